//! Compute pacing: a group past its compute allowance (policy in the arbiter,
//! daemon/src/arbiter/policy/compute.rs) is told a *pace*, the share of the wall clock
//! in which its calls may start work on the GPU. Launches, copies and sets of a paced
//! process pass the gate (gate.rs) only inside its windows: each [`PERIOD`] opens for
//! `pace` of it, at a phase of the process's own (so that paced processes do not all open
//! together). Before a paced call passes, the work the process submitted earlier must have
//! finished (`cuCtxSynchronize`): a paced process keeps at most one call's work queued on
//! the GPU, so a neighbour's kernel waits behind one of its calls, never behind a queue.
//!
//! The pace is a knob, not a measurement: the arbiter corrects it from what NVML reports
//! the group used, so that the group converges on its allowance whatever its kernels and
//! CPU gaps look like. A process that is not paced pays one relaxed load at its gate.
//!
//! Nothing here allocates or takes a lock on the launch path: the pace is an atomic, the
//! real `cuCtxSynchronize` is resolved when the first pace arrives.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use gpufrac_common::protocol::DeviceId;

use crate::ffi::Status;
use crate::real::{resolve, Lib};

/// The pacing window: short enough that a neighbour never waits long for the GPU, long
/// enough that the windows cost little (a sleep and a synchronize per window at least).
pub(crate) const PERIOD: Duration = Duration::from_millis(4);

/// The process's pace in per mille (1000: unpaced): the smallest of its GPUs' paces.
static PACE_PM: AtomicU16 = AtomicU16::new(1000);
/// This process's offset in the period, in ns: spread by PID (set with the first pace),
/// so that paced processes' windows do not all open together.
static PHASE_NS: AtomicU64 = AtomicU64::new(0);
/// The real `cuCtxSynchronize`, once a pace arrived.
static CTX_SYNCHRONIZE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// A synchronize failed (most likely a CUDA graph being captured, where synchronizing is
/// illegal): from then on paced calls only wait for their window.
static SYNC_FAILED: AtomicBool = AtomicBool::new(false);
/// Each GPU's pace as the arbiter last said it (cold: written when a pace arrives).
static PACES: Mutex<Vec<(DeviceId, u16)>> = Mutex::new(Vec::new());

type CtxSynchronize = unsafe extern "C" fn() -> Status;

/// The arbiter's new pace for `device` (per mille, 1 to 1000).
pub(crate) fn set_pace(device: DeviceId, pace_pm: u16) {
    if CTX_SYNCHRONIZE.load(Relaxed).is_null() {
        CTX_SYNCHRONIZE.store(resolve(Lib::Cuda, "cuCtxSynchronize"), Relaxed);
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() } as u64;
        // Fibonacci hashing spreads neighbouring PIDs over the period.
        PHASE_NS.store(pid.wrapping_mul(0x9e37_79b9_7f4a_7c15) % PERIOD.as_nanos() as u64, Relaxed);
    }
    let mut paces = PACES.lock().unwrap_or_else(|p| p.into_inner());
    match paces.iter_mut().find(|(d, _)| *d == device) {
        Some(entry) => entry.1 = pace_pm,
        None => paces.push((device, pace_pm)),
    }
    let pace = paces.iter().map(|&(_, p)| p).min().unwrap_or(1000).clamp(1, 1000);
    let before = PACE_PM.swap(pace, Relaxed);
    crate::gate::set_paced(pace < 1000);
    if (before < 1000) != (pace < 1000) {
        tracing::info!(
            pace = format!("{:.1}%", f64::from(pace) / 10.0),
            "{}",
            if pace < 1000 {
                "the arbiter paces this group: it used more of the GPU's time than its compute share allows while others want theirs"
            } else {
                "the arbiter lifted this group's compute pace"
            }
        );
    }
}

/// The arbiter is gone: nobody measures, so nothing is paced until it is back.
pub(crate) fn forget_paces() {
    PACES.lock().unwrap_or_else(|p| p.into_inner()).clear();
    PACE_PM.store(1000, Relaxed);
    crate::gate::set_paced(false);
}

/// The slow path of a paced call: waits for the process's earlier work, then for its
/// window.
pub(crate) fn pace() {
    let pace = PACE_PM.load(Relaxed);
    if pace >= 1000 {
        return;
    }
    let sync = CTX_SYNCHRONIZE.load(Relaxed);
    if !sync.is_null() && !SYNC_FAILED.load(Relaxed) {
        // SAFETY: the real driver's cuCtxSynchronize (no arguments).
        let status = unsafe { std::mem::transmute::<*mut c_void, CtxSynchronize>(sync)() };
        // No current context is the caller's own call's to report; anything else (a stream
        // being captured into a graph) means synchronizing here is not safe: stop.
        const INVALID_CONTEXT: Status = 201;
        if status != crate::ffi::SUCCESS && status != INVALID_CONTEXT && !SYNC_FAILED.swap(true, Relaxed) {
            tracing::warn!(status, "compute pacing: cuCtxSynchronize failed (a CUDA graph being captured?); paced calls no longer wait for earlier work, only for their window");
        }
    }
    let period = PERIOD.as_nanos() as u64;
    let open = period * u64::from(pace) / 1000;
    let at = (monotonic_ns() + PHASE_NS.load(Relaxed)) % period;
    if at >= open {
        // Until the next window opens. Once: a sleep overshoots by tens of microseconds,
        // more than a small pace's whole window, so the call goes at the wake-up whether
        // or not it landed inside (a late start, never a missed one).
        std::thread::sleep(Duration::from_nanos(period - at));
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_paced_process_passes_only_in_its_windows_and_the_slowest_gpu_sets_the_pace() {
        set_pace([1; 16], 300);
        set_pace([2; 16], 800);
        assert_eq!(PACE_PM.load(Relaxed), 300);
        // Calls of 0.2 ms each, back to back for 300 ms: paced at 30%, they start only in
        // the open 30% of each period, so they keep the "GPU" busy about a third of the
        // time (the open part plus the last call's overrun), where unpaced they would keep it
        // busy nearly all the time.
        let work = Duration::from_micros(200);
        let started = Instant::now();
        let mut busy = Duration::ZERO;
        while started.elapsed() < Duration::from_millis(300) {
            pace();
            let call = Instant::now();
            while call.elapsed() < work {}
            busy += call.elapsed();
        }
        let share = busy.as_secs_f64() / started.elapsed().as_secs_f64();
        let overrun = work.as_secs_f64() / PERIOD.as_secs_f64();
        assert!(
            share > 0.15 && share < 0.3 + overrun + 0.1,
            "calls kept {:.0}% busy at a 30% pace",
            share * 100.0
        );
        // The smallest pace opens 4 µs a period, less than a sleep overshoots: every call
        // still goes within about a period (a real H200 run once hung here, the window
        // missed again and again).
        set_pace([1; 16], 1);
        let started = Instant::now();
        for _ in 0..20 {
            pace();
        }
        assert!(
            started.elapsed() < PERIOD * 40,
            "20 calls at the smallest pace took {:?}",
            started.elapsed()
        );
        set_pace([1; 16], 1000);
        assert_eq!(PACE_PM.load(Relaxed), 800);
        forget_paces();
        assert_eq!(PACE_PM.load(Relaxed), 1000);
    }
}
