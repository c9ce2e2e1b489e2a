//! The priority resolver: a waiting burst whose group uses it may end holders of burst
//! memory of lower priority, or of equal priority and idle, as few as make it fit; never
//! one of higher priority. Ending them is the server's work (SIGTERM, then SIGKILL, through
//! a pidfd); their memory comes back when their connection closes. Nobody is ended for a
//! burst until it has waited [`GIVE_BACK_FIRST`]: the holders were asked at once to give
//! back what they keep unused (a framework's pool, emptied by the shim), which usually
//! serves it without ending anyone. A requester whose
//! priority no entitlement vouches for ends only its own user's processes (the burst waits
//! instead), and a process without a pidfd is never chosen.

use std::time::{Duration, Instant};

use gpufrac_common::Resolver;

use super::{ConnId, Policy, Victim};

/// How long a priority burst waits for the holders' give-back before it ends any of them
/// (emptying a framework's pool of a few GiB takes a few hundred ms).
pub const GIVE_BACK_FIRST: Duration = Duration::from_millis(500);

impl Policy {
    /// For each waiting burst whose group uses the priority resolver and cannot be served:
    /// the fewest holders of burst memory on that GPU, each of lower priority or idle
    /// longer than `idle_timeout` (and never of higher priority), without whose grants it
    /// could be.
    /// Bursts that no such set can serve are left to wait. `spared` are already being ended.
    pub fn priority_victims(&self, now: Instant, idle_timeout: Duration, spared: &[ConnId]) -> Vec<Victim> {
        let mut chosen: Vec<Victim> = Vec::new();
        for gpu in self.gpus.values() {
            for w in gpu.queue.iter().filter(|w| !gpu.held_back(w)) {
                if now.saturating_duration_since(w.since) < GIVE_BACK_FIRST {
                    continue;
                }
                let Some(asker) = self.peers.get(&w.conn).filter(|p| p.resolver == Resolver::Priority) else {
                    continue;
                };
                let mut candidates: Vec<Victim> = gpu
                    .members()
                    .filter(|&(_, c, m)| m.granted > 0 && c != w.conn && !spared.contains(&c))
                    .filter_map(|(_, c, m)| {
                        let p = self.peers.get(&c)?;
                        // Only a process the arbiter can signal safely (a pidfd), and of
                        // another user only for a priority an entitlement vouches for:
                        // without one, a client is believed only about itself.
                        if !p.signalable || (p.uid != asker.uid && !asker.vetted) {
                            return None;
                        }
                        let idle = now.saturating_duration_since(p.last_active);
                        let why = if p.priority < asker.priority {
                            format!("lower priority ({} < {})", p.priority, asker.priority)
                        } else if p.priority == asker.priority && idle > idle_timeout {
                            format!("idle for {}s", idle.as_secs())
                        } else {
                            return None;
                        };
                        Some(Victim { conn: c, pid: p.pid, group: p.group.clone(), bytes: m.granted, why })
                    })
                    .collect();
                // Fewest victims: the largest holders first.
                candidates.sort_by_key(|c| std::cmp::Reverse(c.bytes));
                if gpu.left_to_queue(w, now) {
                    continue;
                }
                let mut set: Vec<Victim> = Vec::new();
                let mut served = false;
                for c in candidates {
                    set.push(c);
                    let conns: Vec<ConnId> = set.iter().map(|v| v.conn).collect();
                    if gpu.servable_without(&conns, w, now) {
                        served = true;
                        break;
                    }
                }
                if served {
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
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::GIVE_BACK_FIRST;

    #[test]
    fn priority_ends_the_fewest_lower_priority_or_idle_holders_never_higher() {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 16 * GIB)]);
        let t0 = now - Duration::from_secs(600);
        for (conn, group, prio, active) in
            [(1, "low", 0, now), (2, "high", 20, t0), (3, "idle", 10, t0), (4, "small", 0, now)]
        {
            p.hello(conn, Peer { priority: prio, last_active: active, ..peer(group, 60_000) });
            p.register(conn, GPU, 16 * GIB, 2 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        }
        p.hello(5, Peer { priority: 10, resolver: Resolver::Priority, ..peer("vip", 60_000) });
        p.register(5, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0, 0).unwrap();
        // 16 - 9 guaranteed = 7 GiB to lend: low 3, high 2, idle 1, small 1, borrowed a
        // while ago and kept.
        for (conn, gib) in [(1, 3), (2, 2), (3, 1), (4, 1)] {
            let before = now - Duration::from_secs(60 - 10 * conn);
            let outcome = p.acquire(conn, GPU, 1, gib * GIB, gib * GIB, 0, false, before);
            assert_eq!(outcome, Outcome::Granted(gib * GIB), "holder {conn}");
        }
        assert_eq!(p.acquire(5, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Queued);
        // Not before the holders had their chance to give back what they keep unused.
        assert!(p.priority_victims(now + GIVE_BACK_FIRST / 2, Duration::from_secs(300), &[]).is_empty());
        let now = now + GIVE_BACK_FIRST;
        let v = p.priority_victims(now, Duration::from_secs(300), &[]);
        assert_eq!(v.len(), 1, "one holder of 3 GiB is enough: {v:?}");
        assert_eq!((v[0].conn, v[0].bytes), (1, 3 * GIB));
        assert!(v[0].why.contains("lower priority"));
        // Sparing it, idle 1 + small 1 = 2 GiB cannot make 3 GiB fit: wait instead.
        let v = p.priority_victims(now, Duration::from_secs(300), &[1]);
        assert!(!v.iter().any(|v| v.conn == 2), "a higher-priority holder is never ended: {v:?}");
        assert!(v.is_empty(), "got {v:?}");
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
        let later = now + GIVE_BACK_FIRST;
        assert!(p.priority_victims(later, Duration::from_secs(300), &[]).is_empty());
        p.peers.get_mut(&2).unwrap().resolver = Resolver::Swap;
        assert!(p.swap_victims(now + Duration::from_secs(60), Duration::ZERO, u64::MAX).is_empty());
        // With the outsider at 4 GiB, low's 3 GiB make 2 GiB fit (16 - 15 + 3 = 4).
        p.observe_processes(GPU, &[(200, 4 * GIB)], now);
        p.peers.get_mut(&2).unwrap().resolver = Resolver::Priority;
        let v = p.priority_victims(later, Duration::from_secs(300), &[]);
        assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1]);
    }
}
