//! The server's side of compute shares (see `policy::compute` for the rule): hands out
//! leases as shims say they want the GPU or are done with it, and at each lease's end.
//! Nothing here reads NVML: what a group took is the time it held its leases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;

use super::Shared;
use crate::arbiter::policy::{ConnId, FollowUp, Policy};

/// Longest the lease task sleeps without a deadline (groups join and leave meanwhile;
/// those changes wake it too).
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// Moves the leases on to now and tells members what changed; returns when to look again
/// at the latest (the lease task's step).
fn lease_step(shared: &Arc<Shared>) -> Option<Instant> {
    let mut policy = shared.policy();
    let (leases, next) = policy.compute_step(Instant::now());
    shared.follow_up(&mut policy, FollowUp { leases, ..FollowUp::default() });
    next
}

/// A shim wants the GPU: a lease is handed out at once if it can be.
pub(super) fn on_want(shared: &Arc<Shared>, policy: &mut Policy, conn: ConnId, device: DeviceId) {
    let follow = policy.on_want(conn, device, Instant::now());
    shared.follow_up(policy, follow);
}

/// A shim is done with its lease: the next one goes at once.
pub(super) fn on_lease_done(
    shared: &Arc<Shared>,
    policy: &mut Policy,
    conn: ConnId,
    (device, lease, drain_us, more): (DeviceId, u32, u32, bool),
) {
    let follow = policy.on_lease_done(conn, device, lease, drain_us, more, Instant::now());
    shared.follow_up(policy, follow);
}

/// Ends leases at their deadlines and takes back those whose holder never answered.
pub(super) async fn run_leases(shared: Arc<Shared>) {
    loop {
        let step = shared.clone();
        let next = tokio::task::spawn_blocking(move || lease_step(&step)).await.ok().flatten();
        let now = Instant::now();
        let until = next.filter(|&t| t < now + IDLE_LOOK).unwrap_or(now + IDLE_LOOK);
        tokio::select! {
            _ = tokio::time::sleep_until(until.into()) => {}
            _ = shared.leases_changed.notified() => {}
        }
    }
}
