//! The admission webhook end to end, over real HTTPS: a CA and a `localhost` certificate
//! made with rcgen, `load_tls` from PEM files, `serve` on 127.0.0.1, and AdmissionReview
//! bodies sent by a hyper client that trusts only that CA. Patches are decoded and applied
//! with `json-patch` to the pod sent, and the resulting pod is checked.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use gpufrac_device_plugin::webhook::{self, load_tls, review, serve, MAX_BODY_BYTES};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsConnector;

/// PEM files for a server certificate signed by a test CA.
struct Pki {
    dir: TempDir,
    ca_der: CertificateDer<'static>,
}

impl Pki {
    fn new() -> Pki {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);

        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let cert = params.signed_by(&key, &issuer).expect("server certificate");

        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).expect("write");
        std::fs::write(dir.path().join("tls.crt"), cert.pem()).expect("write");
        std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).expect("write");
        Pki { dir, ca_der: ca.der().clone() }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn cert(&self) -> PathBuf {
        self.path("tls.crt")
    }

    fn key(&self) -> PathBuf {
        self.path("tls.key")
    }

    fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, contents).expect("write");
        path
    }
}

/// A running webhook and a client for it.
struct Server {
    _pki: Pki,
    addr: std::net::SocketAddr,
    connector: TlsConnector,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

/// An HTTP answer.
struct Answer {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Server {
    async fn start() -> Server {
        let pki = Pki::new();
        let tls = load_tls(&pki.cert(), &pki.key()).expect("load_tls");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, tls, async move {
            let _ = stopped.await;
        }));
        let connector = connector(&pki.ca_der);
        Server { _pki: pki, addr, connector, stop: Some(stop), task }
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: impl Into<Bytes>,
    ) -> Answer {
        let tcp = TcpStream::connect(self.addr).await.expect("connect");
        let name = ServerName::try_from("localhost").expect("server name");
        let tls = self.connector.connect(name, tcp).await.expect("TLS handshake");
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.expect("HTTP handshake");
        tokio::spawn(conn);
        let mut request = Request::builder().method(method).uri(path).header("host", "localhost");
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        let request = request.body(Full::new(body.into())).expect("request");
        let response = sender.send_request(request).await.expect("response");
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.expect("response body").to_bytes();
        Answer { status, headers, body }
    }

    /// POSTs an AdmissionReview to /mutate and returns the answer, which must be a 200
    /// AdmissionReview for the same uid.
    async fn mutate(&self, review: &Value) -> Value {
        let answer =
            self.request(Method::POST, "/mutate", Some("application/json"), review.to_string()).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.headers["content-type"], "application/json");
        let value: Value = serde_json::from_slice(&answer.body).expect("JSON answer");
        assert_eq!(value["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(value["kind"], "AdmissionReview");
        assert_eq!(value["response"]["uid"], review["request"]["uid"]);
        value
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .expect("serve returns after shutdown")
            .expect("serve did not panic");
        result.expect("serve returns Ok");
    }
}

fn connector(ca: &CertificateDer<'static>) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("CA certificate");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// An AdmissionReview for the creation of `pod` in namespace `ml`.
fn create(pod: Value) -> Value {
    // As the API server sends it: "" for a name to be generated (`generateName`).
    let name = pod.pointer("/metadata/name").filter(|n| n.is_string()).cloned().unwrap_or(json!(""));
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": name,
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "admin", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    })
}

/// A pod named `trainer` with these annotations and containers.
fn pod(annotations: Value, containers: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml", "annotations": annotations},
        "spec": {"containers": containers},
    })
}

fn container(name: &str) -> Value {
    json!({"name": name, "image": "registry.example/train:1"})
}

/// The pod sent in `review`, with the answer's patch applied.
fn patched(review: &Value, answer: &Value) -> Value {
    let response = &answer["response"];
    assert_eq!(response["allowed"], true, "{answer}");
    assert_eq!(response["patchType"], "JSONPatch");
    let b64 = response["patch"].as_str().expect("patch is a string");
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).expect("patch is base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON Patch");
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).expect("the patch applies");
    pod
}

/// The env of a container as name → value (a `valueFrom` shown as its JSON), asserting no
/// name appears twice.
fn env_of(container: &Value) -> Vec<(String, String)> {
    let env = container["env"].as_array().expect("env");
    let pairs: Vec<(String, String)> = env
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("name").to_owned();
            let value = match e.get("value") {
                Some(Value::String(v)) => v.clone(),
                _ => e["valueFrom"].to_string(),
            };
            (name, value)
        })
        .collect();
    let mut names: Vec<&str> = pairs.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(before, names.len(), "duplicate env names: {env:?}");
    pairs
}

fn env_value<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

fn assert_allowed_unchanged(answer: &Value) {
    let response = &answer["response"];
    assert_eq!(response["allowed"], true, "{answer}");
    assert!(response.get("patch").is_none(), "{answer}");
    assert!(response.get("patchType").is_none(), "{answer}");
}

/// The refusal message, asserting the answer is a refusal.
fn refusal(answer: &Value) -> String {
    let response = &answer["response"];
    assert_eq!(response["allowed"], false, "{answer}");
    assert!(response.get("patch").is_none(), "{answer}");
    assert_eq!(response["status"]["code"], 400, "{answer}");
    response["status"]["message"].as_str().expect("a message").to_owned()
}

#[tokio::test]
async fn good_pod_is_patched() {
    let server = Server::start().await;
    let mut pod = pod(
        json!({
            "gpufrac.io/gpu-fraction": "0.25",
            "gpufrac.io/gpu-fraction-limit": "0.5",
            "gpufrac.io/resolver": "priority",
            "unrelated": "kept",
        }),
        json!([container("main"), container("sidecar")]),
    );
    pod["spec"]["priority"] = json!(1000);
    let review = create(pod);
    let answer = server.mutate(&review).await;
    let result = patched(&review, &answer);

    let main = &result["spec"]["containers"][0];
    assert_eq!(main["resources"]["limits"]["gpufrac.io/gpu"], "25");
    assert_eq!(main["resources"]["requests"]["gpufrac.io/gpu"], "25");
    let env = env_of(main);
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_LIMIT"), Some("0.5"));
    assert_eq!(env_value(&env, "GPUFRAC_RESOLVER"), Some("priority"));
    assert_eq!(env_value(&env, "GPUFRAC_PRIORITY"), Some("1000"));
    assert_eq!(env_value(&env, "GPUFRAC_POD"), Some("ml/trainer"));
    assert_eq!(env.len(), 4, "{env:?}");
    // The webhook never sets the request: Allocate does.
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_REQUEST"), None);
    // Nothing else changed.
    assert_eq!(result["spec"]["containers"][1], container("sidecar"));
    assert_eq!(result["metadata"], review["request"]["object"]["metadata"]);
    assert!(answer["response"].get("warnings").is_none(), "{answer}");
    server.stop().await;
}

#[tokio::test]
async fn defaults_and_rounding() {
    let server = Server::start().await;
    // No limit, resolver or priority: limit = the request, wait, 0.
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.07"}), json!([container("main")])));
    let result = patched(&review, &server.mutate(&review).await);
    let main = &result["spec"]["containers"][0];
    assert_eq!(main["resources"]["limits"]["gpufrac.io/gpu"], "7");
    let env = env_of(main);
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_LIMIT"), Some("0.07"));
    assert_eq!(env_value(&env, "GPUFRAC_RESOLVER"), Some("wait"));
    assert_eq!(env_value(&env, "GPUFRAC_PRIORITY"), Some("0"));

    // A whole GPU.
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "1"}), json!([container("main")])));
    let result = patched(&review, &server.mutate(&review).await);
    let main = &result["spec"]["containers"][0];
    assert_eq!(main["resources"]["limits"]["gpufrac.io/gpu"], "100");
    assert_eq!(env_value(&env_of(main), "GPUFRAC_MEMORY_LIMIT"), Some("1"));

    // Rounded up to whole shares; the limit follows so that limit >= request holds.
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.333", "gpufrac.io/gpu-fraction-limit": "0.335"}),
        json!([container("main")]),
    ));
    let answer = server.mutate(&review).await;
    let result = patched(&review, &answer);
    let main = &result["spec"]["containers"][0];
    assert_eq!(main["resources"]["limits"]["gpufrac.io/gpu"], "34");
    assert_eq!(env_value(&env_of(main), "GPUFRAC_MEMORY_LIMIT"), Some("0.34"));
    let warning = answer["response"]["warnings"][0].as_str().expect("a warning");
    assert!(warning.contains("34 shares"), "{warning}");
    server.stop().await;
}

#[tokio::test]
async fn container_chosen_by_annotation_keeps_its_resources_and_env() {
    let server = Server::start().await;
    let mut worker = container("worker");
    worker["resources"] = json!({"limits": {"cpu": "2", "memory": "4Gi"}});
    worker["env"] = json!([
        {"name": "A", "value": "1"},
        {"name": "GPUFRAC_RESOLVER", "value": "swap"},
        {"name": "B", "value": "$(GPUFRAC_RESOLVER)"},
    ]);
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": ".5", "gpufrac.io/container": "worker"}),
        json!([container("init-like"), worker]),
    ));
    let result = patched(&review, &server.mutate(&review).await);

    assert_eq!(result["spec"]["containers"][0], container("init-like"));
    let worker = &result["spec"]["containers"][1];
    assert_eq!(
        worker["resources"],
        json!({
            "limits": {"cpu": "2", "memory": "4Gi", "gpufrac.io/gpu": "50"},
            "requests": {"gpufrac.io/gpu": "50"},
        })
    );
    let env = env_of(worker);
    let names: Vec<&str> = env.iter().map(|(n, _)| n.as_str()).collect();
    // Replaced where it stood (B refers to it), the others appended.
    assert_eq!(
        names,
        ["A", "GPUFRAC_RESOLVER", "B", "GPUFRAC_MEMORY_LIMIT", "GPUFRAC_PRIORITY", "GPUFRAC_POD"]
    );
    assert_eq!(env_value(&env, "GPUFRAC_RESOLVER"), Some("wait"));
    assert_eq!(env_value(&env, "A"), Some("1"));
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_LIMIT"), Some("0.5"));
    server.stop().await;
}

#[tokio::test]
async fn existing_gpufrac_settings_are_updated_not_duplicated() {
    let server = Server::start().await;
    let mut main = container("main");
    main["resources"] = json!({
        "limits": {"cpu": "1", "gpufrac.io/gpu": "10"},
        "requests": {"cpu": "500m", "gpufrac.io/gpu": "10"},
    });
    main["env"] = json!([
        {"name": "GPUFRAC_MEMORY_LIMIT", "value": "0.1"},
        {"name": "GPUFRAC_PRIORITY", "value": "7"},
        {"name": "GPUFRAC_POD", "value": "old/name"},
        {"name": "GPUFRAC_PRIORITY", "value": "8"},
        {"name": "KEEP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]);
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.2", "gpufrac.io/gpu-fraction-limit": "0.3",
               "gpufrac.io/resolver": "swap"}),
        json!([main]),
    ));
    let result = patched(&review, &server.mutate(&review).await);
    let main = &result["spec"]["containers"][0];
    assert_eq!(
        main["resources"],
        json!({
            "limits": {"cpu": "1", "gpufrac.io/gpu": "20"},
            "requests": {"cpu": "500m", "gpufrac.io/gpu": "20"},
        })
    );
    let env = env_of(main);
    assert_eq!(
        env,
        [
            ("GPUFRAC_MEMORY_LIMIT".to_owned(), "0.3".to_owned()),
            ("GPUFRAC_PRIORITY".to_owned(), "0".to_owned()),
            ("GPUFRAC_POD".to_owned(), "ml/trainer".to_owned()),
            ("KEEP".to_owned(), json!({"fieldRef": {"fieldPath": "status.podIP"}}).to_string()),
            ("GPUFRAC_RESOLVER".to_owned(), "swap".to_owned()),
        ]
    );
    server.stop().await;
}

#[tokio::test]
async fn resources_without_limits_and_null_env() {
    let server = Server::start().await;
    let mut main = container("main");
    main["resources"] = json!({"requests": {"cpu": "1"}});
    main["env"] = Value::Null;
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.3"}), json!([main])));
    let result = patched(&review, &server.mutate(&review).await);
    let main = &result["spec"]["containers"][0];
    assert_eq!(
        main["resources"],
        json!({"limits": {"gpufrac.io/gpu": "30"},
               "requests": {"cpu": "1", "gpufrac.io/gpu": "30"}})
    );
    assert_eq!(env_of(main).len(), 4);
    server.stop().await;
}

#[tokio::test]
async fn generated_name_comes_from_the_downward_api() {
    let server = Server::start().await;
    let mut pod = pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!([container("main")]));
    let metadata = pod["metadata"].as_object_mut().expect("metadata");
    metadata.remove("name");
    metadata.remove("namespace");
    metadata.insert("generateName".into(), json!("trainer-7d9f8-"));
    let review = create(pod);
    assert_eq!(review["request"]["name"], "");
    let result = patched(&review, &server.mutate(&review).await);
    let env = &result["spec"]["containers"][0]["env"];
    let names: Vec<&str> = env.as_array().expect("env").iter().filter_map(|e| e["name"].as_str()).collect();
    let helper = names.iter().position(|n| *n == "GPUFRAC_POD_NAME");
    let pod_var = names.iter().position(|n| *n == "GPUFRAC_POD");
    assert!(helper.is_some() && helper < pod_var, "{names:?}");
    let helper = &env[helper.unwrap_or_default()];
    assert_eq!(helper["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    assert_eq!(env[pod_var.unwrap_or_default()]["value"], "ml/$(GPUFRAC_POD_NAME)");
    server.stop().await;
}

#[tokio::test]
async fn bad_annotations_are_refused_naming_them() {
    let server = Server::start().await;
    let cases: &[(Value, &[&str])] = &[
        (
            json!({"gpufrac.io/gpu-fraction": "0"}),
            &[r#"gpufrac.io/gpu-fraction="0": expected a fraction 0 < f <= 1"#],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "1.5"}),
            &[r#"gpufrac.io/gpu-fraction="1.5": expected a fraction 0 < f <= 1"#],
        ),
        (json!({"gpufrac.io/gpu-fraction": "abc"}), &[r#"gpufrac.io/gpu-fraction="abc""#]),
        (json!({"gpufrac.io/gpu-fraction": "-0.5"}), &[r#"gpufrac.io/gpu-fraction="-0.5""#]),
        (json!({"gpufrac.io/gpu-fraction": "NaN"}), &[r#"gpufrac.io/gpu-fraction="NaN""#]),
        (json!({"gpufrac.io/gpu-fraction": ""}), &[r#"gpufrac.io/gpu-fraction="""#]),
        (
            json!({"gpufrac.io/gpu-fraction": "25%"}),
            &[r#"gpufrac.io/gpu-fraction="25%""#, "not a percentage"],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.5", "gpufrac.io/gpu-fraction-limit": "0.25"}),
            &[
                r#"gpufrac.io/gpu-fraction-limit="0.25": expected a fraction >= gpufrac.io/gpu-fraction (0.5)"#,
            ],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.5", "gpufrac.io/gpu-fraction-limit": "2"}),
            &[r#"gpufrac.io/gpu-fraction-limit="2""#],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.5", "gpufrac.io/resolver": "fastest"}),
            &[r#"gpufrac.io/resolver="fastest": expected wait, priority or swap"#],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.5", "gpufrac.io/container": "nope"}),
            &[r#"gpufrac.io/container="nope""#, r#""main""#, r#""sidecar""#],
        ),
        (
            json!({"gpufrac.io/gpu-fraction-limit": "0.5"}),
            &["gpufrac.io/gpu-fraction is missing", "gpufrac.io/gpu-fraction-limit"],
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "2", "gpufrac.io/resolver": "x"}),
            &[r#"gpufrac.io/gpu-fraction="2""#, r#"gpufrac.io/resolver="x""#],
        ),
    ];
    for (annotations, expected) in cases {
        let review = create(pod(annotations.clone(), json!([container("main"), container("sidecar")])));
        let message = refusal(&server.mutate(&review).await);
        for part in *expected {
            assert!(message.contains(part), "{annotations}: {message:?} lacks {part:?}");
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn park_after_sets_gpufrac_park_after_or_is_refused() {
    let server = Server::start().await;
    // Accepted: the variable is set, as written.
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/park-after": "30s"}),
        json!([container("main")]),
    ));
    let answer = server.mutate(&review).await;
    let env = env_of(&patched(&review, &answer)["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_PARK_AFTER"), Some("30s"));
    assert_eq!(env.len(), 5, "{env:?}");
    assert!(answer["response"].get("warnings").is_none(), "{answer}");

    // An author-written value is replaced by the annotation's, with a warning.
    let mut main = container("main");
    main["env"] = json!([{"name": "GPUFRAC_PARK_AFTER", "value": "1s"}]);
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/park-after": "5m"}),
        json!([main.clone()]),
    ));
    let answer = server.mutate(&review).await;
    let env = env_of(&patched(&review, &answer)["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_PARK_AFTER"), Some("5m"));
    assert!(warnings(&answer).iter().any(|w| w.contains("GPUFRAC_PARK_AFTER")), "{answer}");

    // Absent: no variable, and the author cannot make the pod parkable without it.
    for containers in [json!([container("main")]), json!([main])] {
        let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), containers));
        let env = env_of(&patched(&review, &server.mutate(&review).await)["spec"]["containers"][0]);
        assert_eq!(env_value(&env, "GPUFRAC_PARK_AFTER"), None, "{env:?}");
    }

    // Refused, naming the annotation and the value.
    for (annotations, expected) in [
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/park-after": "soon"}),
            r#"gpufrac.io/park-after="soon": expected a duration such as 30s, 500ms or 2m"#,
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/park-after": "30"}),
            r#"gpufrac.io/park-after="30""#,
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/park-after": ""}),
            r#"gpufrac.io/park-after="""#,
        ),
        (json!({"gpufrac.io/park-after": "30s"}), "gpufrac.io/gpu-fraction is missing"),
    ] {
        let review = create(pod(annotations.clone(), json!([container("main")])));
        let message = refusal(&server.mutate(&review).await);
        assert!(message.contains(expected), "{annotations}: {message:?} lacks {expected:?}");
        assert!(message.contains("gpufrac.io/park-after"), "{annotations}: {message:?}");
    }
    server.stop().await;
}

#[tokio::test]
async fn compute_fractions_set_gpufrac_compute_variables_or_are_refused() {
    let server = Server::start().await;
    // Accepted: both variables, written as percentages; an author's own value replaced.
    let mut main = container("main");
    main["env"] = json!([{"name": "GPUFRAC_COMPUTE_REQUEST", "value": "100%"}]);
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/compute-fraction": "0.3",
               "gpufrac.io/compute-fraction-limit": "80%"}),
        json!([main.clone()]),
    ));
    let answer = server.mutate(&review).await;
    let env = env_of(&patched(&review, &answer)["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_COMPUTE_REQUEST"), Some("30%"));
    assert_eq!(env_value(&env, "GPUFRAC_COMPUTE_LIMIT"), Some("80%"));
    assert!(warnings(&answer).iter().any(|w| w.contains("GPUFRAC_COMPUTE_REQUEST")), "{answer}");

    // A request alone: only the request (the shim lets it use idle time up to the GPU).
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/compute-fraction": "12.5%"}),
        json!([container("main")]),
    ));
    let env = env_of(&patched(&review, &server.mutate(&review).await)["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_COMPUTE_REQUEST"), Some("12.5%"));
    assert_eq!(env_value(&env, "GPUFRAC_COMPUTE_LIMIT"), None);

    // Absent: the author cannot give the pod a compute share.
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!([main])));
    let env = env_of(&patched(&review, &server.mutate(&review).await)["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_COMPUTE_REQUEST"), None, "{env:?}");

    // Refused, naming the annotation and the value.
    for (annotations, expected) in [
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/compute-fraction": "130%"}),
            r#"gpufrac.io/compute-fraction="130%": a share is at most one whole GPU (100% or 1.0)"#,
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/compute-fraction-limit": "lots"}),
            r#"gpufrac.io/compute-fraction-limit="lots": expected a share of one GPU's time"#,
        ),
        (
            json!({"gpufrac.io/gpu-fraction": "0.25", "gpufrac.io/compute-fraction": "50%",
                   "gpufrac.io/compute-fraction-limit": "0.4"}),
            r#"gpufrac.io/compute-fraction-limit="0.4": the limit must be at least gpufrac.io/compute-fraction (50%)"#,
        ),
        (json!({"gpufrac.io/compute-fraction": "50%"}), "gpufrac.io/gpu-fraction is missing"),
    ] {
        let review = create(pod(annotations.clone(), json!([container("main")])));
        let message = refusal(&server.mutate(&review).await);
        assert!(message.contains(expected), "{annotations}: {message:?} lacks {expected:?}");
    }
    server.stop().await;
}

#[tokio::test]
async fn pods_without_the_annotation_pass_unchanged() {
    let server = Server::start().await;
    for annotations in [Value::Null, json!({}), json!({"example.com/x": "0.5"})] {
        let review = create(pod(annotations, json!([container("main")])));
        assert_allowed_unchanged(&server.mutate(&review).await);
    }
    // No metadata at all.
    let review = create(json!({"spec": {"containers": [container("main")]}}));
    assert_allowed_unchanged(&server.mutate(&review).await);
    server.stop().await;
}

#[tokio::test]
async fn other_kinds_and_operations_pass_unchanged() {
    let server = Server::start().await;
    let annotations = json!({"gpufrac.io/gpu-fraction": "0.25"});

    let mut deployment = create(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "annotations": annotations},
        "spec": {"template": {"metadata": {"annotations": annotations}}},
    }));
    deployment["request"]["kind"] = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
    assert_allowed_unchanged(&server.mutate(&deployment).await);

    // A Pod-named kind of another group is not a Pod.
    let mut other = create(pod(annotations.clone(), json!([container("main")])));
    other["request"]["kind"] = json!({"group": "example.com", "version": "v1", "kind": "Pod"});
    assert_allowed_unchanged(&server.mutate(&other).await);

    for operation in ["UPDATE", "DELETE", "CONNECT"] {
        let mut review = create(pod(annotations.clone(), json!([container("main")])));
        review["request"]["operation"] = json!(operation);
        assert_allowed_unchanged(&server.mutate(&review).await);
    }
    // Even a bad value passes on update: the share was fixed at creation.
    let mut update = create(pod(json!({"gpufrac.io/gpu-fraction": "9"}), json!([container("main")])));
    update["request"]["operation"] = json!("UPDATE");
    assert_allowed_unchanged(&server.mutate(&update).await);
    server.stop().await;
}

#[tokio::test]
async fn bad_requests_get_http_errors() {
    let server = Server::start().await;
    let json_type = Some("application/json");

    // Not JSON, not an AdmissionReview, the wrong version, no request, no uid.
    let bodies: &[(&str, &str)] = &[
        ("{not json", "not JSON"),
        ("[]", "expected a JSON object"),
        (
            r#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}}"#,
            "admission.k8s.io/v1",
        ),
        (r#"{"apiVersion":"admission.k8s.io/v1","kind":"Pod","request":{"uid":"x"}}"#, "kind"),
        (r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#, "request"),
        (r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{}}"#, "request.uid"),
    ];
    for (body, expected) in bodies {
        for path in ["/mutate", "/validate"] {
            let answer = server.request(Method::POST, path, json_type, body.to_string()).await;
            assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{path} {body}");
            assert!(answer.text().contains(expected), "{path} {body}: {}", answer.text());
        }
    }

    let review = create(pod(json!({}), json!([container("main")]))).to_string();
    let answer = server.request(Method::POST, "/mutate", Some("text/plain"), review.clone()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let answer = server.request(Method::POST, "/mutate", None, review.clone()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // A charset parameter is fine.
    let answer = server
        .request(Method::POST, "/mutate", Some("application/json; charset=utf-8"), review.clone())
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());

    let answer = server.request(Method::GET, "/mutate", None, "").await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(answer.headers["allow"], "POST");
    // /validate checks DRA objects; a pod passes it unchanged.
    let answer = server.request(Method::POST, "/validate", json_type, review.clone()).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let answer = server.request(Method::GET, "/validate", None, "").await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(answer.headers["allow"], "POST");
    let answer = server.request(Method::POST, "/validating", json_type, review.clone()).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    let answer = server.request(Method::GET, "/", None, "").await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    let answer = server.request(Method::POST, "/healthz", None, "").await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    server.stop().await;
}

#[tokio::test]
async fn bodies_over_one_mib_are_refused() {
    let server = Server::start().await;
    // A real review, padded with a big annotation just over the limit.
    let padding = "x".repeat(MAX_BODY_BYTES);
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.5", "padding": padding}),
        json!([container("main")]),
    ));
    let answer = server.request(Method::POST, "/mutate", Some("application/json"), review.to_string()).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", answer.text());

    // Without a Content-Length (chunked), the limit holds while reading.
    let tcp = TcpStream::connect(server.addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let mut tls = server.connector.connect(name, tcp).await.expect("handshake");
    let chunk = vec![b' '; 64 * 1024];
    let mut raw = b"POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                    transfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..(MAX_BODY_BYTES / chunk.len() + 1) {
        raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        raw.extend_from_slice(&chunk);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    tls.write_all(&raw).await.expect("write");
    let mut head = vec![0; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut head))
        .await
        .expect("an answer in time")
        .expect("read");
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    drop(tls);

    // Just under the limit is served.
    let mut review =
        create(pod(json!({"gpufrac.io/gpu-fraction": "0.5", "padding": ""}), json!([container("main")])));
    let room = MAX_BODY_BYTES - review.to_string().len();
    review["request"]["object"]["metadata"]["annotations"]["padding"] = json!("y".repeat(room));
    assert_eq!(review.to_string().len(), MAX_BODY_BYTES);
    let answer = server.mutate(&review).await;
    assert_eq!(answer["response"]["allowed"], true);
    server.stop().await;
}

#[tokio::test]
async fn healthz() {
    let server = Server::start().await;
    let answer = server.request(Method::GET, "/healthz", None, "").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text().trim(), "ok");
    server.stop().await;
}

#[tokio::test]
async fn broken_clients_do_not_stop_the_server() {
    let server = Server::start().await;

    // Plain HTTP on the TLS port.
    let mut tcp = TcpStream::connect(server.addr).await.expect("connect");
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut sink)).await;
    drop(tcp);

    // A connection closed mid-handshake, and one that never speaks.
    let mut tcp = TcpStream::connect(server.addr).await.expect("connect");
    tcp.write_all(&[0x16, 0x03, 0x01, 0x00]).await.expect("write");
    drop(tcp);
    let _idle = TcpStream::connect(server.addr).await.expect("connect");

    // A client that does not trust the server's certificate.
    let stranger = Pki::new();
    let tcp = TcpStream::connect(server.addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let refused = connector(&stranger.ca_der).connect(name, tcp).await;
    assert!(refused.is_err());

    // TLS, then garbage instead of HTTP.
    let tcp = TcpStream::connect(server.addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let mut tls = server.connector.connect(name, tcp).await.expect("handshake");
    tls.write_all(b"\x00\x01garbage\r\n\r\n").await.expect("write");
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut sink)).await;
    let head = String::from_utf8_lossy(&sink);
    assert!(head.is_empty() || head.starts_with("HTTP/1.1 400"), "{head}");

    // Still serving.
    let answer = server.request(Method::GET, "/healthz", None, "").await;
    assert_eq!(answer.status, StatusCode::OK);
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.5"}), json!([container("main")])));
    patched(&review, &server.mutate(&review).await);
    server.stop().await;
}

/// Taken by the tests that flood the server, so that they do not flood it at once: each
/// measures answers beside its own flood, on a machine of perhaps two cores.
static FLOOD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How a staller holds its connection.
#[derive(Clone, Copy)]
enum Stall {
    /// Opens TCP and never sends a ClientHello.
    Silent,
    /// Sends a ClientHello, then never answers the server's flight.
    MidHandshake,
}

/// Connections that hold their slot without finishing the TLS handshake, each renewed
/// at once when the server drops it; they stop when this is dropped.
struct Stallers {
    _tasks: JoinSet<()>,
    /// How many of them connected at least once.
    started: Arc<AtomicUsize>,
    count: usize,
}

impl Stallers {
    /// `count` stallers connecting to `addr` from the loopback addresses `sources` in turn.
    fn start(addr: std::net::SocketAddr, sources: &[Ipv4Addr], count: usize, stall: Stall) -> Stallers {
        let client = Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("protocol versions")
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        );
        let started = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        for i in 0..count {
            let source = sources[i % sources.len()];
            let client = client.clone();
            let started = started.clone();
            tasks.spawn(async move {
                let mut first = true;
                loop {
                    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
                    let connected = match socket.bind((source, 0).into()) {
                        Ok(()) => socket.connect(addr).await,
                        Err(e) => Err(e),
                    };
                    let Ok(mut tcp) = connected else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    if std::mem::take(&mut first) {
                        started.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Stall::MidHandshake = stall {
                        let name = ServerName::try_from("localhost").expect("name");
                        let mut tls = rustls::ClientConnection::new(client.clone(), name).expect("client");
                        let mut hello = Vec::new();
                        tls.write_tls(&mut hello).expect("ClientHello");
                        let _ = tcp.write_all(&hello).await;
                    }
                    // Whatever the server sends is left unanswered, until it closes.
                    let mut sink = vec![0; 16 * 1024];
                    while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
                }
            });
        }
        Stallers { _tasks: tasks, started, count }
    }

    /// Waits until every staller has connected (and then a little more, for the server to
    /// accept them).
    async fn connected(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.started.load(Ordering::Relaxed) < self.count {
            assert!(tokio::time::Instant::now() < deadline, "the stallers did not all connect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Ten times in a row, `/healthz` and a real AdmissionReview each answer within 2 s;
/// returns the slowest answer.
async fn answers_within_two_seconds(server: &Server) -> Duration {
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.5"}), json!([container("main")])));
    let mut slowest = Duration::ZERO;
    for round in 0..10 {
        let started = std::time::Instant::now();
        let health =
            tokio::time::timeout(Duration::from_secs(2), server.request(Method::GET, "/healthz", None, ""))
                .await
                .unwrap_or_else(|_| panic!("round {round}: /healthz took over 2 s"));
        assert_eq!(health.status, StatusCode::OK);
        slowest = slowest.max(started.elapsed());
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(2), server.mutate(&review))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the review took over 2 s"));
        slowest = slowest.max(started.elapsed());
        patched(&review, &answer);
    }
    slowest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_from_many_peers_cannot_take_every_slot() {
    let _flood = FLOOD.lock().await;
    let server = Server::start().await;
    // 300 connections from 10 addresses, 30 each: under the per-peer cap, over the slots.
    let sources: Vec<Ipv4Addr> = (2..12).map(|last| Ipv4Addr::new(127, 0, 0, last)).collect();
    let silent = Stallers::start(server.addr, &sources, 150, Stall::Silent);
    let talking = Stallers::start(server.addr, &sources, 150, Stall::MidHandshake);
    silent.connected().await;
    talking.connected().await;
    let slowest = answers_within_two_seconds(&server).await;
    eprintln!("slowest answer beside 300 stalled handshakes from 10 peers: {slowest:?}");
    drop((silent, talking));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_holds_at_most_its_share_of_connections() {
    let _flood = FLOOD.lock().await;
    let server = Server::start().await;
    let staller = Ipv4Addr::new(127, 0, 0, 2);
    let stalled = Stallers::start(server.addr, &[staller], 300, Stall::Silent);
    stalled.connected().await;
    let slowest = answers_within_two_seconds(&server).await;
    eprintln!("slowest answer beside 300 stalled handshakes from one peer: {slowest:?}");
    drop(stalled);

    // Exactly the cap is held; one more connection is closed at once.
    let held = Stallers::start(server.addr, &[staller], webhook::MAX_CONNECTIONS_PER_PEER, Stall::Silent);
    held.connected().await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind((staller, 0).into()).expect("bind");
    // The reset may come before the connect's own completion is seen.
    let closed = tokio::time::timeout(Duration::from_millis(500), async {
        if let Ok(mut tcp) = socket.connect(server.addr).await {
            let _ = tcp.read_to_end(&mut Vec::new()).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection over the per-peer cap was not closed at once");
    drop(held);
    server.stop().await;
}

#[tokio::test]
async fn refusal_for_a_pod_with_thousands_of_containers_is_short() {
    let server = Server::start().await;
    let containers: Vec<Value> = (0..3_500).map(|i| container(&format!("worker-{i:04}"))).collect();
    let review = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.5", "gpufrac.io/container": "nope"}),
        Value::Array(containers),
    ));
    let answer = server.request(Method::POST, "/mutate", Some("application/json"), review.to_string()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.body.len() < 4096, "{} bytes", answer.body.len());
    let message = refusal(&serde_json::from_slice(&answer.body).expect("JSON"));
    assert!(message.contains(r#"gpufrac.io/container="nope""#), "{message}");
    assert!(message.contains(r#""worker-0000""#) && message.contains("and 3490 more"), "{message}");
    server.stop().await;
}

#[tokio::test]
async fn shutdown_stops_accepting() {
    let server = Server::start().await;
    let addr = server.addr;
    let answer = server.request(Method::GET, "/healthz", None, "").await;
    assert_eq!(answer.status, StatusCode::OK);
    server.stop().await;
    assert!(TcpStream::connect(addr).await.is_err());
}

/// The message of a `load_tls` error, asserting that it names `path`.
fn tls_error(cert: &Path, key: &Path, path: &Path) -> String {
    let err = match load_tls(cert, key) {
        Ok(_) => panic!("load_tls({cert:?}, {key:?}) succeeded"),
        Err(err) => err,
    };
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "{message:?} does not name {path:?}");
    message
}

#[test]
fn load_tls_errors_name_the_file() {
    let pki = Pki::new();
    let (cert, key) = (pki.cert(), pki.key());
    assert!(load_tls(&cert, &key).is_ok());

    let missing = pki.path("missing.pem");
    let message = tls_error(&missing, &key, &missing);
    assert!(message.contains("TLS certificate") && message.contains("does not exist"));
    let message = tls_error(&cert, &missing, &missing);
    assert!(message.contains("TLS private key") && message.contains("does not exist"));

    // A directory cannot be read as a file.
    let dir = pki.dir.path().to_path_buf();
    let message = tls_error(&dir, &key, &dir);
    assert!(message.contains("cannot read"), "{message}");

    let empty = pki.write("empty.pem", "");
    let message = tls_error(&empty, &key, &empty);
    assert!(message.contains("no certificate"), "{message}");
    let message = tls_error(&cert, &empty, &empty);
    assert!(message.contains("no private key"), "{message}");

    // Swapped files get a hint.
    let message = tls_error(&key, &cert, &key);
    assert!(message.contains("no certificate") && message.contains("swapped"), "{message}");
    let message = tls_error(&cert, &cert, &cert);
    assert!(message.contains("no private key") && message.contains("swapped"), "{message}");

    // Broken PEM.
    let broken = pki.write("broken.pem", "-----BEGIN CERTIFICATE-----\nnot base64!\n");
    let message = tls_error(&broken, &key, &broken);
    assert!(message.contains("not valid PEM"), "{message}");

    // A key that is not the certificate's.
    let other = pki.write("other.key", KeyPair::generate().expect("key").serialize_pem());
    let message = tls_error(&cert, &other, &other);
    assert!(message.contains("does not match"), "{message}");
    assert!(message.contains(&cert.display().to_string()), "{message}");

    // The error is a std error with a source chain where there is a cause.
    let err = load_tls(&dir, &key).expect_err("a directory is not a PEM file");
    assert!(std::error::Error::source(&err).is_some());
    assert!(matches!(err, webhook::WebhookError::Unreadable { .. }));
}

#[test]
fn review_is_pure_and_answers_malformed_input() {
    // `review` answers even a malformed body, refusing with code 400.
    let answer = review(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "request": {"uid": "u"}}));
    assert_eq!(answer["response"]["uid"], "u");
    let answer = review(&json!("nonsense"));
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["code"], 400);
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert!(webhook::try_review(&json!("nonsense")).is_err());
}

// ---- The pod's author sets none of gpufrac's variables ----

/// An AdmissionReview as kube-apiserver 1.31 sends it for `kubectl apply` of a pod whose
/// author wrote gpufrac's variables into the GPU container: plain values, a
/// `secretKeyRef`, a `fieldRef`, duplicates, and the device plugin's `LD_PRELOAD` and
/// `NVIDIA_VISIBLE_DEVICES`.
const AUTHOR_WROTE_OUR_VARIABLES: &str = r#"{
  "kind": "AdmissionReview",
  "apiVersion": "admission.k8s.io/v1",
  "request": {
    "uid": "3a1c1e0e-5d0c-4f7a-9a57-1d0f6b0c2b11",
    "kind": {"group": "", "version": "v1", "kind": "Pod"},
    "resource": {"group": "", "version": "v1", "resource": "pods"},
    "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
    "requestResource": {"group": "", "version": "v1", "resource": "pods"},
    "name": "greedy",
    "namespace": "ml",
    "operation": "CREATE",
    "userInfo": {"username": "alice", "uid": "f3b2c1d0-0000-4000-8000-000000000001",
                 "groups": ["developers", "system:authenticated"]},
    "object": {
      "kind": "Pod",
      "apiVersion": "v1",
      "metadata": {
        "name": "greedy",
        "namespace": "ml",
        "creationTimestamp": null,
        "annotations": {
          "gpufrac.io/gpu-fraction": "0.25",
          "kubectl.kubernetes.io/last-applied-configuration": "{}"
        },
        "managedFields": [{"manager": "kubectl-client-side-apply", "operation": "Update",
                           "apiVersion": "v1", "time": "2026-11-23T10:00:00Z",
                           "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}]
      },
      "spec": {
        "containers": [{
          "name": "train",
          "image": "registry.example/train:1",
          "env": [
            {"name": "APP_MODE", "value": "train"},
            {"name": "GPUFRAC_MEMORY_REQUEST", "value": "1"},
            {"name": "GPUFRAC_MEMORY_LIMIT", "value": "1"},
            {"name": "GPUFRAC_RESOLVER", "value": "priority"},
            {"name": "GPUFRAC_PRIORITY", "value": "1000000"},
            {"name": "GPUFRAC_GROUP", "value": "gpufrac-aaaaaaaa-0-50"},
            {"name": "GPUFRAC_POD", "value": "kube-system/coredns"},
            {"name": "GPUFRAC_ARBITER_SOCKET", "value": "/tmp/fake.sock"},
            {"name": "LD_PRELOAD", "value": "/tmp/not-the-shim.so"},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "GPUFRAC_GROUP", "valueFrom": {"secretKeyRef": {"name": "stolen", "key": "group"}}},
            {"name": "GPUFRAC_MEMORY_REQUEST", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.annotations['x']"}}},
            {"name": "GPUFRAC_PRIORITY", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
            {"name": "GPUFRAC_SOMETHING_NEW", "value": "x"},
            {"name": "GPUFRAC_WAIT_TIMEOUT", "value": "5s"},
            {"name": "GPUFRAC_LOG", "value": "debug"},
            {"name": "MODE_COPY", "value": "$(APP_MODE)"}
          ],
          "resources": {"limits": {"memory": "4Gi"}},
          "terminationMessagePath": "/dev/termination-log",
          "terminationMessagePolicy": "File",
          "imagePullPolicy": "IfNotPresent"
        }],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "priority": 0,
        "enableServiceLinks": true,
        "preemptionPolicy": "PreemptLowerPriority"
      },
      "status": {}
    },
    "oldObject": null,
    "dryRun": false,
    "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1",
                "fieldManager": "kubectl-client-side-apply", "fieldValidation": "Strict"}
  }
}"#;

/// The warnings of an answer, as strings.
fn warnings(answer: &Value) -> Vec<String> {
    answer["response"]["warnings"]
        .as_array()
        .map(|w| w.iter().map(|w| w.as_str().expect("a string warning").to_owned()).collect())
        .unwrap_or_default()
}

/// The names of a container's env entries, in order.
fn env_names(container: &Value) -> Vec<String> {
    env_of(container).into_iter().map(|(name, _)| name).collect()
}

#[tokio::test]
async fn the_webhook_overwrites_or_removes_every_variable_it_owns() {
    let server = Server::start().await;
    let review: Value = serde_json::from_str(AUTHOR_WROTE_OUR_VARIABLES).expect("the review is JSON");
    let answer = server.mutate(&review).await;
    let result = patched(&review, &answer);
    let train = &result["spec"]["containers"][0];
    let env = env_of(train); // also: no name twice

    // What the webhook sets comes from the annotations and spec.priority, not the author.
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_LIMIT"), Some("0.25"));
    assert_eq!(env_value(&env, "GPUFRAC_RESOLVER"), Some("wait"));
    assert_eq!(env_value(&env, "GPUFRAC_PRIORITY"), Some("0"));
    assert_eq!(env_value(&env, "GPUFRAC_POD"), Some("ml/greedy"));
    // What the device plugin's Allocate sets is gone from the spec, value or valueFrom,
    // since the container's env would win over Allocate's.
    for name in [
        "GPUFRAC_MEMORY_REQUEST",
        "GPUFRAC_GROUP",
        "GPUFRAC_ARBITER_SOCKET",
        "LD_PRELOAD",
        "NVIDIA_VISIBLE_DEVICES",
        "GPUFRAC_SOMETHING_NEW",
    ] {
        assert_eq!(env_value(&env, name), None, "{name} is still in {env:?}");
    }
    // The author's own settings stay, in their order; ours stand where the author's
    // first one stood.
    assert_eq!(
        env_names(train),
        [
            "APP_MODE",
            "GPUFRAC_MEMORY_LIMIT",
            "GPUFRAC_RESOLVER",
            "GPUFRAC_PRIORITY",
            "GPUFRAC_POD",
            "GPUFRAC_WAIT_TIMEOUT",
            "GPUFRAC_LOG",
            "MODE_COPY",
        ]
    );
    assert_eq!(env_value(&env, "GPUFRAC_WAIT_TIMEOUT"), Some("5s"));
    assert_eq!(env_value(&env, "GPUFRAC_LOG"), Some("debug"));
    assert_eq!(env_value(&env, "MODE_COPY"), Some("$(APP_MODE)"));
    assert_eq!(train["resources"]["limits"]["gpufrac.io/gpu"], "25");
    assert_eq!(train["resources"]["limits"]["memory"], "4Gi");

    // The author is told what was taken over.
    let warnings = warnings(&answer);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].starts_with(
        "container \"train\": env \"GPUFRAC_MEMORY_LIMIT\", \"GPUFRAC_RESOLVER\", \"GPUFRAC_PRIORITY\", \
         \"GPUFRAC_POD\" replaced"
    ));
    assert!(warnings[1].starts_with(
        "container \"train\": env \"GPUFRAC_MEMORY_REQUEST\", \"GPUFRAC_GROUP\", \"GPUFRAC_ARBITER_SOCKET\", \
         \"LD_PRELOAD\", \"NVIDIA_VISIBLE_DEVICES\", \"GPUFRAC_SOMETHING_NEW\" removed"
    ));
    server.stop().await;
}

#[test]
fn the_patch_never_adds_what_the_device_plugin_sets() {
    // The same pod through the pure function: the patch itself never names the plugin's
    // variables (an `add` of them would be the author's value under another name).
    let request: Value = serde_json::from_str(AUTHOR_WROTE_OUR_VARIABLES).expect("JSON");
    let answer = review(&request);
    let b64 = answer["response"]["patch"].as_str().expect("a patch");
    let text = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).expect("base64"))
        .expect("UTF-8");
    for name in
        ["GPUFRAC_MEMORY_REQUEST", "GPUFRAC_GROUP", "GPUFRAC_ARBITER_SOCKET", "LD_PRELOAD", "stolen", "all"]
    {
        assert!(!text.contains(&format!("\"{name}\"")), "the patch names {name}: {text}");
    }
}

#[tokio::test]
async fn no_container_of_a_gpufrac_pod_sets_gpufrac_variables() {
    let server = Server::start().await;
    let mut main = container("main");
    main["env"] = json!([{"name": "A", "value": "1"}]);
    let mut sidecar = container("sidecar");
    // A sidecar could preload the shim with its own settings: they are removed; its own
    // LD_PRELOAD is not gpufrac's (it gets no shares, no shim and no socket) and stays.
    sidecar["env"] = json!([
        {"name": "GPUFRAC_MEMORY_REQUEST", "value": "1"},
        {"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so"},
        {"name": "GPUFRAC_GROUP", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        {"name": "GPUFRAC_LOG", "value": "info"},
    ]);
    // A container that asks for gpufrac.io/gpu itself gets shares too: the device plugin's
    // variables are removed from it as from the chosen one.
    let mut helper = container("helper");
    helper["resources"] = json!({"limits": {"gpufrac.io/gpu": "10"}});
    helper["env"] = json!([
        {"name": "LD_PRELOAD", "value": "/tmp/x.so"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "KEEP", "value": "yes"},
    ]);
    let mut pod = pod(json!({"gpufrac.io/gpu-fraction": "0.5"}), json!([main, sidecar, helper]));
    let mut init = container("fetch-weights");
    init["env"] = json!([
        {"name": "GPUFRAC_PRIORITY", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]);
    pod["spec"]["initContainers"] = json!([init, container("untouched-init")]);
    let review = create(pod);
    let answer = server.mutate(&review).await;
    let result = patched(&review, &answer);

    let containers = &result["spec"]["containers"];
    assert_eq!(
        env_names(&containers[0]),
        ["A", "GPUFRAC_MEMORY_LIMIT", "GPUFRAC_RESOLVER", "GPUFRAC_PRIORITY", "GPUFRAC_POD"]
    );
    assert_eq!(
        env_of(&containers[1]),
        [
            ("LD_PRELOAD".to_owned(), "/usr/lib/libjemalloc.so".to_owned()),
            ("GPUFRAC_LOG".to_owned(), "info".to_owned()),
        ]
    );
    assert_eq!(env_of(&containers[2]), [("KEEP".to_owned(), "yes".to_owned())]);
    assert_eq!(containers[2]["resources"], json!({"limits": {"gpufrac.io/gpu": "10"}}));
    let inits = &result["spec"]["initContainers"];
    assert_eq!(inits[0]["env"], json!([]));
    assert_eq!(inits[1], container("untouched-init"));

    let warnings = warnings(&answer);
    let expected = [
        "init container \"fetch-weights\": env \"GPUFRAC_PRIORITY\" removed",
        "container \"sidecar\": env \"GPUFRAC_MEMORY_REQUEST\", \"GPUFRAC_GROUP\" removed",
        "container \"helper\": env \"LD_PRELOAD\", \"NVIDIA_VISIBLE_DEVICES\" removed",
    ];
    assert_eq!(warnings.len(), expected.len(), "{warnings:?}");
    for (warning, expected) in warnings.iter().zip(expected) {
        assert!(warning.starts_with(expected), "{warning:?} should start with {expected:?}");
    }
    server.stop().await;
}

#[tokio::test]
async fn env_from_that_could_set_gpufrac_variables_is_refused() {
    let server = Server::start().await;
    let with_env_from = |env_from: Value| {
        let mut main = container("main");
        main["envFrom"] = env_from;
        create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!([main])))
    };

    // No prefix: a ConfigMap's keys reach the container as they are.
    let message =
        refusal(&server.mutate(&with_env_from(json!([{"configMapRef": {"name": "app-config"}}]))).await);
    assert!(
        message.starts_with("container \"main\": envFrom[0] (configMapRef \"app-config\") has no prefix"),
        "{message}"
    );
    assert!(message.contains("such as APP_"), "{message}");
    // A prefix that, with a key, makes one of gpufrac's names: GPU + FRAC_GROUP,
    // LD_ + PRELOAD, GPUFRAC_ + anything.
    for prefix in ["GPU", "LD_", "GPUFRAC_", "GPUFRAC_X", "NVIDIA_"] {
        let answer = server
            .mutate(&with_env_from(json!([
                {"prefix": "APP_", "configMapRef": {"name": "fine"}},
                {"prefix": prefix, "secretRef": {"name": "tokens", "optional": true}},
            ])))
            .await;
        let message = refusal(&answer);
        assert!(
            message.starts_with(&format!(
                "container \"main\": envFrom[1] (secretRef \"tokens\") has prefix \"{prefix}\""
            )),
            "{prefix}: {message}"
        );
    }
    // Every such source is named.
    let message = refusal(
        &server
            .mutate(&with_env_from(json!([
                {"configMapRef": {"name": "a"}},
                {"secretRef": {"name": "b"}},
            ])))
            .await,
    );
    assert!(
        message.contains("envFrom[0] (configMapRef \"a\")")
            && message.contains("envFrom[1] (secretRef \"b\")")
    );

    // A safe prefix is kept as written.
    let review = with_env_from(json!([{"prefix": "APP_", "configMapRef": {"name": "app-config"}}]));
    let result = patched(&review, &server.mutate(&review).await);
    assert_eq!(
        result["spec"]["containers"][0]["envFrom"],
        json!([{"prefix": "APP_", "configMapRef": {"name": "app-config"}}])
    );

    // A container without shares may use envFrom as it likes: whatever it sets, it gets no
    // shim, no socket and no entitlement from the arbiter.
    let mut sidecar = container("sidecar");
    sidecar["envFrom"] = json!([{"configMapRef": {"name": "sidecar-config"}}]);
    let review = create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!([container("main"), sidecar])));
    let result = patched(&review, &server.mutate(&review).await);
    assert_eq!(
        result["spec"]["containers"][1]["envFrom"],
        json!([{"configMapRef": {"name": "sidecar-config"}}])
    );

    // An init container that asks for gpufrac.io/gpu itself gets shares: the same rule.
    let mut init = container("warmup");
    init["resources"] = json!({"requests": {"gpufrac.io/gpu": "5"}, "limits": {"gpufrac.io/gpu": "5"}});
    init["envFrom"] = json!([{"secretRef": {"name": "s"}}]);
    let mut pod = pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!([container("main")]));
    pod["spec"]["initContainers"] = json!([init]);
    let message = refusal(&server.mutate(&create(pod)).await);
    assert!(
        message.starts_with("init container \"warmup\": envFrom[0] (secretRef \"s\") has no prefix"),
        "{message}"
    );
    server.stop().await;
}

#[tokio::test]
async fn pods_without_the_annotation_keep_what_their_author_wrote() {
    // The webhook's contract: a pod that does not ask for a fraction passes unchanged,
    // whatever its env says (the arbiter caps such a pod by the shares the kubelet gave
    // it, not by its env).
    let server = Server::start().await;
    let mut main = container("main");
    main["env"] = json!([
        {"name": "GPUFRAC_MEMORY_REQUEST", "value": "1"},
        {"name": "LD_PRELOAD", "value": "/x.so"},
    ]);
    main["envFrom"] = json!([{"configMapRef": {"name": "anything"}}]);
    let review = create(pod(json!({"example.com/team": "a"}), json!([main])));
    assert_allowed_unchanged(&server.mutate(&review).await);
    server.stop().await;
}

#[test]
fn takeover_warnings_stay_few_and_short() {
    // Hundreds of sidecars each writing many GPUFRAC_ names: a bounded answer.
    let env: Vec<Value> =
        (0..50).map(|i| json!({"name": format!("GPUFRAC_X{i}_{}", "Y".repeat(200)), "value": "1"})).collect();
    let containers: Vec<Value> = (0..300)
        .map(|i| {
            let mut c = container(&format!("c{i}"));
            c["env"] = json!(env);
            c
        })
        .collect();
    let answer = review(&create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!(containers))));
    let warnings = warnings(&answer);
    assert!(warnings.len() <= 12, "{} warnings", warnings.len());
    assert!(warnings.last().is_some_and(|w| w.contains("more warnings")), "{warnings:?}");
    for warning in &warnings {
        assert!(warning.len() < 1_200, "{} bytes: {warning}", warning.len());
    }
    // Every container's entries are still removed.
    let result =
        patched(&create(pod(json!({"gpufrac.io/gpu-fraction": "0.25"}), json!(containers))), &answer);
    for c in result["spec"]["containers"].as_array().expect("containers").iter().skip(1) {
        assert_eq!(c["env"], json!([]));
    }
}

#[test]
fn a_pod_already_patched_is_patched_to_the_same_and_warned_of_nothing() {
    // Generated name too, so the downward-API helper is part of it.
    let mut first = pod(
        json!({"gpufrac.io/gpu-fraction": "0.3", "gpufrac.io/resolver": "swap"}),
        json!([container("main"), container("sidecar")]),
    );
    first["metadata"]["name"] = Value::Null;
    first["metadata"]["generateName"] = json!("trainer-");
    let review1 = create(first);
    let once = patched(&review1, &review(&review1));
    let review2 = create(once.clone());
    let answer = review(&review2);
    assert_eq!(patched(&review2, &answer), once);
    assert!(warnings(&answer).is_empty(), "{answer}");
}

#[test]
fn the_answer_is_an_admission_review_the_api_server_reads() {
    // The wire format: kube's AdmissionResponse, with the patch in base64 (as Go's []byte).
    let sent = create(pod(json!({"gpufrac.io/gpu-fraction": "0.5"}), json!([container("main")])));
    let answer = review(&sent);
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["uid"], sent["request"]["uid"]);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    assert!(answer["response"]["patch"].is_string(), "{answer}");
    patched(&sent, &answer);
    // kube's own types read the rest back (they expect the patch as an array of numbers,
    // which the API server does not read: kube-rs/kube#1781).
    let mut rest = answer.clone();
    rest["response"].as_object_mut().expect("an object").remove("patch");
    let read: kube::core::admission::AdmissionReview<kube::core::DynamicObject> =
        serde_json::from_value(rest).expect("kube reads the answer");
    assert!(read.response.expect("a response").allowed);

    // A Pod CREATE whose object is not a Pod (a priority that is no number) is refused,
    // saying why.
    let message = refusal(&review(&create(json!({
        "metadata": {"name": "x", "annotations": {"gpufrac.io/gpu-fraction": "0.5"}},
        "spec": {"containers": [container("main")], "priority": "high"},
    }))));
    assert!(
        message.starts_with("request.object is not a Pod: ") && message.contains("\"high\""),
        "{message}"
    );
    // A request kube cannot read (no userInfo, which every API server sends) is no review.
    let mut no_user = sent.clone();
    no_user["request"].as_object_mut().expect("an object").remove("userInfo");
    let bad = webhook::try_review(&no_user).expect_err("not a review");
    assert!(bad.to_string().contains("userInfo"), "{bad}");
}

#[test]
fn a_fraction_of_each_of_several_gpus_is_asked_as_that_many_gpus_worth_of_shares() {
    // 0.75 of each of 2 GPUs: 150 shares, which the device plugin splits 75 + 75.
    let review_json = create(pod(
        json!({"gpufrac.io/gpu-fraction": "0.75", "gpufrac.io/gpu-fraction-num-devices": "2"}),
        json!([container("server")]),
    ));
    let answer = review(&review_json);
    let pod = patched(&review_json, &answer);
    let resources = &pod["spec"]["containers"][0]["resources"];
    assert_eq!(resources["limits"]["gpufrac.io/gpu"], "150", "{pod}");
    assert_eq!(resources["requests"]["gpufrac.io/gpu"], "150", "{pod}");
    // The limit stays a fraction of each GPU.
    let env = env_of(&pod["spec"]["containers"][0]);
    assert_eq!(env_value(&env, "GPUFRAC_MEMORY_LIMIT"), Some("0.75"));
    // 3 × 0.7 = 210 shares: more than 2 GPUs hold.
    let three =
        create(pod_with(&[("gpufrac.io/gpu-fraction", "0.7"), ("gpufrac.io/gpu-fraction-num-devices", "3")]));
    let pod = patched(&three, &review(&three));
    assert_eq!(pod["spec"]["containers"][0]["resources"]["limits"]["gpufrac.io/gpu"], "210");
}

fn pod_with(annotations: &[(&str, &str)]) -> Value {
    let annotations: serde_json::Map<String, Value> =
        annotations.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
    pod(Value::Object(annotations), json!([container("server")]))
}

#[test]
fn a_fraction_across_gpus_the_device_plugin_cannot_place_is_refused_pointing_to_dra() {
    let message = refusal(&review(&create(pod_with(&[
        ("gpufrac.io/gpu-fraction", "0.25"),
        ("gpufrac.io/gpu-fraction-num-devices", "2"),
    ]))));
    assert_eq!(
        message,
        "gpufrac.io/gpu-fraction-num-devices=\"2\" with gpufrac.io/gpu-fraction=\"0.25\": the device plugin sees \
         only a count of shares (50), which one GPU can hold; ask for more than 0.5 of each GPU, or use a DRA \
         claim with count: 2 (docs/kubernetes.md#fractions-across-gpus-tensor-parallel)"
    );
    // Exactly half of each: 100 shares fit one GPU.
    let message = refusal(&review(&create(pod_with(&[
        ("gpufrac.io/gpu-fraction", "0.5"),
        ("gpufrac.io/gpu-fraction-num-devices", "2"),
    ]))));
    assert!(message.contains("(100), which one GPU can hold"), "{message}");
    let message = refusal(&review(&create(pod_with(&[
        ("gpufrac.io/gpu-fraction", "0.6"),
        ("gpufrac.io/gpu-fraction-num-devices", "3"),
    ]))));
    assert!(
        message.contains("(180), which 2 GPUs can hold; ask for more than 0.66 of each GPU"),
        "{message}"
    );
    // Not a count of GPUs.
    for bad in ["0", "17", "two", "1.5", "-2", ""] {
        let message = refusal(&review(&create(pod_with(&[
            ("gpufrac.io/gpu-fraction", "0.75"),
            ("gpufrac.io/gpu-fraction-num-devices", bad),
        ]))));
        assert_eq!(
            message,
            format!(
                "gpufrac.io/gpu-fraction-num-devices=\"{bad}\": expected a whole number of GPUs from 1 to 16"
            )
        );
    }
    // Without the fraction it would do nothing.
    let message = refusal(&review(&create(pod_with(&[("gpufrac.io/gpu-fraction-num-devices", "2")]))));
    assert!(
        message.starts_with(
            "gpufrac.io/gpu-fraction is missing: the pod sets gpufrac.io/gpu-fraction-num-devices"
        ),
        "{message}"
    );
    // One GPU is today's pod.
    let one = create(pod_with(&[
        ("gpufrac.io/gpu-fraction", "0.25"),
        ("gpufrac.io/gpu-fraction-num-devices", "1"),
    ]));
    let pod = patched(&one, &review(&one));
    assert_eq!(pod["spec"]["containers"][0]["resources"]["limits"]["gpufrac.io/gpu"], "25");
}
