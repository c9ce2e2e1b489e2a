//! The node side of gpufrac: the arbiter daemon (to come) and the `gpufrac` CLI's
//! commands. Binaries in `src/bin/` are thin wrappers over this library.
#![deny(missing_docs)]

pub mod arbiter;
pub mod checkpoint;
pub mod demo;
pub mod entitlement;
pub mod run;
pub mod status;
pub mod top;
