//! The gate every launch, copy and set passes. Today it only counts activity (for idle
//! detection); it is the one place where a process will be held while its burst memory
//! is swapped out. Passing it costs two relaxed loads and a store: the activity count is
//! bumped without a locked instruction, so concurrent bumps may be lost, which idle
//! detection tolerates (it only asks whether the count moved).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking::Gate;

static ACTIVITY: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicBool = AtomicBool::new(false);

/// Passes the gate, waiting while it is closed.
#[inline(always)]
pub(crate) fn pass() {
    ACTIVITY.store(ACTIVITY.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    if CLOSED.load(Ordering::Acquire) {
        Gate::wait_open(&CLOSED);
    }
}

/// A count of launches, copies and sets: a process whose count stands still is idle.
pub fn activity() -> u64 {
    ACTIVITY.load(Ordering::Relaxed)
}

mod parking {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Condvar, Mutex};

    /// The cold path: threads wait here while the gate is closed.
    pub(super) struct Gate;

    static LOCK: Mutex<()> = Mutex::new(());
    static OPENED: Condvar = Condvar::new();

    impl Gate {
        pub(super) fn wait_open(closed: &AtomicBool) {
            let mut guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
            while closed.load(Ordering::Acquire) {
                guard = OPENED.wait(guard).unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

/// Passes the gate, for benchmarks outside the crate.
#[doc(hidden)]
#[inline(never)]
pub fn pass_for_bench() {
    pass();
}
