/*
 * shim_bench.c: the measured child of target/release/shim_bench. Times cuMemAlloc +
 * cuMemFree pairs at each size it is given, and cuLaunchKernel of simgpu's no-op kernel,
 * reaching the driver one way, chosen by exactly one define:
 *   -DMODE_LINKED    calls the exported symbols directly (linked with -lcuda);
 *   -DMODE_DLSYM     dlopen("libcuda.so.1") and dlsym of each exported symbol;
 *   -DMODE_PROCADDR  dlsym of cuGetProcAddress_v2 only, which resolves every function by
 *                    its base name for CUDA 12080, as libcudart does: the timed ones
 *                    with the flags given on the command line (1: the legacy default
 *                    stream, 2: the per-thread default stream), the others with 1.
 *
 * Under the shim it then measures the shim's own cost again inside this one process,
 * where the address space is the same for both sides: chunks of pairs (and of launches)
 * through the entry point the program uses and through the driver's own function,
 * found with glibc's dlsym (the shim answers the program's), alternate, and the median
 * of the chunks' CPU-time differences is printed as "inpair <size> <ns>" and
 * "inlaunch <ns>". Bare, the two are the same function and nothing more is printed.
 *
 * Usage: shim_bench <flags> <pairs> <launches> <size>...
 * Prints, per size, "pair <size> <mean ns> <quickest twentieth ns> <CPU ns>", then
 * "launch <mean ns> <CPU ns>" (launches in chunks of 4096, rounded down, at least one, each
 * queued behind 5 ms of device work):
 * wall-clock time per call, and the calling thread's CPU time per call in the median
 * chunk (CLOCK_THREAD_CPUTIME_ID, user and system), which other processes on a busy
 * machine move much less: it does not count the time the thread waited for a CPU.
 * Exit status 1 if a driver call fails (named on stderr), 2 on a usage or loading error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_min.h"

#if defined(MODE_LINKED) + defined(MODE_DLSYM) + defined(MODE_PROCADDR) != 1
#error "define exactly one of MODE_LINKED, MODE_DLSYM, MODE_PROCADDR"
#endif

static struct {
    PFN_cuInit init;
    PFN_cuDevicePrimaryCtxRetain retain;
    PFN_cuCtxSetCurrent set_current;
    PFN_cuModuleLoadData load;
    PFN_cuModuleGetFunction function;
    PFN_cuStreamCreate stream_create;
    PFN_cuStreamSynchronize synchronize;
    PFN_cuMemAlloc alloc;
    PFN_cuMemFree free;
    PFN_cuLaunchKernel launch;
} cu;

static void fail(int status, const char *what, long value) {
    fprintf(stderr, "shim_bench worker: %s (%ld)\n", what, value);
    exit(status);
}

#define CHECK(call)                                                                               \
    do {                                                                                          \
        CUresult r_ = (call);                                                                     \
        if (r_ != CUDA_SUCCESS) fail(1, #call " failed", (long)r_);                               \
    } while (0)

#if defined(MODE_PROCADDR)
static void *resolve(PFN_cuGetProcAddress_v2 get, const char *base, cuuint64_t flags) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get(base, &fn, CUDA_VERSION, flags, &status);
    if (r != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || !fn) fail(2, base, (long)r);
    return fn;
}
#endif

static void load_driver(cuuint64_t flags) {
#if defined(MODE_LINKED)
    (void)flags;
    cu.init = cuInit;
    cu.retain = cuDevicePrimaryCtxRetain;
    cu.set_current = cuCtxSetCurrent;
    cu.load = cuModuleLoadData;
    cu.function = cuModuleGetFunction;
    cu.stream_create = cuStreamCreate;
    cu.synchronize = cuStreamSynchronize;
    cu.alloc = cuMemAlloc_v2;
    cu.free = cuMemFree_v2;
    cu.launch = cuLaunchKernel;
#else
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) fail(2, dlerror(), 0);
#if defined(MODE_DLSYM)
    (void)flags;
#define LOAD(field, symbol)                                                                       \
    if (!(cu.field = (void *)dlsym(lib, #symbol))) fail(2, "dlsym(" #symbol ")", 0);
#else
    PFN_cuGetProcAddress_v2 get = (PFN_cuGetProcAddress_v2)dlsym(lib, "cuGetProcAddress_v2");
    if (!get) fail(2, "dlsym(cuGetProcAddress_v2)", 0);
    cuuint64_t legacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
#define LOAD(field, base, how) cu.field = resolve(get, #base, how);
#endif
#if defined(MODE_DLSYM)
    LOAD(init, cuInit)
    LOAD(retain, cuDevicePrimaryCtxRetain)
    LOAD(set_current, cuCtxSetCurrent)
    LOAD(load, cuModuleLoadData)
    LOAD(function, cuModuleGetFunction)
    LOAD(stream_create, cuStreamCreate)
    LOAD(synchronize, cuStreamSynchronize)
    LOAD(alloc, cuMemAlloc_v2)
    LOAD(free, cuMemFree_v2)
    LOAD(launch, cuLaunchKernel)
#else
    LOAD(init, cuInit, legacy)
    LOAD(retain, cuDevicePrimaryCtxRetain, legacy)
    LOAD(set_current, cuCtxSetCurrent, legacy)
    LOAD(load, cuModuleLoadData, legacy)
    LOAD(function, cuModuleGetFunction, legacy)
    LOAD(stream_create, cuStreamCreate, legacy)
    LOAD(synchronize, cuStreamSynchronize, legacy)
    LOAD(alloc, cuMemAlloc, flags)
    LOAD(free, cuMemFree, flags)
    LOAD(launch, cuLaunchKernel, flags)
#endif
#undef LOAD
#endif
}

static double cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* The driver's own functions, whichever way the program reached them. */
static struct {
    PFN_cuMemAlloc alloc;
    PFN_cuMemFree free;
    PFN_cuLaunchKernel launch;
} own;

typedef void *(*dlsym_fn)(void *, const char *);

/* Finds the driver's own functions with glibc's dlsym (not the one the shim exports);
 * 0 if they cannot be found. */
static int load_own(cuuint64_t flags) {
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!libc || !lib) return 0;
    dlsym_fn glibc = (dlsym_fn)dlvsym(libc, "dlsym", "GLIBC_2.34");
    if (!glibc) glibc = (dlsym_fn)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    if (!glibc) return 0;
    own.alloc = (PFN_cuMemAlloc)glibc(lib, "cuMemAlloc_v2");
    own.free = (PFN_cuMemFree)glibc(lib, "cuMemFree_v2");
    /* cuGetProcAddress for the per-thread default stream answers the _ptsz launch. */
    own.launch = (PFN_cuLaunchKernel)glibc(lib, flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                     ? "cuLaunchKernel_ptsz"
                                                     : "cuLaunchKernel");
    return own.alloc && own.free && own.launch;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values (sorted in place). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, by_value);
    return v[n / 2];
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

enum { CHUNKS = 20 };

/* n alloc+free pairs of `size` bytes in CHUNKS chunks: mean ns per pair, the quickest
 * chunk's, and the CPU time per pair of the median chunk (a chunk that other work on the
 * machine slowed, with interrupts or caches emptied, moves the median little and the
 * mean a lot). */
static void pairs(size_t size, long n) {
    CUdeviceptr ptr = 0;
    for (long i = 0; i < n / 20 + 1; i++) { /* warm up */
        CHECK(cu.alloc(&ptr, size));
        CHECK(cu.free(ptr));
    }
    long per_chunk = n / CHUNKS > 0 ? n / CHUNKS : 1;
    double quickest = 1e300, start = now_ns(), cpu[CHUNKS];
    for (long c = 0; c < CHUNKS; c++) {
        double t = now_ns(), u = cpu_ns();
        for (long i = 0; i < per_chunk; i++) {
            CHECK(cu.alloc(&ptr, size));
            CHECK(cu.free(ptr));
        }
        cpu[c] = (cpu_ns() - u) / (double)per_chunk;
        double each = (now_ns() - t) / (double)per_chunk;
        if (each < quickest) quickest = each;
    }
    double mean = (now_ns() - start) / (double)(per_chunk * CHUNKS);
    printf("pair %zu %.1f %.1f %.1f\n", size, mean, quickest, median(cpu, CHUNKS));
}

enum { ROUNDS_IN_PROCESS = 60 };

/* CPU ns a pair of `size` through the program's entry points takes more than through the
 * driver's own, chunks alternating. */
static double pairs_in_process(size_t size) {
    const long chunk = 500;
    double added[ROUNDS_IN_PROCESS];
    CUdeviceptr ptr = 0;
    for (int r = 0; r < ROUNDS_IN_PROCESS; r++) {
        double t = cpu_ns();
        for (long i = 0; i < chunk; i++) {
            CHECK(cu.alloc(&ptr, size));
            CHECK(cu.free(ptr));
        }
        double hooked = cpu_ns() - t;
        t = cpu_ns();
        for (long i = 0; i < chunk; i++) {
            CHECK(own.alloc(&ptr, size));
            CHECK(own.free(ptr));
        }
        added[r] = (hooked - (cpu_ns() - t)) / (double)chunk;
    }
    return median(added, ROUNDS_IN_PROCESS);
}

/* simgpu's "sleep" kernel, which keeps the stream's worker busy. */
static CUfunction sleeper;

/* Queues 5 ms of device work ahead of a chunk of launches, so that its launches queue
 * behind a busy device, as an inference server's do. Launched to an idle simgpu stream,
 * each launch may instead find the stream's worker thread waiting for work and wake it (a
 * system call), and how many do depends on how soon that thread runs on the other CPU,
 * which moves the time of a launch by hundreds of nanoseconds between runs. */
static void occupy(CUstream stream) {
    unsigned long long us = 5000;
    void *params[1] = {&us};
    CHECK(cu.launch(sleeper, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL));
}

/* The same for launches (each chunk queued behind `occupy`, the queue drained after each
 * chunk, untimed). */
static double launches_in_process(CUfunction f, CUstream stream) {
    const long chunk = 4096;
    double added[ROUNDS_IN_PROCESS];
    void *params[1] = {NULL};
    for (int r = 0; r < ROUNDS_IN_PROCESS; r++) {
        occupy(stream);
        double t = cpu_ns();
        for (long i = 0; i < chunk; i++) CHECK(cu.launch(f, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL));
        double hooked = cpu_ns() - t;
        CHECK(cu.synchronize(stream));
        occupy(stream);
        t = cpu_ns();
        for (long i = 0; i < chunk; i++) CHECK(own.launch(f, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL));
        double bare = cpu_ns() - t;
        CHECK(cu.synchronize(stream));
        added[r] = (hooked - bare) / (double)chunk;
    }
    return median(added, ROUNDS_IN_PROCESS);
}

int main(int argc, char **argv) {
    if (argc < 5) fail(2, "usage: shim_bench <flags> <pairs> <launches> <size>...", argc);
    load_driver(strtoull(argv[1], NULL, 0));
    long n = strtol(argv[2], NULL, 0), launches = strtol(argv[3], NULL, 0);

    CUcontext ctx = NULL;
    CHECK(cu.init(0));
    CHECK(cu.retain(&ctx, 0));
    CHECK(cu.set_current(ctx));
    CUmodule module = NULL;
    CUfunction noop = NULL;
    CUstream stream = NULL;
    CHECK(cu.load(&module, "bench"));
    CHECK(cu.function(&noop, module, "simgpu_noop"));
    CHECK(cu.function(&sleeper, module, "simgpu_sleep_us"));
    CHECK(cu.stream_create(&stream, 1));

    for (int i = 4; i < argc; i++) pairs(strtoull(argv[i], NULL, 0), n);

    void *params[1] = {NULL};
    for (long i = 0; i < 4096; i++) /* warm up */
        CHECK(cu.launch(noop, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL));
    CHECK(cu.synchronize(stream));
    /* Chunks of 4096, each queued behind `occupy` and the queue drained after each (so
     * that memory use does not distort the timing): the mean wall-clock time and the
     * median chunk's CPU time, of the launches only (a drain's CPU time is how long it
     * spun while simgpu's worker thread waited for a CPU, which other processes decide). */
    enum { LAUNCH_CHUNK = 4096, MOST_LAUNCH_CHUNKS = 1024 };
    static double launch_cpu[MOST_LAUNCH_CHUNKS];
    long launch_chunks = launches / LAUNCH_CHUNK;
    if (launch_chunks < 1) launch_chunks = 1;
    if (launch_chunks > MOST_LAUNCH_CHUNKS) launch_chunks = MOST_LAUNCH_CHUNKS;
    double launching = 0;
    for (long c = 0; c < launch_chunks; c++) {
        occupy(stream);
        double start = now_ns(), u = cpu_ns();
        for (long i = 0; i < LAUNCH_CHUNK; i++) CHECK(cu.launch(noop, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL));
        launch_cpu[c] = (cpu_ns() - u) / (double)LAUNCH_CHUNK;
        launching += now_ns() - start;
        CHECK(cu.synchronize(stream));
    }
    double wall = launching / (double)(launch_chunks * LAUNCH_CHUNK);
    printf("launch %.1f %.1f\n", wall, median(launch_cpu, (int)launch_chunks));

    cuuint64_t flags = strtoull(argv[1], NULL, 0);
    if (!load_own(flags)) fail(2, "cannot find the driver's own functions", 0);
    /* Bare, the program calls the driver's own functions: nothing to compare. */
    if ((void *)own.alloc != (void *)cu.alloc) {
        for (int i = 4; i < argc; i++) {
            size_t size = strtoull(argv[i], NULL, 0);
            printf("inpair %zu %.1f\n", size, pairs_in_process(size));
        }
        printf("inlaunch %.1f\n", launches_in_process(noop, stream));
    }
    return 0;
}
