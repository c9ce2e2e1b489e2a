//! Groups leave nothing in `/dev/shm`: two members that exit at the same moment remove
//! their ledger (the second to take the table sees the first gone), and a ledger whose
//! members were all killed (SIGKILL, or SIGTERM, whose default action runs no exit
//! handler) is removed by the next process of the user at its first CUDA call, not at
//! load. Real processes on simgpu.
//!
//! The tests here take turns: a sweep by one test's process could remove the other's
//! stale ledger before it is looked at. (Another gpufrac run of the same user at the same
//! time could too; the assertion says so.)

use std::process::Command;
use std::sync::{Mutex, PoisonError};

use gpufrac_e2e::size::MIB;
use gpufrac_e2e::{compile_c, ledger_path, unique, ChildProcess, ShimSettings, SimGpu};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `alloc_paths` under the shim in `group`, holding 16 MiB until its stdin closes.
fn member(gpu: &SimGpu, group: &str) -> Command {
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("256MiB").memory_limit(gpu.plus_real_context("512MiB")).group(group).args([
        "alloc",
        &(16 * MIB).to_string(),
        &(16 * MIB).to_string(),
    ]);
    cmd
}

/// The member exits through `exit` (its exit handlers run). Its own check that the
/// group's free memory came back may fail with status 4: the other member, exiting at the
/// same moment, gives its memory back between the two readings.
fn exits_normally(member: &mut ChildProcess) {
    let status = member.wait(gpufrac_e2e::TIMEOUT);
    let text = member.diagnostics();
    let raced = status.code() == Some(4) && text.contains("memory not given back");
    assert!(status.code() == Some(0) || raced, "{text}");
}

#[test]
fn two_members_exiting_at_the_same_moment_leave_no_ledger() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let gpu = SimGpu::new("2GiB").with_context_overhead("64MiB");
    for round in 0..20 {
        let group = unique("together");
        let mut a = ChildProcess::spawn(&mut member(&gpu, &group));
        let mut b = ChildProcess::spawn(&mut member(&gpu, &group));
        a.ready();
        b.ready();
        assert!(ledger_path(&group).exists(), "round {round}: the members share a ledger");
        a.close_stdin();
        b.close_stdin();
        exits_normally(&mut a);
        exits_normally(&mut b);
        assert!(
            !ledger_path(&group).exists(),
            "round {round}: {} was left behind",
            ledger_path(&group).display()
        );
    }
}

#[test]
fn a_ledger_whose_members_were_killed_goes_at_the_next_first_cuda_call() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let gpu = SimGpu::new("2GiB").with_context_overhead("64MiB");
    let killed = unique("killed");
    let terminated = unique("terminated");
    let mut k = ChildProcess::spawn(&mut member(&gpu, &killed));
    let mut t = ChildProcess::spawn(&mut member(&gpu, &terminated));
    k.ready();
    t.ready();
    k.kill();
    // SAFETY: signalling a child of ours that has not been reaped (its pid is not reused).
    assert_eq!(unsafe { libc::kill(t.pid() as libc::pid_t, libc::SIGTERM) }, 0);
    k.wait(gpufrac_e2e::TIMEOUT);
    t.wait(gpufrac_e2e::TIMEOUT);
    let stale = [ledger_path(&killed), ledger_path(&terminated)];
    let left = "left (unless another gpufrac process of this user joined a group meanwhile)";
    assert!(stale.iter().all(|p| p.exists()), "no exit handler ran, so both ledgers are {left}");

    // A process under the shim that never calls CUDA does nothing, sweeping included.
    let status = Command::new("/bin/true")
        .preload_shim()
        .memory_request("256MiB")
        .group(unique("idle"))
        .status()
        .expect("run /bin/true");
    assert!(status.success());
    assert!(stale.iter().all(|p| p.exists()), "nothing is swept at load: both are {left}");

    // The next member of any group removes both at its first CUDA call, and its own at exit.
    let next = unique("next");
    let mut n = ChildProcess::spawn(&mut member(&gpu, &next));
    n.ready();
    for path in &stale {
        assert!(!path.exists(), "{} was not swept", path.display());
    }
    n.finish();
    assert!(!ledger_path(&next).exists());
}
