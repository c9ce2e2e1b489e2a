//! Who is on a connection and what it may have: its credentials from the kernel, its
//! pidfd (taken at `Hello`), whether it is an admin, the host memory it can really hold,
//! and its entitlement verdict (looked up in a blocking task, bounded per UID and over
//! all, cached per process), applied to what it declared at `Hello`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::connection::Who;

use super::connection::Connection;
use super::Shared;
#[cfg(test)]
use crate::arbiter::policy::ConnId;
use crate::arbiter::policy::Policy;
use crate::entitlement::identity;
use crate::entitlement::{believe_hello, Entitlements, Identity, NoPolicy};

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

/// The entitlement source and what is kept of its answers.
pub(super) struct Lookups {
    /// Where entitlements come from (`NoPolicy`: none configured).
    entitlements: Arc<dyn Entitlements>,
    /// Whether a source is configured (else every client is unrestricted, asked nothing).
    entitled: bool,
    /// Verdicts by process (PID, start time), reused while its shim reconnects (never a
    /// failed lookup's).
    verdicts: Mutex<HashMap<(u32, u64), (Instant, crate::entitlement::Verdict)>>,
    /// Bounds the entitlement lookups running at once.
    slots: Arc<tokio::sync::Semaphore>,
    /// Bounds each UID's entitlement lookups running at once.
    per_uid: Mutex<HashMap<u32, Arc<tokio::sync::Semaphore>>>,
}

impl Lookups {
    /// Lookups in `entitlements` (`None`: no source, every client believed only about
    /// itself).
    pub(super) fn new(entitlements: Option<Arc<dyn Entitlements>>) -> Lookups {
        Lookups {
            entitled: entitlements.is_some(),
            entitlements: entitlements.unwrap_or_else(|| Arc::new(NoPolicy)),
            verdicts: Mutex::new(HashMap::new()),
            slots: Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS)),
            per_uid: Mutex::new(HashMap::new()),
        }
    }
}

impl Lookups {
    /// The semaphore bounding `uid`'s lookups in flight.
    pub(super) fn uid_lookups(&self, uid: u32) -> Arc<tokio::sync::Semaphore> {
        let mut map = self.per_uid.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(uid).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS_PER_UID))).clone()
    }

    /// Drops `uid`'s semaphore when nothing else uses it (`mine` is the caller's handle; a
    /// waiter, or a lookup still running past its timeout, holds another).
    pub(super) fn forget_uid_lookups(&self, uid: u32, mine: Arc<tokio::sync::Semaphore>) {
        let mut map = self.per_uid.lock().unwrap_or_else(|p| p.into_inner());
        let idle = mine.available_permits() == MAX_LOOKUPS_PER_UID;
        drop(mine);
        if idle && map.get(&uid).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(&uid);
        }
    }
}

/// Root, or a member of `--admin-group` (`admin_gid`): its primary group, or a
/// supplementary one as the kernel gives them for the socket (`SO_PEERGROUPS`, as they were
/// at connect).
pub(super) fn is_admin(admin_gid: Option<u32>, who: Who, socket: std::os::fd::BorrowedFd<'_>) -> bool {
    if who.uid == 0 {
        return true;
    }
    let Some(admin) = admin_gid else { return false };
    who.gid == admin || identity::peer_groups(socket).is_ok_and(|groups| groups.contains(&admin))
}

/// Takes the pidfd of the process that opened `who`'s connection (at `Hello`, not at
/// accept: a connection that never says who it is costs no second descriptor).
pub(super) fn take_pidfd(
    shared: &Shared,
    who: Who,
    socket: std::os::fd::BorrowedFd<'_>,
    cred: Option<&identity::Cred>,
) {
    let pin = || match cred {
        Some(cred) => identity::pidfd_of(socket, cred),
        None => Err("no credentials for the socket".into()),
    };
    let mut pidfd = pin();
    if pidfd.is_err() {
        // Out of descriptors (`pidfd_open` and `/proc/<pid>/stat` need one each), most
        // likely: give up the reserve, make room for later (the oldest connection that
        // has not said who it is) and try once more. Any other failure fails again.
        if shared.admissions.give_up_pin_reserve() {
            shared.admissions.evict_oldest();
            pidfd = pin();
            shared.admissions.refill_pin_reserve();
        }
    }
    let pidfd = match pidfd {
        Ok(fd) => Some(Arc::new(fd)),
        Err(why) => {
            if let Some(suppressed) = shared.logs.refusal_line(who.uid) {
                tracing::warn!(pid = who.pid, uid = who.uid, conn = who.conn, suppressed, "no pidfd for PID {} ({why}): this process will never be signalled, so it is lent no burst memory", who.pid);
            }
            None
        }
    };
    shared.pin(who.conn, pidfd);
}

/// The verdict on `who`: from the cache, else from the source in a blocking task
/// within [`LOOKUP_TIMEOUT`]; without a source, `Unrestricted` at once. With a source:
/// a connection without a pidfd is not entitled (what /proc says about its PID may be
/// another process's), and a lookup that fails or times out is
/// [`Verdict::Unknown`](crate::entitlement::Verdict::Unknown), never cached. At most
/// [`MAX_LOOKUPS`] lookups run at once ([`MAX_LOOKUPS_PER_UID`] per UID); the others
/// wait for their turn within the same timeout.
pub(super) async fn verdict(shared: &Arc<Shared>, who: Who) -> crate::entitlement::Verdict {
    use crate::entitlement::Verdict as V;
    if !shared.lookups.entitled {
        return V::Unrestricted;
    }
    let pidfd = shared.pidfd(who.conn);
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
    let per_uid = shared.lookups.uid_lookups(who.uid);
    let Ok(Ok(uid_permit)) = tokio::time::timeout_at(deadline, per_uid.clone().acquire_owned()).await else {
        shared.lookups.forget_uid_lookups(who.uid, per_uid);
        return late();
    };
    let global = tokio::time::timeout_at(deadline, shared.lookups.slots.clone().acquire_owned()).await;
    let Ok(Ok(permit)) = global else {
        drop(uid_permit);
        shared.lookups.forget_uid_lookups(who.uid, per_uid);
        return late();
    };
    let lookups = shared.lookups.clone();
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
            let cache = lookups.verdicts.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((_, v)) = cache.get(&key).filter(|(at, _)| at.elapsed() < VERDICT_TTL) {
                return v.clone();
            }
        }
        let identity = Identity { pid: who.pid, uid: who.uid, gid: who.gid, cgroup };
        let verdict = lookups.entitlements.lookup(&identity);
        // A failed lookup is no verdict: asked again next time.
        if let Some(key) = key.filter(|_| !verdict.is_unknown()) {
            let mut cache = lookups.verdicts.lock().unwrap_or_else(|p| p.into_inner());
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
    shared.lookups.forget_uid_lookups(who.uid, per_uid);
    verdict
}

/// What the arbiter believes of `c`'s `Hello` under its verdict (logged when capped).
pub(super) fn believe(shared: &Shared, c: &Connection) -> crate::entitlement::Believed {
    let (pid, uid) = (c.who.pid, c.who.uid);
    let verdict = c.verdict.as_ref().unwrap_or(&crate::entitlement::Verdict::Unrestricted);
    let (group, resolver, priority, compute) = match &c.hello {
        Some(d) => (d.group.as_str(), d.resolver, d.priority, d.compute),
        None => ("", gpufrac_common::Resolver::Wait, 0, None),
    };
    // The cgroup is not needed here: the verdict holds what it decided.
    let identity = Identity { pid, uid, gid: c.who.gid, cgroup: crate::entitlement::Cgroup::Host };
    let believed = believe_hello(
        verdict,
        shared.lookups.entitlements.as_ref(),
        &identity,
        group,
        resolver,
        priority,
        compute,
    );
    if !believed.capped.is_empty() {
        if let Some(suppressed) = shared.logs.refusal_line(uid) {
            tracing::warn!(pid, uid, suppressed, entitlement = %believed.entitlement, "the shim declared more than its entitlement: {}", believed.capped.join(", "));
        }
    }
    believed
}

/// A connection whose lookup failed ([`Verdict::Unknown`](crate::entitlement::Verdict::Unknown))
/// and that has registered no GPU yet is looked up again before its registration; an
/// answer now is applied to what it declared by [`believe_again`], under the registration's
/// lock.
pub(super) async fn look_up_again(shared: &Arc<Shared>, c: &mut Connection) {
    if c.registered || !c.verdict.as_ref().is_some_and(|v| v.is_unknown()) {
        return;
    }
    let verdict = verdict(shared, c.who).await;
    c.believe_again = !verdict.is_unknown();
    c.verdict = Some(verdict);
}

/// After [`look_up_again`] had an answer: it replaces what was believed of the
/// connection's `Hello` (its group, resolver, priority, compute share).
pub(super) fn believe_again(shared: &Shared, policy: &mut Policy, c: &mut Connection) {
    if !std::mem::take(&mut c.believe_again) {
        return;
    }
    let believed = believe(shared, c);
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::arbiter::server::{Options, Signals};
    use crate::entitlement::identity::Pidfd;

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
        let (uid, gid) = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
        Who { conn, pid: std::process::id(), uid, gid }
    }

    #[test]
    fn with_a_source_a_connection_without_a_pidfd_is_not_entitled() {
        let source = Arc::new(Slow::default());
        let shared = entitled_shared(source.clone());
        shared.connected(1, None);
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
        plain.connected(1, None);
        assert_eq!(runtime.block_on(plain.verdict(me(1))), crate::entitlement::Verdict::Unrestricted);
    }

    #[test]
    fn a_process_that_cannot_be_pinned_is_believed_to_keep_nothing_in_host_ram() {
        let shared = Shared::with(&[], Options::default(), Box::new(Signals), None);
        shared.connected(1, None);
        assert_eq!(shared.host_memory_cap(1, std::process::id()), 0);
        shared.connected(2, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
        assert!(shared.host_memory_cap(2, std::process::id()) > 0, "its own VmRSS");
        assert_eq!(shared.host_memory_cap(3, std::process::id()), 0, "no such connection");
    }

    #[test]
    fn lookups_in_flight_are_bounded_per_uid_and_over_all() {
        let source = Arc::new(Slow { delay: Duration::from_millis(50), ..Slow::default() });
        let shared = entitled_shared(source.clone());
        let conns = 3 * MAX_LOOKUPS_PER_UID as u64;
        for conn in 1..=conns {
            shared.connected(conn, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
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
            shared.lookups.per_uid.lock().unwrap().is_empty(),
            "nothing kept for UIDs with no lookup under way"
        );
    }

    #[test]
    fn a_lookup_past_the_timeout_is_unknown_and_not_cached() {
        let source = Arc::new(Slow { delay: LOOKUP_TIMEOUT + Duration::from_millis(300), ..Slow::default() });
        let shared = entitled_shared(source.clone());
        shared.connected(1, Some(Pidfd::open(std::process::id()).expect("pidfd_open")));
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let verdict = runtime.block_on(shared.verdict(me(1)));
        assert!(verdict.is_unknown(), "{verdict:?}");
        // The lookup finishes later with an answer (cached then, being one); a timeout alone
        // never is.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(source.asked.load(Ordering::SeqCst), 1);
        let cached =
            shared.lookups.verdicts.lock().unwrap().values().map(|(_, v)| v.is_unknown()).collect::<Vec<_>>();
        assert_eq!(cached, vec![false], "only the real answer is kept");
    }
}
