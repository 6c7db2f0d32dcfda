//! Model-based property test: random histories of every operation (puts, deletes, both
//! built-in upserts, range deletes, point queries, scans in both directions, atomic
//! batches, syncs, checkpoints, reopen after sync, reopen after a crash, keys-only scans)
//! run against the tree with tiny nodes (many splits, merges and flushes) and against a `BTreeMap`.
//!
//! Case count: 10,000 by default, 1,000 under `CI=true`, or `QUILT_PROPTEST_CASES`.

use proptest::prelude::*;
use quilt_betree::reference::apply;
use quilt_betree::{
    truncate_arg, write_at_arg, Batch, Op as TOp, Options, Tree, TRUNCATE, WRITE_AT,
};
use quilt_block::MemDevice;
use std::collections::BTreeMap;
use std::sync::Arc;

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

#[derive(Debug, Clone)]
enum Step {
    Write(Vec<TOp>),
    Get(Vec<u8>),
    Scan {
        lo: Vec<u8>,
        hi: Option<Vec<u8>>,
        forward: bool,
        take: usize,
    },
    Sync,
    Checkpoint,
    /// Every message pushed to the leaves, then a checkpoint.
    Compact,
    /// Sync, drop, open: everything must be there.
    Reopen,
    /// Drop without sync, open: a state between the last sync and now.
    Crash,
}

fn key(i: u16) -> Vec<u8> {
    format!("k{:03}", i % 400).into_bytes()
}

fn op() -> impl Strategy<Value = TOp> {
    prop_oneof![
        6 => (0u16..400, 0usize..200, any::<u8>()).prop_map(|(k, n, b)| TOp::Put { key: key(k), value: vec![b; n] }),
        2 => (0u16..400).prop_map(|k| TOp::Delete { key: key(k) }),
        2 => (0u16..400, 0u64..300, 1usize..8, any::<u8>())
            .prop_map(|(k, off, n, b)| TOp::Upsert { key: key(k), func: WRITE_AT, arg: write_at_arg(off, &vec![b; n]) }),
        1 => (0u16..400, 0u64..150).prop_map(|(k, n)| TOp::Upsert { key: key(k), func: TRUNCATE, arg: truncate_arg(n) }),
        1 => (0u16..400, 1u16..60).prop_map(|(a, n)| TOp::DeleteRange { start: key(a), end: key(a.saturating_add(n).min(399)).into_iter().chain([0xff]).collect() }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        20 => op().prop_map(|o| Step::Write(vec![o])),
        3 => prop::collection::vec(op(), 1..12).prop_map(Step::Write),
        5 => (0u16..400).prop_map(|k| Step::Get(key(k))),
        2 => (0u16..400, prop::option::of(0u16..400), any::<bool>(), 1usize..300)
            .prop_map(|(a, b, forward, take)| Step::Scan { lo: key(a), hi: b.map(key), forward, take }),
        1 => Just(Step::Sync),
        1 => Just(Step::Checkpoint),
        1 => Just(Step::Compact),
        1 => Just(Step::Reopen),
        1 => Just(Step::Crash),
    ]
}

fn contents(t: &Tree) -> Model {
    let all: Model = t.range(b"", None).map(|r| r.unwrap()).collect();
    // A keys-only scan agrees (after a reopen it reads leaves' indexes, not basements).
    let keys: Vec<(Vec<u8>, usize)> = t.keys(b"", None).map(|r| r.unwrap()).collect();
    let lens: Vec<(Vec<u8>, usize)> = all.iter().map(|(k, v)| (k.clone(), v.len())).collect();
    assert_eq!(keys, lens, "keys-only scan");
    all
}

/// `fanout` 8 makes flushes into leaves small enough for leaf deltas.
/// `basement` 256 puts most large values in basements of their own (which keys-only
/// scans read from the leaf's index).
fn run(steps: Vec<Step>, fanout: usize, basement: usize) -> Result<(), TestCaseError> {
    let dev = Arc::new(MemDevice::new(512, 16384).unwrap());
    let mut opts = Options::tiny();
    opts.fanout = fanout;
    opts.basement_bytes = basement;
    let mut t = Tree::create(dev.clone(), opts.clone()).unwrap();
    let mut model = Model::new();
    // Model states since the last sync: a crash may leave any of them.
    let mut since_sync: Vec<Model> = vec![model.clone()];
    for s in steps {
        match s {
            Step::Write(ops) => {
                let mut b = Batch::new();
                b.ops = ops.clone();
                t.write(b).unwrap();
                for o in &ops {
                    apply(&mut model, o);
                }
                since_sync.push(model.clone());
            }
            Step::Get(k) => {
                prop_assert_eq!(t.get(&k).unwrap(), model.get(&k).cloned(), "get {:?}", k)
            }
            Step::Scan {
                lo,
                hi,
                forward,
                take,
            } => {
                let got: Vec<_> = if forward {
                    t.range(&lo, hi.as_deref())
                        .take(take)
                        .map(|r| r.unwrap())
                        .collect()
                } else {
                    t.range_rev(&lo, hi.as_deref())
                        .take(take)
                        .map(|r| r.unwrap())
                        .collect()
                };
                // The lending form returns the same entries.
                let mut it = if forward {
                    t.range(&lo, hi.as_deref())
                } else {
                    t.range_rev(&lo, hi.as_deref())
                };
                let mut lent = Vec::new();
                while lent.len() < take {
                    match it.next_entry() {
                        Some(e) => {
                            let (k, v) = e.unwrap();
                            lent.push((k.to_vec(), v.to_vec()));
                        }
                        None => break,
                    }
                }
                prop_assert_eq!(&lent, &got);
                // So does a limited iterator, which sizes its reads by the count and
                // ends by itself.
                let it = if forward {
                    t.range(&lo, hi.as_deref())
                } else {
                    t.range_rev(&lo, hi.as_deref())
                };
                let limited: Vec<_> = it.limit(take).map(|r| r.unwrap()).collect();
                prop_assert_eq!(&limited, &got);
                let want: Vec<_> = match &hi {
                    Some(h) if *h <= lo => Vec::new(),
                    Some(h) => {
                        let r = model
                            .range(lo.clone()..h.clone())
                            .map(|(k, v)| (k.clone(), v.clone()));
                        if forward {
                            r.take(take).collect()
                        } else {
                            r.rev().take(take).collect()
                        }
                    }
                    None => {
                        let r = model
                            .range(lo.clone()..)
                            .map(|(k, v)| (k.clone(), v.clone()));
                        if forward {
                            r.take(take).collect()
                        } else {
                            r.rev().take(take).collect()
                        }
                    }
                };
                // Keys-only: the same keys with their values' lengths.
                if forward {
                    let keys: Vec<_> = t
                        .keys(&lo, hi.as_deref())
                        .limit(take)
                        .map(|r| r.unwrap())
                        .collect();
                    let lens: Vec<_> = want.iter().map(|(k, v)| (k.clone(), v.len())).collect();
                    prop_assert_eq!(keys, lens);
                }
                prop_assert_eq!(got, want);
            }
            Step::Sync => {
                t.sync().unwrap();
                since_sync = vec![model.clone()];
            }
            Step::Checkpoint => t.checkpoint().unwrap(),
            Step::Compact => {
                t.compact().unwrap();
                t.check().unwrap();
                // Moving messages down changes no key's value.
                prop_assert_eq!(contents(&t), model.clone());
            }
            Step::Reopen => {
                t.sync().unwrap();
                drop(t);
                t = Tree::open(dev.clone(), opts.clone()).unwrap();
                since_sync = vec![model.clone()];
                prop_assert_eq!(contents(&t), model.clone());
            }
            Step::Crash => {
                drop(t);
                t = Tree::open(dev.clone(), opts.clone()).unwrap();
                let got = contents(&t);
                // MemDevice keeps every write it was given, so a crash here loses only
                // what the engine had not written yet: a prefix of the history.
                let Some(i) = since_sync.iter().position(|m| *m == got) else {
                    return Err(TestCaseError::fail(format!(
                        "after a crash: {} keys, not any of the {} states since the last sync",
                        got.len(),
                        since_sync.len()
                    )));
                };
                model = since_sync[i].clone();
                since_sync = vec![model.clone()];
            }
        }
    }
    t.check().unwrap();
    prop_assert_eq!(contents(&t), model.clone());
    let rev: Vec<_> = t.range_rev(b"", None).map(|r| r.unwrap()).collect();
    prop_assert_eq!(
        rev,
        model
            .iter()
            .rev()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    );
    t.sync().unwrap();
    drop(t);
    let t = Tree::open(dev, opts).unwrap();
    t.check().unwrap();
    prop_assert_eq!(contents(&t), model);
    Ok(())
}

fn cases() -> u32 {
    if let Ok(n) = std::env::var("QUILT_PROPTEST_CASES") {
        return n.parse().expect("QUILT_PROPTEST_CASES must be a number");
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        1000
    } else {
        10_000
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn tree_matches_a_btreemap(
        steps in prop::collection::vec(step(), 1..150),
        fanout in prop_oneof![Just(4usize), Just(8)],
        basement in prop_oneof![Just(1024usize), Just(256)],
    ) {
        run(steps, fanout, basement)?;
    }
}

/// Enough data for a tree several levels deep, with every operation kind mixed in.
#[test]
fn a_deep_tree_matches_the_model() {
    let dev = Arc::new(MemDevice::new(512, 65536).unwrap());
    let t = Tree::create(dev.clone(), Options::tiny()).unwrap();
    let mut model = Model::new();
    let mut rng: rand_chacha::ChaCha8Rng = rand::SeedableRng::seed_from_u64(7);
    for i in 0..20_000u64 {
        let x = rand::RngCore::next_u64(&mut rng);
        let k = format!("key{:06}", (x >> 33) % 5000).into_bytes();
        let o = match i % 10 {
            0..=5 => TOp::Put {
                key: k,
                value: vec![(i % 251) as u8; (x % 60) as usize],
            },
            6 => TOp::Delete { key: k },
            7 => TOp::Upsert {
                key: k,
                func: WRITE_AT,
                arg: write_at_arg(x % 20, b"abcd"),
            },
            8 => TOp::Upsert {
                key: k,
                func: TRUNCATE,
                arg: truncate_arg(x % 10),
            },
            _ if i % 100 == 9 => TOp::DeleteRange {
                start: k.clone(),
                end: [k, vec![b'9'; 2]].concat(),
            },
            _ => TOp::Put {
                key: k,
                value: b"v".to_vec(),
            },
        };
        apply(&mut model, &o);
        t.write(Batch { ops: vec![o] }).unwrap();
        if i % 5000 == 4999 {
            t.sync().unwrap();
        }
    }
    t.check().unwrap();
    let s = t.stats();
    assert!(
        s.height >= 2,
        "a tree of 5,000 keys in 4 KiB nodes has internal levels: {s:?}"
    );
    assert!(
        s.flushes > 0 && s.leaf_splits > 0 && s.checkpoints > 1,
        "{s:?}"
    );
    assert_eq!(contents(&t), model);
    for (k, v) in model.iter().step_by(7) {
        assert_eq!(t.get(k).unwrap().as_ref(), Some(v));
    }
    t.sync().unwrap();
    drop(t);
    let t = Tree::open(dev, Options::tiny()).unwrap();
    assert_eq!(contents(&t), model);
    // Delete most of it, key by key (messages that fill buffers and reach the leaves):
    // merges shrink the tree again. Then one range delete over what is left.
    let doomed: Vec<Vec<u8>> = model
        .keys()
        .filter(|k| k[k.len() - 1] != b'7')
        .cloned()
        .collect();
    for k in doomed {
        t.delete(&k).unwrap();
        model.remove(&k);
    }
    t.delete_range(b"key000500", b"key004900").unwrap();
    for k in model
        .range(b"key000500".to_vec()..b"key004900".to_vec())
        .map(|(k, _)| k.clone())
        .collect::<Vec<_>>()
    {
        model.remove(&k);
    }
    for i in 0..3000u32 {
        t.put(format!("z{i:05}").as_bytes(), b"x").unwrap();
        model.insert(format!("z{i:05}").into_bytes(), b"x".to_vec());
    }
    t.check().unwrap();
    assert_eq!(contents(&t), model);
    assert!(t.stats().merges > 0, "{:?}", t.stats());
}
