//! Kubernetes entitlements against stand-ins: a kubelet serving the official
//! `podresources/v1` API (tonic, on a unix socket in a temporary folder) and an API server
//! (hyper, plain HTTP or HTTPS with an rcgen CA) serving real `kubectl get pod -o json`
//! output from `tests/fixtures/pod-*.json`. Lookups are made as the arbiter makes them:
//! from a plain thread, blocking.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpufrac_common::resolver::Resolver;
use gpufrac_daemon::entitlement::kubernetes::api::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpufrac_daemon::entitlement::kubernetes::api::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use gpufrac_daemon::entitlement::kubernetes::apiserver::ApiServerConfig;
use gpufrac_daemon::entitlement::kubernetes::{KubernetesEntitlements, KubernetesError, KubernetesOptions};
use gpufrac_daemon::entitlement::{
    Amount, Cgroup, ContainerRef, Entitlement, Entitlements, Identity, Verdict,
};
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::net::{TcpListener, UnixListener};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

const GPU_A: &str = "GPU-516d6770-7500-0000-0000-00000000000a";
const GPU_B: &str = "GPU-516d6770-7500-0000-0000-00000000000b";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.test-token";

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

/// What the API server stand-in serves.
#[derive(Clone, Default)]
struct Pods {
    by_name: Arc<Mutex<HashMap<(String, String), Value>>>,
    gets: Arc<AtomicUsize>,
}

impl Pods {
    fn put(&self, pod: Value) {
        let ns = pod["metadata"]["namespace"].as_str().expect("namespace").to_owned();
        let name = pod["metadata"]["name"].as_str().expect("name").to_owned();
        self.by_name.lock().expect("lock").insert((ns, name), pod);
    }

    fn answer(&self, request: &Request<hyper::body::Incoming>) -> (StatusCode, Value) {
        self.gets.fetch_add(1, Ordering::SeqCst);
        let auth = request.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if auth != Some(&format!("Bearer {TOKEN}")) {
            return (StatusCode::UNAUTHORIZED, status_object(401, "Unauthorized"));
        }
        let path = request.uri().path().to_owned();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let ["api", "v1", "namespaces", ns, "pods", name] = parts.as_slice() else {
            return (
                StatusCode::NOT_FOUND,
                status_object(404, "the server could not find the requested resource"),
            );
        };
        match self.by_name.lock().expect("lock").get(&((*ns).to_owned(), (*name).to_owned())) {
            Some(pod) => (StatusCode::OK, pod.clone()),
            None => (StatusCode::NOT_FOUND, status_object(404, &format!("pods \"{name}\" not found"))),
        }
    }
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
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token");
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
        let pods = Pods::default();
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

    fn token(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    fn options(&self) -> KubernetesOptions {
        let api = ApiServerConfig::plain_http_for_tests("127.0.0.1", self.api_addr.port(), self.token());
        let mut options = KubernetesOptions::new(self.socket.clone(), api, Some("gpu-node-3".into()));
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

/// Serves `pods` on 127.0.0.1 (HTTPS when `tls` is given) until aborted.
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
                    let (status, body) = pods.answer(&request);
                    async move {
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(body.to_string())))
                                .expect("response"),
                        )
                    }
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

fn uuid(text: &str) -> [u8; 16] {
    gpufrac_common::gpu_uuid::parse(text).expect("a GPU UUID")
}

#[test]
fn shares_are_a_fraction_of_the_right_gpu_and_the_rest_comes_from_the_pod() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();

    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.devices, Some(vec![uuid(GPU_A)]));
    assert_eq!(e.max_request, Amount::Fraction(0.25));
    assert_eq!(e.max_limit, Amount::Fraction(0.5)); // gpufrac.io/gpu-fraction-limit
    assert_eq!(e.max_priority, 1000); // spec.priority
    assert_eq!(e.resolver, Some(Resolver::Priority)); // gpufrac.io/resolver
    assert_eq!(e.group.as_deref(), Some(format!("k8s-{INFERENCE_UID}-server").as_str()));
    assert_eq!(e.source, "kubelet: inference/vllm-small-6d8f7c9b54-x7k2p container server");

    // The direct pod's container sets GPUFRAC_PRIORITY=1000000 and GPUFRAC_RESOLVER=priority
    // in its env: neither counts. No annotations: limit = request, wait, spec.priority 0.
    // Upper-case IDs from a cgroup are the same IDs.
    let e = entitled(k8s.lookup(&process(&DIRECT_UID.to_uppercase(), &WORKER_ID.to_uppercase())));
    assert_eq!(e.devices, Some(vec![uuid(GPU_B)]));
    assert_eq!(e.max_request, Amount::Fraction(0.5));
    assert_eq!(e.max_limit, Amount::Fraction(0.5));
    assert_eq!(e.max_priority, 0);
    assert_eq!(e.resolver, Some(Resolver::Wait));
    assert_eq!(e.group.as_deref(), Some(format!("k8s-{DIRECT_UID}-worker").as_str()));
}

#[test]
fn a_container_without_shares_is_not_entitled() {
    let cluster = Cluster::with_fixtures();
    // A pod the kubelet gave no shares at all.
    cluster.kubelet.pods.lock().expect("lock").retain(|p| p.name != "batch-embed-0");
    let k8s = cluster.entitlements();
    let why = refused(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    assert!(
        why.contains(&format!("pod UID {DIRECT_UID}: no pod the kubelet gave gpufrac.io/gpu shares")),
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
fn a_pod_uid_not_on_this_node_is_not_entitled() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    // The API server places the pod on another node, though the kubelet lists it.
    let mut moved = fixture("pod-direct.json");
    moved["spec"]["nodeName"] = json!("gpu-node-9");
    cluster.pods.put(moved);
    let elsewhere = "11111111-2222-3333-4444-555555555555";
    let why = refused(k8s.lookup(&process(elsewhere, SERVER_ID)));
    assert!(why.contains(elsewhere) && why.contains("another node"), "{why}");
    let why = refused(k8s.lookup(&process(DIRECT_UID, WORKER_ID)));
    assert!(why.contains("runs on node gpu-node-9, not on this node (gpu-node-3)"), "{why}");
    // Nonsense from a cgroup is refused before anyone is asked.
    let why = refused(k8s.lookup(&process("../../etc", SERVER_ID)));
    assert!(why.contains("is not a UUID"), "{why}");
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
    let k8s = cluster.entitlements();
    let why = refused(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("annotation gpufrac.io/resolver=\"preempt\""), "{why}");

    let mut pod = fixture("pod-inference.json");
    pod["spec"]["priority"] = json!("high");
    cluster.pods.put(pod);
    let k8s = cluster.entitlements();
    // A pod the arbiter cannot read is no answer about it: asked again later.
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("spec.priority"), "{why}");
}

#[test]
fn a_container_id_of_no_container_is_not_entitled() {
    let cluster = Cluster::with_fixtures();
    let k8s = cluster.entitlements();
    let stranger = "f".repeat(64);
    let started = Instant::now();
    let why = refused(k8s.lookup(&process(INFERENCE_UID, &stranger)));
    assert!(why.contains("container ffffffffffff is not (yet) one of pod inference/vllm-small-6d8f7c9b54-x7k2p's containers"), "{why}");
    // It was asked again before the refusal (a new container's status comes late), within the deadline.
    assert!(started.elapsed() < Duration::from_millis(1_200), "{:?}", started.elapsed());
    assert!(cluster.pods.gets.load(Ordering::SeqCst) >= 3);
}

#[test]
fn a_container_whose_status_comes_late_is_entitled_once_it_does() {
    let cluster = Cluster::with_fixtures();
    let mut pod = fixture("pod-inference.json");
    pod["status"]["containerStatuses"][1]["containerID"] = Value::Null;
    pod["status"]["containerStatuses"][1]["state"] = json!({"waiting": {"reason": "ContainerCreating"}});
    cluster.pods.put(pod);
    let pods = cluster.pods.clone();
    cluster.rt.spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        pods.put(fixture("pod-inference.json"));
    });
    let mut options = cluster.options();
    options.lookup_timeout = Duration::from_secs(2);
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_request, Amount::Fraction(0.25));
}

#[test]
fn an_api_server_outage_is_covered_by_the_cache_only_within_its_ttl() {
    let cluster = Cluster::with_fixtures();
    let mut options = cluster.options();
    options.cache_ttl = Duration::from_millis(400);
    let k8s = KubernetesEntitlements::new(options).expect("new");
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    let gets = cluster.pods.gets.load(Ordering::SeqCst);
    // A pod that starts after that lookup, never seen by the arbiter.
    let mut new_pod = fixture("pod-direct.json");
    new_pod["metadata"]["name"] = json!("batch-embed-1");
    new_pod["metadata"]["uid"] = json!(NEW_UID);
    cluster.pods.put(new_pod);
    cluster.kubelet.pods.lock().expect("lock").push(pod_resources(
        "research",
        "batch-embed-1",
        &[("worker", GPU_B, 60..70)],
    ));
    cluster.stop_api_server();
    // Within the TTL: the cached answer, with no one asked.
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_limit, Amount::Fraction(0.5));
    assert_eq!(cluster.pods.gets.load(Ordering::SeqCst), gets);
    std::thread::sleep(Duration::from_millis(500));
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("cannot read pod inference/vllm-small-6d8f7c9b54-x7k2p"), "{why}");
    assert!(
        why.contains(&format!(
            "GET http://127.0.0.1:{}/api/v1/namespaces/inference/pods/",
            cluster.api_addr.port()
        )),
        "{why}"
    );
    assert!(why.contains("cannot connect"), "{why}");
    // A pod never seen: the same, with the count of pods that could not be read.
    let why = unknown(k8s.lookup(&process(NEW_UID, WORKER_ID)));
    assert!(why.contains(&format!("pod UID {NEW_UID}: not found among the pods")), "{why}");
    assert!(why.contains("could not be read") && why.contains("cannot connect"), "{why}");
}

#[test]
fn a_changed_pod_is_seen_after_the_ttl_with_get_or_list() {
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
        std::thread::sleep(Duration::from_millis(150));
        for _ in 0..2 {
            let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
            assert_eq!(e.max_limit, Amount::Fraction(0.75));
            assert_eq!(e.max_request, Amount::Fraction(0.3));
            std::thread::sleep(Duration::from_millis(150));
        }
        let gets = cluster.kubelet.gets.load(Ordering::SeqCst);
        match mode {
            GetMode::Serve => assert_eq!(gets, 2),
            // Asked once, then List from then on.
            _ => assert_eq!(gets, 1),
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
    std::fs::write(cluster.token(), "another-token").expect("token");
    let k8s = cluster.entitlements();
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("HTTP 401: Unauthorized") && why.contains("needs `get` on pods"), "{why}");
    // The token file is read again for each request (the kubelet rotates it).
    std::fs::write(cluster.token(), TOKEN).expect("token");
    entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
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
    options.pod_resources_socket = cluster.token();
    let text = KubernetesEntitlements::new(options).expect_err("not a socket").to_string();
    assert!(text.contains("not a unix socket"), "{text}");
    // HTTPS needs a CA and a readable token.
    let text = ApiServerConfig::https("127.0.0.1", 443, &cluster.token(), cluster.token())
        .expect_err("no CA")
        .to_string();
    assert!(text.contains("CA certificate") && text.contains("no CERTIFICATE"), "{text}");
    let text = ApiServerConfig::https("127.0.0.1", 443, &cluster.dir.path().join("ca.crt"), cluster.token())
        .expect_err("no CA file")
        .to_string();
    assert!(text.contains("ca.crt") && text.contains("is the service account's token mounted"), "{text}");
    let pki = Pki::new();
    let ca = pki.write(&cluster);
    let text = ApiServerConfig::https("127.0.0.1", 443, &ca, cluster.dir.path().join("none"))
        .expect_err("no token")
        .to_string();
    assert!(text.contains("service-account token") && text.contains("none"), "{text}");
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

    /// Writes the CA's PEM in the cluster's folder, as the service account's `ca.crt`.
    fn write(&self, cluster: &Cluster) -> PathBuf {
        let path = cluster.dir.path().join(format!("ca-{}.crt", CA_FILES.fetch_add(1, Ordering::SeqCst)));
        std::fs::write(&path, &self.ca_pem).expect("write the CA");
        path
    }
}

static CA_FILES: AtomicUsize = AtomicUsize::new(0);

#[test]
fn https_with_the_service_account_ca() {
    let cluster = Cluster::with_fixtures();
    let pki = Pki::new();
    let (addr, _task) = cluster.rt.block_on(serve_api(cluster.pods.clone(), Some(pki.server.clone())));
    let api = ApiServerConfig::https("127.0.0.1", addr.port(), &pki.write(&cluster), cluster.token())
        .expect("https");
    let mut options = cluster.options();
    options.api_server = api;
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let e = entitled(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert_eq!(e.max_request, Amount::Fraction(0.25));

    // Another CA: the API server is not believed.
    let other = Pki::new();
    let api = ApiServerConfig::https("127.0.0.1", addr.port(), &other.write(&cluster), cluster.token())
        .expect("https");
    let mut options = cluster.options();
    options.api_server = api;
    let k8s = KubernetesEntitlements::new(options).expect("new");
    let why = unknown(k8s.lookup(&process(INFERENCE_UID, SERVER_ID)));
    assert!(why.contains("TLS") && why.contains(&format!("https://127.0.0.1:{}", addr.port())), "{why}");
}
