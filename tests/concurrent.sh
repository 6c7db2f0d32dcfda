#!/usr/bin/env bash
# Concurrent creates and renames in one directory from several processes (issue 18:
# requests run on several CPUs at once, over io_uring and over /dev/fuse): every file
# whole, the names as the processes left them, e2fsck -fn clean, and the kernel's ext2
# driver sees the same tree as quiltfs. Needs root (loop mount for the kernel's view).
# Usage: tests/concurrent.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /tmp/quiltfs-concurrent.XXXXXX)"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
cleanup() {
  mountpoint -q "$m" && umount "$m" || true
  mountpoint -q "$k" && umount "$k" || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "concurrent: FAIL: $*" >&2; exit 1; }

for cfg in "soft-updates uring" "soft-updates nouring" "meta-journal uring"; do
  set -- $cfg
  mode=$1; opt=$2
  echo "concurrent: $mode, -o $opt"
  jflag=(); [ "$mode" = meta-journal ] && jflag=(--journal)
  "$q" mkfs "$work/q.img" --size 512M "${jflag[@]}" --force >/dev/null
  "$q" mount "$work/q.img" "$m" --mode "$mode" -o "$opt" >/dev/null
  python3 "$here/concurrent.py" "$m" 6 60 || fail "$mode -o $opt"
  python3 "$here/manifest.py" "$m" >"$work/ours.txt"
  umount "$m"
  e2fsck -fn "$work/q.img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck -fn ($mode -o $opt)"; }
  mount -o loop,ro -t ext2 "$work/q.img" "$k" 2>/dev/null || mount -o loop,ro -t ext3 "$work/q.img" "$k"
  python3 "$here/manifest.py" "$k" >"$work/kernel.txt"
  umount "$k"
  diff -u "$work/kernel.txt" "$work/ours.txt" >/dev/null || fail "the kernel sees a different tree ($mode -o $opt)"
  rm -f "$work/q.img"
done
echo "concurrent: all checks passed"
