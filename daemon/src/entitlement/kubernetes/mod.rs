//! Entitlements on a Kubernetes node: what a process may have is what the kubelet
//! allocated its container and what its pod says, never what the process says.
//!
//! For a process whose cgroup names a pod UID and a container ID ([`ContainerRef`]):
//!
//! 1. **Which pod.** The kubelet's PodResources API ([`podresources`]) lists the pods of
//!    this node that hold `gpufrac.io/gpu` shares, by namespace and name; each is read
//!    from the API server ([`apiserver`]) and the one whose `metadata.uid` is the cgroup's
//!    pod UID is the process's pod. The kubelet vouches that the pod runs here, the API
//!    server for its UID; a UID no such pod has gets nothing (a pod without shares, or a
//!    pod of another node). Only `get` on pods is needed, never `list`.
//! 2. **Which container.** The pod's `status.containerStatuses` (and
//!    `initContainerStatuses`, for sidecars) map the cgroup's container ID
//!    (`containerd://<id>`, `cri-o://<id>`, `docker://<id>`) to a container name. A
//!    container that has just started may not be in the status yet (the kubelet reports it
//!    within about a second), so an unknown ID is asked again until the lookup's deadline
//!    (2 s) before it is refused.
//! 3. **What it may have.** Request: the container's share IDs (`<GPU UUID>::<n>`, all on
//!    one GPU) → `shares / shares_per_gpu` of that GPU, and only that GPU. Limit: the pod's
//!    `gpufrac.io/gpu-fraction-limit` (never below the request; default the request);
//!    resolver: `gpufrac.io/resolver` (default `wait`); both only for the container the
//!    pod's `gpufrac.io/container` names (default the first), as the webhook applies them;
//!    another container with shares gets limit = request and `wait`. Priority:
//!    `spec.priority` (default 0). Group: `k8s-<pod uid>-<container name>`
//!    ([`group_name`]). A bad annotation refuses the entitlement, naming it.
//!
//! Answers are cached per pod UID for [`DEFAULT_CACHE_TTL`]: within it, neither the
//! kubelet nor the API server is asked again (so an API server outage is felt only after
//! it); only entitlements are cached, never refusals. Each lookup has a deadline
//! ([`DEFAULT_LOOKUP_TIMEOUT`]); when it passes, or the kubelet or the API server cannot be
//! asked, the answer is [`Verdict::Unknown`] with the reason (not a verdict: the arbiter
//! asks again later), and a refusal is [`Verdict::NotEntitled`].
//!
//! A process with no container ([`Cgroup::Host`]: no cgroup under `kubepods` or a
//! container runtime): the node's root is [`Verdict::Unrestricted`] (believed about
//! itself only: root can end any process anyway), unless
//! [`KubernetesOptions::trust_host_root`] is off; any other host process is
//! [`Verdict::NotEntitled`]. A process whose cgroup is under `kubepods` or a runtime but
//! not understood ([`Cgroup::Unknown`]) is [`Verdict::NotEntitled`], whatever its UID.
//!
//! # Selecting it (for `run.rs` and the arbiter's flags)
//!
//! `gpufrac-arbiter --kubernetes [--pod-resources-socket PATH]` should build
//! [`KubernetesOptions::in_cluster`]`(socket)` (the socket defaults to
//! [`podresources::DEFAULT_SOCKET`]), then [`KubernetesEntitlements::new`], and exit with
//! the error (it names what is missing) when either fails; without `--kubernetes`, another
//! source (a policy file, or none). [`KubernetesEntitlements::lookup`] blocks (up to the
//! lookup timeout plus a margin): call it from a blocking task.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufrac_common::resolver::Resolver;

use super::{Amount, Cgroup, ContainerRef, Entitlement, Entitlements, Identity, Verdict};

pub mod apiserver;
pub mod podresources;

use apiserver::{is_uid, ApiServer, ApiServerConfig, ApiServerError, PodRecord};
use podresources::{PodDevices, PodResourcesClient};

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
/// Shares per GPU, as the device plugin's `--shares-per-gpu` default.
pub const DEFAULT_SHARES_PER_GPU: u32 = 100;
/// How long an answer about a pod is kept.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(10);
/// How long one lookup may take before it answers "not entitled".
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
    /// The API server's in-cluster configuration is missing or unusable.
    #[error("Kubernetes API server")]
    ApiServer(#[from] ApiServerError),
    /// An option is out of range.
    #[error("{0}")]
    Option(String),
    /// The lookup thread could not start.
    #[error("cannot start the Kubernetes lookup thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// How to reach the kubelet and the API server, and the lookup's knobs.
#[derive(Debug, Clone)]
pub struct KubernetesOptions {
    /// The kubelet's PodResources socket ([`podresources::DEFAULT_SOCKET`]).
    pub pod_resources_socket: PathBuf,
    /// The API server and the credentials to read pods with.
    pub api_server: ApiServerConfig,
    /// This node's name (`NODE_NAME`, from the downward API's `spec.nodeName`): when set,
    /// a pod the API server places on another node is refused even if the kubelet lists it.
    pub node_name: Option<String>,
    /// Shares per GPU, as the device plugin's `--shares-per-gpu`.
    pub shares_per_gpu: u32,
    /// How long an entitlement is kept before the kubelet and the API server are asked again.
    pub cache_ttl: Duration,
    /// The most one lookup may take.
    pub lookup_timeout: Duration,
    /// Whether a host process (no pod) of root is [`Verdict::Unrestricted`] rather than
    /// [`Verdict::NotEntitled`].
    pub trust_host_root: bool,
}

impl KubernetesOptions {
    /// The options of an arbiter running in its DaemonSet pod: the API server from
    /// `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` and the service account's files,
    /// `NODE_NAME` from the environment (optional), the kubelet at `pod_resources_socket`
    /// (`None`: [`podresources::DEFAULT_SOCKET`]), and the defaults.
    pub fn in_cluster(pod_resources_socket: Option<PathBuf>) -> Result<KubernetesOptions, KubernetesError> {
        let api_server = ApiServerConfig::in_cluster()?;
        let node_name = match std::env::var("NODE_NAME") {
            Ok(name) if name.trim().is_empty() => None,
            Ok(name) => Some(name.trim().to_owned()),
            Err(_) => None,
        };
        Ok(KubernetesOptions::new(
            pod_resources_socket.unwrap_or_else(|| PathBuf::from(podresources::DEFAULT_SOCKET)),
            api_server,
            node_name,
        ))
    }

    /// Options with the defaults for everything but where the kubelet and the API server are.
    pub fn new(
        pod_resources_socket: PathBuf,
        api_server: ApiServerConfig,
        node_name: Option<String>,
    ) -> KubernetesOptions {
        KubernetesOptions {
            pod_resources_socket,
            api_server,
            node_name,
            shares_per_gpu: DEFAULT_SHARES_PER_GPU,
            cache_ttl: DEFAULT_CACHE_TTL,
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            trust_host_root: true,
        }
    }
}

/// Entitlements from the kubelet and the API server (see the module's documentation).
pub struct KubernetesEntitlements {
    inner: Arc<Inner>,
    /// Its own small runtime, so that [`Entitlements::lookup`] works from any thread; taken
    /// on drop and shut down in the background (dropping a runtime in async code panics).
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for KubernetesEntitlements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesEntitlements")
            .field("pod_resources_socket", &self.inner.kubelet.socket())
            .field("api_server", &self.inner.api.base())
            .field("node_name", &self.inner.node_name)
            .finish_non_exhaustive()
    }
}

impl KubernetesEntitlements {
    /// Checks the options (the kubelet's socket must exist) and starts the lookup thread.
    pub fn new(options: KubernetesOptions) -> Result<KubernetesEntitlements, KubernetesError> {
        use std::os::unix::fs::FileTypeExt as _;
        let socket = &options.pod_resources_socket;
        match std::fs::metadata(socket) {
            Ok(meta) if meta.file_type().is_socket() => {}
            Ok(_) => {
                return Err(KubernetesError::Socket {
                    path: socket.clone(),
                    reason: "not a unix socket".into(),
                })
            }
            Err(e) => return Err(KubernetesError::Socket { path: socket.clone(), reason: e.to_string() }),
        }
        if options.shares_per_gpu == 0 {
            return Err(KubernetesError::Option("shares per GPU must be at least 1".into()));
        }
        if options.lookup_timeout.is_zero() {
            return Err(KubernetesError::Option("the lookup timeout must be above 0".into()));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpufrac-k8s")
            .enable_all()
            .build()
            .map_err(KubernetesError::Runtime)?;
        let inner = Inner {
            kubelet: PodResourcesClient::new(options.pod_resources_socket.clone(), RESOURCE),
            api: ApiServer::new(options.api_server),
            node_name: options.node_name,
            shares_per_gpu: options.shares_per_gpu,
            cache_ttl: options.cache_ttl,
            lookup_timeout: options.lookup_timeout,
            trust_host_root: options.trust_host_root,
            cache: Mutex::new(HashMap::new()),
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
                        "no answer from the kubelet and the API server ({}) within {timeout:?}",
                        inner.api.base()
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

/// An answer about one pod.
#[derive(Debug, Clone)]
struct Cached {
    at: Instant,
    pod: PodRecord,
    /// `None`: the kubelet does not run the pod.
    devices: Option<PodDevices>,
}

/// Why a lookup gives no entitlement.
#[derive(Debug, Clone, PartialEq)]
enum Failure {
    /// An answer: nothing for this container.
    No(String),
    /// The kubelet or the API server could not be asked: no answer ([`Verdict::Unknown`]).
    Unreachable(String),
}

/// Why a container gets nothing.
#[derive(Debug, Clone, PartialEq)]
enum Refusal {
    /// Its container ID is not in the pod's status: perhaps not reported yet, ask again.
    NotInStatus(String),
    /// Final.
    No(String),
}

struct Inner {
    kubelet: PodResourcesClient,
    api: ApiServer,
    node_name: Option<String>,
    shares_per_gpu: u32,
    cache_ttl: Duration,
    lookup_timeout: Duration,
    trust_host_root: bool,
    /// Pod UID → the last answer about it.
    cache: Mutex<HashMap<String, Cached>>,
}

/// First pause before asking the API server again about a container not yet in its pod's status.
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// The most GETs of pods in flight at once while looking for a pod UID.
const CONCURRENT_GETS: usize = 8;

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
                    Verdict::NotEntitled {
                        why: format!(
                            "uid {} runs outside any pod on a Kubernetes node: only pods given {RESOURCE} \
                             shares are entitled",
                            who.uid
                        ),
                    }
                };
            }
        };
        let deadline = Instant::now() + self.lookup_timeout;
        match self.resolve(container, deadline).await {
            Ok(entitlement) => Verdict::Entitled(entitlement),
            Err(Failure::No(why)) => Verdict::NotEntitled { why },
            Err(Failure::Unreachable(why)) => Verdict::Unknown { why },
        }
    }

    async fn resolve(&self, who: &ContainerRef, deadline: Instant) -> Result<Entitlement, Failure> {
        let uid = who.pod_uid.to_ascii_lowercase();
        if !is_uid(&uid) {
            return Err(Failure::No(format!("the cgroup's pod UID {} is not a UUID", cut(&who.pod_uid))));
        }
        let container_id = who.container_id.to_ascii_lowercase();
        if container_id.is_empty()
            || container_id.len() > 128
            || !container_id.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(Failure::No(format!(
                "the cgroup's container ID {} is not a container ID",
                cut(&who.container_id)
            )));
        }

        let known = self.cached(&uid);
        if let Some(entry) = known.as_ref().filter(|e| e.at.elapsed() < self.cache_ttl) {
            match self.decide(entry, &container_id) {
                Ok(entitlement) => return Ok(entitlement),
                Err(Refusal::No(why)) => return Err(Failure::No(why)),
                Err(Refusal::NotInStatus(_)) => {} // a newer status may have it
            }
        }
        // A pod seen before is asked about by name; the name must still have the same UID
        // (a StatefulSet pod is replaced under the same name).
        let mut entry = match &known {
            Some(old) => self
                .fetch(&old.pod.namespace, &old.pod.name)
                .await
                .map_err(Failure::Unreachable)?
                .filter(|e| e.pod.uid == uid),
            None => None,
        };
        if entry.is_none() {
            entry = Some(self.discover(&uid).await?);
        }
        let Some(mut entry) = entry else { return Err(Failure::No(format!("pod UID {uid}: not found"))) };
        let mut pause = FIRST_RETRY;
        loop {
            match self.decide(&entry, &container_id) {
                Ok(entitlement) => return Ok(entitlement),
                Err(Refusal::No(why)) => return Err(Failure::No(why)),
                Err(Refusal::NotInStatus(why)) => {
                    if Instant::now() + pause >= deadline {
                        return Err(Failure::No(why));
                    }
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    let (namespace, name) = (entry.pod.namespace.clone(), entry.pod.name.clone());
                    entry = match self.fetch(&namespace, &name).await.map_err(Failure::Unreachable)? {
                        Some(e) if e.pod.uid == uid => e,
                        _ => return Err(Failure::No(format!("pod {namespace}/{name} (UID {uid}) is gone"))),
                    };
                }
            }
        }
    }

    fn cached(&self, uid: &str) -> Option<Cached> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(uid).cloned()
    }

    /// Keeps an answer, and forgets answers long unused (a pod's UID is never reused).
    fn remember(&self, entry: &Cached) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let keep = (self.cache_ttl * 10).max(Duration::from_secs(60));
        cache.retain(|_, e| e.at.elapsed() < keep);
        cache.insert(entry.pod.uid.clone(), entry.clone());
    }

    /// Whether a fresh answer says `namespace/name` is a pod other than `uid`.
    fn known_other(&self, namespace: &str, name: &str, uid: &str) -> bool {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.values().any(|e| {
            e.at.elapsed() < self.cache_ttl
                && e.pod.namespace == namespace
                && e.pod.name == name
                && e.pod.uid != uid
        })
    }

    /// The pod `namespace/name` from the API server and its shares from the kubelet, asked
    /// at once; `None` when the API server has no such pod.
    async fn fetch(&self, namespace: &str, name: &str) -> Result<Option<Cached>, String> {
        let (pod, devices) = tokio::join!(self.api.pod(namespace, name), self.kubelet.pod(namespace, name));
        let Some(pod) = pod.map_err(|e| format!("cannot read pod {namespace}/{name}: {e}"))? else {
            return Ok(None);
        };
        let devices = devices.map_err(|e| e.to_string())?;
        let entry = Cached { at: Instant::now(), pod, devices };
        self.remember(&entry);
        Ok(Some(entry))
    }

    /// The pod with `uid` among the pods the kubelet gave shares: each is read from the API
    /// server (up to [`CONCURRENT_GETS`] at once), skipping those known to be other pods.
    async fn discover(&self, uid: &str) -> Result<Cached, Failure> {
        let pods = self.kubelet.list().await.map_err(|e| Failure::Unreachable(e.to_string()))?;
        let candidates: Vec<PodDevices> =
            pods.into_iter().filter(|p| !self.known_other(&p.namespace, &p.name, uid)).collect();
        let limit = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_GETS));
        let mut tasks = tokio::task::JoinSet::new();
        for devices in candidates {
            let api = self.api.clone();
            let limit = limit.clone();
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let pod = api.pod(&devices.namespace, &devices.name).await;
                (devices, pod)
            });
        }
        let mut found = None;
        let mut failures = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let Ok((devices, pod)) = done else { continue };
            match pod {
                Ok(Some(pod)) => {
                    let entry = Cached { at: Instant::now(), pod, devices: Some(devices) };
                    self.remember(&entry);
                    if entry.pod.uid == uid {
                        found = Some(entry);
                    }
                }
                Ok(None) => {} // deleted since the kubelet listed it
                Err(e) => failures.push(e),
            }
        }
        match (found, failures.first()) {
            (Some(entry), _) => Ok(entry),
            (None, None) => Err(Failure::No(format!(
                "pod UID {uid}: no pod the kubelet gave {RESOURCE} shares on this node has this UID \
                 (a pod without shares, or a pod of another node)"
            ))),
            // Perhaps one of those: not a verdict.
            (None, Some(first)) => Err(Failure::Unreachable(format!(
                "pod UID {uid}: not found among the pods with {RESOURCE} shares on this node; {} of them \
                 could not be read: {first}",
                failures.len()
            ))),
        }
    }

    fn decide(&self, entry: &Cached, container_id: &str) -> Result<Entitlement, Refusal> {
        decide(entry, container_id, self.node_name.as_deref(), self.shares_per_gpu)
    }
}

/// What the container with `container_id` of the pod in `entry` may have.
fn decide(
    entry: &Cached,
    container_id: &str,
    node_name: Option<&str>,
    shares_per_gpu: u32,
) -> Result<Entitlement, Refusal> {
    let pod = &entry.pod;
    let at = format!("pod {}/{}", pod.namespace, pod.name);
    if let (Some(here), Some(there)) = (node_name, pod.node_name.as_deref()) {
        if here != there {
            return Err(Refusal::No(format!("{at} runs on node {there}, not on this node ({here})")));
        }
    }
    let Some(status) = pod.statuses.iter().find(|s| s.container_id.as_deref() == Some(container_id)) else {
        return Err(Refusal::NotInStatus(format!(
            "container {} is not (yet) one of {at}'s containers: no status.containerStatuses entry has \
             this containerID",
            short_id(container_id)
        )));
    };
    let container = &status.name;
    let Some(devices) = &entry.devices else {
        return Err(Refusal::No(format!("the kubelet of this node does not run {at}")));
    };
    let Some(ids) = devices.containers.get(container) else {
        return Err(Refusal::No(format!("container {container} of {at} was allocated no {RESOURCE} shares")));
    };
    let (uuid, shares) = shares_of(ids, shares_per_gpu)
        .map_err(|why| Refusal::No(format!("container {container} of {at}: kubelet PodResources: {why}")))?;
    let request = f64::from(shares) / f64::from(shares_per_gpu);

    // The annotations are checked whichever container asks: a bad one is the pod's mistake.
    let limit = match pod.annotations.get(FRACTION_LIMIT) {
        None => None,
        Some(text) => Some(parse_fraction(text).ok_or_else(|| {
            Refusal::No(format!(
                "{at}: annotation {FRACTION_LIMIT}={}: expected a fraction 0 < f <= 1",
                shown(text)
            ))
        })?),
    };
    let resolver = match pod.annotations.get(RESOLVER) {
        None => Resolver::Wait,
        Some(text) => text
            .parse::<Resolver>()
            .map_err(|e| Refusal::No(format!("{at}: annotation {RESOLVER}={}: {e}", shown(text))))?,
    };
    // The webhook gives the annotations to one container; another with shares (asked for
    // with gpufrac.io/gpu directly) gets its request as its limit, and `wait`.
    let target = pod.annotations.get(CONTAINER).or_else(|| pod.containers.first());
    let (limit, resolver) = match target == Some(container) {
        // The webhook raises a limit below the whole shares granted to them (0.333 → 0.34).
        true => (limit.unwrap_or(request).max(request), resolver),
        false => (request, Resolver::Wait),
    };
    Ok(Entitlement {
        source: format!("kubelet: {}/{} container {container}", pod.namespace, pod.name),
        devices: Some(vec![uuid]),
        max_request: Amount::Fraction(request),
        max_limit: Amount::Fraction(limit),
        max_priority: pod.priority,
        resolver: Some(resolver),
        group: Some(group_name(&pod.uid, container)),
    })
}

/// The GPU and the number of shares in a container's device IDs (`<GPU UUID>::<n>`), which
/// must all be on one GPU.
pub fn shares_of(ids: &[String], shares_per_gpu: u32) -> Result<([u8; 16], u32), String> {
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
    let mut iter = gpus.iter();
    match (iter.next(), iter.next()) {
        (Some((uuid, shares)), None) => {
            let count = u32::try_from(shares.len()).unwrap_or(u32::MAX);
            Ok((*uuid, count))
        }
        (None, _) => Err("no device IDs".into()),
        (Some(_), Some(_)) => {
            let names: Vec<String> = gpus.keys().map(gpufrac_common::gpu_uuid::format).collect();
            Err(format!(
                "shares on {} GPUs ({}): gpufrac gives a container a fraction of one GPU",
                names.len(),
                names.join(", ")
            ))
        }
    }
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
mod tests {
    use super::apiserver::ContainerStatus;
    use super::*;

    const UID: &str = "0f3c2a4e-1111-2222-3333-444455556666";
    const GPU: &str = "GPU-516d6770-7500-0000-0000-000000000003";

    fn entry(annotations: &[(&str, &str)], ids: &[&str]) -> Cached {
        let pod = PodRecord {
            namespace: "ns".into(),
            name: "p".into(),
            uid: UID.into(),
            node_name: Some("n1".into()),
            priority: 7,
            containers: vec!["main".into(), "side".into()],
            statuses: vec![
                ContainerStatus { name: "main".into(), container_id: Some("aa11".into()) },
                ContainerStatus { name: "side".into(), container_id: Some("bb22".into()) },
            ],
            annotations: annotations.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        };
        let mut containers = BTreeMap::new();
        containers.insert("main".to_owned(), ids.iter().map(|s| (*s).to_owned()).collect());
        containers.insert("side".to_owned(), vec![format!("{GPU}::90")]);
        Cached {
            at: Instant::now(),
            pod,
            devices: Some(PodDevices { namespace: "ns".into(), name: "p".into(), containers }),
        }
    }

    fn ids(n: u32) -> Vec<String> {
        (0..n).map(|i| format!("{GPU}::{i}")).collect()
    }

    #[test]
    fn shares_become_a_fraction_of_their_gpu() {
        let ids = ids(25);
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let e =
            decide(&entry(&[(FRACTION_LIMIT, "0.5"), (RESOLVER, "swap")], &refs), "aa11", Some("n1"), 100)
                .expect("entitled");
        assert_eq!(e.max_request, Amount::Fraction(0.25));
        assert_eq!(e.max_limit, Amount::Fraction(0.5));
        assert_eq!(e.resolver, Some(Resolver::Swap));
        assert_eq!(e.max_priority, 7);
        assert_eq!(e.devices, gpufrac_common::gpu_uuid::parse(GPU).map(|u| vec![u]));
        assert_eq!(e.group.as_deref(), Some("k8s-0f3c2a4e-1111-2222-3333-444455556666-main"));
        assert_eq!(e.source, "kubelet: ns/p container main");
        // The other container with shares: its request, no burst, wait.
        let e = decide(&entry(&[(FRACTION_LIMIT, "0.5"), (RESOLVER, "swap")], &refs), "bb22", None, 100)
            .expect("entitled");
        assert_eq!(e.max_request, Amount::Fraction(0.01));
        assert_eq!(e.max_limit, Amount::Fraction(0.01));
        assert_eq!(e.resolver, Some(Resolver::Wait));
    }

    #[test]
    fn a_limit_below_the_granted_shares_is_raised() {
        let ids = ids(34);
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let e = decide(&entry(&[(FRACTION_LIMIT, "0.333")], &refs), "aa11", None, 100).expect("entitled");
        assert_eq!(e.max_limit, Amount::Fraction(0.34));
    }

    #[test]
    fn refusals_name_the_cause() {
        let ids = ids(10);
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let no = |r: Result<Entitlement, Refusal>| match r {
            Err(Refusal::No(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let why = no(decide(&entry(&[(FRACTION_LIMIT, "25%")], &refs), "aa11", None, 100));
        assert!(why.contains("gpufrac.io/gpu-fraction-limit=\"25%\""), "{why}");
        let why = no(decide(&entry(&[(RESOLVER, "fastest")], &refs), "aa11", None, 100));
        assert!(why.contains("gpufrac.io/resolver=\"fastest\""), "{why}");
        let why = no(decide(&entry(&[], &refs), "aa11", Some("n2"), 100));
        assert!(why.contains("runs on node n1"), "{why}");
        let why = no(decide(&entry(&[], &["GPU-x::1"]), "aa11", None, 100));
        assert!(why.contains("device ID \"GPU-x::1\""), "{why}");
        let other = "GPU-516d6770-7500-0000-0000-000000000004::1";
        let why = no(decide(&entry(&[], &[refs[0], other]), "aa11", None, 100));
        assert!(why.contains("shares on 2 GPUs"), "{why}");
        let mut e = entry(&[], &refs);
        e.devices.as_mut().map(|d| d.containers.remove("main"));
        let why = no(decide(&e, "aa11", None, 100));
        assert!(why.contains("allocated no gpufrac.io/gpu shares"), "{why}");
        assert!(matches!(decide(&entry(&[], &refs), "cc33", None, 100), Err(Refusal::NotInStatus(_))));
    }

    #[test]
    fn share_ids_are_checked() {
        assert_eq!(shares_of(&ids(3), 100).map(|(_, n)| n), Ok(3));
        // Duplicates count once.
        let mut dup = ids(3);
        dup.push(dup[0].clone());
        assert_eq!(shares_of(&dup, 100).map(|(_, n)| n), Ok(3));
        assert!(shares_of(&[format!("{GPU}::100")], 100).is_err());
        assert!(shares_of(&[format!("{GPU}:1")], 100).is_err());
        assert!(shares_of(&[], 100).is_err());
    }

    #[test]
    fn fractions() {
        assert_eq!(parse_fraction("0.5"), Some(0.5));
        assert_eq!(parse_fraction(".25"), Some(0.25));
        assert_eq!(parse_fraction("1"), Some(1.0));
        for bad in ["", ".", "0", "1.5", "-0.5", "1e-1", "NaN", "inf", "25%", "0.2.5", "0x1"] {
            assert_eq!(parse_fraction(bad), None, "{bad}");
        }
    }

    #[test]
    fn groups_fit_the_arbiter() {
        let ok = |g: &str| {
            g.len() <= MAX_GROUP
                && g.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        let long = "c".repeat(63);
        let a = group_name(UID, &long);
        let b = group_name(UID, &format!("{}d", "c".repeat(62)));
        assert!(ok(&a) && ok(&b), "{a} {b}");
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("k8s-{UID}-cccccc-")), "{a}");
        assert_eq!(group_name(UID, &long), a, "stable");
        let odd = group_name(UID, "a/b");
        assert!(ok(&odd), "{odd}");
    }
}
