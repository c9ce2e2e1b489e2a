//! The lease thread (`gpufrac-lease`): ends leases, measures drains, gives back a lease
//! its process does not use, and says `Want` for the calls waiting at the gate.

use std::ffi::c_void;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Request, MAX_DRAIN_US};

use super::drain::DeviceClock;
use super::streams::{
    streams_idle, CtxSetCurrent, EventElapsed, EventQuery, ExchangeCaptureMode, Marks, StreamQuery,
};
use super::{
    instant_ns, lock, publish, Local, AWAITING, CLIENT, HELD, IN_LEASE, LEASES, SYNCING, THREAD_WAKE, WANT,
};
use crate::driver::table::{real_ptr, Real};

/// How often the lease thread looks at the streams while a lease runs or drains.
const LOOK_EVERY: Duration = Duration::from_micros(250);
/// Longest the lease thread waits for a drain before it says done anyway (the arbiter
/// takes the lease back a little later).
const DRAIN_AT_MOST: Duration = Duration::from_millis(200);
/// How long a `Want` goes unanswered before it is said again (a message lost with a
/// connection, a late answer the arbiter set aside).
const WANT_AGAIN: Duration = Duration::from_secs(1);
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: u32 = 2;

/// The lease thread.
pub(super) fn run() {
    let relax = real_ptr(Real::cuThreadExchangeStreamCaptureMode);
    if !relax.is_null() {
        let mut mode = CAPTURE_MODE_RELAXED;
        // SAFETY: the real cuThreadExchangeStreamCaptureMode with a live in/out value; it
        // changes this thread's mode only.
        unsafe { std::mem::transmute::<*mut c_void, ExchangeCaptureMode>(relax)(&mut mode) };
    }
    let query = real_ptr(Real::cuStreamQuery);
    if query.is_null() {
        tracing::error!("compute shares: the driver has no cuStreamQuery; drains are not measured");
    }
    // SAFETY: the real functions of these names and signatures (or null, checked).
    let query: Option<StreamQuery> =
        (!query.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, StreamQuery>(query) });
    let set_current = real_ptr(Real::cuCtxSetCurrent);
    // SAFETY: as above.
    let set_current: Option<CtxSetCurrent> = (!set_current.is_null())
        .then(|| unsafe { std::mem::transmute::<*mut c_void, CtxSetCurrent>(set_current) });
    let (event_query, elapsed) = (real_ptr(Real::cuEventQuery), real_ptr(Real::cuEventElapsedTime));
    // SAFETY: the real functions of these names and signatures (both non-null).
    let marks = (!event_query.is_null() && !elapsed.is_null()).then(|| unsafe {
        Marks {
            query: std::mem::transmute::<*mut c_void, EventQuery>(event_query),
            elapsed: std::mem::transmute::<*mut c_void, EventElapsed>(elapsed),
        }
    });
    let idle = || query.is_none_or(|q| streams_idle(q, set_current, marks));
    let mut clock = DeviceClock::new();
    let delay = test_delay();
    let mut delayed: Option<u32> = None;
    // For the debug log: how the drain under way went (its first look's lateness, and
    // the looks that found a call inside, a stream busy, or the device's clock unsettled).
    let mut drain_looks = DrainLooks::default();
    let mut leases = lock(&LEASES);
    loop {
        if !delay.is_zero() {
            let first = leases.devices.iter().find_map(|&(_, l)| match l {
                Local::Draining { lease, .. } if delayed != Some(lease) => Some(lease),
                _ => None,
            });
            if let Some(lease) = first {
                // The test build's stand-in for a lease thread that a busy CPU leaves
                // unscheduled past the lease's end (no lock held meanwhile).
                delayed = Some(lease);
                drop(leases);
                std::thread::sleep(delay);
                leases = lock(&LEASES);
                continue;
            }
        }
        clock.keep_only(|device, lease| {
            leases
                .devices
                .iter()
                .any(|&(d, l)| d == device && matches!(l, Local::Draining { lease: x, .. } if x == lease))
        });
        let now = Instant::now();
        let wanted = WANT.load(SeqCst);
        let mut step = Step::default();
        for (device, local) in leases.devices.iter_mut() {
            let device = *device;
            match *local {
                Local::Held { lease, until, calls, idle: was_idle } => {
                    let held = Held { lease, until, calls, was_idle };
                    look_held(&mut step, local, device, held, now, wanted, &mut clock, &idle);
                }
                Local::Draining { lease, ended } => {
                    look_draining(
                        &mut step,
                        local,
                        device,
                        (lease, ended),
                        now,
                        &mut clock,
                        &mut drain_looks,
                        &idle,
                    );
                }
                Local::Wait { wanted: None } if wanted => {
                    WANT.store(false, SeqCst);
                    step.sends.push(Request::Want { device });
                    *local = Local::Wait { wanted: Some(now) };
                }
                Local::Wait { wanted: Some(since) } if wanted => {
                    if now.saturating_duration_since(since) >= WANT_AGAIN {
                        step.sends.push(Request::Want { device });
                        *local = Local::Wait { wanted: Some(now) };
                    } else {
                        step.soon(since + WANT_AGAIN);
                    }
                }
                Local::Free | Local::Open { .. } | Local::Wait { .. } => {}
            }
        }
        let Step { sends, changed, wake } = step;
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

/// How long a call that waited at the gate for a lease takes to wake: a test build's
/// stand-in for a scheduler that runs woken threads late
/// (`GPUFRAC_TEST_GATE_WAKE_DELAY_US`, read once); always zero in a release build.
pub(super) fn gate_wake_delay() -> Duration {
    static DELAY: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| crate::test_env_us("GPUFRAC_TEST_GATE_WAKE_DELAY_US"))
}

/// How a drain's looks went, for the debug log.
#[derive(Default)]
struct DrainLooks {
    first_late: Duration,
    /// Calls queued and not known finished at the first look, and what a call takes.
    queued: u64,
    cost_us: u64,
    looks: u32,
    inside: u32,
    busy: u32,
    unsettled: u32,
}

impl DrainLooks {
    fn count(&mut self, inside: u64, idle: bool, settled: bool) {
        self.looks += 1;
        self.inside += u32::from(inside > 0);
        self.busy += u32::from(inside == 0 && !idle);
        self.unsettled += u32::from(inside == 0 && !settled);
    }
}

/// How long the lease thread sleeps at each drain's first look: a test build's stand-in for
/// a busy CPU (`GPUFRAC_TEST_DRAIN_LOOK_DELAY_US`), so that a test can tell a drain timed by
/// the device from one timed by this thread; always zero in a release build.
fn test_delay() -> Duration {
    crate::test_env_us("GPUFRAC_TEST_DRAIN_LOOK_DELAY_US")
}

/// What one pass over the devices' leases decided.
#[derive(Default)]
struct Step {
    /// Messages for the arbiter, sent once the lock is let go.
    sends: Vec<Request>,
    /// A lease's state changed (published to the gate's readers).
    changed: bool,
    /// When to look again, at the latest.
    wake: Option<Instant>,
}

impl Step {
    fn soon(&mut self, at: Instant) {
        self.wake = Some(self.wake.map_or(at, |w| w.min(at)));
    }
}

/// A held lease as the last look left it.
struct Held {
    lease: u32,
    until: Instant,
    calls: u64,
    was_idle: bool,
}

/// A look at a held lease: past its end it starts draining; given back early when the
/// group has nothing to run (idle at the last look, no call since, nobody wanting it).
#[allow(clippy::too_many_arguments)]
fn look_held(
    step: &mut Step,
    local: &mut Local,
    device: gpufrac_common::protocol::DeviceId,
    held: Held,
    now: Instant,
    wanted: bool,
    clock: &mut DeviceClock,
    idle: &dyn Fn() -> bool,
) {
    let Held { lease, until, calls, was_idle } = held;
    if now >= until {
        *local = Local::Draining { lease, ended: until };
        step.changed = true;
        step.soon(now);
        return;
    }
    // Nothing to run: idle at the last look, and no call since.
    let count = crate::control::gate::activity();
    let quiet = HELD.load(SeqCst) == 0
        && SYNCING.load(SeqCst) == 0
        && IN_LEASE.load(SeqCst) == 0
        && AWAITING.load(SeqCst) == 0;
    if was_idle && count == calls && !wanted && quiet {
        step.sends.push(Request::LeaseDone { device, lease, drain_us: 0, more: false });
        clock.all_done();
        *local = Local::Wait { wanted: None };
        step.changed = true;
        return;
    }
    *local = Local::Held { lease, until, calls: count, idle: idle() };
    step.soon((now + LOOK_EVERY).min(until));
}

/// A look at a draining lease (`ended` when it did): done once nothing is inside, the
/// streams are idle and the device's clock settled, or after [`DRAIN_AT_MOST`]; then the
/// arbiter hears how long the drain took.
#[allow(clippy::too_many_arguments)]
fn look_draining(
    step: &mut Step,
    local: &mut Local,
    device: gpufrac_common::protocol::DeviceId,
    (lease, ended): (u32, Instant),
    now: Instant,
    clock: &mut DeviceClock,
    drain_looks: &mut DrainLooks,
    idle: &dyn Fn() -> bool,
) {
    if !clock.began(device, lease) {
        clock.begin(device, lease);
        let (queued, cost_ns) = super::streams::in_flight_summary();
        *drain_looks = DrainLooks {
            first_late: now.saturating_duration_since(ended),
            queued,
            cost_us: cost_ns / 1000,
            ..DrainLooks::default()
        };
    }
    let inside = IN_LEASE.load(SeqCst);
    if inside == 0 {
        clock.mark_tails();
    }
    let late = now.saturating_duration_since(ended);
    let (is_idle, settled) = (inside == 0 && idle(), inside == 0 && clock.settled());
    drain_looks.count(inside, is_idle, settled);
    if !((is_idle && settled) || late >= DRAIN_AT_MOST) {
        step.soon(now + LOOK_EVERY);
        return;
    }
    // Polling says when the drain is over; the device's clock says how long it was (the
    // polled figure adds this thread's lateness).
    let late = Instant::now().saturating_duration_since(ended);
    let drain = clock.end(device, lease, instant_ns(ended)).map_or(late, |d| d.min(late));
    let drain_us = (drain.as_micros() as u64).min(u64::from(MAX_DRAIN_US)) as u32;
    let more = WANT.swap(false, SeqCst);
    tracing::debug!(
        lease,
        drain_us,
        polled_us = late.as_micros() as u64,
        first_look_late_us = drain_looks.first_late.as_micros() as u64,
        queued_at_first_look = drain_looks.queued,
        call_cost_us = drain_looks.cost_us,
        looks = drain_looks.looks,
        inside = drain_looks.inside,
        busy = drain_looks.busy,
        unsettled = drain_looks.unsettled,
        "gpufrac: lease done"
    );
    step.sends.push(Request::LeaseDone { device, lease, drain_us, more });
    *local = Local::Wait { wanted: more.then_some(now) };
    step.changed = true;
}
