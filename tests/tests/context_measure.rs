//! A context is charged what it took, whatever its neighbours allocate meanwhile: the shim
//! measures this process's own usage, never the device's, and keeps only clean
//! measurements for the group's later contexts. simgpu makes each context take a while to
//! create (`SIMGPU_CONTEXT_CREATE_TIME`), as a real driver does, while a bare neighbour
//! allocates and frees gigabytes.

use std::process::{Command, Output};

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{
    artifact, compile_c, report_skip, skip_on_real_gpu, unique, ChildProcess, ShimSettings, SimGpu, Skip,
};

const REQUEST: u64 = GIB;
const LIMIT: u64 = 2 * GIB;
/// Allocated by `query.c` after its context.
const QUERY_ALLOC: u64 = 64 * MIB;
const WHY: &str = "simgpu's context overhead and creation time (SIMGPU_CONTEXT_*) to the byte";

/// A bare process that grows by 8 GiB over about 1.3 s (64 MiB every 10 ms), frees it and
/// starts again, until it is dropped: a context created meanwhile sees the device's usage
/// grow by about 2 GiB.
fn churning_neighbour(gpu: &SimGpu) -> ChildProcess {
    let mut cmd = gpu.command(artifact("bursty_server"));
    cmd.args(["--base", "64MiB", "--burst", "8GiB", "--step", "64MiB", "--step-ms", "10"])
        .args(["--hold", "10", "--gap-ms", "0-1", "--bursts", "100000", "--seed", "7"]);
    let mut child = ChildProcess::spawn(&mut cmd);
    child.expect_line(&["READY"], std::time::Duration::from_secs(30));
    child
}

/// `query.c` under the shim in `group`, its context taking 300 ms to create.
fn slow_context_query(gpu: &SimGpu, group: &str) -> Command {
    let mut cmd = gpu.shimmed(compile_c("query.c", &[], false));
    cmd.memory_request(REQUEST.to_string())
        .memory_limit(LIMIT.to_string())
        .group(group)
        .env("SIMGPU_CONTEXT_CREATE_TIME", "300ms");
    cmd
}

/// `held_by_process` from query.c's `INFO <rc> <request> <limit> <held> <mine> <total>`.
fn held_by_process(out: &Output) -> u64 {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "query failed: {stdout}{stderr}");
    let info = stdout.lines().find(|l| l.starts_with("INFO ")).unwrap_or_else(|| panic!("no INFO: {stdout}"));
    let fields: Vec<&str> = info.split_whitespace().collect();
    assert_eq!(fields[1], "0", "{info}");
    fields[5].parse().unwrap_or_else(|_| panic!("{info}"))
}

#[test]
fn a_context_that_takes_no_memory_is_charged_nothing_while_neighbours_allocate() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB").with_context_overhead("0");
    let _neighbour = churning_neighbour(&gpu);
    for round in 0..3 {
        let out = slow_context_query(&gpu, &unique("ctx-zero")).output().expect("run query");
        assert_eq!(
            held_by_process(&out),
            QUERY_ALLOC,
            "round {round}: the context was charged the neighbour's memory"
        );
    }
}

#[test]
fn a_context_is_charged_what_it_took_and_so_are_the_groups_later_contexts() {
    skip_on_real_gpu!(WHY);
    let gpu = SimGpu::new("16GiB").with_context_overhead("256MiB");
    let group = unique("ctx-group");
    // A member that stays: its context, measured before anyone allocates, is the group's
    // clean measurement.
    let mut keeper = gpu.shimmed(artifact("simgpu_probe"));
    keeper
        .args(["hold", &(16 * MIB).to_string()])
        .memory_request(REQUEST.to_string())
        .memory_limit(LIMIT.to_string())
        .group(&group);
    let mut keeper = ChildProcess::spawn(&mut keeper);
    keeper.expect_line(&["READY"], std::time::Duration::from_secs(30));

    let _neighbour = churning_neighbour(&gpu);
    // Later contexts of the group, each created while the neighbour allocates gigabytes.
    for round in 0..3 {
        let out = slow_context_query(&gpu, &group).output().expect("run query");
        assert_eq!(held_by_process(&out), 256 * MIB + QUERY_ALLOC, "round {round}");
    }
    // A member NVML does not list by the PID it knows itself by (its own PID namespace, no
    // arbiter to say its host PID): not measurable, so charged the group's clean
    // measurement, never the device's change. Root makes the namespace; anyone else, in a
    // user namespace of their own that maps their user to itself (the same ledger folder).
    let mut why_not = Vec::new();
    let mut namespace = None;
    for args in [&["--pid", "--fork"][..], &["--user", "--map-current-user", "--pid", "--fork"]] {
        match gpu.command("unshare").args(args).arg("true").output() {
            Ok(out) if out.status.success() => {
                namespace = Some(args);
                break;
            }
            Ok(out) => why_not.push(format!(
                "unshare {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => why_not.push(format!("cannot run unshare: {e}")),
        }
    }
    let Some(namespace) = namespace else {
        report_skip(
            Skip::ThisMachine,
            &format!("the PID-namespace case: cannot make a PID namespace here ({})", why_not.join("; ")),
        );
        return;
    };
    for round in 0..2 {
        let query = slow_context_query(&gpu, &group);
        let mut cmd = gpu.command("unshare");
        cmd.args(namespace).arg(query.get_program());
        for (name, value) in query.get_envs() {
            match value {
                Some(value) => cmd.env(name, value),
                None => cmd.env_remove(name),
            };
        }
        let out = cmd.output().expect("run query in a PID namespace");
        assert_eq!(held_by_process(&out), 256 * MIB + QUERY_ALLOC, "PID namespace, round {round}");
    }
    keeper.close_stdin();
    keeper.finish();
}
