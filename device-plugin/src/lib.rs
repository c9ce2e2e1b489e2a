//! `gpufrac-device-plugin`: the Kubernetes device plugin that advertises each GPU as
//! fractional shares (`plugin`), the DRA kubelet plugin that lets the scheduler place
//! memory fractions on GPUs (`dra`), and the admission webhook that turns pod annotations
//! into shares and the shim's settings (`webhook`).
#![deny(missing_docs)]

pub mod dra;
pub mod plugin;
pub mod webhook;
