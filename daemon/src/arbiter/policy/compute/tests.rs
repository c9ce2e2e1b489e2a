use super::super::testing::*;
use super::super::*;
use super::*;
use gpufrac_common::ComputeShare;

fn share(request: u16, limit: u16) -> Option<ComputeSpec> {
    Some(ComputeSpec {
        request: ComputeShare::from_per_mille(request).unwrap(),
        limit: ComputeShare::from_per_mille(limit).unwrap(),
    })
}

/// A GPU with compute groups on connections 1.. (pids 101..), each its own group.
fn gpu_with(shares: &[Option<ComputeSpec>]) -> Policy {
    let mut p = Policy::new(&[(GPU, 16 * GIB)]);
    for (i, &compute) in shares.iter().enumerate() {
        let conn = i as u64 + 1;
        p.hello(conn, Peer { pid: 100 + conn as u32, compute, ..peer(&format!("g{conn}"), 1000) });
        p.register(conn, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
    }
    p
}

#[test]
fn compute_requests_past_the_whole_gpu_are_refused_naming_the_variable() {
    let mut p = gpu_with(&[share(600, 1000), None]);
    p.hello(9, Peer { pid: 109, compute: share(500, 500), ..peer("late", 1000) });
    let e = p.register(9, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
    assert!(e.contains("GPUFRAC_COMPUTE_REQUEST (50%)") && e.contains("60%"), "{e}");
    p.hello(10, Peer { pid: 110, compute: share(400, 400), ..peer("fits", 1000) });
    p.register(10, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
    // A member must declare its group's share.
    p.hello(11, Peer { pid: 111, compute: share(100, 100), ..peer("g1", 1000) });
    let e = p.register(11, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap_err();
    assert!(e.contains("60%/100%") && e.contains("10%/10%"), "{e}");
}

fn spec(request: u16, limit: u16) -> ComputeSpec {
    share(request, limit).unwrap()
}

/// A simulated GPU driven by the book: groups `busy` (they always have work) or not,
/// each holder using the GPU for its whole lease plus `drain` (its work running past the
/// end), answering `LeaseDone` then. Returns the time each group held over `run`, and
/// the GPU's idle time.
fn simulate(book: &mut LeaseBook, busy: &[(&str, bool)], drain: Duration, run: Duration) -> (Vec<f64>, f64) {
    simulate_late(book, busy, drain, Duration::ZERO, run)
}

/// [`simulate`] with an arbiter that wakes `late` after the time it asked for.
fn simulate_late(
    book: &mut LeaseBook,
    busy: &[(&str, bool)],
    drain: Duration,
    late: Duration,
    run: Duration,
) -> (Vec<f64>, f64) {
    let start = Instant::now();
    let mut now = start;
    let mut held = vec![0.0; busy.len()];
    let mut idle = 0.0;
    for &(g, b) in busy {
        if b {
            book.want(g, now);
        }
    }
    while now < start + run {
        let next = book.step(now);
        match book.holder.clone() {
            Some(h) if h.open => {
                // Open: it runs until the end (nothing else wants).
                let i = busy.iter().position(|&(g, _)| g == h.group).unwrap();
                held[i] += (start + run - now).as_secs_f64();
                break;
            }
            Some(h) => {
                let i = busy.iter().position(|&(g, _)| g == h.group).unwrap();
                let end = h.until + drain;
                held[i] += (end - now).as_secs_f64();
                now = end;
                assert!(book.done(&h.group, h.lease, drain, busy[i].1, now));
            }
            None => {
                let to = next.map_or(start + run, |at| at + late).min(start + run);
                idle += (to - now).as_secs_f64();
                now = to.max(now + Duration::from_micros(10));
            }
        }
    }
    (held, idle)
}

#[test]
fn saturating_groups_hold_the_gpu_by_their_requests_and_the_unrequested_time_alike() {
    let now = Instant::now();
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
    let (held, idle) =
        simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
    let split = held[0] / (held[0] + held[1]);
    assert!((split - 0.3).abs() < 0.01 && idle < 0.01, "{held:?} idle {idle}");
    // Drains are charged: a group whose work runs 5 ms past each lease still gets its
    // request's part of the time, not more.
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
    let (held, _) =
        simulate(&mut book, &[("a", true), ("b", true)], Duration::from_millis(5), Duration::from_secs(10));
    let split = held[0] / (held[0] + held[1]);
    assert!((split - 0.3).abs() < 0.01, "{held:?}");
    // Requests of 10% and 20% leave 70% unrequested: shared 1:2 as well.
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(100, 1000)), ("b".into(), spec(200, 1000))], now);
    let (held, idle) =
        simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
    let split = held[0] / (held[0] + held[1]);
    assert!((split - 1.0 / 3.0).abs() < 0.01 && idle < 0.01, "{held:?} idle {idle}");
}

#[test]
fn a_group_alone_gets_the_open_gpu_or_its_limit_and_never_more() {
    let now = Instant::now();
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(300, 1000)), ("b".into(), spec(700, 1000))], now);
    book.want("a", now);
    book.step(now);
    assert!(matches!(book.grant("a", now), Grant::Open { .. }));
    assert!(book.open());
    // A limit of 50%, alone: half the time, the GPU idle the other half.
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(200, 500))], now);
    let (held, idle) = simulate(&mut book, &[("a", true)], Duration::ZERO, Duration::from_secs(10));
    assert!((held[0] / 10.0 - 0.5).abs() < 0.01 && (idle / 10.0 - 0.5).abs() < 0.01, "{held:?} {idle}");
    // An arbiter that wakes 1.5 ms late for each refill costs the group nothing (the
    // bucket is not full when its lease is due, so what accrues meanwhile is kept).
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(200, 500))], now);
    let late = Duration::from_micros(1500);
    let (held, _) = simulate_late(&mut book, &[("a", true)], Duration::ZERO, late, Duration::from_secs(10));
    assert!((held[0] / 10.0 - 0.5).abs() < 0.005, "{held:?}");
    // Its drains count against the limit too.
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(200, 500))], now);
    let (held, _) = simulate(&mut book, &[("a", true)], Duration::from_millis(3), Duration::from_secs(10));
    assert!((held[0] / 10.0 - 0.5).abs() < 0.02, "{held:?}");
    // Beside a busy neighbour, a limit of 20% with a request of 20% gets 20%, the
    // neighbour the rest.
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(200, 200)), ("b".into(), spec(200, 1000))], now);
    let (held, idle) =
        simulate(&mut book, &[("a", true), ("b", true)], Duration::ZERO, Duration::from_secs(10));
    assert!((held[0] / 10.0 - 0.2).abs() < 0.01 && idle < 0.05, "{held:?} {idle}");
}

/// Groups `a` and `b`, requests of 50%, both wanting the GPU at `now`: `a` holds the first
/// lease (its number and end returned) and `b` waits.
fn a_holds_beside_b(now: Instant) -> (LeaseBook, u32, Instant) {
    let mut book = LeaseBook::default();
    book.sync(&[("a".into(), spec(500, 1000)), ("b".into(), spec(500, 1000))], now);
    book.want("a", now);
    book.want("b", now);
    book.step(now);
    let Grant::Held { lease, until } = book.grant("a", now) else { panic!("{book:?}") };
    (book, lease, until)
}

#[test]
fn a_group_with_nothing_to_run_gives_back_and_the_next_one_goes_at_once() {
    let now = Instant::now();
    let (mut book, lease, until) = a_holds_beside_b(now);
    assert_eq!(until - now, PERIOD / 2);
    assert_eq!(book.grant("b", now), Grant::Wait);
    // a is done after 2 ms with nothing more: b holds at once.
    let t = now + Duration::from_millis(2);
    assert!(book.done("a", lease, Duration::ZERO, false, t));
    assert!(!book.done("a", lease, Duration::ZERO, false, t), "a lease is done once");
    book.step(t);
    // Alone wanting, b's limit is the whole GPU, but a held it just now: a lease (its
    // work in flight bounded), not the open GPU.
    let Grant::Held { lease: b_lease, until } = book.grant("b", t) else { panic!("{book:?}") };
    assert_eq!(until - t, PERIOD);
    // A late answer for an old lease changes nothing.
    assert!(!book.done("b", lease, Duration::ZERO, false, t));
    assert!(matches!(book.grant("b", t), Grant::Held { .. }));
    // Leases while a is quiet; once it has been quiet for OPEN_AFTER_QUIET, open.
    assert!(book.done("b", b_lease, Duration::ZERO, true, until));
    book.step(until);
    assert!(matches!(book.grant("b", until), Grant::Held { .. }));
    let Grant::Held { lease: b_lease, until } = book.grant("b", until) else { unreachable!() };
    let quiet = t + OPEN_AFTER_QUIET;
    assert!(book.done("b", b_lease, Duration::ZERO, true, quiet));
    book.step(quiet);
    assert!(matches!(book.grant("b", quiet), Grant::Open { .. }), "{until:?} {book:?}");
}

#[test]
fn a_group_that_becomes_active_cuts_the_holder_short_but_turn_takers_do_not() {
    let now = Instant::now();
    let mut book = LeaseBook::default();
    book.sync(&[("flood".into(), spec(500, 1000)), ("server".into(), spec(500, 1000))], now);
    book.want("flood", now);
    book.step(now);
    assert!(matches!(book.grant("flood", now), Grant::Open { .. }));
    // The server becomes active 100 ms later: the open GPU becomes leases, and the
    // flood's is cut to end now (it held longer than MIN_HOLD).
    let t = now + Duration::from_millis(100);
    assert!(book.want("server", t));
    assert_eq!(book.grant("flood", t), Grant::Wait, "cut short");
    assert!(book.holds("flood"), "until its work finished");
    assert_eq!(book.step(t), Some(t + DRAIN_GRACE));
    let flood_lease = book.holder.as_ref().unwrap().lease;
    // Its drain done 3 ms later, the server holds: within one period of its want.
    let t2 = t + Duration::from_millis(3);
    assert!(book.done("flood", flood_lease, Duration::ZERO, true, t2));
    book.step(t2);
    assert!(matches!(book.grant("server", t2), Grant::Held { .. }));
    // The flood, wanting again at once, does not cut the server.
    assert!(!book.want("flood", t2));
    // A holder that never answers loses the lease after its end and the grace.
    let Grant::Held { until, .. } = book.grant("server", t2) else { panic!() };
    assert_eq!(book.grant("server", until), Grant::Wait);
    let t3 = until + DRAIN_GRACE;
    book.step(t3);
    assert!(!book.holds("server"));
    // The flood alone wants it, but the server was just here: a lease, not the open GPU.
    assert!(matches!(book.grant("flood", t3), Grant::Held { .. }), "{book:?}");
}

#[test]
fn a_group_back_from_giving_its_lease_back_cuts_a_flood_while_it_used_less_than_its_request() {
    let now = Instant::now();
    let mut book = LeaseBook::default();
    book.sync(&[("flood".into(), spec(500, 1000)), ("server".into(), spec(500, 1000))], now);
    book.want("flood", now);
    // Requests about every 10 ms, each holding 3 ms (every fifth 15 ms: requests queued
    // behind each other), given back: the flood wants always.
    let mut t = now;
    for round in 0..50 {
        book.step(t);
        if let Some(h) = book.holder.clone().filter(|h| h.group == "flood") {
            // The flood holds; the server wants 5 ms into its turn.
            let at = t + Duration::from_millis(5);
            book.want("server", at);
            let Grant::Held { until, .. } = book.grant("flood", h.since) else { panic!("{book:?}") };
            let cut = book.holder.as_ref().unwrap().until;
            assert!(cut <= at + MIN_HOLD, "round {round}: the flood's lease to {until:?} was not cut");
            t = cut + Duration::from_millis(2);
            assert!(book.done("flood", h.lease, Duration::from_millis(2), true, t));
            book.step(t);
        }
        let Grant::Held { lease, .. } = book.grant("server", t) else { panic!("round {round}: {book:?}") };
        t += Duration::from_millis(if round % 5 == 4 { 15 } else { 3 });
        assert!(book.done("server", lease, Duration::ZERO, false, t));
    }
    // A burst of the server's requests, more than one lease serves, after it used less
    // than its request: it is owed, so it holds lease after lease while its queue lasts,
    // up to OWED_LEASES of them, not taking turns with the flood's 20 ms leases.
    book.step(t);
    let h = book.holder.clone().unwrap();
    assert_eq!(h.group, "flood");
    assert!(book.want("server", t + Duration::from_millis(5)), "owed: the flood is cut");
    t += Duration::from_millis(7);
    assert!(book.done("flood", h.lease, Duration::from_millis(2), true, t));
    let burst_start = t;
    let mut server_leases = 0;
    loop {
        book.step(t);
        let Grant::Held { lease, until } = book.grant("server", t) else { break };
        assert_eq!(until - t, PERIOD / 2, "the server's planned lease");
        server_leases += 1;
        t = until;
        assert!(book.done("server", lease, Duration::ZERO, true, t));
    }
    let owed = PERIOD.mul_f64(OWED_LEASES / 2.0);
    // A burst of 50 ms, two and a half of its leases, is served in a row.
    assert!(t - burst_start >= Duration::from_millis(50), "served in a row for {:?}", t - burst_start);
    assert!(t - burst_start <= owed + PERIOD / 2, "and no longer than it was owed: {:?}", t - burst_start);
    // Past what it was owed it takes turns by its request: the flood's whole lease, then
    // its own.
    let Grant::Held { lease, until } = book.grant("flood", t) else { panic!("{book:?}") };
    assert_eq!(until - t, PERIOD / 2, "after {server_leases} of the server's leases");
    assert!(book.done("flood", lease, Duration::ZERO, true, until));
    t = until;
    book.step(t);
    let Grant::Held { lease, until } = book.grant("server", t) else { panic!("{book:?}") };
    // It runs 10 ms past its lease's end and has nothing more; it wants again 1 ms into
    // the flood's next lease. Having held 10 ms more than its request's part since it was
    // owed nothing, it waits until the flood's running pass reaches its own: the flood's
    // lease is cut 10 ms in, not at once.
    t = until + Duration::from_millis(10);
    assert!(book.done("server", lease, Duration::from_millis(10), false, t));
    book.step(t);
    assert!(book.holds("flood"));
    let t2 = t + Duration::from_millis(1);
    assert!(book.want("server", t2), "its turn comes within the flood's lease");
    let cut = book.holder.as_ref().unwrap().until - t;
    assert!(
        cut >= Duration::from_millis(9) && cut <= Duration::from_millis(11),
        "the flood's lease is cut when its running pass reaches the server's: {cut:?}"
    );
}

#[test]
fn a_lease_is_charged_its_length_and_its_drain_not_a_late_answer() {
    let now = Instant::now();
    let (mut book, lease, until) = a_holds_beside_b(now);
    let before = book.groups["a"].pass;
    // Its drain took 2 ms; its answer arrived 10 ms after the end.
    assert!(book.done("a", lease, Duration::from_millis(2), true, until + Duration::from_millis(10)));
    let charged = (book.groups["a"].pass - before) * 0.5;
    let expected = (until - now + Duration::from_millis(2)).as_secs_f64();
    assert!((charged - expected).abs() < 1e-9, "charged {charged} s, expected {expected} s");
}

#[test]
fn members_are_told_once_per_change_and_a_group_is_done_when_all_its_members_are() {
    let mut p = gpu_with(&[share(300, 1000), share(700, 1000), None]);
    // A second member of g1.
    p.hello(4, Peer { pid: 104, compute: share(300, 1000), ..peer("g1", 1000) });
    p.register(4, GPU, 16 * GIB, GIB, GIB, 0, 0, 0).unwrap();
    let now = Instant::now();
    let (orders, _) = p.compute_step(now);
    // Everyone with a share is told to wait; the process without one is told nothing.
    let mut told: Vec<ConnId> = orders.iter().map(|o| o.0).collect();
    told.sort();
    assert_eq!(told, vec![1, 2, 4]);
    assert!(orders.iter().all(|o| o.2 == LeaseState::Wait));
    assert!(p.compute_step(now).0.is_empty(), "nothing changed");
    p.compute_want(1, GPU, now);
    p.compute_want(2, GPU, now);
    let (orders, next) = p.compute_step(now);
    let held: Vec<_> = orders.iter().filter(|o| matches!(o.2, LeaseState::Held { .. })).collect();
    assert_eq!(held.len(), 2, "both members of g1 (lowest pass, first by name): {orders:?}");
    let LeaseState::Held { lease, micros } = held[0].2 else { unreachable!() };
    assert_eq!(micros as u128, (PERIOD * 3 / 10).as_micros());
    assert_eq!(next, Some(now + PERIOD * 3 / 10));
    let t = now + Duration::from_millis(12);
    p.compute_done(1, GPU, lease, 2000, false, t);
    assert!(p.gpus[&GPU].leases.holds("g1"), "one member done, the other not yet");
    p.compute_done(4, GPU, lease, 500, false, t);
    assert!(!p.gpus[&GPU].leases.holds("g1"));
    let (orders, _) = p.compute_step(t);
    // g2 alone wants, its limit the whole GPU; g1 held it just now: a lease for g2;
    // g1's members told to wait.
    let g2_lease = orders.iter().find_map(|o| match o {
        (2, _, LeaseState::Held { lease, .. }) => Some(*lease),
        _ => None,
    });
    assert!(g2_lease.is_some(), "{orders:?}");
    assert!(orders.contains(&(1, GPU, LeaseState::Wait)) && orders.contains(&(4, GPU, LeaseState::Wait)));
    assert_eq!(p.status().gpus[0].processes.iter().find(|p| p.pid == 102).unwrap().compute_state, "holding");
    // g1 quiet for OPEN_AFTER_QUIET: g2's next turn is the open GPU.
    let quiet = t + OPEN_AFTER_QUIET;
    p.compute_done(2, GPU, g2_lease.unwrap(), 0, true, quiet);
    let (orders, _) = p.compute_step(quiet);
    assert!(orders.iter().any(|o| o.0 == 2 && matches!(o.2, LeaseState::Open { .. })), "{orders:?}");
    let s = p.status();
    let g2 = s.gpus[0].processes.iter().find(|p| p.pid == 102).unwrap();
    assert_eq!(g2.compute_state, "open");
    let g1 = s.gpus[0].processes.iter().find(|p| p.pid == 101).unwrap();
    assert_eq!(g1.compute_state, "idle");
    assert!(g1.compute_held_pm > 0, "it held 12 ms of the last second");
}
