//! Reference counts of shared nodes: a range clone makes two edges reach one subtree,
//! and a shared node never changes in place (a change that reaches it through one edge
//! copies it first: `Inner::own`). A node not listed has one reference (or is the root);
//! a listed one has two or more. Saved in the block translation table, so the counts
//! survive a reopen; `Inner::check` compares them with the edges a walk finds.

use crate::node::NodeId;
use std::collections::HashMap;

#[derive(Default)]
pub(super) struct Refs {
    counts: HashMap<NodeId, u32>,
}

impl Refs {
    /// Whether more than one edge reaches `id`.
    pub fn is_shared(&self, id: NodeId) -> bool {
        self.counts.contains_key(&id)
    }

    /// The edges that reach `id` (1 when it is not shared).
    pub fn count(&self, id: NodeId) -> u32 {
        self.counts.get(&id).copied().unwrap_or(1)
    }

    /// Shared nodes.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// One more edge reaches `id`.
    pub fn add(&mut self, id: NodeId) {
        *self.counts.entry(id).or_insert(1) += 1;
    }

    /// One edge to a shared `id` goes away; `false` (and nothing changes) when `id` is
    /// not shared, so that the edge was its last.
    pub fn release(&mut self, id: NodeId) -> bool {
        let Some(n) = self.counts.get_mut(&id) else {
            return false;
        };
        *n -= 1;
        if *n <= 1 {
            self.counts.remove(&id);
        }
        true
    }

    /// Loads a count read from the table (`n` ≥ 2: checked by the caller).
    pub fn load(&mut self, id: NodeId, n: u32) {
        self.counts.insert(id, n);
    }

    /// A shared node no edge of `reached` reaches, if there is one.
    pub fn unreached(&self, reached: impl Fn(NodeId) -> bool) -> Option<NodeId> {
        self.counts.keys().copied().find(|&id| !reached(id))
    }

    /// The counts in the table's order (by node).
    pub fn sorted(&self) -> Vec<(NodeId, u32)> {
        let mut v: Vec<(NodeId, u32)> = self.counts.iter().map(|(k, v)| (*k, *v)).collect();
        v.sort_unstable();
        v
    }
}
