//! The CUDA driver's process checkpoint API on simgpu, driven from another process as
//! NVIDIA's `cuda-checkpoint` drives it: `simgpu_checkpoint` (through the arbiter's
//! wrapper, `gpufrac_daemon::checkpoint`) locks, checkpoints, restores and unlocks
//! `checkpoint_target`, which holds device memory of every kind simgpu moves, on a
//! private 1 GiB device whose contexts take 64 MiB.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_checkpoint`.

use std::process::Command;
use std::time::{Duration, Instant};

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{artifact, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

/// Why every test here needs simgpu.
const SIMULATOR: &str = "tests simgpu's checkpoint API: a 1 GiB simulated device with 64 MiB contexts";
const OVERHEAD: u64 = 64 * MIB;
/// What `checkpoint_target` holds besides its context: its buffers, a 4 MiB array and its
/// module (simgpu's default `SIMGPU_MODULE_BYTES`, 2 MiB).
const TARGET_MEMORY: u64 = 46 * MIB;

fn machine() -> SimGpu {
    SimGpu::new("1GiB").with_context_overhead("64MiB")
}

/// Starts `checkpoint_target` and waits until it holds its memory.
fn start_target(gpu: &SimGpu) -> ChildProcess {
    let mut target = ChildProcess::spawn(&mut gpu.command(artifact("checkpoint_target")));
    target.expect_line(&["PTRS"], TIMEOUT);
    target.ready();
    target
}

/// What one `simgpu_checkpoint` run answered.
#[derive(Debug)]
struct Answer {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Answer {
    /// Panics unless the run succeeded and printed `state`.
    fn expect_state(&self, state: &str) {
        assert!(self.ok && self.stdout.trim() == state, "expected state {state}, got {self:?}");
    }

    /// Panics unless the run failed with the CUDA error `name`.
    fn expect_error(&self, name: &str) {
        assert!(!self.ok && self.stderr.contains(name), "expected {name}, got {self:?}");
    }
}

/// Runs `simgpu_checkpoint --pid <pid> --action <action> [extra...]` on `gpu`.
fn tool(gpu: &SimGpu, pid: u32, action: &str, extra: &[&str]) -> Answer {
    let mut cmd: Command = gpu.command(artifact("simgpu_checkpoint"));
    cmd.args(["--pid", &pid.to_string(), "--action", action]).args(extra);
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run simgpu_checkpoint: {e}"));
    Answer {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn a_checkpointed_process_frees_the_device_and_comes_back_intact() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = machine();
    let mut target = start_target(&gpu);
    let pid = target.pid();
    tool(&gpu, pid, "state", &[]).expect_state("running");
    let before = gpu.listed_holding(pid, 0).expect("the target is listed while it runs");
    assert_eq!(before, OVERHEAD + TARGET_MEMORY, "the target holds {}", mib(before));

    // Only a locked process can be checkpointed.
    tool(&gpu, pid, "checkpoint", &[]).expect_error("CUDA_ERROR_ILLEGAL_STATE");
    tool(&gpu, pid, "lock", &[]).expect_state("locked");
    tool(&gpu, pid, "lock", &[]).expect_error("CUDA_ERROR_ILLEGAL_STATE");
    tool(&gpu, pid, "restore", &[]).expect_error("CUDA_ERROR_ILLEGAL_STATE");

    // A call the locked target makes waits.
    target.write_stdin("call\n");
    target.expect_line(&["CALLING"], TIMEOUT);
    assert!(
        target.silent_for(Duration::from_millis(400)),
        "a call returned while locked: {}",
        target.diagnostics()
    );

    tool(&gpu, pid, "checkpoint", &[]).expect_state("checkpointed");
    assert_eq!(gpu.listed_holding(pid, 0), None, "a checkpointed process holds nothing and is not listed");
    tool(&gpu, pid, "unlock", &[]).expect_error("CUDA_ERROR_ILLEGAL_STATE");
    tool(&gpu, pid, "checkpoint", &[]).expect_error("CUDA_ERROR_ILLEGAL_STATE");

    // Another process takes what the target had: more than was free before.
    let room = GIB - OVERHEAD - 32 * MIB;
    assert!(room > GIB - before, "the other process's allocation fits only without the target");
    let mut other =
        ChildProcess::spawn(gpu.command(artifact("simgpu_probe")).args(["hold", &room.to_string()]));
    other.ready();
    tool(&gpu, pid, "restore", &[]).expect_error("CUDA_ERROR_OUT_OF_MEMORY");
    tool(&gpu, pid, "state", &[]).expect_state("checkpointed");
    other.finish();

    tool(&gpu, pid, "restore", &[]).expect_state("locked");
    assert_eq!(gpu.listed_holding(pid, 0), Some(before), "restored, the target holds what it held");
    assert!(
        target.silent_for(Duration::from_millis(200)),
        "a call returned before unlock: {}",
        target.diagnostics()
    );
    tool(&gpu, pid, "unlock", &[]).expect_state("running");
    target.expect_line(&["CALLED"], TIMEOUT);

    // Every buffer, at its address, holds its pattern.
    target.write_stdin("check\n");
    let line = target.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    assert!(line.starts_with("INTACT"), "{line}: {}", target.diagnostics());
    target.finish();
}

#[test]
fn a_lock_waits_for_work_and_times_out_on_a_call_in_flight() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = machine();
    let mut target = start_target(&gpu);
    let pid = target.pid();

    // A synchronize in flight for 2 s: the lock gives up and leaves the target running.
    target.write_stdin("busy 2000000\n");
    target.expect_line(&["BUSY"], TIMEOUT);
    let asked = Instant::now();
    tool(&gpu, pid, "lock", &["--timeout-ms", "300"]).expect_error("CUDA_ERROR_TIMEOUT");
    assert!(asked.elapsed() >= Duration::from_millis(300), "the lock gave up early");
    tool(&gpu, pid, "state", &[]).expect_state("running");
    target.expect_line(&["IDLE"], TIMEOUT);

    // Queued work, with no call in flight: the lock waits for it to finish.
    let launched = Instant::now();
    target.write_stdin("launch 800000\n");
    target.expect_line(&["LAUNCHED"], TIMEOUT);
    tool(&gpu, pid, "lock", &[]).expect_state("locked");
    assert!(launched.elapsed() >= Duration::from_millis(800), "locked before the queued kernel finished");
    tool(&gpu, pid, "unlock", &[]).expect_state("running");

    // The toggle of cuda-checkpoint: checkpoint, then back.
    tool(&gpu, pid, "toggle", &[]).expect_state("checkpointed");
    tool(&gpu, pid, "toggle", &[]).expect_state("running");
    target.write_stdin("check\n");
    let line = target.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    assert!(line.starts_with("INTACT"), "{line}: {}", target.diagnostics());
    target.finish();
}

#[test]
fn a_process_without_cuda_is_not_found() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = machine();
    // This test process never initialised the driver.
    tool(&gpu, std::process::id(), "state", &[]).expect_error("CUDA_ERROR_NOT_FOUND");
    let mut sleeper = Command::new("sleep").arg("30").spawn().expect("sleep runs");
    tool(&gpu, sleeper.id(), "lock", &[]).expect_error("CUDA_ERROR_NOT_FOUND");
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    // Bad usage is not a driver error.
    let usage = tool(&gpu, 1, "dance", &[]);
    assert!(!usage.ok && usage.stderr.contains("unknown action"), "{usage:?}");
}
