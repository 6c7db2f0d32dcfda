//! Clones on betrfs, natively: a file's blocks into another file (FICLONE, FICLONERANGE's
//! rules), copy_file_range, and a whole tree under a new name. The oracle is a copy
//! made the slow way (the same bytes, names, modes and link structure), checked byte for
//! byte after many interleaved writes to both sides; inode numbers stay unique across
//! the original and its copies; fsck (which checks the tree's reference counts and the
//! index) finds every image clean, after a remount and after a crash.

use quilt_betrfs::{fsck, mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Attr, Ctx, FileSystem, FileType, FsError, RenameFlags};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn counter(fs: &Betrfs, name: &str) -> u64 {
    fs.counters()
        .into_iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| v)
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
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn fresh() -> (Arc<MemDevice>, Betrfs) {
    let dev = Arc::new(MemDevice::new(4096, 16384).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    (dev, fs)
}

fn file(fs: &Betrfs, dir: u64, name: &str, data: &[u8]) -> u64 {
    let c = Ctx::root();
    let ino = fs
        .mknod(dir, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    if !data.is_empty() {
        fs.write(ino, 0, data, &c).unwrap();
    }
    ino
}

fn contents(fs: &Betrfs, ino: u64) -> Vec<u8> {
    let size = fs.getattr(ino).unwrap().size;
    fs.read(ino, 0, size as u32).unwrap()
}

fn clean(dev: &Arc<MemDevice>) {
    let r = fsck::fsck(dev.clone(), false).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

/// Writes `data` at `off` into both the file and its model.
fn write_both(fs: &Betrfs, ino: u64, model: &mut Vec<u8>, off: usize, data: &[u8]) {
    fs.write(ino, off as u64, data, &Ctx::root()).unwrap();
    if model.len() < off + data.len() {
        model.resize(off + data.len(), 0);
    }
    model[off..off + data.len()].copy_from_slice(data);
}

#[test]
fn a_cloned_file_is_independent_of_its_original() {
    let (dev, fs) = fresh();
    let r = fs.root();
    let mut rng = Rng::new(7);
    let mut a = rng.bytes(300_000 + 1234);
    let f = file(&fs, r, "f", &a);
    let g = file(&fs, r, "g", b"old contents of g, replaced");
    let before = fs.tree().stats();
    assert_eq!(
        fs.clone_file(f, 0, g, 0, 0, &Ctx::root()).unwrap(),
        a.len() as u64
    );
    let mut b = a.clone();
    assert_eq!(contents(&fs, g), b);
    assert_eq!(fs.getattr(g).unwrap().blocks, fs.getattr(f).unwrap().blocks);
    let after = fs.tree().stats();
    assert_eq!(after.range_clones, before.range_clones + 1);
    // Interleaved writes to both, at random places, some across the partial tail.
    for i in 0..400 {
        let len = 1 + rng.below(9000) as usize;
        let off = rng.below(a.len() as u64 + 5000) as usize;
        let data = rng.bytes(len);
        if i % 2 == 0 {
            write_both(&fs, f, &mut a, off, &data);
        } else {
            write_both(&fs, g, &mut b, off, &data);
        }
    }
    assert_eq!(contents(&fs, f), a);
    assert_eq!(contents(&fs, g), b);
    fs.sync_all().unwrap();
    assert_eq!(contents(&fs, f), a);
    assert_eq!(contents(&fs, g), b);
    // Dropping the original leaves the copy whole.
    fs.unlink(r, b"f", &Ctx::root()).unwrap();
    assert_eq!(contents(&fs, g), b);
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let g = fs.lookup(fs.root(), b"g").unwrap().ino;
    assert_eq!(contents(&fs, g), b);
}

#[test]
fn clone_ranges_follow_the_kernels_rules() {
    let (dev, fs) = fresh();
    let r = fs.root();
    let c = Ctx::root();
    let mut rng = Rng::new(11);
    let src = rng.bytes(10 * 4096 + 100);
    let s = file(&fs, r, "s", &src);
    let mut dst = rng.bytes(6 * 4096);
    let d = file(&fs, r, "d", &dst);
    // Blocks 2..5 in place: the destination keeps the rest.
    assert_eq!(
        fs.clone_file(s, 8192, d, 8192, 3 * 4096, &c).unwrap(),
        3 * 4096
    );
    dst[8192..8192 + 3 * 4096].copy_from_slice(&src[8192..8192 + 3 * 4096]);
    assert_eq!(contents(&fs, d), dst);
    // Past the destination's end: it grows (a hole in between reads as zeros).
    assert_eq!(
        fs.clone_file(s, 7 * 4096, d, 7 * 4096, 4096, &c).unwrap(),
        4096
    );
    dst.resize(8 * 4096, 0);
    dst[7 * 4096..].copy_from_slice(&src[7 * 4096..8 * 4096]);
    assert_eq!(contents(&fs, d), dst);
    // Unaligned offsets, overlap in one file, a partial last block into the middle.
    let inval = |e: FsError| matches!(e, FsError::Invalid(_));
    assert!(inval(fs.clone_file(s, 100, d, 100, 4096, &c).unwrap_err()));
    assert!(inval(fs.clone_file(s, 0, s, 4096, 8192, &c).unwrap_err()));
    // (The source's last 4196 bytes end inside the 8-block destination.)
    assert!(inval(
        fs.clone_file(s, 9 * 4096, d, 9 * 4096 - 4096 * 5, 0, &c)
            .unwrap_err()
    ));
    // Different offsets cannot share blocks.
    assert_eq!(
        fs.clone_file(s, 0, d, 4096, 4096, &c).unwrap_err(),
        FsError::NotSupported
    );
    // The source's partial tail where it ends the destination too.
    let e = file(&fs, r, "e", &rng.bytes(4096));
    assert_eq!(
        fs.clone_file(s, 8 * 4096, e, 8 * 4096, 0, &c).unwrap(),
        2 * 4096 + 100
    );
    let mut want = contents(&fs, e)[..4096].to_vec();
    want.resize(8 * 4096, 0);
    want.extend_from_slice(&src[8 * 4096..]);
    assert_eq!(contents(&fs, e), want);
    // A length past the source's end stops there.
    let z = file(&fs, r, "z", b"");
    assert_eq!(
        fs.clone_file(s, 0, z, 0, 1 << 30, &c).unwrap(),
        src.len() as u64
    );
    assert_eq!(contents(&fs, z), src);
    // Not regular files.
    let dir = fs.mkdir(r, b"dir", 0o755, &c).unwrap().ino;
    assert_eq!(
        fs.clone_file(dir, 0, z, 0, 0, &c).unwrap_err(),
        FsError::IsDir
    );
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
}

#[test]
fn copy_file_range_shares_the_aligned_middle_and_copies_the_rest() {
    let (dev, fs) = fresh();
    let r = fs.root();
    let c = Ctx::root();
    let mut rng = Rng::new(5);
    let src = rng.bytes(20 * 4096 + 7);
    let s = file(&fs, r, "s", &src);
    // Equal, unaligned offsets: head and tail copied, middle shared.
    let mut dst = rng.bytes(25 * 4096);
    let d = file(&fs, r, "d", &dst);
    let before = counter(&fs, "fs.clones");
    assert_eq!(
        fs.copy_file_range(s, 1000, d, 1000, 50_000, &c).unwrap(),
        50_000
    );
    dst[1000..51_000].copy_from_slice(&src[1000..51_000]);
    assert_eq!(contents(&fs, d), dst);
    assert_eq!(counter(&fs, "fs.clones"), before + 1);
    // Different offsets: copied.
    assert_eq!(
        fs.copy_file_range(s, 10, d, 4096 * 3 + 5, 9000, &c)
            .unwrap(),
        9000
    );
    dst[4096 * 3 + 5..4096 * 3 + 5 + 9000].copy_from_slice(&src[10..9010]);
    assert_eq!(contents(&fs, d), dst);
    // What cp does: everything, into an empty file; the length is clamped at the end.
    let e = file(&fs, r, "e", b"");
    assert_eq!(
        fs.copy_file_range(s, 0, e, 0, u32::MAX as u64, &c).unwrap(),
        src.len() as u64
    );
    assert_eq!(contents(&fs, e), src);
    assert_eq!(
        fs.copy_file_range(s, src.len() as u64, e, 0, 10, &c)
            .unwrap(),
        0
    );
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
}

/// Everything a tree holds, by path: kind, permissions, size, contents or target, and
/// which paths share an inode (by the first path that has it).
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    kind: FileType,
    perm: u16,
    nlink: u32,
    bytes: Vec<u8>,
    same_as: Option<String>,
}

fn walk(
    fs: &Betrfs,
    dir: u64,
    path: &str,
    inos: &mut HashMap<u64, String>,
    out: &mut BTreeMap<String, Seen>,
    all: &mut Vec<u64>,
) {
    let mut entries = Vec::new();
    fs.readdir(dir, 0, &mut |e| {
        entries.push(e);
        true
    })
    .unwrap();
    for e in entries {
        if e.name == b"." || e.name == b".." {
            continue;
        }
        let p = format!("{path}/{}", String::from_utf8_lossy(&e.name));
        let a: Attr = fs.lookup(dir, &e.name).unwrap();
        assert_eq!(a.ino, e.ino, "{p}: readdir and lookup disagree");
        all.push(a.ino);
        let same_as = inos.get(&a.ino).cloned();
        if same_as.is_none() {
            inos.insert(a.ino, p.clone());
        }
        let bytes = match a.kind {
            FileType::Regular => fs.read(a.ino, 0, a.size as u32).unwrap(),
            FileType::Symlink => fs.readlink(a.ino).unwrap(),
            _ => Vec::new(),
        };
        out.insert(
            p.clone(),
            Seen {
                kind: a.kind,
                perm: a.perm,
                nlink: a.nlink,
                bytes,
                same_as,
            },
        );
        if a.kind == FileType::Directory {
            walk(fs, a.ino, &p, inos, out, all);
        }
    }
}

/// The tree below directory `ino`, with paths relative to it, and every inode number met.
fn tree(fs: &Betrfs, ino: u64) -> (BTreeMap<String, Seen>, Vec<u64>) {
    let mut out = BTreeMap::new();
    let mut all = Vec::new();
    walk(fs, ino, "", &mut HashMap::new(), &mut out, &mut all);
    (out, all)
}

#[test]
fn a_cloned_tree_is_a_whole_independent_copy() {
    let (dev, fs) = fresh();
    let c = Ctx::root();
    let r = fs.root();
    let mut rng = Rng::new(3);
    let top = fs.mkdir(r, b"top", 0o755, &c).unwrap().ino;
    let mut dirs = vec![top];
    for i in 0..40 {
        let parent = dirs[rng.below(dirs.len() as u64) as usize];
        if i % 4 == 0 {
            dirs.push(
                fs.mkdir(parent, format!("d{i}").as_bytes(), 0o750, &c)
                    .unwrap()
                    .ino,
            );
        } else {
            let n = rng.below(30_000) as usize;
            file(&fs, parent, &format!("f{i}"), &rng.bytes(n));
        }
    }
    fs.symlink(top, b"link", b"d0/f1", &c).unwrap();
    // Hard links: both names inside, and one name outside the tree.
    let h = file(&fs, top, "h1", &rng.bytes(20_000));
    fs.link(h, dirs[1], b"h2", &c).unwrap();
    let out = file(&fs, r, "outside", &rng.bytes(5000));
    fs.link(out, top, b"o1", &c).unwrap();
    // A nested clone (a marker inside), and a directory moved in from it (another).
    let inner = fs.clone_tree(dirs[1], top, b"inner", &c).unwrap();
    // A link stub moved out of the nested clone.
    fs.rename(
        inner.ino,
        b"h2",
        top,
        b"moved-in",
        RenameFlags::default(),
        &c,
    )
    .unwrap();
    let sub = fs.mkdir(inner.ino, b"sub", 0o755, &c).unwrap().ino;
    file(&fs, sub, "x", b"x");
    fs.rename(
        inner.ino,
        b"sub",
        top,
        b"sub-moved",
        RenameFlags::default(),
        &c,
    )
    .unwrap();
    // An open file, unlinked: its data stays under its path until released.
    let orphan = file(&fs, top, "open-unlinked", &rng.bytes(10_000));
    fs.open(orphan).unwrap();
    fs.unlink(top, b"open-unlinked", &c).unwrap();

    let (mut want, inos_a) = tree(&fs, top);
    let copy = fs.clone_tree(top, r, b"copy", &c).unwrap();
    // The outside file's name in the tree becomes a file of its own in the copy.
    want.get_mut("/o1").unwrap().nlink = 1;
    assert_ne!(copy.ino, top);
    let (got, inos_b) = tree(&fs, copy.ino);
    assert_eq!(got, want, "the copy differs from the original");
    // Every inode of the copy is new (the outside file's second name included).
    let mut all: Vec<u64> = inos_a.iter().chain(&inos_b).copied().collect();
    let distinct_a: std::collections::HashSet<u64> = inos_a.iter().copied().collect();
    let distinct_b: std::collections::HashSet<u64> = inos_b.iter().copied().collect();
    assert!(distinct_a.is_disjoint(&distinct_b), "shared inode numbers");
    all.sort_unstable();
    // The outside file lost nothing: still two names (the copy's o1 is its own).
    assert_eq!(fs.getattr(out).unwrap().nlink, 2);
    let o1 = fs.lookup(copy.ino, b"o1").unwrap();
    assert_eq!(o1.nlink, 1);

    // Interleaved writes, creations and removals on both sides.
    let copy_h1 = fs.lookup(copy.ino, b"h1").unwrap().ino;
    fs.write(copy_h1, 0, b"changed in the copy", &c).unwrap();
    fs.write(h, 5, b"changed in the original", &c).unwrap();
    fs.unlink(top, b"link", &c).unwrap();
    file(&fs, copy.ino, "new-in-copy", b"new");
    let (orig_after, _) = tree(&fs, top);
    let (copy_after, _) = tree(&fs, copy.ino);
    assert!(!orig_after.contains_key("/link") && copy_after.contains_key("/link"));
    assert!(copy_after.contains_key("/new-in-copy") && !orig_after.contains_key("/new-in-copy"));
    assert_eq!(&copy_after["/h1"].bytes[..19], b"changed in the copy");
    assert_eq!(&orig_after["/h1"].bytes[5..28], b"changed in the original");
    assert_eq!(
        copy_after["/d0/h2"].bytes, copy_after["/h1"].bytes,
        "hard links in the copy"
    );
    fs.release(orphan).unwrap();

    // A clone of the copy, then the original goes.
    let copy2 = fs.clone_tree(copy.ino, r, b"copy2", &c).unwrap();
    let (c2, inos_c) = tree(&fs, copy2.ino);
    let (c1, _) = tree(&fs, copy.ino);
    assert_eq!(c2, c1);
    assert!(inos_c
        .iter()
        .all(|i| !distinct_b.contains(i) && !distinct_a.contains(i)));
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let top = fs.lookup(fs.root(), b"top").unwrap().ino;
    let copy = fs.lookup(fs.root(), b"copy").unwrap().ino;
    assert_eq!(tree(&fs, copy).0, c1);
    remove_tree(&fs, fs.root(), b"top", top);
    assert_eq!(tree(&fs, copy).0, c1);
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
}

fn remove_tree(fs: &Betrfs, parent: u64, name: &[u8], ino: u64) {
    let c = Ctx::root();
    let mut entries = Vec::new();
    fs.readdir(ino, 0, &mut |e| {
        entries.push(e);
        true
    })
    .unwrap();
    for e in entries {
        if e.name == b"." || e.name == b".." {
            continue;
        }
        if e.kind == FileType::Directory {
            remove_tree(fs, ino, &e.name, e.ino);
        } else {
            fs.unlink(ino, &e.name, &c).unwrap();
        }
    }
    fs.rmdir(parent, name, &c).unwrap();
}

#[test]
fn tree_clones_refuse_what_they_cannot_do() {
    let (dev, fs) = fresh();
    let c = Ctx::root();
    let r = fs.root();
    let a = fs.mkdir(r, b"a", 0o755, &c).unwrap().ino;
    let b = fs.mkdir(a, b"b", 0o755, &c).unwrap().ino;
    assert!(matches!(
        fs.clone_tree(a, b, b"loop", &c).unwrap_err(),
        FsError::Invalid(_)
    ));
    assert_eq!(fs.clone_tree(a, r, b"a", &c).unwrap_err(), FsError::Exists);
    assert!(fs.clone_tree(r, a, b"root-copy", &c).is_err());
    let user = Ctx {
        uid: 1000,
        gid: 1000,
        ..Ctx::root()
    };
    let mine = fs.mkdir(r, b"mine", 0o777, &c).unwrap().ino;
    assert_eq!(
        fs.clone_tree(a, mine, b"x", &user).unwrap_err(),
        FsError::Perm
    );
    // A single file clones to a new file.
    let f = file(&fs, a, "f", b"one file");
    let g = fs.clone_tree(f, r, b"g", &c).unwrap();
    assert_ne!(g.ino, f);
    assert_eq!(contents(&fs, g.ino), b"one file");
    fs.write(g.ino, 0, b"ONE", &c).unwrap();
    assert_eq!(contents(&fs, f), b"one file");
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
}

/// A tree clone shares the tree's nodes: its cost does not follow the tree's size.
#[test]
fn cloning_a_large_tree_writes_a_few_nodes() {
    let (dev, fs) = fresh();
    let c = Ctx::root();
    let r = fs.root();
    let top = fs.mkdir(r, b"src", 0o755, &c).unwrap().ino;
    let mut rng = Rng::new(9);
    for d in 0..20 {
        let dir = fs
            .mkdir(top, format!("dir{d}").as_bytes(), 0o755, &c)
            .unwrap()
            .ino;
        for i in 0..100 {
            let n = rng.below(6000) as usize;
            file(&fs, dir, &format!("file{i}"), &rng.bytes(n));
        }
    }
    fs.sync_all().unwrap();
    let before = fs.tree().stats();
    let copy = fs.clone_tree(top, r, b"dst", &c).unwrap();
    fs.sync_all().unwrap();
    let after = fs.tree().stats();
    let written = after.node_writes - before.node_writes;
    eprintln!(
        "clone of 2,000 files: {written} nodes written, {} subtrees shared",
        after.subtrees_shared - before.subtrees_shared
    );
    assert!(written < 80, "a clone of 2,000 files wrote {written} nodes");
    assert_eq!(tree(&fs, copy.ino).0, tree(&fs, top).0);
    fs.unmount().unwrap();
    drop(fs);
    clean(&dev);
}
