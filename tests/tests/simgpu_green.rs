//! The simulated GPU's green contexts (CUDA 12.4+) take device memory as contexts do: a
//! green context takes `SIMGPU_CONTEXT_OVERHEAD` (counted in the process's usage, refused
//! with `CUDA_ERROR_OUT_OF_MEMORY` when the device has not that much free) and gives it
//! back at `cuGreenCtxDestroy`; its `CUcontext` can be made current and allocated in.
//!
//! Runs `tests/c/green_ctx.c` on a private 1 GiB device with 64 MiB contexts.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_green`.

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

const OVERHEAD: u64 = 64 * MIB;
const SIMULATOR: &str = "reads what the process holds from simgpu's device state (SIMGPU_STATE)";

#[test]
fn a_green_context_takes_a_contexts_memory_and_gives_it_back() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("1GiB").with_context_overhead("64MiB");
    let mut child = ChildProcess::spawn(&mut gpu.command(compile_c("green_ctx.c", &[], true)));
    let split = child.expect_line(&["SPLIT"], TIMEOUT);
    assert_eq!(split, "SPLIT 132 4 16 68", "132 SMs split in 4 groups of 16, 68 left");
    assert_eq!(child.expect_line(&["CREATED"], TIMEOUT), "CREATED 16 16", "the green context has its 16 SMs");
    child.expect_line(&["READY"], TIMEOUT);
    let held = gpu.listed_holding(child.pid(), 0);
    assert_eq!(
        held,
        Some(OVERHEAD + MIB),
        "the green context's memory and the allocation in it, got {held:?}"
    );

    child.write_stdin("destroy\n");
    let destroyed = child.expect_line(&["DESTROYED"], TIMEOUT);
    assert_eq!(destroyed, "DESTROYED 201", "its CUcontext is gone: CUDA_ERROR_INVALID_CONTEXT");
    let held = gpu.listed_holding(child.pid(), 0);
    assert_eq!(held, None, "destroyed, it gives everything back and NVML lists the process no more");
    child.close_stdin();
    child.expect_line(&["DONE"], TIMEOUT);
    child.expect_exit_code(0);
}

#[test]
fn a_green_context_that_does_not_fit_is_refused() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("1GiB").with_context_overhead("64MiB");
    let mut cmd = gpu.command(compile_c("green_ctx.c", &[], true));
    cmd.arg("fill");
    let mut child = ChildProcess::spawn(&mut cmd);
    let line = child.expect_line(&["FILLED"], TIMEOUT);
    let fields: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().expect("a number")).collect();
    assert_eq!(fields, [GIB / OVERHEAD, 2], "16 of 64 MiB fill 1 GiB; the 17th: CUDA_ERROR_OUT_OF_MEMORY");
    child.expect_line(&["DONE"], TIMEOUT);
    child.expect_exit_code(0);
    let held = gpu.listed_holding(child.pid(), 0);
    assert!(held.is_none(), "all given back, got {:?}", held.map(mib));
}
