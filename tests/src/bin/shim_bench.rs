//! Benchmark of the shim's hot paths against the bare simulated driver, in one run:
//! nanoseconds added per `cuMemAlloc`+`cuMemFree` pair (within the request) at sizes from
//! 4 KiB to 64 MiB and per `cuLaunchKernel`, on every way a program reaches the driver
//! (linked, `dlsym`, `cuGetProcAddress` for the legacy and for the per-thread default
//! stream), and the start-up time added to a process that never calls CUDA
//! (`/bin/true`). Reports; asserts nothing.
//!
//! Each round runs the measured program (`tests/c/shim_bench.c`, one build per path)
//! bare and under the shim, one right after the other (the order flips every round), so
//! that a change in the machine's load hits both alike; "added" is the median over the
//! rounds of the shimmed run's time less its bare partner's, and "middle half" the range
//! of the middle half of those differences (how much the rounds disagree). The times are
//! the calling thread's CPU time (user and system) per call in each run's median chunk
//! (20 chunks of pairs, chunks of 4096 launches, each queued behind 5 ms of simulated
//! device work, as a server's launches queue behind a busy GPU): on a busy machine other processes move
//! wall-clock time far more than the shim does, CPU time much less, and the median chunk
//! less than the mean. The next column is the added
//! wall-clock time, for pairs of each run's quickest twentieth (the pairs are timed in 20
//! chunks). The last, "in-process", is the shim's cost measured inside each shimmed
//! run, where the address space is the same on both sides: chunks through the program's
//! entry points and through the driver's own functions alternate (the median of the
//! rounds' medians): what the shim's code costs, apart from where the driver's mappings
//! land in a process that has the shim loaded.
//!
//! Launches are timed in more processes than pairs: each round adds `--launch-runs`
//! (default 2) bare-and-shimmed runs of launches only, because a launch's figure moves
//! by several ns with where a process's mappings land.
//!
//! Run: `cargo build --release --workspace && target/release/shim_bench
//! [--rounds N] [--launch-runs N] [--pairs N] [--launches N] [--sizes 4KiB,1MiB,...] [--shim PATH]`
//! (`--shim`: another build's `libgpufrac.so`, with its `libgpufrac_core.so` beside it).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use gpufrac_common::parse_bytes;
use gpufrac_e2e::{artifact, compile_c, target_dir};
use simgpu_state::env::SimGpuDir;

/// One way of reaching the driver: the C program's build and its `cuGetProcAddress` flags.
struct Path {
    name: &'static str,
    define: &'static str,
    flags: u32,
}

const PATHS: [Path; 4] = [
    Path { name: "linked", define: "MODE_LINKED", flags: 0 },
    Path { name: "dlsym", define: "MODE_DLSYM", flags: 0 },
    Path { name: "cuGetProcAddress legacy", define: "MODE_PROCADDR", flags: 1 },
    Path { name: "cuGetProcAddress per-thread", define: "MODE_PROCADDR", flags: 2 },
];

/// What one run of the program measured, in ns: per size, a pair's (wall-clock mean,
/// quickest twentieth, CPU time); a launch's (wall-clock mean, CPU time); under the shim
/// also the CPU time it added inside the process, per size and per launch (NaN bare).
struct Run {
    pairs: Vec<(f64, f64, f64)>,
    launch: (f64, f64),
    inside: Vec<f64>,
    inside_launch: f64,
}

struct Settings {
    rounds: usize,
    /// Extra runs per round and path that time launches only (`--launch-runs`): a
    /// launch's figure moves by several ns with where a process's mappings land, so its
    /// median takes more processes than a pair's, whose cost is ten times larger.
    launch_runs: usize,
    pairs: usize,
    launches: usize,
    sizes: Vec<u64>,
    /// The `libgpufrac.so` measured (`--shim`; default the one beside this program), to
    /// compare two builds in one sitting.
    shim: PathBuf,
}

fn run(program: &PathBuf, path: &Path, sim: &SimGpuDir, shim: bool, s: &Settings) -> Run {
    let mut cmd = Command::new(program);
    cmd.arg(path.flags.to_string()).arg(s.pairs.to_string()).arg(s.launches.to_string());
    cmd.args(s.sizes.iter().map(u64::to_string)).env_remove("LD_PRELOAD");
    sim.apply(&mut cmd);
    if shim {
        cmd.env("LD_PRELOAD", &s.shim)
            .env("GPUFRAC_MEMORY_REQUEST", "8GiB")
            .env("GPUFRAC_MEMORY_LIMIT", "12GiB");
    }
    let out = cmd.output().expect("the measured program");
    assert!(
        out.status.success(),
        "{} ({}) failed: {}",
        path.name,
        if shim { "shimmed" } else { "bare" },
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut result =
        Run { pairs: vec![], launch: (f64::NAN, f64::NAN), inside: vec![], inside_launch: f64::NAN };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words.get(i).and_then(|w| w.parse::<f64>().ok()).expect("a number");
        match words.first() {
            Some(&"pair") => result.pairs.push((number(2), number(3), number(4))),
            Some(&"launch") => result.launch = (number(1), number(2)),
            Some(&"inpair") => result.inside.push(number(2)),
            Some(&"inlaunch") => result.inside_launch = number(1),
            _ => {}
        }
    }
    assert_eq!(result.pairs.len(), s.sizes.len(), "a line per size from {}", path.name);
    if shim {
        assert_eq!(result.inside.len(), s.sizes.len(), "in-process lines from {}", path.name);
    }
    result
}

/// One line of the table: the medians of the CPU times, the added CPU time (the median
/// of the rounds' differences, shimmed less bare) and the middle half of those
/// differences (from the first to the third quartile), its ratio, the added wall-clock time
/// (likewise; for pairs, of each run's quickest twentieth), and what the shim added
/// measured inside the shimmed processes (`inside`, their median).
fn print_row(
    path: &str,
    call: &str,
    rounds: &[&(Run, Run)],
    cpu: &dyn Fn(&Run) -> f64,
    wall: &dyn Fn(&Run) -> f64,
    inside: f64,
) {
    let bare = median(rounds.iter().map(|(b, _)| cpu(b)).collect());
    let shim = median(rounds.iter().map(|(_, s)| cpu(s)).collect());
    let mut differences: Vec<f64> = rounds.iter().map(|(b, s)| cpu(s) - cpu(b)).collect();
    differences.sort_by(|a, b| a.total_cmp(b));
    let added = differences[differences.len() / 2];
    let (low, high) = (differences[differences.len() / 4], differences[differences.len() * 3 / 4]);
    let half = format!("{low:+.0}..{high:+.0}");
    let added_wall = median(rounds.iter().map(|(b, s)| wall(s) - wall(b)).collect());
    println!(
        "{path:<28} {call:<18} {bare:>8.1} ns {shim:>8.1} ns {added:>+7.1} ns {half:>12} {:>7.3} {added_wall:>+9.1} ns {inside:>+10.1} ns",
        shim / bare
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Mean wall time of starting `/bin/true`, in microseconds.
fn startup(preload: Option<&std::path::Path>, runs: usize) -> f64 {
    let t = Instant::now();
    for _ in 0..runs {
        let mut cmd = Command::new("/bin/true");
        cmd.env_remove("LD_PRELOAD");
        if let Some(p) = preload {
            cmd.env("LD_PRELOAD", p).env("GPUFRAC_MEMORY_REQUEST", "1GiB");
        }
        assert!(cmd.status().expect("/bin/true").success());
    }
    t.elapsed().as_secs_f64() * 1e6 / runs as f64
}

fn settings() -> Settings {
    let mut s = Settings {
        rounds: 21,
        launch_runs: 2,
        pairs: 20_000,
        launches: 200_000,
        sizes: [4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 64 << 20].into(),
        shim: artifact("libgpufrac.so"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("shim_bench: {flag} needs a value"));
        let count =
            || value.parse::<usize>().unwrap_or_else(|_| panic!("shim_bench: {flag} {value}: not a count"));
        match flag.as_str() {
            "--rounds" => s.rounds = count().max(1),
            "--launch-runs" => s.launch_runs = count(),
            "--pairs" => s.pairs = count().max(20),
            "--launches" => s.launches = count().max(1),
            "--sizes" => {
                s.sizes = value
                    .split(',')
                    .map(|v| parse_bytes("--sizes", v).unwrap_or_else(|e| panic!("shim_bench: {e}")))
                    .collect()
            }
            "--shim" => s.shim = PathBuf::from(&value),
            _ => panic!(
                "shim_bench: unknown option {flag} (--rounds, --launch-runs, --pairs, --launches, --sizes, --shim)"
            ),
        }
    }
    s
}

fn size_name(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn main() {
    let s = settings();
    let sim = SimGpuDir::new(&std::env::temp_dir(), &target_dir(), "16GiB").expect("simulated GPU");
    let programs: Vec<PathBuf> =
        PATHS.iter().map(|p| compile_c("shim_bench.c", &[p.define], p.define == "MODE_LINKED")).collect();
    println!(
        "shim_bench: {} rounds, each with {} more runs of launches only; per run {} alloc+free pairs at each size and {} launches; bare simgpu and under the shim alternately",
        s.rounds, s.launch_runs, s.pairs, s.launches
    );
    let launch_only = Settings { launch_runs: 0, pairs: 20, sizes: vec![4 << 10], shim: s.shim.clone(), ..s };
    // Bare and shimmed, one right after the other, the order flipping every round.
    let pair = |i: usize, round: usize, s: &Settings| {
        let path = &PATHS[i];
        if round.is_multiple_of(2) {
            let bare = run(&programs[i], path, &sim, false, s);
            (bare, run(&programs[i], path, &sim, true, s))
        } else {
            let shimmed = run(&programs[i], path, &sim, true, s);
            (run(&programs[i], path, &sim, false, s), shimmed)
        }
    };
    // runs[path][round] = (bare, shimmed); launch_runs[path] also holds the launch-only runs.
    let mut runs: Vec<Vec<(Run, Run)>> = PATHS.iter().map(|_| vec![]).collect();
    let mut launch_runs: Vec<Vec<(Run, Run)>> = PATHS.iter().map(|_| vec![]).collect();
    for round in 0..s.rounds {
        for i in 0..PATHS.len() {
            runs[i].push(pair(i, round, &s));
            for extra in 0..s.launch_runs {
                launch_runs[i].push(pair(i, round + extra + 1, &launch_only));
            }
        }
    }

    println!(
        "{:<28} {:<18} {:>11} {:>11} {:>10} {:>12} {:>7} {:>12} {:>13}",
        "path", "call", "bare", "with shim", "added", "middle half", "ratio", "added (wall)", "in-process"
    );
    for (i, path) in PATHS.iter().enumerate() {
        let rounds = &runs[i];
        for (k, &size) in s.sizes.iter().enumerate() {
            let call = format!("alloc+free {}", size_name(size));
            let inside = median(rounds.iter().map(|(_, s)| s.inside[k]).collect());
            let rounds: Vec<&(Run, Run)> = rounds.iter().collect();
            print_row(path.name, &call, &rounds, &|r| r.pairs[k].2, &|r| r.pairs[k].1, inside);
        }
        let launches: Vec<&(Run, Run)> = rounds.iter().chain(&launch_runs[i]).collect();
        let inside = median(launches.iter().map(|(_, s)| s.inside_launch).collect());
        print_row(path.name, "cuLaunchKernel", &launches, &|r| r.launch.1, &|r| r.launch.0, inside);
    }

    let shim = s.shim.clone();
    let runs = 300;
    let (mut bare_start, mut shim_start) = (vec![], vec![]);
    for _ in 0..5 {
        bare_start.push(startup(None, runs));
        shim_start.push(startup(Some(&shim), runs));
    }
    let (bs, ss) = (median(bare_start), median(shim_start));
    println!(
        "{:<28} {:<18} {:>8.1} us {:>8.1} us {:>+7.1} us {:>12} {:>7.3}",
        "start-up of /bin/true",
        "",
        bs,
        ss,
        ss - bs,
        "",
        ss / bs
    );
}
