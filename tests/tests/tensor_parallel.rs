//! Fractions across GPUs: a tensor-parallel server's workers, one per GPU, in one group,
//! each step allocating their activations and exchanging exported VMM memory as NCCL
//! does (`tp_worker`). The group is held to its request and limit on each GPU; a step
//! that needs more than the limit on one GPU fails there alone; and two such servers
//! colliding on both GPUs take turns, with no out-of-memory, in every round.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use gpufrac_e2e::busy::BusyLoops;
use gpufrac_e2e::{artifact, skip_on_real_gpu, status, Arbiter, ChildProcess, ShimSettings, SimGpu};

const WHY: &str = "two simulated GPUs of a chosen size";
const GIB: u64 = 1 << 30;

/// Worker `rank` of `group` on GPU `rank`, under the shim: 4 GiB guaranteed and at most
/// 10 GiB on each GPU. (Groups share a ledger by name across the machine: each test
/// names its own.)
fn worker(gpu: &SimGpu, arbiter: &Arbiter, group: &str, rank: u32, socket: &Path, args: &[&str]) -> Child {
    worker_with(gpu, arbiter, group, rank, socket, args, &[])
}

/// [`worker`] with more environment.
fn worker_with(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    group: &str,
    rank: u32,
    socket: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let mut cmd: Command = gpu.shimmed(artifact("tp_worker"));
    cmd.envs(env.iter().copied());
    cmd.memory_request("4GiB")
        .memory_limit("10GiB")
        .resolver("wait")
        .wait_timeout("20s")
        .group(group)
        .arbiter_socket(arbiter.socket())
        .args(["--rank", &rank.to_string(), "--device", &rank.to_string()])
        .arg("--socket")
        .arg(socket)
        .args(["--base", "1GiB", "--exchange", "2MiB"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("start tp_worker")
}

/// Waits for a worker; its stdout, after asserting it ended cleanly.
fn finished(child: Child, who: &str) -> String {
    let out = child.wait_with_output().expect("wait for tp_worker");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{who} failed ({}):\n{stdout}\n{stderr}", out.status);
    stdout
}

fn done_line(stdout: &str) -> &str {
    stdout.lines().find(|l| l.starts_with("DONE")).unwrap_or("no DONE line")
}

#[test]
fn a_tensor_parallel_pair_is_held_to_its_slice_on_each_gpu() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB,16GiB");
    let arbiter = Arbiter::start(&gpu);
    let socket = gpu.lib_dir().join("pair.sock");
    // Each step 5 GiB of activations per worker: within the limit (10 GiB with the 1 GiB
    // shard and the context) on both GPUs.
    let steps = ["--burst", "5GiB", "--steps", "5", "--hold-ms", "100"];
    let w0 = worker(&gpu, &arbiter, "tp-held", 0, &socket, &steps);
    let w1 = worker(&gpu, &arbiter, "tp-held", 1, &socket, &steps);
    // Mid-run, the arbiter shows the group on both GPUs, with its request on each.
    std::thread::sleep(std::time::Duration::from_millis(400));
    let seen = status(&arbiter);
    assert_eq!(seen.gpus.len(), 2, "{seen:?}");
    for g in &seen.gpus {
        let mine: Vec<_> = g.processes.iter().filter(|p| p.group.ends_with("tp-held")).collect();
        assert!(!mine.is_empty(), "the pair is on GPU {}: {g:?}", g.uuid);
        assert!(mine.iter().all(|p| p.request == 4 * GIB && p.limit == 10 * GIB), "{mine:?}");
    }
    for (rank, w) in [w0, w1].into_iter().enumerate() {
        let out = finished(w, &format!("rank {rank}"));
        assert_eq!(done_line(&out), "DONE steps=5 ok=5 oom=0", "rank {rank}:\n{out}");
    }
}

#[test]
fn a_step_past_the_limit_on_one_gpu_fails_on_that_gpu_alone() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB,16GiB");
    let arbiter = Arbiter::start(&gpu);
    let socket = gpu.lib_dir().join("pair.sock");
    // Rank 1 asks 9.5 GiB of activations beside its 1 GiB shard and its context: past
    // the 10 GiB limit on its GPU. Rank 0's 5 GiB fit on its own.
    let w0 = worker(&gpu, &arbiter, "tp-past", 0, &socket, &["--burst", "5GiB", "--steps", "3"]);
    let w1 = worker(&gpu, &arbiter, "tp-past", 1, &socket, &["--burst", "9728MiB", "--steps", "3"]);
    let (out0, out1) = (finished(w0, "rank 0"), finished(w1, "rank 1"));
    for step in 0..3 {
        assert!(
            out1.contains(&format!("STEP {step} oom CUDA_ERROR_OUT_OF_MEMORY")),
            "rank 1's allocation fails on its GPU:\n{out1}"
        );
        assert!(
            out0.contains(&format!("STEP {step} oom the peer's")),
            "rank 0's allocation succeeded on its GPU; the step is skipped for its peer:\n{out0}"
        );
    }
}

#[test]
fn two_tensor_parallel_pairs_colliding_on_both_gpus_take_turns_round_after_round() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB,16GiB");
    let arbiter = Arbiter::start(&gpu);
    // Two groups, 4 GiB guaranteed and 10 GiB at most on each GPU: 8 GiB unreserved on
    // each, so one pair's step (8 GiB per worker beside its 1 GiB shard and its context,
    // 5.25 GiB past the request) fits at a time. Started together, each pair's workers
    // race the other's on both GPUs; two busy loops compete for the CPU. (Without the
    // arbiter's rule across GPUs, a round now and then saw each pair start its step on a
    // different GPU and both wait out their timeout.)
    let _busy = BusyLoops::start(2);
    let rounds = 20;
    let steps = ["--burst", "8GiB", "--steps", "5", "--hold-ms", "10"];
    for round in 0..rounds {
        let (a, b) =
            (gpu.lib_dir().join(format!("a{round}.sock")), gpu.lib_dir().join(format!("b{round}.sock")));
        let workers = vec![
            ("a0", worker(&gpu, &arbiter, "tp-a", 0, &a, &steps)),
            ("b1", worker(&gpu, &arbiter, "tp-b", 1, &b, &steps)),
            ("a1", worker(&gpu, &arbiter, "tp-a", 1, &a, &steps)),
            ("b0", worker(&gpu, &arbiter, "tp-b", 0, &b, &steps)),
        ];
        for (who, w) in workers {
            let out = finished(w, &format!("round {round} {who}"));
            assert_eq!(done_line(&out), "DONE steps=5 ok=5 oom=0", "round {round} {who}:\n{out}");
        }
    }
}

#[test]
fn under_first_use_a_group_reserves_its_request_only_on_the_gpus_it_uses() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB,16GiB");
    let arbiter = Arbiter::start(&gpu);
    let socket = gpu.lib_dir().join("solo.sock");
    // Two one-worker groups that see both GPUs and each use one (the pair's link only
    // keeps them in step): reserved at first use, each group's 4 GiB is on its own GPU
    // alone; reserved on every visible device (the default), each would hold 4 GiB of
    // both.
    let steps = ["--burst", "1GiB", "--steps", "20", "--hold-ms", "50"];
    let first_use = [("GPUFRAC_RESERVE", "first-use")];
    let w0 = worker_with(&gpu, &arbiter, "tp-first-use-0", 0, &socket, &steps, &first_use);
    let w1 = worker_with(&gpu, &arbiter, "tp-first-use-1", 1, &socket, &steps, &first_use);
    let started = std::time::Instant::now();
    let requests = loop {
        let seen = status(&arbiter);
        let request = |gpu: usize, group: &str| {
            seen.gpus
                .get(gpu)
                .and_then(|g| g.processes.iter().find(|p| p.group.ends_with(group)).map(|p| p.request))
        };
        let requests = [
            request(0, "tp-first-use-0"),
            request(0, "tp-first-use-1"),
            request(1, "tp-first-use-0"),
            request(1, "tp-first-use-1"),
        ];
        if requests == [Some(4 * GIB), Some(0), Some(0), Some(4 * GIB)]
            || started.elapsed() > std::time::Duration::from_secs(20)
        {
            break requests;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(
        requests,
        [Some(4 * GIB), Some(0), Some(0), Some(4 * GIB)],
        "(GPU 0: group 0, group 1; GPU 1: ...)"
    );
    for (rank, w) in [w0, w1].into_iter().enumerate() {
        let out = finished(w, &format!("rank {rank}"));
        assert_eq!(done_line(&out), "DONE steps=20 ok=20 oom=0", "rank {rank}:\n{out}");
    }
}

#[test]
fn under_first_use_a_request_that_does_not_fit_fails_the_first_context_there() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB,16GiB");
    let arbiter = Arbiter::start(&gpu);
    // A process that reserves 13 GiB on every visible GPU (the default), and holds 1 GiB.
    let mut holder = gpu.shimmed(env!("CARGO_BIN_EXE_simgpu_probe"));
    holder
        .memory_request("13GiB")
        .group("tp-holder")
        .arbiter_socket(arbiter.socket())
        .args(["hold", "1073741824"]);
    let mut holder = ChildProcess::spawn(&mut holder);
    let _ = holder.ready();
    // A worker reserving 4 GiB at first use starts (cuInit reserves nothing), and its
    // first context, on GPU 1, fails: 4 GiB do not fit beside the 13 GiB guaranteed there.
    let socket = gpu.lib_dir().join("late.sock");
    let first_use = [("GPUFRAC_RESERVE", "first-use")];
    let late = worker_with(&gpu, &arbiter, "tp-late", 1, &socket, &["--steps", "1"], &first_use);
    let out = late.wait_with_output().expect("wait for tp_worker");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("FAILED context CUDA_ERROR_OUT_OF_MEMORY"), "{stderr}");
    assert!(
        stderr.contains("GPUFRAC_MEMORY_REQUEST") && stderr.contains("GPUFRAC_RESERVE"),
        "named: {stderr}"
    );
    // Nothing of its request is reserved on either GPU.
    let seen = status(&arbiter);
    assert!(
        seen.gpus.iter().flat_map(|g| &g.processes).all(|p| !p.group.ends_with("tp-late") || p.request == 0),
        "{seen:?}"
    );
    holder.close_stdin();
    holder.finish();
}
