//! The data log: where a replica makes a write's data durable before it answers
//! `Stored`, before the write's metadata is committed. Appends are sequential (one flush
//! covers a batch), and data reaches its home only once its version is committed, so
//! a write whose client died before the commit never overwrote anything
//! (`docs/design/gnothi.md` §4). Once the data of the oldest records is durable at
//! home, the replica trims them.
//!
//! Layout, in a region of the log device (little-endian, crc32c):
//! - blocks 0 and 1: two head slots, written alternately: `QGDH`, the slot's sequence
//!   number, the lsn and ring offset of the oldest live record, the log's instance, and
//!   the owner's mark (a number the owner keeps with the head: the replica, the log
//!   index up to which every write's data is durable at home). The valid slot with the
//!   higher sequence number wins, so a torn head write loses nothing.
//! - blocks 2..: the ring. A record is a header block (`QGDR`: lsn, instance, write id,
//!   first block, block count, data checksum, header checksum) and its data blocks; a
//!   record that does not fit before the ring's end is preceded by a wrap header
//!   (`QGDW`, its own lsn) and written at the ring's start. The instance (chosen at
//!   format) keeps records of an earlier log in the same place from being read as this
//!   one's.
//!
//! Recovery reads records from the head while each has the next lsn and its checksums
//! match: a torn record, or a stale one from an earlier lap, ends the log.

use crate::codec::{le32, le64};
use crate::table::WriteId;
use quilt_block::{BlockDevice, BlockError, WriteClass};
use std::collections::VecDeque;
use std::sync::Arc;

const HEAD_MAGIC: &[u8; 4] = b"QGDH";
const RECORD_MAGIC: &[u8; 4] = b"QGDR";
const WRAP_MAGIC: &[u8; 4] = b"QGDW";
/// Head slots before the ring.
const HEADS: u64 = 2;
/// The fewest ring blocks a data log may have.
const MIN_RING: u64 = 4;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataLogError {
    #[error(transparent)]
    Device(#[from] BlockError),
    #[error("the data log is full ({need} blocks wanted, {free} free): write data home and trim")]
    Full { need: u64, free: u64 },
    #[error("a record of {blocks} blocks can never fit the data log's ring of {ring}")]
    TooLarge { blocks: u64, ring: u64 },
    #[error("the data log's region ({len} blocks at {first}) is too small or outside the device ({count} blocks)")]
    Region { first: u64, len: u64, count: u64 },
    #[error("data of {len} bytes is not a whole number of {block_size}-byte blocks")]
    Unaligned { len: usize, block_size: usize },
    #[error("no data log here: neither head slot is valid")]
    NotFormatted,
}

pub type Result<T, E = DataLogError> = std::result::Result<T, E>;

/// A record found at recovery, or just appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    pub lsn: u64,
    pub write: WriteId,
    /// The volume block the data starts at.
    pub first: u64,
    pub data: Vec<u8>,
}

/// Where the records live: the ring offset and size of each, oldest first.
#[derive(Debug, Clone, Copy)]
struct Placed {
    lsn: u64,
    offset: u64,
    blocks: u64,
}

pub struct DataLog {
    dev: Arc<dyn BlockDevice>,
    first: u64,
    ring: u64,
    bs: usize,
    /// Live records (and wraps), oldest first.
    live: VecDeque<Placed>,
    /// Blocks they take.
    used: u64,
    /// The head: the oldest live record's lsn and offset.
    head: (u64, u64),
    /// Where the next record goes, and its lsn.
    tail: (u64, u64),
    head_seq: u64,
    instance: u64,
    mark: u64,
}

fn crc(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

impl DataLog {
    /// Makes an empty data log in `len` blocks from `first` of `dev`.
    pub fn format(dev: Arc<dyn BlockDevice>, first: u64, len: u64) -> Result<DataLog> {
        let mut log = DataLog::placed(dev, first, len)?;
        log.head = (1, 0);
        log.tail = (1, 0);
        // Unlike the last log formatted here (which would have to be formatted in the
        // same nanosecond by the same process id to collide).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        log.instance = nanos ^ (u64::from(std::process::id()) << 40) | 1;
        // Both slots, so neither holds a head from an earlier log here.
        log.write_head()?;
        log.write_head()?;
        Ok(log)
    }

    /// Opens the data log in `len` blocks from `first`, and returns the records a
    /// replica must still write home (oldest first).
    pub fn open(dev: Arc<dyn BlockDevice>, first: u64, len: u64) -> Result<(DataLog, Vec<Staged>)> {
        let mut log = DataLog::placed(dev, first, len)?;
        let mut best: Option<(u64, u64, u64, u64, u64)> = None;
        let mut b = vec![0u8; log.bs];
        for slot in 0..HEADS {
            log.dev.read(first + slot, &mut b)?;
            if &b[0..4] != HEAD_MAGIC || le32(&b, 44) != crc(&[&b[..44]]) {
                continue;
            }
            let (seq, lsn, off, inst) = (le64(&b, 4), le64(&b, 12), le64(&b, 20), le64(&b, 28));
            if off < log.ring && best.is_none_or(|(s, ..)| seq > s) {
                best = Some((seq, lsn, off, inst, le64(&b, 36)));
            }
        }
        let (seq, lsn, off, instance, mark) = best.ok_or(DataLogError::NotFormatted)?;
        log.head_seq = seq;
        log.mark = mark;
        log.instance = instance;
        log.head = (lsn, off);
        let mut staged = Vec::new();
        let (mut lsn, mut off) = (lsn, off);
        loop {
            if log.used >= log.ring {
                break;
            }
            let at = log.first + HEADS + off;
            if log.dev.read(at, &mut b).is_err() {
                break;
            }
            if le64(&b, 4) != lsn || le64(&b, 12) != log.instance {
                break;
            }
            if &b[0..4] == WRAP_MAGIC && le32(&b, 20) == crc(&[&b[..20]]) {
                log.place(Placed {
                    lsn,
                    offset: off,
                    blocks: log.ring - off,
                });
                lsn += 1;
                off = 0;
                continue;
            }
            if &b[0..4] != RECORD_MAGIC || le32(&b, 56) != crc(&[&b[..56]]) {
                break;
            }
            let write = WriteId {
                client: le64(&b, 20),
                seq: le64(&b, 28),
            };
            let (vol_first, count, data_crc) = (le64(&b, 36), le64(&b, 44), le32(&b, 52));
            if count == 0 || off + 1 + count > log.ring {
                break;
            }
            let mut data = vec![0u8; count as usize * log.bs];
            if quilt_block::read_each(&*log.dev, at + 1, &mut data).is_err()
                || crc(&[&data]) != data_crc
            {
                break;
            }
            log.place(Placed {
                lsn,
                offset: off,
                blocks: 1 + count,
            });
            staged.push(Staged {
                lsn,
                write,
                first: vol_first,
                data,
            });
            lsn += 1;
            off += 1 + count;
            if off == log.ring {
                off = 0;
            }
        }
        log.tail = (lsn, off);
        Ok((log, staged))
    }

    fn placed(dev: Arc<dyn BlockDevice>, first: u64, len: u64) -> Result<DataLog> {
        let count = dev.block_count();
        if len < HEADS + MIN_RING || first.checked_add(len).is_none_or(|end| end > count) {
            return Err(DataLogError::Region { first, len, count });
        }
        let bs = dev.block_size();
        Ok(DataLog {
            dev,
            first,
            ring: len - HEADS,
            bs,
            live: VecDeque::new(),
            used: 0,
            head: (1, 0),
            tail: (1, 0),
            head_seq: 0,
            instance: 0,
            mark: 0,
        })
    }

    /// Blocks the live records take (wraps included).
    pub fn used(&self) -> u64 {
        self.used
    }

    fn place(&mut self, p: Placed) {
        self.used += p.blocks;
        self.live.push_back(p);
    }

    /// The ring's size in blocks.
    pub fn ring_blocks(&self) -> u64 {
        self.ring
    }

    /// Appends a record of `data` (whole blocks) for `write`, starting at volume block
    /// `first`; durable once [`DataLog::sync`] returns. Its lsn is returned.
    pub fn append(&mut self, write: WriteId, first: u64, data: &[u8]) -> Result<u64> {
        if data.is_empty() || data.len() % self.bs != 0 {
            return Err(DataLogError::Unaligned {
                len: data.len(),
                block_size: self.bs,
            });
        }
        let count = (data.len() / self.bs) as u64;
        let need = 1 + count;
        if need > self.ring {
            return Err(DataLogError::TooLarge {
                blocks: need,
                ring: self.ring,
            });
        }
        let (lsn, off) = self.tail;
        let wrap = off + need > self.ring;
        let waste = if wrap { self.ring - off } else { 0 };
        let free = self.ring - self.used;
        if need + waste > free {
            return Err(DataLogError::Full {
                need: need + waste,
                free,
            });
        }
        let mut h = vec![0u8; self.bs];
        let (lsn, off) = if wrap {
            h[0..4].copy_from_slice(WRAP_MAGIC);
            h[4..12].copy_from_slice(&lsn.to_le_bytes());
            h[12..20].copy_from_slice(&self.instance.to_le_bytes());
            let c = crc(&[&h[..20]]);
            h[20..24].copy_from_slice(&c.to_le_bytes());
            self.dev
                .write(self.first + HEADS + off, &h, WriteClass::Metadata)?;
            self.place(Placed {
                lsn,
                offset: off,
                blocks: waste,
            });
            h.fill(0);
            (lsn + 1, 0)
        } else {
            (lsn, off)
        };
        h[0..4].copy_from_slice(RECORD_MAGIC);
        h[4..12].copy_from_slice(&lsn.to_le_bytes());
        h[12..20].copy_from_slice(&self.instance.to_le_bytes());
        h[20..28].copy_from_slice(&write.client.to_le_bytes());
        h[28..36].copy_from_slice(&write.seq.to_le_bytes());
        h[36..44].copy_from_slice(&first.to_le_bytes());
        h[44..52].copy_from_slice(&count.to_le_bytes());
        h[52..56].copy_from_slice(&crc(&[data]).to_le_bytes());
        let c = crc(&[&h[..56]]);
        h[56..60].copy_from_slice(&c.to_le_bytes());
        let at = self.first + HEADS + off;
        self.dev.write(at, &h, WriteClass::Metadata)?;
        self.dev.write_blocks(at + 1, data, WriteClass::Data)?;
        self.place(Placed {
            lsn,
            offset: off,
            blocks: need,
        });
        let next = off + need;
        self.tail = (lsn + 1, if next == self.ring { 0 } else { next });
        Ok(lsn)
    }

    /// The lsn the next record appended will get.
    pub fn next_lsn(&self) -> u64 {
        self.tail.0
    }

    /// Makes every record appended so far durable.
    pub fn sync(&self) -> Result<()> {
        Ok(self.dev.flush()?)
    }

    /// Lets go of the records before `lsn` (their data is durable at home): their room
    /// is reused once this returns (the new head is durable first).
    pub fn trim(&mut self, lsn: u64) -> Result<()> {
        self.trim_marked(lsn, self.mark)
    }

    /// Raises the owner's mark and makes it durable now (a head write and a flush),
    /// whether or not anything is trimmed.
    pub fn set_mark(&mut self, mark: u64) -> Result<()> {
        if mark > self.mark {
            self.mark = mark;
            self.write_head()?;
        }
        Ok(())
    }

    /// The owner's mark, as the last head written says.
    pub fn mark(&self) -> u64 {
        self.mark
    }

    /// [`DataLog::trim`], writing `mark` with the new head. When nothing is trimmed, no
    /// head is written and the mark stays: an owner whose mark must cover every record
    /// that is gone gets that, as records go only here.
    pub fn trim_marked(&mut self, lsn: u64, mark: u64) -> Result<()> {
        let mut moved = false;
        while self.live.front().is_some_and(|p| p.lsn < lsn) {
            if let Some(p) = self.live.pop_front() {
                self.used -= p.blocks;
            }
            moved = true;
        }
        if !moved {
            return Ok(());
        }
        self.mark = mark;
        self.head = match self.live.front() {
            Some(p) => (p.lsn, p.offset),
            None => self.tail,
        };
        // Written and flushed before the room it frees is reused: a crash in between
        // finds the old head, whose records are still intact.
        self.write_head()?;
        Ok(())
    }

    fn write_head(&mut self) -> Result<()> {
        self.head_seq += 1;
        let mut b = vec![0u8; self.bs];
        b[0..4].copy_from_slice(HEAD_MAGIC);
        b[4..12].copy_from_slice(&self.head_seq.to_le_bytes());
        b[12..20].copy_from_slice(&self.head.0.to_le_bytes());
        b[20..28].copy_from_slice(&self.head.1.to_le_bytes());
        b[28..36].copy_from_slice(&self.instance.to_le_bytes());
        b[36..44].copy_from_slice(&self.mark.to_le_bytes());
        let c = crc(&[&b[..44]]);
        b[44..48].copy_from_slice(&c.to_le_bytes());
        let slot = self.head_seq % HEADS;
        self.dev
            .write(self.first + slot, &b, WriteClass::Metadata)?;
        self.dev.flush()?;
        Ok(())
    }
}
