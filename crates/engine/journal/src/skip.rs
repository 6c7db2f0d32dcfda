//! Log skipping (Bark, OSDI 2008): each committed transaction is one *record* of
//! contiguous blocks written by a range write wherever in the journal area the disk's
//! head gets first, instead of at the next block of a ring a rotation away. The area is
//! larger than the log needs (free space to skip into); records are found again by
//! scanning it, so each one identifies itself.
//!
//! A record, `len` blocks, written in one request:
//! - header blocks (one, or more for a large transaction): magic, kind 1, the journal's
//!   UUID, this mount's nonce, sequence, the block's index in the record, the record's length, how many data
//!   blocks and revoked blocks it holds, then for each data block its home block, its
//!   crc32c and whether it was escaped (it began with the magic, which is zeroed in the
//!   log), then the revoked home blocks; crc32c of the block last;
//! - the data blocks, as they were at the commit;
//! - a commit block: magic, kind 2, UUID, nonce, sequence, index `len - 1`, length, the crc32c
//!   of every block before it, then its own crc32c.
//!
//! One flush follows the write: the commit block's checksum (and each data block's)
//! makes a torn record fail the scan, so no second write and flush ordering the commit
//! after the data is needed. Recovery reads the whole area, keeps each record whose
//! header, data and commit check out, and replays them in sequence order from the
//! superblock's `sequence` for as long as the sequence continues: a transaction commits
//! only after the one before it is durable, so the first gap is where the committed log
//! ends. Records of older sequences (space the journal has freed) are ignored; space is
//! reused only after the superblock's `sequence` has moved past the records it held,
//! durably, so recovery never misses a record it needs.
//!
//! Each mount of the journal draws a random nonce, kept in the superblock, which every
//! record carries: records of an earlier mount (a torn or unreplayed one, whatever its
//! sequence) and blocks the ring placement or the kernel logged (file data included)
//! never pass for this mount's records. Within a mount, file data that begins with the
//! magic is escaped in the log.
//!
//! While records may be in the area, the JBD2 superblock carries the incompatible
//! feature [`INCOMPAT_SKIP`], which the kernel and e2fsck do not know: they refuse to
//! replay such a journal rather than misread it. A clean shutdown empties the journal
//! and clears it, so a cleanly unmounted image is plain ext3 again.

use crate::format::{seq_after, JournalSuper};
use crate::{JournalMap, Result};
use quilt_block::BlockDevice;
use rustc_hash::FxHashMap as HashMap;

/// Incompatible JBD2 feature: the journal holds skip records (this module's format).
pub const INCOMPAT_SKIP: u32 = 0x4000_0000;
/// Compatible JBD2 feature: the journal is to be written with skipping (what `mkfs
/// --journal-placement skip` asks; kernels ignore it).
pub const COMPAT_PREFER_SKIP: u32 = 0x4000_0000;

pub const MAGIC: u32 = u32::from_le_bytes(*b"QSKP");
const KIND_HEADER: u32 = 1;
const KIND_COMMIT: u32 = 2;
/// magic, kind, uuid, nonce, seq, index, len, data count, revoke count.
const HEADER_FIXED: usize = 4 + 4 + 16 + 8 + 4 + 4 + 4 + 4 + 4;
/// home, crc, flags.
const ENTRY: usize = 8 + 4 + 4;

fn crc(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Whether a data block must be escaped in the log (it begins with the record magic).
pub fn needs_escape(b: &[u8]) -> bool {
    b.len() >= 4 && le32(b, 0) == MAGIC
}

/// One data block of a record: its home, and whether it is escaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub home: u64,
    pub escaped: bool,
}

/// How many blocks a record of `data` blocks and `revokes` revoked blocks takes.
pub fn record_len(bs: usize, data: usize, revokes: usize) -> usize {
    let room = bs - HEADER_FIXED - 4;
    let bytes = data * ENTRY + revokes * 8;
    bytes.div_ceil(room).max(1) + data + 1
}

/// Encodes a whole record: header blocks, the data blocks (escaped as needed), and the
/// commit block. `data` holds each block's home and content.
pub fn encode(
    bs: usize,
    sb: &JournalSuper,
    seq: u32,
    data: &[(u64, &[u8])],
    revoked: &[u64],
) -> Vec<u8> {
    let len = record_len(bs, data.len(), revoked.len());
    let headers = len - data.len() - 1;
    let mut out = vec![0u8; len * bs];
    // The entries and revokes, spread over the header blocks.
    let mut payload = Vec::with_capacity(data.len() * ENTRY + revoked.len() * 8);
    let mut logged: Vec<Vec<u8>> = Vec::with_capacity(data.len());
    for (home, d) in data {
        let escaped = needs_escape(d);
        let mut copy = d.to_vec();
        if escaped {
            copy[0..4].fill(0);
        }
        payload.extend_from_slice(&home.to_le_bytes());
        payload.extend_from_slice(&crc(&[&copy]).to_le_bytes());
        payload.extend_from_slice(&(escaped as u32).to_le_bytes());
        logged.push(copy);
    }
    for r in revoked {
        payload.extend_from_slice(&r.to_le_bytes());
    }
    let room = bs - HEADER_FIXED - 4;
    for h in 0..headers {
        let b = &mut out[h * bs..(h + 1) * bs];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&KIND_HEADER.to_le_bytes());
        stamp(b, sb, seq, h, len);
        b[44..48].copy_from_slice(&(data.len() as u32).to_le_bytes());
        b[48..52].copy_from_slice(&(revoked.len() as u32).to_le_bytes());
        let from = (h * room).min(payload.len());
        let to = ((h + 1) * room).min(payload.len());
        b[HEADER_FIXED..HEADER_FIXED + (to - from)].copy_from_slice(&payload[from..to]);
        let c = crc(&[&b[..bs - 4]]);
        b[bs - 4..].copy_from_slice(&c.to_le_bytes());
    }
    for (i, copy) in logged.iter().enumerate() {
        out[(headers + i) * bs..(headers + i + 1) * bs].copy_from_slice(copy);
    }
    let body = crc(&[&out[..(len - 1) * bs]]);
    let c = &mut out[(len - 1) * bs..];
    c[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    c[4..8].copy_from_slice(&KIND_COMMIT.to_le_bytes());
    stamp(c, sb, seq, len - 1, len);
    c[44..48].copy_from_slice(&body.to_le_bytes());
    let own = crc(&[&c[..bs - 4]]);
    c[bs - 4..].copy_from_slice(&own.to_le_bytes());
    out
}

/// The fields every block of a record begins with, after magic and kind: the journal's
/// UUID, the mount's nonce, the sequence, the block's index and the record's length.
fn stamp(b: &mut [u8], sb: &JournalSuper, seq: u32, index: usize, len: usize) {
    b[8..24].copy_from_slice(&sb.uuid);
    b[24..32].copy_from_slice(&sb.skip_nonce.to_le_bytes());
    b[32..36].copy_from_slice(&seq.to_le_bytes());
    b[36..40].copy_from_slice(&(index as u32).to_le_bytes());
    b[40..44].copy_from_slice(&(len as u32).to_le_bytes());
}

/// Whether `b` is a block of `kind` of this journal and mount, its own checksum intact.
fn ours(b: &[u8], sb: &JournalSuper, kind: u32) -> bool {
    let bs = b.len();
    bs >= HEADER_FIXED + 8
        && le32(b, 0) == MAGIC
        && le32(b, 4) == kind
        && b[8..24] == sb.uuid
        && le64(b, 24) == sb.skip_nonce
        && crc(&[&b[..bs - 4]]) == le32(b, bs - 4)
}

/// A header block's fields: sequence, index, record length, data and revoke counts.
fn header(b: &[u8], sb: &JournalSuper) -> Option<(u32, u32, u32, u32, u32)> {
    if !ours(b, sb, KIND_HEADER) {
        return None;
    }
    Some((
        le32(b, 32),
        le32(b, 36),
        le32(b, 40),
        le32(b, 44),
        le32(b, 48),
    ))
}

/// A record found in the area: its sequence, where its blocks lie (journal block
/// numbers), and what it revokes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub seq: u32,
    pub start: u32,
    pub len: u32,
    /// Each data block: home, journal block of its copy, escaped.
    pub copies: Vec<(u64, u32, bool)>,
    pub revoked: Vec<u64>,
}

/// Every whole, intact record in the area `first..maxlen` (header, data and commit
/// checksums all match).
pub fn scan(dev: &dyn BlockDevice, map: &JournalMap, sb: &JournalSuper) -> Result<Vec<Found>> {
    let bs = dev.block_size();
    let read = |j: u32| -> Result<Vec<u8>> {
        let mut b = vec![0u8; bs];
        dev.read(map.device_block(j)?, &mut b)?;
        Ok(b)
    };
    // First the blocks that begin a record of this mount, one block in memory at a time
    // (an external journal may be large); then each such record whole.
    let mut starts = Vec::new();
    let mut j = sb.first;
    let mut chunk = Vec::new();
    while j < sb.maxlen {
        // Up to 256 blocks consecutive on the device, as one request.
        let first = map.device_block(j)?;
        let mut n = 1;
        while n < 256 && j + n < sb.maxlen && map.device_block(j + n)? == first + n as u64 {
            n += 1;
        }
        chunk.resize(n as usize * bs, 0);
        dev.read_blocks(first, &mut chunk)?;
        for (i, b) in chunk.chunks(bs).enumerate() {
            if let Some(h @ (_, 0, _, _, _)) = header(b, sb) {
                starts.push((j + i as u32, h));
            }
        }
        j += n;
    }
    let room = bs - HEADER_FIXED - 4;
    let mut out = Vec::new();
    for (start, (seq, _, len, ndata, nrev)) in starts {
        let (len, ndata, nrev) = (len as usize, ndata as usize, nrev as usize);
        let need = ndata
            .checked_mul(ENTRY)
            .and_then(|a| nrev.checked_mul(8).map(|b| (a, b)))
            .and_then(|(a, b)| a.checked_add(b));
        let Some(need) = need else { continue };
        let headers = need.div_ceil(room).max(1);
        if len != headers + ndata + 1 || start as usize + len > sb.maxlen as usize {
            continue;
        }
        let rec: Vec<Vec<u8>> = if map.contiguous(start, len as u32) {
            let mut all = vec![0u8; len * bs];
            dev.read_blocks(map.device_block(start)?, &mut all)?;
            all.chunks(bs).map(<[u8]>::to_vec).collect()
        } else {
            (start..start + len as u32)
                .map(read)
                .collect::<Result<_>>()?
        };
        // Every header block of the same record, in order.
        let mut payload = Vec::with_capacity(need);
        let mut ok = true;
        for (h, b) in rec.iter().take(headers).enumerate() {
            match header(b, sb) {
                Some((s, i, l, d, r))
                    if s == seq
                        && i as usize == h
                        && l as usize == len
                        && d as usize == ndata
                        && r as usize == nrev =>
                {
                    payload.extend_from_slice(&b[HEADER_FIXED..bs - 4]);
                }
                _ => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok {
            continue;
        }
        let c = &rec[len - 1];
        let body = {
            let mut v = 0u32;
            for b in &rec[..len - 1] {
                v = crc32c::crc32c_append(v, b);
            }
            v
        };
        if !ours(c, sb, KIND_COMMIT)
            || le32(c, 32) != seq
            || le32(c, 36) as usize != len - 1
            || le32(c, 40) as usize != len
            || le32(c, 44) != body
        {
            continue;
        }
        let mut copies = Vec::with_capacity(ndata);
        for i in 0..ndata {
            let e = &payload[i * ENTRY..(i + 1) * ENTRY];
            let (home, sum, flags) = (le64(e, 0), le32(e, 8), le32(e, 12));
            let at = start as usize + headers + i;
            if crc(&[&rec[headers + i]]) != sum {
                ok = false;
                break;
            }
            copies.push((home, at as u32, flags & 1 != 0));
        }
        if !ok {
            continue;
        }
        let revoked = (0..nrev)
            .map(|i| le64(&payload, ndata * ENTRY + i * 8))
            .collect();
        out.push(Found {
            seq,
            start,
            len: len as u32,
            copies,
            revoked,
        });
    }
    Ok(out)
}

/// The records recovery replays: from `sb.sequence` on, for as long as the sequence
/// continues (a later record of a sequence already seen, left by an interrupted earlier
/// instance of the journal, does not count twice: the first found is kept).
pub fn committed(found: Vec<Found>, sb: &JournalSuper) -> Vec<Found> {
    let mut by_seq: HashMap<u32, Found> = HashMap::default();
    for f in found {
        if seq_after(sb.sequence, f.seq) {
            continue; // older than the tail: freed space
        }
        by_seq.entry(f.seq).or_insert(f);
    }
    let mut out = Vec::new();
    let mut seq = sb.sequence;
    while let Some(f) = by_seq.remove(&seq) {
        out.push(f);
        seq = seq.wrapping_add(1);
    }
    out
}

/// Free runs of the area (journal blocks `first..maxlen` not in `used`, sorted by
/// start) as candidate starts for a record of `len` blocks, `step` apart, at most `max`,
/// beginning at `from` (where the last record ended: the disk's head is there) and
/// wrapping round to the area's start. Candidates bunched at the area's front instead
/// made every trip of the head past them cost a seek back or a revolution; spread over
/// a large area, a tenth of a revolution apart.
pub fn candidates(
    first: u32,
    maxlen: u32,
    used: &[(u32, u32)],
    from: u32,
    len: u32,
    step: u32,
    max: usize,
) -> Vec<u32> {
    let mut at = first;
    let mut runs = Vec::new();
    for &(s, l) in used {
        if s > at {
            runs.push((at, s));
        }
        at = at.max(s.saturating_add(l));
    }
    if maxlen > at {
        runs.push((at, maxlen));
    }
    // From `from` to the end, then from the start up to `from`.
    let from = from.clamp(first, maxlen);
    let mut order = Vec::with_capacity(runs.len() + 1);
    for &(a, b) in &runs {
        if b > from {
            order.push((a.max(from), b));
        }
    }
    for &(a, b) in &runs {
        if a < from {
            order.push((a, b.min(from)));
        }
    }
    let mut out = Vec::new();
    for (a, b) in order {
        let mut s = a;
        while s.saturating_add(len) <= b && out.len() < max {
            out.push(s);
            s += step.max(1);
        }
    }
    out
}

/// A nonce for a new mount of the journal: random (the standard library's hasher keys
/// come from the OS's random source), never 0.
pub fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish().max(1)
}

/// Whether the journal may hold skip records (recovery must scan for them).
pub fn is_skip(sb: &JournalSuper) -> bool {
    sb.feature_incompat & INCOMPAT_SKIP != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_block::MemDevice;
    use quilt_block::WriteClass;

    fn sb(maxlen: u32) -> JournalSuper {
        let mut s = JournalSuper::new(4096, maxlen, [7; 16]);
        s.feature_incompat |= INCOMPAT_SKIP;
        s.sequence = 10;
        s.start = 1;
        s.skip_nonce = 0x1234_5678_9abc;
        s
    }

    #[test]
    fn records_round_trip_through_a_scan_and_torn_ones_are_ignored() {
        let dev = MemDevice::new(4096, 2048).unwrap();
        let map = JournalMap {
            blocks: (0..2048).collect(),
        };
        let s = sb(2048);
        let a = vec![1u8; 4096];
        let mut b = vec![2u8; 4096];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes()); // escaped
        let r10 = encode(4096, &s, 10, &[(100, &a), (101, &b)], &[55]);
        let r11 = encode(4096, &s, 11, &[(102, &a)], &[]);
        let r12 = encode(4096, &s, 12, &[(103, &a)], &[]);
        dev.write_blocks(50, &r10, WriteClass::Metadata).unwrap();
        dev.write_blocks(700, &r11, WriteClass::Metadata).unwrap();
        // Record 12 torn: its commit never made it.
        dev.write_blocks(300, &r12[..r12.len() - 4096], WriteClass::Metadata)
            .unwrap();
        let found = scan(&dev, &map, &s).unwrap();
        assert_eq!(found.len(), 2);
        let c = committed(found, &s);
        assert_eq!(c.iter().map(|f| f.seq).collect::<Vec<_>>(), vec![10, 11]);
        assert_eq!(c[0].copies, vec![(100, 51, false), (101, 52, true)]);
        assert_eq!(c[0].revoked, vec![55]);
        // A changed data block fails its checksum: the record is gone, and 11 after it.
        let mut bad = r10.clone();
        bad[4096 + 9] ^= 1;
        dev.write_blocks(50, &bad, WriteClass::Metadata).unwrap();
        let c = committed(scan(&dev, &map, &s).unwrap(), &s);
        assert!(c.is_empty());
    }

    #[test]
    fn records_of_another_mount_are_not_replayed() {
        let dev = MemDevice::new(4096, 2048).unwrap();
        let map = JournalMap {
            blocks: (0..2048).collect(),
        };
        let mut s = sb(2048);
        let a = vec![1u8; 4096];
        let mut old = s.clone();
        old.skip_nonce ^= 1;
        // A whole record of sequence 10 from an earlier mount, then this mount's 11.
        dev.write_blocks(
            20,
            &encode(4096, &old, 10, &[(100, &a)], &[]),
            WriteClass::Metadata,
        )
        .unwrap();
        dev.write_blocks(
            40,
            &encode(4096, &s, 11, &[(101, &a)], &[]),
            WriteClass::Metadata,
        )
        .unwrap();
        assert!(committed(scan(&dev, &map, &s).unwrap(), &s).is_empty());
        s.sequence = 11;
        let c = committed(scan(&dev, &map, &s).unwrap(), &s);
        assert_eq!(c.iter().map(|f| f.seq).collect::<Vec<_>>(), vec![11]);
    }

    #[test]
    fn a_large_transaction_takes_several_header_blocks() {
        let datas: Vec<Vec<u8>> = (0..600).map(|i| vec![i as u8; 4096]).collect();
        let data: Vec<(u64, &[u8])> = datas
            .iter()
            .enumerate()
            .map(|(i, d)| (1000 + i as u64, d.as_slice()))
            .collect();
        let revs: Vec<u64> = (0..300).collect();
        let s = sb(4096);
        let rec = encode(4096, &s, 10, &data, &revs);
        assert_eq!(rec.len() / 4096, record_len(4096, 600, 300));
        assert!(record_len(4096, 600, 300) > 600 + 2);
        let dev = MemDevice::new(4096, 4096).unwrap();
        dev.write_blocks(5, &rec, WriteClass::Metadata).unwrap();
        let map = JournalMap {
            blocks: (0..4096).collect(),
        };
        let c = committed(scan(&dev, &map, &s).unwrap(), &s);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].copies.len(), 600);
        assert_eq!(c[0].revoked.len(), 300);
        assert_eq!(c[0].copies[599].0, 1599);
    }

    #[test]
    fn damaged_areas_never_panic_and_keep_only_intact_records() {
        // Garbage, and garbage with this mount's header fields and valid block
        // checksums but absurd counts and lengths: the scan keeps nothing of it.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let s = sb(256);
        let map = JournalMap {
            blocks: (0..256).collect(),
        };
        for round in 0..200 {
            let dev = MemDevice::new(4096, 256).unwrap();
            for j in 1..256u64 {
                let mut b: Vec<u8> = (0..4096).map(|_| next() as u8).collect();
                if next() % 3 == 0 {
                    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
                    b[4..8].copy_from_slice(&((next() % 3) as u32).to_le_bytes());
                    stamp(
                        &mut b,
                        &s,
                        10 + (next() % 3) as u32,
                        (next() % 3) as usize,
                        (next() % 600) as usize,
                    );
                    if round % 2 == 0 {
                        b[44..48].copy_from_slice(&(next() as u32).to_le_bytes());
                        b[48..52].copy_from_slice(&(next() as u32 % 4).to_le_bytes());
                    }
                    let c = crc(&[&b[..4092]]);
                    b[4092..].copy_from_slice(&c.to_le_bytes());
                }
                dev.write(j, &b, WriteClass::Metadata).unwrap();
            }
            // One intact record among it all.
            let a = vec![9u8; 4096];
            dev.write_blocks(
                100,
                &encode(4096, &s, 10, &[(3, &a)], &[]),
                WriteClass::Metadata,
            )
            .unwrap();
            let c = committed(scan(&dev, &map, &s).unwrap(), &s);
            assert!(c.len() <= 3);
            assert_eq!(
                c.first().map(|f| (f.seq, f.start)),
                Some((10, 100)),
                "round {round}"
            );
        }
    }

    #[test]
    fn candidates_cover_the_free_runs() {
        let c = candidates(1, 100, &[(10, 5), (50, 40)], 1, 4, 8, 100);
        assert_eq!(c, vec![1, 15, 23, 31, 39, 90]);
        assert_eq!(
            candidates(1, 100, &[(1, 99)], 1, 1, 1, 10),
            Vec::<u32>::new()
        );
        // From where the last record ended, round to the start; a run the wrap cuts in
        // two yields both parts.
        let c = candidates(1, 100, &[(10, 5), (50, 40)], 30, 4, 8, 100);
        assert_eq!(c, vec![30, 38, 46, 90, 1, 15, 23]);
        let c = candidates(1, 10_001, &[], 9_000, 4, 4, 600);
        assert_eq!(c.len(), 600);
        assert_eq!(&c[..2], &[9_000, 9_004]);
        assert!(c.contains(&1) && c.iter().all(|&x| x + 4 <= 10_001));
    }
}
