/*
 * implicit_memory.c: takes device memory on the paths a CUDA program does not see as
 * allocations (context limits, module and library loads) and through the pre-3.2 entry
 * points the driver still exports, and reports after each step what the device says this
 * process holds.
 *
 * Usage: implicit_memory <scenario> [file]
 *   limits   cuCtxSetLimit on the stack, printf FIFO and heap, in the primary context and
 *            in a created one
 *   modules  cuModuleLoad (file), cuModuleLoadData(Ex), cuModuleLoadFatBinary,
 *            cuLibraryLoadData and cuLibraryLoadFromFile (file), unloads, and a module
 *            left loaded in a context that is destroyed
 *   legacy   every pre-3.2 entry point, found with dlsym by its unversioned name
 *   legacy-procaddr  the same, found with cuGetProcAddress_v2 at CUDA version 2000
 *
 * Every driver function is found with dlsym in libcuda.so.1 (or cuGetProcAddress_v2),
 * NVML's with dlsym in libnvidia-ml.so.1. After each step it prints one line:
 *   STEP <label> <rc> <used> <free> <value>
 * rc: the step's CUresult; used: this process's usedGpuMemory on device 0 from
 * nvmlDeviceGetComputeRunningProcesses_v3 (0 if not listed); free: cuMemGetInfo_v2's free
 * (0 without a current context); value: what the step read (a limit, a pointer, ...) or 0.
 * Exit status: 0 done; 1 setup failed; 2 usage or loading error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_min.h"

/* ---- NVML: this process's usage on device 0 ---- */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

static int (*nvml_get_processes)(void *device, unsigned int *count, nvmlProcessInfo_t *infos);
static void *nvml_device;

static void *cuda_lib;
static PFN_cuGetProcAddress_v2 get_proc;
static int use_procaddr;

static void die(const char *what) {
    fprintf(stderr, "implicit_memory: %s\n", what);
    exit(2);
}

static void *need(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "implicit_memory: no %s\n", name);
        exit(2);
    }
    return f;
}

/* A driver function by the name a pre-3.2 program links (dlsym), or by its base name at
 * CUDA version `version` (cuGetProcAddress_v2). */
static void *cu(const char *symbol, const char *base, int version) {
    if (!use_procaddr) return need(cuda_lib, symbol);
    void *f = NULL;
    CUdriverProcAddressQueryResult status;
    if (get_proc(base, &f, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || !f) {
        fprintf(stderr, "implicit_memory: cuGetProcAddress_v2(%s, %d) failed (%d)\n", base, version, status);
        exit(2);
    }
    return f;
}

static unsigned long long nvml_used(void) {
    nvmlProcessInfo_t infos[64];
    unsigned int count = 64;
    if (nvml_get_processes(nvml_device, &count, infos) != 0) die("nvmlDeviceGetComputeRunningProcesses_v3 failed");
    for (unsigned int i = 0; i < count; i++)
        if (infos[i].pid == (unsigned int)getpid()) return infos[i].usedGpuMemory;
    return 0;
}

static PFN_cuMemGetInfo get_info;

static void step(const char *label, CUresult rc, unsigned long long value) {
    size_t free = 0, total = 0;
    if (get_info(&free, &total) != CUDA_SUCCESS) free = 0;
    printf("STEP %s %d %llu %zu %llu\n", label, (int)rc, nvml_used(), free, value);
    fflush(stdout);
}

static CUdevice device;
static CUcontext primary;

static void setup(void) {
    cuda_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda_lib) die(dlerror());
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!nvml) die(dlerror());
    get_proc = (PFN_cuGetProcAddress_v2)need(cuda_lib, "cuGetProcAddress_v2");
    int (*nvml_init)(void) = need(nvml, "nvmlInit_v2");
    int (*nvml_handle)(unsigned int, void **) = need(nvml, "nvmlDeviceGetHandleByIndex_v2");
    nvml_get_processes = need(nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (nvml_init() != 0 || nvml_handle(0, &nvml_device) != 0) die("NVML setup failed");

    PFN_cuInit init = (PFN_cuInit)need(cuda_lib, "cuInit");
    PFN_cuDeviceGet device_get = (PFN_cuDeviceGet)need(cuda_lib, "cuDeviceGet");
    PFN_cuDevicePrimaryCtxRetain retain = (PFN_cuDevicePrimaryCtxRetain)need(cuda_lib, "cuDevicePrimaryCtxRetain");
    PFN_cuCtxSetCurrent set_current = (PFN_cuCtxSetCurrent)need(cuda_lib, "cuCtxSetCurrent");
    get_info = (PFN_cuMemGetInfo)need(cuda_lib, "cuMemGetInfo_v2");
    if (init(0) || device_get(&device, 0) || retain(&primary, device) || set_current(primary)) {
        fprintf(stderr, "implicit_memory: CUDA setup failed\n");
        exit(1);
    }
}

/* ---- limits ---- */

static void limits(void) {
    PFN_cuCtxGetLimit_v3010 get_limit = (PFN_cuCtxGetLimit_v3010)need(cuda_lib, "cuCtxGetLimit");
    PFN_cuCtxSetLimit_v3010 set_limit = (PFN_cuCtxSetLimit_v3010)need(cuda_lib, "cuCtxSetLimit");
    PFN_cuCtxCreate_v3020 ctx_create = (PFN_cuCtxCreate_v3020)need(cuda_lib, "cuCtxCreate_v2");
    PFN_cuCtxDestroy_v4000 ctx_destroy = (PFN_cuCtxDestroy_v4000)need(cuda_lib, "cuCtxDestroy_v2");
    size_t v = 0;
    CUresult rc;

    step("start", CUDA_SUCCESS, 0);
    rc = get_limit(&v, CU_LIMIT_STACK_SIZE);
    step("default-stack", rc, v);
    rc = get_limit(&v, CU_LIMIT_PRINTF_FIFO_SIZE);
    step("default-printf", rc, v);
    rc = get_limit(&v, CU_LIMIT_MALLOC_HEAP_SIZE);
    step("default-heap", rc, v);

    step("heap-up", set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, (8u << 20) + (256u << 20)), 0);
    step("heap-back", set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 8u << 20), 0);
    step("stack-up", set_limit(CU_LIMIT_STACK_SIZE, 2048), 0);
    step("stack-back", set_limit(CU_LIMIT_STACK_SIZE, 1024), 0);
    step("printf-up", set_limit(CU_LIMIT_PRINTF_FIFO_SIZE, (1u << 20) + (64u << 20)), 0);
    step("printf-back", set_limit(CU_LIMIT_PRINTF_FIFO_SIZE, 1u << 20), 0);
    step("heap-down", set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 0), 0);
    step("heap-default", set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 8u << 20), 0);

    /* Larger than the device: refused, nothing changes. */
    rc = set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, (size_t)1 << 40);
    get_limit(&v, CU_LIMIT_MALLOC_HEAP_SIZE);
    step("heap-too-big", rc, v);

    /* A limit that takes no memory. */
    rc = set_limit(CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH, 4);
    get_limit(&v, CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH);
    step("sync-depth", rc, v);
    step("unsupported", get_limit(&v, (CUlimit)CU_LIMIT_MAX), 0);

    /* A created context: its own limits, all given back when it is destroyed. */
    CUcontext ctx;
    step("ctx", ctx_create(&ctx, 0, device), 0);
    rc = get_limit(&v, CU_LIMIT_MALLOC_HEAP_SIZE);
    step("ctx-default-heap", rc, v);
    step("ctx-heap-up", set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, (8u << 20) + (128u << 20)), 0);
    step("ctx-destroyed", ctx_destroy(ctx), 0);
}

/* ---- modules and libraries ---- */

static const char image[] = "simgpu reads no image";

static void modules(const char *file) {
    PFN_cuModuleLoad_v2000 load = (PFN_cuModuleLoad_v2000)need(cuda_lib, "cuModuleLoad");
    PFN_cuModuleLoadData_v2000 load_data = (PFN_cuModuleLoadData_v2000)need(cuda_lib, "cuModuleLoadData");
    PFN_cuModuleLoadDataEx_v2010 load_data_ex = (PFN_cuModuleLoadDataEx_v2010)need(cuda_lib, "cuModuleLoadDataEx");
    PFN_cuModuleLoadFatBinary_v2000 load_fat = (PFN_cuModuleLoadFatBinary_v2000)need(cuda_lib, "cuModuleLoadFatBinary");
    PFN_cuModuleUnload_v2000 unload = (PFN_cuModuleUnload_v2000)need(cuda_lib, "cuModuleUnload");
    PFN_cuLibraryLoadData_v12000 lib_load = (PFN_cuLibraryLoadData_v12000)need(cuda_lib, "cuLibraryLoadData");
    PFN_cuLibraryLoadFromFile_v12000 lib_load_file = (PFN_cuLibraryLoadFromFile_v12000)need(cuda_lib, "cuLibraryLoadFromFile");
    PFN_cuLibraryUnload_v12000 lib_unload = (PFN_cuLibraryUnload_v12000)need(cuda_lib, "cuLibraryUnload");
    PFN_cuLibraryGetModule_v12000 lib_module = (PFN_cuLibraryGetModule_v12000)need(cuda_lib, "cuLibraryGetModule");
    PFN_cuCtxSetCurrent set_current = (PFN_cuCtxSetCurrent)need(cuda_lib, "cuCtxSetCurrent");
    PFN_cuCtxCreate_v3020 ctx_create = (PFN_cuCtxCreate_v3020)need(cuda_lib, "cuCtxCreate_v2");
    PFN_cuCtxDestroy_v4000 ctx_destroy = (PFN_cuCtxDestroy_v4000)need(cuda_lib, "cuCtxDestroy_v2");
    CUmodule m[4], lm;
    CUlibrary lib;

    step("start", CUDA_SUCCESS, 0);
    step("load-file", load(&m[0], file), 0);
    step("load-missing", load(&lm, "/nonexistent/simgpu.cubin"), 0);
    step("load-data", load_data(&m[1], image), 0);
    step("load-data-ex", load_data_ex(&m[2], image, 0, NULL, NULL), 0);
    step("load-fatbinary", load_fat(&m[3], image), 0);
    for (int i = 0; i < 4; i++) unload(m[i]);
    step("unloaded", CUDA_SUCCESS, 0);
    step("unload-again", unload(m[0]), 0);

    step("library", lib_load(&lib, image, NULL, NULL, 0, NULL, NULL, 0), 0);
    step("library-unloaded", lib_unload(lib), 0);
    step("library-file", lib_load_file(&lib, file, NULL, NULL, 0, NULL, NULL, 0), 0);
    step("library-file-unloaded", lib_unload(lib), 0);

    /* Loaded without a context: takes its memory when first used in one. */
    set_current(NULL);
    step("library-no-ctx", lib_load(&lib, image, NULL, NULL, 0, NULL, NULL, 0), 0);
    set_current(primary);
    step("library-first-use", lib_module(&lm, lib), 0);
    step("library-second-use", lib_module(&lm, lib), 0);

    /* A destroyed context takes its modules, and what libraries held in it, away. */
    CUcontext ctx;
    step("library-unloaded-again", lib_unload(lib), 0);
    step("ctx", ctx_create(&ctx, 0, device), 0);
    step("ctx-module", load_data(&m[0], image), 0);
    step("ctx-library", lib_load(&lib, image, NULL, NULL, 0, NULL, NULL, 0), 0);
    step("ctx-destroyed", ctx_destroy(ctx), 0);
    step("ctx-module-gone", unload(m[0]), 0);
    step("ctx-library-reused", lib_module(&lm, lib), 0);
    step("end", lib_unload(lib), 0);
}

/* Two modules of SIMGPU_MODULE_BYTES each, on a device with room for one. */
static void modules_oom(void) {
    PFN_cuModuleLoadData_v2000 load_data = (PFN_cuModuleLoadData_v2000)need(cuda_lib, "cuModuleLoadData");
    PFN_cuLibraryLoadData_v12000 lib_load = (PFN_cuLibraryLoadData_v12000)need(cuda_lib, "cuLibraryLoadData");
    CUmodule a, b;
    CUlibrary lib;
    step("start", CUDA_SUCCESS, 0);
    step("first", load_data(&a, image), 0);
    step("second", load_data(&b, image), 0);
    step("library", lib_load(&lib, image, NULL, NULL, 0, NULL, NULL, 0), 0);
}

/* ---- the pre-3.2 entry points ---- */

/* (Each call is made before the step that prints what it wrote: C leaves the order in
 * which a call's arguments are evaluated unspecified.) */

#define V1(name, version) ((PFN_##name##_v##version)cu(#name, #name, version))

static void legacy(void) {
    PFN_cuArrayDestroy destroy_array = NULL;
    destroy_array = (PFN_cuArrayDestroy)need(cuda_lib, "cuArrayDestroy");
    unsigned int u = 0, u2 = 0;
    CUdeviceptr_v1 p = 0, q = 0, base = 0;
    unsigned int host[16], data[16];
    CUresult rc;

    step("start", CUDA_SUCCESS, 0);
    rc = V1(cuDeviceTotalMem, 2000)(&u, device);
    step("total-mem", rc, u);
    rc = V1(cuMemGetInfo, 2000)(&u, &u2);
    step("info-free", rc, u);
    step("info-total", rc, u2);

    rc = V1(cuMemAlloc, 2000)(&p, 256u << 20);
    step("alloc", rc, p);
    rc = V1(cuMemsetD32, 2000)(p, 0xabcd1234u, 16);
    if (!rc) rc = V1(cuMemcpyDtoH, 2000)(host, p, sizeof host);
    step("memset-d32", rc, host[15]);
    for (int i = 0; i < 16; i++) data[i] = 1000u + i;
    rc = V1(cuMemcpyHtoD, 2000)(p, data, sizeof data);
    if (!rc) rc = V1(cuMemcpyDtoD, 2000)(p + 4096, p, sizeof data);
    if (!rc) rc = V1(cuMemcpyDtoH, 2000)(host, p + 4096, sizeof host);
    step("copies", rc, host[15]);
    rc = V1(cuMemsetD8, 2000)(p, 0x11, 4);
    if (!rc) rc = V1(cuMemsetD16, 2000)(p + 4, 0x2222, 2);
    if (!rc) rc = V1(cuMemcpyDtoH, 2000)(host, p, 8);
    step("memset-d8-d16", rc, ((unsigned long long)host[1] << 32) | host[0]);
    rc = V1(cuMemGetAddressRange, 2000)(&base, &u, p + 100);
    step("range-base", rc, base);
    step("range-size", rc, u);

    rc = V1(cuMemAllocPitch, 2000)(&q, &u, 1000, 1024, 4);
    step("pitch", rc, q);
    step("pitch-pitch", rc, u);

    CUarray a, b;
    CUDA_ARRAY_DESCRIPTOR_v1 d2 = {1024, 1024, CU_AD_FORMAT_FLOAT, 1};
    CUDA_ARRAY3D_DESCRIPTOR_v1 d3 = {64, 64, 64, CU_AD_FORMAT_UNSIGNED_INT8, 4, 0};
    step("array", V1(cuArrayCreate, 2000)(&a, &d2), 0);
    step("array3d", V1(cuArray3DCreate, 2000)(&b, &d3), 0);
    destroy_array(a);
    step("arrays-destroyed", destroy_array(b), 0);

    void *h = NULL;
    rc = V1(cuMemAllocHost, 2000)(&h, 1u << 20);
    step("alloc-host", rc, h != NULL);
    step("free", V1(cuMemFree, 2000)(p), 0);
    step("free-pitch", V1(cuMemFree, 2000)(q), 0);

    CUcontext ctx = NULL, popped = NULL;
    step("ctx", V1(cuCtxCreate, 2000)(&ctx, 0, device), 0);
    rc = V1(cuMemAlloc, 2000)(&p, 32u << 20);
    step("ctx-alloc", rc, p);
    rc = V1(cuCtxPopCurrent, 2000)(&popped);
    step("ctx-popped", rc, popped == ctx);
    step("ctx-pushed", V1(cuCtxPushCurrent, 2000)(ctx), 0);
    step("ctx-destroyed", V1(cuCtxDestroy, 2000)(ctx), 0);
    step("primary-released", V1(cuDevicePrimaryCtxRelease, 7000)(device), 0);
}

int main(int argc, char **argv) {
    if (argc < 2) die("usage: implicit_memory <scenario> [file]");
    setup();
    if (!strcmp(argv[1], "limits")) {
        limits();
    } else if (!strcmp(argv[1], "modules") && argc > 2) {
        modules(argv[2]);
    } else if (!strcmp(argv[1], "modules-oom")) {
        modules_oom();
    } else if (!strcmp(argv[1], "legacy")) {
        legacy();
    } else if (!strcmp(argv[1], "legacy-procaddr")) {
        use_procaddr = 1;
        legacy();
    } else {
        die("unknown scenario");
    }
    return 0;
}
