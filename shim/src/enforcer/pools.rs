//! Stream-ordered memory pools, held to the limit whatever they keep.
//!
//! A pool keeps the memory freed into it (`cuMemFreeAsync`) up to its release threshold,
//! and frameworks set that threshold to the maximum: giving the charge back at the free
//! would let a process hold its limit once in each pool and once more in plain
//! allocations. So a pool's memory stays charged while the pool reserves it. Per pool the
//! shim keeps what is charged for it and what its live allocations use; an allocation is
//! served first from what is charged but unused (the pool's cache), else charged before
//! the driver is asked, and after the call anything more the pool reserved (its chunks
//! are bigger than the allocations) is charged too. When a charge would be refused, on
//! any path, the pools are reconciled with what they really reserve (a pool gives memory
//! above its threshold back at a synchronize), then trimmed, before the refusal stands.
//!
//! Allocation paths only: frees of plain allocations look here only while pooled ones
//! are live (one atomic load otherwise), and launches and copies never do.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::driver::ffi::{CUdeviceptr, Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::Enforcer;

type Ptr = *mut c_void;

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: what the pool holds from the device.
const RESERVED_MEM_CURRENT: c_int = 5;

/// One pool the process allocated from.
#[derive(Debug)]
struct Pool {
    handle: usize,
    /// CUDA ordinal of the pool's device.
    ordinal: usize,
    /// The ledger's index of that device.
    device: usize,
    /// Bytes charged to the group for this pool: its live allocations and its cache.
    charged: u64,
    /// Bytes of live allocations (and of allocations being made from the cache).
    in_use: u64,
    /// Bytes charged to the group for allocations the driver is making from this pool
    /// now: the pool may already reserve them, so they are not growth to charge again.
    pending: u64,
}

/// One live allocation from a pool.
#[derive(Debug, Clone, Copy)]
struct Alloc {
    /// The pool's id (not its handle: a destroyed pool's handle may be reused).
    pool: u64,
    device: usize,
    bytes: u64,
    context: Option<usize>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    pools: HashMap<u64, Pool>,
    by_handle: HashMap<usize, u64>,
    allocs: HashMap<CUdeviceptr, Alloc>,
}

/// The process's pools and their allocations.
#[derive(Debug, Default)]
pub(crate) struct PoolBook {
    inner: Mutex<Inner>,
    /// Pools known: reconciling is a no-op without any.
    pools: AtomicUsize,
    /// Live pooled allocations: frees look in the book only while there are some.
    live: AtomicUsize,
}

/// Where a pooled allocation goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub pool: Ptr,
    pub ordinal: usize,
    /// The context the allocation belongs to (freed with it).
    pub context: Option<usize>,
}

/// `CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_INVALID_HANDLE`: the driver knows no such pool.
const NO_SUCH_POOL: [Status; 2] = [1, 400];

/// What the pool reserves from the device now, if the driver says: nothing for a pool the
/// driver no longer knows (gone with a context reset), `None` if it cannot say.
fn reserved(handle: usize) -> Option<u64> {
    let mut value = 0u64;
    let status = call_real!(cuMemPoolGetAttribute(
        handle as Ptr,
        RESERVED_MEM_CURRENT,
        (&mut value as *mut u64).cast()
    ));
    match status {
        SUCCESS => Some(value),
        gone if NO_SUCH_POOL.contains(&gone) => Some(0),
        _ => None,
    }
}

impl PoolBook {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The id of pool `handle`, made known on device `ordinal` (ledger `device`).
    fn register(&self, inner: &mut Inner, handle: usize, ordinal: usize, device: usize) -> u64 {
        if let Some(&id) = inner.by_handle.get(&handle) {
            return id;
        }
        inner.next_id += 1;
        let id = inner.next_id;
        inner.pools.insert(id, Pool { handle, ordinal, device, charged: 0, in_use: 0, pending: 0 });
        inner.by_handle.insert(handle, id);
        self.pools.fetch_add(1, Ordering::AcqRel);
        id
    }

    /// The CUDA ordinal of a pool seen before.
    pub(crate) fn ordinal_of(&self, handle: usize) -> Option<usize> {
        let inner = self.lock();
        inner.by_handle.get(&handle).and_then(|id| inner.pools.get(id)).map(|p| p.ordinal)
    }

    /// Records a pool the program created on device `ordinal`.
    pub(crate) fn created(&self, e: &Enforcer, handle: usize, ordinal: usize) {
        if let Some(slice) = e.slice(ordinal) {
            let mut inner = self.lock();
            self.register(&mut inner, handle, ordinal, slice.ledger);
        }
    }

    /// Allocates `bytes` from `target` with `real`, charging what the pool's cache does
    /// not cover before the call and what the pool grew beyond its charge after it.
    /// `free` gives the allocation back, and waits for its stream to get there, if that
    /// last charge is refused.
    pub(crate) fn allocate(
        &self,
        e: &Enforcer,
        target: Target,
        bytes: u64,
        out: *mut CUdeviceptr,
        real: impl FnMut() -> Status,
        free: impl FnOnce(CUdeviceptr) -> Status,
    ) -> Status {
        let Some(slice) = e.slice(target.ordinal) else { return OUT_OF_MEMORY };
        let device = slice.ledger;
        let handle = target.pool as usize;
        let (id, cached) = {
            let mut inner = self.lock();
            let id = self.register(&mut inner, handle, target.ordinal, device);
            let Some(pool) = inner.pools.get_mut(&id) else { return OUT_OF_MEMORY };
            let cached = pool.charged.saturating_sub(pool.in_use).min(bytes);
            pool.in_use += cached;
            (id, cached)
        };
        // Charged with the book unlocked: a refused charge reconciles the pools.
        let need = bytes - cached;
        if need > 0 {
            if let Err(status) = e.charge(target.ordinal, need) {
                self.settle(id, cached, 0);
                return status;
            }
            // Known to the pool before the driver is asked: another thread's look at what
            // the pool reserves must not take this allocation for growth to charge.
            self.with_pool(id, |pool| pool.pending += need);
        }
        let status = e.physical(real);
        // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
        let addr = unsafe { crate::driver::ffi::read(out) }.filter(|_| status == SUCCESS);
        let Some(addr) = addr else {
            self.settle(id, cached, need);
            e.release(device, need);
            return status;
        };
        // Whatever the pool reserved beyond its charge (and the charges of allocations
        // under way) is charged now, counted in the book first so that two threads do
        // not both charge the same growth.
        let excess = {
            let mut inner = self.lock();
            inner.allocs.insert(addr, Alloc { pool: id, device, bytes, context: target.context });
            self.live.fetch_add(1, Ordering::AcqRel);
            match inner.pools.get_mut(&id) {
                Some(pool) => {
                    pool.pending = pool.pending.saturating_sub(need);
                    pool.charged += need;
                    pool.in_use += need;
                    let known = pool.charged + pool.pending;
                    let excess = reserved(handle).map_or(0, |r| r.saturating_sub(known));
                    pool.charged += excess;
                    excess
                }
                // Destroyed meanwhile (a program bug): the allocation keeps its charge
                // until freed, as a destroyed pool's live allocations do.
                None => 0,
            }
        };
        if excess > 0 && e.charge(target.ordinal, excess).is_err() {
            {
                let mut inner = self.lock();
                inner.allocs.remove(&addr);
                self.live.fetch_sub(1, Ordering::AcqRel);
                if let Some(pool) = inner.pools.get_mut(&id) {
                    pool.charged = pool.charged.saturating_sub(excess);
                    pool.in_use = pool.in_use.saturating_sub(bytes);
                }
            }
            tracing::debug!(
                ordinal = target.ordinal,
                bytes,
                excess,
                "gpufrac: out of memory: the pool grew past GPUFRAC_MEMORY_LIMIT"
            );
            // The freed block reaches the pool once its stream gets there (`free` waits
            // for that); then trimming gives its memory back.
            free(addr);
            // SAFETY: `out` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { crate::driver::ffi::write(out, 0) };
            call_real!(cuMemPoolTrimTo(target.pool, 0));
            self.reconcile(e, Some(device), false);
            return OUT_OF_MEMORY;
        }
        SUCCESS
    }

    /// Runs `f` on pool `id`, if it is still in the book.
    fn with_pool(&self, id: u64, f: impl FnOnce(&mut Pool)) {
        if let Some(pool) = self.lock().pools.get_mut(&id) {
            f(pool);
        }
    }

    /// An allocation that failed: gives back the `cached` bytes it took from the pool's
    /// cache and forgets the `pending` bytes charged for it.
    fn settle(&self, id: u64, cached: u64, pending: u64) {
        self.with_pool(id, |pool| {
            pool.in_use = pool.in_use.saturating_sub(cached);
            pool.pending = pool.pending.saturating_sub(pending);
        });
    }

    /// Frees `addr` with `real` if it is a pooled allocation (`None` otherwise): its bytes
    /// stay charged in its pool's cache, or go back if the pool was destroyed.
    /// One atomic load while no pooled allocation is live (the plain frees' hot path).
    #[inline]
    pub(crate) fn free(
        &self,
        e: &Enforcer,
        addr: CUdeviceptr,
        real: impl FnOnce() -> Status,
    ) -> Option<Status> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.free_pooled(e, addr, real)
    }

    #[inline(never)]
    fn free_pooled(&self, e: &Enforcer, addr: CUdeviceptr, real: impl FnOnce() -> Status) -> Option<Status> {
        // The record goes first, so an address reused at once by another thread is not
        // confused with this one; it comes back if the driver refuses.
        let alloc = {
            let mut inner = self.lock();
            let alloc = inner.allocs.remove(&addr)?;
            self.live.fetch_sub(1, Ordering::AcqRel);
            alloc
        };
        let status = real();
        let mut inner = self.lock();
        if status != SUCCESS {
            inner.allocs.insert(addr, alloc);
            self.live.fetch_add(1, Ordering::AcqRel);
            return Some(status);
        }
        match inner.pools.get_mut(&alloc.pool) {
            Some(pool) => pool.in_use = pool.in_use.saturating_sub(alloc.bytes),
            None => {
                drop(inner);
                e.release(alloc.device, alloc.bytes);
            }
        }
        Some(status)
    }

    /// Gives back what the pools on ledger device `device` (all, with `None`) are charged
    /// beyond what they reserve, after trimming them to nothing with `trim`. A pool never
    /// keeps less charged than its live allocations use. Returns the bytes given back.
    pub(crate) fn reconcile(&self, e: &Enforcer, device: Option<usize>, trim: bool) -> u64 {
        if self.pools.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut given = Vec::new();
        {
            let mut inner = self.lock();
            for pool in inner.pools.values_mut().filter(|p| device.is_none_or(|d| d == p.device)) {
                if trim {
                    call_real!(cuMemPoolTrimTo(pool.handle as Ptr, 0));
                }
                let Some(reserved) = reserved(pool.handle) else { continue };
                let keep = reserved.max(pool.in_use);
                if pool.charged > keep {
                    given.push((pool.device, pool.charged - keep));
                    pool.charged = keep;
                }
            }
        }
        // Released with the book unlocked: with an arbiter, a release may talk to it.
        given
            .iter()
            .map(|&(device, bytes)| {
                e.release(device, bytes);
                bytes
            })
            .sum()
    }

    /// A charge on ledger device `device` was refused: gives back what the pools no
    /// longer reserve (`stage` 0), then trims them and does it again (`stage` 1). True if
    /// anything came back, so the charge is worth trying again.
    pub(crate) fn reclaim(&self, e: &Enforcer, device: usize, stage: u32) -> bool {
        let given = self.reconcile(e, Some(device), stage > 0);
        if given > 0 {
            tracing::debug!(device, given, stage, "gpufrac: took back memory the process's pools kept");
        }
        given > 0
    }

    /// After `cuMemPoolDestroy`: the pool's cache goes back; its live allocations keep
    /// their charge until freed.
    pub(crate) fn destroyed(&self, e: &Enforcer, handle: usize) {
        let gone = {
            let mut inner = self.lock();
            let Some(id) = inner.by_handle.remove(&handle) else { return };
            self.pools.fetch_sub(1, Ordering::AcqRel);
            inner.pools.remove(&id)
        };
        if let Some(pool) = gone {
            e.release(pool.device, pool.charged.saturating_sub(pool.in_use));
        }
    }

    /// After context `context` was destroyed (the driver freed its allocations into
    /// their pools): those allocations' bytes become their pools' cache.
    pub(crate) fn context_gone(&self, e: &Enforcer, context: usize) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut orphans = Vec::new();
        {
            let mut inner = self.lock();
            let Inner { allocs, pools, .. } = &mut *inner;
            allocs.retain(|_, a| {
                if a.context != Some(context) {
                    return true;
                }
                self.live.fetch_sub(1, Ordering::AcqRel);
                match pools.get_mut(&a.pool) {
                    Some(pool) => pool.in_use = pool.in_use.saturating_sub(a.bytes),
                    None => orphans.push((a.device, a.bytes)),
                }
                false
            });
        }
        for (device, bytes) in orphans {
            e.release(device, bytes);
        }
    }
}

/// The pool `cuMemAllocAsync` on `stream` allocates from: the current pool of the
/// stream's device (the current context's device for the default streams, or a stream
/// whose context the shim does not know).
pub(crate) fn stream_pool(e: &Enforcer, stream: Ptr, current: usize) -> Option<Target> {
    let ordinal = stream_ordinal(e, stream).unwrap_or(current);
    let mut dev = 0;
    let mut pool: Ptr = std::ptr::null_mut();
    let found = call_real!(cuDeviceGet(&mut dev, ordinal as c_int)) == SUCCESS
        && call_real!(cuDeviceGetMemPool(&mut pool, dev)) == SUCCESS
        && !pool.is_null();
    found.then_some(Target { pool, ordinal, context: None })
}

/// The device of `stream`'s context, if the shim tracks that context.
fn stream_ordinal(e: &Enforcer, stream: Ptr) -> Option<usize> {
    // The legacy and per-thread default streams (null, CU_STREAM_LEGACY,
    // CU_STREAM_PER_THREAD) belong to the current context.
    if (stream as usize) <= 2 {
        return None;
    }
    let mut ctx: Ptr = std::ptr::null_mut();
    if call_real!(cuStreamGetCtx(stream, &mut ctx)) != SUCCESS || ctx.is_null() {
        return None;
    }
    let id = e.contexts.find(ctx as u64)?;
    Some(e.contexts.ordinal(id))
}

/// The device of a pool handed to `cuMemAllocFromPoolAsync`: known if the program made
/// it (or allocated from it before), else found among the devices' default and current
/// pools; `None` for a pool of host memory or one imported from another process.
pub(crate) fn pool_ordinal(e: &Enforcer, pool: Ptr) -> Option<usize> {
    if let Some(ordinal) = e.pools.ordinal_of(pool as usize) {
        return Some(ordinal);
    }
    (0..e.device_count()).find(|&ordinal| {
        let mut dev = 0;
        if call_real!(cuDeviceGet(&mut dev, ordinal as c_int)) != SUCCESS {
            return false;
        }
        let mut default: Ptr = std::ptr::null_mut();
        let mut current: Ptr = std::ptr::null_mut();
        (call_real!(cuDeviceGetDefaultMemPool(&mut default, dev)) == SUCCESS && default == pool)
            || (call_real!(cuDeviceGetMemPool(&mut current, dev)) == SUCCESS && current == pool)
    })
}
