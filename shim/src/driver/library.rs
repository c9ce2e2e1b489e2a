//! The real CUDA driver and NVML, and the real `dlsym`.
//!
//! Nothing here runs before the first CUDA or NVML call: the libraries are opened and
//! symbols resolved lazily, once, from the hooks.

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::driver::ffi::{Status, NOT_SUPPORTED, NVML_FUNCTION_NOT_FOUND, UNKNOWN};

/// The library a hooked symbol belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lib {
    /// The CUDA driver, `libcuda.so.1`.
    Cuda,
    /// NVML, `libnvidia-ml.so.1`.
    Nvml,
}

impl Lib {
    fn soname(self) -> &'static std::ffi::CStr {
        match self {
            Lib::Cuda => c"libcuda.so.1",
            Lib::Nvml => c"libnvidia-ml.so.1",
        }
    }

    /// What a hook answers when the real library lacks the function.
    pub(crate) fn missing(self) -> Status {
        match self {
            Lib::Cuda => NOT_SUPPORTED,
            Lib::Nvml => NVML_FUNCTION_NOT_FOUND,
        }
    }

    /// What a hook answers if the shim itself failed.
    pub(crate) fn panicked(self) -> Status {
        UNKNOWN
    }
}

pub(crate) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym` as `libgpufrac.so` found it (it exports `dlsym` itself, so a plain call
/// would come back to it), handed over by `gpufrac_core_attach` (the registry).
static HANDED_DLSYM: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn set_real_dlsym(dlsym: DlsymFn) {
    HANDED_DLSYM.store(dlsym as usize, Ordering::Release);
}

/// glibc's own `dlsym`: the one `libgpufrac.so` handed over, else (this library loaded
/// some other way, as in its unit tests) the next one after this library, found with
/// `dlvsym`.
pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    static NEXT: OnceLock<usize> = OnceLock::new();
    let mut addr = HANDED_DLSYM.load(Ordering::Acquire);
    if addr == 0 {
        addr = *NEXT.get_or_init(|| {
            let old = if cfg!(target_arch = "aarch64") { c"GLIBC_2.17" } else { c"GLIBC_2.2.5" };
            [old, c"GLIBC_2.34"]
                .iter()
                // SAFETY: dlvsym with RTLD_NEXT and valid C strings; the result is checked.
                .map(|version| unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) })
                .find(|p| !p.is_null())
                .map_or(0, |p| p as usize)
        });
    }
    // SAFETY: a non-zero address is glibc's dlsym, whose signature is DlsymFn.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(addr) })
}

/// Whether the program's global scope (the executable and the libraries loaded with it or
/// with `RTLD_GLOBAL`) defines `name`, asked of glibc's own `dlsym` so that our hook is
/// not involved. `false` if glibc's `dlsym` cannot be found.
pub(crate) fn defined_globally(name: &CStr) -> bool {
    let Some(dlsym) = real_dlsym() else { return false };
    // SAFETY: glibc's dlsym with RTLD_DEFAULT and a NUL-terminated name; only the
    // address is compared, nothing is read through it.
    !unsafe { dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }.is_null()
}

fn handle(lib: Lib) -> *mut c_void {
    static HANDLES: [OnceLock<usize>; 2] = [OnceLock::new(), OnceLock::new()];
    let slot = &HANDLES[lib as usize];
    // SAFETY: dlopen with a valid C string; a null result is kept as 0 and reported as
    // missing functions.
    *slot.get_or_init(
        || unsafe { libc::dlopen(lib.soname().as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) } as usize
    ) as *mut c_void
}

/// The real `name` in `lib`, or null if the library or the symbol is missing.
pub(crate) fn resolve(lib: Lib, name: &str) -> *mut c_void {
    let (Some(dlsym), Ok(name)) = (real_dlsym(), CString::new(name)) else {
        return std::ptr::null_mut();
    };
    let h = handle(lib);
    if h.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: glibc's dlsym on a handle from dlopen and a valid C string.
    unsafe { dlsym(h, name.as_ptr()) }
}
