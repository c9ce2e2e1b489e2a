/*
 * vmm_share.c: VMM memory shared between processes through POSIX file descriptors
 * (cuMemExportToShareableHandle / cuMemImportFromShareableHandle), passed over a unix
 * socket with SCM_RIGHTS. Linked with -lcuda; device 0's primary context. Each output
 * line is flushed at once.
 *
 * Usage: vmm_share export <socket path> <bytes>
 *   Creates <bytes> with cuMemCreate (requestedHandleTypes = POSIX_FILE_DESCRIPTOR), maps
 *   it, fills word i with i, exports it, listens on <socket path> and prints READY; sends
 *   the descriptor to the first process that connects, then serves stdin, one command a
 *   line:
 *     check    prints WORD0 <word 0 as this process reads it>
 *     release  unmaps, releases the handle, closes its descriptor; prints RELEASED
 *   and at end of file prints DONE and exits.
 *
 * Usage: vmm_share import <socket path> <bytes>
 *   Receives the descriptor, imports it, closes it, maps the memory, checks that word i
 *   is i (word 0 excepted once written), writes 0xdead to word 0 and prints
 *   IMPORTED <sum of the words read, 64-bit>
 *   then serves stdin: check (prints STILL <sum>), release (prints RELEASED), EOF (DONE).
 *
 * Usage: vmm_share local <bytes>
 *   In one process: an allocation that did not ask for POSIX descriptors is refused
 *   export; one that did is exported, imported and mapped at a second address, and a
 *   write through one mapping is read through the other; prints
 *   LOCAL <export of the plain allocation: result> <requestedHandleTypes read back>
 *         <value read through the imported mapping>
 *
 * Exit status: 0 done; 1 a driver or system call failed; 2 usage; 4 a wrong result.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuda_min.h"

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        const char *name = NULL;
        cuGetErrorName(r, &name);
        fprintf(stderr, "vmm_share: %s: %s (%d)\n", what, name ? name : "?", (int)r);
        exit(1);
    }
}

static void fail(const char *what) {
    perror(what);
    exit(1);
}

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "vmm_share: %s\n", what);
        exit(4);
    }
}

static CUmemAllocationProp prop_for(CUmemAllocationHandleType types) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = types;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    return prop;
}

/* Reserves, maps and opens read-write access to `handle`'s `bytes`. */
static CUdeviceptr map(CUmemGenericAllocationHandle handle, size_t bytes) {
    CUdeviceptr ptr = 0;
    check(cuMemAddressReserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
    check(cuMemMap(ptr, bytes, 0, handle, 0), "cuMemMap");
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(cuMemSetAccess(ptr, bytes, &access, 1), "cuMemSetAccess");
    return ptr;
}

static void unmap(CUdeviceptr ptr, size_t bytes) {
    check(cuMemUnmap(ptr, bytes), "cuMemUnmap");
    check(cuMemAddressFree(ptr, bytes), "cuMemAddressFree");
}

/* The sum of the words, word 0 included, read back to the host. */
static unsigned long long sum_words(CUdeviceptr ptr, size_t bytes, int check_pattern) {
    size_t n = bytes / 4;
    unsigned int *host = malloc(bytes);
    if (!host) fail("malloc");
    check(cuMemcpyDtoH_v2(host, ptr, bytes), "cuMemcpyDtoH");
    unsigned long long sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (check_pattern && i > 0) expect(host[i] == (unsigned int)i, "the memory does not hold the exporter's data");
        sum += host[i];
    }
    free(host);
    return sum;
}

static void send_fd(int sock, int fd) {
    char byte = 'f';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    if (sendmsg(sock, &msg, 0) != 1) fail("sendmsg");
}

static int recv_fd(int sock) {
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &msg, 0) != 1) fail("recvmsg");
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS) {
        fprintf(stderr, "vmm_share: no descriptor received\n");
        exit(1);
    }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof(int));
    return fd;
}

static struct sockaddr_un address(const char *path) {
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof a.sun_path) {
        fprintf(stderr, "vmm_share: socket path too long\n");
        exit(2);
    }
    strcpy(a.sun_path, path);
    return a;
}

static void start(void) {
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDevicePrimaryCtxRetain(&ctx, 0), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

/* Serves stdin until end of file; `held` says whether the mapping is still ours. */
static void serve(const char *label, CUdeviceptr ptr, size_t bytes, CUmemGenericAllocationHandle handle,
                  int *fd) {
    char line[64];
    int held = 1;
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "check", 5) == 0 && held) {
            if (strcmp(label, "WORD0") == 0) {
                unsigned int word = 0;
                check(cuMemcpyDtoH_v2(&word, ptr, 4), "cuMemcpyDtoH");
                printf("WORD0 %u\n", word);
            } else {
                printf("%s %llu\n", label, sum_words(ptr, bytes, 1));
            }
        } else if (strncmp(line, "release", 7) == 0 && held) {
            unmap(ptr, bytes);
            check(cuMemRelease(handle), "cuMemRelease");
            if (fd && *fd >= 0) {
                close(*fd);
                *fd = -1;
            }
            held = 0;
            printf("RELEASED\n");
        }
        fflush(stdout);
    }
    printf("DONE\n");
    fflush(stdout);
}

static int export_main(const char *path, size_t bytes) {
    start();
    CUmemAllocationProp prop = prop_for(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle handle;
    check(cuMemCreate(&handle, bytes, &prop, 0), "cuMemCreate");
    CUdeviceptr ptr = map(handle, bytes);
    unsigned int *host = malloc(bytes);
    if (!host) fail("malloc");
    for (size_t i = 0; i < bytes / 4; i++) host[i] = (unsigned int)i;
    check(cuMemcpyHtoD_v2(ptr, host, bytes), "cuMemcpyHtoD");
    free(host);
    int fd = -1;
    check(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
    expect(fd >= 0, "no descriptor exported");

    int listener = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = address(path);
    if (listener < 0 || bind(listener, (struct sockaddr *)&a, sizeof a) != 0 || listen(listener, 1) != 0)
        fail("listen");
    printf("READY\n");
    fflush(stdout);
    int conn = accept(listener, NULL, NULL);
    if (conn < 0) fail("accept");
    send_fd(conn, fd);
    close(conn);
    close(listener);
    unlink(path);
    printf("SENT\n");
    fflush(stdout);
    serve("WORD0", ptr, bytes, handle, &fd);
    return 0;
}

static int import_main(const char *path, size_t bytes) {
    int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = address(path);
    if (sock < 0 || connect(sock, (struct sockaddr *)&a, sizeof a) != 0) fail("connect");
    int fd = recv_fd(sock);
    close(sock);
    start();
    CUmemGenericAllocationHandle handle;
    check(cuMemImportFromShareableHandle(&handle, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    close(fd);
    CUmemAllocationProp back;
    check(cuMemGetAllocationPropertiesFromHandle(&back, handle), "cuMemGetAllocationPropertiesFromHandle");
    expect(back.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "imported handle types differ");
    CUdeviceptr ptr = map(handle, bytes);
    unsigned long long sum = sum_words(ptr, bytes, 1);
    unsigned int word = 0xdead;
    check(cuMemcpyHtoD_v2(ptr, &word, 4), "cuMemcpyHtoD");
    printf("IMPORTED %llu\n", sum);
    fflush(stdout);
    serve("STILL", ptr, bytes, handle, NULL);
    return 0;
}

static int local_main(size_t bytes) {
    start();
    CUmemAllocationProp plain = prop_for(CU_MEM_HANDLE_TYPE_NONE);
    CUmemGenericAllocationHandle h0;
    check(cuMemCreate(&h0, bytes, &plain, 0), "cuMemCreate (plain)");
    int fd = -1;
    CUresult refused = cuMemExportToShareableHandle(&fd, h0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    check(cuMemRelease(h0), "cuMemRelease (plain)");

    CUmemAllocationProp prop = prop_for(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h1, h2;
    check(cuMemCreate(&h1, bytes, &prop, 0), "cuMemCreate");
    check(cuMemExportToShareableHandle(&fd, h1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
    check(cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    close(fd);
    CUmemAllocationProp back;
    check(cuMemGetAllocationPropertiesFromHandle(&back, h2), "cuMemGetAllocationPropertiesFromHandle");
    CUdeviceptr p1 = map(h1, bytes);
    CUdeviceptr p2 = map(h2, bytes);
    expect(p1 != p2, "two reservations at one address");
    unsigned int word = 0xbeef, seen = 0;
    check(cuMemcpyHtoD_v2(p1, &word, 4), "cuMemcpyHtoD");
    check(cuMemcpyDtoH_v2(&seen, p2, 4), "cuMemcpyDtoH");
    unmap(p1, bytes);
    unmap(p2, bytes);
    check(cuMemRelease(h1), "cuMemRelease");
    check(cuMemRelease(h2), "cuMemRelease (imported)");
    printf("LOCAL %d %d %u\n", (int)refused, (int)back.requestedHandleTypes, seen);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "export") == 0) return export_main(argv[2], strtoull(argv[3], NULL, 0));
    if (argc == 4 && strcmp(argv[1], "import") == 0) return import_main(argv[2], strtoull(argv[3], NULL, 0));
    if (argc == 3 && strcmp(argv[1], "local") == 0) return local_main(strtoull(argv[2], NULL, 0));
    fprintf(stderr, "usage: vmm_share export|import <socket> <bytes> | local <bytes>\n");
    return 2;
}
