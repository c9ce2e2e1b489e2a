//! Compute shares: each group's guaranteed share of a GPU's time (its compute request)
//! and the most it may take (its compute limit), kept by **time leases**: per GPU, one
//! group at a time holds the GPU; the others' calls wait at their shims' gates. What a
//! group took is the time it held the lease, never a utilization sample (under
//! time-slicing NVML reads every saturating process near 100%, which is no share).
//!
//! The rule, per GPU ([`LeaseBook`], pure state, the clock passed in):
//! - Groups with a compute share that have work to start *want* the GPU (their shim says
//!   `Want`). One of them holds it at a time. A lease is handed on *serially*: the holder's
//!   shim closes its gate at the lease's end, waits for the work it started to finish, and
//!   says `LeaseDone`; only then does the next group get its lease. So the holder's drain
//!   (its work running past the lease's end) is charged to it exactly, and it never shares
//!   the GPU's time with the next holder (under time-slicing that time could not be told
//!   apart). A shim that never answers loses the lease [`DRAIN_GRACE`] after its end.
//! - Leases are weighted: a [`PERIOD`] is split among the wanting groups by their
//!   requests, so the unrequested time goes to them in the same proportions. Who is next is
//!   decided by stride accounting: each group's *pass* grows by the time it was charged
//!   over its request; the lowest pass goes next. Over time each wanting group gets its
//!   request's part of what the wanting groups held, whatever the lengths of single leases
//!   (cut short, given back early, run long by a drain).
//! - A limit is a token bucket: a group accrues its limit's share of the wall clock, at
//!   most one period's worth, and a lease takes what it held; a group without enough
//!   waits, even while the GPU would be idle. Over any stretch it holds at most its limit
//!   of the time (plus one period's burst).
//! - A group with nothing to run gives the lease back at once (its shim sees its work done
//!   and no new call), so a group alone gets up to its limit and idle time is never kept.
//! - A group that wants again (it had not wanted for a while, or gave its lease back)
//!   keeps what it did not use of its request, up to [`OWED_LEASES`] of its leases: its
//!   pass is brought up to the others' less that, never lowered. Owed, it cuts the holder
//!   short once the holder has held [`MIN_HOLD`]; otherwise it cuts the holder's lease to
//!   end once the holder's running pass reaches its own. A latency-sensitive server thus
//!   waits for the holder's drain (which the holder's shim keeps to a few ms), not for its
//!   lease; groups that keep wanting (they say so in `LeaseDone`) take turns by their
//!   planned leases.
//! - When one group alone wants the GPU and its limit is the whole GPU, the GPU is *open*
//!   to it: no lease, its calls pass untouched, until another group wants it. Only once
//!   the others have been quiet for [`OPEN_AFTER_QUIET`], though: a leased holder's shim
//!   bounds its work in flight (a few ms), an open one's does not, and a
//!   latency-sensitive neighbour that cuts it would wait for all it queued.
//!
//! Processes without compute settings are never gated, and not planned around.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, LeaseState, MAX_LEASE_US};
use gpufrac_common::ComputeSpec;

use super::{uuid_string, ConnId, Gpu, Peer, Policy};

/// The period split among the wanting groups: long enough that a hand-over (a message
/// each way) costs little of it, short enough that a waiting group's turn comes soon.
pub const PERIOD: Duration = Duration::from_millis(40);
/// A holder keeps a lease at least this long before a group that becomes active cuts it.
pub const MIN_HOLD: Duration = Duration::from_micros(250);
/// A group alone is given the open GPU only once every other group with a share on it has
/// neither wanted nor held it for this long: an open holder's work in flight is not
/// bounded, and a neighbour that comes back would wait for all of it.
pub const OPEN_AFTER_QUIET: Duration = Duration::from_secs(1);
/// A limited group's lease starts once its bucket is this short of full (its lease is
/// what the bucket holds then): the arbiter's wake-up for the refill comes a ms or two
/// late on a busy machine, and a bucket already at its cap would lose what accrued
/// meanwhile (a limit of 50% alone got 49.3% of the time, not 50%).
pub const REFILL_SLACK: Duration = Duration::from_millis(1);
/// What a group that wants the GPU again may be owed, in its leases: what it did not use
/// of its request while it did not want, at most this much. One lease was too little for
/// a latency server whose Poisson requests bunch up now and then: past one lease it took
/// turns with a flood's 20 ms leases until its queue was gone, and its p99 read 12x that
/// alone. Three leases (60 ms of a 50/50 pair's GPU) hold a burst of several requests in
/// a row, and bound how long an owed group keeps the others waiting.
pub const OWED_LEASES: f64 = 3.0;
/// How long after its lease's end the arbiter waits for a holder's `LeaseDone`.
pub const DRAIN_GRACE: Duration = Duration::from_millis(250);
/// The stretch over which status shows what each group held.
const SHOWN_OVER: Duration = Duration::from_secs(1);
/// Weight of a group with no request (a limit alone): it runs when no requester wants.
const NO_REQUEST_WEIGHT: f64 = 0.001;

/// What a group may do, as the book says: told to its members as a [`LeaseState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// The GPU is open to it (turn `lease`).
    Open {
        /// The turn's number.
        lease: u32,
    },
    /// It holds lease `lease` until `until`.
    Held {
        /// The lease's number.
        lease: u32,
        /// Its end.
        until: Instant,
    },
    /// Its calls wait.
    Wait,
}

impl Grant {
    /// As told to a shim at `now`.
    pub fn state(self, now: Instant) -> LeaseState {
        match self {
            Grant::Open { lease } => LeaseState::Open { lease },
            Grant::Held { lease, until } => LeaseState::Held {
                lease,
                micros: (until.saturating_duration_since(now).as_micros() as u32).clamp(1, MAX_LEASE_US),
            },
            Grant::Wait => LeaseState::Wait,
        }
    }

    /// What tells two grants apart for the shim (a lease told once is not told again).
    fn key(self) -> (u8, u32) {
        match self {
            Grant::Open { lease } => (0, lease),
            Grant::Held { lease, .. } => (1, lease),
            Grant::Wait => (2, 0),
        }
    }
}

#[derive(Debug, Clone)]
struct Contender {
    spec: ComputeSpec,
    /// It has work to start and holds nothing.
    wanting: bool,
    /// Stride accounting: time charged over its weight, in seconds.
    pass: f64,
    /// Its limit's bucket, in seconds of GPU time (at most one period of its limit).
    budget: f64,
    /// When the bucket was last filled.
    filled: Instant,
    /// What it held lately (start, end), for status.
    held: VecDeque<(Instant, Instant)>,
    /// When it last held or wanted the GPU: a group idle since long ago becomes active.
    last_seen: Option<Instant>,
    /// Since when it wants the GPU, and whether it became active then (for the log).
    wanted_since: Option<(Instant, bool)>,
}

impl Contender {
    fn weight(&self) -> f64 {
        self.spec.request.fraction().max(NO_REQUEST_WEIGHT)
    }
    fn limited(&self) -> bool {
        self.spec.limit.per_mille() < 1000
    }
    fn cap(&self) -> f64 {
        self.spec.limit.fraction() * PERIOD.as_secs_f64()
    }
    fn fill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.filled).as_secs_f64();
        self.budget = (self.budget + elapsed * self.spec.limit.fraction()).min(self.cap().max(self.budget));
        self.filled = now;
    }
}

#[derive(Debug, Clone)]
struct Holder {
    group: String,
    lease: u32,
    /// The GPU is open to it: no deadline.
    open: bool,
    since: Instant,
    until: Instant,
}

/// One GPU's leases: who holds it, who waits, what each was charged.
#[derive(Debug, Clone, Default)]
pub struct LeaseBook {
    groups: BTreeMap<String, Contender>,
    holder: Option<Holder>,
    last_lease: u32,
    /// Whether the GPU was last said open (true) or leased (false), for the log.
    shown_open: Option<bool>,
}

impl LeaseBook {
    /// Makes the book's groups those with compute shares on the GPU now.
    pub fn sync(&mut self, groups: &[(String, ComputeSpec)], now: Instant) {
        self.groups.retain(|name, _| groups.iter().any(|(g, _)| g == name));
        for (name, spec) in groups {
            let vt = self.virtual_time(None);
            let c = self.groups.entry(name.clone()).or_insert_with(|| Contender {
                spec: *spec,
                wanting: false,
                pass: vt,
                budget: spec.limit.fraction() * PERIOD.as_secs_f64(),
                filled: now,
                held: VecDeque::new(),
                last_seen: None,
                wanted_since: None,
            });
            c.spec = *spec;
        }
        if self.holder.as_ref().is_some_and(|h| !self.groups.contains_key(&h.group)) {
            self.holder = None;
        }
    }

    /// The lowest pass among the groups that want or hold the GPU (the holder's as it was
    /// at its lease's start), leaving out `except`; 0 if none.
    fn virtual_time(&self, except: Option<&str>) -> f64 {
        let holder = self.holder.as_ref();
        self.groups
            .iter()
            .filter(|(n, _)| Some(n.as_str()) != except)
            .filter(|(n, c)| c.wanting || holder.is_some_and(|h| &h.group == *n))
            .map(|(_, c)| c.pass)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0)
    }

    /// The lease a group gets now: its requests' part of a period among the groups that
    /// want or hold the GPU.
    fn planned(&self, group: &str) -> Duration {
        let Some(c) = self.groups.get(group) else { return PERIOD };
        let holder = self.holder.as_ref().map(|h| h.group.as_str());
        let total: f64 = self
            .groups
            .iter()
            .filter(|(n, g)| g.wanting || Some(n.as_str()) == holder || n.as_str() == group)
            .map(|(_, g)| g.weight())
            .sum();
        PERIOD.mul_f64((c.weight() / total.max(f64::MIN_POSITIVE)).min(1.0))
    }

    /// A process of `group` has work to start. Returns whether the holder is to be cut
    /// short for it (the book has done so).
    pub fn want(&mut self, group: &str, now: Instant) -> bool {
        if self.holder.as_ref().is_some_and(|h| h.group == group) {
            return false;
        }
        let planned = self.planned(group);
        let vt = self.virtual_time(Some(group));
        let Some(c) = self.groups.get_mut(group) else { return false };
        if c.wanting {
            return false;
        }
        c.wanting = true;
        // A group back from idleness (long, or since it gave its last lease back) keeps
        // what it did not use of its request, up to OWED_LEASES of its leases: its pass is
        // brought up to the others' less that, never lowered. A server that uses less than
        // its request thus goes ahead of a flood at once, and a burst of its requests is
        // served in a row; one that used more than its request takes turns by it (its own
        // pass is higher).
        let active_lately = c.last_seen.is_some_and(|t| now.saturating_duration_since(t) < PERIOD);
        let credit = OWED_LEASES * planned.as_secs_f64() / c.weight();
        c.pass = c.pass.max(vt - credit);
        c.last_seen = Some(now);
        c.wanted_since = Some((now, !active_lately));
        let pass = c.pass;
        let Some(h) = self.holder.as_mut() else { return false };
        let holder = &self.groups[&h.group];
        let running = holder.pass + now.saturating_duration_since(h.since).as_secs_f64() / holder.weight();
        if h.open {
            // Open: from now on its turn is a lease like everyone else's (the same number,
            // which its shim answers), cut at once for a group owed its turn.
            h.open = false;
            h.until = now + PERIOD;
        }
        if pass < running && h.until > now + MIN_HOLD {
            h.until = (h.since + MIN_HOLD).max(now);
            return true;
        }
        // Owed later in this lease: the lease ends when the holder's running pass reaches
        // the newcomer's (stride order, so neither gets more than its part), not at its
        // planned end, which a group back from giving its lease back would wait for.
        let owed_after = Duration::from_secs_f64(((pass - holder.pass) * holder.weight()).clamp(0.0, 1.0));
        let at = (h.since + owed_after).max(h.since + MIN_HOLD).max(now);
        if at < h.until {
            h.until = at;
            return true;
        }
        false
    }

    /// `group` is done with `lease` (its work finished after the lease's end, or it gave
    /// the lease back early); `more`: it wants the GPU again. False if that is not the lease
    /// it holds (a late answer).
    pub fn done(&mut self, group: &str, lease: u32, drain: Duration, more: bool, now: Instant) -> bool {
        match &self.holder {
            Some(h) if h.group == group && h.lease == lease => {}
            _ => return false,
        }
        self.release(now, Some(drain));
        if let Some(c) = self.groups.get_mut(group) {
            if more {
                c.wanting = true;
            }
        }
        true
    }

    /// `group` gets the GPU at `now`: says how long it waited.
    fn granted(&mut self, group: &str, lease: u32, length: Option<Duration>, now: Instant) {
        let Some(c) = self.groups.get_mut(group) else { return };
        c.wanting = false;
        let (since, became_active) = c.wanted_since.take().unwrap_or((now, false));
        let waited_us = now.saturating_duration_since(since).as_micros() as u64;
        let shown = crate::entitlement::shown_group(group);
        let us = length.map_or(0, |l| l.as_micros() as u64);
        if became_active {
            tracing::debug!(group = %shown, lease, us, waited_us, "a group that became active got the GPU");
        } else {
            tracing::debug!(group = %shown, lease, us, waited_us, "lease");
        }
    }

    /// Ends the holder's turn and charges it from its start to `now` at most.
    /// A lease that ran to its end is charged its length and the drain its shim measured,
    /// not the answer's way back (time the GPU was idle, lost to every group alike).
    fn release(&mut self, now: Instant, drain: Option<Duration>) {
        let Some(h) = self.holder.take() else { return };
        let Some(c) = self.groups.get_mut(&h.group) else { return };
        let mut held = now.saturating_duration_since(h.since);
        if let Some(drain) = drain.filter(|_| !h.open && now > h.until) {
            held = held.min(h.until.saturating_duration_since(h.since) + drain);
        }
        let held = held.as_secs_f64();
        c.pass += held / c.weight();
        // Charged first, then filled for the time it held (a holder's bucket is not
        // filled meanwhile, so nothing accrued during the lease is lost to the cap).
        c.budget -= held;
        c.fill(now);
        c.held.push_back((h.since, now));
        c.last_seen = Some(now);
        c.wanting = false;
    }

    /// Moves the book on to `now`: ends leases whose holder never answered, opens the GPU
    /// or hands out the next lease. Returns when it must look again at the latest.
    pub fn step(&mut self, now: Instant) -> Option<Instant> {
        let holder = self.holder.as_ref().map(|h| h.group.clone());
        for (name, c) in self.groups.iter_mut() {
            if Some(name) != holder.as_ref() {
                c.fill(now);
            }
            while c.held.front().is_some_and(|&(_, end)| now.saturating_duration_since(end) > SHOWN_OVER) {
                c.held.pop_front();
            }
        }
        if let Some(h) = &self.holder {
            if !h.open {
                let forfeit = h.until + DRAIN_GRACE;
                if now < forfeit {
                    return Some(if now < h.until { h.until } else { forfeit });
                }
                tracing::warn!(group = %crate::entitlement::shown_group(&h.group), lease = h.lease,
                    "a lease's holder did not say it was done {} ms after its end: the lease is taken back", DRAIN_GRACE.as_millis());
                self.release(now, None);
            } else if self.groups.iter().any(|(n, c)| c.wanting && *n != h.group) {
                // `want` turns an open GPU into leases; nothing to do here.
            } else {
                return None;
            }
        }
        let wanting: Vec<String> =
            self.groups.iter().filter(|(_, c)| c.wanting).map(|(n, _)| n.clone()).collect();
        if wanting.is_empty() {
            return None;
        }
        let neighbours_quiet =
            self.groups.iter().filter(|(n, _)| wanting.first() != Some(*n)).all(|(_, c)| {
                c.last_seen.is_none_or(|t| now.saturating_duration_since(t) >= OPEN_AFTER_QUIET)
            });
        if wanting.len() == 1 && !self.groups[&wanting[0]].limited() && neighbours_quiet {
            self.last_lease = self.last_lease.wrapping_add(1).max(1);
            let lease = self.last_lease;
            self.granted(&wanting[0], lease, None, now);
            self.holder =
                Some(Holder { group: wanting[0].clone(), lease, open: true, since: now, until: now });
            return None;
        }
        // The lowest pass among those whose limit lets them hold a lease now; groups short
        // of budget, with when they will have it.
        let mut refills: Vec<(f64, Instant)> = Vec::new();
        let mut best: Option<(f64, String, Duration)> = None;
        for name in &wanting {
            let planned = self.planned(name);
            let c = &self.groups[name];
            let mut lease = planned;
            if c.limited() {
                // A little short of a full bucket: the arbiter wakes for the refill a little
                // late, and a bucket full at its cap would lose what accrues meanwhile.
                let need = planned.as_secs_f64().min(c.cap() - REFILL_SLACK.as_secs_f64());
                if c.budget < need - 1e-6 {
                    let wait = (need - c.budget) / c.spec.limit.fraction();
                    refills.push((c.pass, now + Duration::from_secs_f64(wait)));
                    continue;
                }
                lease = Duration::from_secs_f64(planned.as_secs_f64().min(c.budget));
            }
            if best.as_ref().is_none_or(|(pass, _, _)| c.pass < *pass) {
                best = Some((c.pass, name.clone(), lease));
            }
        }
        let refill = refills.iter().map(|&(_, at)| at).min();
        let Some((pass, group, mut lease)) = best else { return refill };
        // A group owed more (a lower pass) that only lacks budget goes as soon as it has it:
        // this lease ends then, so its limit, not the others' turns, sets its pace.
        if let Some(at) = refills.iter().filter(|&&(p, _)| p < pass).map(|&(_, at)| at).min() {
            lease = lease.min(at.saturating_duration_since(now).max(MIN_HOLD));
        }
        self.last_lease = self.last_lease.wrapping_add(1).max(1);
        let lease = lease.max(Duration::from_micros(100));
        self.granted(&group, self.last_lease, Some(lease), now);
        let until = now + lease;
        self.holder = Some(Holder { group, lease: self.last_lease, open: false, since: now, until });
        Some(until)
    }

    /// What `group` may do now.
    pub fn grant(&self, group: &str, now: Instant) -> Grant {
        match &self.holder {
            Some(h) if h.group == group && h.open => Grant::Open { lease: h.lease },
            Some(h) if h.group == group && now < h.until => Grant::Held { lease: h.lease, until: h.until },
            _ => Grant::Wait,
        }
    }

    /// Whether the GPU is open to one group now.
    pub fn open(&self) -> bool {
        self.holder.as_ref().is_some_and(|h| h.open)
    }

    /// Whether `group` holds the GPU (open, leased, or draining past its lease).
    pub fn holds(&self, group: &str) -> bool {
        self.holder.as_ref().is_some_and(|h| h.group == group)
    }

    /// The lease `group` holds (or its turn while the GPU is open to it), also while its
    /// work drains past the end.
    pub fn lease_of(&self, group: &str) -> Option<u32> {
        self.holder.as_ref().filter(|h| h.group == group).map(|h| h.lease)
    }

    /// Whether `group` waits for a lease.
    pub fn wants(&self, group: &str) -> bool {
        self.groups.get(group).is_some_and(|c| c.wanting)
    }

    /// The share of the last second `group` held the GPU (0 to 1).
    pub fn held_share(&self, group: &str, now: Instant) -> f64 {
        let Some(c) = self.groups.get(group) else { return 0.0 };
        let from = now.checked_sub(SHOWN_OVER).unwrap_or(now);
        let mut held: f64 = c
            .held
            .iter()
            .map(|&(start, end)| end.saturating_duration_since(start.max(from)).as_secs_f64())
            .sum();
        if let Some(h) = self.holder.as_ref().filter(|h| h.group == group) {
            held += now.saturating_duration_since(h.since.max(from)).as_secs_f64();
        }
        (held / SHOWN_OVER.as_secs_f64()).min(1.0)
    }

    /// What `group` would be planned now: its requests' part among those that want or hold
    /// the GPU, capped by its limit (0 to 1).
    pub fn allowance(&self, group: &str) -> f64 {
        let Some(c) = self.groups.get(group) else { return 0.0 };
        let part = self.planned(group).as_secs_f64() / PERIOD.as_secs_f64();
        part.min(c.spec.limit.fraction())
    }
}

/// A lease state to tell a member: the connection, the GPU and the state.
pub type LeaseOrder = (ConnId, DeviceId, LeaseState);

/// A group's compute state on one GPU.
#[derive(Debug, Clone, Default)]
pub(super) struct GroupCompute {
    /// Its share; `None`: not controlled.
    pub spec: Option<ComputeSpec>,
    /// The lease whose members' `LeaseDone` are being gathered, and what they said: the
    /// group is done when every member is.
    pub done: Vec<ConnId>,
    /// Some member has more to run.
    pub more: bool,
    /// The longest drain its members reported for the last lease, in µs.
    pub last_drain_us: u32,
}

impl Policy {
    /// Whether any group has a compute share.
    pub fn compute_controlled(&self) -> bool {
        self.gpus.values().any(|g| g.groups.values().any(|group| group.compute.spec.is_some()))
    }

    /// Checks a registration's compute share: a new group's request must fit beside the
    /// other groups' requests (at most the whole GPU), a member must declare its group's.
    pub(super) fn admit_compute(gpu: &Gpu, device: &DeviceId, peer: &Peer) -> Result<(), String> {
        if let Some(group) = gpu.groups.get(&peer.group) {
            if group.compute.spec != peer.compute {
                return Err(format!(
                    "GPUFRAC_COMPUTE_REQUEST/GPUFRAC_COMPUTE_LIMIT are {} for GPUFRAC_GROUP {:?} but {} for this process: a group's processes must declare the same compute share",
                    shown(group.compute.spec),
                    crate::entitlement::shown_group(&peer.group),
                    shown(peer.compute),
                ));
            }
            return Ok(());
        }
        let Some(spec) = peer.compute else { return Ok(()) };
        let requested: u32 = gpu
            .groups
            .values()
            .filter_map(|g| g.compute.spec)
            .map(|s| u32::from(s.request.per_mille()))
            .sum();
        if requested + u32::from(spec.request.per_mille()) > 1000 {
            return Err(format!(
                "GPUFRAC_COMPUTE_REQUEST ({}) does not fit on GPU {}: {} of its time is guaranteed to other groups",
                spec.request,
                uuid_string(device),
                gpufrac_common::ComputeShare::from_per_mille(requested.min(1000) as u16).unwrap_or_default(),
            ));
        }
        Ok(())
    }

    /// A member of a group with a compute share has work to start on `device`.
    pub fn compute_want(&mut self, conn: ConnId, device: DeviceId, now: Instant) {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return };
        if gpu.groups[&group].compute.spec.is_none() {
            return;
        }
        if gpu.leases.want(&group, now) {
            tracing::debug!(gpu = %uuid_string(&device), group = %crate::entitlement::shown_group(&group),
                "a group that wants the GPU cuts the holder's lease short");
        }
    }

    /// A member is done with `lease` on `device`; the group is done when all its members
    /// are.
    pub fn compute_done(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        lease: u32,
        drain_us: u32,
        more: bool,
        now: Instant,
    ) {
        let Some((gpu, name)) = self.member_gpu(conn, &device) else { return };
        if gpu.leases.lease_of(&name) != Some(lease) {
            // A late answer (the lease was taken back meanwhile): what it still wants
            // counts.
            if more {
                gpu.leases.want(&name, now);
            }
            return;
        }
        let group = gpu.groups.get_mut(&name).expect("member_gpu found the group");
        let c = &mut group.compute;
        if !c.done.contains(&conn) {
            c.done.push(conn);
            c.more |= more;
            c.last_drain_us = c.last_drain_us.max(drain_us);
        }
        if group.members.keys().all(|m| c.done.contains(m)) {
            let more = c.more;
            c.done.clear();
            c.more = false;
            let drain = Duration::from_micros(c.last_drain_us.into());
            if gpu.leases.done(&name, lease, drain, more, now) {
                tracing::debug!(gpu = %uuid_string(&device), group = %crate::entitlement::shown_group(&name),
                    lease, drain_us = c.last_drain_us, more, "lease done");
            }
            c.last_drain_us = 0;
        }
    }

    /// Moves every GPU's leases on to `now`; returns what to tell which member (only what
    /// changed since it was last told) and when to look again at the latest.
    pub fn compute_step(&mut self, now: Instant) -> (Vec<LeaseOrder>, Option<Instant>) {
        let mut orders = Vec::new();
        let mut next: Option<Instant> = None;
        for (device, gpu) in self.gpus.iter_mut() {
            let specs: Vec<(String, ComputeSpec)> =
                gpu.groups.iter().filter_map(|(n, g)| g.compute.spec.map(|s| (n.clone(), s))).collect();
            if specs.is_empty() && gpu.leases.groups.is_empty() {
                continue;
            }
            gpu.leases.sync(&specs, now);
            if let Some(at) = gpu.leases.step(now) {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
            let mode = gpu.leases.holder.as_ref().map(|h| h.open);
            if let Some(open) = mode.filter(|&m| Some(m) != gpu.leases.shown_open) {
                gpu.leases.shown_open = Some(open);
                let holder =
                    gpu.leases.holder.as_ref().map(|h| crate::entitlement::shown_group(&h.group).to_owned());
                if open {
                    tracing::info!(gpu = %uuid_string(device), group = holder.unwrap_or_default(),
                        "GPU open: one group with a compute share wants it, its limit the whole GPU; no leases");
                } else {
                    tracing::info!(gpu = %uuid_string(device), "GPU leased: groups with compute shares take turns");
                }
            }
            for (name, group) in gpu.groups.iter_mut() {
                if group.compute.spec.is_none() {
                    continue;
                }
                let grant = gpu.leases.grant(name, now);
                for (&conn, member) in group.members.iter_mut() {
                    if member.lease_told != Some(grant.key()) {
                        member.lease_told = Some(grant.key());
                        orders.push((conn, *device, grant.state(now)));
                    }
                }
            }
        }
        (orders, next)
    }

    /// A group's compute state for status: held share, allowance and state.
    pub(super) fn compute_shown(gpu: &Gpu, group: &str, now: Instant) -> (f64, f64, &'static str) {
        let leases = &gpu.leases;
        let state = match leases.grant(group, now) {
            Grant::Open { .. } => "open",
            Grant::Held { .. } => "holding",
            Grant::Wait if leases.holds(group) => "draining",
            Grant::Wait if leases.wants(group) => "waiting",
            Grant::Wait => "idle",
        };
        (leases.held_share(group, now), leases.allowance(group), state)
    }
}

fn shown(spec: Option<ComputeSpec>) -> String {
    spec.map_or("unset".to_owned(), |s| format!("{}/{}", s.request, s.limit))
}

#[cfg(test)]
mod tests;
