//! Time-slicing of each device between processes, as a GPU without MPS does it.
//!
//! At any moment at most one process — the device's *owner* — has kernels making progress
//! on a device; its kernels on several streams run together (they share one context's
//! slice). The owner keeps the device while it has kernels running or queued back to back
//! on a stream. When its slice (`SIMGPU_TIMESLICE`, default [`DEFAULT_TIMESLICE`]) is over
//! and another process waits, the device goes to the process that has waited longest;
//! when the owner has no kernel left, it goes at once to the longest waiter (or to
//! nobody). Kernels of other processes wait: a `simgpu_sleep_us(us)` kernel needs `us` of
//! device time, run in chunks that end at the slice's end (preemption is slice-granular),
//! so under contention its wall time stretches; CPU kernels (fill, checksum) run whole
//! while their process owns the device.
//!
//! All of it lives in the shared mapping: the owner's scheduling token, the slice's start
//! and each process's waiting time per device, with waiters sleeping on the owner word (a
//! futex, polled at least every millisecond). An owner killed while holding a device is
//! found dead (its slot's lock is free, or the slot holds another process's token) by
//! the waiters, who take the device over. The per-process parts that are not shared —
//! how many of the process's streams want the device, how many kernels run — are in
//! [`Scheduler`], one per process.
//!
//! Device time is counted per process while it owns the device and runs kernels
//! (`Machine::process_busy_ns`) and per device (`Machine::busy_ns`): since only one
//! process runs at a time, a device's busy time never exceeds wall time. Apart from it,
//! each process's *pending* time is counted: while it has kernels submitted and not
//! finished (a stream claims the device, or a kernel runs or waits for its slice). That is
//! what NVML's per-process `smUtil` reports, as a real driver does under time-slicing: a
//! sliced-out context's kernels are still in flight, so two processes that flood one
//! device each read near 100% while each has half of its time.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::{monotonic_ns, DeviceRecord, Machine, ProcessRecord, StateError, MAX_DEVICES, SAMPLE_PERIOD};

/// The time slice when `SIMGPU_TIMESLICE` is unset: 2 ms. NVIDIA does not document the
/// driver's default compute time slice; `nvidia-smi compute-policy --set-timeslice`
/// offers short, medium and long slices, given as 2, 10 and 30 ms in third-party guides,
/// and 2 ms is the length usually measured for the default.
pub const DEFAULT_TIMESLICE: Duration = Duration::from_millis(2);
/// How long a waiter sleeps on the owner word before looking again.
const WAIT_TIMEOUT: Duration = Duration::from_millis(1);
/// How often a waiter checks that the owner is still alive (a system call).
const ALIVE_CHECK_NS: u64 = 1_000_000;
/// After its slice, an owner without waiters looks for new ones this often.
const POLL_NS: u64 = 500_000;
/// The shortest chunk a sleep kernel runs between looks at the slice.
const MIN_CHUNK_NS: u64 = 20_000;

/// Reads `SIMGPU_TIMESLICE` (a duration such as `2ms` or `500us`; default
/// [`DEFAULT_TIMESLICE`]). Zero is refused.
pub fn timeslice_from_env() -> Result<Duration, StateError> {
    let Ok(text) = std::env::var("SIMGPU_TIMESLICE") else { return Ok(DEFAULT_TIMESLICE) };
    let slice = gpufrac_common::parse_duration("SIMGPU_TIMESLICE", &text)?;
    if slice.is_zero() {
        return Err(StateError::Timeslice(text));
    }
    Ok(slice)
}

/// Set in a process's pending mark (its record's `pending`, per device) while it has
/// kernels pending on the device; the other bits are then when its pending time would
/// have started had it been pending without a break (now minus the total so far), and
/// without the bit the total itself. One word, so a reader in another process always
/// sees a consistent value.
const PENDING: u64 = 1 << 63;

/// The time a process has had kernels pending on a device so far (ns), from its pending
/// mark read at `now`.
pub(crate) fn pending_ns(mark: u64, now: u64) -> u64 {
    if mark & PENDING != 0 {
        now.saturating_sub(mark & !PENDING)
    } else {
        mark
    }
}

/// What this process knows of its own use of one device.
#[derive(Default)]
struct Local {
    /// Streams that run kernels back to back and so keep the device.
    claims: u32,
    /// Kernels inside [`Scheduler::run_for`] or [`Scheduler::run`]: running, or waiting
    /// for the device.
    wanting: u32,
    /// Kernels making progress now.
    running: u32,
    /// Since when kernels ran without their time being counted yet (monotonic ns).
    busy_since: u64,
    /// The slice is over and another process waits: no kernel starts, and the device is
    /// handed over when the last running one stops.
    yielding: bool,
}

/// This process's side of the devices' time-slicing. Stream workers call
/// [`Scheduler::claim`] when they start running kernels back to back,
/// [`Scheduler::unclaim`] when their queue runs dry, and run each kernel through
/// [`Scheduler::run_for`] (device time) or [`Scheduler::run`] (CPU work).
pub struct Scheduler<'a> {
    machine: &'a Machine,
    slot: usize,
    token: u32,
    slice_ns: u64,
    local: [Mutex<Local>; MAX_DEVICES],
}

impl<'a> Scheduler<'a> {
    pub(crate) fn new(machine: &'a Machine, slot: usize, token: u32, slice: Duration) -> Scheduler<'a> {
        Scheduler {
            machine,
            slot,
            token,
            slice_ns: (slice.as_nanos() as u64).max(1),
            local: std::array::from_fn(|_| Mutex::new(Local::default())),
        }
    }

    /// The time slice.
    pub fn timeslice(&self) -> Duration {
        Duration::from_nanos(self.slice_ns)
    }

    fn lock(&self, device: usize) -> MutexGuard<'_, Local> {
        self.local[device].lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn dev(&self, device: usize) -> &DeviceRecord {
        &self.machine.shared().devices[device]
    }

    fn rec(&self) -> &ProcessRecord {
        &self.machine.shared().processes[self.slot]
    }

    /// A stream starts running kernels back to back on `device`: the process keeps the
    /// device between them (until its slice is over and someone waits).
    pub fn claim(&self, device: usize) {
        if device < MAX_DEVICES {
            let mut local = self.lock(device);
            local.claims += 1;
            self.mark_pending(device, &local);
        }
    }

    /// A stream has no kernel queued any more: when no stream of the process has, the
    /// device goes at once to the process that has waited longest.
    pub fn unclaim(&self, device: usize) {
        if device >= MAX_DEVICES {
            return;
        }
        let mut local = self.lock(device);
        local.claims = local.claims.saturating_sub(1);
        if local.claims == 0 && local.running == 0 {
            self.release(device, &mut local);
        }
        self.mark_pending(device, &local);
    }

    /// Keeps the process's pending mark in step with whether it has kernels pending on
    /// `device` (a stream claims it, or a kernel runs or waits for it): NVML's per-process
    /// utilization counts that time, sliced out or not. The caller holds the device's
    /// local lock, so this process's marks have one writer.
    fn mark_pending(&self, device: usize, local: &Local) {
        let mark = &self.rec().pending[device];
        let now = monotonic_ns();
        let was = mark.load(SeqCst);
        let pending = local.claims > 0 || local.wanting > 0;
        if pending && was & PENDING == 0 {
            mark.store(now.saturating_sub(was) | PENDING, SeqCst);
        } else if !pending && was & PENDING != 0 {
            mark.store(pending_ns(was, now), SeqCst);
        }
    }

    /// A kernel starts (`+1`) or stops (`-1`) wanting `device`.
    fn want(&self, device: usize, starts: bool) {
        let mut local = self.lock(device);
        local.wanting = if starts { local.wanting + 1 } else { local.wanting.saturating_sub(1) };
        self.mark_pending(device, &local);
    }

    /// Runs a kernel that needs `time` of device time on `device`: it makes progress only
    /// while this process owns the device, in chunks that end with the slice.
    pub fn run_for(&self, device: usize, time: Duration) {
        if device >= MAX_DEVICES {
            std::thread::sleep(time);
            return;
        }
        let mut left = time.as_nanos() as u64;
        self.want(device, true);
        while left > 0 {
            let start = self.enter(device);
            let chunk = left.min(self.chunk_ns(device, start));
            std::thread::sleep(Duration::from_nanos(chunk));
            let end = monotonic_ns();
            left = left.saturating_sub(end.saturating_sub(start));
            self.exit(device, end);
        }
        self.want(device, false);
    }

    /// Runs `work` (a kernel done on the CPU) while this process owns `device`; its wall
    /// time is its device time. It is not preempted.
    pub fn run<T>(&self, device: usize, work: impl FnOnce() -> T) -> T {
        if device >= MAX_DEVICES {
            return work();
        }
        struct Running<'s, 'a>(&'s Scheduler<'a>, usize);
        impl Drop for Running<'_, '_> {
            fn drop(&mut self) {
                self.0.exit(self.1, monotonic_ns());
                self.0.want(self.1, false);
            }
        }
        self.want(device, true);
        self.enter(device);
        let _running = Running(self, device);
        work()
    }

    /// How long a sleep kernel may run before looking at the slice again.
    fn chunk_ns(&self, device: usize, now: u64) -> u64 {
        let end = self.dev(device).slice_start_ns.load(SeqCst).saturating_add(self.slice_ns);
        match end.saturating_sub(now) {
            0 => POLL_NS,
            left => left.max(MIN_CHUNK_NS),
        }
    }

    /// Waits until this process owns `device` and counts one more kernel running; returns
    /// when (monotonic ns).
    fn enter(&self, device: usize) -> u64 {
        let dev = self.dev(device);
        let mut checked_alive = monotonic_ns();
        loop {
            let owner = {
                let mut local = self.lock(device);
                let owner = dev.owner.load(SeqCst);
                if owner == self.token && !local.yielding {
                    self.stop_waiting(device);
                    let now = monotonic_ns();
                    local.running += 1;
                    if local.running == 1 {
                        local.busy_since = now;
                    }
                    return now;
                }
                if owner == 0 {
                    if dev.owner.compare_exchange(0, self.token, SeqCst, SeqCst).is_ok() {
                        dev.slice_start_ns.store(monotonic_ns(), SeqCst);
                    }
                    continue;
                }
                self.start_waiting(device);
                owner
            };
            if owner != self.token {
                let now = monotonic_ns();
                if now.saturating_sub(checked_alive) >= ALIVE_CHECK_NS {
                    checked_alive = now;
                    if self.machine.token_record(owner).is_none() {
                        // The owner died holding the device: take it over.
                        if dev.owner.compare_exchange(owner, self.token, SeqCst, SeqCst).is_ok() {
                            dev.slice_start_ns.store(monotonic_ns(), SeqCst);
                            wake_all(&dev.owner);
                        }
                        continue;
                    }
                }
            }
            futex_wait(&dev.owner, owner, WAIT_TIMEOUT);
        }
    }

    /// One kernel stops running at `now`: counts the device time since the last count,
    /// and hands the device over if the slice is over and someone waits (once no kernel of
    /// the process runs) or if the process wants it no more.
    fn exit(&self, device: usize, now: u64) {
        let mut local = self.lock(device);
        local.running = local.running.saturating_sub(1);
        let ran = now.saturating_sub(local.busy_since);
        local.busy_since = now;
        self.dev(device).busy_ns.fetch_add(ran, SeqCst);
        self.rec().busy[device].fetch_add(ran, SeqCst);
        if !local.yielding && self.slice_over(device, now) && self.next_waiter(device).is_some() {
            local.yielding = true;
        }
        if local.running == 0 && (local.yielding || local.claims == 0) {
            self.release(device, &mut local);
        }
        drop(local);
        self.machine.close_sample_if_due(device, SAMPLE_PERIOD.as_nanos() as u64);
    }

    fn slice_over(&self, device: usize, now: u64) -> bool {
        now.saturating_sub(self.dev(device).slice_start_ns.load(SeqCst)) >= self.slice_ns
    }

    /// Gives `device` to the process that has waited longest, or to nobody. The caller
    /// holds the device's local lock and no kernel of this process runs there.
    fn release(&self, device: usize, local: &mut Local) {
        local.yielding = false;
        let dev = self.dev(device);
        if dev.owner.load(SeqCst) != self.token {
            return;
        }
        let next = self.next_waiter(device).unwrap_or(0);
        if next != 0 {
            // Before the owner changes: only the owner reads it.
            dev.slice_start_ns.store(monotonic_ns(), SeqCst);
        }
        if dev.owner.compare_exchange(self.token, next, SeqCst, SeqCst).is_ok()
            && dev.waiters.load(SeqCst) > 0
        {
            wake_all(&dev.owner);
        }
    }

    /// The token of the live process, other than this one, that has waited longest for
    /// `device`. Waits of dead processes found on the way are taken back.
    fn next_waiter(&self, device: usize) -> Option<u32> {
        let dev = self.dev(device);
        if dev.waiters.load(SeqCst) == 0 {
            return None;
        }
        let processes = &self.machine.shared().processes;
        loop {
            let (since, index) = processes
                .iter()
                .enumerate()
                .filter(|(i, p)| *i != self.slot && p.in_use.load(SeqCst) == 1)
                .filter_map(|(i, p)| {
                    let since = p.waiting_since[device].load(SeqCst);
                    (since != 0).then_some((since, i))
                })
                .min()?;
            let waiter = &processes[index];
            if self.machine.slot_alive(index) {
                return Some(waiter.token.load(SeqCst));
            }
            if waiter.waiting_since[device].compare_exchange(since, 0, SeqCst, SeqCst).is_ok() {
                count_down(&dev.waiters);
            }
        }
    }

    fn start_waiting(&self, device: usize) {
        let since = &self.rec().waiting_since[device];
        if since.load(SeqCst) == 0 {
            since.store(monotonic_ns().max(1), SeqCst);
            self.dev(device).waiters.fetch_add(1, SeqCst);
        }
    }

    fn stop_waiting(&self, device: usize) {
        if self.rec().waiting_since[device].swap(0, SeqCst) != 0 {
            count_down(&self.dev(device).waiters);
        }
    }
}

/// Decrements a count, never below zero.
pub(crate) fn count_down(count: &AtomicU32) {
    let _ = count.fetch_update(SeqCst, SeqCst, |n| Some(n.saturating_sub(1)));
}

/// Sleeps until `word` changes from `expected`, a wake, or `timeout`. The word is in a
/// shared file mapping, so the futex is the shared (not process-private) kind.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call and `ts` a
    // valid timespec; FUTEX_WAIT only reads them.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Wakes every process and thread sleeping on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access memory beyond it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}
