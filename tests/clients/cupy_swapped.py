"""CuPy arrays that the swap resolver moves to host RAM and back: CLIENT_PIECES arrays of
CLIENT_PIECE bytes each, made through CuPy's memory pool (cudaMalloc, which the CUDA
runtime reaches through cuGetProcAddress) and filled with a pattern of their own. Says
`READY <pid> <bytes>` and `PTRS <address>,...` once they are filled; on `check` (a line on
standard input) reads every array back and says `INTACT <bytes> PTRS <address>,...` if
each holds its pattern (else `CORRUPT <index>`); ends with `OK done` when standard input
closes. No kernels: simgpu runs none, so copies and sets alone move the data."""

import os
import sys

import cupy
import numpy as np

PIECE = int(os.environ["CLIENT_PIECE"])
PIECES = int(os.environ["CLIENT_PIECES"])


def pattern(index):
    """The bytes of array `index`: a different sequence for each, so that two arrays
    swapped back in each other's place would not pass."""
    return ((np.arange(PIECE, dtype=np.uint32) * 7 + index * 13) % 251).astype(np.uint8)


def addresses(arrays):
    return ",".join(hex(a.data.ptr) for a in arrays)


cupy.cuda.Device(0).use()
arrays = []
for i in range(PIECES):
    a = cupy.empty(PIECE, dtype=np.uint8)
    a.set(pattern(i))
    arrays.append(a)
cupy.cuda.runtime.deviceSynchronize()
print(f"READY {os.getpid()} {PIECE * PIECES}", flush=True)
print(f"PTRS {addresses(arrays)}", flush=True)

for line in sys.stdin:
    if line.strip() != "check":
        sys.exit(f"unknown command {line.strip()!r}: only `check`")
    corrupt = next((i for i, a in enumerate(arrays) if not np.array_equal(a.get(), pattern(i))), None)
    if corrupt is None:
        print(f"INTACT {PIECE * PIECES} PTRS {addresses(arrays)}", flush=True)
    else:
        print(f"CORRUPT {corrupt}", flush=True)

del arrays
cupy.get_default_memory_pool().free_all_blocks()
print("OK done", flush=True)
