//! The process checkpoint API of CUDA 12.8 (`cuCheckpointProcess*`), which a program
//! (NVIDIA's `cuda-checkpoint`, the arbiter) calls on another process by PID to park it:
//! lock it (its CUDA calls wait), checkpoint it (its device memory goes to host memory and
//! the device has it free), restore it (the memory comes back at the same addresses) and
//! unlock it.
//!
//! simgpu's device memory lives in each process, so the target does the work itself: every
//! process that initialised the driver runs an agent thread (started at `cuInit`, the
//! real driver's "restore thread") listening on a unix socket named after the machine's
//! state file and the process's PID ([`socket_name`]). The exports run in the caller's
//! process: they connect to the target's socket, send one request and return the answer,
//! which is the target's `CUresult`.
//!
//! The gate: every other export passes [`Gate::enter`], which counts it in flight; while
//! the process is locked or checkpointed a new call waits there until it is unlocked.
//! Locking closes the gate, then waits for the calls in flight and the work queued on
//! streams to finish.
//!
//! What moves: linear memory (`cuMemAlloc`, pitched, managed, stream-ordered) and the
//! physical allocations of `cuMemCreate` are copied to host buffers and their pages given
//! back to the system; their addresses (and the VMM mappings) stay reserved and
//! inaccessible, and restore puts fresh pages there and copies back. Everything the
//! process holds on the machine's books — those, arrays (simgpu keeps no texels), memory
//! pools keep cached, context memory — is released at checkpoint and charged again at
//! restore, and its contexts are taken off the books so NVML stops listing it.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    CUcheckpointCheckpointArgs, CUcheckpointLockArgs, CUcheckpointRestoreArgs, CUcheckpointUnlockArgs,
    CUprocessState,
};
use parking_lot::{Condvar, Mutex};

use crate::driver::{driver, Driver};
use crate::ffi::{read_in, write_out, CUresult, CuResult};
use crate::memory::{Kind, REGISTRY};

// ---------------------------------------------------------------------------------------
// The gate every export passes.

/// Calls of this process inside an export (past the gate).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Whether new calls wait (the process is being locked, is locked or checkpointed).
static CLOSED: AtomicBool = AtomicBool::new(false);
/// What waiting calls sleep on; `CLOSED` is cleared with it held.
static WAITING: Mutex<()> = parking_lot::const_mutex(());
static OPENED: Condvar = Condvar::new();

/// One call in flight; dropping it ends the call.
pub(crate) struct Gate(());

impl Gate {
    /// Counts the calling export in flight, first waiting while the gate is closed. The
    /// open path is one atomic add, one load and a branch.
    #[inline]
    pub(crate) fn enter() -> Gate {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        // SeqCst on both sides: either the locker sees this call in flight, or this call
        // sees the gate closed (the store-load pattern of Dekker's algorithm).
        if CLOSED.load(Ordering::SeqCst) {
            Gate::wait_until_open();
        }
        Gate(())
    }

    #[cold]
    fn wait_until_open() {
        loop {
            // Not in flight while waiting, so the locker can go on.
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            {
                let mut waiting = WAITING.lock();
                while CLOSED.load(Ordering::SeqCst) {
                    OPENED.wait(&mut waiting);
                }
            }
            IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
            if !CLOSED.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    fn close() {
        CLOSED.store(true, Ordering::SeqCst);
    }

    fn open() {
        let _waiting = WAITING.lock();
        CLOSED.store(false, Ordering::SeqCst);
        OPENED.notify_all();
    }

    /// Whether no call is in flight (meaningful once the gate is closed).
    fn drained() -> bool {
        IN_FLIGHT.load(Ordering::SeqCst) == 0
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Release);
    }
}

// ---------------------------------------------------------------------------------------
// Where a process's agent listens.

/// Longest path a unix socket address holds (`sun_path` less its NUL).
const SUN_PATH_MAX: usize = 107;

/// The address of the agent of process `pid` on the machine whose state file is
/// `state_path`: the file `<state file>.checkpoint-<pid>` next to the state file (the
/// state path made absolute when it exists), or, when that is longer than a socket
/// address holds, the abstract name `simgpu-checkpoint-<FNV-1a of the path, hex>-<pid>`.
pub(crate) fn socket_name(state_path: &str, pid: u32) -> SocketName {
    let state = std::fs::canonicalize(state_path).unwrap_or_else(|_| PathBuf::from(state_path));
    let state = state.to_string_lossy();
    let path = format!("{state}.checkpoint-{pid}");
    if path.len() <= SUN_PATH_MAX {
        return SocketName::Path(PathBuf::from(path));
    }
    let hash =
        state.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    SocketName::Abstract(format!("simgpu-checkpoint-{hash:016x}-{pid}"))
}

/// A socket address: a file, or a name in the abstract namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SocketName {
    Path(PathBuf),
    Abstract(String),
}

impl SocketName {
    fn address(&self) -> std::io::Result<SocketAddr> {
        match self {
            SocketName::Path(path) => SocketAddr::from_pathname(path),
            SocketName::Abstract(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The agent, in the target process.

/// The agent thread's id (`cuCheckpointProcessGetRestoreThreadId`), 0 before it runs.
static AGENT_TID: AtomicI32 = AtomicI32::new(0);
/// The socket file to remove at exit, and the process that owns it (a forked child
/// inherits the exit handler, not the socket).
static SOCKET_FILE: OnceLock<(CString, u32)> = OnceLock::new();

extern "C" fn remove_socket_file() {
    if let Some((path, owner)) = SOCKET_FILE.get() {
        if std::process::id() == *owner {
            // SAFETY: `path` is a NUL-terminated path; unlink has no other precondition.
            unsafe { libc::unlink(path.as_ptr()) };
        }
    }
}

/// Starts the agent of this process (once, from the first successful `cuInit`). The
/// socket is bound before `cuInit` returns, so a caller that learns of the process
/// afterwards finds it. Without a socket (an unwritable folder) the process simply cannot
/// be checkpointed: callers get `CUDA_ERROR_NOT_FOUND`.
pub(crate) fn start_agent(state_path: &str) {
    let name = socket_name(state_path, simgpu_state::driver_pid());
    let Ok(listener) = bind(&name) else { return };
    let _ = std::thread::Builder::new().name("simgpu-restore".into()).spawn(move || agent(listener));
}

fn bind(name: &SocketName) -> std::io::Result<UnixListener> {
    if let SocketName::Path(path) = name {
        // A file of an earlier process with this PID that was killed.
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind_addr(&name.address()?)?;
    if let SocketName::Path(path) = name {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        if let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) {
            if SOCKET_FILE.set((c, std::process::id())).is_ok() {
                // SAFETY: registers a function of this library with no preconditions; glibc
                // runs it at exit, or when this library is unloaded (its DSO handle).
                unsafe { libc::atexit(remove_socket_file) };
            }
        }
    }
    Ok(listener)
}

fn agent(listener: UnixListener) {
    // SAFETY: gettid has no preconditions and cannot fail.
    AGENT_TID.store(unsafe { libc::gettid() }, Ordering::Release);
    for conn in listener.incoming() {
        match conn {
            // One thread per request: a lock that waits must not hold up a state query.
            Ok(stream) => {
                let spawned =
                    std::thread::Builder::new().name("simgpu-checkpoint".into()).spawn(move || serve(stream));
                if spawned.is_err() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            // Out of descriptors or the like: do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Request: operation and argument, each a native-endian `u32`. Answer: the `CUresult`
/// and a value (the state, the thread id).
const MESSAGE: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Op {
    GetState = 1,
    Lock = 2,
    Checkpoint = 3,
    Restore = 4,
    Unlock = 5,
    RestoreThreadId = 6,
}

fn serve(mut stream: UnixStream) {
    let mut request = [0u8; MESSAGE];
    if stream.read_exact(&mut request).is_err() {
        return;
    }
    let word = |i: usize| u32::from_ne_bytes([request[i], request[i + 1], request[i + 2], request[i + 3]]);
    let answer = if !peer_allowed(&stream) {
        Err(CUresult::CUDA_ERROR_NOT_PERMITTED)
    } else {
        match word(0) {
            1 => Ok(STATE.load(Ordering::Acquire)),
            2 => lock(word(4)).map(|()| 0),
            3 => checkpoint().map(|()| 0),
            4 => restore().map(|()| 0),
            5 => unlock().map(|()| 0),
            6 => Ok(AGENT_TID.load(Ordering::Acquire) as u32),
            _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    };
    let (code, value) = match answer {
        Ok(value) => (0, value),
        Err(code) => (code as u32, 0),
    };
    let mut reply = [0u8; MESSAGE];
    reply[..4].copy_from_slice(&code.to_ne_bytes());
    reply[4..].copy_from_slice(&value.to_ne_bytes());
    let _ = stream.write_all(&reply);
}

/// Only the process's own user and root may park it (the file is mode 0600 too; an
/// abstract name has no mode).
fn peer_allowed(stream: &UnixStream) -> bool {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes a `ucred` of `len` bytes into storage we own.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast::<c_void>(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    r == 0 && (cred.uid == 0 || cred.uid == unsafe { libc::geteuid() })
}

// ---------------------------------------------------------------------------------------
// The operations, run by the agent in the target process.

const RUNNING: u32 = CUprocessState::CU_PROCESS_STATE_RUNNING as u32;
const LOCKED: u32 = CUprocessState::CU_PROCESS_STATE_LOCKED as u32;
const CHECKPOINTED: u32 = CUprocessState::CU_PROCESS_STATE_CHECKPOINTED as u32;
const FAILED: u32 = CUprocessState::CU_PROCESS_STATE_FAILED as u32;

/// This process's `CUprocessState`.
static STATE: AtomicU32 = AtomicU32::new(RUNNING);
/// Serialises the transitions, and holds the checkpoint image while checkpointed.
static OPS: Mutex<Option<Image>> = parking_lot::const_mutex(None);

/// Device memory copied out at checkpoint.
struct Image {
    /// Linear allocations: address and contents.
    linear: Vec<(u64, Vec<u8>)>,
    /// `cuMemCreate` allocations: handle and contents.
    physical: Vec<(u64, Vec<u8>)>,
    /// VMM mappings: address, size and the access they had.
    mappings: Vec<(u64, u64, c_uint)>,
    /// What the process held on each device's books.
    held: Vec<(usize, u64)>,
    /// The device of each context taken off the books.
    contexts: Vec<usize>,
}

/// RUNNING → LOCKED: closes the gate, then waits for the calls in flight and the queued
/// work. `timeout_ms` 0 waits as long as it takes; at the timeout the gate opens again,
/// the process stays RUNNING and the answer is `CUDA_ERROR_TIMEOUT`.
fn lock(timeout_ms: u32) -> CuResult {
    let _ops = OPS.lock();
    if STATE.load(Ordering::Acquire) != RUNNING {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    Gate::close();
    let deadline = (timeout_ms != 0).then(|| Instant::now() + Duration::from_millis(timeout_ms.into()));
    let mut nap = Duration::from_micros(20);
    while !(Gate::drained() && crate::stream::pending_jobs() == 0) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            Gate::open();
            return Err(CUresult::CUDA_ERROR_TIMEOUT);
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(2));
    }
    STATE.store(LOCKED, Ordering::Release);
    Ok(())
}

/// LOCKED → RUNNING: the waiting calls go on.
fn unlock() -> CuResult {
    let _ops = OPS.lock();
    if STATE.load(Ordering::Acquire) != LOCKED {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    STATE.store(RUNNING, Ordering::Release);
    Gate::open();
    Ok(())
}

/// LOCKED → CHECKPOINTED. A failure half-way leaves the process FAILED (and locked).
fn checkpoint() -> CuResult {
    let mut ops = OPS.lock();
    if STATE.load(Ordering::Acquire) != LOCKED {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let d = driver()?;
    // Memory shared with other processes cannot be taken away from them; NVIDIA's
    // cuda-checkpoint does not support IPC memory either. Refused before anything moves.
    let shared = {
        let reg = REGISTRY.read();
        reg.physical.values().any(|p| p.shared.is_some()) || crate::ipc::shares_memory(&reg)
    };
    if shared {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    match save(d) {
        Ok(image) => {
            *ops = Some(image);
            STATE.store(CHECKPOINTED, Ordering::Release);
            Ok(())
        }
        Err(code) => {
            STATE.store(FAILED, Ordering::Release);
            Err(code)
        }
    }
}

/// CHECKPOINTED → LOCKED. Without room on a device for what the process held, the answer
/// is `CUDA_ERROR_OUT_OF_MEMORY` and nothing changes: the process stays CHECKPOINTED and
/// the restore can be tried again. A failure after that leaves it FAILED.
fn restore() -> CuResult {
    let mut ops = OPS.lock();
    if STATE.load(Ordering::Acquire) != CHECKPOINTED {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let d = driver()?;
    let image = ops.take().ok_or(CUresult::CUDA_ERROR_ILLEGAL_STATE)?;
    // All the room or none of it.
    let mut charged = Vec::new();
    for &(device, bytes) in &image.held {
        if d.slot.charge(device, bytes).is_err() {
            for (device, bytes) in charged {
                d.slot.release(device, bytes);
            }
            *ops = Some(image);
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        charged.push((device, bytes));
    }
    match load(&image) {
        Ok(()) => {
            for &device in &image.contexts {
                d.slot.context_created(device);
            }
            STATE.store(LOCKED, Ordering::Release);
            Ok(())
        }
        Err(code) => {
            STATE.store(FAILED, Ordering::Release);
            Err(code)
        }
    }
}

/// Copies the device memory out, gives its pages back and takes the process off the
/// machine's books.
fn save(d: &Driver) -> CuResult<Image> {
    let reg = REGISTRY.write();
    let mut linear = Vec::new();
    for (&addr, a) in reg.allocs.iter().filter(|(_, a)| a.kind != Kind::Host) {
        // SAFETY: the registry lists [addr, addr + size) as a live read-write mapping of
        // ours; the gate is closed and the streams idle, so nothing writes it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, a.size as usize) }.to_vec();
        // The pages go; the addresses stay reserved, inaccessible, for the restore.
        replace_mapping(addr, a.size, libc::PROT_NONE)?;
        linear.push((addr, bytes));
    }
    let mut physical = Vec::new();
    for (&handle, p) in &reg.physical {
        let mut bytes = vec![0u8; p.size as usize];
        read_at(p.fd.as_raw_fd(), &mut bytes)?;
        // SAFETY: fallocate on a memory object we own; punching a hole frees its pages
        // (its mappings read zeros afterwards, and are made inaccessible below).
        let punched = unsafe {
            libc::fallocate(
                p.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                p.size as libc::off_t,
            )
        };
        if punched != 0 {
            return Err(CUresult::CUDA_ERROR_UNKNOWN);
        }
        physical.push((handle, bytes));
    }
    let mut mappings = Vec::new();
    for r in reg.reservations.values() {
        for (&addr, m) in &r.maps {
            protect(addr, m.size, libc::PROT_NONE)?;
            mappings.push((addr, m.size, m.access));
        }
    }
    let mut held = Vec::new();
    for device in 0..d.machine.device_count() {
        let bytes = d.slot.held(device);
        if bytes > 0 {
            d.slot.release(device, bytes);
            held.push((device, bytes));
        }
    }
    let contexts = crate::context::devices_of_live_contexts();
    for &device in &contexts {
        d.slot.context_destroyed(device);
    }
    Ok(Image { linear, physical, mappings, held, contexts })
}

/// Puts fresh pages under the saved addresses and copies the contents back.
fn load(image: &Image) -> CuResult {
    let reg = REGISTRY.read();
    for (addr, bytes) in &image.linear {
        replace_mapping(*addr, bytes.len() as u64, libc::PROT_READ | libc::PROT_WRITE)?;
        // SAFETY: [addr, addr + len) was just mapped read-write, fresh, and is ours.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *addr as *mut u8, bytes.len()) };
    }
    for (handle, bytes) in &image.physical {
        let p = reg.physical.get(handle).ok_or(CUresult::CUDA_ERROR_UNKNOWN)?;
        // SAFETY: fallocate on a memory object we own; the result is checked.
        if unsafe { libc::fallocate(p.fd.as_raw_fd(), 0, 0, p.size as libc::off_t) } != 0 {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        write_at(p.fd.as_raw_fd(), bytes)?;
    }
    for &(addr, size, access) in &image.mappings {
        let prot = match access {
            3 => libc::PROT_READ | libc::PROT_WRITE,
            1 => libc::PROT_READ,
            _ => libc::PROT_NONE,
        };
        protect(addr, size, prot)?;
    }
    Ok(())
}

/// Replaces `[addr, addr + len)`, a range of ours, with fresh anonymous memory.
fn replace_mapping(addr: u64, len: u64, prot: c_int) -> CuResult {
    // SAFETY: the range is one of our registry's allocations, so MAP_FIXED replaces only
    // memory of ours; the gate is closed and the streams idle, so nobody uses it.
    let got = unsafe {
        libc::mmap(
            addr as *mut c_void,
            len as usize,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if got == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(())
}

fn protect(addr: u64, len: u64, prot: c_int) -> CuResult {
    // SAFETY: the range is a VMM mapping of ours (listed in the registry).
    if unsafe { libc::mprotect(addr as *mut c_void, len as usize, prot) } != 0 {
        return Err(CUresult::CUDA_ERROR_UNKNOWN);
    }
    Ok(())
}

fn read_at(fd: c_int, buf: &mut [u8]) -> CuResult {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: reads into the unwritten tail of `buf`, which we own.
        let n = unsafe {
            libc::pread(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done, done as libc::off_t)
        };
        if n <= 0 {
            return Err(CUresult::CUDA_ERROR_UNKNOWN);
        }
        done += n as usize;
    }
    Ok(())
}

fn write_at(fd: c_int, buf: &[u8]) -> CuResult {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes from the unsent tail of `buf`, which we own.
        let n =
            unsafe { libc::pwrite(fd, buf[done..].as_ptr().cast(), buf.len() - done, done as libc::off_t) };
        if n <= 0 {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        done += n as usize;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The exports, in the calling process.

/// The codes an agent answers with, back from the wire (an unknown one is UNKNOWN).
fn result_from_code(code: u32) -> CUresult {
    use CUresult as R;
    [
        R::CUDA_SUCCESS,
        R::CUDA_ERROR_INVALID_VALUE,
        R::CUDA_ERROR_OUT_OF_MEMORY,
        R::CUDA_ERROR_NOT_INITIALIZED,
        R::CUDA_ERROR_ILLEGAL_STATE,
        R::CUDA_ERROR_NOT_FOUND,
        R::CUDA_ERROR_NOT_PERMITTED,
        R::CUDA_ERROR_TIMEOUT,
    ]
    .into_iter()
    .find(|r| *r as u32 == code)
    .unwrap_or(R::CUDA_ERROR_UNKNOWN)
}

/// Sends `op` to the agent of process `pid` and waits for its answer.
fn call(pid: c_int, op: Op, arg: u32) -> CuResult<u32> {
    let d = driver()?;
    if pid <= 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let name = socket_name(d.machine.path(), pid as u32);
    // No agent: not a live process that initialised simgpu on this machine.
    let address = name.address().map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?;
    let mut stream = UnixStream::connect_addr(&address).map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?;
    let mut request = [0u8; MESSAGE];
    request[..4].copy_from_slice(&(op as u32).to_ne_bytes());
    request[4..].copy_from_slice(&arg.to_ne_bytes());
    stream.write_all(&request).map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?;
    let mut reply = [0u8; MESSAGE];
    // The target went away during the operation.
    stream.read_exact(&mut reply).map_err(|_| CUresult::CUDA_ERROR_UNKNOWN)?;
    let code = u32::from_ne_bytes([reply[0], reply[1], reply[2], reply[3]]);
    let value = u32::from_ne_bytes([reply[4], reply[5], reply[6], reply[7]]);
    match result_from_code(code) {
        CUresult::CUDA_SUCCESS => Ok(value),
        error => Err(error),
    }
}

/// Reads optional arguments (`{ cuuint64_t reserved[8] }` in CUDA 12.8), whose words
/// must all be zero.
fn reserved_zero<T: Copy>(args: *const T, words: impl Fn(T) -> [u64; 8]) -> CuResult {
    if !args.is_null() && words(read_in(args)?).iter().any(|&w| w != 0) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// `cuCheckpointProcessGetState`.
pub(crate) fn get_state(pid: c_int, out: *mut CUprocessState) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let state = match call(pid, Op::GetState, 0)? {
        RUNNING => CUprocessState::CU_PROCESS_STATE_RUNNING,
        LOCKED => CUprocessState::CU_PROCESS_STATE_LOCKED,
        CHECKPOINTED => CUprocessState::CU_PROCESS_STATE_CHECKPOINTED,
        _ => CUprocessState::CU_PROCESS_STATE_FAILED,
    };
    write_out(out, state)
}

/// `cuCheckpointProcessLock`; `args` may be null (no timeout).
pub(crate) fn lock_process(pid: c_int, args: *const CUcheckpointLockArgs) -> CuResult {
    let timeout = if args.is_null() {
        0
    } else {
        let a = read_in(args)?;
        if a.reserved0 != 0 || a.reserved1.iter().any(|&w| w != 0) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        a.timeoutMs
    };
    call(pid, Op::Lock, timeout).map(drop)
}

/// `cuCheckpointProcessCheckpoint`; `args` may be null.
pub(crate) fn checkpoint_process(pid: c_int, args: *const CUcheckpointCheckpointArgs) -> CuResult {
    reserved_zero(args, |a| a.reserved)?;
    call(pid, Op::Checkpoint, 0).map(drop)
}

/// `cuCheckpointProcessRestore`; `args` may be null.
pub(crate) fn restore_process(pid: c_int, args: *const CUcheckpointRestoreArgs) -> CuResult {
    reserved_zero(args, |a| a.reserved)?;
    call(pid, Op::Restore, 0).map(drop)
}

/// `cuCheckpointProcessUnlock`; `args` may be null.
pub(crate) fn unlock_process(pid: c_int, args: *const CUcheckpointUnlockArgs) -> CuResult {
    reserved_zero(args, |a| a.reserved)?;
    call(pid, Op::Unlock, 0).map(drop)
}

/// `cuCheckpointProcessGetRestoreThreadId`.
pub(crate) fn restore_thread_id(pid: c_int, out: *mut c_int) -> CuResult {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let tid = call(pid, Op::RestoreThreadId, 0)?;
    write_out(out, tid as c_int)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_sits_next_to_the_state_file_or_is_abstract_when_too_long() {
        assert_eq!(
            socket_name("/nonexistent/simgpu-1000", 42),
            SocketName::Path(PathBuf::from("/nonexistent/simgpu-1000.checkpoint-42"))
        );
        let long = format!("/nonexistent/{}", "x".repeat(120));
        match socket_name(&long, 7) {
            SocketName::Abstract(name) => {
                assert!(name.starts_with("simgpu-checkpoint-") && name.ends_with("-7"), "{name}");
                assert_eq!(socket_name(&long, 7), SocketName::Abstract(name));
            }
            other => panic!("expected an abstract name, got {other:?}"),
        }
    }

    #[test]
    fn answers_come_back_as_the_codes_sent() {
        for r in [CUresult::CUDA_ERROR_TIMEOUT, CUresult::CUDA_ERROR_ILLEGAL_STATE, CUresult::CUDA_SUCCESS] {
            assert_eq!(result_from_code(r as u32), r);
        }
        assert_eq!(result_from_code(123_456), CUresult::CUDA_ERROR_UNKNOWN);
    }
}
