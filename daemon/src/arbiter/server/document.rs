//! What the server shows: the status document (`gpufrac status`), the bursts waiting and
//! the last events (`gpufrac top`), each client seeing only its own user's processes
//! unless it is an admin.

use std::time::Instant;

use super::{Shared, Who};
use crate::arbiter::document::{now_ms, Document, Event, EventKind, QueuedBurst, Status};
use crate::arbiter::policy::{uuid_string, ConnId, Policy};

/// Most processes listed in a status document, over all GPUs (and [`MAX_LISTED_PER_GPU`]
/// per GPU): about 1 KiB each at most, well under the CLI's limit on a status frame.
const MAX_LISTED: usize = 8192;
/// Most processes listed per GPU in a status document.
const MAX_LISTED_PER_GPU: usize = 4096;
/// Events kept for `gpufrac top` (bursts that waited or were denied, swaps, holders
/// ended, registrations refused): the last this many.
pub(super) const EVENTS_KEPT: usize = 64;
/// Most waiting bursts listed in a status document.
const MAX_QUEUE_LISTED: usize = 1024;

/// The status document, every process listed (what metrics are made from).
pub(super) fn status(shared: &Shared, policy: &Policy) -> Status {
    Status { swap_limit: shared.options.swap_limit, ..policy.status() }
}

/// [`status`] as served to `gpufrac status`: at most [`MAX_LISTED_PER_GPU`] processes
/// listed per GPU and [`MAX_LISTED`] in all, the rest counted, so that it stays under the
/// CLI's limit on a frame however many processes there are.
pub(super) fn status_listed(shared: &Shared, policy: &Policy) -> Status {
    let mut status = status(shared, policy);
    status.limit_processes(MAX_LISTED_PER_GPU, MAX_LISTED);
    status
}

/// The document served to `who`: [`status_listed`] with the bursts waiting and the last
/// events; every process for an admin, else only its own user's (the GPUs' totals stay),
/// and only the waiters and events about them.
pub(super) fn document_for(shared: &Shared, policy: &Policy, who: Who, admin: bool) -> Document {
    let status = status(shared, policy);
    let queue = queue(shared, &status);
    let events = shared.events.lock().unwrap_or_else(|p| p.into_inner()).recent();
    let mut document = Document { status, queue, events };
    if !admin {
        document.only_uid(who.uid);
    }
    document.status.limit_processes(MAX_LISTED_PER_GPU, MAX_LISTED);
    document
}

/// The bursts waiting, longest first: those queued and not answered whose process
/// `status` shows waiting (or swapped out, for a swap-in) on that GPU.
fn queue(shared: &Shared, status: &Status) -> Vec<QueuedBurst> {
    let now = Instant::now();
    let mut listed: Vec<(Instant, QueuedBurst)> = shared.queued.listed(|q| {
        let uuid = uuid_string(&q.device);
        let gpu = status.gpus.iter().find(|g| g.uuid == uuid)?;
        let p = gpu
            .processes
            .iter()
            .find(|p| p.pid == q.pid && (p.state == "waiting" || p.state == "swapped"))?;
        let waited = now.saturating_duration_since(q.since);
        Some((
            q.since,
            QueuedBurst {
                gpu: uuid,
                pid: q.pid,
                uid: p.uid,
                group: p.group.clone(),
                bytes: q.bytes,
                waited_ms: waited.as_millis() as u64,
                resume: q.resume,
            },
        ))
    });
    listed.sort_by_key(|(since, q)| (*since, q.pid));
    listed.truncate(MAX_QUEUE_LISTED);
    listed.into_iter().map(|(_, q)| q).collect()
}

/// Keeps an event about the process on `conn` (`pid`) for `gpufrac top`: its user and
/// group from the ledger (a process already gone: shown to admins only).
#[allow(clippy::too_many_arguments)]
pub(super) fn record(
    shared: &Shared,
    policy: &Policy,
    conn: ConnId,
    pid: u32,
    gpu: String,
    kind: EventKind,
    bytes: u64,
    detail: String,
) {
    let (uid, group) = policy
        .peer(conn)
        .map_or((u32::MAX, String::new()), |p| (p.uid, crate::entitlement::shown_group(&p.group).to_owned()));
    let event = Event { at_ms: now_ms(), gpu, pid, uid, group, kind, bytes, detail };
    shared.events.lock().unwrap_or_else(|p| p.into_inner()).push(event);
}

/// The GPU on which `pid` borrows the most (where a holder being ended holds its loan),
/// or empty. Only for events, which are rare: it reads the whole status.
pub(super) fn loan_gpu(policy: &Policy, pid: u32) -> String {
    let status = policy.status();
    let on = status
        .gpus
        .iter()
        .filter_map(|g| g.processes.iter().find(|p| p.pid == pid).map(|p| (p.granted, &g.uuid)))
        .max_by_key(|(granted, _)| *granted);
    on.map(|(_, uuid)| uuid.clone()).unwrap_or_default()
}
