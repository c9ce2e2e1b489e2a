//! `dlsym`, exported under both of glibc's versions: programs that `dlopen` libcuda or
//! NVML and look functions up by name (cudarc, ctypes, frameworks) get the hooks for the
//! hooked names; every other lookup goes to glibc's `dlsym` untouched.
//!
//! On x86_64 the export is a few instructions that *jump* to glibc's `dlsym` rather than
//! call it, so glibc sees the program's return address and `dlsym(RTLD_NEXT, ...)` keeps
//! meaning "after the caller's library" (a wrapper library preloaded beside this one
//! finds the real function, not itself).

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::entry::entry_point;

type Ptr = *mut c_void;
pub(crate) type DlsymFn = unsafe extern "C" fn(Ptr, *const c_char) -> Ptr;

/// glibc's own `dlsym`: the next definition after this library, found with `dlvsym`.
pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    static REAL: AtomicUsize = AtomicUsize::new(0);
    let mut addr = REAL.load(Ordering::Acquire);
    if addr == 0 {
        let old = if cfg!(target_arch = "aarch64") { c"GLIBC_2.17" } else { c"GLIBC_2.2.5" };
        for version in [c"GLIBC_2.34", old] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated strings; the result is checked.
            addr = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) } as usize;
            if addr != 0 {
                break;
            }
        }
        REAL.store(addr, Ordering::Release);
    }
    // SAFETY: a non-zero address is glibc's dlsym, whose signature is DlsymFn.
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(addr) })
}

/// What `dlsym` answers: `symbol` if not null, else what `forward` (glibc's `dlsym`, or
/// null if it cannot be found) answers for the same arguments.
#[repr(C)]
pub(crate) struct Answer {
    symbol: Ptr,
    forward: Ptr,
}

/// Decides a `dlsym(handle, name)`: hooked names get the core's hook (or this library's
/// failing entry point if the core cannot be loaded); everything else is glibc's.
extern "C" fn decide(_handle: Ptr, name: *const c_char) -> Answer {
    let forward = real_dlsym().map_or(std::ptr::null_mut(), |f| f as Ptr);
    Answer { symbol: hooked(name).unwrap_or(std::ptr::null_mut()), forward }
}

fn hooked(name: *const c_char) -> Option<Ptr> {
    if name.is_null() {
        return None;
    }
    // SAFETY: a non-null symbol name is NUL-terminated by dlsym's contract.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    if !(bytes.starts_with(b"cu") || bytes.starts_with(b"nvml")) {
        return None;
    }
    let own = entry_point(bytes)?;
    match crate::core::lookup(name) {
        // The core passes through in this process: glibc answers.
        Some(hook) if hook.is_null() => None,
        // The core failed: never the real function, which would run unaccounted.
        Some(hook) if hook as usize == crate::hook_list::LOOKUP_FAILED => Some(own),
        Some(hook) => Some(hook),
        None => Some(own),
    }
}

#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".globl gpufrac_dlsym_old",
    ".globl gpufrac_dlsym_new",
    ".type gpufrac_dlsym_old, @function",
    ".type gpufrac_dlsym_new, @function",
    ".symver gpufrac_dlsym_old, dlsym@GLIBC_2.2.5",
    ".symver gpufrac_dlsym_new, dlsym@@GLIBC_2.34",
    "gpufrac_dlsym_old:",
    "gpufrac_dlsym_new:",
    // Unwind information, so that debuggers and profilers can walk through it.
    ".cfi_startproc",
    // Keep the arguments; realign the stack for the call (8 on entry, 3 pushes of 8).
    "push rdi",
    ".cfi_adjust_cfa_offset 8",
    "push rsi",
    ".cfi_adjust_cfa_offset 8",
    "sub rsp, 8",
    ".cfi_adjust_cfa_offset 8",
    "call {decide}",
    "add rsp, 8",
    ".cfi_adjust_cfa_offset -8",
    "pop rsi",
    ".cfi_adjust_cfa_offset -8",
    "pop rdi",
    ".cfi_adjust_cfa_offset -8",
    // Answer.symbol in rax, Answer.forward in rdx.
    "test rax, rax",
    "jnz 2f",
    "test rdx, rdx",
    "jz 2f",
    // The caller's return address is still on top of the stack for glibc to see.
    "jmp rdx",
    "2:",
    "ret",
    ".cfi_endproc",
    ".size gpufrac_dlsym_old, . - gpufrac_dlsym_old",
    ".size gpufrac_dlsym_new, . - gpufrac_dlsym_new",
    decide = sym decide,
);

#[cfg(not(target_arch = "x86_64"))]
mod portable {
    //! Elsewhere `dlsym` calls glibc's: `dlsym(RTLD_NEXT, ...)` then looks from this
    //! library on instead of from the caller's.
    use super::*;

    #[cfg(target_arch = "aarch64")]
    std::arch::global_asm!(
        ".symver gpufrac_dlsym_old, dlsym@GLIBC_2.17",
        ".symver gpufrac_dlsym_new, dlsym@@GLIBC_2.34"
    );

    fn answer(handle: Ptr, name: *const c_char) -> Ptr {
        let Answer { symbol, forward } = decide(handle, name);
        if !symbol.is_null() || forward.is_null() {
            return symbol;
        }
        // SAFETY: forward is glibc's dlsym; the caller's arguments are passed on.
        unsafe { std::mem::transmute::<Ptr, DlsymFn>(forward)(handle, name) }
    }

    /// `dlsym@GLIBC_2.17`.
    #[no_mangle]
    pub extern "C" fn gpufrac_dlsym_old(handle: Ptr, name: *const c_char) -> Ptr {
        answer(handle, name)
    }

    /// `dlsym@GLIBC_2.34`.
    #[no_mangle]
    pub extern "C" fn gpufrac_dlsym_new(handle: Ptr, name: *const c_char) -> Ptr {
        answer(handle, name)
    }
}
