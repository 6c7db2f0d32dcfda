//! The pending patches of one block that an overlap search must look at, indexed by
//! where in the block they lie, so that a search reads only the patches near the bytes
//! it asks about.
//!
//! Why: a bitmap block gathers one patch per 32-bit word it changed until write-back
//! takes them (up to 1,024 on a 4 KiB block), and every allocation searched all of them
//! several times (its overlaps, the word's patch to merge into, the patches it covers).
//! When an untar fills one group after another, as a tree laid out near itself does,
//! the allocations of a whole transaction land on one or two bitmap blocks, and those
//! searches took nearly a third of the full-journal untar's server CPU (13.2-14.1 s
//! against 9.7-9.9 s with this index).

use crate::graph::PatchId;

/// Bytes per bucket: a patch inside one bucket is filed under it, a longer one (a whole
/// block, a directory record that crosses a bucket's end) under `wide`.
const BUCKET: u32 = 64;

#[derive(Debug, Default)]
pub(crate) struct OverlapIndex {
    /// Patches filed under no bucket: they are looked at by every search.
    wide: Vec<PatchId>,
    /// Per bucket of the block, the patches that lie inside it (allocated on first use).
    buckets: Vec<Vec<PatchId>>,
}

/// Where a patch covering bytes `a0..a1` is filed: `Some(bucket)` or `None` for `wide`.
fn home(a0: u32, a1: u32) -> Option<usize> {
    (a1 > a0 && a0 / BUCKET == (a1 - 1) / BUCKET).then_some((a0 / BUCKET) as usize)
}

impl OverlapIndex {
    pub fn clear(&mut self) {
        self.wide.clear();
        for b in &mut self.buckets {
            b.clear();
        }
    }

    /// Files `id`, which covers bytes `range` of the block.
    pub fn insert(&mut self, id: PatchId, range: (u32, u32)) {
        match home(range.0, range.1) {
            Some(b) => {
                if self.buckets.len() <= b {
                    self.buckets.resize_with(b + 1, Vec::new);
                }
                self.buckets[b].push(id);
            }
            None => self.wide.push(id),
        }
    }

    /// Removes `id`, filed for `range`; false if it was not there.
    pub fn remove(&mut self, id: PatchId, range: (u32, u32)) -> bool {
        let list = match home(range.0, range.1) {
            Some(b) => match self.buckets.get_mut(b) {
                Some(l) => l,
                None => return false,
            },
            None => &mut self.wide,
        };
        match list.iter().position(|&p| p == id) {
            Some(i) => {
                list.remove(i);
                true
            }
            None => false,
        }
    }

    /// Keeps only the patches for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(PatchId) -> bool) {
        for l in std::iter::once(&mut self.wide).chain(self.buckets.iter_mut()) {
            l.retain(|&p| keep(p));
        }
    }

    /// Every patch that may touch a byte of `a0..a1` (a superset: callers test each).
    pub fn near(&self, (a0, a1): (u32, u32)) -> impl Iterator<Item = PatchId> + '_ {
        let buckets: &[Vec<PatchId>] = if a1 > a0 {
            let first = (a0 / BUCKET) as usize;
            let last = ((a1 - 1) / BUCKET) as usize + 1;
            let n = self.buckets.len();
            &self.buckets[first.min(n)..last.min(n)]
        } else {
            &[]
        };
        self.wide
            .iter()
            .copied()
            .chain(buckets.iter().flat_map(|l| l.iter().copied()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Graph;
    use crate::graph::{Kind, Patch};

    fn ids(n: usize) -> Vec<PatchId> {
        let mut g = Graph::default();
        (0..n)
            .map(|i| {
                g.insert(Patch::new(
                    Some(0),
                    Kind::Bit { offset: 0, xor: 1 },
                    i as u64,
                    false,
                ))
            })
            .collect()
    }

    fn near(x: &OverlapIndex, r: (u32, u32)) -> Vec<PatchId> {
        x.near(r).collect()
    }

    #[test]
    fn a_search_finds_every_patch_that_touches_its_bytes() {
        let id = ids(6);
        let mut x = OverlapIndex::default();
        x.insert(id[0], (0, 4096)); // a whole block: wide
        x.insert(id[1], (8, 12)); // a bitmap word in bucket 0
        x.insert(id[2], (60, 70)); // crosses a bucket's end: wide
        x.insert(id[3], (128, 132)); // bucket 2
        x.insert(id[4], (4092, 4096)); // the last bucket
        assert_eq!(near(&x, (0, 4096)).len(), 5);
        // Brute force over the filed ranges is the oracle.
        let filed = [
            (id[0], (0, 4096)),
            (id[1], (8, 12)),
            (id[2], (60, 70)),
            (id[3], (128, 132)),
            (id[4], (4092, 4096)),
        ];
        for a0 in (0..4096).step_by(4) {
            for len in [1u32, 4, 63, 64, 65, 200] {
                let a1 = (a0 + len).min(4096);
                let got = near(&x, (a0, a1));
                for &(p, (b0, b1)) in &filed {
                    if b0 < a1 && a0 < b1 {
                        assert!(got.contains(&p), "{a0}..{a1} missed {b0}..{b1}");
                    }
                }
            }
        }
        // Far from a narrow patch, a search does not look at it.
        assert!(!near(&x, (1024, 1028)).contains(&id[1]));
        assert!(near(&x, (1024, 1028)).contains(&id[0]));
        // An empty range touches nothing filed under a bucket.
        assert!(!near(&x, (8, 8)).contains(&id[1]));

        assert!(x.remove(id[1], (8, 12)));
        assert!(!x.remove(id[1], (8, 12)));
        assert!(!near(&x, (8, 12)).contains(&id[1]));
        x.retain(|p| p != id[0]);
        assert_eq!(near(&x, (0, 4096)).len(), 3);
        x.insert(id[5], (256, 260));
        x.clear();
        assert_eq!(near(&x, (0, 4096)).len(), 0);
    }
}
