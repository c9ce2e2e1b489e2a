//! The CDI spec of a prepared claim: one file per claim in the CDI folder, kind
//! `gpufrac.io/claim`, one device per GPU, each carrying the claim's container edits, which
//! preload the shim, give it the claim's fraction (and `GPUFRAC_PARK_AFTER` when the claim
//! may be parked, `GPUFRAC_COMPUTE_REQUEST` and `GPUFRAC_COMPUTE_LIMIT` when it has a
//! compute share) and the arbiter's socket, and make the claim's GPUs visible. The
//! container runtime applies it to every container of the pod that uses the claim.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use gpufrac_common::dra::{group_name, PreparedClaim};
use serde_json::{json, Value};

use super::gpus::parse_device_name;

/// The CDI kind of gpufrac's claim devices.
pub const KIND: &str = "gpufrac.io/claim";
/// The oldest CDI spec version runtimes still read, and what a spec needs past it: the
/// version a spec declares is the smallest that has everything it uses
/// ([`minimum_version`]), so a runtime bundling an older CDI library still reads it.
const EARLIEST_VERSION: &str = "0.3.0";

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
    let mount = |path: &Path, access: &str| {
        json!({
            "hostPath": path.display().to_string(),
            "containerPath": path.display().to_string(),
            "options": [access, "nosuid", "nodev", "rbind"],
        })
    };
    let edits = json!({
        "env": env(config, claim, pod_priority),
        "mounts": [mount(&config.shim_dir, "ro"), mount(socket_dir, "rw")],
    });
    // Every device carries the claim's edits: a container given any of them sees all the
    // claim's GPUs, as its one group.
    let devices: Vec<Value> = claim
        .devices
        .iter()
        .map(|device| json!({"name": device_name(&claim.uid, &device.device), "containerEdits": edits}))
        .collect();
    let mut spec = json!({"kind": KIND, "devices": devices});
    spec["cdiVersion"] = json!(minimum_version(&spec));
    spec
}

/// The env of the claim's containers. The shim applies one request and limit to every GPU
/// it sees, so a claim of several GPUs declares the largest of each; the arbiter holds
/// each GPU to what the claim holds of it. The rest is the same on every device (the
/// plugin prepares no claim whose devices disagree).
fn env(config: &CdiConfig, claim: &PreparedClaim, pod_priority: i32) -> Vec<String> {
    let Some(first) = claim.devices.first() else { return Vec::new() };
    let mut gpus: Vec<(Option<u32>, &str)> = claim
        .devices
        .iter()
        .map(|d| (parse_device_name(&d.device).map(|(index, _)| index), d.gpu_uuid.as_str()))
        .collect();
    // In NVML's order, as the device plugin lists them.
    gpus.sort();
    let visible: Vec<&str> = gpus.into_iter().map(|(_, uuid)| uuid).collect();
    let request = claim.devices.iter().map(|d| d.request_bytes).max().unwrap_or(0);
    let limit = claim.devices.iter().map(|d| d.limit_bytes).max().unwrap_or(0);
    let mut env = vec![
        format!("LD_PRELOAD={}", config.shim_dir.join("libgpufrac.so").display()),
        format!("NVIDIA_VISIBLE_DEVICES={}", visible.join(",")),
        format!("GPUFRAC_MEMORY_REQUEST={request}"),
        format!("GPUFRAC_MEMORY_LIMIT={limit}"),
        format!("GPUFRAC_PRIORITY={}", first.priority.unwrap_or(pod_priority)),
        format!("GPUFRAC_ARBITER_SOCKET={}", config.arbiter_socket.display()),
        format!("GPUFRAC_GROUP={}", group_name(&claim.uid)),
        format!("GPUFRAC_RESOLVER={}", first.resolver.unwrap_or_default()),
    ];
    if let Some(park_after) = &first.park_after {
        env.push(format!("GPUFRAC_PARK_AFTER={park_after}"));
    }
    // Checked when the claim was prepared and when the checkpoint is read.
    if let Ok(Some(compute)) = first.compute() {
        env.push(format!("GPUFRAC_COMPUTE_REQUEST={}", compute.request));
        env.push(format!("GPUFRAC_COMPUTE_LIMIT={}", compute.limit));
    }
    env
}

/// The smallest CDI version that has every feature `spec` uses, by the rules of the CDI
/// library's own check (`specs-go/version.go`), newest first: `additionalGids` or
/// `intelRdt` need 0.7.0; annotations, or a dot in the kind's class, 0.6.0; a device name
/// that starts with a digit (ours start with the claim's UID), or a device node's
/// `hostPath`, 0.5.0; a mount's `type` 0.4.0.
pub fn minimum_version(spec: &Value) -> &'static str {
    let devices = spec["devices"].as_array().map(Vec::as_slice).unwrap_or_default();
    let edits: Vec<&Value> =
        devices.iter().map(|d| &d["containerEdits"]).chain([&spec["containerEdits"]]).collect();
    let non_empty = |v: &Value| {
        v.as_array().is_some_and(|a| !a.is_empty()) || v.as_object().is_some_and(|o| !o.is_empty())
    };
    if edits.iter().any(|e| non_empty(&e["additionalGids"]) || !e["intelRdt"].is_null()) {
        return "0.7.0";
    }
    let class_has_dot =
        spec["kind"].as_str().and_then(|k| k.split_once('/')).is_some_and(|(_, c)| c.contains('.'));
    if non_empty(&spec["annotations"])
        || devices.iter().any(|d| non_empty(&d["annotations"]))
        || class_has_dot
    {
        return "0.6.0";
    }
    let starts_with_digit =
        |d: &Value| d["name"].as_str().and_then(|n| n.bytes().next()).is_some_and(|b| b.is_ascii_digit());
    let host_path = |e: &&Value| {
        e["deviceNodes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["hostPath"].as_str().is_some_and(|p| !p.is_empty()))
    };
    if devices.iter().any(starts_with_digit) || edits.iter().any(host_path) {
        return "0.5.0";
    }
    let typed_mount = |e: &&Value| {
        e["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["type"].as_str().is_some_and(|t| !t.is_empty()))
    };
    if edits.iter().any(typed_mount) {
        return "0.4.0";
    }
    EARLIEST_VERSION
}

/// Whether [`ensure`] found the claim's spec as it should be or wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The file already said exactly this.
    Unchanged,
    /// The file was missing (a reboot empties the CDI folder, a tmpfs) or different, and
    /// was written.
    Written,
}

/// Makes the claim's spec file say what it should: left alone when it does, else written
/// atomically (a temporary file renamed over it: the runtime never reads half a spec).
pub fn ensure(config: &CdiConfig, claim: &PreparedClaim, pod_priority: i32) -> std::io::Result<Written> {
    let path = spec_path(&config.dir, &claim.uid);
    let text =
        serde_json::to_vec_pretty(&spec(config, claim, pod_priority)).map_err(std::io::Error::other)?;
    if std::fs::read(&path).is_ok_and(|found| found == text) {
        return Ok(Written::Unchanged);
    }
    write_text(config, claim, &path, &text).map(|()| Written::Written)
}

/// Writes the claim's spec atomically, whatever is there.
pub fn write(config: &CdiConfig, claim: &PreparedClaim, pod_priority: i32) -> std::io::Result<PathBuf> {
    let path = spec_path(&config.dir, &claim.uid);
    let text =
        serde_json::to_vec_pretty(&spec(config, claim, pod_priority)).map_err(std::io::Error::other)?;
    write_text(config, claim, &path, &text).map(|()| path)
}

fn write_text(config: &CdiConfig, claim: &PreparedClaim, path: &Path, text: &[u8]) -> std::io::Result<()> {
    let temporary = config.dir.join(format!(".gpufrac.io-claim_{}.{}.tmp", claim.uid, std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(text)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// Removes the claim's spec; one that is already gone is fine.
pub fn remove(dir: &Path, claim_uid: &str) -> std::io::Result<()> {
    match std::fs::remove_file(spec_path(dir, claim_uid)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_the_smallest_the_spec_needs() {
        let device = |name: &str, edits: Value| json!({"name": name, "containerEdits": edits});
        let with = |devices: Vec<Value>| json!({"kind": KIND, "devices": devices});
        let env = json!({"env": ["A=1"], "mounts": [{"hostPath": "/a", "containerPath": "/a"}]});
        assert_eq!(minimum_version(&with(vec![device("gpu-0", env.clone())])), "0.3.0");
        assert_eq!(
            minimum_version(&with(vec![device(
                "gpu-0",
                json!({"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]})
            )])),
            "0.4.0"
        );
        // Ours: device names start with the claim's UID, which may start with a digit.
        assert_eq!(
            minimum_version(&with(vec![device("gpu-0", env.clone()), device("0f3c-gpu-0", env.clone())])),
            "0.5.0"
        );
        assert_eq!(minimum_version(&with(vec![device("a0f3c-gpu-0", env.clone())])), "0.3.0");
        assert_eq!(
            minimum_version(&with(vec![device(
                "gpu-0",
                json!({"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]})
            )])),
            "0.5.0"
        );
        let mut annotated = with(vec![device("gpu-0", env.clone())]);
        annotated["devices"][0]["annotations"] = json!({"a": "b"});
        assert_eq!(minimum_version(&annotated), "0.6.0");
        assert_eq!(minimum_version(&json!({"kind": "gpufrac.io/claim.v2", "devices": []})), "0.6.0");
        assert_eq!(minimum_version(&with(vec![device("gpu-0", json!({"additionalGids": [44]}))])), "0.7.0");
    }

    #[test]
    fn a_claims_spec_declares_the_version_it_needs_and_is_rewritten_only_when_different() {
        let dir = std::env::temp_dir().join(format!("gpufrac-cdi-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = CdiConfig {
            dir: dir.clone(),
            shim_dir: "/opt/gpufrac/lib".into(),
            arbiter_socket: "/run/gpufrac/arbiter.sock".into(),
            nvidia_cdi: false,
        };
        let mut claim = PreparedClaim {
            namespace: "inference".into(),
            name: "llm".into(),
            uid: "0f3c2a9e-1111-4222-8333-444455556666".into(),
            pod_uids: Vec::new(),
            devices: vec![gpufrac_common::dra::PreparedDevice {
                request_names: vec!["gpu".into()],
                pool: "node-a".into(),
                device: "gpu-0".into(),
                shares: Vec::new(),
                gpu_uuid: "GPU-aaaa".into(),
                share_id: None,
                request_bytes: 1 << 30,
                limit_bytes: 1 << 30,
                resolver: None,
                priority: None,
                park_after: None,
                compute_request_per_mille: None,
                compute_limit_per_mille: None,
                cdi_device_id: device_id("0f3c2a9e-1111-4222-8333-444455556666", "gpu-0"),
            }],
        };
        assert_eq!(spec(&config, &claim, 0)["cdiVersion"], "0.5.0", "the UID starts with a digit");
        claim.uid = "af3c2a9e-1111-4222-8333-444455556666".into();
        assert_eq!(spec(&config, &claim, 0)["cdiVersion"], "0.3.0");
        assert_eq!(ensure(&config, &claim, 7).unwrap(), Written::Written, "missing");
        assert_eq!(ensure(&config, &claim, 7).unwrap(), Written::Unchanged);
        assert_eq!(ensure(&config, &claim, 8).unwrap(), Written::Written, "different");
        std::fs::write(spec_path(&dir, &claim.uid), "{}").unwrap();
        assert_eq!(ensure(&config, &claim, 8).unwrap(), Written::Written, "damaged");
        remove(&dir, &claim.uid).unwrap();
        assert_eq!(ensure(&config, &claim, 8).unwrap(), Written::Written, "removed (a reboot)");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
