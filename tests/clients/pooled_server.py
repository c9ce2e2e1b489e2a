"""An inference server written as people write them: its framework (CLIENT_FRAMEWORK,
`cupy` or `torch`) keeps freed memory in its pool, and nothing in this file empties it
(no `free_all_blocks`, no `empty_cache`). With CLIENT_ALLOCATOR=async a CuPy server
allocates from CUDA's stream-ordered pool (`cupy.cuda.MemoryAsyncPool`), which keeps
what is freed into it the same way. It loads a model of CLIENT_MODEL bytes with a
pattern of its own and says `READY <pid> <model bytes>`, then `LOADED seconds=<s>` (how
long the model took to load; `alloc`: of that, the wait for its memory); then, one command per line on
standard input:
- `batch <bytes>`: takes a batch of that many zeroed bytes, reads one back, drops it, and
  says `SERVED <bytes> start=<s> alloc=<s> end=<s>` (wall-clock seconds; `alloc`: how
  long its memory took) or `OOM <bytes> start=<s>
  end=<s> <why>`;
- `check`: reads the model back: `INTACT <bytes>` or `CORRUPT`.
Ends with `OK done` when standard input closes."""

import os
import sys
import time

import numpy as np

FRAMEWORK = os.environ.get("CLIENT_FRAMEWORK", "cupy")
MODEL = int(os.environ["CLIENT_MODEL"])

if FRAMEWORK == "cupy":
    import cupy

    if os.environ.get("CLIENT_ALLOCATOR") == "async":
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)

    def to_device(array, host):
        array.set(host)

    def empty(size):
        return cupy.empty(size, dtype=np.uint8)

    def zero(array):
        array.data.memset_async(0, array.size)

    def to_host(array):
        return array.get()

    def synchronize():
        cupy.cuda.runtime.deviceSynchronize()

    OOM = (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError)
elif FRAMEWORK == "torch":
    import torch

    def to_device(array, host):
        array.copy_(torch.from_numpy(host))

    def empty(size):
        return torch.empty(size, dtype=torch.uint8, device="cuda")

    def zero(array):
        array.zero_()

    def to_host(array):
        return array.cpu().numpy()

    def synchronize():
        torch.cuda.synchronize()

    OOM = (torch.cuda.OutOfMemoryError, RuntimeError)
else:
    sys.exit(f"CLIENT_FRAMEWORK={FRAMEWORK!r}: expected cupy or torch")

# A cycle of 251 bytes: no two pages alike, and cheap to make for a model of GiBs.
PATTERN = np.resize(np.arange(3, 254, dtype=np.uint8), MODEL)
loading = time.time()
model = empty(MODEL)
allocated = time.time()
to_device(model, PATTERN)
synchronize()
print(f"READY {os.getpid()} {MODEL}", flush=True)
print(f"LOADED alloc={allocated - loading:.6f} seconds={time.time() - loading:.6f}", flush=True)

for line in sys.stdin:
    words = line.split()
    if words[:1] == ["batch"] and len(words) == 2:
        size = int(words[1])
        start = time.time()
        try:
            batch = empty(size)
            allocated = time.time()
            zero(batch)
            last = int(to_host(batch[-1:])[0])
            del batch
            synchronize()
            end = time.time()
            print(f"SERVED {size} start={start:.6f} alloc={allocated - start:.6f} end={end:.6f} last={last}", flush=True)
        except OOM as e:
            why = str(e).replace("\n", " ")
            print(f"OOM {size} start={start:.6f} end={time.time():.6f} {why}", flush=True)
    elif words == ["check"]:
        intact = np.array_equal(to_host(model), PATTERN)
        print(f"INTACT {MODEL}" if intact else "CORRUPT", flush=True)
    else:
        sys.exit(f"unknown command {line.strip()!r}: batch <bytes> or check")

print("OK done", flush=True)
