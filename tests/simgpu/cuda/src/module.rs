//! Modules, libraries and launches. Any image loads (simgpu does not compile PTX or run
//! cubins); every module and every library (`cuLibraryLoadData`, the context-independent
//! loading of CUDA 12) offers the built-in kernels, which run on their stream's worker
//! like GPU kernels. Other names are `CUDA_ERROR_NOT_FOUND`:
//!
//! | kernel | parameters (C types) | effect |
//! | --- | --- | --- |
//! | `simgpu_noop` | none | nothing |
//! | `simgpu_fill_u32` | `unsigned int *ptr, unsigned int value, size_t count` | `ptr[0..count] = value` |
//! | `simgpu_checksum_u32` | `const unsigned int *ptr, size_t count, unsigned long long *out` | `*out = ` wrapping sum of `ptr[0..count]` |
//! | `simgpu_sleep_us` | `unsigned long long us` | keeps the stream (and the device's utilization) busy for `us` microseconds of device time |
//!
//! Kernels of different processes share each device by time-slicing
//! (`simgpu_state::sched`): fill, checksum and sleep kernels run only while their process
//! owns the device; `simgpu_noop` takes no device time and does not wait for it.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::LazyLock;
use std::time::Duration;

use cudarc::driver::sys::{CUdevice, CUfunction, CUkernel, CUlaunchConfig, CUlibrary, CUmodule, CUstream};
use parking_lot::Mutex;

use crate::context;
use crate::driver::{device_index, driver};
use crate::ffi::{new_handle, read_in, read_str, write_out, CUresult, CuResult};
use crate::graph::NodeType;
use crate::memory::REGISTRY;
use crate::stream::{self, DefaultStream};

/// A built-in kernel: its name and how many parameters it takes. Its address is both
/// its `CUfunction` and its `CUkernel`, which CUDA 12 lets callers pass to
/// `cuLaunchKernel` in place of a function.
pub(crate) struct Kernel {
    name: &'static CStr,
    params: usize,
}

static KERNELS: [Kernel; 4] = [
    Kernel { name: c"simgpu_noop", params: 0 },
    Kernel { name: c"simgpu_fill_u32", params: 3 },
    Kernel { name: c"simgpu_checksum_u32", params: 3 },
    Kernel { name: c"simgpu_sleep_us", params: 1 },
];

/// Device memory a loaded module holds (`SIMGPU_MODULE_BYTES`): its code and globals in
/// one context.
#[derive(Debug, Clone, Copy)]
struct Charge {
    device: usize,
    ctx: usize,
    bytes: u64,
}

impl Charge {
    /// Takes a module's memory on the device of `ctx`.
    fn take(ctx: &context::Context) -> CuResult<Charge> {
        let d = driver()?;
        let bytes = d.module_bytes;
        if bytes > 0 {
            d.slot.charge(ctx.device, bytes).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        }
        Ok(Charge { device: ctx.device, ctx: ctx.handle(), bytes })
    }

    fn give_back(self) {
        if let Ok(d) = driver() {
            d.slot.release(self.device, self.bytes);
        }
    }
}

/// Loaded modules by handle, with what each holds; a library's module holds nothing of
/// its own (its library does).
static MODULES: LazyLock<Mutex<HashMap<usize, Option<Charge>>>> = LazyLock::new(Default::default);

/// A library (`cuLibraryLoad*`): the module `cuLibraryGetModule` answers, and its memory
/// once it is loaded into a context (`None` until then, and again after that context is
/// destroyed).
struct Library {
    module: usize,
    charge: Option<Charge>,
}

/// Loaded libraries by handle.
static LIBRARIES: LazyLock<Mutex<HashMap<usize, Library>>> = LazyLock::new(Default::default);

fn find_kernel(name: *const c_char) -> CuResult<&'static Kernel> {
    let name = read_str(name)?;
    KERNELS.iter().find(|k| k.name.to_bytes() == name.as_bytes()).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)
}

fn as_function(k: &'static Kernel) -> CUfunction {
    std::ptr::from_ref(k).cast_mut().cast()
}

/// `cuModuleLoadData`, `cuModuleLoadDataEx` and `cuModuleLoadFatBinary`: any image loads
/// into the current context and takes `SIMGPU_MODULE_BYTES` of its device.
pub(crate) fn module_load_data(out: *mut CUmodule, image: *const c_void) -> CuResult {
    let ctx = context::current()?;
    if out.is_null() || image.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    new_module(out, &ctx)
}

/// `cuModuleLoad`: the file must exist and be readable; its contents are not interpreted.
pub(crate) fn module_load(out: *mut CUmodule, path: *const c_char) -> CuResult {
    let ctx = context::current()?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    std::fs::File::open(read_str(path)?).map_err(|_| CUresult::CUDA_ERROR_FILE_NOT_FOUND)?;
    new_module(out, &ctx)
}

fn new_module(out: *mut CUmodule, ctx: &context::Context) -> CuResult {
    let charge = Charge::take(ctx)?;
    let handle = new_handle();
    MODULES.lock().insert(handle, Some(charge));
    if let Err(e) = write_out(out, handle as CUmodule) {
        MODULES.lock().remove(&handle);
        charge.give_back();
        return Err(e);
    }
    Ok(())
}

pub(crate) fn module_unload(module: CUmodule) -> CuResult {
    driver()?;
    let handle = module as usize;
    // A library's module goes with its library (`cuLibraryUnload`).
    let mut modules = MODULES.lock();
    match modules.get(&handle) {
        Some(Some(_)) => {}
        _ => return Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
    }
    if let Some(Some(charge)) = modules.remove(&handle) {
        charge.give_back();
    }
    Ok(())
}

/// Unloads the modules of a destroyed context, as the driver does, and gives back what
/// libraries held in it: they are loaded again when next used in a context.
pub(crate) fn context_destroyed(ctx: usize) {
    let mut modules = MODULES.lock();
    let gone: Vec<usize> =
        modules.iter().filter(|(_, c)| c.is_some_and(|c| c.ctx == ctx)).map(|(&h, _)| h).collect();
    for handle in gone {
        if let Some(Some(charge)) = modules.remove(&handle) {
            charge.give_back();
        }
    }
    drop(modules);
    for library in LIBRARIES.lock().values_mut() {
        if library.charge.is_some_and(|c| c.ctx == ctx) {
            if let Some(charge) = library.charge.take() {
                charge.give_back();
            }
        }
    }
}

pub(crate) fn module_get_function(out: *mut CUfunction, module: CUmodule, name: *const c_char) -> CuResult {
    driver()?;
    if !MODULES.lock().contains_key(&(module as usize)) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    write_out(out, as_function(find_kernel(name)?))
}

/// `cuModuleGetGlobal`: simgpu does not read images, so a module has no variables; a
/// loaded module answers `CUDA_ERROR_NOT_FOUND` for every name. (The CUDA runtime looks up
/// the variables a program registered when it sets a context up; it needs the entry point
/// and takes NOT_FOUND, as it does from `cuModuleGetFunction`.)
pub(crate) fn module_get_global(module: CUmodule, name: *const c_char) -> CuResult {
    driver()?;
    read_str(name)?;
    if !MODULES.lock().contains_key(&(module as usize)) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    Err(CUresult::CUDA_ERROR_NOT_FOUND)
}

/// `cuLibraryGetGlobal`: as [`module_get_global`], for a library.
pub(crate) fn library_get_global(handle: CUlibrary, name: *const c_char) -> CuResult {
    loaded(handle)?;
    read_str(name)?;
    Err(CUresult::CUDA_ERROR_NOT_FOUND)
}

/// `cuLibraryLoadData`: loads any image, like `cuModuleLoadData`, with or without a
/// context (see [`new_library`]).
pub(crate) fn library_load_data(out: *mut CUlibrary, image: *const c_void) -> CuResult {
    driver()?;
    if image.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    new_library(out)
}

/// `cuLibraryLoadFromFile`: the file must exist and be readable; its contents are not
/// interpreted.
pub(crate) fn library_load_from_file(out: *mut CUlibrary, path: *const c_char) -> CuResult {
    driver()?;
    std::fs::File::open(read_str(path)?).map_err(|_| CUresult::CUDA_ERROR_FILE_NOT_FOUND)?;
    new_library(out)
}

/// A new library. With a current context it is loaded into it at once and takes
/// `SIMGPU_MODULE_BYTES` there (`CUDA_ERROR_OUT_OF_MEMORY` if that does not fit); without
/// one (CUDA 12's context-independent loading) it takes its memory when first used in a
/// context ([`loaded`]).
fn new_library(out: *mut CUlibrary) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let charge = match context::current() {
        Ok(ctx) => Some(Charge::take(&ctx)?),
        Err(_) => None,
    };
    let (library, module) = (new_handle(), new_handle());
    MODULES.lock().insert(module, None);
    LIBRARIES.lock().insert(library, Library { module, charge });
    write_out(out, library as CUlibrary)
}

pub(crate) fn library_unload(library: CUlibrary) -> CuResult {
    driver()?;
    let lib = LIBRARIES.lock().remove(&(library as usize)).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    MODULES.lock().remove(&lib.module);
    if let Some(charge) = lib.charge {
        charge.give_back();
    }
    Ok(())
}

/// The module of a loaded library.
fn library(handle: CUlibrary) -> CuResult<usize> {
    driver()?;
    LIBRARIES.lock().get(&(handle as usize)).map(|l| l.module).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// The module of a library being used: a library not yet loaded into a context is
/// loaded into the current one, if any, and takes its memory there.
fn loaded(handle: CUlibrary) -> CuResult<usize> {
    driver()?;
    let current = context::current().ok();
    let mut libraries = LIBRARIES.lock();
    let lib = libraries.get_mut(&(handle as usize)).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    if let (None, Some(ctx)) = (lib.charge, current) {
        lib.charge = Some(Charge::take(&ctx)?);
    }
    Ok(lib.module)
}

pub(crate) fn library_get_kernel(out: *mut CUkernel, handle: CUlibrary, name: *const c_char) -> CuResult {
    loaded(handle)?;
    write_out(out, as_function(find_kernel(name)?).cast())
}

/// `cuLibraryGetModule`: the library's module in the current context.
pub(crate) fn library_get_module(out: *mut CUmodule, handle: CUlibrary) -> CuResult {
    context::current()?;
    let module = loaded(handle)?;
    write_out(out, module as CUmodule)
}

pub(crate) fn library_get_kernel_count(count: *mut c_uint, handle: CUlibrary) -> CuResult {
    library(handle)?;
    write_out(count, KERNELS.len() as c_uint)
}

/// `cuLibraryEnumerateKernels`: the built-in kernels, as many as `room` allows.
pub(crate) fn library_enumerate_kernels(out: *mut CUkernel, room: c_uint, handle: CUlibrary) -> CuResult {
    library(handle)?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    for (i, k) in KERNELS.iter().take(room as usize).enumerate() {
        // SAFETY: the caller provides `room` writable CUkernel slots; i < room.
        write_out(unsafe { out.add(i) }, as_function(k).cast())?;
    }
    Ok(())
}

/// `cuKernelGetFunction`: a kernel is its own function in every context.
pub(crate) fn kernel_get_function(out: *mut CUfunction, k: CUkernel) -> CuResult {
    driver()?;
    context::current()?;
    write_out(out, as_function(kernel(k.cast())?))
}

/// `cuKernelGetName` and `cuFuncGetName`.
pub(crate) fn kernel_get_name(out: *mut *const c_char, f: CUfunction) -> CuResult {
    driver()?;
    write_out(out, kernel(f)?.name.as_ptr())
}

/// `cuFuncGetAttribute` and `cuKernelGetAttribute`: the attributes of a small kernel
/// compiled for compute capability 9.0 (`CUfunction_attribute` values).
pub(crate) fn func_get_attribute(out: *mut c_int, attribute: c_int, f: CUfunction) -> CuResult {
    driver()?;
    kernel(f)?;
    let value = match attribute {
        0 => 1024,    // MAX_THREADS_PER_BLOCK
        1..=3 => 0,   // SHARED, CONST and LOCAL sizes
        4 => 16,      // NUM_REGS
        5 | 6 => 90,  // PTX_VERSION, BINARY_VERSION
        7 => 0,       // CACHE_MODE_CA
        8 => 49_152,  // MAX_DYNAMIC_SHARED_SIZE_BYTES
        9 => -1,      // PREFERRED_SHARED_MEMORY_CARVEOUT: no preference
        10..=15 => 0, // cluster attributes: none required
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    write_out(out, value)
}

/// `cuKernelGetAttribute`: as `cuFuncGetAttribute`, on any valid device.
pub(crate) fn kernel_get_attribute(
    out: *mut c_int,
    attribute: c_int,
    k: CUkernel,
    device: CUdevice,
) -> CuResult {
    device_index(device)?;
    func_get_attribute(out, attribute, k.cast())
}

/// `cuLaunchKernelEx`: as `cuLaunchKernel` with the dimensions, shared memory and stream
/// of `config`; its launch attributes (clusters, priorities, ...) change nothing here.
pub(crate) fn launch_kernel_ex(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    default: DefaultStream,
) -> CuResult {
    let c = read_in(config)?;
    launch_kernel(
        f,
        [c.gridDimX, c.gridDimY, c.gridDimZ],
        [c.blockDimX, c.blockDimY, c.blockDimZ],
        c.sharedMemBytes,
        c.hStream,
        params,
        extra,
        default,
    )
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
#[derive(Clone, Copy)]
enum Work {
    Noop,
    Fill { ptr: u64, value: u32, count: usize },
    Checksum { ptr: u64, count: usize, out: u64 },
    Sleep { us: u64 },
}

impl Work {
    /// Runs the kernel on `device`: `simgpu_noop` at once (it takes no device time); the
    /// others only while this process owns the device (see `simgpu_state::sched`).
    fn run(self, device: usize) -> CuResult {
        let Some(sched) = driver().ok().map(|d| &d.sched) else {
            return self.run_now();
        };
        match self {
            Work::Noop => Ok(()),
            Work::Sleep { us } => {
                sched.run_for(device, Duration::from_micros(us));
                Ok(())
            }
            cpu_work => sched.run(device, || cpu_work.run_now()),
        }
    }

    /// Does the kernel's work in this thread now.
    fn run_now(self) -> CuResult {
        match self {
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
        }
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
    let work = match k.name.to_str().unwrap_or_default() {
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
    match work {
        // No device time: as cheap as a launch can be (launch-overhead benchmarks).
        Work::Noop => s.enqueue(NodeType::Kernel, std::sync::Arc::new(|| Ok(())), false),
        work => s.enqueue(NodeType::Kernel, std::sync::Arc::new(move || work.run(device)), true),
    }
}
