//! The resolvers' orchestration: the ticker that expires waiters, reminds holders to give
//! back while bursts wait, runs the priority and swap resolvers and takes loans back for
//! guarantees; what each asks of the shims goes out here, whom to end goes to `endings`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::Reply;

use super::document::{loan_gpu, record};
use super::endings::{end, ending};
use super::Shared;
use crate::arbiter::document::EventKind;
use crate::arbiter::policy::{uuid_string, ConnId, FollowUp, Policy};

/// How often waiters are checked against their deadlines.
const TICK: Duration = Duration::from_millis(5);

/// How long the oldest waiter of a GPU waits before its queue is described at debug
/// level, and how often then.
const STALL_REPORT_EVERY: Duration = Duration::from_secs(5);

/// How often holders are reminded to give back while bursts wait or a guarantee is owed.
const RECLAIM_EVERY: Duration = Duration::from_millis(200);

/// A holder is asked to give back at most this often (bursts that queue one after another
/// each ask): its shim's give-back is under way.
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(100);

/// The priority resolver: ends the holders chosen for waiting priority bursts.
pub(super) fn resolve_priority(shared: &Shared, policy: &Policy) {
    let now = Instant::now();
    let mut ending = ending(shared, policy, now);
    let spared: Vec<ConnId> = ending.keys().copied().collect();
    let victims = policy.priority_victims(now, shared.options.idle_timeout, &spared);
    for v in victims {
        tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "terminating a holder of burst memory for a priority burst");
        let detail = format!("for a priority burst: {}", v.why);
        record(shared, policy, v.conn, v.pid, loan_gpu(policy, v.pid), EventKind::Ended, v.bytes, detail);
        let reason = if v.why.starts_with("idle") { "idle" } else { "lower-priority" };
        end(shared, &mut ending, &v, reason, now);
    }
}

/// Takes loans back where the guarantees are owed memory: unused grants first, then
/// swap-outs, then ending holders (see `policy::reclaim`).
pub(super) fn reclaim_guarantees(shared: &Shared, policy: &mut Policy) {
    let now = Instant::now();
    let mut ending = ending(shared, policy, now);
    let under_way: Vec<ConnId> = ending.keys().copied().collect();
    let plan = policy.reclaim(now, &under_way, shared.options.swap_limit);
    if plan.is_empty() {
        return;
    }
    for (conn, device) in &plan.give_back {
        shared.send(*conn, &Reply::Reclaim { device: *device });
    }
    for v in &plan.swap_out {
        tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a guarantee");
        shared.send(v.conn, &Reply::SwapOut { device: v.device });
    }
    for v in &plan.end {
        tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "ending a holder of burst memory for a guarantee");
        let detail = format!("for a guarantee: {}", v.why);
        record(shared, policy, v.conn, v.pid, loan_gpu(policy, v.pid), EventKind::Ended, v.bytes, detail);
        end(shared, &mut ending, v, "guarantee", now);
    }
}

/// The swap resolver: asks the chosen holders to swap out, and swapped-out processes to
/// come back when memory is free.
pub(super) fn resolve_swap(shared: &Shared, policy: &mut Policy) {
    let victims = policy.swap_victims(Instant::now(), shared.options.swap_quantum, shared.options.swap_limit);
    for v in victims {
        tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a swap burst");
        shared.send(v.conn, &Reply::SwapOut { device: v.device });
    }
    // Memory counts as free again once no burst was asked for during a quantum (at most a
    // second), so a process in the middle of a burst is not raced.
    let settle = shared.options.swap_quantum.min(Duration::from_secs(1));
    let resumable = policy.resume_candidates(Instant::now(), settle);
    for (conn, device) in resumable {
        shared.send(conn, &Reply::Resume { device });
    }
}

/// While bursts wait, holders of grants are asked to give back what they do not use (when
/// a burst queues, and every [`RECLAIM_EVERY`] while any waits), each at most once per
/// [`ASK_AGAIN_AFTER`]. (Asked at every tick, a holder that had just registered again
/// after an arbiter restart was asked within milliseconds, and a waiter's entry was lost:
/// `arbiter::a_restarted_arbiter_lends_nothing_…`.)
pub(super) fn ask_to_give_back(shared: &Shared, policy: &Policy) {
    let now = Instant::now();
    let holders = policy.contended_holders(now);
    let mut asked = shared.asked_to_give_back.lock().unwrap_or_else(|p| p.into_inner());
    asked.retain(|_, at| now.saturating_duration_since(*at) < ASK_AGAIN_AFTER);
    for (conn, device) in holders {
        // Asked within ASK_AGAIN_AFTER: its give-back is under way.
        if let std::collections::hash_map::Entry::Vacant(entry) = asked.entry((conn, device)) {
            entry.insert(now);
            shared.send(conn, &Reply::Reclaim { device });
        }
    }
}

/// The ticker: every [`TICK`], wakes and expires waiters and runs the resolvers, under one
/// lock of the policy.
pub(super) async fn expire_waiters(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(TICK);
    let mut last_reclaim = Instant::now();
    let mut last_flush = Instant::now();
    let mut last_stall_report = Instant::now();
    loop {
        tick.tick().await;
        let mut policy = shared.policy();
        if last_flush.elapsed() >= Duration::from_secs(1) {
            last_flush = Instant::now();
            shared.logs.flush();
            if tracing::enabled!(tracing::Level::DEBUG) && last_stall_report.elapsed() >= STALL_REPORT_EVERY {
                last_stall_report = Instant::now();
                for line in policy.stall_report(Instant::now(), STALL_REPORT_EVERY) {
                    tracing::debug!("bursts have waited {STALL_REPORT_EVERY:?} or longer: {line}");
                }
            }
        }
        // Wakes first: one lends again, which may leave a queued burst without a chance,
        // refused at once by `expire`.
        shared.follow_up(&mut policy, FollowUp::parking());
        // Keep asking holders while anyone waits (they keep no slack meanwhile; a pooled
        // one may have finished its batch since), and let the priority resolver look again
        // (holders become idle over time); the swap resolver and reclaim look at each tick.
        let remind = last_reclaim.elapsed() >= RECLAIM_EVERY;
        if remind {
            last_reclaim = Instant::now();
        }
        let follow = policy.on_tick(Instant::now(), remind);
        shared.follow_up(&mut policy, follow);
    }
}
