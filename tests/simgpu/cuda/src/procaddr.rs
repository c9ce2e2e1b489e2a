//! `cuGetProcAddress` and the error-name functions.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

use gpufrac_common::cuda_procs::{resolve, ProcQuery, FLAG_PER_THREAD_DEFAULT_STREAM};

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
    let query = match resolve(name, version, flags) {
        ProcQuery::SymbolNotFound => resolve_simgpu(name, version, flags),
        known => known,
    };
    let (found, code) = match query {
        ProcQuery::Found(exported) => (lookup(exported), PROC_SYMBOL_NOT_FOUND),
        ProcQuery::VersionNotSufficient => (None, PROC_VERSION_NOT_SUFFICIENT),
        // In neither versioned table: entry points simgpu exports by their plain name.
        ProcQuery::SymbolNotFound => (lookup(name), PROC_SYMBOL_NOT_FOUND),
    };
    write_out(pfn, found.unwrap_or(std::ptr::null_mut()))?;
    if !status.is_null() {
        write_out(status, if found.is_some() { PROC_SUCCESS } else { code })?;
    }
    found.map(|_| ()).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)
}

/// One version of an entry point gpufrac's shared table (`gpufrac_common::cuda_procs`)
/// does not list: (first CUDA version, symbol, its per-thread-default-stream variant).
type Version = (c_int, &'static str, Option<&'static str>);

/// Entry points simgpu implements beyond the shared table, whose versions change their
/// arguments, so that a caller asking by base name gets the ABI of the CUDA version it
/// was built for (versions and variants of `cudaTypedefs.h`).
static SIMGPU_PROCS: &[(&str, &[Version])] = &[
    ("cuPointerGetAttributes", &[(7000, "cuPointerGetAttributes", None)]),
    ("cuStreamIsCapturing", &[(10000, "cuStreamIsCapturing", Some("cuStreamIsCapturing_ptsz"))]),
    (
        "cuStreamGetCaptureInfo",
        &[
            (10010, "cuStreamGetCaptureInfo", Some("cuStreamGetCaptureInfo_ptsz")),
            (11030, "cuStreamGetCaptureInfo_v2", Some("cuStreamGetCaptureInfo_v2_ptsz")),
            (12030, "cuStreamGetCaptureInfo_v3", Some("cuStreamGetCaptureInfo_v3_ptsz")),
        ],
    ),
    ("cuThreadExchangeStreamCaptureMode", &[(10010, "cuThreadExchangeStreamCaptureMode", None)]),
    ("cuGraphCreate", &[(10000, "cuGraphCreate", None)]),
    ("cuGraphDestroy", &[(10000, "cuGraphDestroy", None)]),
    ("cuGraphGetNodes", &[(10000, "cuGraphGetNodes", None)]),
    ("cuGraphNodeGetType", &[(10000, "cuGraphNodeGetType", None)]),
    ("cuGraphMemAllocNodeGetParams", &[(11040, "cuGraphMemAllocNodeGetParams", None)]),
    // cuGraphInstantiate*, cuGraphUpload, cuGraphExecDestroy and cuDeviceGraphMemTrim are
    // in the shared table (the shim hooks them).
    ("cuDeviceGetGraphMemAttribute", &[(11040, "cuDeviceGetGraphMemAttribute", None)]),
    ("cuDeviceSetGraphMemAttribute", &[(11040, "cuDeviceSetGraphMemAttribute", None)]),
    ("cuFuncGetAttribute", &[(2020, "cuFuncGetAttribute", None)]),
    ("cuFuncGetName", &[(12030, "cuFuncGetName", None)]),
    ("cuModuleGetGlobal", &[(3020, "cuModuleGetGlobal_v2", None)]),
    ("cuEventRecordWithFlags", &[(11010, "cuEventRecordWithFlags", Some("cuEventRecordWithFlags_ptsz"))]),
    ("cuMulticastCreate", &[(12010, "cuMulticastCreate", None)]),
    ("cuMulticastAddDevice", &[(12010, "cuMulticastAddDevice", None)]),
    ("cuMulticastBindMem", &[(12010, "cuMulticastBindMem", None)]),
    ("cuMulticastUnbind", &[(12010, "cuMulticastUnbind", None)]),
    (
        "cuStreamWriteValue32",
        &[
            (8000, "cuStreamWriteValue32", Some("cuStreamWriteValue32_ptsz")),
            (11070, "cuStreamWriteValue32_v2", Some("cuStreamWriteValue32_v2_ptsz")),
        ],
    ),
    ("cuLibraryGetGlobal", &[(12000, "cuLibraryGetGlobal", None)]),
    ("cuLibraryLoadData", &[(12000, "cuLibraryLoadData", None)]),
    ("cuLibraryLoadFromFile", &[(12000, "cuLibraryLoadFromFile", None)]),
    ("cuLibraryUnload", &[(12000, "cuLibraryUnload", None)]),
    ("cuLibraryGetKernel", &[(12000, "cuLibraryGetKernel", None)]),
    ("cuLibraryGetModule", &[(12000, "cuLibraryGetModule", None)]),
    ("cuLibraryGetKernelCount", &[(12040, "cuLibraryGetKernelCount", None)]),
    ("cuLibraryEnumerateKernels", &[(12040, "cuLibraryEnumerateKernels", None)]),
    ("cuKernelGetFunction", &[(12000, "cuKernelGetFunction", None)]),
    ("cuKernelGetAttribute", &[(12000, "cuKernelGetAttribute", None)]),
    ("cuKernelGetName", &[(12030, "cuKernelGetName", None)]),
    // Green contexts; cuGreenCtxCreate and cuGreenCtxDestroy are in the shared table.
    ("cuDeviceGetDevResource", &[(12040, "cuDeviceGetDevResource", None)]),
    ("cuCtxGetDevResource", &[(12040, "cuCtxGetDevResource", None)]),
    ("cuGreenCtxGetDevResource", &[(12040, "cuGreenCtxGetDevResource", None)]),
    ("cuDevSmResourceSplitByCount", &[(12040, "cuDevSmResourceSplitByCount", None)]),
    ("cuDevResourceGenerateDesc", &[(12040, "cuDevResourceGenerateDesc", None)]),
    ("cuCtxFromGreenCtx", &[(12040, "cuCtxFromGreenCtx", None)]),
    ("cuGreenCtxStreamCreate", &[(12040, "cuGreenCtxStreamCreate", None)]),
    // IPC and peer access; cuIpcGetMemHandle is in the shared table (the shim hooks it).
    ("cuIpcOpenMemHandle", &[(4010, "cuIpcOpenMemHandle", None), (11000, "cuIpcOpenMemHandle_v2", None)]),
    ("cuIpcCloseMemHandle", &[(4010, "cuIpcCloseMemHandle", None)]),
    ("cuDeviceCanAccessPeer", &[(4000, "cuDeviceCanAccessPeer", None)]),
    ("cuCtxEnablePeerAccess", &[(4000, "cuCtxEnablePeerAccess", None)]),
    ("cuCtxDisablePeerAccess", &[(4000, "cuCtxDisablePeerAccess", None)]),
];

/// Resolves `name` in [`SIMGPU_PROCS`] as `cuGetProcAddress` does: the newest version
/// not newer than `cuda_version`, per-thread variant when `flags` ask for it.
fn resolve_simgpu(name: &str, cuda_version: c_int, flags: c_ulonglong) -> ProcQuery {
    let Some((_, versions)) = SIMGPU_PROCS.iter().find(|(n, _)| *n == name) else {
        return ProcQuery::SymbolNotFound;
    };
    match versions.iter().rev().find(|(since, ..)| *since <= cuda_version) {
        None => ProcQuery::VersionNotSufficient,
        Some(&(_, _, Some(per_thread))) if flags & FLAG_PER_THREAD_DEFAULT_STREAM != 0 => {
            ProcQuery::Found(per_thread)
        }
        Some(&(_, symbol, _)) => ProcQuery::Found(symbol),
    }
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
    (900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", c"operation not permitted when stream is capturing"),
    (
        901,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (903, c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", c"capture was not initiated in this stream"),
    (905, c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION", c"dependency created on uncaptured work in another stream"),
    (
        906,
        c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        908,
        c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        c"attempt to terminate a thread-local capture sequence from another thread",
    ),
    (401, c"CUDA_ERROR_ILLEGAL_STATE", c"the operation cannot be performed in the present state"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_simgpu_entry_point_is_exported_and_versioned() {
        for (name, versions) in SIMGPU_PROCS {
            assert_eq!(
                resolve(name, 13000, 0),
                ProcQuery::SymbolNotFound,
                "{name} is in the shared table now"
            );
            for (_, symbol, per_thread) in versions.iter() {
                assert!(lookup(symbol).is_some(), "{symbol} is not exported");
                assert!(per_thread.is_none_or(|pt| lookup(pt).is_some()), "{per_thread:?} is not exported");
            }
        }
        let pt = FLAG_PER_THREAD_DEFAULT_STREAM;
        assert_eq!(
            resolve_simgpu("cuStreamGetCaptureInfo", 12090, 0),
            ProcQuery::Found("cuStreamGetCaptureInfo_v3")
        );
        assert_eq!(
            resolve_simgpu("cuStreamGetCaptureInfo", 11030, pt),
            ProcQuery::Found("cuStreamGetCaptureInfo_v2_ptsz")
        );
        assert_eq!(resolve_simgpu("cuLibraryLoadData", 11080, 0), ProcQuery::VersionNotSufficient);
        assert_eq!(resolve_simgpu("cuNoSuchThing", 12090, 0), ProcQuery::SymbolNotFound);
        // libcudart 12.9 asks for these at CUDA 7.0; without them cudaDeviceReset fails.
        for name in ["cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxReset"] {
            assert_eq!(resolve(name, 7000, 0), ProcQuery::Found(name));
            assert!(lookup(name).is_some(), "{name} is not exported");
        }
        assert_eq!(resolve("cuDevicePrimaryCtxReset", 6050, 0), ProcQuery::VersionNotSufficient);
    }
}
