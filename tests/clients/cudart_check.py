"""NVIDIA's CUDA runtime, libcudart 12 from the PyPI wheel nvidia-cuda-runtime-cu12, through
ctypes: it initialises on the driver (cudaFree(0), which goes through the driver's private
export tables), sees the device as the shim shows it, allocates to exactly its room with
cudaMalloc and with the stream-ordered cudaMallocAsync, round-trips data with cudaMemcpy
both ways (synchronous, on streams, device to device), times with events, and comes back
after cudaDeviceReset."""

import ctypes
import glob
import os

import nvidia

from common import CHUNK, MIB, ROOM, TOTAL, fill, pattern, report

# The wheel's runtime: nvidia/cuda_runtime/lib/libcudart.so.12 (CUDA 12, pinned in
# tests/requirements.txt), or nvidia/cu13/lib/libcudart.so.13 where CUDA 13's wheel is
# installed instead (the GPU image of the acceptance run).
CANDIDATES = ["cuda_runtime/lib/libcudart.so.12", "cu13/lib/libcudart.so.13", "*/lib/libcudart.so.1[2-9]"]
FOUND = [hit for base in nvidia.__path__ for c in CANDIDATES for hit in sorted(glob.glob(os.path.join(base, c)))]
assert FOUND, f"no libcudart under {list(nvidia.__path__)}"
LIB = FOUND[0]
rt = ctypes.CDLL(LIB)
rt.cudaGetErrorName.restype = ctypes.c_char_p
rt.cudaGetErrorString.restype = ctypes.c_char_p

SUCCESS = 0
MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
NOT_READY = 600  # cudaErrorNotReady
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind


class RuntimeError_(Exception):
    def __init__(self, call, status):
        name = rt.cudaGetErrorName(status).decode()
        super().__init__(f"{call}: {status} {name}: {rt.cudaGetErrorString(status).decode()}")
        self.status = status


def check(call, status):
    if status != SUCCESS:
        raise RuntimeError_(call, status)


def out_of_memory(e):
    return isinstance(e, RuntimeError_) and e.status == MEMORY_ALLOCATION


def last_error_is_clear():
    """The runtime keeps the last error per thread: an out-of-memory that was handled
    must not poison the next call."""
    rt.cudaGetLastError()
    assert rt.cudaGetLastError() == SUCCESS


# Initialisation: the call every framework makes first.
check("cudaFree(0)", rt.cudaFree(None))
driver, runtime = ctypes.c_int(), ctypes.c_int()
check("cudaDriverGetVersion", rt.cudaDriverGetVersion(ctypes.byref(driver)))
check("cudaRuntimeGetVersion", rt.cudaRuntimeGetVersion(ctypes.byref(runtime)))
assert runtime.value // 1000 == 12, f"runtime {runtime.value}"
count = ctypes.c_int()
check("cudaGetDeviceCount", rt.cudaGetDeviceCount(ctypes.byref(count)))
assert count.value == 1, f"cudaGetDeviceCount {count.value}"
check("cudaSetDevice", rt.cudaSetDevice(0))
current = ctypes.c_int(-1)
check("cudaGetDevice", rt.cudaGetDevice(ctypes.byref(current)))
assert current.value == 0
report("runtime", driver=driver.value, runtime=runtime.value, devices=count.value)

# The device as the runtime reports it: cudaDeviceGetAttribute and cudaMemGetInfo.
major, sms = ctypes.c_int(), ctypes.c_int()
check("cudaDeviceGetAttribute", rt.cudaDeviceGetAttribute(ctypes.byref(major), 75, 0))
check("cudaDeviceGetAttribute", rt.cudaDeviceGetAttribute(ctypes.byref(sms), 16, 0))
assert major.value >= 7 and sms.value > 0, (major.value, sms.value)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check("cudaMemGetInfo", rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
assert total.value == TOTAL and free.value == ROOM, f"cudaMemGetInfo free {free.value} total {total.value}"
report("device", total=total.value, free=free.value, major=major.value)


def malloc(n):
    p = ctypes.c_void_p()
    check("cudaMalloc", rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)))
    return p


got = fill("cudaMalloc", malloc, out_of_memory, lambda p: check("cudaFree", rt.cudaFree(p)))
last_error_is_clear()
report("cudaMalloc", bytes=got)

# Round trips: host -> device -> device -> host, synchronous and on a stream.
n = 4 * MIB
data = pattern(n)
src = ctypes.create_string_buffer(data, n)
back = ctypes.create_string_buffer(n)
a, b = malloc(n), malloc(n)
check("cudaMemcpy H2D", rt.cudaMemcpy(a, src, ctypes.c_size_t(n), H2D))
check("cudaMemcpy D2D", rt.cudaMemcpy(b, a, ctypes.c_size_t(n), D2D))
check("cudaMemcpy D2H", rt.cudaMemcpy(back, b, ctypes.c_size_t(n), D2H))
assert back.raw == data, "cudaMemcpy round trip differs"
check("cudaMemset", rt.cudaMemset(a, 0x5A, ctypes.c_size_t(n)))
check("cudaMemcpy D2H", rt.cudaMemcpy(back, a, ctypes.c_size_t(n), D2H))
assert back.raw == b"\x5a" * n, "cudaMemset did not reach the host"
report("cudaMemcpy", bytes=n)

stream = ctypes.c_void_p()
check("cudaStreamCreate", rt.cudaStreamCreate(ctypes.byref(stream)))
start, end = ctypes.c_void_p(), ctypes.c_void_p()
check("cudaEventCreate", rt.cudaEventCreate(ctypes.byref(start)))
check("cudaEventCreate", rt.cudaEventCreate(ctypes.byref(end)))
pinned = ctypes.c_void_p()
check("cudaMallocHost", rt.cudaMallocHost(ctypes.byref(pinned), ctypes.c_size_t(n)))
ctypes.memmove(pinned, data, n)
check("cudaEventRecord", rt.cudaEventRecord(start, stream))
check("cudaMemcpyAsync H2D", rt.cudaMemcpyAsync(b, pinned, ctypes.c_size_t(n), H2D, stream))
ctypes.memset(back, 0, n)
check("cudaMemcpyAsync D2H", rt.cudaMemcpyAsync(back, b, ctypes.c_size_t(n), D2H, stream))
check("cudaEventRecord", rt.cudaEventRecord(end, stream))
check("cudaEventSynchronize", rt.cudaEventSynchronize(end))
check("cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))
check("cudaStreamQuery", rt.cudaStreamQuery(stream))
check("cudaEventQuery", rt.cudaEventQuery(end))
ms = ctypes.c_float(-1)
check("cudaEventElapsedTime", rt.cudaEventElapsedTime(ctypes.byref(ms), start, end))
assert ms.value >= 0, ms.value
assert back.raw == data, "cudaMemcpyAsync round trip differs"
check("cudaFreeHost", rt.cudaFreeHost(pinned))
check("cudaFree", rt.cudaFree(a))
check("cudaFree", rt.cudaFree(b))
report("streams", bytes=n, elapsed_ms=f"{ms.value:.3f}")


# Stream-ordered allocation from the device's default pool.
def malloc_async(size):
    p = ctypes.c_void_p()
    check("cudaMallocAsync", rt.cudaMallocAsync(ctypes.byref(p), ctypes.c_size_t(size), stream))
    check("cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))
    return p


def free_async(p):
    check("cudaFreeAsync", rt.cudaFreeAsync(p, stream))
    check("cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))


got = fill("cudaMallocAsync", malloc_async, out_of_memory, free_async)
last_error_is_clear()
report("cudaMallocAsync", bytes=got)
p = malloc_async(n)
check("cudaMemcpyAsync H2D", rt.cudaMemcpyAsync(p, src, ctypes.c_size_t(n), H2D, stream))
ctypes.memset(back, 0, n)
check("cudaMemcpyAsync D2H", rt.cudaMemcpyAsync(back, p, ctypes.c_size_t(n), D2H, stream))
check("cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))
assert back.raw == data, "round trip through pool memory differs"
free_async(p)
check("cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
check("cudaMemGetInfo", rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
assert free.value == ROOM, f"after the pool emptied: free {free.value}, room {ROOM}"

check("cudaEventDestroy", rt.cudaEventDestroy(start))
check("cudaEventDestroy", rt.cudaEventDestroy(end))
check("cudaStreamDestroy", rt.cudaStreamDestroy(stream))

# cudaDeviceReset ends the primary context (through cuDevicePrimaryCtxReset's CUDA 7.0
# version); the runtime must come back on a new one, and under the shim the old
# context's memory must not stay charged: the room is whole again.
check("cudaDeviceReset", rt.cudaDeviceReset())
p = malloc(n)
check("cudaMemcpy H2D", rt.cudaMemcpy(p, src, ctypes.c_size_t(n), H2D))
ctypes.memset(back, 0, n)
check("cudaMemcpy D2H", rt.cudaMemcpy(back, p, ctypes.c_size_t(n), D2H))
assert back.raw == data, "round trip after cudaDeviceReset differs"
check("cudaFree", rt.cudaFree(p))
check("cudaMemGetInfo", rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
assert total.value == TOTAL and free.value == ROOM, f"after reset: free {free.value} total {total.value}"
report("reset")
report("done")
