//! Floods a device with `simgpu_sleep_us` kernels, keeping `--depth` of them in flight
//! (launch `depth` kernels, synchronize, again) for `--seconds`, then prints one JSON line
//! on stdout:
//!
//! ```text
//! simgpu_flood --device 0 --kernel-us 1000 --depth 4 --seconds 2 [--latencies]
//! {"pid":1234,"device":0,"kernel_us":1000,"depth":4,"kernels":3992,"syncs":998,
//!  "wall_s":2.001,"sync_us":{"mean":2005.1,"p50":2001.0,"p99":2150.0,"max":2410.0}}
//! ```
//!
//! `sync_us` is the latency of each round: from the launch of its first kernel to the
//! return of its synchronize (with `--latencies`, every round's latency is listed too,
//! as `"latencies_us":[...]`). On simgpu a sleep kernel needs `kernel-us` of device time,
//! so under time-slicing with other processes the rounds stretch. Bad arguments: a usage
//! line on stderr and exit status 2; a failed CUDA call: exit status 1.

use std::ffi::c_void;
use std::process::exit;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};

const USAGE: &str = "usage: simgpu_flood --device N --kernel-us N --depth N --seconds SECONDS [--latencies]";

struct Options {
    device: i32,
    kernel_us: u64,
    depth: u32,
    seconds: f64,
    latencies: bool,
}

fn usage(problem: &str) -> ! {
    eprintln!("simgpu_flood: {problem}\n{USAGE}");
    exit(2);
}

fn parse_options(args: &[String]) -> Options {
    let (mut device, mut kernel_us, mut depth, mut seconds, mut latencies) = (None, None, None, None, false);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--latencies" {
            latencies = true;
            continue;
        }
        let Some(value) = it.next() else { usage(&format!("{flag} needs a value")) };
        let number = |max: f64| -> f64 {
            match value.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 && v <= max => v,
                _ => usage(&format!("{flag} {value:?}: expected a number above 0, at most {max}")),
            }
        };
        let whole = |max: u64| -> u64 {
            match value.parse::<u64>() {
                Ok(v) if v <= max => v,
                _ => usage(&format!("{flag} {value:?}: expected a whole number from 0 to {max}")),
            }
        };
        let seen = match flag.as_str() {
            "--device" => device.replace(whole(15) as i32).is_some(),
            "--kernel-us" => kernel_us.replace(whole(10_000_000).max(1)).is_some(),
            "--depth" => depth.replace(whole(4096).max(1) as u32).is_some(),
            "--seconds" => seconds.replace(number(3600.0)).is_some(),
            _ => usage(&format!("unknown argument {flag:?}")),
        };
        if seen {
            usage(&format!("{flag} given twice"));
        }
    }
    Options {
        device: device.unwrap_or_else(|| usage("--device is required")),
        kernel_us: kernel_us.unwrap_or_else(|| usage("--kernel-us is required")),
        depth: depth.unwrap_or_else(|| usage("--depth is required")),
        seconds: seconds.unwrap_or_else(|| usage("--seconds is required")),
        latencies,
    }
}

fn check(what: &str, result: CUresult) {
    if result != CUresult::CUDA_SUCCESS {
        eprintln!("simgpu_flood: {what} failed: {result:?}");
        exit(1);
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = parse_options(&args);
    // SAFETY: in all the calls below, every out-pointer is a live local, every handle was
    // made by the driver in this program, and kernel parameters point to a live u64.
    unsafe {
        check("cuInit", sys::cuInit(0));
        let mut count = 0;
        check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count));
        if opts.device >= count {
            usage(&format!("--device {}: the machine has {count} devices", opts.device));
        }
        let mut dev = 0;
        check("cuDeviceGet", sys::cuDeviceGet(&mut dev, opts.device));
        let mut ctx = null_mut();
        check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        let mut module = null_mut();
        check("cuModuleLoadData", sys::cuModuleLoadData(&mut module, c"simgpu_flood".as_ptr().cast()));
        let mut sleep = null_mut();
        check(
            "cuModuleGetFunction",
            sys::cuModuleGetFunction(&mut sleep, module, c"simgpu_sleep_us".as_ptr()),
        );
        let mut stream = null_mut();
        check("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));

        let run_for = Duration::from_secs_f64(opts.seconds);
        let mut latencies = Vec::new();
        let mut kernels = 0u64;
        let started = Instant::now();
        while started.elapsed() < run_for {
            let round = Instant::now();
            for _ in 0..opts.depth {
                let mut us = opts.kernel_us;
                let mut params = [(&mut us as *mut u64).cast::<c_void>()];
                check(
                    "cuLaunchKernel",
                    sys::cuLaunchKernel(sleep, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr(), null_mut()),
                );
            }
            check("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
            latencies.push(round.elapsed().as_secs_f64() * 1e6);
            kernels += u64::from(opts.depth);
        }
        let wall = started.elapsed().as_secs_f64();
        check("cuStreamDestroy", sys::cuStreamDestroy_v2(stream));

        let mut sorted = latencies.clone();
        sorted.sort_by(f64::total_cmp);
        let mean = sorted.iter().sum::<f64>() / sorted.len().max(1) as f64;
        let mut report = serde_json::json!({
            "pid": std::process::id(),
            "device": opts.device,
            "kernel_us": opts.kernel_us,
            "depth": opts.depth,
            "kernels": kernels,
            "syncs": latencies.len(),
            "wall_s": wall,
            "sync_us": {
                "mean": mean,
                "p50": percentile(&sorted, 50.0),
                "p99": percentile(&sorted, 99.0),
                "max": sorted.last().copied().unwrap_or(0.0),
            },
        });
        if opts.latencies {
            report["latencies_us"] = serde_json::json!(latencies);
        }
        println!("{report}");
    }
}
