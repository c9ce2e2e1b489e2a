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
//! - A group that becomes active (it had not wanted for a while) joins with a pass one
//!   lease behind the others': it is owed, so a holder that has held at least [`MIN_HOLD`]
//!   is cut short for it. A group that wants again after giving its lease back cuts the
//!   holder's lease to end once the holder's running pass reaches its own (at once if it
//!   already has). A latency-sensitive server thus waits for the holder's drain (which the
//!   holder's shim keeps to a few ms), not for its lease; groups that keep wanting
//!   (they say so in `LeaseDone`) take turns by their planned leases.
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
        // A group back from idleness (long, or since it gave its last lease back) may not
        // bank credit from its idle time, but it keeps up to one lease of what it did not
        // use: its pass is brought up to the others' less one lease, never lowered. A
        // server that uses less than its request thus goes ahead of a flood at once; one
        // that uses more than its request still takes turns by it (its own pass is higher).
        let active_lately = c.last_seen.is_some_and(|t| now.saturating_duration_since(t) < PERIOD);
        let credit = planned.as_secs_f64() / c.weight();
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
                let need = planned.as_secs_f64().min(c.cap());
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
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;
    use gpufrac_common::ComputeShare;

    fn share(request: u16, limit: u16) -> Option<ComputeSpec> {
        Some(ComputeSpec {
            request: ComputeShare::from_per_mille(request).unwrap(),
            limit: ComputeShare::from_per_mille(limit).unwrap(),
        })
    }

    /// A GPU with compute groups on connections 1.. (pids 101..), each its own group.
    fn gpu_with(shares: &[Option<ComputeSpec>]) -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for (i, &compute) in shares.iter().enumerate() {
            let conn = i as u64 + 1;
            p.hello(conn, Peer { pid: 100 + conn as u32, compute, ..peer(&format!("g{conn}"), 1000) });
            p.register(conn, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        }
        p
    }

    #[test]
    fn compute_requests_past_the_whole_gpu_are_refused_naming_the_variable() {
        let mut p = gpu_with(&[share(600, 1000), None]);
        p.hello(9, Peer { pid: 109, compute: share(500, 500), ..peer("late", 1000) });
        let e = p.register(9, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
        assert!(e.contains("GPUFRAC_COMPUTE_REQUEST (50%)") && e.contains("60%"), "{e}");
        p.hello(10, Peer { pid: 110, compute: share(400, 400), ..peer("fits", 1000) });
        p.register(10, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        // A member must declare its group's share.
        p.hello(11, Peer { pid: 111, compute: share(100, 100), ..peer("g1", 1000) });
        let e = p.register(11, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
        assert!(e.contains("60%/100%") && e.contains("10%/10%"), "{e}");
    }

    fn spec(request: u16, limit: u16) -> ComputeSpec {
        share(request, limit).unwrap()
    }

    /// A simulated GPU driven by the book: groups `busy` (they always have work) or not,
    /// each holder using the GPU for its whole lease plus `drain` (its work running past the
    /// end), answering `LeaseDone` then. Returns the time each group held over `run`, and
    /// the GPU's idle time.
    fn simulate(
        book: &mut LeaseBook,
        busy: &[(&str, bool)],
        drain: Duration,
        run: Duration,
    ) -> (Vec<f64>, f64) {
        let start = Instant::now();
        let mut now = start;
        let mut held = vec![0.0; busy.len()];
        let mut idle = 0.0;
        for &(g, b) in busy {
            if b {
                book.want(g, now);
            }
        }
        while now < start + run {
            let next = book.step(now);
            match book.holder.clone() {
                Some(h) if h.open => {
                    // Open: it runs until the end (nothing else wants).
                    let i = busy.iter().position(|&(g, _)| g == h.group).unwrap();
                    held[i] += (start + run - now).as_secs_f64();
                    break;
                }
                Some(h) => {
                    let i = busy.iter().position(|&(g, _)| g == h.group).unwrap();
                    let end = h.until + drain;
                    held[i] += (end - now).as_secs_f64();
                    now = end;
                    assert!(book.done(&h.group, h.lease, drain, busy[i].1, now));
                }
                None => {
                    let to = next.unwrap_or(start + run).min(start + run);
                    idle += (to - now).as_secs_f64();
                    now = to.max(now + Duration::from_micros(10));
                }
            }
        }
        (held, idle)
    }

    #[test]
    fn saturating_groups_hold_the_gpu_by_their_requests_and_the_unrequested_time_alike() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
        let (held, idle) =
            simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
        let split = held[0] / (held[0] + held[1]);
        assert!((split - 0.3).abs() < 0.01 && idle < 0.01, "{held:?} idle {idle}");
        // Drains are charged: a group whose work runs 5 ms past each lease still gets its
        // request's part of the time, not more.
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
        let (held, _) = simulate(
            &mut book,
            &[("a", true), ("b", true)],
            Duration::from_millis(5),
            Duration::from_secs(10),
        );
        let split = held[0] / (held[0] + held[1]);
        assert!((split - 0.3).abs() < 0.01, "{held:?}");
        // Requests of 10% and 20% leave 70% unrequested: shared 1:2 as well.
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(100, 1000)), ("b".into(), spec(200, 1000))], now);
        let (held, idle) =
            simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
        let split = held[0] / (held[0] + held[1]);
        assert!((split - 1.0 / 3.0).abs() < 0.01 && idle < 0.01, "{held:?} idle {idle}");
    }

    #[test]
    fn a_group_alone_gets_the_open_gpu_or_its_limit_and_never_more() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
        book.want("a", now);
        book.step(now);
        assert!(matches!(book.grant("a", now), Grant::Open { .. }));
        assert!(book.open());
        // A limit of 50%, alone: half the time, the GPU idle the other half.
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(200, 500))], now);
        let (held, idle) = simulate(&mut book, &[("a", true)], Duration::ZERO, Duration::from_secs(10));
        assert!((held[0] / 10.0 - 0.5).abs() < 0.01 && (idle / 10.0 - 0.5).abs() < 0.01, "{held:?} {idle}");
        // Its drains count against the limit too.
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(200, 500))], now);
        let (held, _) =
            simulate(&mut book, &[("a", true)], Duration::from_millis(3), Duration::from_secs(10));
        assert!((held[0] / 10.0 - 0.5).abs() < 0.02, "{held:?}");
        // Beside a busy neighbour, a limit of 20% with a request of 20% gets 20%, the
        // neighbour the rest.
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(200, 200)), ("b".into(), spec(200, 1000))], now);
        let (held, idle) =
            simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
        assert!((held[0] / 10.0 - 0.2).abs() < 0.01 && idle < 0.05, "{held:?} {idle}");
    }

    #[test]
    fn a_group_with_nothing_to_run_gives_back_and_the_next_one_goes_at_once() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(500, 1000)), ("b".into(), spec(500, 1000))], now);
        book.want("a", now);
        book.want("b", now);
        book.step(now);
        let Grant::Held { lease, until } = book.grant("a", now) else { panic!("{book:?}") };
        assert_eq!(until - now, PERIOD / 2);
        assert_eq!(book.grant("b", now), Grant::Wait);
        // a is done after 2 ms with nothing more: b holds at once.
        let t = now + Duration::from_millis(2);
        assert!(book.done("a", lease, Duration::ZERO, false, t));
        assert!(!book.done("a", lease, Duration::ZERO, false, t), "a lease is done once");
        book.step(t);
        // Alone wanting, b's limit is the whole GPU, but a held it just now: a lease (its
        // work in flight bounded), not the open GPU.
        let Grant::Held { lease: b_lease, until } = book.grant("b", t) else { panic!("{book:?}") };
        assert_eq!(until - t, PERIOD);
        // A late answer for an old lease changes nothing.
        assert!(!book.done("b", lease, Duration::ZERO, false, t));
        assert!(matches!(book.grant("b", t), Grant::Held { .. }));
        // Leases while a is quiet; once it has been quiet for OPEN_AFTER_QUIET, open.
        assert!(book.done("b", b_lease, Duration::ZERO, true, until));
        book.step(until);
        assert!(matches!(book.grant("b", until), Grant::Held { .. }));
        let Grant::Held { lease: b_lease, until } = book.grant("b", until) else { unreachable!() };
        let quiet = t + OPEN_AFTER_QUIET;
        assert!(book.done("b", b_lease, Duration::ZERO, true, quiet));
        book.step(quiet);
        assert!(matches!(book.grant("b", quiet), Grant::Open { .. }), "{until:?} {book:?}");
    }

    #[test]
    fn a_group_that_becomes_active_cuts_the_holder_short_but_turn_takers_do_not() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("flood".into(), spec(500, 1000)), ("server".into(), spec(500, 1000))], now);
        book.want("flood", now);
        book.step(now);
        assert!(matches!(book.grant("flood", now), Grant::Open { .. }));
        // The server becomes active 100 ms later: the open GPU becomes leases, and the
        // flood's is cut to end now (it held longer than MIN_HOLD).
        let t = now + Duration::from_millis(100);
        assert!(book.want("server", t));
        assert_eq!(book.grant("flood", t), Grant::Wait, "cut short");
        assert!(book.holds("flood"), "until its work finished");
        assert_eq!(book.step(t), Some(t + DRAIN_GRACE));
        let flood_lease = book.holder.as_ref().unwrap().lease;
        // Its drain done 3 ms later, the server holds: within one period of its want.
        let t2 = t + Duration::from_millis(3);
        assert!(book.done("flood", flood_lease, Duration::ZERO, true, t2));
        book.step(t2);
        assert!(matches!(book.grant("server", t2), Grant::Held { .. }));
        // The flood, wanting again at once, does not cut the server.
        assert!(!book.want("flood", t2));
        // A holder that never answers loses the lease after its end and the grace.
        let Grant::Held { until, .. } = book.grant("server", t2) else { panic!() };
        assert_eq!(book.grant("server", until), Grant::Wait);
        let t3 = until + DRAIN_GRACE;
        book.step(t3);
        assert!(!book.holds("server"));
        // The flood alone wants it, but the server was just here: a lease, not the open GPU.
        assert!(matches!(book.grant("flood", t3), Grant::Held { .. }), "{book:?}");
    }

    #[test]
    fn a_group_back_from_giving_its_lease_back_cuts_a_flood_while_it_used_less_than_its_request() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("flood".into(), spec(500, 1000)), ("server".into(), spec(500, 1000))], now);
        book.want("flood", now);
        // Requests about every 10 ms, each holding 3 ms (every fifth 15 ms: requests queued
        // behind each other), given back: the flood wants always.
        let mut t = now;
        for round in 0..50 {
            book.step(t);
            if let Some(h) = book.holder.clone().filter(|h| h.group == "flood") {
                // The flood holds; the server wants 5 ms into its turn.
                let at = t + Duration::from_millis(5);
                book.want("server", at);
                let Grant::Held { until, .. } = book.grant("flood", h.since) else { panic!("{book:?}") };
                let cut = book.holder.as_ref().unwrap().until;
                assert!(cut <= at + MIN_HOLD, "round {round}: the flood's lease to {until:?} was not cut");
                t = cut + Duration::from_millis(2);
                assert!(book.done("flood", h.lease, Duration::from_millis(2), true, t));
                book.step(t);
            }
            let Grant::Held { lease, .. } = book.grant("server", t) else {
                panic!("round {round}: {book:?}")
            };
            t += Duration::from_millis(if round % 5 == 4 { 15 } else { 3 });
            assert!(book.done("server", lease, Duration::ZERO, false, t));
        }
        // A server that held long (50 ms, more than its request while the flood wanted)
        // takes turns by its request: it waits for the flood's running pass to reach its own.
        book.step(t);
        let h = book.holder.clone().unwrap();
        assert_eq!(h.group, "flood");
        book.want("server", t + Duration::from_millis(5));
        t += Duration::from_millis(7);
        assert!(book.done("flood", h.lease, Duration::from_millis(2), true, t));
        book.step(t);
        let Grant::Held { lease, .. } = book.grant("server", t) else { panic!("{book:?}") };
        // Its 20 ms lease, and 30 ms of drain.
        t += Duration::from_millis(50);
        assert!(book.done("server", lease, Duration::from_millis(30), false, t));
        book.step(t);
        assert!(book.holds("flood"));
        let t2 = t + Duration::from_millis(1);
        assert!(book.want("server", t2), "its turn comes within the flood's lease");
        let cut = book.holder.as_ref().unwrap().until;
        assert!(cut > t2 + Duration::from_millis(20), "it held 50 ms: the flood goes on, to {:?}", cut - t2);
    }

    #[test]
    fn a_lease_is_charged_its_length_and_its_drain_not_a_late_answer() {
        let now = Instant::now();
        let mut book = LeaseBook::default();
        book.sync(&[("a".into(), spec(500, 1000)), ("b".into(), spec(500, 1000))], now);
        book.want("a", now);
        book.want("b", now);
        book.step(now);
        let Grant::Held { lease, until } = book.grant("a", now) else { panic!("{book:?}") };
        let before = book.groups["a"].pass;
        // Its drain took 2 ms; its answer arrived 10 ms after the end.
        assert!(book.done("a", lease, Duration::from_millis(2), true, until + Duration::from_millis(10)));
        let charged = (book.groups["a"].pass - before) * 0.5;
        let expected = (until - now + Duration::from_millis(2)).as_secs_f64();
        assert!((charged - expected).abs() < 1e-9, "charged {charged} s, expected {expected} s");
    }

    #[test]
    fn members_are_told_once_per_change_and_a_group_is_done_when_all_its_members_are() {
        let mut p = gpu_with(&[share(300, 1000), share(700, 1000), None]);
        // A second member of g1.
        p.hello(4, Peer { pid: 104, compute: share(300, 1000), ..peer("g1", 1000) });
        p.register(4, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        let now = Instant::now();
        let (orders, _) = p.compute_step(now);
        // Everyone with a share is told to wait; the process without one is told nothing.
        let mut told: Vec<ConnId> = orders.iter().map(|o| o.0).collect();
        told.sort();
        assert_eq!(told, vec![1, 2, 4]);
        assert!(orders.iter().all(|o| o.2 == LeaseState::Wait));
        assert!(p.compute_step(now).0.is_empty(), "nothing changed");
        p.compute_want(1, GPU, now);
        p.compute_want(2, GPU, now);
        let (orders, next) = p.compute_step(now);
        let held: Vec<_> = orders.iter().filter(|o| matches!(o.2, LeaseState::Held { .. })).collect();
        assert_eq!(held.len(), 2, "both members of g1 (lowest pass, first by name): {orders:?}");
        let LeaseState::Held { lease, micros } = held[0].2 else { unreachable!() };
        assert_eq!(micros as u128, (PERIOD * 3 / 10).as_micros());
        assert_eq!(next, Some(now + PERIOD * 3 / 10));
        let t = now + Duration::from_millis(12);
        p.compute_done(1, GPU, lease, 2000, false, t);
        assert!(p.gpus[&GPU].leases.holds("g1"), "one member done, the other not yet");
        p.compute_done(4, GPU, lease, 500, false, t);
        assert!(!p.gpus[&GPU].leases.holds("g1"));
        let (orders, _) = p.compute_step(t);
        // g2 alone wants, its limit the whole GPU; g1 held it just now: a lease for g2;
        // g1's members told to wait.
        let g2_lease = orders.iter().find_map(|o| match o {
            (2, _, LeaseState::Held { lease, .. }) => Some(*lease),
            _ => None,
        });
        assert!(g2_lease.is_some(), "{orders:?}");
        assert!(orders.contains(&(1, GPU, LeaseState::Wait)) && orders.contains(&(4, GPU, LeaseState::Wait)));
        assert_eq!(
            p.status().gpus[0].processes.iter().find(|p| p.pid == 102).unwrap().compute_state,
            "holding"
        );
        // g1 quiet for OPEN_AFTER_QUIET: g2's next turn is the open GPU.
        let quiet = t + OPEN_AFTER_QUIET;
        p.compute_done(2, GPU, g2_lease.unwrap(), 0, true, quiet);
        let (orders, _) = p.compute_step(quiet);
        assert!(orders.iter().any(|o| o.0 == 2 && matches!(o.2, LeaseState::Open { .. })), "{orders:?}");
        let s = p.status();
        let g2 = s.gpus[0].processes.iter().find(|p| p.pid == 102).unwrap();
        assert_eq!(g2.compute_state, "open");
        let g1 = s.gpus[0].processes.iter().find(|p| p.pid == 101).unwrap();
        assert_eq!(g1.compute_state, "idle");
        assert!(g1.compute_held_pm > 0, "it held 12 ms of the last second");
    }
}
