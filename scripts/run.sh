#!/usr/bin/env bash
# Sets everything up and runs quiltfs's main job on its embedded default: the patch-engine
# demo on an image file on local disk. Extra arguments go to `quiltfs demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec ./target/release/quiltfs demo "$@"
