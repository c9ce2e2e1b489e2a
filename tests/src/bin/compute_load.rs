//! A GPU workload for the compute-share tests and benchmark: either a flood that keeps
//! the GPU as busy as it can, or a latency-sensitive server answering requests that
//! arrive at random. Kernels are simgpu's `simgpu_sleep_us` (each needs that much of the
//! device's time; under time-slicing its wall time stretches). One line on stdout at the
//! end, `report` and a JSON object:
//!
//! ```text
//! compute_load flood --kernel-us 1000 --depth 4 --seconds 10 --warmup 2
//! report {"mode":"flood","pid":1234,"kernels":9800,"wall_s":10.0}
//! compute_load requests --kernel-us 2000 --mean-gap-us 8000 --seconds 10 --seed 7
//! report {"mode":"requests","pid":1235,"kernels":1250,"wall_s":10.0,
//!  "queueing_us":{"p50":95.0,"p99":2400.0,"max":3100.0,"mean":310.0},
//!  "worst":[{"at_ms":5123.4,"queueing_us":9100.0,"began_late_us":6000.0,"launch_us":1100.0,
//!  "sync_us":2050.0},...],"started_unix_ms":1795000000000}
//! ```
//!
//! `--stream per-thread` sends the kernels to the thread's per-thread default stream
//! (`CU_STREAM_PER_THREAD`) instead of a stream of its own.
//!
//! `worst`: the requests that queued longest (at most eight), each with its arrival after
//! the measured part's start (`started_unix_ms`, wall clock) and where its time went: how
//! late it began after its arrival (behind earlier requests, or this thread not running),
//! its launch (a wait for a compute lease included) and its synchronize.
//!
//! A request's *queueing delay* is the time from its arrival to its answer, less its
//! kernel's own device time: the wait behind earlier requests of this server, behind
//! other processes' work on the GPU, and the launch and synchronize themselves. Arrivals
//! are a Poisson process (exponential gaps of `--mean-gap-us` on average, seeded), the
//! way independent clients' requests arrive; they are served one at a time, in order.
//!
//! Prints `ready` on stdout once its context is up, and starts when its stdin gets a
//! line (or at once with `--now`), so that several processes start their measured
//! part together. `--warmup S` runs unmeasured for S seconds first (a flood floods, a
//! server sends a request every mean gap). Bad arguments: usage on stderr, exit status 2; a failed CUDA call:
//! exit status 1.

use std::ffi::c_void;
use std::io::BufRead;
use std::process::exit;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUfunction, CUresult, CUstream};
use gpufrac_e2e::rng::Rng;

/// How many of the longest-queued requests the report lists.
const WORST: usize = 8;

const USAGE: &str = "usage: compute_load flood --kernel-us N --depth N --seconds S [--warmup S] [--stream own|per-thread] [--now]\n       compute_load requests --kernel-us N --mean-gap-us N --seconds S [--seed N] [--warmup S] [--stream own|per-thread] [--now]";

fn usage(problem: &str) -> ! {
    eprintln!("compute_load: {problem}\n{USAGE}");
    exit(2);
}

#[derive(Default)]
struct Options {
    flood: bool,
    kernel_us: u64,
    depth: u32,
    mean_gap_us: u64,
    seconds: f64,
    seed: u64,
    now: bool,
    warmup: f64,
    /// Its kernels go to the calling thread's per-thread default stream
    /// (`CU_STREAM_PER_THREAD`), not a stream of its own.
    per_thread: bool,
}

fn parse(args: &[String]) -> Options {
    let mut o = Options { seed: 1, depth: 1, ..Options::default() };
    let mut it = args.iter();
    o.flood = match it.next().map(String::as_str) {
        Some("flood") => true,
        Some("requests") => false,
        Some(other) => usage(&format!("unknown mode {other:?}")),
        None => usage("a mode is required"),
    };
    let (mut kernel, mut gap, mut seconds) = (None, None, None);
    while let Some(flag) = it.next() {
        if flag == "--now" {
            o.now = true;
            continue;
        }
        let Some(value) = it.next() else { usage(&format!("{flag} needs a value")) };
        let whole = |min: u64, max: u64| match value.parse::<u64>() {
            Ok(v) if (min..=max).contains(&v) => v,
            _ => usage(&format!("{flag} {value:?}: expected a whole number from {min} to {max}")),
        };
        match flag.as_str() {
            "--kernel-us" => kernel = Some(whole(1, 10_000_000)),
            "--depth" if o.flood => o.depth = whole(1, 4096) as u32,
            "--mean-gap-us" if !o.flood => gap = Some(whole(1, 100_000_000)),
            "--seed" if !o.flood => o.seed = whole(0, u64::MAX),
            "--seconds" => {
                seconds = match value.parse::<f64>() {
                    Ok(v) if v.is_finite() && v > 0.0 && v <= 3600.0 => Some(v),
                    _ => usage(&format!("--seconds {value:?}: expected a number above 0, at most 3600")),
                }
            }
            "--stream" => {
                o.per_thread = match value.as_str() {
                    "own" => false,
                    "per-thread" => true,
                    _ => usage(&format!("--stream {value:?}: expected own or per-thread")),
                }
            }
            "--warmup" => {
                o.warmup = match value.parse::<f64>() {
                    Ok(v) if v.is_finite() && (0.0..=600.0).contains(&v) => v,
                    _ => usage(&format!("--warmup {value:?}: expected seconds from 0 to 600")),
                }
            }
            _ => usage(&format!("unknown argument {flag:?} for this mode")),
        }
    }
    o.kernel_us = kernel.unwrap_or_else(|| usage("--kernel-us is required"));
    o.seconds = seconds.unwrap_or_else(|| usage("--seconds is required"));
    if !o.flood {
        o.mean_gap_us = gap.unwrap_or_else(|| usage("--mean-gap-us is required"));
    }
    o
}

fn check(what: &str, result: CUresult) {
    if result != CUresult::CUDA_SUCCESS {
        eprintln!("compute_load: {what} failed: {result:?}");
        exit(1);
    }
}

fn launch(sleep: CUfunction, stream: CUstream, us: u64) {
    let mut us = us;
    let mut params = [(&mut us as *mut u64).cast::<c_void>()];
    // SAFETY: a kernel of this module with its one u64 parameter, on a live stream.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(sleep, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr(), null_mut())
    });
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((p / 100.0) * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = parse(&args);
    let (sleep, stream) = {
        // SAFETY: out-pointers are live locals; handles come from the driver.
        unsafe {
            check("cuInit", sys::cuInit(0));
            let mut ctx = null_mut();
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, 0));
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
            let mut module = null_mut();
            check("cuModuleLoadData", sys::cuModuleLoadData(&mut module, c"compute_load".as_ptr().cast()));
            let mut sleep = null_mut();
            check(
                "cuModuleGetFunction",
                sys::cuModuleGetFunction(&mut sleep, module, c"simgpu_sleep_us".as_ptr()),
            );
            let mut stream = null_mut();
            if o.per_thread {
                // CU_STREAM_PER_THREAD: this thread's per-thread default stream.
                stream = 0x2 as CUstream;
            } else {
                check("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
            }
            (sleep, stream)
        }
    };
    let sync = || {
        // SAFETY: a live stream of this program.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
    };
    // One kernel first: the context's set-up is not measured.
    launch(sleep, stream, 1);
    sync();
    println!("ready");
    if !o.now {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
    }
    let run_for = Duration::from_secs_f64(o.seconds);
    // Unmeasured first (`--warmup`): the arbiter settles the shares meanwhile.
    let warm_until = Instant::now() + Duration::from_secs_f64(o.warmup);
    while Instant::now() < warm_until {
        for _ in 0..o.depth {
            launch(sleep, stream, o.kernel_us);
        }
        sync();
        if !o.flood {
            std::thread::sleep(Duration::from_micros(o.mean_gap_us));
        }
    }
    let started = Instant::now();
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut kernels = 0u64;
    let mut report = serde_json::json!({ "pid": std::process::id() });
    if o.flood {
        while started.elapsed() < run_for {
            for _ in 0..o.depth {
                launch(sleep, stream, o.kernel_us);
            }
            sync();
            kernels += u64::from(o.depth);
        }
        report["mode"] = "flood".into();
    } else {
        let mut rng = Rng::new(o.seed);
        let mut delays = Vec::new();
        // Each request's arrival (from the start), queueing, and where its time went: how
        // late after its arrival it began (behind earlier requests, or this thread not
        // running), its launch (a wait for its group's lease included), its synchronize.
        let mut served: Vec<[f64; 5]> = Vec::new();
        let mut arrival = started;
        loop {
            // Exponential gap: -ln(U) * mean, U in (0, 1].
            let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
            let gap = -(1.0 - u).ln() * o.mean_gap_us as f64;
            arrival += Duration::from_secs_f64(gap / 1e6);
            if arrival.duration_since(started) >= run_for {
                break;
            }
            if let Some(wait) = arrival.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let began = Instant::now();
            launch(sleep, stream, o.kernel_us);
            let launched = Instant::now();
            sync();
            let done = Instant::now();
            let answered = done.duration_since(arrival).as_secs_f64() * 1e6;
            let queueing = (answered - o.kernel_us as f64).max(0.0);
            delays.push(queueing);
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            served.push([
                us(arrival.duration_since(started)) / 1000.0,
                queueing,
                us(began.saturating_duration_since(arrival)),
                us(launched - began),
                us(done - launched),
            ]);
            kernels += 1;
        }
        delays.sort_by(f64::total_cmp);
        let mean = delays.iter().sum::<f64>() / delays.len().max(1) as f64;
        report["mode"] = "requests".into();
        report["queueing_us"] = serde_json::json!({
            "p50": percentile(&delays, 50.0),
            "p99": percentile(&delays, 99.0),
            "max": delays.last().copied().unwrap_or(0.0),
            "mean": mean,
        });
        served.sort_by(|a, b| b[1].total_cmp(&a[1]));
        report["worst"] = served
            .iter()
            .take(WORST)
            .map(|r| {
                serde_json::json!({
                    "at_ms": r[0], "queueing_us": r[1], "began_late_us": r[2], "launch_us": r[3], "sync_us": r[4],
                })
            })
            .collect();
    }
    report["started_unix_ms"] = started_unix_ms.into();
    report["kernels"] = kernels.into();
    report["wall_s"] = started.elapsed().as_secs_f64().into();
    println!("report {report}");
}
