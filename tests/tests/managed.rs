//! A managed size: `gpufrac-arbiter --gpu-memory SIZE|FRACTION` manages only that much of
//! each GPU. On a 64 GiB simulated GPU managed as 16 GiB, bursts collide as on a 16 GiB
//! GPU (one waits and is served in turn), status shows 16 GiB, a shim's fraction and its
//! virtual device are of the 16 GiB (CUDA and NVML), a request past it is refused, and a
//! bad value is refused naming the flag. On a real GPU the same tests run on its memory.

use std::path::PathBuf;
use std::process::Command;

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, status, unique, wait_for, Arbiter, ChildProcess, ShimSettings, SimGpu,
};

const MANAGED: u64 = 16 * GIB;
const CHUNK: u64 = 256 * MIB;

fn gpu() -> SimGpu {
    SimGpu::new("64GiB").with_context_overhead("64MiB")
}

/// An arbiter managing `gpu_memory` of each GPU (none: the whole GPU) that logs every
/// grant after a wait (at debug).
fn arbiter(gpu: &SimGpu, gpu_memory: Option<&str>) -> Arbiter {
    let log = std::ffi::OsStr::new("info,gpufrac_daemon::arbiter::server=debug");
    let args: Vec<&str> = gpu_memory.map_or_else(Vec::new, |size| vec!["--gpu-memory", size]);
    Arbiter::start_with_env(gpu, gpu.lib_dir().join("arbiter.sock"), &args, &[("GPUFRAC_LOG", log)])
}

/// `alloc_paths alloc` under the shim: a 4 GiB request and a 12 GiB limit, allocating
/// 256 MiB chunks up to `upto` bytes; prints `READY <held> <free> <total>` (cuMemGetInfo).
fn server(gpu: &SimGpu, arbiter: &Arbiter, group: &str, upto: u64) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("4GiB")
        .memory_limit("12GiB")
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout("60s")
        .args(["alloc", &CHUNK.to_string(), &upto.to_string()]);
    ChildProcess::spawn(&mut cmd)
}

fn state_of(s: &gpufrac_daemon::status::Status, group: &str) -> Option<String> {
    s.gpus[0].processes.iter().find(|p| p.group == group).map(|p| p.state.clone())
}

/// Bursts that collide only on 16 GiB: A holds 12 GiB (4 guaranteed, 8 lent); B's
/// request takes 4 GiB more, and its 6 GiB burst finds nothing left to lend: it waits,
/// and is served when A lets go.
#[test]
fn bursts_collide_on_the_managed_size_of_a_larger_gpu() {
    let gpu = gpu();
    let arbiter = arbiter(&gpu, Some("16GiB"));
    let s = status(&arbiter);
    assert_eq!(s.gpus[0].total, MANAGED, "status shows what is managed: {s:?}");
    assert_eq!(s.gpus[0].headroom, gpu.device_total(0) - MANAGED);
    let table = String::from_utf8(
        Command::new(artifact("gpufrac"))
            .args(["status", "--socket"])
            .arg(arbiter.socket())
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(table.contains("memory 16.00GiB"), "{table}");

    let (group_a, group_b) = (unique("a"), unique("b"));
    let mut a = server(&gpu, &arbiter, &group_a, 12 * GIB);
    let ra = a.ready();
    assert!(ra[0] + CHUNK > 12 * GIB - GIB, "A fills its limit: {}\n{}", mib(ra[0]), a.diagnostics());
    let mut b = server(&gpu, &arbiter, &group_b, 10 * GIB);
    let s = wait_for(&arbiter, "B waiting", |s| state_of(s, &group_b).as_deref() == Some("waiting"));
    assert_eq!((s.gpus[0].guaranteed, s.gpus[0].free), (8 * GIB, 0), "{s:?}");
    a.close_stdin();
    a.finish();
    let rb = b.ready();
    assert_eq!(rb[0], 10 * GIB, "B got all it asked for ({})\n{}", mib(rb[0]), b.diagnostics());
    let log = arbiter.log_text();
    assert!(log.contains("grant after wait") || log.contains("a burst waited"), "{log}");
    b.close_stdin();
    b.finish();
}

/// The simgpu probe and `alloc_paths`, with the shim, `GPUFRAC_MEMORY_LIMIT=0.5` and the
/// arbiter.
fn half(gpu: &SimGpu, arbiter: &Arbiter, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = gpu.shimmed(program);
    cmd.memory_limit("0.5").arbiter_socket(arbiter.socket()).group(unique("half"));
    cmd
}

/// What a shim shows under `GPUFRAC_MEMORY_LIMIT=0.5` with an arbiter managing
/// `gpu_memory`: the total of cuMemGetInfo (`alloc_paths`), of cuMemGetInfo,
/// cuDeviceTotalMem and NVML (the probe's `slice`, which checks they agree), and of NVML
/// alone (the probe's `nvml-only`, as `nvidia-smi`).
fn shown_totals(gpu: &SimGpu, gpu_memory: Option<&str>) -> [u64; 3] {
    let arbiter = arbiter(gpu, gpu_memory);
    let probe = env!("CARGO_BIN_EXE_simgpu_probe");
    let mut c = half(gpu, &arbiter, compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    let mut c = ChildProcess::spawn(c.args(["alloc", &(64 * MIB).to_string(), &(64 * MIB).to_string()]));
    let cuda = c.ready()[2];
    c.close_stdin();
    c.finish();
    let total = |sub: &str, word: &str| {
        let out = half(gpu, &arbiter, probe).arg(sub).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let line =
            text.lines().find(|l| l.starts_with(word)).unwrap_or_else(|| panic!("no {word} in {text}"));
        line.split_whitespace().nth(1).and_then(|t| t.parse::<u64>().ok()).expect("a total")
    };
    [cuda, total("slice", "SLICE"), total("nvml-only", "NVML")]
}

#[test]
fn a_fraction_and_the_virtual_device_are_of_the_managed_size() {
    let gpu = gpu();
    assert_eq!(shown_totals(&gpu, Some("16GiB")), [MANAGED / 2; 3]);
    // Without it, the same processes see half of the whole GPU: the test is not vacuous.
    assert_eq!(shown_totals(&gpu, None), [gpu.device_total(0) / 2; 3]);
}

#[test]
fn a_fraction_of_each_gpu_is_managed_as_a_size() {
    let gpu = gpu();
    let quarter = gpu.device_total(0) / 4;
    assert_eq!(status(&arbiter(&gpu, Some("0.25"))).gpus[0].total, quarter);
    assert_eq!(shown_totals(&gpu, Some("0.25")), [quarter / 2; 3]);
    assert_eq!(status(&arbiter(&gpu, Some("25%"))).gpus[0].total, quarter);
}

/// `GPUFRAC_MEMORY_REQUEST=20GiB` under an arbiter managing `gpu_memory`: the output of
/// a process that allocates 64 MiB.
fn twenty(gpu: &SimGpu, gpu_memory: Option<&str>) -> std::process::Output {
    let arbiter = arbiter(gpu, gpu_memory);
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("20GiB").arbiter_socket(arbiter.socket()).group(unique("big"));
    cmd.args(["alloc", &(64 * MIB).to_string(), &(64 * MIB).to_string()]).stdin(std::process::Stdio::null());
    cmd.output().unwrap()
}

#[test]
fn a_request_larger_than_the_managed_size_is_refused() {
    let gpu = gpu();
    let out = twenty(&gpu, Some("16GiB"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("GPUFRAC_MEMORY_REQUEST=20.00 GiB is more than the arbiter manages of device 0 (16.00 GiB; gpufrac-arbiter --gpu-memory)"),
        "{stderr}"
    );
    assert!(stderr.contains("CUDA_ERROR_NOT_INITIALIZED"), "{stderr}");
    // The whole GPU has room for it.
    let out = twenty(&gpu, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn bad_values_are_refused_naming_the_flag() {
    let gpu = gpu();
    let socket: PathBuf = gpu.lib_dir().join("refused.sock");
    let more = format!("{}GiB", gpu.device_total(0) / GIB + 1);
    for (value, words) in [
        ("0", "expected a size above 0"),
        ("0GiB", "expected a size above 0"),
        ("lots", "expected a size such as"),
        ("1.5", "a plain number is a fraction of the device"),
        ("101%", "at most 100%"),
        (more.as_str(), "more than GPU "),
    ] {
        let out = gpu
            .command(artifact("gpufrac-arbiter"))
            .arg("--socket")
            .arg(&socket)
            .args(["--gpu-memory", value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{value}: {stderr}");
        assert!(stderr.contains("--gpu-memory") && stderr.contains(words), "{value}: {stderr}");
        assert!(!socket.exists(), "{value}: nothing served");
    }
}
