"""The acceptance run (tests/real_gpu/accept.sh drives it): every promise of gpufrac
checked in one go on a real GPU, or on simgpu with the same code, sections sized from what
the device measures (its contexts, never assumed). Python's standard library only: it
runs under the GPU image's python3 and CI's alike; the workloads it starts run under
--python (the one with the frameworks).

    accept.py --mode real|simgpu --bin DIR --python PYTHON OUT_DIR

Writes OUT_DIR/report.json and OUT_DIR/report.md; exits 1 if a section failed. Sections
never stop the run: one that fails or raises is recorded, and the next one runs.
"""

import argparse
import datetime
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import cudrv  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
# The managed size every contended scenario runs on (`--gpu-memory`), whatever the GPU.
MANAGED = 16 * GIB
SECTIONS = ["limits", "pytorch", "jax", "escapes", "collisions", "parking", "compute", "cost"]


def mib(n):
    return f"{n / MIB:.0f} MiB"


class Check:
    def __init__(self, name, status, detail="", **numbers):
        self.name, self.status, self.detail, self.numbers = name, status, detail, numbers

    def json(self):
        return {"name": self.name, "status": self.status, "detail": self.detail, "numbers": self.numbers}


class Section:
    def __init__(self, name):
        self.name, self.checks, self.why, self.seconds = name, [], None, 0.0

    def check(self, name, ok, detail="", **numbers):
        self.checks.append(Check(name, "pass" if ok else "fail", detail, **numbers))
        return ok

    def skip(self, name, why):
        self.checks.append(Check(name, "skip", why))

    @property
    def status(self):
        states = {c.status for c in self.checks}
        if "fail" in states:
            return "fail"
        if "pass" in states:
            return "pass"
        return "skip"

    def json(self):
        why = self.why
        if self.status == "skip" and not why:
            why = "; ".join(c.detail for c in self.checks if c.detail) or "nothing ran"
        return {
            "name": self.name,
            "status": self.status,
            "seconds": round(self.seconds, 1),
            "checks": [c.json() for c in self.checks],
            **({"why": why} if why else {}),
        }


class Proc:
    """A child whose stdout lines are read by a thread, every wait bounded."""

    def __init__(self, argv, env, log_path, stdin=True):
        self.argv = argv
        self.err = open(log_path, "wb")
        self.log_path = log_path
        self.p = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.err,
            cwd=HERE,
            start_new_session=True,
        )
        self.lines = queue.Queue()
        self.all = []
        self.eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.all.append(line)
            self.lines.put(line)
        self.lines.put(None)

    @property
    def pid(self):
        return self.p.pid

    def next(self, timeout):
        """The next line, or None at the end of output (every call after it too) or at
        the timeout."""
        if self.eof:
            return None
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        self.eof = line is None
        return line

    def expect(self, prefix, timeout):
        """The next line starting with `prefix`, or None at exit or timeout."""
        end = time.monotonic() + timeout
        while True:
            line = self.next(max(0.01, end - time.monotonic()))
            if line is None or line.startswith(prefix):
                return line
            if time.monotonic() >= end:
                return None

    def send(self, text):
        try:
            self.p.stdin.write(text.encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close(self):
        if self.p.stdin:
            try:
                self.p.stdin.close()
            except OSError:
                pass

    def wait(self, timeout):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait()

    def stderr(self, last=600):
        self.err.flush()
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-last:]
        except OSError:
            return ""


def numbers_of(line):
    """{key: float} of the `key=value` words of a line."""
    found = {}
    for word in (line or "").split():
        key, _, value = word.partition("=")
        try:
            found[key] = float(value)
        except ValueError:
            pass
    return found


class Run:
    def __init__(self, args):
        self.mode, self.bin, self.python = args.mode, os.path.abspath(args.bin), args.python
        # A rehearsal runs on simgpu but takes every choice the real-GPU run takes (the
        # frameworks run wherever they are installed).
        self.rehearse = args.rehearse
        self.simulated_only = self.mode == "simgpu" and not self.rehearse
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpufrac-accept-")
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.children = []
        self.arbiters = []
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFRAC_") and k != "LD_PRELOAD"}
        self.base_env["PYTHONUNBUFFERED"] = "1"
        self.base_env["PYTHONPATH"] = HERE
        if self.mode == "simgpu":
            self._simgpu()
        else:
            self.base_env = {k: v for k, v in self.base_env.items() if not k.startswith("SIMGPU_")}
        self.nvml = cudrv.Nvml(self.nvml_path)
        self.shim = os.path.join(self.bin, "libgpufrac.so")

    def _simgpu(self):
        libs = os.path.join(self.work, "lib")
        os.makedirs(libs)
        for link, target in [
            ("libcuda.so", "libsimgpu_cuda.so"),
            ("libcuda.so.1", "libsimgpu_cuda.so"),
            ("libnvidia-ml.so", "libsimgpu_nvml.so"),
            ("libnvidia-ml.so.1", "libsimgpu_nvml.so"),
        ]:
            source = os.path.join(self.simgpu_dir, target)
            if not os.path.exists(source):
                sys.exit(f"accept: {source} is missing: build the workspace (cargo build --workspace)")
            os.symlink(source, os.path.join(libs, link))
        self.base_env["LD_LIBRARY_PATH"] = libs + ":" + self.base_env.get("LD_LIBRARY_PATH", "")
        self.base_env["SIMGPU_STATE"] = os.path.join(self.work, "simgpu-state")
        self.base_env["SIMGPU_DEVICES"] = "16GiB"
        self.base_env.pop("SIMGPU_CONTEXT_OVERHEAD", None)
        # The driver process reads the simulated NVML too.
        os.environ.update({k: self.base_env[k] for k in ("SIMGPU_STATE", "SIMGPU_DEVICES")})
        self.libs = libs

    @property
    def simgpu_dir(self):
        return os.environ.get("ACCEPT_SIMGPU_DIR") or self.bin

    @property
    def nvml_path(self):
        return os.path.join(self.libs, "libnvidia-ml.so.1") if self.mode == "simgpu" else "libnvidia-ml.so.1"

    def binary(self, name):
        path = os.path.join(self.bin, name)
        return path if os.path.exists(path) else None

    # --- processes -----------------------------------------------------------------

    def env(self, shim=None, **extra):
        """The environment of a workload: bare, or with `shim` ({"MEMORY_REQUEST": ..., ...},
        each key a GPUFRAC_ variable without its prefix) under the shim."""
        env = dict(self.base_env)
        if shim is not None:
            env["LD_PRELOAD"] = self.shim
            for key, value in shim.items():
                env["GPUFRAC_" + key] = str(value)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def spawn(self, name, argv, env, stdin=True):
        log = os.path.join(self.logs, f"{name}-{len(self.children)}.err")
        p = Proc(argv, env, log, stdin)
        self.children.append(p)
        return p

    def py(self, name, script_and_args, env, stdin=True):
        return self.spawn(name, [self.python] + script_and_args, env, stdin)

    def run_py(self, name, script_and_args, env, timeout):
        """Runs a Python program to its end: (exit status or None on timeout, stdout lines,
        stderr tail)."""
        p = self.py(name, script_and_args, env, stdin=False)
        code = p.wait(timeout)
        time.sleep(0.05)
        return code, list(p.all), p.stderr(2000)

    def importable(self, modules):
        code = subprocess.run(
            [self.python, "-c", f"import {modules}"], env=self.env(), capture_output=True, timeout=120
        ).returncode
        return code == 0

    def arbiter(self, name, *args):
        socket = os.path.join(self.work, f"{name}.sock")
        argv = [os.path.join(self.bin, "gpufrac-arbiter"), "--socket", socket]
        if self.gpu_memory_flag:
            argv += ["--gpu-memory", str(MANAGED)]
        argv += list(args)
        env = self.env(GPUFRAC_LOG="info")
        p = self.spawn(f"arbiter-{name}", argv, env, stdin=False)
        for _ in range(200):
            if os.path.exists(socket) or p.p.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.exists(socket):
            raise RuntimeError(f"the arbiter did not start: {p.stderr()}")
        p.socket = socket
        self.arbiters.append(p)
        return p

    def status(self, arbiter):
        out = subprocess.run(
            [os.path.join(self.bin, "gpufrac"), "status", "--socket", arbiter.socket, "--json"],
            env=self.env(),
            capture_output=True,
            timeout=20,
        )
        doc = json.loads(out.stdout or b"{}")
        return doc.get("status", doc)

    def stop_all(self):
        for p in self.children:
            p.close()
            p.kill()
        self.children.clear()
        self.arbiters.clear()

    # --- the device ------------------------------------------------------------------

    def context_of(self, name, code):
        """What a context takes on this device, measured: a bare process runs `code`
        (which makes its context), says READY, and the device's own count of that process
        (NVML) is read while it holds it."""
        snippet = code + "\nimport sys\nprint('READY', flush=True)\nsys.stdin.read()\n"
        p = self.py(f"context-{name}", ["-c", snippet], self.env())
        line = p.expect("READY", 180)
        used = self.nvml.process_bytes(p.pid) if line else 0
        p.close()
        p.wait(30)
        if not line:
            raise RuntimeError(f"the {name} context probe failed: {p.stderr()}")
        return used

    def probe(self):
        self.gpu_name = self.nvml.gpu_name()
        self.driver = self.nvml.driver_version()
        try:
            self.cuda = self.nvml.cuda_version()
        except RuntimeError:
            self.cuda = "unknown"
        self.total, _ = self.nvml.memory()
        self.context = self.context_of("driver", "import cudrv; cudrv.Driver().init()")
        help_text = subprocess.run(
            [os.path.join(self.bin, "gpufrac-arbiter"), "--help"], capture_output=True, env=self.env()
        ).stdout.decode(errors="replace")
        self.gpu_memory_flag = "--gpu-memory" in help_text


# --- sections --------------------------------------------------------------------------


def client_checks(run, s):
    """The clients' checks of tests/clients/ under the shim, their room the limit less
    their own context as measured bare on this device."""
    clients = [
        ("cuda-bindings", "cuda.bindings.driver", "cuda_bindings_check.py", "from cuda.bindings import driver as cu; cu.cuInit(0); d=cu.cuDeviceGet(0)[1]; c=cu.cuDevicePrimaryCtxRetain(d)[1]; cu.cuCtxSetCurrent(c)"),
        ("CuPy", "cupy", "cupy_check.py", "import cupy; cupy.cuda.runtime.memGetInfo()"),
        ("numba", "numba.cuda", "numba_check.py", "from numba import cuda; cuda.current_context()"),
        ("libcudart", CUDART, "cudart_check.py", "import cudrv; cudrv.Driver().init()"),
    ]
    limit = 4 * GIB
    chunk = 256 * MIB
    for name, module, script, context_code in clients:
        if not run.importable(module):
            s.skip(name, f"{'libcudart (a wheel of nvidia-cuda-runtime)' if module == CUDART else module} is not installed for {run.python}")
            continue
        try:
            context = run.context_of(name, context_code)
        except RuntimeError as e:
            s.check(name, False, str(e))
            continue
        env = run.env(
            {"MEMORY_REQUEST": limit // 2, "MEMORY_LIMIT": limit, "GROUP": f"limits-{script}"},
            CLIENT_TOTAL=limit,
            CLIENT_ROOM=limit - context,
            CLIENT_CHUNK=chunk,
        )
        env["PYTHONPATH"] = os.path.join(ROOT, "tests", "clients") + ":" + HERE
        code, lines, err = run.run_py(f"limits-{name}", [os.path.join(ROOT, "tests", "clients", script)], env, 240)
        fills = {l.split()[1]: numbers_of(l).get("bytes") for l in lines if l.startswith("OK ") and "bytes=" in l}
        ok = code == 0 and lines[-1:] == ["OK done"] and "Traceback" not in err
        s.check(
            name,
            ok,
            "" if ok else f"exit {code}; {(lines[-1:] or [''])[0]} {err[-400:]}",
            limit=limit,
            context=context,
            room=limit - context,
            **{f"filled_{k}": int(v) for k, v in fills.items() if v is not None},
        )


# What `importable` runs to learn whether cudart_check.py finds a runtime (its own search).
CUDART = "nvidia, glob, os; assert [h for b in nvidia.__path__ for c in ('cuda_runtime/lib/libcudart.so.12', 'cu13/lib/libcudart.so.13', '*/lib/libcudart.so.1[2-9]') for h in glob.glob(os.path.join(b, c))]"


def limits(run, s):
    """Through the driver API by ctypes (always there), then each client."""
    limit = run.context + 1 * GIB
    env = run.env({"MEMORY_REQUEST": limit, "MEMORY_LIMIT": limit, "GROUP": "limits-driver"})
    code = (
        "import cudrv\nd = cudrv.Driver().init()\nfree, total = d.mem_info()\n"
        "held = []\nwhile True:\n"
        "    try: held.append(d.alloc(64 << 20))\n"
        "    except cudrv.CudaError as e:\n"
        "        print('FILLED', len(held) * (64 << 20), e.status, 'free=%d' % free, 'total=%d' % total, flush=True); break\n"
    )
    rc, lines, err = run.run_py("limits-driver", ["-c", code], env, 120)
    line = next((l for l in lines if l.startswith("FILLED")), "")
    words = line.split()
    got = int(words[1]) if len(words) > 1 else -1
    n = numbers_of(line)
    room = limit - run.context
    ok = rc == 0 and len(words) > 2 and words[2] == "2" and room - 64 * MIB < got <= room
    s.check(
        "cuMemAlloc to out-of-memory at the limit less the context",
        ok,
        "" if ok else f"{line or err[-400:]}",
        limit=limit,
        context=run.context,
        filled=got,
        reported_total=int(n.get("total", -1)),
        reported_free=int(n.get("free", -1)),
    )
    s.check("cuMemGetInfo shows the slice", n.get("total") == limit, total=int(n.get("total", -1)), limit=limit)
    client_checks(run, s)


def framework_section(run, s, name, module, script, extra):
    if run.simulated_only:
        installed = run.importable(module)
        why = f"{name}'s kernels do not run on simgpu" if installed else f"{name} is not installed here"
        s.why = why
        s.skip(name, why)
        return
    if not run.importable(module):
        s.why = f"{name} is not installed for {run.python}"
        s.skip(name, s.why)
        return
    context = run.context_of(name, extra["context"])
    limit = extra["limit"](context)
    argv = [os.path.join(HERE, script), "--limit", str(limit), "--context", str(context)]
    env = run.env({"MEMORY_REQUEST": limit, "MEMORY_LIMIT": limit, "GROUP": f"{name}-accept"})
    rc, lines, err = run.run_py(name, argv, env, extra["timeout"])
    for line in lines:
        if line.startswith("CHECK "):
            try:
                c = json.loads(line[6:])
            except json.JSONDecodeError:
                continue
            s.checks.append(Check(c["name"], c["status"], c.get("detail", ""), **c.get("numbers", {})))
    s.check(f"{script} ran to its end", rc == 0, "" if rc == 0 else f"exit {rc}: {err[-600:]}", context=context, limit=limit)


def pytorch(run, s):
    framework_section(
        run,
        s,
        "PyTorch",
        "torch",
        "torch_accept.py",
        {"context": "import torch; torch.empty(1, device='cuda')", "limit": lambda c: c + 4 * GIB, "timeout": 150},
    )


def jax(run, s):
    framework_section(
        run,
        s,
        "JAX",
        "jax",
        "jax_accept.py",
        {"context": "import cudrv; cudrv.Driver().init()", "limit": lambda c: c + 8 * GIB, "timeout": 120},
    )


def c_program(run, name):
    """A C test program: prebuilt in the bin folder (what travels), or compiled now with cc."""
    built = run.binary(name)
    if built:
        return built
    out = os.path.join(run.work, name)
    src = os.path.join(ROOT, "tests", "c")
    r = subprocess.run(
        ["cc", "-std=gnu11", "-O1", "-Wall", "-I" + src, os.path.join(src, name + ".c"), "-o", out, "-ldl", "-lpthread"],
        capture_output=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"cc {name}.c: {r.stderr.decode(errors='replace')[-400:]}")
    return out


def escapes(run, s):
    program = c_program(run, "escapes")
    chunk = 16 * MIB
    request, limit = run.context + 256 * MIB, run.context + 512 * MIB
    real_driver = os.path.join(run.libs, "libcuda.so.1") if run.mode == "simgpu" else find_driver()
    cases = [
        ("refused", None, {"MEMORY_REQUEST": 2 * run.total, "MEMORY_LIMIT": 2 * run.total}, {"init": 3}),
        ("contexts", "70", {}, {}),
        ("heap", str(2 * limit), {}, {"heap": 2}),
        ("heap", str(128 * MIB), {}, {"heap": 0}),
        ("stack", "4096", {}, {"stack": 2}),
        ("v1", None, {}, {}),
        ("v1procaddr", None, {}, {}),
        ("v1ctx", None, {}, {}),
        ("export", None, {}, {}),
        ("race", "5", {}, {"race_failures": 0}),
        ("bypass", str(200 * MIB), {}, {"shimmed": 0, "past_limit": 2}),
    ]
    for case, arg, settings, expect in cases:
        label = f"{case} {arg}" if arg else case
        if case == "bypass" and not real_driver:
            s.skip(label, "the driver's own file (libcuda.so.1) was not found for a private copy")
            continue
        shim = {"MEMORY_REQUEST": request, "MEMORY_LIMIT": limit, "GROUP": f"escapes-{case}"}
        shim.update(settings)
        extra = {"ESCAPES_PRIVATE_DRIVER": real_driver} if case == "bypass" else {}
        argv = [program, case, str(chunk)] + ([arg] if arg else [])
        _, before = run.nvml.memory()
        p = run.spawn(f"escapes-{case}", argv, run.env(shim, **extra))
        steps, held = {}, None
        while True:
            line = p.next(90)
            if line is None:
                break
            words = line.split()
            if words[0] == "HELD":
                held = [int(w) for w in words[1:3]]
                break
            if len(words) >= 2 and re.fullmatch(r"-?\d+", words[-1]):
                steps[words[0]] = int(words[-1])
        figure = run.nvml.process_bytes(p.pid)
        _, after = run.nvml.memory()
        device_delta = max(0, after - before)
        p.close()
        code = p.wait(60)
        bad = [f"{k} answered {steps.get(k)} (expected {v})" for k, v in expect.items() if steps.get(k) != v]
        counted = max(figure, device_delta)
        ok = held is not None and code == 0 and not bad and counted <= limit + 2 * MIB
        s.check(
            label,
            ok,
            "" if ok else "; ".join(bad) + f" exit {code} {p.stderr(300)}",
            limit=limit,
            held=held[0] if held else -1,
            device_count=counted,
        )


def find_driver():
    for folder in ["/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib64", "/usr/local/cuda/compat"]:
        path = os.path.join(folder, "libcuda.so.1")
        if os.path.exists(path):
            return os.path.realpath(path)
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True).stdout.decode()
        m = re.search(r"libcuda\.so\.1 .*=> (\S+)", out)
        return os.path.realpath(m.group(1)) if m else None
    except OSError:
        return None


def backend(run):
    """What the collision servers allocate with: PyTorch's caching allocator on a real
    GPU where it is installed, the driver API elsewhere (simgpu runs no PyTorch)."""
    return "torch" if run.mode == "real" and run.importable("torch") else "driver"


def collisions(run, s):
    if not run.gpu_memory_flag and run.total > MANAGED + GIB:
        s.why = "this gpufrac-arbiter has no --gpu-memory: nothing collides on a GPU larger than 16 GiB"
        s.check("arbiter --gpu-memory", False, s.why, total=run.total)
        return
    kind = backend(run)
    ctx = run.context
    # --- wait: eight bursty servers; 8 requests leave room for about two bursts at once.
    arb = run.arbiter("wait")
    request, burst = ctx + 768 * MIB, 3 * GIB
    servers = []
    for i in range(8):
        shim = {
            "MEMORY_REQUEST": request,
            "MEMORY_LIMIT": request + burst + 256 * MIB,
            "RESOLVER": "wait",
            "WAIT_TIMEOUT": "60s",
            "ARBITER_SOCKET": arb.socket,
            "GROUP": f"server{i}",
        }
        argv = [os.path.join(HERE, "workload.py"), "bursty", "--backend", kind, "--base", str(512 * MIB)]
        argv += ["--burst", str(burst), "--step", str(64 * MIB), "--step-ms", "5", "--hold-ms", "300"]
        argv += ["--bursts", "5", "--gap-ms", "50-400", "--seed", str(i)]
        servers.append(run.py(f"bursty{i}", argv, run.env(shim)))
    waits, oom, done, start = [], 0, 0, time.monotonic()
    for srv in servers:
        while True:
            line = srv.next(max(1, 150 - (time.monotonic() - start)))
            if line is None:
                break
            if line.startswith("BURST") and " ok " in line:
                waits.append(numbers_of(line).get("wait_ms", 0))
            elif line.startswith("BURST"):
                oom += 1
            elif line.startswith("DONE"):
                done += 1
                break
    waits.sort()
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))] if waits else -1
    ok = done == 8 and oom == 0 and len(waits) == 40
    s.check(
        f"wait: 8 bursty servers ({kind}) on a managed 16 GiB, 0 out-of-memory",
        ok,
        "" if ok else f"{done}/8 servers finished, {oom} out-of-memory; {servers[0].stderr(300)}",
        bursts_served=len(waits),
        out_of_memory=oom,
        wait_p50_ms=waits[len(waits) // 2] if waits else -1,
        wait_p99_ms=p99,
        seconds=round(time.monotonic() - start, 1),
    )
    for srv in servers:
        srv.close()
        srv.wait(10)

    # The priority and swap scenarios: a filler holds most of the managed size within its
    # request, so that a burst of `data` collides with a holder's `data`. (Only the
    # holder's data is written: on simgpu device memory is this machine's RAM.)
    data = swap_data(run)
    small = ctx + 256 * MIB
    filler_request = MANAGED - 2 * small - data

    def filler(arb):
        shim = {"MEMORY_REQUEST": filler_request, "ARBITER_SOCKET": arb.socket, "GROUP": "filler"}
        argv = [os.path.join(HERE, "workload.py"), "hold", "--bytes", str(filler_request - ctx), "--no-fill"]
        f = run.py("filler", argv, run.env(shim))
        if not f.expect("READY", 120):
            raise RuntimeError(f"the filler did not start: {f.stderr()}")
        return f

    # --- priority: a higher-priority burst ends the lower-priority holder.
    arb = run.arbiter("priority", "--kill-grace", "2s")
    filler(arb)
    low_shim = {
        "MEMORY_REQUEST": small,
        "MEMORY_LIMIT": small + data,
        "RESOLVER": "priority",
        "PRIORITY": 0,
        "ARBITER_SOCKET": arb.socket,
        "GROUP": "low",
    }
    argv = [os.path.join(HERE, "workload.py"), "hold", "--bytes", str(data), "--no-fill"]
    low = run.py("priority-low", argv, run.env(low_shim))
    ready = low.expect("READY", 120)
    high_shim = dict(low_shim, PRIORITY=10, GROUP="high")
    argv = [os.path.join(HERE, "workload.py"), "bursty", "--backend", kind, "--base", str(64 * MIB)]
    argv += ["--burst", str(data), "--step", str(256 * MIB), "--hold-ms", "100", "--bursts", "1", "--gap-ms", "0-1"]
    start = time.monotonic()
    high = run.py("priority-high", argv, run.env(high_shim))
    served = high.expect("BURST", 90)
    served_ms = round((time.monotonic() - start) * 1000)
    low_code = low.wait(30)
    ok = bool(ready) and bool(served) and " ok " in served and low_code is not None and low_code < 0
    s.check(
        "priority: a higher-priority burst ends the lower-priority holder",
        ok,
        "" if ok else f"holder {ready!r}, burst {served!r}, holder exit {low_code}; {high.stderr(300)}",
        burst=data,
        served_after_ms=served_ms,
        holder_exit=low_code if low_code is not None else "still running",
    )
    run.stop_all()

    # --- swap: a burst swaps an idle holder out; its data comes back intact.
    arb = run.arbiter("swap", "--swap-quantum", "1s")
    filler(arb)
    holder_shim = {
        "MEMORY_REQUEST": small,
        "MEMORY_LIMIT": small + data,
        "RESOLVER": "swap",
        "ARBITER_SOCKET": arb.socket,
        "GROUP": "swap-holder",
        "WAIT_TIMEOUT": "120s",
    }
    argv = [os.path.join(HERE, "workload.py"), "hold", "--bytes", str(data), "--seed", "5"]
    holder = run.py("swap-holder", argv, run.env(holder_shim))
    ready = holder.expect("READY", 120)
    pinned_ms = numbers_of(ready).get("pinned_ms", -1)
    time.sleep(3)  # idle for 2 s: a swap burst may take its memory at once
    burster_shim = dict(holder_shim, GROUP="swap-burster")
    argv = [os.path.join(HERE, "workload.py"), "bursty", "--backend", "driver", "--base", str(64 * MIB)]
    argv += ["--burst", str(data), "--step", str(256 * MIB), "--hold-ms", "500", "--bursts", "1", "--gap-ms", "0-1"]
    burster = run.py("swap-burster", argv, run.env(burster_shim))
    served = burster.expect("BURST", 120)
    burster.expect("DONE", 60)
    burster.close()
    burster.wait(20)
    holder.send("check\n")
    back = holder.expect("INTACT", 120) if ready else None
    out_ms, in_ms = log_ms(arb, "swapped out", holder.pid), log_ms(arb, "swapped in", holder.pid)
    ok = bool(served) and " ok " in served and back is not None and out_ms >= 0 and in_ms >= 0
    s.check(
        "swap: a burst swaps an idle holder out, its data back intact",
        ok,
        "" if ok else f"burst {served!r}, swapped out in {out_ms} ms, in in {in_ms} ms, holder {back!r}; {holder.stderr(300)}",
        data=data,
        burst_wait_ms=numbers_of(served).get("wait_ms", -1),
        swap_out_ms=out_ms,
        swap_in_ms=in_ms,
        pinned_copy_ms=pinned_ms,
        swap_out_over_pinned=round(out_ms / pinned_ms, 2) if pinned_ms > 0 and out_ms >= 0 else -1,
        swap_in_over_pinned=round(in_ms / pinned_ms, 2) if pinned_ms > 0 and in_ms >= 0 else -1,
    )


def log_ms(arbiter, phrase, pid):
    """The `ms=` of the arbiter's first log line with `phrase` about `pid` (-1 if none)."""
    with open(arbiter.log_path, errors="replace") as f:
        for line in f:
            if phrase in line and f"pid={pid} " in line:
                return numbers_of(line).get("ms", -1)
    return -1


def swap_data(run):
    """The data a swapped or parked process carries: 4 GiB on a GPU; 1 GiB on simgpu, whose
    device memory is this machine's RAM (a small CI machine's)."""
    return 4 * GIB if run.mode == "real" else 1 * GIB


def parking(run, s):
    if not run.gpu_memory_flag and run.total > MANAGED + GIB:
        s.why = "this gpufrac-arbiter has no --gpu-memory: nothing collides on a GPU larger than 16 GiB"
        s.check("arbiter --gpu-memory", False, s.why, total=run.total)
        return
    ctx = run.context
    data = swap_data(run)
    arb = run.arbiter("park", "--oversubscribe", "2", "--park-with", "auto")
    model_request = ctx + data + 256 * MIB
    model_shim = {
        "MEMORY_REQUEST": model_request,
        "PARK_AFTER": "300ms",
        "WAIT_TIMEOUT": "120s",
        "ARBITER_SOCKET": arb.socket,
        "GROUP": "parked-model",
    }
    model = run.py("park-model", [os.path.join(HERE, "workload.py"), "hold", "--bytes", str(data), "--seed", "9"], run.env(model_shim))
    ready = model.expect("READY", 120)
    pinned_ms = numbers_of(ready).get("pinned_ms", -1)
    time.sleep(1)
    # A group that is not parkable and needs the room the model holds.
    other_request = MANAGED - model_request + GIB
    other_shim = {"MEMORY_REQUEST": other_request, "ARBITER_SOCKET": arb.socket, "GROUP": "needs-room", "WAIT_TIMEOUT": "120s"}
    argv = [os.path.join(HERE, "workload.py"), "bursty", "--backend", "driver", "--base", str(other_request - ctx - 64 * MIB)]
    argv += ["--burst", str(64 * MIB), "--step", str(64 * MIB), "--hold-ms", "300", "--bursts", "1", "--gap-ms", "0-1"]
    start = time.monotonic()
    other = run.py("park-other", argv, run.env(other_shim))
    got_room = other.expect("READY", 150)
    room_ms = (time.monotonic() - start) * 1000
    parked = 0
    try:
        parked = run.status(arb).get("gpus", [{}])[0].get("parked", 0)
    except (ValueError, IndexError, OSError, subprocess.SubprocessError):
        pass
    other.expect("DONE", 60)
    other.close()
    other.wait(30)
    model.send("check\n")
    back = model.expect("INTACT", 150) if ready else None
    with open(arb.log_path, errors="replace") as f:
        how = "the driver's checkpoint" if "parks use the driver's checkpoint API" in f.read() else "the shim's swap"
    park_ms, wake_ms = log_ms(arb, "parked by", model.pid), log_ms(arb, "woke a parked", model.pid)
    n = numbers_of(back)
    ok = bool(ready) and bool(got_room) and parked > 0 and back is not None
    s.check(
        f"a parked {data // GIB} GiB model is woken with its data intact ({how})",
        ok,
        "" if ok else f"model {ready!r}, other {got_room!r}, parked {parked}, check {back!r}; {model.stderr(300)}",
        data=data,
        parked_bytes=parked,
        room_made_ms=round(room_ms),
        park_ms=park_ms,
        wake_ms=wake_ms,
        first_call_after_wake_ms=n.get("first_ms", -1),
        pinned_copy_ms=pinned_ms,
        wake_over_pinned=round(wake_ms / pinned_ms, 2) if pinned_ms > 0 and wake_ms >= 0 else -1,
    )
    model.close()
    model.wait(20)


def compute(run, s):
    if run.simulated_only:
        bench = run.binary("compute_bench")
        if not bench:
            s.why = f"compute_bench is missing from {run.bin} (cargo build --workspace builds it)"
            s.skip("compute_bench", s.why)
            return
        env = run.env()
        out = subprocess.run([bench, "--seconds", "4", "--only", "split,alone,latency"], env=env, capture_output=True, timeout=360)
        text = out.stdout.decode(errors="replace")
        with open(os.path.join(run.logs, "compute_bench.out"), "w") as f:
            f.write(text + out.stderr.decode(errors="replace"))
        def host(row):
            """What the host did during the row that names `row` (its last column: the
            hypervisor's steal and a 2 ms sleep's worst lateness), for a missed bound."""
            for line in text.splitlines():
                if row in line:
                    cells = [c.strip() for c in line.strip().strip("|").split("|")]
                    steal, _, late = cells[-1].partition(";") if len(cells) >= 3 else ("", "", "")
                    if late:
                        return f" (the host during it: {steal.strip()} of steal, a 2 ms sleep {late.strip()} late)"
            return ""
        # The bench measures each flood's throughput against the same flood alone, bare,
        # in the same run; judged here by the compute issue's bounds on simgpu.
        split = re.search(r"compute requests 30% and 70% \| normalized ([\d.]+) / ([\d.]+), shares ([\d.]+)% / ([\d.]+)%.*sum ([\d.]+)", text)
        sliced = re.search(r"two floods, bare \(the GPU's time-slicing\) \| .*sum ([\d.]+)", text)
        whole = re.search(r"limit 100% \(the GPU open\) \| normalized ([\d.]+)", text)
        half = re.search(r"request 20%, limit 50% \| normalized ([\d.]+)", text)
        if out.returncode != 0 or not (split and sliced and whole and half):
            s.check("compute_bench ran and printed its table", False,
                    f"exit {out.returncode}; stdout {text[-400:]!r}; stderr {out.stderr.decode(errors='replace')[-300:]!r}")
            return
        # Judged by what a machine's load cannot break (the bounds of tests/tests/compute.rs):
        # this mode runs debug builds on whatever machine CI has, where a lease's hand-over
        # waits for threads to wake. The benchmark's bounds (a sum of at least 0.95, 95% open,
        # within 3 points of 50%) are reported beside them; docs/benchmarks.md has the
        # benchmark on an idle machine, and the GPU run judges the real thing.
        share30, total, sliced_sum = float(split.group(3)), float(split.group(5)), float(sliced.group(1))
        s.check("requests 30% / 70%: the 30% group's share of the throughput within 3 points, hand-overs losing "
                "at most 30% against the same floods time-sliced", abs(share30 - 30.0) <= 3.0 and total >= 0.7 * sliced_sum,
                f"share {share30}%, sum {total} (time-sliced {sliced_sum}); benchmark bound (sum >= 0.95) "
                + ("met" if total >= 0.95 else "missed" + host("compute requests 30% and 70%")),
                share_30_pct=share30, share_70_pct=float(split.group(4)), normalized_sum=total, time_sliced_sum=sliced_sum)
        whole_v = float(whole.group(1))
        s.check("alone with limit 100%: at least 80% of its bare throughput", whole_v >= 0.8,
                f"normalized {whole_v}; benchmark bound (0.95) "
                + ("met" if whole_v >= 0.95 else "missed" + host("limit 100% (the GPU open)")),
                normalized=whole_v)
        # Against the faster of the two ungated runs, as the test does: a slow reference
        # run cannot make the limit look overrun.
        half_v = float(half.group(1)) / max(1.0, whole_v)
        s.check("alone with limit 50%: at most 53% and at least 35% of its ungated throughput", 0.35 <= half_v <= 0.53,
                f"normalized {half_v:.3f}; benchmark bound (within 3 points of 50%) "
                + ("met" if abs(half_v - 0.5) <= 0.03 else "missed" + host("request 20%, limit 50%")),
                normalized=round(half_v, 3))
        # The latency server's queueing p99: judged against the same server beside the same
        # flood bare (the GPU's own time-slicing), which leases must beat; its ratio to the
        # server alone (within 2x on an idle machine, release build: docs/benchmarks.md) is
        # reported, since this mode runs debug builds wherever CI puts it.
        alone = re.search(r"latency server alone .*\| queueing p50 [\d.]+ ms, p99 ([\d.]+) ms", text)
        bare = re.search(r"latency server beside a flood, bare \| queueing p50 [\d.]+ ms, p99 ([\d.]+) ms", text)
        leased = re.search(r"latency server beside a flood, requests 50% / 50% \| queueing p50 [\d.]+ ms, p99 ([\d.]+) ms", text)
        if not (alone and bare and leased):
            s.check("compute_bench printed the latency rows", False, text[-400:])
            return
        alone_v, bare_v, leased_v = (float(m.group(1)) for m in (alone, bare, leased))
        # The leases of the latency row (the last leases row): their waits' median.
        waits = re.findall(r"\(the leases in that row\) \| \d+ waits: p50 ([\d.]+) ms", text)
        if not waits:
            s.check("compute_bench printed the latency row's leases", False, text[-400:])
            return
        wait_p50 = float(waits[-1])
        # As tests/tests/compute.rs judges it: a server whose calls waited out the flood's
        # whole leases (half of a 40 ms period) would wait 10 ms and more at the median.
        s.check("a latency server beside a flood: its leases come within a quarter of a 40 ms period (median wait)",
                wait_p50 <= 10.0,
                f"wait p50 {wait_p50} ms; queueing p99 {leased_v} ms leased, {bare_v} ms bare, {alone_v} ms alone; "
                "benchmark bound (p99 leased below bare) "
                + ("met" if leased_v < bare_v else "missed" + host("requests 50% / 50%")),
                lease_wait_p50_ms=wait_p50, p99_alone_ms=alone_v, p99_bare_ms=bare_v, p99_leased_ms=leased_v,
                leased_over_alone=round(leased_v / alone_v, 2) if alone_v > 0 else -1)
        return
    script = os.path.join(HERE, "compute_shares.sh")
    if not run.importable("torch"):
        s.why = "compute_shares.sh needs PyTorch, not installed for " + run.python
        s.skip("compute_shares.sh", s.why)
        return
    env = run.env()
    env["PATH"] = os.path.dirname(run.python) + ":" + env.get("PATH", "")
    out = subprocess.run(["bash", script, run.bin, "6"], env=env, capture_output=True, timeout=200)
    text = out.stdout.decode(errors="replace")
    with open(os.path.join(run.logs, "compute_shares.out"), "w") as f:
        f.write(text + out.stderr.decode(errors="replace"))
    numbers = {}
    for line in text.splitlines():
        label, _, rest = line.partition(":")
        values = re.findall(r"(\d+(?:\.\d+)?)%", rest)
        if values:
            numbers[re.sub(r"\W+", "_", label.strip())[:60]] = " / ".join(values)
    s.check("compute_shares.sh ran (shares reported; the judgement is the compute issue's)", out.returncode == 0,
            "" if out.returncode == 0 else out.stderr.decode(errors="replace")[-400:], **numbers)


def cost(run, s):
    workload = [os.path.join(HERE, "workload.py"), "cost", "--pairs", "20000", "--launches", "20000"]
    results = {}
    for under in ("bare", "shim"):
        shim = None if under == "bare" else {"MEMORY_REQUEST": run.context + 2 * GIB, "GROUP": "cost"}
        rc, lines, err = run.run_py(f"cost-{under}", workload, run.env(shim), 180)
        line = next((l for l in lines if l.startswith("COST")), None)
        if rc != 0 or not line:
            s.check(f"alloc+free and launch, {under}", False, err[-400:])
            return
        results[under] = numbers_of(line)
    b, m = results["bare"], results["shim"]
    s.check(
        "alloc+free and launch: what the shim adds",
        True,
        "the quickest chunk's mean per operation, bare and under the shim, in the same run",
        alloc_free_bare_ns=b["alloc_free_ns"],
        alloc_free_shim_ns=m["alloc_free_ns"],
        alloc_free_added_ns=round(m["alloc_free_ns"] - b["alloc_free_ns"]),
        launch_bare_ns=b["launch_ns"],
        launch_shim_ns=m["launch_ns"],
        launch_added_ns=round(m["launch_ns"] - b["launch_ns"]),
    )
    if run.simulated_only or not run.importable("torch, transformers"):
        why = "PyTorch's kernels do not run on simgpu" if run.simulated_only else f"transformers or PyTorch is not installed for {run.python}"
        s.skip("causal LM tokens/s, bare and under the shim", why)
        return
    rates = {}
    for under in ("bare", "shim"):
        shim = None if under == "bare" else {"MEMORY_REQUEST": run.context + 6 * GIB, "GROUP": "cost-lm"}
        rc, lines, err = run.run_py(f"lm-{under}", [os.path.join(HERE, "lm_cost.py")], run.env(shim), 150)
        line = next((l for l in lines if l.startswith("TOKENS")), None)
        if rc != 0 or not line:
            s.check(f"causal LM, {under}", False, err[-400:])
            return
        rates[under] = numbers_of(line)["per_s"]
    s.check(
        "causal LM (random weights) generating: tokens/s under the shim over bare",
        True,
        "measured in the same run",
        bare_tokens_per_s=round(rates["bare"], 1),
        shim_tokens_per_s=round(rates["shim"], 1),
        ratio=round(rates["shim"] / rates["bare"], 3),
    )


RUNNERS = {
    "limits": limits,
    "pytorch": pytorch,
    "jax": jax,
    "escapes": escapes,
    "collisions": collisions,
    "parking": parking,
    "compute": compute,
    "cost": cost,
}


def write_report(run, sections, started):
    doc = {
        "mode": "rehearsal on simgpu" if run.rehearse else run.mode,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": getattr(run, "gpu_name", "unknown"),
        "driver": getattr(run, "driver", "unknown"),
        "cuda": getattr(run, "cuda", "unknown"),
        "gpu_memory": getattr(run, "total", 0),
        "context_bytes": getattr(run, "context", 0),
        "managed": MANAGED,
        "arbiter_gpu_memory_flag": getattr(run, "gpu_memory_flag", False),
        "bin": run.bin,
        "python": run.python,
        "sections": [s.json() for s in sections],
    }
    with open(os.path.join(run.out, "report.json"), "w") as f:
        json.dump(doc, f, indent=2)
    md = [
        f"# gpufrac acceptance run ({doc['mode']})",
        "",
        f"{doc['date']}: {doc['gpu']} ({mib(doc['gpu_memory'])}), driver {doc['driver']}, CUDA {doc['cuda']}; "
        f"a context measured at {mib(doc['context_bytes'])}; contended sections on a managed {mib(MANAGED)}"
        + ("" if doc["arbiter_gpu_memory_flag"] else " (this arbiter has no --gpu-memory: the whole device)"),
        "",
        "| section | result | seconds | why |",
        "| --- | --- | --- | --- |",
    ]
    for s in doc["sections"]:
        md.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s.get('why', '')} |")
    for s in doc["sections"]:
        md += ["", f"## {s['name']}: {s['status']}", ""]
        for c in s["checks"]:
            nums = ", ".join(f"{k}={v}" for k, v in c["numbers"].items())
            md.append(f"- **{c['status']}** {c['name']}" + (f": {nums}" if nums else "") + (f" ({c['detail']})" if c["detail"] else ""))
    with open(os.path.join(run.out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return doc


def main():
    p = argparse.ArgumentParser(prog="accept.py")
    p.add_argument("--mode", choices=["real", "simgpu"], required=True)
    p.add_argument("--bin", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--only", default=",".join(SECTIONS), help="comma list of sections")
    p.add_argument("--rehearse", action="store_true", help="simgpu, with the real-GPU run's paths and choices")
    p.add_argument("out")
    args = p.parse_args()
    only = [x for x in args.only.split(",") if x]
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown sections {unknown}; they are {SECTIONS}")
    for name in ("gpufrac-arbiter", "gpufrac", "libgpufrac.so"):
        if not os.path.exists(os.path.join(args.bin, name)):
            sys.exit(f"accept: {os.path.join(args.bin, name)} is missing (--bin names the folder of the built binaries)")
    started = datetime.datetime.now(datetime.timezone.utc)
    run = Run(args)
    sections = [Section(n) for n in SECTIONS]
    try:
        run.probe()
    except Exception as e:  # noqa: BLE001 (nothing can be sized without the device)
        for s in sections:
            s.check("the device's probe", False, f"{type(e).__name__}: {e}")
        write_report(run, sections, started)
        print(f"accept: the device's probe failed: {e}", file=sys.stderr)
        return 1
    print(f"accept: {run.gpu_name}, driver {run.driver}, CUDA {run.cuda}, context {mib(run.context)}", flush=True)
    for s in sections:
        if s.name not in only:
            s.why = "not asked for (--only)"
            s.skip(s.name, s.why)
            continue
        start = time.monotonic()
        try:
            RUNNERS[s.name](run, s)
        except Exception as e:  # noqa: BLE001 (a section's failure is reported; the next runs)
            import traceback

            s.check("the section ran", False, f"{type(e).__name__}: {e} {traceback.format_exc()[-600:]}")
        finally:
            run.stop_all()
        s.seconds = time.monotonic() - start
        print(f"accept: {s.name}: {s.status} ({s.seconds:.0f} s)", flush=True)
        write_report(run, sections, started)
    doc = write_report(run, sections, started)
    shutil.rmtree(run.work, ignore_errors=True)
    # The shims' group ledgers live in /dev/shm/gpufrac-<euid>/ and go with their last
    # member; the folder itself is left to whoever made it: the run's, once empty, goes.
    try:
        os.rmdir(f"/dev/shm/gpufrac-{os.geteuid()}")
    except OSError:
        pass
    failed = [s["name"] for s in doc["sections"] if s["status"] == "fail"]
    print(f"accept: report in {run.out}/report.md" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
