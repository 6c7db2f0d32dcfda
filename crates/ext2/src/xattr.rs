//! Extended attributes in an ext2 EA block (`i_file_acl`): user.*, trusted.* and
//! security.* names. One block per inode; a block shared with other inodes (refcount > 1,
//! as the kernel's mbcache makes) is copied before it changes.

use crate::format::*;
use crate::fs::{Ext2, State};
use quilt_vfs::{FsError, Result, XattrFlags};

const EA_MAGIC: u32 = 0xEA02_0000;
const HEADER: usize = 32;
const ENTRY: usize = 16;

const PREFIXES: [(&[u8], u8); 3] = [(b"user.", 1), (b"trusted.", 4), (b"security.", 6)];

fn split_name(name: &[u8]) -> Result<(u8, &[u8])> {
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

type Attrs = Vec<(u8, Vec<u8>, Vec<u8>)>;

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

impl Ext2 {
    fn parse_ea_block(&self, blk: u32) -> Result<(u32, Attrs)> {
        self.check_data_block(blk)?;
        self.engine
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
        let bs = self.geo.bs as usize;
        let mut b = vec![0u8; bs];
        put32(&mut b, 0, EA_MAGIC);
        put32(&mut b, 4, 1);
        put32(&mut b, 8, 1);
        let mut off = HEADER;
        let mut vend = bs;
        let mut block_hash: u32 = 0;
        for (idx, name, value) in attrs {
            let vlen = (value.len() + 3) & !3;
            if off + entry_len(name.len()) + 4 > vend.saturating_sub(vlen) {
                return Err(FsError::NoSpace);
            }
            vend -= vlen;
            b[vend..vend + value.len()].copy_from_slice(value);
            let h = entry_hash(name, value);
            b[off] = name.len() as u8;
            b[off + 1] = *idx;
            put16(
                &mut b,
                off + 2,
                if value.is_empty() { 0 } else { vend as u16 },
            );
            put32(&mut b, off + 8, value.len() as u32);
            put32(&mut b, off + 12, h);
            b[off + ENTRY..off + ENTRY + name.len()].copy_from_slice(name);
            off += entry_len(name.len());
            block_hash = (block_hash << 16) ^ (block_hash >> 16) ^ h;
        }
        put32(&mut b, 12, block_hash);
        Ok(b)
    }

    /// Attributes kept in the inode body (after `i_extra_isize`), as the kernel's ext4
    /// driver stores small ones. Returns them and whether the area is in use.
    fn inline_attrs(&self, st: &State, ino: u32, inode: &Inode) -> Result<(bool, Attrs)> {
        let isz = self.geo.inode_size as usize;
        let start = GOOD_OLD_INODE_SIZE + inode.extra_isize as usize;
        if isz <= GOOD_OLD_INODE_SIZE || start + 4 > isz {
            return Ok((false, Vec::new()));
        }
        let (blk, off) = self.inode_loc(st, ino)?;
        self.engine
            .with_block(blk as u64, |d| -> Result<(bool, Attrs)> {
                let slot = &d[off..off + isz];
                if le32(slot, start) != EA_MAGIC {
                    return Ok((false, Vec::new()));
                }
                let region = &slot[start + 4..];
                let out = parse_entries(region, 0, 0, &format!("inode {ino}"))?;
                Ok((true, out))
            })
            .map_err(Self::io)?
    }

    fn read_attrs(&self, st: &State, ino: u32) -> Result<(Inode, Attrs)> {
        let inode = self.read_live_inode(st, ino)?;
        let (_, mut attrs) = self.inline_attrs(st, ino, &inode)?;
        if inode.file_acl != 0 {
            attrs.extend(self.parse_ea_block(inode.file_acl)?.1);
        }
        Ok((inode, attrs))
    }

    /// Writes the inode; with `clear_inline`, also retires its in-inode attributes (they
    /// now live in the block), in the same patch.
    fn write_inode_xattr(
        &self,
        st: &State,
        ino: u32,
        inode: &Inode,
        clear_inline: bool,
        befores: &[quilt_patch::PatchId],
    ) -> Result<Option<quilt_patch::PatchId>> {
        if !clear_inline {
            return self.write_inode(st, ino, inode, befores);
        }
        let start = GOOD_OLD_INODE_SIZE + inode.extra_isize as usize;
        self.write_inode_with(st, ino, inode, befores, |raw| raw[start..].fill(0))
    }

    pub(crate) fn do_getxattr(&self, st: &State, ino: u32, name: &[u8]) -> Result<Vec<u8>> {
        let (idx, short) = split_name(name)?;
        let (_, attrs) = self.read_attrs(st, ino)?;
        attrs
            .into_iter()
            .find(|(i, n, _)| *i == idx && n == short)
            .map(|(_, _, v)| v)
            .ok_or(FsError::NoAttr)
    }

    pub(crate) fn do_listxattr(&self, st: &State, ino: u32) -> Result<Vec<u8>> {
        let (_, attrs) = self.read_attrs(st, ino)?;
        let mut out = Vec::new();
        for (idx, name, _) in attrs {
            if let Some((p, _)) = PREFIXES.iter().find(|(_, i)| *i == idx) {
                out.extend_from_slice(p);
                out.extend_from_slice(&name);
                out.push(0);
            }
        }
        Ok(out)
    }

    /// Sets (`Some`) or removes (`None`) one attribute.
    pub(crate) fn do_setxattr(
        &self,
        st: &mut State,
        ino: u32,
        name: &[u8],
        value: Option<&[u8]>,
        flags: XattrFlags,
    ) -> Result<()> {
        let (idx, short) = split_name(name)?;
        if !self.geo.ext_attr {
            return Err(FsError::NotSupported);
        }
        let (mut inode, mut attrs) = self.read_attrs(st, ino)?;
        crate::flags::refuse_if_frozen(&inode)?;
        let (inline, _) = self.inline_attrs(st, ino, &inode)?;
        let pos = attrs.iter().position(|(i, n, _)| *i == idx && n == short);
        match (value, pos) {
            (None, None) => return Err(FsError::NoAttr),
            (None, Some(p)) => {
                attrs.remove(p);
            }
            (Some(_), Some(_)) if flags.create => return Err(FsError::Exists),
            (Some(_), None) if flags.replace => return Err(FsError::NoAttr),
            (Some(v), Some(p)) => attrs[p].2 = v.to_vec(),
            (Some(v), None) => attrs.push((idx, short.to_vec(), v.to_vec())),
        }
        if value.is_some_and(|v| v.len() > self.geo.bs as usize) {
            return Err(FsError::NoSpace);
        }
        attrs.sort_by(|a, b| (a.0, a.1.len(), &a.1).cmp(&(b.0, b.1.len(), &b.1)));
        Self::touch_times(&mut inode, false, true);
        let old = inode.file_acl;
        let shared = old != 0 && self.parse_ea_block(old)?.0 > 1;
        let sectors = self.geo.bs / 512;
        if attrs.is_empty() {
            let had_block = old != 0;
            inode.file_acl = 0;
            if had_block {
                inode.blocks = inode.blocks.saturating_sub(sectors);
            }
            let h = self.write_inode_xattr(st, ino, &inode, inline, &[])?;
            self.track(st, ino, h);
            if had_block && shared {
                self.drop_ea_ref(old, h)?;
            } else if had_block {
                self.free_block(st, old, h)?;
            }
            return Ok(());
        }
        let img = self.build_ea_block(&attrs)?;
        if old != 0 && !shared {
            let h = self.put_exact(old, 0, &img, &[])?;
            let i = self.write_inode_xattr(st, ino, &inode, inline, &[h])?;
            self.track(st, ino, Some(h));
            self.track(st, ino, i);
            return Ok(());
        }
        let goal = st.gd[((ino - 1) / self.geo.ipg) as usize].inode_table + self.geo.itb;
        let (blk, alloc) = self.alloc_block(st, goal)?;
        let freed: Vec<_> = st.freed.get(&blk).copied().into_iter().collect();
        let init = self.put_block(blk, &img, &freed, false)?;
        inode.file_acl = blk;
        if old == 0 {
            inode.blocks = inode.blocks.saturating_add(sectors);
        }
        let h = self.write_inode_xattr(st, ino, &inode, inline, &[alloc, init])?;
        self.track(st, ino, h);
        if shared {
            self.drop_ea_ref(old, h)?;
        }
        Ok(())
    }

    fn drop_ea_ref(&self, blk: u32, after: Option<quilt_patch::PatchId>) -> Result<()> {
        let rc = self
            .engine
            .with_block(blk as u64, |d| le32(d, 4))
            .map_err(Self::io)?;
        let mut b = [0u8; 4];
        put32(&mut b, 0, rc.saturating_sub(1));
        self.put_exact(blk, 4, &b, &after.into_iter().collect::<Vec<_>>())?;
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
            split_name(b"system.posix_acl_access"),
            Err(FsError::NotSupported)
        );
        assert!(split_name(b"user.").is_err());
    }

    #[test]
    fn hash_matches_the_kernel_definition_on_a_known_case() {
        // name "a" → 0x61; value "abcd" as one little-endian word 0x64636261:
        // (0x61 << 16) ^ (0x61 >> 16) ^ 0x64636261.
        assert_eq!(entry_hash(b"a", b"abcd"), (0x61u32 << 16) ^ 0x6463_6261);
    }
}
