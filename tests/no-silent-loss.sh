#!/usr/bin/env bash
# No silent loss, through real mounts, with kernel ext2 loop mounts and e2fsck -fn as
# oracles:
#  1. Four writers fill a 64 MiB image at once: write(2) itself fails with ENOSPC, fsync
#     and close succeed, and after a remount every file holds exactly the bytes write(2)
#     acknowledged (pattern checked); a later small write fails and leaves nothing.
#     The same through the kernel's writeback cache (-o wbcache).
#  2. The blocks reserved for root: a user's writes fail with free blocks left and
#     f_bavail 0, root still writes - the same on kernel ext2.
#  3. The maximum file size (1 and 4 KiB blocks) is kernel ext2's: the largest size
#     truncate(2) accepts, pwrite(2) of the last byte and past it, after a remount too.
#     Under -o wbcache the kernel checks only its own maximum, so there fsync(2) reports
#     EFBIG, and nothing past the limit is stored.
#  4. st_blocks of a file being written equals kernel ext2's before and after fsync and
#     after close; tar --sparse of a file held open round-trips.
#  5. One writer per image: a second mount, mkfs --force and stats of a mounted image
#     fail naming the mount; after kill -9 of the server a new mount works.
#  6. umount then at once mkfs or mount (100 rounds): the image is free, never "in use".
#  7. mkfs over a file system refuses without --force (ext2 with files, ext4) and leaves
#     it intact; --force replaces it. Sizes that cannot be made are refused and leave no
#     file; a directory given as the image is named as such.
#  8. sync(1) and syncfs(2) (sync -f) make everything durable: after each, kill -9 of the
#     server, remount, nothing lost.
#  9. A sparse 1 GiB image on a 100 MiB host file system (tmpfs): df counts the host's
#     room; when the host fills, write(2) fails with ENOSPC (not a later write-back), and
#     after a remount the file holds exactly what was acknowledged. The same through the
#     kernel's writeback cache.
# Needs root. Usage: tests/no-silent-loss.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
py=(python3 "$here/silentloss.py")
work="$(mktemp -d /tmp/quiltfs-loss.XXXXXX)"
chmod 755 "$work"  # a user writes below it (the reserve check)
m="$work/m"; m2="$work/m2"; k="$work/k"; host="$work/host"; mkdir -p "$m" "$m2" "$k" "$host"
cleanup() {
  for d in "$m" "$m2" "$k" "$host"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "no-silent-loss: FAIL: $*" >&2; exit 1; }
fsck_clean() { e2fsck -fn "$1" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck -fn reports problems on $1"; }; }
jget() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
kernel_img() { # PATH BLOCK_SIZE: a Debian mkfs.ext2 image of 64 MiB, 5% reserved
  rm -f "$1"; truncate -s 64M "$1"; mkfs.ext2 -F -q -b "$2" -m 5 "$1"
}

# Four writers fill IMAGE (64 MiB) mounted with OPTIONS at once: write(2) itself fails
# with ENOSPC (each stops after 128 MiB if it never does), fsync and close succeed,
# more than 55 MiB is stored, and after a remount each file is exactly what write(2)
# acknowledged. Leaves the image mounted, full, for the caller's own checks first
# (CHECKS: a function run then).
fill_four() { # TAG IMAGE OPTIONS CHECKS
  local tag="$1" img="$2" opts="$3" checks="$4" i r acked
  "$q" mkfs "$img" --size 64M >/dev/null
  "$q" mount "$img" "$m" ${opts:+-o "$opts"} >/dev/null
  for i in 1 2 3 4; do "${py[@]}" fill "$m/w$i" "$i" 262144 $((128 << 20)) >"$work/$tag$i.json" & done
  wait
  total=0
  for i in 1 2 3 4; do
    r="$(cat "$work/$tag$i.json")"
    [ "$(jget "$r" write_errno)" = ENOSPC ] || fail "$tag, writer $i: write(2) did not fail with ENOSPC: $r"
    [ "$(jget "$r" fsync_errno)" = None ] && [ "$(jget "$r" close_errno)" = None ] ||
      fail "$tag, writer $i: fsync or close failed after write(2) had acknowledged: $r"
    total=$((total + $(jget "$r" acked)))
  done
  [ "$total" -gt $((55 << 20)) ] || fail "$tag: the writers stored only $total bytes in 64 MiB"
  "$checks"
  umount "$m"
  fsck_clean "$img"
  "$q" mount "$img" "$m" >/dev/null
  for i in 1 2 3 4; do
    acked="$(jget "$(cat "$work/$tag$i.json")" acked)"
    "${py[@]}" verify "$m/w$i" "$i" "$acked" >"$work/$tag-verify$i.json" ||
      fail "$tag, writer $i: after a remount the file is not what was acknowledged: $(cat "$work/$tag-verify$i.json")"
  done
}

echo "no-silent-loss: four writers fill a 64 MiB image"
full_refuses() {
  if echo x >"$m/small" 2>/dev/null; then fail "a write into the full file system succeeded"; fi
}
fill_four direct "$work/a.img" "" full_refuses
[ "$(stat -c %s "$m/small")" = 0 ] || fail "the refused write left bytes in small"
umount "$m"
fsck_clean "$work/a.img"

echo "no-silent-loss: four writers fill a 64 MiB image through the writeback cache"
# Opened while space is ample, so through the kernel's cache; the mount keeps room for
# what the kernel holds, so write(2) itself still fails, and nothing acknowledged is
# lost.
cache_used() { # the kernel sent larger writes than the writers' 256 KiB
  local writes
  writes="$("$q" stats "$m" | awk '$1 == "fuse.write.count" {print $2}')"
  [ "$writes" -lt $((total / 262144)) ] ||
    fail "the cache was not used: $writes WRITE requests for $((total / 262144)) write(2)s"
}
cache_full() { # and, as without the cache, it is full for everyone, and df says so
  cache_used
  full_refuses
  [ "$(df --output=avail -B1 "$m" | tail -1)" -eq 0 ] ||
    fail "through the cache, the writers were refused but df says $(df --output=avail -B1 "$m" | tail -1) bytes are available"
}
fill_four cache "$work/wb.img" wbcache cache_full
umount "$m"
fsck_clean "$work/wb.img"

echo "no-silent-loss: the reserved blocks are root's, as on kernel ext2"
reserve() { # DIR: what a user and then root see when the user fills DIR's file system
  mkdir "$1/pub"; chmod 777 "$1/pub"
  local why=ok
  setpriv --reuid=65534 --regid=65534 --clear-groups \
    dd if=/dev/zero of="$1/pub/u" bs=256k status=none 2>"$work/dd.err" || why="$(cat "$work/dd.err")"
  case "$why" in *"No space left on device"*) why=ENOSPC ;; esac
  python3 - "$1" "$why" <<'EOF'
import os, sys
s = os.statvfs(sys.argv[1])
print(f"user write: {sys.argv[2]}; free blocks left: {s.f_bfree > 0}")
print(f"available: {s.f_bavail}", file=sys.stderr)
EOF
  dd if=/dev/zero of="$1/root" bs=64k count=1 conv=fsync status=none && echo "root write: ok"
}
kernel_img "$work/k.img" 4096
mount -o loop -t ext2 "$work/k.img" "$k"
reserve "$k" >"$work/reserve.kernel" 2>"$work/avail.kernel"
umount "$k"
"$q" mkfs "$work/r.img" --size 64M >/dev/null
"$q" mount "$work/r.img" "$m" -o allow_other >/dev/null
reserve "$m" >"$work/reserve.ours" 2>"$work/avail.ours"
umount "$m"
fsck_clean "$work/r.img"
grep -q "user write: ENOSPC; free blocks left: True" "$work/reserve.kernel" ||
  fail "kernel ext2 does not behave as this test expects: $(cat "$work/reserve.kernel")"
diff -u "$work/reserve.kernel" "$work/reserve.ours" || fail "the reserve differs from kernel ext2's"
# f_bavail: ext2's is free minus reserved, never below 0 (the kernel's ext4 driver, which
# serves ext2 here, keeps a few more blocks back for indirect blocks and says so).
grep -qx "available: 0" "$work/avail.ours" || fail "statfs: $(cat "$work/avail.ours") after a user filled the disk"

for bs in 1024 4096; do
  echo "no-silent-loss: maximum file size with $bs-byte blocks, as kernel ext2's"
  kernel_img "$work/k.img" "$bs"
  mount -o loop -t ext2 "$work/k.img" "$k"
  kmax="$(jget "$("${py[@]}" maxsize "$k/f")" max)"
  kedge="$("${py[@]}" edge "$k/e" "$kmax")"
  umount "$k"
  "$q" mkfs "$work/s.img" --size 64M --block-size "$bs" --force >/dev/null
  "$q" mount "$work/s.img" "$m" -o nowbcache >/dev/null
  qmax="$(jget "$("${py[@]}" maxsize "$m/f")" max)"
  [ "$qmax" = "$kmax" ] || fail "largest size: kernel $kmax, quiltfs $qmax ($bs-byte blocks)"
  qedge="$("${py[@]}" edge "$m/e" "$kmax")"
  [ "$qedge" = "$kedge" ] || fail "at the limit the kernel says $kedge, quiltfs $qedge"
  umount "$m"
  # Through the kernel's writeback cache: a short answer to its write-back must not
  # pass for all written (fsync said nothing, and the byte was gone, before).
  "$q" mount "$work/s.img" "$m" -o wbcache >/dev/null
  [ "$(stat -c %s "$m/e")" = "$kmax" ] || fail "after a remount the file is not $kmax bytes"
  r="$("${py[@]}" edge "$m/c" "$kmax")"
  [ "$(jget "$r" pwrite_last)" = 1 ] && [ "$(jget "$r" truncate_past)" = EFBIG ] ||
    fail "through the cache, at the limit: $r"
  { [ "$(jget "$r" pwrite_past)" = EFBIG ] || [ "$(jget "$r" fsync)" = EFBIG ]; } ||
    fail "through the cache, a write past the limit was lost unreported: $r"
  umount "$m"
  "$q" mount "$work/s.img" "$m" >/dev/null
  [ "$(stat -c %s "$m/c")" = "$kmax" ] || fail "through the cache: after a remount the file is not $kmax bytes"
  [ "$(tail -c 1 "$m/c")" = x ] || fail "through the cache: the last byte below the limit is lost"
  umount "$m"
  fsck_clean "$work/s.img"
done

echo "no-silent-loss: st_blocks of an open file, and tar --sparse of it"
kernel_img "$work/k.img" 4096
mount -o loop -t ext2 "$work/k.img" "$k"
kb="$("${py[@]}" blocks "$k/s")"
umount "$k"
"$q" mkfs "$work/b.img" --size 64M >/dev/null
"$q" mount "$work/b.img" "$m" >/dev/null
qb="$("${py[@]}" blocks "$m/s")"
[ "$qb" = "$kb" ] || fail "st_blocks: kernel $kb, quiltfs $qb"
coproc HOLD { "${py[@]}" hold "$m/sp"; }
read -r -u "${HOLD[0]}" line
[ "$line" = ready ] || fail "the holder did not start"
tar --sparse -cf "$work/sp.tar" -C "$m" sp
exec {HOLD[1]}>&-
wait "$HOLD_PID"
mkdir "$work/x"; tar -xf "$work/sp.tar" -C "$work/x"
cmp "$work/x/sp" "$m/sp" || fail "tar --sparse of an open file did not round-trip"
umount "$m"
fsck_clean "$work/b.img"

echo "no-silent-loss: one writer per image"
out="$("$q" mount "$work/b.img" "$m")"
pid="$(echo "$out" | sed -n 's/.*server pid \([0-9]*\).*/\1/p')"
[ -n "$pid" ] || fail "no server pid in: $out"
echo kept >"$m/keep"; "$q" sync "$m"
if out="$("$q" mount "$work/b.img" "$m2" 2>&1)"; then fail "a second mount of a mounted image succeeded"; fi
grep -q "is in use: it is mounted on $m " <<<"$out" || fail "the second mount's error does not name the mount: $out"
if out="$("$q" mkfs "$work/b.img" --force 2>&1)"; then fail "mkfs --force of a mounted image succeeded"; fi
grep -q "is in use: it is mounted on $m " <<<"$out" || fail "mkfs's error does not name the mount: $out"
if out="$("$q" stats "$work/b.img" 2>&1)"; then fail "stats of a mounted image opened it"; fi
[ "$(cat "$m/keep")" = kept ] || fail "the mounted file system was changed"
kill -9 "$pid"
while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
umount "$m" 2>/dev/null || umount -l "$m"
"$q" mount "$work/b.img" "$m" >/dev/null || fail "a lock left by a killed server blocks a new mount"
[ "$(cat "$m/keep")" = kept ] || fail "the synced file is gone after kill -9"
umount "$m"
fsck_clean "$work/b.img"

echo "no-silent-loss: the image is free the moment umount returns"
# umount(8) returns when the server has answered the kernel's DESTROY; the server lets
# go of the image's lock before it answers, not when its process exits after, so a mkfs
# or mount right behind umount finds the image free (this raced ~3% of the time).
"$q" mkfs "$work/u.img" --size 64M >/dev/null
for i in $(seq 1 100); do
  "$q" mount "$work/u.img" "$m" >/dev/null || fail "round $i: a mount right after umount failed"
  echo "$i" >"$m/f"
  umount "$m"
  out="$("$q" mkfs "$work/u.img" --size 64M 2>&1)" && fail "round $i: mkfs without --force succeeded"
  grep -q "already holds an ext2 file system" <<<"$out" || fail "round $i: mkfs right after umount: $out"
done
"$q" mount "$work/u.img" "$m" >/dev/null
[ "$(cat "$m/f")" = 100 ] || fail "the last round's file is not there"
umount "$m"
fsck_clean "$work/u.img"

echo "no-silent-loss: mkfs protects data"
"$q" mkfs "$work/c.img" --size 64M >/dev/null
"$q" mount "$work/c.img" "$m" >/dev/null
mkdir "$m/d"; echo hello >"$m/d/f"
umount "$m"
if out="$("$q" mkfs "$work/c.img" --size 64M 2>&1)"; then fail "mkfs over a file system succeeded without --force"; fi
grep -q "already holds an ext2 file system of 64 MiB" <<<"$out" || fail "mkfs does not say what it found: $out"
grep -q -- "--force" <<<"$out" || fail "mkfs does not say how to overwrite: $out"
"$q" mount "$work/c.img" "$m" >/dev/null
[ "$(cat "$m/d/f")" = hello ] || fail "the refused mkfs changed the image"
umount "$m"
fsck_clean "$work/c.img"
rm -f "$work/e4.img"; truncate -s 64M "$work/e4.img"; mkfs.ext4 -F -q "$work/e4.img"
if out="$("$q" mkfs "$work/e4.img" 2>&1)"; then fail "mkfs over ext4 succeeded without --force"; fi
grep -q "already holds an ext4 file system" <<<"$out" || fail "mkfs does not name ext4: $out"
"$q" mkfs "$work/c.img" --force >/dev/null
"$q" mount "$work/c.img" "$m" >/dev/null
[ ! -e "$m/d" ] || fail "mkfs --force kept the old files"
umount "$m"
fsck_clean "$work/c.img"
# A size that cannot be made is refused with a message that names the module, and no
# file is left behind.
for args in "--size 1K" "--size 100T" "--fs betrfs --size 1K"; do
  # shellcheck disable=SC2086
  if out="$("$q" mkfs "$work/n.img" $args 2>&1)"; then fail "mkfs $args succeeded"; fi
  [ ! -e "$work/n.img" ] || fail "a refused mkfs $args left $work/n.img behind"
  case "$args" in *betrfs*) ! grep -q ext2 <<<"$out" || fail "betrfs mkfs talks of ext2: $out";; esac
done
mkdir "$work/adir"
if out="$("$q" mount "$work/adir" "$m" 2>&1)"; then fail "a directory was mounted as an image"; fi
grep -q "$work/adir is a directory" <<<"$out" || fail "mounting a directory does not say so: $out"

echo "no-silent-loss: sync(1) and syncfs(2) reach the server"
head -c 20M /dev/urandom >"$work/src.bin"
for round in sync syncfs; do
  "$q" mkfs "$work/y.img" --size 256M --force >/dev/null 2>&1
  out="$("$q" mount "$work/y.img" "$m")"
  pid="$(echo "$out" | sed -n 's/.*server pid \([0-9]*\).*/\1/p')"
  grep -q " $m fuseblk.quiltfs " /proc/self/mounts || fail "not a block-device mount: $(grep " $m " /proc/self/mounts)"
  cp "$work/src.bin" "$m/a.bin"
  mkdir "$m/dir"; for i in $(seq 1 50); do echo "file $i" >"$m/dir/f$i"; done
  if [ "$round" = sync ]; then sync; else sync -f "$m"; fi
  kill -9 "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  umount "$m" 2>/dev/null || umount -l "$m"
  "$q" mount "$work/y.img" "$m" >/dev/null
  cmp "$work/src.bin" "$m/a.bin" || fail "$round: data written before it is gone after kill -9"
  for i in $(seq 1 50); do [ "$(cat "$m/dir/f$i")" = "file $i" ] || fail "$round: dir/f$i lost"; done
  umount "$m"
  fsck_clean "$work/y.img"
done

echo "no-silent-loss: a sparse image on a host file system that fills up"
mount -t tmpfs -o size=100m quiltfs-test-host "$host"
for opts in nowbcache wbcache; do
  "$q" mkfs "$host/s.img" --size 1G --force >/dev/null 2>&1
  "$q" mount "$host/s.img" "$m" -o "$opts" >/dev/null
  mountpoint -q "$m" || fail "the image on the small host did not mount ($opts)"
  avail="$(df --output=avail -B1 "$m" | tail -1)"
  [ "$avail" -le $((100 << 20)) ] || fail "df says $avail bytes available on a 100 MiB host ($opts)"
  r="$("${py[@]}" fill "$m/f" 5 262144)"
  [ "$(jget "$r" write_errno)" = ENOSPC ] || fail "a full host did not fail write(2) with ENOSPC ($opts): $r"
  [ "$(jget "$r" fsync_errno)" = None ] && [ "$(jget "$r" close_errno)" = None ] ||
    fail "fsync or close failed after write(2) had acknowledged (full host, $opts): $r"
  acked="$(jget "$r" acked)"
  [ "$acked" -gt $((50 << 20)) ] || fail "only $acked bytes stored on a 100 MiB host ($opts)"
  umount "$m"
  fsck_clean "$host/s.img"
  "$q" mount "$host/s.img" "$m" >/dev/null
  "${py[@]}" verify "$m/f" 5 "$acked" >/dev/null || fail "after a full host, the file is not what was acknowledged ($opts)"
  # `quiltfs umount` waits for the server to exit: a fuseblk umount(8) returns after the
  # kernel's DESTROY, and the server may still hold the image on the host for a moment
  # (CI once saw "target is busy" on the host's umount).
  "$q" umount "$m"
done
umount "$host"

echo "no-silent-loss: all checks passed"
