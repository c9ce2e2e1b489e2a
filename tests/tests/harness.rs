//! The end-to-end harness itself (`gpufrac_e2e`): a child that never answers or dies
//! early fails its test with what it printed instead of hanging it, simulated-GPU commands
//! get exactly the environment they should, and the C programs link to `libcuda.so.1`
//! the way toolkit-built programs do.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::Duration;

use gpufrac_e2e::{
    artifact, compile_c, describe_status, process_state, ChildProcess, SimGpu, SIMGPU_CUDA, TIMEOUT,
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

    let dir = gpu.lib_dir().to_path_buf();
    drop(gpu);
    assert!(!dir.exists(), "the folder goes with the SimGpu");
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
