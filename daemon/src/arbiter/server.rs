//! The arbiter's socket server: one task per connection reads frames and applies them to
//! the ledger; replies and answers to queued bursts go out through each connection's
//! writer task; a ticker expires waiters. A connection that sends a malformed, oversized
//! or out-of-order frame is closed with a logged reason; the daemon goes on. Closing a
//! connection (the process exited or was killed) releases everything it held at once.
//!
//! Hardened against a client that misbehaves on purpose: connections are capped per UID
//! (the oldest connection that has not said who it is makes room for a new one, so the
//! CLI and new shims of that UID are still served); a connection must say `Hello` or ask
//! for `Status` within [`Options::hello_timeout`] and register a GPU within
//! [`Options::register_timeout`]; when descriptors run out a spare one is given up so the
//! CLI is still answered; group and pod names are checked at `Hello`; log lines about a
//! peer are rate-limited per UID; and no state or metric series is made for a GPU the
//! connection is not registered on.
//!
//! Trusts nothing a client says about itself (README, "Security model"): who it is comes
//! from the kernel at accept (`SO_PEERCRED`, a pidfd, its cgroup); what it may have from
//! an [`Entitlements`] source, asked once per connection before its `Hello` is accepted
//! (and again before its first registration if that lookup failed); what it declares is
//! capped by that. A process the arbiter cannot pin (no pidfd) is not entitled under a
//! source and is lent nothing ever. Processes are signalled only through their pidfd.
//! `gpufrac status` shows a client only its own user's processes unless it is an admin.
//!
//! One file per concern under `server/`: `listener.rs` accepts and caps connections,
//! `frames.rs` frames them, `session.rs` runs each connection and dispatches its requests
//! to `hello.rs`, `register.rs`, `bursts.rs`, `parking.rs` and `compute.rs`; `peers.rs`
//! says who a peer is and what it may have, `endings.rs` signals processes,
//! `resolvers.rs` runs the resolvers on a tick, `processes.rs` watches NVML's process list
//! (and `backstop.rs` acts on what it finds), `logs.rs` and `document.rs` say what
//! happened. Each of those is functions over the policy, or a type owning its part of the
//! state; this file keeps the settings and the state they share, and the follow-up to a
//! change ([`Shared::follow_up`]: what the policy's [`FollowUp`] says must happen). Each
//! request takes the policy's lock once, in `session.rs` (`hello.rs` for the first frame),
//! and passes it down; so do the ticker, the lease task, NVML's look and the checkpoint
//! threads, each step. `listener::serve` stops by ending every connection after the frame
//! in hand, waiting for them at most [`STOP_GRACE`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{DeviceId, Reply};
use tokio::sync::{mpsc, Notify};

use super::document::{EventKind, EventLog, Status};
use super::gpus::ProcessList;
use super::metrics::{GpuLabel, Metrics};
use super::policy::{uuid_string, ConnId, FollowUp, Policy};
use crate::entitlement::identity::{self, Pidfd};
use crate::entitlement::Entitlements;

mod backstop;
mod bursts;
mod compute;
mod connection;
mod document;
mod endings;
mod frames;
mod hello;
mod listener;
mod logs;
mod parking;
mod peers;
mod processes;
mod register;
mod resolvers;
mod session;
pub use crate::arbiter::policy::EnforceLimits;
pub use endings::{Signals, Terminator};
pub use listener::{serve, STOP_GRACE};
pub use parking::ParkWith;

use bursts::Queue;
use connection::Who;
use document::EVENTS_KEPT;
use endings::Ending;
use listener::Admissions;
use logs::Logs;
use peers::Lookups;

/// The priority and swap resolvers' settings.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// A holder idle this long may be ended for an equal-priority burst (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// Between SIGTERM and SIGKILL (`--kill-grace`).
    pub kill_grace: Duration,
    /// How long a holder keeps its burst memory before a swap burst may swap it out
    /// (`--swap-quantum`).
    pub swap_quantum: Duration,
    /// Most host RAM, in bytes, holding swapped-out memory on the node (`--swap-limit`).
    pub swap_limit: u64,
    /// How long borrowers may give back what a guarantee is owed before holders are
    /// ended for it (`--reclaim-grace`).
    pub reclaim_grace: Duration,
    /// Most connections open at once from one UID (`--max-connections-per-uid`).
    pub max_connections_per_uid: usize,
    /// A connection that has not sent `Hello` or `Status` by then is closed.
    pub hello_timeout: Duration,
    /// A connection that said `Hello` but registered no GPU by then is closed.
    pub register_timeout: Duration,
    /// Members of this group (besides root) see every tenant in `gpufrac status`
    /// (`--admin-group`).
    pub admin_gid: Option<u32>,
    /// How far the requests of parkable groups on a GPU may add up past what the other
    /// groups leave (`--oversubscribe`, 1: not past it).
    pub oversubscribe: f64,
    /// How parks move memory (`--park-with`).
    pub park_with: ParkWith,
    /// What is done about a group the device's count shows past what its shims charged
    /// (`--enforce-limits`).
    pub enforce_limits: EnforceLimits,
    /// How long a group stays past its limit by the device's count before it is ended,
    /// under `--enforce-limits end` (`--enforce-grace`).
    pub enforce_grace: Duration,
    /// How much of each GPU gpufrac manages (`--gpu-memory`; checked against the GPUs
    /// by [`crate::arbiter::gpus::managed`]); `None`: all of it.
    pub gpu_memory: Option<gpufrac_common::SizeSpec>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            idle_timeout: Duration::from_secs(300),
            kill_grace: Duration::from_secs(10),
            swap_quantum: Duration::from_secs(10),
            swap_limit: u64::MAX,
            reclaim_grace: crate::arbiter::policy::DEFAULT_RECLAIM_GRACE,
            max_connections_per_uid: 512,
            hello_timeout: Duration::from_secs(5),
            register_timeout: Duration::from_secs(30),
            admin_gid: None,
            oversubscribe: 1.0,
            park_with: ParkWith::Auto,
            enforce_limits: EnforceLimits::Count,
            enforce_grace: crate::arbiter::policy::DEFAULT_ENFORCE_GRACE,
            gpu_memory: None,
        }
    }
}

/// State shared by every connection. Each concern keeps its own part in a type of its own
/// file (the connection caps in `listener.rs`, the entitlement lookups in `peers.rs`, the
/// log budgets in `logs.rs`, the bursts queued in `bursts.rs`); the table of open
/// connections is reached through the small methods below, and what must follow a change
/// to the policy is done by [`Shared::follow_up`], the one place that does it.
pub struct Shared {
    options: Options,
    terminator: Box<dyn Terminator>,
    /// Connections being ended, and when they were sent SIGTERM.
    ending: Mutex<HashMap<ConnId, Ending>>,
    policy: Mutex<Policy>,
    /// The metrics, also served over HTTP.
    pub metrics: Arc<Metrics>,
    /// Metric labels per GPU, made once.
    labels: HashMap<DeviceId, GpuLabel>,
    /// Where memory used outside gpufrac is learnt (NVML); none in tests and benches.
    processes: Option<Box<dyn ProcessList>>,
    /// Per open connection: the pidfd of the process that connected, if one could be had,
    /// and the way to close the connection.
    conns: Mutex<HashMap<ConnId, ConnHandle>>,
    /// Per connection that said `Hello`: where answers decided elsewhere go.
    writers: Mutex<HashMap<ConnId, mpsc::UnboundedSender<Vec<u8>>>>,
    /// Open connections per UID, the pin reserve, the next connection's number.
    admissions: Admissions,
    /// The entitlement source, its verdicts, the lookups in flight.
    lookups: Arc<Lookups>,
    /// Log lines about peers, rate-limited per UID.
    logs: Logs,
    /// The last events logged at INFO or WARN, for `gpufrac top`.
    events: Mutex<EventLog>,
    /// Bursts queued and not answered yet: what the status lists as waiting.
    queued: Queue,
    /// The driver's checkpoint API, once loaded (`None`: not available; parks use the
    /// shim's swap).
    checkpoint_api: std::sync::OnceLock<Option<Arc<crate::checkpoint::CheckpointApi>>>,
    /// Wakes the lease task (compute shares): a shim wanted, was done, came or went.
    leases_changed: Notify,
    /// Set when `serve` stops: every connection ends after the frame in hand.
    stopping: tokio::sync::watch::Sender<bool>,
    /// When each holder was last asked to give back on a GPU: asked at most once per
    /// `ASK_AGAIN_AFTER`.
    asked_to_give_back: Mutex<HashMap<(ConnId, DeviceId), Instant>>,
}

/// What the server keeps of an open connection to act on it from elsewhere.
#[derive(Clone)]
struct ConnHandle {
    pidfd: Option<Arc<Pidfd>>,
    close: Arc<Notify>,
}

impl Shared {
    /// The server state for GPUs `(uuid, memory)`.
    pub fn new(gpus: &[(DeviceId, u64)]) -> Arc<Shared> {
        Shared::with(gpus, Options::default(), Box::new(Signals), None)
    }

    /// The server state with resolver options, a way to end processes and, if given, a
    /// way to see the processes using each GPU.
    pub fn with(
        gpus: &[(DeviceId, u64)],
        options: Options,
        terminator: Box<dyn Terminator>,
        processes: Option<Box<dyn ProcessList>>,
    ) -> Arc<Shared> {
        Shared::entitled(gpus, options, terminator, processes, None)
    }

    /// [`Shared::with`], holding clients to the entitlements of `entitlements` (`None`: no
    /// source, every client believed only about itself).
    pub fn entitled(
        gpus: &[(DeviceId, u64)],
        options: Options,
        terminator: Box<dyn Terminator>,
        processes: Option<Box<dyn ProcessList>>,
        entitlements: Option<Arc<dyn Entitlements>>,
    ) -> Arc<Shared> {
        let mut policy = Policy::new(gpus);
        policy.set_swap_limit(options.swap_limit);
        policy.set_reclaim_grace(options.reclaim_grace);
        policy.set_oversubscribe(options.oversubscribe);
        if let Some(spec) = options.gpu_memory {
            policy
                .set_managed(&gpus.iter().map(|&(id, total)| (id, spec.resolve(total))).collect::<Vec<_>>());
        }
        Arc::new(Shared {
            processes,
            options,
            terminator,
            conns: Mutex::new(HashMap::new()),
            writers: Mutex::new(HashMap::new()),
            admissions: Admissions::new(),
            lookups: Arc::new(Lookups::new(entitlements)),
            logs: Logs::new(),
            ending: Mutex::new(HashMap::new()),
            policy: Mutex::new(policy),
            metrics: Arc::new(Metrics::new()),
            labels: gpus.iter().map(|(id, _)| (*id, GpuLabel { gpu: uuid_string(id) })).collect(),
            events: Mutex::new(EventLog::new(EVENTS_KEPT)),
            queued: Queue::default(),
            checkpoint_api: std::sync::OnceLock::new(),
            leases_changed: Notify::new(),
            stopping: tokio::sync::watch::Sender::new(false),
            asked_to_give_back: Mutex::new(HashMap::new()),
        })
    }

    /// The metric labels of a GPU the arbiter manages; none for any other device ID, so
    /// that no metric series is ever made for one.
    fn label(&self, device: &DeviceId) -> Option<&GpuLabel> {
        self.labels.get(device)
    }

    fn policy(&self) -> MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a new connection, its process not pinned yet; returns the way to close it.
    fn open(&self, conn: ConnId) -> Arc<Notify> {
        let close = Arc::new(Notify::new());
        let handle = ConnHandle { pidfd: None, close: close.clone() };
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).insert(conn, handle);
        close
    }

    /// Keeps the pidfd of the process that opened `conn` (`None`: it could not be pinned).
    fn pin(&self, conn: ConnId, pidfd: Option<Arc<Pidfd>>) {
        if let Some(handle) = self.conns.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&conn) {
            handle.pidfd = pidfd;
        }
    }

    /// The pidfd of the process that opened `conn`, if it is open and was pinned.
    fn pidfd(&self, conn: ConnId) -> Option<Arc<Pidfd>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(&conn).and_then(|c| c.pidfd.clone())
    }

    /// What is kept of `conn`, if it is open.
    fn conn_handle(&self, conn: ConnId) -> Option<ConnHandle> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(&conn).cloned()
    }

    /// `conn` said `Hello`: answers decided elsewhere reach it through `tx`.
    fn add_writer(&self, conn: ConnId, tx: mpsc::UnboundedSender<Vec<u8>>) {
        self.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(conn, tx);
    }

    /// `conn` closed: nothing more is sent to it, nor done to its process.
    fn forget(&self, conn: ConnId) {
        self.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn);
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn);
    }

    fn send(&self, conn: ConnId, reply: &Reply) {
        if let Some(tx) = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&conn) {
            let _ = tx.send(reply.encode());
        }
    }

    /// The most host RAM the process on `conn` can really hold for swapped-out memory
    /// (its resident and swapped host memory, read while its pidfd shows it alive, so the
    /// file was its own): a report of more is not believed. Without a pidfd it cannot be
    /// read safely: a process the arbiter cannot pin is believed to keep nothing there.
    fn host_memory_cap(&self, conn: ConnId, pid: u32) -> u64 {
        let Some(pidfd) = self.pidfd(conn) else { return 0 };
        let held = identity::host_memory_of(pid);
        match held {
            Some(bytes) if pidfd.alive() => bytes,
            _ => 0,
        }
    }

    /// Does what must follow a change to the policy, under the lock the change was made
    /// with (`policy`), in this order: answers to queued bursts, then to wakes, then lease
    /// orders; holders asked to give back and the priority resolver, the swap resolver,
    /// reclaim, a parking step; last the lease task woken. Every change goes through here:
    /// what follows which is decided by the policy ([`FollowUp`]), never by the caller.
    fn follow_up(self: &Arc<Self>, policy: &mut Policy, follow: FollowUp) {
        let FollowUp { answers, wakes, leases, contended, swap, reclaim, park, wake_leases } = follow;
        bursts::deliver(self, policy, answers);
        parking::deliver_wakes(self, policy, wakes);
        for (conn, device, state) in leases {
            self.send(conn, &Reply::Lease { device, state });
        }
        if contended {
            resolvers::ask_to_give_back(self, policy);
            resolvers::resolve_priority(self, policy);
        }
        if swap {
            resolvers::resolve_swap(self, policy);
        }
        if reclaim {
            resolvers::reclaim_guarantees(self, policy);
        }
        if park {
            parking::park_step(self, policy);
        }
        if wake_leases {
            self.leases_changed.notify_one();
        }
    }

    /// The status document, every process listed (what metrics are made from).
    pub fn status(&self) -> Status {
        document::status(self, &self.policy())
    }

    /// The status document served to `gpufrac status`: a bounded number of processes
    /// listed (per GPU and in all), the rest counted, so that it stays under the CLI's
    /// limit on a frame however many processes there are.
    pub fn status_listed(&self) -> Status {
        document::status_listed(self, &self.policy())
    }

    /// Loads the driver's checkpoint API now, failing if it is missing (`--park-with
    /// checkpoint`).
    pub fn require_checkpoint_api(&self) -> Result<(), String> {
        parking::require_checkpoint_api(self)
    }
}

/// What the rooms' unit tests call on the server state, as they called it when each room's
/// functions were methods of it.
#[cfg(test)]
impl Shared {
    /// Keeps an open connection as `accepted` does, its pidfd already taken; returns the
    /// way it is closed.
    fn connected(&self, conn: ConnId, pidfd: Option<Pidfd>) -> Arc<Notify> {
        let close = self.open(conn);
        self.pin(conn, pidfd.map(Arc::new));
        close
    }

    fn admit(&self, who: Who, evict: Arc<Notify>) -> listener::Admission {
        self.admissions.admit(who, evict, self.options.max_connections_per_uid)
    }

    fn identified(&self, who: Who) {
        self.admissions.identified(who)
    }

    fn leave(&self, who: Who) {
        self.admissions.leave(who)
    }

    fn evict_oldest(&self) -> bool {
        self.admissions.evict_oldest()
    }

    async fn verdict(self: &Arc<Shared>, who: Who) -> crate::entitlement::Verdict {
        peers::verdict(self, who).await
    }

    fn signal(&self, conn: ConnId, pid: u32, signal: i32) {
        endings::signal(self, conn, pid, signal)
    }

    fn end(
        &self,
        ending: &mut HashMap<ConnId, Ending>,
        victim: &super::policy::Victim,
        reason: &str,
        now: Instant,
    ) {
        endings::end(self, ending, victim, reason, now)
    }

    fn ending(&self, now: Instant) -> MutexGuard<'_, HashMap<ConnId, Ending>> {
        endings::ending(self, &self.policy(), now)
    }
}
