#!/usr/bin/env bash
# Sets everything up and runs the whole test suite. Under CI=true the property tests run
# fewer cases (set QUILT_PROPTEST_CASES to choose).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# Unit, integration, property and doc tests.
cargo test --workspace
# Each benchmark once, as a smoke test (timings come from `cargo bench`, never from here).
cargo test --release -p quilt-patch --benches --quiet
# The main job, small, end to end.
./target/release/quiltfs demo --files 500 --image "${TMPDIR:-/tmp}/quiltfs-ci-demo.img" >/dev/null
echo "quiltfs: all checks passed"
