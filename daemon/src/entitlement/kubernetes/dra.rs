//! Entitlements from the DRA claims prepared on this node: what the DRA kubelet plugin
//! (`gpufrac-device-plugin`'s, driver `gpu.gpufrac.io`) recorded in its checkpoint
//! ([`gpufrac_common::dra::Checkpoint`]) when the kubelet asked it to prepare a claim for
//! a pod.
//!
//! For a pod (found by UID in the store of this node's pods): the checkpoint's claims whose
//! `podUids` hold the pod's UID and whose namespace is the pod's. Exactly one claim among
//! them is the entitlement: its GPUs only, on each the request and limit in bytes the
//! claim holds there (a tensor-parallel claim holds a fraction of each of several GPUs),
//! its resolver, its priority (default the pod's `spec.priority`), its compute share as
//! prepared ([`PreparedDevice::compute`](gpufrac_common::dra::PreparedDevice::compute);
//! none prepared: no compute request, any limit), and the claim's group
//! ([`gpufrac_common::dra::group_name`]: every process using the claim shares its memory).
//! None is a refusal; two claims are refused too, naming them: a process is one group, and
//! a claim is one group.
//!
//! The checkpoint is re-read when its inode, size, mtime or ctime change (a `stat` per
//! lookup; the plugin replaces it by renaming). It must be a regular file owned by root and
//! writable by no one else, since it says what every pod may have; a file that is not, or
//! that cannot be read or parsed, gives [`Verdict::Unknown`](super::Verdict::Unknown) with
//! the reason. A missing file is an empty checkpoint (nothing prepared yet).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpufrac_common::dra::{group_name, Checkpoint, PreparedClaim};

use super::pods::PodRecord;
use super::{Amount, DeviceCaps, Entitlement, NO_COMPUTE_REQUEST};

/// What identifies one version of the checkpoint file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// The DRA kubelet plugin's checkpoint, read again when it changes.
#[derive(Debug)]
pub struct PreparedClaims {
    path: PathBuf,
    /// The last version read (`None`: the file was missing).
    last: Mutex<Option<(Option<Stamp>, Arc<Checkpoint>)>>,
}

impl PreparedClaims {
    /// The checkpoint at `path` (read at the first lookup).
    pub fn new(path: PathBuf) -> PreparedClaims {
        PreparedClaims { path, last: Mutex::new(None) }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoint as it is now; `Err` says why it cannot be believed.
    pub fn current(&self) -> Result<Arc<Checkpoint>, String> {
        let stamp = self.trusted_stamp()?;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, checkpoint)) = last.as_ref() {
            if *seen == stamp {
                return Ok(checkpoint.clone());
            }
        }
        let checkpoint = match Checkpoint::load(&self.path) {
            Ok(checkpoint) => Arc::new(checkpoint),
            Err(e) => {
                // A damaged file is not kept: the next lookup reads it again.
                *last = None;
                return Err(format!("DRA {e}"));
            }
        };
        // Kept only if the file did not change while it was read (else read it next time).
        if self.trusted_stamp()? == stamp {
            *last = Some((stamp, checkpoint.clone()));
        } else {
            *last = None;
        }
        Ok(checkpoint)
    }

    /// The file's stamp, `None` when it is missing; `Err` when it is not a regular file
    /// owned by root and writable by root only.
    fn trusted_stamp(&self) -> Result<Option<Stamp>, String> {
        let at = self.path.display();
        let meta = match std::fs::symlink_metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("DRA checkpoint {at}: {e}")),
        };
        if !meta.file_type().is_file() {
            return Err(format!("DRA checkpoint {at}: not a regular file"));
        }
        if meta.uid() != 0 {
            return Err(format!(
                "DRA checkpoint {at}: owned by uid {}, not root: only the DRA kubelet plugin (root) may \
                 say what pods are entitled to",
                meta.uid()
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(format!(
                "DRA checkpoint {at}: mode {:04o} lets group or others write it: only root may",
                meta.mode() & 0o7777
            ));
        }
        Ok(Some(Stamp::of(&meta)))
    }
}

/// Why a pod gets nothing from the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum DraRefusal {
    /// A refusal.
    No(String),
    /// The checkpoint holds something this arbiter cannot use: not a verdict.
    Invalid(String),
}

/// What the processes of `pod` may have, from `checkpoint`.
pub fn decide(pod: &PodRecord, checkpoint: &Checkpoint) -> Result<Entitlement, DraRefusal> {
    let at = format!("pod {}/{}", pod.namespace, pod.name);
    let claims: Vec<&PreparedClaim> =
        checkpoint.claims_of_pod(&pod.uid).filter(|claim| claim.namespace == pod.namespace).collect();
    let claim = match claims.as_slice() {
        [] => return Err(DraRefusal::No(format!("no gpufrac claim prepared on this node for {at}"))),
        [one] => *one,
        _ => {
            // One process is one group: two claims would be two groups, two memories.
            let named: Vec<&str> = claims.iter().map(|claim| claim.name.as_str()).collect();
            return Err(DraRefusal::No(format!(
                "a process may use one gpufrac claim (ask for several GPUs in one claim: count: N); \
                 {at} holds claims {}",
                named.join(", ")
            )));
        }
    };
    let Some(first) = claim.devices.first() else {
        return Err(DraRefusal::No(format!("DRA claim {}/{} holds no GPU", claim.namespace, claim.name)));
    };
    let mut devices = BTreeMap::new();
    // The largest of each: what the processes may declare on any of the claim's GPUs.
    let (mut max_request, mut max_limit) = (0, 0);
    let compute = first.compute();
    for device in &claim.devices {
        let which = format!("DRA claim {}/{} device {}", claim.namespace, claim.name, device.device);
        let Some(uuid) = gpufrac_common::gpu_uuid::parse(&device.gpu_uuid) else {
            return Err(DraRefusal::Invalid(format!(
                "{which}: GPU UUID {:?} is not a GPU UUID",
                super::cut(&device.gpu_uuid)
            )));
        };
        if device.limit_bytes < device.request_bytes {
            return Err(DraRefusal::Invalid(format!(
                "{which}: limit {} bytes is below the request, {} bytes",
                device.limit_bytes, device.request_bytes
            )));
        }
        // Checked when the checkpoint was read; a device that is not a share is not believed.
        device.compute().map_err(|e| DraRefusal::Invalid(format!("{which}: {e}")))?;
        // The plugin prepares a claim only when these agree (the process has one of each).
        let differs = [
            ("resolver", device.resolver != first.resolver),
            ("priority", device.priority != first.priority),
            ("compute share", device.compute() != compute),
        ];
        if let Some((field, _)) = differs.iter().find(|(_, differs)| *differs) {
            return Err(DraRefusal::Invalid(format!(
                "{which}: its {field} differs from that of {} in the same claim",
                first.device
            )));
        }
        let caps = DeviceCaps {
            max_request: Amount::Bytes(device.request_bytes),
            max_limit: Amount::Bytes(device.limit_bytes),
        };
        if devices.insert(uuid, caps).is_some() {
            return Err(DraRefusal::Invalid(format!(
                "{which}: GPU {} appears twice in the claim",
                device.gpu_uuid
            )));
        }
        max_request = max_request.max(device.request_bytes);
        max_limit = max_limit.max(device.limit_bytes);
    }
    let compute = compute.map_err(|e| DraRefusal::Invalid(format!("DRA claim {}: {e}", claim.name)))?;
    Ok(Entitlement {
        source: format!("DRA claim {}/{}", claim.namespace, claim.name),
        devices: Some(devices),
        max_request: Amount::Bytes(max_request),
        max_limit: Amount::Bytes(max_limit),
        max_priority: first.priority.unwrap_or(pod.priority),
        resolver: first.resolver,
        group: Some(group_name(&claim.uid)),
        max_compute: Some(compute.unwrap_or(NO_COMPUTE_REQUEST)),
    })
}
