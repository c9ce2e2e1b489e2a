//! Process-wide driver state: initialisation, the simulated machine, and devices.

use std::ffi::{c_char, c_int, c_uint};
use std::sync::OnceLock;

use cudarc::driver::sys::{CUdevice, CUdevice_attribute as A, CUuuid};
use gpufrac_common::parse_bytes;
use simgpu_state::sched::Scheduler;
use simgpu_state::{device_uuid_bytes, pci_bus_id, Machine, ProcessSlot, DEVICE_NAME};

use crate::ffi::{write_c_string, write_out, CUresult, CuResult};

/// The CUDA version simgpu reports and implements the ABI of.
pub(crate) const DRIVER_VERSION: c_int = 12080;
/// Device memory each context takes when `SIMGPU_CONTEXT_OVERHEAD` is unset.
const DEFAULT_CONTEXT_OVERHEAD: &str = "256MiB";
/// Device memory each loaded module takes when `SIMGPU_MODULE_BYTES` is unset: the code
/// and globals of a small module (a real framework's modules range from kilobytes to
/// hundreds of megabytes).
const DEFAULT_MODULE_BYTES: &str = "2MiB";

/// Everything `cuInit` sets up, shared by the whole process.
pub(crate) struct Driver {
    pub machine: &'static Machine,
    pub slot: ProcessSlot<'static>,
    pub context_overhead: u64,
    /// Device memory each loaded module or library takes (`SIMGPU_MODULE_BYTES`).
    pub module_bytes: u64,
    /// How long creating a context takes (`SIMGPU_CONTEXT_CREATE_TIME`, default 0): a real
    /// driver takes 100-500 ms, during which other processes go on allocating.
    pub context_create_time: std::time::Duration,
    /// Time-slicing of the devices with the other processes (`SIMGPU_TIMESLICE`).
    pub sched: Scheduler<'static>,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

fn start() -> Result<Driver, String> {
    let machine = Machine::open_from_env().map_err(|e| e.to_string())?;
    let context_overhead = size_from_env("SIMGPU_CONTEXT_OVERHEAD", DEFAULT_CONTEXT_OVERHEAD)?;
    let module_bytes = size_from_env("SIMGPU_MODULE_BYTES", DEFAULT_MODULE_BYTES)?;
    let context_create_time = match std::env::var("SIMGPU_CONTEXT_CREATE_TIME") {
        Ok(text) => gpufrac_common::parse_duration("SIMGPU_CONTEXT_CREATE_TIME", &text)
            .map_err(|e| format!("simgpu: {e}"))?,
        Err(_) => std::time::Duration::ZERO,
    };
    let timeslice = simgpu_state::sched::timeslice_from_env().map_err(|e| e.to_string())?;
    // The machine lives for the rest of the process: leak it so slots can borrow it.
    let machine: &'static Machine = Box::leak(Box::new(machine));
    let slot = machine.attach().map_err(|e| e.to_string())?;
    let sched = slot.scheduler(timeslice);
    Ok(Driver { machine, slot, context_overhead, module_bytes, context_create_time, sched })
}

/// A size from the environment variable `name` (`default` when unset); `0` is allowed.
fn size_from_env(name: &str, default: &str) -> Result<u64, String> {
    let text = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    match text.trim() {
        "0" => Ok(0),
        text => parse_bytes(name, text).map_err(|e| format!("simgpu: {e}")),
    }
}

/// `cuInit`: opens the simulated machine once; a bad setting is reported on stderr once.
pub(crate) fn init(flags: c_uint) -> CuResult {
    if flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut first = false;
    let state = DRIVER.get_or_init(|| {
        first = true;
        start()
    });
    if first {
        if let Ok(d) = state {
            // The agent that other processes' checkpoint calls talk to.
            crate::checkpoint::start_agent(d.machine.path());
        }
    }
    match state {
        Ok(_) => Ok(()),
        Err(message) => {
            if first {
                eprintln!("{message}");
            }
            Err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
        }
    }
}

/// The initialised driver, or `CUDA_ERROR_NOT_INITIALIZED` before a successful `cuInit`.
pub(crate) fn driver() -> CuResult<&'static Driver> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        _ => Err(CUresult::CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// Checks a device ordinal and returns it as an index.
pub(crate) fn device_index(device: CUdevice) -> CuResult<usize> {
    let d = driver()?;
    if device < 0 || device as usize >= d.machine.device_count() {
        return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(device as usize)
}

pub(crate) fn driver_get_version(version: *mut c_int) -> CuResult {
    write_out(version, DRIVER_VERSION)
}

pub(crate) fn device_get(out: *mut CUdevice, ordinal: c_int) -> CuResult {
    let index = device_index(ordinal)?;
    write_out(out, index as CUdevice)
}

pub(crate) fn device_get_count(count: *mut c_int) -> CuResult {
    write_out(count, driver()?.machine.device_count() as c_int)
}

pub(crate) fn device_get_name(name: *mut c_char, len: c_int, device: CUdevice) -> CuResult {
    device_index(device)?;
    write_c_string(name, len, DEVICE_NAME)
}

pub(crate) fn device_get_uuid(uuid: *mut CUuuid, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let bytes = device_uuid_bytes(index).map(|b| b as c_char);
    write_out(uuid, CUuuid { bytes })
}

pub(crate) fn device_total_mem(bytes: *mut usize, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    write_out(bytes, driver()?.machine.total(index) as usize)
}

/// `cuDeviceTotalMem` of the pre-3.2 API: the total clamped to 32 bits.
pub(crate) fn device_total_mem_v1(bytes: *mut c_uint, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    write_out(bytes, crate::memory::clamp32(driver()?.machine.total(index)))
}

fn pci_bus(index: usize) -> c_int {
    simgpu_state::pci_bus(index) as c_int
}

pub(crate) fn device_get_pci_bus_id(id: *mut c_char, len: c_int, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    write_c_string(id, len, &pci_bus_id(index))
}

pub(crate) fn device_get_by_pci_bus_id(device: *mut CUdevice, id: &str) -> CuResult {
    let d = driver()?;
    let wanted = id.trim().to_ascii_uppercase();
    (0..d.machine.device_count())
        .find(|&i| {
            let full = pci_bus_id(i);
            wanted == full || wanted == full[4..]
        })
        .map_or(Err(CUresult::CUDA_ERROR_INVALID_VALUE), |i| write_out(device, i as CUdevice))
}

pub(crate) fn device_compute_capability(major: *mut c_int, minor: *mut c_int, device: CUdevice) -> CuResult {
    device_index(device)?;
    write_out(major, 9)?;
    write_out(minor, 0)
}

/// `cuDeviceGetAttribute`: the attributes of an H100-like device with every memory
/// feature simgpu implements (pools, VMM, managed memory, unified addressing).
pub(crate) fn device_get_attribute(value: *mut c_int, attrib: c_int, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    if attrib <= 0 || attrib >= A::CU_DEVICE_ATTRIBUTE_MAX as c_int {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    write_out(value, attribute(index, attrib))
}

/// The threads `device` can hold resident at once (multiprocessors times threads per
/// multiprocessor): what a per-thread stack size is multiplied by.
pub(crate) fn resident_threads(device: usize) -> u64 {
    let sms = attribute(device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as c_int);
    let threads = attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR as c_int);
    sms.max(0) as u64 * threads.max(0) as u64
}

/// The multiprocessors (SMs) of `device`: its whole SM resource for green contexts.
pub(crate) fn multiprocessors(device: usize) -> u32 {
    attribute(device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as c_int).max(0) as u32
}

/// The value of attribute `attrib` of device `index` (0 for those simgpu lacks).
fn attribute(index: usize, attrib: c_int) -> c_int {
    let table: &[(A, c_int)] = &[
        (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2_147_483_647),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535),
        (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535),
        (A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, 49152),
        (A::CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 65536),
        (A::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32),
        (A::CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2_147_483_647),
        (A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536),
        (A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1_980_000),
        (A::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 512),
        (A::CU_DEVICE_ATTRIBUTE_GPU_OVERLAP, 1),
        (A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132),
        (A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1),
        (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1),
        (A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED, 1),
        (A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, pci_bus(index)),
        (A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, 2_619_000),
        (A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 5120),
        (A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 52_428_800),
        (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048),
        (A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 2),
        (A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
        (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9),
        (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
        (A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, 233_472),
        (A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, 65536),
        (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1),
        (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 1),
        (A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 232_448),
        (A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, 1),
        (A::CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, 1),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 1),
        (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, 1),
        (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, 32),
        (A::CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO, 2),
    ];
    table.iter().find(|(a, _)| *a as c_int == attrib).map_or(0, |&(_, v)| v)
}
