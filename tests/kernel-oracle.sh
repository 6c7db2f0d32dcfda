#!/usr/bin/env bash
# The Linux kernel and e2fsck as oracles for the ext2 module, both directions:
#  1. quiltfs writes a tree (every operation, holes, a 5 GiB sparse file, links, device
#     nodes, xattrs), is unmounted; e2fsck -fn must be clean and the kernel's view must
#     equal the view through quiltfs. In soft updates, in async, and through the kernel's
#     writeback cache (whose flushed times must be the ones programs saw).
#  2. The kernel writes the same tree on a Debian mkfs.ext2 image; quiltfs must read it
#     identically, change it, and leave it clean for e2fsck.
# Needs root (loop mounts). Usage: tests/kernel-oracle.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /tmp/quiltfs-oracle.XXXXXX)"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
cleanup() {
  mountpoint -q "$m" && umount "$m" || true
  mountpoint -q "$k" && umount "$k" || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "kernel-oracle: FAIL: $*" >&2; exit 1; }
fsck_clean() { e2fsck -fn "$1" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "e2fsck -fn reports problems on $1"; }; }

for run in soft-updates async soft-updates,wbcache; do
  mode="${run%%,*}"; opts=nowbcache; [ "$run" = "${run%,wbcache}" ] || opts=wbcache
  echo "kernel-oracle: quiltfs ($run) writes, the kernel reads"
  "$q" mkfs "$work/q.img" --size 8G >/dev/null
  "$q" mount "$work/q.img" "$m" --mode "$mode" -o "$opts" >/dev/null
  bash "$here/build-tree.sh" "$m"
  python3 "$here/manifest.py" "$m" >"$work/ours.txt"
  # The cache flushes times at the unmount, at least a second after the writes.
  [ "$opts" = nowbcache ] || sleep 1.2
  umount "$m"
  fsck_clean "$work/q.img"
  mount -o loop,ro -t ext2 "$work/q.img" "$k"
  python3 "$here/manifest.py" "$k" >"$work/kernel.txt"
  umount "$k"
  diff -u "$work/kernel.txt" "$work/ours.txt" || fail "the kernel sees a different tree ($run)"
  [ "$(wc -l <"$work/ours.txt")" -gt 300 ] || fail "manifest suspiciously short"
  rm -f "$work/q.img"
done

echo "kernel-oracle: the kernel writes (Debian mkfs.ext2 defaults), quiltfs reads and changes"
truncate -s 8G "$work/k.img"
mkfs.ext2 -F -q "$work/k.img"
mount -o loop "$work/k.img" "$k"
bash "$here/build-tree.sh" "$k"
python3 "$here/manifest.py" "$k" >"$work/kernel.txt"
umount "$k"
"$q" mount "$work/k.img" "$m" >/dev/null
python3 "$here/manifest.py" "$m" >"$work/ours.txt"
diff -u "$work/kernel.txt" "$work/ours.txt" || fail "quiltfs reads the kernel's tree differently"
# Change it through quiltfs: in-inode xattrs move to a block, htree-free directory
# growth, deletes of kernel-made files.
rm -rf "$m/many" "$m/d1"
setfattr -n user.more -v 1 "$m/one"
setfattr -x user.color "$m/b4096"
mkdir "$m/new"; for i in $(seq 1 300); do echo "$i" >"$m/new/f$i"; done
mv "$m/b4097" "$m/new/"
python3 "$here/manifest.py" "$m" >"$work/ours2.txt"
umount "$m"
fsck_clean "$work/k.img"
mount -o loop,ro "$work/k.img" "$k"
python3 "$here/manifest.py" "$k" >"$work/kernel2.txt"
umount "$k"
diff -u "$work/kernel2.txt" "$work/ours2.txt" || fail "the kernel sees quiltfs's changes differently"
echo "kernel-oracle: all checks passed"
