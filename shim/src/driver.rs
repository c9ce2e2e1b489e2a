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
    Cuda cuDevicePrimaryCtxGetState(c_int, *mut c_uint, *mut c_int);
    Cuda cuArrayGetMemoryRequirements(*mut [usize; 4], *mut c_void, c_int);
    Cuda cuMipmappedArrayGetMemoryRequirements(*mut [usize; 4], *mut c_void, c_int);
    Cuda cuArrayDestroy(*mut c_void);
    Cuda cuMipmappedArrayDestroy(*mut c_void);
    Nvml nvmlInit_v2();
    Nvml nvmlDeviceGetHandleByUUID(*const c_char, *mut *mut c_void);
    Nvml nvmlDeviceGetUUID(*mut c_void, *mut c_char, c_uint);
    Nvml nvmlDeviceGetMemoryInfo(*mut c_void, *mut [u64; 3]);
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

/// Formats a device UUID as NVML writes it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
pub(crate) fn uuid_string(bytes: &[u8; 16]) -> String {
    let mut text = String::from("GPU-");
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            text.push('-');
        }
        text.push_str(&format!("{b:02x}"));
    }
    text
}

/// Parses NVML's UUID string back into bytes.
pub(crate) fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let hex: String = text.strip_prefix("GPU-").unwrap_or(text).chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuids_round_trip() {
        let b = [0x51, 0x6d, 0x67, 0x70, 0x75, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];
        let s = super::uuid_string(&b);
        assert_eq!(s, "GPU-516d6770-7500-0000-0000-000000000003");
        assert_eq!(super::parse_uuid(&s), Some(b));
        assert_eq!(super::parse_uuid("GPU-zz"), None);
    }
}
