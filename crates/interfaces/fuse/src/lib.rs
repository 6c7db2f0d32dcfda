//! The FUSE adapter: translates kernel requests into [`quilt_vfs::FileSystem`] calls.
//!
//! Choices: the kernel checks permissions (`default_permissions`); attributes and entries
//! are cached for one second; writes go through to the server (1 MiB at most each), so a
//! write the file system cannot store fails in write(2) itself, as on a kernel file
//! system; the kernel's writeback cache is an option (`writeback_cache`) for fewer,
//! larger writes, kept within what the file system can still store (see `room`);
//! requests are served by several threads.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use quilt_fusewire::abi::{fattr, fopen, init};
use quilt_fusewire::{
    Attr as WireAttr, DirBuf, Entry, Handler, InitReply, KernelInit, Notifier, Op, Reply, Request,
    Session, Transport,
};
use quilt_vfs::{
    Attr, Ctx, FsError, Ino, KernelFs, RenameFlags, SetAttr, TimeOrNow, Timespec, XattrFlags,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

mod callers;
mod clone;
mod control;
mod fileattr;
mod room;
mod stats;
use callers::Callers;
use control::{is_control, CONTROL_INO};
pub use quilt_fusewire::{unmount, HandoffMode, MountKind, RingOptions};
use stats::Op as Stat;
pub use stats::RequestStats;

const TTL: Duration = Duration::from_secs(1);

/// How long a stat(2) waits for the kernel to send a file's cached writes.
const WRITE_BACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The kernel's dirty bound for a mount under the writeback cache, by default.
pub const DIRTY_LIMIT: u64 = 64 << 20;

/// Read-ahead asked of the kernel: as large as one READ.
const READ_AHEAD: u64 = 1 << 20;

thread_local! {
    /// Each server thread's READ reply, filled by the module in place and kept for the
    /// next: a read costs no allocation, and no page faults for a fresh megabyte.
    static READ_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// What the mount names as its block device (see [`quilt_fusewire::mount`]): with one,
/// the mount is `fuseblk`, so sync(1) and syncfs(2) reach the server.
#[derive(Debug, Clone)]
pub enum BlockTarget {
    /// The image is this block device.
    Device(PathBuf),
    /// The image is this file: a loop device is attached over it while mounted.
    File(PathBuf),
}

/// Settings of one mount.
#[derive(Debug, Clone)]
pub struct FuseOptions {
    pub fs_name: String,
    pub read_only: bool,
    /// Let other users in (needed for services running as another user).
    pub allow_other: bool,
    pub threads: usize,
    /// Serve over io_uring when the kernel offers it (the fuse module's `enable_uring`
    /// is set), with this many workers per CPU; /dev/fuse otherwise, or when None.
    pub ring: Option<RingOptions>,
    /// Kernel writeback cache. Off (the default), every write(2) reaches the server
    /// before it returns, so no space, too large and I/O errors fail the write itself.
    /// On, the kernel gathers writes in its page cache and sends them later, at most
    /// `dirty_limit` of them at a time, and the mount keeps room for them (see
    /// `room`); where it cannot bound the kernel (no access to /sys/class/bdi), files
    /// opened for writing write through.
    pub writeback_cache: bool,
    /// What the kernel may hold dirty under the writeback cache (at most a sixteenth of
    /// the file system).
    pub dirty_limit: u64,
    /// The kernel checks permissions against the mode bits (on by default). Off, every
    /// request reaches the file system unchecked: tests use that to drive it as any
    /// user without modelling permissions.
    pub default_permissions: bool,
    /// POSIX ACLs (FUSE_POSIX_ACL): the kernel enforces the file system's ACLs, which
    /// it reads as `system.posix_acl_*` attributes, and leaves the umask to the file
    /// system (which applies it only where no default ACL is inherited). Needs
    /// `default_permissions`. Off, the kernel applies the umask and the mode bits only.
    pub posix_acl: bool,
    /// Options passed through to the kernel as they are.
    pub extra: Vec<String>,
    /// Mount as fuseblk over this (root only; plain FUSE otherwise).
    pub block: Option<BlockTarget>,
    /// The file system's block size (fuseblk's `blksize`).
    pub block_size: u32,
    /// Where the adapter counts requests (share it to report them).
    pub stats: Arc<RequestStats>,
    /// How long the kernel may keep names and attributes without asking again: a
    /// second for a file system only this mount changes; zero for a namespace others
    /// change too (a strongly consistent namespace service).
    pub cache_ttl: Duration,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            fs_name: "quiltfs".into(),
            read_only: false,
            allow_other: false,
            threads: 4,
            ring: Some(RingOptions::default()),
            writeback_cache: false,
            dirty_limit: DIRTY_LIMIT,
            default_permissions: true,
            posix_acl: false,
            extra: Vec::new(),
            block: None,
            block_size: 4096,
            cache_ttl: TTL,
            stats: Arc::default(),
        }
    }
}

/// Something to run when the kernel ends the session (flush and mark clean).
pub type OnUnmount = Box<dyn FnOnce() + Send + Sync>;

struct Adapter<F: KernelFs> {
    fs: Arc<F>,
    inos: Inos,
    ttl: Duration,
    writeback_cache: bool,
    /// The writeback cache's reservation, once the mount exists (see `room`).
    room: OnceLock<Arc<room::Room>>,
    /// Read-ahead waits for the first request: the kernel sets its own when it takes
    /// the answer to INIT, after the mount exists.
    read_ahead: Mutex<Option<room::Bdi>>,
    read_ahead_pending: std::sync::atomic::AtomicBool,
    read_only: bool,
    posix_acl: bool,
    on_unmount: Mutex<Option<OnUnmount>>,
    stats: Arc<RequestStats>,
    /// Set once the session exists: tells the kernel when we changed attributes it has
    /// cached (privileges dropped by a write).
    notifier: OnceLock<Notifier>,
    /// The kernel's lookup count of each inode it holds. While it is above zero the
    /// inode is held open in the file system (`FileSystem::open`), so an unlinked inode
    /// is not freed, nor its number reused, while the kernel may still send requests for
    /// it (writeback of its dirty pages, getattr of a cached inode); FORGET lets go.
    lookups: Mutex<std::collections::HashMap<u64, u64>>,
    /// Processes taking part in patchgroups (see `callers`).
    callers: Arc<Callers>,
    /// Releases the patchgroups of exited processes while the session lasts.
    _reaper: callers::Watcher,
}

fn errno(e: FsError) -> i32 {
    match &e {
        FsError::Corrupt(_) => tracing::error!("{e}"),
        FsError::Io(io) => tracing::error!("{e}{}", causes(io)),
        _ => {}
    }
    e.errno()
}

/// The causes below an I/O failure's message that it does not already show, as
/// `: cause: cause...` (a device's `io::Error` under the block layer's message).
fn causes(io: &quilt_vfs::IoError) -> String {
    let mut out = String::new();
    let mut shown = io.message().to_string();
    let mut next = io.cause().map(|c| c as &(dyn std::error::Error + 'static));
    while let Some(c) = next {
        let text = c.to_string();
        if !shown.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
            shown.push_str(&text);
        }
        next = c.source();
    }
    out
}

fn wire_attr(a: &Attr, inos: Inos) -> WireAttr {
    WireAttr {
        ino: inos.to_fuse(a.ino).0,
        size: a.size,
        blocks: a.blocks,
        atime: (a.atime.sec, a.atime.nsec),
        mtime: (a.mtime.sec, a.mtime.nsec),
        ctime: (a.ctime.sec, a.ctime.nsec),
        mode: a.kind.mode_bits() | a.perm as u32,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
    }
}

fn entry(a: &WireAttr, ttl: Duration) -> Entry {
    Entry {
        attr: *a,
        generation: 0,
        entry_valid: ttl,
        attr_valid: ttl,
    }
}

/// FUSE's root is inode 1; the file system's root keeps its own number. Inode 1 of ext2
/// (the bad-blocks inode) is never visible, so the two swap. Per mount: one process may
/// serve an ext2 image (root 2) and a betrfs one (root 1) at once.
#[derive(Clone, Copy, Debug)]
struct Inos {
    root: u64,
}

/// A node id as the kernel numbers inodes (its root is 1). A type of its own so that one
/// is never handed to the file system, or an inode number to the kernel, without
/// [`Inos`] between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct NodeId(pub u64);

/// The control file's node (it has no inode in the file system).
const CONTROL_NODE: NodeId = NodeId(CONTROL_INO);

impl Inos {
    fn swap(self, n: u64) -> u64 {
        if n == self.root {
            1
        } else if n == 1 {
            self.root
        } else {
            n
        }
    }
    fn to_fuse(self, ino: Ino) -> NodeId {
        NodeId(self.swap(ino))
    }
    fn to_fs(self, node: NodeId) -> Ino {
        self.swap(node.0)
    }
}

/// Whether `t` is within a second or two of the clock (a time the kernel just read).
fn near_now(t: (i64, u32)) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    (t.0 - now).abs() <= 2
}

fn spec(t: (i64, u32)) -> Timespec {
    Timespec {
        sec: t.0,
        nsec: t.1.min(999_999_999),
    }
}

impl<F: KernelFs> Adapter<F> {
    /// The handle and open flags for `ino` opened with `flags` by process `pid`: through
    /// the kernel's cache, or (writeback cache on, opened for writing, and no room kept
    /// for it) directly, so a write that does not fit fails in write(2) instead of at
    /// close. A handle opened for writing through the cache is marked (`room::CACHED`)
    /// and counted until it is released.
    ///
    /// Without the writeback cache, a handle opened write-only writes directly: each
    /// write(2) is then exactly one WRITE request, where the cached path splits a write
    /// that starts inside a page into one request per partial page (about 1.8 requests
    /// per write(2) in an untar), and the kernel asks nothing before it (the cached
    /// path asks for `security.capability` on the first write of every inode; we drop
    /// it ourselves, see `write`). Write-only handles cannot be mapped, and the kernel
    /// drops its cached pages of the range a direct write covers, so readers through
    /// other handles still see the data. What is lost: the written pages are not left
    /// in the kernel's cache, so reading them back asks the server (which caches them).
    fn open_reply(&self, ino: u64, flags: i32, pid: u64) -> (u64, u32) {
        let access = flags & libc::O_ACCMODE;
        if !self.writeback_cache {
            let direct = access == libc::O_WRONLY;
            return (pid, if direct { fopen::DIRECT_IO } else { 0 });
        }
        if access == libc::O_RDONLY {
            return (pid, 0);
        }
        match self.room.get() {
            Some(r) if r.open_cached(ino) => (pid | room::CACHED, 0),
            _ => (pid, fopen::DIRECT_IO),
        }
    }

    /// The kernel's write-back to an append-only file: it writes whole pages, so the
    /// first one repeats the bytes the file already ends with. Those are the file's own
    /// (nothing may change them), so only what lies past the end is written. (Any other
    /// refusal stands.)
    fn write_back_appended(
        &self,
        ino: u64,
        offset: u64,
        data: &[u8],
        c: &Ctx,
    ) -> Result<u32, FsError> {
        let appends = self.fs.get_flags(ino)? & quilt_vfs::flags::APPEND != 0;
        let size = self.fs.getattr(ino)?.size;
        if !appends || offset >= size {
            return Err(FsError::Perm);
        }
        let repeated = ((size - offset) as usize).min(data.len());
        if repeated < data.len() {
            let n = self.fs.write(ino, size, &data[repeated..], c)? as usize;
            if n < data.len() - repeated {
                return Ok((repeated + n) as u32);
            }
        }
        Ok(data.len() as u32)
    }

    /// The rest of a write-back that the file system took only `done` bytes of: asked
    /// again (a few times) until it is all taken or the file system says why not.
    fn write_back_rest(
        &self,
        ino: u64,
        offset: u64,
        data: &[u8],
        mut done: usize,
        c: &Ctx,
    ) -> Result<u32, FsError> {
        for _ in 0..4 {
            if done >= data.len() {
                return Ok(data.len() as u32);
            }
            match self
                .fs
                .write(ino, offset.saturating_add(done as u64), &data[done..], c)?
            {
                0 => break,
                m => done += m as usize,
            }
        }
        if done >= data.len() {
            return Ok(data.len() as u32);
        }
        // Taking nothing more and saying nothing: a full file system, as write(2) says.
        Err(FsError::NoSpace)
    }

    /// Read-ahead as large as one READ, once the kernel has taken the answer to INIT
    /// (which sets it to the smaller of its default and ours).
    #[cold]
    fn set_read_ahead(&self) {
        let Some(b) = self
            .read_ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        self.read_ahead_pending
            .store(false, std::sync::atomic::Ordering::Relaxed);
        match b.read_ahead(READ_AHEAD) {
            // Another user's mount (fusermount3) keeps the kernel's.
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                tracing::debug!("setting read-ahead: {e}")
            }
            Err(e) => tracing::warn!("setting read-ahead: {e}"),
            Ok(()) => {}
        }
    }

    /// Bytes a write by `uid` may still take: root's may take the blocks reserved for
    /// it, as may the kernel's write-back (which comes with no one's credentials).
    fn free_bytes(&self, uid: u32) -> u64 {
        self.fs
            .statfs()
            .map(|s| {
                let blocks = if uid == 0 {
                    s.blocks_free
                } else {
                    s.blocks_avail
                };
                blocks.saturating_mul(s.block_size as u64)
            })
            .unwrap_or(0)
    }

    /// Of `blocks` free, what statfs says: without the room's share while space is low.
    fn reportable(&self, blocks: u64, block_size: u32) -> u64 {
        let bs = u64::from(block_size.max(1));
        match self.room.get() {
            Some(r) => r.reportable(blocks.saturating_mul(bs)) / bs,
            None => blocks,
        }
    }

    /// Looks at free space again if the room asks for it, and acts on a change.
    fn recheck_room(&self, force: bool, wrote: u64) {
        let Some(r) = self.room.get() else { return };
        if !(force || r.wrote(wrote)) {
            return;
        }
        match r.check(self.free_bytes(0)) {
            Some(room::Change::BecameLow(inos)) => {
                tracing::info!("space is low: files opened for writing now write through");
                for ino in inos {
                    self.invalidate_attr(ino);
                }
            }
            Some(room::Change::BecameAmple) => {
                tracing::info!("space is ample again: files opened for writing use the cache")
            }
            None => {}
        }
    }

    /// After a space-freeing change: while space is low, it may be ample again.
    fn freed(&self) {
        if self.room.get().is_some_and(|r| r.is_low()) {
            self.recheck_room(true, 0);
        }
    }

    /// Whether a change by `uid` that takes `need` bytes, not from the kernel's
    /// write-back, may go ahead (while space is low it must leave room for what the
    /// kernel holds).
    fn admit(&self, need: u64, uid: u32) -> bool {
        match self.room.get() {
            Some(r) if r.is_low() => r.admit(need, self.free_bytes(uid), || self.free_bytes(uid)),
            _ => true,
        }
    }

    /// A write drops the file's capabilities (`security.capability`), whoever writes,
    /// as the kernel does for its own file systems: the cached write path asks for the
    /// attribute first, a direct write leaves it to us (HANDLE_KILLPRIV_V2).
    fn drop_capability(&self, ino: u64, writer: &Ctx) -> Result<(), FsError> {
        const CAPABILITY: &[u8] = b"security.capability";
        match self.fs.getxattr(ino, CAPABILITY) {
            Ok(_) => {
                // The kernel's removal is its own, not the writer's: no permission to
                // check, but the writer's patchgroups still order it.
                let c = Ctx {
                    uid: 0,
                    gid: 0,
                    ..*writer
                };
                match self.fs.removexattr(ino, CAPABILITY, &c) {
                    Ok(()) | Err(FsError::NoAttr) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            Err(FsError::NoAttr | FsError::NotSupported) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Drops what the kernel cached of what a clone changed.
    fn forget_changed(&self, c: clone::Changed) {
        let Some(n) = self.notifier.get() else { return };
        let r = match &c {
            clone::Changed::File(ino) => n.inval_inode(self.inos.to_fuse(*ino).0, 0, 0),
            clone::Changed::Entry(dir, name) => n
                .inval_entry(self.inos.to_fuse(*dir).0, name)
                .and_then(|()| n.inval_inode(self.inos.to_fuse(*dir).0, -1, 0)),
        };
        // ENOENT: the kernel held no copy.
        match r {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                tracing::warn!("invalidating the kernel's copy after a clone: {e}")
            }
            _ => {}
        }
    }

    /// Drops the kernel's cached attributes of `ino` (we changed them behind its back).
    fn invalidate_attr(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(self.inos.to_fuse(ino).0, -1, 0) {
                tracing::warn!("invalidating cached attributes of inode {ino}: {e}");
            }
        }
    }

    /// Makes the kernel send what it holds written of `ino` through the cache, if any
    /// handle writes it so: dropping its cached pages, it writes the dirty ones back
    /// (a page per WRITE, at most the dirty bound). A thread of its own asks, since the
    /// WRITEs come back to this server; it is waited for a bounded time (past that,
    /// the answer counts what has arrived).
    fn write_back_first(&self, ino: u64) {
        let (Some(room), Some(n)) = (self.room.get(), self.notifier.get()) else {
            return;
        };
        if !room.has_cached_writers(ino) {
            return;
        }
        let (n, node) = (n.clone(), self.inos.to_fuse(ino).0);
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("wbcache-flush".into())
            .spawn(move || {
                let _ = tx.send(n.inval_inode(node, 0, 0));
            });
        match spawned.map(|_| rx.recv_timeout(WRITE_BACK_WAIT)) {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!("writing back inode {ino} before stat: {e}"),
            Ok(Err(_)) => tracing::warn!("writing back inode {ino} before stat: timed out"),
            Err(e) => tracing::warn!("writing back inode {ino} before stat: {e}"),
        }
    }

    /// Who asks: credentials, and the process whose patchgroups order the change.
    fn ctx(&self, req: &Request<'_>) -> Ctx {
        Ctx {
            uid: req.header.uid,
            gid: req.header.gid,
            pid: self.callers.caller(req.header.pid, self.fs.as_ref()) as u32,
            umask: 0,
        }
    }

    /// Counts one more kernel reference to the inode of `a` (an entry we reply with).
    /// Fails only if the inode went away in between, which the caller reports as the
    /// lookup's result.
    fn remember(&self, a: &Attr) -> Result<(), FsError> {
        if a.ino == self.fs.root() {
            return Ok(());
        }
        let mut m = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(a.ino).or_insert(0);
        if *n == 0 {
            if let Err(e) = self.fs.reference(a.ino) {
                m.remove(&a.ino);
                return Err(e);
            }
        }
        *n += 1;
        Ok(())
    }

    /// Takes `nlookup` of the kernel's lookups of `ino`; true when none are left.
    fn forgotten(&self, ino: u64, nlookup: u64) -> bool {
        let mut m = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let Some(n) = m.get_mut(&ino) else {
            return false;
        };
        *n = n.saturating_sub(nlookup);
        if *n == 0 {
            m.remove(&ino);
            return true;
        }
        false
    }

    /// Takes the kernel's lookups `(ino, nlookup)` and lets the module go of the inodes
    /// left with none, all at once (an `rm -rf` forgets its unlinked files in batches,
    /// which the module frees together).
    fn forget_all(&self, forgets: impl IntoIterator<Item = (u64, u64)>) {
        let gone: Vec<u64> = forgets
            .into_iter()
            .filter(|&(ino, n)| self.forgotten(ino, n))
            .map(|(ino, _)| ino)
            .collect();
        if gone.is_empty() {
            return;
        }
        if let Err(e) = self.fs.unreference_all(&gone) {
            tracing::warn!("releasing inodes {gone:?} after FORGET: {e}");
        }
        // An unlinked file's blocks are freed only now.
        self.freed();
    }

    fn reply_entry(&self, r: Result<Attr, FsError>, reply: Reply<'_>) {
        match r.and_then(|a| self.remember(&a).map(|()| a)) {
            Ok(a) => reply.entry(&entry(&wire_attr(&a, self.inos), self.ttl)),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// READDIRPLUS: names with their attributes, so that `rm -rf`, `find` and `ls -l`
    /// need no LOOKUP per name. Each entry given with attributes counts as a lookup
    /// (the kernel FORGETs it later), except `.` and `..`, sent bare. The names are
    /// listed first and their attributes read after, outside the file system's listing.
    fn readdirplus(&self, dir: u64, offset: u64, size: u32, reply: Reply<'_>) {
        let mut names = Vec::new();
        let mut room = size as usize;
        let r = self.fs.readdir(dir, offset, &mut |e| {
            let need = DirBuf::plus_len(&e.name);
            if need > room {
                return false;
            }
            room -= need;
            names.push(e);
            true
        });
        if let Err(e) = r {
            return reply.error(errno(e));
        }
        let listed: Vec<quilt_vfs::Ino> = names
            .iter()
            .filter(|e| e.name != b"." && e.name != b"..")
            .map(|e| e.ino)
            .collect();
        self.fs.will_getattr(&listed);
        let mut buf = DirBuf::new(size);
        let mut dirs = Vec::new();
        for e in names {
            let bare = e.name == b"." || e.name == b"..";
            if !bare && e.kind == quilt_vfs::FileType::Directory {
                dirs.push(e.ino);
            }
            let attr = if bare {
                None
            } else {
                self.fs.getattr(e.ino).ok()
            };
            let added = match attr {
                Some(a) => match self.remember(&a) {
                    Ok(()) => {
                        let added = buf.add_plus(
                            &entry(&wire_attr(&a, self.inos), self.ttl),
                            e.next_offset,
                            &e.name,
                        );
                        if !added {
                            self.forget_all([(a.ino, 1)]);
                        }
                        added
                    }
                    Err(_) => buf.add_plus_bare(
                        self.inos.to_fuse(e.ino).0,
                        e.next_offset,
                        e.kind.mode_bits(),
                        &e.name,
                    ),
                },
                // `.`/`..`, or a name removed since it was listed: no attributes.
                None => buf.add_plus_bare(
                    self.inos.to_fuse(e.ino).0,
                    e.next_offset,
                    e.kind.mode_bits(),
                    &e.name,
                ),
            };
            if !added {
                if dirs.last() == Some(&e.ino) {
                    dirs.pop();
                }
                break;
            }
        }
        buf.send(reply);
        // After the answer: the caller goes on meanwhile.
        self.fs.will_readdir(&dirs);
    }

    fn reply_unit(&self, r: Result<(), FsError>, reply: Reply<'_>) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn kill_suid(&self, ino: u64, req: &Request<'_>) -> Result<(), FsError> {
        let a = self.fs.getattr(ino)?;
        let mode = a.perm as u32;
        let mut kept = mode & !libc::S_ISUID;
        if kept & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            let set = SetAttr {
                mode: Some(kept),
                ..SetAttr::default()
            };
            self.fs.setattr(ino, set, &self.ctx(req))?;
            // The write's reply carries no attributes: without this the kernel would
            // show (and exec with) the old mode until its cache times out.
            self.invalidate_attr(ino);
        }
        Ok(())
    }

    fn xattr_reply(&self, r: Result<Vec<u8>, FsError>, size: u32, reply: Reply<'_>) {
        match r {
            Ok(v) if size == 0 => reply.xattr_size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(libc::ERANGE),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request<'_>,
        node: NodeId,
        s: &quilt_fusewire::SetattrIn,
        reply: Reply<'_>,
    ) {
        let _t = self.stats.time(Stat::Setattr);
        if node == CONTROL_NODE {
            return reply.error(libc::EPERM);
        }
        let ino = self.inos.to_fs(node);
        let v = s.valid;
        // Under the writeback cache the kernel keeps mtime itself: it sends "now" as
        // the time it read (utimes(NULL), which still says ATIME_NOW), and after writes
        // the mtime they set, when it flushes them (at close, fsync or unmount, maybe
        // seconds later). Either is stored as the kernel sent it, so the file keeps the
        // time programs saw, but judged as "now" (an append-only file's writer may set
        // it; an explicit time far from now stays refused).
        let kernel_now = self.writeback_cache
            && v & fattr::MTIME != 0
            && v & fattr::MTIME_NOW == 0
            && (v & fattr::ATIME == 0 || v & fattr::ATIME_NOW != 0)
            && near_now(s.mtime);
        let time = |now: u32, set: u32, t: (i64, u32)| {
            if v & now != 0 {
                Some(TimeOrNow::Now)
            } else if v & set != 0 && set == fattr::MTIME && kernel_now {
                Some(TimeOrNow::NowAt(spec(t)))
            } else if v & set != 0 {
                Some(TimeOrNow::At(spec(t)))
            } else {
                None
            }
        };
        let set = SetAttr {
            mode: (v & fattr::MODE != 0).then_some(s.mode),
            uid: (v & fattr::UID != 0).then_some(s.uid),
            gid: (v & fattr::GID != 0).then_some(s.gid),
            size: (v & fattr::SIZE != 0).then_some(s.size),
            atime: time(fattr::ATIME_NOW, fattr::ATIME, s.atime),
            mtime: time(fattr::MTIME_NOW, fattr::MTIME, s.mtime),
            ctime: (v & fattr::CTIME != 0).then(|| spec(s.ctime)),
        };
        if v & fattr::KILL_SUIDGID != 0 && set.mode.is_none() {
            // The kernel found the caller without CAP_FSETID (a truncate): we drop the
            // privileges, as HANDLE_KILLPRIV_V2 asks.
            if let Err(e) = self.kill_suid(ino, req) {
                return reply.error(errno(e));
            }
        }
        let resized = set.size.is_some();
        match self.fs.setattr(ino, set, &self.ctx(req)) {
            Ok(a) => reply.attr(&wire_attr(&a, self.inos), self.ttl),
            Err(e) => reply.error(errno(e)),
        }
        if resized {
            self.freed();
        }
    }

    fn create(&self, req: &Request<'_>, reply: Reply<'_>) {
        let Op::Create {
            name,
            flags,
            mode,
            umask,
        } = req.op
        else {
            return reply.error(libc::EINVAL);
        };
        let parent = NodeId(req.header.nodeid);
        let _t = self.stats.time(Stat::Create);
        if is_control(parent, name) {
            return reply.error(libc::EEXIST);
        }
        let mut c = self.ctx(req);
        c.umask = umask;
        let mode = if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        let r = self
            .fs
            .create_open(self.inos.to_fs(parent), name, mode, &c)
            .and_then(|a| self.remember(&a).map(|()| a));
        match r {
            Ok(a) => {
                let (fh, open) = self.open_reply(a.ino, flags, c.pid as u64);
                reply.created(&entry(&wire_attr(&a, self.inos), self.ttl), fh, open)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(&self, req: &Request<'_>, reply: Reply<'_>) {
        let Op::Write {
            fh,
            offset,
            data,
            write_flags: wflags,
        } = req.op
        else {
            return reply.error(libc::EINVAL);
        };
        let node = NodeId(req.header.nodeid);
        let ino = self.inos.to_fs(node);
        let _t = self.stats.time(Stat::Write);
        if node == CONTROL_NODE {
            return reply.error(libc::EPERM);
        }
        let mut c = self.ctx(req);
        let writeback = req.header.pid == 0;
        if writeback {
            // Writeback by the kernel: done for whoever opened the handle.
            c.pid = fh as u32;
        } else if !self.admit(data.len() as u64, req.header.uid) {
            // Space is low and this would take what the kernel's cached writes need.
            return reply.error(libc::ENOSPC);
        }
        if let Err(e) = self.drop_capability(ino, &c) {
            return reply.error(errno(e));
        }
        if wflags & quilt_fusewire::abi::WRITE_KILL_SUIDGID != 0 {
            // A writer without CAP_FSETID (the kernel decided): drop the privileges
            // first, as the kernel's own file systems do.
            if let Err(e) = self.kill_suid(ino, req) {
                return reply.error(errno(e));
            }
        }
        let written = match self.fs.write(ino, offset, data, &c) {
            Err(FsError::Perm) if writeback => self.write_back_appended(ino, offset, data, &c),
            // The kernel takes a short answer to its write-back as all written: what
            // was left would be lost with fsync and close none the wiser. The rest is
            // asked again, so the reason (the maximum file size, no space) reaches them.
            Ok(n) if writeback && (n as usize) < data.len() => {
                self.write_back_rest(ino, offset, data, n as usize, &c)
            }
            r => r,
        };
        match written {
            Ok(n) => {
                reply.written(n);
                self.recheck_room(false, n as u64);
                if writeback && self.room.get().is_some_and(|r| r.gated(ino)) {
                    // Keep the next write(2) to it asking first (see `room`).
                    self.invalidate_attr(ino);
                }
            }
            Err(e) => reply.error(errno(e)),
        }
    }
}

impl<F: KernelFs + 'static> Handler for Adapter<F> {
    fn init(&self, _kernel: &KernelInit) -> InitReply {
        // HANDLE_KILLPRIV_V2: we drop set-user-ID and set-group-ID on chown and on
        // writes and truncates flagged by the kernel, so the kernel marks inodes S_NOSEC
        // once it has seen they carry no privileges, instead of asking for
        // security.capability on every write(2) and for fresh attributes before every
        // chown.
        // DO_READDIRPLUS: every listing carries attributes (with READDIRPLUS_AUTO the
        // kernel listed the rest of a large directory without them and then looked up
        // names one by one: 438 LOOKUPs in a 3,000-entry rm -rf instead of none).
        let mut flags = init::ASYNC_READ
            | init::DO_READDIRPLUS
            | init::PARALLEL_DIROPS
            | init::HANDLE_KILLPRIV_V2
            | init::SETXATTR_EXT;
        if self.posix_acl {
            // DONT_MASK too: FUSE applies the umask itself unless told not to, and with a
            // default ACL it must not apply (the file system applies it where none is).
            flags |= init::POSIX_ACL | init::DONT_MASK;
        }
        if self.writeback_cache && !self.read_only {
            flags |= init::WRITEBACK_CACHE;
        }
        InitReply {
            flags,
            max_write: 1 << 20,
            max_readahead: 1 << 20,
            ..InitReply::default()
        }
    }

    fn destroy(&self) {
        let f = self
            .on_unmount
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(f) = f {
            f();
        }
    }

    fn request(&self, req: &Request<'_>, reply: Reply<'_>) {
        if self
            .read_ahead_pending
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.set_read_ahead();
        }
        let node = NodeId(req.header.nodeid);
        let ino = self.inos.to_fs(node);
        match &req.op {
            Op::Lookup { name } => {
                let _t = self.stats.time(Stat::Lookup);
                if is_control(node, name) {
                    return reply.entry(&entry(&control::attr(), TTL));
                }
                self.reply_entry(self.fs.lookup(ino, name), reply);
            }
            Op::Forget { nlookup } => {
                if node != CONTROL_NODE {
                    self.forget_all([(ino, *nlookup)]);
                }
                reply.none();
            }
            Op::BatchForget(nodes) => {
                self.forget_all(
                    nodes
                        .iter()
                        .filter(|&&(node, _)| node != CONTROL_INO)
                        .map(|&(node, n)| (self.inos.to_fs(NodeId(node)), n)),
                );
                reply.none();
            }
            Op::Getattr { fh } => {
                let _t = self.stats.time(Stat::Getattr);
                if node == CONTROL_NODE {
                    return reply.attr(&control::attr(), TTL);
                }
                // A write(2) through the cache asks with its handle once its attributes
                // were dropped: while space is low, that is the gate (see `room`).
                let gated = fh.is_some_and(|h| h & room::CACHED != 0)
                    && self.room.get().is_some_and(|r| r.gated(ino));
                if gated && self.free_bytes(req.header.uid) < room::GATE {
                    // A file system may hold room it can give back (betrfs's log until
                    // its next checkpoint): settled first, it says what is truly left.
                    if let Err(e) = self.fs.sync_all() {
                        tracing::warn!("syncing before refusing a write for space: {e}");
                    }
                    if self.free_bytes(req.header.uid) < room::GATE {
                        return reply.error(libc::ENOSPC);
                    }
                }
                if fh.is_none() {
                    // stat(2) of a file the kernel may hold written pages of: they are
                    // sent first, so st_blocks counts them (tar --sparse takes a file
                    // with none for all holes). Only a stat that reaches us: within
                    // the attribute timeout the kernel answers from its own cache.
                    self.write_back_first(ino);
                }
                match self.fs.getattr(ino) {
                    Ok(a) => {
                        reply.attr(&wire_attr(&a, self.inos), self.ttl);
                        if gated {
                            self.invalidate_attr(ino);
                        }
                    }
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Setattr(s) => self.setattr(req, node, s, reply),
            Op::Readlink => {
                let _t = self.stats.time(Stat::Readlink);
                match self.fs.readlink(ino) {
                    Ok(t) => reply.data(&t),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Mknod {
                name,
                mode,
                rdev,
                umask,
            } => {
                let _t = self.stats.time(Stat::Mknod);
                if is_control(node, name) {
                    return reply.error(libc::EEXIST);
                }
                let mut c = self.ctx(req);
                c.umask = *umask;
                self.reply_entry(self.fs.mknod(ino, name, *mode, *rdev, &c), reply);
            }
            Op::Mkdir { name, mode, umask } => {
                let _t = self.stats.time(Stat::Mkdir);
                if is_control(node, name) {
                    return reply.error(libc::EEXIST);
                }
                let mut c = self.ctx(req);
                c.umask = *umask;
                self.reply_entry(self.fs.mkdir(ino, name, *mode, &c), reply);
            }
            Op::Unlink { name } => {
                let _t = self.stats.time(Stat::Unlink);
                if is_control(node, name) {
                    return reply.error(libc::EPERM);
                }
                self.reply_unit(self.fs.unlink(ino, name, &self.ctx(req)), reply);
                self.freed();
            }
            Op::Rmdir { name } => {
                let _t = self.stats.time(Stat::Rmdir);
                if is_control(node, name) {
                    return reply.error(libc::ENOTDIR);
                }
                self.reply_unit(self.fs.rmdir(ino, name, &self.ctx(req)), reply);
                self.freed();
            }
            Op::Symlink { name, target } => {
                let _t = self.stats.time(Stat::Symlink);
                if is_control(node, name) {
                    return reply.error(libc::EEXIST);
                }
                let r = self.fs.symlink(ino, name, target, &self.ctx(req));
                self.reply_entry(r, reply);
            }
            Op::Rename {
                name,
                newdir,
                newname,
                flags,
            } => {
                let _t = self.stats.time(Stat::Rename);
                if is_control(node, name) || is_control(NodeId(*newdir), newname) {
                    return reply.error(libc::EPERM);
                }
                let known = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT;
                if flags & !known != 0 {
                    // Anything newer: callers fall back on this.
                    return reply.error(libc::EOPNOTSUPP);
                }
                let f = RenameFlags {
                    noreplace: flags & libc::RENAME_NOREPLACE != 0,
                    exchange: flags & libc::RENAME_EXCHANGE != 0,
                    whiteout: flags & libc::RENAME_WHITEOUT != 0,
                };
                let r = self.fs.rename(
                    ino,
                    name,
                    self.inos.to_fs(NodeId(*newdir)),
                    newname,
                    f,
                    &self.ctx(req),
                );
                self.reply_unit(r, reply);
            }
            Op::Link { oldnode, newname } => {
                let _t = self.stats.time(Stat::Link);
                if is_control(node, newname) {
                    return reply.error(libc::EEXIST);
                }
                let r = self.fs.link(
                    self.inos.to_fs(NodeId(*oldnode)),
                    ino,
                    newname,
                    &self.ctx(req),
                );
                self.reply_entry(r, reply);
            }
            Op::Open { flags } => {
                let _t = self.stats.time(Stat::Open);
                if node == CONTROL_NODE {
                    return reply.open(0, fopen::DIRECT_IO);
                }
                // The handle remembers who opened the file: the kernel's writeback of
                // its pages comes with no process id, and is done for the opener.
                let opener = self.ctx(req).pid as u64;
                if let Err(e) = self.fs.check_open(ino, *flags, &self.ctx(req)) {
                    return reply.error(errno(e));
                }
                match self.fs.open(ino) {
                    Ok(()) => {
                        let (fh, open) = self.open_reply(ino, *flags, opener);
                        reply.open(fh, open)
                    }
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Read { offset, size, .. } => {
                let _t = self.stats.time(Stat::Read);
                if node == CONTROL_NODE {
                    return reply.data(&[]);
                }
                // Out of the thread's slot for the request and back after it (a slot
                // found empty costs only an allocation).
                let mut buf = READ_BUF.with(|b| b.take());
                buf.clear();
                match self.fs.read_into(ino, *offset, *size, &mut buf) {
                    Ok(()) => reply.data(&buf),
                    Err(e) => reply.error(errno(e)),
                }
                READ_BUF.with(|b| b.replace(buf));
            }
            Op::Write { .. } => self.write(req, reply),
            Op::Flush { .. } => {
                let _t = self.stats.time(Stat::Flush);
                // close(2) needs nothing from us (writes reached us in write(2), or the
                // kernel writes dirty pages before asking): ENOSYS tells it to stop
                // sending FLUSH, one request less per file.
                reply.error(libc::ENOSYS);
            }
            Op::Release { .. } => {
                let _t = self.stats.time(Stat::Release);
                if node == CONTROL_NODE {
                    return reply.ok();
                }
                if let (Op::Release { fh, .. }, Some(r)) = (&req.op, self.room.get()) {
                    if fh & room::CACHED != 0 {
                        r.closed(ino);
                    }
                }
                self.reply_unit(self.fs.release(ino), reply);
                self.freed();
            }
            Op::Fsync { datasync, .. } => {
                let _t = self.stats.time(Stat::Fsync);
                if node == CONTROL_NODE {
                    return reply.ok();
                }
                match self.fs.fsync(ino, *datasync) {
                    Ok(()) => {
                        reply.ok();
                        if self.writeback_cache {
                            // The kernel keeps the attributes it had before writing
                            // back; the data is ours now, so let stat see its true
                            // block count.
                            self.invalidate_attr(ino);
                        }
                    }
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Fsyncdir { datasync, .. } => {
                let _t = self.stats.time(Stat::Fsyncdir);
                self.reply_unit(self.fs.fsync(ino, *datasync), reply);
            }
            Op::Syncfs => {
                let _t = self.stats.time(Stat::Syncfs);
                // sync(1) and syncfs(2): everything written so far becomes durable.
                self.reply_unit(self.fs.sync_all(), reply);
            }
            Op::Opendir { .. } => reply.open(0, 0),
            Op::Releasedir { .. } => reply.ok(),
            Op::Readdir { offset, size, .. } => {
                let _t = self.stats.time(Stat::Readdir);
                let mut buf = DirBuf::new(*size);
                let r = self.fs.readdir(ino, *offset, &mut |e| {
                    buf.add(
                        self.inos.to_fuse(e.ino).0,
                        e.next_offset,
                        e.kind.mode_bits(),
                        &e.name,
                    )
                });
                match r {
                    Ok(()) => buf.send(reply),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Readdirplus { offset, size, .. } => {
                let _t = self.stats.time(Stat::Readdirplus);
                self.readdirplus(ino, *offset, *size, reply);
            }
            Op::Statfs => {
                let _t = self.stats.time(Stat::Statfs);
                match self.fs.statfs() {
                    Ok(s) => reply.statfs(&quilt_fusewire::Statfs {
                        blocks: s.blocks,
                        bfree: self.reportable(s.blocks_free, s.block_size),
                        bavail: self.reportable(s.blocks_avail, s.block_size),
                        files: s.files,
                        ffree: s.files_free,
                        bsize: s.block_size,
                        namelen: s.name_max,
                        frsize: s.block_size,
                    }),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Setxattr {
                name,
                value,
                flags,
                setxattr_flags,
            } => {
                let _t = self.stats.time(Stat::Setxattr);
                if node == CONTROL_NODE {
                    return reply.error(libc::EPERM);
                }
                let f = XattrFlags {
                    create: flags & libc::XATTR_CREATE != 0,
                    replace: flags & libc::XATTR_REPLACE != 0,
                    kill_sgid: setxattr_flags & quilt_fusewire::abi::SETXATTR_ACL_KILL_SGID != 0,
                };
                let r = self.fs.setxattr(ino, name, value, f, &self.ctx(req));
                self.reply_unit(r, reply);
            }
            Op::Getxattr { name, size } => {
                let _t = self.stats.time(Stat::Getxattr);
                if node == CONTROL_NODE {
                    return reply.error(libc::ENODATA);
                }
                self.xattr_reply(self.fs.getxattr(ino, name), *size, reply);
            }
            Op::Listxattr { size } => {
                let _t = self.stats.time(Stat::Listxattr);
                if node == CONTROL_NODE {
                    return self.xattr_reply(Ok(Vec::new()), *size, reply);
                }
                self.xattr_reply(self.fs.listxattr(ino), *size, reply);
            }
            Op::Removexattr { name } => {
                let _t = self.stats.time(Stat::Removexattr);
                if node == CONTROL_NODE {
                    return reply.error(libc::EPERM);
                }
                self.reply_unit(self.fs.removexattr(ino, name, &self.ctx(req)), reply);
            }
            Op::Access { mask } => {
                let _t = self.stats.time(Stat::Access);
                if node == CONTROL_NODE {
                    return reply.ok();
                }
                self.reply_unit(self.fs.access(ino, *mask, &self.ctx(req)), reply);
            }
            Op::Create { .. } => self.create(req, reply),
            Op::Ioctl {
                cmd,
                input,
                out_size,
                ..
            } => {
                let _t = self.stats.time(Stat::Ioctl);
                if node != CONTROL_NODE {
                    if clone::is_clone(*cmd) {
                        let inos = self.inos;
                        return match clone::ioctl(
                            self.fs.as_ref(),
                            ino,
                            *cmd,
                            input,
                            &self.ctx(req),
                            |i| inos.to_fs(NodeId(i)),
                            |i| inos.to_fuse(i).0,
                        ) {
                            Ok((out, changed)) => {
                                // Before the answer: the caller's next look must not
                                // find the kernel's old copy (a negative entry, pages).
                                self.forget_changed(changed);
                                reply.ioctl(0, &out[..out.len().min(*out_size as usize)])
                            }
                            Err(e) => reply.error(errno(e)),
                        };
                    }
                    if !fileattr::is_fileattr(*cmd) {
                        return reply.error(libc::ENOTTY);
                    }
                    return match fileattr::ioctl(self.fs.as_ref(), ino, *cmd, input, &self.ctx(req))
                    {
                        Ok(out) => reply.ioctl(0, &out[..out.len().min(*out_size as usize)]),
                        Err(e) => reply.error(errno(e)),
                    };
                }
                match control::ioctl(
                    self.fs.as_ref(),
                    &self.callers,
                    req.header.pid,
                    *cmd,
                    input,
                    *out_size,
                ) {
                    Ok(out) => reply.ioctl(0, &out),
                    Err(e) => reply.error(e),
                }
            }
            Op::Tmpfile { flags, mode, umask } => {
                let _t = self.stats.time(Stat::Create);
                if node == CONTROL_NODE {
                    return reply.error(libc::ENOTDIR);
                }
                let mut c = self.ctx(req);
                c.umask = *umask;
                let r = self
                    .fs
                    .tmpfile(ino, *mode, &c)
                    .and_then(|a| self.fs.open(a.ino).map(|()| a))
                    .and_then(|a| self.remember(&a).map(|()| a));
                match r {
                    Ok(a) => {
                        let (fh, open) = self.open_reply(a.ino, *flags, c.pid as u64);
                        reply.created(&entry(&wire_attr(&a, self.inos), self.ttl), fh, open)
                    }
                    // The kernel then answers EOPNOTSUPP, so callers fall back.
                    Err(FsError::NotSupported) => reply.error(libc::ENOSYS),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::CopyFileRange {
                off_in,
                nodeid_out,
                off_out,
                len,
                flags,
                ..
            } => {
                let _t = self.stats.time(Stat::CopyFileRange);
                if node == CONTROL_NODE || *nodeid_out == CONTROL_INO {
                    return reply.error(libc::EINVAL);
                }
                if *flags != 0 {
                    return reply.error(libc::EINVAL);
                }
                // The answer counts bytes in 32 bits.
                let len = (*len).min(u32::MAX as u64 & !4095);
                if !self.admit(len, req.header.uid) {
                    return reply.error(libc::ENOSPC);
                }
                match self.fs.copy_file_range(
                    ino,
                    *off_in,
                    self.inos.to_fs(NodeId(*nodeid_out)),
                    *off_out,
                    len,
                    &self.ctx(req),
                ) {
                    Ok(n) => reply.written(n.min(len) as u32),
                    // The kernel copies through reads and writes, and stops asking.
                    Err(FsError::NotSupported) => reply.error(libc::ENOSYS),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Lseek { offset, whence, .. } => {
                let _t = self.stats.time(Stat::Lseek);
                // The kernel asks only for SEEK_DATA and SEEK_HOLE.
                let data = match *whence as i32 {
                    libc::SEEK_DATA => true,
                    libc::SEEK_HOLE => false,
                    _ => return reply.error(libc::EINVAL),
                };
                if node == CONTROL_NODE {
                    return reply.error(libc::ENXIO);
                }
                match self.fs.seek_data(ino, *offset, data) {
                    Ok(o) => reply.lseek(o),
                    // The kernel then treats the file as all data, and stops asking.
                    Err(FsError::NotSupported) => reply.error(libc::ENOSYS),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Op::Fallocate {
                offset,
                length,
                mode,
                ..
            } => {
                let _t = self.stats.time(Stat::Fallocate);
                if node == CONTROL_NODE {
                    return reply.error(libc::EPERM);
                }
                let allocates = *mode as i32 & libc::FALLOC_FL_PUNCH_HOLE == 0;
                if allocates && !self.admit(*length, req.header.uid) {
                    return reply.error(libc::ENOSPC);
                }
                let r = self
                    .fs
                    .fallocate(ino, *offset, *length, *mode as i32, &self.ctx(req));
                self.reply_unit(r, reply);
                if allocates {
                    self.recheck_room(true, 0);
                } else {
                    self.freed();
                }
            }
            // Not served: ENOSYS makes the kernel answer EOPNOTSUPP and stop asking.
            _ => reply.error(libc::ENOSYS),
        }
    }
}

fn adapter<F: KernelFs + 'static>(
    fs: Arc<F>,
    opts: &FuseOptions,
    on_unmount: OnUnmount,
) -> Adapter<F> {
    let callers = Arc::new(Callers::default());
    let reaper = callers.watch(fs.clone(), Duration::from_millis(500));
    Adapter {
        inos: Inos { root: fs.root() },
        ttl: opts.cache_ttl,
        fs,
        writeback_cache: opts.writeback_cache && !opts.read_only,
        room: OnceLock::new(),
        read_ahead: Mutex::new(None),
        read_ahead_pending: Default::default(),
        read_only: opts.read_only,
        posix_acl: opts.posix_acl && opts.default_permissions,
        on_unmount: Mutex::new(Some(on_unmount)),
        stats: opts.stats.clone(),
        notifier: OnceLock::new(),
        lookups: Default::default(),
        callers,
        _reaper: reaper,
    }
}

/// The kernel's settings for the new mount at `mountpoint`: read-ahead as large as a
/// READ, and under the writeback cache its dirty bound and the room kept for it. Where
/// the settings cannot be written (another user's mount), read-ahead stays the
/// kernel's and files opened for writing write through.
fn settle<F: KernelFs>(
    adapter: &Adapter<F>,
    mountpoint: &Path,
    kind: MountKind,
    opts: &FuseOptions,
) {
    let bdi = match room::Bdi::of_mount(mountpoint, kind == MountKind::Fuseblk) {
        Ok(b) => b,
        Err(e) => {
            if adapter.writeback_cache {
                tracing::warn!("the mount's backing device: {e}; writes go through");
            }
            return;
        }
    };
    *adapter.read_ahead.lock().unwrap_or_else(|e| e.into_inner()) = Some(bdi.clone());
    adapter
        .read_ahead_pending
        .store(true, std::sync::atomic::Ordering::Release);
    if !adapter.writeback_cache {
        return;
    }
    // At most a sixteenth of the file system, so small ones still use the cache.
    let size = adapter
        .fs
        .statfs()
        .map(|s| s.blocks.saturating_mul(s.block_size as u64))
        .unwrap_or(0);
    let limit = opts.dirty_limit.min(size / 16);
    match room::Room::new(bdi, limit, mountpoint) {
        Ok(r) => {
            let _ = adapter.room.set(r);
            adapter.recheck_room(true, 0);
        }
        Err(e) => tracing::warn!("bounding the kernel's dirty data: {e}; writes go through"),
    }
}

fn mount(mountpoint: &Path, opts: &FuseOptions) -> std::io::Result<quilt_fusewire::Mounted> {
    let block = match &opts.block {
        None => None,
        Some(BlockTarget::Device(p)) => Some(quilt_fusewire::BlockSource::Device(p.clone())),
        Some(BlockTarget::File(p)) => Some(quilt_fusewire::BlockSource::File(
            std::fs::OpenOptions::new()
                .read(true)
                .write(!opts.read_only)
                .open(p)?,
        )),
    };
    quilt_fusewire::mount(
        mountpoint,
        quilt_fusewire::MountOptions {
            fs_name: opts.fs_name.clone(),
            subtype: "quiltfs".into(),
            read_only: opts.read_only,
            allow_other: opts.allow_other,
            default_permissions: opts.default_permissions,
            extra: opts.extra.clone(),
            block,
            block_size: opts.block_size,
        },
    )
}

/// Mounts `fs` at `mountpoint` and serves it on this thread until it is unmounted.
/// `ready` runs once the mount exists, with its kind; `on_unmount` when the session
/// ends (for a fuseblk mount, before umount(2) returns).
pub fn serve<F: KernelFs + 'static>(
    fs: Arc<F>,
    mountpoint: &Path,
    opts: &FuseOptions,
    ready: impl FnOnce(MountKind),
    on_unmount: OnUnmount,
) -> std::io::Result<()> {
    let adapter = adapter(fs, opts, on_unmount);
    let mounted = mount(mountpoint, opts)?;
    settle(&adapter, mountpoint, mounted.kind, opts);
    let loop_dev = mounted.loop_dev;
    let session = Session::new(mounted.channel, opts.threads).with_ring(opts.ring);
    let _ = adapter.notifier.set(session.notifier());
    opts.stats.set_ring_stats(session.ring_stats());
    ready(mounted.kind);
    let stats = opts.stats.clone();
    let r = session.run_reporting(Arc::new(adapter), &move |t| {
        stats.set_ring(t == Transport::Ring)
    });
    // The kernel has let go of the mount: the loop device over the image goes now, so
    // that nothing holds the image once this process ends.
    let detached = loop_dev.map_or(Ok(()), |l| l.detach());
    r.and(detached)
}

/// Tells the kernel that the file system changed under its mount by another way than
/// the mount: a program that links the file system and serves it in the same process
/// calls these after changing it natively, so names and attributes the kernel cached
/// (for up to the entry and attribute timeouts) are asked for again. Changes made
/// through the mount, and patchgroup calls (which change order, not files), need none.
#[derive(Clone)]
pub struct Invalidator {
    notifier: Notifier,
    inos: Inos,
}

impl Invalidator {
    /// The inode's attributes and cached data changed.
    pub fn inode(&self, ino: u64) -> std::io::Result<()> {
        known(self.notifier.inval_inode(self.inos.to_fuse(ino).0, 0, 0))
    }

    /// `name` in directory `parent` was added, removed or now names another inode.
    pub fn entry(&self, parent: u64, name: &[u8]) -> std::io::Result<()> {
        known(self.notifier.inval_entry(self.inos.to_fuse(parent).0, name))?;
        // The directory's own attributes (size, times, link count) changed too.
        self.inode(parent)
    }
}

/// The kernel answers ENOENT for what it holds no copy of: nothing to drop.
fn known(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

/// A mount served by a background thread (for tests); dropping it unmounts.
pub struct BackgroundSession {
    mountpoint: PathBuf,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    invalidator: Invalidator,
}

impl BackgroundSession {
    /// Where to report native changes to the file system while it is mounted.
    pub fn invalidator(&self) -> Invalidator {
        self.invalidator.clone()
    }

    /// Unmounts and waits until the session has ended.
    pub fn umount_and_join(mut self) -> std::io::Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> std::io::Result<()> {
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        if let Err(e) = quilt_fusewire::unmount(&self.mountpoint, false) {
            tracing::warn!("unmounting {}: {e}; detaching", self.mountpoint.display());
            quilt_fusewire::unmount(&self.mountpoint, true)?;
        }
        t.join()
            .map_err(|_| std::io::Error::other("the FUSE session panicked"))?
    }
}

impl Drop for BackgroundSession {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!(
                "ending the FUSE session on {}: {e}",
                self.mountpoint.display()
            );
        }
    }
}

/// Mounts `fs` in a background thread; dropping the handle unmounts (for tests).
pub fn spawn<F: KernelFs + 'static>(
    fs: Arc<F>,
    mountpoint: &Path,
    opts: &FuseOptions,
    on_unmount: OnUnmount,
) -> std::io::Result<BackgroundSession> {
    let adapter = adapter(fs, opts, on_unmount);
    let mounted = mount(mountpoint, opts)?;
    settle(&adapter, mountpoint, mounted.kind, opts);
    let session = Session::new(mounted.channel, opts.threads).with_ring(opts.ring);
    let _ = adapter.notifier.set(session.notifier());
    opts.stats.set_ring_stats(session.ring_stats());
    let invalidator = Invalidator {
        notifier: session.notifier(),
        inos: adapter.inos,
    };
    let adapter = Arc::new(adapter);
    let stats = opts.stats.clone();
    let thread = std::thread::Builder::new()
        .name("fuse-session".into())
        .spawn(move || {
            session.run_reporting(adapter, &move |t| stats.set_ring(t == Transport::Ring))
        })?;
    Ok(BackgroundSession {
        mountpoint: mountpoint.to_path_buf(),
        thread: Some(thread),
        invalidator,
    })
}
