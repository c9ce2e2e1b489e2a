//! Parking idle models. A parkable group (`GPUFRAC_PARK_AFTER`) may be admitted past the
//! GPU, up to `--oversubscribe` times what the other groups' requests and memory outside
//! gpufrac leave, within the host RAM `--swap-limit` allows. One that does not fit when it
//! registers is admitted *parked*: nothing of it is on the device and its request is not
//! reserved. A parked group's first call waits at its gate and asks to be woken; the wake
//! is served in order once the group's request and what it borrowed fit in free memory.
//! When a wake (or a non-parkable guarantee) needs room, resident parkable groups are
//! parked, least recently active first: for a wake only those idle for their
//! `GPUFRAC_PARK_AFTER`; for a non-parkable guarantee crowded out by parkable requests, any
//! of them (a parkable request is never guaranteed against a non-parkable one). Parked
//! groups borrow nothing; their members' memory is in host RAM (moved by the shim, or by
//! the arbiter with the driver's checkpoint API) and comes back at the same addresses.
//! A wake waits at most the group's `GPUFRAC_WAIT_TIMEOUT`, then is refused (`Timeout`):
//! the waiting call fails with out-of-memory and the next one asks again. While wakes
//! wait, no new burst is lent: wakes are guarantees coming back, bursts are loans.

use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;

use super::{gib, uuid_string, ConnId, Gpu, Group, Policy};

mod wake;
pub(super) use wake::Waker;
pub use wake::{WakeAnswer, WakeOutcome};

/// How long a member told to park may take to answer before the park is given up.
const PARK_ANSWER_WAIT: Duration = Duration::from_secs(60);

/// Where a parkable group's memory is.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum GroupPark {
    /// On the device: its request is reserved.
    #[default]
    Resident,
    /// Its members were told to park; their answers are awaited (still reserved).
    Parking {
        /// Since when.
        since: Instant,
    },
    /// Every member's memory is in host RAM, or was never on the device: its request is
    /// not reserved.
    Parked,
}

/// Where a member's memory is.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum MemberPark {
    /// On the device.
    #[default]
    Resident,
    /// Told to park (or, for a checkpoint, its gate is closing); the answer is awaited.
    Parking,
    /// In host RAM.
    Parked,
    /// Its wake was granted: its memory is coming back.
    Waking,
}

impl MemberPark {
    /// The state `gpufrac status` shows, for a member that is not simply resident.
    pub(super) fn shown(self, wake_waits: bool) -> Option<&'static str> {
        match self {
            MemberPark::Resident => None,
            MemberPark::Parking => Some("parking"),
            MemberPark::Parked if wake_waits => Some("waking"),
            MemberPark::Parked => Some("parked"),
            MemberPark::Waking => Some("waking"),
        }
    }
}

/// A member to park: the server tells its shim (and checkpoints it, with `checkpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkOrder {
    /// Its connection.
    pub conn: ConnId,
    /// The GPU.
    pub device: DeviceId,
    /// Its PID.
    pub pid: u32,
    /// Its group.
    pub group: String,
    /// What its group frees on the GPU by parking (request and loans).
    pub bytes: u64,
    /// The arbiter moves its memory with the driver's checkpoint API.
    pub checkpoint: bool,
    /// Why: for a wake, or for a guarantee.
    pub why: &'static str,
}

impl Group {
    /// What its request reserves on the device: all of it, unless it is parked (then only
    /// what its members left there).
    pub(super) fn reserved(&self) -> u64 {
        match self.park {
            GroupPark::Parked => {
                let left = self.members.values().fold(0u64, |sum, m| sum.saturating_add(m.left_on_device));
                left.min(self.request)
            }
            _ => self.request,
        }
    }

    /// What parking it frees on the device: its request and its loans.
    fn footprint(&self) -> u64 {
        self.request.saturating_add(self.granted())
    }

    /// What waking it takes on the device: its request less what it left there, and what
    /// its parked members borrowed.
    pub(super) fn wake_need(&self) -> u64 {
        let lent = self.members.values().map(|m| m.parked_grant).fold(0u64, u64::saturating_add);
        match self.park {
            GroupPark::Parked => self.request.saturating_sub(self.reserved()).saturating_add(lent),
            _ => lent,
        }
    }

    /// When it was last active: a member's last launch, copy or set, its admission or
    /// its last wake.
    fn last_active(&self, policy_peers: &std::collections::HashMap<ConnId, super::Peer>) -> Instant {
        self.members
            .keys()
            .filter_map(|c| policy_peers.get(c).map(|p| p.last_active))
            .fold(self.active_since, Instant::max)
    }
}

impl Gpu {
    /// Sum of the parkable groups' requests, parked or not.
    pub(super) fn parkable_requests(&self) -> u64 {
        self.groups
            .values()
            .filter(|g| g.park_after.is_some())
            .map(|g| g.request)
            .fold(0u64, u64::saturating_add)
    }

    /// Sum of the requests of groups that are never parked.
    fn firm_requests(&self) -> u64 {
        self.groups
            .values()
            .filter(|g| g.park_after.is_none())
            .map(|g| g.request)
            .fold(0u64, u64::saturating_add)
    }

    /// What the parkable groups on the device (resident or parking) hold or reserve.
    pub(super) fn parkable_resident(&self) -> u64 {
        self.groups
            .values()
            .filter(|g| g.park_after.is_some() && g.park != GroupPark::Parked)
            .map(|g| g.footprint())
            .fold(0u64, u64::saturating_add)
    }

    /// How far the reserved requests and memory outside gpufrac (or held uncounted) pass
    /// the GPU: what parking resident parkable groups must free for the other guarantees.
    pub(super) fn crowding(&self) -> u64 {
        (self.guaranteed() as i128 + self.unaccounted() as i128 - self.total as i128)
            .clamp(0, u64::MAX as i128) as u64
    }

    /// What the parks under way free once answered.
    fn parking(&self) -> u64 {
        self.groups
            .values()
            .filter(|g| matches!(g.park, GroupPark::Parking { .. }))
            .map(|g| g.footprint())
            .fold(0u64, u64::saturating_add)
    }
}

impl Policy {
    /// Sets how far parkable groups' requests may add up past the GPU (`--oversubscribe`).
    pub fn set_oversubscribe(&mut self, ratio: f64) {
        self.oversubscribe = ratio.max(1.0);
    }

    /// Parks use the driver's checkpoint API from now on (the arbiter loaded it).
    pub fn set_checkpoint(&mut self, available: bool) {
        self.checkpoint = available;
    }

    /// Admission of a new parkable group's `request` on `gpu`: refused past the
    /// oversubscription or the host RAM it would take parked; `Ok(true)` if admitted
    /// parked (no room on the device now).
    pub(super) fn admit_parkable(
        gpu: &Gpu,
        device: &DeviceId,
        request: u64,
        outside: u64,
        (oversubscribe, swap_limit): (f64, u64),
    ) -> Result<bool, String> {
        let room_for_parkable = gpu.total.saturating_sub(gpu.firm_requests()).saturating_sub(outside);
        let parkable = gpu.parkable_requests().saturating_add(request);
        let most = (room_for_parkable as f64 * oversubscribe) as u64;
        if parkable > most {
            return Err(format!(
                "GPUFRAC_MEMORY_REQUEST ({}) does not fit on GPU {}: the parkable groups' requests would add up to {}, past {} (--oversubscribe {} times the {} that other requests and memory outside gpufrac leave)",
                gib(request),
                uuid_string(device),
                gib(parkable),
                gib(most),
                oversubscribe,
                gib(room_for_parkable),
            ));
        }
        // At worst everything the device cannot hold is parked in host RAM at once.
        let parked_at_most = parkable.saturating_sub(room_for_parkable);
        if parked_at_most > swap_limit {
            return Err(format!(
                "GPUFRAC_MEMORY_REQUEST ({}) does not fit on GPU {}: parked groups could need {} of host RAM, past --swap-limit ({})",
                gib(request),
                uuid_string(device),
                gib(parked_at_most),
                gib(swap_limit),
            ));
        }
        Ok(gpu.guaranteed().saturating_add(outside).saturating_add(request) > gpu.total)
    }

    /// Decides which resident parkable groups to park now: for the first waiting wake and
    /// to keep room for the next two while groups are parked (idle groups only), and for
    /// non-parkable guarantees crowded out (any parkable group), least recently active
    /// first. Marks them parking and returns one order per
    /// member.
    pub fn plan_parks(&mut self, now: Instant) -> Vec<ParkOrder> {
        let mut orders = Vec::new();
        let devices_of = |conn: ConnId, gpus: &std::collections::BTreeMap<DeviceId, Gpu>| {
            gpus.values().filter(|g| g.groups.values().any(|gr| gr.members.contains_key(&conn))).count()
        };
        let counts: std::collections::HashMap<ConnId, usize> = self
            .gpus
            .values()
            .flat_map(|g| g.members().map(|(_, c, _)| c))
            .map(|c| (c, devices_of(c, &self.gpus)))
            .collect();
        for (&device, gpu) in self.gpus.iter_mut() {
            let parking = gpu.parking() as i128;
            let waker_group = gpu.wakers.front().map(|w| w.group.clone());
            let for_wake = match &waker_group {
                Some(name) => gpu.groups.get(name).map_or(0, |g| g.wake_need() as i128 - gpu.room()),
                None => 0,
            };
            // Room kept for the next two wakes: while groups are parked here, idle ones are
            // parked ahead of time so that a wake finds room at once (its wait is then only
            // the copy of its own memory, not another group's park first), and so does one
            // coming right behind it while the park that makes room again is under way.
            // Not while a wake is bringing memory back: that copy is what a request waits for,
            // and a park beside it would share the host's memory bandwidth with it.
            let waking = gpu.members().any(|(_, _, m)| m.park == MemberPark::Waking);
            let mut needs: Vec<u64> = gpu
                .groups
                .values()
                .filter(|g| g.park == GroupPark::Parked && !waking)
                .map(|g| g.wake_need())
                .collect();
            needs.sort_unstable_by(|a, b| b.cmp(a));
            let next_wake = needs.iter().take(2).fold(0u64, |sum, n| sum.saturating_add(*n));
            let for_wake = for_wake.max(next_wake as i128 - gpu.room());
            let crowded = gpu.crowding().min(gpu.parkable_resident()) as i128;
            let (mut for_wake, mut crowded) = (for_wake - parking, crowded - parking);
            if for_wake <= 0 && crowded <= 0 {
                continue;
            }
            let busy: Vec<&str> = gpu
                .queue
                .iter()
                .map(|w| w.group.as_str())
                .chain(gpu.wakers.iter().map(|w| w.group.as_str()))
                .collect();
            let mut candidates: Vec<(Instant, String, bool)> = gpu
                .groups
                .iter()
                .filter(|(name, g)| {
                    g.park_after.is_some()
                        && g.park == GroupPark::Resident
                        && g.members.values().all(|m| m.park == MemberPark::Resident)
                        && !busy.contains(&name.as_str())
                })
                .map(|(name, g)| {
                    let last = g.last_active(&self.peers);
                    let idle = g.park_after.is_some_and(|after| now.saturating_duration_since(last) >= after);
                    (last, name.clone(), idle)
                })
                .collect();
            candidates.sort();
            for (_, name, idle) in candidates {
                let why = if crowded > 0 {
                    "for a guarantee"
                } else if for_wake > 0 && idle {
                    "for a wake"
                } else {
                    continue;
                };
                let Some(g) = gpu.groups.get_mut(&name) else { continue };
                let bytes = g.footprint();
                let parking = Parking { device, name: &name, why, now, checkpoint: self.checkpoint };
                orders.extend(parking.start(g, &counts, &self.peers));
                (for_wake, crowded) = (for_wake - bytes as i128, crowded - bytes as i128);
                if for_wake <= 0 && crowded <= 0 {
                    break;
                }
            }
        }
        self.park_on_every_gpu(&mut orders, &counts, now);
        orders
    }

    /// A group parked on one GPU is parked on each of its other GPUs too, where it is
    /// parkable, resident and waits for nothing there: a tensor-parallel server whose workers see
    /// one GPU each, parked on one GPU only, would keep its other workers' memory and serve
    /// nothing. (Workers that see every GPU are members on each, and all of them get the
    /// first GPU's orders already.)
    fn park_on_every_gpu(
        &mut self,
        orders: &mut Vec<ParkOrder>,
        counts: &std::collections::HashMap<ConnId, usize>,
        now: Instant,
    ) {
        let mut chosen: Vec<(DeviceId, String, &'static str)> =
            orders.iter().map(|o| (o.device, o.group.clone(), o.why)).collect();
        chosen.dedup();
        for (device, name, why) in chosen {
            for (&other, gpu) in self.gpus.iter_mut().filter(|(d, _)| **d != device) {
                let busy =
                    gpu.queue.iter().any(|w| w.group == name) || gpu.wakers.iter().any(|w| w.group == name);
                let Some(g) = gpu.groups.get_mut(&name) else { continue };
                if busy
                    || g.park_after.is_none()
                    || g.park != GroupPark::Resident
                    || !g.members.values().all(|m| m.park == MemberPark::Resident)
                {
                    continue;
                }
                let parking = Parking { device: other, name: &name, why, now, checkpoint: self.checkpoint };
                orders.extend(parking.start(g, counts, &self.peers));
            }
        }
    }

    /// Whether `conn` is being parked on `device` by the arbiter's checkpoint (its shim
    /// closed its gate: the arbiter checkpoints it now).
    pub fn parks_by_checkpoint(&self, conn: ConnId, device: &DeviceId) -> bool {
        let Some(peer) = self.peers.get(&conn) else { return false };
        self.gpus
            .get(device)
            .and_then(|gpu| gpu.groups.get(&peer.group)?.members.get(&conn))
            .is_some_and(|m| m.park == MemberPark::Parking && m.checkpointed)
    }

    /// `conn`'s memory on `device` is parked: `host_bytes` in host RAM, `held` left on the
    /// device. Returns the bursts and wakes that now fit.
    pub fn parked(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        host_bytes: u64,
        held: u64,
        now: Instant,
    ) -> (Vec<super::Answer>, Vec<WakeAnswer>) {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return (Vec::new(), Vec::new()) };
        let total = gpu.total;
        let Some(g) = gpu.groups.get_mut(&group) else { return (Vec::new(), Vec::new()) };
        let limit = g.limit;
        let Some(m) = g.members.get_mut(&conn) else { return (Vec::new(), Vec::new()) };
        if m.park != MemberPark::Parking {
            // Not asked (or asked and given up): a process parks when told, not on its own
            // say-so (that would free its reservation while it may keep its memory).
            tracing::debug!(conn, "a park report nobody asked for: ignored");
            return (Vec::new(), Vec::new());
        }
        m.park = MemberPark::Parked;
        // No process parks more than its group may hold.
        m.parked_bytes = host_bytes.min(limit);
        m.held = held.min(total);
        // Counted within its group's request: a report cannot reserve more than that.
        m.left_on_device = m.held;
        m.parked_grant = m.parked_grant.saturating_add(std::mem::take(&mut m.granted));
        if let GroupPark::Parking { since } = g.park {
            if g.members.values().all(|m| m.park == MemberPark::Parked) {
                g.park = GroupPark::Parked;
                g.parks += 1;
                g.last_park = now.saturating_duration_since(since);
            }
        }
        let wakes = Self::drain_wakers(device, gpu, now);
        (Self::drain(device, gpu, now), wakes)
    }

    /// `conn` did not park on `device` after all (it was busy, or its checkpoint failed):
    /// its group is resident again.
    pub fn park_given_up(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        held: u64,
        now: Instant,
    ) -> Vec<WakeAnswer> {
        let Some((gpu, group)) = self.member_gpu(conn, &device) else { return Vec::new() };
        let total = gpu.total;
        if let Some(g) = gpu.groups.get_mut(&group) {
            if matches!(g.park, GroupPark::Parking { .. }) {
                g.park = GroupPark::Resident;
                g.active_since = now;
            }
            if let Some(m) = g.members.get_mut(&conn) {
                m.park = MemberPark::Resident;
                (m.held, m.checkpointed, m.left_on_device) = (held.min(total), false, 0);
            }
            if g.members.contains_key(&conn) {
                lend_again(g, conn);
            }
        }
        Self::drain_wakers(device, gpu, now)
    }
}

/// What member `conn` of `g` borrowed when it was parked is lent to it again, within what
/// the group may still borrow (its request or limit may have changed meanwhile).
/// A park the arbiter orders: of group `name` on `device`.
struct Parking<'a> {
    device: DeviceId,
    name: &'a str,
    why: &'static str,
    now: Instant,
    /// The driver's checkpoint API is there to park processes on one GPU.
    checkpoint: bool,
}

impl Parking<'_> {
    /// Marks group `g` and its members parking; one order per member (by the checkpoint
    /// where its process is on this GPU alone, `on_gpus` counting each one's GPUs).
    fn start(
        &self,
        g: &mut Group,
        on_gpus: &std::collections::HashMap<ConnId, usize>,
        peers: &std::collections::HashMap<ConnId, super::Peer>,
    ) -> Vec<ParkOrder> {
        let bytes = g.footprint();
        g.park = GroupPark::Parking { since: self.now };
        g.members
            .iter_mut()
            .map(|(&conn, m)| {
                m.park = MemberPark::Parking;
                m.checkpointed = self.checkpoint && on_gpus.get(&conn) == Some(&1);
                ParkOrder {
                    conn,
                    device: self.device,
                    pid: peers.get(&conn).map_or(0, |p| p.pid),
                    group: self.name.to_owned(),
                    bytes,
                    checkpoint: m.checkpointed,
                    why: self.why,
                }
            })
            .collect()
    }
}

pub(super) fn lend_again(g: &mut Group, conn: ConnId) {
    let room = g.room();
    if let Some(m) = g.members.get_mut(&conn) {
        let lent = std::mem::take(&mut m.parked_grant).min(room);
        m.granted = m.granted.saturating_add(lent);
    }
}

/// Parks not answered within [`PARK_ANSWER_WAIT`] are given up: the group counts as
/// resident again (a shim that never answers keeps its memory on the device).
pub(super) fn give_up_late_parks(gpu: &mut Gpu, now: Instant) {
    for (name, g) in gpu.groups.iter_mut() {
        if let GroupPark::Parking { since } = g.park {
            if now.saturating_duration_since(since) >= PARK_ANSWER_WAIT {
                tracing::warn!(group = %name, "a park was not answered within {}s; the group counts as resident", PARK_ANSWER_WAIT.as_secs());
                g.park = GroupPark::Resident;
                for m in g.members.values_mut().filter(|m| m.park == MemberPark::Parking) {
                    m.park = MemberPark::Resident;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

    const MODEL: u64 = 5 * GIB / 4;

    fn parkable(group: &str) -> Peer {
        Peer {
            park_after: Some(Duration::from_secs(1)),
            wait_timeout: Duration::from_secs(30),
            ..peer(group, 30_000)
        }
    }

    /// A 4 GiB GPU with `--oversubscribe 3` and parkable models of 1.25 GiB on
    /// connections 1..=n, admitted in order; returns whether each was admitted parked.
    fn models(n: u64) -> (Policy, Vec<bool>) {
        let mut p = Policy::new(&[(GPU, 4 * GIB)]);
        p.set_oversubscribe(3.0);
        let admitted = (1..=n)
            .map(|conn| {
                p.hello(conn, parkable(&format!("m{conn}")));
                p.register(conn, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap()
            })
            .collect();
        (p, admitted)
    }

    /// Makes every peer's last activity `ago` before `now`.
    fn idle_since(p: &mut Policy, now: Instant, ago: Duration) {
        for peer in p.peers.values_mut() {
            peer.last_active = now - ago;
        }
        for gpu in p.gpus.values_mut() {
            for g in gpu.groups.values_mut() {
                g.active_since = now - ago;
            }
        }
    }

    #[test]
    fn parkable_groups_are_admitted_past_the_gpu_up_to_the_oversubscription() {
        let (mut p, admitted) = models(9);
        // Three fit; the next six are admitted parked; 9 x 1.25 = 11.25 GiB <= 3 x 4 GiB.
        assert_eq!(admitted, [false, false, false, true, true, true, true, true, true]);
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.parkable_requests), (3 * MODEL, 9 * MODEL));
        assert_eq!(state(&p, 4), "parked");
        // A tenth passes 3 x 4 GiB.
        p.hello(10, parkable("m10"));
        let err = p.register(10, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap_err();
        assert!(err.contains("--oversubscribe 3") && err.contains("12.50 GiB"), "{err}");
        // Host RAM: what cannot be on the device at once must fit --swap-limit.
        let (mut p, _) = models(3);
        p.set_swap_limit(GIB / 2);
        p.hello(4, parkable("m4"));
        let err = p.register(4, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap_err();
        assert!(err.contains("--swap-limit"), "{err}");
    }

    #[test]
    fn a_wake_parks_the_least_recently_active_idle_group_then_is_served() {
        let now = Instant::now();
        let (mut p, _) = models(4);
        idle_since(&mut p, now, Duration::from_secs(5));
        // m2 was active lately; m1 and m3 are idle, m1 the longest.
        p.peers.get_mut(&3).unwrap().last_active = now - Duration::from_secs(3);
        p.peers.get_mut(&2).unwrap().last_active = now;
        assert_eq!(p.wake(4, GPU, 7, now), WakeOutcome::Queued);
        assert_eq!(state(&p, 4), "waking");
        let orders = p.plan_parks(now);
        assert_eq!(orders.len(), 1, "{orders:?}");
        assert_eq!((orders[0].conn, orders[0].why, orders[0].checkpoint), (1, "for a wake", false));
        assert_eq!(state(&p, 1), "parking");
        // Nothing more while that park is under way.
        assert!(p.plan_parks(now).is_empty());
        let (_, wakes) = p.parked(1, GPU, GIB, 64 << 20, now);
        assert_eq!(wakes.len(), 1);
        assert_eq!((wakes[0].conn, wakes[0].seq, wakes[0].result), (4, 7, Ok((0, false))));
        assert_eq!(state(&p, 1), "parked");
        assert_eq!(state(&p, 4), "waking");
        p.woken(4, GPU, Some(MODEL), now);
        assert_eq!(state(&p, 4), "running");
        let s = &p.status().gpus[0];
        // m1 keeps its context on the device: 64 MiB.
        assert_eq!(s.guaranteed, 3 * MODEL + (64 << 20));
        assert_eq!(s.parked, GIB);
        let m1 = s.processes.iter().find(|x| x.group == "m1").unwrap();
        assert_eq!((m1.parks, m1.parked_bytes), (1, GIB));
        let m4 = s.processes.iter().find(|x| x.group == "m4").unwrap();
        assert_eq!(m4.wakes, 1);
    }

    #[test]
    fn a_group_on_two_gpus_is_parked_on_both() {
        let now = Instant::now();
        const OTHER: DeviceId = [8; 16];
        let mut p = Policy::new(&[(GPU, 4 * GIB), (OTHER, 4 * GIB)]);
        p.set_oversubscribe(3.0);
        // A tensor-parallel model, one worker on each GPU, and three one-GPU models on
        // the first: the fourth is admitted parked.
        for (conn, group, device) in
            [(1, "tp", GPU), (2, "tp", OTHER), (3, "m3", GPU), (4, "m4", GPU), (5, "m5", GPU)]
        {
            p.hello(conn, Peer { pid: 100 + conn as u32, ..parkable(group) });
            p.register(conn, device, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap();
        }
        assert_eq!(state(&p, 5), "parked");
        idle_since(&mut p, now, Duration::from_secs(5));
        for conn in [3, 4] {
            p.peers.get_mut(&conn).unwrap().last_active = now;
        }
        // m5 is called: the idle tensor-parallel model is parked for it, on both GPUs.
        assert_eq!(p.wake(5, GPU, 7, now), WakeOutcome::Queued);
        let mut orders: Vec<_> = p.plan_parks(now).iter().map(|o| (o.conn, o.device, o.why)).collect();
        orders.sort();
        assert_eq!(orders, vec![(1, GPU, "for a wake"), (2, OTHER, "for a wake")]);
    }

    #[test]
    fn only_idle_groups_are_parked_for_a_wake_which_times_out_without_room() {
        let now = Instant::now();
        let (mut p, _) = models(4);
        // All three resident models were active just now.
        assert_eq!(p.wake(4, GPU, 1, now), WakeOutcome::Queued);
        assert!(p.plan_parks(now).is_empty());
        assert!(p.expire_wakes(now + Duration::from_secs(29)).is_empty());
        let expired = p.expire_wakes(now + Duration::from_secs(31));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].result, Err(Denial::Timeout));
        assert_eq!(state(&p, 4), "parked");
    }

    /// Four models idle for 5 s, m4 admitted parked: nobody asks yet, but m1, the least
    /// recently active, is parked ahead of time for m4's wake.
    fn m1_parked_ahead_of_m4(now: Instant) -> Policy {
        let (mut p, _) = models(4);
        idle_since(&mut p, now, Duration::from_secs(5));
        let orders = p.plan_parks(now);
        assert_eq!(orders.iter().map(|o| o.conn).collect::<Vec<_>>(), [1]);
        p.parked(1, GPU, GIB, 0, now);
        p
    }

    #[test]
    fn room_is_kept_for_the_next_wake_while_groups_are_parked() {
        let now = Instant::now();
        let mut p = m1_parked_ahead_of_m4(now);
        // Now m4's wake is served at once; while its memory comes back nothing else is
        // parked (the copy it waits for has the host to itself), then the next idle model
        // (m2) is parked ahead of m1's next wake.
        assert_eq!(p.wake(4, GPU, 1, now), WakeOutcome::Woken { bytes: 0, restore: false });
        assert!(p.plan_parks(now).is_empty());
        p.woken(4, GPU, Some(MODEL), now);
        let orders = p.plan_parks(now);
        assert_eq!(orders.iter().map(|o| o.conn).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn a_model_just_woken_is_not_parked_for_the_next_wake_before_its_call_runs() {
        let now = Instant::now();
        // m2 and m3 stay busy from here on.
        let mut p = m1_parked_ahead_of_m4(now);
        let busy = |p: &mut Policy, at: Instant| {
            for conn in [2, 3] {
                p.peers.get_mut(&conn).unwrap().last_active = at;
            }
        };
        assert_eq!(p.wake(4, GPU, 1, now), WakeOutcome::Woken { bytes: 0, restore: false });
        // Its memory takes 1.5 s to come back, longer than its GPUFRAC_PARK_AFTER (1 s).
        let back = now + Duration::from_millis(1500);
        busy(&mut p, back);
        p.woken(4, GPU, Some(MODEL), back);
        // Room for m1's next wake is wanted, but m4 was woken for a call that has not run
        // yet: it is not idle, though its last launch was 6.5 s ago.
        let orders = p.plan_parks(back + Duration::from_millis(10));
        assert!(orders.is_empty(), "{orders:?}");
        assert_eq!(state(&p, 4), "running");
        // Idle for its GPUFRAC_PARK_AFTER after the wake, it may be parked again.
        let later = back + Duration::from_secs(2);
        busy(&mut p, later);
        let orders = p.plan_parks(later);
        assert_eq!(orders.iter().map(|o| o.conn).collect::<Vec<_>>(), [4]);
    }

    #[test]
    fn a_firm_request_has_parkable_groups_parked_busy_or_not_and_owes_no_borrower() {
        let now = Instant::now();
        let (mut p, _) = models(3);
        // A burst holder that is not parkable: 256 MiB left, lent.
        p.hello(9, peer("firm", 1000));
        p.register(9, GPU, 4 * GIB, 2 * GIB, 2 * GIB, 0, 0, 0).expect("a firm request beside parkable ones");
        assert_eq!(p.status().gpus[0].reclaiming, 0, "parkable requests are not a debt of borrowers");
        let orders = p.plan_parks(now);
        // 3 x 1.25 + 2 = 5.75 GiB: two models must go, whatever their activity.
        assert_eq!(orders.len(), 2, "{orders:?}");
        assert!(orders.iter().all(|o| o.why == "for a guarantee"));
        for o in &orders {
            p.parked(o.conn, GPU, GIB, 0, now);
        }
        assert!(p.plan_parks(now).is_empty());
        assert_eq!(state(&p, 9), "running");
        let s = &p.status().gpus[0];
        assert_eq!(s.guaranteed, MODEL + 2 * GIB);
    }

    #[test]
    fn a_group_is_parkable_in_all_its_processes_or_in_none() {
        let (mut p, _) = models(1);
        p.hello(2, peer("m1", 30_000));
        let err = p.register(2, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap_err();
        assert!(err.contains("GPUFRAC_PARK_AFTER is set for GPUFRAC_GROUP \"m1\" but unset"), "{err}");
        p.hello(3, parkable("m1"));
        p.register(3, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).expect("a parkable member joins");
    }

    #[test]
    fn a_park_nobody_asked_for_frees_nothing_and_memory_kept_while_parked_is_never_lent() {
        let now = Instant::now();
        let (mut p, _) = models(3);
        // m1 says it parked without being told: ignored, its request stays reserved.
        p.parked(1, GPU, MODEL, 0, now);
        assert_eq!((state(&p, 1).as_str(), p.status().gpus[0].guaranteed), ("running", 3 * MODEL));
        // Told, it says it parked but NVML shows it still uses its model: that memory is
        // charged to its group as uncounted, so nothing lends it to anyone.
        idle_since(&mut p, now, Duration::from_secs(5));
        p.hello(4, parkable("m4"));
        assert!(p.register(4, GPU, 4 * GIB, MODEL, MODEL, 0, 0, 0).unwrap());
        let orders = p.plan_parks(now);
        let conn = orders[0].conn;
        p.parked(conn, GPU, MODEL, 0, now);
        for (&c, peer) in p.peers.iter_mut() {
            peer.pid = 100 + c as u32;
        }
        p.observe_processes(GPU, &[(100 + conn as u32, MODEL)], now);
        p.observe_processes(GPU, &[(100 + conn as u32, MODEL)], now);
        let s = &p.status().gpus[0];
        assert_eq!((s.outside, s.uncounted), (0, MODEL), "{s:?}");
    }

    #[test]
    fn a_declined_park_leaves_the_group_resident() {
        let now = Instant::now();
        let (mut p, _) = models(4);
        idle_since(&mut p, now, Duration::from_secs(5));
        let orders = p.plan_parks(now);
        assert_eq!(orders.len(), 1);
        assert!(p.is_parking(orders[0].conn, &GPU));
        p.park_given_up(orders[0].conn, GPU, MODEL, now);
        assert_eq!(state(&p, orders[0].conn), "running");
        assert_eq!(p.status().gpus[0].guaranteed, 3 * MODEL);
    }

    #[test]
    fn parks_use_the_checkpoint_for_members_on_one_gpu() {
        let now = Instant::now();
        let (mut p, _) = models(4);
        p.set_checkpoint(true);
        idle_since(&mut p, now, Duration::from_secs(5));
        let orders = p.plan_parks(now);
        assert!(orders[0].checkpoint);
        assert!(p.parks_by_checkpoint(orders[0].conn, &GPU));
        p.parked(orders[0].conn, GPU, MODEL, 0, now);
        // Its wake restores the checkpoint before it is answered.
        let conn = orders[0].conn;
        p.peers.get_mut(&conn).unwrap().last_active = now;
        idle_since(&mut p, now, Duration::ZERO);
        assert_eq!(p.wake(conn, GPU, 3, now), WakeOutcome::Woken { bytes: 0, restore: true });
    }
}
