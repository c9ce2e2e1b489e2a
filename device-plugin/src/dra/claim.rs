//! An allocated ResourceClaim (`resource.k8s.io/v1`) → the fraction it holds of each of
//! this node's GPUs: the request is the `memory` capacity the scheduler let it consume on
//! the device; limit, resolver, priority and `parkAfter` come from its opaque
//! configuration. Its compute share: the request is the `compute` capacity it consumed (per
//! mille of the GPU's time, placed by the scheduler), else the configuration's
//! `computeRequest` (which the scheduler does not see); the limit is `computeLimit`. A claim
//! of several GPUs (`count: N`, or N requests: a tensor-parallel server) holds a fraction
//! of each, with one resolver, priority, `parkAfter` and compute share for all. Pure logic
//! over the API's own types, tested from real claims' JSON.

use gpufrac_common::compute::{ComputeShare, ComputeSpec};
use gpufrac_common::dra::PreparedDevice;
use gpufrac_common::size::format_size;
use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};

use super::config::{self, ConfigError, FractionConfig};
use super::gpus::{parse_device_name, GpuInfo};
use super::slices::Sharing;
use super::{cdi, quantity, DRIVER};

/// The device capacity that holds a claim's guarantee.
pub const MEMORY: &str = "memory";

/// The device capacity that holds a claim's compute request, in per mille of the GPU's
/// time (each GPU has 1000).
pub const COMPUTE: &str = "compute";

/// Why a claim cannot be prepared on this node; each names the claim's field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The claim has not been allocated (the kubelet prepares allocated claims only).
    #[error("claim {0} has no status.allocation (it is not allocated yet)")]
    NotAllocated(String),
    /// The claim holds no device of this driver.
    #[error("claim {0} holds no device of driver {DRIVER}")]
    NoDevice(String),
    /// A device of this driver in the allocation is not one of this node's.
    #[error("claim {claim}: status.allocation.devices.results[{index}]: {reason}")]
    Result {
        /// The claim (`namespace/name`).
        claim: String,
        /// The result's index.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The claim's opaque configuration is invalid.
    #[error(
        "claim {claim}: status.allocation.devices.config[{index}].opaque.{}: {} (driver {DRIVER})",
        source.field,
        source.reason
    )]
    Config {
        /// The claim (`namespace/name`).
        claim: String,
        /// The configuration's index.
        index: usize,
        /// What is wrong, naming the field.
        source: ConfigError,
    },
    /// The configured limit does not fit the request or the GPU.
    #[error("claim {claim}: parameters.limit: {reason}")]
    Limit {
        /// The claim (`namespace/name`).
        claim: String,
        /// What is wrong.
        reason: String,
    },
    /// The claim's GPUs would need different settings: a process holds one resolver, one
    /// priority, one `parkAfter` and one compute share on all its GPUs.
    #[error(
        "claim {claim}: {first} and {other} differ in {field}: a process holds one {field} on every GPU \
         of its claim; configure the claim's requests alike"
    )]
    Differs {
        /// The claim (`namespace/name`).
        claim: String,
        /// The field (`resolver`, `priority`, `parkAfter`, `compute share`).
        field: &'static str,
        /// The first device.
        first: String,
        /// The device that differs from it.
        other: String,
    },
    /// A GPU of the claim is smaller than the request the claim holds on another: the
    /// shim declares the largest request on every GPU of the claim.
    #[error(
        "claim {claim}: the request on {largest} ({request}) is more than {smallest} has ({memory}): \
         a claim of several GPUs needs each GPU to hold its largest request"
    )]
    SmallGpu {
        /// The claim (`namespace/name`).
        claim: String,
        /// The device with the largest request.
        largest: String,
        /// That request.
        request: String,
        /// The smallest GPU of the claim.
        smallest: String,
        /// Its memory.
        memory: String,
    },
    /// The merged compute configuration is not a share (`computeLimit` below
    /// `computeRequest` or 0), or `computeRequest` disagrees with the `compute` capacity
    /// the claim consumed.
    #[error("claim {claim}: parameters.{field}: {reason}")]
    Compute {
        /// The claim (`namespace/name`).
        claim: String,
        /// `computeRequest` or `computeLimit`.
        field: &'static str,
        /// What is wrong, with the value.
        reason: String,
    },
}

/// What preparing a claim needs from it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimFraction {
    /// The pods it is reserved for (`status.reservedFor`), by UID and name.
    pub pods: Vec<(String, String)>,
    /// Its devices of this driver on this node, one per GPU.
    pub devices: Vec<PreparedDevice>,
}

/// Reads the bytes of a Kubernetes quantity (`20Gi`, `21474836480`, `20G`, `2e9`,
/// `1.5Gi`), rounded up to a whole byte.
pub fn quantity_bytes(quantity: &str) -> Option<u64> {
    quantity::ceil_u64(quantity.trim()).ok()
}

/// Reads a count written as a Kubernetes quantity (`0`, `250`, `1k`, `1e3`; `300m` is
/// 0.3, rounded up to 1).
pub fn quantity_count(quantity: &str) -> Option<u64> {
    quantity::ceil_u64(quantity.trim()).ok()
}

/// The fraction of this node's GPUs that `claim` holds. `pool` is this node's pool name;
/// `gpus` its GPUs. Devices of other drivers are left alone; a device of this driver that
/// is not this node's is an error.
pub fn fraction(
    claim: &ResourceClaim,
    pool: &str,
    gpus: &[GpuInfo],
    sharing: Sharing,
) -> Result<ClaimFraction, ClaimError> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = format!("{namespace}/{}", claim.metadata.name.clone().unwrap_or_default());
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let status = claim.status.as_ref();
    let Some(allocation) = status.and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref()) else {
        return Err(ClaimError::NotAllocated(name));
    };
    let configs = allocation.config.as_deref().unwrap_or_default();
    let mut devices: Vec<PreparedDevice> = Vec::new();
    // Per device: the limit its configuration names, and its GPU's memory.
    let mut limits: Vec<(Option<u64>, u64)> = Vec::new();
    for (index, result) in allocation.results.iter().flatten().enumerate() {
        if result.driver != DRIVER {
            continue;
        }
        let bad = |reason: String| ClaimError::Result { claim: name.clone(), index, reason };
        if result.pool != pool {
            return Err(bad(format!("pool {:?} is not this node's ({pool:?})", result.pool)));
        }
        let (gpu, share) = match (parse_device_name(&result.device), sharing) {
            (Some((index, None)), Sharing::Capacity) => (gpus.iter().find(|g| g.index == index), None),
            (Some((index, Some(share))), Sharing::Shares(n)) if share < n => {
                (gpus.iter().find(|g| g.index == index), Some(share))
            }
            _ => (None, None),
        };
        let Some(gpu) = gpu else {
            return Err(bad(format!("device {:?} is not a device this node publishes", result.device)));
        };
        // A share is its part of the GPU. Without consumable capacity (a cluster without
        // DRAConsumableCapacity) a whole-GPU device is allocated whole: the claim is
        // guaranteed the whole GPU.
        let request = match result.consumed_capacity.as_ref().and_then(|c| c.get(MEMORY)) {
            Some(quantity) => quantity::ceil_u64(quantity.0.trim())
                .map_err(|e| bad(format!("consumedCapacity.memory: {e}")))?,
            None => sharing.device_memory(gpu.memory),
        };
        if request > gpu.memory {
            return Err(bad(format!(
                "consumedCapacity.memory {} is more than the GPU's {}",
                format_size(request),
                format_size(gpu.memory)
            )));
        }
        let settings = settings_for(&result.request, configs)
            .map_err(|(index, source)| ClaimError::Config { claim: name.clone(), index, source })?;
        let consumed_compute = match result.consumed_capacity.as_ref().and_then(|c| c.get(COMPUTE)) {
            None => None,
            Some(quantity) => match quantity_count(&quantity.0).and_then(|n| u16::try_from(n).ok()) {
                Some(n) if n <= 1000 => Some(n),
                _ => {
                    return Err(bad(format!(
                    "consumedCapacity.compute {:?} is not a share of the GPU's time (0 to 1000 per mille)",
                    quantity.0
                )))
                }
            },
        };
        let compute = compute(&name, consumed_compute, &settings)?;
        let configured = settings.limit.map(|spec| spec.resolve(gpu.memory));
        // Shares of one request on one GPU make one fraction: their memory adds up.
        if let Some(same) = devices.iter_mut().find(|d| d.gpu_uuid == gpu.uuid) {
            if !same.request_names.contains(&result.request) {
                return Err(bad(format!(
                    "requests {:?} and {:?} were both allocated on {}: ask for one request per GPU \
                     (a process holds one fraction of a GPU)",
                    same.request_names[0], result.request, same.device
                )));
            }
            same.shares.push(result.device.clone());
            same.request_bytes = (same.request_bytes + request).min(gpu.memory);
            if compute != same.compute().ok().flatten() {
                return Err(bad(format!(
                    "its compute share differs from that of {} on the same GPU",
                    same.shares.first().unwrap_or(&same.device)
                )));
            }
            continue;
        }
        limits.push((configured, gpu.memory));
        let mut prepared = PreparedDevice {
            request_names: vec![result.request.clone()],
            pool: result.pool.clone(),
            device: gpu.device_name(),
            shares: share.map(|_| vec![result.device.clone()]).unwrap_or_default(),
            gpu_uuid: gpu.uuid.clone(),
            share_id: result.share_id.clone(),
            request_bytes: request,
            limit_bytes: request,
            resolver: settings.resolver,
            priority: settings.priority,
            park_after: settings.park_after,
            compute_request_per_mille: None,
            compute_limit_per_mille: None,
            cdi_device_id: cdi::device_id(&uid, &gpu.device_name()),
        };
        prepared.set_compute(compute);
        devices.push(prepared);
    }
    // The limit: as configured (at least the request, at most the GPU), else the request.
    for (device, (configured, memory)) in devices.iter_mut().zip(limits) {
        let Some(limit) = configured else {
            device.limit_bytes = device.request_bytes;
            continue;
        };
        let refuse = |reason: String| ClaimError::Limit { claim: name.clone(), reason };
        if limit < device.request_bytes {
            return Err(refuse(format!(
                "{} is below the memory the claim requests on {} ({})",
                format_size(limit),
                device.device,
                format_size(device.request_bytes)
            )));
        }
        if limit > memory {
            return Err(refuse(format!(
                "{} is more than the GPU's {}",
                format_size(limit),
                format_size(memory)
            )));
        }
        device.limit_bytes = limit;
    }
    if devices.is_empty() {
        return Err(ClaimError::NoDevice(name));
    }
    several_gpus(&name, &devices, gpus)?;
    Ok(ClaimFraction { pods: reserved_pods(claim), devices })
}

/// Checks a claim of several GPUs can be one process's: its processes declare one
/// resolver, priority, `parkAfter` and compute share, and the largest request and limit,
/// on every GPU (the arbiter cuts each GPU to what the claim holds of it), so the settings
/// must agree and every GPU must hold the largest request.
fn several_gpus(claim: &str, devices: &[PreparedDevice], gpus: &[GpuInfo]) -> Result<(), ClaimError> {
    let [first, rest @ ..] = devices else { return Ok(()) };
    for device in rest {
        let differs = [
            ("resolver", device.resolver != first.resolver),
            ("priority", device.priority != first.priority),
            ("parkAfter", device.park_after != first.park_after),
            ("compute share", device.compute() != first.compute()),
        ];
        if let Some((field, _)) = differs.into_iter().find(|(_, differs)| *differs) {
            return Err(ClaimError::Differs {
                claim: claim.to_owned(),
                field,
                first: first.device.clone(),
                other: device.device.clone(),
            });
        }
    }
    let memory_of =
        |device: &PreparedDevice| gpus.iter().find(|g| g.uuid == device.gpu_uuid).map_or(0, |g| g.memory);
    let largest = devices.iter().max_by_key(|d| d.request_bytes).unwrap_or(first);
    let smallest = devices.iter().min_by_key(|d| memory_of(d)).unwrap_or(first);
    if largest.request_bytes > memory_of(smallest) {
        return Err(ClaimError::SmallGpu {
            claim: claim.to_owned(),
            largest: largest.device.clone(),
            request: format_size(largest.request_bytes),
            smallest: smallest.device.clone(),
            memory: format_size(memory_of(smallest)),
        });
    }
    Ok(())
}

/// The pods `claim` is reserved for (`status.reservedFor`), by UID and name.
pub fn reserved_pods(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| (r.uid.clone(), r.name.clone()))
        .collect()
}

/// Whether `claim` is allocated a device of this driver in `pool` (this node's).
pub fn allocated_in(claim: &ResourceClaim, pool: &str) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .any(|r| r.driver == DRIVER && r.pool == pool)
}

/// The claim's compute share on one device: the request is the `compute` capacity it
/// consumed when more than 0 (a `computeRequest` that says otherwise is refused: the
/// scheduler placed the capacity), else `computeRequest`; the limit `computeLimit`, else
/// the whole GPU. `None` when the claim asks for no share at all.
fn compute(
    claim: &str,
    consumed: Option<u16>,
    settings: &FractionConfig,
) -> Result<Option<ComputeSpec>, ClaimError> {
    let refuse =
        |field: &'static str, reason: String| ClaimError::Compute { claim: claim.to_owned(), field, reason };
    let consumed = consumed.filter(|&n| n > 0).and_then(ComputeShare::from_per_mille);
    let request = match (consumed, settings.compute_request) {
        (Some(capacity), Some(configured)) if capacity != configured => {
            return Err(refuse(
                "computeRequest",
                format!(
                    "\"{configured}\" differs from the compute capacity the claim consumed ({} per mille, \
                     {capacity}): ask for the share once, in capacity.requests.compute (placed by the \
                     scheduler) or in computeRequest",
                    capacity.per_mille()
                ),
            ))
        }
        (capacity, configured) => capacity.or(configured),
    };
    let request_text = request.map(|s| s.to_string());
    let limit_text = settings.compute_limit.map(|s| s.to_string());
    ComputeSpec::from_texts(
        ("computeRequest", request_text.as_deref()),
        ("computeLimit", limit_text.as_deref()),
    )
    .map_err(|e| {
        refuse(
            if e.input == "computeLimit" { "computeLimit" } else { "computeRequest" },
            format!("{:?}: {}", e.value, e.reason),
        )
    })
}

/// The settings of the request `request` (`name` or `name/subrequest`): every opaque
/// configuration of this driver that applies to it, in order (the class's first, then
/// the claim's), each overriding the ones before. An invalid configuration that applies
/// is an error with its index.
fn settings_for(
    request: &str,
    configs: &[DeviceAllocationConfiguration],
) -> Result<FractionConfig, (usize, ConfigError)> {
    let parent = request.split('/').next().unwrap_or(request);
    let mut settings = FractionConfig::default();
    for (index, entry) in configs.iter().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == DRIVER) else { continue };
        let applies = match entry.requests.as_deref() {
            None | Some([]) => true,
            Some(names) => names.iter().any(|n| n == request || n == parent),
        };
        if applies {
            let parsed = config::parse(&opaque.parameters.0).map_err(|e| (index, e))?;
            settings = settings.overridden_by(parsed);
        }
    }
    Ok(settings)
}
