"""CuPy (cupy-cuda12x, its own copy of NVIDIA's CUDA runtime inside): the device and its
memory as the shim shows them, arrays through CuPy's memory pool and through the
stream-ordered pool (cudaMallocAsync) until CuPy's OutOfMemoryError, and host <-> device
round trips, plain, on a stream with pinned memory and on threads' per-thread default
streams. No kernels: simgpu runs none, so
only what CuPy does with copies and memsets (asarray, get, zeros, set) is used."""

import threading

import cupy
import numpy as np

from common import CHUNK, MIB, ROOM, SHIMMED, TOTAL, fill, pattern, report

runtime = cupy.cuda.runtime
assert runtime.getDeviceCount() == 1, runtime.getDeviceCount()
assert runtime.runtimeGetVersion() // 1000 == 12, runtime.runtimeGetVersion()
device = cupy.cuda.Device(0)
device.use()
props = runtime.getDeviceProperties(0)
assert props["totalGlobalMem"] == TOTAL, f"totalGlobalMem {props['totalGlobalMem']} != {TOTAL}"
assert props["major"] >= 7 and props["multiProcessorCount"] > 0, props
free, total = device.mem_info
assert total == TOTAL and free == ROOM, f"mem_info free {free} total {total}"
report("device", name=props["name"].decode(), total=total, free=free,
       compute_capability=device.compute_capability, runtime=runtime.runtimeGetVersion(),
       driver=runtime.driverGetVersion(), shimmed=SHIMMED)

# Round trips.
data = np.frombuffer(pattern(4 * MIB), dtype=np.uint8)
on_device = cupy.asarray(data)
assert on_device.nbytes == data.nbytes
assert np.array_equal(on_device.get(), data), "asarray/get round trip differs"
floats = np.linspace(-1, 1, 1 << 16, dtype=np.float64)
assert np.array_equal(cupy.asnumpy(cupy.asarray(floats)), floats), "float64 round trip differs"
zeros = cupy.zeros(1 << 20, dtype=np.int32)  # a memset on the device
assert not zeros.get().any(), "cupy.zeros is not zero"
copy = cupy.empty_like(on_device)
copy.data.copy_from_device(on_device.data, on_device.nbytes)  # device to device
assert np.array_equal(copy.get(), data), "device-to-device copy differs"
zeros.set(np.arange(1 << 20, dtype=np.int32))
assert np.array_equal(zeros.get(), np.arange(1 << 20, dtype=np.int32)), "set/get differs"
del on_device, zeros, copy
report("round-trip", bytes=data.nbytes)

# On a stream, from and to pinned host memory, timed with events.
stream = cupy.cuda.Stream(non_blocking=True)
start, end = cupy.cuda.Event(), cupy.cuda.Event()
pinned = cupy.cuda.alloc_pinned_memory(data.nbytes)
host = np.frombuffer(pinned, dtype=np.uint8, count=data.nbytes)
host[:] = data
with stream:
    start.record()
    a = cupy.empty(data.shape, dtype=np.uint8)
    a.set(host, stream=stream)
    stream.synchronize()  # the copy reads `host` when the stream gets to it
    host[:] = 0
    a.get(stream=stream, out=host)
    end.record()
end.synchronize()
stream.synchronize()
assert stream.done and end.done
assert np.array_equal(host, data), "round trip on a stream differs"
elapsed = cupy.cuda.get_elapsed_time(start, end)
assert elapsed >= 0, elapsed
del a
report("stream", bytes=data.nbytes, elapsed_ms=f"{elapsed:.3f}")


# On threads' per-thread default streams (CU_STREAM_PER_THREAD): six threads one after
# another, then three at once, each ending after its round trip (under a compute share,
# more threads than the shim bounds, whose bounds go back as they end).
def per_thread_round_trip(seed, results):
    ptds = cupy.cuda.Stream.ptds
    want = np.full(1 << 20, seed, dtype=np.uint8)
    with ptds:
        x = cupy.empty(want.shape, dtype=np.uint8)
        x.set(want, stream=ptds)
        got = x.get(stream=ptds)
        ptds.synchronize()
    results[seed] = np.array_equal(got, want)


per_thread = {}
for seed in range(6):
    t = threading.Thread(target=per_thread_round_trip, args=(seed, per_thread))
    t.start()
    t.join()
together = [threading.Thread(target=per_thread_round_trip, args=(seed, per_thread)) for seed in range(6, 9)]
for t in together:
    t.start()
for t in together:
    t.join()
assert per_thread == {seed: True for seed in range(9)}, per_thread
report("per-thread", threads=len(per_thread))


def out_of_memory(e):
    return isinstance(e, cupy.cuda.memory.OutOfMemoryError)


# CuPy's default memory pool, to out-of-memory: CuPy frees its cached blocks and retries
# before it gives up, so the error means the device (or the limit) is really full.
pool = cupy.get_default_memory_pool()
pool.free_all_blocks()


def allocate(n):
    return cupy.empty(n, dtype=np.uint8)


def release(array):
    """Nothing to do: the array goes back to its pool when fill() drops it."""


got = fill("MemoryPool", allocate, out_of_memory, release)
assert pool.used_bytes() == 0, pool.used_bytes()
assert pool.total_bytes() >= got, (pool.total_bytes(), got)
# The pool keeps what it got; the device shows it as used until the pool lets go.
free, _ = device.mem_info
assert free <= ROOM - got + CHUNK, f"free {free} while the pool holds {pool.total_bytes()}"
pool.free_all_blocks()
free, _ = device.mem_info
assert free == ROOM, f"after free_all_blocks: free {free}, room {ROOM}"
report("MemoryPool", bytes=got)

# After the fill, the pool still works: an array that fits round-trips.
big = cupy.asarray(data)
assert np.array_equal(big.get(), data)
del big
pool.free_all_blocks()

# The stream-ordered pool (cudaMallocAsync), which CuPy offers as MemoryAsyncPool.
async_pool = cupy.cuda.MemoryAsyncPool()
cupy.cuda.set_allocator(async_pool.malloc)
try:
    got = fill("MemoryAsyncPool", allocate, out_of_memory, release)
    runtime.deviceSynchronize()
    a = cupy.asarray(data)
    assert np.array_equal(a.get(), data), "round trip through cudaMallocAsync memory differs"
    del a
    async_pool.free_all_blocks()
    runtime.deviceSynchronize()
finally:
    cupy.cuda.set_allocator(pool.malloc)
free, _ = device.mem_info
assert free == ROOM, f"after the async pool emptied: free {free}, room {ROOM}"
report("MemoryAsyncPool", bytes=got)
report("done")
