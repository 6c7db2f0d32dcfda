//! The journal modes' recovery checked against a model of the journal: the run keeps
//! every transaction as the journal committed it (its sequence, its blocks' contents,
//! its revokes; `quilt_journal::Observer`), and the history holds the marks
//! `journal-write SEQ` and `journal-durable SEQ`. A crash state must recover to the
//! state with exactly the transactions from the journal's tail through some K replayed,
//! in order, where K is at least the last transaction durable before the cut and at
//! most the last one whose write had begun: every block outside the journal equals
//! what the crash left, overlaid with the newest image among transactions tail..=K that
//! no transaction up to K revoked after it. A torn or misplaced record that recovery
//! replayed, a committed one it missed, or transactions out of order make every K
//! disagree. The model parses nothing of the log: only the journal superblock's tail.

use quilt_block::{BlockDevice, LogEntry, MemDevice, RecordingLog};
use quilt_journal::JournalSuper;
use std::collections::{BTreeMap, HashMap, HashSet};

/// One committed transaction, as the journal saw it.
#[derive(Debug, Clone)]
pub struct Txn {
    pub blocks: Vec<(u64, Vec<u8>)>,
    pub revoked: Vec<u64>,
}

/// The transactions of a run, by sequence.
pub type Txns = BTreeMap<u32, Txn>;

/// The greatest SEQ of the marks `{prefix} SEQ` among the first `len` entries.
fn last_mark(log: &RecordingLog, len: usize, prefix: &str) -> Option<u32> {
    log.entries[..len.min(log.entries.len())]
        .iter()
        .filter_map(|e| match e {
            LogEntry::Mark(m) => m.strip_prefix(prefix)?.trim().parse::<u32>().ok(),
            _ => None,
        })
        .max()
}

/// The bounds on K at the cuts `lens` (cuts that leave the same image: the strictest of
/// each bound): the last transaction durable at the cut, the last begun.
pub fn bounds(log: &RecordingLog, lens: &[usize]) -> (Option<u32>, Option<u32>) {
    let lo = lens
        .iter()
        .filter_map(|&l| last_mark(log, l, "journal-durable "))
        .max();
    let hi = lens
        .iter()
        .filter_map(|&l| last_mark(log, l, "journal-write "))
        .max();
    (lo, hi)
}

fn block(img: &[u8], bs: usize, b: u64) -> &[u8] {
    let at = b as usize * bs;
    &img[at..at + bs]
}

/// Checks the recovery of crash image `img` (an ext3 image with its journal in inode 8)
/// against the model. `lo`, `hi`: the bounds on K. Returns what is wrong, if anything.
pub fn check(
    img: &[u8],
    bs: usize,
    txns: &Txns,
    lo: Option<u32>,
    hi: Option<u32>,
) -> Option<String> {
    let dev = MemDevice::from_bytes(bs, img).ok()?;
    let sb = {
        let mut b = vec![0u8; bs];
        dev.read(1024 / bs as u64, &mut b).ok()?;
        let off = 1024 % bs;
        match quilt_ext2::format::Superblock::decode(&b[off..off + 1024]) {
            Ok(sb) => sb,
            Err(e) => return Some(format!("the crash state's superblock: {e}")),
        }
    };
    let map = match quilt_ext2::journal::journal_map(&dev, &sb) {
        Ok(m) => m,
        Err(e) => return Some(format!("the crash state's journal: {e}")),
    };
    let jsb = {
        let mut b = vec![0u8; bs];
        dev.read(map.device_block(0).ok()?, &mut b).ok()?;
        match JournalSuper::decode(&b, bs as u32, map.len()) {
            Ok(j) => j,
            Err(e) => return Some(format!("the crash state's journal superblock: {e}")),
        }
    };
    // Our replay, at the journal layer alone.
    let report = if jsb.start != 0 {
        match quilt_journal::recover(&dev, &map) {
            Ok(r) => Some(r),
            Err(e) => return Some(format!("our replay failed: {e}")),
        }
    } else {
        None
    };
    let recovered = dev.to_vec();
    let tail = jsb.sequence;
    let before_tail = tail.wrapping_sub(1);
    // K = tail - 1: nothing replayed.
    let lo_k = lo.map_or(before_tail, |l| l.max(before_tail));
    let hi_k = if jsb.start == 0 {
        before_tail
    } else {
        hi.map_or(before_tail, |h| h.max(before_tail))
    };
    if lo_k > hi_k {
        return Some(format!(
            "transaction {lo_k} was durable at the cut but the journal's tail ({tail}) leaves nothing after {hi_k} to replay"
        ));
    }
    let journal: HashSet<u64> = map.blocks.iter().copied().collect();
    // Blocks some transaction of the range may have changed; every other block outside
    // the journal must be as the crash left it.
    let mut touched: HashSet<u64> = HashSet::new();
    for s in tail..=hi_k {
        let Some(t) = txns.get(&s) else {
            return Some(format!(
                "the journal's tail names transaction {s}, which the run never committed"
            ));
        };
        touched.extend(t.blocks.iter().map(|(b, _)| *b));
    }
    let blocks = (img.len() / bs) as u64;
    for b in 0..blocks {
        if !journal.contains(&b)
            && !touched.contains(&b)
            && block(img, bs, b) != block(&recovered, bs, b)
        {
            return Some(format!(
                "recovery changed block {b}, which no transaction from the tail ({tail}) through {hi_k} logged"
            ));
        }
    }
    let ours = report.map(|r| r.next_sequence.wrapping_sub(1));
    let mut first_diff = None;
    for k in lo_k..=hi_k {
        // The newest image of each block among tail..=k, unless revoked at or after it.
        let mut expect: HashMap<u64, (u32, &[u8])> = HashMap::new();
        let mut revoked: HashMap<u64, u32> = HashMap::new();
        for s in tail..=k {
            let t = &txns[&s];
            for (b, d) in &t.blocks {
                expect.insert(*b, (s, d));
            }
            for &r in &t.revoked {
                revoked.insert(r, s);
            }
        }
        let mismatch = touched.iter().find_map(|&b| {
            if journal.contains(&b) {
                return None;
            }
            let want: &[u8] = match expect.get(&b) {
                Some(&(s, d)) if revoked.get(&b).is_none_or(|&r| r < s) => d,
                _ => block(img, bs, b),
            };
            (want != block(&recovered, bs, b)).then_some(b)
        });
        match mismatch {
            None => return None,
            Some(b) if Some(k) == ours || first_diff.is_none() => first_diff = Some((k, b)),
            Some(_) => {}
        }
    }
    let (k, b) = first_diff?;
    Some(format!(
        "recovery (through {}) matches no prefix of the committed transactions: tail {tail}, durable through {lo_k}, begun through {hi_k}; with K = {k}, block {b} differs",
        ours.map_or("nothing".to_string(), |o| o.to_string())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_block::RecordingDevice;
    use quilt_ext2::{JournalPlacement, MkfsOptions, Mode, MountOptions};
    use quilt_patch::EngineOptions;
    use quilt_vfs::{Ctx, FileSystem};
    use std::sync::{Arc, Mutex};

    const BS: usize = 4096;

    /// A run of three fsynced files in full-journal mode with skip records: the crash
    /// image at the end of the history, the transactions, the bounds there.
    fn run() -> (Vec<u8>, Txns, Option<u32>, Option<u32>) {
        let mem = Arc::new(MemDevice::new(BS, 4096).unwrap());
        let (engine, _) = quilt_stack::mkfs_ext2(
            mem.clone(),
            EngineOptions::default(),
            &MkfsOptions {
                device_is_zeroed: true,
                inodes: Some(256),
                ..Default::default()
            },
        )
        .unwrap();
        quilt_stack::add_journal(engine, 1024, true).unwrap();
        let base = mem.to_vec();
        let rec = Arc::new(RecordingDevice::new(mem.clone(), 1 << 28));
        let txns = Arc::new(Mutex::new(Txns::new()));
        let sink = txns.clone();
        let fs = quilt_stack::ext2(
            rec.clone(),
            quilt_stack::Ext2Spec::mount(MountOptions {
                mode: Mode::FullJournal,
                journal_placement: Some(JournalPlacement::Skip),
                journal_observer: Some(quilt_journal::Observer(Arc::new(move |seq, b, r| {
                    let t = Txn {
                        blocks: b.iter().map(|(n, d)| (*n, d.to_vec())).collect(),
                        revoked: r.to_vec(),
                    };
                    sink.lock().unwrap().insert(seq, t);
                }))),
                ..Default::default()
            }),
        )
        .unwrap();
        let c = Ctx::root();
        for i in 0..3u8 {
            let f = fs
                .mknod(fs.root(), &[b'f', b'0' + i], 0o100644, 0, &c)
                .unwrap()
                .ino;
            fs.write(f, 0, &vec![i + 1; 10_000], &c).unwrap();
            fs.fsync(f, false).unwrap();
        }
        let log = rec.take_log();
        drop(fs);
        let img = MemDevice::from_bytes(BS, &base).unwrap();
        log.replay_subset(log.entries.len(), &img, |_| true)
            .unwrap();
        let (lo, hi) = bounds(&log, &[log.entries.len()]);
        let t = std::mem::take(&mut *txns.lock().unwrap());
        (img.to_vec(), t, lo, hi)
    }

    #[test]
    fn a_whole_history_recovers_to_its_committed_transactions() {
        let (img, txns, lo, hi) = run();
        assert!(
            lo.is_some() && lo == hi,
            "every commit durable: {lo:?} {hi:?}"
        );
        assert_eq!(check(&img, BS, &txns, lo, hi), None);
    }

    #[test]
    fn a_lost_durable_record_is_caught() {
        let (mut img, txns, lo, hi) = run();
        // Every record gone (the journal's blocks zeroed but its superblock): recovery
        // replays nothing, though the transactions were durable.
        let dev = MemDevice::from_bytes(BS, &img).unwrap();
        let mut b = vec![0u8; BS];
        dev.read(0, &mut b).unwrap();
        let sb = quilt_ext2::format::Superblock::decode(&b[1024..2048]).unwrap();
        let map = quilt_ext2::journal::journal_map(&dev, &sb).unwrap();
        for &blk in &map.blocks[1..] {
            img[blk as usize * BS..(blk as usize + 1) * BS].fill(0);
        }
        let what = check(&img, BS, &txns, lo, hi).expect("a lost transaction must be reported");
        assert!(what.contains("matches no prefix"), "{what}");
    }

    #[test]
    fn a_replay_of_other_contents_is_caught() {
        let (img, mut txns, lo, hi) = run();
        // The model says the last transaction held other contents than the log does:
        // what recovery wrote matches no prefix.
        let last = txns.values_mut().last().unwrap();
        last.blocks.last_mut().unwrap().1[100] ^= 0xff;
        assert!(check(&img, BS, &txns, lo, hi).is_some());
    }
}
