//! The crash explorer for the Bε-tree (`quiltfs crashtest --fs betree`).
//!
//! A run creates a tree with tiny nodes (so that a few hundred operations split, merge,
//! flush, checkpoint and wrap the log ring) on a memory device, then records a seeded
//! history of puts, deletes, upserts, range deletes and atomic batches, with syncs and
//! checkpoints among them, at a recording device. A mark goes before every operation
//! (`op-K`: K operations issued before it) and after every sync (`synced-K`: the first K
//! are durable). Crash states are cut as for the file system (`states`). Each state is
//! opened (recovery must succeed, and the tree must pass its own invariant check) and
//! its contents compared with the model: they must equal the state after the first `k`
//! operations for some `k` from the last sync's count to the operations begun.
//!
//! The control run (`lying`) marks `synced-K` without syncing: the oracle must then find
//! lost operations, which shows it can see them. The second control (`unbound`) syncs,
//! but its syncs leave the values of puts logged by reference out of the log (a record
//! naming data that nothing made durable): the oracle must find those syncs broken.

use crate::states::{self, CrashState};
use crate::workload::Rng;
use quilt_betree::reference::apply;
use quilt_betree::{truncate_arg, write_at_arg, Batch, Op, Options, TRUNCATE, WRITE_AT};
use quilt_block::{BlockDeviceExt, MemDevice, RecordingDevice, RecordingLog};
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

const BS: usize = 512;
const BLOCKS: u64 = 8192;
const OPS: usize = 240;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct KvReport {
    pub runs: usize,
    pub operations: usize,
    pub states_generated: usize,
    pub states_checked: usize,
    /// Cuts checked (a state that several cuts share is held to each one's promise).
    pub cuts_checked: usize,
    pub clean: usize,
    pub with_violations: usize,
    pub failures: Vec<KvFailure>,
    /// Deltas the recorded histories wrote, of leaves and of internal nodes (see
    /// `Shape`).
    pub leaf_deltas_written: usize,
    pub internal_deltas_written: usize,
    pub seconds: f64,
    /// Whether this was the control run (syncs claimed, not made).
    pub lying: bool,
    /// Whether this was the unbound control (syncs that leave puts by reference
    /// without their values).
    pub unbound: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct KvFailure {
    pub seed: u64,
    pub state: CrashState,
    pub problem: String,
}

fn options() -> Options {
    let mut o = Options::tiny();
    o.log_blocks = 48;
    o.cache_bytes = 48 << 10;
    o.dirty_bytes = 16 << 10;
    o
}

fn fingerprint(m: &BTreeMap<Vec<u8>, Vec<u8>>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.len().hash(&mut h);
    for (k, v) in m {
        k.hash(&mut h);
        v.hash(&mut h);
    }
    h.finish()
}

/// The history's tree: even seeds make trees of fanout 4 with every kind of operation;
/// odd seeds trees of fanout 8, more keys and larger values and no upserts, so that
/// buffers flushed into leaves fit their deltas (an upsert never goes into one) and
/// crashes among delta writes are explored.
struct Shape {
    fanout: usize,
    keys: u64,
    max_value: u64,
    no_upserts: bool,
}

fn shape(seed: u64) -> Shape {
    if seed % 2 == 0 {
        Shape {
            fanout: 4,
            keys: 160,
            max_value: 90,
            no_upserts: false,
        }
    } else {
        Shape {
            fanout: 8,
            keys: 900,
            max_value: 700,
            no_upserts: true,
        }
    }
}

fn random_op(r: &mut Rng, sh: &Shape) -> Op {
    let key = |r: &mut Rng| format!("key{:03}", r.below(sh.keys)).into_bytes();
    let pick = match r.below(22) {
        13..=17 if sh.no_upserts => 0,
        x => x,
    };
    match pick {
        0..=9 => {
            let k = key(r);
            let n = r.below(sh.max_value) as usize;
            let b = r.below(256) as u8;
            Op::Put {
                key: k,
                value: vec![b; n],
            }
        }
        10..=12 => Op::Delete { key: key(r) },
        13..=16 => {
            let k = key(r);
            let off = r.below(120);
            Op::Upsert {
                key: k,
                func: WRITE_AT,
                arg: write_at_arg(off, &r.below(u64::MAX).to_le_bytes()[..4]),
            }
        }
        17 => {
            let k = key(r);
            Op::Upsert {
                key: k,
                func: TRUNCATE,
                arg: truncate_arg(r.below(60)),
            }
        }
        18 => {
            let a = r.below(sh.keys);
            let b = (a + 1 + r.below(30)).min(sh.keys);
            Op::DeleteRange {
                start: format!("key{a:03}").into_bytes(),
                end: format!("key{b:03}").into_bytes(),
            }
        }
        19 | 20 => {
            // Ten keys (or some of them) copied under another two digits, sharing the
            // tree's nodes; whatever was there is replaced.
            let a = r.below(16);
            let b = (a + 1 + r.below(15)) % 16;
            let (start, end) = if r.below(2) == 0 {
                (Vec::new(), None)
            } else {
                let lo = r.below(9);
                (
                    format!("{lo}").into_bytes(),
                    Some(format!("{}", lo + 1 + r.below(9 - lo)).into_bytes()),
                )
            };
            Op::CloneRange {
                from: format!("key{a:02}").into_bytes(),
                to: format!("key{b:02}").into_bytes(),
                start,
                end,
            }
        }
        _ => {
            // Ten keys move under another two digits (whatever was there is replaced).
            let a = r.below(16);
            let b = (a + 1 + r.below(15)) % 16;
            Op::RenamePrefix {
                from: format!("key{a:02}").into_bytes(),
                to: format!("key{b:02}").into_bytes(),
            }
        }
    }
}

struct Recorded {
    base: Vec<u8>,
    log: RecordingLog,
    /// Fingerprint of the model after the first `k` operations, for every `k`.
    prefixes: Vec<u64>,
}

fn record(seed: u64, lying: bool, unbound: bool) -> Result<Recorded, String> {
    let s = |e: quilt_betree::Error| e.to_string();
    let mem = Arc::new(MemDevice::new(BS, BLOCKS).map_err(|e| e.to_string())?);
    // The tree starts with some contents, checkpointed, so that the history runs on a
    // tree of a few levels.
    let mut r = Rng::new(seed);
    let sh = shape(seed);
    let mut model = BTreeMap::new();
    {
        let mut o = options();
        o.fanout = sh.fanout;
        let t = quilt_stack::create_tree(mem.clone(), o).map_err(s)?;
        for i in 0..(sh.keys * 15 / 16) as u32 {
            let k = format!("key{:03}", (i * 7) % sh.keys as u32).into_bytes();
            let v = vec![i as u8; 40];
            model.insert(k.clone(), v.clone());
            t.put(&k, &v).map_err(s)?;
        }
        t.close().map_err(s)?;
    }
    let base = mem.to_vec();
    let rec = Arc::new(RecordingDevice::new(mem.clone(), 1 << 30));
    let mut o = options();
    o.control_unbound_syncs = unbound;
    let t = quilt_stack::tree(rec.clone(), o).map_err(s)?;
    let mut prefixes = vec![fingerprint(&model)];
    let mut i = 0;
    while i < OPS {
        rec.mark(&format!("op-{i}"));
        let n = if r.below(8) == 0 {
            1 + r.below(6) as usize
        } else {
            1
        };
        let ops: Vec<Op> = (0..n).map(|_| random_op(&mut r, &sh)).collect();
        for o in &ops {
            apply(&mut model, o);
        }
        t.write(Batch { ops }).map_err(s)?;
        i += 1;
        prefixes.push(fingerprint(&model));
        match r.below(12) {
            0..=1 => {
                if !lying {
                    t.sync().map_err(s)?;
                }
                rec.mark(&format!("synced-{i}"));
            }
            2 if !lying => t.checkpoint().map_err(s)?,
            _ => {}
        }
    }
    drop(t); // a crash: nothing more is written
    Ok(Recorded {
        base,
        log: rec.take_log(),
        prefixes,
    })
}

/// `(synced, begun)` at a cut: operations durable by a sync mark before it, and operations
/// begun before it.
fn bounds(log: &RecordingLog, len: usize) -> (usize, usize) {
    let mut synced = 0;
    let mut begun = 0;
    for e in &log.entries[..len] {
        if let quilt_block::LogEntry::Mark(m) = e {
            if let Some(k) = m.strip_prefix("synced-") {
                synced = synced.max(k.parse().unwrap_or(0));
            } else if let Some(k) = m.strip_prefix("op-") {
                begun = begun.max(k.parse::<usize>().unwrap_or(0) + 1);
            }
        }
    }
    (synced, begun)
}

fn check(rec: &Recorded, state: &CrashState) -> Result<(), String> {
    let dev = Arc::new(MemDevice::from_bytes(BS, &rec.base).map_err(|e| e.to_string())?);
    rec.log
        .replay_subset(state.len, dev.as_ref(), |i| state.keeps(i))
        .map_err(|e| e.to_string())?;
    let t = quilt_stack::tree(dev, options()).map_err(|e| format!("recovery failed: {e}"))?;
    t.check()
        .map_err(|e| format!("recovered tree is damaged: {e}"))?;
    let mut got = BTreeMap::new();
    for e in t.range(b"", None) {
        let (k, v) = e.map_err(|e| format!("scan after recovery failed: {e}"))?;
        got.insert(k, v);
    }
    let fp = fingerprint(&got);
    let matches: Vec<usize> = (0..rec.prefixes.len())
        .filter(|&k| rec.prefixes[k] == fp)
        .collect();
    for len in std::iter::once(state.len).chain(state.also.iter().copied()) {
        let (synced, begun) = bounds(&rec.log, len);
        if !matches.iter().any(|&k| k >= synced && k <= begun) {
            return Err(format!(
                "cut at {len}: recovered {} keys, which is the state after operations {:?}; \
                 it must be the state after k operations for some k in {synced}..={begun}",
                got.len(),
                matches
            ));
        }
    }
    Ok(())
}

/// Explores crash states of seeded histories until `states` are checked.
pub fn run(
    states_wanted: usize,
    seed: u64,
    lying: bool,
    unbound: bool,
    mut progress: impl FnMut(usize, usize),
) -> Result<KvReport, String> {
    let t0 = std::time::Instant::now();
    let mut report = KvReport {
        lying,
        unbound,
        ..Default::default()
    };
    let mut rng = Rng::new(seed ^ 0x6b76);
    let mut run_seed = seed;
    while report.states_checked < states_wanted {
        let rec = record(run_seed, lying, unbound)?;
        report.runs += 1;
        for e in &rec.log.entries {
            if let quilt_block::LogEntry::Write { data, .. } = e {
                // A node's prefix: magic, version, kind, id, then its height at 16.
                if data.starts_with(b"QBND") && data.len() >= 18 {
                    if data[16..18] == [0, 0] {
                        report.leaf_deltas_written += 1;
                    } else {
                        report.internal_deltas_written += 1;
                    }
                }
            }
        }
        report.operations += OPS;
        let all = states::generate(&rec.log, &mut rng);
        report.states_generated += all.len();
        let left = states_wanted - report.states_checked;
        // At most a third of the budget per run, so that several histories are seen.
        let budget = left.min((states_wanted / 3).max(50));
        for state in states::sample(all, budget, &mut rng) {
            report.states_checked += 1;
            report.cuts_checked += 1 + state.also.len();
            match check(&rec, &state) {
                Ok(()) => report.clean += 1,
                Err(problem) => {
                    report.with_violations += 1;
                    if report.failures.len() < 50 {
                        report.failures.push(KvFailure {
                            seed: run_seed,
                            state,
                            problem,
                        });
                    }
                }
            }
            if report.states_checked % 64 == 0 {
                progress(report.states_checked, states_wanted);
            }
        }
        run_seed = run_seed.wrapping_add(1);
    }
    progress(report.states_checked, states_wanted);
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

impl KvReport {
    pub fn text(&self) -> String {
        let mut s = format!(
            "betree crash exploration{}: {} runs of {} operations (deltas written: {} of leaves, \
             {} of internal nodes), \
             {} states generated, {} checked ({} cuts), {} clean, {} with violations, {:.1} s\n",
            if self.lying {
                " (control: syncs claimed, not made)"
            } else if self.unbound {
                " (control: syncs leave puts by reference without their values)"
            } else {
                ""
            },
            self.runs,
            OPS,
            self.leaf_deltas_written,
            self.internal_deltas_written,
            self.states_generated,
            self.states_checked,
            self.cuts_checked,
            self.clean,
            self.with_violations,
            self.seconds
        );
        for f in self.failures.iter().take(5) {
            s += &format!("  seed {} cut {}: {}\n", f.seed, f.state.len, f.problem);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_crash_state_recovers_to_a_synced_prefix() {
        let r = super::run(150, 1, false, false, |_, _| {}).unwrap();
        eprintln!("{}", r.text());
        assert_eq!(r.with_violations, 0, "{}", r.text());
        assert!(r.states_checked >= 150 && r.clean == r.states_checked);
    }

    #[test]
    fn the_oracle_sees_lost_operations() {
        let r = super::run(150, 1, true, false, |_, _| {}).unwrap();
        assert!(
            r.with_violations > 0,
            "claimed syncs that never happened went unnoticed: {}",
            r.text()
        );
    }

    /// Syncs that leave the values of puts by reference out of the log lose synced
    /// batches, and the oracle sees it.
    #[test]
    fn the_oracle_sees_unbound_puts_by_reference() {
        let r = super::run(300, 1, false, true, |_, _| {}).unwrap();
        assert!(
            r.with_violations > 0,
            "syncs that left values unlogged went unnoticed: {}",
            r.text()
        );
    }
}
