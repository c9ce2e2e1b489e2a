/*
 * private_driver.c: takes device memory by a path the shim does not see, for the arbiter's
 * backstop (the device's own count). It allocates on device 0 through the driver as any
 * program reaches it (dlopen("libcuda.so.1") and dlsym: under the shim, its hooks), then
 * loads a private copy of the driver into a new link-map namespace (dlmopen with
 * LM_ID_NEWLM) and allocates there too. The shim exports dlsym and answers hooked cu*
 * names with its hooks whatever the handle, so the private copy's symbols are looked up
 * with glibc's own dlsym (dlvsym of "dlsym" in libc itself). The private copy shares the
 * simulated device through SIMGPU_STATE: the device's figure for this process grows while
 * the shim's count does not.
 *
 * Usage: private_driver <driver_path> <shim_bytes> <private_bytes>
 *   driver_path:   the real file of the driver to load privately (libsimgpu_cuda.so)
 *   shim_bytes:    allocated through the shim first (one cuMemAlloc_v2)
 *   private_bytes: then allocated through the private copy (one cuMemAlloc_v2)
 *
 * Prints, each line flushed at once:
 *   SHIM <bytes>        after the allocation through the shim
 *   READY <bytes>       after the private allocation
 * then reads stdin until end of file, frees both and prints DONE.
 *
 * Exit status: 0 done; 1 a driver call failed (named on stderr); 2 usage or loading error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_min.h"

enum { EXIT_CUDA = 1, EXIT_USAGE = 2 };

typedef void *(*dlsym_fn)(void *handle, const char *symbol);

/* The entry points this program uses, from one copy of the driver. */
struct driver {
    PFN_cuInit init;
    PFN_cuDeviceGet device_get;
    PFN_cuDevicePrimaryCtxRetain retain;
    PFN_cuCtxSetCurrent set_current;
    PFN_cuMemAlloc alloc;
    PFN_cuMemFree free;
};

__attribute__((format(printf, 2, 3), noreturn)) static void die(int status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "private_driver: ");
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(status);
}

static void *need(dlsym_fn look_up, void *lib, const char *name) {
    void *f = look_up(lib, name);
    if (!f) die(EXIT_USAGE, "%s not found", name);
    return f;
}

static struct driver load(dlsym_fn look_up, void *lib) {
    struct driver d;
    d.init = (PFN_cuInit)need(look_up, lib, "cuInit");
    d.device_get = (PFN_cuDeviceGet)need(look_up, lib, "cuDeviceGet");
    d.retain = (PFN_cuDevicePrimaryCtxRetain)need(look_up, lib, "cuDevicePrimaryCtxRetain");
    d.set_current = (PFN_cuCtxSetCurrent)need(look_up, lib, "cuCtxSetCurrent");
    d.alloc = (PFN_cuMemAlloc)need(look_up, lib, "cuMemAlloc_v2");
    d.free = (PFN_cuMemFree)need(look_up, lib, "cuMemFree_v2");
    return d;
}

static void check(CUresult r, const char *what, const char *copy) {
    if (r != CUDA_SUCCESS) die(EXIT_CUDA, "%s through %s: error %d", what, copy, (int)r);
}

/* Makes device 0's primary context current in `d`'s driver and allocates `bytes` there. */
static CUdeviceptr take(const struct driver *d, size_t bytes, const char *copy) {
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr ptr = 0;
    check(d->init(0), "cuInit", copy);
    check(d->device_get(&dev, 0), "cuDeviceGet", copy);
    check(d->retain(&ctx, dev), "cuDevicePrimaryCtxRetain", copy);
    check(d->set_current(ctx), "cuCtxSetCurrent", copy);
    check(d->alloc(&ptr, bytes), "cuMemAlloc_v2", copy);
    return ptr;
}

int main(int argc, char **argv) {
    if (argc != 4) die(EXIT_USAGE, "usage: private_driver <driver_path> <shim_bytes> <private_bytes>");
    size_t shim_bytes = strtoull(argv[2], NULL, 0);
    size_t private_bytes = strtoull(argv[3], NULL, 0);

    /* glibc's own dlsym, asked of libc itself: the shim is preloaded, so RTLD_NEXT from
     * here would find its dlsym (exported under both versions) first. 2.34 moved dlsym
     * from libdl into libc; before that it is libdl's. */
    dlsym_fn real_dlsym = NULL;
    const char *homes[] = {"libc.so.6", "libdl.so.2"};
    const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5"};
    for (int h = 0; h < 2 && !real_dlsym; h++) {
        void *home = dlopen(homes[h], RTLD_NOW | RTLD_NOLOAD);
        for (int v = 0; home && v < 2 && !real_dlsym; v++)
            real_dlsym = (dlsym_fn)dlvsym(home, "dlsym", versions[v]);
    }
    if (!real_dlsym) die(EXIT_USAGE, "glibc's dlsym not found: %s", dlerror());

    /* The driver as every program reaches it: under the shim, its hooks answer. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) die(EXIT_USAGE, "dlopen(libcuda.so.1): %s", dlerror());
    struct driver hooked = load(dlsym, lib);
    CUdeviceptr counted = take(&hooked, shim_bytes, "the shim");
    printf("SHIM %zu\n", shim_bytes);
    fflush(stdout);

    /* A private copy in a namespace of its own: nothing of the shim's is there. */
    void *private_lib = dlmopen(LM_ID_NEWLM, argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!private_lib) die(EXIT_USAGE, "dlmopen(%s): %s", argv[1], dlerror());
    struct driver own = load(real_dlsym, private_lib);
    CUdeviceptr uncounted = take(&own, private_bytes, "the private copy");
    printf("READY %zu\n", private_bytes);
    fflush(stdout);

    while (getchar() != EOF) {
    }
    check(own.free(uncounted), "cuMemFree_v2", "the private copy");
    check(hooked.free(counted), "cuMemFree_v2", "the shim");
    printf("DONE\n");
    fflush(stdout);
    return 0;
}
