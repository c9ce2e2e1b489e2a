//! The status document the arbiter serves to `gpufrac status` and `gpufrac top` (JSON),
//! its table form, and the arbiter's ring of recent events it carries.

pub use crate::arbiter::document::{
    now_ms, Document, Event, EventKind, EventLog, GpuStatus, ProcessStatus, QueuedBurst, Status,
};

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
    fetch_document(socket).map(|document| document.status)
}

/// Asks the arbiter at `socket` for its whole document: the status, the queue and the
/// last events.
pub fn fetch_document(socket: &std::path::Path) -> Result<Document, FetchError> {
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

/// A share of a GPU's time, given in per mille, as a percentage.
pub(crate) fn share(per_mille: u32) -> String {
    gpufrac_common::ComputeShare::from_per_mille(per_mille.min(1000) as u16).unwrap_or_default().to_string()
}

pub(crate) fn seconds(ms: u64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

pub(crate) fn gib(bytes: u64) -> String {
    format!("{:.2}GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// `text` with anything but printable ASCII escaped (`\u{1b}`): names come from
/// processes, and must not move the cursor or forge lines on the admin's terminal.
pub(crate) fn printable(text: &str) -> std::borrow::Cow<'_, str> {
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
    /// The human-readable table of `gpufrac status`: the host RAM swapped-out memory
    /// takes, then each GPU (its line, its notes, its processes).
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        if self.gpus.is_empty() {
            out.push_str("no GPUs\n");
        }
        let swapped: u64 = self.gpus.iter().map(|g| g.swapped.saturating_add(g.parked)).sum();
        let cap = if self.swap_limit == u64::MAX { "no limit".to_owned() } else { gib(self.swap_limit) };
        let _ = writeln!(out, "host RAM for swapped-out memory: {} of {cap}", gib(swapped));
        for g in &self.gpus {
            gpu_lines(&mut out, g);
            process_lines(&mut out, g);
        }
        out
    }
}

/// A GPU's line and its notes (headroom, memory outside gpufrac or uncounted, compute
/// shares, parking, reclaim).
fn gpu_lines(out: &mut String, g: &GpuStatus) {
    use std::fmt::Write;
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
    if g.headroom > 0 {
        let _ = writeln!(
            out,
            "  {} more on the GPU left to processes outside gpufrac (--gpu-memory)",
            gib(g.headroom)
        );
    }
    if g.outside > 0 {
        let _ = writeln!(out, "  {} used by processes outside gpufrac (not lent)", gib(g.outside));
    }
    if g.uncounted > 0 {
        let _ = writeln!(
            out,
            "  {} held by groups beyond what their shims counted (charged to them, not lent)",
            gib(g.uncounted)
        );
    }
    if g.compute_requested_pm > 0 {
        let _ = writeln!(
            out,
            "  compute requested {} of the GPU's time, {}",
            share(g.compute_requested_pm),
            if g.compute_open { "open to one group now (no leases)" } else { "leased by turns" }
        );
    }
    if g.parkable_requests > 0 {
        let _ = writeln!(
            out,
            "  parkable requests {} ({} parked to host, {} wakes waiting for room)",
            gib(g.parkable_requests),
            gib(g.parked),
            g.waking
        );
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
}

/// The table of a GPU's processes, each with its notes, and how many are not listed.
fn process_lines(out: &mut String, g: &GpuStatus) {
    use std::fmt::Write;
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
        process_line(out, p);
    }
    if g.truncated > 0 {
        let _ = writeln!(out, "  ... and {} more processes, not listed", g.truncated);
    }
}

/// A process's line and its notes (compute share, parking, memory uncounted, what it
/// declared beyond its entitlement).
fn process_line(out: &mut String, p: &ProcessStatus) {
    use std::fmt::Write;
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
        gib(p.host_bytes.saturating_add(p.parked_bytes)),
        seconds(p.waited_ms),
        seconds(p.swapped_ms)
    );
    if p.compute_limit_pm > 0 {
        let _ = writeln!(
            out,
            "  {:>8}  compute: request {}, limit {}, held {} of the last second, planned {}, {}",
            "",
            share(p.compute_request_pm),
            share(p.compute_limit_pm),
            share(p.compute_held_pm),
            share(p.compute_allowance_pm),
            printable(&p.compute_state)
        );
    }
    if p.park_after_ms > 0 && (p.parks > 0 || p.wakes > 0) {
        let _ = writeln!(
            out,
            "  {:>8}  parkable after {}: parked {} times (last took {}), woken {} times (last took {})",
            "",
            seconds(p.park_after_ms),
            p.parks,
            seconds(p.last_park_ms),
            p.wakes,
            seconds(p.last_wake_ms)
        );
    }
    if p.uncounted > 0 {
        let _ = writeln!(
            out,
            "  {:>8}  uncounted: its group holds {} more than its shims counted (the device's count), charged to it",
            "",
            gib(p.uncounted)
        );
    }
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

/// How long ago `at_ms` was, at `now_ms`: `4s ago`, `12m03s ago`, `2h05m ago`.
pub(crate) fn ago(at_ms: u64, now_ms: u64) -> String {
    let s = now_ms.saturating_sub(at_ms) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m{:02}s ago", s / 60, s % 60),
        _ => format!("{}h{:02}m ago", s / 3600, s % 3600 / 60),
    }
}

impl Document {
    /// The table of `gpufrac status`: the status's, then the bursts waiting and the last
    /// events, if any.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = self.status.table();
        if !self.queue.is_empty() {
            out.push_str("bursts waiting (longest first):\n");
            for q in &self.queue {
                let _ = writeln!(
                    out,
                    "  GPU {}  pid {}  group {}  {}{}  waiting {}",
                    printable(&q.gpu),
                    q.pid,
                    printable(&q.group),
                    gib(q.bytes),
                    if q.resume { " (swap-in)" } else { "" },
                    seconds(q.waited_ms)
                );
            }
        }
        if !self.events.is_empty() {
            let now = now_ms();
            out.push_str("recent events (newest last):\n");
            for e in &self.events {
                let _ = writeln!(
                    out,
                    "  {:>11}  {:<11} GPU {}  pid {}  group {}  {}  {}",
                    ago(e.at_ms, now),
                    e.kind.label(),
                    if e.gpu.is_empty() { "-".into() } else { printable(&e.gpu) },
                    e.pid,
                    if e.group.is_empty() { "-".into() } else { printable(&e.group) },
                    gib(e.bytes),
                    printable(&e.detail)
                );
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

    #[test]
    fn the_event_log_keeps_the_last_events() {
        let mut log = EventLog::new(3);
        for pid in 1..=5 {
            log.push(Event { pid, ..Event::default() });
        }
        let pids: Vec<u32> = log.recent().iter().map(|e| e.pid).collect();
        assert_eq!(pids, vec![3, 4, 5], "oldest first, the first two dropped");
    }

    #[test]
    fn the_document_is_the_status_with_a_queue_and_events_and_reads_either_way() {
        let document = Document {
            status: Status {
                gpus: vec![GpuStatus { uuid: "GPU-1".into(), total: 8, ..GpuStatus::default() }],
                swap_limit: 3,
            },
            queue: vec![QueuedBurst { gpu: "GPU-1".into(), pid: 7, bytes: 2, ..QueuedBurst::default() }],
            events: vec![Event {
                pid: 7,
                kind: EventKind::SwappedOut,
                detail: "x".into(),
                ..Event::default()
            }],
        };
        let json = serde_json::to_value(&document).unwrap();
        assert_eq!(json["swap_limit"], 3, "flat: {json}");
        assert_eq!(json["events"][0]["kind"], "swapped_out", "{json}");
        let back: Document = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, document);
        // An older client reads the status out of it; a client reads an older document.
        let status: Status = serde_json::from_value(json).unwrap();
        assert_eq!(status, document.status);
        let old: Document = serde_json::from_str(&serde_json::to_string(&document.status).unwrap()).unwrap();
        assert_eq!((old.queue.len(), old.events.len()), (0, 0));
        // A kind from a newer arbiter is read as `other`.
        let newer: Event = serde_json::from_str(
            r#"{"at_ms":1,"gpu":"","pid":1,"group":"g","kind":"migrated","bytes":0,"detail":""}"#,
        )
        .unwrap();
        assert_eq!(newer.kind, EventKind::Other);
    }

    #[test]
    fn a_user_sees_only_its_own_waiters_and_events() {
        let mut document = Document {
            status: Status::default(),
            queue: vec![
                QueuedBurst { pid: 1, uid: 1000, ..QueuedBurst::default() },
                QueuedBurst { pid: 2, uid: 1001, ..QueuedBurst::default() },
            ],
            events: vec![
                Event { pid: 1, uid: 1000, ..Event::default() },
                Event { pid: 2, uid: 1001, ..Event::default() },
                Event { pid: 3, uid: u32::MAX, ..Event::default() },
            ],
        };
        document.only_uid(1000);
        assert_eq!(document.queue.iter().map(|q| q.pid).collect::<Vec<_>>(), vec![1]);
        assert_eq!(document.events.iter().map(|e| e.pid).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn the_table_lists_waiters_and_events_escaped() {
        let document = Document {
            status: Status::default(),
            queue: vec![QueuedBurst {
                gpu: "GPU-1".into(),
                pid: 42,
                group: "g".into(),
                bytes: 1 << 30,
                waited_ms: 1500,
                ..QueuedBurst::default()
            }],
            events: vec![Event {
                at_ms: now_ms(),
                gpu: "GPU-1".into(),
                pid: 42,
                group: "g".into(),
                kind: EventKind::Waited,
                bytes: 1 << 30,
                detail: "waited 1500 ms\x1b[2J".into(),
                ..Event::default()
            }],
        };
        let table = document.table();
        assert!(table.contains("GPU GPU-1  pid 42  group g  1.00GiB  waiting 1.5s"), "{table}");
        assert!(table.contains("waited      GPU GPU-1  pid 42  group g  1.00GiB  waited 1500 ms"), "{table}");
        assert!(!table.contains('\x1b'), "{table}");
        assert_eq!(ago(1_000, 5_000), "4s ago");
        assert_eq!(ago(0, 723_000), "12m03s ago");
        assert_eq!(ago(0, 7_500_000), "2h05m ago");
    }
}
