"""The driver API through cuda-bindings, for the checks that only need memory held: each
call checked (a failure ends the check with the call's name and status), and a block held
in the device's primary context."""

import ctypes
import sys

from cuda.bindings import driver as cu


def check(call, result):
    """The values of a cuda-bindings `result`, or the end of the check if it failed."""
    status, *values = result
    if status != cu.CUresult.CUDA_SUCCESS:
        sys.exit(f"{call}: {status!r}")
    return values[0] if values else None


def hold(size):
    """Allocates `size` bytes on device 0 in its primary context; returns what `release`
    takes to give them back."""
    check("cuInit", cu.cuInit(0))
    device = check("cuDeviceGet", cu.cuDeviceGet(0))
    ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    return device, check("cuMemAlloc", cu.cuMemAlloc(size))


def release(held):
    """Frees what `hold` allocated and releases the primary context."""
    device, pointer = held
    check("cuMemFree", cu.cuMemFree(pointer))
    check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(device))


def keep_busy(microseconds):
    """Runs simgpu's built-in `simgpu_sleep_us` kernel for `microseconds` of device time in
    the current context and waits for it: the process then has utilization samples (only
    on simgpu, whose modules all offer its built-in kernels)."""
    module = check("cuModuleLoadData", cu.cuModuleLoadData(b"simgpu built-in kernels\0"))
    function = check("cuModuleGetFunction", cu.cuModuleGetFunction(module, b"simgpu_sleep_us"))
    params = ((microseconds,), (ctypes.c_ulonglong,))
    check("cuLaunchKernel", cu.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, 0, params, 0))
    check("cuCtxSynchronize", cu.cuCtxSynchronize())
    check("cuModuleUnload", cu.cuModuleUnload(module))
