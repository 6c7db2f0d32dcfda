//! Clones: a file's blocks into another file, or a whole tree under a new name, by
//! range clones of the Bε-tree (`Batch::clone_range`: the tree's nodes are shared until
//! one side changes them), each one atomic batch whatever it covers.
//!
//! A file's data keys are its data prefix and a block number, so a range of blocks can
//! be shared only at the same block numbers: a clone between equal offsets shares, one
//! between different offsets is refused (FICLONERANGE) or copied (copy_file_range).
//!
//! A tree clone copies the records below the tree unchanged (shared), so the copies
//! would have the originals' inode numbers: the copy's top gets a new namespace (see
//! `fs.rs`, "Inode numbers"), which every unmarked record below it takes. What the index
//! lists below the tree is fixed in the same batch: each marker's copy gets a namespace
//! of its own, each inode that link stubs name gets a copy under a new number (its data
//! shared), and the copies of open unlinked files' data (orphans) are dropped.

use crate::fs::{check_name, io, now, Betrfs, Node, MAX_FILE_SIZE};
use crate::keys::{self, Loc};
use crate::record::{self, Entry, BLOCK};
use quilt_betree::Batch;
use quilt_vfs::{flags, rules, Attr, Ctx, FileSystem, FsError, Result, R_OK, W_OK, X_OK};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// Bytes a tree clone's fixes (markers, stubs, copied inodes) may take in its batch.
const FIXES_MAX: usize = 1 << 20;

/// The 8-byte suffix of block `blk`'s data key.
fn blk(b: u64) -> [u8; 8] {
    b.to_be_bytes()
}

impl Betrfs {
    /// Checks that `n` is a regular file (what FICLONE's file arguments must be).
    fn regular(n: &Node) -> Result<()> {
        if n.inode.is_dir() {
            Err(FsError::IsDir)
        } else if !n.inode.is_reg() {
            Err(FsError::Invalid(
                "a clone of something other than a regular file",
            ))
        } else {
            Ok(())
        }
    }

    /// FICLONE / FICLONERANGE (`FileSystem::clone_file`).
    pub(crate) fn clone_blocks(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
        ctx: &Ctx,
    ) -> Result<u64> {
        let r = (|| {
            let mut st = self.lock();
            self.writable(&st)?;
            let s = self.node(&mut st, src)?.clone();
            let d = self.node(&mut st, dst)?.clone();
            Self::regular(&s)?;
            Self::regular(&d)?;
            drop(st);
            self.access(src, R_OK, ctx)?;
            self.access(dst, W_OK, ctx)?;
            // (Before the state is taken: see `room`.)
            self.room(BLOCK)?;
            let mut st = self.lock();
            let s = self.node(&mut st, src)?.clone();
            let mut d = self.node(&mut st, dst)?.clone();
            if d.inode.flags & (flags::IMMUTABLE | flags::APPEND) != 0 {
                return Err(FsError::Perm);
            }
            // The kernel's rules for remapping (generic_remap_file_range_prep).
            let size = s.inode.size;
            if src_off > size {
                return Err(FsError::Invalid("a clone starting past the source's end"));
            }
            let mut len = if len == 0 {
                size - src_off
            } else {
                len.min(size - src_off)
            };
            let at_eof = src_off + len == size;
            if !at_eof {
                len -= len % BLOCK;
            }
            if src_off % BLOCK != 0 || dst_off % BLOCK != 0 {
                return Err(FsError::Invalid("clone offsets must be multiples of 4096"));
            }
            if at_eof && len % BLOCK != 0 && dst_off + len < d.inode.size {
                return Err(FsError::Invalid(
                    "a clone would put the source's partial last block inside the destination",
                ));
            }
            if dst_off.saturating_add(len) > MAX_FILE_SIZE {
                return Err(FsError::TooBig);
            }
            if src == dst {
                let overlap = src_off < dst_off + len && dst_off < src_off + len;
                return Err(if overlap {
                    FsError::Invalid("clone ranges of one file overlap")
                } else {
                    FsError::NotSupported
                });
            }
            if src_off != dst_off {
                // Blocks are keyed by their number: they are shared only in place.
                return Err(FsError::NotSupported);
            }
            if len == 0 {
                return Ok(0);
            }
            let (a, b) = (src_off / BLOCK, (src_off + len).div_ceil(BLOCK));
            let mut batch = Batch::new();
            let (from, to) = (s.loc.data_prefix(), d.loc.data_prefix());
            let blocks_after =
                d.inode.blocks - self.present_in(&d, a, b)? + self.present_in(&s, a, b)?;
            if a == 0 && d.inode.size.div_ceil(BLOCK) <= b {
                // Everything the destination has is replaced: the whole prefix (one cut
                // fewer in the tree).
                batch.clone_prefix(&from, &to);
            } else {
                batch.clone_range(&from, &to, &blk(a), Some(&blk(b)));
            }
            let t = now();
            d.inode.size = d.inode.size.max(dst_off + len);
            d.inode.blocks = blocks_after;
            d.inode.mtime = t;
            d.inode.ctime = t;
            if ctx.uid != 0 {
                // As a write by an unprivileged caller.
                d.inode.mode = rules::kill_suid_sgid(d.inode.mode);
            }
            Self::put_inode(&mut batch, &d);
            self.commit(&mut st, batch)?;
            st.nodes.insert(dst, d);
            self.counters.clones.fetch_add(1, Relaxed);
            Ok(len)
        })();
        self.checked(r)
    }

    /// copy_file_range(2): the block-aligned middle of the range shared when both
    /// offsets are equal (and the files differ), the rest copied.
    pub(crate) fn copy_range(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
        ctx: &Ctx,
    ) -> Result<u64> {
        let (s, d) = {
            let mut st = self.lock();
            self.writable(&st)?;
            let s = self.node(&mut st, src)?.clone();
            let d = self.node(&mut st, dst)?.clone();
            (s, d)
        };
        Self::regular(&s)?;
        Self::regular(&d)?;
        let size = s.inode.size;
        if src_off >= size || len == 0 {
            return Ok(0);
        }
        let n = len.min(size - src_off);
        let end = src_off + n;
        let mut done = 0u64;
        if src != dst && src_off == dst_off {
            let a = src_off.next_multiple_of(BLOCK);
            // The source's partial last block may be shared only where it ends the
            // destination as well.
            let b = if end == size && d.inode.size <= end {
                end
            } else {
                end - end % BLOCK
            };
            if a < b {
                self.copy_bytes(src, src_off, dst, dst_off, a - src_off, ctx)?;
                let shared = self.clone_blocks(src, a, dst, a, b - a, ctx)?;
                done = a - src_off + shared;
            }
        }
        if done < n {
            self.copy_bytes(src, src_off + done, dst, dst_off + done, n - done, ctx)?;
        }
        self.counters.copied_ranges.fetch_add(1, Relaxed);
        Ok(n)
    }

    /// Copies bytes by reads and writes, a batch's worth at a time.
    fn copy_bytes(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
        ctx: &Ctx,
    ) -> Result<()> {
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(self.batch_bytes as u64) as u32;
            let data = self.read(src, src_off + done, want)?;
            if data.is_empty() {
                break;
            }
            let n = self.write(dst, dst_off + done, &data, ctx)?;
            done += n as u64;
        }
        Ok(())
    }

    /// `quiltfs clone` (`FileSystem::clone_tree`).
    pub(crate) fn clone_subtree(
        &self,
        src: u64,
        new_parent: u64,
        new_name: &[u8],
        ctx: &Ctx,
    ) -> Result<Attr> {
        check_name(new_name)?;
        self.access(new_parent, W_OK | X_OK, ctx)?;
        let r = (|| {
            self.room(BLOCK)?;
            let mut st = self.lock();
            self.writable(&st)?;
            let s = self.node(&mut st, src)?.clone();
            if ctx.uid != 0 && ctx.uid != s.inode.uid {
                // A copy of a tree holds what its owner can read: its owner (or root)
                // makes it.
                return Err(FsError::Perm);
            }
            if s.inode.nlink == 0 {
                return Err(FsError::NotFound);
            }
            self.fit_name(&mut st, new_parent, new_name.len())?;
            let (dkey, existing) = self.lookup_in(&mut st, new_parent, new_name)?;
            if existing.is_some() {
                return Err(FsError::Exists);
            }
            self.key_fits(&dkey)?;
            let dp = self.dir_node(&mut st, new_parent)?.clone();
            if dp.inode.nlink == 0 {
                return Err(FsError::NotFound);
            }
            rules::refuse_new_entry(dp.inode.flags)?;
            let is_dir = s.inode.is_dir();
            if is_dir && dp.inode.nlink >= crate::fs::LINK_MAX {
                return Err(FsError::TooManyLinks);
            }
            if let Loc::Path(dp_key) = dp.loc.clone() {
                if is_dir && self.is_within(&mut st, &s, new_parent, &dp_key)? {
                    return Err(FsError::Invalid("a tree cannot be cloned into itself"));
                }
            }
            // (A copied tree is a zone of its own: nothing lands below its key.)
            self.evict_orphans(&mut st, &dkey, false)?;
            let t = now();
            let mut b = Batch::new();
            let mut top = s.inode.clone();
            top.ctime = t;
            top.nlink = if is_dir { s.inode.nlink } else { 1 };
            if is_dir {
                if !matches!(s.loc, Loc::Path(_)) {
                    return Err(FsError::Corrupt(format!("directory {src} has no path")));
                }
                let ns = Self::new_ns(&mut st)?;
                top.ino = record::compose(ns, top.ino);
                top.marker = Some(ns);
                // The copy is a zone's root (its keys start again from it: a tree copied
                // deeper than it was could outgrow the key limit otherwise).
                let from = Self::prefix_of(&s)?;
                let zone = self.new_zone(&mut st, &mut b, top.ino);
                top.zone = Some(zone);
                let to = keys::zone_prefix(zone);
                let mut ops = std::mem::take(&mut b.ops);
                self.clone_zones(&mut st, &mut b, from, to)?;
                ops.append(&mut b.ops);
                b.ops = ops;
                b.put(&keys::index_key(&dkey), b"");
            } else {
                // One file: a new inode in the directory's namespace, its data shared.
                top.ino = Self::new_ino(&mut st, new_parent)?;
                top.marker = None;
                if top.is_reg() {
                    b.clone_prefix(&s.loc.data_prefix(), &Loc::Path(dkey.clone()).data_prefix());
                }
            }
            b.put(&keys::meta_key(&dkey), &top.encode());
            let mut dp = dp;
            if is_dir {
                dp.inode.nlink += 1;
            }
            dp.inode.mtime = t;
            dp.inode.ctime = t;
            Self::put_inode(&mut b, &dp);
            b.put(
                keys::SUPER,
                &Self::super_record(&st, self.errored.load(Relaxed)),
            );
            self.commit(&mut st, b)?;
            st.nodes.insert(new_parent, dp);
            self.counters.clones.fetch_add(1, Relaxed);
            let attr = self.attr_of(&top);
            self.insert(&mut st, Loc::Path(dkey), top);
            Ok(attr)
        })();
        self.checked(r)
    }

    /// A namespace no inode has yet.
    pub(crate) fn new_ns(st: &mut crate::fs::State) -> Result<u64> {
        if st.next_ns >= record::NS_LIMIT {
            return Err(FsError::NoSpace);
        }
        st.next_ns += 1;
        Ok(st.next_ns - 1)
    }

    /// Into `b`: the tree below prefix `from` cloned to `to` (range clones of its key
    /// spaces, then the fixes), and so every zone it holds, each to a new zone of its
    /// own (`fix_clone` finds them in the index).
    fn clone_zones(
        &self,
        st: &mut crate::fs::State,
        b: &mut Batch,
        from: Vec<u8>,
        to: Vec<u8>,
    ) -> Result<()> {
        let mut work = vec![(from, to)];
        let mut fixes = Batch::new();
        // Bounded by the zones there are: each is cloned once.
        while let Some((from, to)) = work.pop() {
            for space in [keys::META, keys::DATA, keys::INDEX] {
                b.clone_prefix(
                    &[&[space], &from[..]].concat(),
                    &[&[space], &to[..]].concat(),
                );
            }
            work.extend(self.fix_clone(st, &mut fixes, &from, &to)?);
        }
        // The tree's keys after the fixes: a batch applies in order, and the fixes
        // overwrite copies the clones make.
        b.ops.append(&mut fixes.ops);
        Ok(())
    }

    /// Into `b`, for a clone of the tree below prefix `from` to `to`: what the index
    /// lists below `from` (markers, link stubs, zones' roots), fixed in the copy; the
    /// copies of orphans' data dropped. Returns the zones below to clone as well (each
    /// copy of a zone's root gets a new zone, and a namespace of its own).
    fn fix_clone(
        &self,
        st: &mut crate::fs::State,
        b: &mut Batch,
        from: &[u8],
        to: &[u8],
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut zones = Vec::new();
        let moved = |p: &[u8]| [to, &p[from.len()..]].concat();
        let lo = keys::index_key(from);
        let mut namespaces: BTreeMap<u64, u64> = BTreeMap::new();
        // Inode under its number → (its copy's number, names in the tree).
        let mut copies: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
        let mut bytes = 0usize;
        for kv in self.tree.range(&lo, Some(&keys::prefix_end(&lo))) {
            let (k, _) = kv.map_err(io)?;
            let path = &k[1..];
            let v = self
                .tree
                .get(&keys::meta_key(path))
                .map_err(io)?
                .ok_or_else(|| FsError::Corrupt("an index key names no entry".into()))?;
            let put = match Entry::decode(&v)? {
                Entry::Inode(mut i) if i.zone.is_some() => {
                    // A zone's root: its copy roots a new zone, in a namespace of its
                    // own (which the zone's unmarked records take from its record).
                    let old = i.zone.unwrap_or_default();
                    let ns = Self::new_ns(st)?;
                    i.marker = Some(ns);
                    i.ino = record::compose(ns, i.ino);
                    let z = self.new_zone(st, b, i.ino);
                    i.zone = Some(z);
                    zones.push((keys::zone_prefix(old), keys::zone_prefix(z)));
                    i.encode()
                }
                Entry::Inode(mut i) => {
                    let Some(m) = i.marker else {
                        return Err(FsError::Corrupt(
                            "an index key names an unmarked record".into(),
                        ));
                    };
                    let ns = match namespaces.get(&m) {
                        Some(&ns) => ns,
                        None => {
                            let ns = Self::new_ns(st)?;
                            namespaces.insert(m, ns);
                            ns
                        }
                    };
                    i.marker = Some(ns);
                    i.ino = record::compose(ns, i.ino);
                    i.encode()
                }
                Entry::Link { ino, mode } => {
                    let copy = match copies.get_mut(&ino) {
                        Some(c) => {
                            c.1 += 1;
                            c.0
                        }
                        None => {
                            let raw = st.next_ino;
                            if raw >= record::RAW_LIMIT {
                                return Err(FsError::NoSpace);
                            }
                            st.next_ino += 1;
                            copies.insert(ino, (raw, 1));
                            raw
                        }
                    };
                    Entry::link_stub(copy, mode)
                }
            };
            let key = keys::meta_key(&moved(path));
            bytes += key.len() + put.len();
            b.put(&key, &put);
            if bytes > FIXES_MAX {
                return Err(FsError::Io(
                    "too many hard links and nested clones in one tree to clone at once".into(),
                ));
            }
        }
        for (ino, (copy, names)) in copies {
            let v = self
                .tree
                .get(&keys::inode_key(ino))
                .map_err(io)?
                .ok_or_else(|| {
                    FsError::Corrupt(format!("link to inode {ino}, which does not exist"))
                })?;
            let mut i = record::decode_inode(&v)?;
            i.ino = copy;
            i.nlink = names;
            b.put(&keys::inode_key(copy), &i.encode());
            if i.is_reg() {
                b.clone_prefix(&Loc::Ino(ino).data_prefix(), &Loc::Ino(copy).data_prefix());
            }
        }
        // Open unlinked files' data still under a path in the tree: nothing names the
        // copy.
        let orphans: Vec<Vec<u8>> = st
            .orphan_paths
            .range(from.to_vec()..keys::prefix_end(from))
            .map(|(p, _)| p.clone())
            .collect();
        for p in orphans {
            let pre = Loc::Path(moved(&p)).data_prefix();
            b.delete_range(&pre, &keys::prefix_end(&pre));
        }
        Ok(zones)
    }
}

#[cfg(test)]
mod tests {
    use super::blk;

    #[test]
    fn block_suffixes_order_as_numbers() {
        assert!(blk(1) < blk(2) && blk(255) < blk(256) && blk(0) < blk(u64::MAX));
    }
}
