"""The CUDA driver API and NVML through ctypes, for the acceptance run's own workloads
(tests/real_gpu/workload.py) and its probes: nothing to install, and the same code on a
real driver and on simgpu (whichever `libcuda.so.1` and `libnvidia-ml.so.1` the loader
finds; under LD_PRELOAD the shim answers the symbols it hooks, as for any program that
loads the driver itself).

The one kernel it launches is `simgpu_noop`: simgpu offers it from any module, and on a
real driver the module is the PTX below, which defines a kernel of that name that does
nothing (the driver compiles PTX for whatever GPU it has).
"""

import ctypes
import os
import time

NOOP_PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry simgpu_noop()
{
    ret;
}
\0"""

OUT_OF_MEMORY = 2


class CudaError(Exception):
    """A driver call that failed: `call` names it, `status` is its CUresult."""

    def __init__(self, call, status, name):
        super().__init__(f"{call}: {name} ({status})")
        self.call, self.status, self.name = call, status, name


class Driver:
    """The driver loaded by soname, with the calls the workloads make checked."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ctx = None

    def name_of(self, status):
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {status}"

    def call(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CudaError(name, status, self.name_of(status))

    def init(self):
        """cuInit and device 0's primary context, made current."""
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), 0)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.dev, self.ctx = dev, ctx
        return self

    def mem_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, size):
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value

    def free(self, ptr):
        self.call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def host_alloc(self, size):
        """Pinned host memory (cuMemAllocHost): what a copy of a plain process's data
        to host RAM goes into, the yardstick for swap and wake times."""
        ptr = ctypes.c_void_p()
        self.call("cuMemAllocHost_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value

    def host_free(self, ptr):
        self.call("cuMemFreeHost", ctypes.c_void_p(ptr))

    def to_device(self, dst, data, size):
        """Copies `size` bytes of `data` (bytes) to device address `dst`."""
        self.call("cuMemcpyHtoD_v2", ctypes.c_uint64(dst), ctypes.c_char_p(data), ctypes.c_size_t(size))

    def to_host(self, dst_host, src, size):
        self.call("cuMemcpyDtoH_v2", ctypes.c_void_p(dst_host), ctypes.c_uint64(src), ctypes.c_size_t(size))

    def sync(self):
        self.call("cuCtxSynchronize")

    def noop_kernel(self):
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(NOOP_PTX))
        self.call("cuModuleGetFunction", ctypes.byref(func), module, b"simgpu_noop")
        return func

    def launch(self, func):
        self.call("cuLaunchKernel", func, 1, 1, 1, 1, 1, 1, 0, None, None, None)


def pattern_block(seed, size=1 << 20):
    """`size` bytes that differ from position to position and from seed to seed."""
    base = bytes((i * 7 + seed * 13 + 3) & 0xFF for i in range(256))
    return (base * (size // 256 + 1))[:size]


class Nvml:
    """NVML, unshimmed in the acceptance driver: the device's own figures."""

    class Process(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self, path="libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(path)
        self._check("nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check("nvmlDeviceGetHandleByIndex_v2", 0, ctypes.byref(self.handle))

    def _check(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name}: NVML error {status}")

    def _text(self, name, *args):
        buf = ctypes.create_string_buffer(96)
        self._check(name, *args, buf, ctypes.c_uint(96))
        return buf.value.decode()

    def gpu_name(self):
        return self._text("nvmlDeviceGetName", self.handle)

    def driver_version(self):
        return self._text("nvmlSystemGetDriverVersion")

    def cuda_version(self):
        v = ctypes.c_int()
        self._check("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(v))
        return f"{v.value // 1000}.{v.value % 1000 // 10}"

    def memory(self):
        m = Nvml.Memory()
        self._check("nvmlDeviceGetMemoryInfo", self.handle, ctypes.byref(m))
        return m.total, m.used

    def processes(self):
        """{pid: bytes} as the device counts them."""
        procs = (Nvml.Process * 256)()
        count = ctypes.c_uint(256)
        self._check("nvmlDeviceGetComputeRunningProcesses_v3", self.handle, ctypes.byref(count), procs)
        return {p.pid: p.used for p in procs[: count.value]}

    def process_bytes(self, pid):
        return self.processes().get(pid, 0)


def now():
    return time.monotonic()


def env_size(name, default):
    value = os.environ.get(name)
    return int(value) if value else default
