#!/usr/bin/env bash
# Installs what quiltfs needs on a fresh Debian machine (as root) and builds it.
# Idempotent: packages already present are not installed again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the stack and its tests use: e2fsprogs (mkfs/e2fsck/debugfs oracles)
# and fuse3 (fusermount3 for the FUSE mount).
need=()
for pkg in e2fsprogs fuse3; do
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

cargo build --release --workspace --quiet
