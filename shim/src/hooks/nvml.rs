//! NVML's view of the device inside the container: memory info reports the group's
//! slice, so `nvidia-smi` and NVML-based tools show the limit as the device's size.
//! Works in processes that never call CUDA (the slice is found by the device's UUID).

use std::ffi::{c_char, c_void};

use crate::driver::ffi::{read, write, Status, SUCCESS};
use crate::driver::table::{call_real, parse_uuid};
use crate::enforcer::{enforcer_any, Enforcer, Slice};

/// The group's (limit, held) on the NVML device, given its physical `total`: the slice
/// `cuInit` set up, else one resolved here (of what the arbiter manages, if less).
fn slice_view(device: *mut c_void, total: u64) -> Option<(u64, u64)> {
    let e = enforcer_any()?;
    let mut name = [0 as c_char; 96];
    if call_real!(nvmlDeviceGetUUID(device, name.as_mut_ptr(), name.len() as u32)) != SUCCESS {
        return None;
    }
    // SAFETY: `name.as_ptr()` is the caller's C string: null or NUL-terminated, alive for this call (the API's contract).
    let text = unsafe { crate::driver::ffi::c_str(name.as_ptr()) }?;
    let uuid = parse_uuid(text)?;
    let slice = slice_for_nvml(e, &uuid, total).ok()?;
    e.pools.reconcile(e, Some(slice.ledger), false);
    Some((slice.limit, e.ledger.held(slice.ledger)))
}

/// The group's share of NVML's device `uuid` of `total` bytes: the slice set up at
/// `cuInit`, else one of what the arbiter manages of it (or of all of it).
fn slice_for_nvml(e: &Enforcer, uuid: &[u8; 16], total: u64) -> Result<Slice, String> {
    if let Some(slice) = e.slice_by_uuid(uuid) {
        return Ok(slice);
    }
    match managed_for_nvml(e, uuid, total) {
        Some(managed) => e.slice_for(None, uuid, managed, true),
        None => e.slice_for(None, uuid, total, false),
    }
}

/// What the arbiter manages of device `uuid` when that is less than its `total`, for
/// NVML's view in a process that has not set its devices up at `cuInit` (asked once).
fn managed_for_nvml(e: &Enforcer, uuid: &[u8; 16], total: u64) -> Option<u64> {
    static MANAGED: std::sync::OnceLock<std::collections::HashMap<[u8; 16], u64>> =
        std::sync::OnceLock::new();
    let socket = e.config.arbiter_socket.as_ref()?;
    let managed = MANAGED.get_or_init(|| crate::control::arbiter::managed_sizes(socket, e.hello()));
    managed.get(uuid).copied().filter(|&managed| managed < total)
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

pub(crate) fn memory_info(device: *mut c_void, memory: *mut c_void) -> Status {
    let status = call_real!(nvmlDeviceGetMemoryInfo(device, memory));
    if status == SUCCESS {
        let out = memory.cast::<Memory>();
        // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
        if let Some(m) = unsafe { read(out) } {
            if let Some((limit, held)) = slice_view(device, m.total) {
                // SAFETY: `out` is the caller's out-pointer: null or writable for its type (the API's contract).
                unsafe { write(out, Memory { total: limit, free: limit.saturating_sub(held), used: held }) };
            }
        }
    }
    status
}

pub(crate) fn memory_info_v2(device: *mut c_void, memory: *mut c_void) -> Status {
    let status = call_real!(nvmlDeviceGetMemoryInfo_v2(device, memory));
    if status == SUCCESS {
        let out = memory.cast::<MemoryV2>();
        // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
        if let Some(m) = unsafe { read(out) } {
            if let Some((limit, held)) = slice_view(device, m.total) {
                let free = limit.saturating_sub(held);
                // SAFETY: `out` is the caller's out-pointer: null or writable for its type (the API's contract).
                unsafe { write(out, MemoryV2 { total: limit, reserved: 0, free, used: held, ..m }) };
            }
        }
    }
    status
}
