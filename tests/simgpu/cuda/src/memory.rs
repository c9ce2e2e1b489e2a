//! Linear device memory (`cuMemAlloc*`, pitched, managed), page-locked host memory, and
//! the registry of everything mapped, which copies and kernels check their pointers
//! against so that a bad pointer is an error code rather than a crash.
//!
//! Device memory is host memory: each allocation is its own anonymous mapping, reserved
//! lazily (`MAP_NORESERVE`), so a simulated 80 GiB device costs only what is touched; a
//! freed one is kept for the next allocation of its length ([`Spare`]).
//! Charges against the device are the requested size rounded up to [`ALLOC_ALIGN`].

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_uint, c_void};
use std::os::fd::OwnedFd;
use std::sync::LazyLock;

use cudarc::driver::sys::CUdeviceptr;
use parking_lot::RwLock;

use crate::context;
use crate::driver::driver;
use crate::ffi::{write_out, CUresult, CuResult};

/// Alignment of every allocation's charge and of pitched rows.
pub(crate) const ALLOC_ALIGN: u64 = 512;

/// How an allocation was made, which decides how it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Device,
    Pitched,
    Managed,
    Host,
    /// Stream-ordered, from a memory pool (the pool's handle).
    Pooled(usize),
    /// Made by a graph's allocation node, backed by the graph memory pool; its address
    /// range belongs to the graph and outlives the allocation (see `graph`).
    Graph,
    /// Another process's memory opened with `cuIpcOpenMemHandle` (see `ipc`): freed only
    /// by `cuIpcCloseMemHandle`, charged to whoever the machine says holds it.
    Ipc,
}

/// One linear allocation: its own anonymous mapping.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub size: u64,
    pub charged: u64,
    pub device: usize,
    pub ctx: usize,
    pub kind: Kind,
    /// A `cuMemFreeAsync` is queued for it; a second free is an error.
    pub freeing: bool,
}

/// An address range reserved with `cuMemAddressReserve`.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub size: u64,
    /// Mapped pieces by address.
    pub maps: BTreeMap<u64, Mapping>,
}

/// A physical allocation mapped into a reservation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mapping {
    pub size: u64,
    pub handle: u64,
    /// `CUmemAccess_flags` granted by `cuMemSetAccess` (0 until then).
    pub access: c_uint,
}

/// A physical allocation made with `cuMemCreate`: a memory object (memfd) charged to the device.
#[derive(Debug)]
pub(crate) struct Physical {
    pub fd: OwnedFd,
    pub size: u64,
    pub device: usize,
    /// Handle references: 1 from `cuMemCreate`, +1 per `cuMemRetainAllocationHandle`.
    pub refs: u32,
    /// Live mappings; the memory is freed when both counts reach zero.
    pub maps: u32,
    /// `CUmemAllocationProp::requestedHandleTypes` of the allocation.
    pub handle_types: u32,
    /// The machine's id of the memory object once exported or imported: it is then shared
    /// with other processes, and letting go of it is told to the machine (`vmm`).
    pub shared: Option<u64>,
}

/// Everything mapped in this process. Copies and kernels hold it for reading while they
/// touch memory, so nothing can be unmapped under them.
#[derive(Default)]
pub(crate) struct Registry {
    pub allocs: BTreeMap<u64, Allocation>,
    pub reservations: BTreeMap<u64, Reservation>,
    pub physical: HashMap<u64, Physical>,
    pub next_handle: u64,
    /// Ranges freed and kept for reuse (see [`Spare`]).
    pub spare: Spare,
    /// Allocations whose IPC handle was taken, by address (`ipc`).
    pub ipc_exported: HashMap<u64, crate::ipc::Exported>,
    /// IPC handles opened, by the address they were mapped at (`ipc`).
    pub ipc_opened: HashMap<u64, crate::ipc::Opened>,
}

/// Freed linear ranges kept mapped for the next allocation of the same length, as a real
/// driver keeps the memory it suballocates from instead of returning it on every free.
/// Without this every `cuMemAlloc`+`cuMemFree` pair was an `mmap` and a `munmap`, which
/// on a virtual machine cost 1.5-2.5 µs with the figure set per process by where the
/// kernel placed the mappings: noise ten times the size of what benchmarks compare.
/// Bounded, so a process holds at most [`Spare::MAX_BYTES`] it is not using.
#[derive(Default)]
pub(crate) struct Spare {
    ranges: Vec<(u64, u64)>,
    bytes: u64,
}

impl Spare {
    const MAX_RANGES: usize = 16;
    const MAX_BYTES: u64 = 128 << 20;

    /// A kept range of exactly `len` bytes, if there is one.
    fn take(&mut self, len: u64) -> Option<u64> {
        let at = self.ranges.iter().rposition(|&(_, l)| l == len)?;
        self.bytes -= len;
        Some(self.ranges.swap_remove(at).0)
    }

    /// Keeps `[addr, addr + len)` for reuse, or unmaps it when the bounds are reached.
    /// Ranges below 4 GiB go back to the kernel: the pre-3.2 API needs that window.
    fn keep(&mut self, addr: u64, len: u64) {
        let low = addr < 1 << 32;
        if low || self.ranges.len() == Self::MAX_RANGES || self.bytes + len > Self::MAX_BYTES {
            unmap(addr, len);
            return;
        }
        self.bytes += len;
        self.ranges.push((addr, len));
    }
}

pub(crate) static REGISTRY: LazyLock<RwLock<Registry>> = LazyLock::new(Default::default);

pub(crate) fn round_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align) * align
}

/// Maps `len` bytes of fresh, zeroed, lazily reserved memory.
pub(crate) fn map_anonymous(len: u64, prot: i32) -> CuResult<u64> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing has no
    // preconditions; failure is checked.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(addr as u64)
}

pub(crate) fn unmap(addr: u64, len: u64) {
    // SAFETY: callers pass a range they mapped and that the registry no longer lists,
    // so nothing in this process uses it any more.
    unsafe { libc::munmap(addr as *mut c_void, len as usize) };
}

impl Registry {
    /// The device memory `[ptr, ptr + len)` lies in, if all of it is usable device memory.
    pub(crate) fn device_range(&self, ptr: u64, len: u64) -> Option<usize> {
        let end = ptr.checked_add(len)?;
        if let Some((&base, a)) = self.allocs.range(..=ptr).next_back() {
            if end <= base + a.size.max(1) && a.kind != Kind::Host {
                return Some(a.device);
            }
        }
        let (&base, r) = self.reservations.range(..=ptr).next_back()?;
        if end > base + r.size {
            return None;
        }
        // Every byte must be in a mapping that was granted read/write access.
        let mut at = ptr;
        let mut device = None;
        while at < end.max(ptr + 1) {
            let (&mbase, m) = r.maps.range(..=at).next_back()?;
            if at >= mbase + m.size || m.access != 3 {
                return None;
            }
            device = self.physical.get(&m.handle).map(|p| p.device);
            at = mbase + m.size;
        }
        device
    }

    /// Whether `[ptr, ptr + len)` lies in one page-locked host allocation
    /// (`cuMemAllocHost`/`cuMemHostAlloc`).
    pub(crate) fn host_range(&self, ptr: u64, len: u64) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        self.allocs
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&base, a)| a.kind == Kind::Host && end <= base + a.size.max(1))
    }

    /// Whether `ptr` is anywhere in memory this driver manages (UVA classification).
    pub(crate) fn owns(&self, ptr: u64) -> bool {
        let in_alloc = self.allocs.range(..=ptr).next_back().is_some_and(|(&b, a)| ptr < b + a.size.max(1));
        let in_reservation =
            self.reservations.range(..=ptr).next_back().is_some_and(|(&b, r)| ptr < b + r.size);
        in_alloc || in_reservation
    }
}

/// Maps `len` bytes of fresh, zeroed, lazily reserved memory wholly below 4 GiB, where
/// the 32-bit device pointers of the pre-3.2 API (`CUdeviceptr_v1`) can address it.
/// It tries fixed addresses from 256 MiB (above the image and early heap of a program
/// linked at a low address) up in 16 MiB steps, never replacing an existing mapping.
fn map_low(len: u64, prot: i32) -> CuResult<u64> {
    const START: u64 = 256 << 20;
    const END: u64 = 1 << 32;
    const STEP: u64 = 16 << 20;
    let mut at = START;
    while at.checked_add(len).is_some_and(|end| end <= END) {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping: the kernel
        // fails with EEXIST where the range is taken; failure is checked.
        let addr = unsafe {
            libc::mmap(
                at as *mut c_void,
                len as usize,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if addr != libc::MAP_FAILED {
            if addr as u64 == at {
                return Ok(at);
            }
            // A kernel older than MAP_FIXED_NOREPLACE took it as a hint and mapped elsewhere.
            unmap(addr as u64, len);
        } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
            break;
        }
        at += STEP;
    }
    Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
}

/// Where an allocation's address must lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Window {
    /// Anywhere (the `_v2` API's 64-bit pointers).
    Any,
    /// Wholly below 4 GiB (the pre-3.2 API's 32-bit pointers).
    Low32,
}

/// Allocates linear memory charged to the current context's device.
pub(crate) fn allocate(size: u64, charge: u64, kind: Kind) -> CuResult<u64> {
    allocate_in(size, charge, kind, Window::Any)
}

/// Allocates linear memory charged to the current context's device, at an address in
/// `window`.
pub(crate) fn allocate_in(size: u64, charge: u64, kind: Kind, window: Window) -> CuResult<u64> {
    if size == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = context::current()?;
    let d = driver()?;
    // A synchronous allocation is not captured: a capture may forbid it.
    crate::graph::unsafe_call()?;
    let charged = if kind == Kind::Host { 0 } else { round_up(charge, ALLOC_ALIGN) };
    if charged > 0 {
        d.slot.charge(ctx.device, charged).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    }
    let record = Allocation { size, charged, device: ctx.device, ctx: ctx.handle(), kind, freeing: false };
    if window == Window::Any {
        let mut reg = REGISTRY.write();
        if let Some(addr) = reg.spare.take(size) {
            reg.allocs.insert(addr, record);
            return Ok(addr);
        }
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let mapped = match window {
        Window::Any => map_anonymous(size, prot),
        Window::Low32 => map_low(size, prot),
    };
    let addr = match mapped {
        Ok(addr) => addr,
        Err(e) => {
            d.slot.release(ctx.device, charged);
            return Err(e);
        }
    };
    REGISTRY.write().allocs.insert(addr, record);
    Ok(addr)
}

/// Removes an allocation, unmaps it and gives its charge back (pooled memory goes back
/// to its pool). The caller holds the registry for writing.
pub(crate) fn release_allocation(reg: &mut Registry, addr: u64) -> Option<Allocation> {
    let a = reg.allocs.remove(&addr)?;
    // Memory an IPC handle shares: the machine says whether it is freed or passes on.
    if crate::ipc::release_shared(reg, addr, a.size) {
        return Some(a);
    }
    if a.kind != Kind::Graph {
        reg.spare.keep(addr, a.size);
    }
    match a.kind {
        Kind::Pooled(pool) => crate::pool::returned(pool, a.device, a.charged),
        Kind::Graph => crate::graph::returned(addr, a.device, a.charged),
        _ => {
            if let Ok(d) = driver() {
                d.slot.release(a.device, a.charged);
            }
        }
    }
    Some(a)
}

pub(crate) fn mem_alloc(out: *mut CUdeviceptr, size: usize) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let addr = allocate(size as u64, size as u64, Kind::Device)?;
    write_out(out, addr)
}

/// `cuMemAllocPitch`: rows padded to [`ALLOC_ALIGN`]; the charge is pitch × height.
pub(crate) fn mem_alloc_pitch(
    out: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CuResult {
    if out.is_null() || pitch.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (addr, row) = pitched(width as u64, height as u64, element_size, Window::Any)?;
    write_out(pitch, row as usize)?;
    write_out(out, addr)
}

/// A pitched allocation in `window`: its address and its pitch.
fn pitched(width: u64, height: u64, element_size: c_uint, window: Window) -> CuResult<(u64, u64)> {
    if width == 0 || height == 0 || ![4, 8, 16].contains(&element_size) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let row = round_up(width, ALLOC_ALIGN);
    let size = row.checked_mul(height).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    Ok((allocate_in(size, size, Kind::Pitched, window)?, row))
}

/// `cuMemAlloc` of the pre-3.2 API: a 32-bit size, and an address below 4 GiB.
pub(crate) fn mem_alloc_v1(out: *mut c_uint, size: c_uint) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let addr = allocate_in(size as u64, size as u64, Kind::Device, Window::Low32)?;
    write_out(out, addr as c_uint)
}

/// `cuMemAllocPitch` of the pre-3.2 API: 32-bit sizes and pitch, an address below 4 GiB.
pub(crate) fn mem_alloc_pitch_v1(
    out: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> CuResult {
    if out.is_null() || pitch.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (addr, row) = pitched(width as u64, height as u64, element_size, Window::Low32)?;
    // The whole allocation lies below 4 GiB, so its pitch does too.
    write_out(pitch, row as c_uint)?;
    write_out(out, addr as c_uint)
}

/// `cuMemGetInfo` of the pre-3.2 API: free and total clamped to 32 bits.
pub(crate) fn mem_get_info_v1(free: *mut c_uint, total: *mut c_uint) -> CuResult {
    let (mut f, mut t) = (0usize, 0usize);
    mem_get_info(&mut f, &mut t)?;
    write_out(free, clamp32(f as u64))?;
    write_out(total, clamp32(t as u64))
}

/// A size for a 32-bit out-parameter: at most `u32::MAX`.
pub(crate) fn clamp32(value: u64) -> c_uint {
    value.min(c_uint::MAX as u64) as c_uint
}

/// `cuMemGetAddressRange` of the pre-3.2 API. A range whose base or size does not fit in
/// 32 bits (only memory of the 64-bit API can be so) is `CUDA_ERROR_INVALID_VALUE`.
pub(crate) fn mem_get_address_range_v1(base: *mut c_uint, size: *mut c_uint, ptr: c_uint) -> CuResult {
    driver()?;
    let (b, s, ..) = find(ptr as u64)?;
    let b = c_uint::try_from(b).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let s = c_uint::try_from(s).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if !base.is_null() {
        write_out(base, b)?;
    }
    if !size.is_null() {
        write_out(size, s)?;
    }
    Ok(())
}

pub(crate) fn mem_alloc_managed(out: *mut CUdeviceptr, size: usize, flags: c_uint) -> CuResult {
    // CU_MEM_ATTACH_GLOBAL = 1, CU_MEM_ATTACH_HOST = 2.
    if out.is_null() || !(flags == 1 || flags == 2) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let addr = allocate(size as u64, size as u64, Kind::Managed)?;
    write_out(out, addr)
}

/// Waits for the work of the allocation's context: `cuMemFree` is a synchronizing call.
pub(crate) fn drain_context(ctx: usize) {
    if let Ok(c) = context::lookup(ctx) {
        let _ = c.null_stream.synchronize();
        for s in crate::stream::streams_of(ctx) {
            let _ = s.synchronize();
        }
    }
}

pub(crate) fn mem_free(ptr: CUdeviceptr) -> CuResult {
    driver()?;
    if ptr == 0 {
        return Ok(());
    }
    crate::graph::unsafe_call()?;
    let ctx = {
        let reg = REGISTRY.read();
        match reg.allocs.get(&ptr) {
            // Opened IPC memory is let go of with `cuIpcCloseMemHandle`.
            Some(a) if !matches!(a.kind, Kind::Host | Kind::Ipc) && !a.freeing => a.ctx,
            _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    };
    drain_context(ctx);
    let mut reg = REGISTRY.write();
    match reg.allocs.get(&ptr) {
        Some(a) if !matches!(a.kind, Kind::Host | Kind::Ipc) && !a.freeing => {
            release_allocation(&mut reg, ptr);
            Ok(())
        }
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

pub(crate) fn mem_get_info(free: *mut usize, total: *mut usize) -> CuResult {
    let ctx = context::current()?;
    let d = driver()?;
    let t = d.machine.total(ctx.device);
    let used = d.machine.used(ctx.device);
    write_out(free, t.saturating_sub(used) as usize)?;
    write_out(total, t as usize)
}

pub(crate) fn mem_alloc_host(out: *mut *mut c_void, size: usize) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let addr = allocate(size as u64, 0, Kind::Host)?;
    write_out(out, addr as *mut c_void)
}

pub(crate) fn mem_free_host(ptr: *mut c_void) -> CuResult {
    driver()?;
    let mut reg = REGISTRY.write();
    match reg.allocs.get(&(ptr as u64)) {
        Some(a) if a.kind == Kind::Host => {
            release_allocation(&mut reg, ptr as u64);
            Ok(())
        }
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// The allocation or mapped range containing `ptr`: (base, size, device, ctx, kind).
fn find(ptr: u64) -> CuResult<(u64, u64, usize, usize, Option<Kind>)> {
    let reg = REGISTRY.read();
    if let Some((&base, a)) = reg.allocs.range(..=ptr).next_back() {
        if ptr < base + a.size {
            return Ok((base, a.size, a.device, a.ctx, Some(a.kind)));
        }
    }
    if let Some((_, r)) = reg.reservations.range(..=ptr).next_back() {
        if let Some((&mbase, m)) = r.maps.range(..=ptr).next_back() {
            if ptr < mbase + m.size {
                let device = reg.physical.get(&m.handle).map_or(0, |p| p.device);
                return Ok((mbase, m.size, device, 0, None));
            }
        }
    }
    Err(CUresult::CUDA_ERROR_NOT_FOUND)
}

pub(crate) fn mem_get_address_range(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) -> CuResult {
    driver()?;
    let (b, s, ..) = find(ptr)?;
    if !base.is_null() {
        write_out(base, b)?;
    }
    if !size.is_null() {
        write_out(size, s as usize)?;
    }
    Ok(())
}

/// `cuPointerGetAttribute` for the attributes programs commonly ask.
pub(crate) fn pointer_get_attribute(data: *mut c_void, attribute: i32, ptr: CUdeviceptr) -> CuResult {
    driver()?;
    let (base, size, device, ctx, kind) = find(ptr).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let host = kind == Some(Kind::Host);
    let managed = kind == Some(Kind::Managed);
    match attribute {
        // CONTEXT
        1 => write_out(data.cast(), context::as_ptr(ctx)),
        // MEMORY_TYPE: HOST = 1, DEVICE = 2
        2 => write_out(data.cast::<c_uint>(), if host { 1 } else { 2 }),
        // DEVICE_POINTER, HOST_POINTER (host memory is device-accessible and vice versa here)
        3 | 4 => write_out(data.cast::<u64>(), ptr),
        // BUFFER_ID
        7 => write_out(data.cast::<u64>(), base),
        // IS_MANAGED, MAPPED (bool)
        8 => write_out(data.cast::<bool>(), managed),
        13 => write_out(data.cast::<bool>(), true),
        // DEVICE_ORDINAL
        9 => write_out(data.cast::<i32>(), device as i32),
        // RANGE_START_ADDR, RANGE_SIZE
        11 => write_out(data.cast::<u64>(), base),
        12 => write_out(data.cast::<usize>(), size as usize),
        // MEMPOOL_HANDLE
        17 => write_out(
            data.cast::<*mut c_void>(),
            match kind {
                Some(Kind::Pooled(pool)) => pool as *mut c_void,
                _ => std::ptr::null_mut(),
            },
        ),
        _ => Err(CUresult::CUDA_ERROR_NOT_SUPPORTED),
    }
}

/// Size in bytes of the value each `CUpointer_attribute` (1 ..= 21) writes, as `cuda.h`
/// types them: pointers and 64-bit values, `unsigned int`/`int`, `bool`, and the 16-byte
/// `CUDA_POINTER_ATTRIBUTE_P2P_TOKENS`.
fn pointer_attribute_size(attribute: i32) -> Option<usize> {
    match attribute {
        1 | 3 | 4 | 7 | 11 | 12 | 14 | 17..=20 => Some(8),
        2 | 9 | 15 | 16 => Some(4),
        6 | 8 | 10 | 13 | 21 => Some(1),
        5 => Some(16),
        _ => None,
    }
}

/// `cuPointerGetAttributes`: each attribute as `cuPointerGetAttribute` answers it. As in
/// CUDA, a pointer simgpu does not know (ordinary host memory) is not an error: its
/// attributes read as zero (no context, memory type 0), its device ordinal as -2 (no
/// device); attributes simgpu does not track read as zero too.
pub(crate) fn pointer_get_attributes(
    count: c_uint,
    attributes: *const i32,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CuResult {
    driver()?;
    if count > 0 && (attributes.is_null() || data.is_null()) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let known = find(ptr).is_ok();
    for i in 0..count as usize {
        // SAFETY: the caller passes `count` attributes and `count` data pointers (both
        // checked non-null above).
        let (attribute, out) = unsafe { (*attributes.add(i), *data.add(i)) };
        let size = pointer_attribute_size(attribute).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        if out.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let answered = if known {
            pointer_get_attribute(out, attribute, ptr)
        } else {
            Err(CUresult::CUDA_ERROR_NOT_SUPPORTED)
        };
        match answered {
            Ok(()) => {}
            Err(CUresult::CUDA_ERROR_NOT_SUPPORTED) => {
                // SAFETY: `out` is the caller's storage for this attribute's value, which
                // `cuda.h` types as `size` bytes.
                unsafe { std::ptr::write_bytes(out.cast::<u8>(), 0, size) };
                // DEVICE_ORDINAL of memory on no device.
                if attribute == 9 && !known {
                    write_out(out.cast::<i32>(), -2)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Frees everything a destroyed context still held.
pub(crate) fn free_all_of_context(ctx: usize) {
    let mut reg = REGISTRY.write();
    let addrs: Vec<u64> = reg.allocs.iter().filter(|(_, a)| a.ctx == ctx).map(|(&b, _)| b).collect();
    for addr in addrs {
        release_allocation(&mut reg, addr);
    }
    drop(reg);
    crate::array::free_all_of_context(ctx);
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn mapped(len: u64) -> u64 {
        map_anonymous(len, libc::PROT_READ | libc::PROT_WRITE).expect("a mapping")
    }

    #[test]
    fn freed_ranges_are_reused_by_length_within_bounds() {
        let mut spare = Spare::default();
        let first = mapped(MIB);
        spare.keep(first, MIB);
        assert_eq!(spare.take(2 * MIB), None, "only a range of the same length");
        assert_eq!(spare.take(MIB), Some(first));
        assert_eq!(spare.take(MIB), None, "taken once");

        // At most MAX_RANGES ranges are kept; the rest go back to the kernel.
        (0..Spare::MAX_RANGES + 4).for_each(|_| spare.keep(mapped(MIB), MIB));
        assert_eq!(spare.ranges.len(), Spare::MAX_RANGES);
        assert_eq!(spare.bytes, Spare::MAX_RANGES as u64 * MIB);
        while spare.take(MIB).is_some() {}
        assert_eq!(spare.bytes, 0);

        // At most MAX_BYTES: a third 64 MiB range is not kept.
        (0..3).for_each(|_| spare.keep(mapped(64 * MIB), 64 * MIB));
        assert_eq!(spare.bytes, Spare::MAX_BYTES);
        assert_eq!(spare.ranges.len(), 2);
        while let Some(addr) = spare.take(64 * MIB) {
            unmap(addr, 64 * MIB);
        }
    }

    #[test]
    fn ranges_below_4_gib_are_never_kept() {
        let mut spare = Spare::default();
        let low = map_low(MIB, libc::PROT_READ | libc::PROT_WRITE).expect("a low mapping");
        spare.keep(low, MIB);
        assert_eq!(spare.take(MIB), None, "the pre-3.2 API needs that window");
    }
}
