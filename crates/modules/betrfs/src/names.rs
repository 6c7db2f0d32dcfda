//! Names: creating inodes, dropping names (and with the last, the inode and its data,
//! or an orphan while a handle is open), moving a file under its number when it gets a
//! second name, and orphans whose data lies where a new name goes.

use crate::fs::{check_name, io, now, Betrfs, Kvs, Node, State, LINK_MAX, RANGE_RENAME_BYTES};
use crate::keys::{self, Loc};
use crate::record::{self, Inode};
use quilt_betree::Batch;
use quilt_vfs::acl::{self, Acl};
use quilt_vfs::{rules, Attr, Ctx, FsError, Result, Timespec};
use std::sync::atomic::Ordering::Relaxed;

impl Betrfs {
    // -----------------------------------------------------------------------------------
    // Creation

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u32,
        target: &[u8],
        ctx: &Ctx,
        tmp: bool,
        want: Option<u64>,
    ) -> Result<Attr> {
        if !tmp {
            check_name(name)?;
        }
        self.room_for_name()?;
        let mut st = self.lock();
        self.writable(&st)?;
        let key = if tmp {
            Vec::new()
        } else {
            self.fit_name(&mut st, parent, name.len())?;
            let (key, existing) = self.lookup_in(&mut st, parent, name)?;
            if existing.is_some() {
                return Err(FsError::Exists);
            }
            self.key_fits(&key)?;
            self.evict_orphans(&mut st, &key, false)?;
            key
        };
        let dir = self.dir_node(&mut st, parent)?.clone();
        if dir.inode.nlink == 0 {
            return Err(FsError::NotFound);
        }
        rules::refuse_new_entry(dir.inode.flags)?;
        let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
        if is_dir && dir.inode.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let (mut mode, mut xattrs) = self.mode_for_new(&dir.inode, mode, ctx.umask)?;
        let gid = if dir.inode.mode & libc::S_ISGID != 0 {
            if is_dir {
                mode |= libc::S_ISGID;
            }
            dir.inode.gid
        } else {
            ctx.gid
        };
        xattrs.sort();
        let t = now();
        let ino = match want {
            None => Self::new_ino(&mut st, parent)?,
            Some(i) => Self::take_granted(&mut st, parent, i)?,
        };
        let nlink = match (tmp, is_dir) {
            (true, _) => 0,
            (false, true) => 2,
            (false, false) => 1,
        };
        let mut inode = Inode {
            rdev,
            flags: rules::inherited_flags(dir.inode.flags, mode),
            target: target.to_vec(),
            xattrs,
            ..Inode::new(ino, mode, ctx.uid, gid, nlink, t)
        };
        let mut b = Batch::new();
        if is_dir && !tmp && keys::dir_prefix(&key).len() > self.zone_threshold() {
            // Deep: a zone's root from the start, so that what is made below it is
            // keyed from here (`zones.rs`).
            inode.zone = Some(self.new_zone(&mut st, &mut b, ino));
            b.put(&keys::index_key(&key), b"");
            self.counters.zones_made.fetch_add(1, Relaxed);
        }
        // The counters the superblock record keeps change only when a number comes
        // from the counter or a zone is made (a granted number was logged with its
        // grant).
        if want.is_none() || inode.zone.is_some() {
            b.put(
                keys::SUPER,
                &Self::super_record(&st, self.errored.load(Relaxed)),
            );
        }
        let loc = if tmp {
            b.put(&keys::orphan_key(ino), b"");
            Loc::Ino(ino)
        } else {
            Loc::Path(key)
        };
        b.put(&loc.meta(), &inode.encode());
        let mut pdir = dir;
        // In a batch, the directory's record is put once after its run of creations
        // (`Betrfs::run_batch`); its node here is what will be put.
        let defer = !tmp && st.deferred.is_some();
        if !tmp {
            if is_dir {
                pdir.inode.nlink += 1;
            }
            pdir.inode.mtime = t;
            pdir.inode.ctime = t;
            if !defer {
                Self::put_inode(&mut b, &pdir);
            }
        }
        self.commit(&mut st, b)?;
        if !tmp {
            st.nodes.insert(parent, pdir);
            if let Some(d) = st.deferred.as_mut() {
                d.insert(parent);
            }
        }
        let attr = self.attr_of(&inode);
        self.insert(&mut st, loc, inode);
        Ok(attr)
    }

    /// Sets aside `count` raw numbers from the counter (see
    /// `FileSystem::grant_inodes`). The counter's new value is logged at once, so that
    /// no number of a grant is handed out again after a crash.
    pub(crate) fn grant(&self, count: u64) -> Result<quilt_vfs::InoGrant> {
        if count == 0 {
            return Err(FsError::Invalid("a grant of no inode numbers"));
        }
        let mut st = self.lock();
        self.writable(&st)?;
        let first = st.next_ino;
        let end = first
            .checked_add(count)
            .filter(|&e| e <= record::RAW_LIMIT)
            .ok_or(FsError::NoSpace)?;
        st.next_ino = end;
        let mut b = Batch::new();
        b.put(
            keys::SUPER,
            &Self::super_record(&st, self.errored.load(Relaxed)),
        );
        self.commit(&mut st, b)?;
        st.grants.push((first, end));
        Ok(quilt_vfs::InoGrant {
            first: record::compose(0, first),
            count,
        })
    }

    /// Sets aside again an earlier mount's grant: numbers below the logged counter
    /// (so never handed out since), of the first namespace, not held already.
    pub(crate) fn hold(&self, g: quilt_vfs::InoGrant) -> Result<()> {
        let mut st = self.lock();
        self.writable(&st)?;
        let first = g.first & (record::RAW_LIMIT - 1);
        let end = first.checked_add(g.count);
        let ok = record::ns_of(g.first) == 0
            && g.count > 0
            && first > 0
            && end.is_some_and(|e| e <= st.next_ino);
        let Some(end) = end.filter(|_| ok) else {
            return Err(FsError::Invalid(
                "inode numbers this file system never granted",
            ));
        };
        if st.grants.iter().any(|&(a, b)| a < end && first < b) {
            return Err(FsError::Invalid("inode numbers already set aside"));
        }
        st.grants.push((first, end));
        Ok(())
    }

    /// The mode and ACLs of a new inode: the directory's default ACL limited by the
    /// mode (directories keep it as theirs), or the umask without one. Symlinks take
    /// neither.
    pub(crate) fn mode_for_new(&self, dir: &Inode, mode: u32, umask: u32) -> Result<(u32, Kvs)> {
        if mode & libc::S_IFMT == libc::S_IFLNK {
            return Ok((mode, Vec::new()));
        }
        let default = match (self.opts.acl, dir.xattr(acl::DEFAULT)) {
            (true, Some(v)) => Some(Acl::from_xattr(v)?),
            _ => None,
        };
        let Some(d) = default else {
            return Ok((mode & !(umask & 0o777), Vec::new()));
        };
        let (access, mode) = d.inherit(mode);
        let mut x = Vec::new();
        if let Some(a) = access {
            x.push((acl::ACCESS.to_vec(), a.to_xattr()));
        }
        if mode & libc::S_IFMT == libc::S_IFDIR {
            x.push((acl::DEFAULT.to_vec(), d.to_xattr()));
        }
        Ok((mode, x))
    }

    // -----------------------------------------------------------------------------------
    // Removal

    /// Whether directory `n` has any entry.
    pub(crate) fn has_children(&self, n: &Node) -> Result<bool> {
        let lo = keys::meta_key(&keys::child_key(&Self::prefix_of(n)?, b""));
        let hi = keys::prefix_end(&lo);
        // (Limited: one entry answers; keys-only: its record is not copied out, and an
        // entry alone in its basement is answered from the leaf's index.)
        match self.tree.keys(&lo, Some(&hi)).limit(1).next_key() {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(io(e)),
        }
    }

    /// Drops one name of `child` (named `key`) into batch `b`: the name, and the inode
    /// and its data when that was the last name and nobody has it open. `reuse`: the
    /// same operation puts another file's data under `key` (a rename over it). Returns
    /// what the in-memory node becomes (None: gone).
    pub(crate) fn drop_name(
        &self,
        st: &mut State,
        b: &mut Batch,
        key: &[u8],
        child: &Node,
        t: Timespec,
        reuse: bool,
    ) -> Result<Option<Node>> {
        let mut n = child.clone();
        n.inode.ctime = t;
        if Self::indexed(child) {
            b.delete(&keys::index_key(key));
        }
        if n.inode.is_dir() {
            b.delete(&keys::meta_key(key));
            if let Some(z) = n.inode.zone {
                // (Empty: only an empty directory goes.)
                b.delete(&keys::zone_key(z));
                st.zones.remove(&z);
            }
            return Ok(None);
        }
        match &child.loc {
            Loc::Path(_) => {
                if child.opens > 0 && reuse {
                    // Open, and its path's data keys are about to be another file's:
                    // it moves under its number (a copy).
                    n.inode.nlink = 0;
                    self.to_inode_space(st, b, &mut n, 0)?;
                    b.put(&keys::orphan_key(n.inode.ino), b"");
                    return Ok(Some(n));
                }
                if child.opens > 0 {
                    // Open: it lives on until the last release, its inode under its
                    // number, its data where it is.
                    let ino = n.inode.ino;
                    n.inode.nlink = 0;
                    n.loc = Loc::Orphan {
                        path: key.to_vec(),
                        ino,
                    };
                    b.delete(&keys::meta_key(key));
                    Self::put_inode(b, &n);
                    b.put(&keys::orphan_key(ino), key);
                    st.by_path.remove(&key.to_vec());
                    st.orphan_paths.insert(key.to_vec(), ino);
                    return Ok(Some(n));
                }
                b.delete(&keys::meta_key(key));
                self.delete_data(b, &child.loc, child.inode.size);
                Ok(None)
            }
            Loc::Orphan { .. } => Err(FsError::Corrupt(format!(
                "an orphan ({}) is named at {key:?}",
                child.inode.ino
            ))),
            Loc::Ino(ino) => {
                b.delete(&keys::meta_key(key));
                n.inode.nlink = n.inode.nlink.saturating_sub(1);
                if n.inode.nlink > 0 {
                    Self::put_inode(b, &n);
                    return Ok(Some(n));
                }
                if child.opens > 0 {
                    Self::put_inode(b, &n);
                    b.put(&keys::orphan_key(*ino), b"");
                    return Ok(Some(n));
                }
                b.delete(&keys::inode_key(*ino));
                self.delete_data(b, &child.loc, child.inode.size);
                Ok(None)
            }
        }
    }

    /// Moves a file stored under its path to its number (the `h`/`e` spaces), with
    /// `extra` more names than it has now, in batch `b`: a small file's data keys are
    /// copied, a larger file's move by one range rename of the tree (the same cost at
    /// any size).
    pub(crate) fn to_inode_space(
        &self,
        st: &mut State,
        b: &mut Batch,
        n: &mut Node,
        extra: u32,
    ) -> Result<()> {
        let (path, named) = match n.loc.clone() {
            Loc::Path(p) => (p, true),
            Loc::Orphan { path, .. } => (path, false),
            Loc::Ino(_) => return Ok(()),
        };
        let ino = n.inode.ino;
        let from = n.loc.data_prefix();
        let to = Loc::Ino(ino);
        let to_prefix = to.data_prefix();
        let mut copies = Batch::new();
        let mut bytes = 0usize;
        for kv in self.tree.range(&from, Some(&keys::prefix_end(&from))) {
            let (k, v) = kv.map_err(io)?;
            let Some(blk) = keys::block_of(&from, &k) else {
                return Err(FsError::Corrupt("a data key of the wrong length".into()));
            };
            bytes += k.len() + v.len();
            if bytes > RANGE_RENAME_BYTES {
                break;
            }
            let mut nk = to_prefix.clone();
            nk.extend_from_slice(&blk.to_be_bytes());
            copies.put(&nk, &v);
        }
        if bytes > RANGE_RENAME_BYTES {
            b.rename_prefix(&from, &to_prefix);
            self.counters.range_renames.fetch_add(1, Relaxed);
        } else {
            b.ops.append(&mut copies.ops);
            b.delete_range(&from, &keys::prefix_end(&from));
        }
        if named {
            b.delete(&keys::meta_key(&path));
        } else {
            // Still an orphan, now wholly under its number.
            b.put(&keys::orphan_key(ino), b"");
            st.orphan_paths.remove(&path);
        }
        n.inode.nlink += extra;
        n.loc = to;
        // Under its number the record holds its whole number: no marker.
        n.inode.marker = None;
        b.put(&n.loc.meta(), &n.inode.encode());
        st.by_path.remove(&path);
        Ok(())
    }

    pub(crate) fn remove(&self, parent: u64, name: &[u8], dir: bool) -> Result<()> {
        let mut st = self.lock();
        self.writable(&st)?;
        if name == b"." {
            return Err(FsError::Invalid("rmdir of ."));
        }
        if name == b".." {
            return Err(FsError::NotEmpty);
        }
        let (key, child) = self.lookup_in(&mut st, parent, name)?;
        let child = child.ok_or(FsError::NotFound)?;
        let c = self.node(&mut st, child)?.clone();
        let p = self.node(&mut st, parent)?.clone();
        // The kernel's may_delete: the flags before the type and emptiness.
        rules::refuse_removal(p.inode.flags, c.inode.flags)?;
        if dir {
            if !c.inode.is_dir() {
                return Err(FsError::NotDir);
            }
            if self.has_children(&c)? {
                return Err(FsError::NotEmpty);
            }
        } else if c.inode.is_dir() {
            return Err(FsError::IsDir);
        }
        let t = now();
        let mut b = Batch::new();
        let after = self.drop_name(&mut st, &mut b, &key, &c, t, false)?;
        let mut p = p;
        if dir {
            p.inode.nlink = p.inode.nlink.saturating_sub(1);
        }
        p.inode.mtime = t;
        p.inode.ctime = t;
        Self::put_inode(&mut b, &p);
        self.commit(&mut st, b)?;
        st.nodes.insert(parent, p);
        st.by_path.remove(&key);
        match after {
            Some(n) => {
                st.nodes.insert(child, n);
            }
            // Gone: what the kernel may still hold is a reference without a handle,
            // through which it reads nothing (a later use is ESTALE).
            None => self.forget(&mut st, child),
        }
        Ok(())
    }

    /// Frees an inode with no names once nobody has it open.
    pub(crate) fn destroy(&self, st: &mut State, ino: u64) -> Result<()> {
        let Some(n) = st.fresh(ino).map(|n| n.clone()) else {
            return Ok(());
        };
        if n.opens > 0 || n.inode.nlink > 0 || self.opts.read_only {
            return Ok(());
        }
        // (References without a handle may remain: they reach no data.)
        match &n.loc {
            Loc::Ino(i) | Loc::Orphan { ino: i, .. } if !n.inode.is_dir() => {
                let mut b = Batch::new();
                b.delete(&keys::inode_key(*i));
                b.delete(&keys::orphan_key(*i));
                self.delete_data(&mut b, &n.loc, n.inode.size);
                self.commit(st, b)?;
                if let Loc::Orphan { path, .. } = &n.loc {
                    st.orphan_paths.remove(path);
                }
            }
            _ => {}
        }
        self.forget(st, ino);
        Ok(())
    }

    /// Before a name appears at path-key `key` (and, for a directory moving in, below
    /// it): orphans whose data still lies there move it under their numbers, so the new
    /// file's data and theirs never share keys. Rare: the kernel forgets most unlinked
    /// files at once.
    pub(crate) fn evict_orphans(&self, st: &mut State, key: &[u8], subtree: bool) -> Result<()> {
        let mut victims: Vec<u64> = st.orphan_paths.get(key).copied().into_iter().collect();
        if subtree {
            let p = keys::dir_prefix(key);
            victims.extend(
                st.orphan_paths
                    .range(p.clone()..keys::prefix_end(&p))
                    .map(|(_, &i)| i),
            );
        }
        for ino in victims {
            let Some(mut n) = st.fresh(ino).map(|n| n.clone()) else {
                continue;
            };
            let mut b = Batch::new();
            self.to_inode_space(st, &mut b, &mut n, 0)?;
            self.commit(st, b)?;
            st.nodes.insert(ino, n);
        }
        Ok(())
    }

    /// Orphans whose data lies below moved prefixes (old → new, simultaneous) travel
    /// with it: their paths and markers follow (into `b`, with the move).
    pub(crate) fn move_orphans(st: &mut State, b: &mut Batch, below: &[(Vec<u8>, Vec<u8>)]) {
        let mut changed = Vec::new();
        for (from, to) in below {
            changed.extend(crate::rename::rebased(&st.orphan_paths, from, to));
        }
        for (old, _, _) in &changed {
            st.orphan_paths.remove(old);
        }
        for (_, new, ino) in changed {
            b.put(&keys::orphan_key(ino), &new);
            st.orphan_paths.insert(new.clone(), ino);
            if let Some(n) = st.nodes.get_mut(&ino) {
                n.loc = Loc::Orphan { path: new, ino };
            }
        }
    }
}
