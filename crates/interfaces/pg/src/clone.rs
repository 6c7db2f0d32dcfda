//! Clones on a quiltfs mount whose module shares storage (betrfs): a range of one file
//! into another, and a whole tree under a new name, without copying data.
//!
//! The kernel's FICLONE and FICLONERANGE never reach a FUSE server (FUSE has no request
//! for remap_file_range), so these calls carry the same request as an ioctl of our own
//! ([`abi::CLONE_RANGE`], [`abi::CLONE_TREE`]). `cp --reflink=always` works on a mount
//! through `libquilt_preload.so`, which turns FICLONE into this; plain `cp` (which tries
//! copy_file_range) clones on its own.
//!
//! ```no_run
//! use std::fs::File;
//! let src = File::open("/mnt/quilt/big.img")?;
//! let dst = File::create("/mnt/quilt/copy.img")?;
//! quilt_pg::clone::clone_file(&dst, 0, &src, 0, 0)?; // all of it
//! quilt_pg::clone::clone_tree("/mnt/quilt/project", "/mnt/quilt/project-snapshot")?;
//! # Ok::<(), std::io::Error>(())
//! ```

use crate::abi;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn stat(fd: i32) -> io::Result<libc::stat> {
    // SAFETY: fstat fills the struct for an open descriptor, or fails.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    }
}

/// Bytes `src_off..src_off + len` of `src` (`len` 0: to its end) into `dst` at
/// `dst_off`, sharing storage: FICLONERANGE's rules (offsets on 4 KiB boundaries, the
/// length too unless the range ends at `src`'s end; equal offsets, since the file
/// system shares blocks at their own positions). Both files on the same mount; `dst`
/// open for writing. Returns the bytes cloned.
pub fn clone_file(dst: &File, dst_off: u64, src: &File, src_off: u64, len: u64) -> io::Result<u64> {
    clone_fd(dst.as_raw_fd(), dst_off, src.as_raw_fd(), src_off, len)
}

/// [`clone_file`] on descriptors.
pub fn clone_fd(dst: i32, dst_off: u64, src: i32, src_off: u64, len: u64) -> io::Result<u64> {
    let (s, d) = (stat(src)?, stat(dst)?);
    if s.st_dev != d.st_dev {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    let args = abi::CloneRangeArgs {
        src_ino: s.st_ino,
        src_off,
        len,
        dst_off,
    };
    let mut buf = args.to_bytes();
    // SAFETY: the ioctl reads and writes `buf`, whose size its number encodes.
    if unsafe { libc::ioctl(dst, abi::CLONE_RANGE as _, buf.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    abi::CloneRangeArgs::from_bytes(&buf)
        .map(|a| a.len)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))
}

/// A new entry `dst` holding a copy of the tree at `src` (a directory and everything
/// below it, or one file), sharing storage with it. `dst` must not exist; its directory
/// must be on the same mount. Returns the new entry's inode number.
pub fn clone_tree(src: impl AsRef<Path>, dst: impl AsRef<Path>) -> io::Result<u64> {
    let (src, dst) = (src.as_ref(), dst.as_ref());
    let name = dst.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "the destination has no name")
    })?;
    let parent = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let s = std::fs::symlink_metadata(src)?;
    let dir = File::open(parent)?;
    use std::os::unix::fs::MetadataExt;
    if stat(dir.as_raw_fd())?.st_dev != s.dev() {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    let args = abi::CloneTreeArgs::new(s.ino(), name.as_bytes())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENAMETOOLONG))?;
    let mut buf = args.to_bytes();
    // SAFETY: the ioctl reads and writes `buf`, whose size its number encodes.
    if unsafe { libc::ioctl(dir.as_raw_fd(), abi::CLONE_TREE as _, buf.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    abi::CloneTreeArgs::from_bytes(&buf)
        .map(|a| a.src_ino)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))
}
