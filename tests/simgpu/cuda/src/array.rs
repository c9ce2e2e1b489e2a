//! CUDA arrays (`cuArrayCreate`, `cuArray3DCreate`, mipmapped arrays). simgpu keeps no
//! texels — no texture path reads them — but charges their real size to the device:
//! width × height × depth × element size × channels, over every mip level.

use std::collections::HashMap;
use std::mem::size_of;
use std::sync::LazyLock;

use cudarc::driver::sys::{self, CUarray, CUmipmappedArray};
use parking_lot::Mutex;

use gpufrac_common::cuda_sizes;

use crate::context;
use crate::driver::driver;
use crate::ffi::{new_handle, read_in, write_out, CUresult, CuResult};
use crate::memory::{round_up, ALLOC_ALIGN};

use gpufrac_common::cuda_sizes::{
    Array3DDescriptor as Array3DDescRaw, Array3DDescriptorV1, ArrayDescriptor as ArrayDescRaw, ArrayDescriptorV1,
};

const _: () = assert!(size_of::<ArrayDescRaw>() == size_of::<sys::CUDA_ARRAY_DESCRIPTOR>());
const _: () = assert!(size_of::<Array3DDescRaw>() == size_of::<sys::CUDA_ARRAY3D_DESCRIPTOR>());

struct ArrayRecord {
    device: usize,
    ctx: usize,
    charged: u64,
    mipmapped: bool,
}

/// Live arrays by handle.
static ARRAYS: LazyLock<Mutex<HashMap<usize, ArrayRecord>>> = LazyLock::new(Default::default);

/// Bytes of one level; unknown formats are not simulated, bad shapes are invalid.
fn level_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32) -> CuResult<u64> {
    if cuda_sizes::array_format_bytes(format).is_none() {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    cuda_sizes::array_bytes(w, h, d, format, channels).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

fn create(bytes: u64, mipmapped: bool) -> CuResult<usize> {
    let ctx = context::current()?;
    let d = driver()?;
    let charged = round_up(bytes, ALLOC_ALIGN);
    d.slot.charge(ctx.device, charged).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    let handle = new_handle();
    let record = ArrayRecord { device: ctx.device, ctx: ctx.handle(), charged, mipmapped };
    ARRAYS.lock().insert(handle, record);
    Ok(handle)
}

fn destroy(handle: usize, mipmapped: bool) -> CuResult {
    driver()?;
    let mut arrays = ARRAYS.lock();
    match arrays.get(&handle) {
        Some(r) if r.mipmapped == mipmapped => {}
        _ => return Err(CUresult::CUDA_ERROR_INVALID_HANDLE),
    }
    if let Some(r) = arrays.remove(&handle) {
        if let Ok(d) = driver() {
            d.slot.release(r.device, r.charged);
        }
    }
    Ok(())
}

pub(crate) fn array_create(out: *mut CUarray, desc: *const sys::CUDA_ARRAY_DESCRIPTOR) -> CuResult {
    let desc: ArrayDescRaw = read_in(desc.cast())?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = level_bytes(desc.width as u64, desc.height as u64, 1, desc.format, desc.channels)?;
    write_out(out, create(bytes, false)? as CUarray)
}

pub(crate) fn array_3d_create(out: *mut CUarray, desc: *const sys::CUDA_ARRAY3D_DESCRIPTOR) -> CuResult {
    let desc: Array3DDescRaw = read_in(desc.cast())?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let bytes =
        level_bytes(desc.width as u64, desc.height as u64, desc.depth as u64, desc.format, desc.channels)?;
    write_out(out, create(bytes, false)? as CUarray)
}

/// `cuArrayCreate` of the pre-3.2 API: a descriptor of 32-bit sizes.
pub(crate) fn array_create_v1(out: *mut CUarray, desc: *const ArrayDescriptorV1) -> CuResult {
    let v1 = read_in(desc)?;
    let desc = ArrayDescRaw {
        width: v1.width as usize,
        height: v1.height as usize,
        format: v1.format,
        channels: v1.channels,
    };
    array_create(out, std::ptr::from_ref(&desc).cast())
}

/// `cuArray3DCreate` of the pre-3.2 API: a descriptor of 32-bit sizes.
pub(crate) fn array_3d_create_v1(out: *mut CUarray, desc: *const Array3DDescriptorV1) -> CuResult {
    let v1 = read_in(desc)?;
    let desc = Array3DDescRaw {
        width: v1.width as usize,
        height: v1.height as usize,
        depth: v1.depth as usize,
        format: v1.format,
        channels: v1.channels,
        flags: v1.flags,
    };
    array_3d_create(out, std::ptr::from_ref(&desc).cast())
}

pub(crate) fn array_destroy(handle: CUarray) -> CuResult {
    destroy(handle as usize, false)
}

pub(crate) fn mipmapped_array_create(
    out: *mut CUmipmappedArray,
    desc: *const sys::CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CuResult {
    let desc: Array3DDescRaw = read_in(desc.cast())?;
    if out.is_null() || levels == 0 || levels > 32 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (w, h, d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    level_bytes(w, h, d, desc.format, desc.channels)?;
    let bytes = cuda_sizes::mipmapped_bytes(w, h, d, desc.format, desc.channels, levels)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    write_out(out, create(bytes, true)? as CUmipmappedArray)
}

pub(crate) fn mipmapped_array_destroy(handle: CUmipmappedArray) -> CuResult {
    destroy(handle as usize, true)
}

/// `cuArrayGetMemoryRequirements` and the mipmapped form: the bytes the array takes on
/// the device, which is what simgpu charges for it.
pub(crate) fn memory_requirements(
    out: *mut sys::CUDA_ARRAY_MEMORY_REQUIREMENTS,
    handle: usize,
    device: sys::CUdevice,
    mipmapped: bool,
) -> CuResult {
    let index = crate::driver::device_index(device)?;
    let arrays = ARRAYS.lock();
    let r = arrays
        .get(&handle)
        .filter(|r| r.mipmapped == mipmapped && r.device == index)
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    let req = sys::CUDA_ARRAY_MEMORY_REQUIREMENTS {
        size: r.charged as usize,
        alignment: ALLOC_ALIGN as usize,
        reserved: [0; 4],
    };
    write_out(out, req)
}

/// Frees the arrays of a destroyed context.
pub(crate) fn free_all_of_context(ctx: usize) {
    let mut arrays = ARRAYS.lock();
    let gone: Vec<usize> = arrays.iter().filter(|(_, r)| r.ctx == ctx).map(|(&h, _)| h).collect();
    for h in gone {
        if let Some(r) = arrays.remove(&h) {
            if let Ok(d) = driver() {
                d.slot.release(r.device, r.charged);
            }
        }
    }
}
