//! Churn load: many processes under the shim and one arbiter, each churning random
//! allocations between its request and its limit on one simgpu GPU, all started at the
//! same moment, a share of them SIGKILLed midway. Every run must hold the promise:
//! every survivor exits cleanly (out-of-memory answers are allowed: a limit reached, a
//! wait timed out), nothing is left in the arbiter's ledger, and the whole GPU can be
//! allocated afterwards.
//!
//! ```text
//! cargo build --release --workspace
//! cargo run --release -p gpufrac-e2e --bin churn_load -- [--processes 48] [--runs 10] \
//!     [--seconds 6] [--device 16GiB] [--context 0] [--busy 0]
//! ```
//!
//! Each process: request 128 MiB, limit 1 GiB, `GPUFRAC_WAIT_TIMEOUT=2s`, its own group.
//! `--busy N` keeps N threads spinning on the CPU meanwhile. Prints a line per run and
//! exits 1 if any run broke the promise.

use std::process::exit;
use std::time::{Duration, Instant};

use gpufrac_e2e::busy::BusyLoops;
use gpufrac_e2e::size::MIB;
use gpufrac_e2e::{artifact, describe_status, status, unique, Arbiter, ChildProcess, SimGpu};

const USAGE: &str = "usage: churn_load [--processes N] [--runs N] [--seconds N] [--device SIZE] \
[--context SIZE] [--busy N]";

struct Options {
    processes: usize,
    runs: u32,
    seconds: u64,
    device: u64,
    context: String,
    busy: usize,
}

fn bad(message: String) -> ! {
    eprintln!("churn_load: {message}\n{USAGE}");
    exit(2)
}

fn parse_options() -> Options {
    let mut o =
        Options { processes: 48, runs: 10, seconds: 6, device: 16 << 30, context: "0".to_owned(), busy: 0 };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        let value = args.next().unwrap_or_else(|| bad(format!("{flag} needs a value")));
        let count = |max: u64| -> u64 {
            match value.trim().parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => bad(format!("{flag} {value:?}: expected a whole number from 1 to {max}")),
            }
        };
        match flag.as_str() {
            "--processes" => o.processes = count(200) as usize,
            "--runs" => o.runs = count(1000) as u32,
            "--seconds" => o.seconds = count(3600),
            "--busy" => {
                o.busy = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|n| *n <= 64)
                    .unwrap_or_else(|| bad(format!("--busy {value:?}: expected 0 to 64")))
            }
            "--device" => {
                o.device =
                    gpufrac_common::parse_bytes("--device", &value).unwrap_or_else(|e| bad(e.to_string()))
            }
            "--context" => {
                if value.trim() != "0" {
                    gpufrac_common::parse_bytes("--context", &value).unwrap_or_else(|e| bad(e.to_string()));
                }
                o.context = value;
            }
            _ => bad(format!("unknown argument {flag:?}")),
        }
    }
    if o.processes as u64 * 128 * MIB > o.device {
        bad(format!("{} requests of 128 MiB do not fit --device", o.processes));
    }
    o
}

/// One run: what went wrong, if anything, and a summary line.
fn run(o: &Options, round: u32) -> (Vec<String>, String) {
    let gpu = SimGpu::new(&format!("{}MiB", o.device / MIB)).with_context_overhead(&o.context);
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("arbiter.sock"), &[]);
    let mut children: Vec<ChildProcess> = (0..o.processes)
        .map(|k| {
            let mut cmd = gpu.command(artifact("churner"));
            cmd.args(["--seconds", &o.seconds.to_string(), "--min", "1MiB", "--max", "128MiB"])
                .args(["--most", "1GiB", "--seed", &(round as usize * 1000 + k).to_string()])
                .env("LD_PRELOAD", artifact("libgpufrac.so"))
                .env("GPUFRAC_MEMORY_REQUEST", "128MiB")
                .env("GPUFRAC_MEMORY_LIMIT", "1GiB")
                .env("GPUFRAC_WAIT_TIMEOUT", "2s")
                .env("GPUFRAC_ARBITER_SOCKET", arbiter.socket())
                .env("GPUFRAC_GROUP", unique(&format!("churn-{k}")));
            ChildProcess::spawn(&mut cmd)
        })
        .collect();
    // A quarter of them die midway, without a chance to give anything back.
    std::thread::sleep(Duration::from_millis(o.seconds * 500));
    let killed: Vec<usize> = (0..o.processes).filter(|k| k % 4 == 3).collect();
    for &k in &killed {
        children[k].kill();
    }
    let mut problems = Vec::new();
    let (mut clean, mut oom) = (0, 0u64);
    for (k, child) in children.iter_mut().enumerate().filter(|(k, _)| !killed.contains(k)) {
        let mut done = None;
        while let Some(line) = child.next_line(Duration::from_secs(o.seconds + 120)) {
            if line.starts_with("DONE") {
                done = Some(line);
            }
        }
        let exit = child.wait(Duration::from_secs(60));
        match done {
            Some(line) if exit.success() => {
                clean += 1;
                oom += line.split("oom=").nth(1).and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
            }
            _ => problems.push(format!(
                "process {k}: {} {}",
                describe_status(exit),
                child.stderr_text().lines().last().unwrap_or("")
            )),
        }
    }
    // Nothing left in the ledger once everyone is gone (the killed ones' connections close).
    let deadline = Instant::now() + Duration::from_secs(10);
    let left = loop {
        let left: usize = status(&arbiter).gpus.iter().map(|g| g.processes.len()).sum();
        if left == 0 || Instant::now() > deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if left > 0 {
        problems.push(format!("{left} processes still in the arbiter's ledger 10 s after the last exit"));
    }
    // The whole GPU can be allocated afterwards (what the killed held is back).
    let mut whole = gpu.command(artifact("simgpu_probe"));
    whole.args(["hold", &(o.device - 64 * MIB).to_string()]);
    let mut probe = ChildProcess::spawn(&mut whole);
    let allocatable = probe.next_line(Duration::from_secs(30)).is_some_and(|l| l.starts_with("READY"));
    probe.close_stdin();
    let _ = probe.wait(Duration::from_secs(30));
    if !allocatable {
        problems
            .push(format!("the whole GPU was not allocatable afterwards: {}", probe.stderr_text().trim()));
    }
    let line = format!(
        "run {}: {clean} of {} survivors exited cleanly ({oom} out-of-memory answers), {} killed, ledger {}, whole GPU {}",
        round + 1,
        o.processes - killed.len(),
        killed.len(),
        if left == 0 { "empty" } else { "NOT empty" },
        if allocatable { "allocatable" } else { "NOT allocatable" }
    );
    (problems, line)
}

fn main() {
    let o = parse_options();
    artifact("churner");
    artifact("libgpufrac.so");
    artifact("gpufrac-arbiter");
    println!(
        "churn_load: {} processes (request 128 MiB, limit 1 GiB, wait timeout 2 s) on a {} MiB simgpu GPU, \
         contexts of {}, {} s each, a quarter SIGKILLed midway, {} busy threads; {} runs",
        o.processes,
        o.device / MIB,
        o.context,
        o.seconds,
        o.busy,
        o.runs
    );
    let _busy = BusyLoops::start(o.busy);
    let mut broken = 0;
    for round in 0..o.runs {
        let (problems, line) = run(&o, round);
        println!("{line}");
        for p in &problems {
            println!("  - {p}");
        }
        if !problems.is_empty() {
            broken += 1;
        }
    }
    println!("churn_load: {} of {} runs held the promise", o.runs - broken, o.runs);
    if broken > 0 {
        exit(1);
    }
}
