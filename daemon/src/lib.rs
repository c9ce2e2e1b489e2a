//! The node side of gpufrac: the arbiter daemon (`gpufrac-arbiter`: its policy, server and
//! metrics in [`arbiter`]) and the `gpufrac` CLI's commands (`run`, `status`, `top`,
//! `demo`). Binaries in `src/bin/` are thin wrappers over this library.
#![deny(missing_docs)]

pub mod arbiter;
pub mod checkpoint;
pub mod demo;
pub mod entitlement;
pub mod run;
pub mod status;
pub mod top;
