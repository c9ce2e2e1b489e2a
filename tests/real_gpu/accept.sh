#!/usr/bin/env bash
# The acceptance run: every promise of gpufrac checked on one GPU in at most 8 minutes,
# sections sized from what the device measures. Builds nothing: it takes built binaries.
#
#     tests/real_gpu/accept.sh [--simgpu | --rehearse] [--bin DIR] [--only S1,S2] OUT_DIR
#
# - no mode: the machine's real GPU, binaries from .accept/bin (tests/real_gpu/pack.sh
#   puts the stripped release binaries and the C test programs there), else
#   target/release;
# - --simgpu: the same sections on a simulated 16 GiB GPU, binaries and simgpu from
#   target/debug (what `cargo build --workspace` makes; CI runs this mode);
# - --rehearse: the real-GPU run's binaries and paths (.accept/bin, what travels), against
#   simgpu's driver and NVML (from target/release or target/debug): the GPU run,
#   rehearsed here.
#
# Writes OUT_DIR/report.md and OUT_DIR/report.json (and the workloads' stderr in
# OUT_DIR/logs/); exits 1 if any section failed, 2 on a bad argument. Sections: limits,
# pytorch, jax, escapes, collisions, parking, compute, cost (docs/testing.md says what
# each checks).
set -u
cd "$(dirname "$0")/../.."
usage="usage: tests/real_gpu/accept.sh [--simgpu | --rehearse] [--bin DIR] [--only SECTIONS] OUT_DIR"
mode=real bin= only= out=
while [ $# -gt 0 ]; do
    case "$1" in
        --simgpu) mode=simgpu ;;
        --rehearse) mode=rehearse ;;
        --bin) bin=${2:?$usage}; shift ;;
        --only) only=${2:?$usage}; shift ;;
        -h|--help) echo "$usage"; exit 0 ;;
        -*) echo "accept.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "$usage" >&2; exit 2; }; out=$1 ;;
    esac
    shift
done
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }

case "$mode" in
    simgpu) bin=${bin:-target/debug} ;;
    *) if [ -z "$bin" ]; then [ -d .accept/bin ] && bin=.accept/bin || bin=target/release; fi ;;
esac
if [ "$mode" = rehearse ]; then
    # simgpu's libraries never travel: take them from a build here.
    for dir in target/release target/debug; do
        [ -e "$dir/libsimgpu_cuda.so" ] && export ACCEPT_SIMGPU_DIR=$PWD/$dir && break
    done
    [ -n "${ACCEPT_SIMGPU_DIR:-}" ] || { echo "accept.sh: --rehearse needs simgpu built (cargo build --workspace)" >&2; exit 2; }
fi

# The Python with the GPU clients: the test command's .venv here, the image's python3 on
# the GPU machine (where .venv, a link to another checkout, does not travel).
python=${ACCEPT_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c '' 2>/dev/null; then python=$PWD/.venv/bin/python; else python=$(command -v python3); fi
fi
[ -n "$python" ] || { echo "accept.sh: no python3" >&2; exit 2; }

driver_mode=real
[ "$mode" = real ] || driver_mode=simgpu
rehearse=
[ "$mode" = rehearse ] && rehearse=--rehearse
exec python3 tests/real_gpu/accept.py --mode "$driver_mode" --bin "$bin" --python "$python" \
    ${only:+--only "$only"} $rehearse "$out"
