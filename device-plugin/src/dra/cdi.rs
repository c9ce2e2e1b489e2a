//! The CDI spec of a prepared claim: one file per claim in the CDI folder, kind
//! `gpufrac.io/claim`, one device per GPU, whose container edits preload the shim, give it
//! the claim's fraction (and `GPUFRAC_PARK_AFTER` when the claim may be parked,
//! `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT` when it has a compute share) and the
//! arbiter's socket, and make the GPU visible. The container
//! runtime applies it to every container of the pod that uses the claim.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use gpufrac_common::dra::{group_name, PreparedClaim};
use serde_json::{json, Value};

/// The CDI kind of gpufrac's claim devices.
pub const KIND: &str = "gpufrac.io/claim";
/// The CDI spec version written (the oldest that has everything used here).
pub const CDI_VERSION: &str = "0.6.0";

/// Where the shim and the arbiter are on the host (and at the same paths in containers).
#[derive(Debug, Clone)]
pub struct CdiConfig {
    /// The CDI folder the container runtime reads (`/var/run/cdi`).
    pub dir: PathBuf,
    /// The folder holding `libgpufrac.so` and `libgpufrac_core.so`.
    pub shim_dir: PathBuf,
    /// The arbiter's socket (absolute); its folder is mounted.
    pub arbiter_socket: PathBuf,
    /// Whether to also return NVIDIA's own CDI device (`nvidia.com/gpu=<UUID>`, from
    /// `nvidia-ctk cdi generate`) rather than rely on `NVIDIA_VISIBLE_DEVICES` alone.
    pub nvidia_cdi: bool,
}

/// The CDI device name of `device` (`gpu-0`) of the claim `claim_uid`.
pub fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// The fully qualified CDI device ID given to the kubelet.
pub fn device_id(claim_uid: &str, device: &str) -> String {
    format!("{KIND}={}", device_name(claim_uid, device))
}

/// The CDI device IDs of one prepared device: ours, and NVIDIA's when configured.
pub fn device_ids(config: &CdiConfig, cdi_device_id: &str, gpu_uuid: &str) -> Vec<String> {
    let mut ids = vec![cdi_device_id.to_owned()];
    if config.nvidia_cdi {
        ids.push(format!("nvidia.com/gpu={gpu_uuid}"));
    }
    ids
}

/// The spec file of the claim `claim_uid`.
pub fn spec_path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("gpufrac.io-claim_{claim_uid}.json"))
}

/// The CDI spec of `claim`. `priority` is what its processes declare when the claim's
/// configuration names none (the pod's).
pub fn spec(config: &CdiConfig, claim: &PreparedClaim, pod_priority: i32) -> Value {
    let socket_dir = config.arbiter_socket.parent().unwrap_or(Path::new("/"));
    let shim = config.shim_dir.join("libgpufrac.so");
    let mount = |path: &Path, access: &str| {
        json!({
            "hostPath": path.display().to_string(),
            "containerPath": path.display().to_string(),
            "options": [access, "nosuid", "nodev", "rbind"],
        })
    };
    let devices: Vec<Value> = claim
        .devices
        .iter()
        .map(|device| {
            let mut env = vec![
                format!("LD_PRELOAD={}", shim.display()),
                format!("NVIDIA_VISIBLE_DEVICES={}", device.gpu_uuid),
                format!("GPUFRAC_MEMORY_REQUEST={}", device.request_bytes),
                format!("GPUFRAC_MEMORY_LIMIT={}", device.limit_bytes),
                format!("GPUFRAC_PRIORITY={}", device.priority.unwrap_or(pod_priority)),
                format!("GPUFRAC_ARBITER_SOCKET={}", config.arbiter_socket.display()),
                format!("GPUFRAC_GROUP={}", group_name(&claim.uid)),
                format!("GPUFRAC_RESOLVER={}", device.resolver.unwrap_or_default()),
            ];
            if let Some(park_after) = &device.park_after {
                env.push(format!("GPUFRAC_PARK_AFTER={park_after}"));
            }
            // Checked when the claim was prepared and when the checkpoint is read.
            if let Ok(Some(compute)) = device.compute() {
                env.push(format!("GPUFRAC_COMPUTE_REQUEST={}", compute.request));
                env.push(format!("GPUFRAC_COMPUTE_LIMIT={}", compute.limit));
            }
            json!({
                "name": device_name(&claim.uid, &device.device),
                "containerEdits": {
                    "env": env,
                    "mounts": [mount(&config.shim_dir, "ro"), mount(socket_dir, "rw")],
                },
            })
        })
        .collect();
    json!({"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices})
}

/// Writes the claim's spec atomically (a temporary file renamed over it: the runtime
/// never reads half a spec).
pub fn write(config: &CdiConfig, claim: &PreparedClaim, pod_priority: i32) -> std::io::Result<PathBuf> {
    let path = spec_path(&config.dir, &claim.uid);
    let text =
        serde_json::to_vec_pretty(&spec(config, claim, pod_priority)).map_err(std::io::Error::other)?;
    let temporary = config.dir.join(format!(".gpufrac.io-claim_{}.{}.tmp", claim.uid, std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(&text)?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written.map(|()| path)
}

/// Removes the claim's spec; one that is already gone is fine.
pub fn remove(dir: &Path, claim_uid: &str) -> std::io::Result<()> {
    match std::fs::remove_file(spec_path(dir, claim_uid)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
