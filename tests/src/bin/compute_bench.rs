//! Compute shares on simgpu, measured by throughput: how two groups that both saturate
//! one GPU split it (bare, under the GPU's own time-slicing; and with compute requests of
//! 30% and 70%), what a group alone gets (limit 100%, and a limit of 50%), and the
//! queueing delay of a latency-sensitive server alone and beside a flooding neighbour
//! (bare, and with requests of 50% each). Each flood's kernels done per second are
//! *normalized* by the same flood's alone and bare in the same run; a group's share is its
//! normalized throughput over the sum, and the sum says how much of the GPU's time was
//! lost (1: none). Prints a table; asserts nothing.
//!
//! Run: `cargo build --release --workspace && target/release/compute_bench [--seconds 10]
//! [--only split,alone,latency] [--server 2000/8000] [--rounds 1]` (about 2 minutes on 2
//! cores; `--server` sets the latency server's kernel and mean gap between requests, in µs,
//! `--flood-kernel-us` the floods' kernels, 1000 by default, and `--rounds` how many times
//! the latency server runs alone and then leased, each leased p99 judged against the alone
//! of its round). Each row says what the host did meanwhile: how much CPU time the
//! hypervisor took from this machine (`/proc/stat`'s steal) and how late, at worst, a
//! thread sleeping 2 ms at a time woke (stops of the VM the guest is not told of as steal
//! show there). On a shared VM, a latency row with either measures the host, not the
//! leases. `COMPUTE_BENCH_LIMIT_LOG` and
//! `COMPUTE_BENCH_LATENCY_LOG` name files to write the arbiter's words for the limit's row
//! and the leased latency row (a file per round, `.1`, `.2`, … after the name, with
//! `--rounds`), to follow their leases one by one; `COMPUTE_BENCH_SHIM_LOG`
//! a folder for the shims' debug logs (their drains look by look), a file per process.

use std::time::Duration;

use gpufrac_e2e::{artifact, log_field, unique, Arbiter, ChildProcess, SimGpu};

const FLOOD_DEPTH: &str = "16";
const WARMUP_S: &str = "3";

struct Bench {
    seconds: f64,
    /// The latency server's kernel and mean gap between requests, in µs.
    server_kernel_us: u64,
    server_gap_us: u64,
    /// The floods' kernels, in µs.
    flood_kernel_us: u64,
    gpu: SimGpu,
    arbiter: Arbiter,
    /// What the host did to this machine during the last [`Bench::run`].
    last_host: std::cell::Cell<HostSeen>,
}

/// What the host did to this machine while a row ran: the CPU time the hypervisor took
/// (steal, if the kernel reports it), and the worst lateness of a thread sleeping 2 ms
/// again and again beside the workloads, which also shows the stops a guest is not told
/// of as steal.
#[derive(Debug, Default, Clone, Copy)]
struct HostSeen {
    steal_s: Option<f64>,
    worst_late: Duration,
}

impl std::fmt::Display for HostSeen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.steal_s {
            Some(s) => write!(f, "{s:.2} s")?,
            None => f.write_str("unknown")?,
        }
        write!(f, "; {:.1} ms", self.worst_late.as_secs_f64() * 1000.0)
    }
}

/// Sleeps 2 ms again and again until `stop`, and returns the worst lateness of a wake.
fn watch_wakes(stop: &std::sync::atomic::AtomicBool) -> Duration {
    const NAP: Duration = Duration::from_millis(2);
    let mut worst = Duration::ZERO;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let asleep = std::time::Instant::now();
        std::thread::sleep(NAP);
        worst = worst.max(asleep.elapsed().saturating_sub(NAP));
    }
    worst
}

/// The CPU time the hypervisor has given other guests while this machine's CPUs wanted to
/// run (`steal` of `/proc/stat`'s `cpu` line), in seconds summed over its CPUs; `None`
/// where the kernel does not say. A latency measured while it grows measures the host.
fn steal_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: f64 = stat.lines().next()?.split_whitespace().nth(8)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks / hz as f64)
}

/// Where the shims' debug logs go, one file per process named by its pid
/// (`COMPUTE_BENCH_SHIM_LOG`, a folder), if anywhere.
fn shim_log_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("COMPUTE_BENCH_SHIM_LOG").map(std::path::PathBuf::from)
}

/// A workload's compute share: `None` runs it bare (no shim).
type Share<'a> = Option<(&'a str, &'a str)>;

impl Bench {
    fn start(&self, share: Share, args: &[&str]) -> ChildProcess {
        let seconds = self.seconds.to_string();
        let mut cmd = self.gpu.command(artifact("compute_load"));
        cmd.args(args).args(["--seconds", &seconds, "--warmup", WARMUP_S]);
        if let Some((request, limit)) = share {
            cmd.env("LD_PRELOAD", artifact("libgpufrac.so"))
                .env("GPUFRAC_MEMORY_REQUEST", "512MiB")
                .env("GPUFRAC_ARBITER_SOCKET", self.arbiter.socket())
                .env("GPUFRAC_GROUP", unique("compute-bench"))
                .env("GPUFRAC_COMPUTE_REQUEST", request)
                .env("GPUFRAC_COMPUTE_LIMIT", limit)
                .env("GPUFRAC_LOG", if shim_log_dir().is_some() { "debug" } else { "warn" });
        }
        let mut child = ChildProcess::spawn(&mut cmd);
        child.expect_line(&["ready"], Duration::from_secs(30));
        child
    }

    /// Starts the measured part of every workload together and returns their reports.
    fn run(&self, mut loads: Vec<ChildProcess>) -> Vec<serde_json::Value> {
        let steal_before = steal_s();
        /// Stops the watcher however the measurement ends (a panic too: the scope joins it).
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let watcher = scope.spawn(|| watch_wakes(&stop));
            let reports = {
                let _stop = StopOnDrop(&stop);
                self.measure(&mut loads)
            };
            let worst_late = watcher.join().unwrap_or_default();
            let steal = steal_before.zip(steal_s()).map(|(before, after)| after - before);
            self.last_host.set(HostSeen { steal_s: steal, worst_late });
            reports
        })
    }

    /// [`Bench::run`]'s measurement: starts the workloads and collects their reports.
    fn measure(&self, loads: &mut [ChildProcess]) -> Vec<serde_json::Value> {
        for l in loads.iter_mut() {
            l.write_stdin("go\n");
        }
        // Halfway: what the arbiter sees and decides, for each group with a share.
        std::thread::sleep(Duration::from_secs_f64(self.seconds / 2.0));
        let seen: Vec<String> = gpufrac_e2e::status(&self.arbiter).gpus[0]
            .processes
            .iter()
            .filter(|p| p.compute_limit_pm > 0)
            .map(|p| {
                format!(
                    "request {} held {} planned {} {}",
                    p.compute_request_pm as f64 / 10.0,
                    p.compute_held_pm as f64 / 10.0,
                    p.compute_allowance_pm as f64 / 10.0,
                    p.compute_state
                )
            })
            .collect();
        if !seen.is_empty() {
            eprintln!("  arbiter halfway (per mille as %): {}", seen.join("; "));
        }
        let timeout = Duration::from_secs_f64(self.seconds + 60.0);
        loads
            .iter_mut()
            .map(|l| {
                let line = l.expect_line(&["report"], timeout);
                l.expect_exit_code(0);
                if let Some(dir) = shim_log_dir() {
                    let path = dir.join(format!("{}.log", l.pid()));
                    let _ = std::fs::write(path, l.stderr_text());
                }
                serde_json::from_str(line.trim_start_matches("report "))
                    .unwrap_or_else(|e| panic!("bad report {line:?}: {e}"))
            })
            .collect()
    }

    /// Prints a row of the table: the configuration, its result and what the host did
    /// during the run behind it.
    fn row(&self, configuration: &str, result: &str) {
        println!("| {configuration} | {result} | {} |", self.last_host.get());
    }

    fn flood(&self, share: Share) -> ChildProcess {
        let kernel = self.flood_kernel_us.to_string();
        self.start(share, &["flood", "--kernel-us", &kernel, "--depth", FLOOD_DEPTH])
    }

    fn server(&self, share: Share) -> ChildProcess {
        let (kernel, gap) = (self.server_kernel_us.to_string(), self.server_gap_us.to_string());
        self.start(share, &["requests", "--kernel-us", &kernel, "--mean-gap-us", &gap, "--seed", "7"])
    }
}

/// Kernels done per second over the measured part.
fn throughput(report: &serde_json::Value) -> f64 {
    report["kernels"].as_f64().unwrap_or(0.0) / report["wall_s"].as_f64().unwrap_or(1.0)
}

fn queueing(report: &serde_json::Value) -> (f64, f64) {
    let q = &report["queueing_us"];
    (q["p50"].as_f64().unwrap_or(0.0) / 1000.0, q["p99"].as_f64().unwrap_or(0.0) / 1000.0)
}

fn main() {
    let mut seconds = 10.0;
    let (mut server_kernel_us, mut server_gap_us, mut flood_kernel_us) = (2000, 8000, 1000);
    let mut only: Option<Vec<String>> = None;
    let mut rounds = 1;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    const USAGE: &str = "usage: compute_bench [--seconds S] [--only split,alone,latency] [--server KERNEL_US/MEAN_GAP_US] [--flood-kernel-us N] [--rounds N]";
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            return;
        }
        let Some(value) = it.next() else {
            eprintln!("compute_bench: {flag} needs a value\n{USAGE}");
            std::process::exit(2)
        };
        match flag.as_str() {
            "--seconds" => {
                seconds = value.parse().ok().filter(|s: &f64| *s > 0.0 && *s <= 600.0).unwrap_or_else(|| {
                    eprintln!("compute_bench: --seconds {value:?}: expected seconds above 0, at most 600");
                    std::process::exit(2)
                })
            }
            "--rounds" => {
                rounds = value.parse().ok().filter(|r| (1..=100).contains(r)).unwrap_or_else(|| {
                    eprintln!(
                        "compute_bench: --rounds {value:?}: expected 1 to 100 rounds of the latency rows"
                    );
                    std::process::exit(2)
                })
            }
            "--only" => only = Some(value.split(',').map(str::to_owned).collect()),
            "--flood-kernel-us" => {
                flood_kernel_us =
                    value.parse().ok().filter(|k| (1..=1_000_000).contains(k)).unwrap_or_else(|| {
                        eprintln!("compute_bench: --flood-kernel-us {value:?}: expected 1 to 1000000");
                        std::process::exit(2)
                    })
            }
            "--server" => {
                // KERNEL_US/MEAN_GAP_US
                let parsed = value
                    .split_once('/')
                    .and_then(|(k, g)| Some((k.parse::<u64>().ok()?, g.parse::<u64>().ok()?)))
                    .filter(|&(k, g)| (1..=1_000_000).contains(&k) && k < g && g <= 10_000_000);
                (server_kernel_us, server_gap_us) = parsed.unwrap_or_else(|| {
                    eprintln!("compute_bench: --server {value:?}: expected KERNEL_US/MEAN_GAP_US, the kernel shorter than the gap, such as 2000/8000");
                    std::process::exit(2)
                })
            }
            _ => {
                eprintln!("compute_bench: unknown argument {flag:?}\n{USAGE}");
                std::process::exit(2)
            }
        }
    }
    let wanted = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let gpu = SimGpu::new("16GiB").with_context_overhead("64MiB");
    // Each lease is logged (debug) so that the latency rows can say what the server waited
    // for: its waits for a lease and the holders' drains.
    let socket = gpu.lib_dir().join(format!("{}.sock", unique("compute-bench")));
    let filter = std::ffi::OsStr::new("info,gpufrac_daemon::arbiter::policy::compute=debug");
    let arbiter = Arbiter::start_with_env(&gpu, socket, &[], &[("GPUFRAC_LOG", filter)]);
    let bench = Bench {
        seconds,
        server_kernel_us,
        server_gap_us,
        flood_kernel_us,
        gpu,
        arbiter,
        last_host: std::cell::Cell::new(HostSeen::default()),
    };
    println!(
        "compute_bench: {seconds} s measured after {WARMUP_S} s of warm-up, one simulated GPU, floods of {flood_kernel_us} µs kernels"
    );
    println!("| configuration | result | the host during it: steal; a 2 ms sleep's worst lateness |");
    println!("| --- | --- | --- |");

    // Every flood is measured against the same flood alone, bare, in this run.
    let mut alone_rate = None;
    let mut alone = |bench: &Bench| -> f64 {
        *alone_rate.get_or_insert_with(|| {
            let rate = throughput(&bench.run(vec![bench.flood(None)])[0]);
            bench.row("one flood alone, bare (the reference)", &format!("{rate:.0} kernels/s"));
            rate
        })
    };
    if wanted("split") {
        let reference = alone(&bench);
        let bare = bench.run(vec![bench.flood(None), bench.flood(None)]);
        let (a, b) = (throughput(&bare[0]) / reference, throughput(&bare[1]) / reference);
        bench.row("two floods, bare (the GPU's time-slicing)", &split(a, b, None));
        let shared = bench.run(vec![bench.flood(Some(("30%", "100%"))), bench.flood(Some(("70%", "100%")))]);
        let (a, b) = (throughput(&shared[0]) / reference, throughput(&shared[1]) / reference);
        bench.row("two floods, compute requests 30% and 70%", &split(a, b, Some(0.3)));
    }
    if wanted("alone") {
        let reference = alone(&bench);
        let whole = throughput(&bench.run(vec![bench.flood(Some(("30%", "100%")))])[0]) / reference;
        bench.row(
            "one flood alone, request 30%, limit 100% (the GPU open)",
            &format!("normalized {whole:.3}"),
        );
        let logged = bench.arbiter.log_text().len();
        let half = throughput(&bench.run(vec![bench.flood(Some(("20%", "50%")))])[0]) / reference;
        bench.row(
            "one flood alone, request 20%, limit 50%",
            &format!("normalized {half:.3} (off by {:+.1} points)", (half - 0.5) * 100.0),
        );
        let log = bench.arbiter.log_text();
        println!("| (the leases in that row) | {} | |", leases(&log[logged..]));
        if let Some(path) = std::env::var_os("COMPUTE_BENCH_LIMIT_LOG") {
            // The arbiter's words for that row, to follow its leases one by one.
            let _ = std::fs::write(path, &log[logged..]);
        }
    }
    if wanted("latency") {
        latency(&bench, rounds);
    }
}

/// Two floods' normalized throughputs `a` and `b` as a row says them: each one's share of
/// their sum, how far the first's is from `target` if it has one, and the sum.
fn split(a: f64, b: f64, target: Option<f64>) -> String {
    let share = a / (a + b);
    let off = target.map_or(String::new(), |t| format!(" (off by {:+.1} points)", (share - t) * 100.0));
    format!(
        "normalized {a:.3} / {b:.3}, shares {:.1}% / {:.1}%{off}, sum {:.3}",
        share * 100.0,
        (1.0 - share) * 100.0,
        a + b
    )
}

/// The latency rows: the server alone and beside a flood with requests of 50% each,
/// `rounds` times, then beside the same flood bare (once, after the rounds). Each round's leased p99 is
/// judged against the server alone in the same round, so that a stretch of the host's
/// stop lands on both sides as often as not; each row says what the host did meanwhile.
fn latency(bench: &Bench, rounds: u32) {
    let (kernel_us, gap_us) = (bench.server_kernel_us, bench.server_gap_us);
    let mut within = 0;
    let mut missed = Vec::new();
    for round in 1..=rounds {
        let of_round = if rounds > 1 { format!(" (round {round})") } else { String::new() };
        let alone = bench.run(vec![bench.server(Some(("50%", "100%")))]);
        let alone_host = bench.last_host.get();
        let (p50, p99) = queueing(&alone[0]);
        bench.row(
            &format!(
                "latency server alone{of_round} (request 50%; {kernel_us} µs kernels, Poisson arrivals every {gap_us} µs on average)"
            ),
            &format!("queueing p50 {p50:.2} ms, p99 {p99:.2} ms"),
        );
        let logged = bench.arbiter.log_text().len();
        let shared = bench.run(vec![bench.server(Some(("50%", "100%"))), bench.flood(Some(("50%", "100%")))]);
        let leased_host = bench.last_host.get();
        eprintln!("  the leased server's longest-queued requests{of_round}: {}", worst_requests(&shared[0]));
        let (s50, s99) = queueing(&shared[0]);
        bench.row(
            &format!("latency server beside a flood, requests 50% / 50%{of_round}"),
            &format!(
                "queueing p50 {s50:.2} ms, p99 {s99:.2} ms ({:.1}x alone), flood {:.0} kernels/s",
                s99 / p99,
                throughput(&shared[1])
            ),
        );
        let log = bench.arbiter.log_text();
        println!("| (the leases in that row) | {} | |", leases(&log[logged..]));
        if let Some(path) = std::env::var_os("COMPUTE_BENCH_LATENCY_LOG") {
            // A file per round when there are several: `<path>.<round>`.
            let mut path = std::path::PathBuf::from(path);
            if rounds > 1 {
                path.as_mut_os_string().push(format!(".{round}"));
            }
            let _ = std::fs::write(path, &log[logged..]);
        }
        if round == rounds {
            let bare = bench.run(vec![bench.server(None), bench.flood(None)]);
            let (b50, b99) = queueing(&bare[0]);
            bench.row(
                "latency server beside a flood, bare",
                &format!(
                    "queueing p50 {b50:.2} ms, p99 {b99:.2} ms ({:.1}x alone), flood {:.0} kernels/s",
                    b99 / p99,
                    throughput(&bare[1])
                ),
            );
        }
        if s99 <= 2.0 * p99 {
            within += 1;
        } else {
            missed.push(format!(
                "round {round} at {:.1}x (the host: {alone_host} alone, {leased_host} leased)",
                s99 / p99
            ));
        }
    }
    if rounds > 1 {
        let result = format!(
            "{within} of {rounds}{}{}",
            if missed.is_empty() { "" } else { "; beyond: " },
            missed.join(", ")
        );
        println!(
            "| rounds whose leased p99 was within 2x of the server alone in the same round | {result} | |"
        );
    }
}

/// A server's longest-queued requests from its report (`worst`): when each arrived (UTC,
/// to find it in the logs) and where its time went.
fn worst_requests(report: &serde_json::Value) -> String {
    let started_ms = report["started_unix_ms"].as_f64().unwrap_or(0.0);
    let Some(worst) = report["worst"].as_array() else { return "none reported".to_owned() };
    let ms = |r: &serde_json::Value, key: &str| r[key].as_f64().unwrap_or(0.0) / 1000.0;
    worst
        .iter()
        .map(|r| {
            let at = (started_ms + r["at_ms"].as_f64().unwrap_or(0.0)) / 1000.0 % 86_400.0;
            format!(
                "{:02}:{:02}:{:06.3} queued {:.1} ms (began {:.1} ms late, launch {:.1} ms, sync {:.1} ms)",
                (at / 3600.0) as u32,
                (at % 3600.0 / 60.0) as u32,
                at % 60.0,
                ms(r, "queueing_us"),
                ms(r, "began_late_us"),
                ms(r, "launch_us"),
                ms(r, "sync_us")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// What the leases took in a row (`row`: the arbiter's log from the row's start): each
/// lease's wait (from its group's `Want`) and each holder's drain past its lease's end, as
/// the arbiter logged them.
fn leases(row: &str) -> String {
    let field = |name: &str| -> Vec<f64> {
        let mut v: Vec<f64> = row
            .lines()
            .filter_map(|l| log_field(l, name)?.parse::<f64>().ok())
            .map(|us| us / 1000.0)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let at =
        |v: &[f64], p: f64| v.get(((v.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0.0);
    let (waits, drains) = (field("waited_us"), field("drain_us"));
    format!(
        "{} waits: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {} drains: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        waits.len(),
        at(&waits, 0.5),
        at(&waits, 0.99),
        at(&waits, 1.0),
        drains.len(),
        at(&drains, 0.5),
        at(&drains, 0.99),
        at(&drains, 1.0)
    )
}
