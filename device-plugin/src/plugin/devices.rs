//! Shares: each GPU is advertised as `shares_per_gpu` devices with IDs `<GPU UUID>::<n>`.

use super::api::Device;

/// The resource the plugin advertises.
pub const RESOURCE_NAME: &str = "gpufrac.io/gpu";
/// The device plugin API version.
pub const API_VERSION: &str = "v1beta1";
/// Device health as the kubelet spells it.
pub const HEALTHY: &str = "Healthy";
/// Device health as the kubelet spells it.
pub const UNHEALTHY: &str = "Unhealthy";
/// Kubernetes device IDs are at most this long.
pub const MAX_ID_LEN: usize = 63;

/// A GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// `GPU-...` UUID, as NVML reports it.
    pub uuid: String,
    /// Whether it is fit for work (no critical XID seen).
    pub healthy: bool,
}

/// The ID of share `n` of the GPU `uuid`.
pub fn share_id(uuid: &str, n: u32) -> String {
    format!("{uuid}::{n}")
}

/// The GPU UUID and share number of an ID.
pub fn parse_share_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, n) = id.rsplit_once("::")?;
    (!uuid.is_empty()).then_some(())?;
    Some((uuid, n.parse().ok()?))
}

/// The full device list the kubelet is sent.
pub fn device_list(gpus: &[Gpu], shares_per_gpu: u32) -> Vec<Device> {
    gpus.iter()
        .flat_map(|gpu| {
            (0..shares_per_gpu).map(move |n| Device {
                id: share_id(&gpu.uuid, n),
                health: if gpu.healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_fit_kubernetes() {
        let uuid = "GPU-516d6770-7500-0000-0000-000000000000";
        let id = share_id(uuid, 99);
        assert!(id.len() <= MAX_ID_LEN);
        assert_eq!(parse_share_id(&id), Some((uuid, 99)));
        assert_eq!(parse_share_id("nope"), None);
        assert_eq!(parse_share_id("::3"), None);
        assert_eq!(parse_share_id("GPU-x::y"), None);
        let list = device_list(&[Gpu { uuid: uuid.into(), healthy: false }], 3);
        assert_eq!(list.len(), 3);
        assert!(list.iter().all(|d| d.health == UNHEALTHY));
    }
}
