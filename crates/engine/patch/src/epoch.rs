//! Write-back in epochs, and the graph's invariants.
//!
//! An epoch: (1) under the state lock, find on each dirty block the patches that are
//! ready, build the block's image with the others rolled back, and mark the ready ones in
//! flight; (2) without the lock, write the images and flush the device; (3) under the lock
//! again, mark the written patches durable. Step (2)'s flush is the commit point: a patch
//! is durable only once it returns, and only then may its afters be written. Epochs are
//! serialised, so no patch is in flight outside step (2).

use crate::engine::{
    consecutive_runs, is_wait, xor_word, Durability, Engine, State, RUN_BLOCKS_MAX,
};
use crate::graph::{Kind, PatchId};
use crate::{PatchError, Result};
use quilt_block::{BlockDeviceExt, BlockNo, WriteClass};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::fmt::Write as _;

/// What one epoch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EpochReport {
    pub blocks_written: usize,
    pub patches_written: usize,
    pub patches_rolled_back: usize,
}

/// Which blocks an epoch considers.
enum Target<'a> {
    /// Every candidate block.
    All,
    /// The candidates woken since the last epoch began: blocks where a patch became
    /// ready because another became durable, not blocks changed meanwhile.
    Woken,
    /// The candidates among the blocks of `p`'s pending closure. `blocks` caches that
    /// closure across the epochs of one `flush_until`: patches leave the closure but only
    /// a merge adds to it, so it is recomputed only when an epoch finds nothing to write.
    Until {
        p: PatchId,
        blocks: &'a mut Option<HashSet<BlockNo>>,
    },
}

struct BlockImage {
    block: BlockNo,
    image: crate::BlockBuf,
    /// File data when every patch written is (a block of a file's bytes), else metadata.
    class: WriteClass,
    /// The patches written, each after its befores on the block.
    ready: Vec<PatchId>,
}

impl Engine {
    /// One epoch: writes every block that carries a ready patch.
    pub fn epoch(&self) -> Result<EpochReport> {
        self.epoch_on(Target::All).map(|r| r.unwrap_or_default())
    }

    fn epoch_on(&self, target: Target<'_>) -> Result<Option<EpochReport>> {
        let until = matches!(target, Target::Until { .. });
        let _epoch = self.sh.epoch.lock().unwrap_or_else(|e| e.into_inner());
        let (batch, rolled_back) = {
            let mut st = self.lock();
            st.check_failed()?;
            let chosen = match target {
                Target::All => {
                    st.woken.clear();
                    std::mem::take(&mut st.candidates).into_iter().collect()
                }
                Target::Woken => {
                    let mut woken = std::mem::take(&mut st.woken);
                    woken.sort_unstable();
                    woken.dedup();
                    woken.retain(|b| st.candidates.remove(b));
                    woken
                }
                Target::Until { p, blocks } => {
                    let Some(p) = st.g.resolve(p) else {
                        return Ok(None);
                    };
                    let mut fresh = blocks.is_none();
                    loop {
                        if blocks.is_none() {
                            let (set, pinned) = st.closure(p);
                            if set.is_empty() {
                                // Only empty patches are left: either held ones, or p
                                // itself is a held empty whose befores are all durable.
                                return if pinned {
                                    Err(PatchError::Pinned)
                                } else {
                                    Ok(None)
                                };
                            }
                            *blocks = Some(set);
                        }
                        let set = blocks.as_ref().expect("just computed");
                        let chosen = st.take_candidates_in(set);
                        if !chosen.is_empty() || fresh {
                            break chosen;
                        }
                        // Nothing ready in the closure as last computed: a merge may
                        // have given it new befores. Look once more before giving up.
                        *blocks = None;
                        fresh = true;
                    }
                }
            };
            st.prepare_epoch(chosen)
        };
        if batch.is_empty() {
            // With the epoch lock held nothing else can be writing: what is left waits
            // for a patch no epoch can write.
            return if until {
                Err(PatchError::Pinned)
            } else {
                Ok(Some(EpochReport::default()))
            };
        }
        let safe = self.sh.opts.durability == Durability::Safe;
        let io = (|| {
            // Runs of consecutive blocks go down as one request each (a Bε-tree node is
            // a run of 64 blocks): the epoch's writes have no order among them, only
            // the flush after them all.
            let mut order: Vec<usize> = (0..batch.len()).collect();
            order.sort_unstable_by_key(|&i| batch[i].block);
            let blocks: Vec<BlockNo> = order.iter().map(|&i| batch[i].block).collect();
            for r in consecutive_runs(&blocks, RUN_BLOCKS_MAX as usize) {
                let first = blocks[r.start];
                if r.len() == 1 {
                    let b = &batch[order[r.start]];
                    self.sh.dev.write(first, &b.image, b.class)?;
                } else {
                    // One request per run: it is data only if every block of it is.
                    let class = if order[r.clone()]
                        .iter()
                        .all(|&i| batch[i].class == WriteClass::Data)
                    {
                        WriteClass::Data
                    } else {
                        WriteClass::Metadata
                    };
                    let parts: Vec<&[u8]> = order[r].iter().map(|&i| &batch[i].image[..]).collect();
                    self.sh.dev.write_blocks_gather(first, &parts, class)?;
                }
            }
            // The commit point of the epoch: nothing in `batch` is durable before this.
            if safe {
                self.sh.dev.flush()?;
            }
            Ok::<(), quilt_block::BlockError>(())
        })();
        let mut st = self.lock();
        match io {
            Ok(()) => {
                let report = st.complete_epoch(&batch, rolled_back, safe);
                st.debug_check();
                Ok(Some(report))
            }
            Err(e) => {
                // The device now holds some subset of the epoch's writes: a crash state,
                // which the consistency mode copes with. The engine's view of what is
                // durable can no longer be trusted, so it stops, as a kernel file system
                // goes read-only after a write error.
                st.failed = Some(e.to_string());
                Err(e.into())
            }
        }
    }

    /// Writes back what is ready, and then what that makes ready, until nothing more
    /// is (blocks held back by unreleased patchgroups or a journal's running
    /// transaction stay dirty). Blocks changed meanwhile wait for the next call: a
    /// flusher round that took them too would never end while a writer keeps up (the
    /// PostMark run showed rounds of thousands of 30-block epochs, a device flush each).
    /// Returns the number of epochs that wrote something.
    pub fn write_back_ready(&self) -> Result<usize> {
        let mut epochs = 0;
        let mut target = Target::All;
        while self.epoch_on(target)?.unwrap_or_default().blocks_written > 0 {
            epochs += 1;
            target = Target::Woken;
        }
        let mut st = self.lock();
        st.held_floor = (st.g.live(), st.dirty.len());
        Ok(epochs)
    }

    /// Makes everything durable. Fails with [`PatchError::Pinned`] if some patches wait
    /// for a patchgroup that is not released.
    pub fn sync(&self) -> Result<()> {
        loop {
            let epochs = self.write_back_ready()?;
            if self.lock().dirty.is_empty() {
                return Ok(());
            }
            if epochs == 0 {
                // An epoch over every candidate block wrote nothing.
                return Err(PatchError::Pinned);
            }
        }
    }

    /// Makes `p` and its transitive befores durable, writing only the blocks they live on
    /// (this is what fsync uses). For a held empty patch (a patchgroup's head), makes its
    /// befores durable.
    pub fn flush_until(&self, p: PatchId) -> Result<()> {
        let mut blocks = None;
        while self
            .epoch_on(Target::Until {
                p,
                blocks: &mut blocks,
            })?
            .is_some()
        {}
        Ok(())
    }

    /// Checks the graph's invariants; the error says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().check_invariants()
    }

    /// The pending patch graph in Graphviz dot, for debugging.
    pub fn dump_dot(&self) -> String {
        self.lock().dump_dot()
    }
}

impl State {
    /// The blocks holding `p`'s pending transitive befores (and `p`'s own block), and
    /// whether some of them wait for a held empty patch. O(patches and edges in the
    /// closure); prunes durable ids from the lists it walks.
    fn closure(&mut self, p: PatchId) -> (HashSet<BlockNo>, bool) {
        let mut blocks = HashSet::default();
        let mut pinned = false;
        let mut seen = HashSet::default();
        let mut stack = vec![p];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let patch = self.g.get(id);
            if let Some(b) = patch.block {
                blocks.insert(b);
            } else if patch.is_held() && id != p {
                pinned = true;
                continue;
            }
            self.g.prune_befores(id);
            for &b in &self.g.get(id).befores {
                let b = self.g.resolve(b).expect("pruned");
                if !seen.contains(&b) {
                    stack.push(b);
                }
            }
        }
        (blocks, pinned)
    }

    /// Takes out of the candidates those in `set`, walking the smaller of the two.
    fn take_candidates_in(&mut self, set: &HashSet<BlockNo>) -> Vec<BlockNo> {
        let chosen: Vec<BlockNo> = if set.len() < self.candidates.len() {
            let mut v: Vec<BlockNo> = set
                .iter()
                .copied()
                .filter(|b| self.candidates.contains(b))
                .collect();
            v.sort_unstable();
            v
        } else {
            self.candidates
                .iter()
                .copied()
                .filter(|b| set.contains(b))
                .collect()
        };
        for b in &chosen {
            self.candidates.remove(b);
        }
        chosen
    }

    /// The patches on `block` that can be written now, each after its befores on the
    /// block: those with no waits whose befores on the block are ready too. A depth-first
    /// walk over the block's pending patches and their same-block edges, so its cost is
    /// the block's own share of the graph. (A patch with no waits has only durable or
    /// same-block befores.)
    fn ready_on(&mut self, block: BlockNo) -> Vec<PatchId> {
        const VISITING: u8 = 1;
        const READY: u8 = 2;
        const NOT: u8 = 3;
        let pending = self.blocks[&block].pending.clone();
        let mut mark: HashMap<PatchId, u8> = HashMap::default();
        let mut order = Vec::new();
        for root in pending {
            if mark.contains_key(&root) {
                continue;
            }
            mark.insert(root, VISITING);
            // (patch, next index into its befores, first visit done)
            let mut stack: Vec<(PatchId, usize, bool)> = vec![(root, 0, false)];
            while let Some(&(id, i, visited)) = stack.last() {
                if !visited {
                    if self.g.get(id).waits > 0 {
                        mark.insert(id, NOT);
                        stack.pop();
                        continue;
                    }
                    self.g.prune_befores(id);
                }
                let befores = &self.g.get(id).befores;
                let mut next = i;
                // None: every before is ready; Some(Some(b)): visit b first;
                // Some(None): some before is not ready.
                let mut verdict: Option<Option<PatchId>> = None;
                while next < befores.len() {
                    let b = self.g.resolve(befores[next]).expect("pruned");
                    debug_assert!(
                        self.g.get(b).block == Some(block) && !self.g.get(b).run,
                        "{id} has no waits but waits for {b} off its block or on a run"
                    );
                    match mark.get(&b) {
                        Some(&READY) => next += 1,
                        // NOT, or VISITING (a cycle): never ready.
                        Some(_) => {
                            verdict = Some(None);
                            break;
                        }
                        None => {
                            verdict = Some(Some(b));
                            break;
                        }
                    }
                }
                *stack.last_mut().expect("non-empty") = (id, next, true);
                match verdict {
                    Some(Some(b)) => {
                        mark.insert(b, VISITING);
                        stack.push((b, 0, false));
                    }
                    Some(None) => {
                        mark.insert(id, NOT);
                        stack.pop();
                    }
                    None => {
                        mark.insert(id, READY);
                        order.push(id);
                        stack.pop();
                    }
                }
            }
        }
        order
    }

    fn prepare_epoch(&mut self, chosen: Vec<BlockNo>) -> (Vec<BlockImage>, usize) {
        let mut batch = Vec::new();
        let mut rolled_back = 0;
        // A ready run is written whole: its other blocks join the epoch (each is dirty,
        // and the run is ready on each of them).
        let mut work = chosen;
        let mut taken: HashSet<BlockNo> = work.iter().copied().collect();
        // A run's patch is ready on each of its blocks: its blocks are added once, not
        // once per block (a 1 MiB write's run of 256 blocks made 65,536 set inserts,
        // a fifth of the server's time writing sequentially).
        let mut expanded: HashSet<PatchId> = HashSet::default();
        let mut next = 0;
        while next < work.len() {
            let block = work[next];
            next += 1;
            if !self.dirty.contains(&block) {
                continue;
            }
            self.stats.blocks_examined += 1;
            // A block of a run found ready on an earlier block of this epoch, holding
            // nothing else, is ready as it is: the walk would find just that (a Bε-tree
            // checkpoint writes thousands of such blocks, and the walk's maps and sets
            // per block were a tenth of its write-back).
            let ready = match self.blocks[&block].pending[..] {
                [p] if self.g.get(p).in_flight && self.g.get(p).run => vec![p],
                _ => self.ready_on(block),
            };
            if ready.is_empty() {
                continue;
            }
            let blk = &self.blocks[&block];
            let ready_set: HashSet<PatchId> = if ready.len() > 8 {
                ready.iter().copied().collect()
            } else {
                HashSet::default()
            };
            let is_ready = |p: &PatchId| {
                if ready.len() > 8 {
                    ready_set.contains(p)
                } else {
                    ready.contains(p)
                }
            };
            let mut not_ready: Vec<PatchId> = blk
                .pending
                .iter()
                .copied()
                .filter(|p| !is_ready(p))
                .collect();
            // Newest first: each rollback restores the bytes its patch found.
            not_ready.sort_by_key(|&p| std::cmp::Reverse(self.g.get(p).seq));
            // Nothing to roll back (the common case): the image is the cached data itself.
            let image: crate::BlockBuf = if not_ready.is_empty() {
                blk.data.clone()
            } else {
                let mut image = blk.data.to_vec();
                self.roll_back(block, &not_ready, &mut image);
                rolled_back += not_ready.len();
                crate::block_buf(image)
            };
            for &p in &ready {
                let patch = self.g.get_mut(p);
                patch.in_flight = true;
                if patch.span > 1 && expanded.insert(p) {
                    for b in patch.blocks() {
                        if taken.insert(b) {
                            work.push(b);
                        }
                    }
                }
            }
            if let Some(h) = self.blocks[&block].hard {
                if is_ready(&h) {
                    self.blocks
                        .get_mut(&block)
                        .expect("dirty block is cached")
                        .hard = None;
                }
            }
            let class = if ready.iter().all(|&p| self.g.get(p).data) {
                WriteClass::Data
            } else {
                WriteClass::Metadata
            };
            batch.push(BlockImage {
                block,
                image,
                class,
                ready,
            });
        }
        (batch, rolled_back)
    }

    /// Undoes `not_ready` (newest first) in `image`.
    fn roll_back(&self, block: BlockNo, not_ready: &[PatchId], image: &mut [u8]) {
        for &p in not_ready {
            match &self.g.get(p).kind {
                Kind::Byte {
                    offset,
                    len,
                    undo: Some(undo),
                } => image[*offset as usize..(*offset + *len) as usize].copy_from_slice(undo),
                Kind::Bit { offset, xor } => xor_word(image, *offset as usize, *xor),
                Kind::Byte { undo: None, .. } => {
                    panic!("hard patch {p} on block {block} would need a rollback: a ready patch on its block does not depend on it")
                }
                Kind::Empty { .. } => unreachable!("empty patches have no block"),
            }
        }
    }

    fn complete_epoch(
        &mut self,
        batch: &[BlockImage],
        rolled_back: usize,
        flushed: bool,
    ) -> EpochReport {
        let mut report = EpochReport {
            blocks_written: batch.len(),
            patches_rolled_back: rolled_back,
            ..Default::default()
        };
        // All patches of the epoch are durable together (one flush). Their edges among
        // themselves are all on one block (a ready patch has no waits), and each block's
        // list puts befores first, so satisfying in list order keeps every patch's befores
        // durable before it (as `satisfy`'s debug check asserts).
        let mut done: HashSet<PatchId> = HashSet::default();
        for b in batch {
            for &p in &b.ready {
                self.satisfy(p);
                done.insert(p);
            }
        }
        report.patches_written = done.len();
        for b in batch {
            let blk = self
                .blocks
                .get_mut(&b.block)
                .expect("written block is cached");
            blk.pending.retain(|p| !done.contains(p));
            blk.overlap_index.retain(|p| !done.contains(&p));
            if blk.pending.is_empty() {
                self.dirty.remove(&b.block);
            }
        }
        self.stats.epochs += 1;
        self.stats.blocks_written += batch.len() as u64;
        self.stats.patches_rolled_back += rolled_back as u64;
        if flushed {
            self.stats.flushes += 1;
        }
        report
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        let mut undo = 0u64;
        let mut extern_count: HashMap<BlockNo, u64> = HashMap::default();
        for (id, p) in self.g.iter_live() {
            undo += p.undo_len() as u64;
            let waits = p
                .befores
                .iter()
                .filter_map(|&b| self.g.resolve(b))
                .filter(|&b| b != id && is_wait(p.block, self.g.get(b)))
                .count();
            if waits != p.waits as usize {
                return Err(format!(
                    "{id} counts {} waits but its befores hold {waits}",
                    p.waits
                ));
            }
            if waits == 0 && p.is_empty() && !p.is_held() {
                return Err(format!(
                    "{id} is an unheld empty patch with nothing to wait for"
                ));
            }
            for &b in &p.befores {
                let Some(b) = self.g.resolve(b) else { continue };
                if b == id {
                    continue;
                }
                if !self
                    .g
                    .get(b)
                    .afters
                    .iter()
                    .any(|&a| self.g.resolve(a) == Some(id))
                {
                    return Err(format!(
                        "{id} waits for {b} but {b} does not list it as an after"
                    ));
                }
            }
            for &a in &p.afters {
                let Some(ar) = self.g.resolve(a) else {
                    return Err(format!(
                        "{id} has after {a} that is durable while {id} is not"
                    ));
                };
                if ar == id {
                    continue;
                }
                if let Some(bb) = p.block {
                    if self.g.get(ar).block != Some(bb) {
                        *extern_count.entry(bb).or_default() += 1;
                    }
                }
            }
            for b in p.blocks() {
                let Some(blk) = self.blocks.get(&b) else {
                    return Err(format!("{id} is on block {b}, which is not cached"));
                };
                if !blk.pending.contains(&id) {
                    return Err(format!("{id} is missing from block {b}'s pending list"));
                }
            }
            if p.span > 1 && (!p.run || !p.is_hard()) {
                return Err(format!("{id} spans {} blocks but is no hard run", p.span));
            }
        }
        if undo != self.stats.undo_bytes_now {
            return Err(format!(
                "undo bytes: counted {} but patches hold {undo}",
                self.stats.undo_bytes_now
            ));
        }
        for (&b, blk) in &self.blocks {
            if blk.extern_afters != extern_count.get(&b).copied().unwrap_or(0) {
                return Err(format!(
                    "block {b}: extern_afters {} but edges say {}",
                    blk.extern_afters,
                    extern_count.get(&b).copied().unwrap_or(0)
                ));
            }
            if blk.pending.is_empty() == self.dirty.contains(&b) {
                return Err(format!("block {b}: dirty set disagrees with pending list"));
            }
            if !self.candidates.contains(&b) {
                if let Some(p) = self.some_ready_on(b) {
                    return Err(format!(
                        "block {b} carries ready patch {p} but is not an epoch candidate"
                    ));
                }
            }
            for &p in &blk.pending {
                if self.g.resolve(p) != Some(p) || !self.g.get(p).on_block(b) {
                    return Err(format!(
                        "block {b} lists {p}, which is not a live patch on it"
                    ));
                }
            }
            if let Some(h) = blk.hard {
                if !self.g.get(h).is_hard() {
                    return Err(format!("block {b}: hard patch {h} has undo bytes"));
                }
                // Negative space: nothing on the block may be written without the hard
                // patch, or the hard patch would need a rollback.
                for &p in &blk.pending {
                    if p != h
                        && self.g.get(p).seq > self.g.get(h).seq
                        && self.g.reaches(p, h, usize::MAX) != Some(true)
                    {
                        return Err(format!("block {b}: {p} does not depend on hard patch {h}"));
                    }
                    if self.g.get(p).seq < self.g.get(h).seq && !self.g.get(p).in_flight {
                        return Err(format!("block {b}: {p} is older than hard patch {h} but was not folded into it"));
                    }
                }
            }
        }
        self.check_acyclic()
    }

    /// A ready patch on `block` that is not being written, found from scratch by a
    /// fixpoint (the check's own computation, independent of `ready_on`'s walk). Patches
    /// being written count as durable: they are by the next epoch.
    fn some_ready_on(&self, block: BlockNo) -> Option<PatchId> {
        let pending = &self.blocks[&block].pending;
        let mut ready: HashSet<PatchId> = pending
            .iter()
            .copied()
            .filter(|&p| self.g.get(p).waits == 0)
            .collect();
        loop {
            let not: Vec<PatchId> = ready
                .iter()
                .copied()
                .filter(|&p| {
                    !self
                        .g
                        .get(p)
                        .befores
                        .iter()
                        .all(|&b| match self.g.resolve(b) {
                            None => true,
                            Some(b) => b == p || ready.contains(&b),
                        })
                })
                .collect();
            if not.is_empty() {
                break;
            }
            for p in not {
                ready.remove(&p);
            }
        }
        // A run is a candidate through its first block only.
        ready
            .into_iter()
            .filter(|&p| !self.g.get(p).in_flight && self.g.get(p).block == Some(block))
            .min()
    }

    fn check_acyclic(&self) -> Result<(), String> {
        // Iterative three-colour DFS over befores.
        let mut colour: HashMap<PatchId, u8> = HashMap::default();
        for (root, _) in self.g.iter_live() {
            if colour.contains_key(&root) {
                continue;
            }
            let mut stack: Vec<(PatchId, usize)> = vec![(root, 0)];
            colour.insert(root, 1);
            while let Some((id, i)) = stack.pop() {
                let befores = &self.g.get(id).befores;
                if i < befores.len() {
                    stack.push((id, i + 1));
                    let Some(b) = self.g.resolve(befores[i]) else {
                        continue;
                    };
                    if b == id {
                        continue;
                    }
                    match colour.get(&b) {
                        Some(1) => return Err(format!("cycle through {id} and {b}")),
                        Some(_) => {}
                        None => {
                            colour.insert(b, 1);
                            stack.push((b, 0));
                        }
                    }
                } else {
                    colour.insert(id, 2);
                }
            }
        }
        Ok(())
    }

    fn dump_dot(&self) -> String {
        let mut s = String::from(
            "digraph patches {\n  rankdir=BT;\n  node [shape=box, fontname=monospace];\n",
        );
        for (id, p) in self.g.iter_live() {
            let label = match &p.kind {
                Kind::Byte { offset, len, undo } => {
                    format!(
                        "{id}\\nblock {} [{offset}+{len}]{}",
                        p.block.unwrap_or(0),
                        if undo.is_none() { " hard" } else { "" }
                    )
                }
                Kind::Bit { offset, xor } => format!(
                    "{id}\\nblock {} bit@{offset} ^{xor:#x}",
                    p.block.unwrap_or(0)
                ),
                Kind::Empty { holds } => {
                    format!("{id}\\nempty{}", if *holds > 0 { " (held)" } else { "" })
                }
            };
            let style = if p.is_empty() { ", style=dashed" } else { "" };
            let _ = writeln!(s, "  \"{id}\" [label=\"{label}\"{style}];");
            let mut seen = HashSet::default();
            for &b in &p.befores {
                if let Some(b) = self.g.resolve(b) {
                    if b != id && seen.insert(b) {
                        let _ = writeln!(s, "  \"{id}\" -> \"{b}\";");
                    }
                }
            }
        }
        s.push_str("}\n");
        s
    }
}
