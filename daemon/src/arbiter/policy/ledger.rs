//! Who holds what: admission of a group's request, registration (also after an arbiter
//! restart), memory given back, processes gone, and memory used outside gpufrac.

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use gpufrac_common::protocol::DeviceId;

use super::{gib, uuid_string, Answer, ConnId, Group, Member, Policy, Residency};

impl Policy {
    /// Registers `conn` on a device. A new group is admitted if its request fits beside
    /// the other groups' requests and the memory used outside gpufrac: memory lent out is
    /// a loan and never keeps a request out (it is taken back, see `reclaim`). A process
    /// re-registering after an arbiter restart keeps what it holds. A parkable group is
    /// admitted under its own rule (see [`super::park`]); `Ok(true)`: admitted parked.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        total: u64,
        request: u64,
        limit: u64,
        held: u64,
        granted: u64,
        host_bytes: u64,
    ) -> Result<bool, String> {
        let peer = self.peers.get(&conn).ok_or("Register before Hello")?.clone();
        let gpu = self
            .gpus
            .get_mut(&device)
            .ok_or_else(|| format!("GPU {} is not managed by this arbiter", uuid_string(&device)))?;
        let (request, limit, held) = checked_sizes(gpu, &device, total, request, limit, held)?;
        // What a re-registering process says it was lent is believed only up to what NVML
        // shows it uses on this GPU (once NVML has answered): a claim cannot skip admission
        // nor put in the ledger memory nobody holds.
        let granted =
            if gpu.observed { granted.min(gpu.seen.get(&peer.pid).copied().unwrap_or(0)) } else { granted };
        // A process the arbiter cannot signal is lent nothing (see `acquire`), nor believed
        // to hold a loan or to keep swapped-out memory.
        let (granted, host_bytes) = if peer.signalable { (granted, host_bytes) } else { (0, 0) };
        let outside = Outside::for_peer(gpu, &peer, granted);
        let now = Instant::now();
        Self::admit_compute(gpu, &device, &peer)?;
        let rule = (self.oversubscribe, self.swap_limit);
        let parked = admit_group(gpu, &device, &peer, (request, limit, held), &outside, rule, now)?;
        // Lent memory the GPU has room for now (its own memory counted as outside until
        // it is registered is not someone else's).
        let available =
            (gpu.total as i128 - gpu.guaranteed() as i128 - gpu.burst() as i128 - outside.others as i128)
                .max(0) as u64;
        let host_now = self.host_committed_except(&device, conn);
        let swap_limit = self.swap_limit;
        let gpu = self.gpus.get_mut(&device).ok_or("GPU vanished")?;
        let group = gpu.groups.get_mut(&peer.group).ok_or("group vanished")?;
        // What a re-registering process says it was lent cannot pass its group's limit nor
        // what the GPU has room for; what it keeps in host RAM is within its group's limit
        // and what the node's swap limit leaves.
        let granted = granted.min(group.room()).min(available);
        let reported = host_bytes.min(group.limit);
        let host_bytes = reported.min(swap_limit.saturating_sub(host_now));
        let mut member = Member::new(held, granted, host_bytes, now);
        member.host_reported = reported;
        member.swaps = peer.resolver == gpufrac_common::Resolver::Swap && peer.signalable;
        if let Some(old) = group.members.get(&conn) {
            // Registered again on the same connection: where its memory is stays as it was.
            member.park = old.park;
            member.parked_bytes = old.parked_bytes;
            member.parked_grant = old.parked_grant;
            member.left_on_device = old.left_on_device;
            member.checkpointed = old.checkpointed;
            member.wake_asked = old.wake_asked;
        } else if parked {
            member.park = super::park::MemberPark::Parked;
        }
        group.members.insert(conn, member);
        // Its memory is in the ledger now, no longer outside it.
        gpu.outside.retain(|&(pid, _)| pid != peer.pid);
        Ok(parked)
    }

    /// Host RAM committed to swapped-out memory on the node (as [`Policy::host_committed`]
    /// counts it), leaving out `conn` on `device`.
    pub(super) fn host_committed_except(&self, device: &DeviceId, conn: ConnId) -> u64 {
        self.gpus
            .iter()
            .flat_map(|(id, g)| g.members().map(move |(_, c, m)| (id, c, m)))
            .filter(|&(id, c, _)| !(id == device && c == conn))
            .fold(0u64, |sum, (_, _, m)| sum.saturating_add(m.host_committed()))
    }

    /// What NVML lists on `device` now, `(pid, bytes used)`: the memory of processes not
    /// registered here is kept out of what is lent, and what groups use beyond what their
    /// shims charged is charged to them. Returns the bursts that now fit.
    pub fn observe_processes(
        &mut self,
        device: DeviceId,
        listed: &[(u32, u64)],
        now: Instant,
    ) -> Vec<Answer> {
        let Some(gpu) = self.gpus.get_mut(&device) else { return Vec::new() };
        let registered: HashSet<u32> =
            gpu.members().filter_map(|(_, conn, _)| self.peers.get(&conn).map(|p| p.pid)).collect();
        // No process uses more than the GPU has (nor can a bad listing overflow the sums);
        // outside gpufrac, its headroom too.
        let total = gpu.total.saturating_add(gpu.headroom);
        gpu.observed = true;
        gpu.seen = listed.iter().map(|&(pid, bytes)| (pid, bytes.min(total))).collect();
        gpu.outside = listed
            .iter()
            .filter(|&&(pid, bytes)| bytes > 0 && !registered.contains(&pid))
            .map(|&(pid, bytes)| (pid, bytes.min(total)))
            .collect();
        // What a group's processes use beyond what its shims can have charged is charged
        // to the group, never taken for memory outside gpufrac (see [`super::backstop`]).
        gpu.compare(device, &self.peers, now, &mut self.findings);
        if let Some(bytes) = gpu.confirm_context() {
            tracing::info!(gpu = %gpufrac_common::gpu_uuid::format(&device), bytes, "learnt what a context takes on this GPU");
        }
        Self::drain(device, gpu, now)
    }

    /// Gives back burst memory (its burst is over); returns the queued bursts that now fit.
    pub fn release(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        bytes: u64,
        held: u64,
        now: Instant,
    ) -> Vec<Answer> {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return Vec::new() };
        if let Some(g) = gpu.groups.get_mut(&group) {
            // Memory comes back when a burst is over: the group is no longer growing.
            g.last_ask = None;
        }
        gpu.end_burst(&group);
        let held = held.min(gpu.total);
        let owed = gpu.open_debt();
        let mut given = 0;
        if let Some(m) = gpu.member_mut(&group, conn) {
            given = bytes.min(m.granted);
            m.granted -= given;
            m.held = held;
            // Being ended or swapped out for the debt: counted there, not here.
            if m.ended_for_debt || m.residency == Residency::SwappingOut {
                given = 0;
            }
        }
        gpu.repaid.given_back = gpu.repaid.given_back.saturating_add(given.min(owed));
        // Its burst over here may be over on its other GPUs too: their queues may move.
        let freed = self.share_bursts(now);
        let mut answers = Vec::new();
        for device in std::iter::once(device).chain(freed.into_iter().filter(|&d| d != device)) {
            if let Some(gpu) = self.gpus.get_mut(&device) {
                answers.extend(Self::drain(device, gpu, now));
            }
        }
        answers
    }

    /// A connection closed (the process exited or was killed): everything it held or
    /// was lent comes back at once, and a group without members frees its request.
    pub fn disconnect(&mut self, conn: ConnId, now: Instant) -> Vec<Answer> {
        self.peers.remove(&conn);
        let mut grants = Vec::new();
        for gpu in self.gpus.values_mut() {
            gpu.queue.retain(|w| w.conn != conn);
            gpu.wakers.retain(|w| w.conn != conn);
            let owed = gpu.open_debt();
            for group in gpu.groups.values_mut() {
                // A borrower that exits while a guarantee is owed gives its loan back (one
                // ended or swapping out for the debt is counted there).
                let removed = group.members.remove(&conn);
                if let Some(m) =
                    removed.filter(|m| !m.ended_for_debt && m.residency != Residency::SwappingOut)
                {
                    gpu.repaid.given_back = gpu.repaid.given_back.saturating_add(m.granted.min(owed));
                }
            }
            gpu.groups.retain(|_, g| !g.members.is_empty());
        }
        self.share_bursts(now);
        for (&device, gpu) in self.gpus.iter_mut() {
            grants.extend(Self::drain(device, gpu, now));
            // Wakes that now fit are served at the arbiter's next look (`drain_all_wakes`).
        }
        grants
    }
}

/// What the resident parkable groups on `gpu` reserve: a firm request is admitted beside
/// the other firm requests only, those groups are parked for it.
fn parkable_reserved(gpu: &super::Gpu) -> u64 {
    gpu.groups
        .values()
        .filter(|g| g.park_after.is_some() && g.park != super::park::GroupPark::Parked)
        .map(|g| g.request)
        .fold(0u64, u64::saturating_add)
}

/// A registration's sizes, checked against the GPU and clamped to it: nothing is larger
/// than the GPU, so reports past it (from a shim that sees another total, or a broken one)
/// cannot overflow the ledger's sums.
fn checked_sizes(
    gpu: &super::Gpu,
    device: &DeviceId,
    total: u64,
    request: u64,
    limit: u64,
    held: u64,
) -> Result<(u64, u64, u64), String> {
    if total != gpu.total {
        tracing::warn!(gpu = %uuid_string(device), shim = total, arbiter = gpu.total, "shim and NVML disagree on the GPU's memory");
    }
    if limit < request {
        return Err(format!("a limit ({}) below the request ({})", gib(limit), gib(request)));
    }
    if gpu.headroom > 0 && request > gpu.total {
        // A shim that learnt the managed size refuses this itself; one that registers
        // it anyway (it could not reach the arbiter at its start) is refused as a
        // request larger than the GPU is.
        return Err(format!(
            "GPUFRAC_MEMORY_REQUEST ({}) is more than the {} gpufrac manages of GPU {} (gpufrac-arbiter --gpu-memory)",
            gib(request),
            gib(gpu.total),
            uuid_string(device)
        ));
    }
    let (request, limit, held) = (request.min(gpu.total), limit.min(gpu.total), held.min(gpu.total));
    Ok((request, limit.max(request), held))
}

/// What keeps a registering process's request out besides the other groups' requests.
struct Outside {
    /// Memory used outside gpufrac by other processes, past the headroom.
    others: u64,
    /// What of it counts against this request (nothing for a process coming back with a
    /// loan: refusing it would free nothing).
    used: u64,
    /// Memory groups hold beyond what their shims charged (see [`super::backstop`]).
    uncounted: u64,
}

impl Outside {
    fn for_peer(gpu: &super::Gpu, peer: &super::Peer, granted: u64) -> Outside {
        // What this very process already uses is not someone else's. A process coming
        // back with burst memory after a restart holds it already: refusing it for memory
        // outside gpufrac would free nothing (and that memory may be its peers coming back
        // too); its request must still fit beside the other requests, or no guarantee could
        // be kept. Within the headroom (`--gpu-memory`), it takes nothing from the managed
        // memory.
        let others: u64 = gpu.beyond_headroom(
            gpu.outside
                .iter()
                .filter(|&&(pid, _)| pid != peer.pid)
                .fold(0u64, |sum, &(_, bytes)| sum.saturating_add(bytes)),
        );
        let used = if granted == 0 { others } else { 0 };
        // Memory groups hold beyond what their shims charged keeps a request out as memory
        // outside gpufrac does.
        let uncounted = if granted == 0 { gpu.uncounted() } else { 0 };
        Outside { others, used, uncounted }
    }

    /// All of it.
    fn total(&self) -> u64 {
        self.used.saturating_add(self.uncounted)
    }

    /// The refusal of `request` on `device`, naming what fills the GPU.
    fn refusal(&self, gpu: &super::Gpu, device: &DeviceId, request: u64) -> String {
        let mut used_outside = String::new();
        if self.used > 0 {
            let past = if gpu.headroom > 0 { " past the headroom --gpu-memory leaves" } else { "" };
            used_outside = format!(" and {} is used by processes outside gpufrac{past}", gib(self.used));
        }
        if self.uncounted > 0 {
            used_outside.push_str(&format!(" and {} is held uncounted by groups", gib(self.uncounted)));
        }
        format!(
            "GPUFRAC_MEMORY_REQUEST ({}) does not fit on GPU {}: {} of {} is guaranteed to other groups{used_outside}",
            gib(request),
            uuid_string(device),
            gib(gpu.guaranteed()),
            gib(gpu.total),
        )
    }
}

/// Admits the peer's group on the GPU (a new group, a member joining one, or a member
/// growing its request); `Ok(true)`: admitted parked.
fn admit_group(
    gpu: &mut super::Gpu,
    device: &DeviceId,
    peer: &super::Peer,
    (request, limit, held): (u64, u64, u64),
    outside: &Outside,
    rule: (f64, u64),
    now: Instant,
) -> Result<bool, String> {
    let mut parked = false;
    if let Some(group) = gpu.groups.get(&peer.group) {
        if group.park_after.is_some() != peer.park_after.is_some() {
            // Parking moves a whole group: a member that cannot be parked would keep it
            // on the device (and one that can, in a group that cannot, never would be).
            return Err(format!(
                "GPUFRAC_PARK_AFTER is {} for GPUFRAC_GROUP {:?} but {} for this process: a group's processes must all set it, or none",
                if group.park_after.is_some() { "set" } else { "unset" },
                crate::entitlement::shown_group(&peer.group),
                if peer.park_after.is_some() { "set" } else { "unset" },
            ));
        }
    }
    match gpu.groups.get(&peer.group) {
        None => {
            let park_after = peer.park_after;
            if park_after.is_some() {
                // A process coming back with memory it holds (after a restart) is
                // resident, wherever it fits.
                parked = Policy::admit_parkable(gpu, device, request, outside.total(), rule)? && held == 0;
            } else {
                // Resident parkable groups do not keep a firm request out: they are
                // parked for it.
                let committed =
                    gpu.guaranteed().saturating_sub(parkable_reserved(gpu)).saturating_add(outside.total());
                if request > 0 && committed.saturating_add(request) > gpu.total {
                    return Err(outside.refusal(gpu, device, request));
                }
            }
            gpu.groups.insert(
                peer.group.clone(),
                Group {
                    request,
                    limit,
                    uid: peer.uid,
                    members: BTreeMap::new(),
                    last_ask: None,
                    burst: Default::default(),
                    park_after,
                    park: if parked { super::park::GroupPark::Parked } else { Default::default() },
                    active_since: now,
                    parks: 0,
                    wakes: 0,
                    last_park: std::time::Duration::ZERO,
                    last_wake: std::time::Duration::ZERO,
                    compute: super::compute::GroupCompute { spec: peer.compute, ..Default::default() },
                    uncounted: Default::default(),
                },
            );
        }
        Some(group) if group.uid != peer.uid => {
            // Its members share one ledger file, private to the user that made it: a
            // member of another user would count apart from the group's limit. (Groups
            // a client names are keyed by its UID, so this is a derived group.)
            return Err(format!(
                "GPUFRAC_GROUP {:?} is used by processes of another user (uid {}): a group's processes must run as one user",
                crate::entitlement::shown_group(&peer.group),
                group.uid
            ));
        }
        Some(group) if group.park == super::park::GroupPark::Parked => {
            // A member joining a parked group is parked with it (nothing of it is on
            // the device yet); its request cannot grow the group's.
            parked = held == 0;
        }
        Some(group) => {
            // The first member does not fix the group for the others: a larger request
            // is guaranteed if its difference fits (admission as for a new group), a
            // larger limit is taken. Never smaller: members still hold what they got.
            if request > group.request {
                let others = gpu.guaranteed().saturating_sub(group.request);
                if others.saturating_add(outside.total()).saturating_add(request) > gpu.total {
                    return Err(outside.refusal(gpu, device, request));
                }
            }
            if (group.request, group.limit) != (request, limit) {
                tracing::warn!(group = %peer.group, "a member's request/limit differ from the group's; the group keeps the larger of each");
            }
            let group = gpu.groups.get_mut(&peer.group).ok_or("group vanished")?;
            let limit = group.limit.max(limit);
            // Loans already made stay within the burst range (limit - request).
            group.request = group.request.max(request.min(limit.saturating_sub(group.granted())));
            group.limit = limit.max(group.request);
        }
    }
    Ok(parked)
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;

    #[test]
    fn a_request_is_admitted_while_its_memory_is_lent_and_refused_only_beside_guarantees() {
        let now = Instant::now();
        // 4 GiB GPU: a has request 512 MiB / limit 3.5 GiB and has borrowed 3 GiB.
        let mut p = Policy::new(&[(GPU, 4 * GIB)]);
        p.hello(1, peer("a", 1000));
        p.register(1, GPU, 4 * GIB, GIB / 2, 7 * GIB / 2, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Granted(3 * GIB));
        // b asks 2 GiB: 0.5 + 2 of 4 GiB are requests, so it is admitted; the GPU now
        // owes b 1.5 GiB that is lent to a.
        p.hello(2, peer("b", 1000));
        p.register(2, GPU, 4 * GIB, 2 * GIB, 2 * GIB, 0, 0, 0).unwrap();
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.burst, s.free, s.reclaiming), (5 * GIB / 2, 3 * GIB, 0, 3 * GIB / 2));
        // c asks 2 GiB: 4.5 GiB of requests do not fit 4 GiB, whatever is lent.
        p.hello(3, peer("c", 1000));
        let err = p.register(3, GPU, 4 * GIB, 2 * GIB, 2 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("GPUFRAC_MEMORY_REQUEST (2.00 GiB) does not fit"), "{err}");
        assert!(err.contains("2.50 GiB of 4.00 GiB is guaranteed") && !err.contains("lent"), "{err}");
    }

    #[test]
    fn memory_outside_gpufrac_counts_against_admission_but_not_the_process_own() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.observe_processes(GPU, &[(200, 10 * GIB), (300, GIB)], now);
        p.hello(1, Peer { pid: 300, ..peer("a", 1000) });
        let err = p.register(1, GPU, 16 * GIB, 7 * GIB, 7 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("10.00 GiB is used by processes outside gpufrac"), "{err}");
        p.register(1, GPU, 16 * GIB, 6 * GIB, 6 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.status().gpus[0].outside, 10 * GIB);
    }

    #[test]
    fn a_managed_size_leaves_headroom_to_memory_outside_gpufrac() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 64 * GIB)]);
        p.set_managed(&[(GPU, 16 * GIB)]);
        // 40 GiB used outside gpufrac fits in the 48 GiB of headroom: all 16 are there.
        p.observe_processes(GPU, &[(200, 40 * GIB)], now);
        p.hello(1, peer("a", 1000));
        let err = p.register(1, GPU, 16 * GIB, 20 * GIB, 20 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("(20.00 GiB) is more than the 16.00 GiB gpufrac manages"), "{err}");
        assert!(err.contains("--gpu-memory"), "{err}");
        p.register(1, GPU, 16 * GIB, 16 * GIB, 16 * GIB, 0, 0, 0).unwrap();
        let s = &p.status().gpus[0];
        assert_eq!(
            (s.total, s.headroom, s.outside, s.guaranteed, s.free),
            (16 * GIB, 48 * GIB, 40 * GIB, 16 * GIB, 0)
        );
        p.disconnect(1, now);
        // Past the headroom, the rest is taken from the managed memory.
        p.observe_processes(GPU, &[(200, 52 * GIB)], now);
        p.hello(2, peer("b", 1000));
        let err = p.register(2, GPU, 16 * GIB, 13 * GIB, 13 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("4.00 GiB is used by processes outside gpufrac past the headroom"), "{err}");
        p.register(2, GPU, 16 * GIB, 12 * GIB, 12 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.status().gpus[0].free, 0);
    }

    #[test]
    fn a_group_belongs_to_one_user() {
        let mut p = policy_with(&[(1, "a", GIB, 2 * GIB)]);
        p.hello(2, Peer { uid: 1001, ..peer("a", 1000) });
        let err = p.register(2, GPU, 16 * GIB, GIB, 2 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("GPUFRAC_GROUP \"a\"") && err.contains("another user"), "{err}");
        p.hello(3, peer("a", 1000));
        p.register(3, GPU, 16 * GIB, GIB, 2 * GIB, 0, 0, 0).expect("the same user joins");
    }

    #[test]
    fn requests_are_guaranteed_and_admission_refuses_what_does_not_fit() {
        let mut p = policy_with(&[(1, "a", 6 * GIB, 8 * GIB), (2, "b", 6 * GIB, 8 * GIB)]);
        p.hello(3, peer("c", 1000));
        let err = p.register(3, GPU, 16 * GIB, 6 * GIB, 6 * GIB, 0, 0, 0).unwrap_err();
        assert!(err.contains("GPUFRAC_MEMORY_REQUEST") && err.contains("does not fit"), "{err}");
        p.register(3, GPU, 16 * GIB, 4 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        // A second member of an admitted group joins without a new guarantee.
        p.hello(4, peer("a", 1000));
        p.register(4, GPU, 16 * GIB, 6 * GIB, 8 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.status().gpus[0].guaranteed, 16 * GIB);
    }

    #[test]
    fn a_disconnected_holder_frees_its_grant_for_the_waiter() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 4 * GIB, 16 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Queued);
        let answers = p.disconnect(1, now);
        assert_eq!((answers[0].conn, answers[0].result), (2, Ok(6 * GIB)));
        // Group a had no other member: its request is free again.
        assert_eq!(p.status().gpus[0].guaranteed, 4 * GIB);
    }

    #[test]
    fn re_registration_after_a_restart_rebuilds_what_was_held() {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, peer("a", 1000));
        p.register(1, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 10 * GIB, 6 * GIB, 0).unwrap();
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.burst, s.free), (4 * GIB, 6 * GIB, 6 * GIB));
        assert_eq!(s.processes[0].held, 10 * GIB);
    }

    #[test]
    fn memory_a_group_uses_beyond_its_guarantee_and_loans_is_charged_to_it() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        // A shim holding itself to 8 GiB of request when the arbiter believes 2 GiB.
        p.hello(1, Peer { pid: 100, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, false, now), Outcome::Granted(GIB));
        // Within its guarantee and loan (and a little measurement slack): nothing charged.
        p.observe_processes(GPU, &[(100, 3 * GIB + 100 * (1 << 20))], now);
        p.observe_processes(GPU, &[(100, 3 * GIB + 100 * (1 << 20))], now);
        assert_eq!((p.status().gpus[0].outside, p.status().gpus[0].uncounted), (0, 0));
        // 8 GiB used: 5 GiB past what it was guaranteed and lent are charged to it, and
        // lent to nobody (seen at two looks).
        p.observe_processes(GPU, &[(100, 8 * GIB)], now);
        p.observe_processes(GPU, &[(100, 8 * GIB)], now);
        let s = &p.status().gpus[0];
        assert_eq!((s.outside, s.uncounted), (0, 5 * GIB));
        assert_eq!(s.free, 16 * GIB - 2 * GIB - GIB - 5 * GIB);
        // A group's members are counted together.
        p.hello(2, Peer { pid: 200, ..peer("a", 1000) });
        p.register(2, GPU, 16 * GIB, 2 * GIB, 4 * GIB, 0, 0, 0).unwrap();
        p.observe_processes(GPU, &[(100, 2 * GIB), (200, GIB)], now);
        assert_eq!(p.status().gpus[0].uncounted, 0);
        p.observe_processes(GPU, &[(100, 2 * GIB), (200, 2 * GIB)], now);
        p.observe_processes(GPU, &[(100, 2 * GIB), (200, 2 * GIB)], now);
        assert_eq!(p.status().gpus[0].uncounted, GIB);
    }

    #[test]
    fn members_claiming_the_groups_whole_grant_share_one_burst_range() {
        // The report: 8 members of one group each re-registering with the group's
        // whole grant reached 56 GiB of burst on a 16 GiB GPU.
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        let listed: Vec<(u32, u64)> = (0..8).map(|i| (100 + i, 16 * GIB)).collect();
        p.observe_processes(GPU, &listed, now);
        for i in 0..8u32 {
            p.hello(u64::from(i) + 1, Peer { pid: 100 + i, ..peer("a", 1000) });
            p.register(u64::from(i) + 1, GPU, 16 * GIB, GIB, 8 * GIB, 8 * GIB, 7 * GIB, 0).unwrap();
        }
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.burst), (GIB, 7 * GIB), "one request, one burst range");
        // Nor is more believed than NVML shows a process using.
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.observe_processes(GPU, &[(100, 2 * GIB)], now);
        p.hello(1, Peer { pid: 100, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, GIB, 8 * GIB, 8 * GIB, 7 * GIB, 0).unwrap();
        assert_eq!(p.status().gpus[0].burst, 2 * GIB);
        p.hello(2, Peer { pid: 200, ..peer("b", 1000) });
        p.register(2, GPU, 16 * GIB, GIB, 8 * GIB, 8 * GIB, 7 * GIB, 0).unwrap();
        assert_eq!(p.status().gpus[0].burst, 2 * GIB, "a process NVML does not list holds no grant");
    }

    #[test]
    fn memory_used_outside_gpufrac_is_never_lent() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 100, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 0, 0).unwrap();
        p.acquire(1, GPU, 1, GIB, GIB, 0, false, now);
        // NVML lists a: 5 GiB (registered: in the ledger already), 200: 6 GiB (no shim),
        // and 300: 3 GiB (a shim not back yet after a restart).
        let listed = [(100, 5 * GIB), (200, 6 * GIB), (300, 3 * GIB)];
        assert!(p.observe_processes(GPU, &listed, now).is_empty());
        let s = &p.status().gpus[0];
        assert_eq!((s.outside, s.free), (9 * GIB, 2 * GIB), "16 - 4 guaranteed - 1 lent - 9 outside");
        assert_eq!(p.acquire(1, GPU, 2, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Queued);
        // a waits while holding a grant, and nobody else holds one: just after a start,
        // no deadlock is declared (the memory outside may be shims coming back)...
        assert!(p.settle(GPU, now).is_empty());
        // 300 re-registers: its memory moves from outside into the ledger.
        p.hello(2, Peer { pid: 300, ..peer("b", 1000) });
        p.register(2, GPU, 16 * GIB, 2 * GIB, 3 * GIB, 3 * GIB, GIB, 0).unwrap();
        assert_eq!(p.status().gpus[0].outside, 6 * GIB);
        // 200 exits: a's burst fits again and is granted.
        let answers = p.observe_processes(GPU, &[(100, 5 * GIB), (300, 3 * GIB)], now);
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].result), (1, Ok(3 * GIB)));
        assert_eq!(p.status().gpus[0].outside, 0);
    }
}
