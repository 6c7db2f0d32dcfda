//! How the engine's costs grow with the pending graph: the same small amount of work
//! (an epoch writing 64 blocks, an fsync-like `flush_until` of a two-block chain, a
//! change made while the graph is over its patch limit) timed while 10 k … 1 M other
//! patches are pending and cannot be written, as in a journal's running transaction or
//! behind an unreleased patchgroup. An engine whose cost follows the work in flight shows
//! flat columns.
//!
//! `cargo bench -p quilt-patch --bench scaling` (full: up to 1 M patches, 9 repetitions);
//! `QUILT_BENCH_QUICK=1` or `CI=true` for 10 k and 100 k with 3. Prints one table, medians.

use quilt_block::MemDevice;
use quilt_patch::{ChangeOpts, Engine, EngineOptions};
use std::sync::Arc;
use std::time::Instant;

const BS: usize = 1024;
/// Pending patches per stuck block: 16-byte records, as inodes or entries in a table block.
const PER_BLOCK: u64 = 16;
/// Records sit this far apart, so that none touches another (touching ones would merge
/// into one patch, and the point is many patches).
const STRIDE: u64 = 32;
/// Blocks written by each measured epoch.
const EPOCH_BLOCKS: u64 = 64;

struct Figures {
    epoch_ns: f64,
    per_block_ns: f64,
    flush_until_ns: f64,
    throttled_change_ns: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN timings"));
    v[v.len() / 2]
}

/// An engine holding `n` pending patches that no epoch may write (captured, the capture
/// closed but its hold never released), with room for the measured work after them.
fn stuck_engine(n: u64, patches_live_max: usize) -> (Engine, u64) {
    let stuck_blocks = n / PER_BLOCK;
    let free_from = 2 * stuck_blocks + 1;
    let blocks = free_from + 200_000;
    let dev = Arc::new(MemDevice::new(BS, blocks).expect("memory device"));
    let e = Engine::new(
        dev,
        EngineOptions {
            cache_bytes_max: 8 << 30,
            patches_live_max,
            // Hard patches would fold each stuck block's records into one patch; the
            // point is many patches.
            hard_patches: false,
            ..EngineOptions::default()
        },
    );
    e.capture_start(false).expect("capture");
    // Each stuck block also has an after on a companion block, as an inode table block
    // has directory entries waiting for it.
    for b in 0..stuck_blocks {
        for k in 0..PER_BLOCK {
            let p = e
                .write(
                    b,
                    (k * STRIDE) as usize,
                    &[k as u8 + 1; 16],
                    &[],
                    ChangeOpts::default(),
                )
                .expect("stuck change");
            if k == 0 {
                e.write(stuck_blocks + b, 0, &[1; 16], &[p], ChangeOpts::default())
                    .expect("companion change");
            }
        }
    }
    let txn = e
        .capture_rotate(false)
        .expect("rotate")
        .expect("capture open");
    // Keep the hold: the transaction never commits during the measurement.
    std::mem::forget(txn);
    (e, free_from)
}

fn measure(n: u64, reps: usize) -> Figures {
    let (e, mut next) = stuck_engine(n, usize::MAX);
    let mut epochs = Vec::new();
    let mut flushes = Vec::new();
    for _ in 0..reps {
        for k in 0..EPOCH_BLOCKS {
            e.write(next + k, 0, &[7; 64], &[], ChangeOpts::default())
                .expect("change");
        }
        next += EPOCH_BLOCKS;
        let t = Instant::now();
        let r = e.epoch().expect("epoch");
        epochs.push(t.elapsed().as_nanos() as f64);
        assert_eq!(
            r.blocks_written as u64, EPOCH_BLOCKS,
            "the stuck blocks stay"
        );

        let a = e
            .write(next, 0, &[1; 32], &[], ChangeOpts::default())
            .expect("change");
        let b = e
            .write(next + 1, 0, &[2; 32], &[a], ChangeOpts::default())
            .expect("change");
        next += 2;
        let t = Instant::now();
        e.flush_until(b).expect("flush_until");
        flushes.push(t.elapsed().as_nanos() as f64);
    }
    let live = e.stats().patches_live;
    assert!(live >= n, "{live} live patches, expected at least {n}");
    drop(e);

    // Throttling: the graph is over its limit, so each change first writes back.
    let (e, mut next) = stuck_engine(n, 8192);
    let mut changes = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        for k in 0..EPOCH_BLOCKS {
            e.write(next + k, 0, &[9; 64], &[], ChangeOpts::default())
                .expect("change");
        }
        changes.push(t.elapsed().as_nanos() as f64 / EPOCH_BLOCKS as f64);
        next += EPOCH_BLOCKS;
    }
    let epoch_ns = median(epochs);
    Figures {
        epoch_ns,
        per_block_ns: epoch_ns / EPOCH_BLOCKS as f64,
        flush_until_ns: median(flushes),
        throttled_change_ns: median(changes),
    }
}

fn main() {
    let quick = std::env::var_os("QUILT_BENCH_QUICK").is_some()
        || std::env::var("CI").is_ok_and(|v| v == "true");
    // `cargo bench` passes `--bench`; a filter argument is ignored.
    let (sizes, reps): (&[u64], usize) = if quick {
        (&[10_000, 100_000], 3)
    } else {
        (&[10_000, 100_000, 1_000_000], 9)
    };
    println!(
        "{:>10} {:>14} {:>16} {:>16} {:>20}",
        "pending", "epoch (µs)", "per block (µs)", "flush_until (µs)", "throttled change (µs)"
    );
    let mut first: Option<f64> = None;
    for &n in sizes {
        let f = measure(n, reps);
        println!(
            "{:>10} {:>14.1} {:>16.2} {:>16.1} {:>20.2}",
            n,
            f.epoch_ns / 1e3,
            f.per_block_ns / 1e3,
            f.flush_until_ns / 1e3,
            f.throttled_change_ns / 1e3
        );
        let base = *first.get_or_insert(f.epoch_ns);
        if n == *sizes.last().expect("sizes") {
            println!(
                "epoch cost at {n} pending / at {}: {:.2}×",
                sizes[0],
                f.epoch_ns / base
            );
        }
    }
}
