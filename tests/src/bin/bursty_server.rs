//! A simulated inference server with a bursty trace, for the density benchmark and the
//! tests: it loads a "model" (`--base`), then plays `--bursts` bursts, each after a random
//! gap, each allocating `--burst` bytes in `--step`-sized `cuMemAlloc` calls (each step
//! followed by a one-word kernel on it, as a server computes while its batch grows), holding them
//! `--hold` ms and freeing them. It calls the driver through `cudarc::driver::sys`
//! (dlopen + dlsym), so it runs bare on simgpu and under the shim alike.
//!
//! With `--chance PCT` the bursts come as a server's requests do instead: every
//! `--tick-ms` (100) ms a burst starts with that chance, for `--seconds` seconds (ticks
//! while a burst is under way are not played), at most `--bursts` of them.
//!
//! ```text
//! bursty_server [--base SIZE] [--burst SIZE] [--step SIZE] [--step-ms MS] [--hold MS]
//!               [--bursts N] [--gap-ms MIN-MAX] [--seed N] [--verify] [--keep-ms MS]
//!               [--chance PCT --tick-ms MS --seconds N] [--pooled] [--linger-ms MS]
//! ```
//!
//! Output, one line each, flushed:
//! - stdout `READY <base bytes>` once the model is loaded and filled;
//! - stdout `BURST <i> ok at_ms=<t> got_ms=<g> freed_ms=<f> wait_ms=<ms>` for a burst served
//!   (`t`: when its first allocation was called, in ms since the Unix epoch, so that
//!   servers' lines can be put on one time line; `g` and `f`: ms after `t` when it held
//!   all of it and when it had freed it; its wait is the wall time from its first
//!   allocation call to its last success, less the `--step-ms` pauses), or `BURST <i> oom after_ms=<ms>
//!   error=<CUDA error name>` for one that failed (what it got is freed);
//! - stdout `DONE bursts=<n> ok=<k> oom=<m>` at the end, exit status 0;
//! - stderr `FAILED init <error>` or `FAILED base <error>` (exit 3) when the CUDA set-up or
//!   the model cannot be had; `CORRUPT ...` (exit 4) when `--verify` finds data that came
//!   back wrong; a message naming the option (exit 2) for bad arguments.
//!
//! With `--keep-ms MS` a burst's first step is freed after the hold and the rest kept
//! `MS` more before it is checked and freed, as a server that lets its temporary buffers go
//! and keeps its cache: memory kept that way is a resting loan, which a swap may move to
//! host RAM and back while it is kept.
//!
//! With `--pooled` the server keeps what each burst frees in a pool of its own, as CuPy's
//! memory pool and PyTorch's caching allocator do: the next burst takes its steps from the
//! pool first, and nothing is freed back to the driver unless the shim asks for it. The
//! pool registers its release with `gpufrac_on_give_back` (looked up at run time, so it
//! also runs bare), which frees every block the pool keeps.
//!
//! With `--linger-ms MS` it waits that long after its last burst, before it frees the model
//! (and what its pool keeps) and says `DONE`.
//!
//! With `--verify` every step of a burst is filled with its own value (simgpu's
//! `simgpu_fill_u32`) and checked after the hold with `simgpu_checksum_u32`, and the model
//! is checked after every burst. The checksums are written into the model's first 8 bytes,
//! a scratch slot that is not part of the checked model, so the program allocates exactly
//! `base + bursts` and nothing else.

use std::ffi::c_void;
use std::process::exit;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};
use gpufrac_e2e::device_model::{alloc, check, error_name, free_all, init, say, Block, Kernels};
use gpufrac_e2e::rng::Rng;

const USAGE: &str = "usage: bursty_server [--base SIZE] [--burst SIZE] [--step SIZE] [--step-ms MS] \
[--hold MS] [--bursts N] [--gap-ms MIN-MAX] [--seed N] [--verify] [--keep-ms MS] [--chance PCT --tick-ms MS --seconds N] \
[--pooled] [--linger-ms MS]";

/// The smallest size accepted for `--base`, `--burst` and `--step`.
const MIN_SIZE: u64 = 4096;

/// The command line.
#[derive(Debug)]
struct Args {
    base: u64,
    burst: u64,
    step: u64,
    /// Pause after each step of a burst, as a server computing layer by layer while its
    /// allocator grows; not counted in the burst's wait.
    step_pause: Duration,
    hold: Duration,
    /// `--keep-ms`: how long the rest of a burst is kept after its first step is freed.
    keep: Option<Duration>,
    bursts: u32,
    gap_min_ms: u64,
    gap_max_ms: u64,
    seed: u64,
    verify: bool,
    /// `--pooled`: freed bursts are kept in the server's own pool.
    pooled: bool,
    /// `--linger-ms`: how long to wait after the last burst.
    linger: Duration,
    /// `--chance`: per tick, in percent; `None`: bursts `--gap-ms` apart.
    chance: Option<u64>,
    tick: Duration,
    /// `--seconds`: how long bursts start with `--chance`.
    seconds: Duration,
}

/// A bad command line: the message to print before exiting with status 2.
fn bad(message: String) -> ! {
    eprintln!("bursty_server: {message}\n{USAGE}");
    exit(2)
}

fn parse_args(argv: &[String]) -> Args {
    let mut args = Args {
        base: 512 << 20,
        burst: 3 << 30,
        step: 64 << 20,
        step_pause: Duration::ZERO,
        hold: Duration::from_millis(300),
        keep: None,
        bursts: 10,
        gap_min_ms: 100,
        gap_max_ms: 1500,
        seed: u64::from(std::process::id()),
        verify: false,
        pooled: false,
        linger: Duration::ZERO,
        chance: None,
        tick: Duration::from_millis(100),
        seconds: Duration::from_secs(20),
    };
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--verify" {
            args.verify = true;
            continue;
        }
        if flag == "--pooled" {
            args.pooled = true;
            continue;
        }
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        // Both `--flag value` and `--flag=value`.
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_owned())),
            _ => (flag.as_str(), None),
        };
        let known = [
            "--base",
            "--burst",
            "--step",
            "--step-ms",
            "--hold",
            "--keep-ms",
            "--bursts",
            "--gap-ms",
            "--seed",
            "--chance",
            "--tick-ms",
            "--seconds",
            "--linger-ms",
        ];
        if !known.contains(&name) {
            bad(format!("unknown argument {flag:?}"));
        }
        let value = match inline {
            Some(v) => v,
            None => it.next().cloned().unwrap_or_else(|| bad(format!("{name} needs a value"))),
        };
        let size = |value: &str| -> u64 {
            let bytes = gpufrac_common::parse_bytes(name, value).unwrap_or_else(|e| bad(e.to_string()));
            if bytes < MIN_SIZE {
                bad(format!("{name} {value:?} is too small: at least 4KiB"));
            }
            bytes
        };
        let number = |value: &str| -> u64 {
            value.trim().parse().unwrap_or_else(|_| bad(format!("{name} {value:?}: expected a whole number")))
        };
        match name {
            "--base" => args.base = size(&value),
            "--burst" => args.burst = size(&value),
            "--step" => args.step = size(&value),
            "--hold" => args.hold = Duration::from_millis(number(&value)),
            "--keep-ms" => args.keep = Some(Duration::from_millis(number(&value))),
            "--linger-ms" => args.linger = Duration::from_millis(number(&value)),
            "--step-ms" => args.step_pause = Duration::from_millis(number(&value)),
            "--bursts" => {
                args.bursts = u32::try_from(number(&value))
                    .unwrap_or_else(|_| bad(format!("--bursts {value:?} is too large")))
            }
            "--seed" => args.seed = number(&value),
            "--chance" => {
                let pct = number(&value);
                if !(1..=100).contains(&pct) {
                    bad(format!("--chance {value:?}: expected a percentage from 1 to 100"));
                }
                args.chance = Some(pct);
            }
            "--tick-ms" => args.tick = Duration::from_millis(number(&value).max(1)),
            "--seconds" => args.seconds = Duration::from_secs(number(&value)),
            "--gap-ms" => {
                let (min, max) = value.split_once('-').unwrap_or_else(|| {
                    bad(format!("--gap-ms {value:?}: expected MIN-MAX in ms, e.g. 100-1500"))
                });
                let (min, max) = (number(min), number(max));
                if min > max {
                    bad(format!("--gap-ms {value:?}: MIN is above MAX"));
                }
                (args.gap_min_ms, args.gap_max_ms) = (min, max);
            }
            _ => unreachable!("every known flag is handled"),
        }
    }
    args
}

/// `total` split into `step`-sized pieces (the last one smaller when it does not divide).
fn pieces(total: u64, step: u64) -> impl Iterator<Item = u64> {
    (0..total.div_ceil(step)).map(move |i| step.min(total - i * step))
}

/// The value that fills step `j` of burst `i` (`i == u32::MAX`: the model).
fn value(i: u32, j: usize) -> u32 {
    let h = Rng::new((u64::from(i) << 32) | j as u64).next();
    (h >> 32) as u32 | 1
}

/// The words checked in `block`: where they start and how many (the model's first block
/// starts with the 8-byte scratch slot, which is not checked).
fn words(block: &Block, scratch_in_it: bool) -> (u64, usize) {
    let skip = if scratch_in_it { 2 } else { 0 };
    (block.ptr + 4 * skip, (block.bytes / 4 - skip) as usize)
}

/// The blocks a `--pooled` server keeps after freeing them, with the context they belong
/// to (the release runs on a thread of the shim's, where it must be made current).
struct Pool {
    blocks: Vec<Block>,
    context: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { blocks: Vec::new(), context: 0 });

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A step of `bytes`: from the pool when it keeps a block of that size, else `cuMemAlloc`.
fn take(bytes: u64, pooled: bool) -> Result<Block, CUresult> {
    if pooled {
        let mut pool = pool();
        if let Some(at) = pool.blocks.iter().position(|b| b.bytes == bytes) {
            return Ok(pool.blocks.swap_remove(at));
        }
    }
    alloc(bytes)
}

/// Frees `blocks`, or keeps them in the pool.
fn give_up(blocks: &mut Vec<Block>, pooled: bool) {
    if pooled {
        pool().blocks.append(blocks);
    } else {
        free_all(blocks);
    }
}

/// The pool's release, registered with `gpufrac_on_give_back`: frees what it keeps.
extern "C" fn release_pool(_: *mut c_void) {
    let mut pool = pool();
    // SAFETY: the context the server made current on its own thread, alive until exit.
    unsafe { sys::cuCtxSetCurrent(pool.context as sys::CUcontext) };
    free_all(&mut pool.blocks);
}

/// Registers [`release_pool`] with the shim, if one is loaded.
fn register_pool() {
    type OnGiveBack = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void) -> i32;
    let mut context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the server's context is current on this thread.
    unsafe { sys::cuCtxGetCurrent(&mut context) };
    pool().context = context as usize;
    // SAFETY: looks a symbol up in the process's global scope; gpufrac.h gives its type.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_on_give_back".as_ptr()) };
    if !found.is_null() {
        // SAFETY: `gpufrac_on_give_back` has this signature (include/gpufrac.h).
        let on_give_back = unsafe { std::mem::transmute::<*mut c_void, OnGiveBack>(found) };
        // SAFETY: the function is valid for the process's life and ignores its argument.
        if unsafe { on_give_back(release_pool, std::ptr::null_mut()) } != 0 {
            eprintln!("bursty_server: gpufrac_on_give_back refused the pool's release");
        }
    }
}

fn corrupt(what: String) -> ! {
    eprintln!("CORRUPT {what}");
    exit(4)
}

fn cuda_failed(what: &str, r: CUresult) -> ! {
    eprintln!("bursty_server: {what} failed: {}", error_name(r));
    exit(1)
}

/// Checks every block of the model against its fill value.
fn check_model(k: &Kernels, model: &[Block], scratch: u64, after: u32) {
    for (j, b) in model.iter().enumerate() {
        let (ptr, count) = words(b, j == 0);
        let got = k.checksum(ptr, count, scratch).unwrap_or_else(|r| cuda_failed("checking the model", r));
        let want = (count as u64).wrapping_mul(u64::from(value(u32::MAX, j)));
        if got != want {
            corrupt(format!("model block {j} after burst {after}: checksum {got:#x}, expected {want:#x}"));
        }
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = parse_args(&argv);
    let mut rng = Rng::new(args.seed);

    // SAFETY: only tries to load the library.
    if !unsafe { sys::is_culib_present() } {
        eprintln!("FAILED init no CUDA driver (libcuda.so) found");
        exit(3);
    }
    let k = init().unwrap_or_else(|r| {
        eprintln!("FAILED init {}", error_name(r));
        exit(3)
    });

    // The model, in steps, filled on the device.
    let mut model = Vec::new();
    for bytes in pieces(args.base, args.step) {
        match alloc(bytes) {
            Ok(b) => model.push(b),
            Err(r) => {
                eprintln!("FAILED base {}", error_name(r));
                exit(3);
            }
        }
    }
    for (j, b) in model.iter().enumerate() {
        k.fill(b.ptr, value(u32::MAX, j), (b.bytes / 4) as usize)
            .unwrap_or_else(|r| cuda_failed("filling the model", r));
    }
    // SAFETY: no arguments.
    check(unsafe { sys::cuCtxSynchronize() }).unwrap_or_else(|r| cuda_failed("loading the model", r));
    // The model's first 8 bytes (its first block is at least 4 KiB).
    let scratch = model.first().expect("the model has at least one block (base >= 4KiB)").ptr;
    if args.verify {
        check_model(&k, &model, scratch, 0);
    }
    if args.pooled {
        register_pool();
    }
    say(&format!("READY {}", args.base));

    let (mut ok, mut oom) = (0u32, 0u32);
    let mut burst = Vec::new();
    let trace_start = Instant::now();
    let mut played = 0;
    for i in 0..args.bursts {
        match args.chance {
            None => std::thread::sleep(Duration::from_millis(rng.between(args.gap_min_ms, args.gap_max_ms))),
            Some(pct) => {
                // Tick until a burst comes up, or the trace is over.
                let mut comes = false;
                while !comes && trace_start.elapsed() < args.seconds {
                    std::thread::sleep(args.tick);
                    comes = rng.between(1, 100) <= pct;
                }
                if !comes {
                    break;
                }
            }
        }
        played += 1;
        let at_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let started = Instant::now();
        let mut failed = None;
        let mut paused = Duration::ZERO;
        for bytes in pieces(args.burst, args.step) {
            if !burst.is_empty() && !args.step_pause.is_zero() {
                std::thread::sleep(args.step_pause);
                paused += args.step_pause;
            }
            match take(bytes, args.pooled) {
                Ok(b) => {
                    // A layer's work on what it got: a server computes as its batch grows.
                    k.fill(b.ptr, value(i, burst.len()), 1)
                        .unwrap_or_else(|r| cuda_failed("computing a step", r));
                    burst.push(b)
                }
                Err(r) => {
                    failed = Some(r);
                    break;
                }
            }
        }
        let ms = started.elapsed().saturating_sub(paused).as_millis();
        let got_ms = started.elapsed().as_millis();
        if let Some(r) = failed {
            give_up(&mut burst, args.pooled);
            oom += 1;
            say(&format!("BURST {i} oom after_ms={ms} error={}", error_name(r)));
            continue;
        }
        if args.verify {
            for (j, b) in burst.iter().enumerate() {
                k.fill(b.ptr, value(i, j), (b.bytes / 4) as usize)
                    .unwrap_or_else(|r| cuda_failed("filling a burst", r));
            }
        }
        std::thread::sleep(args.hold);
        // The first step goes; the rest is kept a while (its checks below skip the first).
        let kept_from = match args.keep {
            Some(keep) if burst.len() > 1 => {
                let mut first = vec![burst.remove(0)];
                give_up(&mut first, args.pooled);
                std::thread::sleep(keep);
                1
            }
            _ => 0,
        };
        if args.verify {
            for (j, b) in burst.iter().enumerate() {
                let j = j + kept_from;
                let (ptr, count) = words(b, false);
                let got =
                    k.checksum(ptr, count, scratch).unwrap_or_else(|r| cuda_failed("checking a burst", r));
                let want = (count as u64).wrapping_mul(u64::from(value(i, j)));
                if got != want {
                    corrupt(format!("burst {i} step {j}: checksum {got:#x}, expected {want:#x}"));
                }
            }
        }
        give_up(&mut burst, args.pooled);
        let freed_ms = started.elapsed().as_millis();
        if args.verify {
            check_model(&k, &model, scratch, i);
        }
        ok += 1;
        say(&format!("BURST {i} ok at_ms={at_ms} got_ms={got_ms} freed_ms={freed_ms} wait_ms={ms}"));
    }
    std::thread::sleep(args.linger);
    free_all(&mut model);
    free_all(&mut pool().blocks);
    say(&format!("DONE bursts={played} ok={ok} oom={oom}"));
}
