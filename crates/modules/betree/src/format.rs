//! The image's fixed structures: the two alternating headers, the block translation
//! table (node id → extent) and the log blocks. Each carries a magic, a version and a
//! crc32c; a damaged one is a typed error.
//!
//! Layout: block 0 and block 1 are the header slots (checkpoint `g` writes slot `g % 2`);
//! the log region follows; node and table extents fill the rest, up to the device's
//! last block, which (from header version 3) holds a mirror of the newest header: a
//! damaged or zeroed newest slot is then read from the mirror instead of silently
//! falling back to the checkpoint before it.

use crate::codec::{crc32c, crc_ok, verify, Reader, Writer};
use crate::node::NodeId;
use crate::{Error, Result};
use quilt_block::BlockNo;

const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"QBETREE1");
const TABLE_MAGIC: u32 = u32::from_le_bytes(*b"QBTT");
const LOG_MAGIC: u32 = u32::from_le_bytes(*b"QBLG");
pub const VERSION: u32 = 1;
/// Headers: version 2 lets replay start in the middle of a log block (`log_offset` is
/// the stream offset of the first record to replay; version 1 always named a block's
/// start, which means the same). Version 1 binaries refuse version 2 headers rather than
/// stop replay at once. Version 3 adds the mirror's block (`Geometry::mirror`); version
/// 2 binaries refuse it (they would allocate nodes over the mirror). Version 4 has
/// version 3's layout; its log may hold puts by reference and the records that bind
/// their values (`log.rs`), which version 3 binaries would replay as a torn record.
const HEADER_VERSION: u32 = 4;
pub const HEADER_SLOTS: u64 = 2;

/// A run of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Extent {
    pub start: BlockNo,
    pub blocks: u64,
}

/// The tree's shape, fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub block_size: usize,
    pub node_bytes: usize,
    pub basement_bytes: usize,
    pub fanout: usize,
    pub log_first: BlockNo,
    pub log_blocks: u64,
    /// The block that mirrors the newest header (the device's last), or 0 for trees
    /// made before mirrors (header version 2 and older).
    pub mirror: BlockNo,
}

impl Geometry {
    pub fn data_first(&self) -> BlockNo {
        // Saturating: a damaged header's log size is refused by the geometry check,
        // which calls this first.
        self.log_first.saturating_add(self.log_blocks)
    }
    /// Where node and table extents end: the mirror, or the device's end.
    pub fn data_end(&self, block_count: u64) -> BlockNo {
        if self.mirror == 0 {
            block_count
        } else {
            self.mirror
        }
    }
    pub fn max_key(&self) -> usize {
        (self.node_bytes / (4 * self.fanout)).clamp(16, 4096)
    }
    pub fn max_value(&self) -> usize {
        self.node_bytes / 4
    }
}

/// One checkpoint's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The format version it was read as, or will be written as (`Header::version_for`).
    pub version: u32,
    /// Random at creation: log blocks of an older tree on the same device never match.
    pub instance: u64,
    pub generation: u64,
    pub geo: Geometry,
    pub root: NodeId,
    pub table: Extent,
    pub table_crc: u32,
    pub next_node: NodeId,
    /// The next message's sequence number: every message below it is in the tree.
    pub next_msn: u64,
    /// Where replay starts: the first record to replay is at stream offset `log_offset`,
    /// in log block `log_lsn` (possibly past the block's start).
    pub log_lsn: u64,
    pub log_offset: u64,
}

impl Header {
    /// The version a header of a tree of this shape is written as: a tree without a
    /// mirror keeps writing version 2, which older binaries read.
    pub fn version_for(geo: &Geometry) -> u32 {
        if geo.mirror == 0 {
            2
        } else {
            HEADER_VERSION
        }
    }

    pub fn slot(&self) -> BlockNo {
        self.generation % HEADER_SLOTS
    }

    pub fn encode(&self, bs: usize) -> Vec<u8> {
        let mut w = Writer::with_capacity(bs);
        w.u64(HEADER_MAGIC);
        w.u32(Header::version_for(&self.geo));
        w.u32(0); // crc
        w.u64(self.instance);
        w.u64(self.generation);
        w.u32(self.geo.block_size as u32);
        w.u32(self.geo.node_bytes as u32);
        w.u32(self.geo.basement_bytes as u32);
        w.u32(self.geo.fanout as u32);
        w.u64(self.geo.log_first);
        w.u64(self.geo.log_blocks);
        w.u64(self.root);
        w.u64(self.table.start);
        w.u64(self.table.blocks);
        w.u32(self.table_crc);
        w.u32(0);
        w.u64(self.next_node);
        w.u64(self.next_msn);
        w.u64(self.log_lsn);
        w.u64(self.log_offset);
        if self.geo.mirror != 0 {
            w.u64(self.geo.mirror);
        }
        let len = w.len();
        w.buf.resize(bs, 0);
        let crc = crc32c(&[&w.buf[..len]]);
        w.put_u32_at(12, crc);
        w.buf
    }

    /// `Ok(None)`: the slot holds no header at all (zeros, or another format).
    pub fn decode(b: &[u8]) -> Result<Option<Header>> {
        let mut r = Reader::new(b, "header");
        if r.u64()? != HEADER_MAGIC {
            return Ok(None);
        }
        let version = r.u32()?;
        if !(1..=HEADER_VERSION).contains(&version) {
            return Err(Error::Corrupt(format!("header: unknown version {version}")));
        }
        let crc = r.u32()?;
        let h = Header {
            version,
            instance: r.u64()?,
            generation: r.u64()?,
            geo: Geometry {
                block_size: r.u32()? as usize,
                node_bytes: r.u32()? as usize,
                basement_bytes: r.u32()? as usize,
                fanout: r.u32()? as usize,
                log_first: r.u64()?,
                log_blocks: r.u64()?,
                mirror: 0,
            },
            root: r.u64()?,
            table: Extent {
                start: r.u64()?,
                blocks: r.u64()?,
            },
            table_crc: r.u32()?,
            next_node: {
                r.u32()?;
                r.u64()?
            },
            next_msn: r.u64()?,
            log_lsn: r.u64()?,
            log_offset: r.u64()?,
        };
        let mut h = h;
        if version >= 3 {
            h.geo.mirror = r.u64()?;
        }
        let len = r.pos();
        let mut copy = b[..len].to_vec();
        copy[12..16].fill(0);
        verify(crc32c(&[&copy]), crc, || {
            format!("header of generation {}", h.generation)
        })?;
        // Counters that only ever grow by one per checkpoint, node, batch or log block:
        // nowhere near this after any life a tree can have, and refused so that the
        // increments after them cannot overflow (the fuzzer found such headers).
        for (what, v) in [
            ("generation", h.generation),
            ("next node", h.next_node),
            ("next message", h.next_msn),
            ("log sequence", h.log_lsn),
            ("log offset", h.log_offset),
        ] {
            if v >= COUNTER_LIMIT {
                return Err(Error::Corrupt(format!(
                    "header of generation {}: {what} {v} is out of range",
                    h.generation
                )));
            }
        }
        Ok(Some(h))
    }
}

/// The bound on a header's counters (see `Header::decode`).
pub const COUNTER_LIMIT: u64 = 1 << 62;

/// Version 2 of the table added the reference counts of shared nodes after the extents,
/// version 3 the base extents of delta leaves after those; older tables still decode.
pub(crate) const TABLE_VERSION: u32 = 3;

/// Encodes the block translation table (each node's extent, then the reference counts
/// of shared nodes) into whole blocks; returns the bytes and the crc the header records.
pub fn encode_table(
    entries: &[(NodeId, Extent)],
    refs: &[(NodeId, u32)],
    bases: &[(NodeId, Extent)],
    bs: usize,
) -> (Vec<u8>, u32) {
    let mut w = Writer::with_capacity(32 + (entries.len() + bases.len()) * 24 + refs.len() * 12);
    w.u32(TABLE_MAGIC);
    w.u32(TABLE_VERSION);
    w.u64(entries.len() as u64);
    for (id, e) in entries {
        w.u64(*id);
        w.u64(e.start);
        w.u64(e.blocks);
    }
    w.u64(refs.len() as u64);
    for (id, n) in refs {
        w.u64(*id);
        w.u32(*n);
    }
    w.u64(bases.len() as u64);
    for (id, e) in bases {
        w.u64(*id);
        w.u64(e.start);
        w.u64(e.blocks);
    }
    let crc = crc32c(&[&w.buf]);
    w.pad_to(bs);
    (w.buf, crc)
}

/// A node's extent, by node.
pub type TableEntries = Vec<(NodeId, Extent)>;
/// Reference counts of shared nodes.
pub type TableRefs = Vec<(NodeId, u32)>;

/// The table: each node's extent, reference counts, and the base extent of each node
/// stored as a delta leaf (version 3; none before).
pub fn decode_table(b: &[u8], want_crc: u32) -> Result<(TableEntries, TableRefs, TableEntries)> {
    let mut r = Reader::new(b, "block translation table");
    if r.u32()? != TABLE_MAGIC {
        return Err(Error::Corrupt("block translation table: bad magic".into()));
    }
    let version = r.u32()?;
    if !(1..=TABLE_VERSION).contains(&version) {
        return Err(Error::Corrupt(format!(
            "block translation table: unknown version {version}"
        )));
    }
    let out = read_extents(&mut r, "entries")?;
    let mut refs = Vec::new();
    if version >= 2 {
        let n = r.u64()? as usize;
        if n > r.remaining() / 12 {
            return Err(Error::Corrupt(format!(
                "block translation table: {n} reference counts"
            )));
        }
        for _ in 0..n {
            refs.push((r.u64()?, r.u32()?));
        }
    }
    let mut bases = Vec::new();
    if version >= 3 {
        bases = read_extents(&mut r, "base extents")?;
    }
    verify(crc32c(&[&b[..r.pos()]]), want_crc, || {
        "block translation table".to_string()
    })?;
    Ok((out, refs, bases))
}

/// A count, then that many (node, extent) entries (`what` names them in an error).
fn read_extents(r: &mut Reader, what: &str) -> Result<TableEntries> {
    let n = r.u64()? as usize;
    if n > r.remaining() / 24 {
        return Err(Error::Corrupt(format!(
            "block translation table: {n} {what}"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = r.u64()?;
        out.push((
            id,
            Extent {
                start: r.u64()?,
                blocks: r.u64()?,
            },
        ));
    }
    Ok(out)
}

/// Bytes of a log block before its data.
pub const LOG_HDR: usize = 40;

/// One block of the redo log: a piece of the log's byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBlock<'a> {
    pub instance: u64,
    pub lsn: u64,
    /// Offset of `data` in the log stream: replay accepts a block only if it continues
    /// the stream exactly where the previous one ended.
    pub offset: u64,
    pub data: &'a [u8],
}

impl LogBlock<'_> {
    pub fn encode(&self, bs: usize) -> Vec<u8> {
        let mut w = Writer::with_capacity(bs);
        w.u32(LOG_MAGIC);
        w.u32(VERSION);
        w.u64(self.instance);
        w.u64(self.lsn);
        w.u64(self.offset);
        w.u32(self.data.len() as u32);
        w.u32(0); // crc
        debug_assert_eq!(w.len(), LOG_HDR);
        w.raw(self.data);
        let crc = crc32c(&[&w.buf]);
        w.put_u32_at(36, crc);
        w.buf.resize(bs, 0);
        w.buf
    }

    /// `None` for anything but an intact log block.
    pub fn decode(b: &[u8]) -> Option<LogBlock<'_>> {
        let mut r = Reader::new(b, "log block");
        if r.u32().ok()? != LOG_MAGIC || r.u32().ok()? != VERSION {
            return None;
        }
        let instance = r.u64().ok()?;
        let lsn = r.u64().ok()?;
        let offset = r.u64().ok()?;
        let used = r.u32().ok()? as usize;
        let crc = r.u32().ok()?;
        let end = LOG_HDR.checked_add(used).filter(|&e| e <= b.len())?;
        let mut head = b[..LOG_HDR].to_vec();
        head[36..40].fill(0);
        if !crc_ok(crc32c(&[&head, &b[LOG_HDR..end]]), crc) {
            return None;
        }
        Some(LogBlock {
            instance,
            lsn,
            offset,
            data: &b[LOG_HDR..end],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            version: 2,
            instance: 7,
            generation: 3,
            geo: Geometry {
                block_size: 4096,
                node_bytes: 65536,
                basement_bytes: 4096,
                fanout: 16,
                log_first: 2,
                log_blocks: 64,
                mirror: 0,
            },
            root: 1,
            table: Extent {
                start: 100,
                blocks: 1,
            },
            table_crc: 0,
            next_node: 9,
            next_msn: 11,
            log_lsn: 5,
            log_offset: 4096,
        }
    }

    /// Headers with a right checksum and a counter no tree can reach are refused: the
    /// increments after them would overflow (found by fuzzing).
    #[test]
    fn counters_out_of_range_are_refused() {
        let ok = header();
        assert_eq!(
            Header::decode(&ok.encode(4096))
                .unwrap()
                .unwrap()
                .generation,
            3
        );
        for h in [
            Header {
                generation: u64::MAX,
                ..header()
            },
            Header {
                next_node: COUNTER_LIMIT,
                ..header()
            },
            Header {
                next_msn: u64::MAX,
                ..header()
            },
            Header {
                log_lsn: COUNTER_LIMIT,
                ..header()
            },
            Header {
                log_offset: u64::MAX,
                ..header()
            },
        ] {
            assert!(
                Header::decode(&h.encode(4096)).is_err_and(|e| e.is_damage()),
                "{h:?}"
            );
        }
    }
}
