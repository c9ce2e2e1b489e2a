/*
 * cuda_min.h: the exact subset of cuda.h (CUDA 12.8) that the end-to-end C programs use.
 *
 * Types, enum values and struct layouts are those of cuda.h 12.8, as carried by the Rust
 * bindings in cudarc 0.19 (src/driver/sys/mod.rs, items for feature "cuda-12080"); the
 * static asserts at the end pin the layouts. A program written against this header runs
 * unchanged against the real driver and against libsimgpu_cuda.so.
 *
 * Every driver function the programs call is listed once, in CUDA_DRIVER_FUNCTIONS, as
 *     X(base name, exported symbol, parameter list)
 * The base name is what cuGetProcAddress takes ("cuMemAlloc"), the exported symbol is the
 * versioned name cuda.h's macros select ("cuMemAlloc_v2"). The same list declares the
 * prototypes (for programs linked with -lcuda), the pointer types PFN_<base>, the names
 * that dlsym looks up, and the stub libcuda.so the programs link against at build time.
 */
#ifndef GPUFRAC_CUDA_MIN_H
#define GPUFRAC_CUDA_MIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_VERSION 12080

/* ---- scalar and handle types ---- */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;

/* ---- results (the values used by the programs and the ones they may print) ---- */
typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

/* ---- enums ---- */
typedef enum CUarray_format_enum {
    CU_AD_FORMAT_UNSIGNED_INT8 = 1,
    CU_AD_FORMAT_UNSIGNED_INT16 = 2,
    CU_AD_FORMAT_UNSIGNED_INT32 = 3,
    CU_AD_FORMAT_SIGNED_INT8 = 8,
    CU_AD_FORMAT_SIGNED_INT16 = 9,
    CU_AD_FORMAT_SIGNED_INT32 = 10,
    CU_AD_FORMAT_HALF = 16,
    CU_AD_FORMAT_FLOAT = 32
} CUarray_format;

typedef enum CUmemAttach_flags_enum {
    CU_MEM_ATTACH_GLOBAL = 1,
    CU_MEM_ATTACH_HOST = 2,
    CU_MEM_ATTACH_SINGLE = 4
} CUmemAttach_flags;

typedef enum CUstream_flags_enum {
    CU_STREAM_DEFAULT = 0,
    CU_STREAM_NON_BLOCKING = 1
} CUstream_flags;

typedef enum CUmemAllocationType_enum {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
    CU_MEM_HANDLE_TYPE_NONE = 0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    CU_MEM_HANDLE_TYPE_WIN32 = 2,
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 4,
    CU_MEM_HANDLE_TYPE_FABRIC = 8,
    CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationHandleType;

typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_LOCATION_TYPE_HOST = 2,
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 3,
    CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4,
    CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemLocationType;

typedef enum CUmemAccess_flags_enum {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags_enum {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
} CUmemAllocationGranularity_flags;

typedef enum CUmemAllocationCompType_enum {
    CU_MEM_ALLOCATION_COMP_NONE = 0,
    CU_MEM_ALLOCATION_COMP_GENERIC = 1
} CUmemAllocationCompType;

typedef enum CUdriverProcAddress_flags_enum {
    CU_GET_PROC_ADDRESS_DEFAULT = 0,
    CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
} CUdriverProcAddress_flags;

typedef enum CUdriverProcAddressQueryResult_enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

/* ---- structs ---- */
typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc;

typedef struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    CUmemAllocationHandleType handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

/* ---- layouts, as in cuda.h 12.8 on LP64 ---- */
#define CUDA_MIN_ASSERT(cond) _Static_assert(cond, #cond)
CUDA_MIN_ASSERT(sizeof(CUresult) == 4);
CUDA_MIN_ASSERT(sizeof(CUdeviceptr) == 8);
CUDA_MIN_ASSERT(sizeof(CUDA_ARRAY_DESCRIPTOR) == 24);
CUDA_MIN_ASSERT(offsetof(CUDA_ARRAY_DESCRIPTOR, Format) == 16);
CUDA_MIN_ASSERT(sizeof(CUDA_ARRAY3D_DESCRIPTOR) == 40);
CUDA_MIN_ASSERT(offsetof(CUDA_ARRAY3D_DESCRIPTOR, Flags) == 32);
CUDA_MIN_ASSERT(sizeof(CUmemLocation) == 8);
CUDA_MIN_ASSERT(sizeof(CUmemAllocationProp) == 32);
CUDA_MIN_ASSERT(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16);
CUDA_MIN_ASSERT(offsetof(CUmemAllocationProp, allocFlags) == 24);
CUDA_MIN_ASSERT(sizeof(CUmemAccessDesc) == 12);
CUDA_MIN_ASSERT(sizeof(CUmemPoolProps) == 88);
CUDA_MIN_ASSERT(offsetof(CUmemPoolProps, maxSize) == 24);
CUDA_MIN_ASSERT(offsetof(CUmemPoolProps, usage) == 32);

/* ---- functions ---- */
#define CUDA_DRIVER_FUNCTIONS(X)                                                              \
    X(cuInit, cuInit, (unsigned int Flags))                                                   \
    X(cuGetErrorName, cuGetErrorName, (CUresult error, const char **pStr))                    \
    X(cuDeviceGet, cuDeviceGet, (CUdevice *device, int ordinal))                              \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2, (size_t *bytes, CUdevice dev))                   \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev))    \
    X(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, (CUdevice dev))                \
    X(cuCtxSetCurrent, cuCtxSetCurrent, (CUcontext ctx))                                      \
    X(cuCtxSynchronize, cuCtxSynchronize, (void))                                             \
    X(cuMemGetInfo, cuMemGetInfo_v2, (size_t *free, size_t *total))                           \
    X(cuMemAlloc, cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytesize))                        \
    X(cuMemAllocPitch, cuMemAllocPitch_v2,                                                    \
      (CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,                 \
       unsigned int ElementSizeBytes))                                                        \
    X(cuMemAllocManaged, cuMemAllocManaged,                                                   \
      (CUdeviceptr *dptr, size_t bytesize, unsigned int flags))                               \
    X(cuMemFree, cuMemFree_v2, (CUdeviceptr dptr))                                            \
    X(cuStreamCreate, cuStreamCreate, (CUstream *phStream, unsigned int Flags))               \
    X(cuStreamDestroy, cuStreamDestroy_v2, (CUstream hStream))                                \
    X(cuStreamSynchronize, cuStreamSynchronize, (CUstream hStream))                           \
    X(cuMemAllocAsync, cuMemAllocAsync,                                                       \
      (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))                                 \
    X(cuMemFreeAsync, cuMemFreeAsync, (CUdeviceptr dptr, CUstream hStream))                   \
    X(cuMemPoolCreate, cuMemPoolCreate,                                                       \
      (CUmemoryPool *pool, const CUmemPoolProps *poolProps))                                  \
    X(cuMemPoolDestroy, cuMemPoolDestroy, (CUmemoryPool pool))                                \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync,                                       \
      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream))              \
    X(cuArrayCreate, cuArrayCreate_v2,                                                        \
      (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray))                        \
    X(cuArray3DCreate, cuArray3DCreate_v2,                                                    \
      (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray))                      \
    X(cuArrayDestroy, cuArrayDestroy, (CUarray hArray))                                       \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,                           \
      (size_t *granularity, const CUmemAllocationProp *prop,                                  \
       CUmemAllocationGranularity_flags option))                                              \
    X(cuMemAddressReserve, cuMemAddressReserve,                                               \
      (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,                     \
       unsigned long long flags))                                                             \
    X(cuMemAddressFree, cuMemAddressFree, (CUdeviceptr ptr, size_t size))                     \
    X(cuMemCreate, cuMemCreate,                                                               \
      (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,    \
       unsigned long long flags))                                                             \
    X(cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle handle))                      \
    X(cuMemMap, cuMemMap,                                                                     \
      (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,      \
       unsigned long long flags))                                                             \
    X(cuMemUnmap, cuMemUnmap, (CUdeviceptr ptr, size_t size))                                 \
    X(cuMemSetAccess, cuMemSetAccess,                                                         \
      (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))              \
    X(cuMemsetD8, cuMemsetD8_v2, (CUdeviceptr dstDevice, unsigned char uc, size_t N))         \
    X(cuMemcpyHtoD, cuMemcpyHtoD_v2,                                                          \
      (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount))                         \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2,                                                          \
      (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount))

/* Stream capture, graphs and the graph memory pool, and what the graph programs launch
 * (kernels of a loaded module). A list of its own: programs that load every function of
 * CUDA_DRIVER_FUNCTIONS do not need these. */
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;

typedef enum CUstreamCaptureMode_enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2
} CUstreamCaptureMode;

typedef enum CUstreamCaptureStatus_enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2
} CUstreamCaptureStatus;

typedef enum CUgraphNodeType_enum {
    CU_GRAPH_NODE_TYPE_KERNEL = 0,
    CU_GRAPH_NODE_TYPE_MEMCPY = 1,
    CU_GRAPH_NODE_TYPE_MEMSET = 2,
    CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10,
    CU_GRAPH_NODE_TYPE_MEM_FREE = 11
} CUgraphNodeType;

typedef enum CUgraphMem_attribute_enum {
    CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0,
    CU_GRAPH_MEM_ATTR_USED_MEM_HIGH = 1,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH = 3
} CUgraphMem_attribute;

typedef enum CUgraphInstantiate_flags_enum {
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1,
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2
} CUgraphInstantiate_flags;

typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_st {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;
CUDA_MIN_ASSERT(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS) == 120);
CUDA_MIN_ASSERT(offsetof(CUDA_MEM_ALLOC_NODE_PARAMS, dptr) == 112);

#define CUDA_GRAPH_FUNCTIONS(X)                                                               \
    X(cuModuleLoadData, cuModuleLoadData, (CUmodule *module, const void *image))              \
    X(cuModuleGetFunction, cuModuleGetFunction,                                               \
      (CUfunction *hfunc, CUmodule hmod, const char *name))                                   \
    X(cuLaunchKernel, cuLaunchKernel,                                                         \
      (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,     \
       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                \
       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra))     \
    X(cuThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode,                   \
      (CUstreamCaptureMode *mode))                                                            \
    X(cuStreamBeginCapture, cuStreamBeginCapture_v2,                                          \
      (CUstream hStream, CUstreamCaptureMode mode))                                           \
    X(cuStreamEndCapture, cuStreamEndCapture, (CUstream hStream, CUgraph *phGraph))           \
    X(cuStreamIsCapturing, cuStreamIsCapturing,                                               \
      (CUstream hStream, CUstreamCaptureStatus *captureStatus))                               \
    X(cuGraphDestroy, cuGraphDestroy, (CUgraph hGraph))                                       \
    X(cuGraphGetNodes, cuGraphGetNodes, (CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)) \
    X(cuGraphNodeGetType, cuGraphNodeGetType, (CUgraphNode hNode, CUgraphNodeType *type))     \
    X(cuGraphMemAllocNodeGetParams, cuGraphMemAllocNodeGetParams,                             \
      (CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out))                            \
    X(cuGraphInstantiate, cuGraphInstantiateWithFlags,                                        \
      (CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags))                   \
    X(cuGraphUpload, cuGraphUpload, (CUgraphExec hGraphExec, CUstream hStream))               \
    X(cuGraphLaunch, cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream))               \
    X(cuGraphExecDestroy, cuGraphExecDestroy, (CUgraphExec hGraphExec))                       \
    X(cuDeviceGraphMemTrim, cuDeviceGraphMemTrim, (CUdevice device))                          \
    X(cuDeviceGetGraphMemAttribute, cuDeviceGetGraphMemAttribute,                             \
      (CUdevice device, CUgraphMem_attribute attr, void *value))                              \
    X(cuDeviceSetGraphMemAttribute, cuDeviceSetGraphMemAttribute,                             \
      (CUdevice device, CUgraphMem_attribute attr, void *value))

/* ---- sharing memory between processes, and green contexts (CUDA 12.4+) ----
 * cuMemExportToShareableHandle / cuMemImportFromShareableHandle with POSIX file
 * descriptors (the int is written to / passed as the void*), and the green context API,
 * laid out as in cuda.h 12.8 (tests/c/vmm_share.c, tests/c/green_ctx.c). */
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;

typedef enum CUdevResourceType_enum {
    CU_DEV_RESOURCE_TYPE_INVALID = 0,
    CU_DEV_RESOURCE_TYPE_SM = 1
} CUdevResourceType;

typedef enum CUgreenCtxCreate_flags_enum { CU_GREEN_CTX_DEFAULT_STREAM = 0x1 } CUgreenCtxCreate_flags;

typedef enum CUdevSmResourceSplit_flags_enum {
    CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING = 0x1,
    CU_DEV_SM_RESOURCE_SPLIT_MAX_POTENTIAL_CLUSTER_SIZE = 0x2
} CUdevSmResourceSplit_flags;

typedef struct CUdevSmResource_st {
    unsigned int smCount;
} CUdevSmResource;

typedef struct CUdevResource_st {
    CUdevResourceType type;
    unsigned char _internal_padding[92];
    union {
        CUdevSmResource sm;
        unsigned char _oversize[48];
    };
} CUdevResource;
CUDA_MIN_ASSERT(sizeof(CUdevResource) == 144);
CUDA_MIN_ASSERT(offsetof(CUdevResource, sm) == 96);

/* Legacy IPC of cuMemAlloc memory and peer access (tests/c/ipc_share.c). */
typedef struct CUipcMemHandle_st {
    char reserved[64];
} CUipcMemHandle;
CUDA_MIN_ASSERT(sizeof(CUipcMemHandle) == 64);
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1

#define CUDA_SHARE_FUNCTIONS(X)                                                               \
    X(cuIpcGetMemHandle, cuIpcGetMemHandle, (CUipcMemHandle *pHandle, CUdeviceptr dptr))      \
    X(cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2,                                              \
      (CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags))                        \
    X(cuIpcCloseMemHandle, cuIpcCloseMemHandle, (CUdeviceptr dptr))                           \
    X(cuDeviceCanAccessPeer, cuDeviceCanAccessPeer,                                           \
      (int *canAccessPeer, CUdevice dev, CUdevice peerDev))                                   \
    X(cuCtxEnablePeerAccess, cuCtxEnablePeerAccess, (CUcontext peerContext, unsigned int Flags)) \
    X(cuCtxDisablePeerAccess, cuCtxDisablePeerAccess, (CUcontext peerContext))                \
    X(cuMemExportToShareableHandle, cuMemExportToShareableHandle,                             \
      (void *shareableHandle, CUmemGenericAllocationHandle handle,                            \
       CUmemAllocationHandleType handleType, unsigned long long flags))                       \
    X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle,                         \
      (CUmemGenericAllocationHandle *handle, void *osHandle,                                  \
       CUmemAllocationHandleType shHandleType))                                               \
    X(cuMemGetAllocationPropertiesFromHandle, cuMemGetAllocationPropertiesFromHandle,         \
      (CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle))                       \
    X(cuDeviceGetDevResource, cuDeviceGetDevResource,                                         \
      (CUdevice device, CUdevResource *resource, CUdevResourceType type))                     \
    X(cuDevSmResourceSplitByCount, cuDevSmResourceSplitByCount,                               \
      (CUdevResource *result, unsigned int *nbGroups, const CUdevResource *input,             \
       CUdevResource *remaining, unsigned int useFlags, unsigned int minCount))               \
    X(cuDevResourceGenerateDesc, cuDevResourceGenerateDesc,                                   \
      (CUdevResourceDesc *phDesc, CUdevResource *resources, unsigned int nbResources))        \
    X(cuGreenCtxCreate, cuGreenCtxCreate,                                                     \
      (CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags))          \
    X(cuGreenCtxDestroy, cuGreenCtxDestroy, (CUgreenCtx hCtx))                                \
    X(cuCtxFromGreenCtx, cuCtxFromGreenCtx, (CUcontext *pContext, CUgreenCtx hCtx))           \
    X(cuGreenCtxGetDevResource, cuGreenCtxGetDevResource,                                     \
      (CUgreenCtx hCtx, CUdevResource *resource, CUdevResourceType type))                     \
    X(cuCtxGetDevResource, cuCtxGetDevResource,                                               \
      (CUcontext hCtx, CUdevResource *resource, CUdevResourceType type))                      \
    X(cuGreenCtxStreamCreate, cuGreenCtxStreamCreate,                                         \
      (CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority))

/* Prototypes of the exported symbols, as cuda.h declares them. */
#define CUDA_MIN_PROTOTYPE(base, symbol, params) CUresult symbol params;
CUDA_DRIVER_FUNCTIONS(CUDA_MIN_PROTOTYPE)
CUDA_GRAPH_FUNCTIONS(CUDA_MIN_PROTOTYPE)
CUDA_SHARE_FUNCTIONS(CUDA_MIN_PROTOTYPE)
#undef CUDA_MIN_PROTOTYPE

/* Pointer types by base name, as cudaTypedefs.h names them (PFN_cuMemAlloc). */
#define CUDA_MIN_PFN(base, symbol, params) typedef CUresult (*PFN_##base) params;
CUDA_DRIVER_FUNCTIONS(CUDA_MIN_PFN)
CUDA_GRAPH_FUNCTIONS(CUDA_MIN_PFN)
CUDA_SHARE_FUNCTIONS(CUDA_MIN_PFN)
#undef CUDA_MIN_PFN

/* The entry point through which everything else can be resolved (CUDA >= 12.5 ABI). */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);
typedef CUresult (*PFN_cuGetProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                            cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *symbolStatus);

/* ---- implicit device memory and the pre-3.2 entry points ----
 * Reached only through dlsym or cuGetProcAddress (tests/c/implicit_memory.c), so they
 * are declared as pointer types named as cudaTypedefs.h names them (PFN_<base>_v<version>),
 * not as prototypes. The pre-3.2 ("v1") ABI has 32-bit device pointers and sizes. */
typedef enum CUlimit_enum {
    CU_LIMIT_STACK_SIZE = 0,
    CU_LIMIT_PRINTF_FIFO_SIZE = 1,
    CU_LIMIT_MALLOC_HEAP_SIZE = 2,
    CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH = 3,
    CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT = 4,
    CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 5,
    CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 6,
    CU_LIMIT_SHMEM_SIZE = 7,
    CU_LIMIT_CIG_ENABLED = 8,
    CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED = 9,
    CU_LIMIT_MAX
} CUlimit;

typedef struct CUlib_st *CUlibrary;
typedef unsigned int CUdeviceptr_v1;

typedef struct CUDA_ARRAY_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    unsigned int Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;

CUDA_MIN_ASSERT(sizeof(CUDA_ARRAY_DESCRIPTOR_v1) == 16);
CUDA_MIN_ASSERT(sizeof(CUDA_ARRAY3D_DESCRIPTOR_v1) == 24);

#define CUDA_DLSYM_FUNCTIONS(X)                                                               \
    X(cuCtxGetLimit, 3010, (size_t *pvalue, CUlimit limit))                                   \
    X(cuCtxSetLimit, 3010, (CUlimit limit, size_t value))                                     \
    X(cuCtxCreate, 3020, (CUcontext *pctx, unsigned int flags, CUdevice dev))                 \
    X(cuCtxDestroy, 4000, (CUcontext ctx))                                                    \
    X(cuModuleLoad, 2000, (CUmodule *module, const char *fname))                              \
    X(cuModuleLoadData, 2000, (CUmodule *module, const void *image))                          \
    X(cuModuleLoadDataEx, 2010,                                                               \
      (CUmodule *module, const void *image, unsigned int numOptions, int *options,            \
       void **optionValues))                                                                  \
    X(cuModuleLoadFatBinary, 2000, (CUmodule *module, const void *fatCubin))                  \
    X(cuModuleUnload, 2000, (CUmodule hmod))                                                  \
    X(cuLibraryLoadData, 12000,                                                               \
      (CUlibrary *library, const void *code, int *jitOptions, void **jitOptionsValues,        \
       unsigned int numJitOptions, int *libraryOptions, void **libraryOptionValues,           \
       unsigned int numLibraryOptions))                                                       \
    X(cuLibraryLoadFromFile, 12000,                                                           \
      (CUlibrary *library, const char *fileName, int *jitOptions, void **jitOptionsValues,    \
       unsigned int numJitOptions, int *libraryOptions, void **libraryOptionValues,           \
       unsigned int numLibraryOptions))                                                       \
    X(cuLibraryUnload, 12000, (CUlibrary library))                                            \
    X(cuLibraryGetModule, 12000, (CUmodule *pMod, CUlibrary library))                         \
    X(cuMemAlloc, 2000, (CUdeviceptr_v1 *dptr, unsigned int bytesize))                        \
    X(cuMemAllocPitch, 2000,                                                                  \
      (CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,                 \
       unsigned int Height, unsigned int ElementSizeBytes))                                   \
    X(cuMemFree, 2000, (CUdeviceptr_v1 dptr))                                                 \
    X(cuMemGetInfo, 2000, (unsigned int *free, unsigned int *total))                          \
    X(cuMemGetAddressRange, 2000,                                                             \
      (CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr))                      \
    X(cuDeviceTotalMem, 2000, (unsigned int *bytes, CUdevice dev))                            \
    X(cuCtxCreate, 2000, (CUcontext *pctx, unsigned int flags, CUdevice dev))                 \
    X(cuCtxDestroy, 2000, (CUcontext ctx))                                                    \
    X(cuCtxPushCurrent, 2000, (CUcontext ctx))                                                \
    X(cuCtxPopCurrent, 2000, (CUcontext *pctx))                                               \
    X(cuArrayCreate, 2000, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray)) \
    X(cuArray3DCreate, 2000,                                                                  \
      (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray))                   \
    X(cuMemAllocHost, 2000, (void **pp, unsigned int bytesize))                               \
    X(cuMemcpyHtoD, 2000, (CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount)) \
    X(cuMemcpyDtoH, 2000, (void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount))   \
    X(cuMemcpyDtoD, 2000,                                                                     \
      (CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount))           \
    X(cuMemsetD8, 2000, (CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N))         \
    X(cuMemsetD16, 2000, (CUdeviceptr_v1 dstDevice, unsigned short us, unsigned int N))       \
    X(cuMemsetD32, 2000, (CUdeviceptr_v1 dstDevice, unsigned int ui, unsigned int N))         \
    X(cuDevicePrimaryCtxRelease, 7000, (CUdevice dev))                                        \
    X(cuDevicePrimaryCtxReset, 7000, (CUdevice dev))

#define CUDA_MIN_PFN_VERSIONED(base, version, params) typedef CUresult (*PFN_##base##_v##version) params;
CUDA_DLSYM_FUNCTIONS(CUDA_MIN_PFN_VERSIONED)
#undef CUDA_MIN_PFN_VERSIONED

#ifdef __cplusplus
}
#endif

#endif /* GPUFRAC_CUDA_MIN_H */
