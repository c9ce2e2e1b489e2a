//! What the shim leaves in a program's address space: the NVML it loads to measure a
//! context must not sit right above the program's next mappings. The kernel places a new
//! mapping right below the lowest one; sharing a 2 MiB page-table region with NVML's
//! mapped memory, each `munmap` of it walks that page table (on simgpu, where device
//! memory is host memory, that made every allocation of 64 KiB to 1 MiB cost 0.2-0.3 µs
//! more under the shim: see docs/benchmarks.md). The shim fences NVML's mappings off with
//! an untouched reservation.

use gpufrac_e2e::{compile_c, skip_on_real_gpu, ShimSettings, SimGpu};

#[test]
fn the_programs_next_mapping_after_its_first_context_shares_no_page_table_with_the_shims_nvml() {
    skip_on_real_gpu!("the layout of simgpu's NVML, which the check names");
    let gpu = SimGpu::new("2GiB");
    let program = compile_c("page_table_fence.c", &["MODE_LINKED"], true);

    let mut cmd = gpu.shimmed(&program);
    cmd.memory_request("256MiB");
    let out = cmd.output().expect("run page_table_fence");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.trim(), "CLEAR", "under the shim, the block shares its page-table region");
}
