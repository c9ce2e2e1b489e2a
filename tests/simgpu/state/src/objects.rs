//! VMM memory shared between processes through exported file descriptors
//! (`cuMemExportToShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
//!
//! Such memory outlives the process that made it: it stays alive while any process holds
//! a handle or a mapping of it, or any exported descriptor of it is open. The machine
//! keeps one record per exported memory object with the holders in the order they came:
//! processes (by slot) and, while exported descriptors are open, the *export* holder.
//!
//! The memory is charged once, to its **owner**, the first holder: the process that made
//! it, then, when the owner lets go, the next holder. This is how the real driver counts
//! it: the resource manager tracks each process's reference as a dup of one memory
//! descriptor, counts it as the owner's (`memSharedOwned`, or `memPrivate` once it is the
//! only reference) and as nobody's own in the others (`memSharedDuped`), and when the
//! owner frees its reference ownership passes to the next reference in the dup list. An
//! exported descriptor is a dup held by the kernel module's private client
//! (`hObjExportRmClient`), which has no process: while it owns the memory (the maker let
//! go, descriptors still open) NVML lists it under no process, but the device's used
//! memory still counts it.
//!
//! Whether exported descriptors are still open is read from the kernel: every exported
//! descriptor is its own open file description of the object's backing file carrying an
//! OFD read lock, which lives exactly as long as some descriptor of that description does
//! (in any process, or in flight in a unix socket). The backing file has a name from its
//! first export until it dies, so that any process can look.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::{Machine, ProcessSlot, MAX_PROCESSES};

/// Most exported memory objects alive on the machine at once.
pub const MAX_SHARED_OBJECTS: usize = 1024;
/// Most holders (processes, and the exported descriptors as one) of one object.
pub const MAX_OBJECT_HOLDERS: usize = 32;
/// The holder standing for every open exported descriptor of an object.
const EXPORT_HOLDER: u32 = u32::MAX;

/// One exported memory object, written under the table lock.
#[repr(C)]
pub(crate) struct ObjectRecord {
    /// The object's id (from 1); 0 when the record is free.
    id: AtomicU64,
    size: AtomicU64,
    /// The backing file's device and inode: how an imported descriptor is recognised.
    file_dev: AtomicU64,
    file_ino: AtomicU64,
    device: AtomicU32,
    /// `CUmemAllocationProp::requestedHandleTypes` of the allocation.
    handle_types: AtomicU32,
    count: AtomicU32,
    _pad: AtomicU32,
    /// Slot index + 1 of each holding process, or [`EXPORT_HOLDER`], in the order they
    /// came; the first is the owner.
    holders: [AtomicU32; MAX_OBJECT_HOLDERS],
}

/// The shared objects' table, part of the machine's state.
#[repr(C)]
pub(crate) struct ObjectTable {
    next_id: AtomicU64,
    /// Per device, the bytes of objects no process owns (kept here so that a charge, on
    /// every allocation, need not walk the records).
    unowned: [AtomicU64; crate::MAX_DEVICES],
    records: [ObjectRecord; MAX_SHARED_OBJECTS],
}

/// What an importer learns of an exported object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedObject {
    /// The object's id on this machine.
    pub id: u64,
    /// Its device.
    pub device: usize,
    /// Its size in bytes.
    pub size: u64,
    /// The handle types its allocation asked for.
    pub handle_types: u32,
}

/// Why an object could not be shared or found.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The table or the object's holder list is full.
    #[error("simgpu: too many exported memory objects or holders")]
    Full,
    /// The descriptor is not an exported object of this machine.
    #[error("simgpu: not an exported memory object of this machine")]
    Unknown,
    /// The backing file could not be named, opened or locked.
    #[error("simgpu: exported memory object: {0}")]
    Io(#[from] std::io::Error),
}

impl ObjectRecord {
    fn holders(&self) -> Vec<u32> {
        let n = (self.count.load(Ordering::Relaxed) as usize).min(MAX_OBJECT_HOLDERS);
        self.holders[..n].iter().map(|h| h.load(Ordering::Relaxed)).collect()
    }

    fn set_holders(&self, list: &[u32]) {
        for (cell, h) in self.holders.iter().zip(list) {
            cell.store(*h, Ordering::Relaxed);
        }
        self.count.store(list.len() as u32, Ordering::Relaxed);
    }

    fn free(&self) {
        self.count.store(0, Ordering::Relaxed);
        self.id.store(0, Ordering::Release);
    }
}

impl Machine {
    fn objects(&self) -> &ObjectTable {
        &self.shared().objects
    }

    /// The name of object `id`'s backing file once exported: in `/dev/shm` where there is
    /// one (device memory belongs in memory even when the state file is on a disk), else
    /// beside the state file; unique to this state file.
    pub fn object_path(&self, id: u64) -> String {
        object_path(&self.path, id)
    }

    /// Memory on `device` owned by no process: exported objects that only open exported
    /// descriptors hold. Caller holds the table lock.
    pub(crate) fn unowned_used(&self, device: usize) -> u64 {
        self.objects().unowned.get(device).map_or(0, |u| u.load(Ordering::Relaxed))
    }

    /// Replaces `r`'s holders by `list`, moving the charge when the owner changes and
    /// freeing the object (and its backing name) when nobody holds it. `gone` is a
    /// process whose usage was already zeroed (a dead one): nothing is taken from it.
    /// Caller holds the table lock.
    fn rehold(&self, r: &ObjectRecord, list: &[u32], gone: Option<u32>) {
        let mut list = list.to_vec();
        // Before the exported descriptors become the owner, look whether they still are.
        if list.first() == Some(&EXPORT_HOLDER)
            && !exports_open(&self.object_path(r.id.load(Ordering::Relaxed)))
        {
            list.remove(0);
        }
        let before = r.holders().first().copied();
        let after = list.first().copied();
        let (size, device) = (r.size.load(Ordering::Relaxed), r.device.load(Ordering::Relaxed) as usize);
        if before != after {
            // The device's charged total changes only when the memory's count starts or
            // ends here: moving it between holders leaves it, except from a holder whose
            // usage was already taken off (`gone`).
            let counted_before = before.is_some_and(|h| Some(h) != gone || h == EXPORT_HOLDER);
            match (counted_before, after.is_some()) {
                (true, false) => self.uncharge(device, size),
                (false, true) => self.recharge(device, size),
                _ => {}
            }
            if let Some(u) = self.objects().unowned.get(device) {
                if before == Some(EXPORT_HOLDER) {
                    let _ = u
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(size)));
                }
                if after == Some(EXPORT_HOLDER) {
                    u.fetch_add(size, Ordering::Relaxed);
                }
            }
            if let Some(h) = before.filter(|&h| h != EXPORT_HOLDER && Some(h) != gone) {
                self.take_from(h, device, size);
            }
            if let Some(h) = after.filter(|&h| h != EXPORT_HOLDER) {
                if let Some(u) = self.shared().processes.get(h as usize - 1).and_then(|p| p.used.get(device))
                {
                    u.fetch_add(size, Ordering::Relaxed);
                }
            }
        }
        if list.is_empty() {
            let _ = crate::remove_state(&self.object_path(r.id.load(Ordering::Relaxed)));
            r.free();
        } else {
            r.set_holders(&list);
        }
    }

    fn take_from(&self, holder: u32, device: usize, size: u64) {
        if let Some(u) = self.shared().processes.get(holder as usize - 1).and_then(|p| p.used.get(device)) {
            let _ = u.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(size)));
        }
    }

    /// Takes a process slot that is dead (or leaving) off every object it held. Caller
    /// holds the table lock; `zeroed`: its usage was already cleared.
    pub(crate) fn leave_all_objects(&self, index: usize, zeroed: bool) {
        let me = index as u32 + 1;
        for r in self.objects().records.iter().filter(|r| r.id.load(Ordering::Acquire) != 0) {
            let list = r.holders();
            if list.contains(&me) {
                let rest: Vec<u32> = list.into_iter().filter(|&h| h != me).collect();
                self.rehold(r, &rest, zeroed.then_some(me));
            }
        }
    }

    /// Drops the export holder of objects whose exported descriptors are all closed.
    /// Caller holds the table lock.
    pub(crate) fn reap_exports(&self) {
        for r in self.objects().records.iter().filter(|r| r.id.load(Ordering::Acquire) != 0) {
            let list = r.holders();
            if list.contains(&EXPORT_HOLDER) && !exports_open(&self.object_path(r.id.load(Ordering::Relaxed)))
            {
                let rest: Vec<u32> = list.into_iter().filter(|&h| h != EXPORT_HOLDER).collect();
                self.rehold(r, &rest, None);
            }
        }
    }
}

impl ProcessSlot<'_> {
    fn me(&self) -> u32 {
        self.index as u32 + 1
    }

    /// Exports a memory object this process made and holds: `file` is its unnamed backing
    /// file (`O_TMPFILE`), charged to this process (`size` bytes on `device`). The first
    /// export names the file and records the object; every export returns a new
    /// descriptor of its own open file description, locked, for the caller to hand out.
    /// `id` is the object's id from an earlier export, if any.
    pub fn export_object(
        &self,
        id: Option<u64>,
        file: BorrowedFd<'_>,
        device: usize,
        size: u64,
        handle_types: u32,
    ) -> Result<(u64, OwnedFd), ObjectError> {
        let machine = self.machine;
        let _guard = machine.shm.lock_table();
        machine.reap_dead();
        let table = machine.objects();
        let known = id.and_then(|id| table.records.iter().find(|r| r.id.load(Ordering::Acquire) == id));
        let record = match known {
            Some(r) => r,
            None => {
                let r = table
                    .records
                    .iter()
                    .find(|r| r.id.load(Ordering::Acquire) == 0)
                    .ok_or(ObjectError::Full)?;
                let id = table.next_id.fetch_add(1, Ordering::Relaxed) + 1;
                let path = machine.object_path(id);
                let _ = crate::remove_state(&path); // a leftover of a crashed machine
                link_fd(file, &path)?;
                let st = fstat(file)?;
                r.size.store(size, Ordering::Relaxed);
                r.device.store(device as u32, Ordering::Relaxed);
                r.handle_types.store(handle_types, Ordering::Relaxed);
                r.file_dev.store(st.st_dev, Ordering::Relaxed);
                r.file_ino.store(st.st_ino, Ordering::Relaxed);
                r.set_holders(&[self.me()]);
                r.id.store(id, Ordering::Release);
                r
            }
        };
        let id = record.id.load(Ordering::Relaxed);
        let fd = open_locked(&machine.object_path(id))?;
        let mut list = record.holders();
        if !list.contains(&EXPORT_HOLDER) {
            // The export's reference comes right after the exporter's, as the driver's dup.
            if list.len() >= MAX_OBJECT_HOLDERS {
                return Err(ObjectError::Full);
            }
            let at = list.iter().position(|&h| h == self.me()).map_or(list.len(), |p| p + 1);
            list.insert(at, EXPORT_HOLDER);
            record.set_holders(&list);
        }
        Ok((id, fd))
    }

    /// Imports the exported object behind `fd` (a descriptor another process, or this
    /// one, exported): this process becomes one of its holders (charged nothing while
    /// another holder owns it). The caller opens its own description of the file.
    pub fn import_object(&self, fd: BorrowedFd<'_>) -> Result<SharedObject, ObjectError> {
        let st = fstat(fd).map_err(|_| ObjectError::Unknown)?;
        let machine = self.machine;
        let _guard = machine.shm.lock_table();
        machine.reap_dead();
        let r = machine
            .objects()
            .records
            .iter()
            .filter(|r| r.id.load(Ordering::Acquire) != 0)
            .find(|r| {
                r.file_dev.load(Ordering::Relaxed) == st.st_dev
                    && r.file_ino.load(Ordering::Relaxed) == st.st_ino
            })
            .ok_or(ObjectError::Unknown)?;
        let mut list = r.holders();
        if !list.contains(&self.me()) {
            if list.len() >= MAX_OBJECT_HOLDERS {
                return Err(ObjectError::Full);
            }
            list.push(self.me());
            r.set_holders(&list);
        }
        Ok(SharedObject {
            id: r.id.load(Ordering::Relaxed),
            device: r.device.load(Ordering::Relaxed) as usize,
            size: r.size.load(Ordering::Relaxed),
            handle_types: r.handle_types.load(Ordering::Relaxed),
        })
    }

    /// This process no longer holds object `id` (no handle, no mapping): if it owned the
    /// memory, the next holder does now; with no holder left the memory is freed.
    pub fn leave_object(&self, id: u64) {
        let machine = self.machine;
        let _guard = machine.shm.lock_table();
        machine.reap_dead();
        if let Some(r) = machine.objects().records.iter().find(|r| r.id.load(Ordering::Acquire) == id) {
            let rest: Vec<u32> = r.holders().into_iter().filter(|&h| h != self.me()).collect();
            machine.rehold(r, &rest, None);
        }
    }

    /// Whether this process owns (is charged for) object `id`.
    pub fn owns_object(&self, id: u64) -> bool {
        let _guard = self.machine.shm.lock_table();
        self.machine
            .objects()
            .records
            .iter()
            .find(|r| r.id.load(Ordering::Acquire) == id)
            .is_some_and(|r| r.holders().first() == Some(&self.me()))
    }
}

/// The backing file name of object `id` of the machine at `state_path` (see
/// [`Machine::object_path`]).
pub fn object_path(state_path: &str, id: u64) -> String {
    let abs = std::path::absolute(state_path)
        .map_or_else(|_| state_path.to_owned(), |p| p.to_string_lossy().into_owned());
    // FNV-1a of the state's absolute path: the same name in every process of the machine.
    let hash =
        abs.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{}/simgpu-vmm-{hash:016x}-{id}", object_dir(state_path))
}

/// Forgets every object of a table being reset, removing their backing names (left by a
/// machine whose processes all died).
pub(crate) fn sweep_table(table: &ObjectTable, state_path: &str) {
    for r in table.records.iter().filter(|r| r.id.load(Ordering::Acquire) != 0) {
        let _ = crate::remove_state(&object_path(state_path, r.id.load(Ordering::Relaxed)));
        r.free();
    }
}

/// Empties the table of a machine being reset whose layout was another's.
pub(crate) fn clear_table(table: &ObjectTable) {
    table.next_id.store(0, Ordering::Relaxed);
    table.unowned.iter().for_each(|u| u.store(0, Ordering::Relaxed));
    table.records.iter().for_each(ObjectRecord::free);
}

/// Where objects' backing files live: `/dev/shm` if it is a folder, else the state's.
pub fn object_dir(state_path: &str) -> String {
    if std::path::Path::new("/dev/shm").is_dir() {
        return "/dev/shm".to_owned();
    }
    match std::path::Path::new(state_path).parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => p.to_string_lossy().into_owned(),
        None => ".".to_owned(),
    }
}

/// Makes an unnamed backing file (`O_TMPFILE`, mode 0600) of `size` bytes for memory that
/// may be exported, in the folder where exported objects live.
pub fn backing_file(state_path: &str, size: u64) -> std::io::Result<OwnedFd> {
    let dir = CString::new(object_dir(state_path)).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: a valid C path; the result is checked.
    let fd = unsafe { libc::open(dir.as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a descriptor we own; the result is checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Opens a new description of the file behind `fd` (not sharing its offset or locks),
/// read-write: how an importer gets its own reference that is not an exported one.
pub fn reopen(fd: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    let path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| std::io::ErrorKind::InvalidInput)?;
    open_path(&path)
}

fn open_path(path: &CString) -> std::io::Result<OwnedFd> {
    // SAFETY: a valid C path; the result is checked.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn lock_record(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is a plain C struct; all-zero is valid.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = 0;
    fl.l_len = 1;
    fl
}

/// Opens `path` as a new exported descriptor, with the read lock that marks it open. Not
/// close-on-exec: it is the program's to hand out.
fn open_locked(path: &str) -> Result<OwnedFd, ObjectError> {
    let c = CString::new(path).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid C path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let fl = lock_record(libc::F_RDLCK);
    // SAFETY: F_OFD_SETLK with a valid flock on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(fd)
}

/// Whether any exported descriptor of the object named `path` is still open anywhere.
fn exports_open(path: &str) -> bool {
    let Ok(c) = CString::new(path) else { return false };
    // SAFETY: a valid C path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut fl = lock_record(libc::F_WRLCK);
    // SAFETY: F_OFD_GETLK with a valid flock to fill, on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) } != 0 {
        // When in doubt, keep the memory alive: forgetting it is worse.
        return true;
    }
    fl.l_type != libc::F_UNLCK as libc::c_short
}

/// Gives the unnamed file `fd` the name `path` (`linkat` through `/proc`, which needs no
/// privilege, unlike `AT_EMPTY_PATH`).
fn link_fd(fd: BorrowedFd<'_>, path: &str) -> std::io::Result<()> {
    let from = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let to = CString::new(path).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: valid C paths; the result is checked.
    let r = unsafe {
        libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn fstat(fd: BorrowedFd<'_>) -> std::io::Result<libc::stat> {
    // SAFETY: stat is a plain C struct; all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills `st` for a descriptor the caller holds; the result is checked.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

const _: () = assert!(MAX_PROCESSES < EXPORT_HOLDER as usize);
