//! `gpufrac`: the command line for users and node admins.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use gpufrac_daemon::{demo, run};

// A shim preloaded into this daemon passes every call through (see
// `gpufrac_common::DAEMON_MARKER`; build.rs exports the symbol).
gpufrac_common::daemon_marker!();

#[derive(Parser)]
#[command(name = "gpufrac", version, about = "Dynamic GPU memory fractions: requests, limits and bursts")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

// Parsed once per invocation: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Commands {
    /// Run a command under the shim, held to a GPU memory request and limit.
    Run {
        #[command(flatten)]
        settings: run::RunSettings,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Show, per GPU, its memory, the guaranteed and burst totals, and every process.
    Status {
        /// The arbiter's socket.
        #[arg(long, default_value = "/run/gpufrac/arbiter.sock")]
        socket: std::path::PathBuf,
        /// Print the JSON document instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// A live view of the arbiter, refreshed every second: per GPU a memory bar, the
    /// processes, the bursts waiting and the last events (what `status` shows you).
    /// Keys: s sort, 1-9 one GPU, 0 or a all, q quit. Prints one frame when stdout is not
    /// a terminal.
    Top {
        /// The arbiter's socket.
        #[arg(long, default_value = "/run/gpufrac/arbiter.sock")]
        socket: std::path::PathBuf,
        /// Print one plain-text frame and exit, even on a terminal.
        #[arg(long)]
        once: bool,
    },
    /// Run sample inference servers sharing simulated GPUs (no GPU needed), in three acts:
    /// wait, priority, swap; each ends with PASS or FAIL, and so does the run.
    Demo {
        /// Memory of the simulated GPU of act 1 (wait); sized from --servers when left
        /// out (4.5GiB for 3). Acts 2 and 3 run on a 4.5GiB GPU of their own.
        #[arg(long)]
        device_memory: Option<String>,
        /// Number of servers in act 1 (wait), 2 to 16.
        #[arg(long, default_value_t = 3)]
        servers: usize,
        /// Batches each server serves.
        #[arg(long, default_value_t = 6)]
        steps: usize,
        /// Run the servers bare, without the shim and the arbiter, to compare.
        #[arg(long)]
        without_gpufrac: bool,
    },
}

fn main() {
    if let Err(e) = run() {
        eprintln!("gpufrac: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Commands::Run { settings, command } => {
            let own_dir = demo::default_bin_dir();
            Err(run::exec(&settings, &command, own_dir.as_deref()).into())
        }
        Commands::Status { socket, json } => {
            let document = gpufrac_daemon::status::fetch_document(&socket)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&document)?);
            } else {
                print!("{}", document.table());
            }
            Ok(())
        }
        Commands::Top { socket, once } => Ok(gpufrac_daemon::top::run(&socket, once)?),
        Commands::Demo { device_memory, servers, steps, without_gpufrac } => {
            // Impossible combinations are refused before anything starts.
            demo::first_act_device(servers, device_memory.as_deref())?;
            let bin_dir = demo::default_bin_dir().context("cannot find the gpufrac executable's folder")?;
            demo::run(&demo::DemoConfig {
                bin_dir,
                device_memory,
                servers,
                steps,
                arbiter: !without_gpufrac,
            })?;
            Ok(())
        }
    }
}
