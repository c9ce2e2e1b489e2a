//! Contexts and the device memory each one takes, measured rather than guessed: the
//! process's own usage as NVML reports it, just before and just after the driver creates
//! the context, never the device's (other processes allocate meanwhile). A context is
//! charged before it is created, so the group (and the arbiter) count it while it comes
//! into being: the size measured before on that device (kept in the group's ledger),
//! refused up front if it does not fit; never measured, a conservative estimate (at most
//! what the limit leaves). The charge is then corrected to the measurement, and a context
//! that turns out not to fit is destroyed and refused with `CUDA_ERROR_OUT_OF_MEMORY`.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::driver::ffi::{read, write, Status, SUCCESS};
use crate::driver::table::{call_real, uuid_string};
use crate::enforcer::{enforcer, refused, Enforcer};

type Ptr = *mut c_void;

/// This process's own usage on CUDA device `ordinal` as NVML lists it (by the PID the
/// arbiter saw, in a container, where NVML reports the host's PIDs), next to what the shim
/// has charged this process there (`mine`, contexts and allocations). `own` is `None`
/// when NVML does not list the process (no context yet, or listed by a PID the shim does
/// not know: a container without an arbiter); the whole outer `None` without NVML, or when
/// this process's charge moved while NVML answered. The device's total is never used:
/// other processes allocate on it at any moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    pub own: Option<u64>,
    pub mine: u64,
}

pub(crate) fn usage(e: &Enforcer, ordinal: usize, dev: usize) -> Option<Usage> {
    let mut device = 0;
    let mut uuid = [0u8; 16];
    if call_real!(cuDeviceGet(&mut device, ordinal as c_int)) != SUCCESS
        || call_real!(cuDeviceGetUuid(&mut uuid, device)) != SUCCESS
        || call_real!(nvmlInit_v2()) != SUCCESS
    {
        return None;
    }
    let name = std::ffi::CString::new(uuid_string(&uuid)).ok()?;
    let mut handle: Ptr = std::ptr::null_mut();
    if call_real!(nvmlDeviceGetHandleByUUID(name.as_ptr() as *const c_char, &mut handle)) != SUCCESS {
        fence_once();
        return None;
    }
    let mut procs = [[0u64; 3]; 256];
    let mut count: c_uint = procs.len() as c_uint;
    let mine = e.ledger.held_by_me(dev);
    let listed =
        call_real!(nvmlDeviceGetComputeRunningProcesses_v3(handle, &mut count, procs.as_mut_ptr().cast()));
    fence_once();
    if listed != SUCCESS {
        return None;
    }
    // Another thread charged or freed while NVML answered: the two do not match.
    if e.ledger.held_by_me(dev) != mine {
        return None;
    }
    let me = e.ledger.my_host_pid().unwrap_or_else(std::process::id);
    let own = own_usage(&procs[..(count as usize).min(procs.len())], me);
    Some(Usage { own, mine })
}

/// How much address space [`fence_once`] reserves: one page-table page's reach (2 MiB
/// on x86_64 and aarch64 with 4 KiB pages) and a page. Not a whole multiple of 2 MiB:
/// the kernel aligns such anonymous mappings to 2 MiB (for huge pages), which would
/// leave a gap under NVML's mappings for small ones to fall into.
const FENCE: usize = (2 << 20) + 4096;

/// Reserves, once per process, a little over 2 MiB of address space (no memory:
/// `PROT_NONE`, never touched) right below the mappings NVML made when the shim loaded
/// it, and fills the small holes left above it (see [`fill_holes_above`]).
///
/// The kernel places a new mapping right below the lowest one. Without the fence, the
/// program's next mappings (a driver's host memory; every allocation of the simulated
/// driver, whose device memory is host memory) land right under NVML's, in the 2 MiB
/// that one of NVML's page-table pages covers: each `munmap` of them then walks that
/// page's entries instead of skipping a range with no page table, about 0.2 µs for a
/// 1 MiB block, all of it added by the shim having loaded NVML into a program that
/// never did. Below an untouched reservation of more than 2 MiB, the page-table page
/// they fall in holds nothing else, as in the program alone.
fn fence_once() {
    static FENCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if FENCED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // Kept for the process's life; nothing reads or writes it. A failure only leaves the
    // layout as it was.
    let fence = reserve(FENCE);
    if fence != libc::MAP_FAILED {
        fill_holes_above(fence as usize);
    }
}

/// At most how many pages [`fill_holes_above`] reserves: a bound on the system calls it
/// makes once per process, at the first context (a few in practice: 9 in `shim_bench`).
const MOST_FILLED_PAGES: usize = 1024;

/// Fills, a page at a time, the holes between mappings above the fence at `fence`
/// (every one smaller than the fence, or the kernel would have put the fence there).
///
/// The kernel puts a small mapping in the highest hole it fits, not below the lowest
/// mapping: a 4 KiB allocation lands in a hole among the libraries (the one ld.so leaves
/// where it read its cache, right under the first preloaded library), sharing its 2 MiB
/// page-table region with the libraries' touched pages, so that its `munmap` walks their
/// page table, and in the middle of the kernel's tree of mappings, where the shim's own
/// mappings (`libgpufrac.so` right above that hole) make finding its neighbours longer.
/// Filled, small mappings land below the fence like large ones. The filler pages are
/// `PROT_NONE` and adjacent ones merge into one mapping per hole. A hole's pages are
/// found by asking for a page anywhere until the kernel places one below the fence.
fn fill_holes_above(fence: usize) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    for _ in 0..MOST_FILLED_PAGES {
        // Kept for the process's life, like the fence (or unmapped just below).
        let filler = reserve(page);
        if filler == libc::MAP_FAILED {
            return;
        }
        if (filler as usize) < fence {
            // No hole above the fence any more: this page is not needed.
            // SAFETY: the page was just mapped here and nothing else knows of it.
            unsafe { libc::munmap(filler, page) };
            return;
        }
    }
}

/// `len` bytes of address space at an address of the kernel's choosing: no access, no
/// memory, no swap reserved (`MAP_FAILED` if the kernel refuses).
fn reserve(len: usize) -> *mut std::ffi::c_void {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing (no
    // hint) never replaces an existing mapping and has no other preconditions.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
}

/// NVML's `NVML_VALUE_NOT_AVAILABLE`: a process listed whose usage the driver does not
/// report (some containers, Windows guests).
const NOT_AVAILABLE: u64 = u64::MAX;

/// The usage NVML lists for `pid` (`nvmlProcessInfo_t`: pid as u32, padded; usedGpuMemory;
/// instance ids), if it is listed with a usage.
fn own_usage(listed: &[[u64; 3]], pid: u32) -> Option<u64> {
    listed.iter().find(|p| p[0] & 0xffff_ffff == u64::from(pid)).map(|p| p[1]).filter(|&b| b != NOT_AVAILABLE)
}

/// Bytes a context took, from this process's own usage before and after creating it, less
/// what the process's other threads were charged for meanwhile (their allocations show in
/// its usage too). `None` when it cannot be measured cleanly: NVML does not list the
/// process afterwards.
fn delta(before: Usage, after: Usage) -> Option<u64> {
    Some(signed_delta(before, after)?.clamp(0, i128::from(u64::MAX)) as u64)
}

/// What a call changed in this process's own usage, less what its other threads were
/// charged or freed meanwhile: negative when the call gave memory back (a smaller heap).
pub(crate) fn signed_delta(before: Usage, after: Usage) -> Option<i128> {
    // Signed: another thread may have freed meanwhile (both figures fall by it).
    let grown = i128::from(after.own?) - i128::from(before.own.unwrap_or(0));
    let others = i128::from(after.mine) - i128::from(before.mine);
    Some(grown - others)
}

/// Whether `bytes` is far from the last clean measurement `known` (more than twice, or
/// less than half): then it is believed only if a second look agrees.
fn far_from(bytes: u64, known: Option<u64>) -> bool {
    known.is_some_and(|known| bytes > known.saturating_mul(2) || bytes.saturating_mul(2) < known)
}

/// The context's size from the usage measured before creating it: a clean measurement
/// (looked at twice when far from the last one), or `None`.
fn measure(e: &Enforcer, ordinal: usize, dev: usize, before: Option<Usage>) -> Option<u64> {
    let before = before?;
    let first = delta(before, usage(e, ordinal, dev)?)?;
    if !far_from(first, e.ledger.context_bytes(dev)) {
        return Some(first);
    }
    // A second look: another thread's allocation caught between NVML's answer and the
    // shim's count, or a driver still settling, gives a different figure.
    std::thread::sleep(std::time::Duration::from_millis(2));
    let second = delta(before, usage(e, ordinal, dev)?)?;
    (second == first).then_some(first)
}

/// Says once per process, at debug level, that a context could not be measured cleanly.
fn unmeasured_once(ordinal: usize, charged: u64) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!(
            ordinal,
            charged,
            "a new context could not be measured cleanly (NVML does not list this process, or two looks disagreed): \
             charged the last clean measurement or the estimate, and nothing was stored"
        );
    }
}

/// What a context never measured on a device is charged until it is, at most: real
/// contexts take a few hundred MiB (simgpu's default is 256 MiB).
const UNMEASURED_CONTEXT: u64 = 256 << 20;

/// What to charge for a new context on ledger device `dev` before creating it: the last
/// measurement (the group's own, or the arbiter's for the GPU), or, never measured, an
/// estimate within what the request leaves (nothing is asked of the arbiter, nor refused,
/// on a guess: the measurement settles it).
fn estimate(e: &Enforcer, dev: usize, request: u64) -> u64 {
    e.ledger
        .context_bytes(dev)
        .unwrap_or_else(|| UNMEASURED_CONTEXT.min(request.saturating_sub(e.ledger.held(dev))))
}

/// Charges a context to the group, creates it with `create`, measures it and corrects the
/// charge; a context that does not fit is destroyed with `destroy` and refused.
fn measured(
    e: &Enforcer,
    ordinal: usize,
    primary: bool,
    create: impl FnOnce() -> (Status, u64),
    destroy: impl FnOnce(),
) -> Status {
    let status = measured_serially(e, ordinal, primary, create, destroy);
    if status == SUCCESS {
        // Listed by the device from now on, and charged: a look at what it holds beyond
        // the charges.
        e.backstop.look(e, ordinal, crate::enforcer::backstop::PERIOD);
    }
    status
}

/// `measured`, one context change at a time.
fn measured_serially(
    e: &Enforcer,
    ordinal: usize,
    primary: bool,
    create: impl FnOnce() -> (Status, u64),
    destroy: impl FnOnce(),
) -> Status {
    let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
    // Another thread retained the primary context first (both found it inactive): this
    // retain only counts a reference, and the context keeps the charge it was given.
    if primary && primary_active(ordinal as c_int) {
        return create().0;
    }
    let Some(slice) = e.slice(ordinal) else { return create().0 };
    let dev = slice.ledger;
    let estimate = estimate(e, dev, slice.request);
    if let Err(status) = e.charge_owed(ordinal, estimate) {
        tracing::warn!(
            ordinal,
            bytes = estimate,
            held = e.ledger.held_fast(dev),
            limit = slice.limit,
            "gpufrac: out of memory: refused a new context: its {estimate} bytes (as measured before on this device) were not available under GPUFRAC_MEMORY_LIMIT"
        );
        return status;
    }
    let before = usage(e, ordinal, dev);
    let (status, handle) = create();
    if status != SUCCESS {
        e.release(dev, estimate);
        return status;
    }
    // Only a clean measurement is kept for the group's later contexts.
    let bytes = match measure(e, ordinal, dev, before) {
        Some(bytes) => {
            if bytes > 0 && e.ledger.context_bytes(dev).is_none_or(|known| known != bytes) {
                e.ledger.set_context_bytes(dev, bytes);
                // The arbiter learns the GPU's context size from it (believed once NVML
                // shows this process using as much), for every group's first context.
                if let Some(client) = e.arbiter.get() {
                    client.report_context(slice.uuid, bytes);
                }
            }
            bytes
        }
        None => {
            unmeasured_once(ordinal, estimate);
            estimate
        }
    };
    if bytes > estimate {
        if let Err(status) = e.charge_owed(ordinal, bytes - estimate) {
            destroy();
            e.release(dev, estimate);
            tracing::warn!(
                ordinal,
                bytes,
                held = e.ledger.held_fast(dev),
                limit = slice.limit,
                "gpufrac: out of memory: a new context took {bytes} bytes, more than GPUFRAC_MEMORY_LIMIT leaves: destroyed and refused"
            );
            return status;
        }
    } else if bytes < estimate {
        e.release(dev, estimate - bytes);
    }
    match e.contexts.add(handle, ordinal, bytes, primary) {
        Some((_, true)) => {}
        // Tracked already with no charge of its own (adopted when it was current before
        // this hook saw it): it holds what was just measured.
        Some((id, false)) => e.contexts.add_charge(id, bytes),
        None => {
            destroy();
            e.release(dev, bytes);
            tracing::warn!(
                ordinal,
                "gpufrac: out of memory: refused a context past the {} this process may have (each one's memory must be counted)",
                crate::enforcer::MAX_CONTEXTS
            );
            return crate::driver::ffi::OUT_OF_MEMORY;
        }
    }
    tracing::debug!(ordinal, bytes, primary, "context created");
    status
}

pub(crate) fn primary_active(dev: c_int) -> bool {
    let (mut flags, mut active) = (0, 0);
    call_real!(cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active)) == SUCCESS && active != 0
}

pub(crate) fn primary_retain(ctx: *mut Ptr, dev: c_int) -> Status {
    let Some(e) = enforcer() else {
        return refused().unwrap_or_else(|| call_real!(cuDevicePrimaryCtxRetain(ctx, dev)));
    };
    // A context's own memory is device memory: a parked process waits for its wake.
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    if dev < 0 || primary_active(dev) {
        return call_real!(cuDevicePrimaryCtxRetain(ctx, dev));
    }
    measured(
        e,
        dev as usize,
        true,
        || {
            // A context on a GPU whose loans are being taken back waits for its memory.
            let status = e.physical(|| call_real!(cuDevicePrimaryCtxRetain(ctx, dev)));
            (status, read(ctx).map_or(0, |c| c as u64))
        },
        || {
            // The primary context was inactive: this one retain is all it has.
            let _ = call_real!(cuDevicePrimaryCtxRelease_v2(dev));
            write(ctx, std::ptr::null_mut());
        },
    )
}

/// After a release or reset: if the primary context is gone, so is what it held.
fn after_primary_change(dev: c_int, status: Status) -> Status {
    if let Some(e) = enforcer() {
        if status == SUCCESS && dev >= 0 && !primary_active(dev) {
            let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(id) = e.contexts.primary_of(dev as usize) {
                e.teardown_context(id);
            }
        }
    }
    status
}

pub(crate) fn primary_release(dev: c_int) -> Status {
    before_teardown();
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxRelease_v2(dev)))
}

pub(crate) fn primary_reset(dev: c_int) -> Status {
    before_teardown();
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxReset_v2(dev)))
}

pub(crate) fn primary_release_v1(dev: c_int) -> Status {
    before_teardown();
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxRelease(dev)))
}

pub(crate) fn primary_reset_v1(dev: c_int) -> Status {
    before_teardown();
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxReset(dev)))
}

fn create(ctx: *mut Ptr, dev: c_int, real: impl FnMut() -> Status) -> Status {
    create_tracked(
        ctx,
        dev,
        real,
        |c| c as u64,
        |c| {
            let _ = call_real!(cuCtxDestroy_v2(c));
        },
    )
}

/// A context made by `real` into `*out` on device `dev`, measured and charged; tracked by
/// `tracked(handle)` (what programs make current), destroyed with `destroy` if refused.
fn create_tracked(
    out: *mut Ptr,
    dev: c_int,
    mut real: impl FnMut() -> Status,
    tracked: impl FnOnce(Ptr) -> u64,
    destroy: impl FnOnce(Ptr),
) -> Status {
    // A context's own memory is device memory: a parked process waits for its wake.
    let _allocating = match crate::control::park::allocating() {
        Ok(a) => a,
        Err(status) => return status,
    };
    match enforcer() {
        Some(e) if dev >= 0 => measured(
            e,
            dev as usize,
            false,
            || {
                let status = e.physical(&mut real);
                (status, read(out).map_or(0, tracked))
            },
            || {
                if let Some(c) = read(out) {
                    destroy(c);
                }
                write(out, std::ptr::null_mut());
            },
        ),
        _ => refused().unwrap_or_else(real),
    }
}

pub(crate) fn ctx_create_v2(ctx: *mut Ptr, flags: c_uint, dev: c_int) -> Status {
    create(ctx, dev, || call_real!(cuCtxCreate_v2(ctx, flags, dev)))
}

pub(crate) fn ctx_create_v3(ctx: *mut Ptr, params: Ptr, count: c_int, flags: c_uint, dev: c_int) -> Status {
    create(ctx, dev, || call_real!(cuCtxCreate_v3(ctx, params, count, flags, dev)))
}

pub(crate) fn ctx_create_v4(ctx: *mut Ptr, params: Ptr, flags: c_uint, dev: c_int) -> Status {
    create(ctx, dev, || call_real!(cuCtxCreate_v4(ctx, params, flags, dev)))
}

/// `cuGreenCtxCreate` (CUDA 12.4+): a green context takes device memory like any
/// context. It is tracked by the `CUcontext` that `cuCtxFromGreenCtx` gives for it, the
/// handle programs make current and allocate in, so that its allocations go with it.
pub(crate) fn green_ctx_create(green: *mut Ptr, desc: Ptr, dev: c_int, flags: c_uint) -> Status {
    create_tracked(
        green,
        dev,
        || call_real!(cuGreenCtxCreate(green, desc, dev, flags)),
        green_context_handle,
        |g| {
            let _ = call_real!(cuGreenCtxDestroy(g));
        },
    )
}

/// The `CUcontext` of green context `green` (the green context's own handle if the
/// driver does not say).
fn green_context_handle(green: Ptr) -> u64 {
    let mut ctx: Ptr = std::ptr::null_mut();
    if call_real!(cuCtxFromGreenCtx(&mut ctx, green)) == SUCCESS && !ctx.is_null() {
        ctx as u64
    } else {
        green as u64
    }
}

pub(crate) fn green_ctx_destroy(green: Ptr) -> Status {
    let ctx = match enforcer() {
        Some(e) => {
            e.resolve_contexts();
            green_context_handle(green)
        }
        None => 0,
    };
    destroyed(ctx as Ptr, call_real!(cuGreenCtxDestroy(green)))
}

/// The pre-4.0 `cuCtxCreate`, which the real driver still exports.
pub(crate) fn ctx_create_v1(ctx: *mut Ptr, flags: c_uint, dev: c_int) -> Status {
    create(ctx, dev, || call_real!(cuCtxCreate(ctx, flags, dev)))
}

pub(crate) fn ctx_destroy_v1(ctx: Ptr) -> Status {
    before_teardown();
    destroyed(ctx, call_real!(cuCtxDestroy(ctx)))
}

pub(crate) fn ctx_destroy(ctx: Ptr) -> Status {
    before_teardown();
    destroyed(ctx, call_real!(cuCtxDestroy_v2(ctx)))
}

/// Before the driver may destroy a context: its streams are not watched any more, and
/// every allocation's context is known (see `Enforcer::resolve_contexts`).
fn before_teardown() {
    // A test build's stand-in for a thread descheduled here, between the hook's look at a
    // checkpoint park and the driver (`GPUFRAC_TEST_TEARDOWN_DELAY_US`).
    std::thread::sleep(crate::test_env_us("GPUFRAC_TEST_TEARDOWN_DELAY_US"));
    crate::control::compute::forget_streams();
    if let Some(e) = enforcer() {
        e.resolve_contexts();
    }
}

/// After the driver destroyed context `ctx`: what it held goes back.
fn destroyed(ctx: Ptr, status: Status) -> Status {
    if let Some(e) = enforcer() {
        if status == SUCCESS && !ctx.is_null() {
            let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(id) = e.contexts.find(ctx as u64) {
                e.teardown_context(id);
            }
        }
    }
    status
}

// ---- The table of tracked contexts ----

/// Most contexts tracked at once. A context past it is refused (`CUDA_ERROR_OUT_OF_MEMORY`,
/// destroyed again), never left outside the count: each takes hundreds of MiB on a real
/// GPU, so no program reaches this by using its memory.
pub(crate) const MAX_CONTEXTS: usize = crate::books::records::MAX_RECORD_CONTEXTS;

/// Contexts created through the shim: their handle, CUDA ordinal and measured memory.
pub(crate) struct Contexts {
    handles: [AtomicU64; MAX_CONTEXTS],
    ordinals: [AtomicU32; MAX_CONTEXTS],
    charged: [AtomicU64; MAX_CONTEXTS],
    primary: [AtomicBool; MAX_CONTEXTS],
    /// One past the highest slot ever used: lookups scan no further.
    used: AtomicU32,
    /// Serialises creation and teardown (rare), not lookups.
    pub(crate) changes: Mutex<()>,
}

/// The current context as the allocation hooks need it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Current {
    pub id: usize,
    pub ordinal: usize,
}

impl Contexts {
    pub(crate) fn new() -> Contexts {
        Contexts {
            handles: std::array::from_fn(|_| AtomicU64::new(0)),
            ordinals: std::array::from_fn(|_| AtomicU32::new(0)),
            charged: std::array::from_fn(|_| AtomicU64::new(0)),
            primary: std::array::from_fn(|_| AtomicBool::new(false)),
            used: AtomicU32::new(0),
            changes: Mutex::new(()),
        }
    }

    /// The id of context `handle`, if tracked.
    #[inline]
    pub(crate) fn find(&self, handle: u64) -> Option<usize> {
        let used = (self.used.load(Ordering::Acquire) as usize).min(MAX_CONTEXTS);
        self.handles[..used].iter().position(|h| h.load(Ordering::Acquire) == handle)
    }

    /// The primary context of `ordinal`, if tracked.
    pub(crate) fn primary_of(&self, ordinal: usize) -> Option<usize> {
        (0..MAX_CONTEXTS).find(|&i| {
            self.handles[i].load(Ordering::Acquire) != 0
                && self.primary[i].load(Ordering::Relaxed)
                && self.ordinals[i].load(Ordering::Relaxed) as usize == ordinal
        })
    }

    /// Tracks a context; returns its id and whether it is new (an existing one keeps its
    /// charge), or `None` when every slot is taken.
    pub(crate) fn add(
        &self,
        handle: u64,
        ordinal: usize,
        charged: u64,
        primary: bool,
    ) -> Option<(usize, bool)> {
        if let Some(id) = self.find(handle) {
            return Some((id, false));
        }
        for i in 0..MAX_CONTEXTS {
            if self.handles[i].compare_exchange(0, handle, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                self.ordinals[i].store(ordinal as u32, Ordering::Relaxed);
                self.charged[i].store(charged, Ordering::Relaxed);
                self.primary[i].store(primary, Ordering::Relaxed);
                self.used.fetch_max(i as u32 + 1, Ordering::AcqRel);
                return Some((i, true));
            }
        }
        None
    }

    /// Adds `bytes` to what context `id` holds beyond its allocations (its device heap,
    /// stack and printf FIFO), given back with it.
    pub(crate) fn add_charge(&self, id: usize, bytes: u64) {
        self.charged[id].fetch_add(bytes, Ordering::AcqRel);
    }

    /// Takes up to `bytes` off context `id`'s own charge; returns what was taken.
    pub(crate) fn take_charge(&self, id: usize, bytes: u64) -> u64 {
        let mut taken = 0;
        let _ = self.charged[id].fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            taken = held.min(bytes);
            Some(held - taken)
        });
        taken
    }

    /// The CUDA ordinal of context `id`.
    pub(crate) fn ordinal(&self, id: usize) -> usize {
        self.ordinals[id].load(Ordering::Relaxed) as usize
    }

    /// The driver's handle of context `id`.
    pub(crate) fn handle(&self, id: usize) -> u64 {
        self.handles[id].load(Ordering::Acquire)
    }

    /// Stops tracking context `id`; returns (ordinal, charged bytes).
    pub(crate) fn remove(&self, id: usize) -> (usize, u64) {
        let ordinal = self.ordinals[id].load(Ordering::Relaxed) as usize;
        let charged = self.charged[id].swap(0, Ordering::AcqRel);
        self.handles[id].store(0, Ordering::Release);
        (ordinal, charged)
    }
}

#[cfg(test)]
mod tests {
    use super::{delta, far_from, own_usage, Usage};

    fn at(own: Option<u64>, mine: u64) -> Usage {
        Usage { own, mine }
    }

    #[test]
    fn a_context_is_measured_by_this_process_own_usage_only() {
        // Not listed before the first context, listed after.
        assert_eq!(delta(at(None, 0), at(Some(256), 0)), Some(256));
        // Listed both times.
        assert_eq!(delta(at(Some(100), 100), at(Some(356), 100)), Some(256));
        // Another thread of this process allocated 1000 meanwhile: not the context's.
        assert_eq!(delta(at(Some(100), 100), at(Some(1356), 1100)), Some(256));
        // Or freed 500 meanwhile: the context still took 256.
        assert_eq!(delta(at(Some(1000), 1000), at(Some(756), 500)), Some(256));
        // Not listed afterwards (a PID the shim does not know): not measurable, whatever
        // the device's usage did.
        assert_eq!(delta(at(None, 0), at(None, 0)), None);
    }

    #[test]
    fn a_usage_the_driver_does_not_report_is_no_measurement() {
        let listed = [[7, 300, 0], [9, u64::MAX, 0]];
        assert_eq!(own_usage(&listed, 7), Some(300));
        assert_eq!(own_usage(&listed, 9), None, "NVML_VALUE_NOT_AVAILABLE");
        assert_eq!(own_usage(&listed, 8), None, "not listed");
    }

    #[test]
    fn a_measurement_far_from_the_last_one_needs_a_second_look() {
        assert!(!far_from(300, None));
        assert!(!far_from(300, Some(256)));
        assert!(far_from(4 << 30, Some(256 << 20)));
        assert!(far_from(0, Some(256 << 20)));
        assert!(!far_from(0, Some(0)));
    }
}
