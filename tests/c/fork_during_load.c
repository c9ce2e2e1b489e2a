/*
 * fork_during_load.c: a library preloaded after the shim that wraps dlopen. When the
 * shim opens libgpufrac_core.so, another thread forks (while the shim is loading it) and
 * the child calls cuInit: the child has no loading thread, so the shim must load the core
 * itself rather than wait for ever. Prints "CHILD ok" or "CHILD failed" on stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int forked;

static void *fork_and_init(void *unused) {
    (void)unused;
    pid_t child = fork();
    if (child == 0) {
        alarm(10);
        int (*init)(unsigned) = (int (*)(unsigned))dlsym(RTLD_DEFAULT, "cuInit");
        int status = init ? init(0) : -1;
        fprintf(stderr, "child cuInit: %d\n", status);
        _exit(status == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    fprintf(stderr, "CHILD %s\n", WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "ok" : "failed");
    return NULL;
}

void *dlopen(const char *file, int flags) {
    static void *(*real)(const char *, int);
    if (!real) real = (void *(*)(const char *, int))dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.34");
    if (!real) real = (void *(*)(const char *, int))dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.2.5");
    if (file && strstr(file, "libgpufrac_core") && !forked) {
        forked = 1;
        pthread_t thread;
        pthread_create(&thread, NULL, fork_and_init, NULL);
        pthread_join(thread, NULL);
    }
    return real(file, flags);
}
