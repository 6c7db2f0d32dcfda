#!/usr/bin/env bash
# `quiltfs bench bark` end to end (root): a quick run of the log-skipping journal and of
# kernel ext4 with its external journal on the disk model (both cache settings) must
# produce every output, a pgbench result for each configuration, journal-disk latencies
# where a journal writes, and leave no mount, loop device, PostgreSQL or image behind;
# bad arguments get a clear error. (Timings are not checked: they come from the full
# run.)   tests/bench-bark.sh [path/to/quiltfs]
set -euo pipefail
q="$(realpath "${1:-./target/release/quiltfs}")"
# A fresh directory per run: a mount left by a run that was killed (a fixed path)
# would make the next run refuse to mount over it.
work="$(mktemp -d "${TMPDIR:-/tmp}/quiltfs-ci-bench-bark.XXXXXX")"
chmod 755 "$work"  # mktemp makes it 0700; servers run as other users below it
out="$work/out"
fail() { echo "bench-bark: FAIL: $*" >&2; exit 1; }
leftovers() {
  { grep -F "$work" /proc/self/mountinfo || true; } | sed 's/^/mount: /'
  { losetup -a | grep -F "$work" || true; } | sed 's/^/loop: /'
  { pgrep -af "postgres -D $work" || true; } | sed 's/^/postgres: /'
  find "$work" -maxdepth 1 \( -name '*.img' -o -name '*.raw' \) | sed 's/^/image: /'
}

if "$q" bench bark --systems skip,nosuch --work "$work" --out "$out" 2>"$work/err"; then
  fail "an unknown system was accepted"
fi
grep -q "unknown system 'nosuch'" "$work/err" || fail "unclear error: $(cat "$work/err")"

"$q" bench bark --quick --systems skip,ext4 --work "$work" --out "$out" >"$work/log" 2>&1 ||
  { tail -30 "$work/log"; leftovers; fail "the quick run failed"; }
for f in report.md results.json results.csv latency-cached-c1.png latency-uncached-c1.png; do
  [ -s "$out/$f" ] || fail "$f is missing"
done
python3 - "$out/results.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
got = {(r["system"], r["cache"], r["clients"]) for r in rows}
want = {(s, c, 1) for s in ["skip", "ext4"] for c in ["Cached", "Uncached"]}
assert want <= got, f"missing configurations: {sorted(want - got)}"
for r in rows:
    assert r["tps"] > 0 and r["seconds"] > 0, r
    assert sum(r["journal_write_latency"]) > 0, f"no journal write measured: {r['system']} {r['cache']}"
print(f"bench-bark: {len(rows)} runs, e.g. " + ", ".join(f"{r['system']} {r['cache']} {r['tps']:.0f} tps" for r in rows[:4]))
PY
grep -q "## Goals" "$out/report.md" || fail "report.md has no goals"
left="$(leftovers)"
[ -z "$left" ] || fail "left behind: $left"
rm -rf "$work"
echo "bench-bark: ok"
