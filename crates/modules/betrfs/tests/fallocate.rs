//! fallocate on betrfs as data-integrity testers meet it on ext4: KEEP_SIZE past the
//! end of a file succeeds without changing it (ext4 answers 0; EOPNOTSUPP stopped fsx
//! and friends), and a preallocation larger than one log record goes through in pieces
//! (it was refused with EOPNOTSUPP), holes becoming zeroed blocks SEEK_DATA finds.

use quilt_betrfs::{mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Ctx, FileSystem, FsError};
use std::sync::Arc;

const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
const REG: u32 = libc::S_IFREG | 0o644;

fn fresh(blocks: u64) -> (Arc<MemDevice>, Betrfs) {
    let dev = Arc::new(MemDevice::new(4096, blocks).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), MountOptions::default()).unwrap();
    (dev, fs)
}

#[test]
fn keep_size_past_the_end_succeeds_and_changes_nothing() {
    let (_dev, fs) = fresh(16384);
    let c = Ctx::root();
    let f = fs.mknod(fs.root(), b"f", REG, 0, &c).unwrap().ino;
    fs.write(f, 0, &[1u8; 5000], &c).unwrap();
    let before = fs.getattr(f).unwrap();
    // Wholly past the end, and across it.
    fs.fallocate(f, 49152, 8192, KEEP, &c).unwrap();
    fs.fallocate(f, 4096, 65536, KEEP, &c).unwrap();
    let after = fs.getattr(f).unwrap();
    assert_eq!(after.size, before.size);
    assert_eq!(
        after.blocks, before.blocks,
        "no block past the end, none new inside"
    );
    assert_eq!(fs.read(f, 0, 10_000).unwrap(), vec![1u8; 5000]);
    // On an empty file too.
    let e = fs.mknod(fs.root(), b"e", REG, 0, &c).unwrap().ino;
    fs.fallocate(e, 0, 1 << 20, KEEP, &c).unwrap();
    assert_eq!(fs.getattr(e).unwrap().size, 0);
}

#[test]
fn a_large_preallocation_goes_through_in_pieces() {
    let (dev, fs) = fresh(65536); // 256 MiB
    let c = Ctx::root();
    let f = fs.mknod(fs.root(), b"big", REG, 0, &c).unwrap().ino;
    fs.write(f, 8 << 20, b"middle", &c).unwrap();
    let len = 64u64 << 20;
    fs.fallocate(f, 0, len, 0, &c).unwrap();
    let a = fs.getattr(f).unwrap();
    assert_eq!(a.size, len);
    assert_eq!(a.blocks, len / 512, "every block of the range present");
    assert_eq!(
        fs.seek_data(f, 0, false).unwrap(),
        len,
        "no hole before the end"
    );
    assert_eq!(fs.read(f, 8 << 20, 6).unwrap(), b"middle");
    assert!(fs.read(f, 0, 1 << 20).unwrap().iter().all(|&b| b == 0));
    fs.unmount().unwrap();
    drop(fs);
    let report = quilt_betrfs::fsck::fsck(dev.clone(), false).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let fs = Betrfs::open(dev, MountOptions::default()).unwrap();
    let f = fs.lookup(fs.root(), b"big").unwrap();
    assert_eq!((f.size, f.blocks), (len, len / 512));
}

#[test]
fn a_preallocation_that_does_not_fit_fails_with_enospc() {
    let (_dev, fs) = fresh(8192); // 32 MiB
    let c = Ctx::root();
    let f = fs.mknod(fs.root(), b"f", REG, 0, &c).unwrap().ino;
    assert_eq!(fs.fallocate(f, 0, 1 << 30, 0, &c), Err(FsError::NoSpace));
    assert_eq!(fs.getattr(f).unwrap().size, 0);
}
