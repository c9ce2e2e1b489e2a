//! Modules and launches. Any image loads (simgpu does not compile PTX); every module
//! offers the built-in kernels, which run on their stream's worker like GPU kernels:
//!
//! | kernel | parameters (C types) | effect |
//! | --- | --- | --- |
//! | `simgpu_noop` | none | nothing |
//! | `simgpu_fill_u32` | `unsigned int *ptr, unsigned int value, size_t count` | `ptr[0..count] = value` |
//! | `simgpu_checksum_u32` | `const unsigned int *ptr, size_t count, unsigned long long *out` | `*out = ` wrapping sum of `ptr[0..count]` |
//! | `simgpu_sleep_us` | `unsigned long long us` | keeps the stream (and the device's utilization) busy for `us` microseconds |

use std::collections::HashSet;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUfunction, CUmodule, CUstream};
use parking_lot::Mutex;

use crate::context;
use crate::driver::driver;
use crate::ffi::{new_handle, read_in, read_str, write_out, CUresult, CuResult};
use crate::memory::REGISTRY;
use crate::stream::{self, DefaultStream};

/// A built-in kernel: its name and how many parameters it takes.
pub(crate) struct Kernel {
    name: &'static str,
    params: usize,
}

static KERNELS: [Kernel; 4] = [
    Kernel { name: "simgpu_noop", params: 0 },
    Kernel { name: "simgpu_fill_u32", params: 3 },
    Kernel { name: "simgpu_checksum_u32", params: 3 },
    Kernel { name: "simgpu_sleep_us", params: 1 },
];

static MODULES: LazyLock<Mutex<HashSet<usize>>> = LazyLock::new(Default::default);

pub(crate) fn module_load_data(out: *mut CUmodule, image: *const c_void) -> CuResult {
    context::current()?;
    if out.is_null() || image.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let handle = new_handle();
    MODULES.lock().insert(handle);
    write_out(out, handle as CUmodule)
}

pub(crate) fn module_unload(module: CUmodule) -> CuResult {
    driver()?;
    let handle = module as usize;
    if !MODULES.lock().remove(&handle) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(())
}

pub(crate) fn module_get_function(out: *mut CUfunction, module: CUmodule, name: *const c_char) -> CuResult {
    driver()?;
    if !MODULES.lock().contains(&(module as usize)) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    let name = read_str(name)?;
    let kernel = KERNELS.iter().find(|k| k.name == name).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?;
    write_out(out, kernel as *const Kernel as CUfunction)
}

fn kernel(f: CUfunction) -> CuResult<&'static Kernel> {
    KERNELS
        .iter()
        .find(|k| std::ptr::eq(*k as *const Kernel, f as *const Kernel))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// Reads parameter `i` of type T from `kernelParams`.
fn param<T: Copy>(params: *mut *mut c_void, i: usize) -> CuResult<T> {
    if params.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the launch contract: kernelParams holds one pointer per kernel parameter,
    // and `i` is below the kernel's parameter count.
    let slot = unsafe { *params.add(i) };
    read_in(slot.cast::<T>().cast_const())
}

/// What a queued kernel will do, with its parameters copied at launch, as CUDA does.
enum Work {
    Noop,
    Fill { ptr: u64, value: u32, count: usize },
    Checksum { ptr: u64, count: usize, out: u64 },
    Sleep { us: u64 },
}

impl Work {
    fn run(self, device: usize) -> CuResult {
        let started = Instant::now();
        let result = match self {
            Work::Noop => Ok(()),
            Work::Sleep { us } => {
                std::thread::sleep(Duration::from_micros(us));
                Ok(())
            }
            Work::Fill { ptr, value, count } => {
                let reg = REGISTRY.read();
                let bytes = count.checked_mul(4).ok_or(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)? as u64;
                if count > 0 && (ptr % 4 != 0 || reg.device_range(ptr, bytes).is_none()) {
                    return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
                }
                if count > 0 {
                    // SAFETY: checked to be mapped read/write device memory, aligned, held
                    // mapped by the registry lock.
                    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u32, count).fill(value) };
                }
                Ok(())
            }
            Work::Checksum { ptr, count, out } => {
                let reg = REGISTRY.read();
                let bytes = count.checked_mul(4).ok_or(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)? as u64;
                let input_ok = count == 0 || (ptr % 4 == 0 && reg.device_range(ptr, bytes).is_some());
                if !input_ok || out % 8 != 0 || reg.device_range(out, 8).is_none() {
                    return Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
                }
                let sum = if count == 0 {
                    0
                } else {
                    // SAFETY: as for fill, read-only.
                    let data = unsafe { std::slice::from_raw_parts(ptr as *const u32, count) };
                    data.iter().fold(0u64, |acc, &v| acc.wrapping_add(v as u64))
                };
                // SAFETY: `out` is checked mapped device memory of 8 bytes, aligned.
                unsafe { (out as *mut u64).write(sum) };
                Ok(())
            }
        };
        if let Ok(d) = driver() {
            d.machine.add_busy(device, started.elapsed().as_nanos() as u64);
        }
        result
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_kernel(
    f: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    _shared_mem: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    default: DefaultStream,
) -> CuResult {
    driver()?;
    let k = kernel(f)?;
    if grid.contains(&0) || block.contains(&0) || block.iter().product::<c_uint>() > 1024 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if !extra.is_null() {
        // Packed parameter buffers (CU_LAUNCH_PARAM_BUFFER_POINTER) are not simulated.
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let work = match k.name {
        "simgpu_fill_u32" => {
            Work::Fill { ptr: param(params, 0)?, value: param(params, 1)?, count: param(params, 2)? }
        }
        "simgpu_checksum_u32" => {
            Work::Checksum { ptr: param(params, 0)?, count: param(params, 1)?, out: param(params, 2)? }
        }
        "simgpu_sleep_us" => Work::Sleep { us: param(params, 0)? },
        _ => Work::Noop,
    };
    debug_assert!(k.params <= 3);
    let s = stream::resolve(stream, default)?;
    let device = s.device;
    s.submit(Box::new(move || work.run(device)))
}
