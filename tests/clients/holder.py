"""Holds CLIENT_HOLD bytes of device memory (cuda-bindings, cuMemAlloc) until its standard
input closes: says `READY <pid> <bytes>` once it holds them, `DONE` once it let go."""

import os
import sys

from common import expected
from driver import hold, release

size = expected("HOLD")
held = hold(size)
print(f"READY {os.getpid()} {size}", flush=True)
sys.stdin.read()
release(held)
print("DONE", flush=True)
