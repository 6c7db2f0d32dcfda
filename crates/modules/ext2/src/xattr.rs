//! Extended attributes: user.*, trusted.*, security.* and the POSIX ACLs
//! (system.posix_acl_access/default, see `acl.rs`), placed as the kernel's ext4 driver
//! places them on ext2 images: in the spare space at the end of an inode larger than 128
//! bytes while they fit there, else in one EA block (`i_file_acl`). A block shared with
//! other inodes (refcount > 1, as the kernel's mbcache makes) is copied before it changes.

use crate::alloc::BlockUse;
use crate::format::*;
use crate::fs::{Ext2, Head, Op, State};
use quilt_patch::PatchId;
use quilt_vfs::{FsError, Result, XattrFlags};

const EA_MAGIC: u32 = 0xEA02_0000;
const HEADER: usize = 32;
const ENTRY: usize = 16;

const PREFIXES: [(&[u8], u8); 3] = [(b"user.", 1), (b"trusted.", 4), (b"security.", 6)];
/// Name indexes of the two ACLs (each stored under an empty name).
pub(crate) const ACL_ACCESS: u8 = 2;
pub(crate) const ACL_DEFAULT: u8 = 3;

fn split_name(name: &[u8]) -> Result<(u8, &[u8])> {
    if name == quilt_vfs::acl::ACCESS {
        return Ok((ACL_ACCESS, b""));
    }
    if name == quilt_vfs::acl::DEFAULT {
        return Ok((ACL_DEFAULT, b""));
    }
    for (p, idx) in PREFIXES {
        if let Some(rest) = name.strip_prefix(p) {
            if rest.is_empty() {
                return Err(FsError::Invalid("empty attribute name"));
            }
            if rest.len() > 255 {
                return Err(FsError::Range);
            }
            return Ok((idx, rest));
        }
    }
    Err(FsError::NotSupported)
}

fn entry_len(name_len: usize) -> usize {
    (ENTRY + name_len + 3) & !3
}

fn value_len(len: usize) -> usize {
    (len + 3) & !3
}

fn entry_hash(name: &[u8], value: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &c in name {
        h = (h << 5) ^ (h >> 27) ^ c as u32;
    }
    for chunk in value.chunks(4) {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h << 16) ^ (h >> 16) ^ u32::from_le_bytes(w);
    }
    h
}

pub(crate) type Attr = (u8, Vec<u8>, Vec<u8>);
type Attrs = Vec<Attr>;

/// One attribute to set (`Some`) or remove (`None`), in on-disk form.
pub(crate) struct Change<'a> {
    pub idx: u8,
    pub name: &'a [u8],
    pub value: Option<Vec<u8>>,
}

/// Decodes the entry list of an attribute area: entries from `first`, values at offsets
/// relative to `value_base` (the block start for EA blocks, the first entry for in-inode
/// attributes). `what` names the area in errors.
fn parse_entries(d: &[u8], first: usize, value_base: usize, what: &str) -> Result<Attrs> {
    let mut out = Vec::new();
    let mut off = first;
    while off + 4 <= d.len() && le32(d, off) != 0 {
        if off + ENTRY > d.len() {
            return Err(corrupt(format!("attribute entry overruns {what}")));
        }
        let nlen = d[off] as usize;
        let idx = d[off + 1];
        let voff = value_base + le16(d, off + 2) as usize;
        let vinum = le32(d, off + 4);
        let vsize = le32(d, off + 8) as usize;
        let end = off + entry_len(nlen);
        if end > d.len() || vinum != 0 || voff + vsize > d.len() {
            return Err(corrupt(format!(
                "attribute entry at {off} of {what} is invalid"
            )));
        }
        out.push((
            idx,
            d[off + ENTRY..off + ENTRY + nlen].to_vec(),
            d[voff..voff + vsize].to_vec(),
        ));
        off = end;
    }
    Ok(out)
}

/// Lays `attrs` out in an area of `len` bytes: entries from `first` (ending with four
/// zero bytes), values packed down from the end with offsets relative to `value_base`.
/// None when they do not fit.
fn layout(attrs: &Attrs, len: usize, first: usize, value_base: usize) -> Option<Vec<u8>> {
    let mut b = vec![0u8; len];
    let mut off = first;
    let mut vend = len;
    for (idx, name, value) in attrs {
        let vlen = value_len(value.len());
        if off + entry_len(name.len()) + 4 > vend.checked_sub(vlen)? {
            return None;
        }
        vend -= vlen;
        b[vend..vend + value.len()].copy_from_slice(value);
        b[off] = name.len() as u8;
        b[off + 1] = *idx;
        let voff = if value.is_empty() {
            0
        } else {
            vend - value_base
        };
        put16(&mut b, off + 2, u16::try_from(voff).ok()?);
        put32(&mut b, off + 8, value.len() as u32);
        put32(&mut b, off + 12, entry_hash(name, value));
        b[off + ENTRY..off + ENTRY + name.len()].copy_from_slice(name);
        off += entry_len(name.len());
    }
    Some(b)
}

impl Ext2 {
    fn parse_ea_block(&self, blk: u32) -> Result<(u32, Attrs)> {
        self.check_data_block(blk)?;
        self.engine()
            .with_block(blk as u64, |d| -> Result<(u32, Attrs)> {
                if le32(d, 0) != EA_MAGIC || le32(d, 8) != 1 {
                    return Err(corrupt(format!(
                        "extended-attribute block {blk} has a bad header"
                    )));
                }
                let refcount = le32(d, 4);
                let out = parse_entries(d, HEADER, 0, &format!("block {blk}"))?;
                Ok((refcount, out))
            })
            .map_err(Self::io)?
    }

    fn build_ea_block(&self, attrs: &Attrs) -> Result<Vec<u8>> {
        let mut b = layout(attrs, self.geo.bs as usize, HEADER, 0).ok_or(FsError::NoSpace)?;
        put32(&mut b, 0, EA_MAGIC);
        put32(&mut b, 4, 1);
        put32(&mut b, 8, 1);
        let block_hash = attrs.iter().fold(0u32, |bh, (_, n, v)| {
            (bh << 16) ^ (bh >> 16) ^ entry_hash(n, v)
        });
        put32(&mut b, 12, block_hash);
        Ok(b)
    }

    /// Where attributes may live in the inode body: the offset after the extra fields
    /// and the length to the end of the inode (a magic word, entries, values).
    fn inline_area(&self, inode: &Inode) -> Option<(usize, usize)> {
        let isz = self.geo.inode_size as usize;
        let start = GOOD_OLD_INODE_SIZE + inode.extra_isize as usize;
        (isz > GOOD_OLD_INODE_SIZE && inode.extra_isize % 4 == 0 && start + 8 <= isz)
            .then(|| (start, isz - start))
    }

    /// Attributes kept in the inode body, as the kernel's ext4 driver stores them.
    fn inline_attrs(&self, st: &State, ino: u32, inode: &Inode) -> Result<Attrs> {
        let Some((start, len)) = self.inline_area(inode) else {
            return Ok(Vec::new());
        };
        let (blk, off) = self.inode_loc(st, ino)?;
        self.engine()
            .with_block(blk as u64, |d| -> Result<Attrs> {
                let area = &d[off + start..off + start + len];
                if le32(area, 0) != EA_MAGIC {
                    return Ok(Vec::new());
                }
                parse_entries(&area[4..], 0, 0, &format!("inode {ino}"))
            })
            .map_err(Self::io)?
    }

    /// The inode, and its attributes in its body and in its block.
    pub(crate) fn read_attrs(&self, st: &State, ino: u32) -> Result<(Inode, Attrs, Attrs)> {
        let inode = self.read_live_inode(st, ino)?;
        let inline = self.inline_attrs(st, ino, &inode)?;
        let block = if inode.file_acl != 0 {
            self.parse_ea_block(inode.file_acl)?.1
        } else {
            Vec::new()
        };
        Ok((inode, inline, block))
    }

    /// One attribute's value (on-disk form), by name index and name.
    pub(crate) fn find_attr(
        &self,
        st: &State,
        ino: u32,
        idx: u8,
        name: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let (_, inline, block) = self.read_attrs(st, ino)?;
        Ok(inline
            .into_iter()
            .chain(block)
            .find(|(i, n, _)| *i == idx && n == name)
            .map(|(_, _, v)| v))
    }

    pub(crate) fn do_getxattr(&self, st: &State, ino: u32, name: &[u8]) -> Result<Vec<u8>> {
        let (idx, short) = split_name(name)?;
        if matches!(idx, ACL_ACCESS | ACL_DEFAULT) {
            return self.get_acl_xattr(st, ino, idx);
        }
        self.find_attr(st, ino, idx, short)?.ok_or(FsError::NoAttr)
    }

    pub(crate) fn do_listxattr(&self, st: &State, ino: u32) -> Result<Vec<u8>> {
        let (_, inline, block) = self.read_attrs(st, ino)?;
        let mut out = Vec::new();
        for (idx, name, _) in inline.into_iter().chain(block) {
            match idx {
                ACL_ACCESS if self.acl => out.extend_from_slice(quilt_vfs::acl::ACCESS),
                ACL_DEFAULT if self.acl => out.extend_from_slice(quilt_vfs::acl::DEFAULT),
                _ => match PREFIXES.iter().find(|(_, i)| *i == idx) {
                    Some((p, _)) => {
                        out.extend_from_slice(p);
                        out.extend_from_slice(&name);
                    }
                    None => continue,
                },
            }
            out.push(0);
        }
        Ok(out)
    }

    /// Sets (`Some`) or removes (`None`) one attribute, for `ctx`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn do_setxattr(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        name: &[u8],
        value: Option<&[u8]>,
        flags: XattrFlags,
        ctx: &quilt_vfs::Ctx,
    ) -> Result<()> {
        let (idx, short) = split_name(name)?;
        if !self.geo.ext_attr {
            return Err(FsError::NotSupported);
        }
        if matches!(idx, ACL_ACCESS | ACL_DEFAULT) {
            return self.set_acl_xattr(op, st, ino, idx, value, flags, ctx);
        }
        let mut inode = self.read_live_inode(st, ino)?;
        crate::flags::refuse_if_frozen(&inode)?;
        let exists = self.find_attr(st, ino, idx, short)?.is_some();
        match (value, exists) {
            (None, false) => return Err(FsError::NoAttr),
            (Some(_), true) if flags.create => return Err(FsError::Exists),
            (Some(_), false) if flags.replace => return Err(FsError::NoAttr),
            _ => {}
        }
        Self::touch_times(&mut inode, false, true);
        let change = Change {
            idx,
            name: short,
            value: value.map(<[u8]>::to_vec),
        };
        self.apply_xattrs(op, st, ino, &mut inode, &[change], &[])?;
        Ok(())
    }

    /// Applies `changes` to the attributes of `ino` and writes `inode` (which the caller
    /// may have changed as well: mode, times) after `befores`. Each new value goes in the
    /// inode body when it fits there, else in the block, and leaves the other place, as
    /// the kernel does. Removing a missing attribute changes nothing. Returns the patch
    /// that wrote the inode.
    pub(crate) fn apply_xattrs(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        inode: &mut Inode,
        changes: &[Change<'_>],
        befores: &[PatchId],
    ) -> Result<Head> {
        let bs = self.geo.bs as usize;
        let area = self.inline_area(inode);
        let mut inline = self.inline_attrs(st, ino, inode)?;
        let old = inode.file_acl;
        let (shared, mut block) = if old != 0 {
            let (rc, a) = self.parse_ea_block(old)?;
            (rc > 1, a)
        } else {
            (false, Vec::new())
        };
        let (inline0, block0) = (inline.clone(), block.clone());
        for c in changes {
            let is = |a: &Attr| a.0 == c.idx && a.1 == c.name;
            inline.retain(|a| !is(a));
            block.retain(|a| !is(a));
            let Some(v) = &c.value else { continue };
            if v.len() > bs {
                return Err(FsError::NoSpace);
            }
            inline.push((c.idx, c.name.to_vec(), v.clone()));
            if area.is_some_and(|(_, len)| layout(&inline, len - 4, 0, 0).is_some()) {
                continue;
            }
            let a = inline.pop().expect("just pushed");
            block.push(a);
            block.sort_by(|a, b| (a.0, a.1.len(), &a.1).cmp(&(b.0, b.1.len(), &b.1)));
        }
        let mut before: Vec<PatchId> = befores.to_vec();
        // The block to let go of once the inode no longer names it.
        let mut release = None;
        let sectors = self.geo.bs / 512;
        if block != block0 {
            if block.is_empty() {
                inode.file_acl = 0;
                inode.blocks = inode.blocks.saturating_sub(sectors);
                release = Some(old);
            } else {
                let img = self.build_ea_block(&block)?;
                if old != 0 && !shared {
                    let h = self.put_exact(op, old, 0, &img, &[])?;
                    self.track(st, ino, Some(h));
                    before.push(h);
                } else {
                    let goal = self.meta_goal(st, self.group_of_inode(ino));
                    let (blk, alloc) = self.alloc_block(op, st, goal, BlockUse::Meta)?;
                    let freed: Vec<_> = st.frees.block(blk).into_iter().collect();
                    let init = self.put_block(op, blk, &img, &freed, false)?;
                    inode.file_acl = blk;
                    if old == 0 {
                        inode.blocks = inode.blocks.saturating_add(sectors);
                    } else {
                        release = Some(old);
                    }
                    before.extend([alloc, init]);
                }
            }
        }
        let h = match area {
            Some((start, len)) if inline != inline0 => {
                let mut bytes = vec![0u8; len];
                if !inline.is_empty() {
                    put32(&mut bytes, 0, EA_MAGIC);
                    let body = layout(&inline, len - 4, 0, 0).expect("checked to fit");
                    bytes[4..].copy_from_slice(&body);
                }
                self.write_inode_with(op, st, ino, inode, &before, |raw| {
                    raw[start..start + len].copy_from_slice(&bytes)
                })?
            }
            _ => self.write_inode(op, st, ino, inode, &before)?,
        };
        self.track(st, ino, h);
        if let Some(old) = release {
            if shared {
                self.drop_ea_ref(op, old, h)?;
            } else {
                self.free_block(op, st, old, h)?;
            }
        }
        Ok(h)
    }

    fn drop_ea_ref(&self, op: &Op<'_>, blk: u32, after: Head) -> Result<()> {
        let rc = self
            .engine()
            .with_block(blk as u64, |d| le32(d, 4))
            .map_err(Self::io)?;
        let mut b = [0u8; 4];
        put32(&mut b, 0, rc.saturating_sub(1));
        self.put_exact(op, blk, 4, &b, &after.into_iter().collect::<Vec<_>>())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_need_a_known_prefix() {
        assert_eq!(split_name(b"user.a").unwrap(), (1, &b"a"[..]));
        assert_eq!(
            split_name(b"system.posix_acl_access").unwrap(),
            (2, &b""[..])
        );
        assert_eq!(split_name(b"system.other"), Err(FsError::NotSupported));
        assert!(split_name(b"user.").is_err());
    }

    #[test]
    fn hash_matches_the_kernel_definition_on_a_known_case() {
        // name "a" → 0x61; value "abcd" as one little-endian word 0x64636261:
        // (0x61 << 16) ^ (0x61 >> 16) ^ 0x64636261.
        assert_eq!(entry_hash(b"a", b"abcd"), (0x61u32 << 16) ^ 0x6463_6261);
    }
}
