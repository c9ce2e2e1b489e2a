//! What the queue looks like while bursts wait long: for operators chasing a stall.

use std::time::{Duration, Instant};

use super::super::Policy;

impl Policy {
    /// For operators chasing a stall (logged at debug): each GPU whose oldest waiter has
    /// waited `after` or longer, with its queue and its holders as the queue sees them.
    pub fn stall_report(&self, now: Instant, after: Duration) -> Vec<String> {
        let mut out = Vec::new();
        for (device, gpu) in &self.gpus {
            let Some(oldest) = gpu.queue.iter().map(|w| w.since).min() else { continue };
            if now.saturating_duration_since(oldest) < after {
                continue;
            }
            let mut line = format!(
                "gpu {} free {} shortfall {} outside {} wakers {} queue:",
                super::super::uuid_string(device),
                gpu.free() >> 20,
                gpu.shortfall() >> 20,
                gpu.outside() >> 20,
                gpu.wakers.len()
            );
            for w in &gpu.queue {
                line += &format!(
                    " [{}#{} {}MiB{}{}{} {}ms]",
                    w.group,
                    w.conn,
                    w.bytes >> 20,
                    if w.resume { " resume" } else { "" },
                    if w.continues { " step" } else { "" },
                    if gpu.held_back(w) { " held-back" } else { "" },
                    now.saturating_duration_since(w.since).as_millis()
                );
            }
            line += " holders:";
            for (name, conn, m) in gpu.members().filter(|(_, _, m)| m.granted > 0 || m.host_bytes > 0) {
                line += &format!(
                    " [{name}#{conn} granted {}MiB held {}MiB host {}MiB {:?}{}{}{}]",
                    m.granted >> 20,
                    m.held >> 20,
                    m.host_bytes >> 20,
                    m.residency,
                    if m.swapping_in { " swapping-in" } else { "" },
                    if gpu.under_way(name, now) { " under-way" } else { "" },
                    if gpu.growing(name, now) { " growing" } else { "" },
                );
            }
            out.push(line);
        }
        out
    }
}
