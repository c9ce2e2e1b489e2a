//! The clients users run against a GPU, installed from PyPI (pinned in
//! `tests/requirements.txt`, into `.venv/` by the README's test command), run bare on
//! simgpu and under the shim: NVIDIA's cuda-bindings and cuda-core, numba-cuda, and the
//! NVML tools pynvml, gpustat and nvitop. Each client must see the right device (16 GiB
//! bare, its 4 GiB slice under the shim), allocate to exactly its room on every path it
//! offers (stream-ordered pools that keep memory after a free included), round-trip data,
//! list only its own group's processes, and exit without a panic or a traceback.
//!
//! The checks themselves are the Python scripts in `tests/clients/`; this file starts
//! them with the expectations in `CLIENT_*` variables and reads their verdict.

use std::path::PathBuf;
use std::process::Command;

use gpufrac_e2e::clients::{self, gpu, python_with, Leased, Under, CHUNK, DEVICE, INSTALL, LIMIT, OVERHEAD};
use gpufrac_e2e::size::MIB;
use gpufrac_e2e::{skip_on_real_gpu, unique, Arbiter, ChildProcess, SimGpu};

/// `.venv/bin/python` with every client importable.
fn python() -> PathBuf {
    python_with(".venv", "pynvml, gpustat, nvitop, cuda.bindings, cuda.core, numba.cuda", INSTALL)
}

/// `script` of `tests/clients/` on `gpu`, drawing (nvitop, gpustat) for a terminal of 160
/// columns, in no colour.
fn client(gpu: &SimGpu, script: &str, under: Under<'_>) -> Command {
    let mut cmd = clients::client(gpu, &python(), script, under);
    cmd.env("COLUMNS", "160").env("TERM", "dumb");
    cmd
}

fn passes(cmd: Command) -> Vec<String> {
    clients::passes(cmd, &[])
}

fn bytes_of(lines: &[String], what: &str) -> u64 {
    let line = lines
        .iter()
        .find(|l| l.split_whitespace().nth(1) == Some(what))
        .unwrap_or_else(|| panic!("no `OK {what}` line in {lines:#?}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("bytes="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no bytes= in {line:?}"))
}

#[test]
fn cuda_bindings_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let _turn = clients::fills_ram();
    let gpu = gpu();
    let lines = passes(client(&gpu, "cuda_bindings_check.py", Under::Bare));
    assert!(bytes_of(&lines, "cuMemAllocAsync") > DEVICE - OVERHEAD - 2 * CHUNK);
}

#[test]
fn cuda_bindings_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let _turn = clients::fills_ram();
    let gpu = gpu();
    let lines = passes(client(&gpu, "cuda_bindings_check.py", Under::Shim { group: &unique("bindings") }));
    for path in
        ["cuMemAlloc", "cuMemAllocAsync", "cuMemAlloc-after-pool", "cuMemAllocFromPoolAsync-2", "cuMemCreate"]
    {
        let got = bytes_of(&lines, path);
        assert!(got <= LIMIT - OVERHEAD && got > LIMIT - OVERHEAD - 2 * CHUNK, "{path}: {got}");
    }
}

#[test]
fn cuda_core_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let _turn = clients::fills_ram();
    let gpu = gpu();
    passes(client(&gpu, "cuda_core_check.py", Under::Bare));
}

#[test]
fn cuda_core_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let _turn = clients::fills_ram();
    let gpu = gpu();
    let lines = passes(client(&gpu, "cuda_core_check.py", Under::Shim { group: &unique("core") }));
    assert!(bytes_of(&lines, "DeviceMemoryResource-1") <= LIMIT - OVERHEAD);
}

#[test]
fn numba_bare() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    passes(client(&gpu, "numba_check.py", Under::Bare));
}

#[test]
fn numba_shimmed() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let gpu = gpu();
    let lines = passes(client(&gpu, "numba_check.py", Under::Shim { group: &unique("numba") }));
    assert!(bytes_of(&lines, "device_array-again") <= LIMIT - OVERHEAD);
}

/// `script` in a group held to a compute share, beside a flood: it must pass as it does
/// alone, while its calls wait for its group's leases.
fn leased(script: &str) -> Vec<String> {
    let leased = Leased::start();
    let mut cmd = leased.client(&python(), script);
    cmd.env("COLUMNS", "160").env("TERM", "dumb");
    let lines = passes(cmd);
    leased.assert_leased();
    lines
}

#[test]
fn cuda_bindings_leased() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let _turn = clients::fills_ram();
    let lines = leased("cuda_bindings_check.py");
    assert!(bytes_of(&lines, "cuMemAlloc") <= LIMIT - OVERHEAD);
}

#[test]
fn numba_leased() {
    skip_on_real_gpu!(clients::EXACT_ROOM);
    let lines = leased("numba_check.py");
    assert!(bytes_of(&lines, "device_array-again") <= LIMIT - OVERHEAD);
}

/// Two tenants hold memory: `mine` in the group the monitor runs in, `theirs` in another.
struct Tenants {
    mine: ChildProcess,
    theirs: ChildProcess,
    group: String,
}

const HELD: u64 = 512 * MIB;

fn tenants(gpu: &SimGpu) -> Tenants {
    let group = unique("monitor");
    let hold = |group: &str| {
        let mut cmd = client(gpu, "holder.py", Under::Shim { group });
        cmd.env("CLIENT_HOLD", HELD.to_string());
        if !gpu.is_real() {
            // Kernels, so that each tenant has utilization samples to show or hide.
            cmd.env("CLIENT_BUSY_US", "20000");
        }
        let mut child = ChildProcess::spawn(&mut cmd);
        child.ready();
        child
    };
    let mine = hold(&group);
    let theirs = hold(&unique("other-tenant"));
    Tenants { mine, theirs, group }
}

/// Runs the monitor `script` bare and under the shim beside two tenants: bare it lists
/// both, under the shim only its own group's, with the slice as the device's memory.
fn monitor(script: &str) {
    let gpu = gpu();
    let mut t = tenants(&gpu);
    let (mine, theirs) = (t.mine.pid().to_string(), t.theirs.pid().to_string());

    let mut bare = client(&gpu, script, Under::Bare);
    bare.env("CLIENT_OWN_PIDS", format!("{mine},{theirs}"))
        .env("CLIENT_HELD_AT_LEAST", (2 * HELD).to_string());
    // Both tenants ran kernels (on simgpu): bare, both have samples, so the shimmed run's
    // hiding of the other tenant's is a check that can fail.
    if !gpu.is_real() {
        bare.env("CLIENT_SAMPLED_PIDS", format!("{mine},{theirs}"));
    }
    passes(bare);

    let mut shimmed = client(&gpu, script, Under::Shim { group: &t.group });
    shimmed
        .env("CLIENT_OWN_PIDS", &mine)
        .env("CLIENT_OTHER_PIDS", &theirs)
        .env("CLIENT_HELD_AT_LEAST", HELD.to_string());
    if !gpu.is_real() {
        shimmed.env("CLIENT_SAMPLED_PIDS", &mine);
    }
    passes(shimmed);

    for child in [&mut t.mine, &mut t.theirs] {
        child.close_stdin();
        child.finish();
    }
}

#[test]
fn pynvml_sees_the_slice_and_its_own_processes() {
    monitor("pynvml_check.py");
}

#[test]
fn gpustat_sees_the_slice_and_its_own_processes() {
    monitor("gpustat_check.py");
}

#[test]
fn nvitop_sees_the_slice_and_its_own_processes() {
    monitor("nvitop_check.py");
}

/// In a PID namespace of its own (a container), NVML lists a process by its PID on the
/// host: the shim learns that PID from the arbiter and shows the process under its own,
/// beside another tenant's process on the host, which stays hidden.
#[test]
fn in_a_pid_namespace_a_process_finds_itself_in_nvml_by_its_own_pid() {
    let gpu = gpu();
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("ns.sock"), &[]);
    let other = unique("other-tenant");
    let mut theirs = client(&gpu, "holder.py", Under::Shim { group: &other });
    theirs.env("CLIENT_HOLD", HELD.to_string()).env("GPUFRAC_ARBITER_SOCKET", arbiter.socket());
    let mut theirs = ChildProcess::spawn(&mut theirs);
    theirs.ready();

    let group = unique("namespaced");
    let launcher = ["unshare", "--pid", "--fork", "--"];
    let mut mine = clients::client_launched(
        &gpu,
        &launcher,
        &python(),
        "own_process_check.py",
        Under::Shim { group: &group },
    );
    mine.env("CLIENT_HOLD", HELD.to_string()).env("GPUFRAC_ARBITER_SOCKET", arbiter.socket());
    let lines = passes(mine);
    assert!(lines.iter().any(|l| l.starts_with("OK compute pid=1 ")), "found itself as PID 1: {lines:#?}");

    theirs.close_stdin();
    theirs.finish();
}
