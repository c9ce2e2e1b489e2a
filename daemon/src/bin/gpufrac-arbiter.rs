//! `gpufrac-arbiter`: the per-node daemon that guarantees requests, lends burst memory
//! and resolves collisions. Runs in the foreground; logs to stderr (`GPUFRAC_LOG`, default
//! `info`).

use std::path::{Path, PathBuf};

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpufrac_daemon::arbiter::{gpus, metrics, server};
use gpufrac_daemon::entitlement::kubernetes::{infer_config, KubernetesEntitlements, KubernetesOptions};
use gpufrac_daemon::entitlement::policy::PolicyFile;
use gpufrac_daemon::entitlement::Entitlements;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::unistd::{sysconf, Group, SysconfVar};

// A shim preloaded into this daemon passes every call through (see
// `gpufrac_common::DAEMON_MARKER`; build.rs exports the symbol).
gpufrac_common::daemon_marker!();

/// Where shims and the CLI find the arbiter unless told otherwise.
const DEFAULT_SOCKET: &str = "/run/gpufrac/arbiter.sock";

#[derive(Parser)]
#[command(name = "gpufrac-arbiter", version, about = "gpufrac's per-node arbiter")]
struct Args {
    /// The unix socket shims and `gpufrac status` connect to.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9400).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Priority resolver: a holder idle this long (no launches, copies or sets) may be
    /// ended for a burst of equal priority.
    #[arg(long, default_value = "5m")]
    idle_timeout: String,
    /// Priority resolver: time between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s")]
    kill_grace: String,
    /// When a guarantee is owed memory that is lent out: how long borrowers have to give
    /// it back as they free (unused grants come back at once, swap-resolver holders are
    /// swapped out) before holders are ended for what is still owed.
    #[arg(long, default_value = "5s")]
    reclaim_grace: String,
    /// Swap resolver: how long a holder keeps its burst memory on the GPU before a swap
    /// burst may move it to host RAM (turns are taken in quanta of this length).
    #[arg(long, default_value = "10s")]
    swap_quantum: String,
    /// Swap resolver: most host RAM for swapped-out memory on this node, as a size
    /// (64GiB) or a share of the node's RAM (50%); 0 turns swapping off. Past it, swap
    /// bursts wait.
    #[arg(long, default_value = "50%")]
    swap_limit: String,
    /// Parking: how far the requests of parkable groups (GPUFRAC_PARK_AFTER) on a GPU
    /// may add up past what the other groups' requests leave, as a ratio (1 to 1000; 1:
    /// not past it). Idle parkable groups are parked in host RAM (within --swap-limit)
    /// when the room is wanted, and woken at their next CUDA call.
    #[arg(long, value_name = "RATIO", default_value = "1")]
    oversubscribe: String,
    /// Parking: how a parked process's memory moves to host RAM: `checkpoint` (the
    /// driver's checkpoint API, CUDA 12.8+, by PID), `shim` (the shim's own swap), or
    /// `auto` (checkpoint where the driver has it).
    #[arg(long, value_name = "HOW", default_value = "auto")]
    park_with: String,
    /// What is done about a group the device's own count (NVML, per process) shows
    /// holding more than its shims counted: `count` charges the excess to the group
    /// (against its limit and the GPU's room); `end` also ends the group's processes once
    /// it has been past its limit for --enforce-grace.
    #[arg(long, value_name = "HOW", default_value = "count")]
    enforce_limits: String,
    /// With --enforce-limits end: how long a group may stay past its limit by the
    /// device's count before its processes are ended.
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    enforce_grace: String,
    /// Manage only this much of each GPU: a size (16GiB) or a fraction of each GPU (0.5,
    /// 50%); the rest is headroom for processes outside gpufrac. Shims' fractions and
    /// virtual devices are of the managed size. Default: all of each GPU.
    #[arg(long, value_name = "SIZE|FRACTION")]
    gpu_memory: Option<String>,
    /// Most connections open at once from one UID (1 to 1048576). Past it, the oldest
    /// connection of that UID that has not said who it is is closed to make room, or
    /// the new one is refused.
    #[arg(long, default_value_t = 512)]
    max_connections_per_uid: usize,
    /// Create the socket's folder when it is missing (by default a missing folder is
    /// refused, being more often a typo than a wish; the default socket's folder,
    /// /run/gpufrac, is always created).
    #[arg(long)]
    create_socket_dir: bool,
    /// Entitlements from an admin policy file (JSON: per UID and GID, the most request,
    /// limit and priority, and the resolvers allowed; see docs/security.md).
    /// Not with --kubernetes: on a Kubernetes node the kubelet and the pods decide.
    /// With neither, clients are believed only about themselves.
    #[arg(long, value_name = "FILE", conflicts_with = "kubernetes")]
    policy: Option<PathBuf>,
    /// Entitlements from the kubelet's PodResources API (which shares each container was
    /// allocated) and this node's pods, listed and watched from the API server (limit,
    /// resolver, priority); the API server from a kubeconfig (KUBECONFIG, ~/.kube/config)
    /// or the in-cluster service account; the node's name from --node-name or NODE_NAME.
    #[arg(long)]
    kubernetes: bool,
    /// The kubelet's PodResources socket (with --kubernetes).
    #[arg(long, value_name = "PATH", requires = "kubernetes")]
    pod_resources_socket: Option<PathBuf>,
    /// Entitlements from the DRA claims prepared on this node (the DRA kubelet plugin's
    /// checkpoint) instead of the device plugin's shares (with --kubernetes; e.g.
    /// /var/lib/kubelet/plugins/gpu.gpufrac.io/prepared-claims.json). A node runs one or
    /// the other.
    #[arg(
        long,
        value_name = "PATH",
        requires = "kubernetes",
        conflicts_with_all = ["pod_resources_socket", "shares_per_gpu"]
    )]
    dra_checkpoint: Option<PathBuf>,
    /// This node's name (with --kubernetes; default: the NODE_NAME environment variable;
    /// one of them is required): only this node's pods are watched.
    #[arg(long, value_name = "NAME", requires = "kubernetes")]
    node_name: Option<String>,
    /// Shares per GPU, as the device plugin's --shares-per-gpu (with --kubernetes;
    /// default 100).
    #[arg(long, value_name = "N", requires = "kubernetes")]
    shares_per_gpu: Option<u32>,
    /// Members of this group (a name or a numeric GID), besides root, see every tenant's
    /// processes in `gpufrac status`; everyone else sees only their own user's.
    #[arg(long, value_name = "GROUP")]
    admin_group: Option<String>,
}

/// Why a node name is refused, if it is: a DNS subdomain, as Kubernetes names nodes.
fn check_node_name(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?}: expected a node name (1 to 253 of a-z 0-9 - ., starting and ending with a letter or digit)"))
    }
}

/// The GID `--admin-group` names: a number, or a group name looked up in the system's
/// group database.
fn admin_gid(group: &str) -> Result<u32> {
    let group = group.trim();
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    // nix would answer "no such group" for a name with a NUL byte: say what is wrong.
    if group.contains('\0') {
        bail!("--admin-group {group:?}: a group name cannot hold a NUL byte");
    }
    // getgrnam_r, its buffer grown while too small (up to 1 MiB).
    match Group::from_name(group) {
        Ok(Some(entry)) => Ok(entry.gid.as_raw()),
        Ok(None) => bail!("--admin-group {group:?}: no such group (give a group name or a numeric GID)"),
        Err(e) => bail!("--admin-group {group:?}: looking the group up: {}", std::io::Error::from(e)),
    }
}

/// The source of entitlements the flags choose, with a line saying which.
fn entitlements(args: &Args) -> Result<Option<Arc<dyn Entitlements>>> {
    if let Some(path) = &args.policy {
        let policy = PolicyFile::load(path).context("--policy")?;
        tracing::info!(policy = %path.display(), entries = policy.entries(), "entitlements from the policy file");
        return Ok(Some(Arc::new(policy)));
    }
    if args.kubernetes {
        let config = infer_config().context("--kubernetes")?;
        let node = match &args.node_name {
            Some(name) => {
                check_node_name(name).map_err(|e| anyhow::anyhow!("--node-name {e}"))?;
                name.clone()
            }
            None => match std::env::var("NODE_NAME").map(|name| name.trim().to_owned()) {
                Ok(name) if !name.is_empty() => {
                    check_node_name(&name).map_err(|e| anyhow::anyhow!("NODE_NAME {e}"))?;
                    name
                }
                _ => bail!(
                    "--kubernetes needs this node's name, to watch only its pods: give --node-name NAME or \
                     set NODE_NAME (from the downward API's spec.nodeName, as \
                     examples/kubernetes/daemonset.yaml does)"
                ),
            },
        };
        let server = config.cluster_url.to_string();
        let mut options = KubernetesOptions::new(config, node.clone(), args.pod_resources_socket.clone());
        if let Some(n) = args.shares_per_gpu {
            options.shares_per_gpu = n;
        }
        options.dra_checkpoint = args.dra_checkpoint.clone();
        let socket = options.pod_resources_socket.clone();
        let source = KubernetesEntitlements::new(options).context("--kubernetes")?;
        match &args.dra_checkpoint {
            Some(checkpoint) => tracing::info!(
                dra_checkpoint = %checkpoint.display(), %node, api_server = %server,
                "entitlements from the DRA claims prepared on this node and the API server"
            ),
            None => tracing::info!(
                pod_resources = %socket.display(), %node, api_server = %server,
                "entitlements from the kubelet and the API server"
            ),
        }
        return Ok(Some(Arc::new(source)));
    }
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        tracing::warn!(
            "running in a Kubernetes pod without --kubernetes: pods' entitlements are not checked"
        );
    }
    tracing::warn!("no entitlement policy loaded: clients are believed about their own request, limit, priority and group (a priority never ends a process of another user); give --policy FILE, or --kubernetes on a Kubernetes node");
    Ok(None)
}

/// Raises the soft limit on open descriptors to the hard limit: each shim holds one.
fn raise_descriptor_limit() {
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            // A refusal leaves the soft limit, as before.
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

/// The node's physical memory (0 when the system does not say).
fn host_memory() -> u64 {
    let value = |var| sysconf(var).ok().flatten().unwrap_or(0).max(0) as u64;
    value(SysconfVar::_PHYS_PAGES).saturating_mul(value(SysconfVar::PAGE_SIZE))
}

fn main() {
    if let Err(e) = gpufrac_common::daemon::init_logging() {
        eprintln!("gpufrac-arbiter: error: {e}");
        std::process::exit(2);
    }
    if let Err(e) = run(Args::parse()) {
        eprintln!("gpufrac-arbiter: error: {e:#}");
        std::process::exit(1);
    }
}

/// Binds the socket: refuses if another arbiter answers on it, removes a stale one. A
/// missing folder is created only with `create_dir`.
fn bind(socket: &Path, create_dir: bool) -> Result<std::os::unix::net::UnixListener> {
    if let Some(dir) = socket.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        if create_dir {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        } else if !dir.is_dir() {
            bail!(
                "the socket's folder {} does not exist (a typo in --socket? --create-socket-dir creates it)",
                dir.display()
            );
        }
    }
    if socket.exists() {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            bail!("another arbiter is serving {}", socket.display());
        }
        std::fs::remove_file(socket)
            .with_context(|| format!("removing the stale socket {}", socket.display()))?;
    }
    let listener = std::os::unix::net::UnixListener::bind(socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    // Shims run as any user inside containers; who reaches the socket is decided by
    // who gets its folder mounted.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn run(args: Args) -> Result<()> {
    // Flags first: a bad one is reported whatever the node has.
    let options = server::Options {
        idle_timeout: gpufrac_common::parse_duration("--idle-timeout", &args.idle_timeout)?,
        kill_grace: gpufrac_common::parse_duration("--kill-grace", &args.kill_grace)?,
        swap_quantum: gpufrac_common::parse_duration("--swap-quantum", &args.swap_quantum)?,
        reclaim_grace: gpufrac_common::parse_duration("--reclaim-grace", &args.reclaim_grace)?,
        swap_limit: match args.swap_limit.trim() {
            "0" => 0,
            limit => gpufrac_common::parse_size("--swap-limit", limit)?.resolve(host_memory()),
        },
        max_connections_per_uid: match args.max_connections_per_uid {
            n @ 1..=1_048_576 => n,
            n => bail!("--max-connections-per-uid {n}: expected 1 to 1048576 connections"),
        },
        admin_gid: args.admin_group.as_deref().map(admin_gid).transpose()?,
        oversubscribe: match args.oversubscribe.trim().parse::<f64>() {
            Ok(ratio) if (1.0..=1000.0).contains(&ratio) => ratio,
            _ => bail!(
                "--oversubscribe {:?}: expected a ratio from 1 (no oversubscription) to 1000, such as 3",
                args.oversubscribe
            ),
        },
        park_with: args
            .park_with
            .parse()
            .map_err(|e| anyhow::anyhow!("--park-with {:?}: {e}", args.park_with))?,
        enforce_limits: args
            .enforce_limits
            .parse()
            .map_err(|e| anyhow::anyhow!("--enforce-limits {:?}: {e}", args.enforce_limits))?,
        enforce_grace: gpufrac_common::parse_duration("--enforce-grace", &args.enforce_grace)?,
        gpu_memory: args
            .gpu_memory
            .as_deref()
            .map(|size| gpufrac_common::parse_size("--gpu-memory", size))
            .transpose()?,
        ..server::Options::default()
    };
    if args.shares_per_gpu == Some(0) {
        bail!("--shares-per-gpu 0: expected at least 1 share per GPU");
    }
    if let Some(gid) = options.admin_gid {
        tracing::info!(gid, "root and members of --admin-group see every tenant in gpufrac status");
    }
    // Checked before the GPUs: a bad policy file is reported whatever the node has.
    let entitlements = entitlements(&args)?;
    raise_descriptor_limit();
    let gpus = gpus::discover().map_err(|e| anyhow::anyhow!("finding the GPUs: {e}"))?;
    if gpus.is_empty() {
        bail!("NVML reports no GPU on this node");
    }
    let managed = match options.gpu_memory {
        Some(spec) => gpus::managed(spec, &gpus).map_err(anyhow::Error::msg)?,
        None => gpus.clone(),
    };
    for ((id, total), (_, managed)) in gpus.iter().zip(&managed) {
        tracing::info!(
            gpu = %gpufrac_daemon::arbiter::policy::uuid_string(id),
            total = %gpufrac_common::size::format_size(*total),
            managed = %gpufrac_common::size::format_size(*managed),
            headroom = %gpufrac_common::size::format_size(total - managed),
            "managing GPU"
        );
    }
    tracing::info!(
        swap_limit = %gpufrac_common::size::format_size(options.swap_limit),
        quantum = ?options.swap_quantum,
        "swap resolver"
    );
    // The default socket's folder is gpufrac's own runtime folder: made on a fresh node.
    let create_dir = args.create_socket_dir || args.socket == Path::new(DEFAULT_SOCKET);
    let listener = bind(&args.socket, create_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let socket = args.socket.clone();
    runtime.block_on(async move {
        let processes: Option<Box<dyn gpus::ProcessList>> = match gpus::NvmlProcesses::open() {
            Ok(list) => Some(Box::new(list)),
            Err(e) => {
                tracing::warn!("{e}: memory used outside gpufrac will not be seen");
                None
            }
        };
        let shared =
            server::Shared::entitled(&gpus, options, Box::new(server::Signals), processes, entitlements);
        if options.park_with == server::ParkWith::Checkpoint {
            shared.require_checkpoint_api().map_err(anyhow::Error::msg)?;
        }
        if options.enforce_limits == server::EnforceLimits::End {
            tracing::info!(grace = ?options.enforce_grace, "groups past their limit by the device's own count are ended after the grace (--enforce-limits end)");
        }
        if options.oversubscribe > 1.0 {
            tracing::info!(ratio = options.oversubscribe, "parkable groups may oversubscribe each GPU");
        }
        let listener = tokio::net::UnixListener::from_std(listener)?;
        if let Some(addr) = args.metrics {
            let tcp = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding --metrics {addr}"))?;
            // The address bound, not the one asked for: with port 0 the system picks one,
            // and this line is how a caller learns it.
            let addr = tcp.local_addr().with_context(|| format!("the address --metrics {addr} bound"))?;
            tracing::info!(%addr, "serving metrics");
            let status_source = shared.clone();
            tokio::spawn(metrics::serve(tcp, shared.metrics.clone(), move || status_source.status()));
        }
        // Polled once before saying "serving": its SIGTERM and SIGINT handlers are
        // installed at its first poll, and until then either signal would end the
        // arbiter without removing its socket.
        let mut shutdown = std::pin::pin!(gpufrac_common::daemon::terminated());
        let stopped = std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(shutdown.as_mut(), cx).is_ready())).await;
        if !stopped {
            tracing::info!(socket = %socket.display(), "serving");
            server::serve(listener, shared, shutdown).await;
        }
        anyhow::Ok(())
    })?;
    let _ = std::fs::remove_file(&args.socket);
    tracing::info!("stopped");
    Ok(())
}
