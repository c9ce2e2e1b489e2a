//! What a group holds on each device, shared by the group's processes without a daemon
//! (standalone mode).
//!
//! Each member process has a slot with its own held bytes per device; the group holds the
//! sum over live members. A charge adds to the member's own counter first and then checks
//! the sum against the limit, backing out if it is over: two racing threads (or
//! processes) can at worst both back out and retry, never both slip past the limit. The
//! fast path is a handful of atomics. A member killed by SIGKILL keeps nothing: its
//! slot's kernel lock is gone, so the next charge that finds the group full, and every
//! report, forget it (see `gpufrac_common::shm`).
//!
//! A process without `GPUFRAC_GROUP` keeps the same structure in private memory.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use gpufrac_common::shm::{ledgers, sweep_dead, SharedFile, SharedPlain};

/// Most devices a ledger tracks.
pub const MAX_DEVICES: usize = 16;
/// Most processes in one group at once.
pub const MAX_MEMBERS: usize = ledgers::MAX_MEMBERS;

/// Changed whenever the layout changes: a ledger of another layout is started afresh.
const LAYOUT: u64 = 0x44;
const MAGIC: u64 = 0x4750_5546_5241_0000 | LAYOUT << 8 | (std::mem::size_of::<LedgerData>() as u64 & 0xff);
const FREE: u32 = 0;
const LIVE: u32 = 1;

#[repr(C)]
struct DeviceRecord {
    claimed: AtomicU32,
    _pad: AtomicU32,
    uuid: [AtomicU64; 2],
    /// Device memory one context was measured to take, 0 until measured.
    context_bytes: AtomicU64,
}

#[repr(C)]
struct Member {
    state: AtomicU32,
    pid: AtomicU32,
    /// Its PID as the arbiter sees it (the host's, in a container), 0 until known: NVML
    /// lists processes by that PID.
    host_pid: AtomicU32,
    _pad: AtomicU32,
    held: [AtomicU64; MAX_DEVICES],
    /// Burst bytes the arbiter granted to this member (arbiter mode).
    granted: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
struct LedgerData {
    magic: AtomicU64,
    /// One past the highest member slot ever used: sums stop there.
    high_water: AtomicU32,
    _pad: AtomicU32,
    devices: [DeviceRecord; MAX_DEVICES],
    members: [Member; MAX_MEMBERS],
}

// SAFETY: integers and atomics only, C layout.
unsafe impl SharedPlain for LedgerData {}

enum Backing {
    Shared(SharedFile<LedgerData>),
    Private(Box<LedgerData>),
}

/// A charge that does not fit under the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit {
    /// What the group held when refused.
    pub held: u64,
}

/// The group's ledger, with this process's member slot.
pub struct Ledger {
    backing: Backing,
    me: usize,
}

fn uuid_words(uuid: &[u8; 16]) -> [u64; 2] {
    let mut hi = [0u8; 8];
    let mut lo = [0u8; 8];
    hi.copy_from_slice(&uuid[..8]);
    lo.copy_from_slice(&uuid[8..]);
    [u64::from_le_bytes(hi), u64::from_le_bytes(lo)]
}

/// The folder of this user's group ledgers (see `gpufrac_common::shm::ledgers`). It is
/// made mode 0700 and used only if it is a real folder of the effective user's with that
/// mode (see `SharedFile::open_private`), so another user can neither plant links nor
/// pre-create ledgers in it.
pub fn ledger_dir() -> PathBuf {
    ledgers::dir()
}

const LEDGER_SUFFIX: &str = ledgers::SUFFIX;

/// How long an exiting member waits for the table (held for microseconds by joiners and
/// by members leaving at the same moment) before leaving the file to the next sweep. Only
/// a holder stalled meanwhile makes it wait: 10 ms was too little for a member that
/// left at the same moment on a loaded machine (round 3 of `leftovers.rs`'s 20, in one
/// loaded run of the whole suite; not reproduced alone beside busy loops), and the file
/// stayed.
const LEAVE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

fn file_name(group: &str) -> String {
    format!("{group}{LEDGER_SUFFIX}")
}

/// Where a group's ledger lives: in this user's ledger folder, by group name.
pub fn group_path(group: &str) -> PathBuf {
    ledger_dir().join(file_name(group))
}

impl Ledger {
    /// This process alone.
    pub fn private() -> Ledger {
        // SAFETY: LedgerData is SharedPlain: all-zero is a valid value.
        let data = unsafe { Box::<LedgerData>::new_zeroed().assume_init() };
        data.high_water.store(1, Ordering::Relaxed);
        data.members[0].state.store(LIVE, Ordering::Relaxed);
        data.members[0].pid.store(std::process::id(), Ordering::Relaxed);
        Ledger { backing: Backing::Private(data), me: 0 }
    }

    /// Joins (or starts) the ledger of `group`. First removes this user's ledgers whose
    /// members all died (SIGKILL, or SIGTERM and other signals whose default action runs
    /// no exit handler): a handful of system calls per ledger in the folder, once per
    /// process, at its first CUDA or NVML call.
    pub fn join(group: &str) -> io::Result<Ledger> {
        let _ = sweep_dead(&ledger_dir(), LEDGER_SUFFIX, MAX_MEMBERS);
        // A file its last member removed between our opening it and claiming a slot is
        // opened again (created afresh): every live member shares one file.
        for _ in 0..100 {
            if let Some(ledger) = Self::try_join(group)? {
                return Ok(ledger);
            }
        }
        Err(io::Error::other(format!("the ledger of group {group} keeps being removed")))
    }

    fn try_join(group: &str) -> io::Result<Option<Ledger>> {
        let shm = SharedFile::<LedgerData>::open_private(&ledger_dir(), &file_name(group), |shm| {
            let d = shm.get();
            let anyone = d.magic.load(Ordering::Acquire) == MAGIC
                && (0..MAX_MEMBERS)
                    .any(|i| d.members[i].state.load(Ordering::Acquire) == LIVE && shm.slot_alive(i));
            if !anyone {
                // Nobody alive: start afresh (also after an incompatible version).
                // SAFETY: we hold the table lock and no live process uses the mapping;
                // all-zero is a valid LedgerData.
                unsafe { std::ptr::write_bytes(d as *const LedgerData as *mut LedgerData, 0, 1) };
                d.magic.store(MAGIC, Ordering::Release);
            }
        })?;
        let me = {
            let table = shm.lock_table();
            if shm.unlinked(&table) {
                return Ok(None);
            }
            let me = shm.claim_slot(MAX_MEMBERS, &table).ok_or_else(|| {
                io::Error::other(format!("more than {MAX_MEMBERS} processes in group {group}"))
            })?;
            let d = shm.get();
            let m = &d.members[me];
            m.held.iter().chain(m.granted.iter()).for_each(|h| h.store(0, Ordering::Relaxed));
            m.pid.store(std::process::id(), Ordering::Relaxed);
            m.host_pid.store(0, Ordering::Relaxed);
            m.state.store(LIVE, Ordering::Release);
            d.high_water.fetch_max(me as u32 + 1, Ordering::AcqRel);
            me
        };
        Ok(Some(Ledger { backing: Backing::Shared(shm), me }))
    }

    /// This process is leaving (it exits): it gives its slot back, and the last live
    /// member removes the group's file, so groups that come and go leave nothing behind
    /// in /dev/shm, even when members exit at the same moment (they take the table in
    /// turn). A file left by members that could not run this (killed) is removed by the
    /// next process of the user that joins any group.
    pub fn leave(&self) {
        if let Backing::Shared(shm) = &self.backing {
            // At exit: no logging (its machinery may already be torn down).
            let _ = shm.leave_and_remove_if_unused(MAX_MEMBERS, LEAVE_WAIT);
        }
    }

    #[inline]
    fn data(&self) -> &LedgerData {
        match &self.backing {
            Backing::Shared(shm) => shm.get(),
            Backing::Private(data) => data,
        }
    }

    /// The ledger's index for the device with `uuid`, claiming one if new.
    pub fn device_index(&self, uuid: &[u8; 16]) -> Option<usize> {
        let words = uuid_words(uuid);
        let d = self.data();
        let find = || {
            d.devices.iter().position(|r| {
                r.claimed.load(Ordering::Acquire) == 1
                    && r.uuid[0].load(Ordering::Relaxed) == words[0]
                    && r.uuid[1].load(Ordering::Relaxed) == words[1]
            })
        };
        if let Some(i) = find() {
            return Some(i);
        }
        let _table = match &self.backing {
            Backing::Shared(shm) => Some(shm.lock_table()),
            Backing::Private(_) => None,
        };
        if let Some(i) = find() {
            return Some(i);
        }
        let i = d.devices.iter().position(|r| r.claimed.load(Ordering::Acquire) == 0)?;
        let r = &d.devices[i];
        r.uuid[0].store(words[0], Ordering::Relaxed);
        r.uuid[1].store(words[1], Ordering::Relaxed);
        r.claimed.store(1, Ordering::Release);
        Some(i)
    }

    /// Sum held on `dev` over members still counted (dead ones until forgotten).
    /// Sequentially consistent, as the additions of `try_charge` are: see there.
    #[inline]
    fn sum(&self, dev: usize) -> u64 {
        self.sum_except(dev, usize::MAX)
    }

    /// `sum` over the members other than slot `skip`.
    #[inline]
    fn sum_except(&self, dev: usize, skip: usize) -> u64 {
        let d = self.data();
        let n = (d.high_water.load(Ordering::Acquire) as usize).min(MAX_MEMBERS);
        let mut total = 0u64;
        for (i, m) in d.members[..n].iter().enumerate() {
            if i != skip && m.state.load(Ordering::Acquire) == LIVE {
                total = total.saturating_add(m.held[dev].load(Ordering::SeqCst));
            }
        }
        total
    }

    /// Burst bytes granted to the group's live members on `dev`.
    pub fn group_granted(&self, dev: usize) -> u64 {
        let d = self.data();
        let n = (d.high_water.load(Ordering::Acquire) as usize).min(MAX_MEMBERS);
        d.members[..n]
            .iter()
            .filter(|m| m.state.load(Ordering::Acquire) == LIVE)
            .map(|m| m.granted[dev].load(Ordering::Acquire))
            .fold(0u64, u64::saturating_add)
    }

    /// Burst bytes granted to this process on `dev`.
    pub fn my_granted(&self, dev: usize) -> u64 {
        self.data().members[self.me].granted[dev].load(Ordering::Acquire)
    }

    /// Records a grant to this process.
    pub fn add_granted(&self, dev: usize, bytes: u64) {
        self.data().members[self.me].granted[dev].fetch_add(bytes, Ordering::AcqRel);
    }

    /// Takes back up to `bytes` of this process's grant; returns what was taken.
    pub fn take_granted(&self, dev: usize, bytes: u64) -> u64 {
        let g = &self.data().members[self.me].granted[dev];
        let mut taken = 0;
        let _ = g.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            taken = v.min(bytes);
            Some(v - taken)
        });
        taken
    }

    /// What the group holds on `dev` without looking for dead members (hot paths).
    pub fn held_fast(&self, dev: usize) -> u64 {
        self.sum(dev)
    }

    /// Forgets members that died; true if any was forgotten.
    pub fn forget_dead(&self) -> bool {
        let Backing::Shared(shm) = &self.backing else { return false };
        let _table = shm.lock_table();
        let d = shm.get();
        let n = (d.high_water.load(Ordering::Acquire) as usize).min(MAX_MEMBERS);
        let mut any = false;
        for (i, m) in d.members[..n].iter().enumerate() {
            if m.state.load(Ordering::Acquire) == LIVE && !shm.slot_alive(i) {
                m.state.store(FREE, Ordering::Release);
                m.held.iter().chain(m.granted.iter()).for_each(|h| h.store(0, Ordering::Relaxed));
                any = true;
            }
        }
        any
    }

    /// What the group holds on `dev`, after forgetting dead members.
    pub fn held(&self, dev: usize) -> u64 {
        self.forget_dead();
        self.sum(dev)
    }

    /// What this process holds on `dev`.
    pub fn held_by_me(&self, dev: usize) -> u64 {
        self.data().members[self.me].held[dev].load(Ordering::Relaxed)
    }

    /// Charges `bytes` on `dev` if the group stays within `limit`; returns what the
    /// group holds afterwards.
    ///
    /// Each member adds to its own counter, then reads the others'. The addition and the
    /// reads are sequentially consistent (on x86 the same instructions as acquire and
    /// release): of two members charging at once, at least one sees the other's
    /// addition, so they cannot both pass the limit. Threads of one process add to the
    /// same counter, whose additions are ordered anyway: the one that comes second sees
    /// both in the value it added to. The hot path is that one addition and one load per
    /// other member (none for a process alone).
    #[inline]
    pub fn try_charge(&self, dev: usize, bytes: u64, limit: u64) -> Result<u64, OverLimit> {
        let mine = &self.data().members[self.me].held[dev];
        let own = mine.fetch_add(bytes, Ordering::SeqCst).saturating_add(bytes);
        let total = own.saturating_add(self.sum_except(dev, self.me));
        if total <= limit {
            return Ok(total);
        }
        mine.fetch_sub(bytes, Ordering::SeqCst);
        self.try_charge_again(dev, bytes, limit)
    }

    /// `try_charge` after its first try was over the limit and backed out: really full
    /// (unless a dead member's memory is the room), or another charge raced with it.
    #[cold]
    #[inline(never)]
    fn try_charge_again(&self, dev: usize, bytes: u64, limit: u64) -> Result<u64, OverLimit> {
        let mine = &self.data().members[self.me].held[dev];
        let mut forgot = false;
        for attempt in 0..64 {
            if self.sum(dev).saturating_add(bytes) > limit {
                // Really full, unless a dead member's memory is the room.
                if forgot || !self.forget_dead() {
                    return Err(OverLimit { held: self.sum(dev) });
                }
                forgot = true;
            } else {
                // Another charge raced with ours; both backed out. Try again.
                for _ in 0..(attempt + 1) * 8 {
                    std::hint::spin_loop();
                }
            }
            let own = mine.fetch_add(bytes, Ordering::SeqCst).saturating_add(bytes);
            let total = own.saturating_add(self.sum_except(dev, self.me));
            if total <= limit {
                return Ok(total);
            }
            mine.fetch_sub(bytes, Ordering::SeqCst);
        }
        Err(OverLimit { held: self.sum(dev) })
    }

    /// Charges without a limit (memory that already exists, such as a new context).
    pub fn force_charge(&self, dev: usize, bytes: u64) {
        self.data().members[self.me].held[dev].fetch_add(bytes, Ordering::AcqRel);
    }

    /// Gives back `bytes` on `dev`.
    #[inline(always)]
    pub fn release(&self, dev: usize, bytes: u64) {
        let mine = &self.data().members[self.me].held[dev];
        let _ = mine.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(bytes)));
    }

    /// The measured memory of one context on `dev`, if measured by any member.
    pub fn context_bytes(&self, dev: usize) -> Option<u64> {
        let v = self.data().devices[dev].context_bytes.load(Ordering::Relaxed);
        (v > 0).then_some(v)
    }

    /// Records a context measurement for the group.
    pub fn set_context_bytes(&self, dev: usize, bytes: u64) {
        self.data().devices[dev].context_bytes.store(bytes, Ordering::Relaxed);
    }

    /// The group's live members (this process alone without a group): each one's PID and
    /// its PID as the arbiter sees it (0 where not known).
    pub fn member_pids(&self) -> Vec<(u32, u32)> {
        self.live_members()
            .map(|m| (m.pid.load(Ordering::Relaxed), m.host_pid.load(Ordering::Relaxed)))
            .collect()
    }

    /// This process's PID as the arbiter sees it, once known.
    pub fn my_host_pid(&self) -> Option<u32> {
        Some(self.data().members[self.me].host_pid.load(Ordering::Relaxed)).filter(|&pid| pid != 0)
    }

    /// Records this process's PID as the arbiter sees it.
    pub fn set_host_pid(&self, pid: u32) {
        self.data().members[self.me].host_pid.store(pid, Ordering::Relaxed);
    }

    /// The group's live members' slots.
    fn live_members(&self) -> impl Iterator<Item = &Member> {
        self.forget_dead();
        let d = self.data();
        let n = (d.high_water.load(Ordering::Acquire) as usize).min(MAX_MEMBERS);
        d.members[..n].iter().filter(|m| m.state.load(Ordering::Acquire) == LIVE)
    }

    /// Live members and what each holds on `dev`.
    pub fn members(&self, dev: usize) -> Vec<(u32, u64)> {
        self.live_members()
            .map(|m| (m.pid.load(Ordering::Relaxed), m.held[dev].load(Ordering::Relaxed)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removes this user's ledger folder at the end of a test if it is empty then, so
    /// that the tests leave nothing in /dev/shm (a test joining meanwhile makes it again).
    struct FolderGoes;

    impl Drop for FolderGoes {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(ledger_dir());
        }
    }

    #[test]
    fn the_last_member_to_leave_removes_the_file_and_nobody_joins_a_removed_one() {
        let _folder = FolderGoes;
        let group = format!("leave-test-{}", std::process::id());
        let path = super::group_path(&group);
        // Two members (two open file descriptions count as two processes).
        let first = Ledger::join(&group).unwrap();
        let second = Ledger::join(&group).unwrap();
        first.leave();
        assert!(path.exists(), "a member is left: the file stays");
        drop(second);
        first.leave();
        assert!(!path.exists(), "the last member removes it");
        // A file removed by hand and made again is not removed by a member of the old one.
        let old = Ledger::join(&group).unwrap();
        std::fs::remove_file(&path).unwrap();
        let new = Ledger::join(&group).unwrap();
        old.leave();
        assert!(path.exists(), "the new file is not the old member's to remove");
        new.leave();
        assert!(!path.exists());
    }

    #[test]
    fn joining_any_group_removes_ledgers_whose_members_all_died() {
        let _folder = FolderGoes;
        let dead = format!("sweep-dead-{}", std::process::id());
        let live = format!("sweep-live-{}", std::process::id());
        let kept = Ledger::join(&live).unwrap();
        // Dropping a ledger without leaving closes its file: as a SIGKILL would.
        drop(Ledger::join(&dead).unwrap());
        assert!(group_path(&dead).exists(), "nobody left it");
        let other = Ledger::join(&format!("sweep-other-{}", std::process::id())).unwrap();
        assert!(!group_path(&dead).exists(), "the next joiner removes a ledger nobody holds");
        assert!(group_path(&live).exists(), "a live member's ledger is kept");
        kept.leave();
        other.leave();
        assert!(!group_path(&live).exists());
    }

    #[test]
    fn a_ledger_someone_else_could_read_or_write_is_never_joined() {
        let _folder = FolderGoes;
        use std::os::unix::fs::PermissionsExt;
        let group = format!("mode-test-{}", std::process::id());
        let path = super::group_path(&group);
        // The folder exists once any ledger was joined.
        drop(Ledger::join(&format!("{group}-first")).unwrap());
        std::fs::write(&path, [0u8; 64]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = Ledger::join(&group).err().expect("a 0666 ledger was joined");
        std::fs::remove_file(&path).unwrap();
        let _ = std::fs::remove_file(super::group_path(&format!("{group}-first")));
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
        assert!(err.to_string().contains("0666"), "{err}");
    }

    #[test]
    fn charges_stay_within_the_limit_and_come_back() {
        let _folder = FolderGoes;
        let l = Ledger::private();
        let dev = l.device_index(&[7; 16]).unwrap();
        assert_eq!(l.device_index(&[7; 16]), Some(dev));
        assert_eq!(l.try_charge(dev, 600, 1000), Ok(600));
        assert_eq!(l.try_charge(dev, 500, 1000), Err(OverLimit { held: 600 }));
        assert_eq!(l.try_charge(dev, 400, 1000), Ok(1000));
        l.release(dev, 1000);
        assert_eq!(l.held(dev), 0);
    }

    #[test]
    fn racing_threads_never_pass_the_limit_together() {
        let _folder = FolderGoes;
        let l = std::sync::Arc::new(Ledger::private());
        let dev = l.device_index(&[1; 16]).unwrap();
        let ok = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (l, ok) = (l.clone(), ok.clone());
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        if l.try_charge(dev, 100, 1000).is_ok() {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(ok.load(Ordering::Relaxed), 10, "exactly ten 100-byte charges fit in 1000");
        assert_eq!(l.held(dev), 1000);
    }

    #[test]
    fn racing_members_of_a_group_never_pass_the_limit_together() {
        let _folder = FolderGoes;
        let group = format!("race-test-{}", std::process::id());
        // Four members (each its own open file description: as four processes), two
        // threads each, charging and releasing at once.
        let members: Vec<_> = (0..4).map(|_| std::sync::Arc::new(Ledger::join(&group).unwrap())).collect();
        let dev = members[0].device_index(&[2; 16]).unwrap();
        assert!(members.iter().all(|m| m.device_index(&[2; 16]) == Some(dev)));
        let limit = 1000;
        // What the successful charges add up to (the ledger's own sum also counts
        // tries that are backing out).
        let granted = std::sync::Arc::new(AtomicU64::new(0));
        let passed = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (l, granted, passed) = (members[i % 4].clone(), granted.clone(), passed.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if l.try_charge(dev, 300, limit).is_ok() {
                            let now = granted.fetch_add(300, Ordering::SeqCst) + 300;
                            assert!(now <= limit, "the group passed its limit: {now}");
                            passed.fetch_add(1, Ordering::Relaxed);
                            granted.fetch_sub(300, Ordering::SeqCst);
                            l.release(dev, 300);
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert!(passed.load(Ordering::Relaxed) > 0);
        assert_eq!(members[0].held(dev), 0);
        members.iter().for_each(|m| m.leave());
    }
}
