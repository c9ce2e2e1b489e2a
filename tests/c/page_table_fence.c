/*
 * page_table_fence.c: after the program's first context (under the shim, that is when the
 * shim loads NVML to measure it), maps a block of anonymous memory (1 MiB, a caching
 * allocator's usual block, unless the first argument gives another size in bytes), as a
 * driver does for host memory and simgpu for every allocation, and says whether its 2 MiB
 * page-table region is shared with another accessible mapping: there, each munmap walks a
 * page-table page instead of skipping an empty range.
 *
 * Built with -DMODE_LINKED (linked with -lcuda) or -DMODE_DLSYM (dlopen of libcuda.so.1
 * and dlsym of each function, so that under the shim its core is loaded at that dlsym,
 * after libcuda). Prints
 *   CLEAR                   no other mapping with any access in that 2 MiB
 *   SHARED <maps line>      the first accessible mapping found there
 * Exit status 0 when it printed either, 1 if a driver call failed, 2 on any other error.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_min.h"

#if defined(MODE_LINKED) + defined(MODE_DLSYM) != 1
#error "define exactly one of MODE_LINKED, MODE_DLSYM"
#endif

#define CHECK(call)                                                                               \
    do {                                                                                          \
        CUresult r_ = (call);                                                                     \
        if (r_ != CUDA_SUCCESS) {                                                                 \
            fprintf(stderr, "page_table_fence: %s failed (%d)\n", #call, (int)r_);              \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)

int main(int argc, char **argv) {
#if defined(MODE_LINKED)
    PFN_cuInit init = cuInit;
    PFN_cuDevicePrimaryCtxRetain retain = cuDevicePrimaryCtxRetain;
    PFN_cuCtxSetCurrent set_current = cuCtxSetCurrent;
#else
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "page_table_fence: %s\n", dlerror());
        return 2;
    }
    PFN_cuInit init = (PFN_cuInit)dlsym(lib, "cuInit");
    PFN_cuDevicePrimaryCtxRetain retain = (PFN_cuDevicePrimaryCtxRetain)dlsym(lib, "cuDevicePrimaryCtxRetain");
    PFN_cuCtxSetCurrent set_current = (PFN_cuCtxSetCurrent)dlsym(lib, "cuCtxSetCurrent");
    if (!init || !retain || !set_current) {
        fprintf(stderr, "page_table_fence: dlsym failed\n");
        return 2;
    }
#endif
    CUcontext ctx = NULL;
    CHECK(init(0));
    CHECK(retain(&ctx, 0));
    CHECK(set_current(ctx));

    const size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : 1 << 20, pmd = 2 << 20;
    if (size == 0) {
        fprintf(stderr, "page_table_fence: a block of 0 bytes\n");
        return 2;
    }
    char *block = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) {
        perror("page_table_fence: mmap");
        return 2;
    }
    unsigned long start = (unsigned long)block, end = start + size;
    /* The 2 MiB region holding the block's last page: where the mapping above it starts. */
    unsigned long region = (end - 1) & ~(pmd - 1), region_end = region + pmd;

    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps) {
        perror("page_table_fence: /proc/self/maps");
        return 2;
    }
    char line[512];
    while (fgets(line, sizeof line, maps)) {
        unsigned long from, to;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &from, &to, perms) != 3) continue;
        if (from == start && to == end) continue; /* the block itself */
        /* Merged into a neighbour (same flags): that neighbour shares the region. */
        int merged = from <= start && to >= end;
        int accessible = strncmp(perms, "---", 3) != 0;
        if (merged) {
            printf("SHARED %s", line);
            fclose(maps);
            return 0;
        }
        if (accessible && from < region_end && to > region) {
            printf("SHARED %s", line);
            fclose(maps);
            return 0;
        }
    }
    fclose(maps);
    printf("CLEAR\n");
    return 0;
}
