//! The on-disk orphan list, as ext3 keeps it: inodes that lost their last name while
//! open (or were made nameless, O_TMPFILE) are chained from the superblock's
//! `s_last_orphan` through their `i_dtime`, so that after a crash recovery frees them
//! (ours at mount, the kernel's, e2fsck's) instead of leaving allocated inodes no
//! directory names. Kept in the journal modes, where the transaction that unlinks also
//! links the list, atomically. Soft updates keeps the list in memory only: a crash
//! there leaves such an inode for e2fsck as an allowed leak (ordering the list's two
//! writes against the unlink is not done).

use crate::format::Inode;
use crate::fs::{Ext2, Op, State};
use quilt_vfs::{FsError, Result};

impl Ext2 {
    fn on_disk_orphans(&self) -> bool {
        self.mode().is_journal() && !self.is_read_only()
    }

    /// Puts `ino` at the head of the on-disk list: `inode` (which the caller writes)
    /// points to the old head.
    pub(crate) fn orphan_add(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
    ) -> Result<()> {
        if !self.on_disk_orphans() {
            return Ok(());
        }
        inode.dtime = st.sb.last_orphan;
        if st.sb.last_orphan != 0 {
            st.files.set_prev(st.sb.last_orphan, ino);
        }
        st.files.set_prev(ino, 0);
        st.sb.last_orphan = ino;
        self.write_super(op, st)
    }

    /// Takes `ino` off the on-disk list (it is freed, or has a name again): its
    /// predecessor, or the superblock, points past it; its own link is cleared.
    pub(crate) fn orphan_remove(&self, op: &Op<'_>, st: &mut State, ino: u32) -> Result<()> {
        if !self.on_disk_orphans() {
            return Ok(());
        }
        let next = self.read_inode(st, ino)?.dtime;
        let prev = match st.files.take_prev(ino) {
            // The back link is checked against the forward one it mirrors.
            Some(p) if p != 0 && self.read_inode(st, p)?.dtime == ino => Some(p),
            _ => None,
        };
        if let Some(p) = prev.or_else(|| (st.sb.last_orphan == ino).then_some(0)) {
            if next != 0 {
                st.files.set_prev(next, p);
            }
        }
        if st.sb.last_orphan == ino {
            st.sb.last_orphan = next;
            self.write_super(op, st)?;
        } else if let Some(p) = prev {
            self.modify_inode(op, st, p, &[], |i| i.dtime = next)?;
        } else {
            // No back link (a list left by an older mount of this image): walk it,
            // bounded.
            let mut at = st.sb.last_orphan;
            let mut steps = 0u32;
            while at != 0 && steps <= self.geo.inodes_count {
                let i = self.read_inode(st, at)?;
                if i.dtime == ino {
                    self.modify_inode(op, st, at, &[], |p| p.dtime = next)?;
                    if next != 0 {
                        st.files.set_prev(next, at);
                    }
                    break;
                }
                at = i.dtime;
                steps += 1;
            }
        }
        self.modify_inode(op, st, ino, &[], |i| i.dtime = 0)?;
        Ok(())
    }

    /// At mount, after recovery: frees the inodes of the on-disk list (left by a crash,
    /// ours or the kernel's) and empties it. Returns how many were freed.
    pub(crate) fn orphan_cleanup(&self) -> Result<usize> {
        let op = self.begin_internal();
        let r = self.change_in(&op, |op, st| {
            let mut at = st.sb.last_orphan;
            let mut freed = 0;
            let mut seen = std::collections::HashSet::new();
            while at != 0 {
                if at < self.geo.first_ino || at > self.geo.inodes_count || !seen.insert(at) {
                    // Damage: what is left of the list stays for e2fsck (as leaks).
                    tracing::warn!(
                        "the orphan list holds inode {at}, out of range or met twice: not followed further"
                    );
                    break;
                }
                let inode = self.read_inode(st, at)?;
                let next = inode.dtime;
                if inode.mode != 0 && inode.links == 0 {
                    self.destroy_inode(op, st, at, None)?;
                    freed += 1;
                } else if inode.mode != 0 {
                    // Named again before the crash: it only leaves the list.
                    self.modify_inode(op, st, at, &[], |i| i.dtime = 0)?;
                }
                at = next;
            }
            if st.sb.last_orphan != 0 {
                st.sb.last_orphan = 0;
                self.write_super(op, st)?;
            }
            Ok::<usize, FsError>(freed)
        });
        op.tx.end()?;
        self.record_pending_error();
        r
    }
}
