//! Helpers shared by gpufrac's end-to-end tests, which run real processes against the
//! build outputs of the workspace:
//!
//! - [`target_dir`] and [`artifact`] find the build outputs (`libgpufrac.so`,
//!   `libsimgpu_cuda.so`, ...) of the profile the test binary was built with;
//! - [`SimGpu`] is a private simulated GPU for one test: a folder of `libcuda.so*` and
//!   `libnvidia-ml.so*` symlinks to the simulated libraries and a state file of its own,
//!   so tests running in parallel never share devices;
//! - [`compile_c`] builds the C test programs of `tests/c/` on demand;
//! - [`ChildProcess`] runs a program that speaks the line protocol of the test programs
//!   (`READY ...` once it holds what it was asked to, then waits for its stdin to close),
//!   with a timeout on every wait, so a broken program fails its test instead of hanging it;
//! - [`clients`] runs the checks of `tests/clients/` (clients from PyPI) bare or shimmed;
//! - [`kube_standins`] (the kubelet and API server the DRA plugin talks to) and
//!   [`dra_node`] (a node of them with the plugin's folders, and the objects and waits the
//!   DRA tests share) serve the DRA kubelet plugin's tests;
//! - [`SimGpu::shimmed`] is a command for the simulated GPU with the shim preloaded, and
//!   [`ShimSettings`] ([`shim`]) sets the shim's variables on it by name
//!   (`.memory_request("1GiB").group(&g)`), so a test writes only the settings it uses.
//!
//! The simulated libraries must have been built beforehand (`cargo build --workspace`):
//! cargo cannot build a `cdylib` as a dependency of a test.
//!
//! With `GPUFRAC_E2E_REAL_GPU=1` ([`real_gpu`]) the same tests run on the machine's real
//! CUDA driver (`libcuda.so.1`) and NVML (`libnvidia-ml.so.1`): a [`SimGpu`] is then a
//! handle on the real devices (sizes read through NVML, see [`SimGpu::device_total`]) and
//! tests that need the simulator say so with [`skip_on_real_gpu!`].
#![deny(missing_docs)]

pub mod busy;
pub mod clients;
pub mod density_chart;
pub mod device_model;
pub mod dra_node;
pub mod kube_standins;
pub mod kubernetes_validate;
pub mod pod_cgroup;
pub mod raw_client;
pub mod rng;
pub mod shim;

pub use shim::ShimSettings;

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use simgpu_state::env::SimGpuDir;

/// How long a test waits for a child's next line or for its exit before failing. Generous,
/// because tests share a small machine with builds; a healthy child answers in milliseconds.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// File name of the simulated CUDA driver in the target folder.
pub const SIMGPU_CUDA: &str = "libsimgpu_cuda.so";
/// File name of the simulated NVML in the target folder.
pub const SIMGPU_NVML: &str = "libsimgpu_nvml.so";

/// The `target/<profile>` folder of the running test binary (`target/debug` for
/// `cargo test`, `target/release` for `cargo test --release`), where the workspace's
/// build outputs are.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running test binary has a path");
    // target/<profile>/deps/<test>-<hash>, or target/<profile>/<binary> for other callers.
    let dir = exe.parent().expect("an executable lives in a folder");
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir.parent().expect("deps/ lives in the profile folder").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The build output `name` in [`target_dir`]; panics, saying how to build it, if it is
/// missing, or if it is one of the shared libraries that `cargo test` does not rebuild
/// and is older than its sources (see [`stale_library`]).
pub fn artifact(name: &str) -> PathBuf {
    let dir = target_dir();
    let path = dir.join(name);
    let release = if dir.file_name() == Some(OsStr::new("release")) { " --release" } else { "" };
    if !path.exists() {
        panic!("{} is missing: build the workspace first: cargo build --workspace{release}", path.display());
    }
    if let Some(stale) = stale_library(&dir, name) {
        panic!("{stale}: the tests would run old code; build the workspace first: cargo build --workspace{release}");
    }
    path
}

/// The shared libraries the tests load, each with the folders of the workspace whose
/// sources it is built from. `cargo test` (and `cargo build --tests`) rebuilds what the
/// test binaries link, never a `cdylib`: after a change to the shim or simgpu without a
/// `cargo build`, the tests would load the last build's library and pass or fail on code
/// that is gone.
const LIBRARY_SOURCES: &[(&str, &[&str])] = &[
    ("libgpufrac.so", &["shim/preload"]),
    ("libgpufrac_core.so", &["shim/src", "shim/Cargo.toml", "common"]),
    (SIMGPU_CUDA, &["tests/simgpu/cuda", "tests/simgpu/state", "common"]),
    (SIMGPU_NVML, &["tests/simgpu/nvml", "tests/simgpu/state", "common"]),
];

/// Why the library `name` in `dir` (and, for the shim's loader, the core it loads) is
/// older than a source file it is built from, if it is; `None` for other artifacts and on
/// a real GPU (whose run may be handed binaries built elsewhere). Looked at once per
/// library and test process.
pub fn stale_library(dir: &Path, name: &str) -> Option<String> {
    static SEEN: std::sync::Mutex<Vec<(String, Option<String>)>> = std::sync::Mutex::new(Vec::new());
    if real_gpu() {
        return None;
    }
    let names: &[&str] =
        if name == "libgpufrac.so" { &["libgpufrac.so", "libgpufrac_core.so"] } else { &[name] };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    for &name in names {
        let Some(&(_, sources)) = LIBRARY_SOURCES.iter().find(|(n, _)| *n == name) else { continue };
        if let Some((_, verdict)) = seen.iter().find(|(n, _)| n == name) {
            if verdict.is_some() {
                return verdict.clone();
            }
            continue;
        }
        let built = std::fs::metadata(dir.join(name)).and_then(|m| m.modified()).ok();
        let newest = sources.iter().filter_map(|s| newest_file(&workspace.join(s))).max();
        let verdict = match (built, newest) {
            (Some(built), Some((changed, file))) if changed > built => Some(format!(
                "{} is older than its source {}",
                dir.join(name).display(),
                file.strip_prefix(workspace).unwrap_or(&file).display()
            )),
            _ => None,
        };
        seen.push((name.to_owned(), verdict.clone()));
        if verdict.is_some() {
            return verdict;
        }
    }
    None
}

/// The most recently modified file under `path` (itself, if a file), with its time.
fn newest_file(path: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return Some((meta.modified().ok()?, path.to_path_buf()));
    }
    std::fs::read_dir(path).ok()?.flatten().filter_map(|entry| newest_file(&entry.path())).max()
}

/// The environment variable that runs the end-to-end tests on the machine's real GPU:
/// `1` for the real CUDA driver and NVML, `0` or unset for simgpu (see [`real_gpu`]).
pub const REAL_GPU_VAR: &str = "GPUFRAC_E2E_REAL_GPU";

/// What a value of [`REAL_GPU_VAR`] asks for: `Ok(true)` for the real GPU (`1`),
/// `Ok(false)` for simgpu (unset or `0`), and for anything else an error naming the
/// variable and what it accepts.
pub fn parse_real_gpu_switch(value: Option<&OsStr>) -> Result<bool, String> {
    match value.map(OsStr::to_str) {
        None | Some(Some("0")) => Ok(false),
        Some(Some("1")) => Ok(true),
        Some(_) => Err(format!(
            "{REAL_GPU_VAR}={:?} is not understood: set it to 1 to run the end-to-end tests on \
             the machine's real GPU, or to 0 (or leave it unset) to run them on simgpu",
            value.unwrap_or_default()
        )),
    }
}

/// Whether the end-to-end tests run on the machine's real GPU: [`REAL_GPU_VAR`] read once
/// per test process. Panics, naming the variable, on a value other than `0` or `1`.
pub fn real_gpu() -> bool {
    static SWITCH: OnceLock<Result<bool, String>> = OnceLock::new();
    match SWITCH.get_or_init(|| parse_real_gpu_switch(std::env::var_os(REAL_GPU_VAR).as_deref())) {
        Ok(on) => *on,
        Err(message) => panic!("{message}"),
    }
}

/// Returns from the calling test, after reporting a [`Skip::NeedsSimgpu`] skip, when
/// the tests run on a real GPU ([`real_gpu`]): for a test that needs simgpu (injected
/// XIDs, its built-in kernels, its context overhead, a simulated device's exact size, or
/// several devices). On simgpu it does nothing.
#[macro_export]
macro_rules! skip_on_real_gpu {
    ($reason:expr) => {
        if $crate::real_gpu() {
            $crate::report_skipped_on_real_gpu($reason);
            return;
        }
    };
}

/// Reports why a test is skipped on a real GPU (what [`skip_on_real_gpu!`] says): a
/// [`Skip::NeedsSimgpu`] skip, see [`report_skip`].
pub fn report_skipped_on_real_gpu(reason: &str) {
    report_skip(Skip::NeedsSimgpu, reason);
}

/// Why a test skipped all or part of itself, which decides whether CI accepts the skip
/// (see [`report_skip`] and the `skip_summary` program).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// It needs simgpu and the tests run on a real GPU ([`skip_on_real_gpu!`]).
    NeedsSimgpu,
    /// It needs a real GPU and the tests run on simgpu.
    NeedsRealGpu,
    /// It needs PyTorch, whose CUDA wheels are too large for every machine (CI's included).
    PyTorch,
    /// This machine lacks what the test needs (root, a namespace, a cgroup, a tool). CI's
    /// machine has it all, so CI fails on such a skip.
    ThisMachine,
}

impl Skip {
    const ALL: [Skip; 4] = [Skip::NeedsSimgpu, Skip::NeedsRealGpu, Skip::PyTorch, Skip::ThisMachine];

    /// The word a record of the skip starts with.
    pub fn label(self) -> &'static str {
        match self {
            Skip::NeedsSimgpu => "needs-simgpu",
            Skip::NeedsRealGpu => "needs-real-gpu",
            Skip::PyTorch => "pytorch",
            Skip::ThisMachine => "this-machine",
        }
    }

    /// The skip a record's first word names.
    pub fn from_label(label: &str) -> Option<Skip> {
        Skip::ALL.into_iter().find(|s| s.label() == label)
    }

    /// Whether CI's machine (no GPU, root, cgroups, `unshare`, openssl, the test venv) may
    /// skip it: only tests that need a GPU it lacks or PyTorch.
    pub fn expected_on_ci(self) -> bool {
        self != Skip::ThisMachine
    }
}

/// One skip a test reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkipRecord {
    /// Why, which decides whether CI accepts it.
    pub kind: Skip,
    /// `<test file>::<test>`, e.g. `runtime_clients::torch_bare`.
    pub test: String,
    /// The reason the test gave.
    pub reason: String,
}

/// Where tests record their skips: `skipped-tests/` in [`target_dir`], one file per
/// test, read and emptied by the `skip_summary` program that runs the test command.
pub fn skipped_tests_dir() -> PathBuf {
    target_dir().join("skipped-tests")
}

/// The running test as `<test file>::<test>`: the test binary's name without cargo's
/// hash, and the test's name, which libtest gives the thread that runs it.
fn current_test_name() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe.as_deref().and_then(Path::file_stem).map(|s| s.to_string_lossy().into_owned());
    let stem = stem.unwrap_or_else(|| "unknown".into());
    let binary = match stem.rsplit_once('-') {
        Some((name, hash)) if !hash.is_empty() && hash.bytes().all(|b| b.is_ascii_hexdigit()) => name,
        _ => stem.as_str(),
    };
    let thread = std::thread::current();
    let test = thread.name().filter(|n| *n != "main").unwrap_or("(a test that runs on the main thread)");
    format!("{binary}::{test}")
}

/// Says on stderr that the running test skips (all or part of itself) and why, and records
/// it in [`skipped_tests_dir`] for the summary the test command prints at its end. Call it
/// from the test's own thread (its name is the test's), then return. Panics if the skip
/// cannot be recorded: a skip nobody is told of is what this prevents.
pub fn report_skip(kind: Skip, reason: &str) {
    let test = current_test_name();
    let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
    eprintln!("skipped {test} ({}): {reason}", kind.label());
    let dir = skipped_tests_dir();
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot record the skip in {}: {e}", dir.display()));
    let file = dir.join(test.replace('/', "_"));
    let line = format!("{}\t{test}\t{reason}\n", kind.label());
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&file)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot record the skip in {}: {e}", file.display()));
}

/// The skips recorded in `dir` (see [`report_skip`]), sorted by test; a line that is not
/// a record is an error naming its file.
pub fn read_skips(dir: &Path) -> Result<Vec<SkipRecord>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    };
    let mut records = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?.path();
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for line in text.lines().filter(|l| !l.is_empty()) {
            let mut fields = line.splitn(3, '\t');
            let (Some(kind), Some(test), Some(reason)) = (fields.next(), fields.next(), fields.next()) else {
                return Err(format!("{}: not a skip record: {line:?}", path.display()));
            };
            let kind = Skip::from_label(kind)
                .ok_or_else(|| format!("{}: unknown kind of skip {kind:?}", path.display()))?;
            records.push(SkipRecord { kind, test: test.to_owned(), reason: reason.to_owned() });
        }
    }
    records.sort_by(|a, b| (&a.test, &a.reason).cmp(&(&b.test, &b.reason)));
    Ok(records)
}

/// How much more than a test sized for simgpu's small contexts (64 or 256 MiB) a process
/// needs on a real GPU, where a context takes a few hundred MiB of device memory (about
/// 500 MiB on an H100): see [`SimGpu::plus_real_context`].
pub const REAL_CONTEXT_ROOM: u64 = 1 << 30;

/// The machine's real GPUs, as NVML lists them.
#[derive(Debug)]
struct RealMachine {
    /// Total memory of each device, in NVML's order.
    totals: Vec<u64>,
}

/// The real GPUs, found once per test process; panics, saying what is missing, on a
/// machine without a CUDA driver, NVML or a device.
fn real_machine() -> &'static RealMachine {
    static MACHINE: OnceLock<Result<RealMachine, String>> = OnceLock::new();
    match MACHINE.get_or_init(find_real_machine) {
        Ok(machine) => machine,
        Err(message) => panic!("{message}"),
    }
}

fn find_real_machine() -> Result<RealMachine, String> {
    let unset = format!("or unset {REAL_GPU_VAR} to run the tests on simgpu");
    // The driver the test programs will load, found the way they find it. It stays loaded
    // (nothing in it runs before cuInit, which this process never calls).
    // SAFETY: dlopen takes a NUL-terminated name and flags; dlerror returns a string the
    // loader owns, valid until the next dl* call on this thread, copied at once.
    let driver = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if driver.is_null() {
        // SAFETY: as above.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(format!(
            "no real CUDA driver: libcuda.so.1 not found ({why}); {REAL_GPU_VAR}=1 runs the \
             end-to-end tests on the machine's GPU: install the NVIDIA driver (or put its folder \
             on LD_LIBRARY_PATH), {unset}"
        ));
    }
    let nvml = nvml_wrapper::Nvml::init()
        .map_err(|e| format!("no real NVML: libnvidia-ml.so.1 cannot be initialised ({e}); {unset}"))?;
    let count = nvml.device_count().map_err(|e| format!("NVML cannot count the GPUs ({e}); {unset}"))?;
    if count == 0 {
        return Err(format!("no GPU: NVML lists no device; {unset}"));
    }
    let totals = (0..count)
        .map(|i| {
            let device = nvml.device_by_index(i).map_err(|e| format!("NVML device {i}: {e}"))?;
            device.memory_info().map(|m| m.total).map_err(|e| format!("NVML device {i} memory: {e}"))
        })
        .collect::<Result<Vec<u64>, String>>()?;
    Ok(RealMachine { totals })
}

/// A private folder under the temp dir (mode 0700), removed with everything in it when
/// dropped: on a real GPU, where [`SimGpu::lib_dir`] holds no driver links, the place
/// tests keep their sockets and files in.
#[derive(Debug)]
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> PrivateDir {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let nanos =
                SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
            let dir = std::env::temp_dir().join(format!("gpufrac-e2e-{}-{n}-{nanos}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return PrivateDir(dir),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("cannot create {}: {e}", dir.display()),
            }
        }
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a [`SimGpu`] runs programs on.
#[derive(Debug)]
enum Machine {
    /// simgpu: driver links and a state file of its own.
    Simulated(SimGpuDir),
    /// The machine's real GPUs ([`real_gpu`]), and a private folder for files.
    Real(PrivateDir),
}

/// A private simulated GPU for one test, or with `GPUFRAC_E2E_REAL_GPU=1` ([`real_gpu`])
/// the machine's real GPUs.
///
/// It owns a private folder (see `simgpu_state::env::SimGpuDir`) holding `libcuda.so*`
/// and `libnvidia-ml.so*` symlinks to the simgpu libraries and the `SIMGPU_STATE` file, so
/// every process started with [`SimGpu::command`] shares the same simulated devices and
/// no other test's. Dropping it removes the folder.
///
/// On a real GPU the folder is empty of drivers and not put on `LD_LIBRARY_PATH`, no
/// `SIMGPU_*` variable is set, the simulated sizes asked for are not applied, and
/// [`SimGpu::devices`], [`SimGpu::device_count`] and [`SimGpu::device_total`] describe the
/// real devices as NVML reports them.
#[derive(Debug)]
pub struct SimGpu {
    machine: Machine,
    devices: String,
    context_overhead: String,
    _sweep: LedgerSweep,
}

impl SimGpu {
    /// A simulated machine with the devices `devices` (the `SIMGPU_DEVICES` syntax: a comma
    /// list of sizes, `"1GiB"`, `"16GiB,16GiB"`) and the default context overhead (256 MiB).
    ///
    /// On a real GPU ([`real_gpu`]), `devices` is not applied: the handle is for the
    /// machine's devices; panics with `no real CUDA driver: libcuda.so.1 not found` (or what
    /// else is missing) on a machine without them.
    pub fn new(devices: &str) -> SimGpu {
        if real_gpu() {
            let totals = &real_machine().totals;
            return SimGpu {
                machine: Machine::Real(PrivateDir::new()),
                devices: totals.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
                context_overhead: "256MiB".to_owned(),
                _sweep: LedgerSweep,
            };
        }
        artifact(SIMGPU_CUDA);
        artifact(SIMGPU_NVML);
        let sim = SimGpuDir::new(&std::env::temp_dir(), &target_dir(), devices)
            .unwrap_or_else(|e| panic!("cannot prepare a simulated GPU: {e}"))
            .with_context_overhead("256MiB");
        SimGpu {
            machine: Machine::Simulated(sim),
            devices: devices.to_owned(),
            context_overhead: "256MiB".to_owned(),
            _sweep: LedgerSweep,
        }
    }

    /// Sets the device memory each CUDA context takes (`SIMGPU_CONTEXT_OVERHEAD`, a size
    /// such as `"64MiB"`). Not applied on a real GPU, whose contexts take what they take.
    pub fn with_context_overhead(mut self, overhead: &str) -> SimGpu {
        overhead.clone_into(&mut self.context_overhead);
        if let Machine::Simulated(sim) = self.machine {
            self.machine = Machine::Simulated(sim.with_context_overhead(overhead));
        }
        self
    }

    /// Sets which devices are NVLinked (`SIMGPU_NVLINK`, pairs such as `"0-1,2-3"`), as
    /// simgpu's NVML reports them. Not applied on a real GPU, whose links are what they are.
    pub fn with_nvlink(mut self, pairs: &str) -> SimGpu {
        if let Machine::Simulated(sim) = self.machine {
            self.machine = Machine::Simulated(sim.with_nvlink(pairs));
        }
        self
    }

    /// Whether this is the machine's real GPU ([`real_gpu`]) rather than simgpu.
    pub fn is_real(&self) -> bool {
        matches!(self.machine, Machine::Real(_))
    }

    /// The folder with the `libcuda.so*` and `libnvidia-ml.so*` symlinks, which
    /// [`SimGpu::command`] puts first on `LD_LIBRARY_PATH`; tests keep their sockets and
    /// files there too. On a real GPU: a private folder of the test's, empty, not on
    /// `LD_LIBRARY_PATH`.
    pub fn lib_dir(&self) -> &Path {
        match &self.machine {
            Machine::Simulated(sim) => sim.lib_dir(),
            Machine::Real(dir) => &dir.0,
        }
    }

    /// The `SIMGPU_STATE` file shared by the processes of this simulated machine (on a
    /// real GPU a path in [`SimGpu::lib_dir`] that nothing uses).
    pub fn state_path(&self) -> PathBuf {
        match &self.machine {
            Machine::Simulated(sim) => sim.state_path(),
            Machine::Real(dir) => dir.0.join("state"),
        }
    }

    /// The `SIMGPU_DEVICES` value (on a real GPU, each device's total memory in bytes,
    /// in the same syntax).
    pub fn devices(&self) -> &str {
        &self.devices
    }

    /// The number of devices.
    pub fn device_count(&self) -> usize {
        self.device_totals().len()
    }

    /// Total memory of device `index`, in bytes: the simulated size asked for, or on a real
    /// GPU what NVML reports. For tests that size what they ask for from the device.
    pub fn device_total(&self, index: usize) -> u64 {
        let totals = self.device_totals();
        *totals.get(index).unwrap_or_else(|| panic!("no device {index}: the machine has {}", totals.len()))
    }

    fn device_totals(&self) -> Vec<u64> {
        match &self.machine {
            Machine::Simulated(_) => simgpu_state::parse_device_list(&self.devices)
                .unwrap_or_else(|e| panic!("the simulated devices {:?}: {e}", self.devices)),
            Machine::Real(_) => real_machine().totals.clone(),
        }
    }

    /// simgpu's own view of its devices (the `SIMGPU_STATE` file that its NVML and driver
    /// read): what the device itself counts, per process and in all, beside any figure the
    /// shim shows. Panics on a real GPU, where the test should have been skipped.
    pub fn device_state(&self) -> simgpu_state::Machine {
        assert!(!self.is_real(), "simgpu's device state read on a real GPU: the test should skip there");
        let path = self.state_path();
        let path = path.to_str().unwrap_or_else(|| panic!("simgpu's state path {path:?} is not UTF-8"));
        simgpu_state::Machine::open(path, &self.device_totals())
            .unwrap_or_else(|e| panic!("cannot open simgpu's state {path}: {e}"))
    }

    /// What simgpu's device `device` counts for process `pid` (all its contexts; 0 when it
    /// holds nothing there): the figure NVML would report, whatever the shim believes.
    pub fn held_by(&self, pid: u32, device: usize) -> u64 {
        self.device_state().processes(device).iter().filter(|p| p.pid == pid).map(|p| p.used).sum()
    }

    /// What simgpu's device `device` counts for process `pid`, or `None` when the process is
    /// not listed there at all (as NVML's process list would leave it out).
    pub fn listed_holding(&self, pid: u32, device: usize) -> Option<u64> {
        self.device_state().processes(device).into_iter().find(|p| p.pid == pid).map(|p| p.used)
    }

    /// The `SIMGPU_CONTEXT_OVERHEAD` value (on a real GPU, the value asked for, not applied).
    pub fn context_overhead(&self) -> &str {
        &self.context_overhead
    }

    /// `size` (such as `"640MiB"`), a limit or request a test sized for simgpu's small
    /// contexts, for the test's processes: as is on simgpu; on a real GPU in bytes with
    /// [`REAL_CONTEXT_ROOM`] added, so that it also holds a real context.
    pub fn plus_real_context(&self, size: &str) -> String {
        if !self.is_real() {
            return size.to_owned();
        }
        let bytes =
            gpufrac_common::size::parse_bytes("a test's size", size).unwrap_or_else(|e| panic!("{e}"));
        (bytes + REAL_CONTEXT_ROOM).to_string()
    }

    /// A command for `program` that runs on this simulated machine: `LD_LIBRARY_PATH`
    /// starts with [`SimGpu::lib_dir`], the `SIMGPU_*` variables are set, and `LD_PRELOAD`
    /// and every `GPUFRAC_*` variable inherited from the test's environment are removed,
    /// so only what the test sets reaches the child. On a real GPU `LD_LIBRARY_PATH` is
    /// left as inherited (the real driver is found as any program finds it) and inherited
    /// `SIMGPU_*` variables are removed too.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let real = match &self.machine {
            Machine::Simulated(sim) => {
                sim.apply(&mut cmd);
                false
            }
            Machine::Real(_) => true,
        };
        cmd.env_remove("LD_PRELOAD");
        for (name, _) in std::env::vars_os() {
            let name_bytes = name.as_encoded_bytes();
            if name_bytes.starts_with(b"GPUFRAC_") || (real && name_bytes.starts_with(b"SIMGPU_")) {
                cmd.env_remove(name);
            }
        }
        cmd
    }

    /// [`SimGpu::command`] for `program` with the shim preloaded (`LD_PRELOAD` is the built
    /// `libgpufrac.so`) and none of its settings: add them with [`ShimSettings`]. With no
    /// `GPUFRAC_MEMORY_REQUEST` nor `GPUFRAC_MEMORY_LIMIT` the shim passes every call through.
    pub fn shimmed(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = self.command(program);
        cmd.preload_shim();
        cmd
    }
}

/// The folder of the C test programs and their headers (`tests/c/`).
pub fn c_source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("c")
}

/// Outputs this process has already built or found up to date.
static COMPILED: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);

/// A name for a temporary output beside `out`, unique across processes and threads.
fn temp_beside(out: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut name = out.file_name().expect("outputs have a file name").to_os_string();
    name.push(format!(".tmp.{}.{n}", std::process::id()));
    out.with_file_name(name)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Newest modification time of the files in `tests/c/` and of the running test binary
/// (which holds the compiler flags): any change there rebuilds.
fn newest_input() -> SystemTime {
    let dir = c_source_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let sources = entries.filter_map(|e| e.ok().and_then(|e| modified(&e.path())));
    let exe = std::env::current_exe().ok().and_then(|exe| modified(&exe));
    sources.chain(exe).max().unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Runs the system C compiler with `args`, writing `out` atomically: the compiler writes a
/// temporary file that is renamed over `out`, so tests compiling the same program at once
/// (in this or another process) never run a half-written one.
fn run_cc(out: &Path, args: &[OsString]) {
    let tmp = temp_beside(out);
    let mut cmd = Command::new("cc");
    cmd.args(args).arg("-o").arg(&tmp);
    let result = cmd.output().unwrap_or_else(|e| panic!("cannot run the C compiler `cc`: {e}"));
    if !result.status.success() {
        let _ = std::fs::remove_file(&tmp);
        panic!(
            "cc failed ({}) building {}:\n{:?}\n{}{}",
            result.status,
            out.display(),
            cmd,
            String::from_utf8_lossy(&result.stdout),
            String::from_utf8_lossy(&result.stderr)
        );
    }
    std::fs::rename(&tmp, out)
        .unwrap_or_else(|e| panic!("cannot move {} to {}: {e}", tmp.display(), out.display()));
}

/// Builds `out` with `args` unless this process already did, or it is newer than every
/// file in `tests/c/` and than the test binary.
fn build_once(out: &Path, args: &[OsString]) {
    let mut compiled = COMPILED.lock().unwrap_or_else(PoisonError::into_inner);
    let compiled = compiled.get_or_insert_with(HashSet::new);
    if compiled.contains(out) {
        return;
    }
    let fresh = modified(out).is_some_and(|built| built >= newest_input());
    if !fresh {
        run_cc(out, args);
    }
    compiled.insert(out.to_path_buf());
}

/// The folder in `target/<profile>/` where the C programs are built.
fn c_output_dir() -> PathBuf {
    let dir = target_dir().join("e2e-c");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// Builds the link-time stub `libcuda.so` (soname `libcuda.so.1`, every function failing)
/// from `tests/c/libcuda_stub.c`, as the CUDA toolkit ships one, and returns its folder.
///
/// Programs link against the stub, so they record a dependency on `libcuda.so.1` exactly
/// as programs built with the toolkit do, and need no driver to build. At run time the
/// loader finds the driver through `LD_LIBRARY_PATH` (the [`SimGpu`] symlinks, or a real
/// driver); the stub folder is never an rpath.
pub fn cuda_stub_dir() -> PathBuf {
    let dir = c_output_dir().join("stub");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    let out = dir.join("libcuda.so");
    let src = c_source_dir();
    let args: Vec<OsString> = vec![
        "-O1".into(),
        "-Wall".into(),
        "-Werror".into(),
        "-fPIC".into(),
        "-shared".into(),
        "-Wl,-soname,libcuda.so.1".into(),
        format!("-I{}", src.display()).into(),
        src.join("libcuda_stub.c").into(),
    ];
    build_once(&out, &args);
    dir
}

/// Compiles `tests/c/<source_name>` with the system `cc` (`-O1 -Wall -Werror`, each of
/// `defines` as `-D<define>`, `-ldl`, and with `link_cuda` also `-lcuda` against the stub
/// of [`cuda_stub_dir`]) into `target/<profile>/e2e-c/`, and returns the program's path.
///
/// The program's name is the source's stem followed by the defines
/// (`alloc_paths-MODE_LINKED`). It is rebuilt when any file in `tests/c/` or the test
/// binary is newer, at most once per test process, and written atomically, so parallel
/// tests may ask for it at once.
pub fn compile_c(source_name: &str, defines: &[&str], link_cuda: bool) -> PathBuf {
    let src = c_source_dir();
    let source = src.join(source_name);
    assert!(source.exists(), "no C test program {}", source.display());
    let stem = Path::new(source_name).file_stem().expect("a source file name").to_string_lossy();
    let mut name = stem.into_owned();
    for define in defines {
        name.push('-');
        name.extend(define.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }));
    }
    let out = c_output_dir().join(name);

    let mut args: Vec<OsString> = vec![
        "-std=gnu11".into(),
        "-O1".into(),
        "-Wall".into(),
        "-Werror".into(),
        format!("-I{}", src.display()).into(),
    ];
    args.extend(defines.iter().map(|d| OsString::from(format!("-D{d}"))));
    args.push(source.into());
    if link_cuda {
        args.push(format!("-L{}", cuda_stub_dir().display()).into());
        args.push("-lcuda".into());
    }
    args.push("-ldl".into());
    build_once(&out, &args);
    out
}

/// What a child printed on stderr, collected by a thread as it comes.
#[derive(Debug, Default)]
struct StderrBuffer {
    bytes: Mutex<Vec<u8>>,
    /// The reader reached the end of the pipe: everything the child wrote is in `bytes`.
    done: std::sync::atomic::AtomicBool,
}

/// A child process driven through its stdin, stdout and stderr, every wait bounded by a
/// timeout.
///
/// The test programs follow one protocol: they print `READY ...` (flushed) once they hold
/// what they were asked to, then read stdin until it is closed, release what they hold and
/// print `DONE`. A child still running when its `ChildProcess` is dropped (a failing test)
/// is killed and reaped.
#[derive(Debug)]
pub struct ChildProcess {
    description: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Every stdout line received so far, for diagnostics.
    stdout_seen: Vec<String>,
    stdout_closed: bool,
    /// A line read by `silent_for`, not yet returned.
    pending: Option<String>,
    stderr: Arc<StderrBuffer>,
    stderr_done: Receiver<()>,
    status: Option<ExitStatus>,
}

/// How a child's stdout reader thread reports: one message per line; the channel closes
/// at end of file.
fn read_lines(stdout: impl Read, lines: mpsc::Sender<String>) {
    for line in BufReader::new(stdout).lines() {
        match line {
            Ok(line) => {
                if lines.send(line).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

impl ChildProcess {
    /// Starts `cmd` with stdin, stdout and stderr piped.
    pub fn spawn(cmd: &mut Command) -> ChildProcess {
        let description = format!("{cmd:?}");
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {description}: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut stderr_pipe = child.stderr.take().expect("stderr is piped");

        let (line_tx, lines) = mpsc::channel();
        std::thread::spawn(move || read_lines(stdout, line_tx));

        let stderr = Arc::new(StderrBuffer::default());
        let (done_tx, stderr_done) = mpsc::channel();
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match stderr_pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        sink.bytes.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(&buf[..n])
                    }
                }
            }
            sink.done.store(true, std::sync::atomic::Ordering::Release);
            let _ = done_tx.send(());
        });

        ChildProcess {
            description,
            child,
            stdin,
            lines,
            stdout_seen: Vec::new(),
            stdout_closed: false,
            pending: None,
            stderr,
            stderr_done,
            status: None,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the child wrote on stderr so far; once it has been reaped ([`ChildProcess::wait`]
    /// and the `expect_*` that wait), all of it (the reader is given a second to catch up).
    pub fn stderr_text(&self) -> String {
        if self.status.is_some() {
            let deadline = Instant::now() + Duration::from_secs(1);
            while !self.stderr.done.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        String::from_utf8_lossy(&self.stderr.bytes.lock().unwrap_or_else(PoisonError::into_inner))
            .into_owned()
    }

    /// Everything known about the child, for a failure message: its command, the stdout
    /// lines seen, its stderr and its exit status.
    pub fn diagnostics(&mut self) -> String {
        if self.status.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.status = Some(status);
            }
        }
        if self.status.is_some() {
            // The child is gone: let the reader catch up with what it wrote last.
            let _ = self.stderr_done.recv_timeout(Duration::from_secs(1));
        }
        // Drain lines not yet consumed.
        while let Ok(line) = self.lines.try_recv() {
            self.stdout_seen.push(line);
        }
        let status = match self.status {
            Some(s) => describe_status(s),
            None => "still running".to_owned(),
        };
        format!(
            "{} (pid {}), {status}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.description,
            self.child.id(),
            self.stdout_seen.join("\n"),
            self.stderr_text()
        )
    }

    /// The next line the child prints, or `None` once its stdout is closed. Panics, with
    /// the child's diagnostics, if no line comes within `timeout`.
    pub fn next_line(&mut self, timeout: Duration) -> Option<String> {
        if let Some(line) = self.pending.take() {
            return Some(line);
        }
        if self.stdout_closed {
            return None;
        }
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                self.stdout_seen.push(line.clone());
                Some(line)
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.stdout_closed = true;
                None
            }
            Err(RecvTimeoutError::Timeout) => {
                let d = self.diagnostics();
                panic!("no output within {timeout:?} from {d}");
            }
        }
    }

    /// Whether the child stays silent for `period` (a line printed meanwhile is kept for
    /// the next read).
    pub fn silent_for(&mut self, period: Duration) -> bool {
        match self.lines.recv_timeout(period) {
            Ok(line) => {
                self.stdout_seen.push(line.clone());
                self.pending = Some(line);
                false
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.stdout_closed = true;
                false
            }
            Err(RecvTimeoutError::Timeout) => true,
        }
    }

    /// Reads lines until one whose first word is one of `words`, and returns that line.
    /// Panics, with the child's diagnostics, if its stdout ends first or `timeout` passes.
    pub fn expect_line(&mut self, words: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_line(left) {
                Some(line) if line.split_whitespace().next().is_some_and(|w| words.contains(&w)) => {
                    return line
                }
                Some(_) => continue,
                None => {
                    // Wait briefly for the exit status: it says why the output ended.
                    if let Some(status) = self.wait_timeout(Duration::from_secs(5)) {
                        self.status = Some(status);
                    }
                    let d = self.diagnostics();
                    panic!("expected a line starting with one of {words:?}, but the output ended: {d}");
                }
            }
        }
    }

    /// Waits for the `READY` line and returns the numbers that follow the word.
    pub fn ready(&mut self) -> Vec<u64> {
        let line = self.expect_line(&["READY"], TIMEOUT);
        let values: Result<Vec<u64>, _> = line.split_whitespace().skip(1).map(str::parse).collect();
        match values {
            Ok(values) => values,
            Err(e) => {
                let d = self.diagnostics();
                panic!("malformed line {line:?} ({e}) from {d}");
            }
        }
    }

    /// Closes the child's stdin: a test program takes this as the signal to release what
    /// it holds and finish.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Writes `text` to the child's stdin.
    pub fn write_stdin(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("stdin was already closed");
        stdin.write_all(text.as_bytes()).and_then(|()| stdin.flush()).expect("the child reads its stdin");
    }

    /// Sends `SIGKILL`. The child is not reaped: see [`ChildProcess::wait_terminated`] and
    /// [`ChildProcess::wait`].
    pub fn kill(&mut self) {
        if self.status.is_none() {
            // An error only means it already exited, which the following wait reports.
            let _ = self.child.kill();
        }
    }

    /// Waits up to `timeout` for the child to exit and reaps it.
    fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.status {
            return Some(status);
        }
        if !wait_terminated(self.child.id(), timeout) {
            return None;
        }
        let status = self.child.wait().expect("waiting for a child that has exited");
        self.status = Some(status);
        Some(status)
    }

    /// Waits for the child to exit, reaps it and returns its status. Panics, with the
    /// child's diagnostics, if it does not exit within `timeout` (the child is then killed).
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        match self.wait_timeout(timeout) {
            Some(status) => status,
            None => {
                let d = self.diagnostics();
                self.kill();
                panic!("still running after {timeout:?}: {d}");
            }
        }
    }

    /// Waits until the child has terminated, without reaping it: it stays a zombie until
    /// [`ChildProcess::wait`] or the drop. Panics if it is still running after `timeout`.
    pub fn wait_terminated(&mut self, timeout: Duration) {
        if self.status.is_none() && !wait_terminated(self.child.id(), timeout) {
            let d = self.diagnostics();
            panic!("still running after {timeout:?}: {d}");
        }
    }

    /// The end of the protocol: closes stdin, expects `DONE`, and expects the child to exit
    /// with status 0. Panics, with the child's diagnostics, otherwise.
    pub fn finish(&mut self) {
        self.close_stdin();
        self.expect_line(&["DONE"], TIMEOUT);
        self.expect_exit_code(0);
    }

    /// Waits for the child to exit and panics, with its diagnostics, unless its exit code is
    /// `code`.
    pub fn expect_exit_code(&mut self, code: i32) {
        let status = self.wait(TIMEOUT);
        if status.code() != Some(code) {
            let d = self.diagnostics();
            panic!("expected exit code {code}: {d}");
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A failing test: every child's side of the story, not only the one it failed on.
        if std::thread::panicking() {
            let stderr = self.stderr_text();
            let from =
                (stderr.len().saturating_sub(4000)..stderr.len()).find(|&i| stderr.is_char_boundary(i));
            let tail = &stderr[from.unwrap_or(stderr.len())..];
            eprintln!("--- stderr of pid {} ---\n{tail}", self.child.id());
        }
    }
}

/// "exit code 3", "killed by signal 9".
pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => format!("{status}"),
    }
}

/// Waits up to `timeout` for the child `pid` (not yet reaped) to terminate, leaving it
/// unreaped. True once it has.
fn wait_terminated(pid: u32, timeout: Duration) -> bool {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; `pid`
    // is our own unreaped child, so it cannot name another process.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd >= 0 {
        let fd = fd as libc::c_int;
        let deadline = Instant::now() + timeout;
        let ready = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            let ms = left.as_millis().min(i32::MAX as u128) as libc::c_int;
            // SAFETY: `poll` is one valid pollfd and the count says one.
            let n = unsafe { libc::poll(&mut poll, 1, ms) };
            if n > 0 {
                break true;
            }
            if n == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                break false;
            }
        };
        // SAFETY: `fd` is the descriptor pidfd_open returned above, closed once.
        unsafe { libc::close(fd) };
        return ready;
    }
    // Kernels before 5.3: ask without reaping, a few times a millisecond apart.
    let deadline = Instant::now() + timeout;
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is valid for writes; WNOWAIT leaves the child unreaped.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: waitid filled `info` (or left it zeroed, pid 0, when nothing exited).
        if r == 0 && unsafe { info.si_pid() } != 0 {
            return true;
        }
        if r != 0 || Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The state letter of a process from `/proc/<pid>/stat` (`R`, `S`, `Z` for a zombie...),
/// or `None` if there is no such process.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may contain spaces and parentheses; the state follows the last ')'.
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// Sizes in bytes, for readable constants in tests.
pub mod size {
    /// One mebibyte.
    pub const MIB: u64 = 1 << 20;
    /// One gibibyte.
    pub const GIB: u64 = 1 << 30;

    /// `bytes` as a number of MiB with two decimals, for messages.
    pub fn mib(bytes: u64) -> String {
        format!("{:.2}MiB", bytes as f64 / MIB as f64)
    }
}

/// A `gpufrac-arbiter` serving a [`SimGpu`], on a socket in the simulated GPU's folder.
/// Dropping it kills it.
pub struct Arbiter {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Arbiter {
    /// Starts an arbiter and waits until it answers on its socket.
    pub fn start(gpu: &SimGpu) -> Arbiter {
        Arbiter::start_at(gpu, gpu.lib_dir().join("arbiter.sock"), &[])
    }

    /// Starts an arbiter on `socket` with extra arguments.
    pub fn start_at(gpu: &SimGpu, socket: PathBuf, args: &[&str]) -> Arbiter {
        Arbiter::start_with_env(gpu, socket, args, &[])
    }

    /// [`Arbiter::start_at`] with `env` added to the arbiter's environment (which
    /// [`SimGpu::command`] otherwise clears of `LD_PRELOAD` and `GPUFRAC_*`).
    pub fn start_with_env(gpu: &SimGpu, socket: PathBuf, args: &[&str], env: &[(&str, &OsStr)]) -> Arbiter {
        let log = socket.with_extension(format!(
            "log.{}",
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        ));
        let log_file = std::fs::File::create(&log).expect("arbiter log file");
        let child = gpu
            .command(artifact("gpufrac-arbiter"))
            .arg("--socket")
            .arg(&socket)
            .args(args)
            // `GPUFRAC_TEST_ARBITER_LOG` (a `GPUFRAC_LOG` filter) raises what the
            // arbiters of a test run write, for a failure that needs the policy's reasons.
            .env("GPUFRAC_LOG", std::env::var("GPUFRAC_TEST_ARBITER_LOG").unwrap_or_else(|_| "info".into()))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start gpufrac-arbiter");
        let arbiter = Arbiter { child, socket, log };
        arbiter.wait_serving();
        arbiter
    }

    fn wait_serving(&self) {
        let deadline = Instant::now() + TIMEOUT;
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "the arbiter never served {}: {}",
                self.socket.display(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The socket shims connect to (`GPUFRAC_ARBITER_SOCKET`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the arbiter logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills it with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops it with SIGTERM and waits for it to exit.
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait for the arbiter")
    }
}

impl Arbiter {
    /// The address the arbiter's `--metrics` listener bound, from its `serving metrics
    /// addr=...` log line: start it with `--metrics 127.0.0.1:0` and the system picks a
    /// free port, with no race against other programs for it.
    pub fn metrics_addr(&self) -> std::net::SocketAddr {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let log = self.log_text();
            let said =
                log.lines().filter(|l| l.contains("serving metrics")).find_map(|l| log_field(l, "addr"));
            if let Some(addr) = said.and_then(|a| a.parse().ok()) {
                return addr;
            }
            assert!(Instant::now() < deadline, "the arbiter never said where it serves metrics:\n{log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The body of the arbiter's `GET /metrics` (started with `--metrics 127.0.0.1:0`);
    /// panics unless it answers 200.
    pub fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let address = self.metrics_addr();
        let mut http = std::net::TcpStream::connect(address).expect("the arbiter's metrics port");
        http.set_read_timeout(Some(TIMEOUT)).expect("a read timeout");
        http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("the metrics request");
        let mut response = String::new();
        http.read_to_string(&mut response).expect("the metrics");
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not HTTP: {response}"));
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_owned()
    }

    /// Waits until the arbiter's log has a line containing `words` and returns that line;
    /// fails the test after [`TIMEOUT`]. Synchronises a test on what the arbiter did, not on
    /// a sleep.
    pub fn wait_for_log(&self, words: &str) -> String {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let log = self.log_text();
            if let Some(line) = log.lines().find(|l| l.contains(words)) {
                return line.to_owned();
            }
            assert!(Instant::now() < deadline, "the arbiter never logged {words:?}:\n{log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// How long, in milliseconds, the arbiter had made each burst of process `pid` wait
    /// when it denied it for `reason` (`"Timeout"`, `"NeverFits"`...), in order: read from
    /// its `burst denied` log lines (INFO), the arbiter's own account of a refusal.
    pub fn denials(&self, pid: u32, reason: &str) -> Vec<u64> {
        let pid = pid.to_string();
        self.log_text()
            .lines()
            .filter(|l| l.contains("burst denied"))
            .filter(|l| log_field(l, "pid") == Some(pid.as_str()) && log_field(l, "reason") == Some(reason))
            .map(|l| {
                log_field(l, "waited_ms")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no waited_ms in the arbiter's line {l:?}"))
            })
            .collect()
    }
}

/// The value of the field `name` in a log line of `name=value` fields (the arbiter's and
/// the shim's format), without quotes.
pub fn log_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let prefix = format!("{name}=");
    line.split_whitespace().find_map(|w| w.strip_prefix(prefix.as_str())).map(|v| v.trim_matches('"'))
}

/// The words of the shim's line for a burst the arbiter did not grant (on its stderr, at
/// the default log level): `gpufrac: out of memory: a burst of N bytes above the request
/// was not granted: <why>`.
pub const NOT_GRANTED: &str = "above the request was not granted";

/// The reason the shim gives after [`NOT_GRANTED`] for a wait that timed out.
pub const WAIT_TIMED_OUT: &str = "GPUFRAC_WAIT_TIMEOUT passed while the memory was lent to others";

/// Where the shim keeps the ledger of `group` (as `gpufrac_core::ledger::group_path` says):
/// in the effective user's folder `/dev/shm/gpufrac-<euid>/`.
pub fn ledger_path(group: &str) -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    dir.join(format!("gpufrac-{uid}")).join(format!("{group}.ledger"))
}

/// Group ledgers live in /dev/shm by name: a group name unique to this test process and call.
pub fn unique(group: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{group}-{}-{n}", std::process::id())
}

/// What `gpufrac status` shows.
pub fn status(arbiter: &Arbiter) -> gpufrac_daemon::status::Status {
    gpufrac_daemon::status::fetch(arbiter.socket()).expect("gpufrac status")
}

/// Polls the status until `cond` holds; fails the test after [`TIMEOUT`].
pub fn wait_for(
    arbiter: &Arbiter,
    what: &str,
    cond: impl Fn(&gpufrac_daemon::status::Status) -> bool,
) -> gpufrac_daemon::status::Status {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let s = status(arbiter);
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}\n{}", arbiter.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sweeps dead group ledgers when the [`SimGpu`] holding it goes: tests kill group
/// members on purpose (SIGKILL runs no exit hook), and their ledgers go with the machine
/// they ran on. Ledgers other tests still use are left. Then the empty ledger folders
/// go, this user's (`sweep`) and those of the users the tests run processes as (only an empty
/// folder can be removed; a shim making a ledger meanwhile makes its folder again).
#[derive(Debug, Default)]
struct LedgerSweep;

impl Drop for LedgerSweep {
    fn drop(&mut self) {
        let _ = gpufrac_common::shm::ledgers::sweep();
        let Some(base) = gpufrac_common::shm::ledgers::dir().parent().map(Path::to_path_buf) else { return };
        for entry in std::fs::read_dir(base).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let uid =
                name.to_str().and_then(|n| n.strip_prefix("gpufrac-")).and_then(|u| u.parse::<u32>().ok());
            // `nobody` is the user tests/trust.rs runs processes as (shim_files.rs cleans
            // up after its own users: it plants folders for them that must not go early).
            if uid == Some(65534) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        self.kill();
        // `GPUFRAC_TEST_KEEP_LOGS`: a folder that keeps every arbiter's log, passing
        // tests' too (a stall that did not fail a test this time).
        if let Some(keep) = std::env::var_os("GPUFRAC_TEST_KEEP_LOGS") {
            if let Some(name) = self.log.file_name() {
                let _ = std::fs::copy(&self.log, Path::new(&keep).join(name));
            }
        }
        // A failing test: what the arbiter saw is the first thing to read.
        if std::thread::panicking() {
            eprintln!("--- log of the arbiter on {} ---\n{}", self.socket.display(), self.log_text());
        }
    }
}

/// `alloc_paths alloc` (the dlsym build) under the shim and the arbiter, as the arbiter's
/// tests run their bursting servers: group `group`, a 1 GiB request and a 3 GiB limit,
/// `resolver` and `priority`, each wait up to `wait`, allocating 32 MiB steps up to
/// `upto` bytes. Returned unstarted, so that a test can add to its environment.
pub fn bursting_server(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    group: &str,
    upto: u64,
    wait: &str,
    resolver: &str,
    priority: i32,
) -> Command {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("1GiB")
        .memory_limit("3GiB")
        .resolver(resolver)
        .priority(priority.to_string())
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout(wait)
        .args(["alloc", &(32u64 << 20).to_string(), &upto.to_string()]);
    cmd
}

#[cfg(test)]
mod skip_records {
    use super::{read_skips, Skip, SkipRecord};

    #[test]
    fn records_read_back_sorted_by_test_and_a_stray_line_is_an_error() {
        let dir = std::env::temp_dir().join(format!("gpufrac-skip-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read_skips(&dir), Ok(Vec::new()), "no folder: no skips");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("b::two"), "pytorch\tb::two\tPyTorch is not installed\n").unwrap();
        std::fs::write(dir.join("a::one"), "this-machine\ta::one\tneeds root\tand a tab\n").unwrap();
        let read = read_skips(&dir).unwrap();
        assert_eq!(
            read,
            [
                SkipRecord {
                    kind: Skip::ThisMachine,
                    test: "a::one".into(),
                    reason: "needs root\tand a tab".into()
                },
                SkipRecord {
                    kind: Skip::PyTorch,
                    test: "b::two".into(),
                    reason: "PyTorch is not installed".into()
                },
            ]
        );
        assert!(Skip::PyTorch.expected_on_ci() && !Skip::ThisMachine.expected_on_ci());
        std::fs::write(dir.join("c::three"), "sometimes\tc::three\twhy\n").unwrap();
        let err = read_skips(&dir).unwrap_err();
        assert!(err.contains("unknown kind of skip \"sometimes\""), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
