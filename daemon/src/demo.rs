//! `gpufrac demo`: several sample inference servers sharing one simulated GPU, with a
//! timeline of what each does and a summary. Needs no GPU: it runs on simgpu, built with
//! the workspace next to the `gpufrac` binary.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

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
    /// Number of servers.
    pub servers: usize,
    /// Batches each server serves.
    pub steps: usize,
    /// Run the servers under the shim and the arbiter (otherwise: bare, to compare).
    pub arbiter: bool,
}

/// The outcome, for the summary and for tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DemoSummary {
    /// Servers that ran on the one GPU.
    pub servers: usize,
    /// Batches served in all.
    pub batches_served: usize,
    /// Out-of-memory errors the servers hit.
    pub out_of_memory: usize,
    /// Bursts that had to wait for memory.
    pub waits: usize,
    /// Bursts granted after waiting.
    pub granted_after_wait: usize,
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

/// Kills the arbiter when the demo ends, however it ends.
struct Reaper(Option<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
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

    println!(
        "gpufrac demo: {} inference servers on one simulated GPU of {} (simgpu, no GPU needed)",
        config.servers, config.device_memory
    );
    println!(
        "Each loads a 768 MiB model, then serves batches whose activations swing between 256 MiB and 1 GiB."
    );
    if config.arbiter {
        println!("Each is guaranteed 1088 MiB (request) and may burst to 2176 MiB (limit); the arbiter lends what no");
        println!("request reserves, and a burst that collides waits until memory is given back.\n");
    } else {
        println!("Without gpufrac: memory is first come, first served; a colliding burst is an out-of-memory error.\n");
    }

    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let forward = |name: String, pipe: Box<dyn std::io::Read + Send>, tx: mpsc::Sender<(String, String)>| {
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send((name.clone(), line));
            }
        });
    };

    let mut reaper = Reaper(None);
    if let Some(bin) = &arbiter_bin {
        let mut cmd = Command::new(bin);
        cmd.arg("--socket")
            .arg(&socket)
            .env("GPUFRAC_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        sim.apply(&mut cmd);
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", bin.display())))?;
        if let Some(err) = child.stderr.take() {
            forward("arbiter".into(), Box::new(err), tx.clone());
        }
        reaper.0 = Some(child);
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if Instant::now() > deadline {
                return Err(DemoError::Server {
                    name: "arbiter".into(),
                    detail: "did not start serving".into(),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    let mut children = Vec::new();
    let mut names_by_pid = std::collections::HashMap::new();
    for i in 0..config.servers {
        let name = format!("server-{}", i + 1);
        let mut cmd = Command::new(&server_bin);
        cmd.args(["--name", &name, "--model", "768MiB", "--steps", &config.steps.to_string()])
            .args(["--batches", ["256MiB,1GiB,512MiB", "512MiB,256MiB,1GiB", "1GiB,512MiB,256MiB"][i % 3]])
            .args(["--compute", "30ms"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sim.apply(&mut cmd);
        if let Some(shim) = &shim {
            cmd.env("LD_PRELOAD", shim)
                .env("GPUFRAC_MEMORY_REQUEST", "1088MiB")
                .env("GPUFRAC_MEMORY_LIMIT", "2176MiB")
                .env("GPUFRAC_ARBITER_SOCKET", &socket)
                .env("GPUFRAC_GROUP", format!("demo-{}-{name}", std::process::id()))
                .env("GPUFRAC_WAIT_TIMEOUT", "60s");
        }
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", server_bin.display())))?;
        names_by_pid.insert(child.id().to_string(), name.clone());
        for pipe in [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            forward(name.clone(), pipe, tx.clone());
        }
        children.push((name, child));
    }
    drop(tx);

    let mut summary = DemoSummary { servers: config.servers, ..Default::default() };
    let mut errors = Vec::new();
    let mut running = config.servers;
    while running > 0 {
        let Ok((name, line)) = rx.recv() else { break };
        let t = started.elapsed().as_secs_f64();
        if name == "arbiter" {
            let who = field(&line, "pid").and_then(|p| names_by_pid.get(p)).cloned().unwrap_or_default();
            let event = if line.contains("burst waits") {
                summary.waits += 1;
                format!(
                    "{who} bursts {} and waits: that memory is lent out",
                    mib(field(&line, "bytes").unwrap_or("?"))
                )
            } else if line.contains("grant after wait") {
                summary.granted_after_wait += 1;
                format!(
                    "{who} granted {} after {} ms",
                    mib(field(&line, "bytes").unwrap_or("?")),
                    field(&line, "waited_ms").unwrap_or("?")
                )
            } else if line.contains("burst denied") {
                format!("{who} burst denied ({})", field(&line, "reason").unwrap_or("?"))
            } else if line.contains("registration refused") || line.contains("ERROR") {
                line.clone()
            } else {
                continue;
            };
            println!("{t:7.3}s  {:<9} {event}", "arbiter");
            continue;
        }
        let event = line.strip_prefix(&name).map(str::trim).unwrap_or(&line).to_owned();
        if event.starts_with("batch=") {
            summary.batches_served += 1;
        } else if event.starts_with("out-of-memory") {
            summary.out_of_memory += 1;
        } else if event.starts_with("done") {
            running -= 1;
        } else if event.contains("error") {
            errors.push((name.clone(), event.clone()));
            running -= 1;
        }
        println!("{t:7.3}s  {name:<9} {event}");
    }
    for (name, mut child) in children {
        let status = child.wait().map_err(io_err(format!("waiting for {name}")))?;
        if !status.success() {
            let detail = errors
                .iter()
                .rev()
                .find(|(n, _)| *n == name)
                .map_or_else(|| status.to_string(), |(_, e)| e.clone());
            return Err(DemoError::Server { name, detail });
        }
    }
    drop(reaper);
    println!("\nSummary");
    println!("  servers on one GPU:     {}", summary.servers);
    println!("  batches served:         {}", summary.batches_served);
    if config.arbiter {
        println!("  bursts that waited:     {}", summary.waits);
        println!("  granted after waiting:  {}", summary.granted_after_wait);
    }
    println!("  out-of-memory errors:   {}", summary.out_of_memory);
    Ok(summary)
}

/// The folder of the running executable, where the build puts everything the demo needs.
pub fn default_bin_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}
