//! Memory the driver takes on its own for a call, which no size argument states: a
//! context's device heap, stack and printf FIFO (`cuCtxSetLimit`), a module's or
//! library's code and globals (`cuModuleLoad*`, `cuLibraryLoad*`). Charged the way
//! contexts are: an estimate before the call, then the process's own usage as NVML
//! reports it around the call, the charge corrected to it; a call whose memory does not
//! fit is undone and refused with `CUDA_ERROR_OUT_OF_MEMORY`. Without a clean
//! measurement (NVML does not list the process) the estimate stands, and the backstop
//! (the device's own count) catches what it missed.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::books::records::{Context, Path, Record};
use crate::driver::ffi::{read, Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::usage::{signed_delta, usage};
use crate::enforcer::{enforcer, refused, Current, Enforcer};

type Ptr = *mut c_void;

/// What a call did to the process's device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// It took this many bytes, now charged to the group.
    Took(u64),
    /// It gave this many back (nothing is charged for the call).
    Gave(u64),
}

/// Charges `estimate` on the current context's device, makes the call, measures it and
/// corrects the charge; `undo` reverses a call whose memory does not fit.
fn measured_call(
    e: &Enforcer,
    cur: Current,
    estimate: u64,
    what: &str,
    call: impl FnMut() -> Status,
    undo: impl FnOnce(),
) -> Result<Change, Status> {
    // One measurement at a time, and none while a context is being created (it would
    // read the other's memory as its own).
    e.backstop.look(e, cur.ordinal, crate::enforcer::backstop::PERIOD);
    let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
    let Some(slice) = e.slice(cur.ordinal) else { return Err(crate::driver::ffi::INVALID_VALUE) };
    let dev = slice.ledger;
    if let Err(status) = e.charge(cur.ordinal, estimate) {
        tracing::warn!(
            ordinal = cur.ordinal,
            bytes = estimate,
            limit = slice.limit,
            "gpufrac: out of memory: refused {what}: its {estimate} bytes were not available under GPUFRAC_MEMORY_LIMIT"
        );
        return Err(status);
    }
    let before = usage(e, cur.ordinal, dev);
    let status = e.physical(call);
    if status != SUCCESS {
        e.release(dev, estimate);
        return Err(status);
    }
    let measured = before.and_then(|before| signed_delta(before, usage(e, cur.ordinal, dev)?));
    let Some(delta) = measured else { return Ok(Change::Took(estimate)) };
    if delta < 0 {
        e.release(dev, estimate);
        return Ok(Change::Gave(delta.unsigned_abs().min(u128::from(u64::MAX)) as u64));
    }
    let took = delta.min(i128::from(u64::MAX)) as u64;
    if took > estimate {
        if e.charge(cur.ordinal, took - estimate).is_err() {
            undo();
            e.release(dev, estimate);
            tracing::warn!(
                ordinal = cur.ordinal,
                bytes = took,
                held = e.ledger.held_fast(dev),
                limit = slice.limit,
                "gpufrac: out of memory: {what} took {took} bytes, more than GPUFRAC_MEMORY_LIMIT leaves: undone and refused"
            );
            return Err(OUT_OF_MEMORY);
        }
    } else {
        e.release(dev, estimate - took);
    }
    Ok(Change::Took(took))
}

/// `CUlimit` values whose size is device memory of the context.
const LIMIT_STACK_SIZE: c_int = 0;
const LIMIT_PRINTF_FIFO_SIZE: c_int = 1;
const LIMIT_MALLOC_HEAP_SIZE: c_int = 2;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT` and `..._MAX_THREADS_PER_MULTIPROCESSOR`.
const ATTR_MULTIPROCESSORS: c_int = 16;
const ATTR_THREADS_PER_MULTIPROCESSOR: c_int = 39;

/// Threads the device holds at once: each has its own stack, so a stack limit takes
/// the per-thread size this many times.
fn resident_threads(ordinal: usize) -> u64 {
    let (mut sms, mut threads) = (0, 0);
    let ok = call_real!(cuDeviceGetAttribute(&mut sms, ATTR_MULTIPROCESSORS, ordinal as c_int)) == SUCCESS
        && call_real!(cuDeviceGetAttribute(&mut threads, ATTR_THREADS_PER_MULTIPROCESSOR, ordinal as c_int))
            == SUCCESS;
    if ok {
        u64::try_from(sms).unwrap_or(0).saturating_mul(u64::try_from(threads).unwrap_or(0))
    } else {
        0
    }
}

/// `cuCtxSetLimit`: the heap, stack and printf FIFO are the context's device memory,
/// charged to it (given back with it), refused when they do not fit.
pub(crate) fn ctx_set_limit(limit: c_int, value: usize) -> Status {
    let real = || call_real!(cuCtxSetLimit(limit, value));
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    if !matches!(limit, LIMIT_STACK_SIZE | LIMIT_PRINTF_FIFO_SIZE | LIMIT_MALLOC_HEAP_SIZE) {
        return real();
    }
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(cur) = e.current() else { return e.untracked(real) };
    let mut old = 0usize;
    let known = call_real!(cuCtxGetLimit(&mut old, limit)) == SUCCESS;
    let grown = (value as u64).saturating_sub(old as u64);
    let estimate = match limit {
        LIMIT_STACK_SIZE => grown.saturating_mul(resident_threads(cur.ordinal)),
        _ => grown,
    };
    let what = match limit {
        LIMIT_STACK_SIZE => "a larger stack (cuCtxSetLimit CU_LIMIT_STACK_SIZE)",
        LIMIT_PRINTF_FIFO_SIZE => "a larger printf FIFO (cuCtxSetLimit CU_LIMIT_PRINTF_FIFO_SIZE)",
        _ => "a larger device heap (cuCtxSetLimit CU_LIMIT_MALLOC_HEAP_SIZE)",
    };
    let undo = || {
        if known {
            let _ = call_real!(cuCtxSetLimit(limit, old));
        }
    };
    match measured_call(e, cur, estimate, what, real, undo) {
        Ok(Change::Took(bytes)) => {
            e.contexts.add_charge(cur.id, bytes);
            SUCCESS
        }
        Ok(Change::Gave(bytes)) => {
            let taken = e.contexts.take_charge(cur.id, bytes);
            if let Some(slice) = e.slice(cur.ordinal) {
                e.release(slice.ledger, taken);
            }
            SUCCESS
        }
        Err(status) => status,
    }
}

/// The last clean measurement of a module load in this process: the next load's estimate.
static LAST_MODULE: AtomicU64 = AtomicU64::new(0);

/// A module or library load: `real` loads it into `*out`, `unload` undoes it.
fn load(out: *mut Ptr, what: &str, real: impl FnMut() -> Status, unload: impl Fn(Ptr) -> Status) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    // No context current: a library loaded context-independently takes its memory in
    // each context when first used there, where no hook sees it; the backstop does.
    let Some(cur) = e.current() else { return e.untracked(real) };
    let estimate = LAST_MODULE.load(Ordering::Relaxed);
    let undo = || {
        // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
        if let Some(handle) = unsafe { read(out) } {
            let _ = unload(handle);
        }
    };
    let bytes = match measured_call(e, cur, estimate, what, real, undo) {
        Ok(Change::Took(bytes)) => bytes,
        Ok(Change::Gave(_)) => 0,
        Err(status) => return status,
    };
    LAST_MODULE.store(bytes, Ordering::Relaxed);
    let Some(slice) = e.slice(cur.ordinal) else { return SUCCESS };
    // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
    match unsafe { read(out) } {
        Some(handle) => {
            let record = Record {
                bytes,
                device: slice.ledger,
                context: Context::Tracked(cur.id),
                path: Path::Module,
                above_request: false,
            };
            e.modules.insert(handle as u64, record);
        }
        None => e.release(slice.ledger, bytes),
    }
    tracing::debug!(ordinal = cur.ordinal, bytes, "{what}");
    SUCCESS
}

/// An unload: the module's charge goes back once the driver has unloaded it.
fn unload(handle: Ptr, real: impl FnOnce() -> Status) -> Status {
    let Some(e) = enforcer() else { return real() };
    let record = e.modules.remove(handle as u64);
    let status = real();
    if let Some(r) = record {
        if status == SUCCESS {
            e.release(r.device, r.bytes);
        } else {
            e.modules.insert(handle as u64, r);
        }
    }
    status
}

pub(crate) fn module_load(module: *mut Ptr, path: *const c_char) -> Status {
    load(
        module,
        "a module load",
        || call_real!(cuModuleLoad(module, path)),
        |m| call_real!(cuModuleUnload(m)),
    )
}

pub(crate) fn module_load_data(module: *mut Ptr, image: *const c_void) -> Status {
    load(
        module,
        "a module load",
        || call_real!(cuModuleLoadData(module, image)),
        |m| call_real!(cuModuleUnload(m)),
    )
}

pub(crate) fn module_load_data_ex(
    module: *mut Ptr,
    image: *const c_void,
    count: c_uint,
    options: *mut c_int,
    values: *mut Ptr,
) -> Status {
    load(
        module,
        "a module load",
        || call_real!(cuModuleLoadDataEx(module, image, count, options, values)),
        |m| call_real!(cuModuleUnload(m)),
    )
}

pub(crate) fn module_load_fat_binary(module: *mut Ptr, image: *const c_void) -> Status {
    load(
        module,
        "a module load",
        || call_real!(cuModuleLoadFatBinary(module, image)),
        |m| call_real!(cuModuleUnload(m)),
    )
}

pub(crate) fn module_unload(module: Ptr) -> Status {
    unload(module, || call_real!(cuModuleUnload(module)))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn library_load_data(
    library: *mut Ptr,
    code: *const c_void,
    jit_options: *mut c_int,
    jit_values: *mut Ptr,
    jit_count: c_uint,
    options: *mut c_int,
    values: *mut Ptr,
    count: c_uint,
) -> Status {
    load(
        library,
        "a library load",
        || {
            call_real!(cuLibraryLoadData(
                library,
                code,
                jit_options,
                jit_values,
                jit_count,
                options,
                values,
                count
            ))
        },
        |l| call_real!(cuLibraryUnload(l)),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn library_load_from_file(
    library: *mut Ptr,
    path: *const c_char,
    jit_options: *mut c_int,
    jit_values: *mut Ptr,
    jit_count: c_uint,
    options: *mut c_int,
    values: *mut Ptr,
    count: c_uint,
) -> Status {
    load(
        library,
        "a library load",
        || {
            call_real!(cuLibraryLoadFromFile(
                library,
                path,
                jit_options,
                jit_values,
                jit_count,
                options,
                values,
                count
            ))
        },
        |l| call_real!(cuLibraryUnload(l)),
    )
}

pub(crate) fn library_unload(library: Ptr) -> Status {
    unload(library, || call_real!(cuLibraryUnload(library)))
}
