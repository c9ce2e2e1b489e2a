//! Loading `libgpufrac_core.so` at the first call, and the table of its hooks.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};

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
    match STATE.compare_exchange(NOT_LOADED, LOADING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let state = if load() { ATTACHED } else { FAILED };
            STATE.store(state, Ordering::Release);
        }
        Err(_) => {
            // Loading takes a few milliseconds, once per process.
            while STATE.load(Ordering::Acquire) == LOADING {
                std::thread::yield_now();
            }
        }
    }
}

type AttachFn = unsafe extern "C" fn(u64, Option<DlsymFn>, *mut Ptr, usize) -> c_int;

fn load() -> bool {
    let Some(dlsym) = real_dlsym() else {
        say(&[b"cannot find glibc's dlsym"]);
        return false;
    };
    let mut path = [0u8; PATH_CAPACITY];
    let path = core_path(&mut path);
    // SAFETY: dlopen with a NUL-terminated path. RTLD_LOCAL keeps the core's symbols out
    // of the program's scope: the program reaches it only through these entry points.
    let handle =
        unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated message owned by the loader.
        let error = unsafe { libc::dlerror() };
        let error = if error.is_null() {
            &b"unknown error"[..]
        } else {
            // SAFETY: non-null, NUL-terminated, valid until the next dl* call here.
            unsafe { CStr::from_ptr(error) }.to_bytes()
        };
        say(&[b"cannot load libgpufrac_core.so, which must be installed beside libgpufrac.so: ", error]);
        return false;
    }
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

const PATH_CAPACITY: usize = libc::PATH_MAX as usize + 32;

/// `<this library's folder>/libgpufrac_core.so` in `buffer`. The folder is the one the
/// loader recorded when it loaded this library (absolute, whatever the program's working
/// folder is now); if it cannot say, `$ORIGIN/...`, which the loader expands the same way.
fn core_path(buffer: &mut [u8; PATH_CAPACITY]) -> &CStr {
    const FALLBACK: &CStr = c"$ORIGIN/libgpufrac_core.so";
    let mut info: libc::Dl_info = empty_info();
    let mut map: *mut c_void = std::ptr::null_mut();
    let mut origin = [0u8; libc::PATH_MAX as usize];
    // SAFETY: dladdr1 on an address inside this library, with RTLD_DL_LINKMAP (2) and a
    // pointer-sized out slot for the link map; dlinfo RTLD_DI_ORIGIN on that link map
    // (glibc's handles are link maps) writes at most PATH_MAX bytes, NUL included.
    let found = unsafe {
        libc::dladdr1(core_path as *const c_void, &mut info, (&mut map as *mut *mut c_void).cast(), 2) != 0
            && !map.is_null()
            && libc::dlinfo(map, libc::RTLD_DI_ORIGIN, origin.as_mut_ptr().cast()) == 0
    };
    let folder = match CStr::from_bytes_until_nul(&origin) {
        Ok(folder) if found && !folder.is_empty() => folder.to_bytes(),
        _ => return FALLBACK,
    };
    let length = folder.len() + 1 + CORE.len();
    if length >= buffer.len() {
        return FALLBACK;
    }
    buffer[..folder.len()].copy_from_slice(folder);
    buffer[folder.len()] = b'/';
    buffer[folder.len() + 1..length].copy_from_slice(CORE);
    buffer[length] = 0;
    CStr::from_bytes_with_nul(&buffer[..=length]).unwrap_or(FALLBACK)
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

/// One line on stderr: `gpufrac: <parts>; CUDA and NVML calls fail in this process.`
fn say(parts: &[&[u8]]) {
    let write = |bytes: &[u8]| {
        // SAFETY: writing a valid byte slice to fd 2; a failure is ignored (nowhere to say it).
        let _ = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
    };
    write(b"gpufrac: ");
    for part in parts {
        write(part);
    }
    write(b"; CUDA and NVML calls fail in this process.\n");
}
