//! Range rename and range clone by tree surgery (BetrFS 0.4's slicing and grafting,
//! with the lifted prefixes of `lift.rs`, and BetrFS 0.5's shared subtrees).
//!
//! `graft(from, to, start, end, how)` moves (`rename_prefix`) or shares (`clone_range`)
//! the keys `from + s`, `start <= s < end`, to `to + s`:
//! 1. **Isolate the source**: walk down towards the range, carrying the range's pending
//!    messages down with the walk (they are newer than everything below, so they may
//!    join the node below), until the range spans several children or reaches the
//!    leaves' parents; there *slice* the children at the range's two ends (a node on the
//!    cut is split in two, recursively down to the leaf). Now children `first..=last` of
//!    one node hold exactly the range, messages included.
//! 2. A rename detaches them and leaves an empty subtree of their height in their place
//!    (so no neighbour's range grows: a lifted neighbour must keep its range inside its
//!    lift). A clone leaves them where they are and counts one more reference to each.
//! 3. **Isolate the destination** the same way, stopping no lower than one level above
//!    the source's subtrees, and drop what it holds (the operation replaces it; a shared
//!    subtree there only loses a reference).
//! 4. **Graft**: the subtrees take the destination's place, under a wrapper node (and
//!    single-child nodes up to the right height) if the destination's node is higher.
//!    Each edge gets a lift mapping the old prefix to the new one, so no key below the
//!    edges changes; the pivots between the subtrees and the buffers that travel with
//!    them (a clone copies them) are rewritten: one node's worth of bytes.
//! 5. Both paths are brought back within bounds (buffers flushed, nodes split).
//!
//! A clone needs no GOTO message (BetrFS 0.5 injects one at the root and turns it into a
//! pivot when it reaches the right height): step 3 places the shared edge at once, for
//! the same few nodes per level. **Copy-on-abundant-write**: a shared node is never
//! changed in place; the first change that must enter it through one of its edges (a
//! buffer flushed into it, a slice, a merge) copies it to a node of that edge's own
//! (`Inner::own`). Changes to a clone wait in the buffers above the shared nodes like any
//! other message, so a node is copied only once a buffer above it is full enough to be
//! flushed: a few scattered writes copy nothing.
//!
//! Cost: a few nodes per level on two root-to-leaf paths, whatever the range holds.
//! Atomic as every batch is: the operation is a record of the redo log, and replay
//! performs the same surgery on the checkpoint it starts from.

use super::Inner;
use crate::lift::{prefix_end, Lift};
use crate::msg::Buffer;
use crate::node::{Entries, Internal, Leaf, Node, NodeId};
use crate::{Error, Result};

/// A key range standing alone: children `first..=last` of `node` cover exactly
/// `lo..hi` (given in the node's own key space), and no node above holds a message for
/// it. `pfx` is the operation's prefix in the node's space, and `ext` what the walk
/// appended to the prefix given at the root: when a lifted edge's outer prefix is longer
/// than the prefix (every key of the range starts with it), the node's space knows only
/// the longer one.
struct Isolated {
    node: NodeId,
    first: usize,
    last: usize,
    pfx: Vec<u8>,
    ext: Vec<u8>,
}

/// What a graft does with the source: moves it (a rename) or shares it (a clone).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Graft {
    Move,
    Share,
}

fn corrupt(id: NodeId, why: &str) -> Error {
    Error::Corrupt(format!("node {id}: {why}"))
}

impl Inner {
    pub(super) fn rename_prefix(&mut self, from: &[u8], to: &[u8]) -> Result<()> {
        self.graft(from, to, b"", None, Graft::Move)
    }

    /// Range clone: the source's subtrees gain a second place (reference counts) under
    /// the destination, with lifts as for a rename; nothing below them is read or
    /// written. The first change that reaches a shared node through either place copies
    /// it (`own`), so writes to one copy never show in the other.
    pub(super) fn clone_range(
        &mut self,
        from: &[u8],
        to: &[u8],
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<()> {
        self.graft(from, to, start, end, Graft::Share)
    }

    /// Moves (or shares) the keys `from + s`, `start <= s < end`, to `to + s`: see the
    /// module's doc for the steps.
    fn graft(
        &mut self,
        from: &[u8],
        to: &[u8],
        start: &[u8],
        end: Option<&[u8]>,
        how: Graft,
    ) -> Result<()> {
        let range = |p: &[u8]| -> Option<(Vec<u8>, Vec<u8>)> {
            let hi = match end {
                Some(e) => [p, e].concat(),
                None => prefix_end(p)?,
            };
            Some(([p, start].concat(), hi))
        };
        let (Some((slo, shi)), Some((dlo, dhi))) = (range(from), range(to)) else {
            return Err(Error::Invalid("a renamed prefix needs an end".into()));
        };
        if slo >= shi {
            return Ok(());
        }
        // 1-2. The source range, cut out as whole subtrees of one node.
        let src = self.isolate(&slo, &shi, 1, from)?;
        let mut np = self.take_internal(src.node)?;
        let height = np.height - 1;
        let (first, last) = (src.first, src.last);
        let (children, buffers, lifts, inner_pivots) = match how {
            Graft::Move => {
                let placeholder = self.build_empty(height);
                let children: Vec<NodeId> =
                    np.children.splice(first..=last, [placeholder]).collect();
                let buffers: Vec<Buffer> = np
                    .buffers
                    .splice(first..=last, [Buffer::default()])
                    .collect();
                let lifts: Vec<Option<Lift>> = np.lifts.splice(first..=last, [None]).collect();
                let pivots: Vec<Vec<u8>> = np.pivots.drain(first..last).collect();
                (children, buffers, lifts, pivots)
            }
            Graft::Share => {
                let children = np.children[first..=last].to_vec();
                for &c in &children {
                    self.add_ref(c);
                }
                self.stats.subtrees_shared += children.len() as u64;
                (
                    children,
                    np.buffers[first..=last].to_vec(),
                    np.lifts[first..=last].to_vec(),
                    np.pivots[first..last].to_vec(),
                )
            }
        };
        self.put_node(src.node, Node::Internal(np), true);

        // 3. The destination, at a node that can take subtrees of that height.
        let dst = self.isolate(&dlo, &dhi, height + 1, to)?;
        let mut nq = self.take_internal(dst.node)?;
        let dst_height = nq.height - 1;

        // 4. The graft. A key `sp + r` of the source node's space is `dp + r` in the
        // destination node's: both stand for `from + e + r` and `to + e + r` at the root,
        // whatever each walk appended (`ext`) to its prefix.
        let (sp, dp) = if let Some(z) = src.ext.strip_prefix(dst.ext.as_slice()) {
            (src.pfx.clone(), [dst.pfx.as_slice(), z].concat())
        } else if let Some(z) = dst.ext.strip_prefix(src.ext.as_slice()) {
            ([src.pfx.as_slice(), z].concat(), dst.pfx.clone())
        } else {
            self.put_node(dst.node, Node::Internal(nq), true);
            return Err(corrupt(dst.node, "the two ranges' lifts disagree"));
        };
        // `mv` maps the source node's space to the destination node's, `back` the other
        // way (as the lift of an edge: inner is the child's side).
        let mv = Lift {
            inner: dp.clone(),
            outer: sp.clone(),
        };
        let back = Lift {
            inner: sp,
            outer: dp,
        };
        let moved = children.len() as u64;
        let pivots: Vec<Vec<u8>> = inner_pivots
            .iter()
            .map(|k| mv.to_inner(k).into_owned())
            .collect();
        let buffers: Vec<Buffer> = buffers.into_iter().map(|b| mv.buffer_to_inner(b)).collect();
        let lifts: Vec<Option<Lift>> = lifts
            .into_iter()
            .map(|l| match l {
                None => Lift::new(back.inner.clone(), back.outer.clone()),
                Some(l) => l.under(&back),
            })
            .collect();
        let graft = if dst_height == height {
            (children, pivots, buffers, lifts)
        } else {
            let mut w = Internal::new(height + 1, pivots, children, buffers);
            w.lifts = lifts;
            let mut top = self.new_id();
            self.put_node(top, Node::Internal(w), true);
            for h in height + 2..=dst_height {
                let n = Internal::new(h, Vec::new(), vec![top], vec![Buffer::default()]);
                top = self.new_id();
                self.put_node(top, Node::Internal(n), true);
            }
            (vec![top], Vec::new(), vec![Buffer::default()], vec![None])
        };
        let (first, last) = (dst.first, dst.last);
        let old: Vec<NodeId> = nq.children.splice(first..=last, graft.0).collect();
        nq.pivots.splice(first..last, graft.1);
        // The destination's own messages die with what it held.
        nq.buffers.splice(first..=last, graft.2);
        nq.lifts.splice(first..=last, graft.3);
        self.put_node(dst.node, Node::Internal(nq), true);
        for id in old {
            self.drop_ref(id, dst_height)?;
        }
        if how == Graft::Move {
            self.stats.subtrees_moved += moved;
        }

        // 5. Both paths within bounds again.
        self.fix_toward(&slo)?;
        self.fix_toward(&dlo)
    }

    fn take_internal(&mut self, id: NodeId) -> Result<Internal> {
        match self.take_full(id)? {
            (Node::Internal(n), _) => Ok(n),
            (leaf, dirty) => {
                self.put_node(id, leaf, dirty);
                Err(corrupt(id, "expected an internal node"))
            }
        }
    }

    /// Cuts `lo..hi` (keys that all start with `pfx`) out as whole children of one node
    /// of height `min_height` or more (see the module's doc). Every node it changes on
    /// the way is made its parent's own first.
    fn isolate(&mut self, lo: &[u8], hi: &[u8], min_height: u16, pfx: &[u8]) -> Result<Isolated> {
        let min_height = min_height.max(1);
        self.grow_root_to(min_height)?;
        let mut id = self.root;
        let (mut lo, mut hi) = (lo.to_vec(), hi.to_vec());
        let (mut pfx, mut ext) = (pfx.to_vec(), Vec::new());
        // The node's own range, in its space (`None`: unbounded).
        let (mut nlo, mut nhi): (Option<Vec<u8>>, Option<Vec<u8>>) = (None, None);
        loop {
            let mut n = self.take_internal(id)?;
            let i = n.child_for(&lo);
            let j = n.pivots.partition_point(|p| p.as_slice() < hi.as_slice());
            let bounds = |n: &Internal, i: usize| {
                let (a, b) = n.child_range(i);
                (
                    a.map(<[u8]>::to_vec).or(nlo.clone()),
                    b.map(<[u8]>::to_vec).or(nhi.clone()),
                )
            };
            let (clo, chi) = bounds(&n, i);
            let starts = clo.as_deref() == Some(&lo[..]);
            if i == j && !(starts && chi.as_deref() == Some(&hi[..])) && n.height > min_height {
                // Inside one child that is not exactly the range: go down, taking the
                // range's messages along.
                let lift = n.lifts[i].clone();
                let r = self
                    .own(&mut n, i)
                    .and_then(|cid| self.push_range_down(&mut n, i, &lo, &hi).map(|()| cid));
                self.put_node(id, Node::Internal(n), true);
                let cid = r?;
                let into = |k: &[u8]| match &lift {
                    Some(l) => l.to_inner(k).into_owned(),
                    None => k.to_vec(),
                };
                if let Some(l) = &lift {
                    if let Some(rest) = pfx.strip_prefix(l.outer.as_slice()) {
                        pfx = [l.inner.as_slice(), rest].concat();
                    } else if let Some(more) = l.outer.strip_prefix(pfx.as_slice()) {
                        ext.extend_from_slice(more);
                        pfx = l.inner.clone();
                    } else {
                        return Err(corrupt(
                            cid,
                            "a range inside a lift that is not its prefix's",
                        ));
                    }
                }
                lo = into(&lo);
                hi = into(&hi);
                nlo = clo.as_deref().map(into);
                nhi = chi.as_deref().map(into);
                id = cid;
                continue;
            }
            let r = (|| -> Result<(usize, usize)> {
                let (mut first, mut last) = (i, j);
                if !starts {
                    self.slice(&mut n, i, &lo)?;
                    first += 1;
                    last += 1;
                }
                if bounds(&n, last).1.as_deref() != Some(&hi[..]) {
                    self.slice(&mut n, last, &hi)?;
                }
                Ok((first, last))
            })();
            self.put_node(id, Node::Internal(n), true);
            let (first, last) = r?;
            return Ok(Isolated {
                node: id,
                first,
                last,
                pfx,
                ext,
            });
        }
    }

    /// Moves the messages for `lo..hi` from `n`'s buffer for child `i` into the child.
    fn push_range_down(&mut self, n: &mut Internal, i: usize, lo: &[u8], hi: &[u8]) -> Result<()> {
        let cid = n.children[i];
        let mut child = self.take_internal(cid)?;
        let part = n.buffers[i].extract(lo, hi);
        if !part.is_empty() {
            child.absorb(match &n.lifts[i] {
                Some(l) => l.buffer_to_inner(part),
                None => part,
            });
        }
        self.put_node(cid, Node::Internal(child), true);
        Ok(())
    }

    /// Splits child `i` of `n` at `k` (strictly inside its range, in `n`'s space): the
    /// keys from `k` on go to a new right sibling, recursively down to the leaf, and the
    /// buffer for the child is cut the same way.
    fn slice(&mut self, n: &mut Internal, i: usize, k: &[u8]) -> Result<()> {
        let cid = self.own(n, i)?;
        let lift = n.lifts[i].clone();
        let k_in = match &lift {
            Some(l) => l.to_inner(k).into_owned(),
            None => k.to_vec(),
        };
        let (mut child, _) = self.take_full(cid)?;
        let right = match &mut child {
            Node::Leaf(l) => l.split_at(&k_in).map(Node::Leaf),
            Node::Internal(c) => self.slice_internal(c, &k_in).map(Node::Internal),
        };
        self.put_node(cid, child, true);
        let right = right?;
        let rid = self.new_id();
        self.put_node(rid, right, true);
        let rb = n.buffers[i].split_off(k);
        n.pivots.insert(i, k.to_vec());
        n.children.insert(i + 1, rid);
        n.buffers.insert(i + 1, rb);
        n.lifts.insert(i + 1, lift);
        Ok(())
    }

    /// Cuts an internal node at `k` (strictly inside its range), returning the right part.
    fn slice_internal(&mut self, c: &mut Internal, k: &[u8]) -> Result<Internal> {
        let ci = c.child_for(k);
        let p = if ci > 0 && c.pivots[ci - 1] == k {
            ci - 1
        } else {
            self.slice(c, ci, k)?;
            ci
        };
        Ok(c.split_after(p))
    }

    /// Adds levels above the root until it is internal and at least `height` high.
    fn grow_root_to(&mut self, height: u16) -> Result<()> {
        loop {
            let h = self.ensure(self.root)?.node.height();
            if h >= height {
                return Ok(());
            }
            let n = Internal::new(h + 1, Vec::new(), vec![self.root], vec![Buffer::default()]);
            self.root = self.new_id();
            self.put_node(self.root, Node::Internal(n), true);
        }
    }

    /// A new subtree of `height` holding nothing: single-child nodes down to an empty
    /// leaf.
    pub(super) fn build_empty(&mut self, height: u16) -> NodeId {
        let mut id = self.new_id();
        self.put_node(id, Node::Leaf(Leaf::empty()), true);
        for h in 1..=height {
            let n = Internal::new(h, Vec::new(), vec![id], vec![Buffer::default()]);
            id = self.new_id();
            self.put_node(id, Node::Internal(n), true);
        }
        id
    }

    /// Takes the lift off the edge to child `idx`: the child's keys are rewritten into
    /// the parent's space and its own edges composed with the lift (one node's work).
    /// Keys may grow: a child past its bounds then splits, and the parent adopts the
    /// pieces (returns whether it did: the parent's later children moved).
    pub(super) fn push_lift_down(&mut self, parent: &mut Internal, idx: usize) -> Result<bool> {
        let Some(lift) = parent.lifts[idx].clone() else {
            return Ok(false);
        };
        let cid = self.own(parent, idx)?;
        let (mut child, _) = self.take_full(cid)?;
        match &mut child {
            Node::Leaf(l) => {
                let es = l.entries().cloned().unwrap_or_default();
                let grow = lift.outer.len().saturating_sub(lift.inner.len());
                let mut out = Entries::with_capacity(es.bytes() + es.len() * grow, es.len());
                for (k, v) in es.iter() {
                    out.push(&lift.to_outer(k), v);
                }
                *l = Leaf::full(out);
            }
            Node::Internal(c) => {
                for p in &mut c.pivots {
                    *p = lift.to_outer(p).into_owned();
                }
                for b in &mut c.buffers {
                    *b = lift.buffer_to_outer(std::mem::take(b));
                }
                for l in &mut c.lifts {
                    *l = match l.take() {
                        None => Some(lift.clone()),
                        Some(x) => x.under(&lift),
                    };
                }
            }
        }
        parent.lifts[idx] = None;
        self.stats.lifts_pushed += 1;
        let r = self.shrink_buffers(&mut child);
        let sibs = if r.is_ok() {
            self.split(&mut child)
        } else {
            Vec::new()
        };
        self.put_node(cid, child, true);
        r?;
        let grew = !sibs.is_empty();
        self.adopt(parent, idx, sibs);
        Ok(grew)
    }

    /// Brings the nodes on the path towards `key` back within their bounds, from the
    /// bottom up: buffers flushed below the node size, nodes past their fanout split.
    fn fix_toward(&mut self, key: &[u8]) -> Result<()> {
        let rid = self.root;
        let (mut root, _) = self.take_full(rid)?;
        let r = match &mut root {
            Node::Internal(n) => self.fix_below(n, key),
            Node::Leaf(_) => Ok(()),
        };
        self.put_node(rid, root, true);
        r?;
        self.fix_root()
    }

    fn fix_below(&mut self, n: &mut Internal, key: &[u8]) -> Result<()> {
        let i = n.child_for(key);
        let cid = n.children[i];
        if self.is_shared(cid) {
            // Nothing changed below a shared node (changes copy it first): it is within
            // its bounds.
            return Ok(());
        }
        let key_in = match &n.lifts[i] {
            Some(l) => l.to_inner(key).into_owned(),
            None => key.to_vec(),
        };
        let (mut child, _) = self.take_full(cid)?;
        let mut r = match &mut child {
            Node::Internal(c) => self.fix_below(c, &key_in),
            Node::Leaf(_) => Ok(()),
        };
        if r.is_ok() {
            r = self.shrink_buffers(&mut child);
        }
        let sibs = if r.is_ok() {
            self.split(&mut child)
        } else {
            Vec::new()
        };
        self.put_node(cid, child, true);
        r?;
        self.adopt(n, i, sibs);
        Ok(())
    }
}
