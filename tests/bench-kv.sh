#!/usr/bin/env bash
# Smoke test of the key-value benchmark (no RocksDB: its C++ build is too long for CI):
# 100,000 keys, one round, betree/redb/fjall; every phase must report for every system.
# Timings are not checked: they come from full runs, never from here.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d /tmp/quiltfs-kvbench-smoke.XXXXXX)"
trap 'rm -rf "$out"' EXIT
QUICK=1 OUT="$out" KV_DIR="$out/stores" "$here/../scripts/bench-kv.sh" >/dev/null
python3 - "$out/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
phases = {"seq_insert", "rand_insert", "point_get", "scan_1000", "upsert_4b", "range_delete_10pct"}
for s in ["betree", "redb", "fjall"]:
    got = {m["phase"] for m in r if m["system"] == s and m["ops_per_sec"] > 0}
    assert got == phases, (s, phases - got)
wa = [m for m in r if m["system"] == "betree" and m["write_amp"] is not None]
assert wa and all(m["write_amp"] > 0 for m in wa), "write amplification missing"
print(f"bench-kv smoke: {len(r)} samples, every phase on every system")
PY
