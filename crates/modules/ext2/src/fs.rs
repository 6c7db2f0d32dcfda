//! Mounting, the in-memory superblock and group descriptors, the helpers every operation
//! uses to turn changes into patches (and to declare or drop dependencies by mode), and
//! the `FileSystem` trait implementation.

use crate::alloc::Grants;
use crate::files::Files;
use crate::format::*;
use crate::pending::{Frees, Syncs};
use quilt_patch::{Engine, PatchError, PatchId, Services};
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, Ino, KernelFs, RenameFlags, Result,
    SetAttr, StatFs, XattrFlags,
};
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The consistency mode, chosen at mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// No dependencies across blocks: fastest, and a crash may corrupt.
    Async,
    /// Soft updates: ordering rules keep the image consistent up to leaks.
    #[default]
    SoftUpdates,
    /// Metadata journaled in the ext3 journal; file data written in place, before the
    /// commit of the transaction that points to it (like ext3 data=ordered, which is
    /// stronger than the data=writeback the issue allows).
    MetaJournal,
    /// Metadata and file data journaled (like ext3 data=journal).
    FullJournal,
}

impl Mode {
    pub fn is_journal(self) -> bool {
        matches!(self, Mode::MetaJournal | Mode::FullJournal)
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Mode, String> {
        match s {
            "async" => Ok(Mode::Async),
            "soft-updates" | "su" => Ok(Mode::SoftUpdates),
            "meta-journal" | "meta" => Ok(Mode::MetaJournal),
            "full-journal" | "full" => Ok(Mode::FullJournal),
            _ => Err(format!(
                "unknown mode '{s}' (expected async, soft-updates, meta-journal or full-journal)"
            )),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Async => "async",
            Mode::SoftUpdates => "soft-updates",
            Mode::MetaJournal => "meta-journal",
            Mode::FullJournal => "full-journal",
        })
    }
}

#[derive(Debug, Clone)]
pub struct MountOptions {
    pub mode: Mode,
    pub read_only: bool,
    /// POSIX ACLs (the `acl` mount option, on by default as for the kernel; `noacl`
    /// makes `system.posix_acl_*` answer "not supported" and ignores default ACLs).
    pub acl: bool,
    /// What follows the discovery of damage on the image (`errors=`).
    pub errors: Errors,
    /// Where the journal puts its commits (`journal=ring|skip|null`); None: what the
    /// journal was made for (`mkfs --journal-placement`).
    pub journal_placement: Option<quilt_journal::Placement>,
    /// The journal's device, when it is on one of its own (`journal_dev=`).
    pub journal_device: Option<JournalDevice>,
    /// Hears each journal transaction as it commits (the crash explorer's model).
    pub journal_observer: Option<quilt_journal::Observer>,
    /// The journal retires transactions only by forced checkpoints (tests).
    pub journal_forced_checkpoints_only: bool,
    /// Replays and starts the journal (`quilt_stack` gives one). Without it the journal
    /// modes are refused, and so is an image whose journal needs recovery.
    pub journal: Option<Journals>,
}

/// The mount's journal starter (a newtype for `Debug`).
#[derive(Clone)]
pub struct Journals(pub std::sync::Arc<dyn crate::journal::JournalStarter>);

impl std::fmt::Debug for Journals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Journals")
    }
}

/// An external journal's device (a newtype for `Debug`).
#[derive(Clone)]
pub struct JournalDevice(pub std::sync::Arc<dyn quilt_block::BlockDevice>);

impl std::fmt::Debug for JournalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JournalDevice({} blocks)", self.0.block_count())
    }
}

/// The `errors=` mount option: after an operation finds the image damaged (and fails
/// with EIO), the superblock is marked as having errors, so the next boot's `e2fsck -p`
/// checks it; then the mount goes on (`Continue`) or takes no more changes (`RemountRo`,
/// the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Errors {
    Continue,
    #[default]
    RemountRo,
}

impl std::str::FromStr for Errors {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Errors, String> {
        match s {
            "continue" => Ok(Errors::Continue),
            "remount-ro" => Ok(Errors::RemountRo),
            "panic" => Err("errors=panic is not supported (continue or remount-ro)".into()),
            _ => Err(format!("unknown errors={s} (continue or remount-ro)")),
        }
    }
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            mode: Mode::default(),
            read_only: false,
            acl: true,
            errors: Errors::default(),
            journal_placement: None,
            journal_device: None,
            journal_observer: None,
            journal_forced_checkpoints_only: false,
            journal: None,
        }
    }
}

/// The patch that made a change, or None when the change altered nothing on disk.
pub(crate) type Head = Option<PatchId>;

/// One operation of the module: the patch layer's operation (its caller's engaged
/// patchgroups order every change, and no transaction closes in its middle) and whether
/// the caller may use the blocks reserved for root (`r_blocks_count`): root, the
/// superblock's `def_resuid`, or a member of a non-root `def_resgid` — the kernel's rule
/// (its CAP_SYS_RESOURCE is uid 0 here). Every change is made through one, passed
/// explicitly, so concurrent operations never share a caller by accident.
pub(crate) struct Op<'a> {
    pub tx: quilt_patch::Op<'a>,
    pub privileged: bool,
    /// Past the batch gate (let go after `tx` ends).
    _pass: quilt_vfs::batch::Passing<'a>,
}

/// Geometry: fixed at mount.
#[derive(Debug, Clone)]
pub(crate) struct Geo {
    pub sb: Superblock,
    pub bs: u32,
    pub blocks_count: u32,
    pub first_data_block: u32,
    pub bpg: u32,
    pub ipg: u32,
    pub inodes_count: u32,
    pub inode_size: u32,
    pub first_ino: u32,
    pub groups: u32,
    pub gdt_blocks: u32,
    pub itb: u32,
    /// Blocks that can never hold data (see `Geo::meta_overhead`); statfs leaves them
    /// out of the total, as the kernel does.
    pub overhead: u64,
    pub filetype: bool,
    pub ext_attr: bool,
    /// Block and byte offset of the primary superblock.
    pub sb_block: u32,
    pub sb_off: usize,
}

impl Geo {
    pub fn group_first_block(&self, g: u32) -> u32 {
        self.sb.group_first_block(g)
    }
    pub fn group_block_count(&self, g: u32) -> u32 {
        self.sb.group_block_count(g)
    }
    pub fn group_has_super(&self, g: u32) -> bool {
        self.sb.group_has_super(g)
    }
    /// The boot block, each superblock copy with its descriptor table and the table's
    /// reserved growth (`resize_inode`), the bitmaps and inode tables.
    fn meta_overhead(&self) -> u64 {
        let resv = if self.sb.feature_compat & COMPAT_RESIZE_INODE != 0 {
            self.sb.reserved_gdt_blocks as u64
        } else {
            0
        };
        let mut o = self.first_data_block as u64;
        for g in 0..self.groups {
            if self.group_has_super(g) {
                o += 1 + self.gdt_blocks as u64 + resv;
            }
            o += 2 + self.itb as u64;
        }
        o
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counters {
    pub blocks_allocated: u64,
    pub blocks_freed: u64,
    pub inodes_created: u64,
    pub inodes_freed: u64,
    pub fsyncs: u64,
    /// Device reads made by changes while holding the state lock alone (misses the
    /// warm-up did not foresee).
    pub reads_under_lock: u64,
}

pub(crate) struct State {
    pub sb: Superblock,
    pub gd: Vec<GroupDesc>,
    /// Blocks and inodes freed by patches that may not be durable yet.
    pub frees: Frees,
    /// Inode numbers granted in advance and not yet taken.
    pub grants: Grants,
    /// What an fsync of each inode must make durable.
    pub syncs: Syncs,
    /// Open handles and orphans: when an unlinked inode is freed.
    pub files: Files,
    pub dir_cursor: u32,
    pub counters: Counters,
    /// Superblock counts changed since they were last written.
    pub sb_dirty: bool,
    /// Group descriptors changed by the current operation.
    pub dirty_groups: std::collections::BTreeSet<u32>,
}

pub struct Ext2 {
    /// The patch layer below: the engine, the operation boundary, the transaction
    /// service (the ext3 journal in the journal modes, attached at open; this module
    /// never holds it), patchgroups.
    pub(crate) svc: Services,
    pub(crate) geo: Geo,
    pub(crate) mode: Mode,
    pub(crate) read_only: bool,
    /// POSIX ACLs on (see `MountOptions::acl`).
    pub(crate) acl: bool,
    /// What to do after finding the image damaged (see `MountOptions::errors`).
    pub(crate) errors: Errors,
    /// Damage found that the superblock does not record yet (`checked`), and whether
    /// there is any.
    pub(crate) pending_error: Mutex<Option<String>>,
    pub(crate) error_waiting: std::sync::atomic::AtomicBool,
    /// Damage was found under `Errors::RemountRo`: no more changes.
    pub(crate) errored: std::sync::atomic::AtomicBool,
    /// The module's in-memory state. Requests that change nothing share it (several run
    /// at once); a change holds it alone. Neither holds it across device I/O: reads
    /// run `without_io` and retry after reading a missed block unlocked (`reading`),
    /// changes first warm the cache with the blocks they will read (`warm_*`).
    pub(crate) st: RwLock<State>,
    /// Device reads made by read-only requests under the shared lock (`reading`).
    pub(crate) reads_under_shared_lock: std::sync::atomic::AtomicU64,
    /// Where changes wait while a batch runs (`apply_batch`).
    pub(crate) gate: quilt_vfs::Gate,
    /// The mount's journal device and starter, for a batch's trial mount.
    pub(crate) journal_device: Option<JournalDevice>,
    pub(crate) journals: Option<Journals>,
    /// The journal's size in blocks, once started (what one transaction may not outgrow).
    pub(crate) journal_blocks: std::sync::atomic::AtomicU32,
}

/// Attempts of a read-only request without device I/O (`reading`) before it reads
/// under the shared lock.
const MISS_RETRIES: usize = 8;
/// The most files one op lets go of (`release_all`).
const RELEASE_BATCH: usize = 64;
/// Blocks of a directory hinted before it is listed (`will_readdir`): those its inode
/// maps directly, at most.
const READDIR_AHEAD_BLOCKS: u64 = NDIR_BLOCKS as u64;
/// Inode table blocks read ahead from a miss (ext4's default `inode_readahead_blks`).
const INODE_READAHEAD_BLOCKS: u64 = 32;

impl Ext2 {
    /// Opens the file system on `engine`'s device: validates the superblock and the group
    /// descriptors, and (read-write) marks the image as mounted. With a journal starter
    /// (`MountOptions::journal`) the image's journal is replayed if it needs it, and in
    /// the journal modes started and attached to the patch layer's services as their
    /// transaction service.
    pub fn open(engine: Engine, opts: MountOptions) -> Result<Ext2> {
        Ext2::open_on(Services::new(engine), opts)
    }

    /// [`Ext2::open`] on services that may be shared with other users of the engine.
    pub fn open_on(svc: Services, opts: MountOptions) -> Result<Ext2> {
        let engine = svc.engine().clone();
        // A journal left needing recovery is replayed first, on the device itself: the
        // engine must not have cached any block yet, or it would serve stale copies.
        if let (false, Some(j), 0) = (opts.read_only, &opts.journal, engine.stats().blocks_cached) {
            let jdev = opts.journal_device.as_ref().map(|d| &d.0);
            crate::journal::recover_with(engine.device(), jdev, j.0.as_ref())?;
        }
        let bs = engine.block_size() as u32;
        let sb_block = (SUPERBLOCK_OFFSET / bs as u64) as u32;
        let sb_off = (SUPERBLOCK_OFFSET % bs as u64) as usize;
        let raw = engine
            .with_block(sb_block as u64, |d| {
                d[sb_off..sb_off + SUPERBLOCK_SIZE].to_vec()
            })
            .map_err(Self::io)?;
        let sb = Superblock::decode(&raw)?;
        if sb.block_size() != bs {
            return Err(FsError::Invalid(
                "device block size differs from the file system's",
            ));
        }
        if sb.blocks_count as u64 > engine.block_count() {
            return Err(corrupt(format!(
                "superblock says {} blocks but the image holds only {}",
                sb.blocks_count,
                engine.block_count()
            )));
        }
        if sb.feature_incompat & INCOMPAT_RECOVER != 0 {
            return Err(FsError::Corrupt(
                "the journal needs recovery: mount read-write once (quiltfs replays it) or run e2fsck -fy"
                    .into(),
            ));
        }
        if opts.mode.is_journal() && sb.feature_compat & COMPAT_HAS_JOURNAL == 0 {
            return Err(FsError::Invalid(
                "the journal modes need an ext3 image with a journal (quiltfs mkfs --journal)",
            ));
        }
        if opts.mode.is_journal() && !opts.read_only && opts.journal.is_none() {
            return Err(FsError::Invalid(
                "the journal modes need a journal starter (mount through quilt_stack::ext2)",
            ));
        }
        let unknown = sb.feature_incompat & !INCOMPAT_SUPPORTED;
        if unknown != 0 {
            return Err(FsError::Corrupt(format!(
                "unsupported incompatible features {unknown:#x} (quiltfs reads ext2 with filetype only)"
            )));
        }
        let mut read_only = opts.read_only;
        let unknown_ro = sb.feature_ro_compat & !RO_COMPAT_SUPPORTED;
        if unknown_ro != 0 && !read_only {
            tracing::warn!(
                "unknown read-only-compatible features {unknown_ro:#x}: mounting read-only"
            );
            read_only = true;
        }
        if sb.state & STATE_VALID == 0 {
            tracing::warn!("the file system was not cleanly unmounted; e2fsck is recommended");
        }
        if sb.state & STATE_ERROR != 0 {
            tracing::warn!("the file system is marked with errors; e2fsck is recommended");
        }
        let geo = Geo {
            bs,
            blocks_count: sb.blocks_count,
            first_data_block: sb.first_data_block,
            bpg: sb.blocks_per_group,
            ipg: sb.inodes_per_group,
            inodes_count: sb.inodes_count,
            inode_size: sb.inode_size as u32,
            first_ino: sb.first_ino,
            groups: sb.group_count(),
            gdt_blocks: sb.gdt_blocks(),
            itb: sb.inode_table_blocks(),
            filetype: sb.has_filetype(),
            ext_attr: sb.feature_compat & COMPAT_EXT_ATTR != 0,
            sb_block,
            sb_off,
            sb: sb.clone(),
            overhead: 0,
        };
        let geo = Geo {
            overhead: geo.meta_overhead(),
            ..geo
        };
        let mut gd = Vec::with_capacity(geo.groups as usize);
        let per_block = bs as usize / GDESC_SIZE;
        for g in 0..geo.groups {
            let blk = sb_block + 1 + g / per_block as u32;
            let off = (g as usize % per_block) * GDESC_SIZE;
            let d = engine
                .with_block(blk as u64, |b| GroupDesc::decode(&b[off..off + GDESC_SIZE]))
                .map_err(Self::io)?;
            let first = geo.group_first_block(g);
            let end = first + geo.group_block_count(g);
            let inside = |b: u32| b >= first && b < end;
            if !inside(d.block_bitmap)
                || !inside(d.inode_bitmap)
                || !inside(d.inode_table)
                || d.inode_table + geo.itb > end
            {
                return Err(corrupt(format!(
                    "group {g}: descriptor points outside its group (bitmaps {} {}, table {})",
                    d.block_bitmap, d.inode_bitmap, d.inode_table
                )));
            }
            if d.free_blocks as u32 > geo.group_block_count(g) || d.free_inodes as u32 > geo.ipg {
                return Err(corrupt(format!(
                    "group {g}: free counts exceed the group size"
                )));
            }
            gd.push(d);
        }
        let fs = Ext2 {
            svc,
            mode: opts.mode,
            read_only,
            acl: opts.acl,
            errors: opts.errors,
            pending_error: Mutex::new(None),
            error_waiting: std::sync::atomic::AtomicBool::new(false),
            errored: std::sync::atomic::AtomicBool::new(false),
            reads_under_shared_lock: Default::default(),
            gate: quilt_vfs::Gate::default(),
            journal_device: opts.journal_device.clone(),
            journals: opts.journal.clone(),
            journal_blocks: Default::default(),
            st: RwLock::new(State {
                sb: sb.clone(),
                gd,
                frees: Frees::default(),
                grants: Grants::default(),
                syncs: Syncs::default(),
                files: Files::default(),
                dir_cursor: 0,
                counters: Counters::default(),
                sb_dirty: false,
                dirty_groups: Default::default(),
            }),
            geo,
        };
        // The root must be a directory.
        {
            let st = fs.lock();
            let root = fs.read_inode(&st, ROOT_INO)?;
            if !root.is_dir() || root.links == 0 {
                return Err(corrupt("the root inode is not a directory"));
            }
        }
        if !fs.read_only {
            // Host storage behind every group's fixed metadata (superblock copies,
            // descriptors, bitmaps, inode table: holes in a fresh sparse image), so
            // writing an inode can never fail for a full host disk; data, directory and
            // map blocks are reserved as they are allocated.
            let st = fs.lock();
            for (g, d) in st.gd.iter().enumerate() {
                let first = fs.geo.group_first_block(g as u32) as u64;
                let end = (d.inode_table + fs.geo.itb) as u64;
                fs.engine()
                    .reserve(first, end.saturating_sub(first))
                    .map_err(|e| match e {
                        quilt_patch::PatchError::Block(
                            e @ quilt_block::BlockError::NoSpace { .. },
                        ) => FsError::Io(quilt_vfs::IoError::caused_by(e)),
                        e => Self::io(e),
                    })?;
            }
            drop(st);
            let op = fs.begin_internal();
            let mut st = fs.lock();
            // Recompute the summary counts from the descriptors (cheap, and the kernel
            // does the same), then mark the image as in use until a clean unmount.
            st.sb.free_blocks_count = st.gd.iter().map(|d| d.free_blocks as u32).sum();
            st.sb.free_inodes_count = st.gd.iter().map(|d| d.free_inodes as u32).sum();
            st.sb.state &= !STATE_VALID;
            st.sb.mnt_count = st.sb.mnt_count.wrapping_add(1);
            st.sb.mtime = quilt_vfs::Timespec::now().sec as u32;
            if opts.mode.is_journal() {
                // Recovery is needed from here on until a clean unmount: durable before
                // the first transaction.
                st.sb.feature_incompat |= INCOMPAT_RECOVER;
            }
            fs.write_super(&op, &mut st)?;
            drop(st);
            op.tx.end()?;
            fs.engine().sync().map_err(Self::io)?;
        }
        if opts.mode.is_journal() && !fs.read_only {
            // (Present: checked before the image was marked in use.)
            let j = opts.journal.as_ref().ok_or(FsError::Invalid(
                "the journal modes need a journal starter (mount through quilt_stack::ext2)",
            ))?;
            let journal = fs.start_journal(opts.mode, &opts, j.0.as_ref())?;
            fs.svc.attach(journal)?;
        }
        if !fs.read_only && fs.lock().sb.last_orphan != 0 {
            let n = fs.orphan_cleanup()?;
            tracing::info!("freed {n} orphaned inodes a crash left");
        }
        Ok(fs)
    }

    pub fn engine(&self) -> &Engine {
        self.svc.engine()
    }
    pub fn services(&self) -> &Services {
        &self.svc
    }
    pub fn mode(&self) -> Mode {
        self.mode
    }
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Clean unmount: frees orphans, writes the counts, marks the image clean, flushes.
    pub fn unmount(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        if self.errored.load(Relaxed) {
            // Read-only after errors: what was acknowledged goes to disk, and the image
            // stays marked as not clean, with errors, for e2fsck.
            self.svc.sync()?;
            return self.engine().sync().map_err(Self::io);
        }
        let op = self.begin_internal();
        let mut st = self.lock();
        for ino in st.files.take_orphans() {
            st.files.forget_opens(ino);
            self.orphan_remove(&op, &mut st, ino)?;
            self.destroy_inode(&op, &mut st, ino, None)?;
        }
        self.write_groups(&op, &mut st)?;
        st.sb.state |= STATE_VALID;
        st.sb.wtime = quilt_vfs::Timespec::now().sec as u32;
        self.write_super(&op, &mut st)?;
        drop(st);
        op.tx.end()?;
        // The transaction service (the journal) commits, puts everything home and marks
        // its log empty; then the superblock no longer asks for recovery.
        let journaled = self.svc.transactional();
        self.svc.shutdown()?;
        if journaled {
            let op = self.begin_internal();
            let mut st = self.lock();
            st.sb.feature_incompat &= !INCOMPAT_RECOVER;
            self.write_super(&op, &mut st)?;
            drop(st);
            op.tx.end()?;
        }
        self.engine().sync().map_err(Self::io)
    }

    /// Drops one open (or kernel reference) of each of `inos`. The last of an unlinked
    /// file frees it: all such files together, in one op and one hold of the exclusive
    /// lock, after what freeing them reads was read without it (`warm_free`). A FORGET
    /// batch of `rm -rf` frees dozens of files; one at a time, each took the lock from
    /// the requests the ring was serving, and woke them at the other CPU when done.
    /// Every ino is let go even when one fails; the first error is returned. At most
    /// [`RELEASE_BATCH`] per op, so that a huge batch (FORGETs of thousands of files
    /// at unmount) never makes one transaction too big for a journal.
    fn release_all(&self, inos: &[Ino]) -> Result<()> {
        // Not `try_fold`: every chunk runs; `and` keeps the first error.
        let mut first = Ok(());
        for chunk in inos.chunks(RELEASE_BATCH) {
            first = first.and(self.release_chunk(chunk));
        }
        first
    }

    fn release_chunk(&self, inos: &[Ino]) -> Result<()> {
        let mut first = Ok(());
        let mut valid = Vec::with_capacity(inos.len());
        for &i in inos {
            match Self::to_ino(i) {
                Ok(i) => valid.push(i),
                Err(e) => first = first.and(Err(e)),
            }
        }
        let inos = valid;
        if !self.read_only {
            let frees: Vec<u32> = {
                let st = self.read_lock();
                let mut opens: HashMap<u32, u32> = HashMap::default();
                for &i in &inos {
                    *opens.entry(i).or_default() += 1;
                }
                opens
                    .into_iter()
                    .filter(|&(i, n)| st.files.opens(i) == n && st.files.is_orphan(i))
                    .map(|(i, _)| i)
                    .collect()
            };
            for ino in frees {
                self.warm_free(ino);
            }
        }
        // The last release of an unlinked file frees it: a change, so it is an op.
        let op = self.begin_internal();
        let r = self.change_in(&op, |op, st| {
            let mut first = Ok(());
            for &ino in &inos {
                if !st.files.release(ino) {
                    continue;
                }
                if st.files.unorphan(ino) && !self.read_only {
                    let r = self
                        .orphan_remove(op, st, ino)
                        .and_then(|()| self.destroy_inode(op, st, ino, None).map(|_| ()));
                    first = first.and(r);
                }
            }
            first
        });
        op.tx.end()?;
        self.record_pending_error();
        first.and(r)
    }

    /// Locks the state. A change needs an op begun first (`begin`): an op waits at the
    /// boundary while a transaction closes, so it must not wait there holding the lock
    /// that the ops in flight need to finish.
    pub(crate) fn lock(&self) -> RwLockWriteGuard<'_, State> {
        self.st.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Shares the state with other readers (see `reading`).
    pub(crate) fn read_lock(&self) -> RwLockReadGuard<'_, State> {
        self.st.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the read-only `f` under the shared lock without device I/O: when it needs a
    /// block that is not cached, the lock is let go, the block (and up to `ahead - 1`
    /// after it: the rest of a file read) is read, and `f` runs again. So a cache miss
    /// never holds up a change, and other readers never wait for it. `f` must have no
    /// effects outside its result, as it may run several times.
    pub(crate) fn reading<T>(
        &self,
        ahead: u64,
        mut f: impl FnMut(&State) -> Result<T>,
    ) -> Result<T> {
        let engine = self.engine();
        for _ in 0..MISS_RETRIES {
            let (r, missed) = engine.without_io(|| f(&self.read_lock()));
            match missed {
                None => return r,
                Some(b) => {
                    self.read_ahead_inodes(b);
                    engine.prefetch(b, ahead).map_err(Self::io)?
                }
            }
        }
        // Many blocks missed one after another (a cold directory of many blocks: each
        // attempt would walk it again): the rest is read under the shared lock.
        let reads = Engine::thread_reads();
        let r = f(&self.read_lock());
        self.reads_under_shared_lock
            .fetch_add(Engine::thread_reads() - reads, Relaxed);
        r
    }

    /// Brings into the cache what a change of `(parent, name)` reads first: the parent's
    /// inode, its entries up to the name, and the inode it names. The change then holds
    /// the lock alone without waiting for the device (mostly: what it reads next, a
    /// bitmap or a map block, may still miss; `fs.reads_under_lock` counts those).
    pub(crate) fn warm_name(&self, parent: Ino, name: &[u8]) {
        let _ = self.reading(1, |st| {
            let p = Self::to_ino(parent)?;
            let dir = self.read_live_inode(st, p)?;
            self.warm_bitmaps(st, p)?;
            if dir.is_dir() {
                if let Some(e) = self.find_entry(&dir, name)? {
                    self.read_inode(st, e.inode)?;
                }
            }
            Ok(())
        });
    }

    /// A miss on an inode table block: a hint to the device for it and the table's
    /// next blocks, as ext4 reads its inode tables ahead (`inode_readahead_blks`).
    /// Inodes made one after another (an untar) sit together in the table, and a walk
    /// of the tree they were made in (`rm -rf`, `find`) asks for them in that order;
    /// read one block per wait, each listing waited for the device a few times.
    fn read_ahead_inodes(&self, missed: u64) {
        if self
            .engine()
            .was_hinted(missed + INODE_READAHEAD_BLOCKS / 2)
        {
            // Well inside a read-ahead already asked for: extended when half used.
            return;
        }
        let run = {
            let st = self.read_lock();
            let g = missed.saturating_sub(self.geo.first_data_block as u64) / self.geo.bpg as u64;
            st.gd.get(g as usize).and_then(|d| {
                let table = d.inode_table as u64..d.inode_table as u64 + self.geo.itb as u64;
                table.contains(&missed).then(|| {
                    missed
                        ..table
                            .end
                            .min(missed + INODE_READAHEAD_BLOCKS)
                            .min(self.geo.blocks_count as u64)
                })
            })
        };
        if let Some(run) = run.filter(|r| r.end - r.start > 1) {
            self.engine().will_need(&mut run.collect());
        }
    }

    /// [`Ext2::warm_name`] for a change of one inode, and its map around `offset`.
    pub(crate) fn warm_inode(&self, ino: Ino, offset: Option<u64>) {
        let _ = self.reading(1, |st| {
            let i = Self::to_ino(ino)?;
            let inode = self.read_inode(st, i)?;
            if let Some(off) = offset {
                self.bmap(&inode, off / self.geo.bs as u64)?;
                self.warm_bitmaps(st, i)?;
            }
            Ok(())
        });
    }

    /// The bitmaps of `ino`'s group, where its new blocks (and a new inode in a
    /// directory) are looked for first.
    fn warm_bitmaps(&self, st: &State, ino: u32) -> Result<()> {
        let g = self.group_of_inode(ino) as usize;
        if let Some(d) = st.gd.get(g) {
            for b in [d.block_bitmap, d.inode_bitmap] {
                self.engine()
                    .with_block(b as u64, |_| ())
                    .map_err(Self::io)?;
            }
        }
        Ok(())
    }

    /// Begins an operation for `ctx`'s process: its changes join the patchgroups that
    /// process has engaged.
    pub(crate) fn begin(&self, ctx: &Ctx) -> Op<'_> {
        let (resuid, resgid) = (self.geo.sb.def_resuid as u32, self.geo.sb.def_resgid as u32);
        let privileged = ctx.uid == 0 || ctx.uid == resuid || (resgid != 0 && ctx.gid == resgid);
        let caller = (ctx.pid != 0).then_some(ctx.pid as u64);
        // The gate first: a change waiting there holds no op open, which a batch's
        // commit would wait for.
        let pass = self.gate.pass();
        Op {
            tx: self.svc.begin(caller),
            privileged,
            _pass: pass,
        }
    }

    /// Begins an operation made on no process's behalf (mount, unmount, the last
    /// release of an unlinked file, fsync's summary counts).
    pub(crate) fn begin_internal(&self) -> Op<'_> {
        let pass = self.gate.pass();
        Op {
            tx: self.svc.begin(None),
            privileged: true,
            _pass: pass,
        }
    }

    /// Runs a change for `ctx`: begins the op, locks the state, runs `f`, writes the
    /// group descriptors it changed, unlocks, and ends the op (the boundary where a
    /// transaction service may commit). Damage `f` found is recorded (`checked`).
    pub(crate) fn change<T>(
        &self,
        ctx: &Ctx,
        f: impl FnOnce(&Op<'_>, &mut State) -> Result<T>,
    ) -> Result<T> {
        self.check_writable()?;
        let op = self.begin(ctx);
        let r = self.change_in(&op, f);
        op.tx.end()?;
        // Damage the change found is recorded now that its op has ended: recording
        // syncs, and in the journal modes a commit waits for every open op to end, this
        // one included (it hung the mount when it ran inside the op).
        self.record_pending_error();
        r
    }

    /// The body of `change`, inside an op the caller ends.
    pub(crate) fn change_in<T>(
        &self,
        op: &Op<'_>,
        f: impl FnOnce(&Op<'_>, &mut State) -> Result<T>,
    ) -> Result<T> {
        let mut st = self.lock();
        let reads = Engine::thread_reads();
        let r = f(op, &mut st);
        let w = self.write_groups(op, &mut st);
        st.counters.reads_under_lock += Engine::thread_reads() - reads;
        drop(st);
        w?;
        self.noted(r)
    }

    /// An operation's result on its way out: damage it found is logged and recorded in
    /// the superblock, and under `errors=remount-ro` the mount takes no more changes.
    /// Not for a result inside an op (see [`Ext2::noted`]).
    pub(crate) fn checked<T>(&self, r: Result<T>) -> Result<T> {
        let r = self.noted(r);
        self.record_pending_error();
        r
    }

    /// [`Ext2::checked`] without the recording, for results inside an op: the damage is
    /// logged and left pending, and recorded once the op has ended (by `change`, or by
    /// the next operation).
    fn noted<T>(&self, r: Result<T>) -> Result<T> {
        let Err(FsError::Corrupt(msg)) = &r else {
            return r;
        };
        tracing::error!("file system error: {msg}");
        if self.read_only {
            return r;
        }
        self.pending_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| msg.clone());
        self.error_waiting.store(true, Relaxed);
        if self.errors == Errors::RemountRo && !self.errored.swap(true, Relaxed) {
            tracing::error!("remounting read-only (errors=remount-ro)");
        }
        r
    }

    /// Marks the superblock as having errors, with the kernel's error record (count,
    /// first and last time, inode and block), and makes it durable. Called with no op
    /// open and the state unlocked (it begins its own op, and syncs).
    pub(crate) fn record_pending_error(&self) {
        // Every operation passes here: only a set flag costs a lock.
        if !self.error_waiting.swap(false, Relaxed) {
            return;
        }
        let op = self.begin_internal();
        let mut st = self.lock();
        let recorded = self.record_error_in(&op, &mut st);
        drop(st);
        let r = recorded
            .and_then(|()| op.tx.end().map_err(Self::io))
            .and_then(|()| self.svc.sync().map_err(Self::io));
        if let Err(e) = r {
            tracing::error!("could not mark the superblock as having errors: {e}");
        }
    }

    fn record_error_in(&self, op: &Op<'_>, st: &mut State) -> Result<()> {
        let Some(msg) = self
            .pending_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(());
        };
        st.sb.state |= STATE_ERROR;
        self.write_super(op, st).and_then(|()| {
            let (ino, blk) = error_subject(&msg);
            let now = quilt_vfs::Timespec::now().sec as u32;
            let mut raw = self
                .engine()
                .with_block(self.geo.sb_block as u64, |d| {
                    d[self.geo.sb_off..self.geo.sb_off + SUPERBLOCK_SIZE].to_vec()
                })
                .map_err(Self::io)?;
            let count = le32(&raw, 0x194);
            put32(&mut raw, 0x194, count.saturating_add(1));
            let func = |b: &mut [u8], at: usize| {
                b[at..at + 32].fill(0);
                b[at..at + 7].copy_from_slice(b"quiltfs");
            };
            if count == 0 {
                put32(&mut raw, 0x198, now);
                put32(&mut raw, 0x19C, ino);
                raw[0x1A0..0x1A8].copy_from_slice(&blk.to_le_bytes());
                func(&mut raw, 0x1A8);
            }
            put32(&mut raw, 0x1CC, now);
            put32(&mut raw, 0x1D0, ino);
            raw[0x1D8..0x1E0].copy_from_slice(&blk.to_le_bytes());
            func(&mut raw, 0x1E0);
            self.put(op, self.geo.sb_block, self.geo.sb_off, &raw, &[], false)?;
            Ok(())
        })
    }

    pub(crate) fn io(e: PatchError) -> FsError {
        FsError::from(e)
    }

    /// The befores a change may declare across blocks in this mode: all of them in soft
    /// updates, none in async mode.
    /// The befores a change keeps from other blocks: soft updates keeps them all; async
    /// none; the journal modes none either, as transactions make groups of changes
    /// atomic instead.
    pub(crate) fn cross(&self, befores: &[PatchId]) -> Vec<PatchId> {
        match self.mode {
            Mode::SoftUpdates => befores.to_vec(),
            Mode::Async | Mode::MetaJournal | Mode::FullJournal => Vec::new(),
        }
    }

    /// Blocks that can never hold data, which statfs leaves out of the total as the
    /// kernel does: the fixed metadata, and a journal in use.
    fn overhead(&self, st: &State) -> u64 {
        let mut o = self.geo.overhead;
        if self.svc.transactional() && st.sb.journal_inum != 0 {
            if let Ok(j) = self.read_inode(st, st.sb.journal_inum) {
                o += j.size / self.geo.bs as u64;
            }
        }
        o
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        if self.read_only || self.errored.load(Relaxed) {
            Err(FsError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Writes `new` at `off` of `blk`, as a patch covering only the bytes that change.
    pub(crate) fn put(
        &self,
        op: &Op<'_>,

        blk: u32,
        off: usize,
        new: &[u8],
        befores: &[PatchId],
        data: bool,
    ) -> Result<Head> {
        let span = self
            .engine()
            .with_block(blk as u64, |d| {
                let old = &d[off..off + new.len()];
                let lo = old.iter().zip(new).position(|(a, b)| a != b)?;
                let hi = old.iter().zip(new).rposition(|(a, b)| a != b)? + 1;
                Some((lo, hi))
            })
            .map_err(Self::io)?;
        let Some((lo, hi)) = span else {
            return Ok(None);
        };
        let befores = self.cross(befores);
        op.tx
            .write(blk as u64, off + lo, &new[lo..hi], &befores, data)
            .map(Some)
            .map_err(Self::io)
    }

    /// Writes `bytes` at `off` of `blk` as one patch covering all of them, whether or not
    /// they change: for records whose bytes belong together (a directory entry, an
    /// initialized inode), so the patch depends on every pending patch it overlaps.
    pub(crate) fn put_exact(
        &self,
        op: &Op<'_>,

        blk: u32,
        off: usize,
        bytes: &[u8],
        befores: &[PatchId],
    ) -> Result<PatchId> {
        let befores = self.cross(befores);
        op.tx
            .write(blk as u64, off, bytes, &befores, false)
            .map_err(Self::io)
    }

    /// Writes a whole block (new contents of a freshly allocated block).
    pub(crate) fn put_block(
        &self,
        op: &Op<'_>,

        blk: u32,
        data: &[u8],
        befores: &[PatchId],
        is_data: bool,
    ) -> Result<PatchId> {
        let befores = self.cross(befores);
        op.tx
            .write(blk as u64, 0, data, &befores, is_data)
            .map_err(Self::io)
    }

    /// An empty patch joining `heads` (None if there is nothing to join).
    pub(crate) fn join(&self, heads: &[Head]) -> Head {
        let ids: Vec<PatchId> = heads.iter().flatten().copied().collect();
        match ids.len() {
            0 => None,
            1 => Some(ids[0]),
            _ => Some(self.engine().empty(&self.cross(&ids))),
        }
    }

    /// Records that an fsync of `ino` must make `head` durable.
    pub(crate) fn track(&self, st: &mut State, ino: u32, head: Head) {
        if let Some(h) = head {
            st.syncs.track(self.engine(), ino, h);
        }
    }

    /// Notes that group `g`'s descriptor changed; `flush_groups` writes it once per
    /// operation.
    pub(crate) fn write_gd(&self, st: &mut State, g: u32) -> Result<()> {
        st.dirty_groups.insert(g);
        st.sb_dirty = true;
        Ok(())
    }

    /// Writes the group descriptors the operation changed (once per operation, however
    /// many changes it made to them).
    pub(crate) fn write_groups(&self, op: &Op<'_>, st: &mut State) -> Result<()> {
        let groups = std::mem::take(&mut st.dirty_groups);
        for g in groups {
            self.write_gd_now(op, st, g)?;
        }
        Ok(())
    }

    fn write_gd_now(&self, op: &Op<'_>, st: &mut State, g: u32) -> Result<()> {
        let per_block = self.geo.bs / GDESC_SIZE as u32;
        let blk = self.geo.sb_block + 1 + g / per_block;
        let off = (g % per_block) as usize * GDESC_SIZE;
        st.sb_dirty = true;
        self.put(op, blk, off, &st.gd[g as usize].encode(), &[], false)?;
        Ok(())
    }

    /// Writes the in-memory superblock fields into the primary superblock.
    pub(crate) fn write_super(&self, op: &Op<'_>, st: &mut State) -> Result<()> {
        let mut raw = self
            .engine()
            .with_block(self.geo.sb_block as u64, |d| {
                d[self.geo.sb_off..self.geo.sb_off + SUPERBLOCK_SIZE].to_vec()
            })
            .map_err(Self::io)?;
        st.sb.encode_into(&mut raw);
        self.put(op, self.geo.sb_block, self.geo.sb_off, &raw, &[], false)?;
        st.sb_dirty = false;
        Ok(())
    }

    pub(crate) fn check_data_block(&self, blk: u32) -> Result<()> {
        if blk < self.geo.first_data_block || blk >= self.geo.blocks_count {
            return Err(corrupt(format!(
                "block pointer {blk} is outside the file system"
            )));
        }
        Ok(())
    }

    pub(crate) fn to_ino(ino: Ino) -> Result<u32> {
        u32::try_from(ino).map_err(|_| FsError::NotFound)
    }

    fn attr_of(&self, ino: u32, inode: &Inode) -> Result<Attr> {
        let kind = FileType::from_mode(inode.mode as u32).ok_or_else(|| {
            corrupt(format!(
                "inode {ino} has unknown type in mode {:o}",
                inode.mode
            ))
        })?;
        let x = inode.has_extra_times();
        Ok(Attr {
            ino: ino as Ino,
            kind,
            perm: inode.mode & 0o7777,
            nlink: inode.links as u32,
            uid: inode.uid,
            gid: inode.gid,
            size: inode.size,
            blocks: inode.blocks as u64,
            atime: Inode::time(inode.atime, inode.atime_extra, x),
            mtime: Inode::time(inode.mtime, inode.mtime_extra, x),
            ctime: Inode::time(inode.ctime, inode.ctime_extra, x),
            rdev: if inode.is_special() { inode.rdev() } else { 0 },
            blksize: self.geo.bs,
        })
    }

    pub(crate) fn attr(&self, st: &State, ino: u32) -> Result<Attr> {
        let inode = self.read_live_inode(st, ino)?;
        self.attr_of(ino, &inode)
    }

    pub(crate) fn counters_list(&self) -> Vec<(String, u64)> {
        let (c, sb) = {
            let st = self.read_lock();
            let sb = &st.sb;
            (
                st.counters,
                [
                    sb.rev_level,
                    sb.feature_compat,
                    sb.feature_incompat,
                    sb.feature_ro_compat,
                ],
            )
        };
        let mut v: Vec<(String, u64)> = vec![
            // The on-disk format (quiltfs-formats(5)): revision and feature masks as the
            // superblock holds them now.
            ("format.revision".into(), u64::from(sb[0])),
            ("format.feature_compat".into(), u64::from(sb[1])),
            ("format.feature_incompat".into(), u64::from(sb[2])),
            ("format.feature_ro_compat".into(), u64::from(sb[3])),
            ("fs.blocks_allocated".into(), c.blocks_allocated),
            ("fs.blocks_freed".into(), c.blocks_freed),
            ("fs.inodes_created".into(), c.inodes_created),
            ("fs.inodes_freed".into(), c.inodes_freed),
            ("fs.fsyncs".into(), c.fsyncs),
            ("fs.reads_under_lock".into(), c.reads_under_lock),
            (
                "fs.reads_under_shared_lock".into(),
                self.reads_under_shared_lock.load(Relaxed),
            ),
        ];
        v.extend(self.svc.counters());
        v
    }
}

impl Ext2 {
    /// After a successful change to the entries of `dirs`: makes it durable before the
    /// call returns where a directory asks for that (DIRSYNC or SYNC).
    fn sync_dirs<T>(&self, r: Result<T>, dirs: &[Ino]) -> Result<T> {
        let v = r?;
        for &d in dirs {
            if self.wants_sync(Self::to_ino(d)?, true) {
                self.fsync(d, false)?;
            }
        }
        Ok(v)
    }
}

/// The inode and block a damage report names ("inode N", "block N"), 0 where it names
/// none: for the superblock's error record.
fn error_subject(msg: &str) -> (u32, u64) {
    let after = |word: &str| -> u64 {
        msg.split(word)
            .nth(1)
            .and_then(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .unwrap_or(0)
    };
    (after("inode ") as u32, after("block "))
}

pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Invalid("bad file name"));
    }
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

impl Ext2 {
    // Creations, with an inode number from a grant or the allocator's.

    /// The part every creation shares: the name's directory warmed, the node made in
    /// a change, a granted number given back on failure, the directory synced if asked.
    #[allow(clippy::too_many_arguments)]
    fn create_named(
        &self,
        want: Option<u32>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        target: Option<&[u8]>,
        ctx: &Ctx,
    ) -> Result<Attr> {
        self.warm_name(parent, name);
        let r = self.change(ctx, |op, st| {
            self.create_node(
                op,
                st,
                Self::to_ino(parent)?,
                name,
                mode,
                rdev,
                target,
                ctx,
                want,
            )
        });
        let r = self.regrant(want, r);
        self.sync_dirs(r, &[parent])
    }

    /// A creation under a granted number that failed gives the number back to the grant
    /// (its undo freed the inode), so that its holder may try again.
    fn regrant(&self, want: Option<u32>, r: Result<Attr>) -> Result<Attr> {
        if let (Some(ino), Err(_)) = (want, &r) {
            let mut st = self.lock();
            if st.grants.end_of(ino).is_none() && self.inode_is_free(&st, ino) {
                st.grants.add(ino, ino + 1);
            }
        }
        r
    }

    fn mknod_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        let want = want.map(Self::to_ino).transpose()?;
        self.check_writable()?;
        if FileType::from_mode(mode)
            .is_none_or(|k| k == FileType::Directory || k == FileType::Symlink)
        {
            return Err(FsError::Invalid(
                "mknod makes files, devices, fifos and sockets",
            ));
        }
        self.create_named(want, parent, name, mode, rdev, None, ctx)
    }

    fn mkdir_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        let want = want.map(Self::to_ino).transpose()?;
        let mode = libc::S_IFDIR | (mode & 0o7777);
        self.create_named(want, parent, name, mode, 0, None, ctx)
    }

    fn symlink_in(
        &self,
        want: Option<Ino>,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        ctx: &Ctx,
    ) -> Result<Attr> {
        let want = want.map(Self::to_ino).transpose()?;
        self.check_writable()?;
        quilt_vfs::rules::check_symlink_target(target, self.geo.bs as usize)?;
        self.create_named(
            want,
            parent,
            name,
            libc::S_IFLNK | 0o777,
            0,
            Some(target),
            ctx,
        )
    }
}

/// The kernel's hints and forgets: read ahead where its next requests will look, and let
/// go of unlinked inodes a FORGET batch at a time.
impl KernelFs for Ext2 {
    fn will_getattr(&self, inos: &[Ino]) {
        let mut blocks: Vec<u64> = {
            let st = self.read_lock();
            inos.iter()
                .filter_map(|&i| Self::to_ino(i).ok())
                .filter_map(|i| self.inode_loc(&st, i).ok())
                .map(|(blk, _)| blk as u64)
                .collect()
        };
        self.engine().will_need(&mut blocks);
    }

    /// The directories' blocks that their inodes map directly (the first
    /// [`READDIR_AHEAD_BLOCKS`] of each), for directories whose inode is cached: a hint
    /// must not wait itself. Without it a walk of a cold tree (`rm -rf`) waited for the
    /// device once per directory it listed.
    fn will_readdir(&self, dirs: &[Ino]) {
        let (mut blocks, _) = self.engine().without_io(|| {
            let st = self.read_lock();
            let mut blocks = Vec::new();
            for &d in dirs {
                let Ok(Ok(inode)) = Self::to_ino(d).map(|i| self.read_live_inode(&st, i)) else {
                    continue;
                };
                if !inode.is_dir() {
                    continue;
                }
                let n = (inode.size / self.geo.bs as u64).min(READDIR_AHEAD_BLOCKS) as usize;
                blocks.extend(
                    inode.block[..n]
                        .iter()
                        .filter(|&&b| b != 0 && b < self.geo.blocks_count)
                        .map(|&b| b as u64),
                );
            }
            blocks
        });
        self.engine().will_need(&mut blocks);
    }

    fn unreference_all(&self, inos: &[Ino]) -> Result<()> {
        self.release_all(inos)
    }
}

impl FileSystem for Ext2 {
    fn root(&self) -> Ino {
        ROOT_INO as Ino
    }

    fn patchgroups(&self) -> Option<&dyn quilt_vfs::Patchgroups> {
        Some(&self.svc)
    }

    fn apply_batch(
        &self,
        ops: &[quilt_vfs::FsOp],
        ctx: &Ctx,
    ) -> std::result::Result<Vec<quilt_vfs::FsReply>, quilt_vfs::BatchError> {
        self.batch(ops, ctx)
    }

    fn check_writable(&self) -> Result<()> {
        Ext2::check_writable(self)
    }

    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let r = self.reading(1, |st| {
            let dir = self.read_live_inode(st, Self::to_ino(parent)?)?;
            if !dir.is_dir() {
                return Err(FsError::NotDir);
            }
            let e = self.find_entry(&dir, name)?.ok_or(FsError::NotFound)?;
            self.attr(st, e.inode).map_err(|err| match err {
                FsError::Stale => corrupt(format!(
                    "directory {parent}: entry '{}' names inode {}, which is not in use",
                    String::from_utf8_lossy(name),
                    e.inode
                )),
                err => err,
            })
        });
        self.checked(r)
    }

    fn getattr(&self, ino: Ino) -> Result<Attr> {
        let r = self.reading(1, |st| self.attr(st, Self::to_ino(ino)?));
        self.checked(r)
    }

    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr> {
        self.warm_inode(ino, None);
        self.change(ctx, |op, st| {
            self.do_setattr(op, st, Self::to_ino(ino)?, set)
        })
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

    fn grant_inodes(&self, count: u64) -> Result<quilt_vfs::InoGrant> {
        self.check_writable()?;
        let count = u32::try_from(count).map_err(|_| FsError::Invalid("grant too large"))?;
        let mut st = self.lock();
        let first = self.grant(&mut st, count)?;
        Ok(quilt_vfs::InoGrant {
            first: first as Ino,
            count: count as u64,
        })
    }

    fn hold_inodes(&self, grant: quilt_vfs::InoGrant) -> Result<()> {
        self.check_writable()?;
        let total = u64::from(self.geo.ipg) * u64::from(self.geo.groups);
        let first_ino = u64::from(self.geo.first_ino);
        let end = grant.first.checked_add(grant.count);
        match end {
            Some(end) if grant.count > 0 && grant.first >= first_ino && end <= total + 1 => {
                let mut st = self.lock();
                let (a, b) = (grant.first as u32, end as u32);
                if (a..b).any(|i| st.grants.end_of(i).is_some()) {
                    return Err(FsError::Invalid("inode numbers already set aside"));
                }
                // Numbers in use stay in use: the allocator takes only free ones, and a
                // creation under a granted number checks it is free.
                st.grants.add(a, b);
                Ok(())
            }
            _ => Err(FsError::Invalid(
                "inode numbers this file system does not have",
            )),
        }
    }

    fn tmpfile(&self, parent: Ino, mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.warm_inode(parent, None);
        let r = self.change(ctx, |op, st| {
            self.create_tmpfile(op, st, Self::to_ino(parent)?, mode, ctx)
        });
        self.sync_dirs(r, &[parent])
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.mkdir_in(None, parent, name, mode, ctx)
    }

    fn mkdir_as(&self, ino: Ino, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.mkdir_in(Some(ino), parent, name, mode, ctx)
    }

    fn unlink(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.warm_name(parent, name);
        let r = self.change(ctx, |op, st| {
            self.remove_name(op, st, Self::to_ino(parent)?, name, false)
        });
        self.sync_dirs(r, &[parent])
    }

    fn rmdir(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.warm_name(parent, name);
        let r = self.change(ctx, |op, st| {
            self.remove_name(op, st, Self::to_ino(parent)?, name, true)
        });
        self.sync_dirs(r, &[parent])
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.symlink_in(None, parent, name, target, ctx)
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

    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        let r = self.reading(1, |st| self.do_readlink(st, Self::to_ino(ino)?));
        self.checked(r)
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
        self.warm_name(parent, name);
        self.warm_name(new_parent, new_name);
        let r = self.change(ctx, |op, st| {
            self.do_rename(
                op,
                st,
                Self::to_ino(parent)?,
                name,
                Self::to_ino(new_parent)?,
                new_name,
                flags,
                ctx,
            )
        });
        self.sync_dirs(r, &[parent, new_parent])
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.warm_inode(ino, None);
        self.warm_name(new_parent, new_name);
        let r = self.change(ctx, |op, st| {
            self.do_link(
                op,
                st,
                Self::to_ino(ino)?,
                Self::to_ino(new_parent)?,
                new_name,
            )
        });
        self.sync_dirs(r, &[new_parent])
    }

    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_into(ino, offset, size, &mut out)?;
        Ok(out)
    }

    fn read_into(&self, ino: Ino, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<()> {
        // A miss in the file's data reads ahead over the rest of the request (in one
        // device request where the file's blocks lie together), so that the attempt
        // after it finds the request's blocks cached.
        let ahead = (size as u64).div_ceil(self.geo.bs as u64).clamp(1, 256);
        let start = out.len();
        let r = self.reading(ahead, |st| {
            // An attempt cut short by a miss leaves a part: dropped, the capacity kept.
            out.truncate(start);
            self.do_read_into(st, Self::to_ino(ino)?, offset, size, out)
        });
        self.checked(r)
    }

    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32> {
        self.warm_inode(ino, Some(offset));
        let n = self.change(ctx, |op, st| {
            self.do_write(op, st, Self::to_ino(ino)?, offset, data)
        })?;
        if self.wants_sync(Self::to_ino(ino)?, false) {
            self.fsync(ino, false)?;
        }
        Ok(n)
    }

    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32, ctx: &Ctx) -> Result<()> {
        self.warm_inode(ino, Some(offset));
        self.change(ctx, |op, st| {
            self.do_fallocate(op, st, Self::to_ino(ino)?, offset, length, mode)
        })?;
        if self.wants_sync(Self::to_ino(ino)?, false) {
            self.fsync(ino, false)?;
        }
        Ok(())
    }

    fn get_flags(&self, ino: Ino) -> Result<u32> {
        let r = self.reading(1, |st| self.do_get_flags(st, Self::to_ino(ino)?));
        self.checked(r)
    }

    fn set_flags(&self, ino: Ino, flags: u32, ctx: &Ctx) -> Result<()> {
        self.warm_inode(ino, None);
        self.change(ctx, |op, st| {
            self.do_set_flags(op, st, Self::to_ino(ino)?, flags, ctx)
        })
    }

    fn check_open(&self, ino: Ino, open_flags: i32, _ctx: &Ctx) -> Result<()> {
        self.reading(1, |st| {
            self.do_check_open(st, Self::to_ino(ino)?, open_flags)
        })
    }

    fn seek_data(&self, ino: Ino, offset: u64, data: bool) -> Result<u64> {
        let r = self.reading(1, |st| {
            self.do_seek_data(st, Self::to_ino(ino)?, offset, data)
        });
        self.checked(r)
    }

    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        if offset == 0 {
            self.will_readdir(&[ino]);
        }
        // An attempt cut short by a miss resumes after the last entry it emitted.
        let mut from = offset;
        let r = self.reading(1, |st| {
            self.do_readdir(st, Self::to_ino(ino)?, from, &mut |e: DirEntry| {
                let next = e.next_offset;
                let taken = emit(e);
                if taken {
                    from = next;
                }
                taken
            })
        });
        self.checked(r)
    }

    fn statfs(&self) -> Result<StatFs> {
        let st = self.read_lock();
        let free = st.sb.free_blocks_count as u64;
        // A sparse image's host may fill first: what it cannot back is not free.
        let writable = self.engine().writable_blocks(free);
        Ok(StatFs {
            block_size: self.geo.bs,
            blocks: (self.geo.blocks_count as u64).saturating_sub(self.overhead(&st)),
            blocks_free: writable,
            blocks_avail: free
                .saturating_sub(st.sb.r_blocks_count as u64)
                .min(writable),
            files: self.geo.inodes_count as u64,
            files_free: st.sb.free_inodes_count as u64,
            name_max: NAME_MAX as u32,
        })
    }

    fn fsync(&self, ino: Ino, _datasync: bool) -> Result<()> {
        let ino = Self::to_ino(ino)?;
        let journaled = self.svc.transactional();
        let op = self.begin_internal();
        let heads = {
            let mut st = self.lock();
            st.counters.fsyncs += 1;
            // With the names leading to it: each directory up the chain whose own name
            // may not be durable yet contributes its pending changes. (Under a
            // transaction service the commit covers everything: no need to look.)
            let heads = st.syncs.take_for_fsync(ino, !journaled, ROOT_INO);
            if st.sb_dirty && !self.read_only {
                // Counts are summaries; writing them here keeps a crash's fsck quieter.
                self.write_super(&op, &mut st)?;
            }
            heads
        };
        op.tx.end()?;
        self.svc.make_durable(&heads)?;
        Ok(())
    }

    fn sync_all(&self) -> Result<()> {
        let op = self.begin_internal();
        {
            let mut st = self.lock();
            if st.sb_dirty && !self.read_only {
                self.write_super(&op, &mut st)?;
            }
            st.syncs.clear();
        }
        op.tx.end()?;
        Ok(self.svc.sync()?)
    }

    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        self.warm_inode(ino, None);
        self.change(ctx, |op, st| {
            self.do_setxattr(op, st, Self::to_ino(ino)?, name, Some(value), flags, ctx)
        })
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        let r = self.reading(1, |st| self.do_getxattr(st, Self::to_ino(ino)?, name));
        self.checked(r)
    }

    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        let r = self.reading(1, |st| self.do_listxattr(st, Self::to_ino(ino)?));
        self.checked(r)
    }

    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.warm_inode(ino, None);
        self.change(ctx, |op, st| {
            self.do_setxattr(
                op,
                st,
                Self::to_ino(ino)?,
                name,
                None,
                XattrFlags::default(),
                ctx,
            )
        })
    }

    fn open(&self, ino: Ino) -> Result<()> {
        let ino = Self::to_ino(ino)?;
        self.reading(1, |st| self.read_live_inode(st, ino))?;
        let mut st = self.lock();
        self.read_live_inode(&st, ino)?;
        st.files.open(ino);
        Ok(())
    }

    fn release(&self, ino: Ino) -> Result<()> {
        self.release_all(&[ino])
    }

    fn counters(&self) -> Vec<(String, u64)> {
        self.counters_list()
    }
}
