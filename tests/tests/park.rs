//! Parking idle models on simgpu, with each of the two mechanisms (the shim's own swap and
//! the driver's checkpoint API, driven by the arbiter): more parkable models than fit
//! share a GPU, taking turns as requests arrive at random, every request served and every
//! byte intact; a non-parkable group's request is never parked nor kept waiting by them;
//! a wake that cannot be served within GPUFRAC_WAIT_TIMEOUT fails its call clearly.

use std::process::Command;
use std::time::{Duration, Instant};

use gpufrac_e2e::rng::Rng;
use gpufrac_e2e::{
    compile_c, log_field, skip_on_real_gpu, status, unique, wait_for, Arbiter, ChildProcess, ShimSettings,
    SimGpu, TIMEOUT,
};

/// Why these tests need simgpu.
const SIMGPU: &str = "the models fill and check memory with simgpu's built-in kernels on its 4 GiB device";

/// Each model: 1 GiB in four chunks, 2 MiB of scratch and its context (64 MiB): a request
/// of 1.25 GiB. Three fit on the 4 GiB GPU.
const REQUEST: &str = "1280MiB";

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

fn arbiter(gpu: &SimGpu, park_with: &str) -> Arbiter {
    let socket = gpu.lib_dir().join("park.sock");
    Arbiter::start_at(gpu, socket, &["--oversubscribe", "3", "--park-with", park_with])
}

/// `program` under the shim in `group`, served by `arbiter`.
fn member(gpu: &SimGpu, program: impl AsRef<std::ffi::OsStr>, arbiter: &Arbiter, group: &str) -> Command {
    let mut cmd = gpu.shimmed(program);
    cmd.arbiter_socket(arbiter.socket()).group(group).log("info");
    cmd
}

/// A parkable model, idle after 300 ms, waiting up to `wait` for its wakes.
fn model(gpu: &SimGpu, arbiter: &Arbiter, group: &str, seed: usize, wait: &str) -> ChildProcess {
    let mut cmd = member(gpu, env!("CARGO_BIN_EXE_parkable_model"), arbiter, group);
    cmd.memory_request(REQUEST).park_after("300ms").wait_timeout(wait).args([
        "--model",
        "1GiB",
        "--chunk",
        "256MiB",
        "--seed",
        &seed.to_string(),
    ]);
    ChildProcess::spawn(&mut cmd)
}

fn ask(m: &mut ChildProcess, command: &str, answers: &[&str]) -> String {
    m.write_stdin(&format!("{command}\n"));
    m.expect_line(answers, TIMEOUT)
}

/// Four models on a GPU that holds three: requests at random, one at a time; every one
/// served, the models parked and woken in turn, their data intact at the end.
fn models_take_turns(park_with: &str) {
    let gpu = gpu();
    let arbiter = arbiter(&gpu, park_with);
    let groups: Vec<String> = (0..4).map(|i| unique(&format!("model{i}"))).collect();
    let mut models: Vec<ChildProcess> =
        groups.iter().enumerate().map(|(i, g)| model(&gpu, &arbiter, g, i, "60s")).collect();
    // The fourth is admitted parked: it loads once an idle one has been parked for it.
    for m in &mut models {
        m.expect_line(&["READY"], TIMEOUT);
    }
    let mut rng = Rng::new(23);
    let mut slowest = Duration::ZERO;
    for r in 0..16 {
        let i = rng.between(0, 3) as usize;
        let asked = Instant::now();
        let answer = ask(&mut models[i], &format!("REQ {r}"), &["OK", "FAIL"]);
        assert!(answer.starts_with(&format!("OK {r} ")), "request {r} to model {i}: {answer}");
        slowest = slowest.max(asked.elapsed());
        // Mostly idle models: a pause now and then lets the idle ones become parkable.
        std::thread::sleep(Duration::from_millis(rng.between(0, 400)));
    }
    for (i, m) in models.iter_mut().enumerate() {
        assert_eq!(ask(m, "CHECK", &["CHECKED", "FAIL"]), "CHECKED 4", "model {i}'s data after its parks");
    }
    let s = status(&arbiter);
    let processes = &s.gpus[0].processes;
    let parks: u64 = processes.iter().map(|p| p.parks).sum();
    let wakes: u64 = processes.iter().map(|p| p.wakes).sum();
    assert!(parks >= 1 && wakes >= 1, "the models took turns: {parks} parks, {wakes} wakes; {s:?}");
    assert!(s.gpus[0].parkable_requests > s.gpus[0].total, "oversubscribed: {s:?}");
    let log = arbiter.log_text();
    let how =
        if park_with == "checkpoint" { "parked by the driver's checkpoint" } else { "parked by the shim" };
    assert!(log.contains(how), "parks used {park_with}:\n{log}");
    for m in &mut models {
        m.write_stdin("QUIT\n");
        m.expect_exit_code(0);
    }
    eprintln!("{park_with}: {parks} parks, {wakes} wakes, slowest request {slowest:?}");
}

#[test]
fn parkable_models_take_turns_parked_by_the_shim() {
    skip_on_real_gpu!(SIMGPU);
    models_take_turns("shim");
}

#[test]
fn parkable_models_take_turns_parked_by_the_driver_checkpoint() {
    skip_on_real_gpu!(SIMGPU);
    models_take_turns("checkpoint");
}

/// A model's thread is inside a hook, between its look at a checkpoint park and the
/// driver, releasing its context as the CUDA runtime does at exit, when the arbiter parks
/// the model with the driver's checkpoint: the park waits for that call (and declines
/// while it takes longer than the park's grace), so the call never reaches the locked
/// driver. A test build's delay holds the thread inside the hook. Before, the call
/// blocked in the driver for ever: a CuPy model's exit hung, once in a while.
#[test]
fn a_context_released_as_a_checkpoint_park_begins_does_not_block_in_the_locked_driver() {
    skip_on_real_gpu!(SIMGPU);
    // Two models whose requests do not fit together: the second is admitted parked and
    // the first, idle, is parked for it.
    let gpu = SimGpu::new("1GiB").with_context_overhead("64MiB");
    let arbiter = arbiter(&gpu, "checkpoint");
    let small = |group: &str, teardown_delay: Option<&str>| {
        let mut cmd = member(&gpu, env!("CARGO_BIN_EXE_parkable_model"), &arbiter, group);
        cmd.memory_request("640MiB").park_after("300ms").wait_timeout("60s");
        cmd.args(["--model", "256MiB", "--chunk", "128MiB", "--seed", "1"]);
        if let Some(us) = teardown_delay {
            cmd.env("GPUFRAC_TEST_TEARDOWN_DELAY_US", us);
        }
        ChildProcess::spawn(&mut cmd)
    };
    let mut first = small(&unique("releasing"), Some("3000000"));
    first.expect_line(&["READY"], TIMEOUT);
    std::thread::sleep(Duration::from_millis(500));
    first.write_stdin("RELEASE\n");
    let mut second = small(&unique("second"), None);
    assert_eq!(first.expect_line(&["RELEASED"], TIMEOUT), "RELEASED CUDA_SUCCESS", "{}", arbiter.log_text());
    second.expect_line(&["READY"], TIMEOUT);
    let log = arbiter.log_text();
    let pid = first.pid().to_string();
    let declined = log
        .lines()
        .filter(|l| l.contains("a park was declined") && log_field(l, "pid") == Some(pid.as_str()))
        .count();
    assert!(declined >= 1, "a park of the first came while its release was inside the hook:\n{log}");
    for model in [&mut first, &mut second] {
        model.write_stdin("QUIT\n");
        model.expect_exit_code(0);
    }
}

/// Three parkable models fill the GPU and are busy; a non-parkable group asking 2 GiB is
/// admitted beside them (they are not guaranteed against it), two of them are parked for
/// it, and its allocation succeeds: it is never parked, and the parked models come back
/// when it is gone.
#[test]
fn a_firm_request_is_never_parked_nor_kept_out_by_parkable_models() {
    skip_on_real_gpu!(SIMGPU);
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "shim");
    let groups: Vec<String> = (0..3).map(|i| unique(&format!("m{i}"))).collect();
    let mut models: Vec<ChildProcess> =
        groups.iter().enumerate().map(|(i, g)| model(&gpu, &arbiter, g, i, "60s")).collect();
    for m in &mut models {
        m.expect_line(&["READY"], TIMEOUT);
    }
    let firm = unique("firm");
    let mut cmd = member(&gpu, compile_c("alloc_paths.c", &["MODE_DLSYM"], false), &arbiter, &firm);
    cmd.memory_request("2GiB").wait_timeout("2s").args([
        "alloc",
        &(64u64 << 20).to_string(),
        &(1792u64 << 20).to_string(),
    ]);
    let mut f = ChildProcess::spawn(&mut cmd);
    let got = f.ready();
    assert_eq!(got[0], 1792 << 20, "the firm group got its memory");
    let timeouts = arbiter.denials(f.pid(), "Timeout");
    assert!(timeouts.is_empty(), "without waiting for a timeout: {timeouts:?}\n{}", arbiter.log_text());
    let s = status(&arbiter);
    let p = s.gpus[0].processes.iter().find(|p| p.group == firm).expect("the firm group registered");
    assert_eq!((p.state.as_str(), p.parks), ("running", 0), "{s:?}");
    wait_for(&arbiter, "parkable models parked for it", |s| {
        s.gpus[0].processes.iter().filter(|p| p.state == "parked").count() >= 2
    });
    f.close_stdin();
    f.finish();
    // Its memory back, every model serves again, data intact.
    for (i, m) in models.iter_mut().enumerate() {
        assert!(
            ask(m, &format!("REQ {i}"), &["OK", "FAIL"]).starts_with("OK"),
            "model {i} after the firm group"
        );
        assert_eq!(ask(m, "CHECK", &["CHECKED", "FAIL"]), "CHECKED 4");
    }
    for m in &mut models {
        m.write_stdin("QUIT\n");
        m.expect_exit_code(0);
    }
}

/// A parked model whose wake finds nobody idle to park waits GPUFRAC_WAIT_TIMEOUT, then
/// its call fails with out-of-memory (and the arbiter says why); it is served once room
/// frees.
#[test]
fn a_wake_that_finds_no_room_fails_its_call_after_the_wait_timeout() {
    skip_on_real_gpu!(SIMGPU);
    let gpu = gpu();
    let arbiter = arbiter(&gpu, "shim");
    // Three models that never idle long enough: parked only after 1 hour.
    let busy: Vec<ChildProcess> = (0..3)
        .map(|i| {
            let mut cmd =
                member(&gpu, env!("CARGO_BIN_EXE_parkable_model"), &arbiter, &unique(&format!("busy{i}")));
            cmd.memory_request(REQUEST).park_after("1h").args(["--model", "1GiB", "--seed", &i.to_string()]);
            ChildProcess::spawn(&mut cmd)
        })
        .collect();
    let mut busy = busy;
    for m in &mut busy {
        m.expect_line(&["READY"], TIMEOUT);
    }
    let group = unique("late");
    let mut late = model(&gpu, &arbiter, &group, 9, "1s");
    // Its first call (the context) waits for the wake, which is refused after 1 s: the
    // arbiter's own account of the wait, from when the wake was queued.
    late.wait(TIMEOUT);
    let failed = late.diagnostics();
    let pid = late.pid().to_string();
    let log = arbiter.log_text();
    let waited: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("not woken in time") && log_field(l, "pid") == Some(pid.as_str()))
        .filter_map(|l| log_field(l, "waited_ms")?.parse().ok())
        .collect();
    assert!(waited.iter().sum::<u64>() >= 1000, "it waited its timeout: {waited:?}\n{log}");
    assert!(failed.contains("FAILED init"), "its init failed: {failed}");
    assert!(failed.contains("not woken within GPUFRAC_WAIT_TIMEOUT"), "the shim says why: {failed}");
    wait_for(&arbiter, "the late model gone", |s| !s.gpus[0].processes.iter().any(|p| p.group == group));
    // One busy model leaves: a new late model is admitted and served at once.
    let mut gone = busy.pop().expect("three busy models");
    gone.write_stdin("QUIT\n");
    gone.expect_exit_code(0);
    let mut late = model(&gpu, &arbiter, &unique("late2"), 9, "10s");
    late.expect_line(&["READY"], TIMEOUT);
    assert!(ask(&mut late, "REQ 1", &["OK", "FAIL"]).starts_with("OK"));
    late.write_stdin("QUIT\n");
    late.expect_exit_code(0);
    for m in &mut busy {
        m.write_stdin("QUIT\n");
        m.expect_exit_code(0);
    }
}
