"""gpustat, as a user runs it (`gpustat --json`, then `gpustat`): it exits cleanly, shows
the slice as the device's memory, what the group holds as used, the group's own processes
and no other tenant's."""

import json
import os
import re
import subprocess
import sys

from common import TOTAL, pids, report


own, others = pids("CLIENT_OWN_PIDS"), pids("CLIENT_OTHER_PIDS")
held_at_least = int(os.environ.get("CLIENT_HELD_AT_LEAST", "0"))
gpustat = os.path.join(os.path.dirname(sys.executable), "gpustat")

run = subprocess.run([gpustat, "--json"], capture_output=True, text=True, timeout=60)
assert run.returncode == 0 and not run.stderr.strip(), f"gpustat --json: {run.returncode} {run.stderr}"
gpu = json.loads(run.stdout)["gpus"][0]
assert gpu["memory.total"] == TOTAL >> 20, f"memory.total {gpu['memory.total']} MiB != {TOTAL >> 20}"
assert gpu["memory.used"] >= held_at_least >> 20, f"memory.used {gpu['memory.used']} MiB"
listed = {p["pid"] for p in gpu["processes"]}
assert own <= listed, f"the group's {sorted(own - listed)} missing from {sorted(listed)}"
assert not listed & others, f"another tenant's {sorted(listed & others)} listed"
report("json", total_mib=gpu["memory.total"], used_mib=gpu["memory.used"], pids=",".join(map(str, sorted(listed))))

run = subprocess.run([gpustat, "--no-color"], capture_output=True, text=True, timeout=60)
assert run.returncode == 0 and not run.stderr.strip(), f"gpustat: {run.returncode} {run.stderr}"
assert re.search(rf"/\s*{TOTAL >> 20} MB", run.stdout), run.stdout
report("text")
report("done")
