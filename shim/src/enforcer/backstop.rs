//! The device's own count as the backstop. What the hooks charged is the fast path;
//! memory can still reach the device past them (raw ioctls, a statically linked or
//! privately loaded driver, kernel code loaded lazily at a launch, a path no hook
//! covers). On its slow paths (a refusal, a new context, a module load), at most once
//! every [`PERIOD`], the shim compares this process's own usage as NVML reports it with
//! what it has charged; memory found beyond [`SLACK`] is charged to the group as
//! *uncounted*, so the limit holds whatever path took it, and given back when it goes.
//! With an arbiter, what the process holds (uncounted included) is what it reports, and
//! the arbiter compares every group on its own schedule as well.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::enforcer::usage::usage;
use crate::enforcer::Enforcer;

/// How often at most the shim looks at the device's count on a context or module load.
pub(crate) const PERIOD: Duration = Duration::from_secs(2);
/// Before answering a refusal it always looks: the memory it may find is what fills the
/// slice, and a refusal is rare (a program that retries in a loop pays one NVML query a
/// try, on a path that is failing anyway).
pub(crate) const REFUSAL_PERIOD: Duration = Duration::ZERO;

/// Usage beyond the charges that is not taken as uncounted: one allocation granule
/// (the driver rounds allocations and keeps small internal buffers).
pub(crate) const SLACK: u64 = 2 << 20;

/// Per ledger device: what this process was charged for memory the device showed and
/// no hook did.
pub(crate) struct Backstop {
    uncounted: [AtomicU64; crate::books::group_ledger::MAX_DEVICES],
    /// Milliseconds since `EPOCH` of the last look, plus one (0: never looked).
    last: AtomicU64,
    warned: AtomicBool,
}

impl Default for Backstop {
    fn default() -> Backstop {
        Backstop {
            uncounted: std::array::from_fn(|_| AtomicU64::new(0)),
            last: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }
}

fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// How much should be uncounted, from the process's own usage `own`, what it has
/// charged `mine` (uncounted included), and what is uncounted now.
fn target(own: u64, mine: u64, uncounted: u64) -> u64 {
    let hooked = mine.saturating_sub(uncounted);
    let beyond = own.saturating_sub(hooked);
    if beyond > SLACK {
        beyond
    } else {
        0
    }
}

impl Backstop {
    /// What this process holds uncounted on ledger device `dev`.
    pub(crate) fn uncounted(&self, dev: usize) -> u64 {
        self.uncounted.get(dev).map_or(0, |u| u.load(Ordering::Relaxed))
    }

    /// Compares the process's usage on CUDA device `ordinal` with its charges, unless it
    /// did within `period` ([`PERIOD`] or [`REFUSAL_PERIOD`]).
    pub(crate) fn look(&self, e: &Enforcer, ordinal: usize, period: Duration) {
        let last = self.last.load(Ordering::Relaxed);
        let at = now_ms();
        if last != 0 && !period.is_zero() && at.saturating_sub(last) < period.as_millis() as u64 {
            return;
        }
        // A context, heap or module being measured (by this thread, which holds the lock
        // while it asks for the memory the measurement found, or another) is on the
        // device and not yet charged: looking now would take it for an escape.
        let Ok(_quiet) = e.contexts.changes.try_lock() else { return };
        if self.last.compare_exchange(last, at, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return; // another thread is looking
        }
        let Some(slice) = e.slice(ordinal) else { return };
        let dev = slice.ledger;
        let Some(measured) = usage(e, ordinal, dev) else {
            tracing::debug!(ordinal, "backstop: the device's count could not be read cleanly");
            return;
        };
        let Some(own) = measured.own else {
            tracing::debug!(ordinal, "backstop: the device does not list this process");
            return;
        };
        let was = self.uncounted(dev);
        let should = target(own, measured.mine, was);
        if should > was {
            e.ledger.force_charge(dev, should - was);
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    ordinal,
                    uncounted = should,
                    device_count = own,
                    charged = measured.mine,
                    "gpufrac: the device reports this process holding {should} bytes more than gpufrac counted (a path \
                     it does not hook); charged to the group against GPUFRAC_MEMORY_LIMIT"
                );
            }
        } else if should < was {
            e.ledger.release(dev, was - should);
        }
        self.uncounted[dev].store(should, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::{target, SLACK};

    const MIB: u64 = 1 << 20;

    #[test]
    fn usage_beyond_the_charges_and_the_slack_is_uncounted() {
        // The device shows what was charged: nothing uncounted.
        assert_eq!(target(300 * MIB, 300 * MIB, 0), 0);
        // Within one granule: the driver's rounding, not an escape.
        assert_eq!(target(300 * MIB + SLACK, 300 * MIB, 0), 0);
        // 1 GiB taken past the hooks.
        assert_eq!(target(1324 * MIB, 300 * MIB, 0), 1024 * MIB);
        // Already charged: the same figure, not twice.
        assert_eq!(target(1324 * MIB, 1324 * MIB, 1024 * MIB), 1024 * MIB);
        // Freed again: nothing uncounted any more.
        assert_eq!(target(300 * MIB, 1324 * MIB, 1024 * MIB), 0);
        // Charged more than the device shows (memory reserved, not yet backed): fine.
        assert_eq!(target(100 * MIB, 300 * MIB, 0), 0);
    }
}
