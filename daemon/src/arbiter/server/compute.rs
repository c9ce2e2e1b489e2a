//! The server's side of compute shares (see `policy::compute` for the rule): samples each
//! GPU's per-process utilization while any group has a compute share, and tells members
//! their pace.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::Reply;

use super::Shared;
use crate::arbiter::policy::uuid_string;

/// How often utilization is sampled while a group has a compute share. NVML samples a
/// real GPU about every 1/6 s: a GPU without a new sample is left as it was.
const COMPUTE_EVERY: Duration = Duration::from_millis(100);

impl Shared {
    /// Re-plans the compute shares from fresh samples and tells members their new pace.
    fn pace_compute(&self) {
        let Some(list) = &self.processes else { return };
        let samples = list.utilization();
        if samples.is_empty() {
            return;
        }
        let orders = self.policy().compute_step(Instant::now(), &samples);
        for (conn, device, pace_pm) in orders {
            tracing::debug!(conn, gpu = %uuid_string(&device), pace_pm, "compute pace");
            self.send(conn, &Reply::Pace { device, pace_pm });
        }
    }
}

/// Samples utilization every [`COMPUTE_EVERY`] while a group has a compute share.
pub(super) async fn watch_compute(shared: Arc<Shared>) {
    if shared.processes.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(COMPUTE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !shared.policy().compute_controlled() {
            continue;
        }
        let sampler = shared.clone();
        let _ = tokio::task::spawn_blocking(move || sampler.pace_compute()).await;
    }
}
