//! Write-back in epochs, and the graph's invariants.
//!
//! An epoch: (1) under the state lock, find on each dirty block the patches that are
//! ready, build the block's image with the others rolled back, and mark the ready ones in
//! flight; (2) without the lock, write the images and flush the device; (3) under the lock
//! again, mark the written patches durable. Step (2)'s flush is the commit point: a patch
//! is durable only once it returns, and only then may its afters be written. Epochs are
//! serialised, so no patch is in flight outside step (2).

use crate::engine::{befores_durable, xor_word, Durability, Engine, State};
use crate::graph::{Kind, PatchId};
use crate::{PatchError, Result};
use quilt_block::BlockNo;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::fmt::Write as _;
use std::sync::Arc;

/// What one epoch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EpochReport {
    pub blocks_written: usize,
    pub patches_written: usize,
    pub patches_rolled_back: usize,
}

/// Which blocks an epoch considers.
enum Target {
    All,
    Blocks(HashSet<BlockNo>),
    /// The blocks of this patch's pending closure.
    Until(PatchId),
}

struct BlockImage {
    block: BlockNo,
    image: Arc<[u8]>,
    ready: Vec<PatchId>,
}

impl Engine {
    /// One epoch over every dirty block.
    pub fn epoch(&self) -> Result<EpochReport> {
        self.epoch_on(Target::All).map(|r| r.unwrap_or_default())
    }

    /// One epoch over the blocks holding `p`'s pending transitive befores. The blocks are
    /// chosen under the epoch lock, so a concurrent epoch cannot make the choice stale.
    /// None when `p` is already durable; `Pinned` when it waits for a held patch.
    fn epoch_until(&self, p: PatchId) -> Result<Option<EpochReport>> {
        self.epoch_on(Target::Until(p))
    }

    fn epoch_on(&self, target: Target) -> Result<Option<EpochReport>> {
        let until = match target {
            Target::Until(p) => Some(p),
            _ => None,
        };
        let _epoch = self.sh.epoch.lock().unwrap_or_else(|e| e.into_inner());
        let (batch, rolled_back) = {
            let mut st = self.lock();
            st.check_failed()?;
            let only = match target {
                Target::All => None,
                Target::Blocks(set) => Some(set),
                Target::Until(p) => {
                    let Some(p) = st.g.resolve(p) else {
                        return Ok(None);
                    };
                    let (blocks, pinned) = st.closure(p);
                    if blocks.is_empty() {
                        // Only empty patches are left: either held ones, or p itself is a
                        // held empty whose befores are all durable.
                        return if pinned {
                            Err(PatchError::Pinned)
                        } else {
                            Ok(None)
                        };
                    }
                    Some(blocks)
                }
            };
            st.prepare_epoch(only.as_ref())
        };
        if batch.is_empty() {
            // With the epoch lock held nothing else can be writing: what is left waits
            // for a patch no epoch can write.
            return if until.is_some() {
                Err(PatchError::Pinned)
            } else {
                Ok(Some(EpochReport::default()))
            };
        }
        let safe = self.sh.opts.durability == Durability::Safe;
        let io = (|| {
            for b in &batch {
                self.sh.dev.write(b.block, &b.image)?;
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

    /// Writes back until nothing that can be written is left (blocks held back by
    /// unreleased patchgroups stay dirty). Returns the number of epochs run.
    pub fn write_back_ready(&self) -> Result<usize> {
        // The first epoch looks at every dirty block; later ones only at blocks holding
        // afters of what the previous epoch made durable, since nothing else can have
        // become ready. (Rescanning stuck blocks made deep chains quadratic.)
        let mut r = self.epoch()?;
        let mut epochs = 0;
        while r.patches_written > 0 {
            epochs += 1;
            let woken = std::mem::take(&mut self.lock().woken);
            if woken.is_empty() {
                break;
            }
            r = self.epoch_on(Target::Blocks(woken))?.unwrap_or_default();
        }
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
                // An epoch over every dirty block wrote nothing.
                return Err(PatchError::Pinned);
            }
        }
    }

    /// Makes `p` and its transitive befores durable, writing only the blocks they live on
    /// (this is what fsync uses). For a held empty patch (a patchgroup's head), makes its
    /// befores durable.
    pub fn flush_until(&self, p: PatchId) -> Result<()> {
        while self.epoch_until(p)?.is_some() {}
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
    /// whether some of them wait for a held empty patch.
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
            stack.extend(self.g.live_befores(id));
        }
        (blocks, pinned)
    }

    /// The patches on `block` that can be written now: the greatest subset whose every
    /// before is durable, in the subset, or an unheld empty patch satisfying the same.
    fn ready_set(&mut self, block: BlockNo) -> Vec<PatchId> {
        let pending = self.blocks[&block].pending.clone();
        // Prune stale befores once, so the fixpoint below only reads.
        let befores: HashMap<PatchId, Vec<PatchId>> = pending
            .iter()
            .map(|&p| (p, self.g.live_befores(p)))
            .collect();
        let mut cand: HashSet<PatchId> = pending.iter().copied().collect();
        loop {
            let mut memo: HashMap<PatchId, bool> = HashMap::default();
            let mut removed = false;
            for &p in &pending {
                if !cand.contains(&p) {
                    continue;
                }
                let ok = befores[&p]
                    .iter()
                    .all(|&b| self.before_ok(b, block, &cand, &mut memo));
                if !ok {
                    cand.remove(&p);
                    removed = true;
                }
            }
            if !removed {
                break;
            }
        }
        pending.into_iter().filter(|p| cand.contains(p)).collect()
    }

    fn before_ok(
        &self,
        b: PatchId,
        block: BlockNo,
        cand: &HashSet<PatchId>,
        memo: &mut HashMap<PatchId, bool>,
    ) -> bool {
        let Some(b) = self.g.resolve(b) else {
            return true;
        };
        let p = self.g.get(b);
        match p.block {
            Some(bb) => bb == block && cand.contains(&b),
            None if p.is_held() => false,
            None => {
                if let Some(&v) = memo.get(&b) {
                    return v;
                }
                // Provisionally false: the graph is acyclic, so this only guards against a
                // broken invariant turning into endless recursion.
                memo.insert(b, false);
                let v = p
                    .befores
                    .iter()
                    .all(|&x| self.before_ok(x, block, cand, memo));
                memo.insert(b, v);
                v
            }
        }
    }

    fn prepare_epoch(&mut self, only: Option<&HashSet<BlockNo>>) -> (Vec<BlockImage>, usize) {
        let dirty: Vec<BlockNo> = match only {
            Some(set) => self
                .dirty
                .iter()
                .copied()
                .filter(|b| set.contains(b))
                .collect(),
            None => self.dirty.iter().copied().collect(),
        };
        let mut batch = Vec::new();
        let mut rolled_back = 0;
        for block in dirty {
            let ready = self.ready_set(block);
            if ready.is_empty() {
                continue;
            }
            let blk = &self.blocks[&block];
            let ready_set: HashSet<PatchId> = ready.iter().copied().collect();
            let mut not_ready: Vec<PatchId> = blk
                .pending
                .iter()
                .copied()
                .filter(|p| !ready_set.contains(p))
                .collect();
            // Newest first: each rollback restores the bytes its patch found.
            not_ready.sort_by_key(|&p| std::cmp::Reverse(self.g.get(p).seq));
            // Nothing to roll back (the common case): the image is the cached data itself.
            let image: Arc<[u8]> = if not_ready.is_empty() {
                blk.data.clone()
            } else {
                let mut image = blk.data.to_vec();
                self.roll_back(block, &not_ready, &mut image);
                rolled_back += not_ready.len();
                image.into()
            };
            for &p in &ready {
                self.g.get_mut(p).in_flight = true;
            }
            if let Some(h) = self.blocks[&block].hard {
                if ready_set.contains(&h) {
                    self.blocks
                        .get_mut(&block)
                        .expect("dirty block is cached")
                        .hard = None;
                }
            }
            batch.push(BlockImage {
                block,
                image,
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
        // All patches of the epoch are durable together (one flush), so their edges among
        // themselves need no order; satisfy befores first to keep the debug check honest.
        let mut all: Vec<PatchId> = batch.iter().flat_map(|b| b.ready.iter().copied()).collect();
        let mut done: HashSet<PatchId> = HashSet::default();
        while !all.is_empty() {
            let before = done.len();
            all.retain(|&p| {
                if befores_durable(&self.g, p) {
                    self.satisfy(p);
                    done.insert(p);
                    false
                } else {
                    true
                }
            });
            assert!(
                done.len() > before || all.is_empty(),
                "epoch wrote patches whose befores are not durable: {all:?}"
            );
        }
        report.patches_written = done.len();
        for b in batch {
            let blk = self
                .blocks
                .get_mut(&b.block)
                .expect("written block is cached");
            blk.pending.retain(|p| !done.contains(p));
            blk.overlap_index.retain(|p| !done.contains(p));
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
            if let Some(b) = p.block {
                let Some(blk) = self.blocks.get(&b) else {
                    return Err(format!("{id} is on block {b}, which is not cached"));
                };
                if !blk.pending.contains(&id) {
                    return Err(format!("{id} is missing from block {b}'s pending list"));
                }
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
            for &p in &blk.pending {
                if self.g.resolve(p) != Some(p) || self.g.get(p).block != Some(b) {
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
