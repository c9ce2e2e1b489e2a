//! The shim holds a group to its limit on every allocation path, whichever way a program
//! reaches the driver, shows the limit as the device's size (CUDA and NVML), shares one
//! limit across the processes of a group, charges contexts, gives a killed member's
//! memory back, and refuses bad settings clearly. Real processes on simgpu.

use std::path::PathBuf;
use std::process::{Command, Output};

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{artifact, compile_c, skip_on_real_gpu, ChildProcess, ShimSettings, SimGpu};

const DEVICE: &str = "2GiB";
const OVERHEAD: u64 = 64 * MIB;
/// The module of built-in kernels the probe loads: its code and globals are device
/// memory the group is charged for (`SIMGPU_MODULE_BYTES`, 2 MiB by default).
const MODULE: u64 = 2 * MIB;
const REQUEST: u64 = 256 * MIB;
const LIMIT: u64 = 640 * MIB;
const CHUNK: u64 = 32 * MIB;
/// Why most tests here need simgpu: they check sizes to the byte.
const EXACT: &str = "exact sizes from simgpu's 64 MiB contexts (SIMGPU_CONTEXT_OVERHEAD) on its 2 GiB device";

fn gpu() -> SimGpu {
    SimGpu::new(DEVICE).with_context_overhead("64MiB")
}

/// A command under the shim with a 256 MiB request and a 640 MiB limit.
fn shimmed(gpu: &SimGpu, program: impl Into<PathBuf>) -> Command {
    let mut cmd = gpu.shimmed(program.into());
    cmd.memory_request(REQUEST.to_string()).memory_limit("640MiB");
    cmd
}

fn program(mode: &str) -> PathBuf {
    match mode {
        "linked" => compile_c("alloc_paths.c", &["MODE_LINKED"], true),
        "dlsym" => compile_c("alloc_paths.c", &["MODE_DLSYM"], false),
        _ => compile_c("alloc_paths.c", &["MODE_PROCADDR"], false),
    }
}

/// One process fills its slice through `path`: it gets all of the limit but its
/// context (less than a chunk short), sees the limit as the device size, and gets its
/// memory back exactly when it frees.
fn held_to_the_limit(mode: &str, path: &str) {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let mut cmd = shimmed(&gpu, program(mode));
    cmd.arg(path).arg(CHUNK.to_string());
    let mut child = ChildProcess::spawn(&mut cmd);
    let v = child.ready();
    let (held, free, total) = (v[0], v[1], v[2]);
    let room = LIMIT - OVERHEAD;
    assert_eq!(total, LIMIT, "{mode}/{path}: cuMemGetInfo total is the limit");
    assert!(
        held <= room && held + CHUNK > room,
        "{mode}/{path}: held {} of the {} the limit leaves after the context",
        mib(held),
        mib(room)
    );
    assert_eq!(free, LIMIT - OVERHEAD - held, "{mode}/{path}: free = limit - held");
    // alloc_paths checks that freeing everything brings free back to limit - context.
    child.close_stdin();
    child.finish();
}

macro_rules! cases {
    ($($mode:ident: [$($path:ident),*];)*) => {
        $(mod $mode {
            $(#[test] fn $path() { super::held_to_the_limit(stringify!($mode), super::path_name(stringify!($path))); })*
        })*
    };
}

fn path_name(test: &str) -> &str {
    test.trim_end_matches('_')
}

cases! {
    linked: [alloc, pitch, managed, async_, pool, array, array3d, vmm];
    dlsym: [alloc, pitch, managed, async_, pool, array, array3d, vmm];
    procaddr: [alloc, pitch, managed, async_, pool, array, array3d, vmm];
}

fn output(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

#[test]
fn without_a_request_the_shim_passes_everything_through() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let mut cmd = gpu.shimmed(program("dlsym"));
    cmd.args(["alloc", &CHUNK.to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    let v = child.ready();
    assert_eq!(v[2], 2 * GIB, "the whole device is visible");
    assert!(v[0] + CHUNK > 2 * GIB - OVERHEAD);
    child.close_stdin();
    child.finish();
}

#[test]
fn cuda_and_nvml_show_the_slice_even_to_nvml_only_tools() {
    skip_on_real_gpu!(
        "simgpu_probe loads simgpu's built-in kernels; the use shown is simgpu's 64 MiB context + 100 MiB"
    );
    let gpu = gpu();
    let probe = env!("CARGO_BIN_EXE_simgpu_probe");
    let (out, stdout, stderr) = output(shimmed(&gpu, probe).arg("slice"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("SLICE {LIMIT} {}", OVERHEAD + MODULE + 100 * MIB));

    // A group member holds memory; nvidia-smi-like tools of the group see it, in the slice.
    let mut holder = ChildProcess::spawn(shimmed(&gpu, probe).group("smi").args(["hold", "104857600"]));
    holder.ready();
    let (out, stdout, stderr) = output(shimmed(&gpu, probe).group("smi").arg("nvml-only"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), format!("NVML {LIMIT} {}", OVERHEAD + MODULE + 100 * MIB));
    holder.close_stdin();
    holder.finish();
}

fn group_member(gpu: &SimGpu, group: &str, limit_bytes: Option<u64>) -> ChildProcess {
    let mut cmd = shimmed(gpu, program("linked"));
    cmd.group(group).arg("alloc").arg(CHUNK.to_string());
    if let Some(limit) = limit_bytes {
        cmd.arg(limit.to_string());
    }
    ChildProcess::spawn(&mut cmd)
}

#[test]
fn processes_of_a_group_share_one_limit_and_each_context_counts() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let group = format!("share-{}", std::process::id());
    let mut a = group_member(&gpu, &group, Some(256 * MIB));
    let ra = a.ready();
    assert_eq!(ra[0], 256 * MIB);
    let mut b = group_member(&gpu, &group, None);
    let rb = b.ready();
    let room = LIMIT - 2 * OVERHEAD - 256 * MIB;
    assert!(rb[0] <= room && rb[0] + CHUNK > room, "B holds {} of the {} A left", mib(rb[0]), mib(room));
    assert_eq!(rb[2], LIMIT);
    assert!(rb[1] < CHUNK, "the group's slice is full");
    // Another group is not affected.
    let mut c = group_member(&gpu, &format!("other-{}", std::process::id()), Some(256 * MIB));
    assert_eq!(c.ready()[0], 256 * MIB);
    // Each checks that freeing brings free back to what it saw after its context: B's
    // view includes A, so B finishes first.
    let ledger = gpufrac_e2e::ledger_path(&group);
    assert!(ledger.exists(), "{} is the group's ledger", ledger.display());
    for p in [&mut c, &mut b] {
        p.close_stdin();
        p.finish();
    }
    assert!(ledger.exists(), "A is still a member: the ledger stays");
    a.close_stdin();
    a.finish();
    assert!(!ledger.exists(), "the last member to exit removes the group's ledger");
}

#[test]
fn a_killed_members_memory_comes_back_to_the_group() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let group = format!("kill-{}", std::process::id());
    let mut a = group_member(&gpu, &group, None);
    let ra = a.ready();
    assert!(ra[0] + CHUNK > LIMIT - OVERHEAD);
    a.kill();
    a.wait(gpufrac_e2e::TIMEOUT);
    let mut b = group_member(&gpu, &group, None);
    let rb = b.ready();
    assert!(rb[0] + CHUNK > LIMIT - OVERHEAD, "B gets the whole slice back: {}", mib(rb[0]));
    b.close_stdin();
    b.finish();
}

#[test]
fn bad_settings_fail_cuinit_with_one_clear_line() {
    let gpu = gpu();
    for (name, value) in [
        ("GPUFRAC_MEMORY_LIMIT", "lots"),
        ("GPUFRAC_MEMORY_LIMIT", "128MiB"),
        ("GPUFRAC_RESOLVER", "fight"),
        ("GPUFRAC_GROUP", "../etc"),
        ("GPUFRAC_MEMORY_REQUEST", "3GiB"),
    ] {
        let (out, stdout, stderr) =
            output(shimmed(&gpu, program("dlsym")).env(name, value).args(["alloc", "1048576"]));
        assert!(!out.status.success(), "{name}={value} was accepted: {stdout}");
        assert!(stderr.contains("CUDA_ERROR_NOT_INITIALIZED"), "{name}={value}: {stderr}");
        let ours: Vec<&str> = stderr.lines().filter(|l| l.starts_with("gpufrac:")).collect();
        assert_eq!(ours.len(), 1, "{name}={value}: one line from the shim: {stderr}");
        assert!(ours[0].contains(name), "{name}={value}: {}", ours[0]);
    }
}

#[test]
fn a_cudarc_client_is_held_to_the_limit_and_its_data_survives() {
    skip_on_real_gpu!("sample-inference-server computes with simgpu's built-in kernels");
    let gpu = gpu();
    let (out, stdout, stderr) = output(shimmed(&gpu, artifact("sample-inference-server")).args([
        "--name",
        "t",
        "--model",
        "256MiB",
        "--batches",
        "128MiB,512MiB,64MiB",
        "--steps",
        "3",
    ]));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(&format!("t started device=0 total={LIMIT}")), "{stdout}");
    // 64 MiB context + 256 MiB model + 512 MiB batch > 640 MiB: refused, cleanly.
    assert!(stdout.contains("t out-of-memory batch=1 bytes=536870912"), "{stdout}");
    assert!(stdout.contains("t done served=2 out-of-memory=1"), "{stdout}");
}

#[test]
fn programs_ask_the_shim_through_gpufrac_h() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let query = compile_c("query.c", &[], false);
    let (out, stdout, stderr) = output(&mut gpu.command(&query));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), "NO_SHIM", "without the shim the lookups fail cleanly");

    let (out, stdout, stderr) = output(&mut shimmed(&gpu, &query));
    assert!(out.status.success(), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("VERSION "), "{stdout}");
    assert_eq!(lines[1], "ENABLED 1 COUNT 1");
    let held = OVERHEAD + 64 * MIB;
    assert_eq!(lines[2], format!("INFO 0 {REQUEST} {LIMIT} {held} {held} {}", 2 * GIB));
    assert_eq!(lines[3], format!("GETTERS {REQUEST} {LIMIT} {held}"));
    assert_eq!(lines[4], "UNKNOWN -1");
}

#[test]
fn gpufrac_run_puts_a_command_under_the_shim() {
    skip_on_real_gpu!(EXACT);
    let gpu = gpu();
    let mut cmd = gpu.command(artifact("gpufrac"));
    cmd.args(["run", "--request", "256MiB", "--limit", "640MiB", "--group", "cli", "--"])
        .arg(program("dlsym"))
        .args(["alloc", &CHUNK.to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    let v = child.ready();
    assert_eq!(v[2], LIMIT, "the command sees the limit as the device size");
    assert!(v[0] + CHUNK > LIMIT - OVERHEAD && v[0] <= LIMIT - OVERHEAD);
    child.close_stdin();
    child.finish();

    let (out, _, stderr) = output(gpu.command(artifact("gpufrac")).args([
        "run",
        "--request",
        "1GiB",
        "--limit",
        "lots",
        "--",
        "true",
    ]));
    assert!(!out.status.success());
    // The message names the flag the user typed, not the variable behind it.
    assert!(stderr.contains("invalid --limit \"lots\"") && !stderr.contains("GPUFRAC_"), "{stderr}");
}
