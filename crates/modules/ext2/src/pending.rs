//! What the module remembers about patches that may not be durable yet, in two parts
//! of [`State`](crate::fs::State) that own their maps: [`Syncs`], what an fsync of
//! each inode must make durable, and [`Frees`], blocks and inodes freed by such
//! patches. Both forget what became durable (`Engine::is_durable`, O(1)) when they
//! grow, so memory is bounded by what is pending, not by everything ever touched.

use quilt_patch::{Engine, PatchId};
use rustc_hash::FxHashMap as HashMap;

/// Fsync lists longer than this fold into one empty patch.
const HEADS_FOLD: usize = 32;
/// The least size at which `Syncs` is pruned.
const HEADS_PRUNE_MIN: usize = 4096;
/// The least size at which the maps of pending frees are pruned.
const FREED_PRUNE_MIN: usize = 65536;
/// Directories followed up from a file by one fsync, at most (a loop in a damaged
/// image's parents ends there).
const FSYNC_CHAIN_MAX: usize = 4096;

/// Per inode, the patches an fsync of it must make durable; and the directory each
/// inode was last given a name in while that name may not be durable, so that fsync
/// follows it up: a fsynced file is also reachable, as soft updates' fsync does for new
/// parent directories.
pub(crate) struct Syncs {
    heads: HashMap<u32, Vec<PatchId>>,
    parents: HashMap<u32, u32>,
    /// Pruned when `heads` reaches this many inodes.
    prune_at: usize,
}

impl Default for Syncs {
    fn default() -> Syncs {
        Syncs {
            heads: HashMap::default(),
            parents: HashMap::default(),
            prune_at: HEADS_PRUNE_MIN,
        }
    }
}

impl Syncs {
    /// An fsync of `ino` must make `head` durable.
    pub fn track(&mut self, engine: &Engine, ino: u32, head: PatchId) {
        if self.heads.len() >= self.prune_at {
            self.prune(engine);
        }
        let list = self.heads.entry(ino).or_default();
        list.push(head);
        if list.len() > HEADS_FOLD {
            let all = std::mem::take(list);
            let e = engine.empty(&all);
            self.heads.insert(ino, vec![e]);
        }
    }

    /// `ino` was given a name in directory `parent`.
    pub fn named_in(&mut self, ino: u32, parent: u32) {
        self.parents.insert(ino, parent);
    }

    /// Forgets `ino` (freed).
    pub fn forget(&mut self, ino: u32) {
        self.heads.remove(&ino);
    }

    /// Forgets every inode's list (after a sync made everything durable).
    pub fn clear(&mut self) {
        self.heads.clear();
    }

    /// Takes what an fsync of `ino` must make durable: its own list, and with
    /// `with_names` those of the directories up the chain its name was made in, up to
    /// `root` (each may hold a name of the next that is not durable yet).
    pub fn take_for_fsync(&mut self, ino: u32, with_names: bool, root: u32) -> Vec<PatchId> {
        let mut heads = self.heads.remove(&ino).unwrap_or_default();
        let mut cur = if with_names {
            self.parents.get(&ino).copied()
        } else {
            None
        };
        let mut steps = 0;
        while let Some(d) = cur {
            steps += 1;
            if steps > FSYNC_CHAIN_MAX {
                break;
            }
            heads.extend(self.heads.remove(&d).unwrap_or_default());
            if d == root {
                break;
            }
            cur = self.parents.get(&d).copied();
        }
        heads
    }

    /// Forgets lists whose patches are durable, and the names of inodes with none.
    pub fn prune(&mut self, engine: &Engine) {
        self.heads.retain(|_, l| {
            l.retain(|&p| !engine.is_durable(p));
            !l.is_empty()
        });
        let heads = &self.heads;
        self.parents.retain(|ino, _| heads.contains_key(ino));
        // Whatever is still pending stays; look again when the map has doubled.
        self.prune_at = (self.heads.len() * 2).max(HEADS_PRUNE_MIN);
    }
}

/// Blocks freed while the patch that removed their last pointer may not be durable
/// (their next contents must wait for it), and inodes freed while the bitmap patch
/// freeing them may not be (allocation passes over them while it can,
/// `alloc::find_fresh`).
pub(crate) struct Frees {
    blocks: HashMap<u32, PatchId>,
    inodes: HashMap<u32, PatchId>,
    /// Pruned when one map reaches this many entries; the mark then moves to twice
    /// what stays: in the journal modes a whole transaction's frees stay pending, and a
    /// fixed mark made every free past it pay a scan of the map. Each prune is paid
    /// for by the inserts since the last one.
    prune_at: usize,
}

impl Default for Frees {
    fn default() -> Frees {
        Frees {
            blocks: HashMap::default(),
            inodes: HashMap::default(),
            prune_at: FREED_PRUNE_MIN,
        }
    }
}

impl Frees {
    /// The patch that freed `blk`, if it was freed since the last prune.
    pub fn block(&self, blk: u32) -> Option<PatchId> {
        self.blocks.get(&blk).copied()
    }

    /// The patch that freed inode `ino`, if it was freed since the last prune.
    pub fn inode(&self, ino: u32) -> Option<PatchId> {
        self.inodes.get(&ino).copied()
    }

    /// `blk`'s next contents must wait for `by`.
    pub fn free_block(&mut self, engine: &Engine, blk: u32, by: PatchId) {
        self.blocks.insert(blk, by);
        if self.blocks.len() >= self.prune_at {
            self.prune(engine);
        }
    }

    /// Inode `ino` stays unused until `by` is durable.
    pub fn free_inode(&mut self, engine: &Engine, ino: u32, by: PatchId) {
        self.inodes.insert(ino, by);
        if self.inodes.len() >= self.prune_at {
            self.prune(engine);
        }
    }

    fn prune(&mut self, engine: &Engine) {
        self.blocks.retain(|_, p| !engine.is_durable(*p));
        self.inodes.retain(|_, p| !engine.is_durable(*p));
        let stays = self.blocks.len().max(self.inodes.len());
        self.prune_at = (stays * 2).max(FREED_PRUNE_MIN);
    }
}
