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
