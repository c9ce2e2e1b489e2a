"""PyTorch under the shim, for the acceptance run's `pytorch` section (accept.py runs it
with the shim preloaded, request = limit = --limit): each case in a process of its own
(the allocator's configuration is read once per process), each in a group of its own so
that no case's context counts against another's.

    torch_accept.py --limit BYTES --context BYTES     (the orchestrator; starts no CUDA)
    torch_accept.py --limit BYTES --context BYTES --case default|expandable|async|graph

Prints one `CHECK {json}` line per check (name, status pass|fail, numbers, detail). The
room is the limit less the context measured bare on this device (--context): the caching
allocator must fill to `torch.OutOfMemoryError` within two chunks of it and never past it.
"""

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20
CHUNK = 256 * MIB
# Slack above the room: the bare probe's context included PyTorch's first 2 MiB block.
SLACK = 64 * MIB


def say(name, ok, detail="", **numbers):
    print("CHECK " + json.dumps({"name": name, "status": "pass" if ok else "fail", "detail": detail, "numbers": numbers}), flush=True)


def fill(torch, room, label):
    held = []
    try:
        while len(held) * CHUNK < 4 * room + 4 * CHUNK:
            held.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
        say(f"{label}: fills to torch.OutOfMemoryError", False, "never ran out of memory", got=len(held) * CHUNK)
        return None
    except torch.OutOfMemoryError:
        got = len(held) * CHUNK
        reserved = torch.cuda.memory_reserved()
        ok = room - 2 * CHUNK < got <= room + SLACK
        say(f"{label}: fills to torch.OutOfMemoryError at the limit less the context", ok,
            "" if ok else "not within two chunks of the room", got=got, room=room, reserved=reserved)
        return got
    finally:
        del held[:]
        torch.cuda.empty_cache()


def recover(torch, room, label):
    """After the out-of-memory error: the room again, and a kernel computing on it."""
    try:
        x = torch.empty(room // 2, dtype=torch.uint8, device="cuda")
        x.fill_(3)
        total = int(x[: 1 << 20].to(torch.int64).sum().item())
        ok = total == 3 * (1 << 20)
        say(f"{label}: the allocator recovers after the out-of-memory error", ok, "" if ok else f"sum {total}",
            allocated=room // 2)
        del x
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 (whatever PyTorch raises is the finding)
        say(f"{label}: the allocator recovers after the out-of-memory error", False, f"{type(e).__name__}: {e}")


def case_default(torch, limit, context):
    room = limit - context
    free, total = torch.cuda.mem_get_info()
    say("torch.cuda.mem_get_info shows the slice", total == limit and abs(free - room) <= SLACK,
        f"free {free} total {total}", free=free, total=total, limit=limit, room=room)
    props = torch.cuda.get_device_properties(0).total_memory
    say("get_device_properties().total_memory is the slice", props == limit, total_memory=props, limit=limit)
    fill(torch, room, "default allocator")
    recover(torch, room, "default allocator")


def case_variant(torch, limit, context, label):
    room = limit - context
    fill(torch, room, label)
    recover(torch, room, label)


def case_graph(torch, limit, context):
    room = limit - context
    n = (1 << 30) // 4
    src = torch.ones(n, device="cuda")
    free_before, _ = torch.cuda.mem_get_info()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        src * 2  # warm-up outside capture, as PyTorch asks
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(g):
        out = src * 2 + 1  # 1 GiB allocated inside the capture, from the graph's pool
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    value = float(out[:1024].sum().item())
    free_after, _ = torch.cuda.mem_get_info()
    ok = value == 3.0 * 1024 and free_before - free_after >= (1 << 30)
    say("a CUDA graph with 1 GiB allocated inside its capture replays, its pool counted", ok,
        f"sum {value}", pool_counted=free_before - free_after)
    # What is left, taken by a second capture: past the limit it fails cleanly.
    big = (room - 2 * (1 << 30)) // 4 + (512 * MIB) // 4
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2):
            torch.empty(big, device="cuda").fill_(1)
        say("a capture allocating past the limit is refused", False, "the capture got more than the limit leaves",
            asked=big * 4)
    except Exception as e:  # noqa: BLE001
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        say("a capture allocating past the limit is refused with out-of-memory", oom, f"{type(e).__name__}",
            asked=big * 4)
    try:
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        say("the first graph still replays afterwards", float(out[:1024].sum().item()) == 3.0 * 1024)
    except Exception as e:  # noqa: BLE001
        say("the first graph still replays afterwards", False, f"{type(e).__name__}: {e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--case")
    a = p.parse_args()
    if not (0 < a.context < a.limit):
        p.error("--context must be positive and below --limit")
    if a.case is None:
        failed = 0
        cases = {"default": "", "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync", "graph": ""}
        for case, conf in cases.items():
            env = dict(os.environ, GPUFRAC_GROUP=os.environ.get("GPUFRAC_GROUP", "torch") + "-" + case)
            if conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            r = subprocess.run([sys.executable, __file__, "--limit", str(a.limit), "--context", str(a.context), "--case", case], env=env, timeout=120)
            if r.returncode != 0:
                say(f"case {case} ran to its end", False, f"exit {r.returncode}")
                failed += 1
        sys.exit(1 if failed else 0)
    import torch

    torch.cuda.init()
    if a.case == "default":
        case_default(torch, a.limit, a.context)
    elif a.case == "expandable":
        case_variant(torch, a.limit, a.context, "expandable_segments:True")
    elif a.case == "async":
        case_variant(torch, a.limit, a.context, "backend:cudaMallocAsync")
    else:
        case_graph(torch, a.limit, a.context)


if __name__ == "__main__":
    main()
