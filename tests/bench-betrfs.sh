#!/usr/bin/env bash
# `quiltfs bench betrfs` end to end (root): a quick run on every system must produce
# every output, a sample for each system and workload it applies to, a clean checker
# verdict after every group, and leave no mount, loop device or image behind; bad
# arguments get a clear error. (Timings are not checked: they come from the full run.)
#   tests/bench-betrfs.sh [path/to/quiltfs]
set -euo pipefail
q="$(realpath "${1:-./target/release/quiltfs}")"
# A fresh directory per run: a mount left by a run that was killed (a fixed path)
# would make the next run refuse to mount over it.
work="$(mktemp -d "${TMPDIR:-/tmp}/quiltfs-ci-bench-betrfs.XXXXXX")"
chmod 755 "$work"  # mktemp makes it 0700; servers run as other users below it
out="$work/out"
fail() { echo "bench-betrfs: FAIL: $*" >&2; exit 1; }
leftovers() {
  { grep -F "$work" /proc/self/mountinfo || true; } | sed 's/^/mount: /'
  { losetup -a | grep -F "$work" || true; } | sed 's/^/loop: /'
  find "$work" -maxdepth 1 -name '*.img' | sed 's/^/image: /'
}

if "$q" bench betrfs --workloads seqwrite,nosuch --work "$work" --out "$out" 2>"$work/err"; then
  fail "an unknown workload was accepted"
fi
grep -q "unknown workload 'nosuch'" "$work/err" || fail "unclear error: $(cat "$work/err")"

"$q" bench betrfs --quick --work "$work" --out "$out" >"$work/log" 2>&1 ||
  { tail -30 "$work/log"; fail "the quick run failed"; }
for f in report.md results.json results.csv seqwrite.png randwrite.png toku4.png rename-latency.png clone-latency.png; do
  [ -s "$out/$f" ] || fail "$f is missing"
done
python3 - "$out/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
systems = [s["name"] for s in d["systems"]]
got = {(s["system"], s["workload"]) for s in d["samples"]}
want = ["seqwrite", "seqread", "randwrite", "untar", "find", "grep", "rmrf", "toku1", "toku4", "rename"]
missing = [(s, w) for s in systems for w in want if (s, w) not in got]
for s in ["betrfs", "btrfs", "xfs"]:
    if (s, "clone") not in got:
        missing.append((s, "clone"))
for s in ["betrfs", "quilt-su"]:
    for w in ["randwrite-native", "toku1-native", "toku4-native"]:
        if (s, w) not in got:
            missing.append((s, w))
assert not missing, f"no sample for {missing}"
for s in d["samples"]:
    # (What a clone's rewrites copied out of shared nodes may be nothing at all.)
    copied = (s["workload"], s["param"]) == ("clone-writes", "copied")
    assert (s["value"] >= 0 if copied else s["value"] > 0) and s["wall_s"] > 0, s
groups = {(c.split(":")[0]) for c in d["checks"]}
assert groups == set(systems), f"checks for {groups}, systems {systems}"
# (Besides the checkers' lines, notes such as a system whose lseek reports no holes.)
assert all(c.endswith("clean") for c in d["checks"] if " workloads, run " in c), d["checks"]
assert any(" workloads, run " in c for c in d["checks"]), d["checks"]
print(f"bench-betrfs: {len(d['samples'])} samples from {len(systems)} systems, every group checked clean")
PY
grep -q "^## Goals" "$out/report.md" || fail "report.md has no goals"
[ -z "$(leftovers)" ] || fail "left behind: $(leftovers)"
rm -rf "$work"
echo "bench-betrfs: ok (quick run of every system and workload, outputs, checks, cleanup)"
