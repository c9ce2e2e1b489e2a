//! The server's log lines about peers, rate-limited per UID so that a client that
//! misbehaves on purpose cannot flood the log: refusals and closings in one budget,
//! connections, registrations and swaps in another; what was left out is counted and said
//! once a window ends.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Who;
use crate::arbiter::ratelimit::{RateLimiter, Verdict};

/// Lines about refusals and closings per UID and second.
const REFUSAL_LINES_PER_SECOND: u32 = 5;
/// Lines about connections coming and going, registrations and swaps, per UID and
/// second (generous: a node starting many processes at once logs each).
const CONNECTION_LINES_PER_SECOND: u32 = 50;

/// The log budgets, per UID.
pub(super) struct Logs {
    /// Lines about refusals and closings.
    refusals: Mutex<RateLimiter>,
    /// Lines about connections, registrations and swaps.
    connections: Mutex<RateLimiter>,
}

impl Logs {
    pub(super) fn new() -> Logs {
        Logs {
            refusals: Mutex::new(RateLimiter::new(REFUSAL_LINES_PER_SECOND, Duration::from_secs(1))),
            connections: Mutex::new(RateLimiter::new(CONNECTION_LINES_PER_SECOND, Duration::from_secs(1))),
        }
    }
}

impl Logs {
    /// Whether a line about a refusal or a closing for `uid` is written now: `Some` with
    /// how many were left out before it.
    pub(super) fn refusal_line(&self, uid: u32) -> Option<u64> {
        let verdict = self.refusals.lock().unwrap_or_else(|p| p.into_inner()).check(uid, Instant::now());
        match verdict {
            Verdict::Log { suppressed } => Some(suppressed),
            Verdict::Suppress => None,
        }
    }

    /// Whether a line about a connection coming or going, a registration or a swap for
    /// `uid` is written now.
    pub(super) fn connection_line(&self, uid: u32) -> Option<u64> {
        let verdict = self.connections.lock().unwrap_or_else(|p| p.into_inner()).check(uid, Instant::now());
        match verdict {
            Verdict::Log { suppressed } => Some(suppressed),
            Verdict::Suppress => None,
        }
    }

    /// Logs a refusal or closing, rate-limited per UID.
    pub(super) fn log_closing(&self, who: Who, reason: &str) {
        if let Some(suppressed) = self.refusal_line(who.uid) {
            if suppressed > 0 {
                tracing::warn!(
                    pid = who.pid,
                    uid = who.uid,
                    conn = who.conn,
                    suppressed,
                    "closing connection: {reason} (and {suppressed} more lines for this uid left out)"
                );
            } else {
                tracing::warn!(pid = who.pid, uid = who.uid, conn = who.conn, "closing connection: {reason}");
            }
        }
    }

    /// Says how many lines were left out for each UID whose window ended.
    pub(super) fn flush(&self) {
        let now = Instant::now();
        let refusals = self.refusals.lock().unwrap_or_else(|p| p.into_inner()).flush(now);
        for (uid, suppressed) in refusals {
            tracing::warn!(uid, suppressed, "{suppressed} lines about refused or closed connections of this uid left out (at most {REFUSAL_LINES_PER_SECOND} a second)");
        }
        let connections = self.connections.lock().unwrap_or_else(|p| p.into_inner()).flush(now);
        for (uid, suppressed) in connections {
            tracing::info!(uid, suppressed, "{suppressed} lines about connections of this uid left out (at most {CONNECTION_LINES_PER_SECOND} a second)");
        }
    }
}
