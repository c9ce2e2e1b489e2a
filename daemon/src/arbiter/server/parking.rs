//! The server's side of parking (see `policy::park` for the rules): tells shims to park,
//! checkpoints and restores processes with the driver's checkpoint API where the arbiter
//! has it, answers wakes, and counts and logs it all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Reply};

use super::{EventKind, Shared};
use crate::arbiter::policy::{uuid_string, ConnId, WakeAnswer, WakeOutcome};
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

impl Shared {
    /// Loads the driver's checkpoint API, once, when parks may use it: the first time a
    /// parkable group says hello (so that an arbiter without parkable groups never loads
    /// the CUDA driver).
    pub(super) fn parkable_hello(&self) {
        if self.options.park_with == ParkWith::Shim {
            return;
        }
        let api = self.checkpoint_api.get_or_init(|| match CheckpointApi::load() {
            Ok(api) => {
                tracing::info!("parks use the driver's checkpoint API");
                Some(Arc::new(api))
            }
            Err(e) => {
                tracing::info!(
                    "parks use the shim's swap: the driver's checkpoint API is not available ({e})"
                );
                None
            }
        });
        self.policy().set_checkpoint(api.is_some());
    }

    /// Loads the checkpoint API now, failing if it is missing (`--park-with checkpoint`).
    pub fn require_checkpoint_api(&self) -> Result<(), String> {
        match CheckpointApi::load() {
            Ok(api) => {
                let _ = self.checkpoint_api.set(Some(Arc::new(api)));
                self.policy().set_checkpoint(true);
                Ok(())
            }
            Err(e) => {
                Err(format!("--park-with checkpoint: the driver's checkpoint API is not available: {e}"))
            }
        }
    }

    fn api(&self) -> Option<Arc<CheckpointApi>> {
        self.checkpoint_api.get().cloned().flatten()
    }

    /// Parks what the policy decides now, refuses wakes past their timeout and answers
    /// the ones that fit. Called after every change that may free or want room, and on
    /// the ticker.
    pub(super) fn park_step(self: &Arc<Self>) {
        let now = Instant::now();
        let (orders, expired) = {
            let mut policy = self.policy();
            let expired = policy.expire_wakes(now);
            (policy.plan_parks(now), expired)
        };
        self.deliver_wakes(expired);
        for o in orders {
            let how = if o.checkpoint { "the driver's checkpoint" } else { "the shim's swap" };
            tracing::info!(pid = o.pid, group = %o.group, gpu = %uuid_string(&o.device), bytes = o.bytes, why = o.why, "parking an idle group with {how}");
            self.send(o.conn, &Reply::Park { device: o.device, checkpoint: o.checkpoint });
        }
    }

    /// The shim parked its memory (`host_bytes` moved, `held` left), or, for a
    /// checkpoint, closed its gate: the arbiter checkpoints it now.
    pub(super) fn on_parked(
        self: &Arc<Self>,
        (conn, pid): (ConnId, u32),
        device: DeviceId,
        host_bytes: u64,
        held: u64,
        micros: u64,
    ) {
        let by_checkpoint = self.policy().parks_by_checkpoint(conn, &device);
        match self.api().filter(|_| by_checkpoint) {
            Some(api) => {
                let shared = self.clone();
                tokio::task::spawn_blocking(move || shared.checkpoint(&api, (conn, pid), device, held));
            }
            None => {
                self.parked(conn, pid, device, host_bytes, held, Duration::from_micros(micros), "the shim")
            }
        }
    }

    /// Locks and checkpoints `pid` (a blocking thread); gives the park up if it fails.
    fn checkpoint(
        self: &Arc<Self>,
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
        match result {
            Ok(()) => self.parked(conn, pid, device, held, 0, started.elapsed(), "the driver's checkpoint"),
            Err(e) => {
                tracing::warn!(pid, gpu = %uuid_string(&device), "the checkpoint of an idle process failed ({e}); it stays on the GPU");
                let wakes = self.policy().park_given_up(conn, device, held, Instant::now());
                self.send(conn, &Reply::Unparked { device });
                self.deliver_wakes(wakes);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn parked(
        self: &Arc<Self>,
        conn: ConnId,
        pid: u32,
        device: DeviceId,
        host_bytes: u64,
        held: u64,
        took: Duration,
        by: &str,
    ) {
        let Some(gpu) = self.label(&device).cloned() else { return };
        if !self.policy().is_member(conn, &device) {
            return;
        }
        self.metrics.parks.get_or_create(&gpu).inc();
        self.metrics.park_bytes.get_or_create(&gpu).inc_by(host_bytes);
        self.metrics.park_seconds.get_or_create(&gpu).observe(took.as_secs_f64());
        tracing::info!(pid, gpu = %gpu.gpu, host_bytes, held, ms = took.as_millis() as u64, "parked by {by}");
        let detail = format!("parked by {by} in {} ms", took.as_millis());
        self.record(conn, pid, gpu.gpu.clone(), EventKind::Parked, host_bytes, detail);
        let (bursts, wakes) = self.policy().parked(conn, device, host_bytes, held, Instant::now());
        self.deliver(bursts);
        self.deliver_wakes(wakes);
        self.park_step();
    }

    /// A call waits at the gate of a parked process: its answer, if it is decided now.
    pub(super) fn on_wake(
        self: &Arc<Self>,
        (conn, pid): (ConnId, u32),
        seq: u64,
        device: DeviceId,
    ) -> Option<Reply> {
        let now = Instant::now();
        let outcome = self.policy().wake(conn, device, seq, now);
        match outcome {
            WakeOutcome::Woken { bytes, restore: false } => {
                self.count_wake(conn, pid, device, Duration::ZERO);
                Some(Reply::Granted { seq, bytes })
            }
            WakeOutcome::Woken { bytes, restore: true } => {
                self.restore(conn, pid, seq, device, bytes, now);
                None
            }
            WakeOutcome::Queued => {
                tracing::debug!(pid, gpu = %uuid_string(&device), "a wake waits for room");
                self.park_step();
                None
            }
            WakeOutcome::Denied(reason) => Some(Reply::Denied { seq, reason }),
        }
    }

    /// Restores and unlocks the checkpointed `pid` (a blocking thread), then answers its
    /// wake. A restore that finds no room yet (memory outside gpufrac) is tried again until
    /// the wake's timeout.
    fn restore(
        self: &Arc<Self>,
        conn: ConnId,
        pid: u32,
        seq: u64,
        device: DeviceId,
        bytes: u64,
        asked: Instant,
    ) {
        let Some(api) = self.api() else {
            self.send(conn, &Reply::Denied { seq, reason: Denial::UnknownDevice });
            return;
        };
        let timeout = self.policy().peer(conn).map_or(Duration::from_secs(30), |p| p.wait_timeout);
        let shared = self.clone();
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
            match result {
                Ok(()) => {
                    let woken = shared.policy().woken(conn, device, None, Instant::now());
                    shared.count_wake(conn, pid, device, asked.elapsed());
                    shared.send(conn, &Reply::Granted { seq, bytes });
                    shared.deliver_wakes(woken);
                }
                Err(e) => {
                    tracing::error!(pid, gpu = %uuid_string(&device), "restoring a parked process failed ({e}); its next call asks again");
                    shared.policy().wake_failed(conn, device);
                    shared.send(conn, &Reply::Denied { seq, reason: Denial::Timeout });
                }
            }
        });
    }

    /// The shim's memory is back after its own swap-in, or it declined a park (busy).
    pub(super) fn on_woken(
        self: &Arc<Self>,
        (conn, pid): (ConnId, u32),
        device: DeviceId,
        held: u64,
        micros: u64,
    ) {
        let now = Instant::now();
        let declined = self.policy().is_parking(conn, &device);
        let wakes = if declined {
            tracing::info!(pid, gpu = %uuid_string(&device), "a park was declined: the process is busy");
            self.policy().park_given_up(conn, device, held, now)
        } else {
            let asked = self.policy().wake_asked(conn, &device);
            let wakes = self.policy().woken(conn, device, Some(held), now);
            let took = asked.map_or(Duration::from_micros(micros), |t| now.saturating_duration_since(t));
            self.count_wake(conn, pid, device, took);
            wakes
        };
        self.deliver_wakes(wakes);
        self.park_step();
    }

    fn count_wake(&self, conn: ConnId, pid: u32, device: DeviceId, took: Duration) {
        let Some(gpu) = self.label(&device).cloned() else { return };
        self.metrics.wakes.get_or_create(&gpu).inc();
        self.metrics.wake_seconds.get_or_create(&gpu).observe(took.as_secs_f64());
        tracing::info!(pid, gpu = %gpu.gpu, ms = took.as_millis() as u64, "woke a parked process");
        let detail = format!("woken in {} ms", took.as_millis());
        self.record(conn, pid, gpu.gpu, EventKind::Woken, 0, detail);
    }

    /// Answers wakes decided later: granted (restoring a checkpoint first) or refused.
    pub(super) fn deliver_wakes(self: &Arc<Self>, answers: Vec<WakeAnswer>) {
        for a in answers {
            let pid = self.policy().peer(a.conn).map_or(0, |p| p.pid);
            match a.result {
                Ok((bytes, true)) => {
                    self.restore(a.conn, pid, a.seq, a.device, bytes, Instant::now() - a.waited)
                }
                Ok((bytes, false)) => {
                    tracing::debug!(pid, waited_ms = a.waited.as_millis() as u64, "a wake waited for room");
                    self.send(a.conn, &Reply::Granted { seq: a.seq, bytes });
                }
                Err(reason) => {
                    if let Some(gpu) = self.label(&a.device) {
                        self.metrics.wake_timeouts.get_or_create(gpu).inc();
                    }
                    tracing::info!(pid, gpu = %uuid_string(&a.device), waited_ms = a.waited.as_millis() as u64, "a parked process was not woken in time: no room");
                    let detail = format!("not woken: {reason:?} after {} ms", a.waited.as_millis());
                    self.record(a.conn, pid, uuid_string(&a.device), EventKind::Denied, 0, detail);
                    self.send(a.conn, &Reply::Denied { seq: a.seq, reason });
                }
            }
        }
    }
}
