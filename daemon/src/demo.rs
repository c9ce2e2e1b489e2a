//! `gpufrac demo`: sample inference servers sharing one simulated GPU, in three acts, one
//! per resolver: bursts that wait for each other, a priority burst that ends an idle
//! lower-priority holder, and a burst served by swapping a sleeping holder to host RAM
//! and back. Each act prints a timeline and ends with its outcome. Needs no GPU: it runs
//! on simgpu, built with the workspace next to the `gpufrac` binary.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use simgpu_state::env::SimGpuDir;

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A file the demo needs is not beside the `gpufrac` binary.
    #[error(
        "{0} not found beside the gpufrac binary; build everything first: cargo build --release --workspace"
    )]
    Missing(PathBuf),
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
}

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Folder with `libsimgpu_*.so`, `libgpufrac.so`, `gpufrac-arbiter` and
    /// `sample-inference-server`.
    pub bin_dir: PathBuf,
    /// Memory of the simulated GPU.
    pub device_memory: String,
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
    /// Bursts that had to wait for memory.
    pub waits: usize,
    /// Bursts granted after waiting.
    pub granted_after_wait: usize,
    /// Holders ended by the priority resolver.
    pub terminated: usize,
    /// Swaps to host RAM and back.
    pub swapped_out: usize,
    /// Swaps back to the GPU.
    pub swapped_in: usize,
    /// Servers whose kept memory was verified intact at the end.
    pub kept_intact: usize,
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
    bytes
        .parse::<u64>()
        .map_or_else(|_| bytes.to_owned(), |b| format!("{:.1} MiB", b as f64 / (1 << 20) as f64))
}

/// Kills the arbiter and any server left when the demo ends, however it ends.
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
    /// Start it only once this server printed this event (and `delay` passed).
    after: Option<(String, &'static str, Duration)>,
}

impl Server {
    fn new(name: &str, args: &[&str]) -> Server {
        Server {
            name: name.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            request: "1088MiB",
            limit: "2176MiB",
            resolver: "wait",
            priority: 0,
            ended: false,
            after: None,
        }
    }
}

/// One act: a resolver, its servers, what it shows.
struct Act {
    title: &'static str,
    story: &'static [&'static str],
    servers: Vec<Server>,
}

/// The lines of every process, in order, and who is who.
struct Timeline {
    started: Instant,
    tx: mpsc::Sender<(String, String)>,
    rx: mpsc::Receiver<(String, String)>,
    names_by_pid: std::collections::HashMap<String, String>,
}

impl Timeline {
    fn forward(&self, name: &str, pipe: Box<dyn std::io::Read + Send>) {
        let (name, tx) = (name.to_owned(), self.tx.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send((name.clone(), line));
            }
        });
    }

    /// Prints an arbiter line worth showing, counting it in `summary`.
    fn arbiter_event(&self, line: &str, summary: &mut DemoSummary) -> Option<String> {
        let who = field(line, "pid").and_then(|p| self.names_by_pid.get(p)).cloned().unwrap_or_default();
        let bytes = || mib(field(line, "bytes").unwrap_or("?"));
        Some(if line.contains("burst waits") {
            summary.waits += 1;
            format!("{who} bursts {} and waits: that memory is lent out", bytes())
        } else if line.contains("grant after wait") {
            summary.granted_after_wait += 1;
            format!("{who} granted {} after {} ms", bytes(), field(line, "waited_ms").unwrap_or("?"))
        } else if line.contains("burst denied") {
            format!("{who} burst denied ({})", field(line, "reason").unwrap_or("?"))
        } else if line.contains("terminating a holder") {
            summary.terminated += 1;
            let why = line.split("why=").nth(1).and_then(|w| w.split(" bytes").next()).unwrap_or("?");
            format!("{who} is ended (SIGTERM) to serve a priority burst: {why}, holding {}", bytes())
        } else if line.contains("asking a holder of burst memory to swap out") {
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
            return None;
        })
    }
}

/// Everything the acts share.
struct Stage<'a> {
    config: &'a DemoConfig,
    server_bin: PathBuf,
    shim: Option<PathBuf>,
    socket: PathBuf,
    sim: SimGpuDir,
}

impl Stage<'_> {
    fn spawn(&self, server: &Server, act: usize, timeline: &mut Timeline) -> Result<Child, DemoError> {
        let mut cmd = Command::new(&self.server_bin);
        cmd.arg("--name").arg(&server.name).args(&server.args).stdout(Stdio::piped()).stderr(Stdio::piped());
        self.sim.apply(&mut cmd);
        if let Some(shim) = &self.shim {
            cmd.env("LD_PRELOAD", shim)
                .env("GPUFRAC_MEMORY_REQUEST", server.request)
                .env("GPUFRAC_MEMORY_LIMIT", server.limit)
                .env("GPUFRAC_RESOLVER", server.resolver)
                .env("GPUFRAC_PRIORITY", server.priority.to_string())
                .env("GPUFRAC_ARBITER_SOCKET", &self.socket)
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

    /// Runs one act to its end: every server finished (or was ended, as expected).
    fn run_act(
        &self,
        number: usize,
        act: &Act,
        timeline: &mut Timeline,
        summary: &mut DemoSummary,
        reaper: &mut Reaper,
    ) -> Result<(), DemoError> {
        println!("\n== Act {number}: {} ==", act.title);
        for line in act.story {
            println!("{line}");
        }
        let mut errors: Vec<(String, String)> = Vec::new();
        let mut next = 0;
        let mut running = std::collections::HashMap::new();
        let mut seen: Vec<(String, String)> = Vec::new();
        let mut started = Vec::new();
        let mut last_progress = Instant::now();
        loop {
            // Start every server whose cue has come.
            while let Some(server) = act.servers.get(next) {
                if let Some((who, event, delay)) = &server.after {
                    if !seen.iter().any(|(n, e)| n == who && e.starts_with(event)) {
                        break;
                    }
                    std::thread::sleep(*delay);
                }
                let child = self.spawn(server, number, timeline)?;
                running.insert(server.name.clone(), (reaper.0.len(), server.ended));
                started.push((server.name.clone(), reaper.0.len(), server.ended));
                reaper.0.push(child);
                next += 1;
            }
            if running.is_empty() && next == act.servers.len() {
                break;
            }
            if running.is_empty() && timeline.rx.try_recv().is_err() {
                let (who, event) =
                    act.servers[next].after.as_ref().map_or(("?", "?"), |(w, e, _)| (w.as_str(), *e));
                return Err(DemoError::Server {
                    name: act.servers[next].name.clone(),
                    detail: format!("not started: {who} exited before printing {event:?}"),
                });
            }
            // A server ended by the priority resolver prints nothing more: reap it.
            running.retain(|n, &mut (i, ended)| match reaper.0[i].try_wait().ok().flatten() {
                None => true,
                Some(status) => {
                    if ended && !status.success() {
                        let t = timeline.started.elapsed().as_secs_f64();
                        println!("{t:7.3}s  {n:<10} ended ({status})");
                    }
                    false
                }
            });
            let (name, line) = match timeline.rx.recv_timeout(Duration::from_millis(200)) {
                Ok(got) => {
                    last_progress = Instant::now();
                    got
                }
                Err(_) if last_progress.elapsed() < Duration::from_secs(120) => continue,
                Err(_) => {
                    return Err(DemoError::Server {
                        name: act.title.into(),
                        detail: "no progress for 2 minutes".into(),
                    })
                }
            };
            let t = timeline.started.elapsed().as_secs_f64();
            if name == "arbiter" {
                if let Some(event) = timeline.arbiter_event(&line, summary) {
                    println!("{t:7.3}s  {:<10} {event}", "arbiter");
                }
                continue;
            }
            let event = line.strip_prefix(&name).map(str::trim).unwrap_or(&line).to_owned();
            seen.push((name.clone(), event.clone()));
            if event.starts_with("batch=") {
                summary.batches_served += 1;
            } else if event.starts_with("out-of-memory") {
                summary.out_of_memory += 1;
            } else if event.starts_with("kept-memory-intact") {
                summary.kept_intact += 1;
            } else if event.contains("error") {
                errors.push((name.clone(), event.clone()));
            }
            println!("{t:7.3}s  {name:<10} {event}");
        }
        for (name, index, ended) in started {
            let status = reaper.0[index].wait().map_err(io_err(format!("waiting for {name}")))?;
            if !status.success() && !ended {
                let detail = errors
                    .iter()
                    .rev()
                    .find(|(n, _)| *n == name)
                    .map_or_else(|| status.to_string(), |(_, e)| e.clone());
                return Err(DemoError::Server { name, detail });
            }
        }
        Ok(())
    }
}

/// The three acts on a GPU of `total` bytes.
fn acts(config: &DemoConfig) -> Vec<Act> {
    let steps = config.steps.to_string();
    let mut first = Act {
        title: "wait: colliding bursts wait for each other",
        story: &[
            "Each server loads a 768 MiB model, then serves batches whose activations swing between 256 MiB",
            "and 1 GiB. Each is guaranteed 1088 MiB (request) and may burst to 2176 MiB (limit); the arbiter",
            "lends what no request reserves, and a burst that collides waits until memory is given back.",
        ],
        servers: Vec::new(),
    };
    if !config.arbiter {
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
        title: "priority: a production burst ends an idle lower-priority holder",
        story: &[
            "A notebook (priority 0) holds 1280 MiB of burst memory and goes idle. A production server",
            "(priority 10, resolver priority) needs 1280 MiB for its batches: the arbiter ends the notebook.",
        ],
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
        title: "swap: two servers take turns with the same memory",
        story: &[
            "chat-a keeps a 1280 MiB KV cache and sleeps. chat-b needs 1280 MiB for its batches: the arbiter",
            "has chat-a's cache moved to host RAM (same addresses, nothing lost) and chat-b runs. When chat-a",
            "wakes up it asks for its cache back and the two take turns, 2 s each (--swap-quantum); chat-a",
            "verifies every byte of its cache at the end.",
        ],
        servers: vec![sleeper, busy],
    };
    vec![first, second, third]
}

/// Runs the demo, printing the timeline to stdout, and returns the summary.
pub fn run(config: &DemoConfig) -> Result<DemoSummary, DemoError> {
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
    let sim = SimGpuDir::new(&std::env::temp_dir(), &config.bin_dir, &config.device_memory)
        .map_err(io_err("preparing the simulated GPU"))?
        .with_context_overhead("256MiB");
    let socket = sim.lib_dir().join("arbiter.sock");
    let stage = Stage { config, server_bin, shim, socket, sim };

    println!(
        "gpufrac demo: inference servers on one simulated GPU of {} (simgpu, no GPU needed)",
        config.device_memory
    );
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let mut timeline =
        Timeline { started: Instant::now(), tx, rx, names_by_pid: std::collections::HashMap::new() };
    let mut reaper = Reaper::default();
    if let Some(bin) = &arbiter_bin {
        let mut cmd = Command::new(bin);
        cmd.arg("--socket")
            .arg(&stage.socket)
            .args(["--swap-quantum", "2s", "--kill-grace", "3s"])
            .env("GPUFRAC_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        stage.sim.apply(&mut cmd);
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", bin.display())))?;
        if let Some(err) = child.stderr.take() {
            timeline.forward("arbiter", Box::new(err));
        }
        reaper.0.push(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&stage.socket).is_err() {
            if Instant::now() > deadline {
                return Err(DemoError::Server {
                    name: "arbiter".into(),
                    detail: "did not start serving".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    let mut summary = DemoSummary { servers: config.servers, ..Default::default() };
    let acts = acts(stage.config);
    let mut outcomes = Vec::new();
    for (i, act) in acts.iter().enumerate() {
        let before = summary.clone();
        stage.run_act(i + 1, act, &mut timeline, &mut summary, &mut reaper)?;
        let outcome = match i {
            0 if config.arbiter => format!(
                "wait: {} batches served, {} bursts waited and were granted, {} out-of-memory errors",
                summary.batches_served - before.batches_served,
                summary.granted_after_wait - before.granted_after_wait,
                summary.out_of_memory - before.out_of_memory
            ),
            0 => format!(
                "without gpufrac: {} batches served, {} out-of-memory errors",
                summary.batches_served - before.batches_served,
                summary.out_of_memory - before.out_of_memory
            ),
            1 => format!(
                "priority: {} idle lower-priority holder ended, production served {} batches, {} out-of-memory errors",
                summary.terminated - before.terminated,
                summary.batches_served - before.batches_served,
                summary.out_of_memory - before.out_of_memory
            ),
            _ => format!(
                "swap: {} swapped out and back in, chat-b served {} batches, {} of 1 kept caches verified intact, {} out-of-memory errors",
                summary.swapped_in - before.swapped_in,
                summary.batches_served - before.batches_served,
                summary.kept_intact - before.kept_intact,
                summary.out_of_memory - before.out_of_memory
            ),
        };
        println!("Outcome: {outcome}");
        outcomes.push(outcome);
    }
    drop(reaper);
    println!("\nSummary");
    println!("  servers on one GPU:     {}", summary.servers);
    println!("  batches served:         {}", summary.batches_served);
    if config.arbiter {
        println!("  bursts that waited:     {}", summary.waits);
        println!("  granted after waiting:  {}", summary.granted_after_wait);
        println!("  holders ended:          {}", summary.terminated);
        println!("  swapped out / in:       {} / {}", summary.swapped_out, summary.swapped_in);
        println!("  kept memory intact:     {}", summary.kept_intact);
    }
    println!("  out-of-memory errors:   {}", summary.out_of_memory);
    for outcome in outcomes {
        println!("  {outcome}");
    }
    Ok(summary)
}

/// The folder of the running executable, where the build puts everything the demo needs.
pub fn default_bin_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}
