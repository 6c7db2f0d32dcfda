//! The `FileSystem` trait implemented by system calls on a mounted directory, so that a
//! test written against the native API can be run again through the kernel and the FUSE
//! adapter. Inode numbers are the ones `lstat` shows; each is mapped to the path it was
//! last seen at (by lookup, readdir or creation), and every use checks that the path
//! still names that inode, so a stale mapping is reported instead of misleading.
//!
//! Operations carrying a `Ctx` run with that fsuid, fsgid and umask on the calling thread
//! (the thread unshares its umask first). Mount without `default_permissions` to let the
//! file system see such requests unchecked, as the native API does.

use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, Ino, RenameFlags, Result, SetAttr, StatFs,
    TimeOrNow, Timespec, XattrFlags,
};
use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct MountFs {
    root: PathBuf,
    root_ino: Ino,
    paths: Mutex<HashMap<Ino, PathBuf>>,
}

fn last_err() -> FsError {
    FsError::from_errno(
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO),
    )
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in test paths")
}

fn check(r: libc::c_int) -> Result<()> {
    if r < 0 {
        Err(last_err())
    } else {
        Ok(())
    }
}

/// Our `rdev` is Linux's new device encoding (what ext2 stores and FUSE carries).
fn encode_dev(d: libc::dev_t) -> u32 {
    let (ma, mi) = (libc::major(d), libc::minor(d));
    (mi & 0xff) | (ma << 8) | ((mi & !0xff) << 12)
}
fn decode_dev(r: u32) -> libc::dev_t {
    libc::makedev((r >> 8) & 0xfff, (r & 0xff) | ((r >> 12) & 0xfff00))
}

fn ts(sec: i64, nsec: i64) -> Timespec {
    Timespec {
        sec,
        nsec: nsec as u32,
    }
}

/// Runs `f` as `ctx` says (fsuid, fsgid, umask), then restores root.
pub fn as_ctx<T>(ctx: &Ctx, f: impl FnOnce() -> T) -> T {
    // SAFETY: per-thread credential and umask changes around one system call.
    unsafe {
        libc::setfsgid(ctx.gid);
        libc::setfsuid(ctx.uid);
        let old = libc::umask(ctx.umask as libc::mode_t);
        let r = f();
        libc::umask(old);
        libc::setfsuid(0);
        libc::setfsgid(0);
        r
    }
}

impl MountFs {
    /// Wraps the mount at `root`. Call from the thread that will use it: that thread's
    /// umask is made its own.
    pub fn new(root: &Path) -> std::io::Result<MountFs> {
        // SAFETY: unshare of this thread's fs attributes (umask, cwd); no memory involved.
        if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let md = std::fs::symlink_metadata(root)?;
        use std::os::unix::fs::MetadataExt;
        let root_ino = md.ino();
        let mut paths = HashMap::new();
        paths.insert(root_ino, root.to_path_buf());
        Ok(MountFs {
            root: root.to_path_buf(),
            root_ino,
            paths: Mutex::new(paths),
        })
    }

    fn lstat(p: &Path) -> Result<libc::stat> {
        let c = cpath(p);
        // SAFETY: lstat into a zeroed stat buffer.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            check(libc::lstat(c.as_ptr(), &mut st))?;
            Ok(st)
        }
    }

    fn attr(st: &libc::stat) -> Result<Attr> {
        let kind = FileType::from_mode(st.st_mode)
            .ok_or_else(|| FsError::Io(format!("unknown file type {:o}", st.st_mode).into()))?;
        Ok(Attr {
            ino: st.st_ino,
            kind,
            perm: (st.st_mode & 0o7777) as u16,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            atime: ts(st.st_atime, st.st_atime_nsec),
            mtime: ts(st.st_mtime, st.st_mtime_nsec),
            ctime: ts(st.st_ctime, st.st_ctime_nsec),
            rdev: encode_dev(st.st_rdev),
            blksize: st.st_blksize as u32,
        })
    }

    /// The path of `ino`, checked to still name it.
    fn path(&self, ino: Ino) -> Result<PathBuf> {
        self.path_stat(ino).map(|(p, _)| p)
    }

    fn path_stat(&self, ino: Ino) -> Result<(PathBuf, libc::stat)> {
        let p = self
            .paths
            .lock()
            .expect("lock")
            .get(&ino)
            .cloned()
            .ok_or_else(|| FsError::Io(format!("harness: inode {ino} was never seen").into()))?;
        match Self::lstat(&p) {
            Ok(st) if st.st_ino == ino => Ok((p, st)),
            _ => Err(FsError::Io(
                format!("harness: {} no longer names inode {ino}", p.display()).into(),
            )),
        }
    }

    /// `name` in directory `parent`. The native API's callers resolve paths without
    /// following symlinks, so a parent that is not a directory (a symlink included) is
    /// ENOTDIR here too, where the kernel would follow the link.
    fn child(&self, parent: Ino, name: &[u8]) -> Result<PathBuf> {
        let (p, st) = self.path_stat(parent)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(FsError::NotDir);
        }
        Ok(p.join(OsStr::from_bytes(name)))
    }

    /// Stats `p` and remembers it as the path of its inode.
    fn seen(&self, p: PathBuf) -> Result<Attr> {
        let a = Self::attr(&Self::lstat(&p)?)?;
        self.paths.lock().expect("lock").insert(a.ino, p);
        Ok(a)
    }

    fn open(&self, ino: Ino, flags: libc::c_int) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let c = cpath(&self.path(ino)?);
        // SAFETY: open of a NUL-terminated path; the fd is owned by the result.
        let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(last_err());
        }
        // SAFETY: fd was just opened and is ours.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}

impl FileSystem for MountFs {
    fn root(&self) -> Ino {
        self.root_ino
    }

    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        let p = self.child(parent, name)?;
        self.seen(p)
    }

    fn getattr(&self, ino: Ino) -> Result<Attr> {
        Self::attr(&Self::lstat(&self.path(ino)?)?)
    }

    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr> {
        let p = self.path(ino)?;
        let c = cpath(&p);
        as_ctx(ctx, || -> Result<()> {
            // SAFETY: plain system calls on a NUL-terminated path.
            unsafe {
                if let Some(size) = set.size {
                    check(libc::truncate(c.as_ptr(), size as libc::off_t))?;
                }
                if set.uid.is_some() || set.gid.is_some() {
                    let u = set.uid.unwrap_or(u32::MAX);
                    let g = set.gid.unwrap_or(u32::MAX);
                    check(libc::lchown(c.as_ptr(), u, g))?;
                }
                if let Some(m) = set.mode {
                    check(libc::chmod(c.as_ptr(), m as libc::mode_t))?;
                }
                if set.atime.is_some() || set.mtime.is_some() {
                    let t = |t: Option<TimeOrNow>| match t {
                        None => libc::timespec {
                            tv_sec: 0,
                            tv_nsec: libc::UTIME_OMIT,
                        },
                        Some(TimeOrNow::Now) => libc::timespec {
                            tv_sec: 0,
                            tv_nsec: libc::UTIME_NOW,
                        },
                        Some(TimeOrNow::At(x) | TimeOrNow::NowAt(x)) => libc::timespec {
                            tv_sec: x.sec,
                            tv_nsec: x.nsec as i64,
                        },
                    };
                    let times = [t(set.atime), t(set.mtime)];
                    check(libc::utimensat(
                        libc::AT_FDCWD,
                        c.as_ptr(),
                        times.as_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    ))?;
                }
            }
            Ok(())
        })?;
        self.getattr(ino)
    }

    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr> {
        let p = self.child(parent, name)?;
        let c = cpath(&p);
        as_ctx(ctx, || {
            // SAFETY: creation calls on a NUL-terminated path; the fd is closed at once.
            unsafe {
                if mode & libc::S_IFMT == libc::S_IFREG {
                    // Regular files the way programs make them (FUSE CREATE, not MKNOD).
                    let fd = libc::open(
                        c.as_ptr(),
                        libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                        (mode & 0o7777) as libc::c_uint,
                    );
                    if fd < 0 {
                        return Err(last_err());
                    }
                    libc::close(fd);
                    Ok(())
                } else {
                    check(libc::mknod(
                        c.as_ptr(),
                        mode as libc::mode_t,
                        decode_dev(rdev),
                    ))
                }
            }
        })?;
        self.seen(p)
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        let p = self.child(parent, name)?;
        let c = cpath(&p);
        // SAFETY: mkdir of a NUL-terminated path.
        as_ctx(ctx, || {
            check(unsafe { libc::mkdir(c.as_ptr(), mode as libc::mode_t) })
        })?;
        self.seen(p)
    }

    fn unlink(&self, parent: Ino, name: &[u8], _ctx: &Ctx) -> Result<()> {
        let c = cpath(&self.child(parent, name)?);
        // SAFETY: unlink of a NUL-terminated path.
        check(unsafe { libc::unlink(c.as_ptr()) })
    }

    fn rmdir(&self, parent: Ino, name: &[u8], _ctx: &Ctx) -> Result<()> {
        let c = cpath(&self.child(parent, name)?);
        // SAFETY: rmdir of a NUL-terminated path.
        check(unsafe { libc::rmdir(c.as_ptr()) })
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        let p = self.child(parent, name)?;
        let c = cpath(&p);
        let t = CString::new(target).map_err(|_| FsError::Invalid("NUL in target"))?;
        // SAFETY: symlink between NUL-terminated strings.
        as_ctx(ctx, || {
            check(unsafe { libc::symlink(t.as_ptr(), c.as_ptr()) })
        })?;
        self.seen(p)
    }

    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        std::fs::read_link(self.path(ino)?)
            .map(|t| t.as_os_str().as_bytes().to_vec())
            .map_err(|e| FsError::from_errno(e.raw_os_error().unwrap_or(libc::EIO)))
    }

    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        flags: RenameFlags,
        _ctx: &Ctx,
    ) -> Result<()> {
        let from = cpath(&self.child(parent, name)?);
        let to = cpath(&self.child(newparent, newname)?);
        let mut f = 0;
        if flags.noreplace {
            f |= libc::RENAME_NOREPLACE;
        }
        if flags.exchange {
            f |= libc::RENAME_EXCHANGE;
        }
        // SAFETY: renameat2 between NUL-terminated paths.
        check(unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                f,
            )
        })
    }

    fn link(&self, ino: Ino, newparent: Ino, newname: &[u8], _ctx: &Ctx) -> Result<Attr> {
        let from = cpath(&self.path(ino)?);
        let p = self.child(newparent, newname)?;
        let to = cpath(&p);
        // SAFETY: link between NUL-terminated paths (linkat without following).
        check(unsafe { libc::link(from.as_ptr(), to.as_ptr()) })?;
        self.seen(p)
    }

    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        use std::os::fd::AsRawFd;
        let fd = self.open(ino, libc::O_RDONLY)?;
        let mut buf = vec![0u8; size as usize];
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: pread into the unfilled tail of our buffer.
            let n = unsafe {
                libc::pread(
                    fd.as_raw_fd(),
                    buf[got..].as_mut_ptr().cast(),
                    buf.len() - got,
                    (offset + got as u64) as libc::off_t,
                )
            };
            if n < 0 {
                return Err(last_err());
            }
            if n == 0 {
                break;
            }
            got += n as usize;
        }
        buf.truncate(got);
        Ok(buf)
    }

    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32> {
        use std::os::fd::AsRawFd;
        let fd = as_ctx(ctx, || self.open(ino, libc::O_WRONLY))?;
        // SAFETY: pwrite from our buffer.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                offset as libc::off_t,
            )
        };
        if n < 0 {
            return Err(last_err());
        }
        Ok(n as u32)
    }

    fn readdir(&self, ino: Ino, cookie: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        let p = self.path(ino)?;
        let c = cpath(&p);
        // SAFETY: a DIR stream we open, read and close here; entries are copied out
        // before the next readdir call.
        unsafe {
            let d = libc::opendir(c.as_ptr());
            if d.is_null() {
                return Err(last_err());
            }
            if cookie != 0 {
                libc::seekdir(d, cookie as libc::c_long);
            }
            loop {
                *libc::__errno_location() = 0;
                let e = libc::readdir64(d);
                if e.is_null() {
                    let err = *libc::__errno_location();
                    libc::closedir(d);
                    return if err == 0 {
                        Ok(())
                    } else {
                        Err(FsError::from_errno(err))
                    };
                }
                let e = &*e;
                let name = std::ffi::CStr::from_ptr(e.d_name.as_ptr())
                    .to_bytes()
                    .to_vec();
                let kind = match e.d_type {
                    libc::DT_DIR => FileType::Directory,
                    libc::DT_LNK => FileType::Symlink,
                    libc::DT_CHR => FileType::CharDevice,
                    libc::DT_BLK => FileType::BlockDevice,
                    libc::DT_FIFO => FileType::Fifo,
                    libc::DT_SOCK => FileType::Socket,
                    _ => FileType::Regular,
                };
                if name != b"." && name != b".." {
                    let child = p.join(OsStr::from_bytes(&name));
                    self.paths.lock().expect("lock").insert(e.d_ino, child);
                }
                let more = emit(DirEntry {
                    ino: e.d_ino,
                    kind,
                    name,
                    next_offset: e.d_off as u64,
                });
                if !more {
                    libc::closedir(d);
                    return Ok(());
                }
            }
        }
    }

    fn statfs(&self) -> Result<StatFs> {
        let c = cpath(&self.root);
        // SAFETY: statvfs into a zeroed buffer.
        unsafe {
            let mut s: libc::statvfs = std::mem::zeroed();
            check(libc::statvfs(c.as_ptr(), &mut s))?;
            Ok(StatFs {
                block_size: s.f_bsize as u32,
                blocks: s.f_blocks,
                blocks_free: s.f_bfree,
                blocks_avail: s.f_bavail,
                files: s.f_files,
                files_free: s.f_ffree,
                name_max: s.f_namemax as u32,
            })
        }
    }

    fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> {
        use std::os::fd::AsRawFd;
        let kind = self.getattr(ino)?.kind;
        if !matches!(kind, FileType::Regular | FileType::Directory) {
            // No fsync(2) reaches a file system for these (a fifo's is the pipe's).
            return Ok(());
        }
        let fd = self.open(ino, libc::O_RDONLY)?;
        // SAFETY: fsync of our fd.
        check(unsafe {
            if datasync {
                libc::fdatasync(fd.as_raw_fd())
            } else {
                libc::fsync(fd.as_raw_fd())
            }
        })
    }

    fn sync_all(&self) -> Result<()> {
        use std::os::fd::AsRawFd;
        let fd = self.open(self.root_ino, libc::O_RDONLY | libc::O_DIRECTORY)?;
        // SAFETY: syncfs of our fd.
        check(unsafe { libc::syncfs(fd.as_raw_fd()) })
    }

    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        _ctx: &Ctx,
    ) -> Result<()> {
        let c = cpath(&self.path(ino)?);
        let n = CString::new(name).map_err(|_| FsError::Invalid("NUL in name"))?;
        let mut f = 0;
        if flags.create {
            f |= libc::XATTR_CREATE;
        }
        if flags.replace {
            f |= libc::XATTR_REPLACE;
        }
        // SAFETY: lsetxattr with our buffers.
        check(unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                f,
            )
        })
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        let c = cpath(&self.path(ino)?);
        let n = CString::new(name).map_err(|_| FsError::Invalid("NUL in name"))?;
        let mut buf = vec![0u8; 65536];
        // SAFETY: lgetxattr into our buffer.
        let r =
            unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(last_err());
        }
        buf.truncate(r as usize);
        Ok(buf)
    }

    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        let c = cpath(&self.path(ino)?);
        let mut buf = vec![0u8; 65536];
        // SAFETY: llistxattr into our buffer.
        let r = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r < 0 {
            return Err(last_err());
        }
        buf.truncate(r as usize);
        Ok(buf)
    }

    fn removexattr(&self, ino: Ino, name: &[u8], _ctx: &Ctx) -> Result<()> {
        let c = cpath(&self.path(ino)?);
        let n = CString::new(name).map_err(|_| FsError::Invalid("NUL in name"))?;
        // SAFETY: lremovexattr with our strings.
        check(unsafe { libc::lremovexattr(c.as_ptr(), n.as_ptr()) })
    }
}
