//! The promise holds in every run, not only in a good one: contended traces played several
//! rounds on one arbiter, every server of a round started at the same moment, once with
//! busy loops competing for the CPU. Sized for CI's two cores; the benchmarks run the full
//! traces (README, "Benchmarks").

use std::process::Command;

use gpufrac_e2e::{artifact, skip_on_real_gpu};

const WHY: &str = "the benchmarks drive simgpu's GPU sizes and context overhead";

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(artifact(program)).args(args).output().expect("run the benchmark");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{program} {args:?} broke the promise:\n{stdout}\n{stderr}");
    stdout
}

#[test]
fn colliding_bursts_are_served_in_turn_round_after_round_on_a_busy_cpu() {
    skip_on_real_gpu!(WHY);
    // 4 servers (request 1 GiB, limit 3.6 GiB) on 8 GiB: every burst of 3 GiB collides.
    let out = run(
        "density_bench",
        &["--only", "wait", "--servers", "4", "--device", "8GiB", "--bursts", "3", "--rounds", "3"],
    );
    assert!(out.contains("3 of 3 rounds held"), "{out}");
    assert!(out.contains("| wait | 4 | 36 / 36 | 0 |"), "every burst served, none out of memory:\n{out}");
    // The same with contexts of 0 bytes and two busy loops on the CPU.
    let out = run(
        "density_bench",
        &[
            "--only",
            "wait",
            "--servers",
            "4",
            "--device",
            "8GiB",
            "--bursts",
            "3",
            "--rounds",
            "2",
            "--context",
            "0",
            "--busy",
            "2",
            "--check",
        ],
    );
    assert!(out.contains("2 of 2 rounds held"), "{out}");
}

#[test]
fn churning_processes_half_of_them_killed_leave_nothing_behind_run_after_run() {
    skip_on_real_gpu!(WHY);
    let out = run("churn_load", &["--processes", "16", "--runs", "2", "--seconds", "3", "--device", "8GiB"]);
    assert!(out.contains("2 of 2 runs held the promise"), "{out}");
    assert!(out.contains("12 of 12 survivors exited cleanly"), "{out}");
}
