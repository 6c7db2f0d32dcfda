//! Mounts an in-memory ext2 at the directory given and serves it until it is
//! unmounted: the adapter and transport without the CLI (works for non-root users
//! too, through fusermount3).
//!
//!     cargo run --release -p quilt-conformance --example memmount -- DIR

use quilt_block::MemDevice;
use quilt_ext2::MkfsOptions;
use quilt_patch::EngineOptions;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: memmount DIR")?;
    let dev = Arc::new(MemDevice::new(4096, 16384)?);
    quilt_stack::mkfs_ext2(
        dev.clone(),
        EngineOptions::default(),
        &MkfsOptions {
            device_is_zeroed: true,
            root_uid: unsafe { libc::geteuid() },
            root_gid: unsafe { libc::getegid() },
            ..Default::default()
        },
    )?;
    let fs = Arc::new(quilt_stack::ext2(dev, quilt_stack::Ext2Spec::default())?);
    quilt_fuse::serve(
        fs,
        std::path::Path::new(&dir),
        &quilt_fuse::FuseOptions::default(),
        |kind| eprintln!("memmount: mounted ({kind:?})"),
        Box::new(|| eprintln!("memmount: unmounted")),
    )?;
    Ok(())
}
