//! Wakes: a parked member asks to be woken, is woken at once if its group fits, else
//! queued until it does or its wait timeout passes; members back on the device without
//! their wake are answered at once.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId};

use super::{give_up_late_parks, lend_again, GroupPark, MemberPark};
use crate::arbiter::policy::{ConnId, Gpu, Policy};

/// A parked member's wake, waiting for room.
#[derive(Debug, Clone)]
pub(in crate::arbiter::policy) struct Waker {
    pub(in crate::arbiter::policy) conn: ConnId,
    pub(in crate::arbiter::policy) group: String,
    pub(in crate::arbiter::policy) seq: u64,
    since: Instant,
    deadline: Instant,
}

impl Waker {
    /// Its answer on `device` at `now`.
    fn answer(&self, device: DeviceId, now: Instant, result: Result<(u64, bool), Denial>) -> WakeAnswer {
        let waited = now.saturating_duration_since(self.since);
        WakeAnswer { conn: self.conn, seq: self.seq, device, waited, result }
    }
}

/// What a wake gets at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeOutcome {
    /// Woken: its memory may come back, `bytes` of it lent as a burst. With `restore`,
    /// the arbiter restores the checkpointed process before answering.
    Woken {
        /// Burst bytes it holds again.
        bytes: u64,
        /// The arbiter restores it with the driver's checkpoint API first.
        restore: bool,
    },
    /// Waits for room: a `WakeAnswer` follows.
    Queued,
    /// Refused.
    Denied(Denial),
}

/// A queued wake, decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeAnswer {
    /// To whom.
    pub conn: ConnId,
    /// The wake's sequence number.
    pub seq: u64,
    /// The GPU.
    pub device: DeviceId,
    /// How long it waited.
    pub waited: Duration,
    /// Woken (burst bytes lent again, whether to restore a checkpoint first) or refused.
    pub result: Result<(u64, bool), Denial>,
}

impl Gpu {
    /// Wakes `conn` of `group` if it fits now: returns the burst bytes it holds again and
    /// whether its memory is to be restored from a checkpoint.
    fn try_wake(&mut self, group: &str, conn: ConnId, now: Instant) -> Option<(u64, bool)> {
        let room = self.room();
        let g = self.groups.get_mut(group)?;
        if matches!(g.park, GroupPark::Parking { .. }) {
            return None;
        }
        if g.park == GroupPark::Parked {
            if g.wake_need() as i128 > room {
                return None;
            }
            // The whole group's request is reserved again, and what each member borrowed
            // is lent again (members not yet back come back with their first call).
            g.park = GroupPark::Resident;
            g.active_since = now;
            g.wakes += 1;
            let conns: Vec<ConnId> =
                g.members.iter().filter(|(_, m)| m.park == MemberPark::Parked).map(|(&c, _)| c).collect();
            for c in conns {
                lend_again(g, c);
            }
        } else {
            let m = g.members.get(&conn)?;
            if m.parked_grant as i128 > room {
                return None;
            }
        }
        lend_again(g, conn);
        let m = g.members.get_mut(&conn)?;
        m.park = MemberPark::Waking;
        Some((m.granted, m.checkpointed))
    }
}

impl Policy {
    /// A parked member asks to be woken: woken now if its group fits, else queued until
    /// it does (or its wait timeout passes).
    pub fn wake(&mut self, conn: ConnId, device: DeviceId, seq: u64, now: Instant) -> WakeOutcome {
        let Some(timeout) = self.peers.get(&conn).map(|p| p.wait_timeout) else {
            return WakeOutcome::Denied(Denial::UnknownDevice);
        };
        let Some((gpu, group)) = self.member_gpu(conn, &device) else {
            return WakeOutcome::Denied(Denial::UnknownDevice);
        };
        let Some(m) = gpu.member_mut(&group, conn) else { return WakeOutcome::Denied(Denial::UnknownDevice) };
        match m.park {
            // Not parked (any more): nothing to bring back, nothing lent anew.
            MemberPark::Resident | MemberPark::Waking => {
                return WakeOutcome::Woken { bytes: 0, restore: false }
            }
            MemberPark::Parking | MemberPark::Parked => {}
        }
        m.wake_asked.get_or_insert(now);
        if gpu.wakers.is_empty() {
            if let Some((bytes, restore)) = gpu.try_wake(&group, conn, now) {
                return WakeOutcome::Woken { bytes, restore };
            }
        }
        gpu.wakers.retain(|w| w.conn != conn);
        let deadline = now.checked_add(timeout.min(crate::arbiter::policy::wait::MAX_WAIT)).unwrap_or(now);
        gpu.wakers.push_back(Waker { conn, group, seq, since: now, deadline });
        WakeOutcome::Queued
    }

    /// `conn`'s memory on `device` is back: `held` on the device now (`None`: what it
    /// parked, after a restore). Returns the wakes that now fit.
    pub fn woken(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        held: Option<u64>,
        now: Instant,
    ) -> Vec<WakeAnswer> {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return Vec::new() };
        let total = gpu.total;
        let mut back = false;
        if let Some(g) = gpu.groups.get_mut(&group) {
            if let Some(m) = g.members.get_mut(&conn).filter(|m| m.park == MemberPark::Waking) {
                m.park = MemberPark::Resident;
                let held = held.unwrap_or(m.held.saturating_add(m.parked_bytes));
                (m.held, m.parked_bytes, m.checkpointed, m.left_on_device) = (held.min(total), 0, false, 0);
                if let Some(asked) = m.wake_asked.take() {
                    g.last_wake = now.saturating_duration_since(asked);
                }
                back = true;
            }
        }
        let answers = Self::drain_wakers(device, gpu, now);
        // Woken for a call that waits: active from now, whatever it did before its park
        // (it stood at its gate meanwhile). Taken for idle, it was parked again for the
        // next wake before its call ran, and two models that fit one at a time parked
        // each other for ever.
        if let Some(peer) = self.peers.get_mut(&conn).filter(|_| back) {
            peer.last_active = peer.last_active.max(now);
        }
        answers
    }

    /// Whether `conn` was told to park on `device` and has not answered.
    pub fn is_parking(&self, conn: ConnId, device: &DeviceId) -> bool {
        self.member(conn, device).is_some_and(|m| m.park == MemberPark::Parking)
    }

    /// When `conn`'s wake on `device` was asked, while it is under way.
    pub fn wake_asked(&self, conn: ConnId, device: &DeviceId) -> Option<Instant> {
        self.member(conn, device).and_then(|m| m.wake_asked)
    }

    /// A granted wake could not bring `conn`'s memory back (its restore failed): it is
    /// parked still, what it was lent kept for its next wake.
    pub fn wake_failed(&mut self, conn: ConnId, device: DeviceId) {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return };
        if let Some(m) = gpu.member_mut(&group, conn) {
            m.park = MemberPark::Parked;
            m.wake_asked = None;
        }
    }

    fn member(&self, conn: ConnId, device: &DeviceId) -> Option<&crate::arbiter::policy::Member> {
        let peer = self.peers.get(&conn)?;
        self.gpus.get(device)?.groups.get(&peer.group)?.members.get(&conn)
    }

    /// Wakes whose deadline passed are refused (`Timeout`); the ones behind may now fit.
    /// Parks not answered in time are given up.
    pub fn expire_wakes(&mut self, now: Instant) -> Vec<WakeAnswer> {
        let mut answers = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            give_up_late_parks(gpu, now);
            while let Some(i) = gpu.wakers.iter().position(|w| w.deadline <= now) {
                let Some(w) = gpu.wakers.remove(i) else { break };
                if let Some(m) = gpu.member_mut(&w.group, w.conn) {
                    m.wake_asked = None;
                }
                answers.push(w.answer(device, now, Err(Denial::Timeout)));
            }
            answers.extend(Self::drain_wakers(device, gpu, now));
        }
        answers
    }

    /// Serves the waiting wakes of `gpu` that fit now, in order.
    pub(super) fn drain_wakers(device: DeviceId, gpu: &mut Gpu, now: Instant) -> Vec<WakeAnswer> {
        let mut answers = Vec::new();
        // Wherever they are in the queue: members back on the device without their wake
        // (a park given up) are answered at once, with nothing to bring back and nothing
        // lent anew; members gone are dropped.
        let parked_still = |gpu: &Gpu, w: &Waker| {
            gpu.groups
                .get(&w.group)
                .and_then(|g| g.members.get(&w.conn))
                .map(|m| matches!(m.park, MemberPark::Parked | MemberPark::Parking))
        };
        let (keep, done): (VecDeque<Waker>, VecDeque<Waker>) =
            std::mem::take(&mut gpu.wakers).into_iter().partition(|w| parked_still(gpu, w) == Some(true));
        gpu.wakers = keep;
        for w in done.into_iter().filter(|w| parked_still(gpu, w).is_some()) {
            answers.push(w.answer(device, now, Ok((0, false))));
        }
        // Then in order, as long as the first fits.
        while let Some(w) = gpu.wakers.front().cloned() {
            let Some((bytes, restore)) = gpu.try_wake(&w.group, w.conn, now) else { break };
            answers.push(w.answer(device, now, Ok((bytes, restore))));
            gpu.wakers.pop_front();
        }
        answers
    }
}
