//! The swap resolver with real processes on simgpu: a burst is served by swapping a
//! sleeping holder's burst memory to host RAM; the holder's data (written by copies and
//! by a queued async kernel) comes back bit for bit at the same addresses; a holder
//! blocked on a copy while swapped out resumes when memory frees; an arbiter killed in
//! the middle loses nothing, and without an arbiter a swapped process comes back on its
//! own when the device has room; the host-RAM cap is honoured; three servers playing
//! ping-pong with one GPU's room, swapped out and in many times, lose no byte.

use std::time::{Duration, Instant};

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, log_field, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess,
    ShimSettings, SimGpu, TIMEOUT,
};

const BURST: u64 = 256 * MIB;
const BURSTS: u64 = 4;
/// Why the swap tests need simgpu.
const KERNELS: &str =
    "simgpu_probe hold-bursts fills memory with simgpu's built-in kernels, and the bursts collide on its 4 GiB device";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `program` under the shim in `group`: 1 GiB request, 3 GiB limit, the swap resolver,
/// waiting up to `wait`.
fn swapper(
    gpu: &SimGpu,
    program: impl AsRef<std::ffi::OsStr>,
    arbiter: &Arbiter,
    group: &str,
    wait: &str,
) -> std::process::Command {
    let mut cmd = gpu.shimmed(program);
    cmd.memory_request("1GiB")
        .memory_limit("3GiB")
        .resolver("swap")
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout(wait)
        .log("info");
    cmd
}

/// A: its request held by a plain allocation, then 1 GiB of bursts (VMM-backed).
fn holder(gpu: &SimGpu, arbiter: &Arbiter, group: &str) -> (ChildProcess, String) {
    holder_waiting(gpu, arbiter, group, "30s")
}

/// `holder` with its `GPUFRAC_WAIT_TIMEOUT`.
fn holder_waiting(gpu: &SimGpu, arbiter: &Arbiter, group: &str, wait: &str) -> (ChildProcess, String) {
    let mut cmd = swapper(gpu, env!("CARGO_BIN_EXE_simgpu_probe"), arbiter, group, wait);
    cmd.args(["hold-bursts", &GIB.to_string(), &BURST.to_string(), &BURSTS.to_string()]);
    let mut a = ChildProcess::spawn(&mut cmd);
    let ptrs = a.expect_line(&["PTRS"], TIMEOUT);
    a.ready();
    (a, ptrs)
}

/// B: allocates 2.5 GiB in 32 MiB steps; its burst only fits if A's is swapped out.
fn requester(gpu: &SimGpu, arbiter: &Arbiter, group: &str, wait: &str) -> ChildProcess {
    let mut cmd = swapper(gpu, compile_c("alloc_paths.c", &["MODE_DLSYM"], false), arbiter, group, wait);
    cmd.args(["alloc", &(32 * MIB).to_string(), &(2560 * MIB).to_string()]);
    ChildProcess::spawn(&mut cmd)
}

fn process<'a>(
    s: &'a gpufrac_daemon::status::Status,
    group: &str,
) -> Option<&'a gpufrac_daemon::status::ProcessStatus> {
    s.gpus[0].processes.iter().find(|p| p.group == group)
}

fn state(s: &gpufrac_daemon::status::Status, group: &str) -> String {
    process(s, group).map_or_else(|| "gone".into(), |p| p.state.clone())
}

fn check_intact(a: &mut ChildProcess) {
    a.write_stdin("check\n");
    let verdict = a.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    assert_eq!(verdict, format!("INTACT {}", BURST * BURSTS), "the holder's data after swapping back in");
}

#[test]
fn swap_serves_a_burst_while_the_holder_sleeps_and_gives_its_data_back_untouched() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    // The arbiter picks the port and says which.
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("s.sock"),
        &["--swap-quantum", "3s", "--metrics", "127.0.0.1:0"],
    );
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, ptrs) = holder(&gpu, &arbiter, &ga);
    // A has held its burst for a quantum; it sleeps (reads stdin) from here on.
    std::thread::sleep(Duration::from_millis(3100));
    let started = Instant::now();
    let mut b = requester(&gpu, &arbiter, &gb, "30s");
    let rb = b.ready();
    assert_eq!(rb[0], 2560 * MIB, "B got its whole burst ({})", mib(rb[0]));
    assert!(started.elapsed() < Duration::from_secs(10), "served within seconds: {:?}", started.elapsed());
    // B may be served before A's last report: status shows the swap-out as it goes.
    wait_for(&arbiter, "A's swap-out answered", |s| {
        process(s, &ga).is_some_and(|p| p.host_bytes >= BURST * BURSTS)
    });
    let s = status(&arbiter);
    let pa = process(&s, &ga).expect("A registered");
    assert_eq!((pa.state.as_str(), pa.host_bytes), ("swapped", BURST * BURSTS), "{s:?}");
    assert_eq!(s.gpus[0].swapped, BURST * BURSTS);
    let table = std::process::Command::new(artifact("gpufrac"))
        .arg("status")
        .arg("--socket")
        .arg(arbiter.socket())
        .output()
        .expect("gpufrac status");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("host RAM for swapped-out memory: 1.00GiB of") && table.contains("swapped"),
        "{table}"
    );

    // A copy while swapped out waits at the gate and asks to come back; B keeps the
    // memory for its quantum, unless it exits first and memory frees.
    a.write_stdin("copy\n");
    assert!(a.silent_for(Duration::from_millis(300)), "a swapped-out process must not copy");
    b.close_stdin();
    b.finish();
    a.expect_line(&["COPIED"], TIMEOUT);
    let s = wait_for(&arbiter, "A back in", |s| state(s, &ga) == "running");
    let pa = process(&s, &ga).unwrap();
    assert!(pa.swapped_ms >= 300, "time swapped out is shown: {pa:?}");
    assert_eq!(pa.host_bytes, 0);
    check_intact(&mut a);
    a.write_stdin("free\n");
    a.expect_line(&["FREED"], TIMEOUT);
    assert!(ptrs.starts_with("PTRS 0x"), "{ptrs}");
    a.close_stdin();
    a.finish();
    let log = arbiter.log_text();
    assert!(log.contains("swapped out") && log.contains("swapped in"), "{log}");
    let body = arbiter.metrics();
    // At least A's swap out and in (B may have taken a turn too if it outlived its quantum).
    for direction in ["out", "in"] {
        let labels = format!("{{gpu=\"{}\",direction=\"{direction}\"}} ", s.gpus[0].uuid);
        let value = |name: &str| -> u64 {
            let key = format!("{name}{labels}");
            body.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
        };
        assert!(value("gpufrac_swaps_total") >= 1, "{direction}:\n{body}");
        assert!(value("gpufrac_swap_bytes_total") >= BURST * BURSTS, "{direction}:\n{body}");
    }
    assert!(body.contains("gpufrac_swap_seconds_bucket{"), "{body}");
}

/// A swapped-out process that allocates waits for its swap-in before it asks for the
/// burst: however long the swap-in waits its turn, its `GPUFRAC_WAIT_TIMEOUT` (1 s here)
/// counts from when it is back. (Asked while swapped out, the arbiter held the step back
/// until the swap-in, and the allocation failed out-of-memory at 1 s.)
#[test]
fn a_swapped_out_process_that_allocates_waits_for_its_swap_in_not_its_wait_timeout() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("sa.sock"), &["--swap-quantum", "3s"]);
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, _) = holder_waiting(&gpu, &arbiter, &ga, "1s");
    std::thread::sleep(Duration::from_millis(3100));
    let mut b = requester(&gpu, &arbiter, &gb, "30s");
    b.ready();
    wait_for(&arbiter, "A swapped out", |s| process(s, &ga).is_some_and(|p| p.host_bytes >= BURST * BURSTS));
    // A's swap-in cannot fit beside B's burst, which B holds past A's 1 s timeout.
    a.write_stdin(&format!("alloc {}\n", 64 * MIB));
    std::thread::sleep(Duration::from_millis(1500));
    b.close_stdin();
    b.finish();
    let answer = a.expect_line(&["ALLOCATED", "NOT_ALLOCATED"], TIMEOUT);
    assert!(answer.starts_with("ALLOCATED "), "A's allocation while swapped out: {answer}");
    wait_for(&arbiter, "A back in", |s| state(s, &ga) == "running");
    check_intact(&mut a);
    a.write_stdin("free\n");
    a.expect_line(&["FREED"], TIMEOUT);
    a.close_stdin();
    a.finish();
}

/// An allocation made while the process's swap-in is under way is not taken out of the
/// swap-in's grant: it asks for its own. (The grant was counted before the swap-in had
/// mapped it, and an allocation in that window fitted under it: the process then held
/// more than the arbiter had lent it, and on a full device that allocation found no
/// memory for its whole `GPUFRAC_WAIT_TIMEOUT`.) The holder keeps 1.75 GiB of bursts in
/// 64 MiB allocations, so that its swap-in maps them one after another for a while.
#[test]
fn an_allocation_during_a_swap_in_does_not_take_the_swap_ins_memory() {
    skip_on_real_gpu!(KERNELS);
    const SMALL: u64 = 64 * MIB;
    const COUNT: u64 = 28;
    let gpu = gpu();
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("si.sock"), &["--swap-quantum", "0s"]);
    let (ga, gb) = (unique("holder"), unique("burst"));
    let mut cmd = swapper(&gpu, env!("CARGO_BIN_EXE_simgpu_probe"), &arbiter, &ga, "30s");
    cmd.args(["hold-bursts", &GIB.to_string(), &SMALL.to_string(), &COUNT.to_string()]);
    let mut a = ChildProcess::spawn(&mut cmd);
    a.expect_line(&["PTRS"], TIMEOUT);
    a.ready();
    let mut b = requester(&gpu, &arbiter, &gb, "30s");
    b.ready();
    wait_for(&arbiter, "A swapped out", |s| process(s, &ga).is_some_and(|p| p.host_bytes >= SMALL * COUNT));
    let swapped_out = gpu.held_by(a.pid(), 0);
    // B leaves: A is offered its memory back. A allocates once the device shows its
    // swap-in mapping.
    b.close_stdin();
    b.finish();
    let started = Instant::now();
    while gpu.held_by(a.pid(), 0) == swapped_out && started.elapsed() < TIMEOUT {
        std::thread::sleep(Duration::from_millis(2));
    }
    a.write_stdin(&format!("alloc {}\n", 64 * MIB));
    let answer = a.expect_line(&["ALLOCATED", "NOT_ALLOCATED"], TIMEOUT);
    assert!(answer.starts_with("ALLOCATED "), "A's allocation during its swap-in: {answer}");
    let s = wait_for(&arbiter, "A back in", |s| state(s, &ga) == "running");
    let pa = process(&s, &ga).unwrap();
    let lent = pa.request + pa.granted;
    let on_device = gpu.held_by(a.pid(), 0);
    assert!(
        on_device <= lent,
        "A holds {} on the device, more than the {} it was lent (request and grants): {pa:?}",
        mib(on_device),
        mib(lent)
    );
    a.write_stdin("check\n");
    assert_eq!(a.expect_line(&["INTACT", "CORRUPT"], TIMEOUT), format!("INTACT {}", SMALL * COUNT));
    a.close_stdin();
    a.finish();
}

#[test]
fn an_arbiter_killed_in_the_middle_of_a_swap_loses_nothing() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    let socket = gpu.lib_dir().join("k.sock");
    let args = ["--swap-quantum", "0s"];
    let mut arbiter = Arbiter::start_at(&gpu, socket.clone(), &args);
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, _) = holder(&gpu, &arbiter, &ga);
    let mut b = requester(&gpu, &arbiter, &gb, "60s");
    // The moment A is chosen (its swap-out under way or just done), the arbiter dies.
    wait_for(&arbiter, "A chosen to swap out", |s| state(s, &ga) == "swapped");
    arbiter.kill();
    let arbiter = Arbiter::start_at(&gpu, socket, &args);
    assert_eq!(b.ready()[0], 2560 * MIB, "B's burst is served by the restarted arbiter");
    // ("swapped" is shown from the moment it is asked; its host copy once it answers.)
    wait_for(&arbiter, "A swapped out, its host copy known", |s| {
        state(s, &ga) == "swapped" && process(s, &ga).is_some_and(|p| p.host_bytes == BURST * BURSTS)
    });
    // B leaves: memory is free, A is told it may come back, and does without any call.
    b.close_stdin();
    b.finish();
    wait_for(&arbiter, "A back in", |s| state(s, &ga) == "running");
    check_intact(&mut a);
    a.close_stdin();
    a.finish();
}

#[test]
fn the_host_ram_cap_is_honoured_and_the_burst_waits_instead() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("c.sock"),
        &["--swap-quantum", "0s", "--swap-limit", "512MiB"],
    );
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, _) = holder(&gpu, &arbiter, &ga);
    let mut b = requester(&gpu, &arbiter, &gb, "1s");
    let rb = b.ready();
    assert!(rb[0] < 2560 * MIB, "1 GiB does not fit a 512 MiB cap: B waits and times out ({})", mib(rb[0]));
    assert_eq!(state(&status(&arbiter), &ga), "running");
    assert!(!arbiter.log_text().contains("swap out"), "{}", arbiter.log_text());
    b.close_stdin();
    b.finish();
    check_intact(&mut a);
    a.close_stdin();
    a.finish();
}

#[test]
fn a_swapped_out_process_that_exits_frees_its_host_copy() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("e.sock"), &["--swap-quantum", "0s"]);
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, _) = holder(&gpu, &arbiter, &ga);
    let mut b = requester(&gpu, &arbiter, &gb, "30s");
    assert_eq!(b.ready()[0], 2560 * MIB);
    let s = wait_for(&arbiter, "A swapped out", |s| {
        process(s, &ga).is_some_and(|p| p.host_bytes >= BURST * BURSTS)
    });
    assert_eq!(s.gpus[0].swapped, BURST * BURSTS);
    // A exits while swapped out (end of input: it never touches its memory again).
    a.close_stdin();
    a.finish();
    let s = wait_for(&arbiter, "A gone", |s| process(s, &ga).is_none());
    assert_eq!(s.gpus[0].swapped, 0, "no host RAM is counted for a process that is gone");
    b.close_stdin();
    b.finish();
}

#[test]
fn without_the_arbiter_a_swapped_process_comes_back_when_the_device_has_room() {
    skip_on_real_gpu!(KERNELS);
    let gpu = gpu();
    let mut arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("g.sock"), &["--swap-quantum", "0s"]);
    let (ga, gb) = (unique("holder"), unique("burst"));
    let (mut a, _) = holder_waiting(&gpu, &arbiter, &ga, "2s");
    let mut b = requester(&gpu, &arbiter, &gb, "30s");
    assert_eq!(b.ready()[0], 2560 * MIB);
    wait_for(&arbiter, "A swapped out", |s| process(s, &ga).is_some_and(|p| p.host_bytes >= BURST * BURSTS));
    // The arbiter dies for good; B leaves, so the device has room again.
    arbiter.kill();
    b.close_stdin();
    b.finish();
    // A's copy waits for the arbiter GPUFRAC_WAIT_TIMEOUT (2 s), then A comes back alone.
    let started = Instant::now();
    a.write_stdin("copy\n");
    a.expect_line(&["COPIED"], TIMEOUT);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "waited for the arbiter first: {:?}",
        started.elapsed()
    );
    check_intact(&mut a);
    a.close_stdin();
    a.finish();
}

#[test]
fn bad_swap_flags_are_refused_naming_the_flag() {
    for (flag, value) in [("--swap-limit", "lots"), ("--swap-quantum", "5parsecs"), ("--swap-limit", "150%")]
    {
        let out = std::process::Command::new(artifact("gpufrac-arbiter"))
            .args(["--socket", "/nonexistent/arbiter.sock", flag, value])
            .output()
            .expect("gpufrac-arbiter");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} accepted");
        assert!(stderr.contains(&format!("invalid {flag}=\"{value}\"")), "{stderr}");
    }
}

/// How many `bursty_server`s take turns in [`swap_ping_pong_keeps_every_byte`].
const PLAYERS: u64 = 3;

/// One player of the ping-pong: a `bursty_server` with the swap resolver that checks its
/// data (`--verify`): a 128 MiB model inside a 256 MiB request, then bursts of 900 MiB
/// and 1000 bytes in 64 MiB steps (fourteen allocations that fill their backings to the
/// last page, then one of 4 MiB and 1000 bytes, whose last page is partly used), held
/// 2.5 s, 0-100 ms apart. The hold is longer than a silent burst stays under way (2 s), so
/// the next player's burst swaps the holder out mid-hold; with a short hold it waited for
/// the holder to finish instead, and no swap-in was ever needed.
fn player(gpu: &SimGpu, arbiter: &Arbiter, group: &str, bursts: u32, seed: u64) -> ChildProcess {
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_bursty_server"));
    cmd.memory_request("256MiB")
        .memory_limit("1280MiB")
        .resolver("swap")
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout("30s")
        .log("info");
    let burst = (900 * MIB + 1000).to_string();
    let (bursts, seed) = (bursts.to_string(), seed.to_string());
    cmd.args([
        "--base",
        "128MiB",
        "--burst",
        &burst,
        "--step",
        "64MiB",
        "--hold",
        "2500",
        "--keep-ms",
        "300",
    ])
    .args(["--gap-ms", "0-100", "--bursts", &bursts, "--seed", &seed, "--verify"]);
    ChildProcess::spawn(&mut cmd)
}

/// Three servers play ping-pong with one GPU's room: on simgpu's 2 GiB device each burst
/// (900 MiB) fits only while no other is resident, so every burst swaps the holder out,
/// and every holder, checking its burst after the hold, swaps the next one out to come
/// back; the arbiter gives memory that frees back to a swapped-out holder at once, and a
/// quantum of 1 s, shorter than a hold, lets it be taken again mid-hold, so a swap-in is
/// often followed closely by a swap-out. Every burst is checked after its hold and the model after every burst:
/// a single page lost in any of those swaps is a `CORRUPT` line and exit status 4.
#[test]
fn swap_ping_pong_keeps_every_byte() {
    skip_on_real_gpu!(KERNELS);
    let gpu = SimGpu::new("2GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("p.sock"), &["--swap-quantum", "1s"]);
    // More rounds for a soak: GPUFRAC_E2E_PING_PONG_BURSTS bursts per player.
    let bursts: u32 = match std::env::var("GPUFRAC_E2E_PING_PONG_BURSTS") {
        Ok(v) => {
            v.parse().unwrap_or_else(|_| panic!("GPUFRAC_E2E_PING_PONG_BURSTS={v:?}: not a whole number"))
        }
        Err(_) => 4,
    };
    let mut players: Vec<ChildProcess> =
        (0..PLAYERS).map(|i| player(&gpu, &arbiter, &unique(&format!("pong{i}")), bursts, 7 + i)).collect();
    for p in &mut players {
        p.ready();
    }
    // A burst may be refused: all three waiting with part of their bursts (the arbiter
    // breaks the deadlock), or one waiting out its 30 s. What it got is freed and the next
    // one plays; this test is about the data, and counts the bursts checked (and that the
    // game ends: a stall is a player not done within its wait).
    let mut served = 0;
    for p in &mut players {
        let status = p.wait(Duration::from_secs(600));
        let corrupt: Vec<String> =
            p.stderr_text().lines().filter(|l| l.starts_with("CORRUPT")).map(str::to_owned).collect();
        assert!(corrupt.is_empty(), "data came back wrong after swaps: {corrupt:?}");
        assert_eq!(status.code(), Some(0), "{}", p.diagnostics());
        let done = p.expect_line(&["DONE"], TIMEOUT);
        served += log_field(&done, "ok").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    assert!(served >= u64::from(bursts), "at least {bursts} bursts served and checked: {served}");
    // The ping-pong happened: burst memory went to host RAM and back, many times (reports
    // of 0 bytes, memory freed while in host RAM, are not counted).
    let log = arbiter.log_text();
    let moved = |words: &str| {
        log.lines()
            .filter(|l| l.contains(words))
            .filter(|l| log_field(l, "bytes").and_then(|b| b.parse::<u64>().ok()).is_some_and(|b| b > 0))
            .count() as u64
    };
    let (outs, ins) = (moved("INFO swapped out "), moved("INFO swapped in "));
    let refused =
        |reason: &str| log.lines().filter(|l| l.contains("burst denied") && l.contains(reason)).count();
    eprintln!(
        "ping-pong: {served} bursts checked, {outs} swap-outs and {ins} swap-ins; refused: {} to break a deadlock, {} timed out",
        refused("reason=Deadlock"),
        refused("reason=Timeout")
    );
    for line in log.lines().filter(|l| l.contains("burst denied")) {
        eprintln!("ping-pong: {line}");
    }
    assert!(outs >= u64::from(bursts) && ins >= u64::from(bursts), "{outs} out, {ins} in:\n{log}");
}
