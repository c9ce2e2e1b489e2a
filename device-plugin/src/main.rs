//! `gpufrac-device-plugin`: advertises each GPU as shares of `gpufrac.io/gpu` to the
//! kubelet, or (`dra`) serves the DRA kubelet plugin that publishes each GPU's memory as a
//! capacity claims share, or (`webhook`) serves the admission webhook for the
//! gpu-fraction annotations.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use gpufrac_device_plugin::dra;
use gpufrac_device_plugin::plugin::allocation::AllocationConfig;
use gpufrac_device_plugin::plugin::devices::Gpu;
use gpufrac_device_plugin::plugin::devices::{share_id, MAX_ID_LEN};
use gpufrac_device_plugin::plugin::health::{self, HealthWatcher};
use gpufrac_device_plugin::plugin::runner;
use gpufrac_device_plugin::webhook;

// A shim preloaded into this daemon passes every call through (see
// `gpufrac_common::DAEMON_MARKER`; build.rs exports the symbol).
gpufrac_common::daemon_marker!();

#[derive(Parser)]
#[command(
    name = "gpufrac-device-plugin",
    version,
    about = "gpufrac's Kubernetes device plugin and admission webhook"
)]
struct Cli {
    /// The kubelet's device plugin folder.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    device_plugin_dir: PathBuf,
    /// Shares each GPU is advertised as.
    #[arg(long, default_value_t = 100)]
    shares_per_gpu: u32,
    /// Host folder holding libgpufrac.so and libgpufrac_core.so (mounted read-only into containers).
    #[arg(long, global = true, default_value = "/opt/gpufrac/lib")]
    shim_dir: PathBuf,
    /// The arbiter's socket, absolute (its folder is mounted into containers).
    #[arg(long, global = true, default_value = "/run/gpufrac/arbiter.sock")]
    arbiter_socket: PathBuf,
    /// Our socket's file name in the device plugin folder.
    #[arg(long, default_value = "gpufrac.sock")]
    socket_name: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the DRA kubelet plugin (Kubernetes 1.34+): publish each GPU as a device whose
    /// memory claims share, and prepare claims (a CDI spec per claim). A node runs this or
    /// the device plugin, not both.
    Dra {
        /// This node's name (the ResourceSlice's node and pool), e.g. from the downward
        /// API's spec.nodeName.
        #[arg(long, value_name = "NODE")]
        node_name: String,
        /// The kubelet's plugin registry, where the registration socket goes.
        #[arg(long, value_name = "DIR", default_value = "/var/lib/kubelet/plugins_registry")]
        plugins_registry: PathBuf,
        /// The plugin's own folder: its DRA socket and its checkpoint of prepared claims.
        #[arg(long, value_name = "DIR", default_value = gpufrac_common::dra::DEFAULT_PLUGIN_DIR)]
        plugin_dir: PathBuf,
        /// Where the claims' CDI specs are written (the container runtime's CDI folder).
        #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
        cdi_dir: PathBuf,
        /// Publish each GPU as N equal shares (devices gpu-<index>-<share>) instead of one
        /// device whose memory claims share: for clusters without DRAConsumableCapacity;
        /// a claim asks for a count of shares with a matchAttribute constraint on
        /// gpu.gpufrac.io/uuid. 0: one device per GPU (consumable capacity).
        #[arg(long, value_name = "N", default_value_t = 0)]
        shares: u32,
        /// Also give containers NVIDIA's own CDI device (nvidia.com/gpu=<UUID>, from
        /// `nvidia-ctk cdi generate`) besides NVIDIA_VISIBLE_DEVICES.
        #[arg(long)]
        nvidia_cdi: bool,
        /// How often prepared claims are checked against the API server: one found stale
        /// (its ResourceClaim deleted, replaced, or no longer allocated to this node) at two
        /// checks in a row is unprepared (its CDI spec removed, its entry dropped).
        #[arg(long, value_name = "DURATION", default_value = "10m",
              value_parser = |v: &str| gpufrac_common::size::parse_duration("--stale-claims-every", v))]
        stale_claims_every: std::time::Duration,
        /// Where the host's /sys is found below: each GPU's PCIe root and NUMA node are read
        /// from <DIR>/sys (tests give a fake tree).
        #[arg(long, value_name = "DIR", default_value = "/", hide = true)]
        sysfs_root: PathBuf,
    },
    /// Serve the admission webhook (HTTPS: POST /mutate for pods, POST /validate for DRA claims).
    Webhook {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:8443")]
        listen: SocketAddr,
        /// PEM certificate chain.
        #[arg(long)]
        tls_cert: PathBuf,
        /// PEM private key.
        #[arg(long)]
        tls_key: PathBuf,
    },
}

fn main() {
    if let Err(e) = gpufrac_common::daemon::init_logging() {
        eprintln!("gpufrac-device-plugin: error: {e}");
        std::process::exit(2);
    }
    if let Err(e) = run(Cli::parse()) {
        eprintln!("gpufrac-device-plugin: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Some(Command::Dra {
            node_name,
            plugins_registry,
            plugin_dir,
            cdi_dir,
            shares,
            nvidia_cdi,
            stale_claims_every,
            sysfs_root,
        }) => {
            check_node_name(&node_name)?;
            if stale_claims_every.is_zero() {
                bail!("--stale-claims-every 0 would check claims without pause; give a duration such as 10m");
            }
            for (flag, path) in [
                ("--plugins-registry", &plugins_registry),
                ("--plugin-dir", &plugin_dir),
                ("--cdi-dir", &cdi_dir),
                ("--shim-dir", &cli.shim_dir),
                ("--arbiter-socket", &cli.arbiter_socket),
            ] {
                if !path.is_absolute() {
                    bail!(
                        "{flag} {} must be an absolute path (containers see it at the same place)",
                        path.display()
                    );
                }
            }
            if !plugins_registry.is_dir() {
                bail!(
                    "--plugins-registry {} is not a folder (is this the kubelet's plugins_registry?)",
                    plugins_registry.display()
                );
            }
            if !sysfs_root.is_dir() {
                bail!("--sysfs-root {} is not a folder (it holds the host's sys/)", sysfs_root.display());
            }
            let gpus =
                dra::gpus::discover(&sysfs_root).map_err(|e| anyhow::anyhow!("finding the GPUs: {e}"))?;
            if gpus.is_empty() {
                bail!("NVML reports no GPU on this node");
            }
            let sharing = match shares {
                0 => dra::slices::Sharing::Capacity,
                1 => bail!("--shares 1 is one device per GPU given whole; use --shares 0 (consumable capacity) or 2 and more"),
                n => dra::slices::Sharing::Shares(n),
            };
            if sharing.devices(gpus.len()) > dra::slices::MAX_DEVICES {
                bail!(
                    "--shares {shares}: {} GPUs x {shares} shares is more devices than a ResourceSlice holds ({}); use at most {}",
                    gpus.len(),
                    dra::slices::MAX_DEVICES,
                    dra::slices::MAX_DEVICES / gpus.len()
                );
            }
            let (watcher, health) = HealthWatcher::start(
                gpus.iter().map(|g| Gpu { uuid: g.uuid.clone(), healthy: true }).collect(),
            )?;
            let config = dra::runner::DraConfig {
                node_name,
                registry_dir: plugins_registry,
                plugin_dir,
                sharing,
                cdi: dra::cdi::CdiConfig {
                    dir: cdi_dir,
                    shim_dir: cli.shim_dir,
                    arbiter_socket: cli.arbiter_socket,
                    nvidia_cdi,
                },
                stale_claims_every,
            };
            let result = runtime.block_on(async {
                let client = kube::Client::try_default().await.context(
                    "connecting to the Kubernetes API server (from KUBECONFIG, else the in-cluster service account)",
                )?;
                dra::runner::run(config, client, gpus, health, gpufrac_common::daemon::terminated()).await?;
                anyhow::Ok(())
            });
            watcher.stop();
            result
        }
        Some(Command::Webhook { listen, tls_cert, tls_key }) => runtime.block_on(async {
            let tls = webhook::load_tls(&tls_cert, &tls_key)?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding --listen {listen}"))?;
            tracing::info!(%listen, "serving the admission webhook");
            webhook::serve(listener, tls, gpufrac_common::daemon::terminated())
                .await
                .context("serving the webhook")?;
            Ok(())
        }),
        None => {
            if !(1..=1000).contains(&cli.shares_per_gpu) {
                bail!("--shares-per-gpu must be between 1 and 1000, not {}", cli.shares_per_gpu);
            }
            if !cli.device_plugin_dir.is_dir() {
                bail!("--device-plugin-dir {} is not a folder", cli.device_plugin_dir.display());
            }
            if cli.socket_name.is_empty() || cli.socket_name.contains('/') {
                bail!("--socket-name {:?} must be a plain file name", cli.socket_name);
            }
            let gpus = health::discover().map_err(|e| anyhow::anyhow!("finding the GPUs: {e}"))?;
            if gpus.is_empty() {
                bail!("NVML reports no GPU on this node");
            }
            for g in &gpus {
                let longest = share_id(&g.uuid, cli.shares_per_gpu - 1);
                if longest.len() > MAX_ID_LEN {
                    bail!("device ID {longest:?} is longer than Kubernetes allows ({MAX_ID_LEN})");
                }
                tracing::info!(gpu = %g.uuid, shares = cli.shares_per_gpu, "advertising GPU");
            }
            let (watcher, health) = HealthWatcher::start(gpus)?;
            let config = runner::RunnerConfig {
                dir: cli.device_plugin_dir,
                socket_name: cli.socket_name,
                allocation: AllocationConfig {
                    shares_per_gpu: cli.shares_per_gpu,
                    shim_dir: cli.shim_dir,
                    arbiter_socket: cli.arbiter_socket,
                },
            };
            let result = runtime.block_on(runner::run(config, health, gpufrac_common::daemon::terminated()));
            watcher.stop();
            result?;
            Ok(())
        }
    }
}

/// Refuses a node name that is not a DNS subdomain (how Kubernetes names nodes).
fn check_node_name(name: &str) -> Result<()> {
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        bail!("--node-name {name:?} is not a Kubernetes node name (lowercase letters, digits, '-' and '.', at most 253)");
    }
    Ok(())
}
