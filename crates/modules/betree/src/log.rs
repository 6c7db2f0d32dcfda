//! The redo log: every batch is one record (length, crc32c, first MSN, operations) in a
//! byte stream cut into log blocks. The region is a ring of blocks; a block's place is
//! `log_first + lsn % log_blocks`. The stream is never restarted while the tree runs: a
//! checkpoint's header names the exact stream position of the first record it does not
//! hold (its block and offset, in the middle of a block if need be), so records logged
//! while a checkpoint is in flight are replayed after either header. The ring's start
//! moves up to a header's replay start only once that header is durable: a block never
//! overwrites one that the durable header's replay still reads. (Recovery restarts the
//! stream at a fresh block after what it replayed, and checkpoints before any new
//! record, so that no record ever follows a torn one.)

use crate::codec::{crc32c, crc_ok, Reader, Writer};
use crate::format::{LogBlock, LOG_HDR};
use crate::msg::Msn;
use crate::{Op, Result};
use quilt_block::BlockNo;
use quilt_patch::{ChangeOpts, Engine, PatchId};
use std::sync::Arc;

/// The first MSN a bind record carries in place of a batch's (no batch reaches it:
/// MSNs stay below `format::COUNTER_LIMIT`).
pub const BIND_MSN: Msn = u64::MAX;

/// A put logged by reference: the value's length and checksum stand in for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Late {
    /// The operation's place in its record.
    pub index: usize,
    pub len: u32,
    pub crc: u32,
}

/// Encodes `ops`; a put whose value is at least `late_min` bytes is logged by
/// reference (kind 7: key, value length, value crc32c).
pub fn encode_ops(w: &mut Writer, ops: &[Op], late_min: usize) {
    for op in ops {
        match op {
            Op::Put { key, value } if value.len() >= late_min => {
                w.u8(7);
                w.bytes(key);
                w.u32(value.len() as u32);
                w.u32(crc32c(&[value]));
            }
            Op::Put { key, value } => {
                w.u8(1);
                w.bytes(key);
                w.bytes(value);
            }
            Op::Delete { key } => {
                w.u8(2);
                w.bytes(key);
            }
            Op::Upsert { key, func, arg } => {
                w.u8(3);
                w.bytes(key);
                w.u16(*func);
                w.bytes(arg);
            }
            Op::DeleteRange { start, end } => {
                w.u8(4);
                w.bytes(start);
                w.bytes(end);
            }
            Op::RenamePrefix { from, to } => {
                w.u8(5);
                w.bytes(from);
                w.bytes(to);
            }
            Op::CloneRange {
                from,
                to,
                start,
                end,
            } => {
                w.u8(6);
                w.bytes(from);
                w.bytes(to);
                w.bytes(start);
                match end {
                    Some(e) => {
                        w.u8(1);
                        w.bytes(e);
                    }
                    None => w.u8(0),
                }
            }
        }
    }
}

/// Decodes `n` operations; a put by reference becomes a put of no bytes, listed in
/// the second vector.
fn decode_ops(r: &mut Reader, n: usize) -> Result<(Vec<Op>, Vec<Late>)> {
    let mut ops = Vec::with_capacity(n.min(r.remaining()));
    let mut late = Vec::new();
    for index in 0..n {
        ops.push(match r.u8()? {
            7 => {
                let key = r.bytes()?.to_vec();
                let len = r.u32()?;
                let crc = r.u32()?;
                late.push(Late { index, len, crc });
                Op::Put {
                    key,
                    value: Vec::new(),
                }
            }
            1 => Op::Put {
                key: r.bytes()?.to_vec(),
                value: r.bytes()?.to_vec(),
            },
            2 => Op::Delete {
                key: r.bytes()?.to_vec(),
            },
            3 => {
                let key = r.bytes()?.to_vec();
                let func = r.u16()?;
                Op::Upsert {
                    key,
                    func,
                    arg: r.bytes()?.to_vec(),
                }
            }
            4 => Op::DeleteRange {
                start: r.bytes()?.to_vec(),
                end: r.bytes()?.to_vec(),
            },
            5 => Op::RenamePrefix {
                from: r.bytes()?.to_vec(),
                to: r.bytes()?.to_vec(),
            },
            6 => {
                let from = r.bytes()?.to_vec();
                let to = r.bytes()?.to_vec();
                let start = r.bytes()?.to_vec();
                let end = match r.u8()? {
                    0 => None,
                    1 => Some(r.bytes()?.to_vec()),
                    k => return Err(r.corrupt(format!("clone range end tag {k}"))),
                };
                Op::CloneRange {
                    from,
                    to,
                    start,
                    end,
                }
            }
            k => return Err(r.corrupt(format!("unknown operation {k}"))),
        });
    }
    Ok((ops, late))
}

fn frame(p: Writer) -> Vec<u8> {
    let mut w = Writer::with_capacity(p.len() + 8);
    w.u32(p.len() as u32);
    w.u32(crc32c(&[&p.buf]));
    w.raw(&p.buf);
    w.buf
}

/// One batch as a framed record, its puts of at least `late_min` bytes by reference.
pub fn record(msn: Msn, ops: &[Op], late_min: usize) -> Vec<u8> {
    let mut p = Writer::default();
    p.u64(msn);
    p.u32(ops.len() as u32);
    encode_ops(&mut p, ops, late_min);
    frame(p)
}

/// A bind record: the values of puts logged by reference, by MSN. Its first MSN is
/// `BIND_MSN`, then a count and each (MSN, value bytes).
pub fn bind_record(values: &[(Msn, Arc<Vec<u8>>)]) -> Vec<u8> {
    let mut p = Writer::with_capacity(12 + values.iter().map(|(_, v)| v.len() + 12).sum::<usize>());
    p.u64(BIND_MSN);
    p.u32(values.len() as u32);
    for (msn, v) in values {
        p.u64(*msn);
        p.bytes(v);
    }
    frame(p)
}

/// The log as the running tree writes it.
#[derive(Debug)]
pub struct LogWriter {
    pub instance: u64,
    pub first: BlockNo,
    pub blocks: u64,
    /// Replay start of the newest durable checkpoint: the ring holds what its replay
    /// reads from here on.
    pub start_lsn: u64,
    /// The block being filled, its stream offset and data.
    pub tail_lsn: u64,
    pub tail_offset: u64,
    pub tail: Vec<u8>,
    /// Bytes of `tail` already handed to the engine.
    pub tail_written: usize,
    /// Log block patches not yet known durable.
    pub pending: Vec<PatchId>,
    pub blocks_written: u64,
    pub bytes: u64,
}

impl LogWriter {
    pub fn cap(bs: usize) -> usize {
        bs - LOG_HDR
    }

    /// Blocks the ring still has room for before a checkpoint must move the start.
    pub fn room(&self) -> u64 {
        // One block stays unused, so the ring never wraps onto its own start.
        (self.blocks - 1).saturating_sub(self.tail_lsn - self.start_lsn + 1)
    }

    /// Blocks a record of `len` bytes needs past the tail.
    pub fn blocks_for(&self, len: usize, bs: usize) -> u64 {
        let cap = Self::cap(bs);
        let free_in_tail = cap - self.tail.len();
        if len <= free_in_tail {
            0
        } else {
            (len - free_in_tail).div_ceil(cap) as u64
        }
    }

    pub fn append(&mut self, engine: &Engine, rec: &[u8]) -> Result<()> {
        let cap = Self::cap(engine.block_size());
        let mut rest = rec;
        while !rest.is_empty() {
            let n = rest.len().min(cap - self.tail.len());
            self.tail.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if self.tail.len() == cap {
                self.write_tail(engine)?;
                self.tail_offset += cap as u64;
                self.tail_lsn += 1;
                self.tail.clear();
                self.tail_written = 0;
            }
        }
        self.bytes += rec.len() as u64;
        Ok(())
    }

    /// Hands the tail block (as filled so far) to the engine.
    pub fn write_tail(&mut self, engine: &Engine) -> Result<()> {
        if self.tail.len() == self.tail_written {
            return Ok(());
        }
        let bs = engine.block_size();
        let block = LogBlock {
            instance: self.instance,
            lsn: self.tail_lsn,
            offset: self.tail_offset,
            data: &self.tail,
        }
        .encode(bs);
        let at = self.first + self.tail_lsn % self.blocks;
        let p = engine.write(at, 0, &block, &[], ChangeOpts::default())?;
        self.pending.push(p);
        self.tail_written = self.tail.len();
        self.blocks_written += 1;
        Ok(())
    }

    /// For a clean shutdown, just before its final checkpoint: the stream goes on at the
    /// next fresh block, so the header names a block's start and the next open finds
    /// nothing to replay there (no checkpoint at open). The partial tail's records are
    /// the checkpoint's; they stay readable in the log for an older header.
    pub fn skip_to_fresh_block(&mut self) {
        if !self.tail.is_empty() {
            self.tail_offset += self.tail.len() as u64;
            self.tail_lsn += 1;
            self.tail.clear();
            self.tail_written = 0;
        }
    }

    /// Where the next record will start: its block and stream offset (a checkpoint's
    /// replay start).
    pub fn position(&self) -> (u64, u64) {
        (self.tail_lsn, self.tail_offset + self.tail.len() as u64)
    }
}

/// A record found by replay: a batch (its puts by reference listed in `late`, their
/// values empty), or (`msn` = `BIND_MSN`, no ops) the values that bind such puts.
pub struct Replayed {
    pub msn: Msn,
    pub ops: Vec<Op>,
    pub late: Vec<Late>,
    pub binds: Vec<(Msn, Vec<u8>)>,
}

/// Reads the log from `lsn` (data at stream offset `offset`) and returns its complete
/// records, in order. Stops at the first block that is missing, damaged, of another
/// tree, or does not continue the stream; then at the first incomplete or damaged record.
pub fn replay(
    engine: &Engine,
    instance: u64,
    first: BlockNo,
    blocks: u64,
    mut lsn: u64,
    mut offset: u64,
) -> Result<Replay> {
    let cap = LogWriter::cap(engine.block_size());
    let start = lsn;
    let mut stream = Vec::new();
    let mut future = None;
    while lsn - start < blocks - 1 {
        let raw = engine.read(first + lsn % blocks)?;
        let Some(b) = LogBlock::decode(&raw) else {
            break;
        };
        if b.instance == instance && b.lsn > lsn {
            // Written on a later lap of the ring: the stream went past here, which only a
            // newer checkpoint's header allows. The header replay started from is not
            // the newest.
            future = Some(b.lsn);
            break;
        }
        // The first block may hold records the checkpoint already has, before `offset`;
        // each later block continues the stream exactly.
        let skip = if lsn == start {
            offset.checked_sub(b.offset)
        } else {
            (b.offset == offset).then_some(0)
        };
        let Some(skip) = skip.filter(|&s| s <= b.data.len() as u64) else {
            break;
        };
        if b.instance != instance || b.lsn != lsn {
            break;
        }
        stream.extend_from_slice(&b.data[skip as usize..]);
        lsn += 1;
        offset = b.offset + b.data.len() as u64;
        if b.data.len() < cap {
            break;
        }
    }
    let out = records(&stream)?;
    Ok(Replay {
        records: out,
        next_lsn: lsn,
        next_offset: offset,
        future,
    })
}

/// The records framed in a log stream, up to the first that is torn or damaged (its
/// length past the stream's end, its checksum wrong, its operations undecodable): what
/// a crash left after the last whole record.
pub fn records(stream: &[u8]) -> Result<Vec<Replayed>> {
    let mut out = Vec::new();
    let mut r = Reader::new(stream, "log record");
    while r.remaining() >= 8 {
        let len = r.u32()? as usize;
        let crc = r.u32()?;
        if len > r.remaining() {
            break;
        }
        let at = r.pos();
        let payload = &stream[at..at + len];
        if !crc_ok(crc32c(&[payload]), crc) {
            break;
        }
        let mut p = Reader::new(payload, "log record");
        let msn = p.u64()?;
        let n = p.u32()? as usize;
        let decoded = if msn == BIND_MSN {
            decode_binds(&mut p, n).map(|b| (Vec::new(), Vec::new(), b))
        } else {
            decode_ops(&mut p, n).map(|(ops, late)| (ops, late, Vec::new()))
        };
        let (ops, late, binds) = match decoded {
            Ok(d) => d,
            Err(e) if e.is_damage() => break,
            Err(e) => return Err(e),
        };
        out.push(Replayed {
            msn,
            ops,
            late,
            binds,
        });
        r.skip(len)?;
    }
    Ok(out)
}

fn decode_binds(r: &mut Reader, n: usize) -> Result<Vec<(Msn, Vec<u8>)>> {
    let mut out = Vec::with_capacity(n.min(r.remaining() / 12));
    for _ in 0..n {
        let msn = r.u64()?;
        out.push((msn, r.bytes()?.to_vec()));
    }
    Ok(out)
}

/// What `replay` read: the records, where the stream it read ends (the next block and
/// its stream offset), and the LSN of a block from a later lap of the ring where it
/// expected the stream to go on, if it met one (see `replay`).
pub struct Replay {
    pub records: Vec<Replayed>,
    pub next_lsn: u64,
    pub next_offset: u64,
    pub future: Option<u64>,
}
