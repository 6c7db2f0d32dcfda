//! The FUSE adapter: translates kernel requests into [`quilt_vfs::FileSystem`] calls.
//!
//! Choices: the kernel checks permissions (`default_permissions`); attributes and entries
//! are cached for one second; writes go through to the server (1 MiB at most each), so a
//! write the file system cannot store fails in write(2) itself, as on a kernel file
//! system; the kernel's writeback cache is an option (`writeback_cache`) that trades
//! that for fewer, larger writes; requests are served by several threads.

use fuser::{
    AccessFlags, Config, Errno, FileAttr, FileHandle, FileType as FuseType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags,
    RenameFlags as FuseRename, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, SessionACL,
    TimeOrNow as FuseTime, WriteFlags,
};
use quilt_vfs::{
    Attr, Ctx, FileSystem, FileType, FsError, RenameFlags, SetAttr, TimeOrNow, Timespec, XattrFlags,
};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod callers;
mod control;
mod stats;
use callers::Callers;
use control::{is_control, CONTROL_INO};
use stats::Op;
pub use stats::RequestStats;

const TTL: Duration = Duration::from_secs(1);

/// Under the writeback cache, opens for writing bypass the cache while free space is
/// below this, so a write that would not fit fails in write(2). More than the kernel
/// lets one FUSE mount hold dirty (its share of the dirty limit, strictly enforced).
pub const LOW_SPACE: u64 = 128 << 20;

/// Settings of one mount.
#[derive(Debug, Clone)]
pub struct FuseOptions {
    pub fs_name: String,
    pub read_only: bool,
    /// Let other users in (needed for services running as another user).
    pub allow_other: bool,
    pub threads: usize,
    /// Kernel writeback cache. Off (the default), every write(2) reaches the server
    /// before it returns, so no space, too large and I/O errors fail the write itself.
    /// On, the kernel gathers writes in its page cache and sends them later: errors then
    /// surface only at fsync(2) or close(2), so opens for writing while free space is
    /// below [`LOW_SPACE`] bypass the cache (direct I/O).
    pub writeback_cache: bool,
    /// The kernel checks permissions against the mode bits (on by default). Off, every
    /// request reaches the file system unchecked: tests use that to drive it as any
    /// user without modelling permissions.
    pub default_permissions: bool,
    /// Options passed through to the kernel as they are.
    pub extra: Vec<String>,
    /// Where the adapter counts requests (share it to report them).
    pub stats: Arc<RequestStats>,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            fs_name: "quiltfs".into(),
            read_only: false,
            allow_other: false,
            threads: 4,
            writeback_cache: false,
            default_permissions: true,
            extra: Vec::new(),
            stats: Arc::default(),
        }
    }
}

/// Something to run when the kernel ends the session (flush and mark clean).
pub type OnUnmount = Box<dyn FnOnce() + Send + Sync>;

struct Adapter<F: FileSystem> {
    fs: Arc<F>,
    writeback_cache: bool,
    read_only: bool,
    on_unmount: Option<OnUnmount>,
    stats: Arc<RequestStats>,
    /// Set once the session exists: tells the kernel when we changed attributes it has
    /// cached (privileges dropped by a write).
    notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// The kernel's lookup count of each inode it holds. While it is above zero the
    /// inode is held open in the file system (`FileSystem::open`), so an unlinked inode
    /// is not freed, nor its number reused, while the kernel may still send requests for
    /// it (writeback of its dirty pages, getattr of a cached inode); FORGET lets go.
    lookups: std::sync::Mutex<std::collections::HashMap<u64, u64>>,
    /// Processes taking part in patchgroups (see `callers`).
    callers: Arc<Callers>,
    /// Releases the patchgroups of exited processes while the session lasts.
    _reaper: callers::Watcher,
}

fn errno(e: FsError) -> Errno {
    if let FsError::Corrupt(m) | FsError::Io(m) = &e {
        tracing::error!("{e}: {m}");
    }
    Errno::from_i32(e.errno())
}

fn to_system(t: Timespec) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs()) + Duration::from_nanos(t.nsec as u64)
    }
}

fn from_system(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            let mut sec = -(d.as_secs() as i64);
            let mut nsec = d.subsec_nanos();
            if nsec > 0 {
                sec -= 1;
                nsec = 1_000_000_000 - nsec;
            }
            Timespec { sec, nsec }
        }
    }
}

fn kind(k: FileType) -> FuseType {
    match k {
        FileType::Regular => FuseType::RegularFile,
        FileType::Directory => FuseType::Directory,
        FileType::Symlink => FuseType::Symlink,
        FileType::CharDevice => FuseType::CharDevice,
        FileType::BlockDevice => FuseType::BlockDevice,
        FileType::Fifo => FuseType::NamedPipe,
        FileType::Socket => FuseType::Socket,
    }
}

fn fattr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(fuse_ino(a.ino)),
        size: a.size,
        blocks: a.blocks,
        atime: to_system(a.atime),
        mtime: to_system(a.mtime),
        ctime: to_system(a.ctime),
        crtime: to_system(a.ctime),
        kind: kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: 0,
    }
}

// FUSE's root is inode 1; the file system's root keeps its own number. Inode 1 of ext2
// (the bad-blocks inode) is never visible, so the two swap.
static ROOT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(2);

fn fuse_ino(ino: u64) -> u64 {
    let root = ROOT.load(std::sync::atomic::Ordering::Relaxed);
    if ino == root {
        1
    } else if ino == 1 {
        root
    } else {
        ino
    }
}
fn fs_ino(ino: INodeNo) -> u64 {
    fuse_ino(ino.0)
}

fn time_or_now(t: FuseTime) -> TimeOrNow {
    match t {
        FuseTime::Now => TimeOrNow::Now,
        FuseTime::SpecificTime(s) => TimeOrNow::At(from_system(s)),
    }
}

impl<F: FileSystem> Adapter<F> {
    /// Who asks: credentials, and the process whose patchgroups order the change.
    /// How a file is opened: through the kernel's cache, or (writeback cache on, opened
    /// for writing, free space low) directly, so a write that does not fit fails in
    /// write(2) instead of at close.
    fn open_flags(&self, flags: i32) -> FopenFlags {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if self.writeback_cache && writes {
            let low = self
                .fs
                .statfs()
                .map(|s| s.blocks_free * s.block_size as u64 <= LOW_SPACE)
                .unwrap_or(true);
            if low {
                return FopenFlags::FOPEN_DIRECT_IO;
            }
        }
        FopenFlags::empty()
    }

    /// Drops the kernel's cached attributes of `ino` (we changed them behind its back).
    fn invalidate_attr(&self, ino: u64) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(INodeNo(fuse_ino(ino)), -1, 0) {
                tracing::warn!("invalidating cached attributes of inode {ino}: {e}");
            }
        }
    }

    fn ctx(&self, req: &Request) -> Ctx {
        Ctx {
            uid: req.uid(),
            gid: req.gid(),
            pid: self.callers.caller(req.pid(), self.fs.as_ref()) as u32,
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
            if let Err(e) = self.fs.open(a.ino) {
                m.remove(&a.ino);
                return Err(e);
            }
        }
        *n += 1;
        Ok(())
    }

    fn forget_n(&self, ino: u64, nlookup: u64) {
        let mut m = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let Some(n) = m.get_mut(&ino) else { return };
        *n = n.saturating_sub(nlookup);
        if *n == 0 {
            m.remove(&ino);
            drop(m);
            if let Err(e) = self.fs.release(ino) {
                tracing::warn!("releasing inode {ino} after FORGET: {e}");
            }
        }
    }

    fn reply_entry(&self, r: Result<Attr, FsError>, reply: ReplyEntry) {
        match r.and_then(|a| self.remember(&a).map(|()| a)) {
            Ok(a) => reply.entry(&TTL, &fattr(&a), Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn kill_suid(&self, ino: u64, req: &Request) -> Result<(), FsError> {
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
            if let Some(n) = self.notifier.get() {
                if let Err(e) = n.inval_inode(INodeNo(fuse_ino(ino)), -1, 0) {
                    tracing::warn!("invalidating cached attributes of inode {ino}: {e}");
                }
            }
        }
        Ok(())
    }
}

impl<F: FileSystem + 'static> Filesystem for Adapter<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        // HANDLE_KILLPRIV_V2: we drop set-user-ID and set-group-ID on chown and on
        // writes flagged by the kernel, so the kernel marks inodes S_NOSEC once it has
        // seen they carry no privileges, instead of asking for security.capability on
        // every write(2) and for fresh attributes before every chown.
        let mut want = InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        if self.writeback_cache && !self.read_only {
            want |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        if let Err(missing) = config.add_capabilities(want) {
            tracing::info!("kernel lacks FUSE capabilities {missing:?}");
            let _ = config.add_capabilities(want & !missing);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        if let Some(f) = self.on_unmount.take() {
            f();
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _t = self.stats.time(Op::Lookup);
        if is_control(parent, name) {
            return reply.entry(&TTL, &control::attr(), Generation(0));
        }
        self.reply_entry(self.fs.lookup(fs_ino(parent), name.as_bytes()), reply);
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if ino.0 == CONTROL_INO {
            return;
        }
        self.forget_n(fs_ino(ino), nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _t = self.stats.time(Op::Getattr);
        if ino.0 == CONTROL_INO {
            return reply.attr(&TTL, &control::attr());
        }
        match self.fs.getattr(fs_ino(ino)) {
            Ok(a) => reply.attr(&TTL, &fattr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<FuseTime>,
        mtime: Option<FuseTime>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _t = self.stats.time(Op::Setattr);
        if ino.0 == CONTROL_INO {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time_or_now),
            mtime: mtime.map(time_or_now),
            ctime: ctime.map(from_system),
        };
        if size.is_some() && mode.is_none() && req.uid() != 0 {
            // The kernel flags a truncate by a caller without CAP_FSETID for us to drop
            // set-user-ID, but fuser does not pass that flag on: uid 0 stands for the
            // capability here.
            if let Err(e) = self.kill_suid(fs_ino(ino), req) {
                return reply.error(errno(e));
            }
        }
        match self.fs.setattr(fs_ino(ino), set, &self.ctx(req)) {
            Ok(a) => reply.attr(&TTL, &fattr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _t = self.stats.time(Op::Readlink);
        match self.fs.readlink(fs_ino(ino)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.time(Op::Mknod);
        if is_control(parent, name) {
            return reply.error(Errno::from_i32(libc::EEXIST));
        }
        let mut c = self.ctx(req);
        c.umask = umask;
        let r = self
            .fs
            .mknod(fs_ino(parent), name.as_bytes(), mode, rdev, &c);
        self.reply_entry(r, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.time(Op::Mkdir);
        if is_control(parent, name) {
            return reply.error(Errno::from_i32(libc::EEXIST));
        }
        let mut c = self.ctx(req);
        c.umask = umask;
        self.reply_entry(
            self.fs.mkdir(fs_ino(parent), name.as_bytes(), mode, &c),
            reply,
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.stats.time(Op::Unlink);
        if is_control(parent, name) {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        match self
            .fs
            .unlink(fs_ino(parent), name.as_bytes(), &self.ctx(req))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.stats.time(Op::Rmdir);
        if is_control(parent, name) {
            return reply.error(Errno::from_i32(libc::ENOTDIR));
        }
        match self
            .fs
            .rmdir(fs_ino(parent), name.as_bytes(), &self.ctx(req))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.time(Op::Symlink);
        if is_control(parent, link_name) {
            return reply.error(Errno::from_i32(libc::EEXIST));
        }
        let r = self.fs.symlink(
            fs_ino(parent),
            link_name.as_bytes(),
            target.as_os_str().as_bytes(),
            &self.ctx(req),
        );
        self.reply_entry(r, reply);
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRename,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Rename);
        if is_control(parent, name) || is_control(newparent, newname) {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        if flags.contains(FuseRename::RENAME_WHITEOUT) {
            return reply.error(Errno::from_i32(libc::EINVAL));
        }
        let f = RenameFlags {
            noreplace: flags.contains(FuseRename::RENAME_NOREPLACE),
            exchange: flags.contains(FuseRename::RENAME_EXCHANGE),
        };
        match self.fs.rename(
            fs_ino(parent),
            name.as_bytes(),
            fs_ino(newparent),
            newname.as_bytes(),
            f,
            &self.ctx(req),
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.time(Op::Link);
        if is_control(newparent, newname) {
            return reply.error(Errno::from_i32(libc::EEXIST));
        }
        let r = self.fs.link(
            fs_ino(ino),
            fs_ino(newparent),
            newname.as_bytes(),
            &self.ctx(req),
        );
        self.reply_entry(r, reply);
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.stats.time(Op::Open);
        if ino.0 == CONTROL_INO {
            return reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
        }
        // The handle remembers who opened the file: the kernel's writeback of its pages
        // comes with no process id, and is done for the opener.
        let opener = self.ctx(req).pid as u64;
        match self.fs.open(fs_ino(ino)) {
            Ok(()) => reply.opened(FileHandle(opener), self.open_flags(flags.0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _t = self.stats.time(Op::Read);
        if ino.0 == CONTROL_INO {
            return reply.data(&[]);
        }
        match self.fs.read(fs_ino(ino), offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        wflags: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _t = self.stats.time(Op::Write);
        if ino.0 == CONTROL_INO {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        let mut c = self.ctx(req);
        if req.pid() == 0 {
            // Writeback by the kernel: done for whoever opened the handle.
            c.pid = fh.0 as u32;
        }
        if wflags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            // A writer without CAP_FSETID (the kernel decided): drop the privileges
            // first, as the kernel's own file systems do.
            if let Err(e) = self.kill_suid(fs_ino(ino), req) {
                return reply.error(errno(e));
            }
        }
        match self.fs.write(fs_ino(ino), offset, data, &c) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Flush);
        // close(2) needs nothing from us (the kernel writes dirty pages before asking):
        // ENOSYS tells it to stop sending FLUSH, one request less per file.
        reply.error(Errno::from_i32(libc::ENOSYS));
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Release);
        if ino.0 == CONTROL_INO {
            return reply.ok();
        }
        match self.fs.release(fs_ino(ino)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Fsync);
        if ino.0 == CONTROL_INO {
            return reply.ok();
        }
        match self.fs.fsync(fs_ino(ino), datasync) {
            Ok(()) => {
                reply.ok();
                if self.writeback_cache {
                    // The kernel keeps the attributes it had before writing back; the
                    // data is ours now, so let stat see its true block count.
                    self.invalidate_attr(fs_ino(ino));
                }
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _t = self.stats.time(Op::Readdir);
        let r = self.fs.readdir(fs_ino(ino), offset, &mut |e| {
            !reply.add(
                INodeNo(fuse_ino(e.ino)),
                e.next_offset,
                kind(e.kind),
                OsStr::from_bytes(&e.name),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Fsyncdir);
        match self.fs.fsync(fs_ino(ino), datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _t = self.stats.time(Op::Statfs);
        match self.fs.statfs() {
            Ok(s) => reply.statfs(
                s.blocks,
                s.blocks_free,
                s.blocks_avail,
                s.files,
                s.files_free,
                s.block_size,
                s.name_max,
                s.block_size,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.time(Op::Setxattr);
        if ino.0 == CONTROL_INO {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        let f = XattrFlags {
            create: flags & libc::XATTR_CREATE != 0,
            replace: flags & libc::XATTR_REPLACE != 0,
        };
        match self
            .fs
            .setxattr(fs_ino(ino), name.as_bytes(), value, f, &self.ctx(req))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _t = self.stats.time(Op::Getxattr);
        if ino.0 == CONTROL_INO {
            return reply.error(Errno::from_i32(libc::ENODATA));
        }
        match self.fs.getxattr(fs_ino(ino), name.as_bytes()) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::from_i32(libc::ERANGE)),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _t = self.stats.time(Op::Listxattr);
        if ino.0 == CONTROL_INO {
            return if size == 0 {
                reply.size(0)
            } else {
                reply.data(&[])
            };
        }
        match self.fs.listxattr(fs_ino(ino)) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(Errno::from_i32(libc::ERANGE)),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.stats.time(Op::Removexattr);
        if ino.0 == CONTROL_INO {
            return reply.error(Errno::from_i32(libc::EPERM));
        }
        match self
            .fs
            .removexattr(fs_ino(ino), name.as_bytes(), &self.ctx(req))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let _t = self.stats.time(Op::Access);
        if ino.0 == CONTROL_INO {
            return reply.ok();
        }
        match self
            .fs
            .access(fs_ino(ino), mask.bits() as u32, &self.ctx(req))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _t = self.stats.time(Op::Create);
        if is_control(parent, name) {
            return reply.error(Errno::from_i32(libc::EEXIST));
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
            .mknod(fs_ino(parent), name.as_bytes(), mode, 0, &c)
            .and_then(|a| self.fs.open(a.ino).map(|()| a))
            .and_then(|a| self.remember(&a).map(|()| a));
        match r {
            Ok(a) => reply.created(
                &TTL,
                &fattr(&a),
                Generation(0),
                FileHandle(c.pid as u64),
                self.open_flags(flags),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        let _t = self.stats.time(Op::Ioctl);
        if ino.0 != CONTROL_INO {
            return reply.error(Errno::from_i32(libc::ENOTTY));
        }
        match control::ioctl(
            self.fs.as_ref(),
            &self.callers,
            req.pid(),
            cmd,
            in_data,
            out_size,
        ) {
            Ok(out) => reply.ioctl(0, &out),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }
}

fn config(opts: &FuseOptions) -> Config {
    let mut cfg = Config::default();
    let mut mo = vec![
        MountOption::FSName(opts.fs_name.clone()),
        MountOption::Subtype("quiltfs".into()),
        MountOption::Dev,
        MountOption::Suid,
    ];
    if opts.default_permissions {
        mo.push(MountOption::DefaultPermissions);
    }
    mo.push(if opts.read_only {
        MountOption::RO
    } else {
        MountOption::RW
    });
    for e in &opts.extra {
        mo.push(MountOption::CUSTOM(e.clone()));
    }
    cfg.mount_options = mo;
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads.max(1));
    cfg.clone_fd = opts.threads > 1;
    cfg
}

/// Mounts `fs` at `mountpoint` and serves it on this thread until it is unmounted.
/// `ready` runs once the mount exists; `on_unmount` when the session ends.
pub fn serve<F: FileSystem + 'static>(
    fs: Arc<F>,
    mountpoint: &Path,
    opts: &FuseOptions,
    ready: impl FnOnce(),
    on_unmount: OnUnmount,
) -> std::io::Result<()> {
    ROOT.store(fs.root(), std::sync::atomic::Ordering::Relaxed);
    let callers = Arc::new(Callers::default());
    let reaper = callers.watch(fs.clone(), Duration::from_millis(500));
    let adapter = Adapter {
        fs,
        writeback_cache: opts.writeback_cache,
        read_only: opts.read_only,
        on_unmount: Some(on_unmount),
        stats: opts.stats.clone(),
        notifier: Arc::default(),
        lookups: Default::default(),
        callers,
        _reaper: reaper,
    };
    let notifier = adapter.notifier.clone();
    let cfg = config(opts);
    let session = match mount_typed(mountpoint, opts)? {
        Some(fd) => fuser::Session::from_fd(adapter, fd, cfg.acl, cfg.clone())?,
        None => fuser::Session::new(adapter, mountpoint, &cfg)?,
    };
    let _ = notifier.set(session.notifier());
    ready();
    session.run()
}

/// Mounts with file-system type `fuse.quiltfs` (fuser always says plain `fuse`), so that
/// mount tables name us and util-linux finds our `umount.fuse.quiltfs` helper. Returns
/// None when not permitted (not root): the caller falls back to fuser's own mount.
fn mount_typed(
    mountpoint: &Path,
    opts: &FuseOptions,
) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let cstr = |b: &[u8]| {
        std::ffi::CString::new(b).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
    };
    // SAFETY: open/mount/close system calls on NUL-terminated strings we own.
    unsafe {
        let fd = libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        use std::os::fd::AsRawFd;
        let mut data = format!(
            "fd={},rootmode=40000,user_id={},group_id={}",
            fd.as_raw_fd(),
            libc::geteuid(),
            libc::getegid()
        );
        if opts.default_permissions {
            data.push_str(",default_permissions");
        }
        if opts.allow_other {
            data.push_str(",allow_other");
        }
        let mut flags: libc::c_ulong = 0;
        if opts.read_only {
            flags |= libc::MS_RDONLY;
        }
        for e in &opts.extra {
            match e.as_str() {
                "nodev" => flags |= libc::MS_NODEV,
                "nosuid" => flags |= libc::MS_NOSUID,
                "noexec" => flags |= libc::MS_NOEXEC,
                other => {
                    data.push(',');
                    data.push_str(other);
                }
            }
        }
        let source = cstr(opts.fs_name.as_bytes())?;
        let target = cstr(mountpoint.as_os_str().as_bytes())?;
        let data = cstr(data.as_bytes())?;
        let r = libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"fuse.quiltfs".as_ptr(),
            flags,
            data.as_ptr() as *const libc::c_void,
        );
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EPERM) {
                return Ok(None);
            }
            return Err(e);
        }
        Ok(Some(fd))
    }
}

/// Mounts `fs` in a background thread; dropping the handle unmounts (for tests).
pub fn spawn<F: FileSystem + 'static>(
    fs: Arc<F>,
    mountpoint: &Path,
    opts: &FuseOptions,
    on_unmount: OnUnmount,
) -> std::io::Result<fuser::BackgroundSession> {
    ROOT.store(fs.root(), std::sync::atomic::Ordering::Relaxed);
    let callers = Arc::new(Callers::default());
    let reaper = callers.watch(fs.clone(), Duration::from_millis(500));
    let adapter = Adapter {
        fs,
        writeback_cache: opts.writeback_cache,
        read_only: opts.read_only,
        on_unmount: Some(on_unmount),
        stats: opts.stats.clone(),
        notifier: Arc::default(),
        lookups: Default::default(),
        callers,
        _reaper: reaper,
    };
    let notifier = adapter.notifier.clone();
    let session = fuser::spawn_mount(adapter, mountpoint, &config(opts))?;
    let _ = notifier.set(session.notifier());
    Ok(session)
}
