//! Scans stream basements of one entry (a file system's data blocks) rather than cache
//! them: every value comes back right, pending messages above the leaves still apply,
//! a second scan reads the basements again (none was kept), and a point query still
//! caches what it reads.

use quilt_betree::{write_at_arg, Batch, Options, Tree, WRITE_AT};
use quilt_block::MemDevice;
use std::collections::BTreeMap;
use std::sync::Arc;

const BLOCK: usize = 4096;
const BLOCKS: u64 = 2000;

fn key(b: u64) -> Vec<u8> {
    let mut k = b"dfile\0".to_vec();
    k.extend_from_slice(&b.to_be_bytes());
    k
}

fn value(b: u64, round: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (b as usize * 31 + i + round as usize) as u8)
        .collect()
}

/// `BLOCKS` 4 KiB values, every fifth missing, compacted and reopened cold; and the
/// model of what it holds.
fn cold_tree() -> (Arc<MemDevice>, Tree, BTreeMap<Vec<u8>, Vec<u8>>) {
    let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
    let t = Tree::create(dev.clone(), Options::default()).unwrap();
    let mut model = BTreeMap::new();
    for c in (0..BLOCKS).step_by(100) {
        let mut b = Batch::new();
        for blk in (c..c + 100).filter(|b| b % 5 != 4) {
            b.put(&key(blk), &value(blk, 0));
            model.insert(key(blk), value(blk, 0));
        }
        t.write(b).unwrap();
    }
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev.clone(), Options::default()).unwrap();
    (dev, t, model)
}

/// Every entry of a forward scan, lent (as betrfs reads files).
fn scan(t: &Tree, lo: &[u8], hi: Option<&[u8]>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut it = t.range(lo, hi);
    let mut out = Vec::new();
    while let Some(kv) = it.next_entry() {
        let (k, v) = kv.unwrap();
        out.push((k.to_vec(), v.to_vec()));
    }
    out
}

/// A forward and a backward scan of `lo..hi` each return that part of `want`.
fn scans_agree_on_part(t: &Tree, want: &[(Vec<u8>, Vec<u8>)], lo: Vec<u8>, hi: Vec<u8>) {
    let part: Vec<_> = want
        .iter()
        .filter(|(k, _)| *k >= lo && *k < hi)
        .cloned()
        .collect();
    assert_eq!(scan(t, &lo, Some(&hi)), part);
    let back: Vec<_> = t
        .range_rev(&lo, Some(&hi))
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(back, part.iter().rev().cloned().collect::<Vec<_>>());
}

#[test]
fn a_scan_of_data_blocks_streams_them_and_keeps_none() {
    let (_dev, t, model) = cold_tree();
    let want: Vec<(Vec<u8>, Vec<u8>)> = model.into_iter().collect();
    let r0 = t.stats().basement_reads;
    assert_eq!(scan(&t, b"", None), want);
    let r1 = t.stats().basement_reads;
    assert_eq!(r1 - r0, want.len() as u64, "one basement read per block");
    // Nothing was cached: the same scan reads every basement again.
    assert_eq!(scan(&t, b"", None), want);
    let r2 = t.stats().basement_reads;
    assert_eq!(
        r2 - r1,
        want.len() as u64,
        "the first scan cached basements"
    );
    // A part of the range, from inside a leaf, backward as well.
    scans_agree_on_part(&t, &want, key(333), key(1501));
    // A point query still caches the basement it reads.
    let g0 = t.stats().basement_reads;
    assert_eq!(t.get(&key(7)).unwrap().as_deref(), Some(&value(7, 0)[..]));
    assert_eq!(t.get(&key(7)).unwrap().as_deref(), Some(&value(7, 0)[..]));
    assert_eq!(
        t.stats().basement_reads - g0,
        1,
        "a point query's basement not cached"
    );
    // A leaf with that one basement cached and the rest not: the scan joins both.
    scans_agree_on_part(&t, &want, key(0), key(60));
    // And a scan with a limit (a chunk sized by the count wanted).
    let some: Vec<_> = t
        .range(&key(0), None)
        .limit(25)
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(some, want[..25].to_vec());
}

#[test]
fn messages_pending_above_streamed_basements_apply() {
    let (dev, t, mut model) = cold_tree();
    // Puts, deletes, partial writes (upserts) and a range delete, left in the buffers
    // above the cold leaves.
    let mut b = Batch::new();
    for blk in (0..BLOCKS).step_by(7) {
        b.put(&key(blk), &value(blk, 1));
        model.insert(key(blk), value(blk, 1));
    }
    for blk in (3..BLOCKS).step_by(11) {
        b.delete(&key(blk));
        model.remove(&key(blk));
    }
    for blk in (5..BLOCKS).step_by(13) {
        b.upsert(&key(blk), WRITE_AT, &write_at_arg(100, b"patched"));
        let v = model.entry(key(blk)).or_default();
        if v.len() < 107 {
            v.resize(107, 0);
        }
        v[100..107].copy_from_slice(b"patched");
    }
    b.delete_range(&key(900), &key(950));
    model.retain(|k, _| *k < key(900) || *k >= key(950));
    t.write(b).unwrap();
    let want: Vec<(Vec<u8>, Vec<u8>)> = model.into_iter().collect();
    let r0 = t.stats().basement_reads;
    assert_eq!(scan(&t, b"", None), want);
    assert!(
        t.stats().basement_reads - r0 > 100,
        "the scan streamed no basement: the messages were not left above the leaves"
    );
    // And after the messages reach the leaves, cold again.
    t.compact().unwrap();
    t.close().unwrap();
    let t = Tree::open(dev, Options::default()).unwrap();
    let r1 = t.stats().basement_reads;
    assert_eq!(scan(&t, b"", None), want);
    assert!(
        t.stats().basement_reads - r1 > 100,
        "the scan streamed no basement"
    );
}
