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

/// `.venv/bin/python` with the runtime and CuPy importable; fails the test, saying how to
/// install them, otherwise.
fn python() -> PathBuf {
    let python = root().join(".venv/bin/python");
    let probe = Command::new(&python).args(["-c", "import nvidia.cuda_runtime, cupy"]).output();
    match probe {
        Ok(out) if out.status.success() => python,
        Ok(out) => panic!(
            "the CUDA runtime clients are not installed in .venv ({}): {INSTALL}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => panic!("{} cannot run ({e}): {INSTALL}", python.display()),
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
    let mut cmd = gpu.command(python());
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
