//! A process that churns device memory for the load tests: for `--seconds`, it allocates
//! blocks of random sizes (`--min` to `--max`) up to a random target below `--most`, then
//! frees a random share of them, over and over, a few milliseconds apart. It calls the
//! driver through `cudarc::driver::sys`, so it runs bare on simgpu and under the shim.
//!
//! ```text
//! churner [--seconds N] [--min SIZE] [--max SIZE] [--most SIZE] [--seed N]
//! ```
//!
//! Prints `READY` once its context exists, then `DONE allocs=<n> frees=<n> oom=<n>` and
//! exits 0. Out-of-memory answers are counted, not errors (a limit reached, a wait timed
//! out). Any other CUDA error is printed as `FAILED <what> <error>` with exit status 3; a
//! bad argument exits 2 naming it.

use std::io::Write;
use std::process::exit;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};
use gpufrac_e2e::rng::Rng;

const USAGE: &str = "usage: churner [--seconds N] [--min SIZE] [--max SIZE] [--most SIZE] [--seed N]";

struct Args {
    seconds: u64,
    min: u64,
    max: u64,
    most: u64,
    seed: u64,
}

fn bad(message: String) -> ! {
    eprintln!("churner: {message}\n{USAGE}");
    exit(2)
}

fn parse_args() -> Args {
    let mut a = Args { seconds: 5, min: 1 << 20, max: 128 << 20, most: 1 << 30, seed: 1 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| bad(format!("{flag} needs a value")));
        let size = || gpufrac_common::parse_bytes(&flag, &value).unwrap_or_else(|e| bad(e.to_string()));
        let number = || {
            value.parse::<u64>().unwrap_or_else(|_| bad(format!("{flag} {value:?}: expected a whole number")))
        };
        match flag.as_str() {
            "--seconds" => a.seconds = number(),
            "--min" => a.min = size(),
            "--max" => a.max = size(),
            "--most" => a.most = size(),
            "--seed" => a.seed = number(),
            _ => bad(format!("unknown argument {flag:?}")),
        }
    }
    if a.min == 0 || a.min > a.max || a.max > a.most {
        bad("expected 0 < --min <= --max <= --most".to_owned());
    }
    a
}

fn error_name(r: CUresult) -> String {
    format!("{r:?}")
}

fn failed(what: &str, r: CUresult) -> ! {
    eprintln!("FAILED {what} {}", error_name(r));
    exit(3)
}

fn main() {
    let args = parse_args();
    let mut rng = Rng::new(args.seed);
    // SAFETY: plain driver calls with valid out-pointers, in order.
    unsafe {
        if !sys::is_culib_present() {
            eprintln!("FAILED init no CUDA driver (libcuda.so) found");
            exit(3);
        }
        let r = sys::cuInit(0);
        if r != CUresult::CUDA_SUCCESS {
            failed("cuInit", r);
        }
        let mut dev = 0;
        let r = sys::cuDeviceGet(&mut dev, 0);
        if r != CUresult::CUDA_SUCCESS {
            failed("cuDeviceGet", r);
        }
        let mut ctx = null_mut();
        let r = sys::cuDevicePrimaryCtxRetain(&mut ctx, dev);
        if r != CUresult::CUDA_SUCCESS {
            failed("cuDevicePrimaryCtxRetain", r);
        }
        let r = sys::cuCtxSetCurrent(ctx);
        if r != CUresult::CUDA_SUCCESS {
            failed("cuCtxSetCurrent", r);
        }
    }
    println!("READY");
    let _ = std::io::stdout().flush();

    let until = Instant::now() + Duration::from_secs(args.seconds);
    let mut blocks: Vec<(u64, u64)> = Vec::new();
    let (mut held, mut allocs, mut frees, mut oom) = (0u64, 0u64, 0u64, 0u64);
    while Instant::now() < until {
        let target = rng.between(args.min, args.most);
        while held < target {
            let bytes = rng.between(args.min, args.max).min(args.most - held).max(args.min);
            let mut ptr = 0u64;
            // SAFETY: a valid out-pointer.
            match unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) } {
                CUresult::CUDA_SUCCESS => {
                    blocks.push((ptr, bytes));
                    held += bytes;
                    allocs += 1;
                }
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    oom += 1;
                    break;
                }
                r => failed("cuMemAlloc", r),
            }
        }
        std::thread::sleep(Duration::from_millis(rng.between(1, 5)));
        let keep = rng.between(0, blocks.len() as u64) as usize;
        while blocks.len() > keep {
            let i = rng.between(0, blocks.len() as u64 - 1) as usize;
            let (ptr, bytes) = blocks.swap_remove(i);
            // SAFETY: a pointer this program allocated and has not freed.
            let r = unsafe { sys::cuMemFree_v2(ptr) };
            if r != CUresult::CUDA_SUCCESS {
                failed("cuMemFree", r);
            }
            held -= bytes;
            frees += 1;
        }
    }
    for (ptr, _) in blocks.drain(..) {
        // SAFETY: as above.
        let r = unsafe { sys::cuMemFree_v2(ptr) };
        if r != CUresult::CUDA_SUCCESS {
            failed("cuMemFree", r);
        }
        frees += 1;
    }
    println!("DONE allocs={allocs} frees={frees} oom={oom}");
    let _ = std::io::stdout().flush();
}
