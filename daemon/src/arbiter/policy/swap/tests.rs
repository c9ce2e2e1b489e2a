//! The swap resolver's turns, each on its own small GPU.

use super::super::testing::*;
use super::super::wait::GROWING_FOR;
use super::super::*;
use super::IDLE_FOR_SWAP;

const MIB: u64 = 1 << 20;

/// Who was answered what, in order.
fn results(answers: &[Answer]) -> Vec<(ConnId, u64, Result<u64, Denial>)> {
    answers.iter().map(|a| (a.conn, a.seq, a.result)).collect()
}

#[test]
fn swap_takes_turns_within_the_quantum_and_the_host_ram_cap() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group, resolver) in [
        (1, "old", Resolver::Swap),
        (2, "waiter", Resolver::Wait),
        (3, "new", Resolver::Swap),
        (4, "bystander", Resolver::Wait),
    ] {
        p.hello(conn, Peer { resolver, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 8 * GIB, 0, 0, 0).unwrap();
    }
    // 8 GiB to lend: old holds 6 and waiter 1 (since long ago), new 1 (5 s ago).
    let long_ago = now - Duration::from_secs(60);
    // Old's burst is over when waiter's starts (a new burst whose whole claim does not
    // fit beside a burst under way waits for it).
    let older = long_ago - Duration::from_secs(3);
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, older), Outcome::Granted(6 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, GIB, GIB, 0, false, long_ago), Outcome::Granted(GIB));
    assert_eq!(p.acquire(3, GPU, 1, GIB, GIB, 0, false, now - Duration::from_secs(5)), Outcome::Granted(GIB));
    // Everyone is active.
    let active = |p: &mut Policy, t: Instant| {
        for conn in 1..=3 {
            if let Some(count) = p.peer(conn).map(|peer| peer.activity + 1) {
                p.activity(conn, count, t);
            }
        }
    };
    active(&mut p, now);
    let quantum = Duration::from_secs(10);
    // A wait-resolver burst never swaps anyone out.
    assert_eq!(p.acquire(2, GPU, 2, 2 * GIB, 2 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.swap_victims(now, quantum, u64::MAX).is_empty());
    p.disconnect(2, now);
    // new wants 5 GiB more (3 are free): only old is past its quantum; the waiter's own
    // group is never chosen.
    assert_eq!(p.acquire(3, GPU, 2, 5 * GIB, 5 * GIB, 0, false, now), Outcome::Queued);
    assert!(p.swap_victims(now, quantum, 5 * GIB).is_empty(), "6 GiB do not fit a 5 GiB host-RAM cap");
    let v = p.swap_victims(now, quantum, 64 * GIB);
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].conn, v[0].bytes), (1, 6 * GIB));
    assert!(p.swap_victims(now, quantum, 64 * GIB).is_empty(), "one swap-out at a time per GPU");
    assert_eq!(state(&p, 1), "swapped");
    // old answers: 6 GiB in host RAM, its grant back; new is served.
    let answers = p.swapped(1, GPU, 0, 6 * GIB, 2 * GIB, now);
    assert_eq!((answers[0].conn, answers[0].result), (3, Ok(5 * GIB)));
    assert_eq!(p.host_committed(), 6 * GIB);
    // old wants back in: it waits (its shim asks again after RESUME_WAIT), and new
    // (active) is swapped out only after its quantum.
    assert_eq!(p.acquire(1, GPU, 2, 6 * GIB, 6 * GIB, 0, true, now), Outcome::Queued);
    assert!(p.expire(now + Duration::from_secs(60)).is_empty(), "a swap-in waits longer than a burst");
    active(&mut p, now + Duration::from_secs(5));
    assert!(p.swap_victims(now + Duration::from_secs(5), quantum, 64 * GIB).is_empty());
    active(&mut p, now + Duration::from_secs(11));
    let v = p.swap_victims(now + Duration::from_secs(11), quantum, 64 * GIB);
    assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![3]);
    let answers = p.swapped(3, GPU, 0, 6 * GIB, 2 * GIB, now + Duration::from_secs(12));
    assert_eq!((answers[0].conn, answers[0].result), (1, Ok(6 * GIB)));
    p.swapped(1, GPU, 6 * GIB, 0, 8 * GIB, now + Duration::from_secs(13));
    assert_eq!(state(&p, 1), "running");
    let s = p.status();
    let old = s.gpus[0].processes.iter().find(|x| x.group == "old").unwrap();
    assert_eq!(old.swapped_ms, 13_000);
    assert_eq!(s.gpus[0].swapped, 6 * GIB, "new's memory is in host RAM now");
    // Memory frees: new is told it may come back, once.
    p.release(1, GPU, 6 * GIB, 2 * GIB, now);
    let later = Instant::now() + Duration::from_secs(14);
    assert!(p.resume_candidates(later, Duration::from_secs(60)).is_empty(), "not before memory settles");
    assert_eq!(p.resume_candidates(later, Duration::ZERO), vec![(3, GPU)]);
    assert!(p.resume_candidates(later, Duration::ZERO).is_empty());
}

#[test]
fn an_idle_holder_is_swapped_out_at_once_an_active_one_after_its_quantum() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "busy"), (2, "sleepy"), (3, "asker")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, last_active: now, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 7 * GIB, 0, 0, 0).unwrap();
    }
    // 10 GiB to lend: busy and sleepy each borrow 4 GiB just now.
    assert_eq!(p.acquire(1, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Granted(4 * GIB));
    let t = now + IDLE_FOR_SWAP;
    p.activity(1, 7, t);
    assert_eq!(p.acquire(3, GPU, 1, 4 * GIB, 4 * GIB, 0, false, t), Outcome::Queued);
    // The quantum (10 s) protects busy; sleepy has not launched anything for 2 s.
    let v = p.swap_victims(t, Duration::from_secs(10), u64::MAX);
    assert_eq!(v.iter().map(|v| (v.conn, v.bytes)).collect::<Vec<_>>(), vec![(2, 4 * GIB)]);
}

#[test]
fn a_holder_just_swapped_back_in_is_not_taken_for_idle() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "back"), (2, "asker")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, last_active: now, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    }
    // 12 GiB to lend: "back" borrowed 8, was swapped out, and after a minute at its
    // gate (no launch meanwhile) comes back.
    assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, now), Outcome::Granted(8 * GIB));
    p.swapped(1, GPU, 0, 8 * GIB, 0, now);
    let t = now + Duration::from_secs(60);
    assert_eq!(p.acquire(1, GPU, 2, 8 * GIB, 8 * GIB, 0, true, t), Outcome::Granted(8 * GIB));
    p.swapped(1, GPU, 8 * GIB, 0, 10 * GIB, t);
    // Another swap burst that does not fit beside it arrives at once: "back" keeps its
    // quantum (10 s) like any holder that just started working.
    assert_eq!(p.acquire(2, GPU, 1, 8 * GIB, 8 * GIB, 0, false, t), Outcome::Queued);
    assert!(p.swap_victims(t, Duration::from_secs(10), u64::MAX).is_empty());
    // Idle for 2 s after its return, it may be moved out again.
    let later = t + IDLE_FOR_SWAP;
    let v = p.swap_victims(later, Duration::from_secs(10), u64::MAX);
    assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), [1]);
}

#[test]
fn a_holder_that_could_strand_the_burst_is_swapped_out_even_when_memory_is_free() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 4 * GIB)]);
    for (conn, group) in [(1, "sleepy"), (2, "asker")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, last_active: now, ..peer(group, 60_000) });
        p.register(conn, GPU, 4 * GIB, GIB, 3 * GIB, 0, 0, 0).unwrap();
    }
    // 2 GiB to lend: sleepy borrowed 1 GiB a second ago (without a launch since it
    // started) and may claim 1 more. The asker's 32 MiB fit, but then neither could be
    // sure to finish: it waits.
    let t = now + IDLE_FOR_SWAP;
    let asked = t - Duration::from_secs(1);
    assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, false, asked), Outcome::Granted(GIB));
    assert_eq!(p.acquire(2, GPU, 1, 32 << 20, 512 << 20, 0, false, t), Outcome::Queued);
    // sleepy is idle: it is swapped out, and the asker served.
    let v = p.swap_victims(t, Duration::from_secs(30), u64::MAX);
    assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![1]);
    let answers = p.swapped(1, GPU, 0, GIB, GIB, t);
    assert_eq!(answers.iter().map(|a| (a.conn, a.result)).collect::<Vec<_>>(), vec![(2, Ok(512 << 20))]);
}

#[test]
fn nobody_is_refused_as_deadlocked_while_a_swap_out_is_under_way() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 4 * GIB)]);
    for (conn, group) in [(1, "a"), (2, "b")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, last_active: now, ..peer(group, 60_000) });
    }
    let mib = 1 << 20;
    // a is swapped out (1 GiB in host RAM, 64 MiB of grant left); b borrows 512 MiB.
    p.register(1, GPU, 4 * GIB, GIB, 3 * GIB, GIB, 64 * mib, GIB).unwrap();
    p.register(2, GPU, 4 * GIB, GIB, 3 * GIB, 0, 0, 0).unwrap();
    assert_eq!(p.acquire(2, GPU, 1, 512 * mib, 512 * mib, 0, false, now), Outcome::Granted(512 * mib));
    // a wants back in; b is asked to swap out for it, and meanwhile asks for more.
    assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, true, now), Outcome::Queued);
    let v = p.swap_victims(now, Duration::ZERO, u64::MAX);
    assert_eq!(v.iter().map(|v| v.conn).collect::<Vec<_>>(), vec![2]);
    assert_eq!(p.acquire(2, GPU, 2, 32 * mib, 32 * mib, 0, false, now), Outcome::Queued);
    let mut answers = p.settle(GPU, now);
    // b's swap-out is answered.
    answers.extend(p.swapped(2, GPU, 0, 512 * mib, GIB, now));
    assert!(
        answers.iter().all(|a| a.result.is_ok()),
        "b's memory is on its way: nobody is refused: {answers:?}"
    );
    assert!(answers.iter().any(|a| (a.conn, a.result) == (1, Ok(GIB))), "a comes back in: {answers:?}");
}

#[test]
fn a_swap_in_under_way_is_not_asked_to_give_its_grant_back() {
    // tests/tests/swap.rs on a loaded machine: the holder is told to come back the
    // moment its swap-out is over, and the burst asks for more while it maps its
    // memory back. Asked to give back what it does not use, it gave back what it had
    // not mapped yet; the burst was lent it, the device was full, and the swap-in
    // stuck with memory the arbiter no longer counted.
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 4 * GIB)]);
    for (conn, group) in [(1, "holder"), (2, "burst")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 30_000) });
    }
    let mib = 1 << 20;
    p.register(1, GPU, 4 * GIB, GIB, 3 * GIB, GIB + 64 * mib, 66 * mib, GIB).unwrap();
    p.register(2, GPU, 4 * GIB, GIB, 3 * GIB, 0, 0, 0).unwrap();
    assert_eq!(p.acquire(2, GPU, 1, 32 * mib, 512 * mib, 0, false, now), Outcome::Granted(512 * mib));
    // The holder's swap-in fits once the burst rests (not beside what a burst under
    // way may still claim): it is granted.
    let rested = now + GROWING_FOR;
    assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, GIB + 64 * mib, true, rested), Outcome::Granted(GIB));
    // The burst asks for more than is left: it waits.
    let later = rested + Duration::from_secs(1);
    assert_eq!(p.acquire(2, GPU, 2, 512 * mib, 512 * mib, 0, false, later), Outcome::Queued);
    assert!(
        !p.contended_holders(later).contains(&(1, GPU)),
        "the swap-in's grant is being mapped: none of it is unused"
    );
    // Once back in, it is asked like any holder that is not growing.
    p.swapped(1, GPU, GIB + 66 * mib, 0, 2 * GIB + 64 * mib, later);
    assert!(p.contended_holders(later + GROWING_FOR).contains(&(1, GPU)));
}

#[test]
fn a_swap_in_that_fits_goes_ahead_of_a_head_that_does_not() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "a"), (2, "b")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 0, 0, 0).unwrap();
    }
    // 12 GiB to lend: b holds 11, a (swapped out) wants 6 back, b is swapped out of 1 GiB.
    assert_eq!(p.acquire(2, GPU, 1, 11 * GIB, 11 * GIB, 0, false, now), Outcome::Granted(11 * GIB));
    p.register(1, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 2 * GIB, 0, 6 * GIB).unwrap();
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, true, now), Outcome::Queued);
    p.swapped(2, GPU, 10 * GIB, GIB, 12 * GIB, now);
    assert_eq!(p.acquire(2, GPU, 2, GIB, GIB, 0, true, now), Outcome::Queued);
    let answers = p.settle(GPU, now);
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!((answers[0].conn, answers[0].result), (2, Ok(GIB)), "b's small swap-in fits and goes first");
}

/// Three swap players of tests/tests/swap.rs's ping-pong on its 2 GiB GPU: 256 MiB
/// requests, 1280 MiB limits, so 1280 MiB to lend and 1024 MiB of range each. Each took
/// a burst of 576 MiB and was swapped out of it (it is in host RAM).
fn ping_pong(now: Instant) -> Policy {
    let mut p = Policy::new(&[(GPU, 2 * GIB)]);
    for (conn, group) in [(1, "pong0"), (2, "pong1"), (3, "pong2")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 30_000) });
        p.register(conn, GPU, 2 * GIB, 256 * MIB, 1280 * MIB, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(conn, GPU, 1, 576 * MIB, 576 * MIB, 0, false, now), Outcome::Granted(576 * MIB));
        assert!(p.swapped(conn, GPU, 0, 576 * MIB, 256 * MIB, now).is_empty());
    }
    assert_eq!(state(&p, 1), "swapped");
    assert_eq!(p.status().gpus[0].swapped, 3 * 576 * MIB);
    p
}

/// [`ping_pong`], then pong1 came back in and its next burst is under way: 640 MiB of
/// its range borrowed, 640 MiB free.
fn ping_pong_one_back(now: Instant) -> Policy {
    let mut p = ping_pong(now);
    assert_eq!(p.acquire(2, GPU, 2, 576 * MIB, 576 * MIB, 0, true, now), Outcome::Granted(576 * MIB));
    assert!(p.swapped(2, GPU, 576 * MIB, 0, 832 * MIB, now).is_empty());
    assert_eq!(p.acquire(2, GPU, 3, 64 * MIB, 64 * MIB, 0, false, now), Outcome::Granted(64 * MIB));
    assert_eq!((state(&p, 2), p.status().gpus[0].free), ("running".to_owned(), 640 * MIB));
    p
}

#[test]
fn a_swap_in_waits_for_what_a_burst_under_way_may_still_claim() {
    // pong0 wants its 576 MiB back: they fit in the 640 MiB free, but not beside the
    // 384 MiB pong1's burst may still claim. Served on free memory alone, the swap-in
    // would take what pong1 needs next, and both would wait for each other (seen
    // end to end: refused as a deadlock, again and again). It waits; the swap resolver
    // takes turns instead, swapping pong1 out (its quantum is 0 here).
    let now = Instant::now();
    let mut p = ping_pong_one_back(now);
    assert_eq!(p.acquire(1, GPU, 2, 576 * MIB, 576 * MIB, 0, true, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty(), "not served beside pong1's burst");
    let v = p.swap_victims(now, Duration::ZERO, u64::MAX);
    assert_eq!(v.iter().map(|v| (v.conn, v.bytes)).collect::<Vec<_>>(), vec![(2, 640 * MIB)]);
    let answers = p.swapped(2, GPU, 0, 640 * MIB, 256 * MIB, now);
    assert_eq!(results(&answers), vec![(1, 2, Ok(576 * MIB))]);
    // Once pong1's burst is over (it gave memory back), a swap-in that fits is served
    // at once, nobody swapped out for it.
    let mut p = ping_pong_one_back(now);
    assert!(p.release(2, GPU, 64 * MIB, 768 * MIB, now).is_empty());
    assert_eq!(p.acquire(1, GPU, 2, 576 * MIB, 576 * MIB, 0, true, now), Outcome::Granted(576 * MIB));
    assert!(p.swap_victims(now, Duration::ZERO, u64::MAX).is_empty());
}

#[test]
fn a_swap_in_that_does_not_fit_has_a_resident_holder_swapped_out() {
    // A swap-in has no deadline worth the name (an hour): left to the queue while the
    // memory it needs stays lent, it stands still. The swap resolver acts on it.
    let now = Instant::now();
    let mut p = ping_pong_one_back(now);
    // pong1's burst grows to its whole range, 1024 MiB: 256 MiB free.
    assert_eq!(p.acquire(2, GPU, 4, 384 * MIB, 384 * MIB, 0, false, now), Outcome::Granted(384 * MIB));
    assert_eq!(p.acquire(1, GPU, 2, 576 * MIB, 576 * MIB, 0, true, now), Outcome::Queued);
    assert!(p.settle(GPU, now).is_empty());
    let v = p.swap_victims(now, Duration::ZERO, u64::MAX);
    assert_eq!(v.iter().map(|v| (v.conn, v.bytes)).collect::<Vec<_>>(), vec![(2, 1024 * MIB)]);
    let answers = p.swapped(2, GPU, 0, 1024 * MIB, 256 * MIB, now);
    assert_eq!(results(&answers), vec![(1, 2, Ok(576 * MIB))]);
}

#[test]
fn a_swapped_out_process_gets_nothing_new_until_it_is_back() {
    // The state a loaded ping-pong stood still in for minutes: a swapped-out process
    // still allocates (allocations do not pass its gate; its launches and copies do),
    // so each player was lent steps of its next burst while its last one was in host
    // RAM. All three ended up swapped out, holding 973 MiB on the device, and pong0's
    // 576 MiB swap-in fit by no rule with 307 MiB free and no resident holder to swap
    // out: nothing was refused and nobody asked to move. Their steps are held back
    // instead, until each is back.
    let now = Instant::now();
    let mut p = ping_pong(now);
    for (conn, bytes) in [(1, 320 * MIB), (2, 320 * MIB), (3, 333 * MIB)] {
        assert!(p.swapped_out(conn, &GPU));
        assert_eq!(p.acquire(conn, GPU, 2, bytes, bytes, 0, false, now), Outcome::Queued);
        assert!(p.settle(GPU, now).is_empty(), "no step is lent while its process is in host RAM");
        assert!(p.swap_victims(now, Duration::ZERO, u64::MAX).is_empty(), "nobody to swap out for them");
    }
    assert_eq!(p.status().gpus[0].free, 1280 * MIB);
    // pong0 asks for its memory back (the server told it to): it fits and is served,
    // ahead of the steps held back.
    assert_eq!(p.acquire(1, GPU, 3, 576 * MIB, 576 * MIB, 0, true, now), Outcome::Queued);
    let answers = p.settle(GPU, now);
    assert_eq!(results(&answers), vec![(1, 3, Ok(576 * MIB))]);
    assert!(p.swapped_out(1, &GPU), "on the device only once its swap-in is reported");
    // Back on the device: its step is served now, the others still wait for theirs.
    let answers = p.swapped(1, GPU, 576 * MIB, 0, 832 * MIB, now);
    assert_eq!(results(&answers), vec![(1, 2, Ok(320 * MIB))]);
    assert!(!p.swapped_out(1, &GPU));
    assert!(p.swapped_out(2, &GPU) && p.swapped_out(3, &GPU));
    assert_eq!(p.status().gpus[0].free, 1280 * MIB - 896 * MIB);
}

/// Swap groups `(conn, name)` (256 MiB requests, 1280 MiB limits) on a GPU of `total`:
/// each borrowed 576 MiB and was swapped out; a and b (conns 1 and 2) came back in, so
/// 384 MiB is free. Returns the policy and a moment when neither is growing any more.
fn back_from_host_ram(total: u64, groups: &[(ConnId, &str)]) -> (Policy, Instant) {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, total)]);
    for &(conn, group) in groups {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 30_000) });
        p.register(conn, GPU, total, 256 * MIB, 1280 * MIB, 0, 0, 0).unwrap();
        assert_eq!(p.acquire(conn, GPU, 1, 576 * MIB, 576 * MIB, 0, false, now), Outcome::Granted(576 * MIB));
        assert!(p.swapped(conn, GPU, 0, 576 * MIB, 256 * MIB, now).is_empty());
    }
    let rested = now + GROWING_FOR;
    for conn in [1, 2] {
        // Granted at once, or at the server's next look at the queue.
        match p.acquire(conn, GPU, 2, 576 * MIB, 576 * MIB, 0, true, rested) {
            Outcome::Queued => assert_eq!(p.settle(GPU, rested).len(), 1),
            outcome => assert_eq!(outcome, Outcome::Granted(576 * MIB)),
        }
        assert!(p.swapped(conn, GPU, 576 * MIB, 0, 832 * MIB, rested).is_empty());
    }
    assert_eq!(p.status().gpus[0].free, 384 * MIB);
    (p, rested + GROWING_FOR)
}

#[test]
fn swap_bursts_waiting_for_each_other_take_turns_instead_of_a_deadlock() {
    // Both came back in from host RAM and each waits for its next step, which only
    // the other's memory could serve. Refusing one (a `Deadlock`) would be an
    // out-of-memory error for a collision; swap moves one out and serves the other.
    let (mut p, later) = back_from_host_ram(2 * GIB, &[(1, "a"), (2, "b")]);
    assert_eq!(p.acquire(1, GPU, 3, 400 * MIB, 400 * MIB, 0, false, later), Outcome::Queued);
    assert_eq!(p.acquire(2, GPU, 3, 400 * MIB, 400 * MIB, 0, false, later), Outcome::Queued);
    let answers = p.settle(GPU, later);
    assert!(answers.is_empty(), "nobody refused: {answers:?}");
    let v = p.swap_victims(later, Duration::ZERO, u64::MAX);
    assert_eq!(v.iter().map(|v| (v.conn, v.bytes)).collect::<Vec<_>>(), vec![(2, 576 * MIB)]);
    let answers = p.swapped(2, GPU, 0, 576 * MIB, 256 * MIB, later);
    assert_eq!(results(&answers), vec![(1, 3, Ok(400 * MIB))]);
    assert!(p.swapped_out(2, &GPU), "b's step waits for b to come back");
    // b's thread waits for its step, not at its gate: b is told to come back at once,
    // and its swap-in waits its turn.
    assert_eq!(p.resume_candidates(later, Duration::from_secs(1)), vec![(2, GPU)]);
    assert!(p.resume_candidates(later, Duration::from_secs(1)).is_empty(), "told once");
}

#[test]
fn holders_waiting_behind_a_swap_in_take_turns_instead_of_a_deadlock() {
    // From a loaded run: two holders, back from host RAM, each wait for a step only the
    // other's memory could serve, behind a third group's swap-in. One of them was
    // refused at once (`Deadlock`, an out-of-memory error for a collision): the swap
    // resolver serves a swap-in at the head as it serves a burst there.
    let (mut p, later) = back_from_host_ram(2304 * MIB, &[(3, "c"), (1, "a"), (2, "b")]);
    assert_eq!(p.acquire(3, GPU, 2, 576 * MIB, 576 * MIB, 0, true, later), Outcome::Queued);
    assert_eq!(p.acquire(1, GPU, 3, 400 * MIB, 400 * MIB, 0, false, later), Outcome::Queued);
    assert_eq!(p.acquire(2, GPU, 3, 400 * MIB, 400 * MIB, 0, false, later), Outcome::Queued);
    let answers = p.settle(GPU, later);
    assert!(answers.is_empty(), "nobody refused: {answers:?}");
    let v = p.swap_victims(later, Duration::ZERO, u64::MAX);
    assert_eq!(v.len(), 1, "one holder moved out for the swap-in: {v:?}");
}

#[test]
fn a_swap_out_left_unanswered_does_not_block_the_gpu_for_ever() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "a"), (2, "b")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 600_000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    }
    let long_ago = now - Duration::from_secs(60);
    assert_eq!(p.acquire(1, GPU, 1, 10 * GIB, 10 * GIB, 0, false, long_ago), Outcome::Granted(10 * GIB));
    assert_eq!(p.acquire(2, GPU, 1, 4 * GIB, 4 * GIB, 0, false, now), Outcome::Queued);
    let quantum = Duration::from_secs(10);
    assert_eq!(p.swap_victims(now, quantum, u64::MAX).len(), 1);
    assert!(p.swap_victims(now + Duration::from_secs(30), quantum, u64::MAX).is_empty());
    // No answer for over a minute: resident again, its quantum anew, then asked again.
    p.activity(1, 1, now + Duration::from_secs(61));
    assert!(p.swap_victims(now + Duration::from_secs(61), quantum, u64::MAX).is_empty());
    assert_eq!(state(&p, 1), "running");
    p.activity(1, 2, now + Duration::from_secs(72));
    assert_eq!(p.swap_victims(now + Duration::from_secs(72), quantum, u64::MAX).len(), 1);
}

#[test]
fn a_swap_in_is_accepted_only_for_what_is_swapped_out_and_waits_until_a_deadline() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "a"), (2, "b")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 1000) });
    }
    // a has nothing swapped out; b has 4 GiB in host RAM.
    p.register(1, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 2 * GIB, 0, 0).unwrap();
    p.register(2, GPU, 16 * GIB, 2 * GIB, 14 * GIB, 2 * GIB, 0, 4 * GIB).unwrap();
    assert_eq!(p.acquire(1, GPU, 1, GIB, GIB, 0, true, now), Outcome::Denied(Denial::NotSwapped));
    assert_eq!(p.acquire(2, GPU, 1, 5 * GIB, 5 * GIB, 0, true, now), Outcome::Denied(Denial::NotSwapped));
    assert_eq!(p.status().gpus[0].waiting, 0);
    // a borrows all 12 GiB: b's swap-in of its 4 GiB waits, for RESUME_WAIT at most.
    assert_eq!(p.acquire(1, GPU, 2, 12 * GIB, 12 * GIB, 0, false, now), Outcome::Granted(12 * GIB));
    assert_eq!(p.acquire(2, GPU, 2, 4 * GIB, 4 * GIB, 0, true, now), Outcome::Queued);
    assert!(p.expire(now + RESUME_WAIT - Duration::from_secs(1)).is_empty());
    let answers = p.expire(now + RESUME_WAIT);
    assert_eq!(results(&answers), vec![(2, 2, Err(Denial::Timeout))]);
    // Asked again (as its shim does), it comes back when a gives memory back.
    let later = now + RESUME_WAIT;
    assert_eq!(p.acquire(2, GPU, 3, 4 * GIB, 4 * GIB, 0, true, later), Outcome::Queued);
    let answers = p.release(1, GPU, 12 * GIB, 2 * GIB, later);
    assert_eq!(results(&answers), vec![(2, 3, Ok(4 * GIB))]);
}

#[test]
fn a_swap_report_cannot_take_a_grant_it_was_not_lent() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for conn in [1, 2] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer("a", 1000) });
        p.register(conn, GPU, 16 * GIB, 2 * GIB, 10 * GIB, 0, 0, 0).unwrap();
    }
    assert_eq!(p.acquire(1, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Granted(6 * GIB));
    // Member 2 claims 8 GiB granted: the group would pass its limit.
    p.swapped(2, GPU, 8 * GIB, 0, 0, now);
    assert_eq!(p.status().gpus[0].burst, 6 * GIB);
}

#[test]
fn reports_cannot_put_more_in_the_ledger_than_the_group_may_hold() {
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    p.hello(1, Peer { resolver: Resolver::Swap, ..peer("a", 1000) });
    p.register(1, GPU, 16 * GIB, 2 * GIB, 6 * GIB, 0, u64::MAX, u64::MAX).unwrap();
    p.swapped(1, GPU, u64::MAX, u64::MAX, 0, now);
    let s = &p.status().gpus[0];
    // 4 GiB lent (its burst range) and its limit in host RAM, whatever it claims.
    assert_eq!((s.burst, s.swapped), (4 * GIB, 6 * GIB));
    assert_eq!(p.host_committed(), 6 * GIB);
    p.swapped(1, GPU, 0, u64::MAX, 0, now);
    let s = &p.status().gpus[0];
    assert_eq!((s.burst, s.swapped), (0, 6 * GIB));
    // The node's swap limit bounds what the others may claim: 6 of 10 GiB are taken.
    p.set_swap_limit(10 * GIB);
    p.hello(2, Peer { resolver: Resolver::Swap, ..peer("b", 1000) });
    p.register(2, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0, u64::MAX).unwrap();
    assert_eq!(p.host_committed(), 10 * GIB);
    p.swapped(2, GPU, 0, u64::MAX, 0, now);
    assert_eq!(p.host_committed(), 10 * GIB);
}

#[test]
fn a_swap_out_reported_past_the_swap_limits_room_can_still_swap_in() {
    // Two holders told to swap out at once under a 6 GiB swap limit: each is counted
    // at most what the limit leaves, but the second really has 4 GiB in host RAM, and
    // its swap-in for that must be served once the GPU has room (refused as "more than
    // it has swapped out", it would wait for ever: seen in guarantees.rs under load).
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    p.set_swap_limit(6 * GIB);
    for (conn, name) in [(1, "a"), (2, "b")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(name, 1000) });
        p.register(conn, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0, 0).unwrap();
    }
    p.swapped(1, GPU, 0, 4 * GIB, 0, now);
    p.swapped(2, GPU, 0, 4 * GIB, 0, now);
    assert_eq!(p.host_committed(), 6 * GIB, "host RAM is counted within the swap limit");
    assert_eq!(
        p.acquire(2, GPU, 1, 4 * GIB, 4 * GIB, 0, true, now),
        Outcome::Granted(4 * GIB),
        "the swap-in of what it has in host RAM is served"
    );
    assert_eq!(
        p.acquire(1, GPU, 2, 5 * GIB, 5 * GIB, 0, true, now),
        Outcome::Denied(Denial::NotSwapped),
        "more than it said it has is still refused"
    );
}

#[test]
fn a_release_crossing_a_swap_out_leaves_the_swap_in_possible() {
    // The demo's act 3: a holder told to swap out gives part of its grant back in a
    // Release while it copies, then reports all of its burst memory in host RAM.
    let now = Instant::now();
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    p.hello(1, Peer { resolver: Resolver::Swap, ..peer("a", 1000) });
    p.register(1, GPU, 16 * GIB, GIB, 8 * GIB, 0, 0, 0).unwrap();
    assert_eq!(p.acquire(1, GPU, 1, 5 * GIB / 4, 5 * GIB / 4, 0, false, now), Outcome::Granted(5 * GIB / 4));
    p.release(1, GPU, GIB / 4, GIB, now);
    p.swapped(1, GPU, 0, 5 * GIB / 4, GIB, now);
    assert_eq!(p.status().gpus[0].swapped, 5 * GIB / 4);
    assert_eq!(
        p.acquire(1, GPU, 2, 5 * GIB / 4, 5 * GIB / 4, GIB, true, now),
        Outcome::Granted(5 * GIB / 4),
        "the swap-in of what it has in host RAM is served"
    );
}

/// From a loaded run of tests/tests/guarantees.rs: a swap burst that only swap-outs
/// could serve waited a minute and timed out, the resolver finding no set of holders
/// to move: a swapped-out group waiting for its swap-in (holding a little) was counted
/// as growing, and two growing claims of all the GPU can lend never fit together.
#[test]
fn a_group_waiting_for_its_swap_in_does_not_keep_a_swap_burst_from_being_served() {
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (conn, group) in [(1, "load0"), (2, "load1"), (3, "load2"), (4, "load3")] {
        p.hello(conn, Peer { resolver: Resolver::Swap, ..peer(group, 60_000) });
        p.register(conn, GPU, 16 * GIB, GIB, 7 * GIB, 0, 0, 0).unwrap();
    }
    // The other requests: 6 GiB left to lend.
    p.hello(9, peer("others", 60_000));
    p.register(9, GPU, 16 * GIB, 6 * GIB, 6 * GIB, 0, 0, 0).unwrap();
    // load1 borrowed 2.8 GiB and was swapped out, keeping 82 MiB on the device.
    assert_eq!(p.acquire(2, GPU, 1, 2898 * MIB, 2898 * MIB, 0, false, at(0)), Outcome::Granted(2898 * MIB));
    p.swapped(2, GPU, 82 * MIB, 2816 * MIB, 0, at(0));
    // load2 holds 3.8 GiB and works on it; load3 and load0 hold a little.
    assert_eq!(p.acquire(3, GPU, 1, 3922 * MIB, 3922 * MIB, 0, false, at(0)), Outcome::Granted(3922 * MIB));
    assert_eq!(p.acquire(4, GPU, 1, 210 * MIB, 210 * MIB, 0, false, at(3000)), Outcome::Granted(210 * MIB));
    assert_eq!(p.acquire(1, GPU, 1, 82 * MIB, 82 * MIB, 0, false, at(6000)), Outcome::Granted(82 * MIB));
    // load3 and load0 ask for new bursts, then load1 to come back. Nothing fits.
    assert_eq!(p.acquire(4, GPU, 2, 64 * MIB, 64 * MIB, 0, false, at(7000)), Outcome::Queued);
    assert_eq!(p.acquire(1, GPU, 2, 64 * MIB, 64 * MIB, 0, false, at(9000)), Outcome::Queued);
    assert_eq!(p.acquire(2, GPU, 2, 2816 * MIB, 2816 * MIB, 0, true, at(9000)), Outcome::Queued);
    assert!(p.settle(GPU, at(9000)).is_empty());
    // Past load2's quantum, the resolver moves holders out for load3, the head.
    let victims: Vec<ConnId> =
        p.swap_victims(at(20_000), Duration::from_secs(10), 64 * GIB).iter().map(|v| v.conn).collect();
    assert_eq!(victims, [3, 1], "load2 (not waiting) first, then load0");
}

#[test]
fn a_group_on_two_gpus_is_swapped_out_on_both() {
    let now = Instant::now();
    const OTHER: DeviceId = [8; 16];
    let mut p = Policy::new(&[(GPU, 16 * GIB), (OTHER, 16 * GIB)]);
    // A tensor-parallel server (one worker per GPU) and a one-GPU server, all using swap.
    for (conn, group, device) in [(1, "tp", GPU), (2, "tp", OTHER), (3, "solo", GPU)] {
        p.hello(conn, Peer { pid: 100 + conn as u32, resolver: Resolver::Swap, ..peer(group, 60_000) });
        p.register(conn, device, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    }
    // The server's step took 8 GiB on each GPU, long ago; it is idle since.
    let long_ago = now - Duration::from_secs(60);
    assert_eq!(p.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, long_ago), Outcome::Granted(8 * GIB));
    assert_eq!(p.acquire(2, OTHER, 1, 8 * GIB, 8 * GIB, 0, false, long_ago), Outcome::Granted(8 * GIB));
    for conn in [1, 2] {
        p.peers.get_mut(&conn).unwrap().last_active = long_ago;
    }
    // The other server's burst on the first GPU needs the server's memory there: the
    // server goes to host RAM on both GPUs, as one.
    assert_eq!(p.acquire(3, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Queued);
    let mut v: Vec<_> = p
        .swap_victims(now, Duration::from_secs(10), u64::MAX)
        .iter()
        .map(|v| (v.conn, v.device, v.bytes))
        .collect();
    v.sort();
    assert_eq!(v, vec![(1, GPU, 8 * GIB), (2, OTHER, 8 * GIB)]);
    // Within the host-RAM cap only: room for one worker's burst swaps out that one alone.
    let mut p2 = Policy::new(&[(GPU, 16 * GIB), (OTHER, 16 * GIB)]);
    for (conn, group, device) in [(1, "tp", GPU), (2, "tp", OTHER), (3, "solo", GPU)] {
        p2.hello(conn, Peer { pid: 100 + conn as u32, resolver: Resolver::Swap, ..peer(group, 60_000) });
        p2.register(conn, device, 16 * GIB, 2 * GIB, 12 * GIB, 0, 0, 0).unwrap();
    }
    assert_eq!(p2.acquire(1, GPU, 1, 8 * GIB, 8 * GIB, 0, false, long_ago), Outcome::Granted(8 * GIB));
    assert_eq!(p2.acquire(2, OTHER, 1, 8 * GIB, 8 * GIB, 0, false, long_ago), Outcome::Granted(8 * GIB));
    for conn in [1, 2] {
        p2.peers.get_mut(&conn).unwrap().last_active = long_ago;
    }
    assert_eq!(p2.acquire(3, GPU, 1, 6 * GIB, 6 * GIB, 0, false, now), Outcome::Queued);
    let v = p2.swap_victims(now, Duration::from_secs(10), 10 * GIB);
    assert_eq!(v.iter().map(|v| (v.conn, v.device)).collect::<Vec<_>>(), vec![(1, GPU)]);
}
