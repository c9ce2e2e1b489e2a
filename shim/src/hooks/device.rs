//! The virtual device: the group's limit is the device's size, and what the group holds
//! is what is used. `free = limit - held`, never below zero.

use std::ffi::{c_int, c_uint};

use crate::driver::ffi::{write, Status, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::enforcer;

pub(crate) fn mem_get_info(free: *mut usize, total: *mut usize) -> Status {
    let status = call_real!(cuMemGetInfo_v2(free, total));
    if status != SUCCESS {
        return status;
    }
    if let Some(e) = enforcer() {
        if let Some(slice) = e.current().and_then(|c| e.slice(c.ordinal)) {
            // What the pools gave back at a synchronize is free again.
            e.pools.reconcile(e, Some(slice.ledger), false);
            let held = e.ledger.held(slice.ledger);
            // SAFETY: `total` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(total, slice.limit as usize) };
            // SAFETY: `free` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(free, slice.limit.saturating_sub(held) as usize) };
        }
    }
    status
}

pub(crate) fn device_total_mem(bytes: *mut usize, dev: c_int) -> Status {
    let status = call_real!(cuDeviceTotalMem_v2(bytes, dev));
    if let (SUCCESS, Some(e)) = (status, enforcer()) {
        if let Some(slice) = usize::try_from(dev).ok().and_then(|d| e.slice(d)) {
            // SAFETY: `bytes` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(bytes, slice.limit as usize) };
        }
    }
    status
}

/// The pre-3.2 `cuMemGetInfo` (32-bit sizes): the same view, each figure clamped to 32
/// bits as the driver clamps it.
pub(crate) fn mem_get_info_v1(free: *mut c_uint, total: *mut c_uint) -> Status {
    let (mut wide_free, mut wide_total) = (0usize, 0usize);
    let status = mem_get_info(&mut wide_free, &mut wide_total);
    if status == SUCCESS {
        // SAFETY: `free` is the caller's out-pointer: null or writable for its type (the API's contract).
        unsafe { write(free, wide_free.min(c_uint::MAX as usize) as c_uint) };
        // SAFETY: `total` is the caller's out-pointer: null or writable for its type (the API's contract).
        unsafe { write(total, wide_total.min(c_uint::MAX as usize) as c_uint) };
    }
    status
}

/// The pre-3.2 `cuDeviceTotalMem` (a 32-bit size).
pub(crate) fn device_total_mem_v1(bytes: *mut c_uint, dev: c_int) -> Status {
    let mut wide = 0usize;
    let status = device_total_mem(&mut wide, dev);
    if status == SUCCESS {
        // SAFETY: `bytes` is the caller's out-pointer: null or writable for its type (the API's contract).
        unsafe { write(bytes, wide.min(c_uint::MAX as usize) as c_uint) };
    }
    status
}
