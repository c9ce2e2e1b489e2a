//! What frameworks keep, given back. PyTorch's caching allocator, CuPy's memory pools and
//! CUDA's stream-ordered pools keep freed memory for the next batch, and the driver (so
//! the ledger, so the arbiter) counts it as held. When the arbiter needs a loan back (a
//! burst waits for memory lent out, a guarantee is owed, the process is parked) or the
//! process has been idle for `GPUFRAC_GIVE_BACK_IDLE` while holding memory above its
//! request, a thread of the shim's own empties those pools: first the release functions
//! a native program registered (`gpufrac_on_give_back`), then the Python frameworks the
//! program imported (through the interpreter already in the process, see [`python`]),
//! then the driver's pools; what they freed goes back to the arbiter.
//!
//! The thread starts at the first give-back (after the first CUDA call, with an arbiter)
//! and serves one request at a time; requests made while one runs are served by the next
//! run. Nothing is released while a stream capture is under way: a free from another
//! thread would invalidate a global-mode capture. A caller that must know the outcome
//! (parking, a swap-out) waits a bounded time: the thread may wait for the interpreter's
//! lock as long as a Python thread holds it.

mod python;

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::enforcer::Enforcer;

/// Why pools are emptied (for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// The arbiter asked (bursts wait for lent memory, or a guarantee is owed).
    Asked,
    /// The process was idle for `GPUFRAC_GIVE_BACK_IDLE` holding memory above its request.
    Idle,
    /// Before the process is parked or its burst memory swapped out: only memory in use
    /// is moved.
    Moving,
}

impl Why {
    fn as_str(self) -> &'static str {
        match self {
            Why::Asked => "asked by the arbiter",
            Why::Idle => "idle",
            Why::Moving => "before moving memory to host RAM",
        }
    }
}

/// A release function registered with `gpufrac_on_give_back`, and its argument.
#[derive(Clone, Copy)]
struct Registered {
    release: unsafe extern "C" fn(*mut c_void),
    data: usize,
}

/// How long a park or a swap-out waits for the pools to be emptied before it moves what
/// is there (a Python thread may hold the interpreter's lock).
pub(crate) const BEFORE_MOVING: Duration = Duration::from_secs(2);

/// Asked by the arbiter, the give-back waits until the process has been quiet this long
/// (no launch, copy, set or allocation): a server in the middle of a batch takes what it
/// needs from its pool, and emptying the pool then would only make it allocate again.
const QUIET: Duration = Duration::from_millis(50);

/// ... but never longer than this: a server that never pauses still gives back.
const QUIET_AT_MOST: Duration = Duration::from_secs(1);

/// At most this many registered release functions.
pub(crate) const MAX_REGISTERED: usize = 16;

static REGISTERED: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// Requests and runs: a run serves every request made before it started.
struct Queue {
    /// Requests made so far.
    asked: u64,
    /// Requests served (the `asked` a finished run started from).
    served: u64,
    /// The latest request's reason.
    why: Why,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue { asked: 0, served: 0, why: Why::Asked });
static CHANGED: Condvar = Condvar::new();
/// The process whose thread serves the queue (0: none yet); a forked child starts its own.
static WORKER_PID: AtomicU32 = AtomicU32::new(0);
/// Bytes given back by the last run that freed something (for tests and the log).
static LAST_GIVEN: AtomicU64 = AtomicU64::new(0);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers `release(data)` to be called when the process gives back what it keeps;
/// false when the table is full.
pub(crate) fn register(release: unsafe extern "C" fn(*mut c_void), data: *mut c_void) -> bool {
    let mut registered = lock(&REGISTERED);
    if registered.len() >= MAX_REGISTERED {
        return false;
    }
    registered.push(Registered { release, data: data as usize });
    true
}

/// Asks the give-back thread to empty the pools (it starts at the first request); returns
/// the request's ticket.
pub(crate) fn ask(e: &'static Enforcer, why: Why) -> u64 {
    let ticket = {
        let mut queue = lock(&QUEUE);
        queue.asked += 1;
        queue.why = why;
        queue.asked
    };
    ensure_worker(e);
    CHANGED.notify_all();
    ticket
}

/// [`ask`], then waits at most `timeout` for the run that serves it; true if it ran.
pub(crate) fn ask_and_wait(e: &'static Enforcer, why: Why, timeout: Duration) -> bool {
    let ticket = ask(e, why);
    let queue = lock(&QUEUE);
    let (queue, _) =
        CHANGED.wait_timeout_while(queue, timeout, |q| q.served < ticket).unwrap_or_else(|p| p.into_inner());
    queue.served >= ticket
}

fn ensure_worker(e: &'static Enforcer) {
    let pid = std::process::id();
    if WORKER_PID.swap(pid, Ordering::AcqRel) == pid {
        return;
    }
    let started = std::thread::Builder::new().name("gpufrac-give-back".into()).spawn(move || worker(e));
    if let Err(err) = started {
        WORKER_PID.store(0, Ordering::Release);
        tracing::warn!("gpufrac: cannot start the give-back thread: {err}");
    }
}

fn worker(e: &'static Enforcer) {
    loop {
        let (target, why) = {
            let queue = lock(&QUEUE);
            let queue = CHANGED.wait_while(queue, |q| q.served >= q.asked).unwrap_or_else(|p| p.into_inner());
            (queue.asked, queue.why)
        };
        if why == Why::Asked {
            wait_for_quiet();
        }
        release(e, why);
        lock(&QUEUE).served = target;
        CHANGED.notify_all();
    }
}

/// Returns once the process made no launch, copy, set or allocation for [`QUIET`], or
/// after [`QUIET_AT_MOST`].
fn wait_for_quiet() {
    let started = Instant::now();
    let (mut count, mut since) = (crate::control::gate::activity(), started);
    while started.elapsed() < QUIET_AT_MOST {
        std::thread::sleep(QUIET / 5);
        let now = crate::control::gate::activity();
        if now != count {
            (count, since) = (now, Instant::now());
        } else if since.elapsed() >= QUIET {
            return;
        }
    }
}

/// Empties every pool this process keeps and gives what was freed back to the arbiter;
/// returns the bytes the process held less afterwards.
fn release(e: &'static Enforcer, why: Why) -> u64 {
    if capture_under_way() {
        // The arbiter asks again while it needs the memory; idle means no capture.
        tracing::debug!(why = why.as_str(), "gpufrac: give-back deferred: a stream capture is under way");
        return 0;
    }
    // Parked (a park went on without waiting longer for this run): the memory is in host
    // RAM or checkpointed, and a free would wait at the closed gate.
    if crate::control::park::parked() {
        return 0;
    }
    let started = Instant::now();
    let devices: Vec<usize> = (0..e.device_count()).filter_map(|o| e.slice(o)).map(|s| s.ledger).collect();
    let held_before: u64 = devices.iter().map(|&d| e.ledger.held_by_me(d)).sum();
    let registered = lock(&REGISTERED).clone();
    for r in &registered {
        // SAFETY: the program registered this function for exactly this call, with `data`
        // as its argument (gpufrac.h); it runs on a thread of ours, as documented there.
        unsafe { (r.release)(r.data as *mut c_void) };
    }
    let ordinals: Vec<usize> = (0..e.device_count())
        .filter(|&o| e.slice(o).is_some_and(|s| e.ledger.held_by_me(s.ledger) > 0))
        .collect();
    // Checked again once the interpreter's lock is held: the wait for it may have outlasted
    // a park's patience, and a free at the closed gate would hold that lock until the wake.
    let frameworks = python::release_frameworks(&ordinals, || !crate::control::park::parked());
    for &device in &devices {
        // What stream-ordered pools keep (CuPy's async pool, PyTorch's cudaMallocAsync
        // backend) is trimmed by the shim itself.
        e.pools.reconcile(e, Some(device), true);
        if let Some(slice) = e.slice_by_ledger(device) {
            e.give_back_unused(&slice);
        }
    }
    let held_after: u64 = devices.iter().map(|&d| e.ledger.held_by_me(d)).sum();
    let given = held_before.saturating_sub(held_after);
    let ms = started.elapsed().as_millis() as u64;
    let names = frameworks.join(",");
    if given > 0 {
        LAST_GIVEN.store(given, Ordering::Release);
        tracing::info!(
            bytes = given,
            frameworks = %names,
            registered = registered.len(),
            ms,
            "gave back memory the process kept and did not use ({})",
            why.as_str()
        );
    } else {
        tracing::debug!(frameworks = %names, ms, why = why.as_str(), ?ordinals, held_before, "gpufrac: give-back found nothing kept");
    }
    given
}

/// The longest an idle process goes between two give-backs while it holds memory above
/// its request that its pools did not give back (live data, or a call still under way).
const IDLE_ASK_AT_MOST_EVERY: Duration = Duration::from_secs(300);

/// Watches for an idle process holding memory above its request: called about once a
/// second with the count of launches, copies and sets ([`crate::control::gate::activity`]).
///
/// "Idle" is no new call: one long call (a copy of GiBs) looks idle while it runs, and a
/// give-back then finds the pools still in use. So while the process stays idle above its
/// request, it asks again after twice as long each time (`GPUFRAC_GIVE_BACK_IDLE`, 2x, 4x,
/// ... at most every five minutes), never more than that.
pub(crate) struct IdleWatch {
    count: u64,
    since: Instant,
    /// Idle this long (since `since`), the next give-back is asked for.
    next: Duration,
}

impl IdleWatch {
    /// A watch that starts now.
    pub(crate) fn new() -> IdleWatch {
        IdleWatch { count: u64::MAX, since: Instant::now(), next: Duration::ZERO }
    }

    /// Asks for a give-back after `GPUFRAC_GIVE_BACK_IDLE` without activity, and again
    /// later (see above) while memory above the request is still held.
    pub(crate) fn tick(&mut self, e: &'static Enforcer, count: u64) {
        let Some(after) = e.config.give_back_idle else { return };
        if count != self.count {
            (self.count, self.since, self.next) = (count, Instant::now(), after);
            return;
        }
        if self.since.elapsed() < self.next {
            return;
        }
        let above_request = (0..e.device_count())
            .filter_map(|o| e.slice(o))
            .any(|s| e.ledger.held(s.ledger) > s.request || e.ledger.my_granted(s.ledger) > 0);
        if above_request {
            ask(e, Why::Idle);
        }
        self.next = (self.next * 2).min(self.next.max(IDLE_ASK_AT_MOST_EVERY));
    }
}

/// `gpufrac_on_give_back` of `gpufrac.h`: 0, or -1 for a null function or a full table.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_on_give_back(
    release: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> c_int {
    let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match release {
        Some(release) => register(release, data),
        None => false,
    }));
    if registered.unwrap_or(false) {
        0
    } else {
        -1
    }
}

/// Stream captures under way in this process (begun, not yet ended), counted by the
/// capture hooks: what frameworks keep is not given back meanwhile (a free from another
/// thread would invalidate a global-mode capture).
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// A capture is about to begin (counted before the driver starts it, so that a give-back
/// that looks meanwhile waits).
pub(crate) fn capture_began() {
    CAPTURES.fetch_add(1, Ordering::AcqRel);
}

/// A capture ended (with a graph, broken, or never begun).
pub(crate) fn capture_ended() {
    let _ = CAPTURES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

/// Whether some stream of this process is being captured into a graph now.
fn capture_under_way() -> bool {
    CAPTURES.load(Ordering::Acquire) != 0
}
