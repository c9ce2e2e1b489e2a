//! A claim's configuration checked at admission, end to end: the real
//! `gpufrac-device-plugin webhook` over HTTPS (a test CA and a `localhost` certificate made
//! with rcgen, a rustls client that trusts only that CA), sent AdmissionReviews at the
//! path `examples/kubernetes/dra/config-validation.yaml` gives the API server, as the API
//! server sends them. A typo is refused with the object's field named and the kubelet
//! plugin's own words; a good claim, the examples and other drivers' configurations pass;
//! the pods' `/mutate` still answers beside it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpufrac_device_plugin::dra::config;
use gpufrac_e2e::{artifact, kubernetes_validate, ChildProcess};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// How long the webhook may take to start on a loaded machine.
const WAIT: Duration = Duration::from_secs(20);
/// The driver whose configuration the webhook reads.
const DRIVER: &str = gpufrac_common::dra::DRIVER;

/// A folder of this test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("gpufrac-dra-admission-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The webhook binary, serving on a port of its own choosing, and a client for it.
struct Webhook {
    process: ChildProcess,
    addr: SocketAddr,
    connector: TlsConnector,
    _dir: TempDir,
}

impl Webhook {
    fn start() -> Webhook {
        let dir = TempDir::new("pki");
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let cert = params.signed_by(&key, &issuer).expect("server certificate");
        let cert_path = dir.0.join("tls.crt");
        let key_path = dir.0.join("tls.key");
        std::fs::write(&cert_path, cert.pem()).expect("write the certificate");
        std::fs::write(&key_path, key.serialize_pem()).expect("write the key");

        let mut cmd = std::process::Command::new(artifact("gpufrac-device-plugin"));
        cmd.env("GPUFRAC_LOG", "info")
            .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(&cert_path)
            .arg("--tls-key")
            .arg(&key_path);
        let mut process = ChildProcess::spawn(&mut cmd);
        let addr = serving_addr(&mut process);

        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).expect("the test CA");
        let tls =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
        Webhook { process, addr, connector: TlsConnector::from(Arc::new(tls)), _dir: dir }
    }

    /// One request on a new connection: the status and the body.
    async fn request(&self, method: Method, path: &str, body: String) -> (StatusCode, Bytes) {
        let tcp = TcpStream::connect(self.addr).await.expect("connect");
        let name = ServerName::try_from("localhost").expect("server name");
        let tls = self.connector.connect(name, tcp).await.expect("TLS handshake");
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.expect("HTTP handshake");
        tokio::spawn(conn);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let response = sender.send_request(request).await.expect("response");
        let status = response.status();
        (status, response.into_body().collect().await.expect("response body").to_bytes())
    }

    /// POSTs an AdmissionReview to `path`; the answer must be a 200 AdmissionReview for the
    /// same uid. Returns its `response`.
    async fn review(&self, path: &str, review: &Value) -> Value {
        let (status, body) = self.request(Method::POST, path, review.to_string()).await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        let answer: Value = serde_json::from_slice(&body).expect("a JSON answer");
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
        assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
        assert_eq!(answer["response"]["uid"], review["request"]["uid"], "{answer}");
        answer["response"].clone()
    }
}

/// The address in the webhook's "serving" log line (it was told port 0).
fn serving_addr(process: &mut ChildProcess) -> SocketAddr {
    let deadline = Instant::now() + WAIT;
    loop {
        let stderr = process.stderr_text();
        let found = stderr
            .lines()
            .filter(|line| line.contains("webhook serving HTTPS"))
            .find_map(|line| line.split("addr=").nth(1)?.split_whitespace().next()?.parse().ok());
        if let Some(addr) = found {
            return addr;
        }
        assert!(
            Instant::now() < deadline,
            "the webhook never said where it serves: {}",
            process.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The path the ValidatingWebhookConfiguration sends DRA objects to.
fn validate_path() -> String {
    let file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes/dra/config-validation.yaml");
    let docs = kubernetes_validate::yaml_documents(&file);
    docs.iter()
        .find(|d| d["kind"] == "ValidatingWebhookConfiguration")
        .and_then(|d| d["webhooks"][0]["clientConfig"]["service"]["path"].as_str())
        .expect("config-validation.yaml names a path")
        .to_owned()
}

/// An AdmissionReview of `operation` on `object`, as the API server sends it.
fn review_of(uid: &str, operation: &str, object: &Value) -> Value {
    let (group, version) =
        object["apiVersion"].as_str().and_then(|v| v.split_once('/')).unwrap_or(("", "v1"));
    let kind = object["kind"].as_str().unwrap_or_default();
    let resource = match kind {
        "ResourceClaim" => "resourceclaims",
        "ResourceClaimTemplate" => "resourceclaimtemplates",
        "DeviceClass" => "deviceclasses",
        "Pod" => "pods",
        other => other,
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "operation": operation,
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        }
    })
}

/// A claim whose configuration list is `config`.
fn claim(version: &str, config: Value) -> Value {
    json!({
        "apiVersion": format!("resource.k8s.io/{version}"),
        "kind": "ResourceClaim",
        "metadata": {"name": "llm", "namespace": "inference"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": config,
        }}
    })
}

fn fraction_config(extra: Value) -> Value {
    let mut parameters = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig"});
    parameters.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    parameters
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typo_in_a_claims_configuration_is_refused_at_admission() {
    let webhook = Webhook::start();
    let path = validate_path();
    assert_eq!(path, "/validate");

    // A typo: refused, the object's field named, in the kubelet plugin's own words.
    let typo = fraction_config(json!({"limit": "40Gi", "resolver": "swapp"}));
    let bad = claim(
        "v1",
        json!([
            {"opaque": {"driver": "gpu.example.com", "parameters": {"whatever": 1}}},
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": typo}},
        ]),
    );
    let response = webhook.review(&path, &review_of("typo", "CREATE", &bad)).await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 400, "{response}");
    let plugin = config::parse(&typo).expect_err("the plugin refuses it too");
    assert_eq!(
        response["status"]["message"],
        format!("spec.devices.config[1].opaque.{}: {}", plugin.field, plugin.reason),
        "{response}"
    );
    assert!(
        response["status"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("spec.devices.config[1].opaque.parameters.resolver: \"swapp\"")),
        "{response}"
    );

    // A limit below the request, in a v1beta1 claim.
    let response = webhook
        .review(
            &path,
            &review_of(
                "compute",
                "CREATE",
                &claim(
                    "v1beta1",
                    json!([{"opaque": {"driver": DRIVER,
                        "parameters": fraction_config(json!({"computeRequest": "40%", "computeLimit": "20%"}))}}]),
                ),
            ),
        )
        .await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(
        response["status"]["message"],
        "spec.devices.config[0].opaque.parameters.computeLimit: \"20%\": the limit must be at least computeRequest (40%)"
    );

    // A good claim, and another driver's configuration with any parameters, pass.
    let good = claim(
        "v1",
        json!([{"opaque": {"driver": DRIVER,
            "parameters": fraction_config(json!({"limit": "0.5", "resolver": "swap", "computeRequest": "30%"}))}}]),
    );
    assert_eq!(webhook.review(&path, &review_of("good", "CREATE", &good)).await["allowed"], true);
    let others = claim("v1", json!([{"opaque": {"driver": "gpu.example.com", "parameters": {"limt": "x"}}}]));
    assert_eq!(webhook.review(&path, &review_of("others", "CREATE", &others)).await["allowed"], true);

    // The examples an operator applies pass.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes/dra");
    let mut sent = 0;
    for name in ["deviceclass.yaml", "inference-claim.yaml", "claim-template-shares.yaml"] {
        for object in kubernetes_validate::yaml_documents(&examples.join(name)) {
            if object["apiVersion"].as_str().is_some_and(|v| v.starts_with("resource.k8s.io/")) {
                let response = webhook.review(&path, &review_of(name, "CREATE", &object)).await;
                assert_eq!(response["allowed"], true, "{name}: {response}");
                sent += 1;
            }
        }
    }
    assert!(sent >= 3, "only {sent} DRA objects in the examples");

    // The pods' route answers beside it, and a GET of the new route is no review.
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
                     "spec": {"containers": [{"name": "c", "image": "x"}]}});
    assert_eq!(webhook.review("/mutate", &review_of("pod", "CREATE", &pod)).await["allowed"], true);
    let (status, _) = webhook.request(Method::GET, &path, String::new()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    // SIGTERM: a clean stop.
    let mut process = webhook.process;
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    let sent = unsafe { libc::kill(process.pid() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
    process.expect_exit_code(0);
}
