//! Checkpoints write behind the caller: batches logged and synced while a checkpoint is
//! in flight must survive a crash that comes before its header is durable (recovery
//! then starts from the older header and replays across the newer one's snapshot), and
//! one that comes after it (replay starts in the middle of a log block).

use quilt_betree::{Batch, Options, Tree};
use quilt_block::{BlockDeviceExt, LogEntry, MemDevice, RecordingDevice};
use std::collections::BTreeMap;
use std::sync::Arc;

const BS: usize = 4096;
const ROUNDS: u32 = 3000;
const PER_ROUND: u32 = 10;

fn opts() -> Options {
    Options {
        node_bytes: 64 << 10,
        basement_bytes: 4 << 10,
        fanout: 8,
        log_blocks: 64,
        cache_bytes: 64 << 20,
        // Past half of it (2 MiB dirty) a checkpoint starts behind the caller.
        dirty_bytes: 4 << 20,
        engine_cache_bytes: 1 << 20,
        ..Options::default()
    }
}

fn key(i: u32) -> Vec<u8> {
    format!("key{:08}", i.wrapping_mul(2_654_435_761) % 1_000_000).into_bytes()
}

/// Every block the header slots (0 and 1) were written with, by log position.
fn header_writes(entries: &[LogEntry]) -> Vec<usize> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, LogEntry::Write { block, .. } if *block < 2))
        .map(|(i, _)| i)
        .collect()
}

/// `Some(n)` if `got` is exactly the first `n` batches' keys, each with `value`.
fn batches_in(got: &BTreeMap<Vec<u8>, Vec<u8>>, value: &[u8]) -> Option<u32> {
    let n = got.len() as u32 / PER_ROUND;
    let whole = got.len() as u32 % PER_ROUND == 0;
    (whole && (0..n * PER_ROUND).all(|i| got.get(&key(i)).is_some_and(|v| v == value))).then_some(n)
}

fn recover(base: &[u8], log: &quilt_block::RecordingLog, len: usize) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let dev = Arc::new(MemDevice::from_bytes(BS, base).unwrap());
    log.replay_prefix(len, dev.as_ref()).unwrap();
    let t = Tree::open(dev, opts()).expect("recovery");
    t.check().expect("recovered tree is sound");
    t.range(b"", None).map(|e| e.unwrap()).collect()
}

#[test]
fn batches_synced_during_a_checkpoint_survive_a_crash_before_and_after_its_header() {
    let mem = Arc::new(MemDevice::new(BS, 32768).unwrap());
    Tree::create(mem.clone(), opts()).unwrap().close().unwrap();
    let base = mem.to_vec();
    let rec = Arc::new(RecordingDevice::new(mem.clone(), 1 << 31));
    let t = Tree::open(rec.clone(), opts()).unwrap();
    // Checkpoints started (snapshots taken) when each sync returned.
    let mut started = Vec::new();
    let value = vec![7u8; 200];
    // Small batches, a sync after each: checkpoints start behind the caller as the dirty
    // nodes pass 2 MiB, and the syncs made meanwhile must not wait for them.
    for round in 0..ROUNDS {
        let mut b = Batch::new();
        for j in 0..PER_ROUND {
            let k = key(round * PER_ROUND + j);
            b.put(&k, &value);
        }
        t.write(b).unwrap();
        t.sync().unwrap();
        rec.mark(&format!("synced-{round}"));
        started.push(t.stats().checkpoints as usize);
    }
    let stats = t.stats();
    drop(t);
    let log = rec.take_log();
    assert!(stats.checkpoints >= 2, "no checkpoint ran: {stats:?}");
    // The k-th header write since the open ends the k-th checkpoint (the open itself
    // makes none: the tree was closed cleanly).
    let headers = header_writes(&log.entries);
    assert_eq!(
        headers.len(),
        stats.checkpoints as usize,
        "one header per checkpoint"
    );
    // Syncs durable while the newest checkpoint's header had not landed.
    let at =
        |round: u32| log.durable_prefix(log.mark_position(&format!("synced-{round}")).unwrap());
    let in_flight: Vec<u32> = (0..ROUNDS)
        .filter(|&r| {
            let n = started[r as usize];
            n > 0 && headers[n - 1] > at(r)
        })
        .collect();
    // Recovery costs a replay: check 40 of them, spread out, and some others.
    let step = (in_flight.len() / 40).max(1);
    let mut checked_before = 0;
    let mut checked_after = 0;
    for round in (0..ROUNDS).step_by(300) {
        let got = recover(&base, &log, at(round));
        assert_eq!(
            batches_in(&got, &value),
            Some(round + 1),
            "crash right after sync {round}"
        );
    }
    for &round in in_flight.iter().step_by(step) {
        let got = recover(&base, &log, at(round));
        assert_eq!(
            batches_in(&got, &value),
            Some(round + 1),
            "crash right after sync {round}, a checkpoint in flight"
        );
        checked_before += 1;
        // The same crash a little later, once the in-flight header is written: replay
        // starts in the middle of a log block.
        let h = headers[started[round as usize] - 1];
        let got = recover(&base, &log, h + 1);
        // Every batch is synced as soon as it is written: the state is the one after some
        // batch at or past this one.
        assert!(
            batches_in(&got, &value).is_some_and(|n| n > round),
            "after the header that followed sync {round}: {} keys, not the state after a \
             later batch",
            got.len()
        );
        checked_after += 1;
    }
    eprintln!(
        "syncs durable with a checkpoint in flight: {} of {ROUNDS}; checked {checked_before}",
        in_flight.len()
    );
    assert!(
        checked_before > 0 && checked_after > 0,
        "no sync completed while a checkpoint was in flight ({} header writes; {stats:?})",
        headers.len()
    );
}
