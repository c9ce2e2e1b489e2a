//! The arbiter's ledger and its wait-and-retry policy, as pure state: no sockets, no
//! clock of its own (callers pass `now`), so it is tested directly.
//!
//! Per GPU: each group's request is guaranteed (admitted only while the sum of requests
//! and of lent burst memory fits the GPU), and memory above a request is lent as burst
//! grants from what no request reserves. A grant never takes a group past its limit nor
//! the GPU past its memory. Bursts that do not fit wait in one FIFO queue per GPU and are
//! granted in order as memory comes back; the head is never bypassed (no starvation),
//! and every waiter gives up at its deadline (no deadlock: a waiter holding burst memory
//! cannot block the others beyond its own timeout).
//!
//! The swap resolver takes turns: when the burst at the head of a GPU's queue uses it
//! and does not fit, holders of burst memory that also use swap, have been resident for
//! their quantum and fit under the node's host-RAM cap are asked to move their burst
//! memory to host RAM. They come back when they ask (a gated call) or when memory is
//! free again; a swap-in waits without deadline, ahead of nobody (FIFO).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId};
use gpufrac_common::Resolver;

use crate::status::{GpuStatus, ProcessStatus, Status};

/// A connection (one shim process).
pub type ConnId = u64;

/// Who is on a connection, from its `Hello` and socket.
#[derive(Debug, Clone)]
pub struct Peer {
    /// From `SO_PEERCRED`.
    pub pid: u32,
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
}

/// A process chosen to be ended so that a priority burst can be served.
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
    /// Why it is chosen: `lower priority (0 < 10)` or `idle for 6m`.
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

#[derive(Debug, Default, Clone, Copy)]
struct Member {
    held: u64,
    granted: u64,
    /// Bytes in host RAM while swapped out.
    host_bytes: u64,
    residency: Residency,
    /// Since when it holds burst memory on the device: its quantum counts from here.
    resident_since: Option<Instant>,
    /// Since when it is swapped out (or being swapped out).
    swapped_since: Option<Instant>,
    /// Told that memory is free to come back (once per swap-out).
    resume_sent: bool,
    /// Time spent in waits already answered.
    waited: Duration,
    /// Time spent swapped out, swap-ins already done.
    swapped_for: Duration,
}

/// How long a holder asked to swap out may take to answer before others are chosen.
const SWAP_OUT_ANSWER: Duration = Duration::from_secs(60);

/// How far away a swap-in's deadline is: it waits until memory comes back.
const NO_DEADLINE: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

impl Member {
    fn grant(&mut self, bytes: u64, now: Instant) {
        if self.granted == 0 && self.residency == Residency::Resident {
            self.resident_since = Some(now);
        }
        self.granted += bytes;
    }

    fn new(held: u64, granted: u64, host_bytes: u64, now: Instant) -> Member {
        let swapped = host_bytes > 0;
        Member {
            held,
            granted,
            host_bytes,
            residency: if swapped { Residency::Swapped } else { Residency::Resident },
            resident_since: (granted > 0).then_some(now),
            swapped_since: swapped.then_some(now),
            ..Member::default()
        }
    }
}

#[derive(Debug)]
struct Group {
    request: u64,
    limit: u64,
    members: BTreeMap<ConnId, Member>,
}

impl Group {
    fn granted(&self) -> u64 {
        self.members.values().map(|m| m.granted).sum()
    }
}

#[derive(Debug)]
struct Waiter {
    conn: ConnId,
    group: String,
    seq: u64,
    /// A swap-in: it waits without deadline.
    resume: bool,
    bytes: u64,
    preferred: u64,
    since: Instant,
    deadline: Instant,
}

#[derive(Debug)]
struct Gpu {
    total: u64,
    groups: BTreeMap<String, Group>,
    queue: VecDeque<Waiter>,
    /// When a burst was last granted or queued here.
    last_busy: Instant,
    /// Processes NVML lists on this GPU that are not registered here, with the memory
    /// they use: programs without the shim, or, after an arbiter restart, shims not yet
    /// back. Their memory is never lent.
    outside: Vec<(u32, u64)>,
    /// Until when memory outside gpufrac may be shims still coming back to a restarted
    /// arbiter (their reconnect backoff is at most 2 s).
    reconnecting_until: Instant,
}

/// How long after the arbiter starts memory outside gpufrac may be shims reconnecting.
const RECONNECT_GRACE: Duration = Duration::from_secs(5);

impl Gpu {
    fn guaranteed(&self) -> u64 {
        self.groups.values().map(|g| g.request).sum()
    }
    fn burst(&self) -> u64 {
        self.groups.values().map(Group::granted).sum()
    }
    fn outside(&self) -> u64 {
        self.outside.iter().map(|&(_, bytes)| bytes).sum()
    }
    fn free(&self) -> u64 {
        self.room().max(0) as u64
    }
    /// Memory left to lend, negative when memory outside gpufrac (which no admission
    /// check bounds) overcommits the GPU: resolvers must free that much more first.
    fn room(&self) -> i128 {
        self.total as i128 - (self.guaranteed() + self.burst() + self.outside()) as i128
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
}

pub use gpufrac_common::gpu_uuid::format as uuid_string;

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl Policy {
    /// A policy for GPUs `(uuid, memory)`.
    pub fn new(gpus: &[(DeviceId, u64)]) -> Policy {
        Policy {
            gpus: gpus
                .iter()
                .map(|&(id, total)| {
                    let gpu = Gpu {
                        total,
                        groups: BTreeMap::new(),
                        queue: VecDeque::new(),
                        last_busy: Instant::now(),
                        outside: Vec::new(),
                        reconnecting_until: Instant::now() + RECONNECT_GRACE,
                    };
                    (id, gpu)
                })
                .collect(),
            peers: HashMap::new(),
        }
    }

    /// A connection said who it is.
    pub fn hello(&mut self, conn: ConnId, peer: Peer) {
        self.peers.insert(conn, peer);
    }

    /// The peer on `conn`, if it said hello.
    pub fn peer(&self, conn: ConnId) -> Option<&Peer> {
        self.peers.get(&conn)
    }

    /// Registers `conn` on a device. A new group is admitted only if its request fits
    /// beside the other groups' requests and the memory lent out now; a process
    /// re-registering after an arbiter restart keeps what it holds.
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
    ) -> Result<(), String> {
        let peer = self.peers.get(&conn).ok_or("Register before Hello")?.clone();
        let gpu = self
            .gpus
            .get_mut(&device)
            .ok_or_else(|| format!("GPU {} is not managed by this arbiter", uuid_string(&device)))?;
        if total != gpu.total {
            tracing::warn!(gpu = %uuid_string(&device), shim = total, arbiter = gpu.total, "shim and NVML disagree on the GPU's memory");
        }
        if !gpu.groups.contains_key(&peer.group) {
            let committed = gpu.guaranteed() + gpu.burst();
            if granted == 0 && committed.saturating_add(request) > gpu.total {
                return Err(format!(
                    "GPUFRAC_MEMORY_REQUEST ({}) does not fit on GPU {}: {} of {} is guaranteed to other groups and {} is lent out",
                    gib(request),
                    uuid_string(&device),
                    gib(gpu.guaranteed()),
                    gib(gpu.total),
                    gib(gpu.burst())
                ));
            }
            gpu.groups.insert(peer.group.clone(), Group { request, limit, members: BTreeMap::new() });
        }
        let group = gpu.groups.get_mut(&peer.group).ok_or("group vanished")?;
        if (group.request, group.limit) != (request, limit) {
            tracing::warn!(group = %peer.group, "a member's request/limit differ from the group's; the group keeps the first");
        }
        // What a re-registering process says it was lent cannot pass its group's limit.
        let (granted, host_bytes) = (granted.min(group.limit - group.request), host_bytes.min(group.limit));
        group.members.insert(conn, Member::new(held, granted, host_bytes, Instant::now()));
        // Its memory is in the ledger now, no longer outside it.
        gpu.outside.retain(|&(pid, _)| pid != peer.pid);
        Ok(())
    }

    /// What NVML lists on `device` now, `(pid, bytes used)`: the memory of processes not
    /// registered here is kept out of what is lent. Returns the bursts that now fit.
    pub fn observe_processes(
        &mut self,
        device: DeviceId,
        listed: &[(u32, u64)],
        now: Instant,
    ) -> Vec<Answer> {
        let Some(gpu) = self.gpus.get_mut(&device) else { return Vec::new() };
        let registered: std::collections::HashSet<u32> = gpu
            .groups
            .values()
            .flat_map(|g| g.members.keys())
            .filter_map(|conn| self.peers.get(conn).map(|p| p.pid))
            .collect();
        gpu.outside =
            listed.iter().copied().filter(|&(pid, bytes)| bytes > 0 && !registered.contains(&pid)).collect();
        Self::drain(device, gpu, now)
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
        let Some(peer) = self.peers.get(&conn) else { return Outcome::Denied(Denial::UnknownDevice) };
        let (group_name, timeout) = (peer.group.clone(), peer.wait_timeout);
        let Some(gpu) = self.gpus.get_mut(&device) else { return Outcome::Denied(Denial::UnknownDevice) };
        let free = gpu.free();
        let Some(group) = gpu.groups.get_mut(&group_name) else {
            return Outcome::Denied(Denial::UnknownDevice);
        };
        let room = (group.limit - group.request).saturating_sub(group.granted());
        let Some(member) = group.members.get_mut(&conn) else {
            return Outcome::Denied(Denial::UnknownDevice);
        };
        member.held = held;
        if bytes > room {
            return Outcome::Denied(Denial::OverLimit);
        }
        gpu.last_busy = now;
        if gpu.queue.is_empty() && free >= bytes {
            let grant = preferred.min(free).min(room).max(bytes);
            member.grant(grant, now);
            return Outcome::Granted(grant);
        }
        gpu.queue.push_back(Waiter {
            conn,
            group: group_name,
            seq,
            resume,
            bytes,
            preferred,
            since: now,
            deadline: if resume { now + NO_DEADLINE } else { now + timeout },
        });
        Outcome::Queued
    }

    /// Gives back burst memory; returns the queued bursts that now fit.
    pub fn release(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        bytes: u64,
        held: u64,
        now: Instant,
    ) -> Vec<Answer> {
        let Some(group_name) = self.peers.get(&conn).map(|p| p.group.clone()) else { return Vec::new() };
        let Some(gpu) = self.gpus.get_mut(&device) else { return Vec::new() };
        if let Some(m) = gpu.groups.get_mut(&group_name).and_then(|g| g.members.get_mut(&conn)) {
            m.granted = m.granted.saturating_sub(bytes);
            m.held = held;
        }
        Self::drain(device, gpu, now)
    }

    /// A connection closed (the process exited or was killed): everything it held or
    /// was lent comes back at once, and a group without members frees its request.
    pub fn disconnect(&mut self, conn: ConnId, now: Instant) -> Vec<Answer> {
        self.peers.remove(&conn);
        let mut grants = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            gpu.queue.retain(|w| w.conn != conn);
            for group in gpu.groups.values_mut() {
                group.members.remove(&conn);
            }
            gpu.groups.retain(|_, g| !g.members.is_empty());
            grants.extend(Self::drain(device, gpu, now));
        }
        grants
    }

    /// Waiters whose deadline passed are denied; the waiters behind them may now fit.
    pub fn expire(&mut self, now: Instant) -> Vec<Answer> {
        let mut answers = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            let before = gpu.queue.len();
            let (expired, kept): (VecDeque<Waiter>, VecDeque<Waiter>) =
                std::mem::take(&mut gpu.queue).into_iter().partition(|w| w.deadline <= now);
            gpu.queue = kept;
            for w in expired {
                answers.push(Self::deny_waiter(gpu, device, w, Denial::Timeout, now));
            }
            if gpu.queue.len() != before {
                answers.extend(Self::drain(device, gpu, now));
            }
        }
        answers
    }

    fn credit_wait(gpu: &mut Gpu, group: &str, conn: ConnId, waited: Duration) {
        if let Some(m) = gpu.groups.get_mut(group).and_then(|g| g.members.get_mut(&conn)) {
            m.waited += waited;
        }
    }

    fn drain(device: DeviceId, gpu: &mut Gpu, now: Instant) -> Vec<Answer> {
        let mut answers = Vec::new();
        while let Some(head) = gpu.queue.front() {
            let group_room =
                gpu.groups.get(&head.group).map(|g| (g.limit - g.request).saturating_sub(g.granted()));
            if group_room.is_none_or(|room| room < head.bytes) {
                // Its group can no longer take it (it changed meanwhile): answer now.
                if let Some(w) = gpu.queue.pop_front() {
                    answers.push(Self::deny_waiter(gpu, device, w, Denial::OverLimit, now));
                }
                continue;
            }
            if gpu.free() < head.bytes {
                if let Some(victim) = Self::deadlocked(gpu, now) {
                    // Nobody can give memory back: refuse the waiter holding the most,
                    // whose out-of-memory error makes it free what it holds.
                    if let Some(pos) = gpu.queue.iter().position(|w| w.conn == victim) {
                        if let Some(w) = gpu.queue.remove(pos) {
                            answers.push(Self::deny_waiter(gpu, device, w, Denial::Deadlock, now));
                            continue;
                        }
                    }
                }
                // A swap-in that fits goes ahead: its process is held at its gate, possibly
                // with memory the head needs, and comes back with nothing new to lend.
                let free = gpu.free();
                let Some(pos) = gpu.queue.iter().position(|w| w.resume && w.bytes <= free) else { break };
                let Some(w) = gpu.queue.remove(pos) else { break };
                let room =
                    gpu.groups.get(&w.group).map_or(0, |g| (g.limit - g.request).saturating_sub(g.granted()));
                let grant = w.bytes.min(room);
                answers.push(Self::grant_waiter(gpu, device, w, grant, now));
                continue;
            }
            let Some(w) = gpu.queue.pop_front() else { break };
            let grant = w.preferred.min(gpu.free()).min(group_room.unwrap_or(0)).max(w.bytes);
            answers.push(Self::grant_waiter(gpu, device, w, grant, now));
        }
        answers
    }

    fn deny_waiter(gpu: &mut Gpu, device: DeviceId, w: Waiter, reason: Denial, now: Instant) -> Answer {
        Self::credit_wait(gpu, &w.group, w.conn, now - w.since);
        Answer { conn: w.conn, seq: w.seq, device, waited: now - w.since, result: Err(reason) }
    }

    fn grant_waiter(gpu: &mut Gpu, device: DeviceId, w: Waiter, grant: u64, now: Instant) -> Answer {
        if let Some(m) = gpu.groups.get_mut(&w.group).and_then(|g| g.members.get_mut(&w.conn)) {
            m.grant(grant, now);
            m.waited += now - w.since;
            // A holder that had to wait has not had its turn yet: its quantum starts now.
            if m.residency == Residency::Resident {
                m.resident_since = Some(now);
            }
        }
        gpu.last_busy = now;
        Answer { conn: w.conn, seq: w.seq, device, waited: now - w.since, result: Ok(grant) }
    }

    /// If every holder of burst memory on `gpu` is waiting for more, the waiting holder
    /// with the largest grant (never a swap-in: refusing it would not free anything).
    /// Just after a restart, memory outside gpufrac is likely shims coming back with
    /// what they hold: no deadlock is declared then (after it, a program without the shim
    /// does not stop gpufrac's own holders from breaking a deadlock).
    fn deadlocked(gpu: &Gpu, now: Instant) -> Option<ConnId> {
        if gpu.outside() > 0 && now < gpu.reconnecting_until {
            return None;
        }
        let mut holders = gpu
            .groups
            .values()
            .flat_map(|g| g.members.iter().filter(|(_, m)| m.granted > 0).map(|(&c, m)| (c, m.granted)))
            .peekable();
        holders.peek()?;
        let mut victim = None;
        for (conn, granted) in holders {
            let waiting = gpu.queue.iter().find(|w| w.conn == conn)?;
            if !waiting.resume && victim.is_none_or(|(_, g)| granted > g) {
                victim = Some((conn, granted));
            }
        }
        victim.map(|(c, _)| c)
    }

    /// Queues a burst like `acquire` and returns what the queue decided at once (for a
    /// waiter refused to break a deadlock). Used by the server after `Outcome::Queued`.
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

    /// Re-examines a GPU's queue (after a burst was queued): breaks a deadlock if there is one.
    pub fn settle(&mut self, device: DeviceId, now: Instant) -> Vec<Answer> {
        match self.gpus.get_mut(&device) {
            Some(gpu) => Self::drain(device, gpu, now),
            None => Vec::new(),
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

    /// For each waiting burst whose group uses the priority resolver: the fewest holders
    /// of burst memory on that GPU, each of lower priority or idle longer than
    /// `idle_timeout` (and never of higher priority), whose grants make the burst fit.
    /// Bursts that no such set can serve are left to wait. `spared` are already being ended.
    pub fn priority_victims(&self, now: Instant, idle_timeout: Duration, spared: &[ConnId]) -> Vec<Victim> {
        let mut chosen: Vec<Victim> = Vec::new();
        for gpu in self.gpus.values() {
            for w in &gpu.queue {
                let Some(req) = self.peers.get(&w.conn).filter(|p| p.resolver == Resolver::Priority) else {
                    continue;
                };
                let mut candidates: Vec<Victim> = gpu
                    .groups
                    .values()
                    .flat_map(|g| g.members.iter())
                    .filter(|(&c, m)| m.granted > 0 && c != w.conn && !spared.contains(&c))
                    .filter_map(|(&c, m)| {
                        let p = self.peers.get(&c)?;
                        let idle = now.saturating_duration_since(p.last_active);
                        let why = if p.priority < req.priority {
                            format!("lower priority ({} < {})", p.priority, req.priority)
                        } else if p.priority == req.priority && idle > idle_timeout {
                            format!("idle for {}s", idle.as_secs())
                        } else {
                            return None;
                        };
                        Some(Victim { conn: c, pid: p.pid, group: p.group.clone(), bytes: m.granted, why })
                    })
                    .collect();
                // Fewest victims: the largest holders first.
                candidates.sort_by_key(|c| std::cmp::Reverse(c.bytes));
                let mut room = gpu.room();
                let mut set = Vec::new();
                for c in candidates {
                    if room >= w.bytes as i128 {
                        break;
                    }
                    room += c.bytes as i128;
                    set.push(c);
                }
                if room >= w.bytes as i128 {
                    for v in set {
                        if !chosen.iter().any(|c| c.conn == v.conn) {
                            chosen.push(v);
                        }
                    }
                }
            }
        }
        chosen
    }

    /// Connections that hold burst grants on a GPU where someone waits: they are asked
    /// to give back what they do not use.
    pub fn contended_holders(&self) -> Vec<(ConnId, DeviceId)> {
        let mut out = Vec::new();
        for (&device, gpu) in &self.gpus {
            if gpu.queue.is_empty() {
                continue;
            }
            for group in gpu.groups.values() {
                for (&conn, m) in &group.members {
                    if m.granted > 0 {
                        out.push((conn, device));
                    }
                }
            }
        }
        out
    }

    /// Host RAM holding swapped-out memory now, plus what swaps under way will add.
    pub fn host_committed(&self) -> u64 {
        self.gpus
            .values()
            .flat_map(|g| g.groups.values())
            .flat_map(|g| g.members.values())
            .map(|m| if m.residency == Residency::SwappingOut { m.granted } else { m.host_bytes })
            .sum()
    }

    /// The swap resolver: for each GPU whose first waiting burst uses swap and does not
    /// fit, the holders to swap out (marked as swapping out). Candidates also use swap,
    /// belong to another group, do not wait themselves, have held their burst memory for
    /// at least `quantum`, and fit under `swap_limit` bytes of host RAM; the longest
    /// resident go first. A GPU with a swap-out under way gets no new one; a burst no set
    /// of candidates can serve is left to wait.
    pub fn swap_victims(&mut self, now: Instant, quantum: Duration, swap_limit: u64) -> Vec<SwapVictim> {
        let mut chosen = Vec::new();
        for gpu in self.gpus.values_mut() {
            for (name, m) in
                gpu.groups.iter_mut().flat_map(|(n, g)| g.members.values_mut().map(move |m| (n, m)))
            {
                let since = m.swapped_since.unwrap_or(now);
                if m.residency == Residency::SwappingOut
                    && now.saturating_duration_since(since) > SWAP_OUT_ANSWER
                {
                    // Stuck (a kernel that does not end?): others may be chosen meanwhile;
                    // its answer, if it comes, still says where its memory is.
                    tracing::warn!(group = %name, "no answer to a swap-out after {SWAP_OUT_ANSWER:?}");
                    (m.residency, m.swapped_since, m.resident_since) = (Residency::Resident, None, Some(now));
                }
            }
        }
        let mut host = self.host_committed();
        for (&device, gpu) in self.gpus.iter_mut() {
            let members = || gpu.groups.values().flat_map(|g| g.members.values());
            if members().any(|m| m.residency == Residency::SwappingOut) {
                continue;
            }
            let Some(head) = gpu.queue.front() else { continue };
            let free = gpu.free();
            if free >= head.bytes || self.peers.get(&head.conn).is_none_or(|p| p.resolver != Resolver::Swap) {
                continue;
            }
            let mut candidates: Vec<(Instant, ConnId, String, u64)> = Vec::new();
            for (name, group) in &gpu.groups {
                if *name == head.group {
                    continue;
                }
                for (&conn, m) in &group.members {
                    let swappable = m.granted > 0
                        && m.residency == Residency::Resident
                        && self.peers.get(&conn).is_some_and(|p| p.resolver == Resolver::Swap)
                        && !gpu.queue.iter().any(|w| w.conn == conn);
                    let since = m.resident_since.unwrap_or(now);
                    if swappable && now.saturating_duration_since(since) >= quantum {
                        candidates.push((since, conn, name.clone(), m.granted));
                    }
                }
            }
            candidates.sort();
            let (mut room, mut set, needed) = (gpu.room(), Vec::new(), head.bytes as i128);
            for (_, conn, group, bytes) in candidates {
                if room >= needed {
                    break;
                }
                if host.saturating_add(bytes) > swap_limit {
                    continue;
                }
                host += bytes;
                room += bytes as i128;
                set.push((conn, group, bytes));
            }
            if room < needed {
                continue;
            }
            for (conn, group, bytes) in set {
                if let Some(m) = gpu.groups.get_mut(&group).and_then(|g| g.members.get_mut(&conn)) {
                    m.residency = Residency::SwappingOut;
                    m.swapped_since = Some(now);
                }
                let pid = self.peers.get(&conn).map_or(0, |p| p.pid);
                chosen.push(SwapVictim { conn, device, pid, group, bytes });
            }
        }
        chosen
    }

    fn member_mut(&mut self, conn: ConnId, device: &DeviceId) -> Option<(&mut Gpu, String)> {
        let group = self.peers.get(&conn)?.group.clone();
        let gpu = self.gpus.get_mut(device)?;
        gpu.groups.get(&group)?.members.get(&conn)?;
        Some((gpu, group))
    }

    /// A process reports where its burst memory is after a swap (out or in) or a free
    /// of swapped-out memory: what it is granted, keeps in host RAM and holds now. Memory
    /// it gave back goes to the waiters.
    pub fn swapped(
        &mut self,
        conn: ConnId,
        device: DeviceId,
        granted: u64,
        host_bytes: u64,
        held: u64,
        now: Instant,
    ) -> Vec<Answer> {
        let Some((gpu, group)) = self.member_mut(conn, &device) else { return Vec::new() };
        let Some(g) = gpu.groups.get_mut(&group) else { return Vec::new() };
        // A report cannot put more in the ledger than the group may hold.
        let (granted, host_bytes) = (granted.min(g.limit - g.request), host_bytes.min(g.limit));
        if let Some(m) = g.members.get_mut(&conn) {
            (m.granted, m.host_bytes, m.held) = (granted, host_bytes, held);
            m.resume_sent = false;
            if host_bytes > 0 {
                m.residency = Residency::Swapped;
                m.swapped_since.get_or_insert(now);
            } else {
                if let Some(since) = m.swapped_since.take() {
                    m.swapped_for += now.saturating_duration_since(since);
                }
                // Resident again (or nothing could be swapped): its quantum starts now.
                m.residency = Residency::Resident;
                m.resident_since = Some(now);
            }
        }
        Self::drain(device, gpu, now)
    }

    /// Swapped-out processes that may come back because memory is free and no burst was
    /// asked for on their GPU for `settle`: at most as many as the free memory holds,
    /// each told once.
    pub fn resume_candidates(&mut self, now: Instant, settle: Duration) -> Vec<(ConnId, DeviceId)> {
        let mut out = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            if !gpu.queue.is_empty() || now.saturating_duration_since(gpu.last_busy) < settle {
                continue;
            }
            let mut free = gpu.free();
            for group in gpu.groups.values_mut() {
                let room = (group.limit - group.request).saturating_sub(group.granted());
                for (&conn, m) in group.members.iter_mut() {
                    if m.residency == Residency::Swapped && !m.resume_sent && m.host_bytes <= free.min(room) {
                        free -= m.host_bytes;
                        m.resume_sent = true;
                        out.push((conn, device));
                    }
                }
            }
        }
        out
    }

    /// The status document.
    pub fn status(&self) -> Status {
        let now = Instant::now();
        let gpus = self
            .gpus
            .iter()
            .map(|(id, gpu)| {
                let mut processes = Vec::new();
                for (name, group) in &gpu.groups {
                    for (conn, m) in &group.members {
                        let Some(peer) = self.peers.get(conn) else { continue };
                        let waiting = gpu.queue.iter().find(|w| w.conn == *conn);
                        let state = match (m.residency, waiting) {
                            (Residency::Swapped | Residency::SwappingOut, _) => "swapped",
                            (Residency::Resident, Some(_)) => "waiting",
                            (Residency::Resident, None) => "running",
                        };
                        let waited = m.waited + waiting.map_or(Duration::ZERO, |w| now - w.since);
                        let swapped = m.swapped_for
                            + m.swapped_since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                        processes.push(ProcessStatus {
                            pid: peer.pid,
                            group: name.clone(),
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
                        });
                    }
                }
                GpuStatus {
                    uuid: uuid_string(id),
                    total: gpu.total,
                    guaranteed: gpu.guaranteed(),
                    burst: gpu.burst(),
                    free: gpu.free(),
                    outside: gpu.outside(),
                    waiting: gpu.queue.len(),
                    swapped: gpu.groups.values().flat_map(|g| g.members.values()).map(|m| m.host_bytes).sum(),
                    processes,
                }
            })
            .collect();
        Status { gpus, swap_limit: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const GPU: DeviceId = [7; 16];

    fn peer(group: &str, timeout_ms: u64) -> Peer {
        Peer {
            pid: 100,
            group: group.into(),
            pod: String::new(),
            resolver: Resolver::Wait,
            priority: 0,
            wait_timeout: Duration::from_millis(timeout_ms),
            last_active: Instant::now(),
            activity: 0,
        }
    }

    #[test]
    fn priority_ends_the_fewest_lower_priority_or_idle_holders_never_higher() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        let t0 = now - Duration::from_secs(600);
        for (conn, group, prio, active) in
            [(1, "low", 0, now), (2, "high", 20, t0), (3, "idle", 10, t0), (4, "small", 0, now)]
        {
            p.hello(conn, Peer { priority: prio, last_active: active, ..peer(group, 60_000) });
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
        }
        p.hello(5, Peer { priority: 10, resolver: Resolver::Priority, ..peer("vip", 60_000) });
        p.register(5, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0, 0).unwrap();
        // 16 - 9 guaranteed = 7 GiB to lend: low 3, high 2, idle 1, small 1.
        for (conn, gib) in [(1, 3), (2, 2), (3, 1), (4, 1)] {
            assert!(matches!(
                p.acquire(conn, GPU, 1, gib * GIB, gib * GIB, 0, false, now),
                Outcome::Granted(_)
            ));
        }
        assert_eq!(p.acquire(5, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Queued);
        let v = p.priority_victims(now, Duration::from_secs(300), &[]);
        assert_eq!(v.len(), 1, "one holder of 3 GiB is enough: {v:?}");
        assert_eq!((v[0].conn, v[0].bytes), (1, 3 * GIB));
        assert!(v[0].why.contains("lower priority"));
        // Sparing it, two are needed (3 GiB from idle + small + ...): idle (equal prio, idle) and small.
        let v = p.priority_victims(now, Duration::from_secs(300), &[1]);
        let conns: Vec<_> = v.iter().map(|v| v.conn).collect();
        assert!(!conns.contains(&2), "a higher-priority holder is never ended: {v:?}");
        assert!(v.is_empty(), "idle 1 + small 1 = 2 GiB cannot make 3 GiB fit: wait instead, got {v:?}");
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

    #[test]
    fn after_the_reconnect_grace_outside_memory_does_not_block_deadlock_breaking() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 101, ..peer("a", 60_000) });
        p.register(1, GPU, 16 * GIB, 4 * GIB, 16 * GIB, 0, 0, 0).unwrap();
        p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now);
        p.observe_processes(GPU, &[(200, 6 * GIB)], now);
        // a holds 4 GiB lent and waits for 4 more: only a could give memory back.
        assert_eq!(p.acquire(1, GPU, 2, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty(), "just after a start: maybe shims coming back");
        let answers = p.settle(GPU, now + RECONNECT_GRACE + Duration::from_secs(1));
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].result), (1, Err(Denial::Deadlock)));
    }

    #[test]
    fn resolvers_end_or_swap_nobody_who_cannot_make_room_beside_outside_memory() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { pid: 101, resolver: Resolver::Swap, ..peer("low", 60_000) });
        p.register(1, GPU, 16 * GIB, 4 * GIB, 8 * GIB, 0, 0, 0).unwrap();
        p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now);
        p.hello(2, Peer { pid: 102, priority: 10, resolver: Resolver::Priority, ..peer("high", 60_000) });
        p.register(2, GPU, 16 * GIB, 4 * GIB, 8 * GIB, 0, 0, 0).unwrap();
        // A program without the shim takes 8 GiB: 4 + 3 + 4 + 8 = 19 of 16 GiB committed.
        p.observe_processes(GPU, &[(200, 8 * GIB)], now);
        assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
        // Ending or swapping low's 3 GiB would only take the GPU from 3 GiB short to 0.
        assert!(p.priority_victims(now, Duration::from_secs(300), &[]).is_empty());
        p.peers.get_mut(&2).unwrap().resolver = Resolver::Swap;
        assert!(p.swap_victims(now + Duration::from_secs(60), Duration::ZERO, u64::MAX).is_empty());
        // With the outsider at 4 GiB, low's 3 GiB make 2 GiB fit (16 - 15 + 3 = 4).
        p.observe_processes(GPU, &[(200, 4 * GIB)], now);
        p.peers.get_mut(&2).unwrap().resolver = Resolver::Priority;
        let v = p.priority_victims(now, Duration::from_secs(300), &[]);
        assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1]);
    }

    fn policy_with(groups: &[(ConnId, &str, u64, u64)]) -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for &(conn, group, request, limit) in groups {
            p.hello(conn, peer(group, 1000));
            p.register(conn, GPU, 16 * GIB, request, limit, 0, 0, 0).unwrap();
        }
        p
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
    fn bursts_wait_in_order_and_are_granted_as_memory_comes_back() {
        let now = Instant::now();
        let mut p = policy_with(&[
            (1, "a", 4 * GIB, 12 * GIB),
            (2, "b", 4 * GIB, 12 * GIB),
            (3, "c", 4 * GIB, 12 * GIB),
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
        let answers = p.release(1, GPU, GIB + GIB / 2, 0, now + Duration::from_millis(5));
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
        let mut p = policy_with(&[(1, "a", 4 * GIB, 16 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
        p.hello(2, Peer { wait_timeout: Duration::from_millis(10), ..peer("b", 10) });
        assert_eq!(p.acquire(2, GPU, 7, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.expire(now + Duration::from_millis(5)).is_empty());
        let answers = p.expire(now + Duration::from_millis(11));
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].seq, answers[0].result), (2, 7, Err(Denial::Timeout)));
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
    fn waiters_that_all_hold_burst_memory_are_not_left_deadlocked() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 4 * GIB, 16 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        // 8 GiB to lend: a takes 5, b takes 3; then both want more.
        assert_eq!(p.acquire(1, GPU, 1, 5 * GIB, 5 * GIB, 0, false, now), Outcome::Granted(5 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Granted(3 * GIB));
        assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, false, now), Outcome::Queued);
        let answers = p.acquire_answers(1, GPU, 2, GIB, now);
        // a holds the most and is refused at once; b still waits for a to give back.
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].result), (1, Err(Denial::Deadlock)));
        let answers = p.release(1, GPU, 5 * GIB, 0, now);
        assert_eq!((answers[0].conn, answers[0].result), (2, Ok(GIB)));
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
    fn swap_takes_turns_within_the_quantum_and_the_host_ram_cap() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for (conn, group, resolver) in
            [(1, "old", Resolver::Swap), (2, "waiter", Resolver::Wait), (3, "new", Resolver::Swap)]
        {
            p.hello(conn, Peer { resolver, ..peer(group, 60_000) });
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
        }
        // 10 GiB to lend: old holds 6 (since long ago), waiter 3, new 1 (just now).
        let long_ago = now - Duration::from_secs(60);
        assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, long_ago), Outcome::Granted(6 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Granted(3 * GIB));
        assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now), Outcome::Granted(GIB));
        let quantum = Duration::from_secs(10);
        // A wait-resolver burst never swaps anyone out.
        assert_eq!(p.acquire(2, GPU, 2, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.swap_victims(now, quantum, u64::MAX).is_empty());
        p.disconnect(2, now);
        // new wants 6 GiB (5 are free): only old is past its quantum; the waiter's own
        // group is never chosen.
        assert_eq!(p.acquire(3, GPU, 2, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Queued);
        assert!(p.swap_victims(now, quantum, 5 * GIB).is_empty(), "6 GiB do not fit a 5 GiB host-RAM cap");
        let v = p.swap_victims(now, quantum, 64 * GIB);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].conn, v[0].bytes), (1, 6 * GIB));
        assert!(p.swap_victims(now, quantum, 64 * GIB).is_empty(), "one swap-out at a time per GPU");
        assert_eq!(state(&p, 1), "swapped");
        // old answers: 6 GiB in host RAM, its grant back; new is served.
        let answers = p.swapped(1, GPU, 0, 6 * GIB, 2 * GIB, now);
        assert_eq!((answers[0].conn, answers[0].result), (3, Ok(6 * GIB)));
        assert_eq!(p.host_committed(), 6 * GIB);
        // old wants back in: it waits without deadline, and new is swapped out only after its quantum.
        assert_eq!(p.acquire(1, GPU, 2, 6 * GIB, 6 * GIB, 0, true, now), Outcome::Queued);
        assert!(p.expire(now + Duration::from_secs(3600)).is_empty(), "a swap-in has no deadline");
        assert!(p.swap_victims(now + Duration::from_secs(5), quantum, 64 * GIB).is_empty());
        let v = p.swap_victims(now + Duration::from_secs(11), quantum, 64 * GIB);
        assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![3]);
        let answers = p.swapped(3, GPU, 0, 7 * GIB, 2 * GIB, now + Duration::from_secs(12));
        assert_eq!((answers[0].conn, answers[0].result), (1, Ok(6 * GIB)));
        p.swapped(1, GPU, 6 * GIB, 0, 8 * GIB, now + Duration::from_secs(13));
        assert_eq!(state(&p, 1), "running");
        let s = p.status();
        let old = s.gpus[0].processes.iter().find(|x| x.group == "old").unwrap();
        assert_eq!(old.swapped_ms, 13_000);
        assert_eq!(s.gpus[0].swapped, 7 * GIB, "new's memory is in host RAM now");
        // Memory frees: new is told it may come back, once.
        p.release(1, GPU, 6 * GIB, 2 * GIB, now);
        let later = Instant::now() + Duration::from_secs(14);
        assert!(p.resume_candidates(later, Duration::from_secs(60)).is_empty(), "not before memory settles");
        assert_eq!(p.resume_candidates(later, Duration::ZERO), vec![(3, GPU)]);
        assert!(p.resume_candidates(later, Duration::ZERO).is_empty());
    }

    #[test]
    fn a_swap_in_that_fits_goes_ahead_of_a_head_that_does_not() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for (conn, group) in [(1, "a"), (2, "b")] {
            p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 60_000) });
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 0, 0, 0).unwrap();
        }
        // 12 GiB to lend: b holds 11, a (swapped out) wants 6 back, b is swapped out of 1 GiB.
        assert_eq!(p.acquire(2, GPU, 1, 11 * GIB, 11 * GIB, 0, false, now), Outcome::Granted(11 * GIB));
        p.register(1, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 2 * GIB, 0, 6 * GIB).unwrap();
        assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, true, now), Outcome::Queued);
        p.swapped(2, GPU, 10 * GIB, GIB, 12 * GIB, now);
        assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, true, now), Outcome::Queued);
        let answers = p.settle(GPU, now);
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_eq!(
            (answers[0].conn, answers[0].result),
            (2, Ok(GIB)),
            "b's small swap-in fits and goes first"
        );
    }

    #[test]
    fn a_swap_out_left_unanswered_does_not_block_the_gpu_for_ever() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for (conn, group) in [(1, "a"), (2, "b")] {
            p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 600_000) });
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 0, 0, 0).unwrap();
        }
        let long_ago = now - Duration::from_secs(60);
        assert_eq!(p.acquire(1, GPU, 1, 10 * GIB, 10 * GIB, 0, false, long_ago), Outcome::Granted(10 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
        let quantum = Duration::from_secs(10);
        assert_eq!(p.swap_victims(now, quantum, u64::MAX).len(), 1);
        assert!(p.swap_victims(now + Duration::from_secs(30), quantum, u64::MAX).is_empty());
        // No answer for over a minute: resident again, its quantum anew, then asked again.
        assert!(p.swap_victims(now + Duration::from_secs(61), quantum, u64::MAX).is_empty());
        assert_eq!(state(&p, 1), "running");
        assert_eq!(p.swap_victims(now + Duration::from_secs(72), quantum, u64::MAX).len(), 1);
    }

    #[test]
    fn reports_cannot_put_more_in_the_ledger_than_the_group_may_hold() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        p.hello(1, Peer { resolver: Resolver::Swap, ..peer("a", 1000) });
        p.register(1, GPU, 16 * GIB, 2 * GIB, 6 * GIB, 0, u64::MAX, u64::MAX).unwrap();
        p.swapped(1, GPU, u64::MAX, u64::MAX, 0, now);
        let s = &p.status().gpus[0];
        assert_eq!((s.burst, s.swapped), (4 * GIB, 6 * GIB));
        assert_eq!(p.host_committed(), 6 * GIB);
    }

    fn state(p: &Policy, conn: ConnId) -> String {
        let group = p.peer(conn).unwrap().group.clone();
        p.status().gpus[0].processes.iter().find(|x| x.group == group).unwrap().state.clone()
    }
}
