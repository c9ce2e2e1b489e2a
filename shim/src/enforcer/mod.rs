//! The shim's process-wide state, set up at the first CUDA or NVML call: pass-through
//! (neither a request nor a limit configured), enforcing, or broken (a bad setting,
//! reported by `cuInit`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use gpufrac_common::config::Config;
use gpufrac_common::protocol::{Request, VERSION};
use gpufrac_common::ComputeSpec;

pub(crate) use crate::books::contexts::{Contexts, Current, MAX_CONTEXTS};
use crate::books::group_ledger::Ledger;
use crate::books::records::{Context, Path, Records};
use crate::driver::ffi::{Status, OUT_OF_MEMORY, SUCCESS};
use crate::driver::table::call_real;

pub(crate) mod backstop;
pub(crate) mod graphs;
mod loans;
pub(crate) use loans::{Lender, NotGranted};
pub(crate) mod pools;
pub(crate) mod usage;
pub(crate) mod vmm;

/// The least time a guaranteed or granted allocation waits for its memory with an arbiter:
/// the arbiter's default reclaim grace (5 s) and kill grace (10 s), and some to spare.
pub(crate) const OWED_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// What the shim does in this process.
pub(crate) enum Mode {
    /// Neither `GPUFRAC_MEMORY_REQUEST` nor `GPUFRAC_MEMORY_LIMIT` set: every call goes to
    /// the driver untouched.
    PassThrough,
    /// Holding the group to its request and limit.
    Enforcing(Box<Enforcer>),
    /// A setting is bad: `cuInit` fails with this message.
    Broken(String),
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// The mode, read from the environment on first use. Inside a gpufrac daemon (its
/// executable exports `gpufrac_common::DAEMON_MARKER`), always pass-through: the arbiter
/// and the device plugin manage whole GPUs, whatever `GPUFRAC_*` variables they have.
pub(crate) fn mode() -> &'static Mode {
    MODE.get_or_init(|| {
        if crate::driver::library::defined_globally(gpufrac_common::DAEMON_MARKER) {
            return Mode::PassThrough;
        }
        match Config::from_env() {
            Ok(None) => Mode::PassThrough,
            Ok(Some(config)) => match Enforcer::new(config) {
                Ok(e) => {
                    if e.config.group.is_some() {
                        leave_group_at_exit();
                    }
                    Mode::Enforcing(Box::new(e))
                }
                Err(message) => Mode::Broken(message),
            },
            Err(e) => Mode::Broken(format!("gpufrac: {e}")),
        }
    })
}

/// The process that joined the group's ledger (a forked child inherits the exit hook
/// but is not a member).
static MEMBER_PID: AtomicU32 = AtomicU32::new(0);
/// This member forked: a child may share its ledger slot (same open file, same mapping),
/// so it cannot tell whether it is the last one using the file.
static FORKED: AtomicBool = AtomicBool::new(false);

fn leave_group_at_exit() {
    extern "C" fn leave() {
        // Nothing may unwind out of an exit handler into the host program.
        let _ = std::panic::catch_unwind(|| {
            if MEMBER_PID.load(Ordering::Relaxed) == std::process::id() && !FORKED.load(Ordering::Relaxed) {
                if let Some(Mode::Enforcing(e)) = MODE.get() {
                    e.ledger.leave();
                }
            }
        });
    }
    extern "C" fn forked() {
        FORKED.store(true, Ordering::Relaxed);
    }
    MEMBER_PID.store(std::process::id(), Ordering::Relaxed);
    // SAFETY: registering functions that take and return nothing and cannot unwind; the
    // fork handler only stores an atomic (it runs in the parent after fork).
    unsafe {
        libc::pthread_atfork(None, Some(forked), None);
        libc::atexit(leave);
    }
}

/// Whether the shim does anything in this process.
pub(crate) fn enabled() -> bool {
    !matches!(mode(), Mode::PassThrough)
}

/// The enforcer, once `cuInit` has set up the devices.
#[inline]
pub(crate) fn enforcer() -> Option<&'static Enforcer> {
    match MODE.get() {
        Some(Mode::Enforcing(e)) if matches!(e.devices.get(), Some(Ok(_))) => Some(e),
        _ => None,
    }
}

/// `CUDA_ERROR_NOT_INITIALIZED` while the shim refused this process's start: a bad
/// setting, or a `cuInit` whose devices could not be set up (a request larger than the
/// GPU, an arbiter that refused the registration). A program that ignored `cuInit`'s
/// failure gets the same error from every call that would take device memory, never the
/// driver's memory unchecked. Answered only when there is no enforcer (the slow branch).
#[cold]
pub(crate) fn refused() -> Option<Status> {
    match MODE.get() {
        Some(Mode::Broken(_)) => Some(crate::driver::ffi::NOT_INITIALIZED),
        Some(Mode::Enforcing(e)) if matches!(e.devices.get(), Some(Err(_))) => {
            Some(crate::driver::ffi::NOT_INITIALIZED)
        }
        _ => None,
    }
}

/// The enforcer even before `cuInit` (NVML callers never call it).
pub(crate) fn enforcer_any() -> Option<&'static Enforcer> {
    match mode() {
        Mode::Enforcing(e) => Some(e),
        _ => None,
    }
}

/// A device's share for the group.
#[derive(Debug, Clone, Copy)]
pub struct Slice {
    /// The ledger's index of the device.
    pub ledger: usize,
    /// Guaranteed bytes.
    pub request: u64,
    /// Most bytes the group may hold.
    pub limit: u64,
    /// The device's memory as the group's fractions see it: physical, or what the
    /// arbiter manages of it (`gpufrac-arbiter --gpu-memory`) when that is less.
    pub total: u64,
    /// The device's UUID.
    pub uuid: [u8; 16],
}

/// Holds this process's group to its request and limit.
pub(crate) struct Enforcer {
    pub config: Config,
    pub ledger: Ledger,
    /// Per CUDA ordinal, set at `cuInit`.
    pub devices: OnceLock<Result<Vec<Slice>, String>>,
    /// Linear, pitched, managed and pooled allocations by address.
    pub pointers: Records,
    /// Arrays and mipmapped arrays by handle.
    pub arrays: Records,
    /// VMM physical allocations by handle.
    pub physical: Records,
    /// Loaded modules and libraries by handle: their code and globals.
    pub modules: Records,
    /// Boxed: 21 KiB of handles, which would otherwise put the allocation hooks' fields
    /// on pages apart (each page one more TLB entry to find again after the driver's
    /// system calls).
    pub contexts: Box<Contexts>,
    pub vmm: Mutex<crate::enforcer::vmm::VmmBook>,
    /// Stream-ordered memory pools and their allocations.
    pub pools: crate::enforcer::pools::PoolBook,
    /// Memory the device showed and no hook charged.
    pub backstop: crate::enforcer::backstop::Backstop,
    /// CUDA graphs with allocation nodes, and their devices' graph pools.
    pub graphs: crate::enforcer::graphs::GraphBook,
    /// The arbiter, when `GPUFRAC_ARBITER_SOCKET` is set (connected at `cuInit`).
    pub lender: OnceLock<Box<dyn Lender>>,
    /// `GPUFRAC_RESERVE=first-use`: each slice's request is what [`Enforcer::reserved`]
    /// says, raised to it at the device's first context.
    first_use: bool,
    /// Per CUDA ordinal, the request reserved so far (first-use only).
    reserved: [AtomicU64; crate::books::group_ledger::MAX_DEVICES],
    /// Serialises reservations at first use.
    reserving: Mutex<()>,
    /// Per ledger device: bytes that threads are asking the arbiter for right now. A
    /// grant that arrives for them is not "unused" and is not given back on reclaim.
    pending: [AtomicU64; crate::books::group_ledger::MAX_DEVICES],
}

/// Counts bytes as pending while a thread waits for the arbiter.
pub(crate) struct Pending<'a>(&'a AtomicU64, u64);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// A charge taken before calling the driver, given back if the call fails.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    pub device: usize,
    pub bytes: u64,
    pub above_request: bool,
    /// The group held at least its request before this charge: all of it is burst.
    pub whole_burst: bool,
}

impl Enforcer {
    fn new(config: Config) -> Result<Enforcer, String> {
        init_logging(&config.log);
        let ledger = match &config.group {
            Some(group) => Ledger::join(group).map_err(|e| {
                format!(
                    "gpufrac: cannot join GPUFRAC_GROUP={group:?} (ledger {}): {e}",
                    crate::books::group_ledger::group_path(group).display()
                )
            })?,
            None => Ledger::private(),
        };
        let first_use = config.reserve == gpufrac_common::config::Reserve::FirstUse;
        Ok(Enforcer {
            config,
            ledger,
            devices: OnceLock::new(),
            pointers: Records::new(1 << 14),
            arrays: Records::new(1 << 12),
            physical: Records::new(1 << 14),
            modules: Records::new(1 << 10),
            contexts: Box::new(Contexts::new()),
            vmm: Mutex::new(Default::default()),
            pools: Default::default(),
            backstop: Default::default(),
            graphs: Default::default(),
            lender: OnceLock::new(),
            first_use,
            reserved: std::array::from_fn(|_| AtomicU64::new(0)),
            reserving: Mutex::new(()),
            pending: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// The group's share of a device with `uuid` and `total` bytes (`managed`: what the
    /// arbiter manages of it, less than the device).
    pub(crate) fn slice_for(
        &self,
        ordinal: Option<usize>,
        uuid: &[u8; 16],
        total: u64,
        managed: bool,
    ) -> Result<Slice, String> {
        use gpufrac_common::size::format_size;
        let which =
            ordinal.map_or_else(|| crate::driver::table::uuid_string(uuid), |o| format!("device {o}"));
        let request = self.config.request.resolve(total);
        let limit = self.config.limit.resolve(total).min(total);
        if request > total && managed {
            return Err(format!(
                "gpufrac: GPUFRAC_MEMORY_REQUEST={} is more than the arbiter manages of {which} ({}; gpufrac-arbiter --gpu-memory)",
                format_size(request),
                format_size(total)
            ));
        }
        if request > total {
            return Err(format!(
                "gpufrac: GPUFRAC_MEMORY_REQUEST={} is more than {which} has ({})",
                format_size(request),
                format_size(total)
            ));
        }
        if limit < request {
            return Err(format!(
                "gpufrac: GPUFRAC_MEMORY_LIMIT ({} on {which}) is below GPUFRAC_MEMORY_REQUEST ({})",
                format_size(limit),
                format_size(request)
            ));
        }
        let ledger = self.ledger.device_index(uuid).ok_or_else(|| {
            format!("gpufrac: more than {} devices", crate::books::group_ledger::MAX_DEVICES)
        })?;
        Ok(Slice { ledger, request, limit, total, uuid: *uuid })
    }

    /// Sets up every visible device (at `cuInit`), `connect` registering them with the
    /// arbiter (and adjusting them to what it believes) before they are used; the error
    /// names the bad setting.
    pub(crate) fn init_devices(
        &'static self,
        connect: impl FnOnce(&'static Enforcer, &mut [Slice]) -> Result<(), String>,
    ) -> &'static Result<Vec<Slice>, String> {
        self.devices.get_or_init(|| {
            let mut count = 0;
            let status = call_real!(cuDeviceGetCount(&mut count));
            if status != SUCCESS {
                return Err(format!("gpufrac: cuDeviceGetCount failed ({status})"));
            }
            (0..count)
                .map(|ordinal| {
                    let mut dev = 0;
                    let mut uuid = [0u8; 16];
                    let mut total = 0usize;
                    let ok = call_real!(cuDeviceGet(&mut dev, ordinal)) == SUCCESS
                        && call_real!(cuDeviceGetUuid(&mut uuid, dev)) == SUCCESS
                        && crate::driver::table::call_real!(cuDeviceTotalMem_v2(&mut total, dev)) == SUCCESS;
                    if !ok {
                        return Err(format!("gpufrac: cannot read device {ordinal}'s UUID and memory"));
                    }
                    let slice = self.slice_for(Some(ordinal as usize), &uuid, total as u64, false)?;
                    tracing::info!(
                        ordinal,
                        request = slice.request,
                        limit = slice.limit,
                        total,
                        "device slice"
                    );
                    Ok(slice)
                })
                .collect::<Result<Vec<Slice>, String>>()
                .and_then(|mut slices| {
                    connect(self, &mut slices)?;
                    Ok(slices)
                })
        })
    }

    /// The `Hello` this process says to the arbiter.
    pub(crate) fn hello(&self) -> Request {
        let group = self.config.group.clone().unwrap_or_else(|| format!("pid-{}", std::process::id()));
        Request::Hello {
            version: VERSION,
            group,
            pod: self.config.pod.clone().unwrap_or_default(),
            resolver: self.config.resolver,
            priority: self.config.priority,
            wait_timeout_ms: self.config.wait_timeout.as_millis().min(u64::MAX as u128) as u64,
            // 0 means never: a parkable group says at least 1 ms.
            park_after_ms: self
                .config
                .park_after
                .map_or(0, |d| d.as_millis().clamp(1, u64::MAX as u128) as u64),
            compute_request_pm: ComputeSpec::to_wire(self.config.compute).0,
            compute_limit_pm: ComputeSpec::to_wire(self.config.compute).1,
        }
    }

    /// Bursts are asked for in chunks of a quarter of the burst range (at least 64 MiB),
    /// so a steady server rarely talks to the arbiter.
    pub(crate) fn chunk(slice: &Slice) -> u64 {
        ((slice.limit - slice.request) / 4).max(64 << 20)
    }

    /// The slice of CUDA device `ordinal`, with the request reserved there so far.
    #[inline]
    pub(crate) fn slice(&self, ordinal: usize) -> Option<Slice> {
        match self.devices.get() {
            Some(Ok(slices)) => {
                let mut slice = *slices.get(ordinal)?;
                if self.first_use {
                    slice.request = self.reserved[ordinal].load(Ordering::Acquire);
                }
                Some(slice)
            }
            _ => None,
        }
    }

    /// Whether the request is reserved at each device's first use (`GPUFRAC_RESERVE`).
    pub(crate) fn reserves_on_first_use(&self) -> bool {
        self.first_use
    }

    /// With `GPUFRAC_RESERVE=first-use`, reserves the group's request on CUDA device
    /// `ordinal` at the process's first context there (with an arbiter, by registering it
    /// again with the request; `cuInit` registered it with none). Out-of-memory if the
    /// arbiter refuses it: the request does not fit beside the other guarantees.
    pub(crate) fn reserve_on_first_use(&self, ordinal: usize) -> Result<(), Status> {
        let Some(target) = self.slices().get(ordinal).map(|s| s.request) else { return Ok(()) };
        if !self.first_use || self.reserved[ordinal].load(Ordering::Acquire) >= target {
            return Ok(());
        }
        self.reserved_slow(ordinal, target)
    }

    #[cold]
    #[inline(never)]
    fn reserved_slow(&self, ordinal: usize, target: u64) -> Result<(), Status> {
        let _one_at_a_time = self.reserving.lock().unwrap_or_else(|p| p.into_inner());
        if self.reserved[ordinal].load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let Some(slice) = self.slices().get(ordinal).copied() else { return Ok(()) };
        let reserved = match self.lender.get() {
            Some(lender) => match lender.reserve(slice.uuid, slice.total, target, slice.limit) {
                Ok(believed) => believed.min(target),
                Err(reason) => {
                    tracing::warn!(
                        ordinal,
                        request = target,
                        "gpufrac: out of memory: GPUFRAC_MEMORY_REQUEST could not be reserved on device {ordinal} at its first use (GPUFRAC_RESERVE=first-use): {reason}"
                    );
                    return Err(OUT_OF_MEMORY);
                }
            },
            None => target,
        };
        tracing::info!(ordinal, request = reserved, "request reserved at the device's first use");
        self.reserved[ordinal].store(reserved, Ordering::Release);
        Ok(())
    }

    /// The CUDA ordinal of this process's one device, when it has exactly one: every
    /// allocation is on it, whichever context is current.
    #[inline]
    pub(crate) fn sole_ordinal(&self) -> Option<usize> {
        (self.slices().len() == 1).then_some(0)
    }

    /// Asks the driver which context each allocation recorded as [`Context::Unresolved`]
    /// was made in (`CU_POINTER_ATTRIBUTE_CONTEXT`), adopting contexts made elsewhere as
    /// [`Enforcer::current`] does, so that the teardown of a context releases exactly what
    /// the driver frees with it. Called just before the driver may destroy a context: one
    /// driver call per such allocation, where a process ends or resets a device. An
    /// allocation made in that context after this call (another thread, at the same
    /// moment) stays unresolved and charged: counted too long, never too short.
    pub(crate) fn resolve_contexts(&self) {
        let Some(ordinal) = self.sole_ordinal() else { return };
        self.pointers.resolve(|key| {
            let mut ctx: *mut c_void = std::ptr::null_mut();
            const CONTEXT: std::ffi::c_int = 1;
            let asked =
                call_real!(cuPointerGetAttribute((&mut ctx as *mut *mut c_void).cast(), CONTEXT, key));
            if asked != SUCCESS || ctx.is_null() {
                return None;
            }
            let handle = ctx as u64;
            self.contexts
                .find(handle)
                .or_else(|| self.contexts.add(handle, ordinal, 0, false).map(|(id, _)| id))
        });
    }

    /// The calling thread's current context, tracked (adopted if created elsewhere).
    #[inline(always)]
    pub(crate) fn current(&self) -> Option<Current> {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        if call_real!(cuCtxGetCurrent(&mut ctx)) != SUCCESS || ctx.is_null() {
            return None;
        }
        let handle = ctx as u64;
        if let Some(id) = self.contexts.find(handle) {
            let ordinal = self.contexts.ordinal(id);
            return Some(Current { id, ordinal });
        }
        let mut ordinal = 0;
        if call_real!(cuCtxGetDevice(&mut ordinal)) != SUCCESS {
            return None;
        }
        let (id, _) = self.contexts.add(handle, ordinal as usize, 0, false)?;
        Some(Current { id, ordinal: ordinal as usize })
    }

    /// What an allocation answers when [`Enforcer::current`] found no context to charge:
    /// the driver's own answer when no context is current (it fails the call), and
    /// `CUDA_ERROR_OUT_OF_MEMORY` when one is current but cannot be tracked (every slot
    /// taken): memory in a context outside the count would be memory past the limit.
    #[cold]
    #[inline(never)]
    pub(crate) fn untracked(&self, real: impl FnOnce() -> Status) -> Status {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        if call_real!(cuCtxGetCurrent(&mut ctx)) != SUCCESS || ctx.is_null() {
            return real();
        }
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "gpufrac: out of memory: the current context is one of more than {MAX_CONTEXTS} this process made; \
                 memory in a context gpufrac cannot track is refused"
            );
        }
        OUT_OF_MEMORY
    }

    /// The first try of [`Enforcer::charge`] alone: `None` if the charge does not fit now
    /// (or the device is unknown), for the caller to take the slow path.
    #[inline(always)]
    pub(crate) fn charge_quick(&self, ordinal: usize, bytes: u64) -> Option<Charge> {
        let slice = self.slice(ordinal)?;
        self.try_charge(&slice, bytes, self.cap(&slice)).ok()
    }

    /// Charges `bytes` on CUDA device `ordinal` if the group stays within its limit. The
    /// first try (a charge that fits: the hot path) is inlined into the allocation hooks;
    /// anything else (pools to take back, the arbiter, a refusal) is `charge_slow`.
    #[inline(always)]
    pub(crate) fn charge(&self, ordinal: usize, bytes: u64) -> Result<Charge, Status> {
        let slice = self.slice(ordinal).ok_or(crate::driver::ffi::INVALID_VALUE)?;
        let cap = self.cap(&slice);
        match self.try_charge(&slice, bytes, cap) {
            Ok(charge) => Ok(charge),
            Err(over) => self.charge_slow(ordinal, slice, bytes, (cap, over), self.config.wait_timeout),
        }
    }

    /// `charge` for memory the driver takes on its own to make a context (or its heap):
    /// a burst for it waits as long as a guaranteed allocation waits for its memory
    /// (`GPUFRAC_WAIT_TIMEOUT`, and at least [`OWED_WAIT`]), also for the part above a
    /// request too small to hold it: a process that cannot make its context cannot work
    /// at all, where a burst that gives up leaves it to try a smaller one.
    pub(crate) fn charge_owed(&self, ordinal: usize, bytes: u64) -> Result<Charge, Status> {
        let slice = self.slice(ordinal).ok_or(crate::driver::ffi::INVALID_VALUE)?;
        let cap = self.cap(&slice);
        match self.try_charge(&slice, bytes, cap) {
            Ok(charge) => Ok(charge),
            Err(over) => {
                self.charge_slow(ordinal, slice, bytes, (cap, over), self.config.wait_timeout.max(OWED_WAIT))
            }
        }
    }

    /// The most the group may hold on `slice`'s device now: with an arbiter, its request
    /// plus what it was granted.
    #[inline]
    fn cap(&self, slice: &Slice) -> u64 {
        match self.lender.get() {
            Some(_) => slice.limit.min(slice.request + self.ledger.group_granted(slice.ledger)),
            None => slice.limit,
        }
    }

    /// One try at charging `bytes` on `slice`'s device under `cap`.
    #[inline]
    fn try_charge(
        &self,
        slice: &Slice,
        bytes: u64,
        cap: u64,
    ) -> Result<Charge, crate::books::group_ledger::OverLimit> {
        let total = self.ledger.try_charge(slice.ledger, bytes, cap)?;
        Ok(Charge {
            device: slice.ledger,
            bytes,
            above_request: total > slice.request,
            whole_burst: total - bytes >= slice.request,
        })
    }

    /// Gives a charge back; with an arbiter, returns burst memory the group no longer
    /// needs, keeping one chunk of slack so a steady server does not talk to it each time.
    #[inline(always)]
    pub(crate) fn release(&self, device: usize, bytes: u64) {
        self.ledger.release(device, bytes);
        if self.lender.get().is_some() {
            self.release_to_arbiter(device);
        }
    }

    /// Calls the driver; with an arbiter, an out-of-memory answer for memory the group is
    /// guaranteed or was granted is transient (loans are being taken back for a guarantee,
    /// or a killed process's memory is still being torn down by the driver), so the call
    /// is retried until `GPUFRAC_WAIT_TIMEOUT`, and at least [`OWED_WAIT`]: the arbiter
    /// takes a guarantee's memory back within its reclaim and kill graces, so a short
    /// burst timeout must not turn a guaranteed allocation into out-of-memory.
    #[inline]
    pub(crate) fn physical(&self, mut call: impl FnMut() -> Status) -> Status {
        let status = call();
        if status != OUT_OF_MEMORY || self.lender.get().is_none() {
            return status;
        }
        self.physical_retry(status, call)
    }

    #[cold]
    #[inline(never)]
    fn physical_retry(&self, mut status: Status, mut call: impl FnMut() -> Status) -> Status {
        let now = std::time::Instant::now();
        // A timeout too large to add is as good as none.
        let deadline =
            now.checked_add(self.config.wait_timeout.max(OWED_WAIT)).unwrap_or(now + OWED_WAIT * 1000);
        let mut pause = std::time::Duration::from_millis(1);
        while status == OUT_OF_MEMORY && std::time::Instant::now() < deadline {
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(50));
            status = call();
        }
        if status == OUT_OF_MEMORY {
            tracing::warn!(
                "gpufrac: out of memory: the GPU had no memory free within {:?} (GPUFRAC_WAIT_TIMEOUT, at least {OWED_WAIT:?}) for memory this group is guaranteed or was granted: guarantees and memory used outside gpufrac fill it",
                self.config.wait_timeout.max(OWED_WAIT)
            );
        }
        status
    }

    /// Devices set up at `cuInit`.
    pub(crate) fn device_count(&self) -> usize {
        self.slices().len()
    }

    /// The slice of the device with `uuid`.
    pub(crate) fn slice_by_uuid(&self, uuid: &[u8; 16]) -> Option<Slice> {
        self.slice(self.slices().iter().position(|s| &s.uuid == uuid)?)
    }

    /// The slice of the ledger's device `device`.
    pub(crate) fn slice_by_ledger(&self, device: usize) -> Option<Slice> {
        self.slice(self.slices().iter().position(|s| s.ledger == device)?)
    }

    fn slices(&self) -> &[Slice] {
        match self.devices.get() {
            Some(Ok(slices)) => slices,
            _ => &[],
        }
    }

    /// Forgets context `id` and everything the driver freed with it.
    pub(crate) fn teardown_context(&self, id: usize) {
        let (ordinal, charged) = self.contexts.remove(id);
        if let Some(slice) = self.slice(ordinal) {
            self.release(slice.ledger, charged);
        }
        for (_, r) in self.pointers.drain_where(|r| r.context == Context::Tracked(id)) {
            // Memory an IPC handle shares may outlive its context in an importer.
            if r.path != Path::Shared {
                self.release(r.device, r.bytes);
            }
        }
        for (_, r) in self.arrays.drain_where(|r| r.context == Context::Tracked(id)) {
            self.release(r.device, r.bytes);
        }
        for (_, r) in self.modules.drain_where(|r| r.context == Context::Tracked(id)) {
            self.release(r.device, r.bytes);
        }
        self.pools.context_gone(self, id);
    }
}

/// Logs to stderr through `GPUFRAC_LOG`. `Targets` reads the `RUST_LOG` syntax of levels
/// and targets without a regular-expression engine, which would be a large share of the
/// library every process loads (and of its start-up cost).
fn init_logging(filter: &str) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter: Targets = filter.parse().unwrap_or_else(|_| Targets::new().with_default(LevelFilter::WARN));
    let output = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    let _ = tracing_subscriber::registry().with(output).with(filter).try_init();
}
