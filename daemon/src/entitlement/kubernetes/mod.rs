//! Entitlements on a Kubernetes node (skeleton).

/// The generated kubelet PodResources API (`podresources/v1`).
#[allow(missing_docs, clippy::all)]
pub mod api {
    tonic::include_proto!("v1");
}
