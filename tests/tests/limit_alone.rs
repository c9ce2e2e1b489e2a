//! A limit is always a limit: `GPUFRAC_MEMORY_LIMIT` without `GPUFRAC_MEMORY_REQUEST`
//! guarantees nothing (a request of 0 bytes) and holds the process to the limit, whether
//! the shim comes from `LD_PRELOAD`, from `gpufrac run --limit` or from
//! `/etc/ld.so.preload`; with an arbiter, all it holds is a burst the arbiter lent.
//! Real processes on an 8 GiB simulated GPU held to 2 GiB.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, report_skip, skip_on_real_gpu, wait_for, Arbiter, ChildProcess, ShimSettings,
    SimGpu, Skip,
};

const DEVICE: u64 = 8 * GIB;
/// Why the tests here need simgpu: they check sizes to the byte against its 64 MiB contexts
/// on its 8 GiB device.
const EXACT: &str = "exact sizes against simgpu's 64 MiB contexts (SIMGPU_CONTEXT_OVERHEAD) and 8 GiB device";
const LIMIT: u64 = 2 * GIB;
const OVERHEAD: u64 = 64 * MIB;
/// The module of built-in kernels the probe loads: its code and globals are device
/// memory the group is charged for (`SIMGPU_MODULE_BYTES`, 2 MiB by default).
const MODULE: u64 = 2 * MIB;
const CHUNK: u64 = 32 * MIB;

fn gpu() -> SimGpu {
    SimGpu::new("8GiB").with_context_overhead("64MiB")
}

/// `program` with the shim preloaded and only `GPUFRAC_MEMORY_LIMIT=2GiB` set.
fn limited(gpu: &SimGpu, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = gpu.shimmed(program);
    cmd.memory_limit("2GiB");
    cmd
}

fn alloc_paths(mode: &str) -> PathBuf {
    match mode {
        "linked" => compile_c("alloc_paths.c", &["MODE_LINKED"], true),
        "dlsym" => compile_c("alloc_paths.c", &["MODE_DLSYM"], false),
        _ => compile_c("alloc_paths.c", &["MODE_PROCADDR"], false),
    }
}

fn output(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// `alloc_paths` allocates chunks until one fails with `CUDA_ERROR_OUT_OF_MEMORY` (any
/// other error ends it with exit status 1), then prints `READY <held> <free> <total>`:
/// the process was stopped at the limit by out-of-memory, with the limit as its device.
fn assert_held_to_the_limit(child: &mut ChildProcess, what: &str) {
    let v = child.ready();
    let (held, free, total) = (v[0], v[1], v[2]);
    let room = LIMIT - OVERHEAD;
    assert_eq!(total, LIMIT, "{what}: cuMemGetInfo's total is the limit, not the 8 GiB device");
    assert!(
        held <= room && held + CHUNK > room,
        "{what}: out of memory at the limit: held {} of the {} the limit leaves after the context\n{}",
        mib(held),
        mib(room),
        child.diagnostics()
    );
    assert_eq!(free, room - held, "{what}: free = limit - held");
    // alloc_paths checks that freeing everything brings free back to limit - context.
    child.close_stdin();
    child.finish();
}

fn held_to_the_limit(mode: &str, path: &str) {
    let gpu = gpu();
    let mut child = ChildProcess::spawn(limited(&gpu, alloc_paths(mode)).arg(path).arg(CHUNK.to_string()));
    assert_held_to_the_limit(&mut child, &format!("{mode}/{path}"));
}

#[test]
fn linked_alloc_stops_at_the_limit_with_out_of_memory() {
    skip_on_real_gpu!(EXACT);
    held_to_the_limit("linked", "alloc");
}

#[test]
fn dlsym_async_stops_at_the_limit_with_out_of_memory() {
    skip_on_real_gpu!(EXACT);
    held_to_the_limit("dlsym", "async");
}

#[test]
fn procaddr_vmm_stops_at_the_limit_with_out_of_memory() {
    skip_on_real_gpu!(EXACT);
    held_to_the_limit("procaddr", "vmm");
}

#[test]
fn cuda_and_nvml_show_the_limit_as_the_device() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let probe = env!("CARGO_BIN_EXE_simgpu_probe");
    // cuMemGetInfo, cuDeviceTotalMem and NVML agree (the probe asserts it) on the limit.
    let (out, stdout, stderr) = output(limited(&gpu, probe).arg("slice"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("SLICE {LIMIT} {}", OVERHEAD + MODULE + 100 * MIB));
    // So does an NVML-only tool (nvidia-smi) under the same setting.
    let (out, stdout, stderr) = output(limited(&gpu, probe).arg("nvml-only"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("NVML {LIMIT} 0"));
    // Without the limit, the same probe sees the whole device: the test is not vacuous.
    let (out, stdout, stderr) = output(gpu.shimmed(probe).arg("nvml-only"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("NVML {DEVICE} 0"));
}

#[test]
fn gpufrac_h_reports_a_request_of_nothing_and_the_limit() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let (out, stdout, stderr) = output(&mut limited(&gpu, compile_c("query.c", &[], false)));
    assert!(out.status.success(), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[1], "ENABLED 1 COUNT 1", "{stdout}");
    let held = OVERHEAD + 64 * MIB;
    assert_eq!(lines[2], format!("INFO 0 0 {LIMIT} {held} {held} {DEVICE}"), "{stdout}");
    assert_eq!(lines[3], format!("GETTERS 0 {LIMIT} {held}"), "{stdout}");
}

#[test]
fn a_cudarc_server_under_gpufrac_run_limit_alone_gets_out_of_memory_past_it() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    // README's quick start, with --limit alone.
    let (out, stdout, stderr) = output(
        gpu.command(artifact("gpufrac"))
            .args(["run", "--limit", "2GiB", "--"])
            .arg(artifact("sample-inference-server"))
            .args(["--name", "t", "--model", "512MiB", "--batches", "256MiB,1GiB,2GiB", "--steps", "3"]),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(&format!("t started device=0 total={LIMIT}")), "{stdout}");
    // 64 MiB context + 512 MiB model + a 2 GiB batch > 2 GiB: CUDA_ERROR_OUT_OF_MEMORY.
    assert!(stdout.contains(&format!("t out-of-memory batch=2 bytes={}", 2 * GIB)), "{stdout}");
    assert!(stdout.contains("t done served=2 out-of-memory=1"), "{stdout}");
}

#[test]
fn gpufrac_run_limit_alone_holds_the_command_to_it_and_guarantees_nothing() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let mut cmd = gpu.command(artifact("gpufrac"));
    cmd.args(["run", "--limit", "2GiB", "--"]).arg(alloc_paths("dlsym")).args(["alloc", &CHUNK.to_string()]);
    assert_held_to_the_limit(&mut ChildProcess::spawn(&mut cmd), "gpufrac run --limit");

    // A request inherited from gpufrac's own environment does not sneak in: the command's
    // slice is what the flags say.
    let (out, stdout, stderr) = output(
        gpu.command(artifact("gpufrac"))
            .env("GPUFRAC_MEMORY_REQUEST", "1GiB")
            .args(["run", "--limit", "2GiB", "--"])
            .arg(compile_c("query.c", &[], false)),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    let held = OVERHEAD + 64 * MIB;
    assert!(stdout.contains(&format!("INFO 0 0 {LIMIT} {held} {held} {DEVICE}")), "{stdout}");

    // Neither --request nor --limit: refused before anything runs, naming both.
    let (out, stdout, stderr) = output(gpu.command(artifact("gpufrac")).args(["run", "--", "true"]));
    assert!(!out.status.success(), "accepted: {stdout}");
    assert!(stderr.contains("--request") && stderr.contains("--limit"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

#[test]
fn with_an_arbiter_all_it_holds_is_a_burst_the_arbiter_lent() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut cmd = limited(&gpu, alloc_paths("dlsym"));
    cmd.arbiter_socket(arbiter.socket()).args(["alloc", &CHUNK.to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    let v = child.ready();
    let (held, total) = (v[0], v[2]);
    let room = LIMIT - OVERHEAD;
    assert_eq!(total, LIMIT, "the limit is the device\n{}", arbiter.log_text());
    assert!(
        held <= room && held + CHUNK > room,
        "the arbiter lent everything up to the limit, and no more: held {}\n{}\n{}",
        mib(held),
        child.diagnostics(),
        arbiter.log_text()
    );
    let pid = child.pid();
    // (`held` in the status is what the shim said at its last ask, before its last grant.)
    let s = wait_for(&arbiter, "the process listed with its grants", |s| {
        s.gpus[0].processes.iter().any(|p| p.pid == pid && p.granted >= held + OVERHEAD)
    });
    let gpu_status = &s.gpus[0];
    let p = gpu_status.processes.iter().find(|p| p.pid == pid).expect("listed");
    assert_eq!((p.request, p.limit), (0, LIMIT), "registered with nothing guaranteed: {p:?}");
    assert_eq!(gpu_status.guaranteed, 0, "nothing reserved on the GPU: {gpu_status:?}");
    // Everything it holds, its context included, was lent: a burst, within the limit.
    assert!(p.granted >= held + OVERHEAD && p.granted <= LIMIT && p.held <= p.granted, "{p:?}");
    assert_eq!(gpu_status.burst, p.granted, "{gpu_status:?}");
    assert_eq!(p.state, "running");

    // `gpufrac status` shows it so.
    let out = Command::new(artifact("gpufrac"))
        .args(["status", "--socket"])
        .arg(arbiter.socket())
        .output()
        .expect("gpufrac status");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(table.contains("guaranteed 0.00GiB"), "{table}");
    let pid_text = pid.to_string();
    let row = table.lines().find(|l| l.split_whitespace().next() == Some(pid_text.as_str()));
    let row = row.unwrap_or_else(|| panic!("a row for pid {pid}: {table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // PID GROUP POD REQUEST LIMIT HELD ...
    assert_eq!(&cells[3..5], ["0.00GiB", "2.00GiB"], "request 0, limit 2 GiB: {row}");

    // Its memory goes back to the arbiter when it lets go.
    child.close_stdin();
    child.finish();
    let s = wait_for(&arbiter, "everything given back", |s| s.gpus[0].processes.is_empty());
    assert_eq!((s.gpus[0].burst, s.gpus[0].guaranteed), (0, 0));
}

/// The shell script run in a private mount namespace: it makes `/etc/ld.so.preload`
/// name the shim there (a file bound over an existing one, else an overlay of `/etc` on a
/// private tmpfs), then runs the command. Arguments: shim, an empty folder, command...
const PRELOAD_FROM_ETC: &str = r#"set -e
shim="$1"; scratch="$2"; shift 2
mount -t tmpfs gpufrac-test "$scratch"
if [ -e /etc/ld.so.preload ]; then
    printf '%s\n' "$shim" > "$scratch/ld.so.preload"
    mount --bind "$scratch/ld.so.preload" /etc/ld.so.preload
else
    mkdir "$scratch/upper" "$scratch/work"
    printf '%s\n' "$shim" > "$scratch/upper/ld.so.preload"
    mount -t overlay gpufrac-test -o "lowerdir=/etc,upperdir=$scratch/upper,workdir=$scratch/work" /etc
fi
exec "$@"
"#;

/// `program` on `gpu` with the shim named by `/etc/ld.so.preload` in a private mount
/// namespace (never the machine's own file), `LD_PRELOAD` unset.
fn preloaded_from_etc(gpu: &SimGpu, scratch: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = gpu.command("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c", PRELOAD_FROM_ETC, "sh"])
        .arg(artifact("libgpufrac.so"))
        .arg(scratch)
        .arg(program)
        .memory_limit("2GiB");
    cmd
}

/// What `/etc/ld.so.preload` holds on the machine (`None`: no such file).
fn machine_preload() -> Option<Vec<u8>> {
    std::fs::read("/etc/ld.so.preload").ok()
}

#[test]
fn from_etc_ld_so_preload_a_limit_alone_is_enforced_too() {
    skip_on_real_gpu!(EXACT);
    let before = machine_preload();
    let gpu = gpu();
    let scratch = gpu.lib_dir().join("preload-namespace");
    std::fs::create_dir_all(&scratch).expect("a scratch folder");

    // Can this machine make the namespace (root can: CI runs as root)? If not, say why and
    // skip this one case.
    let probe = preloaded_from_etc(&gpu, &scratch, "cat").arg("/etc/ld.so.preload").output();
    let why_not = match &probe {
        Err(e) => Some(format!("cannot run unshare: {e}")),
        Ok(out) if !out.status.success() => {
            Some(format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
        }
        Ok(_) => None,
    };
    if let Some(why) = why_not {
        assert_eq!(machine_preload(), before, "the machine's /etc/ld.so.preload is untouched");
        report_skip(
            Skip::ThisMachine,
            &format!("no private mount namespace with its own /etc/ld.so.preload could be made here ({why})"),
        );
        return;
    }
    let out = probe.expect("checked above");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.trim(), artifact("libgpufrac.so").display().to_string(), "{stderr}");
    assert_eq!(machine_preload(), before, "the namespace's file is not the machine's");

    // Held to the limit, with out-of-memory past it, and the limit shown as the device.
    let mut child = ChildProcess::spawn(
        preloaded_from_etc(&gpu, &scratch, alloc_paths("dlsym")).args(["alloc", &CHUNK.to_string()]),
    );
    // `unshare` and `sh` exec the program in place: the child's PID is the program's.
    // Once it is ready, the shim is in it, though no LD_PRELOAD named it.
    let pid = child.pid();
    let v = child.ready();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    assert!(maps.contains("libgpufrac.so"), "the shim is loaded from /etc/ld.so.preload");
    assert!(maps.contains("alloc_paths"), "the process is the program");
    assert!(!environ.split(|&b| b == 0).any(|v| v.starts_with(b"LD_PRELOAD=")), "no LD_PRELOAD");
    let (held, free, total) = (v[0], v[1], v[2]);
    let room = LIMIT - OVERHEAD;
    assert_eq!(total, LIMIT, "cuMemGetInfo's total is the limit");
    assert!(held <= room && held + CHUNK > room, "held {} of {}", mib(held), mib(room));
    assert_eq!(free, room - held);
    child.close_stdin();
    child.finish();

    // CUDA, cuDeviceTotalMem and NVML agree on the limit.
    let probe = env!("CARGO_BIN_EXE_simgpu_probe");
    let (out, stdout, stderr) = output(preloaded_from_etc(&gpu, &scratch, probe).arg("slice"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("SLICE {LIMIT} {}", OVERHEAD + MODULE + 100 * MIB));

    assert_eq!(machine_preload(), before, "the machine's /etc/ld.so.preload is untouched");
}
