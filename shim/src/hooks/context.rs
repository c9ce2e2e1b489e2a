//! Contexts and the device memory each one takes, measured rather than guessed: the
//! process's own usage as NVML reports it, just before and just after the driver creates
//! the context, never the device's (other processes allocate meanwhile). A context is
//! charged before it is created, so the group (and the arbiter) count it while it comes
//! into being: the size measured before on that device (kept in the group's ledger),
//! refused up front if it does not fit; never measured, a conservative estimate (at most
//! what the limit leaves). The charge is then corrected to the measurement, and a context
//! that turns out not to fit is destroyed and refused with `CUDA_ERROR_OUT_OF_MEMORY`.

use std::ffi::{c_int, c_uint, c_void};

use crate::driver::ffi::{read, write, Status, SUCCESS};
use crate::driver::table::call_real;
use crate::enforcer::usage::{delta, far_from, usage, Usage};
use crate::enforcer::{enforcer, refused, Enforcer};

type Ptr = *mut c_void;

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
                if let Some(client) = crate::control::arbiter::client() {
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
    // The device's first context: the request is reserved now under first-use.
    if let Err(status) = e.reserve_on_first_use(dev as usize) {
        return status;
    }
    measured(
        e,
        dev as usize,
        true,
        || {
            // A context on a GPU whose loans are being taken back waits for its memory.
            let status = e.physical(|| call_real!(cuDevicePrimaryCtxRetain(ctx, dev)));
            // SAFETY: `ctx` is what the caller passed: null or a readable value of its type (the API's contract).
            (status, unsafe { read(ctx) }.map_or(0, |c| c as u64))
        },
        || {
            // The primary context was inactive: this one retain is all it has.
            let _ = call_real!(cuDevicePrimaryCtxRelease_v2(dev));
            // SAFETY: `ctx` is the caller's out-pointer: null or writable for its type (the API's contract).
            unsafe { write(ctx, std::ptr::null_mut()) };
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
    if let Some(Err(status)) = enforcer().filter(|_| dev >= 0).map(|e| e.reserve_on_first_use(dev as usize)) {
        return status;
    }
    match enforcer() {
        Some(e) if dev >= 0 => measured(
            e,
            dev as usize,
            false,
            || {
                let status = e.physical(&mut real);
                // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
                (status, unsafe { read(out) }.map_or(0, tracked))
            },
            || {
                // SAFETY: `out` is what the caller passed: null or a readable value of its type (the API's contract).
                if let Some(c) = unsafe { read(out) } {
                    destroy(c);
                }
                // SAFETY: `out` is the caller's out-pointer: null or writable for its type (the API's contract).
                unsafe { write(out, std::ptr::null_mut()) };
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
