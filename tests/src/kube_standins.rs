//! Stand-ins for the two Kubernetes components the DRA kubelet plugin talks to, doing what
//! the real ones do where the plugin's correctness depends on it:
//!
//! - [`ApiServer`]: an HTTP API server over a store of JSON objects by path. It gets,
//!   lists (filtered by `fieldSelector`), watches (events after a `resourceVersion`, as
//!   kube-rs's watcher asks), creates (`generateName` too), replaces (with the
//!   `resourceVersion` check), merge-patches (a strategic merge patch merges a status's
//!   `conditions` by type), deletes and deletes collections, and keeps
//!   every ResourceSlice it was sent. Like a real API server with a feature gate off, it
//!   drops the fields of gates the test turns off ([`ApiServer::disable_gate`]) from the
//!   slices it stores.
//! - [`Kubelet`]: the kubelet's side of DRA, from the official protos: plugin registration
//!   (`GetInfo`, `NotifyRegistrationStatus`), a claim prepared once per node however many
//!   pods share it (later pods only join the kubelet's record, as the real one does), a
//!   claim unprepared when its last pod is gone, a restart that wipes the node's
//!   ResourceSlices (`wipeResourceSlices`) and registers the plugin again, and a reboot
//!   that empties the CDI folder (a tmpfs) and prepares every claim again.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gpufrac_device_plugin::dra::api::registration::registration_client::RegistrationClient;
use gpufrac_device_plugin::dra::api::registration::{InfoRequest, RegistrationStatus};
use gpufrac_device_plugin::dra::api::v1;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::Notify;
use tonic::transport::{Channel, Endpoint, Uri};

/// The ResourceSlices' collection.
pub const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
/// The ResourceClaims of every namespace.
pub const CLAIMS: &str = "/apis/resource.k8s.io/v1/resourceclaims";
/// Every pod.
pub const PODS: &str = "/api/v1/pods";

/// How long a watch with no news is held open before it ends (the client watches again).
const WATCH_HELD: Duration = Duration::from_secs(10);

/// A feature gate whose fields a real API server drops from what it stores when it is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Gate {
    /// `DRAConsumableCapacity`: devices' `allowMultipleAllocations`, capacities'
    /// `requestPolicy`, requests' `capacity`, results' `consumedCapacity` and `shareID`.
    ConsumableCapacity,
    /// `DRADeviceTaints`: devices' `taints`.
    DeviceTaints,
}

/// One change, as a watch reports it.
#[derive(Clone)]
struct Event {
    version: u64,
    kind: &'static str,
    key: String,
    object: Value,
}

/// What the API-server stand-in holds.
#[derive(Default)]
struct Store {
    objects: BTreeMap<String, Value>,
    slices_received: Vec<Value>,
    events: Vec<Event>,
    next_version: u64,
    disabled: BTreeSet<Gate>,
    requests: Vec<(String, String)>,
}

/// The API-server stand-in; clones share one store.
#[derive(Clone, Default)]
pub struct ApiServer {
    store: Arc<Mutex<Store>>,
    changed: Arc<Notify>,
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// The collections an object's path belongs to: its own (`.../namespaces/NS/R`), and for a
/// namespaced object the one of every namespace (`.../R`).
fn collections_of(key: &str) -> Vec<String> {
    let Some((collection, _name)) = key.rsplit_once('/') else { return Vec::new() };
    let mut all = vec![collection.to_owned()];
    let parts: Vec<&str> = collection.split('/').collect();
    if let Some(at) = parts.iter().position(|p| *p == "namespaces") {
        if parts.len() == at + 3 {
            let mut every = parts[..at].to_vec();
            every.push(parts[at + 2]);
            all.push(every.join("/"));
        }
    }
    all
}

/// Whether `object` matches a `fieldSelector` of `a.b=value` terms (`!=` too).
fn selected(object: &Value, selector: Option<&str>) -> bool {
    let Some(selector) = selector.filter(|s| !s.is_empty()) else { return true };
    selector.split(',').all(|term| {
        let (path, value, equal) = match term.split_once("!=") {
            Some((p, v)) => (p, v, false),
            None => match term.split_once('=') {
                Some((p, v)) => (p, v.trim_start_matches('='), true),
                None => return true,
            },
        };
        let found = path.split('.').try_fold(object, |at, part| at.get(part)).and_then(Value::as_str);
        (found == Some(value)) == equal
    })
}

fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (hex, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// RFC 7386 merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            let object = target.as_object_mut().expect("made an object");
            for (k, v) in fields {
                if v.is_null() {
                    object.remove(k);
                } else {
                    merge_patch(object.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl Store {
    fn record(&mut self, kind: &'static str, key: &str, object: &Value) {
        self.events.push(Event {
            version: self.next_version,
            kind,
            key: key.to_owned(),
            object: object.clone(),
        });
    }

    fn stamp(&mut self, object: &mut Value) -> u64 {
        self.next_version += 1;
        object["metadata"]["resourceVersion"] = json!(self.next_version.to_string());
        self.next_version
    }

    /// What a real API server keeps of a slice with `self.disabled` gates off.
    fn strip_disabled(&self, key: &str, object: &mut Value) {
        if !key.starts_with(SLICES) {
            return;
        }
        let Some(devices) = object["spec"]["devices"].as_array_mut() else { return };
        for device in devices {
            let Some(device) = device.as_object_mut() else { continue };
            if self.disabled.contains(&Gate::ConsumableCapacity) {
                device.remove("allowMultipleAllocations");
                if let Some(capacity) = device.get_mut("capacity").and_then(Value::as_object_mut) {
                    for value in capacity.values_mut() {
                        if let Some(value) = value.as_object_mut() {
                            value.remove("requestPolicy");
                        }
                    }
                }
            }
            if self.disabled.contains(&Gate::DeviceTaints) {
                device.remove("taints");
            }
        }
    }

    fn put_object(&mut self, key: &str, mut object: Value, kind: &'static str) -> Value {
        self.stamp(&mut object);
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{}", self.next_version));
        }
        self.objects.insert(key.to_owned(), object.clone());
        self.record(kind, key, &object);
        object
    }

    /// A strategic merge patch as the merge patch it amounts to here: `status.conditions`
    /// merge by `type` (as a Node's do), instead of replacing the kubelet's conditions.
    fn strategic(&self, path: &str, body: &Bytes) -> Bytes {
        let Ok(mut patch) = serde_json::from_slice::<Value>(body) else { return body.clone() };
        let key = path.strip_suffix("/status").unwrap_or(path);
        let Some(existing) = self.objects.get(key) else { return body.clone() };
        let Some(sent) = patch["status"]["conditions"].as_array().cloned() else { return body.clone() };
        let mut merged: Vec<Value> = existing["status"]["conditions"].as_array().cloned().unwrap_or_default();
        for condition in sent {
            match merged.iter_mut().find(|c| c["type"] == condition["type"]) {
                Some(old) => *old = condition,
                None => merged.push(condition),
            }
        }
        patch["status"]["conditions"] = Value::Array(merged);
        Bytes::from(patch.to_string())
    }

    fn answer(
        &mut self,
        method: &Method,
        path: &str,
        query: Option<&str>,
        body: &[u8],
    ) -> (StatusCode, Value) {
        self.requests.push((method.to_string(), path.to_owned()));
        let parsed: Option<Value> = serde_json::from_slice(body).ok();
        let selector = query_value(query, "fieldSelector");
        let is_collection = |store: &Store| {
            !store.objects.contains_key(path)
                && (store.objects.keys().any(|k| collections_of(k).iter().any(|c| c == path))
                    || path.ends_with('s'))
        };
        match *method {
            Method::GET if self.objects.contains_key(path) => (StatusCode::OK, self.objects[path].clone()),
            Method::GET if is_collection(self) => {
                let items: Vec<Value> = self
                    .objects
                    .iter()
                    .filter(|(k, o)| {
                        collections_of(k).iter().any(|c| c == path) && selected(o, selector.as_deref())
                    })
                    .map(|(_, o)| o.clone())
                    .collect();
                let kind = items.first().and_then(|o| o["kind"].as_str()).map(|k| format!("{k}List"));
                (
                    StatusCode::OK,
                    json!({"apiVersion": "v1", "kind": kind.unwrap_or_else(|| "List".into()),
                           "metadata": {"resourceVersion": self.next_version.to_string()}, "items": items}),
                )
            }
            Method::GET => (StatusCode::NOT_FOUND, status(404, "NotFound", &format!("{path} not found"))),
            Method::POST => {
                let Some(mut object) = parsed else {
                    return (StatusCode::BAD_REQUEST, status(400, "BadRequest", "not JSON"));
                };
                let name = match object["metadata"]["name"].as_str() {
                    Some(name) => name.to_owned(),
                    None => match object["metadata"]["generateName"].as_str() {
                        Some(prefix) => format!("{prefix}{}", self.next_version + 1),
                        None => return (StatusCode::UNPROCESSABLE_ENTITY, status(422, "Invalid", "no name")),
                    },
                };
                object["metadata"]["name"] = json!(name);
                let key = format!("{path}/{name}");
                if self.objects.contains_key(&key) {
                    return (StatusCode::CONFLICT, status(409, "AlreadyExists", &format!("{key} exists")));
                }
                object["metadata"].as_object_mut().map(|m| m.remove("uid"));
                self.strip_disabled(&key, &mut object);
                let stored = self.put_object(&key, object, "ADDED");
                if key.starts_with(SLICES) {
                    self.slices_received.push(stored.clone());
                }
                (StatusCode::CREATED, stored)
            }
            Method::PUT => {
                let Some(mut object) = parsed else {
                    return (StatusCode::BAD_REQUEST, status(400, "BadRequest", "not JSON"));
                };
                let (key, subresource) = match path.strip_suffix("/status") {
                    Some(key) if self.objects.contains_key(key) => (key.to_owned(), true),
                    _ => (path.to_owned(), false),
                };
                let Some(existing) = self.objects.get(&key).cloned() else {
                    return (StatusCode::NOT_FOUND, status(404, "NotFound", &format!("{key} not found")));
                };
                let sent_version = &object["metadata"]["resourceVersion"];
                if !sent_version.is_null() && *sent_version != existing["metadata"]["resourceVersion"] {
                    return (StatusCode::CONFLICT, status(409, "Conflict", "resourceVersion changed"));
                }
                if subresource {
                    let mut next = existing.clone();
                    next["status"] = object["status"].take();
                    object = next;
                }
                object["metadata"]["uid"] = existing["metadata"]["uid"].clone();
                self.strip_disabled(&key, &mut object);
                let stored = self.put_object(&key, object, "MODIFIED");
                if key.starts_with(SLICES) {
                    self.slices_received.push(stored.clone());
                }
                (StatusCode::OK, stored)
            }
            Method::PATCH => {
                let Some(patch) = parsed else {
                    return (StatusCode::BAD_REQUEST, status(400, "BadRequest", "not JSON"));
                };
                let key = match path.strip_suffix("/status") {
                    Some(key) if self.objects.contains_key(key) => key.to_owned(),
                    _ => path.to_owned(),
                };
                let Some(mut object) = self.objects.get(&key).cloned() else {
                    return (StatusCode::NOT_FOUND, status(404, "NotFound", &format!("{key} not found")));
                };
                merge_patch(&mut object, &patch);
                self.strip_disabled(&key, &mut object);
                let stored = self.put_object(&key, object, "MODIFIED");
                (StatusCode::OK, stored)
            }
            Method::DELETE if self.objects.contains_key(path) => {
                let object = self.objects.remove(path).expect("checked");
                self.next_version += 1;
                let mut gone = object.clone();
                gone["metadata"]["resourceVersion"] = json!(self.next_version.to_string());
                self.record("DELETED", path, &gone);
                (StatusCode::OK, object)
            }
            Method::DELETE if is_collection(self) => {
                let keys: Vec<String> = self
                    .objects
                    .iter()
                    .filter(|(k, o)| {
                        collections_of(k).iter().any(|c| c == path) && selected(o, selector.as_deref())
                    })
                    .map(|(k, _)| k.clone())
                    .collect();
                let mut items = Vec::new();
                for key in keys {
                    let object = self.objects.remove(&key).expect("listed");
                    self.next_version += 1;
                    // A DELETED event carries the deletion's version, as a real one does.
                    let mut gone = object.clone();
                    gone["metadata"]["resourceVersion"] = json!(self.next_version.to_string());
                    self.record("DELETED", &key, &gone);
                    items.push(object);
                }
                (StatusCode::OK, json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}))
            }
            Method::DELETE => (StatusCode::NOT_FOUND, status(404, "NotFound", &format!("{path} not found"))),
            _ => (StatusCode::METHOD_NOT_ALLOWED, status(405, "MethodNotAllowed", "not served here")),
        }
    }
}

impl ApiServer {
    fn with<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let result = f(&mut self.store.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.notify_waiters();
        result
    }

    /// Stores `object` at `path` (created or replaced, as a controller would).
    pub fn put(&self, path: &str, object: Value) {
        self.with(|store| {
            let kind = if store.objects.contains_key(path) { "MODIFIED" } else { "ADDED" };
            let mut object = object;
            if object["metadata"]["uid"].is_null() {
                object["metadata"]["uid"] = json!(format!("uid-{}", store.next_version + 1));
            }
            store.put_object(path, object, kind);
        });
    }

    /// Changes the object at `path` in place (a controller's update), if it is there.
    pub fn update(&self, path: &str, change: impl FnOnce(&mut Value)) {
        self.with(|store| {
            if let Some(mut object) = store.objects.get(path).cloned() {
                change(&mut object);
                store.put_object(path, object, "MODIFIED");
            }
        });
    }

    /// Deletes the object at `path`.
    pub fn remove(&self, path: &str) {
        self.with(|store| {
            store.answer(&Method::DELETE, path, None, b"");
        });
    }

    /// The object at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        self.with(|store| store.objects.get(path).cloned())
    }

    /// The objects of the collection `collection` (`/apis/.../resourceslices`).
    pub fn list(&self, collection: &str) -> Vec<Value> {
        self.with(|store| {
            store
                .objects
                .iter()
                .filter(|(k, _)| collections_of(k).iter().any(|c| c == collection))
                .map(|(_, o)| o.clone())
                .collect()
        })
    }

    /// The slice `<node>-gpu.gpufrac.io`, as stored.
    pub fn slice(&self, node: &str) -> Option<Value> {
        self.get(&format!("{SLICES}/{node}-gpu.gpufrac.io"))
    }

    /// Every slice the server was sent (created or replaced), as stored.
    pub fn slices_received(&self) -> Vec<Value> {
        self.with(|store| store.slices_received.clone())
    }

    /// Every request served so far, as `(method, path)`.
    pub fn requests(&self) -> Vec<(String, String)> {
        self.with(|store| store.requests.clone())
    }

    /// Turns the feature gate `gate` off: its fields are dropped from slices stored from now on.
    pub fn disable_gate(&self, gate: Gate) {
        self.with(|store| {
            store.disabled.insert(gate);
        });
    }

    /// Deletes the objects of `collection` that `field_selector` selects, as a
    /// DeleteCollection does.
    pub fn delete_collection(&self, collection: &str, field_selector: &str) -> usize {
        self.with(|store| {
            let query = format!("fieldSelector={field_selector}");
            let (_, answer) = store.answer(&Method::DELETE, collection, Some(&query), b"");
            answer["items"].as_array().map_or(0, Vec::len)
        })
    }

    /// Serves the store on a port of 127.0.0.1 the system picks; returns its address.
    pub async fn serve(self) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port for the API server");
        let address = listener.local_addr().expect("its address");
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let server = self.clone();
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                            let server = server.clone();
                            async move { Ok::<_, Infallible>(server.respond(request).await) }
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        address
    }

    async fn respond(
        &self,
        request: Request<hyper::body::Incoming>,
    ) -> Response<http_body_util::combinators::BoxBody<Bytes, Infallible>> {
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().map(str::to_owned);
        if method == Method::GET && query_value(query.as_deref(), "watch").as_deref() == Some("true") {
            return self.watch(path, query).await;
        }
        let strategic = request
            .headers()
            .get("content-type")
            .is_some_and(|t| t.as_bytes().starts_with(b"application/strategic-merge-patch+json"));
        let body = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let (code, answer) = self.with(|store| {
            let body =
                if method == Method::PATCH && strategic { store.strategic(&path, &body) } else { body };
            store.answer(&method, &path, query.as_deref(), &body)
        });
        let mut response = Response::new(Full::new(Bytes::from(answer.to_string())).boxed());
        *response.status_mut() = code;
        response.headers_mut().insert("content-type", "application/json".parse().expect("a header value"));
        response
    }

    /// A watch: every event of the collection after the `resourceVersion` asked for, then
    /// new ones as they come, until [`WATCH_HELD`] passes without news.
    async fn watch(
        &self,
        path: String,
        query: Option<String>,
    ) -> Response<http_body_util::combinators::BoxBody<Bytes, Infallible>> {
        let selector = query_value(query.as_deref(), "fieldSelector");
        let mut after: u64 =
            query_value(query.as_deref(), "resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(16);
        let server = self.clone();
        tokio::spawn(async move {
            loop {
                let notified = server.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let events: Vec<Event> = {
                    let store = server.store.lock().unwrap_or_else(|p| p.into_inner());
                    store
                        .events
                        .iter()
                        .filter(|e| e.version > after && collections_of(&e.key).contains(&path))
                        .cloned()
                        .collect()
                };
                for event in events {
                    after = event.version;
                    if !selected(&event.object, selector.as_deref()) {
                        continue;
                    }
                    let line = format!("{}\n", json!({"type": event.kind, "object": event.object}));
                    if sender.send(Ok(Frame::data(Bytes::from(line)))).await.is_err() {
                        return;
                    }
                }
                if tokio::time::timeout(WATCH_HELD, notified).await.is_err() {
                    return;
                }
            }
        });
        let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
        let mut response = Response::new(BodyExt::boxed(body));
        response.headers_mut().insert("content-type", "application/json".parse().expect("a header value"));
        response
    }
}

/// The unix socket `socket` as a tonic channel.
pub async fn channel(socket: PathBuf) -> Channel {
    Endpoint::try_from("http://[::]:50051")
        .expect("a static URI")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .expect("connect to the plugin")
}

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimName {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

impl ClaimName {
    /// The claim `namespace/name` of UID `uid`.
    pub fn new(namespace: &str, name: &str, uid: &str) -> ClaimName {
        ClaimName { namespace: namespace.into(), name: name.into(), uid: uid.into() }
    }

    fn proto(&self) -> v1::Claim {
        v1::Claim { namespace: self.namespace.clone(), uid: self.uid.clone(), name: self.name.clone() }
    }
}

/// The kubelet stand-in for one node and one DRA plugin.
pub struct Kubelet {
    node: String,
    registry: PathBuf,
    cdi: PathBuf,
    api: ApiServer,
    endpoint: Mutex<Option<String>>,
    /// The claims the kubelet prepared, and the pods using each (its claim-info cache).
    prepared: Mutex<BTreeMap<ClaimName, (v1::NodePrepareResourceResponse, BTreeSet<String>)>>,
}

impl Kubelet {
    /// The kubelet of `node`, whose plugin registry is `registry` and whose container
    /// runtime reads CDI specs from `cdi`.
    pub fn new(node: &str, registry: &Path, cdi: &Path, api: ApiServer) -> Kubelet {
        Kubelet {
            node: node.into(),
            registry: registry.into(),
            cdi: cdi.into(),
            api,
            endpoint: Mutex::new(None),
            prepared: Mutex::new(BTreeMap::new()),
        }
    }

    /// The plugin's registration socket in the registry.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry.join("gpu.gpufrac.io-reg.sock")
    }

    /// What the plugin watcher does with the registration socket: `GetInfo`, then
    /// `NotifyRegistrationStatus`. Returns the DRA endpoint.
    pub async fn register(&self) -> String {
        let mut client = RegistrationClient::new(channel(self.registration_socket()).await);
        let info = client.get_info(InfoRequest {}).await.expect("GetInfo").into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.gpufrac.io");
        client
            .notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() })
            .await
            .expect("NotifyRegistrationStatus");
        *self.endpoint.lock().unwrap_or_else(|p| p.into_inner()) = Some(info.endpoint.clone());
        info.endpoint
    }

    fn endpoint(&self) -> String {
        self.endpoint.lock().unwrap_or_else(|p| p.into_inner()).clone().expect("the plugin registered")
    }

    /// Calls `NodePrepareResources` for `claim`, whatever the kubelet's record says.
    pub async fn call_prepare(&self, claim: &ClaimName) -> v1::NodePrepareResourceResponse {
        let mut client = v1::dra_plugin_client::DraPluginClient::new(channel(self.endpoint().into()).await);
        let request = v1::NodePrepareResourcesRequest { claims: vec![claim.proto()] };
        let mut answer =
            client.node_prepare_resources(request).await.expect("NodePrepareResources").into_inner();
        answer.claims.remove(&claim.uid).unwrap_or_else(|| panic!("no answer for claim {}", claim.uid))
    }

    /// Calls `NodeUnprepareResources` for `claim`; returns its error ("" when none).
    pub async fn call_unprepare(&self, claim: &ClaimName) -> String {
        let mut client = v1::dra_plugin_client::DraPluginClient::new(channel(self.endpoint().into()).await);
        let request = v1::NodeUnprepareResourcesRequest { claims: vec![claim.proto()] };
        let mut answer =
            client.node_unprepare_resources(request).await.expect("NodeUnprepareResources").into_inner();
        answer.claims.remove(&claim.uid).expect("an answer for the claim").error
    }

    /// The pod `pod_uid` starts with `claim`: the plugin is asked to prepare it only if
    /// no other pod on this node holds it prepared already.
    pub async fn start_pod(&self, pod_uid: &str, claim: &ClaimName) -> v1::NodePrepareResourceResponse {
        if let Some((answer, pods)) = self.prepared.lock().unwrap_or_else(|p| p.into_inner()).get_mut(claim) {
            pods.insert(pod_uid.to_owned());
            return answer.clone();
        }
        let answer = self.call_prepare(claim).await;
        if answer.error.is_empty() {
            self.prepared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(claim.clone(), (answer.clone(), BTreeSet::from([pod_uid.to_owned()])));
        }
        answer
    }

    /// The pod `pod_uid` is gone: the claim is unprepared once no pod uses it. Returns
    /// the plugin's error, `None` when it was not asked.
    pub async fn stop_pod(&self, pod_uid: &str, claim: &ClaimName) -> Option<String> {
        let last = {
            let mut prepared = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
            let (_, pods) = prepared.get_mut(claim)?;
            pods.remove(pod_uid);
            let last = pods.is_empty();
            if last {
                prepared.remove(claim);
            }
            last
        };
        if last {
            Some(self.call_unprepare(claim).await)
        } else {
            None
        }
    }

    /// The kubelet restarts: it deletes every ResourceSlice of its node, then its plugin
    /// watcher finds the registration socket and registers the plugin again.
    pub async fn restart(&self) -> String {
        let wiped = self.api.delete_collection(SLICES, &format!("spec.nodeName={}", self.node));
        assert!(wiped > 0, "the kubelet stand-in found no slice of {} to wipe", self.node);
        self.register().await
    }

    /// The node reboots: the CDI folder (a tmpfs) is empty, the kubelet starts afresh and
    /// prepares every claim of its pods again.
    pub async fn reboot(&self) -> Vec<v1::NodePrepareResourceResponse> {
        if let Ok(entries) = std::fs::read_dir(&self.cdi) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        self.restart().await;
        let claims: Vec<ClaimName> =
            self.prepared.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
        let mut answers = Vec::new();
        for claim in claims {
            answers.push(self.call_prepare(&claim).await);
        }
        answers
    }
}
