//! `gpufrac-arbiter`: the per-node daemon. `policy` is the ledger and the resolvers as
//! pure state; `server` speaks the protocol on the unix socket; `document` is the status
//! document both make and the CLI reads; `metrics` exports Prometheus metrics; `gpus`
//! finds the GPUs through NVML; `ratelimit` bounds the log lines one user can cause.

pub mod document;
pub mod gpus;
pub mod metrics;
pub mod policy;
pub mod ratelimit;
pub mod server;
