#!/usr/bin/env bash
# `quiltfs crashtest` on every mode and every workload (issue #5): soft updates may only
# leak and overcount, the journal modes must be spotless (our replay and e2fsck's
# agreeing), and async must show violations, which proves the explorer sees corruption.
# Usage: tests/crashtest.sh [QUILTFS_BINARY]   (STATES=N per mode; default 400, 120 under
# CI=true)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
q="${1:-$here/../target/release/quiltfs}"
states="${STATES:-400}"
[ "${CI:-}" = true ] && states="${STATES:-120}"
work="$(mktemp -d /tmp/quiltfs-crashtest.XXXXXX)"
trap 'rm -rf "$work"' EXIT
for mode in soft-updates meta-journal full-journal; do
  "$q" crashtest --mode "$mode" --workload all --states "$states" --report "$work/$mode.json" \
    || { echo "crashtest: FAIL: $mode breaks its guarantees" >&2; exit 1; }
done
# The log-skipping journal: every state recovers to exactly the committed transactions
# (the journal model, which runs in every journal-mode state), e2fsck refuses the
# unreplayed journal.
for mode in meta-journal full-journal; do
  "$q" crashtest --mode "$mode" --journal-placement skip --workload all --states "$((states / 2))" \
    --report "$work/skip-$mode.json" >/dev/null \
    || { echo "crashtest: FAIL: $mode with log skipping breaks its guarantees" >&2; exit 1; }
done
# Tree renames in a journal mode: exactly one name holds each tree, whole (betrfs runs
# them in its `all`).
"$q" crashtest --mode meta-journal --workload rename --states "$((states / 2))" \
  --report "$work/rename-meta.json" >/dev/null \
  || { echo "crashtest: FAIL: meta-journal renames break their guarantees" >&2; exit 1; }
"$q" crashtest --mode async --workload all --states "$states" --report "$work/async.json" \
  --keep-failures "$work/failures" >/dev/null
# The Bε-tree: every crash state recovers to every synced batch and a prefix of the rest;
# the control run (syncs claimed, not made) must show lost batches.
"$q" crashtest --fs betree --states "$((states * 5))" --report "$work/betree.json" \
  || { echo "crashtest: FAIL: the Bε-tree breaks its guarantees" >&2; exit 1; }
"$q" crashtest --fs betree --lying --states 300 --report "$work/betree-lying.json" >/dev/null
# The second control: syncs that leave the values of puts logged by reference out of the
# log (a record naming data nothing made durable) must show lost batches too.
"$q" crashtest --fs betree --unbound --states 600 --report "$work/betree-unbound.json" >/dev/null
# betrfs: every state mounts, passes quiltfs fsck and keeps every fsync and synced
# patchgroup; its control (fsync, sync and pg_sync that lie) must break promises.
"$q" crashtest --fs betrfs --workload all --states "$((states * 2))" --report "$work/betrfs.json" \
  || { echo "crashtest: FAIL: betrfs breaks its guarantees" >&2; exit 1; }
"$q" crashtest --fs betrfs --lying --workload untar --states 100 --report "$work/betrfs-lying.json" >/dev/null
python3 - "$work" <<'PY'
import json, os, sys
w = sys.argv[1]
r = {m: json.load(open(f"{w}/{m}.json")) for m in ["soft-updates", "meta-journal", "full-journal", "async"]}
for m, x in r.items():
    assert x["states_checked"] > 0 and x["promises_checked"] > 0, (m, x["states_checked"])
su = r["soft-updates"]
assert su["with_violations"] == 0 and su["allowed_only"] > 0, "soft updates should leak sometimes, never break"
for m in ["meta-journal", "full-journal"]:
    assert r[m]["clean"] == r[m]["states_checked"], f"{m}: every state must be clean"
for m in ["meta-journal", "full-journal"]:
    x = json.load(open(f"{w}/skip-{m}.json"))
    assert x["states_checked"] > 0 and x["clean"] == x["states_checked"], f"skip {m}: every state must be clean"
a = r["async"]
assert a["with_violations"] > 0, "async shows no violation: the explorer would be blind"
kept = os.listdir(f"{w}/failures")
assert kept, "no failing image was kept"
b, bl, bu = (json.load(open(f"{w}/{n}.json")) for n in ["betree", "betree-lying", "betree-unbound"])
assert bu["with_violations"] > 0, "betree unbound control lost nothing: a put by reference without its value would go unseen"
assert b["states_checked"] > 0 and b["clean"] == b["states_checked"], "betree: every state must recover whole"
assert bl["with_violations"] > 0, "betree control lost nothing: the oracle would be blind"
print(f"crashtest: betree {b['states_checked']} states clean, controls {bl['with_violations']} and {bu['with_violations']} with violations")
f, fl = (json.load(open(f"{w}/{n}.json")) for n in ["betrfs", "betrfs-lying"])
assert f["states_checked"] > 0 and f["promises_checked"] > 0, "betrfs: nothing checked"
assert f["clean"] == f["states_checked"], "betrfs: every state must be clean"
assert fl["with_violations"] > 0, "betrfs control broke no promise: the oracle would be blind"
print(f"crashtest: betrfs {f['states_checked']} states clean ({f['promises_checked']} promises), control {fl['with_violations']} with violations")
print(f"crashtest: soft updates {su['states_checked']} states ({su['allowed_only']} with allowed leaks), "
      f"journals {r['meta-journal']['states_checked']}+{r['full-journal']['states_checked']} clean, "
      f"async {a['with_violations']}/{a['states_checked']} with violations ({len(kept)} images kept)")
PY
