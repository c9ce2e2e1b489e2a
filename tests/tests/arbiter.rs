//! The arbiter with real processes on simgpu: bursts into the same memory wait and then
//! succeed, waits time out cleanly, status shows who waits, a killed holder's memory goes
//! to the waiter, an arbiter restarted under load loses nothing, garbage on the socket
//! leaves it serving, and a request that does not fit is refused at cuInit.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Reply, Request};
use gpufrac_daemon::status::Status;
use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    artifact, bursting_server, compile_c, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess,
    ShimSettings, SimGpu, NOT_GRANTED, TIMEOUT, WAIT_TIMED_OUT,
};

const CHUNK: u64 = 32 * MIB;
/// Why most tests here need simgpu: the device must be full for bursts to collide.
const COLLIDE: &str =
    "the bursts collide on simgpu's 4 GiB device; on a larger real GPU they fit side by side";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `alloc_paths alloc` under the shim, in group `group`, with a 1 GiB request and a
/// 3 GiB limit, allocating up to `upto` bytes.
fn server(gpu: &SimGpu, arbiter: &Arbiter, group: &str, upto: u64, wait: &str) -> ChildProcess {
    server_with(gpu, arbiter, group, upto, wait, "wait", 0)
}

/// `server` with a resolver and a priority, logging at debug.
fn server_with(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    group: &str,
    upto: u64,
    wait: &str,
    resolver: &str,
    priority: i32,
) -> ChildProcess {
    let mut cmd = bursting_server(gpu, arbiter, group, upto, wait, resolver, priority);
    cmd.log("debug");
    ChildProcess::spawn(&mut cmd)
}

fn state_of<'a>(s: &'a Status, group: &str) -> Option<&'a str> {
    s.gpus[0].processes.iter().find(|p| p.group.starts_with(&format!("{group}-"))).map(|p| p.state.as_str())
}

/// A holds 2.5 GiB (1 GiB guaranteed + 1.5 GiB lent); B wants 2 GiB and has to wait.
/// An arbiter that also logs every grant after a wait (at debug: at INFO only waits of a
/// second or more are logged).
fn arbiter_logging_grants(gpu: &SimGpu) -> Arbiter {
    let log = std::ffi::OsStr::new("info,gpufrac_daemon::arbiter::server=debug");
    Arbiter::start_with_env(gpu, gpu.lib_dir().join("arbiter.sock"), &[], &[("GPUFRAC_LOG", log)])
}

/// Whether the arbiter's log shows a burst granted after waiting.
fn granted_after_wait(log: &str) -> bool {
    log.contains("grant after wait") || log.contains("a burst waited")
}

fn collision(gpu: &SimGpu, arbiter: &Arbiter, wait: &str) -> (ChildProcess, ChildProcess) {
    let mut a = server(gpu, arbiter, &unique("a"), 2560 * MIB, "30s");
    let ra = a.ready();
    assert_eq!(ra[0], 2560 * MIB, "A gets its burst\n{}\n{}", a.diagnostics(), arbiter.log_text());
    let b = server(gpu, arbiter, &unique("b"), 2 * GIB, wait);
    (a, b)
}

#[test]
fn a_burst_into_lent_memory_waits_and_succeeds_when_it_is_freed() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = arbiter_logging_grants(&gpu);
    let (mut a, mut b) = collision(&gpu, &arbiter, "30s");
    // B is shown waiting, in the table and in JSON.
    let s = wait_for(&arbiter, "B waiting", |s| state_of(s, "b") == Some("waiting"));
    assert_eq!(s.gpus[0].waiting, 1);
    assert_eq!(s.gpus[0].guaranteed, 2 * GIB);
    let table = status_table(&arbiter);
    assert!(table.contains("waiting") && table.contains("running"), "{table}");
    let json = Command::new(artifact("gpufrac"))
        .args(["status", "--json", "--socket"])
        .arg(arbiter.socket())
        .output()
        .unwrap();
    let parsed: Status = serde_json::from_slice(&json.stdout).expect("status --json is the status document");
    assert_eq!(parsed.gpus.len(), 1);

    // A lets go; B's blocked allocation completes: no out-of-memory.
    a.close_stdin();
    a.finish();
    let rb = b.ready();
    assert_eq!(rb[0], 2 * GIB, "B got all it asked for ({})", mib(rb[0]));
    assert!(granted_after_wait(&arbiter.log_text()), "{}", arbiter.log_text());
    b.close_stdin();
    b.finish();
    let s = wait_for(&arbiter, "everything released", |s| s.gpus[0].processes.is_empty());
    assert_eq!((s.gpus[0].burst, s.gpus[0].guaranteed), (0, 0));
}

/// Process `child`'s whole stderr (it has exited) says its burst was not granted because
/// its wait timed out: the shim's own words.
fn assert_shim_says_wait_timed_out(child: &mut ChildProcess) {
    let stderr = child.stderr_text();
    assert!(stderr.contains(NOT_GRANTED) && stderr.contains(WAIT_TIMED_OUT), "{}", child.diagnostics());
}

#[test]
fn a_wait_times_out_into_a_clean_out_of_memory_error() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // Requests reserve 3 of the 4 GiB: C's 1 GiB (of which it uses 96 MiB), A's and B's.
    // A borrows 576 MiB (its 1.5 GiB and context past its 1 GiB) of the 1 GiB no request
    // reserves. B's burst to 1.5 GiB needs 576 MiB more than its request: more than is
    // left to lend, though the device has about 1.3 GiB free. Only the arbiter's policy
    // makes it wait, and the wait times out.
    let mut c = server(&gpu, &arbiter, &unique("c"), 32 * MIB, "30s");
    assert_eq!(c.ready()[0], 32 * MIB, "{}", c.diagnostics());
    let mut a = server(&gpu, &arbiter, &unique("a"), 1536 * MIB, "30s");
    assert_eq!(a.ready()[0], 1536 * MIB, "A gets its burst\n{}\n{}", a.diagnostics(), arbiter.log_text());
    let mut b = server(&gpu, &arbiter, &unique("b"), 1536 * MIB, "300ms");
    let rb = b.ready();
    assert!(rb[0] < 1536 * MIB, "B stopped at out-of-memory ({})", mib(rb[0]));
    // The device had room for what B wanted: simgpu would not have refused it.
    let s = status(&arbiter);
    let used: u64 = s.gpus[0].processes.iter().map(|p| p.held).sum();
    assert!(s.gpus[0].total - used > 1536 * MIB - rb[0] + 64 * MIB, "room on the device: {s:?}");
    // The arbiter denied it for its timeout, after making it wait that long (its own
    // measure, from when the burst was queued).
    let waited = arbiter.denials(b.pid(), "Timeout");
    assert!(
        !waited.is_empty() && waited.iter().all(|&ms| ms >= 300),
        "B's burst denied after waiting its 300 ms timeout: {waited:?}\n{}",
        arbiter.log_text()
    );
    b.close_stdin();
    b.finish();
    assert_shim_says_wait_timed_out(&mut b);
    for x in [&mut a, &mut c] {
        x.close_stdin();
        x.finish();
    }
}

#[test]
fn a_killed_holders_memory_is_granted_to_the_waiter() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let (mut a, mut b) = collision(&gpu, &arbiter, "30s");
    wait_for(&arbiter, "B waiting", |s| state_of(s, "b") == Some("waiting"));
    a.kill();
    a.wait(TIMEOUT);
    assert_eq!(b.ready()[0], 2 * GIB);
    b.close_stdin();
    b.finish();
}

#[test]
fn an_arbiter_restarted_under_load_loses_no_accounting() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let mut arbiter = Arbiter::start(&gpu);
    let mut a = server(&gpu, &arbiter, &unique("a"), 2560 * MIB, "30s");
    a.ready();
    let before = wait_for(&arbiter, "A registered", |s| state_of(s, "a").is_some());
    let granted = before.gpus[0].processes[0].granted;
    assert!(granted >= 1536 * MIB, "A was lent its burst ({})", mib(granted));
    arbiter.kill();
    let socket = arbiter.socket().to_path_buf();
    let arbiter = Arbiter::start_at(&gpu, socket, &[]);
    let after = wait_for(&arbiter, "A re-registered", |s| state_of(s, "a").is_some());
    let p = &after.gpus[0].processes[0];
    assert_eq!(p.granted, granted, "the grant survives the restart");
    assert_eq!(after.gpus[0].burst, before.gpus[0].burst);
    assert_eq!(after.gpus[0].guaranteed, GIB);
    // And it keeps arbitrating: B waits for what A holds.
    let mut b = server(&gpu, &arbiter, &unique("b"), 2 * GIB, "30s");
    wait_for(&arbiter, "B waiting", |s| state_of(s, "b") == Some("waiting"));
    a.close_stdin();
    a.finish();
    assert_eq!(b.ready()[0], 2 * GIB);
    b.close_stdin();
    b.finish();
}

#[test]
fn a_restarted_arbiter_lends_nothing_a_holder_not_yet_back_still_holds() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let mut arbiter = Arbiter::start(&gpu);
    let mut a = server(&gpu, &arbiter, &unique("a"), 2560 * MIB, "30s");
    a.ready();
    // A is frozen (it cannot reconnect) while the arbiter restarts without it.
    signal(&a, libc::SIGSTOP);
    arbiter.kill();
    let arbiter = Arbiter::start_at(&gpu, arbiter.socket().to_path_buf(), &[]);
    let mut b = server(&gpu, &arbiter, &unique("b"), 2 * GIB, "30s");
    // B's burst waits: A's 2.5 GiB is seen through NVML, not lent to B.
    let s = wait_for(&arbiter, "B waiting", |s| state_of(s, "b") == Some("waiting"));
    assert!(s.gpus[0].outside >= 2560 * MIB, "A's memory counts as outside ({})", mib(s.gpus[0].outside));
    signal(&a, libc::SIGCONT);
    let s = wait_for(&arbiter, "A back", |s| state_of(s, "a") == Some("running"));
    assert_eq!(s.gpus[0].outside, 0, "A's memory is in the ledger again");
    assert_eq!(state_of(&s, "b"), Some("waiting"), "B still waits for what A holds");
    a.close_stdin();
    a.finish();
    assert_eq!(b.ready()[0], 2 * GIB, "B is served once A lets go");
    b.close_stdin();
    b.finish();
}

#[test]
fn memory_held_by_a_program_without_the_shim_is_not_lent() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = arbiter_logging_grants(&gpu);
    // A program the shim is not preloaded into holds 2 GiB.
    let mut outsider =
        ChildProcess::spawn(gpu.command(compile_c("alloc_paths.c", &["MODE_DLSYM"], false)).args([
            "alloc",
            &CHUNK.to_string(),
            &(2 * GIB).to_string(),
        ]));
    assert_eq!(outsider.ready()[0], 2 * GIB);
    let s = wait_for(&arbiter, "the outsider seen", |s| s.gpus[0].outside >= 2 * GIB);
    assert_eq!(s.gpus[0].free, 4 * GIB - s.gpus[0].outside, "nothing of it is offered");
    let table = status_table(&arbiter);
    assert!(table.contains("used by processes outside gpufrac"), "{table}");
    // A's burst to 2 GiB does not fit beside it: A waits instead of being lent memory
    // the device does not have.
    let mut a = server(&gpu, &arbiter, &unique("a"), 2 * GIB, "30s");
    wait_for(&arbiter, "A waiting", |s| state_of(s, "a") == Some("waiting"));
    // (Ended rather than told to finish: its own check that the device got everything
    // back would see A's memory.)
    outsider.kill();
    outsider.wait(TIMEOUT);
    assert_eq!(a.ready()[0], 2 * GIB, "A is served once the outsider is gone");
    assert!(granted_after_wait(&arbiter.log_text()), "{}", arbiter.log_text());
    a.close_stdin();
    a.finish();
}

/// What `gpufrac status` prints.
fn status_table(arbiter: &Arbiter) -> String {
    let out = Command::new(artifact("gpufrac"))
        .arg("status")
        .arg("--socket")
        .arg(arbiter.socket())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn signal(child: &ChildProcess, signal: i32) {
    // SAFETY: signalling our own child, which has not been reaped.
    assert_eq!(unsafe { libc::kill(child.pid() as i32, signal) }, 0);
}

#[test]
fn garbage_on_the_socket_leaves_the_arbiter_serving() {
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut a = server(&gpu, &arbiter, &unique("a"), 1536 * MIB, "30s");
    a.ready();
    for junk in [
        &b"garbage that is no frame"[..],
        &[0xff, 0xff, 0xff, 0xff, 1, 2],
        &[5, 0, 0, 0, 99, 0, 0, 0, 0],
        &[1, 0, 0, 0, 3],
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(arbiter.socket()).unwrap();
        let _ = s.write_all(junk);
        drop(s);
    }
    // An Acquire before Hello is out of order.
    let mut s = std::os::unix::net::UnixStream::connect(arbiter.socket()).unwrap();
    let _ = s.write_all(
        &gpufrac_common::protocol::Request::Acquire {
            seq: 1,
            device: [0; 16],
            bytes: 1,
            preferred: 1,
            held: 0,
            resume: false,
        }
        .encode(),
    );
    drop(s);
    let st = wait_for(&arbiter, "still serving A", |s| state_of(s, "a") == Some("running"));
    assert_eq!(st.gpus[0].guaranteed, GIB);
    assert!(arbiter.log_text().contains("closing connection"), "{}", arbiter.log_text());
    a.close_stdin();
    a.finish();
}

#[test]
fn a_request_that_does_not_fit_is_refused_at_cuinit() {
    skip_on_real_gpu!("a 3.5 GiB request does not fit beside 1 GiB only on simgpu's 4 GiB device");
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut a = server(&gpu, &arbiter, &unique("a"), 512 * MIB, "30s");
    a.ready();
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("3584MiB")
        .arbiter_socket(arbiter.socket())
        .group(unique("big"))
        .args(["alloc", "1048576"]);
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("GPUFRAC_MEMORY_REQUEST") && stderr.contains("does not fit"), "{stderr}");
    assert!(stderr.contains("CUDA_ERROR_NOT_INITIALIZED"), "{stderr}");
    a.close_stdin();
    a.finish();
}

#[test]
fn metrics_are_served_over_http() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    // Port 0: the arbiter binds one the system picks and says which in its log.
    let socket: PathBuf = gpu.lib_dir().join("m.sock");
    let arbiter = Arbiter::start_at(&gpu, socket, &["--metrics", "127.0.0.1:0"]);
    let (mut a, mut b) = collision(&gpu, &arbiter, "30s");
    wait_for(&arbiter, "B waiting", |s| state_of(s, "b") == Some("waiting"));
    a.close_stdin();
    a.finish();
    b.ready();
    let body = arbiter.metrics();
    for needle in [
        "gpufrac_gpu_memory_bytes{",
        "gpufrac_group_memory_bytes{",
        "gpufrac_grants_total{",
        "gpufrac_waits_total{",
        "gpufrac_wait_seconds_bucket{",
    ] {
        assert!(body.contains(needle), "{needle} missing:\n{body}");
    }
    b.close_stdin();
    b.finish();
}

#[test]
fn the_demo_shows_all_three_resolvers_without_out_of_memory() {
    let out =
        Command::new(artifact("gpufrac")).args(["demo", "--steps", "3"]).output().expect("gpufrac demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("servers in act 1:       3"), "{stdout}");
    assert!(stdout.contains("act 1 wait: 9 batches served"), "{stdout}");
    assert!(
        stdout.contains("priority: 1 idle lower-priority holder ended, production served 2 batches"),
        "{stdout}"
    );
    assert!(stdout.contains("1 of 1 kept caches verified intact"), "{stdout}");
    assert!(stdout.contains("kept caches intact:     1 of 1"), "the summary agrees with act 3: {stdout}");
    assert!(!stdout.contains("0 swapped out"), "the swap act swapped: {stdout}");
    assert!(stdout.contains("out-of-memory errors:   0"), "{stdout}");
    assert_eq!(stdout.matches("Verdict: PASS").count(), 3, "each act passed: {stdout}");
    assert!(
        stdout.trim_end().lines().last().is_some_and(|l| l.starts_with("PASS: all three acts")),
        "the run ends with its verdict: {stdout}"
    );
}

fn signal_of(status: std::process::ExitStatus) -> Option<i32> {
    std::os::unix::process::ExitStatusExt::signal(&status)
}

#[test]
fn priority_ends_a_lower_priority_holder_and_serves_the_burst() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("p.sock"), &["--kill-grace", "2s"]);
    let mut a = server_with(&gpu, &arbiter, &unique("low"), 2560 * MIB, "30s", "wait", 0);
    a.ready();
    // B waits 30 s at most: served, it was served by ending A (checked below), not by
    // its wait running out.
    let mut b = server_with(&gpu, &arbiter, &unique("vip"), 2 * GIB, "30s", "priority", 10);
    assert_eq!(b.ready()[0], 2 * GIB, "the priority burst is served");
    let status = a.wait(TIMEOUT);
    assert_eq!(signal_of(status), Some(libc::SIGTERM), "the lower-priority holder was ended with SIGTERM");
    let log = arbiter.log_text();
    assert!(log.contains("terminating a holder") && log.contains("lower priority (0 < 10)"), "{log}");
    b.close_stdin();
    b.finish();
}

#[test]
fn priority_never_ends_a_higher_priority_holder() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut a = server_with(&gpu, &arbiter, &unique("high"), 2560 * MIB, "30s", "wait", 10);
    a.ready();
    let mut b = server_with(&gpu, &arbiter, &unique("low"), 2 * GIB, "1s", "priority", 0);
    assert!(b.ready()[0] < 2 * GIB, "the lower-priority burst waits and times out");
    let waited = arbiter.denials(b.pid(), "Timeout");
    assert!(
        waited.iter().any(|&ms| ms >= 1000),
        "denied after its 1 s wait: {waited:?}\n{}",
        arbiter.log_text()
    );
    assert!(!arbiter.log_text().contains("terminating"), "{}", arbiter.log_text());
    b.close_stdin();
    b.finish();
    assert_shim_says_wait_timed_out(&mut b);
    a.close_stdin();
    a.finish();
}

#[test]
fn priority_ends_an_idle_holder_of_equal_priority() {
    skip_on_real_gpu!(COLLIDE);
    let gpu = gpu();
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("i.sock"),
        &["--idle-timeout", "1s", "--kill-grace", "2s"],
    );
    let mut a = server_with(&gpu, &arbiter, &unique("idle"), 2560 * MIB, "30s", "wait", 0);
    a.ready();
    let mut b = server_with(&gpu, &arbiter, &unique("busy"), 2 * GIB, "30s", "priority", 0);
    assert_eq!(b.ready()[0], 2 * GIB);
    assert_eq!(signal_of(a.wait(TIMEOUT)), Some(libc::SIGTERM));
    assert!(arbiter.log_text().contains("idle for"), "{}", arbiter.log_text());
    b.close_stdin();
    b.finish();
}

#[test]
fn a_missing_socket_folder_is_refused_unless_asked_for() {
    let gpu = gpu();
    let dir = gpu.lib_dir().join("typo").join("dir");
    let socket = dir.join("arb.sock");
    let out = gpu.command(artifact("gpufrac-arbiter")).arg("--socket").arg(&socket).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("{} does not exist", dir.display())), "{stderr}");
    assert!(stderr.contains("--create-socket-dir"), "{stderr}");
    assert!(!dir.exists(), "the folder was created");
    // Asked for, the folder is created and served; sizes in the log are for people.
    let mut child = gpu
        .command(artifact("gpufrac-arbiter"))
        .arg("--socket")
        .arg(&socket)
        .arg("--create-socket-dir")
        .env("GPUFRAC_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "never served {}", socket.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    let log = String::from_utf8_lossy(&child.wait_with_output().unwrap().stderr).into_owned();
    let total = format!("total={}", gpufrac_common::size::format_size(gpu.device_total(0)));
    assert!(log.contains(&total) && log.contains(" GiB quantum="), "{log}");
}

/// A circle of waits that the queue's safety rule did not see coming (here memory used
/// outside gpufrac, in the demo under a loaded CI a burst taken for settled): S waits
/// holding a loan it does not use, R waits holding one it uses. S is refused, and its
/// shim does not turn that into out-of-memory: it gives the unused loan back, R is
/// served with it, and S is served in turn once memory comes back.
#[test]
fn a_circle_of_waits_is_broken_without_out_of_memory() {
    skip_on_real_gpu!("the outsider and the loans fill simgpu's 8 GiB device exactly");
    let gpu = SimGpu::new("8GiB").with_context_overhead("64MiB");
    let started = Instant::now();
    let arbiter = Arbiter::start(&gpu);
    let device = gpufrac_e2e::raw_client::device_id(&arbiter);
    // R, by hand: 1 GiB guaranteed, 512 MiB borrowed and in use.
    let hello = gpufrac_e2e::raw_client::hello(&unique("r"), "", gpufrac_common::Resolver::Wait, 0, 60_000);
    let mut r = gpufrac_e2e::raw_client::RawClient::hello(&arbiter, &hello);
    r.send(&Request::Register {
        device,
        total: 8 * GIB,
        request: GIB,
        limit: 5 * GIB,
        held: 0,
        granted: 0,
        swapped: 0,
    });
    assert!(matches!(r.reply(), Reply::Registered { .. }));
    let (reply, _) = r.acquire(device, 1, 512 * MIB, GIB + 512 * MIB);
    assert!(matches!(reply, Reply::Granted { bytes, .. } if bytes == 512 * MIB), "{reply:?}");
    // S: a 512 MiB model, then a 1.5 GiB batch freed again; its shim keeps a loan for
    // the next (a quarter of what it may borrow: 1 GiB above what it uses).
    let mut s = gpu.shimmed(artifact("simgpu_probe"));
    s.memory_request("1GiB")
        .memory_limit("5GiB")
        .resolver("wait")
        .arbiter_socket(arbiter.socket())
        .group(unique("s"))
        .wait_timeout("60s")
        .args(["hold-bursts", &(512 * MIB).to_string(), &(1536 * MIB).to_string(), "1"]);
    let mut s = ChildProcess::spawn(&mut s);
    s.ready();
    s.write_stdin("free\n");
    s.expect_line(&["FREED"], TIMEOUT);
    // A program without the shim takes all but 384 MiB of what is left to lend.
    let mut outsider =
        ChildProcess::spawn(gpu.command(compile_c("alloc_paths.c", &["MODE_DLSYM"], false)).args([
            "alloc",
            &CHUNK.to_string(),
            &(4608 * MIB).to_string(),
        ]));
    outsider.ready();
    wait_for(&arbiter, "the outsider seen", |s| s.gpus[0].outside >= 4608 * MIB);
    // (Memory outside gpufrac may be shims reconnecting for the arbiter's first seconds.)
    std::thread::sleep(Duration::from_secs(6).saturating_sub(started.elapsed()));
    // S's next batch needs 1 GiB more than it holds, and waits.
    s.write_stdin(&format!("alloc {}\n", 2 * GIB));
    wait_for(&arbiter, "S waiting", |st| state_of(st, "s") == Some("waiting"));
    // R needs 768 MiB more: neither fits, each waits holding a loan. S's is unused: S
    // gives it back, and R is served with it.
    let (reply, _) = r.acquire(device, 2, 768 * MIB, GIB + 512 * MIB);
    assert!(
        matches!(reply, Reply::Granted { .. }),
        "R is served with what S gave back: {reply:?}\n{}\n{}",
        s.diagnostics(),
        arbiter.log_text()
    );
    assert!(s.silent_for(Duration::from_millis(500)), "S still waits: {}", s.diagnostics());
    // Memory comes back: S is served, no out-of-memory error on the way.
    r.send(&Request::Release { device, bytes: 1280 * MIB, held: GIB });
    outsider.kill();
    outsider.wait(TIMEOUT);
    let line = s.expect_line(&["ALLOCATED", "NOT_ALLOCATED"], TIMEOUT);
    assert!(line.starts_with("ALLOCATED"), "{line}\n{}\n{}", s.diagnostics(), arbiter.log_text());
    assert!(arbiter.log_text().contains("a circle of waits broken"), "{}", arbiter.log_text());
    s.close_stdin();
    s.expect_line(&["DONE"], TIMEOUT);
}
