//! File data: reads as range scans, writes as puts and upserts, truncation and hole
//! punching as deletes, and the count of blocks present.

use crate::fs::{io, Betrfs, Node, POINT_DELETES_MAX};
use crate::keys::{self, Loc};
use crate::record::BLOCK;
use quilt_betree::{truncate_arg, write_at_arg, Batch, TRUNCATE, WRITE_AT};
use quilt_vfs::{FsError, Result};
use std::sync::atomic::Ordering::Relaxed;

impl Betrfs {
    /// Deletes the data of a file of `size` bytes: its blocks are all below the size.
    pub(crate) fn delete_data(&self, b: &mut Batch, loc: &Loc, size: u64) {
        self.delete_blocks(b, loc, 0, size);
    }

    /// Deletes blocks `from..` of a file of `size` bytes: a few point deletes for a
    /// small file (cheap messages that supersede the puts they meet), one range delete
    /// for a larger one (a buffer's range deletes are searched one by one, so a
    /// million-file `rm -rf` must not leave one per file).
    pub(crate) fn delete_blocks(&self, b: &mut Batch, loc: &Loc, from: u64, size: u64) {
        self.counters.range_deletes.fetch_add(1, Relaxed);
        let end = size.div_ceil(BLOCK);
        self.freeing.deleted(end.saturating_sub(from));
        if end.saturating_sub(from) <= POINT_DELETES_MAX {
            for blk in from..end {
                b.delete(&loc.data_key(blk));
            }
        } else {
            b.delete_range(&loc.data_key(from), &keys::prefix_end(&loc.data_prefix()));
        }
    }

    /// Appends up to `size` bytes at `offset` to `out` (short only at end of file): the
    /// blocks present are copied in key order and only the holes between them are
    /// zeroed, so a reused buffer costs no allocation, page fault or `memset` of bytes
    /// that are then overwritten.
    pub(crate) fn read_data_into(
        &self,
        n: &Node,
        offset: u64,
        size: u32,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        let len = n.inode.size;
        if offset >= len || size == 0 {
            return Ok(());
        }
        let end = len.min(offset + size as u64);
        let start = buf.len();
        buf.reserve((end - offset) as usize);
        let first = offset / BLOCK;
        let last = (end - 1) / BLOCK;
        // Bytes of the file `offset..` appended so far: `buf.len() - start`.
        let mut place = |blk: u64, v: &[u8]| -> Result<()> {
            let bstart = blk * BLOCK;
            let from = offset.max(bstart);
            // (A value longer than its block, which fsck reports, is cut at the block.)
            let to = end.min(bstart + (v.len() as u64).min(BLOCK));
            if from < to {
                let at = start + (from - offset) as usize;
                if buf.len() > at {
                    return Err(FsError::Corrupt("data blocks out of order".into()));
                }
                buf.resize(at, 0);
                buf.extend_from_slice(&v[(from - bstart) as usize..(to - bstart) as usize]);
            }
            Ok(())
        };
        if first == last {
            if let Some(v) = self.tree.get(&n.loc.data_key(first)).map_err(io)? {
                place(first, &v)?;
            }
        } else {
            let prefix = n.loc.data_prefix();
            let lo = n.loc.data_key(first);
            let hi = n.loc.data_key(last + 1);
            // Lent entries: copying each block out of the chunk into vectors of its own
            // cost two allocations per block, and page faults on the fresh memory.
            let mut it = self.tree.range(&lo, Some(&hi));
            while let Some(kv) = it.next_entry() {
                let (k, v) = kv.map_err(io)?;
                let blk = keys::block_of(&prefix, k)
                    .ok_or_else(|| FsError::Corrupt("a data key of the wrong length".into()))?;
                place(blk, v)?;
            }
        }
        // The hole at the end, if any (and a block shorter than its place).
        buf.resize(start + (end - offset) as usize, 0);
        Ok(())
    }

    /// Data messages for `data` at `offset`: whole blocks are puts, parts of blocks are
    /// upserts (no read of the old block). Counts the blocks it adds into `n.inode`.
    pub(crate) fn write_msgs(
        &self,
        b: &mut Batch,
        n: &mut Node,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let mut pos = offset;
        let end = offset + data.len() as u64;
        while pos < end {
            let blk = pos / BLOCK;
            let in_off = pos % BLOCK;
            let len = (BLOCK - in_off).min(end - pos);
            let src = &data[(pos - offset) as usize..(pos - offset + len) as usize];
            if !self.present(n, blk)? {
                n.inode.blocks += 1;
            }
            if len == BLOCK {
                b.put(&n.loc.data_key(blk), src);
                self.counters.block_puts.fetch_add(1, Relaxed);
            } else {
                b.upsert(&n.loc.data_key(blk), WRITE_AT, &write_at_arg(in_off, src));
                self.counters.upsert_writes.fetch_add(1, Relaxed);
            }
            // Written blocks extend the size as the loop goes, so `present` sees them.
            n.inode.size = n.inode.size.max(pos + len);
            pos += len;
        }
        Ok(())
    }

    /// Whether block `blk` of the file has a key. Free for a dense file (every block
    /// below the size is there, none past it); a sparse file asks the tree.
    pub(crate) fn present(&self, n: &Node, blk: u64) -> Result<bool> {
        let within = n.inode.size.div_ceil(BLOCK);
        if blk >= within {
            return Ok(false);
        }
        if n.inode.blocks >= within {
            return Ok(true);
        }
        // The key alone: a point get would read the block's value (a cold leaf's
        // basement) only to learn that it is there.
        let key = n.loc.data_key(blk);
        let mut after = key.clone();
        after.push(0);
        let mut probe = self.tree.keys(&key, Some(&after)).limit(1);
        Ok(probe.next_key().transpose().map_err(io)?.is_some())
    }

    /// How many of blocks `from..to` the file has.
    pub(crate) fn present_in(&self, n: &Node, from: u64, to: u64) -> Result<u64> {
        let within = n.inode.size.div_ceil(BLOCK);
        let to = to.min(within);
        if from >= to {
            return Ok(0);
        }
        if n.inode.blocks >= within {
            return Ok(to - from);
        }
        let mut c = 0;
        let mut keys = self
            .tree
            .keys(&n.loc.data_key(from), Some(&n.loc.data_key(to)));
        while let Some(k) = keys.next_key() {
            k.map_err(io)?;
            c += 1;
        }
        Ok(c)
    }

    /// Truncation messages from `old` bytes to `new`.
    pub(crate) fn truncate_msgs(&self, b: &mut Batch, loc: &Loc, old: u64, new: u64) {
        if new >= old {
            return;
        }
        self.delete_blocks(b, loc, new.div_ceil(BLOCK), old);
        if new % BLOCK != 0 {
            b.upsert(
                &loc.data_key(new / BLOCK),
                TRUNCATE,
                &truncate_arg(new % BLOCK),
            );
        }
    }

    /// The first block at or after `from` not present (the file's block count if
    /// every one is).
    pub(crate) fn first_absent(&self, n: &Node, from: u64) -> Result<u64> {
        let last = n.inode.size.div_ceil(BLOCK);
        self.tree
            .first_absent(&n.loc.data_prefix(), from, last)
            .map_err(io)
    }

    /// The first block present at or after `from` (below the file's end).
    pub(crate) fn next_present(&self, n: &Node, from: u64) -> Result<Option<u64>> {
        let prefix = n.loc.data_prefix();
        let last = n.inode.size.div_ceil(BLOCK);
        let mut keys = self
            .tree
            .keys(&n.loc.data_key(from), Some(&n.loc.data_key(last)))
            .limit(1);
        match keys.next_key() {
            None => Ok(None),
            Some(k) => {
                let (k, _) = k.map_err(io)?;
                keys::block_of(&prefix, k)
                    .map(Some)
                    .ok_or_else(|| FsError::Corrupt("a data key of the wrong length".into()))
            }
        }
    }
}
