//! Held batches: applied at once, logged as one record by `release`, forgotten by
//! `rollback`; a crash keeps all of them or none.

use quilt_betree::{Batch, Options, Tree};
use quilt_block::MemDevice;
use std::sync::Arc;

fn tree() -> (Arc<MemDevice>, Tree) {
    let dev = Arc::new(MemDevice::new(512, 16384).unwrap());
    let t = Tree::create(dev.clone(), Options::tiny()).unwrap();
    (dev, t)
}

/// The device as a crash leaves it (what reached it), opened again.
fn after_crash(dev: &MemDevice) -> Tree {
    let copy = Arc::new(MemDevice::from_bytes(512, &dev.to_vec()).unwrap());
    Tree::open(copy, Options::tiny()).unwrap()
}

fn get(t: &Tree, k: &str) -> Option<Vec<u8>> {
    t.get(k.as_bytes()).unwrap()
}

#[test]
fn a_rollback_forgets_held_batches_and_keeps_what_came_before() {
    let (_dev, t) = tree();
    for i in 0..30 {
        t.put(format!("k{i:02}").as_bytes(), b"before").unwrap();
    }
    // Logged, not synced: a rollback keeps it all the same.
    t.put(b"unsynced", b"yes").unwrap();
    t.hold().unwrap();
    for i in 0..30 {
        t.put(format!("k{i:02}").as_bytes(), b"during").unwrap();
    }
    let mut b = Batch::new();
    b.delete_range(b"k10", b"k15").rename_prefix(b"k0", b"m0");
    t.write(b).unwrap();
    assert_eq!(get(&t, "k10"), None);
    assert_eq!(get(&t, "m01").as_deref(), Some(&b"during"[..]));
    t.rollback().unwrap();
    assert!(t.release().is_err(), "nothing is held after a rollback");
    for i in 0..30 {
        assert_eq!(
            get(&t, &format!("k{i:02}")).as_deref(),
            Some(&b"before"[..]),
            "k{i:02}"
        );
    }
    assert_eq!(get(&t, "m01"), None);
    assert_eq!(get(&t, "unsynced").as_deref(), Some(&b"yes"[..]));
    // And the tree goes on.
    t.put(b"after", b"1").unwrap();
    t.sync().unwrap();
    t.check().unwrap();
}

#[test]
fn held_batches_reach_the_log_together_or_not_at_all() {
    let (dev, t) = tree();
    t.put(b"a", b"0").unwrap();
    t.sync().unwrap();
    t.hold().unwrap();
    t.put(b"a", b"1").unwrap();
    t.put(b"b", b"1").unwrap();
    // Nothing held is logged: a sync now makes none of it durable.
    t.sync().unwrap();
    let crashed = after_crash(&dev);
    assert_eq!(get(&crashed, "a").as_deref(), Some(&b"0"[..]));
    assert_eq!(get(&crashed, "b"), None);
    // Checkpoints wait for the release.
    t.checkpoint().unwrap();
    let crashed = after_crash(&dev);
    assert_eq!(get(&crashed, "b"), None);
    t.release().unwrap();
    t.sync().unwrap();
    let crashed = after_crash(&dev);
    assert_eq!(get(&crashed, "a").as_deref(), Some(&b"1"[..]));
    assert_eq!(get(&crashed, "b").as_deref(), Some(&b"1"[..]));
    crashed.check().unwrap();
}

#[test]
fn a_hold_is_bounded_by_one_record() {
    let (_dev, t) = tree();
    t.hold().unwrap();
    let big = vec![7u8; 200];
    let mut refused = None;
    for i in 0..100_000u32 {
        if let Err(e) = t.put(format!("key{i:06}").as_bytes(), &big) {
            refused = Some((i, e));
            break;
        }
    }
    let (n, e) = refused.expect("a hold cannot grow without bound");
    assert!(n > 10, "{n} batches before the limit");
    assert!(e.to_string().contains("too large"), "{e}");
    // What was held is still whole and can be released.
    t.release().unwrap();
    assert_eq!(get(&t, "key000000").as_deref(), Some(&big[..]));
    assert_eq!(get(&t, &format!("key{:06}", n)), None);
}
