#!/usr/bin/env bash
# Compute shares on a real GPU: one flood alone (its full speed), two floods bare (the
# GPU's own time-slicing), two floods with compute requests 30% and 70% under the shim
# and the arbiter, and one flood alone with a limit of 50%. Each flood's share is its
# speed over the speed alone. Needs PyTorch with CUDA; run from the repository root after
# `cargo build --release --workspace` (or give the folder with the release binaries).
#
#     tests/real_gpu/compute_shares.sh [BIN_DIR] [SECONDS]
set -u
bin=$(realpath "${1:-target/release}")
seconds=${2:-10}
here=$(dirname "$0")
load="timeout $((seconds + 60)) python3 $here/compute_load.py --seconds $seconds --warmup 4"
work=$(mktemp -d)
trap 'kill $arbiter 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
GPUFRAC_LOG=info "$bin/gpufrac-arbiter" --socket "$work/a.sock" 2>"$work/arbiter.log" &
arbiter=$!
for _ in $(seq 100); do [ -S "$work/a.sock" ] && break; sleep 0.1; done

shimmed() { # REQUEST LIMIT: the environment of a flood with that compute share
  echo LD_PRELOAD="$bin/libgpufrac.so" GPUFRAC_MEMORY_REQUEST=4GiB \
    GPUFRAC_ARBITER_SOCKET="$work/a.sock" GPUFRAC_GROUP="flood-$RANDOM" \
    GPUFRAC_COMPUTE_REQUEST="$1" GPUFRAC_COMPUTE_LIMIT="$2"
}
rate() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["products_per_s"])'; }

alone=$($load | rate)
echo "alone, bare: $alone products/s"
$load >"$work/b1" &
b1=$!
$load >"$work/b2" &
b2=$!
wait $b1 $b2
python3 - "$alone" "$work/b1" "$work/b2" <<'PY'
import json, sys
alone = float(sys.argv[1])
shares = [json.loads(open(f).read().strip().splitlines()[-1])["products_per_s"] / alone for f in sys.argv[2:]]
print("two floods, bare: " + " / ".join(f"{s:.1%}" for s in shares))
PY
env $(shimmed 30% 100%) $load >"$work/s1" 2>"$work/s1.err" &
p1=$!
env $(shimmed 70% 100%) $load >"$work/s2" 2>"$work/s2.err" &
p2=$!
sleep $((seconds / 2 + 6))
"$bin/gpufrac" status --socket "$work/a.sock" | grep -E "GPU|compute" || true
wait $p1 $p2
python3 - "$alone" "$work/s1" "$work/s2" <<'PY'
import json, sys
alone = float(sys.argv[1])
shares = [json.loads(open(f).read().strip().splitlines()[-1])["products_per_s"] / alone for f in sys.argv[2:]]
print("two floods, compute requests 30% / 70%: " + " / ".join(f"{s:.1%}" for s in shares))
PY
capped=$(env $(shimmed 20% 50%) $load | rate)
python3 -c "print(f'one flood alone, compute limit 50%: {$capped / $alone:.1%}')"
echo "--- arbiter log (compute) ---"
grep -E "pac|refused|compute" "$work/arbiter.log" | tail -20
for f in "$work"/s*.err; do tail -3 "$f"; done
