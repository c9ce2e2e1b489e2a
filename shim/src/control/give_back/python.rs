//! The program's own Python interpreter, reached through the C API symbols already in the
//! process (the `python` executable exports them; an embedding program has `libpython`
//! loaded): a server started as people start it, by `gpufrac run`, with `LD_PRELOAD` set
//! by hand, in a container or through `/etc/ld.so.preload`, needs no start-up hook, no
//! `PYTHONPATH` and no setting. A process without an interpreter, or whose interpreter
//! is not running (not yet started, or shutting down), is left alone.
//!
//! `release.py` runs with the interpreter's lock taken by `PyGILState_Ensure`, as any
//! foreign thread calls into Python; it imports nothing, and catches everything it raises.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::driver::library::real_dlsym;

/// The code run in the interpreter.
const RELEASE: &str = include_str!("release.py");

/// `Py_file_input`: run a module's worth of statements.
const FILE_INPUT: c_int = 257;

type Object = *mut c_void;

type IntQuery = unsafe extern "C" fn() -> c_int;
type GilRelease = unsafe extern "C" fn(c_int);
type RunString = unsafe extern "C" fn(*const c_char, c_int, Object, Object, *mut c_void) -> Object;
type NewObject = unsafe extern "C" fn() -> Object;
type DictGet = unsafe extern "C" fn(Object, *const c_char) -> Object;
type AsUtf8 = unsafe extern "C" fn(Object) -> *const c_char;
type DecRef = unsafe extern "C" fn(Object);
type ErrClear = unsafe extern "C" fn();

/// The few C API functions used, found in the process's global scope.
struct Api {
    is_initialized: IntQuery,
    is_finalizing: IntQuery,
    gil_ensure: IntQuery,
    gil_release: GilRelease,
    run_string: RunString,
    dict_new: NewObject,
    dict_get: DictGet,
    as_utf8: AsUtf8,
    decref: DecRef,
    err_clear: ErrClear,
}

/// The address of `name` in the process's global scope, if defined.
fn global(name: &CStr) -> Option<*mut c_void> {
    let dlsym = real_dlsym()?;
    // SAFETY: glibc's dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let f = unsafe { dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!f.is_null()).then_some(f)
}

/// The function at `address` as a `$type`.
macro_rules! function {
    ($address:expr, $type:ty) => {
        // SAFETY: each is a CPython C API function whose signature (stable since Python
        // 3.7) is `$type`.
        unsafe { std::mem::transmute::<*mut c_void, $type>($address) }
    };
}

impl Api {
    /// The interpreter's functions, if this process has one. Looked up at each give-back:
    /// an embedding program may load `libpython` after the first.
    fn find() -> Option<Api> {
        // `Py_IsFinalizing` is public from 3.13; `_Py_IsFinalizing` before.
        let finalizing = global(c"Py_IsFinalizing").or_else(|| global(c"_Py_IsFinalizing"))?;
        Some(Api {
            is_initialized: function!(global(c"Py_IsInitialized")?, IntQuery),
            is_finalizing: function!(finalizing, IntQuery),
            gil_ensure: function!(global(c"PyGILState_Ensure")?, IntQuery),
            gil_release: function!(global(c"PyGILState_Release")?, GilRelease),
            run_string: function!(global(c"PyRun_StringFlags")?, RunString),
            dict_new: function!(global(c"PyDict_New")?, NewObject),
            dict_get: function!(global(c"PyDict_GetItemString")?, DictGet),
            as_utf8: function!(global(c"PyUnicode_AsUTF8")?, AsUtf8),
            decref: function!(global(c"Py_DecRef")?, DecRef),
            err_clear: function!(global(c"PyErr_Clear")?, ErrClear),
        })
    }
}

/// Whether an error of the release code was logged (once per process).
static ERROR_LOGGED: AtomicBool = AtomicBool::new(false);

/// Empties the pools of the Python frameworks the program imported, on CUDA `devices`;
/// returns the frameworks emptied. Waits for the interpreter's lock as long as a Python
/// thread holds it (the caller bounds its own wait, not this thread's), then runs only if
/// `still_wanted()` says so.
pub(super) fn release_frameworks(devices: &[usize], still_wanted: impl Fn() -> bool) -> Vec<String> {
    let Some(api) = Api::find() else { return Vec::new() };
    let Ok(source) = CString::new(format!("devices = {devices:?}\n{RELEASE}")) else { return Vec::new() };
    // SAFETY: CPython's C API as documented for threads it did not create: the queries
    // need no lock; PyGILState_Ensure is called only while the interpreter runs and is not
    // shutting down, and is paired with PyGILState_Release; every object made is released.
    unsafe {
        if (api.is_initialized)() == 0 || (api.is_finalizing)() != 0 {
            return Vec::new();
        }
        let state = (api.gil_ensure)();
        if !still_wanted() || (api.is_finalizing)() != 0 {
            (api.gil_release)(state);
            return Vec::new();
        }
        let outcome = run(&api, &source);
        (api.gil_release)(state);
        let (summary, error) = outcome;
        if !error.is_empty() && !ERROR_LOGGED.swap(true, Ordering::AcqRel) {
            tracing::warn!("gpufrac: a framework's pool could not be emptied (logged once): {error}");
        }
        summary.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
    }
}

/// Runs `source` in a namespace of its own; returns its `summary` and `error`.
///
/// # Safety
/// The calling thread holds the interpreter's lock.
unsafe fn run(api: &Api, source: &CStr) -> (String, String) {
    // SAFETY: the lock is held (the caller's contract); each new reference is released
    // once, borrowed ones (dict_get) are read before the dictionary goes.
    unsafe {
        let namespace = (api.dict_new)();
        if namespace.is_null() {
            (api.err_clear)();
            return (String::new(), "no memory for a namespace".into());
        }
        let result =
            (api.run_string)(source.as_ptr(), FILE_INPUT, namespace, namespace, std::ptr::null_mut());
        let outcome = if result.is_null() {
            (api.err_clear)();
            (String::new(), "the release code did not run".into())
        } else {
            (api.decref)(result);
            let text = |name: &CStr| {
                let value = (api.dict_get)(namespace, name.as_ptr());
                let utf8 = if value.is_null() { std::ptr::null() } else { (api.as_utf8)(value) };
                if utf8.is_null() {
                    (api.err_clear)();
                    return String::new();
                }
                CStr::from_ptr(utf8).to_string_lossy().into_owned()
            };
            (text(c"summary"), text(c"error"))
        };
        (api.decref)(namespace);
        outcome
    }
}
