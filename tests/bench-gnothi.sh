#!/usr/bin/env bash
# `quiltfs bench gnothi` end to end, small: Gnothi, G′ and a local disk on modelled
# disks, 4 KiB random writes and reads, and the recovery runs (a follower killed and
# restarted under load; a follower's data disk replaced by an empty one) for Gnothi and
# G′. Every output must be there, every row must
# carry the columns the issue names with a positive throughput and no errors, every
# recovery must complete, Gnothi's replicas must keep less at home than G′'s, and no
# replica process or device file may be left behind; bad arguments get a clear error.
# (Timings are not checked: ratios come from the full run.)
#   tests/bench-gnothi.sh [path/to/quiltfs]
set -euo pipefail
q="$(realpath "${1:-./target/release/quiltfs}")"
# A fresh directory per run: a mount left by a run that was killed (a fixed path)
# would make the next run refuse to mount over it.
work="$(mktemp -d "${TMPDIR:-/tmp}/quiltfs-ci-bench-gnothi.XXXXXX")"
chmod 755 "$work"  # mktemp makes it 0700; servers run as other users below it
out="$work/out"
fail() { echo "bench-gnothi: FAIL: $*" >&2; exit 1; }

if "$q" bench gnothi --systems gnothi,nosuch --work "$work/w" --out "$out" 2>"$work/err"; then
  fail "an unknown system was accepted"
fi
grep -q "nosuch" "$work/err" || fail "unclear error: $(cat "$work/err")"

port=$((20000 + RANDOM % 20000))
"$q" bench gnothi --quick --systems gnothi,gprime,local --sizes 4 --workloads randwrite,randread \
  --seconds 2 --size-mib 64 --port "$port" --work "$work/w" --out "$out" >"$work/log" 2>&1 || {
  rc=$?
  tail -30 "$work/log"
  # What the replicas said last (their stderr), to tell a crash of theirs from ours.
  for f in "$work"/w/*/r*.out; do [ -f "$f" ] && { echo "--- $f"; tail -5 "$f"; }; done
  fail "the quick run failed (exit status $rc$( [ $rc -gt 128 ] && echo ", signal $((rc - 128))"))"
}
for f in report.md results.json results.csv stored.csv throughput-f1.png catchup-10ms.png rereplication.png; do
  [ -s "$out/$f" ] || fail "$f is missing"
done
python3 - "$out" <<'PY'
import csv, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/results.csv")))
for col in ["system", "workload", "block_size", "f", "run", "mb_per_s"]:
    assert col in rows[0], f"results.csv has no column {col}"
got = {(r["system"], r["workload"]) for r in rows}
want = {(s, w) for s in ["gnothi", "gprime", "local"] for w in ["randwrite", "randread"]}
want |= {(s, w) for s in ["gnothi", "gprime"] for w in ["catchup", "rereplication"]}
want |= {("gnothi", "phase1")}
assert want <= got, f"missing runs: {sorted(want - got)}"
for r in rows:
    assert float(r["mb_per_s"]) > 0, r
    assert int(r["errors"]) == 0, f"client errors: {r}"
    if r["workload"] in ("catchup", "rereplication"):
        assert r["caught_up"] == "true", f"{r['system']} did not catch up: {r}"
        assert float(r["phase1_s"]) <= float(r["recovery_s"]), r
    if r["workload"] == "phase1":
        # The replica missed writes while down, and caught up on their metadata.
        assert r["caught_up"] == "true", f"Phase 1 did not end: {r}"
        assert int(r["missed_writes"]) > 0 and int(r["missed_entries"]) > 0, r
        assert 0 < float(r["phase1_s"]), r
stored = list(csv.DictReader(open(f"{out}/stored.csv")))
home = lambda s: sum(int(x["home_bytes"]) for x in stored if x["system"] == s)
assert 0 < home("gnothi") < home("gprime"), f"home bytes gnothi {home('gnothi')} gprime {home('gprime')}"
for x in stored:
    assert int(x["reserve_used_blocks"]) == 0, f"reserve not reclaimed: {x}"
print("bench-gnothi: " + ", ".join(f"{r['system']} {r['workload']} {float(r['mb_per_s']):.2f} MB/s" for r in rows))
PY
pgrep -af "quiltfs replica serve.*$work" && fail "replica processes left behind"
left=$(find "$work/w" -name '*.data' -o -name '*.log' 2>/dev/null | head -3)
[ -z "$left" ] || fail "device files left behind: $left"
rm -rf "$work"
echo "bench-gnothi: PASS"
