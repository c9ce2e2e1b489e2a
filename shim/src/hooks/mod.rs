//! What the implemented hooks do: the memory paths, contexts and what the driver takes
//! without a size (heaps, modules), CUDA graphs' and stream-ordered pools, the virtual
//! device in CUDA and NVML, NVML's process lists, `cuInit`, and `gpufrac.h`'s queries.

pub(crate) mod context;
pub(crate) mod device;
pub(crate) mod graphs;
pub(crate) mod implicit;
pub(crate) mod memory;
pub(crate) mod nvml;
pub(crate) mod processes;
pub mod query;
