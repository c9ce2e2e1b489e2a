//! Where each GPU sits, for placement constraints across GPUs: its PCIe root complex and
//! NUMA node (from sysfs) and its NVLink peers (from NVML's peer-to-peer status).
//!
//! The PCIe root follows Kubernetes' standard attribute `resource.kubernetes.io/pcieRoot`
//! (`pci<domain>:<bus>`), found as `k8s.io/dynamic-resource-allocation/deviceattribute`
//! finds it: `/sys/bus/pci/devices/<BDF>` links to `/sys/devices/pci<domain>:<bus>/.../<BDF>`,
//! whose first component is the root complex.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// Why a GPU's place could not be read from sysfs.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// NVML's PCI bus ID is not `domain:bus:device.function` in hex.
    #[error("PCI bus ID {0:?} is not domain:bus:device.function")]
    BusId(String),
    /// A sysfs file or link could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file or link.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The device's sysfs link does not lead where a PCI device's does.
    #[error("{link} points to {target}, not to /sys/devices/pci<domain>:<bus>/.../{bdf}")]
    Link {
        /// The link, `/sys/bus/pci/devices/<BDF>`.
        link: PathBuf,
        /// Where it points, made absolute.
        target: PathBuf,
        /// The device's address.
        bdf: String,
    },
    /// `numa_node` does not hold an integer.
    #[error("{path} holds {text:?}, not a NUMA node")]
    Numa {
        /// The file.
        path: PathBuf,
        /// What it holds.
        text: String,
    },
}

/// The sysfs name of the device NVML calls `bus_id` (`00000000:65:00.0` → `0000:65:00.0`):
/// lowercase hex, the domain in at least 4 digits, as the kernel prints it.
pub fn sysfs_bdf(bus_id: &str) -> Result<String, TopologyError> {
    let bad = || TopologyError::BusId(bus_id.to_owned());
    let hex = |part: &str, width: usize| {
        (!part.is_empty() && part.len() <= width && part.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| part.to_ascii_lowercase())
    };
    let mut parts = bus_id.trim().split(':');
    let (Some(domain), Some(bus), Some(slot), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let (device, function) = slot.split_once('.').ok_or_else(bad)?;
    let domain = hex(domain, 8).ok_or_else(bad)?;
    let domain = u32::from_str_radix(&domain, 16).map_err(|_| bad())?;
    let bus = hex(bus, 2).ok_or_else(bad)?;
    let device = hex(device, 2).ok_or_else(bad)?;
    let function = hex(function, 1).ok_or_else(bad)?;
    Ok(format!("{domain:04x}:{bus:0>2}:{device:0>2}.{function}"))
}

/// `path` with `.` and `..` taken out without touching the file system, as Go's
/// `filepath.Clean` does (sysfs links are relative: `../../../devices/pci0000:00/...`).
fn lexically_clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The PCIe root complex (`pci0000:00`) of the device NVML calls `bus_id`, under the sysfs
/// mounted at `sysfs_root`/`sys`.
pub fn pcie_root(sysfs_root: &Path, bus_id: &str) -> Result<String, TopologyError> {
    let bdf = sysfs_bdf(bus_id)?;
    let link = sysfs_root.join("sys/bus/pci/devices").join(&bdf);
    let target =
        std::fs::read_link(&link).map_err(|source| TopologyError::Read { path: link.clone(), source })?;
    let target = lexically_clean(&link.parent().unwrap_or(Path::new("/")).join(target));
    let devices = sysfs_root.join("sys/devices");
    let bad = || TopologyError::Link { link: link.clone(), target: target.clone(), bdf: bdf.clone() };
    let below = target.strip_prefix(&devices).map_err(|_| bad())?;
    let root = below.components().next().and_then(|c| c.as_os_str().to_str()).ok_or_else(bad)?;
    if !root.starts_with("pci") || target.file_name().and_then(|n| n.to_str()) != Some(bdf.as_str()) {
        return Err(bad());
    }
    Ok(root.to_owned())
}

/// The NUMA node of the device NVML calls `bus_id` (its sysfs `numa_node`); `None` for a
/// device without NUMA affinity (`-1`), which the standard attribute leaves out.
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Result<Option<u32>, TopologyError> {
    let path = sysfs_root.join("sys/bus/pci/devices").join(sysfs_bdf(bus_id)?).join("numa_node");
    let text = std::fs::read_to_string(&path)
        .map_err(|source| TopologyError::Read { path: path.clone(), source })?;
    match text.trim().parse::<i64>() {
        Ok(n) if n < 0 => Ok(None),
        Ok(n) => u32::try_from(n).map(Some).map_err(|_| TopologyError::Numa { path, text }),
        Err(_) => Err(TopologyError::Numa { path, text }),
    }
}

/// What NVML said of NVLink between the node's GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvLinks {
    /// Pairs of GPU indexes NVML reports NVLink between, smaller index first.
    pub linked: BTreeSet<(u32, u32)>,
    /// GPUs for which some answer was an error: their links are not known.
    pub unknown: BTreeSet<u32>,
}

impl NvLinks {
    /// The GPUs `index` has NVLink to; `None` when not all are known.
    pub fn peers(&self, index: u32) -> Option<Vec<u32>> {
        if self.unknown.contains(&index) {
            return None;
        }
        let peers = self
            .linked
            .iter()
            .filter_map(|&(a, b)| match (a == index, b == index) {
                (true, _) => Some(b),
                (_, true) => Some(a),
                _ => None,
            })
            .collect::<BTreeSet<_>>();
        Some(peers.into_iter().collect())
    }

    /// Each GPU of `gpus` that is in an NVLink domain → the domain: the smallest index of a
    /// set of GPUs connected by NVLink in which every pair is linked. A GPU without NVLink,
    /// or in a connected set where some pair is not linked or some link is not known, is in
    /// none: then `matchAttribute` on the domain guarantees NVLink between every pair of a
    /// claim's devices.
    pub fn domains(&self, gpus: &[u32]) -> BTreeMap<u32, u32> {
        let gpus: BTreeSet<u32> = gpus.iter().copied().collect();
        let mut seen = BTreeSet::new();
        let mut domains = BTreeMap::new();
        for &start in &gpus {
            if !seen.insert(start) {
                continue;
            }
            // The connected set of `start`, by breadth-first search over the links.
            let mut set = BTreeSet::from([start]);
            let mut next = vec![start];
            while let Some(gpu) = next.pop() {
                for peer in self.peers(gpu).unwrap_or_default() {
                    if gpus.contains(&peer) && set.insert(peer) {
                        seen.insert(peer);
                        next.push(peer);
                    }
                }
            }
            let complete = set.iter().all(|&a| {
                !self.unknown.contains(&a)
                    && set.iter().all(|&b| a == b || self.linked.contains(&(a.min(b), a.max(b))))
            });
            if set.len() >= 2 && complete {
                domains.extend(set.iter().map(|&gpu| (gpu, start)));
            }
        }
        domains
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links(pairs: &[(u32, u32)], unknown: &[u32]) -> NvLinks {
        NvLinks { linked: pairs.iter().copied().collect(), unknown: unknown.iter().copied().collect() }
    }

    #[test]
    fn nvml_bus_ids_become_sysfs_names() {
        assert_eq!(sysfs_bdf("00000000:65:00.0").unwrap(), "0000:65:00.0");
        assert_eq!(sysfs_bdf("00000001:1A:1F.7").unwrap(), "0001:1a:1f.7");
        // A domain past 16 bits (VMD) keeps its digits, as the kernel prints it.
        assert_eq!(sysfs_bdf("00010000:01:00.0").unwrap(), "10000:01:00.0");
        for bad in ["", "65:00.0", "0000:65:00", "0000:6g:00.0", "0000:65:00.0:1", "000000000:65:00.0"] {
            assert!(matches!(sysfs_bdf(bad), Err(TopologyError::BusId(_))), "{bad}");
        }
    }

    /// A sysfs tree under `root` with the GPU `bdf` below the root complex `complex`
    /// behind a bridge, linked relatively as the kernel links it.
    fn fake_device(root: &Path, complex: &str, bdf: &str, numa: &str) {
        let device = root.join("sys/devices").join(complex).join("0000:00:01.0").join(bdf);
        std::fs::create_dir_all(&device).unwrap();
        std::fs::write(device.join("numa_node"), format!("{numa}\n")).unwrap();
        let bus = root.join("sys/bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        let target = format!("../../../devices/{complex}/0000:00:01.0/{bdf}");
        std::os::unix::fs::symlink(target, bus.join(bdf)).unwrap();
    }

    #[test]
    fn pcie_root_and_numa_node_come_from_sysfs() {
        let root = tempfile::tempdir().unwrap();
        fake_device(root.path(), "pci0000:64", "0000:65:00.0", "1");
        fake_device(root.path(), "pci0001:00", "0001:1a:00.0", "-1");
        assert_eq!(pcie_root(root.path(), "00000000:65:00.0").unwrap(), "pci0000:64");
        assert_eq!(pcie_root(root.path(), "00000001:1A:00.0").unwrap(), "pci0001:00");
        assert_eq!(numa_node(root.path(), "00000000:65:00.0").unwrap(), Some(1));
        // -1: no NUMA affinity, so no attribute.
        assert_eq!(numa_node(root.path(), "00000001:1A:00.0").unwrap(), None);
        // A device sysfs does not have is an error (the attribute is left out).
        let missing = pcie_root(root.path(), "00000000:99:00.0").unwrap_err().to_string();
        assert!(missing.contains("sys/bus/pci/devices/0000:99:00.0"), "{missing}");
        assert!(numa_node(root.path(), "00000000:99:00.0").is_err());
    }

    #[test]
    fn a_link_outside_sys_devices_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let bus = root.path().join("sys/bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        std::os::unix::fs::symlink("../../../elsewhere/pci0000:00/0000:65:00.0", bus.join("0000:65:00.0"))
            .unwrap();
        std::os::unix::fs::symlink("../../../devices/pci0000:00/0000:66:00.0", bus.join("0000:65:01.0"))
            .unwrap();
        let e = pcie_root(root.path(), "00000000:65:00.0").unwrap_err().to_string();
        assert!(e.contains("not to /sys/devices/pci<domain>:<bus>/.../0000:65:00.0"), "{e}");
        // The link must end at the device itself.
        assert!(matches!(pcie_root(root.path(), "00000000:65:01.0"), Err(TopologyError::Link { .. })));
    }

    #[test]
    fn a_numa_node_that_is_not_a_number_is_an_error() {
        let root = tempfile::tempdir().unwrap();
        fake_device(root.path(), "pci0000:00", "0000:10:00.0", "many");
        let e = numa_node(root.path(), "00000000:10:00.0").unwrap_err().to_string();
        assert!(e.contains("holds \"many\\n\", not a NUMA node"), "{e}");
    }

    #[test]
    fn two_linked_gpus_are_one_domain() {
        let links = links(&[(0, 1)], &[]);
        assert_eq!(links.peers(0), Some(vec![1]));
        assert_eq!(links.peers(1), Some(vec![0]));
        assert_eq!(links.domains(&[0, 1]), BTreeMap::from([(0, 0), (1, 0)]));
    }

    #[test]
    fn four_gpus_in_two_pairs_are_two_domains() {
        let links = links(&[(0, 1), (2, 3)], &[]);
        assert_eq!(links.domains(&[0, 1, 2, 3]), BTreeMap::from([(0, 0), (1, 0), (2, 2), (3, 2)]));
        // An NVSwitch machine: every pair linked, one domain.
        let all = self::links(&[(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)], &[]);
        assert_eq!(all.peers(2), Some(vec![0, 1, 3]));
        assert_eq!(all.domains(&[0, 1, 2, 3]).values().collect::<BTreeSet<_>>(), BTreeSet::from([&0]));
    }

    #[test]
    fn a_set_not_fully_linked_or_not_known_has_no_domain() {
        // A chain 0-1-2: 0 and 2 are connected through 1 but not linked themselves.
        let chain = links(&[(0, 1), (1, 2), (3, 4)], &[]);
        assert_eq!(chain.domains(&[0, 1, 2, 3, 4]), BTreeMap::from([(3, 3), (4, 3)]));
        // A GPU without NVLink is in no domain, and has no peers.
        assert_eq!(chain.peers(5), Some(vec![]));
        assert!(!chain.domains(&[0, 1, 5]).contains_key(&5));
        // A GPU whose links NVML could not tell: no peers, and its set has no domain.
        let unknown = links(&[(0, 1), (2, 3)], &[1]);
        assert_eq!(unknown.peers(1), None);
        assert_eq!(unknown.domains(&[0, 1, 2, 3]), BTreeMap::from([(2, 2), (3, 2)]));
    }
}
