//! The one list of hooked symbols, shared by the two libraries of the shim:
//! `libgpufrac_core.so` (this crate) builds its hooks, its `dlsym` and `cuGetProcAddress`
//! answers and the real functions' pointers from it; `libgpufrac.so` (`shim/preload`)
//! builds the exported entry points that load the core at the first call. Both read this
//! file, so the two can never disagree on a name, a signature or a position.
//!
//! `hook_list!(callback)` hands the list to `callback!`. Two kinds of entries:
//! - `implemented`: the shim's own logic runs (accounting, the virtual device, contexts);
//! - `gated`: launches, copies and sets, which pass through the gate (held while the
//!   process's burst memory is swapped out, or while its group waits for its compute
//!   lease) and then straight to the driver. `@ expr` names the stream the call starts its
//!   work on (read only on the gate's slow path); without it, the legacy default stream.
//!
//! Argument types are the names `Ptr`, `Handle`, `CUdeviceptr` and `std::ffi`'s C types,
//! resolved where the callback expands. An implementation is named by its path from the
//! crate root (`hooks::memory::mem_free`) and a stream by a function the expanding module
//! imports (`per_thread`, `config_stream`): the list itself depends on nothing, so the
//! driver's table at the bottom of the shim is built from it, and only the registry at the
//! top, which expands the implementations, reaches the hooks.

macro_rules! hook_list {
    ($callback:ident) => {
        $callback! {
            implemented {
                // Initialisation and entry points.
                Cuda cuInit(flags: c_uint) => registry::init::cu_init;
                Cuda cuGetProcAddress(symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: c_ulonglong)
                    => registry::procaddr::get_proc_address;
                Cuda cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: c_ulonglong, status: *mut c_int)
                    => registry::procaddr::get_proc_address_v2;
                // The virtual device.
                Cuda cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => hooks::device::mem_get_info;
                Cuda cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) => hooks::device::device_total_mem;
                // Contexts and their own memory.
                Cuda cuDevicePrimaryCtxRetain(ctx: *mut Ptr, dev: c_int) => hooks::context::primary_retain;
                Cuda cuDevicePrimaryCtxRelease_v2(dev: c_int) => hooks::context::primary_release;
                Cuda cuDevicePrimaryCtxReset_v2(dev: c_int) => hooks::context::primary_reset;
                // The CUDA 7.0 versions, which libcudart 12 still asks cuGetProcAddress for.
                Cuda cuDevicePrimaryCtxRelease(dev: c_int) => hooks::context::primary_release_v1;
                Cuda cuDevicePrimaryCtxReset(dev: c_int) => hooks::context::primary_reset_v1;
                Cuda cuCtxCreate_v2(ctx: *mut Ptr, flags: c_uint, dev: c_int) => hooks::context::ctx_create_v2;
                Cuda cuCtxCreate_v3(ctx: *mut Ptr, params: Ptr, count: c_int, flags: c_uint, dev: c_int) => hooks::context::ctx_create_v3;
                Cuda cuCtxCreate_v4(ctx: *mut Ptr, params: Ptr, flags: c_uint, dev: c_int) => hooks::context::ctx_create_v4;
                Cuda cuCtxDestroy_v2(ctx: Ptr) => hooks::context::ctx_destroy;
                Cuda cuGreenCtxCreate(green: *mut Ptr, desc: Ptr, dev: c_int, flags: c_uint) => hooks::context::green_ctx_create;
                Cuda cuGreenCtxDestroy(green: Ptr) => hooks::context::green_ctx_destroy;
                // Memory the driver takes without a size argument.
                Cuda cuCtxSetLimit(limit: c_int, value: usize) => hooks::implicit::ctx_set_limit;
                Cuda cuModuleLoad(module: *mut Ptr, path: *const c_char) => hooks::implicit::module_load;
                Cuda cuModuleLoadData(module: *mut Ptr, image: *const c_void) => hooks::implicit::module_load_data;
                Cuda cuModuleLoadDataEx(module: *mut Ptr, image: *const c_void, count: c_uint, options: *mut c_int, values: *mut Ptr)
                    => hooks::implicit::module_load_data_ex;
                Cuda cuModuleLoadFatBinary(module: *mut Ptr, image: *const c_void) => hooks::implicit::module_load_fat_binary;
                Cuda cuModuleUnload(module: Ptr) => hooks::implicit::module_unload;
                Cuda cuLibraryLoadData(library: *mut Ptr, code: *const c_void, jit_options: *mut c_int, jit_values: *mut Ptr,
                    jit_count: c_uint, options: *mut c_int, values: *mut Ptr, count: c_uint) => hooks::implicit::library_load_data;
                Cuda cuLibraryLoadFromFile(library: *mut Ptr, path: *const c_char, jit_options: *mut c_int, jit_values: *mut Ptr,
                    jit_count: c_uint, options: *mut c_int, values: *mut Ptr, count: c_uint) => hooks::implicit::library_load_from_file;
                Cuda cuLibraryUnload(library: Ptr) => hooks::implicit::library_unload;
                // Streams the compute lease watches for its drain.
                Cuda cuStreamDestroy_v2(stream: Ptr) => control::compute::stream_destroy;
                // Waits for the GPU: a thread in one is about to start more work, so its
                // group's compute lease is not given back as idle under it.
                Cuda cuCtxSynchronize() => control::compute::ctx_synchronize;
                Cuda cuStreamSynchronize(stream: Ptr) => control::compute::stream_synchronize;
                Cuda cuStreamSynchronize_ptsz(stream: Ptr) => control::compute::stream_synchronize_ptsz;
                Cuda cuEventSynchronize(event: Ptr) => control::compute::event_synchronize;
                // CUDA graphs: what their memory pool keeps (launches pass the gate too).
                Cuda cuGraphInstantiate(exec: *mut Ptr, graph: Ptr, error_node: *mut Ptr, log: *mut c_char, size: usize)
                    => hooks::graphs::instantiate_v1;
                Cuda cuGraphInstantiate_v2(exec: *mut Ptr, graph: Ptr, error_node: *mut Ptr, log: *mut c_char, size: usize)
                    => hooks::graphs::instantiate_v2;
                Cuda cuGraphInstantiateWithFlags(exec: *mut Ptr, graph: Ptr, flags: c_ulonglong) => hooks::graphs::instantiate_with_flags;
                Cuda cuGraphInstantiateWithParams(exec: *mut Ptr, graph: Ptr, params: Ptr) => hooks::graphs::instantiate_with_params;
                Cuda cuGraphInstantiateWithParams_ptsz(exec: *mut Ptr, graph: Ptr, params: Ptr)
                    => hooks::graphs::instantiate_with_params_ptsz;
                Cuda cuGraphUpload(exec: Ptr, stream: Ptr) => hooks::graphs::upload;
                Cuda cuGraphUpload_ptsz(exec: Ptr, stream: Ptr) => hooks::graphs::upload_ptsz;
                Cuda cuGraphLaunch(exec: Ptr, stream: Ptr) => hooks::graphs::launch;
                Cuda cuGraphLaunch_ptsz(exec: Ptr, stream: Ptr) => hooks::graphs::launch_ptsz;
                Cuda cuGraphExecDestroy(exec: Ptr) => hooks::graphs::exec_destroy;
                Cuda cuDeviceGraphMemTrim(dev: c_int) => hooks::graphs::mem_trim;
                // Captures under way: what frameworks keep is not given back meanwhile (a
                // free from another thread would invalidate a global-mode capture).
                Cuda cuStreamBeginCapture(stream: Ptr) => hooks::graphs::begin_capture_v1;
                Cuda cuStreamBeginCapture_ptsz(stream: Ptr) => hooks::graphs::begin_capture_v1_ptsz;
                Cuda cuStreamBeginCapture_v2(stream: Ptr, mode: c_uint) => hooks::graphs::begin_capture;
                Cuda cuStreamBeginCapture_v2_ptsz(stream: Ptr, mode: c_uint) => hooks::graphs::begin_capture_ptsz;
                Cuda cuStreamEndCapture(stream: Ptr, graph: *mut Ptr) => hooks::graphs::end_capture;
                Cuda cuStreamEndCapture_ptsz(stream: Ptr, graph: *mut Ptr) => hooks::graphs::end_capture_ptsz;
                // Every allocation path.
                Cuda cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => hooks::memory::mem_alloc;
                Cuda cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint)
                    => hooks::memory::mem_alloc_pitch;
                Cuda cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) => hooks::memory::mem_alloc_managed;
                Cuda cuMemFree_v2(dptr: CUdeviceptr) => hooks::memory::mem_free;
                Cuda cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: Ptr) => hooks::memory::mem_alloc_async;
                Cuda cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: Ptr) => hooks::memory::mem_alloc_async_ptsz;
                Cuda cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: Ptr, stream: Ptr)
                    => hooks::memory::mem_alloc_from_pool_async;
                Cuda cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: Ptr, stream: Ptr)
                    => hooks::memory::mem_alloc_from_pool_async_ptsz;
                Cuda cuMemFreeAsync(dptr: CUdeviceptr, stream: Ptr) => hooks::memory::mem_free_async;
                Cuda cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: Ptr) => hooks::memory::mem_free_async_ptsz;
                Cuda cuMemPoolCreate(pool: *mut Ptr, props: *const c_void) => hooks::memory::mem_pool_create;
                Cuda cuMemPoolDestroy(pool: Ptr) => hooks::memory::mem_pool_destroy;
                Cuda cuMemPoolTrimTo(pool: Ptr, keep: usize) => hooks::memory::mem_pool_trim_to;
                Cuda cuArrayCreate_v2(array: *mut Ptr, desc: *const c_void) => hooks::memory::array_create;
                Cuda cuArray3DCreate_v2(array: *mut Ptr, desc: *const c_void) => hooks::memory::array_3d_create;
                Cuda cuArrayDestroy(array: Ptr) => hooks::memory::array_destroy;
                Cuda cuMipmappedArrayCreate(array: *mut Ptr, desc: *const c_void, levels: c_uint) => hooks::memory::mipmapped_array_create;
                Cuda cuMipmappedArrayDestroy(array: Ptr) => hooks::memory::mipmapped_array_destroy;
                Cuda cuMemCreate(handle: *mut Handle, size: usize, prop: *const c_void, flags: c_ulonglong) => hooks::memory::mem_create;
                Cuda cuMemRelease(handle: Handle) => hooks::memory::mem_release;
                Cuda cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: Handle, flags: c_ulonglong) => hooks::memory::mem_map;
                Cuda cuMemUnmap(ptr: CUdeviceptr, size: usize) => hooks::memory::mem_unmap;
                Cuda cuMemRetainAllocationHandle(handle: *mut Handle, addr: Ptr) => hooks::memory::mem_retain_allocation_handle;
                Cuda cuMemExportToShareableHandle(shareable: Ptr, handle: Handle, kind: c_int, flags: c_ulonglong)
                    => hooks::memory::mem_export;
                Cuda cuIpcGetMemHandle(handle: Ptr, dptr: CUdeviceptr) => hooks::memory::ipc_get_mem_handle;
                // The pre-3.2 entry points the real driver still exports (32-bit addresses
                // and sizes), reached by dlsym or a cuGetProcAddress for an old version.
                Cuda cuMemAlloc(dptr: *mut c_uint, size: c_uint) => hooks::memory::mem_alloc_v1;
                Cuda cuMemAllocPitch(dptr: *mut c_uint, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint)
                    => hooks::memory::mem_alloc_pitch_v1;
                Cuda cuMemFree(dptr: c_uint) => hooks::memory::mem_free_v1;
                Cuda cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) => hooks::device::mem_get_info_v1;
                Cuda cuDeviceTotalMem(bytes: *mut c_uint, dev: c_int) => hooks::device::device_total_mem_v1;
                Cuda cuCtxCreate(ctx: *mut Ptr, flags: c_uint, dev: c_int) => hooks::context::ctx_create_v1;
                Cuda cuCtxDestroy(ctx: Ptr) => hooks::context::ctx_destroy_v1;
                Cuda cuArrayCreate(array: *mut Ptr, desc: *const c_void) => hooks::memory::array_create_v1;
                Cuda cuArray3DCreate(array: *mut Ptr, desc: *const c_void) => hooks::memory::array_3d_create_v1;
                // NVML's view of the device.
                Nvml nvmlDeviceGetMemoryInfo(device: Ptr, memory: *mut c_void) => hooks::nvml::memory_info;
                Nvml nvmlDeviceGetMemoryInfo_v2(device: Ptr, memory: *mut c_void) => hooks::nvml::memory_info_v2;
                // NVML's process lists: the group's own processes only.
                Nvml nvmlDeviceGetComputeRunningProcesses(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::compute_v1;
                Nvml nvmlDeviceGetComputeRunningProcesses_v2(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::compute_v2;
                Nvml nvmlDeviceGetComputeRunningProcesses_v3(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::compute_v3;
                Nvml nvmlDeviceGetGraphicsRunningProcesses(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::graphics_v1;
                Nvml nvmlDeviceGetGraphicsRunningProcesses_v2(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::graphics_v2;
                Nvml nvmlDeviceGetGraphicsRunningProcesses_v3(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::graphics_v3;
                Nvml nvmlDeviceGetMPSComputeRunningProcesses(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::mps_v1;
                Nvml nvmlDeviceGetMPSComputeRunningProcesses_v2(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::mps_v2;
                Nvml nvmlDeviceGetMPSComputeRunningProcesses_v3(device: Ptr, count: *mut c_uint, infos: Ptr) => hooks::processes::mps_v3;
                Nvml nvmlDeviceGetProcessUtilization(device: Ptr, samples: Ptr, count: *mut c_uint, last_seen: c_ulonglong)
                    => hooks::processes::utilization;
                Nvml nvmlDeviceGetProcessesUtilizationInfo(device: Ptr, info: Ptr) => hooks::processes::utilization_info;
            }
            gated {
                cuLaunchKernel(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint,
                    stream: Ptr, params: *mut Ptr, extra: *mut Ptr) @ stream;
                cuLaunchKernel_ptsz(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint,
                    stream: Ptr, params: *mut Ptr, extra: *mut Ptr) @ per_thread(stream);
                cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
                cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Ptr) @ stream;
                cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize);
                cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize);
                cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
                cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: Ptr) @ stream;
                cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: Ptr) @ stream;
                cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Ptr) @ stream;
                cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD8_v2(dst: CUdeviceptr, value: c_uchar, n: usize);
                cuMemsetD8_v2_ptds(dst: CUdeviceptr, value: c_uchar, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD16_v2(dst: CUdeviceptr, value: c_ushort, n: usize);
                cuMemsetD16_v2_ptds(dst: CUdeviceptr, value: c_ushort, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD32_v2(dst: CUdeviceptr, value: c_uint, n: usize);
                cuMemsetD32_v2_ptds(dst: CUdeviceptr, value: c_uint, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD8Async(dst: CUdeviceptr, value: c_uchar, n: usize, stream: Ptr) @ stream;
                cuMemsetD8Async_ptsz(dst: CUdeviceptr, value: c_uchar, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD16Async(dst: CUdeviceptr, value: c_ushort, n: usize, stream: Ptr) @ stream;
                cuMemsetD16Async_ptsz(dst: CUdeviceptr, value: c_ushort, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD32Async(dst: CUdeviceptr, value: c_uint, n: usize, stream: Ptr) @ stream;
                cuMemsetD32Async_ptsz(dst: CUdeviceptr, value: c_uint, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemcpy2D_v2(copy: *const c_void);
                cuMemcpy2D_v2_ptds(copy: *const c_void) @ per_thread(std::ptr::null_mut());
                cuMemcpy2DUnaligned_v2(copy: *const c_void);
                cuMemcpy2DUnaligned_v2_ptds(copy: *const c_void) @ per_thread(std::ptr::null_mut());
                cuMemcpy2DAsync_v2(copy: *const c_void, stream: Ptr) @ stream;
                cuMemcpy2DAsync_v2_ptsz(copy: *const c_void, stream: Ptr) @ per_thread(stream);
                cuMemcpy3D_v2(copy: *const c_void);
                cuMemcpy3D_v2_ptds(copy: *const c_void) @ per_thread(std::ptr::null_mut());
                cuMemcpy3DAsync_v2(copy: *const c_void, stream: Ptr) @ stream;
                cuMemcpy3DAsync_v2_ptsz(copy: *const c_void, stream: Ptr) @ per_thread(stream);
                cuMemcpyPeer(dst: CUdeviceptr, dst_ctx: Ptr, src: CUdeviceptr, src_ctx: Ptr, n: usize);
                cuMemcpyPeer_ptds(dst: CUdeviceptr, dst_ctx: Ptr, src: CUdeviceptr, src_ctx: Ptr, n: usize) @ per_thread(std::ptr::null_mut());
                cuMemcpyPeerAsync(dst: CUdeviceptr, dst_ctx: Ptr, src: CUdeviceptr, src_ctx: Ptr, n: usize, stream: Ptr) @ stream;
                cuMemcpyPeerAsync_ptsz(dst: CUdeviceptr, dst_ctx: Ptr, src: CUdeviceptr, src_ctx: Ptr, n: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, value: c_uchar, width: usize, height: usize);
                cuMemsetD2D8_v2_ptds(dst: CUdeviceptr, pitch: usize, value: c_uchar, width: usize, height: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, value: c_ushort, width: usize, height: usize);
                cuMemsetD2D16_v2_ptds(dst: CUdeviceptr, pitch: usize, value: c_ushort, width: usize, height: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, value: c_uint, width: usize, height: usize);
                cuMemsetD2D32_v2_ptds(dst: CUdeviceptr, pitch: usize, value: c_uint, width: usize, height: usize) @ per_thread(std::ptr::null_mut());
                cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, value: c_uchar, width: usize, height: usize, stream: Ptr) @ stream;
                cuMemsetD2D8Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_uchar, width: usize, height: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, value: c_ushort, width: usize, height: usize, stream: Ptr) @ stream;
                cuMemsetD2D16Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_ushort, width: usize, height: usize, stream: Ptr) @ per_thread(stream);
                cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, value: c_uint, width: usize, height: usize, stream: Ptr) @ stream;
                cuMemsetD2D32Async_ptsz(dst: CUdeviceptr, pitch: usize, value: c_uint, width: usize, height: usize, stream: Ptr) @ per_thread(stream);
                cuLaunchKernelEx(config: *const c_void, f: Ptr, params: *mut Ptr, extra: *mut Ptr) @ config_stream(config);
                cuLaunchKernelEx_ptsz(config: *const c_void, f: Ptr, params: *mut Ptr, extra: *mut Ptr) @ per_thread(config_stream(config));
                cuLaunchCooperativeKernel(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
                    shared: c_uint, stream: Ptr, params: *mut Ptr) @ stream;
                cuLaunchCooperativeKernel_ptsz(f: Ptr, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
                    shared: c_uint, stream: Ptr, params: *mut Ptr) @ per_thread(stream);
            }
        }
    };
}

/// FNV-1a of `list`: the fingerprint both libraries compute of the hook names and
/// signatures, so that a core from another build is refused instead of called wrongly.
pub(crate) const fn fingerprint(list: &str) -> u64 {
    let bytes = list.as_bytes();
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    let mut i = 0;
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u64).wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

/// What `gpufrac_core_lookup` answers when it failed (a panic inside the core): the
/// caller must not fall back to the real driver's function, which would run unaccounted.
#[allow(dead_code)]
pub(crate) const LOOKUP_FAILED: usize = usize::MAX;
