//! Modelled disks as files, for the kernel's file systems: a tiny FUSE file system whose
//! root holds one regular file per device, each read, write and fsync going through a
//! `DiskModel` over an image file. A loop device over such a file (`losetup
//! --direct-io=on --sector-size 4096`) is a block device with a 7200 RPM disk's timing,
//! so kernel ext4 can put its external journal on the same model as quiltfs's.

use quilt_block::{BlockDevice, WriteClass};
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FileType, FsError, Ino, RenameFlags, Result, SetAttr, StatFs,
    Timespec, XattrFlags,
};
use std::sync::Arc;

pub struct DiskExport {
    disks: Vec<(String, Arc<dyn BlockDevice>)>,
    born: Timespec,
}

const ROOT: Ino = 1;

fn io(e: quilt_block::BlockError) -> FsError {
    tracing::warn!("disk export: {e}");
    FsError::Io(quilt_vfs::IoError::caused_by(e))
}

impl DiskExport {
    pub fn new(disks: Vec<(String, Arc<dyn BlockDevice>)>) -> DiskExport {
        DiskExport {
            disks,
            born: Timespec::now(),
        }
    }

    fn disk(&self, ino: Ino) -> Result<&Arc<dyn BlockDevice>> {
        ino.checked_sub(2)
            .and_then(|i| self.disks.get(i as usize))
            .map(|(_, d)| d)
            .ok_or(FsError::NotFound)
    }

    fn attr(&self, ino: Ino) -> Result<Attr> {
        let (kind, perm, size) = if ino == ROOT {
            (FileType::Directory, 0o755, 0)
        } else {
            let d = self.disk(ino)?;
            (
                FileType::Regular,
                0o600,
                d.block_count() * d.block_size() as u64,
            )
        };
        Ok(Attr {
            ino,
            kind,
            perm,
            nlink: if ino == ROOT { 2 } else { 1 },
            uid: 0,
            gid: 0,
            size,
            blocks: size / 512,
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            rdev: 0,
            blksize: 4096,
        })
    }
}

/// Nothing for the kernel's hooks: a single file with no inodes to let go of.
impl quilt_vfs::KernelFs for DiskExport {}

impl FileSystem for DiskExport {
    fn root(&self) -> Ino {
        ROOT
    }
    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        if parent != ROOT {
            return Err(FsError::NotDir);
        }
        let i = self
            .disks
            .iter()
            .position(|(n, _)| n.as_bytes() == name)
            .ok_or(FsError::NotFound)?;
        self.attr(i as Ino + 2)
    }
    fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.attr(ino)
    }
    fn setattr(&self, ino: Ino, set: SetAttr, _ctx: &Ctx) -> Result<Attr> {
        // Disks have the size they have; the times and owners are fixed.
        let a = self.attr(ino)?;
        if set.size.is_some_and(|s| s != a.size) {
            return Err(FsError::Perm);
        }
        Ok(a)
    }
    fn mknod(&self, _: Ino, _: &[u8], _: u32, _: u32, _: &Ctx) -> Result<Attr> {
        Err(FsError::Perm)
    }
    fn mkdir(&self, _: Ino, _: &[u8], _: u32, _: &Ctx) -> Result<Attr> {
        Err(FsError::Perm)
    }
    fn unlink(&self, _: Ino, _: &[u8], _: &Ctx) -> Result<()> {
        Err(FsError::Perm)
    }
    fn rmdir(&self, _: Ino, _: &[u8], _: &Ctx) -> Result<()> {
        Err(FsError::Perm)
    }
    fn symlink(&self, _: Ino, _: &[u8], _: &[u8], _: &Ctx) -> Result<Attr> {
        Err(FsError::Perm)
    }
    fn readlink(&self, _: Ino) -> Result<Vec<u8>> {
        Err(FsError::Invalid("not a symbolic link"))
    }
    fn rename(&self, _: Ino, _: &[u8], _: Ino, _: &[u8], _: RenameFlags, _: &Ctx) -> Result<()> {
        Err(FsError::Perm)
    }
    fn link(&self, _: Ino, _: Ino, _: &[u8], _: &Ctx) -> Result<Attr> {
        Err(FsError::Perm)
    }
    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        let d = self.disk(ino)?;
        let bs = d.block_size() as u64;
        let end = (offset + size as u64).min(d.block_count() * bs);
        if offset >= end {
            return Ok(Vec::new());
        }
        let first = offset / bs;
        let last = (end - 1) / bs;
        let mut buf = vec![0u8; ((last - first + 1) * bs) as usize];
        for (i, b) in buf.chunks_mut(bs as usize).enumerate() {
            d.read(first + i as u64, b).map_err(io)?;
        }
        let from = (offset - first * bs) as usize;
        Ok(buf[from..from + (end - offset) as usize].to_vec())
    }
    fn write(&self, ino: Ino, offset: u64, data: &[u8], _ctx: &Ctx) -> Result<u32> {
        let d = self.disk(ino)?;
        let bs = d.block_size() as u64;
        let end = offset + data.len() as u64;
        if end > d.block_count() * bs {
            return Err(FsError::NoSpace);
        }
        if data.is_empty() {
            return Ok(0);
        }
        let first = offset / bs;
        let last = (end - 1) / bs;
        let mut buf = vec![0u8; ((last - first + 1) * bs) as usize];
        let from = (offset - first * bs) as usize;
        // Partial blocks at either end: read them first (loop devices of 4 KiB sectors
        // never send any).
        if from != 0 {
            d.read(first, &mut buf[..bs as usize]).map_err(io)?;
        }
        if end % bs != 0 && (last != first || from == 0) {
            let at = buf.len() - bs as usize;
            d.read(last, &mut buf[at..]).map_err(io)?;
        }
        buf[from..from + data.len()].copy_from_slice(data);
        // One request, as a disk would see it.
        d.write_blocks(first, &buf, WriteClass::Metadata)
            .map_err(io)?;
        Ok(data.len() as u32)
    }
    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        if ino != ROOT {
            return Err(FsError::NotDir);
        }
        for (i, (name, _)) in self.disks.iter().enumerate().skip(offset as usize) {
            let go_on = emit(DirEntry {
                ino: i as Ino + 2,
                kind: FileType::Regular,
                name: name.as_bytes().to_vec(),
                next_offset: i as u64 + 1,
            });
            if !go_on {
                break;
            }
        }
        Ok(())
    }
    fn statfs(&self) -> Result<StatFs> {
        let blocks = self.disks.iter().map(|(_, d)| d.block_count()).sum();
        Ok(StatFs {
            block_size: 4096,
            blocks,
            blocks_free: 0,
            blocks_avail: 0,
            files: self.disks.len() as u64,
            files_free: 0,
            name_max: 255,
        })
    }
    fn fsync(&self, ino: Ino, _datasync: bool) -> Result<()> {
        if ino == ROOT {
            return Ok(());
        }
        self.disk(ino)?.flush().map_err(io)
    }
    fn sync_all(&self) -> Result<()> {
        for (_, d) in &self.disks {
            d.flush().map_err(io)?;
        }
        Ok(())
    }
    fn setxattr(&self, _: Ino, _: &[u8], _: &[u8], _: XattrFlags, _: &Ctx) -> Result<()> {
        Err(FsError::NotSupported)
    }
    fn getxattr(&self, _: Ino, _: &[u8]) -> Result<Vec<u8>> {
        Err(FsError::NoAttr)
    }
    fn listxattr(&self, _: Ino) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn removexattr(&self, _: Ino, _: &[u8], _: &Ctx) -> Result<()> {
        Err(FsError::NoAttr)
    }
}
