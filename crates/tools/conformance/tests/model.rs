//! The conformance suite: model-based tests of every file-system module (ext2 in its
//! consistency modes, betrfs) through the native `FileSystem` API and through FUSE.
//!
//! Random operation sequences over a small namespace (names `a`..`d`, depth ≤ 3, so that
//! collisions, overwrites, ENOTEMPTY and lookups through files happen often; paths are
//! literal, or "the i-th existing name" / "a name in the i-th existing directory" so
//! that most operations hit the tree as it grows) run both on
//! a module over a memory device and on a reference model of POSIX semantics as Linux
//! implements them (a tree of directories naming inodes). After every step the test
//! compares the result (Ok, or the same errno) and then the whole visible state: both
//! trees are walked from the root (readdir in small pages, "." and ".." checked apart),
//! and for each name the kind, link count, size, permissions, owner, device number, file
//! contents (read), symlink target (readlink) and extended attributes (listxattr and
//! getxattr) must agree, with hard links mapping to one inode on both sides. The free
//! inode count must follow the model's inode count, and at the end of each case
//! everything is removed and the free block and inode counts must be back where they
//! started (nothing leaked).
//!
//! Operations: create (mknod S_IFREG), special files (fifo, socket, char and block
//! devices), mkdir, unlink, rmdir, rename (plain, RENAME_NOREPLACE, RENAME_EXCHANGE),
//! link, symlink (fast < 60 bytes and slow ≥ 60), write (small, multi-block, past EOF,
//! and at 50 MB and 4.3 GB for double and triple indirect blocks), truncate (setattr
//! size), chmod (setattr mode), user.* xattrs set (plain, XATTR_CREATE, XATTR_REPLACE)
//! and removed, fsync, sync_all, remount (clean unmount, reopen the image bytes), and
//! `Fill` (up to 40 files with 200–255-byte names, so directories span several blocks).
//!
//! Harness conventions (what the kernel's VFS does before a FUSE file system is called):
//! paths are resolved by `lookup` one component at a time without following symlinks;
//! for the two-path operations (rename, link) both parents are checked to be directories
//! in path-walk order, as the kernel does; write and truncate are skipped on
//! symlinks and special files, chmod on symlinks, and user.* xattrs on anything but
//! regular files and directories (the VFS handles those before the file system sees them).
//!
//! Case count: `QUILT_PROPTEST_CASES` if set, else 300 cases (of up to 60 operations)
//! under `CI=true` and 2,000 otherwise. Each case picks the consistency mode (async or
//! soft updates) and the cache size (roomy, or small enough to force write-back). A
//! failure reports proptest's minimal case with its paths resolved, then the same
//! sequence with steps dropped while the failure stays the same.
//!
//! `thousands_of_random_operations` runs one seeded sequence of 2,000 operations (same
//! distribution, xorshift generator, fixed seed) in one 64 MiB file system, comparing
//! after every step; a failure is reported with a minimized reproduction.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use quilt_betrfs::Betrfs;
use quilt_block::MemDevice;
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, FsOp, FsReply, Ino, RenameFlags, SetAttr,
    XattrFlags,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

#[path = "support/fuse_env.rs"]
#[allow(dead_code)]
mod fuse_env;
#[path = "support/mount_fs.rs"]
mod mount_fs;
use fuse_env::fuse_available;

#[path = "support/mds_service.rs"]
mod mds_service;
use mount_fs::MountFs;

const BS: u64 = 4096;
const NAMES: [&str; 4] = ["a", "b", "c", "d"];
const XNAMES: [&str; 4] = [
    "user.a",
    "user.bb",
    "user.a_rather_longer_attribute_name_for_the_entry",
    "user.d",
];
/// Files up to this size are compared whole; larger ones block by block where the model
/// has data, next to it, and at the block-map boundaries.
const FULL_COMPARE_MAX: u64 = 256 << 10;
/// First logical blocks reached through the indirect, double and triple indirect blocks.
const IND_START: u64 = 12;
const DIND_START: u64 = 12 + 1024;
const TIND_START: u64 = 12 + 1024 + 1024 * 1024;

// ---------------------------------------------------------------------------------------
// Operations

/// Long names (200 to 255 bytes), which `Fill` creates in bulk so that directories
/// span several blocks; name index `NAMES.len() + k` is long name `k`.
const LONG_NAMES: u8 = 64;

fn name_of(i: u8) -> &'static [u8] {
    static LONG: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    if (i as usize) < NAMES.len() {
        return NAMES[i as usize].as_bytes();
    }
    let long = LONG.get_or_init(|| {
        (0..LONG_NAMES as usize)
            .map(|k| {
                let mut n = format!("L{k:02}-").into_bytes();
                n.resize(200 + (k * 7) % 56, b'x');
                n
            })
            .collect()
    });
    &long[i as usize - NAMES.len()]
}

fn index_of(name: &[u8]) -> Option<u8> {
    (0..NAMES.len() as u8 + LONG_NAMES).find(|&i| name_of(i) == name)
}

/// A path of name indices (see `name_of`).
#[derive(Clone, PartialEq, Eq)]
struct P(Vec<u8>);

impl P {
    fn name(&self) -> &'static [u8] {
        name_of(*self.0.last().unwrap())
    }
    fn parent(&self) -> &[u8] {
        &self.0[..self.0.len() - 1]
    }
}

impl fmt::Debug for P {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s: Vec<String> = self
            .0
            .iter()
            .map(|&i| match NAMES.get(i as usize) {
                Some(n) => n.to_string(),
                None => format!("L{:02}…", i as usize - NAMES.len()),
            })
            .collect();
        write!(f, "\"{}\"", s.join("/"))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Perm(u16);

impl fmt::Debug for Perm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0o{:o}", self.0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Special {
    Fifo,
    Socket,
    Char,
    Block,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RFlags {
    Plain,
    NoReplace,
    Exchange,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum XFlag {
    Any,
    Create,
    Replace,
}

/// An operation; `T` is how it names paths: `P` when run, `PS` when generated.
#[derive(Clone, Debug)]
enum Op<T = P> {
    Create {
        path: T,
        perm: Perm,
        who: u8,
    },
    Mknod {
        path: T,
        kind: Special,
        rdev: u32,
    },
    Mkdir {
        path: T,
        perm: Perm,
        who: u8,
    },
    Symlink {
        path: T,
        len: usize,
        seed: u8,
        who: u8,
    },
    Unlink {
        path: T,
    },
    Rmdir {
        path: T,
    },
    Rename {
        from: T,
        to: T,
        flags: RFlags,
    },
    Link {
        from: T,
        to: T,
    },
    Write {
        path: T,
        offset: u64,
        len: usize,
        seed: u8,
    },
    Truncate {
        path: T,
        size: u64,
    },
    Chmod {
        path: T,
        perm: Perm,
    },
    SetXattr {
        path: T,
        name: u8,
        len: usize,
        seed: u8,
        flag: XFlag,
    },
    RemoveXattr {
        path: T,
        name: u8,
    },
    Fsync {
        path: T,
        datasync: bool,
    },
    /// Creates files with long names `from..from + count` (modulo `LONG_NAMES`) in `dir`,
    /// one `Create` step each; compared after the last.
    Fill {
        dir: T,
        from: u8,
        count: u8,
    },
    SyncAll,
    Remount,
}

impl<T> Op<T> {
    fn map<U>(self, mut f: impl FnMut(T) -> U) -> Op<U> {
        match self {
            Op::Create { path, perm, who } => Op::Create {
                path: f(path),
                perm,
                who,
            },
            Op::Mknod { path, kind, rdev } => Op::Mknod {
                path: f(path),
                kind,
                rdev,
            },
            Op::Mkdir { path, perm, who } => Op::Mkdir {
                path: f(path),
                perm,
                who,
            },
            Op::Symlink {
                path,
                len,
                seed,
                who,
            } => Op::Symlink {
                path: f(path),
                len,
                seed,
                who,
            },
            Op::Unlink { path } => Op::Unlink { path: f(path) },
            Op::Rmdir { path } => Op::Rmdir { path: f(path) },
            Op::Rename { from, to, flags } => {
                let from = f(from);
                Op::Rename {
                    from,
                    to: f(to),
                    flags,
                }
            }
            Op::Link { from, to } => {
                let from = f(from);
                Op::Link { from, to: f(to) }
            }
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => Op::Write {
                path: f(path),
                offset,
                len,
                seed,
            },
            Op::Truncate { path, size } => Op::Truncate {
                path: f(path),
                size,
            },
            Op::Chmod { path, perm } => Op::Chmod {
                path: f(path),
                perm,
            },
            Op::SetXattr {
                path,
                name,
                len,
                seed,
                flag,
            } => Op::SetXattr {
                path: f(path),
                name,
                len,
                seed,
                flag,
            },
            Op::RemoveXattr { path, name } => Op::RemoveXattr {
                path: f(path),
                name,
            },
            Op::Fsync { path, datasync } => Op::Fsync {
                path: f(path),
                datasync,
            },
            Op::Fill { dir, from, count } => Op::Fill {
                dir: f(dir),
                from,
                count,
            },
            Op::SyncAll => Op::SyncAll,
            Op::Remount => Op::Remount,
        }
    }
}

/// A generated path: a literal one (often naming nothing, or something of the wrong
/// kind), the `i`-th existing name (modulo their count), or a name in the `i`-th existing
/// directory. Indices keep operations hitting the tree as it grows and shrink well; they
/// are resolved against the model before each step, and failures list the literal paths.
#[derive(Clone, Debug)]
enum PS {
    Lit(P),
    Old(u16),
    New(u16, u8),
    /// The `i`-th existing directory (the root included).
    Dir(u16),
}

fn old_s() -> impl Strategy<Value = PS> {
    prop_oneof![2 => path_s().prop_map(PS::Lit), 3 => any::<u16>().prop_map(PS::Old)]
}

fn new_s() -> impl Strategy<Value = PS> {
    prop_oneof![
        2 => path_s().prop_map(PS::Lit),
        3 => (any::<u16>(), 0u8..4).prop_map(|(i, n)| PS::New(i, n)),
    ]
}

impl Model {
    fn nth_dir(&self, i: u16, depth: usize) -> P {
        let dirs: Vec<P> = std::iter::once(P(Vec::new()))
            .chain(
                self.paths(depth)
                    .into_iter()
                    .filter(|(_, d)| *d)
                    .map(|(p, _)| p),
            )
            .collect();
        dirs[i as usize % dirs.len()].clone()
    }

    fn resolve_spec(&self, ps: PS) -> P {
        match ps {
            PS::Lit(p) => p,
            PS::Old(i) => {
                let v = self.paths(3);
                if v.is_empty() {
                    P(vec![0])
                } else {
                    v[i as usize % v.len()].0.clone()
                }
            }
            PS::New(i, n) => {
                let mut q = self.nth_dir(i, 2).0;
                q.push(n);
                P(q)
            }
            PS::Dir(i) => self.nth_dir(i, 3),
        }
    }
}

fn path_s() -> impl Strategy<Value = P> {
    prop_oneof![
        3 => prop::collection::vec(0u8..4, 1..=1),
        3 => prop::collection::vec(0u8..4, 2..=2),
        2 => prop::collection::vec(0u8..4, 3..=3),
    ]
    .prop_map(P)
}

fn perm_s() -> impl Strategy<Value = Perm> {
    prop_oneof![
        3 => prop::sample::select(vec![0o644u16, 0o755, 0o600, 0o700, 0o777]),
        1 => 0u16..=0o777,
    ]
    .prop_map(Perm)
}

fn offset_s() -> impl Strategy<Value = u64> {
    prop_oneof![
        8 => 0u64..20_000,
        3 => (0u64..40, -8i64..8).prop_map(|(k, d)| (k * BS).saturating_add_signed(d)),
        2 => 0u64..300_000,
        // Around the start of the indirect and double indirect blocks.
        1 => (-3i64..3).prop_map(|d| (IND_START * BS).saturating_add_signed(d * 1000)),
        1 => (-3i64..3).prop_map(|d| (DIND_START * BS).saturating_add_signed(d * 1000)),
        1 => (0u64..100_000).prop_map(|x| 50_000_000 + x),
        1 => (0u64..10_000).prop_map(|x| TIND_START * BS + 50_000 + x),
    ]
}

fn len_s() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..200,
        4 => 1usize..9_000,
        1 => (1usize..=4).prop_map(|k| k * BS as usize),
        1 => 9_000usize..20_000,
    ]
}

fn size_s() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..20_000,
        2 => (0u64..40).prop_map(|k| k * BS),
        1 => 0u64..300_000,
        1 => (0u64..100_000).prop_map(|x| 50_000_000 + x),
        1 => (0u64..100_000).prop_map(|x| TIND_START * BS + x),
    ]
}

fn op_s() -> impl Strategy<Value = Op<PS>> {
    prop_oneof![
        10 => (new_s(), perm_s(), 0u8..2).prop_map(|(path, perm, who)| Op::Create { path, perm, who }),
        2 => (
            new_s(),
            prop::sample::select(vec![Special::Fifo, Special::Socket, Special::Char, Special::Block]),
            prop_oneof![Just(0u32), 1u32..0x1_0000, any::<u32>()],
        )
            .prop_map(|(path, kind, rdev)| Op::Mknod { path, kind, rdev }),
        10 => (new_s(), perm_s(), 0u8..2).prop_map(|(path, perm, who)| Op::Mkdir { path, perm, who }),
        5 => (
            new_s(),
            prop_oneof![3 => 1usize..60, 1 => Just(59usize), 1 => Just(60usize), 3 => 60usize..500],
            any::<u8>(),
            0u8..2,
        )
            .prop_map(|(path, len, seed, who)| Op::Symlink { path, len, seed, who }),
        6 => old_s().prop_map(|path| Op::Unlink { path }),
        5 => old_s().prop_map(|path| Op::Rmdir { path }),
        12 => (
            old_s(),
            prop_oneof![new_s(), old_s()],
            prop_oneof![4 => Just(RFlags::Plain), 1 => Just(RFlags::NoReplace), 2 => Just(RFlags::Exchange)],
        )
            .prop_map(|(from, to, flags)| Op::Rename { from, to, flags }),
        5 => (old_s(), new_s()).prop_map(|(from, to)| Op::Link { from, to }),
        12 => (old_s(), offset_s(), len_s(), any::<u8>())
            .prop_map(|(path, offset, len, seed)| Op::Write { path, offset, len, seed }),
        5 => (old_s(), size_s()).prop_map(|(path, size)| Op::Truncate { path, size }),
        3 => (old_s(), prop_oneof![3 => perm_s(), 1 => (0u16..=0o7777).prop_map(Perm)])
            .prop_map(|(path, perm)| Op::Chmod { path, perm }),
        5 => (
            old_s(),
            0u8..4,
            prop_oneof![Just(0usize), 1usize..40, 40usize..700],
            any::<u8>(),
            prop_oneof![3 => Just(XFlag::Any), 1 => Just(XFlag::Create), 1 => Just(XFlag::Replace)],
        )
            .prop_map(|(path, name, len, seed, flag)| Op::SetXattr { path, name, len, seed, flag }),
        3 => (old_s(), 0u8..4).prop_map(|(path, name)| Op::RemoveXattr { path, name }),
        3 => (old_s(), any::<bool>()).prop_map(|(path, datasync)| Op::Fsync { path, datasync }),
        1 => (any::<u16>().prop_map(PS::Dir), any::<u8>(), 1u8..=40)
            .prop_map(|(dir, from, count)| Op::Fill { dir, from, count }),
        1 => Just(Op::SyncAll),
        2 => Just(Op::Remount),
    ]
}

/// Bytes of a write: never zero, so holes and data cannot be confused.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u32).wrapping_mul(0x9E37_79B1) ^ ((seed as u32) << 24) ^ (i as u32 >> 12);
            ((x >> 24) as u8) | 1
        })
        .collect()
}

fn link_target(len: usize, seed: u8) -> Vec<u8> {
    const CH: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789/._-";
    (0..len)
        .map(|i| CH[(i * 7 + seed as usize) % CH.len()])
        .collect()
}

fn ctx(who: u8) -> Ctx {
    match who {
        0 => Ctx {
            uid: 0,
            gid: 0,
            pid: 1,
            umask: 0,
        },
        _ => Ctx {
            uid: 1000,
            gid: 100,
            pid: 2,
            umask: 0o022,
        },
    }
}

fn xname(i: u8) -> &'static [u8] {
    XNAMES[i as usize].as_bytes()
}

// ---------------------------------------------------------------------------------------
// The reference model

type Id = usize;
const ROOT: Id = 0;
const LOST_FOUND: Id = 1;

#[derive(Clone, Debug)]
struct Node {
    kind: FileType,
    perm: u16,
    uid: u32,
    gid: u32,
    rdev: u32,
    /// Regular files: the size, and the data of every block ever written (bytes past the
    /// size are zeros); symlinks: the target length.
    size: u64,
    chunks: BTreeMap<u64, Vec<u8>>,
    target: Vec<u8>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Names of a non-directory (a directory's count is computed).
    links: u32,
    children: BTreeMap<Vec<u8>, Id>,
    /// A directory's parent.
    parent: Id,
}

impl Node {
    fn new(kind: FileType, perm: u16, uid: u32, gid: u32, parent: Id) -> Node {
        Node {
            kind,
            perm,
            uid,
            gid,
            rdev: 0,
            size: 0,
            chunks: BTreeMap::new(),
            target: Vec::new(),
            xattrs: BTreeMap::new(),
            links: 1,
            children: BTreeMap::new(),
            parent,
        }
    }
    fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }
}

#[derive(Clone, Debug)]
struct Model {
    nodes: HashMap<Id, Node>,
    next: Id,
}

type R<T = ()> = Result<T, FsError>;

impl Model {
    /// What mkfs makes: the root (0755) holding lost+found (0700).
    fn new() -> Model {
        let mut nodes = HashMap::new();
        let mut root = Node::new(FileType::Directory, 0o755, 0, 0, ROOT);
        root.children.insert(b"lost+found".to_vec(), LOST_FOUND);
        nodes.insert(ROOT, root);
        nodes.insert(
            LOST_FOUND,
            Node::new(FileType::Directory, 0o700, 0, 0, ROOT),
        );
        Model { nodes, next: 2 }
    }

    fn n(&self, id: Id) -> &Node {
        &self.nodes[&id]
    }
    fn nm(&mut self, id: Id) -> &mut Node {
        self.nodes.get_mut(&id).unwrap()
    }
    fn is_dir(&self, id: Id) -> bool {
        self.n(id).is_dir()
    }

    fn nlink(&self, id: Id) -> u32 {
        let n = self.n(id);
        if n.is_dir() {
            2 + n.children.values().filter(|&&c| self.is_dir(c)).count() as u32
        } else {
            n.links
        }
    }

    /// Path walk: every component but the last must be a directory.
    fn resolve(&self, path: &[u8]) -> R<Id> {
        let mut cur = ROOT;
        for &c in path {
            let n = self.n(cur);
            if !n.is_dir() {
                return Err(FsError::NotDir);
            }
            cur = *n.children.get(name_of(c)).ok_or(FsError::NotFound)?;
        }
        Ok(cur)
    }

    /// The directory holding the last component (which must be a directory).
    fn dir_of(&self, p: &P) -> R<Id> {
        let d = self.resolve(p.parent())?;
        if !self.is_dir(d) {
            return Err(FsError::NotDir);
        }
        Ok(d)
    }

    fn child(&self, dir: Id, name: &[u8]) -> Option<Id> {
        self.n(dir).children.get(name).copied()
    }

    fn is_ancestor_or_self(&self, anc: Id, mut d: Id) -> bool {
        loop {
            if d == anc {
                return true;
            }
            if d == ROOT {
                return false;
            }
            d = self.n(d).parent;
        }
    }

    /// One name of `id` is gone.
    fn drop_name(&mut self, id: Id) {
        if self.is_dir(id) {
            self.nodes.remove(&id);
            return;
        }
        let n = self.nm(id);
        n.links -= 1;
        if n.links == 0 {
            self.nodes.remove(&id);
        }
    }

    fn create(&mut self, p: &P, kind: FileType, perm: u16, who: u8) -> R<Id> {
        let d = self.dir_of(p)?;
        if self.child(d, p.name()).is_some() {
            return Err(FsError::Exists);
        }
        let c = ctx(who);
        let dn = self.n(d);
        let sgid = dn.perm as u32 & libc::S_ISGID != 0;
        let gid = if sgid { dn.gid } else { c.gid };
        let mut perm = match kind {
            FileType::Symlink => 0o777,
            _ => perm & 0o7777 & !(c.umask as u16 & 0o777),
        };
        if kind == FileType::Directory && sgid {
            perm |= libc::S_ISGID as u16;
        }
        let id = self.next;
        self.next += 1;
        self.nodes.insert(id, Node::new(kind, perm, c.uid, gid, d));
        self.nm(d).children.insert(p.name().to_vec(), id);
        Ok(id)
    }

    fn write(&mut self, id: Id, off: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let n = self.nm(id);
        let end = off + data.len() as u64;
        let mut pos = off;
        while pos < end {
            let b = pos / BS;
            let o = (pos % BS) as usize;
            let k = ((BS - o as u64).min(end - pos)) as usize;
            let chunk = n.chunks.entry(b).or_insert_with(|| vec![0; BS as usize]);
            let src = (pos - off) as usize;
            chunk[o..o + k].copy_from_slice(&data[src..src + k]);
            pos += k as u64;
        }
        n.size = n.size.max(end);
    }

    fn truncate(&mut self, id: Id, size: u64) {
        let n = self.nm(id);
        if size < n.size {
            n.chunks.retain(|&b, _| b * BS < size);
            if size % BS != 0 {
                if let Some(c) = n.chunks.get_mut(&(size / BS)) {
                    c[(size % BS) as usize..].fill(0);
                }
            }
        }
        n.size = size;
    }

    fn read(&self, id: Id, off: u64, len: u64) -> Vec<u8> {
        let n = self.n(id);
        let end = n.size.min(off.saturating_add(len));
        if off >= end {
            return Vec::new();
        }
        let mut out = vec![0u8; (end - off) as usize];
        for (&b, c) in n.chunks.range(off / BS..=(end - 1) / BS) {
            let lo = (b * BS).max(off);
            let hi = ((b + 1) * BS).min(end);
            out[(lo - off) as usize..(hi - off) as usize]
                .copy_from_slice(&c[(lo - b * BS) as usize..(hi - b * BS) as usize]);
        }
        out
    }

    /// Applies `op`; None when the harness skips it (see the module comment).
    fn apply(&mut self, op: &Op) -> Option<R> {
        Some(match op {
            Op::Create { path, perm, who } => {
                self.create(path, FileType::Regular, perm.0, *who).map(drop)
            }
            Op::Mknod { path, kind, rdev } => {
                let (k, perm, rdev) = special(*kind, *rdev);
                self.create(path, k, perm, 0)
                    .map(|id| self.nm(id).rdev = rdev)
            }
            Op::Mkdir { path, perm, who } => self
                .create(path, FileType::Directory, perm.0, *who)
                .map(drop),
            Op::Symlink {
                path,
                len,
                seed,
                who,
            } => self.create(path, FileType::Symlink, 0o777, *who).map(|id| {
                let t = link_target(*len, *seed);
                let n = self.nm(id);
                n.size = t.len() as u64;
                n.target = t;
            }),
            Op::Unlink { path } => (|| {
                let d = self.dir_of(path)?;
                let c = self.child(d, path.name()).ok_or(FsError::NotFound)?;
                if self.is_dir(c) {
                    return Err(FsError::IsDir);
                }
                self.nm(d).children.remove(path.name());
                self.drop_name(c);
                Ok(())
            })(),
            Op::Rmdir { path } => (|| {
                let d = self.dir_of(path)?;
                let c = self.child(d, path.name()).ok_or(FsError::NotFound)?;
                if !self.is_dir(c) {
                    return Err(FsError::NotDir);
                }
                if !self.n(c).children.is_empty() {
                    return Err(FsError::NotEmpty);
                }
                self.nm(d).children.remove(path.name());
                self.drop_name(c);
                Ok(())
            })(),
            Op::Rename { from, to, flags } => self.rename(from, to, *flags),
            Op::Link { from, to } => (|| {
                let src = self.resolve(&from.0)?;
                let d = self.dir_of(to)?;
                if self.child(d, to.name()).is_some() {
                    return Err(FsError::Exists);
                }
                if self.is_dir(src) {
                    return Err(FsError::Perm);
                }
                self.nm(d).children.insert(to.name().to_vec(), src);
                self.nm(src).links += 1;
                Ok(())
            })(),
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => {
                let id = match self.resolve(&path.0) {
                    Ok(id) => id,
                    Err(e) => return Some(Err(e)),
                };
                match self.n(id).kind {
                    FileType::Directory => Err(FsError::IsDir),
                    FileType::Regular => {
                        self.write(id, *offset, &pattern(*seed, *len));
                        Ok(())
                    }
                    _ => return None,
                }
            }
            Op::Truncate { path, size } => {
                let id = match self.resolve(&path.0) {
                    Ok(id) => id,
                    Err(e) => return Some(Err(e)),
                };
                match self.n(id).kind {
                    FileType::Directory => Err(FsError::IsDir),
                    FileType::Regular => {
                        self.truncate(id, *size);
                        Ok(())
                    }
                    _ => return None,
                }
            }
            Op::Chmod { path, perm } => {
                let id = match self.resolve(&path.0) {
                    Ok(id) => id,
                    Err(e) => return Some(Err(e)),
                };
                if self.n(id).kind == FileType::Symlink {
                    return None;
                }
                self.nm(id).perm = perm.0 & 0o7777;
                Ok(())
            }
            Op::SetXattr {
                path,
                name,
                len,
                seed,
                flag,
            } => {
                let id = match self.resolve(&path.0) {
                    Ok(id) => id,
                    Err(e) => return Some(Err(e)),
                };
                if !matches!(self.n(id).kind, FileType::Regular | FileType::Directory) {
                    return None;
                }
                let n = self.nm(id);
                let exists = n.xattrs.contains_key(xname(*name));
                match flag {
                    XFlag::Create if exists => Err(FsError::Exists),
                    XFlag::Replace if !exists => Err(FsError::NoAttr),
                    _ => {
                        n.xattrs.insert(xname(*name).to_vec(), pattern(*seed, *len));
                        Ok(())
                    }
                }
            }
            Op::RemoveXattr { path, name } => {
                let id = match self.resolve(&path.0) {
                    Ok(id) => id,
                    Err(e) => return Some(Err(e)),
                };
                if !matches!(self.n(id).kind, FileType::Regular | FileType::Directory) {
                    return None;
                }
                match self.nm(id).xattrs.remove(xname(*name)) {
                    Some(_) => Ok(()),
                    None => Err(FsError::NoAttr),
                }
            }
            Op::Fsync { path, .. } => self.resolve(&path.0).map(drop),
            Op::Fill { .. } => unreachable!("Fill runs as Create steps"),
            Op::SyncAll | Op::Remount => Ok(()),
        })
    }

    /// rename(2)/renameat2(2) in the order Linux checks: both parents, the source, the
    /// flags against the target, "source is an ancestor of the new parent" (EINVAL),
    /// "target is an ancestor of the old parent" (ENOTEMPTY, EINVAL with EXCHANGE), same
    /// inode (nothing to do), kinds (ENOTDIR/EISDIR), an empty target directory.
    fn rename(&mut self, from: &P, to: &P, flags: RFlags) -> R {
        let op = self.dir_of(from)?;
        let np = self.dir_of(to)?;
        let src = self.child(op, from.name()).ok_or(FsError::NotFound)?;
        let dst = self.child(np, to.name());
        match flags {
            RFlags::NoReplace if dst.is_some() => return Err(FsError::Exists),
            RFlags::Exchange if dst.is_none() => return Err(FsError::NotFound),
            _ => {}
        }
        let exchange = flags == RFlags::Exchange;
        if op != np {
            if self.is_dir(src) && self.is_ancestor_or_self(src, np) {
                return Err(FsError::Invalid("source is an ancestor of the target"));
            }
            if let Some(d) = dst {
                if self.is_dir(d) && self.is_ancestor_or_self(d, op) {
                    return Err(if exchange {
                        FsError::Invalid("target is an ancestor of the source")
                    } else {
                        FsError::NotEmpty
                    });
                }
            }
        }
        if dst == Some(src) {
            return Ok(());
        }
        if exchange {
            let dst = dst.unwrap();
            self.nm(op).children.insert(from.name().to_vec(), dst);
            self.nm(np).children.insert(to.name().to_vec(), src);
            if self.is_dir(src) {
                self.nm(src).parent = np;
            }
            if self.is_dir(dst) {
                self.nm(dst).parent = op;
            }
            return Ok(());
        }
        if let Some(d) = dst {
            match (self.is_dir(src), self.is_dir(d)) {
                (true, false) => return Err(FsError::NotDir),
                (false, true) => return Err(FsError::IsDir),
                (true, true) if !self.n(d).children.is_empty() => return Err(FsError::NotEmpty),
                _ => {}
            }
            self.drop_name(d);
        }
        self.nm(op).children.remove(from.name());
        self.nm(np).children.insert(to.name().to_vec(), src);
        if self.is_dir(src) {
            self.nm(src).parent = np;
        }
        Ok(())
    }

    /// Every existing path (lost+found aside) up to `depth` components, with whether it is
    /// a directory.
    fn paths(&self, depth: usize) -> Vec<(P, bool)> {
        let mut out = Vec::new();
        let mut stack = vec![(ROOT, Vec::new())];
        while let Some((id, p)) = stack.pop() {
            for (name, &c) in &self.n(id).children {
                if let Some(i) = index_of(name) {
                    let mut q: Vec<u8> = p.clone();
                    q.push(i);
                    let dir = self.is_dir(c);
                    if dir && q.len() < depth {
                        stack.push((c, q.clone()));
                    }
                    out.push((P(q), dir));
                }
            }
        }
        out
    }
}

/// Type, permissions and device number of a special file (fifos and sockets carry none).
fn special(kind: Special, rdev: u32) -> (FileType, u16, u32) {
    match kind {
        Special::Fifo => (FileType::Fifo, 0o644, 0),
        Special::Socket => (FileType::Socket, 0o755, 0),
        Special::Char => (FileType::CharDevice, 0o600, rdev),
        Special::Block => (FileType::BlockDevice, 0o660, rdev),
    }
}

// ---------------------------------------------------------------------------------------
// The file system side

struct Harness {
    dev: Arc<MemDevice>,
    /// What the steps and the comparisons use: the file system itself, or (through
    /// FUSE) system calls on its mount.
    fs: Arc<dyn FileSystem>,
    module_fs: Loaded,
    mounted: Option<Mounted>,
    /// The namespace service over the module, when the steps go through it.
    served: Option<mds_service::Service>,
    mode: Module,
    cache: usize,
    /// statfs right after mkfs.
    files_free0: u64,
    blocks_free0: u64,
    /// The root directory's blocks right after mkfs (it may grow; directories never shrink).
    root_blocks0: u64,
    /// Readdir page size, varied from walk to walk.
    page: usize,
}

/// The module under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Module {
    Ext2(Mode),
    Betrfs,
}

impl fmt::Display for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Module::Ext2(m) => write!(f, "ext2 ({m})"),
            Module::Betrfs => write!(f, "betrfs"),
        }
    }
}

/// A mounted module.
#[derive(Clone)]
enum Loaded {
    Ext2(Arc<Ext2>),
    Betrfs(Arc<Betrfs>),
}

impl Loaded {
    fn open(module: Module, dev: Arc<MemDevice>, cache: usize) -> Result<Loaded, String> {
        Ok(match module {
            Module::Ext2(mode) => Loaded::Ext2(Arc::new(
                quilt_stack::ext2(
                    dev,
                    quilt_stack::Ext2Spec {
                        engine: engine_opts(cache),
                        mount: MountOptions {
                            mode,
                            read_only: false,
                            ..Default::default()
                        },
                        flusher: None,
                    },
                )
                .map_err(|e| format!("mount: {e}"))?,
            )),
            Module::Betrfs => Loaded::Betrfs(Arc::new(
                quilt_stack::betrfs(
                    dev,
                    quilt_betrfs::MountOptions {
                        commit_interval: None,
                        ..Default::default()
                    },
                )
                .map_err(|e| format!("mount: {e}"))?,
            )),
        })
    }

    fn fs(&self) -> Arc<dyn FileSystem> {
        match self {
            Loaded::Ext2(f) => f.clone(),
            Loaded::Betrfs(f) => f.clone(),
        }
    }

    fn unmount(&self) -> Result<(), String> {
        match self {
            Loaded::Ext2(f) => f.unmount(),
            Loaded::Betrfs(f) => f.unmount(),
        }
        .map_err(|e| format!("unmount: {e}"))
    }

    fn mount(&self) -> Result<(Mounted, MountFs), String> {
        match self {
            Loaded::Ext2(f) => Mounted::new(f.clone()),
            Loaded::Betrfs(f) => Mounted::new(f.clone()),
        }
    }
}

fn engine_opts(cache: usize) -> EngineOptions {
    EngineOptions {
        cache_bytes_max: cache,
        ..Default::default()
    }
}

/// A FUSE mount of the harness's file system in a temporary directory.
struct Mounted {
    session: Option<quilt_fuse::BackgroundSession>,
    /// Removed after the unmount (fields drop after `drop` runs).
    _dir: tempfile::TempDir,
}

impl Mounted {
    fn new<F: quilt_vfs::KernelFs + 'static>(fs: Arc<F>) -> Result<(Mounted, MountFs), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        // Requests come from the operations' users (uid 1000 too): the kernel refuses other
        // users' requests unless the mount admits everyone.
        let opts = quilt_fuse::FuseOptions {
            default_permissions: false,
            allow_other: true,
            ..Default::default()
        };
        let session = quilt_fuse::spawn(fs, dir.path(), &opts, Box::new(|| {}))
            .map_err(|e| format!("FUSE mount: {e}"))?;
        let mfs = MountFs::new(dir.path()).map_err(|e| format!("MountFs: {e}"))?;
        Ok((
            Mounted {
                session: Some(session),
                _dir: dir,
            },
            mfs,
        ))
    }

    /// Unmounts and waits for the session to end (the adapter lets go of the fs).
    fn unmount(&mut self) -> Result<(), String> {
        match self.session.take() {
            Some(s) => s
                .umount_and_join()
                .map_err(|e| format!("FUSE unmount: {e}")),
            None => Ok(()),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = self.unmount();
    }
}

/// Whether the harness drives the file system directly, through a FUSE mount, or
/// through the namespace service (two clients taking turns, call by call).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Native,
    Fuse,
    Mds,
}

/// The namespace service over `module_fs`, and two clients of it taking turns.
fn serve(module_fs: &Loaded) -> Result<(mds_service::Service, Arc<dyn FileSystem>), String> {
    let svc =
        mds_service::Service::start(module_fs.fs(), None, std::time::Duration::from_secs(30))?;
    let fs = mds_service::Alternating::new(svc.connect("model a"), svc.connect("model b"));
    Ok((svc, Arc::new(fs)))
}

impl Harness {
    fn new_via(blocks: u64, mode: Module, cache: usize, via: Via) -> Result<Harness, String> {
        let dev = Arc::new(MemDevice::new(BS as usize, blocks).map_err(|e| e.to_string())?);
        match mode {
            Module::Ext2(_) => {
                let engine = Engine::new(dev.clone(), engine_opts(cache));
                mkfs(
                    &engine,
                    &MkfsOptions {
                        device_is_zeroed: true,
                        ..Default::default()
                    },
                )
                .map_err(|e| format!("mkfs: {e}"))?;
            }
            Module::Betrfs => {
                quilt_betrfs::mkfs(dev.clone()).map_err(|e| format!("mkfs: {e}"))?;
            }
        }
        let module_fs = Loaded::open(mode, dev.clone(), cache)?;
        let mut served = None;
        let (fs, mounted): (Arc<dyn FileSystem>, _) = match via {
            Via::Native => (module_fs.fs(), None),
            Via::Fuse => {
                let (m, mfs) = module_fs.mount()?;
                (Arc::new(mfs), Some(m))
            }
            Via::Mds => {
                let (svc, fs) = serve(&module_fs)?;
                served = Some(svc);
                (fs, None)
            }
        };
        let sf = fs.statfs().map_err(|e| format!("statfs: {e}"))?;
        let root_blocks0 = fs
            .getattr(fs.root())
            .map_err(|e| format!("getattr: {e}"))?
            .blocks;
        Ok(Harness {
            dev,
            fs,
            module_fs,
            mounted,
            served,
            mode,
            cache,
            files_free0: sf.files_free,
            blocks_free0: sf.blocks_free,
            root_blocks0,
            page: 1,
        })
    }

    fn remount(&mut self) -> Result<(), String> {
        if let Some(m) = self.mounted.as_mut() {
            m.unmount()?;
        }
        if let Some(svc) = self.served.take() {
            // The clients go with the service (their lease renewals stop).
            self.fs = self.module_fs.fs();
            svc.stop()?;
            let (svc, fs) = {
                self.module_fs.unmount()?;
                let bytes = self.dev.to_vec();
                let dev = Arc::new(
                    MemDevice::from_bytes(BS as usize, &bytes).map_err(|e| e.to_string())?,
                );
                self.module_fs = Loaded::open(self.mode, dev.clone(), self.cache)?;
                self.dev = dev;
                serve(&self.module_fs)?
            };
            self.served = Some(svc);
            self.fs = fs;
            return Ok(());
        }
        self.module_fs.unmount()?;
        let bytes = self.dev.to_vec();
        let dev = Arc::new(MemDevice::from_bytes(BS as usize, &bytes).map_err(|e| e.to_string())?);
        self.module_fs = Loaded::open(self.mode, dev.clone(), self.cache)?;
        self.fs = match self.mounted.take() {
            None => self.module_fs.fs(),
            Some(_) => {
                let (m, mfs) = self.module_fs.mount()?;
                self.mounted = Some(m);
                Arc::new(mfs)
            }
        };
        self.dev = dev;
        Ok(())
    }

    fn resolve(&self, path: &[u8]) -> R<Ino> {
        let mut ino = self.fs.root();
        for &c in path {
            ino = self.fs.lookup(ino, name_of(c))?.ino;
        }
        Ok(ino)
    }

    /// The parent directory of the last component, checked to be a directory as the
    /// kernel's path walk does (for the two-path operations).
    fn dir_of(&self, p: &P) -> R<Ino> {
        let ino = self.resolve(p.parent())?;
        if self.fs.getattr(ino)?.kind != FileType::Directory {
            return Err(FsError::NotDir);
        }
        Ok(ino)
    }

    /// An attribute an operation returned must be what getattr says.
    fn check_returned(&self, a: &Attr, what: &str, problems: &mut Vec<String>) {
        match self.fs.getattr(a.ino) {
            Ok(g) => {
                if key(a) != key(&g) {
                    problems.push(format!(
                        "{what} returned {:?} but getattr says {:?}",
                        key(a),
                        key(&g)
                    ));
                }
            }
            Err(e) => problems.push(format!(
                "{what} returned inode {} but getattr fails: {e:?}",
                a.ino
            )),
        }
    }

    /// Runs one operation as the value every client of a module uses ([`FsOp`]), after a
    /// round trip through its serialised form: what reaches the module is what a
    /// message or a client journal would carry.
    fn run(&self, op: FsOp, who: &Ctx) -> Result<FsReply, FsError> {
        let wire = serde_json::to_vec(&op).expect("an operation serialises");
        let back: FsOp = serde_json::from_slice(&wire).expect("an operation deserialises");
        assert_eq!(back, op, "the serialised operation differs");
        back.apply(self.fs.as_ref(), who)
    }

    /// [`Harness::run`] of an operation that returns attributes.
    fn run_attr(&self, op: FsOp, who: &Ctx) -> Result<Attr, FsError> {
        match self.run(op, who)? {
            FsReply::Attr(a) => Ok(a),
            other => panic!("expected attributes, got {other:?}"),
        }
    }

    /// Runs `op` on the file system. Inconsistencies that are not a result (a short
    /// write, a returned attribute differing from getattr) go to `problems`.
    fn apply(&mut self, op: &Op, problems: &mut Vec<String>) -> R {
        let root = ctx(0);
        match op {
            Op::Create { path, perm, who } => {
                let d = self.resolve(path.parent())?;
                let a = self.run_attr(
                    FsOp::Mknod {
                        parent: d,
                        name: path.name().to_vec(),
                        mode: libc::S_IFREG | perm.0 as u32,
                        rdev: 0,
                        ino: None,
                    },
                    &ctx(*who),
                )?;
                self.check_returned(&a, "mknod", problems);
                Ok(())
            }
            Op::Mknod { path, kind, rdev } => {
                let d = self.resolve(path.parent())?;
                let (k, perm, rdev) = special(*kind, *rdev);
                let a = self.run_attr(
                    FsOp::Mknod {
                        parent: d,
                        name: path.name().to_vec(),
                        mode: k.mode_bits() | perm as u32,
                        rdev,
                        ino: None,
                    },
                    &root,
                )?;
                self.check_returned(&a, "mknod", problems);
                Ok(())
            }
            Op::Mkdir { path, perm, who } => {
                let d = self.resolve(path.parent())?;
                let a = self.run_attr(
                    FsOp::Mkdir {
                        parent: d,
                        name: path.name().to_vec(),
                        mode: perm.0 as u32,
                        ino: None,
                    },
                    &ctx(*who),
                )?;
                self.check_returned(&a, "mkdir", problems);
                Ok(())
            }
            Op::Symlink {
                path,
                len,
                seed,
                who,
            } => {
                let d = self.resolve(path.parent())?;
                let a = self.run_attr(
                    FsOp::Symlink {
                        parent: d,
                        name: path.name().to_vec(),
                        target: link_target(*len, *seed),
                        ino: None,
                    },
                    &ctx(*who),
                )?;
                self.check_returned(&a, "symlink", problems);
                Ok(())
            }
            Op::Unlink { path } => {
                let d = self.resolve(path.parent())?;
                self.run(
                    FsOp::Unlink {
                        parent: d,
                        name: path.name().to_vec(),
                    },
                    &root,
                )
                .map(drop)
            }
            Op::Rmdir { path } => {
                let d = self.resolve(path.parent())?;
                self.run(
                    FsOp::Rmdir {
                        parent: d,
                        name: path.name().to_vec(),
                    },
                    &root,
                )
                .map(drop)
            }
            Op::Rename { from, to, flags } => {
                let op = self.dir_of(from)?;
                let np = self.dir_of(to)?;
                let flags = RenameFlags {
                    noreplace: *flags == RFlags::NoReplace,
                    exchange: *flags == RFlags::Exchange,
                    whiteout: false,
                };
                self.run(
                    FsOp::Rename {
                        parent: op,
                        name: from.name().to_vec(),
                        new_parent: np,
                        new_name: to.name().to_vec(),
                        flags,
                    },
                    &root,
                )
                .map(drop)
            }
            Op::Link { from, to } => {
                let src = self.resolve(&from.0)?;
                let d = self.dir_of(to)?;
                let a = self.run_attr(
                    FsOp::Link {
                        ino: src,
                        new_parent: d,
                        new_name: to.name().to_vec(),
                    },
                    &root,
                )?;
                if a.ino != src {
                    problems.push(format!("link returned inode {} for inode {src}", a.ino));
                }
                self.check_returned(&a, "link", problems);
                Ok(())
            }
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => {
                let ino = self.resolve(&path.0)?;
                let r = self.run(
                    FsOp::Write {
                        ino,
                        offset: *offset,
                        data: pattern(*seed, *len),
                    },
                    &root,
                )?;
                match r {
                    FsReply::Written(n) if n as usize == *len => {}
                    other => problems.push(format!("write of {len} bytes reported {other:?}")),
                }
                Ok(())
            }
            Op::Truncate { path, size } => {
                let ino = self.resolve(&path.0)?;
                let a = self.run_attr(
                    FsOp::Setattr {
                        ino,
                        set: SetAttr {
                            size: Some(*size),
                            ..Default::default()
                        },
                    },
                    &root,
                )?;
                if a.size != *size {
                    problems.push(format!("setattr size {size} returned size {}", a.size));
                }
                self.check_returned(&a, "setattr(size)", problems);
                Ok(())
            }
            Op::Chmod { path, perm } => {
                let ino = self.resolve(&path.0)?;
                let a = self.run_attr(
                    FsOp::Setattr {
                        ino,
                        set: SetAttr {
                            mode: Some(perm.0 as u32),
                            ..Default::default()
                        },
                    },
                    &root,
                )?;
                if a.perm != perm.0 {
                    problems.push(format!(
                        "setattr mode {:o} returned perm {:o}",
                        perm.0, a.perm
                    ));
                }
                self.check_returned(&a, "setattr(mode)", problems);
                Ok(())
            }
            Op::SetXattr {
                path,
                name,
                len,
                seed,
                flag,
            } => {
                let ino = self.resolve(&path.0)?;
                let flags = XattrFlags {
                    create: *flag == XFlag::Create,
                    replace: *flag == XFlag::Replace,
                    ..Default::default()
                };
                self.run(
                    FsOp::Setxattr {
                        ino,
                        name: xname(*name).to_vec(),
                        value: pattern(*seed, *len),
                        flags,
                    },
                    &Ctx::root(),
                )
                .map(drop)
            }
            Op::RemoveXattr { path, name } => {
                let ino = self.resolve(&path.0)?;
                self.run(
                    FsOp::Removexattr {
                        ino,
                        name: xname(*name).to_vec(),
                    },
                    &Ctx::root(),
                )
                .map(drop)
            }
            Op::Fsync { path, datasync } => {
                let ino = self.resolve(&path.0)?;
                self.run(
                    FsOp::Fsync {
                        ino,
                        datasync: *datasync,
                    },
                    &root,
                )
                .map(drop)
            }
            Op::Fill { .. } => unreachable!("Fill runs as Create steps"),
            Op::SyncAll => self.run(FsOp::SyncAll, &root).map(drop),
            Op::Remount => {
                if let Err(e) = self.remount() {
                    problems.push(e);
                }
                Ok(())
            }
        }
    }

    /// All entries of a directory, read a few at a time through the cookies.
    fn list(&self, ino: Ino) -> Result<Vec<DirEntry>, String> {
        let page = self.page;
        let mut out: Vec<DirEntry> = Vec::new();
        let mut off = 0u64;
        for _ in 0..10_000 {
            let mut got = 0usize;
            let mut next = off;
            self.fs
                .readdir(ino, off, &mut |e| {
                    if got == page {
                        return false;
                    }
                    got += 1;
                    next = e.next_offset;
                    out.push(e);
                    true
                })
                .map_err(|e| format!("readdir({ino}, {off}): {e:?}"))?;
            if got < page {
                return Ok(out);
            }
            if next <= off {
                return Err(format!("readdir({ino}): cookie did not advance from {off}"));
            }
            off = next;
        }
        Err(format!("readdir({ino}) does not end"))
    }
}

/// The attributes the model predicts (times and block counts are not modelled).
fn key(a: &Attr) -> (Ino, FileType, u16, u32, u32, u32, u64, u32) {
    (a.ino, a.kind, a.perm, a.nlink, a.uid, a.gid, a.size, a.rdev)
}

fn errno_name(e: &R) -> String {
    match e {
        Ok(()) => "Ok".into(),
        Err(e) => {
            let n = match e.errno() {
                libc::ENOENT => "ENOENT",
                libc::EEXIST => "EEXIST",
                libc::ENOTDIR => "ENOTDIR",
                libc::EISDIR => "EISDIR",
                libc::ENOTEMPTY => "ENOTEMPTY",
                libc::EINVAL => "EINVAL",
                libc::EPERM => "EPERM",
                libc::ENODATA => "ENODATA",
                libc::ENOSPC => "ENOSPC",
                libc::EIO => "EIO",
                _ => "errno",
            };
            format!("Err({n}: {e:?})")
        }
    }
}

// ---------------------------------------------------------------------------------------
// Comparing the whole visible state

struct Walk<'a> {
    h: &'a Harness,
    m: &'a Model,
    to_ino: HashMap<Id, Ino>,
    to_id: HashMap<Ino, Id>,
}

impl Walk<'_> {
    fn map(&mut self, id: Id, ino: Ino, path: &str) -> Result<bool, String> {
        match (self.to_ino.get(&id), self.to_id.get(&ino)) {
            (None, None) => {
                self.to_ino.insert(id, ino);
                self.to_id.insert(ino, id);
                Ok(true)
            }
            (Some(&i), Some(&d)) if i == ino && d == id => Ok(false),
            (i, d) => Err(format!(
                "{path}: hard links disagree: model inode {id} ↔ fs inode {ino} (model inode already seen as fs {i:?}, fs inode already seen as model {d:?})"
            )),
        }
    }

    fn node(&mut self, id: Id, ino: Ino, path: &str) -> Result<(), String> {
        let fs = &self.h.fs;
        let n = self.m.n(id);
        let a = fs
            .getattr(ino)
            .map_err(|e| format!("{path}: getattr: {e:?}"))?;
        let nlink = self.m.nlink(id);
        let size = match n.kind {
            FileType::Regular | FileType::Symlink => Some(n.size),
            FileType::Directory => None,
            _ => Some(0),
        };
        if a.kind != n.kind
            || a.perm != n.perm
            || a.uid != n.uid
            || a.gid != n.gid
            || a.nlink != nlink
            || size.is_some_and(|s| s != a.size)
            || a.rdev != n.rdev
        {
            return Err(format!(
                "{path}: attributes differ:\n  expected kind {:?} perm {:o} uid {} gid {} nlink {} size {} rdev {:#x}\n  got      kind {:?} perm {:o} uid {} gid {} nlink {} size {} rdev {:#x}",
                n.kind, n.perm, n.uid, n.gid, nlink,
                size.map_or("(dir)".to_string(), |s| s.to_string()), n.rdev,
                a.kind, a.perm, a.uid, a.gid, a.nlink, a.size, a.rdev
            ));
        }
        if n.is_dir() && (a.size == 0 || a.size % BS != 0) {
            return Err(format!(
                "{path}: directory size {} is not whole blocks",
                a.size
            ));
        }
        match n.kind {
            FileType::Regular => self.contents(id, ino, path)?,
            FileType::Symlink => {
                let t = fs
                    .readlink(ino)
                    .map_err(|e| format!("{path}: readlink: {e:?}"))?;
                if t != n.target {
                    return Err(format!(
                        "{path}: symlink target differs:\n  expected {:?}\n  got      {:?}",
                        String::from_utf8_lossy(&n.target),
                        String::from_utf8_lossy(&t)
                    ));
                }
            }
            _ => {}
        }
        self.xattrs(id, ino, path)
    }

    fn contents(&self, id: Id, ino: Ino, path: &str) -> Result<(), String> {
        let fs = &self.h.fs;
        let n = self.m.n(id);
        let size = n.size;
        let read = |off: u64, len: u32| {
            fs.read(ino, off, len)
                .map_err(|e| format!("{path}: read({off}, {len}): {e:?}"))
        };
        if size <= FULL_COMPARE_MAX {
            let got = read(0, size as u32 + 4096)?;
            let want = self.m.read(id, 0, size);
            if got != want {
                return Err(diff_bytes(path, 0, &want, &got));
            }
        } else {
            let last = (size - 1) / BS;
            let mut blocks: BTreeSet<u64> = [
                0,
                1,
                last,
                last.saturating_sub(1),
                IND_START - 1,
                IND_START,
                DIND_START - 1,
                DIND_START,
                DIND_START + 1024,
                TIND_START - 1,
                TIND_START,
            ]
            .into_iter()
            .collect();
            for &b in n.chunks.keys() {
                blocks.extend([b.saturating_sub(1), b, b + 1]);
            }
            for b in blocks.into_iter().filter(|&b| b <= last) {
                let got = read(b * BS, BS as u32)?;
                let want = self.m.read(id, b * BS, BS);
                if got != want {
                    return Err(diff_bytes(path, b * BS, &want, &got));
                }
            }
        }
        let tail = read(size, 100)?;
        if !tail.is_empty() {
            return Err(format!(
                "{path}: read at EOF ({size}) returned {} bytes",
                tail.len()
            ));
        }
        Ok(())
    }

    fn xattrs(&self, id: Id, ino: Ino, path: &str) -> Result<(), String> {
        let fs = &self.h.fs;
        let n = self.m.n(id);
        let list = fs
            .listxattr(ino)
            .map_err(|e| format!("{path}: listxattr: {e:?}"))?;
        if !list.is_empty() && list.last() != Some(&0) {
            return Err(format!(
                "{path}: listxattr result is not NUL-terminated: {list:?}"
            ));
        }
        let names: Vec<Vec<u8>> = list
            .split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| s.to_vec())
            .collect();
        let got: BTreeSet<Vec<u8>> = names.iter().cloned().collect();
        let want: BTreeSet<Vec<u8>> = n.xattrs.keys().cloned().collect();
        if got != want || names.len() != got.len() {
            let s = |v: &BTreeSet<Vec<u8>>| {
                v.iter()
                    .map(|x| String::from_utf8_lossy(x).into_owned())
                    .collect::<Vec<_>>()
            };
            return Err(format!(
                "{path}: xattr names differ: expected {:?}, got {:?} (raw list {} names)",
                s(&want),
                s(&got),
                names.len()
            ));
        }
        for x in XNAMES {
            let x = x.as_bytes();
            let r = fs.getxattr(ino, x);
            match (n.xattrs.get(x), r) {
                (Some(v), Ok(g)) if *v == g => {}
                (None, Err(FsError::NoAttr)) => {}
                (v, r) => {
                    return Err(format!(
                        "{path}: getxattr {}: expected {}, got {}",
                        String::from_utf8_lossy(x),
                        v.map_or("ENODATA".to_string(), |v| format!("{} bytes", v.len())),
                        match r {
                            Ok(g) => format!(
                                "{} bytes{}",
                                g.len(),
                                if v.is_some_and(|v| v.len() == g.len()) {
                                    " (different)"
                                } else {
                                    ""
                                }
                            ),
                            Err(e) => format!("{e:?}"),
                        }
                    ))
                }
            }
        }
        Ok(())
    }

    fn dir(&mut self, id: Id, ino: Ino, parent_ino: Ino, path: &str) -> Result<(), String> {
        let entries = self.h.list(ino).map_err(|e| format!("{path}: {e}"))?;
        let mut dots = (0, 0);
        let mut got: BTreeMap<Vec<u8>, DirEntry> = BTreeMap::new();
        for e in entries {
            match &e.name[..] {
                b"." => {
                    dots.0 += 1;
                    if e.ino != ino {
                        return Err(format!(
                            "{path}: '.' names inode {} instead of {ino}",
                            e.ino
                        ));
                    }
                }
                b".." => {
                    dots.1 += 1;
                    if e.ino != parent_ino {
                        return Err(format!(
                            "{path}: '..' names inode {} instead of {parent_ino}",
                            e.ino
                        ));
                    }
                }
                _ => {
                    let name = e.name.clone();
                    if got.insert(name.clone(), e).is_some() {
                        return Err(format!(
                            "{path}: readdir lists {:?} twice",
                            String::from_utf8_lossy(&name)
                        ));
                    }
                }
            }
        }
        if dots != (1, 1) {
            return Err(format!(
                "{path}: readdir lists '.' {} times and '..' {} times",
                dots.0, dots.1
            ));
        }
        let n = self.m.n(id);
        let want: Vec<&Vec<u8>> = n.children.keys().collect();
        let have: Vec<&Vec<u8>> = got.keys().collect();
        if want != have {
            let s = |v: &[&Vec<u8>]| {
                v.iter()
                    .map(|x| String::from_utf8_lossy(x).into_owned())
                    .collect::<Vec<_>>()
            };
            return Err(format!(
                "{path}: entries differ: expected {:?}, got {:?}",
                s(&want),
                s(&have)
            ));
        }
        let children: Vec<(Vec<u8>, Id)> =
            n.children.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (name, cid) in children {
            let e = &got[&name];
            let cpath = format!(
                "{}/{}",
                path.trim_end_matches('/'),
                String::from_utf8_lossy(&name)
            );
            let l =
                self.h.fs.lookup(ino, &name).map_err(|err| {
                    format!("{cpath}: readdir lists it but lookup fails: {err:?}")
                })?;
            if l.ino != e.ino {
                return Err(format!(
                    "{cpath}: readdir says inode {}, lookup says {}",
                    e.ino, l.ino
                ));
            }
            if e.kind != self.m.n(cid).kind {
                return Err(format!(
                    "{cpath}: readdir type {:?}, expected {:?}",
                    e.kind,
                    self.m.n(cid).kind
                ));
            }
            if self.map(cid, e.ino, &cpath)? {
                self.node(cid, e.ino, &cpath)?;
                if self.m.is_dir(cid) {
                    self.dir(cid, e.ino, ino, &cpath)?;
                }
            }
        }
        Ok(())
    }
}

fn diff_bytes(path: &str, base: u64, want: &[u8], got: &[u8]) -> String {
    let first = want.iter().zip(got).position(|(a, b)| a != b);
    match first {
        Some(i) => format!(
            "{path}: contents differ at byte {} (expected {:#04x}, got {:#04x}; {} bytes expected, {} read)",
            base + i as u64,
            want[i],
            got[i],
            want.len(),
            got.len()
        ),
        None => format!("{path}: read at {base} returned {} bytes, expected {}", got.len(), want.len()),
    }
}

fn compare(h: &mut Harness, m: &Model) -> Result<(), String> {
    h.page = h.page % 3 + 1;
    let root = h.fs.root();
    let mut w = Walk {
        h: &*h,
        m,
        to_ino: HashMap::new(),
        to_id: HashMap::new(),
    };
    w.map(ROOT, root, "/")?;
    w.node(ROOT, root, "/")?;
    w.dir(ROOT, root, root, "/")?;
    // Every model inode was reached (the model has no orphans).
    if w.to_ino.len() != m.nodes.len() {
        return Err(format!(
            "walk reached {} inodes, the model has {}",
            w.to_ino.len(),
            m.nodes.len()
        ));
    }
    if h.mode == Module::Betrfs {
        // No inode table: statfs's inode counts follow free space, not files.
        return Ok(());
    }
    let sf = h.fs.statfs().map_err(|e| format!("statfs: {e:?}"))?;
    let want = h.files_free0 - (m.nodes.len() as u64 - 2);
    if sf.files_free != want {
        return Err(format!(
            "statfs: {} free inodes, expected {want} ({} in use besides root and lost+found)",
            sf.files_free,
            m.nodes.len() - 2
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Running sequences

/// One step: the model decides (or skips), the file system runs, results compare.
fn step(h: &mut Harness, m: &mut Model, op: &Op) -> Result<(), String> {
    let Some(want) = m.apply(op) else {
        return Ok(());
    };
    let mut problems = Vec::new();
    let got = h.apply(op, &mut problems);
    let same = match (&want, &got) {
        (Ok(()), Ok(())) => true,
        (Err(a), Err(b)) => a.errno() == b.errno(),
        _ => false,
    };
    if !same {
        problems.insert(
            0,
            format!("expected {}, got {}", errno_name(&want), errno_name(&got)),
        );
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Removes every name the model has (deepest first), then checks that the free block
/// and inode counts are back to their values after mkfs (but for blocks the root
/// directory gained), before and after a remount.
fn teardown(h: &mut Harness, m: &mut Model) -> Result<(), String> {
    let mut paths = m.paths(usize::MAX);
    paths.sort_by_key(|(p, _)| std::cmp::Reverse(p.0.len()));
    for (p, dir) in paths {
        let op = if dir {
            Op::Rmdir { path: p }
        } else {
            Op::Unlink { path: p }
        };
        step(h, m, &op).map_err(|e| format!("teardown {op:?} ⇒ {e}"))?;
    }
    for pass in ["", " after a remount"] {
        if !pass.is_empty() {
            h.remount()?;
        }
        compare(h, m).map_err(|e| format!("after teardown{pass}: {e}"))?;
        if let Loaded::Betrfs(b) = &h.module_fs {
            // Nothing may be left in the tree but the superblock record, the root and
            // lost+found: no data, inode, orphan or intent of a removed file.
            // (Through the namespace service, its own directory and registry stay.)
            let own = |k: &[u8]| h.served.is_some() && k.windows(12).any(|w| w == b".quiltfs-mds");
            let keys: Vec<Vec<u8>> = b
                .tree()
                .range(b"", None)
                .map(|kv| kv.map(|(k, _)| k))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("scan: {e}"))?
                .into_iter()
                .filter(|k| !own(k))
                .collect();
            if keys.len() != 3 {
                return Err(format!(
                    "leak after removing everything{pass}: the tree holds {} keys: {:?}",
                    keys.len(),
                    keys.iter().take(8).collect::<Vec<_>>()
                ));
            }
            continue;
        }
        let sf = h.fs.statfs().map_err(|e| format!("statfs: {e:?}"))?;
        let root =
            h.fs.getattr(h.fs.root())
                .map_err(|e| format!("getattr(root): {e:?}"))?;
        let grown = root.blocks.saturating_sub(h.root_blocks0) / (BS / 512);
        if sf.blocks_free + grown != h.blocks_free0 || sf.files_free != h.files_free0 {
            return Err(format!(
                "leak after removing everything{pass}: {} free blocks (the root directory grew by {grown}) and {} free inodes; {} and {} after mkfs",
                sf.blocks_free, sf.files_free, h.blocks_free0, h.files_free0
            ));
        }
    }
    Ok(())
}

/// What kind of failure a message reports, for the minimizer: the operation's variant
/// and the message without step numbers, paths and counts.
fn signature(e: &str) -> String {
    let (head, rest) = e.split_once(" ⇒ ").unwrap_or(("", e));
    let variant = head
        .split(['{', ' '])
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
        .unwrap_or(head);
    let rest = if rest.starts_with("expected") {
        rest.to_string()
    } else {
        rest.split_once(": ")
            .map_or(rest, |(_, r)| r)
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .take(30)
            .collect()
    };
    format!("{variant}|{rest}")
}

fn listing(ops: &[Op]) -> String {
    ops.iter()
        .enumerate()
        .map(|(i, op)| format!("  {i:3}: {op:?}\n"))
        .collect()
}

/// A failed run: what went wrong, and the operations run (paths resolved), the failing
/// one last.
#[derive(Debug)]
struct Failure {
    msg: String,
    ops: Vec<Op>,
}

/// Runs `specs` from a fresh file system, comparing after every step, then tears down.
fn run(specs: &[Op<PS>], mode: Module, cache: usize, blocks: u64) -> Result<(), Failure> {
    run_via(specs, mode, cache, blocks, Via::Native, 1)
}

/// `run`, through `via`, comparing the whole state after every `compare_every`-th
/// operation (and after the last); every result is compared regardless.
fn run_via(
    specs: &[Op<PS>],
    mode: Module,
    cache: usize,
    blocks: u64,
    via: Via,
    compare_every: usize,
) -> Result<(), Failure> {
    let mut ops = Vec::new();
    let fail = |msg: String, ops: &Vec<Op>| Failure {
        msg,
        ops: ops.clone(),
    };
    let mut h = Harness::new_via(blocks, mode, cache, via).map_err(|e| fail(e, &ops))?;
    let mut m = Model::new();
    compare(&mut h, &m).map_err(|e| fail(format!("after mkfs: {e}"), &ops))?;
    for (k, spec) in specs.iter().enumerate() {
        let group = expand(spec.clone().map(|ps| m.resolve_spec(ps)));
        let last = group.last().cloned();
        for op in group {
            let i = ops.len();
            ops.push(op.clone());
            guarded(|| step(&mut h, &mut m, &op))
                .map_err(|e| fail(format!("step {i} {op:?} ⇒ {e}"), &ops))?;
        }
        let due = k % compare_every == compare_every - 1 || k == specs.len() - 1;
        if let (Some(op), true) = (last, due) {
            let i = ops.len() - 1;
            guarded(|| compare(&mut h, &m))
                .map_err(|e| fail(format!("after step {i} {op:?} ⇒ {e}"), &ops))?;
        }
    }
    guarded(|| teardown(&mut h, &mut m)).map_err(|e| fail(e, &ops))
}

/// Runs `f`, turning a panic (in the file system or the harness) into an error.
fn guarded(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "panicked: {}",
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default()
        )),
    }
}

/// The steps of an operation: `Fill` becomes its creates.
fn expand(op: Op) -> Vec<Op> {
    match op {
        Op::Fill { dir, from, count } => (0..count)
            .map(|k| {
                let mut q = dir.0.clone();
                q.push(NAMES.len() as u8 + (from.wrapping_add(k)) % LONG_NAMES);
                Op::Create {
                    path: P(q),
                    perm: Perm(0o644),
                    who: 0,
                }
            })
            .collect(),
        op => vec![op],
    }
}

fn literal(ops: &[Op]) -> Vec<Op<PS>> {
    ops.iter().map(|op| op.clone().map(PS::Lit)).collect()
}

fn cases() -> u32 {
    if let Ok(n) = std::env::var("QUILT_PROPTEST_CASES") {
        return n.parse().expect("QUILT_PROPTEST_CASES must be a number");
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        300
    } else {
        2_000
    }
}

/// 16 MiB: room for every case, cheap to copy at a remount.
const CASE_BLOCKS: u64 = 4096;

/// The property test. It drives proptest's runner itself so that, after proptest has
/// shrunk a failure, the report can also list the minimal case's operations with their
/// paths resolved, shrunk further by dropping steps (`minimize`).
#[test]
fn ext2_agrees_with_the_posix_model() {
    agrees_with_the_posix_model(|soft_updates| {
        Module::Ext2(if soft_updates {
            Mode::SoftUpdates
        } else {
            Mode::Async
        })
    });
}

#[test]
fn betrfs_agrees_with_the_posix_model() {
    agrees_with_the_posix_model(|_| Module::Betrfs);
}

/// The property test for the module `pick` chooses (given a coin it may use to choose a
/// mode). It drives proptest's runner itself so that, after proptest has shrunk a
/// failure, the report can also list the minimal case's operations with their paths
/// resolved, shrunk further by dropping steps (`minimize`).
fn agrees_with_the_posix_model(pick: fn(bool) -> Module) {
    let config = Config {
        cases: cases(),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..Config::default()
    };
    let strategy = (
        any::<bool>(),
        prop::bool::weighted(0.25),
        prop::collection::vec(op_s(), 1..=60),
    );
    let setup = |coin: bool, small_cache: bool| {
        let cache = if small_cache { 96 << 10 } else { 8 << 20 };
        (pick(coin), cache)
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |(coin, small_cache, specs)| {
        let (mode, cache) = setup(coin, small_cache);
        match run(&specs, mode, cache, CASE_BLOCKS) {
            Ok(()) => Ok(()),
            Err(f) => Err(TestCaseError::fail(f.msg)),
        }
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, (coin, small_cache, specs))) => {
            let (mode, cache) = setup(coin, small_cache);
            let f =
                run(&specs, mode, cache, CASE_BLOCKS).expect_err("the minimal case fails again");
            let small = minimize(f.ops.clone(), &f.msg, mode, cache, CASE_BLOCKS, 60);
            let again = run(&literal(&small), mode, cache, CASE_BLOCKS)
                .err()
                .map_or(String::new(), |f| f.msg);
            panic!(
                "{reason}\nmodule {mode}, cache {cache} bytes\n\
                 proptest's minimal case, with its paths resolved ({} steps):\n{}\n\
                 dropping steps while the failure stays the same leaves {} steps, which fail with:\n{again}\n{}",
                f.ops.len(),
                listing(&f.ops),
                small.len(),
                listing(&small)
            );
        }
        Err(e) => panic!("{e}"),
    }
}

// ---------------------------------------------------------------------------------------
// Thousands of operations in one file system

/// Shrinks a failing sequence by dropping chunks of it while it still fails the same way
/// (within a time bound), for the report.
fn minimize(
    mut ops: Vec<Op>,
    failure: &str,
    mode: Module,
    cache: usize,
    blocks: u64,
    seconds: u64,
) -> Vec<Op> {
    let want = signature(failure);
    let start = std::time::Instant::now();
    let mut chunk = ops.len() / 2;
    while chunk >= 1 && start.elapsed().as_secs() < seconds {
        let mut i = 0;
        while i < ops.len() && start.elapsed().as_secs() < seconds {
            let mut trial = ops.clone();
            trial.drain(i..(i + chunk).min(ops.len()));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(&literal(&trial), mode, cache, blocks)
            }));
            match r {
                Ok(Err(f)) if signature(&f.msg) == want => ops = f.ops,
                _ => i += chunk,
            }
        }
        chunk /= 2;
    }
    ops
}

/// The seeded sequence of `thousands_of_random_operations`, replayed through the FUSE
/// adapter and the kernel: every operation becomes the system call a program would make
/// on the mount (creates as the operation's user, with its umask), and after every step
/// the mount's whole visible state is compared with the model, as natively.
#[test]
fn thousands_of_random_operations_through_fuse() {
    through_fuse(&[Module::Ext2(Mode::SoftUpdates), Module::Ext2(Mode::Async)]);
}

#[test]
fn betrfs_thousands_of_random_operations_through_fuse() {
    through_fuse(&[Module::Betrfs]);
}

fn through_fuse(modules: &[Module]) {
    if !fuse_available() {
        return;
    }
    let specs = seeded_specs();
    // Walking the whole mount costs thousands of system calls: under CI the state is
    // compared after every tenth operation (results after every one).
    let every = if std::env::var("CI").is_ok_and(|v| v == "true") {
        10
    } else {
        1
    };
    for &mode in modules {
        let t = std::time::Instant::now();
        let r = run_via(&specs, mode, 1 << 20, 16_384, Via::Fuse, every);
        eprintln!(
            "through FUSE ({mode}): {} operations, state compared every {every}, {:.1?}",
            specs.len(),
            t.elapsed()
        );
        if let Err(f) = r {
            let native = run(&literal(&f.ops), mode, 1 << 20, 16_384)
                .err()
                .map_or("passes".to_string(), |n| format!("fails too: {}", n.msg));
            let tail = f.ops.len().saturating_sub(15);
            panic!(
                "through FUSE ({mode}): {}\n(after {} operations; natively the same operations {native})\nlast operations:\n{}",
                f.msg,
                f.ops.len(),
                listing(&f.ops[tail..])
            );
        }
    }
}

/// The seeded sequence through the namespace service (Cudele) in strong mode: every
/// call a request, the two clients taking turns, the whole visible state compared with
/// the model after every operation (under CI: the first 500, after every tenth), the
/// service restarted with the module at each remount.
#[test]
fn thousands_of_random_operations_through_the_namespace_service() {
    // Every call is a request (and every change a sync, under the default policy's
    // global durability): under CI the first 500 operations, compared every tenth.
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let every = if ci { 10 } else { 1 };
    let mut specs = seeded_specs();
    if ci {
        specs.truncate(500);
    }
    for mode in [Module::Ext2(Mode::SoftUpdates), Module::Betrfs] {
        let t = std::time::Instant::now();
        let r = run_via(&specs, mode, 1 << 20, 16_384, Via::Mds, every);
        eprintln!(
            "through the namespace service ({mode}): {} operations, state compared every \
             {every}, {:.1?}",
            specs.len(),
            t.elapsed()
        );
        if let Err(f) = r {
            let tail = f.ops.len().saturating_sub(15);
            panic!(
                "through the namespace service ({mode}): {}\n(after {} operations)\nlast \
                 operations:\n{}",
                f.msg,
                f.ops.len(),
                listing(&f.ops[tail..])
            );
        }
    }
}

fn seeded_specs() -> Vec<Op<PS>> {
    const OPS: usize = 2_000;
    const SEED: [u8; 16] = *b"quiltfs-ext2-mdl";
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::XorShift, &SEED),
    );
    (0..OPS)
        .map(|_| op_s().new_tree(&mut runner).expect("strategy").current())
        .collect()
}

/// One seeded sequence of 2,000 operations (drawn from the same distribution as the
/// property test, by a xorshift generator with a fixed seed) in one 64 MiB file system,
/// compared after every step.
#[test]
fn thousands_of_random_operations() {
    thousands(Module::Ext2(Mode::SoftUpdates));
}

#[test]
fn betrfs_thousands_of_random_operations() {
    thousands(Module::Betrfs);
}

fn thousands(mode: Module) {
    let cache = 1 << 20;
    let blocks = 16_384;
    let specs = seeded_specs();
    if let Err(f) = run(&specs, mode, cache, blocks) {
        let total = f.ops.len();
        let small = minimize(f.ops, &f.msg, mode, cache, blocks, 120);
        let again = run(&literal(&small), mode, cache, blocks)
            .err()
            .map_or(String::new(), |f| f.msg);
        panic!(
            "{}\n(after {total} operations; mode {mode}, cache {cache})\n\
             minimized to {} operations, which fail with: {again}\n{}",
            f.msg,
            small.len(),
            listing(&small)
        );
    }
}
