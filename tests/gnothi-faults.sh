#!/usr/bin/env bash
# Real replica processes, each in its own network namespace on one bridge, checked
# from outside: `quiltfs cluster check` runs clients in a fifth namespace and checks
# their history for linearizability (every read the latest acknowledged write; at the
# end, with every fault healed, every block read once more), while a nemesis breaks
# at most one replica at a time: kill -9 and restart, its link taken down (the leader's
# too), its data device filled, its data blocks damaged, its whole server replaced by
# a new one through a membership change, its data disk replaced by an empty one.
# Afterwards the volume must read the same with any one replica down (every
# block has its f+1 copies again). Then the control: clients that acknowledge a write
# after one copy, and that copy's disk replaced, must be caught.
# Needs root (namespaces, a tmpfs mount).
#
# Usage: tests/gnothi-faults.sh QUILTFS_BINARY
#   GNOTHI_FAULT_SECONDS   how long the load runs (50: the faults take about 45 s)
#   GNOTHI_FAULTS          which faults, in order (default: all of "kill
#                          partition-leader partition fill damage replace-server replace
#                          control")
#   GNOTHI_FAULT_LOG       the replicas' QUILTFS_LOG (e.g. info,openraft=warn)
set -euo pipefail
Q="$(realpath "$1")"
if [ "$(id -u)" != 0 ]; then
  echo "gnothi-faults: needs root (network namespaces); skipped" >&2
  exit 0
fi
command -v qemu-io >/dev/null && command -v qemu-img >/dev/null ||
  { echo "gnothi-faults: needs qemu-io and qemu-img (apt-get install qemu-utils)" >&2; exit 1; }
SECS=${GNOTHI_FAULT_SECONDS:-50}   # the nemesis below takes about 45 s
FAULTS=" ${GNOTHI_FAULTS:-kill partition-leader partition fill damage replace-server replace control} "
want() { [[ "$FAULTS" == *" $1 "* ]]; }
W="$(mktemp -d /tmp/quiltfs-gfaults.XXXXXX)"
T="qf$$"                      # namespace and link names of this run
HUB="${T}h"
NSC="${T}c"
PORT=7700
declare -a PID
say() { echo "gnothi-faults: $*" >&2; }
fail() {
  say "FAIL: $*"
  for i in 0 1 2; do [ -f "$W/r$i.out" ] && { echo "--- replica $i" >&2; tail -n 15 "$W/r$i.out" >&2; }; done
  exit 1
}

cleanup() {
  set +e
  for p in "${PID[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null; done
  [ -n "${CHECK:-}" ] && kill -9 "$CHECK" 2>/dev/null
  [ -n "${NBD:-}" ] && kill -9 "$NBD" 2>/dev/null
  wait 2>/dev/null
  mountpoint -q "$W/small" && umount "$W/small"
  for ns in "$NSC" "${T}0" "${T}1" "${T}2" "$HUB"; do ip netns del "$ns" 2>/dev/null; done
  [ -n "${GNOTHI_FAULT_KEEP:-}" ] && cp -r "$W" /tmp/gfaults-kept; rm -rf "$W"
}
trap cleanup EXIT

# --- the network: a bridge in a hub namespace, a veth from it to each host ----------
ip netns add "$HUB"
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
host() { # host NAMESPACE LINK ADDRESS
  ip netns add "$1"
  ip -n "$1" link set lo up
  ip -n "$1" link add eth0 type veth peer name "$2" netns "$HUB"
  ip -n "$HUB" link set "$2" master br0 up
  ip -n "$1" addr add "$3/24" dev eth0
  ip -n "$1" link set eth0 up
}
for i in 0 1 2; do host "${T}$i" "${T}p$i" "10.77.0.$((i + 1))"; done
host "$NSC" "${T}pc" 10.77.0.100
addr_of() { echo "10.77.0.$(($1 + 1)):$PORT"; }
PEERS="$(addr_of 0),$(addr_of 1),$(addr_of 2)"
ADDR="gnothi://$PEERS/vol0?secret-file=$W/secret"
cut_link() { ip -n "$HUB" link set "${T}p$1" down; }
heal_link() { ip -n "$HUB" link set "${T}p$1" up; }

# --- the replicas: replica 1's data device on a small tmpfs, to fill ----------------
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$W/secret"
mkdir "$W/small"
mount -t tmpfs -o size=64M quiltfs-gfaults "$W/small"
data_of() { if [ "$1" = 1 ]; then echo "$W/small/r1.data"; else echo "$W/r$1.data"; fi; }
# Each slot's current server's devices (a replaced server's are new files).
declare -a LOG_OF DATA_OF
for i in 0 1 2; do
  LOG_OF[$i]="$W/r$i.log"; DATA_OF[$i]="$(data_of "$i")"
  "$Q" replica format --id "$i" --log-dev "${LOG_OF[$i]}" --data-dev "${DATA_OF[$i]}" \
    --size 64M --reserve-slots 1024 2>/dev/null
done
start() { # start REPLICA [extra serve flags]
  local i=$1; shift
  QUILTFS_LOG="${GNOTHI_FAULT_LOG:-error,openraft=off}" ip netns exec "${T}$i" "$Q" replica serve --id "$i" --listen "$(addr_of "$i")" --peers "$PEERS" \
    --log-dev "${LOG_OF[$i]}" --data-dev "${DATA_OF[$i]}" --secret-file "$W/secret" "$@" \
    >>"$W/r$i.out" 2>&1 &
  PID[$i]=$!
}
kill9() { kill -9 "${PID[$1]}" 2>/dev/null || true; wait "${PID[$1]}" 2>/dev/null || true; PID[$1]=""; }
status_json() { ip netns exec "$NSC" "$Q" cluster status "$ADDR" --json 2>/dev/null; }
leader() { status_json | python3 -c 'import json,sys; r=[x["replica"] for x in json.load(sys.stdin)["replicas"] if x.get("role")=="leader"]; print(r[0] if r else 0)'; }
failures() { status_json | python3 -c 'import json,sys; r=json.load(sys.stdin)["replicas"]['"$1"']; print(r.get("write_back_failures", 0))' 2>/dev/null || echo 0; }
# Waits (bounded) until every replica is up, a member (a new server's count only once
# it applied the change: before, the table still names the old one's copies), and none
# lacks a block of its slices.
settle() {
  local n
  for n in $(seq 1 "${1:-120}"); do
    if status_json | python3 -c 'import json,sys; r=json.load(sys.stdin)["replicas"]; sys.exit(0 if all(x["up"] and x["incomplete"]==0 and x.get("member", True) for x in r) else 1)'; then
      return 0
    fi
    sleep 1
  done
  return 1
}
for i in 0 1 2; do start "$i"; done
settle 60 || fail "the cluster did not come up"
say "3 replicas up in their own namespaces"

# --- the load, and the nemesis ---------------------------------------------------
ip netns exec "$NSC" "$Q" cluster check "$ADDR" --overwrite --seconds "$SECS" --blocks 96 \
  --clients 4 --json >"$W/check.json" 2>"$W/check.err" &
CHECK=$!
step() { say "  $(date +%T) $*"; }
sleep 3
if want kill; then
  step "kill -9 replica 1"; kill9 1; sleep 3
  step "restart replica 1"; start 1; sleep 3
fi
if want partition-leader; then
  L=$(leader || echo 0); step "cut the leader's link (replica $L)"; cut_link "$L"; sleep 5
  step "heal replica $L's link"; heal_link "$L"; sleep 3
fi
if want partition; then
  step "cut replica 2's link"; cut_link 2; sleep 4
  step "heal replica 2's link"; heal_link 2; sleep 2
fi
if want fill; then
  # The check's blocks are allocated on the device already: new data must go to blocks
  # never written, through an NBD export, for the full device to refuse it.
  step "fill replica 1's data device, and write 24 MiB to new blocks through NBD"
  dd if=/dev/zero of="$W/small/filler" bs=1M 2>/dev/null || true
  ip netns exec "$NSC" "$Q" nbd "$ADDR" --listen 127.0.0.1:10809 >"$W/nbd.out" 2>&1 &
  NBD=$!
  for n in $(seq 1 50); do
    ip netns exec "$NSC" qemu-img info nbd://127.0.0.1:10809 >/dev/null 2>&1 && break
    sleep 0.2
  done
  ip netns exec "$NSC" qemu-io -f raw nbd://127.0.0.1:10809 -c "write -P 0x5a 16M 24M" \
    >/dev/null || fail "writes to new blocks failed while one replica's data device was full"
  for n in $(seq 1 50); do
    [ "$(failures 1)" -gt 0 ] && break
    sleep 0.2
  done
  [ "$(failures 1)" -gt 0 ] || fail "replica 1 never met its full device (the fill did not bite)"
  ip netns exec "$NSC" qemu-io -f raw nbd://127.0.0.1:10809 -c "read -P 0x5a 16M 24M" \
    >/dev/null || fail "the 24 MiB written while a data device was full do not read back"
  sleep 3
  step "free it ($(failures 1) write-backs failed on replica 1 meanwhile)"
  rm -f "$W/small/filler"; sleep 2
  ip netns exec "$NSC" qemu-io -f raw nbd://127.0.0.1:10809 -c "read -P 0x5a 16M 24M" \
    >/dev/null || fail "the 24 MiB written while a data device was full do not read back"
  kill "$NBD"; wait "$NBD" 2>/dev/null || true
  NBD=""
fi
if want damage; then
  step "damage replica 2's data blocks (its whole home area, while it runs)"
  head -c $((40 << 20)) /dev/urandom | dd of="$W/r2.data" conv=notrunc bs=1M 2>/dev/null
  sleep 2
  # Damage no read has met yet is a failure too: a scrub finds it, and it is fetched
  # again before the next fault (at most f at a time).
  step "scrub: $(ip netns exec "$NSC" "$Q" cluster scrub "$ADDR" 2>&1 | grep 'replica 2' || true)"
  settle 60 || fail "replica 2's damaged copies were not fetched again"
fi
if want replace-server; then
  # A new machine in slot 1 (the same address here; its data device on the disk, not
  # the small tmpfs): formatted as the slot's second server, started, and let in by the
  # leader. Slot 1 prefers the check's blocks (slice 0), so it has them to rebuild,
  # before the next fault (at most f at a time).
  step "replace replica 1's whole server (both disks) through a membership change"
  kill9 1
  LOG_OF[1]="$W/r1.1.log"; DATA_OF[1]="$W/r1.1.data"
  "$Q" replica format --id 1 --incarnation 1 --log-dev "${LOG_OF[1]}" --data-dev "${DATA_OF[1]}" \
    --size 64M --reserve-slots 1024 2>/dev/null
  start 1
  ip netns exec "$NSC" "$Q" cluster replace "$ADDR" --replica 1 --address "$(addr_of 1)" \
    --incarnation 1 2>"$W/replace.err" || { cat "$W/replace.err" >&2; fail "cluster replace"; }
  settle 60 || fail "replica 1's new server was not rebuilt"
  step "replica 1 is now server $(status_json | python3 -c 'import json,sys; print(json.load(sys.stdin)["replicas"][1]["server"])'), rebuilt"
fi
if want replace; then
  step "replace replica 0's data disk"
  kill9 0; rm -f "${DATA_OF[0]}"; start 0 --new-data-disk
fi
wait "$CHECK" || { cat "$W/check.err" >&2; fail "cluster check failed under faults"; }
CHECK=""
cat "$W/check.json" >&2
python3 - "$W/check.json" <<'PY' || fail "the check's history is too thin to mean anything"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["linearizable"] is True, r
# Enough operations acknowledged, faults or not, that the check says something.
assert r["writes_acked"] >= 500 and r["reads"] >= 500, r
PY
say "history linearizable under kill -9, partitions, a full device, damage, a replaced server and a replaced disk"

# --- every block has its copies again: any one replica down, the same volume ------
settle 120 || fail "the replicas did not finish recovering (status: $(status_json))"
for i in 0 1 2; do
  kill9 "$i"
  ip netns exec "$NSC" "$Q" cluster export "$ADDR" "$W/export-$i" 2>"$W/export.err" ||
    fail "the volume does not read with replica $i down: $(tail -n 2 "$W/export.err")"
  start "$i"
  settle 60 || fail "replica $i did not come back"
done
cmp -s "$W/export-0" "$W/export-1" && cmp -s "$W/export-1" "$W/export-2" ||
  fail "the volume reads differently depending on which replica is down"
say "after recovery the volume reads the same with any one replica down"

# --- the control: one copy acknowledged, then that copy's disk replaced -------------
# The check's blocks all lie in slice 0, whose preferred quorum is replicas 0 and 1.
# Replica 1 runs with a slow Phase 2, so that it does not fetch what it lacks at once;
# replica 0's data disk is replaced after the load. A correct client stored every
# write on both: the volume reads. The control stores on replica 0 only and claims
# both: its writes are gone, and the check must fail.
if ! want control; then say "ok (no control)"; exit 0; fi
control_run() { # control_run [--unsafe-claim-copies]; the check's status
  kill9 1; start 1 --recovery-interval-ms 600000
  settle 30 || fail "replica 1 did not come back"
  ip netns exec "$NSC" "$Q" cluster check "$ADDR" --overwrite --seconds 4 --blocks 96 \
    --clients 4 --hold 14 --final-wait 10 --op-timeout 5 "$@" >"$W/control.out" 2>&1 &
  CHECK=$!
  sleep 6
  kill9 0; rm -f "${DATA_OF[0]}"; start 0 --new-data-disk
  settle 8 || true
  local rc=0
  wait "$CHECK" || rc=$?
  CHECK=""
  kill9 1; start 1
  return "$rc"
}
control_run || { cat "$W/control.out" >&2; fail "the control's scenario fails a correct client"; }
say "the control's scenario with a correct client: $(tail -n 1 "$W/control.out" | cut -d';' -f2)"
settle 60 || fail "the replicas did not recover after the control's scenario"
if control_run --unsafe-claim-copies; then
  cat "$W/control.out" >&2
  fail "the control (writes acknowledged after one copy) was not caught"
fi
say "control caught: $(tail -n 1 "$W/control.out")"
say "ok"
