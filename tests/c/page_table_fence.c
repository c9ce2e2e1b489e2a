/*
 * page_table_fence.c: after the program's first context (under the shim, that is when the
 * shim loads NVML to measure it), maps 1 MiB of anonymous memory (a caching allocator's
 * usual block), as a driver does for host memory and simgpu for every allocation, and
 * says whether its 2 MiB page-table region is shared with another accessible mapping:
 * there, each munmap walks a page-table page instead of skipping an empty range.
 *
 * Built with -DMODE_LINKED (linked with -lcuda). Prints
 *   CLEAR                   no other mapping with any access in that 2 MiB
 *   SHARED <maps line>      the first accessible mapping found there
 * Exit status 0 when it printed either, 1 if a driver call failed, 2 on any other error.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_min.h"

#define CHECK(call)                                                                               \
    do {                                                                                          \
        CUresult r_ = (call);                                                                     \
        if (r_ != CUDA_SUCCESS) {                                                                 \
            fprintf(stderr, "page_table_fence: %s failed (%d)\n", #call, (int)r_);              \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)

int main(void) {
    CUcontext ctx = NULL;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));

    const size_t size = 1 << 20, pmd = 2 << 20;
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
