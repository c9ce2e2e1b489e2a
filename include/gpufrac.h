/*
 * gpufrac.h: what libgpufrac.so (the gpufrac shim) exports for programs that want to ask
 * it about their GPU memory slice.
 *
 * The shim is preloaded (LD_PRELOAD), so a program need not link it: look the functions
 * up with dlsym(RTLD_DEFAULT, "gpufrac_device_info") and the program also runs without
 * the shim (the lookup then returns NULL). The typedefs below are for that. Linking with
 * -lgpufrac works too.
 *
 * Devices are CUDA ordinals, as seen by the process. Answers are available after cuInit;
 * before it, or when the shim does not enforce a slice (GPUFRAC_MEMORY_REQUEST unset),
 * gpufrac_enabled() is 0 and the queries answer 0 or -1. No function fails the caller.
 */
#ifndef GPUFRAC_H
#define GPUFRAC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A device's slice for this process's group, in bytes. */
struct gpufrac_device_info {
    uint64_t request;         /* guaranteed to the group */
    uint64_t limit;           /* most the group may hold; the size cuMemGetInfo reports */
    uint64_t held;            /* what the group (all its processes) holds now */
    uint64_t held_by_process; /* what this process holds now */
    uint64_t total;           /* the device's physical memory */
};

/* The shim's version: major * 10000 + minor * 100 + patch. */
unsigned int gpufrac_version(void);

/* 1 if the shim enforces a slice in this process (after cuInit), else 0. */
int gpufrac_enabled(void);

/* Devices the shim enforces on; 0 before cuInit or without enforcement. */
int gpufrac_device_count(void);

/* Fills *out for CUDA device `device`; returns 0, or -1 (unknown device, no enforcement). */
int gpufrac_device_info(int device, struct gpufrac_device_info *out);

/* Single values for `device`, 0 when unknown. */
uint64_t gpufrac_request(int device);
uint64_t gpufrac_limit(int device);
uint64_t gpufrac_held(int device);

/*
 * Registers release(data), called when the process gives back GPU memory it keeps and
 * does not use: when the arbiter needs memory lent to this process back (a burst waits
 * for it, a guarantee is owed it, the process is about to be parked or swapped out) or
 * after GPUFRAC_GIVE_BACK_IDLE without GPU work. A native server with a pool of its own
 * frees the blocks it caches there (cuMemFree or cudaFree); the shim then returns them.
 * PyTorch's and CuPy's pools need no registration. release runs on a thread of the
 * shim's, never during a stream capture, one call at a time; it must not wait for the
 * program's own GPU work to finish. At most 16 functions; returns 0, or -1 (release is
 * NULL, the table is full, or the shim's core cannot be loaded). Registering loads the
 * shim's core if the program made no CUDA call yet.
 */
int gpufrac_on_give_back(void (*release)(void *data), void *data);

typedef unsigned int (*gpufrac_version_fn)(void);
typedef int (*gpufrac_enabled_fn)(void);
typedef int (*gpufrac_device_count_fn)(void);
typedef int (*gpufrac_device_info_fn)(int, struct gpufrac_device_info *);
typedef uint64_t (*gpufrac_value_fn)(int);
typedef int (*gpufrac_on_give_back_fn)(void (*)(void *), void *);

#ifdef __cplusplus
}
#endif

#endif /* GPUFRAC_H */
