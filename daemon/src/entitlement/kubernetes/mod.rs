//! Entitlements on a Kubernetes node: what a process may have is what the kubelet (or the
//! DRA kubelet plugin) allocated its container and what its pod says, never what the
//! process says.
//!
//! Every API-server read goes through kube-rs: a reflector over the pods of this node only
//! (`fieldSelector=spec.nodeName=<node>`; [`pods`]) keeps them in a local store, and a
//! lookup reads the pod by UID from it. The arbiter's service account needs `list` and
//! `watch` on pods (never `get` per process).
//!
//! For a process whose cgroup names a pod UID and a container ID ([`ContainerRef`]):
//!
//! 1. **Which pod.** The pod of this node whose `metadata.uid` is the cgroup's pod UID, from
//!    the store. The field selector vouches that it runs here (and a pod whose
//!    `spec.nodeName` is another node is refused all the same); a UID no pod of this node
//!    has gets nothing. A pod not in the store yet (its watch event may come a moment
//!    after the kubelet started it) is waited for until the lookup's deadline.
//! 2. **What it may have**, from one of two sources, as the node runs one or the other:
//!    - **The device plugin's shares** (the default). *Which container:* the pod's
//!      `status.containerStatuses` (and `initContainerStatuses`, for sidecars) map the
//!      cgroup's container ID (`containerd://<id>`, `cri-o://<id>`, `docker://<id>`) to a
//!      container name; a container that has just started may not be in the status yet
//!      (the kubelet reports it within about a second), so the store is watched for a
//!      newer status until the lookup's deadline before the container is refused.
//!      *Request:* the container's share IDs from the kubelet's PodResources API
//!      ([`podresources`]; `<GPU UUID>::<n>`) → on each GPU they lie on,
//!      `its shares / shares_per_gpu` of that GPU, and only those GPUs (shares on several
//!      GPUs: a fraction of each, as tensor-parallel servers ask). *Limit:* the pod's
//!      `gpufrac.io/gpu-fraction-limit` on each GPU (never below that GPU's request;
//!      default the request); *resolver:* `gpufrac.io/resolver`
//!      (default `wait`); *compute share:* `gpufrac.io/compute-fraction` (the most
//!      compute request believed; absent: 0%, no guarantee) and
//!      `gpufrac.io/compute-fraction-limit` (the most compute limit believed; absent:
//!      100%), read as the webhook reads them; all only for the container the pod's
//!      `gpufrac.io/container` names (default the first), as the webhook applies them;
//!      another container with shares gets limit = request, `wait` and no compute
//!      request. *Priority:* `spec.priority` (default 0).
//!      *Group:* `k8s-<pod uid>-<container name>` ([`group_name`]). A bad annotation
//!      refuses the entitlement, naming it.
//!    - **DRA claims** ([`KubernetesOptions::dra_checkpoint`]; [`dra`]): the claims the DRA
//!      kubelet plugin prepared for the pod, as its checkpoint records them, whatever the
//!      container (only containers given the claim see its GPUs). Exactly one claim among
//!      the pod's claims of its namespace: its GPUs, on each the request and limit in
//!      bytes the claim holds there, its resolver, its priority (default `spec.priority`),
//!      its compute share as prepared (none: no compute request), group
//!      `dra-<claim uid>`. None, or several claims, is a refusal naming them.
//!
//! The store is the cache of pods: a changed pod is seen once the watch delivers it, and
//! the API server is never asked per lookup. The kubelet's answer about a pod's shares is
//! kept for [`DEFAULT_CACHE_TTL`] (only answers that list the pod). When the watch fails
//! (an API server outage, a token refused), the pods last seen are still answered from; a
//! pod not among them is then [`Verdict::Unknown`], and so is every lookup before the
//! first list arrived. Each lookup has a deadline ([`DEFAULT_LOOKUP_TIMEOUT`]); when it
//! passes, or the kubelet or the DRA checkpoint cannot be read, the answer is
//! [`Verdict::Unknown`] with the reason (not a verdict: the arbiter asks again later),
//! and a refusal is [`Verdict::NotEntitled`].
//!
//! A process with no container ([`Cgroup::Host`]: no cgroup under `kubepods` or a
//! container runtime): the node's root is [`Verdict::Unrestricted`] (believed about
//! itself only: root can end any process anyway), unless
//! [`KubernetesOptions::trust_host_root`] is off; any other host process is
//! [`Verdict::NotEntitled`]. A process whose cgroup is under `kubepods` or a runtime but
//! not understood ([`Cgroup::Unknown`]) is [`Verdict::NotEntitled`], whatever its UID.
//! Both sources share these rules.
//!
//! # Selecting it (for the arbiter's flags)
//!
//! `gpufrac-arbiter --kubernetes [--node-name NAME] [--pod-resources-socket PATH |
//! --dra-checkpoint PATH]` builds [`KubernetesOptions::new`] from [`infer_config`] (a
//! kubeconfig from `KUBECONFIG` or `~/.kube/config`, else the in-cluster service account)
//! and the node's name (`--node-name`, else `NODE_NAME`: required), then
//! [`KubernetesEntitlements::new`], and exits with the error (it names what is missing)
//! when any fails. [`KubernetesEntitlements::lookup`] blocks (up to the lookup timeout
//! plus a margin): call it from a blocking task.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufrac_common::compute::ComputeSpec;
use gpufrac_common::resolver::Resolver;

use super::{
    Amount, Cgroup, ContainerRef, DeviceCaps, Entitlement, Entitlements, Identity, Verdict,
    NO_COMPUTE_REQUEST,
};

pub mod dra;
pub mod podresources;
pub mod pods;

use dra::{DraRefusal, PreparedClaims};
use podresources::{PodDevices, PodResourcesClient};
use pods::{is_uid, PodError, PodRecord, PodStore};

/// The generated kubelet PodResources API (`podresources/v1`): the client the arbiter
/// uses, and the server the tests' kubelet stand-in implements.
#[allow(missing_docs, clippy::all)]
pub mod api {
    tonic::include_proto!("v1");
}

/// The extended resource the device plugin advertises.
pub const RESOURCE: &str = "gpufrac.io/gpu";
/// The pod annotation holding the limit, as a fraction of one GPU.
pub const FRACTION_LIMIT: &str = "gpufrac.io/gpu-fraction-limit";
/// The pod annotation holding the resolver.
pub const RESOLVER: &str = "gpufrac.io/resolver";
/// The pod annotation naming the container that gets the GPU (default the first).
pub const CONTAINER: &str = "gpufrac.io/container";
/// The pod annotation holding the compute request, a share of the GPU's time.
pub const COMPUTE: &str = "gpufrac.io/compute-fraction";
/// The pod annotation holding the compute limit, a share of the GPU's time.
pub const COMPUTE_LIMIT: &str = "gpufrac.io/compute-fraction-limit";
/// Shares per GPU, as the device plugin's `--shares-per-gpu` default.
pub const DEFAULT_SHARES_PER_GPU: u32 = 100;
/// How long the kubelet's answer about a pod's shares is kept.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(10);
/// How long one lookup may take before it answers "unknown".
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// The arbiter's longest group name (`A-Za-z0-9._-`).
pub const MAX_GROUP: usize = 64;

/// Why Kubernetes entitlements cannot be set up; each names what is missing.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    /// The kubelet's PodResources socket is not there.
    #[error(
        "kubelet PodResources socket {}: {reason} (mount the host's /var/lib/kubelet/pod-resources \
         into the arbiter, as examples/kubernetes/daemonset.yaml does, or name another with \
         --pod-resources-socket)",
        path.display()
    )]
    Socket {
        /// The socket.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No configuration for the API server was found.
    #[error(
        "no Kubernetes API server configuration: neither a kubeconfig (KUBECONFIG, ~/.kube/config) nor \
         the in-cluster one (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT, which the kubelet sets \
         in a pod, and the service account's token): {0}"
    )]
    Config(String),
    /// The API server's configuration cannot make a client (a bad CA certificate, say).
    #[error("Kubernetes API server client: {0}")]
    Client(String),
    /// An option is out of range.
    #[error("{0}")]
    Option(String),
    /// The lookup thread could not start.
    #[error("cannot start the Kubernetes lookup thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// The API server's configuration as kube-rs finds it ([`kube::Config::infer`]): a
/// kubeconfig (`KUBECONFIG`, else `~/.kube/config`), else the in-cluster one (the pod's
/// service account; kube-rs re-reads its rotating token). Blocks: never call it from
/// async code.
pub fn infer_config() -> Result<kube::Config, KubernetesError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(KubernetesError::Runtime)?;
    runtime.block_on(kube::Config::infer()).map_err(|e| KubernetesError::Config(error_chain(&e)))
}

/// An error and its causes, joined with `: ` (a cause its parent already shows is not
/// repeated).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        next = cause.source();
    }
    text
}

/// How to reach the API server and the kubelet, and the lookup's knobs.
#[derive(Clone)]
pub struct KubernetesOptions {
    /// The API server and the credentials to list and watch pods with.
    pub api_server: kube::Config,
    /// This node's name: only its pods are watched (required).
    pub node_name: String,
    /// The kubelet's PodResources socket ([`podresources::DEFAULT_SOCKET`]); not used
    /// with [`KubernetesOptions::dra_checkpoint`].
    pub pod_resources_socket: PathBuf,
    /// Shares per GPU, as the device plugin's `--shares-per-gpu`.
    pub shares_per_gpu: u32,
    /// Entitlements from the DRA claims prepared on this node, as the DRA kubelet plugin's
    /// checkpoint at this path records them ([`gpufrac_common::dra::DEFAULT_PLUGIN_DIR`]
    /// and [`gpufrac_common::dra::CHECKPOINT_FILE`]), instead of the device plugin's shares.
    pub dra_checkpoint: Option<PathBuf>,
    /// How long the kubelet's answer about a pod's shares is kept.
    pub cache_ttl: Duration,
    /// The most one lookup may take.
    pub lookup_timeout: Duration,
    /// Whether a host process (no pod) of root is [`Verdict::Unrestricted`] rather than
    /// [`Verdict::NotEntitled`].
    pub trust_host_root: bool,
}

impl std::fmt::Debug for KubernetesOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesOptions")
            .field("api_server", &self.api_server.cluster_url)
            .field("node_name", &self.node_name)
            .field("pod_resources_socket", &self.pod_resources_socket)
            .field("dra_checkpoint", &self.dra_checkpoint)
            .finish_non_exhaustive()
    }
}

impl KubernetesOptions {
    /// Options with the defaults for everything but the API server, the node's name and
    /// the kubelet's socket (`None`: [`podresources::DEFAULT_SOCKET`]).
    pub fn new(
        api_server: kube::Config,
        node_name: impl Into<String>,
        pod_resources_socket: Option<PathBuf>,
    ) -> KubernetesOptions {
        KubernetesOptions {
            api_server,
            node_name: node_name.into(),
            pod_resources_socket: pod_resources_socket
                .unwrap_or_else(|| PathBuf::from(podresources::DEFAULT_SOCKET)),
            shares_per_gpu: DEFAULT_SHARES_PER_GPU,
            dra_checkpoint: None,
            cache_ttl: DEFAULT_CACHE_TTL,
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            trust_host_root: true,
        }
    }
}

/// Where allocations come from.
enum Source {
    /// The device plugin's shares, from the kubelet.
    Kubelet {
        client: PodResourcesClient,
        /// Pod UID → the kubelet's last answer listing the pod, and when it came.
        cache: Mutex<HashMap<String, (Instant, PodDevices)>>,
    },
    /// The DRA kubelet plugin's checkpoint.
    Dra(PreparedClaims),
}

/// Entitlements from the API server and the kubelet or the DRA checkpoint (see the
/// module's documentation).
pub struct KubernetesEntitlements {
    inner: Arc<Inner>,
    /// Its own small runtime (the reflector runs on it), so that [`Entitlements::lookup`]
    /// works from any thread; taken on drop and shut down in the background (dropping a
    /// runtime in async code panics).
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for KubernetesEntitlements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("KubernetesEntitlements");
        d.field("api_server", &self.inner.pods.server()).field("node_name", &self.inner.node_name);
        match &self.inner.source {
            Source::Kubelet { client, .. } => d.field("pod_resources_socket", &client.socket()),
            Source::Dra(claims) => d.field("dra_checkpoint", &claims.path()),
        };
        d.finish_non_exhaustive()
    }
}

impl KubernetesEntitlements {
    /// Checks the options (the kubelet's socket must exist, unless the DRA checkpoint is the
    /// source), starts the lookup thread and the watch of this node's pods.
    pub fn new(options: KubernetesOptions) -> Result<KubernetesEntitlements, KubernetesError> {
        use std::os::unix::fs::FileTypeExt as _;
        if options.node_name.trim().is_empty() {
            return Err(KubernetesError::Option("the node's name is empty".into()));
        }
        if options.lookup_timeout.is_zero() {
            return Err(KubernetesError::Option("the lookup timeout must be above 0".into()));
        }
        let source = match options.dra_checkpoint {
            Some(path) => Source::Dra(PreparedClaims::new(path)),
            None => {
                let socket = &options.pod_resources_socket;
                match std::fs::metadata(socket) {
                    Ok(meta) if meta.file_type().is_socket() => {}
                    Ok(_) => {
                        return Err(KubernetesError::Socket {
                            path: socket.clone(),
                            reason: "not a unix socket".into(),
                        })
                    }
                    Err(e) => {
                        return Err(KubernetesError::Socket { path: socket.clone(), reason: e.to_string() })
                    }
                }
                if options.shares_per_gpu == 0 {
                    return Err(KubernetesError::Option("shares per GPU must be at least 1".into()));
                }
                Source::Kubelet {
                    client: PodResourcesClient::new(socket.clone(), RESOURCE),
                    cache: Mutex::new(HashMap::new()),
                }
            }
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpufrac-k8s")
            .enable_all()
            .build()
            .map_err(KubernetesError::Runtime)?;
        let server = options.api_server.cluster_url.to_string().trim_end_matches('/').to_owned();
        let pods = {
            // The client and the reflector spawn their tasks on this runtime.
            let _entered = runtime.enter();
            let client = kube::Client::try_from(options.api_server)
                .map_err(|e| KubernetesError::Client(format!("{server}: {}", error_chain(&e))))?;
            PodStore::start(client, &options.node_name, server)
        };
        let inner = Inner {
            pods,
            source,
            node_name: options.node_name,
            shares_per_gpu: options.shares_per_gpu,
            cache_ttl: options.cache_ttl,
            lookup_timeout: options.lookup_timeout,
            trust_host_root: options.trust_host_root,
        };
        Ok(KubernetesEntitlements { inner: Arc::new(inner), runtime: Some(runtime) })
    }
}

impl Drop for KubernetesEntitlements {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Entitlements for KubernetesEntitlements {
    /// Blocks for at most the lookup timeout and a little more; never panics, even when
    /// called from async code (where it should not be called: it blocks the thread).
    fn lookup(&self, who: &Identity) -> Verdict {
        let Some(runtime) = &self.runtime else {
            return Verdict::NotEntitled { why: "Kubernetes entitlements are shut down".into() };
        };
        let timeout = self.inner.lookup_timeout;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let inner = self.inner.clone();
        let who = who.clone();
        runtime.spawn(async move {
            let verdict = match tokio::time::timeout(timeout, inner.lookup(&who)).await {
                Ok(verdict) => verdict,
                Err(_) => Verdict::Unknown {
                    why: format!(
                        "no answer from the API server ({}) and the node's allocations within {timeout:?}",
                        inner.pods.server()
                    ),
                },
            };
            let _ = tx.send(verdict);
        });
        rx.recv_timeout(timeout + Duration::from_millis(500)).unwrap_or_else(|_| Verdict::Unknown {
            why: format!("the Kubernetes entitlement lookup did not answer within {timeout:?}"),
        })
    }
}

/// Why a lookup gives no entitlement.
#[derive(Debug, Clone, PartialEq)]
enum Failure {
    /// An answer: nothing for this process.
    No(String),
    /// The API server, the kubelet or the checkpoint could not be read: no answer
    /// ([`Verdict::Unknown`]).
    Unreachable(String),
}

impl From<PodError> for Failure {
    fn from(e: PodError) -> Failure {
        match e {
            PodError::NotOnNode(why) => Failure::No(why),
            PodError::Unknown(why) => Failure::Unreachable(why),
        }
    }
}

struct Inner {
    pods: PodStore,
    source: Source,
    node_name: String,
    shares_per_gpu: u32,
    cache_ttl: Duration,
    lookup_timeout: Duration,
    trust_host_root: bool,
}

impl Inner {
    async fn lookup(&self, who: &Identity) -> Verdict {
        let container = match &who.cgroup {
            Cgroup::Container(container) => container,
            // Under kubepods or a runtime, but not understood: never taken for the host.
            Cgroup::Unknown(why) => {
                return Verdict::NotEntitled {
                    why: format!(
                        "cannot tell which container it runs in ({why}): only processes of a known \
                         container layout or of the host are looked up"
                    ),
                }
            }
            Cgroup::Host => {
                return if who.uid == 0 && self.trust_host_root {
                    Verdict::Unrestricted
                } else {
                    let what = match self.source {
                        Source::Kubelet { .. } => format!("pods given {RESOURCE} shares"),
                        Source::Dra(_) => "pods given a gpufrac DRA claim".to_owned(),
                    };
                    Verdict::NotEntitled {
                        why: format!(
                            "uid {} runs outside any pod on a Kubernetes node: only {what} are entitled",
                            who.uid
                        ),
                    }
                };
            }
        };
        // Answers in time to say why, before the caller's timeout says only that.
        let margin = (self.lookup_timeout / 4).min(Duration::from_millis(100));
        let deadline = tokio::time::Instant::now() + self.lookup_timeout - margin;
        let answer = match checked(container) {
            Err(why) => Err(Failure::No(why)),
            Ok((uid, container_id)) => match &self.source {
                Source::Kubelet { client, cache } => {
                    self.by_kubelet_shares(client, cache, &uid, &container_id, deadline).await
                }
                Source::Dra(claims) => self.by_dra_claims(claims, &uid, deadline).await,
            },
        };
        match answer {
            Ok(entitlement) => Verdict::Entitled(entitlement),
            Err(Failure::No(why)) => Verdict::NotEntitled { why },
            Err(Failure::Unreachable(why)) => Verdict::Unknown { why },
        }
    }

    /// The device plugin's shares of the container, and the pod's annotations.
    async fn by_kubelet_shares(
        &self,
        kubelet: &PodResourcesClient,
        cache: &Mutex<HashMap<String, (Instant, PodDevices)>>,
        uid: &str,
        container_id: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Entitlement, Failure> {
        let listed =
            |pod: &PodRecord| pod.statuses.iter().any(|s| s.container_id.as_deref() == Some(container_id));
        let pod = self.pods.pod(uid, deadline, listed).await?;
        if !listed(&pod) {
            // Checked before the kubelet is asked: the refusal needs no kubelet.
            let why = decide(&pod, None, container_id, &self.node_name, self.shares_per_gpu)
                .err()
                .unwrap_or_default();
            // A failing watch may have missed the status that lists it: no answer.
            return Err(match self.pods.failing() {
                Some(failure) => Failure::Unreachable(format!(
                    "{why}; but the watch of the API server {} is failing, so the status may be old: \
                     {failure}",
                    self.pods.server()
                )),
                None => Failure::No(why),
            });
        }
        let fresh = {
            let cache = cache.lock().unwrap_or_else(|p| p.into_inner());
            cache.get(uid).filter(|(at, _)| at.elapsed() < self.cache_ttl).map(|(_, devices)| devices.clone())
        };
        let devices = match fresh {
            Some(devices) => Some(devices),
            None => {
                let devices = kubelet
                    .pod(&pod.namespace, &pod.name)
                    .await
                    .map_err(|e| Failure::Unreachable(e.to_string()))?;
                if let Some(devices) = &devices {
                    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
                    // A pod's UID is never reused: answers long unused are forgotten.
                    let keep = (self.cache_ttl * 10).max(Duration::from_secs(60));
                    cache.retain(|_, (at, _)| at.elapsed() < keep);
                    cache.insert(uid.to_owned(), (Instant::now(), devices.clone()));
                }
                devices
            }
        };
        decide(&pod, devices.as_ref(), container_id, &self.node_name, self.shares_per_gpu)
            .map_err(Failure::No)
    }

    /// The DRA claims prepared for the pod.
    async fn by_dra_claims(
        &self,
        claims: &PreparedClaims,
        uid: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Entitlement, Failure> {
        let pod = self.pods.pod(uid, deadline, |_| true).await?;
        on_node(&pod, &self.node_name).map_err(Failure::No)?;
        let checkpoint = claims.current().map_err(Failure::Unreachable)?;
        dra::decide(&pod, &checkpoint).map_err(|refusal| match refusal {
            DraRefusal::No(why) => Failure::No(why),
            DraRefusal::Invalid(why) => Failure::Unreachable(why),
        })
    }
}

/// The cgroup's pod UID and container ID, lower case and checked; `Err` says why not.
fn checked(who: &ContainerRef) -> Result<(String, String), String> {
    let uid = who.pod_uid.to_ascii_lowercase();
    if !is_uid(&uid) {
        return Err(format!("the cgroup's pod UID {} is not a UUID", cut(&who.pod_uid)));
    }
    let container_id = who.container_id.to_ascii_lowercase();
    if container_id.is_empty()
        || container_id.len() > 128
        || !container_id.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(format!("the cgroup's container ID {} is not a container ID", cut(&who.container_id)));
    }
    Ok((uid, container_id))
}

/// Refuses a pod the API server places on another node.
fn on_node(pod: &PodRecord, node_name: &str) -> Result<(), String> {
    match pod.node_name.as_deref() {
        Some(there) if there != node_name => Err(format!(
            "pod {}/{} runs on node {there}, not on this node ({node_name})",
            pod.namespace, pod.name
        )),
        _ => Ok(()),
    }
}

/// What the container with `container_id` of `pod` may have, given the kubelet's answer
/// about the pod's shares (`None`: the kubelet lists none for it).
fn decide(
    pod: &PodRecord,
    devices: Option<&PodDevices>,
    container_id: &str,
    node_name: &str,
    shares_per_gpu: u32,
) -> Result<Entitlement, String> {
    let at = format!("pod {}/{}", pod.namespace, pod.name);
    on_node(pod, node_name)?;
    let Some(status) = pod.statuses.iter().find(|s| s.container_id.as_deref() == Some(container_id)) else {
        return Err(format!(
            "container {} is not (yet) one of {at}'s containers: no status.containerStatuses entry has \
             this containerID",
            short_id(container_id)
        ));
    };
    let container = &status.name;
    let Some(devices) = devices else {
        return Err(format!("the kubelet of this node lists no {RESOURCE} shares for {at}"));
    };
    let Some(ids) = devices.containers.get(container) else {
        return Err(format!("container {container} of {at} was allocated no {RESOURCE} shares"));
    };
    let gpus = shares_of(ids, shares_per_gpu)
        .map_err(|why| format!("container {container} of {at}: kubelet PodResources: {why}"))?;

    // The annotations are checked whichever container asks: a bad one is the pod's mistake.
    let limit = match pod.annotations.get(FRACTION_LIMIT) {
        None => None,
        Some(text) => Some(parse_fraction(text).ok_or_else(|| {
            format!("{at}: annotation {FRACTION_LIMIT}={}: expected a fraction 0 < f <= 1", shown(text))
        })?),
    };
    let resolver = match pod.annotations.get(RESOLVER) {
        None => Resolver::Wait,
        Some(text) => text
            .parse::<Resolver>()
            .map_err(|e| format!("{at}: annotation {RESOLVER}={}: {e}", shown(text)))?,
    };
    // As the webhook reads them (and as the shim reads the variables it sets): a request
    // alone may burst to the whole GPU, a limit alone guarantees nothing.
    let compute = ComputeSpec::from_texts(
        (COMPUTE, pod.annotations.get(COMPUTE).map(String::as_str)),
        (COMPUTE_LIMIT, pod.annotations.get(COMPUTE_LIMIT).map(String::as_str)),
    )
    .map_err(|e| format!("{at}: annotation {}={}: {}", e.input, shown(&e.value), e.reason))?
    .unwrap_or(NO_COMPUTE_REQUEST);
    // The webhook gives the annotations to one container; another with shares (asked for
    // with gpufrac.io/gpu directly) gets its request as its limit, `wait`, and no compute
    // request.
    let target = pod.annotations.get(CONTAINER).or_else(|| pod.containers.first());
    let targeted = target == Some(container);
    let (resolver, compute) = match targeted {
        true => (resolver, compute),
        false => (Resolver::Wait, NO_COMPUTE_REQUEST),
    };
    // Each GPU its own fraction: the scheduler may have placed more shares on one.
    let (mut max_request, mut max_limit) = (0.0_f64, 0.0_f64);
    let devices: BTreeMap<[u8; 16], DeviceCaps> = gpus
        .into_iter()
        .map(|(uuid, shares)| {
            let request = f64::from(shares) / f64::from(shares_per_gpu);
            let limit = match targeted {
                // The webhook raises a limit below the whole shares granted (0.333 → 0.34).
                true => limit.unwrap_or(request).max(request),
                false => request,
            };
            max_request = max_request.max(request);
            max_limit = max_limit.max(limit);
            (uuid, DeviceCaps { max_request: Amount::Fraction(request), max_limit: Amount::Fraction(limit) })
        })
        .collect();
    Ok(Entitlement {
        source: format!("kubelet: {}/{} container {container}", pod.namespace, pod.name),
        devices: Some(devices),
        max_request: Amount::Fraction(max_request),
        max_limit: Amount::Fraction(max_limit),
        max_priority: pod.priority,
        resolver: Some(resolver),
        group: Some(group_name(&pod.uid, container)),
        max_compute: Some(compute),
    })
}

/// The GPUs and the number of shares on each in a container's device IDs
/// (`<GPU UUID>::<n>`).
pub fn shares_of(ids: &[String], shares_per_gpu: u32) -> Result<BTreeMap<[u8; 16], u32>, String> {
    let mut gpus: BTreeMap<[u8; 16], BTreeSet<u32>> = BTreeMap::new();
    for id in ids {
        let parsed = id.rsplit_once("::").and_then(|(uuid, n)| {
            let uuid = gpufrac_common::gpu_uuid::parse(uuid)?;
            let n = n.parse::<u32>().ok().filter(|n| *n < shares_per_gpu)?;
            Some((uuid, n))
        });
        let Some((uuid, n)) = parsed else {
            return Err(format!(
                "device ID {}: expected <GPU UUID>::<n> with n below {shares_per_gpu}",
                shown(id)
            ));
        };
        gpus.entry(uuid).or_default().insert(n);
    }
    if gpus.is_empty() {
        return Err("no device IDs".into());
    }
    Ok(gpus
        .into_iter()
        .map(|(uuid, shares)| (uuid, u32::try_from(shares.len()).unwrap_or(u32::MAX)))
        .collect())
}

/// A plain decimal `0 < f <= 1` (`0.5`, `.25`, `1`), as the webhook accepts.
fn parse_fraction(text: &str) -> Option<f64> {
    let text = text.trim();
    let plain = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && text.bytes().filter(|b| *b == b'.').count() <= 1
        && text != ".";
    let f: f64 = text.parse().ok().filter(|_| plain)?;
    (f > 0.0 && f <= 1.0).then_some(f)
}

/// The group of a container: `k8s-<pod uid>-<container name>`, or, when that is longer
/// than [`MAX_GROUP`] or has characters the arbiter refuses, `k8s-<pod uid>-` with the
/// start of the name and a hash of the whole (the pod UID keeps groups of different pods
/// apart; within one pod, the hash keeps its containers apart).
pub fn group_name(pod_uid: &str, container: &str) -> String {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let full = format!("k8s-{pod_uid}-{container}");
    if full.len() <= MAX_GROUP && full.chars().all(allowed) {
        return full;
    }
    let hash = fnv1a64(full.as_bytes());
    let prefix = format!("k8s-{pod_uid}-");
    let room = MAX_GROUP.saturating_sub(prefix.len() + 17);
    let start: String = container.chars().filter(|c| allowed(*c)).take(room).collect();
    let mut group = format!("{prefix}{start}-{hash:016x}");
    group.truncate(MAX_GROUP);
    group
}

/// FNV-1a, 64 bits: a stable hash (the same on every arbiter and after restarts).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// A container ID cut to 12 characters, as `crictl` shows them.
fn short_id(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// The most characters of an outside value echoed in a message.
const SHOWN_CHARS: usize = 64;

/// `text` cut after [`SHOWN_CHARS`] characters, with `…` when cut.
pub(crate) fn cut(text: &str) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        None => text.to_owned(),
        Some((at, _)) => format!("{}…", &text[..at]),
    }
}

/// An outside value as shown in a message: quoted, escaped and cut.
fn shown(text: &str) -> String {
    format!("{:?}", cut(text))
}

#[cfg(test)]
mod tests;
