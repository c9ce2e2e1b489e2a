/*
 * query.c: asks the shim about this process's slice through include/gpufrac.h, looking
 * the functions up with dlsym(RTLD_DEFAULT) so that it also runs without the shim.
 *
 * It creates a context and allocates 64 MiB, then prints:
 *   NO_SHIM                                  if the shim is not loaded, or
 *   VERSION <v>
 *   ENABLED <0|1> COUNT <devices>
 *   INFO <rc> <request> <limit> <held> <held_by_process> <total>
 *   GETTERS <request> <limit> <held>
 *   UNKNOWN <rc for device 99>
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../include/gpufrac.h"
#include "cuda_min.h"

#define LOOKUP(type, name) ((type)dlsym(RTLD_DEFAULT, name))

int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) {
        fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned int) = dlsym(cuda, "cuInit");
    CUresult (*get)(CUdevice *, int) = dlsym(cuda, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr ptr;
    if (init(0) || get(&dev, 0) || retain(&ctx, dev) || set(ctx) || alloc(&ptr, 64u << 20)) {
        fprintf(stderr, "CUDA setup failed\n");
        return 1;
    }

    gpufrac_device_info_fn info = LOOKUP(gpufrac_device_info_fn, "gpufrac_device_info");
    if (!info) {
        printf("NO_SHIM\n");
        return 0;
    }
    printf("VERSION %u\n", LOOKUP(gpufrac_version_fn, "gpufrac_version")());
    printf("ENABLED %d COUNT %d\n", LOOKUP(gpufrac_enabled_fn, "gpufrac_enabled")(),
           LOOKUP(gpufrac_device_count_fn, "gpufrac_device_count")());
    struct gpufrac_device_info i;
    int rc = info(0, &i);
    printf("INFO %d %llu %llu %llu %llu %llu\n", rc, (unsigned long long)i.request, (unsigned long long)i.limit,
           (unsigned long long)i.held, (unsigned long long)i.held_by_process, (unsigned long long)i.total);
    printf("GETTERS %llu %llu %llu\n", (unsigned long long)LOOKUP(gpufrac_value_fn, "gpufrac_request")(0),
           (unsigned long long)LOOKUP(gpufrac_value_fn, "gpufrac_limit")(0),
           (unsigned long long)LOOKUP(gpufrac_value_fn, "gpufrac_held")(0));
    printf("UNKNOWN %d\n", info(99, &i));
    return 0;
}
