//! The patch graph: an arena of patches with generation-checked ids and the edges between
//! them. This module knows nothing about blocks' contents or the device; it keeps the
//! graph's shape and answers reachability questions.

use quilt_block::BlockNo;
use rustc_hash::FxHashSet as HashSet;

/// Searches visiting at most this many patches keep them in a list (see
/// `Graph::reaches_small`).
const SMALL_SEARCH: usize = 64;

thread_local! {
    /// The stack and the patches seen of the thread's bounded searches.
    static SMALL_SEARCH_SCRATCH: std::cell::RefCell<(Vec<PatchId>, Vec<PatchId>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// A handle on a patch. Generation-checked: once the patch is durable its slot is reused
/// under a new generation and the old id resolves to "durable".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PatchId {
    pub(crate) idx: u32,
    pub(crate) gen: u32,
}

impl std::fmt::Display for PatchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p{}.{}", self.idx, self.gen)
    }
}

#[derive(Debug)]
pub(crate) enum Kind {
    /// Bytes `[offset, offset+len)` of the block. `undo` holds the bytes they replaced
    /// (None for a hard patch, which is never rolled back).
    Byte {
        offset: u32,
        len: u32,
        undo: Option<Box<[u8]>>,
    },
    /// XOR `xor` into the 32-bit little-endian word at byte `offset`. Self-inverse, so
    /// it needs no undo bytes.
    Bit { offset: u32, xor: u32 },
    /// No block change. `holds > 0` keeps it from becoming durable (patchgroup tails and
    /// heads use this until release).
    Empty { holds: u32 },
}

#[derive(Debug)]
pub(crate) struct Patch {
    /// The block it changes; for a run, its first block.
    pub block: Option<BlockNo>,
    /// Blocks covered from `block` on: 1, or more for a *run* (a hard patch over fresh
    /// consecutive blocks written whole, see `Engine::write_run`).
    pub span: u32,
    /// Made by `write_run`: may grow over the blocks that follow it while pending.
    pub run: bool,
    pub kind: Kind,
    /// Patches that must be durable first. May hold stale (durable) ids: they are pruned
    /// lazily, because an aggregator with thousands of befores would otherwise pay a scan
    /// for every one that becomes durable.
    pub befores: Vec<PatchId>,
    pub afters: Vec<PatchId>,
    /// Creation order on the block: rollback goes newest first.
    pub seq: u64,
    /// Captured in the image of the epoch now writing; no merging into it.
    pub in_flight: bool,
    /// User data rather than metadata (the journal's meta mode needs to tell them apart).
    pub data: bool,
    /// Slots of patches merged into this one; they forward here and die with it.
    pub absorbed: Vec<u32>,
    /// Edge instances in `befores` that are *waits*: onto a pending patch on another block
    /// or onto an empty patch. Kept equal to a recount by every edge change, so that
    /// readiness is a counter test (`epoch.rs`): a patch whose waits are 0 can be written
    /// together with the ready patches on its own block.
    pub waits: u32,
}

impl Patch {
    /// A pending patch with no edges yet.
    pub fn new(block: Option<BlockNo>, kind: Kind, seq: u64, data: bool) -> Patch {
        Patch {
            block,
            span: 1,
            run: false,
            kind,
            befores: Vec::new(),
            afters: Vec::new(),
            seq,
            in_flight: false,
            data,
            absorbed: Vec::new(),
            waits: 0,
        }
    }

    /// Byte range touched, for overlap tests. Bit patches touch their word.
    pub fn range(&self) -> (u32, u32) {
        match self.kind {
            Kind::Byte { offset, len, .. } => (offset, offset + len),
            Kind::Bit { offset, .. } => (offset, offset + 4),
            Kind::Empty { .. } => (0, 0),
        }
    }
    /// Is `b` one of the blocks this patch changes?
    pub fn on_block(&self, b: BlockNo) -> bool {
        self.block
            .is_some_and(|first| b >= first && b - first < self.span as u64)
    }
    /// The blocks this patch changes (none for an empty patch).
    pub fn blocks(&self) -> std::ops::Range<BlockNo> {
        match self.block {
            Some(first) => first..first + self.span as u64,
            None => 0..0,
        }
    }
    pub fn is_empty(&self) -> bool {
        matches!(self.kind, Kind::Empty { .. })
    }
    pub fn is_held(&self) -> bool {
        matches!(self.kind, Kind::Empty { holds } if holds > 0)
    }
    pub fn is_hard(&self) -> bool {
        matches!(self.kind, Kind::Byte { undo: None, .. })
    }
    pub fn undo_len(&self) -> usize {
        match &self.kind {
            Kind::Byte { undo: Some(u), .. } => u.len(),
            _ => 0,
        }
    }
    /// Does `self` touch any byte (or bit) that `other` touches? Two bit patches on one
    /// word overlap only if they flip a common bit: XORs of disjoint bits commute.
    pub fn overlaps(&self, other: &Patch) -> bool {
        if let (Kind::Bit { offset: a, xor: x }, Kind::Bit { offset: b, xor: y }) =
            (&self.kind, &other.kind)
        {
            return a == b && x & y != 0;
        }
        let (a0, a1) = self.range();
        let (b0, b1) = other.range();
        a0 < b1 && b0 < a1
    }
    /// Does `self` cover everything `other` touches (so that later overlap searches may
    /// skip `other`: whatever overlaps it overlaps `self`, which depends on it)?
    pub fn covers(&self, other: &Patch) -> bool {
        match (&self.kind, &other.kind) {
            (Kind::Bit { offset: a, xor: x }, Kind::Bit { offset: b, xor: y }) => {
                a == b && x & y == *y
            }
            (Kind::Bit { .. }, _) => false,
            _ => {
                let (a0, a1) = self.range();
                let (b0, b1) = other.range();
                a0 <= b0 && b1 <= a1
            }
        }
    }
}

#[derive(Debug)]
enum SlotState {
    Free,
    Live(Patch),
    /// Merged into another patch; resolves to it.
    Forward(PatchId),
}

#[derive(Debug)]
struct Slot {
    gen: u32,
    state: SlotState,
}

/// The arena. Edges are kept on both ends; `befores` lists may be stale (see [`Patch`]).
#[derive(Debug, Default)]
pub(crate) struct Graph {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
}

impl Graph {
    pub fn live(&self) -> usize {
        self.live
    }

    pub fn insert(&mut self, patch: Patch) -> PatchId {
        self.live += 1;
        if let Some(idx) = self.free.pop() {
            let slot = &mut self.slots[idx as usize];
            slot.state = SlotState::Live(patch);
            return PatchId { idx, gen: slot.gen };
        }
        let idx = u32::try_from(self.slots.len()).expect("more than 2^32 live patches");
        self.slots.push(Slot {
            gen: 0,
            state: SlotState::Live(patch),
        });
        PatchId { idx, gen: 0 }
    }

    /// The live patch `id` stands for, following merges; None if it is durable.
    pub fn resolve(&self, mut id: PatchId) -> Option<PatchId> {
        loop {
            let slot = self.slots.get(id.idx as usize)?;
            if slot.gen != id.gen {
                return None;
            }
            match &slot.state {
                SlotState::Free => return None,
                SlotState::Live(_) => return Some(id),
                SlotState::Forward(to) => id = *to,
            }
        }
    }

    /// The patch with exactly this id (already resolved).
    pub fn get(&self, id: PatchId) -> &Patch {
        match &self.slots[id.idx as usize] {
            Slot {
                gen,
                state: SlotState::Live(p),
            } if *gen == id.gen => p,
            _ => panic!("patch {id} is not live (callers resolve ids first)"),
        }
    }

    pub fn get_mut(&mut self, id: PatchId) -> &mut Patch {
        match &mut self.slots[id.idx as usize] {
            Slot {
                gen,
                state: SlotState::Live(p),
            } if *gen == id.gen => p,
            _ => panic!("patch {id} is not live (callers resolve ids first)"),
        }
    }

    /// Removes a durable patch and the forwarding slots of everything merged into it.
    pub fn remove(&mut self, id: PatchId) -> Patch {
        let slot = &mut self.slots[id.idx as usize];
        assert_eq!(slot.gen, id.gen);
        let SlotState::Live(p) = std::mem::replace(&mut slot.state, SlotState::Free) else {
            panic!("removing patch {id} that is not live");
        };
        slot.gen = slot.gen.wrapping_add(1);
        self.free.push(id.idx);
        self.live -= 1;
        for &idx in &p.absorbed {
            let s = &mut self.slots[idx as usize];
            s.state = SlotState::Free;
            s.gen = s.gen.wrapping_add(1);
            self.free.push(idx);
        }
        p
    }

    /// Turns live patch `from` into a forward to `to`, returning its contents. The caller
    /// moves its edges. Every slot that forwarded to `from` now forwards to `to` directly,
    /// so resolving an id takes at most one hop and `is_durable` is O(1).
    pub fn forward(&mut self, from: PatchId, to: PatchId) -> Patch {
        let slot = &mut self.slots[from.idx as usize];
        let SlotState::Live(mut p) = std::mem::replace(&mut slot.state, SlotState::Forward(to))
        else {
            panic!("forwarding patch {from} that is not live");
        };
        self.live -= 1;
        let mut absorbed = std::mem::take(&mut p.absorbed);
        for &idx in &absorbed {
            self.slots[idx as usize].state = SlotState::Forward(to);
        }
        absorbed.push(from.idx);
        self.get_mut(to).absorbed.extend(absorbed);
        p
    }

    /// Drops durable ids and self-edges from `id`'s befores list. Duplicates stay: each
    /// entry is one edge instance, matched by one entry in the before's afters list, and
    /// the wait counts count instances.
    pub fn prune_befores(&mut self, id: PatchId) {
        let mut befores = std::mem::take(&mut self.get_mut(id).befores);
        befores.retain(|&b| self.resolve(b).is_some_and(|r| r != id));
        self.get_mut(id).befores = befores;
    }

    /// Is `target` reachable from `start` by following befores? Visits at most
    /// `limit` patches; `None` means "gave up" (callers treat it as "maybe").
    pub fn reaches(&self, start: PatchId, target: PatchId, limit: usize) -> Option<bool> {
        if limit <= SMALL_SEARCH {
            return self.reaches_small(start, target, limit);
        }
        let mut seen = HashSet::default();
        let mut stack = vec![start];
        while let Some(id) = stack.pop() {
            let Some(id) = self.resolve(id) else { continue };
            if id == target {
                return Some(true);
            }
            if !seen.insert(id) {
                continue;
            }
            if seen.len() > limit {
                return None;
            }
            stack.extend(self.get(id).befores.iter().copied());
        }
        Some(false)
    }

    /// [`Graph::reaches`] for a bounded search (the merge's cycle check, made for
    /// most changes): the patches seen fit a short list, and the list and the stack
    /// are the thread's, reused, so the search allocates nothing.
    fn reaches_small(&self, start: PatchId, target: PatchId, limit: usize) -> Option<bool> {
        SMALL_SEARCH_SCRATCH.with(|scratch| {
            let (stack, seen) = &mut *scratch.borrow_mut();
            stack.clear();
            seen.clear();
            stack.push(start);
            while let Some(id) = stack.pop() {
                let Some(id) = self.resolve(id) else { continue };
                if id == target {
                    return Some(true);
                }
                if seen.contains(&id) {
                    continue;
                }
                seen.push(id);
                if seen.len() > limit {
                    return None;
                }
                stack.extend(self.get(id).befores.iter().copied());
            }
            Some(false)
        })
    }

    pub fn iter_live(&self) -> impl Iterator<Item = (PatchId, &Patch)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &s.state {
                SlotState::Live(p) => Some((
                    PatchId {
                        idx: i as u32,
                        gen: s.gen,
                    },
                    p,
                )),
                _ => None,
            })
    }
}
