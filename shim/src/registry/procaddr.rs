//! The two ways programs find driver functions without linking them: `dlsym` on a
//! `dlopen`ed libcuda (cudarc, ctypes, frameworks; `libgpufrac.so` exports `dlsym` and
//! asks [`gpufrac_core_lookup`]) and `cuGetProcAddress` (the CUDA runtime, PyTorch). Both
//! answer with the hooks for hooked symbols, from the same list as the exports. Also the
//! handshake with `libgpufrac.so`, [`gpufrac_core_attach`].

use std::ffi::{c_char, c_int, c_ulonglong, c_void};
use std::panic::catch_unwind;

use gpufrac_common::cuda_procs::{resolve, ProcQuery};

use crate::driver::ffi::{c_str, write, Status, SUCCESS};
use crate::driver::library::{set_real_dlsym, DlsymFn};
use crate::driver::table::{call_real, HOOK_COUNT};
use crate::enforcer::enabled;
use crate::registry::exports::{lookup, table, FINGERPRINT};

type Ptr = *mut c_void;

/// After the driver answered a lookup: hand out the hook instead, if the symbol the
/// driver resolved (by version and stream flavour) is hooked.
fn substitute(symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: c_ulonglong) {
    // SAFETY: `symbol` is the caller's C string: null or NUL-terminated, alive for this call (the API's contract).
    let Some(name) = (unsafe { c_str(symbol) }) else { return };
    if !enabled() {
        return;
    }
    if let ProcQuery::Found(exported) = resolve(name, version, flags) {
        if let Some(hook) = lookup(exported) {
            // SAFETY: `pfn` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(pfn, hook) };
            return;
        }
    }
    // In a parkable process, what the shim does not hook waits for the wake while the
    // driver holds the process for a checkpoint park (thunks.rs).
    if name.starts_with("cu")
        && crate::enforcer::enforcer_any().is_some_and(|e| e.config.park_after.is_some())
    {
        // SAFETY: `pfn` is the caller's out-pointer, which the driver just filled.
        let real = unsafe { crate::driver::ffi::read(pfn) };
        if let Some(thunk) = real.and_then(crate::control::thunks::thunk_for) {
            // SAFETY: `pfn` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(pfn, thunk) };
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

/// What `libgpufrac.so`'s `dlsym` hands out for a hooked `cu*` or `nvml*` name: the hook,
/// null when the shim passes through in this process (then glibc answers), or
/// `LOOKUP_FAILED` if the shim failed (then `libgpufrac.so` answers with its own entry
/// point, which fails closed). Never panics and allocates nothing.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_core_lookup(name: *const c_char) -> Ptr {
    // SAFETY: `name` is the caller's C string: null or NUL-terminated, alive for this call (the API's contract).
    let Some(name) = (unsafe { c_str(name) }) else { return std::ptr::null_mut() };
    match catch_unwind(|| if enabled() { lookup(name) } else { None }) {
        Ok(hook) => hook.unwrap_or(std::ptr::null_mut()),
        Err(_) => crate::driver::hook_list::LOOKUP_FAILED as Ptr,
    }
}

/// Called by `libgpufrac.so` once, when it loads this library at the process's first CUDA
/// or NVML call: fills its `len` entry points (`slots`) with the hooks, in the order of
/// the shared list, and hands over glibc's `dlsym`. Returns 0, or -1 (nothing written) when the two libraries were not
/// built from the same list.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpufrac_core_attach(
    fingerprint: u64,
    dlsym: Option<DlsymFn>,
    slots: *mut Ptr,
    len: usize,
) -> c_int {
    let Some(dlsym) = dlsym else { return -1 };
    if fingerprint != FINGERPRINT || len != HOOK_COUNT || slots.is_null() {
        return -1;
    }
    set_real_dlsym(dlsym);
    let table = table();
    // SAFETY: the caller passes `len` writable pointers, and len is the table's length.
    unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), slots, len) };
    0
}
