//! `gpufrac-device-plugin`: the Kubernetes device plugin that advertises each GPU as
//! fractional shares (`plugin`), and the admission webhook that turns pod annotations
//! into those shares and the shim's settings (`webhook`).
#![deny(missing_docs)]

pub mod plugin;
pub mod webhook;
