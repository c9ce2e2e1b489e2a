//! The end-to-end harness itself (`gpufrac_e2e`): a child that never answers or dies
//! early fails its test with what it printed instead of hanging it, simulated-GPU commands
//! get exactly the environment they should, and the C programs link to `libcuda.so.1`
//! the way toolkit-built programs do. The switch to a real GPU (`GPUFRAC_E2E_REAL_GPU`)
//! takes only 0 or 1 and fails the tests clearly otherwise, or without a driver.

use std::ffi::OsStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::Duration;

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, describe_status, parse_real_gpu_switch, process_state, real_gpu, skip_on_real_gpu,
    ChildProcess, SimGpu, REAL_CONTEXT_ROOM, REAL_GPU_VAR, SIMGPU_CUDA, TIMEOUT,
};

fn sh(script: &str) -> ChildProcess {
    ChildProcess::spawn(Command::new("sh").arg("-c").arg(script))
}

fn panic_message(result: std::thread::Result<()>) -> String {
    let payload = result.expect_err("the call should have failed the test");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[test]
fn ready_protocol_round_trip() {
    let mut child = sh("echo starting; echo 'READY 1 22 333'; cat >/dev/null; echo DONE");
    assert_eq!(child.ready(), vec![1, 22, 333]);
    child.finish();
}

#[test]
fn silent_child_fails_the_test_instead_of_hanging() {
    let mut child = sh("echo 'still thinking' >&2; exec sleep 600");
    let pid = child.pid();
    let message = panic_message(catch_unwind(AssertUnwindSafe(|| {
        child.next_line(Duration::from_millis(300));
    })));
    assert!(message.contains("no output within"), "unexpected message: {message}");
    drop(child);
    assert_eq!(process_state(pid), None, "a dropped child is killed and reaped");
}

#[test]
fn early_exit_reports_status_and_stderr() {
    let mut child = sh("echo 'alloc_paths: cuMemMap failed' >&2; exit 7");
    let message = panic_message(catch_unwind(AssertUnwindSafe(|| {
        child.expect_line(&["READY"], TIMEOUT);
    })));
    assert!(message.contains("exit code 7"), "the exit status is reported: {message}");
    assert!(message.contains("cuMemMap failed"), "stderr is reported: {message}");
}

#[test]
fn killed_child_can_be_left_unreaped() {
    let mut child = sh("echo READY; exec sleep 600");
    child.ready();
    child.kill();
    child.wait_terminated(TIMEOUT);
    assert_eq!(process_state(child.pid()), Some('Z'));
    assert_eq!(describe_status(child.wait(TIMEOUT)), "killed by signal 9");
}

#[test]
fn simgpu_command_environment() {
    skip_on_real_gpu!("checks simgpu's environment: SIMGPU_* variables and driver links");
    // Variables a developer's shell may carry must not reach the child.
    std::env::set_var("GPUFRAC_E2E_CANARY", "1");
    let gpu = SimGpu::new("2GiB,1GiB").with_context_overhead("1MiB");
    let out = gpu.command("env").env("GPUFRAC_MEMORY_LIMIT", "1GiB").output().expect("run env");
    let env = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| env.lines().find_map(|l| l.strip_prefix(&format!("{name}=")).map(str::to_owned));

    let lib_dir = gpu.lib_dir().to_string_lossy().into_owned();
    assert!(var("LD_LIBRARY_PATH").is_some_and(|v| v.split(':').next() == Some(lib_dir.as_str())));
    assert_eq!(var("SIMGPU_STATE").as_deref(), Some(&*gpu.state_path().to_string_lossy()));
    assert_eq!(var("SIMGPU_DEVICES").as_deref(), Some("2GiB,1GiB"));
    assert_eq!(var("SIMGPU_CONTEXT_OVERHEAD").as_deref(), Some("1MiB"));
    assert_eq!(var("GPUFRAC_E2E_CANARY"), None, "inherited GPUFRAC_* variables are removed");
    assert_eq!(var("GPUFRAC_MEMORY_LIMIT").as_deref(), Some("1GiB"), "the test's own settings stay");
    assert_eq!(var("LD_PRELOAD"), None);

    let cuda = std::fs::canonicalize(artifact(SIMGPU_CUDA)).expect("the driver exists");
    for link in ["libcuda.so", "libcuda.so.1"] {
        assert_eq!(std::fs::canonicalize(gpu.lib_dir().join(link)).ok(), Some(cuda.clone()), "{link}");
    }
    for link in ["libnvidia-ml.so", "libnvidia-ml.so.1"] {
        assert!(gpu.lib_dir().join(link).exists(), "{link}");
    }

    // Sizes for tests: the simulated ones, and limits left as they are.
    assert!(!gpu.is_real());
    assert_eq!((gpu.device_count(), gpu.device_total(0), gpu.device_total(1)), (2, 2 * GIB, GIB));
    assert_eq!(gpu.plus_real_context("640MiB"), "640MiB");

    let dir = gpu.lib_dir().to_path_buf();
    drop(gpu);
    assert!(!dir.exists(), "the folder goes with the SimGpu");
}

/// With `GPUFRAC_E2E_REAL_GPU=1`: commands find the machine's driver as any program does
/// (no simgpu folder on `LD_LIBRARY_PATH`, no `SIMGPU_*` variable), the folder for the
/// test's files holds no driver, and sizes are the real devices'.
#[test]
fn real_gpu_command_environment() {
    if !real_gpu() {
        gpufrac_e2e::report_skip(
            gpufrac_e2e::Skip::NeedsRealGpu,
            &format!(
                "runs with {REAL_GPU_VAR}=1 only (simgpu_command_environment is its simgpu counterpart)"
            ),
        );
        return;
    }
    std::env::set_var("GPUFRAC_E2E_CANARY", "1");
    let gpu = SimGpu::new("2GiB,1GiB").with_context_overhead("1MiB");
    assert!(gpu.is_real());
    let out = gpu.command("env").env("GPUFRAC_MEMORY_LIMIT", "1GiB").output().expect("run env");
    let env = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| env.lines().find_map(|l| l.strip_prefix(&format!("{name}=")).map(str::to_owned));
    assert!(!env.lines().any(|l| l.starts_with("SIMGPU_")), "no simgpu variable: {env}");
    assert_eq!(var("LD_LIBRARY_PATH"), std::env::var("LD_LIBRARY_PATH").ok(), "LD_LIBRARY_PATH as inherited");
    assert_eq!(var("GPUFRAC_E2E_CANARY"), None, "inherited GPUFRAC_* variables are removed");
    assert_eq!(var(REAL_GPU_VAR), None);
    assert_eq!(var("GPUFRAC_MEMORY_LIMIT").as_deref(), Some("1GiB"), "the test's own settings stay");
    assert_eq!(var("LD_PRELOAD"), None);

    let dir = gpu.lib_dir().to_path_buf();
    let entries = std::fs::read_dir(&dir).expect("the test's folder").count();
    assert_eq!(entries, 0, "no driver links in {}", dir.display());
    let totals: Vec<u64> = (0..gpu.device_count()).map(|i| gpu.device_total(i)).collect();
    assert!(!totals.is_empty() && totals.iter().all(|&t| t >= GIB), "the real devices' sizes: {totals:?}");
    let listed: Vec<u64> = gpu.devices().split(',').map(|t| t.parse().expect("bytes")).collect();
    assert_eq!(listed, totals);
    assert_eq!(gpu.plus_real_context("640MiB"), (640 * MIB + REAL_CONTEXT_ROOM).to_string());
    drop(gpu);
    assert!(!dir.exists(), "the folder goes with the SimGpu");
}

#[test]
fn the_real_gpu_switch_is_0_1_or_unset() {
    let parse = |value: Option<&str>| parse_real_gpu_switch(value.map(OsStr::new));
    assert_eq!(parse(None), Ok(false));
    assert_eq!(parse(Some("0")), Ok(false));
    assert_eq!(parse(Some("1")), Ok(true));
    for bad in ["", "yes", "true", "on", "2", " 1", "1 ", "01"] {
        let message = parse(Some(bad)).expect_err(bad);
        assert!(message.contains(&format!("GPUFRAC_E2E_REAL_GPU={bad:?} is not understood")), "{message}");
        assert!(
            message.contains("set it to 1") && message.contains("simgpu"),
            "says what it takes: {message}"
        );
    }
}

/// This test binary run again for `test` alone, with `GPUFRAC_E2E_REAL_GPU=value`: its
/// exit code and everything it printed.
fn rerun_with_switch(test: &str, value: &str) -> (Option<i32>, String) {
    let exe = std::env::current_exe().expect("the test binary");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(REAL_GPU_VAR, value);
    let mut child = ChildProcess::spawn(&mut cmd);
    child.close_stdin();
    // Bounded: the suite must fail early, not hang.
    let status = child.wait(TIMEOUT);
    (status.code(), child.diagnostics())
}

#[test]
fn a_bad_real_gpu_switch_fails_the_tests_naming_it() {
    let (code, out) = rerun_with_switch("simgpu_command_environment", "yes");
    assert_eq!(code, Some(101), "the test fails: {out}");
    assert!(out.contains("GPUFRAC_E2E_REAL_GPU=\"yes\" is not understood: set it to 1"), "{out}");
}

#[test]
fn the_real_gpu_switch_without_a_driver_fails_at_once_saying_so() {
    let (code, out) = rerun_with_switch("real_gpu_command_environment", "1");
    // SAFETY: dlopen takes a NUL-terminated name and flags; a driver found stays loaded.
    let driver = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if driver.is_null() {
        assert_eq!(code, Some(101), "{out}");
        assert!(out.contains("no real CUDA driver: libcuda.so.1 not found"), "{out}");
        assert!(out.contains("unset GPUFRAC_E2E_REAL_GPU to run the tests on simgpu"), "{out}");
    } else {
        // A machine with a driver: the real GPU's environment passed, or what is missing
        // besides the driver is said.
        let said = ["no real NVML:", "no GPU:"].iter().any(|m| out.contains(m));
        assert!(code == Some(0) || said, "{out}");
    }
}

#[test]
fn linked_program_needs_libcuda_so_1_and_no_rpath() {
    let program = compile_c("alloc_paths.c", &["MODE_LINKED"], true);
    assert_eq!(compile_c("alloc_paths.c", &["MODE_LINKED"], true), program);
    let out = Command::new("readelf").arg("-d").arg(&program).output().expect("run readelf");
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(dynamic.contains("Shared library: [libcuda.so.1]"), "{dynamic}");
    assert!(!dynamic.contains("RPATH") && !dynamic.contains("RUNPATH"), "{dynamic}");
}
