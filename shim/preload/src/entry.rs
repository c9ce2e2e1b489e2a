//! The exported entry points, one per hooked symbol of the shared list: each calls the
//! core's hook at the same position, loading the core first if it is not loaded yet.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};

use crate::core::{attached_hook, hook, UNAVAILABLE};

type Ptr = *mut c_void;
type Handle = c_ulonglong;
type CUdeviceptr = u64;
/// A `CUresult` or `nvmlReturn_t`.
type Status = c_uint;

/// One exported entry point: the core's hook at the same position, called with the
/// caller's arguments.
macro_rules! entry_point {
    ($name:ident($($arg:ident: $ty:ty),*)) => {
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> Status {
            // Once the core is attached, a jump to its hook with the registers untouched:
            // the loading stays out of line, so this path saves nothing.
            let f = attached_hook(Entry::$name as usize);
            if !f.is_null() {
                // SAFETY: the core's hook at this position has the signature of the
                // shared list (the core's fingerprint matched); the caller's arguments are
                // passed on unchanged.
                return unsafe { std::mem::transmute::<Ptr, unsafe extern "C" fn($($ty),*) -> Status>(f)($($arg),*) };
            }
            let load = loading::WAY_IN[Entry::$name as usize].load(std::sync::atomic::Ordering::Relaxed);
            // SAFETY: `loading`'s function of this name, of the same signature.
            unsafe { std::mem::transmute::<Ptr, unsafe extern "C" fn($($ty),*) -> Status>(load)($($arg),*) }
        }
    };
}

/// The entry point's first call (or one after the core could not be loaded): loads the
/// core, then calls its hook.
macro_rules! loading_entry_point {
    ($name:ident($($arg:ident: $ty:ty),*)) => {
        #[inline(never)]
        pub(super) extern "C" fn $name($($arg: $ty),*) -> Status {
            match hook(Entry::$name as usize) {
                // SAFETY: the core's hook at this position has the signature of the
                // shared list (the core's fingerprint matched); the caller's arguments are
                // passed on unchanged.
                Some(f) => unsafe {
                    std::mem::transmute::<Ptr, unsafe extern "C" fn($($ty),*) -> Status>(f)($($arg),*)
                },
                None => UNAVAILABLE,
            }
        }
    };
}

macro_rules! entry_points {
    (
        implemented { $( $ilib:ident $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ) => $($imp:ident)::+ ; )* }
        gated { $( $gname:ident ( $($garg:ident : $gty:ty),* $(,)? ) $(@ $stream:expr)? ; )* }
    ) => {
        /// Every hooked symbol, numbered as in the list (and in the core's table).
        #[allow(non_camel_case_types, dead_code)]
        #[derive(Clone, Copy)]
        enum Entry { $($iname,)* $($gname,)* }

        /// How many entry points there are.
        pub(crate) const ENTRY_COUNT: usize = [$(Entry::$iname,)* $(Entry::$gname,)*].len();

        /// What the core must have been built from: every name and signature, in order.
        pub(crate) const FINGERPRINT: u64 = crate::hook_list::fingerprint(concat!(
            $(stringify!($iname ($($ity),*)), ";",)*
            $(stringify!($gname ($($gty),*)), ";",)*
        ));

        /// This library's entry point for `name`, if `name` is hooked.
        pub(crate) fn entry_point(name: &[u8]) -> Option<Ptr> {
            let name = std::str::from_utf8(name).ok()?;
            match name {
                $(stringify!($iname) => Some(exports::$iname as Ptr),)*
                $(stringify!($gname) => Some(exports::$gname as Ptr),)*
                _ => None,
            }
        }

        /// The exported entry points.
        #[allow(non_snake_case, clippy::too_many_arguments)]
        mod exports {
            use super::*;
            $(entry_point!($iname($($iarg: $ity),*));)*
            $(entry_point!($gname($($garg: $gty),*));)*
        }

        /// The entry points' loading paths.
        #[allow(non_snake_case, clippy::too_many_arguments)]
        mod loading {
            use super::*;

            /// The functions below, called through these pointers: a function whose
            /// address is never taken may get a private calling convention, and the
            /// entry point's call could then not be a jump.
            pub(super) static WAY_IN: [std::sync::atomic::AtomicPtr<c_void>; ENTRY_COUNT] =
                [$(std::sync::atomic::AtomicPtr::new($iname as Ptr),)* $(std::sync::atomic::AtomicPtr::new($gname as Ptr),)*];
            $(loading_entry_point!($iname($($iarg: $ity),*));)*
            $(loading_entry_point!($gname($($garg: $gty),*));)*
        }
    };
}

hook_list!(entry_points);
