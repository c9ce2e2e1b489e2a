//! The timeline: every process's lines, in order, with the arbiter's log turned into
//! what happened (who waited, was ended, swapped), counted in the summary.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{DemoSummary, MIB};

/// A burst granted sooner than this did not really wait (the arbiter queues a burst
/// that arrives while memory is being given back, and grants it a moment later).
const WAIT_SHOWN_MS: u64 = 10;

/// `key=value` from a log line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|t| t.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
}

fn mib(bytes: &str) -> String {
    bytes.parse::<u64>().map_or_else(|_| bytes.to_owned(), |b| format!("{} MiB", b / MIB))
}

/// A burst the arbiter queued, not yet shown.
pub(super) struct Queued {
    pub(super) since: Instant,
    pub(super) bytes: String,
    pub(super) shown: bool,
}

/// The lines of every process, in order, and who is who.
pub(super) struct Timeline {
    pub(super) started: Instant,
    pub(super) tx: mpsc::Sender<(String, String)>,
    pub(super) rx: mpsc::Receiver<(String, String)>,
    pub(super) names_by_pid: HashMap<String, String>,
    pub(super) queued: HashMap<String, Queued>,
    /// The act's arbiter's last log lines, shown if the act fails.
    pub(super) arbiter_tail: std::collections::VecDeque<String>,
}

/// Log lines of the arbiter kept for a failing act.
const ARBITER_TAIL: usize = 25;

impl Timeline {
    pub(super) fn forward(&self, name: &str, pipe: Box<dyn std::io::Read + Send>) {
        let (name, tx) = (name.to_owned(), self.tx.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send((name.clone(), line));
            }
        });
    }

    pub(super) fn print(&self, who: &str, event: &str) {
        println!("{:7.3}s  {who:<10} {event}", self.started.elapsed().as_secs_f64());
    }

    /// Shows the queued bursts that have waited past a few ms (or all, with `all`).
    pub(super) fn show_waits(&mut self, all: bool, summary: &mut DemoSummary) {
        let mut due: Vec<(String, String)> = Vec::new();
        for (who, q) in &mut self.queued {
            if !q.shown && (all || q.since.elapsed() > Duration::from_millis(WAIT_SHOWN_MS)) {
                q.shown = true;
                due.push((who.clone(), q.bytes.clone()));
            }
        }
        for (who, bytes) in due {
            summary.waits += 1;
            self.print("arbiter", &format!("{who} bursts {bytes} and waits: that memory is lent out"));
        }
    }

    /// Prints an arbiter line worth showing, counting it in `summary`.
    pub(super) fn arbiter_event(&mut self, line: &str, summary: &mut DemoSummary) {
        if self.arbiter_tail.len() == ARBITER_TAIL {
            self.arbiter_tail.pop_front();
        }
        self.arbiter_tail.push_back(line.to_owned());
        let who = field(line, "pid").and_then(|p| self.names_by_pid.get(p)).cloned().unwrap_or_default();
        let bytes = || mib(field(line, "bytes").unwrap_or("?"));
        let event = if line.contains("burst waits") {
            // Shown once it has waited more than a few ms: most are granted at once.
            self.queued.insert(who, Queued { since: Instant::now(), bytes: bytes(), shown: false });
            return;
        } else if line.contains("grant after wait") || line.contains("a burst waited") {
            let waited: u64 = field(line, "waited_ms").and_then(|w| w.parse().ok()).unwrap_or(0);
            let shown = self.queued.remove(&who).is_some_and(|q| q.shown);
            if !shown && waited <= WAIT_SHOWN_MS {
                return;
            }
            if !shown {
                summary.waits += 1;
            }
            summary.granted_after_wait += 1;
            format!("{who} granted {} after {waited} ms", bytes())
        } else if line.contains("a circle of waits broken") {
            // The shim gives back its unused loan and asks again; an out-of-memory error,
            // if it had none, shows in the server's own lines.
            self.queued.remove(&who);
            format!("{who} is refused its burst to break a circle of waits: it gives back its unused loan and asks again")
        } else if line.contains("burst denied") {
            summary.denied += 1;
            self.queued.remove(&who);
            format!(
                "{who} burst denied after {} ms ({})",
                field(line, "waited_ms").unwrap_or("?"),
                field(line, "reason").unwrap_or("?")
            )
        } else if line.contains("terminating a holder") {
            // The burst it serves waits for it: say so first.
            self.show_waits(true, summary);
            summary.terminated += 1;
            let why = line.split("why=").nth(1).and_then(|w| w.split(" bytes").next()).unwrap_or("?");
            format!("{who} is ended (SIGTERM) to serve a priority burst: {why}, holding {}", bytes())
        } else if line.contains("ending a holder of burst memory for a guarantee") {
            self.show_waits(true, summary);
            summary.terminated += 1;
            format!("{who} is ended (SIGTERM): a guarantee needs the {} it borrowed", bytes())
        } else if line.contains("asking a holder of burst memory to swap out") {
            self.show_waits(true, summary);
            format!("{who} is asked to move {} of burst memory to host RAM", bytes())
        } else if line.contains("swapped out") && field(line, "bytes").is_some_and(|b| b != "0") {
            summary.swapped_out += 1;
            format!(
                "{who} swapped {} out to host RAM in {} ms (addresses kept)",
                bytes(),
                field(line, "ms").unwrap_or("?")
            )
        } else if line.contains("swapped in") && field(line, "bytes").is_some_and(|b| b != "0") {
            summary.swapped_in += 1;
            format!("{who} swapped {} back in in {} ms", bytes(), field(line, "ms").unwrap_or("?"))
        } else if line.contains("registration refused") || line.contains("ERROR") {
            line.to_owned()
        } else {
            return;
        };
        self.print("arbiter", &event);
    }
}
