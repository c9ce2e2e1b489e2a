"""PyTorch (the CUDA 12 wheel, with its own libcudart from nvidia-cuda-runtime-cu12): CUDA
is available, the device and mem_get_info are what the shim shows, tensors made on the
device by copy round-trip, the caching allocator fills to torch.cuda.OutOfMemoryError at
exactly the room and never reserves past it, and empty_cache gives everything back. No
kernels: simgpu runs none, so only tensors made by copy or torch.empty are used."""

import numpy as np
import torch

from common import CHUNK, MIB, ROOM, SHIMMED, TOTAL, fill, pattern, report

assert torch.version.cuda and torch.version.cuda.startswith("12."), torch.version.cuda
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
assert torch.cuda.device_count() == 1, torch.cuda.device_count()
props = torch.cuda.get_device_properties(0)
assert props.total_memory == TOTAL, f"total_memory {props.total_memory} != {TOTAL}"
free, total = torch.cuda.mem_get_info()
assert total == TOTAL and free == ROOM, f"mem_get_info free {free} total {total}"
report("device", name=torch.cuda.get_device_name(0).replace(" ", "_"), total=total, free=free,
       torch=torch.__version__, cuda=torch.version.cuda, shimmed=SHIMMED)

# Tensors made on the device by copy, and back.
data = np.frombuffer(pattern(4 * MIB), dtype=np.uint8).copy()
on_device = torch.from_numpy(data).to("cuda")
assert on_device.is_cuda and on_device.numel() == data.size
assert np.array_equal(on_device.cpu().numpy(), data), "round trip differs"
floats = torch.linspace(-1, 1, 1 << 16, dtype=torch.float64)
assert torch.equal(floats.to("cuda").cpu(), floats), "float64 round trip differs"
pinned = torch.from_numpy(data).pin_memory()
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    async_copy = pinned.to("cuda", non_blocking=True)
    back = async_copy.to("cpu", non_blocking=True)
stream.synchronize()
assert np.array_equal(back.numpy(), data), "round trip on a stream differs"
del on_device, async_copy
report("round-trip", bytes=data.size)

# The caching allocator, to out-of-memory: it frees its cache and retries before it gives
# up, so the error means the device (or the limit) is really full.
torch.cuda.empty_cache()
peak = []


def allocate(n):
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    peak.append(torch.cuda.memory_reserved())
    return t


def out_of_memory(e):
    return isinstance(e, torch.cuda.OutOfMemoryError)


got = fill("caching allocator", allocate, out_of_memory, lambda t: None)
assert max(peak) <= ROOM, f"memory_reserved {max(peak)} beyond the room {ROOM}"
assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() == 0, torch.cuda.memory_reserved()
free, _ = torch.cuda.mem_get_info()
assert free == ROOM, f"after empty_cache: free {free}, room {ROOM}"
report("caching-allocator", bytes=got, reserved=max(peak))

# It still works after the out-of-memory.
again = torch.from_numpy(data).to("cuda")
assert np.array_equal(again.cpu().numpy(), data)
report("done")
