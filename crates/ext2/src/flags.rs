//! Inode flags (`i_flags`): FS_IOC_GETFLAGS/SETFLAGS, inheritance from the parent
//! directory, and the refusals immutable and append-only files impose. The rules are
//! the kernel's for ext2 images (its ext4 driver serves them on current kernels): which
//! flags are visible, which a caller may change, which a new inode takes from its
//! directory, and which operations answer EPERM.

use crate::format::Inode;
use crate::fs::{Ext2, Op, State};
use quilt_vfs::flags::*;
use quilt_vfs::{Ctx, FsError, Result};

/// Flags FS_IOC_GETFLAGS shows (the kernel's EXT4_FL_USER_VISIBLE).
pub(crate) const VISIBLE: u32 = 0x705B_DFFF;
/// Flags FS_IOC_SETFLAGS may change; other visible ones are silently kept (chattr sends
/// back what it read).
const MODIFIABLE: u32 = 0x604B_C0FF;
/// Flags a new inode takes from its directory.
const INHERITED: u32 =
    SECRM | UNRM | COMPR | SYNC | NODUMP | NOATIME | JOURNAL_DATA | NOTAIL | DIRSYNC | NOCOMPR;
/// Flags that mean something only on directories.
const DIR_ONLY: u32 = DIRSYNC | TOPDIR | CASEFOLD | PROJINHERIT;
/// Flags that need a feature ext2 images do not have: extents (the kernel answers
/// EINVAL, it cannot convert the file) and case folding (EOPNOTSUPP).
const NEEDS_FEATURE: u32 = EXTENTS | CASEFOLD;

/// What a file of `mode` may carry of `flags` (the kernel's ext4_mask_flags).
fn mask_for(mode: u32, flags: u32) -> u32 {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => flags,
        libc::S_IFREG => flags & !DIR_ONLY,
        _ => flags & (NODUMP | NOATIME),
    }
}

/// The flags a new inode of `mode` made in a directory with `dir_flags` starts with.
pub(crate) fn inherited(dir_flags: u32, mode: u32) -> u32 {
    mask_for(mode, dir_flags & INHERITED)
}

/// EPERM for any change to an immutable or append-only inode's attributes, names or
/// links (the kernel's IS_IMMUTABLE || IS_APPEND checks).
pub(crate) fn refuse_if_frozen(inode: &Inode) -> Result<()> {
    if inode.flags & (IMMUTABLE | APPEND) != 0 {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// EPERM for adding an entry to an immutable directory (append-only ones take new
/// entries).
pub(crate) fn refuse_new_entry(dir: &Inode) -> Result<()> {
    if dir.flags & IMMUTABLE != 0 {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// EPERM for removing (or replacing) entry `child` of `dir`: neither may be immutable or
/// append-only.
pub(crate) fn refuse_removal(dir: &Inode, child: &Inode) -> Result<()> {
    refuse_if_frozen(dir)?;
    refuse_if_frozen(child)
}

impl Ext2 {
    pub(crate) fn do_get_flags(&self, st: &State, ino: u32) -> Result<u32> {
        Ok(self.read_live_inode(st, ino)?.flags & VISIBLE)
    }

    pub(crate) fn do_set_flags(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        flags: u32,
        ctx: &Ctx,
    ) -> Result<()> {
        let mut inode = self.read_live_inode(st, ino)?;
        if ctx.uid != 0 && ctx.uid != inode.uid {
            return Err(FsError::Perm);
        }
        if flags & !VISIBLE != 0 {
            return Err(FsError::NotSupported);
        }
        let flags = flags & MODIFIABLE;
        if mask_for(inode.mode as u32, flags) != flags {
            return Err(FsError::NotSupported);
        }
        let old = inode.flags;
        if (flags ^ old) & EXTENTS != 0 {
            return Err(FsError::Invalid("extents need the extent feature"));
        }
        if (flags ^ old) & NEEDS_FEATURE != 0 {
            return Err(FsError::NotSupported);
        }
        // Only root (CAP_LINUX_IMMUTABLE) sets or clears immutable and append-only; an
        // immutable inode may change only that flag itself.
        if (flags ^ old) & (IMMUTABLE | APPEND) != 0 && ctx.uid != 0 {
            return Err(FsError::Perm);
        }
        if old & IMMUTABLE != 0
            && flags & IMMUTABLE != 0
            && (old & MODIFIABLE & !IMMUTABLE) != (flags & !IMMUTABLE)
        {
            return Err(FsError::Perm);
        }
        inode.flags = (old & !MODIFIABLE) | flags;
        Self::touch_times(&mut inode, false, true);
        let h = self.write_inode(op, st, ino, &inode, &[])?;
        self.track(st, ino, h);
        Ok(())
    }

    /// open(2) of `ino` with `open_flags`: writing an immutable file is refused, and an
    /// append-only one may be opened for writing only to append, never truncated.
    pub(crate) fn do_check_open(&self, st: &State, ino: u32, open_flags: i32) -> Result<()> {
        let inode = self.read_live_inode(st, ino)?;
        let writes = open_flags & libc::O_ACCMODE != libc::O_RDONLY;
        if inode.flags & IMMUTABLE != 0 && (writes || open_flags & libc::O_TRUNC != 0) {
            return Err(FsError::Perm);
        }
        if inode.flags & APPEND != 0
            && ((writes && open_flags & libc::O_APPEND == 0) || open_flags & libc::O_TRUNC != 0)
        {
            return Err(FsError::Perm);
        }
        Ok(())
    }

    /// Whether changes to `ino` (its data with `SYNC`, its entries with `DIRSYNC` too)
    /// are to be durable before the call returns.
    pub(crate) fn wants_sync(&self, ino: u32, entries: bool) -> bool {
        let mask = if entries { SYNC | DIRSYNC } else { SYNC };
        self.reading(1, |st| self.read_inode(st, ino))
            .is_ok_and(|i| i.flags & mask != 0)
    }
}
