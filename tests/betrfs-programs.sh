#!/usr/bin/env bash
# Real programs on a betrfs mount, each checked for the right contents afterwards, and
# the image checked by `quiltfs fsck -n` after every unmount:
#  1. untar: a tarball of /usr/include (FULL=1: Debian's linux-source) extracted, then
#     compared file by file with the same tarball extracted on the host; after a
#     remount too; then rm -rf leaves the directory empty.
#  2. git: init, add and commit a source tree, log, fsck --full; a clone out of the
#     mount equals the tree.
#  3. SQLite: a database in rollback-journal mode and one in WAL mode, a few thousand
#     transactions each, then integrity_check and the row sums, after a remount too.
#  4. Dovecot: `quiltfs bench mail --quick` on betrfs, with fsync and with patchgroups
#     (the bench checks that every message moved and runs quiltfs fsck).
# Needs root. Usage: tests/betrfs-programs.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /var/tmp/quiltfs-betrfs-programs.XXXXXX)"
chmod 755 "$work"  # Dovecot runs as its own user below it
m="$work/m"; img="$work/img"; mkdir -p "$m" "$work/host"
cleanup() {
  mountpoint -q "$m" && { umount "$m" 2>/dev/null || umount -l "$m" || true; }
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "betrfs-programs: FAIL: $*" >&2; exit 1; }
for p in git sqlite3 tar; do command -v "$p" >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null; done
remount() {
  "$q" umount "$m" >/dev/null
  "$q" fsck -n "$img" >"$work/fsck.out" || { cat "$work/fsck.out"; fail "quiltfs fsck -n after $1"; }
  "$q" mount "$img" "$m" >/dev/null
}
"$q" mkfs --fs betrfs "$img" --size 8G >/dev/null
"$q" mount "$img" "$m" >/dev/null

# 1. untar
if [ "${FULL:-0}" = 1 ]; then
  tarball=/var/tmp/quiltfs-bench-featherstitch/linux.tar
  [ -f "$tarball" ] || { xz -dc -T2 /usr/src/linux-source-6.1.tar.xz >"$work/linux.tar"; tarball="$work/linux.tar"; }
else
  tarball="$work/include.tar"; tar cf "$tarball" -C /usr include
fi
tar xf "$tarball" -C "$work/host"
tar xf "$tarball" -C "$m"
diff -r --no-dereference -x lost+found "$work/host" "$m" >/dev/null || fail "untar: the extracted tree differs from the host's"
n=$(find "$m" | wc -l)
remount untar
diff -r --no-dereference -x lost+found "$work/host" "$m" >/dev/null || fail "untar: the tree differs after a remount"
top=$(ls "$m" | grep -v lost+found)
rm -rf "${m:?}/$top"
[ "$(ls "$m")" = lost+found ] || fail "rm -rf left $(ls "$m")"
echo "betrfs-programs: untar of $n names matches the host's, after a remount too; rm -rf empties it"

# 2. git
mkdir "$m/repo"
cp -r "$here/../crates" "$m/repo/"
( cd "$m/repo" && git init -q && git add -A && git -c user.email=t@q -c user.name=t commit -qm "the tree" \
  && git log --oneline | grep "the tree" >/dev/null && git fsck --full --no-progress ) >/dev/null 2>&1 || fail "git on the mount"
remount git
( cd "$m/repo" && git fsck --full --no-progress ) >/dev/null 2>&1 || fail "git fsck after a remount"
git clone -q "$m/repo" "$work/clone" 2>/dev/null || fail "git clone out of the mount"
diff -r "$here/../crates" "$work/clone/crates" >/dev/null || fail "git: the clone differs from the tree committed"
echo "betrfs-programs: git init/add/commit/log/fsck on the mount; the clone equals the tree"

# 3. SQLite
python3 - "$m" <<'PY'
import sqlite3, sys
m = sys.argv[1]
for mode in ["delete", "wal"]:
    db = sqlite3.connect(f"{m}/{mode}.db")
    db.execute(f"pragma journal_mode={mode}")
    db.execute("create table t(k integer primary key, v text, n integer)")
    for i in range(2000):
        with db:
            db.execute("insert into t(v, n) values (?, ?)", ("x" * (i % 300), i))
            if i % 7 == 0:
                db.execute("update t set n = n + 1 where k = ?", (i // 2 + 1,))
            if i % 11 == 0:
                db.execute("delete from t where k = ?", (i // 3 + 1,))
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
    db.close()
PY
remount sqlite
python3 - "$m" <<'PY'
import sqlite3, sys
m = sys.argv[1]
for mode in ["delete", "wal"]:
    # The same history in memory: the oracle.
    ref = sqlite3.connect(":memory:")
    ref.execute("create table t(k integer primary key, v text, n integer)")
    for i in range(2000):
        ref.execute("insert into t(v, n) values (?, ?)", ("x" * (i % 300), i))
        if i % 7 == 0:
            ref.execute("update t set n = n + 1 where k = ?", (i // 2 + 1,))
        if i % 11 == 0:
            ref.execute("delete from t where k = ?", (i // 3 + 1,))
    db = sqlite3.connect(f"{m}/{mode}.db")
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok", mode
    q = "select count(*), sum(n), sum(length(v)) from t"
    got, want = db.execute(q).fetchone(), ref.execute(q).fetchone()
    assert got == want, (mode, got, want)
    db.close()
print("betrfs-programs: SQLite (rollback journal and WAL): integrity ok, contents equal an in-memory replay, after a remount")
PY
"$q" umount "$m" >/dev/null
"$q" fsck -n "$img" >/dev/null || fail "quiltfs fsck -n at the end"

# 4. Dovecot
"$q" bench mail --quick --configs betrfs-fsync,betrfs-pg --work "$work/mail" >"$work/mail.out" 2>&1 \
  || { tail -20 "$work/mail.out"; fail "Dovecot's mailbox move on betrfs"; }
echo "betrfs-programs: Dovecot moved every message on betrfs (fsync and patchgroups), fsck clean"
