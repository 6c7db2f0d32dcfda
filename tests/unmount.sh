#!/usr/bin/env bash
# When umount(8) or `quiltfs umount` returns, the image is free, and a final write-back
# that failed is reported:
#  1. Rounds of mount, write, unmount (plain umount and quiltfs umount in turn), for the
#     ext2 module and betrfs, half of them with both cores busy: right after the unmount
#     the server process is gone, no loop device is attached over the image, and
#     `quiltfs fsck -n` (which refuses an image in use) and e2fsck find it clean.
#  2. The host file system under the image dies (ext4's shutdown ioctl, xfs_io): the
#     final write-back fails, and umount and quiltfs umount exit non-zero naming the
#     failure; the server is gone and the host can be unmounted at once.
# CI (CI=true): 20 rounds per module. Full: 1,000. Needs root.
# Usage: tests/unmount.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /tmp/quiltfs-unmount.XXXXXX)"
m="$work/m"; host="$work/host"; mkdir -p "$m" "$host"
load=()
cleanup() {
  for p in "${load[@]}"; do kill "$p" 2>/dev/null || true; done
  for d in "$m" "$host"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  for l in $(losetup -j "$work/host.img" -O NAME -n 2>/dev/null); do losetup -d "$l" || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "unmount: FAIL: $*" >&2; exit 1; }
command -v xfs_io >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xfsprogs >/dev/null
if [ "${CI:-}" = true ]; then rounds=20; else rounds=1000; fi
rounds="${QUILT_UNMOUNT_ROUNDS:-$rounds}"

mount_pid() { # IMAGE: mounts it on $m, prints the server's pid
  local out
  out="$("$q" mount "$1" "$m")" || fail "mount of $1 failed"
  sed -n 's/.*(server pid \([0-9]*\)).*/\1/p' <<<"$out"
}

# Gone: no such process, or a zombie (exited; its parent, init, has not reaped it yet).
gone() { [ ! -e "/proc/$1" ] || grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }

start_load() { for _ in 1 2; do (while :; do :; done) & load+=($!); done; }
stop_load() { for p in "${load[@]}"; do kill "$p" 2>/dev/null || true; done; load=(); }

for fs in ext2 betrfs; do
  img="$work/$fs.img"
  "$q" mkfs --fs "$fs" "$img" --size 64M >/dev/null
  for r in $(seq 1 "$rounds"); do
    [ $((r % 2)) -eq 0 ] && start_load
    pid="$(mount_pid "$img")"
    echo "round $r" >"$m/f$((r % 7))"
    if [ $((r % 2)) -eq 0 ]; then umount "$m"; else "$q" umount "$m"; fi
    gone "$pid" || fail "$fs round $r: server $pid still running after the unmount"
    [ -z "$(losetup -j "$img")" ] || fail "$fs round $r: a loop device still holds the image: $(losetup -j "$img")"
    "$q" fsck -n "$img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "$fs round $r: fsck right after the unmount"; }
    stop_load
  done
  if [ "$fs" = ext2 ]; then
    e2fsck -fn "$img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck after the rounds"; }
  fi
  echo "unmount: $fs: $rounds rounds, the image free after each"
done

echo "unmount: a final write-back that fails is reported"
truncate -s 300M "$work/host.img"
mkfs.ext4 -q -F "$work/host.img"
for fs in ext2 betrfs; do
  for how in umount quiltfs; do
    mount -o loop "$work/host.img" "$host"
    rm -f "$host/i.img"
    "$q" mkfs --fs "$fs" "$host/i.img" --size 64M >/dev/null
    pid="$(mount_pid "$host/i.img")"
    dd if=/dev/urandom of="$m/a" bs=1M count=4 status=none
    sync
    dd if=/dev/urandom of="$m/b" bs=1M count=4 status=none
    xfs_io -x -c "shutdown -f" "$host"
    if [ "$how" = umount ]; then
      umount "$m" 2>"$work/err" && fail "$fs: umount succeeded although the write-back failed"
    else
      "$q" umount "$m" 2>"$work/err" && fail "$fs: quiltfs umount succeeded although the write-back failed"
    fi
    grep -q 'Input/output error' "$work/err" || { cat "$work/err"; fail "$fs: $how's error does not name the failure"; }
    mountpoint -q "$m" && fail "$fs: still mounted after $how"
    gone "$pid" || fail "$fs: server $pid still running after $how"
    umount "$host" || fail "$fs: the host cannot be unmounted after $how"
    echo "unmount: $fs, $how: failed as it should ($(head -c 120 "$work/err"))"
  done
done
echo "unmount: all checks passed"
