//! Wait-and-retry, the queue every resolver starts from. A burst is granted at once when
//! it fits and the GPU stays *safe*; otherwise it waits in its GPU's queue, in order, until
//! memory comes back or its deadline passes.
//!
//! Safe is the banker's rule over each group's declared limit: the loans out must be such
//! that, in some order, each growing borrower could still get everything up to its limit
//! from what is free plus what the groups before it give back. A grant that would leave
//! the GPU unsafe is not made, so borrowers can never all be stuck holding part of a burst
//! while waiting for each other: colliding bursts are served one after another instead of
//! ending in out-of-memory. A borrower is *growing* while it waits or has asked within
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
//! That order is a preference, never a reason to stall: if every burst under way waits and
//! none can be served (a burst that paused so long that its next step was taken for a new
//! burst may hold what they need), the queue falls back to the safety rule alone, with
//! which, while the GPU is safe, some waiter can always be served.
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

use super::{Answer, ConnId, Gpu, Outcome, Policy, Residency, Waiter, RESUME_WAIT};

/// How long after its last ask a borrower still counts as growing (bursts ask a chunk at a
/// time as allocators grow; a pause this long means the burst is over or settled).
pub const GROWING_FOR: Duration = Duration::from_secs(2);

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

    /// Whether lending `bytes` more to `group` leaves the GPU safe (see the module doc).
    /// Settled borrowers keep what they hold; growing ones must be able to finish, in some
    /// order, within what is free, what the growing before them give back, and what the
    /// settled leave.
    pub(super) fn safe_after(&self, group: &str, bytes: u64, now: Instant) -> bool {
        let mut free = self.room() - bytes as i128;
        if free < 0 {
            return false;
        }
        let mut settled = 0u64;
        // (what it may still claim, what it holds) of each growing borrower, claims capped
        // below by what the settled leave.
        let mut growing: Vec<(u64, u64)> = Vec::new();
        for (name, g) in &self.groups {
            let asker = name == group;
            let granted = g.granted() + if asker { bytes } else { 0 };
            if granted == 0 {
                continue;
            }
            if asker || self.growing(name, now) {
                growing.push((g.range(), granted));
            } else {
                settled += granted;
            }
        }
        let most = self.lendable().saturating_sub(settled);
        let mut claims: Vec<(u64, u64)> = growing
            .into_iter()
            .map(|(range, granted)| (range.min(most).saturating_sub(granted), granted))
            .collect();
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
            let mut others = false;
            let claimed: u64 = self
                .groups
                .iter()
                .filter(|(name, o)| name.as_str() != group && o.granted() > 0 && self.under_way(name, now))
                .map(|(_, o)| {
                    others = true;
                    o.range().min(self.lendable()).saturating_sub(o.granted())
                })
                .sum();
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

    /// Whether `group` is growing: it waits, or asked lately and is on the device (a group
    /// swapped out cannot allocate until it is back).
    fn growing(&self, group: &str, now: Instant) -> bool {
        let Some(g) = self.groups.get(group) else { return false };
        let resident = g.members.values().any(|m| m.residency == Residency::Resident);
        self.queue.iter().any(|w| w.group == group)
            || (resident && g.last_ask.is_some_and(|t| now.saturating_duration_since(t) < GROWING_FOR))
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
    /// borrow (swapped out or ended): what the resolvers ask before acting.
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
        trial.servable(&w.group, w.bytes, w.preferred, now)
    }

    /// Whether a burst could be served now, were it first in line: by the queue's rule,
    /// or by the safety rule alone, where only bursts under way keep it waiting (they
    /// finish without anyone being ended or swapped out).
    pub(super) fn servable(&self, group: &str, bytes: u64, preferred: u64, now: Instant) -> bool {
        self.grant_for(group, bytes, preferred, now, false).is_some()
            || self.grant_for(group, bytes, preferred, now, true).is_some()
    }

    /// Whether `group` borrows now.
    fn borrows(&self, group: &str) -> bool {
        self.groups.get(group).is_some_and(|g| g.granted() > 0)
    }
}

impl Policy {
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
        // While parked groups wait to be woken nothing new is lent (see `park`).
        if gpu.queue.is_empty() && gpu.wakers.is_empty() {
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
        for (&device, gpu) in self.gpus.iter_mut() {
            let hopeless = gpu.queue.iter().any(|w| gpu.never_served(&w.group, w.bytes).is_some());
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
    /// merely wait, members of growing groups: what they were lent is part of what they
    /// may claim anyway (giving it back would not make the GPU safer), and they are about
    /// to use it. Never a member whose swap-in is under way: its grant is being mapped.
    pub fn contended_holders(&self, now: Instant) -> Vec<(ConnId, DeviceId)> {
        let mut out = Vec::new();
        for (&device, gpu) in &self.gpus {
            let owed = gpu.shortfall() > 0;
            if gpu.queue.is_empty() && !owed {
                continue;
            }
            for (name, conn, m) in gpu.members() {
                if m.granted > 0 && !m.swapping_in && (owed || !gpu.under_way(name, now)) {
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
            let Some(head) = gpu.queue.front() else { break };
            // While others wait, a new burst is lent what it needs, not a chunk more: memory
            // lent as slack would keep the next in line waiting. A step of a burst under
            // way is lent its chunk: new bursts are kept off its whole claim anyway, and
            // fewer, larger grants finish it sooner.
            let contended = gpu.queue.len() > 1;
            // Bursts under way go first, in order: a swap-in that fits (its process is held
            // at its gate, maybe with memory others need, and brings back nothing new to
            // lend), or the next step of a burst under way, when it can be served safely.
            // Finishing a burst is what frees memory.
            let free = gpu.free();
            let under_way = gpu.queue.iter().enumerate().find_map(|(i, w)| {
                let room = gpu.groups.get(&w.group).map_or(0, |g| g.room());
                if w.resume {
                    return (w.bytes <= free && w.bytes <= room).then_some((i, w.bytes));
                }
                if !gpu.under_way(&w.group, now) {
                    return None;
                }
                gpu.grant_for(&w.group, w.bytes, w.preferred, now, false).map(|grant| (i, grant))
            });
            // Then the head, a new burst, if its whole claim fits beside theirs.
            let next = under_way.or_else(|| {
                let preferred = if contended { head.bytes } else { head.preferred };
                gpu.grant_for(&head.group, head.bytes, preferred, now, false).map(|grant| (0, grant))
            });
            // A burst under way that waits may need what a waiter taken for a new burst
            // holds (a step that paused so long that its burst looked over, or a resting
            // loan): when every burst under way waits and none can be served, nothing
            // would come back, so the queue falls back to the safety rule alone, over every
            // waiter, holders first, then the head.
            let next = next.or_else(|| {
                let names = gpu.groups.keys();
                if names.into_iter().any(|name| gpu.under_way(name, now) && !gpu.waits(name)) {
                    return None;
                }
                let holders =
                    gpu.queue.iter().enumerate().filter(|(_, w)| !w.resume && gpu.borrows(&w.group));
                let head = gpu.queue.iter().enumerate().take(1).filter(|(_, w)| !w.resume);
                holders.chain(head).find_map(|(i, w)| {
                    gpu.grant_for(&w.group, w.bytes, w.bytes, now, true).map(|grant| (i, grant))
                })
            });
            if let Some((w, grant)) = next.and_then(|(i, grant)| Some((gpu.queue.remove(i)?, grant))) {
                answers.push(Self::grant_waiter(gpu, device, w, grant, now));
                continue;
            }
            let Some(victim) = Self::deadlocked(gpu, now) else { break };
            // Only when something outside the ledger's rules (memory used outside gpufrac
            // grew) left every borrower waiting with nobody to serve: refuse the one
            // holding the most, whose out-of-memory error makes it free what it holds.
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
    /// the largest grant (never a swap-in: refusing it would free nothing). Safe grants
    /// never lead here; memory used outside gpufrac that grows, or a settled borrower that
    /// grows again, can. Not while a swap-out is under way or guarantees are owed memory
    /// (memory is on its way back), nor just after a restart, when memory outside gpufrac
    /// is likely shims coming back with what they hold.
    fn deadlocked(gpu: &Gpu, now: Instant) -> Option<ConnId> {
        let swapping_out = gpu.members().any(|(_, _, m)| m.residency == Residency::SwappingOut);
        if swapping_out || gpu.shortfall() > 0 || (gpu.outside() > 0 && now < gpu.reconnecting_until) {
            return None;
        }
        let mut holders = gpu.members().filter(|(_, _, m)| m.granted > 0).peekable();
        holders.peek()?;
        let mut victim: Option<(ConnId, u64)> = None;
        for (_, conn, m) in holders {
            let waiting = gpu.waiter(conn)?;
            if !waiting.resume && victim.is_none_or(|(_, most)| m.granted > most) {
                victim = Some((conn, m.granted));
            }
        }
        victim.map(|(conn, _)| conn)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::{GROWING_FOR, MAX_WAIT};

    #[test]
    fn a_process_that_cannot_be_signalled_is_lent_nothing() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        // A raw client without a pidfd (its process exited before the arbiter could pin
        // it, or an old kernel), in a group with a guarantee and room to burst.
        p.hello(1, Peer { signalable: false, ..peer("a", 1000) });
        // It comes back claiming a loan and swapped-out memory: neither is believed.
        p.register(1, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 6 * GIB, 2 * GIB).unwrap();
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.burst, s.swapped), (4 * GIB, 0, 0), "{s:?}");
        // A burst is refused at once: no resolver could ever take it back.
        assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, false, now), Outcome::Denied(Denial::OverLimit));
        assert_eq!(p.acquire(1, GPU, 2, GIB, GIB, 0, true, now), Outcome::Denied(Denial::OverLimit));
        assert_eq!(p.status().gpus[0].waiting, 0, "nothing queued");
        // Nor does a report of swapped-out memory put any in the ledger.
        p.swapped(1, GPU, 0, 3 * GIB, 0, now);
        assert_eq!(p.status().gpus[0].swapped, 0);
        // An unknown device is still answered as such.
        assert_eq!(p.acquire(1, [9; 16], 3, GIB, GIB, 0, false, now), Outcome::Denied(Denial::UnknownDevice));
        // A member of the same group that can be signalled still bursts.
        p.hello(2, peer("a", 1000));
        p.register(2, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now), Outcome::Granted(GIB));
    }

    #[test]
    fn bursts_wait_in_order_and_are_granted_as_memory_comes_back() {
        let now = Instant::now();
        let mut p = policy_with(&[
            (1, "a", 4 * GIB, 8 * GIB),
            (2, "b", 4 * GIB, 6 * GIB),
            (3, "c", 4 * GIB, 5 * GIB),
        ]);
        // 4 GiB unreserved.
        assert_eq!(p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Granted(3 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
        assert_eq!(
            p.acquire(3, GPU, 1, GIB / 2, GIB / 2, 0, false, now),
            Outcome::Queued,
            "no bypassing the head"
        );
        assert_eq!(p.status().gpus[0].processes.iter().filter(|s| s.state == "waiting").count(), 2);
        let answers = p.release(1, GPU, 3 * GIB, 0, now + Duration::from_millis(5));
        assert_eq!(answers.len(), 2);
        assert_eq!((answers[0].conn, answers[0].result), (2, Ok(2 * GIB)));
        assert_eq!((answers[1].conn, answers[1].result), (3, Ok(GIB / 2)));
        assert_eq!(answers[0].waited, Duration::from_millis(5));
        let s = &p.status().gpus[0];
        assert!(s.burst + s.guaranteed <= 16 * GIB);
    }

    #[test]
    fn grants_never_pass_the_limit_or_the_gpu() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 2 * GIB, 3 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Denied(Denial::OverLimit));
        assert_eq!(
            p.acquire(1, GPU, 2, GIB / 2, 4 * GIB, 0, false, now),
            Outcome::Granted(GIB),
            "a chunk, capped by the limit"
        );
        assert_eq!(p.acquire(1, GPU, 3, 1, 1, 0, false, now), Outcome::Denied(Denial::OverLimit));
    }

    #[test]
    fn waiters_time_out_and_unblock_the_queue() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 4 * GIB, 12 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
        p.hello(2, Peer { wait_timeout: Duration::from_millis(10), ..peer("b", 10) });
        assert_eq!(p.acquire(2, GPU, 7, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.expire(now + Duration::from_millis(5)).is_empty());
        let answers = p.expire(now + Duration::from_millis(11));
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].seq, answers[0].result), (2, 7, Err(Denial::Timeout)));
    }

    #[test]
    fn partial_bursts_never_deadlock_they_are_served_one_after_another() {
        let now = Instant::now();
        // 8 servers: request 1 GiB, limit 4 GiB, 8 GiB to lend; each bursts by 3 GiB in
        // 64 MiB steps, asking a 768 MiB chunk at a time, all at once.
        let servers: Vec<(ConnId, String)> = (1..=8).map(|c| (c, format!("s{c}"))).collect();
        let groups: Vec<(ConnId, &str, u64, u64)> =
            servers.iter().map(|(c, g)| (*c, g.as_str(), GIB, 4 * GIB)).collect();
        let mut p = policy_with(&groups);
        p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
        let chunk = 768 << 20;
        let step = 64 << 20;
        // Holdings per server; each asks until it has 3 GiB, then frees everything.
        let mut granted = [0u64; 9];
        let mut waiting = [false; 9];
        let mut done = 0;
        let mut seq = 0;
        let mut t = now;
        for _round in 0..10_000 {
            t += Duration::from_millis(1);
            let mut progressed = false;
            for conn in 1..=8u64 {
                let c = conn as usize;
                if waiting[c] || granted[c] >= 3 * GIB {
                    continue;
                }
                seq += 1;
                let need = step.min(3 * GIB - granted[c]);
                match p.acquire(conn, GPU, seq, need, chunk.max(need), 0, false, t) {
                    Outcome::Granted(g) => granted[c] += g,
                    Outcome::Queued => {
                        waiting[c] = true;
                        for a in p.settle(GPU, t) {
                            assert!(a.result.is_ok(), "nobody is refused: {a:?}");
                            granted[a.conn as usize] += a.result.unwrap();
                            waiting[a.conn as usize] = false;
                        }
                    }
                    Outcome::Denied(d) => panic!("denied {d:?}"),
                }
                progressed = true;
            }
            // Whoever has its whole burst uses it and frees it.
            for conn in 1..=8u64 {
                let c = conn as usize;
                if granted[c] >= 3 * GIB {
                    let back = granted[c];
                    granted[c] = 0;
                    done += 1;
                    for a in p.release(conn, GPU, back, GIB, t) {
                        assert!(a.result.is_ok(), "nobody is refused: {a:?}");
                        granted[a.conn as usize] += a.result.unwrap();
                        waiting[a.conn as usize] = false;
                    }
                    progressed = true;
                }
            }
            if done >= 24 {
                break;
            }
            assert!(progressed, "stuck: every server waits");
            assert!(p.status().gpus[0].burst <= 8 * GIB);
        }
        assert!(done >= 24, "every server finished its bursts, {done} done");
        assert!(p.expire(t + Duration::from_secs(1)).is_empty(), "nobody timed out");
    }

    #[test]
    fn a_group_that_borrows_goes_ahead_of_a_head_that_cannot_be_served() {
        let now = Instant::now();
        let mut p = policy_with(&[
            (1, "a", 2 * GIB, 10 * GIB),
            (2, "b", 2 * GIB, 10 * GIB),
            (3, "c", 2 * GIB, 4 * GIB),
        ]);
        // 10 GiB to lend; a borrows 6 and may claim 2 more.
        assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
        // b asks 3 of the 4 free: then a could not finish its burst (2 more, 1 free) nor b
        // (5 more): lending it could strand both, so b waits.
        assert_eq!(p.acquire(2, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty());
        // a asks for the rest of its burst: it goes ahead of b and is served.
        assert_eq!(p.acquire(1, GPU, 2, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
        let answers = p.settle(GPU, now);
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(2 * GIB))]);
        // a is done and frees its burst: b is served.
        let answers = p.release(1, GPU, 8 * GIB, 0, now);
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(2, Ok(3 * GIB))]);
    }

    #[test]
    fn a_new_burst_never_makes_the_bursts_under_way_wait() {
        let now = Instant::now();
        let mut p = policy_with(&[
            (1, "a", 2 * GIB, 8 * GIB),
            (2, "b", 2 * GIB, 6 * GIB),
            (3, "c", 2 * GIB, 8 * GIB),
        ]);
        // a loaded beyond its request long ago and gave it back (a first loan is taken for
        // a load, see `under_way`).
        let long_ago = now - Duration::from_secs(60);
        assert_eq!(p.acquire(1, GPU, 0, GIB, GIB, 0, false, long_ago), Outcome::Granted(GIB));
        assert!(p.release(1, GPU, GIB, 2 * GIB, long_ago).is_empty());
        // 10 GiB to lend; a's burst is under way: it has 2 and may claim 4 more.
        assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Granted(2 * GIB));
        // b starts a burst: of the 8 GiB free, 4 are a's to claim; b's whole claim (4)
        // fits beside it, so b starts, with at most those 4.
        assert_eq!(p.acquire(2, GPU, 1, GIB, 6 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
        // c has to wait: a and b may still claim all that is free.
        assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now), Outcome::Queued);
        // a asks for the rest of its burst: it is served before c.
        assert_eq!(p.acquire(1, GPU, 2, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        let answers = p.settle(GPU, now);
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(4 * GIB))]);
        // a's burst is over: c starts.
        let answers = p.release(1, GPU, 6 * GIB, 0, now);
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(3, Ok(GIB))]);
    }

    /// The contended trace of `queue_bench`: servers resting above their request (a
    /// context their request does not hold) must not all count as bursts under way, or new
    /// bursts start side by side, a step each, and the room holds half-grown bursts that
    /// all wait. Only as many start as their whole claims fit; a burst under way is served
    /// before them, and the next starts when one is over. A server that took memory lately
    /// and keeps it is told from a burst under way by order, not time: a whole burst of
    /// another server came and went while it did not ask.
    #[test]
    fn resting_loans_do_not_start_more_bursts_than_the_room_holds() {
        let now = Instant::now();
        let long_ago = now - Duration::from_secs(60);
        let ms = Duration::from_millis;
        let step = 64 << 20;
        let chunk = 768 << 20;
        let rest = 256 << 20;
        // 8 servers (request 1 GiB, limit 4 GiB) on 16 GiB: 8 GiB to lend, 2 of it resting
        // loans, so room for two bursts of 2.75 GiB at once.
        let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
        let groups: Vec<(ConnId, &str, u64, u64)> =
            (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
        let mut p = policy_with(&groups);
        for conn in 1..=8 {
            // Each loaded long ago, one after another.
            let loaded = long_ago + GROWING_FOR * conn as u32;
            assert_eq!(p.acquire(conn, GPU, 1, rest, rest, 0, false, loaded), Outcome::Granted(rest));
        }
        // The 7th took a step half a second ago and keeps it.
        assert_eq!(p.acquire(7, GPU, 2, step, step, 0, false, now - ms(500)), Outcome::Granted(step));
        // The 8th plays a whole burst and gives it back; the 7th did not ask meanwhile.
        assert_eq!(p.acquire(8, GPU, 2, step, step, 0, false, now - ms(300)), Outcome::Granted(step));
        assert!(p.release(8, GPU, step, GIB + rest, now - ms(200)).is_empty());
        // Bursts start together: the first two fit, each lent a chunk.
        assert_eq!(p.acquire(1, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
        assert_eq!(p.acquire(2, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
        // The 7th and the 3rd wait with nothing: their claims do not fit beside the two.
        // (Were the 7th's loan a burst under way, its step would be served.)
        assert_eq!(p.acquire(7, GPU, 3, step, chunk, 0, false, now), Outcome::Queued);
        assert_eq!(p.acquire(3, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty());
        // The first asks for the rest of its burst: it goes ahead of the new ones.
        let rest_of_burst = 3 * GIB - rest - chunk;
        assert_eq!(p.acquire(1, GPU, 3, rest_of_burst, rest_of_burst, 0, false, now), Outcome::Queued);
        let answers = p.settle(GPU, now);
        assert_eq!(
            answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
            vec![(1, Ok(rest_of_burst))]
        );
        // Its burst is over: the 7th starts (a step, while the 3rd waits), and the 3rd
        // still waits: its claim does not fit beside the second's and the 7th's.
        let answers = p.release(1, GPU, 3 * GIB - rest, GIB + rest, now);
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(7, Ok(step))]);
        assert_eq!(p.status().gpus[0].waiting, 1);
    }

    /// Servers that loaded together, each a model beyond its request, rest on it: their
    /// loads are no bursts under way, and their bursts start only as their whole claims fit.
    #[test]
    fn loads_beyond_the_request_are_resting_loans_not_bursts_under_way() {
        let now = Instant::now();
        let loaded = now - Duration::from_millis(500);
        let (step, chunk, rest) = (64 << 20, 768 << 20, 256 << 20);
        let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
        let groups: Vec<(ConnId, &str, u64, u64)> =
            (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
        let mut p = policy_with(&groups);
        // All load at once, within GROWING_FOR of the bursts.
        for conn in 1..=8 {
            assert_eq!(p.acquire(conn, GPU, 1, rest, rest, 0, false, loaded), Outcome::Granted(rest));
        }
        // Room for two bursts of 2.75 GiB: two start, each lent a chunk; the others wait.
        assert_eq!(p.acquire(1, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
        assert_eq!(p.acquire(2, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
        assert_eq!(p.acquire(3, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
        assert_eq!(p.acquire(8, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty());
    }

    /// What ended the demo's first act in out-of-memory beside two busy loops: an allocator
    /// paused in the middle of its burst for so long that its next step was taken for a
    /// new burst, which waits for the bursts under way, while one of them needs what the
    /// paused one holds. The queue falls back to the safety rule, serves the paused one
    /// first, and nobody is refused.
    #[test]
    fn a_burst_that_paused_mid_way_is_never_refused_for_deadlock() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        // 4 GiB to lend; p and u may borrow 3 GiB each, v 1 GiB.
        let mut p = policy_with(&[
            (1, "p", 4 * GIB, 7 * GIB),
            (2, "u", 4 * GIB, 7 * GIB),
            (3, "v", 4 * GIB, 5 * GIB),
        ]);
        p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
        // p's burst is under way: 2 GiB, and it will need 1 more.
        assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Granted(2 * GIB));
        // While p's allocator is paused (a starved CPU), v's whole burst fits beside p's
        // claim, comes and goes: p, silent all along, is taken for resting.
        assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now + ms(1)), Outcome::Granted(GIB));
        assert!(p.release(3, GPU, GIB, 4 * GIB, now + ms(2)).is_empty());
        // u starts a burst beside p (safe: p can finish first, then u).
        assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now + ms(3)), Outcome::Granted(GIB));
        // p's allocator wakes up: its step counts as a new burst, whose whole claim does not
        // fit beside u's: it waits.
        assert_eq!(p.acquire(1, GPU, 2, GIB, GIB, 0, false, now + ms(4)), Outcome::Queued);
        assert!(p.settle(GPU, now + ms(4)).is_empty());
        // u asks for its next step: with 1 GiB free it could strand both (p needs 1, u 2),
        // so u waits for p. Every burst under way waits: p is served by the safety rule.
        assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, false, now + ms(5)), Outcome::Queued);
        let answers = p.settle(GPU, now + ms(5));
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(GIB))]);
        // p's burst is over: u goes on.
        let answers = p.release(1, GPU, 3 * GIB, 4 * GIB, now + ms(6));
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(2, Ok(GIB))]);
        assert!(p.expire(now + ms(7)).is_empty(), "nobody refused");
    }

    /// The contended trace with allocators that pause at random in the middle of their
    /// bursts, some for longer than [`GROWING_FOR`], some while whole bursts of others come
    /// and go: every burst is served, nobody is refused.
    #[test]
    fn bursts_that_pause_at_random_mid_way_are_all_served_and_never_refused() {
        #[derive(Default, Clone, Copy)]
        struct Server {
            /// Lent above the request, and used of it.
            lent: u64,
            used: u64,
            growing: bool,
            waiting: bool,
            paused_until: u64,
            held_until: Option<u64>,
        }
        let start = Instant::now();
        let (step, chunk, rest, burst) = (64 << 20, 768 << 20, 256 << 20, 11 * GIB / 4);
        let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
        let groups: Vec<(ConnId, &str, u64, u64)> =
            (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
        let mut p = policy_with(&groups);
        p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
        let mut servers = [Server::default(); 9];
        for (conn, s) in servers.iter_mut().enumerate().skip(1) {
            // Loaded one after another, before the trace starts.
            let loaded = start - GROWING_FOR * (10 - conn as u32);
            assert_eq!(
                p.acquire(conn as ConnId, GPU, 0, rest, rest, 0, false, loaded),
                Outcome::Granted(rest)
            );
            (s.lent, s.used) = (rest, rest);
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut random = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        let apply = |servers: &mut [Server; 9], answers: Vec<Answer>| {
            for a in answers {
                let granted = a.result.unwrap_or_else(|d| panic!("refused: {d:?} {a:?}"));
                let s = &mut servers[a.conn as usize];
                (s.lent, s.used, s.waiting) = (s.lent + granted, s.used + step, false);
            }
        };
        let (mut seq, mut done, mut paused) = (0, 0, 0);
        for ms in 1..=3_600_000u64 {
            let t = start + Duration::from_millis(ms);
            for conn in 1..=8usize {
                let s = servers[conn];
                if s.waiting || ms < s.paused_until {
                    continue;
                }
                if let Some(until) = s.held_until {
                    if ms >= until {
                        let answers = p.release(conn as ConnId, GPU, s.lent - rest, GIB + rest, t);
                        servers[conn] = Server { lent: rest, used: rest, ..Server::default() };
                        done += 1;
                        apply(&mut servers, answers);
                    }
                    continue;
                }
                if !s.growing {
                    // A burst starts with a 12% chance every 100 ms.
                    servers[conn].growing = ms % 100 == 0 && random(100) < 12;
                    continue;
                }
                if s.used - rest >= burst {
                    servers[conn].held_until = Some(ms + 300);
                    continue;
                }
                // One step in 40 pauses the allocator for 0.3 to 3 s.
                if random(40) == 0 {
                    servers[conn].paused_until = ms + 300 + random(2700);
                    paused += 1;
                    continue;
                }
                if s.lent >= s.used + step {
                    servers[conn].used += step;
                    continue;
                }
                seq += 1;
                match p.acquire(conn as ConnId, GPU, seq, step, chunk, 0, false, t) {
                    Outcome::Granted(g) => {
                        (servers[conn].lent, servers[conn].used) = (s.lent + g, s.used + step)
                    }
                    Outcome::Queued => {
                        servers[conn].waiting = true;
                        let answers = p.settle(GPU, t);
                        apply(&mut servers, answers);
                    }
                    Outcome::Denied(d) => panic!("refused: {d:?}"),
                }
            }
            // The arbiter's tick.
            if ms % 50 == 0 {
                let answers = p.expire(t);
                apply(&mut servers, answers);
            }
            if done >= 200 {
                break;
            }
        }
        assert!(done >= 200 && paused > 50, "{done} bursts served, {paused} pauses");
    }

    #[test]
    fn a_settled_borrower_does_not_keep_others_waiting_for_what_it_might_want() {
        let now = Instant::now();
        for (asked, outcome) in [(now - GROWING_FOR, Outcome::Granted(5 * GIB)), (now, Outcome::Queued)] {
            let mut p = policy_with(&[(1, "cache", 2 * GIB, 12 * GIB), (2, "b", 2 * GIB, 12 * GIB)]);
            // 12 GiB to lend; cache borrows 4 (and may one day claim 6 more).
            assert_eq!(p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, asked), Outcome::Granted(4 * GIB));
            // b bursts by 5 of the 8 free. If cache is still growing, both could be
            // stranded (3 free, 5 and 6 to go): b waits. If cache has settled on its 4 GiB,
            // b can finish within the 8 GiB cache leaves: b is served.
            assert_eq!(
                p.acquire(2, GPU, 1, 5 * GIB, 5 * GIB, 0, false, now),
                outcome,
                "cache asked at {asked:?}"
            );
        }
    }

    #[test]
    fn a_limit_above_what_can_be_lent_still_gets_bursts() {
        let now = Instant::now();
        // b's limit is the whole GPU, more than the 12 GiB that can ever be lent.
        let mut p = policy_with(&[(1, "a", 2 * GIB, 2 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(2, GPU, 1, GIB, 4 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
        assert_eq!(p.acquire(2, GPU, 2, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
    }

    #[test]
    fn a_burst_that_can_never_fit_is_refused_at_once_and_blocks_nobody() {
        let now = Instant::now();
        // 12 GiB can ever be lent; a's limit is the whole GPU.
        let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 2 * GIB)]);
        assert_eq!(
            p.acquire(1, GPU, 1, 13 * GIB, 13 * GIB, 0, false, now),
            Outcome::Denied(Denial::NeverFits)
        );
        assert_eq!(p.status().gpus[0].waiting, 0, "it is not queued");
        // A 64 MiB burst behind it is served at once, with 12 GiB free.
        assert_eq!(p.acquire(1, GPU, 2, 64 << 20, 64 << 20, 0, false, now), Outcome::Granted(64 << 20));
        // What the group already borrows counts: 64 MiB are lent, so 12 GiB never fit.
        assert_eq!(
            p.acquire(1, GPU, 3, 12 * GIB, 12 * GIB, 0, false, now),
            Outcome::Denied(Denial::NeverFits)
        );
        let rest = 12 * GIB - (64 << 20);
        assert_eq!(p.acquire(1, GPU, 4, rest, rest, 0, false, now), Outcome::Granted(rest));
    }

    #[test]
    fn a_waiter_a_registration_leaves_without_a_chance_is_refused_then() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
        p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
        // 12 GiB to lend: a borrows 8, b waits for 10 (it fits once a gives back).
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 10 * GIB, 10 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty());
        // c is admitted with 4 GiB: now only 8 GiB can ever be lent, b's 10 never fit. The
        // next look at the queue (the expiry tick) refuses b, long before its deadline.
        p.hello(3, peer("c", 1000));
        p.register(3, GPU, 16 * GIB, 4 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        let answers = p.expire(now + Duration::from_millis(5));
        assert_eq!(
            answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
            vec![(2, Err(Denial::NeverFits))]
        );
        assert_eq!(p.status().gpus[0].waiting, 0);
        assert!(p.expire(now + Duration::from_millis(10)).is_empty());
    }

    #[test]
    fn every_wait_has_a_deadline_even_with_an_endless_timeout() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
        p.hello(2, Peer { wait_timeout: Duration::MAX, ..peer("b", 0) });
        assert_eq!(p.acquire(1, GPU, 1, 12 * GIB, 12 * GIB, 0, false, now), Outcome::Granted(12 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now), Outcome::Queued);
        assert!(p.expire(now + MAX_WAIT - Duration::from_secs(1)).is_empty());
        let answers = p.expire(now + MAX_WAIT);
        assert_eq!(
            answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
            vec![(2, Err(Denial::Timeout))]
        );
    }

    #[test]
    fn after_the_reconnect_grace_outside_memory_does_not_block_deadlock_breaking() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 101, ..peer("a", 60_000) });
        p.register(1, GPU, 16 * GIB, 4 * GIB, 16 * GIB, 0, 0, 0).unwrap();
        p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now);
        p.observe_processes(GPU, &[(200, 6 * GIB)], now);
        // a holds 4 GiB lent and waits for 4 more, 2 are free: only a could give memory back.
        assert_eq!(p.acquire(1, GPU, 2, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty(), "just after a start: maybe shims coming back");
        let answers = p.settle(GPU, now + RECONNECT_GRACE + Duration::from_secs(1));
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].result), (1, Err(Denial::Deadlock)));
    }
}
