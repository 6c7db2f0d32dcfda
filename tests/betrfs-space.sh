#!/usr/bin/env bash
# betrfs gives space back, and df tells what can be written, through real mounts:
#  1. Fill-and-delete cycles: writers (one, then four at once) fill the file system with
#     dd until write(2) fails with ENOSPC; what they wrote is within 10% of what df
#     said was available; everything is deleted and sync'd, and the next cycle writes
#     at least 90% of what was deleted and of what the first cycle wrote. Every few
#     cycles the image is unmounted and `quiltfs fsck -n` must find it clean.
#  2. A sparse 1 GiB image on a 100 MiB host file system (tmpfs): when the host fills,
#     write(2) fails with ENOSPC, fsync and close succeed, the unmount succeeds, and
#     after a remount the file holds exactly what was acknowledged; deleting it gives
#     the room back.
#  3. Four writers fill it through the kernel's writeback cache (-o wbcache): write(2)
#     fails with ENOSPC, nothing acknowledged is lost, at least 90% of df's figure fits.
#     And the sparse image on the small host through the cache: df counts the host's
#     room, write(2) fails with ENOSPC, nothing acknowledged is lost.
# CI (CI=true): 128 MiB, 4 cycles. Full (humans): 128 MiB and 512 MiB, 100 cycles each
# (about an hour). Needs root. Usage: tests/betrfs-space.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
py=(python3 "$here/silentloss.py")
work="$(mktemp -d /tmp/quiltfs-space.XXXXXX)"
m="$work/m"; host="$work/host"; mkdir -p "$m" "$host"
cleanup() {
  for d in "$m" "$host"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "betrfs-space: FAIL: $*" >&2; exit 1; }
jget() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
if [ "${CI:-}" = true ]; then sizes=(128M); cycles=4; else sizes=(128M 512M); cycles=100; fi
cycles="${QUILT_SPACE_CYCLES:-$cycles}"

avail_bytes() { echo $(( $(df --output=avail -k "$m" | tail -1) * 1024 )); }

# Writers fill the mount with dd until ENOSPC; prints the bytes they stored.
fill() { # WRITERS CYCLE
  local n="$1" c="$2" i pids=()
  for i in $(seq 1 "$n"); do
    ( dd if=/dev/urandom of="$m/c$c-w$i" bs=1M status=none 2>"$work/dd$i.err" || true
      grep -q 'No space left on device' "$work/dd$i.err" ||
        { cat "$work/dd$i.err" >&2; echo "writer $i did not end with ENOSPC" >"$work/dd$i.fail"; } ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for i in $(seq 1 "$n"); do [ ! -e "$work/dd$i.fail" ] || fail "cycle $c: $(cat "$work/dd$i.fail")"; done
  local total=0
  for i in $(seq 1 "$n"); do total=$((total + $(stat -c %s "$m/c$c-w$i"))); done
  echo "$total"
}

for size in "${sizes[@]}"; do
  img="$work/space.img"
  rm -f "$img"
  "$q" mkfs --fs betrfs "$img" --size "$size" >/dev/null
  "$q" mount "$img" "$m" >/dev/null
  first=0; deleted=0
  for c in $(seq 1 "$cycles"); do
    writers=$(( c % 2 == 1 ? 1 : 4 ))
    before="$(avail_bytes)"
    wrote="$(fill "$writers" "$c")"
    # df's available space against what could be written: within 10% either way.
    [ $((wrote * 10)) -ge $((before * 9)) ] && [ $((wrote * 10)) -le $((before * 11)) ] ||
      fail "$size cycle $c ($writers writers): df said $before bytes available, $wrote were written"
    [ "$first" -gt 0 ] || first="$wrote"
    [ $((wrote * 10)) -ge $((first * 9)) ] ||
      fail "$size cycle $c: $wrote bytes written, the first cycle wrote $first"
    [ $((wrote * 10)) -ge $((deleted * 9)) ] ||
      fail "$size cycle $c: $wrote bytes written after $deleted were deleted"
    rm -f "$m"/c"$c"-w*
    sync
    deleted="$wrote"
    if [ $((c % 10)) -eq 0 ] || [ "$c" -eq "$cycles" ] || [ "${CI:-}" = true ]; then
      umount "$m" || fail "$size cycle $c: umount failed"
      "$q" fsck -n "$img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "$size cycle $c: fsck"; }
      "$q" mount "$img" "$m" >/dev/null
    fi
    echo "betrfs-space: $size cycle $c ($writers writers): $wrote bytes written, $before available before"
  done
  umount "$m"
done

echo "betrfs-space: four writers fill it through the writeback cache"
# The mount keeps room for what the kernel holds (see crates/interfaces/fuse/src/room.rs):
# write(2) itself fails with ENOSPC, nothing acknowledged is lost, and the room kept
# costs little of what df said was available.
img="$work/wb.img"
"$q" mkfs --fs betrfs "$img" --size 128M >/dev/null
"$q" mount "$img" "$m" -o wbcache >/dev/null
before="$(avail_bytes)"
for i in 1 2 3 4; do "${py[@]}" fill "$m/w$i" "$i" 40960 $((256 << 20)) >"$work/wb$i.json" & done
wait
total=0
for i in 1 2 3 4; do
  r="$(cat "$work/wb$i.json")"
  [ "$(jget "$r" write_errno)" = ENOSPC ] || fail "cache, writer $i: write(2) did not fail with ENOSPC: $r"
  [ "$(jget "$r" fsync_errno)" = None ] && [ "$(jget "$r" close_errno)" = None ] ||
    fail "cache, writer $i: fsync or close failed after write(2) had acknowledged: $r"
  total=$((total + $(jget "$r" acked)))
done
[ $((total * 10)) -ge $((before * 9)) ] || fail "through the cache: $total bytes written, df said $before"
writes="$("$q" stats "$m" | awk '$1 == "fuse.write.count" {print $2}')"
[ "$writes" -lt $((total / 40960)) ] ||
  fail "the cache was not used: $writes WRITE requests for $((total / 40960)) write(2)s"
umount "$m"
"$q" fsck -n "$img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "fsck after filling through the cache"; }
"$q" mount "$img" "$m" >/dev/null
for i in 1 2 3 4; do
  "${py[@]}" verify "$m/w$i" "$i" "$(jget "$(cat "$work/wb$i.json")" acked)" >/dev/null ||
    fail "cache, writer $i: after a remount the file is not what was acknowledged"
done
umount "$m"
echo "betrfs-space: through the cache: $total bytes written, $before available before, $writes WRITE requests"

echo "betrfs-space: a sparse image on a host file system that fills up"
mount -t tmpfs -o size=100m quiltfs-test-host "$host"
"$q" mkfs --fs betrfs "$host/s.img" --size 1G >/dev/null
"$q" mount "$host/s.img" "$m" >/dev/null
r="$("${py[@]}" fill "$m/f" 5 262144)"
[ "$(jget "$r" write_errno)" = ENOSPC ] || fail "a full host did not fail write(2) with ENOSPC: $r"
[ "$(jget "$r" fsync_errno)" = None ] && [ "$(jget "$r" close_errno)" = None ] ||
  fail "fsync or close failed after write(2) had acknowledged (full host): $r"
acked="$(jget "$r" acked)"
[ "$acked" -gt $((40 << 20)) ] || fail "only $acked bytes stored on a 100 MiB host"
umount "$m" || fail "the unmount on a full host failed"
"$q" fsck -n "$host/s.img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "fsck after a full host"; }
"$q" mount "$host/s.img" "$m" >/dev/null
"${py[@]}" verify "$m/f" 5 "$acked" >/dev/null || fail "after a full host, the file is not what was acknowledged"
rm "$m/f"
sync
r="$("${py[@]}" fill "$m/g" 6 262144)"
[ "$(jget "$r" acked)" -gt $((acked * 9 / 10)) ] || fail "after deleting on a full host, only $(jget "$r" acked) bytes fit again ($acked before)"
umount "$m"
# Through the kernel's writeback cache: df counts the host's room, so the mount keeps
# room for what the kernel holds there too.
rm "$host/s.img"
"$q" mkfs --fs betrfs "$host/s.img" --size 1G >/dev/null
"$q" mount "$host/s.img" "$m" -o wbcache >/dev/null
avail="$(df --output=avail -B1 "$m" | tail -1)"
[ "$avail" -le $((100 << 20)) ] || fail "df says $avail bytes available on a 100 MiB host"
r="$("${py[@]}" fill "$m/f" 7 262144)"
[ "$(jget "$r" write_errno)" = ENOSPC ] || fail "a full host did not fail write(2) with ENOSPC through the cache: $r"
[ "$(jget "$r" fsync_errno)" = None ] && [ "$(jget "$r" close_errno)" = None ] ||
  fail "fsync or close failed after write(2) had acknowledged (full host, cache): $r"
acked="$(jget "$r" acked)"
[ "$acked" -gt $((40 << 20)) ] || fail "only $acked bytes stored on a 100 MiB host through the cache"
umount "$m" || fail "the unmount on a full host failed (cache)"
"$q" fsck -n "$host/s.img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "fsck after a full host (cache)"; }
"$q" mount "$host/s.img" "$m" >/dev/null
"${py[@]}" verify "$m/f" 7 "$acked" >/dev/null || fail "after a full host through the cache, the file is not what was acknowledged"
"$q" umount "$m"
umount "$host"
echo "betrfs-space: all checks passed"
