//! The CUDA driver's process checkpoint API (`cuCheckpointProcess*`, CUDA 12.8+), as the
//! arbiter calls it on other processes by PID to park them: [`CheckpointApi::lock`] stops
//! a process's CUDA calls, [`CheckpointApi::checkpoint`] moves its device memory to host
//! memory (the device has it free), [`CheckpointApi::restore`] brings it back at the same
//! addresses, [`CheckpointApi::unlock`] lets the process go on.
//!
//! The driver (`libcuda.so.1`) is loaded at run time, so the arbiter runs on machines
//! whose driver is too old for the API (or has none) and says so. Every call blocks until
//! the driver answers — a lock waits for the target's calls in flight, a checkpoint or a
//! restore copies all its device memory — so async code calls them on a blocking thread.

use std::ffi::{c_int, c_uint, c_void};
use std::time::Duration;

use libloading::Library;

/// The driver library loaded, as programs load it.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: u32 = 2;

/// Why a checkpoint call failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The driver library could not be loaded.
    #[error("cannot load the CUDA driver {library}: {source}")]
    Load {
        /// The library asked for.
        library: String,
        /// What the loader said.
        source: libloading::Error,
    },
    /// The driver lacks an entry point: it is older than CUDA 12.8 (or not a CUDA driver).
    #[error("the CUDA driver {library} has no {symbol}: the process checkpoint API needs a driver of CUDA 12.8 or later")]
    Missing {
        /// The library loaded.
        library: String,
        /// The entry point it lacks.
        symbol: &'static str,
    },
    /// The driver answered a call with an error.
    #[error("{call}: {} ({code})", error_name(*code).unwrap_or("unknown CUDA error"))]
    Driver {
        /// The driver function called.
        call: &'static str,
        /// The `CUresult` it returned.
        code: u32,
    },
}

impl CheckpointError {
    /// The `CUresult` the driver returned, for errors the driver answered.
    pub fn code(&self) -> Option<u32> {
        match self {
            CheckpointError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The name of the driver's `CUresult` (`CUDA_ERROR_TIMEOUT`), where known.
    pub fn name(&self) -> Option<&'static str> {
        self.code().and_then(error_name)
    }

    /// Whether the device lacked room (a restore may be tried again later).
    pub fn is_out_of_memory(&self) -> bool {
        self.code() == Some(OUT_OF_MEMORY)
    }
}

/// The names of the `CUresult` codes the checkpoint API and `cuInit` return.
pub fn error_name(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// A process's checkpoint state (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Running normally.
    Running,
    /// Locked: its CUDA calls wait.
    Locked,
    /// Checkpointed: locked, and its device memory is in host memory.
    Checkpointed,
    /// A checkpoint or restore failed; the process cannot go on.
    Failed,
    /// A state this wrapper does not know (a newer driver's).
    Other(u32),
}

impl ProcessState {
    /// Decodes a `CUprocessState` value.
    pub fn from_raw(value: u32) -> ProcessState {
        match value {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            other => ProcessState::Other(other),
        }
    }
}

impl std::fmt::Display for ProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessState::Running => f.write_str("running"),
            ProcessState::Locked => f.write_str("locked"),
            ProcessState::Checkpointed => f.write_str("checkpointed"),
            ProcessState::Failed => f.write_str("failed"),
            ProcessState::Other(v) => write!(f, "unknown state {v}"),
        }
    }
}

/// `CUcheckpointLockArgs`.
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

type GetStateFn = unsafe extern "C" fn(c_int, *mut c_uint) -> c_uint;
type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> c_uint;
/// Checkpoint, restore and unlock: their arguments are reserved (passed as null).
type ActionFn = unsafe extern "C" fn(c_int, *mut c_void) -> c_uint;
type InitFn = unsafe extern "C" fn(c_uint) -> c_uint;

/// The driver's checkpoint API, loaded and initialised.
#[derive(Debug)]
pub struct CheckpointApi {
    get_state: GetStateFn,
    lock: LockFn,
    checkpoint: ActionFn,
    restore: ActionFn,
    unlock: ActionFn,
    /// Keeps the functions above loaded.
    _library: Library,
}

impl CheckpointApi {
    /// Loads [`DRIVER_LIBRARY`], initialises it (`cuInit(0)`) and looks up the five
    /// functions; the error names what is missing.
    pub fn load() -> Result<CheckpointApi, CheckpointError> {
        let library = DRIVER_LIBRARY.to_owned();
        // SAFETY: loading the CUDA driver runs its initialisers, which have no
        // preconditions on the loading program.
        let lib = unsafe { Library::new(DRIVER_LIBRARY) }
            .map_err(|source| CheckpointError::Load { library: library.clone(), source })?;
        let missing = |symbol| CheckpointError::Missing { library: library.clone(), symbol };
        // SAFETY: each symbol is looked up with the type cuda.h gives it; the copies of the
        // function pointers are kept with the library, which stays loaded as long.
        unsafe {
            let init = *lib.get::<InitFn>(b"cuInit\0").map_err(|_| missing("cuInit"))?;
            let get_state = *lib
                .get::<GetStateFn>(b"cuCheckpointProcessGetState\0")
                .map_err(|_| missing("cuCheckpointProcessGetState"))?;
            let lock = *lib
                .get::<LockFn>(b"cuCheckpointProcessLock\0")
                .map_err(|_| missing("cuCheckpointProcessLock"))?;
            let checkpoint = *lib
                .get::<ActionFn>(b"cuCheckpointProcessCheckpoint\0")
                .map_err(|_| missing("cuCheckpointProcessCheckpoint"))?;
            let restore = *lib
                .get::<ActionFn>(b"cuCheckpointProcessRestore\0")
                .map_err(|_| missing("cuCheckpointProcessRestore"))?;
            let unlock = *lib
                .get::<ActionFn>(b"cuCheckpointProcessUnlock\0")
                .map_err(|_| missing("cuCheckpointProcessUnlock"))?;
            check("cuInit", init(0))?;
            Ok(CheckpointApi { get_state, lock, checkpoint, restore, unlock, _library: lib })
        }
    }

    /// The checkpoint state of process `pid`.
    pub fn state(&self, pid: u32) -> Result<ProcessState, CheckpointError> {
        let mut raw: c_uint = 0;
        // SAFETY: a function of the loaded driver with its cuda.h signature; `raw` is
        // writable storage for the `CUprocessState` it writes.
        check("cuCheckpointProcessGetState", unsafe { (self.get_state)(as_pid(pid), &mut raw) })?;
        Ok(ProcessState::from_raw(raw))
    }

    /// RUNNING → LOCKED: blocks the process's further CUDA calls and waits for those in
    /// flight and its submitted work. After `timeout` (rounded up to whole milliseconds;
    /// `Duration::ZERO` waits as long as it takes) the process is left RUNNING and the
    /// error is `CUDA_ERROR_TIMEOUT`.
    pub fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CheckpointError> {
        let mut args = LockArgs { timeout_ms: timeout_ms(timeout), reserved0: 0, reserved1: [0; 7] };
        // SAFETY: as in `state`; `args` is a `CUcheckpointLockArgs` with zero reserved fields.
        check("cuCheckpointProcessLock", unsafe { (self.lock)(as_pid(pid), &mut args) })
    }

    /// LOCKED → CHECKPOINTED: the process's device memory goes to host memory.
    pub fn checkpoint(&self, pid: u32) -> Result<(), CheckpointError> {
        // SAFETY: as in `state`; the arguments are optional (null).
        check("cuCheckpointProcessCheckpoint", unsafe {
            (self.checkpoint)(as_pid(pid), std::ptr::null_mut())
        })
    }

    /// CHECKPOINTED → LOCKED: the device memory comes back at the same addresses. When the
    /// device lacks room the error [`CheckpointError::is_out_of_memory`] (on simgpu the
    /// process stays CHECKPOINTED, so this can be tried again).
    pub fn restore(&self, pid: u32) -> Result<(), CheckpointError> {
        // SAFETY: as in `checkpoint`.
        check("cuCheckpointProcessRestore", unsafe { (self.restore)(as_pid(pid), std::ptr::null_mut()) })
    }

    /// LOCKED → RUNNING: the process's waiting calls go on.
    pub fn unlock(&self, pid: u32) -> Result<(), CheckpointError> {
        // SAFETY: as in `checkpoint`.
        check("cuCheckpointProcessUnlock", unsafe { (self.unlock)(as_pid(pid), std::ptr::null_mut()) })
    }
}

/// A PID as the driver takes it (`int`); one beyond its range reaches no process.
fn as_pid(pid: u32) -> c_int {
    c_int::try_from(pid).unwrap_or(c_int::MAX)
}

/// `timeout` in whole milliseconds, rounded up (a nonzero timeout never becomes 0, which
/// means none), at most `u32::MAX`.
fn timeout_ms(timeout: Duration) -> c_uint {
    let ms = timeout.as_nanos().div_ceil(1_000_000);
    c_uint::try_from(ms).unwrap_or(c_uint::MAX)
}

fn check(call: &'static str, code: c_uint) -> Result<(), CheckpointError> {
    match code {
        0 => Ok(()),
        code => Err(CheckpointError::Driver { call, code }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_decode_as_cuda_h_numbers_them() {
        assert_eq!(ProcessState::from_raw(0), ProcessState::Running);
        assert_eq!(ProcessState::from_raw(1), ProcessState::Locked);
        assert_eq!(ProcessState::from_raw(2), ProcessState::Checkpointed);
        assert_eq!(ProcessState::from_raw(3), ProcessState::Failed);
        assert_eq!(ProcessState::from_raw(4), ProcessState::Other(4));
        assert_eq!(ProcessState::Checkpointed.to_string(), "checkpointed");
    }

    #[test]
    fn driver_errors_name_the_call_and_the_code() {
        let e = CheckpointError::Driver { call: "cuCheckpointProcessLock", code: 909 };
        assert_eq!(e.to_string(), "cuCheckpointProcessLock: CUDA_ERROR_TIMEOUT (909)");
        assert_eq!(e.name(), Some("CUDA_ERROR_TIMEOUT"));
        assert!(!e.is_out_of_memory());
        let oom = CheckpointError::Driver { call: "cuCheckpointProcessRestore", code: 2 };
        assert!(oom.is_out_of_memory());
        let odd = CheckpointError::Driver { call: "cuCheckpointProcessRestore", code: 4242 };
        assert_eq!(odd.to_string(), "cuCheckpointProcessRestore: unknown CUDA error (4242)");
        assert_eq!(odd.name(), None);
    }

    #[test]
    fn a_missing_entry_point_says_which_and_why() {
        let e = CheckpointError::Missing {
            library: DRIVER_LIBRARY.to_owned(),
            symbol: "cuCheckpointProcessLock",
        };
        let text = e.to_string();
        assert!(text.contains("cuCheckpointProcessLock") && text.contains("12.8"), "{text}");
        assert_eq!(e.code(), None);
    }

    #[test]
    fn timeouts_round_up_to_milliseconds() {
        assert_eq!(timeout_ms(Duration::ZERO), 0);
        assert_eq!(timeout_ms(Duration::from_micros(1)), 1);
        assert_eq!(timeout_ms(Duration::from_millis(250)), 250);
        assert_eq!(timeout_ms(Duration::from_secs(u64::MAX)), u32::MAX);
        assert_eq!(as_pid(u32::MAX), c_int::MAX);
    }
}
