//! The claims the DRA kubelet plugin prepared on this node, as it records them in its
//! checkpoint: the plugin writes the file (so that unpreparing never needs the API server,
//! and a restarted plugin prepares nothing twice), the arbiter reads it to learn what a
//! pod's processes are entitled to. Both sides use these types, so the file cannot drift.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::compute::ComputeSpec;
use crate::resolver::Resolver;

/// The DRA driver's name: the ResourceSlices' `spec.driver`, the claims' configuration
/// `driver`, the kubelet plugin's registered name and the DeviceClass's name.
pub const DRIVER: &str = "gpu.gpufrac.io";

/// The kubelet plugin's own folder (its DRA socket and checkpoint live there).
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/plugins/gpu.gpufrac.io";

/// The checkpoint's file name in the plugin's folder.
pub const CHECKPOINT_FILE: &str = "prepared-claims.json";

/// The checkpoint format this build writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

/// The group every process using the claim `claim_uid` shares: the claim's memory is one
/// request and one limit, whichever containers of its pods use it.
pub fn group_name(claim_uid: &str) -> String {
    format!("dra-{claim_uid}")
}

/// Every claim prepared on this node and not yet unprepared, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Checkpoint {
    /// [`CHECKPOINT_VERSION`].
    pub version: u32,
    /// The prepared claims, by `metadata.uid`.
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's `metadata.uid`.
    pub uid: String,
    /// The pods the claim is reserved for (`status.reservedFor`), by UID: the only pods
    /// whose processes the arbiter entitles to it.
    pub pod_uids: Vec<String>,
    /// The GPUs allocated to the claim by this driver.
    pub devices: Vec<PreparedDevice>,
}

/// One GPU of a prepared claim, with the fraction the claim holds of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PreparedDevice {
    /// The claim's requests this device satisfies.
    pub request_names: Vec<String>,
    /// The ResourceSlice pool (the node's name).
    pub pool: String,
    /// The GPU's device name in the slice (`gpu-<index>`).
    pub device: String,
    /// The slice devices the fraction is made of when the plugin publishes each GPU as
    /// equal shares (`gpu-<index>-<share>`); empty when the GPU is one device whose memory
    /// claims share.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<String>,
    /// The GPU's UUID (`GPU-...`).
    pub gpu_uuid: String,
    /// The allocation's share ID, when the device allows several allocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The guarantee: the `memory` capacity the claim consumed on the device, in bytes.
    pub request_bytes: u64,
    /// The burst ceiling, in bytes (at least the request, at most the GPU).
    pub limit_bytes: u64,
    /// The resolver the claim's configuration names, if any.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "resolver_name")]
    pub resolver: Option<Resolver>,
    /// The priority the claim's configuration names; `None`: the pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Idle this long, the claim's group may be parked (`parkAfter`, the shim's
    /// `GPUFRAC_PARK_AFTER`): a duration as the configuration wrote it, such as `30s`;
    /// `None`: never parked. Absent from checkpoints written before parking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub park_after: Option<String>,
    /// The claim's guaranteed share of the GPU's time, in per mille (0 to 1000): the
    /// `compute` capacity it consumed on the device, else its configuration's
    /// `computeRequest` (0 when only a limit is configured). Set with
    /// [`compute_limit_per_mille`](Self::compute_limit_per_mille) or not at all; `None`:
    /// no compute share (the shim's `GPUFRAC_COMPUTE_REQUEST` unset). Absent from
    /// checkpoints written before compute shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_request_per_mille: Option<u16>,
    /// The most of the GPU's time the claim's processes may take, in per mille (1 to 1000,
    /// at least the request): `computeLimit`, else the whole GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_limit_per_mille: Option<u16>,
    /// The CDI device ID given to the kubelet for this device.
    pub cdi_device_id: String,
}

impl PreparedDevice {
    /// The device's compute share; `Ok(None)`: none; `Err`: the two fields do not make one
    /// (one without the other, a limit of 0, above 1000 or below the request).
    pub fn compute(&self) -> Result<Option<ComputeSpec>, String> {
        match (self.compute_request_per_mille, self.compute_limit_per_mille) {
            (None, None) => Ok(None),
            (Some(request), Some(limit)) if limit > 0 => ComputeSpec::from_wire(request, limit)
                .map_err(|_| format!("compute request {request}‰ and limit {limit}‰ are not a share")),
            (request, limit) => Err(format!(
                "compute request {request:?}‰ and limit {limit:?}‰ are not a share (both are set, limit > 0, or neither)"
            )),
        }
    }

    /// Sets the device's compute share (`None`: none).
    pub fn set_compute(&mut self, spec: Option<ComputeSpec>) {
        self.compute_request_per_mille = spec.map(|s| s.request.per_mille());
        self.compute_limit_per_mille = spec.map(|s| s.limit.per_mille());
    }
}

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The file is not a checkpoint this build understands.
    #[error("checkpoint {path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Checkpoint {
        Checkpoint { version: CHECKPOINT_VERSION, claims: BTreeMap::new() }
    }

    /// Reads `path`; a file that does not exist is an empty checkpoint (nothing prepared yet).
    pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let text = match std::fs::read(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Checkpoint::new()),
            Err(source) => return Err(CheckpointError::Io { path: path.to_owned(), source }),
        };
        let invalid = |reason: String| CheckpointError::Invalid { path: path.to_owned(), reason };
        let checkpoint: Checkpoint = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        if checkpoint.version != CHECKPOINT_VERSION {
            return Err(invalid(format!(
                "version {} (this build reads version {CHECKPOINT_VERSION})",
                checkpoint.version
            )));
        }
        for (uid, claim) in &checkpoint.claims {
            if *uid != claim.uid {
                return Err(invalid(format!("claim {uid} is recorded with uid {}", claim.uid)));
            }
            for device in &claim.devices {
                device
                    .compute()
                    .map_err(|e| invalid(format!("claim {uid}, device {}: {e}", device.device)))?;
            }
        }
        Ok(checkpoint)
    }

    /// Writes the checkpoint to `path` atomically (a temporary file beside it, synced, then
    /// renamed over it), readable by its owner and group only: a reader sees the old or the
    /// new checkpoint, never half of one.
    pub fn store(&self, path: &Path) -> Result<(), CheckpointError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let io = |source| CheckpointError::Io { path: path.to_owned(), source };
        let text = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or(CHECKPOINT_FILE);
        let temporary = path.with_file_name(format!(".{file_name}.{}.tmp", std::process::id()));
        let written = (|| {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o640)
                .open(&temporary)?;
            file.write_all(&text)?;
            file.sync_all()?;
            std::fs::rename(&temporary, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        written.map_err(io)
    }

    /// The prepared claims reserved for the pod `pod_uid`.
    pub fn claims_of_pod<'a>(&'a self, pod_uid: &'a str) -> impl Iterator<Item = &'a PreparedClaim> + 'a {
        self.claims.values().filter(move |claim| claim.pod_uids.iter().any(|uid| uid == pod_uid))
    }
}

/// A resolver written as its name (`wait`, `priority`, `swap`).
mod resolver_name {
    use super::Resolver;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(resolver: &Option<Resolver>, s: S) -> Result<S::Ok, S::Error> {
        match resolver {
            Some(resolver) => s.serialize_str(&resolver.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Resolver>, D::Error> {
        let name: Option<String> = Option::deserialize(d)?;
        name.map(|name| name.parse().map_err(|e| serde::de::Error::custom(format!("resolver {name:?}: {e}"))))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> PreparedClaim {
        PreparedClaim {
            namespace: "inference".into(),
            name: "llm-gpu".into(),
            uid: "0f3c2a9e-1111-2222-3333-444455556666".into(),
            pod_uids: vec!["7a1b2c3d-0000-4000-8000-000000000001".into()],
            devices: vec![PreparedDevice {
                request_names: vec!["gpu".into()],
                pool: "node-a".into(),
                device: "gpu-0".into(),
                shares: Vec::new(),
                gpu_uuid: "GPU-aaaaaaaa-0000-0000-0000-000000000000".into(),
                share_id: Some("a1b2c".into()),
                request_bytes: 20 << 30,
                limit_bytes: 40 << 30,
                resolver: Some(Resolver::Swap),
                priority: None,
                park_after: Some("30s".into()),
                compute_request_per_mille: Some(300),
                compute_limit_per_mille: Some(1000),
                cdi_device_id: "gpufrac.io/claim=0f3c2a9e-1111-2222-3333-444455556666-gpu-0".into(),
            }],
        }
    }

    #[test]
    fn a_checkpoint_survives_a_round_trip_and_finds_claims_by_pod() {
        let dir = std::env::temp_dir().join(format!("gpufrac-dra-checkpoint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(CHECKPOINT_FILE);
        assert_eq!(Checkpoint::load(&path).unwrap(), Checkpoint::new(), "a missing file is empty");
        let mut checkpoint = Checkpoint::new();
        let claim = claim();
        checkpoint.claims.insert(claim.uid.clone(), claim.clone());
        checkpoint.store(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"resolver\": \"swap\""), "{text}");
        assert!(text.contains("\"computeRequestPerMille\": 300"), "{text}");
        assert!(text.contains("\"computeLimitPerMille\": 1000"), "{text}");
        let back = Checkpoint::load(&path).unwrap();
        assert_eq!(back, checkpoint);
        assert_eq!(back.claims_of_pod("7a1b2c3d-0000-4000-8000-000000000001").count(), 1);
        assert_eq!(back.claims_of_pod("another").count(), 0);
        let spec = back.claims[&claim.uid].devices[0].compute().unwrap().unwrap();
        assert_eq!((spec.request.per_mille(), spec.limit.per_mille()), (300, 1000));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_checkpoint_is_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("gpufrac-dra-damaged-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(CHECKPOINT_FILE);
        std::fs::write(&path, r#"{"version": 7, "claims": {}}"#).unwrap();
        let e = Checkpoint::load(&path).unwrap_err().to_string();
        assert!(e.contains("version 7") && e.contains(CHECKPOINT_FILE), "{e}");
        std::fs::write(&path, r#"{"version": 1, "claims": {"x": {"resolver": "fast"}}}"#).unwrap();
        assert!(Checkpoint::load(&path).is_err());
        // A compute share that is not one (limit below the request, or half of one).
        for (request, limit) in
            [(Some(500), Some(400)), (Some(300), None), (None, Some(0)), (Some(0), Some(1001))]
        {
            let mut checkpoint = Checkpoint::new();
            let mut claim = claim();
            claim.devices[0].compute_request_per_mille = request;
            claim.devices[0].compute_limit_per_mille = limit;
            checkpoint.claims.insert(claim.uid.clone(), claim);
            checkpoint.store(&path).unwrap();
            let e = Checkpoint::load(&path).unwrap_err().to_string();
            assert!(e.contains("compute request") && e.contains("gpu-0"), "{request:?} {limit:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_group_of_a_claim_fits_the_arbiter() {
        let group = group_name("0f3c2a9e-1111-2222-3333-444455556666");
        assert_eq!(group, "dra-0f3c2a9e-1111-2222-3333-444455556666");
        assert!(group.len() <= 64);
    }
}
