//! The simulated GPU shares VMM memory between processes as the real driver does: an
//! allocation exported to a POSIX file descriptor and imported by another process (the
//! descriptor passed with SCM_RIGHTS) is the same memory in both; it outlives its maker;
//! the device counts it exactly once throughout, against its owner (the maker, then the
//! importer once the maker let go), and gives it back when the last holder releases it.
//!
//! Runs `tests/c/vmm_share.c` on a private 4 GiB device with 64 MiB contexts.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_share`.

use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

const OVERHEAD: u64 = 64 * MIB;
const SHARED: u64 = 256 * MIB;
const SIMULATOR: &str = "reads what each process holds from simgpu's device state (SIMGPU_STATE)";

/// The device's figures: what each of `pids` holds on device 0, and the device's total.
fn figures(gpu: &SimGpu, pids: &[u32]) -> (Vec<u64>, u64) {
    let machine = gpu.device_state();
    let list = machine.processes(0);
    let held = pids.iter().map(|&pid| list.iter().filter(|p| p.pid == pid).map(|p| p.used).sum()).collect();
    (held, machine.used(0))
}

/// The sum of the words 0..n-1 of the exporter's pattern.
fn pattern_sum(bytes: u64) -> u64 {
    let n = bytes / 4;
    n * (n - 1) / 2
}

#[test]
fn exported_memory_is_one_allocation_in_two_processes_and_outlives_its_maker() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let program = compile_c("vmm_share.c", &[], true);
    let socket = gpu.state_path().with_file_name("share.sock");

    let mut cmd = gpu.command(&program);
    cmd.arg("export").arg(&socket).arg(SHARED.to_string());
    let mut exporter = ChildProcess::spawn(&mut cmd);
    exporter.expect_line(&["READY"], TIMEOUT);
    let (held, total) = figures(&gpu, &[exporter.pid()]);
    assert_eq!(held, [OVERHEAD + SHARED], "the maker holds its context and the allocation");
    assert_eq!(total, OVERHEAD + SHARED);

    let mut cmd = gpu.command(&program);
    cmd.arg("import").arg(&socket).arg(SHARED.to_string());
    let mut importer = ChildProcess::spawn(&mut cmd);
    exporter.expect_line(&["SENT"], TIMEOUT);
    let line = importer.expect_line(&["IMPORTED"], TIMEOUT);
    // The importer read the exporter's pattern, word 0 included (0), before writing it.
    assert_eq!(line, format!("IMPORTED {}", pattern_sum(SHARED)), "the importer sees the exporter's data");
    exporter.write_stdin("check\n");
    assert_eq!(
        exporter.expect_line(&["WORD0"], TIMEOUT),
        format!("WORD0 {}", 0xdead),
        "writes are seen both ways"
    );

    let (pids, both) = ([exporter.pid(), importer.pid()], 2 * OVERHEAD + SHARED);
    let (held, total) = figures(&gpu, &pids);
    assert_eq!(held, [OVERHEAD + SHARED, OVERHEAD], "counted against its maker only, got {held:?}");
    assert_eq!(total, both, "the device counts the shared memory once, got {}", mib(total));

    // The maker releases everything (its descriptor too): the importer owns it now.
    exporter.write_stdin("release\n");
    exporter.expect_line(&["RELEASED"], TIMEOUT);
    let (held, total) = figures(&gpu, &pids);
    assert_eq!(
        held,
        [OVERHEAD, OVERHEAD + SHARED],
        "the importer is charged once the maker let go, got {held:?}"
    );
    assert_eq!(total, both);

    // The maker exits: the memory stays alive, with the same data.
    exporter.close_stdin();
    exporter.expect_line(&["DONE"], TIMEOUT);
    exporter.expect_exit_code(0);
    importer.write_stdin("check\n");
    let expected = pattern_sum(SHARED) + 0xdead;
    assert_eq!(
        importer.expect_line(&["STILL"], TIMEOUT),
        format!("STILL {expected}"),
        "the data outlives its maker"
    );
    let (held, total) = figures(&gpu, &[importer.pid()]);
    assert_eq!(held, [OVERHEAD + SHARED]);
    assert_eq!(total, OVERHEAD + SHARED, "still counted once, got {}", mib(total));

    // The last holder releases it: the device has it back.
    importer.write_stdin("release\n");
    importer.expect_line(&["RELEASED"], TIMEOUT);
    let (held, total) = figures(&gpu, &[importer.pid()]);
    assert_eq!(held, [OVERHEAD]);
    assert_eq!(total, OVERHEAD, "freed with its last holder, got {}", mib(total));
    importer.close_stdin();
    importer.expect_line(&["DONE"], TIMEOUT);
    importer.expect_exit_code(0);
}

#[test]
fn export_needs_the_handle_type_and_an_import_in_the_same_process_is_the_same_memory() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let mut cmd = gpu.command(compile_c("vmm_share.c", &[], true));
    cmd.arg("local").arg((64 * MIB).to_string());
    let mut child = ChildProcess::spawn(&mut cmd);
    let line = child.expect_line(&["LOCAL"], TIMEOUT);
    let fields: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().expect("a number")).collect();
    assert_eq!(
        fields[0], 1,
        "exporting an allocation that did not ask for descriptors: CUDA_ERROR_INVALID_VALUE"
    );
    assert_eq!(fields[1], 1, "the imported handle's properties name POSIX_FILE_DESCRIPTOR");
    assert_eq!(fields[2], 0xbeef, "a write through one mapping is read through the other");
    child.expect_exit_code(0);
    let (_, total) = figures(&gpu, &[]);
    assert_eq!(total, 0, "everything given back at exit");
}
