//! `libgpufrac_core.so`, the shim proper: it holds the container's group to its GPU memory
//! request and limit on every allocation path, shows the limit as the device's size (CUDA
//! and NVML), and never takes the host down. It is not preloaded itself: the small
//! `libgpufrac.so` (`shim/preload`) is, and loads this library beside it at the process's
//! first CUDA or NVML call, so that processes that never use the GPU do not pay for it.
//!
//! Layout: one folder per layer, each importing only the layers below it.
//! - `driver`: the host program's boundary (`ffi`), the real libraries (`library`), the
//!   hook list and the one table of real functions built from it (`table`, `call_real!`);
//! - `books`: the group's ledger, shared by its processes, and this process's records;
//! - `enforcer`: the process's state set up at the first CUDA call, charging and giving
//!   back against the request and limit, loans from the arbiter, the device's own count;
//! - `control`: the gate every launch passes, the compute lease, swap, parking, the
//!   thunks, giving back what frameworks keep, and the arbiter client;
//! - `hooks`: what each implemented hook does (memory, contexts, implicit memory, pools,
//!   graphs, the virtual device, NVML, `cuInit`, `gpufrac.h`'s queries);
//! - `registry`: the exports, `dlsym` and `cuGetProcAddress` answers, built from the list.
//!
//! Nothing runs before the program's first CUDA or NVML call: no threads, no sockets.
#![deny(missing_docs)]
// Unit tests build the hooks without exporting them (no_mangle is off), so the hook
// implementations look unused there; the cdylib build still checks for dead code.
#![cfg_attr(test, allow(dead_code))]

#[macro_use]
mod driver;

mod books;
mod control;
mod enforcer;
mod hooks;
mod registry;

pub use books::{group_ledger as ledger, records};
pub use control::gate;
pub use driver::ffi::{CUdeviceptr, Status};
pub use driver::library::Lib;
pub use hooks::query;

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
