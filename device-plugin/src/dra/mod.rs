//! The DRA kubelet plugin (`gpufrac-device-plugin dra`): the cluster's scheduler places
//! each claim's memory on one GPU with room, and the claim carries the fraction.
//!
//! - `api`: the generated kubelet APIs (DRA `v1` and `v1beta1`, plugin registration `v1`);
//! - `gpus`: the node's GPUs as NVML describes them;
//! - `topology`: where each GPU sits (PCIe root, NUMA node, NVLink), for claims that
//!   constrain their GPUs;
//! - `slices`: the ResourceSlice that advertises them, each GPU one device whose `memory`
//!   and `compute` capacities many claims share, and its publisher;
//! - `config`: a claim's opaque `gpufrac.io/v1` configuration, validated;
//! - `quantity`: Kubernetes quantities read as the API server reads them;
//! - `claim`: an allocated ResourceClaim → the fraction it holds of each GPU;
//! - `cdi`: the CDI spec that makes the container (the shim, its settings, the GPU);
//! - `driver`: prepare and unprepare, recorded in the checkpoint;
//! - `service`: the tonic services (DRA `v1`, `v1beta1`, registration) over `driver`;
//! - `runner`: serve, stay registered through kubelet restarts, publish, stop cleanly.

/// The generated kubelet APIs.
pub mod api {
    /// DRA kubelet plugin API `v1` (kubelets 1.34+).
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// DRA kubelet plugin API `v1beta1` (kubelets that do not have `v1`).
    #[allow(missing_docs, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
    /// The kubelet's plugin registration API (`pluginregistration/v1`).
    #[allow(missing_docs, clippy::all)]
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
}

pub mod cdi;
pub mod claim;
pub mod config;
pub mod driver;
pub mod gpus;
pub mod quantity;
pub mod runner;
pub mod service;
pub mod slices;
pub mod topology;

pub use gpufrac_common::dra::DRIVER;

/// The DRA socket's file name in the plugin's folder.
pub const DRA_SOCKET: &str = "dra.sock";

/// The registration socket's file name in the kubelet's plugin registry.
pub fn registration_socket_name() -> String {
    format!("{DRIVER}-reg.sock")
}

/// The DRA service versions this plugin serves, as the kubelet names them.
pub const SERVED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
