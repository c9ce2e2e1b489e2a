//! The product's promise with real processes on simgpu: a request is guaranteed whatever
//! others borrow (the loans are taken back: swapped out, or their holder ended, never
//! corrupted), colliding bursts under `wait` end without out-of-memory errors, many small
//! requests that fit all start under bursty load, and a swap burst beside an idle holder
//! does not wait out a quantum.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpufrac_daemon::status::{ProcessStatus, Status};
use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{
    compile_c, describe_status, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess,
    ShimSettings, SimGpu, TIMEOUT,
};

/// These tests take turns: two of them run dozens of processes and measure waits, and on a
/// small machine running them at once would measure the machine, not the arbiter.
static HEAVY: Mutex<()> = Mutex::new(());

/// Why the tests here need simgpu: a guarantee is tested only when the device is full.
const FULL: &str =
    "requests and loans fill simgpu's 4 GiB device; on a larger real GPU nothing is taken back";
/// Why the swap tests need simgpu.
const KERNELS: &str = "simgpu_probe hold-bursts fills memory with simgpu's built-in kernels (and the loans fill its 4 GiB device)";

/// The swap quantum of the swap tests: longer than the harness's [`TIMEOUT`], so that a
/// burst served at all was not served by a quantum running out.
const QUANTUM: &str = "120s";

fn quantum() -> Duration {
    Duration::from_secs(120)
}

fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shim's settings for a process of `group` (a command of [`SimGpu::shimmed`]).
fn shim(
    cmd: &mut std::process::Command,
    arbiter: &Arbiter,
    group: &str,
    request: &str,
    limit: &str,
    resolver: &str,
) {
    cmd.memory_request(request)
        .memory_limit(limit)
        .resolver(resolver)
        .arbiter_socket(arbiter.socket())
        .group(group)
        .wait_timeout("60s")
        .log("info");
}

fn process<'a>(s: &'a Status, group: &str) -> Option<&'a ProcessStatus> {
    s.gpus[0].processes.iter().find(|p| p.group == group)
}

/// B: guaranteed 2 GiB (limit 2 GiB) and allocating all of it beside its 64 MiB context,
/// in 32 MiB steps.
fn guaranteed_2gib(gpu: &SimGpu, arbiter: &Arbiter, group: &str) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    shim(&mut cmd, arbiter, group, "2GiB", "2GiB", "wait");
    cmd.args(["alloc", &(32 * MIB).to_string(), &(1984 * MIB).to_string()]);
    ChildProcess::spawn(&mut cmd)
}

#[test]
fn a_request_is_served_at_once_while_its_memory_is_lent_to_a_swap_holder_whose_data_survives() {
    skip_on_real_gpu!(KERNELS);
    let _turn = heavy();
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    // A quantum longer than any wait of the test: taking a loan back for a guarantee does
    // not wait for it.
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("q.sock"), &["--swap-quantum", QUANTUM]);
    let (ga, gb) = (unique("lender"), unique("guaranteed"));
    // A: guaranteed 512 MiB, limit 3.5 GiB; holds its request and borrows 2.5 GiB, which
    // it fills with data, then sleeps.
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_simgpu_probe"));
    shim(&mut cmd, &arbiter, &ga, "512MiB", "3584MiB", "swap");
    cmd.args(["hold-bursts", &(448 * MIB).to_string(), &(256 * MIB).to_string(), "10"]);
    let mut a = ChildProcess::spawn(&mut cmd);
    a.expect_line(&["PTRS"], TIMEOUT);
    a.ready();
    let s = status(&arbiter);
    assert!(s.gpus[0].burst >= 2560 * MIB, "A borrows 2.5 GiB: {s:?}");

    // B asks for 2 GiB: 0.5 + 2 GiB of requests fit 4 GiB, so it is admitted and gets all
    // of it within seconds, A's loan going to host RAM.
    let started = Instant::now();
    let mut b = guaranteed_2gib(&gpu, &arbiter, &gb);
    let got = b.ready()[0];
    let took = started.elapsed();
    assert_eq!(got, 1984 * MIB, "B allocated its whole request ({})\n{}", mib(got), arbiter.log_text());
    assert!(took < quantum(), "B served before a quantum passed: {took:?}");
    // B may be served before A's last report: status shows the swap-out as it goes.
    let s = wait_for(&arbiter, "A's swap-out answered", |s| {
        process(s, &ga).is_some_and(|p| p.host_bytes >= 2560 * MIB)
    });
    let pa = process(&s, &ga).expect("A is still there");
    assert_eq!((pa.state.as_str(), pa.host_bytes), ("swapped", 2560 * MIB), "{s:?}");
    assert_eq!(s.gpus[0].reclaiming, 0, "the guarantee got its memory: {s:?}");
    assert!(arbiter.log_text().contains("swap out for a guarantee"), "{}", arbiter.log_text());

    // B leaves; A reads its data: it comes back in, bit for bit.
    b.finish();
    a.write_stdin("check\n");
    let verdict = a.expect_line(&["INTACT", "CORRUPT"], TIMEOUT);
    assert_eq!(verdict, format!("INTACT {}", 2560 * MIB), "A's data after its loan was taken back");
    a.close_stdin();
    a.finish();
}

/// A (resolver wait): guaranteed 512 MiB, holding 3 GiB with its context, most of it lent.
fn lender_holding_3gib(gpu: &SimGpu, arbiter: &Arbiter, group: &str) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    shim(&mut cmd, arbiter, group, "512MiB", "3584MiB", "wait");
    cmd.args(["alloc", &(32 * MIB).to_string(), &(3008 * MIB).to_string()]);
    let mut a = ChildProcess::spawn(&mut cmd);
    assert_eq!(a.ready()[0], 3008 * MIB);
    a
}

#[test]
fn a_request_is_served_by_ending_a_holder_that_cannot_swap() {
    skip_on_real_gpu!(FULL);
    let _turn = heavy();
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start(&gpu);
    let (ga, gb) = (unique("lender"), unique("guaranteed"));
    let mut a = lender_holding_3gib(&gpu, &arbiter, &ga);

    // A holds 3 GiB of the 4: B's 2 GiB can only be had once A is gone (no bound on how
    // long that takes: the reclaim grace passes first).
    let mut b = guaranteed_2gib(&gpu, &arbiter, &gb);
    let got = b.ready()[0];
    assert_eq!(got, 1984 * MIB, "B allocated its whole request ({})\n{}", mib(got), arbiter.log_text());
    a.wait_terminated(TIMEOUT);
    let ended = describe_status(a.wait(TIMEOUT));
    assert_eq!(ended, "killed by signal 15", "A is ended with SIGTERM");
    let log = arbiter.log_text();
    assert!(log.contains("ending a holder of burst memory for a guarantee"), "{log}");
    b.finish();
}

#[test]
fn a_holder_that_gives_back_within_the_reclaim_grace_is_not_ended() {
    skip_on_real_gpu!(FULL);
    let _turn = heavy();
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    // A reclaim grace longer than the harness's TIMEOUT: B, served at all, was served by
    // A giving back, not by the grace running out and A being ended.
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("g.sock"), &["--reclaim-grace", "120s"]);
    let (ga, gb) = (unique("lender"), unique("guaranteed"));
    let mut a = lender_holding_3gib(&gpu, &arbiter, &ga);

    // B's guarantee is owed A's loan; once the arbiter counts the debt, A's batch ends
    // (well within the grace) and it frees everything.
    let mut b = guaranteed_2gib(&gpu, &arbiter, &gb);
    wait_for(&arbiter, "the debt", |s| s.gpus[0].reclaiming > 0);
    a.close_stdin();
    a.finish();
    let got = b.ready()[0];
    assert_eq!(got, 1984 * MIB, "B allocated its whole request ({})\n{}", mib(got), arbiter.log_text());
    let log = arbiter.log_text();
    assert!(!log.contains("ending a holder"), "nobody is ended: {log}");
    let s = status(&arbiter);
    assert!(s.gpus[0].repaid_given_back > 0 && s.gpus[0].repaid_ended == 0, "{:?}", s.gpus[0]);
    b.close_stdin();
    b.finish();
}

/// The lines `BURST <i> ok wait_ms=<ms>` / `BURST <i> oom ...` and the final `DONE` of a
/// `bursty_server`: (waits of the bursts served, out-of-memory errors).
fn burst_outcomes(server: &mut ChildProcess) -> (Vec<u64>, u64) {
    let (mut waits, mut ooms) = (Vec::new(), 0);
    loop {
        let line = server.expect_line(&["BURST", "DONE"], Duration::from_secs(120));
        if line.starts_with("DONE") {
            break;
        }
        match line.split_whitespace().nth(2) {
            Some("ok") => {
                let ms = line.rsplit("wait_ms=").next().and_then(|v| v.trim().parse().ok());
                waits.push(ms.unwrap_or_else(|| panic!("a wait in {line:?}")));
            }
            _ => ooms += 1,
        }
    }
    server.expect_exit_code(0);
    (waits, ooms)
}

/// How a `bursty_server` bursts: `base` held for life, then `bursts` bursts of `burst` in
/// 64 MiB steps `step_ms` apart, each held `hold_ms`, `gap_ms` (`MIN-MAX`) apart.
struct Trace<'a> {
    base: &'a str,
    burst: &'a str,
    step_ms: u32,
    hold_ms: u32,
    bursts: u32,
    gap_ms: &'a str,
    /// `--verify`: every burst and the model filled and checked (exit 4 on corruption).
    verify: bool,
}

/// A `bursty_server` under the shim with (request, limit, resolver).
fn bursty(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    group: &str,
    share: (&str, &str, &str),
    t: &Trace,
    seed: u64,
) -> ChildProcess {
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_bursty_server"));
    shim(&mut cmd, arbiter, group, share.0, share.1, share.2);
    let numbers = [t.step_ms.to_string(), t.hold_ms.to_string(), t.bursts.to_string(), seed.to_string()];
    cmd.log("warn").args(["--base", t.base, "--burst", t.burst, "--step", "64MiB"]).args([
        "--step-ms",
        &numbers[0],
        "--hold",
        &numbers[1],
        "--bursts",
        &numbers[2],
        "--gap-ms",
        t.gap_ms,
        "--seed",
        &numbers[3],
    ]);
    if t.verify {
        cmd.arg("--verify");
    }
    ChildProcess::spawn(&mut cmd)
}

#[test]
fn eight_bursty_servers_collide_without_out_of_memory_under_wait() {
    skip_on_real_gpu!(
        "the bursts collide on simgpu's 16 GiB device; on a larger real GPU they fit side by side"
    );
    let _turn = heavy();
    let gpu = SimGpu::new("16GiB").with_context_overhead("64MiB");
    let arbiter = Arbiter::start(&gpu);
    // Each: guaranteed 1 GiB, limit 4 GiB; bursts by 3 GiB in 64 MiB allocations 5 ms
    // apart (an allocator growing while the server computes), held 300 ms, at random:
    // 8 GiB to lend for up to 24 GiB of bursts, many of them growing at once.
    let trace = Trace {
        base: "512MiB",
        burst: "3GiB",
        step_ms: 5,
        hold_ms: 300,
        bursts: 6,
        gap_ms: "200-2000",
        verify: false,
    };
    let mut servers: Vec<ChildProcess> = (0..8)
        .map(|i| {
            bursty(&gpu, &arbiter, &unique(&format!("server{i}")), ("1GiB", "4GiB", "wait"), &trace, 1 + i)
        })
        .collect();
    for s in &mut servers {
        s.ready();
    }
    let (mut waits, mut ooms) = (Vec::new(), 0);
    for s in &mut servers {
        let (w, o) = burst_outcomes(s);
        waits.extend(w);
        ooms += o;
    }
    assert_eq!(ooms, 0, "colliding bursts wait, never fail\n{}", arbiter.log_text());
    assert_eq!(waits.len(), 48, "every burst served\n{}", arbiter.log_text());
    // How long they waited depends on the machine's load: reported here, measured by the
    // density benchmark (its burst wait p50/p99), not asserted.
    waits.sort_unstable();
    let p99 = waits[(waits.len() * 99).div_ceil(100) - 1];
    let p50 = waits[waits.len() / 2];
    eprintln!("{} bursts served, {ooms} out-of-memory, wait p50 {p50} ms p99 {p99} ms", waits.len());
    assert!(!arbiter.log_text().contains("Deadlock"), "no burst was refused to break a deadlock");
}

#[test]
fn forty_eight_small_requests_that_fit_all_start_under_bursty_load() {
    skip_on_real_gpu!("the load fills simgpu's 16 GiB device, and 48 contexts of simgpu's 16 MiB fit in it");
    let _turn = heavy();
    let gpu = SimGpu::new("16GiB").with_context_overhead("16MiB");
    let arbiter = Arbiter::start(&gpu);
    // Four borrowers (swap resolver) keep most of the spare memory lent out: 4 GiB of
    // requests, bursts of 5 GiB held 1.5 s, back to back: two of them borrow 10 of the
    // 12 GiB no request reserves. They fill and check their data (`--verify`): swapped
    // out and back, it must come back bit for bit.
    let load_trace = Trace {
        base: "512MiB",
        burst: "5GiB",
        step_ms: 0,
        hold_ms: 1500,
        bursts: 4,
        gap_ms: "0-100",
        verify: true,
    };
    let mut load: Vec<ChildProcess> = (0..4)
        .map(|i| {
            bursty(
                &gpu,
                &arbiter,
                &unique(&format!("load{i}")),
                ("1GiB", "7GiB", "swap"),
                &load_trace,
                100 + i,
            )
        })
        .collect();
    for l in &mut load {
        l.ready();
    }
    wait_for(&arbiter, "the load borrowing", |s| s.gpus[0].burst >= 8 * GIB);
    // 48 small servers, guaranteed 128 MiB each (6 GiB in all: 10 GiB of requests on a
    // 16 GiB GPU), each bursting a little.
    let small_trace = Trace {
        base: "96MiB",
        burst: "64MiB",
        step_ms: 0,
        hold_ms: 300,
        bursts: 2,
        gap_ms: "0-300",
        verify: false,
    };
    let mut small: Vec<ChildProcess> = (0..48)
        .map(|i| {
            bursty(
                &gpu,
                &arbiter,
                &unique(&format!("small{i}")),
                ("128MiB", "256MiB", "wait"),
                &small_trace,
                200 + i,
            )
        })
        .collect();
    for (i, s) in small.iter_mut().enumerate() {
        let line = s.expect_line(&["READY"], Duration::from_secs(120));
        assert_eq!(line, format!("READY {}", 96 * MIB), "small server {i} started");
    }
    for s in &mut small {
        let (_, ooms) = burst_outcomes(s);
        assert_eq!(ooms, 0);
    }
    let s = status(&arbiter);
    assert!(s.gpus[0].guaranteed <= 16 * GIB, "{s:?}");
    for l in &mut load {
        // A borrower may be swapped out or ended for the guarantees, never corrupted.
        // Filling and checking 5 GiB bursts on simgpu takes minutes on a loaded machine:
        // the bound only guards against a hang.
        let status = l.wait(Duration::from_secs(600));
        assert!(status.code() != Some(4), "a borrower's data came back wrong: {}", l.diagnostics());
        assert!(!l.stderr_text().contains("CORRUPT"), "{}", l.diagnostics());
    }
    // What the check above is for: borrowers' bursts went to host memory and came back
    // (the arbiter's own words), so their data was checked after a round trip.
    let log = arbiter.log_text();
    let (outs, ins) = (log.matches("swapped out").count(), log.matches("swapped in").count());
    eprintln!("{outs} swaps out, {ins} swaps in");
    assert!(
        outs >= 1 && ins >= 1,
        "no borrower was swapped out and back: the data check checked no round trip: {log}"
    );
}

#[test]
fn a_swap_burst_beside_an_idle_holder_does_not_wait_out_the_quantum() {
    skip_on_real_gpu!(KERNELS);
    let _turn = heavy();
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    // A quantum longer than the harness's TIMEOUT: only the holder's idleness can explain
    // B being served at all.
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("q.sock"), &["--swap-quantum", QUANTUM]);
    let (ga, gb) = (unique("sleepy"), unique("burst"));
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_simgpu_probe"));
    shim(&mut cmd, &arbiter, &ga, "1GiB", "3GiB", "swap");
    cmd.args(["hold-bursts", &GIB.to_string(), &(256 * MIB).to_string(), "4"]);
    let mut a = ChildProcess::spawn(&mut cmd);
    a.expect_line(&["PTRS"], TIMEOUT);
    a.ready();
    // A touches nothing for three seconds.
    std::thread::sleep(Duration::from_secs(3));
    let started = Instant::now();
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    shim(&mut cmd, &arbiter, &gb, "1GiB", "3GiB", "swap");
    cmd.args(["alloc", &(32 * MIB).to_string(), &(2560 * MIB).to_string()]);
    let mut b = ChildProcess::spawn(&mut cmd);
    assert_eq!(b.ready()[0], 2560 * MIB, "B got its whole burst\n{}", arbiter.log_text());
    let took = started.elapsed();
    // B may be served before A's last report: status shows the swap-out as it goes.
    let s =
        wait_for(&arbiter, "A's swap-out answered", |s| process(s, &ga).is_some_and(|p| p.host_bytes >= GIB));
    let pa = process(&s, &ga).expect("A registered");
    assert_eq!((pa.state.as_str(), pa.host_bytes), ("swapped", GIB), "{s:?}");
    eprintln!("served in {took:?} beside an idle holder (quantum {QUANTUM})");
    assert!(took < quantum(), "served in about the time of the copy, not a quantum: {took:?}");
    b.finish();
    a.write_stdin("check\n");
    assert_eq!(a.expect_line(&["INTACT", "CORRUPT"], TIMEOUT), format!("INTACT {GIB}"));
    a.close_stdin();
    a.finish();
}
