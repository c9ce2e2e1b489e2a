//! What every gpufrac component agrees on: how sizes and durations are written by users,
//! and which versioned symbol the CUDA driver answers for each entry point.
//!
//! Kept free of heavy dependencies because the shim links it into other people's processes.
#![deny(missing_docs)]

pub mod cuda_procs;
pub mod cuda_sizes;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod gpu_uuid;
pub mod protocol;
pub mod resolver;
pub mod shm;
pub mod size;

pub use resolver::Resolver;
pub use size::{parse_bytes, parse_duration, parse_size, SizeError, SizeSpec};
