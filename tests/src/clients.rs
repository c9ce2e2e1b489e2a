//! Running the client checks of `tests/clients/` (Python scripts driving clients installed
//! from PyPI) on a simgpu, bare or under the shim, with what each must see in `CLIENT_*`
//! variables: `CLIENT_TOTAL` (16 GiB bare, the 4 GiB slice under the shim), `CLIENT_ROOM`
//! (that less one context) and `CLIENT_CHUNK`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::size::{GIB, MIB};
use crate::{artifact, log_field, unique, Arbiter, ChildProcess, ShimSettings, SimGpu};

/// The simulated device, bare.
pub const DEVICE: u64 = 16 * GIB;
/// Device memory of each context on it.
pub const OVERHEAD: u64 = 64 * MIB;
/// The shimmed clients' request.
pub const REQUEST: &str = "2GiB";
/// The shimmed clients' limit: the device they see.
pub const LIMIT: u64 = 4 * GIB;
/// What the checks allocate at a time.
pub const CHUNK: u64 = 256 * MIB;
/// A client's whole run, generous: numba, nvitop and CuPy take seconds to import on a
/// busy two-core machine.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// How the test command installs the clients.
pub const INSTALL: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/requirements.txt";
/// Why the checks that fill the device need simgpu (`skip_on_real_gpu!`): each expects its
/// room to be the device (or slice) less exactly simgpu's context ([`OVERHEAD`]).
pub const EXACT_ROOM: &str =
    "the check fills exactly the device or slice less simgpu's 64 MiB context (CLIENT_ROOM)";

/// Clients that fill the device with VMM memory (`cuMemCreate`) take turns: simgpu backs
/// physical allocations with host RAM at once (as a GPU has them from `cuMemCreate` on), so
/// two 16 GiB fills at the same time would ask a small machine for 32 GB.
static FILLS_RAM: Mutex<()> = Mutex::new(());

/// This test's turn to fill the device with memory simgpu backs with host RAM.
pub fn fills_ram() -> MutexGuard<'static, ()> {
    FILLS_RAM.lock().unwrap_or_else(|p| p.into_inner())
}

/// The repository.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python of `venv` (relative to the repository) if it can import `modules`; fails
/// the test, saying how to install them with `install`, otherwise.
pub fn python_with(venv: &str, modules: &str, install: &str) -> PathBuf {
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

/// A simgpu of [`DEVICE`] bytes with [`OVERHEAD`] per context.
pub fn gpu() -> SimGpu {
    SimGpu::new("16GiB").with_context_overhead("64MiB")
}

/// How a client runs: bare, or under the shim in `group`.
#[derive(Clone, Copy)]
pub enum Under<'a> {
    /// Straight on simgpu.
    Bare,
    /// Under the shim, [`REQUEST`] and [`LIMIT`], in `group`.
    Shim {
        /// `GPUFRAC_GROUP`.
        group: &'a str,
    },
}

/// `script` of `tests/clients/`, run by `python` on `gpu`, with the device size and room
/// it must see (bare: the device's size, [`DEVICE`] on the simgpu of [`gpu`]).
pub fn client(gpu: &SimGpu, python: &Path, script: &str, under: Under<'_>) -> Command {
    client_launched(gpu, &[], python, script, under)
}

/// [`client`], started through `launcher` (a program and its arguments, e.g. `unshare`).
pub fn client_launched(
    gpu: &SimGpu,
    launcher: &[&str],
    python: &Path,
    script: &str,
    under: Under<'_>,
) -> Command {
    let mut cmd = match launcher.split_first() {
        Some((program, args)) => {
            let mut cmd = gpu.command(program);
            cmd.args(args).arg(python);
            cmd
        }
        None => gpu.command(python),
    };
    cmd.arg(root().join("tests/clients").join(script))
        .current_dir(root().join("tests/clients"))
        .env("CLIENT_CHUNK", CHUNK.to_string())
        .env_remove("PYTHONPATH");
    let total = match under {
        Under::Bare => gpu.device_total(0),
        Under::Shim { group } => {
            cmd.preload_shim().memory_request(REQUEST).memory_limit(LIMIT.to_string()).group(group);
            LIMIT
        }
    };
    cmd.env("CLIENT_TOTAL", total.to_string()).env("CLIENT_ROOM", (total - OVERHEAD).to_string());
    cmd
}

/// Runs a client to its end: it must exit 0, end with `OK done`, and write no panic, no
/// traceback and none of `forbidden` on stderr. Returns its `OK` lines.
pub fn passes(mut cmd: Command, forbidden: &[&str]) -> Vec<String> {
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
        || ["panicked", "Traceback"].iter().chain(forbidden).any(|text| stderr.contains(text));
    if failed {
        panic!("{}", child.diagnostics());
    }
    lines
}

/// A GPU leased between two groups with compute shares of 50% each: a flood of kernels in
/// one, and a client in the other, so that each of the client's copies, sets and
/// synchronizes goes through its group's leases.
pub struct Leased {
    /// The simulated GPU.
    pub gpu: SimGpu,
    /// Its arbiter, logging each lease at debug.
    pub arbiter: Arbiter,
    flood: ChildProcess,
    group: String,
}

impl Leased {
    /// The GPU, its arbiter (logging each lease) and the flood, running.
    pub fn start() -> Leased {
        let gpu = gpu();
        let socket = gpu.lib_dir().join(format!("{}.sock", unique("leased")));
        let filter = std::ffi::OsStr::new("info,gpufrac_daemon::arbiter::policy::compute=debug");
        let arbiter = Arbiter::start_with_env(&gpu, socket, &[], &[("GPUFRAC_LOG", filter)]);
        let mut cmd = gpu.shimmed(artifact("compute_load"));
        cmd.args(["flood", "--kernel-us", "1000", "--depth", "16", "--seconds", "600", "--now"])
            .memory_request("512MiB")
            .arbiter_socket(arbiter.socket())
            .group(unique("flood"))
            .compute_request("50%")
            .compute_limit("100%");
        let mut flood = ChildProcess::spawn(&mut cmd);
        flood.expect_line(&["ready"], Duration::from_secs(30));
        Leased { gpu, arbiter, flood, group: unique("leased") }
    }

    /// `script` run by `python` under the shim, as [`client`] runs it, in the leased group.
    pub fn client(&self, python: &Path, script: &str) -> Command {
        let mut cmd = client(&self.gpu, python, script, Under::Shim { group: &self.group });
        cmd.arbiter_socket(self.arbiter.socket()).compute_request("50%").compute_limit("100%");
        cmd
    }

    /// Stops the flood; fails the test unless the arbiter leased the GPU to the client's
    /// group (it then waited for its turns).
    pub fn assert_leased(mut self) {
        self.flood.kill();
        let log = self.arbiter.log_text();
        let leases = log
            .lines()
            .filter(|l| {
                l.contains(" lease") && log_field(l, "group").is_some_and(|g| g.contains(&self.group))
            })
            .count();
        assert!(
            log.contains("GPU leased") && leases > 0,
            "the group {} was never leased the GPU: {log}",
            self.group
        );
    }
}
