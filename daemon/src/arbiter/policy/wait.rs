//! Wait-and-retry, the queue every resolver starts from. A burst is granted at once when
//! it fits and the GPU stays *safe*; otherwise it waits in its GPU's queue, in order, until
//! memory comes back or its deadline passes.
//!
//! Safe is the banker's rule over each group's declared limit: the loans out must be such
//! that, in some order, each growing borrower could still get everything up to its limit
//! from what is free plus what the groups before it give back. A grant that would leave
//! the GPU unsafe is not made, so borrowers can never all be stuck holding part of a burst
//! while waiting for each other: colliding bursts are served one after another instead of
//! ending in out-of-memory. A grant after which its borrower could finish from free
//! memory alone leaves the GPU no less safe (it can go first in any order there was), so
//! it is made even where the others' claims could not all be met. A borrower is *growing* while it waits or has asked within
//! [`GROWING_FOR`]; one that has not is counted as settled on what it holds (a server
//! keeping a cache), so that memory it might want one day does not keep others waiting for
//! ever. If a settled borrower grows again it waits like any other.
//!
//! Within what is safe, the queue keeps the room for bursts held by whole bursts. A group's
//! burst is *under way* from the grant that starts it until the group gives memory back
//! (its burst is over) or its processes end, for as long as the group keeps asking: it
//! waits for its next step, or asked within [`GROWING_FOR`] and not before a whole burst of
//! another group started and ended (an allocator that grows asks again within a burst's
//! time; a server resting on a context or a model its request does not hold does not).
//! That comparison counts asks and bursts, not time: a starved CPU stretches both alike.
//! (Silent for [`GROWING_FOR`], a burst is settled for the safety rule too.) A group's
//! first loan is most often its load (a context or a model its request does not hold):
//! it is taken for a resting loan once another group was lent memory after it, so that
//! servers that load together do not each keep a whole claim from the others' bursts.
//! Steps of bursts under way are served first, in order, each with the chunk it prefers.
//! A new burst (its group has none under way: a resting loan is not one) starts only where
//! its whole claim (what it may still borrow up to its limit) fits beside what the bursts
//! under way may still claim, so that it never makes them wait and never waits half-grown
//! itself; new bursts are served in order after the steps, one at a time, each lent just
//! what it needs while others wait. Holders whose burst is not under way are asked to give
//! back what they do not use while anyone waits.
//!
//! Behind waiters that cannot be served, a new burst whose whole claim free memory holds
//! now goes ahead, while the memory such bursts hold could not serve any waiter before it
//! ([`Gpu::backfill`]): it finishes on its own and leaves the GPU no less safe.
//!
//! That order is a preference, never a reason to stall: if every burst under way waits and
//! none can be served (a burst that paused so long that its next step was taken for a new
//! burst may hold what they need), the queue falls back to the safety rule alone, with
//! which, while the GPU is safe, some waiter can always be served.
//!
//! A process whose burst memory is in host RAM (swapped out, or being swapped out) gets
//! nothing new until it is back: a step it asks for waits *held back*, as if it were not
//! in the queue, and the server tells the process to ask for its swap-in. Lent new memory
//! while its last burst is in host RAM, every player of a ping-pong could end up swapped
//! out, each holding steps of a new burst on the device, with a swap-in that fits by no
//! rule and no resident holder to swap out: the GPU stood still.
//!
//! A group registered on several GPUs bursts on all of them as one ([`across`]).
//!
//! A burst that could never be served is refused at once rather than block the queue
//! until its deadline: one past its group's limit (`OverLimit`), or larger than what the
//! GPU could lend its group even if every other loan came back (`NeverFits`). Waiters are
//! checked again whenever the queue is examined, so one that a registration (a new
//! guarantee) leaves without a chance is refused then. Every wait has a deadline: a burst
//! its group's wait timeout (at most [`MAX_WAIT`]), a swap-in [`RESUME_WAIT`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId};
use gpufrac_common::Resolver;

use super::{Answer, ConnId, Gpu, Outcome, Policy, Residency, Waiter, RESUME_WAIT};

/// How long after its last ask a borrower still counts as growing (bursts ask a chunk at a
/// time as allocators grow; a pause this long means the burst is over or settled).
pub const GROWING_FOR: Duration = Duration::from_secs(2);

/// Silent this long (no ask, no step waiting), a holder whose burst is under way is asked
/// too while others wait: a server whose framework keeps its batch in a pool asks for
/// nothing more and gives nothing back by itself, and its shim empties the pool when
/// asked. A burst that allocates as it computes asks again well within this.
pub const ASK_SILENT_AFTER: Duration = Duration::from_millis(200);

/// How finely a grant between what a burst needs and what it prefers is sized.
const GRANT_STEP: u64 = 16 << 20;

/// Longest a burst waits, whatever its group's timeout (the server caps it the same way).
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// The order of asks and bursts on one GPU: a count of events, not a clock, so that a
/// starved CPU, which stretches every allocator's pauses, changes nothing.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct BurstClock {
    /// Ticks so far: one per ask and per grant.
    ticks: u64,
    /// The tick of the latest grant.
    last_grant: u64,
    /// The latest tick at which a burst started that has since ended (its group gave
    /// memory back).
    ended_start: u64,
}

/// A group's burst under way, if any.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct BurstMark {
    /// The tick of the grant that started it; `None`: no burst under way (the group rests
    /// on what it holds).
    started: Option<u64>,
    /// The tick of its group's last ask or grant.
    asked: u64,
    /// The burst under way is the group's first loan: what it loads beyond its request.
    first: bool,
    /// The group was ever lent memory here.
    lent_before: bool,
    /// The burst under way started behind waiters that could not be served (see
    /// `Gpu::backfill`).
    backfilled: bool,
}

impl Gpu {
    /// Memory the groups may borrow in all: what no request reserves and nobody outside
    /// gpufrac (nor any group beyond what its shims charged) uses.
    fn lendable(&self) -> u64 {
        self.total.saturating_sub(self.guaranteed()).saturating_sub(self.unaccounted())
    }

    /// Why a burst of `bytes` for `group` can never be served, if it cannot: the group is
    /// gone or the burst would take it past its limit (`OverLimit`), or it is more than the
    /// GPU could lend the group even if every other group gave back all it borrows
    /// (`NeverFits`): what no request reserves, less what the group borrows already.
    /// Memory used outside gpufrac is not counted: its process may exit or register, and a
    /// burst that needs it waits for that (the README promises it).
    pub(super) fn never_served(&self, group: &str, bytes: u64) -> Option<Denial> {
        let Some(g) = self.groups.get(group) else { return Some(Denial::OverLimit) };
        if bytes > g.room() {
            return Some(Denial::OverLimit);
        }
        let most = self.total.saturating_sub(self.guaranteed()).saturating_sub(g.granted());
        (bytes > most).then_some(Denial::NeverFits)
    }

    /// Whether lending `bytes` more to `group` leaves the GPU safe (see the module doc), or
    /// no less safe than it was.
    /// Settled borrowers keep what they hold; growing ones must be able to finish, in some
    /// order, within what is free, what the growing before them give back, and what the
    /// settled leave.
    pub(super) fn safe_after(&self, group: &str, bytes: u64, now: Instant) -> bool {
        let mut free = self.room() - bytes as i128;
        if free < 0 {
            return false;
        }
        let mut settled = 0u64;
        // (what it may still claim, what it holds, whether it asks) of each growing
        // borrower, claims capped below by what the settled leave.
        let mut growing: Vec<(u64, u64, bool)> = Vec::new();
        for (name, g) in &self.groups {
            let asker = name == group;
            let granted = g.granted() + if asker { bytes } else { 0 };
            if granted == 0 {
                continue;
            }
            if asker || self.growing(name, now) {
                growing.push((g.range(), granted, asker));
            } else {
                settled += granted;
            }
        }
        let most = self.lendable().saturating_sub(settled);
        let mut claims: Vec<(u64, u64)> = Vec::with_capacity(growing.len());
        for (range, granted, asker) in growing {
            let claim = range.min(most).saturating_sub(granted);
            // An asker that can finish from what is free alone leaves the GPU no less safe
            // than it was: it can go first in any order there was, and gives back more
            // than it took. (Where others' claims already could not all be met, refusing
            // it too kept a small burst waiting for nothing.)
            if asker && claim as i128 <= free {
                return true;
            }
            claims.push((claim, granted));
        }
        // One resource: serving the smallest claims first finds an order if there is one.
        claims.sort_unstable();
        for (claim, granted) in claims {
            if claim as i128 > free {
                return false;
            }
            free += granted as i128;
        }
        true
    }

    /// The grant for a burst of `bytes` (`preferred` if there is room) now, if any: the most
    /// up to `preferred`, capped by what is free and by the group's limit, that keeps the
    /// GPU safe, and at least the `bytes` it needs. A new burst (its group has none under
    /// way) starts only where its whole claim fits beside what the bursts under way may
    /// still claim, and only with memory they cannot; `fallback` drops that rule (for when
    /// every burst under way waits and none can be served, see `drain`).
    /// Whether groups other than `group` have bursts under way, and what those may still
    /// claim up to their limits.
    fn claimed_under_way(&self, group: &str, now: Instant) -> (bool, u64) {
        let mut others = false;
        let claimed = self
            .groups
            .iter()
            .filter(|(name, o)| {
                name.as_str() != group
                    && (o.granted() > 0 || self.elsewhere.contains(name.as_str()))
                    && self.under_way(name, now)
            })
            .map(|(_, o)| {
                others = true;
                o.range().min(self.lendable()).saturating_sub(o.granted())
            })
            .sum();
        (others, claimed)
    }

    /// Whether swap-in `w` is served now: what it brings back fits in what is free, in its
    /// group's room, and beside what the bursts under way may still claim. Served on free
    /// memory alone, a swap-in took what had just been freed for the burst it was swapped
    /// out for, and the two stood waiting for each other (refused as a deadlock) instead
    /// of taking turns. Not while a swap-out is under way on the GPU.
    pub(super) fn swap_in_fits(&self, w: &Waiter, now: Instant) -> bool {
        // Memory a swap-out under way frees is for the burst it was asked for, not for
        // the process just moved out (or another) to come straight back.
        if self.members().any(|(_, _, m)| m.residency == Residency::SwappingOut) {
            return false;
        }
        let room = self.groups.get(&w.group).map_or(0, |g| g.room());
        let (_, claimed) = self.claimed_under_way(&w.group, now);
        w.bytes <= room && w.bytes.saturating_add(claimed) <= self.free()
    }

    pub(super) fn grant_for(
        &self,
        group: &str,
        bytes: u64,
        preferred: u64,
        now: Instant,
        fallback: bool,
    ) -> Option<u64> {
        let g = self.groups.get(group)?;
        let room = g.room();
        let mut free = self.free();
        if !fallback && !self.under_way(group, now) {
            // So that it never makes them wait, and never waits half-grown itself: the
            // room holds whole bursts, one after another, not several half-grown ones each
            // waiting for the others.
            let (others, claimed) = self.claimed_under_way(group, now);
            free = free.saturating_sub(claimed);
            let whole = room.min(self.lendable().saturating_sub(g.granted()));
            if others && whole > free {
                return None;
            }
        } else if fallback && !self.borrows(group) {
            // The safety rule alone, as the queue had it before bursts were told apart from
            // resting loans: a group that borrows nothing starts only with what the growing
            // borrowers cannot still claim.
            let claimed: u64 = self
                .groups
                .iter()
                .filter(|(name, o)| o.granted() > 0 && self.growing(name, now))
                .map(|(_, o)| o.range().min(self.lendable()).saturating_sub(o.granted()))
                .sum();
            free = free.saturating_sub(claimed);
        }
        if bytes > free || bytes > room {
            return None;
        }
        let generous = preferred.min(free).min(room).max(bytes);
        if self.safe_after(group, generous, now) {
            return Some(generous);
        }
        if !self.safe_after(group, bytes, now) {
            return None;
        }
        // The most between the two that keeps the GPU safe (lending less never makes it
        // unsafe): fewer, larger grants mean fewer round trips for a growing burst.
        let (mut safe, mut unsafe_) = (bytes, generous);
        while unsafe_ - safe > GRANT_STEP {
            let mid = safe + (unsafe_ - safe) / 2;
            if self.safe_after(group, mid, now) {
                safe = mid;
            } else {
                unsafe_ = mid;
            }
        }
        Some(safe)
    }

    /// Whether `group` has a burst under way (see the module doc): it was lent memory
    /// and has given none back since, it is on the device (a group swapped out cannot
    /// allocate until it is back), and it waits for the next step, or asked lately
    /// ([`GROWING_FOR`]) and not before a whole burst of another group (from its first
    /// grant to memory given back), nor, for its first loan, before any grant to another.
    pub(super) fn under_way(&self, group: &str, now: Instant) -> bool {
        self.under_way_here(group, now) || self.under_way_elsewhere(group)
    }

    /// [`Gpu::under_way`] by what the group did on this GPU alone.
    pub(super) fn under_way_here(&self, group: &str, now: Instant) -> bool {
        let Some(g) = self.groups.get(group) else { return false };
        if g.burst.started.is_none() || !g.members.values().any(|m| m.residency == Residency::Resident) {
            return false;
        }
        if self.queue.iter().any(|w| w.group == group && w.continues) {
            return true;
        }
        let lately = g.last_ask.is_some_and(|t| now.saturating_duration_since(t) < GROWING_FOR);
        // A group's first loan is most often its load (a context, a model), after which it
        // rests: it is taken for that once any other group was lent memory after it.
        let after_others = !g.burst.first || g.burst.asked >= self.bursts.last_grant;
        lately && after_others && g.burst.asked >= self.bursts.ended_start
    }

    /// Whether `group` is growing: it is on the device, and it waits or asked lately. A
    /// group swapped out cannot allocate until it is back, and its swap-in waits until
    /// what it brings back fits beside the bursts under way: until then it rests on what
    /// it holds. (Counted as growing, it kept a swap burst from being served even with
    /// every resident holder swapped out: two growing claims never fit together.)
    fn growing(&self, group: &str, now: Instant) -> bool {
        let Some(g) = self.groups.get(group) else { return false };
        let resident = g.members.values().any(|m| m.residency == Residency::Resident);
        resident
            && (self.queue.iter().any(|w| w.group == group)
                || g.last_ask.is_some_and(|t| now.saturating_duration_since(t) < GROWING_FOR))
    }

    /// Whether some member of `group` waits for a burst (not a swap-in).
    fn waits(&self, group: &str) -> bool {
        self.queue.iter().any(|w| w.group == group && !w.resume)
    }

    /// Counts an ask of `group`: if its burst is no longer under way, it is over (the group
    /// rests on what it holds) and this ask starts a new one. Returns whether the ask
    /// continues a burst under way.
    fn asked(&mut self, group: &str, now: Instant) -> bool {
        let continues = self.under_way(group, now);
        self.bursts.ticks += 1;
        let tick = self.bursts.ticks;
        if let Some(g) = self.groups.get_mut(group) {
            if !continues {
                g.burst.started = None;
            }
            g.burst.asked = tick;
        }
        continues
    }

    /// Counts a grant to `group`: it starts a burst if none is under way.
    fn lent(&mut self, group: &str, now: Instant) {
        self.bursts.ticks += 1;
        let tick = self.bursts.ticks;
        self.bursts.last_grant = tick;
        if let Some(g) = self.groups.get_mut(group) {
            g.last_ask = Some(now);
            if g.burst.started.is_none() {
                g.burst.started = Some(tick);
                g.burst.first = !g.burst.lent_before;
                g.burst.lent_before = true;
                g.burst.backfilled = false;
            }
            g.burst.asked = tick;
        }
    }

    /// `group` gave memory back: its burst, if one was under way, is over.
    pub(super) fn end_burst(&mut self, group: &str) {
        if let Some(started) = self.groups.get_mut(group).and_then(|g| g.burst.started.take()) {
            self.bursts.ended_start = self.bursts.ended_start.max(started);
        }
    }

    /// Whether waiter `w` could be served now if the members `victims` gave back all they
    /// borrow (swapped out or ended): what the resolvers ask before acting. A swap-in by
    /// the rule the queue serves swap-ins with.
    pub(super) fn servable_without(&self, victims: &[ConnId], w: &Waiter, now: Instant) -> bool {
        let mut trial = self.clone();
        for group in trial.groups.values_mut() {
            for (conn, m) in group.members.iter_mut() {
                if victims.contains(conn) {
                    m.granted = 0;
                }
            }
        }
        trial.queue.retain(|q| !victims.contains(&q.conn));
        if w.resume {
            return trial.swap_in_fits(w, now);
        }
        trial.servable(&w.group, w.bytes, w.preferred, now)
    }

    /// Whether a burst could be served now, were it first in line: by the queue's rule,
    /// or by the safety rule alone, where only bursts under way keep it waiting (they
    /// finish without anyone being ended or swapped out).
    pub(super) fn servable(&self, group: &str, bytes: u64, preferred: u64, now: Instant) -> bool {
        self.grant_for(group, bytes, preferred, now, false).is_some()
            || self.grant_for(group, bytes, preferred, now, true).is_some()
    }

    /// Whether the resolvers leave waiter `w` to the queue: it is served now, or it is a
    /// burst (or a step of one) the safety rule alone could serve, whose wait the bursts
    /// under way end by finishing. Never a swap-in that is not served now: the holders
    /// "finishing" may be swapped out themselves, or blocked behind it, and a swap-in has
    /// no deadline to end its wait (three swap holders stood still for minutes so).
    pub(super) fn left_to_queue(&self, w: &Waiter, now: Instant) -> bool {
        if w.resume {
            return self.swap_in_fits(w, now);
        }
        self.servable(&w.group, w.bytes, w.preferred, now)
    }

    /// Whether waiter `w` is held back: a burst of a process not on the device (swapped
    /// out or being swapped out), which waits for its own swap-in first.
    pub(super) fn held_back(&self, w: &Waiter) -> bool {
        !w.resume && self.swapped_out(&w.group, w.conn)
    }

    /// Whether member `conn` of `group` is not on the device: swapped out, or being so.
    pub(super) fn swapped_out(&self, group: &str, conn: ConnId) -> bool {
        self.groups
            .get(group)
            .and_then(|g| g.members.get(&conn))
            .is_some_and(|m| m.residency != Residency::Resident)
    }

    /// The first waiter of the queue that is not held back, with its place.
    pub(super) fn head(&self) -> Option<(usize, &Waiter)> {
        self.queue.iter().enumerate().find(|(_, w)| !self.held_back(w))
    }

    /// Whether `group` borrows now.
    fn borrows(&self, group: &str) -> bool {
        self.groups.get(group).is_some_and(|g| g.granted() > 0)
    }

    /// What member `conn` of `group` was lent and does not use, as far as the ledger
    /// knows: its grant beyond what the group holds over its request (a group's
    /// processes share its request, so the group's use is counted against each grant).
    fn unused_loan(&self, group: &str, conn: ConnId) -> u64 {
        let Some(g) = self.groups.get(group) else { return 0 };
        let Some(m) = g.members.get(&conn) else { return 0 };
        let held = g.members.values().fold(0u64, |sum, m| sum.saturating_add(m.held));
        let used_of_loans = held.saturating_sub(g.request);
        let unused_of_loans = g.granted().saturating_sub(used_of_loans);
        m.granted.min(unused_of_loans)
    }
}

impl Policy {
    /// Whether `conn`'s process is not on `device`: swapped out, or being so. A burst it
    /// asks for is held back until its swap-in (see the module doc).
    pub fn swapped_out(&self, conn: ConnId, device: &DeviceId) -> bool {
        let Some(peer) = self.peers.get(&conn) else { return false };
        self.gpus.get(device).is_some_and(|gpu| gpu.swapped_out(&peer.group, conn))
    }

    /// Asks for at least `bytes` (`preferred` if there is room) of burst memory on `device`.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        seq: u64,
        bytes: u64,
        preferred: u64,
        held: u64,
        resume: bool,
        now: Instant,
    ) -> Outcome {
        self.share_bursts(now);
        let Some(peer) = self.peers.get(&conn) else { return Outcome::Denied(Denial::UnknownDevice) };
        let timeout = peer.wait_timeout;
        // A loan must be takeable back: from a process the arbiter cannot signal (no
        // pidfd) it never could be (neither resolver nor reclaim ever picks it), so it is
        // lent nothing: its burst limit is its request. (A swap-in too: it holds no loan.)
        if !peer.signalable {
            if self.member_gpu(conn, &device).is_none() {
                return Outcome::Denied(Denial::UnknownDevice);
            }
            return Outcome::Denied(Denial::OverLimit);
        }
        let Some((gpu, group)) = self.member_gpu(conn, &device) else {
            return Outcome::Denied(Denial::UnknownDevice);
        };
        let held = held.min(gpu.total);
        let Some(m) = gpu.member_mut(&group, conn) else { return Outcome::Denied(Denial::UnknownDevice) };
        m.held = held;
        // A swap-in brings back what is in host RAM, no more: a member with nothing
        // swapped out, or asking for more than it said it has there, is refused.
        if resume && (m.host_reported == 0 || bytes > m.host_reported) {
            return Outcome::Denied(Denial::NotSwapped);
        }
        if let Some(reason) = gpu.never_served(&group, bytes) {
            return Outcome::Denied(reason);
        }
        gpu.last_busy = now;
        // A swap-in is no step of a burst: it brings back what the group had.
        let continues = !resume && gpu.asked(&group, now);
        // While parked groups wait to be woken nothing new is lent (see `park`), nor to a
        // process not on the device (held back until its swap-in, see the module doc).
        let held_back = !resume && gpu.swapped_out(&group, conn);
        if gpu.queue.is_empty() && gpu.wakers.is_empty() && !held_back {
            if let Some(grant) = gpu.grant_for(&group, bytes, preferred, now, false) {
                if resume {
                    if let Some(g) = gpu.groups.get_mut(&group) {
                        g.last_ask = Some(now);
                    }
                } else {
                    gpu.lent(&group, now);
                }
                if let Some(m) = gpu.member_mut(&group, conn) {
                    m.grant(grant, now);
                    m.swapping_in |= resume;
                }
                return Outcome::Granted(grant);
            }
        }
        gpu.queue.push_back(Waiter {
            conn,
            group,
            seq,
            resume,
            bytes,
            preferred,
            continues,
            since: now,
            deadline: now
                .checked_add(if resume { RESUME_WAIT } else { timeout.min(MAX_WAIT) })
                .unwrap_or(now),
        });
        Outcome::Queued
    }

    /// Queues a burst like `acquire` and returns what the queue decided at once.
    pub fn acquire_answers(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        seq: u64,
        bytes: u64,
        now: Instant,
    ) -> Vec<Answer> {
        match self.acquire(conn, device, seq, bytes, bytes, 0, false, now) {
            Outcome::Queued => self.settle(device, now),
            _ => Vec::new(),
        }
    }

    /// Re-examines a GPU's queue (after a burst was queued).
    pub fn settle(&mut self, device: DeviceId, now: Instant) -> Vec<Answer> {
        self.share_bursts(now);
        match self.gpus.get_mut(&device) {
            Some(gpu) => Self::drain(device, gpu, now),
            None => Vec::new(),
        }
    }

    /// Waiters whose deadline passed are denied, and so are waiters that can no longer
    /// ever be served (a registration reserved memory they need); the waiters behind them
    /// may now fit.
    pub fn expire(&mut self, now: Instant) -> Vec<Answer> {
        let mut answers = Vec::new();
        // A group's burst over on one GPU may let new bursts start on its other GPUs.
        let freed = self.share_bursts(now);
        for (&device, gpu) in self.gpus.iter_mut() {
            let hopeless = gpu.queue.iter().any(|w| gpu.never_served(&w.group, w.bytes).is_some());
            if freed.contains(&device) && !gpu.queue.is_empty() {
                answers.extend(Self::drain(device, gpu, now));
                continue;
            }
            if !hopeless && gpu.queue.iter().all(|w| w.deadline > now) {
                continue;
            }
            let (expired, kept): (VecDeque<Waiter>, VecDeque<Waiter>) =
                std::mem::take(&mut gpu.queue).into_iter().partition(|w| w.deadline <= now);
            gpu.queue = kept;
            for w in expired {
                answers.push(Self::deny_waiter(gpu, device, w, Denial::Timeout, now));
            }
            answers.extend(Self::drain(device, gpu, now));
        }
        answers
    }

    /// Connections that hold burst grants on a GPU where someone waits or a guarantee is
    /// owed memory: they are asked to give back what they do not use. Not, while bursts
    /// merely wait, members of groups whose burst is under way and that asked within
    /// [`ASK_SILENT_AFTER`] or wait for a step: what they were lent is part of what they
    /// may claim anyway, and they are about to use it. A burst under way that went silent
    /// is asked: its memory may sit in a framework's pool, which only the give-back empties
    /// (and giving memory back ends its burst). Never a member whose swap-in is under way:
    /// its grant is being mapped.
    pub fn contended_holders(&self, now: Instant) -> Vec<(ConnId, DeviceId)> {
        let mut out = Vec::new();
        for (&device, gpu) in &self.gpus {
            let owed = gpu.shortfall() > 0;
            if gpu.queue.is_empty() && !owed {
                continue;
            }
            let silent = |name: &str| {
                !gpu.queue.iter().any(|w| w.group == name)
                    && gpu
                        .groups
                        .get(name)
                        .and_then(|g| g.last_ask)
                        .is_none_or(|t| now.saturating_duration_since(t) >= ASK_SILENT_AFTER)
            };
            // Not swap groups: the swap resolver moves their loans to host RAM, their
            // pools emptied first, and a swap holder given back mid-burst was lent its
            // grant again behind others (out-of-memory in density_bench's swap run).
            let swaps = |conn: ConnId| self.peers.get(&conn).is_some_and(|p| p.resolver == Resolver::Swap);
            for (name, conn, m) in gpu.members() {
                let silent_burst = silent(name) && m.residency == Residency::Resident && !swaps(conn);
                if m.granted > 0 && !m.swapping_in && (owed || !gpu.under_way(name, now) || silent_burst) {
                    out.push((conn, device));
                }
            }
        }
        out
    }

    /// Grants what the queue of `gpu` allows now.
    pub(super) fn drain(device: DeviceId, gpu: &mut Gpu, now: Instant) -> Vec<Answer> {
        let mut answers = Vec::new();
        loop {
            // Waiters that can no longer be served (their group changed meanwhile, or a
            // registration reserved memory they need) are answered now, wherever they are
            // in the queue: none of them blocks those behind it until its deadline.
            Self::refuse_hopeless(device, gpu, now, &mut answers);
            if !gpu.wakers.is_empty() {
                // Wakes first: they are guarantees coming back, bursts are loans.
                break;
            }
            // Held-back waiters (their process is not on the device) are passed over
            // until their swap-in is reported; so are swap-ins, served above when they fit
            // (one that waits for what bursts under way may claim must not keep new bursts
            // that fit from starting behind it; the swap resolver acts for it).
            if gpu.queue.is_empty() {
                break;
            }
            let first_burst = gpu.queue.iter().enumerate().find(|(_, w)| !w.resume && !gpu.held_back(w));
            // While others wait, a new burst is lent what it needs, not a chunk more: memory
            // lent as slack would keep the next in line waiting. A step of a burst under
            // way is lent its chunk: new bursts are kept off its whole claim anyway, and
            // fewer, larger grants finish it sooner.
            let contended = gpu.queue.len() > 1;
            // Bursts under way go first, in order: a swap-in that fits beside what they may
            // still claim (its process is held at its gate, maybe with memory others need,
            // and brings back nothing new to lend), or the next step of a burst under way,
            // when it can be served safely.
            // Finishing a burst is what frees memory.
            let under_way = gpu.queue.iter().enumerate().find_map(|(i, w)| {
                if w.resume {
                    return gpu.swap_in_fits(w, now).then_some((i, w.bytes));
                }
                if gpu.held_back(w) || !gpu.under_way(&w.group, now) {
                    return None;
                }
                gpu.grant_for(&w.group, w.bytes, w.preferred, now, false).map(|grant| (i, grant))
            });
            // Then the head, a new burst, if its whole claim fits beside theirs.
            let next = under_way.or_else(|| {
                let (head_at, head) = first_burst?;
                let preferred = if contended { head.bytes } else { head.preferred };
                gpu.grant_for(&head.group, head.bytes, preferred, now, false).map(|grant| (head_at, grant))
            });
            // A burst under way that waits may need what a waiter taken for a new burst
            // holds (a step that paused so long that its burst looked over, or a resting
            // loan): when every burst under way waits and none can be served, nothing
            // would come back, so the queue falls back to the safety rule alone, over every
            // waiter, holders first, then the head.
            let mut backfilled = false;
            let next = next.or_else(|| {
                let names = gpu.groups.keys();
                if names.into_iter().any(|name| gpu.under_way(name, now) && !gpu.waits(name)) {
                    return None;
                }
                let holders = gpu
                    .queue
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| !w.resume && !gpu.held_back(w) && gpu.borrows(&w.group));
                let head = gpu.head().into_iter().filter(|(_, w)| !w.resume);
                holders.chain(head).find_map(|(i, w)| {
                    gpu.grant_for(&w.group, w.bytes, w.bytes, now, true).map(|grant| (i, grant))
                })
            });
            // Then, behind waiters that cannot be served, a new burst that free memory
            // holds whole and that cannot keep them waiting.
            let next = next.or_else(|| {
                let found = gpu.backfill(now);
                backfilled = found.is_some();
                found
            });
            if let Some((w, grant)) = next.and_then(|(i, grant)| Some((gpu.queue.remove(i)?, grant))) {
                let group = w.group.clone();
                answers.push(Self::grant_waiter(gpu, device, w, grant, now));
                if let Some(g) = gpu.groups.get_mut(&group).filter(|_| backfilled) {
                    g.burst.backfilled = true;
                }
                continue;
            }
            let Some(victim) = Self::deadlocked(gpu, now) else { break };
            // Every borrower waits with nobody to serve: something outside the safety
            // rule's view put them there (memory used outside gpufrac grew, or a burst
            // paused so long, on a starved CPU, that it was taken for settled and others
            // were lent what it still needed). One is refused (see `deadlocked`).
            let Some(w) = gpu.queue.iter().position(|w| w.conn == victim).and_then(|i| gpu.queue.remove(i))
            else {
                break;
            };
            answers.push(Self::deny_waiter(gpu, device, w, Denial::Deadlock, now));
        }
        answers
    }

    /// Denies the waiters of `gpu` that can never be served (see `Gpu::never_served`).
    fn refuse_hopeless(device: DeviceId, gpu: &mut Gpu, now: Instant, answers: &mut Vec<Answer>) {
        let mut i = 0;
        while i < gpu.queue.len() {
            let reason = gpu.never_served(&gpu.queue[i].group, gpu.queue[i].bytes);
            match reason {
                Some(reason) => {
                    if let Some(w) = gpu.queue.remove(i) {
                        answers.push(Self::deny_waiter(gpu, device, w, reason, now));
                    }
                }
                None => i += 1,
            }
        }
    }

    fn deny_waiter(gpu: &mut Gpu, device: DeviceId, w: Waiter, reason: Denial, now: Instant) -> Answer {
        let waited = now.saturating_duration_since(w.since);
        if let Some(m) = gpu.member_mut(&w.group, w.conn) {
            m.waited += waited;
        }
        Answer { conn: w.conn, seq: w.seq, device, waited, result: Err(reason) }
    }

    fn grant_waiter(gpu: &mut Gpu, device: DeviceId, w: Waiter, grant: u64, now: Instant) -> Answer {
        let waited = now.saturating_duration_since(w.since);
        if w.resume {
            if let Some(g) = gpu.groups.get_mut(&w.group) {
                g.last_ask = Some(now);
            }
        } else {
            gpu.lent(&w.group, now);
        }
        if let Some(m) = gpu.member_mut(&w.group, w.conn) {
            m.grant(grant, now);
            m.swapping_in |= w.resume;
            m.waited += waited;
            // A holder that had to wait has not had its turn yet: its quantum starts now.
            if m.residency == Residency::Resident {
                m.resident_since = Some(now);
            }
        }
        gpu.last_busy = now;
        Answer { conn: w.conn, seq: w.seq, device, waited, result: Ok(grant) }
    }

    /// If every holder of burst memory on `gpu` waits for more, the waiting holder with
    /// the largest grant (never a swap-in, nor a burst held back for one: refusing them
    /// would free nothing). Safe grants never lead here; memory used outside gpufrac that
    /// grows, or a settled borrower that grows again, can. Not while a swap-out or a
    /// swap-in is under way or guarantees are owed memory (memory is on its way back), nor just after a restart, when memory outside gpufrac
    /// is likely shims coming back with what they hold.
    fn deadlocked(gpu: &Gpu, now: Instant) -> Option<ConnId> {
        let swapping = gpu.members().any(|(_, _, m)| m.residency == Residency::SwappingOut || m.swapping_in);
        if swapping || gpu.shortfall() > 0 || (gpu.outside() > 0 && now < gpu.reconnecting_until) {
            return None;
        }
        // Swap bursts (or a swap-in) waiting for holders that wait take turns instead:
        // the swap resolver moves holders of other groups out (once they have had their
        // quantum), if moving them all would serve the head.
        if let Some((_, head)) = gpu.head() {
            let head_swaps =
                gpu.groups.get(&head.group).and_then(|g| g.members.get(&head.conn)).is_some_and(|m| m.swaps);
            let movable: Vec<ConnId> = gpu
                .members()
                .filter(|(name, _, m)| {
                    **name != head.group && m.swaps && m.granted > 0 && m.residency == Residency::Resident
                })
                .map(|(_, conn, _)| conn)
                .collect();
            if head_swaps && !movable.is_empty() && gpu.servable_without(&movable, head, now) {
                return None;
            }
        }
        let mut holders = gpu.members().filter(|(_, _, m)| m.granted > 0).peekable();
        holders.peek()?;
        // The victim is refused its burst: a shim then gives back what it was lent and
        // does not use (its share of a burst not allocated yet) and asks again, so the
        // one with the most unused loan goes first; with none unused anywhere, the one
        // holding the most, whose out-of-memory error makes it free what it holds.
        let mut victim: Option<(ConnId, (u64, u64))> = None;
        for (group, conn, m) in holders {
            gpu.waiter(conn)?;
            // A process not on the device waits for its swap-in (a burst of it is held
            // back): refusing that burst would free nothing.
            let bursts = gpu.queue.iter().any(|w| w.conn == conn && !w.resume && !gpu.held_back(w));
            let rank = (gpu.unused_loan(group, conn), m.granted);
            if bursts && victim.is_none_or(|(_, best)| rank > best) {
                victim = Some((conn, rank));
            }
        }
        victim.map(|(conn, _)| conn)
    }
}

mod across;
mod backfill;
mod stall;
#[cfg(test)]
mod tests;
