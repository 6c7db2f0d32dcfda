//! What the FUSE tests share: whether this process may mount FUSE, and a fresh ext2
//! file system in memory to mount.

use quilt_block::MemDevice;
use quilt_ext2::{Ext2, MkfsOptions};
use quilt_patch::EngineOptions;
use std::sync::Arc;

/// Can this process mount FUSE file systems (root and /dev/fuse)? Tests that need it are
/// skipped otherwise, unless `QUILT_REQUIRE_FUSE=1` (set by scripts/test.sh when run as
/// root) makes that a failure.
pub fn fuse_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let ok = unsafe { libc::geteuid() } == 0 && std::path::Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_FUSE").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_FUSE=1 but this process cannot mount FUSE (needs root and /dev/fuse)"
        );
        eprintln!("SKIPPED: needs root and /dev/fuse");
    }
    ok
}

/// A freshly made ext2 file system on a 16 MiB in-memory device, opened with defaults.
pub fn fresh_ext2() -> Arc<Ext2> {
    let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
    let zeroed = MkfsOptions {
        device_is_zeroed: true,
        ..Default::default()
    };
    quilt_stack::mkfs_ext2(dev.clone(), EngineOptions::default(), &zeroed).unwrap();
    Arc::new(quilt_stack::ext2(dev, quilt_stack::Ext2Spec::default()).unwrap())
}
