/*
 * next_wrapper.c: a wrapper library of the usual kind, preloaded after the shim. Its
 * getppid() would call "the next" getppid, found with dlsym(RTLD_NEXT); at load it checks
 * that the lookup finds libc's function, not its own (which a dlsym that does not keep
 * the caller's address would return, and the wrapper would then call itself for ever).
 * Prints "NEXT libc" or "NEXT self" (or "NEXT none") on stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

pid_t getppid(void) {
    pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, "getppid");
    return next && next != getppid ? next() : -1;
}

__attribute__((constructor)) static void check_next(void) {
    void *next = dlsym(RTLD_NEXT, "getppid");
    fprintf(stderr, "NEXT %s\n", next == NULL ? "none" : next == (void *)getppid ? "self" : "libc");
}
