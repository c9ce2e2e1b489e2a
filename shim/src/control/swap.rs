//! The swap resolver's half in the shim. In a group whose resolver is `swap`, every
//! linear allocation that lies wholly above the group's request (a burst) is backed by
//! the VMM API: an address range is reserved, physical memory created and mapped there.
//! When the arbiter asks this process to make room, a worker thread closes the gate
//! (launches, copies and sets wait; calls inside finish), synchronizes every context,
//! copies each burst allocation to pinned host memory, unmaps and releases its physical
//! memory and keeps the address range. The process needs not cooperate: it may sleep or
//! compute on the CPU. On its next gated call (or when the arbiter says memory is free)
//! the worker asks for the memory back, waits as long as it takes, maps new physical
//! memory at the same addresses, copies the data back and opens the gate: the program's
//! pointers never change. The host copies live in this process, so nothing is lost if the
//! arbiter dies meanwhile, and they are freed with the process.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Request, SwapDirection};

use crate::control::arbiter::{Client, NotGranted};
use crate::driver::ffi::{CUdeviceptr, Status, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::{Charge, Enforcer, Slice};

/// `CUmemAllocationProp`: pinned device memory on one device.
#[repr(C)]
struct AllocationProp {
    kind: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32_metadata: *mut c_void,
    compression: u8,
    gpu_direct_rdma: u8,
    usage: u16,
    reserved: [u8; 4],
}

impl AllocationProp {
    fn device(ordinal: usize) -> AllocationProp {
        AllocationProp {
            kind: 1,          // CU_MEM_ALLOCATION_TYPE_PINNED
            handle_types: 0,  // CU_MEM_HANDLE_TYPE_NONE
            location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
            location_id: ordinal as i32,
            win32_metadata: std::ptr::null_mut(),
            compression: 0,
            gpu_direct_rdma: 0,
            usage: 0,
            reserved: [0; 4],
        }
    }
}

/// `CUmemAccessDesc`: read-write access from one device.
#[repr(C)]
struct AccessDesc {
    location_type: u32,
    location_id: i32,
    flags: u32,
}

/// One VMM-backed burst allocation.
#[derive(Debug)]
struct Backing {
    /// Reserved, mapped and charged bytes (the request rounded to the granularity).
    size: u64,
    ordinal: usize,
    /// The ledger's device index.
    device: usize,
    /// The context it was allocated in (copies run there).
    context: u64,
    /// The physical allocation while resident; 0 while swapped out.
    handle: u64,
    /// The host copy while swapped out; 0 while resident (unless copying it back failed,
    /// when it is kept until the allocation is freed).
    host: usize,
    /// The host copy is pinned (`cuMemAllocHost`), not `malloc`ed.
    pinned: bool,
}

#[derive(Default)]
struct Book {
    /// By address.
    backings: BTreeMap<CUdeviceptr, Backing>,
    /// Host bytes per ledger device while swapped out.
    swapped: BTreeMap<usize, u64>,
}

static BOOK: Mutex<Book> = Mutex::new(Book { backings: BTreeMap::new(), swapped: BTreeMap::new() });
/// Some allocation is VMM-backed: frees must look in the book.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Granularity per CUDA ordinal (0: not asked yet).
static GRANULARITY: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

fn book() -> MutexGuard<'static, Book> {
    BOOK.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the worker is asked to do.
enum Command {
    /// The arbiter wants this device's burst memory.
    SwapOut(DeviceId),
    /// Memory is free again (the arbiter says) or a call waits at the gate.
    ComeBack,
    /// The arbiter parks this process on a device (see `park`).
    Park { device: DeviceId, checkpoint: bool },
    /// A call waits at the gate of the parked process.
    Wake,
    /// The arbiter gave a park up.
    Unparked(DeviceId),
}

static WORKER: OnceLock<Mutex<Sender<Command>>> = OnceLock::new();

fn tell(command: Command) {
    if let Some(tx) = WORKER.get() {
        let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(command);
    }
}

/// A call waits at the closed gate: the process wants its memory back.
pub(crate) fn wanted() {
    if crate::control::park::parked() {
        tell(Command::Wake);
    } else if swapped_out() {
        tell(Command::ComeBack);
    }
}

/// The arbiter pushed `Park` for `device`.
pub(crate) fn park_requested(device: DeviceId, checkpoint: bool) {
    tell(Command::Park { device, checkpoint });
}

/// The arbiter pushed `Unparked` for `device`.
pub(crate) fn unpark_pushed(device: DeviceId) {
    tell(Command::Unparked(device));
}

/// The arbiter pushed `SwapOut` for `device`.
pub(crate) fn swap_out_requested(device: DeviceId) {
    tell(Command::SwapOut(device));
}

/// The arbiter pushed `Resume`: memory is free again.
pub(crate) fn resume_offered() {
    tell(Command::ComeBack);
}

/// Whether some burst memory is swapped out (the gate stays closed for it).
pub(crate) fn swapped_out() -> bool {
    book().swapped.values().any(|&b| b > 0)
}

/// Host bytes kept for ledger device `device` (for re-registration after an arbiter restart).
pub(crate) fn host_bytes(device: usize) -> u64 {
    book().swapped.get(&device).copied().unwrap_or(0)
}

/// Starts the worker that performs swaps and parks (at `cuInit`, for groups using swap
/// or parkable).
pub(crate) fn start(e: &'static Enforcer, client: Arc<Client>) -> Result<(), String> {
    let (tx, rx) = channel();
    if WORKER.set(Mutex::new(tx)).is_err() {
        return Ok(());
    }
    // Before any swappable allocation exists (cuInit): no call can be inside untracked.
    crate::control::gate::track();
    std::thread::Builder::new()
        .name("gpufrac-swap".into())
        .spawn(move || worker(e, client, rx))
        .map(|_| ())
        .map_err(|e| format!("gpufrac: cannot start the swap thread: {e}"))
}

fn worker(e: &'static Enforcer, client: Arc<Client>, rx: Receiver<Command>) {
    let mut next = None;
    while let Some(command) = next.take().or_else(|| rx.recv().ok()) {
        match command {
            Command::SwapOut(uuid) => {
                let Some(slice) = e.slice_by_uuid(&uuid) else { continue };
                // What the frameworks keep and do not use goes back rather than to host RAM.
                crate::control::give_back::ask_and_wait(
                    e,
                    crate::control::give_back::Why::Moving,
                    crate::control::give_back::BEFORE_MOVING,
                );
                let out = swap_out(e, &slice);
                tracing::info!(
                    bytes = out.bytes,
                    ms = out.took.as_millis() as u64,
                    "swapped burst memory out to host RAM"
                );
                client.send_until_delivered(&report(e, &slice, SwapDirection::Out, out.bytes, out.took));
            }
            Command::ComeBack => {
                // Several calls may have asked: one swap-in serves them all (a command of
                // another kind found meanwhile is kept for after it).
                while let Ok(queued) = rx.try_recv() {
                    if !matches!(queued, Command::ComeBack) {
                        next = Some(queued);
                        break;
                    }
                }
                come_back(e, &client);
            }
            Command::Park { device, checkpoint } => {
                crate::control::park::park(e, &client, device, checkpoint)
            }
            Command::Wake => crate::control::park::wake(e, &client),
            Command::Unparked(device) => crate::control::park::unparked(device),
        }
    }
}

/// Longest pause before a swap-in the arbiter refused at once is asked again.
const REFUSED_PAUSE: Duration = Duration::from_secs(5);

/// Asks for each swapped-out device's memory until it is granted, and swaps it in.
fn come_back(e: &'static Enforcer, client: &Client) {
    let swapped: Vec<(usize, u64)> =
        book().swapped.iter().filter(|(_, &b)| b > 0).map(|(&d, &b)| (d, b)).collect();
    for (device, _) in swapped {
        let Some(slice) = e.slice_by_ledger(device) else { continue };
        let mut asked = 0u32;
        let (granted, bytes) = loop {
            // Read anew each time: swapped-out memory freed meanwhile is not asked for
            // (the arbiter refuses a swap-in for more than is swapped out).
            let bytes = host_bytes(device);
            if bytes == 0 {
                break (0, 0);
            }
            let held = e.ledger.held_by_me(device);
            // The arbiter keeps a swap-in waiting an hour (its RESUME_WAIT) and answers
            // `Timeout` then; this loop asks again, so the process waits as long as it
            // takes. The timeout here is a little longer, so that the arbiter answers
            // first. While it is away, the process waits GPUFRAC_WAIT_TIMEOUT for it, then
            // comes back on its own if the device has the memory free (as a process
            // without an arbiter takes its bursts).
            let away = !client.is_connected();
            let timeout = if away { e.config.wait_timeout } else { Duration::from_secs(3600) };
            match client.acquire(slice.uuid, bytes, bytes, held, timeout, true) {
                Ok(granted) => break (granted, bytes),
                Err(_) if away && !client.is_connected() && device_has_room(&slice, bytes) => {
                    tracing::warn!(
                        bytes,
                        "the arbiter is away: swapping back in on the device's free memory"
                    );
                    break (bytes, bytes);
                }
                Err(why) => {
                    asked += 1;
                    if asked == 1 || asked.is_multiple_of(600) {
                        tracing::warn!(bytes, asked, "the swap-in was not granted yet ({why}); asking again");
                    }
                    // Refused at once (it can never fit while the GPU's guarantees stay as
                    // they are, or the arbiter's ledger disagrees with ours): ask again less
                    // often, up to every 5 s, until the guarantees change.
                    let refused = matches!(why, NotGranted::Denied(d) if d != Denial::Timeout);
                    let pause = if refused {
                        Duration::from_millis(100 << asked.min(6)).min(REFUSED_PAUSE)
                    } else {
                        Duration::from_millis(100)
                    };
                    std::thread::sleep(pause);
                }
            }
        };
        charge_swap_in(e, device, bytes, granted);
        let (moved, took) = swap_in(e, &slice, bytes);
        tracing::info!(bytes = moved, ms = took.as_millis() as u64, "swapped burst memory back in");
        client.send_until_delivered(&report(e, &slice, SwapDirection::In, moved, took));
    }
}

/// Counts the `bytes` a swap-in is about to map as held, then its grant as lent: in this
/// order, so that a thread allocating meanwhile (in this process or another of its group)
/// finds no room in the grant. Had it taken some, the swap-in would map the rest of what
/// the group was lent, and the allocation would find the device full. Counted held, the
/// grant is also not unused, and a reclaim meanwhile (a burst waits) does not take it
/// back. [`swap_in`] is then told `bytes` as what was charged.
pub(crate) fn charge_swap_in(e: &Enforcer, device: usize, bytes: u64, granted: u64) {
    e.ledger.force_charge(device, bytes);
    e.ledger.add_granted(device, granted);
}

/// Whether the device of `slice` has `bytes` free now, as the driver counts (read in the
/// context of one of its swapped-out allocations).
fn device_has_room(slice: &Slice, bytes: u64) -> bool {
    let Some(context) = book().backings.values().find(|b| b.device == slice.ledger).map(|b| b.context) else {
        return false;
    };
    let (mut free, mut total) = (0usize, 0usize);
    let status = in_context(context, || call_real!(cuMemGetInfo_v2(&mut free, &mut total)));
    status == SUCCESS && free as u64 >= bytes
}

/// Where this process's burst memory on `slice`'s device is now, after moving `bytes`.
fn report(e: &Enforcer, slice: &Slice, direction: SwapDirection, bytes: u64, took: Duration) -> Request {
    let _consistent = book();
    let (device, micros) = (slice.uuid, took.as_micros() as u64);
    let host_bytes = _consistent.swapped.get(&slice.ledger).copied().unwrap_or(0);
    let (granted, held) = (e.ledger.my_granted(slice.ledger), e.ledger.held_by_me(slice.ledger));
    Request::Swapped { device, direction, bytes, granted, host_bytes, held, micros }
}

/// The allocation granularity of device `ordinal`.
fn granularity(ordinal: usize) -> u64 {
    let slot = &GRANULARITY[ordinal.min(63)];
    let known = slot.load(Ordering::Relaxed);
    if known != 0 {
        return known;
    }
    let prop = AllocationProp::device(ordinal);
    let mut g = 0usize;
    let status =
        call_real!(cuMemGetAllocationGranularity(&mut g, (&prop as *const AllocationProp).cast(), 0));
    let g = if status == SUCCESS && g > 0 { g as u64 } else { 2 << 20 };
    slot.store(g, Ordering::Relaxed);
    g
}

/// Whether an allocation charged as `charge` is backed by the VMM API (swappable): the
/// group uses swap, has an arbiter, and the allocation lies wholly above the request.
/// Allocations smaller than the granularity stay plain: rounding them up would waste
/// more than swapping them saves. In a parkable process every allocation is backed (a
/// park moves them all), not only bursts.
pub(crate) fn backs(e: &Enforcer, ordinal: usize, charge: &Charge) -> bool {
    let swap = e.config.resolver == gpufrac_common::Resolver::Swap && charge.whole_burst;
    (swap || crate::control::park::parkable())
        && e.lender.get().is_some()
        && charge.bytes >= granularity(ordinal)
}

/// Allocates `charge.bytes` on device `ordinal` in context `context` as a VMM-backed
/// burst, writing the address to `out`. The charge is topped up to the rounded size.
pub(crate) fn allocate(
    e: &Enforcer,
    ordinal: usize,
    context: u64,
    mut charge: Charge,
    out: *mut CUdeviceptr,
) -> Status {
    let g = granularity(ordinal);
    let size = charge.bytes.div_ceil(g) * g;
    if size > charge.bytes {
        match e.charge(ordinal, size - charge.bytes) {
            Ok(_) => charge.bytes = size,
            Err(status) => {
                e.release(charge.device, charge.bytes);
                return status;
            }
        }
    }
    // The memory is made before the book is locked: waiting for the device to have it
    // (a loan being taken back) must not hold up a swap-out the arbiter asks for meanwhile.
    let handle = match create(e, ordinal, size) {
        Ok(handle) => handle,
        Err(status) => {
            e.release(charge.device, charge.bytes);
            return status;
        }
    };
    // The book stays locked until the allocation is in it, so that a swap-out either
    // sees it or runs before it is mapped.
    let mut book = book();
    let mut addr: u64 = 0;
    let mut status = call_real!(cuMemAddressReserve(&mut addr, size as usize, g as usize, 0, 0));
    if status == SUCCESS {
        status = map_at(ordinal, addr, size, handle);
        if status == SUCCESS {
            book.backings.insert(
                addr,
                Backing { size, ordinal, device: charge.device, context, handle, host: 0, pinned: false },
            );
            ACTIVE.store(true, Ordering::Release);
            // SAFETY: `out` is the caller's out-pointer, checked non-null.
            unsafe { out.write(addr) };
            return SUCCESS;
        }
        call_real!(cuMemAddressFree(addr, size as usize));
    } else {
        call_real!(cuMemRelease(handle));
    }
    drop(book);
    e.release(charge.device, charge.bytes);
    status
}

/// Creates `size` bytes of physical memory on `ordinal` and maps it read-write at `addr`.
fn map_new(e: &Enforcer, ordinal: usize, addr: u64, size: u64) -> Result<u64, Status> {
    let handle = create(e, ordinal, size)?;
    match map_at(ordinal, addr, size, handle) {
        SUCCESS => Ok(handle),
        status => Err(status),
    }
}

/// Creates `size` bytes of physical memory on `ordinal`, waiting while the device has
/// none free for memory the group was lent (see `Enforcer::physical`).
fn create(e: &Enforcer, ordinal: usize, size: u64) -> Result<u64, Status> {
    let prop = AllocationProp::device(ordinal);
    let mut handle = 0u64;
    let status = e.physical(|| {
        call_real!(cuMemCreate(&mut handle, size as usize, (&prop as *const AllocationProp).cast(), 0))
    });
    if status == SUCCESS {
        Ok(handle)
    } else {
        Err(status)
    }
}

/// Maps the physical memory `handle` read-write at `addr`; on failure it is released.
fn map_at(ordinal: usize, addr: u64, size: u64, handle: u64) -> Status {
    let access = AccessDesc { location_type: 1, location_id: ordinal as i32, flags: 3 };
    let mut status = call_real!(cuMemMap(addr, size as usize, 0, handle, 0));
    if status == SUCCESS {
        status = call_real!(cuMemSetAccess(addr, size as usize, (&access as *const AccessDesc).cast(), 1));
        if status != SUCCESS {
            call_real!(cuMemUnmap(addr, size as usize));
        }
    }
    if status != SUCCESS {
        call_real!(cuMemRelease(handle));
    }
    status
}

/// Frees a VMM-backed allocation at `addr`; `None` if it is not one. An async free
/// (`stream`) first waits for the stream's work, which may still use the memory.
pub(crate) fn free(e: &Enforcer, addr: CUdeviceptr, stream: Option<*mut c_void>) -> Option<Status> {
    if !ACTIVE.load(Ordering::Acquire) {
        return None;
    }
    let mut book = book();
    let b = book.backings.remove(&addr)?;
    if let Some(stream) = stream.filter(|&s| !crate::driver::table::stream_capturing(s)) {
        call_real!(cuStreamSynchronize(stream));
    }
    if b.handle != 0 {
        call_real!(cuMemUnmap(addr, b.size as usize));
        call_real!(cuMemRelease(b.handle));
        // A host copy beside a resident allocation: one whose copy back failed.
        if b.host != 0 {
            free_host(b.host, b.pinned);
        }
    } else {
        free_host(b.host, b.pinned);
        if let Some(swapped) = book.swapped.get_mut(&b.device) {
            *swapped = swapped.saturating_sub(b.size);
        }
    }
    let still_swapped = book.swapped.values().any(|&v| v > 0);
    drop(book);
    call_real!(cuMemAddressFree(addr, b.size as usize));
    if b.handle != 0 {
        e.release(b.device, b.size);
    } else {
        // Freed while in host RAM: the arbiter counts less host RAM. Not waited for: a
        // message lost now is corrected by the next one or the next registration.
        if let (Some(client), Some(slice)) = (crate::control::arbiter::client(), e.slice_by_ledger(b.device))
        {
            client.send(&report(e, &slice, SwapDirection::In, 0, Duration::ZERO));
        }
        if !still_swapped {
            crate::control::gate::open();
        }
    }
    Some(SUCCESS)
}

/// What a swap-out did.
pub(crate) struct SwappedOut {
    pub(crate) bytes: u64,
    pub(crate) took: Duration,
}

/// Runs `f` with `context` current on this thread.
fn in_context(context: u64, f: impl FnOnce() -> Status) -> Status {
    let pushed = call_real!(cuCtxPushCurrent_v2(context as *mut c_void));
    let status = f();
    if pushed == SUCCESS {
        let mut popped = std::ptr::null_mut();
        call_real!(cuCtxPopCurrent_v2(&mut popped));
    }
    status
}

fn alloc_host(size: u64) -> Option<(usize, bool)> {
    let mut p: *mut c_void = std::ptr::null_mut();
    if call_real!(cuMemAllocHost_v2(&mut p, size as usize)) == SUCCESS && !p.is_null() {
        return Some((p as usize, true));
    }
    // SAFETY: malloc has no preconditions; a null result is handled.
    let p = unsafe { libc::malloc(size as usize) };
    (!p.is_null()).then_some((p as usize, false))
}

/// Touches every page of a fresh host buffer, so that the copy into it does not stop
/// at each page (pinned memory is already resident: this costs little there).
fn prefault(host: usize, size: usize) {
    for offset in (0..size).step_by(4096) {
        // SAFETY: `host` is a writable buffer of `size` bytes that nobody reads yet.
        unsafe { std::ptr::write_volatile((host + offset) as *mut u8, 0) };
    }
}

fn free_host(host: usize, pinned: bool) {
    if host == 0 {
        return;
    }
    if pinned {
        call_real!(cuMemFreeHost(host as *mut c_void));
    } else {
        // SAFETY: `host` came from malloc in alloc_host and is freed once.
        unsafe { libc::free(host as *mut c_void) };
    }
}

/// Moves this process's burst allocations on `slice`'s device to host RAM.
pub(crate) fn swap_out(e: &Enforcer, slice: &Slice) -> SwappedOut {
    let started = Instant::now();
    let mut book = book();
    let mut resident: Vec<CUdeviceptr> = book
        .backings
        .iter()
        .filter(|(_, b)| b.device == slice.ledger && b.handle != 0)
        .map(|(&a, _)| a)
        .collect();
    let mut host_bytes = 0;
    if !resident.is_empty() {
        crate::control::gate::close();
        // Queued kernels and copies may still use the memory.
        let mut contexts: Vec<u64> =
            resident.iter().filter_map(|a| book.backings.get(a)).map(|b| b.context).collect();
        contexts.sort_unstable();
        contexts.dedup();
        for ctx in contexts {
            let status = in_context(ctx, || call_real!(cuCtxSynchronize()));
            if status != SUCCESS {
                tracing::warn!(
                    status,
                    "cuCtxSynchronize failed before a swap-out; swapping what can be copied"
                );
            }
        }
        resident.sort_unstable();
        let sizes: Vec<u64> = resident.iter().filter_map(|a| book.backings.get(a)).map(|b| b.size).collect();
        let stop = AtomicBool::new(false);
        // Three stages on their own threads: host buffers are made ready (faulted in) one
        // ahead of the copy, and device memory is released behind it.
        std::thread::scope(|scope| {
            let (ready_tx, ready_rx) = sync_channel::<Option<(usize, bool)>>(1);
            let (done_tx, done_rx) = channel::<(u64, usize, u64, usize)>();
            let stop = &stop;
            scope.spawn(move || {
                for size in sizes {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let host = alloc_host(size).inspect(|&(h, _)| prefault(h, size as usize));
                    if let Err(unsent) = ready_tx.send(host) {
                        if let Some((h, pinned)) = unsent.0 {
                            free_host(h, pinned);
                        }
                        break;
                    }
                }
            });
            scope.spawn(move || {
                for (addr, size, handle, device) in done_rx {
                    call_real!(cuMemUnmap(addr, size));
                    call_real!(cuMemRelease(handle));
                    // Uncharged once the device has it back, not before: until then it
                    // is held, and a reclaim meanwhile must not give its grant back.
                    e.ledger.release(device, size as u64);
                }
            });
            for addr in resident {
                let Some(b) = book.backings.get_mut(&addr) else { continue };
                let Ok(Some((host, pinned))) = ready_rx.recv() else {
                    tracing::warn!(
                        bytes = b.size,
                        "no host memory for a swap-out; the rest stays on the GPU"
                    );
                    break;
                };
                let size = b.size as usize;
                let copied =
                    in_context(b.context, || call_real!(cuMemcpyDtoH_v2(host as *mut c_void, addr, size)));
                if copied != SUCCESS {
                    tracing::warn!(
                        status = copied,
                        "copying burst memory to the host failed; it stays on the GPU"
                    );
                    free_host(host, pinned);
                    continue;
                }
                let _ = done_tx.send((addr, size, b.handle, b.device));
                if b.host != 0 {
                    // The copy kept from a failed swap-in: this one is newer.
                    free_host(b.host, b.pinned);
                }
                (b.handle, b.host, b.pinned) = (0, host, pinned);
                host_bytes += b.size;
            }
            // Buffers made ready beyond where the copies stopped are given back.
            stop.store(true, Ordering::Release);
            for (h, pinned) in ready_rx.iter().flatten() {
                free_host(h, pinned);
            }
        });
        *book.swapped.entry(slice.ledger).or_default() += host_bytes;
        if host_bytes == 0 && !book.swapped.values().any(|&v| v > 0) {
            crate::control::gate::open();
        }
    }
    // Give back the grant beyond what the group still holds above its request (before
    // the book is unlocked, so that a re-registration sees ledger and book agree).
    let allowed = slice.request + e.ledger.group_granted(slice.ledger);
    let surplus = allowed.saturating_sub(e.ledger.held_fast(slice.ledger));
    e.ledger.take_granted(slice.ledger, surplus);
    drop(book);
    SwappedOut { bytes: host_bytes, took: started.elapsed() }
}

/// Maps new physical memory at every swapped-out address of `slice`'s device and copies
/// the data back; opens the gate when nothing is swapped out any more. Returns the bytes
/// moved and the time taken. A driver that has no memory yet is asked again until it
/// has: the process waits, it is never left with unmapped memory. `charged`: what
/// [`charge_swap_in`] counted held for it (the difference from what is swapped out now,
/// after frees meanwhile, is settled here).
pub(crate) fn swap_in(e: &Enforcer, slice: &Slice, charged: u64) -> (u64, Duration) {
    let started = Instant::now();
    let mut book = book();
    let swapped: Vec<CUdeviceptr> = book
        .backings
        .iter()
        .filter(|(_, b)| b.device == slice.ledger && b.handle == 0)
        .map(|(&a, _)| a)
        .collect();
    let mut moved = 0;
    let plan: Vec<(CUdeviceptr, u64, usize, usize)> = swapped
        .iter()
        .filter_map(|a| book.backings.get(a).map(|b| (*a, b.size, b.ordinal, b.device)))
        .collect();
    let mapping: u64 = plan.iter().map(|&(_, size, _, _)| size).sum();
    if mapping > charged {
        e.ledger.force_charge(slice.ledger, mapping - charged);
    } else {
        // Freed while in host RAM since it was charged: the grant keeps it as slack.
        e.ledger.release(slice.ledger, charged - mapping);
    }
    // Three stages on their own threads: device memory is created and mapped ahead of the
    // copy back (by as many threads as there are CPUs, up to four: making memory is the
    // slow part on a host whose pages are zeroed as they come), and host copies are freed
    // behind it.
    let mappers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
    let plan = Mutex::new(plan.into_iter());
    std::thread::scope(|scope| {
        let (mapped_tx, mapped_rx) = sync_channel::<(CUdeviceptr, u64)>(mappers);
        let (freed_tx, freed_rx) = channel::<(usize, bool)>();
        for _ in 0..mappers {
            let (plan, mapped_tx) = (&plan, mapped_tx.clone());
            scope.spawn(move || loop {
                let next = plan.lock().unwrap_or_else(|p| p.into_inner()).next();
                let Some((addr, size, ordinal, _)) = next else { break };
                let handle = loop {
                    match map_new(e, ordinal, addr, size) {
                        Ok(h) => break h,
                        Err(status) => {
                            tracing::warn!(status, bytes = size, "swap-in: no device memory yet; retrying");
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                };
                if mapped_tx.send((addr, handle)).is_err() {
                    break;
                }
            });
        }
        drop(mapped_tx);
        scope.spawn(move || {
            for (host, pinned) in freed_rx {
                free_host(host, pinned);
            }
        });
        for (addr, handle) in mapped_rx {
            let Some(b) = book.backings.get_mut(&addr) else { continue };
            let (size, host) = (b.size as usize, b.host);
            let status =
                in_context(b.context, || call_real!(cuMemcpyHtoD_v2(addr, host as *const c_void, size)));
            b.handle = handle;
            if status == SUCCESS {
                let _ = freed_tx.send((b.host, b.pinned));
                b.host = 0;
            } else {
                // The context is broken (a sticky error): the host copy is all there is of
                // the data, so it stays with the allocation (freed with it) and the process
                // goes on to see the driver's error on its next call.
                tracing::error!(
                    status,
                    addr,
                    "swap-in: copying back to the device failed; the host copy is kept"
                );
            }
            moved += b.size;
        }
    });
    if let Some(s) = book.swapped.get_mut(&slice.ledger) {
        *s = s.saturating_sub(moved);
    }
    if !book.swapped.values().any(|&v| v > 0) {
        crate::control::gate::open();
    }
    (moved, started.elapsed())
}
