//! `simgpu_checkpoint`: a small stand-in for NVIDIA's `cuda-checkpoint`, which drives the
//! CUDA driver's process checkpoint API on another process (through the arbiter's
//! wrapper, `gpufrac_daemon::checkpoint`, loading `libcuda.so.1`).
//!
//! Usage: `simgpu_checkpoint --pid N --action lock|checkpoint|restore|unlock|state|toggle
//! [--timeout-ms N]`. `toggle` checkpoints a running process (lock, then checkpoint) and
//! resumes a checkpointed one (restore, then unlock). On success it prints the process's
//! state afterwards (`running`, `locked`, `checkpointed`, `failed`); on a driver error it
//! prints `simgpu_checkpoint: <call>: <CUDA error name> (<code>)` on stderr and exits
//! with 1; bad usage exits with 2.

use std::process::ExitCode;
use std::time::Duration;

use gpufrac_daemon::checkpoint::{CheckpointApi, CheckpointError, ProcessState};

const USAGE: &str =
    "usage: simgpu_checkpoint --pid N --action lock|checkpoint|restore|unlock|state|toggle [--timeout-ms N]";

/// What the command line asks for.
struct Request {
    pid: u32,
    action: String,
    timeout: Duration,
}

fn parse(args: &[String]) -> Result<Request, String> {
    let (mut pid, mut action, mut timeout) = (None, None, Duration::ZERO);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--pid" => pid = Some(value()?.parse::<u32>().map_err(|e| format!("--pid: {e}"))?),
            "--action" => action = Some(value()?.clone()),
            "--timeout-ms" => {
                timeout = Duration::from_millis(value()?.parse().map_err(|e| format!("--timeout-ms: {e}"))?)
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let action = action.ok_or("--action is required")?;
    if !["lock", "checkpoint", "restore", "unlock", "state", "toggle"].contains(&action.as_str()) {
        return Err(format!("unknown action {action:?}"));
    }
    Ok(Request { pid: pid.ok_or("--pid is required")?, action, timeout })
}

fn run(api: &CheckpointApi, r: &Request) -> Result<ProcessState, CheckpointError> {
    match r.action.as_str() {
        "lock" => api.lock(r.pid, r.timeout)?,
        "checkpoint" => api.checkpoint(r.pid)?,
        "restore" => api.restore(r.pid)?,
        "unlock" => api.unlock(r.pid)?,
        "toggle" => match api.state(r.pid)? {
            ProcessState::Running => {
                api.lock(r.pid, r.timeout)?;
                api.checkpoint(r.pid)?;
            }
            ProcessState::Checkpointed => {
                api.restore(r.pid)?;
                api.unlock(r.pid)?;
            }
            // Half-way (locked): finish the way back.
            ProcessState::Locked => api.unlock(r.pid)?,
            _ => {}
        },
        _ => {}
    }
    api.state(r.pid)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let request = match parse(&args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("simgpu_checkpoint: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = CheckpointApi::load().and_then(|api| run(&api, &request));
    match outcome {
        Ok(state) => {
            println!("{state}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("simgpu_checkpoint: {} pid {}: {e}", request.action, request.pid);
            ExitCode::from(1)
        }
    }
}
