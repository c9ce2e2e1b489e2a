//! A CUDA program for the checkpoint tests (`tests/tests/simgpu_checkpoint.rs`), calling
//! the driver through `cudarc::driver::sys`: it holds device memory of every kind simgpu
//! checkpoints, each buffer written with its own pattern, and obeys its stdin.
//!
//! Holds: `cuMemAlloc` (16 MiB), pitched (4 MiB), managed (8 MiB), stream-ordered from
//! the default pool (8 MiB), a `cuMemCreate` allocation mapped at a reserved address
//! (4 MiB) and a CUDA array (4 MiB, simgpu keeps no texels: accounted only). Prints
//! `PTRS <addresses>` and `READY <bytes of buffers>`, then obeys lines:
//! - `check`: reads every buffer back at its address, prints `INTACT <bytes>` or
//!   `CORRUPT <buffer> <word>`;
//! - `call`: prints `CALLING`, makes one CUDA call (`cuMemGetInfo`), prints `CALLED`;
//! - `busy <us>`: queues a kernel of `us` microseconds, prints `BUSY`, waits for it
//!   (`cuStreamSynchronize`, a call in flight all along), prints `IDLE`;
//! - `launch <us>`: queues such a kernel, prints `LAUNCHED` without waiting.
//!
//! At end of input it frees everything, prints `DONE` and exits 0.

use std::ffi::c_void;
use std::io::BufRead;
use std::ptr::null_mut;

use cudarc::driver::sys::{self, CUresult};

macro_rules! ck {
    ($call:expr) => {{
        // SAFETY: every call passes valid out-pointers and handles created in this program.
        let r = unsafe { $call };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{} failed", stringify!($call));
    }};
}

const MIB: usize = 1 << 20;

/// Word `j` of buffer `i`.
fn pattern(i: usize, j: usize) -> u32 {
    (i as u32 + 1).wrapping_mul(0x9E37_79B9) ^ (j as u32).wrapping_mul(0x85EB_CA6B)
}

fn prop() -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p
}

fn sleep_kernel(f: sys::CUfunction, stream: sys::CUstream, us: u64) {
    let mut u = us;
    let mut args: [*mut c_void; 1] = [(&mut u as *mut u64).cast()];
    ck!(sys::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, args.as_mut_ptr(), null_mut()));
}

fn main() {
    ck!(sys::cuInit(0));
    let mut dev = 0;
    ck!(sys::cuDeviceGet(&mut dev, 0));
    let mut ctx = null_mut();
    ck!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
    ck!(sys::cuCtxSetCurrent(ctx));
    let mut module = null_mut();
    ck!(sys::cuModuleLoadData(&mut module, c"any image".as_ptr().cast()));
    let mut sleep = null_mut();
    ck!(sys::cuModuleGetFunction(&mut sleep, module, c"simgpu_sleep_us".as_ptr()));
    let mut stream = null_mut();
    ck!(sys::cuStreamCreate(&mut stream, 0));

    // (address, bytes) of each buffer written with a pattern.
    let mut buffers: Vec<(u64, usize)> = Vec::new();
    let mut linear = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut linear, 16 * MIB));
    buffers.push((linear, 16 * MIB));
    let (mut pitched, mut pitch) = (0u64, 0usize);
    ck!(sys::cuMemAllocPitch_v2(&mut pitched, &mut pitch, 4000, 1024, 4));
    buffers.push((pitched, pitch * 1024));
    let mut managed = 0u64;
    ck!(sys::cuMemAllocManaged(&mut managed, 8 * MIB, 1));
    buffers.push((managed, 8 * MIB));
    let mut pooled = 0u64;
    ck!(sys::cuMemAllocAsync(&mut pooled, 8 * MIB, stream));
    ck!(sys::cuStreamSynchronize(stream));
    buffers.push((pooled, 8 * MIB));
    let vmm_size = 4 * MIB;
    let (mut va, mut handle) = (0u64, 0u64);
    ck!(sys::cuMemAddressReserve(&mut va, vmm_size, 0, 0, 0));
    ck!(sys::cuMemCreate(&mut handle, vmm_size, &prop(), 0));
    ck!(sys::cuMemMap(va, vmm_size, 0, handle, 0));
    let access = sys::CUmemAccessDesc {
        location: prop().location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    ck!(sys::cuMemSetAccess(va, vmm_size, &access, 1));
    buffers.push((va, vmm_size));
    let mut array = null_mut();
    let desc = sys::CUDA_ARRAY_DESCRIPTOR {
        Width: 1024,
        Height: 1024,
        Format: sys::CUarray_format::CU_AD_FORMAT_UNSIGNED_INT8,
        NumChannels: 4,
    };
    ck!(sys::cuArrayCreate_v2(&mut array, &desc));

    for (i, &(ptr, bytes)) in buffers.iter().enumerate() {
        let data: Vec<u32> = (0..bytes / 4).map(|j| pattern(i, j)).collect();
        ck!(sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), bytes));
    }
    let total: usize = buffers.iter().map(|b| b.1).sum();
    let ptrs: Vec<String> = buffers.iter().map(|b| format!("{:#x}", b.0)).collect();
    println!("PTRS {}", ptrs.join(" "));
    println!("READY {total}");

    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["check"] => {
                let mut bad = None;
                'all: for (i, &(ptr, bytes)) in buffers.iter().enumerate() {
                    let mut host = vec![0u32; bytes / 4];
                    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, bytes));
                    for (j, &w) in host.iter().enumerate() {
                        if w != pattern(i, j) {
                            bad = Some((i, j));
                            break 'all;
                        }
                    }
                }
                match bad {
                    None => println!("INTACT {total}"),
                    Some((i, j)) => println!("CORRUPT {i} {j}"),
                }
            }
            ["call"] => {
                println!("CALLING");
                let (mut free, mut all) = (0usize, 0usize);
                ck!(sys::cuMemGetInfo_v2(&mut free, &mut all));
                println!("CALLED");
            }
            ["busy", us] => {
                sleep_kernel(sleep, stream, us.parse().expect("busy <microseconds>"));
                println!("BUSY");
                ck!(sys::cuStreamSynchronize(stream));
                println!("IDLE");
            }
            ["launch", us] => {
                sleep_kernel(sleep, stream, us.parse().expect("launch <microseconds>"));
                println!("LAUNCHED");
            }
            other => panic!("checkpoint_target: unknown command {other:?}"),
        }
    }

    ck!(sys::cuArrayDestroy(array));
    ck!(sys::cuMemUnmap(va, vmm_size));
    ck!(sys::cuMemRelease(handle));
    ck!(sys::cuMemAddressFree(va, vmm_size));
    ck!(sys::cuMemFreeAsync(pooled, stream));
    ck!(sys::cuStreamSynchronize(stream));
    for ptr in [linear, pitched, managed] {
        ck!(sys::cuMemFree_v2(ptr));
    }
    println!("DONE");
}
