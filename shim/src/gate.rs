//! The gate every launch, copy and set passes. Today it only counts activity (for idle
//! detection); it is the one place where a process will be held while its burst memory
//! is swapped out. Passing it costs one relaxed increment and one load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking::Gate;

static ACTIVITY: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicBool = AtomicBool::new(false);

/// Passes the gate, waiting while it is closed.
#[inline(always)]
pub(crate) fn pass() {
    ACTIVITY.fetch_add(1, Ordering::Relaxed);
    if CLOSED.load(Ordering::Acquire) {
        Gate::wait_open(&CLOSED);
    }
}

/// Launches, copies and sets so far: idle processes are those whose count stands still.
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
