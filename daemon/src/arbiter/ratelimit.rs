//! Bounds the log lines one user can make the arbiter write: at most a few lines per
//! second per key (the peer's UID), then one line saying how many were left out. Pure
//! state, the clock passed in, so it is unit-tested directly.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What to do with one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it; `suppressed` lines of this key were left out before it (say so).
    Log {
        /// Lines left out since the last one written for this key.
        suppressed: u64,
    },
    /// Leave it out (it is counted).
    Suppress,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

/// At most `per_window` lines per `window` for each key.
#[derive(Debug)]
pub struct RateLimiter {
    per_window: u32,
    window: Duration,
    keys: HashMap<u32, Window>,
}

impl RateLimiter {
    /// A limiter allowing `per_window` lines per `window` and key.
    pub fn new(per_window: u32, window: Duration) -> RateLimiter {
        RateLimiter { per_window, window, keys: HashMap::new() }
    }

    /// Whether a line for `key` may be written at `now`.
    pub fn check(&mut self, key: u32, now: Instant) -> Verdict {
        let window = self.window;
        let w = self.keys.entry(key).or_insert(Window { start: now, logged: 0, suppressed: 0 });
        let mut suppressed = 0;
        if now.saturating_duration_since(w.start) >= window {
            suppressed = w.suppressed;
            *w = Window { start: now, logged: 0, suppressed: 0 };
        }
        if w.logged < self.per_window {
            w.logged += 1;
            Verdict::Log { suppressed }
        } else {
            // Carried over: the next line written reports it, or `flush` does.
            w.suppressed += 1 + suppressed;
            Verdict::Suppress
        }
    }

    /// Forgets keys whose window ended at `now`; returns those that had lines left out,
    /// with how many, so that each gets one line saying so.
    pub fn flush(&mut self, now: Instant) -> Vec<(u32, u64)> {
        let mut out = Vec::new();
        let window = self.window;
        self.keys.retain(|&key, w| {
            let ended = now.saturating_duration_since(w.start) >= window;
            if ended && w.suppressed > 0 {
                out.push((key, w.suppressed));
            }
            !ended
        });
        out.sort_unstable();
        out
    }

    /// How many keys are tracked (bounded by the keys seen during one window).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn allows_a_few_lines_per_window_then_counts_the_rest() {
        let mut r = RateLimiter::new(5, SECOND);
        let t = Instant::now();
        for _ in 0..5 {
            assert_eq!(r.check(1000, t), Verdict::Log { suppressed: 0 });
        }
        for _ in 0..1000 {
            assert_eq!(r.check(1000, t + Duration::from_millis(500)), Verdict::Suppress);
        }
        // Another user has its own budget.
        assert_eq!(r.check(0, t), Verdict::Log { suppressed: 0 });
        // The next window: the first line says how many were left out.
        assert_eq!(r.check(1000, t + SECOND), Verdict::Log { suppressed: 1000 });
        assert_eq!(r.check(1000, t + SECOND), Verdict::Log { suppressed: 0 });
    }

    #[test]
    fn flush_reports_what_was_left_out_and_forgets_old_keys() {
        let mut r = RateLimiter::new(1, SECOND);
        let t = Instant::now();
        assert_eq!(r.check(7, t), Verdict::Log { suppressed: 0 });
        assert_eq!(r.check(7, t), Verdict::Suppress);
        assert_eq!(r.check(7, t), Verdict::Suppress);
        assert_eq!(r.check(8, t), Verdict::Log { suppressed: 0 });
        assert!(r.flush(t + Duration::from_millis(999)).is_empty());
        assert_eq!(r.len(), 2);
        assert_eq!(r.flush(t + SECOND), vec![(7, 2)]);
        assert!(r.is_empty(), "keys are forgotten once their window ends");
        // Nothing is reported twice.
        assert_eq!(r.check(7, t + SECOND), Verdict::Log { suppressed: 0 });
    }

    #[test]
    fn a_count_suppressed_across_windows_is_kept() {
        let mut r = RateLimiter::new(1, SECOND);
        let t = Instant::now();
        r.check(1, t);
        assert_eq!(r.check(1, t), Verdict::Suppress);
        // A new window whose budget is spent at once still carries the old count.
        assert_eq!(r.check(1, t + SECOND), Verdict::Log { suppressed: 1 });
        assert_eq!(r.check(1, t + SECOND), Verdict::Suppress);
        assert_eq!(r.flush(t + 2 * SECOND), vec![(1, 1)]);
    }
}
