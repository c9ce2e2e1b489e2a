//! CUDA arrays (`cuArrayCreate`, `cuArray3DCreate`, mipmapped arrays). simgpu keeps no
//! texels — no texture path reads them — but charges their real size to the device, over
//! every mip level, for every `CUarray_format` of CUDA 12.8: width × height × depth ×
//! element size × channels for the plain formats, the named texel size for normalized and
//! packed ones, 8 or 16 bytes per 4×4 block for BC1..BC7, luma plus subsampled chroma
//! planes for planar YUV. It computes this itself, as the driver does; `cuda_sizes`
//! (what the shim charges) is checked against it in the tests below.

use std::collections::HashMap;
use std::mem::size_of;
use std::sync::LazyLock;

use cudarc::driver::sys::{self, CUarray, CUmipmappedArray};
use parking_lot::Mutex;

use crate::context;
use crate::driver::driver;
use crate::ffi::{new_handle, read_in, write_out, CUresult, CuResult};
use crate::memory::{round_up, ALLOC_ALIGN};

use gpufrac_common::cuda_sizes::{
    Array3DDescriptor as Array3DDescRaw, Array3DDescriptorV1, ArrayDescriptor as ArrayDescRaw,
    ArrayDescriptorV1,
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

/// What one texel site of a format takes, as the driver stores it.
enum Texels {
    /// `bytes` per channel, times `NumChannels` (1, 2 or 4).
    Channels(u64),
    /// `bytes` per texel: the format names its channels.
    Fixed(u64),
    /// `bytes` per 4×4 block (block compression).
    Blocks(u64),
    /// YUV: a luma plane of `sample`-byte samples and U and V subsampled by `sub_x` × `sub_y`.
    Yuv { sample: u64, sub_x: u64, sub_y: u64 },
}

/// Every `CUarray_format` of CUDA 12.8 and how it stores texels; `None` for others.
fn texels(format: u32) -> Option<Texels> {
    use sys::CUarray_format as F;
    use Texels::{Blocks, Channels, Fixed, Yuv};
    const fn f(x: F) -> u32 {
        x as u32
    }
    let yuv = |sample, sub_x, sub_y| Yuv { sample, sub_x, sub_y };
    Some(match format {
        x if x == f(F::CU_AD_FORMAT_UNSIGNED_INT8) || x == f(F::CU_AD_FORMAT_SIGNED_INT8) => Channels(1),
        x if x == f(F::CU_AD_FORMAT_UNSIGNED_INT16)
            || x == f(F::CU_AD_FORMAT_SIGNED_INT16)
            || x == f(F::CU_AD_FORMAT_HALF) =>
        {
            Channels(2)
        }
        x if x == f(F::CU_AD_FORMAT_UNSIGNED_INT32)
            || x == f(F::CU_AD_FORMAT_SIGNED_INT32)
            || x == f(F::CU_AD_FORMAT_FLOAT) =>
        {
            Channels(4)
        }
        x if x == f(F::CU_AD_FORMAT_UNORM_INT8X1) || x == f(F::CU_AD_FORMAT_SNORM_INT8X1) => Fixed(1),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT8X2) || x == f(F::CU_AD_FORMAT_SNORM_INT8X2) => Fixed(2),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT8X4) || x == f(F::CU_AD_FORMAT_SNORM_INT8X4) => Fixed(4),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT16X1) || x == f(F::CU_AD_FORMAT_SNORM_INT16X1) => Fixed(2),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT16X2) || x == f(F::CU_AD_FORMAT_SNORM_INT16X2) => Fixed(4),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT16X4) || x == f(F::CU_AD_FORMAT_SNORM_INT16X4) => Fixed(8),
        x if x == f(F::CU_AD_FORMAT_UNORM_INT_101010_2) => Fixed(4),
        x if x == f(F::CU_AD_FORMAT_YUY2) => Fixed(2),
        x if x == f(F::CU_AD_FORMAT_Y210)
            || x == f(F::CU_AD_FORMAT_Y216)
            || x == f(F::CU_AD_FORMAT_AYUV)
            || x == f(F::CU_AD_FORMAT_Y410) =>
        {
            Fixed(4)
        }
        x if x == f(F::CU_AD_FORMAT_Y416) => Fixed(8),
        x if [
            F::CU_AD_FORMAT_BC1_UNORM,
            F::CU_AD_FORMAT_BC1_UNORM_SRGB,
            F::CU_AD_FORMAT_BC4_UNORM,
            F::CU_AD_FORMAT_BC4_SNORM,
        ]
        .iter()
        .any(|&b| x == f(b)) =>
        {
            Blocks(8)
        }
        x if [
            F::CU_AD_FORMAT_BC2_UNORM,
            F::CU_AD_FORMAT_BC2_UNORM_SRGB,
            F::CU_AD_FORMAT_BC3_UNORM,
            F::CU_AD_FORMAT_BC3_UNORM_SRGB,
            F::CU_AD_FORMAT_BC5_UNORM,
            F::CU_AD_FORMAT_BC5_SNORM,
            F::CU_AD_FORMAT_BC6H_UF16,
            F::CU_AD_FORMAT_BC6H_SF16,
            F::CU_AD_FORMAT_BC7_UNORM,
            F::CU_AD_FORMAT_BC7_UNORM_SRGB,
        ]
        .iter()
        .any(|&b| x == f(b)) =>
        {
            Blocks(16)
        }
        x if x == f(F::CU_AD_FORMAT_NV12) => yuv(1, 2, 2),
        x if x == f(F::CU_AD_FORMAT_P010) || x == f(F::CU_AD_FORMAT_P016) => yuv(2, 2, 2),
        x if x == f(F::CU_AD_FORMAT_NV16) => yuv(1, 2, 1),
        x if x == f(F::CU_AD_FORMAT_P210) || x == f(F::CU_AD_FORMAT_P216) => yuv(2, 2, 1),
        x if x == f(F::CU_AD_FORMAT_Y444_PLANAR8) || x == f(F::CU_AD_FORMAT_YUV444_8bit_SemiPlanar) => {
            yuv(1, 1, 1)
        }
        x if x == f(F::CU_AD_FORMAT_Y444_PLANAR10) || x == f(F::CU_AD_FORMAT_YUV444_16bit_SemiPlanar) => {
            yuv(2, 1, 1)
        }
        _ => return None,
    })
}

/// Bytes of one level of `w × h × d` texels (0 height or depth: absent; depth counts
/// layers too), computed by simgpu itself as the driver it stands in for: unknown
/// formats are `CUDA_ERROR_NOT_SUPPORTED`, bad shapes `CUDA_ERROR_INVALID_VALUE`.
fn level_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32) -> CuResult<u64> {
    let layout = texels(format).ok_or(CUresult::CUDA_ERROR_NOT_SUPPORTED)?;
    let channels_ok = match layout {
        Texels::Channels(_) => matches!(channels, 1 | 2 | 4),
        // The format names its channels; the count passed is not what sizes it.
        _ => (1..=4).contains(&channels),
    };
    if w == 0 || !channels_ok {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (h, layers) = (h.max(1), d.max(1));
    let area = |x: u64, y: u64| x.checked_mul(y);
    let one = match layout {
        Texels::Channels(bytes) => area(w, h).and_then(|a| a.checked_mul(bytes * channels as u64)),
        Texels::Fixed(bytes) => area(w, h).and_then(|a| a.checked_mul(bytes)),
        Texels::Blocks(bytes) => area(w.div_ceil(4), h.div_ceil(4)).and_then(|a| a.checked_mul(bytes)),
        Texels::Yuv { sample, sub_x, sub_y } => {
            let luma = area(w, h).and_then(|a| a.checked_mul(sample));
            let chroma = area(w.div_ceil(sub_x), h.div_ceil(sub_y)).and_then(|a| a.checked_mul(2 * sample));
            luma.zip(chroma).and_then(|(l, c)| l.checked_add(c))
        }
    };
    one.and_then(|b| b.checked_mul(layers)).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// Bytes of a mipmapped array: every level, each halving every present dimension.
fn mipmapped_level_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32, levels: u32) -> CuResult<u64> {
    (0..levels).try_fold(0u64, |sum, level| {
        let shrink = |v: u64| if v == 0 { 0 } else { (v >> level).max(1) };
        let bytes = level_bytes(shrink(w), shrink(h), shrink(d), format, channels)?;
        sum.checked_add(bytes).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
    })
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
    let bytes = mipmapped_level_bytes(w, h, d, desc.format, desc.channels, levels)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use gpufrac_common::cuda_sizes;

    #[test]
    fn sizes_of_each_kind_of_format() {
        use sys::CUarray_format as F;
        let bytes = |w, h, d, f: F, c| level_bytes(w, h, d, f as u32, c);
        assert_eq!(bytes(1024, 512, 0, F::CU_AD_FORMAT_FLOAT, 1), Ok(2 << 20));
        assert_eq!(bytes(100, 10, 0, F::CU_AD_FORMAT_UNORM_INT16X4, 4), Ok(8000));
        assert_eq!(bytes(100, 10, 0, F::CU_AD_FORMAT_SNORM_INT8X1, 1), Ok(1000));
        assert_eq!(bytes(10, 10, 0, F::CU_AD_FORMAT_BC1_UNORM, 4), Ok(9 * 8));
        assert_eq!(bytes(10, 10, 0, F::CU_AD_FORMAT_BC7_UNORM_SRGB, 4), Ok(9 * 16));
        assert_eq!(bytes(1920, 1080, 0, F::CU_AD_FORMAT_NV12, 3), Ok(1920 * 1080 * 3 / 2));
        assert_eq!(bytes(64, 64, 0, F::CU_AD_FORMAT_P216, 3), Ok(64 * 64 * 4));
        assert_eq!(bytes(64, 64, 0, F::CU_AD_FORMAT_Y444_PLANAR10, 3), Ok(64 * 64 * 6));
        assert_eq!(bytes(64, 64, 0, F::CU_AD_FORMAT_Y416, 4), Ok(64 * 64 * 8));
        assert_eq!(bytes(64, 64, 0, F::CU_AD_FORMAT_UNORM_INT_101010_2, 1), Ok(64 * 64 * 4));
        assert_eq!(bytes(1, 1, 0, F::CU_AD_FORMAT_FLOAT, 3), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(bytes(0, 1, 0, F::CU_AD_FORMAT_NV12, 3), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(level_bytes(1, 1, 0, 0xa0, 1), Err(CUresult::CUDA_ERROR_NOT_SUPPORTED));
    }

    /// What the shim charges (`cuda_sizes`) is what simgpu, the driver, takes, for every
    /// format value and a spread of shapes and channel counts.
    #[test]
    fn the_shims_sizes_agree_with_the_driver_for_every_format() {
        let shapes = [
            (1, 0, 0),
            (5, 0, 0),
            (3, 3, 0),
            (10, 7, 0),
            (64, 64, 0),
            (1920, 1080, 0),
            (9, 5, 3),
            (16, 16, 6),
        ];
        let mut known = 0;
        for format in 0..=0x200u32 {
            for &(w, h, d) in &shapes {
                for channels in 0..=5 {
                    let driver = level_bytes(w, h, d, format, channels).ok();
                    let shim = cuda_sizes::array_bytes(w, h, d, format, channels);
                    assert_eq!(driver, shim, "format {format:#x}, {w}x{h}x{d}, {channels} channels");
                }
                let driver = mipmapped_level_bytes(w, h, d, format, 4, 5).ok();
                assert_eq!(
                    driver,
                    cuda_sizes::mipmapped_bytes(w, h, d, format, 4, 5),
                    "format {format:#x} mipmapped"
                );
            }
            known += usize::from(texels(format).is_some());
        }
        assert_eq!(known, 51, "the formats of CUDA 12.8");
    }
}
