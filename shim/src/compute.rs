//! Compute shares, the shim's side of time leases (the rule is the arbiter's,
//! daemon/src/arbiter/policy/compute.rs). A process whose group has a compute share may
//! start work on a GPU only while its group holds that GPU's lease, or while the GPU is
//! open to it. Its launches, copies and sets (and graph launches, cooperative launches,
//! `cuLaunchKernelEx`) wait at the gate (gate.rs) otherwise; the first waiting call makes
//! the lease thread say `Want`.
//!
//! The lease thread (`gpufrac-lease`, started with the arbiter's connection, in the
//! relaxed stream-capture mode so that nothing it calls can invalidate a capture on
//! another thread) keeps each lease:
//! - at the lease's end the gate closes (the calls check the end themselves: no call
//!   passes late because the thread woke late);
//! - then it waits for the work the process started to finish, polling the streams its
//!   calls used during leases with `cuStreamQuery` (a small fixed array filled with
//!   atomics on the launch path), and says `LeaseDone` with the drain, how long that work
//!   ran past the end: the arbiter charges it, and hands the GPU on only then, so a drain
//!   is the holder's alone;
//! - while the lease runs, a process with nothing to run gives it back: its streams were
//!   idle at one look, no call came by the next, and no thread waits in a synchronize
//!   call (one that does is about to start more: it only has not woken yet);
//! - while the lease runs, it queries the *marks* (events the calls record after
//!   themselves on their streams, a ring per stream) to learn which calls finished and
//!   what a call takes; a call waits at the gate while its process has more than
//!   [`IN_FLIGHT_NS`] queued by that estimate (two per stream always go), so a cut
//!   holder's drain, and the wait of the group that cut it, stays that short.
//!
//! Streams are polled rather than marked with events recorded at the lease's end: with
//! the gate closed a stream's queue can only shrink, so "idle" is the end of the drain, and
//! polling needs no event per stream or context of its own. Nothing is gated or watched on
//! a stream that is being captured into a graph (its calls record, they run nothing), and
//! nothing here synchronizes a context or a stream, which a capture forbids. Work on a
//! thread's per-thread default stream cannot be polled from another thread: its drain is
//! not measured (its held time still is).
//!
//! A process without compute settings never gets here: its gate is one relaxed load.
//! A process whose GPU is open to it is not gated either: its gate's slow bit is clear.

use std::ffi::c_void;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU64,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, LeaseState, Request, MAX_DRAIN_US};

use crate::arbiter::Client;
use crate::ffi::{Status, SUCCESS};
use crate::real::{resolve, Lib};

/// How often the lease thread looks at the streams while a lease runs or drains.
const LOOK_EVERY: Duration = Duration::from_micros(250);
/// Longest the lease thread waits for a drain before it says done anyway (the arbiter
/// takes the lease back a little later).
const DRAIN_AT_MOST: Duration = Duration::from_millis(200);
/// How long a waiting call sleeps before it looks again (a wake-up is never lost for
/// longer than this).
const WAIT_SLICE: Duration = Duration::from_millis(2);
/// How long a `Want` goes unanswered before it is said again (a message lost with a
/// connection, a late answer the arbiter set aside).
const WANT_AGAIN: Duration = Duration::from_secs(1);
/// Streams watched for the drain; more are not watched (their drain is not measured).
const STREAM_SLOTS: usize = 8;
/// The work a leased process may have queued on the GPU before its next call waits, as
/// estimated from its streams' marks: what a cut holder's drain can take, and so what a
/// neighbour that cuts it waits for.
const IN_FLIGHT_NS: u64 = 3_000_000;
/// Calls always allowed in flight on a stream, whatever they are estimated to take: two,
/// so that the next is queued while one runs (a stream of long kernels never idles for a
/// wake-up).
const MIN_DEPTH: u64 = 2;
/// A stream's marks: events recorded after its calls while its process holds a lease.
const RING: usize = 16;
/// A mark is recorded once the calls since the last one are estimated to take this long
/// (or after every call while nothing is known): small kernels share a mark.
const MARK_EVERY_NS: u64 = 250_000;
/// Bounded streams: the watched ones, then the legacy default stream.
pub(crate) const SLOT_COUNT: usize = STREAM_SLOTS + 1;
const LEGACY_SLOT: usize = STREAM_SLOTS;
/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`, the default streams' special handles.
const LEGACY: usize = 0x1;
const PER_THREAD: usize = 0x2;
/// `CUDA_ERROR_NOT_READY`.
const NOT_READY: Status = 600;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: u32 = 2;

/// Calls may pass now (every compute device open or held).
static PASS: AtomicBool = AtomicBool::new(true);
/// The end of the shortest lease held, in monotonic ns (`u64::MAX`: open).
static UNTIL_NS: AtomicU64 = AtomicU64::new(u64::MAX);
/// A call waits and the lease thread has not said `Want` for it yet.
static WANT: AtomicBool = AtomicBool::new(false);
/// Streams used by calls while a lease ran (null: free slot).
static STREAMS: [AtomicPtr<c_void>; STREAM_SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; STREAM_SLOTS];
/// The context of the legacy default stream used in a lease (null: none).
static LEGACY_CTX: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Real driver functions, resolved at `start` (never on the launch path).
static IS_CAPTURING: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static IS_CAPTURING_PTSZ: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static CTX_GET_CURRENT: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_CREATE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_RECORD: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_DESTROY: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Gated calls between passing the lease check and returning: the lease thread says a
/// drain is over only once none is (a call that passed just before the lease's end, its
/// thread then preempted on a busy CPU, would otherwise start its work after the next
/// group's lease began).
static IN_LEASE: AtomicU64 = AtomicU64::new(0);
/// Threads of a leased process waiting in a synchronize call.
static SYNCING: AtomicU64 = AtomicU64::new(0);
/// Calls held because their process has enough work in flight (a lease is not given back
/// while one waits).
static HELD: AtomicU64 = AtomicU64::new(0);

/// A bounded stream's marks and what they tell. Written by the calls on it (atomics), read
/// by the lease thread, which queries the marks.
struct Slot {
    /// The ring of events (null: none), created in `ctx`.
    events: [AtomicPtr<c_void>; RING],
    ctx: AtomicPtr<c_void>,
    /// Gated calls that passed on the stream.
    calls: AtomicU64,
    /// `calls` that the last recorded mark follows.
    marked: AtomicU64,
    /// Marks recorded, and marks the lease thread saw reached.
    recorded: AtomicU64,
    seen: AtomicU64,
    /// Per ring entry: `calls` its mark follows, and whether the mark before it was still
    /// pending when it was recorded (then the time between the two is the calls' own).
    covers: [AtomicU64; RING],
    queued: [AtomicBool; RING],
    /// `calls` that have finished (those the last reached mark follows).
    done: AtomicU64,
    /// A call's device time on this stream, in ns (a moving average; 0: not known yet).
    cost_ns: AtomicU64,
    /// A thread records a mark now.
    marking: AtomicBool,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            events: [const { AtomicPtr::new(std::ptr::null_mut()) }; RING],
            ctx: AtomicPtr::new(std::ptr::null_mut()),
            calls: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            recorded: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            covers: [const { AtomicU64::new(0) }; RING],
            queued: [const { AtomicBool::new(false) }; RING],
            done: AtomicU64::new(0),
            cost_ns: AtomicU64::new(0),
            marking: AtomicBool::new(false),
        }
    }

    /// Forgets what it counted (a new stream takes it, or none).
    fn reset(&self) {
        for counter in [&self.calls, &self.marked, &self.recorded, &self.seen, &self.done, &self.cost_ns] {
            counter.store(0, SeqCst);
        }
    }

    /// Work queued and not known finished, in estimated ns: the calls since the last mark
    /// reached, or only those a recorded mark follows (`marked_only`: those whose end
    /// the lease thread will see).
    fn queued_ns(&self, marked_only: bool) -> u64 {
        let upto = if marked_only { self.marked.load(SeqCst) } else { self.calls.load(SeqCst) };
        upto.saturating_sub(self.done.load(SeqCst)).saturating_mul(self.cost_ns.load(Relaxed))
    }
}

static SLOTS: [Slot; SLOT_COUNT] = [const { Slot::new() }; SLOT_COUNT];

type IsCapturing = unsafe extern "C" fn(*mut c_void, *mut u32) -> Status;
type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> Status;
type CtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> Status;
type StreamQuery = unsafe extern "C" fn(*mut c_void) -> Status;
type ExchangeCaptureMode = unsafe extern "C" fn(*mut u32) -> Status;
type EventCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> Status;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> Status;
type EventQuery = unsafe extern "C" fn(*mut c_void) -> Status;
type EventElapsed = unsafe extern "C" fn(*mut f32, *mut c_void, *mut c_void) -> Status;
type EventDestroy = unsafe extern "C" fn(*mut c_void) -> Status;

/// A device's lease as this process keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    /// Not leased (the arbiter is away): calls pass.
    Free,
    Open {
        lease: u32,
    },
    Held {
        lease: u32,
        until: Instant,
        calls: u64,
        idle: bool,
    },
    /// The lease ended (at `ended`); its work is finishing.
    Draining {
        lease: u32,
        ended: Instant,
    },
    /// Since when it told the arbiter it wants the GPU, if it did.
    Wait {
        wanted: Option<Instant>,
    },
}

struct Leases {
    devices: Vec<(DeviceId, Local)>,
}

static LEASES: Mutex<Leases> = Mutex::new(Leases { devices: Vec::new() });
/// Wakes the lease thread.
static THREAD_WAKE: Condvar = Condvar::new();
/// Wakes the calls waiting at the gate (with [`GATE_LOCK`]).
static GATE_LOCK: Mutex<()> = Mutex::new(());
static GATE_OPENED: Condvar = Condvar::new();
static CLIENT: OnceLock<Arc<Client>> = OnceLock::new();
/// Serializes watching the streams with `cuStreamDestroy` (a destroyed handle is never
/// polled).
static STREAMS_LOCK: Mutex<()> = Mutex::new(());

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts leases for a process whose group has a compute share on `devices`: its calls
/// wait for a lease from now on, and the lease thread runs.
pub(crate) fn start(client: Arc<Client>, devices: &[DeviceId]) -> Result<(), String> {
    IS_CAPTURING.store(resolve(Lib::Cuda, "cuStreamIsCapturing"), Relaxed);
    IS_CAPTURING_PTSZ.store(resolve(Lib::Cuda, "cuStreamIsCapturing_ptsz"), Relaxed);
    CTX_GET_CURRENT.store(resolve(Lib::Cuda, "cuCtxGetCurrent"), Relaxed);
    EVENT_CREATE.store(resolve(Lib::Cuda, "cuEventCreate"), Relaxed);
    // Marks are recorded only where the lease thread can query and time them.
    if !resolve(Lib::Cuda, "cuEventQuery").is_null() && !resolve(Lib::Cuda, "cuEventElapsedTime").is_null() {
        EVENT_RECORD.store(resolve(Lib::Cuda, "cuEventRecord"), Relaxed);
    }
    EVENT_DESTROY.store(resolve(Lib::Cuda, "cuEventDestroy_v2"), Relaxed);
    let _ = CLIENT.set(client);
    {
        let mut leases = lock(&LEASES);
        for &device in devices {
            if !leases.devices.iter().any(|(d, _)| *d == device) {
                leases.devices.push((device, Local::Wait { wanted: None }));
            }
        }
        publish(&leases);
    }
    std::thread::Builder::new()
        .name("gpufrac-lease".into())
        .spawn(run)
        .map(|_| ())
        .map_err(|e| format!("gpufrac: cannot start the lease thread: {e}"))
}

/// The arbiter told `state` for `device`.
pub(crate) fn told(device: DeviceId, state: LeaseState) {
    let now = Instant::now();
    let mut leases = lock(&LEASES);
    let Some(entry) = leases.devices.iter_mut().find(|(d, _)| *d == device) else {
        tracing::debug!(?state, "a lease for a device without a compute share here");
        return;
    };
    let before = entry.1;
    entry.1 = match (before, state) {
        (_, LeaseState::Open { lease }) => Local::Open { lease },
        (Local::Held { lease: old, .. } | Local::Open { lease: old }, LeaseState::Held { lease, micros })
            if old == lease =>
        {
            // The same lease told again: keep its end.
            match before {
                Local::Held { .. } => before,
                _ => Local::Held {
                    lease,
                    until: now + Duration::from_micros(micros.into()),
                    calls: 0,
                    idle: false,
                },
            }
        }
        (Local::Draining { .. }, LeaseState::Held { lease, micros })
        | (_, LeaseState::Held { lease, micros }) => {
            Local::Held { lease, until: now + Duration::from_micros(micros.into()), calls: 0, idle: false }
        }
        (Local::Held { lease, .. } | Local::Open { lease }, LeaseState::Wait) => {
            Local::Draining { lease, ended: now }
        }
        (Local::Draining { .. }, LeaseState::Wait) => before,
        (Local::Free | Local::Wait { .. }, LeaseState::Wait) => Local::Wait { wanted: None },
    };
    if matches!(entry.1, Local::Held { .. } | Local::Open { .. }) {
        // What waited passes now; a later waiting call wants again.
        WANT.store(false, SeqCst);
    }
    tracing::debug!(?before, after = ?entry.1, "lease");
    publish(&leases);
    drop(leases);
    THREAD_WAKE.notify_all();
}

/// The arbiter is gone: nobody hands out leases, so calls pass until it is back.
pub(crate) fn forget() {
    let mut leases = lock(&LEASES);
    for entry in leases.devices.iter_mut() {
        entry.1 = Local::Free;
    }
    publish(&leases);
}

/// The arbiter is back (registered again): calls wait for its leases.
pub(crate) fn rejoin() {
    let mut leases = lock(&LEASES);
    for entry in leases.devices.iter_mut() {
        if entry.1 == Local::Free {
            entry.1 = Local::Wait { wanted: None };
        }
    }
    publish(&leases);
    drop(leases);
    THREAD_WAKE.notify_all();
}

/// Sets what the gate reads from the devices' leases, and wakes waiting calls if they
/// may pass.
fn publish(leases: &Leases) {
    let mut pass = true;
    let mut until = u64::MAX;
    let mut gated = false;
    for (_, local) in &leases.devices {
        match *local {
            Local::Free | Local::Open { .. } => {}
            Local::Held { until: end, .. } => {
                gated = true;
                until = until.min(instant_ns(end));
            }
            Local::Draining { .. } | Local::Wait { .. } => {
                gated = true;
                pass = false;
            }
        }
    }
    UNTIL_NS.store(until, SeqCst);
    PASS.store(pass, SeqCst);
    crate::gate::set_leased(gated);
    if pass {
        let _guard = lock(&GATE_LOCK);
        GATE_OPENED.notify_all();
    }
}

/// The slow path of a gated call in a leased process: returns once it may start its
/// work on `stream` (at once on a stream being captured), with the bounded stream's slot
/// if it has one (its mark is recorded after the call, [`after_call`]).
///
/// While the lease is held, a call also waits while its process has more than
/// [`IN_FLIGHT_NS`] of work queued (at least [`MIN_DEPTH`] calls on its own stream), as
/// its streams' marks tell: a cut holder's drain stays that short.
pub(crate) fn wait_for_lease(stream: *mut c_void) -> (Option<usize>, bool) {
    if capturing(stream) {
        return (None, false);
    }
    loop {
        // Counted inside before the lease is looked at (both sequentially consistent): the
        // lease thread, which ends the lease before it reads the count, either sees this
        // call or is seen by it.
        IN_LEASE.fetch_add(1, SeqCst);
        if PASS.load(SeqCst) && monotonic_ns() < UNTIL_NS.load(SeqCst) {
            let slot = watch(stream);
            let Some(index) = slot else { return (None, true) };
            if !over_bound(index) {
                SLOTS[index].calls.fetch_add(1, SeqCst);
                return (slot, true);
            }
            left_lease();
            // Held: the lease thread wakes it when a mark is reached (or the slice ends,
            // and it looks again: the lease may have ended meanwhile).
            HELD.fetch_add(1, SeqCst);
            let guard = lock(&GATE_LOCK);
            if over_bound(index) {
                let _ = GATE_OPENED.wait_timeout(guard, WAIT_SLICE);
            }
            HELD.fetch_sub(1, SeqCst);
            continue;
        }
        left_lease();
        if !WANT.swap(true, SeqCst) {
            // Under the lease thread's lock: it either has not looked at WANT yet or is
            // waiting (a wake-up between its last look and its wait would be lost, and it
            // sleeps up to a second while no lease is held).
            let _leases = lock(&LEASES);
            THREAD_WAKE.notify_all();
        }
        let guard = lock(&GATE_LOCK);
        if PASS.load(SeqCst) && monotonic_ns() < UNTIL_NS.load(SeqCst) {
            continue;
        }
        let _ = GATE_OPENED.wait_timeout(guard, WAIT_SLICE);
    }
}

/// A call that passed on the lease has returned (its work is queued).
pub(crate) fn left_lease() {
    IN_LEASE.fetch_sub(1, SeqCst);
}

/// Whether a call on `index`'s stream waits for the process's work in flight to shrink.
/// Only work that a recorded mark follows counts from other streams, and this stream's
/// unmarked calls are marked first: what holds a call is always work whose end the lease
/// thread will see.
fn over_bound(index: usize) -> bool {
    let slot = &SLOTS[index];
    if slot.events[0].load(Relaxed).is_null() {
        return false;
    }
    let outstanding = slot.recorded.load(SeqCst).saturating_sub(slot.seen.load(SeqCst));
    if outstanding as usize >= RING - 1 {
        return true;
    }
    if slot.calls.load(SeqCst).saturating_sub(slot.done.load(SeqCst)) < MIN_DEPTH {
        return false;
    }
    let others: u64 = SLOTS
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != index)
        .map(|(_, s)| s.queued_ns(true))
        .fold(0, u64::saturating_add);
    if others.saturating_add(slot.queued_ns(false)) < IN_FLIGHT_NS {
        return false;
    }
    if slot.calls.load(SeqCst) != slot.marked.load(SeqCst) {
        mark(index);
    }
    true
}

/// After a gated call on bounded slot `index`: records a mark once the calls since the
/// last one add up to [`MARK_EVERY_NS`] (atomics and, then, one `cuEventRecord`).
pub(crate) fn after_call(index: usize) {
    let slot = &SLOTS[index];
    let pending = slot.calls.load(SeqCst).saturating_sub(slot.marked.load(SeqCst));
    let cost = slot.cost_ns.load(Relaxed);
    if pending > 0 && (cost == 0 || pending.saturating_mul(cost) >= MARK_EVERY_NS) {
        mark(index);
    }
}

/// Records a mark on slot `index`'s stream after the calls so far, if the ring has room
/// (one thread at a time; another one marking makes this one unneeded).
fn mark(index: usize) {
    let slot = &SLOTS[index];
    if slot.marking.swap(true, SeqCst) {
        return;
    }
    let record = EVENT_RECORD.load(Relaxed);
    let (recorded, seen) = (slot.recorded.load(SeqCst), slot.seen.load(SeqCst));
    // At most RING - 1 pending: the entry before the oldest pending one (whose time the
    // lease thread measures from) is never overwritten.
    let room = (recorded.saturating_sub(seen) as usize) < RING - 1;
    let at = recorded as usize % RING;
    let event = slot.events[at].load(SeqCst);
    let stream = if index == LEGACY_SLOT { std::ptr::null_mut() } else { STREAMS[index].load(SeqCst) };
    let ring = !slot.events[0].load(SeqCst).is_null();
    if room && ring && !record.is_null() && !event.is_null() && (index == LEGACY_SLOT || !stream.is_null()) {
        let calls = slot.calls.load(SeqCst);
        slot.covers[at].store(calls, SeqCst);
        slot.queued[at].store(recorded > seen, SeqCst);
        // SAFETY: the real cuEventRecord with an event of this slot's ring (created in the
        // context of the calls on it) and the stream the call just used, which is not
        // capturing (the gate checked) and not destroyed (its call just ran on it).
        if unsafe { std::mem::transmute::<*mut c_void, EventRecord>(record)(event, stream) } == SUCCESS {
            slot.marked.store(calls, SeqCst);
            slot.recorded.store(recorded + 1, SeqCst);
        }
    }
    slot.marking.store(false, SeqCst);
}

/// The calling thread's context (null if none or unknown).
fn current_context() -> *mut c_void {
    let f = CTX_GET_CURRENT.load(Relaxed);
    let mut ctx = std::ptr::null_mut();
    if !f.is_null() {
        // SAFETY: the real cuCtxGetCurrent with a live out-parameter.
        if unsafe { std::mem::transmute::<*mut c_void, CtxGetCurrent>(f)(&mut ctx) } != SUCCESS {
            return std::ptr::null_mut();
        }
    }
    ctx
}

/// Gives slot `index` a ring of marks in the calling thread's context `ctx` (the cold path:
/// once per stream noted while leased). Without one the stream is not bounded.
fn make_ring(index: usize, ctx: *mut c_void) {
    let _guard = lock(&STREAMS_LOCK);
    let slot = &SLOTS[index];
    if ctx.is_null() || (slot.ctx.load(SeqCst) == ctx && !slot.events[0].load(SeqCst).is_null()) {
        return;
    }
    let (create, destroy) = (EVENT_CREATE.load(Relaxed), EVENT_DESTROY.load(Relaxed));
    slot.ctx.store(ctx, SeqCst);
    if create.is_null() || EVENT_RECORD.load(Relaxed).is_null() {
        return;
    }
    for entry in &slot.events {
        let old = entry.swap(std::ptr::null_mut(), SeqCst);
        if !old.is_null() && !destroy.is_null() {
            // SAFETY: an event this slot created in a context that is still alive (a
            // context's destruction forgets its rings, `forget_streams`).
            unsafe { std::mem::transmute::<*mut c_void, EventDestroy>(destroy)(old) };
        }
    }
    slot.reset();
    for entry in &slot.events {
        let mut event = std::ptr::null_mut();
        // SAFETY: the real cuEventCreate with a live out-parameter; default flags (timed).
        if unsafe { std::mem::transmute::<*mut c_void, EventCreate>(create)(&mut event, 0) } != SUCCESS {
            break;
        }
        entry.store(event, SeqCst);
    }
    if slot.events.iter().any(|e| e.load(SeqCst).is_null()) {
        // A partial ring is no ring: the stream goes unbounded.
        slot.events[0].store(std::ptr::null_mut(), SeqCst);
    }
}

/// Whether `stream` is being captured into a graph (its calls only record).
fn capturing(stream: *mut c_void) -> bool {
    let per_thread = stream as usize == PER_THREAD;
    let f = if per_thread { IS_CAPTURING_PTSZ.load(Relaxed) } else { IS_CAPTURING.load(Relaxed) };
    if f.is_null() {
        return false;
    }
    let mut status = 0u32;
    let handle = if per_thread { std::ptr::null_mut() } else { stream };
    // SAFETY: the real cuStreamIsCapturing(_ptsz), given the caller's stream (which the
    // caller's own call is about to use) and a live out-parameter.
    let result = unsafe { std::mem::transmute::<*mut c_void, IsCapturing>(f)(handle, &mut status) };
    // Active (1) or invalidated (2) both mean a capture owns the stream.
    result == SUCCESS && status != 0
}

/// Remembers `stream` for the drain (atomics only; a full array leaves it unwatched) and
/// returns its bounded slot, if it has one (a stream noted for the first time gets a ring
/// of marks, the cold path).
fn watch(stream: *mut c_void) -> Option<usize> {
    let handle = stream as usize;
    if handle == PER_THREAD {
        return None;
    }
    if handle == 0 || handle == LEGACY {
        let ctx = current_context();
        if LEGACY_CTX.load(Relaxed).is_null() && !ctx.is_null() {
            LEGACY_CTX.store(ctx, Relaxed);
        }
        // Only the legacy stream of the context watched is bounded.
        if ctx.is_null() || ctx != LEGACY_CTX.load(Relaxed) {
            return None;
        }
        if SLOTS[LEGACY_SLOT].ctx.load(Relaxed) != ctx {
            make_ring(LEGACY_SLOT, ctx);
        }
        return Some(LEGACY_SLOT);
    }
    if let Some(index) = STREAMS.iter().position(|s| s.load(Relaxed) == stream) {
        return Some(index);
    }
    for (index, slot) in STREAMS.iter().enumerate() {
        if slot.compare_exchange(std::ptr::null_mut(), stream, Relaxed, Relaxed).is_ok() {
            make_ring(index, current_context());
            return Some(index);
        }
    }
    None
}

/// A synchronize call of a leased process, counted while it waits and as activity when
/// it returns. A thread waiting for its work's result is about to start more (a server's
/// next step, the next request of its backlog); on a busy CPU it wakes from the wait well
/// after the GPU finished, and its lease, idle in that gap, would be given back under it:
/// every step would then wait for a hand-over, and a loaded server falls behind for good.
fn synchronizing(call: impl FnOnce() -> Status) -> Status {
    if !crate::gate::leased() {
        return call();
    }
    SYNCING.fetch_add(1, SeqCst);
    let status = call();
    crate::gate::touch();
    SYNCING.fetch_sub(1, SeqCst);
    status
}

/// `cuCtxSynchronize`.
pub(crate) fn ctx_synchronize() -> Status {
    synchronizing(|| crate::hooks::call_real!(cuCtxSynchronize()))
}

/// `cuStreamSynchronize`.
pub(crate) fn stream_synchronize(stream: *mut c_void) -> Status {
    synchronizing(|| crate::hooks::call_real!(cuStreamSynchronize(stream)))
}

/// `cuStreamSynchronize_ptsz`.
pub(crate) fn stream_synchronize_ptsz(stream: *mut c_void) -> Status {
    synchronizing(|| crate::hooks::call_real!(cuStreamSynchronize_ptsz(stream)))
}

/// `cuEventSynchronize`.
pub(crate) fn event_synchronize(event: *mut c_void) -> Status {
    synchronizing(|| crate::hooks::call_real!(cuEventSynchronize(event)))
}

/// `cuStreamDestroy`: the stream is no longer watched (before it is destroyed: the lease
/// thread never polls a destroyed handle).
pub(crate) fn stream_destroy(stream: *mut c_void) -> Status {
    {
        let _guard = lock(&STREAMS_LOCK);
        for (index, slot) in STREAMS.iter().enumerate() {
            if slot.compare_exchange(stream, std::ptr::null_mut(), Relaxed, Relaxed).is_ok() {
                // Its ring stays (the context's), its counts go.
                SLOTS[index].reset();
            }
        }
    }
    crate::hooks::call_real!(cuStreamDestroy_v2(stream))
}

/// A context is destroyed or reset: its streams die with it, so none is watched any more
/// (streams still used are watched again at their next call).
pub(crate) fn forget_streams() {
    let _guard = lock(&STREAMS_LOCK);
    for slot in &STREAMS {
        slot.store(std::ptr::null_mut(), Relaxed);
    }
    LEGACY_CTX.store(std::ptr::null_mut(), Relaxed);
    // The rings' events died with their context (which one is not known: all are
    // forgotten; another context's are left, a few events, until the process ends).
    for slot in &SLOTS {
        for entry in &slot.events {
            entry.store(std::ptr::null_mut(), SeqCst);
        }
        slot.ctx.store(std::ptr::null_mut(), SeqCst);
        slot.reset();
    }
}

/// The real event functions the lease thread queries marks with.
#[derive(Clone, Copy)]
struct Marks {
    query: EventQuery,
    elapsed: EventElapsed,
}

/// Moves each slot's `seen` on over the marks reached, learns its calls' cost from the
/// time between two marks (when the second was queued behind the first), and wakes the
/// calls held for the bound. Runs under [`STREAMS_LOCK`], on the lease thread (relaxed
/// capture mode: an event query there invalidates no capture on another thread).
fn reach_marks(marks: Marks) {
    let mut moved = false;
    for slot in &SLOTS {
        if slot.events[0].load(SeqCst).is_null() {
            continue;
        }
        loop {
            let (seen, recorded) = (slot.seen.load(SeqCst), slot.recorded.load(SeqCst));
            if seen >= recorded {
                break;
            }
            let at = seen as usize % RING;
            let event = slot.events[at].load(SeqCst);
            // SAFETY: an event of this slot's ring, alive (its context's destruction clears
            // the ring under the lock held here).
            let status = unsafe { (marks.query)(event) };
            if status == NOT_READY {
                break;
            }
            let covers = slot.covers[at].load(SeqCst);
            if status == SUCCESS && seen > 0 && slot.queued[at].load(SeqCst) {
                let before = (seen as usize - 1) % RING;
                let calls = covers.saturating_sub(slot.covers[before].load(SeqCst));
                let mut ms = 0f32;
                // SAFETY: two events of this ring, both reached, with a live out-parameter.
                let timed = unsafe { (marks.elapsed)(&mut ms, slot.events[before].load(SeqCst), event) };
                if timed == SUCCESS && calls > 0 && ms >= 0.0 {
                    let sample = (f64::from(ms) * 1e6 / calls as f64) as u64;
                    let cost = slot.cost_ns.load(Relaxed);
                    let cost = if cost == 0 { sample } else { cost - cost / 4 + sample / 4 };
                    slot.cost_ns.store(cost.max(1), Relaxed);
                }
            }
            // Reached (or gone with an error: counted reached, so nothing waits on it).
            slot.done.store(covers, SeqCst);
            slot.seen.store(seen + 1, SeqCst);
            moved = true;
        }
    }
    if moved && HELD.load(SeqCst) > 0 {
        let _guard = lock(&GATE_LOCK);
        GATE_OPENED.notify_all();
    }
}

/// Whether every watched stream has finished its work (the marks reached are taken in
/// first).
fn streams_idle(query: StreamQuery, set_current: Option<CtxSetCurrent>, marks: Option<Marks>) -> bool {
    let _guard = lock(&STREAMS_LOCK);
    if let Some(marks) = marks {
        reach_marks(marks);
    }
    let mut idle = true;
    for slot in &STREAMS {
        let stream = slot.load(Relaxed);
        if stream.is_null() || capturing(stream) {
            continue;
        }
        // SAFETY: a stream a call of this process used, not destroyed (cuStreamDestroy
        // clears its slot under the lock held here).
        match unsafe { query(stream) } {
            SUCCESS => {}
            NOT_READY => idle = false,
            // Gone (destroyed through a path not hooked, its context destroyed): unwatched.
            _ => slot.store(std::ptr::null_mut(), Relaxed),
        }
    }
    let ctx = LEGACY_CTX.load(Relaxed);
    if let (false, Some(set_current)) = (ctx.is_null(), set_current) {
        // SAFETY: a context a call of this process used, not destroyed (cuCtxDestroy
        // clears it under the lock held here); made current on this thread only.
        let legacy = unsafe {
            if set_current(ctx) == SUCCESS && !capturing(std::ptr::null_mut()) {
                query(std::ptr::null_mut())
            } else {
                SUCCESS
            }
        };
        if legacy == NOT_READY {
            idle = false;
        }
    }
    idle
}

/// The lease thread.
fn run() {
    let relax = resolve(Lib::Cuda, "cuThreadExchangeStreamCaptureMode");
    if !relax.is_null() {
        let mut mode = CAPTURE_MODE_RELAXED;
        // SAFETY: the real cuThreadExchangeStreamCaptureMode with a live in/out value; it
        // changes this thread's mode only.
        unsafe { std::mem::transmute::<*mut c_void, ExchangeCaptureMode>(relax)(&mut mode) };
    }
    let query = resolve(Lib::Cuda, "cuStreamQuery");
    if query.is_null() {
        tracing::error!("compute shares: the driver has no cuStreamQuery; drains are not measured");
    }
    // SAFETY: the real functions of these names and signatures (or null, checked).
    let query: Option<StreamQuery> =
        (!query.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, StreamQuery>(query) });
    let set_current = resolve(Lib::Cuda, "cuCtxSetCurrent");
    // SAFETY: as above.
    let set_current: Option<CtxSetCurrent> = (!set_current.is_null())
        .then(|| unsafe { std::mem::transmute::<*mut c_void, CtxSetCurrent>(set_current) });
    let (event_query, elapsed) =
        (resolve(Lib::Cuda, "cuEventQuery"), resolve(Lib::Cuda, "cuEventElapsedTime"));
    // SAFETY: the real functions of these names and signatures (both non-null).
    let marks = (!event_query.is_null() && !elapsed.is_null()).then(|| unsafe {
        Marks {
            query: std::mem::transmute::<*mut c_void, EventQuery>(event_query),
            elapsed: std::mem::transmute::<*mut c_void, EventElapsed>(elapsed),
        }
    });
    let idle = || query.is_none_or(|q| streams_idle(q, set_current, marks));
    let mut leases = lock(&LEASES);
    loop {
        let now = Instant::now();
        let wanted = WANT.load(SeqCst);
        let mut sends: Vec<Request> = Vec::new();
        let mut changed = false;
        let mut wake: Option<Instant> = None;
        let mut soon = |at: Instant| wake = Some(wake.map_or(at, |w: Instant| w.min(at)));
        for (device, local) in leases.devices.iter_mut() {
            let device = *device;
            match *local {
                Local::Held { lease, until, calls, idle: was_idle } => {
                    if now >= until {
                        *local = Local::Draining { lease, ended: until };
                        changed = true;
                        soon(now);
                        continue;
                    }
                    // Nothing to run: idle at the last look, and no call since.
                    let count = crate::gate::activity();
                    let quiet =
                        HELD.load(SeqCst) == 0 && SYNCING.load(SeqCst) == 0 && IN_LEASE.load(SeqCst) == 0;
                    if was_idle && count == calls && !wanted && quiet {
                        sends.push(Request::LeaseDone { device, lease, drain_us: 0, more: false });
                        *local = Local::Wait { wanted: None };
                        changed = true;
                        continue;
                    }
                    *local = Local::Held { lease, until, calls: count, idle: idle() };
                    soon((now + LOOK_EVERY).min(until));
                }
                Local::Draining { lease, ended } => {
                    let late = now.saturating_duration_since(ended);
                    if (IN_LEASE.load(SeqCst) == 0 && idle()) || late >= DRAIN_AT_MOST {
                        let drain_us = (late.as_micros() as u64).min(u64::from(MAX_DRAIN_US)) as u32;
                        let more = WANT.swap(false, SeqCst);
                        sends.push(Request::LeaseDone { device, lease, drain_us, more });
                        *local = Local::Wait { wanted: more.then_some(now) };
                        changed = true;
                    } else {
                        soon(now + LOOK_EVERY);
                    }
                }
                Local::Wait { wanted: None } if wanted => {
                    WANT.store(false, SeqCst);
                    sends.push(Request::Want { device });
                    *local = Local::Wait { wanted: Some(now) };
                }
                Local::Wait { wanted: Some(since) } if wanted => {
                    if now.saturating_duration_since(since) >= WANT_AGAIN {
                        sends.push(Request::Want { device });
                        *local = Local::Wait { wanted: Some(now) };
                    } else {
                        soon(since + WANT_AGAIN);
                    }
                }
                Local::Free | Local::Open { .. } | Local::Wait { .. } => {}
            }
        }
        if changed {
            publish(&leases);
        }
        if !sends.is_empty() {
            drop(leases);
            if let Some(client) = CLIENT.get() {
                for request in &sends {
                    client.send(request);
                }
            }
            leases = lock(&LEASES);
            continue;
        }
        let timeout = wake.map_or(Duration::from_secs(1), |w| w.saturating_duration_since(Instant::now()));
        if WANT.load(SeqCst) && leases.devices.iter().any(|(_, l)| *l == Local::Wait { wanted: None }) {
            continue;
        }
        leases =
            THREAD_WAKE.wait_timeout(leases, timeout).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
    }
}

/// The stream of a per-thread call (`_ptsz`, `_ptds`): its null stream is the calling
/// thread's per-thread default stream.
#[inline(always)]
pub(crate) fn per_thread(stream: *mut c_void) -> *mut c_void {
    if stream.is_null() {
        PER_THREAD as *mut c_void
    } else {
        stream
    }
}

/// The stream of `cuLaunchKernelEx`'s launch configuration (`CUlaunchConfig`: seven
/// 32-bit sizes, then the stream at offset 32).
#[inline(always)]
pub(crate) fn config_stream(config: *const c_void) -> *mut c_void {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's CUlaunchConfig, which the driver reads too; hStream is the
    // pointer-aligned field after gridDim[XYZ], blockDim[XYZ] and sharedMemBytes.
    unsafe { config.cast::<u8>().add(32).cast::<*mut c_void>().read() }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `at` on the monotonic clock, in ns (Instant is CLOCK_MONOTONIC on Linux).
fn instant_ns(at: Instant) -> u64 {
    let now = Instant::now();
    let base = monotonic_ns();
    if at >= now {
        base.saturating_add((at - now).as_nanos() as u64)
    } else {
        base.saturating_sub((now - at).as_nanos() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leased_process_passes_only_while_it_holds_and_a_waiting_call_wants() {
        let _turn = crate::gate::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let device = [7; 16];
        {
            let mut leases = lock(&LEASES);
            leases.devices.push((device, Local::Wait { wanted: None }));
            publish(&leases);
        }
        assert!(!PASS.load(SeqCst));
        let passed = Arc::new(AtomicBool::new(false));
        let caller = {
            let passed = passed.clone();
            std::thread::spawn(move || {
                let (_, inside) = wait_for_lease(std::ptr::null_mut());
                passed.store(inside, SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!passed.load(SeqCst), "a call passed without a lease");
        assert!(WANT.load(SeqCst), "the waiting call wants the GPU");
        told(device, LeaseState::Held { lease: 1, micros: 50_000 });
        caller.join().unwrap();
        assert!(passed.load(SeqCst), "the call passed, counted inside the lease");
        // Counted inside until it returns: the lease's drain waits for it.
        assert_eq!(IN_LEASE.load(SeqCst), 1);
        left_lease();
        // After the lease's end a call waits again, whatever the thread did.
        std::thread::sleep(Duration::from_millis(60));
        assert!(monotonic_ns() >= UNTIL_NS.load(SeqCst));
        told(device, LeaseState::Open { lease: 2 });
        assert!(wait_for_lease(std::ptr::null_mut()).1);
        left_lease();
        assert_eq!(IN_LEASE.load(SeqCst), 0, "a call waiting for a lease is not counted inside it");
        forget();
        assert!(PASS.load(SeqCst));
        lock(&LEASES).devices.clear();
    }

    #[test]
    fn a_call_waits_while_its_process_has_more_than_the_bound_in_flight_but_two_always_go() {
        let _turn = crate::gate::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let (a, b) = (&SLOTS[0], &SLOTS[1]);
        // Rings "made" (a dangling handle: nothing records with EVENT_RECORD unset).
        for slot in [a, b] {
            slot.events[0].store(std::ptr::NonNull::<c_void>::dangling().as_ptr(), SeqCst);
            slot.reset();
        }
        let set = |slot: &Slot, calls: u64, done: u64, cost_ns: u64| {
            slot.calls.store(calls, SeqCst);
            slot.marked.store(calls, SeqCst);
            slot.done.store(done, SeqCst);
            slot.cost_ns.store(cost_ns, SeqCst);
        };
        // Calls of half the bound: two in flight go, a third waits.
        let half = IN_FLIGHT_NS / 2;
        set(a, 1, 0, half);
        assert!(!over_bound(0));
        set(a, 2, 0, half);
        assert!(over_bound(0));
        // 100 µs calls: up to the bound's worth.
        let fit = IN_FLIGHT_NS / 100_000;
        set(a, fit - 1, 0, 100_000);
        assert!(!over_bound(0));
        set(a, fit, 0, 100_000);
        assert!(over_bound(0));
        // 10 ms calls: still two, so the stream never idles for a wake-up.
        set(a, 1, 0, 10_000_000);
        assert!(!over_bound(0));
        // Another stream's marked work counts toward the process's bound.
        set(a, 2, 0, 100_000);
        set(b, 2, 0, half);
        assert!(over_bound(0));
        set(b, 2, 2, half);
        assert!(!over_bound(0));
        // Nothing known about the cost: only a full ring holds.
        set(a, 10, 0, 0);
        assert!(!over_bound(0));
        a.recorded.store(RING as u64 - 1, SeqCst);
        assert!(over_bound(0));
        for slot in [a, b] {
            slot.events[0].store(std::ptr::null_mut(), SeqCst);
            slot.reset();
        }
    }

    #[test]
    fn the_stream_of_a_launch_config_is_read_at_its_offset() {
        #[repr(C)]
        struct Config {
            dims: [u32; 7],
            stream: *mut c_void,
            attrs: *mut c_void,
            count: u32,
        }
        let config =
            Config { dims: [1; 7], stream: 0x1234 as *mut c_void, attrs: std::ptr::null_mut(), count: 0 };
        assert_eq!(config_stream((&config as *const Config).cast()), 0x1234 as *mut c_void);
        assert_eq!(per_thread(std::ptr::null_mut()), PER_THREAD as *mut c_void);
    }
}
