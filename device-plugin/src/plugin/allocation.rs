//! What to give a container: the preferred shares (bin packing on one GPU; more shares
//! than one GPU has, split evenly over the fewest GPUs that can hold them, for a
//! tensor-parallel server) and the answer to `Allocate` (the GPUs, the shim and its
//! settings). Pure logic, tested directly.

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
    /// Must-include shares on more GPUs than the request spans.
    #[error(
        "shares on {0} GPUs ({1}) must be included, but {2} shares span {3}: ask for at most {4} shares per GPU"
    )]
    SeveralGpus(usize, String, usize, usize, u32),
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

/// The preferred shares for one container. Up to one GPU's worth: all on one GPU, on the
/// fullest GPU that still has `size` free shares (so whole GPUs stay free for big jobs),
/// including `must_include`. More (the webhook's `gpu-fraction-num-devices`: N GPUs'
/// fractions asked as N times the shares): split evenly over the fewest GPUs that can hold
/// them, `size / n` on each of `n = ceil(size / shares)` GPUs, the GPUs of `must_include`
/// first, then the fullest that have that many free.
pub fn preferred(
    available: &[String],
    must_include: &[String],
    size: usize,
    known: &[String],
    shares: u32,
) -> Result<Vec<String>, AllocationError> {
    let free = by_gpu(available, known, shares)?;
    let must = by_gpu(must_include, known, shares)?;
    let per_gpu = shares as usize;
    let gpus = size.div_ceil(per_gpu.max(1)).max(1);
    if must.len() > gpus {
        let names = must.keys().cloned().collect::<Vec<_>>().join(", ");
        return Err(AllocationError::SeveralGpus(must.len(), names, size, gpus, shares));
    }
    if must_include.len() > size {
        return Err(AllocationError::Preference(format!(
            "{} devices must be included but only {size} are asked for",
            must_include.len()
        )));
    }
    if !size.is_multiple_of(gpus) {
        return Err(AllocationError::Preference(format!(
            "{size} shares do not split evenly over {gpus} GPUs: ask for a multiple of {gpus} (the same \
             fraction of each GPU)"
        )));
    }
    let each = size / gpus;
    if let Some((uuid, ids)) = must.iter().find(|(_, ids)| ids.len() > each) {
        return Err(AllocationError::Preference(format!(
            "{} shares of {uuid} must be included, more than the {each} of each of {gpus} GPUs",
            ids.len()
        )));
    }
    // GPUs with enough free shares (counting the must-include ones): those holding
    // must-include shares first, then the fullest (whole GPUs stay free for big jobs).
    let mut candidates: Vec<(&String, &Vec<(u32, String)>)> =
        free.iter().filter(|(_, ids)| ids.len() >= each).collect();
    candidates.sort_by_key(|(uuid, ids)| (!must.contains_key(*uuid), ids.len(), (*uuid).clone()));
    let pinned_fit = must.keys().all(|uuid| candidates.iter().any(|(c, _)| *c == uuid));
    if candidates.len() < gpus || !pinned_fit {
        return Err(AllocationError::Preference(match gpus {
            1 => format!("no single GPU has {size} free shares"),
            _ => {
                format!("{gpus} GPUs with {each} free shares each are needed; {} have them", candidates.len())
            }
        }));
    }
    let mut chosen = Vec::with_capacity(size);
    for (uuid, ids) in candidates.into_iter().take(gpus) {
        let mut on_gpu: Vec<String> =
            must.get(uuid).map(|v| v.iter().map(|(_, id)| id.clone()).collect()).unwrap_or_default();
        for (_, id) in ids {
            if on_gpu.len() >= each {
                break;
            }
            if !on_gpu.contains(id) {
                on_gpu.push(id.clone());
            }
        }
        chosen.extend(on_gpu);
    }
    Ok(chosen)
}

/// The container's shares per GPU, in NVML's order (`known`'s): each GPU's UUID and how
/// many of its shares the container holds.
pub fn shares_per_gpu(
    ids: &[String],
    known: &[String],
    shares: u32,
) -> Result<Vec<(String, usize)>, AllocationError> {
    let mut gpus = by_gpu(ids, known, shares)?;
    Ok(known.iter().filter_map(|uuid| gpus.remove(uuid).map(|ids| (uuid.clone(), ids.len()))).collect())
}

/// What `Allocate` returns for one container's shares. Shares on several GPUs make a
/// fraction of each: every GPU is visible, and the shim declares the largest fraction on
/// each, which the arbiter cuts to the container's own shares of that GPU (it reads them
/// from the kubelet).
pub fn allocate(
    ids: &[String],
    known: &[String],
    config: &AllocationConfig,
) -> Result<ContainerAllocateResponse, AllocationError> {
    if ids.is_empty() {
        return Err(AllocationError::Empty);
    }
    let gpus = by_gpu(ids, known, config.shares_per_gpu)?;
    let counts = shares_per_gpu(ids, known, config.shares_per_gpu)?;
    let Some((first_uuid, _)) = counts.first() else { return Err(AllocationError::Empty) };
    let most = counts.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let fraction = most as f64 / config.shares_per_gpu as f64;
    let request = if most as u32 >= config.shares_per_gpu { "1".to_owned() } else { format!("{fraction}") };
    // Shares are exclusive, so the first GPU's first share names this allocation uniquely.
    let first = gpus.get(first_uuid).and_then(|v| v.first()).map_or(0, |(n, _)| *n);
    let group = format!(
        "gpufrac-{}-{first}-{}",
        first_uuid.trim_start_matches("GPU-").get(..8).unwrap_or("gpu"),
        counts.iter().map(|(_, n)| n).sum::<usize>()
    );
    let visible: Vec<&str> = counts.iter().map(|(uuid, _)| uuid.as_str()).collect();
    let shim = config.shim_dir.join("libgpufrac.so");
    let socket_dir = config.arbiter_socket.parent().unwrap_or(Path::new("/")).to_path_buf();
    let envs = [
        ("NVIDIA_VISIBLE_DEVICES", visible.join(",")),
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
    }

    #[test]
    fn more_than_a_gpu_is_split_evenly_over_the_fullest_gpus() {
        const C: &str = "GPU-cccccccc-0000-0000-0000-000000000000";
        let known = vec![A.to_owned(), B.to_owned(), C.to_owned()];
        let mut avail = ids(A, 2..10); // 8 free
        avail.extend(ids(B, 0..10)); // empty
        avail.extend(ids(C, 4..10)); // 6 free: fullest
                                     // 2 GPUs × 0.6: 6 on C (fullest), then 6 on A.
        let mut want = ids(C, 4..10);
        want.extend(ids(A, 2..8));
        assert_eq!(preferred(&avail, &[], 12, &known, 10).unwrap(), want);
        // Must-include shares pin their GPU, whichever is fuller.
        let got = preferred(&avail, &[share_id(B, 3)], 12, &known, 10).unwrap();
        let on = |uuid: &str| got.iter().filter(|id| id.starts_with(uuid)).count();
        assert_eq!((on(A), on(B), on(C)), (0, 6, 6), "{got:?}");
        assert!(got.contains(&share_id(B, 3)));
        // 3 × 0.9: only B has 9 free.
        let e = preferred(&avail, &[], 27, &known, 10).unwrap_err();
        assert_eq!(e.to_string(), "3 GPUs with 9 free shares each are needed; 1 have them");
        // 15 over 2 GPUs is not the same fraction of each.
        let e = preferred(&avail, &[], 15, &known, 10).unwrap_err();
        assert!(e.to_string().contains("15 shares do not split evenly over 2 GPUs"), "{e}");
        // More must-include GPUs than the request spans.
        let e = preferred(&avail, &[share_id(A, 2), share_id(B, 1)], 4, &known, 10).unwrap_err();
        assert!(matches!(e, AllocationError::SeveralGpus(2, _, 4, 1, 10)), "{e}");
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
        // Shares on two GPUs: both visible, in NVML's order; the largest fraction declared
        // (the arbiter holds each GPU to the container's own shares of it).
        let mut two = ids(B, 0..50);
        two.extend(ids(A, 0..75));
        let r = allocate(&two, &known(), &config).unwrap();
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], format!("{A},{B}"));
        assert_eq!(r.envs["GPUFRAC_MEMORY_REQUEST"], "0.75");
        assert_eq!(shares_per_gpu(&two, &known(), 100).unwrap(), [(A.to_owned(), 75), (B.to_owned(), 50)]);
        assert_eq!(allocate(&[], &known(), &config), Err(AllocationError::Empty));
        assert!(matches!(
            allocate(&["GPU-zzz::1".into()], &known(), &config),
            Err(AllocationError::Unknown(_))
        ));
        assert!(matches!(allocate(&[share_id(A, 100)], &known(), &config), Err(AllocationError::Unknown(_))));
    }
}
