//! CUDA graphs under the shim: the memory a graph's allocation nodes take from the
//! device's graph pool (and the pool keeps after the graph ran) is charged to the group,
//! and a graph whose allocations cannot fit under the limit is refused when instantiated.
//! Runs `tests/c/graph_pool.c` (a captured cuMemAllocAsync + kernels + cuMemFreeAsync, as
//! PyTorch's cudaMallocAsync backend with CUDA graphs does) under the shim on simgpu.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test shim_graphs`.

use std::time::Duration;

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, ShimSettings, SimGpu};

const LIMIT: u64 = 512 * MIB;
const CONTEXT: u64 = 64 * MIB;
const SIMULATED: &str = "sizes a 4 GiB simulated device with 64 MiB contexts";

fn start(gpu: &SimGpu, bytes: u64) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("graph_pool.c", &[], true));
    cmd.arg("pool").arg(bytes.to_string()).memory_request("256MiB").memory_limit(LIMIT.to_string());
    ChildProcess::spawn(&mut cmd)
}

fn numbers(child: &mut ChildProcess, word: &str) -> Vec<u64> {
    let line = child.expect_line(&[word], Duration::from_secs(60));
    line.split_whitespace().skip(1).map(|w| w.parse().expect("a number")).collect()
}

/// The program's module of built-in kernels (`SIMGPU_MODULE_BYTES`, 2 MiB by default).
const MODULE: u64 = 2 * MIB;

/// Whether `free` is the slice less the context, the module and the graph's memory, less
/// the few bytes the program's own result buffer takes.
fn free_beside_the_graph(free: u64, graph: u64) -> bool {
    let room = LIMIT - CONTEXT - MODULE - graph;
    free <= room && free + 4096 >= room
}

#[test]
fn the_graph_pool_is_charged_from_instantiation_to_the_graphs_end() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let graph = 256 * MIB;
    let mut child = start(&gpu, graph);
    // Instantiated: its allocations are charged before any launch, so a launch fits.
    let captured = numbers(&mut child, "CAPTURED");
    assert!(free_beside_the_graph(captured[1], graph), "free after instantiation: {}", mib(captured[1]));
    // Launched and finished: the pool keeps the memory, and the group is charged for it.
    let launched = numbers(&mut child, "LAUNCHED");
    assert_eq!(launched[0], graph, "the pool reserves the graph's allocation");
    assert!(free_beside_the_graph(launched[2], graph), "free while the pool holds it: {}", mib(launched[2]));
    numbers(&mut child, "RELAUNCHED");
    let figure = gpu.held_by(child.pid(), 0);
    assert!(figure <= LIMIT, "the device reports {} against a {} limit", mib(figure), mib(LIMIT));
    child.write_stdin("trim\n");
    // Trimmed while the executable graph lives: still charged (its next launch takes the
    // memory again), so the slice never promises what the graph will take.
    let trimmed = numbers(&mut child, "TRIMMED");
    assert_eq!(trimmed[0], 0, "the pool gave its memory back");
    assert!(free_beside_the_graph(trimmed[1], graph), "free after the trim: {}", mib(trimmed[1]));
    child.close_stdin();
    child.expect_line(&["DONE"], Duration::from_secs(60));
    child.expect_exit_code(0);
}

#[test]
fn a_graph_whose_allocations_pass_the_limit_is_refused_at_instantiation() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let mut child = start(&gpu, GIB);
    let status = child.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "graph_pool stops at the refused call\n{}", child.diagnostics());
    let stderr = child.stderr_text();
    assert!(
        stderr.contains("CUDA_ERROR_OUT_OF_MEMORY")
            && stderr.contains("do not fit under GPUFRAC_MEMORY_LIMIT"),
        "the instantiation is refused as out of memory, and the shim says why\n{stderr}"
    );
}
