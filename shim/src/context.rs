//! Contexts and the device memory each one takes, measured rather than guessed: the
//! process's own usage as NVML reports it, just before and just after the driver creates
//! the context. A context is charged before it is created, so the group (and the arbiter)
//! count it while it comes into being: the size measured before on that device (kept in
//! the group's ledger), refused up front if it does not fit; never measured, a
//! conservative estimate (at most what the limit leaves). The charge is then corrected to
//! the measurement, and a context that turns out not to fit is destroyed and refused with
//! `CUDA_ERROR_OUT_OF_MEMORY`.

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::driver::{call, uuid_string};
use crate::ffi::{read, write, Status, SUCCESS};
use crate::hooks::call_real;
use crate::state::{enforcer, refused, Enforcer};

type Ptr = *mut c_void;

/// Bytes in use as NVML sees them: this process's own usage if NVML lists this process
/// (by the PID the arbiter saw, in a container, where NVML reports the host's PIDs; not
/// found there without an arbiter), and the whole device's. `None` without NVML.
fn usage(ordinal: usize) -> Option<(Option<u64>, u64)> {
    let mut dev = 0;
    let mut uuid = [0u8; 16];
    if call!(cuDeviceGet(&mut dev, ordinal as c_int), 801) != SUCCESS
        || call!(cuDeviceGetUuid(&mut uuid, dev), 801) != SUCCESS
        || call!(nvmlInit_v2(), 13) != SUCCESS
    {
        return None;
    }
    let name = std::ffi::CString::new(uuid_string(&uuid)).ok()?;
    let mut handle: Ptr = std::ptr::null_mut();
    if call!(nvmlDeviceGetHandleByUUID(name.as_ptr() as *const c_char, &mut handle), 13) != SUCCESS {
        return None;
    }
    let mut procs = [[0u64; 3]; 256];
    let mut count: c_uint = procs.len() as c_uint;
    let listed = call!(nvmlDeviceGetComputeRunningProcesses_v3(handle, &mut count, procs.as_mut_ptr()), 13);
    // nvmlProcessInfo_t: pid (u32, padded), usedGpuMemory (u64), instance ids.
    let me = enforcer().and_then(|e| e.ledger.my_host_pid()).unwrap_or_else(std::process::id) as u64;
    let own = (listed == SUCCESS)
        .then(|| {
            procs[..(count as usize).min(procs.len())].iter().find(|p| p[0] & 0xffff_ffff == me).map(|p| p[1])
        })
        .flatten();
    let mut mem = [0u64; 3];
    (call!(nvmlDeviceGetMemoryInfo(handle, &mut mem), 13) == SUCCESS).then_some((own, mem[2]))
}

/// Bytes a context took, from usage before and after creating it: this process's own
/// usage when NVML lists it afterwards (before its first context it is not listed: 0),
/// otherwise the whole device's (noisier when other processes allocate meanwhile).
fn delta(before: Option<(Option<u64>, u64)>, after: Option<(Option<u64>, u64)>) -> Option<u64> {
    match (before?, after?) {
        ((b, _), (Some(a), _)) => a.checked_sub(b.unwrap_or(0)),
        ((_, b), (None, a)) => a.checked_sub(b),
    }
}

/// What a context never measured on a device is charged until it is: real contexts take
/// a few hundred MiB (simgpu's default is 256 MiB).
const UNMEASURED_CONTEXT: u64 = 256 << 20;

/// What to charge for a new context on ledger device `dev` before creating it: the last
/// measurement, or (never refused on a guess) the estimate, at most what the limit leaves.
fn estimate(e: &Enforcer, dev: usize, limit: u64) -> u64 {
    e.ledger
        .context_bytes(dev)
        .unwrap_or_else(|| UNMEASURED_CONTEXT.min(limit.saturating_sub(e.ledger.held(dev))))
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
    let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
    let Some(slice) = e.slice(ordinal) else { return create().0 };
    let dev = slice.ledger;
    let estimate = estimate(e, dev, slice.limit);
    if let Err(status) = e.charge(ordinal, estimate) {
        tracing::warn!(
            ordinal,
            bytes = estimate,
            held = e.ledger.held_fast(dev),
            limit = slice.limit,
            "gpufrac: out of memory: refused a new context: its {estimate} bytes (as measured before on this device) were not available under GPUFRAC_MEMORY_LIMIT"
        );
        return status;
    }
    let before = usage(ordinal);
    let (status, handle) = create();
    if status != SUCCESS {
        e.release(dev, estimate);
        return status;
    }
    let after = usage(ordinal);
    let bytes = match delta(before, after) {
        Some(bytes) => {
            if bytes > 0 && e.ledger.context_bytes(dev).is_none_or(|known| known != bytes) {
                e.ledger.set_context_bytes(dev, bytes);
            }
            bytes
        }
        None => {
            tracing::warn!(
                ordinal,
                estimate,
                "cannot measure a new context through NVML; charging the last measurement or the estimate"
            );
            estimate
        }
    };
    if bytes > estimate {
        if let Err(status) = e.charge(ordinal, bytes - estimate) {
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
        Some(id) => e.set_context_charge(id, bytes),
        None => tracing::warn!("more than {} contexts; not tracking this one", crate::state::MAX_CONTEXTS),
    }
    tracing::debug!(ordinal, bytes, primary, "context created");
    status
}

fn primary_active(dev: c_int) -> bool {
    let (mut flags, mut active) = (0, 0);
    call!(cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active), 801) == SUCCESS && active != 0
}

pub(crate) fn primary_retain(ctx: *mut Ptr, dev: c_int) -> Status {
    let Some(e) = enforcer() else {
        return refused().unwrap_or_else(|| call_real!(cuDevicePrimaryCtxRetain(ctx, dev)));
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
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxRelease_v2(dev)))
}

pub(crate) fn primary_reset(dev: c_int) -> Status {
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxReset_v2(dev)))
}

pub(crate) fn primary_release_v1(dev: c_int) -> Status {
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxRelease(dev)))
}

pub(crate) fn primary_reset_v1(dev: c_int) -> Status {
    after_primary_change(dev, call_real!(cuDevicePrimaryCtxReset(dev)))
}

fn create(ctx: *mut Ptr, dev: c_int, mut real: impl FnMut() -> Status) -> Status {
    match enforcer() {
        Some(e) if dev >= 0 => measured(
            e,
            dev as usize,
            false,
            || {
                let status = e.physical(&mut real);
                (status, read(ctx).map_or(0, |c| c as u64))
            },
            || {
                if let Some(c) = read(ctx) {
                    let _ = call_real!(cuCtxDestroy_v2(c));
                }
                write(ctx, std::ptr::null_mut());
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

pub(crate) fn ctx_destroy(ctx: Ptr) -> Status {
    let status = call_real!(cuCtxDestroy_v2(ctx));
    if let Some(e) = enforcer() {
        if status == SUCCESS {
            let _serial = e.contexts.changes.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(id) = e.contexts.find(ctx as u64) {
                e.teardown_context(id);
            }
        }
    }
    status
}

#[cfg(test)]
mod tests {
    use super::delta;

    #[test]
    fn context_measurement_prefers_own_usage_and_falls_back_to_the_device() {
        // Not listed before the first context, listed after.
        assert_eq!(delta(Some((None, 1000)), Some((Some(256), 1300))), Some(256));
        // Listed both times.
        assert_eq!(delta(Some((Some(100), 1000)), Some((Some(356), 1300))), Some(256));
        // Never listed (PIDs of another namespace): the device's change.
        assert_eq!(delta(Some((None, 1000)), Some((None, 1300))), Some(300));
        assert_eq!(delta(None, Some((None, 1300))), None);
    }
}
