#!/usr/bin/env bash
# Clones on a betrfs mount with the programs users run, each checked by content (the
# originals as the oracle), and the image by `quiltfs fsck -n` after every unmount:
#  1. cp (copy_file_range, which betrfs shares) and cp --reflink=always through
#     libquilt_preload.so (FICLONE) of a file of 20 MB; each copy equals the original,
#     and writes to either never show in the other.
#  2. quiltfs clone of a tree (/usr/include, with a hard link and a symlink added):
#     diff -r equal, inode numbers of the copy all new, a second clone of the clone,
#     the original removed with rm -rf and the clones still equal to a host copy.
#  3. What cannot be cloned says so: onto an existing name, into itself, on an ext2
#     mount (the clone needs betrfs), without the preload (cp --reflink=always fails
#     with the kernel's answer).
# Needs root. Usage: tests/betrfs-clone.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
preload="$(dirname "$q")/libquilt_preload.so"
[ -f "$preload" ] || { echo "betrfs-clone: $preload is missing (cargo build --release -p quilt-preload)" >&2; exit 1; }
work="$(mktemp -d /var/tmp/quiltfs-betrfs-clone.XXXXXX)"
m="$work/m"; img="$work/img"; mkdir -p "$m" "$work/host"
cleanup() {
  mountpoint -q "$m" && { umount "$m" 2>/dev/null || umount -l "$m" || true; }
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "betrfs-clone: FAIL: $*" >&2; exit 1; }
remount() {
  "$q" umount "$m" >/dev/null
  "$q" fsck -n "$img" >"$work/fsck.out" || { cat "$work/fsck.out"; fail "quiltfs fsck -n after $1"; }
  "$q" mount "$img" "$m" >/dev/null
}
counter() { "$q" stats "$m" | awk -v k="$1" '$1 == k { print $2 }'; }
"$q" mkfs --fs betrfs "$img" --size 4G >/dev/null
"$q" mount "$img" "$m" >/dev/null

# 1. Files.
head -c 20000000 /dev/urandom >"$work/host/big"
cp "$work/host/big" "$m/big"
c0=$(counter fs.clones)
cp "$m/big" "$m/by-cp"
LD_PRELOAD="$preload" cp --reflink=always "$m/big" "$m/by-reflink" || fail "cp --reflink=always with the preload"
c1=$(counter fs.clones)
[ "$((c1 - c0))" -ge 2 ] || fail "cp and cp --reflink made $((c1 - c0)) clones, not 2"
for f in by-cp by-reflink; do cmp -s "$work/host/big" "$m/$f" || fail "$f differs from the original"; done
cp "$work/host/big" "$work/host/by-cp"; cp "$work/host/big" "$work/host/by-reflink"
patch() { printf '%s' "$2" | dd of="$1" bs=1 seek="$3" conv=notrunc status=none; }
patch "$m/by-cp" changed 5000000; patch "$work/host/by-cp" changed 5000000
patch "$m/big" CHANGED 7000000; patch "$work/host/big" CHANGED 7000000
remount files
for f in big by-cp by-reflink; do cmp -s "$work/host/$f" "$m/$f" || fail "$f after writes to the others and a remount"; done
echo "betrfs-clone: cp and cp --reflink share a 20 MB file; writes to each stay its own, after a remount too"

# 2. Trees.
tar cf "$work/include.tar" -C /usr include
tar xf "$work/include.tar" -C "$work/host"
tar xf "$work/include.tar" -C "$m"
ln "$m/include/stdio.h" "$m/include/stdio-link.h"; ln "$work/host/include/stdio.h" "$work/host/include/stdio-link.h"
ln -s stdio.h "$m/include/stdio-sym.h"; ln -s stdio.h "$work/host/include/stdio-sym.h"
"$q" clone "$m/include" "$m/copy" 2>"$work/clone.out" || { cat "$work/clone.out"; fail "quiltfs clone"; }
diff -r --no-dereference "$m/include" "$m/copy" >/dev/null || fail "the clone differs from the original"
find "$m/include" -printf '%i\n' | sort -u >"$work/inos.a"
find "$m/copy" -printf '%i\n' | sort -u >"$work/inos.b"
[ -z "$(comm -12 "$work/inos.a" "$work/inos.b")" ] || fail "the clone shares inode numbers with the original"
[ "$(stat -c %h "$m/copy/stdio.h")" = 2 ] && [ "$(stat -c %i "$m/copy/stdio.h")" = "$(stat -c %i "$m/copy/stdio-link.h")" ] \
  || fail "the clone's hard link is not one inode with two names"
echo '/* only in the clone */' >>"$m/copy/stdio.h"
grep -q 'only in the clone' "$m/include/stdio.h" && fail "a write to the clone reached the original"
cp "$work/host/include/stdio.h" "$work/stdio.orig"
"$q" clone "$m/copy" "$m/copy2" 2>/dev/null || fail "a clone of a clone"
diff -r --no-dereference "$m/copy" "$m/copy2" >/dev/null || fail "the clone of the clone differs"
rm -rf "$m/include"
echo '/* only in the clone */' >>"$work/host/include/stdio.h"
remount trees
for d in copy copy2; do
  diff -r --no-dereference "$work/host/include" "$m/$d" >/dev/null || fail "$d differs from the host's tree after rm -rf of the original and a remount"
done
echo "betrfs-clone: quiltfs clone of /usr/include ($(find "$m/copy" | wc -l) names): equal, new inode numbers, its hard link kept; a clone of it; both whole after rm -rf of the original"

# 3. Refusals.
"$q" clone "$m/copy" "$m/copy2" 2>"$work/err" && fail "a clone onto an existing name"
grep -qi "exists" "$work/err" || fail "onto an existing name: $(cat "$work/err")"
"$q" clone "$m/copy" "$m/copy/inside" 2>"$work/err" && fail "a clone into itself"
cp --reflink=always "$m/big" "$m/no-preload" 2>/dev/null && fail "cp --reflink=always without the preload succeeded (FUSE cannot carry FICLONE)"
"$q" umount "$m" >/dev/null
"$q" fsck -n "$img" >/dev/null || fail "quiltfs fsck -n at the end"
rm -f "$img"; "$q" mkfs "$img" --size 256M >/dev/null; "$q" mount "$img" "$m" >/dev/null
mkdir "$m/d"
"$q" clone "$m/d" "$m/e" 2>"$work/err" && fail "a clone on an ext2 mount"
grep -q "betrfs" "$work/err" || fail "the ext2 refusal does not say why: $(cat "$work/err")"
"$q" umount "$m" >/dev/null
echo "betrfs-clone: refusals are clear (existing name, into itself, no preload, ext2)"
