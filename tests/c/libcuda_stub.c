/*
 * libcuda_stub.c: a link-time stand-in for libcuda.so, like the CUDA toolkit's
 * stubs/libcuda.so. Built with -soname libcuda.so.1, it lets programs link with -lcuda
 * without any driver present; at run time the dynamic loader finds the real
 * libcuda.so.1 (or the simulated one) on LD_LIBRARY_PATH instead. Every function fails
 * with CUDA_ERROR_UNKNOWN, so a program that picks up this stub by mistake says so.
 */
#include "cuda_min.h"

/* The stubs ignore their parameters; keep -Wextra builds quiet about it. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

#define STUB(base, symbol, params)                                                              \
    CUresult symbol params { return CUDA_ERROR_UNKNOWN; }
CUDA_DRIVER_FUNCTIONS(STUB)
CUDA_GRAPH_FUNCTIONS(STUB)
CUDA_SHARE_FUNCTIONS(STUB)
#undef STUB

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    if (pfn) *pfn = 0;
    if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_UNKNOWN;
}
