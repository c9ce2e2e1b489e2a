/*
 * green_ctx.c: green contexts (CUDA 12.4+) take device memory as contexts do. Linked with
 * -lcuda; device 0. Each output line is flushed at once.
 *
 * Usage: green_ctx
 *   Reads the device's SM resource, splits it into groups of 16 SMs, makes a descriptor
 *   of the first group and prints
 *     SPLIT <device SMs> <groups> <SMs per group> <SMs remaining>
 *   creates a green context from it and prints
 *     CREATED <SMs of the green context> <SMs of its CUcontext>
 *   makes its CUcontext current, allocates 1 MiB in it, creates a stream of it, then
 *   prints READY and waits for a line on stdin; frees the allocation, destroys the green
 *   context and prints
 *     DESTROYED <cuCtxSetCurrent of the old CUcontext afterwards: result>
 *   then waits for end of file on stdin and prints DONE.
 *
 * Usage: green_ctx fill
 *   Creates green contexts until one is refused, and prints
 *     FILLED <green contexts made> <result of the refused one>
 *   then destroys them all and prints DONE.
 *
 * Exit status: 0 done; 1 a driver call failed; 2 usage; 4 a wrong result.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_min.h"

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        cuGetErrorName(r, &name);
        fprintf(stderr, "green_ctx: %s: %s (%d)\n", what, name ? name : "?", (int)r);
        exit(1);
    }
}

static CUdevResourceDesc group_desc(void) {
    CUdevResource whole, groups[4], rest;
    check(cuDeviceGetDevResource(0, &whole, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
    unsigned int n = 4;
    check(cuDevSmResourceSplitByCount(groups, &n, &whole, &rest, 0, 16), "cuDevSmResourceSplitByCount");
    printf("SPLIT %u %u %u %u\n", whole.sm.smCount, n, groups[0].sm.smCount, rest.sm.smCount);
    CUdevResourceDesc desc;
    check(cuDevResourceGenerateDesc(&desc, groups, 1), "cuDevResourceGenerateDesc");
    return desc;
}

static int fill(void) {
    CUdevResourceDesc desc = group_desc();
    CUgreenCtx made[256];
    int n = 0;
    CUresult r = CUDA_SUCCESS;
    while (n < 256) {
        r = cuGreenCtxCreate(&made[n], desc, 0, CU_GREEN_CTX_DEFAULT_STREAM);
        if (r != CUDA_SUCCESS) break;
        n++;
    }
    printf("FILLED %d %d\n", n, (int)r);
    fflush(stdout);
    for (int i = 0; i < n; i++) check(cuGreenCtxDestroy(made[i]), "cuGreenCtxDestroy");
    printf("DONE\n");
    return 0;
}

int main(int argc, char **argv) {
    check(cuInit(0), "cuInit");
    if (argc == 2 && strcmp(argv[1], "fill") == 0) return fill();
    if (argc != 1) {
        fprintf(stderr, "usage: green_ctx [fill]\n");
        return 2;
    }
    CUdevResourceDesc desc = group_desc();
    CUgreenCtx green;
    check(cuGreenCtxCreate(&green, desc, 0, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
    CUdevResource own, of_ctx;
    check(cuGreenCtxGetDevResource(green, &own, CU_DEV_RESOURCE_TYPE_SM), "cuGreenCtxGetDevResource");
    CUcontext ctx;
    check(cuCtxFromGreenCtx(&ctx, green), "cuCtxFromGreenCtx");
    check(cuCtxGetDevResource(ctx, &of_ctx, CU_DEV_RESOURCE_TYPE_SM), "cuCtxGetDevResource");
    printf("CREATED %u %u\n", own.sm.smCount, of_ctx.sm.smCount);
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    CUdeviceptr p;
    check(cuMemAlloc_v2(&p, 1 << 20), "cuMemAlloc in the green context");
    CUstream s;
    check(cuGreenCtxStreamCreate(&s, green, 1 /* CU_STREAM_NON_BLOCKING */, 0), "cuGreenCtxStreamCreate");
    check(cuMemsetD8_v2(p, 7, 1 << 20), "cuMemsetD8");
    check(cuStreamSynchronize(s), "cuStreamSynchronize");
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    check(cuStreamDestroy_v2(s), "cuStreamDestroy");
    check(cuMemFree_v2(p), "cuMemFree");
    check(cuGreenCtxDestroy(green), "cuGreenCtxDestroy");
    CUresult after = cuCtxSetCurrent(ctx);
    printf("DESTROYED %d\n", (int)after);
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
    }
    printf("DONE\n");
    return 0;
}
