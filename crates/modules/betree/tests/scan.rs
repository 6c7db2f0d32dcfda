//! A limited scan (`Iter::limit`) reads about as many basements as hold the entries it
//! was asked for, in either direction, and returns exactly what an unlimited scan
//! returns first. Checked on a tree reopened cold, so every leaf is read in parts.

use quilt_betree::{Batch, Options, Tree};
use quilt_block::MemDevice;
use std::sync::Arc;

const KEYS: u64 = 60_000;
const VALUE: usize = 40;
/// Entries each limited scan asks for.
const N: usize = 2000;

fn key(i: u64) -> Vec<u8> {
    // Scattered, so that the inserts go through the buffers as random ones do.
    format!("k{:08}", i.wrapping_mul(2_654_435_761) % 100_000_000).into_bytes()
}

/// Default geometry (256 KiB nodes, 4 KiB basements), filled, compacted (so the
/// leaves hold every entry) and reopened with an empty cache.
fn cold_tree() -> Tree {
    let dev = Arc::new(MemDevice::new(4096, 16384).unwrap());
    let opts = Options::default();
    let t = Tree::create(dev.clone(), opts.clone()).unwrap();
    for c in 0..KEYS / 1000 {
        let mut b = Batch::new();
        for i in c * 1000..(c + 1) * 1000 {
            b.put(&key(i), &[i as u8; VALUE]);
        }
        t.write(b).unwrap();
    }
    t.compact().unwrap();
    t.close().unwrap();
    Tree::open(dev, opts).unwrap()
}

#[test]
fn a_limited_scan_reads_the_basements_its_entries_need() {
    let t = cold_tree();
    // An entry is 4 + 9 + 4 + 40 = 57 bytes on disk: a full 4 KiB basement holds 71.
    let per_full_basement = 4096 / (4 + 9 + 4 + VALUE);
    for (forward, from) in [(true, 17u64), (false, 40_003), (true, 52_001)] {
        let lo = key(from);
        let range = || {
            if forward {
                t.range(&lo, None)
            } else {
                t.range_rev(b"", Some(&lo))
            }
        };
        let before = t.stats().basement_reads;
        let limited: Vec<_> = range().limit(N).map(|e| e.unwrap()).collect();
        let reads = (t.stats().basement_reads - before) as usize;
        assert_eq!(limited.len(), N);
        // A compacted leaf cuts a basement when the next entry would not fit, so each
        // but a leaf's last holds at least `per_full_basement - 1` entries. At most
        // those, plus the one the scan starts in (how much of it lies past the start
        // is unknown), plus at a leaf's end its short last basement and the next
        // leaf's first. (An unlimited scan reads 16 basements, then 32.)
        let least = N.div_ceil(per_full_basement);
        let most = N.div_ceil(per_full_basement - 1) + 3;
        assert!(
            (least..=most).contains(&reads),
            "forward {forward}: {reads} basements read for {N} entries, not {least}..={most}"
        );
        // The same entries as an unlimited scan's first ones (read again from the
        // cache, since the leaf's basements are loaded now).
        let unlimited: Vec<_> = range().take(N).map(|e| e.unwrap()).collect();
        assert_eq!(limited, unlimited);
        // And it ends by itself.
        let mut it = range().limit(3);
        assert!(it.next_entry().is_some() && it.next_entry().is_some());
        assert!(it.next_entry().is_some() && it.next_entry().is_none());
    }
}

#[test]
fn a_limit_of_zero_reads_nothing() {
    let t = cold_tree();
    let before = t.stats();
    assert!(t.range(b"", None).limit(0).next().is_none());
    let after = t.stats();
    assert_eq!(after.basement_reads, before.basement_reads);
    assert_eq!(after.scans, before.scans);
}
