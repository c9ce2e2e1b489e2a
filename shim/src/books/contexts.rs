//! The contexts this process made through the shim (or adopted): handle, CUDA ordinal and
//! the memory each was charged, in fixed slots read without a lock.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// Most contexts tracked at once. A context past it is refused (`CUDA_ERROR_OUT_OF_MEMORY`,
/// destroyed again), never left outside the count: each takes hundreds of MiB on a real
/// GPU, so no program reaches this by using its memory.
pub(crate) const MAX_CONTEXTS: usize = crate::books::records::MAX_RECORD_CONTEXTS;

/// Contexts created through the shim: their handle, CUDA ordinal and measured memory.
pub(crate) struct Contexts {
    handles: [AtomicU64; MAX_CONTEXTS],
    ordinals: [AtomicU32; MAX_CONTEXTS],
    charged: [AtomicU64; MAX_CONTEXTS],
    primary: [AtomicBool; MAX_CONTEXTS],
    /// One past the highest slot ever used: lookups scan no further.
    used: AtomicU32,
    /// Serialises creation and teardown (rare), not lookups.
    pub(crate) changes: Mutex<()>,
}

/// The current context as the allocation hooks need it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Current {
    pub id: usize,
    pub ordinal: usize,
}

impl Contexts {
    pub(crate) fn new() -> Contexts {
        Contexts {
            handles: std::array::from_fn(|_| AtomicU64::new(0)),
            ordinals: std::array::from_fn(|_| AtomicU32::new(0)),
            charged: std::array::from_fn(|_| AtomicU64::new(0)),
            primary: std::array::from_fn(|_| AtomicBool::new(false)),
            used: AtomicU32::new(0),
            changes: Mutex::new(()),
        }
    }

    /// The id of context `handle`, if tracked.
    #[inline]
    pub(crate) fn find(&self, handle: u64) -> Option<usize> {
        let used = (self.used.load(Ordering::Acquire) as usize).min(MAX_CONTEXTS);
        self.handles[..used].iter().position(|h| h.load(Ordering::Acquire) == handle)
    }

    /// The primary context of `ordinal`, if tracked.
    pub(crate) fn primary_of(&self, ordinal: usize) -> Option<usize> {
        (0..MAX_CONTEXTS).find(|&i| {
            self.handles[i].load(Ordering::Acquire) != 0
                && self.primary[i].load(Ordering::Relaxed)
                && self.ordinals[i].load(Ordering::Relaxed) as usize == ordinal
        })
    }

    /// Tracks a context; returns its id and whether it is new (an existing one keeps its
    /// charge), or `None` when every slot is taken.
    pub(crate) fn add(
        &self,
        handle: u64,
        ordinal: usize,
        charged: u64,
        primary: bool,
    ) -> Option<(usize, bool)> {
        if let Some(id) = self.find(handle) {
            return Some((id, false));
        }
        for i in 0..MAX_CONTEXTS {
            if self.handles[i].compare_exchange(0, handle, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                self.ordinals[i].store(ordinal as u32, Ordering::Relaxed);
                self.charged[i].store(charged, Ordering::Relaxed);
                self.primary[i].store(primary, Ordering::Relaxed);
                self.used.fetch_max(i as u32 + 1, Ordering::AcqRel);
                return Some((i, true));
            }
        }
        None
    }

    /// Adds `bytes` to what context `id` holds beyond its allocations (its device heap,
    /// stack and printf FIFO), given back with it.
    pub(crate) fn add_charge(&self, id: usize, bytes: u64) {
        self.charged[id].fetch_add(bytes, Ordering::AcqRel);
    }

    /// Takes up to `bytes` off context `id`'s own charge; returns what was taken.
    pub(crate) fn take_charge(&self, id: usize, bytes: u64) -> u64 {
        let mut taken = 0;
        let _ = self.charged[id].fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            taken = held.min(bytes);
            Some(held - taken)
        });
        taken
    }

    /// The CUDA ordinal of context `id`.
    pub(crate) fn ordinal(&self, id: usize) -> usize {
        self.ordinals[id].load(Ordering::Relaxed) as usize
    }

    /// The driver's handle of context `id`.
    pub(crate) fn handle(&self, id: usize) -> u64 {
        self.handles[id].load(Ordering::Acquire)
    }

    /// Stops tracking context `id`; returns (ordinal, charged bytes).
    pub(crate) fn remove(&self, id: usize) -> (usize, u64) {
        let ordinal = self.ordinals[id].load(Ordering::Relaxed) as usize;
        let charged = self.charged[id].swap(0, Ordering::AcqRel);
        self.handles[id].store(0, Ordering::Release);
        (ordinal, charged)
    }
}
