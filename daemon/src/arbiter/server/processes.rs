//! Process watching: NVML is asked which processes use each GPU (memory of those not
//! registered is not lent), at start and every [`OBSERVE_EVERY`]; each look also feeds
//! the backstop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::backstop::backstop;
use super::Shared;
use crate::arbiter::policy::FollowUp;

/// How often NVML is asked which processes use memory (for memory used outside gpufrac).
const OBSERVE_EVERY: Duration = Duration::from_millis(250);

/// Learns which processes use each GPU (NVML asked first, outside the policy's lock):
/// memory of those not registered is not lent.
pub(super) fn observe_processes(shared: &Arc<Shared>) {
    let Some(list) = &shared.processes else { return };
    let now = Instant::now();
    let listed = list.processes();
    let mut policy = shared.policy();
    let mut follow = FollowUp::default();
    for (device, listed) in listed {
        follow = follow.and(policy.on_processes(device, &listed, now));
    }
    shared.follow_up(&mut policy, follow);
    // Each look also compared the device's count with the shims'.
    backstop(shared, &mut policy);
}

/// Looks every [`OBSERVE_EVERY`] (a blocking NVML call, off the runtime's threads).
pub(super) async fn watch_processes(shared: Arc<Shared>) {
    if shared.processes.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(OBSERVE_EVERY);
    // After a slow NVML answer, wait a whole period rather than ask again at once.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let observer = shared.clone();
        let _ = tokio::task::spawn_blocking(move || observe_processes(&observer)).await;
    }
}
