//! The kubelet's PodResources API (`podresources/v1`), over its unix socket: which
//! `gpufrac.io/gpu` share IDs the kubelet gave each container of a pod.
//!
//! The kubelet is the authority here: it records what the device plugin's `Allocate` was
//! asked for, per container, and nothing inside a container can change that. `Get` asks
//! about one pod; kubelets where it is missing (before 1.27) or behind its feature gate
//! (`KubeletPodResourcesGet`, answering `Unknown: PodResources API Get method disabled`)
//! are asked with `List` instead, and remembered as such.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;

use super::api::pod_resources_lister_client::PodResourcesListerClient;
use super::api::{GetPodResourcesRequest, ListPodResourcesRequest, PodResources};

/// Where the kubelet serves the PodResources API.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The most bytes of one answer; the kubelet's own server limit is 16 MiB too.
const MAX_MESSAGE: usize = 16 << 20;

/// The most device IDs of our resource one container may list: 100 shares per GPU is the
/// default, 10 000 is far above any real allocation and keeps a broken answer small.
const MAX_IDS: usize = 10_000;

/// Why the kubelet could not be asked; every message names the socket.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket could not be connected to.
    #[error("cannot connect to the kubelet's PodResources socket {}: {source}", socket.display())]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered with an error.
    #[error("kubelet PodResources {call} on {}: {code:?}: {message}", socket.display())]
    Call {
        /// `List` or `Get`.
        call: &'static str,
        /// The socket.
        socket: PathBuf,
        /// The gRPC code.
        code: Code,
        /// The kubelet's message, cut to a sane length.
        message: String,
    },
    /// The answer is not what was asked for.
    #[error("kubelet PodResources {call} on {}: {reason}", socket.display())]
    BadAnswer {
        /// `List` or `Get`.
        call: &'static str,
        /// The socket.
        socket: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// One pod as the kubelet lists it: the device IDs of one resource, per container name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodDevices {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// Container name → the device IDs of the resource asked about (only containers that
    /// have at least one).
    pub containers: BTreeMap<String, Vec<String>>,
}

impl PodDevices {
    /// The IDs of `resource` per container of `pod`, checked: names present, at most
    /// [`MAX_IDS`] IDs per container.
    fn from_proto(pod: &PodResources, resource: &str) -> Result<PodDevices, String> {
        if pod.name.is_empty() || pod.namespace.is_empty() {
            return Err(format!(
                "a pod without a name or namespace ({:?}/{:?})",
                super::cut(&pod.namespace),
                super::cut(&pod.name)
            ));
        }
        let mut containers: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for container in &pod.containers {
            let ids: Vec<String> = container
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect();
            if ids.is_empty() {
                continue;
            }
            if container.name.is_empty() {
                return Err(format!("pod {}/{}: a container without a name", pod.namespace, pod.name));
            }
            let entry = containers.entry(container.name.clone()).or_default();
            entry.extend(ids);
            if entry.len() > MAX_IDS {
                return Err(format!(
                    "pod {}/{} container {}: more than {MAX_IDS} {resource} device IDs",
                    pod.namespace, pod.name, container.name
                ));
            }
        }
        Ok(PodDevices { namespace: pod.namespace.clone(), name: pod.name.clone(), containers })
    }
}

/// A client of the kubelet's PodResources API; connects anew for each call (a local
/// socket: cheap, and right after a kubelet restart that made a new socket).
#[derive(Debug)]
pub struct PodResourcesClient {
    socket: PathBuf,
    resource: String,
    /// Set once the kubelet refused `Get` as unknown or disabled: ask with `List` from then on.
    get_unsupported: AtomicBool,
}

impl PodResourcesClient {
    /// A client of the kubelet at `socket`, reporting device IDs of `resource`.
    pub fn new(socket: impl Into<PathBuf>, resource: impl Into<String>) -> PodResourcesClient {
        PodResourcesClient {
            socket: socket.into(),
            resource: resource.into(),
            get_unsupported: AtomicBool::new(false),
        }
    }

    /// The socket asked.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn connect(&self) -> Result<PodResourcesListerClient<Channel>, PodResourcesError> {
        let path = self.socket.clone();
        // The URI is required by tonic but unused: the connector dials the unix socket.
        let endpoint = Endpoint::from_static("http://[::]:50051");
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|source| PodResourcesError::Connect { socket: self.socket.clone(), source })?;
        Ok(PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_MESSAGE))
    }

    fn call_error(&self, call: &'static str, status: &tonic::Status) -> PodResourcesError {
        PodResourcesError::Call {
            call,
            socket: self.socket.clone(),
            code: status.code(),
            message: super::cut(status.message()),
        }
    }

    fn bad(&self, call: &'static str, reason: String) -> PodResourcesError {
        PodResourcesError::BadAnswer { call, socket: self.socket.clone(), reason }
    }

    /// Every pod the kubelet runs that has at least one device ID of our resource.
    pub async fn list(&self) -> Result<Vec<PodDevices>, PodResourcesError> {
        let mut client = self.connect().await?;
        let answer = client
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|status| self.call_error("List", &status))?
            .into_inner();
        let mut pods = Vec::new();
        for pod in &answer.pod_resources {
            let pod =
                PodDevices::from_proto(pod, &self.resource).map_err(|reason| self.bad("List", reason))?;
            if !pod.containers.is_empty() {
                pods.push(pod);
            }
        }
        Ok(pods)
    }

    /// One pod's device IDs of our resource; `None` when the kubelet does not run it.
    /// Uses `Get`, or `List` where the kubelet lacks `Get`.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Option<PodDevices>, PodResourcesError> {
        if !self.get_unsupported.load(Ordering::Relaxed) {
            let mut client = self.connect().await?;
            let request =
                GetPodResourcesRequest { pod_name: name.to_owned(), pod_namespace: namespace.to_owned() };
            match client.get(request).await {
                Ok(answer) => {
                    let Some(pod) = answer.into_inner().pod_resources else {
                        return Err(
                            self.bad("Get", format!("no pod_resources in the answer for {namespace}/{name}"))
                        );
                    };
                    if pod.namespace != namespace || pod.name != name {
                        return Err(self.bad(
                            "Get",
                            format!(
                                "asked for {namespace}/{name}, got {}/{}",
                                super::cut(&pod.namespace),
                                super::cut(&pod.name)
                            ),
                        ));
                    }
                    return PodDevices::from_proto(&pod, &self.resource)
                        .map(Some)
                        .map_err(|r| self.bad("Get", r));
                }
                // The kubelet answers a plain Go error (gRPC `Unknown`) for a pod it does not run.
                Err(status) if status.code() == Code::Unknown && status.message().ends_with("not found") => {
                    return Ok(None)
                }
                Err(status) if get_is_unsupported(&status) => {
                    tracing::info!(
                        socket = %self.socket.display(),
                        "the kubelet does not serve PodResources Get ({:?}: {}): using List",
                        status.code(),
                        super::cut(status.message())
                    );
                    self.get_unsupported.store(true, Ordering::Relaxed);
                }
                Err(status) => return Err(self.call_error("Get", &status)),
            }
        }
        Ok(self.list().await?.into_iter().find(|p| p.namespace == namespace && p.name == name))
    }
}

/// Whether a `Get` error says the kubelet has no `Get` (older than 1.27: `Unimplemented`)
/// or has it turned off (the `KubeletPodResourcesGet` gate: `Unknown`, "... disabled").
fn get_is_unsupported(status: &tonic::Status) -> bool {
    status.code() == Code::Unimplemented
        || (status.code() == Code::Unknown && status.message().contains("disabled"))
}

#[cfg(test)]
mod tests {
    use super::super::api::{ContainerDevices, ContainerResources};
    use super::*;

    fn pod(containers: Vec<ContainerResources>) -> PodResources {
        PodResources { name: "p".into(), namespace: "ns".into(), containers }
    }

    fn container(name: &str, devices: &[(&str, &[&str])]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: devices
                .iter()
                .map(|(resource, ids)| ContainerDevices {
                    resource_name: (*resource).into(),
                    device_ids: ids.iter().map(|s| (*s).into()).collect(),
                    topology: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_our_resource_is_kept() {
        let p = pod(vec![
            container("a", &[("gpufrac.io/gpu", &["G::1", "G::2"]), ("nvidia.com/gpu", &["X"])]),
            container("b", &[("example.com/nic", &["n0"])]),
            container("c", &[("gpufrac.io/gpu", &["G::3"]), ("gpufrac.io/gpu", &["G::4"])]),
        ]);
        let devices = PodDevices::from_proto(&p, "gpufrac.io/gpu").expect("valid");
        assert_eq!(devices.containers.len(), 2);
        assert_eq!(devices.containers["a"], ["G::1", "G::2"]);
        assert_eq!(devices.containers["c"], ["G::3", "G::4"]);
    }

    #[test]
    fn broken_answers_are_refused() {
        let mut p = pod(vec![]);
        p.name.clear();
        assert!(PodDevices::from_proto(&p, "gpufrac.io/gpu").is_err());
        let p = pod(vec![container("", &[("gpufrac.io/gpu", &["G::1"])])]);
        assert!(PodDevices::from_proto(&p, "gpufrac.io/gpu").is_err());
        let ids: Vec<String> = (0..=MAX_IDS).map(|i| format!("G::{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let p = pod(vec![container("a", &[("gpufrac.io/gpu", &refs)])]);
        assert!(PodDevices::from_proto(&p, "gpufrac.io/gpu").expect_err("too many").contains("more than"));
    }

    #[test]
    fn get_fallback_codes() {
        assert!(get_is_unsupported(&tonic::Status::unimplemented("unknown method Get")));
        assert!(get_is_unsupported(&tonic::Status::unknown("PodResources API Get method disabled")));
        assert!(!get_is_unsupported(&tonic::Status::unknown("pod p in namespace ns not found")));
        assert!(!get_is_unsupported(&tonic::Status::unavailable("x")));
    }
}
