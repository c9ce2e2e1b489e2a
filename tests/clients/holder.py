"""Holds CLIENT_HOLD bytes of device memory (cuda-bindings, cuMemAlloc) until its standard
input closes: says `READY <pid> <bytes>` once it holds them (and, with CLIENT_BUSY_US, has
kept the device busy that many microseconds with simgpu's built-in kernel, so that it has
utilization samples), `DONE` once it let go."""

import os
import sys

from common import expected
from driver import hold, keep_busy, release

size = expected("HOLD")
held = hold(size)
if os.environ.get("CLIENT_BUSY_US"):
    keep_busy(expected("BUSY_US"))
print(f"READY {os.getpid()} {size}", flush=True)
sys.stdin.read()
release(held)
print("DONE", flush=True)
