//! Ending processes: SIGTERM through the pidfd of the process that connected, SIGKILL a
//! `--kill-grace` later, and the connection closed if it outlives that; never a signal by
//! PID alone. The resolvers choose whom; this is how.

use std::collections::HashMap;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::{ConnHandle, Shared};
use crate::arbiter::metrics::Refusal;
use crate::arbiter::policy::{ConnId, Policy, Victim};
use crate::entitlement::identity::Pidfd;

/// The two signals processes are ended with, as the `i32` a pidfd is sent.
const SIGTERM: i32 = nix::sys::signal::Signal::SIGTERM as i32;
const SIGKILL: i32 = nix::sys::signal::Signal::SIGKILL as i32;

/// Ends processes chosen by the priority resolver and for guarantees. Behind a trait so
/// that tests can record instead of signalling.
pub trait Terminator: Send + Sync {
    /// Sends `signal` (`SIGTERM`, `SIGKILL`) to the process `pidfd` names
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

/// A process being ended.
pub(super) struct Ending {
    pub(super) pid: u32,
    /// When it was sent SIGTERM, or SIGKILL once `killed`.
    pub(super) since: Instant,
    pub(super) killed: bool,
}

/// Ends `victim`: SIGTERM now, SIGKILL after `--kill-grace` if it is still connected;
/// its memory comes back when its connection closes.
pub(super) fn end(
    shared: &Shared,
    ending: &mut HashMap<ConnId, Ending>,
    victim: &Victim,
    reason: &str,
    now: Instant,
) {
    shared.metrics.terminations.get_or_create(&Refusal { reason: reason.into() }).inc();
    signal(shared, victim.conn, victim.pid, SIGTERM);
    ending.insert(victim.conn, Ending { pid: victim.pid, since: now, killed: false });
}

/// Signals the process that opened `conn`, through its pidfd only. Without a pidfd
/// nothing is sent (such a process is never chosen; this is a second guard). If that
/// process is gone while its connection lives on (it forked and exited, leaving the
/// connection to a child), its PID may be anyone's now: nothing is signalled, and the
/// connection is closed, which releases what it held in the ledger (what the child
/// still uses, NVML then shows as memory outside gpufrac, never lent).
pub(super) fn signal(shared: &Shared, conn: ConnId, pid: u32, signal: i32) {
    let Some(ConnHandle { pidfd, close }) = shared.conn_handle(conn) else { return };
    let Some(pidfd) = pidfd else {
        tracing::warn!(
            pid,
            conn,
            "not signalling PID {pid}: the arbiter has no pidfd for it (a PID alone may be reused)"
        );
        return;
    };
    match shared.terminator.signal(pid, &pidfd, signal) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ESRCH as i32) => {
            tracing::warn!(pid, conn, "the process that connected as PID {pid} has exited but its connection is still open (held by a child?): not signalling PID {pid}, which may be reused; closing the connection");
            close.notify_one();
        }
        Err(e) => tracing::warn!(pid, conn, "cannot signal PID {pid} through its pidfd: {e}"),
    }
}

/// Connections being ended: those past the grace period get SIGKILL; those gone (no
/// longer in `policy`) are forgotten. Returns the ones still under way.
pub(super) fn ending<'a>(
    shared: &'a Shared,
    policy: &Policy,
    now: Instant,
) -> MutexGuard<'a, HashMap<ConnId, Ending>> {
    let mut ending = shared.ending.lock().unwrap_or_else(|p| p.into_inner());
    for (conn, e) in ending.iter_mut() {
        let overdue = now.saturating_duration_since(e.since) >= shared.options.kill_grace;
        if !overdue || policy.peer(*conn).is_none() {
            continue;
        }
        if !e.killed {
            tracing::warn!(pid = e.pid, "still running after --kill-grace: SIGKILL");
            signal(shared, *conn, e.pid, SIGKILL);
            (e.since, e.killed) = (now, true);
        } else if let Some(handle) = shared.conn_handle(*conn) {
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
    ending.retain(|conn, _| policy.peer(*conn).is_some());
    ending
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::arbiter::policy::Peer;
    use crate::arbiter::server::{Options, Signals};

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

    #[test]
    fn signals_go_through_the_pidfd_of_the_process_that_connected() {
        let record = Recording::default();
        let sent = record.0.clone();
        let shared = Shared::with(&[], Options::default(), Box::new(record), None);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        shared.connected(1, Some(Pidfd::open(child.id()).expect("pidfd_open")));
        shared.connected(2, None);
        // Whatever PID the caller names, the pidfd decides which process it is.
        shared.signal(1, 4242, SIGTERM);
        shared.signal(2, child.id(), SIGKILL);
        shared.signal(3, child.id(), SIGKILL);
        assert_eq!(*sent.lock().unwrap(), vec![(4242, Some(child.id()), SIGTERM)], "only through a pidfd");
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
        let close = shared.connected(1, Some(Pidfd::open(child.0.id()).expect("pidfd_open")));
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
        assert_eq!(sent.lock().unwrap().iter().map(|s| s.2).collect::<Vec<_>>(), [SIGTERM, SIGKILL]);
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
        let close = shared.connected(1, Some(pidfd));
        shared.signal(1, child.id(), SIGTERM);
        // The notification is stored: the connection's task would wake at once.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let closed =
            runtime.block_on(async { tokio::time::timeout(Duration::from_secs(1), close.notified()).await });
        assert!(closed.is_ok(), "the connection is closed");
    }
}
