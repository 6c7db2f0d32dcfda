#!/usr/bin/env bash
# The kernel's ext3 driver, e2fsck and debugfs as oracles for the journal (issue #4):
#  1. `quiltfs mkfs --journal` makes ext3 that e2fsck and the kernel accept; the kernel
#     writes a tree on it and quiltfs (meta-journal) reads the same tree.
#  2. A journal the kernel left dirty (the image copied while mounted): our replay and
#     e2fsck -fy's give the same tree, and both are clean.
#  3. kill -9 of the server mid-workload, in both journal modes, KILLS times each with
#     varying timing: `debugfs logdump` reads our journal; e2fsck -fy's replay and ours
#     give the same tree, both clean; a file fsynced before the kill is intact.
#  4. A Debian mkfs.ext3 image: quiltfs journals on it, is killed, and the kernel's own
#     mount replays the journal; e2fsck is clean afterwards.
#  5. journal_checksum (the kernel sets it): e2fsck verifies the CRCs in our commit
#     blocks; a flipped byte in the log stops both recoveries at the same transaction.
#  6. A tiny journal (1024 blocks) under a long workload: the log wraps many times and
#     fills, writers wait for checkpoints, and nothing is lost.
#  7. Log skipping, in inode 8 and on an external journal device (the kernel's layout,
#     behind the 7200 RPM disk model): killed mid-workload, the kernel and e2fsck refuse
#     the journal's skip records rather than misread them; our replay keeps the fsynced
#     file and leaves plain ext3 that the kernel mounts (journal_path=) and e2fsck -j
#     finds clean.
# Needs root. Usage: tests/journal-oracle.sh [QUILTFS_BINARY]   (KILLS=N, default 6; 2
# under CI=true)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
kills="${KILLS:-6}"
[ "${CI:-}" = true ] && kills="${KILLS:-2}"
work="$(mktemp -d /tmp/quiltfs-journal.XXXXXX)"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
srv=""
cleanup() {
  [ -n "$srv" ] && kill -9 "$srv" 2>/dev/null || true
  mountpoint -q "$m" && umount -l "$m" || true
  mountpoint -q "$k" && umount "$k" || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "journal-oracle: FAIL: $*" >&2; exit 1; }
fsck_clean() { e2fsck -fn "$1" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck -fn reports problems on $1"; }; }
manifest_of() { # IMAGE OUT: the kernel's read-only view of IMAGE (no journal replay)
  mount -o loop,ro,noload -t ext3 "$1" "$k"
  python3 "$here/manifest.py" "$k" >"$2"
  umount "$k"
}
# Compares e2fsck -fy's replay of IMAGE with ours (quiltfs mount + unmount), and checks
# both are clean. $2: a path that must hold $3 afterwards (an fsynced file), or "".
replay_both() {
  local img="$1" must="$2" want="$3" mode="$4"
  cp --sparse=always "$img" "$work/a.img"; cp --sparse=always "$img" "$work/b.img"
  e2fsck -fy "$work/a.img" >"$work/fy.out" 2>&1 || [ $? -le 1 ] || { cat "$work/fy.out"; fail "e2fsck -fy failed"; }
  fsck_clean "$work/a.img"
  "$q" mount "$work/b.img" "$m" --mode "$mode" >/dev/null
  if [ -n "$must" ]; then
    [ "$(cat "$m/$must")" = "$want" ] || fail "the fsynced file $must lost its contents"
  fi
  umount "$m"
  fsck_clean "$work/b.img"
  manifest_of "$work/a.img" "$work/ma.txt"
  manifest_of "$work/b.img" "$work/mb.txt"
  diff -u "$work/ma.txt" "$work/mb.txt" || fail "our replay and e2fsck's differ"
}

echo "journal-oracle: mkfs --journal makes ext3 the kernel and e2fsck accept"
"$q" mkfs "$work/j.img" --size 1G --journal >/dev/null
fsck_clean "$work/j.img"
dumpe2fs -h "$work/j.img" 2>/dev/null | grep "has_journal" >/dev/null || fail "no has_journal feature"
mount -o loop -t ext3 "$work/j.img" "$k"
bash "$here/build-tree.sh" "$k"
python3 "$here/manifest.py" "$k" >"$work/kernel.txt"
umount "$k"
fsck_clean "$work/j.img"
"$q" mount "$work/j.img" "$m" --mode meta-journal >/dev/null
python3 "$here/manifest.py" "$m" >"$work/ours.txt"
umount "$m"
diff -u "$work/kernel.txt" "$work/ours.txt" || fail "quiltfs reads the kernel's ext3 tree differently"
fsck_clean "$work/j.img"
rm -f "$work/j.img"

echo "journal-oracle: a journal the kernel left dirty: our replay equals e2fsck's"
"$q" mkfs "$work/j.img" --size 256M --journal --force >/dev/null
mount -o loop -t ext3 "$work/j.img" "$k"
cp -a "$here/../crates" "$k/"
mkdir "$k/d"; for i in $(seq 1 200); do echo "$i" >"$k/d/f$i"; done
rm -rf "$k/crates/engine/patch"; sync -f "$k"; mv "$k/d" "$k/e"; sync -f "$k"
cp --sparse=always "$work/j.img" "$work/dirty.img"
umount "$k"
dumpe2fs -h "$work/dirty.img" 2>/dev/null | grep needs_recovery >/dev/null || fail "the copy does not need recovery (test setup)"
replay_both "$work/dirty.img" "" "" meta-journal
rm -f "$work/j.img" "$work/dirty.img"

# A metadata-heavy workload with an fsync in the middle; it runs until killed.
workload() {
  local d="$1"
  for r in 1 2 3 4 5 6 7 8 9 10; do
    mkdir -p "$d/r$r"
    for i in $(seq 1 60); do echo "$r.$i" >"$d/r$r/f$i"; done
    ln "$d/r$r/f1" "$d/r$r/hard" 2>/dev/null || true
    mv "$d/r$r/f2" "$d/r$r/g2"
    rm -f "$d/r$r/f3"
    if [ "$r" = 2 ]; then
      python3 -c "import os,sys; fd=os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY|os.O_TRUNC, 0o644); os.write(fd, b'fsynced'); os.fsync(fd)" "$d/synced"
      echo ready >"$work/synced.flag"
    fi
    [ "$r" -gt 5 ] && rm -rf "$d/r$((r - 5))"
  done
}

for mode in meta-journal full-journal; do
  for n in $(seq 1 "$kills"); do
    echo "journal-oracle: kill -9 in $mode mode ($n/$kills)"
    "$q" mkfs "$work/j.img" --size 256M --journal --force >/dev/null
    "$q" mount "$work/j.img" "$m" --mode "$mode" --foreground >/dev/null 2>&1 &
    srv=$!
    for _ in $(seq 1 100); do mountpoint -q "$m" && break; sleep 0.05; done
    rm -f "$work/synced.flag"
    (workload "$m" 2>/dev/null || true) &
    wl=$!
    for _ in $(seq 1 200); do [ -f "$work/synced.flag" ] && break; sleep 0.02; done
    sleep "0.$((RANDOM % 8))"
    kill -9 "$srv"; wait "$srv" 2>/dev/null || true; srv=""
    wait "$wl" 2>/dev/null || true
    umount -l "$m" 2>/dev/null || true
    [ -f "$work/synced.flag" ] || fail "the workload did not reach its fsync"
    debugfs -R logdump "$work/j.img" 2>/dev/null | grep "commit block" >/dev/null \
      || fail "debugfs logdump finds no committed transaction in our journal"
    replay_both "$work/j.img" synced fsynced "$mode"
    rm -f "$work/j.img"
  done
done

echo "journal-oracle: a Debian mkfs.ext3 image: quiltfs journals, is killed, the kernel replays"
truncate -s 512M "$work/d.img"
mkfs.ext3 -F -q "$work/d.img"
"$q" mount "$work/d.img" "$m" --mode meta-journal --foreground >/dev/null 2>&1 &
srv=$!
for _ in $(seq 1 100); do mountpoint -q "$m" && break; sleep 0.05; done
rm -f "$work/synced.flag"
workload "$m"
kill -9 "$srv"; wait "$srv" 2>/dev/null || true; srv=""
umount -l "$m" 2>/dev/null || true
mount -o loop -t ext3 "$work/d.img" "$k"
[ "$(cat "$k/synced")" = fsynced ] || fail "the kernel's replay lost the fsynced file"
umount "$k"
fsck_clean "$work/d.img"
rm -f "$work/d.img"

echo "journal-oracle: journal_checksum (set by the kernel): e2fsck verifies our commit CRCs"
"$q" mkfs "$work/c.img" --size 256M --journal >/dev/null
mount -o loop,journal_checksum -t ext4 "$work/c.img" "$k"; echo x >"$k/x"; umount "$k"
dumpe2fs -h "$work/c.img" 2>/dev/null | grep "journal_checksum" >/dev/null || fail "the kernel did not set journal_checksum (test setup)"
"$q" mount "$work/c.img" "$m" --mode meta-journal --foreground >/dev/null 2>&1 &
srv=$!
for _ in $(seq 1 100); do mountpoint -q "$m" && break; sleep 0.05; done
workload "$m"
kill -9 "$srv"; wait "$srv" 2>/dev/null || true; srv=""
umount -l "$m" 2>/dev/null || true
replay_both "$work/c.img" synced fsynced meta-journal
# A flipped byte in a logged block: both recoveries must stop before that transaction.
first=$(debugfs -R "logdump" "$work/c.img" 2>/dev/null | awk '/descriptor block/ {print $NF; exit}')
[ -n "$first" ] || fail "no descriptor block in the log"
jb=$(debugfs -R "bmap <8> $((first + 1))" "$work/c.img" 2>/dev/null)
printf '\x55' | dd of="$work/c.img" bs=1 seek=$((jb * 4096 + 100)) conv=notrunc 2>/dev/null
replay_both "$work/c.img" "" "" meta-journal
rm -f "$work/c.img"

echo "journal-oracle: a tiny journal under a long workload (wrap-around, full log)"
"$q" mkfs "$work/t.img" --size 512M --journal --journal-size 4M >/dev/null
"$q" mount "$work/t.img" "$m" --mode full-journal >/dev/null
mkdir -p "$work/src"
for i in $(seq 1 24); do head -c 1M /dev/urandom >"$work/src/f$i"; done
cp -a "$here/../crates" "$work/src/"
cp -a "$work/src" "$m/c1"
cp -a "$m/c1" "$m/c2"
rm -rf "$m/c1"
cp -a "$m/c2" "$m/c3"
"$q" stats "$m" --json >"$work/stats.json"
diff -r "$work/src" "$m/c3" >/dev/null || fail "data lost under a full journal"
diff -r "$work/src" "$m/c2" >/dev/null || fail "data lost under a full journal"
umount "$m"
fsck_clean "$work/t.img"
python3 - "$work/stats.json" <<'PY' || fail "the tiny journal did not wrap and fill as expected"
import json, sys
s = json.load(open(sys.argv[1]))
blocks, waits = s["journal.journal_blocks_written"], s["journal.log_full_waits"]
print(f"journal-oracle: tiny journal: {s['journal.transactions']} transactions, {blocks} log blocks written (the log holds 1023), {s['journal.checkpoints']} checkpoints ({s['journal.forced_checkpoints']} forced), {waits} waits for room")
assert blocks > 3 * 1023 and waits > 0 and s["journal.checkpoints"] > 0
PY
for where in internal external; do
  for mode in meta-journal full-journal; do
    echo "journal-oracle: log skipping ($where journal, $mode): killed, refused by the kernel and e2fsck, replayed by us"
    jopt=(); mopt=(); fsck_j=(); kopt=""
    if [ "$where" = external ]; then
      jopt=(--journal-dev "$work/jd.img" --journal-size 16M)
      mopt=(-o "journal_dev=$work/jd.img,journal_model=7200")
      fsck_j=(-j "$work/jd.img")
    fi
    "$q" mkfs "$work/s.img" --size 256M --journal --journal-placement skip "${jopt[@]}" --force >/dev/null
    "$q" mount "$work/s.img" "$m" --mode "$mode" "${mopt[@]}" --foreground >/dev/null 2>&1 &
    srv=$!
    for _ in $(seq 1 100); do mountpoint -q "$m" && break; sleep 0.05; done
    rm -f "$work/synced.flag"
    (workload "$m" 2>/dev/null || true) &
    wl=$!
    for _ in $(seq 1 400); do [ -f "$work/synced.flag" ] && break; sleep 0.02; done
    sleep "0.$((RANDOM % 5))"
    kill -9 "$srv"; wait "$srv" 2>/dev/null || true; srv=""
    wait "$wl" 2>/dev/null || true
    umount -l "$m" 2>/dev/null || true
    [ -f "$work/synced.flag" ] || fail "the workload did not reach its fsync"
    if e2fsck -fn "${fsck_j[@]}" "$work/s.img" >"$work/fsck.out" 2>&1; then
      fail "e2fsck accepted a journal with skip records"
    fi
    grep -q "unknown incompatible feature" "$work/fsck.out" || { cat "$work/fsck.out"; fail "e2fsck did not refuse the skip records"; }
    if [ "$where" = external ]; then
      jl=$(losetup -f --show "$work/jd.img"); fl=$(losetup -f --show "$work/s.img")
      if mount -t ext3 -o "journal_path=$jl" "$fl" "$k" 2>/dev/null; then
        umount "$k"; losetup -d "$fl" "$jl"; fail "the kernel mounted a journal with skip records"
      fi
      losetup -d "$fl"; losetup -d "$jl"
    elif mount -o loop -t ext3 "$work/s.img" "$k" 2>/dev/null; then
      umount "$k"; fail "the kernel mounted a journal with skip records"
    fi
    "$q" mount "$work/s.img" "$m" --mode "$mode" "${mopt[@]}" >/dev/null
    [ "$(cat "$m/synced")" = fsynced ] || fail "log skipping lost the fsynced file"
    umount "$m"
    e2fsck -fn "${fsck_j[@]}" "$work/s.img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck -fn reports problems after our replay"; }
    if [ "$where" = external ]; then
      jl=$(losetup -f --show "$work/jd.img"); fl=$(losetup -f --show "$work/s.img")
      mount -t ext3 -o "journal_path=$jl" "$fl" "$k" || { losetup -d "$fl" "$jl"; fail "the kernel refuses the replayed image"; }
      ok=$(cat "$k/synced"); umount "$k"; losetup -d "$fl"; losetup -d "$jl"
    else
      mount -o loop -t ext3 "$work/s.img" "$k" || fail "the kernel refuses the replayed image"
      ok=$(cat "$k/synced"); umount "$k"
    fi
    [ "$ok" = fsynced ] || fail "the kernel reads the fsynced file differently"
    rm -f "$work/s.img" "$work/jd.img"
  done
done
echo "journal-oracle: all checks passed"
