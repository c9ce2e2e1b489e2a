/*
 * ipc_share.c: cuMemAlloc memory shared between processes with legacy IPC handles
 * (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle), and peer access
 * between two devices' contexts. Linked with -lcuda; each output line is flushed at once.
 *
 * Usage: ipc_share export <bytes>
 *   Allocates <bytes> on device 0 (primary context), writes word i = i, takes its handle
 *   twice (the same handle both times, as "a lightweight operation [that] may be called
 *   multiple times") and prints
 *     HANDLE <128 hex digits>
 *   then serves stdin, one command a line:
 *     word          prints WORD0 <word 0 as this process reads it>
 *     open <hex>    opens a handle in this (the exporting) process: OPEN <result>
 *     handle        takes the handle of the allocation again: SAME <1 if unchanged>
 *     free          frees the allocation: FREED <result>
 *     alloc <bytes> allocates more: ALLOC <result> (kept until exit)
 *   and at end of file prints DONE and exits.
 *
 * Usage: ipc_share import <hex> <bytes> [device]
 *   Opens the handle in device <device>'s primary context (default 0) with
 *   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS and prints OPENED <result>; on success it checks
 *   that word i is i (i >= 1), writes 0xdead to word 0, opens the handle again and prints
 *     IMPORTED <sum of the words read, 64-bit> <1 if the second open gave the same pointer>
 *   then serves stdin: word (WORD0 <v>), close (CLOSED <result>), free (FREE <result> of
 *   cuMemFree on the imported pointer), alloc <bytes> (ALLOC <result>), EOF (DONE).
 *
 * Usage: ipc_share peer
 *   On two devices: prints
 *     PEER <can 0->1> <can 1->0> <can 0->0> <enable> <enable again> <enable self>
 *          <enable with flags 1> <disable> <disable again> <enable after disable>
 *
 * Exit status: 0 done; 1 a driver or system call failed; 2 usage; 4 a wrong result.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_min.h"

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        cuGetErrorName(r, &name);
        fprintf(stderr, "ipc_share: %s: %s (%d)\n", what, name ? name : "?", (int)r);
        exit(1);
    }
}

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "ipc_share: %s\n", what);
        exit(4);
    }
}

static CUcontext primary(int ordinal) {
    CUdevice dev;
    CUcontext ctx;
    check(cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    return ctx;
}

static void to_hex(const CUipcMemHandle *h, char *out) {
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", (unsigned char)h->reserved[i]);
}

static int from_hex(const char *text, CUipcMemHandle *h) {
    if (strlen(text) < 128) return 0;
    for (int i = 0; i < 64; i++) {
        unsigned int byte;
        if (sscanf(text + 2 * i, "%2x", &byte) != 1) return 0;
        h->reserved[i] = (char)byte;
    }
    return 1;
}

static unsigned int word0(CUdeviceptr ptr) {
    unsigned int w = 0;
    check(cuMemcpyDtoH_v2(&w, ptr, sizeof w), "cuMemcpyDtoH");
    return w;
}

static void serve(CUdeviceptr ptr, const CUipcMemHandle *mine, int importer) {
    char line[512];
    while (fgets(line, sizeof line, stdin)) {
        CUipcMemHandle h;
        CUdeviceptr other = 0;
        unsigned long long bytes = 0;
        if (strncmp(line, "word", 4) == 0) {
            printf("WORD0 %u\n", word0(ptr));
        } else if (strncmp(line, "open ", 5) == 0 && from_hex(line + 5, &h)) {
            printf("OPEN %d\n", (int)cuIpcOpenMemHandle_v2(&other, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        } else if (strncmp(line, "handle", 6) == 0 && mine) {
            CUipcMemHandle again;
            check(cuIpcGetMemHandle(&again, ptr), "cuIpcGetMemHandle");
            printf("SAME %d\n", memcmp(&again, mine, sizeof again) == 0);
        } else if (strncmp(line, "free", 4) == 0) {
            printf("%s %d\n", importer ? "FREE" : "FREED", (int)cuMemFree_v2(ptr));
        } else if (strncmp(line, "close", 5) == 0) {
            printf("CLOSED %d\n", (int)cuIpcCloseMemHandle(ptr));
        } else if (sscanf(line, "alloc %llu", &bytes) == 1) {
            printf("ALLOC %d\n", (int)cuMemAlloc_v2(&other, (size_t)bytes));
        } else {
            fprintf(stderr, "ipc_share: unknown command %s", line);
            exit(2);
        }
        fflush(stdout);
    }
    printf("DONE\n");
    fflush(stdout);
}

static int do_export(size_t bytes) {
    primary(0);
    CUdeviceptr ptr;
    check(cuMemAlloc_v2(&ptr, bytes), "cuMemAlloc");
    size_t n = bytes / 4;
    unsigned int *host = malloc(bytes);
    if (!host) return 1;
    for (size_t i = 0; i < n; i++) host[i] = (unsigned int)i;
    check(cuMemcpyHtoD_v2(ptr, host, bytes), "cuMemcpyHtoD");
    free(host);
    CUipcMemHandle h, again;
    check(cuIpcGetMemHandle(&h, ptr), "cuIpcGetMemHandle");
    check(cuIpcGetMemHandle(&again, ptr), "cuIpcGetMemHandle (again)");
    expect(memcmp(&h, &again, sizeof h) == 0, "a second cuIpcGetMemHandle gave another handle");
    /* The contents survive taking the handle. */
    expect(word0(ptr + 4) == 1, "taking the handle changed the memory");
    char hex[129];
    to_hex(&h, hex);
    printf("HANDLE %s\n", hex);
    fflush(stdout);
    serve(ptr, &h, 0);
    return 0;
}

static int do_import(const char *hex, int ordinal, size_t bytes) {
    CUipcMemHandle h;
    if (!from_hex(hex, &h)) return 2;
    primary(ordinal);
    CUdeviceptr ptr = 0;
    CUresult r = cuIpcOpenMemHandle_v2(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("OPENED %d\n", (int)r);
    fflush(stdout);
    if (r != CUDA_SUCCESS) {
        serve(0, NULL, 1);
        return 0;
    }
    size_t n = bytes / 4;
    unsigned int *host = malloc(bytes);
    if (!host) return 1;
    check(cuMemcpyDtoH_v2(host, ptr, bytes), "cuMemcpyDtoH");
    unsigned long long sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0) expect(host[i] == (unsigned int)i, "the memory does not hold the exporter's data");
        sum += host[i];
    }
    free(host);
    unsigned int dead = 0xdead;
    check(cuMemcpyHtoD_v2(ptr, &dead, sizeof dead), "cuMemcpyHtoD");
    CUdeviceptr again = 0;
    check(cuIpcOpenMemHandle_v2(&again, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle (again)");
    printf("IMPORTED %llu %d\n", sum, again == ptr);
    fflush(stdout);
    serve(ptr, NULL, 1);
    return 0;
}

static int do_peer(void) {
    CUcontext c1 = primary(1);
    CUcontext c0 = primary(0);
    int a = -1, b = -1, self = -1;
    check(cuDeviceCanAccessPeer(&a, 0, 1), "cuDeviceCanAccessPeer");
    check(cuDeviceCanAccessPeer(&b, 1, 0), "cuDeviceCanAccessPeer");
    check(cuDeviceCanAccessPeer(&self, 0, 0), "cuDeviceCanAccessPeer");
    int enable = cuCtxEnablePeerAccess(c1, 0);
    int again = cuCtxEnablePeerAccess(c1, 0);
    int to_self = cuCtxEnablePeerAccess(c0, 0);
    int flags = cuCtxEnablePeerAccess(c1, 1);
    int disable = cuCtxDisablePeerAccess(c1);
    int disable_again = cuCtxDisablePeerAccess(c1);
    int reenable = cuCtxEnablePeerAccess(c1, 0);
    printf("PEER %d %d %d %d %d %d %d %d %d %d\n", a, b, self, enable, again, to_self, flags, disable,
           disable_again, reenable);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    check(cuInit(0), "cuInit");
    if (argc == 3 && strcmp(argv[1], "export") == 0) return do_export((size_t)strtoull(argv[2], NULL, 10));
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "import") == 0)
        return do_import(argv[2], argc == 5 ? atoi(argv[4]) : 0, (size_t)strtoull(argv[3], NULL, 10));
    if (argc == 2 && strcmp(argv[1], "peer") == 0) return do_peer();
    fprintf(stderr, "usage: ipc_share export <bytes> | import <hex> <bytes> [device] | peer\n");
    return 2;
}
