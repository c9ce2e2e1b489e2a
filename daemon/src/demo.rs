//! `gpufrac demo`: several sample inference servers sharing one simulated GPU, with a
//! timeline of what each does and a summary. Needs no GPU: it runs on simgpu, built with
//! the workspace next to the `gpufrac` binary.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    /// Folder with `libsimgpu_*.so` and `sample-inference-server`.
    pub bin_dir: PathBuf,
    /// Memory of the simulated GPU.
    pub device_memory: String,
    /// Number of servers.
    pub servers: usize,
    /// Batches each server serves.
    pub steps: usize,
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

/// Runs the demo, printing the timeline to stdout, and returns the summary.
pub fn run(config: &DemoConfig) -> Result<DemoSummary, DemoError> {
    let server_bin = need(config.bin_dir.join("sample-inference-server"))?;
    need(config.bin_dir.join("libsimgpu_cuda.so"))?;
    need(config.bin_dir.join("libsimgpu_nvml.so"))?;
    let sim = SimGpuDir::new(&std::env::temp_dir(), &config.bin_dir, &config.device_memory)
        .map_err(io_err("preparing the simulated GPU"))?
        .with_context_overhead("256MiB");

    println!(
        "gpufrac demo: {} inference servers on one simulated GPU of {} (simgpu, no GPU needed)",
        config.servers, config.device_memory
    );
    println!("Each loads a model, then serves batches whose activation memory swings with the batch size.");
    println!("Memory above the model is taken only while free; a collision is an out-of-memory error.\n");

    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<(String, String)>();
    let mut children = Vec::new();
    for i in 0..config.servers {
        let name = format!("server-{}", i + 1);
        let mut cmd = Command::new(&server_bin);
        cmd.args(["--name", &name, "--model", "768MiB", "--steps", &config.steps.to_string()])
            .args(["--batches", ["256MiB,1GiB,512MiB", "512MiB,256MiB,1GiB", "1GiB,512MiB,256MiB"][i % 3]])
            .args(["--compute", "30ms"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sim.apply(&mut cmd);
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", server_bin.display())))?;
        for pipe in [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            let name = name.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send((name.clone(), line));
                }
            });
        }
        children.push((name, child));
    }
    drop(tx);

    let mut summary = DemoSummary { servers: config.servers, ..Default::default() };
    let mut errors = Vec::new();
    for (name, line) in rx {
        let t = started.elapsed().as_secs_f64();
        let event = line.strip_prefix(&name).map(str::trim).unwrap_or(&line).to_owned();
        if event.starts_with("batch=") {
            summary.batches_served += 1;
        } else if event.starts_with("out-of-memory") {
            summary.out_of_memory += 1;
        } else if event.contains("error") {
            errors.push((name.clone(), event.clone()));
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
    println!("\nSummary");
    println!("  servers on one GPU:   {}", summary.servers);
    println!("  batches served:       {}", summary.batches_served);
    println!("  out-of-memory errors: {}", summary.out_of_memory);
    Ok(summary)
}

/// The folder of the running executable, where the build puts everything the demo needs.
pub fn default_bin_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}
