#!/usr/bin/env bash
# `quiltfs bench cudele` end to end, small: every mechanism and composition measured,
# use case 1 with one and two client processes, creates through the service's FUSE
# mounts (RPC mode with and without Stream, decoupled), use case 2 (a rogue client:
# none, allow, block against one client alone; under block every one of the rogue's
# creates refused, under allow accepted), use case 3 (sync at 1 s against none),
# every output there, the issue's CSV
# columns on every row with a positive rate, the journal far below the paper's 2.5 KB a
# create, and no service process or image left behind; a bad argument gets a clear
# error. (Timings are not checked: ratios come from the full run.)
#   tests/bench-cudele.sh [path/to/quiltfs]
set -euo pipefail
q="$(realpath "${1:-./target/release/quiltfs}")"
# A fresh directory per run: a mount left by a run that was killed (a fixed path)
# would make the next run refuse to mount over it.
work="$(mktemp -d "${TMPDIR:-/tmp}/quiltfs-ci-bench-cudele.XXXXXX")"
chmod 755 "$work"  # mktemp makes it 0700; servers run as other users below it
out="$work/out"
fail() { echo "bench-cudele: FAIL: $*" >&2; exit 1; }

if "$q" bench cudele --fs nosuch --work "$work/w" --out "$out" 2>"$work/err"; then
  fail "an unknown store was accepted"
fi
grep -q "nosuch" "$work/err" || fail "unclear error: $(cat "$work/err")"

port=$((20000 + RANDOM % 20000))
"$q" bench cudele --quick --creates 2000 --port "$port" --work "$work/w" --out "$out" \
  >"$work/log" 2>&1 || { tail -30 "$work/log"; tail -20 "$work/w/serve.log" 2>/dev/null; fail "the quick run failed"; }
for f in report.md results.json results.csv mechanisms.png use-case-1.png mounts.png; do
  [ -s "$out/$f" ] || fail "$f is missing"
done
python3 - "$out" <<'PY'
import csv, json, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/results.csv")))
for col in ["system", "workload", "clients", "run", "creates_per_s"]:
    assert col in rows[0], f"results.csv has no column {col}"
for r in rows:
    assert float(r["creates_per_s"]) > 0, r
systems = {r["system"] for r in rows if r["workload"] == "mechanisms"}
want = {"append client journal", "volatile apply", "nonvolatile apply", "local persist",
        "global persist", "rpcs", "stream", "posix", "hdfs", "batchfs", "deltafs", "ramdisk"}
assert want <= systems, f"missing: {want - systems}"
uc = {(r["system"], r["clients"]) for r in rows if r["workload"] == "use-case-1"}
for m in ["rpcs", "create", "create+merge"]:
    for k in ["1", "2"]:
        assert (m, k) in uc, f"use case 1 has no {m} with {k} clients"
mounts = {r["system"] for r in rows if r["workload"] == "mount"}
assert {"decoupled", "rpcs", "rpcs+stream"} <= mounts, f"mounts measured: {mounts}"
uc3 = {r["system"] for r in rows if r["workload"] == "use-case-3"}
assert {"no sync", "sync 1 s"} <= uc3, f"use case 3 measured: {uc3}"
uc2 = {(r["system"], r["clients"]) for r in rows if r["workload"] == "use-case-2"}
assert {("alone", "1"), ("none", "2"), ("allow", "2"), ("block", "2")} <= uc2, f"use case 2 measured: {uc2}"
j = json.load(open(f"{out}/results.json"))
rogue = {r["case"]: r for r in j["rogue"]}
assert set(rogue) == {"allow", "block"}, f"rogue cases: {set(rogue)}"
assert rogue["block"]["accepted"] == 0 and rogue["block"]["refused"] > 0, rogue["block"]
assert rogue["allow"]["accepted"] > 0 and rogue["allow"]["refused"] == 0, rogue["allow"]
b = j["journal_bytes_per_create"][0]
assert 10 < b < 256, f"{b} journal bytes per create"
PY
pgrep -f "mds serve $work" >/dev/null && fail "a service was left running"
[ -e "$work/w/ns.img" ] && fail "the image was left behind"
grep -q " $work/w/" /proc/self/mounts && fail "a mount was left behind"
grep -q "Goals" "$out/report.md" || fail "the report has no goals"
grep -q "Block within 5% of no interference" "$out/report.md" || fail "the report has no use case 2"
rm -rf "$work"
echo "bench-cudele: ok"
