//! Loans from the arbiter, the shim's side: a charge past what the group holds asks for
//! burst memory (waiting, asking again, or failing with the reason the arbiter gave), and
//! memory given back returns what the group no longer uses.

use std::sync::atomic::Ordering;

use std::time::Duration;

use gpufrac_common::protocol::Denial;

use gpufrac_common::protocol::DeviceId;

use super::{Charge, Enforcer, Pending, Slice};
use crate::driver::ffi::{Status, OUT_OF_MEMORY};

/// The arbiter as the enforcer sees it: who lends burst memory and takes it back. The
/// arbiter client (`control::arbiter`) is one, set at `cuInit` (`registry::init`), so
/// that the enforcer below it names nothing of the layers above.
pub(crate) trait Lender: Send + Sync {
    /// Asks for `bytes` more on `device` (`preferred`: as much as is worth asking for),
    /// this process holding `held`; waits up to `timeout` for the answer: the bytes lent.
    fn acquire(
        &self,
        device: DeviceId,
        bytes: u64,
        preferred: u64,
        held: u64,
        timeout: Duration,
    ) -> Result<u64, NotGranted>;
    /// Returns `bytes` lent on `device`, this process holding `held` afterwards.
    fn release(&self, device: DeviceId, bytes: u64, held: u64);
    /// Whether the arbiter lately asked for memory back on `device` (keep no slack).
    fn contended(&self, device: &DeviceId) -> bool;
    /// Whether some of this process's burst memory is in host RAM: nothing new is lent
    /// until it is back.
    fn swapped_out(&self) -> bool;
    /// Waits for the swap-in, as the process's launches do at the gate.
    fn wait_swapped_in(&self) -> Result<(), Status>;
    /// Reserves `request` on `device` (of `total` bytes, up to `limit`), registered until
    /// now with none (`GPUFRAC_RESERVE=first-use`): the request the arbiter believes, or
    /// why it refused it.
    fn reserve(&self, device: DeviceId, total: u64, request: u64, limit: u64) -> Result<u64, String>;
}

/// Why a burst was not granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotGranted {
    /// The arbiter said no.
    Denied(Denial),
    /// No answer in time: the arbiter is away (`connected` false) or slow.
    NoAnswer { connected: bool },
}

impl std::fmt::Display for NotGranted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotGranted::Denied(Denial::Timeout) => {
                "GPUFRAC_WAIT_TIMEOUT passed while the memory was lent to others"
            }
            NotGranted::Denied(Denial::OverLimit) => "the group's GPUFRAC_MEMORY_LIMIT is reached",
            NotGranted::Denied(Denial::UnknownDevice) => "the arbiter does not know this device",
            NotGranted::Denied(Denial::Deadlock) => {
                "every borrower was waiting, each holding memory another needs, and this one had no unused loan to give back"
            }
            NotGranted::Denied(Denial::NeverFits) => "the burst is larger than the GPU could ever lend",
            NotGranted::Denied(Denial::NotSwapped) => "a swap-in for more than this process has swapped out",
            NotGranted::NoAnswer { connected: false } => {
                "the arbiter did not answer within GPUFRAC_WAIT_TIMEOUT (it is unreachable)"
            }
            NotGranted::NoAnswer { connected: true } => "the arbiter did not answer within GPUFRAC_WAIT_TIMEOUT",
        })
    }
}

impl Enforcer {
    /// `charge` after its first try found the group full (`first`: the cap and the refusal).
    #[cold]
    #[inline(never)]
    pub(super) fn charge_slow(
        &self,
        ordinal: usize,
        slice: Slice,
        bytes: u64,
        first: (u64, crate::books::group_ledger::OverLimit),
        wait: std::time::Duration,
    ) -> Result<Charge, Status> {
        let dev = slice.ledger;
        // The arbiter answers a burst at the group's own GPUFRAC_WAIT_TIMEOUT; a longer
        // wait asks again until this deadline.
        let started = std::time::Instant::now();
        let mut pending = None;
        // How far taking back what the process's pools keep has gone (see `reclaim`).
        let mut reclaimed = 0;
        let mut first = Some(first);
        let mut waited_for_swap_in = false;
        'charge: loop {
            let arbiter = self.lender.get();
            let (cap, over) = match first.take() {
                Some(first) => first,
                None => {
                    let cap = self.cap(&slice);
                    match self.try_charge(&slice, bytes, cap) {
                        Ok(charge) => return Ok(charge),
                        Err(over) => (cap, over),
                    }
                }
            };
            // Counted as in use from here on, so that memory given back meanwhile (by the
            // pools below, or by another thread) is not returned to the arbiter as unused.
            if pending.is_none() {
                self.pending[dev].fetch_add(bytes, Ordering::AcqRel);
                pending = Some(Pending(&self.pending[dev], bytes));
            }
            // Memory the pools keep (and the driver may already have taken back) is the
            // room, before the arbiter is asked or the charge refused.
            while reclaimed < 2 {
                reclaimed += 1;
                if self.pools.reclaim(self, dev, reclaimed - 1) {
                    continue 'charge;
                }
            }
            if reclaimed == 2 {
                // Once per refusal: memory taken past the hooks is counted before the
                // answer (it may be what fills the slice).
                reclaimed += 1;
                self.backstop.look(self, ordinal, crate::enforcer::backstop::REFUSAL_PERIOD);
            }
            let Some(client) = arbiter.filter(|_| over.held.saturating_add(bytes) <= slice.limit) else {
                tracing::debug!(
                    ordinal,
                    bytes,
                    held = over.held,
                    limit = slice.limit,
                    "gpufrac: out of memory: GPUFRAC_MEMORY_LIMIT reached"
                );
                return Err(OUT_OF_MEMORY);
            };
            // A process whose burst memory is in host RAM is lent nothing new until it is
            // back (the arbiter holds such a step back). Its allocation waits for the
            // swap-in here, as its launches do at the gate, so that however long the
            // swap-in waits its turn, it does not count against GPUFRAC_WAIT_TIMEOUT.
            // (Once: a gate opened some other way, e.g. by a park given up, must not make
            // this a loop.)
            if !waited_for_swap_in && client.swapped_out() {
                waited_for_swap_in = true;
                tracing::debug!(ordinal, bytes, "gpufrac: a burst waits for the process's swap-in");
                client.wait_swapped_in()?;
                continue 'charge;
            }
            let need = over.held.saturating_add(bytes).saturating_sub(cap);
            let preferred = need.max(Self::chunk(&slice));
            let lent_before = self.ledger.my_granted(dev);
            match client.acquire(
                slice.uuid,
                need,
                preferred,
                self.ledger.held_by_me(dev),
                self.config.wait_timeout,
            ) {
                Ok(granted) => self.ledger.add_granted(dev, granted),
                Err(why @ (NotGranted::Denied(Denial::Timeout) | NotGranted::NoAnswer { .. }))
                    if started.elapsed() < wait =>
                {
                    tracing::debug!(ordinal, need, "{why}: asking again (a context's memory waits longer)");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(why) => {
                    // Every borrower waited, each holding part of what another needs, and
                    // this process was picked to break the circle: what it was lent and
                    // does not use (a share of a burst not yet allocated) goes back, and it
                    // asks again behind the others, which that memory lets finish. Only
                    // with nothing unused to give does its allocation fail. (The reader
                    // thread may give it back first, for the arbiter's reclaim sent along:
                    // what counts is that this process's loan shrank.)
                    if why == NotGranted::Denied(Denial::Deadlock) && started.elapsed() < wait {
                        pending = None;
                        self.give_back(&slice, 0);
                        let left = self.ledger.my_granted(dev);
                        if left < lent_before {
                            tracing::debug!(
                                ordinal,
                                need,
                                given = lent_before - left,
                                "gpufrac: a waiting burst gave back its unused loan"
                            );
                            continue 'charge;
                        }
                    }
                    tracing::warn!(
                        ordinal,
                        bytes,
                        need,
                        "gpufrac: out of memory: a burst of {need} bytes above the request was not granted: {why}"
                    );
                    return Err(OUT_OF_MEMORY);
                }
            }
        }
    }

    #[inline(never)]
    pub(super) fn release_to_arbiter(&self, device: usize) {
        if let Some(client) = self.lender.get() {
            let Some(slice) = self.slices().iter().find(|s| s.ledger == device).copied() else { return };
            let slack = if client.contended(&slice.uuid) { 0 } else { Self::chunk(&slice) };
            self.give_back(&slice, slack);
        }
    }

    /// Returns all of this process's grant that the group does not use (no slack): after
    /// the process's pools were emptied for a give-back.
    pub(crate) fn give_back_unused(&self, slice: &Slice) -> u64 {
        self.give_back(slice, 0)
    }

    /// Returns this process's grant beyond what the group uses plus `slack`; returns what
    /// was given back.
    pub(crate) fn give_back(&self, slice: &Slice, slack: u64) -> u64 {
        let Some(client) = self.lender.get() else { return 0 };
        let device = slice.ledger;
        let allowed = slice.request + self.ledger.group_granted(device);
        let in_use = self.ledger.held_fast(device) + self.pending[device].load(Ordering::Acquire);
        let give = allowed.saturating_sub(in_use).saturating_sub(slack);
        if give > 0 {
            let taken = self.ledger.take_granted(device, give);
            if taken > 0 {
                client.release(slice.uuid, taken, self.ledger.held_by_me(device));
            }
            return taken;
        }
        0
    }
}
