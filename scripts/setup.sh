#!/usr/bin/env bash
# Installs what quiltfs needs on a fresh Debian machine (as root) and builds it.
# Idempotent: packages already present are not installed again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the stack and its tests use: e2fsprogs (mkfs/e2fsck/debugfs oracles),
# fuse3 (fusermount3 for the FUSE mount), attr (getfattr/setfattr in the kernel-oracle
# test), acl (setfacl/getfacl in the kernel-parity test), gcc (the C patchgroup example),
# g++ (libFuzzer, built for the fuzz smoke), fuse2fs and xz-utils/linux-source (the untar
# benchmark, installed by it), dovecot-imapd (the mail benchmark, installed by it),
# make and fonts-dejavu-core (the Featherstitch suite's build and plots; postmark and
# fuse2fs are installed by it), qemu-utils (qemu-img and qemu-io: the NBD export's
# independent client).
need=()
for pkg in e2fsprogs fuse3 attr acl python3 bc gcc g++ make fonts-dejavu-core qemu-utils; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: missing Debian packages ${need[*]} (run as root to install them)" >&2
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install the Rust toolchain (rustup) first" >&2
  exit 1
fi

# QUILT_PROFILE picks the build (default release); scripts/test.sh builds its own
# profile, ci, whose artifacts `cargo test` shares (Cargo.toml says why).
profile="${QUILT_PROFILE:-release}"
cargo build --profile "$profile" --workspace --quiet
out="target/$profile"

# The binary, and the helpers that make `mount -t fuse.quiltfs IMAGE DIR`, fstab entries
# and `umount DIR` (which then waits for the final write-back) work.
if [ "$(id -u)" = 0 ]; then
  install -m 755 "$out"/quiltfs /usr/local/bin/quiltfs
  install -m 755 "$out"/quiltfs-bench /usr/local/bin/quiltfs-bench
  ln -sf /usr/local/bin/quiltfs /usr/sbin/mount.fuse.quiltfs
  ln -sf /usr/local/bin/quiltfs /usr/sbin/umount.fuse.quiltfs
  # Root's mounts are block-device FUSE mounts (fuseblk.quiltfs): without this helper
  # util-linux's umount returns before the server has let go of the image, and cannot
  # report a failed final write-back.
  ln -sf /usr/local/bin/quiltfs /usr/sbin/umount.fuseblk.quiltfs
  # The patchgroup libraries for programs: C interface and LD_PRELOAD.
  install -m 755 "$out"/libquilt_pg.so "$out"/libquilt_preload.so /usr/local/lib/
  install -m 644 crates/interfaces/pg/include/quiltfs_pg.h /usr/local/include/
  ldconfig 2>/dev/null || true
  # Man pages (quiltfs(1), a page per subcommand, quiltfs-mount-options(7),
  # quiltfs-formats(5)) and bash completion, as the Debian package installs them.
  man_tmp="$(mktemp -d)"
  if "$out"/quiltfs manpages "$man_tmp" 2>/dev/null && "$out"/quiltfs-bench manpages "$man_tmp"; then
    for page in "$man_tmp"/*; do
      mkdir -p "/usr/local/share/man/man${page##*.}"
      install -m 644 "$page" "/usr/local/share/man/man${page##*.}/"
    done
  fi
  rm -rf "$man_tmp"
  mkdir -p /usr/local/share/bash-completion/completions
  "$out"/quiltfs completions bash > /usr/local/share/bash-completion/completions/quiltfs
  # FUSE over io_uring (kernel 6.14+): mounts serve each request on its caller's CPU,
  # about twice as fast on this kind of machine as /dev/fuse (docs/results). Off by
  # default in the kernel; `-o nouring` keeps a mount on /dev/fuse.
  if [ -w /sys/module/fuse/parameters/enable_uring ] \
     && [ "$(cat /sys/module/fuse/parameters/enable_uring)" != Y ]; then
    echo "setup: enabling FUSE over io_uring (/sys/module/fuse/parameters/enable_uring)"
    echo Y > /sys/module/fuse/parameters/enable_uring
  fi
fi
