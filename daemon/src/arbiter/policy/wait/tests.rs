//! The queue's rules, each on its own small GPU.

use super::super::testing::*;
use super::super::*;
use super::{GROWING_FOR, MAX_WAIT};

#[test]
fn a_process_that_cannot_be_signalled_is_lent_nothing() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    // A raw client without a pidfd (its process exited before the arbiter could pin
    // it, or an old kernel), in a group with a guarantee and room to burst.
    p.hello(1, Peer { signalable: false, ..peer("a", 1000) });
    // It comes back claiming a loan and swapped-out memory: neither is believed.
    p.register(1, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 6 * GIB, 2 * GIB).unwrap();
    let s = &p.status().gpus[0];
    assert_eq!((s.guaranteed, s.burst, s.swapped), (4 * GIB, 0, 0), "{s:?}");
    // A burst is refused at once: no resolver could ever take it back.
    assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, false, now), Outcome::Denied(Denial::OverLimit));
    assert_eq!(p.acquire(1, GPU, 2, GIB, GIB, 0, true, now), Outcome::Denied(Denial::OverLimit));
    assert_eq!(p.status().gpus[0].waiting, 0, "nothing queued");
    // Nor does a report of swapped-out memory put any in the ledger.
    p.swapped(1, GPU, 0, 3 * GIB, 0, now);
    assert_eq!(p.status().gpus[0].swapped, 0);
    // An unknown device is still answered as such.
    assert_eq!(p.acquire(1, [9; 16], 3, GIB, GIB, 0, false, now), Outcome::Denied(Denial::UnknownDevice));
    // A member of the same group that can be signalled still bursts.
    p.hello(2, peer("a", 1000));
    p.register(2, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now), Outcome::Granted(GIB));
}

#[test]
fn bursts_wait_in_order_and_are_granted_as_memory_comes_back() {
    let now = Instant::now();
    let mut p =
        policy_with(&[(1, "a", 4 * GIB, 8 * GIB), (2, "b", 4 * GIB, 6 * GIB), (3, "c", 4 * GIB, 5 * GIB)]);
    // 4 GiB unreserved.
    assert_eq!(p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Granted(3 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
    assert_eq!(
        p.acquire(3, GPU, 1, GIB / 2, GIB / 2, 0, false, now),
        Outcome::Queued,
        "no bypassing the head"
    );
    assert_eq!(p.status().gpus[0].processes.iter().filter(|s| s.state == "waiting").count(), 2);
    let answers = p.release(1, GPU, 3 * GIB, 0, now + Duration::from_millis(5));
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
    assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Denied(Denial::OverLimit));
    assert_eq!(
        p.acquire(1, GPU, 2, GIB / 2, 4 * GIB, 0, false, now),
        Outcome::Granted(GIB),
        "a chunk, capped by the limit"
    );
    assert_eq!(p.acquire(1, GPU, 3, 1, 1, 0, false, now), Outcome::Denied(Denial::OverLimit));
}

#[test]
fn waiters_time_out_and_unblock_the_queue() {
    let now = Instant::now();
    let mut p = policy_with(&[(1, "a", 4 * GIB, 12 * GIB), (2, "b", 4 * GIB, 16 * GIB)]);
    assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
    p.hello(2, Peer { wait_timeout: Duration::from_millis(10), ..peer("b", 10) });
    assert_eq!(p.acquire(2, GPU, 7, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.expire(now + Duration::from_millis(5)).is_empty());
    let answers = p.expire(now + Duration::from_millis(11));
    assert_eq!(answers.len(), 1);
    assert_eq!((answers[0].conn, answers[0].seq, answers[0].result), (2, 7, Err(Denial::Timeout)));
}

#[test]
fn partial_bursts_never_deadlock_they_are_served_one_after_another() {
    let now = Instant::now();
    // 8 servers: request 1 GiB, limit 4 GiB, 8 GiB to lend; each bursts by 3 GiB in
    // 64 MiB steps, asking a 768 MiB chunk at a time, all at once.
    let servers: Vec<(ConnId, String)> = (1..=8).map(|c| (c, format!("s{c}"))).collect();
    let groups: Vec<(ConnId, &str, u64, u64)> =
        servers.iter().map(|(c, g)| (*c, g.as_str(), GIB, 4 * GIB)).collect();
    let mut p = policy_with(&groups);
    p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
    let chunk = 768 << 20;
    let step = 64 << 20;
    // Holdings per server; each asks until it has 3 GiB, then frees everything.
    let mut granted = [0u64; 9];
    let mut waiting = [false; 9];
    let mut done = 0;
    let mut seq = 0;
    let mut t = now;
    for _round in 0..10_000 {
        t += Duration::from_millis(1);
        let mut progressed = false;
        for conn in 1..=8u64 {
            let c = conn as usize;
            if waiting[c] || granted[c] >= 3 * GIB {
                continue;
            }
            seq += 1;
            let need = step.min(3 * GIB - granted[c]);
            match p.acquire(conn, GPU, seq, need, chunk.max(need), 0, false, t) {
                Outcome::Granted(g) => granted[c] += g,
                Outcome::Queued => {
                    waiting[c] = true;
                    for a in p.settle(GPU, t) {
                        assert!(a.result.is_ok(), "nobody is refused: {a:?}");
                        granted[a.conn as usize] += a.result.unwrap();
                        waiting[a.conn as usize] = false;
                    }
                }
                Outcome::Denied(d) => panic!("denied {d:?}"),
            }
            progressed = true;
        }
        // Whoever has its whole burst uses it and frees it.
        for conn in 1..=8u64 {
            let c = conn as usize;
            if granted[c] >= 3 * GIB {
                let back = granted[c];
                granted[c] = 0;
                done += 1;
                for a in p.release(conn, GPU, back, GIB, t) {
                    assert!(a.result.is_ok(), "nobody is refused: {a:?}");
                    granted[a.conn as usize] += a.result.unwrap();
                    waiting[a.conn as usize] = false;
                }
                progressed = true;
            }
        }
        if done >= 24 {
            break;
        }
        assert!(progressed, "stuck: every server waits");
        assert!(p.status().gpus[0].burst <= 8 * GIB);
    }
    assert!(done >= 24, "every server finished its bursts, {done} done");
    assert!(p.expire(t + Duration::from_secs(1)).is_empty(), "nobody timed out");
}

#[test]
fn a_group_that_borrows_goes_ahead_of_a_head_that_cannot_be_served() {
    let now = Instant::now();
    let mut p =
        policy_with(&[(1, "a", 2 * GIB, 10 * GIB), (2, "b", 2 * GIB, 10 * GIB), (3, "c", 2 * GIB, 4 * GIB)]);
    // 10 GiB to lend; a borrows 6 and may claim 2 more.
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
    // b asks 3 of the 4 free: then a could not finish its burst (2 more, 1 free) nor b
    // (5 more): lending it could strand both, so b waits.
    assert_eq!(p.acquire(2, GPU, 1, 3 * GIB, 3 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty());
    // a asks for the rest of its burst: it goes ahead of b and is served.
    assert_eq!(p.acquire(1, GPU, 2, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
    let answers = p.settle(GPU, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(2 * GIB))]);
    // a is done and frees its burst: b is served.
    let answers = p.release(1, GPU, 8 * GIB, 0, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(2, Ok(3 * GIB))]);
}

#[test]
fn a_new_burst_never_makes_the_bursts_under_way_wait() {
    let now = Instant::now();
    let mut p =
        policy_with(&[(1, "a", 2 * GIB, 8 * GIB), (2, "b", 2 * GIB, 6 * GIB), (3, "c", 2 * GIB, 8 * GIB)]);
    // a loaded beyond its request long ago and gave it back (a first loan is taken for
    // a load, see `under_way`).
    let long_ago = now - Duration::from_secs(60);
    assert_eq!(p.acquire(1, GPU, 0, GIB, GIB, 0, false, long_ago), Outcome::Granted(GIB));
    assert!(p.release(1, GPU, GIB, 2 * GIB, long_ago).is_empty());
    // 10 GiB to lend; a's burst is under way: it has 2 and may claim 4 more.
    assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Granted(2 * GIB));
    // b starts a burst: of the 8 GiB free, 4 are a's to claim; b's whole claim (4)
    // fits beside it, so b starts, with at most those 4.
    assert_eq!(p.acquire(2, GPU, 1, GIB, 6 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
    // c has to wait: a and b may still claim all that is free.
    assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now), Outcome::Queued);
    // a asks for the rest of its burst: it is served before c.
    assert_eq!(p.acquire(1, GPU, 2, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
    let answers = p.settle(GPU, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(4 * GIB))]);
    // a's burst is over: c starts.
    let answers = p.release(1, GPU, 6 * GIB, 0, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(3, Ok(GIB))]);
}

/// The contended trace of `queue_bench`: servers resting above their request (a
/// context their request does not hold) must not all count as bursts under way, or new
/// bursts start side by side, a step each, and the room holds half-grown bursts that
/// all wait. Only as many start as their whole claims fit; a burst under way is served
/// before them, and the next starts when one is over. A server that took memory lately
/// and keeps it is told from a burst under way by order, not time: a whole burst of
/// another server came and went while it did not ask.
#[test]
fn resting_loans_do_not_start_more_bursts_than_the_room_holds() {
    let now = Instant::now();
    let long_ago = now - Duration::from_secs(60);
    let ms = Duration::from_millis;
    let step = 64 << 20;
    let chunk = 768 << 20;
    let rest = 256 << 20;
    // 8 servers (request 1 GiB, limit 4 GiB) on 16 GiB: 8 GiB to lend, 2 of it resting
    // loans, so room for two bursts of 2.75 GiB at once.
    let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
    let groups: Vec<(ConnId, &str, u64, u64)> =
        (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
    let mut p = policy_with(&groups);
    for conn in 1..=8 {
        // Each loaded long ago, one after another.
        let loaded = long_ago + GROWING_FOR * conn as u32;
        assert_eq!(p.acquire(conn, GPU, 1, rest, rest, 0, false, loaded), Outcome::Granted(rest));
    }
    // The 7th took a step half a second ago and keeps it.
    assert_eq!(p.acquire(7, GPU, 2, step, step, 0, false, now - ms(500)), Outcome::Granted(step));
    // The 8th plays a whole burst and gives it back; the 7th did not ask meanwhile.
    assert_eq!(p.acquire(8, GPU, 2, step, step, 0, false, now - ms(300)), Outcome::Granted(step));
    assert!(p.release(8, GPU, step, GIB + rest, now - ms(200)).is_empty());
    // Bursts start together: the first two fit, each lent a chunk.
    assert_eq!(p.acquire(1, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
    assert_eq!(p.acquire(2, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
    // The 7th and the 3rd wait with nothing: their claims do not fit beside the two.
    // (Were the 7th's loan a burst under way, its step would be served.)
    assert_eq!(p.acquire(7, GPU, 3, step, chunk, 0, false, now), Outcome::Queued);
    assert_eq!(p.acquire(3, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty());
    // The first asks for the rest of its burst: it goes ahead of the new ones.
    let rest_of_burst = 3 * GIB - rest - chunk;
    assert_eq!(p.acquire(1, GPU, 3, rest_of_burst, rest_of_burst, 0, false, now), Outcome::Queued);
    let answers = p.settle(GPU, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(rest_of_burst))]);
    // Its burst is over: the 7th starts (a step, while the 3rd waits), and the 3rd
    // still waits: its claim does not fit beside the second's and the 7th's.
    let answers = p.release(1, GPU, 3 * GIB - rest, GIB + rest, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(7, Ok(step))]);
    assert_eq!(p.status().gpus[0].waiting, 1);
}

/// Servers that loaded together, each a model beyond its request, rest on it: their
/// loads are no bursts under way, and their bursts start only as their whole claims fit.
#[test]
fn loads_beyond_the_request_are_resting_loans_not_bursts_under_way() {
    let now = Instant::now();
    let loaded = now - Duration::from_millis(500);
    let (step, chunk, rest) = (64 << 20, 768 << 20, 256 << 20);
    let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
    let groups: Vec<(ConnId, &str, u64, u64)> =
        (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
    let mut p = policy_with(&groups);
    // All load at once, within GROWING_FOR of the bursts.
    for conn in 1..=8 {
        assert_eq!(p.acquire(conn, GPU, 1, rest, rest, 0, false, loaded), Outcome::Granted(rest));
    }
    // Room for two bursts of 2.75 GiB: two start, each lent a chunk; the others wait.
    assert_eq!(p.acquire(1, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
    assert_eq!(p.acquire(2, GPU, 2, step, chunk, 0, false, now), Outcome::Granted(chunk));
    assert_eq!(p.acquire(3, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
    assert_eq!(p.acquire(8, GPU, 2, step, chunk, 0, false, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty());
}

/// What ended the demo's first act in out-of-memory beside two busy loops: an allocator
/// paused in the middle of its burst for so long that its next step was taken for a
/// new burst, which waits for the bursts under way, while one of them needs what the
/// paused one holds. The queue falls back to the safety rule, serves the paused one
/// first, and nobody is refused.
#[test]
fn a_burst_that_paused_mid_way_is_never_refused_for_deadlock() {
    let now = Instant::now();
    let ms = Duration::from_millis;
    // 4 GiB to lend; p and u may borrow 3 GiB each, v 1 GiB.
    let mut p =
        policy_with(&[(1, "p", 4 * GIB, 7 * GIB), (2, "u", 4 * GIB, 7 * GIB), (3, "v", 4 * GIB, 5 * GIB)]);
    p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
    // p's burst is under way: 2 GiB, and it will need 1 more.
    assert_eq!(p.acquire(1, GPU, 1, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Granted(2 * GIB));
    // While p's allocator is paused (a starved CPU), v's whole burst fits beside p's
    // claim, comes and goes: p, silent all along, is taken for resting.
    assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now + ms(1)), Outcome::Granted(GIB));
    assert!(p.release(3, GPU, GIB, 4 * GIB, now + ms(2)).is_empty());
    // u starts a burst beside p (safe: p can finish first, then u).
    assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now + ms(3)), Outcome::Granted(GIB));
    // p's allocator wakes up: its step counts as a new burst, whose whole claim does not
    // fit beside u's: it waits.
    assert_eq!(p.acquire(1, GPU, 2, GIB, GIB, 0, false, now + ms(4)), Outcome::Queued);
    assert!(p.settle(GPU, now + ms(4)).is_empty());
    // u asks for its next step: with 1 GiB free it could strand both (p needs 1, u 2),
    // so u waits for p. Every burst under way waits: p is served by the safety rule.
    assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, false, now + ms(5)), Outcome::Queued);
    let answers = p.settle(GPU, now + ms(5));
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(GIB))]);
    // p's burst is over: u goes on.
    let answers = p.release(1, GPU, 3 * GIB, 4 * GIB, now + ms(6));
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(2, Ok(GIB))]);
    assert!(p.expire(now + ms(7)).is_empty(), "nobody refused");
}

/// The contended trace with allocators that pause at random in the middle of their
/// bursts, some for longer than [`GROWING_FOR`], some while whole bursts of others come
/// and go: every burst is served, nobody is refused.
#[test]
fn bursts_that_pause_at_random_mid_way_are_all_served_and_never_refused() {
    #[derive(Default, Clone, Copy)]
    struct Server {
        /// Lent above the request, and used of it.
        lent: u64,
        used: u64,
        growing: bool,
        waiting: bool,
        paused_until: u64,
        held_until: Option<u64>,
    }
    let start = Instant::now();
    let (step, chunk, rest, burst) = (64 << 20, 768 << 20, 256 << 20, 11 * GIB / 4);
    let names: Vec<String> = (1..=8).map(|c| format!("s{c}")).collect();
    let groups: Vec<(ConnId, &str, u64, u64)> =
        (1..=8).map(|c| (c as ConnId, names[c - 1].as_str(), GIB, 4 * GIB)).collect();
    let mut p = policy_with(&groups);
    p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
    let mut servers = [Server::default(); 9];
    for (conn, s) in servers.iter_mut().enumerate().skip(1) {
        // Loaded one after another, before the trace starts.
        let loaded = start - GROWING_FOR * (10 - conn as u32);
        assert_eq!(p.acquire(conn as ConnId, GPU, 0, rest, rest, 0, false, loaded), Outcome::Granted(rest));
        (s.lent, s.used) = (rest, rest);
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    let apply = |servers: &mut [Server; 9], answers: Vec<Answer>| {
        for a in answers {
            let granted = a.result.unwrap_or_else(|d| panic!("refused: {d:?} {a:?}"));
            let s = &mut servers[a.conn as usize];
            (s.lent, s.used, s.waiting) = (s.lent + granted, s.used + step, false);
        }
    };
    let (mut seq, mut done, mut paused) = (0, 0, 0);
    for ms in 1..=3_600_000u64 {
        let t = start + Duration::from_millis(ms);
        for conn in 1..=8usize {
            let s = servers[conn];
            if s.waiting || ms < s.paused_until {
                continue;
            }
            if let Some(until) = s.held_until {
                if ms >= until {
                    let answers = p.release(conn as ConnId, GPU, s.lent - rest, GIB + rest, t);
                    servers[conn] = Server { lent: rest, used: rest, ..Server::default() };
                    done += 1;
                    apply(&mut servers, answers);
                }
                continue;
            }
            if !s.growing {
                // A burst starts with a 12% chance every 100 ms.
                servers[conn].growing = ms % 100 == 0 && random(100) < 12;
                continue;
            }
            if s.used - rest >= burst {
                servers[conn].held_until = Some(ms + 300);
                continue;
            }
            // One step in 40 pauses the allocator for 0.3 to 3 s.
            if random(40) == 0 {
                servers[conn].paused_until = ms + 300 + random(2700);
                paused += 1;
                continue;
            }
            if s.lent >= s.used + step {
                servers[conn].used += step;
                continue;
            }
            seq += 1;
            match p.acquire(conn as ConnId, GPU, seq, step, chunk, 0, false, t) {
                Outcome::Granted(g) => (servers[conn].lent, servers[conn].used) = (s.lent + g, s.used + step),
                Outcome::Queued => {
                    servers[conn].waiting = true;
                    let answers = p.settle(GPU, t);
                    apply(&mut servers, answers);
                }
                Outcome::Denied(d) => panic!("refused: {d:?}"),
            }
        }
        // The arbiter's tick.
        if ms % 50 == 0 {
            let answers = p.expire(t);
            apply(&mut servers, answers);
        }
        if done >= 200 {
            break;
        }
    }
    assert!(done >= 200 && paused > 50, "{done} bursts served, {paused} pauses");
}

#[test]
fn a_settled_borrower_does_not_keep_others_waiting_for_what_it_might_want() {
    let now = Instant::now();
    for (asked, outcome) in [(now - GROWING_FOR, Outcome::Granted(5 * GIB)), (now, Outcome::Queued)] {
        let mut p = policy_with(&[(1, "cache", 2 * GIB, 12 * GIB), (2, "b", 2 * GIB, 12 * GIB)]);
        // 12 GiB to lend; cache borrows 4 (and may one day claim 6 more).
        assert_eq!(p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, asked), Outcome::Granted(4 * GIB));
        // b bursts by 5 of the 8 free. If cache is still growing, both could be
        // stranded (3 free, 5 and 6 to go): b waits. If cache has settled on its 4 GiB,
        // b can finish within the 8 GiB cache leaves: b is served.
        assert_eq!(
            p.acquire(2, GPU, 1, 5 * GIB, 5 * GIB, 0, false, now),
            outcome,
            "cache asked at {asked:?}"
        );
    }
}

#[test]
fn a_limit_above_what_can_be_lent_still_gets_bursts() {
    let now = Instant::now();
    // b's limit is the whole GPU, more than the 12 GiB that can ever be lent.
    let mut p = policy_with(&[(1, "a", 2 * GIB, 2 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
    assert_eq!(p.acquire(2, GPU, 1, GIB, 4 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
    assert_eq!(p.acquire(2, GPU, 2, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
}

#[test]
fn a_burst_that_can_never_fit_is_refused_at_once_and_blocks_nobody() {
    let now = Instant::now();
    // 12 GiB can ever be lent; a's limit is the whole GPU.
    let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 2 * GIB)]);
    assert_eq!(p.acquire(1, GPU, 1, 13 * GIB, 13 * GIB, 0, false, now), Outcome::Denied(Denial::NeverFits));
    assert_eq!(p.status().gpus[0].waiting, 0, "it is not queued");
    // A 64 MiB burst behind it is served at once, with 12 GiB free.
    assert_eq!(p.acquire(1, GPU, 2, 64 << 20, 64 << 20, 0, false, now), Outcome::Granted(64 << 20));
    // What the group already borrows counts: 64 MiB are lent, so 12 GiB never fit.
    assert_eq!(p.acquire(1, GPU, 3, 12 * GIB, 12 * GIB, 0, false, now), Outcome::Denied(Denial::NeverFits));
    let rest = 12 * GIB - (64 << 20);
    assert_eq!(p.acquire(1, GPU, 4, rest, rest, 0, false, now), Outcome::Granted(rest));
}

#[test]
fn a_waiter_a_registration_leaves_without_a_chance_is_refused_then() {
    let now = Instant::now();
    let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
    p.peers.values_mut().for_each(|peer| peer.wait_timeout = Duration::from_secs(3600));
    // 12 GiB to lend: a borrows 8, b waits for 10 (it fits once a gives back).
    assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, 10 * GIB, 10 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty());
    // c is admitted with 4 GiB: now only 8 GiB can ever be lent, b's 10 never fit. The
    // next look at the queue (the expiry tick) refuses b, long before its deadline.
    p.hello(3, peer("c", 1000));
    p.register(3, GPU, 16 * GIB, 4 * GIB, 4 * GIB, 0, 0, 0).unwrap();
    let answers = p.expire(now + Duration::from_millis(5));
    assert_eq!(
        answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
        vec![(2, Err(Denial::NeverFits))]
    );
    assert_eq!(p.status().gpus[0].waiting, 0);
    assert!(p.expire(now + Duration::from_millis(10)).is_empty());
}

#[test]
fn every_wait_has_a_deadline_even_with_an_endless_timeout() {
    let now = Instant::now();
    let mut p = policy_with(&[(1, "a", 2 * GIB, 16 * GIB), (2, "b", 2 * GIB, 16 * GIB)]);
    p.hello(2, Peer { wait_timeout: Duration::MAX, ..peer("b", 0) });
    assert_eq!(p.acquire(1, GPU, 1, 12 * GIB, 12 * GIB, 0, false, now), Outcome::Granted(12 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, now), Outcome::Queued);
    assert!(p.expire(now + MAX_WAIT - Duration::from_secs(1)).is_empty());
    let answers = p.expire(now + MAX_WAIT);
    assert_eq!(
        answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
        vec![(2, Err(Denial::Timeout))]
    );
}

#[test]
fn after_the_reconnect_grace_outside_memory_does_not_block_deadlock_breaking() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    p.hello(1, Peer { pid: 101, ..peer("a", 60_000) });
    p.register(1, GPU, 16 * GIB, 4 * GIB, 16 * GIB, 0, 0, 0).unwrap();
    p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now);
    p.observe_processes(GPU, &[(200, 6 * GIB)], now);
    // a holds 4 GiB lent and waits for 4 more, 2 are free: only a could give memory back.
    assert_eq!(p.acquire(1, GPU, 2, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty(), "just after a start: maybe shims coming back");
    let answers = p.settle(GPU, now + RECONNECT_GRACE + Duration::from_secs(1));
    assert_eq!(answers.len(), 1);
    assert_eq!((answers[0].conn, answers[0].result), (1, Err(Denial::Deadlock)));
}

/// What a loaded run of `forty_eight_small_requests_that_fit_all_start_under_bursty_load`
/// (tests/tests/guarantees.rs) stood still on for a minute: four swap servers (1 GiB
/// requests, 7 GiB limits) and requests that leave 6 GiB to lend; one holds 3.8 GiB and
/// works on it, two hold a little and wait for their next burst, which the safety rule
/// keeps waiting (each could claim everything). Small servers' bursts queued behind them.
fn small_bursts_behind_a_head_the_safety_rule_keeps_waiting() -> (Policy, Instant) {
    const MIB: u64 = 1 << 20;
    let start = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "load0"), (2, "load2"), (3, "load3")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, GIB, 7 * GIB, 0, 0, 0).unwrap();
    }
    for (conn, group) in [(10, "small0"), (11, "small1")] {
        p.hello(conn, peer(group, 60_000));
        p.register(conn, GPU, 16 * GIB, 128 * MIB, 256 * MIB, 0, 0, 0).unwrap();
    }
    // The other requests: 6 GiB left to lend.
    p.hello(20, peer("others", 60_000));
    p.register(20, GPU, 16 * GIB, 7 * GIB - 256 * MIB, 7 * GIB - 256 * MIB, 0, 0, 0).unwrap();
    let at = |s: u64| start + Duration::from_secs(s);
    assert_eq!(p.acquire(2, GPU, 1, 3922 * MIB, 3922 * MIB, 0, false, at(0)), Outcome::Granted(3922 * MIB));
    assert_eq!(p.acquire(3, GPU, 1, 210 * MIB, 210 * MIB, 0, false, at(3)), Outcome::Granted(210 * MIB));
    assert_eq!(p.acquire(1, GPU, 1, 82 * MIB, 82 * MIB, 0, false, at(6)), Outcome::Granted(82 * MIB));
    // Each asks for a new burst: neither could finish if the other claimed all it may.
    assert_eq!(p.acquire(3, GPU, 2, 64 * MIB, 64 * MIB, 0, false, at(7)), Outcome::Queued);
    assert!(p.settle(GPU, at(7)).is_empty());
    assert_eq!(p.acquire(1, GPU, 2, 64 * MIB, 64 * MIB, 0, false, at(9)), Outcome::Queued);
    assert!(p.settle(GPU, at(9)).is_empty());
    assert_eq!((state(&p, 1), state(&p, 3)), ("waiting".into(), "waiting".into()));
    (p, at(9))
}

#[test]
fn a_small_burst_that_free_memory_holds_whole_is_not_kept_behind_a_head_that_cannot_be_served() {
    const MIB: u64 = 1 << 20;
    let (mut p, now) = small_bursts_behind_a_head_the_safety_rule_keeps_waiting();
    // 1.8 GiB is free: a small server's burst (its whole claim, 128 MiB) finishes from it
    // alone, and gives it back.
    let answers = p.acquire_answers(10, GPU, 1, 50 * MIB, now);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), [(10, Ok(50 * MIB))]);
    assert_eq!(state(&p, 3), "waiting", "the head still waits");
    // Its next step is served too: it still finishes from free memory alone, though the
    // two swap servers' claims still cannot both be met.
    let step = now + Duration::from_millis(10);
    assert_eq!(p.acquire(10, GPU, 2, 50 * MIB, 50 * MIB, 0, false, step), Outcome::Queued);
    let answers = p.settle(GPU, step);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), [(10, Ok(50 * MIB))]);
    let answers = p.acquire_answers(11, GPU, 1, 50 * MIB, step);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), [(11, Ok(50 * MIB))]);
    assert_eq!(state(&p, 3), "waiting");
}

#[test]
fn a_small_burst_waits_behind_a_head_that_the_memory_such_bursts_hold_would_serve() {
    const MIB: u64 = 1 << 20;
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    // 12 GiB to lend. "a" holds 11 GiB (done growing), "head" waits for 2 GiB.
    let mut p = policy_with(&[
        (1, "a", GIB, 13 * GIB),
        (2, "head", GIB, 8 * GIB),
        (3, "s1", GIB, GIB + 256 * MIB),
        (4, "s2", GIB, GIB + 256 * MIB),
    ]);
    assert_eq!(p.acquire(1, GPU, 1, 11 * GIB, 11 * GIB, 0, false, at(0)), Outcome::Granted(11 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 0, false, at(3000)), Outcome::Queued);
    assert!(p.settle(GPU, at(3000)).is_empty());
    // A small burst that free memory holds whole goes past it: the head waits for memory
    // to come back either way.
    let answers = p.acquire_answers(3, GPU, 1, 128 * MIB, at(3000));
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), [(3, Ok(128 * MIB))]);
    // 1 GiB comes back: the head would fit now but for the 128 MiB s1 holds. s2 waits
    // rather than keep the head waiting longer.
    assert!(p.release(1, GPU, GIB, 0, at(4000)).is_empty());
    assert!(p.acquire_answers(4, GPU, 1, 128 * MIB, at(4000)).is_empty());
    assert_eq!(state(&p, 4), "waiting");
    // s1's burst ends: the head goes first.
    let answers = p.release(3, GPU, 128 * MIB, 0, at(4500));
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), [(2, Ok(2 * GIB))]);
}

#[test]
fn a_circle_of_waits_is_broken_by_the_borrower_with_an_unused_loan() {
    let now = Instant::now();
    let later = now + RECONNECT_GRACE + Duration::from_secs(1);
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, pid, group) in [(1, 101, "a"), (2, 102, "b")] {
        p.hello(conn, Peer { pid, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, 4 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    }
    // 8 GiB to lend: a borrows 3 GiB and uses them, b borrows 2 GiB and has freed what
    // it allocated with them (a shim keeps a loan while it may grow again).
    assert_eq!(p.acquire(1, GPU, 1, 3 * GIB, 3 * GIB, 4 * GIB, false, now), Outcome::Granted(3 * GIB));
    let settled = now + GROWING_FOR + Duration::from_millis(1);
    assert_eq!(p.acquire(2, GPU, 1, 2 * GIB, 2 * GIB, 4 * GIB, false, settled), Outcome::Granted(2 * GIB));
    // Then a process outside gpufrac takes the rest, and both ask for more.
    p.observe_processes(GPU, &[(200, 3 * GIB)], later);
    assert_eq!(p.acquire(1, GPU, 2, 2 * GIB, 2 * GIB, 7 * GIB, false, later), Outcome::Queued);
    assert_eq!(p.acquire(2, GPU, 2, 2 * GIB, 2 * GIB, 4 * GIB, false, later), Outcome::Queued);
    // Nobody can be served. a holds the most, but all of it in use: refusing a would be an
    // out-of-memory error. b's loan is unused: b is refused, gives it back, asks again.
    let answers = p.settle(GPU, later);
    assert_eq!(
        answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(),
        vec![(2, Err(Denial::Deadlock))]
    );
    let answers = p.release(2, GPU, 2 * GIB, 4 * GIB, later);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(1, Ok(2 * GIB))]);
    assert_eq!(
        p.acquire(2, GPU, 3, 4 * GIB, 4 * GIB, 4 * GIB, false, later),
        Outcome::Queued,
        "b waits its turn"
    );
}

/// Two tensor-parallel servers, each a group with one worker on each of two GPUs: 4 GiB
/// guaranteed and up to 10 GiB on each, 8 GiB unreserved on each, so that one step of
/// 6 GiB per worker fits at a time.
fn two_tensor_parallel_pairs() -> (Policy, DeviceId) {
    const OTHER: DeviceId = [8; 16];
    let mut p = Policy::new(&[(GPU, 16 * GIB), (OTHER, 16 * GIB)]);
    for (conn, group, device) in [(1, "a", GPU), (2, "a", OTHER), (3, "b", GPU), (4, "b", OTHER)] {
        p.hello(conn, Peer { pid: 100 + conn as u32, ..peer(group, 1000) });
        p.register(conn, device, 16 * GIB, 4 * GIB, 10 * GIB, 0, 0, 0).unwrap();
    }
    (p, OTHER)
}

#[test]
fn a_group_on_two_gpus_bursts_on_both_before_another_starts_on_either() {
    let now = Instant::now();
    let (mut p, other) = two_tensor_parallel_pairs();
    // a's worker on the first GPU starts a step; b's worker on the second asks at the
    // same moment. Lent there, b would hold what a's other worker needs while a holds
    // what b's other worker needs: neither step could finish.
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
    assert_eq!(p.acquire(4, other, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Queued);
    // a's other worker is served, ahead of b's: its group's step is under way.
    let answers = p.acquire_answers(2, other, 1, 6 * GIB, now);
    let served: Vec<_> = answers.iter().map(|a| (a.conn, a.result)).collect();
    assert_eq!(served, vec![(2, Ok(6 * GIB))]);
    assert!(p.acquire_answers(3, GPU, 1, 6 * GIB, now).is_empty(), "b's worker waits on the first GPU too");
    // a's step ends on the first GPU: b's worker there still waits, a's burst is under
    // way on the other GPU and b's step needs both.
    let later = now + Duration::from_millis(5);
    assert!(p.release(1, GPU, 6 * GIB, 4 * GIB, later).is_empty());
    // a's step ends on the second GPU too: b is served on both.
    let mut answers = p.release(2, other, 6 * GIB, 4 * GIB, later);
    answers.extend(p.expire(later));
    let served: Vec<_> = answers.iter().map(|a| (a.conn, a.result)).collect();
    assert_eq!(served.len(), 2, "{served:?}");
    assert!(served.contains(&(3, Ok(6 * GIB))) && served.contains(&(4, Ok(6 * GIB))), "{served:?}");
}

#[test]
fn groups_on_one_gpu_each_are_not_held_by_bursts_elsewhere() {
    let now = Instant::now();
    const OTHER: DeviceId = [8; 16];
    let mut p = Policy::new(&[(GPU, 16 * GIB), (OTHER, 16 * GIB)]);
    for (conn, group, device) in [(1, "a", GPU), (2, "b", OTHER)] {
        p.hello(conn, peer(group, 1000));
        p.register(conn, device, 16 * GIB, 4 * GIB, 10 * GIB, 0, 0, 0).unwrap();
    }
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
    assert_eq!(p.acquire(2, OTHER, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
}
