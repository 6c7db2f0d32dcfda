//! Behaviour of the engine on hand-built graphs: rollback breaking block-level cycles,
//! the two optimizations, targeted flushes, eviction, the flusher, durability settings,
//! I/O failures and bad requests.

use quilt_block::WriteClass;
use quilt_block::{BlockDevice, BlockError, MemDevice};
use quilt_patch::{ChangeOpts, Durability, Engine, EngineOptions, PatchError};
use std::sync::Arc;
use std::time::Duration;

const BS: usize = 512;
const NONE: ChangeOpts = ChangeOpts {
    caller: None,
    data: false,
};

fn opts(hard: bool, merge: bool) -> EngineOptions {
    EngineOptions {
        hard_patches: hard,
        overlap_merge: merge,
        ..EngineOptions::default()
    }
}

fn setup(o: EngineOptions) -> (Engine, Arc<MemDevice>) {
    let dev = Arc::new(MemDevice::new(BS, 64).unwrap());
    (Engine::new(dev.clone(), o), dev)
}

fn disk(dev: &MemDevice, b: u64) -> Vec<u8> {
    let mut buf = vec![0; BS];
    dev.read(b, &mut buf).unwrap();
    buf
}

#[test]
fn block_level_cycle_is_written_with_rollback() {
    // a1 on A; b1 on B after a1; a2 on A after b1. A and B wait for each other as blocks,
    // but the patches do not: A goes first without a2, then B, then A again.
    let (e, dev) = setup(opts(false, false));
    let a1 = e.write(1, 0, &[1; 8], &[], NONE).unwrap();
    let b1 = e.write(2, 0, &[2; 8], &[a1], NONE).unwrap();
    let a2 = e.write(1, 100, &[3; 8], &[b1], NONE).unwrap();

    let r = e.epoch().unwrap();
    assert_eq!(
        (r.blocks_written, r.patches_written, r.patches_rolled_back),
        (1, 1, 1)
    );
    assert_eq!(&disk(&dev, 1)[..8], &[1; 8]);
    assert_eq!(&disk(&dev, 1)[100..108], &[0; 8], "a2 must be rolled back");
    assert_eq!(&disk(&dev, 2)[..8], &[0; 8]);
    assert!(e.is_durable(a1) && !e.is_durable(b1));

    e.epoch().unwrap();
    assert_eq!(&disk(&dev, 2)[..8], &[2; 8]);
    assert!(!e.is_durable(a2));
    e.epoch().unwrap();
    assert_eq!(&disk(&dev, 1)[100..108], &[3; 8]);
    assert!(e.is_durable(a2));
    assert_eq!(e.stats().epochs, 3);
    assert_eq!(e.stats().flushes, 3);
    assert_eq!(e.stats().patches_rolled_back, 1);
}

#[test]
fn rollback_restores_overlapping_bytes_in_order() {
    // Three overlapping changes on one block; the newest waits for another block. The
    // written image holds the first two, byte for byte.
    let (e, dev) = setup(opts(false, false));
    e.write(1, 0, &[1; 16], &[], NONE).unwrap();
    e.write(1, 8, &[2; 16], &[], NONE).unwrap();
    let other = e.write(2, 0, &[9], &[], NONE).unwrap();
    e.write(1, 4, &[3; 8], &[other], NONE).unwrap();
    let mut want = vec![0u8; BS];
    want[..16].fill(1);
    want[8..24].fill(2);
    let r = e.epoch().unwrap();
    assert_eq!(r.patches_rolled_back, 1);
    assert_eq!(disk(&dev, 1), want);
    e.sync().unwrap();
    want[4..12].fill(3);
    assert_eq!(disk(&dev, 1), want);
    assert_eq!(e.read(1).unwrap(), want);
}

#[test]
fn hard_patches_need_no_undo_bytes_when_no_other_block_waits() {
    let (e, _) = setup(opts(true, false));
    for i in 0..10 {
        e.write(5, i * 10, &[i as u8; 10], &[], NONE).unwrap();
    }
    let s = e.stats();
    assert_eq!(s.patches_made_hard, 1);
    assert_eq!(s.patches_created, 1);
    assert_eq!(s.patches_merged, 9);
    assert_eq!(s.undo_bytes_total, 0);

    // Once another block depends on it, changes on it keep undo bytes again.
    let (e, _) = setup(opts(true, false));
    let d = e.write(5, 0, &[1; 10], &[], NONE).unwrap();
    e.write(6, 0, &[1; 4], &[d], NONE).unwrap();
    e.write(5, 100, &[2; 10], &[], NONE).unwrap();
    e.check_invariants().unwrap();
    // The new change overlaps the hard patch only: it folds into it.
    assert_eq!(e.stats().undo_bytes_total, 0);
    let other = e.write(7, 0, &[1], &[], NONE).unwrap();
    e.write(5, 200, &[3; 10], &[other], NONE).unwrap();
    e.sync().unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn overlap_merging_folds_repeated_writes_to_the_same_bytes() {
    let run = |merge: bool| {
        let (e, dev) = setup(opts(false, merge));
        let anchor = e.write(9, 0, &[1], &[], NONE).unwrap();
        for i in 0..50u8 {
            e.write(3, 0, &[i; 32], &[anchor], NONE).unwrap();
            e.write(3, 16, &[i; 32], &[anchor], NONE).unwrap();
        }
        e.sync().unwrap();
        assert_eq!(
            &disk(&dev, 3)[..48],
            &[&[49u8; 16][..], &[49u8; 32][..]].concat()[..]
        );
        e.stats()
    };
    let plain = run(false);
    let merged = run(true);
    assert_eq!(plain.patches_created, 101);
    assert!(merged.patches_created <= 3, "{merged:?}");
    assert!(merged.patches_merged >= 98);
    assert!(merged.undo_bytes_total < plain.undo_bytes_total / 10);
}

#[test]
fn bit_patches_on_one_word_merge_and_commute() {
    let (e, dev) = setup(opts(false, true));
    let anchor = e.write(9, 0, &[1], &[], NONE).unwrap();
    for bit in 0..32 {
        e.xor_bits(4, 8, 1 << bit, &[anchor], NONE).unwrap();
    }
    assert_eq!(e.stats().patches_created, 2);
    e.sync().unwrap();
    assert_eq!(&disk(&dev, 4)[8..12], &[0xff; 4]);
    assert!(matches!(
        e.xor_bits(4, 6, 1, &[], NONE),
        Err(PatchError::UnalignedWord(6))
    ));
}

#[test]
fn a_bit_does_not_merge_into_a_disjoint_bit_that_waits_for_another_block() {
    let (e, dev) = setup(opts(false, true));
    // A freed inode's bit waits for its cleared record (block 5); another inode of the
    // same bitmap word is then allocated, which depends on nothing.
    let cleared = e.write(5, 0, &[9], &[], NONE).unwrap();
    let free = e.xor_bits(4, 0, 1 << 3, &[cleared], NONE).unwrap();
    let alloc = e.xor_bits(4, 0, 1 << 4, &[], NONE).unwrap();
    assert_ne!(free, alloc, "merged into the free's patch");
    e.flush_until(alloc).unwrap();
    assert!(e.is_durable(alloc));
    assert!(
        !e.is_durable(cleared) && !e.is_durable(free),
        "the allocation waited for the free's record"
    );
    assert_eq!(disk(&dev, 4)[0], 1 << 4, "the free's bit was rolled back");
    assert_eq!(disk(&dev, 5)[0], 0);
    // Bits with the same befores still merge (the test above), and so do changes of a
    // common bit (they depend on each other anyway).
    let again = e.xor_bits(4, 0, 1 << 3, &[], NONE).unwrap();
    assert_eq!(again, free, "a change of the same bit joins its patch");
    e.sync().unwrap();
    assert_eq!(disk(&dev, 4)[0], 1 << 4);
    assert_eq!(disk(&dev, 5)[0], 9);
}

#[test]
fn flush_until_writes_only_what_the_patch_needs() {
    let (e, dev) = setup(EngineOptions::default());
    let a = e.write(1, 0, &[1], &[], NONE).unwrap();
    let b = e.write(2, 0, &[2], &[a], NONE).unwrap();
    let unrelated = e.write(3, 0, &[3], &[], NONE).unwrap();
    e.flush_until(b).unwrap();
    assert!(e.is_durable(a) && e.is_durable(b));
    assert!(!e.is_durable(unrelated));
    assert_eq!(
        (disk(&dev, 1)[0], disk(&dev, 2)[0], disk(&dev, 3)[0]),
        (1, 2, 0)
    );
    assert_eq!(
        e.stats().flushes,
        2,
        "a chain of two blocks needs two epochs"
    );
}

#[test]
fn empty_patches_join_dependencies() {
    let (e, dev) = setup(EngineOptions::default());
    let a = e.write(1, 0, &[1], &[], NONE).unwrap();
    let b = e.write(2, 0, &[2], &[], NONE).unwrap();
    let both = e.empty(&[a, b]);
    let c = e.write(3, 0, &[3], &[both], NONE).unwrap();
    let r = e.epoch().unwrap();
    assert_eq!(r.blocks_written, 2, "c waits for a and b");
    assert!(e.is_durable(both));
    e.flush_until(c).unwrap();
    assert_eq!(disk(&dev, 3)[0], 3);
    assert!(
        e.is_durable(e.empty(&[])),
        "an empty patch with nothing to wait for is durable"
    );

    let x = e.write(4, 0, &[4], &[], NONE).unwrap();
    let join = e.empty(&[x]);
    let y = e.write(5, 0, &[5], &[join], NONE).unwrap();
    assert!(matches!(e.add_depend(join, y), Err(PatchError::Cycle)));
    e.sync().unwrap();
    assert!(matches!(e.add_depend(join, y), Err(PatchError::NotPending)));
}

#[test]
fn cache_stays_within_budget_by_evicting_and_writing_back() {
    let dev = Arc::new(MemDevice::new(BS, 256).unwrap());
    let e = Engine::new(
        dev.clone(),
        EngineOptions {
            cache_bytes_max: 8 * BS,
            ..EngineOptions::default()
        },
    );
    for b in 0..200u64 {
        e.write(b, 0, &[b as u8 + 1], &[], NONE).unwrap();
        assert!(e.stats().blocks_cached <= 8, "{:?}", e.stats());
    }
    e.sync().unwrap();
    for b in 0..200u64 {
        assert_eq!(disk(&dev, b)[0], b as u8 + 1);
        assert_eq!(e.read(b).unwrap()[0], b as u8 + 1);
    }
    let s = e.stats();
    assert!(s.evictions > 150 && s.cache_misses > 200, "{s:?}");
}

#[test]
fn reused_buffers_of_evicted_blocks_show_none_of_their_old_bytes() {
    // Evicted blocks' buffers are reused for blocks coming in (zeroed, read, written
    // whole, written as a run): none may show the bytes they held before.
    let dev = Arc::new(MemDevice::new(BS, 1024).unwrap());
    let e = Engine::new(
        dev.clone(),
        EngineOptions {
            cache_bytes_max: 16 * BS,
            ..EngineOptions::default()
        },
    );
    let zeros = vec![0u8; BS];
    for i in 0..60u64 {
        // Churn: whole blocks of 0xab, written back so that they can be evicted.
        for k in 0..4 {
            e.write(600 + (i * 4 + k) % 400, 0, &[0xab; BS], &[], NONE)
                .unwrap();
        }
        e.sync().unwrap();
        let b = 4 * i;
        e.zero_block(b, &[], NONE).unwrap();
        assert_eq!(e.read(b).unwrap(), zeros, "zeroed block {b}");
        e.write(b + 1, 0, &[1], &[], NONE).unwrap();
        let mut want = zeros.clone();
        want[0] = 1;
        assert_eq!(
            e.read(b + 1).unwrap(),
            want,
            "partly written block {}",
            b + 1
        );
        assert_eq!(e.read(b + 2).unwrap(), zeros, "read block {}", b + 2);
        e.write_run(b + 3, &[0x11; BS], &[], NONE).unwrap();
        assert_eq!(
            e.read(b + 3).unwrap(),
            vec![0x11; BS],
            "run block {}",
            b + 3
        );
    }
    e.sync().unwrap();
    for b in 0..240u64 {
        let want = match b % 4 {
            0 | 2 => zeros.clone(),
            1 => {
                let mut w = zeros.clone();
                w[0] = 1;
                w
            }
            _ => vec![0x11; BS],
        };
        assert_eq!(disk(&dev, b), want, "block {b} on the device");
    }
    assert!(e.stats().evictions > 200, "{:?}", e.stats());
}

#[test]
fn background_flusher_writes_back_on_its_interval() {
    let dev = Arc::new(MemDevice::new(BS, 8).unwrap());
    let e = Engine::new(
        dev.clone(),
        EngineOptions {
            flush_interval_ms: Some(10),
            ..EngineOptions::default()
        },
    );
    let p = e.write(1, 0, &[7], &[], NONE).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !e.is_durable(p) {
        assert!(
            std::time::Instant::now() < deadline,
            "flusher never wrote the block"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(disk(&dev, 1)[0], 7);
    e.stop_flusher();
}

#[test]
fn unsafe_durability_writes_without_flushes() {
    let (e, dev) = setup(EngineOptions {
        durability: Durability::Unsafe,
        ..EngineOptions::default()
    });
    let a = e.write(1, 0, &[1], &[], NONE).unwrap();
    e.write(2, 0, &[2], &[a], NONE).unwrap();
    e.sync().unwrap();
    assert_eq!((disk(&dev, 1)[0], disk(&dev, 2)[0]), (1, 2));
    assert_eq!(dev.stats().flushes, 0);
    assert_eq!(e.stats().flushes, 0);
}

#[test]
fn write_back_failure_stops_the_engine_with_a_clear_error() {
    let (e, dev) = setup(EngineOptions::default());
    e.write(1, 0, &[1], &[], NONE).unwrap();
    dev.set_failing(true);
    let err = e.sync().unwrap_err();
    assert!(
        matches!(err, PatchError::Block(BlockError::Io { .. })),
        "{err}"
    );
    assert_eq!(err.errno(), 5);
    dev.set_failing(false);
    let again = e.write(2, 0, &[1], &[], NONE).unwrap_err();
    assert!(matches!(again, PatchError::Failed(_)), "{again}");
    assert!(again.to_string().contains("injected fault"));
}

#[test]
fn bad_requests_are_typed_errors() {
    let (e, _) = setup(EngineOptions::default());
    assert!(matches!(
        e.write(64, 0, &[1], &[], NONE),
        Err(PatchError::Block(BlockError::OutOfRange { .. }))
    ));
    assert!(matches!(
        e.write(1, 510, &[1; 4], &[], NONE),
        Err(PatchError::OutOfBlock { .. })
    ));
    assert!(matches!(
        e.read(1000),
        Err(PatchError::Block(BlockError::OutOfRange { .. }))
    ));
    assert!(matches!(
        e.xor_bits(1, 512, 1, &[], NONE),
        Err(PatchError::OutOfBlock { .. })
    ));
}

#[test]
fn dot_dump_shows_patches_and_edges() {
    let (e, _) = setup(opts(false, false));
    let a = e.write(1, 0, &[1], &[], NONE).unwrap();
    let b = e.write(2, 0, &[2], &[a], NONE).unwrap();
    let dot = e.dump_dot();
    assert!(dot.starts_with("digraph patches"));
    assert!(dot.contains(&format!("\"{b}\" -> \"{a}\"")), "{dot}");
}

#[test]
fn concurrent_writers_and_flusher_end_in_the_expected_image() {
    let dev = Arc::new(MemDevice::new(BS, 64).unwrap());
    let e = Engine::new(
        dev.clone(),
        EngineOptions {
            flush_interval_ms: Some(1),
            cache_bytes_max: 16 * BS,
            ..EngineOptions::default()
        },
    );
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut prev = None;
                for i in 0..300u64 {
                    let block = t * 16 + i % 16;
                    let befores: Vec<_> = prev.into_iter().collect();
                    let p = e
                        .write(
                            block,
                            (i as usize % 64) * 4,
                            &(i as u32).to_le_bytes(),
                            &befores,
                            NONE,
                        )
                        .unwrap();
                    prev = Some(p);
                    if i % 50 == 0 {
                        e.flush_until(p).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    e.sync().unwrap();
    e.stop_flusher();
    e.check_invariants().unwrap();
    for t in 0..4u64 {
        for i in 284..300u64 {
            let block = t * 16 + i % 16;
            let off = (i as usize % 64) * 4;
            assert_eq!(&disk(&dev, block)[off..off + 4], &(i as u32).to_le_bytes());
        }
    }
    assert_eq!(e.stats().patches_live, 0);
}

#[test]
fn an_epoch_looks_only_at_blocks_that_can_be_written() {
    // 200 dirty blocks whose patches wait for a held empty patch (a journal's running
    // transaction): an epoch writing one other block must not examine them.
    let dev = Arc::new(MemDevice::new(BS, 512).unwrap());
    let e = Engine::new(dev.clone(), opts(false, false));
    e.capture_start(false).unwrap();
    for b in 0..200 {
        e.write(b, 0, &[1; 4], &[], NONE).unwrap();
    }
    let txn = e.capture_rotate(false).unwrap().unwrap();
    assert_eq!(e.epoch().unwrap().blocks_written, 0, "all held");
    let before = e.stats().blocks_examined;
    let free = e.write(300, 0, &[2; 4], &[], NONE).unwrap();
    let r = e.epoch().unwrap();
    assert_eq!(r.blocks_written, 1);
    assert!(e.is_durable(free));
    assert_eq!(
        e.stats().blocks_examined - before,
        1,
        "the epoch examined only the writable block"
    );
    // Releasing the hold makes all 200 writable at once.
    e.release_hold(txn.hold);
    let r = e.epoch().unwrap();
    assert_eq!(r.blocks_written, 200);
    assert!(e.is_durable(txn.done));
    assert_eq!(disk(&dev, 199)[..4], [1; 4]);
    e.check_invariants().unwrap();
}

#[test]
fn a_patch_depending_on_a_small_join_travels_with_its_befores_on_its_block() {
    // c on block 1 waits for a join of a and a2, both on block 1: it is written with them
    // in one epoch, as if it named them directly, not an epoch after the join.
    let (e, dev) = setup(opts(false, false));
    let a = e.write(1, 0, &[1], &[], NONE).unwrap();
    let a2 = e.write(1, 4, &[2], &[], NONE).unwrap();
    let join = e.empty(&[a, a2]);
    let c = e.write(1, 8, &[4], &[join], NONE).unwrap();
    let r = e.epoch().unwrap();
    assert_eq!((r.blocks_written, r.patches_written), (1, 3));
    assert!(e.is_durable(join) && e.is_durable(c));
    assert_eq!(
        [disk(&dev, 1)[0], disk(&dev, 1)[4], disk(&dev, 1)[8]],
        [1, 2, 4]
    );

    // A before added to the join later reaches c, which took the join's befores.
    let a = e.write(1, 0, &[5], &[], NONE).unwrap();
    let x = e.write(3, 0, &[6], &[], NONE).unwrap();
    let join = e.empty(&[a]);
    let c = e.write(4, 0, &[7], &[join], NONE).unwrap();
    assert!(matches!(e.add_depend(join, c), Err(PatchError::Cycle)));
    let y = e.write(5, 0, &[8], &[], NONE).unwrap();
    e.add_depend(join, y).unwrap();
    e.add_depend(y, x).unwrap();
    e.check_invariants().unwrap();
    // c waits for a and y, y for x: three epochs, in order.
    let mut order = Vec::new();
    while !e.is_durable(c) {
        e.epoch().unwrap();
        order.push([a, x, y, c].map(|p| e.is_durable(p)));
    }
    assert_eq!(
        order,
        vec![
            [true, true, false, false],
            [true, true, true, false],
            [true, true, true, true]
        ]
    );
}

const DATA: ChangeOpts = ChangeOpts {
    caller: None,
    data: true,
};

fn blocks_of(n: usize, byte: u8) -> Vec<u8> {
    vec![byte; n * BS]
}

#[test]
fn a_run_of_fresh_blocks_is_one_patch_written_in_one_epoch() {
    let (e, dev) = setup(opts(true, true));
    let r = e.write_run(10, &blocks_of(3, 7), &[], DATA).unwrap()[0];
    assert_eq!(e.stats().patches_created, 1);
    assert_eq!(e.stats().data_patches_created, 1);
    let pointer = e.write(1, 0, &[1; 4], &[r], NONE).unwrap();
    // The pointer waits for the whole run: one epoch writes the three blocks, the next
    // the pointer.
    let first = e.epoch().unwrap();
    assert_eq!((first.blocks_written, first.patches_written), (3, 1));
    assert!(e.is_durable(r) && !e.is_durable(pointer));
    for b in 10..13 {
        assert_eq!(disk(&dev, b), vec![7; BS]);
    }
    e.epoch().unwrap();
    assert!(e.is_durable(pointer));
    e.check_invariants().unwrap();
}

#[test]
fn a_pending_run_grows_over_the_blocks_that_follow_it() {
    let (e, dev) = setup(opts(true, true));
    let a = e.write_run(20, &blocks_of(2, 1), &[], DATA).unwrap()[0];
    let b = e.write_run(22, &blocks_of(1, 2), &[], DATA).unwrap()[0];
    let c = e.write_run(23, &blocks_of(3, 3), &[], DATA).unwrap()[2];
    assert_eq!((a, b), (a, c), "one patch for the three writes");
    assert_eq!(e.stats().patches_created, 1);
    // A change to a middle block joins the run.
    e.write(21, 100, &[9; 8], &[], DATA).unwrap();
    assert_eq!(e.stats().patches_created, 1);
    let r = e.epoch().unwrap();
    assert_eq!(r.blocks_written, 6);
    assert_eq!(&disk(&dev, 21)[100..108], &[9; 8]);
    assert_eq!(disk(&dev, 25), vec![3; BS]);
    // Once written, the next run starts afresh.
    let d = e.write_run(26, &blocks_of(1, 4), &[], DATA).unwrap()[0];
    assert_ne!(d, a);
    e.check_invariants().unwrap();
}

#[test]
fn a_change_that_depends_on_a_run_follows_it_even_on_its_own_blocks() {
    // The run's blocks go out together with no order among them: a change to one of them
    // that depends on the run (on another of its blocks) must wait for the run's flush.
    let (e, dev) = setup(opts(true, true));
    let r = e.write_run(30, &blocks_of(2, 5), &[], DATA).unwrap()[1];
    let later = e.write(31, 0, &[6; 4], &[r], NONE).unwrap();
    assert_ne!(later, r, "it must not merge into the run");
    let first = e.epoch().unwrap();
    assert_eq!(first.blocks_written, 2);
    assert_eq!(
        &disk(&dev, 31)[..4],
        &[5; 4],
        "rolled back in the run's epoch"
    );
    assert!(e.is_durable(r) && !e.is_durable(later));
    e.epoch().unwrap();
    assert_eq!(&disk(&dev, 31)[..4], &[6; 4]);
    // Nor does a run grow with a dependency on itself.
    let s = e.write_run(40, &blocks_of(1, 1), &[], DATA).unwrap()[0];
    let t = e.write_run(41, &blocks_of(1, 2), &[s], DATA).unwrap()[0];
    assert_ne!(s, t);
    e.sync().unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn a_run_over_blocks_with_pending_patches_falls_back_to_one_change_per_block() {
    let (e, dev) = setup(opts(true, true));
    e.write(51, 0, &[1; 4], &[], NONE).unwrap();
    let before = e.stats().patches_created;
    let heads = e.write_run(50, &blocks_of(3, 8), &[], DATA).unwrap();
    // Block 51 is pending: no run; one change per block (51's folds into its hard
    // patch), no empty joining them.
    assert_eq!(heads.len(), 3);
    assert_eq!(e.stats().patches_created, before + 2);
    assert_eq!(e.stats().empties_created, 0);
    for h in heads {
        e.flush_until(h).unwrap();
    }
    for b in 50..53 {
        assert_eq!(disk(&dev, b), vec![8; BS]);
    }
    // Without hard patches there are no runs either.
    let (e, _) = setup(opts(false, true));
    e.write_run(5, &blocks_of(2, 1), &[], DATA).unwrap();
    assert_eq!(e.stats().patches_made_hard, 0);
    // Bad requests are errors.
    assert!(matches!(
        e.write_run(5, &[0; 100], &[], DATA),
        Err(PatchError::Invalid(_))
    ));
    assert!(matches!(
        e.write_run(63, &blocks_of(2, 0), &[], DATA),
        Err(PatchError::Block(BlockError::OutOfRange { .. }))
    ));
}

#[test]
fn consecutive_pointer_writes_merge_into_one_patch_even_behind_a_hard_patch() {
    // A map block: initialized (hard) before the inode that names it; pointers added
    // later must follow the inode, so they cannot join the hard patch, but they join
    // each other.
    let (e, _) = setup(opts(true, true));
    let init = e.write(60, 0, &[0; BS], &[], NONE).unwrap();
    let inode = e.write(61, 0, &[1; 8], &[init], NONE).unwrap();
    let before = e.stats().patches_created;
    let p1 = e.write(60, 4, &[2; 4], &[inode], NONE).unwrap();
    let p2 = e.write(60, 8, &[3; 4], &[inode], NONE).unwrap();
    let p3 = e.write(60, 12, &[4; 4], &[inode], NONE).unwrap();
    assert_ne!(p1, init);
    assert_eq!((p1, p1), (p2, p3));
    assert_eq!(e.stats().patches_created, before + 1);
    e.sync().unwrap();
    e.check_invariants().unwrap();
}

/// A part read gives the bytes the block reads would: the engine's pending data for
/// blocks it holds, the device's for the others, across block edges.
#[test]
fn part_reads_see_pending_and_device_bytes() {
    let (e, dev) = setup(EngineOptions::default());
    let bs = e.block_size();
    // Blocks 10..14 on the device; block 11 and 13 changed in the engine, not written.
    for b in 10..14u64 {
        dev.write(b, &vec![b as u8; bs], WriteClass::Metadata)
            .unwrap();
    }
    e.write(11, 0, &vec![0xaa; bs], &[], ChangeOpts::default())
        .unwrap();
    e.write(13, 5, &[0xbb; 7], &[], ChangeOpts::default())
        .unwrap();
    // What blocks 10..14 hold, built by hand (`read_uncached` is a part read too).
    let mut want: Vec<u8> = (10..14u8).flat_map(|b| vec![b; bs]).collect();
    want[bs..2 * bs].fill(0xaa);
    want[3 * bs + 5..3 * bs + 12].fill(0xbb);
    let mut whole = vec![0u8; 4 * bs];
    e.read_uncached(10, &mut whole).unwrap();
    assert_eq!(whole, want);
    for (skip, len) in [
        (0, 4 * bs),
        (bs - 3, 10),
        (100, 2 * bs),
        (3 * bs + 4, 9),
        (7, 1),
        (bs, 0),
    ] {
        let mut part = vec![0u8; len];
        e.read_part_uncached(10, skip, &mut part).unwrap();
        assert_eq!(part, whole[skip..skip + len], "skip {skip} len {len}");
    }
    assert_eq!(whole[bs], 0xaa);
    assert_eq!(whole[3 * bs + 5], 0xbb);
    let mut past = vec![0u8; 2];
    let count = e.block_count();
    assert!(e.read_part_uncached(count - 1, bs - 1, &mut past).is_err());
}

/// A memory device that logs the hints it is given.
struct Hinted {
    inner: MemDevice,
    hints: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl BlockDevice for Hinted {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.inner.read(block, buf)
    }
    fn write(
        &self,
        block: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.inner.write(block, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        self.inner.flush()
    }
    fn stats(&self) -> quilt_block::IoStats {
        self.inner.stats()
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        quilt_block::read_each(self, first, buf)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        quilt_block::write_each(self, first, buf, class)
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        quilt_block::Capabilities {
            hints: Some(self),
            ..Default::default()
        }
    }
}

impl quilt_block::ReadHints for Hinted {
    fn will_need(&self, first: u64, count: u64) {
        self.hints.lock().unwrap().push((first, count));
    }
}

#[test]
fn hints_go_to_the_device_in_runs_once_and_never_for_cached_blocks() {
    let dev = Arc::new(Hinted {
        inner: MemDevice::new(BS, 64).unwrap(),
        hints: Default::default(),
    });
    let e = Engine::new(dev.clone(), EngineOptions::default());
    let taken = || std::mem::take(&mut *dev.hints.lock().unwrap());
    // Block 4 is cached (read through the engine); the rest are not.
    e.with_block(4, |_| ()).unwrap();
    e.will_need(&mut vec![9, 3, 5, 4, 2, 3, 10]);
    assert_eq!(taken(), vec![(2, 2), (5, 1), (9, 2)]);
    // Given once: only the blocks not hinted yet.
    e.will_need(&mut vec![1, 2, 3, 5, 6]);
    assert_eq!(taken(), vec![(1, 1), (6, 1)]);
    assert!(e.was_hinted(9) && !e.was_hinted(11));
    // Past the end of the device: left out (a hint never fails).
    e.will_need(&mut vec![63, 64, u64::MAX]);
    assert_eq!(taken(), vec![(63, 1)]);
}

/// A memory device that logs each read request as (first block, blocks).
struct ReadLog {
    inner: MemDevice,
    reads: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl BlockDevice for ReadLog {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.reads.lock().unwrap().push((block, 1));
        self.inner.read(block, buf)
    }
    fn write(
        &self,
        block: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.inner.write(block, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        self.inner.flush()
    }
    fn stats(&self) -> quilt_block::IoStats {
        self.inner.stats()
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.reads
            .lock()
            .unwrap()
            .push((first, (buf.len() / self.inner.block_size()) as u64));
        self.inner.read_blocks(first, buf)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        quilt_block::write_each(self, first, buf, class)
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        quilt_block::Capabilities::default()
    }
}

#[test]
fn prefetch_reads_runs_in_one_request_and_never_replaces_a_newer_cached_block() {
    let dev = Arc::new(ReadLog {
        inner: MemDevice::new(BS, 64).unwrap(),
        reads: Default::default(),
    });
    for b in 0..64u64 {
        dev.inner
            .write(b, &[b as u8; BS], WriteClass::Data)
            .unwrap();
    }
    let e = Engine::new(dev.clone(), EngineOptions::default());
    let taken = || std::mem::take(&mut *dev.reads.lock().unwrap());
    // Block 14 is changed in the cache (not written back): its device copy is older.
    e.write(14, 0, &[0xee; 8], &[], NONE).unwrap();
    taken();
    e.prefetch(10, 10).unwrap();
    // 10..14 in one request, 14 cached, 15..20 in another.
    assert_eq!(taken(), vec![(10, 4), (15, 5)]);
    for b in 10..20u64 {
        let got = e.with_block(b, |d| d.to_vec()).unwrap();
        if b == 14 {
            assert_eq!(&got[..8], &[0xee; 8], "the newer cached copy stays");
            assert_eq!(got[8], 14);
        } else {
            assert_eq!(got, vec![b as u8; BS], "block {b}");
        }
    }
    assert!(taken().is_empty(), "every block was cached by the prefetch");
    // A run clipped at the device's end; a lone block through the ordinary path.
    e.prefetch(60, 10).unwrap();
    e.prefetch(30, 1).unwrap();
    assert_eq!(taken(), vec![(60, 4), (30, 1)]);
}
