//! A CUDA client for the end-to-end tests, calling the driver through
//! `cudarc::driver::sys` (dlopen + dlsym). Each subcommand exercises one behaviour and
//! asserts it; exit status 0 means every assertion held.
//!
//! Subcommands: `async-order`, `vmm-remap`, `pool-release`, `nvml`, `slice`, `nvml-only`,
//! `hold <bytes>`, `hold-bursts <base> <burst> <count>`, `timed-alloc <base> <burst>`.

use std::ffi::c_void;
use std::io::{BufRead, Write};
use std::ptr::null_mut;

use cudarc::driver::sys::{self, CUresult};

macro_rules! ck {
    ($call:expr) => {{
        // SAFETY: every call passes valid out-pointers and handles created in this program.
        let r = unsafe { $call };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{} failed", stringify!($call));
    }};
}

macro_rules! expect {
    ($want:expr, $call:expr) => {{
        // SAFETY: as in ck!.
        let r = unsafe { $call };
        assert_eq!(r, $want, "{} returned {:?}, expected {:?}", stringify!($call), r, $want);
    }};
}

const MIB: usize = 1 << 20;

struct Kernels {
    fill: sys::CUfunction,
    checksum: sys::CUfunction,
    sleep: sys::CUfunction,
}

fn setup() -> Kernels {
    ck!(sys::cuInit(0));
    let mut dev = 0;
    ck!(sys::cuDeviceGet(&mut dev, 0));
    let mut ctx = null_mut();
    ck!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
    ck!(sys::cuCtxSetCurrent(ctx));
    let mut module = null_mut();
    ck!(sys::cuModuleLoadData(&mut module, c"any image".as_ptr().cast()));
    let mut k = Kernels { fill: null_mut(), checksum: null_mut(), sleep: null_mut() };
    ck!(sys::cuModuleGetFunction(&mut k.fill, module, c"simgpu_fill_u32".as_ptr()));
    ck!(sys::cuModuleGetFunction(&mut k.checksum, module, c"simgpu_checksum_u32".as_ptr()));
    ck!(sys::cuModuleGetFunction(&mut k.sleep, module, c"simgpu_sleep_us".as_ptr()));
    let mut missing = null_mut();
    expect!(
        CUresult::CUDA_ERROR_NOT_FOUND,
        sys::cuModuleGetFunction(&mut missing, module, c"no_such_kernel".as_ptr())
    );
    k
}

fn launch(f: sys::CUfunction, stream: sys::CUstream, args: &mut [*mut c_void]) {
    ck!(sys::cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, args.as_mut_ptr(), null_mut()));
}

fn fill(k: &Kernels, stream: sys::CUstream, ptr: u64, value: u32, count: usize) {
    let (mut p, mut v, mut c) = (ptr, value, count);
    launch(
        k.fill,
        stream,
        &mut [(&mut p as *mut u64).cast(), (&mut v as *mut u32).cast(), (&mut c as *mut usize).cast()],
    );
}

fn checksum(k: &Kernels, stream: sys::CUstream, ptr: u64, count: usize, out: u64) {
    let (mut p, mut c, mut o) = (ptr, count, out);
    launch(
        k.checksum,
        stream,
        &mut [(&mut p as *mut u64).cast(), (&mut c as *mut usize).cast(), (&mut o as *mut u64).cast()],
    );
}

fn sleep_us(k: &Kernels, stream: sys::CUstream, us: u64) {
    let mut u = us;
    launch(k.sleep, stream, &mut [(&mut u as *mut u64).cast()]);
}

fn read_u32s(ptr: u64, count: usize) -> Vec<u32> {
    let mut host = vec![0u32; count];
    ck!(sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, count * 4));
    host
}

fn free_bytes() -> usize {
    let (mut free, mut total) = (0, 0);
    ck!(sys::cuMemGetInfo_v2(&mut free, &mut total));
    free
}

/// Work queued on a stream runs later, in order; a program that does not synchronize sees it.
fn async_order(k: &Kernels) {
    let mut stream = null_mut();
    // Non-blocking: the legacy default stream does not wait for it.
    ck!(sys::cuStreamCreate(&mut stream, 1));
    let mut buf = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut buf, 4 * MIB));
    ck!(sys::cuMemsetD32_v2(buf, 1, MIB));
    let (mut start, mut end) = (null_mut(), null_mut());
    ck!(sys::cuEventCreate(&mut start, 0));
    ck!(sys::cuEventCreate(&mut end, 0));

    ck!(sys::cuEventRecord(start, stream));
    sleep_us(k, stream, 300_000);
    fill(k, stream, buf, 7, MIB);
    ck!(sys::cuEventRecord(end, stream));

    // Nothing has run yet: the fill waits behind the sleep.
    expect!(CUresult::CUDA_ERROR_NOT_READY, sys::cuStreamQuery(stream));
    expect!(CUresult::CUDA_ERROR_NOT_READY, sys::cuEventQuery(end));
    assert_eq!(read_u32s(buf, 4), vec![1; 4], "queued work ran before the call returned");

    // A second stream waits for the first through the event, then checksums.
    let mut other = null_mut();
    ck!(sys::cuStreamCreate(&mut other, 1));
    let mut sum = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut sum, 8));
    ck!(sys::cuStreamWaitEvent(other, end, 0));
    checksum(k, other, buf, MIB, sum);
    ck!(sys::cuStreamSynchronize(other));
    let mut got = 0u64;
    ck!(sys::cuMemcpyDtoH_v2((&mut got as *mut u64).cast(), sum, 8));
    assert_eq!(got, 7 * MIB as u64, "the waiting stream ran before the event");

    ck!(sys::cuEventSynchronize(end));
    ck!(sys::cuStreamQuery(stream));
    assert_eq!(read_u32s(buf, 4), vec![7; 4]);
    let mut ms = 0f32;
    ck!(sys::cuEventElapsedTime(&mut ms, start, end));
    assert!(ms >= 290.0, "elapsed {ms} ms between events around a 300 ms kernel");

    // Async copies from pageable memory are staged: the buffer may be reused at once.
    let mut host = [5u32; 16];
    ck!(sys::cuMemcpyHtoDAsync_v2(buf, host.as_ptr().cast(), 64, stream));
    host.fill(9);
    ck!(sys::cuStreamSynchronize(stream));
    assert_eq!(read_u32s(buf, 16), vec![5; 16]);

    println!("OK async-order");
}

fn prop(dev: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p
}

fn map_with_access(ptr: u64, size: usize, handle: u64) {
    ck!(sys::cuMemMap(ptr, size, 0, handle, 0));
    let access = sys::CUmemAccessDesc {
        location: prop(0).location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    ck!(sys::cuMemSetAccess(ptr, size, &access, 1));
}

/// Data copied out before unmap/release and back after a new create/map at the same
/// address is the same data; the address never changes; memory is really given back.
fn vmm_remap(k: &Kernels) {
    let p = prop(0);
    let mut gran = 0usize;
    ck!(sys::cuMemGetAllocationGranularity(
        &mut gran,
        &p,
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    ));
    assert_eq!(gran, 2 * MIB);
    let size = 4 * MIB;
    let mut va = 0u64;
    ck!(sys::cuMemAddressReserve(&mut va, 2 * size, 0, 0, 0));
    let mut handle = 0u64;
    let before_create = free_bytes();
    ck!(sys::cuMemCreate(&mut handle, size, &p, 0));
    assert_eq!(free_bytes(), before_create - size, "cuMemCreate is charged to the device");

    ck!(sys::cuMemMap(va, size, 0, handle, 0));
    // Mapped but not yet accessible.
    let mut probe = [0u8; 4];
    expect!(CUresult::CUDA_ERROR_INVALID_VALUE, sys::cuMemcpyDtoH_v2(probe.as_mut_ptr().cast(), va, 4));
    let access = sys::CUmemAccessDesc {
        location: p.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    ck!(sys::cuMemSetAccess(va, size, &access, 1));
    let count = size / 4;
    fill(k, null_mut(), va, 0xabcd, count);
    let pattern: Vec<u32> = (0..1024u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    ck!(sys::cuMemcpyHtoD_v2(va + 4096, pattern.as_ptr().cast(), pattern.len() * 4));
    ck!(sys::cuCtxSynchronize());

    // Swap out: copy to host, unmap, release; the reservation stays.
    let mut saved = vec![0u32; count];
    ck!(sys::cuMemcpyDtoH_v2(saved.as_mut_ptr().cast(), va, size));
    ck!(sys::cuMemUnmap(va, size));
    ck!(sys::cuMemRelease(handle));
    assert_eq!(free_bytes(), before_create, "unmap + release gives the memory back");
    expect!(CUresult::CUDA_ERROR_INVALID_VALUE, sys::cuMemcpyDtoH_v2(probe.as_mut_ptr().cast(), va, 4));
    expect!(CUresult::CUDA_ERROR_INVALID_VALUE, sys::cuMemAddressFree(va + 4096, size));

    // Swap in: new physical memory at the same address, data copied back.
    let mut handle2 = 0u64;
    ck!(sys::cuMemCreate(&mut handle2, size, &p, 0));
    map_with_access(va, size, handle2);
    assert_eq!(read_u32s(va, 4), vec![0; 4], "fresh physical memory is not the old one");
    ck!(sys::cuMemcpyHtoD_v2(va, saved.as_ptr().cast(), size));
    let mut sum = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut sum, 8));
    checksum(k, null_mut(), va, count, sum);
    let mut got = 0u64;
    ck!(sys::cuMemcpyDtoH_v2((&mut got as *mut u64).cast(), sum, 8));
    let want = saved.iter().fold(0u64, |a, &v| a.wrapping_add(v as u64));
    assert_eq!(got, want);
    assert_eq!(read_u32s(va + 4096, 1024), pattern);

    // Mapping twice over the same range is refused; unmapping a partial mapping too.
    expect!(CUresult::CUDA_ERROR_INVALID_VALUE, sys::cuMemMap(va, size, 0, handle2, 0));
    expect!(CUresult::CUDA_ERROR_INVALID_VALUE, sys::cuMemUnmap(va, 2 * MIB));
    // Released while mapped: the memory lives until the unmap.
    let mapped = free_bytes();
    ck!(sys::cuMemRelease(handle2));
    assert_eq!(free_bytes(), mapped);
    ck!(sys::cuMemUnmap(va, size));
    assert_eq!(free_bytes(), mapped + size);

    // Unmapping under a queued kernel (a swap without synchronize) is an illegal
    // address, sticky on the context, as on a GPU.
    let mut handle3 = 0u64;
    ck!(sys::cuMemCreate(&mut handle3, size, &p, 0));
    map_with_access(va, size, handle3);
    let mut stream = null_mut();
    ck!(sys::cuStreamCreate(&mut stream, 1));
    sleep_us(k, stream, 100_000);
    fill(k, stream, va, 1, count);
    ck!(sys::cuMemUnmap(va, size));
    expect!(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS, sys::cuStreamSynchronize(stream));
    expect!(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS, sys::cuCtxSynchronize());
    ck!(sys::cuMemRelease(handle3));
    ck!(sys::cuMemAddressFree(va, 2 * size));
    println!("OK vmm-remap");
}

/// A pool keeps freed memory until a synchronize releases what exceeds its threshold.
fn pool_release() {
    let mut stream = null_mut();
    ck!(sys::cuStreamCreate(&mut stream, 1));
    let base = free_bytes();
    let mut ptr = 0u64;
    ck!(sys::cuMemAllocAsync(&mut ptr, 64 * MIB, stream));
    assert_eq!(free_bytes(), base - 64 * MIB);
    ck!(sys::cuMemFreeAsync(ptr, stream));
    ck!(sys::cuStreamSynchronize(stream));
    assert_eq!(free_bytes(), base, "threshold 0: released at the synchronize");

    let mut pool = null_mut();
    ck!(sys::cuDeviceGetDefaultMemPool(&mut pool, 0));
    let mut threshold: u64 = u64::MAX;
    ck!(sys::cuMemPoolSetAttribute(
        pool,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        (&mut threshold as *mut u64).cast()
    ));
    ck!(sys::cuMemAllocAsync(&mut ptr, 64 * MIB, stream));
    ck!(sys::cuMemFreeAsync(ptr, stream));
    ck!(sys::cuStreamSynchronize(stream));
    assert_eq!(free_bytes(), base - 64 * MIB, "a high threshold keeps the memory reserved");
    let mut reserved = 0u64;
    ck!(sys::cuMemPoolGetAttribute(
        pool,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        (&mut reserved as *mut u64).cast()
    ));
    assert_eq!(reserved, 64 * MIB as u64);
    // Reuse comes from the pool, not the device.
    ck!(sys::cuMemAllocAsync(&mut ptr, 32 * MIB, stream));
    assert_eq!(free_bytes(), base - 64 * MIB);
    ck!(sys::cuMemFreeAsync(ptr, stream));
    ck!(sys::cuStreamSynchronize(stream));
    ck!(sys::cuMemPoolTrimTo(pool, 0));
    assert_eq!(free_bytes(), base, "trim releases the cached memory");
    println!("OK pool-release");
}

/// NVML sees what the driver side does: the same devices, UUIDs, PCI bus IDs, usage and
/// processes; an injected XID arrives as an event.
fn nvml_view() {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::Nvml;

    let mut held = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut held, 100 * MIB));
    let nvml = Nvml::init().expect("nvmlInit");
    let mut count = 0;
    ck!(sys::cuDeviceGetCount(&mut count));
    assert_eq!(nvml.device_count().expect("count"), count as u32);

    let dev = nvml.device_by_index(0).expect("device 0");
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    ck!(sys::cuDeviceGetUuid_v2(&mut uuid, 0));
    let hex: String = uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
    let want = format!("GPU-{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]);
    assert_eq!(dev.uuid().expect("uuid"), want);
    let mut bus = [0 as std::ffi::c_char; 32];
    ck!(sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, 0));
    // SAFETY: the driver wrote a NUL-terminated string into `bus`.
    let bus = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned();
    assert_eq!(dev.pci_info().expect("pci").bus_id, bus);

    let (mut free, mut total) = (0usize, 0usize);
    ck!(sys::cuMemGetInfo_v2(&mut free, &mut total));
    let mem = dev.memory_info().expect("memory info");
    assert_eq!((mem.total, mem.free, mem.used), (total as u64, free as u64, (total - free) as u64));
    let me = std::process::id();
    let procs = dev.running_compute_processes().expect("processes");
    let mine = procs.iter().find(|p| p.pid == me).expect("this process is listed");
    assert_eq!(
        mine.used_gpu_memory,
        nvml_wrapper::enums::device::UsedGpuMemory::Used(mem.used),
        "all memory on the device is this process's (context + 100 MiB)"
    );

    let set = nvml.create_event_set().expect("event set");
    let set = dev.register_events(EventTypes::CRITICAL_XID_ERROR, set).expect("register");
    let injector = std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: simgpu's own export, looked up by name in the loaded NVML library.
        unsafe {
            let lib = libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            assert!(!lib.is_null(), "NVML is loaded");
            let inject = libc::dlsym(lib, c"simgpu_inject_xid".as_ptr());
            assert!(!inject.is_null(), "simgpu_inject_xid is exported");
            let inject: extern "C" fn(u32, u64) -> i32 = std::mem::transmute(inject);
            assert_eq!(inject(0, 79), 0);
        }
    });
    let event = set.wait(5000).expect("the injected XID arrives");
    injector.join().expect("injector");
    assert!(event.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
    assert_eq!(event.event_data, Some(XidError::Value(79)));
    ck!(sys::cuMemFree_v2(held));
    assert_eq!(dev.memory_info().expect("memory info").used, mem.used - 100 * MIB as u64);
    println!("OK nvml");
}

/// Under the shim: `cuMemGetInfo`, `cuDeviceTotalMem` and NVML all show the slice, and
/// agree on what is used. Prints `SLICE <total> <used>` as NVML reports it.
fn slice_view() {
    let mut held = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut held, 100 * MIB));
    let (mut free, mut total) = (0usize, 0usize);
    ck!(sys::cuMemGetInfo_v2(&mut free, &mut total));
    let mut device_total = 0usize;
    ck!(sys::cuDeviceTotalMem_v2(&mut device_total, 0));
    assert_eq!(device_total, total, "cuDeviceTotalMem and cuMemGetInfo agree");
    let nvml = nvml_wrapper::Nvml::init().expect("nvmlInit");
    let mem = nvml.device_by_index(0).expect("device 0").memory_info().expect("memory info");
    assert_eq!((mem.total, mem.free, mem.used), (total as u64, free as u64, (total - free) as u64));
    println!("SLICE {} {}", mem.total, mem.used);
}

/// NVML alone, as `nvidia-smi` uses it (no CUDA call): prints `NVML <total> <used>`.
fn nvml_only() {
    let nvml = nvml_wrapper::Nvml::init().expect("nvmlInit");
    let mem = nvml.device_by_index(0).expect("device 0").memory_info().expect("memory info");
    println!("NVML {} {}", mem.total, mem.used);
}

/// Holds `bytes` until stdin closes, for cross-process tests.
fn hold(bytes: usize) {
    let mut ptr = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut ptr, bytes));
    println!("READY {}", free_bytes());
    std::io::stdout().flush().ok();
    let _ = std::io::stdin().lock().lines().count();
    ck!(sys::cuMemFree_v2(ptr));
    println!("DONE");
}

/// The pattern of word `i` of burst buffer `n` written by copies.
fn pattern(n: usize, i: usize) -> u32 {
    (n as u32).wrapping_mul(0x9E37_79B9) ^ (i as u32).wrapping_mul(0x85EB_CA6B) ^ 0x5A5A_5A5A
}

/// For the swap tests: holds `base` bytes, then `count` buffers of `burst` bytes; even
/// ones written by copies (a pattern per word), odd ones by the async fill kernel queued
/// behind a 300 ms kernel and not waited for. Prints `PTRS <addresses>` and `READY`, then
/// obeys stdin lines: `check` reads every buffer back at the same addresses and prints
/// `INTACT <bytes>` or `CORRUPT <buffer> <word>`; `copy` does one device-to-host copy
/// (which waits at the gate while swapped out) and prints `COPIED <ms>`; `alloc <bytes>`
/// allocates one more buffer and prints `ALLOCATED <ms>` or `NOT_ALLOCATED <status> <ms>`;
/// `free` frees the bursts and prints `FREED`. Prints `DONE` and exits at end of input.
fn hold_bursts(k: &Kernels, base: usize, burst: usize, count: usize) {
    let mut base_ptr = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut base_ptr, base));
    let mut stream = null_mut();
    ck!(sys::cuStreamCreate(&mut stream, 0));
    let words = burst / 4;
    let mut ptrs = Vec::new();
    for n in 0..count {
        let mut p = 0u64;
        ck!(sys::cuMemAlloc_v2(&mut p, burst));
        if n % 2 == 0 {
            let data: Vec<u32> = (0..words).map(|i| pattern(n, i)).collect();
            ck!(sys::cuMemcpyHtoD_v2(p, data.as_ptr().cast(), burst));
        } else {
            sleep_us(k, stream, 300_000);
            fill(k, stream, p, 0xC0DE_0000 + n as u32, words);
        }
        ptrs.push(p);
    }
    let list: Vec<String> = ptrs.iter().map(|p| format!("{p:#x}")).collect();
    println!("PTRS {}", list.join(" "));
    println!("READY {}", free_bytes());
    std::io::stdout().flush().ok();
    // Buffers `alloc` made, beside the checked ones.
    let mut extra = Vec::new();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap_or_default().trim() {
            "check" => {
                let mut verdict = format!("INTACT {}", count * burst);
                'all: for (n, &p) in ptrs.iter().enumerate() {
                    let got = read_u32s(p, words);
                    for (i, &w) in got.iter().enumerate() {
                        let want = if n % 2 == 0 { pattern(n, i) } else { 0xC0DE_0000 + n as u32 };
                        if w != want {
                            verdict = format!("CORRUPT {n} {i}");
                            break 'all;
                        }
                    }
                }
                println!("{verdict}");
            }
            "copy" => {
                let started = std::time::Instant::now();
                let mut word = 0u32;
                ck!(sys::cuMemcpyDtoH_v2((&mut word as *mut u32).cast(), ptrs[0], 4));
                println!("COPIED {}", started.elapsed().as_millis());
            }
            line if line.starts_with("alloc ") => {
                let bytes: usize = line["alloc ".len()..].parse().expect("alloc <bytes>");
                let started = std::time::Instant::now();
                let mut p = 0u64;
                // SAFETY: a valid out-pointer.
                let status = unsafe { sys::cuMemAlloc_v2(&mut p, bytes) };
                let ms = started.elapsed().as_millis();
                if status == CUresult::CUDA_SUCCESS {
                    extra.push(p);
                    println!("ALLOCATED {ms}");
                } else {
                    println!("NOT_ALLOCATED {status:?} {ms}");
                }
            }
            "free" => {
                for &p in extra.iter().chain(&ptrs) {
                    ck!(sys::cuMemFree_v2(p));
                }
                ptrs.clear();
                extra.clear();
                println!("FREED");
            }
            other => println!("UNKNOWN {other}"),
        }
        std::io::stdout().flush().ok();
    }
    println!("DONE");
}

/// For the resolver benchmark: holds `base` bytes, then times one allocation of `burst`
/// bytes (which may wait for the arbiter) and prints `GRANTED <µs>` (or `REFUSED <µs>`);
/// holds it until stdin closes, then prints `DONE`.
fn timed_alloc(base: usize, burst: usize) {
    let mut base_ptr = 0u64;
    ck!(sys::cuMemAlloc_v2(&mut base_ptr, base));
    let started = std::time::Instant::now();
    let mut ptr = 0u64;
    // SAFETY: a valid out-pointer.
    let status = unsafe { sys::cuMemAlloc_v2(&mut ptr, burst) };
    let us = started.elapsed().as_micros();
    let verdict = if status == CUresult::CUDA_SUCCESS { "GRANTED" } else { "REFUSED" };
    println!("{verdict} {us}");
    std::io::stdout().flush().ok();
    let _ = std::io::stdin().lock().lines().count();
    println!("DONE");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("nvml-only") {
        nvml_only();
        return;
    }
    let k = setup();
    match args.get(1).map(String::as_str) {
        Some("async-order") => async_order(&k),
        Some("vmm-remap") => vmm_remap(&k),
        Some("pool-release") => pool_release(),
        Some("nvml") => nvml_view(),
        Some("slice") => slice_view(),
        Some("hold") => hold(args.get(2).and_then(|b| b.parse().ok()).expect("hold <bytes>")),
        Some("timed-alloc") => {
            let n = |i: usize| args.get(i).and_then(|b| b.parse().ok()).expect("timed-alloc <base> <burst>");
            timed_alloc(n(2), n(3))
        }
        Some("hold-bursts") => {
            let n = |i: usize| {
                args.get(i).and_then(|b| b.parse().ok()).expect("hold-bursts <base> <burst> <count>")
            };
            hold_bursts(&k, n(2), n(3), n(4))
        }
        other => {
            eprintln!("simgpu_probe: unknown subcommand {other:?}");
            std::process::exit(2);
        }
    }
}
