//! Real driver and NVML functions the shim calls but does not hook, resolved once.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::ffi::Status;
use crate::real::{resolve, Lib};

macro_rules! real_fns {
    ($( $lib:ident $name:ident ( $($ty:ty),* ); )*) => {
        $(
            #[allow(non_snake_case)]
            pub(crate) fn $name() -> Option<unsafe extern "C" fn($($ty),*) -> Status> {
                static PTR: OnceLock<usize> = OnceLock::new();
                let p = *PTR.get_or_init(|| resolve(Lib::$lib, stringify!($name)) as usize);
                // SAFETY: a non-null address is the real function of this name, whose C
                // signature is the one declared here.
                (p != 0).then(|| unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($ty),*) -> Status>(p) })
            }
        )*
    };
}

real_fns! {
    Cuda cuDeviceGetCount(*mut c_int);
    Cuda cuDeviceGet(*mut c_int, c_int);
    Cuda cuDeviceGetUuid(*mut [u8; 16], c_int);
    Cuda cuCtxGetCurrent(*mut *mut c_void);
    Cuda cuCtxGetDevice(*mut c_int);
    Cuda cuPointerGetAttribute(*mut c_void, c_int, u64);
    Cuda cuCtxGetLimit(*mut usize, c_int);
    Cuda cuDeviceGetAttribute(*mut c_int, c_int, c_int);
    Cuda cuDevicePrimaryCtxGetState(c_int, *mut c_uint, *mut c_int);
    Cuda cuArrayGetMemoryRequirements(*mut [usize; 4], *mut c_void, c_int);
    Cuda cuMipmappedArrayGetMemoryRequirements(*mut [usize; 4], *mut c_void, c_int);
    Cuda cuArrayDestroy(*mut c_void);
    Cuda cuMipmappedArrayDestroy(*mut c_void);
    Cuda cuCtxPushCurrent_v2(*mut c_void);
    Cuda cuCtxPopCurrent_v2(*mut *mut c_void);
    Cuda cuCtxSynchronize();
    Cuda cuStreamSynchronize(*mut c_void);
    Cuda cuStreamIsCapturing(*mut c_void, *mut c_int);
    Cuda cuMemAllocHost_v2(*mut *mut c_void, usize);
    Cuda cuMemFreeHost(*mut c_void);
    Cuda cuMemGetAllocationGranularity(*mut usize, *const c_void, c_uint);
    Cuda cuMemAddressReserve(*mut u64, usize, usize, u64, u64);
    Cuda cuMemAddressFree(u64, usize);
    Cuda cuMemSetAccess(u64, usize, *const c_void, usize);
    Cuda cuMemPoolGetAttribute(*mut c_void, c_int, *mut c_void);
    Cuda cuDeviceGetMemPool(*mut *mut c_void, c_int);
    Cuda cuDeviceGetDefaultMemPool(*mut *mut c_void, c_int);
    Cuda cuStreamGetCtx(*mut c_void, *mut *mut c_void);
    Cuda cuCtxFromGreenCtx(*mut *mut c_void, *mut c_void);
    Cuda cuGraphGetNodes(*mut c_void, *mut *mut c_void, *mut usize);
    Cuda cuGraphNodeGetType(*mut c_void, *mut c_uint);
    Cuda cuGraphMemAllocNodeGetParams(*mut c_void, *mut c_void);
    Cuda cuDeviceGetGraphMemAttribute(c_int, c_int, *mut c_void);
    Nvml nvmlInit_v2();
    Nvml nvmlDeviceGetHandleByUUID(*const c_char, *mut *mut c_void);
    Nvml nvmlDeviceGetUUID(*mut c_void, *mut c_char, c_uint);
    Nvml nvmlDeviceGetComputeRunningProcesses_v3(*mut c_void, *mut c_uint, *mut [u64; 3]);
}

/// Calls an unhooked real function, or answers `missing` if it does not exist.
macro_rules! call {
    ($name:ident ( $($arg:expr),* ), $missing:expr) => {
        match crate::driver::$name() {
            // SAFETY: arguments of the declared C types, valid for the call.
            Some(f) => unsafe { f($($arg),*) },
            None => $missing,
        }
    };
}
pub(crate) use call;

pub(crate) use gpufrac_common::gpu_uuid::{format as uuid_string, parse as parse_uuid};
