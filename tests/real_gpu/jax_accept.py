"""JAX under the shim, for the acceptance run's `jax` section (accept.py runs it with the
shim preloaded, request = limit = --limit): XLA's preallocation is a fraction of the
device it is shown, so it must take 75% of the slice (not of the GPU), and
XLA_PYTHON_CLIENT_MEM_FRACTION is relative to the slice too; an allocation past the pool
fails with XLA's own error and the process carries on. Each case runs in a process of
its own (XLA reads its configuration once), in a group of its own.

    jax_accept.py --limit BYTES --context BYTES [--case default|fraction]

Prints one `CHECK {json}` line per check.
"""

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20


def say(name, ok, detail="", **numbers):
    print("CHECK " + json.dumps({"name": name, "status": "pass" if ok else "fail", "detail": detail, "numbers": numbers}), flush=True)


def pool():
    import jax
    import jax.numpy as jnp

    jnp.ones(16).block_until_ready()
    stats = jax.devices()[0].memory_stats() or {}
    return jax, jnp, stats.get("bytes_limit", -1)


def near(value, expected):
    """Within 2% (XLA rounds its pool to its own granularity)."""
    return abs(value - expected) <= 0.02 * expected


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--case")
    a = p.parse_args()
    if a.case is None:
        failed = 0
        for case in ("default", "fraction"):
            env = dict(os.environ, GPUFRAC_GROUP=os.environ.get("GPUFRAC_GROUP", "jax") + "-" + case)
            env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
            env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
            if case == "fraction":
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ".5"
            r = subprocess.run([sys.executable, __file__, "--limit", str(a.limit), "--context", str(a.context), "--case", case], env=env, timeout=100)
            if r.returncode != 0:
                say(f"case {case} ran to its end", False, f"exit {r.returncode}")
                failed += 1
        sys.exit(1 if failed else 0)
    jax, jnp, limit = pool()
    if a.case == "default":
        say("default preallocation: 75% of the slice", near(limit, 0.75 * a.limit),
            bytes_limit=limit, slice=a.limit, expected=int(0.75 * a.limit))
        return
    say("XLA_PYTHON_CLIENT_MEM_FRACTION=.5: half the slice", near(limit, 0.5 * a.limit),
        bytes_limit=limit, slice=a.limit, expected=int(0.5 * a.limit))
    held, chunk, error = [], 256 * MIB, None
    try:
        for _ in range(4 * a.limit // chunk):
            held.append(jnp.zeros((chunk,), dtype=jnp.uint8).block_until_ready())
    except Exception as e:  # noqa: BLE001 (XLA's error type moves between versions)
        error = e
    got = len(held) * chunk
    clean = error is not None and "RESOURCE_EXHAUSTED" in str(error)
    say("an allocation past the pool fails with RESOURCE_EXHAUSTED", clean and got <= limit,
        "" if clean else f"{type(error).__name__}: {str(error)[:200]}" if error else "never failed", got=got, bytes_limit=limit)
    del held[:]
    try:
        value = int(jnp.arange(1000).sum())
        say("JAX computes after the failure", value == 499500, value=value)
    except Exception as e:  # noqa: BLE001
        say("JAX computes after the failure", False, f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
