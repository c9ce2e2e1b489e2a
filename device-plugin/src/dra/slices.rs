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
//! A GPU that turns unhealthy leaves the slice (claims prepared on it stay prepared) and
//! comes back with it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, PostParams};
use kube::Api;

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

/// The GPU's attributes, which every one of its devices carries.
fn attributes(gpu: &GpuInfo) -> BTreeMap<String, DeviceAttribute> {
    BTreeMap::from([
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("productName".to_owned(), string(&gpu.product_name)),
        ("index".to_owned(), DeviceAttribute { int: Some(gpu.index.into()), ..Default::default() }),
        ("computeCapability".to_owned(), version(gpu.compute_capability.0, gpu.compute_capability.1)),
        ("driverVersion".to_owned(), string(&gpu.driver_version)),
        ("cudaVersion".to_owned(), version(gpu.cuda_version.0, gpu.cuda_version.1)),
        ("pciBusID".to_owned(), string(&gpu.pci_bus_id)),
    ])
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
            attributes.insert(
                "share".to_owned(),
                DeviceAttribute { int: Some(share.into()), ..Default::default() },
            );
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

/// The node's slice: its healthy GPUs (`healthy(uuid)`), pool `node`, generation `generation`.
pub fn slice(
    node: &str,
    gpus: &[GpuInfo],
    sharing: Sharing,
    healthy: impl Fn(&str) -> bool,
    generation: i64,
    owner: Option<OwnerReference>,
) -> ResourceSlice {
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
            devices: Some(
                gpus.iter()
                    .filter(|g| healthy(&g.uuid))
                    .flat_map(|g| match sharing {
                        Sharing::Capacity => vec![device(g)],
                        Sharing::Shares(n) => share_devices(g, n),
                    })
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

/// Publishes the node's slice through the API server, and removes it at a clean stop.
pub struct Publisher {
    api: Api<ResourceSlice>,
    node: String,
    owner: Option<OwnerReference>,
    sharing: Sharing,
    generation: i64,
}

impl Publisher {
    /// A publisher for the node `node`. The slice is owned by the Node object when it can
    /// be read, so that deleting the node deletes its slice.
    pub async fn new(client: kube::Client, node: &str, sharing: Sharing) -> Publisher {
        let owner = match Api::<Node>::all(client.clone()).get(node).await {
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
        Publisher { api: Api::all(client), node: node.to_owned(), owner, sharing, generation: 0 }
    }

    /// Creates or replaces the slice with the GPUs `healthy` accepts, under a new generation.
    pub async fn publish(
        &mut self,
        gpus: &[GpuInfo],
        healthy: impl Fn(&str) -> bool,
    ) -> Result<(), kube::Error> {
        let name = slice_name(&self.node);
        let existing = self.api.get_opt(&name).await?;
        let before = existing.as_ref().map_or(0, |s| s.spec.pool.generation);
        self.generation = self.generation.max(before) + 1;
        let mut next = slice(&self.node, gpus, self.sharing, healthy, self.generation, self.owner.clone());
        let devices = next.spec.devices.as_ref().map_or(0, Vec::len);
        match existing {
            Some(existing) => {
                next.metadata.resource_version = existing.metadata.resource_version;
                self.api.replace(&name, &PostParams::default(), &next).await?;
            }
            None => {
                self.api.create(&PostParams::default(), &next).await?;
            }
        }
        tracing::info!(slice = %name, devices, generation = self.generation, "ResourceSlice published");
        Ok(())
    }

    /// Deletes the slice (a plugin that stops advertises nothing).
    pub async fn remove(&self) -> Result<(), kube::Error> {
        let name = slice_name(&self.node);
        match self.api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                tracing::info!(slice = %name, "ResourceSlice removed");
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}
