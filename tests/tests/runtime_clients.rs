//! NVIDIA's CUDA runtime on simgpu, bare and under the shim: `libcudart` 12 itself through
//! ctypes (from the PyPI wheel `nvidia-cuda-runtime-cu12`) and CuPy (`cupy-cuda12x`, which
//! carries its own copy of the runtime), pinned in `tests/requirements.txt` and installed
//! into `.venv/` by the README's test command.
//!
//! The runtime starts only if the driver answers `cuGetExportTable` with the private
//! tables it asks for (simgpu's `export_tables.rs`); then each client must see the right
//! device (16 GiB bare, its 4 GiB slice under the shim), allocate to exactly its room on
//! every path (`cudaMalloc`, `cudaMallocAsync`, CuPy's memory pool and its stream-ordered
//! pool) and stop there with its own out-of-memory error, round-trip data, and never reach
//! a private-table slot simgpu does not implement. CuPy's arrays also go through the swap
//! resolver: moved to host RAM for another process's burst and back, bit for bit, at the
//! same addresses (`cupy_swapped.py`).
//!
//! The checks are the Python scripts `tests/clients/cudart_check.py` and `cupy_check.py`;
//! this file starts them with the expectations in `CLIENT_*` variables and reads their
//! verdict.
//!
//! PyTorch (`torch_check.py`) is too large for every CI run (6.8 GB of CUDA wheels): its
//! tests run wherever `torch` is importable in `.venv/torch` (a virtual environment of its
//! own) or in `.venv`, and elsewhere skip, saying so in the test command's summary:
//!
//! ```text
//! python3 -m venv .venv/torch && .venv/torch/bin/pip install -r tests/requirements-torch.txt
//! cargo build --workspace && cargo test -p gpufrac-e2e --test runtime_clients torch
//! ```

use std::path::PathBuf;
use std::process::Command;

use gpufrac_e2e::clients::{
    self, gpu, python_with, root, Leased, Under, CHUNK, DEVICE, INSTALL, LIMIT, OVERHEAD,
};
use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{
    compile_c, report_skip, skip_on_real_gpu, unique, wait_for, Arbiter, ChildProcess, ShimSettings, SimGpu,
    Skip, TIMEOUT,
};

/// What simgpu writes on stderr when the runtime asks for a table or calls a slot it
/// does not implement (`export_tables.rs`).
const UNKNOWN_TABLE: &str = "cuGetExportTable asked for the private table";
const UNKNOWN_SLOT: &str = "which simgpu does not implement";

/// Why the PyTorch tests skip where it is not installed.
const NO_TORCH: &str = "PyTorch is not installed (6.8 GB of CUDA wheels; see tests/requirements-torch.txt)";

/// The virtual environments, relative to the repository, where the PyTorch checks look for
/// `torch` (and `numpy`), in order.
const TORCH_VENVS: [&str; 2] = [".venv/torch", ".venv"];

/// The Python of the first of [`TORCH_VENVS`] that imports `torch` and `numpy`, if any.
fn torch_python() -> Option<PathBuf> {
    TORCH_VENVS.iter().map(|venv| root().join(venv).join("bin/python")).find(|python| {
        Command::new(python).args(["-c", "import torch, numpy"]).output().is_ok_and(|o| o.status.success())
    })
}

/// `script` of `tests/clients/` run by `python`, bare or under the shim in a group of its
/// own.
fn client_with(gpu: &gpufrac_e2e::SimGpu, python: &std::path::Path, script: &str, shimmed: bool) -> Command {
    let group = unique("runtime");
    let under = if shimmed { Under::Shim { group: &group } } else { Under::Bare };
    clients::client(gpu, python, script, under)
}

/// `script` of `tests/clients/` run by `.venv`'s Python (it fails the test, saying how to
/// install them, without the CUDA runtime and CuPy).
fn client(gpu: &gpufrac_e2e::SimGpu, script: &str, shimmed: bool) -> Command {
    client_with(gpu, &python_with(".venv", "nvidia.cuda_runtime, cupy", INSTALL), script, shimmed)
}

/// Runs a client to its end (see [`clients::passes`]); it must never reach a private
/// table or slot simgpu lacks either.
fn passes(cmd: Command) -> Vec<String> {
    clients::passes(cmd, &[UNKNOWN_TABLE, UNKNOWN_SLOT])
}

fn line<'a>(lines: &'a [String], what: &str) -> &'a str {
    lines
        .iter()
        .find(|l| l.split_whitespace().nth(1) == Some(what))
        .unwrap_or_else(|| panic!("no `OK {what}` line in {lines:#?}"))
}

fn value(lines: &[String], what: &str, key: &str) -> u64 {
    let line = line(lines, what);
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|w| w.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Every allocation path got all of the room (less than two chunks short) and no more.
fn filled_the_room(lines: &[String], total: u64, paths: &[&str]) {
    let room = total - OVERHEAD;
    for path in paths {
        let got = value(lines, path, "bytes");
        assert!(got <= room && got > room - 2 * CHUNK, "{path}: {got} bytes of a {room}-byte room");
    }
}

#[test]
fn cudart_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    let lines = passes(client(&gpu, "cudart_check.py", false));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    assert!(value(&lines, "runtime", "runtime") >= 12000);
    filled_the_room(&lines, DEVICE, &["cudaMalloc", "cudaMallocAsync"]);
    line(&lines, "reset");
}

#[test]
fn cudart_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    let lines = passes(client(&gpu, "cudart_check.py", true));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["cudaMalloc", "cudaMallocAsync"]);
}

#[test]
fn cupy_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    let lines = passes(client(&gpu, "cupy_check.py", false));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    filled_the_room(&lines, DEVICE, &["MemoryPool", "MemoryAsyncPool"]);
    line(&lines, "stream");
}

#[test]
fn cupy_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    let lines = passes(client(&gpu, "cupy_check.py", true));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["MemoryPool", "MemoryAsyncPool"]);
}

/// CuPy's arrays in a process whose burst memory the swap resolver takes for another's
/// burst: moved to host RAM while CuPy sleeps, brought back when it copies them out, every
/// byte where it was and every array at its address. The arrays come from CuPy's memory
/// pool through the CUDA runtime (`cuGetProcAddress`'s hooks, not the linked ones), so
/// this is the swap path as an inference server built on a runtime meets it.
#[test]
fn cupy_arrays_swapped_out_for_another_burst_come_back_bit_for_bit_at_their_addresses() {
    skip_on_real_gpu!("the holder and the requester are sized to collide on a 2 GiB simgpu device");
    const PIECE: u64 = 128 * MIB;
    const PIECES: u64 = 8;
    // 2 GiB, 64 MiB contexts: CuPy holds 1 GiB (half of it lent above its 512 MiB request)
    // and the requester's 1 GiB only fits once that loan is in host RAM.
    let gpu = SimGpu::new("2GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("cs.sock"), &["--swap-quantum", "0s"]);
    let (holder_group, burst_group) = (unique("cupy-holder"), unique("burst"));
    let swapping = |cmd: &mut Command, group: &str| {
        cmd.memory_request("512MiB")
            .memory_limit("1536MiB")
            .resolver("swap")
            .arbiter_socket(arbiter.socket())
            .group(group)
            .wait_timeout("30s");
    };
    let python = python_with(".venv", "cupy", INSTALL);
    let mut cmd = gpu.shimmed(&python);
    cmd.arg(root().join("tests/clients/cupy_swapped.py"))
        .env("CLIENT_PIECE", PIECE.to_string())
        .env("CLIENT_PIECES", PIECES.to_string())
        .env_remove("PYTHONPATH");
    swapping(&mut cmd, &holder_group);
    let mut cupy = ChildProcess::spawn(&mut cmd);
    assert_eq!(cupy.ready()[1], PIECE * PIECES);
    let ptrs = cupy.expect_line(&["PTRS"], TIMEOUT);

    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.args(["alloc", &(32 * MIB).to_string(), &(1024 * MIB).to_string()]);
    swapping(&mut cmd, &burst_group);
    let mut burst = ChildProcess::spawn(&mut cmd);
    let got = burst.ready()[0];
    assert_eq!(got, 1024 * MIB, "the requester's whole burst ({})", mib(got));
    let s = wait_for(&arbiter, "CuPy's loan in host RAM", |s| {
        s.gpus[0]
            .processes
            .iter()
            .any(|p| p.group == holder_group && p.state == "swapped" && p.host_bytes > 0)
    });
    let swapped = s.gpus[0].processes.iter().find(|p| p.group == holder_group).map_or(0, |p| p.host_bytes);
    assert!(swapped >= 3 * PIECE, "at least CuPy's lent arrays are in host RAM: {}", mib(swapped));

    // CuPy copies its arrays out: it waits at the gate until the requester is done and its
    // memory is back on the device.
    cupy.write_stdin("check\n");
    burst.finish();
    let verdict = cupy.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    let addresses = ptrs.strip_prefix("PTRS ").expect("a PTRS line");
    assert_eq!(
        verdict,
        format!("INTACT {} PTRS {addresses}", PIECE * PIECES),
        "CuPy's arrays after the swap-in"
    );
    wait_for(&arbiter, "CuPy back in", |s| {
        s.gpus[0]
            .processes
            .iter()
            .any(|p| p.group == holder_group && p.state == "running" && p.host_bytes == 0)
    });
    cupy.close_stdin();
    cupy.expect_line(&["OK"], TIMEOUT);
    cupy.expect_exit_code(0);
    let stderr = cupy.stderr_text();
    assert!(!stderr.contains("Traceback") && !stderr.contains("panicked"), "{stderr}");
    let log = arbiter.log_text();
    assert!(log.contains("swapped out") && log.contains("swapped in"), "{log}");
}

/// Two CuPy "models" that are parkable, on a GPU that holds one: the second is admitted
/// parked and loads once the first, idle, is parked for it (`mechanism`: the shim's swap or
/// the driver's checkpoint); then the first reads its arrays back, which wakes it (the
/// second, idle by then, is parked in turn), and finds every byte at its address. The
/// CUDA runtime's first call after a park is one the shim does not hook (`cudaGetDevice`
/// asks `cuCtxGetDevice`): locked by the driver's checkpoint, it blocked there for ever
/// until the shim handed out thunks for unhooked entry points; and a model woken after
/// its `GPUFRAC_PARK_AFTER` of restoring was parked again before its call ran, so the two
/// parked each other in turn.
fn cupy_models_take_turns(mechanism: &str) {
    const PIECE: u64 = 64 * MIB;
    const PIECES: u64 = 8;
    let gpu = SimGpu::new("1GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("cp.sock"),
        &["--oversubscribe", "2", "--park-with", mechanism],
    );
    let python = python_with(".venv", "cupy", INSTALL);
    let model = |group: &str| {
        let mut cmd = gpu.shimmed(&python);
        cmd.arg(root().join("tests/clients/cupy_swapped.py"))
            .env("CLIENT_PIECE", PIECE.to_string())
            .env("CLIENT_PIECES", PIECES.to_string())
            .env_remove("PYTHONPATH")
            .memory_request("640MiB")
            .park_after("300ms")
            .arbiter_socket(arbiter.socket())
            .group(group)
            .wait_timeout("120s")
            .log("info");
        let mut child = ChildProcess::spawn(&mut cmd);
        assert_eq!(child.ready()[1], PIECE * PIECES);
        let ptrs = child.expect_line(&["PTRS"], TIMEOUT);
        (child, ptrs)
    };
    let (first_group, second_group) = (unique("cupy-first"), unique("cupy-second"));
    let (mut first, first_ptrs) = model(&first_group);
    // Loads only once the first has been parked for it.
    let (mut second, second_ptrs) = model(&second_group);
    let s = gpufrac_e2e::status(&arbiter);
    let state = |s: &gpufrac_daemon::status::Status, group: &str| {
        s.gpus[0].processes.iter().find(|p| p.group == group).map(|p| (p.state.clone(), p.parks))
    };
    assert_eq!(
        state(&s, &first_group).map(|(_, parks)| parks >= 1),
        Some(true),
        "the first was parked: {s:?}"
    );

    // The first's read-back wakes it: the second, idle, is parked for it.
    for (model, ptrs, group) in
        [(&mut first, &first_ptrs, &first_group), (&mut second, &second_ptrs, &second_group)]
    {
        model.write_stdin("check\n");
        let verdict = model.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
        let addresses = ptrs.strip_prefix("PTRS ").expect("a PTRS line");
        assert_eq!(verdict, format!("INTACT {} PTRS {addresses}", PIECE * PIECES), "{group} after its wake");
    }
    let s = gpufrac_e2e::status(&arbiter);
    assert_eq!(
        state(&s, &second_group).map(|(_, parks)| parks >= 1),
        Some(true),
        "the second was parked: {s:?}"
    );
    for model in [&mut first, &mut second] {
        model.close_stdin();
        model.expect_line(&["OK"], TIMEOUT);
        model.expect_exit_code(0);
        let stderr = model.stderr_text();
        assert!(!stderr.contains("Traceback") && !stderr.contains("panicked"), "{stderr}");
    }
    let how =
        if mechanism == "checkpoint" { "parked by the driver's checkpoint" } else { "parked by the shim" };
    let log = arbiter.log_text();
    assert!(log.contains(how), "parks used {mechanism}:\n{log}");
}

#[test]
fn cupy_models_take_turns_parked_by_the_shim() {
    skip_on_real_gpu!("two CuPy models are sized to take turns on a 1 GiB simgpu device");
    cupy_models_take_turns("shim");
}

#[test]
fn cupy_models_take_turns_parked_by_the_driver_checkpoint() {
    skip_on_real_gpu!("two CuPy models are sized to take turns on a 1 GiB simgpu device");
    cupy_models_take_turns("checkpoint");
}

/// `script` in a group held to a compute share, beside a flood: it must pass as it does
/// alone, while its copies, sets and synchronizes wait for its group's leases.
fn leased(script: &str) -> Vec<String> {
    let leased = Leased::start();
    let lines = passes(leased.client(&python_with(".venv", "nvidia.cuda_runtime, cupy", INSTALL), script));
    leased.assert_leased();
    lines
}

#[test]
fn cudart_leased() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let lines = leased("cudart_check.py");
    filled_the_room(&lines, LIMIT, &["cudaMalloc", "cudaMallocAsync"]);
    line(&lines, "reset");
}

#[test]
fn cupy_leased() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let lines = leased("cupy_check.py");
    filled_the_room(&lines, LIMIT, &["MemoryPool", "MemoryAsyncPool"]);
    line(&lines, "stream");
    assert_eq!(value(&lines, "per-thread", "threads"), 9, "{lines:?}");
}

#[test]
fn torch_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let Some(python) = torch_python() else { return report_skip(Skip::PyTorch, NO_TORCH) };
    let gpu = gpu();
    let lines = passes(client_with(&gpu, &python, "torch_check.py", false));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    filled_the_room(&lines, DEVICE, &["caching-allocator"]);
}

#[test]
fn torch_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let Some(python) = torch_python() else { return report_skip(Skip::PyTorch, NO_TORCH) };
    let gpu = gpu();
    let lines = passes(client_with(&gpu, &python, "torch_check.py", true));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["caching-allocator"]);
    assert!(value(&lines, "caching-allocator", "reserved") <= LIMIT - OVERHEAD);
}
