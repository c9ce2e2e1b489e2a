//! Control: what holds the process's work back or moves its memory. The gate every launch
//! passes, at the bottom; the compute lease; swapping burst memory to host RAM and back;
//! parking a whole idle process; the thunks that hold what the shim does not hook; giving
//! back what frameworks keep; the arbiter client, whose pushed messages take one route.

pub mod gate;

pub(crate) mod arbiter;
pub(crate) mod compute;
pub(crate) mod give_back;
pub(crate) mod park;
pub(crate) mod swap;
pub(crate) mod thunks;
