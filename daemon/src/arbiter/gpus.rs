//! The GPUs of the node, found through NVML.

use gpufrac_common::protocol::DeviceId;

/// Parses NVML's `GPU-xxxxxxxx-xxxx-...` into UUID bytes.
pub fn parse_uuid(text: &str) -> Option<DeviceId> {
    let hex: String = text.strip_prefix("GPU-").unwrap_or(text).chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

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
