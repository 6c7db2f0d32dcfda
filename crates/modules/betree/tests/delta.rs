//! Deltas (`node::Delta`): a flush into a node (leaf or internal) whose delta has room
//! is written as a delta over the node's unchanged extent. Checked against a `BTreeMap` through
//! checkpoints and reopenings (a reopened tree reads deltas from disk, for point
//! queries, scans in both directions and further flushes), and a damaged delta is a
//! typed error.

use quilt_betree::{Batch, Op, Options, Tree};
use quilt_block::{BlockDevice, MemDevice, WriteClass};
use std::collections::BTreeMap;
use std::sync::Arc;

const BS: usize = 512;

/// Tiny nodes, with a fanout that makes flushes into leaves small enough for deltas.
fn opts() -> Options {
    let mut o = Options::tiny();
    o.fanout = 8;
    o
}

fn key(i: u64) -> Vec<u8> {
    format!("k{:06}", i.wrapping_mul(2_654_435_761) % 5000).into_bytes()
}

fn contents(t: &Tree) -> BTreeMap<Vec<u8>, Vec<u8>> {
    t.range(b"", None).map(|e| e.unwrap()).collect()
}

/// A tree on a fresh device holding keys `key(0..n)`, and the model of it.
fn filled(n: u64) -> (Arc<MemDevice>, Tree, BTreeMap<Vec<u8>, Vec<u8>>) {
    let dev = Arc::new(MemDevice::new(BS, 16384).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..n {
        let (k, v) = (key(i), format!("v{i}").into_bytes());
        model.insert(k.clone(), v.clone());
        t.put(&k, &v).unwrap();
    }
    (dev, t, model)
}

/// Everything the model holds, by point query, and both scan directions.
fn agrees(t: &Tree, model: &BTreeMap<Vec<u8>, Vec<u8>>) {
    assert_eq!(&contents(t), model, "forward scan");
    let back: Vec<(Vec<u8>, Vec<u8>)> = t.range_rev(b"", None).map(|e| e.unwrap()).collect();
    let want: Vec<(Vec<u8>, Vec<u8>)> = model
        .iter()
        .rev()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(back, want, "backward scan");
    for i in (0..5000).step_by(7) {
        let k = format!("k{i:06}").into_bytes();
        assert_eq!(t.get(&k).unwrap(), model.get(&k).cloned(), "get {i}");
    }
    t.check().expect("the tree is sound");
}

/// Puts, deletes and range deletes (upserts never go into deltas), with checkpoints
/// and reopenings; returns the delta counters summed over every opening.
fn run(opts: &Options, rounds: u64) -> (u64, u64) {
    let dev = Arc::new(MemDevice::new(BS, 16384).unwrap());
    let mut t = Tree::create(dev.clone(), opts.clone()).unwrap();
    let mut model = BTreeMap::new();
    let (mut flushes, mut applies) = (0, 0);
    for round in 0..rounds {
        let mut ops = Vec::new();
        for j in 0..40u64 {
            let i = round * 40 + j;
            let k = key(i);
            if i % 11 == 0 {
                model.remove(&k);
                ops.push(Op::Delete { key: k });
            } else {
                let v = format!("v{i}-{}", "x".repeat((i % 50) as usize)).into_bytes();
                model.insert(k.clone(), v.clone());
                ops.push(Op::Put { key: k, value: v });
            }
        }
        if round % 17 == 5 {
            let (a, b) = (
                format!("k{:06}", round * 13 % 5000),
                format!("k{:06}", round * 13 % 5000 + 40),
            );
            model.retain(|k, _| !(k.as_slice() >= a.as_bytes() && k.as_slice() < b.as_bytes()));
            ops.push(Op::DeleteRange {
                start: a.into_bytes(),
                end: b.into_bytes(),
            });
        }
        t.write(Batch { ops }).unwrap();
        if round % 10 == 9 {
            t.checkpoint().unwrap();
        }
        if round % 40 == 39 {
            agrees(&t, &model);
            let s = t.stats();
            flushes += s.delta_flushes;
            applies += s.delta_applies;
            t.sync().unwrap();
            drop(t);
            t = Tree::open(dev.clone(), opts.clone()).unwrap();
            // Cold: every leaf and delta is read from disk again.
            agrees(&t, &model);
        }
    }
    agrees(&t, &model);
    let s = t.stats();
    (flushes + s.delta_flushes, applies + s.delta_applies)
}

#[test]
fn deltas_hold_flushes_and_recover_with_the_leaves() {
    let (flushes, applies) = run(&opts(), 400);
    // The workload must exercise what it checks: flushes into deltas, and deltas
    // applied when they outgrow their room.
    assert!(flushes > 100, "only {flushes} flushes went into deltas");
    assert!(applies > 10, "only {applies} deltas were applied");
}

#[test]
fn without_deltas_every_flush_rewrites_its_leaf() {
    let mut o = opts();
    o.delta_bytes = 0;
    let (flushes, applies) = run(&o, 120);
    assert_eq!((flushes, applies), (0, 0));
}

/// The blocks that start a delta ("QBND"), and the height of each one's node (in the
/// node prefix at byte 16).
fn delta_blocks(dev: &MemDevice) -> Vec<(u64, u16)> {
    (0..dev.block_count())
        .filter_map(|b| {
            let mut x = vec![0u8; BS];
            (dev.read(b, &mut x).is_ok() && x.starts_with(b"QBND"))
                .then(|| (b, u16::from_le_bytes([x[16], x[17]])))
        })
        .collect()
}

#[test]
fn a_damaged_delta_is_a_typed_error() {
    let (dev, t, model) = filled(4000);
    t.checkpoint().unwrap();
    drop(t);
    let image = dev.to_vec();
    let found = delta_blocks(&dev);
    assert!(
        found.iter().any(|&(_, h)| h == 0),
        "the image holds no leaf delta"
    );
    assert!(
        found.iter().any(|&(_, h)| h > 0),
        "the image holds no internal delta"
    );
    let mut errors = 0;
    // One byte flipped in each place of a few delta leaves: the head's section, and
    // the block after it (the delta's messages, or the rest of the section).
    // A few of each kind.
    let leaves = found.iter().filter(|d| d.1 == 0).take(4);
    let internal = found.iter().filter(|d| d.1 > 0).take(4);
    for &(b, _) in leaves.chain(internal) {
        for (block, at) in [(b, 40usize), (b + 1, 10)] {
            let d = Arc::new(MemDevice::from_bytes(BS, &image).unwrap());
            let mut x = vec![0u8; BS];
            d.read(block, &mut x).unwrap();
            x[at] ^= 0x5a;
            d.write(block, &x, WriteClass::Metadata).unwrap();
            let t = match Tree::open(d, opts()) {
                Ok(t) => t,
                Err(e) => {
                    assert!(e.is_damage(), "open: {e:?}");
                    errors += 1;
                    continue;
                }
            };
            // Every read either answers as the model does or fails with a typed error.
            for (k, v) in &model {
                match t.get(k) {
                    Ok(got) => {
                        assert_eq!(got.as_ref(), Some(v), "a damaged delta gave a wrong value")
                    }
                    Err(e) if e.is_damage() => errors += 1,
                    Err(e) => panic!("untyped error {e:?}"),
                }
            }
            for e in t.range(b"", None) {
                if let Err(e) = e {
                    assert!(e.is_damage(), "scan: {e:?}");
                    break;
                }
            }
        }
    }
    // (A block found may hold a delta no checkpoint references any more; not all.)
    assert!(errors > 0, "no damage was noticed");
}

/// A shared node (a range clone shares subtrees) is copied before it changes; the copy
/// is a new node, and must be written whole, not as a delta over the original's extent.
#[test]
fn a_copy_of_a_shared_node_is_written_whole() {
    let dev = Arc::new(MemDevice::new(BS, 16384).unwrap());
    let mut t = Tree::create(dev.clone(), opts()).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..1500u64 {
        let k = format!("a/{:05}", i * 7919 % 1500).into_bytes();
        let v = format!("v{i}").into_bytes();
        model.insert(k.clone(), v.clone());
        t.put(&k, &v).unwrap();
    }
    // Written whole: every cached node now has a base.
    t.checkpoint().unwrap();
    let mut b = Batch::new();
    b.clone_prefix(b"a/", b"b/");
    t.write(b).unwrap();
    for (k, v) in model.clone() {
        model.insert([b"b/", &k[2..]].concat(), v);
    }
    // Changes on both sides reach the shared nodes and copy them.
    let mut copies = 0;
    for round in 0..6u64 {
        for i in 0..1500u64 {
            if i % 3 != round % 3 {
                continue;
            }
            let side = if (i + round) % 2 == 0 { "a" } else { "b" };
            let k = format!("{side}/{:05}", i * 7919 % 1500).into_bytes();
            let v = format!("r{round}-{i}").into_bytes();
            model.insert(k.clone(), v.clone());
            t.put(&k, &v).unwrap();
        }
        t.checkpoint().unwrap();
        agrees(&t, &model);
        copies += t.stats().cow_copies;
        t.sync().unwrap();
        drop(t);
        t = Tree::open(dev.clone(), opts()).unwrap();
        agrees(&t, &model);
    }
    assert!(copies > 0, "no shared node was copied");
}

/// Nodes read for queries take flushes into their deltas (so a partial node may be
/// dirty), then queries load more of them: the cache's charges must still add up
/// (`check` compares them), and the next checkpoint takes the dirty nodes.
#[test]
fn partial_nodes_with_dirty_deltas_are_charged_right() {
    let (dev, mut t, mut model) = filled(3000);
    t.sync().unwrap();
    drop(t);
    for round in 0..8u64 {
        // Cold: every node is read for queries first.
        t = Tree::open(dev.clone(), opts()).unwrap();
        for i in 0..200u64 {
            let _ = t.get(&key(i * 13 + round)).unwrap();
        }
        for i in 0..600u64 {
            let (k, v) = (key(i * 7 + round), format!("r{round}-{i}").into_bytes());
            model.insert(k.clone(), v.clone());
            t.put(&k, &v).unwrap();
            if i % 50 == 0 {
                // Scans and gets load buffers, basements and deltas of dirty nodes.
                let _ = t.range(&key(i), None).take(300).count();
                let _ = t.get(&key(i * 3)).unwrap();
            }
        }
        t.checkpoint().unwrap();
        agrees(&t, &model);
        t.sync().unwrap();
        drop(t);
    }
}
