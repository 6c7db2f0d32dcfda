//! Puts logged by reference (`Options::late_put_bytes`): a sync binds the values it owes
//! (a bind record) when they are few and checkpoints when they are many; either way a
//! crash after the sync finds every value, and the device takes each byte of a large
//! stream about once.

use quilt_betree::{Batch, Options, Tree};
use quilt_block::{BlockDevice, MemDevice};
use std::sync::Arc;

fn key(i: u32) -> Vec<u8> {
    format!("blk{i:08}").into_bytes()
}

fn value(i: u32) -> Vec<u8> {
    (0..4096u32)
        .map(|j| (i.wrapping_mul(31) ^ j) as u8)
        .collect()
}

fn opts() -> Options {
    Options {
        dirty_bytes: 8 << 20,
        ..Options::default()
    }
}

/// Blocks the device was asked to write, by its own counter (a byte count, not a
/// timing: the same on every machine).
fn written(dev: &MemDevice) -> u64 {
    dev.stats().bytes_written / 4096
}

#[test]
fn a_small_sync_binds_and_a_crash_keeps_what_it_synced() {
    let dev = Arc::new(MemDevice::new(4096, 16384).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    // A few values: below an eighth of the dirty limit, so the sync logs them.
    for i in 0..8 {
        t.put(&key(i), &value(i)).unwrap();
    }
    t.sync().unwrap();
    let s = t.stats();
    assert_eq!(s.late_puts, 8);
    assert_eq!(
        s.late_bytes_bound,
        8 * 4096,
        "the sync bound the values it owed"
    );
    // Unsynced, after the sync: may be lost, never half there.
    t.put(&key(100), &value(100)).unwrap();
    drop(t); // a crash
    let t = Tree::open(dev, opts()).unwrap();
    for i in 0..8 {
        assert_eq!(t.get(&key(i)).unwrap(), Some(value(i)), "synced block {i}");
    }
    if let Some(v) = t.get(&key(100)).unwrap() {
        assert_eq!(v, value(100));
    }
    t.check().unwrap();
}

#[test]
fn a_large_stream_is_written_about_once_and_survives_a_crash_after_its_sync() {
    let dev = Arc::new(MemDevice::new(4096, 65536).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    let before = written(&dev);
    const N: u32 = 16384; // 64 MiB in batches of 32 blocks
    for c in 0..N / 32 {
        let mut b = Batch::new();
        for i in c * 32..(c + 1) * 32 {
            b.put(&key(i), &value(i));
        }
        t.write(b).unwrap();
    }
    t.sync().unwrap();
    let s = t.stats();
    assert_eq!(s.late_puts, N as u64);
    assert!(
        s.late_bytes_bound < (N as u64 * 4096) / 8,
        "the final sync owed many values and checkpointed instead of logging them ({} bytes bound)",
        s.late_bytes_bound
    );
    let blocks = written(&dev) - before;
    let data = N as u64;
    eprintln!("{blocks} blocks written for {data} blocks of data");
    assert!(
        blocks < data * 13 / 10,
        "{blocks} blocks written for {data} blocks of data"
    );
    drop(t); // a crash right after the sync
    let t = Tree::open(dev, opts()).unwrap();
    for i in (0..N).step_by(97).chain([N - 1]) {
        assert_eq!(t.get(&key(i)).unwrap(), Some(value(i)), "block {i}");
    }
    let n = t.keys(b"", None).count();
    assert_eq!(n, N as usize);
    t.check().unwrap();
}
