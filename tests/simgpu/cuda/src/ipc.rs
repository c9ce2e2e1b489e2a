//! Legacy IPC of linear memory (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`) and peer access between contexts (`cuDeviceCanAccessPeer`,
//! `cuCtxEnablePeerAccess`, `cuCtxDisablePeerAccess`), as the CUDA driver API reference
//! describes them:
//!
//! - `cuIpcGetMemHandle` takes the *base* of a `cuMemAlloc` allocation and exports it;
//!   calling it again on the same allocation is harmless (the same handle), and memory
//!   freed and allocated again at the same address gets a new handle.
//! - `cuIpcOpenMemHandle` maps the exporter's memory into the importer: the same physical
//!   memory, no new allocation. Handles of one device may be opened by one context per
//!   device per other process; a handle the current context already opened gets its
//!   reference count raised and the same pointer back. The exporting process cannot open
//!   its own handle (the real driver answers `CUDA_ERROR_INVALID_CONTEXT`).
//! - `cuIpcCloseMemHandle` lowers that count and unmaps at zero; "the original allocation
//!   in the exporting process as well as imported mappings in other processes will be
//!   unaffected".
//! - The exporter's `cuMemFree` before the importers close is "undefined behavior" in the
//!   documentation. simgpu does what the driver's resource manager does with every shared
//!   memory descriptor (see `simgpu_state::objects`): the memory lives while any process
//!   maps it, charged to one holder at a time, the exporter first, then the next holder.
//!
//! The memory behind a handle is the machine's shared object (`simgpu_state::objects`),
//! the mechanism of exported VMM memory: taking the handle moves the allocation, at the
//! same address and with its contents, onto a named file that importers open by the
//! object's id.
//!
//! Peer access takes no device memory in simgpu (the documentation names none).

use std::collections::HashSet;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::LazyLock;

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUipcMemHandle};
use parking_lot::Mutex;

use crate::context;
use crate::driver::{device_index, driver};
use crate::ffi::{write_out, CUresult, CuResult};
use crate::memory::{round_up, Allocation, Kind, Registry, REGISTRY};

/// Marks a handle made by simgpu ("SIMGPUIP").
const MAGIC: u64 = 0x5049_5550_474d_4953;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one flag `cuIpcOpenMemHandle` knows.
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const PAGE: u64 = 4096;

/// An allocation of this process whose handle was taken.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Exported {
    /// The machine's id of its memory object.
    pub id: u64,
    /// The handle given out (the same one each time).
    pub handle: [u8; 64],
}

/// A handle this process opened.
#[derive(Debug)]
pub(crate) struct Opened {
    pub id: u64,
    pub ctx: usize,
    pub refs: u32,
}

/// What a handle holds: where to find the memory and how large it is.
#[derive(Debug, Clone, Copy)]
struct Decoded {
    id: u64,
    ino: u64,
    size: u64,
    exporter: u32,
}

fn encode(id: u64, ino: u64, size: u64, exporter: u32) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (i, v) in [MAGIC, id, ino, size, u64::from(exporter)].into_iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    out
}

fn decode(bytes: &[u8; 64]) -> Option<Decoded> {
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    (word(0) == MAGIC && word(1) != 0).then(|| Decoded {
        id: word(1),
        ino: word(2),
        size: word(3),
        exporter: word(4) as u32,
    })
}

fn handle_bytes(h: &CUipcMemHandle) -> [u8; 64] {
    h.reserved.map(|c| c as u8)
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn fstat_ino(fd: &OwnedFd) -> Option<u64> {
    // SAFETY: stat is a plain C struct; all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills `st` for a descriptor we own; the result is checked.
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some(st.st_ino)
}

/// Moves the allocation `[addr, addr + len)` onto `file` at the same address, keeping
/// its contents: the pages the program touched are copied (the rest read as zeros in
/// both), then the file is mapped over the range.
fn move_onto_file(addr: u64, len: u64, file: &OwnedFd) -> std::io::Result<()> {
    let pages = len.div_ceil(PAGE) as usize;
    let mut resident = vec![0u8; pages];
    // SAFETY: `[addr, addr + len)` is a mapping of this process (the registry lists it);
    // `resident` has one byte per page.
    if unsafe { libc::mincore(addr as *mut c_void, len as usize, resident.as_mut_ptr()) } != 0 {
        return Err(errno());
    }
    for (i, _) in resident.iter().enumerate().filter(|(_, r)| **r & 1 != 0) {
        let at = i as u64 * PAGE;
        let n = PAGE.min(len - at) as usize;
        // SAFETY: the page lies in the mapping, readable (device memory is read-write).
        let w = unsafe { libc::pwrite(file.as_raw_fd(), (addr + at) as *const c_void, n, at as libc::off_t) };
        if w != n as isize {
            return Err(errno());
        }
    }
    // SAFETY: MAP_FIXED over this process's own allocation, which the registry's write
    // lock keeps every copy and kernel away from; the file is at least `len` long.
    let m = unsafe {
        libc::mmap(
            addr as *mut c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            file.as_raw_fd(),
            0,
        )
    };
    if m == libc::MAP_FAILED {
        return Err(errno());
    }
    Ok(())
}

/// `cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)`.
pub(crate) fn get_mem_handle(out: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CuResult {
    let d = driver()?;
    context::current()?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut reg = REGISTRY.write();
    if let Some(e) = reg.ipc_exported.get(&dptr) {
        return write_handle(out, e.handle);
    }
    // Only the base of memory `cuMemAlloc` (or its pitched form) made.
    let (len, charged, device) = match reg.allocs.get(&dptr) {
        Some(a) if matches!(a.kind, Kind::Device | Kind::Pitched) && !a.freeing => {
            (a.size, a.charged, a.device)
        }
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    let file = simgpu_state::objects::backing_file(d.machine.path(), round_up(len.max(charged), PAGE))
        .map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    let ino = fstat_ino(&file).ok_or(CUresult::CUDA_ERROR_MAP_FAILED)?;
    move_onto_file(dptr, len, &file).map_err(|_| CUresult::CUDA_ERROR_MAP_FAILED)?;
    // The object is charged what the allocation was: its count moves to the machine's
    // shared object. No exported descriptor stays open (the one made is closed here):
    // importers find the object by its id.
    let (id, descriptor) =
        d.slot.export_object(None, file.as_fd(), device, charged, 0).map_err(|e| match e {
            simgpu_state::objects::ObjectError::Full => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            _ => CUresult::CUDA_ERROR_MAP_FAILED,
        })?;
    drop(descriptor);
    let handle = encode(id, ino, len, simgpu_state::driver_pid());
    reg.ipc_exported.insert(dptr, Exported { id, handle });
    write_handle(out, handle)
}

fn write_handle(out: *mut CUipcMemHandle, bytes: [u8; 64]) -> CuResult {
    write_out(out, CUipcMemHandle { reserved: bytes.map(|b| b as std::ffi::c_char) })
}

/// `cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)`.
pub(crate) fn open_mem_handle(out: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CuResult {
    let d = driver()?;
    let ctx = context::current()?;
    if out.is_null() || flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let h = decode(&handle_bytes(&handle)).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let mut reg = REGISTRY.write();
    // The exporting process cannot open its own handle.
    if h.exporter == simgpu_state::driver_pid() && reg.ipc_exported.values().any(|e| e.id == h.id) {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    if let Some((&addr, o)) = reg.ipc_opened.iter_mut().find(|(_, o)| o.id == h.id) {
        // One context per device may open it; the same context gets the same pointer.
        if o.ctx != ctx.handle() {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        o.refs += 1;
        return write_out(out, addr);
    }
    let path = std::ffi::CString::new(d.machine.object_path(h.id))
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: a valid C path; the result is checked.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW) };
    if fd < 0 {
        // Freed (no holder left) or never made on this machine.
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    if fstat_ino(&file) != Some(h.ino) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let object = d.slot.import_object(file.as_fd()).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let len = h.size;
    // SAFETY: a new shared mapping of the object's file at an address of the kernel's
    // choosing; the file is at least `len` long (its exporter sized it); checked.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        d.slot.leave_object(object.id);
        return Err(CUresult::CUDA_ERROR_MAP_FAILED);
    }
    let addr = addr as u64;
    // Listed as device memory of the object's device, charged nothing here: the machine's
    // object says who is charged.
    reg.allocs.insert(
        addr,
        Allocation {
            size: len,
            charged: 0,
            device: object.device,
            ctx: ctx.handle(),
            kind: Kind::Ipc,
            freeing: false,
        },
    );
    reg.ipc_opened.insert(addr, Opened { id: object.id, ctx: ctx.handle(), refs: 1 });
    write_out(out, addr)
}

/// `cuIpcCloseMemHandle(CUdeviceptr dptr)`: one reference less; unmapped at zero.
pub(crate) fn close_mem_handle(dptr: CUdeviceptr) -> CuResult {
    driver()?;
    context::current()?;
    let ctx = match REGISTRY.read().ipc_opened.get(&dptr) {
        Some(o) => o.ctx,
        None => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    // Work queued on the mapping finishes first, as a free waits for it.
    crate::memory::drain_context(ctx);
    let mut reg = REGISTRY.write();
    let o = reg.ipc_opened.get_mut(&dptr).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    o.refs -= 1;
    if o.refs == 0 {
        crate::memory::release_allocation(&mut reg, dptr);
    }
    Ok(())
}

/// What `memory::release_allocation` does for memory IPC shares: `true` if `addr` was
/// shared (exported or opened), after unmapping it and telling the machine this process
/// lets go of it (the object is freed, or its charge moves to the next holder). The
/// caller holds the registry for writing.
pub(crate) fn release_shared(reg: &mut Registry, addr: u64, len: u64) -> bool {
    let id = if let Some(e) = reg.ipc_exported.remove(&addr) {
        e.id
    } else if let Some(o) = reg.ipc_opened.remove(&addr) {
        o.id
    } else {
        return false;
    };
    crate::memory::unmap(addr, len);
    // A process holds the object while any of its mappings of it lives.
    let still_held =
        reg.ipc_opened.values().any(|o| o.id == id) || reg.ipc_exported.values().any(|e| e.id == id);
    if !still_held {
        if let Ok(d) = driver() {
            d.slot.leave_object(id);
        }
    }
    true
}

/// Whether this process exported or opened IPC memory (a checkpoint cannot take it).
pub(crate) fn shares_memory(reg: &Registry) -> bool {
    !reg.ipc_exported.is_empty() || !reg.ipc_opened.is_empty()
}

/// Pairs (context, peer context) with peer access enabled from the first to the second.
static PEERS: LazyLock<Mutex<HashSet<(usize, usize)>>> = LazyLock::new(Default::default);

/// `cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)`: simgpu's
/// devices are a PCIe machine whose every pair can reach each other; a device is not its
/// own peer (0).
pub(crate) fn device_can_access_peer(out: *mut c_int, dev: CUdevice, peer: CUdevice) -> CuResult {
    let (a, b) = (device_index(dev)?, device_index(peer)?);
    write_out(out, c_int::from(a != b))
}

/// `cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)`: access from the
/// current context to `peer`'s allocations, one way.
pub(crate) fn ctx_enable_peer_access(peer: CUcontext, flags: c_uint) -> CuResult {
    driver()?;
    let me = context::current()?;
    let other = context::lookup(peer as usize)?;
    if flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if other.handle() == me.handle() {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    if other.device == me.device {
        // cuDeviceCanAccessPeer says no for a device and itself.
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    }
    if !PEERS.lock().insert((me.handle(), other.handle())) {
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    }
    Ok(())
}

/// `cuCtxDisablePeerAccess(CUcontext peerContext)`.
pub(crate) fn ctx_disable_peer_access(peer: CUcontext) -> CuResult {
    driver()?;
    let me = context::current()?;
    let other = context::lookup(peer as usize)?;
    if !PEERS.lock().remove(&(me.handle(), other.handle())) {
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    }
    Ok(())
}

/// A destroyed context's peer access goes with it, both ways.
pub(crate) fn context_destroyed(ctx: usize) {
    PEERS.lock().retain(|&(a, b)| a != ctx && b != ctx);
}

/// How many handles this process has open, by object (tests).
#[cfg(test)]
fn opened() -> std::collections::HashMap<u64, u32> {
    REGISTRY.read().ipc_opened.values().map(|o| (o.id, o.refs)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_garbage_is_refused() {
        let h = encode(7, 99, 1 << 20, 1234);
        let d = decode(&h).expect("a handle simgpu made");
        assert_eq!((d.id, d.ino, d.size, d.exporter), (7, 99, 1 << 20, 1234));
        assert!(decode(&[0u8; 64]).is_none());
        assert!(decode(&[0xffu8; 64]).is_none());
        assert!(opened().is_empty());
    }
}
