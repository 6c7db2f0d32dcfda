#!/usr/bin/env bash
# `quiltfs file-view`: a replicated volume as one file through FUSE, a loop device on
# it, and the kernel's own ext4 on that: mkfs.ext4, a copy of real files during which a
# replica is killed with SIGKILL, a remount that reads them back equal, e2fsck -fn of
# the loop device, and, after the view is unmounted, of the volume exported to a file.
# Needs root (FUSE, losetup, mount).
#
# Usage: tests/file-view.sh QUILTFS_BINARY
set -euo pipefail
Q=${1:?usage: tests/file-view.sh QUILTFS_BINARY}
Q=$(readlink -f "$Q")
W=$(mktemp -d /tmp/file-view.XXXXXX)
D=$W/cluster
V=$W/view
E=$W/ext4
SRC=$W/src
mkdir -p "$V" "$E" "$SRC"
for d in /usr/share/doc/*/; do
  cp -r "$d" "$SRC/" 2>/dev/null || true
  [ "$(du -sm "$SRC" | cut -f1)" -ge 16 ] && break
done
PORT=$((20000 + RANDOM % 20000))
VIEW_PID=
LOOP=

cleanup() {
  mountpoint -q "$E" && umount "$E" || true
  [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null || true
  mountpoint -q "$V" && umount "$V" || true
  [ -n "$VIEW_PID" ] && wait "$VIEW_PID" 2>/dev/null || true
  [ -f "$D/cluster.json" ] && "$Q" cluster down "$D" >/dev/null 2>&1 || true
  rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "file-view: FAIL: $*" >&2; cat "$W/view.out" >&2 2>/dev/null || true; exit 1; }
say() { echo "file-view: $*"; }

A=$("$Q" cluster up --dir "$D" --replicas 3 --size 256M --port "$PORT" 2>/dev/null)
"$Q" file-view "$A" "$V" >"$W/view.out" 2>&1 &
VIEW_PID=$!
for _ in $(seq 1 100); do [ -f "$V/vol0" ] && break; sleep 0.1; done
[ -f "$V/vol0" ] || fail "the view did not appear"
[ "$(stat -c %s "$V/vol0")" = $((256 << 20)) ] || fail "the file's size is not the volume's"
touch "$V/other" 2>/dev/null && fail "a second file could be created"
truncate -s 1M "$V/vol0" 2>/dev/null && fail "the volume's file could be truncated"

LOOP=$(losetup -f --show "$V/vol0")
mkfs.ext4 -q "$LOOP"
mount "$LOOP" "$E"
cp -r "$SRC" "$E/a" &
CP=$!
sleep 1
"$Q" cluster stop "$D" --replica 1 --kill >/dev/null
wait "$CP" || fail "the copy failed with a replica killed"
sync
umount "$E"
mount "$LOOP" "$E"
diff -r --no-dereference "$SRC" "$E/a" >/dev/null || fail "the files differ after a remount"
umount "$E"
e2fsck -fn "$LOOP" >"$W/fsck.out" 2>&1 || { cat "$W/fsck.out"; fail "e2fsck of the loop device"; }
losetup -d "$LOOP"; LOOP=
umount "$V"
wait "$VIEW_PID" || fail "the view's server ended badly"
VIEW_PID=
"$Q" cluster start "$D" --replica 1 >/dev/null
"$Q" cluster export "$A" "$W/export.img" 2>/dev/null
e2fsck -fn "$W/export.img" >"$W/fsck.out" 2>&1 || { cat "$W/fsck.out"; fail "e2fsck of the exported volume"; }
say "ext4 on a loop device on the volume's file: copy with a replica killed equal, e2fsck clean (device and export)"
echo "file-view: PASS"
