//! `libsimgpu_nvml.so`: the NVIDIA Management Library (NVML) for the simulated devices of
//! simgpu, with the real NVML ABI (names, structures and return codes of `nvml.h`).
//!
//! It reports what the shared simulated machine (`simgpu-state`) holds: devices and their
//! memory, the processes using them, utilization from the kernel time the simulated CUDA
//! driver records (per device: the time some process ran kernels; per process: the time
//! it had kernels pending, running or sliced out, as a real driver reports it under
//! time-slicing, `simgpu_state::sched`), and injected XID errors as events. The getters
//! monitoring tools call on every refresh (temperature, power, clocks, graphics processes, ...) are in
//! `monitor`: plausible values of an H100, or `NVML_ERROR_NOT_SUPPORTED` for what a real
//! H100 on Linux lacks or simgpu does not simulate. Peer-to-peer status reports NVLink
//! between the pairs of `SIMGPU_NVLINK`. Other functions are not exported.
//!
//! Device `i` looks the same here as through `libsimgpu_cuda.so`: the UUID of
//! `simgpu_state::device_uuid`, the name `simgpu_state::DEVICE_NAME`, PCI bus `0x10 + i`.
#![deny(missing_docs)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::mem::size_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeXidCriticalError, nvmlMemory_t,
    nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlProcessUtilizationInfo_v1_t,
    nvmlProcessUtilizationSample_t, nvmlProcessesUtilizationInfo_t, nvmlReturn_t, nvmlUtilization_t,
};
use nvml_wrapper_sys::bindings::{
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS as P2P_ATOMICS,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK as P2P_NVLINK,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PROP as P2P_PROP,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ as P2P_READ,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_WRITE as P2P_WRITE, nvmlGpuP2PCapsIndex_t,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED as P2P_NOT_SUPPORTED,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK as P2P_OK, nvmlGpuP2PStatus_t,
};
use nvml_wrapper_sys::bindings::{
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as ARGUMENT_VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED as DRIVER_NOT_LOADED,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE,
    nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT as INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND as NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED as NOT_SUPPORTED, nvmlReturn_enum_NVML_ERROR_TIMEOUT as TIMEOUT,
    nvmlReturn_enum_NVML_ERROR_UNINITIALIZED as UNINITIALIZED, nvmlReturn_enum_NVML_ERROR_UNKNOWN as UNKNOWN,
    nvmlReturn_enum_NVML_SUCCESS as SUCCESS,
};
use parking_lot::Mutex;
use simgpu_state::nvlink::{nvlink_from_env, NvLinks};
use simgpu_state::{
    device_uuid, pci_bus_id, Machine, ProcessSlot, ProcessUsage, StateError, DEVICE_NAME, MAX_DEVICES,
};

fn pci_bus(index: usize) -> c_uint {
    simgpu_state::pci_bus(index)
}

/// Driver version string: an R570 driver, the branch of CUDA 12.8.
pub const DRIVER_VERSION: &str = "570.124.06";
/// NVML version string: the CUDA major version, then the driver version.
pub const NVML_VERSION: &str = "12.570.124.06";
/// CUDA version of the driver (12.8), as `cuDriverGetVersion` also reports it.
pub const CUDA_DRIVER_VERSION: c_int = 12080;
/// PCI device and vendor ID of every device (an H100 SXM5 80GB), and its subsystem ID.
const PCI_DEVICE_ID: c_uint = 0x2330_10DE;
const PCI_SUBSYSTEM_ID: c_uint = 0x16C1_10DE;
/// The only event type simulated: XIDs injected with [`simgpu_inject_xid`].
const SUPPORTED_EVENTS: c_ulonglong = nvmlEventTypeXidCriticalError as c_ulonglong;
/// `gpuInstanceId` / `computeInstanceId` of a device without MIG.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;
/// How often `nvmlEventSetWait` looks for new XIDs.
const EVENT_POLL: Duration = Duration::from_millis(5);
/// Utilization windows shorter than this repeat the previous answer instead of measuring.
const MIN_UTIL_WINDOW: Duration = Duration::from_millis(1);

type NvmlResult<T = ()> = Result<T, nvmlReturn_t>;

// ---------------------------------------------------------------------------------------
// The boundary with C callers.

/// Runs an export's body; a panic becomes `on_panic`, since NVML must never unwind into C.
fn guard_with<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Runs an NVML export's body, turning its result or a panic into an NVML return code.
fn guard(body: impl FnOnce() -> NvmlResult) -> nvmlReturn_t {
    guard_with(UNKNOWN, || body().err().unwrap_or(SUCCESS))
}

/// Writes `value` through a caller's out-pointer.
fn write_out<T>(out: *mut T, value: T) -> NvmlResult {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and the NVML contract makes the caller pass writable storage for a
    // T; unaligned storage is tolerated.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Reads a `T` the caller passed by pointer.
fn read_in<T: Copy>(ptr: *const T) -> NvmlResult<T> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and by the NVML contract it points to a readable T; only used for
    // plain integers, for which every bit pattern is valid.
    Ok(unsafe { ptr.read_unaligned() })
}

/// Reads a NUL-terminated string the caller passed.
fn read_str<'a>(ptr: *const c_char) -> NvmlResult<&'a str> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and by the NVML contract a NUL-terminated string that outlives the
    // call.
    let text = unsafe { CStr::from_ptr(ptr) };
    text.to_str().map_err(|_| INVALID_ARGUMENT)
}

/// Copies `text` and its NUL into a caller's buffer of `len` bytes, as NVML does: a buffer
/// too small for all of it is `NVML_ERROR_INSUFFICIENT_SIZE` and is left untouched.
fn write_str(buf: *mut c_char, len: c_uint, text: &str) -> NvmlResult {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if (len as usize) <= text.len() {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller provides `len` writable bytes and we write text.len() + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}

/// Copies `text` into a fixed `char` array, NUL-terminated and truncated to fit.
fn fill_chars(dst: &mut [c_char], text: &str) {
    let n = text.len().min(dst.len().saturating_sub(1));
    for (d, s) in dst.iter_mut().zip(&text.as_bytes()[..n]) {
        *d = *s as c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}

// ---------------------------------------------------------------------------------------
// Initialisation.

/// The machine and this process's slot on it, opened by the first `nvmlInit` and kept for
/// the life of the process.
struct Sim {
    machine: &'static Machine,
    /// Keeps the machine alive (not reset by a process opening it later) while we use it.
    _slot: ProcessSlot<'static>,
}

static SIM: OnceLock<Sim> = OnceLock::new();
/// Serialises the first open of the machine.
static OPENING: Mutex<()> = Mutex::new(());
/// How many `nvmlInit` calls are not matched by an `nvmlShutdown` yet.
static INIT_REFS: Mutex<u32> = Mutex::new(0);
/// The NVLinked pairs of devices (`SIMGPU_NVLINK`), read by `nvmlInit`.
static NVLINK: Mutex<NvLinks> = Mutex::new(NvLinks::none());

/// Opens the machine of `SIMGPU_STATE` / `SIMGPU_DEVICES` once.
fn sim() -> Result<&'static Sim, StateError> {
    if let Some(sim) = SIM.get() {
        return Ok(sim);
    }
    let _opening = OPENING.lock();
    if let Some(sim) = SIM.get() {
        return Ok(sim);
    }
    // The machine lives for the rest of the process: leak it so the slot can borrow it.
    let machine: &'static Machine = Box::leak(Box::new(Machine::open_from_env()?));
    let slot = machine.attach()?;
    Ok(SIM.get_or_init(|| Sim { machine, _slot: slot }))
}

/// `nvmlInit`: opens the simulated machine. Where it cannot be opened (a bad
/// `SIMGPU_DEVICES`, an unusable `SIMGPU_STATE`) the reason goes to stderr as one line
/// and the answer is `NVML_ERROR_DRIVER_NOT_LOADED`, which is what real NVML answers
/// on a machine whose NVIDIA driver is not running.
fn init() -> NvmlResult {
    let mut refs = INIT_REFS.lock();
    let sim = sim().map_err(|e| {
        eprintln!("{e}");
        DRIVER_NOT_LOADED
    })?;
    // Checked against the machine's devices at each init, as a bad SIMGPU_DEVICES is.
    *NVLINK.lock() = nvlink_from_env(device_count(sim.machine)).map_err(|e| {
        eprintln!("{e}");
        DRIVER_NOT_LOADED
    })?;
    if *refs == 0 {
        let now = Instant::now();
        for (i, dev) in DEVICES.iter().enumerate() {
            *dev.util.lock() = Some(UtilWindow { start: now, busy_ns: sim.machine.busy_ns(i), gpu: 0 });
        }
    }
    *refs = refs.saturating_add(1);
    Ok(())
}

fn shutdown() -> NvmlResult {
    let mut refs = INIT_REFS.lock();
    if *refs == 0 {
        return Err(UNINITIALIZED);
    }
    *refs -= 1;
    Ok(())
}

/// The machine, or `NVML_ERROR_UNINITIALIZED` outside `nvmlInit` ... `nvmlShutdown`.
fn machine() -> NvmlResult<&'static Machine> {
    if *INIT_REFS.lock() == 0 {
        return Err(UNINITIALIZED);
    }
    SIM.get().map(|sim| sim.machine).ok_or(UNINITIALIZED)
}

fn device_count(machine: &Machine) -> usize {
    machine.device_count().min(MAX_DEVICES)
}

// ---------------------------------------------------------------------------------------
// Devices.

/// What a device handle points to: one static record per device index, never freed.
struct DeviceSlot {
    util: Mutex<Option<UtilWindow>>,
}

/// Where the current utilization window starts, and the last answer.
#[derive(Clone, Copy)]
struct UtilWindow {
    start: Instant,
    busy_ns: u64,
    gpu: c_uint,
}

static DEVICES: [DeviceSlot; MAX_DEVICES] = [const { DeviceSlot { util: Mutex::new(None) } }; MAX_DEVICES];

fn handle_of(index: usize) -> nvmlDevice_t {
    std::ptr::from_ref(&DEVICES[index]).cast_mut().cast()
}

/// The index of the device `handle` points to, checked against the machine.
fn device_index(handle: nvmlDevice_t) -> NvmlResult<(usize, &'static Machine)> {
    let machine = machine()?;
    (0..device_count(machine))
        .find(|&i| std::ptr::eq(handle.cast_const().cast(), &DEVICES[i]))
        .map(|i| (i, machine))
        .ok_or(INVALID_ARGUMENT)
}

fn handle_by_index(index: c_uint, out: *mut nvmlDevice_t) -> NvmlResult {
    let machine = machine()?;
    if index as usize >= device_count(machine) {
        return Err(INVALID_ARGUMENT);
    }
    write_out(out, handle_of(index as usize))
}

fn handle_by_uuid(uuid: *const c_char, out: *mut nvmlDevice_t) -> NvmlResult {
    let machine = machine()?;
    let wanted = read_str(uuid)?.trim();
    let index = (0..device_count(machine)).find(|&i| device_uuid(i).eq_ignore_ascii_case(wanted));
    write_out(out, handle_of(index.ok_or(NOT_FOUND)?))
}

/// Accepts `domain:bus:device.function` (any domain width) or `bus:device.function`.
fn handle_by_pci_bus_id(id: *const c_char, out: *mut nvmlDevice_t) -> NvmlResult {
    let machine = machine()?;
    let text = read_str(id)?.trim();
    let parts: Vec<&str> = text.split([':', '.']).collect();
    let numbers = parts
        .iter()
        .map(|p| u32::from_str_radix(p, 16).map_err(|_| INVALID_ARGUMENT))
        .collect::<NvmlResult<Vec<u32>>>()?;
    let (domain, bus, dev, function) = match numbers[..] {
        [domain, bus, dev, function] => (domain, bus, dev, function),
        [bus, dev, function] => (0, bus, dev, function),
        _ => return Err(INVALID_ARGUMENT),
    };
    let index = (0..device_count(machine))
        .find(|&i| (domain, bus, dev, function) == (0, pci_bus(i), 0, 0))
        .ok_or(NOT_FOUND)?;
    write_out(out, handle_of(index))
}

fn pci_info(index: usize) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: 0,
        bus: pci_bus(index),
        device: 0,
        pciDeviceId: PCI_DEVICE_ID,
        pciSubSystemId: PCI_SUBSYSTEM_ID,
        busId: [0; 32],
    };
    fill_chars(&mut info.busIdLegacy, &format!("0000:{:02X}:00.0", pci_bus(index)));
    fill_chars(&mut info.busId, &pci_bus_id(index));
    info
}

/// The `nvmlPciInfo_t` of `nvmlDeviceGetPciInfo` and `_v2`, from before NVML 9 widened
/// `busId`: `busId[16]` (now `busIdLegacy`), five IDs and four reserved words, 52 bytes.
#[repr(C)]
#[allow(dead_code)] // Read by C callers.
struct PciInfoV1 {
    bus_id: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    reserved: [c_uint; 4],
}

const _: () = assert!(size_of::<PciInfoV1>() == 52);

fn pci_info_v1(index: usize) -> PciInfoV1 {
    let info = pci_info(index);
    PciInfoV1 {
        bus_id: info.busIdLegacy,
        domain: info.domain,
        bus: info.bus,
        device: info.device,
        pci_device_id: info.pciDeviceId,
        pci_sub_system_id: info.pciSubSystemId,
        reserved: [0; 4],
    }
}

fn memory(index: usize, machine: &Machine) -> (u64, u64, u64) {
    let total = machine.total(index);
    let used = machine.used(index);
    (total, total.saturating_sub(used), used)
}

/// `nvmlMemory_v2`: the structure's size and version 2, as `nvml.h` defines it.
const MEMORY_V2_VERSION: c_uint = (size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);
const _: () = assert!(MEMORY_V2_VERSION == 0x0200_0028);

fn memory_info_v2(device: nvmlDevice_t, out: *mut nvmlMemory_v2_t) -> NvmlResult {
    let (index, machine) = device_index(device)?;
    // `version` is the structure's first field.
    if read_in(out.cast::<c_uint>())? != MEMORY_V2_VERSION {
        return Err(ARGUMENT_VERSION_MISMATCH);
    }
    let (total, free, used) = memory(index, machine);
    write_out(out, nvmlMemory_v2_t { version: MEMORY_V2_VERSION, total, reserved: 0, free, used })
}

/// NVML's list protocol: `*count` says how many entries `infos` has room for; on return it
/// holds how many processes there are, and a list that does not fit is
/// `NVML_ERROR_INSUFFICIENT_SIZE` (the way to ask for the count alone).
/// `nvmlDeviceGetP2PStatus` between devices `a` and `b` for the capability `index`, as a
/// machine whose GPUs share one PCIe root and are NVLinked where `SIMGPU_NVLINK` says:
/// reads, writes and the `PROP` index over PCIe between any two GPUs; NVLink and atomics
/// (which PCIe peers do not have between GPUs) only between linked ones.
fn p2p_status(
    a: nvmlDevice_t,
    b: nvmlDevice_t,
    index: nvmlGpuP2PCapsIndex_t,
) -> NvmlResult<nvmlGpuP2PStatus_t> {
    let (a, b) = (device_index(a)?.0, device_index(b)?.0);
    // NVML documents no answer for a device with itself; this one refuses it.
    if a == b {
        return Err(INVALID_ARGUMENT);
    }
    let linked = NVLINK.lock().linked(a, b);
    match index {
        P2P_READ | P2P_WRITE | P2P_PROP => Ok(P2P_OK),
        P2P_NVLINK | P2P_ATOMICS if linked => Ok(P2P_OK),
        P2P_NVLINK | P2P_ATOMICS => Ok(P2P_NOT_SUPPORTED),
        _ => Err(INVALID_ARGUMENT),
    }
}

fn processes<T>(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    entry: impl Fn(&ProcessUsage) -> T,
) -> NvmlResult {
    let (index, machine) = device_index(device)?;
    let room = read_in(count.cast_const())? as usize;
    let list = machine.processes(index);
    write_out(count, list.len() as c_uint)?;
    if list.len() > room {
        return Err(INSUFFICIENT_SIZE);
    }
    if list.is_empty() {
        return Ok(());
    }
    if infos.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    for (i, process) in list.iter().enumerate() {
        // SAFETY: `infos` is non-null and the caller said it has room for `room` entries;
        // i < list.len() <= room.
        unsafe { infos.add(i).write_unaligned(entry(process)) };
    }
    Ok(())
}

fn process_v1(p: &ProcessUsage) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t { pid: p.pid, usedGpuMemory: p.used }
}

fn process_v2(p: &ProcessUsage) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid: p.pid,
        usedGpuMemory: p.used,
        gpuInstanceId: NO_INSTANCE,
        computeInstanceId: NO_INSTANCE,
    }
}

/// The share of wall time that kernels ran on the device since the previous call (or since
/// `nvmlInit`), in percent. Kernels on several streams at once can add up to more than the
/// wall time; the answer is capped at 100.
fn gpu_utilization(index: usize, machine: &Machine) -> c_uint {
    let now = Instant::now();
    let busy = machine.busy_ns(index);
    let mut window = DEVICES[index].util.lock();
    let Some(prev) = *window else {
        *window = Some(UtilWindow { start: now, busy_ns: busy, gpu: 0 });
        return 0;
    };
    let elapsed = now.saturating_duration_since(prev.start);
    if elapsed < MIN_UTIL_WINDOW {
        return prev.gpu;
    }
    let ran = u128::from(busy.saturating_sub(prev.busy_ns));
    let elapsed = elapsed.as_nanos();
    let gpu = ((ran * 100 + elapsed / 2) / elapsed).min(100) as c_uint;
    *window = Some(UtilWindow { start: now, busy_ns: busy, gpu });
    gpu
}

// ---------------------------------------------------------------------------------------
// Per-process utilization.

/// `nvmlProcessesUtilizationInfo_v1`: the structure's size and version 1, as `nvml.h`
/// defines it.
const PROCESSES_UTILIZATION_INFO_V1: c_uint =
    (size_of::<nvmlProcessesUtilizationInfo_t>() as c_uint) | (1 << 24);
const _: () = assert!(PROCESSES_UTILIZATION_INFO_V1 == 0x0100_0018);

/// The per-process utilization samples newer than `last_seen_us`, in NVML's list
/// protocol: `*count` says how many entries `out` has room for and comes back as how
/// many there are; none is `NVML_ERROR_NOT_FOUND`, a null or short buffer
/// `NVML_ERROR_INSUFFICIENT_SIZE` (the way to ask for the count).
fn process_utilization<T>(
    device: nvmlDevice_t,
    out: *mut T,
    count: *mut c_uint,
    last_seen_us: c_ulonglong,
    entry: impl Fn(&simgpu_state::ProcessUtilization) -> T,
) -> NvmlResult {
    let (index, machine) = device_index(device)?;
    let room = read_in(count.cast_const())? as usize;
    let samples = machine.process_utilization(index, last_seen_us);
    if samples.is_empty() {
        write_out(count, 0)?;
        return Err(NOT_FOUND);
    }
    write_out(count, samples.len() as c_uint)?;
    if out.is_null() || room < samples.len() {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, sample) in samples.iter().enumerate() {
        // SAFETY: `out` is non-null with room for `room` entries; i < samples.len() <= room.
        unsafe { out.add(i).write_unaligned(entry(sample)) };
    }
    Ok(())
}

fn utilization_sample(p: &simgpu_state::ProcessUtilization) -> nvmlProcessUtilizationSample_t {
    nvmlProcessUtilizationSample_t {
        pid: p.pid,
        timeStamp: p.timestamp_us,
        smUtil: p.sm_util,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
    }
}

fn utilization_info(p: &simgpu_state::ProcessUtilization) -> nvmlProcessUtilizationInfo_v1_t {
    nvmlProcessUtilizationInfo_v1_t {
        timeStamp: p.timestamp_us,
        pid: p.pid,
        smUtil: p.sm_util,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
        jpgUtil: 0,
        ofaUtil: 0,
    }
}

/// `nvmlDeviceGetProcessesUtilizationInfo`: as `nvmlDeviceGetProcessUtilization`, with
/// the count, the timestamp and the array in a versioned structure.
fn processes_utilization_info(device: nvmlDevice_t, info: *mut nvmlProcessesUtilizationInfo_t) -> NvmlResult {
    let query = read_in(info.cast_const())?;
    if query.version != PROCESSES_UTILIZATION_INFO_V1 {
        return Err(ARGUMENT_VERSION_MISMATCH);
    }
    let mut count = query.processSamplesCount;
    let result = process_utilization(
        device,
        query.procUtilArray,
        &mut count,
        query.lastSeenTimeStamp,
        utilization_info,
    );
    // SAFETY: `info` is non-null (read above) and points to the caller's structure.
    unsafe { std::ptr::addr_of_mut!((*info).processSamplesCount).write_unaligned(count) };
    result
}

// ---------------------------------------------------------------------------------------
// Events.

/// One device registered in an event set.
struct Watch {
    device: usize,
    types: c_ulonglong,
    /// The device's XID count already delivered (or present at registration).
    seen: u64,
}

#[derive(Default)]
struct EventSet {
    watches: Mutex<Vec<Watch>>,
}

impl EventSet {
    /// The next undelivered XID, as (device, code).
    fn next_xid(&self, machine: &Machine) -> Option<(usize, u64)> {
        let mut watches = self.watches.lock();
        watches.iter_mut().filter(|w| w.types & SUPPORTED_EVENTS != 0).find_map(|w| {
            let (count, last) = machine.xids(w.device);
            if count < w.seen {
                // The machine was reset under us: its counts started again from zero.
                w.seen = 0;
            }
            (count > w.seen).then(|| {
                w.seen += 1;
                (w.device, last)
            })
        })
    }
}

/// Live event sets by handle: the handle is the address of the set, which the table owns.
static EVENT_SETS: LazyLock<Mutex<HashMap<usize, Arc<EventSet>>>> = LazyLock::new(Default::default);

fn event_set(handle: nvmlEventSet_t) -> NvmlResult<Arc<EventSet>> {
    EVENT_SETS.lock().get(&(handle as usize)).cloned().ok_or(INVALID_ARGUMENT)
}

fn event_set_create(out: *mut nvmlEventSet_t) -> NvmlResult {
    machine()?;
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let set = Arc::new(EventSet::default());
    let handle = Arc::as_ptr(&set).cast_mut().cast();
    EVENT_SETS.lock().insert(handle as usize, set);
    write_out(out, handle)
}

fn event_set_free(handle: nvmlEventSet_t) -> NvmlResult {
    machine()?;
    EVENT_SETS.lock().remove(&(handle as usize)).map(drop).ok_or(INVALID_ARGUMENT)
}

fn register_events(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) -> NvmlResult {
    let (index, machine) = device_index(device)?;
    let set = event_set(set)?;
    if types & !SUPPORTED_EVENTS != 0 {
        return Err(NOT_SUPPORTED);
    }
    let mut watches = set.watches.lock();
    match watches.iter_mut().find(|w| w.device == index) {
        Some(watch) => watch.types |= types,
        None => watches.push(Watch { device: index, types, seen: machine.xids(index).0 }),
    }
    Ok(())
}

/// Waits up to `timeout_ms` for an event of `set`, checking every [`EVENT_POLL`].
fn event_wait(
    set: nvmlEventSet_t,
    out: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> NvmlResult<nvmlEventData_t> {
    let machine = machine()?;
    let set = event_set(set)?;
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
    loop {
        if let Some((index, xid)) = set.next_xid(machine) {
            return Ok(nvmlEventData_t {
                device: handle_of(index),
                eventType: SUPPORTED_EVENTS,
                eventData: xid,
                gpuInstanceId: NO_INSTANCE,
                computeInstanceId: NO_INSTANCE,
            });
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TIMEOUT);
        }
        std::thread::sleep(left.min(EVENT_POLL));
    }
}

/// The `nvmlEventData_t` of `nvmlEventSetWait`: without the instance IDs of `_v2`.
#[repr(C)]
#[allow(dead_code)] // Read by C callers.
struct EventDataV1 {
    device: nvmlDevice_t,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
}

const _: () = assert!(size_of::<EventDataV1>() == 24);

// ---------------------------------------------------------------------------------------
// Exports.

/// Defines `#[no_mangle]` NVML functions whose body is a panic-safe `NvmlResult`.
macro_rules! nvml_exports {
    ($( $(#[doc = $doc:literal])* fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {
        $(
            $(#[doc = $doc])*
            ///
            /// # Safety
            ///
            /// Every pointer argument must be NULL or valid for the reads and writes that
            /// `nvml.h` documents for this function.
            #[no_mangle]
            #[allow(non_snake_case)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> nvmlReturn_t {
                guard(|| $body)
            }
        )*
    };
}

nvml_exports! {
    /// Opens the simulated machine; see the crate's `init` for the error answered.
    fn nvmlInit() { init() }
    /// As `nvmlInit`.
    fn nvmlInit_v2() { init() }
    /// As `nvmlInit`; the flags change nothing, the simulated machine always has devices.
    fn nvmlInitWithFlags(_flags: c_uint) { init() }
    /// Undoes one `nvmlInit`; after the last, other calls answer `NVML_ERROR_UNINITIALIZED`.
    fn nvmlShutdown() { shutdown() }

    /// The driver version, e.g. `570.124.06`.
    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) {
        machine()?;
        write_str(version, length, DRIVER_VERSION)
    }
    /// The NVML version, e.g. `12.570.124.06`.
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) {
        machine()?;
        write_str(version, length, NVML_VERSION)
    }
    /// The CUDA version of the driver: 12080.
    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) {
        machine()?;
        write_out(version, CUDA_DRIVER_VERSION)
    }
    /// As `nvmlSystemGetCudaDriverVersion`.
    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) {
        machine()?;
        write_out(version, CUDA_DRIVER_VERSION)
    }

    /// The number of simulated devices.
    fn nvmlDeviceGetCount(count: *mut c_uint) {
        write_out(count, device_count(machine()?) as c_uint)
    }
    /// As `nvmlDeviceGetCount`.
    fn nvmlDeviceGetCount_v2(count: *mut c_uint) {
        write_out(count, device_count(machine()?) as c_uint)
    }
    /// The handle of device `index`.
    fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) {
        handle_by_index(index, device)
    }
    /// As `nvmlDeviceGetHandleByIndex`.
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) {
        handle_by_index(index, device)
    }
    /// The handle of the device with UUID `uuid` (`GPU-...`); `NVML_ERROR_NOT_FOUND` if none.
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) {
        handle_by_uuid(uuid, device)
    }
    /// The handle of the device at PCI address `pciBusId`; `NVML_ERROR_NOT_FOUND` if none.
    fn nvmlDeviceGetHandleByPciBusId(pciBusId: *const c_char, device: *mut nvmlDevice_t) {
        handle_by_pci_bus_id(pciBusId, device)
    }
    /// As `nvmlDeviceGetHandleByPciBusId`.
    fn nvmlDeviceGetHandleByPciBusId_v2(pciBusId: *const c_char, device: *mut nvmlDevice_t) {
        handle_by_pci_bus_id(pciBusId, device)
    }
    /// The index of `device`.
    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) {
        write_out(index, device_index(device)?.0 as c_uint)
    }
    /// The minor number of `device` (`/dev/nvidiaN`): its index.
    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minorNumber: *mut c_uint) {
        write_out(minorNumber, device_index(device)?.0 as c_uint)
    }
    /// `simgpu Virtual GPU`.
    fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) {
        device_index(device)?;
        write_str(name, length, DEVICE_NAME)
    }
    /// The UUID string of `device`.
    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) {
        write_str(uuid, length, &device_uuid(device_index(device)?.0))
    }
    /// Compute capability 9.0.
    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: *mut c_int, minor: *mut c_int) {
        device_index(device)?;
        if major.is_null() || minor.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        write_out(major, 9)?;
        write_out(minor, 0)
    }
    /// PCI information in the layout of `nvmlDeviceGetPciInfo_v3` (`busId[32]`).
    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        write_out(pci, pci_info(device_index(device)?.0))
    }
    /// PCI information in the 52-byte layout of NVML before version 9; see `PciInfoV1`.
    fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        write_out(pci.cast::<PciInfoV1>(), pci_info_v1(device_index(device)?.0))
    }
    /// As `nvmlDeviceGetPciInfo_v2`.
    fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        write_out(pci.cast::<PciInfoV1>(), pci_info_v1(device_index(device)?.0))
    }
    /// The peer-to-peer status of `device1` and `device2` for `p2pIndex` (see
    /// `p2p_status`); `NVML_ERROR_INVALID_ARGUMENT` for a bad handle or index, the same
    /// device twice, or `p2pStatus` null.
    fn nvmlDeviceGetP2PStatus(
        device1: nvmlDevice_t,
        device2: nvmlDevice_t,
        p2pIndex: nvmlGpuP2PCapsIndex_t,
        p2pStatus: *mut nvmlGpuP2PStatus_t,
    ) {
        write_out(p2pStatus, p2p_status(device1, device2, p2pIndex)?)
    }
    /// Device memory: total, free and used (by every live process on the machine).
    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory_out: *mut nvmlMemory_t) {
        let (index, machine) = device_index(device)?;
        let (total, free, used) = memory(index, machine);
        write_out(memory_out, nvmlMemory_t { total, free, used })
    }
    /// As `nvmlDeviceGetMemoryInfo` with `reserved` = 0; `version` must be `nvmlMemory_v2`,
    /// else `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.
    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory_out: *mut nvmlMemory_v2_t) {
        memory_info_v2(device, memory_out)
    }
    /// The processes holding memory on `device`, as `nvmlProcessInfo_v1_t`.
    fn nvmlDeviceGetComputeRunningProcesses(
        device: nvmlDevice_t,
        infoCount: *mut c_uint,
        infos: *mut nvmlProcessInfo_v1_t,
    ) {
        processes(device, infoCount, infos, process_v1)
    }
    /// The processes holding memory on `device`, with no MIG instance.
    fn nvmlDeviceGetComputeRunningProcesses_v2(
        device: nvmlDevice_t,
        infoCount: *mut c_uint,
        infos: *mut nvmlProcessInfo_t,
    ) {
        processes(device, infoCount, infos, process_v2)
    }
    /// As `nvmlDeviceGetComputeRunningProcesses_v2`.
    fn nvmlDeviceGetComputeRunningProcesses_v3(
        device: nvmlDevice_t,
        infoCount: *mut c_uint,
        infos: *mut nvmlProcessInfo_t,
    ) {
        processes(device, infoCount, infos, process_v2)
    }
    /// GPU utilization since the previous call (see `gpu_utilization`); memory
    /// utilization is not simulated and reads 0.
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: *mut nvmlUtilization_t) {
        let (index, machine) = device_index(device)?;
        if utilization.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        write_out(utilization, nvmlUtilization_t { gpu: gpu_utilization(index, machine), memory: 0 })
    }

    /// Per-process utilization: one sample per process whose kernels ran or waited on
    /// `device` in the samples taken after `lastSeenTimeStamp` (µs since the Unix epoch; 0
    /// for all kept), its `smUtil` the percent of that time during which it had kernels
    /// pending there, running or sliced out (as a real driver counts under time-slicing:
    /// two processes that flood one device each read near 100), `timeStamp` when the
    /// newest sample closed; memory, encoder and decoder utilization 0. No sample: `NVML_ERROR_NOT_FOUND`; `utilization` null or
    /// `*processSamplesCount` too small: `NVML_ERROR_INSUFFICIENT_SIZE` with the count.
    fn nvmlDeviceGetProcessUtilization(
        device: nvmlDevice_t,
        utilization: *mut nvmlProcessUtilizationSample_t,
        processSamplesCount: *mut c_uint,
        lastSeenTimeStamp: c_ulonglong,
    ) {
        process_utilization(device, utilization, processSamplesCount, lastSeenTimeStamp, utilization_sample)
    }
    /// As `nvmlDeviceGetProcessUtilization` with `nvmlProcessesUtilizationInfo_v1_t`
    /// (`version` must be `nvmlProcessesUtilizationInfo_v1`, else
    /// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`); JPEG and OFA utilization 0.
    fn nvmlDeviceGetProcessesUtilizationInfo(device: nvmlDevice_t, procesesUtilInfo: *mut nvmlProcessesUtilizationInfo_t) {
        processes_utilization_info(device, procesesUtilInfo)
    }

    /// A new, empty event set.
    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) {
        event_set_create(set)
    }
    /// Frees an event set.
    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        event_set_free(set)
    }
    /// `nvmlEventTypeXidCriticalError`, the only event simulated.
    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, eventTypes: *mut c_ulonglong) {
        device_index(device)?;
        write_out(eventTypes, SUPPORTED_EVENTS)
    }
    /// Watches `device` for the XIDs injected from now on. Other event types are
    /// `NVML_ERROR_NOT_SUPPORTED`, as real NVML answers for types a device lacks.
    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, eventTypes: c_ulonglong, set: nvmlEventSet_t) {
        register_events(device, eventTypes, set)
    }
    /// Waits up to `timeoutms` ms for the next XID on a device of `set`: the event has the
    /// XID code as `eventData`; `NVML_ERROR_TIMEOUT` when none came.
    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeoutms: c_uint) {
        write_out(data, event_wait(set, data, timeoutms)?)
    }
    /// As `nvmlEventSetWait_v2`, with the older `nvmlEventData_t` that has no instance IDs.
    fn nvmlEventSetWait(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeoutms: c_uint) {
        let event = event_wait(set, data, timeoutms)?;
        let (device, event_type, event_data) = (event.device, event.eventType, event.eventData);
        write_out(data.cast::<EventDataV1>(), EventDataV1 { device, event_type, event_data })
    }
}

/// The text of an NVML return code, in a static string.
///
/// # Safety
///
/// Always safe to call; unsafe only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    guard_with(c"Unknown Error".as_ptr(), || error_text(result).as_ptr())
}

fn error_text(result: nvmlReturn_t) -> &'static CStr {
    match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt Request Issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, because ECC is enabled",
        23 => c"Insufficient resources",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Deprecated",
        27 => c"Not Ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        30 => c"Reset type not supported",
        _ => c"Unknown Error",
    }
}

/// Test hook, not NVML: injects XID `xid` on device `device_index` of the simulated
/// machine, which every process sharing it sees (`nvmlEventSetWait` delivers it). Needs no
/// `nvmlInit`. Answers 0, or -1 for a device that does not exist or a machine that cannot
/// be opened (the reason then goes to stderr).
///
/// # Safety
///
/// Always safe to call; unsafe only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn simgpu_inject_xid(device_index: c_uint, xid: c_ulonglong) -> c_int {
    guard_with(-1, || match sim() {
        Ok(sim) if sim.machine.inject_xid(device_index as usize, xid) => 0,
        Ok(_) => -1,
        Err(e) => {
            eprintln!("{e}");
            -1
        }
    })
}

// After `nvml_exports!`, which it uses.
mod monitor;
