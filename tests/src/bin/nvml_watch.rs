//! Watches the GPU's per-process utilization through NVML as the arbiter does, for
//! `tests/tests/simgpu_timeslice.rs`: `nvml_watch <milliseconds>` polls
//! `nvmlDeviceGetProcessUtilization` (nvml-wrapper) on device 0 every 100 ms with the last
//! timestamp seen, then prints `WATCH {"means": {pid: mean smUtil}, "answers": n,
//! "not_found": n}` (a process without a sample in an answer had 0% then).

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn main() {
    let ms: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .expect("usage: nvml_watch <milliseconds to watch for>");
    let nvml = nvml_wrapper::Nvml::init().expect("nvmlInit");
    let device = nvml.device_by_index(0).expect("device 0");
    // Start from now: the first answer covers the samples since.
    let mut last =
        SystemTime::now().duration_since(UNIX_EPOCH).expect("the clock is past 1970").as_micros() as u64;
    let mut sums: HashMap<u32, (u64, u64)> = HashMap::new();
    let (mut answers, mut not_found) = (0u32, 0u32);
    let end = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        match device.process_utilization_stats(last) {
            Ok(samples) => {
                answers += 1;
                for s in &samples {
                    let entry = sums.entry(s.pid).or_default();
                    entry.0 += u64::from(s.sm_util);
                    last = last.max(s.timestamp);
                }
                // Processes without a sample this time had 0%.
                for entry in sums.values_mut() {
                    entry.1 += 1;
                }
            }
            Err(nvml_wrapper::error::NvmlError::NotFound) => not_found += 1,
            Err(e) => panic!("nvmlDeviceGetProcessUtilization: {e}"),
        }
    }
    let means: HashMap<String, f64> =
        sums.iter().map(|(pid, (sum, n))| (pid.to_string(), *sum as f64 / (*n).max(1) as f64)).collect();
    let report = serde_json::json!({ "means": means, "answers": answers, "not_found": not_found });
    println!("WATCH {report}");
}
