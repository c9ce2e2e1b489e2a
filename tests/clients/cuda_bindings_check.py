"""NVIDIA's cuda-bindings (the driver API as Python sees it): the device and its memory
as the shim shows them, every allocation path to the limit, a pool that keeps its memory
after a free (it must not lend a way past the limit), and a host <-> device round trip."""

import ctypes

from cuda.bindings import driver as cu

from common import CHUNK, ROOM, SHIMMED, TOTAL, fill, pattern, report

OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class DriverError(Exception):
    def __init__(self, call, status):
        super().__init__(f"{call}: {status!r}")
        self.status = status


def check(call, result):
    """Unpacks a cuda-bindings answer `(status, value...)`, raising on an error."""
    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        raise DriverError(call, status)
    return values[0] if len(values) == 1 else tuple(values)


def out_of_memory(e):
    return isinstance(e, DriverError) and e.status == OOM


check("cuInit", cu.cuInit(0))
assert check("cuDeviceGetCount", cu.cuDeviceGetCount()) >= 1
device = check("cuDeviceGet", cu.cuDeviceGet(0))
name = check("cuDeviceGetName", cu.cuDeviceGetName(64, device))
total = check("cuDeviceTotalMem", cu.cuDeviceTotalMem(device))
assert total == TOTAL, f"cuDeviceTotalMem {total} != {TOTAL}"
ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
free, total = check("cuMemGetInfo", cu.cuMemGetInfo())
assert total == TOTAL and free == ROOM, f"cuMemGetInfo free {free} total {total}"
report("device", name=name.split(b"\0")[0].decode(), total=total)

stream = check("cuStreamCreate", cu.cuStreamCreate(0))


def sync():
    check("cuStreamSynchronize", cu.cuStreamSynchronize(stream))


# Linear, managed and pitched memory.
got = fill("cuMemAlloc", lambda n: check("cuMemAlloc", cu.cuMemAlloc(n)), out_of_memory,
           lambda p: check("cuMemFree", cu.cuMemFree(p)))
report("cuMemAlloc", bytes=got)
got = fill("cuMemAllocManaged",
           lambda n: check("cuMemAllocManaged",
                           cu.cuMemAllocManaged(n, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)),
           out_of_memory, lambda p: check("cuMemFree", cu.cuMemFree(p)))
report("cuMemAllocManaged", bytes=got)
got = fill("cuMemAllocPitch",
           lambda n: check("cuMemAllocPitch", cu.cuMemAllocPitch(n // 4096, 4096, 4))[0],
           out_of_memory, lambda p: check("cuMemFree", cu.cuMemFree(p)))
report("cuMemAllocPitch", bytes=got)

# Stream-ordered memory from the device's pool, with the release threshold at the most (as
# cuda-core, PyTorch and RAPIDS set it), so that the pool keeps everything after a free.
pool = check("cuDeviceGetDefaultMemPool", cu.cuDeviceGetDefaultMemPool(device))
threshold = cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)
check("cuMemPoolSetAttribute", cu.cuMemPoolSetAttribute(
    pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold))


def pooled_free(p):
    check("cuMemFreeAsync", cu.cuMemFreeAsync(p, stream))
    sync()


def pooled_alloc(n):
    p = check("cuMemAllocAsync", cu.cuMemAllocAsync(n, stream))
    sync()
    return p




def pool_keeps(path, got, pools):
    """After a fill and free the pools keep what was freed, and the device says so. Bare,
    the program must trim them itself to use that memory elsewhere; under the shim the
    shim trims them when the limit is reached, so the program does not."""
    free, _ = check("cuMemGetInfo", cu.cuMemGetInfo())
    assert free <= ROOM - got + CHUNK, f"{path}: {free >> 20} MiB free while its pool keeps {got >> 20} MiB"
    if not SHIMMED:
        for p in pools:
            check("cuMemPoolTrimTo", cu.cuMemPoolTrimTo(p, 0))


got = fill("cuMemAllocAsync", pooled_alloc, out_of_memory, pooled_free)
report("cuMemAllocAsync", bytes=got)
pool_keeps("cuMemAllocAsync", got, [pool])
# The pool keeps what was freed: the limit must still hold for every other path...
got = fill("cuMemAlloc after a pool was filled and freed",
           lambda n: check("cuMemAlloc", cu.cuMemAlloc(n)), out_of_memory,
           lambda p: check("cuMemFree", cu.cuMemFree(p)))
report("cuMemAlloc-after-pool", bytes=got)

# ... and for pools the program makes itself, several at once.
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
pools = [check("cuMemPoolCreate", cu.cuMemPoolCreate(props)) for _ in range(3)]
for p in pools:
    check("cuMemPoolSetAttribute", cu.cuMemPoolSetAttribute(
        p, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold))
for i, p in enumerate(pools):
    def from_pool(n, p=p):
        q = check("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync(n, p, stream))
        sync()
        return q
    got = fill(f"cuMemAllocFromPoolAsync (pool {i})", from_pool, out_of_memory, pooled_free)
    report(f"cuMemAllocFromPoolAsync-{i}", bytes=got)
    pool_keeps(f"cuMemAllocFromPoolAsync (pool {i})", got, [p])
for p in pools:
    check("cuMemPoolDestroy", cu.cuMemPoolDestroy(p))

# Virtual memory management: physical memory made with cuMemCreate, mapped into a range.
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
granularity = check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
assert CHUNK % granularity == 0
got = fill("cuMemCreate", lambda n: check("cuMemCreate", cu.cuMemCreate(n, prop, 0)),
           out_of_memory, lambda h: check("cuMemRelease", cu.cuMemRelease(h)))
report("cuMemCreate", bytes=got)

# A round trip through device memory, with pageable and page-locked host memory.
size = 1 << 20
data = pattern(size)
dptr = check("cuMemAlloc", cu.cuMemAlloc(size))
src = ctypes.create_string_buffer(data, size)
check("cuMemcpyHtoD", cu.cuMemcpyHtoD(dptr, src, size))
back = ctypes.create_string_buffer(size)
check("cuMemcpyDtoH", cu.cuMemcpyDtoH(back, dptr, size))
assert back.raw == data, "pageable round trip changed the data"
pinned = check("cuMemAllocHost", cu.cuMemAllocHost(size))
ctypes.memset(pinned, 0, size)
check("cuMemcpyAsync", cu.cuMemcpyAsync(pinned, dptr, size, stream))
sync()
assert ctypes.string_at(pinned, size) == data, "pinned round trip changed the data"
check("cuMemFreeHost", cu.cuMemFreeHost(pinned))
check("cuMemFree", cu.cuMemFree(dptr))
report("round-trip", bytes=size)

check("cuStreamDestroy", cu.cuStreamDestroy(stream))
check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(device))
report("done")
