//! No way past the limit: a program tries, as a hostile or merely unusual one would, to
//! hold more device memory than its limit, and what the device itself reports the process
//! holding (simgpu's per-process figure, the one NVML reports) never passes the limit.
//! Each case runs `tests/c/escapes.c` under the shim on a simulated 4 GiB device.
//! Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test escapes`.

use std::time::Duration;

use gpufrac_e2e::size::{mib, GIB, MIB};
use gpufrac_e2e::{artifact, compile_c, skip_on_real_gpu, Arbiter, ChildProcess, ShimSettings, SimGpu};

const DEVICE: &str = "4GiB";
const LIMIT: u64 = 512 * MIB;
const CHUNK: u64 = 16 * MIB;
const SIMULATED: &str = "reads simgpu's own per-process figure and sizes a 4 GiB simulated device";

/// Starts `escapes CASE CHUNK [ARG]` under the shim with a 256 MiB request and a 512 MiB
/// limit, plus `env`.
fn start(gpu: &SimGpu, case: &str, arg: Option<&str>, env: &[(&str, &str)]) -> ChildProcess {
    let mut cmd = gpu.shimmed(compile_c("escapes.c", &[], false));
    cmd.arg(case).arg(CHUNK.to_string());
    if let Some(arg) = arg {
        cmd.arg(arg);
    }
    cmd.memory_request("256MiB").memory_limit(LIMIT.to_string());
    for (k, v) in env {
        cmd.env(k, v);
    }
    ChildProcess::spawn(&mut cmd)
}

/// The numbers on the child's line starting with `word`.
fn line(child: &mut ChildProcess, word: &str) -> Vec<i64> {
    let text = child.expect_line(&[word], Duration::from_secs(60));
    text.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect()
}

/// Reads `HELD`, checks the device's own figure for the process against the limit, and
/// lets the child go. Returns (held, the error that ended the allocations, the figure).
fn held_within_limit(gpu: &SimGpu, child: &mut ChildProcess, case: &str) -> (u64, i64, u64) {
    let held = line(child, "HELD");
    let figure = gpu.held_by(child.pid(), 0);
    assert!(
        figure <= LIMIT,
        "{case}: the device reports the process holding {}, past its {} limit\n{}",
        mib(figure),
        mib(LIMIT),
        child.diagnostics()
    );
    child.close_stdin();
    child.expect_exit_code(0);
    (held[0] as u64, held[1], figure)
}

#[test]
fn a_process_whose_start_was_refused_gets_no_device_memory_on_any_path() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // A request larger than the device: cuInit fails, and the program carries on.
    let mut child =
        start(&gpu, "refused", None, &[("GPUFRAC_MEMORY_REQUEST", "8GiB"), ("GPUFRAC_MEMORY_LIMIT", "8GiB")]);
    assert_eq!(line(&mut child, "init"), vec![3], "cuInit answers CUDA_ERROR_NOT_INITIALIZED");
    assert_eq!(line(&mut child, "retain"), vec![3], "no context after a refused start");
    let (held, error, figure) = held_within_limit(&gpu, &mut child, "refused");
    assert_eq!((held, error), (0, 3), "every allocation answers cuInit's error");
    assert_eq!(figure, 0, "the device holds nothing for the process");
}

#[test]
fn a_process_the_arbiter_refused_gets_no_device_memory_either() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    let arbiter = Arbiter::start(&gpu);
    let socket = arbiter.socket().to_str().expect("a UTF-8 path").to_owned();
    let guaranteed = [("GPUFRAC_ARBITER_SOCKET", socket.as_str())];
    // A is guaranteed 3.5 GiB of the 4 GiB; B's 1 GiB request cannot be admitted.
    let mut a = start(
        &gpu,
        "contexts",
        Some("1"),
        &[("GPUFRAC_MEMORY_REQUEST", "3584MiB"), ("GPUFRAC_MEMORY_LIMIT", "3584MiB"), guaranteed[0]],
    );
    line(&mut a, "HELD");
    let mut b = start(
        &gpu,
        "refused",
        None,
        &[("GPUFRAC_MEMORY_REQUEST", "1GiB"), ("GPUFRAC_MEMORY_LIMIT", "1GiB"), guaranteed[0]],
    );
    assert_eq!(
        line(&mut b, "init"),
        vec![3],
        "cuInit answers CUDA_ERROR_NOT_INITIALIZED\n{}",
        b.diagnostics()
    );
    assert_eq!(line(&mut b, "retain"), vec![3], "no context after a refused start");
    let (held, error, figure) = held_within_limit(&gpu, &mut b, "refused by the arbiter");
    assert_eq!(
        (held, error, figure),
        (0, 3, 0),
        "every allocation answers cuInit's error; the device holds nothing"
    );
    a.close_stdin();
    a.expect_exit_code(0);
}

#[test]
fn memory_in_the_seventieth_context_is_counted() {
    skip_on_real_gpu!(SIMULATED);
    // Small contexts, so that 70 fit under the limit.
    let gpu = SimGpu::new(DEVICE).with_context_overhead("1MiB");
    let mut child = start(&gpu, "contexts", Some("70"), &[]);
    assert_eq!(line(&mut child, "CONTEXTS"), vec![70, 0], "70 contexts of 1 MiB fit in 512 MiB");
    let (held, error, figure) = held_within_limit(&gpu, &mut child, "contexts");
    assert_eq!(error, 2, "the allocations end in CUDA_ERROR_OUT_OF_MEMORY");
    assert!(
        held + 70 * MIB <= LIMIT && held + 70 * MIB + CHUNK > LIMIT,
        "held {} beside 70 contexts",
        mib(held)
    );
    assert!(figure >= held, "the device figure {} includes the {} held", mib(figure), mib(held));
}

#[test]
fn a_destroyed_context_gives_back_exactly_what_was_allocated_in_it() {
    skip_on_real_gpu!(SIMULATED);
    // One device: the allocation hooks do not ask for the current context, and the
    // teardown must still tell the two contexts' allocations apart.
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    let mut child = start(&gpu, "teardown", Some(&(128 * MIB).to_string()), &[]);
    for step in ["kept", "context", "in-context", "destroyed"] {
        assert_eq!(line(&mut child, step), vec![0], "{step} succeeds\n{}", child.diagnostics());
    }
    let (held, error, figure) = held_within_limit(&gpu, &mut child, "teardown");
    assert_eq!(error, 2, "the allocations end in CUDA_ERROR_OUT_OF_MEMORY");
    // The primary context (64 MiB) and the 128 MiB kept in it stay charged; the created
    // context and the 128 MiB allocated in it went with it. Counted too long, the room left
    // would be 192 MiB; too short, past the limit on the device.
    assert_eq!(
        held,
        LIMIT - 64 * MIB - 128 * MIB,
        "after the teardown the group may hold its limit less the primary context and what stayed in it (device figure {})",
        mib(figure)
    );
}

#[test]
fn memory_taken_past_every_hook_is_charged_from_the_device_count() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    let driver = artifact("libsimgpu_cuda.so");
    let hidden = 200 * MIB;
    let mut child = start(
        &gpu,
        "bypass",
        Some(&hidden.to_string()),
        &[("ESCAPES_PRIVATE_DRIVER", driver.to_str().expect("a UTF-8 path"))],
    );
    assert_eq!(line(&mut child, "shimmed"), vec![0]);
    assert_eq!(line(&mut child, "private_alloc"), vec![0], "the private copy allocates unseen");
    assert_eq!(line(&mut child, "past_limit"), vec![2], "1 TiB is refused");
    let held = line(&mut child, "HELD");
    let figure = gpu.held_by(child.pid(), 0);
    // The shim's own context and first chunk, the private copy's context and its hidden
    // allocation: once a refusal made the shim look at the device's count, what it lets
    // the program hold besides stays under the limit (the unseen memory itself cannot be
    // stopped, only counted).
    let shimmed = 64 * MIB + CHUNK + held[0] as u64;
    let unseen = 64 * MIB + hidden;
    assert_eq!(held[1], 2, "the allocations end in CUDA_ERROR_OUT_OF_MEMORY");
    assert!(
        shimmed + unseen <= LIMIT + 2 * MIB && figure <= LIMIT + 2 * MIB,
        "held {} through the shim beside {} unseen: the device reports {} against a {} limit\n{}",
        mib(shimmed),
        mib(unseen),
        mib(figure),
        mib(LIMIT),
        child.diagnostics()
    );
    child.close_stdin();
    child.expect_exit_code(0);
    // Read once the child is gone: its stderr is then all collected.
    assert!(
        child.stderr_text().contains("more than gpufrac counted"),
        "the shim says it found uncounted memory\n{}",
        child.diagnostics()
    );
}

#[test]
fn a_primary_context_retained_by_two_threads_at_once_is_charged_once_and_given_back() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // A slow context creation, so that both threads find the context inactive; five
    // rounds of retaining it from two threads at once and releasing it twice.
    let mut child = start(&gpu, "race", Some("5"), &[("SIMGPU_CONTEXT_CREATE_TIME", "50ms")]);
    assert_eq!(line(&mut child, "race_failures"), vec![0], "every retain and release succeeds");
    let (held, error, _) = held_within_limit(&gpu, &mut child, "race");
    assert_eq!(error, 2, "the allocations end in CUDA_ERROR_OUT_OF_MEMORY");
    // Each round's context was charged once and given back once: the slice is whole.
    assert!(
        held + 64 * MIB <= LIMIT && held + 64 * MIB + CHUNK > LIMIT,
        "held {} beside one 64 MiB context, of a {} limit",
        mib(held),
        mib(LIMIT)
    );
}

#[test]
fn a_device_heap_is_charged_and_one_past_the_limit_refused() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // 4 GiB of heap under a 512 MiB limit (PyTorch's and numba's kernels malloc there).
    let mut child = start(&gpu, "heap", Some(&(4 * GIB).to_string()), &[]);
    assert_eq!(line(&mut child, "heap"), vec![2], "a 4 GiB heap is refused as out of memory");
    held_within_limit(&gpu, &mut child, "heap 4 GiB");
    // 128 MiB of heap (8 MiB by default, in the context's own memory): the 120 MiB more
    // are the group's.
    let mut child = start(&gpu, "heap", Some(&(128 * MIB).to_string()), &[]);
    assert_eq!(line(&mut child, "heap"), vec![0], "a 128 MiB heap fits");
    let (held, error, _) = held_within_limit(&gpu, &mut child, "heap 128 MiB");
    assert_eq!(error, 2);
    let room = LIMIT - 64 * MIB - 120 * MIB;
    assert!(held <= room && held + CHUNK > room, "held {} beside the context and its heap", mib(held));
}

#[test]
fn a_stack_past_the_limit_is_refused() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // 4 KiB per thread: 3 KiB more than the default for each of the device's resident
    // threads (simgpu: 132 multiprocessors of 2048), 792 MiB past a 512 MiB limit.
    let mut child = start(&gpu, "stack", Some("4096"), &[]);
    assert_eq!(line(&mut child, "stack"), vec![2], "the stack is refused as out of memory");
    let (held, error, _) = held_within_limit(&gpu, &mut child, "stack");
    assert_eq!(error, 2);
    assert!(
        held + 64 * MIB + CHUNK > LIMIT,
        "nothing of the refused stack stays charged: held {}",
        mib(held)
    );
}

#[test]
fn arrays_in_video_and_compressed_formats_are_charged() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // (CUarray_format, bytes of one 4096x4096 array): NV12 (luma and half-size
    // interleaved chroma), BC7 (16 bytes per 4x4 block), UNORM_INT8X4 (4-byte texels).
    for (format, bytes) in [(0xb0, 24 * MIB), (0x9d, 16 * MIB), (0xc2, 64 * MIB)] {
        let mut cmd = gpu.shimmed(compile_c("escapes.c", &[], false));
        cmd.arg("arrays")
            .arg(bytes.to_string())
            .arg(format.to_string())
            .memory_request("256MiB")
            .memory_limit(LIMIT.to_string());
        let mut child = ChildProcess::spawn(&mut cmd);
        let (held, error, _) = held_within_limit(&gpu, &mut child, &format!("arrays of format {format:#x}"));
        assert_eq!(error, 2, "format {format:#x}: the arrays end in CUDA_ERROR_OUT_OF_MEMORY");
        let room = LIMIT - 64 * MIB;
        assert!(held <= room && held + bytes > room, "format {format:#x}: {} of arrays", mib(held));
    }
}

#[test]
fn module_code_and_globals_are_charged() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // 100 modules of 8 MiB: only what the limit leaves loads.
    let mut child = start(&gpu, "modules", Some("100"), &[("SIMGPU_MODULE_BYTES", "8MiB")]);
    let modules = line(&mut child, "MODULES");
    assert_eq!(modules[1], 2, "the module past the limit is refused as out of memory");
    let loaded = modules[0] as u64;
    assert_eq!(loaded, (LIMIT - 64 * MIB) / (8 * MIB), "as many modules load as fit beside the context");
    let (held, _, _) = held_within_limit(&gpu, &mut child, "modules");
    assert_eq!(held, 0, "nothing is left for allocations");
}

#[test]
fn the_pre_3_2_entry_points_are_held_to_the_limit() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    for case in ["v1", "v1procaddr", "v1ctx"] {
        let mut child = start(&gpu, case, None, &[]);
        let (held, error, _) = held_within_limit(&gpu, &mut child, case);
        assert_eq!(error, 2, "{case}: the allocations end in CUDA_ERROR_OUT_OF_MEMORY");
        let room = LIMIT - 64 * MIB;
        assert!(held <= room && held + CHUNK > room, "{case}: held {} beside its context", mib(held));
    }
}

#[test]
fn green_contexts_are_charged_like_contexts() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    let mut cmd = gpu.shimmed(compile_c("green_ctx.c", &[], true));
    cmd.arg("fill").memory_request("256MiB").memory_limit(LIMIT.to_string());
    let mut child = ChildProcess::spawn(&mut cmd);
    // 64 MiB each: as many as the limit holds, then out of memory.
    assert_eq!(line(&mut child, "FILLED"), vec![(LIMIT / (64 * MIB)) as i64, 2], "{}", child.diagnostics());
    child.expect_line(&["DONE"], Duration::from_secs(60));
    child.expect_exit_code(0);
}

#[test]
fn an_export_loop_cannot_take_a_group_past_its_limit() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new(DEVICE).with_context_overhead("64MiB");
    // Each round: a VMM allocation made exportable, exported to a file descriptor kept
    // open (an importer could hold it as well), and released: the memory lives on.
    let mut child = start(&gpu, "export", None, &[]);
    let held = line(&mut child, "HELD");
    let machine = gpu.device_state();
    // The device counts exported memory nobody maps under no process: its total is the
    // figure (the process is the only one on it).
    let used = machine.used(0);
    assert!(used <= LIMIT, "the device holds {} for a group limited to {}", mib(used), mib(LIMIT));
    assert_eq!(held[1], 2, "the loop ends in CUDA_ERROR_OUT_OF_MEMORY");
    assert!(held[0] as u64 + 64 * MIB + CHUNK > LIMIT, "the loop fills the limit: {}", mib(held[0] as u64));
    child.close_stdin();
    child.expect_exit_code(0);
}
