//! The bottom layer: the host program's boundary (statuses, panics, pointers it passes),
//! the real CUDA driver and NVML libraries, and the one table of their functions the shim
//! calls, built from the hook list.

#[macro_use]
pub(crate) mod hook_list;

pub(crate) mod ffi;
pub(crate) mod library;
pub(crate) mod table;
