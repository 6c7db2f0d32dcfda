//! Paths of any length (zones, `keys.rs`): directories nested until the full path is
//! 4,095, 4,096, 8,000 and 30,000 bytes long (each step an operation on its parent, as
//! a program working relatively does), files, links and symlinks made at the bottom,
//! and renames of directories that make what lies below them cross every limit the
//! tree's keys have, on images whose key limits differ (512 and 1,024 bytes). After
//! each, what a walk shows is compared with a model, before and after a remount, and
//! fsck finds nothing.

use quilt_betrfs::{fsck, mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Ctx, FileSystem, FileType, Ino};
use std::collections::BTreeMap;
use std::sync::Arc;

const REG: u32 = libc::S_IFREG | 0o644;

fn opts() -> MountOptions {
    MountOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// Every path below the root with what it is: directories, file contents, link
/// targets, link counts.
fn walk(fs: &Betrfs) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<(Ino, String)> = vec![(fs.root(), String::new())];
    while let Some((dir, path)) = stack.pop() {
        let mut names = Vec::new();
        fs.readdir(dir, 0, &mut |e| {
            names.push((e.name, e.ino));
            true
        })
        .unwrap_or_else(|e| panic!("readdir of {path}: {e:?}"));
        for (n, ino) in names {
            if n == b"." {
                continue;
            }
            if n == b".." {
                continue;
            }
            let p = format!("{path}/{}", String::from_utf8_lossy(&n));
            let a = fs
                .lookup(dir, &n)
                .unwrap_or_else(|e| panic!("lookup of {} bytes: {e:?}", p.len()));
            assert_eq!(
                a.ino,
                ino,
                "readdir and lookup disagree at {} bytes",
                p.len()
            );
            let what = match a.kind {
                FileType::Directory => {
                    stack.push((a.ino, p.clone()));
                    format!("dir {}", a.nlink)
                }
                FileType::Regular => {
                    let d = fs.read(a.ino, 0, (a.size + 1) as u32).unwrap();
                    format!("file {} {:?}", a.nlink, String::from_utf8_lossy(&d))
                }
                FileType::Symlink => format!("symlink {:?}", fs.readlink(a.ino).unwrap()),
                k => format!("{k:?}"),
            };
            out.insert(p, what);
        }
    }
    out
}

struct Deep {
    dev: Arc<MemDevice>,
    fs: Betrfs,
    /// What the tree should hold: path → description (as `walk` gives it).
    model: BTreeMap<String, String>,
}

impl Deep {
    fn new(blocks: u64) -> Deep {
        let dev = Arc::new(MemDevice::new(4096, blocks).unwrap());
        mkfs(dev.clone()).unwrap();
        let fs = Betrfs::open(dev.clone(), opts()).unwrap();
        let model = walk(&fs);
        Deep { dev, fs, model }
    }

    /// Nests directories named `name` below `parent` until the path passes `bytes`;
    /// returns the bottom directory and its path.
    fn nest(&mut self, parent: Ino, path: &str, name: &str, bytes: usize) -> (Ino, String) {
        let c = Ctx::root();
        let (mut dir, mut p) = (parent, path.to_string());
        while p.len() < bytes {
            dir = self
                .fs
                .mkdir(dir, name.as_bytes(), 0o755, &c)
                .unwrap_or_else(|e| panic!("mkdir at {} bytes: {e:?}", p.len()))
                .ino;
            p = format!("{p}/{name}");
            self.model.insert(p.clone(), "dir 2".into());
        }
        (dir, p)
    }

    fn file(&mut self, dir: Ino, path: &str, name: &str, body: &str) -> Ino {
        let c = Ctx::root();
        let f = self.fs.mknod(dir, name.as_bytes(), REG, 0, &c).unwrap().ino;
        self.fs.write(f, 0, body.as_bytes(), &c).unwrap();
        self.model
            .insert(format!("{path}/{name}"), format!("file 1 {body:?}"));
        f
    }

    /// The walk equals the model, now and after a remount; fsck finds nothing.
    fn check(&mut self, when: &str) {
        // (Directory link counts: 2 and one per subdirectory, counted from the model.)
        let mut model = self.model.clone();
        let dirs: Vec<String> = model
            .iter()
            .filter(|(_, v)| v.starts_with("dir"))
            .map(|(k, _)| k.clone())
            .collect();
        for d in dirs {
            let subdirs = self
                .model
                .iter()
                .filter(|(k, v)| {
                    v.starts_with("dir")
                        && k.len() > d.len() + 1
                        && k.starts_with(&format!("{d}/"))
                        && !k[d.len() + 1..].contains('/')
                })
                .count();
            model.insert(d, format!("dir {}", 2 + subdirs));
        }
        let got = walk(&self.fs);
        diff(&model, &got, when);
        self.fs.unmount().unwrap();
        let r = fsck::fsck(self.dev.clone(), false).unwrap();
        assert!(r.problems.is_empty(), "{when}: fsck: {:?}", r.problems);
        self.fs = Betrfs::open(self.dev.clone(), opts()).unwrap();
        diff(&model, &walk(&self.fs), &format!("{when}, after a remount"));
    }
}

fn diff(want: &BTreeMap<String, String>, got: &BTreeMap<String, String>, when: &str) {
    if want == got {
        return;
    }
    let missing: Vec<_> = want
        .keys()
        .filter(|k| !got.contains_key(*k))
        .map(|k| k.len())
        .take(3)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .map(|k| k.len())
        .take(3)
        .collect();
    let changed: Vec<_> = want
        .iter()
        .filter_map(|(k, v)| got.get(k).filter(|g| *g != v).map(|g| (k.len(), v, g)))
        .take(3)
        .collect();
    panic!(
        "{when}: {} paths expected, {} found; missing (lengths) {missing:?}, extra {extra:?}, changed {changed:?}",
        want.len(),
        got.len()
    );
}

/// Moves the model's entries below `from` (and `from` itself) to `to`.
fn model_rename(model: &mut BTreeMap<String, String>, from: &str, to: &str) {
    let moved: Vec<(String, String)> = model
        .iter()
        .filter(|(k, _)| *k == from || k.starts_with(&format!("{from}/")))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, _) in &moved {
        model.remove(k);
    }
    for (k, v) in moved {
        model.insert(format!("{to}{}", &k[from.len()..]), v);
    }
}

fn deep_trees_on(blocks: u64) {
    let c = Ctx::root();
    let mut t = Deep::new(blocks);
    let root = t.fs.root();
    for (i, len) in [4095usize, 4096, 8000, 30_000].into_iter().enumerate() {
        let top = format!("t{i}");
        let (bottom, path) = t.nest(root, "", &top, 1);
        // Names of every length, so paths cross each limit byte by byte.
        let (bottom, path) = t.nest(bottom, &path, &"n".repeat(100 + i * 37), len - 300);
        let (bottom, path) = t.nest(bottom, &path, "x", len);
        let f = t.file(bottom, &path, "file", &format!("at {len}"));
        t.fs.link(f, bottom, b"hard", &c).unwrap();
        t.model
            .insert(format!("{path}/file"), format!("file 2 \"at {len}\""));
        t.model
            .insert(format!("{path}/hard"), format!("file 2 \"at {len}\""));
        let target = "../".repeat(3) + &"y".repeat(200);
        t.fs.symlink(bottom, b"sym", target.as_bytes(), &c).unwrap();
        t.model.insert(
            format!("{path}/sym"),
            format!("symlink {:?}", target.as_bytes()),
        );
        let long = "L".repeat(255);
        t.file(bottom, &path, &long, "a 255-byte name");
    }
    t.check("four deep trees");
    assert!(
        t.model.keys().any(|k| k.len() >= 30_000),
        "the deepest path is short"
    );
    let zones = t.fs.tree().range(b"z", Some(b"{")).count();
    assert!(zones > 4, "only {zones} zones for paths of 30,000 bytes");
    // Renames that make what is below cross every limit: a top directory renamed to a
    // 255-byte name (every path below grows by 253 bytes), a deep subtree moved under
    // another deep one and back, a directory exchanged with a deeper one.
    let long = "R".repeat(255);
    t.fs.rename(root, b"t0", root, long.as_bytes(), Default::default(), &c)
        .unwrap();
    model_rename(&mut t.model, "/t0", &format!("/{long}"));
    t.check("a top directory renamed to 255 bytes");
    // /t1's chain: move t1/nnn… (the first level below t1) under the bottom of t2.
    let t2 = t.fs.lookup(root, b"t2").unwrap().ino;
    let mut bottom2 = t2;
    let mut path2 = "/t2".to_string();
    loop {
        let mut next = None;
        t.fs.readdir(bottom2, 0, &mut |e| {
            if e.name != b"." && e.name != b".." && next.is_none() {
                let a = e.name.clone();
                next = Some(a);
            }
            true
        })
        .unwrap();
        let Some(n) = next else { break };
        let a = t.fs.lookup(bottom2, &n).unwrap();
        if a.kind != FileType::Directory {
            break;
        }
        bottom2 = a.ino;
        path2 = format!("{path2}/{}", String::from_utf8_lossy(&n));
    }
    let t1 = t.fs.lookup(root, b"t1").unwrap().ino;
    let first = "n".repeat(137);
    t.fs.rename(
        t1,
        first.as_bytes(),
        bottom2,
        b"moved",
        Default::default(),
        &c,
    )
    .unwrap();
    model_rename(
        &mut t.model,
        &format!("/t1/{first}"),
        &format!("{path2}/moved"),
    );
    t.check("a deep subtree moved under another deep one");
    t.fs.rename(bottom2, b"moved", t1, b"back", Default::default(), &c)
        .unwrap();
    model_rename(&mut t.model, &format!("{path2}/moved"), "/t1/back");
    t.check("and moved back under a shallow one");
    let exchange = quilt_vfs::RenameFlags {
        exchange: true,
        ..Default::default()
    };
    t.fs.rename(root, b"t1", root, b"t3", exchange, &c).unwrap();
    model_rename(&mut t.model, "/t1", "/swap");
    model_rename(&mut t.model, "/t3", "/t1");
    model_rename(&mut t.model, "/swap", "/t3");
    t.check("two deep trees exchanged");
    // A clone of the deepest tree.
    let t3 = t.fs.lookup(root, b"t3").unwrap().ino;
    t.fs.clone_tree(t3, root, b"copy", &c).unwrap();
    let copies: Vec<(String, String)> = t
        .model
        .iter()
        .filter(|(k, _)| k.starts_with("/t3/") || *k == "/t3")
        .map(|(k, v)| (format!("/copy{}", &k[3..]), v.clone()))
        .collect();
    t.model.extend(copies);
    t.check("a deep tree cloned");
    // Everything removed again, bottom up: the zones go with their roots.
    let paths: Vec<String> = t.model.keys().rev().cloned().collect();
    for p in paths {
        let (dir, name) = p.rsplit_once('/').unwrap();
        let mut d = root;
        for part in dir.split('/').filter(|s| !s.is_empty()) {
            d = t.fs.lookup(d, part.as_bytes()).unwrap().ino;
        }
        if t.model[&p].starts_with("dir") {
            t.fs.rmdir(d, name.as_bytes(), &c).unwrap();
        } else {
            t.fs.unlink(d, name.as_bytes(), &c).unwrap();
        }
        t.model.remove(&p);
    }
    t.check("everything removed");
    let zones = t.fs.tree().range(b"z", Some(b"{")).count();
    assert_eq!(zones, 0, "zone records left after their roots went");
}

#[test]
fn paths_of_any_length_on_a_small_image() {
    // 4 MiB: 16 KiB nodes, keys of at most 512 bytes.
    deep_trees_on(1024);
}

#[test]
fn paths_of_any_length_on_a_larger_image() {
    // 64 MiB: 64 KiB nodes, keys of at most 1,024 bytes.
    deep_trees_on(16384);
}
