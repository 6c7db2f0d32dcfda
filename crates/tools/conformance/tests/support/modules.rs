//! The modules as the native-API tests make, mount and check them: a 64 MiB memory
//! image, built through the wiring crate, and each module's own checker as the oracle
//! (e2fsck for ext2, betrfs fsck).

#![allow(dead_code)] // each test file uses its share

use quilt_block::{BlockDevice, MemDevice};
use quilt_vfs::FileSystem;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Ext2(quilt_ext2::Mode),
    Betrfs,
}

/// Journal blocks given to an ext2 image made for a journal mode.
pub const JOURNAL_BLOCKS: u32 = 2048;

/// A fresh image for `kind` (4 KiB blocks, 16384 of them); ext2 gets a journal when
/// its mode uses one.
pub fn mkfs(kind: Kind) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(4096, 16384).expect("a memory device"));
    match kind {
        Kind::Ext2(mode) => {
            let (engine, _) = quilt_stack::mkfs_ext2(
                dev.clone(),
                Default::default(),
                &quilt_ext2::MkfsOptions {
                    device_is_zeroed: true,
                    inodes: Some(2048),
                    ..Default::default()
                },
            )
            .expect("mkfs ext2");
            if mode.is_journal() {
                quilt_stack::add_journal(engine, JOURNAL_BLOCKS, false).expect("add a journal");
            }
        }
        Kind::Betrfs => quilt_stack::mkfs_betrfs(dev.clone()).expect("mkfs betrfs"),
    }
    dev
}

/// A mounted module, kept as its own type so that it can be unmounted (which the
/// trait object cannot be).
pub enum Mounted {
    Ext2(Box<quilt_ext2::Ext2>),
    Betrfs(Box<quilt_betrfs::Betrfs>),
}

impl std::ops::Deref for Mounted {
    type Target = dyn FileSystem;
    fn deref(&self) -> &Self::Target {
        match self {
            Mounted::Ext2(f) => &**f,
            Mounted::Betrfs(f) => &**f,
        }
    }
}

/// Mounts `dev` (betrfs without its commit timer: the tests decide when things are
/// written).
pub fn try_mount(kind: Kind, dev: Arc<dyn BlockDevice>) -> Result<Mounted, quilt_vfs::FsError> {
    Ok(match kind {
        Kind::Ext2(mode) => Mounted::Ext2(Box::new(quilt_stack::ext2(
            dev,
            quilt_stack::Ext2Spec::mount(quilt_ext2::MountOptions {
                mode,
                ..Default::default()
            }),
        )?)),
        Kind::Betrfs => Mounted::Betrfs(Box::new(quilt_stack::betrfs(
            dev,
            quilt_betrfs::MountOptions {
                commit_interval: None,
                ..Default::default()
            },
        )?)),
    })
}

pub fn mount(kind: Kind, dev: Arc<dyn BlockDevice>) -> Mounted {
    try_mount(kind, dev).expect("mount")
}

pub fn unmount(fs: Mounted) {
    match fs {
        Mounted::Ext2(f) => f.unmount().expect("unmount ext2"),
        Mounted::Betrfs(f) => f.unmount().expect("unmount betrfs"),
    }
}

/// The module's checker finds nothing wrong with the image: `e2fsck -fn` (skipped
/// where it is not installed, unless QUILT_REQUIRE_E2FSCK is set), betrfs fsck.
pub fn check(kind: Kind, dev: &Arc<MemDevice>) {
    match kind {
        Kind::Ext2(_) => {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let img = dir.path().join("img");
            std::fs::write(&img, dev.to_vec()).expect("write the image");
            let Ok(out) = std::process::Command::new("e2fsck")
                .arg("-fn")
                .arg(&img)
                .output()
            else {
                assert!(
                    std::env::var_os("QUILT_REQUIRE_E2FSCK").is_none(),
                    "e2fsck is required"
                );
                return;
            };
            assert!(
                out.status.success(),
                "e2fsck: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Kind::Betrfs => {
            let r = quilt_betrfs::fsck::fsck(dev.clone() as Arc<dyn BlockDevice>, false)
                .expect("betrfs fsck runs");
            assert_eq!(r.exit_code(), 0, "fsck: {:?}", r.problems);
        }
    }
}
