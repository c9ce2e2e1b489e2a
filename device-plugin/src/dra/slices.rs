//! The ResourceSlice that advertises the node's GPUs to the scheduler: one slice, one pool
//! named after the node, and per healthy GPU either
//! - [`Sharing::Capacity`] (the default): one device (`gpu-<index>`) whose `memory`
//!   capacity many claims share (`allowMultipleAllocations`, consumable capacity). The
//!   request policy rounds what a claim asks for up to a multiple of [`MEMORY_STEP`] (at
//!   least [`MEMORY_MIN`]; a claim that names no amount gets [`MEMORY_DEFAULT`]), and a
//!   second consumable capacity `compute`, [`COMPUTE_PER_GPU`] per mille of the GPU's
//!   time, of which a claim that names none consumes nothing (so the scheduler never puts
//!   compute requests adding up past the GPU on it); or
//! - [`Sharing::Shares`]: for clusters without consumable capacity, N devices
//!   (`gpu-<index>-<share>`), each an equal share of its memory, all with the GPU's
//!   attributes, so that a claim asking for several with a `matchAttribute` constraint on
//!   `gpu.gpufrac.io/uuid` gets them all on one GPU. These have no `compute` capacity:
//!   a claim's `computeRequest` is then checked by the arbiter alone.
//!
//! A GPU that turns unhealthy stays in the slice with the taint [`UNHEALTHY_TAINT`]
//! (effect `NoExecute`: nothing new is placed on it and the pods using it are evicted),
//! removed when it is healthy again. Where the API server drops taints (`DRADeviceTaints`
//! off), the GPU leaves the slice instead (claims prepared on it stay prepared).
//!
//! The [`Publisher`] compares what the API server stored with what it sent: fields dropped
//! (consumable capacity's, taints) are said once per change at WARN in the log and in the
//! Node condition [`CONDITION`] (`kubectl describe node`), which stays while the gate is
//! off, unlike an Event, which the API server forgets after an hour.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, DeviceTaint,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::Value;

use super::claim::{COMPUTE, MEMORY};
use super::gpus::{share_name, GpuInfo};
use super::DRIVER;

/// The least memory a claim may hold of a GPU.
pub const MEMORY_MIN: &str = "256Mi";
/// What a claim's memory is rounded up to a multiple of.
pub const MEMORY_STEP: &str = "256Mi";
/// The memory of a claim that names none.
pub const MEMORY_DEFAULT: &str = "1Gi";

/// A GPU's `compute` capacity: its time, in per mille.
pub const COMPUTE_PER_GPU: u16 = 1000;

/// The most devices one ResourceSlice may hold (`resource.k8s.io/v1`).
pub const MAX_DEVICES: usize = 128;

/// How each GPU is advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// One device whose `memory` capacity claims share (needs `DRAConsumableCapacity`).
    Capacity,
    /// This many devices, each an equal share of the GPU's memory.
    Shares(u32),
}

impl Sharing {
    /// The memory of one slice device of a GPU of `memory` bytes.
    pub fn device_memory(self, memory: u64) -> u64 {
        match self {
            Sharing::Capacity => memory,
            Sharing::Shares(n) => memory / u64::from(n.max(1)),
        }
    }

    /// How many devices `gpus` GPUs take in the slice.
    pub fn devices(self, gpus: usize) -> usize {
        match self {
            Sharing::Capacity => gpus,
            Sharing::Shares(n) => gpus.saturating_mul(n as usize),
        }
    }
}

/// The slice's name for the node `node`.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute { string: Some(value.to_owned()), ..Default::default() }
}

fn version(major: i32, minor: i32) -> DeviceAttribute {
    DeviceAttribute { version: Some(format!("{major}.{minor}.0")), ..Default::default() }
}

/// Kubernetes' standard attribute of a device's PCIe root complex (`pci<domain>:<bus>`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// Kubernetes' standard attribute of a device's NUMA node (an int; left out without one).
pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
/// The indexes of the GPUs a GPU has NVLink to (`"1"`, `"0,2"`).
pub const NVLINK_PEERS: &str = "nvlinkPeers";
/// The GPU's NVLink domain: GPUs with the same value are NVLinked pairwise.
pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
/// The longest string attribute value `resource.k8s.io/v1` allows.
const MAX_STRING_ATTRIBUTE: usize = 64;

fn int(value: u32) -> DeviceAttribute {
    DeviceAttribute { int: Some(value.into()), ..Default::default() }
}

/// The GPU's attributes, which every one of its devices carries.
fn attributes(gpu: &GpuInfo) -> BTreeMap<String, DeviceAttribute> {
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("productName".to_owned(), string(&gpu.product_name)),
        ("index".to_owned(), int(gpu.index)),
        ("computeCapability".to_owned(), version(gpu.compute_capability.0, gpu.compute_capability.1)),
        ("driverVersion".to_owned(), string(&gpu.driver_version)),
        ("cudaVersion".to_owned(), version(gpu.cuda_version.0, gpu.cuda_version.1)),
        ("pciBusID".to_owned(), string(&gpu.pci_bus_id)),
    ]);
    let place = &gpu.topology;
    if let Some(root) = &place.pcie_root {
        attributes.insert(PCIE_ROOT.to_owned(), string(root));
    }
    if let Some(node) = place.numa_node {
        attributes.insert(NUMA_NODE.to_owned(), int(node));
    }
    let peers = place.nvlink_peers.iter().flatten().map(u32::to_string).collect::<Vec<_>>().join(",");
    // Past the API's limit (dozens of peers) the list is left out; the domain still says.
    if !peers.is_empty() && peers.len() <= MAX_STRING_ATTRIBUTE {
        attributes.insert(NVLINK_PEERS.to_owned(), string(&peers));
    }
    if let Some(domain) = place.nvlink_domain {
        attributes.insert(NVLINK_DOMAIN.to_owned(), int(domain));
    }
    attributes
}

/// The slice's device for `gpu` under [`Sharing::Capacity`].
pub fn device(gpu: &GpuInfo) -> Device {
    let memory = DeviceCapacity {
        value: Quantity(gpu.memory.to_string()),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(Quantity(MEMORY_DEFAULT.into())),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(MEMORY_MIN.into()),
                step: Some(Quantity(MEMORY_STEP.into())),
                max: None,
            }),
            valid_values: None,
        }),
    };
    // Asked for in per mille (`compute: 300` is 30% of the GPU's time); a claim that does
    // not ask consumes 0 and has no compute share, or the one its configuration names.
    let compute = DeviceCapacity {
        value: Quantity(COMPUTE_PER_GPU.to_string()),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(Quantity("0".into())),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity("0".into()),
                step: Some(Quantity("1".into())),
                max: None,
            }),
            valid_values: None,
        }),
    };
    Device {
        name: gpu.device_name(),
        attributes: Some(attributes(gpu)),
        capacity: Some(BTreeMap::from([(MEMORY.to_owned(), memory), (COMPUTE.to_owned(), compute)])),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    }
}

/// The slice's devices for `gpu` under [`Sharing::Shares`]`(shares)`.
pub fn share_devices(gpu: &GpuInfo, shares: u32) -> Vec<Device> {
    let memory = Sharing::Shares(shares).device_memory(gpu.memory);
    (0..shares)
        .map(|share| {
            let mut attributes = attributes(gpu);
            attributes.insert("share".to_owned(), int(share));
            Device {
                name: share_name(gpu.index, share),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([(
                    MEMORY.to_owned(),
                    DeviceCapacity { value: Quantity(memory.to_string()), request_policy: None },
                )])),
                ..Default::default()
            }
        })
        .collect()
}

/// The taint on the devices of an unhealthy GPU, where the cluster has device taints.
pub const UNHEALTHY_TAINT: &str = "gpu.gpufrac.io/unhealthy";
/// The taint's value: why the GPU is unhealthy.
pub const UNHEALTHY_VALUE: &str = "CriticalXID";
/// The taint's effect: nothing new is placed on the GPU and the pods using it are evicted.
pub const UNHEALTHY_EFFECT: &str = "NoExecute";
/// The Node condition that says whether the API server stored the slice as sent.
pub const CONDITION: &str = "GpufracDRASliceComplete";

/// How the slice shows an unhealthy GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unhealthy {
    /// Its devices stay, tainted [`UNHEALTHY_TAINT`] (needs `DRADeviceTaints`).
    Tainted,
    /// Its devices leave the slice.
    Removed,
}

/// The taint of a GPU unhealthy since `since`.
pub fn unhealthy_taint(since: &Time) -> DeviceTaint {
    DeviceTaint {
        key: UNHEALTHY_TAINT.to_owned(),
        value: Some(UNHEALTHY_VALUE.to_owned()),
        effect: UNHEALTHY_EFFECT.to_owned(),
        time_added: Some(since.clone()),
    }
}

/// The node's slice: its healthy GPUs (`healthy(uuid)`), pool `node`, generation
/// `generation`; unhealthy GPUs are left out.
pub fn slice(
    node: &str,
    gpus: &[GpuInfo],
    sharing: Sharing,
    healthy: impl Fn(&str) -> bool,
    generation: i64,
    owner: Option<OwnerReference>,
) -> ResourceSlice {
    let never = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let unhealthy =
        gpus.iter().filter(|g| !healthy(&g.uuid)).map(|g| (g.uuid.clone(), never.clone())).collect();
    slice_showing(node, gpus, sharing, &unhealthy, Unhealthy::Removed, generation, owner)
}

/// The node's slice, the GPUs of `unhealthy` (UUID → since when) shown as `how` says.
pub fn slice_showing(
    node: &str,
    gpus: &[GpuInfo],
    sharing: Sharing,
    unhealthy: &BTreeMap<String, Time>,
    how: Unhealthy,
    generation: i64,
    owner: Option<OwnerReference>,
) -> ResourceSlice {
    let devices = gpus
        .iter()
        .filter_map(|g| match (unhealthy.get(&g.uuid), how) {
            (None, _) => Some((g, None)),
            (Some(since), Unhealthy::Tainted) => Some((g, Some(unhealthy_taint(since)))),
            (Some(_), Unhealthy::Removed) => None,
        })
        .flat_map(|(g, taint)| {
            let mut devices = match sharing {
                Sharing::Capacity => vec![device(g)],
                Sharing::Shares(n) => share_devices(g, n),
            };
            if let Some(taint) = taint {
                for device in &mut devices {
                    device.taints = Some(vec![taint.clone()]);
                }
            }
            devices
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: 1 },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// The fields (by name: `allowMultipleAllocations`, `requestPolicy`, `taints`) that were
/// sent in `sent` and are missing from `stored`, as an API server with a feature gate off
/// drops them. Values are not compared: the API server rewrites quantities (`1000` → `1k`).
pub fn dropped_fields(sent: &ResourceSliceSpec, stored: &ResourceSliceSpec) -> BTreeSet<String> {
    fn walk(sent: &Value, stored: &Value, out: &mut BTreeSet<String>) {
        match (sent, stored) {
            (Value::Object(sent), Value::Object(stored)) => {
                for (key, value) in sent {
                    match stored.get(key) {
                        None | Some(Value::Null) if !value.is_null() => {
                            out.insert(key.clone());
                        }
                        Some(found) => walk(value, found, out),
                        None => {}
                    }
                }
            }
            // Devices (and their taints) come back in the order sent.
            (Value::Array(sent), Value::Array(stored)) => {
                for (value, found) in sent.iter().zip(stored) {
                    walk(value, found, out);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    if let (Ok(sent), Ok(stored)) = (serde_json::to_value(sent), serde_json::to_value(stored)) {
        walk(&sent, &stored, &mut out);
    }
    out
}

/// The fields of consumable capacity (`DRAConsumableCapacity`).
const CAPACITY_FIELDS: [&str; 2] = ["allowMultipleAllocations", "requestPolicy"];
/// The field of device taints (`DRADeviceTaints`).
const TAINTS_FIELD: &str = "taints";

/// What the fields `dropped` missing from the stored slice mean for placement.
pub fn dropped_meaning(dropped: &BTreeSet<String>) -> String {
    let mut meanings = Vec::new();
    if CAPACITY_FIELDS.iter().any(|f| dropped.contains(*f)) {
        meanings.push(
            "the API server has DRAConsumableCapacity off, so each claim gets a whole GPU and no GPU \
             is shared: turn the gate on (kube-apiserver, kube-scheduler, every kubelet) or run the \
             plugin with --shares N"
                .to_owned(),
        );
    }
    if dropped.contains(TAINTS_FIELD) {
        meanings.push(
            "the API server has DRADeviceTaints off, so an unhealthy GPU leaves the slice instead of \
             being tainted: nothing new is placed on it, but its pods are not evicted"
                .to_owned(),
        );
    }
    let other: Vec<&str> = dropped
        .iter()
        .map(String::as_str)
        .filter(|f| *f != TAINTS_FIELD && !CAPACITY_FIELDS.contains(f))
        .collect();
    if !other.is_empty() {
        meanings.push(format!("the API server does not know {}", other.join(", ")));
    }
    meanings.join("; ")
}

/// The time now, as the API server keeps times (whole seconds).
pub fn time_now() -> Time {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    Time(
        k8s_openapi::jiff::Timestamp::from_second(seconds)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    )
}

/// The spec with generation 0: what the slice says, whichever write it came from.
fn content(spec: &ResourceSliceSpec) -> ResourceSliceSpec {
    let mut spec = spec.clone();
    spec.pool.generation = 0;
    spec
}

/// The last slice written, and what the API server made of it.
struct Written {
    /// What was sent (generation 0).
    sent: ResourceSliceSpec,
    /// What was stored (generation 0).
    stored: ResourceSliceSpec,
    /// The stored slice's version.
    resource_version: Option<String>,
}

/// Keeps the node's slice what the plugin wants through the API server, and says when the
/// API server drops fields of it.
pub struct Publisher {
    api: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    owner: Option<OwnerReference>,
    sharing: Sharing,
    generation: i64,
    last: Option<Written>,
    /// Fields the last write's answer lacked, `taints` aside.
    dropped: BTreeSet<String>,
    /// Whether the API server ever dropped taints (then unhealthy GPUs are removed).
    taints_dropped: bool,
    /// What the log and the Node condition last said (the dropped fields).
    reported: Option<BTreeSet<String>>,
}

impl Publisher {
    /// A publisher for the node `node`. The slice is owned by the Node object when it can
    /// be read, so that deleting the node deletes its slice.
    pub async fn new(client: kube::Client, node: &str, sharing: Sharing) -> Publisher {
        let nodes = Api::<Node>::all(client.clone());
        let owner = match nodes.get(node).await {
            Ok(found) => found.metadata.uid.map(|uid| OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_owned(),
                uid,
                controller: Some(true),
                block_owner_deletion: None,
            }),
            Err(e) => {
                tracing::warn!(%node, "reading the Node (the slice will have no owner): {e}");
                None
            }
        };
        Publisher {
            api: Api::all(client),
            nodes,
            node: node.to_owned(),
            owner,
            sharing,
            generation: 0,
            last: None,
            dropped: BTreeSet::new(),
            taints_dropped: false,
            reported: None,
        }
    }

    /// The node whose slice this is.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The slice's name.
    pub fn name(&self) -> String {
        slice_name(&self.node)
    }

    /// How unhealthy GPUs are shown: tainted, unless the API server dropped taints.
    pub fn unhealthy_shown(&self) -> Unhealthy {
        if self.taints_dropped {
            Unhealthy::Removed
        } else {
            Unhealthy::Tainted
        }
    }

    /// Whether `slice` is the one this publisher last wrote (its own write, seen again).
    pub fn wrote(&self, slice: &ResourceSlice) -> bool {
        self.last.as_ref().is_some_and(|l| {
            l.resource_version.is_some() && l.resource_version == slice.metadata.resource_version
        })
    }

    /// Makes the stored slice the one wanted for `gpus` with `unhealthy` GPUs (UUID →
    /// since when): written when it is missing, differs from what the last write stored,
    /// or `force`. Returns whether it wrote.
    pub async fn sync(
        &mut self,
        gpus: &[GpuInfo],
        unhealthy: &BTreeMap<String, Time>,
        force: bool,
    ) -> Result<bool, kube::Error> {
        let name = self.name();
        let mut existing = self.api.get_opt(&name).await?;
        let wanted = |publisher: &Publisher| {
            let how = publisher.unhealthy_shown();
            slice_showing(
                &publisher.node,
                gpus,
                publisher.sharing,
                unhealthy,
                how,
                0,
                publisher.owner.clone(),
            )
        };
        if !force {
            if let (Some(existing), Some(last)) = (&existing, &self.last) {
                if last.sent == wanted(self).spec && content(&existing.spec) == last.stored {
                    return Ok(false);
                }
            }
        }
        loop {
            let sent = wanted(self);
            let stored = self.write(existing.take(), sent.clone()).await?;
            let dropped = dropped_fields(&sent.spec, &stored.spec);
            // Taints are only sent while a GPU is unhealthy: once dropped, they are known
            // to be dropped for good, and the GPU is shown by its removal.
            let taints_now_dropped = dropped.contains(TAINTS_FIELD) && !self.taints_dropped;
            self.taints_dropped |= dropped.contains(TAINTS_FIELD);
            self.dropped = dropped.into_iter().filter(|f| f != TAINTS_FIELD).collect();
            self.last = Some(Written {
                sent: content(&sent.spec),
                stored: content(&stored.spec),
                resource_version: stored.metadata.resource_version.clone(),
            });
            existing = Some(stored);
            if !taints_now_dropped {
                break;
            }
        }
        self.report().await;
        Ok(true)
    }

    /// Creates or replaces the slice with `next` under a new generation; returns what the
    /// API server stored.
    async fn write(
        &mut self,
        existing: Option<ResourceSlice>,
        mut next: ResourceSlice,
    ) -> Result<ResourceSlice, kube::Error> {
        let name = self.name();
        let before = existing.as_ref().map_or(0, |s| s.spec.pool.generation);
        self.generation = self.generation.max(before) + 1;
        next.spec.pool.generation = self.generation;
        let devices = next.spec.devices.as_ref().map_or(0, Vec::len);
        let tainted = next
            .spec
            .devices
            .iter()
            .flatten()
            .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
            .count();
        let stored = match existing {
            Some(existing) => {
                next.metadata.resource_version = existing.metadata.resource_version;
                self.api.replace(&name, &PostParams::default(), &next).await?
            }
            None => self.api.create(&PostParams::default(), &next).await?,
        };
        tracing::info!(slice = %name, devices, tainted, generation = self.generation, "ResourceSlice published");
        Ok(stored)
    }

    /// Every field the API server is known to drop.
    fn all_dropped(&self) -> BTreeSet<String> {
        let mut all = self.dropped.clone();
        if self.taints_dropped {
            all.insert(TAINTS_FIELD.to_owned());
        }
        all
    }

    /// Says, once per change, which fields the API server drops: in the log and in the
    /// Node condition [`CONDITION`].
    async fn report(&mut self) {
        let dropped = self.all_dropped();
        if self.reported.as_ref() == Some(&dropped) {
            return;
        }
        let name = self.name();
        let (status, reason, message) = if dropped.is_empty() {
            if self.reported.is_some() {
                tracing::info!(slice = %name, "the API server stores every field of the ResourceSlice again");
            }
            (
                "True",
                "AllFieldsStored",
                format!("the API server stored ResourceSlice {name} as the plugin sent it"),
            )
        } else {
            let fields = dropped.iter().map(String::as_str).collect::<Vec<_>>().join(", ");
            let message = format!(
                "the API server dropped {fields} from ResourceSlice {name}: {}",
                dropped_meaning(&dropped)
            );
            tracing::warn!(slice = %name, fields = %fields, "{message}");
            ("False", "FieldsDropped", message)
        };
        let at = time_now();
        let patch = serde_json::json!({"status": {"conditions": [{
            "type": CONDITION, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": at, "lastHeartbeatTime": at,
        }]}});
        // Strategic merge: the conditions list merges by type, the kubelet's stay.
        match self.nodes.patch_status(&self.node, &PatchParams::default(), &Patch::Strategic(patch)).await {
            Ok(_) => {}
            Err(e) => tracing::warn!(node = %self.node, "setting the Node condition {CONDITION}: {e}"),
        }
        // Said in the log even when the condition could not be set: not said again.
        self.reported = Some(dropped);
    }

    /// Deletes a slice of this driver and node that is not the one published (left by an
    /// older plugin): the scheduler would count its devices too.
    pub async fn delete_stray(&self, name: &str) {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(slice = %name, "a stray ResourceSlice of this node was deleted"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => tracing::warn!(slice = %name, "deleting a stray ResourceSlice of this node: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gpus::Topology;
    use super::*;

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            product_name: "Sim".into(),
            memory: 16 << 30,
            compute_capability: (9, 0),
            driver_version: "580.0".into(),
            cuda_version: (13, 0),
            pci_bus_id: "0000:01:00.0".into(),
            topology: Default::default(),
        }
    }

    #[test]
    fn a_gpus_place_is_in_its_attributes_when_known() {
        let mut placed = gpu(1, "GPU-b");
        placed.topology = Topology {
            pcie_root: Some("pci0000:64".into()),
            numa_node: Some(1),
            nvlink_peers: Some(vec![0, 2]),
            nvlink_domain: Some(0),
        };
        let known = attributes(&placed);
        assert_eq!(known[PCIE_ROOT].string.as_deref(), Some("pci0000:64"));
        assert_eq!(known[NUMA_NODE].int, Some(1));
        assert_eq!(known[NVLINK_PEERS].string.as_deref(), Some("0,2"));
        assert_eq!(known[NVLINK_DOMAIN].int, Some(0));
        // Shares carry them too, so that a claim of shares can be constrained the same way.
        let shares = share_devices(&placed, 2);
        assert!(shares.iter().all(|d| d.attributes.as_ref().unwrap()[NVLINK_DOMAIN].int == Some(0)));
        // Unknown, or no NVLink: left out, never an empty or made-up value.
        let mut bare = gpu(0, "GPU-a");
        bare.topology.nvlink_peers = Some(vec![]);
        let unknown = attributes(&bare);
        for name in [PCIE_ROOT, NUMA_NODE, NVLINK_PEERS, NVLINK_DOMAIN] {
            assert!(!unknown.contains_key(name), "{name}");
        }
    }

    #[test]
    fn an_unhealthy_gpu_is_tainted_or_removed() {
        let gpus = [gpu(0, "GPU-a"), gpu(1, "GPU-b")];
        let since = time_now();
        let unhealthy = BTreeMap::from([("GPU-b".to_owned(), since.clone())]);
        let tainted = slice_showing("n", &gpus, Sharing::Shares(2), &unhealthy, Unhealthy::Tainted, 1, None);
        let devices = tainted.spec.devices.unwrap();
        assert_eq!(devices.len(), 4);
        assert!(devices[..2].iter().all(|d| d.taints.is_none()));
        assert!(devices[2..].iter().all(|d| d.taints == Some(vec![unhealthy_taint(&since)])));
        let removed = slice_showing("n", &gpus, Sharing::Capacity, &unhealthy, Unhealthy::Removed, 1, None);
        let names: Vec<String> = removed.spec.devices.unwrap().into_iter().map(|d| d.name).collect();
        assert_eq!(names, ["gpu-0"]);
    }

    #[test]
    fn dropped_fields_are_named_and_rewritten_values_are_not() {
        let gpus = [gpu(0, "GPU-a")];
        let unhealthy = BTreeMap::from([("GPU-a".to_owned(), time_now())]);
        let sent = slice_showing("n", &gpus, Sharing::Capacity, &unhealthy, Unhealthy::Tainted, 1, None).spec;
        assert!(dropped_fields(&sent, &sent).is_empty());
        let mut stored = sent.clone();
        for device in stored.devices.iter_mut().flatten() {
            device.allow_multiple_allocations = None;
            device.taints = None;
            for capacity in device.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                capacity.request_policy = None;
                // The API server writes quantities its own way: not a dropped field.
                capacity.value = Quantity("16Gi".into());
            }
        }
        let dropped = dropped_fields(&sent, &stored);
        assert_eq!(
            dropped.iter().map(String::as_str).collect::<Vec<_>>(),
            ["allowMultipleAllocations", "requestPolicy", "taints"]
        );
        let meaning = dropped_meaning(&dropped);
        assert!(meaning.contains("DRAConsumableCapacity") && meaning.contains("--shares N"), "{meaning}");
        assert!(meaning.contains("DRADeviceTaints"), "{meaning}");
    }
}
