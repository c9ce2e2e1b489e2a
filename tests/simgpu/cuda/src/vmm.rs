//! Virtual memory management with real address semantics: a reservation is a range of
//! inaccessible address space, a physical allocation is a memory object (memfd) charged
//! to the device, and mapping puts that object at an address of the reservation. Data
//! copied out before an unmap and back after a new create and map at the same address is
//! really the same data, and the program's pointers never change — what swap relies on.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

use simgpu_state::objects::ObjectError;

use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};

use crate::driver::{device_index, driver};
use crate::ffi::{read_in, write_out, CUresult, CuResult};
use crate::memory::{round_up, Mapping, Physical, Registry, Reservation, REGISTRY};

/// Granularity of every VMM size, address and offset (minimum and recommended).
pub(crate) const GRANULARITY: u64 = 2 << 20;

/// `CUmemLocation` with its enum read as a raw integer: a value from C that is not a
/// known enumerator must be refused, not be undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LocationRaw {
    pub kind: u32,
    pub id: i32,
}

/// `CUmemAllocationProp`, read raw.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AllocPropRaw {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location: LocationRaw,
    pub win32_metadata: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`, read raw.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AccessDescRaw {
    pub location: LocationRaw,
    pub flags: u32,
}

/// The leading fields of `CUmemPoolProps`, read raw.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PoolPropsRaw {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location: LocationRaw,
}

// The mirrors must match the cuda.h layouts cudarc carries.
const _: () = assert!(size_of::<LocationRaw>() == size_of::<sys::CUmemLocation>());
const _: () = assert!(size_of::<AllocPropRaw>() == size_of::<sys::CUmemAllocationProp>());
const _: () = assert!(size_of::<AccessDescRaw>() == size_of::<sys::CUmemAccessDesc>());
const _: () = assert!(size_of::<PoolPropsRaw>() <= size_of::<sys::CUmemPoolProps>());

/// The reservation holding all of `[ptr, ptr + size)`.
fn reservation_containing(reg: &mut Registry, ptr: u64, size: u64) -> CuResult<&mut Reservation> {
    reg.reservations
        .range_mut(..=ptr)
        .next_back()
        .filter(|(&b, r)| ptr.saturating_add(size) <= b + r.size)
        .map(|(_, r)| r)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)
}

/// Checks an allocation property: pinned device memory on an existing device.
fn device_of(prop: *const c_void) -> CuResult<usize> {
    let prop: AllocPropRaw = read_in(prop.cast())?;
    // CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE
    if prop.alloc_type != 1 || prop.location.kind != 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    device_index(prop.location.id)
}

fn aligned(v: u64) -> bool {
    v.is_multiple_of(GRANULARITY)
}

pub(crate) fn get_granularity(out: *mut usize, prop: *const c_void, option: c_uint) -> CuResult {
    driver()?;
    device_of(prop)?;
    if option > 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    write_out(out, GRANULARITY as usize)
}

pub(crate) fn address_reserve(
    out: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _hint: CUdeviceptr,
    flags: c_ulonglong,
) -> CuResult {
    driver()?;
    let size = size as u64;
    if out.is_null() || size == 0 || !aligned(size) || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let align = (alignment as u64).max(GRANULARITY);
    if !align.is_power_of_two() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // Reserve extra, then trim, to get the alignment.
    let span = size + align;
    let raw = crate::memory::map_anonymous(span, libc::PROT_NONE)?;
    let base = round_up(raw, align);
    if base > raw {
        crate::memory::unmap(raw, base - raw);
    }
    let tail = raw + span - (base + size);
    if tail > 0 {
        crate::memory::unmap(base + size, tail);
    }
    REGISTRY.write().reservations.insert(base, Reservation { size, maps: Default::default() });
    write_out(out, base)
}

pub(crate) fn address_free(ptr: CUdeviceptr, size: usize) -> CuResult {
    driver()?;
    let mut reg = REGISTRY.write();
    match reg.reservations.get(&ptr) {
        Some(r) if r.size == size as u64 && r.maps.is_empty() => {}
        // Freeing a reservation that still has mappings is refused, as by the driver.
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    }
    reg.reservations.remove(&ptr);
    crate::memory::unmap(ptr, size as u64);
    Ok(())
}

pub(crate) fn mem_create(
    out: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const c_void,
    flags: c_ulonglong,
) -> CuResult {
    let device = device_of(prop)?;
    let handle_types = read_in(prop.cast::<AllocPropRaw>())?.handle_types;
    let d = driver()?;
    let size = size as u64;
    if out.is_null() || size == 0 || !aligned(size) || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // Only POSIX file descriptors can be asked for: the Win32 kinds are not on Linux and
    // the device has no fabric (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0).
    if handle_types & !HANDLE_TYPE_POSIX_FD != 0 {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    d.slot.charge(device, size).map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    let fd = if handle_types & HANDLE_TYPE_POSIX_FD != 0 {
        // Exportable memory is an unnamed file that its first export names, so that other
        // processes can find out whether exported descriptors of it are still open.
        simgpu_state::objects::backing_file(d.machine.path(), size)
            .map_err(|_| CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        memory_object(size)
    };
    let fd = match fd {
        Ok(fd) => fd,
        Err(e) => {
            d.slot.release(device, size);
            return Err(e);
        }
    };
    let mut reg = REGISTRY.write();
    reg.next_handle += 1;
    let handle = reg.next_handle;
    reg.physical.insert(handle, Physical { fd, size, device, refs: 1, maps: 0, handle_types, shared: None });
    write_out(out, handle)
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_WIN32`, `_WIN32_KMT` and `_FABRIC`: real kinds this machine lacks.
const HANDLE_TYPES_ELSEWHERE: [u32; 3] = [2, 4, 8];

/// `cuMemExportToShareableHandle(void *shareableHandle, handle, handleType, flags)`: a new
/// file descriptor (an `int` written to `shareableHandle`) for the memory of `handle`,
/// which the allocation must have asked for (`requestedHandleTypes`). Each call gives a
/// new descriptor; the memory stays alive while any of them is open.
pub(crate) fn export_to_shareable_handle(
    out: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CuResult {
    let d = driver()?;
    if out.is_null() || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut reg = REGISTRY.write();
    let p = reg.physical.get_mut(&handle).filter(|p| p.refs > 0).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if handle_type != HANDLE_TYPE_POSIX_FD || p.handle_types & HANDLE_TYPE_POSIX_FD == 0 {
        // A kind the allocation did not ask for: it cannot be made afterwards.
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let (id, fd) = d
        .slot
        .export_object(p.shared, p.fd.as_fd(), p.device, p.size, p.handle_types)
        .map_err(|e| object_error(&e))?;
    p.shared = Some(id);
    write_out(out.cast::<c_int>(), fd.into_raw_fd())
}

/// `cuMemImportFromShareableHandle(handle *out, void *osHandle, handleType)`: for a POSIX
/// descriptor, `osHandle` is the descriptor itself cast to a pointer. The handle refers to
/// the exporter's memory; the caller keeps (and closes) its descriptor.
pub(crate) fn import_from_shareable_handle(
    out: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CuResult {
    let d = driver()?;
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if HANDLE_TYPES_ELSEWHERE.contains(&handle_type) {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    let raw = os_handle as isize;
    if handle_type != HANDLE_TYPE_POSIX_FD || !(0..=i32::MAX as isize).contains(&raw) {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(raw as c_int, libc::F_GETFD) } < 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the descriptor is open (checked above) and only used during this call;
    // closing it meanwhile from another thread would be the program's own race.
    let fd = unsafe { BorrowedFd::borrow_raw(raw as c_int) };
    let mut reg = REGISTRY.write();
    let object = d.slot.import_object(fd).map_err(|e| object_error(&e))?;
    // Imported again in a process that holds it: the same handle (the documentation
    // promises no particular one).
    let held = reg.physical.iter_mut().find(|(_, p)| p.shared == Some(object.id) && p.refs > 0);
    if let Some((&handle, p)) = held {
        p.refs += 1;
        return write_out(out, handle);
    }
    let own = match simgpu_state::objects::reopen(fd) {
        Ok(own) => own,
        Err(_) => {
            if !reg.physical.values().any(|p| p.shared == Some(object.id)) {
                d.slot.leave_object(object.id);
            }
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
    };
    reg.next_handle += 1;
    let handle = reg.next_handle;
    let p = Physical {
        fd: own,
        size: object.size,
        device: object.device,
        refs: 1,
        maps: 0,
        handle_types: object.handle_types,
        shared: Some(object.id),
    };
    reg.physical.insert(handle, p);
    write_out(out, handle)
}

fn object_error(e: &ObjectError) -> CUresult {
    match e {
        ObjectError::Full => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ObjectError::Unknown | ObjectError::Io(_) => CUresult::CUDA_ERROR_INVALID_VALUE,
    }
}

fn memory_object(size: u64) -> CuResult<OwnedFd> {
    // SAFETY: the name is a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(c"simgpu-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a descriptor we own; the result is checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // Its pages are made when it is first mapped with access (`mem_set_access` populates
    // them): its first use costs no page faults, as on a GPU, and they are zeroed once.
    Ok(fd)
}

/// Drops a physical allocation once it has no handle reference and no mapping.
fn free_if_unused(reg: &mut Registry, handle: u64) {
    if reg.physical.get(&handle).is_some_and(|p| p.refs == 0 && p.maps == 0) {
        if let Some(p) = reg.physical.remove(&handle) {
            if let Ok(d) = driver() {
                match p.shared {
                    // Other processes may hold it: the machine decides who is charged now.
                    Some(id) => d.slot.leave_object(id),
                    None => d.slot.release(p.device, p.size),
                }
            }
        }
    }
}

pub(crate) fn mem_release(handle: CUmemGenericAllocationHandle) -> CuResult {
    driver()?;
    let mut reg = REGISTRY.write();
    let p = reg.physical.get_mut(&handle).filter(|p| p.refs > 0).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    p.refs -= 1;
    free_if_unused(&mut reg, handle);
    Ok(())
}

pub(crate) fn mem_map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CuResult {
    driver()?;
    let (size, offset) = (size as u64, offset as u64);
    if size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut reg = REGISTRY.write();
    let fd = match reg.physical.get(&handle) {
        Some(p) if p.refs > 0 && offset + size <= p.size => p.fd.as_raw_fd(),
        _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
    };
    let reservation = reservation_containing(&mut reg, ptr, size)?;
    let overlaps = reservation.maps.range(..ptr + size).next_back().is_some_and(|(&b, m)| b + m.size > ptr);
    if overlaps {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // Mapped inaccessible: access comes with cuMemSetAccess, as on a GPU.
    // SAFETY: the range lies inside our own PROT_NONE reservation, which nothing else
    // uses, and fd is a live memory object of at least offset + size bytes.
    let addr = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            size as usize,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    reservation.maps.insert(ptr, Mapping { size, handle, access: 0 });
    if let Some(p) = reg.physical.get_mut(&handle) {
        p.maps += 1;
    }
    Ok(())
}

pub(crate) fn mem_unmap(ptr: CUdeviceptr, size: usize) -> CuResult {
    driver()?;
    let size = size as u64;
    let mut reg = REGISTRY.write();
    let reservation = reservation_containing(&mut reg, ptr, size)?;
    // The range must be exactly a run of whole mappings.
    let pieces: Vec<(u64, Mapping)> =
        reservation.maps.range(ptr..ptr + size).map(|(&b, &m)| (b, m)).collect();
    let mut at = ptr;
    for (b, m) in &pieces {
        if *b != at {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        at += m.size;
    }
    if at != ptr + size || pieces.is_empty() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // Put the reservation back: inaccessible, not backed.
    // SAFETY: the range is ours (inside our reservation, currently mapped by us).
    let addr = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            size as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_UNKNOWN);
    }
    for (b, _) in &pieces {
        reservation.maps.remove(b);
    }
    for (_, m) in pieces {
        if let Some(p) = reg.physical.get_mut(&m.handle) {
            p.maps -= 1;
        }
        free_if_unused(&mut reg, m.handle);
    }
    Ok(())
}

/// `madvise` advice to fault pages in ahead of use (Linux 5.14), named here for older libc
/// crates.
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;

pub(crate) fn mem_set_access(ptr: CUdeviceptr, size: usize, desc: *const c_void, count: usize) -> CuResult {
    driver()?;
    if desc.is_null() || count == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let mut flags = None;
    for i in 0..count {
        // SAFETY: the caller passes an array of `count` descriptors.
        let entry: AccessDescRaw = read_in(unsafe { desc.cast::<AccessDescRaw>().add(i) })?;
        if entry.location.kind != 1 || !matches!(entry.flags, 0 | 1 | 3) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        device_index(entry.location.id)?;
        flags = Some(entry.flags);
    }
    let flags = flags.unwrap_or(0);
    let size = size as u64;
    let mut reg = REGISTRY.write();
    let reservation = reservation_containing(&mut reg, ptr, size)?;
    // Every byte of the range must be mapped.
    let mut at = ptr;
    while at < ptr + size {
        match reservation.maps.range(..=at).next_back() {
            Some((&b, m)) if at < b + m.size => at = b + m.size,
            _ => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    }
    let prot = match flags {
        3 => libc::PROT_READ | libc::PROT_WRITE,
        1 => libc::PROT_READ,
        _ => libc::PROT_NONE,
    };
    // SAFETY: the whole range is mapped by us (checked above).
    if unsafe { libc::mprotect(ptr as *mut c_void, size as usize, prot) } != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    if prot != libc::PROT_NONE {
        // The memory exists since cuMemCreate: map its pages now, as a GPU's mapping is
        // resident, so that the first use does not fault page by page. Best effort
        // (kernels before 5.14 lack MADV_POPULATE_READ/WRITE).
        let advice = if prot & libc::PROT_WRITE != 0 { MADV_POPULATE_WRITE } else { MADV_POPULATE_READ };
        // SAFETY: advice on a range we mapped (checked above); it only prefaults pages.
        unsafe { libc::madvise(ptr as *mut c_void, size as usize, advice) };
    }
    let starts: Vec<u64> = reservation.maps.range(..ptr + size).map(|(&b, _)| b).collect();
    for b in starts {
        if let Some(m) = reservation.maps.get_mut(&b) {
            if b + m.size > ptr {
                m.access = flags;
            }
        }
    }
    Ok(())
}

pub(crate) fn retain_allocation_handle(
    out: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CuResult {
    driver()?;
    let addr = addr as u64;
    let mut reg = REGISTRY.write();
    let handle = reg
        .reservations
        .range(..=addr)
        .next_back()
        .and_then(|(_, r)| r.maps.range(..=addr).next_back())
        .filter(|(&b, m)| addr < b + m.size)
        .map(|(_, m)| m.handle)
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    if let Some(p) = reg.physical.get_mut(&handle) {
        p.refs += 1;
    }
    write_out(out, handle)
}

pub(crate) fn get_allocation_properties(out: *mut c_void, handle: CUmemGenericAllocationHandle) -> CuResult {
    driver()?;
    let (device, handle_types) = REGISTRY
        .read()
        .physical
        .get(&handle)
        .map(|p| (p.device, p.handle_types))
        .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
    let prop = AllocPropRaw {
        alloc_type: 1,
        handle_types,
        location: LocationRaw { kind: 1, id: device as i32 },
        win32_metadata: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    };
    write_out(out.cast::<AllocPropRaw>(), prop)
}
