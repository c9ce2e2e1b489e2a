//! The shared machine across real processes: accounting, out-of-memory at the physical
//! size, and release of a killed process's memory with no lock left held.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use simgpu_state::Machine;

const MIB: u64 = 1 << 20;

/// When run as a child: attach, charge the given MiB on device 0, say so, and wait.
fn child_main() -> bool {
    let Ok(mib) = std::env::var("SIMGPU_TEST_CHILD_MIB") else { return false };
    let path = std::env::var("SIMGPU_TEST_STATE").expect("state path");
    let machine = Machine::open(&path, &[1024 * MIB]).expect("open");
    let slot = machine.attach().expect("attach");
    let mib: u64 = mib.parse().expect("MiB");
    slot.charge(0, mib * MIB).expect("charge");
    println!("READY");
    std::thread::sleep(std::time::Duration::from_secs(60));
    true
}

fn temp_state(name: &str) -> String {
    let path = std::env::temp_dir().join(format!("simgpu-state-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path.to_string_lossy().into_owned()
}

fn spawn_holder(state: &str, mib: u64) -> std::process::Child {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("SIMGPU_TEST_CHILD_MIB", mib.to_string())
        .env("SIMGPU_TEST_STATE", state)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let out = child.stdout.take().expect("stdout");
    let ready = BufReader::new(out).lines().map_while(Result::ok).any(|l| l.contains("READY"));
    assert!(ready, "child never became ready");
    child
}

#[test]
fn child_entry() {
    // Only does something when spawned as a child by the tests below.
    child_main();
}

#[test]
fn processes_share_devices_and_killed_processes_release_memory() {
    let state = temp_state("kill");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    let me = machine.attach().expect("attach");
    let mut child = spawn_holder(&state, 700);
    assert_eq!(machine.used(0), 700 * MIB);
    assert_eq!(machine.processes(0).len(), 1);
    // The device has 324 MiB left for us, not more.
    assert!(me.charge(0, 400 * MIB).is_err());
    me.charge(0, 300 * MIB).expect("what is left fits");
    me.release(0, 300 * MIB);

    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    // The dead process's memory comes back, and no lock was left held: this returns.
    me.charge(0, 1000 * MIB).expect("memory of the killed process is free again");
    assert_eq!(machine.used(0), 1000 * MIB);
    assert!(machine.processes(0).iter().all(|p| p.pid == std::process::id()));
    drop(me);
    assert_eq!(machine.used(0), 0);
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn charges_made_at_once_never_pass_the_device_and_all_come_back() {
    let state = temp_state("race");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    // Slots in one process stand for processes; a charge takes no lock, so threads
    // charging at once are what the device's bound must hold against.
    let slots: Vec<_> = (0..4).map(|_| machine.attach().expect("attach")).collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = std::sync::Barrier::new(slots.len());
    let (fitted, refused) = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut looks = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                assert!(machine.used(0) <= 1024 * MIB, "the device held more than its size");
                looks += 1;
            }
            looks
        });
        let workers: Vec<_> = slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let (mut fitted, mut refused) = (0u32, 0u32);
                    let mut seed = 0x9e37_79b9_u64 + i as u64;
                    // Each keeps its last three charges: together they want up to 3 GiB.
                    let mut held = std::collections::VecDeque::new();
                    for _ in 0..20_000 {
                        if held.len() == 3 {
                            slot.release(0, held.pop_front().expect("held"));
                        }
                        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        let bytes = (seed >> 33) % (256 * MIB) + 1;
                        if slot.charge(0, bytes).is_ok() {
                            fitted += 1;
                            held.push_back(bytes);
                        } else {
                            refused += 1;
                        }
                        std::thread::yield_now();
                    }
                    held.into_iter().for_each(|bytes| slot.release(0, bytes));
                    (fitted, refused)
                })
            })
            .collect();
        let totals = workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(watcher.join().expect("watcher") > 0);
        totals
    });
    assert!(
        fitted > 0 && refused > 0,
        "the charges should have collided: {fitted} fitted, {refused} refused"
    );
    assert_eq!(machine.used(0), 0);
    // Nothing was lost on the way: the whole device fits again.
    slots[0].charge(0, 1024 * MIB).expect("every charge came back");
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn killed_zombie_releases_memory_before_it_is_reaped() {
    let state = temp_state("zombie");
    let machine = Machine::open(&state, &[1024 * MIB]).expect("open");
    let mut child = spawn_holder(&state, 512);
    assert_eq!(machine.used(0), 512 * MIB);
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    // Not reaped yet: the kernel has closed its files, so its lock bytes are free.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while machine.used(0) != 0 {
        assert!(std::time::Instant::now() < deadline, "a killed process kept its memory");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.wait().expect("reap");
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn new_settings_apply_only_when_nobody_uses_the_machine() {
    let state = temp_state("settings");
    let first = Machine::open(&state, &[1024 * MIB, 2048 * MIB]).expect("open");
    let slot = first.attach().expect("attach");
    let second = Machine::open(&state, &[64 * MIB]).expect("join");
    assert_eq!(second.device_count(), 2, "a machine in use keeps its devices");
    assert_eq!(second.total(1), 2048 * MIB);
    drop(slot);
    let third = Machine::open(&state, &[64 * MIB]).expect("reopen");
    assert_eq!(third.device_count(), 1);
    assert_eq!(third.total(0), 64 * MIB);
    let _ = simgpu_state::remove_state(&state);
}

#[test]
fn bad_device_lists_are_refused_by_name() {
    for bad in [
        "",
        "16GiB,",
        "0.5",
        "abc",
        "1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB,1GiB",
    ] {
        let err = simgpu_state::parse_device_list(bad).expect_err(bad).to_string();
        assert!(err.contains("SIMGPU_DEVICES"), "{err}");
    }
    assert_eq!(simgpu_state::parse_device_list("1GiB,2GiB").expect("valid"), vec![1024 * MIB, 2048 * MIB]);
}
