//! simgpu's behaviour as CUDA programs see it, each checked in its own real process:
//! async ordering, VMM data surviving unmap and remap, pool release, and a real
//! `cudarc` client whose data survives copies and kernels.

use std::process::Output;

use gpufrac_e2e::{artifact, skip_on_real_gpu, SimGpu};

/// Why every test here needs simgpu.
const SIMULATOR: &str = "tests the simulator itself (simgpu_probe loads simgpu's built-in kernels)";

fn sim(devices: &str) -> SimGpu {
    SimGpu::new(devices).with_context_overhead("64MiB")
}

fn run(sim: &SimGpu, program: &str, args: &[&str]) -> Output {
    let out = sim.command(program).args(args).output().expect("run program");
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn probe(sim: &SimGpu, what: &str) {
    let out = run(sim, env!("CARGO_BIN_EXE_simgpu_probe"), &[what]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("OK {what}")));
}

#[test]
fn queued_work_runs_later_in_order_and_events_order_streams() {
    skip_on_real_gpu!(SIMULATOR);
    probe(&sim("1GiB"), "async-order");
}

#[test]
fn vmm_data_survives_unmap_release_and_remap_at_the_same_address() {
    skip_on_real_gpu!(SIMULATOR);
    probe(&sim("1GiB"), "vmm-remap");
}

#[test]
fn pools_release_freed_memory_at_synchronize_above_their_threshold() {
    skip_on_real_gpu!(SIMULATOR);
    probe(&sim("1GiB"), "pool-release");
}

#[test]
fn nvml_sees_the_same_devices_usage_and_processes_and_delivers_injected_xids() {
    skip_on_real_gpu!("injects an XID through simgpu_inject_xid, on two simulated devices");
    probe(&sim("1GiB,2GiB"), "nvml");
}

#[test]
fn a_cudarc_client_runs_and_its_data_survives_copies_and_kernels() {
    skip_on_real_gpu!(SIMULATOR);
    let sim = sim("2GiB");
    let server = artifact("sample-inference-server");
    let out = run(
        &sim,
        server.to_str().expect("utf-8 path"),
        &["--name", "t", "--model", "64MiB", "--batches", "16MiB,32MiB,4GiB", "--steps", "3"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The model and two batches fit; the 4 GiB batch is a clean out-of-memory error.
    assert!(stdout.contains("t started device=0 total=2147483648"), "{stdout}");
    assert!(stdout.contains("t model-loaded bytes=67108864"), "{stdout}");
    assert!(stdout.contains("t out-of-memory batch=2 bytes=4294967296"), "{stdout}");
    assert!(stdout.contains("t done served=2 out-of-memory=1"), "{stdout}");
}

#[test]
fn a_bad_setting_fails_cuinit_naming_the_variable() {
    skip_on_real_gpu!("SIMGPU_DEVICES is simgpu's setting");
    let sim = SimGpu::new("lots");
    let out = sim.command(env!("CARGO_BIN_EXE_simgpu_probe")).arg("async-order").output().expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("SIMGPU_DEVICES") && stderr.contains("lots"), "{stderr}");
    assert!(stderr.contains("CUDA_ERROR_NOT_INITIALIZED") || stderr.contains("cuInit"), "{stderr}");
}
