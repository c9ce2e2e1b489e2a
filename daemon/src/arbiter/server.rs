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

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpufrac_common::protocol::{Denial, DeviceId, Reply, Request, MAX_FRAME, VERSION};
use gpufrac_common::ComputeSpec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, Notify};

use super::gpus::ProcessList;
use super::metrics::{GpuLabel, Metrics, Refusal};
use super::policy::{uuid_string, Answer, ConnId, Outcome, Peer, Policy, Victim};
use super::ratelimit::{RateLimiter, Verdict};
use crate::entitlement::identity::{self, Pidfd};
use crate::entitlement::{believe_hello, believe_register, Entitlements, Identity, NoPolicy};
use crate::status::{Document, Event, EventKind, EventLog, QueuedBurst, Status};

mod backstop;
mod compute;
mod parking;
pub use crate::arbiter::policy::EnforceLimits;
pub use parking::ParkWith;

/// Longest wait a shim may ask for.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// How often waiters are checked against their deadlines.
const TICK: Duration = Duration::from_millis(5);
/// A burst that waited at least this long is logged at INFO (shorter waits at debug: a
/// burst asks in chunks, and most chunks wait a little while bursts take turns).
const LOGGED_WAIT: Duration = Duration::from_secs(1);
/// How often holders are reminded to give back while bursts wait or a guarantee is owed.
const RECLAIM_EVERY: Duration = Duration::from_millis(200);
/// How often NVML is asked which processes use memory (for memory used outside gpufrac).
const OBSERVE_EVERY: Duration = Duration::from_millis(250);
/// Lines about refusals and closings per UID and second.
const REFUSAL_LINES_PER_SECOND: u32 = 5;
/// Lines about connections coming and going, registrations and swaps, per UID and
/// second (generous: a node starting many processes at once logs each).
const CONNECTION_LINES_PER_SECOND: u32 = 50;
/// Most processes listed in a status document, over all GPUs (and [`MAX_LISTED_PER_GPU`]
/// per GPU): about 1 KiB each at most, well under the CLI's limit on a status frame.
const MAX_LISTED: usize = 8192;
/// Most processes listed per GPU in a status document.
const MAX_LISTED_PER_GPU: usize = 4096;
/// Events kept for `gpufrac top` (bursts that waited or were denied, swaps, holders
/// ended, registrations refused): the last this many.
const EVENTS_KEPT: usize = 64;
/// Most waiting bursts listed in a status document.
const MAX_QUEUE_LISTED: usize = 1024;
/// Longest group name (`GPUFRAC_GROUP`).
const MAX_GROUP: usize = 64;
/// Longest pod (`namespace/name`, each part at most 253 characters).
const MAX_POD: usize = 2 * 253 + 1;
/// Longest an entitlement lookup may take (waiting for a slot included) before its answer
/// is `Unknown`: no guarantee nor burst for now, asked again later, never cached.
const LOOKUP_TIMEOUT: Duration = Duration::from_millis(2500);
/// How long a verdict is reused for the same process (its shim reconnecting).
const VERDICT_TTL: Duration = Duration::from_secs(30);
/// Most verdicts cached.
const MAX_VERDICTS: usize = 4096;
/// Most entitlement lookups running at once (each takes one of the runtime's blocking
/// threads while it runs).
const MAX_LOOKUPS: usize = 32;
/// Most entitlement lookups running at once for one UID.
const MAX_LOOKUPS_PER_UID: usize = 8;

/// Ends processes chosen by the priority resolver and for guarantees. Behind a trait so
/// that tests can record instead of signalling.
pub trait Terminator: Send + Sync {
    /// Sends `signal` (`libc::SIGTERM`, `libc::SIGKILL`) to the process `pidfd` names
    /// (`pid` is what it connected as, for logs). `ESRCH`: that process is gone.
    fn signal(&self, pid: u32, pidfd: &Pidfd, signal: i32) -> std::io::Result<()>;
}

/// Signals real processes, only through their pidfd: a reused PID is never signalled.
pub struct Signals;

impl Terminator for Signals {
    fn signal(&self, _pid: u32, pidfd: &Pidfd, signal: i32) -> std::io::Result<()> {
        pidfd.signal(signal)
    }
}

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

/// State shared by every connection.
pub struct Shared {
    options: Options,
    terminator: Box<dyn Terminator>,
    /// Connections being ended, and when they were sent SIGTERM.
    ending: Mutex<HashMap<ConnId, Ending>>,
    policy: Mutex<Policy>,
    writers: Mutex<HashMap<ConnId, mpsc::UnboundedSender<Vec<u8>>>>,
    /// The metrics, also served over HTTP.
    pub metrics: Arc<Metrics>,
    next_conn: AtomicU64,
    /// Metric labels per GPU, made once.
    labels: HashMap<DeviceId, GpuLabel>,
    /// Where memory used outside gpufrac is learnt (NVML); none in tests and benches.
    processes: Option<Box<dyn ProcessList>>,
    /// Open connections per UID.
    uids: Mutex<HashMap<u32, UidConns>>,
    /// Lines about refusals and closings, per UID.
    refusal_log: Mutex<RateLimiter>,
    /// Lines about connections, registrations and swaps, per UID.
    connection_log: Mutex<RateLimiter>,
    /// Where entitlements come from (`NoPolicy`: none configured).
    entitlements: Arc<dyn Entitlements>,
    /// Whether a source is configured (else every client is unrestricted, asked nothing).
    entitled: bool,
    /// Per open connection: the pidfd of the process that connected, if one could be had,
    /// and the way to close the connection.
    conns: Mutex<HashMap<ConnId, ConnHandle>>,
    /// Descriptors kept open to be given up when a process that said `Hello` cannot be
    /// pinned for lack of them (a crowd of idle connections took the rest): without its
    /// pidfd it would be lent nothing for its whole life. Refilled when it can be.
    pin_reserve: Mutex<Vec<std::fs::File>>,
    /// Verdicts by process (PID, start time), reused while its shim reconnects (never a
    /// failed lookup's).
    verdicts: Mutex<HashMap<(u32, u64), (Instant, crate::entitlement::Verdict)>>,
    /// Bounds the entitlement lookups running at once.
    lookups: Arc<tokio::sync::Semaphore>,
    /// Bounds each UID's entitlement lookups running at once.
    uid_lookups: Mutex<HashMap<u32, Arc<tokio::sync::Semaphore>>>,
    /// The last events logged at INFO or WARN, for `gpufrac top`.
    events: Mutex<EventLog>,
    /// Bursts queued and not answered yet, by connection and sequence number: what the
    /// status lists as waiting (with what each needs).
    queued: Mutex<HashMap<(ConnId, u64), Queued>>,
    /// The driver's checkpoint API, once loaded (`None`: not available; parks use the
    /// shim's swap).
    checkpoint_api: std::sync::OnceLock<Option<Arc<crate::checkpoint::CheckpointApi>>>,
    /// Wakes the lease task (compute shares): a shim wanted, was done, came or went.
    leases_changed: Notify,
}

/// A burst queued, as the server saw it go in.
struct Queued {
    device: DeviceId,
    pid: u32,
    bytes: u64,
    resume: bool,
    since: Instant,
}

/// A process being ended.
struct Ending {
    pid: u32,
    /// When it was sent SIGTERM, or SIGKILL once `killed`.
    since: Instant,
    killed: bool,
}

/// What the server keeps of an open connection to act on it from elsewhere.
struct ConnHandle {
    pidfd: Option<Arc<Pidfd>>,
    close: Arc<Notify>,
}

/// One UID's open connections.
#[derive(Default)]
struct UidConns {
    open: usize,
    /// Those that have not said `Hello` or `Status` yet, oldest first, with the way to
    /// close each.
    pending: VecDeque<(ConnId, Arc<Notify>)>,
}

/// Whether a new connection is served.
enum Admission {
    /// Under the cap.
    Served,
    /// At the cap: the oldest connection of its UID that has not said who it is is closed
    /// to make room.
    Evicting(ConnId),
    /// At the cap with every connection identified: closed at once.
    Refused,
}

/// Who is on a connection, from the kernel.
#[derive(Debug, Clone, Copy)]
struct Who {
    conn: ConnId,
    pid: u32,
    uid: u32,
    gid: u32,
}

/// Counts a connection against its UID until dropped.
struct Counted {
    shared: Arc<Shared>,
    who: Who,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.shared.leave(self.who);
    }
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
            entitled: entitlements.is_some(),
            entitlements: entitlements.unwrap_or_else(|| Arc::new(NoPolicy)),
            conns: Mutex::new(HashMap::new()),
            pin_reserve: Mutex::new(pin_reserve()),
            verdicts: Mutex::new(HashMap::new()),
            lookups: Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS)),
            uid_lookups: Mutex::new(HashMap::new()),
            ending: Mutex::new(HashMap::new()),
            policy: Mutex::new(policy),
            writers: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::new()),
            next_conn: AtomicU64::new(1),
            labels: gpus.iter().map(|(id, _)| (*id, GpuLabel { gpu: uuid_string(id) })).collect(),
            uids: Mutex::new(HashMap::new()),
            refusal_log: Mutex::new(RateLimiter::new(REFUSAL_LINES_PER_SECOND, Duration::from_secs(1))),
            connection_log: Mutex::new(RateLimiter::new(CONNECTION_LINES_PER_SECOND, Duration::from_secs(1))),
            events: Mutex::new(EventLog::new(EVENTS_KEPT)),
            queued: Mutex::new(HashMap::new()),
            checkpoint_api: std::sync::OnceLock::new(),
            leases_changed: Notify::new(),
        })
    }

    /// The metric labels of a GPU the arbiter manages; none for any other device ID, so
    /// that no metric series is ever made for one.
    fn label(&self, device: &DeviceId) -> Option<&GpuLabel> {
        self.labels.get(device)
    }

    /// Whether a line about a refusal or a closing for `uid` is written now: `Some` with
    /// how many were left out before it.
    fn refusal_line(&self, uid: u32) -> Option<u64> {
        let verdict = self.refusal_log.lock().unwrap_or_else(|p| p.into_inner()).check(uid, Instant::now());
        match verdict {
            Verdict::Log { suppressed } => Some(suppressed),
            Verdict::Suppress => None,
        }
    }

    /// Whether a line about a connection coming or going, a registration or a swap for
    /// `uid` is written now.
    fn connection_line(&self, uid: u32) -> Option<u64> {
        let verdict =
            self.connection_log.lock().unwrap_or_else(|p| p.into_inner()).check(uid, Instant::now());
        match verdict {
            Verdict::Log { suppressed } => Some(suppressed),
            Verdict::Suppress => None,
        }
    }

    /// Logs a refusal or closing, rate-limited per UID.
    fn log_closing(&self, who: Who, reason: &str) {
        if let Some(suppressed) = self.refusal_line(who.uid) {
            if suppressed > 0 {
                tracing::warn!(
                    pid = who.pid,
                    uid = who.uid,
                    conn = who.conn,
                    suppressed,
                    "closing connection: {reason} (and {suppressed} more lines for this uid left out)"
                );
            } else {
                tracing::warn!(pid = who.pid, uid = who.uid, conn = who.conn, "closing connection: {reason}");
            }
        }
    }

    /// Says how many lines were left out for each UID whose window ended.
    fn flush_logs(&self) {
        let now = Instant::now();
        let refusals = self.refusal_log.lock().unwrap_or_else(|p| p.into_inner()).flush(now);
        for (uid, suppressed) in refusals {
            tracing::warn!(uid, suppressed, "{suppressed} lines about refused or closed connections of this uid left out (at most {REFUSAL_LINES_PER_SECOND} a second)");
        }
        let connections = self.connection_log.lock().unwrap_or_else(|p| p.into_inner()).flush(now);
        for (uid, suppressed) in connections {
            tracing::info!(uid, suppressed, "{suppressed} lines about connections of this uid left out (at most {CONNECTION_LINES_PER_SECOND} a second)");
        }
    }

    /// Counts a new connection against its UID's cap.
    fn admit(&self, who: Who, evict: Arc<Notify>) -> Admission {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        let entry = uids.entry(who.uid).or_default();
        let admission = if entry.open < self.options.max_connections_per_uid.max(1) {
            Admission::Served
        } else if let Some((oldest, notify)) = entry.pending.pop_front() {
            notify.notify_one();
            Admission::Evicting(oldest)
        } else {
            if entry.open == 0 {
                uids.remove(&who.uid);
            }
            return Admission::Refused;
        };
        entry.open += 1;
        entry.pending.push_back((who.conn, evict));
        admission
    }

    /// A connection said who it is: no longer the first to make room.
    fn identified(&self, who: Who) {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = uids.get_mut(&who.uid) {
            entry.pending.retain(|(conn, _)| *conn != who.conn);
        }
    }

    /// A connection closed.
    fn leave(&self, who: Who) {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = uids.get_mut(&who.uid) {
            entry.pending.retain(|(conn, _)| *conn != who.conn);
            entry.open = entry.open.saturating_sub(1);
            if entry.open == 0 {
                uids.remove(&who.uid);
            }
        }
    }

    /// Opens the pin reserve again if it was given up (when descriptors allow).
    fn refill_pin_reserve(&self) {
        let mut reserve = self.pin_reserve.lock().unwrap_or_else(|p| p.into_inner());
        if reserve.is_empty() {
            *reserve = pin_reserve();
        }
    }

    /// Closes the oldest connection, of any UID, that has not said who it is (out of
    /// descriptors). Returns whether there was one.
    fn evict_oldest(&self) -> bool {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        let oldest =
            uids.iter().filter_map(|(uid, e)| e.pending.front().map(|(conn, _)| (*conn, *uid))).min();
        let Some((_, uid)) = oldest else { return false };
        match uids.get_mut(&uid).and_then(|e| e.pending.pop_front()) {
            Some((_, notify)) => {
                notify.notify_one();
                true
            }
            None => false,
        }
    }

    fn policy(&self) -> MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The status document, every process listed (what metrics are made from).
    pub fn status(&self) -> Status {
        let status = self.policy().status();
        Status { swap_limit: self.options.swap_limit, ..status }
    }

    /// The status document served to `gpufrac status`: at most [`MAX_LISTED_PER_GPU`]
    /// processes listed per GPU and [`MAX_LISTED`] in all, the rest counted, so that it
    /// stays under the CLI's limit on a frame however many processes there are.
    pub fn status_listed(&self) -> Status {
        let mut status = self.status();
        status.limit_processes(MAX_LISTED_PER_GPU, MAX_LISTED);
        status
    }

    /// The document served to `who`: [`Shared::status_listed`] with the bursts waiting
    /// and the last events; every process for an admin, else only its own user's (the
    /// GPUs' totals stay), and only the waiters and events about them.
    fn document_for(&self, who: Who, admin: bool) -> Document {
        let status = self.status();
        let queue = self.queue(&status);
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner()).recent();
        let mut document = Document { status, queue, events };
        if !admin {
            document.only_uid(who.uid);
        }
        document.status.limit_processes(MAX_LISTED_PER_GPU, MAX_LISTED);
        document
    }

    /// The bursts waiting, longest first: those queued and not answered whose process
    /// `status` shows waiting (or swapped out, for a swap-in) on that GPU.
    fn queue(&self, status: &Status) -> Vec<QueuedBurst> {
        let now = Instant::now();
        let queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        let mut listed: Vec<(Instant, QueuedBurst)> = queued
            .values()
            .filter_map(|q| {
                let uuid = uuid_string(&q.device);
                let gpu = status.gpus.iter().find(|g| g.uuid == uuid)?;
                let p = gpu
                    .processes
                    .iter()
                    .find(|p| p.pid == q.pid && (p.state == "waiting" || p.state == "swapped"))?;
                let waited = now.saturating_duration_since(q.since);
                Some((
                    q.since,
                    QueuedBurst {
                        gpu: uuid,
                        pid: q.pid,
                        uid: p.uid,
                        group: p.group.clone(),
                        bytes: q.bytes,
                        waited_ms: waited.as_millis() as u64,
                        resume: q.resume,
                    },
                ))
            })
            .collect();
        drop(queued);
        listed.sort_by_key(|(since, q)| (*since, q.pid));
        listed.truncate(MAX_QUEUE_LISTED);
        listed.into_iter().map(|(_, q)| q).collect()
    }

    /// Keeps an event about the process on `conn` (`pid`) for `gpufrac top`: its user and
    /// group from the ledger (a process already gone: shown to admins only).
    fn record(&self, conn: ConnId, pid: u32, gpu: String, kind: EventKind, bytes: u64, detail: String) {
        let (uid, group) = self.policy().peer(conn).map_or((u32::MAX, String::new()), |p| {
            (p.uid, crate::entitlement::shown_group(&p.group).to_owned())
        });
        let event = Event { at_ms: crate::status::now_ms(), gpu, pid, uid, group, kind, bytes, detail };
        self.events.lock().unwrap_or_else(|p| p.into_inner()).push(event);
    }

    /// The GPU on which `pid` borrows the most (where a holder being ended holds its
    /// loan), or empty. Only for events, which are rare: it reads the whole status.
    fn loan_gpu(&self, pid: u32) -> String {
        let status = self.policy().status();
        let on = status
            .gpus
            .iter()
            .filter_map(|g| g.processes.iter().find(|p| p.pid == pid).map(|p| (p.granted, &g.uuid)))
            .max_by_key(|(granted, _)| *granted);
        on.map(|(_, uuid)| uuid.clone()).unwrap_or_default()
    }

    /// Root, or a member of `--admin-group`: its primary group, or a supplementary one as
    /// the kernel gives them for the socket (`SO_PEERGROUPS`, as they were at connect).
    fn is_admin(&self, who: Who, socket: std::os::fd::BorrowedFd<'_>) -> bool {
        if who.uid == 0 {
            return true;
        }
        let Some(admin) = self.options.admin_gid else { return false };
        who.gid == admin || identity::peer_groups(socket).is_ok_and(|groups| groups.contains(&admin))
    }

    /// Takes the pidfd of the process that opened `who`'s connection (at `Hello`, not at
    /// accept: a connection that never says who it is costs no second descriptor).
    fn take_pidfd(&self, who: Who, socket: std::os::fd::BorrowedFd<'_>, cred: Option<&identity::Cred>) {
        let pin = || match cred {
            Some(cred) => identity::pidfd_of(socket, cred),
            None => Err("no credentials for the socket".into()),
        };
        let mut pidfd = pin();
        if pidfd.is_err() {
            // Out of descriptors (`pidfd_open` and `/proc/<pid>/stat` need one each), most
            // likely: give up the reserve, make room for later (the oldest connection that
            // has not said who it is) and try once more. Any other failure fails again.
            let reserve = std::mem::take(&mut *self.pin_reserve.lock().unwrap_or_else(|p| p.into_inner()));
            if !reserve.is_empty() {
                drop(reserve);
                self.evict_oldest();
                pidfd = pin();
                self.refill_pin_reserve();
            }
        }
        let pidfd = match pidfd {
            Ok(fd) => Some(Arc::new(fd)),
            Err(why) => {
                if let Some(suppressed) = self.refusal_line(who.uid) {
                    tracing::warn!(pid = who.pid, uid = who.uid, conn = who.conn, suppressed, "no pidfd for PID {} ({why}): this process will never be signalled, so it is lent no burst memory", who.pid);
                }
                None
            }
        };
        if let Some(handle) = self.conns.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&who.conn) {
            handle.pidfd = pidfd;
        }
    }

    /// The most host RAM the process on `conn` can really hold for swapped-out memory
    /// (its resident and swapped host memory, read while its pidfd shows it alive, so the
    /// file was its own): a report of more is not believed. Without a pidfd it cannot be
    /// read safely: a process the arbiter cannot pin is believed to keep nothing there.
    fn host_memory_cap(&self, conn: ConnId, pid: u32) -> u64 {
        let pidfd =
            self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(&conn).and_then(|c| c.pidfd.clone());
        let Some(pidfd) = pidfd else { return 0 };
        let held = identity::host_memory_of(pid);
        match held {
            Some(bytes) if pidfd.alive() => bytes,
            _ => 0,
        }
    }

    /// The verdict on `who`: from the cache, else from the source in a blocking task
    /// within [`LOOKUP_TIMEOUT`]; without a source, `Unrestricted` at once. With a source:
    /// a connection without a pidfd is not entitled (what /proc says about its PID may be
    /// another process's), and a lookup that fails or times out is
    /// [`Verdict::Unknown`](crate::entitlement::Verdict::Unknown), never cached. At most
    /// [`MAX_LOOKUPS`] lookups run at once ([`MAX_LOOKUPS_PER_UID`] per UID); the others
    /// wait for their turn within the same timeout.
    async fn verdict(self: &Arc<Shared>, who: Who) -> crate::entitlement::Verdict {
        use crate::entitlement::Verdict as V;
        if !self.entitled {
            return V::Unrestricted;
        }
        let pidfd =
            self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(&who.conn).and_then(|c| c.pidfd.clone());
        let Some(pidfd) = pidfd else {
            return V::NotEntitled {
                why: "cannot pin the process that connected (no pidfd: it may have exited, its PID reused)"
                    .into(),
            };
        };
        let deadline = tokio::time::Instant::now() + LOOKUP_TIMEOUT;
        let late = || V::Unknown { why: format!("entitlement lookup took more than {LOOKUP_TIMEOUT:?}") };
        // One UID's connections cannot take every lookup slot, nor all of them the
        // runtime's blocking threads: the permits go with the blocking task, so they are
        // held for as long as it really runs, even past the timeout.
        let per_uid = self.uid_lookups(who.uid);
        let Ok(Ok(uid_permit)) = tokio::time::timeout_at(deadline, per_uid.clone().acquire_owned()).await
        else {
            self.forget_uid_lookups(who.uid, per_uid);
            return late();
        };
        let global = tokio::time::timeout_at(deadline, self.lookups.clone().acquire_owned()).await;
        let Ok(Ok(permit)) = global else {
            drop(uid_permit);
            self.forget_uid_lookups(who.uid, per_uid);
            return late();
        };
        let shared = self.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _permits = (permit, uid_permit);
            let started = identity::start_ticks(who.pid);
            let cgroup = identity::cgroup_of(who.pid);
            // What /proc said is the peer's only if the process that connected was still
            // alive after the reads (its PID cannot have been reused meanwhile).
            if !pidfd.alive() {
                return V::NotEntitled { why: "the process that connected has exited".into() };
            }
            let key = started.map(|t| (who.pid, t));
            if let Some(key) = key {
                let cache = shared.verdicts.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((_, v)) = cache.get(&key).filter(|(at, _)| at.elapsed() < VERDICT_TTL) {
                    return v.clone();
                }
            }
            let identity = Identity { pid: who.pid, uid: who.uid, gid: who.gid, cgroup };
            let verdict = shared.entitlements.lookup(&identity);
            // A failed lookup is no verdict: asked again next time.
            if let Some(key) = key.filter(|_| !verdict.is_unknown()) {
                let mut cache = shared.verdicts.lock().unwrap_or_else(|p| p.into_inner());
                if cache.len() >= MAX_VERDICTS {
                    cache.retain(|_, (at, _)| at.elapsed() < VERDICT_TTL);
                    if cache.len() >= MAX_VERDICTS {
                        cache.clear();
                    }
                }
                cache.insert(key, (Instant::now(), verdict.clone()));
            }
            verdict
        });
        let verdict = match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(e)) => V::Unknown { why: format!("entitlement lookup failed: {e}") },
            Err(_) => late(),
        };
        self.forget_uid_lookups(who.uid, per_uid);
        verdict
    }

    /// The semaphore bounding `uid`'s lookups in flight.
    fn uid_lookups(&self, uid: u32) -> Arc<tokio::sync::Semaphore> {
        let mut map = self.uid_lookups.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(uid).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS_PER_UID))).clone()
    }

    /// Drops `uid`'s semaphore when nothing else uses it (`mine` is the caller's handle; a
    /// waiter, or a lookup still running past its timeout, holds another).
    fn forget_uid_lookups(&self, uid: u32, mine: Arc<tokio::sync::Semaphore>) {
        let mut map = self.uid_lookups.lock().unwrap_or_else(|p| p.into_inner());
        let idle = mine.available_permits() == MAX_LOOKUPS_PER_UID;
        drop(mine);
        if idle && map.get(&uid).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(&uid);
        }
    }

    fn send(&self, conn: ConnId, reply: &Reply) {
        if let Some(tx) = self.writers.lock().unwrap_or_else(|p| p.into_inner()).get(&conn) {
            let _ = tx.send(reply.encode());
        }
    }

    /// Ends `victim`: SIGTERM now, SIGKILL after `--kill-grace` if it is still connected;
    /// its memory comes back when its connection closes.
    fn end(&self, ending: &mut HashMap<ConnId, Ending>, victim: &Victim, reason: &str, now: Instant) {
        self.metrics.terminations.get_or_create(&Refusal { reason: reason.into() }).inc();
        self.signal(victim.conn, victim.pid, libc::SIGTERM);
        ending.insert(victim.conn, Ending { pid: victim.pid, since: now, killed: false });
    }

    /// Signals the process that opened `conn`, through its pidfd only. Without a pidfd
    /// nothing is sent (such a process is never chosen; this is a second guard). If that
    /// process is gone while its connection lives on (it forked and exited, leaving the
    /// connection to a child), its PID may be anyone's now: nothing is signalled, and the
    /// connection is closed, which releases what it held in the ledger (what the child
    /// still uses, NVML then shows as memory outside gpufrac, never lent).
    fn signal(&self, conn: ConnId, pid: u32, signal: i32) {
        let (pidfd, close) = match self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(&conn) {
            Some(c) => (c.pidfd.clone(), c.close.clone()),
            None => return,
        };
        let Some(pidfd) = pidfd else {
            tracing::warn!(
                pid,
                conn,
                "not signalling PID {pid}: the arbiter has no pidfd for it (a PID alone may be reused)"
            );
            return;
        };
        match self.terminator.signal(pid, &pidfd, signal) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                tracing::warn!(pid, conn, "the process that connected as PID {pid} has exited but its connection is still open (held by a child?): not signalling PID {pid}, which may be reused; closing the connection");
                close.notify_one();
            }
            Err(e) => tracing::warn!(pid, conn, "cannot signal PID {pid} through its pidfd: {e}"),
        }
    }

    /// Connections being ended: those past the grace period get SIGKILL; those gone are
    /// forgotten. Returns the ones still under way.
    fn ending(&self, now: Instant) -> MutexGuard<'_, HashMap<ConnId, Ending>> {
        let mut ending = self.ending.lock().unwrap_or_else(|p| p.into_inner());
        for (conn, e) in ending.iter_mut() {
            let overdue = now.saturating_duration_since(e.since) >= self.options.kill_grace;
            if !overdue || self.policy().peer(*conn).is_none() {
                continue;
            }
            if !e.killed {
                tracing::warn!(pid = e.pid, "still running after --kill-grace: SIGKILL");
                self.signal(*conn, e.pid, libc::SIGKILL);
                (e.since, e.killed) = (now, true);
            } else if let Some(handle) = self.conns.lock().unwrap_or_else(|p| p.into_inner()).get(conn) {
                // Connected a grace after SIGKILL: the process that connected cannot be
                // running (a zombie whose children hold its connection?). Its connection is
                // closed; whatever memory is still in use NVML shows as outside gpufrac.
                tracing::warn!(
                    pid = e.pid,
                    "still connected a --kill-grace after SIGKILL: closing its connection"
                );
                handle.close.notify_one();
                e.since = now + Duration::from_secs(3600);
            }
        }
        ending.retain(|conn, _| self.policy().peer(*conn).is_some());
        ending
    }

    /// The priority resolver: ends the holders chosen for waiting priority bursts.
    fn resolve_priority(&self) {
        let now = Instant::now();
        let mut ending = self.ending(now);
        let spared: Vec<ConnId> = ending.keys().copied().collect();
        let victims = self.policy().priority_victims(now, self.options.idle_timeout, &spared);
        for v in victims {
            tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "terminating a holder of burst memory for a priority burst");
            let detail = format!("for a priority burst: {}", v.why);
            self.record(v.conn, v.pid, self.loan_gpu(v.pid), EventKind::Ended, v.bytes, detail);
            let reason = if v.why.starts_with("idle") { "idle" } else { "lower-priority" };
            self.end(&mut ending, &v, reason, now);
        }
    }

    /// Takes loans back where the guarantees are owed memory: unused grants first, then
    /// swap-outs, then ending holders (see `policy::reclaim`).
    fn reclaim_guarantees(&self) {
        let now = Instant::now();
        let mut ending = self.ending(now);
        let under_way: Vec<ConnId> = ending.keys().copied().collect();
        let plan = self.policy().reclaim(now, &under_way, self.options.swap_limit);
        if plan.is_empty() {
            return;
        }
        for (conn, device) in &plan.give_back {
            self.send(*conn, &Reply::Reclaim { device: *device });
        }
        for v in &plan.swap_out {
            tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a guarantee");
            self.send(v.conn, &Reply::SwapOut { device: v.device });
        }
        for v in &plan.end {
            tracing::warn!(pid = v.pid, group = %v.group, bytes = v.bytes, why = %v.why, "ending a holder of burst memory for a guarantee");
            let detail = format!("for a guarantee: {}", v.why);
            self.record(v.conn, v.pid, self.loan_gpu(v.pid), EventKind::Ended, v.bytes, detail);
            self.end(&mut ending, v, "guarantee", now);
        }
    }

    /// The swap resolver: asks the chosen holders to swap out, and swapped-out processes
    /// to come back when memory is free.
    fn resolve_swap(&self) {
        let victims =
            self.policy().swap_victims(Instant::now(), self.options.swap_quantum, self.options.swap_limit);
        for v in victims {
            tracing::info!(pid = v.pid, group = %v.group, gpu = %uuid_string(&v.device), bytes = v.bytes, "asking a holder of burst memory to swap out for a swap burst");
            self.send(v.conn, &Reply::SwapOut { device: v.device });
        }
        // Memory counts as free again once no burst was asked for during a quantum (at
        // most a second), so a process in the middle of a burst is not raced.
        let settle = self.options.swap_quantum.min(Duration::from_secs(1));
        let resumable = self.policy().resume_candidates(Instant::now(), settle);
        for (conn, device) in resumable {
            self.send(conn, &Reply::Resume { device });
        }
    }

    /// Learns which processes use each GPU: memory of those not registered is not lent.
    fn observe_processes(&self) {
        let Some(list) = &self.processes else { return };
        let now = Instant::now();
        for (device, listed) in list.processes() {
            let answers = self.policy().observe_processes(device, &listed, now);
            self.deliver(answers);
        }
        // Each look also compared the device's count with the shims'.
        self.backstop();
    }

    /// While bursts wait, holders of grants are asked to give back what they do not use.
    fn ask_to_give_back(&self) {
        let holders = self.policy().contended_holders(Instant::now());
        for (conn, device) in holders {
            self.send(conn, &Reply::Reclaim { device });
        }
    }

    /// Sends the answers to queued bursts, counts and logs them.
    fn deliver(&self, answers: Vec<Answer>) {
        for a in answers {
            let asked = self.queued.lock().unwrap_or_else(|p| p.into_inner()).remove(&(a.conn, a.seq));
            // Answers come from the ledger, so always for a GPU it manages.
            let gpu = self.label(&a.device);
            let uuid = uuid_string(&a.device);
            let (pid, group) =
                self.policy().peer(a.conn).map_or((0, String::new()), |p| (p.pid, p.group.clone()));
            if let Some(gpu) = gpu {
                self.metrics.wait_seconds.get_or_create(gpu).observe(a.waited.as_secs_f64());
            }
            match a.result {
                Ok(bytes) => {
                    if let Some(gpu) = gpu {
                        self.metrics.grants.get_or_create(gpu).inc();
                        self.metrics.granted_bytes.get_or_create(gpu).inc_by(bytes);
                    }
                    // Operators see bursts that waited long, not allocator traffic.
                    if a.waited >= LOGGED_WAIT {
                        tracing::info!(pid, %group, gpu = %uuid, bytes, waited_ms = a.waited.as_millis() as u64, "a burst waited {} ms for its memory", a.waited.as_millis());
                        let detail = format!("waited {} ms for its memory", a.waited.as_millis());
                        self.record(a.conn, pid, uuid.clone(), EventKind::Waited, bytes, detail);
                    } else {
                        tracing::debug!(pid, %group, gpu = %uuid, bytes, waited_ms = a.waited.as_millis() as u64, "grant after wait");
                    }
                    self.send(a.conn, &Reply::Granted { seq: a.seq, bytes });
                }
                Err(reason) => {
                    if let (Denial::Timeout, Some(gpu)) = (reason, gpu) {
                        self.metrics.timeouts.get_or_create(gpu).inc();
                    }
                    tracing::info!(pid, %group, gpu = %uuid, waited_ms = a.waited.as_millis() as u64, ?reason, "burst denied");
                    let detail = format!("{reason:?} after waiting {} ms", a.waited.as_millis());
                    let bytes = asked.map_or(0, |q| q.bytes);
                    self.record(a.conn, pid, uuid.clone(), EventKind::Denied, bytes, detail);
                    self.send(a.conn, &Reply::Denied { seq: a.seq, reason });
                }
            }
        }
    }
}

/// Serves shims and the CLI on `listener` until `shutdown` completes.
pub async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    // Before the first burst: a restarted arbiter must not lend memory that shims not yet
    // back still hold.
    let observer = shared.clone();
    let _ = tokio::task::spawn_blocking(move || observer.observe_processes()).await;
    let watcher = tokio::spawn(watch_processes(shared.clone()));
    let leases = tokio::spawn(compute::run_leases(shared.clone()));
    let ticker = tokio::spawn(expire_waiters(shared.clone()));
    let accept = async {
        // Kept open to be given up when descriptors run out, so that one more connection
        // (the CLI's) can still be accepted.
        let mut spare = spare_descriptor();
        let mut last_warning: Option<Instant> = None;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    accepted(stream, &shared);
                    if spare.is_none() {
                        spare = spare_descriptor();
                    }
                    shared.refill_pin_reserve();
                }
                Err(e) => {
                    let out_of_descriptors = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                        last_warning = Some(Instant::now());
                        if out_of_descriptors {
                            tracing::warn!("accept failed: {e}: closing the oldest connection that has not said who it is, serving one more on a spare descriptor (this line at most once a second)");
                        } else {
                            tracing::warn!("accept failed: {e} (this line at most once a second)");
                        }
                    }
                    if out_of_descriptors {
                        // Make room for later connections (the oldest connection that
                        // has not said who it is), and serve this one on the spare.
                        let evicted = shared.evict_oldest();
                        if spare.take().is_some() {
                            if let Ok((stream, _)) = listener.accept().await {
                                accepted(stream, &shared);
                            }
                            continue;
                        }
                        if evicted {
                            // Its descriptor is free once its task has run.
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                    }
                    // Never spin: the connection waiting stays in the backlog.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    tokio::select! {
        _ = accept => {}
        _ = shutdown => {}
    }
    ticker.abort();
    watcher.abort();
    leases.abort();
}

/// A descriptor to give up when there are no more.
fn spare_descriptor() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

/// The descriptors pinning one process takes (its pidfd, and its `/proc/<pid>/stat` on
/// kernels without `SO_PEERPIDFD`), to give up for it; empty if they cannot be had now.
fn pin_reserve() -> Vec<std::fs::File> {
    let reserve: Vec<std::fs::File> = (0..2).filter_map(|_| spare_descriptor()).collect();
    if reserve.len() == 2 {
        reserve
    } else {
        Vec::new()
    }
}

/// Counts a new connection against its UID and serves it, or closes it at once.
fn accepted(stream: UnixStream, shared: &Arc<Shared>) {
    // The peer's PID, UID and GID come from the kernel, never from a message; so does the
    // pidfd every signal to it goes through, taken at its `Hello`.
    let cred = identity::cred_of(stream.as_fd()).ok();
    let (pid, uid, gid) = cred.map_or((0, u32::MAX, u32::MAX), |c| (c.pid, c.uid, c.gid));
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let who = Who { conn, pid, uid, gid };
    let evict = Arc::new(Notify::new());
    match shared.admit(who, evict.clone()) {
        Admission::Served => {}
        Admission::Evicting(oldest) => {
            if let Some(suppressed) = shared.refusal_line(uid) {
                tracing::warn!(pid, uid, conn, oldest, suppressed, "{} connections from this uid (--max-connections-per-uid): closing its oldest that has not said who it is", shared.options.max_connections_per_uid);
            }
        }
        Admission::Refused => {
            drop(stream);
            shared.metrics.refusals.get_or_create(&Refusal { reason: "connections-per-uid".into() }).inc();
            shared.log_closing(
                who,
                &format!(
                    "{} connections from this uid already (--max-connections-per-uid)",
                    shared.options.max_connections_per_uid
                ),
            );
            return;
        }
    }
    let close = Arc::new(Notify::new());
    shared
        .conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(conn, ConnHandle { pidfd: None, close: close.clone() });
    let counted = Counted { shared: shared.clone(), who };
    tokio::spawn(handle(stream, counted, evict, close, cred));
}

async fn watch_processes(shared: Arc<Shared>) {
    if shared.processes.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(OBSERVE_EVERY);
    // After a slow NVML answer, wait a whole period rather than ask again at once.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let observer = shared.clone();
        let _ = tokio::task::spawn_blocking(move || observer.observe_processes()).await;
    }
}

async fn expire_waiters(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(TICK);
    let mut last_reclaim = Instant::now();
    let mut last_flush = Instant::now();
    loop {
        tick.tick().await;
        if last_flush.elapsed() >= Duration::from_secs(1) {
            last_flush = Instant::now();
            shared.flush_logs();
        }
        // Wakes first: one lends again, which may leave a queued burst without a chance,
        // refused at once by `expire`.
        shared.park_step();
        let answers = shared.policy().expire(Instant::now());
        if !answers.is_empty() {
            shared.deliver(answers);
        }
        // Keep reminding holders while anyone waits (they keep no slack meanwhile), and
        // let the priority resolver look again (holders become idle over time).
        if last_reclaim.elapsed() >= RECLAIM_EVERY {
            last_reclaim = Instant::now();
            shared.ask_to_give_back();
            shared.resolve_priority();
        }
        shared.resolve_swap();
        shared.reclaim_guarantees();
    }
}

async fn handle(
    stream: UnixStream,
    counted: Counted,
    evict: Arc<Notify>,
    close: Arc<Notify>,
    cred: Option<identity::Cred>,
) {
    let shared = counted.shared.clone();
    let who = counted.who;
    let (conn, pid) = (who.conn, who.pid);
    let (mut reader, mut writer) = stream.into_split();
    // Answers decided elsewhere (a grant after a wait) arrive here; direct replies are
    // written by this task at once, without a hop through another task.
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut state = Connection {
        who,
        greeted: false,
        registered: false,
        verdict: None,
        hello: None,
        capped_logged: false,
        admin: false,
    };
    let mut buf = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    // Until `Hello` or `Status`, then until a GPU is registered; then none.
    let mut deadline = Some(tokio::time::Instant::now() + shared.options.hello_timeout);
    let result: Result<(), String> = loop {
        tokio::select! {
            _ = evict.notified() => {
                break Err("too many connections: the oldest that had not said who it is".into());
            }
            _ = close.notified() => {
                break Err("the process that connected has exited; its connection is closed rather than its PID signalled".into());
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                break Err(if state.greeted {
                    format!("no GPU registered within {:?} of Hello", shared.options.register_timeout)
                } else {
                    format!("no Hello or Status within {:?}", shared.options.hello_timeout)
                });
            }
            frame = next_frame(&mut reader, &mut buf) => {
                let body = match frame {
                    Ok(Some(body)) => body,
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(e),
                };
                out.clear();
                let greeted = state.greeted;
                let request = match Request::decode(&body) {
                    Ok(request) => request,
                    Err(e) => break Err(e.to_string()),
                };
                if !state.greeted {
                    let socket = reader.as_ref().as_fd();
                    match request {
                        Request::Hello { .. } => {
                            shared.take_pidfd(who, socket, cred.as_ref());
                            // What the client may have is known before its Hello is accepted.
                            if state.verdict.is_none() {
                                state.verdict = Some(shared.verdict(who).await);
                            }
                        }
                        Request::Status => state.admin = shared.is_admin(who, socket),
                        _ => {}
                    }
                } else if matches!(request, Request::Register { .. }) {
                    look_up_again(&shared, &mut state).await;
                }
                let flow = on_frame(&shared, &mut state, &tx, request, &mut out);
                if state.registered {
                    deadline = None;
                } else if state.greeted && !greeted {
                    shared.identified(who);
                    deadline = Some(tokio::time::Instant::now() + shared.options.register_timeout);
                }
                if !out.is_empty() && writer.write_all(&out).await.is_err() {
                    break Ok(());
                }
                match flow {
                    Ok(Flow::Continue) => {}
                    Ok(Flow::Close) => break Ok(()),
                    Err(e) => break Err(e),
                }
            }
            Some(frame) = rx.recv() => {
                if writer.write_all(&frame).await.is_err() {
                    break Ok(());
                }
            }
        }
    };
    if let Err(reason) = result {
        shared.metrics.refusals.get_or_create(&Refusal { reason: "bad-frame".into() }).inc();
        shared.log_closing(who, &reason);
    }
    shared.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn);
    shared.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn);
    let had_peer = shared.policy().peer(conn).is_some();
    let answers = shared.policy().disconnect(conn, Instant::now());
    shared.queued.lock().unwrap_or_else(|p| p.into_inner()).retain(|(c, _), _| *c != conn);
    if had_peer && shared.connection_line(who.uid).is_some() {
        tracing::info!(pid, uid = who.uid, conn, "process gone: released what it held");
    }
    shared.deliver(answers);
    // A lease it held goes on at once.
    shared.leases_changed.notify_one();
    // What it held may wake a parked group.
    shared.park_step();
    // The connection stops counting against its UID only now.
    drop(counted);
}

/// The next frame body from `reader`, buffering in `buf`; `Ok(None)` at a clean end of
/// stream. Cancel-safe: bytes already read stay in `buf`.
async fn next_frame(reader: &mut OwnedReadHalf, buf: &mut Vec<u8>) -> Result<Option<Vec<u8>>, String> {
    loop {
        if buf.len() >= 4 {
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len == 0 || len > MAX_FRAME {
                return Err(format!("frame of {len} bytes (allowed: 1 to {MAX_FRAME})"));
            }
            if buf.len() >= 4 + len {
                let body = buf[4..4 + len].to_vec();
                buf.drain(..4 + len);
                return Ok(Some(body));
            }
        }
        match reader.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err(format!("connection closed in the middle of a frame ({} bytes)", buf.len())),
            Ok(_) => {}
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// What one connection has said so far.
struct Connection {
    who: Who,
    /// Said `Hello`.
    greeted: bool,
    /// Registered on a GPU at least once.
    registered: bool,
    /// What it may have, asked when its `Hello` came (and again before a registration
    /// while it is unknown).
    verdict: Option<crate::entitlement::Verdict>,
    /// What it declared at `Hello`.
    hello: Option<Declared>,
    /// A cut registration was logged already (once per connection).
    capped_logged: bool,
    /// May see every tenant in `gpufrac status` (root or `--admin-group`).
    admin: bool,
}

/// Why a group name from `Hello` is refused, if it is: 1 to 64 of `A-Za-z0-9._-`.
fn check_group(group: &str) -> Result<(), String> {
    let ok = !group.is_empty()
        && group.len() <= MAX_GROUP
        && group.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!("group {group:?} refused: expected 1 to {MAX_GROUP} of A-Z a-z 0-9 . _ -"))
    }
}

/// Why a pod from `Hello` is refused, if it is: empty, or 1 to 507 of `A-Za-z0-9._-/:`.
fn check_pod(pod: &str) -> Result<(), String> {
    let ok = pod.len() <= MAX_POD
        && pod.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/' | b':'));
    if ok {
        Ok(())
    } else {
        Err(format!("pod {pod:?} refused: expected at most {MAX_POD} of A-Z a-z 0-9 . _ - / :"))
    }
}

enum Flow {
    Continue,
    Close,
}

fn reply(out: &mut Vec<u8>, r: &Reply) {
    out.extend_from_slice(&r.encode());
}

/// What a client declared at `Hello`, kept to apply a later verdict to.
struct Declared {
    group: String,
    resolver: gpufrac_common::Resolver,
    priority: i32,
    compute: Option<ComputeSpec>,
}

/// What the arbiter believes of `c`'s `Hello` under its verdict (logged when capped).
fn believe(shared: &Shared, c: &Connection) -> crate::entitlement::Believed {
    let (pid, uid) = (c.who.pid, c.who.uid);
    let verdict = c.verdict.as_ref().unwrap_or(&crate::entitlement::Verdict::Unrestricted);
    let (group, resolver, priority, compute) = match &c.hello {
        Some(d) => (d.group.as_str(), d.resolver, d.priority, d.compute),
        None => ("", gpufrac_common::Resolver::Wait, 0, None),
    };
    // The cgroup is not needed here: the verdict holds what it decided.
    let identity = Identity { pid, uid, gid: c.who.gid, cgroup: crate::entitlement::Cgroup::Host };
    let believed =
        believe_hello(verdict, shared.entitlements.as_ref(), &identity, group, resolver, priority, compute);
    if !believed.capped.is_empty() {
        if let Some(suppressed) = shared.refusal_line(uid) {
            tracing::warn!(pid, uid, suppressed, entitlement = %believed.entitlement, "the shim declared more than its entitlement: {}", believed.capped.join(", "));
        }
    }
    believed
}

/// A connection whose lookup failed ([`Verdict::Unknown`](crate::entitlement::Verdict::Unknown))
/// and that has registered no GPU yet is looked up again before its registration; an
/// answer now replaces what was believed of its `Hello` (its group, resolver, priority,
/// compute share).
async fn look_up_again(shared: &Arc<Shared>, c: &mut Connection) {
    if c.registered || !c.verdict.as_ref().is_some_and(|v| v.is_unknown()) {
        return;
    }
    let verdict = shared.verdict(c.who).await;
    if verdict.is_unknown() {
        c.verdict = Some(verdict);
        return;
    }
    c.verdict = Some(verdict);
    let believed = believe(shared, c);
    let mut policy = shared.policy();
    let Some(mut peer) = policy.peer(c.who.conn).cloned() else { return };
    peer.group = believed.group_key;
    peer.resolver = believed.resolver;
    peer.priority = believed.priority;
    peer.compute = believed.compute;
    peer.vetted = believed.vetted;
    peer.entitlement = believed.entitlement;
    peer.capped = believed.capped.join(", ");
    policy.hello(c.who.conn, peer);
}

/// Applies one frame; direct replies go into `out`.
fn on_frame(
    shared: &Arc<Shared>,
    c: &mut Connection,
    tx: &mpsc::UnboundedSender<Vec<u8>>,
    request: Request,
    out: &mut Vec<u8>,
) -> Result<Flow, String> {
    let (conn, pid, uid) = (c.who.conn, c.who.pid, c.who.uid);
    if !c.greeted {
        return match request {
            Request::Status => {
                // Plain data built under the ledger's lock, serialized outside it; only
                // what this user may see.
                let document = shared.document_for(c.who, c.admin);
                let json = serde_json::to_string(&document).map_err(|e| e.to_string())?;
                reply(out, &Reply::Status { json });
                Ok(Flow::Close)
            }
            Request::Hello {
                version,
                group,
                pod,
                resolver,
                priority,
                wait_timeout_ms,
                park_after_ms,
                compute_request_pm,
                compute_limit_pm,
            } => {
                // Names reach logs and `gpufrac status`: nothing but the characters the
                // shim allows is accepted.
                check_group(&group)?;
                check_pod(&pod)?;
                // What it manages of each GPU: the shim's fractions are of it.
                let managed = shared.policy().totals();
                reply(out, &Reply::Welcome { version: VERSION, pid, managed });
                if version != VERSION {
                    return Err(format!("protocol version {version}, this arbiter speaks {VERSION}"));
                }
                let wait_timeout = Duration::from_millis(wait_timeout_ms).min(MAX_WAIT);
                shared.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(conn, tx.clone());
                if shared.connection_line(uid).is_some() {
                    tracing::info!(pid, uid, %group, %pod, %resolver, priority, "shim connected");
                }
                let now = Instant::now();
                c.verdict.get_or_insert(crate::entitlement::Verdict::Unrestricted);
                // Checked when the frame was decoded.
                let compute = ComputeSpec::from_wire(compute_request_pm, compute_limit_pm).ok().flatten();
                c.hello = Some(Declared { group, resolver, priority, compute });
                let believed = believe(shared, c);
                let signalable = shared
                    .conns
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&conn)
                    .is_some_and(|h| h.pidfd.is_some());
                let peer = Peer {
                    pid,
                    uid,
                    group: believed.group_key,
                    pod,
                    resolver: believed.resolver,
                    priority: believed.priority,
                    wait_timeout,
                    last_active: now,
                    activity: 0,
                    vetted: believed.vetted,
                    signalable,
                    entitlement: believed.entitlement,
                    capped: believed.capped.join(", "),
                    park_after: (park_after_ms > 0).then(|| Duration::from_millis(park_after_ms)),
                    // Held to its entitlement like its priority.
                    compute: believed.compute,
                };
                if park_after_ms > 0 {
                    shared.parkable_hello();
                }
                let mut policy = shared.policy();
                policy.hello(conn, peer);
                if !signalable {
                    // Shown in status: its bursts are refused (a loan must be takeable back).
                    policy
                        .note_capped(conn, "no burst (no pidfd: it could never be made to give a loan back)");
                }
                drop(policy);
                c.greeted = true;
                Ok(Flow::Continue)
            }
            other => Err(format!("expected Hello or Status first, got {other:?}")),
        };
    }
    match request {
        Request::Register { device, total, request, limit, held, granted, swapped } => {
            // Capped by the entitlement on the GPU's own size, not the one the shim reports.
            let device_total = shared.policy().total(&device).unwrap_or(total);
            let verdict = c.verdict.as_ref().unwrap_or(&crate::entitlement::Verdict::Unrestricted);
            let (declared_request, declared_limit) = (request, limit);
            let (request, limit, cut) = believe_register(verdict, &device, device_total, request, limit);
            // A limit below the request is the shim's error, reported as such.
            let (request, limit) = if declared_limit < declared_request {
                (declared_request, declared_limit)
            } else {
                (request, limit)
            };
            if let Some(cut) = &cut {
                shared.policy().note_capped(conn, cut);
                if !c.capped_logged {
                    c.capped_logged = true;
                    if let Some(suppressed) = shared.refusal_line(uid) {
                        tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "registration beyond the entitlement: {cut}");
                    }
                }
            }
            // Swapped-out memory it says it keeps is in its own host memory, or nowhere.
            let swapped = if swapped > 0 { swapped.min(shared.host_memory_cap(conn, pid)) } else { 0 };
            let result =
                shared.policy().register(conn, device, total, request, limit, held, granted, swapped);
            match result {
                Ok(parked) => {
                    c.registered = true;
                    if shared.connection_line(uid).is_some() {
                        tracing::info!(pid, gpu = %uuid_string(&device), request, limit, held, granted, swapped, "registered");
                    }
                    let (request, limit, context, small) = {
                        let policy = shared.policy();
                        let (request, limit) = policy.group_of(conn, &device).unwrap_or((request, limit));
                        (
                            request,
                            limit,
                            policy.context_bytes(&device).unwrap_or(0),
                            policy.small_request_warning(&device, request),
                        )
                    };
                    if let Some(warning) = small {
                        if let Some(suppressed) = shared.refusal_line(uid) {
                            tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "{warning}");
                        }
                    }
                    reply(out, &Reply::Registered { device, request, limit, parked, context });
                    // Its request may be lent out: take it back now (or parked groups
                    // crowd it: park them).
                    shared.reclaim_guarantees();
                    shared.park_step();
                    // A group with a compute share joins the leases.
                    shared.leases_changed.notify_one();
                }
                Err(reason) => {
                    shared.metrics.refusals.get_or_create(&Refusal { reason: "admission".into() }).inc();
                    if let Some(suppressed) = shared.refusal_line(uid) {
                        tracing::warn!(pid, uid, suppressed, gpu = %uuid_string(&device), "registration refused: {reason}");
                    }
                    let detail = format!("registration refused: {reason}");
                    shared.record(conn, pid, uuid_string(&device), EventKind::Refused, request, detail);
                    reply(out, &Reply::Refused { device, reason });
                }
            }
        }
        Request::Acquire { seq, device, bytes, preferred, held, resume } => {
            let outcome =
                shared.policy().acquire(conn, device, seq, bytes, preferred, held, resume, Instant::now());
            // No metric series for a device ID the arbiter does not manage.
            let gpu = shared.label(&device);
            match outcome {
                Outcome::Granted(granted) => {
                    if let Some(gpu) = gpu {
                        shared.metrics.grants.get_or_create(gpu).inc();
                        shared.metrics.granted_bytes.get_or_create(gpu).inc_by(granted);
                    }
                    reply(out, &Reply::Granted { seq, bytes: granted });
                }
                Outcome::Queued => {
                    if let Some(gpu) = gpu {
                        shared.metrics.waits.get_or_create(gpu).inc();
                    }
                    let queued = Queued { device, pid, bytes, resume, since: Instant::now() };
                    shared.queued.lock().unwrap_or_else(|p| p.into_inner()).insert((conn, seq), queued);
                    tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "burst waits: memory is lent out");
                    let answers = shared.policy().settle(device, Instant::now());
                    shared.deliver(answers);
                    shared.ask_to_give_back();
                    shared.resolve_priority();
                    shared.resolve_swap();
                }
                Outcome::Denied(reason) => {
                    shared.metrics.refusals.get_or_create(&Refusal { reason: format!("{reason:?}") }).inc();
                    reply(out, &Reply::Denied { seq, reason });
                }
            }
        }
        Request::Activity { count } => shared.policy().activity(conn, count, Instant::now()),
        Request::Release { device, bytes, held } => {
            let answers = shared.policy().release(conn, device, bytes, held, Instant::now());
            if !answers.is_empty() {
                shared.deliver(answers);
            }
        }
        Request::Swapped { device, direction, bytes, granted, host_bytes, held, micros } => {
            // Counted and logged only for a GPU this connection is registered on: any
            // other device ID would make a metric series per frame.
            let member = shared.policy().is_member(conn, &device);
            if let (true, Some(gpu)) = (member, shared.label(&device)) {
                let direction = direction.as_str();
                let took = Duration::from_micros(micros);
                if shared.connection_line(uid).is_some() {
                    tracing::info!(pid, gpu = %gpu.gpu, bytes, host_bytes, granted, ms = took.as_millis() as u64, us = micros, "swapped {direction}");
                }
                if bytes > 0 {
                    shared.metrics.count_swap(gpu, direction, bytes, took);
                    let kind = if direction == "in" { EventKind::SwappedIn } else { EventKind::SwappedOut };
                    let detail = format!("swapped {direction} in {} ms", took.as_millis());
                    shared.record(conn, pid, gpu.gpu.clone(), kind, bytes, detail);
                }
            }
            let host_bytes =
                if host_bytes > 0 { host_bytes.min(shared.host_memory_cap(conn, pid)) } else { 0 };
            let answers = shared.policy().swapped(conn, device, granted, host_bytes, held, Instant::now());
            shared.deliver(answers);
        }
        Request::Parked { device, host_bytes, held, micros } => {
            shared.on_parked((conn, pid), device, host_bytes, held, micros);
        }
        Request::Wake { seq, device } => {
            if let Some(answer) = shared.on_wake((conn, pid), seq, device) {
                reply(out, &answer);
            }
        }
        Request::Woken { device, held, micros } => shared.on_woken((conn, pid), device, held, micros),
        Request::ContextMeasured { device, bytes } => {
            tracing::debug!(pid, gpu = %uuid_string(&device), bytes, "a context measured");
            shared.policy().context_measured(conn, &device, bytes);
        }
        Request::Want { device } => shared.on_want(conn, device),
        Request::LeaseDone { device, lease, drain_us, more } => {
            shared.on_lease_done(conn, device, lease, drain_us, more)
        }
        other => return Err(format!("unexpected {other:?} after Hello")),
    }
    Ok(Flow::Continue)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what it is asked to signal: the PID it was told, the PID the pidfd names
    /// (from the kernel), and the signal; sends nothing.
    #[derive(Default)]
    struct Recording(Arc<Mutex<Vec<Sent>>>);

    /// (PID told, PID the pidfd names, signal).
    type Sent = (u32, Option<u32>, i32);

    impl Terminator for Recording {
        fn signal(&self, pid: u32, pidfd: &Pidfd, signal: i32) -> std::io::Result<()> {
            self.0.lock().unwrap().push((pid, pidfd.pid(), signal));
            Ok(())
        }
    }

    fn handle(shared: &Shared, conn: ConnId, pidfd: Option<Pidfd>) -> Arc<Notify> {
        let close = Arc::new(Notify::new());
        let handle = ConnHandle { pidfd: pidfd.map(Arc::new), close: close.clone() };
        shared.conns.lock().unwrap().insert(conn, handle);
        close
    }

    #[test]
    fn signals_go_through_the_pidfd_of_the_process_that_connected() {
        let record = Recording::default();
        let sent = record.0.clone();
        let shared = Shared::with(&[], Options::default(), Box::new(record), None);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        handle(&shared, 1, Some(Pidfd::open(child.id()).expect("pidfd_open")));
        handle(&shared, 2, None);
        // Whatever PID the caller names, the pidfd decides which process it is.
        shared.signal(1, 4242, libc::SIGTERM);
        shared.signal(2, child.id(), libc::SIGKILL);
        shared.signal(3, child.id(), libc::SIGKILL);
        assert_eq!(
            *sent.lock().unwrap(),
            vec![(4242, Some(child.id()), libc::SIGTERM)],
            "only through a pidfd"
        );
        child.kill().expect("kill");
        child.wait().expect("reap");
    }

    #[test]
    fn a_process_still_connected_a_grace_after_sigkill_has_its_connection_closed() {
        let record = Recording::default();
        let sent = record.0.clone();
        let grace = Duration::from_secs(10);
        let shared =
            Shared::with(&[], Options { kill_grace: grace, ..Options::default() }, Box::new(record), None);
        let child = Reaped(std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep"));
        let close = handle(&shared, 1, Some(Pidfd::open(child.0.id()).expect("pidfd_open")));
        let now = Instant::now();
        let peer = Peer {
            pid: child.0.id(),
            uid: 0,
            group: "g".into(),
            pod: String::new(),
            resolver: gpufrac_common::Resolver::Wait,
            priority: 0,
            wait_timeout: Duration::ZERO,
            last_active: now,
            activity: 0,
            vetted: false,
            signalable: true,
            entitlement: String::new(),
            capped: String::new(),
            park_after: None,
            compute: None,
        };
        shared.policy().hello(1, peer);
        let victim = Victim { conn: 1, pid: child.0.id(), group: "g".into(), bytes: 1, why: "test".into() };
        shared.end(&mut shared.ending(now), &victim, "test", now);
        drop(shared.ending(now + grace));
        // The recording terminator sends nothing: the process "survives" SIGKILL.
        drop(shared.ending(now + grace + grace / 2));
        assert_eq!(
            sent.lock().unwrap().iter().map(|s| s.2).collect::<Vec<_>>(),
            [libc::SIGTERM, libc::SIGKILL]
        );
        drop(shared.ending(now + 2 * grace));
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let closed =
            runtime.block_on(async { tokio::time::timeout(Duration::from_secs(1), close.notified()).await });
        assert!(closed.is_ok(), "the connection is closed");
        assert_eq!(sent.lock().unwrap().len(), 2, "no more signals");
    }

    /// Kills and reaps a child when dropped.
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_connection_whose_process_is_gone_is_closed_not_signalled_by_pid() {
        let shared = Shared::with(&[], Options::default(), Box::new(Signals), None);
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pidfd = Pidfd::open(child.id()).expect("pidfd_open");
        child.wait().expect("reap");
        let close = handle(&shared, 1, Some(pidfd));
        shared.signal(1, child.id(), libc::SIGTERM);
        // The notification is stored: the connection's task would wake at once.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let closed =
            runtime.block_on(async { tokio::time::timeout(Duration::from_secs(1), close.notified()).await });
        assert!(closed.is_ok(), "the connection is closed");
    }

    /// Answers `Entitled`, counting the lookups and how many ran at once at most.
    #[derive(Default)]
    struct Slow {
        delay: Duration,
        running: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
        asked: std::sync::atomic::AtomicUsize,
    }

    impl crate::entitlement::Entitlements for Slow {
        fn lookup(&self, _who: &Identity) -> crate::entitlement::Verdict {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            self.asked.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            self.running.fetch_sub(1, Ordering::SeqCst);
            crate::entitlement::Verdict::NotEntitled { why: "slow".into() }
        }
    }

    fn entitled_shared(source: Arc<Slow>) -> Arc<Shared> {
        let source: Arc<dyn crate::entitlement::Entitlements> = source;
        Shared::entitled(&[], Options::default(), Box::new(Signals), None, Some(source))
    }

    fn me(conn: ConnId) -> Who {
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Who { conn, pid: std::process::id(), uid, gid }
    }

    #[test]
    fn with_a_source_a_connection_without_a_pidfd_is_not_entitled() {
        let source = Arc::new(Slow::default());
        let shared = entitled_shared(source.clone());
        handle(&shared, 1, None);
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let verdict = runtime.block_on(shared.verdict(me(1)));
        match verdict {
            crate::entitlement::Verdict::NotEntitled { why } => assert!(why.contains("cannot pin"), "{why}"),
            other => panic!("expected NotEntitled, got {other:?}"),
        }
        assert_eq!(source.asked.load(Ordering::SeqCst), 0, "the source is not even asked");
        // Without a source, everyone is unrestricted as before.
        let plain = Shared::with(&[], Options::default(), Box::new(Signals), None);
        handle(&plain, 1, None);
        assert_eq!(runtime.block_on(plain.verdict(me(1))), crate::entitlement::Verdict::Unrestricted);
    }

    #[test]
    fn a_process_that_cannot_be_pinned_is_believed_to_keep_nothing_in_host_ram() {
        let shared = Shared::with(&[], Options::default(), Box::new(Signals), None);
        handle(&shared, 1, None);
        assert_eq!(shared.host_memory_cap(1, std::process::id()), 0);
        handle(&shared, 2, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
        assert!(shared.host_memory_cap(2, std::process::id()) > 0, "its own VmRSS");
        assert_eq!(shared.host_memory_cap(3, std::process::id()), 0, "no such connection");
    }

    #[test]
    fn lookups_in_flight_are_bounded_per_uid_and_over_all() {
        let source = Arc::new(Slow { delay: Duration::from_millis(50), ..Slow::default() });
        let shared = entitled_shared(source.clone());
        let conns = 3 * MAX_LOOKUPS_PER_UID as u64;
        for conn in 1..=conns {
            handle(&shared, conn, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
        }
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let verdicts = runtime.block_on(async {
            let tasks: Vec<_> = (1..=conns)
                .map(|conn| {
                    let shared = shared.clone();
                    tokio::spawn(async move { shared.verdict(me(conn)).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        assert!(
            source.most.load(Ordering::SeqCst) <= MAX_LOOKUPS_PER_UID,
            "at most {MAX_LOOKUPS_PER_UID} at once"
        );
        // The first answer is cached for this process: the others waited, then used it.
        assert!(
            verdicts.iter().all(|v| matches!(v, crate::entitlement::Verdict::NotEntitled { .. })),
            "{verdicts:?}"
        );
        assert!(
            shared.uid_lookups.lock().unwrap().is_empty(),
            "nothing kept for UIDs with no lookup under way"
        );
    }

    #[test]
    fn a_lookup_past_the_timeout_is_unknown_and_not_cached() {
        let source = Arc::new(Slow { delay: LOOKUP_TIMEOUT + Duration::from_millis(300), ..Slow::default() });
        let shared = entitled_shared(source.clone());
        handle(&shared, 1, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let verdict = runtime.block_on(shared.verdict(me(1)));
        assert!(verdict.is_unknown(), "{verdict:?}");
        // The lookup finishes later with an answer (cached then, being one); a timeout alone
        // never is.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(source.asked.load(Ordering::SeqCst), 1);
        let cached =
            shared.verdicts.lock().unwrap().values().map(|(_, v)| v.is_unknown()).collect::<Vec<_>>();
        assert_eq!(cached, vec![false], "only the real answer is kept");
    }

    #[test]
    fn group_names_are_what_the_shim_allows() {
        for ok in ["a", "pod-a.web_1", "pid-1234", &"x".repeat(MAX_GROUP)] {
            assert_eq!(check_group(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a b", "a/b", "evil\x1b[31m", "line\nforged", "tab\t", "é", "\u{7f}", &"x".repeat(65)]
        {
            let err = check_group(bad).expect_err(bad);
            assert!(!err.contains('\x1b') && !err.contains('\n'), "the reason escapes the name: {err}");
        }
    }

    #[test]
    fn pods_are_namespace_slash_name_or_empty() {
        for ok in ["", "default/server-0", "ns:x/a.b_c", &format!("{}/{}", "a".repeat(253), "b".repeat(253))]
        {
            assert_eq!(check_pod(ok), Ok(()), "{ok}");
        }
        for bad in ["a b", "ns/\x1b]0;title\x07", "ns/name\r", &"a".repeat(MAX_POD + 1)] {
            let err = check_pod(bad).expect_err(bad);
            assert!(!err.contains('\x1b') && !err.contains('\r'), "{err}");
        }
    }

    #[test]
    fn connections_past_the_cap_make_room_or_are_refused() {
        let shared = Shared::with(
            &[],
            Options { max_connections_per_uid: 2, ..Options::default() },
            Box::new(Signals),
            None,
        );
        let who = |conn, uid| Who { conn, pid: 1, uid, gid: uid };
        let notify = || Arc::new(Notify::new());
        assert!(matches!(shared.admit(who(1, 7), notify()), Admission::Served));
        assert!(matches!(shared.admit(who(2, 7), notify()), Admission::Served));
        // Another UID has its own cap.
        assert!(matches!(shared.admit(who(3, 8), notify()), Admission::Served));
        // Conn 1 said Hello; conn 2 did not: it makes room.
        shared.identified(who(1, 7));
        assert!(matches!(shared.admit(who(4, 7), notify()), Admission::Evicting(2)));
        shared.leave(who(2, 7));
        shared.identified(who(4, 7));
        // Everything identified: refused.
        assert!(matches!(shared.admit(who(5, 7), notify()), Admission::Refused));
        shared.leave(who(1, 7));
        assert!(matches!(shared.admit(who(6, 7), notify()), Admission::Served));
        for (conn, uid) in [(4, 7), (6, 7), (3, 8)] {
            shared.leave(who(conn, uid));
        }
        assert!(shared.uids.lock().unwrap().is_empty(), "nothing kept for UIDs gone");
        assert!(!shared.evict_oldest());
    }
}
