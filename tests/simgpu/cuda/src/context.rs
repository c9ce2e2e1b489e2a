//! Contexts: primary and created ones, the per-thread current-context stack, and the
//! device memory each context takes (`SIMGPU_CONTEXT_OVERHEAD`, plus what its limits
//! take beyond their defaults: `cuCtxSetLimit`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};

use cudarc::driver::sys::{CUcontext, CUdevice};
use parking_lot::Mutex;

use crate::driver::{device_index, driver};
use crate::ffi::{write_out, CUresult, CuResult};
use crate::stream::{self, sticky_to_result, Stream};

/// One context on one device.
pub(crate) struct Context {
    pub device: usize,
    pub flags: AtomicU32,
    pub primary: bool,
    /// Made by `cuGreenCtxCreate`: destroyed only through `cuGreenCtxDestroy`.
    pub green: bool,
    pub null_stream: Arc<Stream>,
    pub sticky: Arc<AtomicU32>,
    handle: usize,
    alive: AtomicBool,
    /// Its `CUlimit` values and the device memory the context holds for itself.
    limits: Mutex<Limits>,
}

/// `CUlimit` values up to `CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED` (CUDA 12.8).
const LIMIT_COUNT: usize = 10;
const LIMIT_STACK_SIZE: usize = 0;
const LIMIT_PRINTF_FIFO_SIZE: usize = 1;
const LIMIT_MALLOC_HEAP_SIZE: usize = 2;

/// Each limit's value in a new context, as on a real GPU: 1 KiB of stack per thread, a
/// 1 MiB printf FIFO, an 8 MiB device heap; device-runtime sync depth 2 and 2048 pending
/// launches, 64-byte L2 fetch granularity; no persisting L2, shared memory or CIG settings.
const DEFAULT_LIMITS: [usize; LIMIT_COUNT] = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0, 0, 0, 0];

/// A context's limits and the device memory it holds for itself.
struct Limits {
    values: [usize; LIMIT_COUNT],
    /// Bytes charged to the device for the context: its overhead, adjusted by its limits.
    charged: u64,
}

/// Device memory the stack, printf FIFO and heap limits take on `device`: the stack is
/// per resident thread (the device's multiprocessors times the threads each can hold), the
/// FIFO and the heap are one buffer each. `None` if it does not fit in 64 bits.
fn limit_memory(values: &[usize; LIMIT_COUNT], device: usize) -> Option<u64> {
    let stack = (values[LIMIT_STACK_SIZE] as u64).checked_mul(crate::driver::resident_threads(device))?;
    stack
        .checked_add(values[LIMIT_PRINTF_FIFO_SIZE] as u64)?
        .checked_add(values[LIMIT_MALLOC_HEAP_SIZE] as u64)
}

/// What a context whose limits are `values` takes on `device`: `SIMGPU_CONTEXT_OVERHEAD`,
/// which includes the limits at their defaults (as a real context's memory does), plus
/// what the limits take beyond their defaults (minus what they take less), never below
/// zero. `None` if it does not fit in 64 bits.
fn context_memory(overhead: u64, values: &[usize; LIMIT_COUNT], device: usize) -> Option<u64> {
    let now = limit_memory(values, device)? as i128;
    let defaults = limit_memory(&DEFAULT_LIMITS, device)? as i128;
    u64::try_from((overhead as i128 + now - defaults).max(0)).ok()
}

impl Context {
    /// The handle callers hold (`CUcontext`).
    pub(crate) fn handle(&self) -> usize {
        self.handle
    }
}

static CONTEXTS: LazyLock<Mutex<HashMap<usize, Arc<Context>>>> = LazyLock::new(Default::default);

/// Per device: the primary context (if active), its retain count and its flags, and its
/// handle, the same whether active or not (0 until first asked for).
#[derive(Default)]
struct Primary {
    ctx: Option<Arc<Context>>,
    retains: u32,
    flags: c_uint,
    handle: usize,
}

impl Primary {
    fn handle(&mut self) -> usize {
        if self.handle == 0 {
            self.handle = crate::ffi::new_handle();
        }
        self.handle
    }
}

/// The handle of `device`'s primary context, without retaining it: the handle it has
/// while active and keeps across resets, as with the real driver. The CUDA runtime asks
/// for it through its private interface (`export_tables`), makes it current, and only
/// then retains the context.
pub(crate) fn primary_handle(device: CUdevice) -> CuResult<usize> {
    let index = device_index(device)?;
    Ok(PRIMARY.lock().entry(index).or_default().handle())
}

fn is_primary_handle(handle: usize) -> bool {
    PRIMARY.lock().values().any(|p| p.handle == handle)
}

static PRIMARY: LazyLock<Mutex<HashMap<usize, Primary>>> = LazyLock::new(Default::default);

thread_local! {
    static CURRENT: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's current-context stack. From a thread-local destructor at
/// thread exit (cuda-core releases its primary context so) the stack may already be
/// gone, where `LocalKey::with` would panic: the thread then has no current context,
/// `f` does not run, and the answer is `R::default()` (no context, nothing popped).
fn with_stack<R: Default>(f: impl FnOnce(&mut Vec<usize>) -> R) -> R {
    CURRENT.try_with(|c| f(&mut c.borrow_mut())).unwrap_or_default()
}

/// Returns the live context behind a handle.
pub(crate) fn lookup(handle: usize) -> CuResult<Arc<Context>> {
    CONTEXTS.lock().get(&handle).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
}

/// The calling thread's current context.
pub(crate) fn current() -> CuResult<Arc<Context>> {
    driver()?;
    let top = with_stack(|stack| stack.last().copied());
    match top {
        Some(handle) => lookup(handle),
        None => Err(CUresult::CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Creates a context; a primary context gets its device's handle (`primary`), another
/// context its own address.
fn create(device: usize, flags: c_uint, primary: Option<usize>) -> CuResult<Arc<Context>> {
    create_context(device, flags, primary, false)
}

/// Creates the context of a green context (`cuGreenCtxCreate`): it takes device memory as
/// any context does, and is not made current.
pub(crate) fn create_green(device: usize) -> CuResult<Arc<Context>> {
    create_context(device, 0, None, true)
}

/// Destroys the context of a green context (`cuGreenCtxDestroy`).
pub(crate) fn destroy_green(ctx: &Arc<Context>) {
    destroy(ctx);
}

fn create_context(
    device: usize,
    flags: c_uint,
    primary: Option<usize>,
    green: bool,
) -> CuResult<Arc<Context>> {
    let d = driver()?;
    d.slot.charge(device, d.context_overhead).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    d.slot.context_created(device);
    // The context's memory is taken; setting it up takes a while longer.
    if !d.context_create_time.is_zero() {
        std::thread::sleep(d.context_create_time);
    }
    let ctx = Arc::new_cyclic(|weak: &std::sync::Weak<Context>| {
        // The handle is the context's own address, known before it is built.
        let handle = primary.unwrap_or(weak.as_ptr() as usize);
        let sticky = Arc::new(AtomicU32::new(0));
        Context {
            device,
            flags: AtomicU32::new(flags),
            primary: primary.is_some(),
            green,
            null_stream: Stream::new(handle, device, sticky.clone(), 0, 0),
            sticky,
            handle,
            alive: AtomicBool::new(true),
            limits: Mutex::new(Limits { values: DEFAULT_LIMITS, charged: d.context_overhead }),
        }
    });
    CONTEXTS.lock().insert(ctx.handle, ctx.clone());
    Ok(ctx)
}

fn destroy(ctx: &Arc<Context>) {
    if !ctx.alive.swap(false, Ordering::AcqRel) {
        return;
    }
    // The CUDA runtime's state for this context goes first, while the context still works.
    crate::export_tables::context_destroyed(ctx.handle);
    // Let queued work finish before its memory disappears, as the real driver does.
    for s in stream::streams_of(ctx.handle) {
        let _ = s.synchronize();
    }
    let _ = ctx.null_stream.synchronize();
    CONTEXTS.lock().remove(&ctx.handle);
    stream::forget_streams_of(ctx.handle);
    crate::memory::free_all_of_context(ctx.handle);
    crate::ipc::context_destroyed(ctx.handle);
    crate::module::context_destroyed(ctx.handle);
    with_stack(|stack| stack.retain(|&h| h != ctx.handle));
    if let Ok(d) = driver() {
        d.slot.release(ctx.device, ctx.limits.lock().charged);
        d.slot.context_destroyed(ctx.device);
    }
    crate::graph::context_destroyed(ctx.device);
}

pub(crate) fn primary_retain(out: *mut CUcontext, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let mut table = PRIMARY.lock();
    let entry = table.entry(index).or_default();
    let ctx = match &entry.ctx {
        Some(ctx) => ctx.clone(),
        None => {
            let handle = entry.handle();
            let ctx = create(index, entry.flags, Some(handle))?;
            entry.ctx = Some(ctx.clone());
            ctx
        }
    };
    write_out(out, ctx.handle as CUcontext)?;
    entry.retains += 1;
    Ok(())
}

pub(crate) fn primary_release(device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let mut table = PRIMARY.lock();
    let entry = table.entry(index).or_default();
    if entry.retains == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    entry.retains -= 1;
    if entry.retains == 0 {
        if let Some(ctx) = entry.ctx.take() {
            destroy(&ctx);
        }
    }
    Ok(())
}

pub(crate) fn primary_reset(device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let mut table = PRIMARY.lock();
    let entry = table.entry(index).or_default();
    if let Some(ctx) = entry.ctx.take() {
        destroy(&ctx);
    }
    entry.retains = 0;
    Ok(())
}

pub(crate) fn primary_set_flags(device: CUdevice, flags: c_uint) -> CuResult {
    let index = device_index(device)?;
    if flags & !0x1f != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut table = PRIMARY.lock();
    let entry = table.entry(index).or_default();
    entry.flags = flags;
    if let Some(ctx) = &entry.ctx {
        ctx.flags.store(flags, Ordering::Relaxed);
    }
    Ok(())
}

pub(crate) fn primary_get_state(device: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CuResult {
    let index = device_index(device)?;
    let table = PRIMARY.lock();
    let (f, a) = table.get(&index).map_or((0, 0), |e| (e.flags, e.ctx.is_some() as c_int));
    write_out(flags, f)?;
    write_out(active, a)
}

/// `cuCtxCreate` (all versions): creates a context and pushes it on this thread.
pub(crate) fn ctx_create(out: *mut CUcontext, flags: c_uint, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = create(index, flags, None)?;
    write_out(out, ctx.handle as CUcontext)?;
    with_stack(|stack| stack.push(ctx.handle));
    Ok(())
}

pub(crate) fn ctx_destroy(handle: CUcontext) -> CuResult {
    let ctx = lookup(handle as usize)?;
    // A green context's CUcontext goes with cuGreenCtxDestroy.
    if ctx.primary || ctx.green {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    destroy(&ctx);
    Ok(())
}

pub(crate) fn ctx_get_current(out: *mut CUcontext) -> CuResult {
    driver()?;
    let top = with_stack(|stack| stack.last().copied()).unwrap_or(0);
    write_out(out, top as CUcontext)
}

pub(crate) fn ctx_set_current(handle: CUcontext) -> CuResult {
    driver()?;
    let raw = handle as usize;
    // An inactive primary context may be made current (the CUDA runtime does so before
    // it retains it); calls needing a context fail until it is retained.
    if raw != 0 && lookup(raw).is_err() && !is_primary_handle(raw) {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    with_stack(|stack| {
        stack.pop();
        if raw != 0 {
            stack.push(raw);
        }
    });
    Ok(())
}

pub(crate) fn ctx_push(handle: CUcontext) -> CuResult {
    let ctx = lookup(handle as usize)?;
    with_stack(|stack| stack.push(ctx.handle));
    Ok(())
}

pub(crate) fn ctx_pop(out: *mut CUcontext) -> CuResult {
    driver()?;
    let popped = with_stack(|stack| stack.pop()).ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
    if !out.is_null() {
        write_out(out, popped as CUcontext)?;
    }
    Ok(())
}

pub(crate) fn ctx_get_device(out: *mut CUdevice) -> CuResult {
    write_out(out, current()?.device as CUdevice)
}

pub(crate) fn ctx_get_flags(out: *mut c_uint) -> CuResult {
    write_out(out, current()?.flags.load(Ordering::Relaxed))
}

pub(crate) fn ctx_set_flags(flags: c_uint) -> CuResult {
    current()?.flags.store(flags, Ordering::Relaxed);
    Ok(())
}

pub(crate) fn ctx_get_api_version(handle: CUcontext, out: *mut c_uint) -> CuResult {
    if !handle.is_null() {
        lookup(handle as usize)?;
    } else {
        current()?;
    }
    write_out(out, 3020)
}

/// `cuCtxSynchronize`: waits for every stream of the current context.
pub(crate) fn ctx_synchronize() -> CuResult {
    let ctx = current()?;
    crate::graph::context_sync(ctx.handle)?;
    ctx.null_stream.synchronize()?;
    for s in stream::streams_of(ctx.handle) {
        s.synchronize()?;
    }
    crate::pool::trim_after_sync(ctx.device);
    sticky_to_result(ctx.sticky.load(Ordering::Acquire))
}

/// The index of a `CUlimit` simgpu knows: `CUDA_ERROR_UNSUPPORTED_LIMIT` for others.
fn limit_index(limit: c_int) -> CuResult<usize> {
    usize::try_from(limit).ok().filter(|&i| i < LIMIT_COUNT).ok_or(CUresult::CUDA_ERROR_UNSUPPORTED_LIMIT)
}

/// `cuCtxGetLimit`: the current context's value of `limit`.
pub(crate) fn ctx_get_limit(out: *mut usize, limit: c_int) -> CuResult {
    let ctx = current()?;
    let index = limit_index(limit)?;
    let value = ctx.limits.lock().values[index];
    write_out(out, value)
}

/// `cuCtxSetLimit`: sets `limit` of the current context. The stack, printf FIFO and heap
/// are device memory of the context: a larger value takes the difference from the device
/// (`CUDA_ERROR_OUT_OF_MEMORY`, nothing changed, when it does not fit), a smaller one
/// gives it back. Other limits take no memory.
pub(crate) fn ctx_set_limit(limit: c_int, value: usize) -> CuResult {
    let ctx = current()?;
    let index = limit_index(limit)?;
    let d = driver()?;
    let mut limits = ctx.limits.lock();
    let mut values = limits.values;
    values[index] = value;
    let wanted =
        context_memory(d.context_overhead, &values, ctx.device).ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    if wanted > limits.charged {
        d.slot.charge(ctx.device, wanted - limits.charged).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    } else {
        d.slot.release(ctx.device, limits.charged - wanted);
    }
    *limits = Limits { values, charged: wanted };
    Ok(())
}

/// Opaque pointer form of a context handle, for pointer attributes.
pub(crate) fn as_ptr(handle: usize) -> *mut c_void {
    handle as *mut c_void
}

/// The device of every live context of the process (one entry per context), for the
/// checkpoint, which takes them off the machine's books and puts them back.
pub(crate) fn devices_of_live_contexts() -> Vec<usize> {
    CONTEXTS.lock().values().map(|c| c.device).collect()
}
