//! The driver's entry points: one table of the real CUDA and NVML functions the shim calls,
//! hooked or not, built from the hook list and the few functions the shim calls without
//! hooking them; one way to call them, [`call_real!`]. Each pointer is resolved on first
//! use and read with one atomic load after that.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::driver::ffi::{CUdeviceptr, Status};
use crate::driver::library::{resolve, Lib};

type Ptr = *mut c_void;
type Handle = c_ulonglong;

/// The hook list, with the functions the shim calls but does not hook appended.
macro_rules! with_unhooked {
    (
        implemented { $( $ilib:ident $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ) => $($imp:ident)::+ ; )* }
        gated { $( $gname:ident ( $($garg:ident : $gty:ty),* $(,)? ) $(@ $stream:expr)? ; )* }
    ) => {
        real_table! {
            $( $ilib $iname ( $($ity),* ); )*
            $( Cuda $gname ( $($gty),* ); )*
            ;

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
    Cuda cuCtxPushCurrent_v2(*mut c_void);
    Cuda cuCtxPopCurrent_v2(*mut *mut c_void);
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
    Cuda cuCtxSetCurrent(*mut c_void);
    Cuda cuStreamCreate(*mut *mut c_void, c_uint);
    Cuda cuStreamQuery(*mut c_void);
    Cuda cuStreamIsCapturing_ptsz(*mut c_void, *mut c_int);
    Cuda cuThreadExchangeStreamCaptureMode(*mut c_uint);
    Cuda cuEventCreate(*mut *mut c_void, c_uint);
    Cuda cuEventRecord(*mut c_void, *mut c_void);
    Cuda cuEventQuery(*mut c_void);
    Cuda cuEventElapsedTime(*mut f32, *mut c_void, *mut c_void);
    Cuda cuEventDestroy_v2(*mut c_void);
    Nvml nvmlInit_v2();
    Nvml nvmlDeviceGetHandleByUUID(*const c_char, *mut *mut c_void);
    Nvml nvmlDeviceGetUUID(*mut c_void, *mut c_char, c_uint);
        }
    };
}

macro_rules! real_table {
    ( $( $hlib:ident $hname:ident ( $($hty:ty),* ); )* ; $( $ulib:ident $uname:ident ( $($uty:ty),* ); )* ) => {
        /// Every real function the shim calls: the hooked ones first, in the hook list's
        /// order (so that a hook's position in the list is its place here), then the rest.
        #[allow(non_camel_case_types, dead_code)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Real { $($hname,)* $($uname,)* }

        /// Name and library of each real function, indexed by `Real as usize`.
        pub(crate) static NAMES: &[(&str, Lib)] = &[
            $((stringify!($hname), Lib::$hlib),)*
            $((stringify!($uname), Lib::$ulib),)*
        ];

        /// How many of them are hooked (the first ones).
        pub(crate) const HOOK_COUNT: usize = [$(Real::$hname,)*].len();

        /// Signatures of the real functions.
        #[allow(non_camel_case_types, dead_code)]
        pub(crate) mod sig {
            use super::*;
            $(pub type $hname = unsafe extern "C" fn($($hty),*) -> Status;)*
            $(pub type $uname = unsafe extern "C" fn($($uty),*) -> Status;)*
        }

        /// The real functions, resolved from the real library on first use.
        #[allow(non_snake_case, dead_code)]
        pub(crate) mod real {
            use super::*;
            $(
                #[inline]
                pub fn $hname() -> Option<sig::$hname> {
                    let p = real_ptr(Real::$hname);
                    // SAFETY: p is the real library's symbol of this name, whose C
                    // signature is the one declared in the list.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<Ptr, sig::$hname>(p) })
                }
            )*
            $(
                #[inline]
                pub fn $uname() -> Option<sig::$uname> {
                    let p = real_ptr(Real::$uname);
                    // SAFETY: as above.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<Ptr, sig::$uname>(p) })
                }
            )*
        }
    };
}

hook_list!(with_unhooked);

/// The resolved pointers, null until first use (or when the library lacks the function).
pub(crate) static REAL: [AtomicPtr<c_void>; NAMES.len()] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; NAMES.len()];

/// The real function `which`: one atomic load once resolved.
#[inline]
pub(crate) fn real_ptr(which: Real) -> Ptr {
    let slot = &REAL[which as usize];
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    let (name, lib) = NAMES[which as usize];
    let found = resolve(lib, name);
    slot.store(found, Ordering::Release);
    found
}

/// Calls the real function of this name, or answers its library's "function missing"
/// (`CUDA_ERROR_NOT_SUPPORTED`, `NVML_ERROR_FUNCTION_NOT_FOUND`).
macro_rules! call_real {
    ($name:ident ( $($arg:expr),* $(,)? )) => {
        match crate::driver::table::real::$name() {
            // SAFETY: forwarding arguments of the declared C types to the real function.
            Some(f) => unsafe { f($($arg),*) },
            None => crate::driver::table::NAMES[crate::driver::table::Real::$name as usize].1.missing(),
        }
    };
}
pub(crate) use call_real;

/// Whether `stream` is being captured into a CUDA graph (the capture active or already
/// invalidated: either way its calls only record). The per-thread default stream
/// (`CU_STREAM_PER_THREAD`) is asked through the `_ptsz` entry point, as the driver does
/// for its callers; a driver without the entry point, or an error, counts as no.
pub(crate) fn stream_capturing(stream: *mut c_void) -> bool {
    /// `CU_STREAM_PER_THREAD`.
    const PER_THREAD: usize = 0x2;
    let mut status: c_int = 0;
    let asked = if stream as usize == PER_THREAD {
        call_real!(cuStreamIsCapturing_ptsz(std::ptr::null_mut(), &mut status))
    } else {
        call_real!(cuStreamIsCapturing(stream, &mut status))
    };
    asked == crate::driver::ffi::SUCCESS && status != 0
}

pub(crate) use gpufrac_common::gpu_uuid::{format as uuid_string, parse as parse_uuid};
