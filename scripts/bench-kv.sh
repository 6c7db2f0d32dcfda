#!/usr/bin/env bash
# The key-value benchmark (issue 19): the quiltfs Bε-tree against redb, fjall and RocksDB,
# same machine, same run, same cache and sync points; medians and min–max over RUNS
# rounds, write amplification, disk use. Builds bench/kv (its own workspace: RocksDB's
# C++ takes about 20 minutes on two cores the first time; needs libclang-dev, installed
# here). Usage: scripts/bench-kv.sh [KEYS] [RUNS] [extra quilt-kvbench options]
#   KEYS default 2,000,000 (10,000,000 is the issue's full size); QUICK=1: 100,000 keys,
#   one run, no RocksDB (no C++ build).
set -euo pipefail
cd "$(dirname "$0")/.."
keys="${1:-2000000}"; runs="${2:-3}"; shift $(( $# > 2 ? 2 : $# ))
features=(); systems="betree,redb,fjall,rocksdb"
if [ "${QUICK:-}" = 1 ]; then
  keys=100000; runs=1; features=(--no-default-features); systems="betree,redb,fjall"
else
  if ! dpkg -s libclang-dev >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { echo "bench-kv: needs libclang-dev (run as root to install it)" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
  fi
fi
(cd bench/kv && cargo build --release --quiet "${features[@]}")
out="${OUT:-kv-results}"
mkdir -p "$out"
dir="${KV_DIR:-/var/tmp/quiltfs-kvbench}"
trap 'rm -rf "$dir"' EXIT
bench/kv/target/release/quilt-kvbench --keys "$keys" --runs "$runs" --systems "$systems" \
  --dir "$dir" --json "$out/results.json" "$@" | tee "$out/report.md"
echo "bench-kv: report in $out/report.md, samples in $out/results.json" >&2
