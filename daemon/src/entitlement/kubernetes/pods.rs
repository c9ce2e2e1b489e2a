//! The pods of this node, as the API server shows them: a kube-rs reflector (a list, then
//! a watch, of `GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`) keeps them in a
//! local store, so a lookup reads a pod by UID from memory instead of asking the API
//! server for each process; and [`PodRecord`], the parts of a pod gpufrac believes, checked.
//!
//! The store is the cache: a pod is as fresh as the watch that delivered it. Until the
//! first list has arrived nothing is known ([`PodStore::pod`] waits for it until the
//! lookup's deadline, then says why); when the watch fails later (an API server outage,
//! a refused token), the pods last seen are kept and still answered from, while a pod not
//! among them is no answer (the watch may have missed it), never a refusal. kube-rs
//! retries a failed watch with a backoff (up to 30 s apart) and re-reads a rotated
//! service-account token itself.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::{Api, Client, ResourceExt as _};

use super::cut;

/// How long a watch failure is believed to last when nothing came since: kube-rs retries
/// at most 30 s apart, so a failure that goes on is reported again within that; a watch
/// that resumed without news is taken as healthy after this.
const FAILURE_MEMORY: Duration = Duration::from_secs(60);

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
    /// Reads a pod as the API server gave it; `Err` names the field that is wrong.
    pub fn from_pod(pod: &Pod) -> Result<PodRecord, String> {
        let meta = &pod.metadata;
        let required = |value: &Option<String>, field: &str| {
            value.clone().filter(|s| !s.is_empty()).ok_or_else(|| format!("{field} is missing"))
        };
        let namespace = required(&meta.namespace, "metadata.namespace")?;
        let name = required(&meta.name, "metadata.name")?;
        let uid = required(&meta.uid, "metadata.uid")?.to_ascii_lowercase();
        if !is_uid(&uid) {
            return Err(format!("metadata.uid {}: expected a UUID", cut(&uid)));
        }
        let Some(spec) = &pod.spec else { return Err("spec is missing".into()) };
        let containers = spec
            .containers
            .iter()
            .enumerate()
            .map(|(i, c)| {
                Some(c.name.clone())
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| format!("spec.containers[{i}].name is missing"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut statuses = Vec::new();
        let status = pod.status.as_ref();
        let lists = [
            ("containerStatuses", status.and_then(|s| s.container_statuses.as_ref())),
            ("initContainerStatuses", status.and_then(|s| s.init_container_statuses.as_ref())),
        ];
        for (list, entries) in lists {
            for (i, entry) in entries.into_iter().flatten().enumerate() {
                let at = format!("status.{list}[{i}]");
                if entry.name.is_empty() {
                    return Err(format!("{at}.name is missing"));
                }
                let container_id =
                    match entry.container_id.as_deref() {
                        None | Some("") => None,
                        Some(id) => Some(strip_runtime(id).ok_or_else(|| {
                            format!("{at}.containerID {}: expected <runtime>://<id>", cut(id))
                        })?),
                    };
                statuses.push(ContainerStatus { name: entry.name.clone(), container_id });
            }
        }
        let annotations = meta
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| k.starts_with("gpufrac.io/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(PodRecord {
            namespace,
            name,
            uid,
            node_name: spec.node_name.clone(),
            priority: spec.priority.unwrap_or(0),
            containers,
            statuses,
            annotations,
        })
    }
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

/// How the watch fares.
#[derive(Debug, Default)]
struct Health {
    /// The last time the watch delivered something (an event, or the end of a list).
    last_ok: Option<Instant>,
    /// The last failure and when it came.
    last_error: Option<(Instant, String)>,
}

/// Why a pod could not be given.
#[derive(Debug, Clone, PartialEq)]
pub enum PodError {
    /// The store answers: no such pod on this node.
    NotOnNode(String),
    /// The store cannot answer (never synced, the watch failing, an unreadable pod).
    Unknown(String),
}

/// The pods of one node, kept by a reflector running on the runtime it was started on.
#[derive(Clone)]
pub struct PodStore {
    store: Store<Pod>,
    health: Arc<Mutex<Health>>,
    /// Bumped after each event applied to the store: lookups waiting for a pod to appear
    /// or change wake up on it.
    changed: tokio::sync::watch::Receiver<u64>,
    node: String,
    server: String,
}

impl std::fmt::Debug for PodStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodStore")
            .field("node", &self.node)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl PodStore {
    /// Starts the reflector over the pods of `node` (on the current tokio runtime: call it
    /// within one). `server` names the API server in messages.
    pub fn start(client: Client, node: &str, server: String) -> PodStore {
        let api: Api<Pod> = Api::all(client);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let (store, writer) = reflector::store();
        let health = Arc::new(Mutex::new(Health::default()));
        let (bump, changed) = tokio::sync::watch::channel(0_u64);
        let events = watcher(api, config)
            .default_backoff()
            // Only what a lookup reads matters; managed fields are most of a pod's bytes.
            .modify(|pod| pod.managed_fields_mut().clear());
        let reflected = reflector::reflector(writer, events);
        let watched_health = health.clone();
        let watched_node = node.to_owned();
        tokio::spawn(async move {
            let mut reflected = std::pin::pin!(reflected);
            while let Some(event) = reflected.next().await {
                let mut health = watched_health.lock().unwrap_or_else(|p| p.into_inner());
                match event {
                    Ok(_) => health.last_ok = Some(Instant::now()),
                    Err(e) => {
                        let why = describe(&e);
                        tracing::warn!(node = %watched_node, "Kubernetes pods: {why}");
                        health.last_error = Some((Instant::now(), why));
                    }
                }
                drop(health);
                bump.send_modify(|n| *n = n.wrapping_add(1));
            }
        });
        PodStore { store, health, changed, node: node.to_owned(), server }
    }

    /// The API server, for messages.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The watch's current failure, if it is failing (the store may miss changes).
    pub fn failing(&self) -> Option<String> {
        let health = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let (at, why) = health.last_error.as_ref()?;
        let recovered = health.last_ok.is_some_and(|ok| ok > *at);
        (!recovered && at.elapsed() < FAILURE_MEMORY).then(|| why.clone())
    }

    /// The last failure, even an old one.
    fn last_error(&self) -> Option<String> {
        let health = self.health.lock().unwrap_or_else(|p| p.into_inner());
        health.last_error.as_ref().map(|(_, why)| why.clone())
    }

    /// The pod with `uid` (lower case), as the store has it. A pod not there yet (its
    /// watch event may lag behind the kubelet) is waited for until `deadline`; so is a
    /// newer version of a pod that `will_do` refuses (a status that does not list the
    /// container yet), after which the version last seen is answered.
    pub async fn pod(
        &self,
        uid: &str,
        deadline: tokio::time::Instant,
        will_do: impl Fn(&PodRecord) -> bool,
    ) -> Result<PodRecord, PodError> {
        let mut changed = self.changed.clone();
        let ready = tokio::time::timeout_at(deadline, self.store.wait_until_ready()).await;
        if !matches!(ready, Ok(Ok(()))) {
            let why = self.last_error().unwrap_or_else(|| "no answer yet".into());
            return Err(PodError::Unknown(format!(
                "the pods of node {} are not listed yet from the API server {}: {why}",
                self.node, self.server
            )));
        }
        loop {
            // Marks the current version seen: a change after this wakes the wait below.
            changed.borrow_and_update();
            let found = self
                .store
                .find(|pod| pod.metadata.uid.as_deref().is_some_and(|u| u.eq_ignore_ascii_case(uid)));
            let last = match found {
                Some(pod) => {
                    let record = PodRecord::from_pod(&pod).map_err(|why| {
                        PodError::Unknown(format!(
                            "pod {}/{} from the API server {}: {why}",
                            pod.namespace().unwrap_or_default(),
                            pod.name_any(),
                            self.server
                        ))
                    })?;
                    if will_do(&record) {
                        return Ok(record);
                    }
                    Ok(record)
                }
                None => Err(format!(
                    "pod UID {uid}: no pod of node {} has this UID (a pod of another node, or one the \
                     API server does not know)",
                    self.node
                )),
            };
            // Past the deadline (or the reflector gone): the last answer stands.
            if !matches!(tokio::time::timeout_at(deadline, changed.changed()).await, Ok(Ok(()))) {
                return match (last, self.failing()) {
                    (Ok(record), _) => Ok(record),
                    (Err(why), Some(failure)) => Err(PodError::Unknown(format!(
                        "{why}; but the watch of the API server {} is failing, so it may have missed it: \
                         {failure}",
                        self.server
                    ))),
                    (Err(why), None) => Err(PodError::NotOnNode(why)),
                };
            }
        }
    }
}

/// A watch failure, said for an admin: what was asked, the HTTP status and the API
/// server's message (with the RBAC the arbiter needs when refused), or the error chain.
fn describe(e: &watcher::Error) -> String {
    let (what, source) = match e {
        watcher::Error::InitialListFailed(source) => ("listing the pods", source),
        watcher::Error::WatchStartFailed(source) => ("watching the pods", source),
        watcher::Error::WatchFailed(source) => ("watching the pods", source),
        watcher::Error::WatchError(status) => {
            return format!("watching the pods: {}", status_text(status.code, &status.message))
        }
        other => return other.to_string(),
    };
    match source {
        kube::Error::Api(status) => format!("{what}: {}", status_text(status.code, &status.message)),
        other => {
            let mut text = format!("{what}: {other}");
            let mut next = std::error::Error::source(other);
            while let Some(cause) = next {
                let cause_text = cause.to_string();
                if !text.ends_with(&cause_text) {
                    text.push_str(": ");
                    text.push_str(&cause_text);
                }
                next = cause.source();
            }
            text
        }
    }
}

/// `HTTP 403: <message>`, with the RBAC hint for 401 and 403.
fn status_text(code: u16, message: &str) -> String {
    let hint = match code {
        401 | 403 => {
            " (the arbiter's service account needs `list` and `watch` on pods: examples/kubernetes/rbac.yaml)"
        }
        _ => "",
    };
    if code == 0 {
        // Not an HTTP status: kube read something from the stream it could not decode.
        return match message.trim() {
            "" => "an answer that is not a watch event (a proxy, or not an API server?)".to_owned(),
            message => format!("an answer that is not a watch event: {}", cut(message)),
        };
    }
    format!("HTTP {code}: {}{hint}", cut(message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn pod() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "0F3C2A4E-1111-2222-3333-444455556666",
                         "annotations": {"gpufrac.io/resolver": "swap", "other": "x"}},
            "spec": {"nodeName": "n1", "priority": 1000, "containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"containerStatuses": [
                {"name": "a", "containerID": "containerd://ABCDEF", "image": "i", "imageID": "",
                 "ready": true, "restartCount": 0},
                {"name": "b", "containerID": "cri-o://0123", "image": "i", "imageID": "",
                 "ready": true, "restartCount": 0},
            ], "initContainerStatuses": [{"name": "init", "containerID": "", "image": "i", "imageID": "",
                                          "ready": false, "restartCount": 0}]},
        })
    }

    fn record(value: Value) -> Result<PodRecord, String> {
        PodRecord::from_pod(&serde_json::from_value(value).expect("a Pod"))
    }

    #[test]
    fn a_pod_is_read() {
        let p = record(pod()).expect("valid");
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
        let cases: [(&str, Value, &str); 3] = [
            ("/metadata/uid", json!("nope"), "metadata.uid"),
            ("/metadata/name", json!(""), "metadata.name"),
            ("/status/containerStatuses/0/containerID", json!("abcdef"), "containerStatuses[0].containerID"),
        ];
        for (pointer, value, named) in cases {
            let mut p = pod();
            *p.pointer_mut(pointer).expect("exists") = value;
            let err = record(p).expect_err(pointer);
            assert!(err.contains(named), "{pointer}: {err}");
        }
    }

    #[test]
    fn uids() {
        assert!(is_uid("0f3c2a4e-1111-2222-3333-444455556666"));
        assert!(!is_uid("0f3c2a4e-1111-2222-3333-44445555666"));
        assert!(!is_uid("0f3c2a4e_1111-2222-3333-444455556666"));
        assert!(!is_uid("../../x"));
    }

    #[test]
    fn refusals_say_what_rbac_is_needed() {
        assert!(status_text(403, "pods is forbidden").contains("`list` and `watch` on pods"));
        assert_eq!(status_text(500, "oops"), "HTTP 500: oops");
    }
}
