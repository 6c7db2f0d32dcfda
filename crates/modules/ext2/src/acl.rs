//! POSIX ACLs on ext2: the on-disk form (`system.posix_acl_*` attributes under name
//! indexes 2 and 3, version 1, short entries for the base tags), and what the kernel's
//! ext2/ext4 drivers do with them: setting an access ACL sets the mode bits (and stores
//! nothing when the mode says it all), chmod rewrites the access ACL, a new inode inherits
//! its directory's default ACL in place of the umask. With the `noacl` mount option the
//! attributes answer "not supported", as the kernel's.
//!
//! The kernel enforces ACLs (FUSE_POSIX_ACL); the module keeps them consistent.

use crate::format::{le16, le32, Inode};
use crate::fs::{Ext2, Op, State};
use crate::xattr::{Change, ACL_ACCESS, ACL_DEFAULT};
use quilt_vfs::acl::{self, Acl, Entry};
use quilt_vfs::{Ctx, FsError, Result, XattrFlags};

const DISK_VERSION: u32 = 1;

fn to_disk(a: &Acl) -> Vec<u8> {
    let mut out = DISK_VERSION.to_le_bytes().to_vec();
    for e in &a.0 {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        if matches!(e.tag, acl::USER | acl::GROUP) {
            out.extend_from_slice(&e.id.to_le_bytes());
        }
    }
    out
}

fn from_disk(b: &[u8], ino: u32) -> Result<Acl> {
    let bad = || crate::format::corrupt(format!("inode {ino}: damaged ACL"));
    if b.len() < 4 || le32(b, 0) != DISK_VERSION {
        return Err(bad());
    }
    let mut entries = Vec::new();
    let mut off = 4;
    while off < b.len() {
        if off + 4 > b.len() {
            return Err(bad());
        }
        let (tag, perm) = (le16(b, off), le16(b, off + 2));
        let mut id = 0;
        off += 4;
        if matches!(tag, acl::USER | acl::GROUP) {
            if off + 4 > b.len() {
                return Err(bad());
            }
            id = le32(b, off);
            off += 4;
        }
        entries.push(Entry { tag, perm, id });
    }
    Acl::new(entries).map_err(|_| bad())
}

impl Ext2 {
    /// The ACL of `ino` under `idx` (access or default), if it has one.
    fn read_acl(&self, st: &State, ino: u32, idx: u8) -> Result<Option<Acl>> {
        self.find_attr(st, ino, idx, b"")?
            .map(|v| from_disk(&v, ino))
            .transpose()
    }

    pub(crate) fn get_acl_xattr(&self, st: &State, ino: u32, idx: u8) -> Result<Vec<u8>> {
        if !self.acl {
            return Err(FsError::NotSupported);
        }
        let a = self.read_acl(st, ino, idx)?.ok_or(FsError::NoAttr)?;
        Ok(a.to_xattr())
    }

    /// setxattr/removexattr of an ACL (the kernel has checked the caller owns the file
    /// or is privileged, and that a default ACL goes on a directory; they are checked
    /// again here for callers of the library).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn set_acl_xattr(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        idx: u8,
        value: Option<&[u8]>,
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        if !self.acl {
            return Err(FsError::NotSupported);
        }
        let mut inode = self.read_live_inode(st, ino)?;
        if ctx.uid != 0 && ctx.uid != inode.uid {
            return Err(FsError::Perm);
        }
        crate::flags::refuse_if_frozen(&inode)?;
        let parsed = value.map(Acl::from_xattr).transpose()?;
        if idx == ACL_DEFAULT && !inode.is_dir() {
            // As the kernel: refused to set, and nothing to remove.
            return if parsed.is_some() {
                Err(FsError::Access)
            } else {
                Ok(())
            };
        }
        let exists = self.find_attr(st, ino, idx, b"")?.is_some();
        if flags.create && exists && parsed.is_some() {
            return Err(FsError::Exists);
        }
        if flags.replace && !exists {
            return Err(FsError::NoAttr);
        }
        let mut store = parsed.clone();
        if let (ACL_ACCESS, Some(a)) = (idx, &parsed) {
            // The mode follows the ACL; an ACL the mode expresses is not stored.
            let mut mode = (inode.mode as u32 & !0o777) | a.mode_bits();
            if flags.kill_sgid {
                mode &= !libc::S_ISGID;
            }
            inode.mode = mode as u16;
            if a.is_mode() {
                store = None;
            }
        }
        if store.is_none() && !exists && parsed.is_none() {
            // Removing an ACL the file does not have changes nothing, as on the kernel.
            return Ok(());
        }
        Self::touch_times(&mut inode, false, true);
        let change = Change {
            idx,
            name: b"",
            value: store.as_ref().map(to_disk),
        };
        self.apply_xattrs(op, st, ino, &mut inode, &[change], &[])?;
        Ok(())
    }

    /// chmod of `ino` to `inode.mode`: the access ACL's base entries follow. None when
    /// ACLs are off or the file has no access ACL.
    pub(crate) fn acl_chmod(
        &self,
        st: &State,
        ino: u32,
        inode: &Inode,
    ) -> Result<Option<Change<'static>>> {
        if !self.acl {
            return Ok(None);
        }
        let Some(mut a) = self.read_acl(st, ino, ACL_ACCESS)? else {
            return Ok(None);
        };
        a.chmod(inode.mode as u32);
        Ok(Some(Change {
            idx: ACL_ACCESS,
            name: b"",
            value: Some(to_disk(&a)),
        }))
    }

    /// A new inode of `mode` in directory `parent` for a caller with `umask`: its mode,
    /// and the ACLs it starts with — its directory's default ACL limited by the mode
    /// (directories keep the default ACL as theirs), or, without one, the umask applied.
    /// Symbolic links take neither.
    pub(crate) fn acl_for_new(
        &self,
        st: &State,
        parent: u32,
        mode: u32,
        umask: u32,
    ) -> Result<(u32, Vec<Change<'static>>)> {
        if mode & libc::S_IFMT == libc::S_IFLNK {
            return Ok((mode, Vec::new()));
        }
        let default = if self.acl {
            self.read_acl(st, parent, ACL_DEFAULT)?
        } else {
            None
        };
        let Some(d) = default else {
            return Ok((mode & !(umask & 0o777), Vec::new()));
        };
        let (access, mode) = d.inherit(mode);
        let mut changes = Vec::new();
        if let Some(a) = access {
            changes.push(Change {
                idx: ACL_ACCESS,
                name: b"",
                value: Some(to_disk(&a)),
            });
        }
        if mode & libc::S_IFMT == libc::S_IFDIR {
            changes.push(Change {
                idx: ACL_DEFAULT,
                name: b"",
                value: Some(to_disk(&d)),
            });
        }
        Ok((mode, changes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_form_is_short_for_base_entries_and_round_trips() {
        let a = Acl::new(vec![
            Entry {
                tag: acl::USER_OBJ,
                perm: 6,
                id: 0,
            },
            Entry {
                tag: acl::USER,
                perm: 0,
                id: 1234,
            },
            Entry {
                tag: acl::GROUP_OBJ,
                perm: 4,
                id: 0,
            },
            Entry {
                tag: acl::MASK,
                perm: 4,
                id: 0,
            },
            Entry {
                tag: acl::OTHER,
                perm: 4,
                id: 0,
            },
        ])
        .unwrap();
        let d = to_disk(&a);
        // version, four short entries, one long.
        assert_eq!(d.len(), 4 + 4 * 4 + 8);
        assert_eq!(from_disk(&d, 1).unwrap(), a);
        assert!(from_disk(&d[..d.len() - 2], 1).is_err());
        assert!(from_disk(&[2, 0, 0, 0], 1).is_err());
    }
}
