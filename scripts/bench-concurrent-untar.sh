#!/bin/bash
# Concurrent untars (issue 18): N programs untar the same 20,000-entry slice of the
# linux-source tarball into N directories of one file system, for N = 1, 2, 4; wall
# time from the first start to `sync -f`, median of RUNS runs, for quiltfs (soft
# updates, default mount options) and kernel ext2 on a loop device, side by side.
#
#   scripts/bench-concurrent-untar.sh [RUNS] [QUILTFS BINARY] [MOUNT OPTIONS]
#
# Needs root and the decompressed tarball that `quiltfs bench featherstitch` leaves in
# /var/tmp/quiltfs-bench-featherstitch (run any bench of it once). Every image is made
# fresh and checked with e2fsck -fn afterwards.
set -euo pipefail
runs=${1:-3}
bin=${2:-$(command -v quiltfs || echo target/release/quiltfs)}
opts=${3:-}
work=/var/tmp/quiltfs-concurrent-untar
full=/var/tmp/quiltfs-bench-featherstitch/linux.tar
[ -f "$full" ] || { echo "no $full: run 'quiltfs bench featherstitch --quick' once first" >&2; exit 1; }
mkdir -p "$work"
slice=$work/slice-20000.tar
if [ ! -f "$slice" ]; then
    echo "making $slice (once)" >&2
    # (head closes the pipe early: tar's SIGPIPE is expected.)
    (set +o pipefail; tar tf "$full" | head -20000 > "$work/slice.list")
    rm -rf "$work/x"; mkdir -p "$work/x"
    tar xf "$full" -C "$work/x" --no-recursion -T "$work/slice.list"
    tar cf "$slice" -C "$work/x" --no-recursion -T "$work/slice.list"
    rm -rf "$work/x"
fi
img=$work/img; mnt=$work/mnt; mkdir -p "$mnt"
cleanup() { mountpoint -q "$mnt" && umount "$mnt"; rm -f "$img"; }
trap cleanup EXIT

one() { # system n -> wall seconds
    local sys=$1 n=$2
    rm -f "$img"
    if [ "$sys" = quiltfs ]; then
        "$bin" mkfs "$img" --size 4G --force >/dev/null 2>&1
        # shellcheck disable=SC2086
        "$bin" mount "$img" "$mnt" $opts >/dev/null
    else
        truncate -s 4G "$img"; mkfs.ext2 -q -F "$img"; mount -o loop "$img" "$mnt"
    fi
    for i in $(seq 1 "$n"); do mkdir "$mnt/d$i"; done
    local t0 t1
    t0=$(date +%s.%N)
    for i in $(seq 1 "$n"); do tar xf "$slice" -C "$mnt/d$i" & done
    wait
    sync -f "$mnt"
    t1=$(date +%s.%N)
    umount "$mnt"
    e2fsck -fn "$img" >/dev/null 2>&1 || { echo "e2fsck found $sys's image damaged" >&2; exit 1; }
    rm -f "$img"
    echo "$t1 - $t0" | bc
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf "%-8s %7s %10s %12s\n" system untars "median s" "per untar s"
for sys in quiltfs ext2; do
    for n in 1 2 4; do
        m=$(for _ in $(seq 1 "$runs"); do one "$sys" "$n"; done | median)
        printf "%-8s %7d %10.2f %12.2f\n" "$sys" "$n" "$m" "$(echo "$m / $n" | bc -l)"
    done
done
