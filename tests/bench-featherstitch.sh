#!/usr/bin/env bash
# `quiltfs bench featherstitch` end to end (root): a quick run on a few systems must
# produce every output with a sample for each system and workload, leave no mount, loop
# device or image behind, and stop cleanly on Ctrl-C and on bad arguments.
#   tests/bench-featherstitch.sh [path/to/quiltfs]
set -euo pipefail
q="$(realpath "${1:-./target/release/quiltfs}")"
# A fresh directory per run: a mount left by a run that was killed (a fixed path)
# would make the next run refuse to mount over it.
work="$(mktemp -d "${TMPDIR:-/tmp}/quiltfs-ci-bench-fs.XXXXXX")"
chmod 755 "$work"  # mktemp makes it 0700; servers run as other users below it
out="$work/out"
fail() { echo "bench-featherstitch: FAIL: $*" >&2; exit 1; }

leftovers() {
  # Mounts and loop devices under the work directory, and images left in it.
  { grep -F "$work" /proc/self/mountinfo || true; } | sed 's/^/mount: /'
  { losetup -a | grep -F "$work" || true; } | sed 's/^/loop: /'
  find "$work" -maxdepth 1 -name '*.img' | sed 's/^/image: /'
}

# 1. Bad arguments: a clear error, nothing set up.
if "$q" bench featherstitch --systems ext2,nosuch --work "$work" --out "$out" 2>"$work/err"; then
  fail "an unknown system was accepted"
fi
grep -q "unknown system 'nosuch'" "$work/err" || fail "unclear error: $(cat "$work/err")"

# 2. A quick run: kernel ext2, quiltfs soft updates (with the optimization table's
# no-optimization twin), full journal, fuse2fs; every workload.
systems=ext2,quilt-su,quilt-su-opt-none,quilt-full,fuse2fs
"$q" bench featherstitch --quick --systems "$systems" --work "$work" --out "$out" >"$work/log" 2>&1 ||
  { tail -30 "$work/log"; fail "the quick run failed"; }
for f in report.md results.json results.csv untar.png delete.png postmark.png andrew.png; do
  [ -s "$out/$f" ] || fail "$f is missing"
done
for p in "$out"/*.png; do
  [ "$(head -c 8 "$p" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "$p is not a PNG"
done
python3 - "$out/results.json" "$systems" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
systems = sys.argv[2].split(",")
got = {(s["system"], s["workload"]) for s in d["samples"]}
missing = [(s, w) for s in systems for w in ("untar", "delete", "postmark", "andrew") if (s, w) not in got]
assert not missing, f"no sample for {missing}"
for s in d["samples"]:
    assert s["wall_s"] > 0 and s["work_s"] > 0, s
    assert abs(s["wall_s"] - (s["work_s"] + s["sync_s"] + s["umount_s"])) < 1e-6, s
    if s["system"].startswith("quilt"):
        # Every quiltfs workload writes, so the engine made patches.
        assert s["patches_created"] and s["patches_created"] > 0, s
        assert s["fs_user_s"] + s["fs_sys_s"] > 0, s
    else:
        assert s["patches_created"] is None, s
# The untar wrote the tarball's bytes to each device, so each counted writes.
for s in d["samples"]:
    if s["workload"] == "untar":
        assert s["device_writes"] > 0, s
# Hard patches and merging must cut the undo bytes (the optimization table's point).
def med(system, key):
    v = sorted(x[key] for x in d["samples"] if x["system"] == system and x["workload"] == "untar")
    return v[len(v) // 2]
assert med("quilt-su", "undo_bytes") < med("quilt-su-opt-none", "undo_bytes") / 10, "optimizations did not cut undo bytes"
assert med("quilt-su", "patches_created") < med("quilt-su-opt-none", "patches_created"), "optimizations did not cut patches"
print("bench-featherstitch: results.json has every sample")
PY
grep -q "^## Benchmark times" "$out/report.md" || fail "report.md has no benchmark table"
grep -q "^## Patch optimizations" "$out/report.md" || fail "report.md has no optimization table"
grep -q "^## Goals" "$out/report.md" || fail "report.md has no goals"
[ "$(head -1 "$out/results.csv" | tr ',' '\n' | grep -c .)" -ge 15 ] || fail "results.csv has too few columns"
[ -z "$(leftovers)" ] || fail "left behind: $(leftovers)"

# 3. Ctrl-C in the middle: an error that says so, and everything torn down.
# (Every workload: the run must still be going when the signal comes, a second after
# the mount.)
setsid "$q" bench featherstitch --quick --systems quilt-su --workloads untar,delete,postmark,andrew \
  --work "$work" --out "$work/out-int" >"$work/int.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  grep -qF "$work/quilt-su.mnt" /proc/self/mountinfo && break
  sleep 0.1
done
grep -qF "$work/quilt-su.mnt" /proc/self/mountinfo || fail "the interrupted run never mounted"
sleep 1
kill -INT -- "-$pid"
if wait "$pid"; then fail "an interrupted run exited 0"; fi
grep -q "interrupted" "$work/int.log" || fail "no word of the interruption: $(tail -5 "$work/int.log")"
[ -z "$(leftovers)" ] || fail "left behind after Ctrl-C: $(leftovers)"
rm -rf "$work"
echo "bench-featherstitch: ok (quick run, outputs, Ctrl-C cleanup, bad arguments)"
