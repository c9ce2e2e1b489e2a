"""What every client check shares: the expectations the Rust test passes in the
environment, and the fill-to-out-of-memory rule every allocation path is held to."""

import os
import sys

MIB = 1 << 20
GIB = 1 << 30


def expected(name):
    """A byte count the test passes as CLIENT_<name>."""
    value = os.environ.get("CLIENT_" + name)
    if value is None:
        sys.exit(f"CLIENT_{name} is not set: run this through tests/tests/real_clients.rs")
    return int(value)


# The device size the client must see: the physical size bare, the limit under the shim.
TOTAL = expected("TOTAL")
# What one process can hold at most: TOTAL less its context.
ROOM = expected("ROOM")
# The step a fill allocates by.
CHUNK = expected("CHUNK")
# Whether the client runs under the shim.
SHIMMED = bool(os.environ.get("LD_PRELOAD"))


def pids(variable):
    """The PIDs the test passes as a comma list in `variable` (CLIENT_OWN_PIDS: the
    group's own processes, CLIENT_OTHER_PIDS: another tenant's), as a set; empty if unset."""
    return {int(p) for p in os.environ.get(variable, "").split(",") if p}


def report(what, **values):
    """One line the Rust test reads: `OK <what> key=value ...`."""
    fields = " ".join(f"{k}={v}" for k, v in values.items())
    print(f"OK {what} {fields}".rstrip(), flush=True)


def fill(path, allocate, is_out_of_memory, free, chunk=None):
    """Allocates `chunk` at a time with `allocate()` until the client reports out of
    memory, checks the process got all of its room (less than two chunks short, never
    more), frees everything with `free(handle)`, and returns the bytes it got."""
    chunk = chunk or CHUNK
    held = []
    try:
        for _ in range(4 * TOTAL // chunk + 4):
            try:
                held.append(allocate(chunk))
            except Exception as e:  # the client's own out-of-memory error type
                if not is_out_of_memory(e):
                    raise
                break
        else:
            raise AssertionError(f"{path}: never ran out of memory")
        got = len(held) * chunk
        assert got <= ROOM, f"{path}: got {got >> 20} MiB, more than the {ROOM >> 20} MiB room"
        assert got > ROOM - 2 * chunk, f"{path}: got only {got >> 20} MiB of {ROOM >> 20} MiB"
        return got
    finally:
        for h in held:
            free(h)


def pattern(n):
    """`n` bytes that differ from position to position, for round trips."""
    return bytes((i * 7 + 3) & 0xFF for i in range(n))
