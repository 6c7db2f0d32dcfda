#!/usr/bin/env bash
# Patchgroups for programs (issue #6), through a real mount: the C library and its
# example, and the LD_PRELOAD library turning an unmodified program's fsyncs into
# patchgroup boundaries (ordering without waiting for the disk), counted at the device.
# Usage: tests/patchgroups.sh [RELEASE_DIR]   (needs root, /dev/fuse, cc, python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# Absolute: LD_PRELOAD of a relative path fails in every process started elsewhere.
rel="$(cd "${1:-$here/../target/release}" && pwd)"
q="$rel/quiltfs"
work="$(mktemp -d /tmp/quiltfs-pg.XXXXXX)"
mnt="$work/m"
mkdir -p "$mnt"
cleanup() {
  mountpoint -q "$mnt" && "$q" umount "$mnt" || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "patchgroups: FAIL: $*" >&2; exit 1; }
stat_of() { "$q" stats "$mnt" | awk -v k="$1" '$1 == k { print $2 }'; }

"$q" mkfs "$work/img" --size 64M >/dev/null
# No background write-back: flushes counted while a writer runs must be its own, not a
# periodic pass that happened to fall inside the window (it did, under load).
"$q" mount "$work/img" "$mnt" -o flusher_ms=0 >/dev/null

# 1. The C interface: the example compiles against the header and the shared library,
#    and runs (an ordered rename, a sync, a refused rule with the server's reason).
cc -Wall -Werror -I "$here/../crates/interfaces/pg/include" "$here/../crates/interfaces/pg/examples/ordered_rename.c" \
  -L "$rel" -lquilt_pg -o "$work/ordered_rename"
out="$(LD_LIBRARY_PATH="$rel" "$work/ordered_rename" "$mnt")"
grep -q '^refused as expected: patchgroup [0-9]* already has groups depending on it' <<<"$out" \
  || fail "C example: $out"
[ "$(cat "$mnt/note")" = "written before it was named" ] || fail "C example's file"

# 2. The preload library. The program: 40 files, each written and fsynced.
cat > "$work/writer.py" <<'PY'
import os, sys
d = sys.argv[1]
for i in range(40):
    fd = os.open(f"{d}/f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, (f"message {i} " * 150).encode())
    os.fsync(fd)
    os.close(fd)
# An fsync elsewhere is passed through untouched.
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT, 0o644); os.write(fd, b"x"); os.fsync(fd); os.close(fd)
PY
flushes_of() {  # flushes and ioctls made while the writer runs in directory $1 with env $2...
  local dir="$1"; shift
  mkdir -p "$mnt/$dir"
  local f0 i0; f0="$(stat_of device.flushes)"; i0="$(stat_of fuse.ioctl.count)"
  env "$@" python3 "$work/writer.py" "$mnt/$dir" "$work/outside"
  echo "$(( $(stat_of device.flushes) - f0 )) $(( $(stat_of fuse.ioctl.count) - i0 ))"
}
read -r plain plain_io < <(flushes_of plain)
read -r order order_io < <(flushes_of order QUILTFS_MOUNT="$mnt" LD_PRELOAD="$rel/libquilt_preload.so")
read -r durable durable_io < <(flushes_of durable QUILTFS_MOUNT="$mnt" QUILTFS_FSYNC=durable \
  LD_PRELOAD="$rel/libquilt_preload.so")
echo "patchgroups: device flushes for 40 fsyncs: plain $plain, preload order $order, preload durable $durable (patchgroup ioctls: $plain_io, $order_io, $durable_io)"
[ "$plain" -ge 40 ] || fail "plain fsyncs should each flush ($plain)"
[ "$plain_io" -eq 0 ] || fail "no patchgroup calls without the library"
# One NEXT per fsync, plus create/release/engage in every process that loads the
# library (python3 may be a shim that starts several).
[ "$order_io" -ge 43 ] || fail "the library should switch groups at each fsync ($order_io ioctls)"
[ "$order" -le 4 ] || fail "ordering fsyncs should not wait for the disk ($order flushes)"
[ "$durable" -ge 40 ] || fail "durable mode keeps fsync durable ($durable flushes)"
[ "$durable_io" -ge 43 ] || fail "durable mode orders as well ($durable_io ioctls)"
[ "$(cat "$work/outside")" = x ] || fail "fsync outside the mount"

# 3. Nothing lost: after unmount every file is complete and e2fsck finds the image clean.
"$q" umount "$mnt"
e2fsck -fn "$work/img" >/dev/null 2>&1 || fail "e2fsck after the preload runs"
"$q" mount -o ro "$work/img" "$mnt" >/dev/null
python3 - "$mnt" <<'PY' || fail "a file written under the library is not complete"
import sys
for d in ["plain", "order", "durable"]:
    for i in range(40):
        got = open(f"{sys.argv[1]}/{d}/f{i}").read()
        assert got == f"message {i} " * 150, (d, i, len(got))
PY
echo "patchgroups: ok"
