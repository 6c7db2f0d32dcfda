#!/usr/bin/env bash
# Images made by earlier format versions open, read right, take writes and stay clean
# (README "Formats and versions", quiltfs-formats(5)):
#  1. betrfs made by the quiltfs of commit 52cba76 (superblock and inode records
#     version 1, tree header version 1): `quiltfs stats` names those versions, `quiltfs
#     fsck` finds it clean, a mount shows exactly the files that build wrote (the
#     manifest taken through its own mount, tests/compat/betrfs-v1.manifest), takes new
#     files and changes, and after the unmount fsck is clean and the records are the
#     current version.
#  1b. betrfs made by the quiltfs of commit 609eb35 (tree header version 3, the last
#     before puts by reference): read right, written (a file of whole blocks, an
#     append), its header rewritten as version 4, fsck clean, the data read back.
#  2. betrfs's first development layout (commit 3d4f672, inode records without a block
#     count) is refused with a message that says so, and left unchanged.
#  3. ext2 revision 0 (the original layout, made here by Debian's mke2fs -r 0 and
#     filled by debugfs, both independent of quiltfs): quiltfs reads every file, writes
#     more, and e2fsck -fn is clean; the kernel's ext2 reads what quiltfs wrote.
# tests/compat/populate.sh and manifest.py made the fixtures (see their headers).
# Needs root (FUSE and loop mounts). Usage: tests/compat.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
fx="$here/compat"
work="$(mktemp -d /tmp/quiltfs-compat.XXXXXX)"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
cleanup() {
  for d in "$m" "$k"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "compat: FAIL: $*" >&2; exit 1; }
clean() { e2fsck -fn "$1" >"$work/e2fsck.log" 2>&1 || { cat "$work/e2fsck.log" >&2; return 1; }; }
stat_of() { "$q" stats "$1" --json | python3 -c "import json,sys; print(json.load(sys.stdin).get('$2'))"; }

echo "compat: 1. betrfs of commit 52cba76 (records and tree header version 1)"
img="$work/v1.img"
gunzip -c "$fx/betrfs-v1.img.gz" > "$img"
[ "$(stat_of "$img" format.superblock_version)" = 1 ] || fail "stats: superblock version $(stat_of "$img" format.superblock_version), not 1"
[ "$(stat_of "$img" format.tree_header_version)" = 1 ] || fail "stats: tree header version not 1"
"$q" fsck -n "$img" >/dev/null || fail "fsck of the old image"
"$q" mount "$img" "$m" >/dev/null
python3 "$fx/manifest.py" "$m" > "$work/seen.manifest"
diff -u "$fx/betrfs-v1.manifest" "$work/seen.manifest" || fail "the old image's files differ from what the old build wrote"
# New writes into old directories and files.
printf 'written by this build\n' > "$m/a/b/c/new.txt"
printf 'appended\n' >> "$m/hello.txt"
mkdir "$m/docs/sub" && cp "$m/big-text.txt" "$m/docs/sub/copy.txt"
mv "$m/docs/note-1.txt" "$m/a/b/note-1.txt"
rm "$m/a/small.bin"
python3 "$fx/manifest.py" "$m" > "$work/after.manifest"
umount "$m"
"$q" fsck -n "$img" >/dev/null || fail "fsck after writing to the old image"
[ "$(stat_of "$img" format.superblock_version)" -ge 2 ] || fail "the superblock record was not rewritten in the current version"
"$q" mount "$img" "$m" >/dev/null
python3 "$fx/manifest.py" "$m" > "$work/again.manifest"
umount "$m"
diff -u "$work/after.manifest" "$work/again.manifest" || fail "a remount changed the files"
grep -q '^a/b/c/new.txt 0644 1 file 22 ' "$work/again.manifest" || fail "the new file is not there"
grep -q '^docs/sub/copy.txt 0644 1 file 1092000 902333cb' "$work/again.manifest" || fail "the copy is wrong"

echo "compat: 1b. betrfs of commit 609eb35 (tree header version 3, before puts by reference)"
img="$work/v3.img"
gunzip -c "$fx/betrfs-v3header.img.gz" > "$img"
[ "$(stat_of "$img" format.tree_header_version)" = 3 ] || fail "stats: tree header version $(stat_of "$img" format.tree_header_version), not 3"
"$q" fsck -n "$img" >/dev/null || fail "fsck of the version 3 image"
"$q" mount "$img" "$m" >/dev/null
python3 "$fx/manifest.py" "$m" > "$work/seen3.manifest"
diff -u "$fx/betrfs-v3header.manifest" "$work/seen3.manifest" || fail "the version 3 image's files differ from what its build wrote"
# Whole blocks (puts by reference once the header is version 4) and small writes.
python3 -c "import random,sys; r=random.Random(9); sys.stdout.buffer.write(bytes(r.getrandbits(8) for _ in range(2000000)))" > "$work/blocks.bin"
cp "$work/blocks.bin" "$m/a/blocks.bin"
sync
printf 'appended\n' >> "$m/hello.txt"
umount "$m"
[ "$(stat_of "$img" format.tree_header_version)" = 4 ] || fail "the tree header was not rewritten as version 4"
"$q" fsck -n "$img" >/dev/null || fail "fsck after writing to the version 3 image"
"$q" mount "$img" "$m" >/dev/null
cmp "$work/blocks.bin" "$m/a/blocks.bin" || fail "the file written in whole blocks reads back wrong"
grep -q 'appended' "$m/hello.txt" || fail "the append is lost"
umount "$m"

echo "compat: 2. betrfs's first development layout is refused, by name"
img="$work/first.img"
gunzip -c "$fx/betrfs-first-layout.img.gz" > "$img"
before="$(sha256sum < "$img")"
if out="$("$q" mount "$img" "$m" 2>&1)"; then umount "$m"; fail "the first layout mounted"; fi
grep -q "development build of 2026-11-25" <<<"$out" || fail "the refusal does not name the layout: $out"
if "$q" fsck -n "$img" >/dev/null 2>&1; then fail "fsck called the first layout clean"; fi
# stats names it too, and does not open it as something else (a key-value tree, which
# would rewrite its header in a version its own build cannot read).
if out="$("$q" stats "$img" 2>&1)"; then fail "stats read the first layout: $out"; fi
grep -q "development build of 2026-11-25" <<<"$out" || fail "stats: $out"
[ "$(sha256sum < "$img")" = "$before" ] || fail "the refused image was changed"

echo "compat: 3. ext2 revision 0 (mke2fs -r 0, debugfs)"
img="$work/r0.img"
mke2fs -q -F -r 0 -t ext2 -b 1024 "$img" 16M >/dev/null
src="$work/src"; mkdir -p "$src"
python3 -c "import random,sys; r=random.Random(7); sys.stdout.buffer.write(bytes(r.getrandbits(8) for _ in range(300000)))" > "$src/random.bin"
printf 'revision zero\n' > "$src/small.txt"
debugfs -w "$img" -f - >/dev/null 2>&1 <<CMDS
mkdir dir
mkdir dir/sub
write $src/random.bin dir/random.bin
write $src/small.txt dir/sub/small.txt
symlink link dir/sub/small.txt
CMDS
clean "$img" || fail "the revision 0 image as made is not clean"
[ "$(stat_of "$img" format.revision)" = 0 ] || fail "stats: revision not 0"
"$q" mount "$img" "$m" >/dev/null
cmp "$m/dir/random.bin" "$src/random.bin" || fail "random.bin reads wrong"
cmp "$m/dir/sub/small.txt" "$src/small.txt" || fail "small.txt reads wrong"
[ "$(readlink "$m/link")" = dir/sub/small.txt ] || fail "the symlink reads wrong"
mkdir "$m/new"
for i in $(seq 1 20); do printf 'new %d\n' "$i" > "$m/new/f$i"; done
cp "$src/random.bin" "$m/new/copy.bin"
umount "$m"
clean "$img" || fail "e2fsck after quiltfs wrote to the revision 0 image"
[ "$(stat_of "$img" format.revision)" = 0 ] || fail "the image is no longer revision 0"
mount -o loop,ro -t ext2 "$img" "$k"
cmp "$k/new/copy.bin" "$src/random.bin" || fail "the kernel reads copy.bin wrong"
[ "$(cat "$k/new/f20")" = "new 20" ] || fail "the kernel reads f20 wrong"
umount "$k"
echo "compat: PASS"
