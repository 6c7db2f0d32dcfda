//! Recovery: replays the committed transactions a journal holds, as the kernel's jbd2 and
//! e2fsck do, in three passes over the log from `start`. SCAN finds where the committed
//! log ends (a transaction counts only once its commit block is there); REVOKE collects
//! each revoked block with the newest transaction that revoked it; REPLAY writes every
//! journal copy to its home block unless a transaction at least as new revoked it. Then
//! the journal is marked empty (`start = 0`) with the next sequence number.
//!
//! A journal written with log skipping (`skip.rs`) is read by a scan of its whole area
//! instead: its committed records, in sequence order from the superblock's, replayed the
//! same way.
//!
//! Works on the device directly, before any cache holds its blocks.

use crate::format::{
    commit_checksum, parse_descriptor, parse_revoke, seq_after, Header, JournalSuper, Tag,
    TxnChecksum, BLOCK_COMMIT, BLOCK_DESCRIPTOR, BLOCK_REVOKE, CHECKSUM_CRC32, COMPAT_CHECKSUM,
    MAGIC,
};
use crate::{JournalError, JournalMap, Result};
use quilt_block::BlockDevice;
use quilt_block::WriteClass;
use rustc_hash::FxHashMap as HashMap;

/// What a recovery did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Committed transactions found (and replayed).
    pub transactions: u32,
    /// Journal copies written to their home blocks.
    pub blocks_replayed: u64,
    /// Journal copies skipped because a newer transaction revoked their block.
    pub blocks_revoked: u64,
    /// The sequence number the next transaction gets.
    pub next_sequence: u32,
}

/// One transaction's records, in log order.
#[derive(Default)]
struct Txn {
    /// (home block, journal block of the copy, escaped)
    copies: Vec<(u64, u32, bool)>,
    revoked: Vec<u64>,
}

struct Log<'a> {
    dev: &'a dyn BlockDevice,
    map: &'a JournalMap,
    sb: JournalSuper,
}

impl Log<'_> {
    fn read(&self, j: u32) -> Result<Vec<u8>> {
        let mut b = vec![0u8; self.dev.block_size()];
        self.dev.read(self.map.device_block(j)?, &mut b)?;
        Ok(b)
    }

    fn next(&self, j: u32) -> u32 {
        if j + 1 >= self.sb.maxlen {
            self.sb.first
        } else {
            j + 1
        }
    }

    /// The committed transactions from `start` on (SCAN), with their records.
    fn scan(&self) -> Result<Vec<(u32, Txn)>> {
        let mut out = Vec::new();
        let mut pos = self.sb.start;
        let mut seq = self.sb.sequence;
        let mut cur = Txn::default();
        // Every log block is visited at most once per pass: a log longer than the ring
        // is a damaged one.
        let mut budget = (self.sb.maxlen - self.sb.first) as u64;
        let incompat = self.sb.feature_incompat;
        // journal_checksum: a commit whose CRC does not match its transaction ends the
        // log there, as in e2fsck (a torn commit).
        let checksummed = self.sb.feature_compat & COMPAT_CHECKSUM != 0;
        let mut crc = TxnChecksum::default();
        loop {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let b = self.read(pos)?;
            let Some(h) = Header::parse(&b) else { break };
            if h.sequence != seq {
                break;
            }
            match h.blocktype {
                BLOCK_DESCRIPTOR => {
                    let tags: Vec<Tag> = parse_descriptor(&b, incompat)?;
                    if checksummed {
                        crc.update(&b);
                    }
                    let mut p = self.next(pos);
                    for t in tags {
                        if budget == 0 {
                            return Ok(out);
                        }
                        budget -= 1;
                        if checksummed {
                            crc.update(&self.read(p)?);
                        }
                        cur.copies.push((t.block, p, t.escaped));
                        p = self.next(p);
                    }
                    pos = p;
                    continue;
                }
                BLOCK_REVOKE => cur.revoked.extend(parse_revoke(&b, incompat)?),
                BLOCK_COMMIT => {
                    if checksummed {
                        let want = std::mem::take(&mut crc).value();
                        match commit_checksum(&b) {
                            None => {}
                            Some((CHECKSUM_CRC32, v)) if v == want => {}
                            Some(_) => break,
                        }
                    }
                    out.push((seq, std::mem::take(&mut cur)));
                    seq = seq.wrapping_add(1);
                }
                _ => break,
            }
            pos = self.next(pos);
        }
        Ok(out)
    }
}

/// Replays the journal at `map` on `dev` if it holds committed transactions, then marks
/// it empty. Returns what it did (nothing when `start` is 0).
pub fn recover(dev: &dyn BlockDevice, map: &JournalMap) -> Result<RecoveryReport> {
    recover_on(dev, dev, map)
}

/// As `recover`, for a journal on a device of its own (`jdev`, which `map` maps into):
/// the copies go home to `home`, which is flushed before the journal is marked empty.
pub fn recover_on(
    home: &dyn BlockDevice,
    jdev: &dyn BlockDevice,
    map: &JournalMap,
) -> Result<RecoveryReport> {
    let dev = jdev;
    let bs = dev.block_size();
    let mut raw = vec![0u8; bs];
    dev.read(map.device_block(0)?, &mut raw)?;
    let sb = JournalSuper::decode(&raw, bs as u32, map.len())?;
    sb.check_readable()?;
    if sb.start == 0 {
        return Ok(RecoveryReport {
            next_sequence: sb.sequence,
            ..Default::default()
        });
    }
    let log = Log {
        dev,
        map,
        sb: sb.clone(),
    };
    let txns: Vec<(u32, Txn)> = if crate::skip::is_skip(&sb) {
        // Skip records: wherever they landed in the area (`skip.rs`).
        crate::skip::committed(crate::skip::scan(dev, map, &sb)?, &sb)
            .into_iter()
            .map(|f| {
                (
                    f.seq,
                    Txn {
                        copies: f.copies,
                        revoked: f.revoked,
                    },
                )
            })
            .collect()
    } else {
        log.scan()?
    };
    let mut revoked: HashMap<u64, u32> = HashMap::default();
    for (seq, t) in &txns {
        for &b in &t.revoked {
            let e = revoked.entry(b).or_insert(*seq);
            if seq_after(*seq, *e) {
                *e = *seq;
            }
        }
    }
    let mut report = RecoveryReport {
        transactions: txns.len() as u32,
        ..Default::default()
    };
    let count = home.block_count();
    for (seq, t) in &txns {
        for &(hb, j, escaped) in &t.copies {
            if revoked.get(&hb).is_some_and(|&r| !seq_after(*seq, r)) {
                report.blocks_revoked += 1;
                continue;
            }
            if hb >= count {
                return Err(JournalError::Corrupt(format!(
                    "transaction {seq} logs block {hb}, past the device's end ({count})"
                )));
            }
            let mut data = log.read(j)?;
            if escaped {
                if crate::skip::is_skip(&sb) {
                    data[0..4].copy_from_slice(&crate::skip::MAGIC.to_le_bytes());
                } else {
                    data[0..4].copy_from_slice(&MAGIC.to_be_bytes());
                }
            }
            self::home_write(home, hb, &data)?;
            report.blocks_replayed += 1;
        }
    }
    home.flush()?;
    let next = txns.last().map_or(sb.sequence, |(s, _)| s.wrapping_add(1));
    let mut clean = sb;
    clean.sequence = next;
    clean.start = 0;
    // Empty now: a plain JBD2 journal again, which the kernel may use.
    clean.feature_incompat &= !crate::skip::INCOMPAT_SKIP;
    clean.encode_into(&mut raw);
    dev.write(map.device_block(0)?, &raw, WriteClass::Metadata)?;
    dev.flush()?;
    report.next_sequence = next;
    Ok(report)
}

fn home_write(home: &dyn BlockDevice, block: u64, data: &[u8]) -> Result<()> {
    home.write(block, data, WriteClass::Metadata)?;
    Ok(())
}
