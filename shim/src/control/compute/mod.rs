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
//! Streams are polled to know *when* a drain is over: with the gate closed a stream's
//! queue can only shrink, so "idle" is its end. How *long* it was is timed by the device
//! (drain.rs): a reference event on a private stream per context, recorded at the drain's
//! first look, and the streams' last marks, compared with `cuEventElapsedTime`. Polling
//! alone would report, and have charged, how late this thread saw the work end.
//!
//! Nothing is gated or watched on a stream that is being captured into a graph (its
//! calls record, they run nothing), and nothing here synchronizes a context or a stream,
//! which a capture forbids. Work on a thread's per-thread default stream cannot be polled
//! from another thread: its drain is not measured (its held time still is).
//!
//! A process without compute settings never gets here: its gate is one relaxed load.
//! A process whose GPU is open to it is not gated either: its gate's slow bit is clear.
//!
//! The lease itself is kept here (what the arbiter told, the gate's view of it, the calls
//! waiting at the gate); the streams and their marks in `streams.rs`; the lease thread in
//! `thread.rs`; the drain's figure by the device's clock in `drain.rs`.

mod drain;
mod streams;
#[cfg(test)]
mod tests;
mod thread;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, LeaseState};

use crate::control::arbiter::Client;
use crate::driver::ffi::Status;

pub(crate) use streams::{after_call, forget_streams, stream_destroy};
use streams::{capturing, over_bound, watch, PER_THREAD, SLOTS};

/// How long a waiting call sleeps before it looks again (a wake-up is never lost for
/// longer than this).
const WAIT_SLICE: Duration = Duration::from_millis(2);

/// Calls may pass now (every compute device open or held).
static PASS: AtomicBool = AtomicBool::new(true);
/// The end of the shortest lease held, in monotonic ns (`u64::MAX`: open).
static UNTIL_NS: AtomicU64 = AtomicU64::new(u64::MAX);
/// A call waits and the lease thread has not said `Want` for it yet.
static WANT: AtomicBool = AtomicBool::new(false);
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
/// Calls waiting at the gate for a lease: a lease that came is not given back while one
/// has not woken yet (on an idle machine a thread's wake-up can take longer than the lease
/// thread's two looks, and the lease went back and forth unused).
static AWAITING: AtomicU64 = AtomicU64::new(0);

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

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts leases for a process whose group has a compute share on `devices`: its calls
/// wait for a lease from now on, and the lease thread runs.
pub(crate) fn start(client: Arc<Client>, devices: &[DeviceId]) -> Result<(), String> {
    streams::resolve_driver();
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
        .spawn(thread::run)
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
    crate::control::gate::set_leased(gated);
    if pass {
        let _guard = lock(&GATE_LOCK);
        GATE_OPENED.notify_all();
    }
}

/// The lease as the gate calls it, registered at start-up (`registry::init`).
pub(crate) fn at_the_gate() -> crate::control::gate::Lease {
    crate::control::gate::Lease { wait: wait_for_lease, after_call, left: left_lease }
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
            let Some(index) = slot else {
                // Its end is not timed by the device: this lease's drain is the polled one.
                drain::UNWATCHED.fetch_add(1, SeqCst);
                return (None, true);
            };
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
        AWAITING.fetch_add(1, SeqCst);
        let _ = GATE_OPENED.wait_timeout(guard, WAIT_SLICE);
        let delay = thread::gate_wake_delay();
        if !delay.is_zero() {
            // The test build's stand-in for a woken thread that the scheduler runs late.
            std::thread::sleep(delay);
        }
        AWAITING.fetch_sub(1, SeqCst);
    }
}

/// A call that passed on the lease has returned (its work is queued).
pub(crate) fn left_lease() {
    IN_LEASE.fetch_sub(1, SeqCst);
}

/// A synchronize call of a leased process, counted while it waits and as activity when
/// it returns. A thread waiting for its work's result is about to start more (a server's
/// next step, the next request of its backlog); on a busy CPU it wakes from the wait well
/// after the GPU finished, and its lease, idle in that gap, would be given back under it:
/// every step would then wait for a hand-over, and a loaded server falls behind for good.
fn synchronizing(call: impl FnOnce() -> Status) -> Status {
    if !crate::control::gate::leased() {
        return call();
    }
    SYNCING.fetch_add(1, SeqCst);
    let status = call();
    crate::control::gate::touch();
    SYNCING.fetch_sub(1, SeqCst);
    status
}

/// `cuCtxSynchronize`.
pub(crate) fn ctx_synchronize() -> Status {
    synchronizing(|| crate::driver::table::call_real!(cuCtxSynchronize()))
}

/// `cuStreamSynchronize`.
pub(crate) fn stream_synchronize(stream: *mut c_void) -> Status {
    synchronizing(|| crate::driver::table::call_real!(cuStreamSynchronize(stream)))
}

/// `cuStreamSynchronize_ptsz`.
pub(crate) fn stream_synchronize_ptsz(stream: *mut c_void) -> Status {
    synchronizing(|| crate::driver::table::call_real!(cuStreamSynchronize_ptsz(stream)))
}

/// `cuEventSynchronize`.
pub(crate) fn event_synchronize(event: *mut c_void) -> Status {
    synchronizing(|| crate::driver::table::call_real!(cuEventSynchronize(event)))
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
