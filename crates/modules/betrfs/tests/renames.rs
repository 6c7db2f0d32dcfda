//! Renames large enough to move by range rename of the tree (a directory's subtree, a
//! file's data moving to its number for a second name): every file arrives whole under
//! its new path, nothing stays under the old, the moves survive a crash right after the
//! sync, and fsck finds the image clean. Small renames (copies) are the conformance
//! suite's.

use quilt_betrfs::{fsck, mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, RenameFlags};
use std::collections::BTreeMap;
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

/// Path → contents (directories as empty strings with a trailing '/').
fn walk(fs: &Betrfs, dir: u64, path: &str, out: &mut BTreeMap<String, Vec<u8>>) {
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
        if e.kind == FileType::Directory {
            out.insert(format!("{p}/"), Vec::new());
            walk(fs, e.ino, &p, out);
        } else {
            let size = fs.getattr(e.ino).unwrap().size;
            out.insert(p, fs.read(e.ino, 0, size as u32).unwrap());
        }
    }
}

fn tree_of(fs: &Betrfs) -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    walk(fs, fs.root(), "", &mut m);
    m
}

/// Moves the entries under `from` (a path prefix) to `to`.
fn renamed(m: &BTreeMap<String, Vec<u8>>, from: &str, to: &str) -> BTreeMap<String, Vec<u8>> {
    m.iter()
        .map(|(k, v)| match k.strip_prefix(from) {
            Some(rest) => (format!("{to}{rest}"), v.clone()),
            None => (k.clone(), v.clone()),
        })
        .collect()
}

/// A directory of `dirs` subdirectories with `files` files each, of a few KiB.
fn fill(fs: &Betrfs, parent: u64, name: &[u8], dirs: usize, files: usize, seed: u8) -> u64 {
    let c = Ctx::root();
    let d = fs.mkdir(parent, name, 0o755, &c).unwrap().ino;
    for i in 0..dirs {
        let s = fs
            .mkdir(d, format!("s{i}").as_bytes(), 0o755, &c)
            .unwrap()
            .ino;
        for j in 0..files {
            let f = fs
                .mknod(s, format!("f{j}").as_bytes(), libc::S_IFREG | 0o644, 0, &c)
                .unwrap()
                .ino;
            let len = 100 + (i * 31 + j * 977) % 6000;
            fs.write(
                f,
                0,
                &vec![seed.wrapping_add((i * files + j) as u8); len],
                &c,
            )
            .unwrap();
        }
    }
    d
}

#[test]
fn large_directories_move_whole_and_survive_a_crash() {
    let dev = Arc::new(MemDevice::new(4096, 16384).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let c = Ctx::root();
    let r = fs.root();
    let src = fill(&fs, r, b"src", 4, 30, 1);
    let dst = fs.mkdir(r, b"dst", 0o755, &c).unwrap().ino;
    fs.mkdir(dst, b"empty", 0o755, &c).unwrap();
    // A file open and unlinked inside: its data stays under its old path and must
    // travel with the tree.
    let s0 = fs.lookup(src, b"s0").unwrap().ino;
    let gone = fs
        .mknod(s0, b"open", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    fs.write(gone, 0, &vec![9u8; 70_000], &c).unwrap();
    fs.open(gone).unwrap();
    fs.unlink(s0, b"open", &c).unwrap();
    let mut want = tree_of(&fs);

    // Over an empty directory, into another parent.
    let before = counter(&fs, "fs.range_renames");
    fs.rename(r, b"src", dst, b"empty", RenameFlags::default(), &c)
        .unwrap();
    assert!(
        counter(&fs, "fs.range_renames") > before,
        "{:?}",
        fs.counters()
    );
    // (The moved directory's own entry lands on the one it replaced.)
    want = renamed(&want, "/src/", "/dst/empty/");
    assert_eq!(tree_of(&fs), want);
    assert_eq!(fs.lookup(r, b"src").unwrap_err(), FsError::NotFound);
    assert_eq!(fs.read(gone, 69_990, 100).unwrap(), vec![9u8; 10]);

    // Exchange with another large tree.
    fill(&fs, r, b"other", 3, 25, 100);
    let mut want = tree_of(&fs);
    fs.rename(
        r,
        b"other",
        dst,
        b"empty",
        RenameFlags {
            exchange: true,
            ..Default::default()
        },
        &c,
    )
    .unwrap();
    want = want
        .into_iter()
        .map(|(k, v)| {
            if let Some(rest) = k.strip_prefix("/other/") {
                (format!("/dst/empty/{rest}"), v)
            } else if let Some(rest) = k.strip_prefix("/dst/empty/") {
                (format!("/other/{rest}"), v)
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(tree_of(&fs), want);

    // A second name for a large file: its data moves to its number.
    let big_dir = fs.lookup(r, b"other").unwrap().ino;
    let s1 = fs.lookup(big_dir, b"s1").unwrap().ino;
    let big = fs
        .mknod(s1, b"big", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs.write(big, 0, &data, &c).unwrap();
    fs.link(big, r, b"big-link", &c).unwrap();
    assert_eq!(fs.read(big, 0, 1_000_000).unwrap(), data);
    let want = tree_of(&fs);

    // Renames back and forth, then the crash right after a sync.
    fs.rename(r, b"other", r, b"o2", RenameFlags::default(), &c)
        .unwrap();
    fs.rename(r, b"o2", r, b"other", RenameFlags::default(), &c)
        .unwrap();
    fs.sync_all().unwrap();
    drop(fs);
    let fs = Betrfs::open(
        Arc::new(MemDevice::from_bytes(4096, &dev.to_vec()).unwrap()),
        opts(),
    )
    .unwrap();
    // The open unlinked file is gone after the crash; everything else is as synced.
    assert_eq!(tree_of(&fs), want);
    fs.unmount().unwrap();
    drop(fs);
    let r = fsck::fsck(dev.clone(), false).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

/// Nodes cached below a renamed directory catch up lazily (`State::fresh`): writes and
/// reads through their inode numbers land under the new path, a new tree at the old
/// name is a different one, and past the pending-move limit every path catches up at
/// once.
#[test]
fn cached_nodes_below_a_renamed_directory_follow_it() {
    let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
    mkfs(dev.clone()).unwrap();
    let fs = Betrfs::open(dev.clone(), opts()).unwrap();
    let c = Ctx::root();
    let r = fs.root();
    let a = fs.mkdir(r, b"a", 0o755, &c).unwrap().ino;
    let s = fs.mkdir(a, b"s", 0o755, &c).unwrap().ino;
    let f = fs.mknod(s, b"f", libc::S_IFREG | 0o644, 0, &c).unwrap().ino;
    fs.write(f, 0, b"old tree", &c).unwrap();
    fs.rename(r, b"a", r, b"b", RenameFlags::default(), &c)
        .unwrap();
    // Through the cached inode: the data goes under b/s/f.
    fs.write(f, 0, b"OLD", &c).unwrap();
    assert_eq!(fs.read(f, 0, 100).unwrap(), b"OLD tree");
    // A new tree under the old name.
    let a2 = fs.mkdir(r, b"a", 0o755, &c).unwrap().ino;
    let s2 = fs.mkdir(a2, b"s", 0o755, &c).unwrap().ino;
    let f2 = fs
        .mknod(s2, b"f", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    assert_ne!(f2, f);
    fs.write(f2, 0, b"new tree", &c).unwrap();
    let b = fs.lookup(r, b"b").unwrap().ino;
    let bs = fs.lookup(b, b"s").unwrap().ino;
    assert_eq!((bs, fs.lookup(bs, b"f").unwrap().ino), (s, f));
    assert_eq!(fs.lookup(s2, b"f").unwrap().ino, f2);
    assert_eq!(fs.read(f2, 0, 100).unwrap(), b"new tree");
    assert_eq!(fs.read(f, 0, 100).unwrap(), b"OLD tree");
    // Many renames back and forth (past the pending-move limit), with a write between.
    for i in 0..150u32 {
        let (x, y) = if i % 2 == 0 {
            (&b"b"[..], &b"c"[..])
        } else {
            (&b"c"[..], &b"b"[..])
        };
        fs.rename(r, x, r, y, RenameFlags::default(), &c).unwrap();
        fs.write(f, 8, format!("{i:04}").as_bytes(), &c).unwrap();
    }
    assert_eq!(fs.read(f, 0, 100).unwrap(), b"OLD tree0149");
    let b = fs.lookup(r, b"b").unwrap().ino;
    fs.unlink(fs.lookup(b, b"s").unwrap().ino, b"f", &c)
        .unwrap();
    assert_eq!(fs.lookup(s, b"f").unwrap_err(), FsError::NotFound);
    assert_eq!(fs.read(f2, 0, 100).unwrap(), b"new tree");
    fs.unmount().unwrap();
    drop(fs);
    let r = fsck::fsck(dev.clone(), false).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}
