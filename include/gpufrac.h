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

typedef unsigned int (*gpufrac_version_fn)(void);
typedef int (*gpufrac_enabled_fn)(void);
typedef int (*gpufrac_device_count_fn)(void);
typedef int (*gpufrac_device_info_fn)(int, struct gpufrac_device_info *);
typedef uint64_t (*gpufrac_value_fn)(int);

#ifdef __cplusplus
}
#endif

#endif /* GPUFRAC_H */
