//! The GPUs of the node, found through NVML.

use gpufrac_common::protocol::DeviceId;

pub use gpufrac_common::gpu_uuid::parse as parse_uuid;

/// Every GPU NVML reports, with its memory.
pub fn discover() -> Result<Vec<(DeviceId, u64)>, String> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| nvml_init_error(&e))?;
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

/// What to check when NVML's library or the driver is missing.
const NVML_HINT: &str =
    "(is the NVIDIA driver installed? to try gpufrac without a GPU, see simgpu in the README)";

/// Why NVML could not be opened, with a hint when its library or the driver is missing.
pub fn nvml_init_error(e: &nvml_wrapper::error::NvmlError) -> String {
    use nvml_wrapper::error::NvmlError as E;
    match e {
        E::LibloadingError(_) | E::LibraryNotFound | E::DriverNotLoaded => {
            format!("cannot initialise NVML: {e} {NVML_HINT}")
        }
        _ => format!("cannot initialise NVML: {e}"),
    }
}

/// The processes using memory on each GPU, `(pid, bytes)`: how the arbiter learns of
/// memory used outside gpufrac (behind a trait so the policy is testable without NVML).
pub trait ProcessList: Send + Sync {
    /// Every managed GPU with what NVML lists on it; a GPU NVML cannot answer for is left
    /// out (what was last known of it stays).
    fn processes(&self) -> Vec<(DeviceId, Vec<(u32, u64)>)>;

    /// Each busy process's share of each GPU's time (0 to 1) since the previous call, for
    /// compute shares. A GPU with no new sample yet is left out (nothing is known of it);
    /// one with samples lists the processes that were busy (the others were idle).
    fn utilization(&self) -> Vec<(DeviceId, Vec<(u32, f64)>)> {
        Vec::new()
    }
}

/// Without any new sample for this long, a GPU's processes are taken to be idle (NVML
/// only reports processes that were busy; it samples every 1/6 s or so).
const IDLE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// [`ProcessList`] from NVML's compute and graphics processes. PIDs are the driver's (the host's), as
/// the arbiter's are with `hostPID: true`; memory NVML cannot report counts as none.
pub struct NvmlProcesses {
    nvml: nvml_wrapper::Nvml,
    /// Per GPU index: the newest utilization sample's timestamp and when it was read.
    sampled: std::sync::Mutex<std::collections::HashMap<u32, (u64, std::time::Instant)>>,
}

impl NvmlProcesses {
    /// Opens NVML.
    pub fn open() -> Result<NvmlProcesses, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| nvml_init_error(&e))?;
        Ok(NvmlProcesses { nvml, sampled: Default::default() })
    }
}

impl ProcessList for NvmlProcesses {
    fn processes(&self) -> Vec<(DeviceId, Vec<(u32, u64)>)> {
        let Ok(count) = self.nvml.device_count() else { return Vec::new() };
        (0..count)
            .filter_map(|i| {
                let dev = self.nvml.device_by_index(i).ok()?;
                let id = parse_uuid(&dev.uuid().ok()?)?;
                let mut listed = dev.running_compute_processes().ok()?;
                // Graphics contexts hold memory too (a process may be in both lists).
                listed.extend(dev.running_graphics_processes().unwrap_or_default());
                let mut used: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
                for p in listed {
                    let bytes = match p.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => bytes,
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                    };
                    let entry = used.entry(p.pid).or_default();
                    *entry = (*entry).max(bytes);
                }
                Some((id, used.into_iter().collect()))
            })
            .collect()
    }

    fn utilization(&self) -> Vec<(DeviceId, Vec<(u32, f64)>)> {
        let Ok(count) = self.nvml.device_count() else { return Vec::new() };
        let mut sampled = self.sampled.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        (0..count)
            .filter_map(|i| {
                let dev = self.nvml.device_by_index(i).ok()?;
                let id = parse_uuid(&dev.uuid().ok()?)?;
                let (last_seen, last_read) = sampled.get(&i).copied().unwrap_or((0, now));
                let samples = match dev.process_utilization_stats(last_seen) {
                    Ok(samples) => samples,
                    Err(nvml_wrapper::error::NvmlError::NotFound) => Vec::new(),
                    Err(_) => return None,
                };
                if samples.is_empty() {
                    // Nothing new: idle, once no sample came for a while; else not known yet.
                    if now.saturating_duration_since(last_read) < IDLE_AFTER {
                        sampled.entry(i).or_insert((last_seen, now));
                        return None;
                    }
                    sampled.insert(i, (last_seen, now));
                    return Some((id, Vec::new()));
                }
                let newest = samples.iter().map(|s| s.timestamp).max().unwrap_or(last_seen);
                sampled.insert(i, (newest, now));
                // Several samples of one process: each covers one sampling period.
                let mut per_pid: std::collections::BTreeMap<u32, (u64, u32)> = Default::default();
                for s in samples {
                    let e = per_pid.entry(s.pid).or_default();
                    *e = (e.0 + u64::from(s.sm_util.min(100)), e.1 + 1);
                }
                let shares =
                    per_pid.into_iter().map(|(pid, (sum, n))| (pid, sum as f64 / f64::from(n) / 100.0));
                Some((id, shares.collect()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nvml_comes_with_a_hint() {
        let missing = nvml_init_error(&nvml_wrapper::error::NvmlError::LibraryNotFound);
        assert!(
            missing.ends_with(
                "(is the NVIDIA driver installed? to try gpufrac without a GPU, see simgpu in the README)"
            ),
            "{missing}"
        );
        let other = nvml_init_error(&nvml_wrapper::error::NvmlError::NoPermission);
        assert!(!other.contains("simgpu"), "{other}");
    }
}
