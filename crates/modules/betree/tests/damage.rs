//! Damaged images: random corruption of any block (headers, log, nodes, table) never
//! panics: opening and reading give data or a typed error. A torn header falls back to
//! the other one, and the tree it yields holds everything synced.

use quilt_betree::{Error, Options, Tree};
use quilt_block::{BlockDevice, BlockDeviceExt, LogEntry, MemDevice, RecordingDevice, WriteClass};
use std::collections::BTreeMap;
use std::sync::Arc;

const BS: usize = 512;

fn opts() -> Options {
    let mut o = Options::tiny();
    o.log_blocks = 64;
    o
}

/// An image with a tree of a few levels, checkpointed, then more batches in the log.
fn image() -> (Vec<u8>, BTreeMap<Vec<u8>, Vec<u8>>) {
    let dev = Arc::new(MemDevice::new(BS, 4096).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..1500u32 {
        let k = format!("k{:05}", (i * 7919) % 3000).into_bytes();
        let v = format!("value-{i}").into_bytes();
        t.put(&k, &v).unwrap();
        model.insert(k, v);
    }
    t.checkpoint().unwrap();
    for i in 0..40u32 {
        let k = format!("late{i:03}").into_bytes();
        t.put(&k, b"x").unwrap();
        model.insert(k, b"x".to_vec());
    }
    t.sync().unwrap();
    drop(t);
    (dev.to_vec(), model)
}

/// Opens and reads everything it can; any error must be a typed one (no panic).
fn exercise(img: &[u8]) -> Result<usize, Error> {
    let dev = Arc::new(MemDevice::from_bytes(BS, img).unwrap());
    let t = Tree::open(dev, opts())?;
    let mut n = 0;
    for e in t.range(b"", None) {
        e?;
        n += 1;
    }
    for e in t.range_rev(b"k01", Some(b"k02")) {
        e?;
    }
    t.get(b"k00007")?;
    t.put(b"new", b"value")?;
    t.check()?;
    Ok(n)
}

#[test]
fn corrupting_any_used_block_never_panics() {
    let (img, model) = image();
    assert_eq!(exercise(&img).unwrap(), model.len());
    let blocks = img.len() / BS;
    let used: Vec<usize> = (0..blocks)
        .filter(|&b| img[b * BS..(b + 1) * BS].iter().any(|&x| x != 0))
        .collect();
    assert!(used.len() > 50, "the image uses {} blocks", used.len());
    // A seeded stream: where and what to damage, the same in every run.
    let mut rng: rand_chacha::ChaCha8Rng = rand::SeedableRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
    let mut next = move || rand::RngCore::next_u64(&mut rng) >> 11;
    let (mut errors, mut fine) = (0, 0);
    for &b in &used {
        for round in 0..3 {
            let mut bad = img.clone();
            let block = &mut bad[b * BS..(b + 1) * BS];
            match round {
                // One flipped byte, a zeroed half (a torn write), random garbage.
                0 => block[(next() as usize) % BS] ^= 1 << (next() % 8),
                1 => block[BS / 2..].fill(0),
                _ => block.iter_mut().for_each(|x| *x = next() as u8),
            }
            match exercise(&bad) {
                Ok(_) => fine += 1,
                Err(
                    Error::Corrupt(_)
                    | Error::Checksum { .. }
                    | Error::NotFormatted
                    | Error::Failed(_),
                ) => errors += 1,
                Err(e) => panic!("block {b}, round {round}: unexpected error kind: {e}"),
            }
        }
    }
    // Most damage must be noticed; some lands where it does not matter (padding, the
    // older header, log blocks past the replayed ones).
    assert!(errors > used.len(), "{errors} errors, {fine} fine");
}

#[test]
fn a_torn_header_falls_back_to_the_other_one() {
    let dev = Arc::new(MemDevice::new(BS, 4096).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..400u32 {
        let k = format!("a{i:04}").into_bytes();
        t.put(&k, &i.to_le_bytes()).unwrap();
        model.insert(k, i.to_le_bytes().to_vec());
    }
    t.sync().unwrap();
    drop(t);
    let before = dev.to_vec();
    // Record the next checkpoint, which writes the other header slot.
    let rec = Arc::new(RecordingDevice::new(dev.clone(), 1 << 30));
    let t = Tree::open(rec.clone(), opts()).unwrap();
    for i in 0..200u32 {
        let k = format!("b{i:04}").into_bytes();
        t.put(&k, b"b").unwrap();
        model.insert(k, b"b".to_vec());
    }
    t.sync().unwrap();
    rec.mark("synced");
    t.checkpoint().unwrap();
    drop(t);
    let log = rec.take_log();
    let synced = log.mark_position("synced").unwrap();
    let header_writes: Vec<usize> = (synced..log.entries.len())
        .filter(|&i| matches!(&log.entries[i], LogEntry::Write { block, .. } if *block < 2))
        .collect();
    assert!(!header_writes.is_empty(), "the checkpoint wrote no header");
    for &h in &header_writes {
        // Everything up to the header write, then half of the new header over the old.
        let crash = MemDevice::from_bytes(BS, &before).unwrap();
        log.replay_prefix(h, &crash).unwrap();
        let LogEntry::Write { block, data, .. } = &log.entries[h] else {
            unreachable!()
        };
        let mut torn = vec![0u8; BS];
        crash.read(*block, &mut torn).unwrap();
        torn[..BS / 2].copy_from_slice(&data[..BS / 2]);
        crash.write(*block, &torn, WriteClass::Metadata).unwrap();
        let t = Tree::open(Arc::new(crash), opts()).unwrap();
        let got: BTreeMap<_, _> = t.range(b"", None).map(|e| e.unwrap()).collect();
        assert_eq!(got, model, "after a torn header at entry {h}");
        assert_eq!(
            t.damage(),
            Vec::<String>::new(),
            "a torn header is a crash, not damage"
        );
        t.check().unwrap();
    }
}

/// A tree cleanly closed after many checkpoints, its log having wrapped round its ring
/// several times; and which header slot holds the newest header.
fn closed_after_wraps() -> (Vec<u8>, BTreeMap<Vec<u8>, Vec<u8>>, usize) {
    let dev = Arc::new(MemDevice::new(BS, 4096).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..3000u32 {
        let k = format!("k{:05}", (i * 7919) % 2000).into_bytes();
        let v = format!("value-{i}-{}", "x".repeat((i % 40) as usize)).into_bytes();
        t.put(&k, &v).unwrap();
        model.insert(k, v);
        if i % 400 == 0 {
            t.checkpoint().unwrap();
        }
    }
    assert!(
        t.stats().log_blocks_written > 3 * 64,
        "the log did not wrap"
    );
    t.close().unwrap();
    let img = dev.to_vec();
    let generation = |slot: usize| {
        let b = &img[slot * BS..(slot + 1) * BS];
        u64::from_le_bytes(b[24..32].try_into().unwrap())
    };
    let newest = if generation(0) > generation(1) { 0 } else { 1 };
    (img, model, newest)
}

fn zeroed(img: &[u8], blocks: &[usize]) -> Vec<u8> {
    let mut bad = img.to_vec();
    for &b in blocks {
        bad[b * BS..(b + 1) * BS].fill(0);
    }
    bad
}

type Contents = BTreeMap<Vec<u8>, Vec<u8>>;

fn open_all(img: &[u8]) -> Result<(Tree, Contents), Error> {
    let t = Tree::open(Arc::new(MemDevice::from_bytes(BS, img).unwrap()), opts())?;
    let got = t.range(b"", None).collect::<Result<_, _>>()?;
    Ok((t, got))
}

/// One header block damaged loses nothing: the newest slot is read from the mirror,
/// the older slot and the mirror are not needed; the newest slot and the mirror are
/// reported, and a repair rewrites them. With the mirror lost as well, the older header cannot be brought up to
/// date (its log was overwritten): the open is refused, never rolled back.
#[test]
fn a_damaged_header_block_loses_nothing_and_is_reported() {
    let (img, model, newest) = closed_after_wraps();
    let mirror = img.len() / BS - 1;
    for (what, blocks) in [
        ("the newest slot", vec![newest]),
        ("the older slot", vec![1 - newest]),
        ("the mirror", vec![mirror]),
    ] {
        let (t, got) = open_all(&zeroed(&img, &blocks)).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got, model, "{what} zeroed");
        // (The older slot zeroed looks like what a crash tearing the next header's
        // write leaves: nothing is lost either way, and the next checkpoint writes it.)
        assert!(
            what == "the older slot" || !t.damage().is_empty(),
            "{what} zeroed: no damage reported"
        );
        t.repair_headers().unwrap();
        assert!(t.damage().is_empty());
        drop(t);
    }
}

/// The newest header and its mirror both lost (two blocks), after the log was written
/// past the older header's replay start: the older header cannot be brought up to
/// date, and the open says so instead of rolling the tree back.
#[test]
fn an_older_header_whose_log_was_overwritten_is_refused() {
    let dev = Arc::new(MemDevice::new(BS, 4096).unwrap());
    let t = Tree::create(dev.clone(), opts()).unwrap();
    // Values of 900 bytes: each synced put takes about two blocks of the 64-block ring.
    let mut i = 0u32;
    let mut puts = |t: &Tree, n: u32| {
        for _ in 0..n {
            t.put(format!("k{i:06}").as_bytes(), &[7u8; 900]).unwrap();
            t.sync().unwrap();
            i += 1;
        }
    };
    // Checkpoint A (the older header), about 36 blocks of log, checkpoint B (the
    // newest), then about 40 more: the log now overwrites what A's replay would read.
    puts(&t, 5);
    t.checkpoint().unwrap();
    puts(&t, 18);
    t.checkpoint().unwrap();
    let checkpoints = t.stats().checkpoints;
    puts(&t, 20);
    assert_eq!(
        t.stats().checkpoints,
        checkpoints,
        "a checkpoint came in between"
    );
    drop(t); // a crash: no close
    let img = dev.to_vec();
    let generation =
        |slot: usize| u64::from_le_bytes(img[slot * BS + 24..slot * BS + 32].try_into().unwrap());
    let newest = if generation(0) > generation(1) { 0 } else { 1 };
    let mirror = img.len() / BS - 1;
    assert!(open_all(&img).is_ok());
    match open_all(&zeroed(&img, &[newest, mirror])) {
        Err(Error::Corrupt(m)) => assert!(m.contains("newer header was lost"), "{m}"),
        Err(e) => panic!("refused with {e:?}"),
        Ok((_, got)) => panic!(
            "opened the older header ({} keys): a silent rollback",
            got.len()
        ),
    }
}

#[test]
fn a_damaged_node_is_a_typed_error_and_other_reads_go_on() {
    let (img, _) = image();
    // One block of the node area damaged at a time, until one lands in a node that the
    // open does not read (a leaf's basement): the open succeeds, the reads that need
    // the block fail with a typed error, the others go on.
    let keys: Vec<Vec<u8>> = (0..3000u32)
        .map(|i| format!("k{i:05}").into_bytes())
        .collect();
    let mut seen = 0;
    for b in 70..(img.len() / BS) as u64 {
        let at = b as usize * BS;
        if img[at..at + BS].iter().all(|&x| x == 0) {
            continue;
        }
        let mut bad = img.clone();
        bad[at + 40] ^= 0xff;
        let dev = Arc::new(MemDevice::from_bytes(BS, &bad).unwrap());
        let t = match Tree::open(dev, opts()) {
            Err(e) if e.is_damage() => continue, // the table or a node the open reads
            Err(e) => panic!("block {b}: unexpected error: {e}"),
            Ok(t) => t,
        };
        let (mut ok, mut corrupt) = (0, 0);
        for k in &keys {
            match t.get(k) {
                Ok(_) => ok += 1,
                Err(e) if e.is_damage() => corrupt += 1,
                Err(e) => panic!("block {b}: unexpected error: {e}"),
            }
        }
        if corrupt > 0 {
            assert!(ok > 0, "block {b}: one damaged block failed every read");
            seen += 1;
            if seen == 3 {
                return;
            }
        }
    }
    panic!("no damaged block was noticed by a read ({seen} were)");
}
