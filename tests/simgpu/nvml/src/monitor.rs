//! The getters monitoring tools (`nvidia-smi`-like tools, `gpustat`, `nvitop`, exporters)
//! call on every refresh, so that they run on simgpu without a missing-symbol error.
//!
//! Values are those of an idle-to-busy H100 SXM5 on Linux: temperature and power follow
//! the utilization last reported by `nvmlDeviceGetUtilizationRates`, clocks are the
//! device's maximum, error counters are zero, and there are no graphics or MPS processes.
//! What a real H100 on Linux does not have (fans, a Windows driver model) or simgpu does
//! not simulate answers `NVML_ERROR_NOT_SUPPORTED`, which every tool handles as "N/A".

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::time::{SystemTime, UNIX_EPOCH};

use nvml_wrapper_sys::bindings::{
    nvmlBAR1Memory_t, nvmlDevice_t, nvmlFBCStats_t, nvmlFieldValue_t, nvmlProcessInfo_t,
    nvmlProcessInfo_v1_t, nvmlReturn_t,
};

use crate::{
    device_index, guard, machine, read_in, write_out, write_str, NvmlResult, DEVICES, INVALID_ARGUMENT,
    NOT_FOUND, NOT_SUPPORTED,
};

/// Maximum clocks in MHz by `nvmlClockType_t`: graphics, SM, memory, video.
const MAX_CLOCKS: [c_uint; 4] = [1980, 1980, 2619, 1755];
/// Power limit (default, enforced and maximum) and minimum, in milliwatts.
const POWER_LIMIT_MW: c_uint = 700_000;
const POWER_MIN_MW: c_uint = 200_000;
/// Board power at idle, in milliwatts; full utilization reaches the limit.
const IDLE_POWER_MW: c_uint = 70_000;
/// GPU temperature at idle and its rise at full utilization, in °C.
const IDLE_TEMP_C: c_uint = 33;
const BUSY_TEMP_RISE_C: c_uint = 40;
/// `nvmlTemperatureThresholds_t` values: shutdown, slowdown, memory max, GPU max.
const TEMP_THRESHOLDS_C: [c_uint; 4] = [92, 89, 95, 87];
/// The sampling period that encoder and decoder utilization report, in microseconds.
const CODEC_SAMPLING_US: c_uint = 167_000;
/// BAR1 aperture of an H100: 128 GiB.
const BAR1_BYTES: c_ulonglong = 128 << 30;
/// `NVML_BRAND_NVIDIA`, `NVML_DEVICE_ARCH_HOPPER`, and the CUDA cores of 132 SMs.
const BRAND_NVIDIA: c_uint = 14;
const ARCH_HOPPER: c_uint = 9;
const GPU_CORES: c_uint = 16_896;
/// Every `nvmlClocksEventReasons` bit a device can report.
const SUPPORTED_EVENT_REASONS: c_ulonglong = 0x1ff;
/// `NVML_FEATURE_ENABLED`, `NVML_FEATURE_DISABLED`.
const ENABLED: c_uint = 1;
const DISABLED: c_uint = 0;
/// H100 MIG: up to seven instances (not enabled on simgpu's devices).
const MAX_MIG_DEVICES: c_uint = 7;

/// The GPU utilization (percent) last answered for `device`, without opening a new
/// measurement window, so that reading temperature or power does not disturb it.
fn last_utilization(device: nvmlDevice_t) -> NvmlResult<c_uint> {
    let (index, _) = device_index(device)?;
    Ok((*DEVICES[index].util.lock()).map_or(0, |w| w.gpu))
}

fn temperature(device: nvmlDevice_t, sensor: c_uint, out: *mut c_uint) -> NvmlResult {
    let util = last_utilization(device)?;
    // NVML_TEMPERATURE_GPU is the only sensor.
    if sensor != 0 {
        return Err(INVALID_ARGUMENT);
    }
    write_out(out, IDLE_TEMP_C + BUSY_TEMP_RISE_C * util / 100)
}

/// `nvmlTemperature_v1_t`: version, sensor, temperature (signed).
#[repr(C)]
#[derive(Clone, Copy)]
struct TemperatureV1 {
    version: c_uint,
    sensor: c_uint,
    temperature: c_int,
}

/// `nvmlTemperature_v1`: the structure's size and version 1, as `nvml.h` defines it.
const TEMPERATURE_V1: c_uint = (std::mem::size_of::<TemperatureV1>() as c_uint) | (1 << 24);

fn temperature_v(device: nvmlDevice_t, out: *mut TemperatureV1) -> NvmlResult {
    let mut query = read_in(out.cast_const())?;
    if query.version != TEMPERATURE_V1 {
        return Err(crate::ARGUMENT_VERSION_MISMATCH);
    }
    let mut celsius = 0;
    temperature(device, query.sensor, &mut celsius)?;
    query.temperature = celsius as c_int;
    write_out(out, query)
}

fn power_usage(device: nvmlDevice_t, out: *mut c_uint) -> NvmlResult {
    let util = last_utilization(device)?;
    write_out(out, IDLE_POWER_MW + (POWER_LIMIT_MW - IDLE_POWER_MW) / 100 * util)
}

fn clock(device: nvmlDevice_t, clock_type: c_uint, out: *mut c_uint) -> NvmlResult {
    device_index(device)?;
    let mhz = MAX_CLOCKS.get(clock_type as usize).ok_or(INVALID_ARGUMENT)?;
    write_out(out, *mhz)
}

/// Writes `value` after checking the device handle: the shape of most getters.
fn device_value<T>(device: nvmlDevice_t, out: *mut T, value: T) -> NvmlResult {
    device_index(device)?;
    write_out(out, value)
}

/// Answers an NVML list getter for a list that is always empty on simgpu: `*count` = 0.
fn empty_list(device: nvmlDevice_t, count: *mut c_uint) -> NvmlResult {
    device_index(device)?;
    read_in(count.cast_const())?;
    write_out(count, 0)
}

/// Codec utilization (encoder, decoder, JPEG, OFA): always idle.
fn codec_utilization(device: nvmlDevice_t, util: *mut c_uint, period_us: *mut c_uint) -> NvmlResult {
    device_index(device)?;
    write_out(util, 0)?;
    write_out(period_us, CODEC_SAMPLING_US)
}

/// `nvmlDeviceGetFieldValues`: each field answers `NVML_ERROR_NOT_SUPPORTED` in its own
/// `nvmlReturn`, which is how NVML reports fields a device lacks; the call succeeds.
fn field_values(device: nvmlDevice_t, count: c_int, values: *mut nvmlFieldValue_t) -> NvmlResult {
    device_index(device)?;
    if count < 0 || (count > 0 && values.is_null()) {
        return Err(INVALID_ARGUMENT);
    }
    let now_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
    for i in 0..count as usize {
        // SAFETY: the caller passes `count` entries at `values` (checked non-null above).
        let entry = unsafe { &mut *values.add(i) };
        entry.timestamp = now_us;
        entry.latencyUsec = 0;
        entry.nvmlReturn = NOT_SUPPORTED;
    }
    Ok(())
}

/// `nvmlSystemGetProcessName`: the program of `pid` (its first `cmdline` word, else its
/// `comm`), as NVML reads it from procfs.
fn process_name(pid: c_uint, name: *mut c_char, length: c_uint) -> NvmlResult {
    machine()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let first = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    let text = if first.is_empty() {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).map_err(|_| NOT_FOUND)?.trim_end().to_owned()
    } else {
        String::from_utf8_lossy(first).into_owned()
    };
    // NVML truncates to the caller's buffer rather than failing.
    let mut end = text.len().min((length as usize).saturating_sub(1));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    write_str(name, length, &text[..end])
}

nvml_exports! {
    /// Graphics processes: none on simgpu (v1 layout).
    fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_v1_t) {
        empty_list(device, infoCount)
    }
    /// Graphics processes: none on simgpu.
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, infoCount)
    }
    /// Graphics processes: none on simgpu.
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, infoCount)
    }
    /// MPS compute processes: none, simgpu has no MPS server (v1 layout).
    fn nvmlDeviceGetMPSComputeRunningProcesses(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_v1_t) {
        empty_list(device, infoCount)
    }
    /// MPS compute processes: none.
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, infoCount)
    }
    /// MPS compute processes: none.
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, infoCount: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, infoCount)
    }
    /// GPU temperature in °C, rising with utilization.
    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensorType: c_uint, temp: *mut c_uint) {
        temperature(device, sensorType, temp)
    }
    /// As `nvmlDeviceGetTemperature`, with a versioned `nvmlTemperature_v1_t`.
    fn nvmlDeviceGetTemperatureV(device: nvmlDevice_t, temperature: *mut c_void) {
        temperature_v(device, temperature.cast())
    }
    /// Temperature thresholds of an H100 (shutdown, slowdown, memory max, GPU max).
    fn nvmlDeviceGetTemperatureThreshold(device: nvmlDevice_t, thresholdType: c_uint, temp: *mut c_uint) {
        device_index(device)?;
        write_out(temp, *TEMP_THRESHOLDS_C.get(thresholdType as usize).ok_or(NOT_SUPPORTED)?)
    }
    /// Board power in mW: idle power plus a share of the limit proportional to utilization.
    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) {
        power_usage(device, power)
    }
    /// 700 W.
    fn nvmlDeviceGetPowerManagementLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        device_value(device, limit, POWER_LIMIT_MW)
    }
    /// 700 W.
    fn nvmlDeviceGetPowerManagementDefaultLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        device_value(device, limit, POWER_LIMIT_MW)
    }
    /// 700 W.
    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        device_value(device, limit, POWER_LIMIT_MW)
    }
    /// 200 W to 700 W.
    fn nvmlDeviceGetPowerManagementLimitConstraints(device: nvmlDevice_t, minLimit: *mut c_uint, maxLimit: *mut c_uint) {
        device_value(device, minLimit, POWER_MIN_MW)?;
        write_out(maxLimit, POWER_LIMIT_MW)
    }
    /// `NVML_FEATURE_ENABLED`.
    fn nvmlDeviceGetPowerManagementMode(device: nvmlDevice_t, mode: *mut c_uint) {
        device_value(device, mode, ENABLED)
    }
    /// P0.
    fn nvmlDeviceGetPerformanceState(device: nvmlDevice_t, pState: *mut c_uint) {
        device_value(device, pState, 0)
    }
    /// P0.
    fn nvmlDeviceGetPowerState(device: nvmlDevice_t, pState: *mut c_uint) {
        device_value(device, pState, 0)
    }
    /// No clock event (throttle) reason.
    fn nvmlDeviceGetCurrentClocksEventReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) {
        device_value(device, reasons, 0)
    }
    /// As `nvmlDeviceGetCurrentClocksEventReasons` (its older name).
    fn nvmlDeviceGetCurrentClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) {
        device_value(device, reasons, 0)
    }
    /// Every reason bit.
    fn nvmlDeviceGetSupportedClocksEventReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) {
        device_value(device, reasons, SUPPORTED_EVENT_REASONS)
    }
    /// As `nvmlDeviceGetSupportedClocksEventReasons` (its older name).
    fn nvmlDeviceGetSupportedClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) {
        device_value(device, reasons, SUPPORTED_EVENT_REASONS)
    }

    /// Current clock of `type` in MHz: the maximum (simgpu's devices never downclock).
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, clockType: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }
    /// Maximum clock of `type` in MHz.
    fn nvmlDeviceGetMaxClockInfo(device: nvmlDevice_t, clockType: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }
    /// As `nvmlDeviceGetClockInfo`, whatever the clock ID (current, target, default).
    fn nvmlDeviceGetClock(device: nvmlDevice_t, clockType: c_uint, _clockId: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }
    /// Application clocks: the maximum.
    fn nvmlDeviceGetApplicationsClock(device: nvmlDevice_t, clockType: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }
    /// Default application clocks: the maximum.
    fn nvmlDeviceGetDefaultApplicationsClock(device: nvmlDevice_t, clockType: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }
    /// Maximum boost clocks: the maximum.
    fn nvmlDeviceGetMaxCustomerBoostClock(device: nvmlDevice_t, clockType: c_uint, clock_mhz: *mut c_uint) {
        clock(device, clockType, clock_mhz)
    }

    /// Idle encoder.
    fn nvmlDeviceGetEncoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, samplingPeriodUs: *mut c_uint) {
        codec_utilization(device, utilization, samplingPeriodUs)
    }
    /// Idle decoder.
    fn nvmlDeviceGetDecoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, samplingPeriodUs: *mut c_uint) {
        codec_utilization(device, utilization, samplingPeriodUs)
    }
    /// Idle JPEG engine.
    fn nvmlDeviceGetJpgUtilization(device: nvmlDevice_t, utilization: *mut c_uint, samplingPeriodUs: *mut c_uint) {
        codec_utilization(device, utilization, samplingPeriodUs)
    }
    /// Idle optical-flow engine.
    fn nvmlDeviceGetOfaUtilization(device: nvmlDevice_t, utilization: *mut c_uint, samplingPeriodUs: *mut c_uint) {
        codec_utilization(device, utilization, samplingPeriodUs)
    }
    /// No encoder sessions: zero count, FPS and latency.
    fn nvmlDeviceGetEncoderStats(device: nvmlDevice_t, sessionCount: *mut c_uint, averageFps: *mut c_uint, averageLatency: *mut c_uint) {
        device_value(device, sessionCount, 0)?;
        write_out(averageFps, 0)?;
        write_out(averageLatency, 0)
    }
    /// No encoder sessions.
    fn nvmlDeviceGetEncoderSessions(device: nvmlDevice_t, sessionCount: *mut c_uint, _sessionInfos: *mut u8) {
        empty_list(device, sessionCount)
    }
    /// No frame-buffer-capture sessions.
    fn nvmlDeviceGetFBCStats(device: nvmlDevice_t, fbcStats: *mut nvmlFBCStats_t) {
        device_value(device, fbcStats, nvmlFBCStats_t { sessionsCount: 0, averageFPS: 0, averageLatency: 0 })
    }
    /// No frame-buffer-capture sessions.
    fn nvmlDeviceGetFBCSessions(device: nvmlDevice_t, sessionCount: *mut c_uint, _sessionInfo: *mut u8) {
        empty_list(device, sessionCount)
    }

    /// `NVML_COMPUTEMODE_DEFAULT`.
    fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut c_uint) {
        device_value(device, mode, 0)
    }
    /// Enabled, as on a data-center node.
    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: *mut c_uint) {
        device_value(device, mode, ENABLED)
    }
    /// No display attached.
    fn nvmlDeviceGetDisplayActive(device: nvmlDevice_t, isActive: *mut c_uint) {
        device_value(device, isActive, DISABLED)
    }
    /// No display attached.
    fn nvmlDeviceGetDisplayMode(device: nvmlDevice_t, display: *mut c_uint) {
        device_value(device, display, DISABLED)
    }
    /// ECC enabled, now and after reboot.
    fn nvmlDeviceGetEccMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) {
        device_value(device, current, ENABLED)?;
        write_out(pending, ENABLED)
    }
    /// No ECC errors, of any type and counter.
    fn nvmlDeviceGetTotalEccErrors(device: nvmlDevice_t, errorType: c_uint, counterType: c_uint, eccCounts: *mut c_ulonglong) {
        if errorType > 1 || counterType > 1 {
            return Err(INVALID_ARGUMENT);
        }
        device_value(device, eccCounts, 0)
    }
    /// No memory errors anywhere.
    fn nvmlDeviceGetMemoryErrorCounter(device: nvmlDevice_t, errorType: c_uint, counterType: c_uint, _locationType: c_uint, count: *mut c_ulonglong) {
        if errorType > 1 || counterType > 1 {
            return Err(INVALID_ARGUMENT);
        }
        device_value(device, count, 0)
    }
    /// No remapped rows, none pending, no failure.
    fn nvmlDeviceGetRemappedRows(device: nvmlDevice_t, corrRows: *mut c_uint, uncRows: *mut c_uint, isPending: *mut c_uint, failureOccurred: *mut c_uint) {
        device_value(device, corrRows, 0)?;
        write_out(uncRows, 0)?;
        write_out(isPending, 0)?;
        write_out(failureOccurred, 0)
    }

    /// BAR1: a 128 GiB aperture, unused.
    fn nvmlDeviceGetBAR1MemoryInfo(device: nvmlDevice_t, bar1Memory: *mut nvmlBAR1Memory_t) {
        device_value(device, bar1Memory, nvmlBAR1Memory_t { bar1Total: BAR1_BYTES, bar1Free: BAR1_BYTES, bar1Used: 0 })
    }
    /// No PCIe traffic (KB/s).
    fn nvmlDeviceGetPcieThroughput(device: nvmlDevice_t, _counter: c_uint, value: *mut c_uint) {
        device_value(device, value, 0)
    }
    /// No PCIe replays.
    fn nvmlDeviceGetPcieReplayCounter(device: nvmlDevice_t, value: *mut c_uint) {
        device_value(device, value, 0)
    }
    /// PCIe generation 5.
    fn nvmlDeviceGetCurrPcieLinkGeneration(device: nvmlDevice_t, currLinkGen: *mut c_uint) {
        device_value(device, currLinkGen, 5)
    }
    /// PCIe generation 5.
    fn nvmlDeviceGetMaxPcieLinkGeneration(device: nvmlDevice_t, maxLinkGen: *mut c_uint) {
        device_value(device, maxLinkGen, 5)
    }
    /// PCIe generation 5.
    fn nvmlDeviceGetGpuMaxPcieLinkGeneration(device: nvmlDevice_t, maxLinkGenDevice: *mut c_uint) {
        device_value(device, maxLinkGenDevice, 5)
    }
    /// x16.
    fn nvmlDeviceGetCurrPcieLinkWidth(device: nvmlDevice_t, currLinkWidth: *mut c_uint) {
        device_value(device, currLinkWidth, 16)
    }
    /// x16.
    fn nvmlDeviceGetMaxPcieLinkWidth(device: nvmlDevice_t, maxLinkWidth: *mut c_uint) {
        device_value(device, maxLinkWidth, 16)
    }
    /// 32000 MB/s per lane (generation 5).
    fn nvmlDeviceGetPcieSpeed(device: nvmlDevice_t, pcieSpeed: *mut c_uint) {
        device_value(device, pcieSpeed, 32_000)
    }

    /// A 13-digit board serial number, distinct per device.
    fn nvmlDeviceGetSerial(device: nvmlDevice_t, serial: *mut c_char, length: c_uint) {
        let (index, _) = device_index(device)?;
        write_str(serial, length, &format!("1654922{index:06}"))
    }
    /// The VBIOS version string.
    fn nvmlDeviceGetVbiosVersion(device: nvmlDevice_t, version: *mut c_char, length: c_uint) {
        device_index(device)?;
        write_str(version, length, "96.00.99.00.01")
    }
    /// `NVML_BRAND_NVIDIA`.
    fn nvmlDeviceGetBrand(device: nvmlDevice_t, brandType: *mut c_uint) {
        device_value(device, brandType, BRAND_NVIDIA)
    }
    /// `NVML_DEVICE_ARCH_HOPPER`.
    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch: *mut c_uint) {
        device_value(device, arch, ARCH_HOPPER)
    }
    /// 16896 CUDA cores (132 SMs).
    fn nvmlDeviceGetNumGpuCores(device: nvmlDevice_t, numCores: *mut c_uint) {
        device_value(device, numCores, GPU_CORES)
    }
    /// A 5120-bit memory bus.
    fn nvmlDeviceGetMemoryBusWidth(device: nvmlDevice_t, busWidth: *mut c_uint) {
        device_value(device, busWidth, 5120)
    }
    /// A board of its own per device: the ID is derived from its PCI bus.
    fn nvmlDeviceGetBoardId(device: nvmlDevice_t, boardId: *mut c_uint) {
        let (index, _) = device_index(device)?;
        write_out(boardId, crate::pci_bus(index) << 8)
    }
    /// Not a multi-GPU board.
    fn nvmlDeviceGetMultiGpuBoard(device: nvmlDevice_t, multiGpuBool: *mut c_uint) {
        device_value(device, multiGpuBool, 0)
    }
    /// `NVML_GPU_VIRTUALIZATION_MODE_NONE`: bare metal.
    fn nvmlDeviceGetVirtualizationMode(device: nvmlDevice_t, pVirtualMode: *mut c_uint) {
        device_value(device, pVirtualMode, 0)
    }

    /// Handles from `nvmlDeviceGetHandleBy*` are whole GPUs, never MIG devices.
    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, isMigDevice: *mut c_uint) {
        device_value(device, isMigDevice, 0)
    }
    /// MIG capable, and disabled now and after reset.
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, currentMode: *mut c_uint, pendingMode: *mut c_uint) {
        device_value(device, currentMode, DISABLED)?;
        write_out(pendingMode, DISABLED)
    }
    /// Seven, as an H100 (MIG stays disabled).
    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) {
        device_value(device, count, MAX_MIG_DEVICES)
    }
    /// With MIG disabled there is no MIG device: `NVML_ERROR_NOT_FOUND`.
    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, _index: c_uint, _migDevice: *mut nvmlDevice_t) {
        device_index(device)?;
        Err(NOT_FOUND)
    }

    /// Every requested field answers `NVML_ERROR_NOT_SUPPORTED` in its own entry.
    fn nvmlDeviceGetFieldValues(device: nvmlDevice_t, valuesCount: c_int, values: *mut nvmlFieldValue_t) {
        field_values(device, valuesCount, values)
    }
    /// The program name of process `pid` (from procfs, as NVML does).
    fn nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint) {
        process_name(pid, name, length)
    }
    /// No S-class units.
    fn nvmlUnitGetCount(unitCount: *mut c_uint) {
        machine()?;
        write_out(unitCount, 0)
    }
}

/// Exports NVML entry points that simgpu does not simulate. Each answers
/// `NVML_ERROR_UNINITIALIZED` outside `nvmlInit` and otherwise `NVML_ERROR_NOT_SUPPORTED`,
/// what NVML answers for a feature the device lacks, and which tools show as "N/A";
/// a missing symbol would instead be `NVML_ERROR_FUNCTION_NOT_FOUND`, which tools treat
/// as a broken installation. The arguments are ignored: the C calling convention lets a
/// function declared without parameters be called with any.
macro_rules! not_supported {
    ($($name:ident),* $(,)?) => {
        $(
            /// Not simulated: `NVML_ERROR_NOT_SUPPORTED`, whatever the arguments.
            #[no_mangle]
            #[allow(non_snake_case)]
            pub extern "C" fn $name() -> nvmlReturn_t {
                guard(|| machine().and(Err(NOT_SUPPORTED)))
            }
        )*
    };
}

not_supported! {
    // No fans on an SXM board; no Windows driver model on Linux.
    nvmlDeviceGetFanSpeed, nvmlDeviceGetFanSpeed_v2, nvmlDeviceGetNumFans, nvmlDeviceGetTargetFanSpeed,
    nvmlDeviceGetMinMaxFanSpeed, nvmlDeviceGetFanControlPolicy_v2, nvmlDeviceGetDriverModel,
    nvmlDeviceGetDriverModel_v2,
    // Sensors, power and clocks beyond the basics.
    nvmlDeviceGetMarginTemperature, nvmlDeviceGetThermalSettings,
    nvmlDeviceGetTotalEnergyConsumption, nvmlDeviceGetPowerSource, nvmlDeviceGetViolationStatus,
    nvmlDeviceGetAutoBoostedClocksEnabled, nvmlDeviceGetSupportedMemoryClocks,
    nvmlDeviceGetSupportedGraphicsClocks, nvmlDeviceGetDynamicPstatesInfo, nvmlDeviceGetAdaptiveClockInfoStatus,
    nvmlDeviceGetGpcClkVfOffset, nvmlDeviceGetMemClkVfOffset, nvmlDeviceGetClkMonStatus,
    nvmlDeviceGetSupportedPerformanceStates, nvmlDeviceGetMinMaxClockOfPState, nvmlDeviceGetSamples,
    nvmlDeviceGetEncoderCapacity, nvmlDeviceGetGpuOperationMode,
    // Memory error history (an H100 remaps rows instead of retiring pages).
    nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPages_v2, nvmlDeviceGetRetiredPagesPendingStatus,
    nvmlDeviceGetDetailedEccErrors, nvmlDeviceGetRowRemapperHistogram,
    // Board identity and firmware.
    nvmlDeviceGetBoardPartNumber, nvmlDeviceGetInforomVersion, nvmlDeviceGetInforomImageVersion,
    nvmlDeviceGetInforomConfigurationChecksum, nvmlDeviceValidateInforom, nvmlDeviceGetGspFirmwareMode,
    nvmlDeviceGetGspFirmwareVersion, nvmlDeviceGetModuleId, nvmlDeviceGetPciInfoExt, nvmlDeviceGetIrqNum,
    nvmlDeviceGetBusType, nvmlDeviceGetPcieLinkMaxSpeed, nvmlDeviceGetHandleBySerial, nvmlDeviceGetAttributes_v2,
    // Topology, NVLink and fabric beyond peer-to-peer status (`nvmlDeviceGetP2PStatus`,
    // in the crate's root, answers NVLink from SIMGPU_NVLINK).
    nvmlDeviceGetTopologyCommonAncestor, nvmlDeviceGetTopologyNearestGpus,
    nvmlDeviceGetCpuAffinity, nvmlDeviceGetCpuAffinityWithinScope, nvmlDeviceGetMemoryAffinity,
    nvmlDeviceGetNvLinkState, nvmlDeviceGetNvLinkVersion, nvmlDeviceGetNvLinkCapability,
    nvmlDeviceGetNvLinkRemotePciInfo_v2, nvmlDeviceGetNvLinkErrorCounter, nvmlDeviceGetNvLinkUtilizationCounter,
    nvmlDeviceGetNvLinkRemoteDeviceType, nvmlDeviceGetGpuFabricInfo, nvmlDeviceGetGpuFabricInfoV,
    // MIG instances (MIG is disabled), accounting, vGPU.
    nvmlDeviceGetGpuInstanceId, nvmlDeviceGetComputeInstanceId, nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    nvmlDeviceGetGpuInstances, nvmlDeviceGetGpuInstanceProfileInfo, nvmlDeviceGetGpuInstanceProfileInfoV,
    nvmlDeviceGetAccountingMode, nvmlDeviceGetAccountingStats, nvmlDeviceGetAccountingPids,
    nvmlDeviceGetAccountingBufferSize, nvmlDeviceGetHostVgpuMode, nvmlDeviceGetSupportedVgpus,
    nvmlDeviceGetCreatableVgpus, nvmlDeviceGetActiveVgpus, nvmlDeviceGetGridLicensableFeatures_v4,
    // Confidential computing. These two go together: nvitop reads an exported
    // `nvmlDeviceGetConfComputeMemSizeInfo` without `nvmlDeviceGetRunningProcessDetailList`
    // as a driver whose process records carry an extra field.
    nvmlDeviceGetConfComputeMemSizeInfo, nvmlDeviceGetRunningProcessDetailList,
    nvmlSystemGetConfComputeState, nvmlSystemGetConfComputeCapabilities,
    // System-wide.
    nvmlSystemGetHicVersion, nvmlSystemGetTopologyGpuSet,
}
