//! The arbiter's backstop on simgpu: a process under the shim allocates within its limit
//! through the shim, then allocates more through a private copy of simgpu's driver
//! (`dlmopen` into a namespace of its own, symbols from glibc's own `dlsym`), which the
//! shim never sees. The device's count (NVML, by PID) shows it; the arbiter charges the
//! excess to the process's group (`gpufrac status --json`: `uncounted`), a burst of
//! another group sees the room gone, and with `--enforce-limits end` the process is ended
//! and the log says why.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use gpufrac_daemon::status::Status;
use gpufrac_e2e::size::MIB;
use gpufrac_e2e::{
    artifact, bursting_server, compile_c, skip_on_real_gpu, unique, wait_for, Arbiter, ChildProcess,
    ShimSettings, SimGpu, SIMGPU_CUDA, TIMEOUT,
};

/// Why these tests need simgpu: the private copy of the driver is simgpu's.
const PRIVATE: &str = "the private copy of the driver the test loads is simgpu's";

/// What the escaping process allocates through the shim, then through its private driver.
const COUNTED: u64 = 512 * MIB;
const PRIVATE_BYTES: u64 = 1536 * MIB;
/// simgpu's context here: the private copy makes one of its own, uncounted too.
const CONTEXT: u64 = 64 * MIB;

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `private_driver` under the shim in group `group` (request = limit = 1 GiB).
fn escaper(gpu: &SimGpu, arbiter: &Arbiter, group: &str) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("private_driver.c", &[], false));
    cmd.memory_request("1GiB")
        .arbiter_socket(arbiter.socket())
        .group(group)
        .arg(artifact(SIMGPU_CUDA))
        .arg(COUNTED.to_string())
        .arg(PRIVATE_BYTES.to_string());
    let mut child = ChildProcess::spawn(&mut cmd);
    child.expect_line(&["SHIM"], TIMEOUT);
    child
}

/// `gpufrac status --json`, parsed.
fn status_json(arbiter: &Arbiter) -> Status {
    let out = Command::new(artifact("gpufrac"))
        .args(["status", "--json", "--socket"])
        .arg(arbiter.socket())
        .output()
        .expect("run gpufrac status");
    assert!(out.status.success(), "gpufrac status: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("status --json is the status document")
}

/// The `uncounted` bytes `gpufrac status --json` shows for `group`'s process.
fn uncounted(s: &Status, group: &str) -> Option<u64> {
    s.gpus[0].processes.iter().find(|p| p.group == group).map(|p| p.uncounted)
}

/// Polls `gpufrac status --json` until `group` is shown with memory uncounted; fails after
/// [`TIMEOUT`].
fn wait_uncounted(arbiter: &Arbiter, group: &str) -> Status {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let s = status_json(arbiter);
        if uncounted(&s, group).is_some_and(|b| b > 0) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{group} never shown with memory uncounted: {s:?}\n{}",
            arbiter.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn memory_taken_past_the_shim_is_charged_to_the_group_and_others_see_the_room_gone() {
    skip_on_real_gpu!(PRIVATE);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // A group reserving 1 GiB it does not use: the room a burst could be lent if the
    // escape went unseen.
    let idle = unique("idle");
    let mut reserve =
        ChildProcess::spawn(&mut bursting_server(&gpu, &arbiter, &idle, 32 * MIB, "1s", "wait", 0));
    reserve.ready();
    let group = unique("escaper");
    let mut a = escaper(&gpu, &arbiter, &group);
    a.expect_line(&["READY"], TIMEOUT);

    let s = wait_uncounted(&arbiter, &group);
    // Its request (1 GiB) is what its shim may have charged; the device shows the
    // allocation through the shim and its context, the private allocation and the private
    // copy's context.
    let used = COUNTED + CONTEXT + PRIVATE_BYTES + CONTEXT;
    assert_eq!(uncounted(&s, &group), Some(used - 1024 * MIB), "{s:?}");
    let g = &s.gpus[0];
    assert_eq!(g.uncounted, used - 1024 * MIB);
    assert_eq!(g.outside, 0, "charged to the group, not taken for memory outside gpufrac: {g:?}");
    assert_eq!(g.free, 4096 * MIB - 2048 * MIB - g.uncounted, "{g:?}");
    let log = arbiter.log_text();
    assert_eq!(log.matches("beyond what its shims counted").count(), 1, "logged once:\n{log}");
    assert!(log.contains(&format!("group {group} holds")) && log.contains("WARN"), "{log}");
    assert!(status_table(&arbiter).contains("uncounted"), "shown in the table too");

    // Another group bursts: 1.5 GiB past a 512 MiB request would fit on the device (it has
    // 4096 - 2240 - 64 MiB free), and in the ledger had the escape gone unseen (4 GiB less
    // 2.5 GiB of requests), but not beside what the escaper holds uncounted.
    let mut b = bursting_server(&gpu, &arbiter, &unique("b"), 1536 * MIB, "1s", "wait", 0);
    b.memory_request("512MiB").memory_limit("2GiB");
    let mut b = ChildProcess::spawn(&mut b);
    let held = b.ready()[0];
    let room = 4096 * MIB - 2560 * MIB - (used - 1024 * MIB);
    assert!(
        held <= 512 * MIB - CONTEXT + room,
        "the burst got {} MiB: the room held uncounted was lent\n{}",
        held / MIB,
        arbiter.log_text()
    );
    b.finish();

    // In `count` mode the escaper is charged, not ended.
    assert!(a.silent_for(Duration::from_millis(500)), "still running");
    a.finish();
    reserve.finish();
}

#[test]
fn with_enforce_limits_end_a_group_past_its_limit_is_ended() {
    skip_on_real_gpu!(PRIVATE);
    let gpu = gpu();
    let socket = gpu.lib_dir().join("arbiter.sock");
    let arbiter = Arbiter::start_at(&gpu, socket, &["--enforce-limits", "end", "--enforce-grace", "1s"]);
    let group = unique("escaper");
    let mut a = escaper(&gpu, &arbiter, &group);
    a.expect_line(&["READY"], TIMEOUT);
    wait_uncounted(&arbiter, &group);
    a.wait_terminated(TIMEOUT);
    let status = a.wait(TIMEOUT);
    assert_eq!(status.signal(), Some(libc::SIGTERM), "ended by the arbiter: {status:?}");
    let log = arbiter.log_text();
    assert!(
        log.contains("--enforce-limits end: ending a process of a group past its limit")
            && log.contains(&format!("pid={}", a.pid())),
        "{log}"
    );
    // Its memory (the private copy's too) went with it.
    wait_for(&arbiter, "the escaper gone", |s| s.gpus[0].processes.is_empty() && s.gpus[0].uncounted == 0);
}

#[test]
fn a_bad_enforce_limits_is_refused_naming_the_flag() {
    let out = Command::new(artifact("gpufrac-arbiter"))
        .args(["--socket", "/nonexistent/arbiter.sock", "--enforce-limits", "kill"])
        .output()
        .expect("run gpufrac-arbiter");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--enforce-limits \"kill\": expected count or end"), "{err}");
    let out = Command::new(artifact("gpufrac-arbiter"))
        .args(["--socket", "/nonexistent/arbiter.sock", "--enforce-grace", "soon"])
        .output()
        .expect("run gpufrac-arbiter");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--enforce-grace"), "{out:?}");
}

/// `gpufrac status`'s table.
fn status_table(arbiter: &Arbiter) -> String {
    let out = Command::new(artifact("gpufrac"))
        .args(["status", "--socket"])
        .arg(arbiter.socket())
        .output()
        .expect("run gpufrac status");
    String::from_utf8_lossy(&out.stdout).into_owned()
}
