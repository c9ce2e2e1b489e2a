//! What the shim leaves in a program's address space: the NVML it loads to measure a
//! context must not sit right above the program's next mappings. The kernel places a new
//! mapping right below the lowest one; sharing a 2 MiB page-table region with NVML's
//! mapped memory, each `munmap` of it walks that page table (on simgpu, where device
//! memory is host memory, that made every allocation of 64 KiB to 1 MiB cost 0.2-0.3 µs
//! more under the shim: see docs/benchmarks.md). The shim fences NVML's mappings off with
//! an untouched reservation. A small mapping goes instead to the highest hole it fits
//! (among the libraries, beside touched pages): the shim fills the holes above its fence,
//! so that small mappings land below it too.

use gpufrac_e2e::{compile_c, skip_on_real_gpu, ShimSettings, SimGpu};

/// What `page_table_fence.c` (built with `mode`) says of a block of `size` bytes mapped
/// after the first context, under the shim: `CLEAR` or `SHARED <maps line>`.
fn block_after_first_context(mode: &str, size: u64) -> String {
    let gpu = SimGpu::new("2GiB");
    let program = compile_c("page_table_fence.c", &[mode], mode == "MODE_LINKED");
    let mut cmd = gpu.shimmed(&program);
    cmd.memory_request("256MiB").arg(size.to_string());
    let out = cmd.output().expect("run page_table_fence");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout.trim().to_owned()
}

#[test]
fn the_programs_next_mapping_after_its_first_context_shares_no_page_table_with_the_shims_nvml() {
    skip_on_real_gpu!("the layout of simgpu's NVML, which the check names");
    let said = block_after_first_context("MODE_LINKED", 1 << 20);
    assert_eq!(said, "CLEAR", "under the shim, the 1 MiB block shares its page-table region");
}

#[test]
fn a_small_mapping_after_the_first_context_lands_in_no_hole_among_the_libraries() {
    skip_on_real_gpu!("the layout of simgpu's libraries, which the check names");
    // Linked, libcuda is loaded with the program; through dlsym, after it, and the shim's
    // core at that dlsym: the holes above the fence differ.
    for mode in ["MODE_LINKED", "MODE_DLSYM"] {
        let said = block_after_first_context(mode, 4096);
        assert_eq!(said, "CLEAR", "under the shim ({mode}), a 4 KiB block shares its page-table region");
    }
}
