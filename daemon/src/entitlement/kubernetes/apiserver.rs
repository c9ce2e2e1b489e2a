//! Reads one pod from the Kubernetes API server (`GET /api/v1/namespaces/{ns}/pods/{name}`)
//! with the pod's service account, and checks the parts gpufrac believes: its UID, the
//! container IDs the runtime gave its containers, its `gpufrac.io/` annotations and its
//! priority.
//!
//! A small HTTPS client on hyper and rustls (both already built for the webhook), not a
//! Kubernetes client library: one GET of one object is all that is needed. The token is
//! read from its file for each request, since the kubelet rotates projected tokens.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The in-cluster service account's files.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The most bytes of one pod's JSON (a pod object is limited to about 1.5 MiB by etcd).
const MAX_BODY: usize = 4 << 20;

/// Why the API server could not be used or asked.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// An environment variable the in-cluster configuration needs is missing or invalid.
    #[error("{name}={value:?}: {reason}")]
    Env {
        /// The variable.
        name: &'static str,
        /// Its value (empty when unset).
        value: String,
        /// What is expected.
        reason: &'static str,
    },
    /// A service-account file cannot be read or used.
    #[error("{what} {}: {reason}", path.display())]
    File {
        /// Which file: the service-account token or CA certificate.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The connection or the HTTP exchange failed.
    #[error("GET {url}: {reason}")]
    Request {
        /// What was asked.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// The API server answered with an error status.
    #[error("GET {url}: HTTP {status}: {message}{hint}")]
    Status {
        /// What was asked.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The API server's message (its `Status` object's), cut to a sane length.
        message: String,
        /// A hint for the admin, or empty.
        hint: &'static str,
    },
    /// The answer is not a pod gpufrac can read.
    #[error("GET {url}: {reason}")]
    BadPod {
        /// What was asked.
        url: String,
        /// What is wrong, naming the field.
        reason: String,
    },
}

/// Where the API server is and how to prove who we are to it.
#[derive(Clone)]
pub struct ApiServerConfig {
    /// Host (name or IP) and port.
    host: String,
    port: u16,
    /// TLS to the API server, trusting only the given CA; `None`: plain HTTP (tests only).
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    /// The bearer token's file, read for each request.
    token_file: PathBuf,
}

impl std::fmt::Debug for ApiServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServerConfig")
            .field("base", &self.base())
            .field("token_file", &self.token_file)
            .finish_non_exhaustive()
    }
}

impl ApiServerConfig {
    /// The in-cluster configuration, as client-go's: `KUBERNETES_SERVICE_HOST` and
    /// `KUBERNETES_SERVICE_PORT`, and the service account's `token` and `ca.crt` in
    /// `/var/run/secrets/kubernetes.io/serviceaccount`.
    pub fn in_cluster() -> Result<ApiServerConfig, ApiServerError> {
        let var = |name: &'static str| std::env::var(name).unwrap_or_default();
        let host = var("KUBERNETES_SERVICE_HOST");
        if host.is_empty() {
            return Err(ApiServerError::Env {
                name: "KUBERNETES_SERVICE_HOST",
                value: host,
                reason: "not set: not running in a Kubernetes pod (the kubelet sets it)",
            });
        }
        let port_text = var("KUBERNETES_SERVICE_PORT");
        let Ok(port) = port_text.trim().parse::<u16>() else {
            return Err(ApiServerError::Env {
                name: "KUBERNETES_SERVICE_PORT",
                value: port_text,
                reason: "expected a TCP port number",
            });
        };
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        ApiServerConfig::https(&host, port, &dir.join("ca.crt"), dir.join("token"))
    }

    /// HTTPS to `host:port`, trusting only the CA certificates in the PEM file `ca_file`,
    /// with the bearer token in `token_file` (which must be readable now, and is read again
    /// for each request).
    pub fn https(
        host: &str,
        port: u16,
        ca_file: &Path,
        token_file: PathBuf,
    ) -> Result<ApiServerConfig, ApiServerError> {
        let bad_ca = |reason: String| ApiServerError::File {
            what: "service-account CA certificate",
            path: ca_file.to_path_buf(),
            reason,
        };
        let ca_pem = std::fs::read(ca_file).map_err(|e| {
            bad_ca(format!("{e} (is the service account's token mounted? see examples/kubernetes/rbac.yaml)"))
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&ca_pem) {
            let cert = cert.map_err(|e| bad_ca(format!("not valid PEM: {e}")))?;
            roots.add(cert).map_err(|e| bad_ca(format!("not a usable CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(bad_ca("no CERTIFICATE in it".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad_ca(format!("TLS setup: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // An IP (the usual KUBERNETES_SERVICE_HOST) is checked against the certificate's IP
        // names, a host name against its DNS names.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = match host.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(host.to_owned()).map_err(|_| ApiServerError::Env {
                name: "KUBERNETES_SERVICE_HOST",
                value: host.to_owned(),
                reason: "expected a host name or an IP address",
            })?,
        };
        let config =
            ApiServerConfig { host: host.to_owned(), port, tls: Some((Arc::new(tls), name)), token_file };
        config.token()?;
        Ok(config)
    }

    /// **Tests only**: plain HTTP to `host:port`, for an API server stand-in. Never use it
    /// with a real API server: the token would travel in clear and the answer could be
    /// anyone's.
    pub fn plain_http_for_tests(host: &str, port: u16, token_file: PathBuf) -> ApiServerConfig {
        ApiServerConfig { host: host.to_owned(), port, tls: None, token_file }
    }

    /// `https://host:port` (or `http://` for tests), for messages.
    pub fn base(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.authority())
    }

    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn token(&self) -> Result<String, ApiServerError> {
        let bad = |reason: String| ApiServerError::File {
            what: "service-account token",
            path: self.token_file.clone(),
            reason,
        };
        let token = std::fs::read_to_string(&self.token_file).map_err(|e| bad(e.to_string()))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(bad("empty".into()));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("not a bearer token (characters other than printable ASCII)".into()));
        }
        Ok(token.to_owned())
    }
}

/// A client that reads pods.
#[derive(Debug, Clone)]
pub struct ApiServer {
    config: ApiServerConfig,
}

impl ApiServer {
    /// A client for the API server `config` names.
    pub fn new(config: ApiServerConfig) -> ApiServer {
        ApiServer { config }
    }

    /// The API server asked, for messages.
    pub fn base(&self) -> String {
        self.config.base()
    }

    /// The pod `namespace/name`, checked; `None` when the API server has no such pod.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Option<PodRecord>, ApiServerError> {
        // Names come from the kubelet; still, never let one change the path.
        let path_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        };
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}");
        let url = format!("{}{path}", self.config.base());
        if !path_ok(namespace) || !path_ok(name) {
            return Err(ApiServerError::BadPod { url, reason: "not a valid namespace or pod name".into() });
        }
        let Some(body) = self.get(&path, &url).await? else { return Ok(None) };
        let value: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiServerError::BadPod { url: url.clone(), reason: format!("not JSON: {e}") })?;
        let pod = PodRecord::from_json(&value)
            .map_err(|reason| ApiServerError::BadPod { url: url.clone(), reason })?;
        if pod.namespace != namespace || pod.name != name {
            return Err(ApiServerError::BadPod {
                url,
                reason: format!("asked for {namespace}/{name}, got {}/{}", pod.namespace, pod.name),
            });
        }
        Ok(Some(pod))
    }

    /// The body of a 200 answer to `GET path`; `None` for 404.
    async fn get(&self, path: &str, url: &str) -> Result<Option<Bytes>, ApiServerError> {
        let failed = |reason: String| ApiServerError::Request { url: url.to_owned(), reason };
        let token = self.config.token()?;
        let request = Request::builder()
            .method(Method::GET)
            .uri(path)
            .header(hyper::header::HOST, self.config.authority())
            .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, concat!("gpufrac-arbiter/", env!("CARGO_PKG_VERSION")))
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        let tcp = TcpStream::connect((self.config.host.as_str(), self.config.port))
            .await
            .map_err(|e| failed(format!("cannot connect: {e}")))?;
        let (status, body) = match &self.config.tls {
            Some((tls, name)) => {
                let stream = TlsConnector::from(tls.clone())
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| failed(format!("TLS: {e}")))?;
                exchange(stream, request).await
            }
            None => exchange(tcp, request).await,
        }
        .map_err(failed)?;
        match status {
            StatusCode::OK => Ok(Some(body)),
            StatusCode::NOT_FOUND => Ok(None),
            status => {
                let hint = match status {
                    StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                        " (the gpufrac-node service account needs `get` on pods: examples/kubernetes/rbac.yaml)"
                    }
                    _ => "",
                };
                // The API server's `Status` object says why; anything else is shown cut.
                let message = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("message").and_then(Value::as_str).map(super::cut))
                    .unwrap_or_else(|| super::cut(&String::from_utf8_lossy(&body)));
                Err(ApiServerError::Status { url: url.to_owned(), status: status.as_u16(), message, hint })
            }
        }
    }
}

/// One HTTP/1.1 request on a fresh connection: the status and the body (at most
/// [`MAX_BODY`] bytes).
async fn exchange<S>(stream: S, request: Request<Empty<Bytes>>) -> Result<(StatusCode, Bytes), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    // Ends when the exchange does (or when the caller's timeout drops the task's future).
    let driver = tokio::spawn(connection);
    let result = async {
        let answer = sender.send_request(request).await.map_err(|e| e.to_string())?;
        let status = answer.status();
        let body = Limited::new(answer.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        Ok((status, body))
    }
    .await;
    driver.abort();
    result
}

/// A container's status: its name and the ID the runtime gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerStatus {
    /// The container's name in the pod spec.
    pub name: String,
    /// The ID without the runtime prefix (`containerd://`, `cri-o://`, `docker://`),
    /// lower case; `None` while the container has not started.
    pub container_id: Option<String>,
}

/// What gpufrac reads of a pod, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRecord {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`, lower case.
    pub uid: String,
    /// `spec.nodeName`, when scheduled.
    pub node_name: Option<String>,
    /// `spec.priority` (0 when absent, as the API server leaves it without a priority class).
    pub priority: i32,
    /// `spec.containers[].name`, in order.
    pub containers: Vec<String>,
    /// `status.containerStatuses` and `status.initContainerStatuses` (sidecars).
    pub statuses: Vec<ContainerStatus>,
    /// The `gpufrac.io/` annotations (others are not kept).
    pub annotations: BTreeMap<String, String>,
}

impl PodRecord {
    /// Reads a Pod (`kubectl get pod -o json`); `Err` names the field that is wrong.
    pub fn from_json(pod: &Value) -> Result<PodRecord, String> {
        if !pod.is_object() {
            return Err("not a JSON object".into());
        }
        if let Some(kind) = pod.get("kind") {
            if kind != "Pod" {
                return Err(format!("kind {}: expected \"Pod\"", super::cut(&kind.to_string())));
            }
        }
        let string = |pointer: &str| -> Result<Option<String>, String> {
            match pod.pointer(pointer) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(format!(
                    "{}: expected a string, got {}",
                    field(pointer),
                    super::cut(&other.to_string())
                )),
            }
        };
        let required = |pointer: &str| -> Result<String, String> {
            string(pointer)?.filter(|s| !s.is_empty()).ok_or_else(|| format!("{} is missing", field(pointer)))
        };
        let namespace = required("/metadata/namespace")?;
        let name = required("/metadata/name")?;
        let uid = required("/metadata/uid")?.to_ascii_lowercase();
        if !is_uid(&uid) {
            return Err(format!("metadata.uid {}: expected a UUID", super::cut(&uid)));
        }
        let node_name = string("/spec/nodeName")?;
        let priority = match pod.pointer("/spec/priority") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_i64().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| {
                format!("spec.priority {}: expected a 32-bit integer", super::cut(&v.to_string()))
            })?,
        };
        let containers = match pod.pointer("/spec/containers") {
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    c.get("name")
                        .and_then(Value::as_str)
                        .filter(|n| !n.is_empty())
                        .map(str::to_owned)
                        .ok_or_else(|| format!("spec.containers[{i}].name is missing"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err("spec.containers is missing".into()),
        };
        let mut statuses = Vec::new();
        for list in ["containerStatuses", "initContainerStatuses"] {
            let Some(entries) = pod.pointer(&format!("/status/{list}")).filter(|v| !v.is_null()) else {
                continue;
            };
            let Some(entries) = entries.as_array() else {
                return Err(format!("status.{list}: expected an array"));
            };
            for (i, entry) in entries.iter().enumerate() {
                let at = format!("status.{list}[{i}]");
                let name = entry
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| format!("{at}.name is missing"))?
                    .to_owned();
                let container_id = match entry.get("containerID") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) if s.is_empty() => None,
                    Some(Value::String(s)) => Some(strip_runtime(s).ok_or_else(|| {
                        format!("{at}.containerID {}: expected <runtime>://<id>", super::cut(s))
                    })?),
                    Some(other) => {
                        return Err(format!(
                            "{at}.containerID: expected a string, got {}",
                            super::cut(&other.to_string())
                        ))
                    }
                };
                statuses.push(ContainerStatus { name, container_id });
            }
        }
        let mut annotations = BTreeMap::new();
        match pod.pointer("/metadata/annotations") {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (key, value) in map.iter().filter(|(k, _)| k.starts_with("gpufrac.io/")) {
                    let Some(value) = value.as_str() else {
                        return Err(format!("metadata.annotations[{key:?}]: expected a string"));
                    };
                    annotations.insert(key.clone(), value.to_owned());
                }
            }
            Some(_) => return Err("metadata.annotations: expected an object".into()),
        }
        Ok(PodRecord { namespace, name, uid, node_name, priority, containers, statuses, annotations })
    }
}

/// `/spec/priority` → `spec.priority`, for messages.
fn field(pointer: &str) -> String {
    pointer.trim_start_matches('/').replace('/', ".")
}

/// Whether `text` is a lower-case UUID (`8-4-4-4-12` hex digits), as Kubernetes writes UIDs.
pub fn is_uid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `containerd://<id>` → `<id>` (lower case); `None` without a `scheme://` or with an empty ID.
fn strip_runtime(id: &str) -> Option<String> {
    let (runtime, id) = id.split_once("://")?;
    (!runtime.is_empty() && !id.is_empty()).then(|| id.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "0F3C2A4E-1111-2222-3333-444455556666",
                         "annotations": {"gpufrac.io/resolver": "swap", "other": "x"}},
            "spec": {"nodeName": "n1", "priority": 1000, "containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"containerStatuses": [
                {"name": "a", "containerID": "containerd://ABCDEF"},
                {"name": "b", "containerID": "cri-o://0123"},
            ], "initContainerStatuses": [{"name": "init", "containerID": ""}]},
        })
    }

    #[test]
    fn a_pod_is_read() {
        let p = PodRecord::from_json(&pod()).expect("valid");
        assert_eq!(p.uid, "0f3c2a4e-1111-2222-3333-444455556666");
        assert_eq!(p.priority, 1000);
        assert_eq!(p.containers, ["a", "b"]);
        assert_eq!(p.statuses[0].container_id.as_deref(), Some("abcdef"));
        assert_eq!(p.statuses[1].container_id.as_deref(), Some("0123"));
        assert_eq!(p.statuses[2].container_id, None);
        assert_eq!(p.annotations.len(), 1);
        assert_eq!(p.node_name.as_deref(), Some("n1"));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: [(&str, Value, &str); 6] = [
            ("/metadata/uid", json!("nope"), "metadata.uid"),
            ("/metadata/uid", json!(7), "metadata.uid"),
            ("/spec/priority", json!(3_000_000_000_i64), "spec.priority"),
            ("/spec/priority", json!("high"), "spec.priority"),
            ("/status/containerStatuses/0/containerID", json!("abcdef"), "containerStatuses[0].containerID"),
            ("/metadata/annotations/gpufrac.io~1resolver", json!(1), "gpufrac.io/resolver"),
        ];
        for (pointer, value, named) in cases {
            let mut p = pod();
            *p.pointer_mut(pointer).expect("exists") = value;
            let err = PodRecord::from_json(&p).expect_err(pointer);
            assert!(err.contains(named), "{pointer}: {err}");
        }
        let mut p = pod();
        p["kind"] = json!("Node");
        assert!(PodRecord::from_json(&p).is_err());
        assert!(PodRecord::from_json(&json!([])).is_err());
    }

    #[test]
    fn uids() {
        assert!(is_uid("0f3c2a4e-1111-2222-3333-444455556666"));
        assert!(!is_uid("0f3c2a4e-1111-2222-3333-44445555666"));
        assert!(!is_uid("0f3c2a4e_1111-2222-3333-444455556666"));
        assert!(!is_uid("../../x"));
    }
}
