//! Property tests of the write-back engine against a reference model.
//!
//! Each case runs a random sequence of changes (byte writes, whole-block writes, bit
//! flips, empty patches, added dependencies) interleaved with random write-back
//! (single epochs, `flush_until`, full syncs, evictions forced by a tiny cache), under a
//! random choice of the two optimizations. The model knows nothing about the engine's
//! patches: it keeps the list of changes the test asked for and their explicit befores.
//!
//! Every change writes a token unique to it (byte changes) or sets a bit no other change
//! touches (bit changes), so the set of changes visible in any block image can be read
//! back from the image. The checks:
//!
//! * at every block write reaching the device: the image equals the model's changes of
//!   that block that it shows, applied in order from zero (rollback restores bytes
//!   exactly), and every explicit before of a visible change is visible in the same image
//!   (same block) or in the device's state as of its last flush (other blocks);
//! * after `flush_until(c)`, `c` and its befores are durable;
//! * the cache always reads as the model's newest contents;
//! * after a full sync, the device equals the model;
//! * crash states cut from the recorded log (prefixes at flushes and marks, plus random
//!   subsets of the writes after the last flush) never show a change without its befores;
//! * the engine's own graph invariants (acyclic after every merge, counts) hold after
//!   every step.
//!
//! Case count: 10,000 by default (plus a tenth as many long histories), 2,000 under `CI=true`, or `QUILT_PROPTEST_CASES`.

use proptest::prelude::*;
use quilt_block::{BlockDevice, BlockDeviceExt, BlockNo, IoStats, MemDevice, RecordingDevice};
use quilt_patch::{ChangeOpts, Durability, Engine, EngineOptions, PatchError, PatchId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

const BS: usize = 512;
const BLOCKS: u64 = 6;
/// Bytes [0, 256) hold 64 token slots; bytes [256, 512) hold 2048 bits.
const SLOTS: usize = 64;
const BIT_BASE: usize = 256;

#[derive(Debug, Clone)]
enum Op {
    Write {
        block: u64,
        slot: usize,
        nslots: usize,
        befores: Vec<usize>,
    },
    WholeBlock {
        block: u64,
        befores: Vec<usize>,
    },
    /// Whole blocks `block..block + n` in one `write_run`.
    Run {
        block: u64,
        n: u64,
        befores: Vec<usize>,
    },
    Bit {
        block: u64,
        befores: Vec<usize>,
    },
    Empty {
        befores: Vec<usize>,
    },
    AddDepend {
        empty: usize,
        before: usize,
    },
    Epoch,
    FlushUntil(usize),
    Sync,
    Read(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let befores = prop::collection::vec(any::<usize>(), 0..3);
    prop_oneof![
        6 => (0..BLOCKS, 0..SLOTS, 1..6usize, befores.clone()).prop_map(|(block, slot, nslots, befores)| Op::Write { block, slot, nslots, befores }),
        1 => (0..BLOCKS, befores.clone()).prop_map(|(block, befores)| Op::WholeBlock { block, befores }),
        2 => (0..BLOCKS, 1..4u64, befores.clone()).prop_map(|(block, n, befores)| Op::Run { block, n: n.min(BLOCKS - block), befores }),
        3 => (0..BLOCKS, befores.clone()).prop_map(|(block, befores)| Op::Bit { block, befores }),
        1 => befores.prop_map(|befores| Op::Empty { befores }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(empty, before)| Op::AddDepend { empty, before }),
        2 => Just(Op::Epoch),
        1 => any::<usize>().prop_map(Op::FlushUntil),
        1 => Just(Op::Sync),
        1 => (0..BLOCKS).prop_map(Op::Read),
    ]
}

#[derive(Debug, Clone)]
enum What {
    /// Bytes at an offset; `token` marks the 4-byte slots it owns in [0, 256).
    Bytes {
        offset: usize,
        bytes: Vec<u8>,
        token: u32,
    },
    /// Sets bit `bit` of the bit region.
    Bit {
        bit: usize,
    },
    Empty,
}

#[derive(Debug, Clone)]
struct Change {
    block: Option<BlockNo>,
    what: What,
    befores: Vec<usize>,
}

impl Change {
    fn range(&self) -> (usize, usize) {
        match &self.what {
            What::Bytes { offset, bytes, .. } => (*offset, offset + bytes.len()),
            What::Bit { bit } => {
                let w = BIT_BASE + bit / 32 * 4;
                (w, w + 4)
            }
            What::Empty => (0, 0),
        }
    }
    /// Does this change need to be ordered after `earlier` on the same block? Bits that
    /// differ commute; everything else that shares a byte does not.
    fn overlaps(&self, earlier: &Change) -> bool {
        if let (What::Bit { bit: a }, What::Bit { bit: b }) = (&self.what, &earlier.what) {
            return a == b;
        }
        let (a0, a1) = self.range();
        let (b0, b1) = earlier.range();
        a0 < b1 && b0 < a1
    }
    fn apply(&self, img: &mut [u8]) {
        match &self.what {
            What::Bytes { offset, bytes, .. } => {
                img[*offset..offset + bytes.len()].copy_from_slice(bytes)
            }
            What::Bit { bit } => img[BIT_BASE + bit / 8] |= 1 << (bit % 8),
            What::Empty => {}
        }
    }
}

#[derive(Default)]
struct Model {
    changes: Vec<Change>,
    by_block: HashMap<BlockNo, Vec<usize>>,
    next_bit: HashMap<BlockNo, usize>,
}

impl Model {
    /// The changes of `block` visible in `img`, oldest first: those whose token or bit
    /// shows, plus those overwritten by a later visible change that overlaps them.
    fn visible(&self, block: BlockNo, img: &[u8]) -> Vec<usize> {
        let ids = self.by_block.get(&block).cloned().unwrap_or_default();
        let mut vis: Vec<usize> = Vec::new();
        for &i in ids.iter().rev() {
            let c = &self.changes[i];
            let shows = match &c.what {
                What::Bytes {
                    offset,
                    bytes,
                    token,
                } => {
                    let first = offset / 4;
                    let last = ((offset + bytes.len()) / 4).min(SLOTS);
                    (first..last).any(|s| {
                        u32::from_le_bytes(img[s * 4..s * 4 + 4].try_into().unwrap()) == *token
                    })
                }
                What::Bit { bit } => img[BIT_BASE + bit / 8] & (1 << (bit % 8)) != 0,
                What::Empty => false,
            };
            let superseded = vis.iter().any(|&j| self.changes[j].overlaps(c));
            if shows || superseded {
                vis.push(i);
            }
        }
        vis.reverse();
        vis
    }

    fn apply_all(&self, ids: &[usize]) -> Vec<u8> {
        let mut img = vec![0u8; BS];
        for &i in ids {
            self.changes[i].apply(&mut img);
        }
        img
    }

    /// Is change `i` present according to `visible_on` (a per-block visible set)? Empty
    /// changes are present when all their befores are.
    fn present(&self, i: usize, visible_on: &dyn Fn(BlockNo) -> HashSet<usize>) -> bool {
        match self.changes[i].block {
            Some(b) => visible_on(b).contains(&i),
            None => self.changes[i]
                .befores
                .iter()
                .all(|&r| self.present(r, visible_on)),
        }
    }
}

/// Device wrapper that checks every write against the model at the moment it happens.
struct OracleDevice {
    inner: MemDevice,
    model: Arc<Mutex<Model>>,
    /// Device contents as of the last flush.
    durable: Mutex<Vec<Vec<u8>>>,
    failures: Mutex<Vec<String>>,
}

impl OracleDevice {
    fn block_of(&self, b: BlockNo) -> Vec<u8> {
        let mut buf = vec![0; BS];
        self.inner.read(b, &mut buf).unwrap();
        buf
    }
    fn fail(&self, msg: String) {
        self.failures.lock().unwrap().push(msg);
    }
}

impl BlockDevice for OracleDevice {
    fn block_size(&self) -> usize {
        BS
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.inner.read(block, buf)
    }
    fn write(
        &self,
        block: BlockNo,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        {
            let m = self.model.lock().unwrap();
            let vis = m.visible(block, buf);
            let expect = m.apply_all(&vis);
            if expect != buf {
                self.fail(format!("block {block}: written image is not its visible changes {vis:?} applied in order (bad rollback)"));
            }
            let durable = self.durable.lock().unwrap();
            let vis_set: HashSet<usize> = vis.iter().copied().collect();
            let visible_on = |b: BlockNo| -> HashSet<usize> {
                if b == block {
                    vis_set.clone()
                } else {
                    m.visible(b, &durable[b as usize]).into_iter().collect()
                }
            };
            for &i in &vis {
                for &r in &m.changes[i].befores {
                    if !m.present(r, &visible_on) {
                        self.fail(format!("block {block} written carrying change {i} before its before {r} is durable"));
                    }
                }
            }
        }
        self.inner.write(block, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        let snapshot: Vec<Vec<u8>> = (0..BLOCKS).map(|b| self.block_of(b)).collect();
        *self.durable.lock().unwrap() = snapshot;
        self.inner.flush()
    }
    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        quilt_block::read_each(self, first, buf)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        quilt_block::write_each(self, first, buf, class)
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        quilt_block::Capabilities {
            ..Default::default()
        }
    }
}

/// Index of the next model change (one per entry of `ids`).
fn n_before_run(ids: &[PatchId]) -> usize {
    ids.len()
}

fn pick(sel: usize, n: usize) -> Option<usize> {
    (n > 0).then(|| sel % n)
}

fn run_case(ops: &[Op], hard: bool, merge: bool, cache_blocks: usize) -> Result<(), TestCaseError> {
    let model = Arc::new(Mutex::new(Model::default()));
    let oracle = Arc::new(OracleDevice {
        inner: MemDevice::new(BS, BLOCKS).unwrap(),
        model: model.clone(),
        durable: Mutex::new(vec![vec![0; BS]; BLOCKS as usize]),
        failures: Mutex::new(Vec::new()),
    });
    let rec = Arc::new(RecordingDevice::new(oracle.clone(), 64 << 20));
    let engine = Engine::new(
        rec.clone(),
        EngineOptions {
            hard_patches: hard,
            overlap_merge: merge,
            durability: Durability::Safe,
            cache_bytes_max: cache_blocks * BS,
            flush_interval_ms: None,
            // Small, so that throttled write-back inside changes is exercised too.
            patches_live_max: 48,
        },
    );
    let mut ids: Vec<PatchId> = Vec::new();
    let opts = ChangeOpts::default();

    for (step, op) in ops.iter().enumerate() {
        let n = ids.len();
        let befores_of = |sel: &Vec<usize>| -> Vec<usize> {
            let mut v: Vec<usize> = sel.iter().filter_map(|&s| pick(s, n)).collect();
            v.sort();
            v.dedup();
            v
        };
        match op {
            Op::Write { block, befores, .. } | Op::WholeBlock { block, befores } => {
                let token = n as u32 + 1;
                let (offset, bytes) = match op {
                    Op::Write { slot, nslots, .. } => {
                        let nslots = (*nslots).min(SLOTS - slot);
                        let bytes: Vec<u8> =
                            (0..nslots).flat_map(|_| token.to_le_bytes()).collect();
                        (slot * 4, bytes)
                    }
                    _ => {
                        // Tokens everywhere, bits as they are now (so no bit is lost).
                        let mut bytes = engine.read(*block).unwrap();
                        for s in 0..SLOTS {
                            bytes[s * 4..s * 4 + 4].copy_from_slice(&token.to_le_bytes());
                        }
                        (0, bytes)
                    }
                };
                let bf = befores_of(befores);
                {
                    let mut m = model.lock().unwrap();
                    m.changes.push(Change {
                        block: Some(*block),
                        what: What::Bytes {
                            offset,
                            bytes: bytes.clone(),
                            token,
                        },
                        befores: bf.clone(),
                    });
                    m.by_block.entry(*block).or_default().push(n);
                }
                let bids: Vec<PatchId> = bf.iter().map(|&i| ids[i]).collect();
                ids.push(engine.write(*block, offset, &bytes, &bids, opts).unwrap());
            }
            Op::Run { block, n, befores } => {
                // One model change per block (each with its own token), one engine call.
                let bf = befores_of(befores);
                let mut data = Vec::new();
                {
                    let mut m = model.lock().unwrap();
                    for (i, b) in (*block..block + n).enumerate() {
                        let token = (n_before_run(&ids) + i) as u32 + 1;
                        // Tokens everywhere, bits as they are now (so no bit is lost).
                        let mut bytes = engine.read(b).unwrap();
                        for s in 0..SLOTS {
                            bytes[s * 4..s * 4 + 4].copy_from_slice(&token.to_le_bytes());
                        }
                        data.extend_from_slice(&bytes);
                        m.changes.push(Change {
                            block: Some(b),
                            what: What::Bytes {
                                offset: 0,
                                bytes,
                                token,
                            },
                            befores: bf.clone(),
                        });
                        m.by_block
                            .entry(b)
                            .or_default()
                            .push(n_before_run(&ids) + i);
                    }
                }
                let bids: Vec<PatchId> = bf.iter().map(|&i| ids[i]).collect();
                let heads = engine.write_run(*block, &data, &bids, opts).unwrap();
                assert_eq!(heads.len() as u64, *n);
                ids.extend(heads);
            }
            Op::Bit { block, befores } => {
                let bf = befores_of(befores);
                let bit = {
                    let mut m = model.lock().unwrap();
                    let bit = *m.next_bit.entry(*block).or_default();
                    m.next_bit.insert(*block, bit + 1);
                    m.changes.push(Change {
                        block: Some(*block),
                        what: What::Bit { bit },
                        befores: bf.clone(),
                    });
                    m.by_block.entry(*block).or_default().push(n);
                    bit
                };
                let bids: Vec<PatchId> = bf.iter().map(|&i| ids[i]).collect();
                let word = BIT_BASE + bit / 32 * 4;
                ids.push(
                    engine
                        .xor_bits(*block, word, 1 << (bit % 32), &bids, opts)
                        .unwrap(),
                );
            }
            Op::Empty { befores } => {
                let bf = befores_of(befores);
                model.lock().unwrap().changes.push(Change {
                    block: None,
                    what: What::Empty,
                    befores: bf.clone(),
                });
                let bids: Vec<PatchId> = bf.iter().map(|&i| ids[i]).collect();
                ids.push(engine.empty(&bids));
            }
            Op::AddDepend { empty, before } => {
                let empties: Vec<usize> = {
                    let m = model.lock().unwrap();
                    (0..n).filter(|&i| m.changes[i].block.is_none()).collect()
                };
                let (Some(e), Some(b)) = (pick(*empty, empties.len()), pick(*before, n)) else {
                    continue;
                };
                let e = empties[e];
                let model_cycle = {
                    let m = model.lock().unwrap();
                    // Does change b (transitively, through explicit befores and same-block
                    // overlaps) wait for e?
                    let mut stack = vec![b];
                    let mut seen = HashSet::new();
                    let mut found = false;
                    while let Some(x) = stack.pop() {
                        if x == e {
                            found = true;
                            break;
                        }
                        if !seen.insert(x) {
                            continue;
                        }
                        stack.extend(m.changes[x].befores.iter().copied());
                        if let Some(blk) = m.changes[x].block {
                            for &y in &m.by_block[&blk] {
                                if y < x && m.changes[x].overlaps(&m.changes[y]) {
                                    stack.push(y);
                                }
                            }
                        }
                    }
                    found
                };
                match engine.add_depend(ids[e], ids[b]) {
                    Ok(()) => {
                        prop_assert!(
                            !model_cycle,
                            "step {step}: engine accepted a dependency that closes a cycle"
                        );
                        model.lock().unwrap().changes[e].befores.push(b);
                    }
                    Err(PatchError::Cycle) => {}
                    // The empty patch may already be durable: then it can take no befores.
                    Err(PatchError::NotPending) => prop_assert!(engine.is_durable(ids[e])),
                    Err(other) => return Err(TestCaseError::fail(format!("step {step}: {other}"))),
                }
            }
            Op::Epoch => {
                engine.epoch().unwrap();
            }
            Op::FlushUntil(sel) => {
                let Some(i) = pick(*sel, n) else { continue };
                engine.flush_until(ids[i]).unwrap();
                rec.mark(&format!("flushed {i}"));
                let m = model.lock().unwrap();
                let durable = oracle.durable.lock().unwrap();
                let visible_on = |b: BlockNo| -> HashSet<usize> {
                    m.visible(b, &durable[b as usize]).into_iter().collect()
                };
                prop_assert!(
                    m.present(i, &visible_on),
                    "step {step}: change {i} not durable after flush_until"
                );
            }
            Op::Sync => engine.sync().unwrap(),
            Op::Read(block) => {
                let got = engine.read(*block).unwrap();
                let m = model.lock().unwrap();
                let all = m.by_block.get(block).cloned().unwrap_or_default();
                prop_assert_eq!(
                    got,
                    m.apply_all(&all),
                    "step {}: cache differs from the model on block {}",
                    step,
                    block
                );
            }
        }
        if let Err(e) = engine.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
        }
        let failures = oracle.failures.lock().unwrap();
        prop_assert!(failures.is_empty(), "step {step} ({op:?}): {failures:?}");
    }

    // A full flush leaves the device equal to the cache and to the model.
    engine.sync().unwrap();
    {
        let failures = oracle.failures.lock().unwrap();
        prop_assert!(failures.is_empty(), "final sync: {failures:?}");
    }
    {
        let m = model.lock().unwrap();
        for b in 0..BLOCKS {
            let all = m.by_block.get(&b).cloned().unwrap_or_default();
            let dev = oracle.block_of(b);
            prop_assert_eq!(
                &dev,
                &m.apply_all(&all),
                "block {} differs from the model after sync",
                b
            );
            prop_assert_eq!(
                &dev,
                &engine.read(b).unwrap(),
                "block {} differs from the cache after sync",
                b
            );
        }
        prop_assert_eq!(engine.stats().patches_live, 0);
        prop_assert_eq!(engine.stats().undo_bytes_now, 0);
    }

    // Crash states from the recorded log.
    let log = rec.log();
    let m = model.lock().unwrap();
    let mut states = 0;
    for (k, &len) in log.crash_points().iter().enumerate() {
        let in_flight = log.in_flight(len);
        // The prefix itself, everything in flight dropped, and a few subsets.
        let masks: Vec<u64> = [u64::MAX, 0]
            .into_iter()
            .chain((0..3).map(|j| (k as u64 * 7919 + j * 104729) ^ 0x5555_aaaa_3333_cccc))
            .collect();
        for mask in masks {
            let img = MemDevice::new(BS, BLOCKS).unwrap();
            log.replay_subset(len, &img, |i| {
                let pos = in_flight.iter().position(|&x| x == i).unwrap_or(0);
                mask >> (pos % 64) & 1 == 1
            })
            .unwrap();
            let vis: Vec<HashSet<usize>> = (0..BLOCKS)
                .map(|b| {
                    let mut buf = vec![0; BS];
                    img.read(b, &mut buf).unwrap();
                    m.visible(b, &buf).into_iter().collect()
                })
                .collect();
            let visible_on = |b: BlockNo| vis[b as usize].clone();
            for b in 0..BLOCKS {
                for &i in &vis[b as usize] {
                    for &r in &m.changes[i].befores {
                        prop_assert!(m.present(r, &visible_on), "crash state at {len} (mask {mask:#x}) shows change {i} without its before {r}");
                    }
                }
            }
            states += 1;
        }
    }
    prop_assert!(states > 0);
    Ok(())
}

fn cases() -> u32 {
    if let Ok(n) = std::env::var("QUILT_PROPTEST_CASES") {
        return n.parse().expect("QUILT_PROPTEST_CASES must be a number");
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        2_000
    } else {
        10_000
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn write_back_respects_dependencies_under_every_optimization(
        ops in prop::collection::vec(op(), 1..60),
        hard in any::<bool>(),
        merge in any::<bool>(),
        cache_blocks in 2usize..10,
    ) {
        run_case(&ops, hard, merge, cache_blocks)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: (cases() / 10).max(10), max_shrink_iters: 2000, ..ProptestConfig::default() })]

    /// Longer histories: many patches per block, deep chains, repeated merges.
    #[test]
    fn long_histories_respect_dependencies(
        ops in prop::collection::vec(op(), 100..400),
        hard in any::<bool>(),
        merge in any::<bool>(),
        cache_blocks in 2usize..10,
    ) {
        run_case(&ops, hard, merge, cache_blocks)?;
    }
}
