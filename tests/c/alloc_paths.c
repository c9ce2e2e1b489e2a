/*
 * alloc_paths.c: fills device 0 through one allocation path of the CUDA driver API,
 * holds the memory until told to let go, frees it, and checks the driver got it all back.
 *
 * One source, three ways of reaching the driver, chosen by exactly one define:
 *   -DMODE_LINKED    calls the exported symbols directly (linked with -lcuda);
 *   -DMODE_DLSYM     dlopen("libcuda.so.1") and dlsym of each exported symbol;
 *   -DMODE_PROCADDR  dlsym of cuGetProcAddress_v2 only, which then resolves every other
 *                    function by its base name for CUDA 12080, CU_GET_PROC_ADDRESS_DEFAULT.
 *
 * Usage: alloc_paths <path> <chunk_bytes> [limit_bytes]
 *   path: alloc | pitch | managed | async | pool | array | array3d | vmm
 *   chunk_bytes: size of each allocation (vmm rounds it up to the allocation granularity)
 *   limit_bytes: optional; stop before holding more than this many bytes
 *
 * It initialises the driver, makes device 0's primary context current, then allocates
 * chunks until one returns CUDA_ERROR_OUT_OF_MEMORY (or the limit is reached), checks that
 * the first allocation holds what is written to it (where the path allows plain copies),
 * and prints, each line flushed at once:
 *   READY <bytes held> <free> <total>     free and total from cuMemGetInfo_v2
 * It then reads stdin until end of file, frees everything, checks that cuMemGetInfo_v2's
 * free is back to its value right after context creation, and prints
 *   DONE
 * If creating the context itself runs out of device memory it prints CTX_OOM instead.
 *
 * Exit status: 0 done; 1 a driver call failed with something other than out-of-memory
 * during allocation (named on stderr with cuGetErrorName); 2 usage or loading error;
 * 3 CTX_OOM; 4 wrong data read back or memory not given back.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_min.h"

#if defined(MODE_LINKED) + defined(MODE_DLSYM) + defined(MODE_PROCADDR) != 1
#error "define exactly one of MODE_LINKED, MODE_DLSYM, MODE_PROCADDR"
#endif

#if defined(MODE_LINKED)
#define MODE_NAME "linked"
#elif defined(MODE_DLSYM)
#define MODE_NAME "dlsym"
#else
#define MODE_NAME "procaddr"
#endif

enum { EXIT_CUDA = 1, EXIT_USAGE = 2, EXIT_CTX_OOM = 3, EXIT_MISMATCH = 4 };

/* ---- the driver, however it was reached ---- */

static struct {
#define CU_FIELD(base, symbol, params) PFN_##base base;
    CUDA_DRIVER_FUNCTIONS(CU_FIELD)
#undef CU_FIELD
} cu;

__attribute__((format(printf, 2, 3), noreturn)) static void die(int status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "alloc_paths (" MODE_NAME "): ");
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(status);
}

#if defined(MODE_DLSYM) || defined(MODE_PROCADDR)
static void *open_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) die(EXIT_USAGE, "dlopen(libcuda.so.1): %s", dlerror());
    return lib;
}
#endif

#if defined(MODE_PROCADDR)
static void *resolve(PFN_cuGetProcAddress_v2 get_proc, const char *base) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get_proc(base, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (r != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || !fn) {
        die(EXIT_USAGE, "cuGetProcAddress_v2(\"%s\", 12080, DEFAULT): result %d, symbolStatus %d, pfn %s",
            base, (int)r, (int)status, fn ? "set" : "NULL");
    }
    return fn;
}
#endif

static void load_driver(void) {
#if defined(MODE_LINKED)
#define CU_LOAD(base, symbol, params) cu.base = symbol;
    CUDA_DRIVER_FUNCTIONS(CU_LOAD)
#undef CU_LOAD
#elif defined(MODE_DLSYM)
    void *lib = open_driver();
#define CU_LOAD(base, symbol, params)                                                           \
    {                                                                                           \
        void *fn = dlsym(lib, #symbol);                                                         \
        if (!fn) die(EXIT_USAGE, "dlsym(%s): %s", #symbol, dlerror());                          \
        cu.base = (PFN_##base)fn;                                                               \
    }
    CUDA_DRIVER_FUNCTIONS(CU_LOAD)
#undef CU_LOAD
#else
    void *lib = open_driver();
    void *sym = dlsym(lib, "cuGetProcAddress_v2");
    if (!sym) die(EXIT_USAGE, "dlsym(%s): %s", "cuGetProcAddress_v2", dlerror());
    PFN_cuGetProcAddress_v2 get_proc = (PFN_cuGetProcAddress_v2)sym;
#define CU_LOAD(base, symbol, params) cu.base = (PFN_##base)resolve(get_proc, #base);
    CUDA_DRIVER_FUNCTIONS(CU_LOAD)
#undef CU_LOAD
#endif
}

static const char *error_name(CUresult r) {
    const char *name = NULL;
    if (cu.cuGetErrorName(r, &name) != CUDA_SUCCESS || !name) return "(no name)";
    return name;
}

/* Any failure is fatal: the call and cuGetErrorName's name go to stderr. */
static void check(CUresult r, const char *call) {
    if (r == CUDA_SUCCESS) return;
    die(EXIT_CUDA, "%s failed: %s (%d)", call, error_name(r), (int)r);
}
#define CHECK(call) check((call), #call)

/* For allocations: 1 on success, 0 on out-of-memory, fatal otherwise. */
static int allocated(CUresult r, const char *call) {
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
    check(r, call);
    return 1;
}
#define ALLOCATED(call) allocated((call), #call)

/* ---- the allocation paths ---- */

enum path { ALLOC, PITCH, MANAGED, ASYNC, POOL, ARRAY, ARRAY3D, VMM };
static const char *const PATH_NAMES[] = {"alloc", "pitch", "managed", "async",
                                         "pool",  "array", "array3d", "vmm"};

/* One allocation, whatever its path. */
struct block {
    CUdeviceptr ptr; /* linear paths and vmm */
    size_t bytes;    /* device memory it holds */
    CUarray array;   /* array paths */
    CUmemGenericAllocationHandle handle; /* vmm */
};

static enum path path;
static CUdevice device;
static CUstream stream;   /* async, pool */
static CUmemoryPool pool; /* pool */
static CUmemAllocationProp vmm_prop;
static size_t vmm_granularity;
static CUdeviceptr vmm_base;
static size_t vmm_reserved, vmm_next;

static const size_t ARRAY_WIDTH = 4096; /* elements of 4 bytes per row */

static size_t round_up(size_t v, size_t align) { return (v + align - 1) / align * align; }

static void setup_path(void) {
    switch (path) {
    case ASYNC:
        CHECK(cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
        break;
    case POOL: {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = device;
        CHECK(cu.cuMemPoolCreate(&pool, &props));
        CHECK(cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
        break;
    }
    case VMM: {
        size_t total = 0;
        memset(&vmm_prop, 0, sizeof vmm_prop);
        vmm_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        vmm_prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        vmm_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        vmm_prop.location.id = device;
        CHECK(cu.cuMemGetAllocationGranularity(&vmm_granularity, &vmm_prop,
                                               CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        if (vmm_granularity == 0) die(EXIT_MISMATCH, "cuMemGetAllocationGranularity returned 0");
        CHECK(cu.cuDeviceTotalMem(&total, device));
        vmm_reserved = round_up(total, vmm_granularity);
        CHECK(cu.cuMemAddressReserve(&vmm_base, vmm_reserved, 0, 0, 0));
        break;
    }
    default:
        break;
    }
}

/* The device memory one chunk of this path will hold. */
static size_t chunk_size(size_t chunk) {
    switch (path) {
    case ARRAY: {
        size_t h = chunk / (ARRAY_WIDTH * 4);
        return ARRAY_WIDTH * (h ? h : 1) * 4;
    }
    case ARRAY3D: {
        size_t h = chunk / (ARRAY_WIDTH * 4 * 4);
        return ARRAY_WIDTH * (h ? h : 1) * 4 * 4;
    }
    case VMM:
        return round_up(chunk, vmm_granularity);
    default:
        return chunk;
    }
}

/* Allocates one chunk; 0 when the device is out of memory. */
static int allocate_one(size_t chunk, struct block *b) {
    memset(b, 0, sizeof *b);
    switch (path) {
    case ALLOC:
        b->bytes = chunk;
        return ALLOCATED(cu.cuMemAlloc(&b->ptr, chunk));
    case PITCH: {
        size_t width = chunk / 64 / 4 * 4, pitch = 0;
        if (width == 0) width = 4;
        if (!ALLOCATED(cu.cuMemAllocPitch(&b->ptr, &pitch, width, 64, 4))) return 0;
        if (pitch < width) die(EXIT_MISMATCH, "cuMemAllocPitch returned pitch %zu below width %zu", pitch, width);
        b->bytes = pitch * 64;
        return 1;
    }
    case MANAGED:
        b->bytes = chunk;
        return ALLOCATED(cu.cuMemAllocManaged(&b->ptr, chunk, CU_MEM_ATTACH_GLOBAL));
    case ASYNC:
        b->bytes = chunk;
        if (!ALLOCATED(cu.cuMemAllocAsync(&b->ptr, chunk, stream))) return 0;
        CHECK(cu.cuStreamSynchronize(stream));
        return 1;
    case POOL:
        b->bytes = chunk;
        if (!ALLOCATED(cu.cuMemAllocFromPoolAsync(&b->ptr, chunk, pool, stream))) return 0;
        CHECK(cu.cuStreamSynchronize(stream));
        return 1;
    case ARRAY: {
        CUDA_ARRAY_DESCRIPTOR d;
        memset(&d, 0, sizeof d);
        d.Width = ARRAY_WIDTH;
        d.Height = chunk_size(chunk) / (ARRAY_WIDTH * 4);
        d.Format = CU_AD_FORMAT_UNSIGNED_INT32;
        d.NumChannels = 1;
        b->bytes = chunk_size(chunk);
        return ALLOCATED(cu.cuArrayCreate(&b->array, &d));
    }
    case ARRAY3D: {
        CUDA_ARRAY3D_DESCRIPTOR d;
        memset(&d, 0, sizeof d);
        d.Width = ARRAY_WIDTH;
        d.Height = chunk_size(chunk) / (ARRAY_WIDTH * 4 * 4);
        d.Depth = 4;
        d.Format = CU_AD_FORMAT_UNSIGNED_INT32;
        d.NumChannels = 1;
        d.Flags = 0;
        b->bytes = chunk_size(chunk);
        return ALLOCATED(cu.cuArray3DCreate(&b->array, &d));
    }
    case VMM: {
        size_t size = chunk_size(chunk);
        CUmemAccessDesc access;
        if (vmm_next + size > vmm_reserved) {
            /* The reservation spans the whole device: the driver let us create more
             * physical memory than the device has. */
            die(EXIT_MISMATCH, "cuMemCreate kept succeeding past the device's total memory (%zu bytes)", vmm_reserved);
        }
        if (!ALLOCATED(cu.cuMemCreate(&b->handle, size, &vmm_prop, 0))) return 0;
        b->ptr = vmm_base + vmm_next;
        b->bytes = size;
        CHECK(cu.cuMemMap(b->ptr, size, 0, b->handle, 0));
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CHECK(cu.cuMemSetAccess(b->ptr, size, &access, 1));
        vmm_next += size;
        return 1;
    }
    }
    return 0;
}

static void free_one(const struct block *b) {
    switch (path) {
    case ALLOC:
    case PITCH:
    case MANAGED:
        CHECK(cu.cuMemFree(b->ptr));
        break;
    case ASYNC:
    case POOL:
        CHECK(cu.cuMemFreeAsync(b->ptr, stream));
        break;
    case ARRAY:
    case ARRAY3D:
        CHECK(cu.cuArrayDestroy(b->array));
        break;
    case VMM:
        CHECK(cu.cuMemUnmap(b->ptr, b->bytes));
        CHECK(cu.cuMemRelease(b->handle));
        break;
    }
}

static void teardown_path(void) {
    switch (path) {
    case ASYNC:
        CHECK(cu.cuStreamSynchronize(stream));
        CHECK(cu.cuStreamDestroy(stream));
        break;
    case POOL:
        CHECK(cu.cuStreamSynchronize(stream));
        CHECK(cu.cuMemPoolDestroy(pool));
        CHECK(cu.cuStreamDestroy(stream));
        break;
    case VMM:
        CHECK(cu.cuMemAddressFree(vmm_base, vmm_reserved));
        break;
    default:
        break;
    }
}

/* Writes the first allocation and reads it back through the driver. */
static void check_data(const struct block *b) {
    enum { LEN = 4096 };
    static unsigned char pattern[LEN], back[LEN];
    size_t len = b->bytes < LEN ? b->bytes : LEN;
    unsigned char last = 0;

    CHECK(cu.cuMemsetD8(b->ptr, 0x5a, b->bytes));
    CHECK(cu.cuMemcpyDtoH(back, b->ptr, len));
    CHECK(cu.cuMemcpyDtoH(&last, b->ptr + b->bytes - 1, 1));
    for (size_t i = 0; i < len; i++)
        if (back[i] != 0x5a) die(EXIT_MISMATCH, "cuMemsetD8 then cuMemcpyDtoH: byte %zu is 0x%02x, not 0x5a", i, back[i]);
    if (last != 0x5a) die(EXIT_MISMATCH, "cuMemsetD8 did not reach the last byte (0x%02x)", last);

    for (size_t i = 0; i < len; i++) pattern[i] = (unsigned char)(i * 7 + 1);
    CHECK(cu.cuMemcpyHtoD(b->ptr, pattern, len));
    memset(back, 0, sizeof back);
    CHECK(cu.cuMemcpyDtoH(back, b->ptr, len));
    if (memcmp(pattern, back, len) != 0)
        die(EXIT_MISMATCH, "cuMemcpyHtoD then cuMemcpyDtoH: data differs");

    if (path == MANAGED) {
        /* Managed memory is also the host's to read once the device is idle. */
        CHECK(cu.cuCtxSynchronize());
        const volatile unsigned char *host = (const volatile unsigned char *)(uintptr_t)b->ptr;
        if (host[0] != pattern[0] || host[len - 1] != pattern[len - 1])
            die(EXIT_MISMATCH, "managed memory read on the host: data differs");
    }
}

static int parse_size(const char *text, size_t *out) {
    char *end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    if (!end || *end != '\0' || end == text) return 0;
    *out = (size_t)v;
    return 1;
}

int main(int argc, char **argv) {
    size_t chunk = 0, limit = 0;
    int found = 0;

    if (argc < 3 || argc > 4 || !parse_size(argv[2], &chunk) || chunk == 0 ||
        (argc == 4 && !parse_size(argv[3], &limit))) {
        fprintf(stderr,
                "usage: %s alloc|pitch|managed|async|pool|array|array3d|vmm <chunk_bytes> "
                "[limit_bytes]\n",
                argv[0]);
        return EXIT_USAGE;
    }
    for (size_t i = 0; i < sizeof PATH_NAMES / sizeof PATH_NAMES[0]; i++) {
        if (strcmp(argv[1], PATH_NAMES[i]) == 0) {
            path = (enum path)i;
            found = 1;
        }
    }
    if (!found) die(EXIT_USAGE, "unknown path %s", argv[1]);

    load_driver();

    CUcontext ctx = NULL;
    CHECK(cu.cuInit(0));
    CHECK(cu.cuDeviceGet(&device, 0));
    CUresult r = cu.cuDevicePrimaryCtxRetain(&ctx, device);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        printf("CTX_OOM\n");
        fflush(stdout);
        return EXIT_CTX_OOM;
    }
    check(r, "cuDevicePrimaryCtxRetain(&ctx, device)");
    CHECK(cu.cuCtxSetCurrent(ctx));

    size_t free_at_start = 0, total = 0;
    CHECK(cu.cuMemGetInfo(&free_at_start, &total));

    setup_path();

    struct block *blocks = NULL;
    size_t count = 0, capacity = 0, held = 0;
    for (;;) {
        if (limit && held + chunk_size(chunk) > limit) break;
        if (count == capacity) {
            capacity = capacity ? capacity * 2 : 64;
            blocks = realloc(blocks, capacity * sizeof *blocks);
            if (!blocks) die(EXIT_USAGE, "out of host memory");
        }
        if (!allocate_one(chunk, &blocks[count])) break;
        held += blocks[count].bytes;
        count++;
    }

    if (count > 0 && path != ARRAY && path != ARRAY3D) check_data(&blocks[0]);

    size_t free_held = 0;
    CHECK(cu.cuMemGetInfo(&free_held, &total));
    printf("READY %zu %zu %zu\n", held, free_held, total);
    fflush(stdout);

    char sink[256];
    while (fread(sink, 1, sizeof sink, stdin) > 0) {
    }

    for (size_t i = 0; i < count; i++) free_one(&blocks[i]);
    teardown_path();
    free(blocks);
    CHECK(cu.cuCtxSynchronize());

    size_t free_at_end = 0;
    CHECK(cu.cuMemGetInfo(&free_at_end, &total));
    if (free_at_end != free_at_start) {
        die(EXIT_MISMATCH,
            "memory not given back: %zu bytes free after context creation, %zu after freeing",
            free_at_start, free_at_end);
    }
    CHECK(cu.cuDevicePrimaryCtxRelease(device));
    printf("DONE\n");
    fflush(stdout);
    return 0;
}
