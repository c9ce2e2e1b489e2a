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

use std::fs::{File, OpenOptions};
use std::io;
use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

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
    ptr: *const T,
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
            let _ = ofd(self.file, libc::F_OFD_SETLK, libc::F_UNLCK, TABLE_LOCK_BYTE);
        }
    }
}

impl<T: SharedPlain> SharedFile<T> {
    /// Opens or creates the file at `path` (mode 0600) and maps it. `prepare` runs under
    /// the table lock with the mapped value, so that the first process can initialise it.
    pub fn open(path: &Path, prepare: impl FnOnce(&SharedFile<T>)) -> io::Result<SharedFile<T>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        let size = std::mem::size_of::<T>();
        ofd(&file, libc::F_OFD_SETLKW, libc::F_WRLCK, TABLE_LOCK_BYTE)?;
        let mapped = (|| {
            if file.metadata()?.len() < size as u64 {
                file.set_len(size as u64)?;
            }
            // SAFETY: mapping a regular file we hold open, at least `size` bytes long,
            // shared and read-write; the result is checked against MAP_FAILED.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if addr == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            Ok(addr as *const T)
        })();
        let ptr = match mapped {
            Ok(ptr) => ptr,
            Err(e) => {
                let _ = ofd(&file, libc::F_OFD_SETLK, libc::F_UNLCK, TABLE_LOCK_BYTE);
                return Err(e);
            }
        };
        let shared = SharedFile {
            file,
            path: path.to_owned(),
            ptr,
            local: Mutex::new(()),
            own: Default::default(),
            _t: PhantomData,
        };
        prepare(&shared);
        ofd(&shared.file, libc::F_OFD_SETLK, libc::F_UNLCK, TABLE_LOCK_BYTE)?;
        Ok(shared)
    }

    /// The shared value.
    pub fn get(&self) -> &T {
        // SAFETY: the mapping is valid for the life of self, and T is valid for any bytes.
        unsafe { &*self.ptr }
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the table lock (blocking). If the lock call fails the guard still excludes
    /// this process's threads, so a broken lock degrades instead of hanging the host.
    pub fn lock_table(&self) -> TableGuard<'_> {
        let local = self.local.lock().unwrap_or_else(|poison| poison.into_inner());
        let locked = ofd(&self.file, libc::F_OFD_SETLKW, libc::F_WRLCK, TABLE_LOCK_BYTE).is_ok();
        TableGuard { file: &self.file, locked, _local: local }
    }

    /// Whether the file was removed from its folder since it was opened (by the last
    /// member leaving): a process about to join must open the path again instead.
    pub fn unlinked(&self, _table: &TableGuard<'_>) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map(|m| m.nlink() == 0).unwrap_or(false)
    }

    /// Removes the file from its folder if no other process holds a slot below `count`.
    /// Under the table lock, which joiners take before claiming a slot, so none can join
    /// the removed file unawares (see [`SharedFile::unlinked`]).
    /// Never blocks (it runs at exit): if the table is busy, the file stays.
    pub fn remove_if_unused(&self, count: usize) -> io::Result<bool> {
        let Ok(local) = self.local.try_lock() else { return Ok(false) };
        if ofd(&self.file, libc::F_OFD_SETLK, libc::F_WRLCK, TABLE_LOCK_BYTE).is_err() {
            return Ok(false);
        }
        let _table = TableGuard { file: &self.file, locked: true, _local: local };
        if (0..count.min(MAX_SLOTS)).any(|i| !self.is_own(i) && self.slot_alive(i)) {
            return Ok(false);
        }
        // The path may name another file by now (ours removed by hand, a new one made).
        use std::os::unix::fs::MetadataExt;
        let (ours, named) = (self.file.metadata()?, std::fs::metadata(&self.path)?);
        if (ours.dev(), ours.ino()) != (named.dev(), named.ino()) {
            return Ok(false);
        }
        std::fs::remove_file(&self.path)?;
        Ok(true)
    }

    /// Claims the first free slot below `count` for this process; the caller holds the
    /// table lock. A slot is free when nobody holds its lock byte, whatever its record says.
    pub fn claim_slot(&self, count: usize, _table: &TableGuard<'_>) -> Option<usize> {
        (0..count.min(MAX_SLOTS)).find(|&i| {
            let free = !self.is_own(i)
                && ofd(&self.file, libc::F_OFD_SETLK, libc::F_WRLCK, SLOT_LOCK_BASE + i as i64).is_ok();
            if free {
                self.set_own(i, true);
            }
            free
        })
    }

    /// Gives a claimed slot back.
    pub fn release_slot(&self, index: usize) {
        if index < MAX_SLOTS && self.is_own(index) {
            let _ = ofd(&self.file, libc::F_OFD_SETLK, libc::F_UNLCK, SLOT_LOCK_BASE + index as i64);
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
        // SAFETY: flock is a plain C struct; all-zero is valid.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = (SLOT_LOCK_BASE + index as i64) as libc::off_t;
        fl.l_len = 1;
        match fcntl(&self.file, libc::F_OFD_GETLK, &mut fl) {
            Ok(()) => fl.l_type != libc::F_UNLCK as libc::c_short,
            // When in doubt, keep the slot: forgetting a live process's memory is worse.
            Err(_) => true,
        }
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
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, std::mem::size_of::<T>()) };
    }
}

fn fcntl(file: &File, cmd: libc::c_int, fl: &mut libc::flock) -> io::Result<()> {
    loop {
        // SAFETY: `fl` is a valid flock and the descriptor is open for the call.
        if unsafe { libc::fcntl(file.as_raw_fd(), cmd, fl as *mut libc::flock) } == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

fn ofd(file: &File, cmd: libc::c_int, kind: libc::c_int, byte: i64) -> io::Result<()> {
    // SAFETY: flock is a plain C struct; all-zero is valid.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fcntl(file, cmd, &mut fl)
}
