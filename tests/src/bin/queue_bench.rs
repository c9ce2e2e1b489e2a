//! The contended queue: does the wait queue keep the GPU's room for bursts busy while
//! bursts wait? N servers (`bursty_server`) under the shim and one `gpufrac-arbiter` on one
//! simgpu GPU, all started together each round, each: request 1 GiB, limit 4 GiB, a 1 GiB
//! model (its weights and its 2 MiB module of kernels), a context of `--context` (256 MiB: each rests that much above its request, as
//! real servers whose context is not in their request do), then for `--seconds` (20) a
//! burst of 2.75 GiB (in 64 MiB allocations), held 300 ms, starting with a 12% chance every
//! 100 ms. The trace is seeded per server and round, the same in every run.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/queue_bench [--servers 8] [--device 16GiB] [--context 256MiB] [--rounds 10] \
//!     [--seconds 20] [--chance 12] [--burst 2.75GiB] [--check] [--bursts]
//! ```
//!
//! It prints a line per round: bursts served (of those started), wait p50 and p99 (from a
//! burst's first allocation to its last), the *room* (how many bursts fit at once in what
//! the requests and the servers' resting memory leave), how much of that room bursts held
//! over the round, and how much of it they held while some burst waited (the time-weighted
//! share, over the moments when at least one burst waited, of `min(bursts holding all they
//! asked, room) / room`). Then the rounds together; `--bursts` lists every burst under its
//! round. `--check` exits 1 if a burst was not
//! served, a server failed, or a round's p99 was above 1.5 s.

use std::process::exit;
use std::time::Duration;

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{artifact, describe_status, unique, Arbiter, ChildProcess, SimGpu};

const USAGE: &str = "usage: queue_bench [--servers N] [--device SIZE] [--context SIZE] [--rounds N] \
[--seconds N] [--chance PCT] [--burst SIZE] [--check] [--bursts]";

const REQUEST: u64 = GIB;
const LIMIT: u64 = 4 * GIB;
/// The module of built-in kernels each server loads (simgpu's default): held for life.
const MODULE: u64 = 2 * MIB;
/// The model's weights: with its kernels, 1 GiB, all of the request.
const MODEL: u64 = GIB - MODULE;
const STEP: u64 = 64 * MIB;
const HOLD_MS: u64 = 300;
const TICK_MS: u64 = 100;
const WAIT_TIMEOUT: &str = "30s";
/// What `--check` holds every round's p99 to.
const P99_MAX_MS: u64 = 1500;

struct Options {
    servers: usize,
    device: u64,
    context: u64,
    rounds: u32,
    seconds: u64,
    chance: u64,
    burst: u64,
    check: bool,
    /// `--bursts`: print every burst (server, start in ms into the round, wait).
    list: bool,
}

fn bad(message: String) -> ! {
    eprintln!("queue_bench: {message}\n{USAGE}");
    exit(2)
}

fn parse_options() -> Options {
    let mut o = Options {
        servers: 8,
        device: 16 * GIB,
        context: 256 * MIB,
        rounds: 10,
        seconds: 20,
        chance: 12,
        burst: 11 * GIB / 4,
        check: false,
        list: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                println!("{USAGE}");
                exit(0);
            }
            "--check" => {
                o.check = true;
                continue;
            }
            "--bursts" => {
                o.list = true;
                continue;
            }
            _ => {}
        }
        let value = args.next().unwrap_or_else(|| bad(format!("{flag} needs a value")));
        let count = |max: u64| -> u64 {
            match value.trim().parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => bad(format!("{flag} {value:?}: expected a whole number from 1 to {max}")),
            }
        };
        let size = || gpufrac_common::parse_bytes(&flag, &value).unwrap_or_else(|e| bad(e.to_string()));
        match flag.as_str() {
            "--servers" => o.servers = count(64) as usize,
            "--rounds" => o.rounds = count(1000) as u32,
            "--seconds" => o.seconds = count(3600),
            "--chance" => o.chance = count(100),
            "--device" => o.device = size(),
            "--burst" => o.burst = size(),
            "--context" => o.context = if value.trim() == "0" { 0 } else { size() },
            _ => bad(format!("unknown argument {flag:?}")),
        }
    }
    if o.servers as u64 * REQUEST > o.device {
        bad(format!("{} requests of 1 GiB do not fit --device", o.servers));
    }
    if o.burst + MODEL + o.context + MODULE > LIMIT {
        bad("a burst above the model and the context must fit the 4 GiB limit".to_owned());
    }
    o
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The value of `key=` in a line of `bursty_server`.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)).and_then(|v| v.parse().ok())
}

/// One served burst on the round's time line, in ms since the Unix epoch: when it
/// started asking, when it held all of it, when it had freed it.
#[derive(Clone, Copy)]
struct Burst {
    start: u64,
    got: u64,
    freed: u64,
}

/// How much of `room` the bursts held: over the round (from the first burst's start to
/// the last one's end), and over the moments when some burst waited. Both in `[0, 1]`.
fn room_use(bursts: &[Burst], room: u64) -> (f64, f64) {
    // Events: +1 holding at `got`, -1 at `freed`; +1 waiting at `start`, -1 at `got`.
    let mut events: Vec<(u64, i64, i64)> = Vec::new();
    for b in bursts {
        events.push((b.start, 0, 1));
        events.push((b.got, 1, -1));
        events.push((b.freed, -1, 0));
    }
    events.sort_unstable();
    let (mut holding, mut waiting) = (0i64, 0i64);
    let (mut used, mut span, mut used_waiting, mut waited) = (0.0, 0.0, 0.0, 0.0);
    let mut last: Option<u64> = None;
    for (t, dh, dw) in events {
        if let Some(from) = last {
            let dt = (t - from) as f64;
            let share = holding.clamp(0, room as i64) as f64 / room as f64;
            used += share * dt;
            span += dt;
            if waiting > 0 {
                used_waiting += share * dt;
                waited += dt;
            }
        }
        holding += dh;
        waiting += dw;
        last = Some(t);
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    (ratio(used, span), ratio(used_waiting, waited))
}

/// What one round did.
#[derive(Default)]
struct Round {
    /// Each served burst's server and line, for `--bursts`.
    lines: Vec<(usize, String)>,
    started: u64,
    served: u64,
    waits: Vec<u64>,
    bursts: Vec<Burst>,
    problems: Vec<String>,
}

fn round(o: &Options, gpu: &SimGpu, arbiter: &Arbiter, r: u32) -> Round {
    let mut children: Vec<ChildProcess> = (0..o.servers)
        .map(|k| {
            let mut cmd = gpu.command(artifact("bursty_server"));
            cmd.args(["--base", &MODEL.to_string(), "--burst", &o.burst.to_string()])
                .args(["--step", &STEP.to_string(), "--hold", &HOLD_MS.to_string()])
                .args(["--chance", &o.chance.to_string(), "--tick-ms", &TICK_MS.to_string()])
                .args(["--seconds", &o.seconds.to_string(), "--bursts", "10000"])
                .args(["--seed", &(7000 + k + 100 * r as usize).to_string()])
                .env("LD_PRELOAD", artifact("libgpufrac.so"))
                .env("GPUFRAC_MEMORY_REQUEST", REQUEST.to_string())
                .env("GPUFRAC_MEMORY_LIMIT", LIMIT.to_string())
                .env("GPUFRAC_RESOLVER", "wait")
                .env("GPUFRAC_WAIT_TIMEOUT", WAIT_TIMEOUT)
                .env("GPUFRAC_ARBITER_SOCKET", arbiter.socket())
                .env("GPUFRAC_GROUP", unique(&format!("queue-{k}")));
            ChildProcess::spawn(&mut cmd)
        })
        .collect();
    let silence = Duration::from_secs(o.seconds + 120);
    let mut out = Round::default();
    // Read one after another: the servers write a line per burst, which their pipes hold.
    for (k, child) in children.iter_mut().enumerate() {
        let mut done = false;
        while let Some(line) = child.next_line(silence) {
            let mut words = line.split_whitespace();
            match (words.next(), words.nth(1)) {
                (Some("BURST"), Some(result)) => {
                    out.started += 1;
                    if result != "ok" {
                        out.problems.push(format!("server {k}: {line}"));
                        continue;
                    }
                    out.served += 1;
                    out.lines.push((k, line.clone()));
                    out.waits.push(field(&line, "wait_ms=").unwrap_or(0));
                    let start = field(&line, "at_ms=").unwrap_or(0);
                    out.bursts.push(Burst {
                        start,
                        got: start + field(&line, "got_ms=").unwrap_or(0),
                        freed: start + field(&line, "freed_ms=").unwrap_or(0),
                    });
                }
                (Some("DONE"), _) => done = true,
                _ => {}
            }
        }
        let status = child.wait(silence);
        if !status.success() || !done {
            let last = child.stderr_text().lines().last().unwrap_or("").to_owned();
            out.problems.push(format!("server {k}: {} {last}", describe_status(status)));
        }
    }
    out.waits.sort_unstable();
    out
}

fn main() {
    let o = parse_options();
    artifact("bursty_server");
    artifact("libgpufrac.so");
    artifact("gpufrac-arbiter");
    // What each server holds at rest above its request, and so how many bursts fit at once
    // in what the requests and the resting memory leave.
    let resting = (MODEL + o.context + MODULE).saturating_sub(REQUEST);
    let spare = o.device.saturating_sub(o.servers as u64 * (REQUEST + resting));
    let room = (spare / o.burst).max(1);
    println!(
        "queue_bench: {} servers (request 1 GiB, limit 4 GiB, a 1 GiB model, contexts of {} MiB: {} MiB each above \
         its request at rest) on a {} MiB simgpu GPU; bursts of {} MiB in 64 MiB steps held {HOLD_MS} ms, a {}% chance \
         every {TICK_MS} ms for {} s; room for {room} bursts at once; {} rounds on one arbiter; {} CPUs",
        o.servers,
        o.context / MIB,
        resting / MIB,
        o.device / MIB,
        o.burst / MIB,
        o.chance,
        o.seconds,
        o.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let context = if o.context == 0 { "0".to_owned() } else { format!("{}MiB", o.context.div_ceil(MIB)) };
    let gpu = SimGpu::new(&format!("{}MiB", o.device.div_ceil(MIB))).with_context_overhead(&context);
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("arbiter.sock"), &[]);
    let (mut all_waits, mut started, mut served, mut broken, mut over) = (Vec::new(), 0, 0, 0, 0);
    let (mut use_sum, mut use_waiting_sum) = (0.0, 0.0);
    for r in 0..o.rounds {
        let out = round(&o, &gpu, &arbiter, r);
        let (used, used_waiting) = room_use(&out.bursts, room);
        let (p50, p99) = (percentile(&out.waits, 50.0), percentile(&out.waits, 99.0));
        println!(
            "round {}: {} / {} bursts served, wait p50 {p50} ms, p99 {p99} ms; room in use {:.0}% of the round, \
             {:.0}% while a burst waited",
            r + 1,
            out.served,
            out.started,
            used * 100.0,
            used_waiting * 100.0
        );
        for p in &out.problems {
            println!("  - {p}");
        }
        if o.list {
            let first = out.bursts.iter().map(|b| b.start).min().unwrap_or(0);
            for ((k, line), b) in out.lines.iter().zip(&out.bursts) {
                println!("  server {k} at {} ms: {line}", b.start - first);
            }
        }
        started += out.started;
        served += out.served;
        if !out.problems.is_empty() || out.served < out.started {
            broken += 1;
        }
        if p99 > P99_MAX_MS {
            over += 1;
        }
        use_sum += used;
        use_waiting_sum += used_waiting;
        all_waits.extend(out.waits);
    }
    all_waits.sort_unstable();
    let rounds = f64::from(o.rounds);
    println!(
        "queue_bench: {served} / {started} bursts served, wait p50 {} ms, p99 {} ms over all rounds; room in use \
         {:.0}% of the rounds, {:.0}% while a burst waited (means); {} of {} rounds with every burst served, \
         {} with p99 above {P99_MAX_MS} ms",
        percentile(&all_waits, 50.0),
        percentile(&all_waits, 99.0),
        use_sum / rounds * 100.0,
        use_waiting_sum / rounds * 100.0,
        o.rounds - broken,
        o.rounds,
        over,
    );
    if o.check && (broken > 0 || over > 0) {
        eprintln!("queue_bench: --check: {broken} round(s) with a burst not served, {over} with p99 above {P99_MAX_MS} ms");
        exit(1);
    }
}
