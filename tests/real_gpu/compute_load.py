"""A GPU flood for checking compute shares on a real GPU: bf16 matrix products in a loop,
synchronizing every 8, for --warmup then --seconds; prints one JSON line with the
products per second over the measured seconds. Needs PyTorch with CUDA.

    python3 compute_load.py --seconds 10 --warmup 3 [--size 4096]
"""
import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, required=True)
parser.add_argument("--warmup", type=float, default=3.0)
parser.add_argument("--size", type=int, default=4096)
args = parser.parse_args()
if not (0 < args.seconds <= 600 and 0 <= args.warmup <= 600 and 64 <= args.size <= 32768):
    sys.exit("compute_load.py: --seconds in (0, 600], --warmup in [0, 600], --size in [64, 32768]")

import torch  # noqa: E402  (after the argument check: importing takes seconds)

a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)


def run(seconds):
    done, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        done += 8
    return done


run(args.warmup)
start = time.monotonic()
done = run(args.seconds)
print(json.dumps({"pid": os.getpid(), "products_per_s": done / (time.monotonic() - start)}), flush=True)
