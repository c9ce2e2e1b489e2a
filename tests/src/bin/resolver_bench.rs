//! Benchmarks the collision resolvers on simgpu, in one run:
//! - swap out and swap in, in GB/s, against a plain `memcpy` of the same size (into
//!   memory already touched, and into fresh memory, which is what a swap-out copies to);
//! - the time from a burst request to its grant under each resolver: `wait` (memory
//!   free: the arbiter's round trip; when it collides the wait lasts as long as the
//!   holder keeps its memory, which no resolver-side number describes), `priority` (an
//!   idle lower-priority holder is ended), `swap` (a sleeping holder is swapped out).
//!
//! Run: `cargo build --release --workspace && target/release/resolver_bench [GiB]`.

use std::time::{Duration, Instant};

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{artifact, unique, wait_for, Arbiter, ChildProcess, SimGpu, TIMEOUT};

const BURST: u64 = 256 * MIB;

fn probe(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    limit: u64,
    resolver: &str,
    priority: i32,
) -> std::process::Command {
    let mut cmd = gpu.command(artifact("simgpu_probe"));
    cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
        .env("GPUFRAC_MEMORY_REQUEST", "1GiB")
        .env("GPUFRAC_MEMORY_LIMIT", limit.to_string())
        .env("GPUFRAC_RESOLVER", resolver)
        .env("GPUFRAC_PRIORITY", priority.to_string())
        .env("GPUFRAC_ARBITER_SOCKET", arbiter.socket())
        .env("GPUFRAC_GROUP", unique(resolver))
        .env("GPUFRAC_WAIT_TIMEOUT", "60s")
        .env("GPUFRAC_LOG", "warn");
    cmd
}

/// A holder of `bytes` of burst memory (in 256 MiB buffers) above its 1 GiB request.
fn holder(gpu: &SimGpu, arbiter: &Arbiter, bytes: u64, resolver: &str) -> ChildProcess {
    let mut cmd = probe(gpu, arbiter, 2 * GIB + bytes, resolver, 0);
    cmd.args(["hold-bursts", &GIB.to_string(), &BURST.to_string(), &(bytes / BURST).to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    child.ready();
    child
}

/// Times one burst of `bytes` just above a 1 GiB request (its context's 64 MiB and 960
/// MiB fill it); returns the microseconds it took.
fn burst(gpu: &SimGpu, arbiter: &Arbiter, bytes: u64, resolver: &str, priority: i32) -> (ChildProcess, u64) {
    let mut cmd = probe(gpu, arbiter, 2 * GIB + bytes, resolver, priority);
    cmd.args(["timed-alloc", &(GIB - 64 * MIB).to_string(), &bytes.to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    let line = child.expect_line(&["GRANTED", "REFUSED"], TIMEOUT * 4);
    assert!(line.starts_with("GRANTED"), "{resolver}: {line}");
    let us = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    (child, us)
}

/// `bytes=` and `us=` of the arbiter's last log line containing `what`.
fn logged(arbiter: &Arbiter, what: &str) -> (u64, u64) {
    let log = arbiter.log_text();
    let field = |line: &str, k: &str| {
        line.split_whitespace().find_map(|t| t.strip_prefix(k)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    log.lines()
        .rev()
        .filter(|l| l.contains(what))
        .map(|l| (field(l, "bytes="), field(l, "us=")))
        .find(|&(bytes, _)| bytes > 0)
        .unwrap_or((0, 0))
}

fn gbs(bytes: u64, us: u64) -> f64 {
    bytes as f64 / 1e9 / (us.max(1) as f64 / 1e6)
}

/// GB/s of copying `bytes` into memory already touched, and into fresh memory (which
/// the kernel must first fault in and zero, as for a swap-out's host copy); best of 3.
fn memcpy(bytes: usize) -> (f64, f64) {
    let src = vec![0x5au8; bytes];
    let mut warm = vec![1u8; bytes];
    let (mut best_warm, mut best_fresh) = (u64::MAX, u64::MAX);
    for _ in 0..3 {
        let started = Instant::now();
        warm.copy_from_slice(std::hint::black_box(&src));
        best_warm = best_warm.min(started.elapsed().as_micros() as u64);
        std::hint::black_box(&warm);
        let started = Instant::now();
        let mut fresh: Vec<u8> = Vec::with_capacity(bytes);
        // SAFETY: copying `bytes` initialised bytes into a fresh allocation of that capacity.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), fresh.as_mut_ptr(), bytes);
            fresh.set_len(bytes);
        }
        best_fresh = best_fresh.min(started.elapsed().as_micros() as u64);
        std::hint::black_box(&fresh);
    }
    (gbs(bytes as u64, best_warm), gbs(bytes as u64, best_fresh))
}

fn main() {
    let gib: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let size = gib * GIB;
    println!(
        "resolver_bench: {gib} GiB of burst memory, simgpu, {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // The GPU: two 1 GiB requests, room to lend for one burst and a half.
    let device = format!("{}MiB", (2 * GIB + size + size / 2) / MIB);

    let (warm, fresh) = memcpy(size as usize);
    println!("memcpy {gib} GiB: {warm:.2} GB/s into touched memory, {fresh:.2} GB/s into fresh memory");

    // Swap: a sleeping holder is swapped out for the burst, and back in when it leaves.
    let gpu = SimGpu::new(&device).with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("swap.sock"), &["--swap-quantum", "0s"]);
    let mut a = holder(&gpu, &arbiter, size, "swap");
    // Its queued kernels (two 300 ms sleeps) finish: the swap-out then waits for nothing.
    std::thread::sleep(Duration::from_millis(800));
    let (mut b, swap_us) = burst(&gpu, &arbiter, size, "swap", 0);
    wait_for(&arbiter, "the swap-out answered", |_| logged(&arbiter, "swapped out").0 > 0);
    let (out_bytes, out_us) = logged(&arbiter, "swapped out");
    b.close_stdin();
    b.finish();
    wait_for(&arbiter, "the swap-in", |_| logged(&arbiter, "swapped in").0 > 0);
    let (in_bytes, in_us) = logged(&arbiter, "swapped in");
    a.write_stdin("check\n");
    let verdict = a.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    a.close_stdin();
    a.finish();
    drop(arbiter);
    let (out_gbs, in_gbs) = (gbs(out_bytes, out_us), gbs(in_bytes, in_us));
    println!(
        "swap out {:.0} MiB: {:.1} ms, {out_gbs:.2} GB/s = {:.0}% of memcpy into fresh memory, {:.0}% into touched",
        out_bytes as f64 / MIB as f64,
        out_us as f64 / 1000.0,
        100.0 * out_gbs / fresh,
        100.0 * out_gbs / warm
    );
    println!(
        "swap in  {:.0} MiB: {:.1} ms, {in_gbs:.2} GB/s = {:.0}% of memcpy into fresh memory, {:.0}% into touched; data {verdict}",
        in_bytes as f64 / MIB as f64,
        in_us as f64 / 1000.0,
        100.0 * in_gbs / fresh,
        100.0 * in_gbs / warm
    );

    // Priority: an idle lower-priority holder is ended.
    let gpu = SimGpu::new(&device).with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("prio.sock"), &["--kill-grace", "5s"]);
    let mut a = holder(&gpu, &arbiter, size, "wait");
    let (mut b, priority_us) = burst(&gpu, &arbiter, size, "priority", 10);
    a.wait(TIMEOUT);
    b.close_stdin();
    b.finish();
    drop(arbiter);

    // Wait, with the memory free: the arbiter's round trip.
    let gpu = SimGpu::new(&device).with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("wait.sock"), &[]);
    let (mut b, wait_us) = burst(&gpu, &arbiter, size, "wait", 0);
    b.close_stdin();
    b.finish();
    drop(arbiter);

    println!("burst of {gib} GiB, request to grant (the allocating call, measured in the process):");
    println!("  wait     (memory free)                        {:>9.2} ms", wait_us as f64 / 1000.0);
    println!("  priority (lower-priority holder ended)        {:>9.2} ms", priority_us as f64 / 1000.0);
    println!("  swap     (sleeping holder swapped out)        {:>9.2} ms", swap_us as f64 / 1000.0);
    std::thread::sleep(Duration::from_millis(10));
}
