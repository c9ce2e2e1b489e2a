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
//! a private-table slot simgpu does not implement.
//!
//! The checks are the Python scripts `tests/clients/cudart_check.py` and `cupy_check.py`;
//! this file starts them with the expectations in `CLIENT_*` variables and reads their
//! verdict.
//!
//! PyTorch (`torch_check.py`) is too large for every CI run (6.8 GB installed): its tests
//! are ignored by default and run on request, from a virtual environment of their own:
//!
//! ```text
//! python3 -m venv .venv/torch && .venv/torch/bin/pip install -r tests/requirements-torch.txt
//! cargo build --workspace && cargo test -p gpufrac-e2e --test runtime_clients -- --ignored
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{artifact, unique, ChildProcess, SimGpu};

const DEVICE: u64 = 16 * GIB;
const OVERHEAD: u64 = 64 * MIB;
const REQUEST: &str = "2GiB";
const LIMIT: u64 = 4 * GIB;
const CHUNK: u64 = 256 * MIB;
/// A client's whole run, generous: CuPy takes seconds to import on a busy two-core machine.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

const INSTALL: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/requirements.txt";

/// What simgpu writes on stderr when the runtime asks for a table or calls a slot it
/// does not implement (`export_tables.rs`).
const UNKNOWN_TABLE: &str = "cuGetExportTable asked for the private table";
const UNKNOWN_SLOT: &str = "which simgpu does not implement";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const INSTALL_TORCH: &str =
    "python3 -m venv .venv/torch && .venv/torch/bin/pip install -r tests/requirements-torch.txt";

/// The Python of `venv` (relative to the repository) if it can import `modules`; fails the
/// test, saying how to install them with `install`, otherwise.
fn python_with(venv: &str, modules: &str, install: &str) -> PathBuf {
    let python = root().join(venv).join("bin/python");
    let probe = Command::new(&python).args(["-c", &format!("import {modules}")]).output();
    match probe {
        Ok(out) if out.status.success() => python,
        Ok(out) => panic!(
            "{modules} are not installed in {venv} ({}): {install}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => panic!("{} cannot run ({e}): {install}", python.display()),
    }
}

/// The checks' Python for `script`: `.venv/torch` for PyTorch, `.venv` for the others.
fn python(script: &str) -> PathBuf {
    if script.starts_with("torch") {
        python_with(".venv/torch", "torch, numpy", INSTALL_TORCH)
    } else {
        python_with(".venv", "nvidia.cuda_runtime, cupy", INSTALL)
    }
}

fn gpu() -> SimGpu {
    SimGpu::new("16GiB").with_context_overhead("64MiB")
}

/// How a client runs: bare, or under the shim in a group of its own.
#[derive(Clone, Copy, PartialEq)]
enum Under {
    Bare,
    Shim,
}

/// `script` of `tests/clients/` on `gpu`, with the device size and room it must see.
fn client(gpu: &SimGpu, script: &str, under: Under) -> Command {
    let mut cmd = gpu.command(python(script));
    cmd.arg(root().join("tests/clients").join(script))
        .current_dir(root().join("tests/clients"))
        .env("CLIENT_CHUNK", CHUNK.to_string())
        .env_remove("PYTHONPATH");
    let total = match under {
        Under::Bare => DEVICE,
        Under::Shim => {
            cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
                .env("GPUFRAC_MEMORY_REQUEST", REQUEST)
                .env("GPUFRAC_MEMORY_LIMIT", LIMIT.to_string())
                .env("GPUFRAC_GROUP", unique("runtime"));
            LIMIT
        }
    };
    cmd.env("CLIENT_TOTAL", total.to_string()).env("CLIENT_ROOM", (total - OVERHEAD).to_string());
    cmd
}

/// Runs a client to its end: it must exit 0, end with `OK done`, write no panic and no
/// traceback, and never reach a private table or slot simgpu lacks. Returns its `OK`
/// lines.
fn passes(mut cmd: Command) -> Vec<String> {
    let mut child = ChildProcess::spawn(&mut cmd);
    child.close_stdin();
    let mut lines = Vec::new();
    while let Some(line) = child.next_line(RUN_TIMEOUT) {
        lines.push(line);
    }
    let status = child.wait(RUN_TIMEOUT);
    let stderr = child.stderr_text();
    let failed = !status.success()
        || lines.last().map(String::as_str) != Some("OK done")
        || stderr.contains("panicked")
        || stderr.contains("Traceback")
        || stderr.contains(UNKNOWN_TABLE)
        || stderr.contains(UNKNOWN_SLOT);
    if failed {
        panic!("{}", child.diagnostics());
    }
    lines
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
    let gpu = gpu();
    let lines = passes(client(&gpu, "cudart_check.py", Under::Bare));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    assert!(value(&lines, "runtime", "runtime") >= 12000);
    filled_the_room(&lines, DEVICE, &["cudaMalloc", "cudaMallocAsync"]);
    line(&lines, "reset");
}

#[test]
fn cudart_shimmed() {
    let gpu = gpu();
    let lines = passes(client(&gpu, "cudart_check.py", Under::Shim));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["cudaMalloc", "cudaMallocAsync"]);
}

#[test]
fn cupy_bare() {
    let gpu = gpu();
    let lines = passes(client(&gpu, "cupy_check.py", Under::Bare));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    filled_the_room(&lines, DEVICE, &["MemoryPool", "MemoryAsyncPool"]);
    line(&lines, "stream");
}

#[test]
fn cupy_shimmed() {
    let gpu = gpu();
    let lines = passes(client(&gpu, "cupy_check.py", Under::Shim));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["MemoryPool", "MemoryAsyncPool"]);
}

#[test]
#[ignore = "PyTorch is not in tests/requirements.txt (6.8 GB); see the module's doc to run it"]
fn torch_bare() {
    let gpu = gpu();
    let lines = passes(client(&gpu, "torch_check.py", Under::Bare));
    assert_eq!(value(&lines, "device", "total"), DEVICE);
    filled_the_room(&lines, DEVICE, &["caching-allocator"]);
}

#[test]
#[ignore = "PyTorch is not in tests/requirements.txt (6.8 GB); see the module's doc to run it"]
fn torch_shimmed() {
    let gpu = gpu();
    let lines = passes(client(&gpu, "torch_check.py", Under::Shim));
    assert_eq!(value(&lines, "device", "total"), LIMIT);
    filled_the_room(&lines, LIMIT, &["caching-allocator"]);
    assert!(value(&lines, "caching-allocator", "reserved") <= LIMIT - OVERHEAD);
}
