//! The C functions of `include/gpufrac.h`, for programs that want to ask the shim what
//! their slice is. They never fail the caller: without the shim's enforcement, or for an
//! unknown device, they answer 0 / -1.

use std::ffi::c_int;
use std::panic::catch_unwind;

use crate::enforcer::enforcer;

/// `struct gpufrac_device_info` of `gpufrac.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GpufracDeviceInfo {
    /// Guaranteed bytes of the group on the device.
    pub request: u64,
    /// Most bytes the group may hold.
    pub limit: u64,
    /// Bytes the group holds now (all its processes).
    pub held: u64,
    /// Bytes this process holds now.
    pub held_by_process: u64,
    /// The device's physical memory.
    pub total: u64,
}

fn info(device: c_int) -> Option<GpufracDeviceInfo> {
    let e = enforcer()?;
    let slice = e.slice(usize::try_from(device).ok()?)?;
    Some(GpufracDeviceInfo {
        request: slice.request,
        limit: slice.limit,
        held: e.ledger.held(slice.ledger),
        held_by_process: e.ledger.held_by_me(slice.ledger),
        total: slice.total,
    })
}

fn safely<T>(default: T, f: impl FnOnce() -> Option<T>) -> T {
    catch_unwind(std::panic::AssertUnwindSafe(f)).ok().flatten().unwrap_or(default)
}

/// The shim's version as `major * 10000 + minor * 100 + patch`.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_version() -> u32 {
    let part = |s: &str| s.parse::<u32>().unwrap_or(0);
    part(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + part(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + part(env!("CARGO_PKG_VERSION_PATCH"))
}

/// 1 if the shim enforces a request and limit in this process (after `cuInit`), else 0.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_enabled() -> c_int {
    safely(0, || enforcer().map(|_| 1))
}

/// Devices the shim enforces on (0 before `cuInit` or without enforcement).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_device_count() -> c_int {
    safely(0, || {
        let e = enforcer()?;
        match e.devices.get() {
            Some(Ok(slices)) => Some(slices.len() as c_int),
            _ => None,
        }
    })
}

/// Fills `out` for CUDA device `device`; 0 on success, -1 otherwise.
///
/// # Safety
/// `out` is null or points to a writable `GpufracDeviceInfo` (gpufrac.h).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn gpufrac_device_info(device: c_int, out: *mut GpufracDeviceInfo) -> c_int {
    safely(-1, || {
        let i = info(device)?;
        // SAFETY: `out` is the caller's out-pointer: null or writable for its type (the API's contract).
        (!out.is_null()).then(|| unsafe { crate::driver::ffi::write(out, i) }).map(|_| 0)
    })
}

/// The group's request on `device` in bytes (0 if unknown).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_request(device: c_int) -> u64 {
    safely(0, || info(device).map(|i| i.request))
}

/// The group's limit on `device` in bytes (0 if unknown).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_limit(device: c_int) -> u64 {
    safely(0, || info(device).map(|i| i.limit))
}

/// What the group holds on `device` in bytes (0 if unknown).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_held(device: c_int) -> u64 {
    safely(0, || info(device).map(|i| i.held))
}
