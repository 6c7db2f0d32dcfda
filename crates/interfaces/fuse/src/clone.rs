//! Clones over FUSE. FICLONE and FICLONERANGE stop in the kernel (FUSE has no request
//! for remap_file_range), so programs ask through `quilt_pg::clone`'s ioctls: a range
//! clone on the destination file, a tree clone on the destination's directory. The
//! kernel copies the argument structure in and out by the sizes the ioctl numbers
//! encode. copy_file_range(2) arrives as its own request (see the adapter).

use quilt_pg_abi::{self as abi, CloneRangeArgs, CloneTreeArgs};
use quilt_vfs::{Attr, Ctx, FileSystem, FsError, Ino};

/// Is `cmd` one of the clone ioctls?
pub(crate) fn is_clone(cmd: u32) -> bool {
    cmd == abi::CLONE_RANGE || cmd == abi::CLONE_TREE
}

/// What a served clone changed, for the kernel's caches to forget.
pub(crate) enum Changed {
    /// The destination file's data and attributes.
    File(Ino),
    /// A new entry in a directory (and the directory's attributes).
    Entry(Ino, Vec<u8>),
}

/// Serves one clone ioctl asked of `ino`. `to_fs` maps the kernel's inode numbers (the
/// caller's st_ino) to the file system's. Returns the reply's bytes and what changed.
pub(crate) fn ioctl(
    fs: &dyn FileSystem,
    ino: Ino,
    cmd: u32,
    input: &[u8],
    ctx: &Ctx,
    to_fs: impl Fn(u64) -> u64,
    to_fuse: impl Fn(u64) -> u64,
) -> Result<(Vec<u8>, Changed), FsError> {
    match cmd {
        abi::CLONE_RANGE => {
            let mut a = CloneRangeArgs::from_bytes(input)
                .ok_or(FsError::Invalid("a clone-range argument of the wrong size"))?;
            a.len = fs.clone_file(to_fs(a.src_ino), a.src_off, ino, a.dst_off, a.len, ctx)?;
            Ok((a.to_bytes().to_vec(), Changed::File(ino)))
        }
        abi::CLONE_TREE => {
            let mut a = CloneTreeArgs::from_bytes(input)
                .ok_or(FsError::Invalid("a clone-tree argument of the wrong size"))?;
            let name = a.name().to_vec();
            let made: Attr = fs.clone_tree(to_fs(a.src_ino), ino, &name, ctx)?;
            a.src_ino = to_fuse(made.ino);
            Ok((a.to_bytes().to_vec(), Changed::Entry(ino, name)))
        }
        _ => Err(FsError::NotSupported),
    }
}
