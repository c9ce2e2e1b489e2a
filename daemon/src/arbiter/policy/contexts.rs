//! What a context takes on each GPU. A real context takes 300 to 600 MiB (more with a
//! larger device heap), so it is part of every request in practice, and a shim that has
//! never measured one on a GPU would otherwise charge a guess for its first. The arbiter
//! learns the figure from the first clean measurement a shim reports
//! ([`Policy::context_measured`]; the newest report waits, if several came before a look)
//! that NVML confirms: believed only once NVML shows the reporting process using at least
//! that much (a report alone could inflate every group's first charge and
//! the backstop's slack), and tells every shim at registration. Admission warns when a
//! request is smaller than the GPU's context: the context alone then lives on a loan.

use gpufrac_common::protocol::DeviceId;

use super::{ConnId, Gpu, Policy};

/// A report waiting for NVML's confirmation: (the reporter's PID, bytes).
pub(super) type Candidate = (u32, u64);

/// The most a context is believed to take: real ones take 300 to 600 MiB, more only with
/// a device heap or stack set large, which is charged to its own group, not to every
/// group's first context (nor to the backstop's slack).
pub const MOST_BELIEVED: u64 = 2 << 30;

impl Gpu {
    /// Believes the waiting report if NVML's last look shows its process using at least
    /// that much; returns the size learnt.
    pub(super) fn confirm_context(&mut self) -> Option<u64> {
        let (pid, bytes) = self.context_candidate?;
        if self.context_bytes.is_some() {
            self.context_candidate = None;
            return None;
        }
        let used = self.seen.get(&pid).copied().unwrap_or(0);
        if used < bytes {
            return None;
        }
        self.context_candidate = None;
        self.context_bytes = Some(bytes);
        Some(bytes)
    }
}

impl Policy {
    /// A shim of connection `conn` measured a context on `device` cleanly: a candidate
    /// for the GPU's context size until NVML confirms it (the first confirmed one stays).
    pub fn context_measured(&mut self, conn: ConnId, device: &DeviceId, bytes: u64) {
        if !self.is_member(conn, device) {
            return;
        }
        let Some(pid) = self.peers.get(&conn).map(|p| p.pid) else { return };
        let Some(gpu) = self.gpus.get_mut(device) else { return };
        // The newest report waits: an older one's process may have gone before NVML saw it.
        if gpu.context_bytes.is_none() && bytes > 0 && bytes <= gpu.total.min(MOST_BELIEVED) {
            gpu.context_candidate = Some((pid, bytes));
        }
    }

    /// What a context takes on `device`, when learnt.
    pub fn context_bytes(&self, device: &DeviceId) -> Option<u64> {
        self.gpus.get(device).and_then(|g| g.context_bytes)
    }

    /// The warning admission gives for a request smaller than a context on `device`.
    pub fn small_request_warning(&self, device: &DeviceId, request: u64) -> Option<String> {
        use gpufrac_common::size::format_size;
        let context = self.context_bytes(device)?;
        (request < context).then(|| {
            format!(
                "GPUFRAC_MEMORY_REQUEST ({}) is smaller than a context on this GPU ({}): the context alone \
                 takes memory above the request, a loan that a guarantee can take back",
                format_size(request),
                format_size(context)
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::testing::{peer, GIB, GPU};
    use super::super::{Peer, Policy};

    const MIB: u64 = 1 << 20;

    fn one_group() -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 100, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        p
    }

    #[test]
    fn a_reported_context_size_is_believed_once_nvml_shows_it() {
        let now = Instant::now();
        let mut p = one_group();
        p.context_measured(1, &GPU, 500 * MIB);
        assert_eq!(p.context_bytes(&GPU), None, "a report alone is not believed");
        p.observe_processes(GPU, &[(100, 200 * MIB)], now);
        assert_eq!(p.context_bytes(&GPU), None, "NVML shows less than the report");
        p.observe_processes(GPU, &[(100, 600 * MIB)], now);
        assert_eq!(p.context_bytes(&GPU), Some(500 * MIB));
        // The first stays.
        p.context_measured(1, &GPU, 700 * MIB);
        p.observe_processes(GPU, &[(100, 2 * GIB)], now);
        assert_eq!(p.context_bytes(&GPU), Some(500 * MIB));
    }

    #[test]
    fn only_a_member_of_the_gpu_reports_and_never_past_the_most_believed() {
        let now = Instant::now();
        let mut p = one_group();
        p.context_measured(9, &GPU, 500 * MIB);
        p.context_measured(1, &GPU, 32 * GIB);
        p.observe_processes(GPU, &[(100, 16 * GIB)], now);
        p.context_measured(1, &GPU, 3 * GIB);
        p.observe_processes(GPU, &[(100, 16 * GIB)], now);
        assert_eq!(p.context_bytes(&GPU), None);
    }

    #[test]
    fn admission_warns_of_a_request_smaller_than_the_context() {
        let now = Instant::now();
        let mut p = one_group();
        assert_eq!(p.small_request_warning(&GPU, 128 * MIB), None, "nothing known yet");
        p.context_measured(1, &GPU, 500 * MIB);
        p.observe_processes(GPU, &[(100, 600 * MIB)], now);
        let warning = p.small_request_warning(&GPU, 128 * MIB).expect("a warning");
        assert!(warning.contains("128.00 MiB") && warning.contains("500.00 MiB"), "{warning}");
        assert_eq!(p.small_request_warning(&GPU, GIB), None);
    }
}
