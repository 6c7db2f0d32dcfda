#!/usr/bin/env bash
# Server profiles of the betrfs bench's workloads, by hand on a fresh 16 GiB image: a 1 GiB
# file written and read in 40 KiB requests, find, grep -r and rm -rf of the linux tree
# (cold cache), and a TokuBench stand-in (200,000 files of 200 bytes, 4 processes).
# For each: the wall time, `perf record` of the FUSE server (WORKLOAD.perf, top symbols in
# WORKLOAD.top) and its `quiltfs stats` (WORKLOAD.stats, with each request type's count
# and server time).
#   scripts/profile-betrfs.sh [QUILTFS] [OUTDIR]   (root; perf and the tarball that
#   scripts/linux-tarball.sh prepares)
set -euo pipefail
Q=$(realpath "${1:-./target/release/quiltfs}")
W=$(realpath -m "${2:-/var/tmp/profile-betrfs}")
TAR=/var/tmp/quiltfs-bench-betrfs/linux.tar
[ -f "$TAR" ] || { echo "profile-betrfs: $TAR missing (scripts/linux-tarball.sh)" >&2; exit 2; }
command -v perf >/dev/null || { echo "profile-betrfs: perf is not installed" >&2; exit 2; }
mkdir -p "$W/m"
cd "$W"
rm -f img
truncate -s 16G img
"$Q" mkfs --fs betrfs img --force >/dev/null
LOOP=$(losetup -f --show img)
SPID=
cleanup() {
  umount "$W/m" 2>/dev/null || true
  [ -n "$SPID" ] && wait "$SPID" 2>/dev/null || true
  losetup -d "$LOOP"
}
trap cleanup EXIT
start() {
  "$Q" mount "$LOOP" m --foreground --cache-mib 128 >"server-$1.log" 2>&1 &
  SPID=$!
  while ! mountpoint -q m; do sleep 0.05; done
}
stop() { "$Q" sync m || true; umount m; wait "$SPID" || true; SPID=; }
prof() { # name, command...
  local w=$1; shift
  sync; echo 3 >/proc/sys/vm/drop_caches
  start "$w"
  perf record -F 1999 -p "$SPID" -o "$w.perf" 2>/dev/null & local pp=$!
  sleep 0.5
  local t0 t1
  t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N)
  "$Q" stats m >"$w.stats" 2>&1 || true
  kill -INT "$pp"; wait "$pp" || true
  stop
  echo "$w $(echo "$t1 - $t0" | bc) s" | tee -a times.txt
  perf report -i "$w.perf" --no-children --sort sym --percent-limit 1 --stdio 2>/dev/null |
    grep -v '^#' | grep -v '^$' | head -30 >"$w.top"
}
toku() {
  python3 - "$W/m/toku" 200000 4 <<'PY'
import os, sys
from multiprocessing import Process
root, n, p = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def path(i):
    parts = []
    while True:
        parts.append(str(i % 128)); i //= 128
        if i == 0: return parts
def work(k):
    for i in range(k, n, p):
        d = os.path.join(root, *path(i // 128))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            f.write(b"x" * 200)
ps = [Process(target=work, args=(k,)) for k in range(p)]
[x.start() for x in ps]; [x.join() for x in ps]
PY
}
start setup; tar xf "$TAR" -C m; stop
prof seqwrite dd if=/dev/zero of=m/big bs=40k count=25600 conv=fsync status=none
prof seqread dd if=m/big of=/dev/null bs=40k status=none
prof find sh -c "find m >/dev/null"
prof grep sh -c "grep -r -c quiltfs-never-matches-this m >/dev/null || true"
prof rmrf rm -rf m/linux-source-6.1
prof toku4 toku
