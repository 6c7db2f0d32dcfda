//! Block and inode bitmaps: allocation with locality (file blocks near their inode and
//! their previous block, directories spread across groups) and freeing. Every bitmap
//! change is a bit patch; the group descriptor counts follow with no ordering (they are
//! summaries e2fsck recomputes, as in Featherstitch).

use crate::format::*;
use crate::fs::{Ext2, Head, Op, State};
use quilt_patch::{PatchError, PatchId};
use quilt_vfs::{FsError, Result};

/// How many recently freed items an allocation passes over before it takes one. In the
/// journal modes a freed block is pending until its transaction commits and it is home;
/// passing over more of them keeps file data out of blocks whose free is not committed
/// (the engine journals such data if it must, see `patch::capture`). In soft updates 64
/// was too few: a mailbox's expunge frees hundreds of inodes at once, every later
/// allocation then found only pending ones among its first 64 and reused the first, and
/// each reuse chained the new file behind the old one's removal (the mail benchmark's
/// epoch chain: two inode numbers taken again 140 times each in a 200-message run).
/// The candidates are found in one look at the bitmap block; the cost is a map lookup
/// per pending one passed over.
const FRESH_SKIPS: usize = 4096;
const FRESH_SKIPS_JOURNAL: usize = 1024;

impl Ext2 {
    /// Finds up to `want` zero bits in `bitmap` among the first `limit` bits, in order
    /// from `start`, wrapping. One look at the block for all of them: an allocation that
    /// passes over many pending bits must not pay a cache lookup (and its budget check)
    /// for each.
    fn find_zeros(&self, bitmap: u32, start: u32, limit: u32, want: usize) -> Result<Vec<u32>> {
        self.engine()
            .with_block(bitmap as u64, |d| {
                let limit = limit.min(d.len() as u32 * 8);
                let mut out = Vec::new();
                let scan = |from: u32, to: u32, out: &mut Vec<u32>| {
                    let mut i = from;
                    while i < to && out.len() < want {
                        if i % 64 == 0 && i + 64 <= to {
                            let at = (i / 8) as usize;
                            let mut w = [0u8; 8];
                            w.copy_from_slice(&d[at..at + 8]);
                            let mut free = !u64::from_le_bytes(w);
                            while free != 0 && out.len() < want {
                                out.push(i + free.trailing_zeros());
                                free &= free - 1;
                            }
                            i += 64;
                            continue;
                        }
                        if d[(i / 8) as usize] & (1 << (i % 8)) == 0 {
                            out.push(i);
                        }
                        i += 1;
                    }
                };
                let start = start.min(limit);
                scan(start, limit, &mut out);
                scan(0, start, &mut out);
                out
            })
            .map_err(Self::io)
    }

    /// Like `find_zero`, but passes over (up to `FRESH_SKIPS` times, more in the journal
    /// modes) free bits whose
    /// freeing may not be durable yet (`pending`). Reusing such an item at once chains its
    /// new owner's changes behind the old owner's removal; a program that frees and
    /// reallocates in turn (a mail server rewriting its index through a lock file and a
    /// rename) then builds a dependency chain as long as its run, and write-back needs an
    /// epoch, and a flush, per link. If only such bits are free, the first one is used:
    /// the dependency keeps it correct, only slower.
    fn find_fresh(
        &self,
        bitmap: u32,
        start: u32,
        limit: u32,
        pending: impl Fn(u32) -> bool,
    ) -> Result<Option<u32>> {
        let skips = if self.mode.is_journal() {
            FRESH_SKIPS_JOURNAL
        } else {
            FRESH_SKIPS
        };
        // Small batches first: the first free bit is nearly always fresh.
        let mut want = 8;
        loop {
            let bits = self.find_zeros(bitmap, start, limit, want)?;
            if let Some(&b) = bits.iter().find(|&&b| !pending(b)) {
                return Ok(Some(b));
            }
            if bits.len() < want || want >= skips {
                return Ok(bits.first().copied());
            }
            want = (want * 8).min(skips);
        }
    }

    fn bit_is_set(&self, bitmap: u32, bit: u32) -> Result<bool> {
        self.engine()
            .with_block(bitmap as u64, |d| {
                d[(bit / 8) as usize] & (1 << (bit % 8)) != 0
            })
            .map_err(Self::io)
    }

    fn flip_bit(&self, op: &Op<'_>, bitmap: u32, bit: u32, befores: &[PatchId]) -> Result<PatchId> {
        let word = (bit / 32) * 4;
        let befores = self.cross(befores);
        op.tx
            .xor_bits(bitmap as u64, word as usize, 1 << (bit % 32), &befores)
            .map_err(Self::io)
    }

    /// Allocates a block, preferring `goal` and its group. Returns the block and the
    /// bitmap patch.
    pub(crate) fn alloc_block(
        &self,
        op: &Op<'_>,

        st: &mut State,
        goal: u32,
    ) -> Result<(u32, PatchId)> {
        // The last r_blocks_count free blocks are root's (kernel ext2's rule), so a full
        // disk still leaves root room to log in and clean up.
        if st.sb.free_blocks_count <= st.sb.r_blocks_count && !op.privileged {
            return Err(FsError::NoSpace);
        }
        let g0 =
            self.group_of_block(goal.clamp(self.geo.first_data_block, self.geo.blocks_count - 1));
        let ng = self.geo.groups;
        for k in 0..ng {
            let g = (g0 + k) % ng;
            if st.gd[g as usize].free_blocks == 0 {
                continue;
            }
            let first = self.geo.group_first_block(g);
            let count = self.geo.group_block_count(g);
            let start = if k == 0 {
                goal.saturating_sub(first).min(count - 1)
            } else {
                0
            };
            let bitmap = st.gd[g as usize].block_bitmap;
            let pending = |bit: u32| {
                st.freed
                    .get(&(first + bit))
                    .is_some_and(|&p| !self.engine().is_durable(p))
            };
            let Some(bit) = self.find_fresh(bitmap, start, count, pending)? else {
                // The descriptor said free blocks exist; the bitmap disagrees.
                tracing::warn!(
                    "group {g}: free block count says {} but bitmap is full",
                    st.gd[g as usize].free_blocks
                );
                st.gd[g as usize].free_blocks = 0;
                continue;
            };
            let blk = first + bit;
            if self.is_meta_block(st, blk) {
                return Err(corrupt(format!(
                    "block bitmap of group {g} marks metadata block {blk} free"
                )));
            }
            // Storage behind the block before it is ours: a sparse image on a full host
            // disk fails this operation, not the write-back after it returned.
            self.engine().reserve(blk as u64, 1).map_err(|e| match e {
                PatchError::Block(quilt_block::BlockError::NoSpace { .. }) => {
                    tracing::warn!("{e}");
                    FsError::NoSpace
                }
                e => Self::io(e),
            })?;
            let freed = st.freed.get(&blk).copied();
            let p = self.flip_bit(op, bitmap, bit, &freed.into_iter().collect::<Vec<_>>())?;
            // Saturating: a damaged descriptor may count fewer free blocks than its bitmap.
            st.gd[g as usize].free_blocks = st.gd[g as usize].free_blocks.saturating_sub(1);
            st.sb.free_blocks_count = st.sb.free_blocks_count.saturating_sub(1);
            self.write_gd(st, g)?;
            st.counters.blocks_allocated += 1;
            return Ok((blk, p));
        }
        Err(FsError::NoSpace)
    }

    /// Frees `blk` after `befores` (the patch that removed the last pointer to it), and
    /// remembers that patch: the block's next contents must wait for it.
    pub(crate) fn free_block(
        &self,
        op: &Op<'_>,
        st: &mut State,
        blk: u32,
        befores: Head,
    ) -> Result<()> {
        self.free_blocks(op, st, &mut [blk], befores)
    }

    /// Frees `blks` (sorting them) after `befores` with one bitmap change per 32-bit
    /// word of bits: a file's blocks lie mostly together, so freeing a file changes a
    /// few words, not one per block. (Freeing files was most of the CPU that `rm -rf`
    /// spent under the module's exclusive lock.) A block already free, or named twice,
    /// is damage: nothing of its word is freed, nor anything after it.
    pub(crate) fn free_blocks(
        &self,
        op: &Op<'_>,
        st: &mut State,
        blks: &mut [u32],
        befores: Head,
    ) -> Result<()> {
        for &b in blks.iter() {
            self.check_data_block(b)?;
        }
        blks.sort_unstable();
        let head = befores;
        let befores = self.cross(&head.into_iter().collect::<Vec<_>>());
        let mut rest = &blks[..];
        while let Some(&blk) = rest.first() {
            let g = self.group_of_block(blk);
            let first = self.geo.group_first_block(g);
            let word = (blk - first) / 32;
            let n = rest
                .iter()
                .take_while(|&&b| self.group_of_block(b) == g && (b - first) / 32 == word)
                .count();
            let (these, after) = rest.split_at(n);
            rest = after;
            let mut mask = 0u32;
            for &b in these {
                let m = 1u32 << ((b - first) % 32);
                if mask & m != 0 {
                    return Err(corrupt(format!("freeing block {b} twice")));
                }
                mask |= m;
            }
            let bitmap = st.gd[g as usize].block_bitmap;
            let set = self
                .engine()
                .with_block(bitmap as u64, |d| le32(d, word as usize * 4))
                .map_err(Self::io)?;
            if let Some(&free) = these
                .iter()
                .find(|&&b| set & (1 << ((b - first) % 32)) == 0)
            {
                return Err(corrupt(format!(
                    "freeing block {free}, which is already free"
                )));
            }
            op.tx
                .xor_bits(bitmap as u64, word as usize * 4, mask, &befores)
                .map_err(Self::io)?;
            // A journal must not replay an old copy of these blocks over their next
            // owners' data.
            self.engine()
                .capture_revoke(these.iter().map(|&b| b as u64));
            if let Some(p) = head {
                for &b in these {
                    self.note_freed_block(st, b, p);
                }
            }
            let k = these.len() as u32;
            st.gd[g as usize].free_blocks = st.gd[g as usize].free_blocks.saturating_add(k as u16);
            st.sb.free_blocks_count = st.sb.free_blocks_count.saturating_add(k);
            self.write_gd(st, g)?;
            st.counters.blocks_freed += k as u64;
        }
        Ok(())
    }

    /// Allocates an inode: directories go to a group with few directories and room to
    /// spare, files to their parent's group.
    pub(crate) fn alloc_inode(
        &self,
        op: &Op<'_>,

        st: &mut State,
        parent: u32,
        dir: bool,
    ) -> Result<(u32, PatchId)> {
        let ng = self.geo.groups;
        let pg = self.group_of_inode(parent);
        let start = if dir {
            let avg_free = st.sb.free_inodes_count / ng;
            let mut best: Option<u32> = None;
            for k in 0..ng {
                let g = (st.dir_cursor + k) % ng;
                let d = &st.gd[g as usize];
                if d.free_inodes == 0 || (d.free_inodes as u32) < avg_free {
                    continue;
                }
                if best.is_none_or(|b| d.used_dirs < st.gd[b as usize].used_dirs) {
                    best = Some(g);
                }
            }
            st.dir_cursor = (st.dir_cursor + 1) % ng;
            best.unwrap_or(pg)
        } else {
            pg
        };
        for k in 0..ng {
            let g = (start + k) % ng;
            if st.gd[g as usize].free_inodes == 0 {
                continue;
            }
            let bitmap = st.gd[g as usize].inode_bitmap;
            let from = if g == 0 { self.geo.first_ino - 1 } else { 0 };
            let base = g * self.geo.ipg + 1;
            let pending = |bit: u32| {
                st.freed_inodes
                    .get(&(base + bit))
                    .is_some_and(|&p| !self.engine().is_durable(p))
            };
            let Some(bit) = self.find_fresh(bitmap, from, self.geo.ipg, pending)? else {
                st.gd[g as usize].free_inodes = 0;
                continue;
            };
            if g == 0 && bit < self.geo.first_ino - 1 {
                continue;
            }
            let ino = g * self.geo.ipg + bit + 1;
            let p = self.flip_bit(op, bitmap, bit, &[])?;
            st.gd[g as usize].free_inodes = st.gd[g as usize].free_inodes.saturating_sub(1);
            if dir {
                st.gd[g as usize].used_dirs = st.gd[g as usize].used_dirs.saturating_add(1);
            }
            st.sb.free_inodes_count = st.sb.free_inodes_count.saturating_sub(1);
            self.write_gd(st, g)?;
            return Ok((ino, p));
        }
        Err(FsError::NoSpace)
    }

    pub(crate) fn free_inode(
        &self,
        op: &Op<'_>,

        st: &mut State,
        ino: u32,
        dir: bool,
        befores: Head,
    ) -> Result<()> {
        let g = self.group_of_inode(ino);
        let bit = (ino - 1) % self.geo.ipg;
        let bitmap = st.gd[g as usize].inode_bitmap;
        if !self.bit_is_set(bitmap, bit)? {
            return Err(corrupt(format!(
                "freeing inode {ino}, which is already free"
            )));
        }
        let p = self.flip_bit(op, bitmap, bit, &befores.into_iter().collect::<Vec<_>>())?;
        self.note_freed_inode(st, ino, p);
        st.gd[g as usize].free_inodes = st.gd[g as usize].free_inodes.saturating_add(1);
        if dir {
            st.gd[g as usize].used_dirs = st.gd[g as usize].used_dirs.saturating_sub(1);
        }
        st.sb.free_inodes_count = st.sb.free_inodes_count.saturating_add(1);
        self.write_gd(st, g)?;
        Ok(())
    }

    /// The block group holding inode `ino`'s slot.
    pub(crate) fn group_of_inode(&self, ino: u32) -> u32 {
        ino.saturating_sub(1) / self.geo.ipg
    }

    pub(crate) fn group_of_block(&self, blk: u32) -> u32 {
        (blk - self.geo.first_data_block) / self.geo.bpg
    }

    /// Is `blk` a superblock, descriptor, bitmap or inode-table block?
    pub(crate) fn is_meta_block(&self, st: &State, blk: u32) -> bool {
        let g = self.group_of_block(blk);
        let d = &st.gd[g as usize];
        let first = self.geo.group_first_block(g);
        (self.geo.group_has_super(g) && blk < first + 1 + self.geo.gdt_blocks)
            || blk == d.block_bitmap
            || blk == d.inode_bitmap
            || (blk >= d.inode_table && blk < d.inode_table + self.geo.itb)
    }
}
