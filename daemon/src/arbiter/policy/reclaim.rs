//! Taking loans back for the guarantees. A group is admitted while its request is lent
//! out (see `ledger`), and memory used outside gpufrac may grow: either way the GPU then
//! owes its guarantees memory that borrowers hold (the *debt*). It is taken back cheapest
//! first: holders give back grants they do not use (asked at once, believed for
//! [`GIVE_BACK_GRACE`]); holders whose resolver is swap move their burst memory to host
//! RAM (no quantum: a guarantee comes first); every other borrower gives back as it frees
//! (holders keep no slack while a debt is open), for up to the reclaim grace
//! (`--reclaim-grace`, [`DEFAULT_RECLAIM_GRACE`]); only what is still owed after it is
//! taken by ending holders, lowest priority first, then the one borrowing the most. Until
//! the debt is paid nothing is lent, so bursts never block a request, and the newcomer's
//! own allocations wait for their memory meanwhile. How each debt was paid (given back,
//! swapped, ended) is counted per GPU for status and metrics.

use std::time::{Duration, Instant};

use gpufrac_common::protocol::DeviceId;
use gpufrac_common::Resolver;

use super::{gib, ConnId, Policy, Residency, SwapVictim, Victim};

/// How long holders have to give back grants they do not use before the debt is taken
/// from memory in use (their answer takes milliseconds; what they use is known only as
/// last reported, so it is not trusted longer).
pub const GIVE_BACK_GRACE: Duration = Duration::from_millis(500);

/// How long borrowers have to give back what a guarantee is owed, as they free, before
/// holders are ended for it (`--reclaim-grace`): servers free memory every few hundred
/// milliseconds to seconds; ending one that would have given back loses its work.
pub const DEFAULT_RECLAIM_GRACE: Duration = Duration::from_secs(5);

/// What to do now so that the guarantees get the memory they are owed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reclaim {
    /// Holders to ask to give back what they do not use (`Reclaim`), once per debt.
    pub give_back: Vec<(ConnId, DeviceId)>,
    /// Holders to swap out (marked as swapping out).
    pub swap_out: Vec<SwapVictim>,
    /// Holders to end.
    pub end: Vec<Victim>,
}

impl Reclaim {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.give_back.is_empty() && self.swap_out.is_empty() && self.end.is_empty()
    }
}

impl Policy {
    /// Plans how each GPU that owes its guarantees memory gets it back. `ending` are being
    /// ended already (their memory is on its way back); swap-outs are under `swap_limit`
    /// bytes of host RAM in all.
    pub fn reclaim(&mut self, now: Instant, ending: &[ConnId], swap_limit: u64) -> Reclaim {
        let mut plan = Reclaim::default();
        let mut host = self.host_committed();
        let mut swaps: Vec<(DeviceId, ConnId)> = Vec::new();
        for (&device, gpu) in self.gpus.iter_mut() {
            let short = gpu.shortfall();
            if short == 0 {
                (gpu.short_since, gpu.short_last) = (None, 0);
                continue;
            }
            // A debt that grew is a new guarantee's: it gets its own ask and grace.
            if short > gpu.short_last {
                gpu.short_since = None;
            }
            gpu.short_last = short;
            let since = *gpu.short_since.get_or_insert_with(|| {
                plan.give_back.extend(gpu.groups.values().flat_map(|g| {
                    g.members.iter().filter(|(_, m)| m.granted > 0).map(|(&c, _)| (c, device))
                }));
                now
            });
            // Just after a restart memory outside gpufrac is likely shims coming back with
            // what they hold: nothing is owed yet.
            if gpu.outside() > 0 && now < gpu.reconnecting_until {
                continue;
            }
            let on_its_way = |conn: ConnId, residency: Residency| {
                ending.contains(&conn) || residency == Residency::SwappingOut
            };
            let coming: u64 = gpu
                .members()
                .filter(|&(_, c, m)| on_its_way(c, m.residency))
                .map(|(_, _, m)| m.granted)
                .sum();
            let unused: u64 = if now.saturating_duration_since(since) < GIVE_BACK_GRACE {
                gpu.groups
                    .values()
                    .filter(|g| !g.members.iter().any(|(&c, m)| on_its_way(c, m.residency)))
                    .map(|g| g.unused())
                    .sum()
            } else {
                0
            };
            let mut owed = short as i128 - coming as i128 - unused as i128;
            if owed <= 0 {
                continue;
            }
            let in_grace = now.saturating_duration_since(since) < self.reclaim_grace;
            // Swap first: nothing is lost. Idle holders, then the largest.
            let mut swappable: Vec<(bool, std::cmp::Reverse<u64>, ConnId)> = gpu
                .members()
                .filter(|&(_, c, m)| {
                    m.granted > 0
                        && m.residency == Residency::Resident
                        && !ending.contains(&c)
                        && gpu.waiter(c).is_none()
                        && self.peers.get(&c).is_some_and(|p| p.resolver == Resolver::Swap)
                })
                .map(|(_, c, m)| {
                    let idle = self.peers.get(&c).is_some_and(|p| {
                        now.saturating_duration_since(p.last_active) >= super::swap::IDLE_FOR_SWAP
                    });
                    (!idle, std::cmp::Reverse(m.granted), c)
                })
                .collect();
            swappable.sort();
            let mut swapped_now = Vec::new();
            for (_, std::cmp::Reverse(bytes), conn) in swappable {
                if owed <= 0 {
                    break;
                }
                if host.saturating_add(bytes) > swap_limit {
                    continue;
                }
                host += bytes;
                owed -= bytes as i128;
                swapped_now.push(conn);
                swaps.push((device, conn));
            }
            // Within the grace the other borrowers give back as they free.
            if owed <= 0 || in_grace {
                continue;
            }
            // Then end holders: lowest priority first, then the one borrowing the most.
            let mut endable: Vec<(i32, std::cmp::Reverse<u64>, ConnId)> = gpu
                .members()
                .filter(|&(_, c, m)| {
                    m.granted > 0 && !on_its_way(c, m.residency) && !swapped_now.contains(&c)
                })
                .filter_map(|(_, c, m)| {
                    // Never a process the arbiter cannot signal safely (no pidfd).
                    let p = self.peers.get(&c).filter(|p| p.signalable)?;
                    Some((p.priority, std::cmp::Reverse(m.granted), c))
                })
                .collect();
            endable.sort();
            for (priority, std::cmp::Reverse(bytes), conn) in endable {
                if owed <= 0 {
                    break;
                }
                let Some(peer) = self.peers.get(&conn) else { continue };
                // What ending it pays of this debt (the rest of its loan is freed too).
                let paid = (bytes as i128).min(owed) as u64;
                owed -= bytes as i128;
                gpu.repaid.ended = gpu.repaid.ended.saturating_add(paid);
                if let Some(m) = gpu.groups.values_mut().find_map(|g| g.members.get_mut(&conn)) {
                    m.ended_for_debt = true;
                }
                plan.end.push(Victim {
                    conn,
                    pid: peer.pid,
                    group: peer.group.clone(),
                    bytes,
                    why: format!(
                        "a guarantee needs its burst memory back (priority {priority}, borrowing {})",
                        gib(bytes)
                    ),
                });
            }
        }
        plan.swap_out = swaps
            .into_iter()
            .filter_map(|(device, conn)| {
                let victim = self.start_swap_out(device, conn, now)?;
                // What its answer moves to host RAM is counted as this debt's (see `swapped`).
                if let Some(m) = self.gpus.get_mut(&device).and_then(|g| g.member_mut(&victim.group, conn)) {
                    m.swapping_for_debt = true;
                }
                Some(victim)
            })
            .collect();
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::{DEFAULT_RECLAIM_GRACE, GIVE_BACK_GRACE};

    /// An 8 GiB GPU: `holders` (conn, resolver, priority, bytes borrowed and in use), each
    /// with a request of 0.5 GiB and a limit of 3.5 GiB.
    fn lent_out(holders: &[(ConnId, Resolver, i32, u64)]) -> Policy {
        let now = Instant::now();
        let mut p = Policy::new(&[(GPU, 8 * GIB)]);
        for &(conn, resolver, priority, borrowed) in holders {
            p.hello(conn, Peer { resolver, priority, ..peer(&format!("g{conn}"), 60_000) });
            p.register(conn, GPU, 8 * GIB, GIB / 2, 7 * GIB / 2, 0, 0, 0).unwrap();
            assert!(matches!(
                p.acquire(conn, GPU, 1, borrowed, borrowed, GIB / 2 + borrowed, false, now),
                Outcome::Granted(_)
            ));
        }
        p
    }

    #[test]
    fn nothing_is_done_while_nothing_is_owed() {
        let mut p = lent_out(&[(1, Resolver::Wait, 0, 3 * GIB)]);
        assert!(p.reclaim(Instant::now(), &[], u64::MAX).is_empty());
    }

    #[test]
    fn a_new_guarantee_takes_loans_back_cheapest_first() {
        let now = Instant::now();
        // 8 GiB: two swap holders (2 and 1 GiB in use), two wait holders of priority 5 and
        // 0 (2 GiB each): 1 GiB of requests, 7 lent; then a 4 GiB request arrives.
        let mut p = Policy::new(&[(GPU, 8 * GIB)]);
        for (conn, resolver, priority) in
            [(1, Resolver::Swap, 0), (2, Resolver::Swap, 0), (3, Resolver::Wait, 5), (4, Resolver::Wait, 0)]
        {
            p.hello(conn, Peer { resolver, priority, ..peer(&format!("g{conn}"), 60_000) });
            p.register(conn, GPU, 8 * GIB, GIB / 4, 9 * GIB / 4, 0, 0, 0).unwrap();
        }
        for (conn, bytes) in [(1, 2 * GIB), (2, GIB), (3, 2 * GIB), (4, 2 * GIB)] {
            // Each uses all it borrowed, one after another.
            let at = now - Duration::from_secs(60 - 10 * conn);
            assert_eq!(
                p.acquire(conn, GPU, 1, bytes, bytes, GIB / 4 + bytes, false, at),
                Outcome::Granted(bytes)
            );
        }
        assert_eq!(p.status().gpus[0].free, 0);
        p.hello(9, peer("guaranteed", 60_000));
        p.register(9, GPU, 8 * GIB, 4 * GIB, 4 * GIB, 0, 0, 0).expect("1 + 4 GiB of requests fit 8 GiB");
        assert_eq!(p.status().gpus[0].reclaiming, 4 * GIB);
        // Nothing is lent while the guarantee is owed memory.
        p.hello(10, peer("late", 60_000));
        p.register(10, GPU, 8 * GIB, GIB / 2, GIB, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(10, GPU, 1, 64 << 20, 64 << 20, 0, false, now), Outcome::Queued);
        // Everyone is asked to give back unused grants; nobody has any: both swap holders
        // go to host RAM (3 GiB); the wait holders have the reclaim grace to give back.
        let plan = p.reclaim(now, &[], u64::MAX);
        assert_eq!(plan.give_back.len(), 4, "{plan:?}");
        let mut swapped: Vec<_> = plan.swap_out.iter().map(|v| (v.conn, v.bytes)).collect();
        swapped.sort();
        assert_eq!(swapped, vec![(1, 2 * GIB), (2, GIB)]);
        assert!(plan.end.is_empty(), "nobody is ended within the grace: {plan:?}");
        assert!(p.reclaim(now + DEFAULT_RECLAIM_GRACE / 2, &[], u64::MAX).is_empty());
        // Still owed after the grace: the lowest priority wait holder is ended.
        let plan = p.reclaim(now + DEFAULT_RECLAIM_GRACE, &[], u64::MAX);
        assert_eq!(plan.end.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![4], "{plan:?}");
        assert!(plan.end[0].why.contains("guarantee"));
        // Under way: asked again, nothing more is done.
        assert!(p.reclaim(now + DEFAULT_RECLAIM_GRACE, &[4], u64::MAX).is_empty());
        // The swap-outs are answered and 4 exits: the debt is paid, the late burst is served.
        p.swapped(1, GPU, 0, 2 * GIB, GIB / 4, now);
        p.swapped(2, GPU, 0, GIB, GIB / 4, now);
        let answers = p.disconnect(4, now);
        let s = &p.status().gpus[0];
        assert_eq!(s.reclaiming, 0);
        // The debt, 4.5 GiB, paid once: 3 GiB swapped out, 1.5 GiB of the loan of the one ended.
        assert_eq!((s.repaid_given_back, s.repaid_swapped, s.repaid_ended), (0, 3 * GIB, 3 * GIB / 2));
        assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(10, Ok(64 << 20))]);
    }

    #[test]
    fn unused_grants_are_given_back_before_anyone_is_swapped_or_ended() {
        let now = Instant::now();
        // 3 GiB lent, of which 1 GiB is in use.
        let mut p = lent_out(&[(1, Resolver::Swap, 0, 3 * GIB)]);
        p.release(1, GPU, 0, GIB / 2 + GIB, now);
        p.hello(2, peer("new", 60_000));
        p.register(2, GPU, 8 * GIB, 5 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        // 8 - 5.5 requests = 2.5 to lend, 3 lent: 0.5 GiB owed, 2 GiB unused.
        let plan = p.reclaim(now, &[], u64::MAX);
        assert_eq!(plan.give_back, vec![(1, GPU)]);
        assert!(plan.swap_out.is_empty() && plan.end.is_empty(), "{plan:?}");
        // Not given back within the grace (the report was stale): swapped out after all.
        let plan = p.reclaim(now + GIVE_BACK_GRACE, &[], u64::MAX);
        assert_eq!(plan.swap_out.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn a_swap_over_the_host_ram_cap_is_not_made_the_holder_is_ended_instead() {
        let now = Instant::now();
        let mut p = lent_out(&[(1, Resolver::Swap, 0, 3 * GIB)]);
        p.hello(2, peer("new", 60_000));
        p.register(2, GPU, 8 * GIB, 5 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        let plan = p.reclaim(now, &[], GIB);
        assert!(plan.swap_out.is_empty() && plan.end.is_empty(), "{plan:?}");
        let plan = p.reclaim(now + DEFAULT_RECLAIM_GRACE, &[], GIB);
        assert!(plan.swap_out.is_empty());
        assert_eq!(plan.end.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn borrowers_that_give_back_as_they_free_within_the_grace_are_not_ended() {
        let now = Instant::now();
        // Two wait borrowers of 3 GiB each, all in use; a 5 GiB guarantee arrives: 8 - 6
        // requests = 2 GiB to lend, 6 lent, 4 owed.
        let mut p = lent_out(&[(1, Resolver::Wait, 0, 3 * GIB), (2, Resolver::Wait, 0, 3 * GIB)]);
        p.hello(3, peer("new", 60_000));
        p.register(3, GPU, 8 * GIB, 5 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        assert_eq!(p.status().gpus[0].reclaiming, 4 * GIB);
        assert!(p.reclaim(now, &[], u64::MAX).end.is_empty());
        // They free as their bursts end, in pieces, within the grace.
        let later = now + DEFAULT_RECLAIM_GRACE / 2;
        p.release(1, GPU, 2 * GIB, GIB / 2 + GIB, later);
        assert!(p.reclaim(later, &[], u64::MAX).is_empty());
        p.release(2, GPU, 3 * GIB, GIB / 2, later);
        let s = &p.status().gpus[0];
        assert_eq!((s.reclaiming, s.repaid_given_back, s.repaid_ended), (0, 4 * GIB, 0));
        // Paid: after the grace nobody is ended.
        assert!(p.reclaim(now + 2 * DEFAULT_RECLAIM_GRACE, &[], u64::MAX).is_empty());
    }

    #[test]
    fn only_what_is_still_owed_after_the_grace_is_taken_by_ending() {
        let now = Instant::now();
        let mut p = lent_out(&[(1, Resolver::Wait, 0, 3 * GIB), (2, Resolver::Wait, 5, GIB)]);
        p.hello(3, peer("new", 60_000));
        p.register(3, GPU, 8 * GIB, 5 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        // 2 GiB owed; 1 gives back 1 GiB within the grace, 1 GiB is still owed after it.
        assert!(p.reclaim(now, &[], u64::MAX).end.is_empty());
        p.release(1, GPU, GIB, GIB / 2 + 2 * GIB, now);
        assert_eq!(p.status().gpus[0].reclaiming, GIB);
        let plan = p.reclaim(now + DEFAULT_RECLAIM_GRACE, &[], u64::MAX);
        // The lowest priority holder, which borrows enough, is the one ended.
        assert_eq!(plan.end.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1], "{plan:?}");
        let s = &p.status().gpus[0];
        assert_eq!((s.repaid_given_back, s.repaid_ended), (GIB, GIB), "the 2 GiB debt paid once");
        // What it frees while being ended is not counted again, nor is its exit.
        p.release(1, GPU, GIB, GIB / 2 + GIB, now + DEFAULT_RECLAIM_GRACE);
        p.disconnect(1, now + DEFAULT_RECLAIM_GRACE);
        let s = &p.status().gpus[0];
        assert_eq!((s.repaid_given_back, s.repaid_ended), (GIB, GIB));
    }

    #[test]
    fn a_debt_that_grows_is_a_new_guarantees_with_a_grace_of_its_own() {
        let now = Instant::now();
        let mut p = lent_out(&[(1, Resolver::Wait, 0, 3 * GIB), (2, Resolver::Wait, 0, 3 * GIB)]);
        p.hello(3, peer("first", 60_000));
        p.register(3, GPU, 8 * GIB, 5 * GIB / 2, 5 * GIB / 2, 0, 0, 0).unwrap();
        assert!(p.reclaim(now, &[], u64::MAX).end.is_empty());
        // Just before the first grace ends a second guarantee arrives: asked afresh, and
        // nobody is ended for it until its own grace is over.
        let later = now + DEFAULT_RECLAIM_GRACE - Duration::from_millis(100);
        p.hello(4, peer("second", 60_000));
        p.register(4, GPU, 8 * GIB, GIB, GIB, 0, 0, 0).unwrap();
        let plan = p.reclaim(later, &[], u64::MAX);
        assert_eq!(plan.give_back.len(), 2, "{plan:?}");
        assert!(p.reclaim(now + DEFAULT_RECLAIM_GRACE, &[], u64::MAX).end.is_empty());
        assert!(!p.reclaim(later + DEFAULT_RECLAIM_GRACE, &[], u64::MAX).end.is_empty());
    }

    #[test]
    fn a_swap_out_for_a_debt_counts_what_it_moved_once() {
        let now = Instant::now();
        let mut p = lent_out(&[(1, Resolver::Swap, 0, 3 * GIB)]);
        p.hello(2, peer("new", 60_000));
        p.register(2, GPU, 8 * GIB, 5 * GIB, 5 * GIB, 0, 0, 0).unwrap();
        // 8 - 5.5 requests = 2.5 to lend, 3 lent: 0.5 GiB owed.
        let plan = p.reclaim(now + GIVE_BACK_GRACE, &[], u64::MAX);
        assert_eq!(plan.swap_out.len(), 1, "{plan:?}");
        // A release crossing the swap-out is not counted as given back.
        p.release(1, GPU, GIB / 4, GIB / 2 + 3 * GIB - GIB / 4, now);
        assert_eq!(p.status().gpus[0].repaid_given_back, 0);
        p.swapped(1, GPU, 0, 3 * GIB - GIB / 4, GIB / 2, now);
        let s = &p.status().gpus[0];
        assert_eq!((s.repaid_given_back, s.repaid_swapped, s.reclaiming), (0, GIB / 4, 0), "{s:?}");
    }
}
