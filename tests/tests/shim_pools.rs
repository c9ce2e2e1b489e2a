//! Stream-ordered pools keep what is freed into them up to their release threshold
//! (frameworks set it to the maximum): under the shim that memory still counts, so a
//! process fills its limit once, whatever it spreads over pools, devices and plain
//! allocations, and what a pool keeps is taken back (trimmed) when another allocation
//! needs the room. Real processes on simgpu (`tests/c/pool_limits.c`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, ShimSettings, SimGpu, TIMEOUT};

const LIMIT: u64 = 4 * GIB;
const OVERHEAD: u64 = 64 * MIB;
const CHUNK: u64 = 256 * MIB;
/// 15 chunks and the context fit under the limit (3904 MiB), a 16th does not.
const COUNT: u64 = 15;
const OUT_OF_MEMORY: i64 = 2;

/// Polls the simulated devices' memory in use until stopped; returns the most seen on each.
fn watch(gpu: &SimGpu, devices: usize) -> (Arc<AtomicBool>, std::thread::JoinHandle<Vec<u64>>) {
    let machine = gpu.device_state();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let watcher = std::thread::spawn(move || {
        let most: Vec<AtomicU64> = (0..devices).map(|_| AtomicU64::new(0)).collect();
        while !s.load(Ordering::Relaxed) {
            for (d, m) in most.iter().enumerate() {
                m.fetch_max(machine.used(d), Ordering::Relaxed);
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        most.iter().map(|m| m.load(Ordering::Relaxed)).collect()
    });
    (stop, watcher)
}

fn used_now(gpu: &SimGpu, device: usize) -> u64 {
    let machine = gpu.device_state();
    machine.used(device)
}

/// The numbers of each output line, by its first words (`SYNCED 1` → free after pool 1).
fn run(scenario: &str, devices: usize) {
    skip_on_real_gpu!("reads what the process holds from simgpu's device state (SIMGPU_STATE), on one or two simulated 16 GiB devices with 64 MiB contexts");
    let gpu = SimGpu::new(if devices == 2 { "16GiB,16GiB" } else { "16GiB" }).with_context_overhead("64MiB");
    let (stop, watcher) = watch(&gpu, devices);
    let mut cmd = gpu.shimmed(compile_c("pool_limits.c", &[], false));
    cmd.memory_request("4GiB").memory_limit("4GiB").args([scenario, &CHUNK.to_string(), &COUNT.to_string()]);
    let mut child = ChildProcess::spawn(&mut cmd);
    let mut lines: HashMap<String, i64> = HashMap::new();
    loop {
        let line = child.next_line(TIMEOUT).unwrap_or_else(|| panic!("{scenario}: {}", child.diagnostics()));
        if line == "READY" {
            break;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let value = words.last().and_then(|w| w.parse().ok()).expect("a number ends each line");
        lines.insert(words[..words.len() - 1].join(" "), value);
    }
    let get =
        |key: &str| *lines.get(key).unwrap_or_else(|| panic!("{scenario}: no line {key:?} in {lines:?}"));
    let held_now: Vec<u64> = (0..devices).map(|d| used_now(&gpu, d)).collect();
    child.close_stdin();
    child.finish();
    stop.store(true, Ordering::Relaxed);
    let most = watcher.join().expect("the watcher");

    let pools = match scenario {
        "three" => vec![0, 0, 0],
        "two_devices" => vec![0, 1],
        _ => vec![0],
    };
    for (i, &d) in pools.iter().enumerate() {
        assert_eq!(
            get(&format!("FILL {i} {d}")),
            OUT_OF_MEMORY,
            "{scenario}: pool {i}: a chunk past the limit is refused"
        );
        let free0 = get(&format!("FREE0 {d}")) as u64;
        let synced = get(&format!("SYNCED {i} {d}")) as u64;
        assert_eq!(
            synced,
            free0 - COUNT * CHUNK,
            "{scenario}: pool {i}: after free and synchronize, cuMemGetInfo counts what the pool keeps as used"
        );
    }
    for d in 0..devices {
        assert_eq!(
            get(&format!("ALLOC {d}")),
            OUT_OF_MEMORY,
            "{scenario}: device {d}: cuMemAlloc past the limit"
        );
        assert!(
            held_now[d] <= LIMIT && held_now[d] >= OVERHEAD + COUNT * CHUNK,
            "{scenario}: device {d}: the process holds {} at the end, for {} allocated under a {} limit",
            mib(held_now[d]),
            mib(OVERHEAD + COUNT * CHUNK),
            mib(LIMIT)
        );
        assert!(
            most[d] <= LIMIT,
            "{scenario}: device {d}: the process held {} at some point, past its {} limit",
            mib(most[d]),
            mib(LIMIT)
        );
    }
}

/// (a) The device's current pool, kept whole, then `cuMemAlloc` of as much again.
#[test]
fn the_default_pool_counts_what_it_keeps() {
    run("default", 1);
}

/// (b) One pool made with `cuMemPoolCreate`.
#[test]
fn a_created_pool_counts_what_it_keeps() {
    run("one", 1);
}

/// (c) Three pools filled in turn: each is served by trimming the one before.
#[test]
fn three_pools_share_one_limit() {
    run("three", 1);
}

/// (d) Pools on two devices: each device's limit holds on its own.
#[test]
fn pools_on_two_devices_are_held_per_device() {
    run("two_devices", 2);
}
