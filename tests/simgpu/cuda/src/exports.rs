//! Every symbol libsimgpu_cuda.so exports, declared once: the list below generates the
//! `extern "C"` functions (each panic-safe) and the name → address table that
//! `dlsym`-style lookups and `cuGetProcAddress` answer from.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};

use cudarc::driver::sys::{
    CUarray, CUcheckpointCheckpointArgs, CUcheckpointLockArgs, CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs, CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUipcMemHandle, CUkernel,
    CUlaunchConfig, CUlibrary, CUmemGenericAllocationHandle, CUmemoryPool, CUmipmappedArray, CUmodule,
    CUprocessState, CUstream, CUuuid, CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY_DESCRIPTOR,
    CUDA_ARRAY_MEMORY_REQUIREMENTS,
};
use cudarc::driver::sys::{CUdevResource, CUdevResourceDesc, CUgreenCtx};
use cudarc::driver::sys::{
    CUgraph, CUgraphExec, CUgraphNode, CUDA_GRAPH_INSTANTIATE_PARAMS, CUDA_MEM_ALLOC_NODE_PARAMS,
};

use gpufrac_common::cuda_sizes::{Array3DDescriptorV1, ArrayDescriptorV1};

use crate::copy::{self, dtoh, htod, Op};
use crate::ffi::{read_str, CUresult};
use crate::stream::CaptureOuts;
use crate::stream::DefaultStream::{Legacy, PerThread};
use crate::{
    array, checkpoint, context, driver, export_tables, graph, green, ipc, memory, module, pool, procaddr,
    stream, vmm,
};

macro_rules! exports {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $body:expr ;)*) => {
        $(
            #[no_mangle]
            #[allow(non_snake_case, clippy::too_many_arguments)]
            pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
                crate::ffi::guard(|| $body)
            }
        )*

        /// The address of the exported function named `symbol`.
        pub(crate) fn lookup(symbol: &str) -> Option<*mut c_void> {
            match symbol {
                $( stringify!($name) => Some($name as *mut c_void), )*
                _ => ungated_lookup(symbol).or_else(|| unsupported_lookup(symbol)),
            }
        }
    };
}

/// Exports that do not pass the checkpoint gate (see `checkpoint`): the checkpoint API
/// acts on other processes, or on this one while its gate is closed.
macro_rules! ungated {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $body:expr ;)*) => {
        $(
            #[no_mangle]
            #[allow(non_snake_case)]
            pub extern "C" fn $name($($arg: $ty),*) -> CUresult {
                crate::ffi::contain(|| $body)
            }
        )*

        fn ungated_lookup(symbol: &str) -> Option<*mut c_void> {
            match symbol {
                $( stringify!($name) => Some($name as *mut c_void), )*
                _ => None,
            }
        }
    };
}

macro_rules! unsupported {
    ($($name:ident),* $(,)?) => {
        $(
            /// Not simulated: answers `CUDA_ERROR_NOT_SUPPORTED` whatever its arguments.
            #[no_mangle]
            #[allow(non_snake_case)]
            pub extern "C" fn $name() -> CUresult {
                CUresult::CUDA_ERROR_NOT_SUPPORTED
            }
        )*

        fn unsupported_lookup(symbol: &str) -> Option<*mut c_void> {
            match symbol {
                $( stringify!($name) => Some($name as *mut c_void), )*
                _ => None,
            }
        }
    };
}

exports! {
    // Initialisation, versions, entry points, errors.
    cuInit(flags: c_uint) => driver::init(flags);
    cuDriverGetVersion(version: *mut c_int) => driver::driver_get_version(version);
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: c_ulonglong)
        => procaddr::get_proc_address(symbol, pfn, version, flags, std::ptr::null_mut());
    cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: c_ulonglong, status: *mut c_int)
        => procaddr::get_proc_address(symbol, pfn, version, flags, status);
    cuGetErrorName(error: c_uint, out: *mut *const c_char) => procaddr::error_name(error, out);
    cuGetErrorString(error: c_uint, out: *mut *const c_char) => procaddr::error_string(error, out);
    cuGetExportTable(table: *mut *const c_void, id: *const CUuuid) => export_tables::get_export_table(table, id);

    // Devices.
    cuDeviceGet(device: *mut CUdevice, ordinal: c_int) => driver::device_get(device, ordinal);
    cuDeviceGetCount(count: *mut c_int) => driver::device_get_count(count);
    cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) => driver::device_get_name(name, len, dev);
    cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) => driver::device_get_uuid(uuid, dev);
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) => driver::device_get_uuid(uuid, dev);
    cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) => driver::device_total_mem(bytes, dev);
    cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) => driver::device_get_attribute(value, attrib, dev);
    cuDeviceGetPCIBusId(id: *mut c_char, len: c_int, dev: CUdevice) => driver::device_get_pci_bus_id(id, len, dev);
    cuDeviceGetByPCIBusId(dev: *mut CUdevice, id: *const c_char) => driver::device_get_by_pci_bus_id(dev, read_str(id)?);
    cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) => driver::device_compute_capability(major, minor, dev);
    cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => pool::device_get_default_mem_pool(pool, dev);
    cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => pool::device_get_mem_pool(pool, dev);
    cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) => pool::device_set_mem_pool(dev, pool);

    // Contexts.
    cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) => context::primary_retain(ctx, dev);
    cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => context::primary_release(dev);
    cuDevicePrimaryCtxReset_v2(dev: CUdevice) => context::primary_reset(dev);
    // The CUDA 7.0 versions, which libcudart 12 still asks for (see procaddr).
    cuDevicePrimaryCtxRelease(dev: CUdevice) => context::primary_release(dev);
    cuDevicePrimaryCtxReset(dev: CUdevice) => context::primary_reset(dev);
    cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) => context::primary_set_flags(dev, flags);
    cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) => context::primary_get_state(dev, flags, active);
    cuCtxCreate_v2(ctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => context::ctx_create(ctx, flags, dev);
    cuCtxCreate_v3(ctx: *mut CUcontext, _params: *mut c_void, _count: c_int, flags: c_uint, dev: CUdevice) => context::ctx_create(ctx, flags, dev);
    cuCtxCreate_v4(ctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) => context::ctx_create(ctx, flags, dev);
    cuCtxDestroy_v2(ctx: CUcontext) => context::ctx_destroy(ctx);
    cuCtxGetCurrent(ctx: *mut CUcontext) => context::ctx_get_current(ctx);
    cuCtxSetCurrent(ctx: CUcontext) => context::ctx_set_current(ctx);
    cuCtxPushCurrent_v2(ctx: CUcontext) => context::ctx_push(ctx);
    cuCtxPopCurrent_v2(ctx: *mut CUcontext) => context::ctx_pop(ctx);
    cuCtxGetDevice(dev: *mut CUdevice) => context::ctx_get_device(dev);
    cuCtxGetFlags(flags: *mut c_uint) => context::ctx_get_flags(flags);
    cuCtxSetFlags(flags: c_uint) => context::ctx_set_flags(flags);
    cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) => context::ctx_get_api_version(ctx, version);
    cuCtxSynchronize() => context::ctx_synchronize();
    cuCtxGetLimit(value: *mut usize, limit: c_int) => context::ctx_get_limit(value, limit);
    cuCtxSetLimit(limit: c_int, value: usize) => context::ctx_set_limit(limit, value);

    // Green contexts (CUDA 12.4+).
    cuDeviceGetDevResource(dev: CUdevice, res: *mut CUdevResource, kind: c_uint) => green::device_get_dev_resource(dev, res, kind);
    cuCtxGetDevResource(ctx: CUcontext, res: *mut CUdevResource, kind: c_uint) => green::ctx_get_dev_resource(ctx, res, kind);
    cuGreenCtxGetDevResource(g: CUgreenCtx, res: *mut CUdevResource, kind: c_uint)
        => green::green_ctx_get_dev_resource(g as usize, res, kind);
    cuDevSmResourceSplitByCount(result: *mut CUdevResource, groups: *mut c_uint, input: *const CUdevResource,
        remaining: *mut CUdevResource, flags: c_uint, min_count: c_uint)
        => green::sm_resource_split_by_count(result, groups, input, remaining, flags, min_count);
    cuDevResourceGenerateDesc(desc: *mut CUdevResourceDesc, res: *const CUdevResource, count: c_uint)
        => green::resource_generate_desc(desc, res, count);
    cuGreenCtxCreate(g: *mut CUgreenCtx, desc: CUdevResourceDesc, dev: CUdevice, flags: c_uint)
        => green::green_ctx_create(g, desc as usize, dev, flags);
    cuGreenCtxDestroy(g: CUgreenCtx) => green::green_ctx_destroy(g as usize);
    cuCtxFromGreenCtx(ctx: *mut CUcontext, g: CUgreenCtx) => green::ctx_from_green_ctx(ctx, g as usize);
    cuGreenCtxStreamCreate(s: *mut CUstream, g: CUgreenCtx, flags: c_uint, priority: c_int)
        => green::green_ctx_stream_create(s, g as usize, flags, priority);

    // Linear memory.
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => memory::mem_get_info(free, total);
    cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => memory::mem_alloc(dptr, size);
    cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint)
        => memory::mem_alloc_pitch(dptr, pitch, width, height, elem);
    cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) => memory::mem_alloc_managed(dptr, size, flags);
    cuMemFree_v2(dptr: CUdeviceptr) => memory::mem_free(dptr);
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) => memory::mem_alloc_host(pp, size);
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, _flags: c_uint) => memory::mem_alloc_host(pp, size);
    cuMemFreeHost(p: *mut c_void) => memory::mem_free_host(p);
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) => memory::mem_get_address_range(base, size, dptr);
    cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: CUdeviceptr) => memory::pointer_get_attribute(data, attribute, ptr);
    cuPointerGetAttributes(count: c_uint, attributes: *mut c_int, data: *mut *mut c_void, ptr: CUdeviceptr)
        => memory::pointer_get_attributes(count, attributes, data, ptr);

    // The pre-3.2 entry points the real driver still exports under their plain names:
    // 32-bit device pointers and sizes (`CUdeviceptr_v1` is `unsigned int`).
    cuMemAlloc(dptr: *mut c_uint, size: c_uint) => memory::mem_alloc_v1(dptr, size);
    cuMemAllocPitch(dptr: *mut c_uint, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint)
        => memory::mem_alloc_pitch_v1(dptr, pitch, width, height, elem);
    cuMemFree(dptr: c_uint) => memory::mem_free(dptr as CUdeviceptr);
    cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) => memory::mem_get_info_v1(free, total);
    cuMemGetAddressRange(base: *mut c_uint, size: *mut c_uint, dptr: c_uint) => memory::mem_get_address_range_v1(base, size, dptr);
    cuMemAllocHost(pp: *mut *mut c_void, size: c_uint) => memory::mem_alloc_host(pp, size as usize);
    cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) => driver::device_total_mem_v1(bytes, dev);
    cuCtxCreate(ctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => context::ctx_create(ctx, flags, dev);
    cuCtxDestroy(ctx: CUcontext) => context::ctx_destroy(ctx);
    cuCtxPushCurrent(ctx: CUcontext) => context::ctx_push(ctx);
    cuCtxPopCurrent(ctx: *mut CUcontext) => context::ctx_pop(ctx);
    cuArrayCreate(a: *mut CUarray, desc: *const ArrayDescriptorV1) => array::array_create_v1(a, desc);
    cuArray3DCreate(a: *mut CUarray, desc: *const Array3DDescriptorV1) => array::array_3d_create_v1(a, desc);
    cuMemcpyHtoD(dst: c_uint, src: *const c_void, n: c_uint) => copy::sync(htod(dst as CUdeviceptr, src, n as usize), Legacy);
    cuMemcpyDtoH(dst: *mut c_void, src: c_uint, n: c_uint) => copy::sync(dtoh(dst, src as CUdeviceptr, n as usize), Legacy);
    cuMemcpyDtoD(dst: c_uint, src: c_uint, n: c_uint)
        => copy::sync(Op::DtoD { dst: dst as CUdeviceptr, src: src as CUdeviceptr, n: n as usize }, Legacy);
    cuMemsetD8(dst: c_uint, v: c_uchar, n: c_uint)
        => copy::sync(Op::Set { dst: dst as CUdeviceptr, value: v as u32, width: 1, count: n as usize }, Legacy);
    cuMemsetD16(dst: c_uint, v: c_ushort, n: c_uint)
        => copy::sync(Op::Set { dst: dst as CUdeviceptr, value: v as u32, width: 2, count: n as usize }, Legacy);
    cuMemsetD32(dst: c_uint, v: c_uint, n: c_uint)
        => copy::sync(Op::Set { dst: dst as CUdeviceptr, value: v, width: 4, count: n as usize }, Legacy);

    // Stream-ordered allocation and pools.
    cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, s: CUstream) => pool::mem_alloc_async(dptr, size, s, Legacy);
    cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, s: CUstream) => pool::mem_alloc_async(dptr, size, s, PerThread);
    cuMemFreeAsync(dptr: CUdeviceptr, s: CUstream) => pool::mem_free_async(dptr, s, Legacy);
    cuMemFreeAsync_ptsz(dptr: CUdeviceptr, s: CUstream) => pool::mem_free_async(dptr, s, PerThread);
    cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, p: CUmemoryPool, s: CUstream)
        => pool::mem_alloc_from_pool_async(dptr, size, p, s, Legacy);
    cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, p: CUmemoryPool, s: CUstream)
        => pool::mem_alloc_from_pool_async(dptr, size, p, s, PerThread);
    cuMemPoolCreate(p: *mut CUmemoryPool, props: *const c_void) => pool::mem_pool_create(p, props);
    cuMemPoolDestroy(p: CUmemoryPool) => pool::mem_pool_destroy(p);
    cuMemPoolTrimTo(p: CUmemoryPool, keep: usize) => pool::mem_pool_trim_to(p, keep);
    cuMemPoolSetAttribute(p: CUmemoryPool, attr: c_int, value: *mut c_void) => pool::mem_pool_set_attribute(p, attr, value);
    cuMemPoolGetAttribute(p: CUmemoryPool, attr: c_int, value: *mut c_void) => pool::mem_pool_get_attribute(p, attr, value);
    cuMemPoolSetAccess(p: CUmemoryPool, map: *const c_void, count: usize) => pool::mem_pool_set_access(p, map, count);
    cuMemPoolGetAccess(flags: *mut u32, p: CUmemoryPool, location: *const c_void) => pool::mem_pool_get_access(flags, p, location);

    // Arrays.
    cuArrayCreate_v2(a: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => array::array_create(a, desc);
    cuArray3DCreate_v2(a: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => array::array_3d_create(a, desc);
    cuArrayDestroy(a: CUarray) => array::array_destroy(a);
    cuMipmappedArrayCreate(a: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint)
        => array::mipmapped_array_create(a, desc, levels);
    cuMipmappedArrayDestroy(a: CUmipmappedArray) => array::mipmapped_array_destroy(a);
    cuArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUarray, dev: CUdevice)
        => array::memory_requirements(req, a as usize, dev, false);
    cuMipmappedArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUmipmappedArray, dev: CUdevice)
        => array::memory_requirements(req, a as usize, dev, true);

    // Virtual memory management.
    cuMemGetAllocationGranularity(g: *mut usize, prop: *const c_void, option: c_uint) => vmm::get_granularity(g, prop, option);
    cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: c_ulonglong)
        => vmm::address_reserve(ptr, size, align, addr, flags);
    cuMemAddressFree(ptr: CUdeviceptr, size: usize) => vmm::address_free(ptr, size);
    cuMemCreate(h: *mut CUmemGenericAllocationHandle, size: usize, prop: *const c_void, flags: c_ulonglong)
        => vmm::mem_create(h, size, prop, flags);
    cuMemRelease(h: CUmemGenericAllocationHandle) => vmm::mem_release(h);
    cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, h: CUmemGenericAllocationHandle, flags: c_ulonglong)
        => vmm::mem_map(ptr, size, offset, h, flags);
    cuMemUnmap(ptr: CUdeviceptr, size: usize) => vmm::mem_unmap(ptr, size);
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const c_void, count: usize) => vmm::mem_set_access(ptr, size, desc, count);
    cuMemGetAllocationPropertiesFromHandle(prop: *mut c_void, h: CUmemGenericAllocationHandle)
        => vmm::get_allocation_properties(prop, h);
    cuMemRetainAllocationHandle(h: *mut CUmemGenericAllocationHandle, addr: *mut c_void) => vmm::retain_allocation_handle(h, addr);
    cuMemExportToShareableHandle(out: *mut c_void, h: CUmemGenericAllocationHandle, kind: c_uint, flags: c_ulonglong)
        => vmm::export_to_shareable_handle(out, h, kind, flags);
    cuMemImportFromShareableHandle(h: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, kind: c_uint)
        => vmm::import_from_shareable_handle(h, os_handle, kind);
    cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) => ipc::get_mem_handle(handle, dptr);
    cuIpcOpenMemHandle_v2(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint)
        => ipc::open_mem_handle(dptr, handle, flags);
    cuIpcOpenMemHandle(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint)
        => ipc::open_mem_handle(dptr, handle, flags);
    cuIpcCloseMemHandle(dptr: CUdeviceptr) => ipc::close_mem_handle(dptr);
    cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) => ipc::device_can_access_peer(can, dev, peer);
    cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) => ipc::ctx_enable_peer_access(peer, flags);
    cuCtxDisablePeerAccess(peer: CUcontext) => ipc::ctx_disable_peer_access(peer);

    // Copies and sets.
    cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) => copy::sync(Op::Unified { dst, src, n }, Legacy);
    cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) => copy::sync(Op::Unified { dst, src, n }, PerThread);
    cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(Op::Unified { dst, src, n }, s, Legacy);
    cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(Op::Unified { dst, src, n }, s, PerThread);
    cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) => copy::sync(htod(dst, src, n), Legacy);
    cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) => copy::sync(htod(dst, src, n), PerThread);
    cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) => copy::sync(dtoh(dst, src, n), Legacy);
    cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) => copy::sync(dtoh(dst, src, n), PerThread);
    cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) => copy::sync(Op::DtoD { dst, src, n }, Legacy);
    cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) => copy::sync(Op::DtoD { dst, src, n }, PerThread);
    cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) => copy::queued(htod(dst, src, n), s, Legacy);
    cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) => copy::queued(htod(dst, src, n), s, PerThread);
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(dtoh(dst, src, n), s, Legacy);
    cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(dtoh(dst, src, n), s, PerThread);
    cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(Op::DtoD { dst, src, n }, s, Legacy);
    cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) => copy::queued(Op::DtoD { dst, src, n }, s, PerThread);
    cuMemsetD8_v2(dst: CUdeviceptr, v: c_uchar, n: usize) => copy::sync(Op::Set { dst, value: v as u32, width: 1, count: n }, Legacy);
    cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: c_uchar, n: usize) => copy::sync(Op::Set { dst, value: v as u32, width: 1, count: n }, PerThread);
    cuMemsetD16_v2(dst: CUdeviceptr, v: c_ushort, n: usize) => copy::sync(Op::Set { dst, value: v as u32, width: 2, count: n }, Legacy);
    cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: c_ushort, n: usize) => copy::sync(Op::Set { dst, value: v as u32, width: 2, count: n }, PerThread);
    cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) => copy::sync(Op::Set { dst, value: v, width: 4, count: n }, Legacy);
    cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: c_uint, n: usize) => copy::sync(Op::Set { dst, value: v, width: 4, count: n }, PerThread);
    cuMemsetD8Async(dst: CUdeviceptr, v: c_uchar, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v as u32, width: 1, count: n }, s, Legacy);
    cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: c_uchar, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v as u32, width: 1, count: n }, s, PerThread);
    cuMemsetD16Async(dst: CUdeviceptr, v: c_ushort, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v as u32, width: 2, count: n }, s, Legacy);
    cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: c_ushort, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v as u32, width: 2, count: n }, s, PerThread);
    cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v, width: 4, count: n }, s, Legacy);
    cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: c_uint, n: usize, s: CUstream) => copy::queued(Op::Set { dst, value: v, width: 4, count: n }, s, PerThread);

    // Streams and events.
    cuStreamCreate(s: *mut CUstream, flags: c_uint) => stream::stream_create(s, flags, 0);
    cuStreamCreateWithPriority(s: *mut CUstream, flags: c_uint, priority: c_int) => stream::stream_create(s, flags, priority);
    cuStreamDestroy_v2(s: CUstream) => stream::stream_destroy(s);
    cuStreamSynchronize(s: CUstream) => stream::stream_synchronize(s, Legacy);
    cuStreamSynchronize_ptsz(s: CUstream) => stream::stream_synchronize(s, PerThread);
    cuStreamQuery(s: CUstream) => stream::stream_query(s, Legacy);
    cuStreamQuery_ptsz(s: CUstream) => stream::stream_query(s, PerThread);
    cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) => stream::stream_wait_event(s, e, flags, Legacy);
    cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, flags: c_uint) => stream::stream_wait_event(s, e, flags, PerThread);
    cuStreamGetCtx(s: CUstream, ctx: *mut CUcontext) => stream::stream_get_ctx(s, ctx, Legacy);
    cuStreamGetCtx_ptsz(s: CUstream, ctx: *mut CUcontext) => stream::stream_get_ctx(s, ctx, PerThread);
    cuStreamGetPriority(s: CUstream, p: *mut c_int) => stream::stream_get_priority(s, p, Legacy);
    cuStreamGetPriority_ptsz(s: CUstream, p: *mut c_int) => stream::stream_get_priority(s, p, PerThread);
    cuStreamGetFlags(s: CUstream, f: *mut c_uint) => stream::stream_get_flags(s, f, Legacy);
    cuStreamGetFlags_ptsz(s: CUstream, f: *mut c_uint) => stream::stream_get_flags(s, f, PerThread);
    cuStreamIsCapturing(s: CUstream, status: *mut c_uint) => stream::stream_is_capturing(s, status, Legacy);
    cuStreamIsCapturing_ptsz(s: CUstream, status: *mut c_uint) => stream::stream_is_capturing(s, status, PerThread);
    cuStreamGetCaptureInfo(s: CUstream, status: *mut c_uint, id: *mut u64)
        => stream::stream_get_capture_info(s, status, CaptureOuts::id_only(id), Legacy);
    cuStreamGetCaptureInfo_ptsz(s: CUstream, status: *mut c_uint, id: *mut u64)
        => stream::stream_get_capture_info(s, status, CaptureOuts::id_only(id), PerThread);
    cuStreamGetCaptureInfo_v2(s: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, count: *mut usize)
        => stream::stream_get_capture_info(s, status, CaptureOuts { id, graph, deps, edges: std::ptr::null_mut(), count }, Legacy);
    cuStreamGetCaptureInfo_v2_ptsz(s: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, count: *mut usize)
        => stream::stream_get_capture_info(s, status, CaptureOuts { id, graph, deps, edges: std::ptr::null_mut(), count }, PerThread);
    cuStreamGetCaptureInfo_v3(s: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void,
        edges: *mut *const c_void, count: *mut usize)
        => stream::stream_get_capture_info(s, status, CaptureOuts { id, graph, deps, edges, count }, Legacy);
    cuStreamGetCaptureInfo_v3_ptsz(s: CUstream, status: *mut c_uint, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void,
        edges: *mut *const c_void, count: *mut usize)
        => stream::stream_get_capture_info(s, status, CaptureOuts { id, graph, deps, edges, count }, PerThread);
    cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) => stream::exchange_capture_mode(mode);

    // Stream capture, graphs and the graph memory pool. cuStreamBeginCapture without
    // a mode is CUDA 10.0's, whose captures behave as GLOBAL ones.
    cuStreamBeginCapture(s: CUstream) => graph::begin_capture(s, graph::MODE_GLOBAL, Legacy);
    cuStreamBeginCapture_ptsz(s: CUstream) => graph::begin_capture(s, graph::MODE_GLOBAL, PerThread);
    cuStreamBeginCapture_v2(s: CUstream, mode: c_uint) => graph::begin_capture(s, mode, Legacy);
    cuStreamBeginCapture_v2_ptsz(s: CUstream, mode: c_uint) => graph::begin_capture(s, mode, PerThread);
    cuStreamEndCapture(s: CUstream, g: *mut CUgraph) => graph::end_capture(s, g, Legacy);
    cuStreamEndCapture_ptsz(s: CUstream, g: *mut CUgraph) => graph::end_capture(s, g, PerThread);
    cuGraphCreate(g: *mut CUgraph, flags: c_uint) => graph::graph_create(g, flags);
    cuGraphDestroy(g: CUgraph) => graph::graph_destroy(g);
    cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) => graph::graph_get_nodes(g, nodes, count);
    cuGraphNodeGetType(node: CUgraphNode, ty: *mut c_uint) => graph::node_get_type(node, ty);
    cuGraphMemAllocNodeGetParams(node: CUgraphNode, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS)
        => graph::mem_alloc_node_get_params(node, params);
    cuGraphInstantiate(e: *mut CUgraphExec, g: CUgraph, err: *mut CUgraphNode, log: *mut c_char, size: usize)
        => graph::instantiate_v1(e, g, err, log, size);
    cuGraphInstantiate_v2(e: *mut CUgraphExec, g: CUgraph, err: *mut CUgraphNode, log: *mut c_char, size: usize)
        => graph::instantiate_v1(e, g, err, log, size);
    cuGraphInstantiateWithFlags(e: *mut CUgraphExec, g: CUgraph, flags: c_ulonglong) => graph::instantiate_with_flags(e, g, flags);
    cuGraphInstantiateWithParams(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS)
        => graph::instantiate_with_params(e, g, p, Legacy);
    cuGraphInstantiateWithParams_ptsz(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS)
        => graph::instantiate_with_params(e, g, p, PerThread);
    cuGraphUpload(e: CUgraphExec, s: CUstream) => graph::graph_upload(e, s, Legacy);
    cuGraphUpload_ptsz(e: CUgraphExec, s: CUstream) => graph::graph_upload(e, s, PerThread);
    cuGraphLaunch(e: CUgraphExec, s: CUstream) => graph::graph_launch(e, s, Legacy);
    cuGraphLaunch_ptsz(e: CUgraphExec, s: CUstream) => graph::graph_launch(e, s, PerThread);
    cuGraphExecDestroy(e: CUgraphExec) => graph::exec_destroy(e);
    cuDeviceGraphMemTrim(dev: CUdevice) => graph::device_graph_mem_trim(dev);
    cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void) => graph::device_get_graph_mem_attribute(dev, attr, value);
    cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void) => graph::device_set_graph_mem_attribute(dev, attr, value);
    cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) => stream::priority_range(least, greatest);
    cuEventCreate(e: *mut CUevent, flags: c_uint) => stream::event_create(e, flags);
    cuEventDestroy_v2(e: CUevent) => stream::event_destroy(e);
    cuEventRecord(e: CUevent, s: CUstream) => stream::event_record(e, s, Legacy);
    cuEventRecord_ptsz(e: CUevent, s: CUstream) => stream::event_record(e, s, PerThread);
    // Flags (CU_EVENT_RECORD_EXTERNAL, for graphs) change nothing outside a capture.
    cuEventRecordWithFlags(e: CUevent, s: CUstream, flags: c_uint) => stream::event_record_with_flags(e, s, flags, Legacy);
    cuEventRecordWithFlags_ptsz(e: CUevent, s: CUstream, flags: c_uint) => stream::event_record_with_flags(e, s, flags, PerThread);
    cuEventSynchronize(e: CUevent) => stream::event_synchronize(e);
    cuEventQuery(e: CUevent) => stream::event_query(e);
    cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) => stream::event_elapsed_time(ms, start, end);
    cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) => stream::event_elapsed_time(ms, start, end);

    // Modules and launches.
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) => module::module_load_data(m, image);
    cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: c_uint, _opts: *mut c_int, _vals: *mut *mut c_void)
        => module::module_load_data(m, image);
    cuModuleLoad(m: *mut CUmodule, path: *const c_char) => module::module_load(m, path);
    cuModuleLoadFatBinary(m: *mut CUmodule, image: *const c_void) => module::module_load_data(m, image);
    cuModuleUnload(m: CUmodule) => module::module_unload(m);
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) => module::module_get_function(f, m, name);
    cuModuleGetGlobal_v2(_dptr: *mut CUdeviceptr, _bytes: *mut usize, m: CUmodule, name: *const c_char)
        => module::module_get_global(m, name);
    cuLibraryGetGlobal(_dptr: *mut CUdeviceptr, _bytes: *mut usize, lib: CUlibrary, name: *const c_char)
        => module::library_get_global(lib, name);
    cuFuncGetAttribute(value: *mut c_int, attrib: c_int, f: CUfunction) => module::func_get_attribute(value, attrib, f);
    cuFuncGetName(name: *mut *const c_char, f: CUfunction) => module::kernel_get_name(name, f);
    cuLibraryLoadData(lib: *mut CUlibrary, image: *const c_void, _jit_opts: *mut c_int, _jit_vals: *mut *mut c_void, _jit_n: c_uint,
        _lib_opts: *mut c_int, _lib_vals: *mut *mut c_void, _lib_n: c_uint)
        => module::library_load_data(lib, image);
    cuLibraryLoadFromFile(lib: *mut CUlibrary, path: *const c_char, _jit_opts: *mut c_int, _jit_vals: *mut *mut c_void, _jit_n: c_uint,
        _lib_opts: *mut c_int, _lib_vals: *mut *mut c_void, _lib_n: c_uint)
        => module::library_load_from_file(lib, path);
    cuLibraryUnload(lib: CUlibrary) => module::library_unload(lib);
    cuLibraryGetKernel(k: *mut CUkernel, lib: CUlibrary, name: *const c_char) => module::library_get_kernel(k, lib, name);
    cuLibraryGetModule(m: *mut CUmodule, lib: CUlibrary) => module::library_get_module(m, lib);
    cuLibraryGetKernelCount(count: *mut c_uint, lib: CUlibrary) => module::library_get_kernel_count(count, lib);
    cuLibraryEnumerateKernels(ks: *mut CUkernel, room: c_uint, lib: CUlibrary) => module::library_enumerate_kernels(ks, room, lib);
    cuKernelGetFunction(f: *mut CUfunction, k: CUkernel) => module::kernel_get_function(f, k);
    cuKernelGetAttribute(value: *mut c_int, attrib: c_int, k: CUkernel, dev: CUdevice) => module::kernel_get_attribute(value, attrib, k, dev);
    cuKernelGetName(name: *mut *const c_char, k: CUkernel) => module::kernel_get_name(name, k.cast());
    cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void)
        => module::launch_kernel_ex(config, f, params, extra, Legacy);
    cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void)
        => module::launch_kernel_ex(config, f, params, extra, PerThread);
    cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint,
        s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void)
        => module::launch_kernel(f, [gx, gy, gz], [bx, by, bz], shared, s, params, extra, Legacy);
    cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint,
        s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void)
        => module::launch_kernel(f, [gx, gy, gz], [bx, by, bz], shared, s, params, extra, PerThread);
}

ungated! {
    cuCheckpointProcessGetState(pid: c_int, state: *mut CUprocessState) => checkpoint::get_state(pid, state);
    cuCheckpointProcessLock(pid: c_int, args: *mut CUcheckpointLockArgs) => checkpoint::lock_process(pid, args);
    cuCheckpointProcessCheckpoint(pid: c_int, args: *mut CUcheckpointCheckpointArgs)
        => checkpoint::checkpoint_process(pid, args);
    cuCheckpointProcessRestore(pid: c_int, args: *mut CUcheckpointRestoreArgs) => checkpoint::restore_process(pid, args);
    cuCheckpointProcessUnlock(pid: c_int, args: *mut CUcheckpointUnlockArgs) => checkpoint::unlock_process(pid, args);
    cuCheckpointProcessGetRestoreThreadId(pid: c_int, tid: *mut c_int) => checkpoint::restore_thread_id(pid, tid);
}

// Entry points that exist in the real driver but are not simulated: programs that probe
// for them get a clean error rather than a missing symbol.
unsupported! {
    cuLaunchCooperativeKernel,
    cuMemHostRegister_v2, cuMemHostUnregister, cuMemHostGetDevicePointer_v2, cuMemcpy2D_v2, cuMemcpy2DAsync_v2,
    cuMemcpy3D_v2, cuMemcpy3DAsync_v2, cuMemcpyPeer, cuMemcpyPeerAsync, cuMemPrefetchAsync, cuMemAdvise,
    cuFuncSetAttribute, cuFuncSetCacheConfig, cuOccupancyMaxActiveBlocksPerMultiprocessor,
    cuTexObjectCreate, cuTexObjectDestroy, cuSurfObjectCreate, cuSurfObjectDestroy,
    cuLaunchHostFunc, cuStreamAddCallback,
    cuLinkCreate_v2, cuLinkAddData_v2, cuLinkComplete, cuLinkDestroy,
    cuMemsetD2D8_v2, cuDeviceGetLuid,
    cuDeviceGetP2PAttribute, cuCtxResetPersistingL2Cache, cuProfilerStart, cuProfilerStop,
    cuMemcpy2D_v2_ptds, cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds, cuMemcpy2DAsync_v2_ptsz,
    cuMemcpy3D_v2_ptds, cuMemcpy3DAsync_v2_ptsz, cuMemcpyPeer_ptds, cuMemcpyPeerAsync_ptsz,
    cuMemsetD2D8_v2_ptds, cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds, cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds,
    cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz, cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz,
    cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz, cuLaunchCooperativeKernel_ptsz,
    // PyTorch's driver table (c10/cuda/driver_api) requires these to exist, and looks for
    // the multicast ones (a miss leaves an error behind in the CUDA runtime).
    cuStreamWriteValue32, cuStreamWriteValue32_ptsz, cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz,
    cuMulticastCreate, cuMulticastAddDevice, cuMulticastBindMem, cuMulticastUnbind,
}

#[cfg(test)]
mod tests {
    use gpufrac_common::cuda_procs::PROCS;

    #[test]
    fn every_entry_point_in_the_table_is_exported() {
        for proc in PROCS {
            for (_, symbol) in proc.versions.iter().chain(proc.per_thread.as_ref().map(|s| (0, *s)).iter()) {
                assert!(super::lookup(symbol).is_some(), "{} ({symbol}) is not exported", proc.name);
            }
        }
    }
}
