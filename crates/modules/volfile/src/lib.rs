//! A block device seen as a file system of one file: the root directory holds one
//! regular file, named as the caller says, whose bytes are the device's. Mounted through
//! the FUSE adapter (`quiltfs file-view`), it lets a loop device, and so the kernel's
//! own ext4 or any other file system, run on a replicated volume.
//!
//! The file's size is the device's and cannot change; nothing can be created, removed
//! or renamed (EPERM); writes past the end write what fits and then fail with ENOSPC,
//! as at the end of a block device. fsync and sync reach the device's flush, so what a
//! file system on the loop device makes durable is durable on the volume.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use quilt_block::{BlockError, ByteView};
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, Ino, IoError, KernelFs, RenameFlags,
    Result, SetAttr, StatFs, Timespec, XattrFlags,
};
use std::sync::{Arc, Mutex};

pub const ROOT: Ino = 1;
pub const FILE: Ino = 2;

pub struct VolumeFile {
    bytes: ByteView,
    name: Vec<u8>,
    read_only: bool,
    uid: u32,
    gid: u32,
    /// The file's times: set when it is written (or by utimes), kept in memory only.
    times: Mutex<(Timespec, Timespec)>,
    mounted: Timespec,
}

impl VolumeFile {
    /// The device `dev` as the one file `name`, owned by `uid`:`gid`.
    pub fn new(
        dev: Arc<dyn quilt_block::BlockDevice>,
        name: &str,
        read_only: bool,
        uid: u32,
        gid: u32,
    ) -> Result<VolumeFile> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(FsError::Invalid(
                "the file's name must be one path component",
            ));
        }
        let now = Timespec::now();
        Ok(VolumeFile {
            bytes: ByteView::new(dev),
            name: name.as_bytes().to_vec(),
            read_only,
            uid,
            gid,
            times: Mutex::new((now, now)),
            mounted: now,
        })
    }

    fn block_size(&self) -> u32 {
        self.bytes.device().block_size() as u32
    }

    fn attr(&self, ino: Ino) -> Result<Attr> {
        let (atime, mtime) = *self.times.lock().unwrap_or_else(|p| p.into_inner());
        let write = if self.read_only { 0 } else { 0o200 };
        let (kind, perm, nlink, size) = match ino {
            ROOT => (FileType::Directory, 0o555 | write, 2, 0),
            FILE => (FileType::Regular, 0o444 | write, 1, self.bytes.size()),
            _ => return Err(FsError::Stale),
        };
        Ok(Attr {
            ino,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            size,
            blocks: size.div_ceil(512),
            atime: if ino == FILE { atime } else { self.mounted },
            mtime: if ino == FILE { mtime } else { self.mounted },
            ctime: if ino == FILE { mtime } else { self.mounted },
            rdev: 0,
            blksize: self.block_size(),
        })
    }

    fn is_file(&self, ino: Ino) -> Result<()> {
        match ino {
            FILE => Ok(()),
            ROOT => Err(FsError::IsDir),
            _ => Err(FsError::Stale),
        }
    }

    fn dir(&self, ino: Ino) -> Result<()> {
        match ino {
            ROOT => Ok(()),
            FILE => Err(FsError::NotDir),
            _ => Err(FsError::Stale),
        }
    }

    fn touch(&self) {
        let now = Timespec::now();
        let mut t = self.times.lock().unwrap_or_else(|p| p.into_inner());
        t.1 = now;
    }
}

fn device_error(e: BlockError) -> FsError {
    match e {
        BlockError::NoSpace { .. } | BlockError::LogFull { .. } => FsError::NoSpace,
        e => FsError::Io(IoError::caused_by(e)),
    }
}

impl FileSystem for VolumeFile {
    fn root(&self) -> Ino {
        ROOT
    }
    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        self.dir(parent)?;
        match name {
            b"." | b".." => self.attr(ROOT),
            n if n == self.name.as_slice() => self.attr(FILE),
            _ => Err(FsError::NotFound),
        }
    }
    fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.attr(ino)
    }
    fn setattr(&self, ino: Ino, set: SetAttr, _ctx: &Ctx) -> Result<Attr> {
        let attr = self.attr(ino)?;
        if set.mode.is_some() || set.uid.is_some() || set.gid.is_some() {
            return Err(FsError::Perm);
        }
        if let Some(size) = set.size {
            self.is_file(ino)?;
            if size != attr.size {
                return Err(FsError::Perm); // a device's size is fixed
            }
        }
        if ino == FILE && (set.atime.is_some() || set.mtime.is_some()) {
            if self.read_only {
                return Err(FsError::ReadOnly);
            }
            let now = Timespec::now();
            let mut t = self.times.lock().unwrap_or_else(|p| p.into_inner());
            let pick = |x: quilt_vfs::TimeOrNow| match x {
                quilt_vfs::TimeOrNow::Now => now,
                quilt_vfs::TimeOrNow::At(ts) | quilt_vfs::TimeOrNow::NowAt(ts) => ts,
            };
            if let Some(a) = set.atime {
                t.0 = pick(a);
            }
            if let Some(m) = set.mtime {
                t.1 = pick(m);
            }
        }
        self.attr(ino)
    }
    fn mknod(&self, parent: Ino, _: &[u8], _: u32, _: u32, _: &Ctx) -> Result<Attr> {
        self.dir(parent)?;
        Err(FsError::Perm)
    }
    fn mkdir(&self, parent: Ino, _: &[u8], _: u32, _: &Ctx) -> Result<Attr> {
        self.dir(parent)?;
        Err(FsError::Perm)
    }
    fn unlink(&self, parent: Ino, name: &[u8], _: &Ctx) -> Result<()> {
        self.lookup(parent, name)?;
        Err(FsError::Perm)
    }
    fn rmdir(&self, parent: Ino, name: &[u8], _: &Ctx) -> Result<()> {
        self.lookup(parent, name)?;
        Err(FsError::Perm)
    }
    fn symlink(&self, parent: Ino, _: &[u8], _: &[u8], _: &Ctx) -> Result<Attr> {
        self.dir(parent)?;
        Err(FsError::Perm)
    }
    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        self.attr(ino)?;
        Err(FsError::Invalid("not a symbolic link"))
    }
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        _: Ino,
        _: &[u8],
        _: RenameFlags,
        _: &Ctx,
    ) -> Result<()> {
        self.lookup(parent, name)?;
        Err(FsError::Perm)
    }
    fn link(&self, ino: Ino, _: Ino, _: &[u8], _: &Ctx) -> Result<Attr> {
        self.attr(ino)?;
        Err(FsError::Perm)
    }
    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        self.is_file(ino)?;
        let end = self.bytes.size();
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (size as u64).min(end - offset) as usize];
        self.bytes.read_at(offset, &mut buf).map_err(device_error)?;
        Ok(buf)
    }
    fn write(&self, ino: Ino, offset: u64, data: &[u8], _: &Ctx) -> Result<u32> {
        self.is_file(ino)?;
        if self.read_only {
            return Err(FsError::ReadOnly);
        }
        let end = self.bytes.size();
        if offset >= end && !data.is_empty() {
            return Err(FsError::NoSpace);
        }
        let n = (data.len() as u64).min(end.saturating_sub(offset)) as usize;
        self.bytes
            .write_at(offset, &data[..n])
            .map_err(device_error)?;
        self.touch();
        Ok(n as u32)
    }
    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        self.dir(ino)?;
        let entries = [
            (ROOT, FileType::Directory, b".".to_vec()),
            (ROOT, FileType::Directory, b"..".to_vec()),
            (FILE, FileType::Regular, self.name.clone()),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            let e = DirEntry {
                ino,
                kind,
                name,
                next_offset: i as u64 + 1,
            };
            if !emit(e) {
                break;
            }
        }
        Ok(())
    }
    fn statfs(&self) -> Result<StatFs> {
        Ok(StatFs {
            block_size: self.block_size(),
            blocks: self.bytes.device().block_count(),
            blocks_free: 0,
            blocks_avail: 0,
            files: 2,
            files_free: 0,
            name_max: 255,
        })
    }
    fn fsync(&self, ino: Ino, _datasync: bool) -> Result<()> {
        self.attr(ino)?;
        self.bytes.flush().map_err(device_error)
    }
    fn sync_all(&self) -> Result<()> {
        self.bytes.flush().map_err(device_error)
    }
    fn setxattr(&self, ino: Ino, _: &[u8], _: &[u8], _: XattrFlags, _: &Ctx) -> Result<()> {
        self.attr(ino)?;
        Err(FsError::NotSupported)
    }
    fn getxattr(&self, ino: Ino, _: &[u8]) -> Result<Vec<u8>> {
        self.attr(ino)?;
        Err(FsError::NoAttr)
    }
    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        self.attr(ino)?;
        Ok(Vec::new())
    }
    fn removexattr(&self, ino: Ino, _: &[u8], _: &Ctx) -> Result<()> {
        self.attr(ino)?;
        Err(FsError::NoAttr)
    }
}

impl KernelFs for VolumeFile {}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_block::{BlockDevice, MemDevice};

    fn view() -> (Arc<MemDevice>, VolumeFile) {
        let dev = Arc::new(MemDevice::new(512, 16).unwrap());
        let v = VolumeFile::new(dev.clone(), "vol0", false, 0, 0).unwrap();
        (dev, v)
    }

    fn ctx() -> Ctx {
        Ctx {
            uid: 0,
            gid: 0,
            pid: 1,
            umask: 0o022,
        }
    }

    #[test]
    fn one_file_whose_bytes_are_the_device() {
        let (dev, v) = view();
        let a = v.lookup(ROOT, b"vol0").unwrap();
        assert_eq!((a.ino, a.kind, a.size), (FILE, FileType::Regular, 8192));
        assert_eq!(v.lookup(ROOT, b"other"), Err(FsError::NotFound));
        assert_eq!(v.write(FILE, 500, b"hello", &ctx()).unwrap(), 5);
        let mut b = vec![0u8; 512];
        dev.read(0, &mut b).unwrap();
        assert_eq!(&b[500..505], b"hello");
        assert_eq!(v.read(FILE, 498, 9).unwrap(), b"\0\0hello\0\0");
        // Reads stop at the end; writes past it write what fits, then fail.
        assert_eq!(v.read(FILE, 8190, 100).unwrap().len(), 2);
        assert!(v.read(FILE, 9000, 10).unwrap().is_empty());
        assert_eq!(v.write(FILE, 8190, b"abcd", &ctx()).unwrap(), 2);
        assert_eq!(v.write(FILE, 8192, b"x", &ctx()), Err(FsError::NoSpace));
        assert_eq!(v.read(FILE, 8190, 2).unwrap(), b"ab");
        let mut names = Vec::new();
        v.readdir(ROOT, 0, &mut |e| {
            names.push(e.name);
            true
        })
        .unwrap();
        assert_eq!(names, [b".".to_vec(), b"..".to_vec(), b"vol0".to_vec()]);
        v.fsync(FILE, false).unwrap();
    }

    #[test]
    fn the_namespace_and_the_size_are_fixed() {
        let (_, v) = view();
        let c = ctx();
        assert_eq!(v.mknod(ROOT, b"x", 0o100644, 0, &c), Err(FsError::Perm));
        assert_eq!(v.mkdir(ROOT, b"x", 0o755, &c), Err(FsError::Perm));
        assert_eq!(v.unlink(ROOT, b"vol0", &c), Err(FsError::Perm));
        assert_eq!(v.unlink(ROOT, b"nope", &c), Err(FsError::NotFound));
        assert_eq!(
            v.rename(ROOT, b"vol0", ROOT, b"y", RenameFlags::default(), &c),
            Err(FsError::Perm)
        );
        let grow = SetAttr {
            size: Some(1),
            ..SetAttr::default()
        };
        assert_eq!(v.setattr(FILE, grow, &c), Err(FsError::Perm));
        let same = SetAttr {
            size: Some(8192),
            ..SetAttr::default()
        };
        assert_eq!(v.setattr(FILE, same, &c).unwrap().size, 8192);
        assert_eq!(v.read(ROOT, 0, 1), Err(FsError::IsDir));
        assert_eq!(v.getattr(7), Err(FsError::Stale));
        assert!(VolumeFile::new(
            Arc::new(MemDevice::new(512, 1).unwrap()),
            "a/b",
            false,
            0,
            0
        )
        .is_err());
    }

    #[test]
    fn a_read_only_view_refuses_writes() {
        let dev = Arc::new(MemDevice::new(512, 4).unwrap());
        let v = VolumeFile::new(dev, "v", true, 0, 0).unwrap();
        assert_eq!(v.write(FILE, 0, b"x", &ctx()), Err(FsError::ReadOnly));
        assert_eq!(v.getattr(FILE).unwrap().perm, 0o444);
    }
}
