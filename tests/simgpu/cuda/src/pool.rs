//! Stream-ordered allocation (`cuMemAllocAsync`, `cuMemFreeAsync`,
//! `cuMemAllocFromPoolAsync`) and memory pools.
//!
//! A pool keeps memory freed into it reserved (still charged to the device) for reuse,
//! and releases what exceeds its release threshold at the next synchronizing call
//! (stream, event or context synchronize), or on `cuMemPoolTrimTo` — as CUDA pools do.
//! The default threshold is 0, so an idle pool holds nothing after a synchronize.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock};

use cudarc::driver::sys::{CUdevice, CUdeviceptr, CUmemoryPool, CUstream};
use parking_lot::Mutex;

use crate::driver::{device_index, driver};
use crate::ffi::{read_in, write_out, CUresult, CuResult};
use crate::memory::{map_anonymous, release_allocation, round_up, Allocation, Kind, ALLOC_ALIGN, REGISTRY};
use crate::stream::{self, DefaultStream};
use crate::vmm::{AccessDescRaw, LocationRaw, PoolPropsRaw};

#[derive(Default)]
struct PoolState {
    /// Freed bytes kept for reuse, still charged to the device.
    cached: u64,
    /// Bytes in live allocations.
    used: u64,
    reserved_high: u64,
    used_high: u64,
    release_threshold: u64,
    reuse_flags: [i32; 3],
    /// Access granted to other devices (`cuMemPoolSetAccess`), by device index; the
    /// pool's own device always has read-write access.
    peer_access: HashMap<usize, u32>,
}

pub(crate) struct Pool {
    device: usize,
    is_default: bool,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct Pools {
    all: HashMap<usize, Arc<Pool>>,
    default_of: HashMap<usize, usize>,
    current_of: HashMap<usize, usize>,
}

static POOLS: LazyLock<Mutex<Pools>> = LazyLock::new(Default::default);

fn new_pool(device: usize, is_default: bool) -> (usize, Arc<Pool>) {
    let pool = Arc::new(Pool { device, is_default, state: Mutex::new(PoolState::default()) });
    (Arc::as_ptr(&pool) as usize, pool)
}

fn default_pool(pools: &mut Pools, device: usize) -> usize {
    if let Some(&h) = pools.default_of.get(&device) {
        return h;
    }
    let (h, pool) = new_pool(device, true);
    pools.all.insert(h, pool);
    pools.default_of.insert(device, h);
    h
}

fn pool(handle: usize) -> CuResult<Arc<Pool>> {
    POOLS.lock().all.get(&handle).cloned().ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

pub(crate) fn device_get_default_mem_pool(out: *mut CUmemoryPool, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let h = default_pool(&mut POOLS.lock(), index);
    write_out(out, h as CUmemoryPool)
}

pub(crate) fn device_get_mem_pool(out: *mut CUmemoryPool, device: CUdevice) -> CuResult {
    let index = device_index(device)?;
    let mut pools = POOLS.lock();
    let h = match pools.current_of.get(&index) {
        Some(&h) => h,
        None => default_pool(&mut pools, index),
    };
    write_out(out, h as CUmemoryPool)
}

pub(crate) fn device_set_mem_pool(device: CUdevice, handle: CUmemoryPool) -> CuResult {
    let index = device_index(device)?;
    let p = pool(handle as usize)?;
    if p.device != index {
        return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
    POOLS.lock().current_of.insert(index, handle as usize);
    Ok(())
}

pub(crate) fn mem_pool_create(out: *mut CUmemoryPool, props: *const c_void) -> CuResult {
    driver()?;
    let props: PoolPropsRaw = read_in(props.cast())?;
    // CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE.
    if props.alloc_type != 1 || props.location.kind != 1 {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let index = device_index(props.location.id)?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (h, p) = new_pool(index, false);
    POOLS.lock().all.insert(h, p);
    write_out(out, h as CUmemoryPool)
}

pub(crate) fn mem_pool_destroy(handle: CUmemoryPool) -> CuResult {
    let p = pool(handle as usize)?;
    if p.is_default {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut pools = POOLS.lock();
    pools.all.remove(&(handle as usize));
    pools.current_of.retain(|_, h| *h != handle as usize);
    drop(pools);
    // Cached memory goes back at once; live allocations go back when freed.
    let mut st = p.state.lock();
    let cached = st.cached;
    release(&p, &mut st, cached);
    Ok(())
}

fn release(p: &Pool, st: &mut PoolState, bytes: u64) {
    let bytes = bytes.min(st.cached);
    st.cached -= bytes;
    if let Ok(d) = driver() {
        d.slot.release(p.device, bytes);
    }
}

pub(crate) fn mem_pool_trim_to(handle: CUmemoryPool, keep: usize) -> CuResult {
    let p = pool(handle as usize)?;
    let mut st = p.state.lock();
    let reserved = st.cached + st.used;
    release(&p, &mut st, reserved.saturating_sub(keep as u64));
    Ok(())
}

/// After a synchronizing call: pools on `device` shrink to their release threshold.
pub(crate) fn trim_after_sync(device: usize) {
    let pools: Vec<Arc<Pool>> = POOLS.lock().all.values().filter(|p| p.device == device).cloned().collect();
    for p in pools {
        let mut st = p.state.lock();
        let reserved = st.cached + st.used;
        let excess = reserved.saturating_sub(st.release_threshold);
        release(&p, &mut st, excess);
    }
}

/// Memory of a pooled allocation that was freed comes back to its pool.
pub(crate) fn returned(handle: usize, device: usize, bytes: u64) {
    match pool(handle) {
        Ok(p) => {
            let mut st = p.state.lock();
            st.used = st.used.saturating_sub(bytes);
            st.cached += bytes;
        }
        // The pool was destroyed meanwhile: the memory goes straight back to the device.
        Err(_) => {
            if let Ok(d) = driver() {
                d.slot.release(device, bytes);
            }
        }
    }
}

pub(crate) fn mem_pool_set_attribute(handle: CUmemoryPool, attr: i32, value: *mut c_void) -> CuResult {
    let p = pool(handle as usize)?;
    let mut st = p.state.lock();
    match attr {
        1..=3 => st.reuse_flags[(attr - 1) as usize] = read_in(value.cast::<i32>())?,
        4 => st.release_threshold = read_in(value.cast::<u64>())?,
        // Only resetting the high-water marks (to 0) is allowed.
        6 => {
            read_in(value.cast::<u64>())?;
            st.reserved_high = st.cached + st.used;
        }
        8 => {
            read_in(value.cast::<u64>())?;
            st.used_high = st.used;
        }
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
    Ok(())
}

pub(crate) fn mem_pool_get_attribute(handle: CUmemoryPool, attr: i32, value: *mut c_void) -> CuResult {
    let p = pool(handle as usize)?;
    let st = p.state.lock();
    match attr {
        1..=3 => write_out(value.cast::<i32>(), st.reuse_flags[(attr - 1) as usize]),
        4 => write_out(value.cast::<u64>(), st.release_threshold),
        5 => write_out(value.cast::<u64>(), st.cached + st.used),
        6 => write_out(value.cast::<u64>(), st.reserved_high),
        7 => write_out(value.cast::<u64>(), st.used),
        8 => write_out(value.cast::<u64>(), st.used_high),
        _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
}

/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const READ_WRITE: u32 = 3;

/// `cuMemPoolSetAccess`: who may access the pool's memory. As in CUDA the pool's own
/// device keeps read-write access (asking for less is an error); other devices get what
/// is asked (none, read, read-write).
pub(crate) fn mem_pool_set_access(handle: CUmemoryPool, map: *const c_void, count: usize) -> CuResult {
    let p = pool(handle as usize)?;
    if count > 0 && map.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut entries = Vec::with_capacity(count.min(64));
    for i in 0..count {
        // SAFETY: the caller passes an array of `count` descriptors (non-null, checked).
        let entry: AccessDescRaw = read_in(unsafe { map.cast::<AccessDescRaw>().add(i) })?;
        // CU_MEM_LOCATION_TYPE_DEVICE; flags none (0), read (1), read-write (3).
        if entry.location.kind != 1 || !matches!(entry.flags, 0 | 1 | 3) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let device = device_index(entry.location.id)?;
        if device == p.device && entry.flags != READ_WRITE {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        entries.push((device, entry.flags));
    }
    let mut st = p.state.lock();
    for (device, flags) in entries.into_iter().filter(|&(d, _)| d != p.device) {
        st.peer_access.insert(device, flags);
    }
    Ok(())
}

/// `cuMemPoolGetAccess`: the access `location` (a device) has to the pool's memory.
pub(crate) fn mem_pool_get_access(
    flags: *mut u32,
    handle: CUmemoryPool,
    location: *const c_void,
) -> CuResult {
    let p = pool(handle as usize)?;
    let location: LocationRaw = read_in(location.cast())?;
    if location.kind != 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let device = device_index(location.id)?;
    let access = if device == p.device {
        READ_WRITE
    } else {
        p.state.lock().peer_access.get(&device).copied().unwrap_or(0)
    };
    write_out(flags, access)
}

fn alloc_from(
    out: *mut CUdeviceptr,
    size: usize,
    handle: usize,
    stream: CUstream,
    default: DefaultStream,
) -> CuResult {
    if out.is_null() || size == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let s = stream::resolve(stream, default)?;
    let p = pool(handle)?;
    if p.device != s.device {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // Captured: an allocation node of the graph memory pool, not this pool's memory.
    if let Some(capture) = s.capturing() {
        return crate::graph::capture_alloc(&capture, out, size);
    }
    let d = driver()?;
    let charge = round_up(size as u64, ALLOC_ALIGN);
    {
        let mut st = p.state.lock();
        let from_cache = st.cached.min(charge);
        d.slot.charge(p.device, charge - from_cache).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
        st.cached -= from_cache;
        st.used += charge;
        st.used_high = st.used_high.max(st.used);
        st.reserved_high = st.reserved_high.max(st.used + st.cached);
    }
    let addr = match map_anonymous(size as u64, libc::PROT_READ | libc::PROT_WRITE) {
        Ok(addr) => addr,
        Err(e) => {
            returned(handle, p.device, charge);
            return Err(e);
        }
    };
    let record = Allocation {
        size: size as u64,
        charged: charge,
        device: p.device,
        ctx: s.ctx,
        kind: Kind::Pooled(handle),
        freeing: false,
    };
    REGISTRY.write().allocs.insert(addr, record);
    write_out(out, addr)
}

pub(crate) fn mem_alloc_async(
    out: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
    default: DefaultStream,
) -> CuResult {
    let s = stream::resolve(stream, default)?;
    let handle = {
        let mut pools = POOLS.lock();
        match pools.current_of.get(&s.device) {
            Some(&h) => h,
            None => default_pool(&mut pools, s.device),
        }
    };
    alloc_from(out, size, handle, stream, default)
}

pub(crate) fn mem_alloc_from_pool_async(
    out: *mut CUdeviceptr,
    size: usize,
    handle: CUmemoryPool,
    stream: CUstream,
    default: DefaultStream,
) -> CuResult {
    alloc_from(out, size, handle as usize, stream, default)
}

/// `cuMemFreeAsync`: the memory stays usable until the stream reaches the free.
pub(crate) fn mem_free_async(ptr: CUdeviceptr, stream: CUstream, default: DefaultStream) -> CuResult {
    let s = stream::resolve(stream, default)?;
    if let Some(capture) = s.capturing() {
        return crate::graph::capture_free(&capture, ptr);
    }
    {
        let mut reg = REGISTRY.write();
        match reg.allocs.get_mut(&ptr) {
            Some(a) if a.kind != Kind::Host && !a.freeing => a.freeing = true,
            // A graph allocation whose launch is queued but has not allocated it yet:
            // freed when the stream gets there, as its address is fixed.
            None if crate::graph::is_graph_address(ptr) => {}
            _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    }
    s.submit(Box::new(move || match release_allocation(&mut REGISTRY.write(), ptr) {
        Some(_) => Ok(()),
        None => Err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
    }))
}
