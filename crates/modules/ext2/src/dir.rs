//! Directories: entries, lookup, listing with stable cookies, and the name operations
//! (create, link, unlink, rmdir, rename) with their soft-updates order:
//!
//! - create: inode bitmap → initialized inode → entry naming it;
//! - mkdir: also the directory block and the parent's link count before the inode;
//! - link: link count up → entry;
//! - unlink: entry removal → link count down, or → cleared inode → freed bits;
//! - rename: link count up → new entry → old entry removed → link count down; for a
//!   directory moving between parents, the new parent's count and ".." in between.

use crate::alloc::{BlockUse, NewInode};
use crate::flags;
use crate::format::*;
use crate::fs::{check_name, Ext2, Head, Op, State};
use quilt_patch::PatchId;
use quilt_vfs::{Attr, Ctx, DirEntry, FileType, FsError, Ino, RenameFlags, Result};

/// A directory block's entries; damage is reported with the block's number (the
/// superblock's error record and the log name it).
fn parse_dir(phys: u32, d: &[u8], filetype: bool) -> Result<Vec<RawDirent<'_>>> {
    parse_dir_block(d, filetype).map_err(|e| match e {
        FsError::Corrupt(m) => corrupt(format!("directory block {phys}: {m}")),
        e => e,
    })
}

/// A directory entry found by name.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub phys: u32,
    pub offset: usize,
    /// The record before it in the same block (removal merges into it).
    pub prev: Option<usize>,
    pub inode: u32,
}

impl Ext2 {
    fn dir_block(&self, dir: &Inode, lblk: u64) -> Result<u32> {
        let phys = self.bmap(dir, lblk)?;
        if phys == 0 {
            return Err(corrupt(format!("directory has a hole at block {lblk}")));
        }
        Ok(phys)
    }

    fn ftype(&self, mode: u32) -> u8 {
        if self.geo.filetype {
            dirent_type_of_mode(mode)
        } else {
            0
        }
    }

    pub(crate) fn find_entry(&self, dir: &Inode, name: &[u8]) -> Result<Option<Found>> {
        let bs = self.geo.bs as u64;
        for lblk in 0..dir.size / bs {
            let phys = self.dir_block(dir, lblk)?;
            let found = self
                .engine()
                .with_block(phys as u64, |d| -> Result<Option<Found>> {
                    let mut prev = None;
                    for e in parse_dir(phys, d, self.geo.filetype)? {
                        if e.inode != 0 && e.name == name {
                            return Ok(Some(Found {
                                phys,
                                offset: e.offset,
                                prev,
                                inode: e.inode,
                            }));
                        }
                        prev = Some(e.offset);
                    }
                    Ok(None)
                })
                .map_err(Self::io)??;
            if let Some(f) = found {
                if f.inode == 0 || f.inode > self.geo.inodes_count {
                    return Err(corrupt(format!(
                        "entry names inode {} out of range",
                        f.inode
                    )));
                }
                return Ok(Some(f));
            }
        }
        Ok(None)
    }

    /// Adds `name → child` to directory `dir_ino`; the entry waits for `befores`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_entry(
        &self,
        op: &Op<'_>,
        st: &mut State,
        dir_ino: u32,
        name: &[u8],
        child: u32,
        ftype: u8,
        befores: &[PatchId],
    ) -> Result<PatchId> {
        let mut dir = self.read_inode(st, dir_ino)?;
        let bs = self.geo.bs as u64;
        let need = dirent_len(name.len());
        Self::touch_times(&mut dir, true, true);
        dir.flags &= !INDEX_FL;
        for lblk in 0..dir.size / bs {
            let phys = self.dir_block(&dir, lblk)?;
            let slot = self
                .engine()
                .with_block(phys as u64, |d| -> Result<Option<(usize, usize, usize)>> {
                    for e in parse_dir(phys, d, self.geo.filetype)? {
                        let used = if e.inode == 0 {
                            0
                        } else {
                            dirent_len(e.name.len())
                        };
                        if e.rec_len >= used + need {
                            return Ok(Some((e.offset, e.rec_len, used)));
                        }
                    }
                    Ok(None)
                })
                .map_err(Self::io)??;
            if let Some((off, rec_len, used)) = slot {
                // The previous record's length (if split) and the new entry, one patch.
                let mut buf = vec![0u8; used + 8 + name.len()];
                if used > 0 {
                    self.engine()
                        .with_block(phys as u64, |d| {
                            buf[..used].copy_from_slice(&d[off..off + used])
                        })
                        .map_err(Self::io)?;
                    put16(&mut buf, 4, used as u16);
                }
                encode_dirent(&mut buf[used..], child, rec_len - used, name, ftype);
                let start = if used > 0 { 4 } else { 0 };
                let head = self.put_exact(op, phys, off + start, &buf[start..], befores)?;
                let h = self.write_inode(op, st, dir_ino, &dir, &[])?;
                self.track(st, dir_ino, h);
                return Ok(head);
            }
        }
        // No room: a new block at the end.
        let lblk = dir.size / bs;
        let mut content = vec![0u8; bs as usize];
        encode_dirent(&mut content, child, bs as usize, name, ftype);
        dir.size = dir.size.saturating_add(bs);
        let goal = if lblk > 0 {
            self.bmap(&dir, lblk - 1)? + 1
        } else {
            self.meta_goal(st, self.group_of_inode(dir_ino))
        };
        let (_, head) = self.bmap_alloc(
            op, st, dir_ino, &mut dir, lblk, &content, befores, false, goal, None,
        )?;
        Ok(head)
    }

    /// Removes the entry `f` (merging it into the previous record, or zeroing its inode
    /// field when it leads its block).
    pub(crate) fn remove_entry(
        &self,
        op: &Op<'_>,
        f: &Found,
        befores: &[PatchId],
    ) -> Result<PatchId> {
        match f.prev {
            Some(prev) => {
                // The new length is computed from both records' lengths, which pending
                // patches may have set (a split that placed this entry): the patch
                // covers every byte from the previous record's length through this
                // record's length, so it waits for (or merges with) whatever wrote them.
                // Written over the length field alone, it could land while the split
                // it relied on was rolled back, exposing a stale entry (the crash
                // explorer found a name pointing at a freed inode that way).
                let mut b = self
                    .engine()
                    .with_block(f.phys as u64, |d| d[prev + 4..f.offset + 6].to_vec())
                    .map_err(Self::io)?;
                let len = le16(&b, f.offset + 4 - (prev + 4));
                let prev_len = le16(&b, 0);
                put16(&mut b, 0, prev_len + len);
                self.put_exact(op, f.phys, prev + 4, &b, befores)
            }
            None => self.put_exact(op, f.phys, f.offset, &[0; 4], befores),
        }
    }

    /// Points an existing entry at another inode.
    fn retarget_entry(
        &self,
        op: &Op<'_>,
        f: &Found,
        ino: u32,
        ftype: u8,
        befores: &[PatchId],
    ) -> Result<PatchId> {
        let mut head = self
            .engine()
            .with_block(f.phys as u64, |d| d[f.offset..f.offset + 8].to_vec())
            .map_err(Self::io)?;
        put32(&mut head, 0, ino);
        head[7] = ftype;
        self.put_exact(op, f.phys, f.offset, &head, befores)
    }

    fn is_empty_dir(&self, dir: &Inode) -> Result<bool> {
        let bs = self.geo.bs as u64;
        for lblk in 0..dir.size / bs {
            let phys = self.dir_block(dir, lblk)?;
            let empty = self
                .engine()
                .with_block(phys as u64, |d| -> Result<bool> {
                    Ok(parse_dir(phys, d, self.geo.filetype)?
                        .iter()
                        .all(|e| e.inode == 0 || e.name == b"." || e.name == b".."))
                })
                .map_err(Self::io)??;
            if !empty {
                return Ok(false);
            }
        }
        Ok(true)
    }

    pub(crate) fn do_readdir(
        &self,
        st: &State,
        ino: u32,
        cookie: u64,
        emit: &mut dyn FnMut(DirEntry) -> bool,
    ) -> Result<()> {
        let dir = self.read_live_inode(st, ino)?;
        if !dir.is_dir() {
            return Err(FsError::NotDir);
        }
        // A cookie is the entry's byte position in the directory; entries never move, so
        // it stays valid while others come and go (a removed entry's successor is found
        // by position).
        let bs = self.geo.bs as u64;
        for lblk in cookie / bs..dir.size / bs {
            let phys = self.dir_block(&dir, lblk)?;
            let entries: Vec<(usize, u32, usize, u8, Vec<u8>)> = self
                .engine()
                .with_block(phys as u64, |d| -> Result<_> {
                    Ok(parse_dir(phys, d, self.geo.filetype)?
                        .into_iter()
                        .map(|e| (e.offset, e.inode, e.rec_len, e.file_type, e.name.to_vec()))
                        .collect())
                })
                .map_err(Self::io)??;
            for (off, inode, rec_len, ft, name) in entries {
                let pos = lblk * bs + off as u64;
                if pos < cookie || inode == 0 {
                    continue;
                }
                let kind = match ft {
                    1 => FileType::Regular,
                    2 => FileType::Directory,
                    3 => FileType::CharDevice,
                    4 => FileType::BlockDevice,
                    5 => FileType::Fifo,
                    6 => FileType::Socket,
                    7 => FileType::Symlink,
                    _ => {
                        let i = self.read_inode(st, inode)?;
                        FileType::from_mode(i.mode as u32).unwrap_or(FileType::Regular)
                    }
                };
                let e = DirEntry {
                    ino: inode as Ino,
                    kind,
                    name,
                    next_offset: pos + rec_len as u64,
                };
                if !emit(e) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Creates a file, device node, fifo, socket, directory or symlink.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_node(
        &self,
        op: &Op<'_>,
        st: &mut State,
        parent: u32,
        name: &[u8],
        mode: u32,
        rdev: u32,
        target: Option<&[u8]>,
        ctx: &Ctx,
        want: Option<u32>,
    ) -> Result<Attr> {
        check_name(name)?;
        let dir = self.read_live_inode(st, parent)?;
        if !dir.is_dir() {
            return Err(FsError::NotDir);
        }
        if dir.links == 0 {
            return Err(FsError::NotFound);
        }
        if self.find_entry(&dir, name)?.is_some() {
            return Err(FsError::Exists);
        }
        flags::refuse_new_entry(&dir)?;
        let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
        // The umask, or the directory's default ACL in its place.
        let (mode, acls) = self.acl_for_new(st, parent, mode, ctx.umask)?;
        if is_dir && dir.links >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let mut mode = mode;
        let gid = if dir.mode as u32 & libc::S_ISGID != 0 {
            if is_dir {
                mode |= libc::S_ISGID;
            }
            dir.gid
        } else {
            ctx.gid
        };
        let kind = if !is_dir {
            NewInode::File
        } else if parent == ROOT_INO || dir.flags & quilt_vfs::flags::TOPDIR != 0 {
            NewInode::TopDir
        } else {
            NewInode::Dir
        };
        let (ino, bit) = self.alloc_inode(op, st, parent, kind, want)?;
        let mut inode = self.new_inode(mode, ctx.uid, gid);
        inode.links = 1;
        inode.flags = flags::inherited(dir.flags, mode);
        let mut befores = vec![bit];
        let bs = self.geo.bs;
        // A directory's or a symlink's block: in front of the group's data.
        let goal = self.meta_goal(st, self.group_of_inode(ino));
        let mut block_with = |st: &mut State, inode: &mut Inode, content: &[u8]| -> Result<()> {
            let (blk, alloc) = self.alloc_block(op, st, goal, BlockUse::Meta)?;
            let freed: Vec<_> = st.frees.block(blk).into_iter().collect();
            let init = self.put_block(op, blk, content, &freed, false)?;
            befores.push(alloc);
            befores.push(init);
            inode.block[0] = blk;
            inode.blocks = bs / 512;
            Ok(())
        };
        let made = (|| -> Result<()> {
            if is_dir {
                let mut content = vec![0u8; bs as usize];
                encode_dirent(&mut content, ino, 12, b".", self.ftype(libc::S_IFDIR));
                encode_dirent(
                    &mut content[12..],
                    parent,
                    bs as usize - 12,
                    b"..",
                    self.ftype(libc::S_IFDIR),
                );
                block_with(st, &mut inode, &content)?;
                inode.size = bs as u64;
                inode.links = 2;
            } else if let Some(t) = target {
                inode.size = t.len() as u64;
                if t.len() < FAST_SYMLINK_MAX {
                    let mut raw = [0u8; 60];
                    raw[..t.len()].copy_from_slice(t);
                    for (i, v) in inode.block.iter_mut().enumerate() {
                        *v = le32(&raw, i * 4);
                    }
                } else {
                    let mut content = vec![0u8; bs as usize];
                    content[..t.len()].copy_from_slice(t);
                    block_with(st, &mut inode, &content)?;
                }
            } else if inode.is_special() {
                inode.set_rdev(rdev);
            }
            Ok(())
        })();
        if let Err(e) = made {
            // Undo the inode allocation (nothing names it yet).
            self.free_inode(op, st, ino, is_dir, None)?;
            return Err(e);
        }
        if is_dir {
            let p =
                self.modify_inode(op, st, parent, &[], |d| d.links = d.links.saturating_add(1))?;
            befores.extend(p);
        }
        let n = self.init_inode(op, st, ino, &inode, &befores)?;
        let named = (|| {
            let mut n = n;
            if !acls.is_empty() {
                // The ACLs are in place before any name leads to the inode.
                n = self
                    .apply_xattrs(op, st, ino, &mut inode, &acls, &[n])?
                    .unwrap_or(n);
            }
            self.add_entry(op, st, parent, name, ino, self.ftype(mode), &[n])
        })();
        let entry = match named {
            Ok(e) => e,
            Err(e) => {
                // No room for the ACLs' block or the entry: take the inode back (its
                // blocks too; nothing names it).
                if is_dir {
                    self.modify_inode(op, st, parent, &[], |d| {
                        d.links = d.links.saturating_sub(1)
                    })?;
                }
                self.destroy_inode(op, st, ino, None)?;
                return Err(e);
            }
        };
        self.track(st, parent, Some(entry));
        self.track(st, ino, Some(entry));
        st.syncs.named_in(ino, parent);
        st.counters.inodes_created += 1;
        self.attr(st, ino)
    }

    /// Creates a regular file with no name (open(2)'s O_TMPFILE): it lives as an orphan,
    /// freed at its last release, unless `do_link` gives it a name first.
    pub(crate) fn create_tmpfile(
        &self,
        op: &Op<'_>,
        st: &mut State,
        parent: u32,
        mode: u32,
        ctx: &Ctx,
    ) -> Result<Attr> {
        let dir = self.read_live_inode(st, parent)?;
        if !dir.is_dir() {
            return Err(FsError::NotDir);
        }
        if dir.links == 0 {
            return Err(FsError::NotFound);
        }
        flags::refuse_new_entry(&dir)?;
        let (ino, n) = self.unnamed_inode(
            op,
            st,
            parent,
            &dir,
            libc::S_IFREG | (mode & 0o7777),
            0,
            ctx,
        )?;
        st.files.orphan(ino);
        let mut inode = self.read_inode(st, ino)?;
        self.orphan_add(op, st, ino, &mut inode)?;
        let n = self.write_inode(op, st, ino, &inode, &[n])?.or(Some(n));
        self.track(st, ino, n);
        self.attr(st, ino)
    }

    /// Allocates and initializes an inode that no entry names yet, with `links` links
    /// (the caller names it, or keeps it as an orphan), owned as a new file in `dir`
    /// would be. Returns it and the patch that initialized it.
    #[allow(clippy::too_many_arguments)]
    fn unnamed_inode(
        &self,
        op: &Op<'_>,
        st: &mut State,
        parent: u32,
        dir: &Inode,
        mode: u32,
        links: u16,
        ctx: &Ctx,
    ) -> Result<(u32, PatchId)> {
        let gid = if dir.mode as u32 & libc::S_ISGID != 0 {
            dir.gid
        } else {
            ctx.gid
        };
        let (mode, acls) = self.acl_for_new(st, parent, mode, ctx.umask)?;
        let (ino, bit) = self.alloc_inode(op, st, parent, NewInode::File, None)?;
        let mut inode = self.new_inode(mode, ctx.uid, gid);
        inode.links = links;
        inode.flags = flags::inherited(dir.flags, mode);
        let mut init = self.init_inode(op, st, ino, &inode, &[bit])?;
        if !acls.is_empty() {
            match self.apply_xattrs(op, st, ino, &mut inode, &acls, &[init]) {
                Ok(i) => init = i.unwrap_or(init),
                Err(e) => {
                    // No room for the ACLs' block: the inode goes back.
                    self.destroy_inode(op, st, ino, None)?;
                    return Err(e);
                }
            }
        }
        st.counters.inodes_created += 1;
        Ok((ino, init))
    }

    pub(crate) fn remove_name(
        &self,
        op: &Op<'_>,
        st: &mut State,
        parent: u32,
        name: &[u8],
        rmdir: bool,
    ) -> Result<()> {
        if name == b"." {
            return Err(FsError::Invalid("cannot remove '.'"));
        }
        if name == b".." {
            return Err(if rmdir {
                FsError::NotEmpty
            } else {
                FsError::IsDir
            });
        }
        check_name(name)?;
        let dir = self.read_live_inode(st, parent)?;
        if !dir.is_dir() {
            return Err(FsError::NotDir);
        }
        let f = self.find_entry(&dir, name)?.ok_or(FsError::NotFound)?;
        let child = self.read_live_inode(st, f.inode)?;
        flags::refuse_removal(&dir, &child)?;
        if rmdir {
            if !child.is_dir() {
                return Err(FsError::NotDir);
            }
            if !self.is_empty_dir(&child)? {
                return Err(FsError::NotEmpty);
            }
        } else if child.is_dir() {
            return Err(FsError::IsDir);
        }
        let r = self.remove_entry(op, &f, &[])?;
        let h = self.modify_inode(op, st, parent, &[r], |d| {
            Self::touch_times(d, true, true);
            d.flags &= !INDEX_FL;
        })?;
        self.track(st, parent, Some(r));
        self.track(st, parent, h);
        let gone = self.drop_link(op, st, f.inode, rmdir, Some(r))?;
        if rmdir {
            // The parent counts the child's ".." until the child is cleared: count it
            // down only after that (the crash explorer found the parent's link count
            // too low when this waited only for the entry's removal).
            let after: Vec<PatchId> = gone.into_iter().chain([r]).collect();
            let d = self.modify_inode(op, st, parent, &after, |d| {
                d.links = d.links.saturating_sub(1)
            })?;
            self.track(st, parent, d);
        }
        Ok(())
    }

    /// One name of `ino` is gone (after `removal`): count it down, and free the inode
    /// when no name and no open handle is left. Returns the patch that wrote the inode's
    /// new state (cleared, when freed).
    fn drop_link(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        whole_dir: bool,
        removal: Head,
    ) -> Result<Head> {
        let mut inode = self.read_inode(st, ino)?;
        inode.links = if whole_dir {
            0
        } else {
            inode.links.saturating_sub(1)
        };
        Self::touch_times(&mut inode, false, true);
        if inode.links > 0 {
            let h = self.write_inode(
                op,
                st,
                ino,
                &inode,
                &removal.into_iter().collect::<Vec<_>>(),
            )?;
            self.track(st, ino, h);
            return Ok(h);
        }
        if st.files.opens(ino) > 0 {
            // Still open: it lives, nameless, until the last release.
            st.files.orphan(ino);
            self.orphan_add(op, st, ino, &mut inode)?;
            let h = self.write_inode(
                op,
                st,
                ino,
                &inode,
                &removal.into_iter().collect::<Vec<_>>(),
            )?;
            self.track(st, ino, h);
            return Ok(h);
        }
        self.destroy_inode(op, st, ino, removal)
    }

    pub(crate) fn do_link(
        &self,
        op: &Op<'_>,
        st: &mut State,
        ino: u32,
        parent: u32,
        name: &[u8],
    ) -> Result<Attr> {
        check_name(name)?;
        let inode = self.read_live_inode(st, ino)?;
        let dir = self.read_live_inode(st, parent)?;
        if !dir.is_dir() {
            return Err(FsError::NotDir);
        }
        if self.find_entry(&dir, name)?.is_some() {
            return Err(FsError::Exists);
        }
        flags::refuse_new_entry(&dir)?;
        flags::refuse_if_frozen(&inode)?;
        if inode.is_dir() {
            return Err(FsError::Perm);
        }
        if inode.links >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let l = self.modify_inode(op, st, ino, &[], |i| {
            i.links = i.links.saturating_add(1);
            Self::touch_times(i, false, true);
        })?;
        // An O_TMPFILE file given its first name is no longer an orphan (the kernel
        // lets only those, and no other unnamed inode, be linked).
        let was_orphan = st.files.unorphan(ino);
        if was_orphan {
            self.orphan_remove(op, st, ino)?;
        }
        let e = self.add_entry(
            op,
            st,
            parent,
            name,
            ino,
            self.ftype(inode.mode as u32),
            &l.into_iter().collect::<Vec<_>>(),
        );
        let e = match e {
            Ok(e) => e,
            Err(err) => {
                self.modify_inode(op, st, ino, &[], |i| i.links = i.links.saturating_sub(1))?;
                if was_orphan {
                    // Still nameless: an orphan again, freed at its last release.
                    st.files.orphan(ino);
                    let mut inode = self.read_inode(st, ino)?;
                    self.orphan_add(op, st, ino, &mut inode)?;
                    let n = self.write_inode(op, st, ino, &inode, &[])?;
                    self.track(st, ino, n);
                }
                return Err(err);
            }
        };
        self.track(st, parent, Some(e));
        self.track(st, ino, Some(e));
        st.syncs.named_in(ino, parent);
        self.attr(st, ino)
    }

    /// The parent of directory `ino`, from its ".." entry.
    fn dotdot(&self, st: &State, ino: u32) -> Result<Found> {
        let dir = self.read_live_inode(st, ino)?;
        self.find_entry(&dir, b"..")?
            .ok_or_else(|| corrupt(format!("directory {ino} has no '..' entry")))
    }

    /// Is `dir` equal to `ancestor` or inside it?
    fn is_within(&self, st: &State, mut dir: u32, ancestor: u32) -> Result<bool> {
        for _ in 0..self.geo.inodes_count {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == ROOT_INO {
                return Ok(false);
            }
            dir = self.dotdot(st, dir)?.inode;
        }
        Err(corrupt("directory parents form a loop"))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn do_rename(
        &self,
        op: &Op<'_>,
        st: &mut State,
        parent: u32,
        name: &[u8],
        new_parent: u32,
        new_name: &[u8],
        flags: RenameFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        if flags.whiteout && flags.exchange {
            return Err(FsError::Invalid("RENAME_WHITEOUT with RENAME_EXCHANGE"));
        }
        for n in [name, new_name] {
            if n == b"." || n == b".." {
                return Err(FsError::Invalid("cannot rename '.' or '..'"));
            }
            check_name(n)?;
        }
        if flags.exchange && flags.noreplace {
            return Err(FsError::Invalid("RENAME_EXCHANGE with RENAME_NOREPLACE"));
        }
        let pdir = self.read_live_inode(st, parent)?;
        let ndir = self.read_live_inode(st, new_parent)?;
        if !pdir.is_dir() || !ndir.is_dir() {
            return Err(FsError::NotDir);
        }
        let src = self.find_entry(&pdir, name)?.ok_or(FsError::NotFound)?;
        let dst = self.find_entry(&ndir, new_name)?;
        let child = self.read_live_inode(st, src.inode)?;
        flags::refuse_removal(&pdir, &child)?;
        match &dst {
            Some(d) if d.inode != src.inode => {
                flags::refuse_removal(&ndir, &self.read_live_inode(st, d.inode)?)?
            }
            Some(_) => {}
            None => flags::refuse_new_entry(&ndir)?,
        }
        if flags.exchange {
            let dst = dst.ok_or(FsError::NotFound)?;
            return self.exchange(op, st, parent, &src, new_parent, &dst);
        }
        if let Some(d) = &dst {
            if flags.noreplace {
                return Err(FsError::Exists);
            }
            if d.inode == src.inode {
                return Ok(()); // two names of one inode: POSIX says do nothing
            }
        }
        let moving_dir = child.is_dir();
        // A target that contains the source is never empty (Linux checks this first).
        if let Some(d) = &dst {
            if self.read_live_inode(st, d.inode)?.is_dir() && self.is_within(st, parent, d.inode)? {
                return Err(FsError::NotEmpty);
            }
        }
        if moving_dir && parent != new_parent && self.is_within(st, new_parent, src.inode)? {
            return Err(FsError::Invalid("cannot move a directory under itself"));
        }
        let victim = match &dst {
            Some(d) => {
                let v = self.read_live_inode(st, d.inode)?;
                if moving_dir && !v.is_dir() {
                    return Err(FsError::NotDir);
                }
                if !moving_dir && v.is_dir() {
                    return Err(FsError::IsDir);
                }
                if v.is_dir() && !self.is_empty_dir(&v)? {
                    return Err(FsError::NotEmpty);
                }
                Some((d.clone(), v))
            }
            None => None,
        };
        if moving_dir && victim.is_none() && parent != new_parent && ndir.links >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let ftype = self.ftype(child.mode as u32);
        // RENAME_WHITEOUT: the whiteout inode exists (initialized, linked once) before
        // the old entry is pointed at it in place in step (5), so no crash state lacks
        // the old name.
        // A device number of 0:0 is what a new inode carries already.
        let whiteout = if flags.whiteout {
            Some(self.unnamed_inode(op, st, parent, &pdir, libc::S_IFCHR, 1, ctx)?)
        } else {
            None
        };
        // (1) The moving inode gains a link, then the new name points at it.
        let up = self.modify_inode(op, st, src.inode, &[], |i| {
            i.links = i.links.saturating_add(1);
            Self::touch_times(i, false, true);
        })?;
        let up: Vec<PatchId> = up.into_iter().collect();
        let new_entry = match &victim {
            Some((d, _)) => {
                let e = self.retarget_entry(op, d, src.inode, ftype, &up)?;
                self.modify_inode(op, st, new_parent, &[], |i| {
                    Self::touch_times(i, true, true)
                })?;
                e
            }
            None => match self.add_entry(op, st, new_parent, new_name, src.inode, ftype, &up) {
                Ok(e) => e,
                Err(err) => {
                    self.modify_inode(op, st, src.inode, &[], |i| {
                        i.links = i.links.saturating_sub(1)
                    })?;
                    if let Some((w, _)) = whiteout {
                        self.destroy_inode(op, st, w, None)?;
                    }
                    return Err(err);
                }
            },
        };
        self.track(st, new_parent, Some(new_entry));
        st.syncs.named_in(src.inode, new_parent);
        let mut before_removal = vec![new_entry];
        if moving_dir && parent != new_parent {
            // (2) the new parent counts the directory (unless it replaces one), (3) ".."
            // moves, (4) the old parent stops counting it.
            let mut dd_befores = vec![new_entry];
            if victim.is_none() {
                let p = self.modify_inode(op, st, new_parent, &[], |i| {
                    i.links = i.links.saturating_add(1)
                })?;
                dd_befores.extend(p);
            }
            let dd = self.dotdot(st, src.inode)?;
            let moved =
                self.retarget_entry(op, &dd, new_parent, self.ftype(libc::S_IFDIR), &dd_befores)?;
            self.track(st, src.inode, Some(moved));
            let down = self.modify_inode(op, st, parent, &[moved], |i| {
                i.links = i.links.saturating_sub(1)
            })?;
            self.track(st, parent, down);
            before_removal = vec![moved];
        }
        // (5) The old name goes, (6) then the extra link. The new entry may have been
        // placed in the old one's directory block, right before it: look it up again.
        let pdir = self.read_live_inode(st, parent)?;
        let src = self
            .find_entry(&pdir, name)?
            .ok_or_else(|| corrupt("renamed entry vanished"))?;
        let removal = match whiteout {
            None => self.remove_entry(op, &src, &before_removal)?,
            Some((w, init)) => {
                before_removal.push(init);
                let r =
                    self.retarget_entry(op, &src, w, self.ftype(libc::S_IFCHR), &before_removal)?;
                self.track(st, w, Some(r));
                st.syncs.named_in(w, parent);
                r
            }
        };
        let h = self.modify_inode(op, st, parent, &[], |i| {
            Self::touch_times(i, true, true);
            i.flags &= !INDEX_FL;
        })?;
        self.track(st, parent, Some(removal));
        self.track(st, parent, h);
        let down = self.modify_inode(op, st, src.inode, &[removal], |i| {
            i.links = i.links.saturating_sub(1)
        })?;
        self.track(st, src.inode, down);
        self.track(st, src.inode, Some(removal));
        // The replaced inode loses its name once the new entry is on disk.
        if let Some((d, v)) = victim {
            if v.is_dir() {
                // Its ".." counted in the new parent; the moved directory now does.
                if !moving_dir || parent == new_parent {
                    self.modify_inode(op, st, new_parent, &[new_entry], |i| {
                        i.links = i.links.saturating_sub(1)
                    })?;
                }
            }
            self.drop_link(op, st, d.inode, v.is_dir(), Some(new_entry))?;
        }
        Ok(())
    }

    /// RENAME_EXCHANGE: both names stay, pointing at each other's inode.
    fn exchange(
        &self,
        op: &Op<'_>,
        st: &mut State,
        pa: u32,
        a: &Found,
        pb: u32,
        b: &Found,
    ) -> Result<()> {
        if a.inode == b.inode {
            return Ok(());
        }
        let ia = self.read_live_inode(st, a.inode)?;
        let ib = self.read_live_inode(st, b.inode)?;
        if pa != pb {
            if ia.is_dir() && self.is_within(st, pb, a.inode)? {
                return Err(FsError::Invalid("cannot move a directory under itself"));
            }
            if ib.is_dir() && self.is_within(st, pa, b.inode)? {
                return Err(FsError::Invalid("cannot move a directory under itself"));
            }
        }
        // Counts up first, entries next, counts down last: a crash leaves counts too
        // high, never too low.
        let up_a: Vec<PatchId> = self
            .modify_inode(op, st, a.inode, &[], |i| {
                i.links = i.links.saturating_add(1);
                Self::touch_times(i, false, true);
            })?
            .into_iter()
            .collect();
        let up_b: Vec<PatchId> = self
            .modify_inode(op, st, b.inode, &[], |i| {
                i.links = i.links.saturating_add(1);
                Self::touch_times(i, false, true);
            })?
            .into_iter()
            .collect();
        let mut parent_up = Vec::new();
        let delta = ia.is_dir() as i32 - ib.is_dir() as i32;
        if pa != pb && delta != 0 {
            // The parent gaining a subdirectory counts it before the entry points there.
            let gainer = if delta > 0 { pb } else { pa };
            parent_up.extend(
                self.modify_inode(op, st, gainer, &[], |i| i.links = i.links.saturating_add(1))?,
            );
        }
        let mut eb_befores = up_a.clone();
        eb_befores.extend(&parent_up);
        let mut ea_befores = up_b.clone();
        ea_befores.extend(&parent_up);
        let ea = self.retarget_entry(op, a, b.inode, self.ftype(ib.mode as u32), &ea_befores)?;
        let eb = self.retarget_entry(op, b, a.inode, self.ftype(ia.mode as u32), &eb_befores)?;
        let mut after = vec![ea, eb];
        if pa != pb {
            if ia.is_dir() {
                let dd = self.dotdot(st, a.inode)?;
                after.push(self.retarget_entry(op, &dd, pb, self.ftype(libc::S_IFDIR), &[eb])?);
            }
            if ib.is_dir() {
                let dd = self.dotdot(st, b.inode)?;
                after.push(self.retarget_entry(op, &dd, pa, self.ftype(libc::S_IFDIR), &[ea])?);
            }
            if delta != 0 {
                let loser = if delta > 0 { pa } else { pb };
                self.modify_inode(op, st, loser, &after, |i| {
                    i.links = i.links.saturating_sub(1)
                })?;
            }
        }
        for p in [pa, pb] {
            let h = self.modify_inode(op, st, p, &[], |i| Self::touch_times(i, true, true))?;
            self.track(st, p, h);
        }
        for (ino, e) in [(a.inode, ea), (b.inode, eb)] {
            let h =
                self.modify_inode(op, st, ino, &after, |i| i.links = i.links.saturating_sub(1))?;
            self.track(st, ino, h);
            self.track(st, ino, Some(e));
        }
        self.track(st, pa, Some(ea));
        self.track(st, pb, Some(eb));
        st.syncs.named_in(a.inode, pb);
        st.syncs.named_in(b.inode, pa);
        Ok(())
    }
}
