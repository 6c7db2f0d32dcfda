#!/usr/bin/env bash
# Untar benchmark (issue #3): Debian's linux-source tarball extracted onto kernel ext2
# (loop mount), fuse2fs, and quiltfs in async and soft-updates modes, interleaved, for
# RUNS rounds. Each timed phase ends with the data durable: `tar x` then `sync` and
# unmount (quiltfs's umount helper waits for its final write-back and flush; fuse2fs is
# run in the foreground and waited for). Reports wall seconds, the FUSE server's CPU
# seconds and peak RSS, medians and ratios to kernel ext2.
#   scripts/bench-untar.sh [RUNS] [SYSTEMS...]      (QUICK=1: a 58 MB subset)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"; shift || true
systems=("${@:-ext2 quiltfs-su quiltfs-async fuse2fs}")
read -r -a systems <<<"${systems[*]}"
q="$PWD/target/release/quiltfs"
for p in fuse2fs time; do
  dpkg -s "$p" >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null
done
work="${WORK:-/tmp/quiltfs-bench}"; mkdir -p "$work/m"
tarball=$(scripts/linux-tarball.sh "$work")
m="$work/m"; img="$work/img"
cleanup() { mountpoint -q "$m" && umount "$m" || true; rm -f "$img"; }
trap cleanup EXIT
out="$work/untar.csv"; echo "system,run,wall_s,server_cpu_s,server_peak_rss_kib" >"$out"
one() {
  local sys="$1" run="$2" t0 t1 cpu="" rss=""
  rm -f "$img"; truncate -s 4G "$img"
  case "$sys" in
    ext2) mkfs.ext2 -F -q "$img"; mount -o loop "$img" "$m" ;;
    fuse2fs) mkfs.ext2 -F -q "$img"
      /usr/bin/time -f "%U %S %M" -o "$work/srv.time" fuse2fs "$img" "$m" -f >/dev/null 2>&1 &
      srv=$!; while ! mountpoint -q "$m"; do sleep 0.05; done ;;
    quiltfs-*) "$q" mkfs "$img" --size 4G --force >/dev/null
      mode=soft-updates; [ "$sys" = quiltfs-async ] && mode=async
      /usr/bin/time -f "%U %S %M" -o "$work/srv.time" "$q" mount "$img" "$m" --foreground --mode "$mode" >/dev/null 2>&1 &
      srv=$!; while ! mountpoint -q "$m"; do sleep 0.05; done ;;
  esac
  sync; echo 3 >/proc/sys/vm/drop_caches
  t0=$(date +%s.%N)
  tar xf "$tarball" -C "$m"
  sync
  umount "$m"
  if [ "$sys" != ext2 ]; then wait "$srv" || true; fi
  t1=$(date +%s.%N)
  if [ "$sys" != ext2 ]; then
    read -r u s rss <"$work/srv.time"; cpu=$(echo "$u + $s" | bc)
  fi
  local wall; wall=$(echo "$t1 - $t0" | bc)
  echo "$sys,$run,$wall,$cpu,$rss" >>"$out"
  printf 'bench: %-14s run %d: %6.2f s wall  server cpu %s s  peak rss %s KiB\n' "$sys" "$run" "$wall" "${cpu:--}" "${rss:--}"
  if [ "$sys" != ext2 ] && [ "$sys" != fuse2fs ]; then
    e2fsck -fn "$img" >/dev/null 2>&1 || echo "bench: WARNING: e2fsck reports problems after $sys"
  fi
}
for run in $(seq 1 "$runs"); do
  for sys in "${systems[@]}"; do one "$sys" "$run"; done
done
python3 - "$out" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    by.setdefault(r["system"], []).append(r)
med = {s: statistics.median(float(r["wall_s"]) for r in v) for s, v in by.items()}
base = med.get("ext2")
print("\n| system | wall s (median, min-max) | vs kernel ext2 | server cpu s | peak RSS MiB |")
print("|---|---|---|---|---|")
for s, v in by.items():
    w = sorted(float(r["wall_s"]) for r in v)
    cpu = [float(r["server_cpu_s"]) for r in v if r["server_cpu_s"]]
    rss = [int(r["server_peak_rss_kib"]) for r in v if r["server_peak_rss_kib"]]
    ratio = "%.2f×" % (med[s] / base) if base else "-"
    print("| %s | %.2f (%.2f–%.2f) | %s | %s | %s |" % (s, med[s], w[0], w[-1], ratio,
          "%.1f" % statistics.median(cpu) if cpu else "-",
          "%d" % (max(rss) // 1024) if rss else "-"))
PY
