#!/usr/bin/env bash
# Prints the path of Debian's linux-source tarball, uncompressed (1.36 GB, made once
# under WORK, or the Featherstitch suite's copy if it exists); QUICK=1: a 58 MB subset
# (fs/ and kernel/). Installs linux-source and xz-utils if missing. For the benchmarks.
#   scripts/linux-tarball.sh WORK
set -euo pipefail
work="$1"; mkdir -p "$work"
for p in xz-utils linux-source-6.1; do
  dpkg -s "$p" >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null
done
tarball=/var/tmp/quiltfs-bench-featherstitch/linux.tar
if [ ! -f "$tarball" ]; then
  tarball="$work/linux.tar"
  if [ ! -f "$tarball" ]; then
    echo "bench: decompressing the linux-source tarball (once, untimed)" >&2
    xz -dc -T2 /usr/src/linux-source-6.1.tar.xz >"$tarball.tmp" && mv "$tarball.tmp" "$tarball"
  fi
fi
if [ "${QUICK:-0}" = 1 ]; then
  small="$work/small.tar"
  if [ ! -f "$small" ]; then
    mkdir -p "$work/x" && tar xf "$tarball" -C "$work/x" linux-source-6.1/fs linux-source-6.1/kernel
    tar cf "$small" -C "$work/x" . && rm -rf "$work/x"
  fi
  tarball="$small"
fi
echo "$tarball"
