//! Keys-only scans (`Tree::keys`): the keys and value lengths a full scan gives, read
//! from the leaves' indexes where a basement holds one entry (a file system's data
//! blocks), with pending messages applied from their lengths; a registered upsert
//! pending above a leaf makes the scan read the values it needs, and agree still.

use quilt_betree::{write_at_arg, Batch, Options, Tree, Upserts, FIRST_USER_UPSERT, WRITE_AT};
use quilt_block::MemDevice;
use std::collections::BTreeMap;
use std::sync::Arc;

const BLOCK: usize = 4096;
/// Blocks of the "file": every third one missing.
const BLOCKS: u64 = 3000;

fn key(b: u64) -> Vec<u8> {
    let mut k = b"dfile\0".to_vec();
    k.extend_from_slice(&b.to_be_bytes());
    k
}

fn all_keys(t: &Tree) -> Vec<(Vec<u8>, usize)> {
    t.range(b"", None)
        .map(|r| r.map(|(k, v)| (k, v.len())))
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The id of a registered upsert that appends its argument, or deletes the value when
/// the argument is empty.
const APPEND: u16 = FIRST_USER_UPSERT;

fn opts() -> Options {
    let mut o = Options::default();
    let mut u = Upserts::default();
    u.register(
        APPEND,
        Arc::new(|old: Option<&[u8]>, arg: &[u8]| {
            if arg.is_empty() {
                return Ok(None);
            }
            let mut v = old.map(<[u8]>::to_vec).unwrap_or_default();
            v.extend_from_slice(arg);
            Ok(Some(v))
        }),
    )
    .unwrap();
    o.upserts = u;
    o
}

/// A tree of `BLOCKS` 4 KiB values (every third missing), compacted and reopened cold.
fn cold_data_tree() -> (Arc<MemDevice>, Tree) {
    let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    for c in (0..BLOCKS).step_by(100) {
        let mut b = Batch::new();
        for blk in (c..c + 100).filter(|b| b % 3 != 2) {
            b.put(&key(blk), &[blk as u8; BLOCK]);
        }
        t.write(b).unwrap();
    }
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev.clone(), opts()).unwrap();
    (dev, t)
}

#[test]
fn a_keys_only_scan_of_data_blocks_reads_no_basement() {
    let (_dev, t) = cold_data_tree();
    let before = t.stats().basement_reads;
    let keys: Vec<(Vec<u8>, usize)> = t.keys(b"", None).map(|r| r.unwrap()).collect();
    let after = t.stats().basement_reads;
    let want: Vec<(Vec<u8>, usize)> = (0..BLOCKS)
        .filter(|b| b % 3 != 2)
        .map(|b| (key(b), BLOCK))
        .collect();
    assert_eq!(keys, want);
    assert_eq!(after, before, "a keys-only scan read basements");
    // The full scan reads every basement, and says the same.
    assert_eq!(all_keys(&t), want);
    assert!(t.stats().basement_reads >= after + want.len() as u64);
}

#[test]
fn a_limited_keys_only_scan_starts_and_stops_where_asked() {
    let (_dev, t) = cold_data_tree();
    let got: Vec<(Vec<u8>, usize)> = t
        .keys(&key(1000), Some(&key(2000)))
        .limit(5)
        .map(|r| r.unwrap())
        .collect();
    // (1001, 1004 and 1007 are holes.)
    let want: Vec<(Vec<u8>, usize)> = [1000, 1002, 1003, 1005, 1006]
        .into_iter()
        .map(|b| (key(b), BLOCK))
        .collect();
    assert_eq!(got, want);
    // The lending form, to the range's end.
    let mut it = t.keys(&key(2990), Some(&key(2999)));
    let mut lent = Vec::new();
    while let Some(e) = it.next_key() {
        let (k, l) = e.unwrap();
        lent.push((k.to_vec(), l));
    }
    let want: Vec<_> = (2990..2999)
        .filter(|b| b % 3 != 2)
        .map(|b| (key(b), BLOCK))
        .collect();
    assert_eq!(lent, want);
}

/// Messages pending above cold leaves: puts, deletes, a range delete, both built-in
/// upserts (whose results' lengths follow from the old lengths), and the registered one
/// (whose results need the values). Every state agrees with a full scan and a model.
#[test]
fn pending_messages_and_registered_upserts_agree_with_a_full_scan() {
    let (dev, t) = cold_data_tree();
    let mut model: BTreeMap<Vec<u8>, usize> = (0..BLOCKS)
        .filter(|b| b % 3 != 2)
        .map(|b| (key(b), BLOCK))
        .collect();
    let check = |t: &Tree, model: &BTreeMap<Vec<u8>, usize>| {
        let keys: Vec<(Vec<u8>, usize)> = t.keys(b"", None).map(|r| r.unwrap()).collect();
        let want: Vec<(Vec<u8>, usize)> = model.iter().map(|(k, l)| (k.clone(), *l)).collect();
        assert_eq!(keys, want);
        assert_eq!(all_keys(t), want);
    };
    // Built-ins only.
    let mut b = Batch::new();
    b.put(&key(2), b"short");
    model.insert(key(2), 5);
    b.delete(&key(4));
    model.remove(&key(4));
    b.upsert(&key(5), WRITE_AT, &write_at_arg(5000, b"xy"));
    model.insert(key(5), 5002);
    b.upsert(&key(8), WRITE_AT, &write_at_arg(10, b"z"));
    model.insert(key(8), 11);
    b.upsert(
        &key(6),
        quilt_betree::TRUNCATE,
        &quilt_betree::truncate_arg(7),
    );
    model.insert(key(6), 7);
    b.upsert(
        &key(11),
        quilt_betree::TRUNCATE,
        &quilt_betree::truncate_arg(7),
    );
    b.delete_range(&key(100), &key(200));
    model.retain(|k, _| !(k >= &key(100) && k < &key(200)));
    t.write(b).unwrap();
    check(&t, &model);
    // The registered upsert: append, and delete (an empty argument).
    let mut b = Batch::new();
    b.upsert(&key(300), APPEND, b"abc");
    *model.get_mut(&key(300)).unwrap() += 3;
    b.upsert(&key(302), APPEND, b"new");
    model.insert(key(302), 3);
    b.upsert(&key(303), APPEND, b"");
    model.remove(&key(303));
    t.write(b).unwrap();
    check(&t, &model);
    // After a crash (replayed into the root's buffer above cold leaves) and a clean reopen.
    t.sync().unwrap();
    drop(t);
    let t = Tree::open(dev.clone(), opts()).unwrap();
    check(&t, &model);
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev, opts()).unwrap();
    check(&t, &model);
}

/// `first_absent` against the model (the first number at or after `from` not in it),
/// from every start near the holes and at the ends.
fn check_absent(t: &Tree, model: &BTreeMap<Vec<u8>, usize>, to: u64) {
    for from in (0..to).step_by(7).chain([0, 1, 2, to - 1, to]) {
        assert_absent(t, model, b"dfile\0", from, to);
    }
}

/// `first_absent(prefix, from, to)` is the model's first block missing there (the
/// model's keys are `key(b)`, whatever prefix the tree has them under now).
fn assert_absent(t: &Tree, model: &BTreeMap<Vec<u8>, usize>, prefix: &[u8], from: u64, to: u64) {
    let want = (from..to)
        .find(|b| !model.contains_key(&key(*b)))
        .unwrap_or(to);
    assert_eq!(
        t.first_absent(prefix, from, to).unwrap(),
        want,
        "{}, from {from}",
        String::from_utf8_lossy(prefix)
    );
}

#[test]
fn first_absent_walks_quiet_leaves_in_place_and_agrees_with_a_model() {
    let (dev, t) = cold_data_tree();
    let mut model: BTreeMap<Vec<u8>, usize> = (0..BLOCKS)
        .filter(|b| b % 3 != 2)
        .map(|b| (key(b), BLOCK))
        .collect();
    check_absent(&t, &model, BLOCKS);
    let s = t.stats();
    assert!(s.absent_walks > 0 && s.absent_merges == 0, "{s:?}");
    // A dense run across many leaves, then a hole: fill every hole below 2000 (2000
    // itself stays one).
    let mut b = Batch::new();
    for blk in (0..2000).filter(|b| b % 3 == 2) {
        b.put(&key(blk), &[1; BLOCK]);
        model.insert(key(blk), BLOCK);
    }
    t.write(b).unwrap();
    // Pending above the leaves: merged, and the same answers.
    check_absent(&t, &model, BLOCKS);
    assert!(t.stats().absent_merges > 0);
    assert_eq!(t.first_absent(b"dfile\0", 0, BLOCKS).unwrap(), 2000);
    // Deletes and a range delete pending.
    let mut b = Batch::new();
    b.delete(&key(10));
    model.remove(&key(10));
    b.delete_range(&key(1500), &key(1510));
    model.retain(|k, _| !(k >= &key(1500) && k < &key(1510)));
    t.write(b).unwrap();
    check_absent(&t, &model, BLOCKS);
    // Flushed down and reopened cold: quiet again, walked in place.
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev.clone(), opts()).unwrap();
    let before = t.stats();
    check_absent(&t, &model, BLOCKS);
    let after = t.stats();
    assert!(after.absent_walks > before.absent_walks);
    assert_eq!(
        after.basement_reads, before.basement_reads,
        "a walk read basements"
    );
    // Keys of other shapes between the numbered ones, and a renamed prefix (a lift).
    t.put(b"dfile\0\0\0\0\0\0\0\0\x0bx", b"not a block")
        .unwrap();
    check_absent(&t, &model, BLOCKS);
    t.rename_prefix(b"dfile\0", b"dmoved\0").unwrap();
    t.compact().unwrap();
    for (from, to) in [(0, BLOCKS), (11, BLOCKS), (1400, 1600), (2500, 2600)] {
        assert_absent(&t, &model, b"dmoved\0", from, to);
    }
    assert_eq!(t.first_absent(b"dfile\0", 0, BLOCKS).unwrap(), 0);
}
