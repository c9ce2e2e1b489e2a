//! `libgpufrac.so`, the library `LD_PRELOAD` names in every process of a container.
//!
//! Every process pays for loading it, shells and helpers that never touch the GPU
//! included, so it is kept small and does nothing until it is called. It exports the
//! hooked CUDA and NVML entry points (from the list it shares with the core), `dlsym`, and
//! the functions of `gpufrac.h`. The first call of a hooked entry point loads
//! `libgpufrac_core.so` from the same folder (the shim proper, `shim/`), which hands over
//! its hooks; from then on an entry point is one atomic load and a call.
//!
//! If the core cannot be loaded, every hooked CUDA and NVML call fails with 999 (both
//! libraries' "unknown error") after one message on stderr: no process reaches the GPU
//! unaccounted. Nothing here can panic: there is no unwinding to contain at the exports.
#![deny(missing_docs)]

#[path = "../../src/driver/hook_list.rs"]
#[macro_use]
mod hook_list;

mod core;
mod dlsym;
mod entry;
mod query;
