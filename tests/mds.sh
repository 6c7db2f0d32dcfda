#!/usr/bin/env bash
# The namespace service (Cudele) from the command line, on betrfs and on ext3:
# `quiltfs mds serve`, two FUSE mounts of it (what one writes the other sees at once,
# with real programs: cp -a and diff -r), policies set and shown through a mount, a
# weak subtree mounted decoupled (cp -a, mv, ln -s in the client's own view, EBUSY
# for the other mount meanwhile, everything merged at unmount), a strong subtree held
# by the mount of it (EBUSY for the other until the unmount), and kill -9 of the
# service during a create loop under global durability: after a restart every file whose creation was
# acknowledged is there with its bytes, and the store's checker (quiltfs fsck, e2fsck)
# finds it clean. Then kill -9 of a decoupled client after Local Persist (the next
# mount with its local directory merges its journal) and of the service during a
# durable merge (whole or absent after the restart, every file once after the next
# sync).
#
# Throughout, seeded random calls (tests/errno_calls.py) through a strong mount and a
# decoupled one give every result and errno the kernel's ext4 gives for them, and an
# open file outlives its unlink by either mount until it is closed.
# Usage: tests/mds.sh QUILTFS_BINARY
set -euo pipefail
Q=${1:?usage: tests/mds.sh QUILTFS_BINARY}
Q=$(readlink -f "$Q")
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d /tmp/mds-test.XXXXXX)
SERVE_PID=
MOUNTS=()

cleanup() {
  for m in "${MOUNTS[@]}"; do
    mountpoint -q "$m" 2>/dev/null && { umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; }
  done
  [ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
fail() {
  echo "mds: FAIL: $*" >&2
  cat "$W/serve.err" >&2 2>/dev/null || true
  exit 1
}
say() { echo "mds: $*"; }

# Starts the service on $1 (port) for image $2; sets ADDR.
serve() {
  local port=$1 img=$2
  QUILTFS_LOG=error,quilt_cudele=info "$Q" mds serve "$img" --listen "127.0.0.1:$port" --lease 3 >"$W/serve.out" 2>"$W/serve.err" &
  SERVE_PID=$!
  # Up to a minute: a restart finishes a staged merge before it listens (60,000
  # creates under the test build's debug assertions, on a shared machine), and the
  # loop ends as soon as the address is printed.
  for _ in $(seq 1 600); do
    ADDR=$(grep -o 'mds://[^ ]*' "$W/serve.out" 2>/dev/null || true)
    [ -n "$ADDR" ] && return 0
    kill -0 "$SERVE_PID" 2>/dev/null || fail "quiltfs mds serve exited"
    sleep 0.1
  done
  fail "the service did not start"
}
stop_serving() { kill "$SERVE_PID"; wait "$SERVE_PID" || fail "the service did not stop cleanly"; SERVE_PID=; }
crash_serving() { kill -9 "$SERVE_PID"; wait "$SERVE_PID" 2>/dev/null || true; SERVE_PID=; }
mnt() {
  mkdir -p "$2"
  "$Q" mount "$1" "$2" >/dev/null || fail "mounting $1 on $2"
  MOUNTS+=("$2")
}
unmnt() { umount "$1" || fail "umount $1"; }
check_store() {
  case $1 in
    betrfs) "$Q" fsck "$2" >/dev/null || fail "quiltfs fsck of $2" ;;
    ext3) e2fsck -fn "$2" >/dev/null 2>&1 || { e2fsck -fn "$2" >&2 || true; fail "e2fsck of $2"; } ;;
  esac
}

# The kernel's answers to seeded random calls (tests/errno_calls.py: every result and
# errno, then the tree left), on ext4 through a loop mount: the oracle for the mounts.
SEEDS="1 2"
CALLS=1200
truncate -s 64M "$W/k.img"
mkfs.ext4 -F -q "$W/k.img"
mkdir -p "$W/k"
mount -o loop "$W/k.img" "$W/k"
MOUNTS+=("$W/k")
for seed in $SEEDS 3; do
  mkdir "$W/k/s$seed"
  python3 "$HERE/errno_calls.py" "$W/k/s$seed" "$seed" "$CALLS" >"$W/kernel.$seed"
done
umount "$W/k"
# $1: directory, $2: seed, $3: what runs there; the same results as the kernel's.
same_as_kernel() {
  python3 "$HERE/errno_calls.py" "$1" "$2" "$CALLS" >"$W/ours.$2" || fail "$3: errno_calls.py failed"
  diff -u "$W/kernel.$2" "$W/ours.$2" >"$W/errno.diff" || { head -40 "$W/errno.diff" >&2; fail "$3: seed $2: not the kernel's results"; }
}

for fs in betrfs ext3; do
  IMG=$W/$fs.img
  case $fs in
    betrfs) "$Q" mkfs --fs betrfs --size 256M "$IMG" >/dev/null ;;
    ext3) "$Q" mkfs --journal --size 256M "$IMG" >/dev/null ;;
  esac
  PORT=$((20000 + RANDOM % 20000))
  serve "$PORT" "$IMG"
  A=$W/a-$fs B=$W/b-$fs
  mnt "$ADDR" "$A"
  mnt "$ADDR" "$B"

  # 1. Two clients, one namespace, no stale views.
  echo "from a" >"$A/note"
  [ "$(cat "$B/note")" = "from a" ] || fail "$fs: b does not read what a wrote"
  mkdir "$B/dir" && mv "$A/note" "$A/dir/moved"
  [ -f "$B/dir/moved" ] && [ ! -e "$B/note" ] || fail "$fs: b still sees the old name"
  cp -a /etc/ssl "$A/ssl" 2>/dev/null || cp -a /usr/share/doc/bash "$A/ssl"
  src=/etc/ssl; [ -d /etc/ssl ] || src=/usr/share/doc/bash
  diff -r "$src" "$B/ssl" >/dev/null || fail "$fs: the copy read through the other mount differs"
  # (Here-strings, not pipes: under pipefail, grep -q exiting at its first match can
  # leave the writer with SIGPIPE and the pipeline failed.)
  grep -q quiltfs-mds <<<"$(ls -a "$A")" && fail "$fs: the service's own directory shows"
  # 1b. The kernel's errno values: the same calls through a strong mount.
  for seed in $SEEDS; do
    mkdir "$A/errno$seed"
    same_as_kernel "$A/errno$seed" "$seed" "$fs: a strong mount"
  done
  say "$fs: $CALLS random calls × seeds $SEEDS through a strong mount, every result the kernel's (ext4)"
  # 1c. An open file outlives its unlink, by this mount or the other, until closed.
  python3 - "$A" "$B" <<'PY' || fail "$fs: an open file did not outlive its unlink"
import os, sys
a, b = sys.argv[1], sys.argv[2]
fd = os.open(f"{a}/open-1", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"hello")
os.unlink(f"{a}/open-1")
os.pwrite(fd, b" world", 5)
assert os.pread(fd, 100, 0) == b"hello world" and os.fstat(fd).st_nlink == 0
os.close(fd)
fd = os.open(f"{a}/open-2", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"x" * 100000)
os.unlink(f"{b}/open-2")
assert os.pread(fd, 200000, 0) == b"x" * 100000
os.close(fd)
assert not os.path.exists(f"{a}/open-1") and not os.path.exists(f"{b}/open-2")
PY

  # 2. Policies through a mount; a weak subtree is not mounted as if it were strong.
  "$Q" mds policy set "$A/dir" consistency=weak interfere=block inodes=2000 >/dev/null
  out=$("$Q" mds policy show "$B/dir")
  grep -q "consistency=weak" <<<"$out" || fail "$fs: policy show: $out"
  grep -q "version 1" <<<"$out" || fail "$fs: policy version: $out"
  "$Q" mds policy show "$B/dir/moved" >/dev/null 2>&1 && fail "$fs: a policy of a file"
  # 2b. The weak subtree mounted decoupled: real programs work in the client's own
  # view, others get EBUSY meanwhile (interfere=block), and the unmount merges it.
  sub="${ADDR%%\?*}dir?${ADDR#*\?}"
  mkdir -p "$W/weak"
  "$Q" mount "$sub" "$W/weak" 2>"$W/weak.err" >"$W/weak.out" || fail "$fs: the weak subtree: $(cat "$W/weak.err")"
  MOUNTS+=("$W/weak")
  grep -q "decoupled" "$W/weak.out" || fail "$fs: the mount does not say it decoupled: $(cat "$W/weak.out")"
  grep -q "held decoupled by" <<<"$("$Q" mds policy show "$sub")" || fail "$fs: the mount holds nothing: $("$Q" mds policy show "$sub" 2>&1)"
  cp -a "$src" "$W/weak/tree"
  mv "$W/weak/moved" "$W/weak/tree/moved-again"
  ln -s moved-again "$W/weak/tree/link"
  diff -r "$src" "$W/weak/tree" -x moved-again -x link >/dev/null || fail "$fs: the decoupled view differs from what was copied in"
  ls "$B/dir" >/dev/null 2>&1 && fail "$fs: another client read a blocked subtree"
  # The kernel's errno values from the client's own view too, and the tree it leaves
  # merged as the kernel left it.
  mkdir "$W/weak/errno"
  same_as_kernel "$W/weak/errno" 3 "$fs: a decoupled mount"
  unmnt "$W/weak"
  # The release (after the last merge) ends the hold.
  for _ in $(seq 1 100); do
    grep -q "not held" <<<"$("$Q" mds policy show "$sub")" && break
    sleep 0.1
  done
  grep -q "not held" <<<"$("$Q" mds policy show "$sub")" || fail "$fs: still held after the unmount"
  diff -r "$src" "$B/dir/tree" -x moved-again -x link >/dev/null || fail "$fs: the merged copy differs"
  [ "$(cat "$B/dir/tree/moved-again")" = "from a" ] || fail "$fs: a rename of an older file was not merged"
  [ "$(readlink "$B/dir/tree/link")" = "moved-again" ] || fail "$fs: the symlink was not merged"
  [ ! -e "$B/dir/moved" ] || fail "$fs: the old name is still there after the merge"
  python3 "$HERE/errno_calls.py" "$B/dir/errno" 3 0 >"$W/merged.3"
  diff -u <(grep '^tree ' "$W/kernel.3") "$W/merged.3" >&2 || fail "$fs: the merged tree of the calls is not the kernel's"
  say "$fs: a weak subtree mounted decoupled, blocked for others, merged at unmount"
  # Back where the checks below expect it.
  mv "$A/dir/tree/moved-again" "$A/dir/moved"
  # 2c. A strong subtree mounted as the root under interfere=block is held by that
  # mount: the other mount gets EBUSY inside it until the unmount.
  mkdir "$A/own"
  "$Q" mds policy set "$A/own" consistency=strong interfere=block >/dev/null
  own="${ADDR%%\?*}own?${ADDR#*\?}"
  mkdir -p "$W/own"
  "$Q" mount "$own" "$W/own" >"$W/own.out" 2>"$W/own.err" || fail "$fs: the strong subtree: $(cat "$W/own.err")"
  MOUNTS+=("$W/own")
  grep -q "held by this mount" "$W/own.out" || fail "$fs: the mount does not say it holds: $(cat "$W/own.out")"
  grep -q "held by client" <<<"$("$Q" mds policy show "$own")" || fail "$fs: the mount holds nothing: $("$Q" mds policy show "$own" 2>&1)"
  echo mine >"$W/own/f"
  [ "$(cat "$W/own/f")" = mine ] || fail "$fs: the holder does not read its own file"
  err=$(ls "$B/own" 2>&1) && fail "$fs: another mount listed a held subtree"
  grep -qi "busy" <<<"$err" || fail "$fs: not EBUSY for the other mount: $err"
  unmnt "$W/own"
  for _ in $(seq 1 100); do
    grep -q "not held" <<<"$("$Q" mds policy show "$own")" && break
    sleep 0.1
  done
  [ "$(cat "$B/own/f")" = mine ] || fail "$fs: the other mount does not read the file after the unmount"
  say "$fs: a strong subtree held by its mount, EBUSY for the other until the unmount"

  # 3. kill -9 during a create loop (global durability: each create is durable when
  # it returns); every acknowledged file is there after a restart.
  mkdir "$A/loop"
  : >"$W/acked"
  (
    i=0
    while [ $i -lt 100000 ]; do
      if { echo "payload $i" >"$A/loop/f$i"; } 2>/dev/null; then echo "f$i" >>"$W/acked"; else break; fi
      i=$((i + 1))
    done
  ) &
  LOOP=$!
  sleep 2
  crash_serving
  wait "$LOOP" || true
  n=$(wc -l <"$W/acked")
  [ "$n" -gt 10 ] || fail "$fs: only $n creates before the crash"
  unmnt "$A"; unmnt "$B"
  serve "$PORT" "$IMG"
  C=$W/c-$fs
  mnt "$ADDR" "$C"
  missing=0
  while read -r f; do
    n_=${f#f}
    [ "$(cat "$C/loop/$f" 2>/dev/null)" = "payload $n_" ] || missing=$((missing + 1))
  done <"$W/acked"
  # A line is written only once `echo > f` returned: its create and its write were
  # both answered, so both were durable.
  [ "$missing" -eq 0 ] || fail "$fs: $missing of $n acknowledged files lost or wrong"
  [ "$(cat "$C/dir/moved")" = "from a" ] || fail "$fs: older files lost"
  grep -q "interfere=block" <<<"$("$Q" mds policy show "$C/dir")" || fail "$fs: the policy did not survive"
  say "$fs: $n creates acknowledged before kill -9, all there after the restart"

  # 4. kill -9 of a decoupled client after Local Persist (an invisible subtree: nothing
  # merged); a mount with the same local directory comes back as it and merges the
  # journal, data of its new files included; what came after the sync is lost.
  mkdir "$C/inv"
  "$Q" mds policy set "$C/inv" preset=deltafs interfere=allow >/dev/null
  inv="${ADDR%%\?*}inv?${ADDR#*\?}&local-dir=$W/local-$fs"
  mkdir -p "$W/inv"
  out=$("$Q" mount "$inv" "$W/inv") || fail "$fs: mounting the invisible subtree"
  MOUNTS+=("$W/inv")
  client_pid=$(echo "$out" | sed -n 's/.*server pid \([0-9]*\).*/\1/p')
  [ -n "$client_pid" ] || fail "$fs: no server pid in: $out"
  for i in $(seq 1 200); do echo "kept $i" >"$W/inv/k$i"; done
  "$Q" sync "$W/inv" || fail "$fs: quiltfs sync of the decoupled mount"
  echo lost >"$W/inv/after-sync"
  kill -9 "$client_pid"
  umount "$W/inv" 2>/dev/null || umount -l "$W/inv"
  [ -z "$(ls "$C/inv")" ] || fail "$fs: an invisible subtree's files showed before any merge"
  mkdir -p "$W/inv2"
  "$Q" mount "$inv" "$W/inv2" >"$W/inv2.out" || fail "$fs: mounting again after the kill"
  MOUNTS+=("$W/inv2")
  grep -q "journal of subtree [0-9]*: [1-9][0-9]* events merged" "$W/inv2.out" || fail "$fs: the recovery: $(cat "$W/inv2.out")"
  [ "$(ls "$C/inv" | grep -c '^k')" -eq 200 ] || fail "$fs: $(ls "$C/inv" | grep -c '^k') of 200 files after the recovery"
  [ "$(cat "$C/inv/k77")" = "kept 77" ] || fail "$fs: a recovered file's data"
  [ ! -e "$C/inv/after-sync" ] || fail "$fs: a change after the last sync survived the crash"
  unmnt "$W/inv2"
  say "$fs: a decoupled client killed after Local Persist came back and merged 200 files"

  # 5. kill -9 of the service during a durable merge of N creates (60,000 on betrfs; 12,000 on ext3,
  # whose 256 MiB image has 16,384 inodes) (weak, global:
  # the journal is staged, then applied): after the restart the merge is whole or
  # absent, and the client's next sync leaves every file there once.
  N=60000; pause=0.4
  [ "$fs" = ext3 ] && { N=12000; pause=0.15; }
  mkdir "$C/big"
  "$Q" mds policy set "$C/big" preset=hdfs interfere=allow inodes=$((N + 1000)) sync=0 >/dev/null
  big="${ADDR%%\?*}big?${ADDR#*\?}"
  mkdir -p "$W/big"
  "$Q" mount "$big" "$W/big" >/dev/null || fail "$fs: mounting the weak subtree"
  MOUNTS+=("$W/big")
  python3 - "$W/big" "$N" <<'PY'
import os, sys
for i in range(int(sys.argv[2])):
    os.close(os.open(f"{sys.argv[1]}/n{i}", os.O_CREAT | os.O_WRONLY, 0o644))
PY
  "$Q" sync "$W/big" 2>/dev/null &
  SYNC=$!
  sleep "$pause"
  crash_serving
  wait "$SYNC" || true
  unmnt "$C"
  serve "$PORT" "$IMG"
  mnt "$ADDR" "$C"
  n=$(ls "$C/big" | wc -l)
  [ "$n" -eq 0 ] || [ "$n" -eq "$N" ] || fail "$fs: $n of $N files after a crash during the merge"
  staged=no; grep -q "finished the staged merge" "$W/serve.err" && staged=yes
  for _ in $(seq 1 50); do "$Q" sync "$W/big" 2>/dev/null && break; sleep 0.2; done
  [ "$(ls "$C/big" | wc -l)" -eq "$N" ] || fail "$fs: $(ls "$C/big" | wc -l) of $N files after the client's next sync"
  [ "$(ls "$C/big" | sort -u | wc -l)" -eq "$N" ] || fail "$fs: duplicate names"
  unmnt "$W/big"
  say "$fs: kill -9 during a merge: $n of $N after the restart (staged merge finished at start: $staged), all once after the next sync"
  unmnt "$C"
  stop_serving
  check_store "$fs" "$IMG"
done
say "all checks passed"
