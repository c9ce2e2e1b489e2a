//! `gpufrac demo`: sample inference servers sharing a simulated GPU, in three acts, one
//! per resolver: bursts that wait for each other, a priority burst that ends an idle
//! lower-priority holder, and a burst served by swapping a sleeping holder to host RAM
//! and back. Each act runs on its own simulated GPU under its own arbiter, prints a
//! timeline and ends with its outcome and a PASS/FAIL verdict: an act whose resolver did
//! not act failed. Needs no GPU: it runs on simgpu, built with the workspace next to the
//! `gpufrac` binary.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpufrac_common::size::format_size;
use simgpu_state::env::SimGpuDir;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The fewest servers of the first act: bursts wait for each other only when two collide.
pub const MIN_SERVERS: usize = 2;
/// The most servers of the first act.
pub const MAX_SERVERS: usize = 16;
/// What each server of the first act is guaranteed (GPUFRAC_MEMORY_REQUEST).
const REQUEST: u64 = 1088 * MIB;
/// What each server of the first act may burst to (GPUFRAC_MEMORY_LIMIT).
const LIMIT: u64 = 2176 * MIB;
/// Room the largest burst of the first act needs beside every request (a 1 GiB batch).
const LARGEST_BURST: u64 = GIB;
/// Memory no request reserves, when the device is sized from `--servers`: one 1 GiB
/// burst and one 256 MiB burst at a time, so that the others wait.
const SPARE: u64 = 1344 * MIB;
/// The simulated GPU of acts 2 and 3, sized so that their two bursts collide.
const SMALL_DEVICE: &str = "4.5GiB";
/// A burst granted sooner than this did not really wait (the arbiter queues a burst
/// that arrives while memory is being given back, and grants it a moment later).
const WAIT_SHOWN_MS: u64 = 10;

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

/// The memory of the first act's GPU sized for `servers`: their requests, one 1 GiB
/// burst and one 256 MiB burst (4.5 GiB for 3 servers).
pub fn device_memory_for(servers: usize) -> u64 {
    servers as u64 * REQUEST + SPARE
}

/// The memory of the first act's GPU: `device_memory` if given, else sized from
/// `servers`; refuses at once what cannot show bursts waiting for each other, with a hint.
pub fn first_act_device(servers: usize, device_memory: Option<&str>) -> Result<u64, DemoError> {
    if !(MIN_SERVERS..=MAX_SERVERS).contains(&servers) {
        let hint = if servers < MIN_SERVERS {
            " (hint: bursts wait for each other only when two servers collide)"
        } else {
            ""
        };
        return Err(DemoError::Impossible(format!(
            "--servers must be between {MIN_SERVERS} and {MAX_SERVERS}, not {servers}{hint}"
        )));
    }
    let sized = device_memory_for(servers);
    let Some(given) = device_memory else { return Ok(sized) };
    let device = gpufrac_common::parse_bytes("--device-memory", given)
        .map_err(|e| DemoError::Impossible(e.to_string()))?;
    let requests = servers as u64 * REQUEST;
    let hint =
        format!("or leave --device-memory out to size it for {servers} servers ({})", format_size(sized));
    if device < requests + LARGEST_BURST {
        return Err(DemoError::Impossible(format!(
            "--device-memory {given} is too small for {servers} servers: their requests take {servers} × {} = {} \
             and a 1 GiB batch needs {} beside them (hint: give at least {}, {hint})",
            format_size(REQUEST),
            format_size(requests),
            format_size(LARGEST_BURST),
            format_size(requests + LARGEST_BURST),
        )));
    }
    if device >= servers as u64 * LIMIT {
        return Err(DemoError::Impossible(format!(
            "--device-memory {given} is too large for {servers} servers: all of them fit at their limit ({}) \
             at once, so no burst would ever wait (hint: give less than {}, {hint})",
            format_size(LIMIT),
            format_size(servers as u64 * LIMIT),
        )));
    }
    Ok(device)
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
        ActKind::Wait => {
            if d.granted_after_wait == 0 {
                problems.push("no burst waited and was granted: the bursts never collided".to_owned());
            }
            if d.denied > 0 {
                problems.push(format!("{} bursts timed out waiting", d.denied));
            }
        }
        ActKind::Priority => {
            if d.terminated == 0 {
                problems.push("no holder was ended for the priority burst".to_owned());
            }
        }
        ActKind::Swap => {
            if d.swapped_out == 0 || d.swapped_in == 0 {
                problems.push(format!(
                    "nothing was swapped out and back in ({} out, {} in)",
                    d.swapped_out, d.swapped_in
                ));
            }
            if d.kept_intact < d.kept_expected {
                problems
                    .push(format!("{} of {} kept caches verified intact", d.kept_intact, d.kept_expected));
            }
        }
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

/// `key=value` from a log line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|t| t.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
}

fn mib(bytes: &str) -> String {
    bytes.parse::<u64>().map_or_else(|_| bytes.to_owned(), |b| format!("{} MiB", b / MIB))
}

/// Kills the arbiters and any server left when the demo ends, however it ends.
#[derive(Default)]
struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
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

/// A burst the arbiter queued, not yet shown.
struct Queued {
    since: Instant,
    bytes: String,
    shown: bool,
}

/// The lines of every process, in order, and who is who.
struct Timeline {
    started: Instant,
    tx: mpsc::Sender<(String, String)>,
    rx: mpsc::Receiver<(String, String)>,
    names_by_pid: HashMap<String, String>,
    queued: HashMap<String, Queued>,
    /// The act's arbiter's last log lines, shown if the act fails.
    arbiter_tail: std::collections::VecDeque<String>,
}

/// Log lines of the arbiter kept for a failing act.
const ARBITER_TAIL: usize = 25;

impl Timeline {
    fn forward(&self, name: &str, pipe: Box<dyn std::io::Read + Send>) {
        let (name, tx) = (name.to_owned(), self.tx.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send((name.clone(), line));
            }
        });
    }

    fn print(&self, who: &str, event: &str) {
        println!("{:7.3}s  {who:<10} {event}", self.started.elapsed().as_secs_f64());
    }

    /// Shows the queued bursts that have waited past a few ms (or all, with `all`).
    fn show_waits(&mut self, all: bool, summary: &mut DemoSummary) {
        let mut due: Vec<(String, String)> = Vec::new();
        for (who, q) in &mut self.queued {
            if !q.shown && (all || q.since.elapsed() > Duration::from_millis(WAIT_SHOWN_MS)) {
                q.shown = true;
                due.push((who.clone(), q.bytes.clone()));
            }
        }
        for (who, bytes) in due {
            summary.waits += 1;
            self.print("arbiter", &format!("{who} bursts {bytes} and waits: that memory is lent out"));
        }
    }

    /// Prints an arbiter line worth showing, counting it in `summary`.
    fn arbiter_event(&mut self, line: &str, summary: &mut DemoSummary) {
        if self.arbiter_tail.len() == ARBITER_TAIL {
            self.arbiter_tail.pop_front();
        }
        self.arbiter_tail.push_back(line.to_owned());
        let who = field(line, "pid").and_then(|p| self.names_by_pid.get(p)).cloned().unwrap_or_default();
        let bytes = || mib(field(line, "bytes").unwrap_or("?"));
        let event = if line.contains("burst waits") {
            // Shown once it has waited more than a few ms: most are granted at once.
            self.queued.insert(who, Queued { since: Instant::now(), bytes: bytes(), shown: false });
            return;
        } else if line.contains("grant after wait") || line.contains("a burst waited") {
            let waited: u64 = field(line, "waited_ms").and_then(|w| w.parse().ok()).unwrap_or(0);
            let shown = self.queued.remove(&who).is_some_and(|q| q.shown);
            if !shown && waited <= WAIT_SHOWN_MS {
                return;
            }
            if !shown {
                summary.waits += 1;
            }
            summary.granted_after_wait += 1;
            format!("{who} granted {} after {waited} ms", bytes())
        } else if line.contains("burst denied") {
            summary.denied += 1;
            self.queued.remove(&who);
            format!(
                "{who} burst denied after {} ms ({})",
                field(line, "waited_ms").unwrap_or("?"),
                field(line, "reason").unwrap_or("?")
            )
        } else if line.contains("terminating a holder") {
            // The burst it serves waits for it: say so first.
            self.show_waits(true, summary);
            summary.terminated += 1;
            let why = line.split("why=").nth(1).and_then(|w| w.split(" bytes").next()).unwrap_or("?");
            format!("{who} is ended (SIGTERM) to serve a priority burst: {why}, holding {}", bytes())
        } else if line.contains("ending a holder of burst memory for a guarantee") {
            self.show_waits(true, summary);
            summary.terminated += 1;
            format!("{who} is ended (SIGTERM): a guarantee needs the {} it borrowed", bytes())
        } else if line.contains("asking a holder of burst memory to swap out") {
            self.show_waits(true, summary);
            format!("{who} is asked to move {} of burst memory to host RAM", bytes())
        } else if line.contains("swapped out") && field(line, "bytes").is_some_and(|b| b != "0") {
            summary.swapped_out += 1;
            format!(
                "{who} swapped {} out to host RAM in {} ms (addresses kept)",
                bytes(),
                field(line, "ms").unwrap_or("?")
            )
        } else if line.contains("swapped in") && field(line, "bytes").is_some_and(|b| b != "0") {
            summary.swapped_in += 1;
            format!("{who} swapped {} back in in {} ms", bytes(), field(line, "ms").unwrap_or("?"))
        } else if line.contains("registration refused") || line.contains("ERROR") {
            line.to_owned()
        } else {
            return;
        };
        self.print("arbiter", &event);
    }
}

/// What all acts share.
struct Stage<'a> {
    config: &'a DemoConfig,
    server_bin: PathBuf,
    shim: Option<PathBuf>,
    arbiter_bin: Option<PathBuf>,
}

/// One act's simulated GPU and arbiter.
struct Gpu {
    sim: SimGpuDir,
    socket: PathBuf,
}

impl Stage<'_> {
    /// A fresh simulated GPU of `memory`, with an arbiter serving it when under gpufrac.
    fn gpu(&self, memory: &str, timeline: &Timeline, reaper: &mut Reaper) -> Result<Gpu, DemoError> {
        let sim = SimGpuDir::new(&std::env::temp_dir(), &self.config.bin_dir, memory)
            .map_err(io_err("preparing the simulated GPU"))?
            .with_context_overhead("256MiB");
        let socket = sim.lib_dir().join("arbiter.sock");
        if let Some(bin) = &self.arbiter_bin {
            let mut cmd = Command::new(bin);
            cmd.arg("--socket")
                .arg(&socket)
                .args(["--swap-quantum", "2s", "--kill-grace", "3s", "--reclaim-grace", "2s"])
                // The demo narrates every wait, short ones too (debug in the arbiter's log).
                .env("GPUFRAC_LOG", "info,gpufrac_daemon::arbiter::server=debug")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            sim.apply(&mut cmd);
            let mut child = cmd.spawn().map_err(io_err(format!("starting {}", bin.display())))?;
            if let Some(err) = child.stderr.take() {
                timeline.forward("arbiter", Box::new(err));
            }
            reaper.0.push(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::os::unix::net::UnixStream::connect(&socket).is_err() {
                if Instant::now() > deadline {
                    return Err(DemoError::Server {
                        name: "arbiter".into(),
                        detail: "did not start serving".into(),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(Gpu { sim, socket })
    }

    fn spawn(
        &self,
        gpu: &Gpu,
        server: &Server,
        act: usize,
        timeline: &mut Timeline,
    ) -> Result<Child, DemoError> {
        let mut cmd = Command::new(&self.server_bin);
        cmd.arg("--name").arg(&server.name).args(&server.args).stdout(Stdio::piped()).stderr(Stdio::piped());
        gpu.sim.apply(&mut cmd);
        if let Some(shim) = &self.shim {
            cmd.env("LD_PRELOAD", shim)
                .env("GPUFRAC_MEMORY_REQUEST", server.request)
                .env("GPUFRAC_MEMORY_LIMIT", server.limit)
                .env("GPUFRAC_RESOLVER", server.resolver)
                .env("GPUFRAC_PRIORITY", server.priority.to_string())
                .env("GPUFRAC_ARBITER_SOCKET", &gpu.socket)
                .env("GPUFRAC_GROUP", format!("demo-{}-{act}-{}", std::process::id(), server.name))
                .env("GPUFRAC_WAIT_TIMEOUT", "60s");
        }
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", self.server_bin.display())))?;
        timeline.names_by_pid.insert(child.id().to_string(), server.name.clone());
        if let Some(out) = child.stdout.take() {
            timeline.forward(&server.name, Box::new(out));
        }
        if let Some(err) = child.stderr.take() {
            timeline.forward(&server.name, Box::new(err));
        }
        Ok(child)
    }

    /// Prints a server's line, counting it in `summary`.
    fn server_line(
        name: &str,
        line: &str,
        expected_to_end: bool,
        timeline: &Timeline,
        summary: &mut DemoSummary,
        errors: &mut Vec<(String, String)>,
    ) -> String {
        let event = line.strip_prefix(name).map(str::trim).unwrap_or(line).to_owned();
        if event.starts_with("batch=") {
            summary.batches_served += 1;
        } else if event.starts_with("out-of-memory") {
            summary.out_of_memory += 1;
        } else if event.starts_with("kept-memory-intact") && !expected_to_end {
            summary.kept_intact += 1;
        } else if event.contains("error") {
            errors.push((name.to_owned(), event.clone()));
        }
        timeline.print(name, &event);
        event
    }

    /// Runs one act to its end: every server finished (or was ended, as expected). A
    /// server that fails ends the act at once.
    fn run_act(
        &self,
        number: usize,
        act: &Act,
        timeline: &mut Timeline,
        summary: &mut DemoSummary,
        reaper: &mut Reaper,
    ) -> Result<(), DemoError> {
        let gpu = self.gpu(&act.device_memory, timeline, reaper)?;
        let mut errors: Vec<(String, String)> = Vec::new();
        let mut next = 0;
        // name → (index in the reaper, expected to be ended)
        let mut running: HashMap<String, (usize, bool)> = HashMap::new();
        let mut seen: Vec<(String, String)> = Vec::new();
        let mut last_progress = Instant::now();
        let expected_to_end: HashMap<&str, bool> =
            act.servers.iter().map(|s| (s.name.as_str(), s.ended)).collect();
        loop {
            // Start every server whose cue has come.
            while let Some(server) = act.servers.get(next) {
                if let Some((who, event, delay)) = &server.after {
                    if !seen.iter().any(|(n, e)| n == who && e.starts_with(event)) {
                        break;
                    }
                    std::thread::sleep(*delay);
                }
                let child = self.spawn(&gpu, server, number, timeline)?;
                running.insert(server.name.clone(), (reaper.0.len(), server.ended));
                reaper.0.push(child);
                next += 1;
            }
            // Reap who exited: one ended by the priority resolver prints nothing more; any
            // other failure ends the act.
            let mut failed = None;
            running.retain(|n, &mut (i, ended)| match reaper.0[i].try_wait().ok().flatten() {
                None => true,
                Some(status) => {
                    if !status.success() {
                        if ended {
                            timeline.print(n, &format!("ended ({status})"));
                        } else {
                            failed = Some((n.clone(), status));
                        }
                    }
                    false
                }
            });
            if let Some((name, status)) = failed {
                // Its last lines may still be on their way.
                while let Ok((who, line)) = timeline.rx.recv_timeout(Duration::from_millis(300)) {
                    if who == "arbiter" {
                        timeline.arbiter_event(&line, summary);
                    } else {
                        let ends = expected_to_end.get(who.as_str()).copied().unwrap_or(false);
                        Self::server_line(&who, &line, ends, timeline, summary, &mut errors);
                    }
                }
                let detail = errors
                    .iter()
                    .rev()
                    .find(|(n, _)| *n == name)
                    .map_or_else(|| status.to_string(), |(_, e)| e.clone());
                return Err(DemoError::Server { name, detail });
            }
            timeline.show_waits(false, summary);
            // Often while a burst is queued, to show it once it has waited a few ms.
            let tick = if timeline.queued.values().any(|q| !q.shown) { 2 } else { 200 };
            let (name, line) = match timeline.rx.recv_timeout(Duration::from_millis(tick)) {
                Ok(got) => {
                    last_progress = Instant::now();
                    got
                }
                // Everyone exited and every line is in.
                Err(_) if running.is_empty() && next == act.servers.len() => break,
                Err(_) if running.is_empty() => {
                    let server = &act.servers[next];
                    let (who, event) = server.after.as_ref().map_or(("?", "?"), |(w, e, _)| (w.as_str(), *e));
                    return Err(DemoError::Server {
                        name: server.name.clone(),
                        detail: format!("not started: {who} exited before printing {event:?}"),
                    });
                }
                Err(_) if last_progress.elapsed() < Duration::from_secs(90) => continue,
                Err(_) => {
                    return Err(DemoError::Server {
                        name: act.title.into(),
                        detail: "no progress for 90 s".into(),
                    })
                }
            };
            if name == "arbiter" {
                timeline.arbiter_event(&line, summary);
                continue;
            }
            let ends = expected_to_end.get(name.as_str()).copied().unwrap_or(false);
            let event = Self::server_line(&name, &line, ends, timeline, summary, &mut errors);
            seen.push((name, event));
        }
        timeline.queued.clear();
        Ok(())
    }
}

/// The three acts: the first on a GPU of `device` bytes, the others on their own.
fn acts(config: &DemoConfig, device: u64) -> Vec<Act> {
    let steps = config.steps.to_string();
    let mut first = Act {
        kind: ActKind::Wait,
        title: "wait: colliding bursts wait for each other",
        story: &[
            "Each server loads a 768 MiB model, then serves batches whose activations swing between 256 MiB",
            "and 1 GiB. Each is guaranteed 1088 MiB (request) and may burst to 2176 MiB (limit); the arbiter",
            "lends what no request reserves, and a burst that collides waits until memory is given back.",
        ],
        device_memory: format!("{}MiB", device.div_ceil(MIB)),
        servers: Vec::new(),
    };
    if !config.arbiter {
        first.kind = ActKind::Bare;
        first.title = "without gpufrac: first come, first served";
        first.story = &["The same servers, bare: a colliding burst is an out-of-memory error."];
    }
    for i in 0..config.servers {
        let batches = ["256MiB,1GiB,512MiB", "512MiB,256MiB,1GiB", "1GiB,512MiB,256MiB"][i % 3];
        first.servers.push(Server::new(
            &format!("server-{}", i + 1),
            &["--model", "768MiB", "--steps", &steps, "--batches", batches, "--compute", "30ms"],
        ));
    }
    if !config.arbiter {
        return vec![first];
    }
    let notebook = Server {
        limit: "2560MiB",
        resolver: "wait",
        priority: 0,
        ended: true,
        ..Server::new(
            "notebook",
            &["--model", "832MiB", "--keep", "1280MiB", "--steps", "0", "--idle", "120s"],
        )
    };
    let production = Server {
        limit: "2560MiB",
        resolver: "priority",
        priority: 10,
        after: Some(("notebook".into(), "idle", Duration::from_millis(200))),
        ..Server::new(
            "production",
            &["--model", "832MiB", "--batches", "1280MiB", "--steps", "2", "--compute", "30ms"],
        )
    };
    let second = Act {
        kind: ActKind::Priority,
        title: "priority: a production burst ends an idle lower-priority holder",
        story: &[
            "A notebook (priority 0) holds 1280 MiB of burst memory and goes idle. A production server",
            "(priority 10, resolver priority) needs 1280 MiB for its batches: the arbiter ends the notebook.",
        ],
        device_memory: SMALL_DEVICE.into(),
        servers: vec![notebook, production],
    };
    let sleeper = Server {
        resolver: "swap",
        limit: "2560MiB",
        ..Server::new("chat-a", &["--model", "832MiB", "--keep", "1280MiB", "--steps", "0", "--idle", "10s"])
    };
    let busy = Server {
        resolver: "swap",
        limit: "2560MiB",
        // At once: chat-b's burst waits out chat-a's quantum if it comes sooner, and a
        // slow start of chat-b (a loaded machine) still finds chat-a asleep.
        after: Some(("chat-a".into(), "idle", Duration::from_millis(200))),
        ..Server::new(
            "chat-b",
            &["--model", "832MiB", "--batches", "1280MiB", "--steps", "3", "--compute", "30ms"],
        )
    };
    let third = Act {
        kind: ActKind::Swap,
        title: "swap: two servers take turns with the same memory",
        story: &[
            "chat-a keeps a 1280 MiB KV cache and sleeps. chat-b needs 1280 MiB for its batches: the arbiter",
            "has chat-a's cache moved to host RAM (same addresses, nothing lost) and chat-b runs. The cache",
            "comes back when memory is free again (should chat-a need it sooner, the two take turns, 2 s each:",
            "--swap-quantum); chat-a verifies every byte of its cache at the end.",
        ],
        device_memory: SMALL_DEVICE.into(),
        servers: vec![sleeper, busy],
    };
    vec![first, second, third]
}

/// What an act did, in one line.
fn outcome_text(kind: ActKind, d: &DemoSummary) -> String {
    match kind {
        ActKind::Wait => format!(
            "{} batches served, {} bursts waited and were granted, {} denied, {} out-of-memory errors",
            d.batches_served, d.granted_after_wait, d.denied, d.out_of_memory
        ),
        ActKind::Bare => {
            format!("{} batches served, {} out-of-memory errors", d.batches_served, d.out_of_memory)
        }
        ActKind::Priority => format!(
            "{} idle lower-priority holder ended, production served {} batches, {} out-of-memory errors",
            d.terminated, d.batches_served, d.out_of_memory
        ),
        ActKind::Swap => format!(
            "{} swapped out and {} back in, chat-b served {} batches, {} of {} kept caches verified intact, {} out-of-memory errors",
            d.swapped_out, d.swapped_in, d.batches_served, d.kept_intact, d.kept_expected, d.out_of_memory
        ),
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
    fn the_device_is_sized_from_the_servers() {
        assert_eq!(device_memory_for(3), 4608 * MIB, "the 4.5 GiB of the default");
        assert_eq!(first_act_device(5, None).expect("sized"), 5 * 1088 * MIB + 1344 * MIB);
        for n in MIN_SERVERS..=MAX_SERVERS {
            let sized = first_act_device(n, None).expect("sized");
            // Every request fits with room for the largest burst, and not all at their limit.
            assert!(sized >= n as u64 * REQUEST + LARGEST_BURST && sized < n as u64 * LIMIT, "{n}");
        }
        assert_eq!(first_act_device(5, Some("7GiB")).expect("given"), 7 * GIB);
    }

    #[test]
    fn impossible_combinations_are_refused_with_a_hint() {
        let err = first_act_device(5, Some("4.5GiB")).unwrap_err().to_string();
        assert!(err.contains("too small for 5 servers") && err.contains("at least 6.31 GiB"), "{err}");
        assert!(err.contains("leave --device-memory out"), "{err}");
        let err = first_act_device(3, Some("16GiB")).unwrap_err().to_string();
        assert!(err.contains("too large") && err.contains("no burst would ever wait"), "{err}");
        for n in [0, 1] {
            let err = first_act_device(n, None).unwrap_err().to_string();
            assert!(
                err.contains("--servers must be between 2 and 16") && err.contains("two servers collide"),
                "{err}"
            );
        }
        let err = first_act_device(MAX_SERVERS + 1, None).unwrap_err().to_string();
        assert!(err.contains("--servers must be between 2 and 16, not 17"), "{err}");
        let err = first_act_device(3, Some("lots")).unwrap_err().to_string();
        assert!(err.contains("--device-memory"), "{err}");
    }

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
