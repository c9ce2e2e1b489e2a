//! The parking configurations (`park-shim`, `park-checkpoint`): many mostly idle models on
//! a GPU that holds a third of them. `--models` parkable models (`parkable_model`: 1 GiB in
//! four chunks, a 2 MiB scratch block, a 64 MiB context: a request of 1090 MiB, idle after
//! 500 ms) share one 4 GiB simgpu GPU under `gpufrac-arbiter --oversubscribe 4`, parked by
//! the shim's swap or by the driver's checkpoint API. `--requests` requests arrive one at a
//! time, each to a model picked at random, 1-4 s apart (a request every few seconds); each checks a quarter of its
//! model on the device, so every request proves that the data came back intact. At the end
//! every model checks all of its data.
//!
//! Measured: requests served and failed (a wake refused after GPUFRAC_WAIT_TIMEOUT, 60 s,
//! would be one), out-of-memory errors, the wake times (from the call that waited to the
//! memory back, as each model's shim logs them), and, in the same run, the time to copy
//! 1 GiB into fresh pages on this machine (what bringing a model back costs at least).

use std::time::{Duration, Instant};

use gpufrac_e2e::rng::Rng;
use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{artifact, unique, Arbiter, ChildProcess, SimGpu};

/// Each model's memory (and what a wake brings back).
const MODEL: u64 = GIB;
/// Model, scratch block and context.
const REQUEST: u64 = MODEL + 2 * MIB + 64 * MIB;
/// A model is parked when the room is wanted after it was idle this long.
const PARK_AFTER: &str = "500ms";
/// The longest a model waits for its wake.
const WAIT_TIMEOUT: &str = "60s";
/// Loading twelve models one after another, each after another's park, takes a while.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// What one parking configuration did.
#[derive(Default)]
pub struct ParkOutcome {
    pub models: usize,
    pub requests: u32,
    pub served: u32,
    pub failed: u32,
    /// Out-of-memory errors the models' shims or answers reported.
    pub oom: u32,
    /// Data that came back wrong, models that failed.
    pub broken: u32,
    /// Every wake, in ms.
    pub wakes: Vec<u64>,
    /// Of each wake, the time it waited for room (another group's park), in ms.
    pub waited: Vec<u64>,
    /// Copying one model's memory into fresh pages here, in ms (median of three).
    pub copy_ms: f64,
    pub wall: Duration,
    pub notes: Vec<String>,
}

/// How long copying `MODEL` bytes into fresh pages takes here (median of three), in ms.
fn fresh_page_copy_ms() -> f64 {
    let source = vec![0x5au8; MODEL as usize];
    let mut times: Vec<f64> = (0..3)
        .map(|_| {
            // Zeroed by the allocator from fresh pages: the copy faults each one in, as a
            // restore into freshly mapped memory does.
            let mut target = vec![0u8; MODEL as usize];
            let started = Instant::now();
            target.copy_from_slice(&source);
            let took = started.elapsed().as_secs_f64() * 1000.0;
            std::hint::black_box(&target);
            took
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[1]
}

/// Runs the configuration: parks by `park_with` (`shim` or `checkpoint`).
pub fn run(park_with: &str, models: usize, requests: u32) -> ParkOutcome {
    let mut out = ParkOutcome { models, requests, ..ParkOutcome::default() };
    out.copy_ms = fresh_page_copy_ms();
    eprintln!(
        "density_bench: park-{park_with}: {models} models of {} MiB on a 4 GiB GPU, {requests} requests...",
        MODEL / MIB
    );
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("arbiter.sock"),
        &["--oversubscribe", "4", "--park-with", park_with],
    );
    let started = Instant::now();
    let mut children: Vec<ChildProcess> = (0..models)
        .map(|k| {
            let mut cmd = gpu.command(artifact("parkable_model"));
            cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
                .env("GPUFRAC_MEMORY_REQUEST", REQUEST.to_string())
                .env("GPUFRAC_PARK_AFTER", PARK_AFTER)
                .env("GPUFRAC_WAIT_TIMEOUT", WAIT_TIMEOUT)
                .env("GPUFRAC_ARBITER_SOCKET", arbiter.socket())
                .env("GPUFRAC_GROUP", unique(&format!("density-park-{k}")))
                .env("GPUFRAC_LOG", "info")
                .args(["--model", &MODEL.to_string(), "--chunk", &(256 * MIB).to_string()])
                .args(["--seed", &(2000 + k).to_string()]);
            ChildProcess::spawn(&mut cmd)
        })
        .collect();
    for child in &mut children {
        child.expect_line(&["READY"], LOAD_TIMEOUT);
    }
    // Wakes while loading (a model admitted parked waits for another's park) are not
    // counted: the requests' wakes are.
    let woken = |text: String| text.lines().filter(|l| l.contains("woken: device memory back")).count();
    let loading: Vec<usize> = children.iter().map(|c| woken(c.stderr_text())).collect();
    let mut rng = Rng::new(4242);
    for r in 0..requests {
        std::thread::sleep(Duration::from_millis(rng.between(1000, 4000)));
        let k = rng.between(0, models as u64 - 1) as usize;
        children[k].write_stdin(&format!("REQ {r}\n"));
        let answer = children[k].expect_line(&["OK", "FAIL"], ANSWER_TIMEOUT);
        if answer.starts_with("OK") {
            out.served += 1;
        } else {
            out.failed += 1;
            out.oom += u32::from(answer.contains("OUT_OF_MEMORY"));
            out.notes.push(format!("request {r} to model {k}: {answer}"));
        }
    }
    // Nor the wakes of the final check (every model in turn, none of them idle between).
    let served: Vec<usize> = children.iter().map(|c| woken(c.stderr_text())).collect();
    for (k, child) in children.iter_mut().enumerate() {
        child.write_stdin("CHECK\n");
        let checked = child.expect_line(&["CHECKED", "FAIL"], ANSWER_TIMEOUT);
        if checked != "CHECKED 4" {
            out.broken += 1;
            out.notes.push(format!("model {k}'s data at the end: {checked}"));
        }
        child.write_stdin("QUIT\n");
        let status = child.wait(ANSWER_TIMEOUT);
        if !status.success() {
            out.broken += 1;
            out.notes.push(format!("model {k}: {}", gpufrac_e2e::describe_status(status)));
        }
        let mut seen = 0;
        for line in child.stderr_text().lines() {
            let wake = line.contains("woken: device memory back");
            seen += usize::from(wake);
            if wake && seen > loading[k] && seen <= served[k] {
                let field = |key: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(key))
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                out.wakes.push(field("waited_ms=") + field("ms="));
                out.waited.push(field("waited_ms="));
            }
            if line.contains("out of memory") || line.contains("CORRUPT") {
                out.oom += u32::from(line.contains("out of memory"));
                out.broken += u32::from(line.contains("CORRUPT"));
                out.notes.push(format!("model {k}: {line}"));
            }
        }
    }
    out.wall = started.elapsed();
    out.wakes.sort_unstable();
    out.waited.sort_unstable();
    let at =
        |v: &[u64], p: usize| v.get((v.len() * p / 100).min(v.len().saturating_sub(1))).copied().unwrap_or(0);
    out.notes.push(format!(
        "of the wakes, waiting for room (another model's park; for a checkpoint, the restore too): p50 {} ms, p99 {} ms",
        at(&out.waited, 50),
        at(&out.waited, 99)
    ));
    let log = arbiter.log_text();
    let parks = log.matches("parked by").count();
    out.notes.push(format!("arbiter: {parks} parks, {} wakes", out.wakes.len()));
    out
}
