//! Memory shared with legacy IPC handles under the shim, counted once: an allocation
//! whose handle was taken stays charged to the exporter's group after its `cuMemFree`
//! (an importer may keep it alive, where no hook of the exporter sees it, as simgpu
//! models from the driver's documentation), so a loop of export, free and allocate
//! cannot pass the limit; the importer is never charged for what it opens (the same
//! physical memory, on the GPU that holds it), and its backstop finds nothing uncounted
//! while the exporter holds the memory.
//!
//! Runs `tests/c/ipc_share.c` on a private 4 GiB device with 64 MiB contexts.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test shim_ipc`.

use gpufrac_e2e::shim::ShimSettings;
use gpufrac_e2e::size::{mib, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, ChildProcess, SimGpu, TIMEOUT};

const OVERHEAD: u64 = 64 * MIB;
const SHARED: u64 = 256 * MIB;
const SIMULATED: &str = "frees memory an importer keeps open, whose fate the real driver leaves undefined";

fn held(gpu: &SimGpu, pid: u32) -> u64 {
    gpu.device_state().processes(0).iter().filter(|p| p.pid == pid).map(|p| p.used).sum()
}

#[test]
fn memory_an_importer_keeps_stays_charged_to_the_exporter_and_never_to_the_importer() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    let program = compile_c("ipc_share.c", &[], true);

    // The exporter's group: 512 MiB, its context and the shared 256 MiB in it.
    let mut cmd = gpu.shimmed(&program);
    cmd.arg("export").arg(SHARED.to_string()).memory_request("512MiB").memory_limit("512MiB");
    cmd.env("GPUFRAC_GROUP", "exporter");
    let mut exporter = ChildProcess::spawn(&mut cmd);
    let line = exporter.expect_line(&["HANDLE"], TIMEOUT);
    let handle = line.split_whitespace().nth(1).expect("HANDLE <hex>").to_owned();

    // The importer's group: 128 MiB, half of it its context. It opens 256 MiB.
    let mut cmd = gpu.shimmed(&program);
    cmd.arg("import").arg(&handle).arg(SHARED.to_string()).memory_request("128MiB").memory_limit("128MiB");
    cmd.env("GPUFRAC_GROUP", "importer");
    let mut importer = ChildProcess::spawn(&mut cmd);
    assert_eq!(importer.expect_line(&["OPENED"], TIMEOUT), "OPENED 0", "opening takes no new memory");
    importer.expect_line(&["IMPORTED"], TIMEOUT);
    // Not charged for it: 32 MiB fit beside its context, then 64 MiB more do not; that
    // refusal makes the importer's backstop look at the device's count, which shows it
    // holding what it charged, so the last 32 MiB of its slice still fit.
    importer.write_stdin("alloc 33554432\nalloc 67108864\nalloc 33554432\n");
    for (expected, what) in [(0, "32 MiB beside the context"), (2, "past the limit"), (0, "the last 32 MiB")]
    {
        assert_eq!(
            importer.expect_line(&["ALLOC"], TIMEOUT),
            format!("ALLOC {expected}"),
            "importer: {what}"
        );
    }
    assert_eq!(
        held(&gpu, importer.pid()),
        OVERHEAD + 64 * MIB,
        "the device counts the importer's own memory only"
    );
    assert_eq!(held(&gpu, exporter.pid()), OVERHEAD + SHARED, "and the shared memory against the exporter");

    // The exporter frees while the importer keeps the memory open: the memory lives on
    // (the device now counts it against the importer), and stays charged to the
    // exporter's group, which cannot allocate it again past its limit.
    exporter.write_stdin("free\n");
    assert_eq!(exporter.expect_line(&["FREED"], TIMEOUT), "FREED 0");
    assert_eq!(held(&gpu, importer.pid()), 2 * OVERHEAD + SHARED, "the importer keeps the memory alive");
    exporter.write_stdin(&format!("alloc {SHARED}\nalloc {}\n", 192 * MIB));
    assert_eq!(
        exporter.expect_line(&["ALLOC"], TIMEOUT),
        "ALLOC 2",
        "the freed-but-shared 256 MiB is still the exporter's: 256 MiB more would pass its 512 MiB"
    );
    assert_eq!(
        exporter.expect_line(&["ALLOC"], TIMEOUT),
        "ALLOC 0",
        "what the limit leaves beside the context and the shared memory fits"
    );
    let device = gpu.device_state().used(0);
    assert_eq!(
        device,
        2 * OVERHEAD + 64 * MIB + SHARED + 192 * MIB,
        "the device holds the shared memory once, got {}",
        mib(device)
    );

    for p in [&mut exporter, &mut importer] {
        p.close_stdin();
        p.expect_line(&["DONE"], TIMEOUT);
        p.expect_exit_code(0);
    }
}
