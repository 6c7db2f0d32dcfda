//! Zones (`keys`, "Zones"): how a directory becomes the root of one, and what asks for
//! it. No path then outgrows the tree's key limit, at any depth, and no rename is
//! refused or broken by one:
//!
//! - **creation**: a new directory whose prefix would pass `Betrfs::zone_threshold` is
//!   made a zone's root at once (an empty zone: its record and nothing else); a name
//!   that would not fit in an older image's long directory makes that directory one
//!   first (`fit_name`);
//! - **renames**: a directory that moves with more below it than one batch copies, or
//!   whose copied keys would grow past the limits, becomes a zone's root in the rename's
//!   own batch, and then only its record moves (`Betrfs::plan_move`).
//!
//! Becoming a zone's root is one range rename per key space of what lies below the
//! directory (its keys get shorter), the same cost whatever it holds.

use crate::fs::{Betrfs, Node, State};
use crate::keys::{self, Loc};
use quilt_betree::Batch;
use quilt_vfs::{FsError, Result};
use std::sync::atomic::Ordering::Relaxed;

impl Betrfs {
    /// Into `b`: directory `d` (at a path, not a zone's root) becomes the root of a new
    /// zone, and everything below it moves under the zone's prefix. Sets `d`'s zone; its
    /// record is the caller's to write (where it goes), with the superblock record
    /// (which counts zones) and its index key. Returns the old prefix and the zone's,
    /// for `Betrfs::moved_below`.
    pub(crate) fn zone_in_batch(
        &self,
        st: &mut State,
        b: &mut Batch,
        d: &mut Node,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let Loc::Path(key) = &d.loc else {
            return Err(FsError::Corrupt(format!(
                "directory {} has no path",
                d.inode.ino
            )));
        };
        if d.inode.zone.is_some() {
            return Err(FsError::Corrupt(format!(
                "directory {} is a zone's root already",
                d.inode.ino
            )));
        }
        let old = keys::dir_prefix(key);
        let z = self.new_zone(st, b, d.inode.ino);
        let zp = keys::zone_prefix(z);
        self.rename_ranges(b, &old, &zp, &[keys::META, keys::DATA, keys::INDEX]);
        d.inode.zone = Some(z);
        self.counters.zones_made.fetch_add(1, Relaxed);
        Ok((old, zp))
    }

    /// Directory `dir` becomes a zone's root where it stands, in a batch of its own (an
    /// older image's directory too deep for a new name; atomic by itself, so a crash
    /// after it leaves a zone and nothing else).
    pub(crate) fn make_zone(&self, st: &mut State, dir: u64) -> Result<()> {
        let mut d = self.node(st, dir)?.clone();
        let Loc::Path(key) = d.loc.clone() else {
            return Err(FsError::Corrupt(format!("directory {dir} has no path")));
        };
        let mut b = Batch::new();
        let was_indexed = Self::indexed(&d);
        let below = self.zone_in_batch(st, &mut b, &mut d)?;
        Self::move_orphans(st, &mut b, std::slice::from_ref(&below));
        if !was_indexed {
            b.put(&keys::index_key(&key), b"");
        }
        Self::put_inode(&mut b, &d);
        b.put(
            keys::SUPER,
            &Self::super_record(st, self.errored.load(Relaxed)),
        );
        self.commit(st, b)?;
        Self::move_cached_paths(st, &[], &[below]);
        st.nodes.insert(dir, d);
        Ok(())
    }

    /// Makes room for a name of `len` bytes in directory `dir`: if its key (with a data
    /// block's suffix) would pass the tree's key limit, the directory becomes a zone's
    /// root first. Only directories of images older than zones get there: newer ones
    /// are zones' roots before their prefixes grow that long.
    pub(crate) fn fit_name(&self, st: &mut State, dir: u64, len: usize) -> Result<()> {
        let d = self.dir_node(st, dir)?;
        if d.inode.zone.is_some() || d.inode.nlink == 0 {
            return Ok(());
        }
        let prefix = Self::prefix_of(d)?.len();
        if prefix + 1 + len + 10 <= self.tree.geometry().max_key() {
            return Ok(());
        }
        self.make_zone(st, dir)
    }

    /// Whether directory `anc` is `dir` or one of its ancestors (`dir_key`: `dir`'s
    /// path-key). Within a zone, prefixes tell; across a zone's root, the zone's record
    /// names it, and the walk goes on from its cached path (the kernel holds the
    /// ancestors of every directory it names; the native API never forgets). A zone's
    /// root no longer cached ends the walk: no ancestor found.
    pub(crate) fn is_within(
        &self,
        st: &mut State,
        anc: &Node,
        dir: u64,
        dir_key: &[u8],
    ) -> Result<bool> {
        if dir == anc.inode.ino {
            return Ok(true);
        }
        let anc_prefix = Self::prefix_of(anc)?;
        let mut key = dir_key.to_vec();
        // Bounded: each zone is crossed once on the way up.
        for _ in 0..=st.next_zone {
            if key.starts_with(&anc_prefix) {
                return Ok(true);
            }
            let Some(z) = keys::zone_of(&key) else {
                return Ok(false);
            };
            let root = self.zone_root(st, z)?;
            if root == anc.inode.ino {
                return Ok(true);
            }
            match st.fresh(root).map(|n| n.loc.clone()) {
                Some(Loc::Path(k)) => key = k,
                _ => return Ok(false),
            }
        }
        Err(FsError::Corrupt("zones form a cycle".into()))
    }
}
