/*
 * pool_limits.c: fills stream-ordered memory pools that keep what is freed into them
 * (release threshold UINT64_MAX, as cuda-core, PyTorch and RAPIDS set it), frees, and
 * allocates again elsewhere: under a limit, the memory a pool keeps must still count.
 *
 * Usage: pool_limits <scenario> <chunk_bytes> <count>
 *   default      device 0's current pool, through cuMemAllocAsync
 *   one          one pool made with cuMemPoolCreate on device 0 (cuMemAllocFromPoolAsync)
 *   three        three such pools on device 0, filled in turn
 *   two_devices  a made pool on device 0 and device 1's current pool (cuMemAllocAsync)
 *
 * For each pool in turn it allocates <count> chunks (each must succeed), tries one more,
 * frees them all with cuMemFreeAsync and synchronizes the stream. Then, on each device
 * used, it allocates <count> chunks with cuMemAlloc and tries one more. Output lines:
 *   FREE0 <device> <free>                    cuMemGetInfo free once the context exists
 *   FILL <pool> <device> <extra result>      the result of the chunk past <count>
 *   SYNCED <pool> <device> <free>            cuMemGetInfo free after the free and sync
 *   ALLOC <device> <extra result>            as FILL, for cuMemAlloc
 *   READY                                    then it reads stdin to its end, frees
 *   DONE
 * Exit status: 0 done; 1 a call failed (named on stderr); 2 usage or loading error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_min.h"

/* Not in cuda_min.h: the pool calls and their attribute (cuda.h 12.8 values). */
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
typedef CUresult (*PFN_pool_attr)(CUmemoryPool pool, int attr, void *value);
typedef CUresult (*PFN_device_pool)(CUmemoryPool *pool, CUdevice dev);

static struct {
#define CU_FIELD(base, symbol, params) PFN_##base base;
    CUDA_DRIVER_FUNCTIONS(CU_FIELD)
#undef CU_FIELD
    PFN_pool_attr cuMemPoolSetAttribute;
    PFN_device_pool cuDeviceGetMemPool;
} cu;

static void die(int status, const char *what, CUresult r) {
    fprintf(stderr, "pool_limits: %s failed (%d)\n", what, (int)r);
    exit(status);
}
#define CHECK(call)                                                                             \
    do {                                                                                        \
        CUresult r_ = (call);                                                                   \
        if (r_ != CUDA_SUCCESS) die(1, #call, r_);                                              \
    } while (0)

static void *symbol(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (!fn) {
        fprintf(stderr, "pool_limits: dlsym(%s): %s\n", name, dlerror());
        exit(2);
    }
    return fn;
}

enum { MAX_POOLS = 3, MAX_DEVICES = 2, MAX_CHUNKS = 64 };

struct pool {
    int device;
    CUmemoryPool handle; /* NULL: the device's current pool, through cuMemAllocAsync */
};

static CUcontext ctx[MAX_DEVICES];
static CUstream stream[MAX_DEVICES];

static size_t free_now(int device) {
    size_t free = 0, total = 0;
    CHECK(cu.cuCtxSetCurrent(ctx[device]));
    CHECK(cu.cuMemGetInfo(&free, &total));
    return free;
}

static CUresult alloc_async(const struct pool *p, CUdeviceptr *ptr, size_t bytes) {
    if (p->handle) return cu.cuMemAllocFromPoolAsync(ptr, bytes, p->handle, stream[p->device]);
    return cu.cuMemAllocAsync(ptr, bytes, stream[p->device]);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s default|one|three|two_devices <chunk_bytes> <count>\n", argv[0]);
        return 2;
    }
    const char *scenario = argv[1];
    size_t chunk = strtoull(argv[2], NULL, 0);
    int count = atoi(argv[3]);
    if (count <= 0 || count > MAX_CHUNKS) return 2;

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "pool_limits: dlopen(libcuda.so.1): %s\n", dlerror());
        return 2;
    }
#define CU_LOAD(base, sym, params) cu.base = (PFN_##base)symbol(lib, #sym);
    CUDA_DRIVER_FUNCTIONS(CU_LOAD)
#undef CU_LOAD
    cu.cuMemPoolSetAttribute = (PFN_pool_attr)symbol(lib, "cuMemPoolSetAttribute");
    cu.cuDeviceGetMemPool = (PFN_device_pool)symbol(lib, "cuDeviceGetMemPool");

    struct pool pools[MAX_POOLS];
    int npools = 0, ndevices = 1;
    int made = !strcmp(scenario, "one") ? 1 : !strcmp(scenario, "three") ? 3 : 0;
    if (!strcmp(scenario, "two_devices")) {
        made = 1;
        ndevices = 2;
    } else if (!made && strcmp(scenario, "default")) {
        fprintf(stderr, "pool_limits: unknown scenario %s\n", scenario);
        return 2;
    }

    CHECK(cu.cuInit(0));
    for (int d = 0; d < ndevices; d++) {
        CUdevice dev;
        CHECK(cu.cuDeviceGet(&dev, d));
        CHECK(cu.cuDevicePrimaryCtxRetain(&ctx[d], dev));
        CHECK(cu.cuCtxSetCurrent(ctx[d]));
        CHECK(cu.cuStreamCreate(&stream[d], CU_STREAM_NON_BLOCKING));
        printf("FREE0 %d %zu\n", d, free_now(d));
    }
    uint64_t keep_all = UINT64_MAX;
    for (int i = 0; i < made; i++) {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = 0;
        CHECK(cu.cuMemPoolCreate(&pools[npools].handle, &props));
        CHECK(cu.cuMemPoolSetAttribute(pools[npools].handle, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all));
        pools[npools++].device = 0;
    }
    if (!made || ndevices == 2) {
        /* The device's current pool, as cuMemAllocAsync finds it. */
        int d = ndevices - 1;
        CUdevice dev;
        CUmemoryPool current;
        CHECK(cu.cuDeviceGet(&dev, d));
        CHECK(cu.cuDeviceGetMemPool(&current, dev));
        CHECK(cu.cuMemPoolSetAttribute(current, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all));
        pools[npools].handle = NULL;
        pools[npools++].device = d;
    }

    CUdeviceptr ptrs[MAX_CHUNKS + 1];
    for (int i = 0; i < npools; i++) {
        const struct pool *p = &pools[i];
        CHECK(cu.cuCtxSetCurrent(ctx[p->device]));
        for (int c = 0; c < count; c++) CHECK(alloc_async(p, &ptrs[c], chunk));
        CUresult extra = alloc_async(p, &ptrs[count], chunk);
        printf("FILL %d %d %d\n", i, p->device, (int)extra);
        fflush(stdout);
        if (extra == CUDA_SUCCESS) CHECK(cu.cuMemFreeAsync(ptrs[count], stream[p->device]));
        for (int c = 0; c < count; c++) CHECK(cu.cuMemFreeAsync(ptrs[c], stream[p->device]));
        CHECK(cu.cuStreamSynchronize(stream[p->device]));
        printf("SYNCED %d %d %zu\n", i, p->device, free_now(p->device));
        fflush(stdout);
    }

    static CUdeviceptr held[MAX_DEVICES][MAX_CHUNKS];
    for (int d = 0; d < ndevices; d++) {
        CHECK(cu.cuCtxSetCurrent(ctx[d]));
        for (int c = 0; c < count; c++) CHECK(cu.cuMemAlloc(&held[d][c], chunk));
        CUdeviceptr extra_ptr;
        CUresult extra = cu.cuMemAlloc(&extra_ptr, chunk);
        if (extra == CUDA_SUCCESS) CHECK(cu.cuMemFree(extra_ptr));
        printf("ALLOC %d %d\n", d, (int)extra);
    }
    printf("READY\n");
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
    }
    for (int d = 0; d < ndevices; d++) {
        CHECK(cu.cuCtxSetCurrent(ctx[d]));
        for (int c = 0; c < count; c++) CHECK(cu.cuMemFree(held[d][c]));
    }
    for (int i = 0; i < npools; i++) {
        if (pools[i].handle) CHECK(cu.cuMemPoolDestroy(pools[i].handle));
    }
    printf("DONE\n");
    fflush(stdout);
    return 0;
}
