//! One record per live allocation: what it is, where, how big, and whether it lies above
//! the group's request (what swap will move later). A fixed-size open-addressing table
//! updated with compare-and-swap only: recording and forgetting an allocation costs a
//! few atomics, never a lock. A table that fills up spills into a locked map.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl Path {
    fn from_bits(bits: u64) -> Option<Path> {
        Some(match bits {
            1 => Path::Linear,
            2 => Path::Pitched,
            3 => Path::Managed,
            4 => Path::Pooled,
            5 => Path::Array,
            6 => Path::Mipmapped,
            7 => Path::Physical,
            _ => return None,
        })
    }
}

/// What is recorded of one allocation, packed into one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Bytes charged for it.
    pub bytes: u64,
    /// The ledger's device index.
    pub device: usize,
    /// The context it belongs to (its index in the context table), if any.
    pub context: Option<usize>,
    /// How it was made.
    pub path: Path,
    /// Whether any of it lies above the group's request.
    pub above_request: bool,
}

const BYTES_BITS: u32 = 44;
const NO_CONTEXT: u64 = 0x3f;

impl Record {
    fn pack(self) -> u64 {
        debug_assert!(self.bytes < 1 << BYTES_BITS);
        (self.bytes & ((1 << BYTES_BITS) - 1))
            | ((self.device as u64 & 0xf) << 44)
            | ((self.path as u64) << 48)
            | (self.context.map_or(NO_CONTEXT, |c| c as u64 & 0x3f) << 52)
            | ((self.above_request as u64) << 58)
            | (1 << 59)
    }

    fn unpack(word: u64) -> Option<Record> {
        let context = (word >> 52) & 0x3f;
        Some(Record {
            bytes: word & ((1 << BYTES_BITS) - 1),
            device: ((word >> 44) & 0xf) as usize,
            path: Path::from_bits((word >> 48) & 0xf)?,
            context: (context != NO_CONTEXT).then_some(context as usize),
            above_request: (word >> 58) & 1 == 1,
        })
    }

    /// Whether this record fits the packed form (allocations below 16 TiB).
    fn packable(&self) -> bool {
        self.bytes < 1 << BYTES_BITS
    }
}

/// One slot: a key and its packed record, on one cache line with its neighbours.
#[repr(C, align(16))]
struct Slot {
    key: AtomicU64,
    word: AtomicU64,
}

/// Live allocations by key (device address, array handle or physical handle).
pub struct Records {
    slots: Box<[Slot]>,
    mask: usize,
    overflow: Mutex<HashMap<u64, Record>>,
}

impl Records {
    /// A table for about `capacity` live allocations (rounded up to a power of two).
    pub fn new(capacity: usize) -> Records {
        let cap = capacity.next_power_of_two().max(16);
        Records {
            slots: (0..cap).map(|_| Slot { key: AtomicU64::new(EMPTY), word: AtomicU64::new(0) }).collect(),
            mask: cap - 1,
            overflow: Mutex::new(HashMap::new()),
        }
    }

    fn start(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & self.mask
    }

    /// Records `key`. Keys are unique while live (the driver never hands out a live
    /// address twice), so no check for an existing entry is needed.
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
        self.overflow.lock().unwrap_or_else(|p| p.into_inner()).insert(key, record);
    }

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

    /// Forgets `key`, returning its record. Of two threads freeing the same key, one gets it.
    pub fn remove(&self, key: u64) -> Option<Record> {
        if let Some(i) = self.find(key) {
            let word = self.slots[i].word.swap(0, Ordering::AcqRel);
            if word != 0
                && self.slots[i]
                    .key
                    .compare_exchange(key, TOMBSTONE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return Record::unpack(word);
            }
        }
        self.overflow.lock().unwrap_or_else(|p| p.into_inner()).remove(&key)
    }

    /// The record of `key`, if live.
    pub fn get(&self, key: u64) -> Option<Record> {
        if let Some(i) = self.find(key) {
            if let Some(r) = Record::unpack(self.slots[i].word.load(Ordering::Acquire)) {
                return Some(r);
            }
        }
        self.overflow.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied()
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
        let mut overflow = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        let keys: Vec<u64> = overflow.iter().filter(|(_, r)| pred(r)).map(|(&k, _)| k).collect();
        out.extend(keys.into_iter().filter_map(|k| overflow.remove(&k).map(|r| (k, r))));
        out
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
        out.extend(self.overflow.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(&k, &r)| (k, r)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bytes: u64, ctx: Option<usize>) -> Record {
        Record { bytes, device: 3, context: ctx, path: Path::Pitched, above_request: true }
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
}
