#!/usr/bin/env bash
# Coverage-guided fuzzing of everything quiltfs reads from disk (cargo fuzz, libFuzzer,
# nightly toolchain). Built optimized with overflow checks and without a sanitizer: the
# code under test is safe Rust, so AddressSanitizer would find nothing a panic does not
# and halves the rate (about 125 inputs/s against 70 here).
#
#   scripts/fuzz.sh [TARGET|all] [SECONDS]     default: all targets, 3600 s each
#
# Targets: superblock, inodes, dirs, xattrs, journal (fuzz/src/lib.rs); betree_header,
# betree_table, betree_log, betree_nodes, betrfs_records (fuzz/src/betree.rs). The corpus
# grows in fuzz/corpus/<target> (not committed). Runs go on past crashes and timeouts
# (libFuzzer's fork mode); each lands in fuzz/artifacts/<target>: once fixed, copy it to
# fuzz/regressions/<target>/ so `cargo test` in fuzz/ replays it forever.
# A summary line per target (executions, coverage, corpus size) goes to fuzz/runs.log.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-all}
secs=${2:-3600}
if ! rustup toolchain list | grep -q nightly; then
  rustup toolchain install nightly --profile minimal
fi
command -v cargo-fuzz >/dev/null || cargo +nightly install cargo-fuzz --locked
# The seeds: each region's bytes in the undamaged image.
(cd fuzz && QUILT_FUZZ_SEEDS="$PWD/corpus" cargo +nightly test --release --quiet write_seeds >/dev/null)
targets=(superblock inodes dirs xattrs journal betree_header betree_table betree_log betree_nodes betrfs_records)
[ "$target" = all ] || targets=("$target")
for t in "${targets[@]}"; do
  log=fuzz/artifacts/$t.log
  mkdir -p "fuzz/artifacts/$t"
  echo "fuzz: $t for ${secs}s" >&2
  rc=0
  (cd fuzz && cargo +nightly fuzz run -O -s none "$t" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
      -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
      -artifact_prefix="artifacts/$t/") >"$log" 2>&1 || rc=$?
  crashes=$(find "fuzz/artifacts/$t" -type f -name 'crash-*' | wc -l)
  timeouts=$(find "fuzz/artifacts/$t" -type f \( -name 'timeout-*' -o -name 'slow-unit-*' \) | wc -l)
  [ "$crashes" = 0 ] || rc=1
  # Fork mode's progress lines: "#N: cov: C ft: F corp: K exec/s: E oom/timeout/crash: ...".
  last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -1 || true)
  execs=${last%%:*}
  line="$(date -u +%FT%TZ) $t ${secs}s rc=$rc crashes=$crashes slow_or_timeouts=$timeouts execs=${execs#\#} ${last#*: }"
  echo "$line" | tee -a fuzz/runs.log
  if [ "$rc" != 0 ]; then
    echo "fuzz: $t found a crash; see $log and fuzz/artifacts/$t/" >&2
    failed=1
  fi
done
exit "${failed:-0}"
