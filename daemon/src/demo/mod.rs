//! `gpufrac demo`: sample inference servers sharing a simulated GPU, in three acts, one
//! per resolver: bursts that wait for each other, a priority burst that ends an idle
//! lower-priority holder, and a burst served by swapping a sleeping holder to host RAM
//! and back. Each act runs on its own simulated GPU under its own arbiter, prints a
//! timeline and ends with its outcome and a PASS/FAIL verdict: an act whose resolver did
//! not act failed. Needs no GPU: it runs on simgpu, built with the workspace next to the
//! `gpufrac` binary.

//!
//! One file per act (`wait.rs`, `priority.rs`, `swap.rs`: its servers, what it must show,
//! its outcome in a line); `stage.rs` runs an act, `timeline.rs` narrates it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpufrac_common::size::format_size;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

mod priority;
mod stage;
mod swap;
mod timeline;
mod wait;

use stage::{Reaper, Stage};
use timeline::Timeline;

pub use wait::{device_memory_for, first_act_device, MAX_SERVERS, MIN_SERVERS};

/// The simulated GPU of acts 2 and 3, sized so that their two bursts collide.
const SMALL_DEVICE: &str = "4.5GiB";

/// Why the demo could not run, or failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A file the demo needs is not beside the `gpufrac` binary.
    #[error(
        "{0} not found beside the gpufrac binary; build everything first: cargo build --release --workspace"
    )]
    Missing(PathBuf),
    /// `--servers` and `--device-memory` cannot show the first act.
    #[error("{0}")]
    Impossible(String),
    /// Starting the simulated GPU or a server failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A server failed (not an out-of-memory error, which the demo counts).
    #[error("server {name} failed: {detail}")]
    Server {
        /// The server.
        name: String,
        /// Its last error line.
        detail: String,
    },
    /// An act did not show its resolver.
    #[error("the demo failed: {0}")]
    Failed(String),
}

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Folder with `libsimgpu_*.so`, `libgpufrac.so`, `gpufrac-arbiter` and
    /// `sample-inference-server`.
    pub bin_dir: PathBuf,
    /// Memory of the simulated GPU of the first act; `None`: sized from `servers`.
    pub device_memory: Option<String>,
    /// Number of servers in the first act.
    pub servers: usize,
    /// Batches each server of the first act serves.
    pub steps: usize,
    /// Run under the shim and the arbiter, all three acts (otherwise: the first act
    /// bare, to compare).
    pub arbiter: bool,
}

/// The outcome, for the summary and for tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DemoSummary {
    /// Servers that ran on the one GPU in the first act.
    pub servers: usize,
    /// Batches served in all.
    pub batches_served: usize,
    /// Out-of-memory errors the servers hit.
    pub out_of_memory: usize,
    /// Bursts that waited for memory (longer than a few ms).
    pub waits: usize,
    /// Bursts granted after waiting (longer than a few ms).
    pub granted_after_wait: usize,
    /// Bursts denied (their wait timed out).
    pub denied: usize,
    /// Holders ended by the priority resolver.
    pub terminated: usize,
    /// Swaps to host RAM.
    pub swapped_out: usize,
    /// Swaps back to the GPU.
    pub swapped_in: usize,
    /// Servers whose kept memory was verified intact at the end.
    pub kept_intact: usize,
    /// Servers that were to verify their kept memory at the end.
    pub kept_expected: usize,
    /// Each act played, in order.
    pub acts: Vec<ActOutcome>,
}

impl DemoSummary {
    /// What happened since `before` (the counters only).
    fn since(&self, before: &DemoSummary) -> DemoSummary {
        DemoSummary {
            servers: self.servers,
            batches_served: self.batches_served - before.batches_served,
            out_of_memory: self.out_of_memory - before.out_of_memory,
            waits: self.waits - before.waits,
            granted_after_wait: self.granted_after_wait - before.granted_after_wait,
            denied: self.denied - before.denied,
            terminated: self.terminated - before.terminated,
            swapped_out: self.swapped_out - before.swapped_out,
            swapped_in: self.swapped_in - before.swapped_in,
            kept_intact: self.kept_intact - before.kept_intact,
            kept_expected: self.kept_expected - before.kept_expected,
            acts: Vec::new(),
        }
    }

    /// Every act played passed (a bare run has no verdict).
    pub fn passed(&self) -> bool {
        self.acts.iter().all(|a| a.verdict.as_ref().is_none_or(Result::is_ok))
    }
}

/// Which resolver an act shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActKind {
    /// Bursts wait for each other.
    Wait,
    /// The first act without gpufrac, to compare: no verdict.
    Bare,
    /// A priority burst ends an idle lower-priority holder.
    Priority,
    /// A sleeping holder is swapped to host RAM and back.
    Swap,
}

/// How one act ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActOutcome {
    /// The act.
    pub kind: ActKind,
    /// What it did, in one line.
    pub text: String,
    /// PASS (`Ok`) or FAIL with the reason; `None` for a bare run.
    pub verdict: Option<Result<(), String>>,
}

/// The verdict on an act from what happened during it (`d`), `batches` being what its
/// servers were to serve: `Err` says why the act did not show its resolver.
pub fn verdict(kind: ActKind, d: &DemoSummary, batches: usize) -> Option<Result<(), String>> {
    let mut problems = Vec::new();
    match kind {
        ActKind::Bare => return None,
        ActKind::Wait => wait::problems(d, &mut problems),
        ActKind::Priority => priority::problems(d, &mut problems),
        ActKind::Swap => swap::problems(d, &mut problems),
    }
    if d.batches_served < batches {
        problems.push(format!("{} of {batches} batches served", d.batches_served));
    }
    if d.out_of_memory > 0 {
        problems.push(format!("{} out-of-memory errors", d.out_of_memory));
    }
    Some(if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) })
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

fn need(path: PathBuf) -> Result<PathBuf, DemoError> {
    if path.exists() {
        Ok(path)
    } else {
        Err(DemoError::Missing(path))
    }
}

/// One server of an act.
struct Server {
    name: String,
    args: Vec<String>,
    request: &'static str,
    limit: &'static str,
    resolver: &'static str,
    priority: i32,
    /// The priority resolver is expected to end it.
    ended: bool,
    /// It keeps memory (`--keep`) and verifies it at the end.
    keeps: bool,
    /// Batches it is to serve.
    steps: usize,
    /// Start it only once this server printed this event (and `delay` passed).
    after: Option<(String, &'static str, Duration)>,
}

impl Server {
    fn new(name: &str, args: &[&str]) -> Server {
        let arg = |key: &str| args.iter().position(|a| *a == key).and_then(|i| args.get(i + 1));
        Server {
            name: name.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            request: "1088MiB",
            limit: "2176MiB",
            resolver: "wait",
            priority: 0,
            ended: false,
            keeps: arg("--keep").is_some(),
            steps: arg("--steps").and_then(|s| s.parse().ok()).unwrap_or(4),
            after: None,
        }
    }
}

/// One act: a resolver, its GPU, its servers, what it shows.
struct Act {
    kind: ActKind,
    title: &'static str,
    story: &'static [&'static str],
    device_memory: String,
    servers: Vec<Server>,
}

/// The three acts: the first on a GPU of `device` bytes, the others on their own.
fn acts(config: &DemoConfig, device: u64) -> Vec<Act> {
    let first = wait::act(config, device);
    if !config.arbiter {
        return vec![first];
    }
    vec![first, priority::act(), swap::act()]
}

/// What an act did, in one line.
fn outcome_text(kind: ActKind, d: &DemoSummary) -> String {
    match kind {
        ActKind::Wait => wait::outcome(d),
        ActKind::Bare => wait::bare_outcome(d),
        ActKind::Priority => priority::outcome(d),
        ActKind::Swap => swap::outcome(d),
    }
}

fn verdict_word(verdict: &Option<Result<(), String>>) -> String {
    match verdict {
        None => "no verdict (bare run, to compare)".into(),
        Some(Ok(())) => "PASS".into(),
        Some(Err(why)) => format!("FAIL: {why}"),
    }
}

fn print_summary(summary: &DemoSummary, config: &DemoConfig, acts: &[Act]) {
    println!("\nSummary");
    println!("  servers in act 1:       {}", summary.servers);
    println!("  batches served:         {}", summary.batches_served);
    if config.arbiter {
        println!("  bursts that waited:     {}", summary.waits);
        println!("  granted after waiting:  {}", summary.granted_after_wait);
        println!("  holders ended:          {}", summary.terminated);
        println!("  swapped out / in:       {} / {}", summary.swapped_out, summary.swapped_in);
        println!("  kept caches intact:     {} of {}", summary.kept_intact, summary.kept_expected);
    }
    println!("  out-of-memory errors:   {}", summary.out_of_memory);
    for (i, act) in acts.iter().enumerate() {
        let resolver = act.title.split(':').next().unwrap_or(act.title);
        match summary.acts.get(i) {
            Some(o) => println!("  act {} {resolver}: {} — {}", i + 1, o.text, verdict_word(&o.verdict)),
            None => println!("  act {} {resolver}: not played", i + 1),
        }
    }
}

/// Runs the demo, printing the timeline to stdout, and returns the summary; fails when a
/// server fails or an act did not show its resolver.
pub fn run(config: &DemoConfig) -> Result<DemoSummary, DemoError> {
    let device = first_act_device(config.servers, config.device_memory.as_deref())?;
    let server_bin = need(config.bin_dir.join("sample-inference-server"))?;
    need(config.bin_dir.join("libsimgpu_cuda.so"))?;
    need(config.bin_dir.join("libsimgpu_nvml.so"))?;
    let (shim, arbiter_bin) = if config.arbiter {
        (
            Some(need(config.bin_dir.join("libgpufrac.so"))?),
            Some(need(config.bin_dir.join("gpufrac-arbiter"))?),
        )
    } else {
        (None, None)
    };
    let stage = Stage { config, server_bin, shim, arbiter_bin };
    let sized = if config.device_memory.is_some() { "given" } else { "sized for them" };
    println!("gpufrac demo: inference servers on simulated GPUs (simgpu, no GPU needed)");
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let mut timeline = Timeline {
        started: Instant::now(),
        tx,
        rx,
        names_by_pid: HashMap::new(),
        queued: HashMap::new(),
        arbiter_tail: Default::default(),
    };
    let mut reaper = Reaper::default();

    let mut summary = DemoSummary { servers: config.servers, ..Default::default() };
    let acts = acts(stage.config, device);
    let mut failure = None;
    for (i, act) in acts.iter().enumerate() {
        println!("\n== Act {}: {} ==", i + 1, act.title);
        let gpu = if i == 0 {
            format!("{} servers on a GPU of {} ({sized})", act.servers.len(), format_size(device))
        } else {
            let memory = gpufrac_common::parse_bytes("device", &act.device_memory).unwrap_or_default();
            format!("a GPU of {}", format_size(memory))
        };
        println!("({gpu}, with an arbiter of its own)");
        for line in act.story {
            println!("{line}");
        }
        let before = summary.clone();
        summary.kept_expected += act.servers.iter().filter(|s| s.keeps && !s.ended).count();
        timeline.arbiter_tail.clear();
        let played = stage.run_act(i + 1, act, &mut timeline, &mut summary, &mut reaper);
        let d = summary.since(&before);
        let batches = act.servers.iter().filter(|s| !s.ended).map(|s| s.steps).sum();
        let mut outcome = ActOutcome {
            kind: act.kind,
            text: outcome_text(act.kind, &d),
            verdict: verdict(act.kind, &d, batches),
        };
        if let Err(e) = played {
            outcome.verdict = Some(Err(e.to_string()));
            failure = Some(e);
            if !timeline.arbiter_tail.is_empty() {
                println!("The arbiter's last log lines in this act:");
                for line in &timeline.arbiter_tail {
                    println!("  {line}");
                }
            }
        }
        println!("Outcome: {}", outcome.text);
        println!("Verdict: {}", verdict_word(&outcome.verdict));
        summary.acts.push(outcome);
        if failure.is_some() {
            break;
        }
    }
    drop(reaper);
    // A server ended by the priority act never ran its exit hook: its group's ledger goes
    // now that every server is gone (ledgers still in use are left).
    let _ = gpufrac_common::shm::ledgers::sweep();
    print_summary(&summary, config, &acts);
    let failed: Vec<String> = summary
        .acts
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match &a.verdict {
            Some(Err(why)) => {
                Some(format!("act {} ({}): {why}", i + 1, format!("{:?}", a.kind).to_lowercase()))
            }
            _ => None,
        })
        .collect();
    if let Some(e) = failure {
        println!("\nFAIL: {}", failed.join("; "));
        return Err(e);
    }
    if !failed.is_empty() {
        println!("\nFAIL: {}", failed.join("; "));
        return Err(DemoError::Failed(failed.join("; ")));
    }
    if config.arbiter {
        println!("\nPASS: all three acts showed their resolver, without an out-of-memory error");
    }
    Ok(summary)
}

/// The folder of the running executable, where the build puts everything the demo needs.
pub fn default_bin_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_act_whose_resolver_did_not_act_fails() {
        let wait =
            DemoSummary { batches_served: 18, granted_after_wait: 12, waits: 12, ..Default::default() };
        assert_eq!(verdict(ActKind::Wait, &wait, 18), Some(Ok(())));
        let none_waited = DemoSummary { batches_served: 18, ..Default::default() };
        let why = verdict(ActKind::Wait, &none_waited, 18).expect("verdict").unwrap_err();
        assert!(why.contains("never collided"), "{why}");
        let oom = DemoSummary { out_of_memory: 1, ..wait.clone() };
        assert!(verdict(ActKind::Wait, &oom, 18).expect("verdict").unwrap_err().contains("out-of-memory"));
        let denied = DemoSummary { denied: 2, ..wait };
        assert!(verdict(ActKind::Wait, &denied, 18).expect("verdict").unwrap_err().contains("timed out"));

        let ended = DemoSummary { terminated: 1, batches_served: 2, ..Default::default() };
        assert_eq!(verdict(ActKind::Priority, &ended, 2), Some(Ok(())));
        let nobody = DemoSummary { batches_served: 2, kept_intact: 1, ..Default::default() };
        let why = verdict(ActKind::Priority, &nobody, 2).expect("verdict").unwrap_err();
        assert!(why.contains("no holder was ended"), "{why}");

        let swapped = DemoSummary {
            swapped_out: 2,
            swapped_in: 2,
            kept_intact: 1,
            kept_expected: 1,
            batches_served: 3,
            ..Default::default()
        };
        assert_eq!(verdict(ActKind::Swap, &swapped, 3), Some(Ok(())));
        let unswapped = DemoSummary { swapped_out: 0, swapped_in: 0, ..swapped.clone() };
        let why = verdict(ActKind::Swap, &unswapped, 3).expect("verdict").unwrap_err();
        assert!(why.contains("nothing was swapped"), "{why}");
        let lost = DemoSummary { kept_intact: 0, ..swapped };
        assert!(verdict(ActKind::Swap, &lost, 3).expect("verdict").unwrap_err().contains("0 of 1"));

        assert_eq!(verdict(ActKind::Bare, &DemoSummary::default(), 18), None, "a bare run has no verdict");
        let summary = DemoSummary {
            acts: vec![ActOutcome {
                kind: ActKind::Priority,
                text: String::new(),
                verdict: Some(Err("x".into())),
            }],
            ..Default::default()
        };
        assert!(!summary.passed());
    }
}
