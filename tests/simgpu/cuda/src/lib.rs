//! `libsimgpu_cuda.so`: a CUDA driver in which device memory is host memory, for tests
//! and demos on machines without a GPU.
//!
//! It exports the real driver ABI (names, `_v2` versions, per-thread-stream variants,
//! argument types and enum values of `cuda.h`, types taken from `cudarc::driver::sys`).
//! All processes sharing `SIMGPU_STATE` share the simulated devices (see the
//! `simgpu-state` crate): memory one process holds is gone for the others, and a process
//! that exits or is killed gives its memory back.
//!
//! Layout: `exports` declares every symbol once; each area of the API has its module.

mod array;
mod checkpoint;
mod context;
mod copy;
mod driver;
mod export_tables;
mod exports;
mod ffi;
mod graph;
mod green;
mod ipc;
mod memory;
mod module;
mod pool;
mod procaddr;
mod stream;
mod vmm;
