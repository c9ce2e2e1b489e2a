//! The gate every launch, copy and set passes. It counts what passes (the activity count
//! that tells the arbiter whether a process is idle) and, in a process that may be
//! swapped out (resolver `swap`) or parked (`GPUFRAC_PARK_AFTER`), which calls are
//! inside, so that a swap-out or a park can close it: new calls wait, calls already inside
//! finish, then the swap proceeds. Passing costs a relaxed load and store in other
//! processes, and two atomic additions and a load in swappable ones; closing and waiting
//! are the cold path. A process whose group has a compute share waits here for its
//! group's lease on the GPU (compute/), unless the GPU is open to it. A parked process's wake that fails (`GPUFRAC_WAIT_TIMEOUT`) sends
//! the calls waiting here back with out-of-memory rather than keep them for ever.

use std::sync::atomic::{
    AtomicBool, AtomicU64, AtomicU8,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::OnceLock;
use std::time::Duration;

use crate::driver::ffi::{Status, OUT_OF_MEMORY};

/// The compute lease as the gate sees it, registered at start-up (`registry::init`) by
/// the layer above: the gate calls up through it, never by name.
pub(crate) struct Lease {
    /// Waits for the group's lease for a call that starts work on `stream`: the stream's
    /// slot among those the lease drains, and whether the call is counted inside it.
    pub wait: fn(*mut std::ffi::c_void) -> (Option<usize>, bool),
    /// A call on the stream in `slot` returned (its work is marked for the drain).
    pub after_call: fn(usize),
    /// A call counted inside the lease left it.
    pub left: fn(),
}

/// What a closed gate's waiters ask of the layers above, registered at start-up.
pub(crate) struct Holder {
    /// Whether the process is parked: its wake, not a swap-in, opens the gate.
    pub parked: fn() -> bool,
    /// A call waits at the closed gate: the process wants its memory back.
    pub wanted: fn(),
}

static LEASE: OnceLock<Lease> = OnceLock::new();
static HOLDER: OnceLock<Holder> = OnceLock::new();

/// Registers the compute lease (once; before calls are sent through it).
pub(crate) fn register_lease(lease: Lease) {
    let _ = LEASE.set(lease);
}

/// Registers who parks and swaps the process (once; before the gate is first closed).
pub(crate) fn register_holder(holder: Holder) {
    let _ = HOLDER.set(holder);
}

fn parked() -> bool {
    HOLDER.get().is_some_and(|h| (h.parked)())
}

fn wanted() {
    if let Some(h) = HOLDER.get() {
        (h.wanted)();
    }
}

/// Calls that entered (including ones that found the gate closed and stepped back).
static ENTERED: AtomicU64 = AtomicU64::new(0);
/// Calls that left.
static LEFT: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicBool = AtomicBool::new(false);
/// Why calls take the slow path, if they do: [`TRACKED`] (set once, before the first
/// swappable allocation) and [`LEASED`] (while its calls need a lease). One load of this
/// decides the fast path.
static SLOW: AtomicU8 = AtomicU8::new(0);
/// Calls inside are tracked: the process may be swapped out or parked.
const TRACKED: u8 = 1;
/// Calls wait for the group's lease on the GPU (compute/).
const LEASED: u8 = 2;
/// Wakes that failed so far: a waiting call that sees this move gives up.
static FAILED_WAKES: AtomicU64 = AtomicU64::new(0);

/// Tracks the calls inside from now on: the process may be swapped out.
pub(crate) fn track() {
    SLOW.fetch_or(TRACKED, SeqCst);
}

/// Sends calls through the lease's wait (compute/), or no longer (the GPU is open to
/// the process, or nobody hands out leases).
pub(crate) fn set_leased(leased: bool) {
    if leased {
        SLOW.fetch_or(LEASED, SeqCst);
    } else {
        SLOW.fetch_and(!LEASED, SeqCst);
    }
}

/// A call inside the gate; leaving is counted when it drops. Bit 0: the call is counted
/// inside ([`TRACKED`]); bit 7: it passed on its group's compute lease and is counted
/// inside that lease ([`IN_LEASE`]); the bits between: 1 + the leased stream slot it ran
/// on (compute/), whose in-flight mark it may record once the call has queued its work.
pub(crate) struct Pass(u8);

/// [`Pass`]'s bit of a call counted inside its group's compute lease.
const IN_LEASE: u8 = 0x80;

impl Drop for Pass {
    #[inline(always)]
    fn drop(&mut self) {
        // A tracked call's leaving stays inline, as before marks existed.
        if self.0 == 1 {
            LEFT.fetch_add(1, SeqCst);
        } else if self.0 != 0 {
            leave(self.0);
        }
    }
}

#[cold]
#[inline(never)]
fn leave(pass: u8) {
    if pass & 1 != 0 {
        LEFT.fetch_add(1, SeqCst);
    }
    let Some(lease) = LEASE.get() else { return };
    if let Some(slot) = ((pass & !IN_LEASE) >> 1).checked_sub(1) {
        (lease.after_call)(usize::from(slot));
    }
    if pass & IN_LEASE != 0 {
        (lease.left)();
    }
}

/// Enters the gate, waiting while it is closed; out-of-memory if the process is parked
/// and its wake failed.
#[inline(always)]
#[allow(dead_code)]
pub(crate) fn enter() -> Result<Pass, Status> {
    enter_on(std::ptr::null_mut)
}

/// The real function in `real` if the call may go straight to it: nobody tracks or leases
/// this process's calls and the function is resolved. The call is counted; null otherwise
/// (the caller goes through [`enter_on`]).
#[inline(always)]
pub(crate) fn pass_quickly(real: &std::sync::atomic::AtomicPtr<std::ffi::c_void>) -> *mut std::ffi::c_void {
    if SLOW.load(Relaxed) != 0 {
        return std::ptr::null_mut();
    }
    let p = real.load(std::sync::atomic::Ordering::Acquire);
    if !p.is_null() {
        ENTERED.store(ENTERED.load(Relaxed).wrapping_add(1), Relaxed);
    }
    p
}

/// [`enter`] for a call that starts work on the stream `stream()` names (evaluated only
/// on the slow path): a leased process's call waits for its lease, except on a stream
/// being captured.
#[inline(always)]
pub(crate) fn enter_on(stream: impl FnOnce() -> *mut std::ffi::c_void) -> Result<Pass, Status> {
    let slow = SLOW.load(Relaxed);
    if slow == 0 {
        // Nobody ever closes this gate: only the activity count moves. Concurrent
        // bumps may be lost, which idle detection tolerates (it asks whether it moved).
        ENTERED.store(ENTERED.load(Relaxed).wrapping_add(1), Relaxed);
        return Ok(Pass(0));
    }
    enter_slowly(slow, stream())
}

/// [`enter`] for a leased or tracked process.
#[cold]
#[inline(never)]
fn enter_slowly(slow: u8, stream: *mut std::ffi::c_void) -> Result<Pass, Status> {
    loop {
        let lease = LEASE.get().filter(|_| slow & LEASED != 0);
        let (slot, in_lease) = lease.map_or((None, false), |lease| (lease.wait)(stream));
        // Slots are few (compute/streams.rs, `SLOT_COUNT`): 1 + slot fits in the six bits above bit 0.
        let marked = slot.map_or(0, |s| (s as u8 + 1) << 1) | if in_lease { IN_LEASE } else { 0 };
        if slow & TRACKED == 0 {
            ENTERED.store(ENTERED.load(Relaxed).wrapping_add(1), Relaxed);
            return Ok(Pass(marked));
        }
        // Counting in before looking at CLOSED (both sequentially consistent) means a
        // closer that set CLOSED either sees this call in its count or is seen by it.
        ENTERED.fetch_add(1, SeqCst);
        if !CLOSED.load(SeqCst) {
            return Ok(Pass(marked | 1));
        }
        LEFT.fetch_add(1, SeqCst);
        // Not inside the lease while it waits (its drain would wait for this call): the
        // lease is looked at again once the gate opens.
        if let Some(lease) = lease.filter(|_| in_lease) {
            (lease.left)();
        }
        if !parking::wait_until(|| !CLOSED.load(SeqCst)) {
            return Err(OUT_OF_MEMORY);
        }
    }
}

/// Closes the gate and returns once no call is inside.
pub(crate) fn close() {
    CLOSED.store(true, SeqCst);
    // LEFT first: a call entering meanwhile can only make the difference look larger.
    while LEFT.load(SeqCst) != ENTERED.load(SeqCst) {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Opens the gate and wakes every waiting call, unless the process is parked (its wake
/// opens it).
pub(crate) fn open() {
    if !parked() {
        parking::open(&CLOSED);
    }
}

/// Waits until the parked process is woken (asking for the wake); `Err` (out-of-memory)
/// if the wake failed meanwhile.
pub(crate) fn wait_awake() -> Result<(), Status> {
    if parking::wait_until(|| !parked()) {
        Ok(())
    } else {
        Err(OUT_OF_MEMORY)
    }
}

/// For a process with burst memory in host RAM: waits until the gate opens, which it does
/// once nothing is swapped out (asking for it back); `Err` (out-of-memory) if a wake failed
/// meanwhile. (The gate, not the swap book: the swap-in opens the gate holding the book.)
pub(crate) fn wait_swapped_in() -> Result<(), Status> {
    if parking::wait_until(|| !CLOSED.load(SeqCst)) {
        Ok(())
    } else {
        Err(OUT_OF_MEMORY)
    }
}

/// The wake failed: calls waiting for it give up.
pub(crate) fn fail_waiters() {
    parking::notify(|| {
        FAILED_WAKES.fetch_add(1, SeqCst);
    });
}

/// Whether the process's calls wait for compute leases (its GPU is neither open to it
/// nor free of compute settings).
pub(crate) fn leased() -> bool {
    SLOW.load(Relaxed) & LEASED != 0
}

/// Counts an allocation, free or context call as activity (a process loading its model
/// is not idle), without entering the gate.
pub(crate) fn touch() {
    // Entered first: a closer comparing the two sees this as a call inside (briefly), never
    // the count of a real call inside cancelled out.
    ENTERED.fetch_add(1, SeqCst);
    LEFT.fetch_add(1, SeqCst);
}

/// A count of launches, copies and sets: a process whose count stands still is idle.
pub fn activity() -> u64 {
    ENTERED.load(Relaxed)
}

mod parking {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Condvar, Mutex};

    static LOCK: Mutex<()> = Mutex::new(());
    /// How often a waiting call asks again for what it waits for.
    const ASK_AGAIN: std::time::Duration = std::time::Duration::from_secs(1);
    static OPENED: Condvar = Condvar::new();

    /// The cold path: the calling thread waits here until `done` (the gate open, the
    /// process woken), and tells the swap worker that the process wants its memory back.
    /// False if a wake failed meanwhile.
    pub(super) fn wait_until(done: impl Fn() -> bool) -> bool {
        let failed = super::FAILED_WAKES.load(SeqCst);
        super::wanted();
        let mut guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        while !done() {
            if super::FAILED_WAKES.load(SeqCst) != failed {
                return false;
            }
            let (next, timeout) = OPENED.wait_timeout(guard, ASK_AGAIN).unwrap_or_else(|p| p.into_inner());
            guard = next;
            if timeout.timed_out() && !done() {
                // Still waiting: ask again (a wake is answered once; asking twice is
                // harmless, a request lost on the way would otherwise leave it for ever).
                drop(guard);
                super::wanted();
                guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
            }
        }
        true
    }

    pub(super) fn open(closed: &AtomicBool) {
        notify(|| closed.store(false, SeqCst));
    }

    /// Changes what waiters look at, under the lock, and wakes them all.
    pub(super) fn notify(change: impl FnOnce()) {
        let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
        change();
        OPENED.notify_all();
    }
}

/// Opens the gate whatever the park state says (the park itself, once woken or given up).
pub(crate) fn open_unparked() {
    parking::open(&CLOSED);
}

/// Wakes the waiters so that they look again (the process was woken).
pub(crate) fn notify_waiters() {
    parking::notify(|| {});
}

/// Passes the gate, for benchmarks outside the crate.
#[doc(hidden)]
#[inline(never)]
pub fn pass_for_bench() {
    let _pass = enter();
}

/// Unit tests that change the gate's process-wide state take turns.
#[cfg(test)]
pub(crate) static TEST_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn closing_waits_for_calls_inside_and_holds_new_ones_until_opened() {
        let _turn = TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        track();
        let inside = enter().unwrap();
        let closed = Arc::new(AtomicBool::new(false));
        let closer = {
            let closed = closed.clone();
            std::thread::spawn(move || {
                close();
                closed.store(true, SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!closed.load(SeqCst), "close() returned while a call was inside");
        drop(inside);
        closer.join().unwrap();
        assert!(closed.load(SeqCst));
        let passed = Arc::new(AtomicUsize::new(0));
        let caller = {
            let passed = passed.clone();
            std::thread::spawn(move || {
                let _pass = enter().unwrap();
                passed.fetch_add(1, SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(passed.load(SeqCst), 0, "a call passed a closed gate");
        open();
        caller.join().unwrap();
        assert_eq!(passed.load(SeqCst), 1);
    }
}
