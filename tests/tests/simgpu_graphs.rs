//! The simulated GPU captures streams into CUDA graphs and keeps a graph memory pool as
//! the real driver does: memory a launched graph allocated and freed stays held by the
//! process (seen by the device's own per-process figure) until `cuDeviceGraphMemTrim`;
//! a synchronizing call during a capture fails and breaks the capture.
//!
//! Runs `tests/c/graph_pool.c` on a private 4 GiB device with 64 MiB contexts.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_graphs`.

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

const DEVICE: u64 = 4 * GIB;
const OVERHEAD: u64 = 64 * MIB;
/// The captured allocation.
const GRAPH_BYTES: u64 = 256 * MIB;
/// The program's own `cuMemAlloc(8)`, as simgpu charges it (512-byte granules), and its
/// module of built-in kernels (`SIMGPU_MODULE_BYTES`, 2 MiB by default).
const SMALL: u64 = 512 + 2 * MIB;
const SIMULATOR: &str = "reads what the process holds from simgpu's device state (SIMGPU_STATE)";

/// The numbers after the first word of the next line starting with `word`.
fn numbers(child: &mut ChildProcess, word: &str) -> Vec<u64> {
    let line = child.expect_line(&[word], TIMEOUT);
    line.split_whitespace().skip(1).map(|v| v.parse().expect("a number")).collect()
}

#[test]
fn graph_memory_stays_with_the_process_until_trimmed() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let mut cmd = gpu.command(compile_c("graph_pool.c", &[], true));
    cmd.arg("pool").arg(GRAPH_BYTES.to_string());
    let mut child = ChildProcess::spawn(&mut cmd);
    let pid = child.pid();

    let captured = numbers(&mut child, "CAPTURED");
    assert_eq!(captured[0], 0, "capturing and instantiating reserves nothing in the graph pool");
    assert_eq!(captured[1], DEVICE - OVERHEAD - SMALL, "before a launch the graph takes no device memory");

    let launched = numbers(&mut child, "LAUNCHED");
    assert_eq!(launched[0], GRAPH_BYTES, "the pool keeps the launched graph's allocation reserved");
    assert_eq!(launched[1], 0, "the graph freed its allocation: nothing in use");
    assert_eq!(launched[2], DEVICE - OVERHEAD - SMALL - GRAPH_BYTES, "cuMemGetInfo counts the pool");

    let relaunched = numbers(&mut child, "RELAUNCHED");
    assert_eq!(relaunched, [GRAPH_BYTES, GRAPH_BYTES], "a second launch reuses the pool's memory");
    let held = gpu.held_by(pid, 0);
    assert_eq!(
        held,
        OVERHEAD + SMALL + GRAPH_BYTES,
        "after the launches completed the device counts the pool for the process, got {}",
        mib(held)
    );

    child.write_stdin("trim\n");
    let trimmed = numbers(&mut child, "TRIMMED");
    assert_eq!(trimmed[0], 0, "cuDeviceGraphMemTrim gives the unused reservation back");
    assert_eq!(trimmed[1], DEVICE - OVERHEAD - SMALL, "the device has the memory back");
    assert_eq!(trimmed[2], 0, "the reserved high-water mark resets to the current value");
    let held = gpu.held_by(pid, 0);
    assert_eq!(
        held,
        OVERHEAD + SMALL,
        "after the trim the process holds its context only, got {}",
        mib(held)
    );

    child.close_stdin();
    child.expect_line(&["DONE"], TIMEOUT);
    child.expect_exit_code(0);
}

#[test]
fn synchronizing_during_a_capture_fails_and_invalidates_it() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let mut cmd = gpu.command(compile_c("graph_pool.c", &[], true));
    cmd.arg("ctxsync");
    let mut child = ChildProcess::spawn(&mut cmd);
    let sync = numbers(&mut child, "CTXSYNC");
    // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CU_STREAM_CAPTURE_STATUS_INVALIDATED,
    // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and no graph.
    assert_eq!(sync, [900, 2, 901, 1], "cuCtxSynchronize during a capture");
    let malloc = numbers(&mut child, "MALLOC");
    assert_eq!(
        malloc,
        [900, 0],
        "cuMemAlloc is refused during a GLOBAL capture, allowed to a RELAXED thread"
    );
    // RELAXED lets a thread make unsafe calls, not synchronize a context that captures.
    let relaxed = numbers(&mut child, "RELAXEDSYNC");
    assert_eq!(relaxed, [900, 901], "cuCtxSynchronize from a RELAXED thread during a capture");
    // The legacy stream encompasses a capturing blocking stream
    // (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the capture invalidated), not a non-blocking
    // one, whose captured kernel then launches as a graph.
    let legacy = numbers(&mut child, "LEGACY");
    assert_eq!(legacy, [906, 901, 0, 0, 0], "the legacy stream synchronized during captures");
    child.expect_exit_code(0);
}
