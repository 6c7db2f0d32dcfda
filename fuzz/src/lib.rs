//! Fuzzing what quiltfs reads from disk.
//!
//! Each target owns one region of a small populated image (the superblock and group
//! descriptors; inodes and indirect blocks; directory blocks; extended-attribute blocks
//! and in-inode attribute space; the journal). The input overwrites the start of its
//! region — an input shorter than the region leaves the rest as the seed image has it,
//! and `seed(region)` is the region's original bytes, the natural first corpus entry —
//! and the damaged image is then mounted, walked, changed, unmounted and mounted again.
//! Errors are expected; a panic, a hang or a sanitizer report is a bug.
//!
//! Everything is deterministic: the seed images are built once per process from a fixed
//! script, and times come from the clock only in fields no decision depends on.

pub mod betree;

pub use betree::{prepare_tree, run_records, run_tree, TreeRegion};
use quilt_block::MemDevice;
use quilt_ext2::format::{GroupDesc, Inode, Superblock, GDESC_SIZE};
use quilt_ext2::{Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::EngineOptions;
use quilt_vfs::{Ctx, FileSystem, FileType, RenameFlags, SetAttr, XattrFlags};
use std::sync::{Arc, OnceLock};

const BS: usize = 1024;
const BLOCKS: u64 = 4096;

/// The part of the image a target's input overwrites.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    /// The primary superblock, then the group descriptor block.
    Superblock,
    /// The first 64 inodes of the inode table, then the indirect, double-indirect and
    /// first second-level blocks of a large file.
    Inodes,
    /// Every block of the root directory and of a directory of 300 entries.
    Dirs,
    /// The attribute blocks of five files, then the spare space at the end of their
    /// inodes (attributes and POSIX ACLs in both places).
    Xattrs,
    /// The first 48 blocks of the journal of an ext3 image cut off mid-run (the superblock
    /// asks for recovery), then recovery, a mount in meta-journal mode and the walk.
    Journal,
}

struct Seed {
    image: Vec<u8>,
    /// Byte ranges of the image, in the order the input fills them.
    ranges: Vec<(usize, usize)>,
}

fn seeds() -> &'static [Seed; 5] {
    static S: OnceLock<[Seed; 5]> = OnceLock::new();
    S.get_or_init(|| {
        let (ext2, loc) = build(false);
        let (ext3, jloc) = build(true);
        let seed = |image: &Vec<u8>, ranges: Vec<(usize, usize)>| Seed {
            image: image.clone(),
            ranges,
        };
        [
            seed(&ext2, loc.superblock.clone()),
            seed(&ext2, loc.inodes.clone()),
            seed(&ext2, loc.dirs.clone()),
            seed(&ext2, loc.xattrs.clone()),
            seed(&ext3, jloc.journal.clone()),
        ]
    })
}

fn seed_of(region: Region) -> &'static Seed {
    &seeds()[region as usize]
}

/// Builds the seed images (each process does once; fuzz targets call it before the first
/// input so libFuzzer's per-input timeout does not count it).
pub fn prepare() {
    seeds();
}

/// The region's bytes in the undamaged image.
pub fn seed(region: Region) -> Vec<u8> {
    let s = seed_of(region);
    s.ranges
        .iter()
        .flat_map(|&(a, n)| s.image[a..a + n].iter().copied())
        .collect()
}

/// The seed image with `data` written over the start of the region.
pub fn damaged(region: Region, data: &[u8]) -> Vec<u8> {
    let s = seed_of(region);
    let mut img = s.image.clone();
    let mut rest = data;
    for &(at, n) in &s.ranges {
        if rest.is_empty() {
            break;
        }
        let k = n.min(rest.len());
        img[at..at + k].copy_from_slice(&rest[..k]);
        rest = &rest[k..];
    }
    img
}

/// One fuzz case: damage the region, then mount and use the image twice over.
pub fn run(region: Region, data: &[u8]) {
    let img = damaged(region, data);
    let mode = if region == Region::Journal {
        Mode::MetaJournal
    } else {
        Mode::SoftUpdates
    };
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).expect("seed image size"));
    if let Ok(fs) = open(&dev, mode, false) {
        exercise(&fs, true);
        let _ = fs.unmount();
    }
    // Whatever the first mount left (its repairs, its refusals half-way) is read again.
    if let Ok(fs) = open(&dev, mode, true) {
        exercise(&fs, false);
    }
}

fn open(dev: &Arc<MemDevice>, mode: Mode, read_only: bool) -> quilt_vfs::Result<Ext2> {
    quilt_stack::ext2(
        dev.clone(),
        quilt_stack::Ext2Spec::mount(MountOptions {
            mode: if read_only { Mode::SoftUpdates } else { mode },
            read_only,
            ..Default::default()
        }),
    )
}

/// Reads everything reachable (bounded), then, when `change`, changes some of it.
fn exercise(fs: &Ext2, change: bool) {
    let c = Ctx::root();
    let root = fs.root();
    let _ = fs.statfs();
    let mut stack = vec![root];
    let mut files = Vec::new();
    let mut dirs = 0;
    while let Some(dir) = stack.pop() {
        dirs += 1;
        if dirs > 64 {
            break;
        }
        let mut names = Vec::new();
        let _ = fs.readdir(dir, 0, &mut |e| {
            names.push(e.name);
            names.len() < 512
        });
        for name in names {
            if name == b"." || name == b".." {
                continue;
            }
            let Ok(a) = fs.lookup(dir, &name) else {
                continue;
            };
            let _ = fs.getattr(a.ino);
            if let Ok(list) = fs.listxattr(a.ino) {
                for n in list.split(|&b| b == 0).filter(|n| !n.is_empty()) {
                    let _ = fs.getxattr(a.ino, n);
                }
            }
            match a.kind {
                FileType::Directory => stack.push(a.ino),
                FileType::Regular => {
                    let _ = fs.read(a.ino, 0, 64 << 10);
                    let _ = fs.read(a.ino, a.size.saturating_sub(4096), 8192);
                    let _ = fs.seek_data(a.ino, 0, false);
                    files.push((dir, name, a.ino));
                }
                FileType::Symlink => {
                    let _ = fs.readlink(a.ino);
                }
                _ => {}
            }
        }
    }
    if !change {
        return;
    }
    for (i, (dir, name, ino)) in files.iter().take(8).enumerate() {
        let _ = fs.write(*ino, (i as u64) * 70_000, b"fuzz", &c);
        let _ = fs.setattr(
            *ino,
            SetAttr {
                size: Some(100 + i as u64),
                ..Default::default()
            },
            &c,
        );
        let _ = fs.setxattr(
            *ino,
            b"user.fuzz",
            &[i as u8; 40],
            XattrFlags::default(),
            &c,
        );
        if i % 2 == 0 {
            let _ = fs.unlink(*dir, name, &c);
        } else {
            let _ = fs.rename(*dir, name, root, b"moved", RenameFlags::default(), &c);
        }
    }
    if let Ok(d) = fs.mkdir(root, b"new", 0o755, &c) {
        for i in 0..20 {
            let _ = fs.mknod(
                d.ino,
                format!("n{i}").as_bytes(),
                libc::S_IFREG | 0o644,
                0,
                &c,
            );
        }
        let _ = fs.symlink(d.ino, b"s", b"target", &c);
        let _ = fs.rename(root, b"new", root, b"dir", RenameFlags::default(), &c);
    }
    let _ = fs.rmdir(root, b"dir", &c);
    let _ = fs.sync_all();
}

/// Where each region lies in a seed image.
struct Locations {
    superblock: Vec<(usize, usize)>,
    inodes: Vec<(usize, usize)>,
    dirs: Vec<(usize, usize)>,
    xattrs: Vec<(usize, usize)>,
    journal: Vec<(usize, usize)>,
}

/// Builds a populated 4 MiB image with 1 KiB blocks (an ext3 one cut off with committed
/// transactions in its journal when `journal`), and finds the regions in it.
fn build(journal: bool) -> (Vec<u8>, Locations) {
    let dev = Arc::new(MemDevice::new(BS, BLOCKS).expect("memory device"));
    let opts = MkfsOptions {
        device_is_zeroed: true,
        inodes: Some(512),
        ..Default::default()
    };
    let (engine, _) =
        quilt_stack::mkfs_ext2(dev.clone(), EngineOptions::default(), &opts).expect("mkfs");
    if journal {
        quilt_stack::add_journal(engine, 1024, false).expect("journal");
    } else {
        drop(engine);
    }
    let mode = if journal {
        Mode::MetaJournal
    } else {
        Mode::default()
    };
    let fs = open(&dev, mode, false).expect("mount");
    let c = Ctx::root();
    let root = fs.root();
    let must = |r: quilt_vfs::Result<quilt_vfs::Attr>| r.expect("populate").ino;
    let dir = must(fs.mkdir(root, b"dir", 0o755, &c));
    let mut small = Vec::new();
    for i in 0..300 {
        let name = format!("file-with-a-longer-name-{i:04}");
        let f = must(fs.mknod(dir, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c));
        if i < 20 {
            fs.write(f, i * 1000, &[i as u8; 1500], &c).expect("write");
            small.push(f);
        }
    }
    let big = must(fs.mknod(root, b"big", libc::S_IFREG | 0o600, 0, &c));
    // Past the double-indirect threshold at 1 KiB blocks (12 + 256 blocks).
    fs.write(big, 0, &vec![7u8; 300 << 10], &c).expect("write");
    fs.write(big, 2 << 20, b"tail", &c).expect("write");
    fs.symlink(root, b"fast", b"dir/file", &c).expect("symlink");
    fs.symlink(root, b"slow", &[b'x'; 300], &c)
        .expect("symlink");
    fs.mknod(root, b"fifo", libc::S_IFIFO | 0o644, 0, &c)
        .expect("fifo");
    let attrs: &[(u64, &[u8], &[u8])] = &[
        (big, b"user.a", b"one"),
        (big, b"trusted.t", &[3u8; 200]),
        (small[0], b"user.a", b"one"),
        (small[1], b"user.long-name-for-an-attribute", &[9u8; 500]),
        (small[1], b"security.s", b"label"),
    ];
    for &(ino, n, v) in attrs {
        fs.setxattr(ino, n, v, XattrFlags::default(), &c)
            .expect("setxattr");
    }
    fs.setxattr(small[2], b"user.a", b"one", XattrFlags::default(), &c)
        .expect("setxattr");
    // POSIX ACLs: an access ACL with named entries (in the inode), a default ACL on the
    // directory, and a long one that goes to the block.
    let acl = |named: u32| {
        use quilt_vfs::acl::*;
        let e = |tag, perm, id| Entry { tag, perm, id };
        let mut v = vec![
            e(USER_OBJ, 6, 0),
            e(GROUP_OBJ, 4, 0),
            e(MASK, 6, 0),
            e(OTHER, 0, 0),
        ];
        v.extend((0..named).map(|i| e(USER, 4, 1000 + i)));
        Acl::new(v).expect("valid ACL").to_xattr()
    };
    let set = |ino, name: &[u8], v: Vec<u8>| {
        fs.setxattr(ino, name, &v, XattrFlags::default(), &c)
            .expect("set ACL")
    };
    set(small[3], quilt_vfs::acl::ACCESS, acl(2));
    set(small[4], quilt_vfs::acl::ACCESS, acl(30));
    set(dir, quilt_vfs::acl::DEFAULT, acl(1));
    if journal {
        // Cut off with the log holding committed transactions the home blocks may not
        // have yet: the image asks for recovery.
        fs.sync_all().expect("commit");
        let w = must(fs.mknod(root, b"late", libc::S_IFREG | 0o644, 0, &c));
        fs.write(w, 0, b"after the first commit", &c)
            .expect("write");
        fs.fsync(w, false).expect("commit");
    } else {
        fs.unmount().expect("unmount");
    }
    let image = dev.to_vec();
    drop(fs);
    let loc = locate(
        &image,
        dir,
        big,
        &[big, small[0], small[1], small[2], small[3], small[4]],
    );
    (image, loc)
}

fn locate(image: &[u8], dir: u64, big: u64, xattr_inos: &[u64]) -> Locations {
    let sb = Superblock::decode(&image[1024..2048]).expect("seed superblock");
    let gd = GroupDesc::decode(&image[2 * BS..2 * BS + GDESC_SIZE]);
    let isz = sb.inode_size as usize;
    let inode_at = |ino: u64| gd.inode_table as usize * BS + (ino as usize - 1) * isz;
    let inode = |ino: u64| Inode::decode(&image[inode_at(ino)..inode_at(ino) + isz]);
    let block = |b: u32| (b as usize * BS, BS);
    let le32 = |at: usize| u32::from_le_bytes(image[at..at + 4].try_into().expect("4 bytes"));
    let data_blocks = |ino: u64| -> Vec<(usize, usize)> {
        let i = inode(ino);
        let n = (i.size as usize).div_ceil(BS).min(12);
        i.block[..n].iter().map(|&b| block(b)).collect()
    };
    let b = inode(big);
    let dind_child = le32(b.block[13] as usize * BS);
    let mut xattrs: Vec<(usize, usize)> = Vec::new();
    for &ino in xattr_inos {
        let acl = inode(ino).file_acl;
        if acl != 0 && !xattrs.contains(&block(acl)) {
            xattrs.push(block(acl));
        }
    }
    for &ino in xattr_inos {
        // Past the fixed 128 bytes and the extra fields.
        let at = inode_at(ino) + 160;
        xattrs.push((at, isz.saturating_sub(160)));
    }
    let mut dirs = data_blocks(2);
    dirs.extend(data_blocks(dir));
    let journal = if sb.journal_inum != 0 {
        let j = inode(sb.journal_inum as u64);
        // The journal is contiguous from its first block on a fresh image.
        (0..48).map(|k| block(j.block[0] + k)).collect()
    } else {
        Vec::new()
    };
    Locations {
        superblock: vec![(1024, 1024), (2 * BS, BS)],
        inodes: vec![
            (inode_at(1), 64 * isz),
            block(b.block[12]),
            block(b.block[13]),
            block(dind_child),
        ],
        dirs,
        xattrs,
        journal,
    }
}

/// Every region, in the order of the targets.
pub const REGIONS: [(Region, &str); 5] = [
    (Region::Superblock, "superblock"),
    (Region::Inodes, "inodes"),
    (Region::Dirs, "dirs"),
    (Region::Xattrs, "xattrs"),
    (Region::Journal, "journal"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn seeds_are_sane_and_the_undamaged_image_mounts() {
        for (r, _) in REGIONS {
            let s = seed(r);
            assert!(s.len() >= 1024, "{r:?}: {} bytes", s.len());
            assert_eq!(damaged(r, &s), seed_of(r).image, "{r:?}");
            run(r, &s);
        }
        assert!(
            seed(Region::Dirs).len() > 8 * BS,
            "the big directory spans blocks"
        );
        assert_eq!(seed(Region::Journal).len(), 48 * BS);
        // The seed image is what it claims: the walk finds the populated tree.
        let dev = Arc::new(MemDevice::from_bytes(BS, &seed_of(Region::Dirs).image).unwrap());
        let fs = open(&dev, Mode::SoftUpdates, true).unwrap();
        let dir = fs.lookup(fs.root(), b"dir").unwrap();
        let mut n = 0;
        fs.readdir(dir.ino, 0, &mut |_| {
            n += 1;
            true
        })
        .unwrap();
        assert_eq!(n, 302);
    }

    /// Writes each target's seed into `$QUILT_FUZZ_SEEDS/<target>/seed` (scripts/fuzz.sh
    /// does this before a run); without the variable, nothing.
    #[test]
    fn write_seeds() {
        let Some(dir) = std::env::var_os("QUILT_FUZZ_SEEDS") else {
            return;
        };
        for (r, name) in REGIONS {
            let d = Path::new(&dir).join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("seed"), seed(r)).unwrap();
        }
    }

    /// Every input a fuzzer ever crashed on (`regressions/<target>/*`) runs clean.
    #[test]
    fn regressions() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        let mut ran = 0;
        for (r, name) in REGIONS {
            let Ok(entries) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for e in entries {
                let path = e.unwrap().path();
                eprintln!("{name}: {}", path.display());
                run(r, &std::fs::read(&path).unwrap());
                ran += 1;
            }
        }
        eprintln!("{ran} regression inputs");
    }

    /// The CI smoke: seeded random damage (bit flips, overwritten stretches, interesting
    /// values) over each region, without coverage guidance. The hour-long runs are
    /// scripts/fuzz.sh's.
    #[test]
    fn smoke() {
        let cases = std::env::var("QUILT_FUZZ_SMOKE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if std::env::var_os("CI").is_some() {
                150
            } else {
                600
            });
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (r, _) in REGIONS {
            let base = seed(r);
            for case in 0..cases {
                let mut d = base.clone();
                for _ in 0..1 + case % 6 {
                    let at = next() as usize % d.len();
                    match next() % 4 {
                        0 => d[at] ^= 1 << (next() % 8),
                        1 => {
                            for b in d.iter_mut().skip(at).take(1 + next() as usize % 48) {
                                *b = next() as u8;
                            }
                        }
                        2 => {
                            let v: [u8; 4] = [0, 0xff, 0x7f, 0x80].map(|k| k ^ (next() as u8 & 1));
                            let at = at & !3;
                            let n = 4.min(d.len() - at);
                            d[at..at + n].copy_from_slice(&v[..n]);
                        }
                        _ => {
                            let n = 4.min(d.len() - at);
                            let v = (next() % 5000) as u32;
                            d[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
                        }
                    }
                }
                run(r, &d);
            }
        }
    }
}
