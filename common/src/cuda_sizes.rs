//! Sizes the CUDA driver API implies: the bytes of CUDA arrays from their descriptors.

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

/// Bytes per element of a `CUarray_format`, for the formats with a fixed element size.
pub fn array_format_bytes(format: u32) -> Option<u64> {
    Some(match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => return None,
    })
}

/// Bytes of an array level of `width × height × depth` elements (0 height or depth: the
/// dimension is absent), or `None` for an invalid shape or an unknown format.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32) -> Option<u64> {
    if width == 0 || ![1, 2, 4].contains(&channels) {
        return None;
    }
    let texel = array_format_bytes(format)? * channels as u64;
    width.checked_mul(height.max(1))?.checked_mul(depth.max(1))?.checked_mul(texel)
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
        assert_eq!(array_bytes(1, 1, 1, 0xb0, 1), None);
        // 8x8, 4x4, 2x2, 1x1 of 4-byte texels.
        assert_eq!(mipmapped_bytes(8, 8, 0, 0x03, 1, 4), Some((64 + 16 + 4 + 1) * 4));
    }
}
