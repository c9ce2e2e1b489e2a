//! A small file mapped into several processes, with kernel-managed locks that a killed
//! process can never leave held.
//!
//! - The *table lock* is an open-file-description (OFD) record lock on one byte, for
//!   changes that must see a consistent table; the kernel drops it when its holder dies.
//! - Each *slot* (one per member process) has its own OFD lock byte, held for the life of
//!   the process that claimed it. A slot whose byte nobody holds belongs to a dead
//!   process, so its records can be forgotten: this is how simgpu releases a killed
//!   process's memory and how the shim's group ledger forgets a killed member.
//!
//! Lock bytes lie far beyond the mapped data; record locks need no backing bytes.
//!
//! [`SharedFile::open_private`] is for files in shared places such as /dev/shm: the file
//! lives in a folder of the effective user's own (mode 0700), and neither the folder nor
//! the file is used unless it is a real folder or regular file of that user with the
//! expected mode: no symbolic link is ever followed and nothing someone else made is
//! adopted.

use std::ffi::{CStr, CString};
use std::fs::{File, OpenOptions};
use std::io;
use std::marker::PhantomData;
use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use nix::errno::Errno;
use nix::fcntl::{fcntl, open, openat, AtFlags, FcntlArg, OFlag};
use nix::libc::{c_short, flock, F_UNLCK, F_WRLCK, SEEK_SET};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::stat::{fchmod, fstatat, Mode};
use nix::unistd::{geteuid, mkdir, unlinkat, UnlinkatFlags};

const TABLE_LOCK_BYTE: i64 = 1 << 40;
const SLOT_LOCK_BASE: i64 = TABLE_LOCK_BYTE + 1;
/// Most slots a mapped file can have.
pub const MAX_SLOTS: usize = 256;

/// Types that may live in a shared mapping.
///
/// # Safety
/// Every bit pattern, all-zero included, must be a valid value (plain integers and
/// atomics only), and the layout must be `#[repr(C)]` so that every process agrees on it.
pub unsafe trait SharedPlain: Sync {}

/// A file of one `T` mapped shared into this process.
pub struct SharedFile<T: SharedPlain> {
    file: File,
    path: PathBuf,
    /// For [`SharedFile::open_private`]: the folder, held open, and the file's name in it,
    /// so removal never goes through a path someone could have changed.
    dir: Option<(OwnedFd, CString)>,
    ptr: NonNull<T>,
    /// Serialises this process's threads; OFD locks only exclude other processes.
    local: Mutex<()>,
    /// Slots this mapping claimed (a lock never conflicts with its own description).
    own: [AtomicU64; MAX_SLOTS / 64],
    _t: PhantomData<T>,
}

// SAFETY: T is SharedPlain (atomics only, Sync); the mapping lives as long as self.
unsafe impl<T: SharedPlain> Send for SharedFile<T> {}
// SAFETY: as above.
unsafe impl<T: SharedPlain> Sync for SharedFile<T> {}

/// The table lock, held until dropped.
pub struct TableGuard<'a> {
    file: &'a File,
    locked: bool,
    _local: MutexGuard<'a, ()>,
}

impl Drop for TableGuard<'_> {
    fn drop(&mut self) {
        if self.locked {
            let _ = ofd(self.file, Ofd::Unlock, TABLE_LOCK_BYTE);
        }
    }
}

impl<T: SharedPlain> SharedFile<T> {
    /// Opens or creates the file at `path` (mode 0600) and maps it. `prepare` runs under
    /// the table lock with the mapped value, so that the first process can initialise it.
    /// For a path this process's user controls (simgpu's state); in shared folders use
    /// [`SharedFile::open_private`].
    pub fn open(path: &Path, prepare: impl FnOnce(&SharedFile<T>)) -> io::Result<SharedFile<T>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            // Other processes may have it mapped already; std opens it O_CLOEXEC.
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        Self::map(file, path.to_owned(), None, prepare)
    }

    /// Opens or creates the file `name` in the folder `dir`, which is created (mode 0700)
    /// if missing, and maps it as [`SharedFile::open`] does. Refused, with an error naming
    /// the path: a folder that is a symbolic link, not a folder, not the effective user's
    /// or not mode 0700; a file that is a symbolic link, not a regular file, not the
    /// effective user's, not mode 0600 or with other hard links. A new file is made with
    /// `O_EXCL` (mode 0600), so it is always this process's own.
    pub fn open_private(
        dir: &Path,
        name: &str,
        prepare: impl FnOnce(&SharedFile<T>),
    ) -> io::Result<SharedFile<T>> {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a file name")));
        }
        let path = dir.join(name);
        let c_name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut attempts = 0;
        let (dir_fd, file) = loop {
            let opened = private_dir(dir).and_then(|dir_fd| {
                let file = open_private_file(&dir_fd, &c_name, &path)?;
                Ok((dir_fd, file))
            });
            match opened {
                Ok(opened) => break opened,
                // The folder was removed, empty (a sweep, see `ledgers::sweep`), while we
                // were making or opening it: make it again. A busy machine can lose the race
                // many times in a row (100 in a row in CI, against a sweep every 50 µs), so
                // the tries back off, up to about a second in all; a folder that really
                // cannot be made fails the same way every time.
                Err(e) if e.kind() == io::ErrorKind::NotFound && attempts < 1000 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_micros((attempts * 10).min(1000)));
                }
                Err(e) => return Err(e),
            }
        };
        Self::map(file, path, Some((dir_fd, c_name)), prepare)
    }

    fn map(
        file: File,
        path: PathBuf,
        dir: Option<(OwnedFd, CString)>,
        prepare: impl FnOnce(&SharedFile<T>),
    ) -> io::Result<SharedFile<T>> {
        let size = std::mem::size_of::<T>();
        ofd(&file, Ofd::Lock, TABLE_LOCK_BYTE)?;
        let mapped = (|| {
            if file.metadata()?.len() < size as u64 {
                file.set_len(size as u64)?;
            }
            let len = NonZeroUsize::new(size).ok_or(Errno::EINVAL)?;
            let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
            // SAFETY: a new mapping (no address asked for, so nothing existing is
            // replaced) of a regular file we hold open, at least `size` bytes long, shared
            // and read-write; only `SharedPlain` values, valid for any bytes, are read
            // through it.
            let addr = unsafe { mmap(None, len, prot, MapFlags::MAP_SHARED, &file, 0) }?;
            Ok(addr.cast::<T>())
        })();
        let ptr = match mapped {
            Ok(ptr) => ptr,
            Err(e) => {
                let _ = ofd(&file, Ofd::Unlock, TABLE_LOCK_BYTE);
                return Err(e);
            }
        };
        let shared = SharedFile {
            file,
            path,
            dir,
            ptr,
            local: Mutex::new(()),
            own: Default::default(),
            _t: PhantomData,
        };
        prepare(&shared);
        ofd(&shared.file, Ofd::Unlock, TABLE_LOCK_BYTE)?;
        Ok(shared)
    }

    /// The shared value.
    pub fn get(&self) -> &T {
        // SAFETY: the mapping is valid for the life of self, and T is valid for any bytes.
        unsafe { self.ptr.as_ref() }
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the table lock (blocking). If the lock call fails the guard still excludes
    /// this process's threads, so a broken lock degrades instead of hanging the host.
    pub fn lock_table(&self) -> TableGuard<'_> {
        let local = self.local.lock().unwrap_or_else(|poison| poison.into_inner());
        let locked = ofd(&self.file, Ofd::Lock, TABLE_LOCK_BYTE).is_ok();
        TableGuard { file: &self.file, locked, _local: local }
    }

    /// Whether the file was removed from its folder since it was opened (by the last
    /// member leaving): a process about to join must open the path again instead.
    pub fn unlinked(&self, _table: &TableGuard<'_>) -> bool {
        self.file.metadata().map(|m| m.nlink() == 0).unwrap_or(false)
    }

    /// This process leaves (it exits): gives back every slot it claimed, then removes the
    /// file from its folder if no other process holds a slot below `count`. Under the
    /// table lock, which joiners take before claiming a slot, so none can join the removed
    /// file unawares (see [`SharedFile::unlinked`]), and which two members leaving at once
    /// take in turn: the second sees the first's slot given back and removes the file.
    /// Waits at most `wait` for the table (it runs at exit: a holder that never lets go
    /// costs the host that long, and the file stays for [`sweep_dead`]).
    pub fn leave_and_remove_if_unused(&self, count: usize, wait: std::time::Duration) -> io::Result<bool> {
        let Some(_table) = self.lock_table_within(wait) else { return Ok(false) };
        for i in 0..MAX_SLOTS {
            self.release_slot(i);
        }
        if any_slot_locked(&self.file, count)? {
            return Ok(false);
        }
        // The path may name another file by now (ours removed by hand, a new one made).
        let Some((dir, name)) = &self.dir else {
            let ours = self.file.metadata()?;
            let named = std::fs::symlink_metadata(&self.path)?;
            if (ours.dev(), ours.ino()) != (named.dev(), named.ino()) {
                return Ok(false);
            }
            std::fs::remove_file(&self.path)?;
            return Ok(true);
        };
        // The folder stays: removed, its name in a shared folder such as /dev/shm could be
        // taken by another user, and this user's files would be refused until it goes.
        unlink_if_same(dir, name, &self.file)
    }

    /// The table lock, polled for at most `wait` (for exit handlers, which must not hang).
    fn lock_table_within(&self, wait: std::time::Duration) -> Option<TableGuard<'_>> {
        let deadline = std::time::Instant::now() + wait;
        let mut pause = std::time::Duration::from_micros(50);
        let local = loop {
            match self.local.try_lock() {
                Ok(local) => break local,
                Err(std::sync::TryLockError::Poisoned(poison)) => break poison.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        };
        loop {
            match ofd(&self.file, Ofd::TryLock, TABLE_LOCK_BYTE) {
                Ok(()) => return Some(TableGuard { file: &self.file, locked: true, _local: local }),
                Err(e) if is_busy(&e) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(1));
                }
                Err(_) => return None,
            }
        }
    }

    /// Claims the first free slot below `count` for this process; the caller holds the
    /// table lock. A slot is free when nobody holds its lock byte, whatever its record says.
    pub fn claim_slot(&self, count: usize, _table: &TableGuard<'_>) -> Option<usize> {
        (0..count.min(MAX_SLOTS)).find(|&i| {
            let free = !self.is_own(i) && ofd(&self.file, Ofd::TryLock, SLOT_LOCK_BASE + i as i64).is_ok();
            if free {
                self.set_own(i, true);
            }
            free
        })
    }

    /// Gives a claimed slot back.
    pub fn release_slot(&self, index: usize) {
        if index < MAX_SLOTS && self.is_own(index) {
            let _ = ofd(&self.file, Ofd::Unlock, SLOT_LOCK_BASE + index as i64);
            self.set_own(index, false);
        }
    }

    /// Whether the process that claimed `index` is alive (ours always is).
    pub fn slot_alive(&self, index: usize) -> bool {
        if index >= MAX_SLOTS {
            return false;
        }
        if self.is_own(index) {
            return true;
        }
        // When in doubt, keep the slot: forgetting a live process's memory is worse.
        locked_by_other(&self.file, SLOT_LOCK_BASE + index as i64, 1).unwrap_or(true)
    }

    fn is_own(&self, index: usize) -> bool {
        self.own[index / 64].load(Ordering::Relaxed) & (1 << (index % 64)) != 0
    }

    fn set_own(&self, index: usize, own: bool) {
        let bit = 1u64 << (index % 64);
        if own {
            self.own[index / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            self.own[index / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

impl<T: SharedPlain> Drop for SharedFile<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `open`; no reference outlives self.
        let _ = unsafe { munmap(self.ptr.cast(), std::mem::size_of::<T>()) };
    }
}

fn euid() -> u32 {
    geteuid().as_raw()
}

fn refuse(path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refusing {}: {why}; remove it if nobody should have made it", path.display()),
    )
}

/// `io::Error::new` keeps the kind of `errno` and says `what` about it.
fn say(errno: Errno, what: impl std::fmt::Display) -> io::Error {
    let err = io::Error::from(errno);
    io::Error::new(err.kind(), format!("{what}: {err}"))
}

/// Flags for opening a folder: never through a symbolic link, never inherited.
fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Creates `dir` (mode 0700) if missing and opens it, without following a symbolic link;
/// it must be a folder of the effective user's with mode 0700.
fn private_dir(dir: &Path) -> io::Result<OwnedFd> {
    let created = match mkdir(dir, Mode::from_bits_truncate(0o700)) {
        Ok(()) => true,
        Err(Errno::EEXIST) => false,
        Err(e) => return Err(say(e, format_args!("cannot create {}", dir.display()))),
    };
    let fd = match open(dir, dir_flags(), Mode::empty()) {
        Ok(fd) => fd,
        // Say what is wrong with it, as far as we can see.
        Err(e) => {
            return Err(match std::fs::symlink_metadata(dir) {
                Ok(m) if m.file_type().is_symlink() => refuse(dir, "it is a symbolic link"),
                Ok(m) if !m.is_dir() => refuse(dir, "it is not a folder"),
                Ok(m) if m.uid() != euid() => refuse(
                    dir,
                    format_args!("it belongs to uid {}, not to this user (uid {})", m.uid(), euid()),
                ),
                _ => say(e, format_args!("cannot open {}", dir.display())),
            })
        }
    };
    let meta = File::from(fd.try_clone()?).metadata()?;
    let me = euid();
    if meta.uid() != me {
        return Err(refuse(
            dir,
            format_args!("it belongs to uid {}, not to this user (uid {me})", meta.uid()),
        ));
    }
    if created && meta.mode() & 0o7777 != 0o700 {
        // Our own new folder, narrowed by the umask: widen it to 0700 exactly.
        fchmod(&fd, Mode::from_bits_truncate(0o700))?;
    } else if meta.mode() & 0o7777 != 0o700 {
        return Err(refuse(dir, format_args!("its mode is {:04o}, not 0700", meta.mode() & 0o7777)));
    }
    Ok(fd)
}

/// Opens `name` in `dir` read-write without following a symbolic link, creating it
/// (mode 0600, `O_EXCL`) if missing; an existing file must be a regular file of the
/// effective user's, mode 0600, with no other hard link.
fn open_private_file(dir: &OwnedFd, name: &CStr, path: &Path) -> io::Result<File> {
    let flags = OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    for _ in 0..100 {
        match openat(dir, name, flags, Mode::empty()) {
            Ok(fd) => {
                let file = File::from(fd);
                let meta = file.metadata()?;
                let me = euid();
                if !meta.file_type().is_file() {
                    return Err(refuse(path, "it is not a regular file"));
                }
                if meta.uid() != me {
                    return Err(refuse(
                        path,
                        format_args!("it belongs to uid {}, not to this user (uid {me})", meta.uid()),
                    ));
                }
                if meta.mode() & 0o7777 != 0o600 {
                    return Err(refuse(
                        path,
                        format_args!("its mode is {:04o}, not 0600", meta.mode() & 0o7777),
                    ));
                }
                // 0 links: removed since we opened it; the caller sees that and opens again.
                if meta.nlink() > 1 {
                    return Err(refuse(path, format_args!("it has {} hard links", meta.nlink())));
                }
                return Ok(file);
            }
            Err(Errno::ENOENT) => {}
            Err(Errno::ELOOP) => return Err(refuse(path, "it is a symbolic link")),
            Err(Errno::EISDIR) => return Err(refuse(path, "it is not a regular file")),
            Err(e) => return Err(say(e, format_args!("cannot open {}", path.display()))),
        }
        // O_EXCL with O_NOFOLLOW never opens an existing name or link.
        let excl = flags | OFlag::O_CREAT | OFlag::O_EXCL;
        match openat(dir, name, excl, Mode::from_bits_truncate(0o600)) {
            Ok(fd) => {
                let file = File::from(fd);
                // Exactly 0600 whatever the umask.
                fchmod(&file, Mode::from_bits_truncate(0o600))?;
                return Ok(file);
            }
            // Another process made it meanwhile: open theirs.
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(say(e, format_args!("cannot create {}", path.display()))),
        }
    }
    Err(io::Error::other(format!("{} keeps appearing and disappearing", path.display())))
}

/// Removes, from the private folder `dir` (see [`SharedFile::open_private`]), every file
/// whose name ends in `suffix` and whose first `count` slots nobody holds: files whose
/// processes all died (SIGKILL, SIGTERM, a crash: nothing ran at their exit) and that
/// nobody uses now. A file someone holds the table of (a process joining it) is left, and
/// so is anything that is not a regular file of the effective user's with mode 0600 and
/// one link: it is not ours to judge. Returns how many were removed. Errors only if the
/// folder itself cannot be opened (missing: nothing to sweep, `Ok(0)`).
pub fn sweep_dead(dir: &Path, suffix: &str, count: usize) -> io::Result<usize> {
    let dir_fd = match open(dir, dir_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let meta = File::from(dir_fd.try_clone()?).metadata()?;
    if meta.uid() != euid() || meta.mode() & 0o7777 != 0o700 {
        return Ok(0);
    }
    let mut removed = 0;
    // Names are listed by path, then opened relative to the folder checked above.
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        if !name.as_bytes().ends_with(suffix.as_bytes()) {
            continue;
        }
        let Ok(c_name) = CString::new(name.as_bytes()) else { continue };
        if matches!(sweep_one(&dir_fd, &c_name, count), Ok(true)) {
            removed += 1;
        }
    }
    Ok(removed)
}

/// [`sweep_dead`] for one name: true if it was removed.
fn sweep_one(dir: &OwnedFd, name: &CStr, count: usize) -> io::Result<bool> {
    // O_NONBLOCK: a FIFO planted here must not block us.
    let flags = OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    let file = File::from(openat(dir, name, flags, Mode::empty())?);
    let meta = file.metadata()?;
    if !meta.file_type().is_file()
        || meta.uid() != euid()
        || meta.mode() & 0o7777 != 0o600
        || meta.nlink() != 1
    {
        return Ok(false);
    }
    // Busy: someone is joining (or leaving, and will remove it if it is the last).
    if ofd(&file, Ofd::TryLock, TABLE_LOCK_BYTE).is_err() {
        return Ok(false);
    }
    // Closing `file` drops the table lock (it is this description's).
    if any_slot_locked(&file, count)? {
        return Ok(false);
    }
    unlink_if_same(dir, name, &file)
}

/// Whether any process holds one of the first `count` slot locks of `file` (this
/// description's own locks never conflict, so they do not count).
fn any_slot_locked(file: &File, count: usize) -> io::Result<bool> {
    let count = count.min(MAX_SLOTS);
    if count == 0 {
        return Ok(false);
    }
    // One call for the whole range: any lock in it is reported.
    locked_by_other(file, SLOT_LOCK_BASE, count as i64)
}

/// Removes `name` from `dir` if it still names `file` (never following a link).
fn unlink_if_same(dir: &OwnedFd, name: &CStr, file: &File) -> io::Result<bool> {
    let ours = file.metadata()?;
    let named = fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
    if (ours.dev(), ours.ino()) != (named.st_dev, named.st_ino) {
        return Ok(false);
    }
    // The name only, never following a link.
    unlinkat(dir, name, UnlinkatFlags::NoRemoveDir)?;
    Ok(true)
}

fn is_busy(e: &io::Error) -> bool {
    matches!(e.raw_os_error().map(Errno::from_raw), Some(Errno::EAGAIN | Errno::EACCES))
}

/// What [`ofd`] does with a lock byte. The calls go through `nix` (a match and the
/// `fcntl` call, nothing allocated): the shim takes the table lock on its allocation path.
#[derive(Clone, Copy)]
enum Ofd {
    /// `F_OFD_SETLKW` of a write lock: waits until the byte is free.
    Lock,
    /// `F_OFD_SETLK` of a write lock: `EAGAIN` or `EACCES` when someone holds the byte.
    TryLock,
    /// `F_OFD_SETLK` of `F_UNLCK`.
    Unlock,
}

/// A lock record of `len` bytes from `start`.
fn record(kind: i32, start: i64, len: i64) -> flock {
    flock { l_type: kind as c_short, l_whence: SEEK_SET as c_short, l_start: start, l_len: len, l_pid: 0 }
}

/// `fcntl` again while a signal interrupts it.
fn retry(mut call: impl FnMut() -> nix::Result<i32>) -> io::Result<()> {
    loop {
        match call() {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(_) => return Ok(()),
        }
    }
}

fn ofd(file: &File, op: Ofd, byte: i64) -> io::Result<()> {
    let fl = record(if matches!(op, Ofd::Unlock) { F_UNLCK } else { F_WRLCK }, byte, 1);
    retry(|| {
        fcntl(
            file,
            match op {
                Ofd::Lock => FcntlArg::F_OFD_SETLKW(&fl),
                Ofd::TryLock | Ofd::Unlock => FcntlArg::F_OFD_SETLK(&fl),
            },
        )
    })
}

/// Whether another open file description holds a lock on any of the `len` bytes from
/// `start` (`F_OFD_GETLK`; this description's own locks never conflict).
fn locked_by_other(file: &File, start: i64, len: i64) -> io::Result<bool> {
    let mut fl = record(F_WRLCK, start, len);
    retry(|| fcntl(file, FcntlArg::F_OFD_GETLK(&mut fl)))?;
    Ok(fl.l_type != F_UNLCK as c_short)
}

#[cfg(test)]
mod tests;

/// Where the shim keeps group ledgers, shared here so that tools that never load the shim
/// (the demo, the tests) can clean up after processes that died without leaving.
pub mod ledgers {
    use std::io;
    use std::path::PathBuf;

    /// A ledger file's name is its group's followed by this.
    pub const SUFFIX: &str = ".ledger";
    /// Most processes in one group (slots in a ledger).
    pub const MAX_MEMBERS: usize = 64;

    /// The folder of this user's group ledgers: `/dev/shm/gpufrac-<euid>` (under the temp
    /// dir where there is no /dev/shm), made mode 0700 by the shim.
    pub fn dir() -> PathBuf {
        let uid = super::euid();
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        base.join(format!("gpufrac-{uid}"))
    }

    /// Removes this user's ledgers whose members are all gone (see [`super::sweep_dead`]);
    /// ledgers in use are left, and so is the folder unless it is empty then. Returns how
    /// many were removed.
    pub fn sweep() -> io::Result<usize> {
        let removed = super::sweep_dead(&dir(), SUFFIX, MAX_MEMBERS)?;
        // Only an empty folder goes; a shim making a ledger meanwhile makes it again.
        let _ = std::fs::remove_dir(dir());
        Ok(removed)
    }
}
