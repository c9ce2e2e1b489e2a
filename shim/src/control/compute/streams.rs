//! The streams a leased process's calls use: which ones the drain polls, and the *marks*
//! (events recorded after the calls, a ring per stream) that tell the lease thread what
//! finished and what a call takes, so a call waits while its process has more than
//! [`IN_FLIGHT_NS`] queued.

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU64,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Mutex;

use super::{lock, GATE_LOCK, GATE_OPENED, HELD};
use crate::driver::ffi::{Status, SUCCESS};
use crate::driver::table::{real_ptr, Real};

/// Streams watched for the drain; more are not watched (their drain is not measured).
const STREAM_SLOTS: usize = 8;
/// The work a leased process may have queued on the GPU before its next call waits, as
/// estimated from its streams' marks: what a cut holder's drain can take, and so what a
/// neighbour that cuts it waits for.
pub(super) const IN_FLIGHT_NS: u64 = 2_000_000;
/// Calls always allowed in flight on a stream, whatever they are estimated to take: two,
/// so that the next is queued while one runs (a stream of long kernels never idles for a
/// wake-up).
const MIN_DEPTH: u64 = 2;
/// A stream's marks: events recorded after its calls while its process holds a lease.
pub(super) const RING: usize = 16;
/// A mark is recorded once the calls since the last one are estimated to take this long
/// (or after every call while nothing is known): small kernels share a mark.
const MARK_EVERY_NS: u64 = 250_000;
/// Threads whose per-thread default stream is bounded, a slot each while the thread lives.
const PER_THREAD_SLOTS: usize = 4;
/// Bounded streams: the watched ones, the legacy default stream, then the per-thread
/// default streams of the first threads that use theirs.
pub(super) const SLOT_COUNT: usize = STREAM_SLOTS + 1 + PER_THREAD_SLOTS;
pub(super) const LEGACY_SLOT: usize = STREAM_SLOTS;
const FIRST_PER_THREAD_SLOT: usize = STREAM_SLOTS + 1;
/// A per-thread slot's owner once its thread has ended: its marks are still watched until
/// all are reached, then the slot is free.
const ENDED: u64 = u64::MAX;
/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`, the default streams' special handles.
const LEGACY: usize = 0x1;
pub(super) const PER_THREAD: usize = 0x2;
/// `CUDA_ERROR_NOT_READY`.
const NOT_READY: Status = 600;

/// Streams used by calls while a lease ran (null: free slot).
pub(super) static STREAMS: [AtomicPtr<c_void>; STREAM_SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; STREAM_SLOTS];
/// The context of the legacy default stream used in a lease (null: none).
static LEGACY_CTX: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Per per-thread slot: its owner thread's token (0: free; [`ENDED`]).
static OWNERS: [AtomicU64; PER_THREAD_SLOTS] = [const { AtomicU64::new(0) }; PER_THREAD_SLOTS];
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);
/// The key whose destructor frees a thread's per-thread slot when the thread ends (made at
/// `resolve_driver`; u64::MAX: none).
static THREAD_END_KEY: AtomicU64 = AtomicU64::new(u64::MAX);
thread_local! {
    /// This thread's token (0: none yet) and per-thread slot (index + 1; 0: none). Constant
    /// initializers and no destructor: reading them allocates nothing and registers nothing.
    static TOKEN: Cell<u64> = const { Cell::new(0) };
    static OWN_SLOT: Cell<usize> = const { Cell::new(0) };
}
/// Real driver functions, resolved at `start` (never on the launch path).
static CTX_GET_CURRENT: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_CREATE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_RECORD: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EVENT_DESTROY: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// Serializes watching the streams with `cuStreamDestroy` (a destroyed handle is never
/// polled).
pub(super) static STREAMS_LOCK: Mutex<()> = Mutex::new(());

/// A bounded stream's marks and what they tell. Written by the calls on it (atomics), read
/// by the lease thread, which queries the marks.
pub(super) struct Slot {
    /// The ring of events (null: none), created in `ctx`.
    pub(super) events: [AtomicPtr<c_void>; RING],
    pub(super) ctx: AtomicPtr<c_void>,
    /// Gated calls that passed on the stream.
    pub(super) calls: AtomicU64,
    /// `calls` that the last recorded mark follows.
    pub(super) marked: AtomicU64,
    /// Marks recorded, and marks the lease thread saw reached.
    pub(super) recorded: AtomicU64,
    pub(super) seen: AtomicU64,
    /// Per ring entry: `calls` its mark follows, and whether the mark before it was still
    /// pending when it was recorded (then the time between the two is the calls' own).
    pub(super) covers: [AtomicU64; RING],
    pub(super) queued: [AtomicBool; RING],
    /// `calls` that have finished (those the last reached mark follows).
    pub(super) done: AtomicU64,
    /// A call's device time on this stream, in ns (a moving average; 0: not known yet).
    pub(super) cost_ns: AtomicU64,
    /// A thread records a mark now.
    pub(super) marking: AtomicBool,
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
    pub(super) fn reset(&self) {
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

pub(super) static SLOTS: [Slot; SLOT_COUNT] = [const { Slot::new() }; SLOT_COUNT];

type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> Status;
pub(super) type CtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> Status;
pub(super) type StreamQuery = unsafe extern "C" fn(*mut c_void) -> Status;
pub(super) type ExchangeCaptureMode = unsafe extern "C" fn(*mut u32) -> Status;
type EventCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> Status;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> Status;
pub(super) type EventQuery = unsafe extern "C" fn(*mut c_void) -> Status;
pub(super) type EventElapsed = unsafe extern "C" fn(*mut f32, *mut c_void, *mut c_void) -> Status;
type EventDestroy = unsafe extern "C" fn(*mut c_void) -> Status;

/// Resolves the real driver functions the marks and the capture checks use (at the
/// lease's start, never on the launch path).
pub(super) fn resolve_driver() {
    CTX_GET_CURRENT.store(real_ptr(Real::cuCtxGetCurrent), Relaxed);
    EVENT_CREATE.store(real_ptr(Real::cuEventCreate), Relaxed);
    // Marks are recorded only where the lease thread can query and time them.
    if !real_ptr(Real::cuEventQuery).is_null() && !real_ptr(Real::cuEventElapsedTime).is_null() {
        EVENT_RECORD.store(real_ptr(Real::cuEventRecord), Relaxed);
    }
    EVENT_DESTROY.store(real_ptr(Real::cuEventDestroy_v2), Relaxed);
    if THREAD_END_KEY.load(SeqCst) == u64::MAX {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: pthread_key_create with a live out-parameter and a destructor that only
        // stores to atomics (the shim is never unloaded, so the function stays).
        if unsafe { libc::pthread_key_create(&mut key, Some(thread_ended)) } == 0 {
            THREAD_END_KEY.store(u64::from(key), SeqCst);
        }
    }
}

/// A thread that owned a per-thread slot ended (`value`: the slot's index + 1): its work
/// may still run, so the slot is watched until its marks are reached ([`streams_idle`]).
extern "C" fn thread_ended(value: *mut c_void) {
    let slot = (value as usize).wrapping_sub(1).wrapping_sub(FIRST_PER_THREAD_SLOT);
    if let Some(owner) = OWNERS.get(slot) {
        owner.store(ENDED, SeqCst);
    }
}

/// Whether slot `index` is a thread's per-thread default stream.
pub(super) fn is_per_thread_slot(index: usize) -> bool {
    index >= FIRST_PER_THREAD_SLOT
}

/// The calling thread's per-thread default stream's slot, if it has one or can take a free
/// one. Each leased call on that stream reads two thread-locals, the current context (as
/// the legacy stream's calls do) and its slot's owner; a thread's first takes the slot
/// (the cold path: a token, a ring of marks, and the key that frees the slot when the
/// thread ends). Bounded only in the context the slot was made in, as the legacy stream is.
fn per_thread_slot() -> Option<usize> {
    let token = TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_TOKEN.fetch_add(1, Relaxed));
        }
        t.get()
    });
    let ctx = current_context();
    if ctx.is_null() {
        return None;
    }
    let cached = OWN_SLOT.with(Cell::get);
    if let Some(index) = cached.checked_sub(1) {
        if OWNERS[index - FIRST_PER_THREAD_SLOT].load(Relaxed) == token {
            let slot_ctx = SLOTS[index].ctx.load(Relaxed);
            if slot_ctx.is_null() {
                // Its context was destroyed (the rings forgotten): a ring in this one.
                make_ring(index, ctx);
            } else if slot_ctx != ctx {
                return None;
            }
            return Some(index);
        }
    }
    let at = OWNERS.iter().position(|o| o.compare_exchange(0, token, SeqCst, SeqCst).is_ok())?;
    let index = FIRST_PER_THREAD_SLOT + at;
    OWN_SLOT.with(|s| s.set(index + 1));
    let key = THREAD_END_KEY.load(SeqCst);
    if key != u64::MAX {
        // SAFETY: a key made by pthread_key_create; a non-null value makes its destructor
        // run when this thread ends.
        unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, (index + 1) as *const c_void) };
    }
    make_ring(index, ctx);
    Some(index)
}

/// Whether a call on `index`'s stream waits for the process's work in flight to shrink.
/// Only work that a recorded mark follows counts from other streams, and this stream's
/// unmarked calls are marked first: what holds a call is always work whose end the lease
/// thread will see.
pub(super) fn over_bound(index: usize) -> bool {
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

/// Calls queued and not known finished on the bounded streams, and the longest a call
/// takes on any of them by its marks (0: not known), for the lease thread's debug log.
pub(super) fn in_flight_summary() -> (u64, u64) {
    SLOTS.iter().filter(|s| !s.events[0].load(Relaxed).is_null()).fold((0, 0), |(calls, cost), s| {
        let queued = s.calls.load(SeqCst).saturating_sub(s.done.load(SeqCst));
        (calls.saturating_add(queued), cost.max(s.cost_ns.load(Relaxed)))
    })
}

/// After a gated call on bounded slot `index`: records a mark once the calls since the
/// last one add up to [`MARK_EVERY_NS`] (atomics and, then, one `cuEventRecord`).
pub(crate) fn after_call(index: usize) {
    let slot = &SLOTS[index];
    let pending = slot.calls.load(SeqCst).saturating_sub(slot.marked.load(SeqCst));
    let cost = slot.cost_ns.load(Relaxed);
    // A per-thread default stream is marked after every call: nobody else can mark its
    // tail, nor query it, so its marks alone say when its work is done.
    if pending > 0
        && (cost == 0 || pending.saturating_mul(cost) >= MARK_EVERY_NS || is_per_thread_slot(index))
    {
        mark(index);
    }
}

/// Records a mark on slot `index`'s stream after the calls so far, if the ring has room
/// (one thread at a time; another one marking makes this one unneeded).
pub(super) fn mark(index: usize) {
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
    // A per-thread slot's marks are recorded by its own thread (only its calls mark it),
    // on its per-thread default stream.
    let stream = match index {
        LEGACY_SLOT => std::ptr::null_mut(),
        i if is_per_thread_slot(i) => PER_THREAD as *mut c_void,
        i => STREAMS[i].load(SeqCst),
    };
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
pub(super) fn capturing(stream: *mut c_void) -> bool {
    crate::driver::table::stream_capturing(stream)
}

/// Remembers `stream` for the drain (atomics only; a full array leaves it unwatched) and
/// returns its bounded slot, if it has one (a stream noted for the first time gets a ring
/// of marks, the cold path).
pub(super) fn watch(stream: *mut c_void) -> Option<usize> {
    let handle = stream as usize;
    if handle == PER_THREAD {
        return per_thread_slot();
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
    crate::driver::table::call_real!(cuStreamDestroy_v2(stream))
}

/// A context is destroyed or reset: its streams die with it, so none is watched any more
/// (streams still used are watched again at their next call).
pub(crate) fn forget_streams() {
    let _guard = lock(&STREAMS_LOCK);
    // The lease thread's drain references were made in these contexts too.
    super::drain::CONTEXTS_EPOCH.fetch_add(1, SeqCst);
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
pub(super) struct Marks {
    pub(super) query: EventQuery,
    pub(super) elapsed: EventElapsed,
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
pub(super) fn streams_idle(
    query: StreamQuery,
    set_current: Option<CtxSetCurrent>,
    marks: Option<Marks>,
) -> bool {
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
    // Per-thread default streams cannot be queried from this thread: every call on one is
    // marked, so it is idle once its marks are reached. A slot whose thread ended is free
    // then.
    for (at, owner) in OWNERS.iter().enumerate() {
        let slot = &SLOTS[FIRST_PER_THREAD_SLOT + at];
        // Without a ring (none could be made, or its context was destroyed) nothing of it
        // is known: it is not waited for, as a stream not watched is not.
        let done = slot.events[0].load(SeqCst).is_null()
            || (slot.seen.load(SeqCst) >= slot.recorded.load(SeqCst)
                && slot.marked.load(SeqCst) == slot.calls.load(SeqCst));
        match owner.load(SeqCst) {
            0 => {}
            ENDED if done && owner.compare_exchange(ENDED, 0, SeqCst, SeqCst).is_ok() => slot.reset(),
            _ if !done => idle = false,
            _ => {}
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
