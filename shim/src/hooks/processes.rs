//! NVML's lists of processes, as a tenant sees them: only its own group's processes
//! (the live members of its ledger; a process without a group is alone in it), in every
//! version of the running-process and per-process utilization queries. Other tenants'
//! PIDs, and what they hold or use, are none of its business.
//!
//! The real function fills a buffer of the shim's own, grown until everything fits
//! (these are queries, not hot paths), and the caller gets the filtered entries with
//! NVML's count protocol: the count in, the count out, `NVML_ERROR_INSUFFICIENT_SIZE`
//! with the needed count when the caller's room is too small.

use std::ffi::{c_uint, c_ulonglong, c_void};

use crate::driver::ffi::{read, write, Status, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::enforcer_any;

type Ptr = *mut c_void;

const INVALID_ARGUMENT: Status = 2;
const INSUFFICIENT_SIZE: Status = 7;
/// `NVML_ERROR_NOT_FOUND`: what utilization queries answer when there is no sample.
const NOT_FOUND: Status = 6;
/// Times the real function is asked again when processes appear between two calls.
const ATTEMPTS: usize = 4;
/// Most entries asked for: a count past it from the library below is not believed
/// (the buffer is the shim's, allocated in the host process).
const MAX_ENTRIES: usize = 1 << 16;

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ProcessV1 {
    pid: u32,
    used: u64,
}

/// `nvmlProcessInfo_t` (v2, and v3 in current headers).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ProcessV2 {
    pid: u32,
    used: u64,
    gpu_instance: u32,
    compute_instance: u32,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct UtilizationSample {
    pid: u32,
    time_stamp: u64,
    sm: u32,
    memory: u32,
    encoder: u32,
    decoder: u32,
}

/// `nvmlProcessUtilizationInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct UtilizationInfo {
    time_stamp: u64,
    pid: u32,
    sm: u32,
    memory: u32,
    encoder: u32,
    decoder: u32,
    jpeg: u32,
    ofa: u32,
}

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UtilizationList {
    version: u32,
    count: u32,
    last_seen: u64,
    entries: *mut UtilizationInfo,
}

/// An entry that names a process.
pub(crate) trait Entry: Copy + Default {
    fn pid(&self) -> u32;
    fn set_pid(&mut self, pid: u32);
}

macro_rules! entries {
    ($($t:ty),*) => {$(
        impl Entry for $t {
            fn pid(&self) -> u32 {
                self.pid
            }
            fn set_pid(&mut self, pid: u32) {
                self.pid = pid;
            }
        }
    )*};
}

entries!(ProcessV1, ProcessV2, UtilizationSample, UtilizationInfo);

/// The group's members the caller may see, or `None` when the shim does not enforce here.
fn visible() -> Option<Vec<(u32, u32)>> {
    enforcer_any().map(|e| e.ledger.member_pids())
}

/// The group's entries among `all`, each under the PID its group knows it by. NVML lists
/// processes by their PID in the outermost PID namespace (the driver knows no others), so
/// in a container a member is found by the PID the arbiter saw (`host`) and shown by its
/// own; a member whose outer PID is not known (no arbiter) is found by its own PID, which
/// is the same outside a container.
fn of_group<T: Entry>(all: Vec<T>, members: &[(u32, u32)]) -> Vec<T> {
    all.into_iter()
        .filter_map(|mut entry| {
            let listed = entry.pid();
            let (own, _) = members
                .iter()
                .find(|&&(own, host)| if host != 0 { host == listed } else { own == listed })?;
            entry.set_pid(*own);
            Some(entry)
        })
        .collect()
}

/// Asks `real` (count in/out, buffer) for every entry, growing the buffer until they fit.
fn everything<T: Entry>(
    first: usize,
    mut real: impl FnMut(*mut c_uint, *mut T) -> Status,
) -> (Status, Vec<T>) {
    let mut room = first.clamp(32, 4096);
    for _ in 0..ATTEMPTS {
        let mut buffer = vec![T::default(); room];
        let mut count = room as c_uint;
        let status = real(&mut count, buffer.as_mut_ptr());
        if status == INSUFFICIENT_SIZE && count as usize > room {
            // Room for processes that start before the next call, too.
            room = (count as usize).saturating_add(16).min(MAX_ENTRIES);
            continue;
        }
        buffer.truncate((count as usize).min(room));
        return (status, buffer);
    }
    (INSUFFICIENT_SIZE, Vec::new())
}

/// Answers the caller's `count`/`out` with the entries of the group's processes only.
fn answer<T: Entry>(count: *mut c_uint, out: *mut T, kept: &[T]) -> Status {
    // SAFETY: `count` is what the caller passed: null or a readable value of its type (the API's contract).
    let room = unsafe { read(count) }.unwrap_or(0) as usize;
    // SAFETY: `count` is the caller's out-pointer: null or writable for its type (the API's contract).
    unsafe { write(count, kept.len() as c_uint) };
    if kept.len() > room {
        return INSUFFICIENT_SIZE;
    }
    if kept.is_empty() {
        return SUCCESS;
    }
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    for (i, entry) in kept.iter().enumerate() {
        // SAFETY: `out` is non-null and holds `room` entries by NVML's contract;
        // i < kept.len() <= room.
        unsafe { out.add(i).write_unaligned(*entry) };
    }
    SUCCESS
}

/// The count-protocol queries: the group's entries of what `real` lists.
fn filtered<T: Entry>(
    count: *mut c_uint,
    out: *mut T,
    mut real: impl FnMut(*mut c_uint, *mut T) -> Status,
) -> Status {
    let Some(pids) = visible() else { return real(count, out) };
    // SAFETY: `count` is what the caller passed: null or a readable value of its type (the API's contract).
    let Some(room) = (unsafe { read(count) }) else { return real(count, out) };
    let (status, all) = everything(room as usize, &mut real);
    if status != SUCCESS {
        return status;
    }
    answer(count, out, &of_group(all, &pids))
}

macro_rules! process_lists {
    ($( $hook:ident => $real:ident : $entry:ty; )*) => {
        $(
            pub(crate) fn $hook(device: Ptr, count: *mut c_uint, infos: Ptr) -> Status {
                filtered(count, infos.cast::<$entry>(), |n, buffer: *mut $entry| {
                    call_real!($real(device, n, buffer.cast()))
                })
            }
        )*
    };
}

process_lists! {
    compute_v1 => nvmlDeviceGetComputeRunningProcesses: ProcessV1;
    compute_v2 => nvmlDeviceGetComputeRunningProcesses_v2: ProcessV2;
    compute_v3 => nvmlDeviceGetComputeRunningProcesses_v3: ProcessV2;
    graphics_v1 => nvmlDeviceGetGraphicsRunningProcesses: ProcessV1;
    graphics_v2 => nvmlDeviceGetGraphicsRunningProcesses_v2: ProcessV2;
    graphics_v3 => nvmlDeviceGetGraphicsRunningProcesses_v3: ProcessV2;
    mps_v1 => nvmlDeviceGetMPSComputeRunningProcesses: ProcessV1;
    mps_v2 => nvmlDeviceGetMPSComputeRunningProcesses_v2: ProcessV2;
    mps_v3 => nvmlDeviceGetMPSComputeRunningProcesses_v3: ProcessV2;
}

/// `nvmlDeviceGetProcessUtilization`: samples of the group's processes only; none of
/// them is `NVML_ERROR_NOT_FOUND`, as NVML answers when there is no sample at all (pynvml
/// takes a count of 0 with success for an error).
pub(crate) fn utilization(device: Ptr, samples: Ptr, count: *mut c_uint, last_seen: c_ulonglong) -> Status {
    let status = filtered(count, samples.cast::<UtilizationSample>(), |n, buffer: *mut UtilizationSample| {
        call_real!(nvmlDeviceGetProcessUtilization(device, buffer.cast(), n, last_seen))
    });
    // SAFETY: `count` is what the caller passed: null or a readable value of its type (the API's contract).
    none_is_not_found(status, unsafe { read(count) })
}

/// A utilization answer of no sample, as NVML gives it.
fn none_is_not_found(status: Status, count: Option<c_uint>) -> Status {
    if status == SUCCESS && count == Some(0) {
        NOT_FOUND
    } else {
        status
    }
}

/// `nvmlDeviceGetProcessesUtilizationInfo`: the same count protocol inside a versioned
/// struct, which the real function gets as a copy pointing at the shim's buffer.
pub(crate) fn utilization_info(device: Ptr, info: Ptr) -> Status {
    let list = info.cast::<UtilizationList>();
    let real = |l: *mut UtilizationList| call_real!(nvmlDeviceGetProcessesUtilizationInfo(device, l.cast()));
    // SAFETY: `list` is what the caller passed: null or a readable value of its type (the API's contract).
    let (Some(pids), Some(caller)) = (visible(), unsafe { read(list) }) else { return real(list) };
    let (status, all) = everything(caller.count as usize, |n, buffer| {
        // SAFETY: `n` is what the caller passed: null or a readable value of its type (the API's contract).
        let mut mine = UtilizationList { count: unsafe { read(n) }.unwrap_or(0), entries: buffer, ..caller };
        let status = real(&mut mine);
        // SAFETY: `n` is the caller's out-pointer: null or writable for its type (the API's contract).
        unsafe { write(n, mine.count) };
        status
    });
    if status != SUCCESS {
        return status;
    }
    let kept = of_group(all, &pids);
    let mut count = caller.count;
    let status = answer(&mut count, caller.entries, &kept);
    // SAFETY: `list` is the caller's out-pointer: null or writable for its type (the API's contract).
    unsafe { write(list, UtilizationList { count, ..caller }) };
    none_is_not_found(status, Some(count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(pids: &[u32]) -> Vec<ProcessV2> {
        pids.iter().map(|&pid| ProcessV2 { pid, used: u64::from(pid) << 20, ..Default::default() }).collect()
    }

    fn pids(entries: &[ProcessV2]) -> Vec<(u32, u64)> {
        entries.iter().map(|e| (e.pid, e.used)).collect()
    }

    #[test]
    fn outside_a_container_members_are_found_by_their_own_pid() {
        let kept = of_group(listed(&[100, 200, 300]), &[(100, 0), (300, 300)]);
        assert_eq!(pids(&kept), [(100, 100 << 20), (300, 300 << 20)]);
    }

    #[test]
    fn in_a_container_members_are_found_by_the_host_pid_and_shown_by_their_own() {
        // Host PIDs 5001 and 5002 are the container's 1 and 7; 9999 is another tenant's.
        let kept = of_group(listed(&[9999, 5001, 5002]), &[(1, 5001), (7, 5002)]);
        assert_eq!(pids(&kept), [(1, 5001 << 20), (7, 5002 << 20)]);
    }

    #[test]
    fn a_member_known_by_its_host_pid_is_not_matched_by_its_own() {
        // The container's PID 7 is some other process's PID on the host.
        let kept = of_group(listed(&[7]), &[(7, 5002)]);
        assert!(kept.is_empty());
    }
}
