//! The GPUs of the node, found through NVML.

use gpufrac_common::protocol::DeviceId;

pub use gpufrac_common::gpu_uuid::parse as parse_uuid;

/// Every GPU NVML reports, with its memory.
pub fn discover() -> Result<Vec<(DeviceId, u64)>, String> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("cannot initialise NVML: {e}"))?;
    let count = nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?;
    (0..count)
        .map(|i| {
            let dev = nvml.device_by_index(i).map_err(|e| format!("NVML device {i}: {e}"))?;
            let uuid = dev.uuid().map_err(|e| format!("NVML device {i} UUID: {e}"))?;
            let id = parse_uuid(&uuid).ok_or_else(|| format!("NVML device {i}: unreadable UUID {uuid:?}"))?;
            let total = dev.memory_info().map_err(|e| format!("NVML device {i} memory: {e}"))?.total;
            Ok((id, total))
        })
        .collect()
}
