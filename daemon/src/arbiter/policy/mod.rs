//! The arbiter's decisions, as pure state: no sockets, no clock of its own (callers pass
//! `now`), so every rule is unit-tested directly.
//!
//! The rule: per GPU, each group's **request is guaranteed** and memory above it is a
//! **loan**. A group is admitted when its request fits beside the other groups' requests
//! and the memory used outside gpufrac, whatever is lent out at the time. When a guarantee
//! needs lent memory back, the loans are taken back at once ([`reclaim`]). Bursts are lent
//! what no request reserves, never past a group's limit, in an order that can never
//! deadlock ([`wait`]); the requester's resolver decides what else a colliding burst may
//! do: end lower-priority or idle holders ([`priority`]) or move a holder's burst memory to
//! host RAM ([`swap`]). [`ledger`] keeps who holds what. Parkable groups (`GPUFRAC_PARK_AFTER`)
//! may be admitted past the GPU up to `--oversubscribe`; idle ones are parked (their whole
//! memory moved to host RAM, their request no longer reserved) when a wake or a guarantee
//! needs the room, and woken at their next call ([`park`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId};
use gpufrac_common::{ComputeSpec, Resolver};

use super::document::{GpuStatus, ProcessStatus, Status};

mod backstop;
mod compute;
mod contexts;
mod follow_up;
mod ledger;
mod park;
mod priority;
#[cfg(test)]
mod props;
mod reclaim;
mod swap;
mod wait;

pub use backstop::{EnforceLimits, Finding, DEFAULT_ENFORCE_GRACE};
pub use compute::{LeaseOrder, PERIOD as LEASE_PERIOD};
pub use follow_up::FollowUp;
pub use park::{ParkOrder, WakeAnswer, WakeOutcome};
pub use reclaim::{Reclaim, DEFAULT_RECLAIM_GRACE};

/// A connection (one shim process).
pub type ConnId = u64;

/// Who is on a connection, from its `Hello` and socket.
#[derive(Debug, Clone)]
pub struct Peer {
    /// From `SO_PEERCRED`.
    pub pid: u32,
    /// From `SO_PEERCRED`: a group's members are one user's (they share its ledger).
    pub uid: u32,
    /// Its group.
    pub group: String,
    /// `namespace/name` or empty.
    pub pod: String,
    /// The group's resolver.
    pub resolver: Resolver,
    /// The group's priority.
    pub priority: i32,
    /// How long its bursts wait.
    pub wait_timeout: Duration,
    /// When its activity count last moved (or it connected).
    pub last_active: Instant,
    /// Its last activity count.
    pub activity: u64,
    /// Its priority comes from an entitlement, so it may get processes of other users
    /// ended; otherwise it is believed only about itself (same UID).
    pub vetted: bool,
    /// The arbiter holds a pidfd for it: it may be ended. Without one it never is (a PID
    /// alone may be reused).
    pub signalable: bool,
    /// What it may have (the entitlement's source, `not entitled: ...`, `unrestricted`).
    pub entitlement: String,
    /// What it declared beyond its entitlement, if anything.
    pub capped: String,
    /// Idle this long, its group may be parked (`GPUFRAC_PARK_AFTER`); `None`: never.
    pub park_after: Option<Duration>,
    /// The group's share of each GPU's time; `None`: not controlled ([`compute`]).
    pub compute: Option<ComputeSpec>,
}

/// A process chosen to be ended: for a priority burst, or to give a guarantee its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    /// Its connection.
    pub conn: ConnId,
    /// Its PID (from `SO_PEERCRED`).
    pub pid: u32,
    /// Its group.
    pub group: String,
    /// Burst bytes it holds on the GPU.
    pub bytes: u64,
    /// Why it is chosen: `lower priority (0 < 10)`, `idle for 360s`, or for a guarantee.
    pub why: String,
}

/// A holder chosen to swap its burst memory out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapVictim {
    /// Its connection.
    pub conn: ConnId,
    /// The GPU.
    pub device: DeviceId,
    /// Its PID.
    pub pid: u32,
    /// Its group.
    pub group: String,
    /// Burst bytes it holds there (what it is expected to move to host RAM).
    pub bytes: u64,
}

/// Where a member's burst memory is.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Residency {
    #[default]
    Resident,
    /// Told to swap out; the answer is awaited.
    SwappingOut,
    /// Its burst memory is in host RAM.
    Swapped,
}

/// One process of a group on one GPU.
#[derive(Debug, Default, Clone, Copy)]
struct Member {
    held: u64,
    granted: u64,
    /// Bytes in host RAM while swapped out, as the node's host RAM counts them (within the
    /// swap limit's room when reported).
    host_bytes: u64,
    /// Bytes it says it keeps in host RAM, within its group's limit: what a swap-in may
    /// bring back. More than `host_bytes` when reports crossed and the swap limit's room
    /// was smaller than the swap-out: that memory is in host RAM all the same, and a
    /// swap-in refused for it would be refused for ever.
    host_reported: u64,
    residency: Residency,
    /// Since when it holds burst memory on the device: its quantum counts from here.
    resident_since: Option<Instant>,
    /// Since when it is swapped out (or being swapped out).
    swapped_since: Option<Instant>,
    /// Told that memory is free to come back (once per swap-out).
    resume_sent: bool,
    /// Its swap-in was granted and its report is awaited: the grant is being mapped, none
    /// of it is unused.
    swapping_in: bool,
    /// Burst bytes it was told to move to host RAM (while it swaps out).
    moving: u64,
    /// Chosen to be ended for a guarantee: what it held is counted as paid by ending it.
    ended_for_debt: bool,
    /// Told to swap out for a guarantee: what its answer moves is counted as swapped.
    swapping_for_debt: bool,
    /// Time spent in waits already answered.
    waited: Duration,
    /// Time spent swapped out, swap-ins already done.
    swapped_for: Duration,
    /// Where its memory is, for a parkable group.
    park: park::MemberPark,
    /// Bytes of its memory in host RAM while parked.
    parked_bytes: u64,
    /// Burst bytes it held when parked: what its wake lends it again.
    parked_grant: u64,
    /// What it could not move off the device when parked (contexts, small allocations),
    /// as it reported then: what its parked group still reserves.
    left_on_device: u64,
    /// Parked by the arbiter with the driver's checkpoint API (its wake restores it).
    checkpointed: bool,
    /// Since when its wake has waited, while it waits.
    wake_asked: Option<Instant>,
    /// The lease state it was last told ([`compute`]); `None`: nothing yet.
    lease_told: Option<(u8, u32)>,
    /// Its group uses the swap resolver and the arbiter can signal it: a swap can take
    /// its burst memory back (see `Policy::swap_victims`).
    swaps: bool,
}

/// How long a swap-in waits before it is answered `Timeout`. Every wait has a deadline,
/// so that a queue always empties; a swapped-out process still waits for its memory as
/// long as it takes: its shim (`come_back` in shim/src/control/swap.rs) asks again after any
/// answer but a grant, and while connected waits this long plus half a second for one, so
/// the arbiter's answer comes first and the next ask starts a fresh wait.
const RESUME_WAIT: Duration = Duration::from_secs(3600);

impl Member {
    fn grant(&mut self, bytes: u64, now: Instant) {
        if self.granted == 0 && self.residency == Residency::Resident {
            self.resident_since = Some(now);
        }
        self.granted = self.granted.saturating_add(bytes);
    }

    /// Host RAM it takes: what it keeps there, or, while it is being told to swap out,
    /// what it was lent (what it is about to move there).
    fn host_committed(&self) -> u64 {
        let swapped = if self.residency == Residency::SwappingOut { self.granted } else { self.host_bytes };
        swapped.saturating_add(self.parked_bytes)
    }

    /// What its own swap may have on the device beyond its grant, whatever the timing of
    /// the device's count: while it swaps out, what it was told to move (a `Release` may
    /// cross the copy, and the device frees the memory after the copy); while swapped out,
    /// its host copy (a swap-in maps it back before its report, and a listing taken
    /// before the swap-out's report still shows it). The [`backstop`] never charges it.
    fn in_transit(&self) -> u64 {
        match self.residency {
            Residency::Resident => 0,
            Residency::SwappingOut => self.moving.max(self.granted),
            Residency::Swapped => self.host_reported,
        }
    }

    fn new(held: u64, granted: u64, host_bytes: u64, now: Instant) -> Member {
        let swapped = host_bytes > 0;
        Member {
            held,
            granted,
            host_bytes,
            host_reported: host_bytes,
            residency: if swapped { Residency::Swapped } else { Residency::Resident },
            resident_since: (granted > 0).then_some(now),
            swapped_since: swapped.then_some(now),
            ..Member::default()
        }
    }
}

/// Processes sharing one request and limit on one GPU.
#[derive(Debug, Clone)]
struct Group {
    request: u64,
    limit: u64,
    /// The user whose processes its members are.
    uid: u32,
    members: BTreeMap<ConnId, Member>,
    /// When a member last asked for burst memory: a group that asked lately is growing,
    /// and may ask for everything up to its limit.
    last_ask: Option<Instant>,
    /// Its burst under way, if any ([`wait`]).
    burst: wait::BurstMark,
    /// Idle this long, it may be parked; `None`: never.
    park_after: Option<Duration>,
    /// Where its memory is (always resident for groups that are not parkable).
    park: park::GroupPark,
    /// When it was admitted or last woken: idleness counts from here at the earliest.
    active_since: Instant,
    /// Parks and wakes so far, and how long the last ones took.
    parks: u64,
    wakes: u64,
    last_park: Duration,
    last_wake: Duration,
    /// Its share of the GPU's time and what it uses ([`compute`]).
    compute: compute::GroupCompute,
    /// What it holds beyond what its shims charged, per the device's count ([`backstop`]).
    uncounted: backstop::Uncounted,
}

impl Group {
    fn granted(&self) -> u64 {
        self.members.values().fold(0u64, |sum, m| sum.saturating_add(m.granted))
    }
    /// The burst range: what the group may borrow in all.
    fn range(&self) -> u64 {
        self.limit - self.request
    }
    /// What it may still borrow: memory it holds uncounted counts against its limit.
    fn room(&self) -> u64 {
        self.range().saturating_sub(self.granted()).saturating_sub(self.uncounted.charged)
    }
    /// Lent bytes its members hold but do not use (as last reported): a swap-in under way
    /// uses all it was granted for.
    fn unused(&self) -> u64 {
        let held: u64 = self.members.values().fold(0u64, |sum, m| {
            let mapping = if m.swapping_in { m.host_reported } else { 0 };
            sum.saturating_add(m.held).saturating_add(mapping)
        });
        self.granted().saturating_sub(held.saturating_sub(self.request))
    }
    /// What its members' own swaps may have on the device beyond their grants.
    fn in_transit(&self) -> u64 {
        self.members.values().fold(0u64, |sum, m| sum.saturating_add(m.in_transit()))
    }
}

/// A burst waiting in a GPU's queue.
#[derive(Debug, Clone)]
struct Waiter {
    conn: ConnId,
    group: String,
    seq: u64,
    /// A swap-in: it waits without deadline.
    resume: bool,
    bytes: u64,
    preferred: u64,
    /// The next step of its group's burst under way when it asked, not a new burst
    /// (see [`wait`]).
    continues: bool,
    since: Instant,
    deadline: Instant,
}

/// One GPU's ledger.
#[derive(Debug, Clone)]
struct Gpu {
    /// What gpufrac manages of the GPU: all of it, or `--gpu-memory`.
    total: u64,
    /// The rest of the GPU (`--gpu-memory`): memory processes outside gpufrac may use
    /// without taking any from what gpufrac manages.
    headroom: u64,
    groups: BTreeMap<String, Group>,
    queue: VecDeque<Waiter>,
    /// Parked members whose wake waits for room, in order.
    wakers: VecDeque<park::Waker>,
    /// When a burst was last granted or queued here.
    last_busy: Instant,
    /// Processes NVML lists on this GPU that are not registered here, with the memory
    /// they use: programs without the shim, or, after an arbiter restart, shims not yet
    /// back. Their memory is never lent.
    outside: Vec<(u32, u64)>,
    /// Every process NVML last listed here with the memory it uses, registered or not:
    /// what a process re-registering with grants is believed to hold at most.
    seen: HashMap<u32, u64>,
    /// NVML has answered for this GPU at least once.
    observed: bool,
    /// Until when memory outside gpufrac may be shims still coming back to a restarted
    /// arbiter (their reconnect backoff is at most 2 s).
    reconnecting_until: Instant,
    /// The order of asks and bursts on it, for telling bursts under way from resting loans
    /// ([`wait`]).
    bursts: wait::BurstClock,
    /// Groups registered here whose burst is under way on another GPU (a tensor-parallel
    /// server's workers, one per GPU): here too their burst counts as under way
    /// ([`Policy::share_bursts`]).
    elsewhere: std::collections::BTreeSet<String>,
    /// Since when guarantees have been owed memory that is lent out (restarted when the
    /// debt grows: a new guarantee gets a grace of its own).
    short_since: Option<Instant>,
    /// The debt when it was last looked at.
    short_last: u64,
    /// How the debts owed to guarantees here were paid, bytes in all.
    repaid: Repaid,
    /// Who holds the GPU's time and who waits for it ([`compute`]).
    leases: compute::LeaseBook,
    /// What a context takes on it, when known: the slack of the [`backstop`]'s comparison,
    /// and every shim's first charge for a context (see [`contexts`]).
    context_bytes: Option<u64>,
    /// A shim's report of it waiting for NVML's confirmation.
    context_candidate: Option<contexts::Candidate>,
}

/// Bytes of the debts owed to guarantees on a GPU, by how they were paid back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Repaid {
    /// Given back by their borrowers (unused grants, or freed while the debt was open).
    pub given_back: u64,
    /// Moved to host RAM by swap-resolver holders.
    pub swapped: u64,
    /// Freed by ending holders after the reclaim grace.
    pub ended: u64,
}

/// How long after the arbiter starts memory outside gpufrac may be shims reconnecting.
const RECONNECT_GRACE: Duration = Duration::from_secs(5);

impl Gpu {
    /// What the groups' requests reserve on the device: a parked group's request is not
    /// reserved, only what it left there.
    fn guaranteed(&self) -> u64 {
        // Saturating: reports are capped at the GPU's size, but a sum must never wrap.
        self.groups.values().fold(0u64, |sum, g| sum.saturating_add(g.reserved()))
    }
    fn burst(&self) -> u64 {
        self.groups.values().fold(0u64, |sum, g| sum.saturating_add(g.granted()))
    }
    /// Memory used outside gpufrac beyond the headroom: what it takes from the managed
    /// memory.
    fn outside(&self) -> u64 {
        self.beyond_headroom(self.outside_seen())
    }
    /// Memory NVML shows used by processes outside gpufrac, all of it.
    fn outside_seen(&self) -> u64 {
        self.outside.iter().fold(0u64, |sum, &(_, bytes)| sum.saturating_add(bytes))
    }
    /// What of `outside` (bytes used outside gpufrac) the headroom does not hold.
    fn beyond_headroom(&self, outside: u64) -> u64 {
        outside.saturating_sub(self.headroom)
    }
    fn free(&self) -> u64 {
        self.room().max(0) as u64
    }
    /// Memory left to lend; negative when guarantees are owed lent memory (a group was
    /// admitted while its request was lent out) or memory outside gpufrac overcommits the
    /// GPU: that much has to come back before anything is lent again. Memory groups hold
    /// beyond what their shims charged counts as outside memory does.
    fn room(&self) -> i128 {
        self.total as i128 - self.guaranteed() as i128 - self.burst() as i128 - self.unaccounted() as i128
    }
    /// What the guarantees are owed: lent memory that must come back. Requests of
    /// resident parkable groups that crowd out other guarantees are not owed by
    /// borrowers: parking those groups pays that part ([`park`]).
    fn shortfall(&self) -> u64 {
        let owed = (-self.room()).clamp(0, u64::MAX as i128) as u64;
        owed.saturating_sub(self.crowding().min(self.parkable_resident()))
    }
    /// What the guarantees are owed beyond what is on its way back already (holders being
    /// ended or swapped out for it): what a borrower giving back now pays.
    fn open_debt(&self) -> u64 {
        let settling = self
            .members()
            .filter(|(_, _, m)| m.ended_for_debt || m.residency == Residency::SwappingOut)
            .fold(0u64, |sum, (_, _, m)| sum.saturating_add(m.granted));
        self.shortfall().saturating_sub(settling)
    }
    fn members(&self) -> impl Iterator<Item = (&String, ConnId, &Member)> {
        self.groups.iter().flat_map(|(name, g)| g.members.iter().map(move |(&c, m)| (name, c, m)))
    }
    fn member_mut(&mut self, group: &str, conn: ConnId) -> Option<&mut Member> {
        self.groups.get_mut(group)?.members.get_mut(&conn)
    }
    fn waiter(&self, conn: ConnId) -> Option<&Waiter> {
        self.queue.iter().find(|w| w.conn == conn)
    }
}

/// What an `Acquire` gets at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Granted now, this many bytes.
    Granted(u64),
    /// Queued: a `Grant` or a timeout will follow.
    Queued,
    /// Refused.
    Denied(Denial),
}

/// The answer to a queued burst, decided later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// To whom.
    pub conn: ConnId,
    /// The request's sequence number.
    pub seq: u64,
    /// On which GPU.
    pub device: DeviceId,
    /// How long it waited.
    pub waited: Duration,
    /// Granted (`Ok(bytes)`) or denied.
    pub result: Result<u64, Denial>,
}

/// The node's GPUs and who holds what on them.
#[derive(Debug, Default)]
pub struct Policy {
    gpus: BTreeMap<DeviceId, Gpu>,
    peers: HashMap<ConnId, Peer>,
    /// Most host RAM for swapped-out memory (`--swap-limit`): what re-registering
    /// processes are believed to keep there at most, all together.
    swap_limit: u64,
    /// How long borrowers may give back what a guarantee is owed before holders are ended
    /// (`--reclaim-grace`).
    reclaim_grace: Duration,
    /// How far the requests of parkable groups on a GPU may add up past what the other
    /// groups leave (`--oversubscribe`, 1: not past it).
    oversubscribe: f64,
    /// Parks use the driver's checkpoint API (the arbiter has it), else the shim's swap.
    checkpoint: bool,
    /// What the [`backstop`]'s comparisons found, until the server takes it.
    findings: Vec<Finding>,
}

pub use gpufrac_common::gpu_uuid::format as uuid_string;

/// A share (0 to 1) in per mille.
fn per_mille(share: f64) -> u32 {
    (share.clamp(0.0, 1.0) * 1000.0).round() as u32
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl Policy {
    /// A policy for GPUs `(uuid, memory)`.
    pub fn new(gpus: &[(DeviceId, u64)]) -> Policy {
        let now = Instant::now();
        Policy {
            gpus: gpus
                .iter()
                .map(|&(id, total)| {
                    let gpu = Gpu {
                        total,
                        headroom: 0,
                        groups: BTreeMap::new(),
                        queue: VecDeque::new(),
                        wakers: VecDeque::new(),
                        last_busy: now,
                        outside: Vec::new(),
                        seen: HashMap::new(),
                        observed: false,
                        reconnecting_until: now + RECONNECT_GRACE,
                        bursts: Default::default(),
                        elsewhere: Default::default(),
                        short_since: None,
                        short_last: 0,
                        repaid: Repaid::default(),
                        leases: Default::default(),
                        context_bytes: None,
                        context_candidate: None,
                    };
                    (id, gpu)
                })
                .collect(),
            peers: HashMap::new(),
            swap_limit: u64::MAX,
            reclaim_grace: reclaim::DEFAULT_RECLAIM_GRACE,
            oversubscribe: 1.0,
            checkpoint: false,
            findings: Vec::new(),
        }
    }

    /// Sets how long borrowers may give back what a guarantee is owed before holders are
    /// ended for it (`--reclaim-grace`).
    pub fn set_reclaim_grace(&mut self, grace: Duration) {
        self.reclaim_grace = grace;
    }

    /// Sets the node's limit on host RAM for swapped-out memory (`--swap-limit`).
    pub fn set_swap_limit(&mut self, swap_limit: u64) {
        self.swap_limit = swap_limit;
    }

    /// A connection said who it is.
    pub fn hello(&mut self, conn: ConnId, peer: Peer) {
        self.peers.insert(conn, peer);
    }

    /// The peer on `conn`, if it said hello.
    pub fn peer(&self, conn: ConnId) -> Option<&Peer> {
        self.peers.get(&conn)
    }

    /// Whether `conn` is registered on `device` (a member of its group there).
    pub fn is_member(&self, conn: ConnId, device: &DeviceId) -> bool {
        let Some(peer) = self.peers.get(&conn) else { return false };
        self.gpus
            .get(device)
            .and_then(|gpu| gpu.groups.get(&peer.group))
            .is_some_and(|group| group.members.contains_key(&conn))
    }

    /// The memory of a GPU the arbiter manages.
    pub fn total(&self, device: &DeviceId) -> Option<u64> {
        self.gpus.get(device).map(|g| g.total)
    }

    /// Manages only `managed` bytes of each GPU (`--gpu-memory`; at most the GPU, as
    /// [`crate::arbiter::gpus::managed`] checks): the rest is headroom for processes
    /// outside gpufrac, whose memory takes from the managed memory only past it.
    pub fn set_managed(&mut self, managed: &[(DeviceId, u64)]) {
        for (id, bytes) in managed {
            if let Some(gpu) = self.gpus.get_mut(id) {
                let physical = gpu.total.saturating_add(gpu.headroom);
                gpu.total = (*bytes).min(physical);
                gpu.headroom = physical - gpu.total;
            }
        }
    }

    /// The memory the arbiter manages on each GPU (what a `Welcome` tells the shims).
    pub fn totals(&self) -> Vec<(DeviceId, u64)> {
        self.gpus.iter().map(|(id, g)| (*id, g.total)).collect()
    }

    /// The request and limit of the group `conn` is a member of on `device`.
    pub fn group_of(&self, conn: ConnId, device: &DeviceId) -> Option<(u64, u64)> {
        let peer = self.peers.get(&conn)?;
        let group = self.gpus.get(device)?.groups.get(&peer.group)?;
        Some((group.request, group.limit))
    }

    /// Notes, for status, what a registration of `conn` declared beyond its entitlement.
    pub fn note_capped(&mut self, conn: ConnId, what: &str) {
        if let Some(p) = self.peers.get_mut(&conn) {
            if !p.capped.contains(what) {
                if !p.capped.is_empty() {
                    p.capped.push_str("; ");
                }
                // Bounded: one note per kind of cut, a handful of GPUs.
                if p.capped.len() < 1024 {
                    p.capped.push_str(what);
                }
            }
        }
    }

    /// The activity count of `conn` moved (or not).
    pub fn activity(&mut self, conn: ConnId, count: u64, now: Instant) {
        if let Some(p) = self.peers.get_mut(&conn) {
            if p.activity != count {
                p.activity = count;
                p.last_active = now;
            }
        }
    }

    /// The GPU of `device` and the group of `conn` on it, if `conn` is a member there.
    fn member_gpu(&mut self, conn: ConnId, device: &DeviceId) -> Option<(&mut Gpu, String)> {
        let group = self.peers.get(&conn)?.group.clone();
        let gpu = self.gpus.get_mut(device)?;
        gpu.groups.get(&group)?.members.get(&conn)?;
        Some((gpu, group))
    }

    /// The status document.
    pub fn status(&self) -> Status {
        let now = Instant::now();
        let gpus = self
            .gpus
            .iter()
            .map(|(id, gpu)| {
                let mut processes = Vec::new();
                for (name, conn, m) in gpu.members() {
                    let Some(peer) = self.peers.get(&conn) else { continue };
                    let Some(group) = gpu.groups.get(name) else { continue };
                    let waiting = gpu.waiter(conn);
                    let state = match (m.park.shown(m.wake_asked.is_some()), m.residency, waiting) {
                        (Some(parked), _, _) => parked,
                        (None, Residency::Swapped | Residency::SwappingOut, _) => "swapped",
                        (None, Residency::Resident, Some(_)) => "waiting",
                        (None, Residency::Resident, None) => "running",
                    };
                    let compute = group.compute.spec.map(|_| Self::compute_shown(gpu, name, now));
                    let waited = m.waited + waiting.map_or(Duration::ZERO, |w| now - w.since);
                    let swapped = m.swapped_for
                        + m.swapped_since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                    processes.push(ProcessStatus {
                        pid: peer.pid,
                        uid: peer.uid,
                        group: crate::entitlement::shown_group(name).to_owned(),
                        pod: peer.pod.clone(),
                        request: group.request,
                        limit: group.limit,
                        held: m.held,
                        granted: m.granted,
                        priority: peer.priority,
                        resolver: peer.resolver.to_string(),
                        state: state.to_owned(),
                        host_bytes: m.host_bytes,
                        waited_ms: waited.as_millis() as u64,
                        swapped_ms: swapped.as_millis() as u64,
                        entitlement: peer.entitlement.clone(),
                        capped: peer.capped.clone(),
                        group_key: name.clone(),
                        park_after_ms: group.park_after.map_or(0, |d| d.as_millis().max(1) as u64),
                        parked_bytes: m.parked_bytes,
                        parks: group.parks,
                        wakes: group.wakes,
                        last_park_ms: group.last_park.as_millis() as u64,
                        last_wake_ms: group.last_wake.as_millis() as u64,
                        compute_request_pm: group.compute.spec.map_or(0, |c| c.request.per_mille().into()),
                        compute_limit_pm: group.compute.spec.map_or(0, |c| c.limit.per_mille().into()),
                        compute_held_pm: compute.map_or(0, |c| per_mille(c.0)),
                        compute_allowance_pm: compute.map_or(0, |c| per_mille(c.1)),
                        compute_state: compute.map_or(String::new(), |c| c.2.to_owned()),
                        uncounted: group.uncounted.charged,
                    });
                }
                GpuStatus {
                    uuid: uuid_string(id),
                    total: gpu.total,
                    guaranteed: gpu.guaranteed(),
                    burst: gpu.burst(),
                    free: gpu.free(),
                    outside: gpu.outside_seen(),
                    headroom: gpu.headroom,
                    uncounted: gpu.uncounted(),
                    reclaiming: gpu.shortfall(),
                    repaid_given_back: gpu.repaid.given_back,
                    repaid_swapped: gpu.repaid.swapped,
                    repaid_ended: gpu.repaid.ended,
                    waiting: gpu.queue.len(),
                    swapped: gpu.members().map(|(_, _, m)| m.host_bytes).sum(),
                    parked: gpu.members().map(|(_, _, m)| m.parked_bytes).fold(0u64, u64::saturating_add),
                    parkable_requests: gpu.parkable_requests(),
                    waking: gpu.wakers.len(),
                    compute_requested_pm: gpu
                        .groups
                        .values()
                        .filter_map(|g| g.compute.spec)
                        .map(|c| u32::from(c.request.per_mille()))
                        .sum(),
                    compute_open: gpu.leases.open(),
                    processes,
                    truncated: 0,
                }
            })
            .collect();
        Status { gpus, swap_limit: 0 }
    }
}

/// What the resolvers' unit tests share.
#[cfg(test)]
mod testing {
    use super::*;

    pub const GIB: u64 = 1 << 30;
    pub const GPU: DeviceId = [7; 16];

    pub fn peer(group: &str, timeout_ms: u64) -> Peer {
        Peer {
            pid: 100,
            uid: 1000,
            group: group.into(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout: Duration::from_millis(timeout_ms),
            last_active: Instant::now(),
            activity: 0,
            vetted: false,
            signalable: true,
            entitlement: String::new(),
            capped: String::new(),
            park_after: None,
            compute: None,
        }
    }

    /// A 16 GiB GPU with groups `(conn, name, request, limit)`, one member each.
    pub fn policy_with(groups: &[(ConnId, &str, u64, u64)]) -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for &(conn, group, request, limit) in groups {
            p.hello(conn, peer(group, 1000));
            p.register(conn, GPU, 16 * GIB, request, limit, 0, 0, 0).unwrap();
        }
        p
    }

    /// The state `gpufrac status` shows for `conn`.
    pub fn state(p: &Policy, conn: ConnId) -> String {
        let group = p.peer(conn).unwrap().group.clone();
        p.status().gpus[0].processes.iter().find(|x| x.group == group).unwrap().state.clone()
    }
}
