//! What to give a container: the preferred shares (bin packing on one GPU) and the
//! answer to `Allocate` (the GPU, the shim and its settings). Pure logic, tested directly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::api::{ContainerAllocateResponse, Mount};
use super::devices::parse_share_id;

/// Where the shim and the arbiter live on the node, and how GPUs are split.
#[derive(Debug, Clone)]
pub struct AllocationConfig {
    /// Shares per GPU.
    pub shares_per_gpu: u32,
    /// Host folder holding `libgpufrac.so` and `libgpufrac_core.so`, mounted read-only at the same path.
    pub shim_dir: PathBuf,
    /// The arbiter's socket; its folder is mounted at the same path.
    pub arbiter_socket: PathBuf,
}

/// Why a request is refused (becomes a gRPC `InvalidArgument`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    /// No device in the request.
    #[error("empty request: no device IDs")]
    Empty,
    /// An ID this plugin never advertised.
    #[error("unknown device ID {0:?} (expected <GPU UUID>::<n> of this node)")]
    Unknown(String),
    /// Shares of more than one GPU.
    #[error("shares on {0} GPUs ({1}): gpufrac gives a container a fraction of one GPU; ask for at most {2} shares")]
    SeveralGpus(usize, String, u32),
    /// A preferred allocation that cannot be formed.
    #[error("{0}")]
    Preference(String),
}

/// Groups share IDs by GPU, checking each against the known GPUs.
fn by_gpu<'a>(
    ids: impl IntoIterator<Item = &'a String>,
    known: &[String],
    shares: u32,
) -> Result<BTreeMap<String, Vec<(u32, String)>>, AllocationError> {
    let mut out: BTreeMap<String, Vec<(u32, String)>> = BTreeMap::new();
    for id in ids {
        match parse_share_id(id) {
            Some((uuid, n)) if n < shares && known.iter().any(|k| k == uuid) => {
                out.entry(uuid.to_owned()).or_default().push((n, id.clone()))
            }
            _ => return Err(AllocationError::Unknown(id.clone())),
        }
    }
    for v in out.values_mut() {
        v.sort();
        v.dedup();
    }
    Ok(out)
}

/// The preferred shares for one container: all on one GPU, on the fullest GPU that still
/// has `size` free shares (so whole GPUs stay free for big jobs), including
/// `must_include`.
pub fn preferred(
    available: &[String],
    must_include: &[String],
    size: usize,
    known: &[String],
    shares: u32,
) -> Result<Vec<String>, AllocationError> {
    let free = by_gpu(available, known, shares)?;
    let must = by_gpu(must_include, known, shares)?;
    if must.len() > 1 {
        let gpus = must.keys().cloned().collect::<Vec<_>>().join(", ");
        return Err(AllocationError::SeveralGpus(must.len(), gpus, shares));
    }
    if must_include.len() > size {
        return Err(AllocationError::Preference(format!(
            "{} devices must be included but only {size} are asked for",
            must_include.len()
        )));
    }
    let pinned = must.keys().next().cloned();
    // Candidates: GPUs with enough free shares (counting the must-include ones), fullest first.
    let candidate = free
        .iter()
        .filter(|(uuid, _)| pinned.as_ref().is_none_or(|p| p == *uuid))
        .filter(|(_, ids)| ids.len() >= size)
        .min_by_key(|(uuid, ids)| (ids.len(), (*uuid).clone()));
    let Some((uuid, ids)) = candidate else {
        return Err(AllocationError::Preference(format!("no single GPU has {size} free shares")));
    };
    let mut chosen: Vec<String> =
        must.get(uuid).map(|v| v.iter().map(|(_, id)| id.clone()).collect()).unwrap_or_default();
    for (_, id) in ids {
        if chosen.len() >= size {
            break;
        }
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    Ok(chosen)
}

/// What `Allocate` returns for one container's shares.
pub fn allocate(
    ids: &[String],
    known: &[String],
    config: &AllocationConfig,
) -> Result<ContainerAllocateResponse, AllocationError> {
    if ids.is_empty() {
        return Err(AllocationError::Empty);
    }
    let gpus = by_gpu(ids, known, config.shares_per_gpu)?;
    if gpus.len() != 1 {
        let names = gpus.keys().cloned().collect::<Vec<_>>().join(", ");
        return Err(AllocationError::SeveralGpus(gpus.len(), names, config.shares_per_gpu));
    }
    let Some((uuid, shares)) = gpus.into_iter().next() else { return Err(AllocationError::Empty) };
    let fraction = shares.len() as f64 / config.shares_per_gpu as f64;
    let request =
        if shares.len() as u32 >= config.shares_per_gpu { "1".to_owned() } else { format!("{fraction}") };
    // Shares are exclusive, so the first share's number names this allocation uniquely.
    let first = shares.first().map_or(0, |(n, _)| *n);
    let group = format!(
        "gpufrac-{}-{first}-{}",
        uuid.trim_start_matches("GPU-").get(..8).unwrap_or("gpu"),
        shares.len()
    );
    let shim = config.shim_dir.join("libgpufrac.so");
    let socket_dir = config.arbiter_socket.parent().unwrap_or(Path::new("/")).to_path_buf();
    let envs = [
        ("NVIDIA_VISIBLE_DEVICES", uuid.clone()),
        ("GPUFRAC_MEMORY_REQUEST", request),
        ("LD_PRELOAD", shim.display().to_string()),
        ("GPUFRAC_ARBITER_SOCKET", config.arbiter_socket.display().to_string()),
        ("GPUFRAC_GROUP", group),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let mount = |path: &Path, read_only: bool| Mount {
        container_path: path.display().to_string(),
        host_path: path.display().to_string(),
        read_only,
    };
    Ok(ContainerAllocateResponse {
        envs,
        mounts: vec![mount(&config.shim_dir, true), mount(&socket_dir, false)],
        devices: Vec::new(),
        annotations: Default::default(),
        cdi_devices: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::devices::share_id;

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

    fn known() -> Vec<String> {
        vec![A.into(), B.into()]
    }

    fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| share_id(uuid, n)).collect()
    }

    #[test]
    fn prefers_the_fullest_gpu_that_fits() {
        let mut avail = ids(A, 7..10); // A has 3 free: fuller
        avail.extend(ids(B, 0..10)); // B is empty
        assert_eq!(preferred(&avail, &[], 2, &known(), 10).unwrap(), ids(A, 7..9));
        assert_eq!(preferred(&avail, &[], 5, &known(), 10).unwrap(), ids(B, 0..5));
        let must = vec![share_id(B, 4)];
        let got = preferred(&avail, &must, 2, &known(), 10).unwrap();
        assert_eq!(got, vec![share_id(B, 4), share_id(B, 0)]);
        assert!(preferred(&avail, &[share_id(A, 7), share_id(B, 1)], 2, &known(), 10).is_err());
        assert!(preferred(&avail, &[], 11, &known(), 10).is_err());
    }

    #[test]
    fn allocate_gives_one_gpu_and_the_shim() {
        let config = AllocationConfig {
            shares_per_gpu: 100,
            shim_dir: "/opt/gpufrac/lib".into(),
            arbiter_socket: "/run/gpufrac/arbiter.sock".into(),
        };
        let r = allocate(&ids(A, 10..35), &known(), &config).unwrap();
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], A);
        assert_eq!(r.envs["GPUFRAC_MEMORY_REQUEST"], "0.25");
        assert_eq!(r.envs["LD_PRELOAD"], "/opt/gpufrac/lib/libgpufrac.so");
        assert_eq!(r.envs["GPUFRAC_ARBITER_SOCKET"], "/run/gpufrac/arbiter.sock");
        assert_eq!(r.envs["GPUFRAC_GROUP"], "gpufrac-aaaaaaaa-10-25");
        assert_eq!(r.mounts.len(), 2);
        assert!(r.mounts[0].read_only && r.mounts[0].host_path == "/opt/gpufrac/lib");
        assert_eq!(r.mounts[1].host_path, "/run/gpufrac");
        assert_eq!(allocate(&ids(A, 0..100), &known(), &config).unwrap().envs["GPUFRAC_MEMORY_REQUEST"], "1");
        let mut two = ids(A, 0..2);
        two.extend(ids(B, 0..2));
        assert!(matches!(allocate(&two, &known(), &config), Err(AllocationError::SeveralGpus(2, ..))));
        assert_eq!(allocate(&[], &known(), &config), Err(AllocationError::Empty));
        assert!(matches!(
            allocate(&["GPU-zzz::1".into()], &known(), &config),
            Err(AllocationError::Unknown(_))
        ));
        assert!(matches!(allocate(&[share_id(A, 100)], &known(), &config), Err(AllocationError::Unknown(_))));
    }
}
