//! `gpufrac`: the command line for users and node admins.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use gpufrac_daemon::demo;

#[derive(Parser)]
#[command(name = "gpufrac", version, about = "Dynamic GPU memory fractions: requests, limits and bursts")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Run sample inference servers sharing one simulated GPU (no GPU needed).
    Demo {
        /// Memory of the simulated GPU.
        #[arg(long, default_value = "4GiB")]
        device_memory: String,
        /// Number of servers.
        #[arg(long, default_value_t = 3)]
        servers: usize,
        /// Batches each server serves.
        #[arg(long, default_value_t = 6)]
        steps: usize,
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
        Commands::Demo { device_memory, servers, steps } => {
            gpufrac_common::parse_bytes("--device-memory", &device_memory)?;
            anyhow::ensure!((1..=16).contains(&servers), "--servers must be between 1 and 16, not {servers}");
            let bin_dir = demo::default_bin_dir().context("cannot find the gpufrac executable's folder")?;
            demo::run(&demo::DemoConfig { bin_dir, device_memory, servers, steps })?;
            Ok(())
        }
    }
}
