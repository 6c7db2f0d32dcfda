//! Lifted prefixes: how a subtree moves without changing a key inside it.
//!
//! An edge from an internal node to a child may carry a [`Lift`]: every key the parent
//! routes to that child starts with `outer`, and the child's subtree stores it with
//! `outer` replaced by `inner`. A range rename (`Tree` → `rename_range`) cuts the
//! renamed range out as whole subtrees and hangs them under the new prefix with a lift
//! on each edge, so it rewrites no key below the cut: only the edges, the pivots between
//! the moved children and the buffers of the node they hang from.
//!
//! BetrFS 0.4 gets the same effect by storing in each node keys without the prefix its
//! parent's pivots imply; here the prefix is explicit on the edge, which leaves the node
//! format, the basements and the buffer filters as they were. A lift is pushed one level
//! down (the child's keys rewritten, its own edges composed) only where two children with
//! different lifts merge, or a lifted root child becomes the root: work a merge pays for
//! anyway.
//!
//! Invariant (checked by `Tree::check`): the range a parent gives a lifted child lies in
//! `[outer, prefix_end(outer))`, so every key routed there starts with `outer`, and every
//! key, pivot and message of the child's subtree starts with `inner`. Ranges of lifted
//! children only ever shrink (splits, slices), so the invariant holds once made.

use crate::msg::{Buffer, RangeDel};
use std::borrow::Cow;

/// The first key after every key that starts with `p` (`None`: there is none, `p` is all
/// 0xff bytes or empty).
pub fn prefix_end(p: &[u8]) -> Option<Vec<u8>> {
    let last = p.iter().rposition(|&b| b != 0xff)?;
    let mut e = p[..=last].to_vec();
    e[last] += 1;
    Some(e)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lift {
    /// The prefix the child's subtree stores.
    pub inner: Vec<u8>,
    /// The prefix its parent routes to it.
    pub outer: Vec<u8>,
}

/// Maps `k` from the space whose keys start with `from` to the one whose keys start with
/// `to`. A bound outside `from`'s range is clamped to its ends (a range clipped to the
/// child first would have been the same).
fn rebase<'a>(k: &'a [u8], from: &[u8], to: &[u8]) -> Cow<'a, [u8]> {
    if let Some(rest) = k.strip_prefix(from) {
        let mut v = Vec::with_capacity(to.len() + rest.len());
        v.extend_from_slice(to);
        v.extend_from_slice(rest);
        return Cow::Owned(v);
    }
    if k < from {
        Cow::Owned(to.to_vec())
    } else {
        // At or past the end of `from`'s range: the end of `to`'s. (`to` always has an
        // end: lifts are made only for prefixes that have one.)
        Cow::Owned(prefix_end(to).unwrap_or_else(|| to.to_vec()))
    }
}

impl Lift {
    /// A lift, or `None` when it would change nothing.
    pub fn new(inner: Vec<u8>, outer: Vec<u8>) -> Option<Lift> {
        (inner != outer).then_some(Lift { inner, outer })
    }

    pub fn to_inner<'a>(&self, k: &'a [u8]) -> Cow<'a, [u8]> {
        rebase(k, &self.outer, &self.inner)
    }

    pub fn to_outer<'a>(&self, k: &'a [u8]) -> Cow<'a, [u8]> {
        rebase(k, &self.inner, &self.outer)
    }

    pub fn bytes(&self) -> usize {
        self.inner.len() + self.outer.len() + 8
    }

    /// This lift seen through the parent's own edge `above` (child space → the parent's
    /// parent's space): the lift of one edge after the parent's lift was pushed down.
    /// Keys under this edge start with both `self.outer` and `above.inner` (one is a
    /// prefix of the other), so the longer of the two is what they share.
    pub fn under(&self, above: &Lift) -> Option<Lift> {
        if self.outer.len() >= above.inner.len() {
            Lift::new(self.inner.clone(), above.to_outer(&self.outer).into_owned())
        } else {
            let extra = &above.inner[self.outer.len()..];
            Lift::new([&self.inner[..], extra].concat(), above.outer.clone())
        }
    }

    /// A buffer's messages with their keys mapped into the child's space.
    pub fn buffer_to_inner(&self, b: Buffer) -> Buffer {
        map_buffer(b, |k| self.to_inner(k).into_owned())
    }

    pub fn buffer_to_outer(&self, b: Buffer) -> Buffer {
        map_buffer(b, |k| self.to_outer(k).into_owned())
    }
}

/// Applies an order-preserving key map to every message of a buffer.
pub fn map_buffer(b: Buffer, f: impl Fn(&[u8]) -> Vec<u8>) -> Buffer {
    Buffer {
        ranges: b
            .ranges
            .into_iter()
            .map(|r| RangeDel {
                msn: r.msn,
                start: f(&r.start),
                end: f(&r.end),
            })
            .filter(|r| r.start < r.end)
            .collect(),
        points: b.points.map_keys(&f),
    }
}

/// Composes the lifts of a path: maps keys between the outer space (the root's) and the
/// space of each node on a root-to-leaf path. `edges[l]` is the lift on the edge below
/// level `l`.
#[derive(Debug, Default, Clone)]
pub struct PathLifts {
    pub edges: Vec<Option<Lift>>,
}

impl PathLifts {
    pub fn none(&self) -> bool {
        self.edges.iter().all(Option::is_none)
    }

    /// An outer key in the space of level `level` (0: the root).
    pub fn down<'a>(&self, level: usize, k: &'a [u8]) -> Cow<'a, [u8]> {
        let mut k = Cow::Borrowed(k);
        for l in self.edges[..level].iter().flatten() {
            k = Cow::Owned(l.to_inner(&k).into_owned());
        }
        k
    }

    /// A key of level `level`'s space in the outer space.
    pub fn up<'a>(&self, level: usize, k: &'a [u8]) -> Cow<'a, [u8]> {
        let mut k = Cow::Borrowed(k);
        for l in self.edges[..level].iter().rev().flatten() {
            k = Cow::Owned(l.to_outer(&k).into_owned());
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_first_key_after_the_prefix() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(b"a\xff\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff"), None);
        assert_eq!(prefix_end(b""), None);
        assert_eq!(prefix_end(b"a\x00"), Some(b"a\x01".to_vec()));
    }

    #[test]
    fn a_lift_maps_keys_and_clamps_bounds() {
        let l = Lift::new(b"old/".to_vec(), b"new/".to_vec()).unwrap();
        assert_eq!(&*l.to_inner(b"new/x"), b"old/x");
        assert_eq!(&*l.to_outer(b"old/x"), b"new/x");
        assert_eq!(&*l.to_inner(b"new0"), b"old0"); // the range's end maps to the end
        assert_eq!(&*l.to_inner(b"a"), b"old/");
        assert_eq!(&*l.to_inner(b"z"), b"old0");
        assert!(Lift::new(b"same".to_vec(), b"same".to_vec()).is_none());
    }

    #[test]
    fn composed_lifts_map_like_the_two_in_turn() {
        // Parent's edge: parent stores "p/", its parent sees "q/".
        let above = Lift::new(b"p/".to_vec(), b"q/".to_vec()).unwrap();
        // A longer edge below it, and a shorter one (all keys under it start "p/d/").
        let long = Lift::new(b"x/".to_vec(), b"p/d/".to_vec()).unwrap();
        let short = Lift::new(b"y".to_vec(), b"p".to_vec()).unwrap();
        for (edge, stored) in [(&long, &b"x/f"[..]), (&short, &b"y/d/f"[..])] {
            let via_two = above.to_outer(&edge.to_outer(stored)).into_owned();
            let one = edge.under(&above).unwrap();
            assert_eq!(one.to_outer(stored).into_owned(), via_two);
            assert_eq!(one.to_inner(&via_two).into_owned(), stored.to_vec());
        }
    }
}
