//! The JBD2 on-disk format (the journal of ext3 and ext4), as the kernel's
//! `Documentation/filesystems/ext4/journal.rst` and e2fsprogs describe it. Every field is
//! big-endian. The journal is a ring of blocks: block 0 holds the journal superblock, the
//! log runs from `first` to `maxlen - 1` and wraps. A transaction is one or more
//! descriptor blocks (each followed by the journal copies of the blocks its tags name),
//! revoke blocks, and a commit block, all stamped with the transaction's sequence number.

use crate::JournalError;

/// `h_magic` of every journal metadata block.
pub const MAGIC: u32 = 0xC03B_3998;

pub const BLOCK_DESCRIPTOR: u32 = 1;
pub const BLOCK_COMMIT: u32 = 2;
pub const BLOCK_SUPER_V1: u32 = 3;
pub const BLOCK_SUPER_V2: u32 = 4;
pub const BLOCK_REVOKE: u32 = 5;

/// Compatible journal feature: commit blocks carry a CRC32 of the transaction's
/// descriptor and data blocks (the kernel's `journal_checksum` on ext3).
pub const COMPAT_CHECKSUM: u32 = 0x1;
/// `h_chksum_type` of such a commit block.
pub const CHECKSUM_CRC32: u8 = 1;

/// Incompatible journal features.
pub const INCOMPAT_REVOKE: u32 = 0x1;
pub const INCOMPAT_64BIT: u32 = 0x2;
pub const INCOMPAT_ASYNC_COMMIT: u32 = 0x4;
pub const INCOMPAT_CSUM_V2: u32 = 0x8;
pub const INCOMPAT_CSUM_V3: u32 = 0x10;
pub const INCOMPAT_FAST_COMMIT: u32 = 0x20;
/// What recovery understands (checksums are parsed, not verified; skip records, ours).
pub const INCOMPAT_READABLE: u32 = INCOMPAT_REVOKE
    | INCOMPAT_64BIT
    | INCOMPAT_ASYNC_COMMIT
    | INCOMPAT_CSUM_V2
    | INCOMPAT_CSUM_V3
    | crate::skip::INCOMPAT_SKIP;
/// What our writer produces and keeps correct (no checksums, 32-bit block numbers; skip
/// records).
pub const INCOMPAT_WRITABLE: u32 = INCOMPAT_REVOKE | crate::skip::INCOMPAT_SKIP;

/// Tag flags.
pub const TAG_ESCAPE: u32 = 1;
pub const TAG_SAME_UUID: u32 = 2;
pub const TAG_LAST: u32 = 8;

/// The smallest journal JBD2 accepts.
pub const MIN_BLOCKS: u32 = 1024;

fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}
fn put32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_be_bytes());
}
fn put16(b: &mut [u8], o: usize, v: u16) {
    b[o..o + 2].copy_from_slice(&v.to_be_bytes());
}

/// The 12-byte header of a journal metadata block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub blocktype: u32,
    pub sequence: u32,
}

impl Header {
    /// The header of `b`, or None if `b` does not start with the journal magic.
    pub fn parse(b: &[u8]) -> Option<Header> {
        if b.len() < 12 || be32(b, 0) != MAGIC {
            return None;
        }
        Some(Header {
            blocktype: be32(b, 4),
            sequence: be32(b, 8),
        })
    }

    pub fn encode_into(&self, b: &mut [u8]) {
        put32(b, 0, MAGIC);
        put32(b, 4, self.blocktype);
        put32(b, 8, self.sequence);
    }
}

/// The journal superblock (the fields we use; the rest of the block is kept as found).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalSuper {
    /// `BLOCK_SUPER_V1` or `BLOCK_SUPER_V2`.
    pub version: u32,
    pub block_size: u32,
    /// Blocks in the journal, superblock included.
    pub maxlen: u32,
    /// First block of the log.
    pub first: u32,
    /// Sequence number of the first transaction expected in the log.
    pub sequence: u32,
    /// Log block where the log starts; 0 when the journal holds nothing to replay.
    pub start: u32,
    pub errno: i32,
    pub feature_compat: u32,
    pub feature_incompat: u32,
    pub feature_ro_compat: u32,
    pub uuid: [u8; 16],
    pub nr_users: u32,
    /// The nonce of the skip records of this mount of the journal (kept in the JBD2
    /// superblock's padding, at 0xF0, while `skip::INCOMPAT_SKIP` is set): a record of
    /// another mount, left in the area, never passes for one of this mount's.
    pub skip_nonce: u64,
}

impl JournalSuper {
    /// A fresh v2 superblock for a journal of `maxlen` blocks of `block_size` bytes.
    pub fn new(block_size: u32, maxlen: u32, uuid: [u8; 16]) -> JournalSuper {
        JournalSuper {
            version: BLOCK_SUPER_V2,
            block_size,
            maxlen,
            first: 1,
            sequence: 1,
            start: 0,
            errno: 0,
            feature_compat: 0,
            feature_incompat: 0,
            feature_ro_compat: 0,
            uuid,
            nr_users: 1,
            skip_nonce: 0,
        }
    }

    /// Decodes and checks the superblock against the journal's size in blocks and the
    /// file system's block size.
    pub fn decode(b: &[u8], block_size: u32, blocks: u32) -> Result<JournalSuper, JournalError> {
        let bad = |m: String| Err(JournalError::Corrupt(m));
        let Some(h) = Header::parse(b) else {
            return bad("the journal superblock has no JBD2 magic".into());
        };
        if h.blocktype != BLOCK_SUPER_V1 && h.blocktype != BLOCK_SUPER_V2 {
            return bad(format!(
                "the journal superblock has block type {}",
                h.blocktype
            ));
        }
        let mut uuid = [0u8; 16];
        let v2 = h.blocktype == BLOCK_SUPER_V2;
        if v2 {
            uuid.copy_from_slice(&b[0x30..0x40]);
        }
        let s = JournalSuper {
            version: h.blocktype,
            block_size: be32(b, 0x0C),
            maxlen: be32(b, 0x10),
            first: be32(b, 0x14),
            sequence: be32(b, 0x18),
            start: be32(b, 0x1C),
            errno: be32(b, 0x20) as i32,
            feature_compat: if v2 { be32(b, 0x24) } else { 0 },
            feature_incompat: if v2 { be32(b, 0x28) } else { 0 },
            feature_ro_compat: if v2 { be32(b, 0x2C) } else { 0 },
            uuid,
            nr_users: if v2 { be32(b, 0x40) } else { 1 },
            skip_nonce: if v2 {
                (be32(b, 0xF0) as u64) << 32 | be32(b, 0xF4) as u64
            } else {
                0
            },
        };
        if s.block_size != block_size {
            return bad(format!(
                "the journal's block size {} differs from the file system's {block_size}",
                s.block_size
            ));
        }
        if s.maxlen < MIN_BLOCKS || s.maxlen > blocks {
            return bad(format!(
                "the journal superblock says {} blocks; the journal inode holds {blocks}",
                s.maxlen
            ));
        }
        if s.first == 0 || s.first >= s.maxlen {
            return bad(format!(
                "the journal's first log block {} is outside it",
                s.first
            ));
        }
        if s.start != 0 && (s.start < s.first || s.start >= s.maxlen) {
            return bad(format!(
                "the journal's log start {} is outside the log",
                s.start
            ));
        }
        Ok(s)
    }

    /// Writes the fields into `b` (a whole block), leaving the others as they are.
    pub fn encode_into(&self, b: &mut [u8]) {
        Header {
            blocktype: self.version,
            sequence: 0,
        }
        .encode_into(b);
        put32(b, 0x0C, self.block_size);
        put32(b, 0x10, self.maxlen);
        put32(b, 0x14, self.first);
        put32(b, 0x18, self.sequence);
        put32(b, 0x1C, self.start);
        put32(b, 0x20, self.errno as u32);
        if self.version == BLOCK_SUPER_V2 {
            put32(b, 0x24, self.feature_compat);
            put32(b, 0x28, self.feature_incompat);
            put32(b, 0x2C, self.feature_ro_compat);
            b[0x30..0x40].copy_from_slice(&self.uuid);
            put32(b, 0x40, self.nr_users);
            put32(b, 0xF0, (self.skip_nonce >> 32) as u32);
            put32(b, 0xF4, self.skip_nonce as u32);
        }
    }

    /// Unknown incompatible features stop both recovery and writing.
    pub fn check_readable(&self) -> Result<(), JournalError> {
        let unknown = self.feature_incompat & !INCOMPAT_READABLE;
        if unknown != 0 {
            return Err(JournalError::Unsupported(format!(
                "journal incompatible features {unknown:#x}"
            )));
        }
        Ok(())
    }
}

/// One tag of a descriptor block: a home block whose journal copy follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    pub block: u64,
    /// The journal copy's first four bytes were the magic and are zeroed.
    pub escaped: bool,
}

/// Bytes per tag under these incompatible features (as the kernel's journal_tag_bytes).
pub fn tag_bytes(incompat: u32) -> usize {
    if incompat & INCOMPAT_CSUM_V3 != 0 {
        return 16;
    }
    let mut sz = 12;
    if incompat & INCOMPAT_CSUM_V2 != 0 {
        sz += 2;
    }
    if incompat & INCOMPAT_64BIT != 0 {
        sz
    } else {
        sz - 4
    }
}

/// Bytes at the end of descriptor and revoke blocks taken by a checksum tail.
fn tail_bytes(incompat: u32) -> usize {
    if incompat & (INCOMPAT_CSUM_V2 | INCOMPAT_CSUM_V3) != 0 {
        4
    } else {
        0
    }
}

/// How many tags fit in one descriptor block we write.
pub fn descriptor_capacity(block_size: usize, incompat: u32) -> usize {
    (block_size - 12 - 16 - tail_bytes(incompat)) / tag_bytes(incompat)
}

/// The tags of a descriptor block, in order.
pub fn parse_descriptor(b: &[u8], incompat: u32) -> Result<Vec<Tag>, JournalError> {
    let tb = tag_bytes(incompat);
    let end = b.len() - tail_bytes(incompat);
    let mut tags = Vec::new();
    let mut o = 12;
    while o + tb <= end {
        let (lo, flags, hi) = if incompat & INCOMPAT_CSUM_V3 != 0 {
            (be32(b, o), be32(b, o + 4), be32(b, o + 8))
        } else {
            let hi = if incompat & INCOMPAT_64BIT != 0 {
                be32(b, o + 8)
            } else {
                0
            };
            (be32(b, o), be16(b, o + 6) as u32, hi)
        };
        tags.push(Tag {
            block: (hi as u64) << 32 | lo as u64,
            escaped: flags & TAG_ESCAPE != 0,
        });
        o += tb;
        if flags & TAG_SAME_UUID == 0 {
            o += 16;
        }
        if flags & TAG_LAST != 0 {
            return Ok(tags);
        }
    }
    if tags.is_empty() {
        return Err(JournalError::Corrupt(
            "a descriptor block without tags".into(),
        ));
    }
    Ok(tags)
}

/// A descriptor block (no checksum features, 32-bit block numbers) for `tags`, which
/// must fit (`descriptor_capacity`).
pub fn encode_descriptor(
    block_size: usize,
    sequence: u32,
    uuid: &[u8; 16],
    tags: &[Tag],
) -> Vec<u8> {
    assert!(!tags.is_empty() && tags.len() <= descriptor_capacity(block_size, 0));
    let mut b = vec![0u8; block_size];
    Header {
        blocktype: BLOCK_DESCRIPTOR,
        sequence,
    }
    .encode_into(&mut b);
    let mut o = 12;
    for (i, t) in tags.iter().enumerate() {
        let mut flags = 0;
        if t.escaped {
            flags |= TAG_ESCAPE;
        }
        if i > 0 {
            flags |= TAG_SAME_UUID;
        }
        if i + 1 == tags.len() {
            flags |= TAG_LAST;
        }
        put32(&mut b, o, t.block as u32);
        put16(&mut b, o + 6, flags as u16);
        o += 8;
        if i == 0 {
            b[o..o + 16].copy_from_slice(uuid);
            o += 16;
        }
    }
    b
}

/// The running checksum of `COMPAT_CHECKSUM` journals: the kernel's `crc32_be` from ~0
/// over the transaction's descriptor and data blocks, in log order, with no final
/// inversion (CRC-32/BZIP2 without its final xor).
pub struct TxnChecksum(crc::Digest<'static, u32>);

static CRC32_BE: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_BZIP2);

impl Default for TxnChecksum {
    fn default() -> Self {
        TxnChecksum(CRC32_BE.digest())
    }
}

impl TxnChecksum {
    pub fn update(&mut self, block: &[u8]) {
        self.0.update(block);
    }
    pub fn value(self) -> u32 {
        !self.0.finalize()
    }
}

/// The checksum a commit block carries: Some((type, value)) when it has one.
pub fn commit_checksum(b: &[u8]) -> Option<(u8, u32)> {
    let (ty, size, v) = (b[12], b[13], be32(b, 16));
    (ty != 0 || size != 0 || v != 0).then_some((ty, v))
}

/// A commit block, with the transaction's checksum if the journal keeps them.
pub fn encode_commit(
    block_size: usize,
    sequence: u32,
    sec: u64,
    nsec: u32,
    checksum: Option<u32>,
) -> Vec<u8> {
    let mut b = vec![0u8; block_size];
    Header {
        blocktype: BLOCK_COMMIT,
        sequence,
    }
    .encode_into(&mut b);
    if let Some(c) = checksum {
        b[12] = CHECKSUM_CRC32;
        b[13] = 4;
        put32(&mut b, 16, c);
    }
    b[0x30..0x38].copy_from_slice(&sec.to_be_bytes());
    put32(&mut b, 0x38, nsec);
    b
}

/// The block numbers a revoke block lists.
pub fn parse_revoke(b: &[u8], incompat: u32) -> Result<Vec<u64>, JournalError> {
    let count = be32(b, 12) as usize;
    let wide = incompat & INCOMPAT_64BIT != 0;
    let rec = if wide { 8 } else { 4 };
    if count < 16 || count > b.len() - tail_bytes(incompat) {
        return Err(JournalError::Corrupt(format!(
            "a revoke block claims {count} bytes"
        )));
    }
    let mut out = Vec::new();
    let mut o = 16;
    while o + rec <= count {
        out.push(if wide {
            u64::from_be_bytes(b[o..o + 8].try_into().expect("8 bytes"))
        } else {
            be32(b, o) as u64
        });
        o += rec;
    }
    Ok(out)
}

/// How many 32-bit revoke records fit in one block we write.
pub fn revoke_capacity(block_size: usize) -> usize {
    (block_size - 16) / 4
}

/// A revoke block listing `blocks` (32-bit records; must fit).
pub fn encode_revoke(block_size: usize, sequence: u32, blocks: &[u32]) -> Vec<u8> {
    assert!(blocks.len() <= revoke_capacity(block_size));
    let mut b = vec![0u8; block_size];
    Header {
        blocktype: BLOCK_REVOKE,
        sequence,
    }
    .encode_into(&mut b);
    put32(&mut b, 12, (16 + 4 * blocks.len()) as u32);
    for (i, &blk) in blocks.iter().enumerate() {
        put32(&mut b, 16 + 4 * i, blk);
    }
    b
}

/// Does `data` need escaping (it starts with the journal magic)?
pub fn needs_escape(data: &[u8]) -> bool {
    data.len() >= 4 && be32(data, 0) == MAGIC
}

/// `tid_gt` of JBD2: sequence numbers compare on a circle.
pub fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn superblock_round_trips_and_is_checked() {
        let s = JournalSuper::new(4096, 8192, [7; 16]);
        let mut b = vec![0u8; 4096];
        s.encode_into(&mut b);
        assert_eq!(JournalSuper::decode(&b, 4096, 8192).unwrap(), s);
        assert!(JournalSuper::decode(&b, 1024, 8192).is_err(), "block size");
        assert!(
            JournalSuper::decode(&b, 4096, 4000).is_err(),
            "longer than its inode"
        );
        let mut bad = s.clone();
        bad.start = 9000;
        bad.encode_into(&mut b);
        assert!(
            JournalSuper::decode(&b, 4096, 8192).is_err(),
            "start outside"
        );
        b[0] ^= 1;
        assert!(JournalSuper::decode(&b, 4096, 8192).is_err(), "magic");
        let mut f = s.clone();
        f.feature_incompat = INCOMPAT_FAST_COMMIT;
        assert!(f.check_readable().is_err());
    }

    #[test]
    fn transaction_checksum_is_the_kernels_crc32_be() {
        // crc32_be(~0, "123456789") with no final inversion: the CRC-32/BZIP2 check
        // value 0xFC891918, uninverted.
        let mut c = TxnChecksum::default();
        c.update(b"1234");
        c.update(b"56789");
        assert_eq!(c.value(), !0xFC89_1918);
        let b = encode_commit(4096, 3, 0, 0, Some(0xDEAD_BEEF));
        assert_eq!(commit_checksum(&b), Some((CHECKSUM_CRC32, 0xDEAD_BEEF)));
        assert_eq!(commit_checksum(&encode_commit(4096, 3, 0, 0, None)), None);
    }

    #[test]
    fn sequence_numbers_compare_on_a_circle() {
        assert!(seq_after(2, 1));
        assert!(!seq_after(1, 2));
        assert!(seq_after(0, u32::MAX));
        assert!(!seq_after(5, 5));
    }

    #[test]
    fn tag_sizes_follow_the_features() {
        assert_eq!(tag_bytes(0), 8);
        assert_eq!(tag_bytes(INCOMPAT_64BIT), 12);
        assert_eq!(tag_bytes(INCOMPAT_CSUM_V2), 10);
        assert_eq!(tag_bytes(INCOMPAT_CSUM_V3 | INCOMPAT_64BIT), 16);
        assert_eq!(descriptor_capacity(4096, 0), (4096 - 28) / 8);
    }

    proptest! {
        #[test]
        fn descriptors_round_trip(blocks in proptest::collection::vec((any::<u32>(), any::<bool>()), 1..=508), seq in any::<u32>()) {
            let tags: Vec<Tag> = blocks.iter().map(|&(b, e)| Tag { block: b as u64, escaped: e }).collect();
            let b = encode_descriptor(4096, seq, &[3; 16], &tags);
            prop_assert_eq!(Header::parse(&b), Some(Header { blocktype: BLOCK_DESCRIPTOR, sequence: seq }));
            prop_assert_eq!(parse_descriptor(&b, 0).unwrap(), tags);
        }

        #[test]
        fn revokes_round_trip(blocks in proptest::collection::vec(any::<u32>(), 0..=1020)) {
            let b = encode_revoke(4096, 9, &blocks);
            let got: Vec<u32> = parse_revoke(&b, 0).unwrap().into_iter().map(|x| x as u32).collect();
            prop_assert_eq!(got, blocks);
        }

        #[test]
        fn parsers_never_panic_on_garbage(b in proptest::collection::vec(any::<u8>(), 4096), f in 0u32..64) {
            let _ = parse_descriptor(&b, f & INCOMPAT_READABLE);
            let _ = parse_revoke(&b, f & INCOMPAT_READABLE);
            let _ = JournalSuper::decode(&b, 4096, 1 << 20);
        }
    }
}
