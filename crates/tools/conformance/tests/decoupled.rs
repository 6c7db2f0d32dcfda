//! A decoupled subtree served as a file system (`DecoupledFs`, what a FUSE mount of a
//! weak or invisible subtree serves), checked against an independent oracle: the
//! same module, on its own device, given the same calls directly. Every call's result
//! (its errno, when it fails) must match the module's; the tree the view shows must
//! match the module's tree; and after the journal is merged (a sync halfway, the
//! release at the end) the service's namespace must match it too: names, types,
//! permissions, owners, link counts, sizes, file data, symlink targets and extended
//! attributes.

use quilt_cudele::client::{DecoupleOptions, RemoteFs};
use quilt_cudele::DecoupledFs;
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, Ino, RenameFlags, SetAttr, XattrFlags};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[path = "support/mds_service.rs"]
mod mds_service;
#[path = "support/modules.rs"]
mod modules;

use mds_service::Service;
use modules::{mkfs, Kind};

/// xorshift64*: the same sequence on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
}

const DIRS: [&str; 6] = ["", "old", "a", "a/b", "c", "a/b/d"];
const NAMES: [&str; 6] = ["x", "y", "a", "b", "d", "f"];

fn user() -> Ctx {
    Ctx {
        uid: 1000,
        gid: 1000,
        pid: 9,
        umask: 0o022,
    }
}

fn resolve(fs: &dyn FileSystem, root: Ino, path: &str) -> Result<Ino, FsError> {
    let mut ino = root;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        ino = fs.lookup(ino, part.as_bytes())?.ino;
    }
    Ok(ino)
}

fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((d, n)) => (d, n),
        None => ("", path),
    }
}

/// One call, made on a file system rooted at `root`; its result as a comparable value.
#[derive(Debug, Clone)]
enum Call {
    Create(String, u32),
    Mkdir(String, u32),
    Symlink(String, String),
    Write(String, u64, u32, u8),
    Truncate(String, u64),
    Chmod(String, u32),
    Unlink(String),
    Rmdir(String),
    Rename(String, String, u8),
    Link(String, String),
    SetXattr(String, u8, u8, bool),
    RemoveXattr(String, u8),
}

fn run(fs: &dyn FileSystem, root: Ino, call: &Call, ctx: &Ctx) -> Result<String, i32> {
    let r: Result<String, FsError> = (|| {
        Ok(match call {
            Call::Create(p, mode) => {
                let (d, n) = split(p);
                let d = resolve(fs, root, d)?;
                let a = fs.mknod(d, n.as_bytes(), libc::S_IFREG | mode, 0, ctx)?;
                format!("{:o}", a.perm)
            }
            Call::Mkdir(p, mode) => {
                let (d, n) = split(p);
                let d = resolve(fs, root, d)?;
                format!("{:o}", fs.mkdir(d, n.as_bytes(), *mode, ctx)?.perm)
            }
            Call::Symlink(p, t) => {
                let (d, n) = split(p);
                let d = resolve(fs, root, d)?;
                fs.symlink(d, n.as_bytes(), t.as_bytes(), ctx)?
                    .size
                    .to_string()
            }
            Call::Write(p, off, len, byte) => {
                let i = resolve(fs, root, p)?;
                if fs.getattr(i)?.kind != FileType::Regular {
                    return Err(FsError::IsDir);
                }
                let data = vec![*byte; *len as usize];
                fs.write(i, *off, &data, ctx)?.to_string()
            }
            Call::Truncate(p, size) => {
                let i = resolve(fs, root, p)?;
                let set = SetAttr {
                    size: Some(*size),
                    ..SetAttr::default()
                };
                fs.setattr(i, set, ctx)?.size.to_string()
            }
            Call::Chmod(p, mode) => {
                let i = resolve(fs, root, p)?;
                let set = SetAttr {
                    mode: Some(*mode),
                    ..SetAttr::default()
                };
                format!("{:o}", fs.setattr(i, set, ctx)?.perm)
            }
            Call::Unlink(p) => {
                let (d, n) = split(p);
                let d = resolve(fs, root, d)?;
                fs.unlink(d, n.as_bytes(), ctx)?;
                String::new()
            }
            Call::Rmdir(p) => {
                let (d, n) = split(p);
                let d = resolve(fs, root, d)?;
                fs.rmdir(d, n.as_bytes(), ctx)?;
                String::new()
            }
            Call::Rename(from, to, how) => {
                let (d, n) = split(from);
                let (d2, n2) = split(to);
                let d = resolve(fs, root, d)?;
                let d2 = resolve(fs, root, d2)?;
                let flags = RenameFlags {
                    noreplace: *how == 1,
                    exchange: *how == 2,
                    ..RenameFlags::default()
                };
                fs.rename(d, n.as_bytes(), d2, n2.as_bytes(), flags, ctx)?;
                String::new()
            }
            Call::Link(from, to) => {
                let i = resolve(fs, root, from)?;
                let (d2, n2) = split(to);
                let d2 = resolve(fs, root, d2)?;
                fs.link(i, d2, n2.as_bytes(), ctx)?.nlink.to_string()
            }
            Call::SetXattr(p, k, v, create) => {
                let i = resolve(fs, root, p)?;
                let flags = XattrFlags {
                    create: *create,
                    ..XattrFlags::default()
                };
                let name = format!("user.k{k}");
                fs.setxattr(i, name.as_bytes(), &[*v; 5], flags, ctx)?;
                String::new()
            }
            Call::RemoveXattr(p, k) => {
                let i = resolve(fs, root, p)?;
                fs.removexattr(i, format!("user.k{k}").as_bytes(), ctx)?;
                String::new()
            }
        })
    })();
    r.map_err(|e| e.errno())
}

fn random_call(rng: &mut Rng) -> Call {
    let path = |rng: &mut Rng| {
        let d = *rng.pick(&DIRS);
        let n = *rng.pick(&NAMES);
        if d.is_empty() {
            n.to_string()
        } else {
            format!("{d}/{n}")
        }
    };
    let any = |rng: &mut Rng| {
        if rng.below(3) == 0 {
            rng.pick(&DIRS[1..]).to_string()
        } else {
            path(rng)
        }
    };
    match rng.below(14) {
        0 | 1 => Call::Create(path(rng), *rng.pick(&[0o644, 0o600, 0o666, 0o755])),
        2 => Call::Mkdir(path(rng), *rng.pick(&[0o755, 0o700, 0o777, 0o1777])),
        3 => Call::Symlink(path(rng), "target/of/link".into()),
        4 | 5 => Call::Write(
            path(rng),
            rng.below(3) * 4000,
            rng.below(9000) as u32 + 1,
            rng.below(250) as u8 + 1,
        ),
        6 => Call::Truncate(path(rng), rng.below(12000)),
        7 => Call::Chmod(any(rng), *rng.pick(&[0o755, 0o700, 0o777, 0o644, 0o1777])),
        8 => Call::Unlink(path(rng)),
        9 => Call::Rmdir(any(rng)),
        10 | 11 => Call::Rename(any(rng), path(rng), rng.below(3) as u8),
        12 => Call::Link(path(rng), path(rng)),
        _ => {
            if rng.below(2) == 0 {
                Call::SetXattr(
                    any(rng),
                    rng.below(3) as u8,
                    rng.below(9) as u8,
                    rng.below(2) == 0,
                )
            } else {
                Call::RemoveXattr(any(rng), rng.below(3) as u8)
            }
        }
    }
}

/// Everything compared of a tree, by path.
fn tree(fs: &dyn FileSystem, root: Ino) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(String::new(), root)];
    while let Some((path, dir)) = todo.pop() {
        let mut es = Vec::new();
        fs.readdir(dir, 0, &mut |e| {
            if e.name != b"." && e.name != b".." {
                es.push(e);
            }
            true
        })
        .unwrap();
        for e in es {
            let name = String::from_utf8_lossy(&e.name).into_owned();
            let p = format!("{path}/{name}");
            let a = fs.lookup(dir, &e.name).unwrap();
            assert_eq!(a.ino, e.ino, "{p}: listed and looked-up inodes differ");
            let mut what = format!(
                "{:?} {:o} links {} owner {}:{}",
                a.kind, a.perm, a.nlink, a.uid, a.gid
            );
            match a.kind {
                FileType::Regular => {
                    let data = fs.read(a.ino, 0, (a.size + 10) as u32).unwrap();
                    assert_eq!(data.len() as u64, a.size, "{p}: size and data disagree");
                    let sum = data
                        .iter()
                        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(*b)));
                    what += &format!(" size {} data {sum:x}", a.size);
                }
                FileType::Symlink => {
                    what += &format!(" -> {:?}", fs.readlink(a.ino).unwrap());
                }
                FileType::Directory => todo.push((p.clone(), a.ino)),
                _ => {}
            }
            let names = fs.listxattr(a.ino).unwrap();
            // (listxattr's order is the module's: ext2 keeps insertion order.)
            let mut names: Vec<&[u8]> =
                names.split(|b| *b == 0).filter(|x| !x.is_empty()).collect();
            names.sort();
            for x in names {
                let v = fs.getxattr(a.ino, x).unwrap();
                what += &format!(" {}={v:?}", String::from_utf8_lossy(x));
            }
            out.insert(p, what);
        }
    }
    out
}

fn same(what: &str, a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) {
    if a == b {
        return;
    }
    let mut diff = Vec::new();
    for k in a.keys().chain(b.keys()) {
        if a.get(k) != b.get(k) && !diff.iter().any(|(p, _, _)| p == k) {
            diff.push((k.clone(), a.get(k).cloned(), b.get(k).cloned()));
        }
    }
    panic!(
        "{what}: the trees differ at {} paths: {diff:#?}",
        diff.len()
    );
}

/// Files and directories that exist before the client decouples the subtree.
fn seed(fs: &dyn FileSystem, root: Ino) {
    let c = Ctx::root();
    let old = fs.mkdir(root, b"old", 0o755, &c).unwrap();
    let f = fs
        .mknod(old.ino, b"f", libc::S_IFREG | 0o644, 0, &c)
        .unwrap();
    fs.write(f.ino, 0, b"older data", &c).unwrap();
    fs.symlink(old.ino, b"x", b"elsewhere", &c).unwrap();
    fs.mkdir(root, b"c", 0o777, &c).unwrap();
    let shared = fs.mkdir(old.ino, b"d", 0o1777, &c).unwrap();
    fs.mknod(shared.ino, b"y", libc::S_IFREG | 0o666, 0, &user())
        .unwrap();
}

/// Calls per run, and runs (seeds) per module.
fn size() -> (usize, u64) {
    if std::env::var_os("CI").is_some() {
        (6_000, 2)
    } else {
        (30_000, 6)
    }
}

#[test]
fn a_decoupled_view_answers_as_the_module_would_and_merges_into_the_same_tree() {
    for kind in [Kind::Betrfs, Kind::Ext2(quilt_ext2::Mode::MetaJournal)] {
        for seed_no in 1..=size().1 {
            check_one(kind, seed_no);
        }
    }
}

fn check_one(kind: Kind, seed_no: u64) {
    // The oracle: the same module, given the same calls directly.
    let oracle_dev = mkfs(kind);
    let oracle = modules::mount(kind, oracle_dev);
    let oracle: &dyn FileSystem = match &oracle {
        modules::Mounted::Ext2(f) => &**f,
        modules::Mounted::Betrfs(f) => &**f,
    };
    let oroot = oracle
        .mkdir(oracle.root(), b"job", 0o777, &Ctx::root())
        .unwrap()
        .ino;
    seed(oracle, oroot);

    let dev = mkfs(kind);
    let store: Arc<dyn FileSystem> = match modules::mount(kind, dev) {
        modules::Mounted::Ext2(f) => Arc::<quilt_ext2::Ext2>::from(f),
        modules::Mounted::Betrfs(f) => Arc::<quilt_betrfs::Betrfs>::from(f),
    };
    let svc = Service::start(store.clone(), None, Duration::from_secs(30)).unwrap();
    let admin = svc.connect("admin");
    let strong = RemoteFs::new(admin.clone());
    let job = strong
        .mkdir(strong.root(), b"job", 0o777, &Ctx::root())
        .unwrap()
        .ino;
    seed(&strong, job);
    admin
        .set_policy(job, "consistency=weak interfere=allow inodes=64")
        .unwrap();
    let view = DecoupledFs::open(
        svc.connect("worker"),
        job,
        DecoupleOptions {
            local_dir: None,
            sync_interval: Some(Duration::ZERO),
        },
    )
    .unwrap();

    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed_no);
    let n = size().0;
    let mut log = Vec::new();
    for i in 0..n {
        let call = random_call(&mut rng);
        // As root: a module leaves permission checks to its caller (the kernel, with
        // default_permissions), and so does the view; the merge checks them again.
        let ctx = Ctx::root();
        let want = run(oracle, oroot, &call, &ctx);
        let got = run(&view, job, &call, &ctx);
        log.push(format!("{call:?} as {} ⇒ {want:?}", ctx.uid));
        if got != want {
            let tail = log.len().saturating_sub(12);
            panic!(
                "{kind:?} seed {seed_no} call {i}: {call:?} as uid {}: the view answered \
                 {got:?}, the module {want:?}\nlast calls:\n{}",
                ctx.uid,
                log[tail..].join("\n")
            );
        }
        if i % 500 == 499 {
            same(
                &format!("{kind:?} seed {seed_no}, the view after call {i}"),
                &tree(oracle, oroot),
                &tree(&view, job),
            );
        }
        if i == n / 2 {
            // A merge halfway: the service holds the first half, the view goes on.
            view.sync().unwrap();
            same(
                &format!("{kind:?} seed {seed_no}, the service after the halfway merge"),
                &tree(oracle, oroot),
                &tree(&strong, job),
            );
        }
    }
    let want = tree(oracle, oroot);
    same(
        &format!("{kind:?} seed {seed_no}, the view"),
        &want,
        &tree(&view, job),
    );
    let synced = view.release().unwrap();
    assert!(synced.events > 0, "nothing was merged");
    same(
        &format!("{kind:?} seed {seed_no}, the service after the release"),
        &want,
        &tree(&strong, job),
    );
    eprintln!(
        "{kind:?} seed {seed_no}: {n} calls, view and merged namespace equal to the module's \
         ({} paths)",
        want.len()
    );
    svc.stop().unwrap();
}
