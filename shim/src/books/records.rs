//! One record per live allocation: what it is, where, how big, and whether it lies above
//! the group's request (what swap will move later). A fixed-size open-addressing table
//! updated with atomics only: recording an allocation is one compare-and-swap, forgetting
//! it one swap (and a plain store), never a lock. A table that fills up spills into a
//! locked map, which is looked at only while it holds something.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = u64::MAX;

/// How an allocation was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Path {
    /// `cuMemAlloc`.
    Linear = 1,
    /// `cuMemAllocPitch`.
    Pitched = 2,
    /// `cuMemAllocManaged`.
    Managed = 3,
    /// `cuMemAllocAsync` or `cuMemAllocFromPoolAsync`.
    Pooled = 4,
    /// `cuArrayCreate`, `cuArray3DCreate`.
    Array = 5,
    /// `cuMipmappedArrayCreate`.
    Mipmapped = 6,
    /// `cuMemCreate`.
    Physical = 7,
    /// A module's or library's code and globals (`cuModuleLoad*`, `cuLibraryLoad*`).
    Module = 8,
    /// `cuMemAlloc` or pitched memory whose IPC handle was taken (`cuIpcGetMemHandle`):
    /// another process may keep it alive after its free, so its charge outlives the free.
    Shared = 9,
}

impl Path {
    #[inline]
    fn from_bits(bits: u64) -> Option<Path> {
        Some(match bits {
            1 => Path::Linear,
            2 => Path::Pitched,
            3 => Path::Managed,
            4 => Path::Pooled,
            5 => Path::Array,
            6 => Path::Mipmapped,
            7 => Path::Physical,
            8 => Path::Module,
            9 => Path::Shared,
            _ => return None,
        })
    }
}

/// The context an allocation belongs to: the driver frees the allocation with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// Tied to no context (physical memory, `cuMemCreate`).
    Unbound,
    /// The tracked context of this id (`Contexts`).
    Tracked(usize),
    /// The context that was current when it was made, not asked of the driver then: in a
    /// process with one device, the allocation hooks do not ask (see
    /// `memory::stream_ordered`). Asked only before a context may be torn down
    /// (`Enforcer::resolve_contexts`), which turns it into `Tracked`.
    Unresolved,
}

/// What is recorded of one allocation, packed into one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Bytes charged for it.
    pub bytes: u64,
    /// The ledger's device index.
    pub device: usize,
    /// The context it belongs to.
    pub context: Context,
    /// How it was made.
    pub path: Path,
    /// Whether any of it lies above the group's request.
    pub above_request: bool,
}

/// Bits 0-39: bytes; 40-43: device; 44-47: path; 48-57: context; 58: above the request;
/// 59: set (a word of 0 is an empty slot). A larger allocation (1 TiB and up) goes to
/// the overflow map.
const BYTES_BITS: u32 = 40;
const CONTEXT_BITS: u32 = 10;
const UNBOUND: u64 = (1 << CONTEXT_BITS) - 1;
const UNRESOLVED: u64 = UNBOUND - 1;
/// Contexts a record can name: every id below `UNRESOLVED`.
pub(crate) const MAX_RECORD_CONTEXTS: usize = UNRESOLVED as usize;

impl Record {
    #[inline]
    fn pack(self) -> u64 {
        debug_assert!(self.packable());
        (self.bytes & ((1 << BYTES_BITS) - 1))
            | ((self.device as u64 & 0xf) << 40)
            | ((self.path as u64) << 44)
            | (match self.context {
                Context::Unbound => UNBOUND,
                Context::Unresolved => UNRESOLVED,
                Context::Tracked(id) => id as u64 & UNBOUND,
            } << 48)
            | ((self.above_request as u64) << 58)
            | (1 << 59)
    }

    #[inline]
    fn unpack(word: u64) -> Option<Record> {
        let context = match (word >> 48) & UNBOUND {
            UNBOUND => Context::Unbound,
            UNRESOLVED => Context::Unresolved,
            id => Context::Tracked(id as usize),
        };
        Some(Record {
            bytes: word & ((1 << BYTES_BITS) - 1),
            device: ((word >> 40) & 0xf) as usize,
            path: Path::from_bits((word >> 44) & 0xf)?,
            context,
            above_request: (word >> 58) & 1 == 1,
        })
    }

    /// Whether this record fits the packed form (allocations below 1 TiB, a context id
    /// below `MAX_RECORD_CONTEXTS`).
    #[inline]
    fn packable(&self) -> bool {
        self.bytes < 1 << BYTES_BITS
            && match self.context {
                Context::Tracked(id) => id < MAX_RECORD_CONTEXTS,
                Context::Unbound | Context::Unresolved => true,
            }
    }
}

/// One slot: a key and its packed record, on one cache line with its neighbours.
#[repr(C, align(16))]
struct Slot {
    key: AtomicU64,
    word: AtomicU64,
}

/// Live allocations by key (device address, array handle or physical handle).
///
/// A slot's key is claimed with a compare-and-swap (empty or tombstone to the key), then
/// its word is stored. Whoever swaps a non-zero word out of a slot owns its removal: no
/// other thread can take that word, and no inserter can claim the slot while it still
/// holds the key, so the owner turns the key into a tombstone with a plain store.
pub struct Records {
    slots: Box<[Slot]>,
    mask: usize,
    overflow: Mutex<HashMap<u64, Record>>,
    /// Records in `overflow`: a miss in the table looks there only when it is not 0.
    spilled: AtomicUsize,
}

impl Records {
    /// A table for about `capacity` live allocations (rounded up to a power of two).
    pub fn new(capacity: usize) -> Records {
        let cap = capacity.next_power_of_two().max(16);
        Records {
            slots: (0..cap).map(|_| Slot { key: AtomicU64::new(EMPTY), word: AtomicU64::new(0) }).collect(),
            mask: cap - 1,
            overflow: Mutex::new(HashMap::new()),
            spilled: AtomicUsize::new(0),
        }
    }

    #[inline]
    fn start(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & self.mask
    }

    /// Records `key`. Keys are unique while live (the driver never hands out a live
    /// address twice), so no check for an existing entry is needed.
    #[inline(always)]
    pub fn insert(&self, key: u64, record: Record) {
        if key != EMPTY && key != TOMBSTONE && record.packable() {
            let mut i = self.start(key);
            for _ in 0..=self.mask {
                let current = self.slots[i].key.load(Ordering::Relaxed);
                if (current == EMPTY || current == TOMBSTONE)
                    && self.slots[i]
                        .key
                        .compare_exchange(current, key, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    self.slots[i].word.store(record.pack(), Ordering::Release);
                    return;
                }
                i = (i + 1) & self.mask;
            }
        }
        self.spill(key, record);
    }

    /// The table is full (or the record does not pack): the locked map keeps it.
    #[cold]
    #[inline(never)]
    fn spill(&self, key: u64, record: Record) {
        let mut overflow = self.overflow();
        // Counted under the lock, before it can be looked for: a miss that reads 0 here
        // ran before this insert could be seen at all.
        if overflow.insert(key, record).is_none() {
            self.spilled.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn overflow(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Record>> {
        self.overflow.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `key` out of the locked map, if it spilled there.
    #[cold]
    #[inline(never)]
    fn unspill(&self, key: u64) -> Option<Record> {
        let mut overflow = self.overflow();
        let r = overflow.remove(&key);
        if r.is_some() {
            self.spilled.fetch_sub(1, Ordering::AcqRel);
        }
        r
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let mut i = self.start(key);
        for _ in 0..=self.mask {
            match self.slots[i].key.load(Ordering::Acquire) {
                k if k == key => return Some(i),
                EMPTY => return None,
                _ => i = (i + 1) & self.mask,
            }
        }
        None
    }

    /// Forgets `key`, returning its record. Of two threads freeing the same key, one gets
    /// it: the one that swaps the word out. The slot keeps the key until that thread
    /// marks it a tombstone, so no insert can claim the slot in between.
    #[inline(always)]
    pub fn remove(&self, key: u64) -> Option<Record> {
        if let Some(i) = self.find(key) {
            let word = self.slots[i].word.swap(0, Ordering::AcqRel);
            if word != 0 {
                self.slots[i].key.store(TOMBSTONE, Ordering::Release);
                return Record::unpack(word);
            }
        }
        if self.spilled.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.unspill(key)
    }

    /// The record of `key`, if live.
    pub fn get(&self, key: u64) -> Option<Record> {
        if let Some(i) = self.find(key) {
            if let Some(r) = Record::unpack(self.slots[i].word.load(Ordering::Acquire)) {
                return Some(r);
            }
        }
        self.overflow().get(&key).copied()
    }

    /// Removes and returns every record matching `pred` (context teardown; not hot).
    pub fn drain_where(&self, pred: impl Fn(&Record) -> bool) -> Vec<(u64, Record)> {
        let mut out = Vec::new();
        for i in 0..=self.mask {
            let key = self.slots[i].key.load(Ordering::Acquire);
            if key == EMPTY || key == TOMBSTONE {
                continue;
            }
            if Record::unpack(self.slots[i].word.load(Ordering::Acquire)).is_some_and(|r| pred(&r)) {
                if let Some(r) = self.remove(key) {
                    out.push((key, r));
                }
            }
        }
        let mut overflow = self.overflow();
        let keys: Vec<u64> = overflow.iter().filter(|(_, r)| pred(r)).map(|(&k, _)| k).collect();
        for k in keys {
            if let Some(r) = overflow.remove(&k) {
                self.spilled.fetch_sub(1, Ordering::AcqRel);
                out.push((k, r));
            }
        }
        out
    }

    /// Gives each record whose context is `Context::Unresolved` the context `context_of`
    /// answers for its key (`None`: left as it is). A record freed meanwhile is left
    /// alone: its word is replaced only if it is still the one read (not hot).
    pub fn resolve(&self, context_of: impl Fn(u64) -> Option<usize>) {
        for slot in self.slots.iter() {
            let key = slot.key.load(Ordering::Acquire);
            let word = slot.word.load(Ordering::Acquire);
            // The word read belongs to this key only if the slot kept it all along.
            if key == EMPTY || key == TOMBSTONE || slot.key.load(Ordering::Acquire) != key {
                continue;
            }
            let Some(r) = Record::unpack(word).filter(|r| r.context == Context::Unresolved) else { continue };
            let Some(id) = context_of(key) else { continue };
            let resolved = Record { context: Context::Tracked(id), ..r };
            if resolved.packable() {
                // Fails only if the record was freed (or freed and made again) meanwhile.
                let _ =
                    slot.word.compare_exchange(word, resolved.pack(), Ordering::AcqRel, Ordering::Relaxed);
            }
        }
        for (&key, r) in self.overflow().iter_mut() {
            if r.context == Context::Unresolved {
                if let Some(id) = context_of(key) {
                    r.context = Context::Tracked(id);
                }
            }
        }
    }

    /// Every live record (for queries and tests; not hot).
    pub fn snapshot(&self) -> Vec<(u64, Record)> {
        let mut out: Vec<(u64, Record)> = (0..=self.mask)
            .filter_map(|i| {
                let key = self.slots[i].key.load(Ordering::Acquire);
                if key == EMPTY || key == TOMBSTONE {
                    return None;
                }
                Record::unpack(self.slots[i].word.load(Ordering::Acquire)).map(|r| (key, r))
            })
            .collect();
        out.extend(self.overflow().iter().map(|(&k, &r)| (k, r)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bytes: u64, ctx: Option<usize>) -> Record {
        let context = ctx.map_or(Context::Unbound, Context::Tracked);
        Record { bytes, device: 3, context, path: Path::Pitched, above_request: true }
    }

    #[test]
    fn records_round_trip_and_are_removed_once() {
        let t = Records::new(16);
        for k in 1..=40u64 {
            t.insert(k * 4096, rec(k, Some(2)));
        }
        assert_eq!(t.get(4096 * 7), Some(rec(7, Some(2))));
        assert_eq!(t.remove(4096 * 7), Some(rec(7, Some(2))));
        assert_eq!(t.remove(4096 * 7), None);
        assert_eq!(t.snapshot().len(), 39, "past capacity, records spill over and stay findable");
        let drained = t.drain_where(|r| r.bytes % 2 == 0);
        assert_eq!(drained.len(), 20);
        assert_eq!(t.snapshot().len(), 19);
        t.insert(99, rec(1 << 40, None));
        assert_eq!(t.get(99), Some(rec(1 << 40, None)));
    }

    #[test]
    fn every_context_id_and_module_record_round_trips() {
        let t = Records::new(16);
        // The last id a record names in its word, and the ones past it (the overflow map).
        for (key, ctx) in
            [(1u64, 0usize), (2, 63), (3, 64), (4, MAX_RECORD_CONTEXTS - 1), (5, MAX_RECORD_CONTEXTS)]
        {
            let r = Record {
                bytes: 1 << 39,
                device: 15,
                context: Context::Tracked(ctx),
                path: Path::Module,
                above_request: false,
            };
            t.insert(key, r);
            assert_eq!(t.get(key), Some(r), "context {ctx}");
        }
        assert_eq!(t.drain_where(|r| r.context == Context::Tracked(64)).len(), 1);
    }

    #[test]
    fn unresolved_contexts_round_trip_and_resolve_in_place() {
        let t = Records::new(16);
        let unresolved = |bytes| Record { context: Context::Unresolved, ..rec(bytes, None) };
        // 40 records in a table of 16: some in the overflow map.
        for k in 1..=40u64 {
            t.insert(k * 4096, if k % 4 == 0 { rec(k, Some(1)) } else { unresolved(k) });
        }
        t.insert(1 << 60, rec(3, None));
        assert_eq!(t.get(4096), Some(unresolved(1)));
        // Keys below 20 pages were made in context 5, the others in 6; one the driver
        // does not know stays unresolved.
        t.resolve(|key| match key / 4096 {
            7 => None,
            k if k < 20 => Some(5),
            _ => Some(6),
        });
        for k in 1..=40u64 {
            let want = match k {
                _ if k % 4 == 0 => rec(k, Some(1)),
                7 => unresolved(7),
                _ if k < 20 => rec(k, Some(5)),
                _ => rec(k, Some(6)),
            };
            assert_eq!(t.get(k * 4096), Some(want), "record {k}");
        }
        assert_eq!(t.get(1 << 60), Some(rec(3, None)), "an unbound record is no context's");
        assert_eq!(t.drain_where(|r| r.context == Context::Tracked(5)).len(), 14);
    }

    #[test]
    fn racing_removers_of_one_key_get_its_record_once() {
        use std::sync::{Arc, Barrier};
        let t = Arc::new(Records::new(16));
        let threads = 4;
        let start = Arc::new(Barrier::new(threads + 1));
        let done = Arc::new(Barrier::new(threads + 1));
        let got = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let rounds = 2000u64;
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (t, start, done, got) = (t.clone(), start.clone(), done.clone(), got.clone());
                std::thread::spawn(move || {
                    for round in 0..rounds {
                        start.wait();
                        if let Some(r) = t.remove(0x1000 + (round % 8) * 0x1000) {
                            assert_eq!(r, rec(round + 1, Some(1)));
                            got.fetch_add(1, Ordering::Relaxed);
                        }
                        done.wait();
                    }
                })
            })
            .collect();
        for round in 0..rounds {
            t.insert(0x1000 + (round % 8) * 0x1000, rec(round + 1, Some(1)));
            start.wait();
            done.wait();
            assert_eq!(got.swap(0, Ordering::Relaxed), 1, "round {round}: one remover gets the record");
        }
        workers.into_iter().for_each(|w| w.join().unwrap());
        assert!(t.snapshot().is_empty());
    }

    #[test]
    fn threads_recording_and_forgetting_at_once_keep_every_record_exact() {
        let t = std::sync::Arc::new(Records::new(64));
        let workers: Vec<_> = (0..4u64)
            .map(|w| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        // Eight live keys per thread, in a table of 64: collisions and reused
                        // tombstones all the time, and a spill now and then.
                        let key = (w << 32) | ((i % 8 + 1) << 12);
                        let r = rec(i + 1, Some(w as usize));
                        if i >= 8 {
                            assert_eq!(
                                t.remove(key),
                                Some(rec(i - 7, Some(w as usize))),
                                "thread {w}, step {i}"
                            );
                        }
                        t.insert(key, r);
                    }
                })
            })
            .collect();
        workers.into_iter().for_each(|w| w.join().unwrap());
        assert_eq!(t.snapshot().len(), 32);
    }
}
