//! The boundary with C callers: panic containment, result codes, and the checked reads
//! and writes through the pointers callers hand us.

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(crate) use cudarc::driver::sys::CUresult;

/// What every implementation returns; the error is the CUDA result code to hand back.
pub(crate) type CuResult<T = ()> = Result<T, CUresult>;

/// Runs one export's body, turning its result or a panic into a CUDA result code:
/// a driver must never unwind into its caller. It is also the checkpoint gate: the call
/// counts as in flight, and while the process is locked or checkpointed (see
/// `checkpoint`) it waits here until it is unlocked.
pub(crate) fn guard(body: impl FnOnce() -> CuResult) -> CUresult {
    let _in_flight = crate::checkpoint::Gate::enter();
    contain(body)
}

/// Runs a body like [`guard`] but outside the checkpoint gate: for the checkpoint API
/// itself, which acts on (possibly) other processes and must not wait for its own.
pub(crate) fn contain(body: impl FnOnce() -> CuResult) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUresult::CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `value` through an out-pointer supplied by the caller.
pub(crate) fn write_out<T>(out: *mut T, value: T) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the CUDA API contract makes the caller pass a pointer to
    // writable storage of type T; unaligned callers are tolerated.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Reads a `T` the caller passed by pointer.
pub(crate) fn read_in<T: Copy>(ptr: *const T) -> CuResult<T> {
    if ptr.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and by the API contract it points to a readable T. Callers only
    // use this for plain-data mirrors whose every bit pattern is valid.
    Ok(unsafe { ptr.read_unaligned() })
}

/// Reads a NUL-terminated name passed by the caller.
pub(crate) fn read_str<'a>(ptr: *const c_char) -> CuResult<&'a str> {
    if ptr.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and by the API contract a NUL-terminated string that outlives
    // the call.
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str().map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// Copies `text` into a caller's buffer of `len` bytes, NUL-terminated, truncating.
pub(crate) fn write_c_string(buf: *mut c_char, len: i32, text: &str) -> CuResult {
    if buf.is_null() || len <= 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: the caller provides `len` writable bytes; we write n + 1 <= len of them.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        buf.add(n).write(0);
    }
    Ok(())
}

/// A fresh opaque handle for an object callers never dereference (modules, arrays):
/// distinct, non-null, aligned and never reused within the process.
pub(crate) fn new_handle() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x5000_0000);
    NEXT.fetch_add(16, Ordering::Relaxed)
}
