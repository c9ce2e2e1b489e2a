//! Benchmark of the shim's hot paths against the bare simulated driver, in one run:
//! nanoseconds added per `cuMemAlloc`+`cuMemFree` pair (within the request) and per
//! `cuLaunchKernel`, and the start-up time added to a process that never calls CUDA
//! (`/bin/true`). Reports ratios; asserts nothing. The pairs are also timed in 20 chunks,
//! and the quickest chunk of each run reported too: on a busy machine a run's median is
//! moved by other processes far more than by the shim, its quickest chunk much less.
//!
//! Run: `cargo build --release --workspace && target/release/shim_bench`.
//! (`shim_bench worker N` is the measured child process.)

use std::ffi::c_void;
use std::process::Command;
use std::ptr::null_mut;
use std::time::Instant;

use cudarc::driver::sys::{self, CUresult};
use gpufrac_e2e::{artifact, target_dir};
use simgpu_state::env::SimGpuDir;

macro_rules! ck {
    ($call:expr) => {{
        // SAFETY: valid out-pointers and handles created in this program.
        let r = unsafe { $call };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{} failed", stringify!($call));
    }};
}

/// In the child: time `n` alloc+free pairs and `n` launches; print ns per operation (and
/// per pair in the quickest twentieth of the pairs).
fn worker(n: usize) {
    ck!(sys::cuInit(0));
    let mut ctx = null_mut();
    ck!(sys::cuDevicePrimaryCtxRetain(&mut ctx, 0));
    ck!(sys::cuCtxSetCurrent(ctx));
    let mut module = null_mut();
    ck!(sys::cuModuleLoadData(&mut module, c"bench".as_ptr().cast()));
    let mut noop = null_mut();
    ck!(sys::cuModuleGetFunction(&mut noop, module, c"simgpu_noop".as_ptr()));
    let mut stream = null_mut();
    ck!(sys::cuStreamCreate(&mut stream, 1));

    let mut ptr = 0u64;
    let chunks = 20;
    let per_chunk = (n / chunks).max(1);
    let mut quickest = f64::MAX;
    let t = Instant::now();
    let mut done = 0;
    while done < n {
        let count = per_chunk.min(n - done);
        let chunk = Instant::now();
        for _ in 0..count {
            ck!(sys::cuMemAlloc_v2(&mut ptr, 4096));
            ck!(sys::cuMemFree_v2(ptr));
        }
        if count == per_chunk {
            quickest = quickest.min(chunk.elapsed().as_nanos() as f64 / count as f64);
        }
        done += count;
    }
    let pair = t.elapsed().as_nanos() as f64 / n as f64;

    let mut params: [*mut c_void; 0] = [];
    let launches = n * 10;
    let t = Instant::now();
    for i in 0..launches {
        ck!(sys::cuLaunchKernel(noop, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr(), null_mut()));
        if i % 4096 == 4095 {
            // Keep the queue short so memory use does not distort the timing.
            ck!(sys::cuStreamSynchronize(stream));
        }
    }
    ck!(sys::cuStreamSynchronize(stream));
    let launch = t.elapsed().as_nanos() as f64 / launches as f64;
    println!("{pair:.1} {launch:.1} {quickest:.1}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run_worker(sim: &SimGpuDir, shim: bool, n: usize) -> (f64, f64, f64) {
    let mut cmd = Command::new(std::env::current_exe().expect("own path"));
    cmd.args(["worker", &n.to_string()]).env_remove("LD_PRELOAD");
    sim.apply(&mut cmd);
    if shim {
        cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
            .env("GPUFRAC_MEMORY_REQUEST", "8GiB")
            .env("GPUFRAC_MEMORY_LIMIT", "12GiB");
    }
    let out = cmd.output().expect("worker");
    assert!(out.status.success(), "worker failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text.split_whitespace().map(|x| x.parse().expect("number")).collect();
    (v[0], v[1], v[2])
}

/// Mean wall time of starting `/bin/true`, in microseconds.
fn startup(preload: Option<&std::path::Path>, runs: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..runs {
        let mut cmd = Command::new("/bin/true");
        cmd.env_remove("LD_PRELOAD");
        if let Some(p) = preload {
            cmd.env("LD_PRELOAD", p).env("GPUFRAC_MEMORY_REQUEST", "1GiB");
        }
        assert!(cmd.status().expect("/bin/true").success());
    }
    t.elapsed().as_secs_f64() * 1e6 / runs as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        worker(args.get(2).and_then(|n| n.parse().ok()).unwrap_or(100_000));
        return;
    }
    let n = 100_000;
    let rounds = 7;
    let sim = SimGpuDir::new(&std::env::temp_dir(), &target_dir(), "16GiB").expect("simulated GPU");
    println!("shim_bench: {rounds} rounds, {n} alloc+free pairs and {} launches each, bare simgpu and under the shim alternately", n * 10);
    let (mut bare_pair, mut bare_launch, mut shim_pair, mut shim_launch) = (vec![], vec![], vec![], vec![]);
    let (mut bare_quick, mut shim_quick) = (vec![], vec![]);
    for _ in 0..rounds {
        let (p, l, q) = run_worker(&sim, false, n);
        bare_pair.push(p);
        bare_launch.push(l);
        bare_quick.push(q);
        let (p, l, q) = run_worker(&sim, true, n);
        shim_pair.push(p);
        shim_launch.push(l);
        shim_quick.push(q);
    }
    let (bp, bl, sp, sl) = (median(bare_pair), median(bare_launch), median(shim_pair), median(shim_launch));
    let (bq, sq) = (median(bare_quick), median(shim_quick));
    let shim = artifact("libgpufrac.so");
    let runs = 300;
    let (mut bare_start, mut shim_start) = (vec![], vec![]);
    for _ in 0..5 {
        bare_start.push(startup(None, runs));
        shim_start.push(startup(Some(&shim), runs));
    }
    let (bs, ss) = (median(bare_start), median(shim_start));
    println!("{:<28} {:>12} {:>12} {:>10} {:>8}", "", "bare simgpu", "with shim", "added", "ratio");
    println!(
        "{:<28} {:>9.1} ns {:>9.1} ns {:>7.1} ns {:>8.3}",
        "cuMemAlloc+cuMemFree pair",
        bp,
        sp,
        sp - bp,
        sp / bp
    );
    println!(
        "{:<28} {:>9.1} ns {:>9.1} ns {:>7.1} ns {:>8.3}",
        "  quickest 1/20 of the pairs",
        bq,
        sq,
        sq - bq,
        sq / bq
    );
    println!("{:<28} {:>9.1} ns {:>9.1} ns {:>7.1} ns {:>8.3}", "cuLaunchKernel", bl, sl, sl - bl, sl / bl);
    println!(
        "{:<28} {:>9.1} us {:>9.1} us {:>7.1} us {:>8.3}",
        "start-up of /bin/true",
        bs,
        ss,
        ss - bs,
        ss / bs
    );
}
