//! Regression test for what the crash explorer found: in soft-updates mode, an fsync of
//! a new file in a new directory made the file durable but not the directory's own
//! name, so after a crash the file was unreachable. fsync now also flushes the pending
//! names of its new ancestor directories.

mod support;

use quilt_block::{BlockDevice, BlockDeviceExt, MemDevice, RecordingDevice};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem};
use std::sync::Arc;

#[test]
fn an_fsynced_file_in_new_directories_survives_a_crash() {
    let mem = Arc::new(MemDevice::new(4096, 4096).unwrap());
    mkfs(
        &Engine::new(mem.clone(), EngineOptions::default()),
        &MkfsOptions {
            device_is_zeroed: true,
            ..Default::default()
        },
    )
    .unwrap();
    let base = mem.to_vec();
    for mode in [Mode::SoftUpdates, Mode::Async] {
        let dev = Arc::new(MemDevice::from_bytes(4096, &base).unwrap());
        let rec = Arc::new(RecordingDevice::new(dev, 1 << 30));
        let fs = Ext2::open(
            Engine::new(rec.clone(), EngineOptions::default()),
            MountOptions {
                journal: support::journals(),
                mode,
                read_only: false,
                ..Default::default()
            },
        )
        .unwrap();
        let c = Ctx::root();
        let a = fs.mkdir(fs.root(), b"a", 0o755, &c).unwrap().ino;
        let b = fs.mkdir(a, b"b", 0o755, &c).unwrap().ino;
        let f = fs.mknod(b, b"f", libc::S_IFREG | 0o644, 0, &c).unwrap().ino;
        fs.write(f, 0, b"kept", &c).unwrap();
        fs.fsync(f, false).unwrap();
        rec.mark("fsynced");
        let log = rec.take_log();
        drop(fs);
        // The crash: exactly what reached the device by the time fsync returned.
        let crashed = MemDevice::from_bytes(4096, &base).unwrap();
        log.replay_prefix(log.mark_position("fsynced").unwrap(), &crashed)
            .unwrap();
        let crashed = Arc::new(crashed);
        let fs = Ext2::open(
            Engine::new(
                crashed.clone() as Arc<dyn BlockDevice>,
                EngineOptions::default(),
            ),
            MountOptions {
                journal: support::journals(),
                mode: Mode::Async,
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mut ino = fs.root();
        for name in [&b"a"[..], b"b", b"f"] {
            ino = fs
                .lookup(ino, name)
                .unwrap_or_else(|e| {
                    panic!(
                        "{mode}: {} is not reachable: {e}",
                        String::from_utf8_lossy(name)
                    )
                })
                .ino;
        }
        assert_eq!(fs.read(ino, 0, 100).unwrap(), b"kept", "{mode}");
    }
}
