//! The data log keeps what it acknowledged: every record appended before a completed
//! sync, and not trimmed by a trim that completed, is found again by recovery, in
//! order, with its data, in every crash state the recorded device history allows (a
//! prefix up to a flush, plus any subset of the writes after it); and recovery never
//! returns a record that was not appended.

use proptest::prelude::*;
use quilt_block::{BlockDevice, MemDevice, RecordingDevice};
use quilt_gnothi::datalog::{DataLog, DataLogError, Staged};
use quilt_gnothi::WriteId;
use std::collections::HashMap;
use std::sync::Arc;

const BS: usize = 512;
const REGION: (u64, u64) = (3, 34); // 32 ring blocks, after 3 blocks of something else
const DEV_BLOCKS: u64 = 40;

fn data(lsn_seed: u64, blocks: usize) -> Vec<u8> {
    (0..blocks * BS)
        .map(|i| (lsn_seed as usize * 31 + i * 7) as u8)
        .collect()
}

#[test]
fn records_come_back_after_a_reopen_and_trimmed_ones_do_not() {
    let dev = Arc::new(MemDevice::new(BS, DEV_BLOCKS).unwrap());
    let mut log = DataLog::format(dev.clone(), REGION.0, REGION.1).unwrap();
    let mut lsns = Vec::new();
    for i in 0..4u64 {
        let w = WriteId { client: 9, seq: i };
        lsns.push(log.append(w, 100 + i, &data(i, 1 + i as usize)).unwrap());
    }
    log.sync().unwrap();
    log.trim(lsns[1]).unwrap();
    drop(log);
    let (log, staged) = DataLog::open(dev.clone(), REGION.0, REGION.1).unwrap();
    let got: Vec<u64> = staged.iter().map(|s| s.lsn).collect();
    assert_eq!(got, lsns[1..].to_vec());
    assert_eq!(staged[2].data, data(3, 4));
    assert_eq!(staged[2].first, 103);
    assert_eq!(
        log.used(),
        (1 + 2) + (1 + 3) + (1 + 4),
        "a header and the data, each"
    );
}

#[test]
fn a_full_log_says_so_and_takes_records_again_after_a_trim() {
    let dev = Arc::new(MemDevice::new(BS, DEV_BLOCKS).unwrap());
    let mut log = DataLog::format(dev.clone(), REGION.0, REGION.1).unwrap();
    let w = |seq| WriteId { client: 1, seq };
    let mut n = 0u64;
    let first = loop {
        match log.append(w(n), n, &data(n, 4)) {
            Ok(lsn) => {
                if n == 0 {
                    n += 1;
                    continue;
                }
                n += 1;
                let _ = lsn;
            }
            Err(DataLogError::Full { .. }) => break n,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(first, 6, "32 ring blocks hold six records of 1 + 4 blocks");
    log.sync().unwrap();
    assert!(matches!(
        log.append(w(99), 0, &data(0, 40)),
        Err(DataLogError::TooLarge { .. })
    ));
    // Trim three: the next record wraps to the ring's start.
    log.trim(4).unwrap();
    let lsn = log.append(w(100), 7, &data(100, 4)).unwrap();
    log.sync().unwrap();
    let (_, staged) = DataLog::open(dev, REGION.0, REGION.1).unwrap();
    let got: Vec<u64> = staged.iter().map(|s| s.lsn).collect();
    assert_eq!(got, vec![4, 5, 6, lsn], "a wrap takes an lsn of its own");
    assert_eq!(staged[3].data, data(100, 4));
}

#[test]
fn bad_regions_and_blank_devices_are_refused() {
    let dev = Arc::new(MemDevice::new(BS, DEV_BLOCKS).unwrap());
    assert!(matches!(
        DataLog::format(dev.clone(), 30, 20),
        Err(DataLogError::Region { .. })
    ));
    assert!(matches!(
        DataLog::format(dev.clone(), 0, 3),
        Err(DataLogError::Region { .. })
    ));
    assert!(matches!(
        DataLog::open(dev.clone(), REGION.0, REGION.1),
        Err(DataLogError::NotFormatted)
    ));
    let mut log = DataLog::format(dev, REGION.0, REGION.1).unwrap();
    assert!(matches!(
        log.append(WriteId { client: 0, seq: 0 }, 0, &[0u8; 100]),
        Err(DataLogError::Unaligned { .. })
    ));
}

#[derive(Debug, Clone)]
enum Step {
    Append(usize),
    Sync,
    Trim(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1usize..6).prop_map(Step::Append),
        2 => Just(Step::Sync),
        1 => (1usize..3).prop_map(Step::Trim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_crash_state_keeps_what_was_acknowledged(
        steps in proptest::collection::vec(step(), 1..40),
        subset in proptest::collection::vec(any::<bool>(), 64),
    ) {
        let base = Arc::new(MemDevice::new(BS, DEV_BLOCKS).unwrap());
        DataLog::format(base.clone(), REGION.0, REGION.1).unwrap();
        let image = base.to_vec();
        let rec = Arc::new(RecordingDevice::new(
            Arc::new(MemDevice::from_bytes(BS, &image).unwrap()),
            1 << 26,
        ));
        let (mut log, staged) = DataLog::open(rec.clone(), REGION.0, REGION.1).unwrap();
        prop_assert!(staged.is_empty());
        let pos = || rec.log().entries.len();
        let mut appended: HashMap<u64, Staged> = HashMap::new();
        let mut unsynced: Vec<u64> = Vec::new();
        let mut live: Vec<u64> = Vec::new();
        // Per lsn: where the sync that made it durable ended, and where the trim that
        // let it go ended.
        let mut acked_at: HashMap<u64, usize> = HashMap::new();
        let mut trimmed_at: HashMap<u64, usize> = HashMap::new();
        for (i, s) in steps.iter().enumerate() {
            match s {
                Step::Append(blocks) => {
                    let w = WriteId { client: 1, seq: i as u64 };
                    let d = data(i as u64, *blocks);
                    match log.append(w, i as u64 * 10, &d) {
                        Ok(lsn) => {
                            appended.insert(lsn, Staged { lsn, write: w, first: i as u64 * 10, data: d });
                            unsynced.push(lsn);
                            live.push(lsn);
                        }
                        Err(DataLogError::Full { .. }) => {}
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Step::Sync => {
                    log.sync().unwrap();
                    let p = pos();
                    for lsn in unsynced.drain(..) {
                        acked_at.insert(lsn, p);
                    }
                }
                Step::Trim(k) => {
                    let k = (*k).min(live.len());
                    if k == 0 { continue; }
                    let upto = live.get(k).copied().unwrap_or(u64::MAX);
                    // Trim only what a replica would: records already durable.
                    if live[..k].iter().any(|l| !acked_at.contains_key(l)) { continue; }
                    log.trim(if upto == u64::MAX { live[k - 1] + 1 } else { upto }).unwrap();
                    let p = pos();
                    for lsn in live.drain(..k) {
                        trimmed_at.insert(lsn, p);
                    }
                }
            }
        }
        let history = rec.log();
        for len in history.crash_points() {
            let target = Arc::new(MemDevice::from_bytes(BS, &image).unwrap());
            // Of the writes after the last flush, those `subset` picks reached the disk.
            history.replay_subset(len, &*target, |i| subset[i % subset.len()]).unwrap();
            let (_, got) = DataLog::open(target as Arc<dyn BlockDevice>, REGION.0, REGION.1).unwrap();
            for w in got.windows(2) {
                prop_assert!(w[1].lsn > w[0].lsn, "lsns out of order at {}", len);
            }
            for g in &got {
                prop_assert_eq!(Some(g), appended.get(&g.lsn), "a record never appended, at {}", len);
            }
            // A sync that had returned before the crash promised its records; a trim
            // that had returned may have let its records go.
            for (lsn, &at) in &acked_at {
                let trimmed = trimmed_at.get(lsn).is_some_and(|&t| t <= len);
                if at <= len && !trimmed {
                    prop_assert!(got.iter().any(|g| g.lsn == *lsn), "acknowledged record {} lost at {}", lsn, len);
                }
            }
        }
    }
}
