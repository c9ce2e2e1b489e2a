//! The node's GPUs as NVML describes them: what a ResourceSlice advertises of each, and
//! where each sits (PCIe root, NUMA node, NVLink peers; see `topology`).

use std::path::Path;

use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
use nvml_wrapper::Nvml;

use super::topology::{self, NvLinks};
use crate::plugin::health::nvml_init_error;

/// One GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML's index: the device is `gpu-<index>` in the slice.
    pub index: u32,
    /// `GPU-...` UUID.
    pub uuid: String,
    /// Product name (`NVIDIA H100 80GB HBM3`).
    pub product_name: String,
    /// Device memory in bytes.
    pub memory: u64,
    /// CUDA compute capability, major and minor.
    pub compute_capability: (i32, i32),
    /// The driver's version as NVML prints it (`550.54.15`).
    pub driver_version: String,
    /// The CUDA version the driver supports, major and minor (`12.4`).
    pub cuda_version: (i32, i32),
    /// PCI bus ID (`00000000:65:00.0`).
    pub pci_bus_id: String,
    /// Where it sits, as far as sysfs and NVML tell.
    pub topology: Topology,
}

/// Where a GPU sits: what tensor-parallel claims constrain their GPUs with. Each is `None`
/// where sysfs or NVML could not tell (its attribute is then left out of the slice).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// Its PCIe root complex, `pci<domain>:<bus>` (`pci0000:64`).
    pub pcie_root: Option<String>,
    /// Its NUMA node; `None` too for a GPU without NUMA affinity.
    pub numa_node: Option<u32>,
    /// The indexes of the GPUs it has NVLink to (empty: none).
    pub nvlink_peers: Option<Vec<u32>>,
    /// Its NVLink domain ([`NvLinks::domains`]).
    pub nvlink_domain: Option<u32>,
}

impl GpuInfo {
    /// Its device name in the ResourceSlice.
    pub fn device_name(&self) -> String {
        device_name(self.index)
    }
}

/// The device name of the GPU of NVML index `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The device name of share `share` of the GPU of NVML index `index`.
pub fn share_name(index: u32, share: u32) -> String {
    format!("gpu-{index}-{share}")
}

/// The GPU index and share number a slice device name stands for: `gpu-<index>` (the
/// whole GPU, `None`) or `gpu-<index>-<share>`.
pub fn parse_device_name(name: &str) -> Option<(u32, Option<u32>)> {
    let rest = name.strip_prefix("gpu-")?;
    let number = |text: &str| {
        (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse().ok()).flatten()
    };
    match rest.split_once('-') {
        None => Some((number(rest)?, None)),
        Some((index, share)) => Some((number(index)?, Some(number(share)?))),
    }
}

/// The GPUs NVML reports, with their place read from the sysfs under `sysfs_root`
/// (`/` but in tests).
pub fn discover(sysfs_root: &Path) -> Result<Vec<GpuInfo>, String> {
    let nvml = Nvml::init().map_err(|e| nvml_init_error(&e))?;
    let driver_version = nvml.sys_driver_version().map_err(|e| format!("NVML driver version: {e}"))?;
    let cuda = nvml.sys_cuda_driver_version().map_err(|e| format!("NVML CUDA driver version: {e}"))?;
    let cuda_version = (cuda / 1000, (cuda % 1000) / 10);
    let count = nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?;
    let mut gpus = (0..count)
        .map(|index| {
            let what =
                |field: &str, e: nvml_wrapper::error::NvmlError| format!("NVML device {index} {field}: {e}");
            let dev = nvml.device_by_index(index).map_err(|e| what("handle", e))?;
            let capability = dev.cuda_compute_capability().map_err(|e| what("compute capability", e))?;
            let pci_bus_id = dev.pci_info().map_err(|e| what("PCI info", e))?.bus_id;
            // Placement hints, not needed to serve: an error leaves the attribute out.
            let pcie_root = topology::pcie_root(sysfs_root, &pci_bus_id)
                .map_err(|e| tracing::debug!(gpu = index, "no PCIe root attribute: {e}"))
                .ok();
            let numa_node = topology::numa_node(sysfs_root, &pci_bus_id)
                .map_err(|e| tracing::debug!(gpu = index, "no NUMA node attribute: {e}"))
                .ok()
                .flatten();
            Ok(GpuInfo {
                index,
                uuid: dev.uuid().map_err(|e| what("UUID", e))?,
                product_name: dev.name().map_err(|e| what("name", e))?,
                memory: dev.memory_info().map_err(|e| what("memory", e))?.total,
                compute_capability: (capability.major, capability.minor),
                driver_version: driver_version.clone(),
                cuda_version,
                pci_bus_id,
                topology: Topology { pcie_root, numa_node, ..Topology::default() },
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let links = nvlinks(&nvml, count);
    let domains = links.domains(&gpus.iter().map(|g| g.index).collect::<Vec<_>>());
    for gpu in &mut gpus {
        gpu.topology.nvlink_peers = links.peers(gpu.index);
        gpu.topology.nvlink_domain = domains.get(&gpu.index).copied();
    }
    Ok(gpus)
}

/// NVLink between each pair of the `count` GPUs, as NVML's peer-to-peer status tells.
fn nvlinks(nvml: &Nvml, count: u32) -> NvLinks {
    let mut links = NvLinks::default();
    for a in 0..count {
        for b in a + 1..count {
            let status = nvml
                .device_by_index(a)
                .and_then(|dev_a| Ok((dev_a, nvml.device_by_index(b)?)))
                .and_then(|(dev_a, dev_b)| dev_a.p2p_status(&dev_b, P2pCapabilitiesIndex::NvLink));
            match status {
                Ok(P2pStatus::Ok) => {
                    links.linked.insert((a, b));
                }
                // Any other status is an answer: no NVLink between them.
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(gpu = a, peer = b, "no NVLink attributes: NVML peer-to-peer status: {e}");
                    links.unknown.extend([a, b]);
                }
            }
        }
    }
    links
}
