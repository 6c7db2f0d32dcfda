//! The tree's node cache: the nodes in memory, what they are charged, and which are
//! dirty. It owns the accounting that decides when to checkpoint and when to evict,
//! with one invariant: `mem`, `dirty_mem` and `dirty_nodes` are the sums over the
//! entries (`check`). Every change of an entry's size or dirtiness goes through here.

use crate::node::{self, Leaf, LeafData, Node, NodeId};
use rustc_hash::FxHashMap;
use std::sync::Arc;

pub(super) struct Cached {
    /// Shared with a checkpoint in flight while it encodes the node (a change takes a
    /// copy then, `Inner::take_cached`).
    pub node: Arc<Node>,
    dirty: bool,
    tick: u64,
    mem: usize,
}

impl Cached {
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }
}

#[derive(Default)]
pub(super) struct NodeCache {
    // (Fx: ids are small integers the tree hands out, and SipHash was a sixth of a
    // SEEK_HOLE walk over cached leaves.)
    nodes: FxHashMap<NodeId, Cached>,
    /// Use counter: an entry's `tick` is when it was last used (least recently used
    /// goes first).
    tick: u64,
    mem: usize,
    dirty_mem: usize,
    /// Dirty nodes cached: each may take a block more on disk than its bytes (its
    /// extent is whole blocks), counted in what a checkpoint needs (`pending_blocks`).
    dirty_nodes: usize,
}

impl std::ops::Index<&NodeId> for NodeCache {
    type Output = Cached;
    fn index(&self, id: &NodeId) -> &Cached {
        &self.nodes[id]
    }
}

impl NodeCache {
    /// Bytes charged for the nodes cached.
    pub fn mem(&self) -> usize {
        self.mem
    }

    /// Bytes charged for the dirty ones.
    pub fn dirty_mem(&self) -> usize {
        self.dirty_mem
    }

    pub fn dirty_nodes(&self) -> usize {
        self.dirty_nodes
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn get(&self, id: &NodeId) -> Option<&Cached> {
        self.nodes.get(id)
    }

    pub fn contains_key(&self, id: &NodeId) -> bool {
        self.nodes.contains_key(id)
    }

    /// Bytes charged for internal nodes.
    pub fn internal_mem(&self) -> usize {
        self.nodes
            .values()
            .filter(|c| c.node.height() > 0)
            .map(|c| c.mem)
            .sum()
    }

    /// Caches `node` under `id`, charged its size, as used now. `false` when `id` was
    /// cached already (a bug: the old entry is replaced and uncharged).
    pub fn insert(&mut self, id: NodeId, node: Node, dirty: bool) -> bool {
        let mem = node.mem();
        self.tick += 1;
        self.mem += mem;
        if dirty {
            self.dirty_mem += mem;
            self.dirty_nodes += 1;
        }
        let old = self.nodes.insert(
            id,
            Cached {
                node: Arc::new(node),
                dirty,
                tick: self.tick,
                mem,
            },
        );
        match old {
            Some(old) => {
                self.uncharge(&old);
                false
            }
            None => true,
        }
    }

    /// Takes `id` out of the cache, uncharged.
    pub fn remove(&mut self, id: &NodeId) -> Option<Cached> {
        let c = self.nodes.remove(id)?;
        self.uncharge(&c);
        Some(c)
    }

    fn uncharge(&mut self, c: &Cached) {
        self.mem -= c.mem;
        if c.dirty {
            self.dirty_mem -= c.mem;
            self.dirty_nodes -= 1;
        }
    }

    /// Marks `id` used now; `None` if it is not cached.
    pub fn touch(&mut self, id: NodeId) -> Option<&mut Cached> {
        self.tick += 1;
        let tick = self.tick;
        let c = self.nodes.get_mut(&id)?;
        c.tick = tick;
        Some(c)
    }

    /// Changes a cached node in place without making it dirty (parts read or dropped, a
    /// base learned) and charges the difference, to the dirty bytes too if it is dirty.
    /// `None` if it is not cached.
    pub fn change<R>(&mut self, id: NodeId, f: impl FnOnce(&mut Node) -> R) -> Option<R> {
        let c = self.nodes.get_mut(&id)?;
        let before = c.node.mem();
        let r = f(Arc::make_mut(&mut c.node));
        let after = c.node.mem();
        c.mem = (c.mem + after).saturating_sub(before);
        self.mem = (self.mem + after).saturating_sub(before);
        if c.dirty {
            self.dirty_mem = (self.dirty_mem + after).saturating_sub(before);
        }
        Some(r)
    }

    /// The dirty nodes' ids, the upper nodes first (a checkpoint's thread encodes them
    /// in this order: every batch changes the root, and a node changed before the
    /// thread encoded it is copied).
    pub fn dirty_ids(&self) -> Vec<NodeId> {
        let mut dirty: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, c)| c.dirty)
            .map(|(id, _)| *id)
            .collect();
        dirty.sort_unstable_by_key(|id| (std::cmp::Reverse(self.nodes[id].node.height()), *id));
        dirty
    }

    /// Marks `id` clean (a checkpoint took it); its node and its charge, `None` if it
    /// is not cached.
    pub fn mark_clean(&mut self, id: NodeId) -> Option<(Arc<Node>, usize)> {
        let c = self.nodes.get_mut(&id)?;
        if c.dirty {
            c.dirty = false;
            self.dirty_mem -= c.mem;
            self.dirty_nodes -= 1;
        }
        Some((c.node.clone(), c.mem))
    }

    /// Marks a clean cached `id` dirty again (its checkpoint failed); whether it was
    /// cached.
    pub fn mark_dirty(&mut self, id: NodeId) -> bool {
        match self.nodes.get_mut(&id) {
            Some(c) => {
                if !c.dirty {
                    c.dirty = true;
                    self.dirty_mem += c.mem;
                    self.dirty_nodes += 1;
                }
                true
            }
            None => false,
        }
    }

    /// Drops the basements of leaves read for queries, least recently used first,
    /// until the charge is down to `target` (the leaf's index stays: it is a fraction
    /// of its basements' size and saves a read per query). Only leaves holding some
    /// basement are looked at, and the charge is lowered by what is dropped rather
    /// than the node's whole estimate taken twice (with thousands of partial leaves
    /// cached, that estimate was an eighth of a point query's time).
    pub fn drop_basements(&mut self, target: usize) {
        let holds_basements = |n: &Node| {
            matches!(n, Node::Leaf(Leaf { data: LeafData::Partial { loaded, .. }, .. })
                if loaded.iter().any(Option::is_some))
        };
        let mut partial: Vec<(u64, NodeId)> = self
            .nodes
            .iter()
            .filter(|(_, c)| holds_basements(&c.node))
            .map(|(id, c)| (c.tick, *id))
            .collect();
        partial.sort_unstable();
        for (_, id) in partial {
            if self.mem <= target {
                return;
            }
            let Some(c) = self.nodes.get_mut(&id) else {
                continue;
            };
            let mut freed = 0;
            if let Node::Leaf(Leaf {
                data: LeafData::Partial { loaded, .. },
                ..
            }) = Arc::make_mut(&mut c.node)
            {
                for l in loaded.iter_mut() {
                    if let Some(e) = l.take() {
                        freed += node::entries_mem(&e);
                    }
                }
            }
            c.mem = c.mem.saturating_sub(freed);
            self.mem = self.mem.saturating_sub(freed);
            if c.dirty {
                self.dirty_mem = self.dirty_mem.saturating_sub(freed);
            }
        }
    }

    /// Evicts clean nodes `may_go` allows until the charge is down to `target`: whole
    /// leaves first (large; read again only by a flush or a scan), then leaf indexes,
    /// then internal nodes (every query passes through them; they are few, about one in
    /// the fanout, and costly to read: a whole node, buffers decoded); least recently
    /// used first within each kind. Returns how many went.
    pub fn evict_clean(&mut self, target: usize, may_go: impl Fn(NodeId) -> bool) -> u64 {
        let kind = |n: &Node| match n {
            Node::Leaf(l) if l.entries().is_some() => 0u8,
            Node::Leaf(_) => 1,
            Node::Internal(_) => 2,
        };
        let mut clean: Vec<(u8, u64, NodeId)> = self
            .nodes
            .iter()
            .filter(|(id, c)| !c.dirty && may_go(**id))
            .map(|(id, c)| (kind(&c.node), c.tick, *id))
            .collect();
        clean.sort_unstable();
        let mut evicted = 0;
        for (_, _, id) in clean {
            if self.mem <= target {
                break;
            }
            if self.remove(&id).is_some() {
                evicted += 1;
            }
        }
        evicted
    }

    /// Whether the charges add up (a drift in `dirty_mem` misjudges when to
    /// checkpoint, or underflows when a checkpoint takes the nodes).
    pub fn check(&self) -> Result<(), String> {
        let mem: usize = self.nodes.values().map(|c| c.mem).sum();
        let dirty: usize = self.nodes.values().filter(|c| c.dirty).map(|c| c.mem).sum();
        let dirty_nodes = self.nodes.values().filter(|c| c.dirty).count();
        if (mem, dirty, dirty_nodes) != (self.mem, self.dirty_mem, self.dirty_nodes) {
            return Err(format!(
                "the cache charges {} bytes ({} dirty, {} nodes) for nodes of {mem} ({dirty}, {dirty_nodes})",
                self.mem, self.dirty_mem, self.dirty_nodes
            ));
        }
        Ok(())
    }
}
