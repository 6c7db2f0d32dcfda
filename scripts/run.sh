#!/usr/bin/env bash
# Sets everything up and runs quiltfs's main job on its embedded default: an ext2 image
# file on local disk (./quiltfs.img, 1 GiB, sparse), mounted through FUSE in soft-updates
# mode at ./quiltfs-mnt, filled with a copy of /usr/share (real files, links, symlinks),
# read back and compared, unmounted (which waits for the final write-back), checked with
# e2fsck -fn and the kernel's own ext2 driver. Prints the server's counters. With
# --fs betrfs the image is betrfs (the Bε-tree file system), checked with quiltfs fsck.
#   scripts/run.sh [--mode async|soft-updates] [--fs ext2|betrfs] [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mode=soft-updates; keep=0; fs=ext2
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) mode="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --fs) fs="$2"; shift 2 ;;
    *) echo "usage: scripts/run.sh [--mode async|soft-updates] [--fs ext2|betrfs] [--keep]" >&2; exit 2 ;;
  esac
done
q=./target/release/quiltfs
img="$PWD/quiltfs.img"; mnt="$PWD/quiltfs-mnt"; k="$PWD/quiltfs-kernel"
mkdir -p "$mnt" "$k"
cleanup() { mountpoint -q "$mnt" && umount "$mnt" || true; mountpoint -q "$k" && umount "$k" || true; rmdir "$k" 2>/dev/null || true; }
trap cleanup EXIT
force=()
if [ -e "$img" ]; then echo "run: replacing $img (kept by an earlier run)"; force=(--force); fi
"$q" mkfs --fs "$fs" "$img" --size 1G "${force[@]}"
if [ "$fs" = betrfs ]; then "$q" mount "$img" "$mnt"; else "$q" mount "$img" "$mnt" --mode "$mode"; fi
src=/usr/share
start=$(date +%s.%N)
cp -a "$src" "$mnt/share"
echo "run: copied $(find "$mnt/share" | wc -l) entries from $src in $(echo "$(date +%s.%N) - $start" | bc | cut -c1-5) s"
diff -r --no-dereference "$src" "$mnt/share" >/dev/null || { echo "run: FAIL: the copy differs" >&2; exit 1; }
echo "run: contents read back identical"
"$q" stats "$mnt" | grep -E '^(fs|patch\.(patches_created|patches_merged|patches_made_hard|patches_rolled_back|undo_bytes_total|blocks_written|epochs)|device\.(writes|flushes))'
"$q" umount "$mnt"
if [ "$fs" = betrfs ]; then
  "$q" fsck -n "$img" || { echo "run: FAIL: quiltfs fsck -n" >&2; exit 1; }
  echo "run: quiltfs fsck -n: clean"
  "$q" mount "$img" "$mnt" -o ro
  diff -r --no-dereference "$src" "$mnt/share" >/dev/null || { echo "run: FAIL: the tree differs after a remount" >&2; exit 1; }
  echo "run: mounted again, the same tree"
  "$q" umount "$mnt"
else
  e2fsck -fn "$img" >/dev/null 2>&1 || { echo "run: FAIL: e2fsck -fn" >&2; exit 1; }
  echo "run: e2fsck -fn: clean"
  mount -o loop,ro -t ext2 "$img" "$k"
  diff -r --no-dereference "$src" "$k/share" >/dev/null || { echo "run: FAIL: the kernel reads another tree" >&2; exit 1; }
  echo "run: the kernel's ext2 driver reads the same tree"
  umount "$k"
fi
[ "$keep" = 1 ] || rm -f "$img"
echo "run: done (--keep keeps $img; mount it again with: $q mount $img $mnt)"
