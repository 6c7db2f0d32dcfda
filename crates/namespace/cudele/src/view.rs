//! A decoupled subtree as a file system ([`DecoupledFs`]): what a FUSE mount of a weak
//! or invisible subtree serves, and what a program linking the library can use in
//! place of the lower-level [`Decoupled`].
//!
//! **What it answers from.** The client's own view: the service's subtree as it was
//! when the client first changed each directory, with the client's changes on top.
//! A directory the client never changed is read from the service (a lookup or a
//! listing is a request); the first change to one lists it once (`adopt`), and from
//! then on the client answers for it alone. Every change appends one event to the
//! client's journal (Append Client Journal) and updates the view; nothing is asked of
//! anyone, so a create costs what a hash-map insert and a journal append cost.
//!
//! **File data.** A file the client created has no place at the service before a
//! merge makes it, so its data rides in the journal (`FsOp::Write` events, at most
//! 1 MiB each; the merge applies them after the batch that made the file) and is kept
//! here to be read back, up to [`DATA_LIMIT`] bytes per session (then ENOSPC, with a
//! message: sync or release the subtree). Files that existed before are read and
//! written at the service directly: data is not namespace metadata (Cudele's clients
//! wrote object data to RADOS the same way).
//!
//! **Errors** are the ones the module would give for the same call on the same
//! namespace (ENOENT, EEXIST, ENOTEMPTY, EISDIR, EINVAL for a directory moved into
//! itself), checked here before the event is appended, so a journal the view
//! accepted is one the merge accepts, unless another client changed the subtree
//! meanwhile (`interfere=allow`: the documented conflict rule).

use crate::client::{Client, DecoupleOptions, Decoupled, RemoteFs, Synced};
use crate::policy::Policy;
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, FsOp, Ino, RenameFlags, Result, SetAttr,
    StatFs, TimeOrNow, Timespec, XattrFlags,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// File data of new files one session keeps (and journals) before refusing more.
pub const DATA_LIMIT: u64 = 128 << 20;

/// What the view holds of an inode it touched.
struct Node {
    attr: Attr,
    /// Made in this session: its data, target and attributes are all here.
    ours: bool,
    target: Vec<u8>,
    data: Vec<u8>,
    /// Extended attributes: for a new inode all of them; for an older one the changes
    /// (`None`: removed).
    xattrs: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

/// A directory the client changed (or made): all its entries, with listing cookies
/// that stay valid while entries come and go.
struct Dir {
    parent: Ino,
    entries: BTreeMap<Vec<u8>, (Ino, FileType, u64)>,
    by_cookie: BTreeMap<u64, Vec<u8>>,
    next_cookie: u64,
}

impl Dir {
    fn new(parent: Ino) -> Dir {
        Dir {
            parent,
            entries: BTreeMap::new(),
            by_cookie: BTreeMap::new(),
            // 1 and 2 are `.` and `..`.
            next_cookie: 3,
        }
    }

    fn insert(&mut self, name: &[u8], ino: Ino, kind: FileType) {
        if let Some((_, _, c)) = self.entries.remove(name) {
            self.by_cookie.remove(&c);
        }
        let c = self.next_cookie;
        self.next_cookie += 1;
        self.entries.insert(name.to_vec(), (ino, kind, c));
        self.by_cookie.insert(c, name.to_vec());
    }

    fn remove(&mut self, name: &[u8]) -> Option<(Ino, FileType)> {
        let (ino, kind, c) = self.entries.remove(name)?;
        self.by_cookie.remove(&c);
        Some((ino, kind))
    }

    fn get(&self, name: &[u8]) -> Option<(Ino, FileType)> {
        self.entries.get(name).map(|e| (e.0, e.1))
    }
}

#[derive(Default)]
struct View {
    nodes: HashMap<Ino, Node>,
    dirs: HashMap<Ino, Dir>,
    /// Bytes of new files' data held.
    data: u64,
    /// A name each older non-directory was met by (the merge reaches those by name).
    seen: HashMap<Ino, (Ino, Vec<u8>)>,
    /// Inodes the journal already reached: created, renamed, or witnessed.
    witnessed: HashSet<Ino>,
}

impl View {
    fn node(&mut self, ino: Ino) -> Result<&mut Node> {
        self.nodes
            .get_mut(&ino)
            .ok_or(FsError::Io("an inode the view lost".into()))
    }

    fn dir(&mut self, ino: Ino) -> Result<&mut Dir> {
        self.dirs.get_mut(&ino).ok_or(FsError::NotDir)
    }

    /// The parent directory's times and link count after an entry came or went.
    fn touch_dir(&mut self, dir: Ino, links: i64) -> Result<()> {
        let now = Timespec::now();
        let a = &mut self.node(dir)?.attr;
        a.mtime = now;
        a.ctime = now;
        a.nlink = (i64::from(a.nlink) + links).max(0) as u32;
        Ok(())
    }
}

/// A decoupled subtree, served from the client's view (module docs).
pub struct DecoupledFs {
    base: RemoteFs,
    d: Mutex<Option<Decoupled>>,
    v: Mutex<View>,
    /// Changes one at a time: a change may first read the service (outside the view's
    /// lock), and nothing may change what it read before it is done.
    writer: Mutex<()>,
    root: Ino,
}

fn valid_name(name: &[u8]) -> Result<()> {
    if name.len() > 255 {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(FsError::Invalid(
            "a name that is empty, . or .., or holds '/'",
        ));
    }
    Ok(())
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn blocks(size: u64) -> u64 {
    size.div_ceil(4096) * 8
}

impl DecoupledFs {
    /// Decouples the subtree at `subtree` for `client` and serves it.
    pub fn open(client: Arc<Client>, subtree: Ino, opts: DecoupleOptions) -> Result<DecoupledFs> {
        let d = client.decouple(subtree, opts)?;
        Ok(DecoupledFs {
            base: RemoteFs::at(client, subtree),
            d: Mutex::new(Some(d)),
            v: Mutex::new(View::default()),
            writer: Mutex::new(()),
            root: subtree,
        })
    }

    pub fn policy(&self) -> Result<Policy> {
        self.with(|d| Ok(d.policy()))
    }

    fn with<T>(&self, f: impl FnOnce(&Decoupled) -> Result<T>) -> Result<T> {
        match &*locked(&self.d) {
            Some(d) => f(d),
            None => Err(FsError::Invalid("the subtree was released")),
        }
    }

    /// Appends a name or attribute change to the journal.
    fn journal(&self, ctx: &Ctx, op: FsOp) -> Result<()> {
        self.with(|d| d.change(ctx, op)).map(|_| ())
    }

    /// Persists and merges what was appended, as the policy says.
    pub fn sync(&self) -> Result<Synced> {
        self.with(|d| d.sync())
    }

    /// Events appended so far.
    pub fn appended(&self) -> Result<u64> {
        self.with(|d| Ok(d.appended()))
    }

    /// The last sync as the policy says, then the hold goes. Later calls fail.
    pub fn release(&self) -> Result<Synced> {
        let d = locked(&self.d).take();
        match d {
            Some(d) => d.release(),
            None => Ok(Synced::default()),
        }
    }

    /// The inode's attributes, from the view or the service.
    fn attr(&self, ino: Ino) -> Result<Attr> {
        if let Some(n) = locked(&self.v).nodes.get(&ino) {
            return Ok(n.attr);
        }
        self.base.getattr(ino)
    }

    /// Makes sure the view holds `ino` (copied from the service when it is older).
    fn ensure(&self, ino: Ino) -> Result<()> {
        if locked(&self.v).nodes.contains_key(&ino) {
            return Ok(());
        }
        let a = self.base.getattr(ino)?;
        locked(&self.v).nodes.entry(ino).or_insert(Node {
            attr: a,
            ours: false,
            target: Vec::new(),
            data: Vec::new(),
            xattrs: BTreeMap::new(),
        });
        Ok(())
    }

    fn met(&self, parent: Ino, name: &[u8], ino: Ino, kind: FileType) {
        if kind != FileType::Directory {
            let mut v = locked(&self.v);
            if !v.witnessed.contains(&ino) {
                v.seen.entry(ino).or_insert_with(|| (parent, name.to_vec()));
            }
        }
    }

    /// Before an event names an older non-directory by number: a witness event naming
    /// it by a name it has now, once.
    fn witness(&self, ino: Ino, ctx: &Ctx) -> Result<()> {
        let found = {
            let v = locked(&self.v);
            let n = v.nodes.get(&ino);
            if v.witnessed.contains(&ino)
                || n.is_some_and(|n| n.ours || n.attr.kind == FileType::Directory)
            {
                return Ok(());
            }
            let named = |p: &Ino, name: &[u8]| {
                v.dirs
                    .get(p)
                    .is_some_and(|d| d.get(name).is_some_and(|e| e.0 == ino))
            };
            match v.seen.get(&ino) {
                Some((p, name)) if named(p, name) => Some((*p, name.clone())),
                Some((p, _)) if v.dirs.contains_key(p) => None,
                Some((p, name)) => Some((*p, name.clone())),
                None => None,
            }
            .or_else(|| {
                v.dirs.iter().find_map(|(p, d)| {
                    d.entries
                        .iter()
                        .find(|(_, e)| e.0 == ino)
                        .map(|(n, _)| (*p, n.clone()))
                })
            })
        };
        let Some((parent, name)) = found else {
            return Err(FsError::Invalid(
                "an older file changed by number that no name here reaches",
            ));
        };
        self.with(|d| Ok(d.witness(ctx, parent, &name)))?;
        let mut v = locked(&self.v);
        v.witnessed.insert(ino);
        v.seen.remove(&ino);
        Ok(())
    }

    /// Makes the view answer for directory `dir` alone: its entries listed once.
    fn adopt(&self, dir: Ino) -> Result<()> {
        if locked(&self.v).dirs.contains_key(&dir) {
            return Ok(());
        }
        self.ensure(dir)?;
        if locked(&self.v).nodes[&dir].attr.kind != FileType::Directory {
            return Err(FsError::NotDir);
        }
        let mut d = Dir::new(0);
        self.base.readdir(dir, 0, &mut |e| {
            if e.name == b".." {
                d.parent = e.ino;
            } else if e.name != b"." {
                d.insert(&e.name, e.ino, e.kind);
            }
            true
        })?;
        let mut v = locked(&self.v);
        if !v.dirs.contains_key(&dir) {
            for (name, (ino, kind, _)) in &d.entries {
                if *kind != FileType::Directory && !v.witnessed.contains(ino) {
                    v.seen.entry(*ino).or_insert_with(|| (dir, name.clone()));
                }
            }
            v.dirs.insert(dir, d);
        }
        Ok(())
    }

    /// What `name` in `dir` names now.
    fn entry(&self, dir: Ino, name: &[u8]) -> Result<Option<(Ino, FileType)>> {
        if let Some(d) = locked(&self.v).dirs.get(&dir) {
            return Ok(d.get(name));
        }
        match self.base.lookup(dir, name) {
            Ok(a) => Ok(Some((a.ino, a.kind))),
            Err(FsError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A directory names are added to or removed from (adopted). Permissions are the
    /// caller's to check, as for every module: the kernel does (default_permissions),
    /// and the merge checks each event's credentials again.
    fn writable_dir(&self, dir: Ino) -> Result<Attr> {
        self.adopt(dir)?;
        Ok(locked(&self.v).nodes[&dir].attr)
    }

    /// A new inode in the view, named `name` in `parent`.
    fn made(&self, parent: Ino, name: &[u8], attr: Attr, target: Vec<u8>) -> Result<Attr> {
        let mut v = locked(&self.v);
        let dir = attr.kind == FileType::Directory;
        v.dir(parent)?.insert(name, attr.ino, attr.kind);
        v.touch_dir(parent, if dir { 1 } else { 0 })?;
        if dir {
            v.dirs.insert(attr.ino, Dir::new(parent));
        }
        v.nodes.insert(
            attr.ino,
            Node {
                attr,
                ours: true,
                target,
                data: Vec::new(),
                xattrs: BTreeMap::new(),
            },
        );
        Ok(attr)
    }

    fn new_attr(&self, ino: Ino, kind: FileType, mode: u32, ctx: &Ctx, parent: &Attr) -> Attr {
        let now = Timespec::now();
        // A directory with the set-group-ID bit passes its group on (and the bit to new
        // directories).
        let gid = if parent.perm & 0o2000 != 0 {
            parent.gid
        } else {
            ctx.gid
        };
        let mut perm = (mode & 0o7777 & !ctx.umask) as u16;
        if kind == FileType::Directory && parent.perm & 0o2000 != 0 {
            perm |= 0o2000;
        }
        Attr {
            ino,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: ctx.uid,
            gid,
            size: if kind == FileType::Directory { 4096 } else { 0 },
            blocks: if kind == FileType::Directory { 8 } else { 0 },
            atime: now,
            mtime: now,
            ctime: now,
            rdev: 0,
            blksize: 4096,
        }
    }

    /// Refuses a creation whose name is taken.
    fn free_name(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        valid_name(name)?;
        let p = self.writable_dir(parent)?;
        if self.entry(parent, name)?.is_some() {
            return Err(FsError::Exists);
        }
        Ok(p)
    }

    /// Walks up from `dir` to the subtree's root: whether `ancestor` is on the way.
    fn below(&self, dir: Ino, ancestor: Ino) -> Result<bool> {
        let mut d = dir;
        for _ in 0..4096 {
            if d == ancestor {
                return Ok(true);
            }
            if d == self.root {
                return Ok(false);
            }
            let up = locked(&self.v).dirs.get(&d).map(|x| x.parent);
            d = match up {
                Some(p) => p,
                None => self.base.lookup(d, b"..")?.ino,
            };
        }
        Err(FsError::Io(
            "a directory loop above a rename's target".into(),
        ))
    }

    /// Whether directory `dir` (adopted) holds no entries.
    fn empty(&self, dir: Ino) -> Result<bool> {
        self.adopt(dir)?;
        Ok(locked(&self.v).dirs[&dir].entries.is_empty())
    }

    /// A file's size and times after the service changed its data.
    fn refresh(&self, ino: Ino) -> Result<()> {
        if !locked(&self.v).nodes.contains_key(&ino) {
            return Ok(());
        }
        let a = self.base.getattr(ino)?;
        if let Some(n) = locked(&self.v).nodes.get_mut(&ino) {
            n.attr.size = a.size;
            n.attr.blocks = a.blocks;
            n.attr.mtime = a.mtime;
            n.attr.ctime = a.ctime;
        }
        Ok(())
    }

    fn is_ours(&self, ino: Ino) -> bool {
        locked(&self.v).nodes.get(&ino).is_some_and(|n| n.ours)
    }
}

fn at(t: TimeOrNow) -> Timespec {
    t.resolve()
}

impl FileSystem for DecoupledFs {
    fn root(&self) -> Ino {
        self.root
    }

    /// An older file's handle is the service's, so that it outlives an unlink this
    /// view's journal merges; a file made here lives in the view.
    fn open(&self, ino: Ino) -> Result<()> {
        if self.is_ours(ino) {
            return Ok(());
        }
        self.base.open(ino)
    }

    fn release(&self, ino: Ino) -> Result<()> {
        if self.is_ours(ino) {
            return Ok(());
        }
        self.base.release(ino)
    }

    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        if name == b"." {
            return self.getattr(parent);
        }
        if name == b".." {
            let up = locked(&self.v).dirs.get(&parent).map(|d| d.parent);
            return match up {
                Some(p) => self.getattr(p),
                None => self.base.lookup(parent, name),
            };
        }
        let known = {
            let v = locked(&self.v);
            match (v.dirs.get(&parent), v.nodes.get(&parent)) {
                (Some(d), _) => Some(d.get(name)),
                (None, Some(n)) if n.attr.kind != FileType::Directory => {
                    return Err(FsError::NotDir)
                }
                // A directory removed here, or made here and never listed.
                (None, Some(n)) if n.ours || n.attr.nlink == 0 => Some(None),
                _ => None,
            }
        };
        match known {
            Some(Some((ino, _))) => self.getattr(ino),
            Some(None) => Err(FsError::NotFound),
            None => {
                let a = self.base.lookup(parent, name)?;
                self.met(parent, name, a.ino, a.kind);
                Ok(a)
            }
        }
    }

    fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.attr(ino)
    }

    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr> {
        let _w = locked(&self.writer);
        self.ensure(ino)?;
        let (a, ours) = {
            let v = locked(&self.v);
            let n = &v.nodes[&ino];
            (n.attr, n.ours)
        };
        if set.size.is_some() && a.kind == FileType::Directory {
            return Err(FsError::IsDir);
        }
        let mut rest = set;
        if let Some(size) = set.size {
            if a.kind != FileType::Regular {
                return Err(FsError::Invalid("a size for what is not a regular file"));
            }
            if ours {
                {
                    let mut v = locked(&self.v);
                    let held = v.data;
                    let n = v.node(ino)?;
                    let old = n.data.len() as u64;
                    if size > old && held + (size - old) > DATA_LIMIT {
                        return Err(too_much());
                    }
                    n.data.resize(size as usize, 0);
                    v.data = (held + size).saturating_sub(old);
                }
                self.with(|d| d.truncate(ctx, ino, set))?;
                rest = SetAttr::default();
            } else {
                // Data of an older file: at the service.
                self.base.setattr(
                    ino,
                    SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    },
                    ctx,
                )?;
                self.refresh(ino)?;
                rest.size = None;
            }
        }
        let changes_more = rest != SetAttr::default();
        if changes_more {
            self.witness(ino, ctx)?;
            self.with(|d| d.change(ctx, FsOp::Setattr { ino, set: rest }))?;
        }
        let mut v = locked(&self.v);
        let n = v.node(ino)?;
        let now = Timespec::now();
        if let Some(m) = set.mode {
            n.attr.perm = (m & 0o7777) as u16;
        }
        if let Some(u) = set.uid {
            n.attr.uid = u;
        }
        if let Some(g) = set.gid {
            n.attr.gid = g;
        }
        if let Some(t) = set.atime {
            n.attr.atime = at(t);
        }
        if let Some(t) = set.mtime {
            n.attr.mtime = at(t);
        }
        if let Some(size) = set.size {
            n.attr.size = size;
            n.attr.blocks = blocks(size);
            n.attr.mtime = now;
        }
        n.attr.ctime = set.ctime.unwrap_or(now);
        Ok(n.attr)
    }

    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr> {
        let _w = locked(&self.writer);
        let p = self.free_name(parent, name)?;
        let kind = FileType::from_mode(if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        })
        .ok_or(FsError::Invalid("a mode that names no file type"))?;
        if matches!(kind, FileType::Directory | FileType::Symlink) {
            return Err(FsError::Invalid("mknod of a directory or symlink"));
        }
        if matches!(kind, FileType::CharDevice | FileType::BlockDevice) && ctx.uid != 0 {
            return Err(FsError::Perm);
        }
        let ino = self.with(|d| d.mknod(ctx, parent, name, mode, rdev))?;
        let mut a = self.new_attr(ino, kind, mode, ctx, &p);
        a.rdev = rdev;
        self.made(parent, name, a, Vec::new())
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        let _w = locked(&self.writer);
        let p = self.free_name(parent, name)?;
        let ino = self.with(|d| d.mkdir(ctx, parent, name, mode))?;
        let a = self.new_attr(ino, FileType::Directory, mode, ctx, &p);
        self.made(parent, name, a, Vec::new())
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        let _w = locked(&self.writer);
        if target.is_empty() || target.len() > 4095 || target.contains(&0) {
            return Err(if target.len() > 4095 {
                FsError::NameTooLong
            } else {
                FsError::Invalid("a symlink target that is empty or holds NUL")
            });
        }
        let p = self.free_name(parent, name)?;
        let ino = self.with(|d| d.symlink(ctx, parent, name, target))?;
        let mut a = self.new_attr(ino, FileType::Symlink, 0o777, &Ctx { umask: 0, ..*ctx }, &p);
        a.size = target.len() as u64;
        self.made(parent, name, a, target.to_vec())
    }

    fn unlink(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        let _w = locked(&self.writer);
        valid_name(name)?;
        self.writable_dir(parent)?;
        let (ino, kind) = self.entry(parent, name)?.ok_or(FsError::NotFound)?;
        if kind == FileType::Directory {
            return Err(FsError::IsDir);
        }
        self.ensure(ino)?;
        self.journal(
            ctx,
            FsOp::Unlink {
                parent,
                name: name.to_vec(),
            },
        )?;
        let mut v = locked(&self.v);
        v.dir(parent)?.remove(name);
        v.touch_dir(parent, 0)?;
        let n = v.node(ino)?;
        n.attr.nlink = n.attr.nlink.saturating_sub(1);
        n.attr.ctime = Timespec::now();
        Ok(())
    }

    fn rmdir(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        let _w = locked(&self.writer);
        valid_name(name)?;
        self.writable_dir(parent)?;
        let (ino, kind) = self.entry(parent, name)?.ok_or(FsError::NotFound)?;
        if kind != FileType::Directory {
            return Err(FsError::NotDir);
        }
        if !self.empty(ino)? {
            return Err(FsError::NotEmpty);
        }
        self.journal(
            ctx,
            FsOp::Rmdir {
                parent,
                name: name.to_vec(),
            },
        )?;
        let mut v = locked(&self.v);
        v.dir(parent)?.remove(name);
        v.touch_dir(parent, -1)?;
        v.dirs.remove(&ino);
        let n = v.node(ino)?;
        n.attr.nlink = 0;
        n.attr.ctime = Timespec::now();
        Ok(())
    }

    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        if let Some(n) = locked(&self.v).nodes.get(&ino) {
            if n.attr.kind != FileType::Symlink {
                return Err(FsError::Invalid("not a symlink"));
            }
            if n.ours {
                return Ok(n.target.clone());
            }
        }
        self.base.readlink(ino)
    }

    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        let _w = locked(&self.writer);
        valid_name(name)?;
        valid_name(new_name)?;
        if flags.whiteout {
            return Err(FsError::Invalid("RENAME_WHITEOUT in a decoupled subtree"));
        }
        if flags.exchange && flags.noreplace {
            return Err(FsError::Invalid("RENAME_EXCHANGE with RENAME_NOREPLACE"));
        }
        self.writable_dir(parent)?;
        self.writable_dir(new_parent)?;
        let op = FsOp::Rename {
            parent,
            name: name.to_vec(),
            new_parent,
            new_name: new_name.to_vec(),
            flags,
        };
        let (ino, kind) = self.entry(parent, name)?.ok_or(FsError::NotFound)?;
        let target = self.entry(new_parent, new_name)?;
        if flags.exchange {
            let (t, tkind) = target.ok_or(FsError::NotFound)?;
            if t == ino {
                return Ok(());
            }
            if kind == FileType::Directory && self.below(new_parent, ino)? {
                return Err(FsError::Invalid("a directory moved into itself"));
            }
            if tkind == FileType::Directory && self.below(parent, t)? {
                return Err(FsError::Invalid("a directory moved into itself"));
            }
            self.ensure(ino)?;
            self.ensure(t)?;
            self.journal(ctx, op)?;
            let mut v = locked(&self.v);
            v.dir(parent)?.insert(name, t, tkind);
            v.dir(new_parent)?.insert(new_name, ino, kind);
            let dirs = |k: FileType| i64::from(k == FileType::Directory);
            let moved = dirs(tkind) - dirs(kind);
            v.touch_dir(parent, if parent == new_parent { 0 } else { moved })?;
            v.touch_dir(new_parent, if parent == new_parent { 0 } else { -moved })?;
            for (i, up) in [(ino, new_parent), (t, parent)] {
                v.witnessed.insert(i);
                if let Some(d) = v.dirs.get_mut(&i) {
                    d.parent = up;
                }
                v.node(i)?.attr.ctime = Timespec::now();
            }
            return Ok(());
        }
        if target.is_some() && flags.noreplace {
            return Err(FsError::Exists);
        }
        if kind == FileType::Directory && self.below(new_parent, ino)? {
            return Err(FsError::Invalid("a directory moved into itself"));
        }
        if let Some((t, FileType::Directory)) = target {
            // The target holds the source (rename(2): ENOTEMPTY).
            if self.below(parent, t)? {
                return Err(FsError::NotEmpty);
            }
        }
        if let Some((t, tkind)) = target {
            if t == ino {
                // Two names of one inode: nothing happens (rename(2)).
                return Ok(());
            }
            match (kind == FileType::Directory, tkind == FileType::Directory) {
                (true, false) => return Err(FsError::NotDir),
                (false, true) => return Err(FsError::IsDir),
                (true, true) if !self.empty(t)? => return Err(FsError::NotEmpty),
                _ => {}
            }
            self.ensure(t)?;
        }
        self.ensure(ino)?;
        self.journal(ctx, op)?;
        let mut v = locked(&self.v);
        let now = Timespec::now();
        let is_dir = kind == FileType::Directory;
        if let Some((t, tkind)) = target {
            let n = v.node(t)?;
            if tkind == FileType::Directory {
                n.attr.nlink = 0;
            } else {
                n.attr.nlink = n.attr.nlink.saturating_sub(1);
            }
            n.attr.ctime = now;
            if tkind == FileType::Directory {
                v.dirs.remove(&t);
                v.touch_dir(new_parent, -1)?;
            }
        }
        v.dir(parent)?.remove(name);
        v.dir(new_parent)?.insert(new_name, ino, kind);
        if is_dir && parent != new_parent {
            v.touch_dir(parent, -1)?;
            v.touch_dir(new_parent, 1)?;
        } else {
            v.touch_dir(parent, 0)?;
            v.touch_dir(new_parent, 0)?;
        }
        if let Some(d) = v.dirs.get_mut(&ino) {
            d.parent = new_parent;
        }
        v.witnessed.insert(ino);
        v.node(ino)?.attr.ctime = now;
        Ok(())
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr> {
        let _w = locked(&self.writer);
        self.ensure(ino)?;
        self.free_name(new_parent, new_name)?;
        if self.attr(ino)?.kind == FileType::Directory {
            return Err(FsError::Perm);
        }
        let a = self.attr(ino)?;
        if a.nlink == 0 {
            return Err(FsError::NotFound);
        }
        if a.nlink >= 65000 {
            return Err(FsError::TooManyLinks);
        }
        self.witness(ino, ctx)?;
        self.journal(
            ctx,
            FsOp::Link {
                ino,
                new_parent,
                new_name: new_name.to_vec(),
            },
        )?;
        let mut v = locked(&self.v);
        v.dir(new_parent)?.insert(new_name, ino, a.kind);
        v.touch_dir(new_parent, 0)?;
        let n = v.node(ino)?;
        n.attr.nlink += 1;
        n.attr.ctime = Timespec::now();
        Ok(n.attr)
    }

    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        if let Some(n) = locked(&self.v).nodes.get(&ino) {
            if n.ours {
                if n.attr.kind == FileType::Directory {
                    return Err(FsError::IsDir);
                }
                let len = n.data.len() as u64;
                let from = offset.min(len) as usize;
                let to = offset.saturating_add(u64::from(size)).min(len) as usize;
                return Ok(n.data[from..to].to_vec());
            }
        }
        self.base.read(ino, offset, size)
    }

    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32> {
        if !self.is_ours(ino) {
            let n = self.base.write(ino, offset, data, ctx)?;
            let _w = locked(&self.writer);
            self.refresh(ino)?;
            return Ok(n);
        }
        let _w = locked(&self.writer);
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|e| *e <= 1 << 44)
            .ok_or(FsError::TooBig)?;
        {
            let mut v = locked(&self.v);
            let held = v.data;
            let n = v.node(ino)?;
            let grow = end.saturating_sub(n.data.len() as u64);
            if held + grow > DATA_LIMIT {
                return Err(too_much());
            }
            if grow > 0 {
                n.data.resize(end as usize, 0);
            }
            n.data[offset as usize..end as usize].copy_from_slice(data);
            let now = Timespec::now();
            n.attr.size = n.data.len() as u64;
            n.attr.blocks = blocks(n.attr.size);
            n.attr.mtime = now;
            n.attr.ctime = now;
            v.data = held + grow;
        }
        let mut off = offset;
        for part in data.chunks(crate::merge::MAX_WRITE) {
            self.with(|d| d.write(ctx, ino, off, part))?;
            off += part.len() as u64;
        }
        Ok(data.len() as u32)
    }

    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        let listing = {
            let v = locked(&self.v);
            v.dirs.get(&ino).map(|d| {
                let mut out = Vec::new();
                if offset == 0 {
                    out.push(DirEntry {
                        ino,
                        kind: FileType::Directory,
                        name: b".".to_vec(),
                        next_offset: 1,
                    });
                }
                if offset <= 1 {
                    out.push(DirEntry {
                        ino: d.parent,
                        kind: FileType::Directory,
                        name: b"..".to_vec(),
                        next_offset: 2,
                    });
                }
                for (c, name) in d.by_cookie.range(offset.max(2) + 1..) {
                    let (e, kind, _) = d.entries[name];
                    out.push(DirEntry {
                        ino: e,
                        kind,
                        name: name.clone(),
                        next_offset: *c,
                    });
                }
                out
            })
        };
        if listing.is_none() {
            if let Some(n) = locked(&self.v).nodes.get(&ino) {
                if n.attr.kind != FileType::Directory {
                    return Err(FsError::NotDir);
                }
                if n.ours || n.attr.nlink == 0 {
                    return Err(FsError::NotFound);
                }
            }
        }
        match listing {
            Some(es) => {
                for e in es {
                    if !emit(e) {
                        break;
                    }
                }
                Ok(())
            }
            None => self.base.readdir(ino, offset, &mut |e| {
                self.met(ino, &e.name, e.ino, e.kind);
                emit(e)
            }),
        }
    }

    fn statfs(&self) -> Result<StatFs> {
        self.base.statfs()
    }

    /// Durable as the subtree's policy makes anything durable: a sync (Local Persist,
    /// Global Persist, and a merge for a weak subtree).
    fn fsync(&self, _ino: Ino, _datasync: bool) -> Result<()> {
        self.sync().map(|_| ())
    }

    fn sync_all(&self) -> Result<()> {
        self.sync().map(|_| ())
    }

    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        let _w = locked(&self.writer);
        self.ensure(ino)?;
        check_xattr_name(name)?;
        let exists = match self.getxattr(ino, name) {
            Ok(_) => true,
            Err(FsError::NoAttr) => false,
            Err(e) => return Err(e),
        };
        if flags.create && exists {
            return Err(FsError::Exists);
        }
        if flags.replace && !exists {
            return Err(FsError::NoAttr);
        }
        self.witness(ino, ctx)?;
        self.with(|d| {
            d.change(
                ctx,
                FsOp::Setxattr {
                    ino,
                    name: name.to_vec(),
                    value: value.to_vec(),
                    flags: XattrFlags {
                        create: false,
                        replace: false,
                        ..flags
                    },
                },
            )
        })?;
        let mut v = locked(&self.v);
        let n = v.node(ino)?;
        n.xattrs.insert(name.to_vec(), Some(value.to_vec()));
        n.attr.ctime = Timespec::now();
        Ok(())
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        if let Some(n) = locked(&self.v).nodes.get(&ino) {
            match n.xattrs.get(name) {
                Some(Some(v)) => return Ok(v.clone()),
                Some(None) => return Err(FsError::NoAttr),
                None if n.ours => return Err(FsError::NoAttr),
                None => {}
            }
        }
        self.base.getxattr(ino, name)
    }

    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        let (ours, changes) = match locked(&self.v).nodes.get(&ino) {
            Some(n) => (n.ours, n.xattrs.clone()),
            None => return self.base.listxattr(ino),
        };
        let mut names: BTreeMap<Vec<u8>, ()> = BTreeMap::new();
        if !ours {
            for n in self.base.listxattr(ino)?.split(|b| *b == 0) {
                if !n.is_empty() {
                    names.insert(n.to_vec(), ());
                }
            }
        }
        for (n, v) in changes {
            match v {
                Some(_) => names.insert(n, ()),
                None => names.remove(&n),
            };
        }
        let mut out = Vec::new();
        for n in names.keys() {
            out.extend_from_slice(n);
            out.push(0);
        }
        Ok(out)
    }

    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        let _w = locked(&self.writer);
        self.ensure(ino)?;
        check_xattr_name(name)?;
        self.getxattr(ino, name)?;
        self.witness(ino, ctx)?;
        self.journal(
            ctx,
            FsOp::Removexattr {
                ino,
                name: name.to_vec(),
            },
        )?;
        let mut v = locked(&self.v);
        let n = v.node(ino)?;
        if n.ours {
            n.xattrs.remove(name);
        } else {
            n.xattrs.insert(name.to_vec(), None);
        }
        n.attr.ctime = Timespec::now();
        Ok(())
    }

    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32, ctx: &Ctx) -> Result<()> {
        if self.is_ours(ino) {
            return Err(FsError::NotSupported);
        }
        self.base.fallocate(ino, offset, length, mode, ctx)?;
        let _w = locked(&self.writer);
        self.refresh(ino)
    }
}

/// The service's own attributes are no client's; names as xattr(7) allows them.
fn check_xattr_name(name: &[u8]) -> Result<()> {
    if name.starts_with(crate::merge::RESERVED_XATTR) {
        return Err(FsError::Perm);
    }
    if name.is_empty() || name.len() > 255 {
        return Err(FsError::Range);
    }
    Ok(())
}

fn too_much() -> FsError {
    tracing::warn!(
        "cudele: the decoupled session holds {} MiB of new files' data: sync or release \
         the subtree to write more",
        DATA_LIMIT >> 20
    );
    FsError::NoSpace
}

/// The kernel's references need nothing of the view.
/// The kernel's references without a handle take nothing at the service (as for
/// [`RemoteFs`]).
impl quilt_vfs::KernelFs for DecoupledFs {
    fn reference(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
    fn unreference(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
}
