"""numba-cuda: the device as numba reports it, device arrays filled to the limit, and a
host <-> device round trip of a NumPy array."""

import contextlib
import io

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

from common import CHUNK, ROOM, TOTAL, fill, report

assert cuda.is_available(), "numba sees no CUDA device"
with contextlib.redirect_stdout(io.StringIO()) as listing:
    assert cuda.detect(), "cuda.detect() found no supported device"
assert "[SUPPORTED]" in listing.getvalue(), listing.getvalue()
context = cuda.current_context()
free, total = context.get_memory_info()
assert total == TOTAL, f"total {total} != {TOTAL}"
assert free <= ROOM, f"free {free} > room {ROOM}"
report("device", name=str(cuda.get_current_device().name).replace(" ", "_"), total=total)


def out_of_memory(e):
    return isinstance(e, CudaAPIError) and "OUT_OF_MEMORY" in str(e)


got = fill("device_array", lambda n: cuda.device_array(n, dtype=np.uint8), out_of_memory, lambda a: None)
# numba frees arrays when they are collected, in batches: make sure they are gone.
context.deallocations.clear()
report("device_array", bytes=got)
got = fill("device_array again", lambda n: cuda.device_array(n, dtype=np.uint8), out_of_memory, lambda a: None)
context.deallocations.clear()
report("device_array-again", bytes=got)

host = np.arange(1 << 18, dtype=np.uint32)
on_device = cuda.to_device(host)
back = on_device.copy_to_host()
assert np.array_equal(host, back), "round trip changed the data"
report("round-trip", bytes=host.nbytes)
assert CHUNK and ROOM
report("done")
