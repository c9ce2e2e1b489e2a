//! The lease's unit tests.

use super::streams::{Slot, IN_FLIGHT_NS, RING};
use super::*;

#[test]
fn a_leased_process_passes_only_while_it_holds_and_a_waiting_call_wants() {
    let _turn = crate::control::gate::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
    crate::control::gate::register_lease(super::at_the_gate());
    let device = [7; 16];
    {
        let mut leases = lock(&LEASES);
        leases.devices.push((device, Local::Wait { wanted: None }));
        publish(&leases);
    }
    assert!(!PASS.load(SeqCst));
    let passed = Arc::new(AtomicBool::new(false));
    let caller = {
        let passed = passed.clone();
        std::thread::spawn(move || {
            let (_, inside) = wait_for_lease(std::ptr::null_mut());
            passed.store(inside, SeqCst);
        })
    };
    // Polled, not slept: on a loaded machine the caller may take a while to start, and a
    // failed assertion here would leave the lease table to hang the next test.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !WANT.load(SeqCst) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!passed.load(SeqCst), "a call passed without a lease");
    assert!(WANT.load(SeqCst), "the waiting call wants the GPU");
    told(device, LeaseState::Held { lease: 1, micros: 50_000 });
    caller.join().unwrap();
    assert!(passed.load(SeqCst), "the call passed, counted inside the lease");
    // Counted inside until it returns: the lease's drain waits for it.
    assert_eq!(IN_LEASE.load(SeqCst), 1);
    left_lease();
    // After the lease's end a call waits again, whatever the thread did.
    std::thread::sleep(Duration::from_millis(60));
    assert!(monotonic_ns() >= UNTIL_NS.load(SeqCst));
    told(device, LeaseState::Open { lease: 2 });
    assert!(wait_for_lease(std::ptr::null_mut()).1);
    left_lease();
    assert_eq!(IN_LEASE.load(SeqCst), 0, "a call waiting for a lease is not counted inside it");
    forget();
    assert!(PASS.load(SeqCst));
    lock(&LEASES).devices.clear();
}

#[test]
fn a_call_waits_while_its_process_has_more_than_the_bound_in_flight_but_two_always_go() {
    let _turn = crate::control::gate::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
    crate::control::gate::register_lease(super::at_the_gate());
    let (a, b) = (&SLOTS[0], &SLOTS[1]);
    // Rings "made" (a dangling handle: nothing records with EVENT_RECORD unset).
    for slot in [a, b] {
        slot.events[0].store(std::ptr::NonNull::<c_void>::dangling().as_ptr(), SeqCst);
        slot.reset();
    }
    let set = |slot: &Slot, calls: u64, done: u64, cost_ns: u64| {
        slot.calls.store(calls, SeqCst);
        slot.marked.store(calls, SeqCst);
        slot.done.store(done, SeqCst);
        slot.cost_ns.store(cost_ns, SeqCst);
    };
    // Calls of half the bound: two in flight go, a third waits.
    let half = IN_FLIGHT_NS / 2;
    set(a, 1, 0, half);
    assert!(!over_bound(0));
    set(a, 2, 0, half);
    assert!(over_bound(0));
    // 100 µs calls: up to the bound's worth.
    let fit = IN_FLIGHT_NS / 100_000;
    set(a, fit - 1, 0, 100_000);
    assert!(!over_bound(0));
    set(a, fit, 0, 100_000);
    assert!(over_bound(0));
    // 10 ms calls: still two, so the stream never idles for a wake-up.
    set(a, 1, 0, 10_000_000);
    assert!(!over_bound(0));
    // Another stream's marked work counts toward the process's bound.
    set(a, 2, 0, 100_000);
    set(b, 2, 0, half);
    assert!(over_bound(0));
    set(b, 2, 2, half);
    assert!(!over_bound(0));
    // Nothing known about the cost: only a full ring holds.
    set(a, 10, 0, 0);
    assert!(!over_bound(0));
    a.recorded.store(RING as u64 - 1, SeqCst);
    assert!(over_bound(0));
    for slot in [a, b] {
        slot.events[0].store(std::ptr::null_mut(), SeqCst);
        slot.reset();
    }
}

#[test]
fn the_stream_of_a_launch_config_is_read_at_its_offset() {
    #[repr(C)]
    struct Config {
        dims: [u32; 7],
        stream: *mut c_void,
        attrs: *mut c_void,
        count: u32,
    }
    let config =
        Config { dims: [1; 7], stream: 0x1234 as *mut c_void, attrs: std::ptr::null_mut(), count: 0 };
    assert_eq!(config_stream((&config as *const Config).cast()), 0x1234 as *mut c_void);
    assert_eq!(per_thread(std::ptr::null_mut()), PER_THREAD as *mut c_void);
}
