//! The simulated machine that every process using simgpu shares: its devices, how much
//! device memory each process holds on each, and events injected for health tests.
//!
//! The state lives in a small file (`SIMGPU_STATE`, by default one per user under
//! `/dev/shm`) mapped into every process. Two kernel-managed kinds of lock keep it
//! consistent without ever being left held by a killed process:
//! - the table lock, an open-file-description (OFD) record lock on one byte, taken for
//!   every change that must see a consistent total;
//! - one OFD lock byte per process slot, held for the life of the process that owns the
//!   slot. The kernel drops it when the process exits or is killed, so a slot whose byte
//!   is free belongs to a dead process and its memory is released, as the real driver
//!   releases a dead process's memory.
//!
//! It also holds each device's time-slice scheduler ([`sched`]): which process's kernels
//! may run now, who waits, how much device time each process has had, and how long each
//! has had kernels pending (running or sliced out), sampled for NVML's per-process
//! utilization ([`Machine::process_utilization`]). Which devices are NVLinked is read
//! per process from `SIMGPU_NVLINK` ([`nvlink`]).
#![deny(missing_docs)]

pub mod env;
pub mod nvlink;
pub mod objects;
pub mod sched;

use std::ffi::CString;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use gpufrac_common::shm::{SharedFile, SharedPlain};
use gpufrac_common::{parse_bytes, SizeError};

/// Most simulated devices on one machine.
pub const MAX_DEVICES: usize = 16;
/// Most processes using the simulated machine at once.
pub const MAX_PROCESSES: usize = 256;
/// Device memory when `SIMGPU_DEVICES` is unset: one device of 16 GiB.
pub const DEFAULT_DEVICES: &str = "16GiB";

/// Bumped whenever the layout of [`Shared`] changes meaning (the size is in the magic too):
/// a process of another layout resets the file instead of misreading it.
const LAYOUT_VERSION: u64 = 5;
const MAGIC: u64 =
    0x5349_4d47_0000_0000 | (LAYOUT_VERSION << 24) | (std::mem::size_of::<Shared>() as u64 & 0xff_ffff);

/// Utilization samples each device keeps for `nvmlDeviceGetProcessUtilization`: at one
/// every [`SAMPLE_PERIOD`] while kernels run, about 12.8 s of history.
pub const SAMPLE_RING: usize = 128;
/// Most processes one utilization sample lists (those whose kernels ran or waited in its
/// period).
pub const SAMPLE_PROCESSES: usize = 32;
/// How often the stream workers close a utilization sample while kernels run: 100 ms
/// (a real GPU samples about every 1/6 s).
pub const SAMPLE_PERIOD: std::time::Duration = std::time::Duration::from_millis(100);
/// A reader of per-process utilization closes the current sample first when it is at
/// least this old, so that its answer covers time up to its call.
pub const READER_SAMPLE_PERIOD: std::time::Duration = std::time::Duration::from_millis(10);

/// Name of every simulated device, as the driver and NVML report it.
pub const DEVICE_NAME: &str = "simgpu Virtual GPU";

/// The 16 UUID bytes of device `index` (`GPU-516d6770-7500-0000-0000-0000000000NN`),
/// the same through the driver and NVML.
pub fn device_uuid_bytes(index: usize) -> [u8; 16] {
    let mut bytes = [0x51, 0x6d, 0x67, 0x70, 0x75, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    bytes[15] = index as u8;
    bytes
}

/// The UUID of device `index` as NVML writes it.
pub fn device_uuid(index: usize) -> String {
    gpufrac_common::gpu_uuid::format(&device_uuid_bytes(index))
}

/// The PCI bus number of device `index` (domain 0, device 0, function 0).
pub fn pci_bus(index: usize) -> u32 {
    0x10 + index as u32
}

/// The PCI bus ID of device `index` as the driver and NVML write it.
pub fn pci_bus_id(index: usize) -> String {
    format!("00000000:{:02X}:00.0", pci_bus(index))
}

/// Why the simulated machine could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A setting could not be read.
    #[error("simgpu: {0}")]
    Setting(#[from] SizeError),
    /// `SIMGPU_DEVICES` named no device or too many.
    #[error("simgpu: invalid SIMGPU_DEVICES={0:?}: expected 1 to {MAX_DEVICES} comma-separated sizes such as 16GiB,16GiB")]
    DeviceList(String),
    /// The state file could not be created, locked or mapped.
    #[error("simgpu: shared state {path}: {source}")]
    Io {
        /// The state file.
        path: String,
        /// What the system said.
        source: io::Error,
    },
    /// `SIMGPU_TIMESLICE` was zero.
    #[error("simgpu: invalid SIMGPU_TIMESLICE={0:?}: expected a duration above zero such as 2ms or 500us")]
    Timeslice(String),
    /// Every process slot is taken by a live process.
    #[error("simgpu: more than {MAX_PROCESSES} processes use the simulated GPU at once")]
    TooManyProcesses,
}

/// One simulated device as the state holds it.
#[repr(C)]
struct DeviceRecord {
    total: AtomicU64,
    /// Bytes charged on this device: the live records' `used` plus the objects' `unowned`,
    /// changed with every change to them, so that a charge is one compare-and-swap and no
    /// lock. A process killed between charging this and its record leaves the bytes
    /// counted here until the machine is reset: counted too long, never too short.
    charged: AtomicU64,
    /// Nanoseconds that kernels have run on this device, for utilization.
    busy_ns: AtomicU64,
    /// Number of XID events injected so far, and the code of the last one.
    xid_count: AtomicU64,
    last_xid: AtomicU64,
    /// The scheduling token ([`ProcessRecord::token`]) of the process whose kernels may
    /// run now; 0 when nobody owns the device. Waiters sleep on it (a futex).
    owner: AtomicU32,
    /// How many processes wait for the device: a hint that lets an owner skip looking
    /// for waiters (a killed waiter's count is taken back when found dead).
    waiters: AtomicU32,
    /// When the owner's time slice began (CLOCK_MONOTONIC, ns).
    slice_start_ns: AtomicU64,
    samples: SampleRing,
}

/// Per-process utilization samples of one device, written under the table lock.
#[repr(C)]
struct SampleRing {
    /// Samples written so far; entry `n % SAMPLE_RING` is the n-th.
    written: AtomicU64,
    /// When the last sample closed (CLOCK_MONOTONIC, ns): the next one starts there.
    last_mono_ns: AtomicU64,
    entries: [SampleEntry; SAMPLE_RING],
}

#[repr(C)]
struct SampleEntry {
    /// When the sample closed, in microseconds since the Unix epoch (NVML's timeStamp).
    unix_us: AtomicU64,
    /// How long the sample covers, in nanoseconds.
    period_ns: AtomicU64,
    count: AtomicU32,
    _pad: AtomicU32,
    procs: [SampleProcess; SAMPLE_PROCESSES],
}

#[repr(C)]
struct SampleProcess {
    pid: AtomicU32,
    _pad: AtomicU32,
    /// Device time the process's kernels had in the sample's period.
    busy_ns: AtomicU64,
    /// How long in the sample's period the process had kernels pending, running or not.
    pending_ns: AtomicU64,
}

/// One process's share of the machine.
#[repr(C)]
struct ProcessRecord {
    in_use: AtomicU32,
    pid: AtomicU32,
    used: [AtomicU64; MAX_DEVICES],
    /// Contexts it has on each device: NVML lists a process with a context, as the driver
    /// does, even when the context takes no memory (`SIMGPU_CONTEXT_OVERHEAD=0`).
    contexts: [AtomicU32; MAX_DEVICES],
    /// This slot's scheduling token: the slot index in the low 8 bits, a sequence number
    /// above, so that a slot reused by a new process never inherits a dead owner's device.
    token: AtomicU32,
    _pad: AtomicU32,
    /// Device time its kernels had on each device (ns while it owned the device and ran).
    busy: [AtomicU64; MAX_DEVICES],
    /// `busy` when the device's last utilization sample closed.
    sampled_busy: [AtomicU64; MAX_DEVICES],
    /// How long it has had kernels pending on each device (submitted, not finished:
    /// running or sliced out), as a mark that [`sched::pending_ns`] reads; written by
    /// the process itself only.
    pending: [AtomicU64; MAX_DEVICES],
    /// Its pending time when the device's last utilization sample closed.
    sampled_pending: [AtomicU64; MAX_DEVICES],
    /// Since when (CLOCK_MONOTONIC, ns) it waits for each device; 0 when it does not.
    waiting_since: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
struct Shared {
    magic: AtomicU64,
    device_count: AtomicU32,
    generation: AtomicU32,
    /// Sequence for scheduling tokens.
    next_token: AtomicU32,
    _pad: AtomicU32,
    devices: [DeviceRecord; MAX_DEVICES],
    processes: [ProcessRecord; MAX_PROCESSES],
    /// Exported VMM memory, shared between processes ([`objects`]).
    objects: objects::ObjectTable,
}

/// One process's share of a device over recent samples, as
/// `nvmlDeviceGetProcessUtilization` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUtilization {
    /// The process ID (as [`driver_pid`] gives it).
    pub pid: u32,
    /// Percent of the samples' time during which this process had kernels pending on the
    /// device (submitted, not finished), whether they ran or waited for their time slice:
    /// what a real driver reports under time-slicing, where two processes that keep the
    /// device busy each read near 100%. Not the process's share of the device: that is
    /// `busy_ns / period_ns`.
    pub sm_util: u32,
    /// When the newest of the samples closed, in microseconds since the Unix epoch: the
    /// `lastSeenTimeStamp` to pass next time.
    pub timestamp_us: u64,
    /// Device time of the process in those samples, in nanoseconds: the time it owned the
    /// device and ran kernels.
    pub busy_ns: u64,
    /// How long in those samples it had kernels pending, in nanoseconds (`sm_util`'s
    /// measure).
    pub pending_ns: u64,
    /// How long those samples cover, in nanoseconds.
    pub period_ns: u64,
}

/// A process using a device and the memory it holds there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    /// The process ID in the namespace of the process that created its slot.
    pub pid: u32,
    /// Bytes of device memory it holds.
    pub used: u64,
}

/// The simulated machine, mapped into this process.
pub struct Machine {
    shm: SharedFile<Shared>,
    path: String,
}

// SAFETY: Shared holds only integers and atomics, in a fixed C layout.
unsafe impl SharedPlain for Shared {}

/// The default state path for this user.
pub fn default_state_path() -> String {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    format!("/dev/shm/simgpu-{uid}")
}

/// Reads `SIMGPU_DEVICES` (or its default) into device sizes in bytes.
pub fn devices_from_env() -> Result<Vec<u64>, StateError> {
    let text = std::env::var("SIMGPU_DEVICES").unwrap_or_else(|_| DEFAULT_DEVICES.to_owned());
    parse_device_list(&text)
}

/// Parses a `SIMGPU_DEVICES` value.
pub fn parse_device_list(text: &str) -> Result<Vec<u64>, StateError> {
    let sizes =
        text.split(',').map(|part| parse_bytes("SIMGPU_DEVICES", part)).collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() || sizes.len() > MAX_DEVICES {
        return Err(StateError::DeviceList(text.to_owned()));
    }
    Ok(sizes)
}

impl Machine {
    /// Opens the machine named by `SIMGPU_STATE` with the devices of `SIMGPU_DEVICES`.
    pub fn open_from_env() -> Result<Machine, StateError> {
        let path = std::env::var("SIMGPU_STATE").unwrap_or_else(|_| default_state_path());
        Machine::open(&path, &devices_from_env()?)
    }

    /// Opens (creating if needed) the machine at `path`. When no live process uses it,
    /// its devices are set to `devices`; otherwise the running machine is joined as is.
    pub fn open(path: &str, devices: &[u64]) -> Result<Machine, StateError> {
        if devices.is_empty() || devices.len() > MAX_DEVICES {
            return Err(StateError::DeviceList(format!("{} devices", devices.len())));
        }
        let shm = SharedFile::<Shared>::open(Path::new(path), |shm| {
            let anyone_alive = shm.get().magic.load(Ordering::Acquire) == MAGIC
                && (0..MAX_PROCESSES).any(|i| shm.slot_alive(i));
            if !anyone_alive {
                if shm.get().magic.load(Ordering::Acquire) == MAGIC {
                    objects::sweep_table(&shm.get().objects, path);
                }
                reset(shm.get(), devices);
            }
        })
        .map_err(|source| StateError::Io { path: path.to_owned(), source })?;
        Ok(Machine { shm, path: path.to_owned() })
    }

    fn shared(&self) -> &Shared {
        self.shm.get()
    }

    /// Path of the state file.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Number of simulated devices.
    pub fn device_count(&self) -> usize {
        self.shared().device_count.load(Ordering::Acquire) as usize
    }

    /// Physical memory of `device`, in bytes (0 for a device that does not exist).
    pub fn total(&self, device: usize) -> u64 {
        self.shared().devices.get(device).map_or(0, |d| d.total.load(Ordering::Relaxed))
    }

    /// Claims a process slot for this process, held until the process ends. NVML lists
    /// it by [`driver_pid`].
    pub fn attach(&self) -> Result<ProcessSlot<'_>, StateError> {
        let table = self.shm.lock_table();
        let i = self.shm.claim_slot(MAX_PROCESSES, &table).ok_or(StateError::TooManyProcesses)?;
        let rec = &self.shared().processes[i];
        self.forget_waits(rec);
        self.forget_usage(rec);
        clear_record(rec);
        // A dead process's slot not yet reaped: its shared objects pass on.
        self.leave_all_objects(i, true);
        let seq = self.shared().next_token.fetch_add(1, Ordering::Relaxed) % 0x00ff_ffff + 1;
        rec.token.store(seq << 8 | i as u32, Ordering::Relaxed);
        rec.pid.store(driver_pid(), Ordering::Relaxed);
        rec.in_use.store(1, Ordering::Release);
        Ok(ProcessSlot { machine: self, index: i })
    }

    /// Memory in use on `device` by live processes, releasing what dead ones held.
    pub fn used(&self, device: usize) -> u64 {
        let _guard = self.shm.lock_table();
        self.reap_dead();
        self.sum_used(device)
    }

    /// Live processes with a context or memory on `device`.
    pub fn processes(&self, device: usize) -> Vec<ProcessUsage> {
        let _guard = self.shm.lock_table();
        self.reap_dead();
        let mut listed: Vec<ProcessUsage> = Vec::new();
        let slots = self.shared().processes.iter().filter(|p| p.in_use.load(Ordering::Acquire) == 1);
        for (pid, used) in slots.filter_map(|p| {
            let used = p.used.get(device)?.load(Ordering::Relaxed);
            let contexts = p.contexts.get(device)?.load(Ordering::Relaxed);
            (used > 0 || contexts > 0).then(|| (p.pid.load(Ordering::Relaxed), used))
        }) {
            // One entry per process, as the device counts it: a process that loaded the
            // driver twice (a private `dlmopen` copy) has two slots and one figure.
            match listed.iter_mut().find(|p| p.pid == pid) {
                Some(p) => p.used += used,
                None => listed.push(ProcessUsage { pid, used }),
            }
        }
        listed
    }

    /// Adds kernel run time on `device`, for utilization. The scheduler ([`sched`]) does
    /// this for the kernels it runs: busy time is time during which some process owned the
    /// device and ran kernels, so it never exceeds wall time.
    pub fn add_busy(&self, device: usize, nanos: u64) {
        if let Some(d) = self.shared().devices.get(device) {
            d.busy_ns.fetch_add(nanos, Ordering::Relaxed);
        }
    }

    /// Total kernel run time on `device` so far, in nanoseconds.
    pub fn busy_ns(&self, device: usize) -> u64 {
        self.shared().devices.get(device).map_or(0, |d| d.busy_ns.load(Ordering::Relaxed))
    }

    /// Device time of each live process on `device` so far, as `(pid, nanoseconds)`: the
    /// time during which it owned the device and ran kernels there ([`sched`]). Processes
    /// that never ran a kernel there are left out. Releases what dead processes held.
    pub fn process_busy_ns(&self, device: usize) -> Vec<(u32, u64)> {
        if device >= MAX_DEVICES {
            return Vec::new();
        }
        let _guard = self.shm.lock_table();
        self.reap_dead();
        self.shared()
            .processes
            .iter()
            .filter(|p| p.in_use.load(Ordering::Acquire) == 1)
            .map(|p| (p.pid.load(Ordering::Relaxed), p.busy[device].load(Ordering::Relaxed)))
            .filter(|&(_, busy)| busy > 0)
            .collect()
    }

    /// How long each live process has had kernels pending on `device` so far (submitted,
    /// not finished: running or waiting for its time slice), as `(pid, nanoseconds)`: the
    /// measure of NVML's per-process `smUtil`. Processes that never had a kernel there
    /// are left out. Releases what dead processes held.
    pub fn process_pending_ns(&self, device: usize) -> Vec<(u32, u64)> {
        if device >= MAX_DEVICES {
            return Vec::new();
        }
        let _guard = self.shm.lock_table();
        self.reap_dead();
        let now = monotonic_ns();
        self.shared()
            .processes
            .iter()
            .filter(|p| p.in_use.load(Ordering::Acquire) == 1)
            .map(|p| {
                (
                    p.pid.load(Ordering::Relaxed),
                    sched::pending_ns(p.pending[device].load(Ordering::SeqCst), now),
                )
            })
            .filter(|&(_, pending)| pending > 0)
            .collect()
    }

    /// The PID of the process that owns `device` now (whose kernels may run), if any.
    pub fn device_owner(&self, device: usize) -> Option<u32> {
        let token = self.shared().devices.get(device)?.owner.load(Ordering::Acquire);
        let rec = self.token_record(token)?;
        Some(rec.pid.load(Ordering::Relaxed))
    }

    /// Per-process utilization of `device` over the samples that closed after
    /// `last_seen_us` (microseconds since the Unix epoch; 0 for all samples kept), one
    /// entry per process whose kernels ran or waited in them, as
    /// `nvmlDeviceGetProcessUtilization` answers: `sm_util` is the time it had kernels
    /// pending, `busy_ns` its device time. The sample in progress is closed first when it is at least
    /// [`READER_SAMPLE_PERIOD`] old. Empty when no sample is newer than `last_seen_us`.
    pub fn process_utilization(&self, device: usize, last_seen_us: u64) -> Vec<ProcessUtilization> {
        if device >= self.device_count().min(MAX_DEVICES) {
            return Vec::new();
        }
        let _guard = self.shm.lock_table();
        self.close_sample_locked(device, READER_SAMPLE_PERIOD.as_nanos() as u64);
        let ring = &self.shared().devices[device].samples;
        let written = ring.written.load(Ordering::Acquire);
        let (mut period, mut newest) = (0u64, 0u64);
        // (pid, device time, pending time)
        let mut busy: Vec<(u32, u64, u64)> = Vec::new();
        for n in (written.saturating_sub(SAMPLE_RING as u64)..written).rev() {
            let entry = &ring.entries[(n % SAMPLE_RING as u64) as usize];
            let at = entry.unix_us.load(Ordering::Relaxed);
            if at <= last_seen_us {
                break;
            }
            newest = newest.max(at);
            period += entry.period_ns.load(Ordering::Relaxed);
            let count = (entry.count.load(Ordering::Relaxed) as usize).min(SAMPLE_PROCESSES);
            for p in &entry.procs[..count] {
                let pid = p.pid.load(Ordering::Relaxed);
                let (ns, pending) = (p.busy_ns.load(Ordering::Relaxed), p.pending_ns.load(Ordering::Relaxed));
                match busy.iter_mut().find(|(q, _, _)| *q == pid) {
                    Some((_, total, total_pending)) => {
                        *total += ns;
                        *total_pending += pending;
                    }
                    None => busy.push((pid, ns, pending)),
                }
            }
        }
        let period = period.max(1);
        busy.into_iter()
            .map(|(pid, ns, pending)| ProcessUtilization {
                pid,
                sm_util: ((u128::from(pending) * 100 + u128::from(period) / 2) / u128::from(period)).min(100)
                    as u32,
                timestamp_us: newest,
                busy_ns: ns,
                pending_ns: pending,
                period_ns: period,
            })
            .collect()
    }

    /// Closes `device`'s utilization sample in progress if it is at least `min_ns` old.
    pub(crate) fn close_sample_if_due(&self, device: usize, min_ns: u64) {
        let Some(dev) = self.shared().devices.get(device) else { return };
        if monotonic_ns().saturating_sub(dev.samples.last_mono_ns.load(Ordering::Acquire)) < min_ns {
            return;
        }
        let _guard = self.shm.lock_table();
        self.close_sample_locked(device, min_ns);
    }

    /// As [`Machine::close_sample_if_due`]; the caller holds the table lock.
    fn close_sample_locked(&self, device: usize, min_ns: u64) {
        let ring = &self.shared().devices[device].samples;
        let now = monotonic_ns();
        let last = ring.last_mono_ns.load(Ordering::Acquire);
        if now.saturating_sub(last) < min_ns {
            return;
        }
        let written = ring.written.load(Ordering::Relaxed);
        let entry = &ring.entries[(written % SAMPLE_RING as u64) as usize];
        let mut count = 0;
        for p in self.shared().processes.iter().filter(|p| p.in_use.load(Ordering::Acquire) == 1) {
            let busy = p.busy[device].load(Ordering::Relaxed);
            let before = p.sampled_busy[device].swap(busy, Ordering::Relaxed);
            let ran = busy.saturating_sub(before);
            let pending = sched::pending_ns(p.pending[device].load(Ordering::SeqCst), now);
            let pending_before = p.sampled_pending[device].swap(pending, Ordering::Relaxed);
            let waited = pending.saturating_sub(pending_before);
            // A process is in the sample when its kernels ran or waited in it: a
            // sliced-out process is listed, busy, as the real driver lists it.
            if (ran > 0 || waited > 0) && count < SAMPLE_PROCESSES {
                entry.procs[count].pid.store(p.pid.load(Ordering::Relaxed), Ordering::Relaxed);
                entry.procs[count].busy_ns.store(ran, Ordering::Relaxed);
                entry.procs[count].pending_ns.store(waited, Ordering::Relaxed);
                count += 1;
            }
        }
        entry.unix_us.store(now_ns() / 1000, Ordering::Relaxed);
        entry.period_ns.store(now.saturating_sub(last), Ordering::Relaxed);
        entry.count.store(count as u32, Ordering::Relaxed);
        ring.last_mono_ns.store(now, Ordering::Release);
        ring.written.store(written + 1, Ordering::Release);
    }

    /// The record of the live process holding scheduling `token`, if there is one.
    fn token_record(&self, token: u32) -> Option<&ProcessRecord> {
        if token == 0 {
            return None;
        }
        let index = (token & 0xff) as usize;
        let rec = &self.shared().processes[index];
        let live = rec.in_use.load(Ordering::Acquire) == 1
            && rec.token.load(Ordering::Relaxed) == token
            && self.slot_alive(index);
        live.then_some(rec)
    }

    /// Injects an XID error on `device` (health tests); NVML event sets deliver it.
    pub fn inject_xid(&self, device: usize, xid: u64) -> bool {
        let Some(d) = self.shared().devices.get(device).filter(|_| device < self.device_count()) else {
            return false;
        };
        d.last_xid.store(xid, Ordering::Relaxed);
        d.xid_count.fetch_add(1, Ordering::Release);
        true
    }

    /// How many XIDs were injected on `device` so far, and the last one's code.
    pub fn xids(&self, device: usize) -> (u64, u64) {
        self.shared()
            .devices
            .get(device)
            .map_or((0, 0), |d| (d.xid_count.load(Ordering::Acquire), d.last_xid.load(Ordering::Relaxed)))
    }

    fn sum_used(&self, device: usize) -> u64 {
        self.shared()
            .processes
            .iter()
            .filter(|p| p.in_use.load(Ordering::Acquire) == 1)
            .filter_map(|p| p.used.get(device).map(|u| u.load(Ordering::Relaxed)))
            .fold(self.unowned_used(device), u64::saturating_add)
    }

    /// Forgets the records of processes that are gone. Caller holds the table lock.
    fn reap_dead(&self) {
        for (i, rec) in self.shared().processes.iter().enumerate() {
            if rec.in_use.load(Ordering::Acquire) == 1 && !self.slot_alive(i) {
                rec.in_use.store(0, Ordering::Release);
                self.forget_waits(rec);
                self.forget_usage(rec);
                clear_record(rec);
                self.leave_all_objects(i, true);
            }
        }
        self.reap_exports();
    }

    fn slot_alive(&self, index: usize) -> bool {
        self.shm.slot_alive(index)
    }

    /// Takes a process's memory off the devices' charged totals and zeroes its usage.
    fn forget_usage(&self, rec: &ProcessRecord) {
        for (device, used) in rec.used.iter().enumerate() {
            self.uncharge(device, used.swap(0, Ordering::AcqRel));
        }
    }

    /// Takes `bytes` off `device`'s charged total.
    pub(crate) fn uncharge(&self, device: usize, bytes: u64) {
        if let Some(dev) = self.shared().devices.get(device).filter(|_| bytes > 0) {
            let _ = dev
                .charged
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c.saturating_sub(bytes)));
        }
    }

    /// Adds `bytes` to `device`'s charged total without a bound: memory that moved to
    /// a holder from one whose usage was already taken off.
    pub(crate) fn recharge(&self, device: usize, bytes: u64) {
        if let Some(dev) = self.shared().devices.get(device) {
            dev.charged.fetch_add(bytes, Ordering::AcqRel);
        }
    }

    /// Takes back the waits of a process that is gone (or leaving) from the devices'
    /// waiter counts.
    fn forget_waits(&self, rec: &ProcessRecord) {
        for (device, since) in rec.waiting_since.iter().enumerate() {
            if since.swap(0, Ordering::SeqCst) != 0 {
                sched::count_down(&self.shared().devices[device].waiters);
            }
        }
    }
}

/// Zeroes a process record's usage, scheduling and sampling fields.
fn clear_record(rec: &ProcessRecord) {
    rec.used.iter().for_each(|u| u.store(0, Ordering::Relaxed));
    rec.contexts.iter().for_each(|c| c.store(0, Ordering::Relaxed));
    rec.busy.iter().for_each(|b| b.store(0, Ordering::Relaxed));
    rec.sampled_busy.iter().for_each(|b| b.store(0, Ordering::Relaxed));
    rec.pending.iter().for_each(|b| b.store(0, Ordering::Relaxed));
    rec.sampled_pending.iter().for_each(|b| b.store(0, Ordering::Relaxed));
    rec.waiting_since.iter().for_each(|w| w.store(0, Ordering::Relaxed));
}

/// This process's place on the simulated machine: device memory is charged to it.
pub struct ProcessSlot<'a> {
    machine: &'a Machine,
    index: usize,
}

/// A charge that did not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes free on the device when the charge was refused.
    pub free: u64,
}

impl<'a> ProcessSlot<'a> {
    fn record(&self) -> &ProcessRecord {
        &self.machine.shared().processes[self.index]
    }

    /// The time-slice scheduler through which this process's kernels take the devices,
    /// with slices of `slice` (see [`sched`]).
    pub fn scheduler(&self, slice: std::time::Duration) -> sched::Scheduler<'a> {
        sched::Scheduler::new(self.machine, self.index, self.record().token.load(Ordering::Relaxed), slice)
    }

    /// Charges `bytes` on `device` to this process if the device has them free.
    pub fn charge(&self, device: usize, bytes: u64) -> Result<(), OutOfMemory> {
        let (Some(dev), Some(used)) =
            (self.machine.shared().devices.get(device), self.record().used.get(device))
        else {
            return Err(OutOfMemory { free: 0 });
        };
        let total = dev.total.load(Ordering::Relaxed);
        let fits = |c: u64| c.checked_add(bytes).filter(|&n| n <= total);
        if dev.charged.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits).is_err() {
            // Only look for dead processes when it matters: their memory may be the room.
            let _guard = self.machine.shm.lock_table();
            self.machine.reap_dead();
            if let Err(charged) = dev.charged.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits) {
                return Err(OutOfMemory { free: total.saturating_sub(charged) });
            }
        }
        // The device first, the record second: see `DeviceRecord::charged`.
        used.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Gives back `bytes` on `device`.
    pub fn release(&self, device: usize, bytes: u64) {
        let Some(u) = self.record().used.get(device) else { return };
        let before = u.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(bytes)));
        self.machine.uncharge(device, before.unwrap_or_default().min(bytes));
    }

    /// Counts a context created on `device` (NVML lists the process while it has one).
    pub fn context_created(&self, device: usize) {
        if let Some(c) = self.record().contexts.get(device) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a context destroyed on `device`.
    pub fn context_destroyed(&self, device: usize) {
        let Some(c) = self.record().contexts.get(device) else { return };
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(1)));
    }

    /// Bytes this process holds on `device`.
    pub fn held(&self, device: usize) -> u64 {
        self.record().used.get(device).map_or(0, |u| u.load(Ordering::Relaxed))
    }
}

impl Drop for ProcessSlot<'_> {
    fn drop(&mut self) {
        let _guard = self.machine.shm.lock_table();
        let rec = self.record();
        rec.in_use.store(0, Ordering::Release);
        self.machine.forget_waits(rec);
        self.machine.forget_usage(rec);
        clear_record(rec);
        self.machine.leave_all_objects(self.index, true);
        let token = rec.token.load(Ordering::Relaxed);
        for dev in &self.machine.shared().devices {
            if dev.owner.compare_exchange(token, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                sched::wake_all(&dev.owner);
            }
        }
        self.machine.shm.release_slot(self.index);
    }
}

fn reset(s: &Shared, devices: &[u64]) {
    for (i, dev) in s.devices.iter().enumerate() {
        dev.total.store(devices.get(i).copied().unwrap_or(0), Ordering::Relaxed);
        dev.charged.store(0, Ordering::Relaxed);
        dev.busy_ns.store(0, Ordering::Relaxed);
        dev.xid_count.store(0, Ordering::Relaxed);
        dev.last_xid.store(0, Ordering::Relaxed);
        dev.owner.store(0, Ordering::Relaxed);
        dev.waiters.store(0, Ordering::Relaxed);
        dev.slice_start_ns.store(0, Ordering::Relaxed);
        dev.samples.written.store(0, Ordering::Relaxed);
        dev.samples.last_mono_ns.store(monotonic_ns(), Ordering::Relaxed);
    }
    for p in &s.processes {
        p.in_use.store(0, Ordering::Relaxed);
        p.pid.store(0, Ordering::Relaxed);
        p.token.store(0, Ordering::Relaxed);
        clear_record(p);
    }
    objects::clear_table(&s.objects);
    s.device_count.store(devices.len() as u32, Ordering::Relaxed);
    s.generation.fetch_add(1, Ordering::Relaxed);
    s.magic.store(MAGIC, Ordering::Release);
}

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process of the machine, for
/// time slices and sample periods.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Nanoseconds since the Unix epoch, for timestamps shared between processes.
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Removes the state file at `path` (tests and the demo clean up after themselves).
pub fn remove_state(path: &str) -> io::Result<()> {
    let c = CString::new(path).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated path.
    if unsafe { libc::unlink(c.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The PID a real driver reports for this process: the driver knows no PID namespaces,
/// so NVML lists a process in a container by its PID in the outermost namespace (the
/// host's), the first of `NSpid` in `/proc/self/status` where `/proc` shows it (a
/// container that mounts its own `/proc` shows only its own PID).
pub fn driver_pid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or_else(std::process::id)
}
