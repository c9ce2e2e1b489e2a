/*
 * gpufrac.h: what libgpufrac.so (the gpufrac shim) exports for programs that want to
 * ask it things. Link with -lgpufrac, or look the symbols up with dlsym(RTLD_DEFAULT, ...)
 * so that the program also runs without the shim.
 *
 * Foundation stage: the version query. The request, limit and held-memory queries per
 * device arrive with the shim's enforcement.
 */
#ifndef GPUFRAC_H
#define GPUFRAC_H

#ifdef __cplusplus
extern "C" {
#endif

/* The shim's version as major * 10000 + minor * 100 + patch. */
unsigned int gpufrac_version(void);

#ifdef __cplusplus
}
#endif

#endif /* GPUFRAC_H */
