//! Free space for node and table extents: first fit over a map of free runs, merged with
//! their neighbours when freed. Rebuilt at open from the table (everything the newest
//! checkpoint references is in use; the rest is free).

use crate::format::Extent;
use quilt_block::BlockNo;
use std::collections::BTreeMap;

#[derive(Debug, Default)]
pub struct Alloc {
    /// start → length of each free run.
    free: BTreeMap<BlockNo, u64>,
    pub free_blocks: u64,
}

impl Alloc {
    /// Everything in `first..end` free except `used` (which may overlap each other only
    /// if the image is damaged: the caller checks that).
    pub fn new(first: BlockNo, end: BlockNo, used: &[Extent]) -> Alloc {
        let mut used: Vec<Extent> = used.to_vec();
        used.sort();
        let mut a = Alloc::default();
        let mut at = first;
        for u in used {
            if u.start > at {
                a.free(Extent {
                    start: at,
                    blocks: u.start - at,
                });
            }
            at = at.max(u.start + u.blocks);
        }
        if end > at {
            a.free(Extent {
                start: at,
                blocks: end - at,
            });
        }
        a
    }

    /// `blocks` consecutive free blocks, or `None` when no run is long enough.
    pub fn alloc(&mut self, blocks: u64) -> Option<Extent> {
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= blocks)?;
        self.free.remove(&start);
        if len > blocks {
            self.free.insert(start + blocks, len - blocks);
        }
        self.free_blocks -= blocks;
        Some(Extent { start, blocks })
    }

    /// The lowest free runs, cut to hold `blocks` in all (fewer if less is free): where
    /// first fit puts the next extents.
    pub fn lowest(&self, mut blocks: u64) -> Vec<Extent> {
        let mut out = Vec::new();
        for (&start, &len) in &self.free {
            if blocks == 0 {
                break;
            }
            let take = len.min(blocks);
            out.push(Extent {
                start,
                blocks: take,
            });
            blocks -= take;
        }
        out
    }

    pub fn free(&mut self, e: Extent) {
        if e.blocks == 0 {
            return;
        }
        let mut start = e.start;
        let mut len = e.blocks;
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "double free of {e:?}");
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(e.start + e.blocks)) {
            self.free.remove(&(e.start + e.blocks));
            len += nl;
        }
        self.free.insert(start, len);
        self.free_blocks += e.blocks;
    }
}
