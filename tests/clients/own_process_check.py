"""A process under the shim in a PID namespace of its own (as in a container) holds
CLIENT_HOLD bytes and looks itself up in NVML's process lists (pynvml): the driver lists
processes by their PIDs on the host, and the shim shows the group's own by the PIDs they
know themselves by, so the process finds itself, with what it holds, and nothing else."""

import os

import pynvml

from common import expected, report
from driver import hold, release

size = expected("HOLD")
held = hold(size)

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
    assert listed[me] >= size, f"{name}: {listed[me]} bytes listed for {size} held"
    report(name, pid=me, used=listed[me])
pynvml.nvmlShutdown()
release(held)
report("done")
