#!/usr/bin/env bash
# Packs what the real-GPU acceptance run takes into .accept/bin (ignored by git; the
# device tool's run carries it): the release binaries, stripped (gpufrac-arbiter is about
# 90 MB with its line tables, 14 MB without), and the C test programs compiled here, so
# that the GPU machine, which has no cargo, builds nothing.
#
#     cargo build --release --workspace && tests/real_gpu/pack.sh [RELEASE_DIR]
set -eu
cd "$(dirname "$0")/../.."
src=${1:-target/release}
dest=.accept/bin
rm -rf "$dest" && mkdir -p "$dest"
for f in gpufrac-arbiter gpufrac libgpufrac.so libgpufrac_core.so; do
    [ -e "$src/$f" ] || { echo "pack.sh: $src/$f is missing: cargo build --release --workspace" >&2; exit 1; }
    strip -o "$dest/$f" "$src/$f"
done
cc -std=gnu11 -O1 -Wall -Itests/c tests/c/escapes.c -o "$dest/escapes" -ldl -lpthread
du -sh .accept
