//! Files unlinked while open, and what a crash leaves of them: their data stays where it
//! was until the last release, and a crash before it leaves nothing behind after the
//! next mount (checked key by key, and by fsck).

use quilt_betrfs::{fsck, mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Ctx, FileSystem};
use std::sync::Arc;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn keys(fs: &Betrfs) -> Vec<Vec<u8>> {
    fs.tree().range(b"", None).map(|kv| kv.unwrap().0).collect()
}

#[test]
fn a_crash_with_open_unlinked_files_frees_them_at_the_next_mount() {
    let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let c = Ctx::root();
    let r = fs.root();
    let before = keys(&fs).len();
    let d = fs.mkdir(r, b"d", 0o755, &c).unwrap().ino;
    for (i, size) in [10usize, 5000, 300_000, 3_000_000].into_iter().enumerate() {
        let name = format!("f{i}");
        let f = fs
            .mknod(d, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        fs.write(f, 0, &vec![i as u8 + 1; size], &c).unwrap();
        fs.open(f).unwrap();
        fs.unlink(d, name.as_bytes(), &c).unwrap();
        assert_eq!(fs.read(f, size as u64 - 1, 10).unwrap(), vec![i as u8 + 1]);
    }
    // A name reused while its old file is open, then the directory renamed.
    let f = fs
        .mknod(d, b"f1", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    fs.write(f, 0, b"kept", &c).unwrap();
    fs.rename(r, b"d", r, b"e", Default::default(), &c).unwrap();
    fs.fsync(f, false).unwrap();
    // The crash: no release, no unmount.
    drop(fs);
    let fs = Betrfs::open(
        Arc::new(MemDevice::from_bytes(4096, &dev.to_vec()).unwrap()),
        opts(),
    )
    .unwrap();
    let e = fs.lookup(fs.root(), b"e").unwrap().ino;
    let f = fs.lookup(e, b"f1").unwrap().ino;
    assert_eq!(fs.read(f, 0, 100).unwrap(), b"kept");
    // What is left: the superblock, root, lost+found, e, e/f1 and its one block; e, a
    // large directory when it moved, is a zone's root (its zone's record, and its
    // index key).
    let left = keys(&fs);
    assert_eq!(left.len(), before + 5, "{left:?}");
    fs.unmount().unwrap();
    drop(fs);
    let r = fsck::fsck(dev.clone(), false).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}
