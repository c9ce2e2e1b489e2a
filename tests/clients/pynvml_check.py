"""nvidia-ml-py (pynvml), as monitoring tools use it: the device and its memory as the shim
shows them (the slice, with what the group holds as used), and the process lists of every
version, which show the group's own processes (CLIENT_OWN_PIDS) and, under the shim, none
of another tenant's (CLIENT_OTHER_PIDS); the same for per-process utilization samples,
which must show the processes of CLIENT_SAMPLED_PIDS (tenants that ran kernels: bare,
another tenant's among them, so that hiding it under the shim is a check that can fail)."""

import os

import pynvml

from common import TOTAL, pids, report


own, others = pids("CLIENT_OWN_PIDS"), pids("CLIENT_OTHER_PIDS")
must_sample = pids("CLIENT_SAMPLED_PIDS")
held_at_least = int(os.environ.get("CLIENT_HELD_AT_LEAST", "0"))

pynvml.nvmlInit()
assert pynvml.nvmlDeviceGetCount() >= 1
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
name = pynvml.nvmlDeviceGetName(handle)
uuid = pynvml.nvmlDeviceGetUUID(handle)
memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
assert memory.total == TOTAL, f"memory total {memory.total} != {TOTAL}"
assert memory.used + memory.free == memory.total, f"used {memory.used} + free {memory.free} != total"
assert memory.used >= held_at_least, f"used {memory.used} < {held_at_least} held by the group"
v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
assert v2.total == TOTAL, f"memory v2 total {v2.total} != {TOTAL}"
utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
assert 0 <= utilization.gpu <= 100
report("device", name=str(name).replace(" ", "_"), uuid=uuid, total=memory.total, used=memory.used)

queries = {
    "compute": pynvml.nvmlDeviceGetComputeRunningProcesses,
    "graphics": pynvml.nvmlDeviceGetGraphicsRunningProcesses,
    "compute_v2": pynvml.nvmlDeviceGetComputeRunningProcesses_v2,
    "graphics_v2": pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2,
    "compute_v3": pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
    "graphics_v3": pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3,
}
for what, query in queries.items():
    listed = {p.pid for p in query(handle)}
    if what.startswith("compute"):
        assert own <= listed, f"{what}: {sorted(own - listed)} of the group's processes missing from {sorted(listed)}"
    leaked = listed & others
    assert not leaked, f"{what}: another tenant's processes {sorted(leaked)} listed"
    report(what, listed=",".join(map(str, sorted(listed))))
# Per-process utilization (what an arbiter samples for compute shares): the count protocol
# works, no sample is an NVML "not found" (never a count of 0 with success, which pynvml
# takes for an error), and another tenant's samples are not shown under the shim.
try:
    sampled = {s.pid for s in pynvml.nvmlDeviceGetProcessUtilization(handle, 0)}
except pynvml.NVMLError_NotFound:
    sampled = set()
missing = must_sample - sampled
assert not missing, f"process utilization: {sorted(missing)} ran kernels but are not in {sorted(sampled)}"
leaked = sampled & others
assert not leaked, f"process utilization: another tenant's processes {sorted(leaked)} sampled"
report("process_utilization", sampled=",".join(map(str, sorted(sampled))))
pynvml.nvmlShutdown()
report("done")
