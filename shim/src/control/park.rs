//! Parking, the shim's half (`GPUFRAC_PARK_AFTER`). A parkable group's idle processes may
//! be told by the arbiter to park: their whole device memory leaves the GPU, so that more
//! models than fit can share it. Two mechanisms, one gate:
//!
//! - **the shim's own swap**: every linear and stream-ordered allocation of a parkable
//!   process is VMM-backed (as swap-resolver bursts are), so the swap worker can copy all
//!   of it to host RAM, release the physical memory and keep the addresses;
//! - **the driver's checkpoint API**: the arbiter locks and checkpoints the process by PID;
//!   the shim only closes its gate first, so that the process's next call comes here and
//!   asks for the wake instead of blocking inside the driver.
//!
//! Either way the gate stays closed while parked: launches, copies and sets wait at it,
//! allocations wait in [`allocating`]. The first call that waits asks the arbiter to wake
//! the group (`Wake`); the arbiter makes room (parking others if it must), brings the
//! memory back (checkpoint) or grants it (the shim swaps back in, same addresses), and the
//! gate opens. A wake that is not granted within `GPUFRAC_WAIT_TIMEOUT` sends the waiting
//! calls back with out-of-memory; the next call asks again.
//!
//! What stays on the device while parked (shim path): allocations smaller than the VMM
//! granularity (2 MiB on most GPUs: rounding them up would waste more than parking
//! saves), arrays, memory in pools the program made itself, and each context's own
//! memory. The `Parked` report says how much that is, and the arbiter counts it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, Request};

use crate::control::arbiter::Client;
use crate::driver::ffi::Status;
use crate::enforcer::Enforcer;

/// The process may be parked: allocations look at [`PARKED`].
static PARKABLE: AtomicBool = AtomicBool::new(false);
/// Parked on some device: allocations and gated calls wait for the wake.
static PARKED: AtomicBool = AtomicBool::new(false);
/// Allocation calls between their look at `PARKED` and their end.
static ALLOCATING: AtomicU64 = AtomicU64::new(0);
/// Hooked calls between their look at the driver's hold (`thunks::held`) and their end:
/// a checkpoint park waits for them before the driver may lock the process, since one that
/// looked before the hold would otherwise reach the locked driver and block there.
static HOOKED: AtomicU64 = AtomicU64::new(0);
/// The devices this process is parked on, and whether the arbiter checkpointed it there.
static DEVICES: Mutex<BTreeMap<DeviceId, bool>> = Mutex::new(BTreeMap::new());

/// How long a checkpoint park waits, once calls the shim does not hook are held back,
/// for one that passed just before to reach the driver.
const THUNK_SETTLE: Duration = Duration::from_millis(5);

/// How long a park waits for allocations under way (and, for a checkpoint, any hooked
/// call on its way to the driver) before it declines (the group is not idle after all).
const ALLOCATIONS_GRACE: Duration = Duration::from_millis(200);

fn devices() -> MutexGuard<'static, BTreeMap<DeviceId, bool>> {
    DEVICES.lock().unwrap_or_else(|p| p.into_inner())
}

/// This process may be parked from now on (at `cuInit`, before any allocation).
pub(crate) fn enable() {
    PARKABLE.store(true, SeqCst);
}

/// Whether this process may be parked.
#[inline]
pub(crate) fn parkable() -> bool {
    PARKABLE.load(SeqCst)
}

/// Whether this process is parked (on some device).
#[inline]
pub(crate) fn parked() -> bool {
    PARKED.load(SeqCst)
}

/// An allocation under way; counted out when it drops.
pub(crate) struct Allocating(bool);

impl Drop for Allocating {
    fn drop(&mut self) {
        if self.0 {
            ALLOCATING.fetch_sub(1, SeqCst);
        }
    }
}

/// A hooked call on its way to the driver; counted out when it drops.
pub(crate) struct ToDriver(bool);

impl Drop for ToDriver {
    fn drop(&mut self) {
        if self.0 {
            HOOKED.fetch_sub(1, SeqCst);
        }
    }
}

/// Enters a hooked call that goes on to the driver: while the driver holds the process
/// locked for a checkpoint park it waits for the wake first; in a parkable process it is
/// counted until it ends, so that a park that holds the process meanwhile waits for it
/// rather than let it into the locked driver. One relaxed load in other processes.
#[inline]
pub(crate) fn to_driver() -> Result<ToDriver, Status> {
    if !PARKABLE.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(ToDriver(false));
    }
    loop {
        // Counted in before looking (both sequentially consistent): a park that set the
        // hold either sees this call in the count or is seen by it.
        HOOKED.fetch_add(1, SeqCst);
        if !crate::control::thunks::held_now() {
            return Ok(ToDriver(true));
        }
        HOOKED.fetch_sub(1, SeqCst);
        crate::control::thunks::wait_until_released()?;
    }
}

/// Enters an allocation: waits while the process is parked (asking for the wake);
/// out-of-memory if the wake failed. One relaxed load in processes that are not parkable.
#[inline]
pub(crate) fn allocating() -> Result<Allocating, Status> {
    if !PARKABLE.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(Allocating(false));
    }
    crate::control::gate::touch();
    loop {
        // Counted in before looking (both sequentially consistent): a park that set
        // PARKED either sees this allocation in the count or is seen by it.
        ALLOCATING.fetch_add(1, SeqCst);
        if !PARKED.load(SeqCst) {
            return Ok(Allocating(true));
        }
        ALLOCATING.fetch_sub(1, SeqCst);
        crate::control::gate::wait_awake()?;
    }
}

/// The arbiter admitted this process parked (its group's request does not fit on the GPU
/// now): its first call waits for the wake. Nothing is on the device yet.
pub(crate) fn admitted_parked(device: DeviceId) {
    devices().insert(device, false);
    PARKED.store(true, SeqCst);
    crate::control::gate::close();
    tracing::info!("admitted parked: the GPU is oversubscribed; the first CUDA call waits for room");
}

/// Parks this process's memory on `device` (the swap worker's thread), answering
/// `Parked`, or `Woken` if it declines because allocations are under way.
pub(crate) fn park(e: &'static Enforcer, client: &Client, device: DeviceId, checkpoint: bool) {
    let Some(slice) = e.slice_by_uuid(&device) else { return };
    let started = Instant::now();
    if devices().contains_key(&device) {
        // Parked already (a repeated command): say so again.
        let held = e.ledger.held_by_me(slice.ledger);
        let host_bytes = crate::control::swap::host_bytes(slice.ledger);
        client.send_until_delivered(&Request::Parked { device, host_bytes, held, micros: 0 });
        return;
    }
    // Only memory in use is moved: what the frameworks keep and do not use goes back
    // first (waited for a bounded time).
    crate::control::give_back::ask_and_wait(
        e,
        crate::control::give_back::Why::Moving,
        crate::control::give_back::BEFORE_MOVING,
    );
    let was_parked = PARKED.swap(true, SeqCst);
    let was_held = crate::control::thunks::held_now();
    if checkpoint {
        // From here hooked calls wait for the wake rather than go on to the driver, which
        // may lock the process; the ones under way are waited for below.
        crate::control::thunks::set_held(true);
    }
    let busy = || ALLOCATING.load(SeqCst) != 0 || (checkpoint && HOOKED.load(SeqCst) != 0);
    let deadline = started + ALLOCATIONS_GRACE;
    while busy() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if busy() {
        // Busy after all: not parked. The arbiter hears it is resident.
        if checkpoint && !was_held {
            crate::control::thunks::set_held(false);
        }
        if !was_parked {
            PARKED.store(false, SeqCst);
            crate::control::gate::notify_waiters();
        }
        tracing::debug!("declined to park: calls under way");
        let held = e.ledger.held_by_me(slice.ledger);
        client.send_until_delivered(&Request::Woken { device, held, micros: 0 });
        return;
    }
    // Launches, copies and sets inside finish; new ones wait.
    crate::control::gate::close();
    let host_bytes =
        if checkpoint { 0 } else { in_background(|| crate::control::swap::swap_out(e, &slice).bytes) };
    // Every grant goes back: a parked group borrows nothing. The wake grants it again.
    e.ledger.take_granted(slice.ledger, e.ledger.my_granted(slice.ledger));
    devices().insert(device, checkpoint);
    let held = e.ledger.held_by_me(slice.ledger);
    let took = started.elapsed();
    if checkpoint {
        // From here the driver may lock the process: calls the shim does not hook wait
        // for the wake in their thunks rather than block inside the driver. A thunk that
        // looked just before the hold cannot be counted (it jumps on, it does not return
        // here): a moment lets it reach the driver before the lock, which waits for it.
        std::thread::sleep(THUNK_SETTLE);
        tracing::info!(held, "parking: gate closed for the driver's checkpoint");
    } else {
        tracing::info!(
            host_bytes,
            held,
            ms = took.as_millis() as u64,
            "parked: device memory moved to host RAM"
        );
    }
    let micros = took.as_micros() as u64;
    client.send_until_delivered(&Request::Parked { device, host_bytes, held, micros });
}

/// Runs `work` on a thread of its own at a lower CPU priority (nice +10), with the threads
/// it starts: a park is background work, and a wake of another process (what a request
/// waits for) should have the CPU and the memory bandwidth first.
fn in_background<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            // SAFETY: gettid has no preconditions; setpriority on this very thread's ID
            // only lowers its priority (a failure leaves it as it was).
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, 10);
            }
            work()
        });
        worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Wakes every device this process is parked on (the swap worker's thread, when a call
/// waits): asks the arbiter, waits at most `GPUFRAC_WAIT_TIMEOUT`, brings the memory back
/// (shim path; the arbiter restored a checkpointed process before granting) and opens the
/// gate. A wake not granted sends the waiting calls back with out-of-memory.
pub(crate) fn wake(e: &'static Enforcer, client: &Client) {
    let parked: Vec<(DeviceId, bool)> = devices().iter().map(|(&d, &c)| (d, c)).collect();
    for (device, checkpoint) in parked {
        let Some(slice) = e.slice_by_uuid(&device) else {
            devices().remove(&device);
            if checkpoint {
                crate::control::thunks::set_held(false);
            }
            continue;
        };
        let asked = Instant::now();
        match client.wake(device, e.config.wait_timeout) {
            Ok(granted) => {
                let (moved, took) = if checkpoint {
                    // The arbiter restored and unlocked the process before granting.
                    crate::control::thunks::set_held(false);
                    e.ledger.add_granted(slice.ledger, granted);
                    (0, Duration::ZERO)
                } else {
                    let bytes = crate::control::swap::host_bytes(slice.ledger);
                    crate::control::swap::charge_swap_in(e, slice.ledger, bytes, granted);
                    crate::control::swap::swap_in(e, &slice, bytes)
                };
                devices().remove(&device);
                let held = e.ledger.held_by_me(slice.ledger);
                tracing::info!(
                    bytes = moved,
                    held,
                    waited_ms = asked.elapsed().saturating_sub(took).as_millis() as u64,
                    ms = took.as_millis() as u64,
                    "woken: device memory back"
                );
                if !checkpoint {
                    let micros = took.as_micros() as u64;
                    client.send_until_delivered(&Request::Woken { device, held, micros });
                }
            }
            Err(why) => {
                tracing::warn!(
                    "the parked group was not woken within GPUFRAC_WAIT_TIMEOUT ({why}): the calls that waited return out-of-memory"
                );
                crate::control::gate::fail_waiters();
                return;
            }
        }
    }
    open_if_awake();
}

/// The arbiter says this process is not parked on `device` (a park it gave up).
pub(crate) fn unparked(device: DeviceId) {
    if let Some(checkpoint) = devices().remove(&device) {
        if checkpoint {
            crate::control::thunks::set_held(false);
        }
        tracing::info!("not parked any more: the arbiter gave the park up");
    }
    open_if_awake();
}

/// Opens the gate once no device is parked (and no burst is swapped out).
fn open_if_awake() {
    if devices().is_empty() {
        PARKED.store(false, SeqCst);
        if crate::control::swap::swapped_out() {
            crate::control::gate::notify_waiters();
        } else {
            crate::control::gate::open_unparked();
        }
    }
}
