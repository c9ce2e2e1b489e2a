//! The hooks built from the one list (`hook_list.rs`): the exported functions (each
//! panic-safe), the name → hook table that `dlsym` and `cuGetProcAddress` answer from, the
//! real functions' signatures, the lazily resolved pointers to the real ones, and the
//! table handed to `libgpufrac.so` when it loads this library.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::ffi::{CUdeviceptr, Status};
use crate::real::{resolve, Lib};

type Ptr = *mut c_void;
type Handle = c_ulonglong;

macro_rules! hooks {
    (
        implemented { $( $ilib:ident $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ) => $imp:path ; )* }
        gated { $( $gname:ident ( $($garg:ident : $gty:ty),* $(,)? ) $(@ $stream:expr)? ; )* }
    ) => {
        /// Every hooked symbol, in one enumeration.
        #[allow(non_camel_case_types, dead_code)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Hook { $($iname,)* $($gname,)* }

        /// The first gated hook's index: they come after the implemented ones.
        const FIRST_GATED: usize = [$(Hook::$iname,)*].len();

        /// Name and library of each hook, indexed by `Hook as usize`.
        pub(crate) static HOOKS: &[(&str, Lib)] = &[
            $((stringify!($iname), Lib::$ilib),)*
            $((stringify!($gname), Lib::Cuda),)*
        ];

        /// Signatures of the real functions.
        #[allow(non_camel_case_types, dead_code)]
        pub(crate) mod sig {
            use super::*;
            $(pub type $iname = unsafe extern "C" fn($($ity),*) -> Status;)*
            $(pub type $gname = unsafe extern "C" fn($($gty),*) -> Status;)*
        }

        /// The real functions, resolved from the real library on first use.
        #[allow(non_snake_case, dead_code)]
        pub(crate) mod real {
            use super::*;
            $(
                #[inline]
                pub fn $iname() -> Option<sig::$iname> {
                    let p = real_ptr(Hook::$iname);
                    // SAFETY: p is the real library's symbol of this name, whose C
                    // signature is the one declared in the hook list.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<Ptr, sig::$iname>(p) })
                }
            )*
            $(
                #[inline]
                pub fn $gname() -> Option<sig::$gname> {
                    let p = real_ptr(Hook::$gname);
                    // SAFETY: as above.
                    (!p.is_null()).then(|| unsafe { std::mem::transmute::<Ptr, sig::$gname>(p) })
                }
            )*
        }

        /// The exported hooks. In unit tests they are not exported, so that the test
        /// binary does not intercept its own calls.
        #[allow(non_snake_case, clippy::too_many_arguments)]
        pub mod exports {
            use super::*;
            $(
                #[cfg_attr(not(test), no_mangle)]
                pub extern "C" fn $iname($($iarg: $ity),*) -> Status {
                    crate::ffi::guard(Lib::$ilib, || {
                        // Locked by the driver for a checkpoint park, a call that goes
                        // on to the driver would block there: it waits for the wake
                        // first, and a park waits for it while it is under way (gated
                        // calls wait at the gate).
                        let _to_driver = if Lib::$ilib == Lib::Cuda {
                            match crate::park::to_driver() {
                                Ok(counted) => Some(counted),
                                Err(status) => return status,
                            }
                        } else {
                            None
                        };
                        $imp($($iarg),*)
                    })
                }
            )*
            $(
                #[cfg_attr(not(test), no_mangle)]
                pub extern "C" fn $gname($($garg: $gty),*) -> Status {
                    // A process whose gate nobody closes and that waits for no lease:
                    // counted, then straight on to the real function (a jump: nothing
                    // here can panic, and nothing is left to do after the call).
                    let real = crate::gate::pass_quickly(&REAL[Hook::$gname as usize]);
                    if !real.is_null() {
                        // SAFETY: the real library's symbol of this name, whose C
                        // signature is the one declared in the hook list; the caller's
                        // arguments are passed on unchanged.
                        return unsafe { std::mem::transmute::<Ptr, sig::$gname>(real)($($garg),*) };
                    }
                    let slow = gated::WAY_IN[Hook::$gname as usize - FIRST_GATED].load(Ordering::Relaxed);
                    // SAFETY: `gated`'s function of this name, of the same signature.
                    unsafe { std::mem::transmute::<Ptr, sig::$gname>(slow)($($garg),*) }
                }
            )*
        }

        /// The gated hooks' way through the gate when the quick pass does not apply.
        #[allow(non_snake_case, clippy::too_many_arguments)]
        mod gated {
            use super::*;

            /// The functions below, called through these pointers: a function whose
            /// address is never taken may get a private calling convention, and the
            /// exported hook's call could then not be a jump.
            pub(super) static WAY_IN: [AtomicPtr<c_void>; HOOK_COUNT - FIRST_GATED] =
                [$(AtomicPtr::new($gname as Ptr),)*];
            $(
                #[inline(never)]
                pub(super) extern "C" fn $gname($($garg: $gty),*) -> Status {
                    crate::ffi::guard(Lib::Cuda, || {
                        let _inside = match crate::gate::enter_on(|| hook_stream!($($stream)?)) {
                            Ok(pass) => pass,
                            Err(status) => return status,
                        };
                        match real::$gname() {
                            // SAFETY: forwarding the caller's arguments unchanged to the
                            // real function of the same signature.
                            Some(f) => unsafe { f($($garg),*) },
                            None => Lib::Cuda.missing(),
                        }
                    })
                }
            )*
        }

        /// The hooks in list order, as `libgpufrac.so` indexes its entry points.
        pub(crate) fn table() -> [Ptr; HOOK_COUNT] {
            [$(exports::$iname as Ptr,)* $(exports::$gname as Ptr,)*]
        }

        /// What both libraries must agree on: every name and signature, in order.
        pub(crate) const FINGERPRINT: u64 = crate::hook_list::fingerprint(concat!(
            $(stringify!($iname ($($ity),*)), ";",)*
            $(stringify!($gname ($($gty),*)), ";",)*
        ));

        /// The hook exported under `name`, if the shim hooks that symbol.
        pub(crate) fn lookup(name: &str) -> Option<Ptr> {
            match name {
                $(stringify!($iname) => Some(exports::$iname as Ptr),)*
                $(stringify!($gname) => Some(exports::$gname as Ptr),)*
                _ => None,
            }
        }
    };
}

/// The stream a gated call starts its work on: as the hook list names it, or the legacy
/// default stream (null) for calls without one.
macro_rules! hook_stream {
    () => {
        std::ptr::null_mut()
    };
    ($stream:expr) => {
        $stream
    };
}

pub(crate) const HOOK_COUNT: usize = HOOKS.len();
static REAL: [AtomicPtr<c_void>; HOOK_COUNT] = [const { AtomicPtr::new(std::ptr::null_mut()) }; HOOK_COUNT];

/// The real function behind `hook`: one atomic load once resolved.
#[inline]
pub(crate) fn real_ptr(hook: Hook) -> Ptr {
    let slot = &REAL[hook as usize];
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    let (name, lib) = HOOKS[hook as usize];
    let found = resolve(lib, name);
    slot.store(found, Ordering::Release);
    found
}

/// Calls the real function behind a hook, or answers the library's "function missing".
macro_rules! call_real {
    ($name:ident ( $($arg:expr),* $(,)? )) => {
        match crate::hooks::real::$name() {
            // SAFETY: forwarding arguments of the declared C types to the real function.
            Some(f) => unsafe { f($($arg),*) },
            None => crate::hooks::HOOKS[crate::hooks::Hook::$name as usize].1.missing(),
        }
    };
}
pub(crate) use call_real;

hook_list!(hooks);
