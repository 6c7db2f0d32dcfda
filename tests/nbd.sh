#!/usr/bin/env bash
# `quiltfs nbd` against QEMU's NBD client (qemu-img, qemu-io) as the independent oracle:
# an image file exported, written and read back, unaligned patterns, a read-only export
# refusing writes; then a replicated volume exported: an ext4 image made by the kernel's
# mkfs.ext4 copied onto it through NBD, one replica killed, the copy read back equal and
# the volume passing e2fsck -fn.
#
# Usage: tests/nbd.sh QUILTFS_BINARY
set -euo pipefail
Q=${1:?usage: tests/nbd.sh QUILTFS_BINARY}
Q=$(readlink -f "$Q")
command -v qemu-img >/dev/null && command -v qemu-io >/dev/null \
  || { echo "nbd: needs qemu-img and qemu-io (apt-get install qemu-utils)" >&2; exit 1; }
W=$(mktemp -d /tmp/nbd-test.XXXXXX)
D=$W/cluster
PORT=$((20000 + RANDOM % 20000))
NBD_PID=

cleanup() {
  [ -n "$NBD_PID" ] && kill "$NBD_PID" 2>/dev/null && wait "$NBD_PID" 2>/dev/null || true
  [ -f "$D/cluster.json" ] && "$Q" cluster down "$D" >/dev/null 2>&1 || true
  rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "nbd: FAIL: $*" >&2; cat "$W/nbd.out" >&2 2>/dev/null || true; exit 1; }
say() { echo "nbd: $*"; }

# Starts `quiltfs nbd ARGS...` on port $1 and waits until it answers.
serve() {
  local port=$1; shift
  "$Q" nbd "$@" --listen "127.0.0.1:$port" >"$W/nbd.out" 2>&1 &
  NBD_PID=$!
  for _ in $(seq 1 100); do
    qemu-img info "nbd://127.0.0.1:$port" >/dev/null 2>&1 && return 0
    kill -0 "$NBD_PID" 2>/dev/null || fail "quiltfs nbd exited"
    sleep 0.1
  done
  fail "quiltfs nbd did not answer on port $port"
}
stop_serving() { kill "$NBD_PID"; wait "$NBD_PID" 2>/dev/null || true; NBD_PID=; }

# 1. An image file: size, a 10 MiB round trip, unaligned patterns.
truncate -s 64M "$W/img.raw"
serve "$PORT" "$W/img.raw" --name disk
U="nbd://127.0.0.1:$PORT/disk"
size=$(qemu-img info --output=json "$U" | python3 -c "import json,sys; print(json.load(sys.stdin)['virtual-size'])")
[ "$size" = $((64 << 20)) ] || fail "virtual size $size"
head -c 10M /dev/urandom >"$W/rnd"
qemu-img convert -n -f raw -O raw "$W/rnd" "$U" || fail "qemu-img convert into the export"
qemu-img convert -f raw -O raw "$U" "$W/back.raw" || fail "qemu-img convert out of the export"
cmp -n $((10 << 20)) "$W/rnd" "$W/back.raw" || fail "round trip differs"
cmp -i $((10 << 20)) "$W/back.raw" /dev/zero -n $((54 << 20)) || fail "beyond the data is not zero"
qemu-io -f raw "$U" -c "write -P 0xab 1000 5000" -c "write -P 0xcd 70001 3" \
  -c "write -z 8192 4096" >/dev/null || fail "qemu-io writes"
qemu-io -f raw "$U" -c "read -P 0xab 1000 5000" -c "read -P 0xcd 70001 3" \
  -c "read -P 0 8192 4096" >"$W/io.out" || fail "qemu-io reads"
grep -q "Pattern verification failed" "$W/io.out" && { cat "$W/io.out"; fail "unaligned patterns"; }
# Bytes around the patterns kept what the round trip wrote.
stop_serving
cmp -n 1000 "$W/rnd" "$W/img.raw" || fail "bytes before an unaligned write changed"
cmp -i 6000 -n 2192 "$W/rnd" "$W/img.raw" || fail "bytes after an unaligned write changed"
say "image file: round trip equal, unaligned writes exact"

# 2. Read-only: the export says so (QEMU then refuses to open it for writing; the
# server's own EPERM for clients that write anyway is tested in the crate), reads work.
serve "$PORT" "$W/img.raw" --name disk --read-only
qemu-io -f raw "$U" -c "write -P 0x11 0 4096" >"$W/ro.out" 2>&1 \
  && fail "a read-only export was opened for writing"
qemu-io -r -f raw "$U" -c "read -P 0xcd 70001 3" >"$W/io.out" || fail "reading a read-only export"
grep -q "Pattern verification failed" "$W/io.out" && fail "read-only export reads wrong data"
stop_serving
cmp -n 1000 "$W/rnd" "$W/img.raw" || fail "a read-only export changed its image"
say "read-only export: refused for writing, reads equal"

# 3. A replicated volume: the kernel's ext4 copied on through NBD, a replica killed.
A=$("$Q" cluster up --dir "$D" --replicas 3 --size 128M --port $((PORT + 1)) 2>/dev/null)
truncate -s 128M "$W/ext4.img"
mkfs.ext4 -q -F "$W/ext4.img"
e2fsck -fn "$W/ext4.img" >/dev/null 2>&1 || fail "mkfs.ext4 made an unclean image"
serve "$PORT" "$A"
qemu-img convert -n -f raw -O raw "$W/ext4.img" "nbd://127.0.0.1:$PORT/vol0" || fail "copying ext4 onto the volume"
"$Q" cluster stop "$D" --replica 2 --kill >/dev/null
qemu-img convert -f raw -O raw "nbd://127.0.0.1:$PORT/vol0" "$W/vol.img" || fail "reading the volume with a replica down"
cmp "$W/ext4.img" "$W/vol.img" || fail "the volume read through NBD differs from what was written"
e2fsck -fn "$W/vol.img" >"$W/fsck.out" 2>&1 || { cat "$W/fsck.out"; fail "e2fsck of the volume"; }
stop_serving
"$Q" cluster start "$D" --replica 2 >/dev/null
say "replicated volume: ext4 copied through NBD, equal with a replica killed, e2fsck clean"
echo "nbd: PASS"
