#!/usr/bin/env bash
# betrfs against the ext2 module and kernel ext4 (issue 20's closing figures; the full
# suite is the betrfs benchmark issue's): untar of Debian's linux-source, then find,
# grep -r and rm -rf, each on a cold cache (unmounted and mounted again, page cache
# dropped). Every phase ends durable (sync, and the unmount waits for the server's last
# write-back). Systems interleave within a round; medians and ratios to ext4.
#   scripts/bench-betrfs.sh [RUNS] [SYSTEMS...]     (QUICK=1: a 58 MB subset)
#   systems: ext4 quiltfs-su (ext2 module, soft updates) betrfs
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"; shift || true
systems=("${@:-ext4 quiltfs-su betrfs}")
read -r -a systems <<<"${systems[*]}"
q="$PWD/target/release/quiltfs"
[ -x "$q" ] || cargo build --release -q -p quilt-cli
for p in e2fsprogs bc; do
  dpkg -s "$p" >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null
done
work="${WORK:-/tmp/quiltfs-bench-betrfs}"; mkdir -p "$work/m"
tarball=$(scripts/linux-tarball.sh "$work")
m="$work/m"; img="$work/img"
cleanup() { mountpoint -q "$m" && umount "$m" || true; rm -f "$img"; }
trap cleanup EXIT
out="$work/betrfs.csv"; echo "system,run,phase,wall_s" >"$out"
mnt() {
  case "$1" in
    ext4) mount -o loop "$img" "$m" ;;
    *) "$q" mount "$img" "$m" >/dev/null ;;
  esac
  sync; echo 3 >/proc/sys/vm/drop_caches
}
timed() {  # system run phase command...
  local sys="$1" run="$2" phase="$3"; shift 3
  local t0 t1; t0=$(date +%s.%N)
  "$@"
  sync; umount "$m"
  t1=$(date +%s.%N)
  local wall; wall=$(echo "$t1 - $t0" | bc)
  echo "$sys,$run,$phase,$wall" >>"$out"
  printf 'bench: %-11s run %d %-7s %7.2f s\n' "$sys" "$run" "$phase" "$wall"
}
one() {
  local sys="$1" run="$2"
  rm -f "$img"; truncate -s 8G "$img"
  case "$sys" in
    ext4) mkfs.ext4 -F -q "$img" ;;
    quiltfs-su) "$q" mkfs "$img" --force >/dev/null ;;
    betrfs) "$q" mkfs --fs betrfs "$img" --force >/dev/null ;;
  esac
  mnt "$sys"; timed "$sys" "$run" untar tar xf "$tarball" -C "$m"
  mnt "$sys"; timed "$sys" "$run" find sh -c "find '$m' | wc -l >'$work/find.out'"
  mnt "$sys"; timed "$sys" "$run" grep sh -c "grep -r -c quiltfs_never_matches '$m' | wc -l >'$work/grep.out' || true"
  mnt "$sys"; timed "$sys" "$run" rmrf rm -rf "$m/linux-source-6.1"
  echo "bench: $sys: $(cat "$work/find.out") names found, $(cat "$work/grep.out") files grepped"
  case "$sys" in
    ext4) e2fsck -fn "$img" >/dev/null 2>&1 || echo "bench: WARNING: e2fsck finds problems after $sys" ;;
    quiltfs-su) e2fsck -fn "$img" >/dev/null 2>&1 || echo "bench: WARNING: e2fsck finds problems after $sys" ;;
    betrfs) "$q" fsck -n "$img" >/dev/null || echo "bench: WARNING: quiltfs fsck finds problems after betrfs" ;;
  esac
}
for run in $(seq 1 "$runs"); do
  for sys in "${systems[@]}"; do one "$sys" "$run"; done
done
python3 - "$out" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
phases = ["untar", "find", "grep", "rmrf"]
systems = []
for r in rows:
    if r["system"] not in systems:
        systems.append(r["system"])
med = {}
for s in systems:
    for p in phases:
        v = [float(r["wall_s"]) for r in rows if r["system"] == s and r["phase"] == p]
        if v:
            med[s, p] = (statistics.median(v), min(v), max(v), len(v))
print("\n| phase | " + " | ".join(systems) + " |")
print("|---|" + "---|" * len(systems))
for p in phases:
    cells = []
    for s in systems:
        if (s, p) not in med:
            cells.append("-")
            continue
        m, lo, hi, n = med[s, p]
        base = med.get(("ext4", p))
        ratio = " (%.2f× ext4)" % (m / base[0]) if base and s != "ext4" else ""
        cells.append("%.2f s%s [%.2f–%.2f, n=%d]" % (m, ratio, lo, hi, n))
    print("| %s | %s |" % (p, " | ".join(cells)))
PY
