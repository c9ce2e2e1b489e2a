//! Every allocation path, held to the group's limit: a charge is taken before the driver
//! is asked (so two racing threads cannot both pass the limit), given back if the driver
//! fails, recorded per allocation, and given back exactly on free, async free, destroy or
//! release.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use gpufrac_common::cuda_sizes::{
    array_bytes, mipmapped_bytes, Array3DDescriptor, Array3DDescriptorV1, ArrayDescriptor, ArrayDescriptorV1,
};

use crate::books::records::{Context, Path, Record};
use crate::driver::ffi::{read, CUdeviceptr, Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::pools::{self, Target};
use crate::enforcer::{enforcer, refused, Charge, Current, Enforcer};

type Ptr = *mut c_void;

/// Records a successful allocation under `key`, or gives the charge back if the driver failed.
#[inline(always)]
fn settle(
    e: &Enforcer,
    status: Status,
    charge: Charge,
    key: Option<u64>,
    path: Path,
    context: Context,
) -> Status {
    match key.filter(|_| status == SUCCESS) {
        Some(key) => {
            let record = Record {
                bytes: charge.bytes,
                device: charge.device,
                context,
                path,
                above_request: charge.above_request,
            };
            let table = match path {
                Path::Array | Path::Mipmapped => &e.arrays,
                Path::Physical => &e.physical,
                _ => &e.pointers,
            };
            table.insert(key, record);
        }
        None => e.release(charge.device, charge.bytes),
    }
    status
}

/// The common shape of the linear allocation hooks.
#[inline(always)]
fn linear(bytes: u64, path: Path, out: *mut CUdeviceptr, real: impl FnMut() -> Status) -> Status {
    stream_ordered(bytes, path, None, out, real)
}

/// `linear`, for an allocation ordered on `stream` when there is one: one made while the
/// stream is being captured into a graph belongs to the graph and is never VMM-backed.
///
/// The hot path, an allocation within what the group may hold now in a process with one
/// device that cannot be parked: the enforcer (two loads), the park flag (one load), one
/// ledger addition, the driver, one record claimed. No lock, no system call, no time read,
/// no logging, and no call to the driver but the allocation. The device to charge is the
/// process's one device, so the current context is not asked (that call was 40 of the
/// ~110 ns the shim added to a pair on simgpu); which context the allocation belongs to is
/// asked only before a context may be torn down (`Context::Unresolved`). Everything else
/// (more devices, a charge that does not fit, a burst that swap may back, a parkable
/// process, a stream-ordered allocation) is out of line, so that the hot path is a few cache lines of code.
#[inline(always)]
fn stream_ordered(
    bytes: u64,
    path: Path,
    stream: Option<Ptr>,
    out: *mut CUdeviceptr,
    mut real: impl FnMut() -> Status,
) -> Status {
    // A stream-ordered allocation keeps its context asked: memory from a pool belongs to
    // no context, and the driver may answer no context for it later.
    if let Some(e) = enforcer().filter(|_| path != Path::Pooled && !crate::control::park::parkable()) {
        if let Some(ordinal) = e.sole_ordinal() {
            if let Some(charge) = e.charge_quick(ordinal, bytes) {
                // Swap backs only bursts (`swap::backs`), and only with an arbiter.
                if charge.above_request && e.lender.get().is_some() {
                    return charged(e, ordinal, None, charge, path, stream, out, real);
                }
                let status = e.physical(&mut real);
                // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
                return settle(e, status, charge, unsafe { read(out) }, path, Context::Unresolved);
            }
        }
    }
    stream_ordered_slow(bytes, path, stream, out, real)
}

/// `stream_ordered` off its hot path: the current context asked of the driver (it says
/// which device to charge, and a call without one gets the driver's answer rather than
/// a wait for memory), the park check, and the slow charge.
#[cold]
#[inline(never)]
fn stream_ordered_slow(
    bytes: u64,
    path: Path,
    stream: Option<Ptr>,
    out: *mut CUdeviceptr,
    real: impl FnMut() -> Status,
) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(Current { id, ordinal }) = e.current() else { return e.untracked(real) };
    let charge = match e.charge(ordinal, bytes) {
        Ok(c) => c,
        Err(status) => return status,
    };
    charged(e, ordinal, Some(id), charge, path, stream, out, real)
}

/// The rest of `stream_ordered` once `charge` is taken on device `ordinal` (in context
/// `id`, asked here if not known yet): swap backs the allocation with the VMM API where it
/// may, else the driver makes it.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn charged(
    e: &Enforcer,
    ordinal: usize,
    id: Option<usize>,
    charge: Charge,
    path: Path,
    stream: Option<Ptr>,
    out: *mut CUdeviceptr,
    mut real: impl FnMut() -> Status,
) -> Status {
    // Swap backs allocations only in a process with an arbiter (`swap::backs`): without
    // one, not even asked.
    let swapped = matches!(path, Path::Linear | Path::Pooled)
        && !out.is_null()
        && e.lender.get().is_some()
        && crate::control::swap::backs(e, ordinal, &charge)
        && !stream.is_some_and(crate::driver::table::stream_capturing);
    let Some(id) = id.or_else(|| e.current().map(|c| c.id)) else {
        e.release(charge.device, charge.bytes);
        return e.untracked(real);
    };
    if swapped {
        return crate::control::swap::allocate(e, ordinal, e.contexts.handle(id), charge, out);
    }
    let status = e.physical(&mut real);
    // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
    settle(e, status, charge, unsafe { read(out) }, path, Context::Tracked(id))
}

/// Inlined whole into its exported hook, as `mem_free` is: each hot path is then one
/// stretch of code, fewer instruction-cache lines and pages to fetch again after the
/// driver's system calls evicted them (20 ns less a pair on simgpu).
#[inline(always)]
pub(crate) fn mem_alloc(dptr: *mut CUdeviceptr, size: usize) -> Status {
    linear(size as u64, Path::Linear, dptr, || call_real!(cuMemAlloc_v2(dptr, size)))
}

pub(crate) fn mem_alloc_managed(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) -> Status {
    linear(size as u64, Path::Managed, dptr, || call_real!(cuMemAllocManaged(dptr, size, flags)))
}

/// Pitched: the driver picks the pitch, so the charge is width × height first and
/// topped up to the real pitch × height once known.
pub(crate) fn mem_alloc_pitch(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> Status {
    pitched(
        width as u64,
        height as u64,
        || call_real!(cuMemAllocPitch_v2(dptr, pitch, width, height, elem)),
        // SAFETY: `dptr` and `pitch` are what the caller passed: null or readable values of their types (the API's contract).
        || Some((unsafe { read(dptr) }?, unsafe { read(pitch) }? as u64)),
        |p| call_real!(cuMemFree_v2(p)),
    )
}

/// `mem_alloc_pitch` for any width of pointer: `made` reads back the address and pitch,
/// `free` undoes the allocation.
fn pitched(
    width: u64,
    height: u64,
    real: impl FnMut() -> Status,
    made: impl Fn() -> Option<(u64, u64)>,
    free: impl FnOnce(u64) -> Status,
) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(Current { id, ordinal }) = e.current() else { return e.untracked(real) };
    let estimate = width.saturating_mul(height);
    let mut charge = match e.charge(ordinal, estimate) {
        Ok(c) => c,
        Err(status) => return status,
    };
    let status = e.physical(real);
    if status == SUCCESS {
        let actual = made().map_or(estimate, |(_, p)| p.saturating_mul(height));
        if actual > estimate {
            match e.charge(ordinal, actual - estimate) {
                Ok(extra) => {
                    charge.bytes = actual;
                    charge.above_request |= extra.above_request;
                }
                Err(refused) => {
                    if let Some((p, _)) = made() {
                        free(p);
                    }
                    e.release(charge.device, charge.bytes);
                    return refused;
                }
            }
        }
    }
    settle(e, status, charge, made().map(|(p, _)| p), Path::Pitched, Context::Tracked(id))
}

/// The pre-3.2 entry points the real driver still exports, with 32-bit addresses and
/// sizes (`CUdeviceptr_v1`): counted exactly as their current versions.
pub(crate) fn mem_alloc_v1(dptr: *mut c_uint, size: c_uint) -> Status {
    let real = || call_real!(cuMemAlloc(dptr, size));
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(Current { id, ordinal }) = e.current() else { return e.untracked(real) };
    let charge = match e.charge(ordinal, u64::from(size)) {
        Ok(c) => c,
        Err(status) => return status,
    };
    let status = e.physical(real);
    // SAFETY: `dptr` is what the caller passed: null or a readable value of its type (the API's contract).
    settle(e, status, charge, unsafe { read(dptr) }.map(u64::from), Path::Linear, Context::Tracked(id))
}

pub(crate) fn mem_alloc_pitch_v1(
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    elem: c_uint,
) -> Status {
    pitched(
        u64::from(width),
        u64::from(height),
        || call_real!(cuMemAllocPitch(dptr, pitch, width, height, elem)),
        // SAFETY: `dptr` and `pitch` are what the caller passed: null or readable values of their types (the API's contract).
        || Some((u64::from(unsafe { read(dptr) }?), u64::from(unsafe { read(pitch) }?))),
        // Only an address the 32-bit entry point gave, which fits in 32 bits.
        |p| call_real!(cuMemFree(p as c_uint)),
    )
}

pub(crate) fn mem_free_v1(dptr: c_uint) -> Status {
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    free(u64::from(dptr), |e| &e.pointers, || call_real!(cuMemFree(dptr)))
}

/// Frees memory recorded under `key`: the record goes first (so an address reused by
/// another thread at once is not confused with this one) and comes back if the driver
/// refuses.
fn free(
    key: u64,
    table: impl Fn(&Enforcer) -> &crate::books::records::Records,
    real: impl FnOnce() -> Status,
) -> Status {
    let Some(e) = enforcer() else { return real() };
    free_recorded(e, key, table(e), real)
}

/// `free` with the enforcer and the table at hand.
#[inline(always)]
fn free_recorded(
    e: &Enforcer,
    key: u64,
    table: &crate::books::records::Records,
    real: impl FnOnce() -> Status,
) -> Status {
    let record = table.remove(key);
    let status = real();
    if let Some(r) = record {
        if status == SUCCESS {
            // Memory an IPC handle shares may live on in its importers: see `ipc_get_mem_handle`.
            if r.path != Path::Shared {
                e.release(r.device, r.bytes);
            }
        } else {
            table.insert(key, r);
        }
    }
    status
}

/// `swap::free`, asked only where swap may have backed an allocation: it backs them only
/// in a process with an arbiter (`swap::backs`), so without one there is nothing to ask.
#[inline]
fn swap_free(e: &Enforcer, dptr: CUdeviceptr, stream: Option<Ptr>) -> Option<Status> {
    e.lender.get()?;
    crate::control::swap::free(e, dptr, stream)
}

/// The hot path of a free: the park check, the enforcer, one load each for swap (with
/// an arbiter only) and the pools, one record swapped out, the driver, one ledger
/// subtraction.
#[inline(always)]
pub(crate) fn mem_free(dptr: CUdeviceptr) -> Status {
    // A parked process's memory is not on the device: a free waits for the wake too.
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let real = || call_real!(cuMemFree_v2(dptr));
    let Some(e) = enforcer() else { return real() };
    if let Some(status) = swap_free(e, dptr, None) {
        return status;
    }
    // A synchronous free of a pooled allocation returns it to its pool too.
    if let Some(status) = e.pools.free(e, dptr, real) {
        return status;
    }
    free_recorded(e, dptr, &e.pointers, real)
}

/// A stream-ordered allocation, from `pool` or (without one) from the current pool of
/// the stream's device. Its pool's book charges it (see `pools`), except when the stream
/// is being captured into a graph (the graph's memory pool is charged instead, see
/// `graphs`), when the pool is not one of a device's, and when swap backs it with the
/// VMM API.
fn pooled(
    size: usize,
    dptr: *mut CUdeviceptr,
    pool: Option<Ptr>,
    stream: Ptr,
    mut real: impl FnMut() -> Status,
    free: impl FnOnce(CUdeviceptr) -> Status,
) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    // Captured into a graph: the address of one of its allocation nodes, which takes
    // memory only when the graph runs, from the graph pool (charged there: `graphs`).
    if crate::driver::table::stream_capturing(stream) {
        return real();
    }
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(Current { id, ordinal }) = e.current() else { return e.untracked(real) };
    let bytes = size as u64;
    let target = match pool {
        _ if dptr.is_null() => None,
        Some(pool) => pools::pool_ordinal(e, pool).map(|ordinal| Target { pool, ordinal, context: None }),
        None => pools::stream_pool(e, stream, ordinal),
    }
    .map(|t| Target { context: Some(id), ..t });
    let Some(target) = target else { return stream_ordered(bytes, Path::Pooled, Some(stream), dptr, real) };
    if swapping(e) {
        // Charged whole first, so that swap backs exactly the allocations it did before.
        let charge = match e.charge(target.ordinal, bytes) {
            Ok(c) => c,
            Err(status) => return status,
        };
        if crate::control::swap::backs(e, target.ordinal, &charge) {
            return crate::control::swap::allocate(e, target.ordinal, e.contexts.handle(id), charge, dptr);
        }
        e.release(charge.device, charge.bytes);
    }
    e.pools.allocate(e, target, bytes, dptr, &mut real, free)
}

/// A pooled allocation freed back (its charge refused): waits for `stream` to reach the
/// free, so that the pool holds the block again and can be trimmed.
fn free_and_wait(stream: Ptr, freed: Status) -> Status {
    call_real!(cuStreamSynchronize(stream));
    freed
}

/// Whether swap may back allocations with the VMM API in this process.
fn swapping(e: &Enforcer) -> bool {
    (e.config.resolver == gpufrac_common::Resolver::Swap || crate::control::park::parkable())
        && e.lender.get().is_some()
}

pub(crate) fn mem_alloc_async(dptr: *mut CUdeviceptr, size: usize, stream: Ptr) -> Status {
    pooled(
        size,
        dptr,
        None,
        stream,
        || call_real!(cuMemAllocAsync(dptr, size, stream)),
        |p| free_and_wait(stream, call_real!(cuMemFreeAsync(p, stream))),
    )
}

pub(crate) fn mem_alloc_async_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: Ptr) -> Status {
    pooled(
        size,
        dptr,
        None,
        stream,
        || call_real!(cuMemAllocAsync_ptsz(dptr, size, stream)),
        |p| free_and_wait(stream, call_real!(cuMemFreeAsync_ptsz(p, stream))),
    )
}

pub(crate) fn mem_alloc_from_pool_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Ptr,
    stream: Ptr,
) -> Status {
    pooled(
        size,
        dptr,
        Some(pool),
        stream,
        || call_real!(cuMemAllocFromPoolAsync(dptr, size, pool, stream)),
        |p| free_and_wait(stream, call_real!(cuMemFreeAsync(p, stream))),
    )
}

pub(crate) fn mem_alloc_from_pool_async_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Ptr,
    stream: Ptr,
) -> Status {
    pooled(
        size,
        dptr,
        Some(pool),
        stream,
        || call_real!(cuMemAllocFromPoolAsync_ptsz(dptr, size, pool, stream)),
        |p| free_and_wait(stream, call_real!(cuMemFreeAsync_ptsz(p, stream))),
    )
}

/// An async free: memory from a pool stays charged in the pool's cache (the pool keeps
/// it); any other memory (`cuMemAlloc`'d, or a graph's) is given back at the call.
pub(crate) fn mem_free_async(dptr: CUdeviceptr, stream: Ptr) -> Status {
    // A parked process's memory is not on the device: a free waits for the wake too.
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    free_async(dptr, stream, || call_real!(cuMemFreeAsync(dptr, stream)))
}

pub(crate) fn mem_free_async_ptsz(dptr: CUdeviceptr, stream: Ptr) -> Status {
    // A parked process's memory is not on the device: a free waits for the wake too.
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    free_async(dptr, stream, || call_real!(cuMemFreeAsync_ptsz(dptr, stream)))
}

/// `cuMemFreeAsync` by way of `real` (the legacy or the per-thread stream's entry point).
fn free_async(dptr: CUdeviceptr, stream: Ptr, real: impl Fn() -> Status + Copy) -> Status {
    let Some(e) = enforcer() else { return real() };
    if let Some(status) = swap_free(e, dptr, Some(stream)) {
        return status;
    }
    if let Some(status) = e.pools.free(e, dptr, real) {
        return status;
    }
    free_recorded(e, dptr, &e.pointers, real)
}

/// A pool made on a device is known from the start, so allocations from it are charged
/// to its device whatever context is current.
pub(crate) fn mem_pool_create(pool: *mut Ptr, props: *const c_void) -> Status {
    let status = call_real!(cuMemPoolCreate(pool, props));
    if let (SUCCESS, Some(e), Some(handle), Some(head)) =
        // SAFETY: `pool` and `props` are what the caller passed: null or readable values of their types (the API's contract).
        (status, enforcer(), unsafe { read(pool) }, unsafe { read(props.cast::<PropHead>()) })
    {
        // CU_MEM_LOCATION_TYPE_DEVICE: pools of host memory are not device memory.
        if head.location_type == 1 && head.location_id >= 0 {
            e.pools.created(e, handle as usize, head.location_id as usize);
        }
    }
    status
}

/// A destroyed pool's cache goes back; its live allocations keep their charge until freed.
pub(crate) fn mem_pool_destroy(pool: Ptr) -> Status {
    let status = call_real!(cuMemPoolDestroy(pool));
    if let (SUCCESS, Some(e)) = (status, enforcer()) {
        e.pools.destroyed(e, pool as usize);
    }
    status
}

/// The program trimmed a pool: what it no longer reserves goes back.
pub(crate) fn mem_pool_trim_to(pool: Ptr, keep: usize) -> Status {
    let status = call_real!(cuMemPoolTrimTo(pool, keep));
    if let (SUCCESS, Some(e)) = (status, enforcer()) {
        e.pools.reconcile(e, None, false);
    }
    status
}

/// Arrays: charged from the descriptor before creation, then corrected to the size the
/// driver reports (`cuArrayGetMemoryRequirements`). A format the shim cannot size is
/// charged by that report alone, and an array whose size neither gives is destroyed and
/// refused: an array outside the count would be memory past the limit.
fn array(estimate: Option<u64>, out: *mut Ptr, mipmapped: bool, mut real: impl FnMut() -> Status) -> Status {
    let Some(e) = enforcer() else { return refused().unwrap_or_else(&mut real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    let Some(Current { id, ordinal }) = e.current() else { return e.untracked(real) };
    let known = estimate.is_some();
    let estimate = estimate.unwrap_or(0);
    let mut charge = match e.charge(ordinal, estimate) {
        Ok(c) => c,
        Err(status) => return status,
    };
    let status = e.physical(real);
    // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
    let handle = unsafe { read(out) }.filter(|_| status == SUCCESS);
    if let Some(h) = handle {
        let destroy = || {
            if mipmapped {
                call_real!(cuMipmappedArrayDestroy(h));
            } else {
                call_real!(cuArrayDestroy(h));
            }
        };
        let mut req = [0usize; 4];
        let asked = if mipmapped {
            call_real!(cuMipmappedArrayGetMemoryRequirements(&mut req, h, ordinal as i32))
        } else {
            call_real!(cuArrayGetMemoryRequirements(&mut req, h, ordinal as i32))
        };
        let actual = req[0] as u64;
        if asked != SUCCESS && !known {
            destroy();
            e.release(charge.device, charge.bytes);
            tracing::warn!(
                ordinal,
                "gpufrac: refused an array in a format gpufrac cannot size (the driver did not report its memory requirements)"
            );
            return crate::driver::ffi::NOT_SUPPORTED;
        }
        if asked == SUCCESS && actual > estimate {
            if e.charge(ordinal, actual - estimate).is_err() {
                destroy();
                e.release(charge.device, charge.bytes);
                return OUT_OF_MEMORY;
            }
            charge.bytes = actual;
        } else if asked == SUCCESS && actual < estimate {
            e.release(charge.device, estimate - actual);
            charge.bytes = actual;
        }
    }
    let path = if mipmapped { Path::Mipmapped } else { Path::Array };
    settle(e, status, charge, handle.map(|h| h as u64), path, Context::Tracked(id))
}

pub(crate) fn array_create_v1(out: *mut Ptr, desc: *const c_void) -> Status {
    // SAFETY: `desc` is what the caller passed: null or a readable value of its type (the API's contract).
    let estimate = unsafe { read(desc.cast::<ArrayDescriptorV1>()) }
        .and_then(|d| array_bytes(d.width.into(), d.height.into(), 0, d.format, d.channels));
    array(estimate, out, false, || call_real!(cuArrayCreate(out, desc)))
}

pub(crate) fn array_3d_create_v1(out: *mut Ptr, desc: *const c_void) -> Status {
    // SAFETY: `desc` is what the caller passed: null or a readable value of its type (the API's contract).
    let estimate = unsafe { read(desc.cast::<Array3DDescriptorV1>()) }
        .and_then(|d| array_bytes(d.width.into(), d.height.into(), d.depth.into(), d.format, d.channels));
    array(estimate, out, false, || call_real!(cuArray3DCreate(out, desc)))
}

pub(crate) fn array_create(out: *mut Ptr, desc: *const c_void) -> Status {
    // SAFETY: `desc` is what the caller passed: null or a readable value of its type (the API's contract).
    let estimate = unsafe { read(desc.cast::<ArrayDescriptor>()) }
        .and_then(|d| array_bytes(d.width as u64, d.height as u64, 0, d.format, d.channels));
    array(estimate, out, false, || call_real!(cuArrayCreate_v2(out, desc)))
}

pub(crate) fn array_3d_create(out: *mut Ptr, desc: *const c_void) -> Status {
    // SAFETY: `desc` is what the caller passed: null or a readable value of its type (the API's contract).
    let estimate = unsafe { read(desc.cast::<Array3DDescriptor>()) }
        .and_then(|d| array_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.channels));
    array(estimate, out, false, || call_real!(cuArray3DCreate_v2(out, desc)))
}

pub(crate) fn mipmapped_array_create(out: *mut Ptr, desc: *const c_void, levels: c_uint) -> Status {
    // SAFETY: `desc` is what the caller passed: null or a readable value of its type (the API's contract).
    let estimate = unsafe { read(desc.cast::<Array3DDescriptor>()) }.and_then(|d| {
        mipmapped_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.channels, levels)
    });
    array(estimate, out, true, || call_real!(cuMipmappedArrayCreate(out, desc, levels)))
}

pub(crate) fn array_destroy(handle: Ptr) -> Status {
    free(handle as u64, |e| &e.arrays, || call_real!(cuArrayDestroy(handle)))
}

pub(crate) fn mipmapped_array_destroy(handle: Ptr) -> Status {
    free(handle as u64, |e| &e.arrays, || call_real!(cuMipmappedArrayDestroy(handle)))
}

/// Gives back the charge of physical allocation `handle`, which this process no longer
/// references or maps, unless it was exported: another process may have imported it and
/// keep the memory alive however long it likes, where no hook of this process sees it, so
/// an exported allocation stays charged to this group until the process ends. A loop of
/// export, import elsewhere and release therefore fills the exporter's limit, never more.
fn physical_gone(e: &Enforcer, handle: u64, exported: bool) {
    let Some(r) = e.physical.remove(handle) else { return };
    if exported {
        tracing::debug!(
            bytes = r.bytes,
            "released an exported allocation: it stays charged (an importer may keep it alive)"
        );
    } else {
        e.release(r.device, r.bytes);
    }
}

/// `cuIpcGetMemHandle`: another process may now open the allocation, and the driver
/// keeps the memory for as long as any importer has it open, after this process frees it
/// (the documentation calls that order undefined; simgpu models the driver keeping it, as
/// it keeps every shared memory descriptor), where no hook of this process sees it. So,
/// as exported VMM memory, it stays charged to this group until the process ends: a loop
/// of taking a handle, an import elsewhere and a free fills the exporter's limit, never
/// more. Importers take no memory by opening it and are charged nothing: counted once,
/// on the GPU that holds it.
pub(crate) fn ipc_get_mem_handle(handle: Ptr, dptr: CUdeviceptr) -> Status {
    let status = call_real!(cuIpcGetMemHandle(handle, dptr));
    if let (Some(e), SUCCESS) = (enforcer(), status) {
        // The driver takes only the base of a cuMemAlloc allocation, which is its key.
        if let Some(mut r) = e.pointers.remove(dptr) {
            if r.path != Path::Shared {
                tracing::debug!(
                    bytes = r.bytes,
                    "an IPC handle was taken: the allocation stays charged after its free"
                );
            }
            r.path = Path::Shared;
            e.pointers.insert(dptr, r);
        }
    }
    status
}

/// `cuMemExportToShareableHandle`: the allocation may now outlive this process's handles.
pub(crate) fn mem_export(shareable: Ptr, handle: c_ulonglong, kind: c_int, flags: c_ulonglong) -> Status {
    let status = call_real!(cuMemExportToShareableHandle(shareable, handle, kind, flags));
    if let (Some(e), SUCCESS) = (enforcer(), status) {
        book(e).exported.insert(handle);
    }
    status
}

fn book(e: &Enforcer) -> std::sync::MutexGuard<'_, crate::enforcer::vmm::VmmBook> {
    e.vmm.lock().unwrap_or_else(|p| p.into_inner())
}

/// `CUmemAllocationProp`'s leading fields: the location's device is at byte 12.
#[repr(C)]
#[derive(Clone, Copy)]
struct PropHead {
    alloc_type: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
}

pub(crate) fn mem_create(
    handle: *mut c_ulonglong,
    size: usize,
    prop: *const c_void,
    flags: c_ulonglong,
) -> Status {
    let real = || call_real!(cuMemCreate(handle, size, prop, flags));
    let Some(e) = enforcer() else { return refused().unwrap_or_else(real) };
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    // SAFETY: `prop` is what the caller passed: null or a readable value of its type (the API's contract).
    let Some(head) = (unsafe { read(prop.cast::<PropHead>()) }) else { return real() };
    if head.location_type != 1 || head.location_id < 0 {
        return real();
    }
    let charge = match e.charge(head.location_id as usize, size as u64) {
        Ok(c) => c,
        Err(status) => return status,
    };
    let status = e.physical(real);
    // SAFETY: `handle` is what the caller passed: null or a readable value of its type (the API's contract).
    if let (SUCCESS, Some(h)) = (status, unsafe { read(handle) }) {
        book(e).handles.insert(h, (1, 0));
    }
    // SAFETY: `handle` is what the caller passed: null or a readable value of its type (the API's contract).
    settle(e, status, charge, unsafe { read(handle) }, Path::Physical, Context::Unbound)
}

pub(crate) fn mem_release(handle: c_ulonglong) -> Status {
    let status = call_real!(cuMemRelease(handle));
    if let (Some(e), SUCCESS) = (enforcer(), status) {
        let mut book = book(e);
        if let Some(entry) = book.handles.get_mut(&handle) {
            entry.0 = entry.0.saturating_sub(1);
        }
        if book.unused(handle) {
            let exported = book.exported.remove(&handle);
            drop(book);
            physical_gone(e, handle, exported);
        }
    }
    status
}

pub(crate) fn mem_retain_allocation_handle(handle: *mut c_ulonglong, addr: Ptr) -> Status {
    let status = call_real!(cuMemRetainAllocationHandle(handle, addr));
    // SAFETY: `handle` is what the caller passed: null or a readable value of its type (the API's contract).
    if let (Some(e), SUCCESS, Some(h)) = (enforcer(), status, unsafe { read(handle) }) {
        if let Some(entry) = book(e).handles.get_mut(&h) {
            entry.0 += 1;
        }
    }
    status
}

pub(crate) fn mem_map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: c_ulonglong,
    flags: c_ulonglong,
) -> Status {
    let status = call_real!(cuMemMap(ptr, size, offset, handle, flags));
    if let (Some(e), SUCCESS) = (enforcer(), status) {
        let mut book = book(e);
        if let Some(entry) = book.handles.get_mut(&handle) {
            entry.1 += 1;
            book.mappings.insert(ptr, (handle, size as u64));
        }
    }
    status
}

pub(crate) fn mem_unmap(ptr: CUdeviceptr, size: usize) -> Status {
    let status = call_real!(cuMemUnmap(ptr, size));
    if let (Some(e), SUCCESS) = (enforcer(), status) {
        let mut book = book(e);
        let gone: Vec<(u64, u64)> =
            book.mappings.range(ptr..ptr.saturating_add(size as u64)).map(|(&a, &(h, _))| (a, h)).collect();
        let mut freed = Vec::new();
        for (addr, h) in gone {
            book.mappings.remove(&addr);
            if let Some(entry) = book.handles.get_mut(&h) {
                entry.1 = entry.1.saturating_sub(1);
            }
            if book.unused(h) {
                let exported = book.exported.remove(&h);
                freed.push((h, exported));
            }
        }
        drop(book);
        for (h, exported) in freed {
            physical_gone(e, h, exported);
        }
    }
    status
}
