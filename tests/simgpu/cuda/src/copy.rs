//! Copies and sets, synchronous and stream-ordered. Device pointers are checked against
//! the registry while it is held, so a copy to freed or unmapped memory returns an error
//! (`CUDA_ERROR_INVALID_VALUE` at the call, `CUDA_ERROR_ILLEGAL_ADDRESS` when queued
//! work finds its memory gone) instead of faulting.

use cudarc::driver::sys::{CUdeviceptr, CUstream};

use crate::driver::driver;
use crate::ffi::{CUresult, CuResult};
use crate::graph::NodeType;
use crate::memory::{Registry, REGISTRY};
use crate::stream::{self, DefaultStream};

/// One copy or set. Host addresses are carried as integers so the operation can move to
/// a stream's worker; the caller keeps them valid until the work is done, as CUDA requires.
#[derive(Clone, Copy)]
pub(crate) enum Op {
    HtoD {
        dst: u64,
        src: usize,
        n: usize,
    },
    DtoH {
        dst: usize,
        src: u64,
        n: usize,
    },
    DtoD {
        dst: u64,
        src: u64,
        n: usize,
    },
    /// `cuMemcpy`: either side may be host or device (unified addressing).
    Unified {
        dst: u64,
        src: u64,
        n: usize,
    },
    /// `cuMemsetD8/16/32`: `count` elements of `width` bytes.
    Set {
        dst: u64,
        value: u32,
        width: usize,
        count: usize,
    },
}

impl Op {
    fn device_ok(reg: &Registry, ptr: u64, n: usize) -> bool {
        reg.device_range(ptr, n as u64).is_some()
    }

    /// Checks every device range and returns (destination, source, bytes) to touch.
    fn check(&self, reg: &Registry) -> Option<(usize, usize, usize)> {
        match *self {
            Op::HtoD { dst, src, n } => {
                (src != 0 && Self::device_ok(reg, dst, n)).then_some((dst as usize, src, n))
            }
            Op::DtoH { dst, src, n } => {
                (dst != 0 && Self::device_ok(reg, src, n)).then_some((dst, src as usize, n))
            }
            Op::DtoD { dst, src, n } => (Self::device_ok(reg, dst, n) && Self::device_ok(reg, src, n))
                .then_some((dst as usize, src as usize, n)),
            Op::Unified { dst, src, n } => {
                // With unified addressing either side may be device memory, page-locked
                // host memory, or any other host memory; the direction follows from it.
                let side_ok = |p: u64| {
                    p != 0 && (!reg.owns(p) || Self::device_ok(reg, p, n) || reg.host_range(p, n as u64))
                };
                (side_ok(dst) && side_ok(src)).then_some((dst as usize, src as usize, n))
            }
            Op::Set { dst, width, count, .. } => {
                let n = width.checked_mul(count)?;
                ((dst as usize).is_multiple_of(width) && Self::device_ok(reg, dst, n)).then_some((
                    dst as usize,
                    0,
                    n,
                ))
            }
        }
    }

    fn len(&self) -> usize {
        match *self {
            Op::HtoD { n, .. } | Op::DtoH { n, .. } | Op::DtoD { n, .. } | Op::Unified { n, .. } => n,
            Op::Set { width, count, .. } => width.saturating_mul(count),
        }
    }

    /// Performs the operation, or returns `bad` if a range is not usable memory.
    fn run(&self, bad: CUresult) -> CuResult {
        if self.len() == 0 {
            return Ok(());
        }
        let reg = REGISTRY.read();
        let (dst, src, n) = self.check(&reg).ok_or(bad)?;
        match *self {
            Op::Set { value, width, count, .. } => {
                // SAFETY: [dst, dst + width * count) is mapped read/write device memory
                // (checked above, registry held so it stays mapped), aligned to `width`.
                unsafe {
                    match width {
                        1 => std::ptr::write_bytes(dst as *mut u8, value as u8, count),
                        2 => std::slice::from_raw_parts_mut(dst as *mut u16, count).fill(value as u16),
                        _ => std::slice::from_raw_parts_mut(dst as *mut u32, count).fill(value),
                    }
                }
            }
            // SAFETY: device sides are mapped for n bytes (checked, and held mapped by the
            // registry lock); host sides are the caller's buffers of n bytes by the API
            // contract. `copy` tolerates overlap, which cuMemcpyDtoD allows.
            _ => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) },
        }
        Ok(())
    }
}

/// A synchronous copy or set: ordered after earlier work on the default stream.
pub(crate) fn sync(op: Op, default: DefaultStream) -> CuResult {
    driver()?;
    let s = stream::resolve(std::ptr::null_mut(), default)?;
    // A synchronous copy waits for its stream: a capture may forbid it, and the legacy
    // stream cannot wait for a capturing one.
    crate::graph::unsafe_call()?;
    if crate::graph::any_capture() && stream::is_legacy(&s) {
        crate::graph::legacy_use(s.ctx)?;
    }
    s.synchronize()?;
    op.run(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// A stream-ordered copy or set: checked now, performed by the stream's worker.
///
/// Host memory that is not page-locked (not from `cuMemAllocHost`/`cuMemHostAlloc`)
/// behaves as the CUDA documentation says: a copy *from* it is staged at once, so the
/// caller may reuse its buffer on return; a copy *to* it returns only once it is done.
pub(crate) fn queued(op: Op, stream: CUstream, default: DefaultStream) -> CuResult {
    driver()?;
    let s = stream::resolve(stream, default)?;
    if op.len() == 0 {
        return Ok(());
    }
    // Captured: a node that copies when the graph runs (graph allocations are not
    // memory yet, so the ranges are checked then).
    if s.capturing().is_some() {
        let ty = if matches!(op, Op::Set { .. }) { NodeType::Memset } else { NodeType::Memcpy };
        return s.enqueue(
            ty,
            std::sync::Arc::new(move || op.run(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)),
            false,
        );
    }
    let (pageable_src, pageable_dst) = {
        let reg = REGISTRY.read();
        if op.check(&reg).is_none() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        match op {
            Op::HtoD { src, .. } => (!reg.owns(src as u64), false),
            Op::DtoH { dst, .. } => (false, !reg.owns(dst as u64)),
            Op::Unified { dst, src, .. } => (!reg.owns(src), !reg.owns(dst)),
            _ => (false, false),
        }
    };
    if pageable_src {
        let (dst, src, n) = match op {
            Op::HtoD { dst, src, n } => (dst, src, n),
            Op::Unified { dst, src, n } => (dst, src as usize, n),
            _ => unreachable!("only host-to-device copies have a host source"),
        };
        // SAFETY: the caller's source buffer holds n readable bytes for this call.
        let staged = unsafe { std::slice::from_raw_parts(src as *const u8, n) }.to_vec();
        let direct = pageable_dst && matches!(op, Op::Unified { .. });
        return s.submit(Box::new(move || {
            let op = if direct {
                Op::Unified { dst, src: staged.as_ptr() as u64, n }
            } else {
                Op::HtoD { dst, src: staged.as_ptr() as usize, n }
            };
            op.run(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)
        }));
    }
    s.submit(Box::new(move || op.run(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)))?;
    if pageable_dst {
        s.synchronize()?;
    }
    Ok(())
}

pub(crate) fn htod(dst: CUdeviceptr, src: *const std::ffi::c_void, n: usize) -> Op {
    Op::HtoD { dst, src: src as usize, n }
}

pub(crate) fn dtoh(dst: *mut std::ffi::c_void, src: CUdeviceptr, n: usize) -> Op {
    Op::DtoH { dst: dst as usize, src, n }
}
