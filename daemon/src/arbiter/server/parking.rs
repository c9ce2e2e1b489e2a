//! The server's side of parking (see `policy::park` for the rules): tells shims to park,
//! checkpoints and restores processes with the driver's checkpoint API where the arbiter
//! has it, answers wakes, and counts and logs it all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Reply};

use super::document::record;
use super::{EventKind, Shared};
use crate::arbiter::policy::{uuid_string, ConnId, Policy, WakeAnswer, WakeOutcome};
use crate::checkpoint::CheckpointApi;

/// How parks move memory (`--park-with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ParkWith {
    /// The driver's checkpoint API where the driver has it (CUDA 12.8+), else the shim.
    #[default]
    Auto,
    /// Always the driver's checkpoint API (the arbiter refuses to start without it).
    Checkpoint,
    /// Always the shim's own swap.
    Shim,
}

impl std::str::FromStr for ParkWith {
    type Err = String;
    fn from_str(text: &str) -> Result<ParkWith, String> {
        match text {
            "auto" => Ok(ParkWith::Auto),
            "checkpoint" => Ok(ParkWith::Checkpoint),
            "shim" => Ok(ParkWith::Shim),
            other => Err(format!("expected auto, checkpoint or shim, not {other:?}")),
        }
    }
}

/// How long the checkpoint API's lock waits for the process's calls in flight.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a restore that found no room is tried again (within the wake's timeout).
const RESTORE_RETRY: Duration = Duration::from_millis(50);

/// Loads the driver's checkpoint API, once, when parks may use it: the first time a
/// parkable group says hello (so that an arbiter without parkable groups never loads the
/// CUDA driver). Called outside the policy's lock.
pub(super) fn load_checkpoint_api(shared: &Shared) {
    if shared.options.park_with == ParkWith::Shim {
        return;
    }
    shared.checkpoint_api.get_or_init(|| match CheckpointApi::load() {
        Ok(api) => {
            tracing::info!("parks use the driver's checkpoint API");
            Some(Arc::new(api))
        }
        Err(e) => {
            tracing::info!("parks use the shim's swap: the driver's checkpoint API is not available ({e})");
            None
        }
    });
}

/// A parkable group said hello: the policy learns whether parks may checkpoint (after
/// [`load_checkpoint_api`]).
pub(super) fn parkable_hello(shared: &Shared, policy: &mut Policy) {
    if shared.options.park_with == ParkWith::Shim {
        return;
    }
    policy.set_checkpoint(api(shared).is_some());
}

/// Loads the checkpoint API now, failing if it is missing (`--park-with checkpoint`).
pub(super) fn require_checkpoint_api(shared: &Shared) -> Result<(), String> {
    match CheckpointApi::load() {
        Ok(api) => {
            let _ = shared.checkpoint_api.set(Some(Arc::new(api)));
            shared.policy().set_checkpoint(true);
            Ok(())
        }
        Err(e) => Err(format!("--park-with checkpoint: the driver's checkpoint API is not available: {e}")),
    }
}

fn api(shared: &Shared) -> Option<Arc<CheckpointApi>> {
    shared.checkpoint_api.get().cloned().flatten()
}

/// Parks what the policy decides now, refuses wakes past their timeout and answers the
/// ones that fit: the parking step of the follow-up to a change, and the ticker's.
pub(super) fn park_step(shared: &Arc<Shared>, policy: &mut Policy) {
    let now = Instant::now();
    let expired = policy.expire_wakes(now);
    let orders = policy.plan_parks(now);
    deliver_wakes(shared, policy, expired);
    for o in orders {
        let how = if o.checkpoint { "the driver's checkpoint" } else { "the shim's swap" };
        tracing::info!(pid = o.pid, group = %o.group, gpu = %uuid_string(&o.device), bytes = o.bytes, why = o.why, "parking an idle group with {how}");
        shared.send(o.conn, &Reply::Park { device: o.device, checkpoint: o.checkpoint });
    }
}

/// The shim parked its memory (`host_bytes` moved, `held` left), or, for a checkpoint,
/// closed its gate: the arbiter checkpoints it now (in a blocking thread, which takes the
/// policy's lock itself when it is done).
pub(super) fn on_parked(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    (conn, pid): (ConnId, u32),
    device: DeviceId,
    host_bytes: u64,
    held: u64,
    micros: u64,
) {
    let by_checkpoint = policy.parks_by_checkpoint(conn, &device);
    match api(shared).filter(|_| by_checkpoint) {
        Some(api) => {
            let shared = shared.clone();
            tokio::task::spawn_blocking(move || checkpoint(&shared, &api, (conn, pid), device, held));
        }
        None => {
            let took = Duration::from_micros(micros);
            parked(shared, policy, (conn, pid), device, host_bytes, held, took, "the shim")
        }
    }
}

/// Locks and checkpoints `pid` (a blocking thread); gives the park up if it fails.
fn checkpoint(
    shared: &Arc<Shared>,
    api: &CheckpointApi,
    (conn, pid): (ConnId, u32),
    device: DeviceId,
    held: u64,
) {
    let started = Instant::now();
    let result = api.lock(pid, LOCK_TIMEOUT).and_then(|()| {
        api.checkpoint(pid).inspect_err(|_| {
            let _ = api.unlock(pid);
        })
    });
    let mut policy = shared.policy();
    match result {
        Ok(()) => {
            let took = started.elapsed();
            parked(shared, &mut policy, (conn, pid), device, held, 0, took, "the driver's checkpoint")
        }
        Err(e) => {
            tracing::warn!(pid, gpu = %uuid_string(&device), "the checkpoint of an idle process failed ({e}); it stays on the GPU");
            let follow = policy.on_park_given_up(conn, device, held, Instant::now());
            shared.send(conn, &Reply::Unparked { device });
            shared.follow_up(&mut policy, follow);
        }
    }
}

/// A park done: counted, logged, and the policy told.
#[allow(clippy::too_many_arguments)]
fn parked(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    (conn, pid): (ConnId, u32),
    device: DeviceId,
    host_bytes: u64,
    held: u64,
    took: Duration,
    by: &str,
) {
    let Some(gpu) = shared.label(&device).cloned() else { return };
    if !policy.is_member(conn, &device) {
        return;
    }
    shared.metrics.parks.get_or_create(&gpu).inc();
    shared.metrics.park_bytes.get_or_create(&gpu).inc_by(host_bytes);
    shared.metrics.park_seconds.get_or_create(&gpu).observe(took.as_secs_f64());
    tracing::info!(pid, gpu = %gpu.gpu, host_bytes, held, ms = took.as_millis() as u64, "parked by {by}");
    let detail = format!("parked by {by} in {} ms", took.as_millis());
    record(shared, policy, conn, pid, gpu.gpu.clone(), EventKind::Parked, host_bytes, detail);
    let follow = policy.on_parked(conn, device, host_bytes, held, Instant::now());
    shared.follow_up(policy, follow);
}

/// A call waits at the gate of a parked process: its answer, if it is decided now.
pub(super) fn on_wake(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    (conn, pid): (ConnId, u32),
    seq: u64,
    device: DeviceId,
) -> Option<Reply> {
    let now = Instant::now();
    let (outcome, follow) = policy.on_wake(conn, device, seq, now);
    let answer = match outcome {
        WakeOutcome::Woken { bytes, restore: false } => {
            count_wake(shared, policy, (conn, pid), device, Duration::ZERO);
            Some(Reply::Granted { seq, bytes })
        }
        WakeOutcome::Woken { bytes, restore: true } => {
            restore(shared, policy, (conn, pid), seq, device, bytes, now);
            None
        }
        WakeOutcome::Queued => {
            tracing::debug!(pid, gpu = %uuid_string(&device), "a wake waits for room");
            None
        }
        WakeOutcome::Denied(reason) => Some(Reply::Denied { seq, reason }),
    };
    // Queued: a parking step makes room for it.
    shared.follow_up(policy, follow);
    answer
}

/// Restores and unlocks the checkpointed `pid` (a blocking thread, which takes the policy's
/// lock itself when it is done), then answers its wake. A restore that finds no room yet
/// (memory outside gpufrac) is tried again until the wake's timeout.
fn restore(
    shared: &Arc<Shared>,
    policy: &Policy,
    (conn, pid): (ConnId, u32),
    seq: u64,
    device: DeviceId,
    bytes: u64,
    asked: Instant,
) {
    let Some(api) = api(shared) else {
        shared.send(conn, &Reply::Denied { seq, reason: Denial::UnknownDevice });
        return;
    };
    let timeout = policy.peer(conn).map_or(Duration::from_secs(30), |p| p.wait_timeout);
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let result = loop {
            match api.restore(pid) {
                Err(e) if e.is_out_of_memory() && started.elapsed() < timeout => {
                    std::thread::sleep(RESTORE_RETRY)
                }
                other => break other.and_then(|()| api.unlock(pid)),
            }
        };
        let mut policy = shared.policy();
        match result {
            Ok(()) => {
                let follow = policy.on_woken(conn, device, None, Instant::now());
                count_wake(&shared, &policy, (conn, pid), device, asked.elapsed());
                shared.send(conn, &Reply::Granted { seq, bytes });
                shared.follow_up(&mut policy, follow);
            }
            Err(e) => {
                tracing::error!(pid, gpu = %uuid_string(&device), "restoring a parked process failed ({e}); its next call asks again");
                policy.wake_failed(conn, device);
                shared.send(conn, &Reply::Denied { seq, reason: Denial::Timeout });
            }
        }
    });
}

/// The shim's memory is back after its own swap-in, or it declined a park (busy).
pub(super) fn on_woken(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    (conn, pid): (ConnId, u32),
    device: DeviceId,
    held: u64,
    micros: u64,
) {
    let now = Instant::now();
    let follow = if policy.is_parking(conn, &device) {
        tracing::info!(pid, gpu = %uuid_string(&device), "a park was declined: the process is busy");
        policy.on_park_given_up(conn, device, held, now)
    } else {
        let asked = policy.wake_asked(conn, &device);
        let follow = policy.on_woken(conn, device, Some(held), now);
        let took = asked.map_or(Duration::from_micros(micros), |t| now.saturating_duration_since(t));
        count_wake(shared, policy, (conn, pid), device, took);
        follow
    };
    shared.follow_up(policy, follow);
}

fn count_wake(
    shared: &Shared,
    policy: &Policy,
    (conn, pid): (ConnId, u32),
    device: DeviceId,
    took: Duration,
) {
    let Some(gpu) = shared.label(&device).cloned() else { return };
    shared.metrics.wakes.get_or_create(&gpu).inc();
    shared.metrics.wake_seconds.get_or_create(&gpu).observe(took.as_secs_f64());
    tracing::info!(pid, gpu = %gpu.gpu, ms = took.as_millis() as u64, "woke a parked process");
    let detail = format!("woken in {} ms", took.as_millis());
    record(shared, policy, conn, pid, gpu.gpu, EventKind::Woken, 0, detail);
}

/// Answers wakes decided later: granted (restoring a checkpoint first) or refused.
pub(super) fn deliver_wakes(shared: &Arc<Shared>, policy: &Policy, answers: Vec<WakeAnswer>) {
    for a in answers {
        let pid = policy.peer(a.conn).map_or(0, |p| p.pid);
        match a.result {
            Ok((bytes, true)) => {
                restore(shared, policy, (a.conn, pid), a.seq, a.device, bytes, Instant::now() - a.waited)
            }
            Ok((bytes, false)) => {
                tracing::debug!(pid, waited_ms = a.waited.as_millis() as u64, "a wake waited for room");
                shared.send(a.conn, &Reply::Granted { seq: a.seq, bytes });
            }
            Err(reason) => {
                if let Some(gpu) = shared.label(&a.device) {
                    shared.metrics.wake_timeouts.get_or_create(gpu).inc();
                }
                tracing::info!(pid, gpu = %uuid_string(&a.device), waited_ms = a.waited.as_millis() as u64, "a parked process was not woken in time: no room");
                let detail = format!("not woken: {reason:?} after {} ms", a.waited.as_millis());
                record(shared, policy, a.conn, pid, uuid_string(&a.device), EventKind::Denied, 0, detail);
                shared.send(a.conn, &Reply::Denied { seq: a.seq, reason });
            }
        }
    }
}
