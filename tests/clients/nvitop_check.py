"""nvitop, as a user runs it once (`nvitop -1`): it exits cleanly with no traceback, shows
the slice as the device's memory and the group's own processes, no other tenant's."""

import os
import re
import subprocess
import sys

from common import TOTAL, pids, report


own, others = pids("CLIENT_OWN_PIDS"), pids("CLIENT_OTHER_PIDS")
nvitop = os.path.join(os.path.dirname(sys.executable), "nvitop")
env = dict(os.environ, COLUMNS="160", LINES="50")
run = subprocess.run([nvitop, "-1", "--ascii", "--only-compute"], capture_output=True, text=True,
                     timeout=120, env=env)
output = run.stdout
assert run.returncode == 0, f"nvitop -1: {run.returncode}\n{output}\n{run.stderr}"
assert "Traceback" not in output + run.stderr, output + run.stderr
# nvitop writes a total in MiB, or from 100 GiB on (a real H200's 143771 MiB) in GiB with
# one decimal.
totals = [f"/ {TOTAL >> 20}MiB", f"/ {TOTAL / (1 << 30):.1f}GiB"]
assert any(t in output for t in totals), f"the slice ({' or '.join(totals)}) not in\n{output}"
listed = {int(p) for p in re.findall(r"^\|\s+\d+\s+(\d+)\s", output, re.MULTILINE)}
assert own <= listed, f"the group's {sorted(own - listed)} missing from {sorted(listed)}\n{output}"
assert not listed & others, f"another tenant's {sorted(listed & others)} listed\n{output}"
report("nvitop", total_mib=TOTAL >> 20, pids=",".join(map(str, sorted(listed))))
report("done")
