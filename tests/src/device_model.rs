//! Programs that hold a "model" on the device (bursty_server, parkable_model): the CUDA
//! set-up, simgpu's built-in fill and checksum kernels, allocations, and one-line output.
//! They call the driver through `cudarc::driver::sys` (dlopen + dlsym), so they run bare
//! on simgpu and under the shim alike.

use std::ffi::{c_void, CStr};
use std::io::Write;
use std::ptr::null_mut;

use cudarc::driver::sys::{self, CUresult};

/// The driver's name for `r` (`CUDA_ERROR_OUT_OF_MEMORY`).
pub fn error_name(r: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: a valid out-pointer; the driver answers a static string or an error.
    let ok = unsafe { sys::cuGetErrorName(r, &mut name) } == CUresult::CUDA_SUCCESS;
    if ok && !name.is_null() {
        // SAFETY: cuGetErrorName returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

/// `Ok` for success, else the error.
pub fn check(r: CUresult) -> Result<(), CUresult> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

/// Prints one line on stdout and flushes it, so readers see it at once.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (the reader went away) is no reason to stop the trace.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// The simgpu built-in kernels used to fill and check memory.
pub struct Kernels {
    fill: sys::CUfunction,
    checksum: sys::CUfunction,
}

/// CUDA set up: a current context and the kernels.
pub fn init() -> Result<Kernels, CUresult> {
    // SAFETY: every call gets valid out-pointers and handles it was given by the driver.
    unsafe {
        check(sys::cuInit(0))?;
        let mut dev = 0;
        check(sys::cuDeviceGet(&mut dev, 0))?;
        let mut ctx = null_mut();
        check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
        check(sys::cuCtxSetCurrent(ctx))?;
        let mut module = null_mut();
        check(sys::cuModuleLoadData(&mut module, c"simgpu built-in kernels".as_ptr().cast()))?;
        let mut k = Kernels { fill: null_mut(), checksum: null_mut() };
        check(sys::cuModuleGetFunction(&mut k.fill, module, c"simgpu_fill_u32".as_ptr()))?;
        check(sys::cuModuleGetFunction(&mut k.checksum, module, c"simgpu_checksum_u32".as_ptr()))?;
        Ok(k)
    }
}

fn launch(f: sys::CUfunction, args: &mut [*mut c_void]) -> Result<(), CUresult> {
    // SAFETY: `args` points at the kernel's parameters, each alive for the call (the
    // driver copies them before returning); the legacy default stream (null) is valid.
    check(unsafe { sys::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, null_mut(), args.as_mut_ptr(), null_mut()) })
}

impl Kernels {
    /// Queues `ptr[0..count] = value`.
    pub fn fill(&self, ptr: u64, value: u32, count: usize) -> Result<(), CUresult> {
        let (mut p, mut v, mut c) = (ptr, value, count);
        launch(
            self.fill,
            &mut [(&mut p as *mut u64).cast(), (&mut v as *mut u32).cast(), (&mut c as *mut usize).cast()],
        )
    }

    /// The wrapping sum of `ptr[0..count]`, computed on the device into `scratch` (8 bytes).
    pub fn checksum(&self, ptr: u64, count: usize, scratch: u64) -> Result<u64, CUresult> {
        let (mut p, mut c, mut o) = (ptr, count, scratch);
        launch(
            self.checksum,
            &mut [(&mut p as *mut u64).cast(), (&mut c as *mut usize).cast(), (&mut o as *mut u64).cast()],
        )?;
        let mut sum = 0u64;
        // SAFETY: 8 bytes into a u64; the synchronous copy is ordered after the kernel.
        check(unsafe { sys::cuMemcpyDtoH_v2((&mut sum as *mut u64).cast(), scratch, 8) })?;
        Ok(sum)
    }
}

/// One device allocation.
#[derive(Clone, Copy)]
pub struct Block {
    /// Its device address.
    pub ptr: u64,
    /// Its size.
    pub bytes: u64,
}

/// `cuMemAlloc`s `bytes`.
pub fn alloc(bytes: u64) -> Result<Block, CUresult> {
    let mut ptr = 0u64;
    // SAFETY: a valid out-pointer.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) })?;
    Ok(Block { ptr, bytes })
}

/// Frees every block.
pub fn free_all(blocks: &mut Vec<Block>) {
    for b in blocks.drain(..) {
        // SAFETY: `b.ptr` came from cuMemAlloc_v2 and is freed once. A failure leaves
        // nothing to do: the process exit releases it.
        unsafe { sys::cuMemFree_v2(b.ptr) };
    }
}
