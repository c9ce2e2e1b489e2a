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
    /// Bytes of such debts paid back so far by their borrowers giving back (unused grants,
    /// or memory freed while the debt was open).
    #[serde(default)]
    pub repaid_given_back: u64,
    /// Bytes of such debts paid back by swapping holders out to host RAM.
    #[serde(default)]
    pub repaid_swapped: u64,
    /// Bytes of such debts paid back by ending holders (after the reclaim grace).
    #[serde(default)]
    pub repaid_ended: u64,
    /// Processes waiting for a grant.
    pub waiting: usize,
    /// Bytes of its processes' burst memory swapped out to host RAM.
    #[serde(default)]
    pub swapped: u64,
    /// Every registered process, or the first of them when there are very many.
    pub processes: Vec<ProcessStatus>,
    /// Registered processes not listed in `processes` (the document stays small).
    #[serde(default)]
    pub truncated: usize,
}

/// One process on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Process ID in the arbiter's PID namespace.
    pub pid: u32,
    /// Its user (from the kernel): a client is shown only its own user's processes.
    #[serde(default)]
    pub uid: u32,
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
    /// What it may have: the entitlement's source (`policy FILE: uid 1000`, `kubelet: ...`),
    /// `not entitled: <why>`, or `unrestricted (no policy)`.
    #[serde(default)]
    pub entitlement: String,
    /// What it declared beyond its entitlement and was cut (`priority 100 -> 10`), or empty.
    #[serde(default)]
    pub capped: String,
    /// Its group's key in the arbiter's ledger (`@<derived>`, `<uid>/<name>`,
    /// `<uid>:<pid>/<name>`): what tells groups shown under one name apart (metrics).
    /// Not sent to clients.
    #[serde(skip)]
    pub group_key: String,
}

/// Why the status could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Nobody answers on the socket. What the system said is in the message, not a
    /// `source`: printed with its chain, it would come twice, around the hint.
    #[error(
        "cannot reach the arbiter at {path}: {error} (is gpufrac-arbiter running? --socket names another)"
    )]
    Connect {
        /// The socket.
        path: String,
        /// What the system said.
        error: std::io::Error,
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
        .map_err(|error| FetchError::Connect { path: socket.display().to_string(), error })?;
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

/// `text` with anything but printable ASCII escaped (`\u{1b}`): names come from
/// processes, and must not move the cursor or forge lines on the admin's terminal.
fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_ascii_graphic() || c == ' ' {
            out.push(c);
        } else {
            out.extend(c.escape_default());
        }
    }
    std::borrow::Cow::Owned(out)
}

impl Status {
    /// Lists at most `per_gpu` processes per GPU and `total` in all; those left out are
    /// counted in each GPU's `truncated`.
    pub fn limit_processes(&mut self, per_gpu: usize, total: usize) {
        let mut left = total;
        for g in &mut self.gpus {
            let keep = g.processes.len().min(per_gpu).min(left);
            g.truncated += g.processes.len() - keep;
            g.processes.truncate(keep);
            left -= keep;
        }
    }

    /// Keeps only the processes of `uid` (what a user who is not an admin may see); the
    /// GPUs' totals stay.
    pub fn only_uid(&mut self, uid: u32) {
        for g in &mut self.gpus {
            g.processes.retain(|p| p.uid == uid);
        }
    }

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
                printable(&g.uuid),
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
            let repaid = g.repaid_given_back.saturating_add(g.repaid_swapped).saturating_add(g.repaid_ended);
            if repaid > 0 {
                let _ = writeln!(
                    out,
                    "  taken back for guarantees so far: {} given back, {} swapped to host, {} by ending holders",
                    gib(g.repaid_given_back),
                    gib(g.repaid_swapped),
                    gib(g.repaid_ended)
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
                    printable(&p.group),
                    if p.pod.is_empty() { "-".into() } else { printable(&p.pod) },
                    gib(p.request),
                    gib(p.limit),
                    gib(p.held),
                    p.priority,
                    printable(&p.resolver),
                    printable(&p.state),
                    gib(p.host_bytes),
                    seconds(p.waited_ms),
                    seconds(p.swapped_ms)
                );
                // What it declared beyond its entitlement: the mismatch, shown.
                if !p.capped.is_empty() {
                    let _ = writeln!(
                        out,
                        "  {:>8}  declared beyond its entitlement ({}): {}",
                        "",
                        printable(&p.entitlement),
                        printable(&p.capped)
                    );
                }
            }
            if g.truncated > 0 {
                let _ = writeln!(out, "  ... and {} more processes, not listed", g.truncated);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_arbiter_is_told_once() {
        let missing = std::path::Path::new("/nonexistent/gpufrac/arbiter.sock");
        let err = fetch(missing).expect_err("nobody serves there");
        let shown = format!("{:#}", anyhow::Error::from(err));
        assert!(
            shown.starts_with("cannot reach the arbiter at /nonexistent/gpufrac/arbiter.sock: "),
            "{shown}"
        );
        assert!(shown.ends_with("(is gpufrac-arbiter running? --socket names another)"), "{shown}");
        assert_eq!(shown.matches("No such file").count(), 1, "{shown}");
    }

    #[test]
    fn the_table_escapes_what_a_terminal_would_interpret() {
        let status = Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                processes: vec![ProcessStatus {
                    group: "evil\x1b[2J\nforged line".into(),
                    pod: "ns/\u{7f}pod".into(),
                    ..ProcessStatus::default()
                }],
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let table = status.table();
        assert!(!table.contains('\x1b') && !table.contains('\u{7f}'), "{table}");
        assert!(table.contains("evil\\u{1b}[2J\\nforged line"), "{table}");
        assert_eq!(table.lines().count(), 4, "no forged line: {table}");
        let mut capped = status.clone();
        capped.gpus[0].processes[0].entitlement = "policy /etc/p.json: uid 7".into();
        capped.gpus[0].processes[0].capped = "priority 99 -> 0\x1b]0;t\x07".into();
        let table = capped.table();
        assert!(
            table.contains("declared beyond its entitlement (policy /etc/p.json: uid 7): priority 99 -> 0"),
            "{table}"
        );
        assert!(!table.contains('\x1b') && !table.contains('\x07'), "{table}");
    }

    #[test]
    fn long_lists_are_cut_and_counted() {
        let gpu = |n| GpuStatus { processes: vec![ProcessStatus::default(); n], ..GpuStatus::default() };
        let mut status = Status { gpus: vec![gpu(10), gpu(3), gpu(5)], swap_limit: 0 };
        status.limit_processes(4, 6);
        let listed: Vec<(usize, usize)> =
            status.gpus.iter().map(|g| (g.processes.len(), g.truncated)).collect();
        assert_eq!(listed, vec![(4, 6), (2, 1), (0, 5)]);
        assert!(status.table().contains("and 6 more processes"));
        let json = serde_json::to_string(&status).unwrap();
        let back: Status = serde_json::from_str(&json).unwrap();
        assert_eq!(back, status);
        // Documents from before the field read as nothing cut.
        let old: GpuStatus = serde_json::from_str(
            r#"{"uuid":"GPU-1","total":1,"guaranteed":0,"burst":0,"free":1,"waiting":0,"processes":[]}"#,
        )
        .unwrap();
        assert_eq!(old.truncated, 0);
    }
}
