//! What every gpufrac component agrees on: how sizes and durations are written by users,
//! the shim's `GPUFRAC_*` settings (feature `config`), which versioned symbol the CUDA
//! driver answers for each entry point, and the marker that tells the shim it was loaded
//! into a gpufrac daemon.
//!
//! Kept free of heavy dependencies because the shim links it into other people's processes.
#![deny(missing_docs)]

pub mod compute;
#[cfg(feature = "config")]
pub mod config;
pub mod cuda_procs;
pub mod cuda_sizes;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "dra")]
pub mod dra;
pub mod gpu_uuid;
pub mod protocol;
pub mod resolver;
pub mod shm;
pub mod size;

pub use compute::{ComputeShare, ComputeSpec};
pub use resolver::Resolver;
pub use size::{parse_bytes, parse_duration, parse_size, SizeError, SizeSpec};

/// The symbol every gpufrac daemon executable (`gpufrac-arbiter`, `gpufrac`,
/// `gpufrac-device-plugin`) defines and exports in its dynamic symbol table, with
/// [`daemon_marker!`] and `-Wl,--export-dynamic-symbol=gpufrac_daemon_marker` in its
/// `build.rs`. A shim preloaded into a process whose global scope has it passes every
/// call through untouched, whatever `GPUFRAC_*` variables the process has: a daemon
/// manages the whole GPU, never a slice. (`gpufrac run` execs another program, which has
/// no marker, so the shim enforces there.)
pub const DAEMON_MARKER: &std::ffi::CStr = c"gpufrac_daemon_marker";

/// Defines [`DAEMON_MARKER`] in a daemon's binary crate (call it once, at the crate's top
/// level). The binary's `build.rs` must also export it:
/// `cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=gpufrac_daemon_marker`.
#[macro_export]
macro_rules! daemon_marker {
    () => {
        /// Marks this executable as a gpufrac daemon for a preloaded shim
        /// (`gpufrac_common::DAEMON_MARKER`); `#[used]` keeps it through codegen and the
        /// linker's export keeps it in the dynamic symbol table.
        #[used]
        #[no_mangle]
        #[allow(non_upper_case_globals)]
        pub static gpufrac_daemon_marker: u8 = 1;
    };
}
