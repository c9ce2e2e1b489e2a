//! The simulated GPU shares `cuMemAlloc` memory between processes with legacy IPC
//! handles as the CUDA driver API reference describes (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle`, `cuIpcCloseMemHandle`): the importer maps the exporter's memory
//! (the same bytes, no new allocation), a context that opens a handle twice gets the same
//! pointer, the exporting process cannot open its own handle, and the device counts the
//! memory once, against one holder at a time: the exporter, then (after the exporter's
//! `cuMemFree`, which the documentation calls undefined while importers keep it open) the
//! next holder, until the last one closes it. Peer access follows `cuCtxEnablePeerAccess`'s
//! documented errors.
//!
//! Runs `tests/c/ipc_share.c` bare (no shim) on private devices with 64 MiB contexts.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_ipc`.

use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

const OVERHEAD: u64 = 64 * MIB;
const SHARED: u64 = 256 * MIB;
const SIMULATOR: &str = "reads what each process holds from simgpu's device state (SIMGPU_STATE)";

fn figures(gpu: &SimGpu, pids: &[u32]) -> (Vec<u64>, u64) {
    let machine = gpu.device_state();
    let list = machine.processes(0);
    let held = pids.iter().map(|&pid| list.iter().filter(|p| p.pid == pid).map(|p| p.used).sum()).collect();
    (held, machine.used(0))
}

fn pattern_sum(bytes: u64) -> u64 {
    let n = bytes / 4;
    n * (n - 1) / 2
}

fn handle_of(exporter: &mut ChildProcess) -> String {
    let line = exporter.expect_line(&["HANDLE"], TIMEOUT);
    line.split_whitespace().nth(1).expect("HANDLE <hex>").to_owned()
}

#[test]
fn an_ipc_handle_maps_the_same_memory_counted_once_until_its_last_holder_closes_it() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let program = compile_c("ipc_share.c", &[], true);

    let mut cmd = gpu.command(&program);
    cmd.arg("export").arg(SHARED.to_string());
    let mut exporter = ChildProcess::spawn(&mut cmd);
    let handle = handle_of(&mut exporter);
    assert_eq!(figures(&gpu, &[exporter.pid()]), (vec![OVERHEAD + SHARED], OVERHEAD + SHARED));

    // The exporting process cannot open its own handle.
    exporter.write_stdin(&format!("open {handle}\n"));
    assert_eq!(exporter.expect_line(&["OPEN"], TIMEOUT), "OPEN 201", "CUDA_ERROR_INVALID_CONTEXT");

    let mut cmd = gpu.command(&program);
    cmd.arg("import").arg(&handle).arg(SHARED.to_string());
    let mut importer = ChildProcess::spawn(&mut cmd);
    assert_eq!(importer.expect_line(&["OPENED"], TIMEOUT), "OPENED 0");
    assert_eq!(
        importer.expect_line(&["IMPORTED"], TIMEOUT),
        format!("IMPORTED {} 1", pattern_sum(SHARED)),
        "the importer reads the exporter's data, and a second open gives the same pointer"
    );
    exporter.write_stdin("word\n");
    assert_eq!(
        exporter.expect_line(&["WORD0"], TIMEOUT),
        format!("WORD0 {}", 0xdead),
        "one memory, both ways"
    );

    let pids = [exporter.pid(), importer.pid()];
    let (held, total) = figures(&gpu, &pids);
    assert_eq!(held, [OVERHEAD + SHARED, OVERHEAD], "charged to the exporter only, got {held:?}");
    assert_eq!(total, 2 * OVERHEAD + SHARED, "no new allocation, got {}", mib(total));

    // An imported pointer is not freed with cuMemFree; one close of two opens keeps it.
    importer.write_stdin("free\nclose\nword\n");
    assert_eq!(importer.expect_line(&["FREE"], TIMEOUT), "FREE 1", "CUDA_ERROR_INVALID_VALUE");
    assert_eq!(importer.expect_line(&["CLOSED"], TIMEOUT), "CLOSED 0");
    assert_eq!(importer.expect_line(&["WORD0"], TIMEOUT), format!("WORD0 {}", 0xdead));

    // The exporter frees while the importer keeps it open: the memory lives on, charged to
    // the importer now (the driver's dup list), still once.
    exporter.write_stdin("free\n");
    assert_eq!(exporter.expect_line(&["FREED"], TIMEOUT), "FREED 0");
    let (held, total) = figures(&gpu, &pids);
    assert_eq!(held, [OVERHEAD, OVERHEAD + SHARED], "the importer holds it now, got {held:?}");
    assert_eq!(total, 2 * OVERHEAD + SHARED);
    importer.write_stdin("word\n");
    assert_eq!(importer.expect_line(&["WORD0"], TIMEOUT), format!("WORD0 {}", 0xdead), "the data lives on");

    // A handle whose memory another process opened once more, after the free: still valid
    // while held. The last close gives it back to the device.
    importer.write_stdin("close\n");
    assert_eq!(importer.expect_line(&["CLOSED"], TIMEOUT), "CLOSED 0");
    let (held, total) = figures(&gpu, &pids);
    assert_eq!(held, [OVERHEAD, OVERHEAD], "freed with its last holder, got {held:?}");
    assert_eq!(total, 2 * OVERHEAD);
    importer.write_stdin("close\n");
    assert_eq!(importer.expect_line(&["CLOSED"], TIMEOUT), "CLOSED 1", "nothing left to close");

    // Freed everywhere: the handle opens nothing any more.
    let mut cmd = gpu.command(&program);
    cmd.arg("import").arg(&handle).arg(SHARED.to_string());
    let mut late = ChildProcess::spawn(&mut cmd);
    assert_eq!(late.expect_line(&["OPENED"], TIMEOUT), "OPENED 1", "a freed allocation's handle is invalid");
    for p in [&mut exporter, &mut importer, &mut late] {
        p.close_stdin();
        p.expect_line(&["DONE"], TIMEOUT);
        p.expect_exit_code(0);
    }
}

#[test]
fn memory_an_importer_holds_outlives_the_exporting_process() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let program = compile_c("ipc_share.c", &[], true);
    let mut cmd = gpu.command(&program);
    cmd.arg("export").arg(SHARED.to_string());
    let mut exporter = ChildProcess::spawn(&mut cmd);
    let handle = handle_of(&mut exporter);
    let mut cmd = gpu.command(&program);
    cmd.arg("import").arg(&handle).arg(SHARED.to_string());
    let mut importer = ChildProcess::spawn(&mut cmd);
    importer.expect_line(&["IMPORTED"], TIMEOUT);
    exporter.kill();
    let mut last = (vec![], 0);
    for _ in 0..100 {
        last = figures(&gpu, &[importer.pid()]);
        if last == (vec![OVERHEAD + SHARED], OVERHEAD + SHARED) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(last, (vec![OVERHEAD + SHARED], OVERHEAD + SHARED), "the importer holds it alone");
    importer.write_stdin("word\n");
    assert_eq!(importer.expect_line(&["WORD0"], TIMEOUT), format!("WORD0 {}", 0xdead));
    importer.close_stdin();
    importer.expect_line(&["DONE"], TIMEOUT);
    importer.expect_exit_code(0);
    assert_eq!(gpu.device_state().used(0), 0, "freed with its last holder");
}

#[test]
fn peer_access_follows_the_documented_answers() {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = SimGpu::new("4GiB,4GiB").with_context_overhead("64MiB");
    let mut cmd = gpu.command(compile_c("ipc_share.c", &[], true));
    cmd.arg("peer");
    let mut child = ChildProcess::spawn(&mut cmd);
    // can 0->1, 1->0, 0->0; enable 0; again 704 (ALREADY_ENABLED); to itself 201
    // (INVALID_CONTEXT); flags 1 (INVALID_VALUE); disable 0; again 705 (NOT_ENABLED);
    // enable after disable 0.
    assert_eq!(child.expect_line(&["PEER"], TIMEOUT), "PEER 1 1 0 0 704 201 1 0 705 0");
    child.expect_exit_code(0);
    let machine = gpu.device_state();
    assert_eq!((machine.used(0), machine.used(1)), (0, 0));
}
