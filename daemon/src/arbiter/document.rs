//! The status document's types: what the arbiter serves to `gpufrac status` and
//! `gpufrac top` (JSON), made by the policy (`Status`) and the server (`Document`, with
//! the bursts waiting and the last events). Plain data, so that the policy needs nothing
//! of the CLI; `crate::status` re-exports them with the table the CLI prints.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// What the arbiter serves: the [`Status`], the bursts waiting for memory and the last
/// events. Its JSON is the status's with two more fields (`queue`, `events`), so a client
/// reads an older arbiter's document (both empty) and an older client reads this one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    /// The node: GPUs and processes.
    #[serde(flatten)]
    pub status: Status,
    /// Bursts waiting for memory, longest waiting first, on every GPU.
    #[serde(default)]
    pub queue: Vec<QueuedBurst>,
    /// The last events (bursts that waited 1 s or more or were denied, holders swapped or
    /// ended, registrations refused), oldest first.
    #[serde(default)]
    pub events: Vec<Event>,
}

/// A burst waiting in a GPU's queue.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedBurst {
    /// The GPU's `GPU-...` UUID.
    pub gpu: String,
    /// The process waiting.
    pub pid: u32,
    /// Its user: a client is shown only its own user's waiters.
    #[serde(default)]
    pub uid: u32,
    /// Its group.
    pub group: String,
    /// Bytes it needs.
    pub bytes: u64,
    /// How long this burst has waited so far, in ms.
    pub waited_ms: u64,
    /// A swapped-out process asking for its memory back.
    #[serde(default)]
    pub resume: bool,
}

/// What happened, in an [`Event`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A burst was granted after waiting 1 s or more.
    Waited,
    /// A queued burst was refused (a timeout, a deadlock, never fits).
    Denied,
    /// A holder moved its burst memory to host RAM.
    SwappedOut,
    /// A swapped-out holder brought its burst memory back.
    SwappedIn,
    /// A holder of burst memory was ended (for a priority burst or a guarantee).
    Ended,
    /// A registration was refused (its request does not fit).
    Refused,
    /// An idle parkable process's memory was moved to host RAM.
    Parked,
    /// A group was found holding memory beyond what its shims counted (the device's own
    /// count): charged to it.
    Uncounted,
    /// A parked process's memory came back.
    Woken,
    /// A kind this client does not know (from a newer arbiter).
    #[default]
    #[serde(other)]
    Other,
}

impl EventKind {
    /// How it is shown: `waited`, `swapped out`, ...
    pub fn label(self) -> &'static str {
        match self {
            EventKind::Waited => "waited",
            EventKind::Denied => "denied",
            EventKind::SwappedOut => "swapped out",
            EventKind::SwappedIn => "swapped in",
            EventKind::Ended => "ended",
            EventKind::Refused => "refused",
            EventKind::Parked => "parked",
            EventKind::Woken => "woken",
            EventKind::Uncounted => "uncounted",
            EventKind::Other => "other",
        }
    }
}

/// One event the arbiter logged at INFO or WARN, kept for `gpufrac top`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    /// The GPU's `GPU-...` UUID, or empty when not about one GPU.
    pub gpu: String,
    /// The process it is about.
    pub pid: u32,
    /// Its user: a client is shown only events about its own user's processes.
    #[serde(default)]
    pub uid: u32,
    /// Its group (empty once the process is gone).
    pub group: String,
    /// What happened.
    pub kind: EventKind,
    /// Bytes concerned: granted, swapped, held on loan, asked for.
    pub bytes: u64,
    /// More words: how long it waited, why it was ended or refused.
    pub detail: String,
}

/// The last events, at most a fixed number: the oldest goes when a new one comes.
#[derive(Debug, Clone)]
pub struct EventLog {
    events: VecDeque<Event>,
    capacity: usize,
}

impl EventLog {
    /// An empty log keeping the last `capacity` events (at least one).
    pub fn new(capacity: usize) -> EventLog {
        let capacity = capacity.max(1);
        EventLog { events: VecDeque::with_capacity(capacity), capacity }
    }

    /// Adds `event`, dropping the oldest when full.
    pub fn push(&mut self, event: Event) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }

    /// The events kept, oldest first.
    pub fn recent(&self) -> Vec<Event> {
        self.events.iter().cloned().collect()
    }
}

/// Now, in ms since the Unix epoch (0 on a clock before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis().min(u128::from(u64::MAX)) as u64)
}

/// The whole node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Every GPU the arbiter manages.
    pub gpus: Vec<GpuStatus>,
    /// Host RAM the node allows for swapped-out memory (`--swap-limit`), in bytes.
    #[serde(default)]
    pub swap_limit: u64,
}

/// One GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    /// `GPU-...` UUID.
    pub uuid: String,
    /// Physical memory.
    pub total: u64,
    /// Sum of the requests of the groups on it.
    pub guaranteed: u64,
    /// Sum of the burst grants.
    pub burst: u64,
    /// What is left to grant.
    pub free: u64,
    /// Memory used by processes NVML lists that are not registered with the arbiter
    /// (programs without the shim; after a restart, shims not yet back): never lent.
    #[serde(default)]
    pub outside: u64,
    /// The part of the GPU gpufrac does not manage (`gpufrac-arbiter --gpu-memory`):
    /// processes outside gpufrac may use it without taking from `total`, which is what
    /// gpufrac manages.
    #[serde(default)]
    pub headroom: u64,
    /// Memory groups hold beyond what their shims charged, as the device's own count
    /// shows it (see each process's `uncounted`): charged to those groups, never lent.
    #[serde(default)]
    pub uncounted: u64,
    /// Lent memory being taken back because the guarantees need it (a request admitted
    /// while its memory was lent out): nothing is lent until it is back.
    #[serde(default)]
    pub reclaiming: u64,
    /// Bytes of such debts paid back so far by their borrowers giving back (unused grants,
    /// or memory freed while the debt was open).
    #[serde(default)]
    pub repaid_given_back: u64,
    /// Bytes of such debts paid back by swapping holders out to host RAM.
    #[serde(default)]
    pub repaid_swapped: u64,
    /// Bytes of such debts paid back by ending holders (after the reclaim grace).
    #[serde(default)]
    pub repaid_ended: u64,
    /// Processes waiting for a grant.
    pub waiting: usize,
    /// Bytes of its processes' burst memory swapped out to host RAM.
    #[serde(default)]
    pub swapped: u64,
    /// Bytes of parked groups' memory kept in host RAM.
    #[serde(default)]
    pub parked: u64,
    /// Sum of the requests of parkable groups (parked or not): with `--oversubscribe`
    /// it may pass the GPU's memory.
    #[serde(default)]
    pub parkable_requests: u64,
    /// Parked groups waiting to be woken.
    #[serde(default)]
    pub waking: usize,
    /// Sum of the compute requests of the groups on it, per mille of its time.
    #[serde(default)]
    pub compute_requested_pm: u32,
    /// The GPU is open to one group with a compute share (the only one that wants it, its
    /// limit the whole GPU): no leases now.
    #[serde(default)]
    pub compute_open: bool,
    /// Every registered process, or the first of them when there are very many.
    pub processes: Vec<ProcessStatus>,
    /// Registered processes not listed in `processes` (the document stays small).
    #[serde(default)]
    pub truncated: usize,
}

/// One process on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Process ID in the arbiter's PID namespace.
    pub pid: u32,
    /// Its user (from the kernel): a client is shown only its own user's processes.
    #[serde(default)]
    pub uid: u32,
    /// Its group.
    pub group: String,
    /// `namespace/name` or empty.
    pub pod: String,
    /// The group's request.
    pub request: u64,
    /// The group's limit.
    pub limit: u64,
    /// Bytes it holds, as last reported.
    pub held: u64,
    /// Burst bytes granted to it.
    pub granted: u64,
    /// The group's priority.
    pub priority: i32,
    /// The group's resolver.
    pub resolver: String,
    /// `running`, `waiting`, `swapped`, `parked` (its memory in host RAM), `parking` or
    /// `waking`.
    pub state: String,
    /// Bytes of its burst memory kept in host RAM while swapped out.
    #[serde(default)]
    pub host_bytes: u64,
    /// How long it has waited for bursts, in all (the current wait included), in ms.
    #[serde(default)]
    pub waited_ms: u64,
    /// How long it has been swapped out, in all (the current swap included), in ms.
    #[serde(default)]
    pub swapped_ms: u64,
    /// Its group may be parked once idle this long, in ms; 0: never parked.
    #[serde(default)]
    pub park_after_ms: u64,
    /// Bytes of its device memory kept in host RAM while parked.
    #[serde(default)]
    pub parked_bytes: u64,
    /// How often it was parked and woken.
    #[serde(default)]
    pub parks: u64,
    /// How often it was woken.
    #[serde(default)]
    pub wakes: u64,
    /// How long its last park took, in ms.
    #[serde(default)]
    pub last_park_ms: u64,
    /// How long its last wake took (waiting for room and bringing the memory back), in ms.
    #[serde(default)]
    pub last_wake_ms: u64,
    /// Its group's compute request and limit, per mille of the GPU's time; both 0: no
    /// compute share.
    #[serde(default)]
    pub compute_request_pm: u32,
    /// See `compute_request_pm`.
    #[serde(default)]
    pub compute_limit_pm: u32,
    /// The share of the last second its group held the GPU (its leases, their drains
    /// included, and time the GPU was open to it), per mille.
    #[serde(default)]
    pub compute_held_pm: u32,
    /// The part of a lease period its group is planned now (its request's part among the
    /// groups that want the GPU, up to its limit), per mille.
    #[serde(default)]
    pub compute_allowance_pm: u32,
    /// Its group's lease on the GPU: `open` (the GPU is open to it), `holding`,
    /// `draining` (its lease ended, its work still runs), `waiting` or `idle`; empty
    /// without a compute share.
    #[serde(default)]
    pub compute_state: String,
    /// What its group holds on this GPU beyond what its shims charged, as NVML's
    /// per-process figures show it (memory taken by a path the shim does not see): charged
    /// to the group, against its limit and the GPU's room. The same for every member.
    #[serde(default)]
    pub uncounted: u64,
    /// What it may have: the entitlement's source (`policy FILE: uid 1000`, `kubelet: ...`),
    /// `not entitled: <why>`, or `unrestricted (no policy)`.
    #[serde(default)]
    pub entitlement: String,
    /// What it declared beyond its entitlement and was cut (`priority 100 -> 10`), or empty.
    #[serde(default)]
    pub capped: String,
    /// Its group's key in the arbiter's ledger (`@<derived>`, `<uid>/<name>`,
    /// `<uid>:<pid>/<name>`): what tells groups shown under one name apart (metrics).
    /// Not sent to clients.
    #[serde(skip)]
    pub group_key: String,
}

impl Status {
    /// Lists at most `per_gpu` processes per GPU and `total` in all; those left out are
    /// counted in each GPU's `truncated`.
    pub fn limit_processes(&mut self, per_gpu: usize, total: usize) {
        let mut left = total;
        for g in &mut self.gpus {
            let keep = g.processes.len().min(per_gpu).min(left);
            g.truncated += g.processes.len() - keep;
            g.processes.truncate(keep);
            left -= keep;
        }
    }

    /// Keeps only the processes of `uid` (what a user who is not an admin may see); the
    /// GPUs' totals stay.
    pub fn only_uid(&mut self, uid: u32) {
        for g in &mut self.gpus {
            g.processes.retain(|p| p.uid == uid);
        }
    }
}

impl Document {
    /// Keeps only what `uid` may see (a user who is not an admin): its processes, its
    /// waiting bursts and the events about its processes; the GPUs' totals stay.
    pub fn only_uid(&mut self, uid: u32) {
        self.status.only_uid(uid);
        self.queue.retain(|q| q.uid == uid);
        self.events.retain(|e| e.uid == uid);
    }
}
