//! `libgpufrac_core.so`, the shim proper: it holds the container's group to its GPU memory
//! request and limit on every allocation path, shows the limit as the device's size (CUDA
//! and NVML), and never takes the host down. It is not preloaded itself: the small
//! `libgpufrac.so` (`shim/preload`) is, and loads this library beside it at the process's
//! first CUDA or NVML call, so that processes that never use the GPU do not pay for it.
//!
//! Layout:
//! - `hook_list`: the one list of hooked symbols, shared with `libgpufrac.so`; `hooks`:
//!   the exports, `dlsym` and `cuGetProcAddress` answers and the real functions' pointers
//!   built from it;
//! - `memory`, `context`, `implicit`, `device`, `nvml`: what the implemented hooks do
//!   (`implicit`: memory the driver takes without a size argument: heaps, modules;
//!   `graphs`: what CUDA graphs' memory pool keeps); `pools`: what
//!   stream-ordered pools keep, held to the limit; `processes`: NVML's process lists,
//!   the group's own only;
//! - `gate`: what launches, copies and sets pass through; `give_back`: what frameworks
//!   keep (PyTorch, CuPy, registered release functions), emptied when the memory is wanted;
//! - `ledger`: what the group holds, shared by its processes; `records`: per allocation;
//!   `backstop`: the device's own count, compared on the slow paths;
//! - `state`, `init`: setup at the first CUDA call, from the settings of
//!   `gpufrac_common::config`; `real`, `driver`: the real libraries; `procaddr`: `dlsym`
//!   and `cuGetProcAddress`; `query`: `gpufrac.h`.
//!
//! Nothing runs before the program's first CUDA or NVML call: no threads, no sockets.
#![deny(missing_docs)]
// Unit tests build the hooks without exporting them (no_mangle is off), so the hook
// implementations look unused there; the cdylib build still checks for dead code.
#![cfg_attr(test, allow(dead_code))]

#[macro_use]
mod hook_list;

mod arbiter;
mod backstop;
mod compute;
mod context;
mod device;
mod driver;
mod ffi;
pub mod gate;
mod give_back;
mod graphs;
mod hooks;
mod implicit;
mod init;
pub mod ledger;
mod memory;
mod nvml;
mod park;
mod pools;
mod procaddr;
mod processes;
pub mod query;
mod real;
pub mod records;
mod state;
mod swap;
mod thunks;

pub use ffi::{CUdeviceptr, Status};
pub use real::Lib;

/// A test build's delay in µs from the environment variable `name`; zero when unset or in
/// a release build.
pub(crate) fn test_env_us(name: &str) -> std::time::Duration {
    if !cfg!(debug_assertions) {
        return std::time::Duration::ZERO;
    }
    let Ok(value) = std::env::var(name) else { return std::time::Duration::ZERO };
    match value.parse() {
        Ok(us) => std::time::Duration::from_micros(us),
        Err(_) => {
            tracing::warn!(%value, "{name} is not a whole number of microseconds; ignored");
            std::time::Duration::ZERO
        }
    }
}
