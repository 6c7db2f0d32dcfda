//! Merging a client journal into the global namespace: every event validated first,
//! then applied in atomic batches, each of which also moves the client's watermark.
//!
//! **Validation** replays the journal against a shadow of the namespace (the names and
//! inodes the journal touched, over what the file system holds) and refuses the whole
//! journal, changing nothing, if any event is wrong: a parent that is not a directory
//! inside the subtree, a name that is empty, too long or holds `/`, an inode number
//! outside the client's grants or used twice, a type or attribute a client may not
//! set, an operation with no place in a journal (reads other than a lookup, file
//! data of a file the client did not create). What the journal may touch is the
//! subtree: its root, what the journal created, and what it reached by name from
//! there (a `Lookup` event is a witness: it is checked, not applied).
//!
//! **The conflict rule** (others changed the subtree meanwhile, which `interfere=allow`
//! permits): the decoupled client's updates win, and nothing of the others' is lost.
//! A creation (or a rename's target under `noreplace`, or a link) whose name is taken
//! in the namespace by an entry the journal did not make moves that entry aside first,
//! to `NAME.cudele-conflict-INO` in the same directory (INO the entry's inode number;
//! a further `.N` if that name is taken too). An unlink, rmdir or rename of a name that
//! is already gone is skipped (what it removes is not there). Everything else an
//! interfering client did stays.
//!
//! **Applying** runs the plan in order as root, in batches of at most `chunk` events
//! (an event and the steps it needs, a move aside, the new file's owner, never split),
//! each with the client's watermark (`trusted.quiltfs.cudele.merged.CLIENT` on the
//! subtree's root: the last sequence number applied, and the highest granted number
//! used) set in the same batch. A batch is
//! atomic on both modules, so after a crash the namespace holds a prefix of whole
//! batches and the watermark says which: merging the journal again applies exactly the
//! rest (the service stages a journal before merging it and finishes staged merges when
//! it starts, so a merge it accepted ends whole).

use crate::journal::Event;
use quilt_vfs::{
    Attr, Ctx, FileSystem, FileType, FsError, FsOp, Ino, InoGrant, RenameFlags, SetAttr, XattrFlags,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::HashMap;

/// The xattr names the service keeps on a subtree's root. Clients may never set them.
pub const RESERVED_XATTR: &[u8] = b"trusted.quiltfs.";
const MAX_NAME: usize = 255;
const MAX_SYMLINK: usize = 4095;
/// The largest write one event carries (a FUSE write is at most 1 MiB).
pub const MAX_WRITE: usize = 1 << 20;
/// The largest file a journal's data may make.
const MAX_FILE: u64 = 1 << 44;

/// The watermark's xattr for `client`.
pub fn watermark_name(client: u64) -> Vec<u8> {
    format!("trusted.quiltfs.cudele.merged.{client}").into_bytes()
}

/// How far a client's journal is merged into a subtree: the last event applied, and
/// the highest granted number it created (a client takes its granted numbers in
/// increasing order, so the numbers above this one are still unused: what the service
/// sets aside again after a restart).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watermark {
    pub seq: u64,
    pub max_ino: Ino,
}

impl Watermark {
    fn encode(&self) -> Vec<u8> {
        let mut v = self.seq.to_le_bytes().to_vec();
        v.extend_from_slice(&self.max_ino.to_le_bytes());
        v
    }
}

/// `client`'s watermark in the subtree at `root` (zero: nothing merged yet).
pub fn watermark(fs: &dyn FileSystem, root: Ino, client: u64) -> Result<Watermark, FsError> {
    match fs.getxattr(root, &watermark_name(client)) {
        Ok(v) if v.len() == 16 => {
            let mut a = [0u8; 8];
            a.copy_from_slice(&v[..8]);
            let seq = u64::from_le_bytes(a);
            a.copy_from_slice(&v[8..]);
            Ok(Watermark {
                seq,
                max_ino: u64::from_le_bytes(a),
            })
        }
        Ok(_) => Err(FsError::Io(
            "a merge watermark of the wrong size on the subtree's root".into(),
        )),
        Err(FsError::NoAttr) => Ok(Watermark::default()),
        Err(e) => Err(e),
    }
}

/// What a merge may touch.
#[derive(Debug, Clone)]
pub struct Scope {
    /// The subtree's root directory.
    pub root: Ino,
    pub client: u64,
    /// The inode numbers granted to the client: every creation names one.
    pub grants: Vec<InoGrant>,
}

impl Scope {
    fn granted(&self, ino: Ino) -> bool {
        self.grants.iter().any(|g| g.contains(ino))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MergeError {
    #[error("event {seq}: {why}; nothing of the journal was applied")]
    Invalid { seq: u64, why: String },
    #[error(
        "applying events up to {seq}: {error}; events up to {applied} are merged, the \
         rest can be merged again"
    )]
    Apply {
        seq: u64,
        applied: u64,
        error: FsError,
    },
    #[error("reading the namespace: {0}")]
    Namespace(FsError),
}

/// One step of a plan: an operation, and the event it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub seq: u64,
    pub op: FsOp,
}

impl Step {
    /// The granted number this step creates under, if any.
    fn creates(&self) -> Option<Ino> {
        match &self.op {
            FsOp::Mknod { ino, .. } | FsOp::Mkdir { ino, .. } | FsOp::Symlink { ino, .. } => *ino,
            _ => None,
        }
    }
}

/// A validated journal, ready to apply.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// The watermark once applied.
    pub last: Watermark,
    /// Events in the plan (past the watermark).
    pub events: u64,
    /// Events skipped by the conflict rule (their name was already gone).
    pub skipped: u64,
    /// Entries of other clients moved aside: (directory, old name, new name).
    pub moved_aside: Vec<(Ino, Vec<u8>, Vec<u8>)>,
    /// New inodes the plan creates.
    pub creates: u64,
}

/// What the shadow knows of an inode the journal may touch.
#[derive(Debug, Clone, Copy)]
struct Known {
    kind: FileType,
    uid: u32,
    /// Made by this journal (so far as the shadow goes, not in the namespace yet).
    ours: bool,
}

/// A name in a directory, and what the journal left there (`None`: removed).
type Names = HashMap<(Ino, Vec<u8>), Option<(Ino, FileType)>>;

/// The maps keyed by inode number hash with Fx (the numbers are the namespace's, or
/// granted ones the journal must take in increasing order); those keyed by names, which
/// a journal chooses freely, keep SipHash's resistance to chosen collisions.
struct Shadow<'a> {
    fs: &'a dyn FileSystem,
    scope: &'a Scope,
    /// Names the journal changed: `None` once removed.
    names: Names,
    known: FxHashMap<Ino, Known>,
    /// Each directory's parent, as the journal left it (for the loop check of renames).
    parent: FxHashMap<Ino, Ino>,
    /// Entries added minus removed, per directory (for rmdir's emptiness).
    delta: FxHashMap<Ino, i64>,
    /// Existing directories' entry counts, read once.
    counted: FxHashMap<Ino, i64>,
    /// Existing directories found outside the subtree (not to ask twice).
    outside: FxHashSet<Ino>,
    used: FxHashSet<Ino>,
    /// The highest granted number created so far (creations go up).
    max_ino: Ino,
    /// Names asked of existing directories, and the directories listed whole.
    asked: FxHashMap<Ino, u32>,
    listed: FxHashMap<Ino, HashMap<Vec<u8>, (Ino, FileType)>>,
}

/// Names asked of one existing directory before it is listed whole instead.
const LIST_AFTER: u32 = 32;

fn bad(seq: u64, why: impl Into<String>) -> MergeError {
    MergeError::Invalid {
        seq,
        why: why.into(),
    }
}

fn check_name(seq: u64, name: &[u8]) -> Result<(), MergeError> {
    if name.is_empty() || name == b"." || name == b".." {
        return Err(bad(seq, "an empty name, or . or .."));
    }
    if name.len() > MAX_NAME {
        return Err(bad(
            seq,
            format!("a name of {} bytes (at most 255)", name.len()),
        ));
    }
    if name.contains(&b'/') || name.contains(&0) {
        return Err(bad(seq, "a name holding '/' or NUL"));
    }
    Ok(())
}

fn show(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

impl<'a> Shadow<'a> {
    fn new(fs: &'a dyn FileSystem, scope: &'a Scope) -> Result<Shadow<'a>, MergeError> {
        let a = fs.getattr(scope.root).map_err(MergeError::Namespace)?;
        if a.kind != FileType::Directory {
            return Err(MergeError::Namespace(FsError::NotDir));
        }
        let mut known = FxHashMap::default();
        known.insert(
            scope.root,
            Known {
                kind: FileType::Directory,
                uid: a.uid,
                ours: false,
            },
        );
        Ok(Shadow {
            fs,
            scope,
            names: HashMap::new(),
            known,
            parent: FxHashMap::default(),
            delta: FxHashMap::default(),
            counted: FxHashMap::default(),
            outside: FxHashSet::default(),
            used: FxHashSet::default(),
            max_ino: 0,
            asked: FxHashMap::default(),
            listed: FxHashMap::default(),
        })
    }

    /// What `name` in `dir` names now: the journal's change, else the namespace's.
    fn resolve(&mut self, dir: Ino, name: &[u8]) -> Result<Option<(Ino, FileType)>, MergeError> {
        if let Some(e) = self.names.get(&(dir, name.to_vec())) {
            return Ok(*e);
        }
        if self.known.get(&dir).is_some_and(|k| k.ours) {
            return Ok(None);
        }
        // A directory the journal adds many names to is listed once rather than asked
        // name by name.
        if let Some(l) = self.listed.get(&dir) {
            return Ok(l.get(name).copied());
        }
        let asked = self.asked.entry(dir).or_default();
        *asked += 1;
        if *asked >= LIST_AFTER {
            let mut l = HashMap::new();
            self.fs
                .readdir(dir, 0, &mut |e| {
                    if e.name != b"." && e.name != b".." {
                        l.insert(e.name, (e.ino, e.kind));
                    }
                    true
                })
                .map_err(MergeError::Namespace)?;
            let found = l.get(name).copied();
            self.listed.insert(dir, l);
            return Ok(found);
        }
        match self.fs.lookup(dir, name) {
            Ok(a) => Ok(Some((a.ino, a.kind))),
            Err(FsError::NotFound) => Ok(None),
            Err(e) => Err(MergeError::Namespace(e)),
        }
    }

    /// Whether `ino` is an inode of the subtree the journal may touch; directories not
    /// met yet are placed by walking up their `..`.
    fn inside(&mut self, ino: Ino) -> Result<Option<Known>, MergeError> {
        if let Some(k) = self.known.get(&ino) {
            return Ok(Some(*k));
        }
        if self.outside.contains(&ino) {
            return Ok(None);
        }
        let a = match self.fs.getattr(ino) {
            Ok(a) => a,
            // (A number no inode has: ENOENT or ESTALE, as the module says it.)
            Err(FsError::NotFound | FsError::Stale) => return Ok(None),
            Err(e) => return Err(MergeError::Namespace(e)),
        };
        if self.scope.granted(ino) {
            // The client's own: granted numbers are only ever its creations (made by an
            // earlier merge of its journal).
            self.learn(&a);
            return Ok(self.known.get(&ino).copied());
        }
        if a.kind != FileType::Directory {
            // Anything else is reached by name (a creation, a lookup), never by number.
            return Ok(None);
        }
        let mut walk = vec![ino];
        let mut d = ino;
        for _ in 0..4096 {
            let up = self.fs.lookup(d, b"..").map_err(MergeError::Namespace)?.ino;
            if self.known.contains_key(&up) {
                break;
            }
            if up == d || self.outside.contains(&up) {
                self.outside.extend(walk);
                return Ok(None);
            }
            walk.push(up);
            d = up;
        }
        let k = Known {
            kind: a.kind,
            uid: a.uid,
            ours: false,
        };
        // Only the directory asked for is remembered (its ancestors are found again if
        // asked; they are few).
        self.known.insert(ino, k);
        Ok(Some(k))
    }

    fn learn(&mut self, a: &Attr) {
        self.known.entry(a.ino).or_insert(Known {
            kind: a.kind,
            uid: a.uid,
            ours: false,
        });
    }

    /// A directory of the subtree the caller may add entries to or remove them from.
    fn writable_dir(&mut self, seq: u64, dir: Ino, ctx: &Ctx) -> Result<Known, MergeError> {
        let k = self
            .inside(dir)?
            .ok_or_else(|| bad(seq, format!("directory {dir} is not inside the subtree")))?;
        if k.kind != FileType::Directory {
            return Err(bad(seq, format!("{dir} is not a directory")));
        }
        if !k.ours {
            self.fs
                .access(dir, (libc::W_OK | libc::X_OK) as u32, ctx)
                .map_err(|e| bad(seq, format!("no write permission in directory {dir}: {e}")))?;
        }
        Ok(k)
    }

    fn entries(&mut self, dir: Ino) -> Result<i64, MergeError> {
        let base = if self.known.get(&dir).is_some_and(|k| k.ours) {
            0
        } else if let Some(n) = self.counted.get(&dir) {
            *n
        } else {
            let mut n = 0i64;
            self.fs
                .readdir(dir, 0, &mut |e| {
                    if e.name != b"." && e.name != b".." {
                        n += 1;
                    }
                    true
                })
                .map_err(MergeError::Namespace)?;
            self.counted.insert(dir, n);
            n
        };
        Ok(base + self.delta.get(&dir).copied().unwrap_or(0))
    }

    fn add(&mut self, dir: Ino, name: &[u8], e: (Ino, FileType)) {
        self.names.insert((dir, name.to_vec()), Some(e));
        *self.delta.entry(dir).or_default() += 1;
        if e.1 == FileType::Directory {
            self.parent.insert(e.0, dir);
        }
    }

    fn remove(&mut self, dir: Ino, name: &[u8]) {
        self.names.insert((dir, name.to_vec()), None);
        *self.delta.entry(dir).or_default() -= 1;
    }

    fn parent_of(&self, d: Ino) -> Result<Ino, MergeError> {
        if let Some(p) = self.parent.get(&d) {
            return Ok(*p);
        }
        Ok(self.fs.lookup(d, b"..").map_err(MergeError::Namespace)?.ino)
    }

    /// Makes `name` in `dir` free for the journal's entry: an entry the journal did not
    /// make moves aside (the conflict rule). Refuses when the journal made it itself.
    fn make_room(
        &mut self,
        seq: u64,
        dir: Ino,
        name: &[u8],
        plan: &mut Plan,
    ) -> Result<(), MergeError> {
        let Some((ino, kind)) = self.resolve(dir, name)? else {
            return Ok(());
        };
        if self.names.contains_key(&(dir, name.to_vec())) {
            return Err(bad(
                seq,
                format!(
                    "`{}` exists: an earlier event of the journal made it",
                    show(name)
                ),
            ));
        }
        let mut aside = format!("{}.cudele-conflict-{ino}", show(name)).into_bytes();
        let mut n = 1;
        while aside.len() > MAX_NAME || self.resolve(dir, &aside)?.is_some() {
            let stem = &name[..name.len().min(200)];
            aside = format!("{}.cudele-conflict-{ino}.{n}", show(stem)).into_bytes();
            n += 1;
            if n > 1000 {
                return Err(bad(seq, "no free name to move a conflicting entry to"));
            }
        }
        plan.steps.push(Step {
            seq,
            op: FsOp::Rename {
                parent: dir,
                name: name.to_vec(),
                new_parent: dir,
                new_name: aside.clone(),
                flags: RenameFlags {
                    noreplace: true,
                    ..Default::default()
                },
            },
        });
        plan.moved_aside.push((dir, name.to_vec(), aside.clone()));
        self.names.insert((dir, name.to_vec()), None);
        self.names.insert((dir, aside), Some((ino, kind)));
        Ok(())
    }

    /// A creation of inode `ino` (of `kind`, for `uid`:`gid`) named `name` in `dir`.
    #[allow(clippy::too_many_arguments)]
    fn create(
        &mut self,
        seq: u64,
        dir: Ino,
        name: &[u8],
        ino: Option<Ino>,
        kind: FileType,
        ev: &Event,
        plan: &mut Plan,
    ) -> Result<Ino, MergeError> {
        let ctx = creds(ev);
        check_name(seq, name)?;
        let ino = ino.ok_or_else(|| bad(seq, "a creation without a granted inode number"))?;
        if !self.scope.granted(ino) {
            return Err(bad(
                seq,
                format!("inode {ino} is outside the client's grants"),
            ));
        }
        if !self.used.insert(ino) {
            return Err(bad(seq, format!("inode {ino} is created twice")));
        }
        if ino <= self.max_ino {
            return Err(bad(
                seq,
                format!(
                    "inode {ino} after {}: a client takes its granted numbers in increasing \
                     order",
                    self.max_ino
                ),
            ));
        }
        self.max_ino = ino;
        // A number above the client's watermark is unused: only the client creates under
        // its grants, only through merges, which move the watermark (and the module
        // refuses a number that is not free in its grants all the same).
        self.writable_dir(seq, dir, &ctx)?;
        self.make_room(seq, dir, name, plan)?;
        plan.steps.push(Step {
            seq,
            op: ev.op.clone(),
        });
        if ev.uid != 0 || ev.gid != 0 {
            plan.steps.push(Step {
                seq,
                op: FsOp::Setattr {
                    ino,
                    set: SetAttr {
                        uid: Some(ev.uid),
                        gid: Some(ev.gid),
                        ..Default::default()
                    },
                },
            });
        }
        self.known.insert(
            ino,
            Known {
                kind,
                uid: ev.uid,
                ours: true,
            },
        );
        self.add(dir, name, (ino, kind));
        plan.creates += 1;
        Ok(ino)
    }

    /// An inode an ino-only event may change: inside, and the caller owns it or is root.
    fn owned(&mut self, seq: u64, ino: Ino, ev: &Event) -> Result<Known, MergeError> {
        let k = self.inside(ino)?.ok_or_else(|| {
            bad(
                seq,
                format!("inode {ino} is not one the journal created or reached by name"),
            )
        })?;
        if ev.uid != 0 && k.uid != ev.uid {
            return Err(bad(seq, format!("inode {ino} belongs to another user")));
        }
        Ok(k)
    }

    /// RENAME_EXCHANGE of two names: both must still be there (else skipped, as a
    /// rename of a name already gone), and neither directory may end up inside itself.
    fn exchange(&mut self, seq: u64, ev: &Event, plan: &mut Plan) -> Result<(), MergeError> {
        let FsOp::Rename {
            parent,
            name,
            new_parent,
            new_name,
            ..
        } = &ev.op
        else {
            return Err(bad(seq, "not a rename"));
        };
        let ctx = creds(ev);
        check_name(seq, name)?;
        check_name(seq, new_name)?;
        self.writable_dir(seq, *parent, &ctx)?;
        self.writable_dir(seq, *new_parent, &ctx)?;
        let (Some(a), Some(b)) = (
            self.resolve(*parent, name)?,
            self.resolve(*new_parent, new_name)?,
        ) else {
            plan.skipped += 1;
            return Ok(());
        };
        if a.0 == b.0 {
            return Ok(());
        }
        for (moved, into) in [(a, *new_parent), (b, *parent)] {
            if moved.1 != FileType::Directory {
                continue;
            }
            let mut d = into;
            for _ in 0..4096 {
                if d == moved.0 {
                    return Err(bad(seq, "a directory exchanged into itself"));
                }
                if d == self.scope.root {
                    break;
                }
                d = self.parent_of(d)?;
            }
        }
        plan.steps.push(Step {
            seq,
            op: ev.op.clone(),
        });
        self.names.insert((*parent, name.clone()), Some(b));
        self.names.insert((*new_parent, new_name.clone()), Some(a));
        for (e, dir) in [(a, *new_parent), (b, *parent)] {
            self.known.entry(e.0).or_insert(Known {
                kind: e.1,
                uid: 0,
                ours: false,
            });
            if e.1 == FileType::Directory {
                self.parent.insert(e.0, dir);
            }
        }
        Ok(())
    }

    /// A regular file whose data the journal may carry: one the client created (its
    /// number is granted), which no other client can have written before the merge
    /// made it. Data of files that existed before goes to the service directly.
    fn own_file(&mut self, seq: u64, ino: Ino, ev: &Event) -> Result<(), MergeError> {
        let k = self.owned(seq, ino, ev)?;
        if !self.scope.granted(ino) {
            return Err(bad(
                seq,
                format!("file data of inode {ino}, which the client did not create"),
            ));
        }
        if k.kind != FileType::Regular {
            return Err(bad(
                seq,
                format!("file data of inode {ino}, not a regular file"),
            ));
        }
        Ok(())
    }

    /// Checks one event and adds its steps to the plan.
    fn event(&mut self, seq: u64, ev: &Event, plan: &mut Plan) -> Result<(), MergeError> {
        let ctx = creds(ev);
        match &ev.op {
            FsOp::Mknod {
                parent,
                name,
                mode,
                ino,
                ..
            } => {
                let kind = FileType::from_mode(*mode)
                    .ok_or_else(|| bad(seq, format!("mode {mode:o} names no file type")))?;
                match kind {
                    FileType::Regular | FileType::Fifo | FileType::Socket => {}
                    FileType::CharDevice | FileType::BlockDevice if ev.uid == 0 => {}
                    FileType::CharDevice | FileType::BlockDevice => {
                        return Err(bad(seq, "a device node made by a user who is not root"))
                    }
                    _ => return Err(bad(seq, "mknod of a directory or symlink")),
                }
                self.create(seq, *parent, name, *ino, kind, ev, plan)?;
            }
            FsOp::Mkdir {
                parent, name, ino, ..
            } => {
                let new = self.create(seq, *parent, name, *ino, FileType::Directory, ev, plan)?;
                self.parent.insert(new, *parent);
            }
            FsOp::Symlink {
                parent,
                name,
                target,
                ino,
            } => {
                if target.is_empty() || target.len() > MAX_SYMLINK || target.contains(&0) {
                    return Err(bad(
                        seq,
                        "a symlink target that is empty, too long or holds NUL",
                    ));
                }
                self.create(seq, *parent, name, *ino, FileType::Symlink, ev, plan)?;
            }
            FsOp::Link {
                ino,
                new_parent,
                new_name,
            } => {
                check_name(seq, new_name)?;
                let k = self.owned(seq, *ino, ev)?;
                if k.kind == FileType::Directory {
                    return Err(bad(seq, "a hard link to a directory"));
                }
                self.writable_dir(seq, *new_parent, &ctx)?;
                self.make_room(seq, *new_parent, new_name, plan)?;
                plan.steps.push(Step {
                    seq,
                    op: ev.op.clone(),
                });
                self.add(*new_parent, new_name, (*ino, k.kind));
            }
            FsOp::Unlink { parent, name } | FsOp::Rmdir { parent, name } => {
                let dir = matches!(ev.op, FsOp::Rmdir { .. });
                check_name(seq, name)?;
                self.writable_dir(seq, *parent, &ctx)?;
                let Some((ino, kind)) = self.resolve(*parent, name)? else {
                    plan.skipped += 1;
                    return Ok(());
                };
                if dir != (kind == FileType::Directory) {
                    return Err(bad(
                        seq,
                        format!(
                            "{} of `{}`, which is {}a directory",
                            if dir { "rmdir" } else { "unlink" },
                            show(name),
                            if dir { "not " } else { "" }
                        ),
                    ));
                }
                if dir {
                    if ino == self.scope.root {
                        return Err(bad(seq, "rmdir of the subtree's root"));
                    }
                    self.known.entry(ino).or_insert(Known {
                        kind,
                        uid: 0,
                        ours: false,
                    });
                    if self.entries(ino)? != 0 {
                        return Err(bad(seq, format!("rmdir of `{}`, not empty", show(name))));
                    }
                }
                plan.steps.push(Step {
                    seq,
                    op: ev.op.clone(),
                });
                self.remove(*parent, name);
            }
            FsOp::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => {
                if flags.whiteout {
                    return Err(bad(seq, "a whiteout rename has no place in a journal"));
                }
                if flags.exchange {
                    return self.exchange(seq, ev, plan);
                }
                check_name(seq, name)?;
                check_name(seq, new_name)?;
                self.writable_dir(seq, *parent, &ctx)?;
                self.writable_dir(seq, *new_parent, &ctx)?;
                let Some((ino, kind)) = self.resolve(*parent, name)? else {
                    plan.skipped += 1;
                    return Ok(());
                };
                if parent == new_parent && name == new_name {
                    return Ok(());
                }
                if kind == FileType::Directory {
                    // Not into itself or below it.
                    let mut d = *new_parent;
                    for _ in 0..4096 {
                        if d == ino {
                            return Err(bad(seq, "a directory renamed into itself"));
                        }
                        if d == self.scope.root {
                            break;
                        }
                        d = self.parent_of(d)?;
                    }
                }
                let mut op = ev.op.clone();
                match self.resolve(*new_parent, new_name)? {
                    Some(_) if flags.noreplace => {
                        self.make_room(seq, *new_parent, new_name, plan)?;
                        // Room made: the rename itself need not refuse.
                        if let FsOp::Rename { flags, .. } = &mut op {
                            flags.noreplace = false;
                        }
                    }
                    Some((t, tk)) => {
                        if (tk == FileType::Directory) != (kind == FileType::Directory) {
                            return Err(bad(
                                seq,
                                "a rename between a directory and a non-directory",
                            ));
                        }
                        if tk == FileType::Directory {
                            self.known.entry(t).or_insert(Known {
                                kind: tk,
                                uid: 0,
                                ours: false,
                            });
                            if self.entries(t)? != 0 {
                                return Err(bad(
                                    seq,
                                    "a rename over a directory that is not empty",
                                ));
                            }
                        }
                        self.remove(*new_parent, new_name);
                    }
                    None => {}
                }
                plan.steps.push(Step { seq, op });
                self.remove(*parent, name);
                self.add(*new_parent, new_name, (ino, kind));
                self.known.entry(ino).or_insert(Known {
                    kind,
                    uid: 0,
                    ours: false,
                });
            }
            FsOp::Setattr { ino, set } => {
                if let Some(size) = set.size {
                    self.own_file(seq, *ino, ev)?;
                    if size > MAX_FILE {
                        return Err(bad(seq, format!("a size of {size} bytes")));
                    }
                }
                self.owned(seq, *ino, ev)?;
                if set.uid.is_some_and(|u| u != ev.uid) && ev.uid != 0 {
                    return Err(bad(seq, "a change of owner by a user who is not root"));
                }
                if set.gid.is_some_and(|g| g != ev.gid) && ev.uid != 0 {
                    return Err(bad(seq, "a change to a group not the caller's"));
                }
                if let Some(u) = set.uid {
                    if let Some(k) = self.known.get_mut(ino) {
                        k.uid = u;
                    }
                }
                plan.steps.push(Step {
                    seq,
                    op: ev.op.clone(),
                });
            }
            FsOp::Write { ino, offset, data } => {
                self.own_file(seq, *ino, ev)?;
                if data.len() > MAX_WRITE {
                    return Err(bad(
                        seq,
                        format!("a write of {} bytes (at most {MAX_WRITE})", data.len()),
                    ));
                }
                if offset
                    .checked_add(data.len() as u64)
                    .is_none_or(|end| end > MAX_FILE)
                {
                    return Err(bad(seq, format!("a write at offset {offset}")));
                }
                plan.steps.push(Step {
                    seq,
                    op: ev.op.clone(),
                });
            }
            FsOp::Setxattr { ino, name, .. } | FsOp::Removexattr { ino, name } => {
                if name.starts_with(RESERVED_XATTR) {
                    return Err(bad(seq, "the service's own attributes (trusted.quiltfs.*)"));
                }
                if !name.starts_with(b"user.") && ev.uid != 0 {
                    return Err(bad(
                        seq,
                        "an attribute outside user.* by a user who is not root",
                    ));
                }
                if name.is_empty() || name.len() > MAX_NAME {
                    return Err(bad(seq, "an attribute name that is empty or too long"));
                }
                self.owned(seq, *ino, ev)?;
                plan.steps.push(Step {
                    seq,
                    op: ev.op.clone(),
                });
            }
            FsOp::Lookup { parent, name } => {
                check_name(seq, name)?;
                let k = self.inside(*parent)?.ok_or_else(|| {
                    bad(seq, format!("directory {parent} is not inside the subtree"))
                })?;
                if k.kind != FileType::Directory {
                    return Err(bad(seq, format!("{parent} is not a directory")));
                }
                if !self.names.contains_key(&(*parent, name.clone())) {
                    match self.fs.lookup(*parent, name) {
                        Ok(a) => self.learn(&a),
                        Err(FsError::NotFound) => {}
                        Err(e) => return Err(MergeError::Namespace(e)),
                    }
                }
            }
            other => {
                return Err(bad(
                    seq,
                    format!("{} has no place in a client journal", op_name(other)),
                ))
            }
        }
        Ok(())
    }
}

fn op_name(op: &FsOp) -> &'static str {
    match op {
        FsOp::Read { .. } | FsOp::Readdir { .. } | FsOp::Readlink { .. } => "a read",
        FsOp::Getattr { .. } | FsOp::Getxattr { .. } | FsOp::Listxattr { .. } => "a read",
        FsOp::Write { .. } | FsOp::Fallocate { .. } => "file data",
        FsOp::Fsync { .. } | FsOp::SyncAll => "a sync",
        FsOp::Statfs => "statfs",
        _ => "this operation",
    }
}

fn creds(ev: &Event) -> Ctx {
    Ctx {
        uid: ev.uid,
        gid: ev.gid,
        pid: 0,
        umask: 0,
    }
}

/// Validates `events` (those past the watermark) for `scope`, against `fs` as it is
/// now, and plans their merge. Changes nothing.
pub fn plan(
    fs: &dyn FileSystem,
    scope: &Scope,
    events: &[(u64, Event)],
    watermark: Watermark,
) -> Result<Plan, MergeError> {
    let mut shadow = Shadow::new(fs, scope)?;
    shadow.max_ino = watermark.max_ino;
    let mut plan = Plan {
        last: watermark,
        ..Plan::default()
    };
    for (seq, ev) in events.iter().filter(|(s, _)| *s > watermark.seq) {
        shadow.event(*seq, ev, &mut plan)?;
        plan.last.seq = *seq;
        plan.events += 1;
    }
    plan.last.max_ino = shadow.max_ino;
    if plan.creates > 0 {
        let st = fs.statfs().map_err(MergeError::Namespace)?;
        if st.files_free < plan.creates {
            return Err(MergeError::Invalid {
                seq: plan.last.seq,
                why: format!(
                    "the namespace has {} free inodes, the journal creates {}",
                    st.files_free, plan.creates
                ),
            });
        }
    }
    Ok(plan)
}

/// Applies a plan, at most `chunk` events per atomic batch, each batch moving the
/// watermark. Returns the watermark reached (the plan's last event).
pub fn apply(
    fs: &dyn FileSystem,
    scope: &Scope,
    plan: &Plan,
    chunk: usize,
) -> Result<Watermark, MergeError> {
    let chunk = chunk.max(1);
    let name = watermark_name(scope.client);
    let mut applied = watermark(fs, scope.root, scope.client).map_err(MergeError::Namespace)?;
    let steps = &plan.steps;
    // What an earlier, cut application of this plan applied is not applied again.
    let mut i = steps
        .iter()
        .position(|s| s.seq > applied.seq)
        .unwrap_or(steps.len());
    let mut batch: Vec<FsOp> = Vec::new();
    let mut seqs: Vec<u64> = Vec::new();
    while i < steps.len() {
        batch.clear();
        seqs.clear();
        let mut events = 0;
        let mut last = applied;
        while i < steps.len() {
            let step = &steps[i];
            if !step.op.batchable() {
                // File data cannot be part of an atomic batch: what came before is
                // applied first, then the write on its own. A crash before the next
                // watermark applies it again, which leaves the same bytes.
                if !batch.is_empty() {
                    break;
                }
                apply_data(fs, &step.op).map_err(|error| MergeError::Apply {
                    seq: step.seq,
                    applied: applied.seq,
                    error,
                })?;
                last.seq = step.seq;
                i += 1;
                continue;
            }
            if step.seq != last.seq {
                if events == chunk {
                    break;
                }
                events += 1;
                last.seq = step.seq;
            }
            if let Some(ino) = step.creates() {
                last.max_ino = last.max_ino.max(ino);
            }
            batch.push(step.op.clone());
            seqs.push(step.seq);
            i += 1;
        }
        if batch.is_empty() {
            // Only file data since the last batch: the watermark moves at the end.
            continue;
        }
        batch.push(FsOp::Setxattr {
            ino: scope.root,
            name: name.clone(),
            value: last.encode(),
            flags: XattrFlags::default(),
        });
        seqs.push(last.seq);
        fs.apply_batch(&batch, &Ctx::root())
            .map_err(|e| MergeError::Apply {
                seq: seqs.get(e.index).copied().unwrap_or(last.seq),
                applied: applied.seq,
                error: e.error,
            })?;
        applied = last;
    }
    if plan.last.seq > applied.seq {
        // Events that were all skipped: the watermark still moves past them.
        fs.setxattr(
            scope.root,
            &name,
            &plan.last.encode(),
            XattrFlags::default(),
            &Ctx::root(),
        )
        .map_err(|e| MergeError::Apply {
            seq: plan.last.seq,
            applied: applied.seq,
            error: e,
        })?;
        applied = plan.last;
    }
    Ok(applied)
}

/// One event of file data, applied as root. A file another client removed meanwhile
/// (`interfere=allow`) has no one left to read the data: skipped.
fn apply_data(fs: &dyn FileSystem, op: &FsOp) -> Result<(), FsError> {
    let r = match op {
        FsOp::Write { ino, offset, data } => {
            fs.write(*ino, *offset, data, &Ctx::root()).map(|_| ())
        }
        FsOp::Setattr { ino, set } => fs.setattr(*ino, *set, &Ctx::root()).map(|_| ()),
        other => Err(FsError::Invalid(match other {
            FsOp::Fallocate { .. } => "fallocate in a merge",
            _ => "an operation a merge does not apply",
        })),
    };
    match r {
        Err(FsError::NotFound | FsError::Stale) => Ok(()),
        r => r,
    }
}

/// Validates and applies: the whole merge of one journal's events.
pub fn merge(
    fs: &dyn FileSystem,
    scope: &Scope,
    events: &[(u64, Event)],
    chunk: usize,
) -> Result<Plan, MergeError> {
    let w = watermark(fs, scope.root, scope.client).map_err(MergeError::Namespace)?;
    let p = plan(fs, scope, events, w)?;
    apply(fs, scope, &p, chunk)?;
    Ok(p)
}
