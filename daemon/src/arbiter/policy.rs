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

#[derive(Debug, Default, Clone, Copy)]
struct Member {
    held: u64,
    granted: u64,
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
}

impl Gpu {
    fn guaranteed(&self) -> u64 {
        self.groups.values().map(|g| g.request).sum()
    }
    fn burst(&self) -> u64 {
        self.groups.values().map(Group::granted).sum()
    }
    fn free(&self) -> u64 {
        self.total.saturating_sub(self.guaranteed() + self.burst())
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
                .map(|&(id, total)| (id, Gpu { total, groups: BTreeMap::new(), queue: VecDeque::new() }))
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
        group.members.insert(conn, Member { held, granted });
        Ok(())
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
        if gpu.queue.is_empty() && free >= bytes {
            let grant = preferred.min(free).min(room).max(bytes);
            member.granted += grant;
            return Outcome::Granted(grant);
        }
        gpu.queue.push_back(Waiter {
            conn,
            group: group_name,
            seq,
            bytes,
            preferred,
            since: now,
            deadline: now + timeout,
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
            gpu.queue.retain(|w| {
                let keep = w.deadline > now;
                if !keep {
                    answers.push(Answer {
                        conn: w.conn,
                        seq: w.seq,
                        device,
                        waited: now - w.since,
                        result: Err(Denial::Timeout),
                    });
                }
                keep
            });
            if gpu.queue.len() != before {
                answers.extend(Self::drain(device, gpu, now));
            }
        }
        answers
    }

    fn drain(device: DeviceId, gpu: &mut Gpu, now: Instant) -> Vec<Answer> {
        let mut answers = Vec::new();
        while let Some(head) = gpu.queue.front() {
            let group_room =
                gpu.groups.get(&head.group).map(|g| (g.limit - g.request).saturating_sub(g.granted()));
            if group_room.is_none_or(|room| room < head.bytes) {
                // Its group can no longer take it (it changed meanwhile): answer now.
                if let Some(w) = gpu.queue.pop_front() {
                    answers.push(Answer {
                        conn: w.conn,
                        seq: w.seq,
                        device,
                        waited: now - w.since,
                        result: Err(Denial::OverLimit),
                    });
                }
                continue;
            }
            if gpu.free() < head.bytes {
                if let Some(victim) = Self::deadlocked(gpu) {
                    // Nobody can give memory back: refuse the waiter holding the most,
                    // whose out-of-memory error makes it free what it holds.
                    if let Some(pos) = gpu.queue.iter().position(|w| w.conn == victim) {
                        if let Some(w) = gpu.queue.remove(pos) {
                            answers.push(Answer {
                                conn: w.conn,
                                seq: w.seq,
                                device,
                                waited: now - w.since,
                                result: Err(Denial::Deadlock),
                            });
                            continue;
                        }
                    }
                }
                break;
            }
            let Some(w) = gpu.queue.pop_front() else { break };
            let grant = w.preferred.min(gpu.free()).min(group_room.unwrap_or(0)).max(w.bytes);
            if let Some(m) = gpu.groups.get_mut(&w.group).and_then(|g| g.members.get_mut(&w.conn)) {
                m.granted += grant;
            }
            answers.push(Answer {
                conn: w.conn,
                seq: w.seq,
                device,
                waited: now - w.since,
                result: Ok(grant),
            });
        }
        answers
    }

    /// If every holder of burst memory on `gpu` is waiting for more, the waiting holder
    /// with the largest grant.
    fn deadlocked(gpu: &Gpu) -> Option<ConnId> {
        let mut holders = gpu
            .groups
            .values()
            .flat_map(|g| g.members.iter().filter(|(_, m)| m.granted > 0).map(|(&c, m)| (c, m.granted)))
            .peekable();
        holders.peek()?;
        let mut victim = None;
        for (conn, granted) in holders {
            if !gpu.queue.iter().any(|w| w.conn == conn) {
                return None;
            }
            if victim.is_none_or(|(_, g)| granted > g) {
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
        match self.acquire(conn, device, seq, bytes, bytes, 0, now) {
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
                let mut room = gpu.free();
                let mut set = Vec::new();
                for c in candidates {
                    if room >= w.bytes {
                        break;
                    }
                    room += c.bytes;
                    set.push(c);
                }
                if room >= w.bytes {
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

    /// The status document.
    pub fn status(&self) -> Status {
        let gpus = self
            .gpus
            .iter()
            .map(|(id, gpu)| {
                let mut processes = Vec::new();
                for (name, group) in &gpu.groups {
                    for (conn, m) in &group.members {
                        let Some(peer) = self.peers.get(conn) else { continue };
                        let waiting = gpu.queue.iter().any(|w| w.conn == *conn);
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
                            state: if waiting { "waiting" } else { "running" }.to_owned(),
                        });
                    }
                }
                GpuStatus {
                    uuid: uuid_string(id),
                    total: gpu.total,
                    guaranteed: gpu.guaranteed(),
                    burst: gpu.burst(),
                    free: gpu.free(),
                    waiting: gpu.queue.len(),
                    processes,
                }
            })
            .collect();
        Status { gpus }
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
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0).unwrap();
        }
        p.hello(5, Peer { priority: 10, resolver: Resolver::Priority, ..peer("vip", 60_000) });
        p.register(5, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0).unwrap();
        // 16 - 9 guaranteed = 7 GiB to lend: low 3, high 2, idle 1, small 1.
        for (conn, gib) in [(1, 3), (2, 2), (3, 1), (4, 1)] {
            assert!(matches!(p.acquire(conn, GPU, 1, gib * GIB, gib * GIB, 0, now), Outcome::Granted(_)));
        }
        assert_eq!(p.acquire(5, GPU, 1, 3 * GIB, 3 * GIB, 0, now), Outcome::Queued);
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

    fn policy_with(groups: &[(ConnId, &str, u64, u64)]) -> Policy {
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        for &(conn, group, request, limit) in groups {
            p.hello(conn, peer(group, 1000));
            p.register(conn, GPU, 16 * GIB, request, limit, 0, 0).unwrap();
        }
        p
    }

    #[test]
    fn requests_are_guaranteed_and_admission_refuses_what_does_not_fit() {
        let mut p = policy_with(&[(1, "a", 6 * GIB, 8 * GIB), (2, "b", 6 * GIB, 8 * GIB)]);
        p.hello(3, peer("c", 1000));
        let err = p.register(3, GPU, 16 * GIB, 6 * GIB, 6 * GIB, 0, 0).unwrap_err();
        assert!(err.contains("GPUFRAC_MEMORY_REQUEST") && err.contains("does not fit"), "{err}");
        p.register(3, GPU, 16 * GIB, 4 * GIB, 4 * GIB, 0, 0).unwrap();
        // A second member of an admitted group joins without a new guarantee.
        p.hello(4, peer("a", 1000));
        p.register(4, GPU, 16 * GIB, 6 * GIB, 8 * GIB, 0, 0).unwrap();
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
        assert_eq!(p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 0, now), Outcome::Granted(3 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 0, now), Outcome::Queued);
        assert_eq!(p.acquire(3, GPU, 1, GIB / 2, GIB / 2, 0, now), Outcome::Queued, "no bypassing the head");
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
        assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, now), Outcome::Denied(Denial::OverLimit));
        assert_eq!(
            p.acquire(1, GPU, 2, GIB / 2, 4 * GIB, 0, now),
            Outcome::Granted(GIB),
            "a chunk, capped by the limit"
        );
        assert_eq!(p.acquire(1, GPU, 3, 1, 1, 0, now), Outcome::Denied(Denial::OverLimit));
    }

    #[test]
    fn waiters_time_out_and_unblock_the_queue() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 4 * GIB, 16 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, now), Outcome::Granted(8 * GIB));
        p.hello(2, Peer { wait_timeout: Duration::from_millis(10), ..peer("b", 10) });
        assert_eq!(p.acquire(2, GPU, 7, 4 * GIB, 4 * GIB, 0, now), Outcome::Queued);
        assert!(p.expire(now + Duration::from_millis(5)).is_empty());
        let answers = p.expire(now + Duration::from_millis(11));
        assert_eq!(answers.len(), 1);
        assert_eq!((answers[0].conn, answers[0].seq, answers[0].result), (2, 7, Err(Denial::Timeout)));
    }

    #[test]
    fn a_disconnected_holder_frees_its_grant_for_the_waiter() {
        let now = Instant::now();
        let mut p = policy_with(&[(1, "a", 4 * GIB, 16 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
        assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, now), Outcome::Granted(8 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 6 * GIB, 6 * GIB, 0, now), Outcome::Queued);
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
        assert_eq!(p.acquire(1, GPU, 1, 5 * GIB, 5 * GIB, 0, now), Outcome::Granted(5 * GIB));
        assert_eq!(p.acquire(2, GPU, 1, 3 * GIB, 3 * GIB, 0, now), Outcome::Granted(3 * GIB));
        assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, now), Outcome::Queued);
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
        p.register(1, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 10 * GIB, 6 * GIB).unwrap();
        let s = &p.status().gpus[0];
        assert_eq!((s.guaranteed, s.burst, s.free), (4 * GIB, 6 * GIB, 6 * GIB));
        assert_eq!(s.processes[0].held, 10 * GIB);
    }
}
