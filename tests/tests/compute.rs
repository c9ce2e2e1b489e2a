//! Compute shares, with real processes on simgpu (whose GPU time-slices kernels of
//! different processes, docs/simgpu.md): two groups saturating one GPU split its time by
//! their compute requests; a group alone uses up to its limit; requests past the GPU
//! and compute settings without an arbiter are refused naming the variable; groups
//! without compute settings are left to the GPU's own time-slicing.
//!
//! Shares are measured by the workloads themselves (`compute_load`: kernels run times
//! the device time each needs, over the wall time), not by what the arbiter believes.
//! Shares are judged relative to what the same run measured (the two groups' parts of
//! the time they got together; a group alone against a bare flood alone), so that a busy
//! machine, whose CPUs take wall time from every flood alike, does not move the verdict.

use std::time::Duration;

use gpufrac_e2e::{
    artifact, skip_on_real_gpu, unique, wait_for, Arbiter, ChildProcess, ShimSettings, SimGpu,
};

const KERNEL_US: u64 = 1000;
const SIMGPU_KERNELS: &str = "compute_load runs simgpu's built-in sleep kernel";

/// One test at a time: shares are measured on a machine whose CPUs the simulated GPUs
/// of other tests would take.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> (std::sync::MutexGuard<'static, ()>, SimGpu) {
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    (turn, SimGpu::new("16GiB").with_context_overhead("64MiB"))
}

/// A flood of 1 ms kernels, shimmed with `share` (request, limit) unless `None` (memory
/// settings only), measured for `seconds` after `warmup`; waits for its `ready`.
fn flood(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    share: Option<(&str, &str)>,
    warmup: u32,
    seconds: u32,
) -> ChildProcess {
    let mut cmd = gpu.shimmed(artifact("compute_load"));
    cmd.args(["flood", "--kernel-us", &KERNEL_US.to_string(), "--depth", "16"])
        .args(["--warmup", &warmup.to_string(), "--seconds", &seconds.to_string()])
        .memory_request("512MiB")
        .arbiter_socket(arbiter.socket())
        .group(unique("compute"));
    if let Some((request, limit)) = share {
        cmd.compute_request(request).compute_limit(limit);
    }
    let mut child = ChildProcess::spawn(&mut cmd);
    child.expect_line(&["ready"], Duration::from_secs(30));
    child
}

/// Starts every flood's measured part together; returns each one's share of the GPU.
fn shares(mut floods: Vec<ChildProcess>) -> Vec<f64> {
    go(&mut floods);
    measured(&mut floods)
}

fn go(floods: &mut [ChildProcess]) {
    for f in floods {
        f.write_stdin("go\n");
    }
}

/// Each flood's share of the GPU over its measured seconds, once it ends.
fn measured(floods: &mut [ChildProcess]) -> Vec<f64> {
    floods
        .iter_mut()
        .map(|f| {
            let line = f.expect_line(&["report"], Duration::from_secs(120));
            f.expect_exit_code(0);
            let report: serde_json::Value = serde_json::from_str(line.trim_start_matches("report ")).unwrap();
            let kernels = report["kernels"].as_f64().unwrap();
            kernels * KERNEL_US as f64 / 1e6 / report["wall_s"].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn two_saturating_groups_split_the_gpu_by_their_compute_requests() {
    skip_on_real_gpu!(SIMGPU_KERNELS);
    let (_turn, gpu) = gpu();
    let arbiter = Arbiter::start(&gpu);
    let small = flood(&gpu, &arbiter, Some(("30%", "100%")), 3, 5);
    let large = flood(&gpu, &arbiter, Some(("70%", "100%")), 3, 5);
    // While they run, the group past its request is shown paced.
    let mut both = vec![small, large];
    go(&mut both);
    let status = wait_for(&arbiter, "the 30% group paced", |s| {
        s.gpus[0].processes.iter().any(|p| p.compute_request_pm == 300 && p.compute_pace_pm < 1000)
    });
    let gpu_status = &status.gpus[0];
    assert_eq!(gpu_status.compute_requested_pm, 1000);
    let large_status = gpu_status.processes.iter().find(|p| p.compute_request_pm == 700).unwrap();
    assert_eq!((large_status.compute_limit_pm, large_status.compute_allowance_pm), (1000, 700));
    let got = measured(&mut both);
    // Each group's part of the time the two got together: a busy machine's CPUs take
    // wall time from both alike, not from one group's part (time-slicing alone splits
    // it 50/50, which this excludes).
    let split = got[0] / (got[0] + got[1]);
    assert!(
        (split - 0.3).abs() <= 0.1,
        "the 30% group got {:.1}% of the time they got together ({:.1}% and {:.1}% of the wall time)",
        split * 100.0,
        got[0] * 100.0,
        got[1] * 100.0
    );
    let log = arbiter.log_text();
    assert!(log.contains("pacing a group past its compute allowance"), "{log}");
}

#[test]
fn a_group_alone_uses_the_gpu_up_to_its_compute_limit() {
    skip_on_real_gpu!(SIMGPU_KERNELS);
    let (_turn, gpu) = gpu();
    let arbiter = Arbiter::start(&gpu);
    // What a flood without compute settings gets alone in this run: the most this
    // machine, as busy as it is now, lets a flood have.
    let bare = shares(vec![flood(&gpu, &arbiter, None, 1, 3)]);
    let whole = shares(vec![flood(&gpu, &arbiter, Some(("30%", "100%")), 1, 3)]);
    assert!(
        whole[0] >= 0.85 * bare[0],
        "alone with a limit of 100% it got {:.1}%, a bare flood {:.1}%",
        whole[0] * 100.0,
        bare[0] * 100.0
    );
    let capped = shares(vec![flood(&gpu, &arbiter, Some(("20%", "60%")), 3, 4)]);
    let part = capped[0] / bare[0];
    assert!(
        (part - 0.6).abs() <= 0.12,
        "alone with a limit of 60% it got {:.1}% of what a bare flood got ({:.1}% and {:.1}%)",
        part * 100.0,
        capped[0] * 100.0,
        bare[0] * 100.0
    );
}

#[test]
fn groups_without_compute_settings_share_the_gpu_as_its_time_slicing_does() {
    skip_on_real_gpu!(SIMGPU_KERNELS);
    let (_turn, gpu) = gpu();
    let arbiter = Arbiter::start(&gpu);
    let got = shares(vec![flood(&gpu, &arbiter, None, 1, 3), flood(&gpu, &arbiter, None, 1, 3)]);
    let split = got[0] / (got[0] + got[1]);
    assert!(
        (split - 0.5).abs() <= 0.1,
        "the first got {:.1}% of the time they got together: {got:?}",
        split * 100.0
    );
    let status = gpufrac_e2e::status(&arbiter);
    assert_eq!(status.gpus[0].compute_requested_pm, 0);
}

#[test]
fn compute_requests_past_the_gpu_and_shares_without_an_arbiter_are_refused_naming_the_variable() {
    skip_on_real_gpu!(SIMGPU_KERNELS);
    let (_turn, gpu) = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut first = flood(&gpu, &arbiter, Some(("60%", "100%")), 0, 30);
    let mut cmd = gpu.shimmed(artifact("compute_load"));
    cmd.args(["flood", "--kernel-us", "1000", "--seconds", "1", "--now"])
        .memory_request("512MiB")
        .arbiter_socket(arbiter.socket())
        .group(unique("compute"))
        .compute_request("50%");
    let mut refused = ChildProcess::spawn(&mut cmd);
    refused.expect_exit_code(1);
    let text = refused.stderr_text();
    assert!(text.contains("GPUFRAC_COMPUTE_REQUEST (50%) does not fit") && text.contains("60%"), "{text}");
    first.kill();

    let mut cmd = gpu.shimmed(artifact("compute_load"));
    cmd.args(["flood", "--kernel-us", "1000", "--seconds", "1", "--now"])
        .memory_request("512MiB")
        .compute_limit("50%");
    let mut alone = ChildProcess::spawn(&mut cmd);
    alone.expect_exit_code(1);
    let text = alone.stderr_text();
    assert!(text.contains("GPUFRAC_COMPUTE_LIMIT") && text.contains("GPUFRAC_ARBITER_SOCKET"), "{text}");
}
