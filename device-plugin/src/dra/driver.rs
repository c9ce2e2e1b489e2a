//! Prepare and unprepare: what the kubelet asks of the plugin, recorded in the plugin's
//! checkpoint (`prepared-claims.json` in its folder) before it is answered. A claim already
//! in the checkpoint is not prepared again (its pods are brought up to date); unpreparing
//! reads only the checkpoint, never the API server, because the kubelet unprepares after
//! the claim may be gone, possibly after a restart of the plugin.

use std::path::PathBuf;

use gpufrac_common::dra::{Checkpoint, PreparedClaim, PreparedDevice};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use tokio::sync::Mutex;

use super::cdi::{self, CdiConfig};
use super::claim::{self, ClaimError};
use super::gpus::GpuInfo;
use super::slices::Sharing;

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its `metadata.uid`.
    pub uid: String,
    /// Its name.
    pub name: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// Why a claim could not be prepared or unprepared; the kubelet shows it in the pod's events.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The kubelet's request is malformed.
    #[error("claim {claim}: {reason}")]
    Request {
        /// The claim as the kubelet named it.
        claim: String,
        /// What is wrong.
        reason: String,
    },
    /// The claim could not be read from the API server.
    #[error("reading ResourceClaim {claim} from the API server: {source}")]
    ApiServer {
        /// The claim.
        claim: ClaimRef,
        /// What kube said.
        source: Box<kube::Error>,
    },
    /// The claim read from the API server is not the one the kubelet named.
    #[error(
        "ResourceClaim {claim}: the API server has uid {found} under that name (the claim was replaced)"
    )]
    Replaced {
        /// The claim the kubelet named.
        claim: ClaimRef,
        /// The UID found.
        found: String,
    },
    /// The claim cannot be prepared here.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The CDI spec could not be written or removed.
    #[error("CDI spec of claim {claim} in {dir}: {source}")]
    Cdi {
        /// The claim.
        claim: ClaimRef,
        /// The CDI folder.
        dir: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The checkpoint could not be written.
    #[error(transparent)]
    Checkpoint(#[from] gpufrac_common::dra::CheckpointError),
}

/// The plugin's state: the node's GPUs, where things go, and the prepared claims.
pub struct Driver {
    client: kube::Client,
    pool: String,
    gpus: Vec<GpuInfo>,
    sharing: Sharing,
    cdi: CdiConfig,
    checkpoint_path: PathBuf,
    /// The checkpoint as last written; the lock also serialises preparations, so that two
    /// calls for one claim never both prepare it.
    prepared: Mutex<Checkpoint>,
}

impl Driver {
    /// A driver for this node (`pool` is the node's name), reading the checkpoint left by
    /// a previous run: its claims stay prepared.
    pub fn new(
        client: kube::Client,
        pool: String,
        gpus: Vec<GpuInfo>,
        sharing: Sharing,
        cdi: CdiConfig,
        checkpoint_path: PathBuf,
    ) -> Result<Driver, gpufrac_common::dra::CheckpointError> {
        let prepared = Checkpoint::load(&checkpoint_path)?;
        if !prepared.claims.is_empty() {
            tracing::info!(claims = prepared.claims.len(), checkpoint = %checkpoint_path.display(), "prepared claims from the checkpoint");
        }
        Ok(Driver { client, pool, gpus, sharing, cdi, checkpoint_path, prepared: Mutex::new(prepared) })
    }

    /// The node's GPUs.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Where the CDI specs go.
    pub fn cdi(&self) -> &CdiConfig {
        &self.cdi
    }

    /// Prepares `claim` (or answers from the checkpoint if it is prepared already) and
    /// returns its devices.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        check_ref(claim)?;
        let object = self.read_claim(claim).await;
        let mut prepared = self.prepared.lock().await;
        if let Some(known) = prepared.claims.get(&claim.uid) {
            // Prepared already (another pod sharing the claim, a kubelet retry, or a
            // restart): the same devices; only the pods it is reserved for may have grown.
            let devices = known.devices.clone();
            let pods = match &object {
                Ok(object) => claim::fraction(object, &self.pool, &self.gpus, self.sharing)
                    .map(|f| f.pods.into_iter().map(|(uid, _)| uid).collect::<Vec<_>>())
                    .ok(),
                Err(_) => None,
            };
            if let Some(pods) = pods.filter(|pods| *pods != known.pod_uids) {
                let mut next = prepared.clone();
                if let Some(entry) = next.claims.get_mut(&claim.uid) {
                    entry.pod_uids = pods;
                }
                next.store(&self.checkpoint_path)?;
                *prepared = next;
            }
            tracing::debug!(%claim, "claim already prepared");
            return Ok(devices);
        }
        let object = object?;
        let fraction = claim::fraction(&object, &self.pool, &self.gpus, self.sharing)?;
        let pod_priority = self.pod_priority(&claim.namespace, &fraction.pods).await;
        let entry = PreparedClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            pod_uids: fraction.pods.iter().map(|(uid, _)| uid.clone()).collect(),
            devices: fraction.devices,
        };
        let cdi_error =
            |source| PrepareError::Cdi { claim: claim.clone(), dir: self.cdi.dir.clone(), source };
        cdi::write(&self.cdi, &entry, pod_priority).map_err(cdi_error)?;
        let mut next = prepared.clone();
        next.claims.insert(claim.uid.clone(), entry.clone());
        if let Err(e) = next.store(&self.checkpoint_path) {
            let _ = cdi::remove(&self.cdi.dir, &claim.uid);
            return Err(e.into());
        }
        *prepared = next;
        for device in &entry.devices {
            tracing::info!(
                %claim,
                gpu = %device.gpu_uuid,
                request = device.request_bytes,
                limit = device.limit_bytes,
                "claim prepared"
            );
        }
        Ok(entry.devices)
    }

    /// Unprepares `claim` from the checkpoint: its CDI spec removed, its entry dropped. A
    /// claim this plugin never prepared (or already unprepared) is done already.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        check_ref(claim)?;
        let mut prepared = self.prepared.lock().await;
        cdi::remove(&self.cdi.dir, &claim.uid).map_err(|source| PrepareError::Cdi {
            claim: claim.clone(),
            dir: self.cdi.dir.clone(),
            source,
        })?;
        if !prepared.claims.contains_key(&claim.uid) {
            tracing::debug!(%claim, "claim not prepared here: nothing to unprepare");
            return Ok(());
        }
        let mut next = prepared.clone();
        next.claims.remove(&claim.uid);
        next.store(&self.checkpoint_path)?;
        *prepared = next;
        tracing::info!(%claim, "claim unprepared");
        Ok(())
    }

    /// The CDI device IDs of a prepared device.
    pub fn cdi_device_ids(&self, device: &PreparedDevice) -> Vec<String> {
        cdi::device_ids(&self.cdi, &device.cdi_device_id, &device.gpu_uuid)
    }

    async fn read_claim(&self, claim: &ClaimRef) -> Result<ResourceClaim, PrepareError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let object = api
            .get(&claim.name)
            .await
            .map_err(|source| PrepareError::ApiServer { claim: claim.clone(), source: Box::new(source) })?;
        let found = object.metadata.uid.clone().unwrap_or_default();
        if found != claim.uid {
            return Err(PrepareError::Replaced { claim: claim.clone(), found });
        }
        Ok(object)
    }

    /// The priority of the first pod the claim is reserved for that can be read (0 when
    /// none can: the arbiter still caps it by the pod's own).
    async fn pod_priority(&self, namespace: &str, pods: &[(String, String)]) -> i32 {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        for (uid, name) in pods {
            match api.get(name).await {
                Ok(pod) if pod.metadata.uid.as_deref() == Some(uid) => {
                    return pod.spec.and_then(|s| s.priority).unwrap_or(0);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(pod = %format!("{namespace}/{name}"), "reading the pod's priority: {e}")
                }
            }
        }
        0
    }
}

/// The kubelet names claims by namespace, name and UID; all three must be there, and the
/// UID must be safe in a file name.
fn check_ref(claim: &ClaimRef) -> Result<(), PrepareError> {
    let bad = |reason: &str| PrepareError::Request { claim: claim.to_string(), reason: reason.to_owned() };
    if claim.namespace.is_empty() || claim.name.is_empty() {
        return Err(bad("the request names no namespace or name"));
    }
    // Kubernetes names: a namespace is a DNS label, a claim's name a DNS subdomain.
    let name_ok = |name: &str, longest: usize| {
        name.len() <= longest
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !name_ok(&claim.namespace, 63) || !name_ok(&claim.name, 253) {
        return Err(bad("the namespace or name is not a Kubernetes name"));
    }
    let uid_ok = !claim.uid.is_empty()
        && claim.uid.len() <= 64
        && claim.uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if !uid_ok {
        return Err(bad("the uid is not a Kubernetes UID"));
    }
    Ok(())
}
