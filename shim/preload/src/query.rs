//! The functions of `gpufrac.h`. They never load the core: before any CUDA or NVML call
//! went through this library there is no slice to report, and the answers are the
//! "not enforcing" ones (0, or -1 for `gpufrac_device_info`). Once the core is loaded they
//! are its answers.

use std::ffi::{c_int, c_void, CStr};

use crate::core::loaded;
use crate::dlsym::real_dlsym;

/// The core's function `name`, if the core is loaded and has it.
fn in_core(name: &CStr) -> Option<*mut c_void> {
    let (core, dlsym) = (loaded()?, real_dlsym()?);
    // SAFETY: glibc's dlsym on the core's handle with a NUL-terminated name.
    let f = unsafe { dlsym(core, name.as_ptr()) };
    (!f.is_null()).then_some(f)
}

macro_rules! forward {
    ($(#[$doc:meta] fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $default:expr;)*) => {$(
        #[$doc]
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> $ret {
            match in_core(c_name!($name)) {
                // SAFETY: the core's function of this name has this signature
                // (both follow gpufrac.h).
                Some(f) => unsafe { std::mem::transmute::<*mut c_void, extern "C" fn($($ty),*) -> $ret>(f)($($arg),*) },
                None => $default,
            }
        }
    )*};
}

macro_rules! c_name {
    ($name:ident) => {
        match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
            Ok(name) => name,
            Err(_) => c"",
        }
    };
}

/// The shim's version as `major * 10000 + minor * 100 + patch`.
#[no_mangle]
pub extern "C" fn gpufrac_version() -> u32 {
    const fn number(s: &str) -> u32 {
        let (bytes, mut i, mut n) = (s.as_bytes(), 0, 0);
        while i < bytes.len() {
            n = n * 10 + (bytes[i] - b'0') as u32;
            i += 1;
        }
        n
    }
    const VERSION: u32 = number(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + number(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + number(env!("CARGO_PKG_VERSION_PATCH"));
    VERSION
}

/// `struct gpufrac_device_info` of `gpufrac.h`, filled by the core.
#[repr(C)]
pub struct DeviceInfo {
    request: u64,
    limit: u64,
    held: u64,
    held_by_process: u64,
    total: u64,
}

forward! {
    /// 1 if the shim enforces a slice in this process (after `cuInit`), else 0.
    fn gpufrac_enabled() -> c_int = 0;
    /// Devices the shim enforces on; 0 before `cuInit` or without enforcement.
    fn gpufrac_device_count() -> c_int = 0;
    /// Fills `out` for CUDA device `device`; 0 on success, -1 otherwise.
    fn gpufrac_device_info(device: c_int, out: *mut DeviceInfo) -> c_int = -1;
    /// The group's request on `device` in bytes (0 if unknown).
    fn gpufrac_request(device: c_int) -> u64 = 0;
    /// The group's limit on `device` in bytes (0 if unknown).
    fn gpufrac_limit(device: c_int) -> u64 = 0;
    /// What the group holds on `device` in bytes (0 if unknown).
    fn gpufrac_held(device: c_int) -> u64 = 0;
}

/// Registers `release(data)`, called on a thread of the shim's when the process gives back
/// memory it keeps and does not use; 0, or -1 (a null function, a full table, no core).
/// Loads the core: a program that registers one uses the GPU.
#[no_mangle]
pub extern "C" fn gpufrac_on_give_back(
    release: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> c_int {
    crate::core::attach();
    match in_core(c"gpufrac_on_give_back") {
        // SAFETY: the core's function of this name has this signature (gpufrac.h).
        Some(f) => unsafe {
            std::mem::transmute::<
                *mut c_void,
                extern "C" fn(Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) -> c_int,
            >(f)(release, data)
        },
        None => -1,
    }
}
