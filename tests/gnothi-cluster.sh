#!/usr/bin/env bash
# A replicated volume as real processes (quiltfs cluster), with ext2 on it through
# FUSE: replicas killed with SIGKILL during a copy and while reading, one replica's
# data device damaged (and scrubbed), another's data disk replaced by an empty one
# during a copy, a whole server replaced through a membership change during a copy,
# the whole cluster stopped and started again; and a cluster over TLS. Every time, the
# files read back equal to their source, and the volume, exported to a file, passes
# e2fsck -fn. Needs root (FUSE mounts).
#
# Usage: tests/gnothi-cluster.sh QUILTFS_BINARY
set -euo pipefail
Q=${1:?usage: tests/gnothi-cluster.sh QUILTFS_BINARY}
Q=$(readlink -f "$Q")
W=$(mktemp -d /tmp/gnothi-cluster.XXXXXX)
D=$W/cluster
M=$W/mnt
SRC=$W/src
mkdir -p "$M" "$SRC"
# About 24 MiB of real files (documentation trees), enough for a copy to be under way
# when a replica is killed.
for d in /usr/share/doc/*/; do
  cp -r "$d" "$SRC/" 2>/dev/null || true
  [ "$(du -sm "$SRC" | cut -f1)" -ge 24 ] && break
done
# A port range of our own: 3 replicas from a random base.
PORT=$((20000 + RANDOM % 20000))

cleanup() {
  # (A mount whose server died fails `mountpoint`, and its directory stops the rm:
  # found in /proc/mounts, lazily detached if a plain unmount fails.)
  if grep -q " $M " /proc/mounts; then "$Q" umount "$M" >/dev/null 2>&1 || umount -l "$M" || true; fi
  [ -f "$D/cluster.json" ] && "$Q" cluster down "$D" >/dev/null 2>&1 || true
  [ -f "$W/tls/cluster.json" ] && "$Q" cluster down "$W/tls" >/dev/null 2>&1 || true
  rm -rf "$W"
}
trap cleanup EXIT

fail() { echo "gnothi-cluster: FAIL: $*" >&2; for f in "$D"/r*.out; do echo "== $f" >&2; tail -5 "$f" >&2; done; exit 1; }
say() { echo "gnothi-cluster: $*"; }

status_field() { "$Q" cluster status "$D" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print(sum(r.get('$1',0) for r in d['replicas'] if r['up']))"; }
leader() { "$Q" cluster status "$D" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print([r['replica'] for r in d['replicas'] if r.get('role')=='leader'][0])"; }
wait_whole() {
  for _ in $(seq 1 300); do
    [ "$(status_field incomplete)" = 0 ] && [ "$(status_field reserve_used)" = 0 ] && return 0
    sleep 0.2
  done
  "$Q" cluster status "$D" >&2
  fail "replicas did not catch up (incomplete $(status_field incomplete), reserve $(status_field reserve_used))"
}
check_files() { diff -r --no-dereference "$SRC" "$M/$1" >/dev/null || fail "$1 differs from $SRC ($2)"; }
fsck_volume() {
  "$Q" cluster export "$A" "$W/export.img" 2>/dev/null
  e2fsck -fn "$W/export.img" >"$W/fsck.out" 2>&1 || { cat "$W/fsck.out"; fail "e2fsck ($1)"; }
  rm -f "$W/export.img"
}

A=$("$Q" cluster up --dir "$D" --replicas 3 --size 256M --port "$PORT" 2>/dev/null)
say "volume up: $A"
"$Q" mkfs "$A" >/dev/null
"$Q" mount "$A" "$M" >/dev/null

# 1. A replica killed during a copy: the copy completes, and reads back equal.
cp -r "$SRC" "$M/a" &
CP=$!
sleep 1
"$Q" cluster stop "$D" --replica 1 --kill >/dev/null
wait "$CP" || fail "the copy failed with a replica down"
"$Q" sync "$M"
check_files a "replica 1 killed during the copy"
say "copy with replica 1 killed: equal"

# 2. It comes back and catches up (Phase 1, Phase 2, reserve reclaimed).
"$Q" cluster start "$D" --replica 1 >/dev/null
wait_whole
say "replica 1 caught up, reserve empty"
# Each replica's view of a block mkfs wrote: one version everywhere, f+1 home copies
# that match it, none damaged.
"$Q" cluster inspect "$D" 1 >"$W/inspect.out" || { cat "$W/inspect.out"; fail "cluster inspect"; }
python3 - "$W/inspect.out" <<'PY' || fail "cluster inspect: $(cat "$W/inspect.out")"
import re, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 3, lines
versions = {re.search(r"version (\d+)", l).group(1) for l in lines}
assert len(versions) == 1 and versions != {"0"}, versions
assert sum("crc ok" in l and "home copy" in l for l in lines) == 2, lines
assert not any("crc bad" in l for l in lines), lines
PY

# 3. The leader killed while reading.
L=$(leader)
"$Q" cluster stop "$D" --replica "$L" --kill >/dev/null
check_files a "leader $L killed"
"$Q" cluster start "$D" --replica "$L" >/dev/null
wait_whole
say "leader $L killed while reading: equal"

# 4. One replica's data device damaged (its home blocks overwritten): reads go
#    elsewhere and the damaged copies are fetched again.
"$Q" umount "$M"
"$Q" cluster stop "$D" --replica 2 >/dev/null
# Every block of it but the last MiB (its label, after the reserve, says whose disk it
# is): where ext2 put the files depends on its allocator.
dd if=/dev/urandom of="$D/r2.data" bs=1M count=$(( ($(stat -c %s "$D/r2.data") >> 20) - 1 )) conv=notrunc status=none
"$Q" cluster start "$D" --replica 2 >/dev/null
"$Q" mount "$A" "$M" >/dev/null
check_files a "replica 2's data damaged"
BAD=$(status_field checksum_failures)
[ "$BAD" -gt 0 ] || fail "replica 2's damaged blocks were never noticed (checksum_failures 0)"
# Blocks no read touched are still damaged on replica 2: a scrub finds them (before
# the disk replacement below could make replica 0's copy their last), they are fetched
# again, and a second scrub finds nothing.
"$Q" cluster scrub "$D" >"$W/scrub1.out" || { cat "$W/scrub1.out"; fail "scrub"; }
SCRUBBED=$(awk '/replica 2:/ {print $6}' "$W/scrub1.out")
[ "${SCRUBBED:-0}" -gt 0 ] || { cat "$W/scrub1.out"; fail "the scrub found no damage on replica 2"; }
wait_whole
"$Q" cluster scrub "$D" >"$W/scrub2.out"
grep -q " [1-9][0-9]* damaged" "$W/scrub2.out" && { cat "$W/scrub2.out"; fail "damage left after the repair"; }
"$Q" umount "$M"
fsck_volume "after damage"
say "damaged data device: $BAD damaged blocks noticed by reads, $SCRUBBED more by a scrub, repaired, e2fsck clean"

# 5. Replica 0's data disk replaced by an empty one during a copy: the volume is told,
#    re-replication rebuilds it, and then it serves with each of the others down.
"$Q" mount "$A" "$M" >/dev/null
cp -r "$SRC" "$M/b" &
CP=$!
sleep 1
"$Q" cluster replace-disk "$D" --replica 0 >/dev/null 2>"$W/replace.err" || { cat "$W/replace.err"; fail "cluster replace-disk"; }
wait "$CP" || fail "the copy failed while a disk was replaced"
"$Q" sync "$M"
wait_whole
for r in 1 2; do
  "$Q" cluster stop "$D" --replica "$r" --kill >/dev/null
  check_files a "replica 0 rebuilt, replica $r down"
  check_files b "replica 0 rebuilt, replica $r down"
  "$Q" cluster start "$D" --replica "$r" >/dev/null
  wait_whole
done
"$Q" umount "$M"
say "replica 0's data disk replaced during a copy: rebuilt, equal with each other replica down"

# 5b. Replica 2's whole server (both disks) replaced during a copy: the new server joins
#     through a membership change, is rebuilt, and serves with each other replica down.
#     The mount was made with the old address list: it learns the new server's.
"$Q" mount "$A" "$M" >/dev/null
cp -r "$SRC" "$M/c" &
CP=$!
sleep 1
"$Q" cluster replace "$D" --replica 2 >/dev/null 2>"$W/replace2.err" || { cat "$W/replace2.err"; fail "cluster replace"; }
wait "$CP" || fail "the copy failed while a server was replaced"
"$Q" sync "$M"
wait_whole
SERVER=$("$Q" cluster status "$D" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print([r['server'] for r in d['replicas'] if r['replica']==2][0])")
[ "$SERVER" = 5 ] || fail "slot 2 is served by server $SERVER, not the replacement (5)"
for r in 0 1; do
  "$Q" cluster stop "$D" --replica "$r" --kill >/dev/null
  for d in a b c; do check_files $d "server 2 replaced, replica $r down"; done
  "$Q" cluster start "$D" --replica "$r" >/dev/null
  wait_whole
done
"$Q" umount "$M"
say "replica 2's whole server replaced during a copy (now server $SERVER): rebuilt, equal with each other replica down"

# 6. The whole cluster stopped and started again.
"$Q" cluster down "$D" >/dev/null
for r in 0 1 2; do "$Q" cluster start "$D" --replica $r >/dev/null; done
for _ in $(seq 1 100); do leader >/dev/null 2>&1 && break; sleep 0.2; done
"$Q" mount "$A" "$M" >/dev/null
check_files a "after a full restart"
check_files b "after a full restart"
check_files c "after a full restart"
"$Q" umount "$M"
fsck_volume "after a full restart"
say "full restart: equal, e2fsck clean"
"$Q" cluster down "$D" >/dev/null

# 7. Over TLS: a cluster whose replicas present certificates of its own CA. A client
#    that trusts the CA reads and writes; one without TLS gets in nowhere.
DT="$W/tls"
AT=$("$Q" cluster up --dir "$DT" --replicas 3 --size 64M --port $((PORT + 10)) --tls 2>/dev/null)
case "$AT" in *tls-ca=*) ;; *) "$Q" cluster down "$DT" >/dev/null; fail "cluster up --tls printed $AT";; esac
"$Q" cluster check "$AT" --overwrite --seconds 3 >"$W/tls.out" 2>&1 || { "$Q" cluster down "$DT" >/dev/null; cat "$W/tls.out"; fail "cluster check over TLS"; }
PLAIN=${AT%&tls-ca=*}
if "$Q" cluster export "$PLAIN" "$W/plain.img" >/dev/null 2>&1; then
  "$Q" cluster down "$DT" >/dev/null; fail "a client without TLS read a TLS cluster"
fi
"$Q" cluster down "$DT" >/dev/null
say "TLS: $(cut -d';' -f2 "$W/tls.out" | tr -d ' ') with the CA; refused without it"
say "PASS"
