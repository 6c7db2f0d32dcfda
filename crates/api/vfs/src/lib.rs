//! The file-system trait: inode-level POSIX operations that the FUSE adapter, the native
//! API users (tests, benchmarks, programs) and later the namespace service all drive.
//! File-system modules (ext2 now, the Bε-tree later) implement it.
//!
//! Conventions: inode numbers are the module's own (the root is [`FileSystem::root`]);
//! names are raw bytes; times are nanoseconds-resolution [`Timespec`]s; errors are
//! [`FsError`]s that map to one errno each at the FUSE boundary.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use std::fmt;

pub mod acl;
pub mod batch;
mod ioerr;
mod op;
pub mod rules;

pub use batch::{BatchError, Gate};
pub use ioerr::IoError;
pub use op::{FsOp, FsReply, InoGrant, WireError};

pub type Ino = u64;

/// Seconds and nanoseconds since the epoch.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Default,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Timespec {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
}

impl FileType {
    /// The `S_IFMT` bits of a mode.
    pub fn from_mode(mode: u32) -> Option<FileType> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileType::Regular,
            libc::S_IFDIR => FileType::Directory,
            libc::S_IFLNK => FileType::Symlink,
            libc::S_IFCHR => FileType::CharDevice,
            libc::S_IFBLK => FileType::BlockDevice,
            libc::S_IFIFO => FileType::Fifo,
            libc::S_IFSOCK => FileType::Socket,
            _ => return None,
        })
    }
    pub fn mode_bits(self) -> u32 {
        match self {
            FileType::Regular => libc::S_IFREG,
            FileType::Directory => libc::S_IFDIR,
            FileType::Symlink => libc::S_IFLNK,
            FileType::CharDevice => libc::S_IFCHR,
            FileType::BlockDevice => libc::S_IFBLK,
            FileType::Fifo => libc::S_IFIFO,
            FileType::Socket => libc::S_IFSOCK,
        }
    }
}

/// What `stat` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileType,
    /// Permission bits (and setuid/setgid/sticky), without the type.
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// 512-byte units allocated, metadata blocks included (as `st_blocks`).
    pub blocks: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub rdev: u32,
    pub blksize: u32,
}

/// Which attributes `setattr` changes; `None` leaves one alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeOrNow>,
    pub mtime: Option<TimeOrNow>,
    pub ctime: Option<Timespec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TimeOrNow {
    Now,
    At(Timespec),
    /// "Now" as the caller's kernel read it when the change was made: stored as given,
    /// judged as `Now` (who may set it). The FUSE writeback cache sends a write's mtime
    /// this way when it flushes it, which may be a second or more after the write.
    NowAt(Timespec),
}

impl TimeOrNow {
    pub fn resolve(self) -> Timespec {
        match self {
            TimeOrNow::Now => Timespec::now(),
            TimeOrNow::At(t) | TimeOrNow::NowAt(t) => t,
        }
    }
}

/// Who asks: credentials for new files and access checks, and the process whose engaged
/// patchgroups order the change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ctx {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// File-creation mask to apply to new modes (the FUSE kernel has usually applied it).
    pub umask: u32,
}

impl Ctx {
    pub fn root() -> Ctx {
        Ctx::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RenameFlags {
    /// RENAME_NOREPLACE: fail with EEXIST if the target exists.
    pub noreplace: bool,
    /// RENAME_EXCHANGE: swap the two names atomically.
    pub exchange: bool,
    /// RENAME_WHITEOUT: the old name is left naming a whiteout (a character device
    /// 0:0, owned by the caller), as overlayfs upper directories need.
    pub whiteout: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DirEntry {
    pub ino: Ino,
    pub kind: FileType,
    pub name: Vec<u8>,
    /// Cookie to resume listing after this entry.
    pub next_offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatFs {
    pub block_size: u32,
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_avail: u64,
    pub files: u64,
    pub files_free: u64,
    pub name_max: u32,
}

/// File-system errors, each one errno.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("file name too long")]
    NameTooLong,
    #[error("no space left on device")]
    NoSpace,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("permission denied")]
    Access,
    #[error("operation not permitted")]
    Perm,
    #[error("too many links")]
    TooManyLinks,
    #[error("file too large")]
    TooBig,
    #[error("no such attribute")]
    NoAttr,
    #[error("attribute value or list does not fit")]
    Range,
    #[error("read-only file system")]
    ReadOnly,
    #[error("operation not supported")]
    NotSupported,
    #[error("cross-device link")]
    CrossDevice,
    #[error("device busy")]
    Busy,
    /// The inode number names no file (any more): a stale handle (ESTALE).
    #[error("stale file handle")]
    Stale,
    /// fallocate of something that is not a regular file (ENODEV).
    #[error("not a regular file")]
    NoDevice,
    /// SEEK_DATA or SEEK_HOLE at or past the end of the file (ENXIO).
    #[error("no data at or after that offset")]
    NoData,
    /// The image is damaged where this operation looked; the message says where.
    #[error("file system corrupted: {0}")]
    Corrupt(String),
    /// The device or the patch layer failed; the [`IoError`] keeps the error that did.
    #[error("I/O error: {0}")]
    Io(IoError),
    /// A patchgroup rule was broken; `errno` is what the caller sees.
    #[error("{what}")]
    Patchgroup { errno: i32, what: String },
}

impl FsError {
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::Access => libc::EACCES,
            FsError::Perm => libc::EPERM,
            FsError::TooManyLinks => libc::EMLINK,
            FsError::TooBig => libc::EFBIG,
            FsError::NoAttr => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::ReadOnly => libc::EROFS,
            FsError::NotSupported => libc::EOPNOTSUPP,
            FsError::CrossDevice => libc::EXDEV,
            FsError::Busy => libc::EBUSY,
            FsError::NoDevice => libc::ENODEV,
            FsError::Stale => libc::ESTALE,
            FsError::NoData => libc::ENXIO,
            FsError::Corrupt(_) => libc::EIO,
            FsError::Io(_) => libc::EIO,
            FsError::Patchgroup { errno, .. } => *errno,
        }
    }
}

impl FsError {
    /// The error an errno stands for (the inverse of [`FsError::errno`]); for results of
    /// system calls, as when a file system is reached through a mount.
    pub fn from_errno(e: i32) -> FsError {
        match e {
            libc::ENOENT => FsError::NotFound,
            libc::EEXIST => FsError::Exists,
            libc::ENOTDIR => FsError::NotDir,
            libc::EISDIR => FsError::IsDir,
            libc::ENOTEMPTY => FsError::NotEmpty,
            libc::ENAMETOOLONG => FsError::NameTooLong,
            libc::ENOSPC => FsError::NoSpace,
            libc::EINVAL => FsError::Invalid("EINVAL"),
            libc::EACCES => FsError::Access,
            libc::EPERM => FsError::Perm,
            libc::EMLINK => FsError::TooManyLinks,
            libc::EFBIG => FsError::TooBig,
            libc::ENODATA => FsError::NoAttr,
            libc::ERANGE => FsError::Range,
            libc::EROFS => FsError::ReadOnly,
            libc::EOPNOTSUPP => FsError::NotSupported,
            libc::EXDEV => FsError::CrossDevice,
            libc::EBUSY => FsError::Busy,
            libc::ENODEV => FsError::NoDevice,
            libc::ESTALE => FsError::Stale,
            libc::ENXIO => FsError::NoData,
            libc::EIO => FsError::Io("EIO".into()),
            other => FsError::Io(format!("errno {other}").into()),
        }
    }
}

pub type Result<T, E = FsError> = std::result::Result<T, E>;

/// Bits of the `access` mask.
pub const R_OK: u32 = 4;
pub const W_OK: u32 = 2;
pub const X_OK: u32 = 1;

/// POSIX permission check of `mask` for `ctx` against an inode's owner, group and mode.
/// Root passes everything except execute on a file with no execute bit at all.
pub fn check_access(attr: &Attr, mask: u32, ctx: &Ctx) -> Result<()> {
    let mode = attr.perm as u32;
    if ctx.uid == 0 {
        if mask & X_OK != 0 && attr.kind != FileType::Directory && mode & 0o111 == 0 {
            return Err(FsError::Access);
        }
        return Ok(());
    }
    let bits = if ctx.uid == attr.uid {
        (mode >> 6) & 7
    } else if ctx.gid == attr.gid {
        (mode >> 3) & 7
    } else {
        mode & 7
    };
    if bits & mask == mask {
        Ok(())
    } else {
        Err(FsError::Access)
    }
}

/// Inode flags as FS_IOC_GETFLAGS/SETFLAGS carry them (the bits are ext2's on-disk
/// ones, which the kernel's interface kept).
pub mod flags {
    pub const SECRM: u32 = 0x0000_0001;
    pub const UNRM: u32 = 0x0000_0002;
    pub const COMPR: u32 = 0x0000_0004;
    /// Writes are synchronous.
    pub const SYNC: u32 = 0x0000_0008;
    /// No change at all: not its data, attributes, names or links.
    pub const IMMUTABLE: u32 = 0x0000_0010;
    /// Data only appended; no other change.
    pub const APPEND: u32 = 0x0000_0020;
    pub const NODUMP: u32 = 0x0000_0040;
    pub const NOATIME: u32 = 0x0000_0080;
    pub const NOCOMPR: u32 = 0x0000_0400;
    /// Hashed-tree directory (ext3's htree): set by the file system, cleared by ext2.
    pub const INDEX: u32 = 0x0000_1000;
    pub const JOURNAL_DATA: u32 = 0x0000_4000;
    pub const NOTAIL: u32 = 0x0000_8000;
    /// Directory changes are synchronous.
    pub const DIRSYNC: u32 = 0x0001_0000;
    pub const TOPDIR: u32 = 0x0002_0000;
    pub const EXTENTS: u32 = 0x0008_0000;
    pub const PROJINHERIT: u32 = 0x2000_0000;
    pub const CASEFOLD: u32 = 0x4000_0000;
}

/// Counters a module exposes; printed by `quiltfs stats` as text or JSON.
pub type Counters = Vec<(String, u64)>;

/// Inode-level POSIX operations. Every method takes `&self`: implementations serve
/// concurrent callers.
pub trait FileSystem: Send + Sync {
    fn root(&self) -> Ino;
    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr>;
    fn getattr(&self, ino: Ino) -> Result<Attr>;
    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr>;
    /// Creates a regular file, device node, fifo or socket (`mode` carries the type).
    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr>;
    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr>;
    fn unlink(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()>;
    fn rmdir(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()>;
    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr>;
    fn readlink(&self, ino: Ino) -> Result<Vec<u8>>;
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
        ctx: &Ctx,
    ) -> Result<()>;
    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr>;
    /// Reads up to `size` bytes at `offset`; short only at end of file.
    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>>;
    /// [`read`](Self::read) appended to `out`, for a caller that reuses its buffer (the
    /// FUSE server's per-thread reply buffer): a module that can fill it in place
    /// overrides this and a read costs no allocation. On an error, `out` may hold part
    /// of the data past its old length.
    fn read_into(&self, ino: Ino, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<()> {
        out.extend_from_slice(&self.read(ino, offset, size)?);
        Ok(())
    }
    /// Writes all of `data` at `offset` and returns the count.
    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32>;
    /// Lists entries from cookie `offset` (0 = start); `emit` returns false when full.
    /// Cookies stay valid while entries are added and removed.
    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()>;
    fn statfs(&self) -> Result<StatFs>;
    /// Makes the file's changes (and everything they depend on) durable.
    fn fsync(&self, ino: Ino, datasync: bool) -> Result<()>;
    /// Makes everything durable.
    fn sync_all(&self) -> Result<()>;
    fn access(&self, ino: Ino, mask: u32, ctx: &Ctx) -> Result<()> {
        check_access(&self.getattr(ino)?, mask, ctx)
    }
    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()>;
    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>>;
    /// Names, each NUL-terminated, as listxattr(2) returns them.
    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>>;
    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()>;
    /// A handle on `ino` was opened: an unlinked inode lives until its last `release`.
    fn open(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
    /// Creates a regular file and opens a handle on it (the kernel's CREATE): `mknod`
    /// then `open`. A module that does both in one step (the namespace service's client,
    /// in one request) overrides it.
    fn create_open(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        let a = self.mknod(parent, name, mode, 0, ctx)?;
        self.open(a.ino)?;
        Ok(a)
    }
    fn release(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
    /// A regular file with no name in directory `parent` (open(2)'s O_TMPFILE): it is
    /// freed at its last `release` unless `link` names it first.
    fn tmpfile(&self, _parent: Ino, _mode: u32, _ctx: &Ctx) -> Result<Attr> {
        Err(FsError::NotSupported)
    }
    /// lseek(2)'s SEEK_DATA (`data`) or SEEK_HOLE: the first offset at or after
    /// `offset` inside data (a hole), as the kernel's block-mapped file systems answer:
    /// `NoData` (ENXIO) at or past the end, and the end counts as a hole. Modules that
    /// cannot tell answer `NotSupported`, and callers treat the file as all data.
    fn seek_data(&self, _ino: Ino, _offset: u64, _data: bool) -> Result<u64> {
        Err(FsError::NotSupported)
    }
    /// The inode's flags ([`flags`]: FS_IOC_GETFLAGS's bits, which are ext2's).
    fn get_flags(&self, _ino: Ino) -> Result<u32> {
        Err(FsError::NotSupported)
    }
    /// FS_IOC_SETFLAGS: the module checks who may set what ([`FsError::Perm`]) and which
    /// flags it knows ([`FsError::NotSupported`] for the rest).
    fn set_flags(&self, _ino: Ino, _flags: u32, _ctx: &Ctx) -> Result<()> {
        Err(FsError::NotSupported)
    }
    /// An open(2) of `ino` with these flags (O_ACCMODE, O_APPEND, O_TRUNC, ...) is about
    /// to succeed: the module refuses what the inode's flags forbid (writing an immutable
    /// file, or an append-only one other than by appending).
    fn check_open(&self, _ino: Ino, _open_flags: i32, _ctx: &Ctx) -> Result<()> {
        Ok(())
    }
    /// fallocate(2) with `mode` (FALLOC_FL_* bits): preallocation (0, KEEP_SIZE) or
    /// PUNCH_HOLE|KEEP_SIZE. `NotSupported` for modes the module cannot do, so callers
    /// fall back.
    fn fallocate(
        &self,
        _ino: Ino,
        _offset: u64,
        _length: u64,
        _mode: i32,
        _ctx: &Ctx,
    ) -> Result<()> {
        Err(FsError::NotSupported)
    }
    /// Range clone (FICLONE, FICLONERANGE): bytes `src_off..src_off + len` of `src`
    /// (`len` 0: to its end) now also make up `dst` from `dst_off`, sharing storage until
    /// either changes. The kernel's rules for remapping: offsets on block boundaries,
    /// the length too unless the range ends at `src`'s end, and that partial last block
    /// only where it ends `dst` as well; `dst` grows to hold the range. Returns the
    /// bytes cloned. `NotSupported` where the module cannot share (callers copy).
    fn clone_file(
        &self,
        _src: Ino,
        _src_off: u64,
        _dst: Ino,
        _dst_off: u64,
        _len: u64,
        _ctx: &Ctx,
    ) -> Result<u64> {
        Err(FsError::NotSupported)
    }
    /// copy_file_range(2): up to `len` bytes from `src` at `src_off` to `dst` at
    /// `dst_off` (fewer at `src`'s end); returns how many. A module that shares storage
    /// does so where it can. `NotSupported`: the kernel copies through reads and writes.
    fn copy_file_range(
        &self,
        _src: Ino,
        _src_off: u64,
        _dst: Ino,
        _dst_off: u64,
        _len: u64,
        _ctx: &Ctx,
    ) -> Result<u64> {
        Err(FsError::NotSupported)
    }
    /// A new name `new_name` in `new_parent` for a copy of the whole tree at `src` (a
    /// directory with everything below it, or a single file), made without copying data:
    /// the copy shares storage with the original until either changes. The copy's
    /// inodes are new (numbers, link counts, and times as in the original; the new
    /// entry's times are now).
    fn clone_tree(
        &self,
        _src: Ino,
        _new_parent: Ino,
        _new_name: &[u8],
        _ctx: &Ctx,
    ) -> Result<Attr> {
        Err(FsError::NotSupported)
    }
    fn counters(&self) -> Counters {
        Vec::new()
    }
    /// Sets aside `count` inode numbers, contiguous, that the module will not hand out
    /// by itself: creations that name one of them ([`FileSystem::mknod_as`] and the
    /// others, [`FsOp`]'s `ino`) take it. For a holder that creates files on its own and
    /// has them applied later under the numbers it already used (a client of the
    /// namespace service). A grant lasts while the module is mounted; numbers not used
    /// by then are never handed out. `NotSupported` where the module cannot.
    /// Applies `ops` as one atomic step (see [`batch`]): every operation's reply, or
    /// the one that failed and nothing changed. Not every module or mode can
    /// (`NotSupported`).
    fn apply_batch(
        &self,
        _ops: &[FsOp],
        _ctx: &Ctx,
    ) -> std::result::Result<Vec<FsReply>, BatchError> {
        Err(BatchError::at(0, FsError::NotSupported))
    }

    fn grant_inodes(&self, _count: u64) -> Result<InoGrant> {
        Err(FsError::NotSupported)
    }
    /// Sets aside again the numbers of `grant`, a grant of an earlier mount whose
    /// holder has not used them (grants live for a mount; the namespace service keeps
    /// its clients' across restarts and says which numbers are still unused). `Invalid`
    /// for numbers this file system never granted or hands out itself.
    fn hold_inodes(&self, _grant: InoGrant) -> Result<()> {
        Err(FsError::NotSupported)
    }
    /// [`FileSystem::mknod`] under inode number `ino`, from a grant of this mount
    /// (`Invalid` otherwise).
    fn mknod_as(
        &self,
        _ino: Ino,
        _parent: Ino,
        _name: &[u8],
        _mode: u32,
        _rdev: u32,
        _ctx: &Ctx,
    ) -> Result<Attr> {
        Err(FsError::NotSupported)
    }
    /// [`FileSystem::mkdir`] under inode number `ino`, from a grant of this mount.
    fn mkdir_as(
        &self,
        _ino: Ino,
        _parent: Ino,
        _name: &[u8],
        _mode: u32,
        _ctx: &Ctx,
    ) -> Result<Attr> {
        Err(FsError::NotSupported)
    }
    /// [`FileSystem::symlink`] under inode number `ino`, from a grant of this mount.
    fn symlink_as(
        &self,
        _ino: Ino,
        _parent: Ino,
        _name: &[u8],
        _target: &[u8],
        _ctx: &Ctx,
    ) -> Result<Attr> {
        Err(FsError::NotSupported)
    }

    /// The patchgroups this module offers (the patch layer's, the same for every
    /// module: `quilt_patch::Services` implements [`Patchgroups`]). A module with them
    /// gets the patchgroup calls below for free; one without write ordering answers
    /// `NotSupported`.
    fn patchgroups(&self) -> Option<&dyn Patchgroups> {
        None
    }
    /// Refuses changes on a read-only mount (or one that stopped after damage).
    fn check_writable(&self) -> Result<()> {
        Ok(())
    }

    // Patchgroups (Featherstitch): application-defined write ordering; see
    // [`Patchgroups`], to which these defaults pass each call.

    /// Creates a group: not released, not engaged, depending on nothing.
    fn pg_create(&self) -> Result<PgId> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        self.check_writable()?;
        s.pg_create()
    }
    /// Group `after`'s changes wait for group `before`'s (only before `after` is
    /// released, and never on a group that is engaged).
    fn pg_depend(&self, after: PgId, before: PgId) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_depend(after, before)
    }
    /// Ends the group's dependencies; it may now be engaged.
    fn pg_release(&self, pg: PgId) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_release(pg)
    }
    /// `caller`'s following changes join the group (released, and with no group yet
    /// depending on it).
    fn pg_engage(&self, pg: PgId, caller: u64) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_engage(pg, caller)
    }
    fn pg_disengage(&self, pg: PgId, caller: u64) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_disengage(pg, caller)
    }
    /// Waits until every change of the group, and so of every group before it, is
    /// durable.
    fn pg_sync(&self, pg: PgId) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_sync(pg)
    }
    /// Drops the handle: the group keeps its place in the order, is disengaged
    /// everywhere and can take no groups after it.
    fn pg_abandon(&self, pg: PgId) -> Result<()> {
        let s = self.patchgroups().ok_or(FsError::NotSupported)?;
        s.pg_abandon(pg)
    }
}

/// What the kernel's FUSE protocol adds to the POSIX operations: the references it holds
/// on inodes without open handles, the hints its request stream gives, and the
/// processes whose patchgroups follow a fork or end with an exit. Only the FUSE adapter
/// (and tools that play the kernel, as the crash explorer does) call these; the native
/// API, the namespace service and the conformance model speak [`FileSystem`] alone. Every
/// method has a default, so a module with nothing to do here writes an empty `impl`.
pub trait KernelFs: FileSystem {
    /// The kernel holds a reference to `ino` without an open handle (a lookup it has not
    /// forgotten): it may ask for the inode's attributes, but once the inode is unlinked
    /// it can no longer reach its data. Modules for which keeping an unlinked file's data
    /// costs something (betrfs) free it at the unlink when only references remain.
    /// Defaults to [`FileSystem::open`].
    fn reference(&self, ino: Ino) -> Result<()> {
        self.open(ino)
    }
    /// The kernel forgot a reference taken with [`KernelFs::reference`].
    fn unreference(&self, ino: Ino) -> Result<()> {
        self.release(ino)
    }
    /// The kernel forgot the last references to each of `inos` at once (a FORGET
    /// batch): [`KernelFs::unreference`] of each by default. A module may free the
    /// unlinked ones among them together. Each is let go even when another fails; the
    /// first error is returned.
    fn unreference_all(&self, inos: &[Ino]) -> Result<()> {
        // Not `try_fold`: every inode is let go; `and` keeps the first error.
        let mut first = Ok(());
        for &ino in inos {
            first = first.and(self.unreference(ino));
        }
        first
    }
    /// A hint that the attributes of `inos` will be asked for next (a listing with
    /// attributes: READDIRPLUS, which `rm -rf`, `find` and `ls -l` use): a module may
    /// start reading where they are kept, so that the getattrs that follow, one at a
    /// time, do not each wait for the device. Nothing by default.
    fn will_getattr(&self, _inos: &[Ino]) {}
    /// A hint that `dirs` may be listed soon (a listing with attributes named them, and
    /// a tree walk descends into them next): a module may start reading their entries.
    /// Nothing by default.
    fn will_readdir(&self, _dirs: &[Ino]) {}
    /// `child` (a new process) starts with `parent`'s engagements.
    fn pg_inherit(&self, parent: u64, child: u64) {
        if let Some(s) = self.patchgroups() {
            s.pg_inherit(parent, child)
        }
    }
    /// `caller` is gone: disengages it everywhere.
    fn pg_forget_caller(&self, caller: u64) {
        if let Some(s) = self.patchgroups() {
            s.pg_forget_caller(caller)
        }
    }
}

/// Patchgroups (Featherstitch): application-defined write ordering. A group's changes
/// reach the disk only after the changes of every group it depends on. `caller`
/// identifies a process (through FUSE, its thread-group id): the changes an operation
/// makes for a caller (`Ctx::pid`) join the groups that caller has engaged. The patch
/// layer implements it once (`quilt_patch::Services`); a module hands it out through
/// [`FileSystem::patchgroups`]. (Kept here, in the file-system interface, so that the
/// interface needs nothing of the engine.)
pub trait Patchgroups: Send + Sync {
    fn pg_create(&self) -> Result<PgId>;
    fn pg_depend(&self, after: PgId, before: PgId) -> Result<()>;
    fn pg_release(&self, pg: PgId) -> Result<()>;
    fn pg_engage(&self, pg: PgId, caller: u64) -> Result<()>;
    fn pg_disengage(&self, pg: PgId, caller: u64) -> Result<()>;
    fn pg_sync(&self, pg: PgId) -> Result<()>;
    fn pg_abandon(&self, pg: PgId) -> Result<()>;
    fn pg_inherit(&self, parent: u64, child: u64);
    fn pg_forget_caller(&self, caller: u64);
}

/// A patchgroup handle.
pub type PgId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct XattrFlags {
    /// XATTR_CREATE: fail if it exists.
    pub create: bool,
    /// XATTR_REPLACE: fail if it does not.
    pub replace: bool,
    /// Setting an access ACL: the caller is neither in the file's group nor privileged,
    /// so the set-group-ID bit goes (FUSE_SETXATTR_ACL_KILL_SGID).
    pub kill_sgid: bool,
}

impl fmt::Display for FileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod errno_tests {
    use super::FsError;

    #[test]
    fn from_errno_inverts_errno() {
        let all = [
            FsError::NotFound,
            FsError::Exists,
            FsError::NotDir,
            FsError::IsDir,
            FsError::NotEmpty,
            FsError::NameTooLong,
            FsError::NoSpace,
            FsError::Invalid("x"),
            FsError::Access,
            FsError::Perm,
            FsError::TooManyLinks,
            FsError::TooBig,
            FsError::NoAttr,
            FsError::Range,
            FsError::ReadOnly,
            FsError::NotSupported,
            FsError::CrossDevice,
            FsError::Busy,
            FsError::Stale,
            FsError::NoDevice,
            FsError::NoData,
            FsError::Corrupt("x".into()),
            FsError::Io("x".into()),
        ];
        for e in all {
            assert_eq!(FsError::from_errno(e.errno()).errno(), e.errno(), "{e:?}");
        }
        assert_eq!(FsError::from_errno(libc::ENOTTY).errno(), libc::EIO);
    }
}
