//! Inodes: reading and writing them, block maps (direct, indirect, double and triple
//! indirect), file data, truncation and freeing.
//!
//! Soft-updates order for a new block: its bitmap bit and its initialized contents
//! before the pointer to it. The inode's block count and size are written before a
//! pointer in an indirect block (a crash leaves them too high, never too low), and after
//! pointers are cleared on truncation, for the same reason.

use crate::alloc::BlockUse;
use crate::format::*;
use crate::fs::{Ext2, Head, Op, State};
use quilt_patch::PatchId;
use quilt_vfs::{FsError, Result, SetAttr, Timespec};

/// The most blocks one write allocates before it writes them (a write of up to 1 MiB of
/// 4 KiB blocks: the FUSE adapter's largest).
const STRETCH_BLOCKS_MAX: u64 = 256;

/// Where a logical block's pointer lives: the slot in `i_block`, then the slots in each
/// indirect level.
struct Path {
    top: usize,
    rest: Vec<usize>,
}

impl Ext2 {
    pub(crate) fn inode_loc(&self, st: &State, ino: u32) -> Result<(u32, usize)> {
        if ino == 0 || ino > self.geo.inodes_count {
            return Err(FsError::NotFound);
        }
        let idx = ino - 1;
        let g = idx / self.geo.ipg;
        let i = (idx % self.geo.ipg) as u64 * self.geo.inode_size as u64;
        let blk = st.gd[g as usize].inode_table + (i / self.geo.bs as u64) as u32;
        Ok((blk, (i % self.geo.bs as u64) as usize))
    }

    pub(crate) fn read_inode(&self, st: &State, ino: u32) -> Result<Inode> {
        let (blk, off) = self.inode_loc(st, ino)?;
        let isz = self.geo.inode_size as usize;
        self.engine()
            .with_block(blk as u64, |d| Inode::decode(&d[off..off + isz]))
            .map_err(Self::io)
    }

    /// An inode that must be in use (named by an entry, or open). A free one is `Stale`
    /// for a number the caller gave; where an entry names it, that is damage, which
    /// `lookup` reports as such.
    pub(crate) fn read_live_inode(&self, st: &State, ino: u32) -> Result<Inode> {
        if ino != ROOT_INO && ino < self.geo.first_ino {
            return Err(FsError::NotFound);
        }
        let inode = self.read_inode(st, ino)?;
        if inode.mode == 0 || (inode.links == 0 && !st.files.is_orphan(ino)) {
            return Err(FsError::Stale);
        }
        if quilt_vfs::FileType::from_mode(inode.mode as u32).is_none() {
            return Err(corrupt(format!(
                "inode {ino} has an unknown type (mode {:o})",
                inode.mode
            )));
        }
        if inode.is_dir() && inode.size % self.geo.bs as u64 != 0 {
            return Err(corrupt(format!(
                "directory {ino} has size {} (not whole blocks)",
                inode.size
            )));
        }
        Ok(inode)
    }

    pub(crate) fn write_inode(
        &self,
        op: &Op<'_>,

        st: &State,
        ino: u32,
        inode: &Inode,
        befores: &[PatchId],
    ) -> Result<Head> {
        self.write_inode_with(op, st, ino, inode, befores, |_| {})
    }

    /// Writes an inode over its current slot bytes, after `edit` has changed the raw slot
    /// further (bytes past the fields `Inode` knows).
    pub(crate) fn write_inode_with(
        &self,
        op: &Op<'_>,

        st: &State,
        ino: u32,
        inode: &Inode,
        befores: &[PatchId],
        edit: impl FnOnce(&mut [u8]),
    ) -> Result<Head> {
        let (blk, off) = self.inode_loc(st, ino)?;
        let isz = self.geo.inode_size as usize;
        let mut raw = self
            .engine()
            .with_block(blk as u64, |d| d[off..off + isz].to_vec())
            .map_err(Self::io)?;
        inode.encode_into(&mut raw);
        edit(&mut raw);
        self.put(op, blk, off, &raw, befores, false)
    }

    /// Zeroes the inode's slot (keeping a deletion time), as a freed inode.
    pub(crate) fn clear_inode(
        &self,
        op: &Op<'_>,

        st: &State,
        ino: u32,
        befores: &[PatchId],
    ) -> Result<Head> {
        let (blk, off) = self.inode_loc(st, ino)?;
        let mut raw = vec![0u8; self.geo.inode_size as usize];
        put32(&mut raw, 0x14, Timespec::now().sec as u32);
        self.put_exact(op, blk, off, &raw, befores).map(Some)
    }

    /// Writes a new inode's whole slot (see `put_exact`).
    pub(crate) fn init_inode(
        &self,
        op: &Op<'_>,

        st: &State,
        ino: u32,
        inode: &Inode,
        befores: &[PatchId],
    ) -> Result<PatchId> {
        let (blk, off) = self.inode_loc(st, ino)?;
        let mut raw = vec![0u8; self.geo.inode_size as usize];
        inode.encode_into(&mut raw);
        self.put_exact(op, blk, off, &raw, befores)
    }

    /// Reads, changes and writes an inode.
    pub(crate) fn modify_inode(
        &self,
        op: &Op<'_>,

        st: &State,
        ino: u32,
        befores: &[PatchId],
        f: impl FnOnce(&mut Inode),
    ) -> Result<Head> {
        let mut inode = self.read_inode(st, ino)?;
        f(&mut inode);
        self.write_inode(op, st, ino, &inode, befores)
    }

    pub(crate) fn new_inode(&self, mode: u32, uid: u32, gid: u32) -> Inode {
        let now = Timespec::now();
        let (lo, extra) = Inode::split_time(now);
        let big = self.geo.inode_size as usize > GOOD_OLD_INODE_SIZE;
        Inode {
            mode: mode as u16,
            uid,
            gid,
            atime: lo,
            ctime: lo,
            mtime: lo,
            extra_isize: if big {
                crate::mkfs::EXTRA_ISIZE.min(self.geo.inode_size as u16 - 128)
            } else {
                0
            },
            ctime_extra: extra,
            mtime_extra: extra,
            atime_extra: extra,
            crtime: lo,
            crtime_extra: extra,
            generation: (now.nsec ^ now.sec as u32).wrapping_mul(2654435761),
            ..Default::default()
        }
    }

    pub(crate) fn touch_times(inode: &mut Inode, m: bool, c: bool) {
        let (lo, extra) = Inode::split_time(Timespec::now());
        if m {
            inode.mtime = lo;
            inode.mtime_extra = extra;
        }
        if c {
            inode.ctime = lo;
            inode.ctime_extra = extra;
        }
    }

    fn ptrs(&self) -> u64 {
        self.geo.bs as u64 / 4
    }

    fn path(&self, lblk: u64) -> Result<Path> {
        let p = self.ptrs();
        let mut l = lblk;
        if l < NDIR_BLOCKS as u64 {
            return Ok(Path {
                top: l as usize,
                rest: vec![],
            });
        }
        l -= NDIR_BLOCKS as u64;
        if l < p {
            return Ok(Path {
                top: IND_BLOCK,
                rest: vec![l as usize],
            });
        }
        l -= p;
        if l < p * p {
            return Ok(Path {
                top: DIND_BLOCK,
                rest: vec![(l / p) as usize, (l % p) as usize],
            });
        }
        l -= p * p;
        if l < p * p * p {
            return Ok(Path {
                top: TIND_BLOCK,
                rest: vec![
                    (l / (p * p)) as usize,
                    ((l / p) % p) as usize,
                    (l % p) as usize,
                ],
            });
        }
        Err(FsError::TooBig)
    }

    /// The largest file size, as the kernel computes it for a block-mapped file without
    /// `huge_file`: the data and every map block of a dense file, counted in 512-byte
    /// sectors, must fit `i_blocks`' 32 bits (about 2 TiB with 4 KiB blocks), or the
    /// block map's reach if that is smaller (16 GiB with 1 KiB blocks).
    pub(crate) fn max_file_size(&self) -> u64 {
        max_file_size(self.geo.bs)
    }

    fn read_ptr(&self, blk: u32, slot: usize) -> Result<u32> {
        self.check_data_block(blk)?;
        self.engine()
            .with_block(blk as u64, |d| le32(d, slot * 4))
            .map_err(Self::io)
    }

    /// The physical block of logical block `lblk`, or 0 for a hole.
    pub(crate) fn bmap(&self, inode: &Inode, lblk: u64) -> Result<u32> {
        Ok(self.bmap_span(inode, lblk)?.0)
    }

    /// Like [`Ext2::bmap`], and for a hole also how many blocks from `lblk` on are
    /// holes for the same reason (a missing map block covers a whole subtree), so that
    /// scans skip them in one step.
    pub(crate) fn bmap_span(&self, inode: &Inode, lblk: u64) -> Result<(u32, u64)> {
        let p = self.ptrs();
        let path = self.path(lblk)?;
        let (base, mut span) = match path.top {
            IND_BLOCK => (NDIR_BLOCKS as u64, p),
            DIND_BLOCK => (NDIR_BLOCKS as u64 + p, p * p),
            TIND_BLOCK => (NDIR_BLOCKS as u64 + p + p * p, p * p * p),
            _ => (lblk, 1),
        };
        let within = lblk - base;
        let mut ptr = inode.block[path.top];
        if ptr == 0 {
            return Ok((0, span - within % span));
        }
        for &slot in &path.rest {
            span /= p;
            ptr = self.read_ptr(ptr, slot)?;
            if ptr == 0 {
                return Ok((0, span - within % span));
            }
        }
        self.check_data_block(ptr)?;
        Ok((ptr, 1))
    }

    /// SEEK_DATA (`data`) and SEEK_HOLE over the block map: a block is data when it
    /// is mapped, as for the kernel's block-mapped files.
    pub(crate) fn do_seek_data(
        &self,
        st: &State,
        ino: u32,
        offset: u64,
        data: bool,
    ) -> Result<u64> {
        let inode = self.read_live_inode(st, ino)?;
        if offset >= inode.size {
            return Err(FsError::NoData);
        }
        if !inode.is_reg() || !inode.has_block_map() {
            return Ok(if data { offset } else { inode.size });
        }
        let bs = self.geo.bs as u64;
        let last = (inode.size - 1) / bs;
        let mut l = offset / bs;
        while l <= last {
            let (phys, span) = self.bmap_span(&inode, l)?;
            if (phys != 0) == data {
                return Ok((l * bs).max(offset).min(inode.size));
            }
            l += span.max(1);
        }
        if data {
            Err(FsError::NoData)
        } else {
            Ok(inode.size)
        }
    }

    /// Maps `lblk` to a new block holding `content`, which waits for `content_befores`.
    /// Missing indirect blocks are created on the way. Writes the inode (new block count,
    /// and whatever the caller changed in `inode`) and returns the block and the patch
    /// that makes it reachable.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bmap_alloc(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        lblk: u64,
        content: &[u8],
        content_befores: &[PatchId],
        is_data: bool,
        goal: u32,
        defer: Option<&mut Vec<PatchId>>,
    ) -> Result<(u32, PatchId)> {
        // Mapped already (damage)? Refused before anything is allocated. The map blocks
        // the mapping creates are allocated before the block itself (in front of the
        // group's data: `meta_goal`), as the kernel allocates a branch: a full disk fails
        // it whole, and whatever was taken goes back before the error does (nothing
        // points at it yet: the link is the last step).
        let (need, _) = self.new_map_blocks(ino, inode, lblk)?;
        let use_ = if is_data {
            BlockUse::Data
        } else {
            BlockUse::Meta
        };
        let mut pre: Vec<(u32, PatchId)> = Vec::with_capacity(need);
        let mut taken: Option<u32> = None;
        let r = (|| {
            let meta = self.meta_goal(st, self.group_of_inode(ino));
            for _ in 0..need {
                let a = self.alloc_block(op, st, meta, BlockUse::Meta)?;
                pre.insert(0, a);
            }
            let (blk, alloc) = self.alloc_block(op, st, goal, use_)?;
            taken = Some(blk);
            let mut befores: Vec<PatchId> = content_befores.to_vec();
            befores.extend(st.frees.block(blk));
            let init = self.put_block(op, blk, content, &befores, is_data)?;
            let head = self.bmap_map(
                op,
                st,
                ino,
                inode,
                lblk,
                blk,
                &[alloc, init],
                &mut pre,
                defer,
            )?;
            Ok((blk, head))
        })();
        if r.is_err() {
            let linked = taken.is_some_and(|b| self.bmap(inode, lblk).ok() == Some(b));
            let unlinked = taken.filter(|_| !linked);
            for blk in pre.iter().map(|&(b, _)| b).chain(unlinked) {
                if let Err(e) = self.free_block(op, st, blk, None) {
                    tracing::warn!("freeing unmapped block {blk} after an error: {e}");
                }
            }
        }
        r
    }

    /// How many map blocks the mapping of hole `lblk` would create, and the key of the
    /// map block its pointer would go in (None: the inode), as the file is mapped now.
    fn new_map_blocks(&self, ino: u32, inode: &Inode, lblk: u64) -> Result<(usize, Vec<usize>)> {
        let (path, slots, _, depth) = self.empty_slot(ino, inode, lblk)?;
        Ok((path.rest.len() - depth, slots[..slots.len() - 1].to_vec()))
    }

    /// The path to `lblk`'s slot and how much of it exists: `nodes[i]` is the block
    /// holding slot `slots[i]` (`nodes[0]` = 0: the inode itself); the slot at `depth` is
    /// empty. Damage (a pointer outside the file system, the block mapped already) is an
    /// error.
    fn empty_slot(
        &self,
        ino: u32,
        inode: &Inode,
        lblk: u64,
    ) -> Result<(Path, Vec<usize>, Vec<u32>, usize)> {
        let path = self.path(lblk)?;
        let slots: Vec<usize> = std::iter::once(path.top)
            .chain(path.rest.iter().copied())
            .collect();
        let mut nodes: Vec<u32> = vec![0];
        let mut ptr = inode.block[path.top];
        let mut depth = 0;
        while ptr != 0 && depth < path.rest.len() {
            self.check_data_block(ptr)?;
            nodes.push(ptr);
            depth += 1;
            ptr = self.read_ptr(ptr, slots[depth])?;
        }
        if ptr != 0 {
            return Err(corrupt(format!(
                "inode {ino}: block {lblk} is already mapped"
            )));
        }
        Ok((path, slots, nodes, depth))
    }

    /// Maps `lblk` to block `blk`, allocated and initialized already (`child_befores`:
    /// its bitmap bit and its contents, which the pointer must follow). Missing indirect
    /// blocks are created on the way, each placed after the one below. Writes the inode
    /// (new block count, and whatever the caller changed in `inode`) and returns the
    /// patch that makes the block reachable. With `defer`, a pointer in the inode itself
    /// is left for the caller's one inode write, and its befores are added to `defer`.
    /// New map blocks come from `pre` (allocated by the caller, popped from the end)
    /// before the allocator.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bmap_map(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        lblk: u64,
        blk: u32,
        child_befores: &[PatchId],
        pre: &mut Vec<(u32, PatchId)>,
        defer: Option<&mut Vec<PatchId>>,
    ) -> Result<PatchId> {
        let (path, slots, nodes, depth) = self.empty_slot(ino, inode, lblk)?;
        // Slot `slots[depth]` of node `nodes[depth]` is empty: levels depth+1.. are new.
        let levels = path.rest.len() - depth + 1;
        // Map blocks go in front of the group's data, with its directories (`meta_goal`).
        let goal = self.meta_goal(st, self.group_of_inode(ino));
        let init = *child_befores
            .last()
            .ok_or_else(|| corrupt("no initialization patch"))?;
        let mut child = (blk, child_befores.to_vec());
        // Map blocks taken so far, and whether from `pre`: on an error before the link
        // those go back to `pre` (the caller frees what is left there) and the others
        // to the allocator.
        let mut taken: Vec<((u32, PatchId), bool)> = Vec::new();
        for level in (depth + 1..=path.rest.len()).rev() {
            let next = match pre.pop() {
                Some(p) => Ok((p, true)),
                None => self
                    .alloc_block(op, st, goal, BlockUse::Meta)
                    .map(|a| (a, false)),
            };
            let r = next.and_then(|((ind, alloc), from_pre)| {
                taken.push(((ind, alloc), from_pre));
                let mut b = vec![0u8; self.geo.bs as usize];
                put32(&mut b, slots[level] * 4, child.0);
                let mut befores = child.1.clone();
                befores.extend(st.frees.block(ind));
                let init = self.put_block(op, ind, &b, &befores, false)?;
                Ok((ind, vec![alloc, init]))
            });
            match r {
                Ok(c) => child = c,
                Err(e) => {
                    for (p, from_pre) in taken.into_iter().rev() {
                        if from_pre {
                            pre.push(p);
                        } else if let Err(e) = self.free_block(op, st, p.0, None) {
                            tracing::warn!("freeing unmapped block {} after an error: {e}", p.0);
                        }
                    }
                    return Err(e);
                }
            }
        }
        inode.blocks = inode
            .blocks
            .saturating_add(levels as u32 * (self.geo.bs / 512));
        let mut defer = defer;
        let head = if let (0, Some(d)) = (depth, defer.as_deref_mut()) {
            // The caller writes the inode once for many blocks, after all their befores.
            inode.block[path.top] = child.0;
            d.extend(&child.1);
            init
        } else if depth == 0 {
            inode.block[path.top] = child.0;
            self.write_inode(op, st, ino, inode, &child.1)?
                .ok_or_else(|| corrupt("inode write changed nothing"))?
        } else {
            // Pointers this request deferred are in `inode` too: their befores come along.
            let pending: Vec<PatchId> = defer.as_deref().cloned().unwrap_or_default();
            let i = self.write_inode(op, st, ino, inode, &pending)?;
            // Those pointers are now in an inode write that waits for their befores, and
            // every later write of the inode overlaps it and so comes after it: the
            // caller's list starts again. (Kept whole, it grew by a dozen ids a block,
            // and each merge's cycle search walked it: a 64 MiB journal's mkfs took
            // half a minute.)
            if let Some(d) = defer {
                d.clear();
            }
            let mut befores = child.1.clone();
            befores.extend(i);
            let mut b = [0u8; 4];
            put32(&mut b, 0, child.0);
            self.put(op, nodes[depth], slots[depth] * 4, &b, &befores, false)?
                .ok_or_else(|| corrupt("pointer write changed nothing"))?
        };
        Ok(head)
    }

    /// Appends up to `size` bytes of the file at `offset` to `out` (short only at end
    /// of file). Each byte is written once: the cached blocks copied in, holes zeroed;
    /// `out` is not cleared first, so a reused buffer costs no allocation.
    pub(crate) fn do_read_into(
        &self,
        st: &State,
        ino: u32,
        offset: u64,
        size: u32,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let inode = self.read_live_inode(st, ino)?;
        if inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if offset >= inode.size {
            return Ok(());
        }
        let end = inode.size.min(offset.saturating_add(size as u64));
        let bs = self.geo.bs as u64;
        out.reserve((end - offset) as usize);
        let mut pos = offset;
        while pos < end {
            let lblk = pos / bs;
            let in_off = (pos % bs) as usize;
            let n = ((bs - in_off as u64).min(end - pos)) as usize;
            let phys = self.bmap(&inode, lblk)?;
            if phys != 0 {
                self.engine()
                    .with_block(phys as u64, |d| {
                        out.extend_from_slice(&d[in_off..in_off + n])
                    })
                    .map_err(Self::io)?;
            } else {
                out.resize(out.len() + n, 0);
            }
            pos += n as u64;
        }
        Ok(())
    }

    pub(crate) fn do_write(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<u32> {
        let mut inode = self.read_live_inode(st, ino)?;
        if inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if !inode.is_reg() {
            return Err(FsError::Invalid("write to a non-regular file"));
        }
        // Handles opened before the flag was set are held to it too.
        if inode.flags & quilt_vfs::flags::IMMUTABLE != 0
            || (inode.flags & quilt_vfs::flags::APPEND != 0 && offset < inode.size)
        {
            return Err(FsError::Perm);
        }
        // As the kernel does: nothing at or past the maximum size, a short write up to it.
        let max = self.max_file_size();
        if offset >= max && !data.is_empty() {
            return Err(FsError::TooBig);
        }
        let data = &data[..data.len().min((max.saturating_sub(offset)) as usize)];
        let end = offset + data.len() as u64;
        if data.is_empty() {
            return Ok(0);
        }
        let bs = self.geo.bs as u64;
        Self::touch_times(&mut inode, true, true);
        let old_size = inode.size;
        if end > inode.size {
            inode.size = end;
        }
        let mut pos = offset;
        let mut goal = self.goal_for(st, ino, &inode, offset / bs);
        let mut written = 0usize;
        let mut deferred: Vec<PatchId> = Vec::new();
        let mut result: Result<()> = Ok(());
        while pos < end {
            let lblk = pos / bs;
            let in_off = (pos % bs) as usize;
            let n = ((bs - in_off as u64).min(end - pos)) as usize;
            let src = &data[(pos - offset) as usize..(pos - offset) as usize + n];
            let phys = match self.bmap(&inode, lblk) {
                Ok(p) => p,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if phys != 0 {
                goal = phys + 1;
                let head = op
                    .tx
                    .write(phys as u64, in_off, src, &[], true)
                    .map_err(Self::io);
                match head {
                    Ok(h) => self.track(st, ino, Some(h)),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                pos += n as u64;
                written += n;
                continue;
            }
            // A stretch of holes: allocated together, their contents written as runs
            // (one patch per stretch of consecutive blocks, grown across writes while
            // pending), then mapped.
            let (done, r) = self.write_new_blocks(
                op,
                st,
                ino,
                &mut inode,
                offset,
                data,
                pos,
                &mut goal,
                &mut deferred,
            );
            pos += done as u64;
            written += done;
            if let Err(e) = r {
                result = Err(e);
                break;
            }
        }
        // A short write (ENOSPC midway) still reports what was written; one that wrote
        // nothing leaves the size as it was (as kernel ext2 does). (The size raised
        // above may have reached the disk with a map block's pointer: too high for a
        // moment, never too low.)
        if written < data.len() {
            inode.size = if written == 0 {
                old_size
            } else {
                old_size.max(offset + written as u64)
            };
        }
        let h = self.write_inode(op, st, ino, &inode, &deferred)?;
        self.track(st, ino, h);
        if written == 0 {
            result?;
        }
        Ok(written as u32)
    }

    /// Allocates the holes of a write from `pos` on (up to the write's end, the next
    /// mapped block or `STRETCH_BLOCKS_MAX`), writes their contents as runs of
    /// consecutive blocks, and maps them. Returns the bytes of `data` now stored and the
    /// error that stopped it, if any (a short write). Blocks allocated but not mapped
    /// when an error strikes are freed again.
    #[allow(clippy::too_many_arguments)]
    fn write_new_blocks(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        offset: u64,
        data: &[u8],
        pos: u64,
        goal: &mut u32,
        deferred: &mut Vec<PatchId>,
    ) -> (usize, Result<()>) {
        let bs = self.geo.bs as u64;
        let end = offset + data.len() as u64;
        let first = pos / bs;
        let last = (end - 1) / bs;
        // (logical block, physical block, bitmap patch)
        let mut stretch: Vec<(u64, u32, PatchId)> = Vec::new();
        // Map blocks the first block's mapping creates, allocated before its data (in
        // front of the group's data: `meta_goal`); the stretch stops before a block that
        // would need map blocks of its own, so a full disk fails a branch whole (data and
        // map blocks), as the kernel's does, instead of filling up with data it cannot
        // map.
        let mut pre: Vec<(u32, PatchId)> = Vec::new();
        let mut leaf: Option<Vec<usize>> = None;
        let mut result = Ok(());
        for lblk in first..=last.min(first + STRETCH_BLOCKS_MAX - 1) {
            if lblk != first {
                match self.bmap(inode, lblk) {
                    Ok(0) => {}
                    Ok(_) => break,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            let (need, key) = match self.new_map_blocks(ino, inode, lblk) {
                Ok(n) => n,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if lblk == first {
                let meta = self.meta_goal(st, self.group_of_inode(ino));
                for _ in 0..need {
                    match self.alloc_block(op, st, meta, BlockUse::Meta) {
                        Ok((b, a)) => {
                            pre.insert(0, (b, a));
                        }
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                if result.is_err() {
                    break;
                }
                leaf = Some(key);
            } else if need > 0 && leaf.as_ref() != Some(&key) {
                break;
            }
            match self.alloc_block(op, st, *goal, BlockUse::Data) {
                Ok((b, a)) => {
                    *goal = b + 1;
                    stretch.push((lblk, b, a));
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // The bytes of `data` that land in logical block `lblk`, and where.
        let piece = |lblk: u64| -> (usize, &[u8]) {
            let b0 = (lblk * bs).max(pos);
            let b1 = ((lblk + 1) * bs).min(end);
            (
                (b0 - lblk * bs) as usize,
                &data[(b0 - offset) as usize..(b1 - offset) as usize],
            )
        };
        // An allocation that failed (a full disk) ends the stretch; what was allocated
        // before it is still written (a short write), and the error reported after.
        let stop = std::mem::replace(&mut result, Ok(()));
        let mut mapped = 0;
        let mut done = 0usize;
        let mut i = 0;
        while i < stretch.len() && result.is_ok() {
            let mut j = i + 1;
            while j < stretch.len() && stretch[j].1 == stretch[j - 1].1 + 1 {
                j += 1;
            }
            let mut bytes = vec![0u8; (j - i) * bs as usize];
            let mut befores = Vec::new();
            for (k, &(lblk, blk, _)) in stretch[i..j].iter().enumerate() {
                let (at, src) = piece(lblk);
                let o = k * bs as usize + at;
                bytes[o..o + src.len()].copy_from_slice(src);
                befores.extend(st.frees.block(blk));
            }
            let heads = match op
                .tx
                .write_run(stretch[i].1 as u64, &bytes, &befores, true)
                .map_err(Self::io)
            {
                Ok(r) => r,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            for (&(lblk, blk, alloc), &init) in stretch[i..j].iter().zip(&heads) {
                let mapped_now = self.bmap_map(
                    op,
                    st,
                    ino,
                    inode,
                    lblk,
                    blk,
                    &[alloc, init],
                    &mut pre,
                    Some(deferred),
                );
                match mapped_now {
                    Ok(h) => self.track(st, ino, Some(h)),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                mapped += 1;
                done += piece(lblk).1.len();
            }
            i = j;
        }
        if result.is_ok() {
            result = stop;
        }
        // Allocated but never mapped (an error above): not ours after all.
        let unused = pre.iter().map(|&(b, _)| b);
        for blk in stretch[mapped..].iter().map(|&(_, b, _)| b).chain(unused) {
            if let Err(e) = self.free_block(op, st, blk, None) {
                tracing::warn!("freeing unmapped block {blk} after an error: {e}");
            }
        }
        (done, result)
    }

    /// Where to put logical block `lblk`: after the previous block of the file, or where
    /// the inode's group keeps file data (`data_goal`).
    fn goal_for(&self, st: &State, ino: u32, inode: &Inode, lblk: u64) -> u32 {
        if lblk > 0 {
            if let Ok(p) = self.bmap(inode, lblk - 1) {
                if p != 0 {
                    return p + 1;
                }
            }
        }
        self.data_goal(st, self.group_of_inode(ino))
    }

    /// Frees every block of logical blocks `from..to`, and each indirect block whose whole
    /// range lies inside (indirect blocks only partly inside stay, as the kernel leaves
    /// them). Pointers inside indirect blocks that stay are cleared first; `inode` gets its
    /// cleared slots, and the caller writes it after the cleared pointers (`clears`) and
    /// frees `frees` after both.
    fn cut_tree(
        &self,
        op: &Op<'_>,
        inode: &mut Inode,
        (from, to): (u64, u64),
        frees: &mut Vec<u32>,
        clears: &mut Vec<PatchId>,
    ) -> Result<()> {
        let p = self.ptrs();
        for slot in 0..NDIR_BLOCKS {
            if (from..to).contains(&(slot as u64)) && inode.block[slot] != 0 {
                frees.push(inode.block[slot]);
                inode.block[slot] = 0;
            }
        }
        let spans = [
            (IND_BLOCK, 1u32, NDIR_BLOCKS as u64, p),
            (DIND_BLOCK, 2, NDIR_BLOCKS as u64 + p, p * p),
            (TIND_BLOCK, 3, NDIR_BLOCKS as u64 + p + p * p, p * p * p),
        ];
        for (slot, level, start, span) in spans {
            let blk = inode.block[slot];
            if blk == 0 || start + span <= from || start >= to {
                continue;
            }
            self.check_data_block(blk)?;
            if from <= start && start + span <= to {
                self.collect_subtree(blk, level, frees)?;
                inode.block[slot] = 0;
            } else if self.cut_subtree(op, blk, level, start, (from, to), frees, clears)? {
                // Nothing left below it: the map block goes too.
                frees.push(blk);
                inode.block[slot] = 0;
            }
        }
        Ok(())
    }

    /// All blocks of the subtree at `blk` (an indirect block of `level`), itself included.
    fn collect_subtree(&self, blk: u32, level: u32, frees: &mut Vec<u32>) -> Result<()> {
        self.check_data_block(blk)?;
        let ptrs: Vec<u32> = self
            .engine()
            .with_block(blk as u64, |d| {
                (0..d.len() / 4)
                    .map(|i| le32(d, i * 4))
                    .filter(|&x| x != 0)
                    .collect()
            })
            .map_err(Self::io)?;
        for c in ptrs {
            self.check_data_block(c)?;
            if level > 1 {
                self.collect_subtree(c, level - 1, frees)?;
            } else {
                frees.push(c);
            }
        }
        frees.push(blk);
        Ok(())
    }

    /// Cuts the part of the subtree at `blk` (covering logical blocks from `start`) inside
    /// `from..to`, clearing the pointers in `blk` itself. Returns whether `blk` points at
    /// nothing any more: the caller frees it and clears its pointer (a map block that a
    /// punched hole or an undone allocation emptied is not kept).
    #[allow(clippy::too_many_arguments)]
    fn cut_subtree(
        &self,
        op: &Op<'_>,
        blk: u32,
        level: u32,
        start: u64,
        (from, to): (u64, u64),
        frees: &mut Vec<u32>,
        clears: &mut Vec<PatchId>,
    ) -> Result<bool> {
        let p = self.ptrs();
        let child_span = p.pow(level - 1);
        let mut img = self.engine().read(blk as u64).map_err(Self::io)?;
        let mut changed = false;
        for i in 0..p as usize {
            let c = le32(&img, i * 4);
            let cstart = start + i as u64 * child_span;
            if c == 0 || cstart + child_span <= from || cstart >= to {
                continue;
            }
            self.check_data_block(c)?;
            if from <= cstart && cstart + child_span <= to {
                if level > 1 {
                    self.collect_subtree(c, level - 1, frees)?;
                } else {
                    frees.push(c);
                }
                put32(&mut img, i * 4, 0);
                changed = true;
            } else if self.cut_subtree(op, c, level - 1, cstart, (from, to), frees, clears)? {
                frees.push(c);
                put32(&mut img, i * 4, 0);
                changed = true;
            }
        }
        let empty = img.chunks_exact(4).all(|w| w == [0; 4]);
        if changed && !empty {
            if let Some(h) = self.put(op, blk, 0, &img, &[], false)? {
                clears.push(h);
            }
        }
        Ok(empty)
    }

    /// Frees logical blocks `range` of `ino` and writes the inode (with `inode`'s other
    /// changes) after the cleared pointers; the blocks are freed after both.
    fn free_range(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        range: (u64, u64),
    ) -> Result<Head> {
        let bs = self.geo.bs;
        let mut frees = Vec::new();
        let mut clears = Vec::new();
        self.cut_tree(op, inode, range, &mut frees, &mut clears)?;
        inode.blocks = inode.blocks.saturating_sub(frees.len() as u32 * (bs / 512));
        let head = self.write_inode(op, st, ino, inode, &clears)?;
        for h in &clears {
            self.track(st, ino, Some(*h));
        }
        // The blocks are unreachable once the inode (and the cleared pointers) are on
        // disk.
        let mut all = clears.clone();
        all.extend(head);
        let after = self.join(&all.iter().map(|&x| Some(x)).collect::<Vec<_>>());
        self.free_blocks(op, st, &mut frees, after)?;
        self.track(st, ino, head);
        Ok(head)
    }

    /// fallocate(2): PUNCH_HOLE|KEEP_SIZE frees the blocks inside the range and zeroes
    /// the partial ones at its edges, as the kernel does for block-mapped files;
    /// preallocation (mode 0, or KEEP_SIZE inside the file) allocates zeroed blocks for
    /// the holes in the range — beyond the kernel, which refuses it on such files — so
    /// later writes there cannot fail for space. ext2 has no unwritten blocks, so the
    /// zeros are written, and no blocks may lie past the size (e2fsck would object):
    /// KEEP_SIZE past the end is refused. Other modes are not supported.
    pub(crate) fn do_fallocate(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<()> {
        const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        if mode & !(KEEP_SIZE | PUNCH) != 0 || mode == PUNCH {
            return Err(FsError::NotSupported);
        }
        if length == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes"));
        }
        let mut inode = self.read_live_inode(st, ino)?;
        if inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if !inode.is_reg() {
            return Err(FsError::NoDevice);
        }
        let flags = inode.flags;
        if flags & quilt_vfs::flags::IMMUTABLE != 0
            || (flags & quilt_vfs::flags::APPEND != 0 && mode & PUNCH != 0)
        {
            return Err(FsError::Perm);
        }
        let bs = self.geo.bs as u64;
        let end = offset.saturating_add(length);
        if mode & PUNCH != 0 {
            // Past the size, up to the end of the last block (its bytes past the size are
            // zeros already), as the kernel rounds.
            let end = end.min(inode.size.div_ceil(bs) * bs);
            if offset >= end {
                return Ok(());
            }
            // Whole blocks inside are freed; the partial ones at the edges keep their
            // other bytes.
            let (first_full, last_full) = (offset.div_ceil(bs), end / bs);
            let partial = if first_full > last_full {
                vec![(offset, end)]
            } else {
                [(offset, first_full * bs), (last_full * bs, end)]
                    .into_iter()
                    .filter(|(a, b)| a < b)
                    .collect()
            };
            for (from, to) in partial {
                let phys = self.bmap(&inode, from / bs)?;
                if phys != 0 {
                    let zeros = vec![0u8; (to - from) as usize];
                    let h = self.put(op, phys, (from % bs) as usize, &zeros, &[], true)?;
                    self.track(st, ino, h);
                }
            }
            Self::touch_times(&mut inode, true, true);
            self.free_range(
                op,
                st,
                ino,
                &mut inode,
                (first_full, last_full.max(first_full)),
            )?;
            return Ok(());
        }
        if end > self.max_file_size() {
            return Err(FsError::TooBig);
        }
        if mode & KEEP_SIZE != 0 && end > inode.size.div_ceil(bs) * bs {
            return Err(FsError::NotSupported);
        }
        let zeros = vec![0u8; bs as usize];
        let mut goal = self.goal_for(st, ino, &inode, offset / bs);
        let mut deferred: Vec<PatchId> = Vec::new();
        let mut result = Ok(());
        let size_at_start = inode.size;
        // The blocks this call mapped, in order: one that fails gives them back.
        let mut mapped: Vec<u64> = Vec::new();
        let keep = mode & KEEP_SIZE != 0;
        for lblk in offset / bs..end.div_ceil(bs) {
            match self.bmap(&inode, lblk) {
                Ok(0) => {}
                Ok(p) => {
                    goal = p + 1;
                    continue;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            // The size covers the block before it is mapped: a map block's pointer may
            // reach the disk with the inode written for it (soft updates: the size on
            // disk may be too high for a moment, never too low for a mapped block).
            let size_before = inode.size;
            if !keep {
                inode.size = inode.size.max(((lblk + 1) * bs).min(end));
            }
            match self.bmap_alloc(
                op,
                st,
                ino,
                &mut inode,
                lblk,
                &zeros,
                &[],
                true,
                goal,
                Some(&mut deferred),
            ) {
                Ok((b, h)) => {
                    goal = b + 1;
                    mapped.push(lblk);
                    self.track(st, ino, Some(h));
                }
                Err(e) => {
                    inode.size = size_before;
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_err() {
            // All or nothing: a preallocation that runs out gives back what it took
            // (the kernel's ext4 keeps it, and grows the size over it; a caller that
            // got ENOSPC is then left with a file it did not ask for). The size is as
            // it was, which covers no block this call mapped.
            inode.size = size_at_start;
            let mut i = 0;
            while i < mapped.len() {
                let mut j = i + 1;
                while j < mapped.len() && mapped[j] == mapped[j - 1] + 1 {
                    j += 1;
                }
                self.free_range(op, st, ino, &mut inode, (mapped[i], mapped[j - 1] + 1))?;
                i = j;
            }
        } else if !keep {
            inode.size = inode.size.max(end);
        }
        Self::touch_times(&mut inode, false, true);
        let h = self.write_inode(op, st, ino, &inode, &deferred)?;
        self.track(st, ino, h);
        result
    }

    /// Shrinks or grows `ino` to `size`; writes the inode (with `inode`'s other changes).
    pub(crate) fn truncate(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        size: u64,
    ) -> Result<Head> {
        if size > self.max_file_size() {
            return Err(FsError::TooBig);
        }
        let bs = self.geo.bs as u64;
        if size < inode.size && inode.has_block_map() {
            // Zero the tail of the last kept block, so a later extension reads zeros.
            if size % bs != 0 {
                let phys = self.bmap(inode, size / bs)?;
                if phys != 0 {
                    let off = (size % bs) as usize;
                    let zeros = vec![0u8; bs as usize - off];
                    let h = self.put(op, phys, off, &zeros, &[], true)?;
                    self.track(st, ino, h);
                }
            }
            let from = size.div_ceil(bs);
            inode.size = size;
            return self.free_range(op, st, ino, inode, (from, u64::MAX));
        }
        inode.size = size;
        let h = self.write_inode(op, st, ino, inode, &[])?;
        self.track(st, ino, h);
        Ok(h)
    }

    /// Brings into the cache what freeing `ino` reads: the indirect blocks of its map
    /// and the bitmaps its blocks and its inode are counted in. Reads with no lock of the
    /// module held, so the free that follows holds the exclusive lock without waiting
    /// for the device. The last release of an unlinked file runs beside other requests
    /// (at FORGET, during `rm -rf`): read under the lock, each indirect block stalled
    /// every request for a device read. Only a hint: the free reads whatever is still
    /// missing (or was changed meanwhile) itself.
    pub(crate) fn warm_free(&self, ino: u32) {
        let Ok(inode) = self.reading(1, |st| self.read_inode(st, ino)) else {
            return;
        };
        // The blocks it will free, found as the free finds them (`collect_subtree`
        // reads each indirect block through the engine, which caches it); then their
        // groups' bitmaps.
        let mut blocks = Vec::new();
        if inode.has_block_map() {
            for (slot, &b) in inode.block.iter().enumerate() {
                match slot {
                    _ if b == 0 => {}
                    IND_BLOCK | DIND_BLOCK | TIND_BLOCK => {
                        let level = (slot - IND_BLOCK + 1) as u32;
                        let _ = self.collect_subtree(b, level, &mut blocks);
                    }
                    _ => blocks.push(b),
                }
            }
        }
        let groups: std::collections::BTreeSet<u32> = blocks
            .into_iter()
            .filter(|&b| self.check_data_block(b).is_ok())
            .map(|b| self.group_of_block(b))
            .collect();
        let bitmaps: Vec<u32> = {
            let st = self.read_lock();
            let mut v: Vec<u32> = groups
                .iter()
                .filter_map(|&g| st.gd.get(g as usize).map(|d| d.block_bitmap))
                .collect();
            if let Some(d) = st.gd.get(self.group_of_inode(ino) as usize) {
                v.push(d.inode_bitmap);
            }
            v
        };
        for b in bitmaps {
            let _ = self.engine().with_block(b as u64, |_| ());
        }
    }

    /// Frees an inode whose last name is gone, and its blocks, after `removal` (the patch
    /// that removed its entry): the cleared inode waits for the removal, the bitmap frees
    /// wait for the cleared inode. Returns the patch clearing it.
    pub(crate) fn destroy_inode(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        removal: Head,
    ) -> Result<Head> {
        let inode = self.read_inode(st, ino)?;
        let mut frees = Vec::new();
        if inode.has_block_map() {
            let mut copy = inode.clone();
            let mut clears = Vec::new();
            self.cut_tree(op, &mut copy, (0, u64::MAX), &mut frees, &mut clears)?;
        }
        if inode.file_acl != 0 {
            frees.push(inode.file_acl);
        }
        let cleared = self.clear_inode(op, st, ino, &removal.into_iter().collect::<Vec<_>>())?;
        let after = cleared.or(removal);
        self.free_blocks(op, st, &mut frees, after)?;
        self.free_inode(op, st, ino, inode.is_dir(), after)?;
        st.syncs.forget(ino);
        st.counters.inodes_freed += 1;
        Ok(after)
    }

    /// Setattr. A change of owner or group of anything but a directory drops set-user-ID,
    /// and set-group-ID where group execute is on, as Linux does even for root (the
    /// FUSE adapter relies on this: it tells the kernel the file system kills them).
    pub(crate) fn do_setattr(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        set: SetAttr,
    ) -> Result<quilt_vfs::Attr> {
        let mut inode = self.read_live_inode(st, ino)?;
        quilt_vfs::rules::refuse_setattr(inode.flags, &set)?;
        let now = Inode::split_time(Timespec::now());
        if let Some(mode) = set.mode {
            inode.mode = (inode.mode & libc::S_IFMT as u16) | (mode & 0o7777) as u16;
        }
        if let Some(uid) = set.uid {
            inode.uid = uid;
        }
        if let Some(gid) = set.gid {
            inode.gid = gid;
        }
        if (set.uid.is_some() || set.gid.is_some()) && set.mode.is_none() && !inode.is_dir() {
            inode.mode = kill_suid_sgid(inode.mode);
        }
        if let Some(t) = set.atime {
            (inode.atime, inode.atime_extra) = Inode::split_time(t.resolve());
        }
        if let Some(t) = set.mtime {
            (inode.mtime, inode.mtime_extra) = Inode::split_time(t.resolve());
        }
        (inode.ctime, inode.ctime_extra) = match set.ctime {
            Some(t) => Inode::split_time(t),
            None => now,
        };
        if set.mode.is_some() {
            // chmod rewrites the access ACL's base entries with the mode, in the same
            // inode write where the ACL lives in the inode.
            if let Some(c) = self.acl_chmod(st, ino, &inode)? {
                self.apply_xattrs(op, st, ino, &mut inode, &[c], &[])?;
                if set.size.is_none() {
                    return self.attr(st, ino);
                }
            }
        }
        if let Some(size) = set.size {
            if inode.is_dir() {
                return Err(FsError::IsDir);
            }
            if !inode.is_reg() {
                return Err(FsError::Invalid("truncate of a non-regular file"));
            }
            if size != inode.size && set.mtime.is_none() {
                (inode.mtime, inode.mtime_extra) = now;
            }
            self.truncate(op, st, ino, &mut inode, size)?;
        } else {
            let h = self.write_inode(op, st, ino, &inode, &[])?;
            self.track(st, ino, h);
        }
        self.attr(st, ino)
    }

    pub(crate) fn do_readlink(&self, st: &State, ino: u32) -> Result<Vec<u8>> {
        let inode = self.read_live_inode(st, ino)?;
        if !inode.is_symlink() {
            return Err(FsError::Invalid("not a symbolic link"));
        }
        let len = inode.size as usize;
        if inode.is_fast_symlink() {
            let mut raw = [0u8; 60];
            for (i, v) in inode.block.iter().enumerate() {
                put32(&mut raw, i * 4, *v);
            }
            return Ok(raw[..len].to_vec());
        }
        if len >= self.geo.bs as usize {
            return Err(corrupt(format!("symlink {ino} has length {len}")));
        }
        let phys = self.bmap(&inode, 0)?;
        if phys == 0 {
            return Err(corrupt(format!("slow symlink {ino} has no block")));
        }
        self.engine()
            .with_block(phys as u64, |d| d[..len].to_vec())
            .map_err(Self::io)
    }
}

pub(crate) fn kill_suid_sgid(mode: u16) -> u16 {
    quilt_vfs::rules::kill_suid_sgid(mode as u32) as u16
}

/// See [`Ext2::max_file_size`].
pub(crate) fn max_file_size(bs: u32) -> u64 {
    let bits = bs.trailing_zeros();
    let ppb = bs as u64 / 4;
    let limit = ((1u64 << 32) - 1) >> (bits - 9);
    let reach = NDIR_BLOCKS as u64 + ppb + ppb * ppb + ppb * ppb * ppb;
    let full_map = 1 + (1 + ppb) + (1 + ppb + ppb * ppb);
    let blocks = if reach + full_map <= limit {
        reach
    } else {
        // Data blocks d and map blocks m(d) with d + m(d) = limit: count the map blocks
        // that addressing `limit` blocks would need and take them off.
        let mut rest = limit - NDIR_BLOCKS as u64 - ppb;
        let mut map = 1;
        if rest < ppb * ppb {
            map += 1 + rest.div_ceil(ppb);
        } else {
            map += 1 + ppb;
            rest -= ppb * ppb;
            map += 1 + rest.div_ceil(ppb) + rest.div_ceil(ppb * ppb);
        }
        limit - map
    };
    (blocks << bits).min(i64::MAX as u64)
}
