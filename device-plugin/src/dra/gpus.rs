//! The node's GPUs as NVML describes them: what a ResourceSlice advertises of each.

use nvml_wrapper::Nvml;

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

/// The GPUs NVML reports.
pub fn discover() -> Result<Vec<GpuInfo>, String> {
    let nvml = Nvml::init().map_err(|e| nvml_init_error(&e))?;
    let driver_version = nvml.sys_driver_version().map_err(|e| format!("NVML driver version: {e}"))?;
    let cuda = nvml.sys_cuda_driver_version().map_err(|e| format!("NVML CUDA driver version: {e}"))?;
    let cuda_version = (cuda / 1000, (cuda % 1000) / 10);
    let count = nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?;
    (0..count)
        .map(|index| {
            let what =
                |field: &str, e: nvml_wrapper::error::NvmlError| format!("NVML device {index} {field}: {e}");
            let dev = nvml.device_by_index(index).map_err(|e| what("handle", e))?;
            let capability = dev.cuda_compute_capability().map_err(|e| what("compute capability", e))?;
            Ok(GpuInfo {
                index,
                uuid: dev.uuid().map_err(|e| what("UUID", e))?,
                product_name: dev.name().map_err(|e| what("name", e))?,
                memory: dev.memory_info().map_err(|e| what("memory", e))?.total,
                compute_capability: (capability.major, capability.minor),
                driver_version: driver_version.clone(),
                cuda_version,
                pci_bus_id: dev.pci_info().map_err(|e| what("PCI info", e))?.bus_id,
            })
        })
        .collect()
}
