//! The GPUs of the node, found through NVML.

use gpufrac_common::protocol::DeviceId;

pub use gpufrac_common::gpu_uuid::parse as parse_uuid;
use gpufrac_common::size::format_size;
use gpufrac_common::SizeSpec;

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

/// How much of each GPU `(uuid, memory)` gpufrac manages under `--gpu-memory` `spec`:
/// `(uuid, managed bytes)`; refused, naming the flag, when it is more than a GPU has or
/// comes to nothing.
pub fn managed(spec: SizeSpec, gpus: &[(DeviceId, u64)]) -> Result<Vec<(DeviceId, u64)>, String> {
    gpus.iter()
        .map(|&(id, total)| {
            let managed = spec.resolve(total);
            let gpu = crate::arbiter::policy::uuid_string(&id);
            if managed > total {
                return Err(format!(
                    "--gpu-memory {}: more than GPU {gpu} has ({}); give at most its size, or a fraction such as 0.5",
                    format_size(managed),
                    format_size(total)
                ));
            }
            if managed == 0 {
                return Err(format!("--gpu-memory: nothing of GPU {gpu} ({})", format_size(total)));
            }
            Ok((id, managed))
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

    /// Each busy process's share of each GPU's time (0 to 1), from its newest sample of
    /// the last second, for compute shares; a process without one was idle. A GPU NVML
    /// cannot answer for is left out.
    fn utilization(&self) -> Vec<(DeviceId, Vec<(u32, f64)>)> {
        Vec::new()
    }
}

/// Without any new sample for this long, a process is taken to be idle (NVML only reports
/// processes that were busy; a real GPU's driver samples every 1/6 s or so).
const IDLE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// [`ProcessList`] from NVML's compute and graphics processes. PIDs are the driver's (the host's), as
/// the arbiter's are with `hostPID: true`; memory NVML cannot report counts as none.
pub struct NvmlProcesses {
    nvml: nvml_wrapper::Nvml,
    /// Per GPU index: what utilization samples said so far.
    sampled: std::sync::Mutex<std::collections::HashMap<u32, Sampled>>,
}

/// A GPU's utilization samples as read so far.
#[derive(Default)]
struct Sampled {
    /// The newest sample's timestamp (NVML's `lastSeenTimeStamp` for the next read).
    last_timestamp: u64,
    /// Each process's newest sample: its share, its timestamp and when it was read.
    latest: std::collections::HashMap<u32, (f64, u64, std::time::Instant)>,
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
                let bytes = |list: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>| {
                    list.into_iter()
                        .map(|p| match p.used_gpu_memory {
                            nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => (p.pid, bytes),
                            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => (p.pid, 0),
                        })
                        .collect::<Vec<_>>()
                };
                let compute = bytes(dev.running_compute_processes().ok()?);
                // Graphics contexts hold memory too (a process may be in both lists).
                let graphics = bytes(dev.running_graphics_processes().unwrap_or_default());
                Some((id, merge(&compute, &graphics)))
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
                let seen = sampled.entry(i).or_default();
                let samples = match dev.process_utilization_stats(seen.last_timestamp) {
                    Ok(samples) => samples,
                    Err(nvml_wrapper::error::NvmlError::NotFound) => Vec::new(),
                    Err(_) => return None,
                };
                // Each process's newest sample stands until a newer one or until it is
                // IDLE_AFTER old: the driver samples processes on schedules of their own, so a
                // batch without a process does not mean it was idle.
                for s in samples {
                    seen.last_timestamp = seen.last_timestamp.max(s.timestamp);
                    let share = f64::from(s.sm_util.min(100)) / 100.0;
                    match seen.latest.get_mut(&s.pid) {
                        Some(entry) if entry.1 > s.timestamp => {}
                        Some(entry) => *entry = (share, s.timestamp, now),
                        None => {
                            seen.latest.insert(s.pid, (share, s.timestamp, now));
                        }
                    }
                }
                seen.latest.retain(|_, &mut (_, _, read)| now.saturating_duration_since(read) < IDLE_AFTER);
                Some((id, seen.latest.iter().map(|(&pid, &(share, _, _))| (pid, share)).collect()))
            })
            .collect()
    }
}

/// Each process's memory from NVML's compute and graphics lists: a process listed more
/// than once in one list (a context per entry: one per copy of the driver it loaded, as a
/// program that loads a private copy does) uses the sum; one in both lists is the same
/// memory seen twice, the larger figure.
pub fn merge(compute: &[(u32, u64)], graphics: &[(u32, u64)]) -> Vec<(u32, u64)> {
    use std::collections::BTreeMap;
    let sum = |list: &[(u32, u64)]| {
        let mut used: BTreeMap<u32, u64> = BTreeMap::new();
        for &(pid, bytes) in list {
            let entry = used.entry(pid).or_default();
            *entry = entry.saturating_add(bytes);
        }
        used
    };
    let mut used = sum(compute);
    for (pid, bytes) in sum(graphics) {
        let entry = used.entry(pid).or_default();
        *entry = (*entry).max(bytes);
    }
    used.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_of_one_list_add_up_and_the_two_lists_overlap() {
        let compute = [(7, 100), (9, 5), (7, 50)];
        let graphics = [(7, 120), (8, 30), (9, 10)];
        assert_eq!(merge(&compute, &graphics), [(7, 150), (8, 30), (9, 10)]);
        assert_eq!(merge(&[(1, u64::MAX), (1, 1)], &[]), [(1, u64::MAX)]);
    }

    #[test]
    fn a_managed_size_is_of_each_gpu_and_never_more() {
        let gpus = [([1; 16], 64 << 30), ([2; 16], 16 << 30)];
        assert_eq!(
            managed(SizeSpec::Fraction(0.25), &gpus).unwrap(),
            [([1; 16], 16 << 30), ([2; 16], 4 << 30)]
        );
        assert_eq!(
            managed(SizeSpec::Bytes(16 << 30), &gpus).unwrap(),
            [([1; 16], 16 << 30), ([2; 16], 16 << 30)]
        );
        let more = managed(SizeSpec::Bytes(20 << 30), &gpus).unwrap_err();
        assert!(
            more.starts_with("--gpu-memory 20.00 GiB: more than GPU ") && more.contains("(16.00 GiB)"),
            "{more}"
        );
        assert!(managed(SizeSpec::Fraction(1e-12), &gpus)
            .unwrap_err()
            .starts_with("--gpu-memory: nothing of GPU"));
    }

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
