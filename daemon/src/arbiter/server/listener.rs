//! The listener: accepts connections, counts each against its UID's cap (the oldest that
//! has not said who it is makes room), keeps a spare descriptor so that the CLI is still
//! served when descriptors run out, and starts the background tasks and one session per
//! connection.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::connection::Counted;
use super::{compute, processes, resolvers, session, Shared, Who};
use crate::arbiter::metrics::Refusal;
use crate::arbiter::policy::ConnId;
use crate::entitlement::identity;

/// One UID's open connections.
#[derive(Default)]
struct UidConns {
    pub(super) open: usize,
    /// Those that have not said `Hello` or `Status` yet, oldest first, with the way to
    /// close each.
    pub(super) pending: VecDeque<(ConnId, Arc<Notify>)>,
}

/// Whether a new connection is served.
pub(super) enum Admission {
    /// Under the cap.
    Served,
    /// At the cap: the oldest connection of its UID that has not said who it is is closed
    /// to make room.
    Evicting(ConnId),
    /// At the cap with every connection identified: closed at once.
    Refused,
}

/// What the listener keeps: open connections per UID, the pin reserve, the next
/// connection's number.
pub(super) struct Admissions {
    /// Open connections per UID.
    uids: Mutex<HashMap<u32, UidConns>>,
    /// Descriptors kept open to be given up when a process that said `Hello` cannot be
    /// pinned for lack of them (a crowd of idle connections took the rest): without its
    /// pidfd it would be lent nothing for its whole life. Refilled when it can be.
    pin_reserve: Mutex<Vec<std::fs::File>>,
    next_conn: AtomicU64,
}

impl Admissions {
    pub(super) fn new() -> Admissions {
        Admissions {
            uids: Mutex::new(HashMap::new()),
            pin_reserve: Mutex::new(pin_reserve()),
            next_conn: AtomicU64::new(1),
        }
    }
}

impl Admissions {
    /// Counts a new connection against its UID's cap (`max` open at once).
    pub(super) fn admit(&self, who: Who, evict: Arc<Notify>, max: usize) -> Admission {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        let entry = uids.entry(who.uid).or_default();
        let admission = if entry.open < max.max(1) {
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
    pub(super) fn identified(&self, who: Who) {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = uids.get_mut(&who.uid) {
            entry.pending.retain(|(conn, _)| *conn != who.conn);
        }
    }

    /// A connection closed.
    pub(super) fn leave(&self, who: Who) {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = uids.get_mut(&who.uid) {
            entry.pending.retain(|(conn, _)| *conn != who.conn);
            entry.open = entry.open.saturating_sub(1);
            if entry.open == 0 {
                uids.remove(&who.uid);
            }
        }
    }

    /// Gives the pin reserve up, so that a process can be pinned with its descriptors:
    /// whether there was one to give.
    pub(super) fn give_up_pin_reserve(&self) -> bool {
        let reserve = std::mem::take(&mut *self.pin_reserve.lock().unwrap_or_else(|p| p.into_inner()));
        !reserve.is_empty()
    }

    /// Opens the pin reserve again if it was given up (when descriptors allow).
    pub(super) fn refill_pin_reserve(&self) {
        let mut reserve = self.pin_reserve.lock().unwrap_or_else(|p| p.into_inner());
        if reserve.is_empty() {
            *reserve = pin_reserve();
        }
    }

    /// Closes the oldest connection, of any UID, that has not said who it is (out of
    /// descriptors). Returns whether there was one.
    pub(super) fn evict_oldest(&self) -> bool {
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
}

/// How long `serve`, stopping, waits for its connections to end (each ends after the
/// frame in hand and the answers already decided for it) before it drops those left.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

/// Serves shims and the CLI on `listener` until `shutdown` completes; then stops accepting
/// and the background tasks, tells every connection to end, and returns once they all
/// have, or after [`STOP_GRACE`] (the rest are dropped), so that the caller removes the
/// socket after the last answer.
pub async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    // Before the first burst: a restarted arbiter must not lend memory that shims not yet
    // back still hold.
    let observer = shared.clone();
    let _ = tokio::task::spawn_blocking(move || processes::observe_processes(&observer)).await;
    let watcher = tokio::spawn(processes::watch_processes(shared.clone()));
    let leases = tokio::spawn(compute::run_leases(shared.clone()));
    let ticker = tokio::spawn(resolvers::expire_waiters(shared.clone()));
    let mut sessions = JoinSet::new();
    let accept = async {
        // Kept open to be given up when descriptors run out, so that one more connection
        // (the CLI's) can still be accepted.
        let mut spare = spare_descriptor();
        let mut last_warning: Option<Instant> = None;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    // Sessions that ended are let go of here.
                    while sessions.try_join_next().is_some() {}
                    accepted(stream, &shared, &mut sessions);
                    if spare.is_none() {
                        spare = spare_descriptor();
                    }
                    shared.admissions.refill_pin_reserve();
                }
                Err(e) => {
                    let out_of_descriptors = matches!(
                        e.raw_os_error().map(nix::errno::Errno::from_raw),
                        Some(nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE)
                    );
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
                        let evicted = shared.admissions.evict_oldest();
                        if spare.take().is_some() {
                            if let Ok((stream, _)) = listener.accept().await {
                                accepted(stream, &shared, &mut sessions);
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
    // Nothing new: no connection, no decision.
    drop(listener);
    ticker.abort();
    watcher.abort();
    leases.abort();
    stop(&shared, sessions).await;
}

/// Tells every session to end and waits for them, at most [`STOP_GRACE`]; drops the rest.
async fn stop(shared: &Shared, mut sessions: JoinSet<()>) {
    shared.stopping.send_replace(true);
    let ended =
        tokio::time::timeout(STOP_GRACE, async { while sessions.join_next().await.is_some() {} }).await;
    if ended.is_err() {
        tracing::warn!(
            left = sessions.len(),
            "connections still open {STOP_GRACE:?} after the stop: dropped"
        );
        sessions.shutdown().await;
    }
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

/// Counts a new connection against its UID and serves it (a session in `sessions`), or
/// closes it at once.
pub(super) fn accepted(stream: UnixStream, shared: &Arc<Shared>, sessions: &mut JoinSet<()>) {
    // The peer's PID, UID and GID come from the kernel, never from a message; so does the
    // pidfd every signal to it goes through, taken at its `Hello`.
    let cred = identity::cred_of(stream.as_fd()).ok();
    let (pid, uid, gid) = cred.map_or((0, u32::MAX, u32::MAX), |c| (c.pid, c.uid, c.gid));
    let conn = shared.admissions.next_conn.fetch_add(1, Ordering::Relaxed);
    let who = Who { conn, pid, uid, gid };
    let evict = Arc::new(Notify::new());
    match shared.admissions.admit(who, evict.clone(), shared.options.max_connections_per_uid) {
        Admission::Served => {}
        Admission::Evicting(oldest) => {
            if let Some(suppressed) = shared.logs.refusal_line(uid) {
                tracing::warn!(pid, uid, conn, oldest, suppressed, "{} connections from this uid (--max-connections-per-uid): closing its oldest that has not said who it is", shared.options.max_connections_per_uid);
            }
        }
        Admission::Refused => {
            drop(stream);
            shared.metrics.refusals.get_or_create(&Refusal { reason: "connections-per-uid".into() }).inc();
            shared.logs.log_closing(
                who,
                &format!(
                    "{} connections from this uid already (--max-connections-per-uid)",
                    shared.options.max_connections_per_uid
                ),
            );
            return;
        }
    }
    let close = shared.open(conn);
    let counted = Counted { shared: shared.clone(), who };
    sessions.spawn(session::handle(stream, counted, evict, close, cred));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::server::{Options, Signals};

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
        assert!(shared.admissions.uids.lock().unwrap().is_empty(), "nothing kept for UIDs gone");
        assert!(!shared.evict_oldest());
    }

    #[test]
    fn stopping_ends_the_connections_then_returns_within_the_grace() {
        use gpufrac_common::protocol::{read_frame, Reply, Request, MAX_FRAME, VERSION};
        use std::io::{Read, Write};

        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arbiter.sock");
        let listener = {
            let _runtime = runtime.enter();
            UnixListener::bind(&path).unwrap()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = runtime.spawn(serve(listener, Shared::new(&[([7; 16], 1 << 30)]), async {
            let _ = stopped.await;
        }));
        // A shim that said Hello, connected when the arbiter stops.
        let mut shim = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let hello = Request::Hello {
            version: VERSION,
            group: "g".into(),
            pod: String::new(),
            resolver: gpufrac_common::Resolver::Wait,
            priority: 0,
            wait_timeout_ms: 1000,
            park_after_ms: 0,
            compute_request_pm: 0,
            compute_limit_pm: 0,
        };
        shim.write_all(&hello.encode()).unwrap();
        let welcome = Reply::decode(&read_frame(&mut shim, MAX_FRAME).unwrap()).unwrap();
        assert!(matches!(welcome, Reply::Welcome { .. }), "{welcome:?}");
        let asked = Instant::now();
        stop.send(()).unwrap();
        // Its connection is closed by the arbiter (not left to the runtime's end), and
        // `serve` returns once it is: well within the grace.
        shim.set_read_timeout(Some(STOP_GRACE + Duration::from_secs(1))).unwrap();
        let mut rest = Vec::new();
        assert_eq!(shim.read_to_end(&mut rest).unwrap(), 0, "closed, nothing more said");
        runtime
            .block_on(async { tokio::time::timeout(STOP_GRACE, server).await })
            .expect("serve returns within the grace")
            .unwrap();
        assert!(asked.elapsed() < STOP_GRACE, "{:?}", asked.elapsed());
    }
}
