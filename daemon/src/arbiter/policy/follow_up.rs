//! What must happen after a change, as one value. Each change a request (or a tick, or a
//! look at NVML) makes goes through one of the methods below, which makes it and says in a
//! [`FollowUp`] what follows: answers to send, resolvers to run, a parking step, the lease
//! task to wake. The server does all of it in one function (`server::Shared::follow_up`),
//! under the same lock as the change. The primitives these call stay unit-tested on their
//! own.

use std::time::Instant;

use gpufrac_common::protocol::DeviceId;

use super::{Answer, ConnId, LeaseOrder, Outcome, Policy, WakeAnswer, WakeOutcome};

/// What must follow a change, in the order the server does it: answers to bursts, then to
/// wakes, then lease orders; then holders asked to give back and the priority resolver
/// (`contended`), the swap resolver, reclaim, a parking step; last the lease task woken.
#[derive(Debug, Default)]
#[must_use = "what must follow a change: hand it to the server's follow-up"]
pub struct FollowUp {
    /// Queued bursts answered: sent, counted and logged.
    pub answers: Vec<Answer>,
    /// Wakes answered (a checkpointed process is restored first).
    pub wakes: Vec<WakeAnswer>,
    /// What changed in the compute leases: each member told.
    pub leases: Vec<LeaseOrder>,
    /// Bursts wait: holders are asked to give back what they do not use, and the
    /// priority resolver looks.
    pub contended: bool,
    /// The swap resolver looks: swap-outs for swap bursts, swap-ins where memory is free.
    pub swap: bool,
    /// A guarantee may be owed lent memory: loans are taken back.
    pub reclaim: bool,
    /// Room was freed or is wanted: a parking step (wakes past their timeout refused,
    /// idle groups parked for the wakes and guarantees that need room).
    pub park: bool,
    /// Who wants or may have the GPU's time changed: the lease task looks again at once.
    pub wake_leases: bool,
}

impl FollowUp {
    /// Only a parking step (the ticker's first: a wake lends again before queued bursts
    /// are looked at).
    pub fn parking() -> FollowUp {
        FollowUp { park: true, ..FollowUp::default() }
    }

    /// This and `other`, answers and orders in order.
    pub fn and(mut self, other: FollowUp) -> FollowUp {
        self.answers.extend(other.answers);
        self.wakes.extend(other.wakes);
        self.leases.extend(other.leases);
        self.contended |= other.contended;
        self.swap |= other.swap;
        self.reclaim |= other.reclaim;
        self.park |= other.park;
        self.wake_leases |= other.wake_leases;
        self
    }
}

impl Policy {
    /// A burst asked for ([`Policy::acquire`]). Queued, the queue settles at once and
    /// the resolvers look (holders asked to give back, priority, swap).
    #[allow(clippy::too_many_arguments)]
    pub fn on_acquire(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        seq: u64,
        bytes: u64,
        preferred: u64,
        held: u64,
        resume: bool,
        now: Instant,
    ) -> (Outcome, FollowUp) {
        let outcome = self.acquire(conn, device, seq, bytes, preferred, held, resume, now);
        let follow = match outcome {
            Outcome::Queued => FollowUp {
                answers: self.settle(device, now),
                contended: true,
                swap: true,
                ..FollowUp::default()
            },
            Outcome::Granted(_) | Outcome::Denied(_) => FollowUp::default(),
        };
        (outcome, follow)
    }

    /// Burst memory given back ([`Policy::release`]): the bursts that now fit are
    /// answered; on a GPU with parkable groups, a parking step, so that a wake waiting for
    /// that room is answered now rather than at the next tick. The compute leases are not
    /// looked at: a release changes nobody's share of the GPU's time.
    pub fn on_release(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        bytes: u64,
        held: u64,
        now: Instant,
    ) -> FollowUp {
        let answers = self.release(conn, device, bytes, held, now);
        FollowUp { answers, park: self.parking_on(&device), ..FollowUp::default() }
    }

    /// A swap reported ([`Policy::swapped`]): as [`Policy::on_release`], memory moved off
    /// the device (or back) may answer bursts, and wakes on a GPU with parkable groups.
    pub fn on_swapped(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        granted: u64,
        host_bytes: u64,
        held: u64,
        now: Instant,
    ) -> FollowUp {
        let answers = self.swapped(conn, device, granted, host_bytes, held, now);
        FollowUp { answers, park: self.parking_on(&device), ..FollowUp::default() }
    }

    /// A registration ([`Policy::register`]), `Ok(parked)` with what follows: a request
    /// lent out is taken back, parkable groups crowding it are parked, and a group with a
    /// compute share joins the leases.
    #[allow(clippy::too_many_arguments)]
    pub fn on_register(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        total: u64,
        request: u64,
        limit: u64,
        held: u64,
        granted: u64,
        host_bytes: u64,
    ) -> Result<(bool, FollowUp), String> {
        let parked = self.register(conn, device, total, request, limit, held, granted, host_bytes)?;
        Ok((parked, FollowUp { reclaim: true, park: true, wake_leases: true, ..FollowUp::default() }))
    }

    /// A connection closed ([`Policy::disconnect`]): what it held answers bursts, may wake
    /// a parked group, and a lease it held goes on at once.
    pub fn on_disconnect(&mut self, conn: ConnId, now: Instant) -> FollowUp {
        let answers = self.disconnect(conn, now);
        FollowUp { answers, park: true, wake_leases: true, ..FollowUp::default() }
    }

    /// A park done ([`Policy::parked`]): the bursts and wakes that fit now, then the next
    /// parking step.
    pub fn on_parked(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        host_bytes: u64,
        held: u64,
        now: Instant,
    ) -> FollowUp {
        let (answers, wakes) = self.parked(conn, device, host_bytes, held, now);
        FollowUp { answers, wakes, park: true, ..FollowUp::default() }
    }

    /// A park given up ([`Policy::park_given_up`]: declined, or its checkpoint failed):
    /// the wakes that fit now, then the next parking step.
    pub fn on_park_given_up(&mut self, conn: ConnId, device: DeviceId, held: u64, now: Instant) -> FollowUp {
        let wakes = self.park_given_up(conn, device, held, now);
        FollowUp { wakes, park: true, ..FollowUp::default() }
    }

    /// A parked process's memory is back ([`Policy::woken`]): the wakes that fit now,
    /// then the next parking step.
    pub fn on_woken(&mut self, conn: ConnId, device: DeviceId, held: Option<u64>, now: Instant) -> FollowUp {
        let wakes = self.woken(conn, device, held, now);
        FollowUp { wakes, park: true, ..FollowUp::default() }
    }

    /// A wake asked for ([`Policy::wake`]); one that waits for room gets a parking step.
    pub fn on_wake(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        seq: u64,
        now: Instant,
    ) -> (WakeOutcome, FollowUp) {
        let outcome = self.wake(conn, device, seq, now);
        let park = matches!(outcome, WakeOutcome::Queued);
        (outcome, FollowUp { park, ..FollowUp::default() })
    }

    /// What NVML lists on `device` ([`Policy::observe_processes`]): the bursts that fit
    /// now.
    pub fn on_processes(&mut self, device: DeviceId, listed: &[(u32, u64)], now: Instant) -> FollowUp {
        FollowUp { answers: self.observe_processes(device, listed, now), ..FollowUp::default() }
    }

    /// A tick: waiters past their deadline are refused ([`Policy::expire`]), the swap
    /// resolver and reclaim look, and, when `remind` (every so often, not at each tick),
    /// holders are asked to give back and the priority resolver looks.
    pub fn on_tick(&mut self, now: Instant, remind: bool) -> FollowUp {
        FollowUp {
            answers: self.expire(now),
            contended: remind,
            swap: true,
            reclaim: true,
            ..FollowUp::default()
        }
    }

    /// A member wants the GPU ([`Policy::compute_want`]): a lease goes at once if it can.
    pub fn on_want(&mut self, conn: ConnId, device: DeviceId, now: Instant) -> FollowUp {
        self.compute_want(conn, device, now);
        self.leases_now(now)
    }

    /// A member is done with its lease ([`Policy::compute_done`]): the next one goes at
    /// once.
    #[allow(clippy::too_many_arguments)]
    pub fn on_lease_done(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        lease: u32,
        drain_us: u32,
        more: bool,
        now: Instant,
    ) -> FollowUp {
        self.compute_done(conn, device, lease, drain_us, more, now);
        self.leases_now(now)
    }

    /// The leases moved on to `now`, and the lease task woken to look again.
    fn leases_now(&mut self, now: Instant) -> FollowUp {
        let (leases, _) = self.compute_step(now);
        FollowUp { leases, wake_leases: true, ..FollowUp::default() }
    }

    /// Whether `device` has parkable groups (a parking step can do something there).
    fn parking_on(&self, device: &DeviceId) -> bool {
        self.gpus.get(device).is_some_and(|g| g.groups.values().any(|group| group.park_after.is_some()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::testing::{policy_with, GIB, GPU};
    use super::*;

    #[test]
    fn a_queued_burst_settles_and_calls_the_resolvers() {
        let mut p = policy_with(&[(1, "a", GIB, 12 * GIB), (2, "b", GIB, 12 * GIB)]);
        let now = Instant::now();
        let (first, follow) = p.on_acquire(1, GPU, 1, 10 * GIB, 10 * GIB, 0, false, now);
        assert!(matches!(first, Outcome::Granted(_)), "{first:?}");
        assert!(!follow.contended && !follow.swap && follow.answers.is_empty());
        let (second, follow) = p.on_acquire(2, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now);
        assert!(matches!(second, Outcome::Queued), "{second:?}");
        assert!(follow.contended && follow.swap && !follow.reclaim && !follow.park && !follow.wake_leases);
        // The holder gives back: the waiter is answered, and no parking step on a GPU
        // without parkable groups.
        let follow = p.on_release(1, GPU, 10 * GIB, GIB, now + Duration::from_millis(1));
        assert_eq!(follow.answers.len(), 1);
        assert_eq!(follow.answers[0].conn, 2);
        assert!(!follow.park && !follow.wake_leases);
    }

    #[test]
    fn registrations_and_disconnections_say_what_follows() {
        let mut p = policy_with(&[(1, "a", GIB, 2 * GIB)]);
        let follow = p.on_disconnect(1, Instant::now());
        assert!(follow.park && follow.wake_leases && !follow.reclaim);
        let merged = FollowUp::parking().and(FollowUp { reclaim: true, ..FollowUp::default() });
        assert!(merged.park && merged.reclaim && !merged.swap);
    }
}
