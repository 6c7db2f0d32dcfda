//! Inode flags (`i_flags`): FS_IOC_GETFLAGS/SETFLAGS, inheritance from the parent
//! directory, and the refusals immutable and append-only files impose. The rules are
//! the kernel's for ext2 images (its ext4 driver serves them on current kernels): which
//! flags are visible, which a caller may change, which a new inode takes from its
//! directory, and which operations answer EPERM.

use crate::format::Inode;
use crate::fs::{Ext2, Op, State};
use quilt_vfs::flags::*;
use quilt_vfs::{Ctx, Result};

pub(crate) use quilt_vfs::rules::VISIBLE;

pub(crate) fn inherited(dir_flags: u32, mode: u32) -> u32 {
    quilt_vfs::rules::inherited_flags(dir_flags, mode)
}

pub(crate) fn refuse_if_frozen(inode: &Inode) -> Result<()> {
    quilt_vfs::rules::refuse_if_frozen(inode.flags)
}

pub(crate) fn refuse_new_entry(dir: &Inode) -> Result<()> {
    quilt_vfs::rules::refuse_new_entry(dir.flags)
}

pub(crate) fn refuse_removal(dir: &Inode, child: &Inode) -> Result<()> {
    quilt_vfs::rules::refuse_removal(dir.flags, child.flags)
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
        inode.flags =
            quilt_vfs::rules::set_flags(inode.flags, flags, inode.mode as u32, inode.uid, ctx)?;
        Self::touch_times(&mut inode, false, true);
        let h = self.write_inode(op, st, ino, &inode, &[])?;
        self.track(st, ino, h);
        Ok(())
    }

    /// open(2) of `ino` with `open_flags`: writing an immutable file is refused, and an
    /// append-only one may be opened for writing only to append, never truncated.
    pub(crate) fn do_check_open(&self, st: &State, ino: u32, open_flags: i32) -> Result<()> {
        let inode = self.read_live_inode(st, ino)?;
        quilt_vfs::rules::check_open(inode.flags, open_flags)
    }

    /// Whether changes to `ino` (its data with `SYNC`, its entries with `DIRSYNC` too)
    /// are to be durable before the call returns.
    pub(crate) fn wants_sync(&self, ino: u32, entries: bool) -> bool {
        let mask = if entries { SYNC | DIRSYNC } else { SYNC };
        self.reading(1, |st| self.read_inode(st, ino))
            .is_ok_and(|i| i.flags & mask != 0)
    }
}
