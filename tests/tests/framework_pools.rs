//! Servers as people write them: CuPy (and PyTorch where installed) keep freed memory in
//! their pools, and nothing in the server empties them (`tests/clients/pooled_server.py`
//! calls neither `free_all_blocks` nor `empty_cache`). Started by `gpufrac run` beside an
//! arbiter, such a server gives back what its pool keeps when the memory is wanted: a
//! neighbour's burst waiting for it (the `wait` resolver), a newcomer's guarantee, or after
//! `GPUFRAC_GIVE_BACK_IDLE` without GPU work. The shim reaches the framework through the
//! interpreter in the process: no setting, no start-up hook.
//!
//! The GPU is 4 GiB with 64 MiB contexts; each server is guaranteed 1 GiB and may burst to
//! 3 GiB, holds a 512 MiB model and takes a 2 GiB batch. One server's kept batch and the
//! other's batch do not fit together: without the give-back the second batch waits out
//! `GPUFRAC_WAIT_TIMEOUT` and fails, and a newcomer's guarantee ends the pooled server.

use std::path::PathBuf;
use std::process::Command;

use gpufrac_e2e::clients::{python_with, root, INSTALL};
use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{
    artifact, report_skip, skip_on_real_gpu, unique, wait_for, Arbiter, ChildProcess, ShimSettings, SimGpu,
    Skip, TIMEOUT,
};

const GIB: u64 = 1024 * MIB;
const MODEL: u64 = 512 * MIB;
const BATCH: u64 = 2 * GIB;
/// How long a batch may wait for a neighbour's pool (the bound).
const SERVED_WITHIN: f64 = 1.0;

/// The Python of the first virtual environment that imports torch, if any.
fn torch_python() -> Option<PathBuf> {
    [".venv/torch", ".venv"].iter().map(|venv| root().join(venv).join("bin/python")).find(|python| {
        Command::new(python).args(["-c", "import torch, numpy"]).output().is_ok_and(|o| o.status.success())
    })
}

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

/// `gpufrac run FLAGS --group GROUP-… --arbiter-socket … -- python pooled_server.py`, its
/// model `model` bytes, logging at INFO.
fn pooled_server(
    gpu: &SimGpu,
    arbiter: &Arbiter,
    flags: &[&str],
    group: &str,
    (python, framework): (&PathBuf, &str),
    model: u64,
) -> Command {
    let mut cmd = gpu.command(artifact("gpufrac"));
    cmd.arg("run")
        .args(flags)
        .arg("--group")
        .arg(unique(group))
        .arg("--arbiter-socket")
        .arg(arbiter.socket())
        .arg("--")
        .arg(python)
        .arg(root().join("tests/clients/pooled_server.py"))
        .env("CLIENT_FRAMEWORK", framework)
        .env("CLIENT_MODEL", model.to_string())
        .env("GPUFRAC_LOG", "info")
        .env_remove("PYTHONPATH");
    cmd
}

/// `pooled_server.py` under `gpufrac run` with a 1 GiB request and a 3 GiB limit.
fn server(
    gpu: &SimGpu,
    python: &PathBuf,
    framework: &str,
    arbiter: &Arbiter,
    extra: &[(&str, &str)],
) -> ChildProcess {
    let flags = ["--request", "1GiB", "--limit", "3GiB", "--wait-timeout", "15s"];
    let mut cmd = pooled_server(gpu, arbiter, &flags, "pooled", (python, framework), MODEL);
    for (name, value) in extra {
        cmd.env(name, value);
    }
    let mut child = ChildProcess::spawn(&mut cmd);
    assert_eq!(child.ready()[1], MODEL, "the server's model");
    child.expect_line(&["LOADED"], TIMEOUT);
    child
}

/// `SERVED`'s (start, alloc, end) seconds, or a failure naming what the server said.
fn served(child: &mut ChildProcess, bytes: u64) -> (f64, f64, f64) {
    child.write_stdin(&format!("batch {bytes}\n"));
    let line = child.expect_line(&["SERVED", "OOM"], TIMEOUT);
    assert!(
        line.starts_with("SERVED"),
        "the batch of {} was refused: {line}\n{}",
        mib(bytes),
        child.stderr_text()
    );
    let field = |name: &str| -> f64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name}= in {line}"))
    };
    (field("start"), field("alloc"), field("end"))
}

/// One test of this file at a time: each moves GiBs through simgpu's host memory, and the
/// bound on a wait is about the arbiter and the shim, not about two cores shared by three.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn model_intact(child: &mut ChildProcess) {
    child.write_stdin("check\n");
    assert_eq!(child.expect_line(&["INTACT", "CORRUPT"], TIMEOUT), format!("INTACT {MODEL}"), "the model");
}

fn finish(mut child: ChildProcess) -> String {
    child.close_stdin();
    child.expect_line(&["OK"], TIMEOUT);
    child.expect_exit_code(0);
    let stderr = child.stderr_text();
    assert!(!stderr.contains("Traceback") && !stderr.contains("panicked"), "{stderr}");
    stderr
}

/// Two pooled servers, one batch each: the second is served within a second of the first
/// one's end, with no out-of-memory, from what the first one's pool gave back.
fn second_batch_served_from_the_first_ones_pool(python: &PathBuf, framework: &str, allocator: &str) {
    let _turn = turn();
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    // CuPy's allocator by name (`pooled_server.py`), PyTorch's by its own setting.
    let setting = if framework == "torch" { "PYTORCH_CUDA_ALLOC_CONF" } else { "CLIENT_ALLOCATOR" };
    let allocator = if allocator == "default" { "" } else { allocator };
    let env = [("GPUFRAC_GIVE_BACK_IDLE", "off"), (setting, allocator)];
    let mut first = server(&gpu, python, framework, &arbiter, &env);
    let mut second = server(&gpu, python, framework, &arbiter, &env);
    served(&mut first, BATCH);
    // The first server's pool keeps its batch: the GPU counts it held.
    let kept = gpu.held_by(first.pid(), 0);
    assert!(kept >= MODEL + BATCH, "the pool keeps the batch ({} held)", mib(kept));
    // The second batch starts after the first one's end: what its memory waited is how
    // long after the first batch's end it was served.
    let (_, waited, _) = served(&mut second, BATCH);
    assert!(
        waited <= SERVED_WITHIN,
        "the second batch's memory took {waited:.3} s (within {SERVED_WITHIN} s)"
    );
    model_intact(&mut first);
    model_intact(&mut second);
    let stderr = finish(first);
    assert!(stderr.contains("gave back memory the process kept"), "the first server's log: {stderr}");
    assert!(stderr.contains(framework), "the framework it emptied: {stderr}");
    finish(second);
    assert!(!arbiter.log_text().contains("terminating"), "{}", arbiter.log_text());
}

/// A pooled server and a newcomer whose guarantee needs what the pool keeps: the newcomer
/// has its memory within a second and the server lives on, its model intact.
fn newcomers_guarantee_from_the_pool(python: &PathBuf, framework: &str) {
    let _turn = turn();
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut pooled = server(&gpu, python, framework, &arbiter, &[("GPUFRAC_GIVE_BACK_IDLE", "off")]);
    served(&mut pooled, BATCH);
    // 64 MiB context + 512 MiB model + 2 GiB kept: 1.3 GiB free of 4 GiB. The newcomer's
    // 2 GiB request is admitted (1 + 2 GiB of guarantees) and owed what the pool keeps.
    let mut cmd =
        pooled_server(&gpu, &arbiter, &["--request", "2GiB"], "newcomer", (python, framework), 1536 * MIB);
    let mut newcomer = ChildProcess::spawn(&mut cmd);
    newcomer.ready();
    let loaded = newcomer.expect_line(&["LOADED"], TIMEOUT);
    let took: f64 = loaded
        .split_whitespace()
        .find_map(|w| w.strip_prefix("alloc="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no alloc= in {loaded}"));
    assert!(
        took <= SERVED_WITHIN,
        "the newcomer's guaranteed memory took {took:.3} s (within {SERVED_WITHIN} s)"
    );
    model_intact(&mut pooled);
    assert!(gpu.held_by(pooled.pid(), 0) < MODEL + BATCH, "the pool gave its batch back");
    let log = arbiter.log_text();
    assert!(!log.contains("ending a holder"), "the pooled server was ended: {log}");
    finish(newcomer);
    let stderr = finish(pooled);
    assert!(stderr.contains("gave back memory the process kept"), "{stderr}");
}

/// After `GPUFRAC_GIVE_BACK_IDLE` without GPU work, what the pool keeps above the request
/// goes back with no one asking.
fn idle_pool_goes_back(python: &PathBuf, framework: &str) {
    let _turn = turn();
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let mut pooled = server(&gpu, python, framework, &arbiter, &[("GPUFRAC_GIVE_BACK_IDLE", "2s")]);
    served(&mut pooled, BATCH);
    assert!(gpu.held_by(pooled.pid(), 0) >= MODEL + BATCH, "kept right after the batch");
    // The batch's long calls (a 2 GiB memset on simgpu) look idle while they run: a
    // give-back then finds the pool in use, and the next one comes after twice as long
    // (2, 4, 8 s...): within about four times the setting after the batch ends.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while gpu.held_by(pooled.pid(), 0) >= MODEL + GIB {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle pool was never given back ({} held)\n{}",
            mib(gpu.held_by(pooled.pid(), 0)),
            pooled.stderr_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The loan went back to the arbiter, not just to the driver.
    let lent =
        |s: &gpufrac_daemon::status::Status| s.gpus[0].processes.iter().map(|p| p.granted).sum::<u64>();
    wait_for(&arbiter, "the loan given back to the arbiter", |s| lent(s) == 0);
    model_intact(&mut pooled);
    let stderr = finish(pooled);
    assert!(stderr.contains("(idle)"), "{stderr}");
}

#[test]
fn cupy_second_batch_is_served_from_the_first_servers_pool() {
    skip_on_real_gpu!("the servers are sized to collide on a 4 GiB simgpu device");
    second_batch_served_from_the_first_ones_pool(&python_with(".venv", "cupy", INSTALL), "cupy", "default");
}

/// The same with CuPy allocating from CUDA's stream-ordered pool (`MemoryAsyncPool`).
#[test]
fn cupy_async_pool_second_batch_is_served_from_the_first_servers_pool() {
    skip_on_real_gpu!("the servers are sized to collide on a 4 GiB simgpu device");
    second_batch_served_from_the_first_ones_pool(&python_with(".venv", "cupy", INSTALL), "cupy", "async");
}

const NO_TORCH: &str = "PyTorch is not installed (6.8 GB of CUDA wheels; see tests/requirements-torch.txt)";

/// A scenario as two tests: with CuPy (in the test environment), and with PyTorch where
/// installed (a `pytorch` skip elsewhere).
macro_rules! with_cupy_and_torch {
    ($cupy:ident, $torch:ident, $scenario:ident) => {
        #[test]
        fn $cupy() {
            skip_on_real_gpu!("the servers are sized for a 4 GiB simgpu device");
            $scenario(&python_with(".venv", "cupy", INSTALL), "cupy");
        }

        #[test]
        fn $torch() {
            skip_on_real_gpu!("the servers are sized for a 4 GiB simgpu device");
            let Some(python) = torch_python() else { return report_skip(Skip::PyTorch, NO_TORCH) };
            $scenario(&python, "torch");
        }
    };
}

with_cupy_and_torch!(
    cupy_newcomers_guarantee_is_paid_from_the_pool_and_the_server_lives,
    torch_newcomers_guarantee_is_paid_from_the_pool_and_the_server_lives,
    newcomers_guarantee_from_the_pool
);
with_cupy_and_torch!(
    cupy_idle_pool_goes_back_by_itself,
    torch_idle_pool_goes_back_by_itself,
    idle_pool_goes_back
);
with_cupy_and_torch!(
    cupy_parking_a_pooled_server_moves_only_what_is_in_use,
    torch_parking_a_pooled_server_moves_only_what_is_in_use,
    parking_moves_only_what_is_in_use
);

#[test]
fn torch_second_batch_is_served_from_the_first_servers_pool() {
    skip_on_real_gpu!("the servers are sized to collide on a 4 GiB simgpu device");
    let Some(python) = torch_python() else { return report_skip(Skip::PyTorch, NO_TORCH) };
    // Each setting of PyTorch's caching allocator keeps freed memory its own way.
    for conf in ["default", "expandable_segments:True", "backend:cudaMallocAsync"] {
        eprintln!("PYTORCH_CUDA_ALLOC_CONF={conf}");
        second_batch_served_from_the_first_ones_pool(&python, "torch", conf);
    }
}

/// A parkable pooled server, idle, is parked for a newcomer: its pool is emptied first,
/// so only the model (512 MiB) is copied to host RAM, not the 2 GiB the pool keeps; woken
/// by its next command, its model is intact.
fn parking_moves_only_what_is_in_use(python: &PathBuf, framework: &str) {
    let _turn = turn();
    let gpu = gpu();
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("park.sock"),
        &["--oversubscribe", "3", "--park-with", "shim"],
    );
    let parkable = |request: &str, limit: &str, model: u64, park_after: &str, group: &str| {
        let flags =
            ["--request", request, "--limit", limit, "--park-after", park_after, "--wait-timeout", "30s"];
        let mut cmd = pooled_server(&gpu, &arbiter, &flags, group, (python, framework), model);
        cmd.env("GPUFRAC_GIVE_BACK_IDLE", "off");
        ChildProcess::spawn(&mut cmd)
    };
    let mut pooled = parkable("1GiB", "3GiB", MODEL, "1s", "pooled");
    pooled.ready();
    pooled.expect_line(&["LOADED"], TIMEOUT);
    served(&mut pooled, BATCH);
    assert!(gpu.held_by(pooled.pid(), 0) >= MODEL + BATCH, "the pool keeps the batch");
    // 1 GiB + 3 GiB of parkable requests on a 4 GiB GPU less the contexts: the newcomer's
    // 2.5 GiB model needs the idle server parked.
    let mut newcomer = parkable("3GiB", "3GiB", 2560 * MIB, "1h", "newcomer");
    newcomer.ready();
    newcomer.expect_line(&["LOADED"], TIMEOUT);
    let stderr = pooled.stderr_text();
    let parked =
        stderr.lines().find(|l| l.contains("parked: device memory moved to host RAM")).unwrap_or_else(|| {
            panic!("the pooled server was not parked by the shim: {stderr}\n{}", arbiter.log_text())
        });
    let moved: u64 = gpufrac_e2e::log_field(parked, "host_bytes").and_then(|v| v.parse().ok()).expect(parked);
    assert!(
        (MODEL..=MODEL + 64 * MIB).contains(&moved),
        "parking copied {} to host RAM, the model being {}: {parked}",
        mib(moved),
        mib(MODEL)
    );
    // Emptied when the newcomer's guarantee asked, or at the latest by the park itself.
    assert!(stderr.contains("gave back memory the process kept"), "{stderr}");
    finish(newcomer);
    model_intact(&mut pooled);
    finish(pooled);
}

/// A native server with a pool of its own (`bursty_server --pooled`) that registered its
/// release with `gpufrac_on_give_back`: a neighbour's burst waiting for what the pool
/// keeps is served within a second, with no out-of-memory error, by that release.
#[test]
fn a_native_pools_registered_release_serves_a_neighbours_burst() {
    skip_on_real_gpu!("the servers are sized to collide on a 4 GiB simgpu device");
    let _turn = turn();
    let gpu = gpu();
    let arbiter = Arbiter::start(&gpu);
    let bursty = |linger: &str| {
        let mut cmd = gpu.shimmed(artifact("bursty_server"));
        cmd.memory_request("1GiB")
            .memory_limit("3GiB")
            .wait_timeout("15s")
            .arbiter_socket(arbiter.socket())
            .group(unique("native"))
            .log("info")
            .env("GPUFRAC_GIVE_BACK_IDLE", "off")
            .args(["--pooled", "--base", "512MiB", "--burst", "2GiB", "--step", "64MiB", "--hold", "0"])
            .args(["--bursts", "1", "--gap-ms", "0-0", "--linger-ms", linger]);
        ChildProcess::spawn(&mut cmd)
    };
    // The first keeps its burst in its pool, and lingers.
    let mut first = bursty("60000");
    first.ready();
    let line = first.expect_line(&["BURST"], TIMEOUT);
    assert!(line.starts_with("BURST 0 ok"), "{line}");
    assert!(gpu.held_by(first.pid(), 0) >= MODEL + BATCH, "the pool keeps the burst");
    let mut second = bursty("0");
    second.ready();
    let line = second.expect_line(&["BURST"], TIMEOUT);
    assert!(line.starts_with("BURST 0 ok"), "the neighbour's burst: {line}\n{}", first.stderr_text());
    let waited: u64 = gpufrac_e2e::log_field(&line, "wait_ms").and_then(|v| v.parse().ok()).expect(&line);
    assert!(waited <= 1000, "the neighbour's burst waited {waited} ms for the pool: {line}");
    second.expect_line(&["DONE"], TIMEOUT);
    first.kill();
    let stderr = first.stderr_text();
    assert!(
        stderr.contains("gave back memory the process kept") && stderr.contains("registered=1"),
        "{stderr}"
    );
}
