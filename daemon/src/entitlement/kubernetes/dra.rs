//! Entitlements from the DRA claims prepared on this node: what the DRA kubelet plugin
//! (`gpufrac-device-plugin`'s, driver `gpu.gpufrac.io`) recorded in its checkpoint
//! ([`gpufrac_common::dra::Checkpoint`]) when the kubelet asked it to prepare a claim for
//! a pod.
//!
//! For a pod (found by UID in the store of this node's pods): the checkpoint's claims whose
//! `podUids` hold the pod's UID and whose namespace is the pod's. Exactly one device among
//! them is the entitlement: that GPU only, the claim's request and limit in bytes, its
//! resolver, its priority (default the pod's `spec.priority`), its compute share as
//! prepared ([`PreparedDevice::compute`]; none prepared: no compute request, any limit),
//! and the claim's group ([`gpufrac_common::dra::group_name`]: every process using the
//! claim shares its memory).
//! None is a refusal; several (two claims, or a claim of two GPUs) are refused too, naming
//! them: a process uses one GPU.
//!
//! The checkpoint is re-read when its inode, size, mtime or ctime change (a `stat` per
//! lookup; the plugin replaces it by renaming). It must be a regular file owned by root and
//! writable by no one else, since it says what every pod may have; a file that is not, or
//! that cannot be read or parsed, gives [`Verdict::Unknown`](super::Verdict::Unknown) with
//! the reason. A missing file is an empty checkpoint (nothing prepared yet).

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpufrac_common::dra::{group_name, Checkpoint, PreparedClaim, PreparedDevice};

use super::pods::PodRecord;
use super::{Amount, Entitlement, NO_COMPUTE_REQUEST};

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
    let devices: Vec<(&PreparedClaim, &PreparedDevice)> =
        claims.iter().flat_map(|claim| claim.devices.iter().map(move |device| (*claim, device))).collect();
    let (claim, device) = match devices.as_slice() {
        [] => return Err(DraRefusal::No(format!("no gpufrac claim prepared on this node for {at}"))),
        [one] => *one,
        _ => {
            let named: Vec<String> = claims
                .iter()
                .map(|claim| match claim.devices.len() {
                    1 => claim.name.clone(),
                    n => {
                        let names: Vec<&str> = claim.devices.iter().map(|d| d.device.as_str()).collect();
                        format!("{} ({n} GPUs: {})", claim.name, names.join(", "))
                    }
                })
                .collect();
            let claims_word = if claims.len() == 1 { "claim" } else { "claims" };
            return Err(DraRefusal::No(format!(
                "a process may use one gpufrac GPU; {at} holds {claims_word} {}",
                named.join(", ")
            )));
        }
    };
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
    let compute = device.compute().map_err(|e| DraRefusal::Invalid(format!("{which}: {e}")))?;
    Ok(Entitlement {
        source: format!("DRA claim {}/{}", claim.namespace, claim.name),
        devices: Some(vec![uuid]),
        max_request: Amount::Bytes(device.request_bytes),
        max_limit: Amount::Bytes(device.limit_bytes),
        max_priority: device.priority.unwrap_or(pod.priority),
        resolver: device.resolver,
        group: Some(group_name(&claim.uid)),
        max_compute: Some(compute.unwrap_or(NO_COMPUTE_REQUEST)),
    })
}
