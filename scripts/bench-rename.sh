#!/usr/bin/env bash
# Rename latency on betrfs through the mount (issue 21's goal): a directory holding the
# linux source (83,731 entries) against one of 10 files, renamed back and forth, warm
# (right after the untar and a sync) and cold (after a remount). Each rename(2) is
# timed alone; medians of RUNS, and the server's counters (range renames, subtrees
# moved) after.
#   scripts/bench-rename.sh [RUNS]     (QUICK=1: a 58 MB subset of the source)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-9}"
q="$PWD/target/release/quiltfs"
[ -x "$q" ] || cargo build --release -q -p quilt-cli
work="${WORK:-/tmp/quiltfs-bench-rename}"; mkdir -p "$work/m"
tarball=$(scripts/linux-tarball.sh "$work")
m="$work/m"; img="$work/img"
cleanup() { mountpoint -q "$m" && "$q" umount "$m" >/dev/null 2>&1 || true; rm -f "$img"; }
trap cleanup EXIT
rm -f "$img"; truncate -s 8G "$img"
"$q" mkfs --fs betrfs "$img" --force >/dev/null
"$q" mount "$img" "$m" >/dev/null
echo "bench: untar of $(basename "$tarball") (untimed)"
tar xf "$tarball" -C "$m"
mkdir "$m/small"; for i in $(seq 1 10); do head -c 3000 /dev/urandom >"$m/small/f$i"; done
mkdir "$m/into"
sync
big=$(ls "$m" | grep linux | head -1)
entries=$(find "$m/$big" | wc -l)
measure() {  # label
  python3 - "$m" "$big" "$runs" "$1" <<'PY'
import os, statistics, sys, time
m, big, runs, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def timed(a, b):
    t = time.perf_counter(); os.rename(a, b); return (time.perf_counter() - t) * 1e3
res = {}
for name in [big, "small"]:
    xs = []
    for i in range(runs):
        a, b = f"{m}/{name}", f"{m}/into/{name}"
        xs.append(timed(a, b)); xs.append(timed(b, a))
    res[name] = statistics.median(xs)
    print(f"bench: {label:5} rename of {name:18} median {res[name]:7.3f} ms  (min {min(xs):.3f}, max {max(xs):.3f}, {len(xs)} renames)")
print(f"bench: {label:5} ratio big/small {res[big] / res['small']:.2f}")
PY
}
echo "bench: $entries entries under $big"
measure warm
"$q" umount "$m" >/dev/null
"$q" mount "$img" "$m" >/dev/null
sync; echo 3 >/proc/sys/vm/drop_caches
measure cold
"$q" stats "$m" 2>/dev/null | grep -E "range_renames|subtrees_moved|lifts_pushed|keys_moved" || true
"$q" umount "$m" >/dev/null
"$q" fsck -n "$img" >/dev/null && echo "bench: quiltfs fsck: clean" || echo "bench: WARNING: quiltfs fsck finds problems"
