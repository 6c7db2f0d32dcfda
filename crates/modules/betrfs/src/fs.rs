//! The module: the in-memory side (inodes the caller knows, where each lives) and every
//! operation as one atomic batch of tree messages.
//!
//! **Atomicity.** Each operation validates everything first, then builds one [`Batch`]
//! and hands it to the tree, which logs it as one record: after a crash it happened
//! whole or not at all. Only then does the in-memory state change. A batch the tree
//! fails to take leaves the module failed (EIO until remounted), as the ext2 module
//! stops after a failed write-back. Moves too large for one batch (a directory rename
//! of a big subtree, a big file's first hard link) write an intent first and move in
//! chunks; mount finishes any move an intent names (`recover`).
//!
//! **Locking.** One mutex around [`State`] (taken as [`Locked`], which also passes the
//! batch gate); the tree has its own, always taken inside ours. Nothing waits for the
//! disk while holding ours: fsync (the log's group commit) and sync (a checkpoint) run
//! without it; a change's room (`room`: a compaction or a checkpoint when space is
//! short) is made before it is taken; and the wait for the checkpoint in flight that a
//! fast writer owes the tree comes after it is let go (`Locked`'s drop,
//! `Tree::write_behind`). Two waits are left under it, counted in the tree's
//! `checkpoint_waits`: a batch that finds the log ring or the device without room
//! until the checkpoint in flight is done. Reads of tree nodes that miss the cache
//! still happen under the tree's lock (a read of file data takes ours only to find
//! the file).
//!
//! **Inode numbers.** A number is `namespace << 40 | raw` (`record::compose`). Raw
//! numbers come from one counter; a file system starts in namespace 0. A record under a
//! path takes its namespace from its own marker, else from its directory (the root's is
//! 0), and only the raw part of the number it stores counts. So a clone of a whole tree
//! (`clone.rs`), which copies the records below it unchanged, gives every copy a new
//! number by marking the copy's top with a new namespace. Inodes under their numbers
//! (`h`) store their whole number, and link stubs name it. A rename into a directory of
//! another namespace marks the moved entry with the one it had, so its number (and all
//! numbers below it) stay. Markers and link stubs are listed in the index (`i` keys), so
//! a clone finds the ones in its tree without reading the rest: each copy of a marker
//! gets a new namespace of its own, each inode its stubs name gets a copy.

use crate::keys::{self, Loc};
use crate::record::{self, Entry, Inode, Super, BLOCK};
use crate::undo::Undoable;
use quilt_betree::{write_at_arg, Batch, Tree, WRITE_AT};
use quilt_vfs::acl::{self, Acl};
use quilt_vfs::{
    flags, rules, Attr, Ctx, DirEntry, FileSystem, FileType, FsError, Ino, KernelFs, RenameFlags,
    Result, SetAttr, StatFs, Timespec, XattrFlags,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Keys with their values, in key order.
pub(crate) type Kvs = Vec<(Vec<u8>, Vec<u8>)>;

pub const ROOT_INO: u64 = 1;
pub const LOST_FOUND_INO: u64 = 2;
pub const NAME_MAX: usize = 255;
pub const LINK_MAX: u32 = 65_000;
/// Largest file: 16 TiB, ext4's with 4 KiB blocks.
pub const MAX_FILE_SIZE: u64 = 1 << 44;
/// Most bytes of data one batch carries (a write is cut into batches of this much).
const BATCH_DATA_MAX: usize = 1 << 20;
/// Most key and value bytes a move puts in one batch before it needs an intent.
/// Files of at most this many blocks lose their data by point deletes.
pub(crate) const POINT_DELETES_MAX: u64 = 16;
/// A rename (or a file's move to its number) whose keys hold more than this moves them
/// by one range rename of the tree (`Batch::rename_prefix`: subtrees move whole, the
/// same cost at any size); a smaller one copies its keys, which leaves the tree's
/// leaves as they were (a range rename cuts the leaves at both ends of both ranges).
pub(crate) const RANGE_RENAME_BYTES: usize = 64 << 10;
/// Readdir cookies remembered (oldest forgotten first).
const COOKIES_MAX: usize = 1 << 18;
/// Extended attributes of one inode: names and values together.
const XATTR_MAX: usize = 64 << 10;

/// Options of a mount.
#[derive(Debug, Clone)]
pub struct MountOptions {
    pub read_only: bool,
    /// POSIX ACLs (on by default, as for ext2; `noacl` answers "not supported").
    pub acl: bool,
    /// The log is made durable at least this often (async mode; fsync and sync make it
    /// durable at once). `None`: only fsync, sync and unmount do.
    pub commit_interval: Option<std::time::Duration>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            read_only: false,
            acl: true,
            commit_interval: Some(std::time::Duration::from_secs(5)),
        }
    }
}

/// An inode the module has met, and where it lives.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub loc: Loc,
    pub inode: Inode,
    /// Open handles: an unlinked file keeps its data until the last is released.
    pub opens: u32,
    /// The kernel's references without a handle (lookups not forgotten): they keep
    /// nothing of an unlinked file.
    pub refs: u32,
    /// How many of the state's cache moves (`State::moves`) its path has been through.
    pub seen: u64,
}

/// Past this many pending cache moves, every cached path catches up at once and the
/// list starts again (amortized: one pass per this many directory renames).
const MOVES_MAX: usize = 64;

impl State {
    /// The node of `ino`, its path brought up to date with the directory renames since
    /// it was last taken.
    pub fn fresh(&mut self, ino: u64) -> Option<&mut Node> {
        let now = self.moves_base + self.moves.len() as u64;
        let n = self.nodes.get_mut(&ino)?;
        if n.seen < now {
            let from = (n.seen.max(self.moves_base) - self.moves_base) as usize;
            if let Loc::Path(p) = &mut n.loc {
                for set in &self.moves[from..] {
                    if let Some((f, t)) = set.iter().find(|(f, _)| p.starts_with(f)) {
                        let mut np = t.clone();
                        np.extend_from_slice(&p[f.len()..]);
                        *p = np;
                    }
                }
            }
            n.seen = now;
        }
        Some(n)
    }

    /// Records a set of simultaneous directory moves (old prefix → new) for the cached
    /// paths below them.
    pub fn push_moves(&mut self, set: Vec<(Vec<u8>, Vec<u8>)>) {
        self.moves.push(set);
        if self.moves.len() > MOVES_MAX {
            let inos: Vec<u64> = self.nodes.keys().copied().collect();
            for ino in inos {
                self.fresh(ino);
            }
            self.moves_base += self.moves.len() as u64;
            self.moves.clear();
            let by_path = self
                .nodes
                .iter()
                .filter_map(|(&ino, n)| match &n.loc {
                    Loc::Path(p) => Some((p.clone(), ino)),
                    _ => None,
                })
                .collect();
            self.by_path.replace(by_path);
        }
    }
}

/// What a batch may change in the state besides its big maps (which record their own
/// changes, `undo.rs`): copied whole at its start, all of it small.
struct Small {
    moves: Vec<Vec<(Vec<u8>, Vec<u8>)>>,
    moves_base: u64,
    next_ino: u64,
    grants: Vec<(u64, u64)>,
    next_ns: u64,
    next_zone: u64,
    zones: HashMap<u64, u64>,
    cookies: HashMap<u64, (u64, Vec<u8>)>,
    cookie_order: VecDeque<u64>,
    next_cookie: u64,
    failed: Option<String>,
}

impl State {
    /// From now on until `commit_batch` or `rollback_batch`, every change can be taken
    /// back.
    fn begin_batch(&mut self, ops: usize) -> Small {
        // About two nodes a creation (the new one, its directory), one path.
        self.nodes.begin(ops.saturating_mul(2).min(1 << 20));
        self.by_path.begin(ops.min(1 << 20));
        self.orphan_paths.begin(0);
        self.deferred = Some(FxHashSet::default());
        Small {
            moves: self.moves.clone(),
            moves_base: self.moves_base,
            next_ino: self.next_ino,
            grants: self.grants.clone(),
            next_ns: self.next_ns,
            next_zone: self.next_zone,
            zones: self.zones.clone(),
            cookies: self.cookies.clone(),
            cookie_order: self.cookie_order.clone(),
            next_cookie: self.next_cookie,
            failed: self.failed.clone(),
        }
    }

    fn commit_batch(&mut self) {
        self.deferred = None;
        self.nodes.commit();
        self.by_path.commit();
        self.orphan_paths.commit();
    }

    /// The state as `begin_batch` found it.
    fn rollback_batch(&mut self, s: Small) {
        self.deferred = None;
        self.nodes.rollback();
        self.by_path.rollback();
        self.orphan_paths.rollback();
        self.moves = s.moves;
        self.moves_base = s.moves_base;
        self.next_ino = s.next_ino;
        self.grants = s.grants;
        self.next_ns = s.next_ns;
        self.next_zone = s.next_zone;
        self.zones = s.zones;
        self.cookies = s.cookies;
        self.cookie_order = s.cookie_order;
        self.next_cookie = s.next_cookie;
        self.failed = s.failed;
    }
}

#[derive(Default, Clone)]
pub(crate) struct State {
    /// Keyed by inode numbers the module hands out itself: Fx, not SipHash (a sixth
    /// of a merge's creation was hashing).
    pub nodes: Undoable<FxHashMap<u64, Node>>,
    /// Path-key → inode, for every cached name with a path (files with one name,
    /// directories, link stubs are not here: their names resolve through the tree).
    pub by_path: Undoable<BTreeMap<Vec<u8>, u64>>,
    /// Path-key → orphan whose data is still under that path (`Loc::Orphan`).
    pub orphan_paths: Undoable<BTreeMap<Vec<u8>, u64>>,
    /// Renames of directories not yet applied to every cached path below them: each a
    /// set of simultaneous moves (old prefix → new; an exchange is two). A node's path
    /// catches up when it is next taken (`State::fresh`), so renaming a directory whose
    /// 80,000 descendants the kernel holds costs the same as one with none. `by_path`
    /// may keep a descendant's old key meanwhile: `Betrfs::load` checks what it finds.
    pub moves: Vec<Vec<(Vec<u8>, Vec<u8>)>>,
    /// Moves before `moves[0]` (applied to every cached node, then dropped).
    pub moves_base: u64,
    pub next_ino: u64,
    /// Raw inode numbers granted in advance and not yet taken (`grant_inodes`): runs
    /// `start..end` below `next_ino`, which the allocator never reaches again. In
    /// memory: a grant lasts the mount.
    pub grants: Vec<(u64, u64)>,
    pub next_ns: u64,
    /// The next zone number (`keys`, "Zones").
    pub next_zone: u64,
    /// Zone → the number of the directory at its root, as its record says (read once).
    pub zones: HashMap<u64, u64>,
    pub cookies: HashMap<u64, (u64, Vec<u8>)>,
    pub cookie_order: VecDeque<u64>,
    pub next_cookie: u64,
    pub failed: Option<String>,
    /// While a batch runs: the directories whose records its creations changed and
    /// have not put yet (`Betrfs::put_deferred`). A run of creations in one directory
    /// (a merge of a client journal) then puts the directory's record once, not once
    /// per entry. Their nodes stay in the cache until put.
    pub deferred: Option<FxHashSet<u64>>,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub ops: AtomicU64,
    pub fsyncs: AtomicU64,
    pub syncs: AtomicU64,
    pub moves_chunked: AtomicU64,
    pub range_renames: AtomicU64,
    /// Directories made zones' roots (at creation or when they moved).
    pub zones_made: AtomicU64,
    pub keys_moved: AtomicU64,
    pub range_deletes: AtomicU64,
    pub upsert_writes: AtomicU64,
    /// The tree's deletes and range deletes when it was last compacted for space.
    pub compacted_at: AtomicU64,
    pub block_puts: AtomicU64,
    /// Range and tree clones, and copy_file_range calls.
    pub clones: AtomicU64,
    pub copied_ranges: AtomicU64,
}

/// Data deleted and not yet compacted: a delete frees space only once its message
/// reaches the leaves (`Tree::compact`), so the commit thread compacts once enough is
/// owed, and `sync` whenever anything is, so that `rm; sync; df` tells the truth.
#[derive(Default)]
pub(crate) struct Freeing {
    /// Blocks of file data deleted (a sparse file's holes counted too).
    deleted_blocks: AtomicU64,
    /// `deleted_blocks` when the tree was last compacted.
    compacted_at: AtomicU64,
}

impl Freeing {
    pub(crate) fn deleted(&self, blocks: u64) {
        self.deleted_blocks.fetch_add(blocks, Relaxed);
    }

    fn owed(&self) -> u64 {
        self.deleted_blocks
            .load(Relaxed)
            .saturating_sub(self.compacted_at.load(Relaxed))
    }

    /// Compacts the tree, and marks what was deleted before as compacted.
    fn compact(&self, tree: &Tree) -> quilt_betree::Result<()> {
        let d = self.deleted_blocks.load(Relaxed);
        tree.compact()?;
        self.compacted_at.fetch_max(d, Relaxed);
        Ok(())
    }
}

/// The state locked, and the batch gate passed (the state's lock is let go first).
pub(crate) struct Locked<'a> {
    /// `Some` until dropped.
    st: Option<MutexGuard<'a, State>>,
    pass: Option<quilt_vfs::batch::Passing<'a>>,
    fs: &'a Betrfs,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.st.as_ref().expect("the state is held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.st.as_mut().expect("the state is held until dropped")
    }
}

impl Drop for Locked<'_> {
    /// Lets go of the state (and the batch gate), then pays what the changes made under
    /// it owe the tree: a wait for the checkpoint in flight (`commit`), which so holds
    /// up no other request.
    fn drop(&mut self) {
        drop(self.st.take());
        drop(self.pass.take());
        if self.fs.owes.swap(false, Relaxed) {
            if let Err(e) = self.fs.tree.catch_up() {
                // The tree remembers the failure: the next change reports it.
                tracing::error!("betrfs: waiting for the checkpoint in flight: {e}");
            }
        }
    }
}

/// The file system on a Bε-tree.
/// The refusal of a Bε-tree that holds no betrfs superblock record (a key-value store):
/// callers that also open key-value stores tell it from other refusals by this text.
pub const NOT_BETRFS: &str = "not a betrfs image: a Bε-tree without betrfs's superblock \
     record (a key-value store? see quiltfs kv)";

pub struct Betrfs {
    pub(crate) tree: Arc<Tree>,
    /// The superblock record's format version as this mount found it (`quiltfs stats`).
    sb_version: u8,
    pub(crate) st: Mutex<State>,
    /// A change logged a batch while the checkpoint in flight was too far behind: the
    /// next `Locked` to be dropped waits for it (`Tree::catch_up`), after letting go.
    owes: AtomicBool,
    /// Where changes wait while a batch runs (`apply_batch`).
    gate: quilt_vfs::Gate,
    pub(crate) opts: MountOptions,
    pub(crate) counters: Counters,
    pub(crate) freeing: Arc<Freeing>,
    pub(crate) errored: AtomicBool,
    /// Most data bytes (and moved key and value bytes) in one batch: what the tree's log
    /// takes in one record, halved, at most 1 MiB.
    pub(crate) batch_bytes: usize,
    /// Patchgroup bookkeeping (the rules that keep groups acyclic); the order itself is
    /// the log's.
    svc: quilt_patch::Services,
    /// Blocks a change that grows the file system leaves to those that do not (fixed
    /// at mount: a sixty-fourth of the tree's space, at least two nodes), beyond what
    /// the tree keeps for its own checkpoints (`quilt_betree::Space`): unlinks,
    /// renames, truncates and attribute changes still go on when writes get ENOSPC,
    /// and so does the compaction that makes deleted space free again.
    pub(crate) reserve: u64,
    /// The tree's block size.
    block_size: u64,
    /// File blocks per leaf, and the device blocks such a leaf takes, for a file
    /// written in order: leaves split three quarters full, each block stored with its
    /// key, and the leaf's index in front (`statfs` answers in file blocks).
    leaf_fill: (u64, u64),
    /// Largest encoded inode (the tree's value limit, less room).
    max_record: usize,
    flusher: Mutex<Option<Flusher>>,
}

struct Flusher {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: std::thread::JoinHandle<()>,
}

pub(crate) fn io(e: quilt_betree::Error) -> FsError {
    match e {
        quilt_betree::Error::Corrupt(m) => FsError::Corrupt(m),
        e @ quilt_betree::Error::Checksum { .. } => FsError::Corrupt(e.to_string()),
        quilt_betree::Error::Full(_) => FsError::NoSpace,
        quilt_betree::Error::Patch(e) => e.into(),
        e => FsError::Io(quilt_vfs::IoError::caused_by(e)),
    }
}

pub(crate) fn now() -> Timespec {
    Timespec::now()
}

/// The names an xattr may have here: the kernel's namespaces for ext2.
fn check_xattr_name(name: &[u8]) -> Result<()> {
    if name == acl::ACCESS || name == acl::DEFAULT {
        return Ok(());
    }
    for p in [&b"user."[..], b"trusted.", b"security."] {
        if let Some(rest) = name.strip_prefix(p) {
            if rest.is_empty() {
                return Err(FsError::Invalid("empty attribute name"));
            }
            if rest.len() > 255 {
                return Err(FsError::Range);
            }
            return Ok(());
        }
    }
    Err(FsError::NotSupported)
}

pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name.contains(&0) || name.contains(&b'/') {
        return Err(FsError::Invalid(
            "a name is non-empty and holds no '/' or NUL",
        ));
    }
    if name == b"." || name == b".." {
        return Err(FsError::Exists);
    }
    Ok(())
}

impl Betrfs {
    /// Formats a new file system on `tree` (an empty, new tree): the superblock record,
    /// the root (0755) and lost+found (0700), owned by root.
    pub fn format(tree: &Tree) -> Result<()> {
        let t = now();
        let dir = |ino, mode, nlink| Inode::new(ino, libc::S_IFDIR | mode, 0, 0, nlink, t);
        let mut b = Batch::new();
        b.put(
            keys::SUPER,
            &Super {
                next_ino: LOST_FOUND_INO + 1,
                next_ns: 1,
                next_zone: 1,
                version: 2,
                dirty: false,
                error: false,
            }
            .encode(),
        );
        b.put(&keys::meta_key(b""), &dir(ROOT_INO, 0o755, 3).encode());
        let lf = keys::child_key(b"", b"lost+found");
        b.put(
            &keys::meta_key(&lf),
            &dir(LOST_FOUND_INO, 0o700, 2).encode(),
        );
        tree.write(b).map_err(io)?;
        tree.checkpoint().map_err(io)
    }

    /// Mounts the file system on an open tree: finishes what a crash interrupted
    /// (orphans, chunked moves), then marks the image in use.
    pub fn mount(tree: Tree, opts: MountOptions) -> Result<Betrfs> {
        let sup = tree
            .get(keys::SUPER)
            .map_err(io)?
            .ok_or(FsError::Invalid(NOT_BETRFS))?;
        let sup = Super::decode(&sup)?;
        let g = tree.geometry();
        // A record of the log may take a quarter of it; half of that leaves room for the
        // keys and the inode record that travel with the data.
        let batch_bytes = ((g.log_blocks / 4).saturating_sub(4) as usize * g.block_size / 2)
            .clamp(8 << 10, BATCH_DATA_MAX);
        let max_record = g.max_value().saturating_sub(256);
        let bs = g.block_size as u64;
        let space = tree.space();
        let reserve = (space.blocks / 64).max(2 * g.node_bytes as u64 / bs);
        let leaf_fill = {
            // An entry: the block, a key of about 40 bytes and the entry's lengths; the
            // index: a prefix and a basement reference per block.
            let entry = bs + 48;
            let per_leaf = ((g.node_bytes as u64 * 3 / 4) / entry).max(1);
            let bytes = per_leaf * entry + 64 + per_leaf * 40;
            (per_leaf, bytes.div_ceil(bs))
        };
        let svc = quilt_patch::Services::new(tree.engine().clone());
        let tree = Arc::new(tree);
        let fs = Betrfs {
            svc,
            reserve,
            leaf_fill,
            block_size: bs,
            batch_bytes,
            max_record,
            tree,
            st: Mutex::new(State {
                next_ino: sup.next_ino,
                next_ns: sup.next_ns,
                next_zone: sup.next_zone,
                next_cookie: 3,
                ..State::default()
            }),
            owes: AtomicBool::new(false),
            gate: quilt_vfs::Gate::default(),
            opts,
            counters: Counters::default(),
            freeing: Arc::default(),
            errored: AtomicBool::new(sup.error),
            flusher: Mutex::new(None),
            sb_version: sup.version,
        };
        {
            let mut st = fs.lock();
            let root = fs
                .tree
                .get(&keys::meta_key(b""))
                .map_err(io)?
                .ok_or_else(|| FsError::Corrupt("the root directory's record is missing".into()))?;
            let Entry::Inode(root) = Entry::decode(&root)? else {
                return Err(FsError::Corrupt("the root is a link stub".into()));
            };
            if !root.is_dir() || root.ino != ROOT_INO {
                return Err(FsError::Corrupt(
                    "the root record is not directory 1".into(),
                ));
            }
            fs.insert(&mut st, Loc::Path(Vec::new()), root);
        }
        if !fs.opts.read_only {
            crate::recover::recover(&fs)?;
            if sup.version < 2 {
                tracing::info!("betrfs: indexing the link stubs of an older image");
                crate::recover::build_index(&fs)?;
            }
            let mut b = Batch::new();
            b.put(
                keys::SUPER,
                &Self::super_of(&fs.lock(), true, fs.errored.load(Relaxed)),
            );
            fs.tree.write(b).map_err(io)?;
            fs.tree.sync().map_err(io)?;
            if let Some(every) = fs.opts.commit_interval {
                fs.start_flusher(every);
            }
        }
        Ok(fs)
    }

    pub(crate) fn start_flusher(&self, every: std::time::Duration) {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let tree = self.tree.clone();
        let freeing = self.freeing.clone();
        // Compacting for deleted data once a sixty-fourth of the space is owed: an `rm`
        // of large files frees its space within a commit interval or two.
        let owed_max = (self.tree.space().blocks / 64).max(256);
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("betrfs-commit".into())
            .spawn(move || {
                let (m, cv) = &*s;
                let mut stopped = m.lock().unwrap_or_else(|e| e.into_inner());
                while !*stopped {
                    let (g, _) = cv
                        .wait_timeout(stopped, every)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = g;
                    if !*stopped {
                        drop(stopped);
                        if let Err(e) = tree.sync() {
                            tracing::warn!("betrfs: periodic commit failed: {e}");
                        }
                        if freeing.owed() >= owed_max {
                            if let Err(e) = freeing.compact(&tree) {
                                tracing::warn!("betrfs: compaction for deleted data failed: {e}");
                            }
                        }
                        stopped = m.lock().unwrap_or_else(|e| e.into_inner());
                    }
                }
            })
            .expect("spawn the commit thread");
        *self.flusher.lock().unwrap_or_else(|e| e.into_inner()) = Some(Flusher { stop, thread });
    }

    /// Clean unmount: stops the commit thread, marks the image clean and checkpoints.
    /// Files still open stay orphans (the next mount frees them).
    pub fn unmount(&self) -> Result<()> {
        if let Some(f) = self
            .flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            *f.stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
            f.stop.1.notify_all();
            let _ = f.thread.join();
        }
        if self.opts.read_only {
            return Ok(());
        }
        let mut b = Batch::new();
        b.put(
            keys::SUPER,
            &Self::super_of(&self.lock(), false, self.errored.load(Relaxed)),
        );
        self.tree.write(b).map_err(io)?;
        self.tree.checkpoint().map_err(io)
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// The state, after any batch another thread runs (`apply_batch`).
    pub(crate) fn lock(&self) -> Locked<'_> {
        let pass = self.gate.pass();
        Locked {
            st: Some(self.st.lock().unwrap_or_else(|e| e.into_inner())),
            pass: Some(pass),
            fs: self,
        }
    }

    /// Damage is logged and remembered in the superblock record (for fsck).
    pub(crate) fn checked<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(FsError::Corrupt(m)) = &r {
            tracing::error!("betrfs: damage found: {m}");
            if !self.errored.swap(true, Relaxed) && !self.opts.read_only {
                let mut b = Batch::new();
                b.put(keys::SUPER, &Self::super_of(&self.lock(), true, true));
                let _ = self.tree.write(b);
            }
        }
        r
    }

    pub(crate) fn writable(&self, st: &State) -> Result<()> {
        if self.opts.read_only {
            return Err(FsError::ReadOnly);
        }
        if let Some(f) = &st.failed {
            return Err(FsError::Io(
                format!("the file system stopped after a failure: {f}").into(),
            ));
        }
        Ok(())
    }

    /// Blocks `bytes` of file data take in the tree's leaves (see `leaf_fill`).
    pub(crate) fn blocks_for(&self, bytes: u64) -> u64 {
        let (per_leaf, leaf_blocks) = self.leaf_fill;
        (bytes.div_ceil(self.block_size) * leaf_blocks).div_ceil(per_leaf) + 1
    }

    /// Refuses growth when the tree is close to full: the tree's next checkpoint needs
    /// room for a copy of every dirty node, and unlinks, renames and the compaction
    /// that frees what they deleted need the reserve, so ENOSPC comes while there is
    /// room for all of them. Before answering ENOSPC it makes what it can free: a
    /// compaction when something was deleted since the last (deletes free their space
    /// only once they reach the leaves), else a checkpoint when it would free the
    /// extents of the nodes it rewrites (`Space::pending` counts their copies whole).
    /// Called before the state is taken (a compaction or a checkpoint is device I/O
    /// and waits for it), so a caller's own checks may come after: on a file system
    /// that is full, a change that would also fail for another reason fails ENOSPC.
    pub(crate) fn room(&self, bytes: u64) -> Result<()> {
        self.room_beyond(bytes, self.reserve)
    }

    /// Room for a new name (an inode record and an entry): it may take the reserve,
    /// as root may take ext2's, so that a file system full of data still takes an
    /// empty file or a directory while `statfs` shows free blocks. (The tree keeps its
    /// own margin for checkpoints and deletes whatever this lets through.)
    pub(crate) fn room_for_name(&self) -> Result<()> {
        self.room_beyond(BLOCK, 0)
    }

    fn room_beyond(&self, bytes: u64, reserve: u64) -> Result<()> {
        if self.opts.read_only {
            return Err(FsError::ReadOnly);
        }
        let need = self.blocks_for(bytes) + reserve;
        let sp = self.tree.space();
        if sp.avail() >= need {
            return Ok(());
        }
        let ts = self.tree.stats();
        let deletes = ts.deletes + ts.range_deletes;
        if self.counters.compacted_at.swap(deletes, Relaxed) != deletes {
            tracing::info!("betrfs: short of space, compacting the tree");
            self.freeing.compact(&self.tree).map_err(io)?;
        } else if sp.pending > sp.margin {
            self.tree.checkpoint().map_err(io)?;
        } else {
            return Err(FsError::NoSpace);
        }
        if self.tree.space().avail() >= need {
            return Ok(());
        }
        Err(FsError::NoSpace)
    }

    /// Hands a batch to the tree; a failure stops the module (the in-memory state may be
    /// ahead of what was logged).
    pub(crate) fn commit(&self, st: &mut State, b: Batch) -> Result<()> {
        if b.ops.is_empty() {
            return Ok(());
        }
        self.counters.ops.fetch_add(1, Relaxed);
        // The wait for the checkpoint in flight comes after the state is let go.
        match self.tree.write_behind(b) {
            Ok(owes) => {
                if owes {
                    self.owes.store(true, Relaxed);
                }
                Ok(())
            }
            // Refused before anything was logged: the tree is unchanged, but the
            // caller may have changed the cache for it (paths below a moved directory):
            // the module stops rather than serve what the tree does not hold.
            Err(quilt_betree::Error::Invalid(m)) => {
                tracing::error!("betrfs: the tree refused a batch: {m}");
                st.failed = Some(m.clone());
                Err(FsError::Io(m.into()))
            }
            // Refused before anything was logged (a checkpoint the log needed found no
            // room): the tree and the state are as they were.
            Err(quilt_betree::Error::Full(_)) => Err(FsError::NoSpace),
            Err(e) => {
                st.failed = Some(e.to_string());
                Err(io(e))
            }
        }
    }

    pub(crate) fn insert(&self, st: &mut State, loc: Loc, inode: Inode) -> u64 {
        let ino = inode.ino;
        if let Loc::Path(p) = &loc {
            st.by_path.insert(p.clone(), ino);
        }
        let seen = st.moves_base + st.moves.len() as u64;
        st.nodes.insert(
            ino,
            Node {
                loc,
                inode,
                opens: 0,
                refs: 0,
                seen,
            },
        );
        ino
    }

    pub(crate) fn forget(&self, st: &mut State, ino: u64) {
        st.fresh(ino);
        if let Some(n) = st.nodes.remove(&ino) {
            if let Loc::Path(p) = n.loc {
                if st.by_path.get(&p) == Some(&ino) {
                    st.by_path.remove(&p);
                }
            }
        }
    }

    /// The node of `ino`, its path current. After a failure that stopped the module,
    /// an error: what the cache holds may be ahead of the tree, and is never served.
    pub(crate) fn node<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a Node> {
        if let Some(f) = &st.failed {
            return Err(FsError::Io(
                format!("the file system stopped after a failure: {f}; unmount and mount it again")
                    .into(),
            ));
        }
        st.fresh(ino).map(|n| &*n).ok_or(FsError::Stale)
    }

    pub(crate) fn dir_node<'a>(&self, st: &'a mut State, ino: u64) -> Result<&'a Node> {
        let n = self.node(st, ino)?;
        if !n.inode.is_dir() {
            return Err(FsError::NotDir);
        }
        Ok(n)
    }

    /// The prefix of a directory's children: its zone's for a zone's root, else its own
    /// path-key turned into a prefix.
    pub(crate) fn prefix_of(n: &Node) -> Result<Vec<u8>> {
        if let Some(z) = n.inode.zone {
            return Ok(keys::zone_prefix(z));
        }
        match &n.loc {
            Loc::Path(p) => Ok(keys::dir_prefix(p)),
            Loc::Ino(i) | Loc::Orphan { ino: i, .. } => {
                Err(FsError::Corrupt(format!("directory {i} has no path")))
            }
        }
    }

    /// The number of the directory at the root of zone `z` (its record, read once).
    pub(crate) fn zone_root(&self, st: &mut State, z: u64) -> Result<u64> {
        if let Some(&ino) = st.zones.get(&z) {
            return Ok(ino);
        }
        let v = self
            .tree
            .get(&keys::zone_key(z))
            .map_err(io)?
            .ok_or_else(|| FsError::Corrupt(format!("zone {z} has no record")))?;
        let root = record::Zone::decode(&v)?.root;
        st.zones.insert(z, root);
        Ok(root)
    }

    /// The number of the directory holding the entry at path-key `key` (not the root).
    pub(crate) fn parent_ino(&self, st: &mut State, key: &[u8]) -> Result<u64> {
        match keys::up(key) {
            keys::Up::Zone(z) => self.zone_root(st, z),
            keys::Up::Dir(pk) => self.load(st, &pk)?.ok_or_else(|| {
                FsError::Corrupt(format!(
                    "the directory of {} is missing",
                    String::from_utf8_lossy(key)
                ))
            }),
        }
    }

    /// Longest prefix a directory outside a zone's root may have (`keys`, "Zones"): a
    /// new directory whose prefix would be longer is made a zone's root, so that every
    /// key of an entry below it, a name of up to 255 bytes and a data block's suffix
    /// included, stays within the tree's key limit, at any depth. (A directory that
    /// becomes a zone's root when it moves may leave its subtree's prefixes up to 16
    /// bytes longer than this: the zone prefix is longer than a top directory's own.)
    pub(crate) fn zone_threshold(&self) -> usize {
        self.tree
            .geometry()
            .max_key()
            .saturating_sub(2 + NAME_MAX + 1 + 8 + 16 + 16)
    }

    /// A new zone for the directory numbered `root`, its record into `b` (the caller
    /// writes the superblock record, which counts zones, in the same batch).
    pub(crate) fn new_zone(&self, st: &mut State, b: &mut Batch, root: u64) -> u64 {
        let z = st.next_zone;
        st.next_zone += 1;
        b.put(&keys::zone_key(z), &record::Zone { root }.encode());
        st.zones.insert(z, root);
        z
    }

    /// The inode named by path-key `key`, loaded into the cache.
    pub(crate) fn load(&self, st: &mut State, key: &[u8]) -> Result<Option<u64>> {
        if let Some(&ino) = st.by_path.get(key) {
            // (A key a directory rename left behind names a node now elsewhere.)
            match st.fresh(ino) {
                Some(n) if matches!(&n.loc, Loc::Path(p) if p == key) => return Ok(Some(ino)),
                _ => {
                    st.by_path.remove(&key.to_vec());
                }
            }
        }
        let Some(v) = self.tree.get(&keys::meta_key(key)).map_err(io)? else {
            return Ok(None);
        };
        match Entry::decode(&v)? {
            Entry::Inode(mut i) => {
                let ns = match i.marker {
                    Some(ns) => ns,
                    None if key.is_empty() => 0,
                    None => record::ns_of(self.parent_ino(st, key)?),
                };
                i.ino = record::compose(ns, i.ino);
                if let Some(n) = st.fresh(i.ino) {
                    if matches!(&n.loc, Loc::Path(p) if p == key) {
                        st.by_path.insert(key.to_vec(), i.ino);
                        return Ok(Some(i.ino));
                    }
                    return Err(FsError::Corrupt(format!(
                        "inode {} is named at two paths ({:?} and {:?})",
                        i.ino, n.loc, key
                    )));
                }
                Ok(Some(self.insert(st, Loc::Path(key.to_vec()), i)))
            }
            Entry::Link { ino, mode } => {
                if st.nodes.contains_key(&ino) {
                    return Ok(Some(ino));
                }
                let v = self
                    .tree
                    .get(&keys::inode_key(ino))
                    .map_err(io)?
                    .ok_or_else(|| {
                        FsError::Corrupt(format!("link to inode {ino}, which does not exist"))
                    })?;
                let i = record::decode_inode(&v)?;
                if i.ino != ino || i.mode & libc::S_IFMT != mode {
                    return Err(FsError::Corrupt(format!(
                        "link to inode {ino} finds inode {} of another type",
                        i.ino
                    )));
                }
                Ok(Some(self.insert(st, Loc::Ino(ino), i)))
            }
        }
    }

    /// Whether a name of `n` is listed in the index: a link stub, a record with a
    /// namespace marker, or a zone's root (a tree clone finds them there).
    pub(crate) fn indexed(n: &Node) -> bool {
        matches!(n.loc, Loc::Ino(_)) || n.inode.marker.is_some() || n.inode.zone.is_some()
    }

    /// The number of the inode a directory entry names (`dir`: the directory's number).
    pub(crate) fn entry_ino(e: &Entry, dir: u64) -> u64 {
        match e {
            Entry::Inode(i) => {
                record::compose(i.marker.unwrap_or_else(|| record::ns_of(dir)), i.ino)
            }
            Entry::Link { ino, .. } => *ino,
        }
    }

    /// Takes `ino` out of a grant of this mount for a new inode in directory `dir`.
    pub(crate) fn take_granted(st: &mut State, dir: u64, ino: u64) -> Result<u64> {
        if record::ns_of(ino) != record::ns_of(dir) {
            return Err(FsError::Invalid(
                "a granted number names an inode of the first namespace (not inside a clone)",
            ));
        }
        let raw = ino & (record::RAW_LIMIT - 1);
        let Some(i) = st.grants.iter().position(|&(a, b)| raw >= a && raw < b) else {
            return Err(FsError::Invalid("inode number not granted by this mount"));
        };
        let (a, b) = st.grants.swap_remove(i);
        if a < raw {
            st.grants.push((a, raw));
        }
        if raw + 1 < b {
            st.grants.push((raw + 1, b));
        }
        Ok(ino)
    }

    /// A new raw number in the namespace of directory `dir` (`dir`'s number).
    pub(crate) fn new_ino(st: &mut State, dir: u64) -> Result<u64> {
        if st.next_ino >= record::RAW_LIMIT {
            return Err(FsError::NoSpace);
        }
        let raw = st.next_ino;
        st.next_ino += 1;
        Ok(record::compose(record::ns_of(dir), raw))
    }

    pub(crate) fn lookup_in(
        &self,
        st: &mut State,
        parent: u64,
        name: &[u8],
    ) -> Result<(Vec<u8>, Option<u64>)> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let dir = self.dir_node(st, parent)?;
        if dir.inode.nlink == 0 {
            return Ok((Vec::new(), None));
        }
        let key = keys::child_key(&Self::prefix_of(dir)?, name);
        if key.len() + 10 > self.tree.geometry().max_key() {
            // No entry has such a key: before a name goes here, its directory becomes
            // a zone's root (`fit_name`), whose keys are short.
            return Ok((key, None));
        }
        let ino = self.load(st, &key)?;
        Ok((key, ino))
    }

    /// A new name's key, checked against the tree's limit (its directory has been
    /// made to fit it: `fit_name`).
    pub(crate) fn key_fits(&self, key: &[u8]) -> Result<()> {
        if key.len() + 10 > self.tree.geometry().max_key() {
            return Err(FsError::NameTooLong);
        }
        Ok(())
    }

    pub(crate) fn attr_of(&self, i: &Inode) -> Attr {
        let blocks = match i.kind() {
            FileType::Regular => i.blocks * (BLOCK / 512),
            FileType::Directory => BLOCK / 512,
            _ => 0,
        };
        Attr {
            ino: i.ino,
            kind: i.kind(),
            perm: (i.mode & 0o7777) as u16,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            size: if i.kind() == FileType::Symlink {
                i.target.len() as u64
            } else {
                i.size
            },
            blocks,
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            rdev: i.rdev,
            blksize: BLOCK as u32,
        }
    }

    pub(crate) fn put_inode(b: &mut Batch, n: &Node) {
        b.put(&n.loc.meta(), &n.inode.encode());
    }

    /// The superblock record of a mounted file system (dirty: the mount is running).
    pub(crate) fn super_record(st: &State, error: bool) -> Vec<u8> {
        Self::super_of(st, true, error)
    }

    pub(crate) fn super_of(st: &State, dirty: bool, error: bool) -> Vec<u8> {
        Super {
            next_ino: st.next_ino,
            next_ns: st.next_ns,
            next_zone: st.next_zone,
            version: 2,
            dirty,
            error,
        }
        .encode()
    }
}

impl Betrfs {
    /// A batch's operations in order (the tree held, the state recording). Creations
    /// leave their directories' records to the end of a run of creations
    /// (`State::deferred`); any other operation, which may read or move those records
    /// in the tree, finds them put first.
    fn run_batch(
        &self,
        ops: &[quilt_vfs::FsOp],
        ctx: &Ctx,
    ) -> std::result::Result<Vec<quilt_vfs::FsReply>, quilt_vfs::BatchError> {
        use quilt_vfs::{BatchError, FsOp};
        let mut out = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let creates = matches!(
                op,
                FsOp::Mknod { .. } | FsOp::Mkdir { .. } | FsOp::Symlink { .. }
            );
            if !creates {
                self.put_deferred().map_err(|e| BatchError::at(i, e))?;
            }
            out.push(op.apply(self, ctx).map_err(|e| BatchError::at(i, e))?);
        }
        self.put_deferred()
            .map_err(|e| BatchError::at(ops.len().saturating_sub(1), e))?;
        Ok(out)
    }

    /// Puts the records of the directories the batch's creations changed (as the
    /// cache has them now: path current, the last creation's times and links).
    fn put_deferred(&self) -> Result<()> {
        let mut st = self.lock();
        let Some(dirs) = st.deferred.as_mut().filter(|d| !d.is_empty()) else {
            return Ok(());
        };
        let dirs: Vec<u64> = dirs.drain().collect();
        let mut b = Batch::new();
        for ino in dirs {
            // Creations never remove a directory, and the cache keeps a deferred one.
            let n = st.fresh(ino).ok_or_else(|| {
                FsError::Io(format!("directory {ino} left the cache with its record unput").into())
            })?;
            Self::put_inode(&mut b, n);
        }
        self.commit(&mut st, b)
    }

    // Creations, with an inode number from a grant or the counter's.

    fn mknod_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        match FileType::from_mode(mode) {
            Some(FileType::Directory) | Some(FileType::Symlink) | None => {
                return Err(FsError::Invalid(
                    "mknod of a directory, symlink or unknown type",
                ))
            }
            _ => {}
        }
        let r = self.create(parent, name, mode, rdev, b"", ctx, false, want);
        self.checked(r)
    }

    fn mkdir_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        let r = self.create(
            parent,
            name,
            libc::S_IFDIR | (mode & 0o7777),
            0,
            b"",
            ctx,
            false,
            want,
        );
        self.checked(r)
    }

    fn symlink_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        ctx: &Ctx,
    ) -> Result<Attr> {
        quilt_vfs::rules::check_symlink_target(target, BLOCK as usize)?;
        let r = self.create(
            parent,
            name,
            libc::S_IFLNK | 0o777,
            0,
            target,
            ctx,
            false,
            want,
        );
        self.checked(r)
    }
}

/// References the kernel holds without a handle: an unlinked file only they keep is
/// freed at the unlink.
impl KernelFs for Betrfs {
    fn reference(&self, ino: Ino) -> Result<()> {
        let mut st = self.lock();
        let n = st.nodes.get_mut(&ino).ok_or(FsError::Stale)?;
        n.refs += 1;
        Ok(())
    }

    /// The kernel forgot the inode: with no handle open either, nothing but the tree
    /// needs it, and the cache lets it go (a later lookup reads it again), so a mount's
    /// memory follows what the kernel holds, not everything it ever looked up.
    fn unreference(&self, ino: Ino) -> Result<()> {
        let mut st = self.lock();
        // A directory whose record a running batch has still to put stays.
        let deferred = st.deferred.as_ref().is_some_and(|d| d.contains(&ino));
        if let Some(n) = st.nodes.get_mut(&ino) {
            n.refs = n.refs.saturating_sub(1);
            if n.refs == 0 && n.opens == 0 && n.inode.nlink > 0 && ino != ROOT_INO && !deferred {
                self.forget(&mut st, ino);
            }
        }
        Ok(())
    }
}

impl FileSystem for Betrfs {
    fn root(&self) -> Ino {
        ROOT_INO
    }

    fn check_writable(&self) -> Result<()> {
        self.writable(&self.lock())
    }

    fn patchgroups(&self) -> Option<&dyn quilt_vfs::Patchgroups> {
        Some(&self.svc)
    }

    /// The group's order is the log's: a group's changes were logged after those of
    /// every group it depends on, and recovery replays a prefix of the log. So making
    /// the log durable up to now makes the group and everything before it durable.
    fn pg_sync(&self, pg: quilt_vfs::PgId) -> Result<()> {
        self.svc
            .pg_sync(quilt_patch::PatchgroupId(pg))
            .map_err(quilt_patch::pg_error)?;
        self.tree.sync().map_err(io)
    }

    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        let r = (|| {
            let mut st = self.lock();
            if name == b"." {
                return Ok(self.attr_of(&self.dir_node(&mut st, parent)?.inode));
            }
            if name == b".." {
                let d = self.dir_node(&mut st, parent)?;
                let Loc::Path(key) = d.loc.clone() else {
                    return Err(FsError::NotFound);
                };
                let ino = if key.is_empty() {
                    ROOT_INO
                } else {
                    self.parent_ino(&mut st, &key)?
                };
                return Ok(self.attr_of(&self.node(&mut st, ino)?.inode));
            }
            let (_, ino) = self.lookup_in(&mut st, parent, name)?;
            let ino = ino.ok_or(FsError::NotFound)?;
            Ok(self.attr_of(&self.node(&mut st, ino)?.inode))
        })();
        self.checked(r)
    }

    fn getattr(&self, ino: Ino) -> Result<Attr> {
        let mut st = self.lock();
        Ok(self.attr_of(&self.node(&mut st, ino)?.inode))
    }

    fn setattr(&self, ino: Ino, set: SetAttr, _ctx: &Ctx) -> Result<Attr> {
        let mut st = self.lock();
        self.writable(&st)?;
        let mut n = self.node(&mut st, ino)?.clone();
        rules::refuse_setattr(n.inode.flags, &set)?;
        let t = now();
        let old_size = n.inode.size;
        if let Some(size) = set.size {
            if n.inode.is_dir() {
                return Err(FsError::IsDir);
            }
            if !n.inode.is_reg() {
                return Err(FsError::Invalid("truncate of a non-regular file"));
            }
            if size > MAX_FILE_SIZE {
                return Err(FsError::TooBig);
            }
        }
        // Blocks a truncation takes away (counted while the size is the old one).
        let removed = match set.size {
            Some(size) if size < old_size => self.present_in(&n, size.div_ceil(BLOCK), u64::MAX)?,
            _ => 0,
        };
        let i = &mut n.inode;
        if let Some(mode) = set.mode {
            i.mode = (i.mode & libc::S_IFMT) | (mode & 0o7777);
            if self.opts.acl {
                if let Some(v) = i.xattr(acl::ACCESS) {
                    let mut a = Acl::from_xattr(v)?;
                    a.chmod(i.mode);
                    i.set_xattr(acl::ACCESS, Some(a.to_xattr()));
                }
            }
        }
        if let Some(uid) = set.uid {
            i.uid = uid;
        }
        if let Some(gid) = set.gid {
            i.gid = gid;
        }
        if (set.uid.is_some() || set.gid.is_some()) && set.mode.is_none() && !i.is_dir() {
            i.mode = rules::kill_suid_sgid(i.mode);
        }
        if let Some(a) = set.atime {
            i.atime = a.resolve();
        }
        if let Some(m) = set.mtime {
            i.mtime = m.resolve();
        }
        i.ctime = set.ctime.unwrap_or(t);
        let mut b = Batch::new();
        if let Some(size) = set.size {
            if size != old_size && set.mtime.is_none() {
                i.mtime = t;
            }
            i.size = size;
            i.blocks = i.blocks.saturating_sub(removed);
            self.truncate_msgs(&mut b, &n.loc, old_size, size);
        }
        Self::put_inode(&mut b, &n);
        self.commit(&mut st, b)?;
        let a = self.attr_of(&n.inode);
        st.nodes.insert(ino, n);
        Ok(a)
    }

    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr> {
        self.mknod_in(None, parent, name, mode, rdev, ctx)
    }

    fn mknod_as(
        &self,
        ino: Ino,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        self.mknod_in(Some(ino), parent, name, mode, rdev, ctx)
    }

    fn mkdir_as(&self, ino: Ino, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.mkdir_in(Some(ino), parent, name, mode, ctx)
    }

    fn symlink_as(
        &self,
        ino: Ino,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        ctx: &Ctx,
    ) -> Result<Attr> {
        self.symlink_in(Some(ino), parent, name, target, ctx)
    }

    /// The batch runs with the gate held (no other change between its operations), on
    /// a tree that holds its batches: they are logged as one record when all
    /// succeeded; on a failure the tree is read again from its log and the state is
    /// put back as it was.
    fn apply_batch(
        &self,
        ops: &[quilt_vfs::FsOp],
        ctx: &Ctx,
    ) -> std::result::Result<Vec<quilt_vfs::FsReply>, quilt_vfs::BatchError> {
        use quilt_vfs::BatchError;
        quilt_vfs::batch::check_batchable(ops)?;
        let _held = self.gate.batch().map_err(|e| BatchError::at(0, e))?;
        let before = {
            let mut st = self.lock();
            self.writable(&st).map_err(|e| BatchError::at(0, e))?;
            st.begin_batch(ops.len())
        };
        if let Err(e) = self.tree.hold() {
            self.lock().commit_batch();
            return Err(BatchError::at(0, io(e)));
        }
        match self.run_batch(ops, ctx) {
            Ok(replies) => match self.tree.release() {
                Ok(()) => {
                    self.lock().commit_batch();
                    Ok(replies)
                }
                Err(e) => {
                    self.lock().commit_batch();
                    // Applied and not logged: what the cache holds is ahead of the tree.
                    let m = format!("a batch could not be logged: {e}");
                    tracing::error!("betrfs: {m}");
                    self.lock().failed = Some(m.clone());
                    Err(BatchError::at(
                        ops.len().saturating_sub(1),
                        FsError::Io(m.into()),
                    ))
                }
            },
            Err(e) => {
                match self.tree.rollback() {
                    Ok(()) => self.lock().rollback_batch(before),
                    Err(r) => {
                        let m = format!("rolling back a batch: {r}");
                        tracing::error!("betrfs: {m}");
                        let mut st = self.lock();
                        st.commit_batch();
                        st.failed = Some(m);
                    }
                }
                Err(e)
            }
        }
    }

    fn grant_inodes(&self, count: u64) -> Result<quilt_vfs::InoGrant> {
        let r = self.grant(count);
        self.checked(r)
    }

    fn hold_inodes(&self, grant: quilt_vfs::InoGrant) -> Result<()> {
        let r = self.hold(grant);
        self.checked(r)
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.mkdir_in(None, parent, name, mode, ctx)
    }

    fn tmpfile(&self, parent: Ino, mode: u32, ctx: &Ctx) -> Result<Attr> {
        let r = self.create(
            parent,
            b"",
            libc::S_IFREG | (mode & 0o7777),
            0,
            b"",
            ctx,
            true,
            None,
        );
        self.checked(r)
    }

    fn unlink(&self, parent: Ino, name: &[u8], _ctx: &Ctx) -> Result<()> {
        let r = self.remove(parent, name, false);
        self.checked(r)
    }

    fn rmdir(&self, parent: Ino, name: &[u8], _ctx: &Ctx) -> Result<()> {
        let r = self.remove(parent, name, true);
        self.checked(r)
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.symlink_in(None, parent, name, target, ctx)
    }

    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        if n.inode.kind() != FileType::Symlink {
            return Err(FsError::Invalid("not a symbolic link"));
        }
        Ok(n.inode.target.clone())
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
        let r = self.do_rename(parent, name, new_parent, new_name, flags, ctx);
        self.checked(r)
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], _ctx: &Ctx) -> Result<Attr> {
        check_name(new_name)?;
        let r = (|| {
            let mut st = self.lock();
            self.writable(&st)?;
            self.fit_name(&mut st, new_parent, new_name.len())?;
            let (key, existing) = self.lookup_in(&mut st, new_parent, new_name)?;
            let dp = self.node(&mut st, new_parent)?.clone();
            if dp.inode.nlink == 0 {
                return Err(FsError::NotFound);
            }
            if existing.is_some() {
                return Err(FsError::Exists);
            }
            self.key_fits(&key)?;
            let n = self.node(&mut st, ino)?.clone();
            rules::refuse_new_entry(dp.inode.flags)?;
            rules::refuse_if_frozen(n.inode.flags)?;
            if n.inode.is_dir() {
                return Err(FsError::Perm);
            }
            if n.inode.nlink >= LINK_MAX {
                return Err(FsError::TooManyLinks);
            }
            let t = now();
            let mut b = Batch::new();
            let stub = Entry::link_stub(ino, n.inode.mode);
            self.evict_orphans(&mut st, &key, false)?;
            // (An eviction may have moved this very file: read it again.)
            let mut n = self.node(&mut st, ino)?.clone();
            match n.loc.clone() {
                Loc::Path(old) => {
                    // The second name: the inode and its data move under its number,
                    // and the first name becomes a stub too.
                    self.to_inode_space(&mut st, &mut b, &mut n, 0)?;
                    b.put(&keys::meta_key(&old), &stub);
                    b.put(&keys::index_key(&old), b"");
                }
                Loc::Orphan { .. } => {
                    // An unlinked open file named again (linkat of an O_TMPFILE-like
                    // handle): under its number first.
                    self.to_inode_space(&mut st, &mut b, &mut n, 0)?;
                    b.delete(&keys::orphan_key(ino));
                }
                Loc::Ino(i) => {
                    if n.inode.nlink == 0 {
                        b.delete(&keys::orphan_key(i));
                    }
                }
            }
            n.inode.nlink += 1;
            n.inode.ctime = t;
            b.put(&keys::meta_key(&key), &stub);
            b.put(&keys::index_key(&key), b"");
            Self::put_inode(&mut b, &n);
            let mut dp = dp;
            dp.inode.mtime = t;
            dp.inode.ctime = t;
            Self::put_inode(&mut b, &dp);
            self.commit(&mut st, b)?;
            st.nodes.insert(new_parent, dp);
            let a = self.attr_of(&n.inode);
            st.nodes.insert(ino, n);
            Ok(a)
        })();
        self.checked(r)
    }

    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_into(ino, offset, size, &mut out)?;
        Ok(out)
    }

    fn read_into(&self, ino: Ino, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<()> {
        let n = {
            let mut st = self.lock();
            let n = self.node(&mut st, ino)?;
            if n.inode.is_dir() {
                return Err(FsError::IsDir);
            }
            n.clone()
        };
        // Without our lock: the tree's reads serve concurrent readers; a read racing a
        // write of the same bytes sees either version of each block, as POSIX allows
        // between unsynchronized callers.
        let r = self.read_data_into(&n, offset, size, out);
        self.checked(r)
    }

    fn write(&self, ino: Ino, offset: u64, data: &[u8], _ctx: &Ctx) -> Result<u32> {
        let r = (|| {
            // Room first, before the state is taken: making it may wait for a
            // compaction or a checkpoint.
            let fits = data
                .len()
                .min(MAX_FILE_SIZE.saturating_sub(offset) as usize);
            if fits > 0 {
                self.room(fits as u64)?;
            }
            let mut st = self.lock();
            self.writable(&st)?;
            let mut n = self.node(&mut st, ino)?.clone();
            if n.inode.is_dir() {
                return Err(FsError::IsDir);
            }
            if !n.inode.is_reg() {
                return Err(FsError::Invalid("write to a non-regular file"));
            }
            if n.inode.flags & flags::IMMUTABLE != 0
                || (n.inode.flags & flags::APPEND != 0 && offset < n.inode.size)
            {
                return Err(FsError::Perm);
            }
            if offset >= MAX_FILE_SIZE && !data.is_empty() {
                return Err(FsError::TooBig);
            }
            let data = &data[..data.len().min((MAX_FILE_SIZE - offset) as usize)];
            if data.is_empty() {
                return Ok(0);
            }
            let t = now();
            let mut done = 0usize;
            while done < data.len() {
                let part = &data[done..(done + self.batch_bytes).min(data.len())];
                let at = offset + done as u64;
                let mut b = Batch::new();
                self.write_msgs(&mut b, &mut n, at, part)?;
                n.inode.mtime = t;
                n.inode.ctime = t;
                Self::put_inode(&mut b, &n);
                self.commit(&mut st, b)?;
                st.nodes.insert(ino, n.clone());
                done += part.len();
            }
            Ok(data.len() as u32)
        })();
        self.checked(r)
    }

    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32, _ctx: &Ctx) -> Result<()> {
        const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        if mode & !(KEEP | PUNCH) != 0 || (mode & PUNCH != 0 && mode & KEEP == 0) {
            return Err(FsError::NotSupported);
        }
        if length == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes"));
        }
        // Preallocation checks the room first, before the state is taken (see `room`):
        // the call fails with ENOSPC, as ext4's does, when the tree cannot take it now
        // (a copy-on-write tree can promise no more: a later write there takes new
        // space whatever was done now).
        if mode & PUNCH == 0 && offset.saturating_add(length) <= MAX_FILE_SIZE {
            self.room(length)?;
        }
        let mut st = self.lock();
        self.writable(&st)?;
        let mut n = self.node(&mut st, ino)?.clone();
        if n.inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if !n.inode.is_reg() {
            return Err(FsError::NoDevice);
        }
        if n.inode.flags & flags::IMMUTABLE != 0
            || (n.inode.flags & flags::APPEND != 0 && mode & PUNCH != 0)
        {
            return Err(FsError::Perm);
        }
        let end = offset.saturating_add(length);
        if end > MAX_FILE_SIZE {
            return Err(FsError::TooBig);
        }
        let mut b = Batch::new();
        let t = now();
        if mode & PUNCH != 0 {
            let end = end.min(n.inode.size.div_ceil(BLOCK) * BLOCK);
            if offset >= end {
                return Ok(());
            }
            // Whole blocks go; the partial ones at the edges get zeros.
            let first_whole = offset.div_ceil(BLOCK);
            let last_whole = end / BLOCK;
            if first_whole < last_whole {
                let removed = self.present_in(&n, first_whole, last_whole)?;
                b.delete_range(&n.loc.data_key(first_whole), &n.loc.data_key(last_whole));
                n.inode.blocks = n.inode.blocks.saturating_sub(removed);
            }
            // Edges: zeros written into blocks that are there; a hole stays a hole.
            let edge = |blk: u64| self.present(&n, blk);
            let (e1, e2) = (edge(offset / BLOCK)?, edge(end.saturating_sub(1) / BLOCK)?);
            let zero = |b: &mut Batch, from: u64, to: u64| {
                let there = if from / BLOCK == offset / BLOCK {
                    e1
                } else {
                    e2
                };
                if from < to && there {
                    let z = vec![0u8; (to - from) as usize];
                    b.upsert(
                        &n.loc.data_key(from / BLOCK),
                        WRITE_AT,
                        &write_at_arg(from % BLOCK, &z),
                    );
                }
            };
            if first_whole > last_whole {
                zero(&mut b, offset, end);
            } else {
                zero(&mut b, offset, (first_whole * BLOCK).min(end));
                zero(&mut b, (last_whole * BLOCK).max(offset), end);
            }
        } else {
            // Preallocation: blocks without data become present zero blocks (an empty
            // value), so SEEK_DATA sees them as the kernel's allocated blocks.
            let first = offset / BLOCK;
            // With KEEP_SIZE, only the part inside the file: no block lies past a file's
            // size here (unlink, truncate and fsck rely on it). A range wholly past the
            // end allocates nothing and succeeds, as on ext4 (whose blocks there would
            // be invisible until the file grows).
            let last = if mode & KEEP != 0 {
                end.min(n.inode.size).div_ceil(BLOCK).max(first)
            } else {
                end.div_ceil(BLOCK)
            };
            // In batches the log takes (a key and an empty value a block).
            let per_key = n.loc.data_key(first).len() + 32;
            let per_batch = (self.batch_bytes / per_key).max(1) as u64;
            let prefix = n.loc.data_prefix();
            let mut at = first;
            while at < last {
                let to = (at + per_batch).min(last);
                // Which blocks are present: the keys only (a preallocation over data
                // read every block of it before).
                let mut present = std::collections::HashSet::new();
                let mut ks = self
                    .tree
                    .keys(&n.loc.data_key(at), Some(&n.loc.data_key(to)));
                while let Some(kv) = ks.next_key() {
                    let (k, _) = kv.map_err(io)?;
                    if let Some(blk) = keys::block_of(&prefix, k) {
                        present.insert(blk);
                    }
                }
                for blk in at..to {
                    if !present.contains(&blk) {
                        b.put(&n.loc.data_key(blk), b"");
                        n.inode.blocks += 1;
                    }
                }
                at = to;
                if at < last {
                    Self::put_inode(&mut b, &n);
                    self.commit(&mut st, std::mem::take(&mut b))?;
                    st.nodes.insert(ino, n.clone());
                }
            }
            if mode & KEEP == 0 && end > n.inode.size {
                n.inode.size = end;
            }
        }
        n.inode.ctime = t;
        n.inode.mtime = t;
        Self::put_inode(&mut b, &n);
        self.commit(&mut st, b)?;
        st.nodes.insert(ino, n);
        Ok(())
    }

    fn seek_data(&self, ino: Ino, offset: u64, data: bool) -> Result<u64> {
        let n = {
            let mut st = self.lock();
            let n = self.node(&mut st, ino)?;
            if !n.inode.is_reg() {
                return Err(FsError::Invalid("seek in a non-regular file"));
            }
            n.clone()
        };
        let size = n.inode.size;
        if offset >= size {
            return Err(FsError::NoData);
        }
        // Every block present (the count is exact; fsck checks it key by key): data here
        // and the only hole at the end, without a scan. Otherwise a keys-only scan,
        // which reads the leaves' indexes and not the data.
        if n.inode.blocks >= size.div_ceil(BLOCK) {
            return Ok(if data { offset } else { size });
        }
        let blk = offset / BLOCK;
        if data {
            return match self.next_present(&n, blk)? {
                Some(b) if b * BLOCK < size => Ok(offset.max(b * BLOCK)),
                _ => Err(FsError::NoData),
            };
        }
        // The first block from `blk` on that is not present: the tree walks leaves with
        // nothing pending in place, a comparison per key.
        let hole = self.first_absent(&n, blk)?;
        Ok(offset.max(hole * BLOCK).min(size))
    }

    fn get_flags(&self, ino: Ino) -> Result<u32> {
        let mut st = self.lock();
        Ok(self.node(&mut st, ino)?.inode.flags & rules::VISIBLE)
    }

    fn set_flags(&self, ino: Ino, f: u32, ctx: &Ctx) -> Result<()> {
        let mut st = self.lock();
        self.writable(&st)?;
        let mut n = self.node(&mut st, ino)?.clone();
        n.inode.flags = rules::set_flags(n.inode.flags, f, n.inode.mode, n.inode.uid, ctx)?;
        n.inode.ctime = now();
        let mut b = Batch::new();
        Self::put_inode(&mut b, &n);
        self.commit(&mut st, b)?;
        st.nodes.insert(ino, n);
        Ok(())
    }

    fn check_open(&self, ino: Ino, open_flags: i32, _ctx: &Ctx) -> Result<()> {
        let mut st = self.lock();
        rules::check_open(self.node(&mut st, ino)?.inode.flags, open_flags)
    }

    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        let r = (|| {
            let (prefix, parent_ino, after) = {
                let mut st = self.lock();
                let d = self.dir_node(&mut st, ino)?.clone();
                if d.inode.nlink == 0 {
                    return Ok(());
                }
                let Loc::Path(key) = &d.loc else {
                    return Err(FsError::Corrupt(format!("directory {ino} has no path")));
                };
                let key = key.clone();
                let parent_ino = if key.is_empty() {
                    ROOT_INO
                } else {
                    self.parent_ino(&mut st, &key)?
                };
                let after = match offset {
                    0..=2 => None,
                    c => match st.cookies.get(&c) {
                        Some((dir, name)) if *dir == ino => Some(name.clone()),
                        _ => return Err(FsError::Invalid("unknown directory cookie")),
                    },
                };
                (Self::prefix_of(&d)?, parent_ino, after)
            };
            if offset == 0
                && !emit(DirEntry {
                    ino,
                    kind: FileType::Directory,
                    name: b".".to_vec(),
                    next_offset: 1,
                })
            {
                return Ok(());
            }
            if offset <= 1
                && !emit(DirEntry {
                    ino: parent_ino,
                    kind: FileType::Directory,
                    name: b"..".to_vec(),
                    next_offset: 2,
                })
            {
                return Ok(());
            }
            let base = keys::meta_key(&keys::child_key(&prefix, b""));
            let hi = keys::prefix_end(&base);
            let lo = match &after {
                None => base.clone(),
                Some(name) => {
                    let mut k = base.clone();
                    k.extend_from_slice(name);
                    k.push(0);
                    k
                }
            };
            for kv in self.tree.range(&lo, Some(&hi)) {
                let (k, v) = kv.map_err(io)?;
                let name = k[base.len()..].to_vec();
                let e = Entry::decode(&v)?;
                let e_ino = Self::entry_ino(&e, ino);
                let cookie = {
                    let mut st = self.lock();
                    // The entry's inode becomes known, as after a lookup, so callers of
                    // the library may use the numbers readdir gives (read afresh under
                    // our lock: the scan may predate a change).
                    if !st.nodes.contains_key(&e_ino) {
                        self.load(&mut st, &k[1..])?;
                    }
                    let c = st.next_cookie;
                    st.next_cookie += 1;
                    st.cookies.insert(c, (ino, name.clone()));
                    st.cookie_order.push_back(c);
                    if st.cookie_order.len() > COOKIES_MAX {
                        if let Some(old) = st.cookie_order.pop_front() {
                            st.cookies.remove(&old);
                        }
                    }
                    c
                };
                if !emit(DirEntry {
                    ino: e_ino,
                    kind: e.kind(),
                    name,
                    next_offset: cookie,
                }) {
                    break;
                }
            }
            Ok(())
        })();
        self.checked(r)
    }

    fn statfs(&self) -> Result<StatFs> {
        // Free is what changes may still take (the tree's next checkpoint and margin
        // set aside); available, what writes may (the reserve for unlinks and renames
        // set aside too), in blocks of file data (a block's key and entry count).
        let sp = self.tree.space();
        let bs = self.block_size;
        let (per_leaf, leaf_blocks) = self.leaf_fill;
        let data = |blocks: u64| blocks * per_leaf / leaf_blocks;
        let free = sp.avail();
        let avail = free.saturating_sub(self.reserve);
        Ok(StatFs {
            block_size: bs as u32,
            blocks: data(sp.blocks.saturating_sub(sp.margin)),
            blocks_free: data(free),
            blocks_avail: data(avail),
            // No inode table: as many names as blocks could hold.
            files: sp.blocks * (bs / 256),
            files_free: avail * (bs / 256),
            name_max: NAME_MAX as u32,
        })
    }

    fn fsync(&self, ino: Ino, _datasync: bool) -> Result<()> {
        {
            let mut st = self.lock();
            self.node(&mut st, ino)?;
        }
        self.counters.fsyncs.fetch_add(1, Relaxed);
        // The log is one sequence: making it durable up to now covers the file's
        // changes and everything before them (the names leading to it included).
        self.tree.sync().map_err(io)
    }

    fn sync_all(&self) -> Result<()> {
        self.counters.syncs.fetch_add(1, Relaxed);
        if self.opts.read_only {
            return Ok(());
        }
        if self.freeing.owed() > 0 {
            // (A compaction ends with a checkpoint.)
            return self.freeing.compact(&self.tree).map_err(io);
        }
        self.tree.checkpoint().map_err(io)
    }

    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        f: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        self.set_xattr(ino, name, Some(value), f, ctx)
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        check_xattr_name(name)?;
        if !self.opts.acl && (name == acl::ACCESS || name == acl::DEFAULT) {
            return Err(FsError::NotSupported);
        }
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        n.inode
            .xattr(name)
            .map(<[u8]>::to_vec)
            .ok_or(FsError::NoAttr)
    }

    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        let mut st = self.lock();
        let n = self.node(&mut st, ino)?;
        let mut out = Vec::new();
        for (name, _) in &n.inode.xattrs {
            if !self.opts.acl && (name == acl::ACCESS || name == acl::DEFAULT) {
                continue;
            }
            out.extend_from_slice(name);
            out.push(0);
        }
        Ok(out)
    }

    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.set_xattr(ino, name, None, XattrFlags::default(), ctx)
    }

    fn open(&self, ino: Ino) -> Result<()> {
        let mut st = self.lock();
        let n = st.nodes.get_mut(&ino).ok_or(FsError::Stale)?;
        n.opens += 1;
        Ok(())
    }

    fn release(&self, ino: Ino) -> Result<()> {
        let mut st = self.lock();
        let Some(n) = st.nodes.get_mut(&ino) else {
            return Ok(());
        };
        n.opens = n.opens.saturating_sub(1);
        if n.opens == 0 && n.inode.nlink == 0 {
            let r = self.destroy(&mut st, ino);
            return self.checked(r);
        }
        Ok(())
    }

    fn clone_file(
        &self,
        src: Ino,
        src_off: u64,
        dst: Ino,
        dst_off: u64,
        len: u64,
        ctx: &Ctx,
    ) -> Result<u64> {
        self.clone_blocks(src, src_off, dst, dst_off, len, ctx)
    }

    fn copy_file_range(
        &self,
        src: Ino,
        src_off: u64,
        dst: Ino,
        dst_off: u64,
        len: u64,
        ctx: &Ctx,
    ) -> Result<u64> {
        self.copy_range(src, src_off, dst, dst_off, len, ctx)
    }

    fn clone_tree(&self, src: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.clone_subtree(src, new_parent, new_name, ctx)
    }

    fn counters(&self) -> quilt_vfs::Counters {
        let c = &self.counters;
        let s = self.tree.stats();
        let st = self.lock();
        let versions = self.tree.format_versions();
        vec![
            // The on-disk formats (quiltfs-formats(5)): the superblock record's as found
            // at mount, the tree header's as last read or written, and the node format
            // this build writes.
            (
                "format.superblock_version".into(),
                u64::from(self.sb_version),
            ),
            (
                "format.tree_header_version".into(),
                u64::from(versions.header),
            ),
            (
                "format.node_version_written".into(),
                u64::from(versions.node_written),
            ),
            ("fs.ops".into(), c.ops.load(Relaxed)),
            ("fs.fsyncs".into(), c.fsyncs.load(Relaxed)),
            ("fs.syncs".into(), c.syncs.load(Relaxed)),
            ("fs.inodes_cached".into(), st.nodes.len() as u64),
            ("fs.block_puts".into(), c.block_puts.load(Relaxed)),
            ("fs.upsert_writes".into(), c.upsert_writes.load(Relaxed)),
            ("fs.range_deletes".into(), c.range_deletes.load(Relaxed)),
            ("fs.keys_moved".into(), c.keys_moved.load(Relaxed)),
            ("fs.moves_chunked".into(), c.moves_chunked.load(Relaxed)),
            ("fs.range_renames".into(), c.range_renames.load(Relaxed)),
            ("fs.zones_made".into(), c.zones_made.load(Relaxed)),
            ("tree.range_renames".into(), s.range_renames),
            ("tree.subtrees_moved".into(), s.subtrees_moved),
            ("tree.lifts_pushed".into(), s.lifts_pushed),
            ("fs.clones".into(), c.clones.load(Relaxed)),
            ("fs.copied_ranges".into(), c.copied_ranges.load(Relaxed)),
            ("tree.range_clones".into(), s.range_clones),
            ("tree.subtrees_shared".into(), s.subtrees_shared),
            ("tree.shared_nodes".into(), s.shared_nodes),
            ("tree.cow_copies".into(), s.cow_copies),
            ("tree.cow_bytes".into(), s.cow_bytes),
            ("tree.height".into(), s.height),
            ("tree.flushes".into(), s.flushes),
            ("tree.checkpoints".into(), s.checkpoints),
            ("tree.syncs".into(), s.syncs),
            ("tree.node_writes".into(), s.node_writes),
            ("tree.log_bytes".into(), s.log_bytes),
            ("tree.cache_bytes".into(), s.cache_bytes),
            ("tree.device_bytes_written".into(), s.device_bytes_written),
            ("tree.device_bytes_read".into(), s.device_bytes_read),
            ("tree.device_flushes".into(), s.device_flushes),
        ]
    }
}

impl Betrfs {
    fn set_xattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: Option<&[u8]>,
        f: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        check_xattr_name(name)?;
        let is_acl = name == acl::ACCESS || name == acl::DEFAULT;
        if is_acl && !self.opts.acl {
            return Err(FsError::NotSupported);
        }
        let mut st = self.lock();
        self.writable(&st)?;
        let mut n = self.node(&mut st, ino)?.clone();
        rules::refuse_if_frozen(n.inode.flags)?;
        let exists = n.inode.xattr(name).is_some();
        let mut store = value.map(<[u8]>::to_vec);
        if is_acl {
            if ctx.uid != 0 && ctx.uid != n.inode.uid {
                return Err(FsError::Perm);
            }
            let parsed = value.map(Acl::from_xattr).transpose()?;
            if name == acl::DEFAULT && !n.inode.is_dir() {
                return if parsed.is_some() {
                    Err(FsError::Access)
                } else {
                    Ok(())
                };
            }
            if f.create && exists && parsed.is_some() {
                return Err(FsError::Exists);
            }
            if f.replace && !exists {
                return Err(FsError::NoAttr);
            }
            store = parsed.as_ref().map(Acl::to_xattr);
            if let (true, Some(a)) = (name == acl::ACCESS, &parsed) {
                let mut mode = (n.inode.mode & !0o777) | a.mode_bits();
                if f.kill_sgid {
                    mode &= !libc::S_ISGID;
                }
                n.inode.mode = mode;
                if a.is_mode() {
                    store = None;
                }
            }
            if store.is_none() && !exists && parsed.is_none() {
                return Ok(());
            }
        } else {
            match (value, exists) {
                (None, false) => return Err(FsError::NoAttr),
                (Some(_), true) if f.create => return Err(FsError::Exists),
                (Some(_), false) if f.replace => return Err(FsError::NoAttr),
                _ => {}
            }
        }
        n.inode.set_xattr(name, store);
        if n.inode.xattr_bytes() > XATTR_MAX || n.inode.encode().len() > self.max_record {
            return Err(FsError::NoSpace);
        }
        n.inode.ctime = now();
        let mut b = Batch::new();
        Self::put_inode(&mut b, &n);
        self.commit(&mut st, b)?;
        st.nodes.insert(ino, n);
        Ok(())
    }
}
