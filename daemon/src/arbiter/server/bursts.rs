//! Bursts: acquires, releases and swaps; answers to queued bursts (granted after a wait,
//! denied), counted and logged; and what the server keeps of each burst still queued.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Reply, SwapDirection};

use super::connection::Connection;
use super::document::record;
use super::frames::reply;
use super::Shared;
use crate::arbiter::document::EventKind;
use crate::arbiter::metrics::Refusal;
use crate::arbiter::policy::{uuid_string, Answer, ConnId, Outcome, Policy};

/// A burst that waited at least this long is logged at INFO (shorter waits at debug: a
/// burst asks in chunks, and most chunks wait a little while bursts take turns).
const LOGGED_WAIT: Duration = Duration::from_secs(1);

/// A burst queued, as the server saw it go in.
pub(super) struct Queued {
    pub(super) device: DeviceId,
    pub(super) pid: u32,
    pub(super) bytes: u64,
    pub(super) resume: bool,
    pub(super) since: Instant,
}

/// The bursts queued and not answered yet, by connection and sequence number: what the
/// status lists as waiting (with what each needs).
#[derive(Default)]
pub(super) struct Queue(Mutex<HashMap<(ConnId, u64), Queued>>);

impl Queue {
    fn lock(&self) -> MutexGuard<'_, HashMap<(ConnId, u64), Queued>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a burst that went into the queue.
    fn insert(&self, conn: ConnId, seq: u64, queued: Queued) {
        self.lock().insert((conn, seq), queued);
    }

    /// The burst answered now, if it was kept.
    fn take(&self, conn: ConnId, seq: u64) -> Option<Queued> {
        self.lock().remove(&(conn, seq))
    }

    /// Forgets the bursts `conn` had queued (it closed).
    pub(super) fn forget(&self, conn: ConnId) {
        self.lock().retain(|(c, _), _| *c != conn);
    }

    /// What `f` makes of each burst kept, where it makes something.
    pub(super) fn listed<T>(&self, f: impl FnMut(&Queued) -> Option<T>) -> Vec<T> {
        self.lock().values().filter_map(f).collect()
    }
}

/// Sends the answers to queued bursts, counts and logs them.
pub(super) fn deliver(shared: &Shared, policy: &Policy, answers: Vec<Answer>) {
    for a in answers {
        let asked = shared.queued.take(a.conn, a.seq);
        // Answers come from the ledger, so always for a GPU it manages.
        let gpu = shared.label(&a.device);
        let uuid = uuid_string(&a.device);
        let (pid, group) = policy.peer(a.conn).map_or((0, String::new()), |p| (p.pid, p.group.clone()));
        if let Some(gpu) = gpu {
            shared.metrics.wait_seconds.get_or_create(gpu).observe(a.waited.as_secs_f64());
        }
        match a.result {
            Ok(bytes) => {
                if let Some(gpu) = gpu {
                    shared.metrics.grants.get_or_create(gpu).inc();
                    shared.metrics.granted_bytes.get_or_create(gpu).inc_by(bytes);
                }
                // Operators see bursts that waited long, not allocator traffic.
                if a.waited >= LOGGED_WAIT {
                    tracing::info!(pid, %group, gpu = %uuid, bytes, waited_ms = a.waited.as_millis() as u64, "a burst waited {} ms for its memory", a.waited.as_millis());
                    let detail = format!("waited {} ms for its memory", a.waited.as_millis());
                    record(shared, policy, a.conn, pid, uuid.clone(), EventKind::Waited, bytes, detail);
                } else {
                    tracing::debug!(pid, %group, gpu = %uuid, bytes, waited_ms = a.waited.as_millis() as u64, "grant after wait");
                }
                shared.send(a.conn, &Reply::Granted { seq: a.seq, bytes });
            }
            Err(reason) => {
                if let (Denial::Timeout, Some(gpu)) = (reason, gpu) {
                    shared.metrics.timeouts.get_or_create(gpu).inc();
                }
                if reason == Denial::Deadlock {
                    // Not an out-of-memory error yet: its shim gives back what it was
                    // lent and does not use, and asks again.
                    tracing::info!(pid, %group, gpu = %uuid, waited_ms = a.waited.as_millis() as u64, ?reason, "a circle of waits broken: every borrower waited, this one is refused its burst");
                } else {
                    tracing::info!(pid, %group, gpu = %uuid, waited_ms = a.waited.as_millis() as u64, ?reason, "burst denied");
                }
                let detail = format!("{reason:?} after waiting {} ms", a.waited.as_millis());
                let bytes = asked.map_or(0, |q| q.bytes);
                record(shared, policy, a.conn, pid, uuid.clone(), EventKind::Denied, bytes, detail);
                shared.send(a.conn, &Reply::Denied { seq: a.seq, reason });
            }
        }
    }
}

/// An `Acquire`: burst memory granted at once, queued (the resolvers then look at once),
/// or denied.
#[allow(clippy::too_many_arguments)]
pub(super) fn on_acquire(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    c: &Connection,
    out: &mut Vec<u8>,
    seq: u64,
    device: DeviceId,
    bytes: u64,
    preferred: u64,
    held: u64,
    resume: bool,
) {
    let (conn, pid) = (c.who.conn, c.who.pid);
    let now = Instant::now();
    let (outcome, follow) = policy.on_acquire(conn, device, seq, bytes, preferred, held, resume, now);
    // No metric series for a device ID the arbiter does not manage.
    let gpu = shared.label(&device);
    match outcome {
        Outcome::Granted(granted) => {
            if let Some(gpu) = gpu {
                shared.metrics.grants.get_or_create(gpu).inc();
                shared.metrics.granted_bytes.get_or_create(gpu).inc_by(granted);
            }
            reply(out, &Reply::Granted { seq, bytes: granted });
        }
        Outcome::Queued => {
            if let Some(gpu) = gpu {
                shared.metrics.waits.get_or_create(gpu).inc();
            }
            shared.queued.insert(conn, seq, Queued { device, pid, bytes, resume, since: now });
            tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "burst waits: memory is lent out");
            // A process whose burst memory is in host RAM gets nothing new until it is back:
            // its burst waits for its swap-in, which the swap resolver tells it to ask for.
            if !resume && policy.swapped_out(conn, &device) {
                tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "burst held back until its process is swapped back in");
            }
        }
        Outcome::Denied(reason) => {
            shared.metrics.refusals.get_or_create(&Refusal { reason: format!("{reason:?}") }).inc();
            reply(out, &Reply::Denied { seq, reason });
        }
    }
    // Queued: the queue settled at once, and the resolvers look.
    shared.follow_up(policy, follow);
}

/// A `Release`: memory given back, which may answer bursts (and wakes) waiting for it
/// (see [`Policy::on_release`] for what follows).
pub(super) fn on_release(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    c: &Connection,
    device: DeviceId,
    bytes: u64,
    held: u64,
) {
    let follow = policy.on_release(c.who.conn, device, bytes, held, Instant::now());
    shared.follow_up(policy, follow);
}

/// A `Swapped`: the shim moved memory to host RAM or back; counted and logged only on a
/// GPU the connection is registered on, its host memory believed up to what it can hold.
#[allow(clippy::too_many_arguments)]
pub(super) fn on_swapped(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    c: &Connection,
    device: DeviceId,
    direction: SwapDirection,
    bytes: u64,
    granted: u64,
    host_bytes: u64,
    held: u64,
    micros: u64,
) {
    let (conn, pid, uid) = (c.who.conn, c.who.pid, c.who.uid);
    // Counted and logged only for a GPU this connection is registered on: any
    // other device ID would make a metric series per frame.
    let member = policy.is_member(conn, &device);
    if let (true, Some(gpu)) = (member, shared.label(&device)) {
        let direction = direction.as_str();
        let took = Duration::from_micros(micros);
        if shared.logs.connection_line(uid).is_some() {
            tracing::info!(pid, gpu = %gpu.gpu, bytes, host_bytes, granted, ms = took.as_millis() as u64, us = micros, "swapped {direction}");
        }
        if bytes > 0 {
            shared.metrics.count_swap(gpu, direction, bytes, took);
            let kind = if direction == "in" { EventKind::SwappedIn } else { EventKind::SwappedOut };
            let detail = format!("swapped {direction} in {} ms", took.as_millis());
            record(shared, policy, conn, pid, gpu.gpu.clone(), kind, bytes, detail);
        }
    }
    let host_bytes = if host_bytes > 0 { host_bytes.min(shared.host_memory_cap(conn, pid)) } else { 0 };
    let follow = policy.on_swapped(conn, device, granted, host_bytes, held, Instant::now());
    shared.follow_up(policy, follow);
}
