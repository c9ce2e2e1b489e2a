//! The hooks built from the one list (`hook_list.rs`): the exported functions (each
//! panic-safe), the name → hook table that `dlsym` and `cuGetProcAddress` answer from, the
//! real functions' signatures, the lazily resolved pointers to the real ones, and the
//! table handed to `libgpufrac.so` when it loads this library.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::control::compute::{config_stream, per_thread};
use crate::driver::ffi::{CUdeviceptr, Status};
use crate::driver::library::Lib;
use crate::driver::table::{real, sig, Real, HOOK_COUNT, REAL};

type Ptr = *mut c_void;
type Handle = c_ulonglong;

macro_rules! hooks {
    (
        implemented { $( $ilib:ident $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ) => $($imp:ident)::+ ; )* }
        gated { $( $gname:ident ( $($garg:ident : $gty:ty),* $(,)? ) $(@ $stream:expr)? ; )* }
    ) => {
        /// The first gated hook's index: they come after the implemented ones.
        const FIRST_GATED: usize = [$(stringify!($iname),)*].len();

        /// The exported hooks. In unit tests they are not exported, so that the test
        /// binary does not intercept its own calls.
        #[allow(non_snake_case, clippy::too_many_arguments)]
        pub mod exports {
            use super::*;
            $(
                #[cfg_attr(not(test), no_mangle)]
                pub extern "C" fn $iname($($iarg: $ity),*) -> Status {
                    crate::driver::ffi::guard(Lib::$ilib, || {
                        // Locked by the driver for a checkpoint park, a call that goes
                        // on to the driver would block there: it waits for the wake
                        // first, and a park waits for it while it is under way (gated
                        // calls wait at the gate).
                        let _to_driver = if Lib::$ilib == Lib::Cuda {
                            match crate::control::park::to_driver() {
                                Ok(counted) => Some(counted),
                                Err(status) => return status,
                            }
                        } else {
                            None
                        };
                        crate::$($imp)::+($($iarg),*)
                    })
                }
            )*
            $(
                #[cfg_attr(not(test), no_mangle)]
                pub extern "C" fn $gname($($garg: $gty),*) -> Status {
                    // A process whose gate nobody closes and that waits for no lease:
                    // counted, then straight on to the real function (a jump: nothing
                    // here can panic, and nothing is left to do after the call).
                    let real = crate::control::gate::pass_quickly(&REAL[Real::$gname as usize]);
                    if !real.is_null() {
                        // SAFETY: the real library's symbol of this name, whose C
                        // signature is the one declared in the hook list; the caller's
                        // arguments are passed on unchanged.
                        return unsafe { std::mem::transmute::<Ptr, sig::$gname>(real)($($garg),*) };
                    }
                    let slow = gated::WAY_IN[Real::$gname as usize - FIRST_GATED].load(Ordering::Relaxed);
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
                    crate::driver::ffi::guard(Lib::Cuda, || {
                        let _inside = match crate::control::gate::enter_on(|| hook_stream!($($stream)?)) {
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
        pub(crate) const FINGERPRINT: u64 = crate::driver::hook_list::fingerprint(concat!(
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

hook_list!(hooks);
