"""Holds CLIENT_HOLD bytes of device memory (cuda-bindings, cuMemAlloc) until its standard
input closes: says `READY <pid> <bytes>` once it holds them, `DONE` once it let go."""

import os
import sys

from cuda.bindings import driver as cu

from common import expected


def check(call, result):
    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        sys.exit(f"holder: {call}: {status!r}")
    return values[0] if values else None


hold = expected("HOLD")
check("cuInit", cu.cuInit(0))
device = check("cuDeviceGet", cu.cuDeviceGet(0))
ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
pointer = check("cuMemAlloc", cu.cuMemAlloc(hold))
print(f"READY {os.getpid()} {hold}", flush=True)
sys.stdin.read()
check("cuMemFree", cu.cuMemFree(pointer))
check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(device))
print("DONE", flush=True)
