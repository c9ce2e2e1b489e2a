//! The node's GPUs through NVML, and their health from XID events: a GPU that reports a
//! critical XID becomes unhealthy, except for the XIDs that applications cause (NVIDIA's
//! own plugin ignores those too).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use tokio::sync::watch;

use super::devices::Gpu;

/// XIDs caused by applications, not by the GPU: they leave it healthy.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// The GPUs NVML reports, all healthy.
pub fn discover() -> Result<Vec<Gpu>, String> {
    let nvml = Nvml::init().map_err(|e| nvml_init_error(&e))?;
    let count = nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?;
    (0..count)
        .map(|i| {
            let dev = nvml.device_by_index(i).map_err(|e| format!("NVML device {i}: {e}"))?;
            let uuid = dev.uuid().map_err(|e| format!("NVML device {i} UUID: {e}"))?;
            Ok(Gpu { uuid, healthy: true })
        })
        .collect()
}

/// What to check when NVML's library or the driver is missing.
const NVML_HINT: &str =
    "(is the NVIDIA driver installed? to try gpufrac without a GPU, see simgpu in the README)";

/// Why NVML could not be opened, with a hint when its library or the driver is missing.
pub fn nvml_init_error(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound | NvmlError::DriverNotLoaded => {
            format!("cannot initialise NVML: {e} {NVML_HINT}")
        }
        _ => format!("cannot initialise NVML: {e}"),
    }
}

/// The XID watcher's thread, and the GPUs' health it keeps current.
pub struct HealthWatcher {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl HealthWatcher {
    /// Starts watching XID events for `gpus` on a thread of its own; the receiver sees
    /// every change of their health.
    pub fn start(gpus: Vec<Gpu>) -> std::io::Result<(HealthWatcher, watch::Receiver<Vec<Gpu>>)> {
        let (tx, rx) = watch::channel(gpus);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name("xid-events".into()).spawn(move || watch_xids(tx, stop))?
        };
        Ok((HealthWatcher { stop, thread }, rx))
    }

    /// Stops the thread and waits for it (within its 200 ms wait for events).
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// Watches XID events until `stop`, marking GPUs unhealthy in `gpus`. Blocking: run it
/// on its own thread.
pub fn watch_xids(gpus: watch::Sender<Vec<Gpu>>, stop: Arc<AtomicBool>) {
    if let Err(e) = watch_loop(&gpus, &stop) {
        tracing::error!("GPU health from NVML events stopped: {e}");
    }
}

fn watch_loop(gpus: &watch::Sender<Vec<Gpu>>, stop: &AtomicBool) -> Result<(), NvmlError> {
    let nvml = Nvml::init()?;
    let mut set = nvml.create_event_set()?;
    for i in 0..nvml.device_count()? {
        let dev = nvml.device_by_index(i)?;
        set = dev.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| e.error)?;
    }
    while !stop.load(Ordering::Relaxed) {
        match set.wait(200) {
            Ok(event) => {
                let xid = match event.event_data {
                    Some(XidError::Value(v)) => v,
                    _ => 0,
                };
                let uuid = event.device.uuid()?;
                if APPLICATION_XIDS.contains(&xid) {
                    tracing::info!(gpu = %uuid, xid, "application XID: the GPU stays healthy");
                    continue;
                }
                tracing::warn!(gpu = %uuid, xid, "critical XID: marking the GPU unhealthy");
                gpus.send_modify(|list| {
                    for g in list.iter_mut().filter(|g| g.uuid == uuid) {
                        g.healthy = false;
                    }
                });
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!("waiting for NVML events: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nvml_comes_with_a_hint() {
        let missing = nvml_init_error(&NvmlError::LibraryNotFound);
        assert!(
            missing.ends_with(
                "(is the NVIDIA driver installed? to try gpufrac without a GPU, see simgpu in the README)"
            ),
            "{missing}"
        );
        let other = nvml_init_error(&NvmlError::NoPermission);
        assert!(!other.contains("simgpu"), "{other}");
    }
}
