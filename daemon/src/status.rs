//! The status document the arbiter serves to `gpufrac status` (JSON), and its table form.

use serde::{Deserialize, Serialize};

/// The whole node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Every GPU the arbiter manages.
    pub gpus: Vec<GpuStatus>,
    /// Host RAM the node allows for swapped-out memory (`--swap-limit`), in bytes.
    #[serde(default)]
    pub swap_limit: u64,
}

/// One GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    /// `GPU-...` UUID.
    pub uuid: String,
    /// Physical memory.
    pub total: u64,
    /// Sum of the requests of the groups on it.
    pub guaranteed: u64,
    /// Sum of the burst grants.
    pub burst: u64,
    /// What is left to grant.
    pub free: u64,
    /// Memory used by processes NVML lists that are not registered with the arbiter
    /// (programs without the shim; after a restart, shims not yet back): never lent.
    #[serde(default)]
    pub outside: u64,
    /// Lent memory being taken back because the guarantees need it (a request admitted
    /// while its memory was lent out): nothing is lent until it is back.
    #[serde(default)]
    pub reclaiming: u64,
    /// Processes waiting for a grant.
    pub waiting: usize,
    /// Bytes of its processes' burst memory swapped out to host RAM.
    #[serde(default)]
    pub swapped: u64,
    /// Every registered process.
    pub processes: Vec<ProcessStatus>,
}

/// One process on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Process ID in the arbiter's PID namespace.
    pub pid: u32,
    /// Its group.
    pub group: String,
    /// `namespace/name` or empty.
    pub pod: String,
    /// The group's request.
    pub request: u64,
    /// The group's limit.
    pub limit: u64,
    /// Bytes it holds, as last reported.
    pub held: u64,
    /// Burst bytes granted to it.
    pub granted: u64,
    /// The group's priority.
    pub priority: i32,
    /// The group's resolver.
    pub resolver: String,
    /// `running`, `waiting` or `swapped`.
    pub state: String,
    /// Bytes of its burst memory kept in host RAM while swapped out.
    #[serde(default)]
    pub host_bytes: u64,
    /// How long it has waited for bursts, in all (the current wait included), in ms.
    #[serde(default)]
    pub waited_ms: u64,
    /// How long it has been swapped out, in all (the current swap included), in ms.
    #[serde(default)]
    pub swapped_ms: u64,
}

/// Why the status could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Nobody answers on the socket.
    #[error(
        "cannot reach the arbiter at {path}: {source} (is gpufrac-arbiter running? --socket names another)"
    )]
    Connect {
        /// The socket.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// The answer was not a status document.
    #[error("bad answer from the arbiter: {0}")]
    Answer(String),
}

/// Asks the arbiter at `socket` for its status.
pub fn fetch(socket: &std::path::Path) -> Result<Status, FetchError> {
    use gpufrac_common::protocol::{read_frame, Reply, Request, MAX_STATUS_FRAME};
    use std::io::Write;
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .map_err(|source| FetchError::Connect { path: socket.display().to_string(), source })?;
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    stream.write_all(&Request::Status.encode()).map_err(|e| FetchError::Answer(e.to_string()))?;
    let body = read_frame(&mut stream, MAX_STATUS_FRAME).map_err(|e| FetchError::Answer(e.to_string()))?;
    match Reply::decode(&body).map_err(|e| FetchError::Answer(e.to_string()))? {
        Reply::Status { json } => serde_json::from_str(&json).map_err(|e| FetchError::Answer(e.to_string())),
        other => Err(FetchError::Answer(format!("unexpected {other:?}"))),
    }
}

fn seconds(ms: u64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

fn gib(bytes: u64) -> String {
    format!("{:.2}GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl Status {
    /// The human-readable table of `gpufrac status`.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        if self.gpus.is_empty() {
            out.push_str("no GPUs\n");
        }
        let swapped: u64 = self.gpus.iter().map(|g| g.swapped).sum();
        let cap = if self.swap_limit == u64::MAX { "no limit".to_owned() } else { gib(self.swap_limit) };
        let _ = writeln!(out, "host RAM for swapped-out memory: {} of {cap}", gib(swapped));
        for g in &self.gpus {
            let _ = writeln!(
                out,
                "GPU {}  memory {}  guaranteed {}  burst {}  free {}  waiting {}  swapped to host {}",
                g.uuid,
                gib(g.total),
                gib(g.guaranteed),
                gib(g.burst),
                gib(g.free),
                g.waiting,
                gib(g.swapped)
            );
            if g.outside > 0 {
                let _ = writeln!(out, "  {} used by processes outside gpufrac (not lent)", gib(g.outside));
            }
            if g.reclaiming > 0 {
                let _ = writeln!(
                    out,
                    "  {} of lent memory being taken back for the guarantees (nothing is lent meanwhile)",
                    gib(g.reclaiming)
                );
            }
            let _ = writeln!(
                out,
                "  {:>8}  {:<20} {:<24} {:>10} {:>10} {:>10} {:>8} {:<8} {:<8} {:>10} {:>9} {:>9}",
                "PID",
                "GROUP",
                "POD",
                "REQUEST",
                "LIMIT",
                "HELD",
                "PRIORITY",
                "RESOLVER",
                "STATE",
                "HOST",
                "WAITED",
                "SWAPPED"
            );
            for p in &g.processes {
                let _ = writeln!(
                    out,
                    "  {:>8}  {:<20} {:<24} {:>10} {:>10} {:>10} {:>8} {:<8} {:<8} {:>10} {:>9} {:>9}",
                    p.pid,
                    p.group,
                    if p.pod.is_empty() { "-" } else { &p.pod },
                    gib(p.request),
                    gib(p.limit),
                    gib(p.held),
                    p.priority,
                    p.resolver,
                    p.state,
                    gib(p.host_bytes),
                    seconds(p.waited_ms),
                    seconds(p.swapped_ms)
                );
            }
        }
        out
    }
}
