//! Damaged betrfs images: whatever is wrong, a mount refuses with an error or the
//! operations that meet the damage answer EIO (and the image is marked for fsck); never
//! a panic. Two kinds of damage: bytes of the image changed under the tree (its
//! checksums catch them), and records the tree holds intact but that make no sense to
//! the file system (written through the tree directly), which fsck must report.

use quilt_betree::{Batch, Tree};
use quilt_betrfs::{fsck, keys, mkfs, Betrfs, MountOptions};
use quilt_block::{BlockDevice, MemDevice};
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, Ino};
use std::sync::Arc;

const BLOCKS: u64 = 4096;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// An image with a little of everything: directories, files of several sizes, a hard
/// link, a symlink, xattrs.
fn populated() -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(4096, BLOCKS).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let c = Ctx::root();
    let root = fs.root();
    let d = fs.mkdir(root, b"dir", 0o755, &c).unwrap().ino;
    for i in 0..20u32 {
        let f = fs
            .mknod(d, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        fs.write(f, 0, &vec![i as u8; 1000 * i as usize + 1], &c)
            .unwrap();
        fs.setxattr(f, b"user.k", b"v", Default::default(), &c)
            .unwrap();
    }
    let f0 = fs.lookup(d, b"f3").unwrap().ino;
    fs.link(f0, root, b"hard", &c).unwrap();
    fs.symlink(d, b"sym", b"../hard", &c).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    dev.to_vec()
}

/// Walks everything reachable, reading every file, link and attribute. Returns the
/// errors met; panics only if the file system does.
fn walk(fs: &Betrfs) -> Vec<FsError> {
    let mut errs = Vec::new();
    let mut stack: Vec<Ino> = vec![fs.root()];
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        seen += 1;
        if seen > 10_000 {
            break;
        }
        let mut names = Vec::new();
        if let Err(e) = fs.readdir(dir, 0, &mut |e| {
            names.push(e.name);
            true
        }) {
            errs.push(e);
            continue;
        }
        for n in names {
            if n == b"." || n == b".." {
                continue;
            }
            match fs.lookup(dir, &n) {
                Err(e) => errs.push(e),
                Ok(a) => {
                    let _ = fs.listxattr(a.ino).map_err(|e| errs.push(e));
                    match a.kind {
                        FileType::Directory => stack.push(a.ino),
                        FileType::Regular => {
                            if let Err(e) = fs.read(a.ino, 0, 1 << 20) {
                                errs.push(e)
                            }
                        }
                        FileType::Symlink => {
                            if let Err(e) = fs.readlink(a.ino) {
                                errs.push(e)
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    errs
}

fn is_damage(e: &FsError) -> bool {
    matches!(e, FsError::Corrupt(_) | FsError::Io(_) | FsError::Stale)
}

#[test]
fn every_used_block_flipped_is_an_error_never_a_panic() {
    let img = populated();
    let bs = 4096;
    // The blocks the image uses (the rest are zero).
    let used: Vec<usize> = (0..img.len() / bs)
        .filter(|&b| img[b * bs..(b + 1) * bs].iter().any(|&x| x != 0))
        .collect();
    assert!(used.len() > 4, "the image uses {} blocks", used.len());
    let (mut refused, mut mounted) = (0, 0);
    for &b in &used {
        for &(at, how) in &[(17usize, 0x01u8), (bs / 2, 0xff), (bs - 3, 0x80)] {
            let mut bad = img.clone();
            bad[b * bs + at] ^= how;
            let dev = Arc::new(MemDevice::from_bytes(bs, &bad).unwrap());
            match Betrfs::open(dev, opts()) {
                Err(e) => {
                    assert!(is_damage(&e), "block {b}: mount failed with {e:?}");
                    refused += 1;
                }
                Ok(fs) => {
                    mounted += 1;
                    for e in walk(&fs) {
                        assert!(is_damage(&e), "block {b}: {e:?}");
                    }
                }
            }
        }
    }
    eprintln!(
        "{} used blocks, 3 flips each: {refused} mounts refused, {mounted} mounted (damage in unused bytes or met later)",
        used.len()
    );
    assert!(refused > 0);
}

/// Records the tree holds intact but that betrfs must refuse: each is written into a
/// good image through the tree, then the image is mounted and walked.
#[test]
fn nonsense_records_are_eio_and_fsck_reports_them() {
    let img = populated();
    let name = |path: &[&[u8]]| {
        let mut prefix = Vec::new();
        let mut k = Vec::new();
        for c in path {
            k = keys::child_key(&prefix, c);
            prefix = keys::dir_prefix(&k);
        }
        k
    };
    let f5 = name(&[b"dir", b"f5"]);
    let cases: Vec<(&str, Batch)> = vec![
        ("a truncated inode record", {
            let mut b = Batch::new();
            b.put(&keys::meta_key(&f5), &[1, 1, 0, 0]);
            b
        }),
        ("an unknown record tag", {
            let mut b = Batch::new();
            b.put(&keys::meta_key(&f5), &[9, 1, 2, 3, 4, 5, 6, 7, 8]);
            b
        }),
        ("a link to a missing inode", {
            let mut b = Batch::new();
            b.put(
                &keys::meta_key(&f5),
                &quilt_betrfs::record::Entry::link_stub(999_999, libc::S_IFREG),
            );
            b
        }),
        ("a name whose directory is missing", {
            let mut b = Batch::new();
            let orphan = name(&[b"nodir", b"x"]);
            b.put(
                &keys::meta_key(&orphan),
                &quilt_betrfs::record::Entry::link_stub(3, libc::S_IFREG),
            );
            b
        }),
        ("a data block past the end of its file", {
            let mut b = Batch::new();
            b.put(&keys::Loc::Path(f5.clone()).data_key(1000), b"stray");
            b
        }),
        ("a damaged superblock record", {
            let mut b = Batch::new();
            b.put(keys::SUPER, b"garbage");
            b
        }),
        ("a key in no key space", {
            let mut b = Batch::new();
            b.put(b"zzz", b"?");
            b
        }),
    ];
    for (what, batch) in cases {
        let dev = Arc::new(MemDevice::from_bytes(4096, &img).unwrap());
        {
            let t = Tree::open(
                dev.clone(),
                quilt_betrfs::tree_options(4096, dev.block_count()),
            )
            .unwrap();
            t.write(batch).unwrap();
            t.close().unwrap();
        }
        let report = fsck::fsck(dev.clone(), false);
        match &report {
            Ok(r) => assert!(!r.problems.is_empty(), "{what}: fsck finds nothing ({r:?})"),
            Err(e) => assert!(is_damage(e), "{what}: fsck fails with {e:?}"),
        }
        match Betrfs::open(dev.clone(), opts()) {
            Err(e) => assert!(is_damage(&e), "{what}: mount fails with {e:?}"),
            Ok(fs) => {
                let errs = walk(&fs);
                for e in &errs {
                    assert!(is_damage(e), "{what}: {e:?}");
                }
                let met = !errs.is_empty();
                fs.unmount().unwrap();
                drop(fs);
                if met {
                    // Damage met while mounted is remembered for fsck.
                    let r = fsck::fsck(dev.clone(), false).unwrap();
                    assert!(
                        r.problems.iter().any(|p| p.contains("recorded damage")),
                        "{what}: the error flag is not set: {:?}",
                        r.problems
                    );
                }
            }
        }
    }
}

/// `fsck -y` repairs what it can without guessing, and a second check finds the image
/// clean: a directory's wrong link count, a file's wrong block count, a data block past
/// the end, and an inode with no name (which goes to lost+found).
#[test]
fn fsck_repairs_counts_strays_and_nameless_inodes() {
    let img = populated();
    let dev = Arc::new(MemDevice::from_bytes(4096, &img).unwrap());
    {
        let t = Tree::open(
            dev.clone(),
            quilt_betrfs::tree_options(4096, dev.block_count()),
        )
        .unwrap();
        let dir = keys::child_key(b"", b"dir");
        let f7 = keys::child_key(&keys::dir_prefix(&dir), b"f7");
        let mut b = Batch::new();
        for (k, change) in [(&dir, 0u8), (&f7, 1)] {
            let v = t.get(&keys::meta_key(k)).unwrap().unwrap();
            let quilt_betrfs::record::Entry::Inode(mut i) =
                quilt_betrfs::record::Entry::decode(&v).unwrap()
            else {
                panic!("an inode record")
            };
            if change == 0 {
                i.nlink = 7;
            } else {
                i.blocks += 5;
            }
            b.put(&keys::meta_key(k), &i.encode());
        }
        b.put(&keys::Loc::Path(f7.clone()).data_key(999), b"stray");
        // A nameless inode: f7's record, under a number of its own, without data.
        let quilt_betrfs::record::Entry::Inode(mut lost) =
            quilt_betrfs::record::Entry::decode(&t.get(&keys::meta_key(&f7)).unwrap().unwrap())
                .unwrap()
        else {
            panic!("an inode record")
        };
        lost.blocks = 0;
        lost.size = 0;
        lost.ino = 77_000;
        b.put(&keys::inode_key(77_000), &lost.encode());
        b.put(
            keys::SUPER,
            &quilt_betrfs::record::Super {
                next_ino: 80_000,
                next_ns: 1,
                version: 2,
                dirty: false,
                error: false,
                next_zone: 1,
            }
            .encode(),
        );
        t.write(b).unwrap();
        t.close().unwrap();
    }
    let before = fsck::fsck(dev.clone(), false).unwrap();
    assert!(before.problems.len() >= 4, "{:?}", before.problems);
    let fixed = fsck::fsck(dev.clone(), true).unwrap();
    assert_eq!(
        fixed.exit_code(),
        1,
        "{:?} / {:?}",
        fixed.fixed,
        fixed.problems
    );
    let after = fsck::fsck(dev.clone(), false).unwrap();
    assert!(after.problems.is_empty(), "{:?}", after.problems);
    assert_eq!(after.exit_code(), 0);
    // The nameless inode is in lost+found.
    let fs = Betrfs::open(dev, opts()).unwrap();
    let lf = fs.lookup(fs.root(), b"lost+found").unwrap().ino;
    assert_eq!(fs.lookup(lf, b"#77000").unwrap().ino, 77_000);
}

/// What a walk shows of the tree: every name with its kind, contents (or target) and
/// attributes, in order.
fn snapshot(fs: &Betrfs) -> Result<std::collections::BTreeMap<String, String>, FsError> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack: Vec<(Ino, String)> = vec![(fs.root(), String::new())];
    while let Some((dir, path)) = stack.pop() {
        let mut names = Vec::new();
        fs.readdir(dir, 0, &mut |e| {
            names.push(e.name);
            true
        })?;
        for n in names {
            if n == b"." || n == b".." {
                continue;
            }
            let p = format!("{path}/{}", String::from_utf8_lossy(&n));
            let a = fs.lookup(dir, &n)?;
            let what = match a.kind {
                FileType::Directory => {
                    stack.push((a.ino, p.clone()));
                    format!("dir {}", a.nlink)
                }
                FileType::Regular => {
                    let data = fs.read(a.ino, 0, (a.size + 1) as u32)?;
                    format!("file {} {} {:08x}", a.nlink, data.len(), crc32(&data))
                }
                FileType::Symlink => format!("link {:?}", fs.readlink(a.ino)?),
                k => format!("{k:?}"),
            };
            let x = fs.listxattr(a.ino)?;
            out.insert(p, format!("{what} xattrs {x:?}"));
        }
    }
    Ok(out)
}

fn crc32(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &x| {
        (h ^ x as u32).wrapping_mul(0x0100_0193)
    })
}

/// A populated image that has been through many checkpoints, with a log that wrapped
/// round its ring several times, cleanly unmounted.
fn well_used() -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(4096, BLOCKS).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let c = Ctx::root();
    let root = fs.root();
    for round in 0..6u32 {
        let d = fs
            .mkdir(root, format!("d{round}").as_bytes(), 0o755, &c)
            .unwrap()
            .ino;
        for i in 0..25u32 {
            let f = fs
                .mknod(d, format!("f{i}").as_bytes(), libc::S_IFREG | 0o644, 0, &c)
                .unwrap()
                .ino;
            let len = 300 * i as usize + 7 + (round as usize * 4096);
            fs.write(f, 0, &vec![(i + round) as u8; len], &c).unwrap();
            if i % 5 == 0 {
                fs.setxattr(
                    f,
                    b"user.k",
                    format!("v{i}").as_bytes(),
                    Default::default(),
                    &c,
                )
                .unwrap();
            }
        }
        // Churn that the log and the checkpoints see, then delete it.
        let t = fs
            .mknod(root, b"churn", libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        for k in 0..64u64 {
            fs.write(t, k * 16384, &[k as u8; 16384], &c).unwrap();
        }
        fs.sync_all().unwrap();
        fs.unlink(root, b"churn", &c).unwrap();
    }
    let f = fs
        .lookup(fs.lookup(root, b"d2").unwrap().ino, b"f3")
        .unwrap()
        .ino;
    fs.link(f, root, b"hard", &c).unwrap();
    fs.symlink(root, b"sym", b"d1/f4", &c).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    dev.to_vec()
}

/// The sweep: every block of a cleanly unmounted image that holds anything,
/// zeroed, and one bit of it flipped, one block at a time. Each damaged image either
/// mounts and shows every file as it was, or is refused with an error, or is reported
/// by fsck; never does it mount with something missing or changed while fsck calls it
/// clean (a silent rollback: a damaged newest header once opened the checkpoint
/// before it, 153 files fewer). CI takes every seventh block.
#[test]
fn no_single_damaged_block_changes_the_tree_silently() {
    let img = well_used();
    let bs = 4096;
    let good = {
        let dev = Arc::new(MemDevice::from_bytes(bs, &img).unwrap());
        let fs = Betrfs::open(dev, opts()).unwrap();
        snapshot(&fs).unwrap()
    };
    assert!(good.len() > 150, "the image holds {} names", good.len());
    let stride = if std::env::var("CI").is_ok_and(|v| v == "true") {
        7
    } else {
        1
    };
    let blocks: Vec<usize> = (0..img.len() / bs)
        .filter(|&b| img[b * bs..(b + 1) * bs].iter().any(|&x| x != 0))
        .step_by(stride)
        .collect();
    let (mut intact, mut refused, mut reported) = (0, 0, 0);
    for &b in &blocks {
        for how in ["zeroed", "flipped"] {
            let mut bad = img.clone();
            let blk = &mut bad[b * bs..(b + 1) * bs];
            if how == "zeroed" {
                blk.fill(0);
            } else {
                blk[(b * 131) % bs] ^= 1 << (b % 8);
            }
            let dev = Arc::new(MemDevice::from_bytes(bs, &bad).unwrap());
            let shown = match Betrfs::open(dev, opts()) {
                Err(e) => {
                    assert!(is_damage(&e), "block {b} {how}: refused with {e:?}");
                    refused += 1;
                    continue;
                }
                Ok(fs) => snapshot(&fs),
            };
            if shown.as_ref().ok() == Some(&good) {
                intact += 1;
                continue;
            }
            let dev = Arc::new(MemDevice::from_bytes(bs, &bad).unwrap());
            match fsck::fsck(dev, false) {
                Err(_) => reported += 1,
                Ok(r) if !r.problems.is_empty() => reported += 1,
                Ok(_) => {
                    let what = match &shown {
                        Err(e) => format!("an error ({e:?})"),
                        Ok(s) => {
                            let gone: Vec<_> = good
                                .keys()
                                .filter(|k| !s.contains_key(*k))
                                .take(5)
                                .collect();
                            let changed: Vec<_> = good
                                .iter()
                                .filter(|(k, v)| s.get(*k).is_some_and(|w| w != *v))
                                .map(|(k, _)| k)
                                .take(5)
                                .collect();
                            format!(
                                "{} names (of {}), gone {gone:?}, changed {changed:?}",
                                s.len(),
                                good.len()
                            )
                        }
                    };
                    panic!("block {b} {how}: mounts showing {what}, and fsck finds nothing");
                }
            }
        }
    }
    eprintln!(
        "{} blocks, zeroed and flipped: {intact} intact, {refused} refused, {reported} reported by fsck",
        blocks.len()
    );
}
