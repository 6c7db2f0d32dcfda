//! Damaged images: bit flips and garbage in every kind of metadata block. Opening and then
//! walking and changing the tree must give errors (or work), never panic or hang.

mod support;

use quilt_block::{BlockDevice, MemDevice};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FsError, XattrFlags};
use std::sync::Arc;

const BS: usize = 1024;

/// A small populated image: directories over several blocks, files with indirect
/// blocks, symlinks, xattrs.
fn populated() -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(BS, 4096).unwrap());
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    mkfs(
        &engine,
        &MkfsOptions {
            device_is_zeroed: true,
            ..Default::default()
        },
    )
    .unwrap();
    let fs = Ext2::open(engine, support::options()).unwrap();
    let c = Ctx::root();
    let r = fs.root();
    let d = fs.mkdir(r, b"dir", 0o755, &c).unwrap().ino;
    for i in 0..40 {
        let f = fs
            .mknod(d, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        fs.write(f, (i as u64) * 5000, &vec![i as u8; 3000], &c)
            .unwrap();
    }
    let big = fs
        .mknod(r, b"big", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    fs.write(big, 0, &vec![9u8; 300_000], &c).unwrap();
    fs.symlink(r, b"s", &[b'x'; 200], &c).unwrap();
    fs.setxattr(big, b"user.k", b"v", XattrFlags::default(), &Ctx::root())
        .unwrap();
    fs.unmount().unwrap();
    dev.to_vec()
}

/// Walks everything, then changes a few things; returns how many operations failed.
fn exercise(fs: &Ext2) -> usize {
    let c = Ctx::root();
    let mut errors = 0;
    let mut stack = vec![fs.root()];
    let mut visited = 0;
    while let Some(dir) = stack.pop() {
        visited += 1;
        if visited > 500 {
            break;
        }
        let mut entries = Vec::new();
        if fs
            .readdir(dir, 0, &mut |e| {
                entries.push(e);
                entries.len() < 1000
            })
            .is_err()
        {
            errors += 1;
            continue;
        }
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            match fs.lookup(dir, &e.name) {
                Ok(a) => match a.kind {
                    quilt_vfs::FileType::Directory => stack.push(a.ino),
                    quilt_vfs::FileType::Regular => {
                        errors += fs.read(a.ino, 0, 1 << 20).is_err() as usize;
                        errors += fs.listxattr(a.ino).is_err() as usize;
                        errors += fs.write(a.ino, 7000, b"poke", &c).is_err() as usize;
                    }
                    quilt_vfs::FileType::Symlink => errors += fs.readlink(a.ino).is_err() as usize,
                    _ => {}
                },
                Err(_) => errors += 1,
            }
        }
    }
    let r = fs.root();
    errors += fs.mknod(r, b"new", libc::S_IFREG | 0o644, 0, &c).is_err() as usize;
    errors += fs.mkdir(r, b"newdir", 0o755, &c).is_err() as usize;
    errors += fs.unlink(r, b"big", &c).is_err() as usize;
    errors += fs
        .rename(r, b"dir", r, b"dir2", Default::default(), &c)
        .is_err() as usize;
    let _ = fs.sync_all();
    errors
}

/// A seeded stream (ChaCha8: the same in every run and on every machine).
struct Rng(rand_chacha::ChaCha8Rng);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(rand::SeedableRng::seed_from_u64(seed))
    }
    fn next(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }
}

#[test]
fn damaged_metadata_gives_errors_not_panics() {
    let clean = populated();
    // Locate the metadata: superblock (block 1 at 1 KiB), descriptors (block 2), then
    // group 0's bitmaps and inode table from the descriptor, and the root directory
    // block from inode 2.
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let gd = 2 * BS;
    let (bb, ib, it) = (le32(&clean, gd), le32(&clean, gd + 4), le32(&clean, gd + 8));
    let root_inode = it * BS + 256;
    let root_dir_block = le32(&clean, root_inode + 0x28);
    let regions: Vec<(&str, usize, usize)> = vec![
        ("superblock", BS, 200),
        ("group descriptors", gd, 64),
        ("block bitmap", bb * BS, BS),
        ("inode bitmap", ib * BS, BS),
        ("inode table", it * BS, 16 * 256),
        ("root directory", root_dir_block * BS, BS),
    ];
    let cases: u64 = if std::env::var("CI").is_ok() { 40 } else { 200 };
    let mut rng = Rng::new(0x9e3779b97f4a7c15);
    let (mut refused, mut opened) = (0, 0);
    for (name, start, len) in &regions {
        for case in 0..cases {
            let mut img = clean.clone();
            if case % 4 == 0 {
                // Garbage over a stretch.
                let at = start + (rng.next() as usize % len);
                let n = 1 + rng.next() as usize % 64;
                for b in img.iter_mut().skip(at).take(n) {
                    *b = rng.next() as u8;
                }
            } else {
                for _ in 0..1 + case % 8 {
                    let at = start + (rng.next() as usize % len);
                    img[at] ^= 1 << (rng.next() % 8);
                }
            }
            let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
            let engine = Engine::new(dev.clone(), EngineOptions::default());
            match Ext2::open(engine, support::options()) {
                Err(e) => {
                    refused += 1;
                    assert!(!e.to_string().is_empty(), "{name}: error without a message");
                }
                Ok(fs) => {
                    opened += 1;
                    exercise(&fs);
                    let _ = fs.unmount();
                }
            }
        }
    }
    eprintln!("damaged images: {refused} refused at mount, {opened} mounted and exercised");
    assert!(refused > 0, "some superblock damage must be refused");
    assert!(opened > 0);
}

#[test]
fn clear_errors_for_wrong_images() {
    // Not ext2 at all.
    let dev = Arc::new(MemDevice::new(BS, 1024).unwrap());
    let err = Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        support::options(),
    )
    .err()
    .unwrap();
    assert!(
        matches!(err, FsError::Corrupt(ref m) if m.contains("magic")),
        "{err}"
    );
    // An unknown incompatible feature is refused; an unknown read-only one mounts
    // read-only.
    let clean = populated();
    let mut img = clean.clone();
    img[BS + 0x60] |= 0x80; // incompat: 0x80 is not ours
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
    let err = Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        support::options(),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("incompatible"), "{err}");
    let mut img = clean.clone();
    img[BS + 0x64] |= 0x40; // ro_compat: unknown to us
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
    let fs = Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        support::options(),
    )
    .unwrap();
    assert!(fs.is_read_only());
    assert_eq!(
        fs.mkdir(fs.root(), b"x", 0o755, &Ctx::root()),
        Err(FsError::ReadOnly)
    );
    // A device smaller than the superblock says.
    let dev = Arc::new(MemDevice::from_bytes(BS, &clean[..clean.len() / 2]).unwrap());
    let err = Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        support::options(),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("image holds only"), "{err}");
    let _ = MemDevice::block_size;
}

#[test]
fn damage_found_while_mounted_marks_the_superblock_and_follows_errors_option() {
    use quilt_ext2::format::{Superblock, STATE_ERROR};
    use quilt_ext2::Errors;
    let clean = populated();
    // The root directory's first block, from inode 2 of group 0's table.
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let it = le32(&clean, 2 * BS + 8);
    let dir_block = le32(&clean, it * BS + 256 + 0x28);
    for errors in [Errors::RemountRo, Errors::Continue] {
        let mut img = clean.clone();
        img[dir_block * BS..dir_block * BS + 64].fill(0xff);
        let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
        let engine = Engine::new(dev.clone(), EngineOptions::default());
        let opts = MountOptions {
            journal: support::journals(),
            errors,
            ..Default::default()
        };
        let fs = Ext2::open(engine, opts).unwrap();
        let err = fs.readdir(fs.root(), 0, &mut |_| true).unwrap_err();
        assert!(
            matches!(&err, FsError::Corrupt(m) if m.contains(&format!("block {dir_block}"))),
            "{err}"
        );
        let made = fs.mkdir(fs.root(), b"after", 0o755, &Ctx::root());
        match errors {
            Errors::RemountRo => assert_eq!(made.unwrap_err(), FsError::ReadOnly),
            Errors::Continue => assert!(!matches!(made, Err(FsError::ReadOnly))),
        }
        fs.unmount().unwrap();
        let sb = Superblock::decode(&dev.to_vec()[1024..2048]).unwrap();
        assert_ne!(
            sb.state & STATE_ERROR,
            0,
            "{errors:?}: the superblock records the error"
        );
        let raw = dev.to_vec();
        // Under continue the mkdir met the damage too: each error is counted.
        let count = if errors == Errors::Continue { 2 } else { 1 };
        assert_eq!(
            le32(&raw, 1024 + 0x194),
            count,
            "{errors:?}: errors counted"
        );
        assert_eq!(
            le32(&raw, 1024 + 0x1D8),
            dir_block,
            "the damaged block recorded"
        );
    }
}

#[test]
fn freeing_a_block_the_bitmap_says_is_free_is_reported_damage() {
    let clean = populated();
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let le16 = |b: &[u8], o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap()) as usize;
    let (bb, it) = (le32(&clean, 2 * BS), le32(&clean, 2 * BS + 8));
    // `big`'s inode, from the root directory's entries.
    let dir = le32(&clean, it * BS + 256 + 0x28) * BS;
    let mut at = dir;
    let big = loop {
        assert!(at < dir + BS, "big is in the root directory");
        let (ino, rec, len) = (
            le32(&clean, at),
            le16(&clean, at + 4),
            clean[at + 6] as usize,
        );
        if &clean[at + 8..at + 8 + len] == b"big" {
            break ino;
        }
        at += rec;
    };
    // Its fifth data block, marked free in the bitmap (one group: bit = block - 1).
    let inode = it * BS + (big - 1) * 256;
    let victim = le32(&clean, inode + 0x28 + 4 * 4);
    let mut img = clean.clone();
    img[bb * BS + (victim - 1) / 8] &= !(1 << ((victim - 1) % 8));
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
    let fs = Ext2::open(
        Engine::new(dev.clone(), EngineOptions::default()),
        support::options(),
    )
    .unwrap();
    let err = fs.unlink(fs.root(), b"big", &Ctx::root()).unwrap_err();
    assert!(
        matches!(&err, FsError::Corrupt(m) if m.contains(&format!("freeing block {victim}, which is already free"))),
        "{err}"
    );
    let _ = fs.unmount();
    let sb = quilt_ext2::format::Superblock::decode(&dev.to_vec()[1024..2048]).unwrap();
    assert_ne!(
        sb.state & quilt_ext2::format::STATE_ERROR,
        0,
        "the superblock records it"
    );
}

/// In the journal modes, recording damage found by a change syncs, and a commit waits
/// for every open operation to end: recorded inside the change's own operation, it
/// waited for itself and the mount hung (found by the fuzzing smoke on a damaged
/// journal). The change must return its error, and the error must be on disk.
#[test]
fn damage_found_by_a_change_in_a_journal_mode_returns_and_is_recorded() {
    use quilt_ext2::format::{Superblock, STATE_ERROR};
    use quilt_ext2::{Errors, Mode};
    let mut img = populated();
    {
        let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
        let fs = Ext2::open(
            Engine::new(dev.clone(), EngineOptions::default()),
            support::options(),
        )
        .unwrap();
        fs.create_journal(1024).unwrap();
        fs.unmount().unwrap();
        img = dev.to_vec();
    }
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let it = le32(&img, 2 * BS + 8);
    let dir_block = le32(&img, it * BS + 256 + 0x28);
    img[dir_block * BS..dir_block * BS + 64].fill(0xff);
    for mode in [Mode::MetaJournal, Mode::FullJournal] {
        let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
        let fs = Arc::new(
            Ext2::open(
                Engine::new(dev.clone(), EngineOptions::default()),
                MountOptions {
                    journal: support::journals(),
                    mode,
                    errors: Errors::Continue,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let f = fs.clone();
        std::thread::spawn(move || {
            let r = f.mkdir(f.root(), b"new", 0o755, &Ctx::root());
            let _ = tx.send(r);
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{mode:?}: a change that met damage did not return"));
        assert!(matches!(r, Err(FsError::Corrupt(_))), "{mode:?}: {r:?}");
        fs.unmount().unwrap();
        let sb = Superblock::decode(&dev.to_vec()[1024..2048]).unwrap();
        assert_ne!(sb.state & STATE_ERROR, 0, "{mode:?}: the error is recorded");
    }
}
