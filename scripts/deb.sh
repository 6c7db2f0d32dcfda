#!/usr/bin/env bash
# Builds the Debian package of quiltfs from this workspace's release build:
# target/debian/quiltfs_VERSION_amd64.deb. Made with dpkg-deb from a staged tree (the
# layout is in packaging/debian and ARCHITECTURE.md); the man pages and completions are
# made by the binaries themselves from their command-line definitions.
# Usage: scripts/deb.sh [--version VERSION] [--no-build] [--from DIR]
#   --version   the package's version (default: the workspace's, e.g. 0.1.0)
#   --no-build  use the build as it is (scripts/setup.sh built it)
#   --from DIR  the build to package (default target/release; the test suite packages
#               its own, target/ci)
set -euo pipefail
cd "$(dirname "$0")/.."
version=""
build=1
rel=target/release
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --from) rel="$2"; shift 2 ;;
    *) echo "deb: unknown argument $1 (usage: scripts/deb.sh [--version V] [--no-build] [--from DIR])" >&2; exit 2 ;;
  esac
done
if [ -z "$version" ]; then
  version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)"
fi
[ -n "$version" ] || { echo "deb: no version found in Cargo.toml" >&2; exit 1; }
for tool in dpkg-deb objcopy gzip; do
  command -v "$tool" >/dev/null || { echo "deb: $tool is missing (apt-get install dpkg binutils gzip)" >&2; exit 1; }
done
if [ "$build" = 1 ]; then
  cargo build --release --workspace --quiet
fi
for f in quiltfs quiltfs-bench libquilt_pg.so libquilt_preload.so; do
  [ -f "$rel/$f" ] || { echo "deb: $rel/$f is missing (build the workspace: cargo build --release --workspace)" >&2; exit 1; }
done
pkg=packaging/debian
out=target/debian
stage="$out/quiltfs_${version}_amd64"
rm -rf "$stage"
mkdir -p "$stage/DEBIAN" "$stage/usr/bin" "$stage/usr/sbin" "$stage/usr/lib/quiltfs" \
  "$stage/usr/include" "$stage/usr/lib/x86_64-linux-gnu/pkgconfig" \
  "$stage/lib/systemd/system" "$stage/usr/share/doc/quiltfs/examples" \
  "$stage/usr/share/man/man1" "$stage/usr/share/man/man5" "$stage/usr/share/man/man7" \
  "$stage/usr/share/bash-completion/completions" "$stage/usr/share/zsh/vendor-completions" \
  "$stage/usr/share/fish/vendor_completions.d" "$stage/usr/share/lintian/overrides"

# Binaries and libraries without their debug sections (the build keeps line tables for
# backtraces; the package ships what runs).
strip_into() { objcopy --strip-debug --strip-unneeded --remove-section=.comment "$1" "$2"; chmod "$3" "$2"; }
strip_into "$rel/quiltfs" "$stage/usr/bin/quiltfs" 755
strip_into "$rel/quiltfs-bench" "$stage/usr/bin/quiltfs-bench" 755
strip_into "$rel/libquilt_pg.so" "$stage/usr/lib/quiltfs/libquilt_pg.so" 644
strip_into "$rel/libquilt_preload.so" "$stage/usr/lib/quiltfs/libquilt_preload.so" 644
install -m 644 crates/interfaces/pg/include/quiltfs_pg.h "$stage/usr/include/"
sed "s/@VERSION@/$version/" "$pkg/quiltfs-pg.pc.in" > "$stage/usr/lib/x86_64-linux-gnu/pkgconfig/quiltfs-pg.pc"
# mount(8) runs mount.fuse.quiltfs for `-t fuse.quiltfs` and fstab lines; umount(8)
# runs the umount helpers, which wait for the final write-back.
for h in mount.fuse.quiltfs umount.fuse.quiltfs umount.fuseblk.quiltfs; do
  ln -s ../bin/quiltfs "$stage/usr/sbin/$h"
done

install -m 644 "$pkg"/units/*.service "$stage/lib/systemd/system/"
install -m 644 "$pkg"/examples/* "$stage/usr/share/doc/quiltfs/examples/"
install -m 644 "$pkg/copyright" "$stage/usr/share/doc/quiltfs/copyright"
gzip -9n -c README.md > "$stage/usr/share/doc/quiltfs/README.md.gz"
commit="$("$rel/quiltfs" --version | sed -n 's/.*(commit \([^,)]*\).*/\1/p')"
{
  echo "quiltfs ($version) unstable; urgency=medium"
  echo
  echo "  * Built from commit ${commit:-unknown}."
  echo
  echo " -- quiltfs developers <quiltfs@example.invalid>  $(date -R -d "@${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}")"
} | gzip -9n > "$stage/usr/share/doc/quiltfs/changelog.gz"  # a native package's
install -m 644 "$pkg/lintian-overrides" "$stage/usr/share/lintian/overrides/quiltfs"

# Man pages: quiltfs(1) and a page per subcommand, the mount options (7), the formats
# (5); and `quiltfs bench`'s pages from its own binary.
man="$out/man"
rm -rf "$man"
"$rel/quiltfs" manpages "$man" 2>/dev/null
"$rel/quiltfs-bench" manpages "$man"
for page in "$man"/*; do
  section="${page##*.}"
  gzip -9n -c "$page" > "$stage/usr/share/man/man$section/$(basename "$page").gz"
done
# The mount helpers' pages are quiltfs mount's and umount's.
mkdir -p "$stage/usr/share/man/man8"
for h in mount.fuse.quiltfs:mount umount.fuse.quiltfs:umount umount.fuseblk.quiltfs:umount; do
  printf '.so man1/quiltfs-%s.1\n' "${h#*:}" | gzip -9n > "$stage/usr/share/man/man8/${h%%:*}.8.gz"
done
"$rel/quiltfs" completions bash > "$stage/usr/share/bash-completion/completions/quiltfs"
"$rel/quiltfs" completions zsh > "$stage/usr/share/zsh/vendor-completions/_quiltfs"
"$rel/quiltfs" completions fish > "$stage/usr/share/fish/vendor_completions.d/quiltfs.fish"

install -m 755 "$pkg/postinst" "$pkg/prerm" "$pkg/postrm" "$stage/DEBIAN/"
size="$(du -sk --exclude=DEBIAN "$stage" | cut -f1)"
sed -e "s/@VERSION@/$version/" -e "s/@SIZE@/$size/" "$pkg/control.in" > "$stage/DEBIAN/control"
( cd "$stage" && find . -path ./DEBIAN -prune -o -type f -print0 | sort -z | xargs -0 md5sum | sed 's| \./| |' ) > "$stage/DEBIAN/md5sums"
chmod 644 "$stage/DEBIAN/md5sums" "$stage/DEBIAN/control"
find "$stage" -type d -exec chmod 755 {} +
deb="$out/quiltfs_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "deb: $deb ($(du -h "$deb" | cut -f1))"
