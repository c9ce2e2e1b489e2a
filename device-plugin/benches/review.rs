//! The webhook's review round trip over real HTTPS on 127.0.0.1: p50 and p99 of 300
//! AdmissionReviews, on one kept-alive connection (as the API server sends them) and on a
//! new connection each (TLS handshake included). The client sets `TCP_NODELAY`, as Go's
//! does. Run with `cargo bench -p gpufrac-device-plugin --bench review`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpufrac_device_plugin::webhook::{load_tls, serve};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// Reviews timed in each mode.
const REVIEWS: usize = 300;

fn main() {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(bench());
}

async fn bench() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("server certificate");
    std::fs::write(dir.path().join("tls.crt"), cert.pem()).expect("write");
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).expect("write");
    let tls = load_tls(&dir.path().join("tls.crt"), &dir.path().join("tls.key")).expect("load_tls");

    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, tls, async move {
        let _ = stopped.await;
    }));
    let connector = connector(ca.der().clone());
    let body = Bytes::from(review().to_string());

    let mut sender = connect(&connector, addr).await;
    for _ in 0..20 {
        round_trip(&mut sender, &body).await; // warm-up
    }
    let mut kept = Vec::with_capacity(REVIEWS);
    for _ in 0..REVIEWS {
        let started = Instant::now();
        round_trip(&mut sender, &body).await;
        kept.push(started.elapsed());
    }
    report("one kept-alive connection", &mut kept);

    let mut fresh = Vec::with_capacity(REVIEWS);
    for _ in 0..REVIEWS {
        let started = Instant::now();
        let mut sender = connect(&connector, addr).await;
        round_trip(&mut sender, &body).await;
        fresh.push(started.elapsed());
    }
    report("a new connection each (TLS handshake included)", &mut fresh);

    let _ = stop.send(());
    let _ = server.await;
}

fn connector(ca: CertificateDer<'static>) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("CA certificate");
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

async fn connect(connector: &TlsConnector, addr: std::net::SocketAddr) -> SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("TCP_NODELAY");
    let name = ServerName::try_from("localhost").expect("server name");
    let tls = connector.connect(name, tcp).await.expect("TLS handshake");
    let (sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.expect("HTTP handshake");
    tokio::spawn(conn);
    sender
}

async fn round_trip(sender: &mut SendRequest<Full<Bytes>>, body: &Bytes) {
    let request = Request::post("/mutate")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .expect("request");
    sender.ready().await.expect("the connection is open");
    let response = sender.send_request(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let answer = response.into_body().collect().await.expect("body").to_bytes();
    let answer: Value = serde_json::from_slice(&answer).expect("JSON");
    assert_eq!(answer["response"]["allowed"], true);
}

/// A pod asking for a quarter of a GPU, as the API server would send it.
fn review() -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "trainer",
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "admin", "groups": ["system:authenticated"]},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "trainer", "namespace": "ml",
                             "annotations": {"gpufrac.io/gpu-fraction": "0.25"}},
                "spec": {"containers": [{"name": "main", "image": "registry.example/train:1"}]},
            },
        },
    })
}

fn report(what: &str, times: &mut [Duration]) {
    times.sort_unstable();
    let at = |q: f64| times[((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1];
    println!(
        "review round trip over HTTPS, {what}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} reviews)",
        at(0.50).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
        times.len(),
    );
}
