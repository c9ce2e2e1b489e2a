//! The time-slice scheduler with two "processes" in one test: two mappings of the same
//! state file, each with its own slot (record locks belong to the open file, so the two
//! slots are as separate as two processes'). Real processes are in the end-to-end tests
//! (tests/tests/simgpu_timeslice.rs).

use std::time::{Duration, Instant};

use simgpu_state::Machine;

fn temp_state(name: &str) -> String {
    let path = std::env::temp_dir().join(format!("simgpu-sched-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path.to_string_lossy().into_owned()
}

#[test]
fn two_processes_flooding_a_device_take_turns_and_each_gets_half() {
    let state = temp_state("half");
    let (m1, m2) =
        (Machine::open(&state, &[1 << 30]).expect("open"), Machine::open(&state, &[1 << 30]).expect("open"));
    let (s1, s2) = (m1.attach().expect("attach"), m2.attach().expect("attach"));
    let (p1, p2) = (s1.scheduler(Duration::from_millis(2)), s2.scheduler(Duration::from_millis(2)));
    // Each floods the same device time (160 kernels of 0.5 ms): half each by construction,
    // so what is judged is the order they got it in, not how a busy host's CPUs scheduled
    // the two threads (a wall-clock window gave 1:2 beside two busy loops).
    const KERNELS: usize = 160;
    let start = Instant::now();
    let done: std::sync::Mutex<Vec<(Instant, usize)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for (who, sched) in [&p1, &p2].into_iter().enumerate() {
            let done = &done;
            scope.spawn(move || {
                sched.claim(0);
                for _ in 0..KERNELS {
                    sched.run_for(0, Duration::from_micros(500));
                    done.lock().unwrap().push((Instant::now(), who));
                }
                sched.unclaim(0);
            });
        }
    });
    let wall = start.elapsed().as_nanos() as f64;
    // Both "processes" have this PID: add up the device time by slot instead.
    let busy: Vec<u64> = m1.process_busy_ns(0).iter().map(|(_, ns)| *ns).collect();
    assert_eq!(busy.len(), 2, "{busy:?}");
    let total: u64 = busy.iter().sum();
    // The device runs one at a time: never more device time than wall time.
    assert!(total as f64 <= wall * 1.005, "busy {total} ns in {wall} ns of wall time");
    for ns in &busy {
        let share = *ns as f64 / total as f64;
        assert!((0.45..=0.55).contains(&share), "shares {busy:?}");
    }
    // They took turns while both had work: a device that ran one to the end, then the
    // other, would switch once. 2 ms slices of 80 ms each switch dozens of times.
    let mut done = done.into_inner().unwrap();
    done.sort();
    let first_finished = done.iter().rposition(|&(_, who)| who != done.last().unwrap().1).unwrap();
    let switches = done[..=first_finished].windows(2).filter(|w| w[0].1 != w[1].1).count();
    assert!(switches >= 3, "the device switched {switches} times while both had work");
    assert_eq!(m1.busy_ns(0), total);
    // Nobody owns the device once both are done.
    assert_eq!(m1.device_owner(0), None);
    // The samples cover it: one process (one PID here) had the device while it was busy.
    let samples = m2.process_utilization(0, 0);
    assert_eq!(samples.len(), 1, "{samples:?}");
    let later = m2.process_utilization(0, samples[0].timestamp_us);
    assert!(later.is_empty(), "nothing ran since: {later:?}");
    let _ = std::fs::remove_file(&state);
}

#[test]
fn the_owner_keeps_the_device_within_its_slice_and_a_cpu_kernel_waits() {
    let state = temp_state("slice");
    let (m1, m2) =
        (Machine::open(&state, &[1 << 30]).expect("open"), Machine::open(&state, &[1 << 30]).expect("open"));
    let (s1, s2) = (m1.attach().expect("attach"), m2.attach().expect("attach"));
    let (p1, p2) = (s1.scheduler(Duration::from_secs(10)), s2.scheduler(Duration::from_secs(10)));
    std::thread::scope(|scope| {
        let owner = scope.spawn(|| p1.run_for(0, Duration::from_millis(300)));
        let deadline = Instant::now() + Duration::from_secs(5);
        while m1.device_owner(0).is_none() {
            assert!(Instant::now() < deadline, "nobody took the device");
            std::thread::sleep(Duration::from_millis(1));
        }
        let asked = Instant::now();
        let waited = p2.run(0, || asked.elapsed());
        owner.join().expect("owner");
        assert!(
            waited >= Duration::from_millis(200),
            "the CPU kernel ran after {waited:?}, within the owner's slice"
        );
    });
}

#[test]
fn a_process_sliced_out_has_its_kernels_pending_all_the_time_it_waits() {
    let state = temp_state("pending");
    let (m1, m2) =
        (Machine::open(&state, &[1 << 30]).expect("open"), Machine::open(&state, &[1 << 30]).expect("open"));
    let (s1, s2) = (m1.attach().expect("attach"), m2.attach().expect("attach"));
    let (p1, p2) = (s1.scheduler(Duration::from_millis(2)), s2.scheduler(Duration::from_millis(2)));
    let start = Instant::now();
    let run = Duration::from_millis(400);
    std::thread::scope(|scope| {
        for sched in [&p1, &p2] {
            scope.spawn(move || {
                sched.claim(0);
                while start.elapsed() < run {
                    sched.run_for(0, Duration::from_micros(500));
                }
                sched.unclaim(0);
            });
        }
    });
    let wall = start.elapsed().as_nanos() as f64;
    // By slot (both "processes" have this PID), in slot order for both lists.
    let busy: Vec<u64> = m1.process_busy_ns(0).iter().map(|(_, ns)| *ns).collect();
    let pending: Vec<u64> = m1.process_pending_ns(0).iter().map(|(_, ns)| *ns).collect();
    assert_eq!((busy.len(), pending.len()), (2, 2), "busy {busy:?}, pending {pending:?}");
    for (b, p) in busy.iter().zip(&pending) {
        // Each had about half of the device's time, and kernels pending nearly all of it:
        // the waiting half too.
        assert!((*b as f64) < wall * 0.6, "busy {busy:?} in {wall} ns");
        assert!(*p as f64 >= wall * 0.9, "pending {pending:?} in {wall} ns (busy {busy:?})");
        assert!(*p as f64 <= wall * 1.005, "pending {pending:?} in {wall} ns");
    }
    // Nothing pending any more: the marks stopped with the last unclaim.
    std::thread::sleep(Duration::from_millis(50));
    let later: Vec<u64> = m1.process_pending_ns(0).iter().map(|(_, ns)| *ns).collect();
    assert_eq!(later, pending, "pending time went on after the work ended");
    let _ = std::fs::remove_file(&state);
}
