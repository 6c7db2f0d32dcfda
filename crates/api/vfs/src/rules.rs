//! POSIX and Linux rules every file-system module applies the same way, whatever its
//! on-disk form: inode flags (which are visible, which a caller may change, which a new
//! inode inherits, what immutable and append-only refuse) and the set-ID bits a change
//! of owner drops. The flag rules are the kernel's for ext2 images (its ext4 driver
//! serves them on current kernels); the Bε-tree module keeps the same bits.

use crate::flags::*;
use crate::{Ctx, FsError, Result};

/// Flags FS_IOC_GETFLAGS shows (the kernel's EXT4_FL_USER_VISIBLE).
pub const VISIBLE: u32 = 0x705B_DFFF;
/// Flags FS_IOC_SETFLAGS may change; other visible ones are silently kept (chattr sends
/// back what it read).
const MODIFIABLE: u32 = 0x604B_C0FF;
/// Flags a new inode takes from its directory.
const INHERITED: u32 =
    SECRM | UNRM | COMPR | SYNC | NODUMP | NOATIME | JOURNAL_DATA | NOTAIL | DIRSYNC | NOCOMPR;
/// Flags that mean something only on directories.
const DIR_ONLY: u32 = DIRSYNC | TOPDIR | CASEFOLD | PROJINHERIT;
/// Flags that need a feature neither module has: extents (the kernel answers EINVAL,
/// it cannot convert the file) and case folding (EOPNOTSUPP).
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
pub fn inherited_flags(dir_flags: u32, mode: u32) -> u32 {
    mask_for(mode, dir_flags & INHERITED)
}

/// EPERM for any change to an immutable or append-only inode's attributes, names or
/// links (the kernel's IS_IMMUTABLE || IS_APPEND checks).
pub fn refuse_if_frozen(flags: u32) -> Result<()> {
    if flags & (IMMUTABLE | APPEND) != 0 {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// EPERM for a setattr the inode's flags forbid: the kernel's notify_change freezes
/// owner, mode, size and explicit times of immutable and append-only inodes, and "now"
/// times of immutable ones.
pub fn refuse_setattr(flags: u32, set: &crate::SetAttr) -> Result<()> {
    let explicit = |t: Option<crate::TimeOrNow>| matches!(t, Some(crate::TimeOrNow::At(_)));
    if set.mode.is_some()
        || set.uid.is_some()
        || set.gid.is_some()
        || set.size.is_some()
        || explicit(set.atime)
        || explicit(set.mtime)
    {
        refuse_if_frozen(flags)?;
    }
    if flags & IMMUTABLE != 0 {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// EPERM for adding an entry to an immutable directory (append-only ones take new
/// entries).
pub fn refuse_new_entry(dir_flags: u32) -> Result<()> {
    if dir_flags & IMMUTABLE != 0 {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// EPERM for removing (or replacing) an entry: neither the directory nor the child may
/// be immutable or append-only.
pub fn refuse_removal(dir_flags: u32, child_flags: u32) -> Result<()> {
    refuse_if_frozen(dir_flags)?;
    refuse_if_frozen(child_flags)
}

/// FS_IOC_SETFLAGS by `ctx` on an inode of `mode` owned by `owner` with flags `old`:
/// the flags it ends up with, or why not.
pub fn set_flags(old: u32, flags: u32, mode: u32, owner: u32, ctx: &Ctx) -> Result<u32> {
    if ctx.uid != 0 && ctx.uid != owner {
        return Err(FsError::Perm);
    }
    if flags & !VISIBLE != 0 {
        return Err(FsError::NotSupported);
    }
    let flags = flags & MODIFIABLE;
    if mask_for(mode, flags) != flags {
        return Err(FsError::NotSupported);
    }
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
    Ok((old & !MODIFIABLE) | flags)
}

/// open(2) with `open_flags` of an inode with `flags`: writing an immutable file is
/// refused, and an append-only one may be opened for writing only to append, never
/// truncated.
pub fn check_open(flags: u32, open_flags: i32) -> Result<()> {
    let writes = open_flags & libc::O_ACCMODE != libc::O_RDONLY;
    if flags & IMMUTABLE != 0 && (writes || open_flags & libc::O_TRUNC != 0) {
        return Err(FsError::Perm);
    }
    if flags & APPEND != 0
        && ((writes && open_flags & libc::O_APPEND == 0) || open_flags & libc::O_TRUNC != 0)
    {
        return Err(FsError::Perm);
    }
    Ok(())
}

/// `mode` without set-user-ID, and without set-group-ID if group execute is on (without
/// it, set-group-ID marks mandatory locking and stays), as Linux drops them on chown and
/// on writes by unprivileged users.
pub fn kill_suid_sgid(mode: u32) -> u32 {
    let mut m = mode & !libc::S_ISUID;
    let sgid_x = libc::S_ISGID | libc::S_IXGRP;
    if m & sgid_x == sgid_x {
        m &= !libc::S_ISGID;
    }
    m
}

/// A symlink's target: not empty (ENOENT, as Linux answers), and shorter than `limit`
/// bytes, the module's block (ENAMETOOLONG).
pub fn check_symlink_target(target: &[u8], limit: usize) -> Result<()> {
    if target.is_empty() {
        return Err(FsError::NotFound);
    }
    if target.len() >= limit {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}
