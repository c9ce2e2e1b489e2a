//! Kubernetes entitlements against stand-ins: a kubelet serving the official
//! `podresources/v1` API (tonic, on a unix socket in a temporary folder) and an API server
//! (hyper, plain HTTP or HTTPS with an rcgen CA) answering what kube-rs's reflector asks:
//! the list of this node's pods (`GET /api/v1/pods?fieldSelector=spec.nodeName=...`) and
//! the watch after it (newline-delimited `ADDED`/`MODIFIED`/`DELETED` events, pushed as a
//! test changes a pod), from real `kubectl get pod -o json` output in
//! `tests/fixtures/pod-*.json`. kube-rs is configured from a kubeconfig file the test
//! writes. Lookups are made as the arbiter makes them: from a plain thread, blocking.
//! The DRA source is tested here too, with checkpoints written as the DRA kubelet plugin
//! writes them.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt as _;
use gpufrac_common::compute::{ComputeShare, ComputeSpec};
use gpufrac_common::dra::{Checkpoint, PreparedClaim, PreparedDevice};
use gpufrac_common::resolver::Resolver;
use gpufrac_daemon::entitlement::kubernetes::api::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpufrac_daemon::entitlement::kubernetes::api::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use gpufrac_daemon::entitlement::kubernetes::{KubernetesEntitlements, KubernetesError, KubernetesOptions};
use gpufrac_daemon::entitlement::{
    Amount, Cgroup, ContainerRef, DeviceCaps, Entitlement, Entitlements, Identity, Verdict,
};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::net::{TcpListener, UnixListener};
use tokio::runtime::Runtime;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{BroadcastStream, UnixListenerStream};
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

const GPU_A: &str = "GPU-516d6770-7500-0000-0000-00000000000a";
const GPU_B: &str = "GPU-516d6770-7500-0000-0000-00000000000b";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.test-token";
const NODE: &str = "gpu-node-3";

const INFERENCE_UID: &str = "7c1e4b2a-93d5-4f08-b6a1-5e2d8c9f0a17";
const SERVER_ID: &str = "e3a1c5d7b9f2046813579bdf02468ace13579bdf02468ace13579bdf02468ace";
const METRICS_ID: &str = "5b0ffa1c0f4c2e1c9d3e7a8b6f5d4c3b2a1908f7e6d5c4b3a29180f7e6d5c4b3";
const DIRECT_UID: &str = "a4f0d2c6-18b3-4e7d-8c59-0b6e3f1a2d94";
const NEW_UID: &str = "c0ffee00-18b3-4e7d-8c59-0b6e3f1a2d94";
const WORKER_ID: &str = "8d4c2b0a9f8e7d6c5b4a39281706f5e4d3c2b1a0918273645f4e3d2c1b0a9f8e";

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("fixture JSON")
}

/// How the kubelet stand-in answers `Get`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GetMode {
    Serve,
    /// A kubelet before 1.27.
    Unimplemented,
    /// The `KubeletPodResourcesGet` gate off.
    Disabled,
}

#[derive(Clone)]
struct Kubelet {
    pods: Arc<Mutex<Vec<PodResources>>>,
    get_mode: Arc<Mutex<GetMode>>,
    lists: Arc<AtomicUsize>,
    gets: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: GrpcRequest<ListPodResourcesRequest>,
    ) -> Result<GrpcResponse<ListPodResourcesResponse>, Status> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        let pods = self.pods.lock().expect("lock").clone();
        Ok(GrpcResponse::new(ListPodResourcesResponse { pod_resources: pods }))
    }

    async fn get_allocatable_resources(
        &self,
        _: GrpcRequest<AllocatableResourcesRequest>,
    ) -> Result<GrpcResponse<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the stand-in"))
    }

    async fn get(
        &self,
        request: GrpcRequest<GetPodResourcesRequest>,
    ) -> Result<GrpcResponse<GetPodResourcesResponse>, Status> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        // As the kubelet answers (pkg/kubelet/apis/podresources/server_v1.go).
        match *self.get_mode.lock().expect("lock") {
            GetMode::Unimplemented => {
                return Err(Status::unimplemented("unknown method Get for service v1.PodResourcesLister"))
            }
            GetMode::Disabled => return Err(Status::unknown("PodResources API Get method disabled")),
            GetMode::Serve => {}
        }
        let r = request.into_inner();
        let pods = self.pods.lock().expect("lock");
        match pods.iter().find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace) {
            Some(pod) => Ok(GrpcResponse::new(GetPodResourcesResponse { pod_resources: Some(pod.clone()) })),
            None => {
                Err(Status::unknown(format!("pod {} in namespace {} not found", r.pod_name, r.pod_namespace)))
            }
        }
    }
}

fn pod_resources(
    namespace: &str,
    name: &str,
    containers: &[(&str, &str, std::ops::Range<u32>)],
) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: containers
            .iter()
            .map(|(container, gpu, shares)| ContainerResources {
                name: (*container).into(),
                devices: vec![
                    ContainerDevices {
                        resource_name: "gpufrac.io/gpu".into(),
                        device_ids: shares.clone().map(|n| format!("{gpu}::{n}")).collect(),
                        topology: None,
                    },
                    // Other resources are listed too; they are not ours.
                    ContainerDevices {
                        resource_name: "example.com/nic".into(),
                        device_ids: vec!["nic0".into()],
                        topology: None,
                    },
                ],
                ..Default::default()
            })
            .collect(),
    }
}

/// One change of a pod in the API server stand-in: its resourceVersion, the pod before
/// (`None`: created) and after (`None`: deleted).
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    old: Option<Value>,
    new: Option<Value>,
}

#[derive(Default)]
struct PodState {
    rv: u64,
    by_name: HashMap<(String, String), Value>,
    log: Vec<Change>,
}

/// What the API server stand-in serves, and what it was asked.
#[derive(Clone)]
struct Pods {
    state: Arc<Mutex<PodState>>,
    changes: broadcast::Sender<Change>,
    requests: Arc<AtomicUsize>,
    lists: Arc<AtomicUsize>,
    watches: Arc<AtomicUsize>,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

impl Pods {
    fn new() -> Pods {
        Pods {
            state: Arc::default(),
            changes: broadcast::channel(1024).0,
            requests: Arc::default(),
            lists: Arc::default(),
            watches: Arc::default(),
        }
    }

    /// Creates or replaces a pod (a new resourceVersion), telling the watches.
    fn put(&self, mut pod: Value) {
        let ns = pod["metadata"]["namespace"].as_str().expect("namespace").to_owned();
        let name = pod["metadata"]["name"].as_str().expect("name").to_owned();
        let mut state = self.state.lock().expect("lock");
        state.rv += 1;
        pod["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        let old = state.by_name.insert((ns, name), pod.clone());
        let change = Change { rv: state.rv, old, new: Some(pod) };
        state.log.push(change.clone());
        let _ = self.changes.send(change);
    }

    /// Deletes a pod, telling the watches.
    fn delete(&self, namespace: &str, name: &str) {
        let mut state = self.state.lock().expect("lock");
        state.rv += 1;
        let Some(mut old) = state.by_name.remove(&(namespace.to_owned(), name.to_owned())) else { return };
        old["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        let change = Change { rv: state.rv, old: Some(old), new: None };
        state.log.push(change.clone());
        let _ = self.changes.send(change);
    }

    fn answer(&self, request: &Request<hyper::body::Incoming>) -> Response<Body> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let auth = request.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if auth != Some(&format!("Bearer {TOKEN}")) {
            return json_answer(StatusCode::UNAUTHORIZED, status_object(401, "Unauthorized"));
        }
        if request.uri().path() != "/api/v1/pods" {
            return json_answer(
                StatusCode::NOT_FOUND,
                status_object(404, "the server could not find the requested resource"),
            );
        }
        let query = query(request.uri().query().unwrap_or_default());
        let node = match query.get("fieldSelector") {
            None => None,
            Some(selector) => match selector.strip_prefix("spec.nodeName=") {
                Some(node) => Some(node.to_owned()),
                None => {
                    return json_answer(
                        StatusCode::BAD_REQUEST,
                        status_object(
                            400,
                            &format!("field selector {selector:?} not served by the stand-in"),
                        ),
                    )
                }
            },
        };
        if query.get("watch").map(String::as_str) == Some("true") {
            self.watches.fetch_add(1, Ordering::SeqCst);
            let since: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
            // Subscribed under the lock that orders changes: nothing is missed or sent twice.
            let state = self.state.lock().expect("lock");
            let live = BroadcastStream::new(self.changes.subscribe()).filter_map(|c| async move { c.ok() });
            let backlog: Vec<Change> = state.log.iter().filter(|c| c.rv > since).cloned().collect();
            drop(state);
            let events = futures::stream::iter(backlog).chain(live).filter_map(move |change| {
                let event = (change.rv > since).then(|| watch_event(&change, node.as_deref())).flatten();
                async move {
                    event.map(|event| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{event}\n")))))
                }
            });
            let mut response = Response::new(StreamBody::new(events).boxed_unsync());
            response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
            return response;
        }
        self.lists.fetch_add(1, Ordering::SeqCst);
        let state = self.state.lock().expect("lock");
        let items: Vec<Value> =
            state.by_name.values().filter(|pod| on(pod, node.as_deref())).cloned().collect();
        json_answer(
            StatusCode::OK,
            json!({"kind": "PodList", "apiVersion": "v1",
                   "metadata": {"resourceVersion": state.rv.to_string()}, "items": items}),
        )
    }
}

/// Whether `pod` is selected by the node selector.
fn on(pod: &Value, node: Option<&str>) -> bool {
    node.is_none_or(|node| pod["spec"]["nodeName"] == node)
}

/// The watch event a change is for a watch of `node`'s pods, if any: a pod that leaves
/// the selection is `DELETED` from it, as the API server says.
fn watch_event(change: &Change, node: Option<&str>) -> Option<Value> {
    let was = change.old.as_ref().is_some_and(|pod| on(pod, node));
    match &change.new {
        Some(pod) if on(pod, node) => {
            Some(json!({"type": if was { "MODIFIED" } else { "ADDED" }, "object": pod}))
        }
        _ if was => {
            let mut pod = change.new.clone().or_else(|| change.old.clone())?;
            pod["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            Some(json!({"type": "DELETED", "object": pod}))
        }
        _ => None,
    }
}

/// A URL query, percent-decoded.
fn query(text: &str) -> HashMap<String, String> {
    let decode = |s: &str| {
        let bytes = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'%' if i + 2 < bytes.len() => {
                    let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                    match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                        Some(b) => out.push(b),
                        None => out.extend_from_slice(&bytes[i..i + 3]),
                    }
                    i += 3;
                }
                b'+' => {
                    out.push(b' ');
                    i += 1;
                }
                b => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    text.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn json_answer(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .expect("response")
}

fn status_object(code: u16, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "code": code})
}

/// The stand-ins, the temporary folder and the runtime they run on.
struct Cluster {
    rt: Runtime,
    dir: TempDir,
    kubelet: Kubelet,
    socket: PathBuf,
    pods: Pods,
    api_addr: SocketAddr,
    api_task: JoinHandle<()>,
}

impl Cluster {
    fn start() -> Cluster {
        let rt = Runtime::new().expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("kubelet.sock");
        let kubelet = Kubelet {
            pods: Arc::default(),
            get_mode: Arc::new(Mutex::new(GetMode::Serve)),
            lists: Arc::default(),
            gets: Arc::default(),
        };
        let _guard = rt.enter();
        let listener = UnixListener::bind(&socket).expect("bind the kubelet socket");
        let service = PodResourcesListerServer::new(kubelet.clone());
        rt.spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        let pods = Pods::new();
        let (api_addr, api_task) = rt.block_on(serve_api(pods.clone(), None));
        Cluster { rt, dir, kubelet, socket, pods, api_addr, api_task }
    }

    /// The inference pod (annotations, priority 1000; `server` holds 25 shares of GPU A,
    /// `metrics` none) and a direct pod (`worker` holds 50 shares of GPU B).
    fn with_fixtures() -> Cluster {
        let cluster = Cluster::start();
        cluster.pods.put(fixture("pod-inference.json"));
        cluster.pods.put(fixture("pod-direct.json"));
        *cluster.kubelet.pods.lock().expect("lock") = vec![
            pod_resources("inference", "vllm-small-6d8f7c9b54-x7k2p", &[("server", GPU_A, 0..25)]),
            pod_resources("research", "batch-embed-0", &[("worker", GPU_B, 10..60)]),
        ];
        cluster
    }

    /// kube-rs's configuration from a kubeconfig file naming `server` (with `ca_pem`, the
    /// CA to trust for HTTPS) and `token`, as an admin would write one.
    fn kube_config(&self, server: &str, ca_pem: Option<&str>, token: &str) -> kube::Config {
        let ca = ca_pem
            .map(|pem| {
                format!(
                    "\n    certificate-authority-data: {}",
                    base64::engine::general_purpose::STANDARD.encode(pem)
                )
            })
            .unwrap_or_default();
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}{ca}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: {token}\n"
        );
        let path = self.dir.path().join(format!("kubeconfig-{}", KUBECONFIGS.fetch_add(1, Ordering::SeqCst)));
        std::fs::write(&path, text).expect("write the kubeconfig");
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).expect("a kubeconfig");
        self.rt
            .block_on(kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            ))
            .expect("a kube config")
    }

    fn options(&self) -> KubernetesOptions {
        let config = self.kube_config(&format!("http://127.0.0.1:{}", self.api_addr.port()), None, TOKEN);
        let mut options = KubernetesOptions::new(config, NODE, Some(self.socket.clone()));
        options.lookup_timeout = Duration::from_millis(600);
        options
    }

    fn entitlements(&self) -> KubernetesEntitlements {
        KubernetesEntitlements::new(self.options()).expect("new")
    }

    fn stop_api_server(&self) {
        self.api_task.abort();
        // Wait until the listener is closed, so the next connection is refused.
        let addr = self.api_addr;
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(addr).is_ok() {
            assert!(Instant::now() < deadline, "the API server stand-in did not stop");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

static KUBECONFIGS: AtomicUsize = AtomicUsize::new(0);

/// Serves `pods` on 127.0.0.1 (HTTPS when `tls` is given) until aborted; aborting it ends
/// its connections (and so the watches) too.
async fn serve_api(pods: Pods, tls: Option<Arc<rustls::ServerConfig>>) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let pods = pods.clone();
            let tls = tls.clone();
            connections.spawn(async move {
                let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let response = pods.answer(&request);
                    async move { Ok::<_, Infallible>(response) }
                });
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    None => {
                        let _ = http.serve_connection(TokioIo::new(tcp), service).await;
                    }
                    Some(tls) => {
                        let Ok(stream) = tokio_rustls::TlsAcceptor::from(tls).accept(tcp).await else {
                            return;
                        };
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                }
            });
        }
    });
    (addr, task)
}

fn process(pod_uid: &str, container_id: &str) -> Identity {
    Identity {
        pid: 4242,
        uid: 1000,
        gid: 1000,
        cgroup: Cgroup::Container(ContainerRef {
            pod_uid: pod_uid.into(),
            container_id: container_id.into(),
        }),
    }
}

fn entitled(verdict: Verdict) -> Entitlement {
    match verdict {
        Verdict::Entitled(e) => e,
        other => panic!("expected Entitled, got {other:?}"),
    }
}

fn refused(verdict: Verdict) -> String {
    match verdict {
        Verdict::NotEntitled { why } => why,
        other => panic!("expected NotEntitled, got {other:?}"),
    }
}

/// The lookup failed: no verdict (the arbiter asks again, never caches it).
fn unknown(verdict: Verdict) -> String {
    match verdict {
        Verdict::Unknown { why } => why,
        other => panic!("expected Unknown, got {other:?}"),
    }
}

fn compute(request: u16, limit: u16) -> ComputeSpec {
    ComputeSpec {
        request: ComputeShare::from_per_mille(request).expect("a share"),
        limit: ComputeShare::from_per_mille(limit).expect("a share"),
    }
}

fn uuid(text: &str) -> [u8; 16] {
    gpufrac_common::gpu_uuid::parse(text).expect("a GPU UUID")
}

/// Looks up `who` until `done` holds of the verdict (a change the watch has yet to
/// deliver), for at most 5 s; the last verdict.
fn eventually(k8s: &KubernetesEntitlements, who: &Identity, done: impl Fn(&Verdict) -> bool) -> Verdict {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let verdict = k8s.lookup(who);
        if done(&verdict) || Instant::now() > deadline {
            return verdict;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn shares_are_a_fraction_of_the_right_gpu_and_the_rest_comes_from_the_pod() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();

    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(gpus(&e), Some(vec![uuid(GPU_A)]));
    assert_eq!(e.max_request, Amount::Fraction(0.25));
    assert_eq!(e.max_limit, Amount::Fraction(0.5)); // gpufrac.io/gpu-fraction-limit
    assert_eq!(e.max_priority, 1000); // spec.priority
    assert_eq!(e.resolver, Some(Resolver::Priority)); // gpufrac.io/resolver
    assert_eq!(e.group.as_deref(), Some(format!("k8s-{INFERENCE_UID}-server").as_str()));
    assert_eq!(e.source, "kubelet: inference/vllm-small-6d8f7c9b54-x7k2p container server");
    // No compute annotation: no compute request vouched (a declared limit is believed).
    assert_eq!(e.max_compute, Some(compute(0, 1000)));

    // The direct pod's container sets GPUFRAC_PRIORITY=1000000 and GPUFRAC_RESOLVER=priority
    // in its env: neither counts. No annotations: limit = request, wait, spec.priority 0.
    // Upper-case IDs from a cgroup are the same IDs.
    let e = entitled(k8s.lookup(&process(&DIRECT_UID.to_uppercase(), &WORKER_ID.to_uppercase())));
    assert_eq!(gpus(&e), Some(vec![uuid(GPU_B)]));
    assert_eq!(e.max_request, Amount::Fraction(0.5));
    assert_eq!(e.max_limit, Amount::Fraction(0.5));
    assert_eq!(e.max_priority, 0);
    assert_eq!(e.resolver, Some(Resolver::Wait));
    assert_eq!(e.group.as_deref(), Some(format!("k8s-{DIRECT_UID}-worker").as_str()));
}

/// The GPUs an entitlement names, without what it may have on each.
fn gpus(e: &Entitlement) -> Option<Vec<[u8; 16]>> {
    e.devices.as_ref().map(|devices| devices.keys().copied().collect())
}

#[test]
fn shares_on_two_gpus_are_a_fraction_of_each() {
    let cluster = Cluster::with_fixtures();
    // The kubelet lists the container's shares of one resource together, whatever the GPU.
    {
        let mut pods = cluster.kubelet.pods.lock().expect("lock");
        let direct = pods.iter_mut().find(|p| p.name == "batch-embed-0").expect("the direct pod");
        let ids = &mut direct.containers[0].devices[0].device_ids;
        ids.extend((0..75).map(|n| format!("{GPU_A}::{n}")));
    }
    let k8s = cluster.entitlements();
    let e = entitled(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    let caps = |f| DeviceCaps { max_request: Amount::Fraction(f), max_limit: Amount::Fraction(f) };
    let want = [(uuid(GPU_A), caps(0.75)), (uuid(GPU_B), caps(0.5))];
    assert_eq!(e.devices, Some(want.into_iter().collect()), "each GPU its own shares");
    assert_eq!(e.group.as_deref(), Some(format!("k8s-{DIRECT_UID}-worker").as_str()), "one group");
}

#[test]
fn lookups_read_the_local_store_not_the_api_server() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    let asked = cluster.pods.requests.load(Ordering::SeqCst);
    for _ in 0..20 {
        entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
        entitled(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    }
    assert_eq!(cluster.pods.requests.load(Ordering::SeqCst), asked, "no request per lookup");
    // One list and one watch, of this node's pods only.
    assert_eq!(cluster.pods.lists.load(Ordering::SeqCst), 1);
    assert_eq!(cluster.pods.watches.load(Ordering::SeqCst), 1);
}

#[test]
fn a_container_without_shares_is_not_entitled() {
    let cluster = Cluster::with_fixtures();
    // A pod the kubelet gave no shares at all.
    cluster.kubelet.pods.lock().expect("lock").retain(|p| p.name != "batch-embed-0");
    let k8s = cluster.entitlements();
    let why = refused(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    assert!(
        why.contains(
            "the kubelet of this node lists no gpufrac.io/gpu shares for pod research/batch-embed-0"
        ),
        "{why}"
    );
    // The sidecar of a pod with shares.
    let why = refused(k8s.lookup(&process(INFERENCE_UID, METRICS_ID)));
    assert!(
        why.contains(
            "container metrics of pod inference/vllm-small-6d8f7c9b54-x7k2p was allocated no gpufrac.io/gpu shares"
        ),
        "{why}"
    );
}

#[test]
fn a_pod_of_another_node_is_not_seen_nor_entitled() {
    let cluster = Cluster::with_fixtures();
    // A pod of another node whose name the kubelet of this node lists too.
    let mut elsewhere = fixture("pod-direct.json");
    elsewhere["metadata"]["name"] = json!("batch-embed-1");
    elsewhere["metadata"]["uid"] = json!(NEW_UID);
    elsewhere["spec"]["nodeName"] = json!("gpu-node-9");
    cluster.pods.put(elsewhere);
    cluster.kubelet.pods.lock().expect("lock").push(pod_resources(
        "research",
        "batch-embed-1",
        &[("worker", GPU_B, 60..70)],
    ));
    let k8s = cluster.entitlements();
    let why = refused(k8s.lookup(&process(NEW_UID, WORKER_ID)));
    assert!(why.contains(&format!("pod UID {NEW_UID}: no pod of node {NODE} has this UID")), "{why}");
    // A pod that moves to another node leaves this node's store.
    entitled(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    let mut moved = fixture("pod-direct.json");
    moved["spec"]["nodeName"] = json!("gpu-node-9");
    cluster.pods.put(moved);
    let verdict =
        eventually(&k8s, &process(DIRECT_UID, WORKER_ID), |v| matches!(v, Verdict::NotEntitled { .. }));
    assert!(refused(verdict).contains("no pod of node gpu-node-3 has this UID"));
    // So does a deleted pod.
    cluster.pods.delete("inference", "vllm-small-6d8f7c9b54-x7k2p");
    let verdict =
        eventually(&k8s, &process(INFERENCE_UID, SERVER_ID), |v| matches!(v, Verdict::NotEntitled { .. }));
    assert!(refused(verdict).contains(INFERENCE_UID));
    // Nonsense from a cgroup is refused before anyone is asked.
    let why = refused(k8s.lookup(&process("../../etc", SERVER_ID)));
    assert!(why.contains("is not a UUID"), "{why}");
}

#[test]
fn a_new_pod_is_waited_for_until_the_watch_delivers_it() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    // The kubelet runs it already; its watch event comes a moment later.
    cluster.kubelet.pods.lock().expect("lock").push(pod_resources(
        "research",
        "batch-embed-1",
        &[("worker", GPU_B, 60..70)],
    ));
    let pods = cluster.pods.clone();
    cluster.rt.spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut new_pod = fixture("pod-direct.json");
        new_pod["metadata"]["name"] = json!("batch-embed-1");
        new_pod["metadata"]["uid"] = json!(NEW_UID);
        pods.put(new_pod);
    });
    let e = entitled(k8s.lookup(&process(NEW_UID, WORKER_ID)));
    assert_eq!(e.max_request, Amount::Fraction(0.1));
}

#[test]
fn compute_annotations_are_the_most_compute_share_believed() {
    let cluster = Cluster::with_fixtures();
    let mut pod = fixture("pod-inference.json");
    pod["metadata"]["annotations"]["gpufrac.io/compute-fraction"] = json!("30%");
    pod["metadata"]["annotations"]["gpufrac.io/compute-fraction-limit"] = json!("0.8");
    cluster.pods.put(pod);
    let k8s = cluster.entitlements();
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_compute, Some(compute(300, 800)));

    // A bad one is the pod's mistake: refused, naming it.
    let mut pod = fixture("pod-inference.json");
    pod["metadata"]["annotations"]["gpufrac.io/compute-fraction"] = json!("300%");
    cluster.pods.put(pod);
    let verdict =
        eventually(&k8s, &process(INFERENCE_UID, SERVER_ID), |v| matches!(v, Verdict::NotEntitled { .. }));
    let why = refused(verdict);
    assert!(
        why.contains("annotation gpufrac.io/compute-fraction=\"300%\": a share is at most one whole GPU"),
        "{why}"
    );
}

#[test]
fn a_bad_annotation_is_named() {
    let cluster = Cluster::with_fixtures();
    let mut pod = fixture("pod-inference.json");
    pod["metadata"]["annotations"]["gpufrac.io/gpu-fraction-limit"] = json!("2");
    cluster.pods.put(pod);
    let k8s = cluster.entitlements();
    let why = refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(
        why.contains("annotation gpufrac.io/gpu-fraction-limit=\"2\": expected a fraction 0 < f <= 1"),
        "{why}"
    );

    let mut pod = fixture("pod-inference.json");
    pod["metadata"]["annotations"]["gpufrac.io/resolver"] = json!("preempt");
    cluster.pods.put(pod);
    let verdict = eventually(&k8s, &process(INFERENCE_UID, SERVER_ID), |v| match v {
        Verdict::NotEntitled { why } => why.contains("preempt"),
        _ => false,
    });
    let why = refused(verdict);
    assert!(why.contains("annotation gpufrac.io/resolver=\"preempt\""), "{why}");

    // A pod the arbiter cannot read is no answer about it: asked again later.
    let mut pod = fixture("pod-inference.json");
    pod["status"]["containerStatuses"][1]["containerID"] = json!("e3a1c5d7");
    cluster.pods.put(pod);
    let verdict = eventually(&k8s, &process(INFERENCE_UID, SERVER_ID), Verdict::is_unknown);
    let why = unknown(verdict);
    assert!(why.contains("containerID e3a1c5d7: expected <runtime>://<id>"), "{why}");
}

#[test]
fn a_container_id_of_no_container_is_not_entitled() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    let stranger = "f".repeat(64);
    let started = Instant::now();
    let why = refused(k8s.lookup(&process(INFERENCE_UID, &stranger)));
    assert!(why.contains("container ffffffffffff is not (yet) one of pod inference/vllm-small-6d8f7c9b54-x7k2p's containers"), "{why}");
    // A newer status was waited for (a new container's status comes late), within the deadline.
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_millis(1_200), "{waited:?}");
}

#[test]
fn a_container_whose_status_comes_late_is_entitled_once_it_does() {
    let cluster = Cluster::with_fixtures();
    let mut pod = fixture("pod-inference.json");
    pod["status"]["containerStatuses"][1]["containerID"] = Value::Null;
    pod["status"]["containerStatuses"][1]["state"] = json!({"waiting": {"reason": "ContainerCreating"}});
    cluster.pods.put(pod);
    let mut options = cluster.options();
    options.lookup_timeout = Duration::from_secs(2);
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let pods = cluster.pods.clone();
    cluster.rt.spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        pods.put(fixture("pod-inference.json"));
    });
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_request, Amount::Fraction(0.25));
}

#[test]
fn an_api_server_outage_keeps_the_last_synced_store() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    // A pod that starts after the outage began, never seen by the arbiter.
    cluster.kubelet.pods.lock().expect("lock").push(pod_resources(
        "research",
        "batch-embed-1",
        &[("worker", GPU_B, 60..70)],
    ));
    cluster.stop_api_server();
    // The pods seen keep their entitlements.
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_limit, Amount::Fraction(0.5));
    // A pod not seen is no answer while the watch fails (it may have missed it).
    let verdict = eventually(&k8s, &process(NEW_UID, WORKER_ID), Verdict::is_unknown);
    let why = unknown(verdict);
    assert!(why.contains(&format!("pod UID {NEW_UID}: no pod of node {NODE} has this UID")), "{why}");
    assert!(why.contains("the watch of the API server") && why.contains("is failing"), "{why}");
    assert!(why.contains(&format!("127.0.0.1:{}", cluster.api_addr.port())), "{why}");
    // So is a container its pod's last status does not list: a newer one may be missed.
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, &"f".repeat(64))));
    assert!(why.contains("is not (yet) one of") && why.contains("is failing"), "{why}");
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
}

#[test]
fn a_store_never_synced_is_unknown() {
    let cluster = Cluster::with_fixtures();
    cluster.stop_api_server();
    let k8s = cluster.entitlements();
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(
        why.contains(&format!("the pods of node {NODE} are not listed yet from the API server")),
        "{why}"
    );
    assert!(why.contains(&format!("http://127.0.0.1:{}", cluster.api_addr.port())), "{why}");
    assert!(why.contains("listing the pods"), "{why}");
}

#[test]
fn a_changed_pod_is_seen_after_the_watch_delivers_it_with_get_or_list() {
    for mode in [GetMode::Serve, GetMode::Unimplemented, GetMode::Disabled] {
        let cluster = Cluster::with_fixtures();
        *cluster.kubelet.get_mode.lock().expect("lock") = mode;
        let mut options = cluster.options();
        options.cache_ttl = Duration::from_millis(100);
        let k8s = KubernetesEntitlements::new(options).expect("new");
        entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
        let mut pod = fixture("pod-inference.json");
        pod["metadata"]["annotations"]["gpufrac.io/gpu-fraction-limit"] = json!("0.75");
        cluster.pods.put(pod);
        *cluster.kubelet.pods.lock().expect("lock") =
            vec![pod_resources("inference", "vllm-small-6d8f7c9b54-x7k2p", &[("server", GPU_A, 0..30)])];
        let e = entitled(eventually(&k8s, &process(INFERENCE_UID, SERVER_ID), |v| {
            matches!(v, Verdict::Entitled(e) if e.max_limit == Amount::Fraction(0.75)
                && e.max_request == Amount::Fraction(0.3))
        }));
        assert_eq!(e.max_limit, Amount::Fraction(0.75));
        assert_eq!(e.max_request, Amount::Fraction(0.3));
        let (gets, lists) =
            (cluster.kubelet.gets.load(Ordering::SeqCst), cluster.kubelet.lists.load(Ordering::SeqCst));
        match mode {
            GetMode::Serve => assert!(gets >= 2 && lists == 0, "{gets} gets, {lists} lists"),
            // Asked once, then List from then on.
            _ => assert!(gets == 1 && lists >= 2, "{gets} gets, {lists} lists"),
        }
    }
}

#[test]
fn host_processes() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    let root = Identity { pid: 1, uid: 0, gid: 0, cgroup: Cgroup::Host };
    assert_eq!(k8s.lookup(&root), Verdict::Unrestricted);
    // Root whose cgroup is under kubepods but not understood (a pod's own slice, a nested
    // cgroup without a container ID) is never taken for the host's root.
    for cgroup in [
        format!("0::/kubepods/burstable/pod{INFERENCE_UID}\n"),
        "0::/kubepods.slice/kubepods-besteffort.slice\n".to_owned(),
        format!("0::/kubepods/burstable/pod{INFERENCE_UID}/init.scope\n"),
    ] {
        let cgroup = gpufrac_daemon::entitlement::identity::parse_cgroup(&cgroup);
        assert!(matches!(cgroup, Cgroup::Unknown(_)), "{cgroup:?}");
        let pod_root = Identity { pid: 3, uid: 0, gid: 0, cgroup };
        let why = refused(k8s.lookup(&pod_root));
        assert!(why.contains("cannot tell which container"), "{why}");
    }
    // A container nested below the pod's (systemd in the container) is that container.
    let nested = gpufrac_daemon::entitlement::identity::parse_cgroup(&format!(
        "0::/kubepods/burstable/pod{INFERENCE_UID}/{SERVER_ID}/init.scope\n"
    ));
    let e = entitled(k8s.lookup(&Identity { pid: 4, uid: 0, gid: 0, cgroup: nested }));
    assert!(e.source.contains("inference/"), "{}", e.source);
    let user = Identity { pid: 2, uid: 1000, gid: 1000, cgroup: Cgroup::Host };
    let why = refused(k8s.lookup(&user));
    assert!(why.contains("uid 1000 runs outside any pod"), "{why}");
    let mut options = cluster.options();
    options.trust_host_root = false;
    let k8s = KubernetesEntitlements::new(options).expect("new");
    refused(k8s.lookup(&root));
}

#[test]
fn a_refused_token_says_what_rbac_is_needed() {
    let cluster = Cluster::with_fixtures();
    let mut options = cluster.options();
    options.api_server =
        cluster.kube_config(&format!("http://127.0.0.1:{}", cluster.api_addr.port()), None, "another-token");
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("HTTP 401: Unauthorized") && why.contains("`list` and `watch` on pods"), "{why}");
}

#[test]
fn the_kubelet_down_is_no_verdict() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    std::fs::remove_file(&cluster.socket).expect("remove the socket");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("cannot connect to the kubelet's PodResources socket"), "{why}");
    assert!(why.contains(&cluster.socket.display().to_string()), "{why}");
}

#[test]
fn setup_errors_name_what_is_missing() {
    let cluster = Cluster::with_fixtures();
    let mut options = cluster.options();
    options.pod_resources_socket = cluster.dir.path().join("nope.sock");
    let err = KubernetesEntitlements::new(options).expect_err("no socket");
    assert!(matches!(err, KubernetesError::Socket { .. }));
    let text = err.to_string();
    assert!(text.contains("nope.sock") && text.contains("/var/lib/kubelet/pod-resources"), "{text}");
    let mut options = cluster.options();
    options.pod_resources_socket = cluster.dir.path().join("kubeconfig-0");
    std::fs::write(&options.pod_resources_socket, "").expect("a file");
    let text = KubernetesEntitlements::new(options).expect_err("not a socket").to_string();
    assert!(text.contains("not a unix socket"), "{text}");
    let mut options = cluster.options();
    options.node_name = " ".into();
    let text = KubernetesEntitlements::new(options).expect_err("no node").to_string();
    assert!(text.contains("node's name"), "{text}");
}

/// A CA and a certificate for 127.0.0.1 it signed, made with rcgen.
struct Pki {
    ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("CA");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let cert = params.signed_by(&key, &issuer).expect("certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("server config");
        Pki { ca_pem: ca.pem(), server: Arc::new(server) }
    }
}

#[test]
fn https_with_the_kubeconfig_ca() {
    let cluster = Cluster::with_fixtures();
    let pki = Pki::new();
    let (addr, _task) = cluster.rt.block_on(serve_api(cluster.pods.clone(), Some(pki.server.clone())));
    let server = format!("https://127.0.0.1:{}", addr.port());
    let mut options = cluster.options();
    options.api_server = cluster.kube_config(&server, Some(&pki.ca_pem), TOKEN);
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_request, Amount::Fraction(0.25));

    // Another CA: the API server is not believed.
    let other = Pki::new();
    let mut options = cluster.options();
    options.api_server = cluster.kube_config(&server, Some(&other.ca_pem), TOKEN);
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains(&server) && why.contains("listing the pods"), "{why}");
    assert!(why.to_lowercase().contains("certificate"), "{why}");
}

// ---- Entitlements from DRA claims (the DRA kubelet plugin's checkpoint) ----

const CLAIM_UID: &str = "0f3c2a9e-1111-2222-3333-444455556666";
const GIB: u64 = 1 << 30;

fn device(name: &str, gpu: &str, request: u64, limit: u64) -> PreparedDevice {
    // From JSON, as the plugin writes it: fields added to the format later keep their defaults.
    serde_json::from_value(json!({
        "requestNames": ["gpu"],
        "pool": NODE,
        "device": name,
        "gpuUuid": gpu,
        "shareId": "a1b2c",
        "requestBytes": request,
        "limitBytes": limit,
        "cdiDeviceId": format!("gpufrac.io/claim={name}"),
    }))
    .expect("a prepared device")
}

fn claim(
    namespace: &str,
    name: &str,
    uid: &str,
    pods: &[&str],
    devices: Vec<PreparedDevice>,
) -> PreparedClaim {
    PreparedClaim {
        namespace: namespace.into(),
        name: name.into(),
        uid: uid.into(),
        pod_uids: pods.iter().map(|p| (*p).to_owned()).collect(),
        devices,
    }
}

fn checkpoint(claims: Vec<PreparedClaim>) -> Checkpoint {
    let mut checkpoint = Checkpoint::new();
    for claim in claims {
        checkpoint.claims.insert(claim.uid.clone(), claim);
    }
    checkpoint
}

/// A cluster whose arbiter reads entitlements from a DRA checkpoint it returns the path of.
fn dra(cluster: &Cluster, first: &Checkpoint) -> (KubernetesEntitlements, PathBuf) {
    let path = cluster.dir.path().join("plugins/gpu.gpufrac.io").join(gpufrac_common::dra::CHECKPOINT_FILE);
    std::fs::create_dir_all(path.parent().expect("a folder")).expect("the plugin's folder");
    first.store(&path).expect("store the checkpoint");
    let mut options = cluster.options();
    options.dra_checkpoint = Some(path.clone());
    // No kubelet socket is needed.
    options.pod_resources_socket = cluster.dir.path().join("none.sock");
    (KubernetesEntitlements::new(options).expect("new"), path)
}

#[test]
fn a_dra_claim_gives_its_request_limit_resolver_and_priority() {
    let cluster = Cluster::with_fixtures();
    let mut gpu = device("gpu-0", GPU_A, 20 * GIB, 40 * GIB);
    gpu.resolver = Some(Resolver::Swap);
    gpu.priority = Some(5);
    gpu.set_compute(Some(compute(300, 800)));
    let (k8s, _) = dra(
        &cluster,
        &checkpoint(vec![claim("inference", "llm-gpu", CLAIM_UID, &[INFERENCE_UID], vec![gpu])]),
    );
    // Any container of the pod: only those given the claim see its GPU.
    for container in [SERVER_ID, METRICS_ID] {
        let e = entitled(k8s.lookup(&process(INFERENCE_UID, container)));
        assert_eq!(e.source, "DRA claim inference/llm-gpu");
        assert_eq!(gpus(&e), Some(vec![uuid(GPU_A)]));
        assert_eq!(e.max_request, Amount::Bytes(20 * GIB));
        assert_eq!(e.max_limit, Amount::Bytes(40 * GIB));
        assert_eq!(e.resolver, Some(Resolver::Swap));
        assert_eq!(e.max_priority, 5); // the claim's, not the pod's 1000
        assert_eq!(e.group.as_deref(), Some(format!("dra-{CLAIM_UID}").as_str()));
        assert_eq!(e.max_compute, Some(compute(300, 800))); // as prepared
    }
}

#[test]
fn a_dra_claim_without_a_priority_gets_the_pods() {
    let cluster = Cluster::with_fixtures();
    let (k8s, _) = dra(
        &cluster,
        &checkpoint(vec![
            claim(
                "inference",
                "llm-gpu",
                CLAIM_UID,
                &[INFERENCE_UID],
                vec![device("gpu-0", GPU_A, GIB, GIB)],
            ),
            claim(
                "research",
                "embed-gpu",
                "1f3c2a9e-1111-2222-3333-444455556666",
                &[DIRECT_UID],
                vec![device("gpu-1", GPU_B, GIB, 2 * GIB)],
            ),
        ]),
    );
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!((e.max_priority, e.resolver), (1000, None)); // spec.priority; the client's resolver
                                                            // No compute share prepared (nor any in the checkpoint's format then): no request.
    assert_eq!(e.max_compute, Some(compute(0, 1000)));
    let e = entitled(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    assert_eq!(e.max_priority, 0);
    assert_eq!(gpus(&e), Some(vec![uuid(GPU_B)]));
}

#[test]
fn a_pod_without_a_prepared_claim_is_refused() {
    let cluster = Cluster::with_fixtures();
    let (k8s, path) = dra(
        &cluster,
        &checkpoint(vec![claim(
            "inference",
            "llm-gpu",
            CLAIM_UID,
            &[INFERENCE_UID],
            vec![device("gpu-0", GPU_A, GIB, GIB)],
        )]),
    );
    let why = refused(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    assert_eq!(why, "no gpufrac claim prepared on this node for pod research/batch-embed-0");
    // Nothing prepared yet (no checkpoint at all): the same.
    std::fs::remove_file(&path).expect("remove");
    let why = refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("no gpufrac claim prepared on this node for pod inference/"), "{why}");
    // A pod of no node's store: refused before the checkpoint is read.
    let why = refused(k8s.lookup(&process(NEW_UID, WORKER_ID)));
    assert!(why.contains("no pod of node"), "{why}");
}

#[test]
fn a_claim_of_another_namespace_is_not_the_pods() {
    let cluster = Cluster::with_fixtures();
    // The checkpoint says the claim is reserved for the pod's UID, but the claim lives in
    // another namespace: a pod can only use claims of its own namespace.
    let (k8s, _) = dra(
        &cluster,
        &checkpoint(vec![claim(
            "research",
            "stolen-gpu",
            CLAIM_UID,
            &[INFERENCE_UID],
            vec![device("gpu-0", GPU_A, GIB, GIB)],
        )]),
    );
    let why = refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("no gpufrac claim prepared on this node for pod inference/vllm-small"), "{why}");
}

#[test]
fn a_claim_of_two_gpus_entitles_each_and_two_claims_are_refused() {
    let cluster = Cluster::with_fixtures();
    let (k8s, path) = dra(
        &cluster,
        &checkpoint(vec![claim(
            "inference",
            "two-gpus",
            CLAIM_UID,
            &[INFERENCE_UID],
            vec![device("gpu-0", GPU_A, 2 * GIB, 4 * GIB), device("gpu-1", GPU_B, GIB, 3 * GIB)],
        )]),
    );
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    let caps =
        |request, limit| DeviceCaps { max_request: Amount::Bytes(request), max_limit: Amount::Bytes(limit) };
    let want = [(uuid(GPU_A), caps(2 * GIB, 4 * GIB)), (uuid(GPU_B), caps(GIB, 3 * GIB))];
    assert_eq!(e.devices, Some(want.into_iter().collect()), "each GPU what the claim holds of it");
    assert_eq!((e.max_request, e.max_limit), (Amount::Bytes(2 * GIB), Amount::Bytes(4 * GIB)));
    assert_eq!(e.group.as_deref(), Some(format!("dra-{CLAIM_UID}").as_str()), "one group for both");
    // A checkpoint whose devices disagree is not believed (the plugin refuses such a claim).
    let mut other = device("gpu-1", GPU_B, GIB, 3 * GIB);
    other.resolver = Some(Resolver::Swap);
    checkpoint(vec![claim(
        "inference",
        "two-gpus",
        CLAIM_UID,
        &[INFERENCE_UID],
        vec![device("gpu-0", GPU_A, GIB, GIB), other],
    )])
    .store(&path)
    .expect("store");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("device gpu-1: its resolver differs from that of gpu-0"), "{why}");
    checkpoint(vec![
        claim("inference", "a", CLAIM_UID, &[INFERENCE_UID], vec![device("gpu-0", GPU_A, GIB, GIB)]),
        claim(
            "inference",
            "b",
            "1f3c2a9e-1111-2222-3333-444455556666",
            &[INFERENCE_UID],
            vec![device("gpu-1", GPU_B, GIB, GIB)],
        ),
    ])
    .store(&path)
    .expect("store");
    let why = refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(
        why,
        "a process may use one gpufrac claim (ask for several GPUs in one claim: count: N); pod \
         inference/vllm-small-6d8f7c9b54-x7k2p holds claims a, b"
    );
}

#[test]
fn a_checkpoint_rewritten_between_lookups_is_seen() {
    let cluster = Cluster::with_fixtures();
    let first = checkpoint(vec![claim(
        "inference",
        "llm-gpu",
        CLAIM_UID,
        &[INFERENCE_UID],
        vec![device("gpu-0", GPU_A, GIB, 2 * GIB)],
    )]);
    let (k8s, path) = dra(&cluster, &first);
    assert_eq!(entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID))).max_request, Amount::Bytes(GIB));
    // The same size, within the same clock tick: still a new file (renamed over the old).
    let second = checkpoint(vec![claim(
        "inference",
        "llm-gpu",
        CLAIM_UID,
        &[INFERENCE_UID],
        vec![device("gpu-0", GPU_A, 2 * GIB, 2 * GIB)],
    )]);
    second.store(&path).expect("store");
    assert_eq!(entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID))).max_request, Amount::Bytes(2 * GIB));
    // Unprepared: gone at the next lookup.
    checkpoint(Vec::new()).store(&path).expect("store");
    refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
}

#[test]
fn a_damaged_or_untrusted_checkpoint_is_unknown() {
    use std::os::unix::fs::PermissionsExt as _;
    let cluster = Cluster::with_fixtures();
    let good = checkpoint(vec![claim(
        "inference",
        "llm-gpu",
        CLAIM_UID,
        &[INFERENCE_UID],
        vec![device("gpu-0", GPU_A, GIB, GIB)],
    )]);
    let (k8s, path) = dra(&cluster, &good);
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));

    std::fs::write(&path, "{\"version\": 1, \"claims\": ").expect("write");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.starts_with("DRA checkpoint") && why.contains(&path.display().to_string()), "{why}");
    std::fs::write(&path, r#"{"version": 9, "claims": {}}"#).expect("write");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("version 9"), "{why}");

    good.store(&path).expect("store");
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("mode 0666 lets group or others write it"), "{why}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    // Owned by someone else (the tests run as root, who can give it away).
    std::os::unix::fs::chown(&path, Some(1000), None).expect("chown");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("owned by uid 1000, not root"), "{why}");
    std::fs::remove_file(&path).expect("remove");
    std::os::unix::fs::symlink(cluster.dir.path().join("elsewhere.json"), &path).expect("symlink");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("not a regular file"), "{why}");

    // A device the arbiter cannot use is no answer either.
    std::fs::remove_file(&path).expect("remove");
    checkpoint(vec![claim(
        "inference",
        "llm-gpu",
        CLAIM_UID,
        &[INFERENCE_UID],
        vec![device("gpu-0", "GPU-nope", GIB, GIB)],
    )])
    .store(&path)
    .expect("store");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("DRA claim inference/llm-gpu device gpu-0: GPU UUID \"GPU-nope\""), "{why}");
}

#[test]
fn dra_host_processes_follow_the_same_rules() {
    let cluster = Cluster::with_fixtures();
    let (k8s, _) = dra(&cluster, &checkpoint(Vec::new()));
    assert_eq!(k8s.lookup(&Identity { pid: 1, uid: 0, gid: 0, cgroup: Cgroup::Host }), Verdict::Unrestricted);
    let why = refused(k8s.lookup(&Identity { pid: 2, uid: 1000, gid: 1000, cgroup: Cgroup::Host }));
    assert!(why.contains("only pods given a gpufrac DRA claim are entitled"), "{why}");
    let cgroup = Cgroup::Unknown("0::/kubepods.slice".into());
    let why = refused(k8s.lookup(&Identity { pid: 3, uid: 0, gid: 0, cgroup }));
    assert!(why.contains("cannot tell which container"), "{why}");
}
