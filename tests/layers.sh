#!/usr/bin/env bash
# The layer check holds on the tree, and fails on each kind of wrong-way arrow planted in
# a copy of it: an api crate using the engine, an interface linking a module through a
# dev-dependency, a same-layer dependency nobody listed, a crate outside the layer
# folders, and a crate root without the no-unwrap policy. No build: `cargo metadata --no-deps` reads the manifests only.
set -euo pipefail
cd "$(dirname "$0")/.."
check=scripts/check-layers.py
$check .

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fresh() {
  rm -rf "$work/ws"
  mkdir "$work/ws"
  # Manifests and sources only (no target/, no .git): what cargo metadata reads.
  tar --exclude=./target --exclude=./.git --exclude=./fuzz --exclude=./bench -cf - . | tar -xf - -C "$work/ws"
}

# The check must fail on the planted copy and name the arrow.
expect_failure() {
  local name=$1 expect=$2
  if out=$($check "$work/ws" 2>&1); then
    echo "layers: the check passed with a planted $name" >&2
    exit 1
  fi
  if ! grep -qF -- "$expect" <<<"$out"; then
    echo "layers: the check failed on $name without naming it ($expect):" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "layers: planted $name refused"
}

fresh
sed -i 's|^\[dependencies\]$|[dependencies]\nquilt-patch = { path = "../../engine/patch" }|' "$work/ws/crates/api/vfs/Cargo.toml"
expect_failure "vfs -> patch" "quilt-vfs (api) -> quilt-patch (engine), normal"

fresh
sed -i 's|^\[dev-dependencies\]$|[dev-dependencies]\nquilt-ext2 = { path = "../../modules/ext2" }|' "$work/ws/crates/interfaces/fusewire/Cargo.toml"
expect_failure "fusewire -> ext2 (dev)" "quilt-fusewire (interfaces) -> quilt-ext2 (modules), dev"

fresh
sed -i 's|^\[dependencies\]$|[dependencies]\nquilt-ext2 = { path = "../ext2" }|' "$work/ws/crates/modules/betree/Cargo.toml"
expect_failure "betree -> ext2 (same layer, unlisted)" "quilt-betree (modules) -> quilt-ext2 (modules), normal: same layer"

fresh
mv "$work/ws/crates/devices/block" "$work/ws/crates/block"
sed -i 's|crates/devices/block|crates/block|' "$work/ws/Cargo.toml"
expect_failure "a crate outside the layer folders" "quilt-block: lives at crates/block/Cargo.toml"

fresh
sed -i '/deny(clippy::unwrap_used)/d' "$work/ws/crates/modules/betree/src/lib.rs"
expect_failure "a crate without the unwrap policy" "quilt-betree: crates/modules/betree/src/lib.rs does not deny clippy::unwrap_used"

echo "layers: ok"
