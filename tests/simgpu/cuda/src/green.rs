//! Green contexts (CUDA 12.4+): a device's SMs as a resource that can be split into
//! groups, a descriptor of such a group, and a context limited to it.
//!
//! simgpu keeps the SM counts (a green context reports its own), but does not partition
//! execution: kernels of a green context run as any context's do (time-sliced with other
//! processes). What matters for memory is real: a green context is a context, so it takes
//! `SIMGPU_CONTEXT_OVERHEAD` (refused with `CUDA_ERROR_OUT_OF_MEMORY` when the device has
//! not that much free), counts in the process's usage and NVML's process list, and gives
//! it back at `cuGreenCtxDestroy`; the `CUcontext` of `cuCtxFromGreenCtx` can be made
//! current and allocated in like any context.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint};
use std::mem::size_of;
use std::sync::{Arc, LazyLock};

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUstream};
use parking_lot::Mutex;

use crate::context::{self, Context};
use crate::driver::{device_index, driver, multiprocessors};
use crate::ffi::{new_handle, read_in, write_out, CUresult, CuResult};

/// `CU_DEV_RESOURCE_TYPE_SM`.
const RESOURCE_SM: u32 = 1;
/// `CU_GREEN_CTX_DEFAULT_STREAM`, which cuGreenCtxCreate requires.
const GREEN_CTX_DEFAULT_STREAM: c_uint = 1;
/// `CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING` and `_MAX_POTENTIAL_CLUSTER_SIZE`.
const SPLIT_IGNORE_COSCHEDULING: c_uint = 1;
const SPLIT_FLAGS: c_uint = 3;
/// `CU_STREAM_NON_BLOCKING`, which cuGreenCtxStreamCreate requires.
const STREAM_NON_BLOCKING: c_uint = 1;

/// `CUdevResource` (CUDA 12.4 to 12.9), with its type read as a raw integer and the SM
/// member of its union.
#[repr(C)]
#[derive(Clone, Copy)]
struct ResourceRaw {
    kind: u32,
    _internal_padding: [u8; 92],
    sm_count: u32,
    _rest: [u8; 44],
}

const _: () = assert!(size_of::<ResourceRaw>() == size_of::<sys::CUdevResource>());

impl ResourceRaw {
    fn sm(sm_count: u32) -> ResourceRaw {
        ResourceRaw { kind: RESOURCE_SM, _internal_padding: [0; 92], sm_count, _rest: [0; 44] }
    }
}

/// A green context: its context and the SMs it was given.
struct Green {
    ctx: Arc<Context>,
    sm_count: u32,
}

/// Descriptors (`CUdevResourceDesc`) by handle: the SMs they describe. The driver has no
/// call to free one; they live as long as the process.
static DESCS: LazyLock<Mutex<HashMap<usize, u32>>> = LazyLock::new(Default::default);
/// Green contexts (`CUgreenCtx`) by handle.
static GREENS: LazyLock<Mutex<HashMap<usize, Green>>> = LazyLock::new(Default::default);

fn green(handle: usize) -> CuResult<(Arc<Context>, u32)> {
    GREENS.lock().get(&handle).map(|g| (g.ctx.clone(), g.sm_count)).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

fn write_sm(out: *mut sys::CUdevResource, kind: c_uint, sm_count: u32) -> CuResult {
    if kind != RESOURCE_SM {
        return Err(CUresult::CUDA_ERROR_INVALID_RESOURCE_TYPE);
    }
    write_out(out.cast::<ResourceRaw>(), ResourceRaw::sm(sm_count))
}

/// `cuDeviceGetDevResource`: all of the device's SMs.
pub(crate) fn device_get_dev_resource(dev: CUdevice, out: *mut sys::CUdevResource, kind: c_uint) -> CuResult {
    driver()?;
    let device = device_index(dev)?;
    write_sm(out, kind, multiprocessors(device))
}

/// `cuCtxGetDevResource`: a green context's SMs, or all of the device's for another.
pub(crate) fn ctx_get_dev_resource(
    handle: CUcontext,
    out: *mut sys::CUdevResource,
    kind: c_uint,
) -> CuResult {
    let ctx = context::lookup(handle as usize)?;
    let own = GREENS.lock().values().find(|g| Arc::ptr_eq(&g.ctx, &ctx)).map(|g| g.sm_count);
    write_sm(out, kind, own.unwrap_or_else(|| multiprocessors(ctx.device)))
}

/// `cuGreenCtxGetDevResource`.
pub(crate) fn green_ctx_get_dev_resource(
    handle: usize,
    out: *mut sys::CUdevResource,
    kind: c_uint,
) -> CuResult {
    let (_, sm_count) = green(handle)?;
    write_sm(out, kind, sm_count)
}

/// `cuDevSmResourceSplitByCount`: as many groups of `minCount` SMs as asked for and fit,
/// rounded as on a compute capability 9.0 device (at least 8 and a multiple of 8, or of 2
/// with `IGNORE_SM_COSCHEDULING`). With `result` null, only says how many groups fit.
pub(crate) fn sm_resource_split_by_count(
    result: *mut sys::CUdevResource,
    groups: *mut c_uint,
    input: *const sys::CUdevResource,
    remaining: *mut sys::CUdevResource,
    flags: c_uint,
    min_count: c_uint,
) -> CuResult {
    driver()?;
    let input = read_in(input.cast::<ResourceRaw>())?;
    if input.kind != RESOURCE_SM {
        return Err(CUresult::CUDA_ERROR_INVALID_RESOURCE_TYPE);
    }
    if flags & !SPLIT_FLAGS != 0 || groups.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let step = if flags & SPLIT_IGNORE_COSCHEDULING != 0 { 2 } else { 8 };
    let count = min_count.max(1).div_ceil(step) * step;
    let fit = input.sm_count / count;
    let made = if result.is_null() {
        fit
    } else {
        let wanted = read_in(groups.cast_const())?;
        let made = wanted.min(fit);
        for i in 0..made as usize {
            // SAFETY: the caller's array has `wanted` entries and i < made <= wanted.
            write_out(unsafe { result.cast::<ResourceRaw>().add(i) }, ResourceRaw::sm(count))?;
        }
        made
    };
    write_out(groups, made)?;
    if !remaining.is_null() {
        write_out(remaining.cast::<ResourceRaw>(), ResourceRaw::sm(input.sm_count - made * count))?;
    }
    Ok(())
}

/// `cuDevResourceGenerateDesc`: a descriptor of the SMs of `resources`.
pub(crate) fn resource_generate_desc(
    out: *mut sys::CUdevResourceDesc,
    resources: *const sys::CUdevResource,
    count: c_uint,
) -> CuResult {
    driver()?;
    if out.is_null() || resources.is_null() || count == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut sm_count = 0u32;
    for i in 0..count as usize {
        // SAFETY: the caller passes an array of `count` resources.
        let r = read_in(unsafe { resources.cast::<ResourceRaw>().add(i) })?;
        if r.kind != RESOURCE_SM {
            return Err(CUresult::CUDA_ERROR_INVALID_RESOURCE_TYPE);
        }
        sm_count = sm_count.saturating_add(r.sm_count);
    }
    if sm_count == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
    }
    let handle = new_handle();
    DESCS.lock().insert(handle, sm_count);
    write_out(out, handle as sys::CUdevResourceDesc)
}

/// `cuGreenCtxCreate`: a context on `dev` with the SMs of `desc`, not made current. It
/// takes device memory as any context (`CUDA_ERROR_OUT_OF_MEMORY` when it does not fit).
pub(crate) fn green_ctx_create(
    out: *mut sys::CUgreenCtx,
    desc: usize,
    dev: CUdevice,
    flags: c_uint,
) -> CuResult {
    driver()?;
    let device = device_index(dev)?;
    if out.is_null() || flags != GREEN_CTX_DEFAULT_STREAM {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let sm_count = DESCS.lock().get(&desc).copied().ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if sm_count > multiprocessors(device) {
        return Err(CUresult::CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
    }
    let ctx = context::create_green(device)?;
    let handle = new_handle();
    GREENS.lock().insert(handle, Green { ctx, sm_count });
    write_out(out, handle as sys::CUgreenCtx)
}

/// `cuGreenCtxDestroy`: destroys the green context and its context, giving its memory back.
pub(crate) fn green_ctx_destroy(handle: usize) -> CuResult {
    driver()?;
    let g = GREENS.lock().remove(&handle).ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    context::destroy_green(&g.ctx);
    Ok(())
}

/// `cuCtxFromGreenCtx`: the green context's `CUcontext`.
pub(crate) fn ctx_from_green_ctx(out: *mut CUcontext, handle: usize) -> CuResult {
    driver()?;
    let (ctx, _) = green(handle)?;
    write_out(out, ctx.handle() as CUcontext)
}

/// `cuGreenCtxStreamCreate`: a stream of the green context (flags must be
/// `CU_STREAM_NON_BLOCKING`).
pub(crate) fn green_ctx_stream_create(
    out: *mut CUstream,
    handle: usize,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    driver()?;
    let (ctx, _) = green(handle)?;
    if flags != STREAM_NON_BLOCKING {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    crate::stream::stream_create_in(&ctx, out, flags, priority)
}
