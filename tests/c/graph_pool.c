/*
 * graph_pool.c: stream capture and the graph memory pool, as PyTorch's cudaMallocAsync
 * backend with CUDA graphs uses them. Linked with -lcuda; runs on device 0's primary
 * context. Kernels are simgpu's built-ins (simgpu_fill_u32, simgpu_checksum_u32).
 *
 * Usage: graph_pool pool <bytes>
 *   Captures, on a stream, cuMemAllocAsync(bytes) + a fill kernel + a checksum kernel +
 *   cuMemFreeAsync, checks the graph's nodes (types, the allocation node's size and
 *   address), instantiates it and prints, each line flushed at once:
 *     CAPTURED <reserved> <free>                  before any launch
 *     LAUNCHED <reserved> <used> <free>           after a launch completed
 *     RELAUNCHED <reserved> <reserved high>       after a second launch
 *   then waits for a line on stdin, trims the pool with cuDeviceGraphMemTrim and prints
 *     TRIMMED <reserved> <free> <reserved high after reset>
 *   then waits for end of file on stdin and prints DONE.
 *   reserved/used: cuDeviceGetGraphMemAttribute RESERVED_MEM_CURRENT / USED_MEM_CURRENT;
 *   free: cuMemGetInfo_v2. Each launch's checksum must be 7 * (bytes / 4).
 *
 * Usage: graph_pool ctxsync
 *   Begins a GLOBAL capture, captures a cuMemAllocAsync, calls cuCtxSynchronize and
 *   prints
 *     CTXSYNC <cuCtxSynchronize result> <capture status after> <cuStreamEndCapture result> <graph null?>
 *   then the same with cuMemAlloc during a GLOBAL and during a RELAXED-thread capture:
 *     MALLOC <cuMemAlloc result in GLOBAL> <cuMemAlloc result with the thread RELAXED>
 *   then cuCtxSynchronize from a RELAXED thread during a capture (RELAXED allows unsafe
 *   calls, not a synchronize that encompasses the capture):
 *     RELAXEDSYNC <cuCtxSynchronize result> <cuStreamEndCapture result>
 *   then cuStreamSynchronize(CU_STREAM_LEGACY) while a blocking stream captures, and
 *   while only a non-blocking stream captures, then the non-blocking capture's graph
 *   launched:
 *     LEGACY <sync result> <end result> <sync result, non-blocking> <end result, non-blocking> <launch result>
 *
 * Usage: graph_pool leased <kernels>
 *   For a process whose group takes the GPU by compute leases: runs a fill kernel on the
 *   stream outside any capture (so that the shim watches the stream), then captures, in
 *   GLOBAL mode, <kernels> fill kernels 1 ms apart and a checksum kernel (a capture open
 *   for that long while leases begin and end), instantiates the graph, launches it twice
 *   checking its checksum, and prints LEASED OK.
 *
 * Exit status: 0 done; 1 a driver call failed; 2 usage; 4 a wrong result.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_min.h"

/* cuda.h's handle of the legacy default stream. */
#define CU_STREAM_LEGACY ((CUstream)0x1)

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        cuGetErrorName(r, &name);
        fprintf(stderr, "graph_pool: %s: %s (%d)\n", what, name ? name : "?", (int)r);
        exit(1);
    }
}

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "graph_pool: %s\n", what);
        exit(4);
    }
}

static unsigned long long attr(CUgraphMem_attribute a) {
    cuuint64_t value = 0;
    check(cuDeviceGetGraphMemAttribute(0, a, &value), "cuDeviceGetGraphMemAttribute");
    return (unsigned long long)value;
}

static unsigned long long free_now(void) {
    size_t free = 0, total = 0;
    check(cuMemGetInfo_v2(&free, &total), "cuMemGetInfo");
    return (unsigned long long)free;
}

static void wait_line(void) {
    int c;
    while ((c = getchar()) != EOF && c != '\n') {
    }
}

static CUfunction fill, checksum;
static CUstream stream;

static void setup(void) {
    CUdevice dev;
    CUcontext ctx;
    CUmodule module;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    static const char image[] = "simgpu";
    check(cuModuleLoadData(&module, image), "cuModuleLoadData");
    check(cuModuleGetFunction(&fill, module, "simgpu_fill_u32"), "simgpu_fill_u32");
    check(cuModuleGetFunction(&checksum, module, "simgpu_checksum_u32"), "simgpu_checksum_u32");
    check(cuStreamCreate(&stream, CU_STREAM_DEFAULT), "cuStreamCreate");
}

static void launch_and_check(CUgraphExec exec, CUdeviceptr out, size_t count) {
    unsigned long long sum = 0;
    check(cuMemsetD8_v2(out, 0, 8), "cuMemsetD8");
    check(cuGraphLaunch(exec, stream), "cuGraphLaunch");
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    check(cuMemcpyDtoH_v2(&sum, out, 8), "cuMemcpyDtoH");
    expect(sum == 7ull * count, "the graph's checksum is not 7 * count");
}

static int pool(size_t bytes) {
    size_t count = bytes / 4;
    CUdeviceptr out, p = 0;
    check(cuMemAlloc_v2(&out, 8), "cuMemAlloc");

    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    check(cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
    expect(status == CU_STREAM_CAPTURE_STATUS_ACTIVE, "the capturing stream does not say ACTIVE");
    check(cuMemAllocAsync(&p, bytes, stream), "cuMemAllocAsync (captured)");
    unsigned int value = 7;
    void *fill_args[] = {&p, &value, &count};
    check(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, stream, fill_args, NULL), "fill (captured)");
    void *sum_args[] = {&p, &count, &out};
    check(cuLaunchKernel(checksum, 1, 1, 1, 1, 1, 1, 0, stream, sum_args, NULL), "checksum (captured)");
    check(cuMemFreeAsync(p, stream), "cuMemFreeAsync (captured)");
    CUgraph graph = NULL;
    check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
    check(cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
    expect(status == CU_STREAM_CAPTURE_STATUS_NONE, "the stream still captures after the end");

    CUgraphNode nodes[8];
    size_t n = 8;
    check(cuGraphGetNodes(graph, nodes, &n), "cuGraphGetNodes");
    expect(n == 4, "the graph should have 4 nodes");
    const CUgraphNodeType want[] = {CU_GRAPH_NODE_TYPE_MEM_ALLOC, CU_GRAPH_NODE_TYPE_KERNEL,
                                    CU_GRAPH_NODE_TYPE_KERNEL, CU_GRAPH_NODE_TYPE_MEM_FREE};
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType type;
        check(cuGraphNodeGetType(nodes[i], &type), "cuGraphNodeGetType");
        expect(type == want[i], "a node has the wrong type");
    }
    CUDA_MEM_ALLOC_NODE_PARAMS params;
    memset(&params, 0, sizeof params);
    check(cuGraphMemAllocNodeGetParams(nodes[0], &params), "cuGraphMemAllocNodeGetParams");
    expect(params.bytesize == bytes && params.dptr == p, "the allocation node's size or address is wrong");

    CUgraphExec exec;
    check(cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    printf("CAPTURED %llu %llu\n", attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), free_now());
    fflush(stdout);

    launch_and_check(exec, out, count);
    printf("LAUNCHED %llu %llu %llu\n", attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
           attr(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), free_now());
    fflush(stdout);
    launch_and_check(exec, out, count);
    printf("RELAUNCHED %llu %llu\n", attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
           attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH));
    fflush(stdout);

    wait_line();
    check(cuDeviceGraphMemTrim(0), "cuDeviceGraphMemTrim");
    cuuint64_t zero = 0;
    check(cuDeviceSetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH, &zero),
          "cuDeviceSetGraphMemAttribute");
    printf("TRIMMED %llu %llu %llu\n", attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), free_now(),
           attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH));
    fflush(stdout);

    wait_line();
    check(cuGraphExecDestroy(exec), "cuGraphExecDestroy");
    check(cuGraphDestroy(graph), "cuGraphDestroy");
    check(cuMemFree_v2(out), "cuMemFree");
    printf("DONE\n");
    return 0;
}

static int ctxsync(void) {
    CUdeviceptr p = 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUgraph graph = NULL;

    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    check(cuMemAllocAsync(&p, 1 << 20, stream), "cuMemAllocAsync (captured)");
    CUresult sync = cuCtxSynchronize();
    check(cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
    CUresult end = cuStreamEndCapture(stream, &graph);
    printf("CTXSYNC %d %d %d %d\n", (int)sync, (int)status, (int)end, graph == NULL);

    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    CUresult global = cuMemAlloc_v2(&p, 1 << 20);
    end = cuStreamEndCapture(stream, &graph);
    expect(end == 901, "a capture a cuMemAlloc broke must end invalidated");

    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    check(cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
    CUresult relaxed = cuMemAlloc_v2(&p, 1 << 20);
    check(cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
    check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture after a RELAXED thread's cuMemAlloc");
    printf("MALLOC %d %d\n", (int)global, (int)relaxed);

    /* The capture has to begin after the mode changes back: a RELAXED thread's own
       capture would be RELAXED only if begun so; this one is GLOBAL. */
    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    check(cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
    CUresult relaxed_sync = cuCtxSynchronize();
    check(cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
    end = cuStreamEndCapture(stream, &graph);
    printf("RELAXEDSYNC %d %d\n", (int)relaxed_sync, (int)end);

    /* The legacy stream encompasses every blocking stream of its context. */
    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    CUresult legacy = cuStreamSynchronize(CU_STREAM_LEGACY);
    CUresult legacy_end = cuStreamEndCapture(stream, &graph);
    CUstream nonblocking;
    CUgraphExec exec;
    check(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING), "cuStreamCreate (non-blocking)");
    check(cuStreamBeginCapture_v2(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    unsigned long long us = 100;
    void *params[] = {&us};
    CUfunction sleep_us;
    CUmodule module;
    check(cuModuleLoadData(&module, "simgpu"), "cuModuleLoadData");
    check(cuModuleGetFunction(&sleep_us, module, "simgpu_sleep_us"), "simgpu_sleep_us");
    check(cuLaunchKernel(sleep_us, 1, 1, 1, 1, 1, 1, 0, nonblocking, params, NULL), "cuLaunchKernel (captured)");
    CUresult nb_sync = cuStreamSynchronize(CU_STREAM_LEGACY);
    CUresult nb_end = cuStreamEndCapture(nonblocking, &graph);
    CUresult launched = CUDA_ERROR_INVALID_VALUE;
    if (nb_end == CUDA_SUCCESS) {
        check(cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiateWithFlags");
        launched = cuGraphLaunch(exec, nonblocking);
        check(cuStreamSynchronize(nonblocking), "cuStreamSynchronize after the graph's launch");
    }
    printf("LEGACY %d %d %d %d %d\n", (int)legacy, (int)legacy_end, (int)nb_sync, (int)nb_end, (int)launched);
    return 0;
}

static int leased(int kernels) {
    size_t count = 1024;
    CUdeviceptr out, p;
    check(cuMemAlloc_v2(&out, 8), "cuMemAlloc");
    check(cuMemAlloc_v2(&p, count * 4), "cuMemAlloc");
    unsigned int value = 7;
    void *fill_args[] = {&p, &value, &count};
    check(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, stream, fill_args, NULL), "fill");
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");

    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    for (int i = 0; i < kernels; i++) {
        check(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, stream, fill_args, NULL), "fill (captured)");
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    void *sum_args[] = {&p, &count, &out};
    check(cuLaunchKernel(checksum, 1, 1, 1, 1, 1, 1, 0, stream, sum_args, NULL), "checksum (captured)");
    CUgraph graph = NULL;
    check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
    CUgraphExec exec;
    check(cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
    launch_and_check(exec, out, count);
    launch_and_check(exec, out, count);
    printf("LEASED OK\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "leased") == 0) {
        setup();
        return leased(atoi(argv[2]));
    }
    if (argc == 3 && strcmp(argv[1], "pool") == 0) {
        setup();
        return pool((size_t)strtoull(argv[2], NULL, 10));
    }
    if (argc == 2 && strcmp(argv[1], "ctxsync") == 0) {
        setup();
        return ctxsync();
    }
    fprintf(stderr, "usage: graph_pool pool <bytes> | graph_pool ctxsync | graph_pool leased <kernels>\n");
    return 2;
}
