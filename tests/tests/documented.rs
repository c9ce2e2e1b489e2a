//! Behaviours the docs promise, each checked in the words the arbiter and the shim use
//! for it: a guaranteed allocation whose memory is lent out waits for it past a short
//! `GPUFRAC_WAIT_TIMEOUT` (at least 20 s, docs/arbiter.md "Loans taken back");
//! `--reclaim-grace` is the grace borrowers get, not the default; the shim's
//! out-of-memory lines say why (docs/shim.md "When memory is refused"); the arbiter
//! refuses a socket another arbiter serves and removes its own on SIGTERM and SIGINT
//! (docs/interface.md); a pod named by `GPUFRAC_POD` or `gpufrac run --pod` is shown by
//! `gpufrac status` and in the metrics.
//!
//! Every wait is on an event (a line a program prints, a status field, a log line); the
//! only durations asserted are lower bounds read from the arbiter's own log clock.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    artifact, bursting_server, compile_c, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess,
    ShimSettings, SimGpu, TIMEOUT,
};

const CHUNK: u64 = 32 * MIB;
/// Why these tests need simgpu: they fill a 4 GiB device to the byte.
const FULL: &str = "the tests fill simgpu's 4 GiB device to the byte; a real GPU's size differs";
const ENDING: &str = "ending a holder of burst memory for a guarantee";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `alloc_paths alloc` under the shim (group `group`, `request`, `limit`, each burst
/// waiting up to `wait`, the arbiter on `socket`), allocating 32 MiB steps up to `upto`.
fn shimmed(
    gpu: &SimGpu,
    socket: &Path,
    group: &str,
    (request, limit): (&str, &str),
    wait: &str,
    upto: u64,
) -> Command {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request(request)
        .memory_limit(limit)
        .arbiter_socket(socket)
        .group(group)
        .wait_timeout(wait)
        .args(["alloc", &CHUNK.to_string(), &upto.to_string()]);
    cmd
}

/// The borrower: request 512 MiB, limit 3.5 GiB, holding 3 GiB (2.5 GiB of it lent) until
/// its stdin closes. `wrap` may start its command another way (through a shell).
fn borrower(gpu: &SimGpu, arbiter: &Arbiter, wrap: impl FnOnce(Command) -> Command) -> ChildProcess {
    let cmd = shimmed(gpu, arbiter.socket(), &unique("borrower"), ("512MiB", "3584MiB"), "30s", 3 * GIB);
    let mut a = ChildProcess::spawn(&mut wrap(cmd));
    assert_eq!(a.ready()[0], 3 * GIB, "the borrower holds its burst\n{}", arbiter.log_text());
    a
}

/// The guarantee: request and limit 2 GiB, `GPUFRAC_WAIT_TIMEOUT=500ms`, allocating 1.5 GiB
/// where the device has about 0.9 GiB free: the rest is lent to the borrower, and comes
/// back only when the arbiter takes it back.
fn guarantee(gpu: &SimGpu, arbiter: &Arbiter) -> ChildProcess {
    let cmd = shimmed(gpu, arbiter.socket(), &unique("guaranteed"), ("2GiB", "2GiB"), "500ms", 1536 * MIB);
    ChildProcess::spawn(&mut { cmd })
}

/// When the arbiter (or a shim) logged the first line for which `pick` holds, in seconds on
/// the system clock (the RFC 3339 timestamp tracing writes first: `2026-11-27T01:42:16.286662Z`).
fn logged_at(log: &str, what: &str, pick: impl Fn(&str) -> bool) -> f64 {
    let line = log.lines().find(|l| pick(l)).unwrap_or_else(|| panic!("{what} was never logged:\n{log}"));
    let stamp = line.split_whitespace().next().unwrap_or_default();
    let parse = || -> Option<f64> {
        let (date, time) = stamp.strip_suffix('Z')?.split_once('T')?;
        let day: f64 = date.rsplit('-').next()?.parse().ok()?;
        let mut hms = time.split(':');
        let (h, m, s): (f64, f64, f64) =
            (hms.next()?.parse().ok()?, hms.next()?.parse().ok()?, hms.next()?.parse().ok()?);
        // The day of the month is enough: the tests run for minutes, never across a month.
        Some(((day * 24.0 + h) * 60.0 + m) * 60.0 + s)
    };
    parse().unwrap_or_else(|| panic!("no timestamp on the line {line:?}"))
}

/// The guarantee's registration and the borrower's ending, on the arbiter's clock.
fn debt_opened_and_holder_ended(arbiter: &Arbiter, guaranteed: u32, borrower: u32) -> (f64, f64) {
    let log = arbiter.log_text();
    let registered = logged_at(&log, "the guarantee's registration", |l| {
        l.contains(" registered ") && l.contains(&format!("pid={guaranteed} "))
    });
    let ended = logged_at(&log, "the borrower's ending", |l| {
        l.contains(ENDING) && l.contains(&format!("pid={borrower} "))
    });
    (registered, ended)
}

#[test]
fn a_guaranteed_allocation_waits_for_its_lent_memory_past_a_short_wait_timeout() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    // The default graces: borrowers have 5 s to give back, then are ended.
    let arbiter = Arbiter::start(&gpu);
    let mut a = borrower(&gpu, &arbiter, |c| c);
    let mut b = guarantee(&gpu, &arbiter);
    let got = b.ready()[0];
    let stderr = b.stderr_text();
    assert_eq!(got, 1536 * MIB, "the guarantee got all of it ({}):\n{}", mib(got), b.diagnostics());
    assert!(!stderr.contains("out of memory"), "no out-of-memory on the way:\n{stderr}");
    // What it waited for came back only when the borrower was ended, after the grace:
    // well past its 500 ms (the arbiter's own clock says by how much).
    assert_eq!(a.wait(TIMEOUT).signal(), Some(libc::SIGTERM), "the borrower was ended:\n{}", a.diagnostics());
    let (registered, ended) = debt_opened_and_holder_ended(&arbiter, b.pid(), a.pid());
    assert!(
        ended - registered >= 5.0,
        "the borrower had the default 5 s grace: ended {:.3} s after",
        ended - registered
    );
    let s = status(&arbiter);
    assert!(s.gpus[0].repaid_ended > 0, "the debt was paid by ending a holder: {s:?}");
    b.finish();
}

#[test]
fn reclaim_grace_is_the_time_borrowers_have_before_they_are_ended() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    // Longer than the default (5 s), and short enough for the guarantee's 20 s wait.
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("arbiter.sock"), &["--reclaim-grace", "9s"]);
    let mut a = borrower(&gpu, &arbiter, |c| c);
    let mut b = guarantee(&gpu, &arbiter);
    assert_eq!(
        b.ready()[0],
        1536 * MIB,
        "the guarantee is served once the loan is back:\n{}",
        b.diagnostics()
    );
    assert_eq!(a.wait(TIMEOUT).signal(), Some(libc::SIGTERM), "the borrower was ended:\n{}", a.diagnostics());
    let (registered, ended) = debt_opened_and_holder_ended(&arbiter, b.pid(), a.pid());
    assert!(
        ended - registered >= 9.0,
        "the borrower had the 9 s it was given, not the default 5 s: ended {:.3} s after the debt opened\n{}",
        ended - registered,
        arbiter.log_text()
    );
    b.finish();
}

/// The line the shim writes on stderr for an out-of-memory of reason `why`, as
/// docs/shim.md quotes it; panics, with the child's diagnostics, if it is not there.
fn says_burst_not_granted(child: &mut ChildProcess, why: &str) {
    let stderr = child.stderr_text();
    let found = stderr.lines().any(|l| {
        l.split_once("gpufrac: out of memory: a burst of ").is_some_and(|(_, rest)| {
            rest.split_once(" bytes above the request was not granted: ").is_some_and(|(bytes, reason)| {
                bytes.parse::<u64>().is_ok() && reason.split(" ordinal=").next() == Some(why)
            })
        })
    });
    assert!(
        found,
        "no \"a burst of <N> bytes above the request was not granted: {why}\":\n{}",
        child.diagnostics()
    );
}

#[test]
fn a_burst_that_waited_past_its_timeout_says_so() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut a =
        ChildProcess::spawn(&mut bursting_server(&gpu, &arbiter, &unique("a"), 2560 * MIB, "30s", "wait", 0));
    assert_eq!(a.ready()[0], 2560 * MIB);
    let mut b =
        ChildProcess::spawn(&mut bursting_server(&gpu, &arbiter, &unique("b"), 2 * GIB, "300ms", "wait", 0));
    assert!(b.ready()[0] < 2 * GIB, "B's burst is not served");
    says_burst_not_granted(&mut b, "GPUFRAC_WAIT_TIMEOUT passed while the memory was lent to others");
    b.finish();
    a.finish();
}

#[test]
fn a_burst_the_gpu_could_never_lend_says_so() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // 2.5 GiB guaranteed to A: at most 1.5 GiB of the 4 GiB can ever be lent.
    let cmd = shimmed(&gpu, arbiter.socket(), &unique("a"), ("2560MiB", "2560MiB"), "30s", CHUNK);
    let mut a = ChildProcess::spawn(&mut { cmd });
    a.ready();
    // B (request 512 MiB) wants 3 GiB: its bursts are refused once past what can be lent,
    // at once, however long it would wait.
    let cmd = shimmed(&gpu, arbiter.socket(), &unique("b"), ("512MiB", "3GiB"), "1h", 3 * GIB);
    let mut b = ChildProcess::spawn(&mut { cmd });
    assert!(b.ready()[0] < 3 * GIB, "B's burst is not served");
    says_burst_not_granted(&mut b, "the burst is larger than the GPU could ever lend");
    b.finish();
    a.finish();
}

#[test]
fn a_burst_with_no_arbiter_to_answer_says_so() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    let socket = gpu.lib_dir().join("nobody-serves-this.sock");
    let cmd = shimmed(&gpu, &socket, &unique("alone"), ("256MiB", "1GiB"), "300ms", GIB);
    let mut b = ChildProcess::spawn(&mut { cmd });
    assert!(b.ready()[0] < GIB, "no burst without an arbiter");
    says_burst_not_granted(
        &mut b,
        "the arbiter did not answer within GPUFRAC_WAIT_TIMEOUT (it is unreachable)",
    );
    b.finish();
}

#[test]
fn the_limit_reached_is_said_at_debug_and_nothing_at_the_default_level() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    let line = "gpufrac: out of memory: GPUFRAC_MEMORY_LIMIT reached";
    for (log, said) in [("debug", true), ("warn", false)] {
        let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
        cmd.memory_limit("512MiB").log(log).args(["alloc", &CHUNK.to_string()]);
        let mut p = ChildProcess::spawn(&mut cmd);
        assert_eq!(p.ready()[0], 512 * MIB - 64 * MIB, "the limit less the context");
        p.finish();
        let stderr = p.stderr_text();
        assert_eq!(stderr.contains(line), said, "GPUFRAC_LOG={log}:\n{stderr}");
        if !said {
            assert!(!stderr.contains("out of memory"), "GPUFRAC_LOG={log}:\n{stderr}");
        }
    }
}

#[test]
fn memory_owed_that_never_comes_back_fails_after_at_least_20_s_saying_so() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    // The borrower is ended at once but ignores SIGTERM, and SIGKILL comes only after
    // the guarantee's wait is long over: its memory never comes back in time.
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("arbiter.sock"),
        &["--reclaim-grace", "0s", "--kill-grace", "1h"],
    );
    let mut a = borrower(&gpu, &arbiter, |cmd| {
        // An ignored signal stays ignored across exec.
        let mut sh = Command::new("sh");
        sh.arg("-c").arg("trap '' TERM; exec \"$0\" \"$@\"").arg(cmd.get_program()).args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => sh.env(k, v),
                None => sh.env_remove(k),
            };
        }
        sh
    });
    let mut b = guarantee(&gpu, &arbiter);
    let got = b.ready()[0];
    assert!(got < 1536 * MIB, "the guarantee's memory never came back ({})", mib(got));
    let stderr = b.stderr_text();
    let line = "gpufrac: out of memory: the GPU had no memory free within 20s (GPUFRAC_WAIT_TIMEOUT, at least 20s) \
                for memory this group is guaranteed or was granted: guarantees and memory used outside gpufrac fill it";
    assert!(stderr.contains(line), "{line:?} missing:\n{}", b.diagnostics());
    // It waited the 20 s it says: from its registration (the arbiter's log, before any of
    // its allocations) to that line (the shim's own timestamp), both on the system clock.
    let registered = logged_at(&arbiter.log_text(), "the guarantee's registration", |l| {
        l.contains(" registered ") && l.contains(&format!("pid={} ", b.pid()))
    });
    let refused = logged_at(&stderr, "the out-of-memory line", |l| l.contains(line));
    assert!(refused - registered >= 20.0, "refused {:.3} s after registering", refused - registered);
    assert!(arbiter.log_text().contains(ENDING), "the arbiter did end the borrower:\n{}", arbiter.log_text());
    b.finish();
    a.kill();
}

/// A `gpufrac-arbiter` started by the test itself (the harness's [`Arbiter`] stops it
/// only with SIGTERM or SIGKILL), logging to a file.
struct OwnArbiter {
    child: Child,
    log: PathBuf,
}

impl OwnArbiter {
    fn start(gpu: &SimGpu, socket: &Path) -> OwnArbiter {
        let log = socket.with_extension("own.log");
        let child = gpu
            .command(artifact("gpufrac-arbiter"))
            .arg("--socket")
            .arg(socket)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the arbiter's log"))
            .spawn()
            .expect("start gpufrac-arbiter");
        let own = OwnArbiter { child, log };
        let deadline = Instant::now() + TIMEOUT;
        while !own.log_text().contains(" serving ") {
            assert!(Instant::now() < deadline, "the arbiter never served:\n{}", own.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
        own
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` and waits (bounded) for the arbiter to exit.
    fn stop_with(&mut self, signal: libc::c_int) -> std::process::ExitStatus {
        // SAFETY: signalling our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, signal) }, 0);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the arbiter") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the arbiter did not stop on signal {signal}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for OwnArbiter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_arbiter_removes_its_socket_on_sigterm_and_on_sigint() {
    let gpu = gpu();
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let socket = gpu.lib_dir().join(format!("{name}.sock"));
        let mut arbiter = OwnArbiter::start(&gpu, &socket);
        assert!(socket.exists());
        let exit = arbiter.stop_with(signal);
        assert!(exit.success(), "{name}: a clean stop, not {exit:?}:\n{}", arbiter.log_text());
        assert!(arbiter.log_text().contains(" stopped"), "{name}:\n{}", arbiter.log_text());
        assert!(!socket.exists(), "{name}: the socket {} is still there", socket.display());
    }
}

#[test]
fn a_second_arbiter_refuses_the_socket_another_serves_and_leaves_it_alone() {
    let gpu = gpu();
    let first = Arbiter::start(&gpu);
    let inode = std::fs::metadata(first.socket()).expect("the first arbiter's socket").ino();
    let log = first.socket().with_extension("second.log");
    let mut second = gpu
        .command(artifact("gpufrac-arbiter"))
        .arg("--socket")
        .arg(first.socket())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("the second arbiter's log"))
        .spawn()
        .expect("start a second gpufrac-arbiter");
    let deadline = Instant::now() + TIMEOUT;
    let exit = loop {
        if let Some(exit) = second.try_wait().expect("wait for the second arbiter") {
            break exit;
        }
        if Instant::now() >= deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!(
                "the second arbiter is still running:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(exit.code(), Some(1), "the second arbiter exits non-zero:\n{stderr}");
    let said = format!("gpufrac-arbiter: error: another arbiter is serving {}", first.socket().display());
    assert!(stderr.contains(&said), "{said:?} missing:\n{stderr}");
    // The first is untouched: the same socket file, still answering.
    let after = std::fs::metadata(first.socket()).expect("the first arbiter's socket is still there").ino();
    assert_eq!(after, inode, "the socket file was replaced");
    assert!(status(&first).gpus.len() == 1, "the first arbiter still answers");
}

#[test]
fn the_pod_a_process_names_is_shown_by_status_and_in_the_metrics() {
    skip_on_real_gpu!(FULL);
    let gpu = gpu();
    // The arbiter picks the port and says which.
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("arbiter.sock"), &["--metrics", "127.0.0.1:0"]);
    // One named by `gpufrac run --pod`, one by GPUFRAC_POD, one by nothing.
    let (by_flag, by_env, unnamed) = (unique("by-flag"), unique("by-env"), unique("unnamed"));
    let alloc = compile_c("alloc_paths.c", &["MODE_DLSYM"], false);
    let mut cmd = gpu.command(artifact("gpufrac"));
    cmd.args([
        "run",
        "--request",
        "256MiB",
        "--pod",
        "serving/web-0",
        "--group",
        &by_flag,
        "--arbiter-socket",
    ])
    .arg(arbiter.socket())
    .arg("--")
    .arg(&alloc)
    .args(["alloc", &CHUNK.to_string(), &CHUNK.to_string()]);
    let mut flagged = ChildProcess::spawn(&mut cmd);
    let mut cmd = shimmed(&gpu, arbiter.socket(), &by_env, ("256MiB", "256MiB"), "30s", CHUNK);
    cmd.pod("batch/job-7");
    let mut envied = ChildProcess::spawn(&mut cmd);
    let mut plain = ChildProcess::spawn(&mut shimmed(
        &gpu,
        arbiter.socket(),
        &unnamed,
        ("256MiB", "256MiB"),
        "30s",
        CHUNK,
    ));
    for p in [&mut flagged, &mut envied, &mut plain] {
        p.ready();
    }
    let pod_of = |s: &gpufrac_daemon::status::Status, group: &str| {
        s.gpus[0].processes.iter().find(|p| p.group == group).map(|p| p.pod.clone())
    };
    let s = wait_for(&arbiter, "all three registered", |s| {
        [&by_flag, &by_env, &unnamed].iter().all(|g| pod_of(s, g).is_some())
    });
    assert_eq!(pod_of(&s, &by_flag).as_deref(), Some("serving/web-0"));
    assert_eq!(pod_of(&s, &by_env).as_deref(), Some("batch/job-7"));
    assert_eq!(pod_of(&s, &unnamed).as_deref(), Some(""));
    // The table, as a user reads it.
    let out = Command::new(artifact("gpufrac"))
        .args(["status", "--socket"])
        .arg(arbiter.socket())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(table.contains("POD"), "{table}");
    for (group, pod) in [(&by_flag, "serving/web-0"), (&by_env, "batch/job-7"), (&unnamed, "-")] {
        let row = table
            .lines()
            .find(|l| l.contains(group.as_str()))
            .unwrap_or_else(|| panic!("{group} missing:\n{table}"));
        assert!(row.split_whitespace().any(|w| w == pod), "{group}'s row shows {pod}:\n{table}");
    }
    // The metrics: each group's series carry its pod.
    let body = arbiter.metrics();
    for (group, pod) in [(&by_flag, "serving/web-0"), (&by_env, "batch/job-7"), (&unnamed, "")] {
        let series = format!(
            r#"gpufrac_group_memory_bytes{{gpu="{}",group="{group}",workload_pod="{pod}",kind="request"}} {}"#,
            s.gpus[0].uuid,
            256 * MIB
        );
        assert!(body.contains(&series), "{series} missing:\n{body}");
    }
    for p in [&mut flagged, &mut envied, &mut plain] {
        p.finish();
    }
}
