//! Property tests of the policy: random sequences of what shims and NVML can tell the
//! arbiter (hello, register, acquire, release, swapped, activity, processes listed,
//! disconnect) and of what its timers do (expire, settle, the resolvers), on one or two
//! GPUs, with sizes both plausible and absurd. After every step nothing has panicked and
//! the ledger keeps its invariants:
//!
//! - an admitted group's requests fit the GPU (guaranteed ≤ total), and each group's
//!   grants stay within its burst range (limit − request);
//! - lent memory never passes what the GPU has (grants + guarantees + memory outside
//!   gpufrac ≤ total) unless a guarantee is owed (`reclaiming`), which only a registration
//!   or memory outside gpufrac can cause; while it is owed nothing more is lent;
//! - every `Queued` burst is answered exactly once (a grant or a denial), never one that
//!   was not queued, and the queues hold exactly the bursts not answered yet;
//! - after an expiry tick no waiter that can never be served is left in a queue, and one
//!   tick past the longest deadline answers every waiter;
//! - a disconnect leaves no trace of the connection;
//! - whatever members claim, the ledger never holds more than the GPU has (burst ≤ total,
//!   each group's request and limit ≤ total) nor more than the group's entitlement: a
//!   connection may have one (random caps applied as the server applies them), and no
//!   group's request or limit is above the largest its members are entitled to;
//! - the resolvers end only processes the arbiter holds a pidfd for, and a priority burst
//!   ends a process of another user only when its priority is vouched for (`vetted`);
//! - a process the arbiter holds no pidfd for is never lent anything (nor believed to
//!   keep swapped-out memory): no resolver could take such a loan back.
//!
//! Cases come from seeds: those in `daemon/tests/corpus/policy_seeds.txt` (failures once
//! found, replayed every run) and a fixed number of fresh ones derived from a base seed.
//! `GPUFRAC_PROPS_SEED=<seed>` replays one case (printing its steps); `GPUFRAC_PROPS_CASES`
//! runs more fresh cases (fuzzing for longer).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;
use gpufrac_common::Resolver;

use super::park::MemberPark;
use super::wait::MAX_WAIT;
use super::{Answer, ConnId, Outcome, Peer, Policy, WakeAnswer, WakeOutcome, RESUME_WAIT};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Fresh cases in a normal test run (kept well under a second or two in debug builds).
const CASES: u64 = 150;
/// Steps per case.
const STEPS: usize = 150;
const CORPUS: &str = include_str!("../../../tests/corpus/policy_seeds.txt");

/// SplitMix64: small, seedable, good enough to pick operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
    /// A size: mostly whole 64 MiB steps up to a little past `total`, sometimes any
    /// number of bytes, zero, or absurd.
    fn size(&mut self, total: u64) -> u64 {
        match self.below(100) {
            0..=69 => self.below(total / (64 * MIB) + 2) * 64 * MIB,
            70..=84 => self.below(total + 1),
            85..=94 => 0,
            95..=97 => u64::MAX - self.below(3),
            _ => self.next(),
        }
    }
}

/// One GPU of a case.
#[derive(Clone, Copy)]
struct Device {
    id: DeviceId,
    total: u64,
}

struct Case {
    rng: Rng,
    policy: Policy,
    devices: Vec<Device>,
    /// Connections that said hello and are not disconnected.
    live: Vec<ConnId>,
    /// The entitlement of each group's members, if they have one: (max request, max
    /// limit) bytes. An entitlement follows from who a process is (its user, its
    /// container), so every member of a group has the same.
    caps: std::collections::HashMap<String, Option<(u64, u64)>>,
    next_conn: ConnId,
    next_seq: u64,
    /// (conn, device, seq) of bursts queued and not answered yet.
    outstanding: BTreeSet<(ConnId, DeviceId, u64)>,
    /// (conn, device, seq) of wakes queued and not answered yet.
    waking: BTreeSet<(ConnId, DeviceId, u64)>,
    now: Instant,
    log: Vec<String>,
    verbose: bool,
}

impl Case {
    fn new(seed: u64, verbose: bool) -> Case {
        let mut rng = Rng(seed);
        let devices: Vec<Device> = (0..1 + rng.below(2))
            .map(|i| Device { id: [i as u8 + 1; 16], total: rng.pick(&[4 * GIB, 16 * GIB, 80 * GIB]) })
            .collect();
        let mut policy = Policy::new(&devices.iter().map(|d| (d.id, d.total)).collect::<Vec<_>>());
        // Parking: oversubscribed or not, by the shim or by the driver's checkpoint.
        policy.set_oversubscribe(rng.pick(&[1.0, 3.0]));
        policy.set_checkpoint(rng.chance(50));
        Case {
            rng,
            policy,
            devices,
            live: Vec::new(),
            caps: std::collections::HashMap::new(),
            next_conn: 1,
            next_seq: 1,
            outstanding: BTreeSet::new(),
            waking: BTreeSet::new(),
            now: Instant::now(),
            log: Vec::new(),
            verbose,
        }
    }

    fn note(&mut self, step: String) {
        if self.verbose {
            eprintln!("{step}");
        }
        self.log.push(step);
    }

    fn fail(&self, what: String) -> ! {
        let tail: Vec<&String> = self.log.iter().rev().take(30).rev().collect();
        panic!("{what}\nlast steps:\n{tail:#?}");
    }

    fn device(&mut self) -> Device {
        let devices = self.devices.clone();
        self.rng.pick(&devices)
    }

    fn conn(&mut self) -> Option<ConnId> {
        let live = self.live.clone();
        (!live.is_empty()).then(|| self.rng.pick(&live))
    }

    /// Checks and consumes answers to queued bursts.
    fn answered(&mut self, answers: Vec<Answer>) {
        for a in answers {
            if !self.outstanding.remove(&(a.conn, a.device, a.seq)) {
                self.fail(format!("an answer to a burst that was not waiting: {a:?}"));
            }
        }
    }

    /// Checks and consumes answers to queued wakes.
    fn woke(&mut self, answers: Vec<WakeAnswer>) {
        for a in answers {
            if !self.waking.remove(&(a.conn, a.device, a.seq)) {
                self.fail(format!("an answer to a wake that was not waiting: {a:?}"));
            }
        }
    }

    /// A member of a parkable group whose park state is one of `states`, and its GPU.
    fn parkable_member(&mut self, states: &[MemberPark]) -> Option<(ConnId, DeviceId)> {
        let found: Vec<(ConnId, DeviceId)> = self
            .policy
            .gpus
            .iter()
            .flat_map(|(id, g)| {
                g.members().filter(|(_, _, m)| states.contains(&m.park)).map(move |(_, c, _)| (c, *id))
            })
            .collect();
        (!found.is_empty()).then(|| self.rng.pick(&found))
    }

    /// A connection and a device it is registered on, mostly; any live one else.
    fn target(&mut self) -> Option<(ConnId, Device)> {
        let members: Vec<(ConnId, DeviceId)> =
            self.policy.gpus.iter().flat_map(|(id, g)| g.members().map(move |(_, c, _)| (c, *id))).collect();
        if !members.is_empty() && self.rng.chance(85) {
            let (conn, id) = self.rng.pick(&members);
            let device = *self.devices.iter().find(|d| d.id == id)?;
            return Some((conn, device));
        }
        let conn = self.conn()?;
        Some((conn, self.device()))
    }

    /// A plausible size for a burst of a group on `d`: whole 64 MiB steps up to a quarter
    /// of the GPU, mostly; any size else.
    fn burst_size(&mut self, d: Device) -> u64 {
        if self.rng.chance(80) {
            (1 + self.rng.below(d.total / (256 * MIB))) * 64 * MIB
        } else {
            self.rng.size(d.total)
        }
    }

    /// The member `(granted, host_bytes)` of `conn` on `device`, if it is one.
    fn member(&self, conn: ConnId, device: &DeviceId) -> Option<(u64, u64)> {
        let group = &self.policy.peers.get(&conn)?.group;
        let m = self.policy.gpus.get(device)?.groups.get(group)?.members.get(&conn)?;
        Some((m.granted, m.host_bytes))
    }

    /// One random step; returns its kind.
    fn step(&mut self) -> &'static str {
        self.now += Duration::from_millis(self.rng.pick(&[0, 1, 5, 100, 600, 2500, 20_000]));
        let now = self.now;
        let kind = match self.rng.below(112) {
            0..=7 => "hello",
            8..=19 => "register",
            20..=44 => "acquire",
            45..=54 => "release",
            55..=62 => "swapped",
            63..=69 => "expire",
            70..=73 => "disconnect",
            74..=79 => "observe",
            80..=83 => "activity",
            84..=87 => "swap_victims",
            88..=90 => "reclaim",
            91..=93 => "resume_candidates",
            94..=95 => "settle",
            100..=102 => "plan_parks",
            103..=105 => "park_answer",
            106..=108 => "wake",
            109..=111 => "woken",
            _ => "look",
        };
        match kind {
            "hello" => {
                let conn = self.next_conn;
                self.next_conn += 1;
                let peer = Peer {
                    pid: 100 + conn as u32,
                    // Two users: a group's members are one user's, and a priority that no
                    // entitlement vouches for ends only its own user's processes.
                    uid: self.rng.pick(&[1000, 1000, 1001]),
                    group: format!("g{}", self.rng.below(4)),
                    pod: String::new(),
                    resolver: self.rng.pick(&[
                        Resolver::Wait,
                        Resolver::Priority,
                        Resolver::Swap,
                        Resolver::Swap,
                    ]),
                    priority: self.rng.pick(&[-5, 0, 0, 3]),
                    wait_timeout: Duration::from_millis(self.rng.pick(&[0, 10, 1000, 30_000, u64::MAX])),
                    last_active: now,
                    activity: 0,
                    vetted: self.rng.chance(50),
                    signalable: self.rng.chance(90),
                    entitlement: String::new(),
                    capped: String::new(),
                    park_after: self
                        .rng
                        .chance(30)
                        .then(|| Duration::from_millis(self.rng.pick(&[0, 500, 5000]))),
                    compute: None,
                };
                self.note(format!("hello {conn} {peer:?}"));
                self.policy.hello(conn, peer);
                self.live.push(conn);
                let group = self.policy.peers[&conn].group.clone();
                if !self.caps.contains_key(&group) {
                    let cap = self.rng.chance(50).then(|| {
                        let total = self.devices.iter().map(|d| d.total).min().unwrap_or(0);
                        let request = self.rng.below(5) * total / 16;
                        (request, request.saturating_add(self.rng.below(9) * total / 16))
                    });
                    self.caps.insert(group, cap);
                }
            }
            "register" => {
                let Some(conn) = self.conn() else { return kind };
                let d = self.device();
                let request = if self.rng.chance(80) {
                    self.rng.below(5) * d.total / 16
                } else {
                    self.rng.size(d.total)
                };
                let limit = if self.rng.chance(90) {
                    request.saturating_add(self.rng.size(d.total) / 2)
                } else {
                    self.rng.size(d.total)
                };
                let total = if self.rng.chance(90) { d.total } else { self.rng.size(d.total) };
                let (held, granted, host) = match self.rng.below(6) {
                    0..=2 => (0, 0, 0),
                    3 | 4 => (self.rng.size(d.total), self.rng.size(d.total), 0),
                    _ => (self.rng.size(d.total), self.rng.size(d.total), self.rng.size(d.total)),
                };
                // Capped as the server caps a registration by the connection's entitlement.
                let group = self.policy.peers.get(&conn).map(|p| p.group.clone()).unwrap_or_default();
                let (request, limit) = match self.caps.get(&group).copied().flatten() {
                    Some((max_request, max_limit)) if limit >= request => {
                        let verdict =
                            crate::entitlement::Verdict::Entitled(crate::entitlement::Entitlement {
                                source: "props".into(),
                                devices: None,
                                max_request: crate::entitlement::Amount::Bytes(max_request),
                                max_limit: crate::entitlement::Amount::Bytes(max_limit),
                                max_priority: 0,
                                resolver: None,
                                group: None,
                                max_compute: None,
                            });
                        let (r, l, _) =
                            crate::entitlement::believe_register(&verdict, &d.id, d.total, request, limit);
                        (r, l)
                    }
                    _ => (request, limit),
                };
                let result = self.policy.register(conn, d.id, total, request, limit, held, granted, host);
                self.note(format!(
                    "register {conn} total {total} request {request} limit {limit} held {held} granted {granted} host {host}: {}",
                    result.is_ok()
                ));
            }
            "acquire" => {
                let Some((conn, d)) = self.target() else { return kind };
                let host = self.member(conn, &d.id).map_or(0, |m| m.1);
                let resume = self.rng.chance(if host > 0 { 60 } else { 5 });
                let bytes = if resume && self.rng.chance(80) { host } else { self.burst_size(d) };
                let preferred = if self.rng.chance(90) {
                    bytes.saturating_add(self.rng.size(d.total / 4))
                } else {
                    self.rng.size(d.total)
                };
                let held = self.rng.size(d.total);
                let seq = self.next_seq;
                self.next_seq += 1;
                let outcome = self.policy.acquire(conn, d.id, seq, bytes, preferred, held, resume, now);
                self.note(format!(
                    "acquire {conn} seq {seq} bytes {bytes} preferred {preferred} resume {resume}: {outcome:?}"
                ));
                if outcome == Outcome::Queued {
                    self.outstanding.insert((conn, d.id, seq));
                    let answers = self.policy.settle(d.id, now);
                    self.answered(answers);
                    self.no_swap_in_left_that_fits(&d.id, now);
                }
            }
            "release" => {
                let Some((conn, d)) = self.target() else { return kind };
                let granted = self.member(conn, &d.id).map_or(0, |m| m.0);
                let bytes =
                    if self.rng.chance(70) { self.rng.below(granted + 1) } else { self.rng.size(d.total) };
                let held = self.rng.size(d.total);
                self.note(format!("release {conn} bytes {bytes} held {held}"));
                let answers = self.policy.release(conn, d.id, bytes, held, now);
                self.answered(answers);
            }
            "swapped" => {
                let Some((conn, d)) = self.target() else { return kind };
                let (granted, host) = self.member(conn, &d.id).unwrap_or((0, 0));
                // A swap out as a shim reports it, or any state at all.
                let (granted, host) = match self.rng.below(3) {
                    0 => (0, host.saturating_add(granted)),
                    1 => (granted.saturating_add(host), 0),
                    _ => (self.rng.size(d.total), self.rng.size(d.total)),
                };
                let held = self.rng.size(d.total);
                self.note(format!("swapped {conn} granted {granted} host {host} held {held}"));
                let answers = self.policy.swapped(conn, d.id, granted, host, held, now);
                self.answered(answers);
            }
            "expire" => {
                self.note("expire".into());
                // Wakes first, as the server's tick does: a wake lends again, which may leave
                // a queued burst without a chance, for `expire` to refuse.
                let wakes = self.policy.expire_wakes(now);
                self.woke(wakes);
                let answers = self.policy.expire(now);
                self.answered(answers);
                // Nobody without a chance is left waiting, nor anybody past its deadline.
                for (id, gpu) in &self.policy.gpus {
                    for w in &gpu.queue {
                        if let Some(reason) = gpu.never_served(&w.group, w.bytes) {
                            self.fail(format!("{w:?} on {id:?} can never be served ({reason:?}) but waits"));
                        }
                        if w.deadline <= now {
                            self.fail(format!("{w:?} waits past its deadline"));
                        }
                    }
                }
            }
            "disconnect" => {
                let Some(conn) = self.conn() else { return kind };
                self.note(format!("disconnect {conn}"));
                self.live.retain(|&c| c != conn);
                self.outstanding.retain(|&(c, _, _)| c != conn);
                self.waking.retain(|&(c, _, _)| c != conn);
                let answers = self.policy.disconnect(conn, now);
                if answers.iter().any(|a| a.conn == conn) {
                    self.fail(format!("an answer to the connection that closed: {answers:?}"));
                }
                self.answered(answers);
                let p = &self.policy;
                let trace = p.peers.contains_key(&conn)
                    || p.gpus.values().any(|g| {
                        g.members().any(|(_, c, _)| c == conn)
                            || g.waiter(conn).is_some()
                            || g.wakers.iter().any(|w| w.conn == conn)
                    });
                if trace {
                    self.fail(format!("connection {conn} left a trace"));
                }
            }
            "observe" => {
                let d = self.device();
                let listed: Vec<(u32, u64)> = (0..self.rng.below(4))
                    .map(|_| {
                        let pid = if self.rng.chance(50) {
                            100 + self.rng.below(self.next_conn + 1) as u32
                        } else {
                            900
                        };
                        (pid + self.rng.below(2) as u32, self.rng.size(d.total / 2))
                    })
                    .collect();
                self.note(format!("observe {listed:?}"));
                let answers = self.policy.observe_processes(d.id, &listed, now);
                self.answered(answers);
            }
            "activity" => {
                let Some(conn) = self.conn() else { return kind };
                let count = self.rng.below(3);
                self.note(format!("activity {conn} {count}"));
                self.policy.activity(conn, count, now);
            }
            "swap_victims" => {
                let quantum = Duration::from_millis(self.rng.pick(&[0, 10_000]));
                let limit = self.rng.pick(&[0, 8 * GIB, u64::MAX]);
                let victims = self.policy.swap_victims(now, quantum, limit);
                self.note(format!("swap_victims: {victims:?}"));
                // Some answer at once, as their shims would.
                for v in victims {
                    if self.rng.chance(70) {
                        if let Some((granted, host)) = self.member(v.conn, &v.device) {
                            let answers = self.policy.swapped(v.conn, v.device, 0, host + granted, 0, now);
                            self.answered(answers);
                        }
                    }
                }
            }
            "reclaim" => {
                let plan = self.policy.reclaim(now, &[], self.rng.pick(&[0, u64::MAX]));
                self.note(format!("reclaim: {plan:?}"));
                for v in &plan.end {
                    if !self.policy.peers.get(&v.conn).is_some_and(|p| p.signalable) {
                        self.fail(format!("reclaim ends {v:?}, which has no pidfd"));
                    }
                }
                let idle = Duration::from_millis(self.rng.pick(&[0, 300_000]));
                for v in self.policy.priority_victims(now, idle, &[]) {
                    let Some(victim) = self.policy.peers.get(&v.conn) else {
                        self.fail(format!("priority ends {v:?}, which is gone"));
                    };
                    if !victim.signalable {
                        self.fail(format!("priority ends {v:?}, which has no pidfd"));
                    }
                    // Some priority waiter on a GPU the victim holds memory on may end it:
                    // one of its own user, or one whose priority an entitlement vouches for.
                    let justified = self.policy.gpus.values().any(|gpu| {
                        gpu.members().any(|(_, c, _)| c == v.conn)
                            && gpu.queue.iter().any(|w| {
                                self.policy.peers.get(&w.conn).is_some_and(|asker| {
                                    asker.resolver == Resolver::Priority
                                        && (asker.uid == victim.uid || asker.vetted)
                                        && asker.priority >= victim.priority
                                })
                            })
                    });
                    if !justified {
                        self.fail(format!("priority ends {v:?} ({victim:?}) for no waiter allowed to"));
                    }
                }
            }
            "resume_candidates" => {
                let out =
                    self.policy.resume_candidates(now, Duration::from_millis(self.rng.pick(&[0, 1000])));
                self.note(format!("resume_candidates: {out:?}"));
            }
            "plan_parks" => {
                let orders = self.policy.plan_parks(now);
                self.note(format!("plan_parks: {orders:?}"));
                for o in &orders {
                    let parkable = self.policy.peers.get(&o.conn).is_some_and(|p| p.park_after.is_some());
                    if !parkable {
                        self.fail(format!("{o:?} parks a group that is not parkable"));
                    }
                }
            }
            "park_answer" => {
                let Some((conn, id)) = self.parkable_member(&[MemberPark::Parking]) else { return kind };
                let total = self.policy.gpus[&id].total;
                // What it leaves on the device: at most its group's request, as a shim does.
                let request = self.policy.group_of(conn, &id).map_or(0, |(r, _)| r);
                let held = self.rng.size(request.max(1)).min(request);
                let answers = if self.rng.chance(75) {
                    let host = self.rng.size(total);
                    self.note(format!("parked {conn} host {host} held {held}"));
                    let (bursts, wakes) = self.policy.parked(conn, id, host, held, now);
                    self.answered(bursts);
                    wakes
                } else {
                    self.note(format!("park given up {conn} held {held}"));
                    self.policy.park_given_up(conn, id, held, now)
                };
                self.woke(answers);
            }
            "wake" => {
                let Some((conn, id)) = self.parkable_member(&[MemberPark::Parked, MemberPark::Parking])
                else {
                    return kind;
                };
                let seq = self.next_seq;
                self.next_seq += 1;
                let outcome = self.policy.wake(conn, id, seq, now);
                self.note(format!("wake {conn} seq {seq}: {outcome:?}"));
                match outcome {
                    WakeOutcome::Queued => {
                        self.waking.retain(|&(c, d, _)| !(c == conn && d == id));
                        self.waking.insert((conn, id, seq));
                    }
                    WakeOutcome::Woken { .. } | WakeOutcome::Denied(_) => {}
                }
            }
            "woken" => {
                let Some((conn, id)) = self.parkable_member(&[MemberPark::Waking]) else { return kind };
                let held = self.policy.group_of(conn, &id).map_or(0, |(r, _)| r);
                self.note(format!("woken {conn} held {held}"));
                let answers = self.policy.woken(conn, id, Some(held), now);
                self.woke(answers);
            }
            "settle" => {
                let d = self.device();
                self.note("settle".into());
                let answers = self.policy.settle(d.id, now);
                self.answered(answers);
                self.no_swap_in_left_that_fits(&d.id, now);
            }
            _ => {
                self.note("look".into());
                let _ = self.policy.status();
                let _ = self.policy.contended_holders(now);
                let _ = self.policy.host_committed();
            }
        }
        kind
    }

    /// After a look at `device`'s queue, no swap-in that fits is left waiting (a swap-in
    /// has no deadline worth the name: one the queue passed over could wait for ever),
    /// unless wakes come first.
    fn no_swap_in_left_that_fits(&self, device: &DeviceId, now: Instant) {
        let Some(gpu) = self.policy.gpus.get(device) else { return };
        if !gpu.wakers.is_empty() {
            return;
        }
        if let Some(w) = gpu.queue.iter().find(|w| w.resume && gpu.swap_in_fits(w, now)) {
            self.fail(format!("{w:?} fits on {device:?} but was left waiting"));
        }
    }

    /// (shortfall, burst) per GPU.
    fn debts(&self) -> Vec<(u64, u64)> {
        self.policy.gpus.values().map(|g| (g.shortfall(), g.burst())).collect()
    }

    fn check(&self, kind: &str, before: &[(u64, u64)]) {
        for (id, gpu) in &self.policy.gpus {
            if gpu.burst() > gpu.total {
                self.fail(format!("{id:?}: {} lent of {}", gpu.burst(), gpu.total));
            }
            for (name, g) in &gpu.groups {
                if g.request > gpu.total || g.limit > gpu.total {
                    self.fail(format!(
                        "group {name}: request {} limit {} on {}",
                        g.request, g.limit, gpu.total
                    ));
                }
                // The group holds no more than its members' entitlement.
                if let Some((max_request, max_limit)) = self.caps.get(name).copied().flatten() {
                    if g.request > max_request || g.limit > max_limit {
                        self.fail(format!(
                            "group {name}: request {} limit {} past its entitlement {max_request}/{max_limit}",
                            g.request, g.limit
                        ));
                    }
                }
                for (conn, m) in &g.members {
                    // A loan to a process without a pidfd could never be taken back.
                    let signalable = self.policy.peers.get(conn).is_some_and(|p| p.signalable);
                    if !signalable && (m.granted > 0 || m.host_bytes > 0) {
                        self.fail(format!(
                            "group {name}: conn {conn} has no pidfd but holds {} lent, {} in host RAM",
                            m.granted, m.host_bytes
                        ));
                    }
                    if m.host_bytes > g.limit {
                        self.fail(format!(
                            "group {name}: a member keeps {} in host RAM, limit {}",
                            m.host_bytes, g.limit
                        ));
                    }
                }
            }
            // The requests of groups never parked fit the GPU; parkable ones may add up past
            // it (they are parked for the others), and so may what parked ones left there.
            let firm = gpu
                .groups
                .values()
                .filter(|g| g.park_after.is_none())
                .map(|g| g.request)
                .fold(0u64, u64::saturating_add);
            if firm > gpu.total {
                self.fail(format!("{id:?}: {firm} guaranteed to groups never parked, of {}", gpu.total));
            }
            for w in &gpu.wakers {
                let parked = gpu
                    .groups
                    .get(&w.group)
                    .and_then(|g| g.members.get(&w.conn))
                    .is_some_and(|m| matches!(m.park, MemberPark::Parked | MemberPark::Parking));
                if !parked {
                    self.fail(format!("{w:?} waits to be woken without being parked"));
                }
            }
            for (name, g) in &gpu.groups {
                if g.limit < g.request || g.granted() > g.limit - g.request {
                    self.fail(format!(
                        "group {name}: {} granted, limit {} request {}",
                        g.granted(),
                        g.limit,
                        g.request
                    ));
                }
                if g.members.is_empty() {
                    self.fail(format!("group {name} without members"));
                }
                for conn in g.members.keys() {
                    if self.policy.peers.get(conn).is_none_or(|p| &p.group != name) {
                        self.fail(format!("member {conn} of {name} is not a peer of that group"));
                    }
                }
            }
            for w in &gpu.queue {
                if gpu.groups.get(&w.group).is_none_or(|g| !g.members.contains_key(&w.conn)) {
                    self.fail(format!("{w:?} waits without being a member"));
                }
                if w.deadline > w.since + MAX_WAIT.max(RESUME_WAIT) {
                    self.fail(format!("{w:?} waits too long"));
                }
            }
        }
        let wakers: BTreeSet<(ConnId, DeviceId, u64)> = self
            .policy
            .gpus
            .iter()
            .flat_map(|(id, g)| g.wakers.iter().map(move |w| (w.conn, *id, w.seq)))
            .collect();
        if wakers != self.waking {
            self.fail(format!("wakes queued {wakers:?} but not answered {:?}", self.waking));
        }
        let queued: BTreeSet<(ConnId, DeviceId, u64)> = self
            .policy
            .gpus
            .iter()
            .flat_map(|(id, g)| g.queue.iter().map(move |w| (w.conn, *id, w.seq)))
            .collect();
        if queued != self.outstanding {
            self.fail(format!("queued {queued:?} but not answered {:?}", self.outstanding));
        }
        // A guarantee is owed only through a registration or memory outside gpufrac, and
        // while it is owed nothing more is lent.
        for ((short, burst), (short_before, burst_before)) in
            self.debts().into_iter().zip(before.iter().copied())
        {
            match kind {
                "register" => {}
                _ => {
                    // What a parked group could not move (contexts, small allocations) is
                    // learnt when it parks, as memory outside gpufrac is when observed: a
                    // firm request that counted on it is owed it (from loans).
                    if !matches!(kind, "observe" | "park_answer") && short > short_before {
                        self.fail(format!("{kind} made the guarantees owed {short} (was {short_before})"));
                    }
                    if short > 0 && burst > burst_before {
                        self.fail(format!("{kind} lent {} while {short} is owed", burst - burst_before));
                    }
                }
            }
        }
    }

    /// Every waiter is answered one tick past the longest deadline.
    fn finish(&mut self) {
        let later = self.now + MAX_WAIT.max(RESUME_WAIT) + Duration::from_secs(1);
        let answers = self.policy.expire(later);
        self.answered(answers);
        if !self.outstanding.is_empty() {
            self.fail(format!("still waiting past every deadline: {:?}", self.outstanding));
        }
        let wakes = self.policy.expire_wakes(later);
        self.woke(wakes);
        if !self.waking.is_empty() {
            self.fail(format!("wakes still waiting past every deadline: {:?}", self.waking));
        }
    }
}

fn run(seed: u64, verbose: bool) {
    let mut case = Case::new(seed, verbose);
    for _ in 0..STEPS {
        let before = case.debts();
        let kind = case.step();
        case.check(kind, &before);
    }
    case.finish();
}

fn run_caught(seed: u64) {
    if let Err(e) = std::panic::catch_unwind(|| run(seed, false)) {
        let why = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!("policy case {seed:#x} failed (replay: GPUFRAC_PROPS_SEED={seed:#x}; add it to daemon/tests/corpus/policy_seeds.txt): {why}");
    }
}

fn parse_seed(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

#[test]
fn the_corpus_replays_without_breaking_an_invariant() {
    let seeds: Vec<u64> = CORPUS
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter(|l| !l.trim().is_empty())
        .map(|l| parse_seed(l).unwrap_or_else(|| panic!("bad seed in the corpus: {l:?}")))
        .collect();
    assert!(!seeds.is_empty());
    for seed in seeds {
        run_caught(seed);
    }
}

#[test]
fn random_sequences_never_panic_nor_break_an_invariant() {
    if let Some(seed) = std::env::var("GPUFRAC_PROPS_SEED").ok().and_then(|s| parse_seed(&s)) {
        run(seed, true);
        return;
    }
    let cases = std::env::var("GPUFRAC_PROPS_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(CASES);
    let mut base = Rng(0x6770_7566_7261_6321);
    for _ in 0..cases {
        run_caught(base.next());
    }
}
