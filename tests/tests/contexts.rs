//! Real contexts: a context is part of every request. The arbiter learns what a context
//! takes on a GPU from the first clean measurement a shim reports (believed once NVML
//! shows it) and tells every shim at registration; a request smaller than that is
//! warned about, naming both numbers, by the arbiter and the shim; and a context is never
//! refused on a guess: a small request on a GPU full of guarantees still makes its context.
//! Real processes on simgpu (`tests/c/escapes.c`) with an arbiter.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test contexts`.

use std::process::Command;
use std::time::{Duration, Instant};

use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, Arbiter, ChildProcess, ShimSettings, SimGpu, TIMEOUT};

const SIMULATED: &str = "sizes simgpu's 64 MiB contexts on its 4 GiB device";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `escapes CASE 16MiB [ARG]` under the shim with `request`, `limit` and the arbiter.
fn shimmed(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    case: &str,
    arg: Option<&str>,
    request: &str,
    limit: &str,
) -> Command {
    let mut cmd = gpu.shimmed(compile_c("escapes.c", &[], false));
    cmd.arg(case).arg((16 * MIB).to_string());
    if let Some(arg) = arg {
        cmd.arg(arg);
    }
    cmd.memory_request(request).memory_limit(limit).wait_timeout("1s").arbiter_socket(arbiter.socket());
    cmd
}

fn numbers(child: &mut ChildProcess, word: &str) -> Vec<i64> {
    let line = child.expect_line(&[word], TIMEOUT);
    line.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect()
}

/// Waits until the arbiter's log contains `text`.
fn logged(arbiter: &Arbiter, text: &str) -> String {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let log = arbiter.log_text();
        if log.contains(text) {
            return log;
        }
        assert!(Instant::now() < deadline, "the arbiter never logged {text:?}:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_arbiter_learns_a_gpus_context_and_warns_of_a_request_smaller_than_it() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // A makes one context (64 MiB on this GPU) and holds its memory.
    let mut a = ChildProcess::spawn(&mut shimmed(&gpu, &arbiter, "contexts", Some("1"), "256MiB", "256MiB"));
    assert_eq!(numbers(&mut a, "CONTEXTS"), vec![1, 0]);
    numbers(&mut a, "HELD");
    let log = logged(&arbiter, "learnt what a context takes on this GPU");
    assert!(log.contains(&format!("bytes={}", 64 * MIB)), "the measured 64 MiB is learnt:\n{log}");
    // B asks for less than a context: both the arbiter and B's shim say so, with both
    // numbers; B still makes its context (the part above its request is lent).
    let mut b = ChildProcess::spawn(&mut shimmed(&gpu, &arbiter, "contexts", Some("1"), "32MiB", "512MiB"));
    assert_eq!(numbers(&mut b, "CONTEXTS"), vec![1, 0], "B's context is made\n{}", b.diagnostics());
    numbers(&mut b, "HELD");
    let log = logged(&arbiter, "is smaller than a context on this GPU");
    assert!(log.contains("32.00 MiB") && log.contains("64.00 MiB"), "the arbiter names both:\n{log}");
    for child in [&mut a, &mut b] {
        child.close_stdin();
        child.expect_exit_code(0);
    }
    // Read once B is gone: its stderr is then all collected.
    let stderr = b.stderr_text();
    assert!(
        stderr.contains("smaller than a context on this GPU")
            && stderr.contains(&(32 * MIB).to_string())
            && stderr.contains(&(64 * MIB).to_string()),
        "B's shim says so too:\n{stderr}"
    );
}

#[test]
fn a_small_request_makes_its_context_on_a_gpu_full_of_guarantees() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // A is guaranteed 3900 MiB of the 4 GiB: beside B's 128 MiB, 68 MiB are left to lend.
    let mut a =
        ChildProcess::spawn(&mut shimmed(&gpu, &arbiter, "contexts", Some("1"), "3900MiB", "3900MiB"));
    assert_eq!(numbers(&mut a, "CONTEXTS"), vec![1, 0]);
    // B, the first on this GPU to make a context in its group, is guaranteed 128 MiB: its
    // context (64 MiB) fits in it, and must not wait for a loan on a guess of its size.
    let started = Instant::now();
    let mut b = ChildProcess::spawn(&mut shimmed(&gpu, &arbiter, "contexts", Some("1"), "128MiB", "1GiB"));
    assert_eq!(numbers(&mut b, "CONTEXTS"), vec![1, 0], "B's context is made\n{}", b.diagnostics());
    let held = numbers(&mut b, "HELD");
    assert!(
        held[0] as u64 >= 64 * MIB - 16 * MIB,
        "B gets the rest of its request beside its context: held {}",
        mib(held[0] as u64)
    );
    assert!(started.elapsed() < Duration::from_secs(20), "no wait on a loan that cannot come");
    for mut child in [a, b] {
        child.close_stdin();
        child.expect_exit_code(0);
    }
}
