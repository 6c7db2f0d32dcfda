//! Workloads, and what they promise. A workload drives the file system through paths;
//! before each operation the recorder puts a mark `op-K` into the device's history, and
//! after each fsync or sync that returned, a mark `fsync-K` with the promises it made:
//! the fsynced file's contents, the fsynced directory's names, or after a sync the whole
//! tree. A promise is checked in a crash state only while no later operation (one that
//! started before the cut) has touched its path.

use quilt_block::{BlockDevice, BlockDeviceExt};
use quilt_vfs::{
    Ctx, FileSystem, FileType, FsError, FsOp, FsReply, KernelFs, RenameFlags, SetAttr,
};
use std::collections::{BTreeMap, BTreeSet};

/// What a promise says is on disk at a path.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Expect {
    File(#[serde(skip)] Vec<u8>),
    Dir(BTreeSet<String>),
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Promise {
    /// The mark placed when the promise was made.
    pub mark: String,
    /// The operation that made it.
    pub op: usize,
    pub path: String,
    /// The file's inode (a write through another hard link changes it too).
    pub ino: u64,
    pub expect: Expect,
}

/// What one operation touched: paths, and the inodes they named before it ran.
#[derive(Debug, Clone, Default)]
pub struct Touch {
    /// The operation, as a reproduction lists it.
    pub what: String,
    pub paths: Vec<String>,
    pub inodes: Vec<u64>,
}

impl Touch {
    /// Does this operation invalidate `p` (made earlier)?
    pub fn invalidates(&self, p: &Promise) -> bool {
        (matches!(p.expect, Expect::File(_)) && self.inodes.contains(&p.ino))
            || self.paths.iter().any(|t| invalidates(t, &p.path))
    }
}

/// What must hold in every crash state of a run, wherever the cut.
#[derive(Debug, Clone, serde::Serialize)]
pub enum Invariant {
    /// A message moved from `src_dir` to `dst_dir` (names starting with `stem`): it is
    /// never gone from the source unless it is in the destination, and a copy in the
    /// destination is never incomplete.
    Moved {
        stem: String,
        src_dir: String,
        dst_dir: String,
        #[serde(skip)]
        content: Vec<u8>,
    },
    /// A tree renamed from one name to the next along `names`: exactly one of the names
    /// holds it, whole (never neither, never a part; both only where the mode allows a
    /// rename to leave two names, which betrfs never does).
    OneOf {
        names: Vec<String>,
        #[serde(skip)]
        tree: BTreeMap<String, Vec<u8>>,
    },
    /// A tree cloned from `src` to `dst`: the clone is either absent or whole (never a
    /// part, never different), and the source is whole (always if `src_made` is false;
    /// where the clone is there, if the source is itself made by the run). At cuts
    /// where fewer than `until` operations have begun (later ones change the trees).
    Cloned {
        src: String,
        dst: String,
        src_made: bool,
        until: usize,
        #[serde(skip)]
        tree: BTreeMap<String, Vec<u8>>,
    },
    /// A tree nothing changes (the original of a clone while the clone is written, or a
    /// clone while its original is removed): whole at every cut where at least `from`
    /// operations have begun (the tree was made durable before the last of them).
    Unchanged {
        path: String,
        from: usize,
        #[serde(skip)]
        tree: BTreeMap<String, Vec<u8>>,
    },
}

impl Invariant {
    /// Whether the invariant holds at a cut where `begun` operations have begun.
    pub fn active(&self, begun: usize) -> bool {
        match self {
            Invariant::Cloned { until, .. } => begun <= *until,
            Invariant::Unchanged { from, .. } => begun >= *from,
            Invariant::Moved { .. } | Invariant::OneOf { .. } => true,
        }
    }
}

/// Records marks, the paths each operation touches, and promises.
pub struct Recorder<'a> {
    dev: &'a dyn BlockDevice,
    pub(crate) fs: &'a dyn KernelFs,
    pub touched: Vec<Touch>,
    pub promises: Vec<Promise>,
    pub invariants: Vec<Invariant>,
    pub errors: usize,
    /// The process the operations are made for (0: none; patchgroups need one).
    caller: u32,
    /// The patchgroup engaged (`pg_start`, `pg_next`).
    group: Option<u64>,
    /// Inodes referenced as the kernel references what it looked up (`hold`), oldest
    /// first, until `forget` lets them go.
    held: Vec<u64>,
    /// Every file-system operation made, as the value any client of a module sends,
    /// with the index of its `touched` entry: the history a failure report replays.
    pub ops: Vec<(usize, FsOp)>,
}

fn parent(p: &str) -> &str {
    p.rsplit_once('/').map_or("", |(a, _)| a)
}

fn ctx() -> Ctx {
    Ctx::root()
}

/// The process id the patchgroup workloads act as.
pub const PG_CALLER: u32 = 4242;

impl<'a> Recorder<'a> {
    pub fn new(dev: &'a dyn BlockDevice, fs: &'a dyn KernelFs) -> Self {
        Recorder {
            dev,
            fs,
            touched: Vec::new(),
            promises: Vec::new(),
            invariants: Vec::new(),
            errors: 0,
            caller: 0,
            group: None,
            held: Vec::new(),
            ops: Vec::new(),
        }
    }

    /// Makes operation `op` (of the `touched` entry just begun) and records it.
    fn run(&mut self, op: FsOp) -> Result<FsReply, FsError> {
        let r = op.apply(self.fs, &self.ctx());
        self.ops.push((self.touched.len() - 1, op));
        r
    }

    fn ctx(&self) -> Ctx {
        Ctx {
            pid: self.caller,
            ..Ctx::root()
        }
    }

    /// From now on the operations are made by a process that creates a patchgroup and
    /// engages it (what the LD_PRELOAD library does at start).
    pub fn pg_start(&mut self) {
        self.caller = PG_CALLER;
        self.begin("patchgroup: create, release, engage".into(), &[]);
        let c = self.caller as u64;
        let r = self.fs.pg_create().and_then(|g| {
            self.fs.pg_release(g)?;
            self.fs.pg_engage(g, c)?;
            Ok(g)
        });
        self.group = self.note(r);
    }

    /// Ends the engaged group and engages a new one that depends on it: what the
    /// LD_PRELOAD library makes of an fsync.
    pub fn pg_next(&mut self) {
        let Some(cur) = self.group else { return };
        self.begin(format!("patchgroup: next after {cur}"), &[]);
        let c = self.caller as u64;
        let fs = self.fs;
        let r = fs.pg_create().and_then(|g| {
            fs.pg_disengage(cur, c)?;
            fs.pg_depend(g, cur)?;
            fs.pg_release(g)?;
            fs.pg_engage(g, c)?;
            fs.pg_abandon(cur)?;
            Ok(g)
        });
        if let Some(g) = self.note(r) {
            self.group = Some(g);
        }
    }

    /// Waits for the engaged group; on success the whole tree is promised (every change
    /// of this single process is in the chain of groups it syncs).
    pub fn pg_sync(&mut self) {
        let Some(cur) = self.group else { return };
        self.begin(format!("patchgroup: sync {cur}"), &[]);
        let op = self.touched.len() - 1;
        if self.note(self.fs.pg_sync(cur)).is_none() {
            return;
        }
        self.promise_tree(op);
    }

    fn begin(&mut self, what: String, paths: &[&str]) {
        self.dev.mark(&format!("op-{}", self.touched.len()));
        let inodes = paths.iter().filter_map(|p| self.resolve(p).ok()).collect();
        self.touched.push(Touch {
            what,
            paths: paths.iter().map(|p| p.to_string()).collect(),
            inodes,
        });
    }

    fn resolve(&self, path: &str) -> Result<u64, FsError> {
        resolve(self.fs, path)
    }

    fn split(&self, path: &str) -> Result<(u64, String), FsError> {
        let d = self.resolve(parent(path))?;
        let name = path.rsplit('/').next().unwrap_or(path).to_string();
        Ok((d, name))
    }

    fn note<T>(&mut self, r: Result<T, FsError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(_) => {
                self.errors += 1;
                None
            }
        }
    }

    pub fn create(&mut self, path: &str) {
        self.begin(format!("creat /{path}"), &[path]);
        let r = self.split(path).and_then(|(d, n)| {
            self.run(FsOp::Mknod {
                parent: d,
                name: n.into_bytes(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: None,
            })
        });
        self.note(r);
    }

    pub fn mkdir(&mut self, path: &str) {
        self.begin(format!("mkdir /{path}"), &[path]);
        let r = self.split(path).and_then(|(d, n)| {
            self.run(FsOp::Mkdir {
                parent: d,
                name: n.into_bytes(),
                mode: 0o755,
                ino: None,
            })
        });
        self.note(r);
    }

    pub fn write(&mut self, path: &str, offset: u64, data: &[u8]) {
        self.begin(
            format!("write /{path} at {offset}, {} bytes", data.len()),
            &[path],
        );
        let r = self.resolve(path).and_then(|ino| {
            self.run(FsOp::Write {
                ino,
                offset,
                data: data.to_vec(),
            })
        });
        self.note(r);
    }

    pub fn truncate(&mut self, path: &str, size: u64) {
        self.begin(format!("truncate /{path} to {size}"), &[path]);
        let set = SetAttr {
            size: Some(size),
            ..Default::default()
        };
        let r = self
            .resolve(path)
            .and_then(|ino| self.run(FsOp::Setattr { ino, set }));
        self.note(r);
    }

    pub fn link(&mut self, from: &str, to: &str) {
        self.begin(format!("link /{from} /{to}"), &[from, to]);
        let r = self.resolve(from).and_then(|ino| {
            let (d, n) = self.split(to)?;
            self.run(FsOp::Link {
                ino,
                new_parent: d,
                new_name: n.into_bytes(),
            })
        });
        self.note(r);
    }

    /// A reference to `path`'s inode, as a FUSE mount takes one for every name it
    /// looks up or lists (READDIRPLUS) and keeps until the kernel forgets it: a file
    /// unlinked meanwhile lives on, nameless, until then.
    pub fn hold(&mut self, path: &str) {
        self.begin(format!("lookup /{path} (held)"), &[path]);
        let r = self
            .resolve(path)
            .and_then(|i| self.fs.reference(i).map(|()| i));
        if let Some(i) = self.note(r) {
            self.held.push(i);
        }
    }

    /// The kernel forgets the `n` oldest inodes held, in one batch (BATCH_FORGET).
    pub fn forget(&mut self, n: usize) {
        let batch: Vec<u64> = self.held.drain(..n.min(self.held.len())).collect();
        self.begin(format!("forget {} inodes", batch.len()), &[]);
        let r = self.fs.unreference_all(&batch);
        self.note(r);
    }

    pub fn unlink(&mut self, path: &str) {
        self.begin(format!("unlink /{path}"), &[path]);
        let r = self.split(path).and_then(|(d, n)| {
            self.run(FsOp::Unlink {
                parent: d,
                name: n.into_bytes(),
            })
        });
        self.note(r);
    }

    pub fn rmdir(&mut self, path: &str) {
        self.begin(format!("rmdir /{path}"), &[path]);
        let r = self.split(path).and_then(|(d, n)| {
            self.run(FsOp::Rmdir {
                parent: d,
                name: n.into_bytes(),
            })
        });
        self.note(r);
    }

    pub fn rename(&mut self, from: &str, to: &str) {
        self.begin(format!("rename /{from} /{to}"), &[from, to]);
        let r = self.split(from).and_then(|(d, n)| {
            let (d2, n2) = self.split(to)?;
            self.run(FsOp::Rename {
                parent: d,
                name: n.into_bytes(),
                new_parent: d2,
                new_name: n2.into_bytes(),
                flags: RenameFlags::default(),
            })
        });
        self.note(r);
    }

    /// A clone of the tree (or file) at `from` under the new name `to`.
    pub fn clone_tree(&mut self, from: &str, to: &str) {
        self.begin(format!("clone /{from} /{to}"), &[to]);
        let r = self.resolve(from).and_then(|s| {
            let (d, n) = self.split(to)?;
            self.fs.clone_tree(s, d, n.as_bytes(), &self.ctx())
        });
        self.note(r);
    }

    /// fsync(path); on success the path's state is promised.
    pub fn fsync(&mut self, path: &str) {
        self.begin(format!("fsync /{path}"), &[]);
        let op = self.touched.len() - 1;
        let Some(ino) = self.note(self.resolve(path)) else {
            return;
        };
        let r = self.run(FsOp::Fsync {
            ino,
            datasync: false,
        });
        if self.note(r).is_none() {
            return;
        }
        let mark = format!("fsync-{op}");
        self.dev.mark(&mark);
        if let Some(expect) = self.state_of(ino) {
            self.promises.push(Promise {
                mark,
                op,
                path: path.to_string(),
                ino,
                expect,
            });
        }
    }

    /// sync(); on success every path is promised.
    pub fn sync(&mut self) {
        self.begin("sync".into(), &[]);
        let op = self.touched.len() - 1;
        let r = self.run(FsOp::SyncAll);
        if self.note(r).is_none() {
            return;
        }
        self.promise_tree(op);
    }

    /// After a sync made by operation `op`: every path is promised.
    fn promise_tree(&mut self, op: usize) {
        let mark = format!("fsync-{op}");
        self.dev.mark(&mark);
        let mut stack = vec![String::new()];
        while let Some(p) = stack.pop() {
            let Ok(ino) = self.resolve(&p) else { continue };
            let Some(expect) = self.state_of(ino) else {
                continue;
            };
            if let Expect::Dir(names) = &expect {
                for n in names {
                    stack.push(if p.is_empty() {
                        n.clone()
                    } else {
                        format!("{p}/{n}")
                    });
                }
            }
            self.promises.push(Promise {
                mark: mark.clone(),
                op,
                path: p,
                ino,
                expect,
            });
        }
    }

    fn state_of(&self, ino: u64) -> Option<Expect> {
        state_of(self.fs, ino)
    }
}

/// The inode at `path` (components separated by '/', relative to the root), looked up
/// one component at a time.
pub fn resolve(fs: &dyn FileSystem, path: &str) -> Result<u64, FsError> {
    let mut ino = fs.root();
    for c in path.split('/').filter(|c| !c.is_empty()) {
        ino = fs.lookup(ino, c.as_bytes())?.ino;
    }
    Ok(ino)
}

/// The promised view of an inode: a file's contents or a directory's names.
pub fn state_of(fs: &dyn FileSystem, ino: u64) -> Option<Expect> {
    let a = fs.getattr(ino).ok()?;
    match a.kind {
        FileType::Regular => fs
            .read(ino, 0, a.size.min(u32::MAX as u64) as u32)
            .ok()
            .map(Expect::File),
        FileType::Directory => {
            let mut names = BTreeSet::new();
            fs.readdir(ino, 0, &mut |e| {
                if e.name != b"." && e.name != b".." && e.name != b"lost+found" {
                    names.insert(String::from_utf8_lossy(&e.name).into_owned());
                }
                true
            })
            .ok()?;
            Some(Expect::Dir(names))
        }
        _ => None,
    }
}

/// Everything below directory `path`: relative paths to file contents, directories
/// with a trailing '/' (and no contents). `None` if `path` is no readable directory.
pub fn tree_at(fs: &dyn FileSystem, path: &str) -> Option<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(resolve(fs, path).ok()?, String::new())];
    while let Some((ino, rel)) = stack.pop() {
        let Expect::Dir(names) = state_of(fs, ino)? else {
            return None;
        };
        for n in names {
            let child = fs.lookup(ino, n.as_bytes()).ok()?.ino;
            let p = format!("{rel}{n}");
            match state_of(fs, child)? {
                Expect::File(bytes) => {
                    out.insert(p, bytes);
                }
                Expect::Dir(_) => {
                    out.insert(format!("{p}/"), Vec::new());
                    stack.push((child, format!("{p}/")));
                }
            }
        }
    }
    Some(out)
}

/// The trees the rename workload moves: `t{n}` holds `n` small files, in
/// subdirectories of ten past ten; `dst/slot` is an empty directory a tree replaces.
pub fn rename_setup(fs: &dyn FileSystem, seed: u64, sizes: &[usize]) -> Result<(), FsError> {
    let c = ctx();
    let root = fs.root();
    let dst = fs.mkdir(root, b"dst", 0o755, &c)?.ino;
    fs.mkdir(dst, b"slot", 0o755, &c)?;
    make_trees(fs, seed, sizes)?;
    fs.sync_all()
}

/// Trees `t{n}` of `n` files each, in subdirectories of ten past ten. Files of up to
/// 9,000 bytes; in trees past a thousand files, up to 300 (they must fit the image).
fn make_trees(fs: &dyn FileSystem, seed: u64, sizes: &[usize]) -> Result<(), FsError> {
    let c = ctx();
    let mut rng = Rng::new(seed);
    let root = fs.root();
    for &n in sizes {
        let t = fs.mkdir(root, format!("t{n}").as_bytes(), 0o755, &c)?.ino;
        for i in 0..n {
            let dir = if n > 10 {
                let name = format!("d{}", i / 10);
                match fs.lookup(t, name.as_bytes()) {
                    Ok(a) => a.ino,
                    Err(_) => fs.mkdir(t, name.as_bytes(), 0o755, &c)?.ino,
                }
            } else {
                t
            };
            let f = fs
                .mknod(
                    dir,
                    format!("f{i}").as_bytes(),
                    libc::S_IFREG | 0o644,
                    0,
                    &c,
                )?
                .ino;
            let lens: &[usize] = if n > 1000 {
                &[0, 40, 300]
            } else {
                &[0, 40, 300, 700, 4096, 9000]
            };
            let len = lens[rng.below(lens.len() as u64) as usize];
            fs.write(f, 0, &pattern(rng.next_u64(), len), &c)?;
        }
    }
    Ok(())
}

/// The clone workload's trees (as the rename workload's), each with a second name for
/// one of its files in a subdirectory (a link stub the clone must copy).
pub fn clone_setup(fs: &dyn FileSystem, seed: u64, sizes: &[usize]) -> Result<(), FsError> {
    make_trees(fs, seed, sizes)?;
    let c = ctx();
    for &n in sizes {
        let t = resolve(fs, &format!("t{n}"))?;
        let f = fs.lookup(if n > 10 { fs.lookup(t, b"d0")?.ino } else { t }, b"f0")?;
        let sub = fs.mkdir(t, b"links", 0o755, &c)?.ino;
        fs.link(f.ino, sub, b"second-name", &c)?;
    }
    fs.sync_all()
}

/// Clones of whole trees (nested, 1 to 10,000 files, with hard links inside), a clone
/// of a clone, a single file's clone; then writes into some clones while their
/// originals must not change, and the removal of an original while its clone must not
/// change.
pub fn clone_trees(r: &mut Recorder, sizes: &[usize]) {
    let first = r.invariants.len();
    for (k, &n) in sizes.iter().enumerate() {
        let (src, dst) = (format!("t{n}"), format!("c{n}"));
        let Some(tree) = tree_at(r.fs, &src) else {
            r.errors += 1;
            continue;
        };
        r.invariants.push(Invariant::Cloned {
            src: src.clone(),
            dst: dst.clone(),
            src_made: false,
            until: usize::MAX,
            tree: tree.clone(),
        });
        r.clone_tree(&src, &dst);
        r.fsync("");
        if k % 2 == 0 {
            let again = format!("cc{n}");
            r.invariants.push(Invariant::Cloned {
                src: dst.clone(),
                dst: again.clone(),
                src_made: true,
                until: usize::MAX,
                tree: tree.clone(),
            });
            r.clone_tree(&dst, &again);
        }
        let one = if n > 10 {
            format!("{src}/d0/f0")
        } else {
            format!("{src}/f0")
        };
        r.clone_tree(&one, &format!("f{n}"));
    }
    r.sync();
    // From here on the trees change: the clones' invariants end, and each tree that must
    // not change holds from the first cut after the sync returned.
    let now = r.touched.len();
    for inv in &mut r.invariants[first..] {
        if let Invariant::Cloned { until, .. } = inv {
            *until = now;
        }
    }
    let from = now + 1;
    for (k, &n) in sizes.iter().enumerate() {
        let (src, dst) = (format!("t{n}"), format!("c{n}"));
        let Some(tree) = tree_at(r.fs, &src) else {
            r.errors += 1;
            continue;
        };
        if k % 2 == 1 {
            // The clone changes; its original must not.
            r.invariants.push(Invariant::Unchanged {
                path: src.clone(),
                from,
                tree,
            });
            let f = if n > 10 {
                format!("{dst}/d0/f0")
            } else {
                format!("{dst}/f0")
            };
            r.write(&f, 0, b"written into the clone");
            r.write(
                &format!("{dst}/links/second-name"),
                3,
                b"through the other name",
            );
            r.unlink(&f);
            r.fsync(&dst);
        } else if n <= 100 {
            // The original goes; its clone must not change.
            r.invariants.push(Invariant::Unchanged {
                path: dst.clone(),
                from,
                tree,
            });
            remove_tree(r, &src);
        }
    }
    r.sync();
}

/// Removes the tree at `path`, entry by entry, deepest first.
fn remove_tree(r: &mut Recorder, path: &str) {
    let Ok(ino) = resolve(r.fs, path) else {
        r.errors += 1;
        return;
    };
    let mut entries = Vec::new();
    let _ = r.fs.readdir(ino, 0, &mut |e| {
        if e.name != b"." && e.name != b".." {
            entries.push((String::from_utf8_lossy(&e.name).into_owned(), e.kind));
        }
        true
    });
    for (name, kind) in entries {
        let p = format!("{path}/{name}");
        if kind == FileType::Directory {
            remove_tree(r, &p);
        } else {
            r.unlink(&p);
        }
    }
    r.rmdir(path);
}

/// Renames of whole trees (small ones move key by key in betrfs, large ones by range
/// rename of the tree): to a new name, over an empty directory, into another directory,
/// and one tree twice, with an fsync of a parent between and a sync at the end.
pub fn rename_trees(r: &mut Recorder, sizes: &[usize]) {
    for (k, &n) in sizes.iter().enumerate() {
        let from = format!("t{n}");
        let names: Vec<String> = match k % 4 {
            0 => vec![from, format!("u{n}")],
            1 => vec![from, "dst/slot".into()],
            2 => vec![from, format!("dst/u{n}")],
            _ => vec![from, format!("u{n}"), format!("dst/v{n}")],
        };
        let Some(tree) = tree_at(r.fs, &names[0]) else {
            r.errors += 1;
            continue;
        };
        r.invariants.push(Invariant::OneOf {
            names: names.clone(),
            tree,
        });
        for w in names.windows(2) {
            r.rename(&w[0], &w[1]);
            r.fsync(parent(&w[1]));
        }
    }
    r.sync();
}

/// Does an operation on path `touched` invalidate a promise about `path`? The same
/// path, an ancestor (renamed or removed), or a name inside the promised directory.
pub fn invalidates(touched: &str, path: &str) -> bool {
    touched == path || path.starts_with(&format!("{touched}/")) || parent(touched) == path
}

/// The workloads' random stream: ChaCha8 from a seed, so a run repeats from its seed on
/// any machine and with any version of the crate.
#[derive(Debug, Clone)]
pub struct Rng(rand_chacha::ChaCha8Rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        use rand::SeedableRng;
        Rng(rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        use rand::Rng as _;
        if n == 0 {
            0
        } else {
            self.0.random_range(0..n)
        }
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// The ACE operation types, in enumeration order.
pub const ACE_OPS: [&str; 9] = [
    "creat", "mkdir", "write", "truncate", "link", "unlink", "rename", "rmdir", "fsync",
];

/// One ACE step: operation `kind` at position `i` (0..3) of its sequence; each position
/// uses different arguments, so sequences combine files and directories in many ways.
/// Every step is followed by an fsync of what it changed (a persistence point).
pub fn ace_step(r: &mut Recorder, kind: &str, i: usize) {
    let i = i % 3;
    let fsync_path: String = match kind {
        "creat" => {
            let p = ["foo2", "A/baz", "B/qux"][i];
            r.create(p);
            p.into()
        }
        "mkdir" => {
            let p = ["B", "A/C", "D"][i];
            r.mkdir(p);
            p.into()
        }
        "write" => {
            let p = ["foo", "A/bar", "foo2"][i];
            r.write(p, [0, 4000, 8192][i], &pattern(i as u64 + 7, 5000));
            p.into()
        }
        "truncate" => {
            let p = ["foo", "A/bar", "foo"][i];
            r.truncate(p, [100, 0, 20000][i]);
            p.into()
        }
        "link" => {
            let (a, b) = [
                ("foo", "A/foo_link"),
                ("A/bar", "bar_link"),
                ("foo", "B/link"),
            ][i];
            r.link(a, b);
            b.into()
        }
        "unlink" => {
            let p = ["foo", "A/bar", "foo2"][i];
            r.unlink(p);
            parent(p).into()
        }
        "rename" => {
            let (a, b) = [("foo", "A/foo"), ("A", "B"), ("A/bar", "bar")][i];
            r.rename(a, b);
            b.into()
        }
        "rmdir" => {
            let p = ["A", "B", "A/C"][i];
            r.rmdir(p);
            parent(p).into()
        }
        _ => {
            let p = ["foo", "A", ""][i];
            r.fsync(p);
            return;
        }
    };
    // The persistence point: the target if it exists, else its directory.
    if r.resolve(&fsync_path).is_ok() {
        r.fsync(&fsync_path);
    } else {
        r.fsync(parent(&fsync_path));
    }
}

/// The state every ACE sequence starts from (made durable before recording starts).
pub fn ace_setup(fs: &dyn FileSystem) -> Result<(), FsError> {
    let c = ctx();
    let root = fs.root();
    let a = fs.mkdir(root, b"A", 0o755, &c)?.ino;
    let foo_ino = fs.mknod(root, b"foo", libc::S_IFREG | 0o644, 0, &c)?.ino;
    fs.write(foo_ino, 0, &pattern(1, 9000), &c)?;
    let bar = fs.mknod(a, b"bar", libc::S_IFREG | 0o644, 0, &c)?.ino;
    fs.write(bar, 0, &pattern(2, 3000), &c)?;
    fs.sync_all()
}

/// File `f` of the untar tree's directory `dp`: every third one in its `sub`.
fn tree_file(dp: &str, f: usize) -> String {
    if f % 3 == 0 {
        format!("{dp}/sub/file{f}")
    } else {
        format!("{dp}/file{f}")
    }
}

/// Creates a small tree (the shape of an untar): `dirs` directories of `files` files
/// of varied sizes, an fsync every tenth file, a sync at the end.
pub fn untar(r: &mut Recorder, seed: u64, dirs: usize, files: usize) {
    let mut rng = Rng::new(seed);
    for d in 0..dirs {
        let dp = format!("src{d}");
        r.mkdir(&dp);
        r.mkdir(&format!("{dp}/sub"));
        for f in 0..files {
            let p = tree_file(&dp, f);
            r.create(&p);
            let len = [10usize, 700, 4096, 5000, 20000, 60000][rng.below(6) as usize];
            r.write(&p, 0, &pattern(rng.next_u64(), len));
            if f % 10 == 9 {
                r.fsync(&p);
            }
        }
    }
    r.sync();
}

/// rm -rf of the untar tree (made durable first), fsyncing each emptied directory's
/// parent.
pub fn rmrf(r: &mut Recorder, dirs: usize, files: usize) {
    for d in 0..dirs {
        let dp = format!("src{d}");
        for f in 0..files {
            r.unlink(&tree_file(&dp, f));
        }
        r.rmdir(&format!("{dp}/sub"));
        r.fsync(&dp);
        r.rmdir(&dp);
        r.fsync("");
    }
    r.sync();
}

/// rm -rf of the untar tree as it reaches a FUSE mount: the listing holds each
/// directory's files before they are unlinked, and the kernel forgets them in batches
/// (of five here) after their unlinks, so files are freed after their names are gone,
/// several in one operation. An fsync before each batch makes the unlinks durable
/// first: a crash may leave files unlinked but not yet freed.
pub fn rmrf_held(r: &mut Recorder, dirs: usize, files: usize) {
    for d in 0..dirs {
        let dp = format!("src{d}");
        let paths: Vec<String> = (0..files).map(|f| tree_file(&dp, f)).collect();
        for p in &paths {
            r.hold(p);
        }
        for (k, p) in paths.iter().enumerate() {
            r.unlink(p);
            if k % 5 == 4 {
                // Durable before they are forgotten (another process's sync, say): a
                // crash finds them nameless and not yet freed.
                r.fsync(&dp);
                r.forget(5);
            }
        }
        r.forget(files);
        r.rmdir(&format!("{dp}/sub"));
        r.fsync(&dp);
        r.rmdir(&dp);
        r.fsync("");
    }
    r.sync();
}

/// A PostMark-like mix: a pool of files, then transactions that create, delete, read
/// or append, with an fsync of the touched file every fifth transaction.
pub fn postmark(r: &mut Recorder, seed: u64, initial: usize, transactions: usize) {
    let mut rng = Rng::new(seed);
    r.mkdir("pm");
    let mut live: Vec<String> = Vec::new();
    let mut next = 0;
    for _ in 0..initial {
        let p = format!("pm/f{next}");
        next += 1;
        r.create(&p);
        r.write(
            &p,
            0,
            &pattern(rng.next_u64(), 500 + rng.below(9000) as usize),
        );
        live.push(p);
    }
    for t in 0..transactions {
        let pick = rng.below(live.len().max(1) as u64) as usize;
        let touched = match rng.below(4) {
            0 => {
                let p = format!("pm/f{next}");
                next += 1;
                r.create(&p);
                r.write(
                    &p,
                    0,
                    &pattern(rng.next_u64(), 500 + rng.below(9000) as usize),
                );
                live.push(p.clone());
                Some(p)
            }
            1 if !live.is_empty() => {
                let p = live.swap_remove(pick);
                r.unlink(&p);
                None
            }
            2 if !live.is_empty() => {
                let p = live[pick].clone();
                r.begin(format!("read /{p}"), &[]);
                if let Ok(i) = r.resolve(&p) {
                    let _ = r.fs.read(i, 0, 65536);
                }
                None
            }
            _ if !live.is_empty() => {
                let p = live[pick].clone();
                let size = r
                    .resolve(&p)
                    .and_then(|i| r.fs.getattr(i))
                    .map_or(0, |a| a.size);
                r.write(
                    &p,
                    size,
                    &pattern(rng.next_u64(), 1 + rng.below(3000) as usize),
                );
                Some(p)
            }
            _ => None,
        };
        if t % 5 == 4 {
            match touched {
                Some(p) => r.fsync(&p),
                None => r.fsync("pm"),
            }
        }
    }
    r.sync();
}

/// A message of the mail workload: about 2 kB, different for each seed and number.
fn message(seed: u64, i: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9));
    pattern(rng.next_u64(), 1500 + rng.below(1100) as usize)
}

/// The mailbox the mail workload moves messages out of: maildir `src` with `n`
/// messages in `src/cur`, made durable before recording starts.
pub fn mail_setup(fs: &dyn FileSystem, seed: u64, n: usize) -> Result<(), FsError> {
    let c = ctx();
    let src = fs.mkdir(fs.root(), b"src", 0o700, &c)?.ino;
    for d in [&b"tmp"[..], b"new"] {
        fs.mkdir(src, d, 0o700, &c)?;
    }
    let cur = fs.mkdir(src, b"cur", 0o700, &c)?.ino;
    for i in 0..n {
        let f = fs
            .mknod(
                cur,
                format!("m{i}:2,").as_bytes(),
                libc::S_IFREG | 0o600,
                0,
                &c,
            )?
            .ino;
        fs.write(f, 0, &message(seed, i), &c)?;
    }
    fs.sync_all()
}

/// The IMAP move of the mail benchmark, as Dovecot does it on maildir: create the
/// destination mailbox, then for each message write a copy into `dst/tmp`, fsync it,
/// rename it into `dst/cur`, and flag the source deleted (a rename that adds `T`); then
/// expunge (unlink the flagged sources). With `groups`, every fsync is what the
/// LD_PRELOAD library makes of it (the next patchgroup, no waiting) and a patchgroup
/// sync ends the run; without, nothing is ordered until a sync at the end: the unsafe
/// configuration (fsync disabled), whose crash states must show the invariant broken.
pub fn mail_move(r: &mut Recorder, seed: u64, n: usize, groups: bool) {
    let fsync = |r: &mut Recorder| {
        if groups {
            r.pg_next();
        }
    };
    if groups {
        r.pg_start();
    }
    for d in ["dst", "dst/tmp", "dst/new", "dst/cur"] {
        r.mkdir(d);
    }
    fsync(r);
    for i in 0..n {
        let m = message(seed, i);
        r.invariants.push(Invariant::Moved {
            stem: format!("m{i}:"),
            src_dir: "src/cur".into(),
            dst_dir: "dst/cur".into(),
            content: m.clone(),
        });
        let tmp = format!("dst/tmp/m{i}:copy");
        r.create(&tmp);
        r.write(&tmp, 0, &m);
        fsync(r);
        r.rename(&tmp, &format!("dst/cur/m{i}:2,"));
        fsync(r);
        r.rename(&format!("src/cur/m{i}:2,"), &format!("src/cur/m{i}:2,T"));
        fsync(r);
    }
    for i in 0..n {
        r.unlink(&format!("src/cur/m{i}:2,T"));
    }
    fsync(r);
    if groups {
        r.pg_sync();
    } else {
        // Everything goes to disk in write-back's own order.
        r.sync();
    }
}

/// Deep trees (betrfs's zones): directories nested until paths pass twice the depth at
/// which new directories root zones, a file written and fsynced at several depths, the
/// top renamed to a long name and a middle directory moved to the top (both large
/// enough to become zones' roots when they move), then a sync.
pub fn deep(r: &mut Recorder, seed: u64, levels: usize) {
    let mut rng = Rng::new(seed);
    let name = "d".repeat(40 + rng.below(40) as usize);
    let every = 3 + rng.below(5) as usize;
    let mut path = "deep".to_string();
    r.mkdir(&path);
    for level in 0..levels {
        path = format!("{path}/{name}{level:02}");
        r.mkdir(&path);
        if level % every == every - 1 {
            let f = format!("{path}/f");
            r.create(&f);
            r.write(&f, 0, &pattern(level as u64, 9000));
            r.fsync(&f);
        }
    }
    for k in 0..40 {
        let f = format!("{path}/g{k}");
        r.create(&f);
        r.write(&f, 0, &pattern(k, 3000));
    }
    r.fsync(&path);
    let long = "R".repeat(200);
    r.rename("deep", &long);
    r.fsync("");
    let middle = format!("{long}/{name}00/{name}01/{name}02");
    r.rename(&middle, "middle");
    r.fsync("");
    r.sync();
}

/// A full device (betrfs's space): a file written until the device refuses it, fsynced
/// on the way; deleted; a sync (which compacts what was deleted); written again as far
/// as it goes; a sync.
pub fn full(r: &mut Recorder, seed: u64) {
    let chunk = (64 << 10) << Rng::new(seed).below(3);
    let data = pattern(seed, chunk);
    for round in 0..2 {
        let f = format!("fill{round}");
        r.create(&f);
        let mut off = 0u64;
        for k in 0.. {
            let before = r.errors;
            r.write(&f, off, &data);
            if r.errors > before {
                // ENOSPC: the device is full (not counted as a failed run).
                r.errors = before;
                break;
            }
            off += chunk as u64;
            if k % 8 == 7 {
                r.fsync(&f);
            }
        }
        r.fsync(&f);
        if round == 0 {
            r.unlink(&f);
            r.sync();
        }
    }
    r.sync();
}
