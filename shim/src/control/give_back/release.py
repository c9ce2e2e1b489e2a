# Run by libgpufrac inside the program's own interpreter when the process gives back what
# it keeps (see shim/src/give_back/python.rs), on a thread of the shim's, in a namespace of
# its own. `devices` (the CUDA ordinals this process holds memory on) is set before it.
# It imports nothing the program did not import, empties only memory the frameworks keep
# and do not use, and leaves `summary` (the frameworks emptied, comma-separated) and
# `error` (the first failure, as text; empty if none) for the shim to read.
import sys

released = []
error = ""


def loaded(name):
    """`name` if the program imported it, and is not importing it right now."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


def release_torch(torch):
    cuda = getattr(torch, "cuda", None)
    # Never the one to start CUDA in PyTorch: a program that did not use it keeps nothing.
    if cuda is None or not cuda.is_initialized():
        return False
    # Every allocator setting: the native caching allocator (with or without expandable
    # segments) frees its unused cached blocks; backend:cudaMallocAsync trims its pool.
    cuda.empty_cache()
    return True


def release_cupy(cupy):
    cuda = cupy.cuda
    pools = [cupy.get_default_memory_pool()]
    # The pool behind the program's current allocator (a MemoryPool of its own, or the
    # stream-ordered MemoryAsyncPool), if it is not the default one.
    current = getattr(cuda.get_allocator(), "__self__", None)
    if current is not None and all(current is not p for p in pools) and hasattr(current, "free_all_blocks"):
        pools.append(current)
    # A pool empties the current device's arena only; only devices in use are visited, so
    # that no context is made on another.
    for device in devices:
        with cuda.Device(device):
            for pool in pools:
                pool.free_all_blocks()
    return True


for name, release in (("torch", release_torch), ("cupy", release_cupy)):
    module = loaded(name)
    if module is None:
        continue
    try:
        if release(module):
            released.append(name)
    except BaseException as e:  # noqa: BLE001 - the program must never see it
        if not error:
            error = f"{name}: {type(e).__name__}: {e}"

summary = ",".join(released)
