"""The acceptance run's workloads (tests/real_gpu/accept.py starts them, bare or under the
shim), through the driver API by ctypes (cudrv.py: the same code on a real GPU and on
simgpu) or, for the bursty server, through PyTorch's caching allocator:

    workload.py bursty --backend driver|torch --base BYTES --burst BYTES --step BYTES
                       --step-ms MS --hold-ms MS --bursts N --gap-ms MIN-MAX --seed N
    workload.py hold --bytes BYTES --seed N [--no-fill]
    workload.py cost --pairs N --launches N

bursty: `READY`, then per burst `BURST <i> ok wait_ms=<ms>` or `BURST <i> oom <error>`
(what it got is freed), then `DONE bursts=<n> ok=<k> oom=<m>`.
hold (--no-fill: only holds the memory, says READY, and waits for the end of input): holds BYTES in 256 MiB blocks written with a pattern, times a copy of them all into
pinned host memory (the yardstick for a swap or a wake), prints `READY pinned_ms=<ms>`,
then obeys stdin: `check` reads everything back (`INTACT first_ms=<ms> all_ms=<ms>`, the
first call's time including any wake or swap-in, or `CORRUPT <block>`); end of input
ends it.
cost: `COST alloc_free_ns=<ns> launch_ns=<ns>`, each the quickest of 20 chunks' mean.
Every line is flushed; a failed set-up prints `FAILED <what>` on stderr and exits 3.
"""

import argparse
import random
import sys
import time

import cudrv

BLOCK = 256 << 20


def out(line):
    print(line, flush=True)


def fail(what):
    print(f"FAILED {what}", file=sys.stderr, flush=True)
    sys.exit(3)


class DriverBackend:
    def __init__(self):
        self.d = cudrv.Driver().init()

    def alloc(self, n):
        return self.d.alloc(n)

    def free(self, p):
        self.d.free(p)

    def is_oom(self, e):
        return isinstance(e, cudrv.CudaError) and e.status == cudrv.OUT_OF_MEMORY

    def release(self):
        pass


class TorchBackend:
    """A PyTorch server as people write one: tensors from the caching allocator, which
    keeps what each burst frees; the shim empties that cache when a neighbour needs the
    memory (docs/shim.md, "What frameworks keep, given back")."""

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.empty(1, device="cuda")

    def alloc(self, n):
        return self.torch.empty(n, dtype=self.torch.uint8, device="cuda")

    def free(self, t):
        del t

    def is_oom(self, e):
        return isinstance(e, self.torch.OutOfMemoryError)

    def release(self):
        # No empty_cache(): the server keeps its pool, as servers do.
        self.torch.cuda.synchronize()


def bursty(a):
    lo, hi = (int(x) for x in a.gap_ms.split("-"))
    rng = random.Random(a.seed)
    try:
        backend = TorchBackend() if a.backend == "torch" else DriverBackend()
        base = [backend.alloc(a.base)]
    except Exception as e:  # noqa: BLE001 (the set-up's error, whatever the backend)
        fail(f"init {e}")
    out("READY")
    ok = oom = 0
    for i in range(a.bursts):
        time.sleep(rng.uniform(lo, hi) / 1000)
        held, start, paused = [], time.monotonic(), 0.0
        try:
            while len(held) * a.step < a.burst:
                held.append(backend.alloc(a.step))
                if a.step_ms:
                    time.sleep(a.step_ms / 1000)
                    paused += a.step_ms / 1000
            out(f"BURST {i} ok wait_ms={(time.monotonic() - start - paused) * 1000:.1f}")
            ok += 1
            time.sleep(a.hold_ms / 1000)
        except Exception as e:  # noqa: BLE001
            if not backend.is_oom(e):
                raise
            out(f"BURST {i} oom {type(e).__name__}")
            oom += 1
        for h in held:
            backend.free(h)
        held.clear()
        backend.release()
    del base
    out(f"DONE bursts={a.bursts} ok={ok} oom={oom}")


def hold(a):
    try:
        d = cudrv.Driver().init()
        blocks = []
        left = a.bytes
        while left > 0:
            n = min(BLOCK, left)
            blocks.append((d.alloc(n), n))
            left -= n
        if a.no_fill:
            out(f"READY bytes={a.bytes}")
            sys.stdin.read()
            return
        pinned = d.host_alloc(BLOCK)
        for j, (p, n) in enumerate(blocks):
            data = cudrv.pattern_block(a.seed + j, n)
            d.to_device(p, data, n)
        d.sync()
        start = time.monotonic()
        for p, n in blocks:
            d.to_host(pinned, p, n)
        pinned_ms = (time.monotonic() - start) * 1000
    except cudrv.CudaError as e:
        fail(f"hold {e}")
    out(f"READY pinned_ms={pinned_ms:.1f} bytes={a.bytes}")
    for line in sys.stdin:
        if line.strip() != "check":
            continue
        start = time.monotonic()
        first = None
        bad = None
        try:
            for j, (p, n) in enumerate(blocks):
                d.to_host(pinned, p, n)
                if first is None:
                    first = time.monotonic() - start
                got = (ctypes_bytes(pinned, n))
                if got != cudrv.pattern_block(a.seed + j, n):
                    bad = j
                    break
        except cudrv.CudaError as e:
            out(f"ERROR {e}")
            continue
        all_ms = (time.monotonic() - start) * 1000
        out(f"CORRUPT {bad}" if bad is not None else f"INTACT first_ms={first * 1000:.1f} all_ms={all_ms:.1f}")
    for p, _ in blocks:
        d.free(p)
    d.host_free(pinned)


def ctypes_bytes(address, n):
    import ctypes

    return ctypes.string_at(address, n)


def cost(a):
    d = cudrv.Driver().init()
    func = d.noop_kernel()
    d.free(d.alloc(1 << 20))

    def quickest(op, n):
        chunk = max(1, n // 20)
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter_ns()
            for _ in range(chunk):
                op()
            best = min(best, (time.perf_counter_ns() - start) / chunk)
        return best

    pair = quickest(lambda: d.free(d.alloc(1 << 20)), a.pairs)
    launch = quickest(lambda: d.launch(func), a.launches)
    d.sync()
    out(f"COST alloc_free_ns={pair:.0f} launch_ns={launch:.0f}")


def main():
    p = argparse.ArgumentParser(prog="workload.py")
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bursty")
    b.add_argument("--backend", choices=["driver", "torch"], default="driver")
    for name in ("base", "burst", "step"):
        b.add_argument(f"--{name}", type=int, required=True)
    b.add_argument("--step-ms", type=float, default=0)
    b.add_argument("--hold-ms", type=float, default=300)
    b.add_argument("--bursts", type=int, default=5)
    b.add_argument("--gap-ms", default="100-500")
    b.add_argument("--seed", type=int, default=1)
    h = sub.add_parser("hold")
    h.add_argument("--bytes", type=int, required=True)
    h.add_argument("--seed", type=int, default=1)
    h.add_argument("--no-fill", action="store_true", help="only hold the memory (no data, no checks)")
    c = sub.add_parser("cost")
    c.add_argument("--pairs", type=int, default=20000)
    c.add_argument("--launches", type=int, default=20000)
    a = p.parse_args()
    if a.what == "bursty" and min(a.base, a.burst, a.step) < 4096:
        p.error("--base, --burst and --step must be at least 4096 bytes")
    if a.what == "hold" and a.bytes < 4096:
        p.error("--bytes must be at least 4096")
    {"bursty": bursty, "hold": hold, "cost": cost}[a.what](a)


if __name__ == "__main__":
    main()
