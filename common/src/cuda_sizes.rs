//! Sizes the CUDA driver API implies: the bytes of CUDA arrays from their descriptors,
//! for every `CUarray_format` of CUDA 12.8 (`None` for a format it does not know, so that
//! a caller can refuse it rather than charge nothing).

/// `CUDA_ARRAY_DESCRIPTOR` with its format as a raw integer: a value from C that is not a
/// known enumerator must be refused, not be undefined behaviour.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height in elements (0: one-dimensional).
    pub height: usize,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element (1, 2 or 4).
    pub channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` with its format as a raw integer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Array3DDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height in elements (0: absent).
    pub height: usize,
    /// Depth in elements (0: absent).
    pub depth: usize,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element (1, 2 or 4).
    pub channels: u32,
    /// `CUDA_ARRAY3D_*` flags.
    pub flags: u32,
}

/// `CUDA_ARRAY_DESCRIPTOR_v1` of the pre-3.2 API (`cuArrayCreate`): 32-bit sizes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayDescriptorV1 {
    /// Width in elements.
    pub width: u32,
    /// Height in elements (0: one-dimensional).
    pub height: u32,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element.
    pub channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR_v1` of the pre-3.2 API (`cuArray3DCreate`): 32-bit sizes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Array3DDescriptorV1 {
    /// Width in elements.
    pub width: u32,
    /// Height in elements (0: absent).
    pub height: u32,
    /// Depth in elements (0: absent).
    pub depth: u32,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element.
    pub channels: u32,
    /// `CUDA_ARRAY3D_*` flags.
    pub flags: u32,
}

const _: () = assert!(std::mem::size_of::<ArrayDescriptorV1>() == 16);
const _: () = assert!(std::mem::size_of::<Array3DDescriptorV1>() == 24);

/// How a `CUarray_format` lays out its texels, which decides an array's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatLayout {
    /// Each channel takes this many bytes; a texel has `NumChannels` (1, 2 or 4) of them.
    PerChannel(u64),
    /// Each texel takes this many bytes whatever `NumChannels` says (normalized formats
    /// with their channel count in the name, packed YUV, `UNORM_INT_101010_2`).
    Texel(u64),
    /// Block-compressed: each 4×4 block of texels takes this many bytes (BC1..BC7).
    Block(u64),
    /// Planar or semi-planar YUV: a full-size luma plane and two chroma components
    /// subsampled by `chroma_x` across and `chroma_y` down, each sample `sample` bytes.
    Planar {
        /// Bytes of one sample (1 for 8-bit, 2 for 10- and 16-bit formats).
        sample: u64,
        /// Horizontal chroma subsampling (2 for 4:2:x, 1 for 4:4:4).
        chroma_x: u64,
        /// Vertical chroma subsampling (2 for 4:2:0, else 1).
        chroma_y: u64,
    },
}

/// The layout of every `CUarray_format` of CUDA 12.8 (`cuda.h`), `None` for a value that
/// is not one, so that a caller can refuse it.
pub fn array_format(format: u32) -> Option<FormatLayout> {
    use FormatLayout::{Block, PerChannel, Planar, Texel};
    Some(match format {
        0x01 | 0x08 => PerChannel(1),        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => PerChannel(2), // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => PerChannel(4), // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        0x50 => Texel(4),                    // UNORM_INT_101010_2
        // UNORM_INT8X1/X2/X4, UNORM_INT16X1/X2/X4, and the SNORM ones.
        0xc0 | 0xc6 => Texel(1),
        0xc1 | 0xc7 | 0xc3 | 0xc9 => Texel(2),
        0xc2 | 0xc8 | 0xc4 | 0xca => Texel(4),
        0xc5 | 0xcb => Texel(8),
        // BC1 (and sRGB) and BC4 (UNORM, SNORM): 8-byte blocks; BC2, BC3, BC5, BC6H and
        // BC7: 16-byte blocks.
        0x91 | 0x92 | 0x97 | 0x98 => Block(8),
        0x93..=0x96 | 0x99..=0x9e => Block(16),
        0xb0 => Planar { sample: 1, chroma_x: 2, chroma_y: 2 }, // NV12
        0x9f | 0xa1 => Planar { sample: 2, chroma_x: 2, chroma_y: 2 }, // P010, P016
        0xa2 => Planar { sample: 1, chroma_x: 2, chroma_y: 1 }, // NV16
        0xa3 | 0xa4 => Planar { sample: 2, chroma_x: 2, chroma_y: 1 }, // P210, P216
        0xb2 | 0xb4 => Planar { sample: 1, chroma_x: 1, chroma_y: 1 }, // Y444_PLANAR8, YUV444_8bit_SemiPlanar
        0xb3 | 0xb5 => Planar { sample: 2, chroma_x: 1, chroma_y: 1 }, // Y444_PLANAR10, YUV444_16bit_SemiPlanar
        0xa5 => Texel(2),                                              // YUY2
        0xa6..=0xa9 => Texel(4),                                       // Y210, Y216, AYUV, Y410
        0xb1 => Texel(8),                                              // Y416
        _ => return None,
    })
}

/// Bytes per element of a `CUarray_format` whose element size does not depend on the
/// array's shape (`NumChannels` aside): per-channel and per-texel formats. `None` for
/// block-compressed and planar formats and for unknown values.
pub fn array_format_bytes(format: u32) -> Option<u64> {
    match array_format(format)? {
        FormatLayout::PerChannel(bytes) | FormatLayout::Texel(bytes) => Some(bytes),
        FormatLayout::Block(_) | FormatLayout::Planar { .. } => None,
    }
}

/// Bytes of an array level of `width × height × depth` texels (0 height or depth: the
/// dimension is absent; depth counts layers too) in `format`, or `None` for an invalid
/// shape or an unknown format. `channels` must be 1, 2 or 4 for per-channel formats; the
/// others carry their channels in the format and accept 1 to 4.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32) -> Option<u64> {
    let layout = array_format(format)?;
    let per_channel = matches!(layout, FormatLayout::PerChannel(_));
    if width == 0 || (per_channel && ![1, 2, 4].contains(&channels)) || !(1..=4).contains(&channels) {
        return None;
    }
    let (h, d) = (height.max(1), depth.max(1));
    let plane = match layout {
        FormatLayout::PerChannel(bytes) => width.checked_mul(h)?.checked_mul(bytes * channels as u64)?,
        FormatLayout::Texel(bytes) => width.checked_mul(h)?.checked_mul(bytes)?,
        FormatLayout::Block(bytes) => width.div_ceil(4).checked_mul(h.div_ceil(4))?.checked_mul(bytes)?,
        FormatLayout::Planar { sample, chroma_x, chroma_y } => {
            let luma = width.checked_mul(h)?.checked_mul(sample)?;
            let chroma =
                width.div_ceil(chroma_x).checked_mul(h.div_ceil(chroma_y))?.checked_mul(2 * sample)?;
            luma.checked_add(chroma)?
        }
    };
    plane.checked_mul(d)
}

/// Bytes of a mipmapped array of `levels` levels, each halving every present dimension.
pub fn mipmapped_bytes(
    width: u64,
    height: u64,
    depth: u64,
    format: u32,
    channels: u32,
    levels: u32,
) -> Option<u64> {
    if levels == 0 || levels > 32 {
        return None;
    }
    (0..levels).try_fold(0u64, |sum, level| {
        let shrink = |v: u64| if v == 0 { 0 } else { (v >> level).max(1) };
        sum.checked_add(array_bytes(shrink(width), shrink(height), shrink(depth), format, channels)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 512, 0, 0x03, 1), Some(2 << 20));
        assert_eq!(array_bytes(16, 0, 0, 0x20, 4), Some(256));
        assert_eq!(array_bytes(16, 16, 4, 0x10, 2), Some(16 * 16 * 4 * 4));
        assert_eq!(array_bytes(0, 1, 1, 0x03, 1), None);
        assert_eq!(array_bytes(1, 1, 1, 0x03, 3), None);
        assert_eq!(array_bytes(1, 1, 1, 0xa0, 1), None);
        // 8x8, 4x4, 2x2, 1x1 of 4-byte texels.
        assert_eq!(mipmapped_bytes(8, 8, 0, 0x03, 1, 4), Some((64 + 16 + 4 + 1) * 4));
    }

    #[test]
    fn normalized_and_packed_formats_take_their_texel_whatever_the_channels() {
        assert_eq!(array_bytes(100, 10, 0, 0xc0, 1), Some(1000)); // UNORM_INT8X1
        assert_eq!(array_bytes(100, 10, 0, 0xc2, 1), Some(4000)); // UNORM_INT8X4
        assert_eq!(array_bytes(100, 10, 0, 0xcb, 4), Some(8000)); // SNORM_INT16X4
        assert_eq!(array_bytes(100, 10, 0, 0xc7, 2), Some(2000)); // SNORM_INT8X2
        assert_eq!(array_bytes(100, 10, 0, 0x50, 1), Some(4000)); // UNORM_INT_101010_2
        assert_eq!(array_bytes(64, 8, 0, 0xa5, 1), Some(64 * 8 * 2)); // YUY2
        assert_eq!(array_bytes(64, 8, 0, 0xa8, 4), Some(64 * 8 * 4)); // AYUV
        assert_eq!(array_bytes(64, 8, 0, 0xb1, 4), Some(64 * 8 * 8)); // Y416
        assert_eq!(array_bytes(64, 8, 0, 0xc0, 5), None);
        assert_eq!(array_bytes(64, 8, 0, 0x01, 3), None);
    }

    #[test]
    fn block_compressed_formats_take_8_or_16_bytes_per_4x4_block() {
        // 10x10 texels: 3x3 blocks.
        for (format, block) in
            [(0x91, 8), (0x92, 8), (0x97, 8), (0x98, 8), (0x93, 16), (0x95, 16), (0x99, 16)]
        {
            assert_eq!(array_bytes(10, 10, 0, format, 4), Some(9 * block), "format {format:#x}");
        }
        for format in [0x94, 0x96, 0x9a, 0x9b, 0x9c, 0x9d, 0x9e] {
            assert_eq!(array_bytes(16, 16, 2, format, 4), Some(16 * 16 * 2), "format {format:#x}");
        }
        // A 1D BC array is one block row.
        assert_eq!(array_bytes(5, 0, 0, 0x91, 4), Some(2 * 8));
        // Mip levels round up to whole blocks: 8x8 (4 blocks), 4x4, 2x2, 1x1 (1 each).
        assert_eq!(mipmapped_bytes(8, 8, 0, 0x9d, 4, 4), Some((4 + 1 + 1 + 1) * 16));
    }

    #[test]
    fn planar_yuv_formats_take_luma_and_chroma_planes() {
        // NV12 1920x1080: luma plus half-by-half interleaved UV.
        assert_eq!(array_bytes(1920, 1080, 0, 0xb0, 3), Some(1920 * 1080 * 3 / 2));
        // Odd sizes round the chroma plane up.
        assert_eq!(array_bytes(3, 3, 0, 0xb0, 3), Some(9 + 2 * 2 * 2));
        assert_eq!(array_bytes(64, 64, 0, 0x9f, 3), Some(64 * 64 * 3)); // P010
        assert_eq!(array_bytes(64, 64, 0, 0xa1, 3), Some(64 * 64 * 3)); // P016
        assert_eq!(array_bytes(64, 64, 0, 0xa2, 3), Some(64 * 64 * 2)); // NV16
        assert_eq!(array_bytes(64, 64, 0, 0xa3, 3), Some(64 * 64 * 4)); // P210
        assert_eq!(array_bytes(64, 64, 0, 0xa4, 3), Some(64 * 64 * 4)); // P216
        assert_eq!(array_bytes(64, 64, 0, 0xb2, 3), Some(64 * 64 * 3)); // Y444_PLANAR8
        assert_eq!(array_bytes(64, 64, 0, 0xb3, 3), Some(64 * 64 * 6)); // Y444_PLANAR10
        assert_eq!(array_bytes(64, 64, 2, 0xb0, 3), Some(2 * 64 * 64 * 3 / 2)); // two layers
    }

    #[test]
    fn every_format_of_cuda_12_8_is_known_and_nothing_else() {
        use cudarc::driver::sys::CUarray_format as F;
        let all = [
            F::CU_AD_FORMAT_UNSIGNED_INT8,
            F::CU_AD_FORMAT_UNSIGNED_INT16,
            F::CU_AD_FORMAT_UNSIGNED_INT32,
            F::CU_AD_FORMAT_SIGNED_INT8,
            F::CU_AD_FORMAT_SIGNED_INT16,
            F::CU_AD_FORMAT_SIGNED_INT32,
            F::CU_AD_FORMAT_HALF,
            F::CU_AD_FORMAT_FLOAT,
            F::CU_AD_FORMAT_NV12,
            F::CU_AD_FORMAT_UNORM_INT8X1,
            F::CU_AD_FORMAT_UNORM_INT8X2,
            F::CU_AD_FORMAT_UNORM_INT8X4,
            F::CU_AD_FORMAT_UNORM_INT16X1,
            F::CU_AD_FORMAT_UNORM_INT16X2,
            F::CU_AD_FORMAT_UNORM_INT16X4,
            F::CU_AD_FORMAT_SNORM_INT8X1,
            F::CU_AD_FORMAT_SNORM_INT8X2,
            F::CU_AD_FORMAT_SNORM_INT8X4,
            F::CU_AD_FORMAT_SNORM_INT16X1,
            F::CU_AD_FORMAT_SNORM_INT16X2,
            F::CU_AD_FORMAT_SNORM_INT16X4,
            F::CU_AD_FORMAT_BC1_UNORM,
            F::CU_AD_FORMAT_BC1_UNORM_SRGB,
            F::CU_AD_FORMAT_BC2_UNORM,
            F::CU_AD_FORMAT_BC2_UNORM_SRGB,
            F::CU_AD_FORMAT_BC3_UNORM,
            F::CU_AD_FORMAT_BC3_UNORM_SRGB,
            F::CU_AD_FORMAT_BC4_UNORM,
            F::CU_AD_FORMAT_BC4_SNORM,
            F::CU_AD_FORMAT_BC5_UNORM,
            F::CU_AD_FORMAT_BC5_SNORM,
            F::CU_AD_FORMAT_BC6H_UF16,
            F::CU_AD_FORMAT_BC6H_SF16,
            F::CU_AD_FORMAT_BC7_UNORM,
            F::CU_AD_FORMAT_BC7_UNORM_SRGB,
            F::CU_AD_FORMAT_P010,
            F::CU_AD_FORMAT_P016,
            F::CU_AD_FORMAT_NV16,
            F::CU_AD_FORMAT_P210,
            F::CU_AD_FORMAT_P216,
            F::CU_AD_FORMAT_YUY2,
            F::CU_AD_FORMAT_Y210,
            F::CU_AD_FORMAT_Y216,
            F::CU_AD_FORMAT_AYUV,
            F::CU_AD_FORMAT_Y410,
            F::CU_AD_FORMAT_Y416,
            F::CU_AD_FORMAT_Y444_PLANAR8,
            F::CU_AD_FORMAT_Y444_PLANAR10,
            F::CU_AD_FORMAT_YUV444_8bit_SemiPlanar,
            F::CU_AD_FORMAT_YUV444_16bit_SemiPlanar,
            F::CU_AD_FORMAT_UNORM_INT_101010_2,
        ];
        for f in all {
            assert!(array_format(f as u32).is_some(), "{f:?} is not known");
            assert!(array_bytes(8, 8, 0, f as u32, 4).is_some_and(|b| b > 0), "{f:?} has no size");
        }
        let known = (0..=0x1_0000u32).filter(|&v| array_format(v).is_some()).count();
        assert_eq!(known, all.len(), "only the formats of cuda.h are known");
        assert_eq!(array_format(0xa0), None); // between P010 and P016: no format
        assert_eq!(array_format(0x7fff_ffff), None); // CU_AD_FORMAT_MAX
    }
}
