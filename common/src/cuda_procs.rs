//! Which exported symbol the CUDA driver hands out for an entry point, by requested CUDA
//! version and default-stream flavour: the table behind `cuGetProcAddress`.
//!
//! Callers such as the CUDA runtime ask for a base name (`cuMemAlloc`) with the CUDA
//! version they were built against (`12080`) and a flag choosing the legacy or the
//! per-thread default stream. The answer is the newest versioned symbol not newer than
//! the request (`cuMemAlloc_v2`), or its `_ptds`/`_ptsz` variant for per-thread callers.
//! Versions and variants follow `cudaTypedefs.h`: an entry point whose ABI changed lists
//! its old symbol too (`cuMemAlloc` at 2000, the pre-3.2 API with 32-bit device pointers
//! and sizes, which the real driver still exports), so a caller asking for an old version
//! gets the old ABI, as from the real driver.

/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`.
pub const FLAG_LEGACY_STREAM: u64 = 1;
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const FLAG_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// One driver entry point.
#[derive(Debug)]
pub struct Proc {
    /// The base name callers ask for.
    pub name: &'static str,
    /// `(first CUDA version, exported symbol)`, oldest first.
    pub versions: &'static [(i32, &'static str)],
    /// The per-thread-default-stream symbol of the newest version, if the entry has one.
    pub per_thread: Option<&'static str>,
}

/// The answer to a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcQuery {
    /// The exported symbol to hand out.
    Found(&'static str),
    /// The entry point exists, but only in a newer CUDA than requested.
    VersionNotSufficient,
    /// No such entry point.
    SymbolNotFound,
}

/// Resolves `name` as `cuGetProcAddress` does for `cuda_version` and `flags`.
pub fn resolve(name: &str, cuda_version: i32, flags: u64) -> ProcQuery {
    let Some(proc) = PROCS.iter().find(|p| p.name == name) else {
        return ProcQuery::SymbolNotFound;
    };
    let Some(&(_, symbol)) = proc.versions.iter().rev().find(|(since, _)| *since <= cuda_version) else {
        return ProcQuery::VersionNotSufficient;
    };
    let newest = proc.versions.last().map(|&(_, s)| s);
    match proc.per_thread {
        // Per-thread variants exist for the newest version only, from CUDA 7.0 on.
        Some(pt)
            if flags & FLAG_PER_THREAD_DEFAULT_STREAM != 0
                && newest == Some(symbol)
                && cuda_version >= 7000 =>
        {
            ProcQuery::Found(pt)
        }
        _ => ProcQuery::Found(symbol),
    }
}

/// The base name of an exported symbol (`cuMemAlloc_v2` → `cuMemAlloc`), if it is in the table.
pub fn base_name(symbol: &str) -> Option<&'static str> {
    PROCS
        .iter()
        .find(|p| p.versions.iter().any(|&(_, s)| s == symbol) || p.per_thread == Some(symbol))
        .map(|p| p.name)
}

macro_rules! procs {
    ($( $name:literal : [ $( $since:literal => $sym:literal ),+ ] $( ptds $pt:literal )? ;)*) => {
        /// Every entry point gpufrac knows, with its versions and per-thread variant.
        pub static PROCS: &[Proc] = &[
            $( Proc { name: $name, versions: &[ $( ($since, $sym) ),+ ], per_thread: procs!(@pt $($pt)?) }, )*
        ];
    };
    (@pt) => { None };
    (@pt $pt:literal) => { Some($pt) };
}

procs! {
    // Initialisation, errors and entry points.
    "cuInit": [2000 => "cuInit"];
    "cuDriverGetVersion": [2020 => "cuDriverGetVersion"];
    "cuGetErrorName": [6000 => "cuGetErrorName"];
    "cuGetErrorString": [6000 => "cuGetErrorString"];
    "cuGetProcAddress": [11030 => "cuGetProcAddress", 12000 => "cuGetProcAddress_v2"];
    // Devices.
    "cuDeviceGet": [2000 => "cuDeviceGet"];
    "cuDeviceGetCount": [2000 => "cuDeviceGetCount"];
    "cuDeviceGetName": [2000 => "cuDeviceGetName"];
    "cuDeviceGetUuid": [9020 => "cuDeviceGetUuid", 11040 => "cuDeviceGetUuid_v2"];
    "cuDeviceTotalMem": [2000 => "cuDeviceTotalMem", 3020 => "cuDeviceTotalMem_v2"];
    "cuDeviceGetAttribute": [2000 => "cuDeviceGetAttribute"];
    "cuDeviceGetPCIBusId": [4010 => "cuDeviceGetPCIBusId"];
    "cuDeviceGetByPCIBusId": [4010 => "cuDeviceGetByPCIBusId"];
    "cuDeviceComputeCapability": [2000 => "cuDeviceComputeCapability"];
    "cuDeviceGetDefaultMemPool": [11020 => "cuDeviceGetDefaultMemPool"];
    "cuDeviceGetMemPool": [11020 => "cuDeviceGetMemPool"];
    "cuDeviceSetMemPool": [11020 => "cuDeviceSetMemPool"];
    // Contexts.
    "cuDevicePrimaryCtxRetain": [7000 => "cuDevicePrimaryCtxRetain"];
    "cuDevicePrimaryCtxRelease": [7000 => "cuDevicePrimaryCtxRelease", 11000 => "cuDevicePrimaryCtxRelease_v2"];
    "cuDevicePrimaryCtxReset": [7000 => "cuDevicePrimaryCtxReset", 11000 => "cuDevicePrimaryCtxReset_v2"];
    "cuDevicePrimaryCtxSetFlags": [11000 => "cuDevicePrimaryCtxSetFlags_v2"];
    "cuDevicePrimaryCtxGetState": [7000 => "cuDevicePrimaryCtxGetState"];
    "cuCtxCreate": [2000 => "cuCtxCreate", 3020 => "cuCtxCreate_v2", 11040 => "cuCtxCreate_v3", 12050 => "cuCtxCreate_v4"];
    "cuCtxDestroy": [2000 => "cuCtxDestroy", 4000 => "cuCtxDestroy_v2"];
    "cuCtxGetCurrent": [4000 => "cuCtxGetCurrent"];
    "cuCtxSetCurrent": [4000 => "cuCtxSetCurrent"];
    "cuCtxPushCurrent": [2000 => "cuCtxPushCurrent", 4000 => "cuCtxPushCurrent_v2"];
    "cuCtxPopCurrent": [2000 => "cuCtxPopCurrent", 4000 => "cuCtxPopCurrent_v2"];
    "cuCtxGetDevice": [2000 => "cuCtxGetDevice"];
    "cuCtxGetFlags": [7000 => "cuCtxGetFlags"];
    "cuCtxSetFlags": [12010 => "cuCtxSetFlags"];
    "cuCtxGetApiVersion": [3020 => "cuCtxGetApiVersion"];
    "cuCtxSynchronize": [2000 => "cuCtxSynchronize"];
    "cuCtxGetLimit": [3010 => "cuCtxGetLimit"];
    "cuCtxSetLimit": [3010 => "cuCtxSetLimit"];
    // Memory.
    "cuMemGetInfo": [2000 => "cuMemGetInfo", 3020 => "cuMemGetInfo_v2"];
    "cuMemAlloc": [2000 => "cuMemAlloc", 3020 => "cuMemAlloc_v2"];
    "cuMemAllocPitch": [2000 => "cuMemAllocPitch", 3020 => "cuMemAllocPitch_v2"];
    "cuMemAllocManaged": [6000 => "cuMemAllocManaged"];
    "cuMemFree": [2000 => "cuMemFree", 3020 => "cuMemFree_v2"];
    "cuMemAllocHost": [2000 => "cuMemAllocHost", 3020 => "cuMemAllocHost_v2"];
    "cuMemHostAlloc": [2020 => "cuMemHostAlloc"];
    "cuMemFreeHost": [2000 => "cuMemFreeHost"];
    "cuMemGetAddressRange": [2000 => "cuMemGetAddressRange", 3020 => "cuMemGetAddressRange_v2"];
    "cuPointerGetAttribute": [4000 => "cuPointerGetAttribute"];
    "cuMemAllocAsync": [11020 => "cuMemAllocAsync"] ptds "cuMemAllocAsync_ptsz";
    "cuMemFreeAsync": [11020 => "cuMemFreeAsync"] ptds "cuMemFreeAsync_ptsz";
    "cuMemAllocFromPoolAsync": [11020 => "cuMemAllocFromPoolAsync"] ptds "cuMemAllocFromPoolAsync_ptsz";
    "cuMemPoolCreate": [11020 => "cuMemPoolCreate"];
    "cuMemPoolDestroy": [11020 => "cuMemPoolDestroy"];
    "cuMemPoolTrimTo": [11020 => "cuMemPoolTrimTo"];
    "cuMemPoolSetAttribute": [11020 => "cuMemPoolSetAttribute"];
    "cuMemPoolGetAttribute": [11020 => "cuMemPoolGetAttribute"];
    "cuArrayCreate": [2000 => "cuArrayCreate", 3020 => "cuArrayCreate_v2"];
    "cuArray3DCreate": [2000 => "cuArray3DCreate", 3020 => "cuArray3DCreate_v2"];
    "cuArrayDestroy": [2000 => "cuArrayDestroy"];
    "cuMipmappedArrayCreate": [5000 => "cuMipmappedArrayCreate"];
    "cuMipmappedArrayDestroy": [5000 => "cuMipmappedArrayDestroy"];
    "cuArrayGetMemoryRequirements": [11060 => "cuArrayGetMemoryRequirements"];
    "cuMipmappedArrayGetMemoryRequirements": [11060 => "cuMipmappedArrayGetMemoryRequirements"];
    // Virtual memory management.
    "cuMemGetAllocationGranularity": [10020 => "cuMemGetAllocationGranularity"];
    "cuMemAddressReserve": [10020 => "cuMemAddressReserve"];
    "cuMemAddressFree": [10020 => "cuMemAddressFree"];
    "cuMemCreate": [10020 => "cuMemCreate"];
    "cuMemRelease": [10020 => "cuMemRelease"];
    "cuMemMap": [10020 => "cuMemMap"];
    "cuMemUnmap": [10020 => "cuMemUnmap"];
    "cuMemSetAccess": [10020 => "cuMemSetAccess"];
    "cuMemGetAllocationPropertiesFromHandle": [10020 => "cuMemGetAllocationPropertiesFromHandle"];
    "cuMemRetainAllocationHandle": [11000 => "cuMemRetainAllocationHandle"];
    "cuMemExportToShareableHandle": [10020 => "cuMemExportToShareableHandle"];
    "cuMemImportFromShareableHandle": [10020 => "cuMemImportFromShareableHandle"];
    // Legacy IPC: memory another process may map and keep alive.
    "cuIpcGetMemHandle": [4010 => "cuIpcGetMemHandle"];
    // Green contexts take device memory as contexts do (CUDA 12.4).
    "cuGreenCtxCreate": [12040 => "cuGreenCtxCreate"];
    "cuGreenCtxDestroy": [12040 => "cuGreenCtxDestroy"];
    // Copies and sets.
    "cuMemcpy": [4000 => "cuMemcpy"] ptds "cuMemcpy_ptds";
    "cuMemcpyAsync": [4000 => "cuMemcpyAsync"] ptds "cuMemcpyAsync_ptsz";
    "cuMemcpyHtoD": [2000 => "cuMemcpyHtoD", 3020 => "cuMemcpyHtoD_v2"] ptds "cuMemcpyHtoD_v2_ptds";
    "cuMemcpyDtoH": [2000 => "cuMemcpyDtoH", 3020 => "cuMemcpyDtoH_v2"] ptds "cuMemcpyDtoH_v2_ptds";
    "cuMemcpyDtoD": [2000 => "cuMemcpyDtoD", 3020 => "cuMemcpyDtoD_v2"] ptds "cuMemcpyDtoD_v2_ptds";
    "cuMemcpyHtoDAsync": [3020 => "cuMemcpyHtoDAsync_v2"] ptds "cuMemcpyHtoDAsync_v2_ptsz";
    "cuMemcpyDtoHAsync": [3020 => "cuMemcpyDtoHAsync_v2"] ptds "cuMemcpyDtoHAsync_v2_ptsz";
    "cuMemcpyDtoDAsync": [3020 => "cuMemcpyDtoDAsync_v2"] ptds "cuMemcpyDtoDAsync_v2_ptsz";
    "cuMemsetD8": [2000 => "cuMemsetD8", 3020 => "cuMemsetD8_v2"] ptds "cuMemsetD8_v2_ptds";
    "cuMemsetD16": [2000 => "cuMemsetD16", 3020 => "cuMemsetD16_v2"] ptds "cuMemsetD16_v2_ptds";
    "cuMemsetD32": [2000 => "cuMemsetD32", 3020 => "cuMemsetD32_v2"] ptds "cuMemsetD32_v2_ptds";
    "cuMemsetD8Async": [3020 => "cuMemsetD8Async"] ptds "cuMemsetD8Async_ptsz";
    "cuMemsetD16Async": [3020 => "cuMemsetD16Async"] ptds "cuMemsetD16Async_ptsz";
    "cuMemsetD32Async": [3020 => "cuMemsetD32Async"] ptds "cuMemsetD32Async_ptsz";
    "cuMemcpy2D": [3020 => "cuMemcpy2D_v2"] ptds "cuMemcpy2D_v2_ptds";
    "cuMemcpy2DUnaligned": [3020 => "cuMemcpy2DUnaligned_v2"] ptds "cuMemcpy2DUnaligned_v2_ptds";
    "cuMemcpy2DAsync": [3020 => "cuMemcpy2DAsync_v2"] ptds "cuMemcpy2DAsync_v2_ptsz";
    "cuMemcpy3D": [3020 => "cuMemcpy3D_v2"] ptds "cuMemcpy3D_v2_ptds";
    "cuMemcpy3DAsync": [3020 => "cuMemcpy3DAsync_v2"] ptds "cuMemcpy3DAsync_v2_ptsz";
    "cuMemcpyPeer": [4000 => "cuMemcpyPeer"] ptds "cuMemcpyPeer_ptds";
    "cuMemcpyPeerAsync": [4000 => "cuMemcpyPeerAsync"] ptds "cuMemcpyPeerAsync_ptsz";
    "cuMemsetD2D8": [3020 => "cuMemsetD2D8_v2"] ptds "cuMemsetD2D8_v2_ptds";
    "cuMemsetD2D16": [3020 => "cuMemsetD2D16_v2"] ptds "cuMemsetD2D16_v2_ptds";
    "cuMemsetD2D32": [3020 => "cuMemsetD2D32_v2"] ptds "cuMemsetD2D32_v2_ptds";
    "cuMemsetD2D8Async": [3020 => "cuMemsetD2D8Async"] ptds "cuMemsetD2D8Async_ptsz";
    "cuMemsetD2D16Async": [3020 => "cuMemsetD2D16Async"] ptds "cuMemsetD2D16Async_ptsz";
    "cuMemsetD2D32Async": [3020 => "cuMemsetD2D32Async"] ptds "cuMemsetD2D32Async_ptsz";
    // Streams and events.
    "cuStreamCreate": [2000 => "cuStreamCreate"];
    "cuStreamCreateWithPriority": [5050 => "cuStreamCreateWithPriority"];
    "cuStreamDestroy": [4000 => "cuStreamDestroy_v2"];
    "cuStreamSynchronize": [2000 => "cuStreamSynchronize"] ptds "cuStreamSynchronize_ptsz";
    "cuStreamQuery": [2000 => "cuStreamQuery"] ptds "cuStreamQuery_ptsz";
    "cuStreamWaitEvent": [3020 => "cuStreamWaitEvent"] ptds "cuStreamWaitEvent_ptsz";
    "cuStreamGetCtx": [9020 => "cuStreamGetCtx"] ptds "cuStreamGetCtx_ptsz";
    "cuStreamGetPriority": [5050 => "cuStreamGetPriority"] ptds "cuStreamGetPriority_ptsz";
    "cuStreamGetFlags": [5050 => "cuStreamGetFlags"] ptds "cuStreamGetFlags_ptsz";
    "cuCtxGetStreamPriorityRange": [5050 => "cuCtxGetStreamPriorityRange"];
    "cuEventCreate": [2000 => "cuEventCreate"];
    "cuEventDestroy": [4000 => "cuEventDestroy_v2"];
    "cuEventRecord": [2000 => "cuEventRecord"] ptds "cuEventRecord_ptsz";
    "cuEventSynchronize": [2000 => "cuEventSynchronize"];
    "cuEventQuery": [2000 => "cuEventQuery"];
    "cuEventElapsedTime": [2000 => "cuEventElapsedTime", 12080 => "cuEventElapsedTime_v2"];
    // Modules and launches.
    "cuModuleLoadData": [2000 => "cuModuleLoadData"];
    "cuModuleLoadDataEx": [2010 => "cuModuleLoadDataEx"];
    "cuModuleLoad": [2000 => "cuModuleLoad"];
    "cuModuleLoadFatBinary": [2000 => "cuModuleLoadFatBinary"];
    "cuModuleUnload": [2000 => "cuModuleUnload"];
    "cuModuleGetFunction": [2000 => "cuModuleGetFunction"];
    "cuLaunchKernel": [4000 => "cuLaunchKernel"] ptds "cuLaunchKernel_ptsz";
    "cuLaunchKernelEx": [11060 => "cuLaunchKernelEx"] ptds "cuLaunchKernelEx_ptsz";
    "cuLaunchCooperativeKernel": [9000 => "cuLaunchCooperativeKernel"] ptds "cuLaunchCooperativeKernel_ptsz";
    "cuGraphLaunch": [10000 => "cuGraphLaunch"] ptds "cuGraphLaunch_ptsz";
    // CUDA 12 gave cuGraphInstantiate the flags signature (cudaTypedefs.h).
    "cuGraphInstantiate": [10000 => "cuGraphInstantiate", 11000 => "cuGraphInstantiate_v2", 12000 => "cuGraphInstantiateWithFlags"];
    "cuGraphInstantiateWithFlags": [11040 => "cuGraphInstantiateWithFlags"];
    "cuGraphInstantiateWithParams": [12000 => "cuGraphInstantiateWithParams"] ptds "cuGraphInstantiateWithParams_ptsz";
    "cuGraphUpload": [11010 => "cuGraphUpload"] ptds "cuGraphUpload_ptsz";
    "cuGraphExecDestroy": [10000 => "cuGraphExecDestroy"];
    "cuDeviceGraphMemTrim": [11040 => "cuDeviceGraphMemTrim"];
    // cudaTypedefs.h: the mode argument came in 10.1 (`_v2`).
    "cuStreamBeginCapture": [10000 => "cuStreamBeginCapture", 10010 => "cuStreamBeginCapture_v2"] ptds "cuStreamBeginCapture_v2_ptsz";
    "cuStreamEndCapture": [10000 => "cuStreamEndCapture"] ptds "cuStreamEndCapture_ptsz";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_version_not_newer_than_requested() {
        assert_eq!(resolve("cuMemAlloc", 12080, 0), ProcQuery::Found("cuMemAlloc_v2"));
        assert_eq!(resolve("cuCtxCreate", 12080, 0), ProcQuery::Found("cuCtxCreate_v4"));
        assert_eq!(resolve("cuCtxCreate", 12000, 0), ProcQuery::Found("cuCtxCreate_v3"));
        assert_eq!(resolve("cuCtxCreate", 11000, 0), ProcQuery::Found("cuCtxCreate_v2"));
        assert_eq!(resolve("cuMemAllocAsync", 11000, 0), ProcQuery::VersionNotSufficient);
        assert_eq!(resolve("cuMemAllocPitch", 1000, 0), ProcQuery::VersionNotSufficient);
        assert_eq!(resolve("cuNoSuchThing", 12080, 0), ProcQuery::SymbolNotFound);
    }

    #[test]
    fn old_versions_answer_the_unversioned_symbols() {
        for name in [
            "cuMemAlloc",
            "cuMemAllocPitch",
            "cuMemFree",
            "cuMemGetInfo",
            "cuMemGetAddressRange",
            "cuDeviceTotalMem",
            "cuCtxCreate",
            "cuCtxDestroy",
            "cuCtxPushCurrent",
            "cuCtxPopCurrent",
            "cuArrayCreate",
            "cuArray3DCreate",
            "cuMemAllocHost",
            "cuMemcpyHtoD",
            "cuMemcpyDtoH",
            "cuMemcpyDtoD",
            "cuMemsetD8",
            "cuMemsetD16",
            "cuMemsetD32",
        ] {
            assert_eq!(resolve(name, 2000, 0), ProcQuery::Found(name), "{name} at CUDA 2.0");
            assert_eq!(resolve(name, 3010, 0), ProcQuery::Found(name), "{name} at CUDA 3.1");
            assert_ne!(resolve(name, 12080, 0), ProcQuery::Found(name), "{name} at CUDA 12.8");
            assert_eq!(base_name(name), Some(name));
        }
        assert_eq!(resolve("cuMemAlloc", 3020, 0), ProcQuery::Found("cuMemAlloc_v2"));
        assert_eq!(resolve("cuCtxDestroy", 3020, 0), ProcQuery::Found("cuCtxDestroy"));
        assert_eq!(
            resolve("cuDevicePrimaryCtxRelease", 7000, 0),
            ProcQuery::Found("cuDevicePrimaryCtxRelease")
        );
        // Per-thread variants are of the newest version only.
        let pt = FLAG_PER_THREAD_DEFAULT_STREAM;
        assert_eq!(resolve("cuMemcpyHtoD", 2000, pt), ProcQuery::Found("cuMemcpyHtoD"));
    }

    #[test]
    fn per_thread_variants() {
        let pt = FLAG_PER_THREAD_DEFAULT_STREAM;
        assert_eq!(resolve("cuLaunchKernel", 12000, pt), ProcQuery::Found("cuLaunchKernel_ptsz"));
        assert_eq!(resolve("cuMemcpyHtoD", 12000, pt), ProcQuery::Found("cuMemcpyHtoD_v2_ptds"));
        assert_eq!(resolve("cuLaunchKernel", 12000, FLAG_LEGACY_STREAM), ProcQuery::Found("cuLaunchKernel"));
        assert_eq!(resolve("cuMemAlloc", 12000, pt), ProcQuery::Found("cuMemAlloc_v2"));
    }

    #[test]
    fn base_names() {
        assert_eq!(base_name("cuMemAlloc_v2"), Some("cuMemAlloc"));
        assert_eq!(base_name("cuLaunchKernel_ptsz"), Some("cuLaunchKernel"));
        assert_eq!(base_name("nope"), None);
        let mut names: Vec<_> = PROCS.iter().map(|p| p.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PROCS.len(), "duplicate entry point in PROCS");
    }
}
