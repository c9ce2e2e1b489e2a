//! Prepare and unprepare: what the kubelet asks of the plugin, recorded in the plugin's
//! checkpoint (`prepared-claims.json` in its folder) before it is answered. A claim already
//! in the checkpoint is not prepared again (its pods are brought up to date, its CDI spec
//! written again if a reboot emptied the CDI folder); unpreparing reads only the
//! checkpoint, never the API server, because the kubelet unprepares after the claim may be
//! gone, possibly after a restart of the plugin. While the plugin runs
//! ([`Driver::keep_claims`]), missing specs are restored at start, a shared claim's pods
//! follow its `reservedFor`, and stale claims are unprepared.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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

impl ClaimRef {
    /// The claim a checkpoint entry records.
    pub fn of(entry: &PreparedClaim) -> ClaimRef {
        ClaimRef { namespace: entry.namespace.clone(), uid: entry.uid.clone(), name: entry.name.clone() }
    }
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
        if let Some(known) = prepared.claims.get(&claim.uid).cloned() {
            // Prepared already (a kubelet retry, a restart of the plugin or of the node):
            // the same devices, the pods it is reserved for brought up to date, and its
            // CDI spec written again if it is missing (a reboot empties the CDI folder)
            // or says something else.
            match &object {
                Ok(object) => {
                    let pods = claim::reserved_pods(object);
                    let uids: Vec<String> = pods.iter().map(|(uid, _)| uid.clone()).collect();
                    if uids != known.pod_uids {
                        let mut next = prepared.clone();
                        if let Some(entry) = next.claims.get_mut(&claim.uid) {
                            entry.pod_uids = uids;
                        }
                        next.store(&self.checkpoint_path)?;
                        *prepared = next;
                    }
                    let priority = self.pod_priority(&claim.namespace, &pods).await;
                    self.ensure_spec(&known, priority, false)
                        .map_err(|source| self.cdi_error(claim, source))?;
                }
                // The API server is away: a missing spec is still written (the pod's
                // priority unknown: 0, which the arbiter caps by the pod's own anyway).
                Err(e) => {
                    tracing::warn!(%claim, "answering from the checkpoint: {e}");
                    self.ensure_spec(&known, 0, true).map_err(|source| self.cdi_error(claim, source))?;
                }
            }
            tracing::debug!(%claim, "claim already prepared");
            return Ok(known.devices);
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
        cdi::write(&self.cdi, &entry, pod_priority).map_err(|source| self.cdi_error(claim, source))?;
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

    fn cdi_error(&self, claim: &ClaimRef, source: std::io::Error) -> PrepareError {
        PrepareError::Cdi { claim: claim.clone(), dir: self.cdi.dir.clone(), source }
    }

    /// Makes the claim's CDI spec say what it should (only when it is missing if
    /// `only_if_missing`), and says so when it was written.
    fn ensure_spec(
        &self,
        entry: &PreparedClaim,
        pod_priority: i32,
        only_if_missing: bool,
    ) -> std::io::Result<()> {
        if only_if_missing && cdi::spec_path(&self.cdi.dir, &entry.uid).exists() {
            return Ok(());
        }
        if cdi::ensure(&self.cdi, entry, pod_priority)? == cdi::Written::Written {
            let claim = ClaimRef::of(entry);
            tracing::info!(%claim, "CDI spec written again from the checkpoint (it was missing or different)");
        }
        Ok(())
    }

    /// Keeps the prepared claims true while the plugin runs: every checkpointed claim's
    /// missing CDI spec written again at once (after a reboot), each prepared claim's pods
    /// kept equal to its `reservedFor` (pods join and leave a shared claim without the
    /// kubelet asking the plugin), and stale claims unprepared (checked every
    /// `check_every`).
    pub async fn keep_claims(self: Arc<Self>, check_every: Duration) {
        self.restore_specs().await;
        tokio::join!(self.follow_claims(), self.clean_stale_claims(check_every));
    }

    /// Writes the spec of every checkpointed claim whose spec is missing (the CDI folder is
    /// a tmpfs: a reboot empties it, the checkpoint survives), before the kubelet asks.
    pub async fn restore_specs(&self) {
        let claims: Vec<PreparedClaim> = self.prepared.lock().await.claims.values().cloned().collect();
        for entry in claims {
            if cdi::spec_path(&self.cdi.dir, &entry.uid).exists() {
                continue;
            }
            let claim = ClaimRef::of(&entry);
            let priority = match self.read_claim(&claim).await {
                Ok(object) => self.pod_priority(&claim.namespace, &claim::reserved_pods(&object)).await,
                Err(e) => {
                    tracing::warn!(%claim, "the pod's priority for the restored CDI spec: {e}; using 0");
                    0
                }
            };
            // Under the lock: the claim may have been unprepared, or its spec written by a
            // prepare, meanwhile.
            let prepared = self.prepared.lock().await;
            let Some(entry) = prepared.claims.get(&claim.uid) else { continue };
            if let Err(e) = self.ensure_spec(entry, priority, true) {
                tracing::error!(%claim, "writing the claim's CDI spec again: {}", self.cdi_error(&claim, e));
            }
        }
    }

    /// Watches ResourceClaims (all namespaces; only the pods of those prepared here are
    /// kept, in the checkpoint) and rewrites the checkpoint when a prepared claim's
    /// `reservedFor` changes: the kubelet prepares a shared claim once per node, and the
    /// arbiter entitles exactly the pods the checkpoint lists.
    async fn follow_claims(&self) {
        use futures::StreamExt as _;
        use kube::runtime::{watcher, WatchStreamExt as _};
        let api: Api<ResourceClaim> = Api::all(self.client.clone());
        let events = watcher(api, watcher::Config::default()).default_backoff();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                    if let Err(e) = self.reserved_for_changed(&object).await {
                        tracing::error!("recording a shared claim's pods: {e}");
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("watching ResourceClaims: {e}"),
            }
        }
    }

    /// Brings the checkpointed pods of `object`, if it is prepared here, up to its
    /// `reservedFor`.
    async fn reserved_for_changed(&self, object: &ResourceClaim) -> Result<(), PrepareError> {
        let Some(uid) = object.metadata.uid.as_deref() else { return Ok(()) };
        let mut prepared = self.prepared.lock().await;
        let Some(known) = prepared.claims.get(uid) else { return Ok(()) };
        let pods: Vec<String> = claim::reserved_pods(object).into_iter().map(|(uid, _)| uid).collect();
        if pods == known.pod_uids {
            return Ok(());
        }
        let claim = ClaimRef::of(known);
        let mut next = prepared.clone();
        if let Some(entry) = next.claims.get_mut(uid) {
            entry.pod_uids = pods.clone();
        }
        next.store(&self.checkpoint_path)?;
        *prepared = next;
        tracing::info!(%claim, pods = ?pods, "the claim's pods changed: the checkpoint follows its reservedFor");
        Ok(())
    }

    /// Every `every`, checks each checkpointed claim against the API server; one found
    /// stale (its ResourceClaim gone, replaced by another UID, or no longer allocated to
    /// this node) on two checks in a row is unprepared: the kubelet, which unprepares
    /// claims itself, missed it (a pod deleted while the node was down, a kubelet whose
    /// state was lost). An API error is never taken for staleness.
    async fn clean_stale_claims(&self, every: Duration) {
        let mut suspects = std::collections::BTreeSet::new();
        loop {
            tokio::time::sleep(every).await;
            suspects = self.check_stale(&suspects).await;
        }
    }

    /// One check: unprepares the claims of `suspects` that are still stale; returns the
    /// claims stale now for the first time (and suspects the API server did not answer for).
    async fn check_stale(
        &self,
        suspects: &std::collections::BTreeSet<String>,
    ) -> std::collections::BTreeSet<String> {
        let claims: Vec<PreparedClaim> = self.prepared.lock().await.claims.values().cloned().collect();
        let mut next = std::collections::BTreeSet::new();
        for entry in claims {
            let claim = ClaimRef::of(&entry);
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
            let why = match api.get_opt(&claim.name).await {
                Ok(None) => "its ResourceClaim is gone from the API server".to_owned(),
                Ok(Some(object)) if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) => format!(
                    "the API server has another ResourceClaim under its name (uid {})",
                    object.metadata.uid.as_deref().unwrap_or("none")
                ),
                Ok(Some(object)) if !claim::allocated_in(&object, &self.pool) => {
                    "its ResourceClaim is no longer allocated to this node".to_owned()
                }
                Ok(Some(_)) => continue,
                Err(e) => {
                    tracing::debug!(%claim, "checking whether the claim is stale: {e}");
                    if suspects.contains(&claim.uid) {
                        next.insert(claim.uid);
                    }
                    continue;
                }
            };
            if !suspects.contains(&claim.uid) {
                tracing::info!(%claim, "prepared claim looks stale ({why}): unprepared if it still is at the next check");
                next.insert(claim.uid);
                continue;
            }
            match self.unprepare(&claim).await {
                Ok(()) => tracing::info!(%claim, "stale claim unprepared ({why})"),
                Err(e) => tracing::error!(%claim, "unpreparing a stale claim: {e}"),
            }
        }
        next
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
