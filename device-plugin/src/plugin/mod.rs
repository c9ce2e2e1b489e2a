//! The kubelet device plugin: each GPU advertised as shares of `gpufrac.io/gpu`.
//!
//! - `api`: the generated `v1beta1` protocol;
//! - `devices`: share IDs and the device list;
//! - `allocation`: preferred allocation (bin packing) and `Allocate`'s answer, as pure logic;
//! - `service`: the tonic `DevicePlugin` service, forwarding to the above;
//! - `health`: NVML XID events → device health;
//! - `runner`: serve, register, re-register after a kubelet restart, stop cleanly.

/// The generated kubelet device plugin API (`v1beta1`).
#[allow(missing_docs, clippy::all)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

pub mod allocation;
pub mod devices;
pub mod health;
pub mod runner;
pub mod service;
