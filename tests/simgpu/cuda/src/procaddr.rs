//! `cuGetProcAddress` and the error-name functions.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

use gpufrac_common::cuda_procs::{resolve, ProcQuery};

use crate::exports::lookup;
use crate::ffi::{read_str, write_out, CUresult, CuResult};

/// `CUdriverProcAddressQueryResult` values.
const PROC_SUCCESS: c_int = 0;
const PROC_SYMBOL_NOT_FOUND: c_int = 1;
const PROC_VERSION_NOT_SUFFICIENT: c_int = 2;

/// Answers for every exported function, by base name, honouring the requested CUDA
/// version and the per-thread default stream flag. Works before `cuInit`, as the CUDA
/// runtime calls it first.
pub(crate) fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CuResult {
    let name = read_str(symbol)?;
    if pfn.is_null() || flags > 2 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (found, code) = match resolve(name, version, flags) {
        ProcQuery::Found(exported) => (lookup(exported), PROC_SYMBOL_NOT_FOUND),
        ProcQuery::VersionNotSufficient => (None, PROC_VERSION_NOT_SUFFICIENT),
        // Not in the versioned table: entry points simgpu exports by their plain name.
        ProcQuery::SymbolNotFound => (lookup(name), PROC_SYMBOL_NOT_FOUND),
    };
    write_out(pfn, found.unwrap_or(std::ptr::null_mut()))?;
    if !status.is_null() {
        write_out(status, if found.is_some() { PROC_SUCCESS } else { code })?;
    }
    found.map(|_| ()).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)
}

/// (code, name, description) of the results simgpu returns and common ones callers print.
static ERRORS: &[(c_uint, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (100, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (200, c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (400, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (700, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (719, c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

fn lookup_error(
    code: c_uint,
) -> CuResult<&'static (c_uint, &'static std::ffi::CStr, &'static std::ffi::CStr)> {
    ERRORS.iter().find(|(c, ..)| *c == code).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

pub(crate) fn error_name(code: c_uint, out: *mut *const c_char) -> CuResult {
    let found = lookup_error(code);
    write_out(out, found.map_or(std::ptr::null(), |e| e.1.as_ptr()))?;
    found.map(|_| ())
}

pub(crate) fn error_string(code: c_uint, out: *mut *const c_char) -> CuResult {
    let found = lookup_error(code);
    write_out(out, found.map_or(std::ptr::null(), |e| e.2.as_ptr()))?;
    found.map(|_| ())
}
