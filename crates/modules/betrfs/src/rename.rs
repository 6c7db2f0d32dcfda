//! Renames: what moves with a name (a directory's whole subtree, a file's data), in
//! one batch: small ones as copies of their keys, larger ones as range renames of the
//! tree (`Batch::rename_prefix`); the cache's paths and orphans follow.

use crate::fs::{
    check_name, io, now, Betrfs, Kvs, Node, State, LINK_MAX, POINT_DELETES_MAX, RANGE_RENAME_BYTES,
};
use crate::keys::{self, Loc};
use crate::record::{Entry, Inode};
use quilt_betree::Batch;
use quilt_vfs::{rules, Ctx, FsError, RenameFlags, Result, Timespec};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

impl Betrfs {
    /// What moves with entry `n` when its key goes from `from_key` to `to_key`, and
    /// into `b` what must come first: a file's data keys; a directory's subtree, copied
    /// when small and within the limits at its new place, else the directory becomes a
    /// zone's root here (`zones.rs`) and nothing below it moves (as for a zone's root
    /// already). Returns the move below (None: nothing) and, for a directory made a
    /// zone's root, its old prefix and the zone's.
    #[allow(clippy::type_complexity)]
    pub(crate) fn plan_move(
        &self,
        st: &mut State,
        b: &mut Batch,
        n: &mut Node,
        from_key: &[u8],
        to_key: &[u8],
    ) -> Result<(Option<Below>, Option<(Vec<u8>, Vec<u8>)>)> {
        if !n.inode.is_dir() {
            let (from, to) = ([from_key, &[0]].concat(), [to_key, &[0]].concat());
            const DATA: &[u8] = &[keys::DATA];
            let list = self.collect(&from, DATA, RANGE_RENAME_BYTES)?;
            let below = Below {
                from,
                to,
                spaces: DATA,
                list,
            };
            return Ok((Some(below), None));
        }
        if n.inode.zone.is_some() {
            return Ok((None, None));
        }
        const TREE: &[u8] = &[keys::META, keys::DATA, keys::INDEX];
        let (from, to) = (keys::dir_prefix(from_key), keys::dir_prefix(to_key));
        if let Some(list) = self.collect(&from, TREE, RANGE_RENAME_BYTES)? {
            // The keys copied to their new place stay within the limits: every path
            // as long as a directory's prefix may be, every data key within the tree's.
            let path_max = self.zone_threshold() + 16;
            let key_max = self.tree.geometry().max_key();
            let grown = |len: usize| (len + to.len()).saturating_sub(from.len());
            let fits = to.len() <= path_max
                && list.iter().all(|(k, _)| match k.first() {
                    Some(&keys::DATA) => grown(k.len()) <= key_max,
                    _ => grown(k.len() - 1) <= path_max,
                });
            if fits {
                let below = Below {
                    from,
                    to,
                    spaces: TREE,
                    list: Some(list),
                };
                return Ok((Some(below), None));
            }
        }
        let zoned = self.zone_in_batch(st, b, n)?;
        Ok((None, Some(zoned)))
    }

    /// Every key under `prefix` in `spaces`, or `None` past `limit` bytes.
    pub(crate) fn collect(
        &self,
        prefix: &[u8],
        spaces: &[u8],
        limit: usize,
    ) -> Result<Option<Kvs>> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for &space in spaces {
            let mut lo = vec![space];
            lo.extend_from_slice(prefix);
            for kv in self.tree.range(&lo, Some(&keys::prefix_end(&lo))) {
                let (k, v) = kv.map_err(io)?;
                bytes += k.len() + v.len();
                if bytes > limit {
                    return Ok(None);
                }
                out.push((k, v));
            }
        }
        Ok(Some(out))
    }

    /// Into `b`: every move's old ranges deleted, then its keys put under the new
    /// prefix (all deletes first: an exchange puts keys where the other move deletes).
    #[allow(clippy::type_complexity)]
    pub(crate) fn emit_moves(
        &self,
        b: &mut Batch,
        moves: Vec<(&[u8], &[u8], &[u8], Kvs)>,
    ) -> Result<()> {
        for (from, _, spaces, list) in &moves {
            if list.len() as u64 <= POINT_DELETES_MAX {
                // What was collected is all the range holds (under our lock): point
                // deletes, which a buffer searches by key (see `delete_blocks`).
                for (k, _) in list {
                    b.delete(k);
                }
                continue;
            }
            for &space in spaces.iter() {
                let mut lo = vec![space];
                lo.extend_from_slice(from);
                b.delete_range(&lo, &keys::prefix_end(&lo));
            }
        }
        for (from, to, _, list) in moves {
            self.counters
                .keys_moved
                .fetch_add(list.len() as u64, Relaxed);
            for (k, v) in list {
                let nk = keys::rebase(&k, from, to)
                    .ok_or_else(|| FsError::Corrupt("a key outside its range".into()))?;
                b.put(&nk, &v);
            }
        }
        Ok(())
    }

    /// Moves every key under `from` to `to` in chunks, each one batch (puts of the new
    /// keys and deletes of the old). An intent naming the move was committed before;
    /// after a crash, mount finishes the move (`recover`).
    pub(crate) fn move_chunked(
        &self,
        st: &mut State,
        from: &[u8],
        to: &[u8],
        spaces: &[u8],
    ) -> Result<()> {
        for &space in spaces {
            let mut lo = vec![space];
            lo.extend_from_slice(from);
            let hi = keys::prefix_end(&lo);
            loop {
                let mut b = Batch::new();
                let mut bytes = 0usize;
                for kv in self.tree.range(&lo, Some(&hi)) {
                    let (k, v) = kv.map_err(io)?;
                    bytes += k.len() + v.len();
                    let nk = keys::rebase(&k, from, to)
                        .ok_or_else(|| FsError::Corrupt("a key outside its range".into()))?;
                    b.put(&nk, &v);
                    b.delete(&k);
                    if bytes > self.batch_bytes {
                        break;
                    }
                }
                if b.ops.is_empty() {
                    break;
                }
                self.counters
                    .keys_moved
                    .fetch_add(b.ops.len() as u64 / 2, Relaxed);
                self.commit(st, b)?;
            }
        }
        Ok(())
    }

    /// Into `b`: one range rename per key space of everything under `from` to `to`
    /// (a scratch prefix is its own: it is used with the spaces' bytes after it).
    pub(crate) fn rename_ranges(&self, b: &mut Batch, from: &[u8], to: &[u8], spaces: &[u8]) {
        let full = |p: &[u8], space: u8| {
            if p.first() == Some(&keys::SCRATCH) {
                [p, &[space]].concat()
            } else {
                [&[space], p].concat()
            }
        };
        for &space in spaces {
            b.rename_prefix(&full(from, space), &full(to, space));
        }
        self.counters.range_renames.fetch_add(1, Relaxed);
    }

    /// Into `b`: one move below an entry, by copies or by range renames.
    pub(crate) fn emit_below(&self, b: &mut Batch, m: Below) -> Result<()> {
        match m.list {
            Some(list) => self.emit_moves(b, vec![(&m.from, &m.to, m.spaces, list)]),
            None => {
                self.rename_ranges(b, &m.from, &m.to, m.spaces);
                Ok(())
            }
        }
    }

    /// The cache's paths after moves of entries (`from` key → `to` key), all at once
    /// (an exchange swaps two), and of what lay below them (`below`: old prefix → new,
    /// simultaneous): the entries themselves now, what lies below when it is next taken
    /// (`State::fresh`: a rename costs the same whatever the kernel holds below it).
    pub(crate) fn move_cached_paths(
        st: &mut State,
        moves: &[(Vec<u8>, Vec<u8>)],
        below: &[(Vec<u8>, Vec<u8>)],
    ) {
        let changed: Vec<(Vec<u8>, Vec<u8>, u64)> = moves
            .iter()
            .filter_map(|(from, to)| {
                let ino = *st.by_path.get(from)?;
                Some((from.clone(), to.clone(), ino))
            })
            .collect();
        for (old, _, ino) in &changed {
            if st.by_path.get(old) == Some(ino) {
                st.by_path.remove(old);
            }
        }
        for (_, new, ino) in changed {
            st.by_path.insert(new.clone(), ino);
            if let Some(n) = st.fresh(ino) {
                n.loc = Loc::Path(new);
            }
        }
        if !below.is_empty() {
            st.push_moves(below.to_vec());
        }
    }

    /// An entry moving into directory `dir` keeps its number (and the numbers below it):
    /// a record of another namespace than the directory's gets a marker naming its own.
    pub(crate) fn keep_number(n: &mut Node, dir: u64) {
        let ns = crate::record::ns_of(n.inode.ino);
        if matches!(n.loc, Loc::Path(_))
            && n.inode.marker.is_none()
            && ns != crate::record::ns_of(dir)
        {
            n.inode.marker = Some(ns);
        }
    }

    /// What a name's key holds for `n`: its inode, or a link stub.
    pub(crate) fn entry_bytes(n: &Node) -> Vec<u8> {
        match n.loc {
            Loc::Path(_) => n.inode.encode(),
            Loc::Ino(i) | Loc::Orphan { ino: i, .. } => Entry::link_stub(i, n.inode.mode),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn do_rename(
        &self,
        parent: u64,
        name: &[u8],
        new_parent: u64,
        new_name: &[u8],
        flags: RenameFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        if flags.exchange && (flags.noreplace || flags.whiteout) {
            return Err(FsError::Invalid("RENAME_EXCHANGE with other flags"));
        }
        if name == b"." || name == b".." || new_name == b"." || new_name == b".." {
            return Err(FsError::Busy);
        }
        check_name(new_name)?;
        let mut st = self.lock();
        self.writable(&st)?;
        self.fit_name(&mut st, new_parent, new_name.len())?;
        let counters_before = (st.next_ino, st.next_zone);
        let (skey, src) = self.lookup_in(&mut st, parent, name)?;
        let src = src.ok_or(FsError::NotFound)?;
        let (dkey, dst) = self.lookup_in(&mut st, new_parent, new_name)?;
        let mut s = self.node(&mut st, src)?.clone();
        let mut sp = self.node(&mut st, parent)?.clone();
        let mut dp = self.node(&mut st, new_parent)?.clone();
        if dp.inode.nlink == 0 {
            return Err(FsError::NotFound);
        }
        if flags.exchange && dst.is_none() {
            return Err(FsError::NotFound);
        }
        if flags.noreplace && dst.is_some() {
            return Err(FsError::Exists);
        }
        if dst == Some(src) {
            // Two names of one inode (or the same name): nothing to do.
            return Ok(());
        }
        let d = dst.map(|d| self.node(&mut st, d).cloned()).transpose()?;
        let s_dir = s.inode.is_dir();
        let (Loc::Path(sp_key), Loc::Path(dp_key)) = (sp.loc.clone(), dp.loc.clone()) else {
            return Err(FsError::Corrupt("a directory without a path".into()));
        };
        // A directory may not move under itself.
        if s_dir && self.is_within(&mut st, &s, new_parent, &dp_key)? {
            return Err(FsError::Invalid("a directory cannot move into itself"));
        }
        if let Some(d) = &d {
            if d.inode.is_dir() && self.is_within(&mut st, d, parent, &sp_key)? {
                return Err(if flags.exchange {
                    FsError::Invalid("a directory cannot move into itself")
                } else {
                    FsError::NotEmpty
                });
            }
            if !flags.exchange {
                if s_dir && !d.inode.is_dir() {
                    return Err(FsError::NotDir);
                }
                if !s_dir && d.inode.is_dir() {
                    return Err(FsError::IsDir);
                }
                if d.inode.is_dir() && self.has_children(d)? {
                    return Err(FsError::NotEmpty);
                }
            }
        }
        rules::refuse_removal(sp.inode.flags, s.inode.flags)?;
        match &d {
            Some(d) => rules::refuse_removal(dp.inode.flags, d.inode.flags)?,
            None => rules::refuse_new_entry(dp.inode.flags)?,
        }
        let cross = parent != new_parent;
        if cross && s_dir && d.is_none() && dp.inode.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        if !flags.exchange {
            self.evict_orphans(&mut st, &dkey, s_dir && s.inode.zone.is_none())?;
        }
        let t = now();
        s.inode.ctime = t;
        let mut b = Batch::new();
        let s_was = Self::indexed(&s);
        // Directories that become zones' roots here go first in the batch (their
        // subtrees leave for their zones before anything else lands).
        let (s_below, s_zoned) = self.plan_move(&mut st, &mut b, &mut s, &skey, &dkey)?;
        // What moved below directories, for the cache's paths and the orphans.
        let mut below_dirs: Vec<(Vec<u8>, Vec<u8>)> = s_zoned.into_iter().collect();
        if flags.exchange {
            let mut d = d.expect("checked above");
            let d_dir = d.inode.is_dir();
            d.inode.ctime = t;
            if cross {
                sp.inode.nlink = sp.inode.nlink + d_dir as u32 - s_dir as u32;
                dp.inode.nlink = dp.inode.nlink + s_dir as u32 - d_dir as u32;
            }
            let d_was = Self::indexed(&d);
            let (d_below, d_zoned) = self.plan_move(&mut st, &mut b, &mut d, &dkey, &skey)?;
            below_dirs.extend(d_zoned);
            for (below, dir) in [(&s_below, s_dir), (&d_below, d_dir)] {
                if let (Some(m), true) = (below, dir) {
                    below_dirs.push((m.from.clone(), m.to.clone()));
                }
            }
            match (s_below, d_below) {
                (Some(sm), Some(dm)) if sm.list.is_some() && dm.list.is_some() => {
                    self.emit_moves(
                        &mut b,
                        vec![
                            (&sm.from, &sm.to, sm.spaces, sm.list.unwrap_or_default()),
                            (&dm.from, &dm.to, dm.spaces, dm.list.unwrap_or_default()),
                        ],
                    )?;
                }
                (Some(sm), Some(dm)) => {
                    // Through a scratch prefix (its own key space), all in one batch.
                    let mut tmp = vec![keys::SCRATCH];
                    tmp.extend_from_slice(&st.next_ino.to_be_bytes());
                    st.next_ino += 1;
                    self.rename_ranges(&mut b, &sm.from, &tmp, sm.spaces);
                    self.rename_ranges(&mut b, &dm.from, &dm.to, dm.spaces);
                    self.rename_ranges(&mut b, &tmp, &sm.to, sm.spaces);
                }
                (Some(m), None) | (None, Some(m)) => self.emit_below(&mut b, m)?,
                (None, None) => {}
            }
            let moves = [(skey.clone(), dkey.clone()), (dkey.clone(), skey.clone())];
            Self::move_cached_paths(&mut st, &moves, &below_dirs);
            // Orphans whose data lies in either tree travel with it.
            Self::move_orphans(&mut st, &mut b, &below_dirs);
            s.loc = st.fresh(src).map_or(s.loc, |n| n.loc.clone());
            d.loc = st.fresh(d.inode.ino).map_or(d.loc, |n| n.loc.clone());
            Self::keep_number(&mut s, dp.inode.ino);
            Self::keep_number(&mut d, sp.inode.ino);
            for (was, key) in [(s_was, &skey), (d_was, &dkey)] {
                if was {
                    b.delete(&keys::index_key(key));
                }
            }
            for (n, key) in [(&s, &dkey), (&d, &skey)] {
                if Self::indexed(n) {
                    b.put(&keys::index_key(key), b"");
                }
            }
            b.put(&keys::meta_key(&dkey), &Self::entry_bytes(&s));
            b.put(&keys::meta_key(&skey), &Self::entry_bytes(&d));
            if let Loc::Ino(_) = d.loc {
                Self::put_inode(&mut b, &d);
            }
            st.nodes.insert(d.inode.ino, d);
        } else {
            let mut dst_after = None;
            if let Some(d) = &d {
                if d.inode.is_dir() {
                    dp.inode.nlink = dp.inode.nlink.saturating_sub(1);
                }
                dst_after = Some((
                    d.inode.ino,
                    self.drop_name(&mut st, &mut b, &dkey, d, t, true)?,
                ));
                st.by_path.remove(&dkey);
            }
            if s_dir && cross {
                sp.inode.nlink = sp.inode.nlink.saturating_sub(1);
                dp.inode.nlink += 1;
            }
            b.delete(&keys::meta_key(&skey));
            if let Some(m) = s_below {
                if s_dir {
                    below_dirs.push((m.from.clone(), m.to.clone()));
                }
                self.emit_below(&mut b, m)?;
            }
            Self::move_cached_paths(&mut st, &[(skey.clone(), dkey.clone())], &below_dirs);
            Self::move_orphans(&mut st, &mut b, &below_dirs);
            s.loc = st.fresh(src).map_or(s.loc, |n| n.loc.clone());
            Self::keep_number(&mut s, dp.inode.ino);
            if s_was {
                b.delete(&keys::index_key(&skey));
            }
            if Self::indexed(&s) {
                b.put(&keys::index_key(&dkey), b"");
            }
            b.put(&keys::meta_key(&dkey), &Self::entry_bytes(&s));
            if flags.whiteout {
                let ino = Self::new_ino(&mut st, parent)?;
                let w = Inode::new(ino, libc::S_IFCHR, ctx.uid, ctx.gid, 1, t);
                b.put(&keys::meta_key(&skey), &w.encode());
            }
            match dst_after {
                Some((ino, Some(n))) => {
                    st.nodes.insert(ino, n);
                }
                Some((ino, None)) => {
                    st.nodes.remove(&ino);
                }
                None => {}
            }
        }
        // Counters taken (a whiteout's number, a scratch prefix, a zone).
        if (st.next_ino, st.next_zone) != counters_before {
            b.put(
                keys::SUPER,
                &Self::super_record(&st, self.errored.load(Relaxed)),
            );
        }
        self.finish_parents(&mut st, &mut b, &mut s, &mut sp, &mut dp, t, cross);
        self.commit(&mut st, b)?;
        self.store_nodes(&mut st, src, s, parent, sp, new_parent, dp, cross);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish_parents(
        &self,
        st: &mut State,
        b: &mut Batch,
        s: &mut Node,
        sp: &mut Node,
        dp: &mut Node,
        t: Timespec,
        cross: bool,
    ) {
        if !cross {
            // One directory: what happened to the target's side counts for it.
            sp.inode.nlink = dp.inode.nlink;
        }
        sp.inode.mtime = t;
        sp.inode.ctime = t;
        dp.inode.mtime = t;
        dp.inode.ctime = t;
        // Paths may have moved under the parents' own records (an exchange of a
        // directory above one of them).
        sp.loc = st
            .fresh(sp.inode.ino)
            .map_or(sp.loc.clone(), |n| n.loc.clone());
        dp.loc = st
            .fresh(dp.inode.ino)
            .map_or(dp.loc.clone(), |n| n.loc.clone());
        if let Loc::Ino(_) = s.loc {
            Self::put_inode(b, s);
        }
        if cross {
            Self::put_inode(b, dp);
        }
        Self::put_inode(b, sp);
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn store_nodes(
        &self,
        st: &mut State,
        src: u64,
        s: Node,
        parent: u64,
        sp: Node,
        new_parent: u64,
        dp: Node,
        cross: bool,
    ) {
        if cross {
            st.nodes.insert(new_parent, dp);
        }
        st.nodes.insert(parent, sp);
        st.nodes.insert(src, s);
    }
}

/// The entries of `map` below prefix `pf`, with their keys as they are once it moves
/// to `pt`: (old key, new key, inode).
pub(crate) fn rebased(
    map: &BTreeMap<Vec<u8>, u64>,
    pf: &[u8],
    pt: &[u8],
) -> Vec<(Vec<u8>, Vec<u8>, u64)> {
    map.range(pf.to_vec()..keys::prefix_end(pf))
        .map(|(k, &ino)| {
            let mut nk = pt.to_vec();
            nk.extend_from_slice(&k[pf.len()..]);
            (k.clone(), nk, ino)
        })
        .collect()
}

/// What moves below an entry whose key changes (see `Betrfs::plan_move`).
pub(crate) struct Below {
    pub from: Vec<u8>,
    pub to: Vec<u8>,
    pub spaces: &'static [u8],
    /// Its keys, when few enough to copy (`None`: one range rename per key space).
    pub list: Option<Kvs>,
}
