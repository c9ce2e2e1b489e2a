//! The two ways programs find driver functions without linking them: `dlsym` on a
//! `dlopen`ed libcuda (cudarc, ctypes, frameworks) and `cuGetProcAddress` (the CUDA
//! runtime, PyTorch). Both answer with the hooks for hooked symbols, from the same list
//! as the exports.

use std::ffi::{c_char, c_int, c_ulonglong, c_void};

use gpufrac_common::cuda_procs::{resolve, ProcQuery};

use crate::ffi::{c_str, write, Status, SUCCESS};
use crate::hooks::{call_real, lookup};
use crate::real::real_dlsym;
use crate::state::enabled;

type Ptr = *mut c_void;

/// After the driver answered a lookup: hand out the hook instead, if the symbol the
/// driver resolved (by version and stream flavour) is hooked.
fn substitute(symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: c_ulonglong) {
    let Some(name) = c_str(symbol) else { return };
    if !enabled() {
        return;
    }
    if let ProcQuery::Found(exported) = resolve(name, version, flags) {
        if let Some(hook) = lookup(exported) {
            write(pfn, hook);
        }
    }
}

pub(crate) fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut Ptr,
    version: c_int,
    flags: c_ulonglong,
) -> Status {
    let status = call_real!(cuGetProcAddress(symbol, pfn, version, flags));
    if status == SUCCESS {
        substitute(symbol, pfn, version, flags);
    }
    status
}

pub(crate) fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut Ptr,
    version: c_int,
    flags: c_ulonglong,
    status_out: *mut c_int,
) -> Status {
    let status = call_real!(cuGetProcAddress_v2(symbol, pfn, version, flags, status_out));
    if status == SUCCESS {
        substitute(symbol, pfn, version, flags);
    }
    status
}

/// Our `dlsym`: hooked `cu*` and `nvml*` names get the hook, whatever the handle; every
/// other lookup goes to glibc's. Must never panic nor allocate for other names: it runs
/// for every symbol lookup in the process, the Rust runtime's included.
fn dlsym_hook(handle: Ptr, name: *const c_char) -> Ptr {
    let Some(real) = real_dlsym() else { return std::ptr::null_mut() };
    if !name.is_null() {
        // SAFETY: a non-null symbol name is a NUL-terminated string by dlsym's contract.
        let bytes = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
        if bytes.starts_with(b"cu") || bytes.starts_with(b"nvml") {
            let hooked = std::panic::catch_unwind(|| {
                std::str::from_utf8(bytes).ok().filter(|_| enabled()).and_then(lookup)
            });
            if let Ok(Some(hook)) = hooked {
                return hook;
            }
        }
    }
    // SAFETY: forwarding the caller's arguments to glibc's dlsym.
    unsafe { real(handle, name) }
}

// Export `dlsym` under both glibc versions: old binaries bind dlsym@GLIBC_2.2.5 (2.17 on
// aarch64), binaries built against glibc >= 2.34 bind dlsym@GLIBC_2.34. build.rs declares
// the versions in the linker's version script.
#[cfg(all(not(test), target_arch = "x86_64"))]
std::arch::global_asm!(
    ".symver gpufrac_dlsym_old, dlsym@GLIBC_2.2.5",
    ".symver gpufrac_dlsym_new, dlsym@@GLIBC_2.34"
);
#[cfg(all(not(test), target_arch = "aarch64"))]
std::arch::global_asm!(
    ".symver gpufrac_dlsym_old, dlsym@GLIBC_2.17",
    ".symver gpufrac_dlsym_new, dlsym@@GLIBC_2.34"
);

/// `dlsym@GLIBC_2.2.5` (x86_64) / `dlsym@GLIBC_2.17` (aarch64).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_dlsym_old(handle: Ptr, name: *const c_char) -> Ptr {
    dlsym_hook(handle, name)
}

/// `dlsym@GLIBC_2.34`.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_dlsym_new(handle: Ptr, name: *const c_char) -> Ptr {
    dlsym_hook(handle, name)
}
