//! The boundary with the host program: status codes, panic containment, checked pointer
//! access. Statuses stay plain integers: a real driver may return codes this build does
//! not know, and those must pass through untouched.

use std::ffi::{c_char, c_uint, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::driver::library::Lib;

/// A `CUresult` or `nvmlReturn_t`, as an integer.
pub type Status = c_uint;
/// A device address.
pub type CUdeviceptr = u64;

pub(crate) const SUCCESS: Status = 0;
pub(crate) const INVALID_VALUE: Status = 1;
pub(crate) const OUT_OF_MEMORY: Status = 2;
pub(crate) const NOT_INITIALIZED: Status = 3;
/// `CUDA_ERROR_NOT_SUPPORTED`: also what a hook answers when the real driver lacks the
/// function.
pub(crate) const NOT_SUPPORTED: Status = 801;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture ended all the same, with no graph.
pub(crate) const CAPTURE_INVALIDATED: Status = 901;
/// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`: as above.
pub(crate) const CAPTURE_UNJOINED: Status = 904;
/// `CUDA_ERROR_UNKNOWN` and `NVML_ERROR_UNKNOWN` alike: what a hook answers if the shim
/// itself failed.
pub(crate) const UNKNOWN: Status = 999;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`: a hook's answer when the real NVML lacks the function.
pub(crate) const NVML_FUNCTION_NOT_FOUND: Status = 13;

/// Runs a hook's body; a panic becomes the library's "unknown error" (999 in both CUDA
/// and NVML) instead of unwinding into the host program.
#[inline]
pub(crate) fn guard(lib: Lib, body: impl FnOnce() -> Status) -> Status {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| lib.panicked())
}

/// Reads a value the caller passed by pointer, if the pointer is not null.
///
/// # Safety
/// `ptr` is null or points to a readable `T` (unaligned is fine), and `T` is plain data
/// whose every bit pattern is valid: the mirrors of the C API's structs and integers.
pub(crate) unsafe fn read<T: Copy>(ptr: *const T) -> Option<T> {
    // SAFETY: non-null here, readable by this function's contract.
    (!ptr.is_null()).then(|| unsafe { ptr.read_unaligned() })
}

/// Writes through an out-pointer the caller passed, if it is not null.
///
/// # Safety
/// `ptr` is null or points to storage writable for a `T` (unaligned is fine).
pub(crate) unsafe fn write<T>(ptr: *mut T, value: T) {
    if !ptr.is_null() {
        // SAFETY: non-null here, writable by this function's contract.
        unsafe { ptr.write_unaligned(value) };
    }
}

/// A C string argument as UTF-8, if it is one.
///
/// # Safety
/// `ptr` is null or a NUL-terminated string that stays alive and unchanged for `'a`
/// (callers keep the result within the hook call that received the pointer).
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char) -> Option<&'a str> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null here, NUL-terminated and alive for 'a by this function's contract.
    unsafe { CStr::from_ptr(ptr) }.to_str().ok()
}
