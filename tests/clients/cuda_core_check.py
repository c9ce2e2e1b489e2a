"""NVIDIA's cuda-core (the Pythonic layer over the driver): the device as the shim shows
it, each memory resource it offers filled to the limit, its pools (which keep memory after
a free, release threshold at the most) never a way past it, and a round trip through
page-locked host memory."""

import ctypes

from cuda.bindings import driver as cu
from cuda.core import (
    Device,
    DeviceMemoryResource,
    DeviceMemoryResourceOptions,
    LegacyPinnedMemoryResource,
    VirtualMemoryResource,
    VirtualMemoryResourceOptions,
)

from common import CHUNK, ROOM, SHIMMED, TOTAL, fill, pattern, report

device = Device()
device.set_current()
stream = device.create_stream()


def free_and_total():
    status, free, total = cu.cuMemGetInfo()
    assert status == cu.CUresult.CUDA_SUCCESS, status
    return free, total


free, total = free_and_total()
assert total == TOTAL, f"total {total} != {TOTAL}"
report("device", name=device.name.replace(" ", "_"), total=total, uuid=device.uuid)


def out_of_memory(e):
    return "CUDA_ERROR_OUT_OF_MEMORY" in str(e)


def release(buffer):
    buffer.close(stream)
    stream.sync()


def fill_resource(path, resource):
    def allocate(n):
        buffer = resource.allocate(n, stream=stream)
        stream.sync()
        return buffer

    return fill(path, allocate, out_of_memory, release)


def pool_keeps(path, got, resource):
    """The pool keeps what was freed, and the device says so; bare, the program trims it
    itself to use the memory elsewhere, under the shim the shim does it."""
    free, _ = free_and_total()
    assert free <= ROOM - got + CHUNK, f"{path}: {free >> 20} MiB free while its pool keeps {got >> 20} MiB"
    if not SHIMMED:
        assert cu.cuMemPoolTrimTo(resource.handle, 0)[0] == cu.CUresult.CUDA_SUCCESS


# The device's own pool (what device.allocate uses), then pools of their own.
default = device.memory_resource
got = fill_resource("device.allocate", device)
report("device.allocate", bytes=got)
pool_keeps("device.allocate", got, default)
owned = [DeviceMemoryResource(device, DeviceMemoryResourceOptions()) for _ in range(2)]
# cuda-core leaves its own pools' release threshold at 0 (they give memory back at a
# synchronize); frameworks raise it to the maximum, as for the device's pool.
for resource in owned:
    keep_all = cu.cuuint64_t(2**64 - 1)
    threshold = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    assert cu.cuMemPoolSetAttribute(resource.handle, threshold, keep_all)[0] == cu.CUresult.CUDA_SUCCESS
for i, resource in enumerate(owned):
    got = fill_resource(f"DeviceMemoryResource {i}", resource)
    report(f"DeviceMemoryResource-{i}", bytes=got)
    pool_keeps(f"DeviceMemoryResource {i}", got, resource)
for resource in owned:
    resource.close()

# ManagedMemoryResource needs CUDA 13 bindings in cuda-core 1.2 (these are 12.9):
# managed memory is checked through cuda-bindings (cuMemAllocManaged) instead.
vmm = VirtualMemoryResource(device, VirtualMemoryResourceOptions())
got = fill_resource("VirtualMemoryResource", vmm)
report("VirtualMemoryResource", bytes=got)

# Host -> device -> device -> host, through page-locked host memory.
size = 1 << 20
data = pattern(size)
pinned = LegacyPinnedMemoryResource()
src = pinned.allocate(size, stream=stream)
dst = pinned.allocate(size, stream=stream)
ctypes.memmove(int(src.handle), data, size)
ctypes.memset(int(dst.handle), 0, size)
on_device = device.allocate(size, stream=stream)
on_device.copy_from(src, stream=stream)
second = on_device.copy_to(stream=stream)
second.copy_to(dst, stream=stream)
stream.sync()
assert ctypes.string_at(int(dst.handle), size) == data, "round trip changed the data"
for b in (src, dst, on_device, second):
    b.close(stream)
stream.sync()
report("round-trip", bytes=size)
report("done")
