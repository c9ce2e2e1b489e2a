//! simgpu takes device memory where a real driver does without an allocation call —
//! context limits (stack, printf FIFO, device heap), module and library loads — and on the
//! pre-3.2 entry points the real `libcuda` still exports, each seen as what the device
//! reports the process holding (NVML's per-process `usedGpuMemory`) and in
//! `cuMemGetInfo`'s free.
//!
//! Each test runs `tests/c/implicit_memory.c` on a private 4 GiB device whose contexts
//! take 64 MiB. Run: `cargo build --workspace && cargo test -p gpufrac-e2e --test simgpu_implicit_memory`.

use std::collections::HashMap;

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{compile_c, skip_on_real_gpu, SimGpu};

/// Why every test here needs simgpu.
const SIMULATOR: &str = "tests the simulator's own model of implicit memory, with its sizes";
const OVERHEAD: u64 = 64 * MIB;
/// simgpu's device: 132 multiprocessors of 2048 resident threads.
const RESIDENT_THREADS: u64 = 132 * 2048;

/// One `STEP <label> <rc> <used> <free> <value>` line.
#[derive(Debug, Clone, Copy)]
struct Step {
    rc: i32,
    used: u64,
    free: u64,
    value: u64,
}

/// Runs a scenario and returns its steps by label.
fn run(gpu: &SimGpu, scenario: &str, extra: &[(&str, &str)], args: &[&str]) -> HashMap<String, Step> {
    let program = compile_c("implicit_memory.c", &[], false);
    let mut cmd = gpu.command(program);
    cmd.arg(scenario).args(args);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run implicit_memory");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "implicit_memory {scenario} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() == 6 && f[0] == "STEP").then(|| {
                let n = |i: usize| f[i].parse::<u64>().unwrap_or_else(|_| panic!("bad line {line:?}"));
                let step = Step { rc: f[2].parse().expect("rc"), used: n(3), free: n(4), value: n(5) };
                (f[1].to_owned(), step)
            })
        })
        .collect()
}

fn at<'a>(steps: &'a HashMap<String, Step>, label: &str) -> &'a Step {
    steps.get(label).unwrap_or_else(|| panic!("no step {label}: {steps:?}"))
}

/// Asserts step `label` succeeded and the process holds `delta` bytes more than at
/// `base` (negative: fewer), in NVML's figure and in `cuMemGetInfo`'s free alike.
fn assert_delta(steps: &HashMap<String, Step>, base: &str, label: &str, delta: i64) {
    let (b, s) = (at(steps, base), at(steps, label));
    assert_eq!(s.rc, 0, "{label} must succeed: {s:?}");
    assert_eq!(s.used as i64 - b.used as i64, delta, "{label}: NVML's usage against {base} ({b:?} -> {s:?})");
    assert_eq!(
        b.free as i64 - s.free as i64,
        delta,
        "{label}: cuMemGetInfo's free against {base} ({b:?} -> {s:?})"
    );
}

fn gpu() -> SimGpu {
    SimGpu::new("4GiB").with_context_overhead("64MiB")
}

#[test]
fn context_limits_take_and_give_back_device_memory() {
    skip_on_real_gpu!(SIMULATOR);
    let steps = run(&gpu(), "limits", &[], &[]);
    // A fresh context holds its overhead, which includes the limits at their defaults.
    assert_eq!(at(&steps, "start").used, OVERHEAD);
    assert_eq!(at(&steps, "default-stack").value, 1024);
    assert_eq!(at(&steps, "default-printf").value, MIB);
    assert_eq!(at(&steps, "default-heap").value, 8 * MIB);

    assert_delta(&steps, "start", "heap-up", (256 * MIB) as i64);
    assert_delta(&steps, "start", "heap-back", 0);
    // The stack is per resident thread: 1 KiB more for each of them.
    assert_delta(&steps, "start", "stack-up", (1024 * RESIDENT_THREADS) as i64);
    assert_delta(&steps, "start", "stack-back", 0);
    assert_delta(&steps, "start", "printf-up", (64 * MIB) as i64);
    assert_delta(&steps, "start", "printf-back", 0);
    assert_delta(&steps, "start", "heap-down", -((8 * MIB) as i64));
    assert_delta(&steps, "start", "heap-default", 0);

    let too_big = at(&steps, "heap-too-big");
    assert_eq!(too_big.rc, 2, "a heap larger than the device is CUDA_ERROR_OUT_OF_MEMORY: {too_big:?}");
    assert_eq!(too_big.value, 8 * MIB, "a refused limit leaves the old value");
    assert_eq!(too_big.used, at(&steps, "start").used, "a refused limit takes nothing");

    let sync = at(&steps, "sync-depth");
    assert_eq!((sync.rc, sync.value), (0, 4), "other limits are accepted: {sync:?}");
    assert_delta(&steps, "start", "sync-depth", 0);
    assert_eq!(at(&steps, "unsupported").rc, 215, "an unknown limit is CUDA_ERROR_UNSUPPORTED_LIMIT");

    // A created context has its own limits, and gives them all back when destroyed.
    assert_delta(&steps, "start", "ctx", OVERHEAD as i64);
    assert_eq!(at(&steps, "ctx-default-heap").value, 8 * MIB);
    assert_delta(&steps, "start", "ctx-heap-up", (OVERHEAD + 128 * MIB) as i64);
    assert_delta(&steps, "start", "ctx-destroyed", 0);
}

/// Every way of loading a module or library takes `bytes` on the device, given back at
/// unload or with its context.
fn modules_take(bytes: Option<u64>) {
    skip_on_real_gpu!(SIMULATOR);
    let gpu = gpu();
    // Any readable file is an image to simgpu.
    let file = gpu.lib_dir().join("module.cubin");
    std::fs::write(&file, b"not read").expect("write a module file");
    let setting = bytes.map(|b| b.to_string());
    let env: Vec<(&str, &str)> = setting.iter().map(|b| ("SIMGPU_MODULE_BYTES", b.as_str())).collect();
    let steps = run(&gpu, "modules", &env, &[file.to_str().expect("utf-8 path")]);
    let m = bytes.unwrap_or(2 * MIB) as i64;

    assert_delta(&steps, "start", "load-file", m);
    assert_eq!(at(&steps, "load-missing").rc, 301, "a missing file is CUDA_ERROR_FILE_NOT_FOUND");
    assert_eq!(at(&steps, "load-missing").used, at(&steps, "load-file").used, "a refused load takes nothing");
    assert_delta(&steps, "start", "load-data", 2 * m);
    assert_delta(&steps, "start", "load-data-ex", 3 * m);
    assert_delta(&steps, "start", "load-fatbinary", 4 * m);
    assert_delta(&steps, "start", "unloaded", 0);
    assert_eq!(at(&steps, "unload-again").rc, 400, "an unloaded module is an invalid handle");

    assert_delta(&steps, "start", "library", m);
    assert_delta(&steps, "start", "library-unloaded", 0);
    assert_delta(&steps, "start", "library-file", m);
    assert_delta(&steps, "start", "library-file-unloaded", 0);

    // Without a context nothing is taken (and cuMemGetInfo has no context to answer).
    let no_ctx = at(&steps, "library-no-ctx");
    assert_eq!((no_ctx.rc, no_ctx.used), (0, at(&steps, "start").used), "{no_ctx:?}");
    assert_delta(&steps, "start", "library-first-use", m);
    assert_delta(&steps, "start", "library-second-use", m);
    assert_delta(&steps, "start", "library-unloaded-again", 0);

    assert_delta(&steps, "start", "ctx", OVERHEAD as i64);
    assert_delta(&steps, "start", "ctx-module", OVERHEAD as i64 + m);
    assert_delta(&steps, "start", "ctx-library", OVERHEAD as i64 + 2 * m);
    assert_delta(&steps, "start", "ctx-destroyed", 0);
    assert_eq!(at(&steps, "ctx-module-gone").rc, 400, "a destroyed context's module is gone");
    assert_delta(&steps, "start", "ctx-library-reused", m);
    assert_delta(&steps, "start", "end", 0);
}

#[test]
fn modules_and_libraries_take_two_mib_by_default() {
    modules_take(None);
}

#[test]
fn modules_take_simgpu_module_bytes() {
    modules_take(Some(5 * MIB));
}

#[test]
fn modules_take_nothing_with_simgpu_module_bytes_zero() {
    modules_take(Some(0));
}

#[test]
fn a_module_that_does_not_fit_is_out_of_memory() {
    skip_on_real_gpu!(SIMULATOR);
    let steps = run(&gpu(), "modules-oom", &[("SIMGPU_MODULE_BYTES", "3GiB")], &[]);
    assert_delta(&steps, "start", "first", (3 * GIB) as i64);
    for label in ["second", "library"] {
        let s = at(&steps, label);
        assert_eq!(s.rc, 2, "{label}: a module larger than what is free is CUDA_ERROR_OUT_OF_MEMORY: {s:?}");
        assert_eq!(s.used, at(&steps, "first").used, "{label}: a refused module takes nothing");
    }
}

/// Every pre-3.2 entry point, found as `how` finds it, works with 32-bit pointers and sizes
/// and holds real device memory.
fn legacy_entry_points(how: &str) {
    skip_on_real_gpu!(SIMULATOR);
    let steps = run(&gpu(), how, &[], &[]);
    let device = 4 * GIB;
    // 32-bit totals and free clamp: the 4 GiB device does not fit in 32 bits.
    assert_eq!(at(&steps, "total-mem").value, u64::from(u32::MAX), "cuDeviceTotalMem clamps to 32 bits");
    assert_eq!(at(&steps, "info-total").value, u64::from(u32::MAX), "cuMemGetInfo's total clamps to 32 bits");
    assert_eq!(at(&steps, "info-free").value, device - OVERHEAD, "cuMemGetInfo's free (under 4 GiB here)");

    let alloc = at(&steps, "alloc");
    assert!(
        alloc.value != 0 && alloc.value + 256 * MIB <= 1 << 32,
        "a v1 allocation lies wholly below 4 GiB: {alloc:?}"
    );
    assert_delta(&steps, "start", "alloc", (256 * MIB) as i64);
    assert_eq!(at(&steps, "memset-d32").value, 0xabcd_1234, "cuMemsetD32 then cuMemcpyDtoH");
    assert_eq!(at(&steps, "copies").value, 1015, "cuMemcpyHtoD, cuMemcpyDtoD, cuMemcpyDtoH");
    assert_eq!(at(&steps, "memset-d8-d16").value, 0x2222_2222_1111_1111, "cuMemsetD8 and cuMemsetD16");
    assert_eq!(at(&steps, "range-base").value, alloc.value, "cuMemGetAddressRange's base");
    assert_eq!(at(&steps, "range-size").value, 256 * MIB, "cuMemGetAddressRange's size");

    let pitch = at(&steps, "pitch");
    assert!(
        pitch.value != 0 && pitch.value + MIB <= 1 << 32,
        "a v1 pitched allocation is below 4 GiB: {pitch:?}"
    );
    assert_eq!(at(&steps, "pitch-pitch").value, 1024, "1000-byte rows padded to 512 bytes");
    assert_delta(&steps, "start", "pitch", (257 * MIB) as i64);
    assert_delta(&steps, "start", "array", (261 * MIB) as i64);
    assert_delta(&steps, "start", "array3d", (262 * MIB) as i64);
    assert_delta(&steps, "start", "arrays-destroyed", (257 * MIB) as i64);
    let host = at(&steps, "alloc-host");
    assert_eq!(host.value, 1, "cuMemAllocHost gave a pointer: {host:?}");
    assert_delta(&steps, "start", "alloc-host", (257 * MIB) as i64);
    assert_delta(&steps, "start", "free", MIB as i64);
    assert_delta(&steps, "start", "free-pitch", 0);

    assert_delta(&steps, "start", "ctx", OVERHEAD as i64);
    assert_delta(&steps, "start", "ctx-alloc", (OVERHEAD + 32 * MIB) as i64);
    let popped = at(&steps, "ctx-popped");
    assert_eq!((popped.rc, popped.value), (0, 1), "cuCtxPopCurrent pops the created context: {popped:?}");
    assert_delta(&steps, "start", "ctx-pushed", (OVERHEAD + 32 * MIB) as i64);
    assert_delta(&steps, "start", "ctx-destroyed", 0);
    let released = at(&steps, "primary-released");
    assert_eq!((released.rc, released.used), (0, 0), "the CUDA 7.0 cuDevicePrimaryCtxRelease: {released:?}");
}

#[test]
fn the_pre_3_2_entry_points_found_by_dlsym_hold_device_memory() {
    legacy_entry_points("legacy");
}

#[test]
fn the_pre_3_2_entry_points_found_by_cu_get_proc_address_at_version_2000_hold_device_memory() {
    legacy_entry_points("legacy-procaddr");
}
