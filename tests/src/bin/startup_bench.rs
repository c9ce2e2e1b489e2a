//! Start-up cost of the shim in a process that never calls CUDA: runs `/bin/true` N times
//! (default 500) bare, with an empty preloaded C library (built here with `cc`) and with
//! `libgpufrac.so` preloaded, alternating, and prints each median and the differences in
//! µs. Asserts nothing.
//!
//! Run: `cargo build --release --workspace && target/release/startup_bench [N] [shim.so]`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use gpufrac_e2e::artifact;

/// Builds an empty shared library with `cc` in a fresh temp folder.
fn empty_library() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("startup-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("make a temp folder");
    let source = dir.join("empty.c");
    std::fs::write(&source, "void startup_bench_empty(void) {}\n").expect("write empty.c");
    let library = dir.join("libempty.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed to build the empty library");
    library
}

/// Microseconds one run of `/bin/true` takes, with `preload` preloaded if given.
fn run_once(preload: Option<&Path>) -> f64 {
    let mut cmd = Command::new("/bin/true");
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    cmd.env_remove("LD_PRELOAD");
    if let Some(library) = preload {
        cmd.env("LD_PRELOAD", library);
    }
    let start = Instant::now();
    let status = cmd.status().expect("run /bin/true");
    let elapsed = start.elapsed();
    assert!(status.success(), "/bin/true failed with {preload:?} preloaded");
    elapsed.as_secs_f64() * 1e6
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(500, |a| a.parse().expect("N is a number of runs"));
    let shim = args.next().map_or_else(|| artifact("libgpufrac.so"), PathBuf::from);
    let empty = empty_library();
    // Warm the page cache and the dynamic loader's caches.
    for _ in 0..20 {
        run_once(None);
        run_once(Some(&empty));
        run_once(Some(&shim));
    }
    let (mut bare, mut with_empty, mut with_shim) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        bare.push(run_once(None));
        with_empty.push(run_once(Some(&empty)));
        with_shim.push(run_once(Some(&shim)));
    }
    let _ = std::fs::remove_dir_all(empty.parent().expect("the library lives in a folder"));
    let (bare, with_empty, with_shim) = (median(bare), median(with_empty), median(with_shim));
    println!("/bin/true, median of {n} runs each ({})", shim.display());
    println!("  bare                     {bare:8.1} µs");
    println!("  empty preloaded library  {with_empty:8.1} µs  (+{:.1} µs)", with_empty - bare);
    println!("  libgpufrac.so preloaded  {with_shim:8.1} µs  (+{:.1} µs)", with_shim - bare);
    println!("  shim over empty library  {:+8.1} µs", with_shim - with_empty);
}
