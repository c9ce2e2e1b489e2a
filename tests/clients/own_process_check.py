"""A process under the shim in a PID namespace of its own (as in a container) holds
CLIENT_HOLD bytes and looks itself up in NVML's process lists (pynvml): the driver lists
processes by their PIDs on the host, and the shim shows the group's own by the PIDs they
know themselves by, so the process finds itself, with what it holds, and nothing else."""

import os
import sys

import pynvml
from cuda.bindings import driver as cu

from common import expected, report


def check(call, result):
    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        sys.exit(f"{call}: {status!r}")
    return values[0] if values else None


hold = expected("HOLD")
check("cuInit", cu.cuInit(0))
device = check("cuDeviceGet", cu.cuDeviceGet(0))
ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
pointer = check("cuMemAlloc", cu.cuMemAlloc(hold))

pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
me = os.getpid()
for name, query in [
    ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
    ("compute_v2", pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
    ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
]:
    listed = {p.pid: p.usedGpuMemory for p in query(handle)}
    if name == "graphics":
        assert not listed, f"{name}: {listed}"
        continue
    assert set(listed) == {me}, f"{name}: pid {me} (in its namespace) expected alone, got {listed}"
    assert listed[me] >= hold, f"{name}: {listed[me]} bytes listed for {hold} held"
    report(name, pid=me, used=listed[me])
pynvml.nvmlShutdown()
check("cuMemFree", cu.cuMemFree(pointer))
report("done")
