//! Process watching: NVML is asked which processes use each GPU (memory of those not
//! registered is not lent), at start and every [`OBSERVE_EVERY`]; each look also feeds
//! the backstop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Shared;

/// How often NVML is asked which processes use memory (for memory used outside gpufrac).
const OBSERVE_EVERY: Duration = Duration::from_millis(250);

impl Shared {
    /// Learns which processes use each GPU: memory of those not registered is not lent.
    pub(super) fn observe_processes(&self) {
        let Some(list) = &self.processes else { return };
        let now = Instant::now();
        for (device, listed) in list.processes() {
            let answers = self.policy().observe_processes(device, &listed, now);
            self.deliver(answers);
        }
        // Each look also compared the device's count with the shims'.
        self.backstop();
    }
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
        let _ = tokio::task::spawn_blocking(move || observer.observe_processes()).await;
    }
}
