//! The server's side of compute shares (see `policy::compute` for the rule): hands out
//! leases as shims say they want the GPU or are done with it, and at each lease's end.
//! Nothing here reads NVML: what a group took is the time it held its leases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, Reply};

use super::Shared;
use crate::arbiter::policy::ConnId;

/// Longest the lease task sleeps without a deadline (groups join and leave meanwhile;
/// those changes wake it too).
const IDLE_LOOK: Duration = Duration::from_secs(1);

impl Shared {
    /// Moves the leases on to now and tells members what changed; returns when to look
    /// again at the latest.
    pub(super) fn lease_step(&self) -> Option<Instant> {
        let (orders, next) = self.policy().compute_step(Instant::now());
        for (conn, device, state) in orders {
            self.send(conn, &Reply::Lease { device, state });
        }
        next
    }

    /// A shim wants the GPU: a lease is handed out at once if it can be.
    pub(super) fn on_want(&self, conn: ConnId, device: DeviceId) {
        self.policy().compute_want(conn, device, Instant::now());
        self.lease_step();
        self.leases_changed.notify_one();
    }

    /// A shim is done with its lease: the next one goes at once.
    pub(super) fn on_lease_done(
        &self,
        conn: ConnId,
        device: DeviceId,
        lease: u32,
        drain_us: u32,
        more: bool,
    ) {
        self.policy().compute_done(conn, device, lease, drain_us, more, Instant::now());
        self.lease_step();
        self.leases_changed.notify_one();
    }
}

/// Ends leases at their deadlines and takes back those whose holder never answered.
pub(super) async fn run_leases(shared: Arc<Shared>) {
    loop {
        let step = shared.clone();
        let next = tokio::task::spawn_blocking(move || step.lease_step()).await.ok().flatten();
        let now = Instant::now();
        let until = next.filter(|&t| t < now + IDLE_LOOK).unwrap_or(now + IDLE_LOOK);
        tokio::select! {
            _ = tokio::time::sleep_until(until.into()) => {}
            _ = shared.leases_changed.notified() => {}
        }
    }
}
