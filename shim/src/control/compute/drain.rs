//! A drain's figure by the device's own clock: how long the work a lease started ran past
//! the lease's end, as the GPU stamped it, not as the lease thread saw it.
//!
//! The lease thread still polls the streams to know *when* a drain is over (it must say
//! `LeaseDone` promptly), but what it sees is late: by its look's period, and by however
//! long a busy CPU leaves it (or the stream's completion) unscheduled. Charged to the
//! group's next lease and to its limit, that lateness is GPU time the group never had. So
//! the figure comes from events instead:
//! - at the drain's first look the lease thread records a *reference* event on a private,
//!   idle, non-blocking stream of each context in use (one stream and one timed event per
//!   context, made once, on this thread): it completes at once, so its device time is the
//!   host's clock at the record, read just before;
//! - once no call is inside the lease, each used stream's unmarked tail (calls since its
//!   last mark, streams.rs) gets a mark, recorded while the stream is still busy (a stream
//!   already idle has a tail whose end only polling saw: the drain is then the polled one);
//! - at the drain's end the device end of a stream's work is the reference's host time
//!   plus `cuEventElapsedTime(reference, its last mark)` (negative when it ended before the
//!   reference), and the drain is the latest such end past the lease's end (at least 0,
//!   at most the polled figure).
//!
//! What cannot be timed this way falls back to the polled figure for the whole drain: a
//! call on a stream that is not watched (a ninth stream, the per-thread default stream of
//! a fifth thread or of a context other than its slot's), the legacy stream's unmarked
//! tail (recording on it from this thread could make a capture elsewhere depend on the
//! legacy stream), a stream capturing at the drain's end, a context without a reference,
//! two devices draining at once. Nothing here runs on
//! the launch path, records on a capturing stream, or synchronizes anything.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use gpufrac_common::protocol::DeviceId;

use super::streams::{
    capturing, mark, CtxSetCurrent, EventElapsed, EventQuery, StreamQuery, RING, SLOTS, SLOT_COUNT, STREAMS,
    STREAMS_LOCK,
};
use super::{lock, monotonic_ns};
use crate::driver::ffi::{Status, SUCCESS};
use crate::driver::table::{real_ptr, Real};

/// `CU_STREAM_NON_BLOCKING`: the reference's stream never waits for the legacy stream.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CUDA_ERROR_NOT_READY`.
const NOT_READY: Status = 600;
/// Longest a drain waits for its references to complete once its work is done: they
/// complete at once on a GPU, but one that never does must not hold every hand-over (the
/// drain is then the polled one).
const SETTLE_AT_MOST_NS: u64 = 5_000_000;

/// Bumped when the contexts are forgotten (one destroyed or reset): the references made in
/// them died with them.
pub(super) static CONTEXTS_EPOCH: AtomicU64 = AtomicU64::new(0);
/// Gated calls that passed on a lease without a watched stream (their end is not timed).
pub(super) static UNWATCHED: AtomicU64 = AtomicU64::new(0);

type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> Status;
type EventCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> Status;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> Status;

/// The real driver functions the figure needs.
#[derive(Clone, Copy)]
struct Driver {
    set_current: CtxSetCurrent,
    stream_create: StreamCreate,
    event_create: EventCreate,
    event_record: EventRecord,
    event_query: EventQuery,
    elapsed: EventElapsed,
    stream_query: StreamQuery,
}

/// A context's reference: its private stream and event, and the host's clock (monotonic
/// ns) when the event was last recorded for the drain under way.
struct Reference {
    ctx: *mut c_void,
    stream: *mut c_void,
    event: *mut c_void,
    at_ns: Option<u64>,
}

/// The lease thread's device clock for drains.
pub(super) struct DeviceClock {
    driver: Option<Driver>,
    refs: Vec<Reference>,
    epoch: u64,
    /// The drains under way (device, lease): more than one is not timed.
    draining: Vec<(DeviceId, u32)>,
    /// Something of the drain under way cannot be timed: the polled figure stands.
    untimed: bool,
    /// Per slot: its calls when the last drain ended (more now: used since).
    last_calls: [u64; SLOT_COUNT],
    last_unwatched: u64,
}

impl DeviceClock {
    /// Resolves the driver's functions (none missing, or every drain is the polled one).
    pub(super) fn new() -> DeviceClock {
        let names = [
            Real::cuCtxSetCurrent,
            Real::cuStreamCreate,
            Real::cuEventCreate,
            Real::cuEventRecord,
            Real::cuEventQuery,
            Real::cuEventElapsedTime,
            Real::cuStreamQuery,
        ];
        let found = names.map(real_ptr);
        let driver = found.iter().all(|f| !f.is_null()).then(|| {
            // SAFETY: the real functions of these names, whose signatures these types are
            // (all non-null).
            unsafe {
                Driver {
                    set_current: std::mem::transmute::<*mut c_void, CtxSetCurrent>(found[0]),
                    stream_create: std::mem::transmute::<*mut c_void, StreamCreate>(found[1]),
                    event_create: std::mem::transmute::<*mut c_void, EventCreate>(found[2]),
                    event_record: std::mem::transmute::<*mut c_void, EventRecord>(found[3]),
                    event_query: std::mem::transmute::<*mut c_void, EventQuery>(found[4]),
                    elapsed: std::mem::transmute::<*mut c_void, EventElapsed>(found[5]),
                    stream_query: std::mem::transmute::<*mut c_void, StreamQuery>(found[6]),
                }
            }
        });
        DeviceClock {
            driver,
            refs: Vec::new(),
            epoch: CONTEXTS_EPOCH.load(SeqCst),
            draining: Vec::new(),
            untimed: false,
            last_calls: [0; SLOT_COUNT],
            last_unwatched: UNWATCHED.load(SeqCst),
        }
    }

    /// Whether the drain of `lease` on `device` has begun here.
    pub(super) fn began(&self, device: DeviceId, lease: u32) -> bool {
        self.draining.contains(&(device, lease))
    }

    /// Forgets drains that are no longer under way without having ended here (the arbiter
    /// took the lease back and gave a new one).
    pub(super) fn keep_only(&mut self, under_way: impl Fn(DeviceId, u32) -> bool) {
        self.draining.retain(|&(device, lease)| under_way(device, lease));
        if self.draining.is_empty() {
            self.untimed = false;
        }
    }

    /// The drain of `lease` on `device` begins: records the references of the contexts the
    /// lease's calls used.
    pub(super) fn begin(&mut self, device: DeviceId, lease: u32) {
        if !self.draining.is_empty() {
            self.untimed = true;
        }
        self.draining.push((device, lease));
        let Some(driver) = self.driver else {
            self.untimed = true;
            return;
        };
        let _guard = lock(&STREAMS_LOCK);
        let epoch = CONTEXTS_EPOCH.load(SeqCst);
        if epoch != self.epoch {
            // Their contexts are gone (or some are: which is not known; the others keep a
            // stream and an event each until the process ends, as the marks' rings do).
            self.refs.clear();
            self.epoch = epoch;
        }
        for r in &mut self.refs {
            r.at_ns = None;
        }
        for (index, slot) in SLOTS.iter().enumerate() {
            let ctx = slot.ctx.load(SeqCst);
            if ctx.is_null() || slot.calls.load(SeqCst) == self.last_calls[index] {
                continue;
            }
            let at = match self.refs.iter().position(|r| r.ctx == ctx) {
                Some(at) => at,
                None => match make_reference(driver, ctx) {
                    Some(r) => {
                        self.refs.push(r);
                        self.refs.len() - 1
                    }
                    None => continue,
                },
            };
            let r = &mut self.refs[at];
            if r.at_ns.is_some() {
                continue;
            }
            let now = monotonic_ns();
            // SAFETY: the real cuEventRecord with this context's private event and idle,
            // non-blocking stream (never captured: nothing else knows it).
            if unsafe { (driver.event_record)(r.event, r.stream) } == SUCCESS {
                r.at_ns = Some(now);
            }
        }
    }

    /// Once no call is inside the lease: marks each used stream's unmarked calls while the
    /// stream still runs them (see the module's doc for what cannot be).
    pub(super) fn mark_tails(&mut self) {
        let Some(driver) = self.driver.filter(|_| !self.untimed) else { return };
        let _guard = lock(&STREAMS_LOCK);
        for (index, slot) in SLOTS.iter().enumerate() {
            let calls = slot.calls.load(SeqCst);
            if calls == self.last_calls[index] || slot.marked.load(SeqCst) == calls {
                continue;
            }
            // The legacy stream's tail is not marked from here (the module's doc), nor a
            // thread's per-thread default stream's, which is another thread's to mark (its
            // calls all are).
            let stream = STREAMS.get(index).map_or(std::ptr::null_mut(), |s| s.load(SeqCst));
            // SAFETY: a stream a call of this process used, not destroyed (cuStreamDestroy
            // clears its slot under the lock held here), not capturing (checked first).
            let busy = !stream.is_null()
                && !capturing(stream)
                && unsafe { (driver.stream_query)(stream) } == NOT_READY;
            if busy {
                mark(index);
            }
            if slot.marked.load(SeqCst) != calls {
                self.untimed = true;
                return;
            }
        }
    }

    /// A lease given back with its streams idle: what their calls started is over, and
    /// the next drain times only what comes after.
    pub(super) fn all_done(&mut self) {
        if self.draining.is_empty() {
            for (index, slot) in SLOTS.iter().enumerate() {
                self.last_calls[index] = slot.calls.load(SeqCst);
            }
            self.last_unwatched = UNWATCHED.load(SeqCst);
        }
    }

    /// Whether the references recorded for the drain have completed (at once on a GPU; a
    /// look or two later on simgpu, whose streams are host threads): the drain is over only
    /// then, so its figure is there to take (or [`SETTLE_AT_MOST_NS`] after the record).
    pub(super) fn settled(&self) -> bool {
        let Some(driver) = self.driver.filter(|_| !self.untimed) else { return true };
        let _guard = lock(&STREAMS_LOCK);
        if CONTEXTS_EPOCH.load(SeqCst) != self.epoch {
            return true;
        }
        let now = monotonic_ns();
        self.refs.iter().all(|r| {
            r.at_ns.is_none_or(|at| {
                now.saturating_sub(at) >= SETTLE_AT_MOST_NS
                    // SAFETY: a reference's event, alive (its context was not forgotten: the
                    // epoch is unchanged, under the lock); a query only.
                    || unsafe { (driver.event_query)(r.event) } != NOT_READY
            })
        })
    }

    /// The drain of `lease` on `device` is over: its figure by the device's clock, if every
    /// call of the lease could be timed, for a lease that ended at `ended_ns` (monotonic).
    pub(super) fn end(&mut self, device: DeviceId, lease: u32, ended_ns: u64) -> Option<Duration> {
        let figure = self.figure(ended_ns);
        if let Err(why) = figure {
            tracing::debug!(lease, why, "the drain is the polled one");
        }
        self.draining.retain(|&d| d != (device, lease));
        if self.draining.is_empty() {
            self.untimed = false;
            for (index, slot) in SLOTS.iter().enumerate() {
                self.last_calls[index] = slot.calls.load(SeqCst);
            }
            self.last_unwatched = UNWATCHED.load(SeqCst);
        }
        figure.ok()
    }

    fn figure(&self, ended_ns: u64) -> Result<Duration, &'static str> {
        let driver = self.driver.ok_or("the driver lacks a function")?;
        if self.untimed || self.draining.len() != 1 {
            return Err("a tail not marked, or two drains at once");
        }
        if UNWATCHED.load(SeqCst) != self.last_unwatched {
            return Err("a call on a stream not watched");
        }
        let _guard = lock(&STREAMS_LOCK);
        if CONTEXTS_EPOCH.load(SeqCst) != self.epoch {
            return Err("a context was destroyed");
        }
        let mut latest: Option<f64> = None;
        for (index, slot) in SLOTS.iter().enumerate() {
            let calls = slot.calls.load(SeqCst);
            if calls == self.last_calls[index] {
                continue;
            }
            let recorded = slot.recorded.load(SeqCst);
            let (ctx, first) = (slot.ctx.load(SeqCst), slot.events[0].load(SeqCst));
            if ctx.is_null() || first.is_null() || recorded == 0 || slot.marked.load(SeqCst) != calls {
                return Err("a stream without marks, or its last calls unmarked");
            }
            let r = self.refs.iter().find(|r| r.ctx == ctx).ok_or("a context without a reference")?;
            let at_ns = r.at_ns.ok_or("a reference not recorded")?;
            let last = slot.events[(recorded as usize - 1) % RING].load(SeqCst);
            let mut ms = 0f32;
            // SAFETY: this context's reference and an event of the slot's ring, both alive
            // (the contexts were not forgotten: the epoch is unchanged, under the lock),
            // with a live out-parameter; queries only.
            let timed = unsafe {
                (driver.event_query)(last) == SUCCESS && (driver.elapsed)(&mut ms, r.event, last) == SUCCESS
            };
            if !timed || !ms.is_finite() {
                return Err("a mark not reached or not timed");
            }
            let end = at_ns as f64 + f64::from(ms) * 1e6;
            latest = Some(latest.map_or(end, |l: f64| l.max(end)));
        }
        let past = latest.map_or(0.0, |end| (end - ended_ns as f64).max(0.0));
        Ok(Duration::from_nanos(past as u64))
    }
}

/// A private non-blocking stream and a timed event in `ctx`, made current on this thread.
fn make_reference(driver: Driver, ctx: *mut c_void) -> Option<Reference> {
    let (mut stream, mut event) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the real cuCtxSetCurrent with a context a call of this process used, alive
    // (its destruction would have changed the epoch, checked under the lock held by the
    // caller); this thread's current context only. Then the real cuStreamCreate and
    // cuEventCreate with live out-parameters (default event flags: timed).
    let made = unsafe {
        (driver.set_current)(ctx) == SUCCESS
            && (driver.stream_create)(&mut stream, STREAM_NON_BLOCKING) == SUCCESS
            && (driver.event_create)(&mut event, 0) == SUCCESS
    };
    // A stream made without its event stays unused (one stream, once per context).
    made.then_some(Reference { ctx, stream, event, at_ns: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_every_drain_is_the_polled_one() {
        let mut clock = DeviceClock {
            driver: None,
            refs: Vec::new(),
            epoch: 0,
            draining: Vec::new(),
            untimed: false,
            last_calls: [0; SLOT_COUNT],
            last_unwatched: 0,
        };
        clock.begin([1; 16], 3);
        assert!(clock.began([1; 16], 3));
        assert_eq!(clock.end([1; 16], 3, 0), None);
        assert!(!clock.began([1; 16], 3));
    }
}
