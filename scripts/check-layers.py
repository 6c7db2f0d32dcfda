#!/usr/bin/env python3
"""The layer map, checked: every crate's dependencies run down the stack.

A crate's layer is the folder it lives in (crates/<layer>/<crate>). A crate may depend
on crates of the layers its own layer lists below, and on a crate of its own layer only
when its Cargo.toml names that crate in `[package.metadata.quilt] same-layer = [...]`.
Normal, build and dev dependencies are all checked: a test that links a module into an
interface crate is the same wrong-way arrow. Every crate also needs a `description`
(the one line saying what it owns), and every library and binary root states the
crates' common policy: `#![cfg_attr(not(test), deny(clippy::unwrap_used))]` (no
unwrap outside tests: bytes from a disk, a network or a user are errors, never panics;
an invariant that cannot fail says so with `expect`).

Usage: scripts/check-layers.py [WORKSPACE_DIR]      (default: the repository)
Exit status 0 when the map holds, 1 with one line per wrong arrow otherwise.
"""

import json
import os
import subprocess
import sys

# Lowest first. A layer may use the layers listed for it (never a higher one).
LAYERS = {
    "devices": [],
    "api": [],
    "engine": ["devices", "api"],
    "modules": ["devices", "api", "engine"],
    # Front ends speak the api only: the FUSE server never links a module or the engine.
    "interfaces": ["devices", "api"],
    # Replicated storage (Gnothi): stores through devices, and its client is one; its
    # RPC plumbing (quilt-rpc) is shared with the namespace service and lives in api.
    "replication": ["devices", "api"],
    # The namespace service (Cudele): keeps a namespace in any module and serves it, and
    # its client is a file system; like the front ends it speaks the api only.
    "namespace": ["api"],
    "wiring": ["devices", "api", "engine", "modules", "replication", "namespace"],
    "tools": ["devices", "api", "engine", "modules", "interfaces", "replication", "namespace",
              "wiring"],
}


def layer_of(manifest, root):
    rel = os.path.relpath(manifest, root).split(os.sep)
    if len(rel) == 4 and rel[0] == "crates" and rel[3] == "Cargo.toml":
        return rel[1]
    return None


def check(root):
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
        cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        # --offline can refuse on a clean machine whose registry index is empty; with
        # --no-deps nothing is downloaded either way.
        out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                             cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        return ["cargo metadata failed"]
    meta = json.loads(out.stdout)
    root = meta["workspace_root"]
    ours = {}
    for p in meta["packages"]:
        ours[p["name"]] = p
    wrong = []
    for name, p in sorted(ours.items()):
        layer = layer_of(p["manifest_path"], root)
        if layer is None or layer not in LAYERS:
            wrong.append(f"{name}: lives at {os.path.relpath(p['manifest_path'], root)}, "
                         f"not in a layer folder crates/<{'|'.join(LAYERS)}>/<crate>")
            continue
        if not (p.get("description") or "").strip():
            wrong.append(f"{name}: no description (the one line saying what it owns)")
        quilt = (p.get("metadata") or {}).get("quilt") or {}
        same = set(quilt.get("same-layer", []))
        for d in p["dependencies"]:
            dep = d["name"]
            if dep not in ours:
                continue
            kind = d["kind"] or "normal"
            dl = layer_of(ours[dep]["manifest_path"], root)
            if dl == layer:
                if dep not in same:
                    wrong.append(f"{name} ({layer}) -> {dep} ({dl}), {kind}: same layer, "
                                 f"not listed in [package.metadata.quilt] same-layer")
            elif dl not in LAYERS[layer]:
                wrong.append(f"{name} ({layer}) -> {dep} ({dl}), {kind}: {layer} may use "
                             f"{', '.join(LAYERS[layer]) or 'no other layer'}")
        for s in same:
            if s not in ours or layer_of(ours[s]["manifest_path"], root) != layer:
                wrong.append(f"{name}: same-layer lists {s}, which is not a crate of {layer}")
        for t in p["targets"]:
            if not set(t["kind"]) & {"lib", "rlib", "cdylib", "staticlib", "bin"}:
                continue
            with open(t["src_path"], encoding="utf-8") as f:
                if "deny(clippy::unwrap_used)" not in f.read():
                    wrong.append(f"{name}: {os.path.relpath(t['src_path'], root)} does not "
                                 f"deny clippy::unwrap_used outside tests")
    return wrong


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    wrong = check(os.path.abspath(root))
    for w in wrong:
        print(f"layers: {w}")
    if wrong:
        print(f"layers: {len(wrong)} wrong-way dependencies (the map is in scripts/check-layers.py "
              f"and ARCHITECTURE.md)")
        return 1
    print("layers: every dependency runs down the stack")
    return 0


if __name__ == "__main__":
    sys.exit(main())
