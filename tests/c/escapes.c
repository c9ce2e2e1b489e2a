/*
 * escapes.c: tries, as a hostile or merely unusual program would, to hold more device
 * memory than its limit allows, then holds what it got until stdin closes, so that the
 * test can read what the device itself reports the process holding.
 *
 * Every driver function is found with dlopen("libcuda.so.1") and dlsym (so a preloaded
 * shim answers with its hooks, as it does for any program that loads the driver itself).
 *
 * Usage: escapes <case> <chunk_bytes> [arg]
 *   refused          ignores cuInit's failure, then allocates with cuMemAlloc_v2
 *   contexts N       creates N contexts of its own (cuCtxCreate_v2), allocates in the last
 *   heap BYTES       asks for a device heap of BYTES (cuCtxSetLimit), then allocates
 *   modules N        loads N modules (cuModuleLoadData), then allocates
 *   v1               allocates through the pre-3.2 cuMemAlloc (32-bit addresses), by dlsym
 *   v1procaddr       the same, resolved by cuGetProcAddress for CUDA 2.0
 *   v1ctx            creates a context with the unversioned cuCtxCreate, then allocates
 *   stack BYTES      asks for a per-thread stack of BYTES (cuCtxSetLimit), then allocates
 *   arrays FORMAT    creates 4096x4096 arrays of CUarray_format FORMAT (cuArrayCreate_v2,
 *                    one channel) until one fails; HELD counts them, times <chunk_bytes>
 *   export           rounds of cuMemCreate (exportable to a file descriptor),
 *                    cuMemExportToShareableHandle (the descriptor kept open) and
 *                    cuMemRelease, until one fails
 *   teardown BYTES   allocates BYTES in the primary context, creates a context of its own
 *                    (cuCtxCreate_v2), allocates BYTES there, destroys that context
 *                    (cuCtxDestroy_v2, which frees what was allocated in it), and allocates
 *                    in the primary context again
 *   race N           N rounds of: two threads retain the primary context at once, and
 *                    it is released twice (destroyed); then allocates
 *   bypass BYTES     allocates through the shim, then BYTES through a private copy of the
 *                    driver (dlmopen of $ESCAPES_PRIVATE_DRIVER, symbols found with glibc's
 *                    own dlsym) that no hook sees, asks the shim for 1 TiB (refused), then
 *                    allocates through the shim again
 *
 * Each allocation is one chunk, until one fails. Prints, each line flushed:
 *   <step> <CUresult>             for each setup step (init, retain, current, heap...)
 *   HELD <bytes> <CUresult>       what the allocations got, and the error that ended them
 * then reads stdin to its end and exits 0 (2: usage or loading error).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUmodule;
typedef unsigned long long CUdeviceptr;

static void *lib;

static void *sym(const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "escapes: no %s in the driver\n", name);
        exit(2);
    }
    return p;
}

static void step(const char *name, CUresult r) {
    printf("%s %d\n", name, r);
    fflush(stdout);
}

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);

/* Allocates chunks with `alloc` until one fails; prints what it held. */
static void fill(CUresult (*alloc)(CUdeviceptr *, size_t), size_t chunk) {
    unsigned long long held = 0;
    CUresult r = 0;
    for (int i = 0; i < 100000; i++) {
        CUdeviceptr p = 0;
        r = alloc(&p, chunk);
        if (r != 0) break;
        held += chunk;
    }
    printf("HELD %llu %d\n", held, r);
    fflush(stdout);
}

static CUresult (*cuMemAlloc_v1)(unsigned *, unsigned);
static CUresult alloc_v1(CUdeviceptr *out, size_t bytes) {
    unsigned p = 0;
    CUresult r = cuMemAlloc_v1(&p, (unsigned)bytes);
    *out = p;
    return r;
}

static pthread_barrier_t together;

static void *retain_together(void *unused) {
    (void)unused;
    CUcontext ctx = NULL;
    pthread_barrier_wait(&together);
    CUresult r = cuDevicePrimaryCtxRetain(&ctx, 0);
    return (void *)(intptr_t)(r == 0 ? 0 : 1);
}

static void primary(void) {
    CUcontext ctx = NULL;
    step("retain", cuDevicePrimaryCtxRetain(&ctx, 0));
    step("current", cuCtxSetCurrent(ctx));
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: escapes <case> <chunk_bytes> [arg]\n");
        return 2;
    }
    const char *which = argv[1];
    size_t chunk = strtoull(argv[2], NULL, 10);
    long long arg = argc > 3 ? strtoll(argv[3], NULL, 10) : 0;
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "escapes: %s\n", dlerror());
        return 2;
    }
    cuInit = sym("cuInit");
    cuDevicePrimaryCtxRetain = sym("cuDevicePrimaryCtxRetain");
    cuCtxSetCurrent = sym("cuCtxSetCurrent");
    cuMemAlloc_v2 = sym("cuMemAlloc_v2");
    step("init", cuInit(0));

    if (!strcmp(which, "refused")) {
        primary();
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "contexts")) {
        CUresult (*create)(CUcontext *, unsigned, int) = sym("cuCtxCreate_v2");
        CUcontext last = NULL;
        long long made = 0;
        CUresult r = 0;
        for (long long i = 0; i < arg; i++) {
            CUcontext c = NULL;
            r = create(&c, 0, 0);
            if (r != 0) break;
            last = c;
            made++;
        }
        printf("CONTEXTS %lld %d\n", made, r);
        fflush(stdout);
        if (last) step("current", cuCtxSetCurrent(last));
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "heap")) {
        CUresult (*set_limit)(int, size_t) = sym("cuCtxSetLimit");
        primary();
        step("heap", set_limit(2 /* CU_LIMIT_MALLOC_HEAP_SIZE */, (size_t)arg));
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "stack")) {
        CUresult (*set_limit)(int, size_t) = sym("cuCtxSetLimit");
        primary();
        step("stack", set_limit(0 /* CU_LIMIT_STACK_SIZE */, (size_t)arg));
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "arrays")) {
        struct {
            size_t width, height;
            unsigned format, channels;
        } desc = {4096, 4096, (unsigned)arg, 1};
        CUresult (*create)(void **, const void *) = sym("cuArrayCreate_v2");
        primary();
        unsigned long long made = 0;
        CUresult r = 0;
        for (int i = 0; i < 10000; i++) {
            void *array = NULL;
            r = create(&array, &desc);
            if (r != 0) break;
            made++;
        }
        printf("HELD %llu %d\n", made * chunk, r);
        fflush(stdout);
    } else if (!strcmp(which, "export")) {
        struct {
            unsigned type, handle_types, location_type;
            int location_id;
            void *win32;
            unsigned char compression, rdma;
            unsigned short usage;
            unsigned char reserved[4];
        } prop = {1 /* PINNED */, 1 /* POSIX_FILE_DESCRIPTOR */, 1 /* DEVICE */, 0, NULL, 0, 0, 0, {0}};
        CUresult (*create)(unsigned long long *, size_t, const void *, unsigned long long) = sym("cuMemCreate");
        CUresult (*export_fd)(void *, unsigned long long, int, unsigned long long) =
            sym("cuMemExportToShareableHandle");
        CUresult (*release)(unsigned long long) = sym("cuMemRelease");
        primary();
        unsigned long long held = 0;
        CUresult r = 0;
        for (int i = 0; i < 10000; i++) {
            unsigned long long h = 0;
            int fd = -1;
            r = create(&h, chunk, &prop, 0);
            if (r != 0) break;
            r = export_fd(&fd, h, 1, 0);
            if (r != 0) break;
            r = release(h);
            if (r != 0) break;
            held += chunk;
        }
        printf("HELD %llu %d\n", held, r);
        fflush(stdout);
    } else if (!strcmp(which, "modules")) {
        CUresult (*load)(CUmodule *, const void *) = sym("cuModuleLoadData");
        static const char image[] = "simgpu module";
        primary();
        long long loaded = 0;
        CUresult r = 0;
        for (long long i = 0; i < arg; i++) {
            CUmodule m = NULL;
            r = load(&m, image);
            if (r != 0) break;
            loaded++;
        }
        printf("MODULES %lld %d\n", loaded, r);
        fflush(stdout);
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "v1")) {
        cuMemAlloc_v1 = sym("cuMemAlloc");
        primary();
        fill(alloc_v1, chunk);
    } else if (!strcmp(which, "v1procaddr")) {
        CUresult (*get)(const char *, void **, int, unsigned long long, int *) = sym("cuGetProcAddress_v2");
        void *fn = NULL;
        int found = -1;
        step("procaddr", get("cuMemAlloc", &fn, 2000, 0, &found));
        if (!fn) return 2;
        cuMemAlloc_v1 = fn;
        primary();
        fill(alloc_v1, chunk);
    } else if (!strcmp(which, "v1ctx")) {
        CUresult (*create)(CUcontext *, unsigned, int) = sym("cuCtxCreate");
        CUcontext c = NULL;
        step("context", create(&c, 0, 0));
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "teardown")) {
        CUresult (*create)(CUcontext *, unsigned, int) = sym("cuCtxCreate_v2");
        CUresult (*destroy)(CUcontext) = sym("cuCtxDestroy_v2");
        CUdeviceptr kept = 0, freed_with_context = 0;
        CUcontext own = NULL;
        primary();
        step("kept", cuMemAlloc_v2(&kept, (size_t)arg));
        step("context", create(&own, 0, 0));
        step("in-context", cuMemAlloc_v2(&freed_with_context, (size_t)arg));
        step("destroyed", destroy(own));
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "race")) {
        CUresult (*release)(int) = sym("cuDevicePrimaryCtxRelease_v2");
        intptr_t failed = 0;
        for (long long round = 0; round < arg; round++) {
            pthread_t threads[2];
            pthread_barrier_init(&together, NULL, 2);
            for (int i = 0; i < 2; i++) pthread_create(&threads[i], NULL, retain_together, NULL);
            for (int i = 0; i < 2; i++) {
                void *r = NULL;
                pthread_join(threads[i], &r);
                failed += (intptr_t)r;
            }
            pthread_barrier_destroy(&together);
            failed += release(0) != 0;
            failed += release(0) != 0;
        }
        step("race_failures", (CUresult)failed);
        primary();
        fill(cuMemAlloc_v2, chunk);
    } else if (!strcmp(which, "bypass")) {
        const char *path = getenv("ESCAPES_PRIVATE_DRIVER");
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        void *(*glibc_dlsym)(void *, const char *) = NULL;
        if (libc) glibc_dlsym = dlvsym(libc, "dlsym", "GLIBC_2.34");
        if (libc && !glibc_dlsym) glibc_dlsym = dlvsym(libc, "dlsym", "GLIBC_2.2.5");
        void *private = path ? dlmopen(LM_ID_NEWLM, path, RTLD_NOW | RTLD_LOCAL) : NULL;
        if (!glibc_dlsym || !private) {
            fprintf(stderr, "escapes: no private driver (%s): %s\n", path ? path : "unset", dlerror());
            return 2;
        }
        CUresult (*p_init)(unsigned) = glibc_dlsym(private, "cuInit");
        CUresult (*p_retain)(CUcontext *, int) = glibc_dlsym(private, "cuDevicePrimaryCtxRetain");
        CUresult (*p_current)(CUcontext) = glibc_dlsym(private, "cuCtxSetCurrent");
        CUresult (*p_alloc)(CUdeviceptr *, size_t) = glibc_dlsym(private, "cuMemAlloc_v2");
        if (!p_init || !p_retain || !p_current || !p_alloc) return 2;
        primary();
        CUdeviceptr first = 0;
        step("shimmed", cuMemAlloc_v2(&first, chunk));
        CUcontext pctx = NULL;
        step("private_init", p_init(0));
        step("private_retain", p_retain(&pctx, 0));
        step("private_current", p_current(pctx));
        CUdeviceptr hidden = 0;
        step("private_alloc", p_alloc(&hidden, (size_t)arg));
        /* One allocation past the limit: refused, and a refusal is when the shim looks. */
        CUdeviceptr huge = 0;
        step("past_limit", cuMemAlloc_v2(&huge, (size_t)1 << 40));
        fill(cuMemAlloc_v2, chunk);
    } else {
        fprintf(stderr, "escapes: unknown case %s\n", which);
        return 2;
    }
    char buf[64];
    while (fgets(buf, sizeof buf, stdin)) {
    }
    return 0;
}
