//! Loading `libgpufrac_core.so` at the first call, and the table of its hooks.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::dlsym::{real_dlsym, DlsymFn};
use crate::entry::{ENTRY_COUNT, FINGERPRINT};

type Ptr = *mut c_void;

/// What an entry point answers when the core cannot be loaded: 999 is
/// `CUDA_ERROR_UNKNOWN` and `NVML_ERROR_UNKNOWN` alike.
pub(crate) const UNAVAILABLE: u32 = 999;

/// The core's file name; it lives in this library's own folder.
const CORE: &[u8] = b"libgpufrac_core.so";

/// The core's hooks, by entry point; null until the core is attached.
static HOOKS: [AtomicPtr<c_void>; ENTRY_COUNT] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; ENTRY_COUNT];

const NOT_LOADED: u8 = 0;
const LOADING: u8 = 1;
const ATTACHED: u8 = 2;
const FAILED: u8 = 3;
static STATE: AtomicU8 = AtomicU8::new(NOT_LOADED);
/// The core's handle from `dlopen`, once attached.
static HANDLE: AtomicUsize = AtomicUsize::new(0);
/// The core's `gpufrac_core_lookup`, once attached.
static LOOKUP: AtomicUsize = AtomicUsize::new(0);

/// The core's hook for entry point `entry` if the core is attached; null otherwise.
#[inline(always)]
pub(crate) fn attached_hook(entry: usize) -> Ptr {
    HOOKS.get(entry).map_or(std::ptr::null_mut(), |slot| slot.load(Ordering::Acquire))
}

/// The core's hook for entry point `entry`, loading the core at the first call; `None`
/// if the core cannot be loaded.
#[inline]
pub(crate) fn hook(entry: usize) -> Option<Ptr> {
    let slot = HOOKS.get(entry)?;
    let hook = slot.load(Ordering::Acquire);
    if !hook.is_null() {
        return Some(hook);
    }
    attach();
    let hook = slot.load(Ordering::Acquire);
    (!hook.is_null()).then_some(hook)
}

/// The core's handle if it is attached, without loading it.
pub(crate) fn loaded() -> Option<Ptr> {
    (STATE.load(Ordering::Acquire) == ATTACHED).then(|| HANDLE.load(Ordering::Acquire) as Ptr)
}

/// What the core's `dlsym` answer is for a hooked `name` (`Some(null)`: glibc answers),
/// loading the core if needed; `None` if the core cannot be loaded.
pub(crate) fn lookup(name: *const c_char) -> Option<Ptr> {
    attach();
    let lookup = LOOKUP.load(Ordering::Acquire);
    if lookup == 0 {
        return None;
    }
    // SAFETY: LOOKUP holds the core's gpufrac_core_lookup, `fn(*const c_char) -> Ptr`;
    // `name` is the NUL-terminated name dlsym was given.
    Some(unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char) -> Ptr>(lookup)(name) })
}

/// Loads and attaches the core once; other threads calling meanwhile wait for it.
#[cold]
pub(crate) fn attach() {
    // Settled (loaded or failed): nothing to do, nothing written.
    if STATE.load(Ordering::Acquire) >= ATTACHED {
        return;
    }
    watch_forks();
    match STATE.compare_exchange(NOT_LOADED, LOADING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // SAFETY: pthread_self has no preconditions.
            LOADER.store(unsafe { libc::pthread_self() } as usize, Ordering::Relaxed);
            let state = if load() { ATTACHED } else { FAILED };
            STATE.store(state, Ordering::Release);
        }
        Err(_) => wait_for_loader(),
    }
}

/// The thread loading the core (`pthread_self`), while it does.
static LOADER: AtomicUsize = AtomicUsize::new(0);

/// After a `fork`, a child whose loading thread was another thread has none: it starts
/// over at its next call instead of waiting for ever.
fn watch_forks() {
    static WATCHING: AtomicBool = AtomicBool::new(false);
    extern "C" fn in_child() {
        // SAFETY: pthread_self has no preconditions; in the child it names the thread
        // that called fork.
        let me = unsafe { libc::pthread_self() } as usize;
        if STATE.load(Ordering::Relaxed) == LOADING && LOADER.load(Ordering::Relaxed) != me {
            STATE.store(NOT_LOADED, Ordering::Relaxed);
        }
    }
    if !WATCHING.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a child handler that only touches atomics (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    }
}

/// How long a call waits for another thread loading the core before it fails: loading
/// takes milliseconds, so this is a thread stuck behind us (a library constructor,
/// running under the loader's lock, that calls CUDA while we wait for that lock).
const LOAD_WAIT: Duration = Duration::from_secs(30);

fn wait_for_loader() {
    // SAFETY: pthread_self has no preconditions.
    if LOADER.load(Ordering::Relaxed) == unsafe { libc::pthread_self() } as usize {
        // A call made while this very thread loads the core (from a constructor the
        // loader runs): it cannot wait for itself, so it fails.
        return;
    }
    let start = Instant::now();
    let mut turns = 0u32;
    while STATE.load(Ordering::Acquire) == LOADING {
        if turns < 1000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
        turns = turns.saturating_add(1);
        if start.elapsed() > LOAD_WAIT {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                say(&[b"waited 30 s for another thread to load libgpufrac_core.so; this call fails"]);
            }
            return;
        }
    }
}

type AttachFn = unsafe extern "C" fn(u64, Option<DlsymFn>, *mut Ptr, usize) -> c_int;

fn load() -> bool {
    let Some(dlsym) = real_dlsym() else {
        say(&[b"cannot find glibc's dlsym", EVERY_CALL_FAILS]);
        return false;
    };
    let Some(handle) = open_core() else { return false };
    // SAFETY: glibc's dlsym on the handle dlopen returned, with NUL-terminated names.
    let (attach, lookup) = unsafe {
        (dlsym(handle, c"gpufrac_core_attach".as_ptr()), dlsym(handle, c"gpufrac_core_lookup".as_ptr()))
    };
    let mut hooks = [std::ptr::null_mut(); ENTRY_COUNT];
    let attached = !attach.is_null()
        && !lookup.is_null()
        // SAFETY: the core's gpufrac_core_attach has the AttachFn signature; `hooks`
        // has ENTRY_COUNT writable slots.
        && unsafe { std::mem::transmute::<Ptr, AttachFn>(attach)(FINGERPRINT, Some(dlsym), hooks.as_mut_ptr(), ENTRY_COUNT) } == 0;
    if !attached {
        say(&[
            b"libgpufrac_core.so was not built with this libgpufrac.so; install the two from the same build",
            EVERY_CALL_FAILS,
        ]);
        return false;
    }
    for (slot, hook) in HOOKS.iter().zip(hooks) {
        slot.store(hook, Ordering::Release);
    }
    LOOKUP.store(lookup as usize, Ordering::Release);
    HANDLE.store(handle as usize, Ordering::Release);
    true
}

const EVERY_CALL_FAILS: &[u8] = b"; CUDA and NVML calls fail in this process";

/// Opens the core beside this library: in the folder the loader recorded when it loaded
/// this library (absolute, whatever the program's working folder is now), else in the
/// folder of the file itself when `LD_PRELOAD` named it through a symbolic link.
fn open_core() -> Option<Ptr> {
    let (mut info, mut map) = (empty_info(), std::ptr::null_mut::<c_void>());
    // SAFETY: dladdr1 on an address inside this library, with RTLD_DL_LINKMAP (2) and a
    // pointer-sized out slot for the link map.
    let found = unsafe {
        libc::dladdr1(open_core as *const c_void, &mut info, (&mut map as *mut *mut c_void).cast(), 2) != 0
    };
    let mut origin = [0u8; libc::PATH_MAX as usize];
    // SAFETY: dlinfo RTLD_DI_ORIGIN on this library's link map (glibc's handles are link
    // maps) writes at most PATH_MAX bytes, NUL included.
    let has_origin = found
        && !map.is_null()
        && unsafe { libc::dlinfo(map, libc::RTLD_DI_ORIGIN, origin.as_mut_ptr().cast()) } == 0;
    let mut real = [0u8; libc::PATH_MAX as usize];
    // SAFETY: realpath of the name the loader knows this library by, into a PATH_MAX
    // buffer; the result is checked.
    let has_real = found
        && !info.dli_fname.is_null()
        && !unsafe { libc::realpath(info.dli_fname, real.as_mut_ptr().cast()) }.is_null();
    let folders = [
        has_origin.then(|| CStr::from_bytes_until_nul(&origin).ok()).flatten().map(CStr::to_bytes),
        has_real.then(|| CStr::from_bytes_until_nul(&real).ok()).flatten().map(|p| folder_of(p.to_bytes())),
    ];
    let mut first_error: Option<([u8; 512], usize)> = None;
    let mut tried: Option<&[u8]> = None;
    for folder in folders.into_iter().flatten().filter(|f| !f.is_empty()) {
        if tried == Some(folder) {
            continue;
        }
        tried = Some(folder);
        let mut buffer = [0u8; PATH_CAPACITY];
        let Some(path) = beside(folder, &mut buffer) else { continue };
        // SAFETY: dlopen with a NUL-terminated path. RTLD_LOCAL keeps the core's symbols
        // out of the program's scope: it is reached only through these entry points.
        let handle =
            unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE) };
        if !handle.is_null() {
            return Some(handle);
        }
        if first_error.is_none() {
            first_error = Some(dl_error());
        }
    }
    let (error, length) = first_error.unwrap_or_else(|| {
        let mut text = [0u8; 512];
        let what = b"this library's folder is unknown";
        text[..what.len()].copy_from_slice(what);
        (text, what.len())
    });
    say(&[
        b"cannot load libgpufrac_core.so, which must be installed beside libgpufrac.so: ",
        &error[..length],
        EVERY_CALL_FAILS,
    ]);
    None
}

const PATH_CAPACITY: usize = libc::PATH_MAX as usize + 32;

/// `<folder>/libgpufrac_core.so`, NUL-terminated in `buffer`, if it fits.
fn beside<'a>(folder: &[u8], buffer: &'a mut [u8; PATH_CAPACITY]) -> Option<&'a CStr> {
    let length = folder.len() + 1 + CORE.len();
    let place = buffer.get_mut(..=length)?;
    place[..folder.len()].copy_from_slice(folder);
    place[folder.len()] = b'/';
    place[folder.len() + 1..length].copy_from_slice(CORE);
    place[length] = 0;
    CStr::from_bytes_with_nul(place).ok()
}

/// The folder part of an absolute path (`/` for a file at the root).
fn folder_of(path: &[u8]) -> &[u8] {
    match path.iter().rposition(|&b| b == b'/') {
        Some(0) => b"/",
        Some(i) => &path[..i],
        None => b"",
    }
}

/// The loader's last error message, copied (it is overwritten by the next dl call).
fn dl_error() -> ([u8; 512], usize) {
    let mut text = [0u8; 512];
    // SAFETY: dlerror returns null or a NUL-terminated message owned by the loader, valid
    // until the next dl call, which comes after the copy.
    let error = unsafe { libc::dlerror() };
    let bytes = if error.is_null() {
        &b"unknown error"[..]
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(error) }.to_bytes()
    };
    let length = bytes.len().min(text.len());
    text[..length].copy_from_slice(&bytes[..length]);
    (text, length)
}

/// An all-zero `Dl_info` (pointers null), for dladdr1 to fill.
fn empty_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

/// One line on stderr: `gpufrac: <parts>.`
fn say(parts: &[&[u8]]) {
    let write = |bytes: &[u8]| {
        // SAFETY: writing a valid byte slice to fd 2; a failure is ignored (nowhere to say it).
        let _ = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
    };
    write(b"gpufrac: ");
    for part in parts {
        write(part);
    }
    write(b".\n");
}
