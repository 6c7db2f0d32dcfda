#!/usr/bin/env bash
# betrfs against the kernel's ext2 driver as the oracle: the probes of
# tests/kernel-parity.sh that are about POSIX behaviour (not ext2's on-disk format) run
# on a kernel ext2 loop mount and on a betrfs mount, and must print the same results
# and errno values: SEEK_DATA/SEEK_HOLE, O_TMPFILE and linkat, the hard-link limit,
# RENAME_WHITEOUT, inode flags (chattr/lsattr, as root and as another user), POSIX ACLs
# (setfacl/getfacl, access through the mask, default ACLs, who may set them), fallocate
# PUNCH_HOLE. After each, `quiltfs fsck -n` must find the image clean.
# Needs root. Usage: tests/kernel-parity-betrfs.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /tmp/quiltfs-parity-betrfs.XXXXXX)"
chmod 755 "$work"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
cleanup() {
  for d in "$m" "$k"; do mountpoint -q "$d" && { umount "$d" || umount -l "$d" || true; }; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "kernel-parity-betrfs: FAIL: $*" >&2; exit 1; }
fresh() {  # kernel and betrfs images of 256 MiB
  rm -f "$work/k.img" "$work/b.img"
  truncate -s 256M "$work/k.img"; mkfs.ext2 -F -q -b 4096 -I 256 "$work/k.img"
  "$q" mkfs --fs betrfs "$work/b.img" --size 256M >/dev/null
}
clean() { "$q" fsck -n "$work/b.img" >"$work/fsck.out" || { cat "$work/fsck.out"; fail "quiltfs fsck -n after $1"; }; }
# compare NAME SCRIPT...: runs the script with DIR=$k then DIR=$m; outputs must match.
compare() {
  local name="$1"; shift
  mount -o loop -t ext2 "$work/k.img" "$k"
  DIR="$k" bash -c "$*" >"$work/$name.kernel" 2>&1 || true
  umount "$k"
  "$q" mount "$work/b.img" "$m" -o allow_other >/dev/null
  DIR="$m" bash -c "$*" >"$work/$name.ours" 2>&1 || true
  umount "$m"
  [ -s "$work/$name.kernel" ] || fail "$name: the kernel run printed nothing"
  # statfs's inode counts: betrfs has no inode table (they follow free space).
  sed -i '/^inodes used by the run:/d' "$work/$name.kernel" "$work/$name.ours"
  if [ "$name" = punch ]; then
    # st_blocks: ext2 counts its indirect blocks too, betrfs only data blocks; betrfs's
    # must be exactly the blocks its data map covers. Then the rest must match.
    python3 - "$work/$name.ours" <<'PY' || fail "punch: st_blocks is not the data map's blocks"
import re, sys
for line in open(sys.argv[1]):
    m = re.search(r"blocks (\d+) data (\S*)", line)
    if not m:
        continue
    want = 0
    for r in filter(None, m.group(2).split(",")):
        a, b = map(int, r.split("-"))
        want += (-(-b // 4096) - a // 4096) * 8
    assert int(m.group(1)) == want, (line, want)
PY
    sed -i -E 's/ blocks [0-9]+ / blocks - /' "$work/$name.kernel" "$work/$name.ours"
  fi
  diff -u "$work/$name.kernel" "$work/$name.ours" || fail "$name differs from the kernel's"
  clean "$name"
  echo "kernel-parity-betrfs: $name: $(wc -l <"$work/$name.ours") lines as the kernel's"
}
fresh
compare seek "python3 '$here/seekholes.py' write \"\$DIR\" && python3 '$here/seekholes.py' probe \"\$DIR\""
compare tmpfile "mkdir \"\$DIR/t\" && python3 '$here/tmpfile.py' \"\$DIR/t\""
compare links "python3 '$here/links.py' \"\$DIR\""
compare whiteout "mkdir \"\$DIR/w\" && python3 '$here/whiteout.py' \"\$DIR/w\""
fresh
compare flags "mkdir \"\$DIR/f\" && python3 '$here/flags.py' setup \"\$DIR/f\" && lsattr -R \"\$DIR/f\" 2>&1 | sed \"s#\$DIR##\" | sort && python3 '$here/flags.py' probe \"\$DIR/f\""
fresh
compare acl "mkdir \"\$DIR/a\" && python3 '$here/acl.py' setup \"\$DIR/a\" && python3 '$here/acl.py' probe \"\$DIR/a\""
fresh
compare punch "mkdir \"\$DIR/f\" && python3 '$here/fallocate.py' punch \"\$DIR/f\""
