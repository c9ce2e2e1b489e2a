//! Density benchmark: how many bursty inference servers one GPU holds with gpufrac's
//! dynamic fractions, against fractions sized for the peak.
//!
//! N simulated servers (`bursty_server`: a 512 MiB model, then bursts of 3 GiB in 64 MiB
//! allocations 5 ms apart, held 300 ms, 100-1500 ms apart, the same seeded trace per server index in
//! every configuration) share ONE simgpu GPU (16 GiB, 64 MiB per context), started at once,
//! in these configurations, one after another:
//!
//! - `static`: fractions sized for the peak (request = limit = model + burst + context,
//!   shim without arbiter); as many servers as fit, floor(device / peak), which is its
//!   servers per GPU;
//! - `bare`: N servers, no shim, no arbiter: colliding bursts are out-of-memory errors;
//! - `wait`, `priority`, `swap`: N servers under the shim and `gpufrac-arbiter` (`--swap-quantum
//!   1s` for swap), request = model + context + 448 MiB (1 GiB), limit = peak, each its own
//!   group, `GPUFRAC_WAIT_TIMEOUT=30s`.
//!
//! It prints a markdown table (servers per GPU, bursts served, out-of-memory errors, burst
//! wait p50/p99 over the bursts served, wall time), the ratio of gpufrac (`wait`) servers
//! per GPU to `static`, and under it what the arbiter counted (its metrics: waits,
//! timeouts, refusals by reason, swaps, terminations), the bursts its log says it denied
//! and why, and anything a server did not survive.
//!
//! Run (the shim and simgpu come from the workspace build):
//!
//! ```text
//! cargo build --release --workspace
//! cargo run --release -p gpufrac-e2e --bin density_bench -- [--servers 8] [--bursts 10] \
//!     [--device 16GiB] [--only static,bare,wait,priority,swap] [--verify] [--rounds 1] \
//!     [--busy 0] [--context 64MiB] [--context-create-time 0ms] [--check] [--svg PATH]
//! ```
//!
//! `--verify` makes every server fill and check its bursts (slow: each 3 GiB burst is
//! faulted in on the host). `--rounds N` plays the trace N times on one arbiter per
//! configuration, all servers of a round started at the same moment; `--busy N` keeps N
//! threads spinning on the CPU meanwhile; `--context SIZE` sets simgpu's context size (the
//! request and limit grow with it); `--context-create-time DURATION` makes each server's
//! context take that long to create (`SIMGPU_CONTEXT_CREATE_TIME`: a real driver takes
//! 100-500 ms, while the other servers load their models); `--check` exits 1 if any round under `wait` had an
//! out-of-memory error or a server that failed. The arbiter's INFO lines per second (per
//! server) are printed under the table: what an operator's log receives.
//!
//! Three more run only when `--only` names them: `wait-pooled`, `priority-pooled` and
//! `swap-pooled`, the same as `wait`, `priority` and `swap` with servers that keep what
//! their bursts free in a pool of their own (`bursty_server --pooled`, as CuPy and
//! PyTorch keep it), which only the shim's give-back empties. With both kinds in one run
//! each resolver's line under the table gives the pooled servers' wait p99 as a ratio of
//! the freeing ones'.
//!
//! Two more configurations run only when `--only` names them: `park-shim` and
//! `park-checkpoint`, many mostly idle parkable models on a GPU that holds a third of them
//! (`--models 12`, `--requests 60`; see `park.rs`). They print a table of their own:
//! requests served, failed, wake p50/p99 and the p99's ratio to copying one model into
//! fresh pages on this machine.
//!
//! `--svg PATH` also writes a chart (`gpufrac_e2e::density_chart`): one panel per
//! configuration with the device memory each server held over time (stacked; sampled from
//! simgpu's state every 20 ms), the GPU's size and the sum of the requests, and a red cross
//! for each out-of-memory error (when the server reported it, at the top of its band). The
//! table is the same with or without it. `docs/density.svg` is
//! `density_bench --svg docs/density.svg`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{exit, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpufrac_e2e::density_chart::{self, Chart, Oom, Panel, Sample};
use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{artifact, describe_status, unique, Arbiter, ChildProcess, SimGpu};

const BASE: u64 = 512 * MIB;
const BURST: u64 = 3 * GIB;
/// The module of built-in kernels each server loads (simgpu's `SIMGPU_MODULE_BYTES`
/// default): code and globals are part of what a server holds at its peak.
const MODULE: u64 = 2 * MIB;
const STEP: u64 = 64 * MIB;
/// Between the steps of a burst: an allocator grows while the server computes.
const STEP_MS: u64 = 5;
const HOLD_MS: u64 = 300;
const GAP_MS: &str = "100-1500";
/// simgpu's context size unless `--context` says otherwise.
const CONTEXT: u64 = 64 * MIB;
/// Guaranteed above the model and the context, so that the request is 1 GiB.
const MARGIN: u64 = 448 * MIB;
const WAIT_TIMEOUT: &str = "30s";
/// The longest a server may stay silent: a burst waits at most 30 s, a gap 1.5 s.
const SILENCE: Duration = Duration::from_secs(300);
/// How often `--svg` samples what each server holds.
const SAMPLE_PERIOD: Duration = Duration::from_millis(20);

mod park;

const CONFIGS: [&str; 5] = ["static", "bare", "wait", "priority", "swap"];
/// The arbitrated configurations with pooled servers; run only when `--only` names them.
const POOLED_CONFIGS: [&str; 3] = ["wait-pooled", "priority-pooled", "swap-pooled"];
/// Run only when `--only` names them.
const PARK_CONFIGS: [&str; 2] = ["park-shim", "park-checkpoint"];

const USAGE: &str = "usage: density_bench [--servers N] [--bursts N] [--device SIZE] \
[--only static,bare,wait,priority,swap,wait-pooled,priority-pooled,swap-pooled,park-shim,park-checkpoint] [--verify] [--rounds N] [--busy N] \
[--context SIZE] [--context-create-time DURATION] [--check] [--svg PATH] [--models N] [--requests N]";

struct Options {
    servers: usize,
    bursts: u32,
    device: u64,
    only: Vec<&'static str>,
    verify: bool,
    rounds: u32,
    busy: usize,
    context: u64,
    context_create_time: String,
    check: bool,
    /// Where `--svg` writes the chart.
    svg: Option<PathBuf>,
    /// Parkable models in the parking configurations.
    models: usize,
    /// Requests played in the parking configurations.
    requests: u32,
}

fn bad(message: String) -> ! {
    eprintln!("density_bench: {message}\n{USAGE}");
    exit(2)
}

fn parse_options() -> Options {
    let mut o = Options {
        servers: 8,
        bursts: 10,
        device: 16 * GIB,
        only: CONFIGS.to_vec(),
        verify: false,
        rounds: 1,
        busy: 0,
        context: CONTEXT,
        context_create_time: "0ms".to_owned(),
        check: false,
        svg: None,
        models: 12,
        requests: 60,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        if flag == "--verify" {
            o.verify = true;
            continue;
        }
        if flag == "--check" {
            o.check = true;
            continue;
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_owned(), Some(v.to_owned())),
            _ => (flag.clone(), None),
        };
        if ![
            "--servers",
            "--bursts",
            "--device",
            "--only",
            "--rounds",
            "--busy",
            "--context",
            "--context-create-time",
            "--svg",
            "--models",
            "--requests",
        ]
        .contains(&name.as_str())
        {
            bad(format!("unknown argument {flag:?}"));
        }
        let value = inline.or_else(|| args.next()).unwrap_or_else(|| bad(format!("{name} needs a value")));
        let count = |max: u64| -> u64 {
            match value.trim().parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => bad(format!("{name} {value:?}: expected a whole number from 1 to {max}")),
            }
        };
        match name.as_str() {
            "--svg" => o.svg = Some(PathBuf::from(value)),
            "--models" => o.models = count(24).max(2) as usize,
            "--requests" => o.requests = count(100_000) as u32,
            "--servers" => o.servers = count(256) as usize,
            "--bursts" => o.bursts = count(10_000) as u32,
            "--rounds" => o.rounds = count(1000) as u32,
            "--busy" => {
                o.busy = match value.trim().parse::<usize>() {
                    Ok(n) if n <= 64 => n,
                    _ => bad(format!("--busy {value:?}: expected a whole number from 0 to 64")),
                }
            }
            "--context-create-time" => {
                gpufrac_common::parse_duration("--context-create-time", &value)
                    .unwrap_or_else(|e| bad(e.to_string()));
                o.context_create_time = value.trim().to_owned();
            }
            "--context" => {
                o.context = match value.trim() {
                    "0" => 0,
                    text => {
                        gpufrac_common::parse_bytes("--context", text).unwrap_or_else(|e| bad(e.to_string()))
                    }
                }
            }
            "--device" => {
                o.device =
                    gpufrac_common::parse_bytes("--device", &value).unwrap_or_else(|e| bad(e.to_string()))
            }
            _ => {
                let mut only = Vec::new();
                for word in value.split(',').map(str::trim) {
                    let Some(c) =
                        CONFIGS.iter().chain(&POOLED_CONFIGS).chain(&PARK_CONFIGS).find(|&&c| c == word)
                    else {
                        bad(format!(
                            "--only: unknown configuration {word:?}; known: {},{},{}",
                            CONFIGS.join(","),
                            POOLED_CONFIGS.join(","),
                            PARK_CONFIGS.join(",")
                        ))
                    };
                    if !only.contains(c) {
                        only.push(*c);
                    }
                }
                o.only = only;
            }
        }
    }
    let request = BASE + o.context + MARGIN;
    let arbitrated = o.only.iter().any(|c| !matches!(*c, "static" | "bare") && !PARK_CONFIGS.contains(c));
    if arbitrated && o.servers as u64 * request > o.device {
        bad(format!(
            "{} servers with a request of {} MiB each need {} MiB, more than --device {} MiB: \
             the arbiter would refuse some; lower --servers or raise --device",
            o.servers,
            request / MIB,
            o.servers as u64 * request / MIB,
            o.device / MIB
        ));
    }
    if o.device < BASE + o.context {
        bad(format!("--device {} MiB cannot hold even one server's model and context", o.device / MIB));
    }
    o
}

/// What one configuration did.
#[derive(Default)]
struct Outcome {
    servers: usize,
    ok: u64,
    oom: u64,
    bursts: u64,
    /// Wait of each burst served, in ms.
    waits: Vec<u64>,
    wall: Duration,
    notes: Vec<String>,
    /// Rounds with an out-of-memory error or a server that failed.
    broken_rounds: u32,
    /// With `--svg`: what each server held over time.
    samples: Vec<Sample>,
    /// With `--svg`: each out-of-memory error, when and by which server.
    ooms: Vec<Oom>,
    /// The sum of the servers' requests (none without the shim).
    guarantees: Option<u64>,
}

/// Samples what each server of the current round holds on the simulated device, from
/// simgpu's state, every [`SAMPLE_PERIOD`] until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    /// The current round's servers: (PID, server index).
    pids: Arc<Mutex<Vec<(u32, usize)>>>,
    thread: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    fn start(gpu: &SimGpu, servers: usize, started: Instant) -> Sampler {
        let path = gpu.state_path().to_string_lossy().into_owned();
        let devices = simgpu_state::parse_device_list(gpu.devices())
            .unwrap_or_else(|e| bad(format!("the simulated device {:?}: {e}", gpu.devices())));
        let stop = Arc::new(AtomicBool::new(false));
        let pids: Arc<Mutex<Vec<(u32, usize)>>> = Arc::default();
        let (stop_flag, current) = (Arc::clone(&stop), Arc::clone(&pids));
        let thread = std::thread::spawn(move || {
            let machine = simgpu_state::Machine::open(&path, &devices)
                .unwrap_or_else(|e| panic!("density_bench: cannot open simgpu's state {path}: {e}"));
            let mut samples = Vec::new();
            loop {
                let stopping = stop_flag.load(Ordering::Acquire);
                let t = started.elapsed().as_secs_f64();
                let usage = machine.processes(0);
                let mut held = vec![0; servers];
                let pids = current.lock().unwrap_or_else(PoisonError::into_inner).clone();
                for p in usage {
                    if let Some(&(_, k)) = pids.iter().find(|(pid, _)| *pid == p.pid) {
                        held[k] = p.used;
                    }
                }
                samples.push(Sample { t, held });
                if stopping {
                    return samples;
                }
                std::thread::sleep(SAMPLE_PERIOD);
            }
        });
        Sampler { stop, pids, thread }
    }

    fn set_round(&self, pids: Vec<(u32, usize)>) {
        *self.pids.lock().unwrap_or_else(PoisonError::into_inner) = pids;
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

/// What one server of a round printed (each stdout line with the seconds since the
/// configuration started when it arrived) and how it ended.
struct ServerRun {
    lines: Vec<(f64, String)>,
    status: ExitStatus,
    stderr: String,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The value of `key=` in a line of `bursty_server`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key))
}

/// A free TCP port on the loopback, for the arbiter's metrics.
/// The arbiter's Prometheus text, or `None` if it does not answer.
fn fetch_metrics(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text)
}

/// One line on what the arbiter counted: waits, refusals by reason, swaps, terminations.
fn summarize_metrics(text: &str) -> String {
    let mut waits = 0.0;
    let mut swaps_out = 0.0;
    let mut terminations = 0.0;
    let mut timeouts = 0.0;
    let mut refusals: Vec<(String, f64)> = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        if name.starts_with("gpufrac_waits_total") {
            waits += value;
        } else if name.starts_with("gpufrac_swaps_total") && name.contains("direction=\"out\"") {
            swaps_out += value;
        } else if name.starts_with("gpufrac_timeouts_total") {
            timeouts += value;
        } else if name.starts_with("gpufrac_terminations_total") {
            terminations += value;
        } else if let Some(labels) = name.strip_prefix("gpufrac_refusals_total{") {
            let reason = labels.split('"').nth(1).unwrap_or("?").to_owned();
            refusals.push((reason, value));
        }
    }
    let refusals = if refusals.is_empty() {
        "none".to_owned()
    } else {
        refusals.iter().map(|(r, v)| format!("{r} {v}")).collect::<Vec<_>>().join(", ")
    };
    format!(
        "bursts that waited {waits}, timed out {timeouts}, refusals: {refusals}, swap-outs {swaps_out}, terminations {terminations}"
    )
}

/// Bursts the arbiter denied (after waiting or at once), by reason, from its log.
fn summarize_log(log: &str) -> String {
    let mut reasons: Vec<(String, u32)> = Vec::new();
    for line in log.lines().filter(|l| l.contains("denied")) {
        let reason = field(line, "reason=").unwrap_or("?").to_owned();
        match reasons.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => reasons.push((reason, 1)),
        }
    }
    if reasons.is_empty() {
        return "no burst denied".to_owned();
    }
    let list = reasons.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ");
    format!("bursts denied: {list}")
}

fn run(config: &str, o: &Options) -> Outcome {
    let peak = BASE + BURST + o.context + MODULE;
    let request = BASE + o.context + MARGIN;
    let servers = if config == "static" { (o.device / peak) as usize } else { o.servers };
    let mut out = Outcome { servers, ..Outcome::default() };
    if servers == 0 {
        out.notes.push(format!("no server sized for the peak ({} MiB) fits the device", peak / MIB));
        return out;
    }
    eprintln!("density_bench: {config}: {servers} servers, {} round(s)...", o.rounds);

    let context = if o.context == 0 { "0".to_owned() } else { format!("{}MiB", o.context.div_ceil(MIB)) };
    let gpu = SimGpu::new(&format!("{}MiB", o.device.div_ceil(MIB))).with_context_overhead(&context);
    // `wait-pooled` is `wait` with servers that keep their freed bursts.
    let (resolver, pooled) = match config.strip_suffix("-pooled") {
        Some(resolver) => (resolver, true),
        None => (config, false),
    };
    let arbiter = (!matches!(config, "static" | "bare")).then(|| {
        // The arbiter picks the metrics port and says which (`Arbiter::metrics_addr`).
        let mut args = vec!["--metrics", "127.0.0.1:0"];
        if resolver == "swap" {
            args.extend(["--swap-quantum", "1s"]);
        }
        Arbiter::start_at(&gpu, gpu.lib_dir().join("arbiter.sock"), &args)
    });

    out.guarantees = match config {
        "bare" => None,
        "static" => Some(servers as u64 * peak),
        _ => Some(servers as u64 * request),
    };
    let started = Instant::now();
    let sampler = o.svg.is_some().then(|| Sampler::start(&gpu, servers, started));
    for round in 0..o.rounds {
        let (oom_before, notes_before) = (out.oom, out.notes.len());
        // Every server of the round is spawned before any is read: they start together.
        let mut children: Vec<ChildProcess> = (0..servers)
            .map(|k| {
                let mut cmd = gpu.command(artifact("bursty_server"));
                cmd.env("SIMGPU_CONTEXT_CREATE_TIME", &o.context_create_time)
                    .args(["--base", &BASE.to_string(), "--burst", &BURST.to_string()])
                    .args(["--step", &STEP.to_string(), "--step-ms", &STEP_MS.to_string()])
                    .args(["--hold", &HOLD_MS.to_string()])
                    .args(["--bursts", &o.bursts.to_string(), "--gap-ms", GAP_MS])
                    .args(["--seed", &(1000 + k + 100 * round as usize).to_string()]);
                if o.verify {
                    cmd.arg("--verify");
                }
                if pooled {
                    cmd.arg("--pooled");
                }
                match resolver {
                    "bare" => {}
                    "static" => {
                        cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
                            .env("GPUFRAC_MEMORY_REQUEST", peak.to_string())
                            .env("GPUFRAC_MEMORY_LIMIT", peak.to_string())
                            .env("GPUFRAC_GROUP", unique(&format!("density-static-{k}")));
                    }
                    resolver => {
                        let arbiter = arbiter.as_ref().expect("started for the arbitrated configurations");
                        cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
                            .env("GPUFRAC_MEMORY_REQUEST", request.to_string())
                            .env("GPUFRAC_MEMORY_LIMIT", peak.to_string())
                            .env("GPUFRAC_RESOLVER", resolver)
                            .env("GPUFRAC_WAIT_TIMEOUT", WAIT_TIMEOUT)
                            .env("GPUFRAC_ARBITER_SOCKET", arbiter.socket())
                            .env("GPUFRAC_GROUP", unique(&format!("density-{resolver}-{k}")));
                    }
                }
                ChildProcess::spawn(&mut cmd)
            })
            .collect();
        if let Some(sampler) = &sampler {
            sampler.set_round(children.iter().enumerate().map(|(k, c)| (c.pid(), k)).collect());
        }

        // Every server is read by a thread of its own, so that each line is timed when
        // it comes; they are counted in server order.
        let runs: Vec<ServerRun> = std::thread::scope(|scope| {
            let readers: Vec<_> = children
                .iter_mut()
                .map(|child| {
                    scope.spawn(move || {
                        let mut lines = Vec::new();
                        while let Some(line) = child.next_line(SILENCE) {
                            lines.push((started.elapsed().as_secs_f64(), line));
                        }
                        let status = child.wait(SILENCE);
                        ServerRun { lines, status, stderr: child.stderr_text() }
                    })
                })
                .collect();
            readers.into_iter().map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        for (k, run) in runs.into_iter().enumerate() {
            let mut done = false;
            for (t, line) in &run.lines {
                let mut words = line.split_whitespace();
                match (words.next(), words.nth(1)) {
                    (Some("BURST"), Some("ok")) => {
                        out.ok += 1;
                        out.waits.push(field(line, "wait_ms=").and_then(|v| v.parse().ok()).unwrap_or(0));
                    }
                    (Some("BURST"), Some("oom")) => {
                        out.oom += 1;
                        out.ooms.push(Oom { t: *t, server: k });
                    }
                    (Some("DONE"), _) => done = true,
                    _ => {}
                }
            }
            let status = run.status;
            if !status.success() || !done {
                let last = run.stderr.lines().last().unwrap_or("").to_owned();
                out.notes.push(format!(
                    "round {}: server {k}: {} {last}",
                    round + 1,
                    describe_status(status)
                ));
            }
        }
        if out.oom > oom_before || out.notes.len() > notes_before {
            out.broken_rounds += 1;
        }
    }
    out.wall = started.elapsed();
    if let Some(sampler) = sampler {
        out.samples = sampler.finish();
    }
    out.bursts = servers as u64 * u64::from(o.bursts) * u64::from(o.rounds);
    if let Some(port) = arbiter.as_ref().map(|a| a.metrics_addr().port()) {
        match fetch_metrics(port) {
            Some(text) => out.notes.push(format!("arbiter: {}", summarize_metrics(&text))),
            None => out.notes.push("arbiter: metrics not available".to_owned()),
        }
    }
    if let Some(arbiter) = &arbiter {
        let log = arbiter.log_text();
        out.notes.push(format!("arbiter log: {}", summarize_log(&log)));
        // What an operator's log receives (the arbiter logs at INFO here).
        let lines = log.lines().count() as f64;
        let seconds = out.wall.as_secs_f64().max(0.001);
        out.notes.push(format!(
            "arbiter log volume at INFO: {lines} lines in {seconds:.1} s = {:.2} lines/s, {:.3} per server per second",
            lines / seconds,
            lines / seconds / servers as f64
        ));
    }
    if o.rounds > 1 {
        out.notes.push(format!(
            "{} of {} rounds held (no out-of-memory error, no server failed)",
            o.rounds - out.broken_rounds,
            o.rounds
        ));
    }
    out.waits.sort_unstable();
    drop(arbiter);
    out
}

fn ms(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v} ms"))
}

/// How the chart names a configuration (as the README's table does).
fn long_name(config: &str) -> String {
    match config {
        "static" => "static fractions".to_owned(),
        "bare" => "bare, no gpufrac".to_owned(),
        resolver => format!("gpufrac, {resolver}"),
    }
}

/// Writes the chart of `--svg` (a message on stderr says where; exits 1 if it cannot).
fn write_chart(path: &std::path::Path, o: &Options, results: &[(&str, Outcome)]) {
    let panels = results
        .iter()
        .map(|(config, r)| Panel {
            title: format!(
                "{}: {} servers, {} / {} bursts served, {} out-of-memory errors, {:.1} s",
                long_name(config),
                r.servers,
                r.ok,
                r.bursts,
                r.oom,
                r.wall.as_secs_f64()
            ),
            servers: r.servers,
            samples: r.samples.clone(),
            ooms: r.ooms.clone(),
            guarantees: r.guarantees,
        })
        .collect();
    let chart = Chart {
        title: format!(
            "density_bench: {} bursty inference servers on one {} GiB simulated GPU",
            o.servers,
            o.device as f64 / GIB as f64
        ),
        subtitle: format!(
            "each: a {} MiB model, then {} bursts of {} GiB ({} MiB steps, held {HOLD_MS} ms, gaps {GAP_MS} ms), \
             {} round(s); gpufrac request {} MiB, limit {} MiB; memory held per server, stacked",
            BASE / MIB,
            o.bursts,
            BURST / GIB,
            STEP / MIB,
            o.rounds,
            (BASE + o.context + MARGIN) / MIB,
            (BASE + BURST + o.context + MODULE) / MIB,
        ),
        device: o.device,
        panels,
    };
    let written = density_chart::render_svg(&chart).and_then(|svg| {
        std::fs::write(path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))
    });
    match written {
        Ok(()) => eprintln!("density_bench: chart written to {}", path.display()),
        Err(e) => {
            eprintln!("density_bench: --svg: {e}");
            exit(1);
        }
    }
}

fn main() {
    let o = parse_options();
    let _busy = gpufrac_e2e::busy::BusyLoops::start(o.busy);
    // Fail early, with the build hint, if something is missing.
    artifact("bursty_server");
    artifact("libgpufrac.so");
    artifact("gpufrac-arbiter");
    println!(
        "density_bench: one simgpu GPU of {} MiB ({} MiB per context); servers: model {} MiB, bursts of {} MiB \
         in {} MiB steps held {HOLD_MS} ms, gaps {GAP_MS} ms, {} bursts each, {} round(s); gpufrac request {} MiB, \
         limit {} MiB; contexts take {} to create; {} CPUs, {} busy threads",
        o.device / MIB,
        o.context / MIB,
        BASE / MIB,
        BURST / MIB,
        STEP / MIB,
        o.bursts,
        o.rounds,
        (BASE + o.context + MARGIN) / MIB,
        (BASE + BURST + o.context + MODULE) / MIB,
        o.context_create_time,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        o.busy
    );
    let mut results = Vec::new();
    for config in CONFIGS.iter().chain(&POOLED_CONFIGS).filter(|c| o.only.contains(c)) {
        results.push((*config, run(config, &o)));
    }
    let parked: Vec<(&str, park::ParkOutcome)> = PARK_CONFIGS
        .iter()
        .filter(|c| o.only.contains(c))
        .map(|c| (*c, park::run(c.trim_start_matches("park-"), o.models, o.requests)))
        .collect();
    if !parked.is_empty() {
        print_parked(&parked);
    }
    if o.check && parked.iter().any(|(_, p)| p.failed > 0 || p.oom > 0 || p.broken > 0) {
        eprintln!("density_bench: --check: a parking configuration failed a request or lost data");
        exit(1);
    }
    if results.is_empty() {
        return;
    }

    println!();
    println!(
        "| configuration | servers per GPU | bursts (batches) served | out-of-memory errors | burst wait p50 | burst wait p99 | wall time |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (config, r) in &results {
        println!(
            "| {config} | {} | {} / {} | {} | {} | {} | {:.1} s |",
            r.servers,
            r.ok,
            r.bursts,
            r.oom,
            ms(percentile(&r.waits, 50.0)),
            ms(percentile(&r.waits, 99.0)),
            r.wall.as_secs_f64()
        );
    }
    println!();
    let find = |name: &str| results.iter().find(|(c, _)| *c == name).map(|(_, r)| r);
    match (find("wait"), find("static")) {
        (Some(w), Some(s)) if s.servers > 0 => println!(
            "gpufrac (wait) servers per GPU / static: {} / {} = {:.2}x{}",
            w.servers,
            s.servers,
            w.servers as f64 / s.servers as f64,
            if w.oom > 0 {
                format!(" (with {} out-of-memory errors under wait)", w.oom)
            } else {
                String::new()
            }
        ),
        (Some(_), Some(_)) => println!("gpufrac (wait) servers per GPU / static: static fits no server"),
        _ => println!("gpufrac (wait) servers per GPU / static: run both wait and static to compare"),
    }
    for pooled in POOLED_CONFIGS {
        let freeing = pooled.trim_end_matches("-pooled");
        if let (Some(p), Some(f)) = (find(pooled), find(freeing)) {
            let (pp, fp) = (percentile(&p.waits, 99.0), percentile(&f.waits, 99.0));
            let ratio = match (pp, fp) {
                (Some(pp), Some(fp)) => format!("{:.2}x", pp as f64 / (fp as f64).max(1.0)),
                _ => "-".to_owned(),
            };
            println!(
                "{pooled}: burst wait p99 {} against {} with servers that free ({freeing}): {ratio}; out-of-memory errors {} against {}",
                ms(pp),
                ms(fp),
                p.oom,
                f.oom
            );
        }
    }
    for (config, r) in &results {
        for note in &r.notes {
            println!("- {config}: {note}");
        }
    }
    if let Some(path) = &o.svg {
        write_chart(path, &o, &results);
    }
    if o.check {
        for w in ["wait", "wait-pooled"].into_iter().filter_map(find) {
            if w.broken_rounds > 0 {
                eprintln!(
                    "density_bench: --check: {} round(s) under wait broke the promise",
                    w.broken_rounds
                );
                exit(1);
            }
        }
    }
}

/// The parking configurations' table.
fn print_parked(results: &[(&str, park::ParkOutcome)]) {
    println!();
    println!(
        "| configuration | models / fit on the GPU | requests served | failed | out-of-memory errors | wake p50 | wake p99 | wake p99 / fresh-page copy | wall time |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (config, r) in results {
        let p99 = percentile(&r.wakes, 99.0);
        println!(
            "| {config} | {} / 3 | {} / {} | {} | {} | {} | {} | {} | {:.1} s |",
            r.models,
            r.served,
            r.requests,
            r.failed,
            r.oom,
            ms(percentile(&r.wakes, 50.0)),
            ms(p99),
            p99.map_or_else(|| "-".to_owned(), |p| format!("{:.2}x", p as f64 / r.copy_ms.max(0.001))),
            r.wall.as_secs_f64()
        );
    }
    for (config, r) in results {
        println!("- {config}: copying one model (1 GiB) into fresh pages here: {:.0} ms", r.copy_ms);
        for note in &r.notes {
            println!("- {config}: {note}");
        }
    }
}
