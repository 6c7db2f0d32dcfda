//! Nodes in memory and on disk.
//!
//! On disk a node is one extent of whole blocks (copy-on-write: a changed node goes to a
//! new extent at the next checkpoint). It starts with a 32-byte prefix
//! (magic, version, kind, node id, height, section length, crc32c of the section):
//!
//! * an **internal** node's section is the whole node: child ids, pivots, and one message
//!   buffer per child;
//! * a **leaf**'s section is its basement index (first key, offset, length, entry count
//!   and crc32c of each basement); the basements follow one after another, the first
//!   right after the index (it is not padded to a block), so a point query reads the
//!   index and the blocks of one basement, not the whole leaf;
//! * a **delta**'s section names an extent of the same node written whole (its *base*),
//!   holds a copy of the base's section (a leaf's basement index, an internal node's
//!   children, pivots and buffer places, each pointing into the base), and says where
//!   the delta lies: one message buffer, with its filter, that follows the section. The
//!   node is the base with the delta's messages applied. A flush into a node whose
//!   delta has room writes the delta alone at the next checkpoint, not the whole node
//!   (see `Delta`).

use crate::codec::{crc32c, key_cmp, key_prefix, verify, Reader, Writer};
pub use crate::entries::Entries;
use crate::format::Extent;
use crate::lift::Lift;
use crate::msg::{Buffer, Msg, Msn, RangeDel, Upserts};
use crate::points::Points;
use crate::{Error, Result};
use std::borrow::Cow;

pub type NodeId = u64;

const MAGIC_INTERNAL: u32 = u32::from_le_bytes(*b"QBNI");
const MAGIC_LEAF: u32 = u32::from_le_bytes(*b"QBNL");
const MAGIC_DELTA: u32 = u32::from_le_bytes(*b"QBND");

/// What a node's extent holds, by its magic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Internal,
    Leaf,
    /// A delta over a leaf extent of the same node.
    Delta,
}
/// Version 2 added lifts to internal nodes; version 1 nodes (no lifts) still decode.
/// Version 3 added deltas (written with version 3; the other kinds keep 2's layout).
/// Version 4 cuts an internal node's buffers into runs for point queries (see
/// `BufferRef::runs`); nodes of versions 1-3 still decode.
pub(crate) const VERSION: u16 = 4;
pub const PREFIX: usize = 32;
const CRC_AT: usize = 24;

#[derive(Debug, Clone)]
pub struct Internal {
    /// 1: the children are leaves.
    pub height: u16,
    /// `pivots[i]` separates child `i` (keys below it) from child `i + 1`.
    pub pivots: Vec<Vec<u8>>,
    pub children: Vec<NodeId>,
    pub buffers: Vec<Buffer>,
    /// The lift on the edge to each child (`lift.rs`): `None` for most.
    pub lifts: Vec<Option<Lift>>,
    /// A node read for queries holds only the buffers read so far: `unread[i]` says
    /// where buffer `i` lies in the extent (empty: every buffer is loaded). Only whole
    /// nodes are changed.
    pub unread: Vec<Option<BufferRef>>,
    /// Messages flushed in since the node was as `delta.base` holds it, for any child
    /// (see `Delta`; the buffers' places in `unread` are in the base's extent).
    pub delta: Delta,
}

/// Where one buffer of an internal node lies in its extent, and what a point query may
/// skip it by: a buffer with no range delete whose filter rules the key out holds no
/// message for it (most buffers, for most keys: they hold only recent changes).
///
/// From version 4 the buffer's point messages are also indexed in runs of about a
/// basement (`runs`), and `crc` covers only the buffer's head (its range deletes and
/// message count) while each run has its own: a point query reads the head only if the
/// buffer has range deletes, and then the one run that would hold its key, instead of
/// the whole buffer (about 21 KiB at 10 M keys, 60% of the bytes a query read). A
/// buffer's bytes are laid out as before, so a whole read decodes it the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferRef {
    pub offset: u32,
    pub len: u32,
    pub crc: u32,
    pub ranges: u32,
    /// A Bloom filter of the buffer's keys (`Probes`), ten bits per key.
    pub filter: Vec<u64>,
    /// Its point messages' runs, following its head and one another to its end (offsets
    /// in the extent). Empty in nodes before version 4 (`crc` covers the whole buffer)
    /// and for a buffer with no point message.
    pub runs: RunIndex,
}

/// A buffer's run index as its node's section holds it: per run its first key (u32
/// length, bytes), then offset, length, key count and crc32c. Kept encoded, one
/// allocation however many runs: decoding each run's key into a vector of its own cost
/// opening an internal node some eighty allocations, and scans 7%.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunIndex {
    raw: Vec<u8>,
}

/// Where one run lies, how many keys it holds and its crc32c.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunPlace {
    pub offset: u32,
    pub len: u32,
    pub groups: u32,
    pub crc: u32,
}

impl RunIndex {
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// The runs in order, with their first keys (checked when the index was read).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], RunPlace)> + '_ {
        let mut r = Reader::new(&self.raw, "run index");
        std::iter::from_fn(move || {
            if r.remaining() == 0 {
                return None;
            }
            let lo = r.bytes().ok()?;
            let (offset, len) = (r.u32().ok()?, r.u32().ok()?);
            let (groups, crc) = (r.u32().ok()?, r.u32().ok()?);
            Some((
                lo,
                RunPlace {
                    offset,
                    len,
                    groups,
                    crc,
                },
            ))
        })
    }

    pub fn first(&self) -> Option<RunPlace> {
        self.iter().next().map(|(_, p)| p)
    }

    /// The run that would hold `key`: the last whose first key is not above it.
    pub fn find(&self, key: &[u8]) -> Option<RunPlace> {
        self.iter()
            .take_while(|(lo, _)| key_cmp(lo, key).is_le())
            .last()
            .map(|(_, p)| p)
    }
}

/// What a point query reads of an unread buffer for one key.
pub enum BufferProbe {
    /// Nothing: the buffer holds no message for the key.
    Skip,
    /// All of it (a buffer before version 4), searched in place.
    Whole(BufferRef),
    /// Its head (where the range deletes are: offset, length, crc32c) if it has range
    /// deletes, and the run that would hold the key if the filter admits it.
    Parts {
        head: Option<(u32, u32, u32)>,
        run: Option<RunPlace>,
    },
}

impl BufferRef {
    /// Where the buffer lies, without its filter (what reading it needs).
    pub fn place(&self) -> BufferRef {
        BufferRef {
            filter: Vec::new(),
            runs: self.runs.clone(),
            ..*self
        }
    }

    /// `false` only if the buffer surely holds no message for `key`.
    pub fn may_hold(&self, key: &[u8]) -> bool {
        self.ranges > 0 || Probes::admits(&self.filter, key)
    }

    /// What a point query for `key` must read of the buffer.
    pub fn probe(&self, key: &[u8]) -> BufferProbe {
        if !self.may_hold(key) {
            return BufferProbe::Skip;
        }
        let Some(first) = self.runs.first() else {
            return BufferProbe::Whole(self.place());
        };
        // (`read_buffer_ref` checked that the runs follow the head.)
        let head_len = first.offset.saturating_sub(self.offset);
        BufferProbe::Parts {
            head: (self.ranges > 0).then_some((self.offset, head_len, self.crc)),
            run: Probes::admits(&self.filter, key)
                .then(|| self.runs.find(key))
                .flatten(),
        }
    }

    /// Memory its place takes beyond the struct (filter and run index).
    pub fn mem(&self) -> usize {
        self.filter.len() * 8 + self.runs.raw.len()
    }
}

const FILTER_PROBES: u32 = 3;

const FILTER_SEED: u32 = 0x9e37_79b9;

/// The second hash, `crc32c_append(FILTER_SEED, key)`, from the first (`crc32c(key)`)
/// without a second pass over the key: a CRC is linear in its initial value, so the two
/// differ by a term that depends on the key's length alone (tabled for short keys).
/// Building filters for whole internal nodes hashed every key twice, a twentieth of the
/// checkpoint thread's time.
fn second_hash(h1: u32, key: &[u8]) -> u32 {
    const TABLED: usize = 64;
    static TERMS: std::sync::OnceLock<[u32; TABLED + 1]> = std::sync::OnceLock::new();
    let term = |n: usize| {
        let zeros = vec![0u8; n];
        crc32c::crc32c_append(FILTER_SEED, &zeros) ^ crc32c::crc32c(&zeros)
    };
    if key.len() > TABLED {
        return crc32c::crc32c_append(FILTER_SEED, key);
    }
    h1 ^ TERMS.get_or_init(|| std::array::from_fn(term))[key.len()]
}

/// Where a key's bits lie in a filter of `words` words: `(h1 + j * h2) % bits` for
/// `j` in `0..FILTER_PROBES`, the layout every filter on disk was built with. The
/// remainders come from one multiplication each (Lemire's fastmod; `h1`, `h2` and
/// `bits` fit 32 bits) and the later probes by stepping: a filter is built for every
/// key of a node a checkpoint writes whole, and three divisions a key were a tenth of
/// the checkpoint thread's time.
#[derive(Clone, Copy)]
struct Probes {
    bits: u64,
    /// `u64::MAX / bits + 1`; 0 when `bits` does not fit 32 bits (plain remainders).
    m: u64,
}

impl Probes {
    /// `None` for an empty filter (it rules nothing out).
    fn new(words: usize) -> Option<Probes> {
        let bits = (words as u64).checked_mul(64).filter(|&b| b > 0)?;
        let m = if bits <= u32::MAX as u64 {
            u64::MAX / bits + 1
        } else {
            0
        };
        Some(Probes { bits, m })
    }

    fn rem(&self, a: u32) -> u64 {
        if self.m == 0 {
            return a as u64 % self.bits;
        }
        let low = self.m.wrapping_mul(a as u64);
        ((low as u128 * self.bits as u128) >> 64) as u64
    }

    fn of(&self, key: &[u8]) -> [usize; FILTER_PROBES as usize] {
        let h1 = crc32c::crc32c(key);
        let h2 = second_hash(h1, key) | 1;
        let (mut x, step) = (self.rem(h1), self.rem(h2));
        std::array::from_fn(|_| {
            let at = x as usize;
            x += step;
            if x >= self.bits {
                x -= self.bits;
            }
            at
        })
    }

    fn admits(filter: &[u64], key: &[u8]) -> bool {
        let Some(p) = Probes::new(filter.len()) else {
            return true;
        };
        p.of(key)
            .iter()
            .all(|&b| filter[b / 64] & (1 << (b % 64)) != 0)
    }
}

fn filter_for(b: &Buffer) -> Vec<u64> {
    let points = b.points.settled();
    let words = (points.groups_len() * 10).div_ceil(64).max(1);
    let mut f = vec![0u64; words];
    let p = Probes::new(words).expect("at least one word");
    for k in points.keys() {
        for bit in p.of(k) {
            f[bit / 64] |= 1 << (bit % 64);
        }
    }
    f
}

impl Internal {
    pub fn new(
        height: u16,
        pivots: Vec<Vec<u8>>,
        children: Vec<NodeId>,
        buffers: Vec<Buffer>,
    ) -> Internal {
        Internal {
            height,
            pivots,
            lifts: vec![None; children.len()],
            children,
            buffers,
            unread: Vec::new(),
            delta: Delta::default(),
        }
    }

    /// Cuts the node after child `p` (whose upper pivot is dropped): keeps children
    /// `..=p`, returns the rest as a node of the same height.
    pub fn split_after(&mut self, p: usize) -> Internal {
        let children = self.children.split_off(p + 1);
        let buffers = self.buffers.split_off(p + 1);
        let lifts = self.lifts.split_off(p + 1);
        let pivots = self.pivots.split_off(p + 1);
        self.pivots.pop();
        Internal {
            height: self.height,
            pivots,
            children,
            buffers,
            lifts,
            unread: Vec::new(),
            delta: Delta::default(),
        }
    }

    pub fn is_whole(&self) -> bool {
        self.unread.iter().all(Option::is_none)
    }

    /// Whether buffer `i` holds a message, loaded or not (an encoded buffer with no
    /// message is its two counts: 8 bytes).
    pub fn holds_messages(&self, i: usize) -> bool {
        !self.buffers[i].is_empty()
            || self
                .unread
                .get(i)
                .and_then(Option::as_ref)
                .is_some_and(|r| r.ranges > 0 || r.len > 8)
    }

    /// Whether any message waits here: in a buffer, or in the node's delta.
    pub fn holds_any_message(&self) -> bool {
        !self.delta.is_empty() || (0..self.children.len()).any(|i| self.holds_messages(i))
    }

    pub fn child_for(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| key_cmp(p, key).is_le())
    }

    /// Keys of child `i`: `lo..hi` (`None`: unbounded on that side, within this node).
    pub fn child_range(&self, i: usize) -> (Option<&[u8]>, Option<&[u8]>) {
        let lo = i.checked_sub(1).map(|j| self.pivots[j].as_slice());
        let hi = self.pivots.get(i).map(|p| p.as_slice());
        (lo, hi)
    }

    pub fn bytes(&self) -> usize {
        PREFIX
            + 4
            + self.children.len() * 16
            + self.pivots.iter().map(|p| p.len() + 4).sum::<usize>()
            + self.buffers.iter().map(|b| b.bytes() + 8).sum::<usize>()
            + self.lifts.iter().flatten().map(Lift::bytes).sum::<usize>()
    }

    /// The child whose buffer holds the most bytes (the flush target).
    pub fn heaviest(&self) -> Option<usize> {
        (0..self.buffers.len())
            .filter(|&i| !self.buffers[i].is_empty())
            .max_by_key(|&i| self.buffers[i].bytes())
    }

    pub fn route(&mut self, key: Vec<u8>, msn: Msn, msg: Msg) {
        let i = self.child_for(&key);
        self.buffers[i].push(key, msn, msg);
    }

    /// Takes a whole buffer flushed from the parent: its range deletes first (they drop
    /// older messages below), then its point messages, cut at the pivots with
    /// `split_off` rather than routed one by one.
    pub fn absorb(&mut self, buf: Buffer) {
        for r in &buf.ranges {
            self.route_range(r);
        }
        let mut points = buf.points;
        points.settle();
        // Each child takes its run of the parent's groups, merged into its buffer.
        let n = points.groups_len();
        let mut a = 0;
        for i in 0..self.children.len() {
            if a == n {
                return;
            }
            let b = match self.pivots.get(i) {
                Some(p) => points.position(p),
                None => n,
            };
            if b > a {
                if self.buffers[i].points.is_empty() && a == 0 && b == n {
                    self.buffers[i].points = points;
                    return;
                }
                self.buffers[i].points.merge_range(&points, a, b);
            }
            a = b;
        }
    }

    /// Gives each child whose keys meet the range its clipped piece.
    pub fn route_range(&mut self, r: &RangeDel) {
        let first = self.child_for(&r.start);
        for i in first..self.children.len() {
            let (lo, hi) = self.child_range(i);
            if lo.is_some_and(|lo| lo >= r.end.as_slice()) {
                break;
            }
            let start = match lo {
                Some(lo) if lo > r.start.as_slice() => lo.to_vec(),
                _ => r.start.clone(),
            };
            let end = match hi {
                Some(hi) if hi < r.end.as_slice() => hi.to_vec(),
                _ => r.end.clone(),
            };
            if start < end {
                self.buffers[i].push_range(RangeDel {
                    msn: r.msn,
                    start,
                    end,
                });
            }
        }
    }
}

/// One basement as the leaf's index describes it.
#[derive(Debug, Clone)]
pub struct BasementRef {
    /// Its first key (the first basement's counts from the leaf's lower bound).
    pub lo: Vec<u8>,
    /// `key_prefix(lo)`, kept beside the offsets: a point query's search of a leaf's
    /// index then reads the keys only where prefixes tie (they were a cache miss each).
    pub lo_prefix: u64,
    pub offset: u32,
    pub len: u32,
    pub count: u32,
    pub crc: u32,
}

#[derive(Debug, Clone)]
pub enum LeafData {
    /// Every entry, sorted (a leaf being changed is always whole).
    Full(Entries),
    /// A clean leaf read for queries: its index and the basements read so far.
    Partial {
        index: Vec<BasementRef>,
        loaded: Vec<Option<Entries>>,
    },
}

#[derive(Debug, Clone)]
pub struct Leaf {
    pub data: LeafData,
    /// Entry bytes (`entry_bytes`) of a full leaf; the on-disk size of a partial one.
    pub bytes: usize,
    pub delta: Delta,
}

/// Where a node's contents lie on disk: an extent of the node written whole, and that
/// extent's section (its magic, checksum and all), which a delta over it copies.
#[derive(Debug, Clone)]
pub struct Base {
    pub extent: Extent,
    pub section: Vec<u8>,
}

/// A node's messages that are not applied to it yet.
///
/// A random write reaches a node as a flush of a few KiB, and rewriting the whole node
/// for it (256 KiB) was most of the tree's write amplification. While a node in memory
/// is exactly as an extent on disk holds it (`base`), a flush into it goes into the
/// delta instead, and a checkpoint writes the delta alone, pointing at the base. When
/// the delta would outgrow its limit, the node is read whole, the delta applied (a
/// leaf's entries updated, an internal node's buffers given their messages), and the
/// node written whole again.
///
/// Invariants: `base` is `None` as soon as the node changes in memory, and then the
/// delta is empty (`Inner::take_full` applies it first); a dirty node's delta is loaded
/// (`unread` is `None`). The delta's messages are newer than everything the base holds
/// and older than every message above the node.
#[derive(Debug, Clone, Default)]
pub struct Delta {
    pub base: Option<Base>,
    /// The messages, when loaded.
    pub buf: Buffer,
    /// Where the delta lies in the node's extent, while not read yet (a node read for
    /// queries).
    pub unread: Option<DeltaRef>,
}

/// Where a delta's messages lie in its extent, as its section says: its range deletes
/// (few: kept in the section), its point messages in runs of about a basement (a point
/// query whose key the filter admits reads one run, not the whole delta: with whole
/// 64 KiB deltas, point queries on a tree written at random were 15% slower), and a
/// Bloom filter of its keys.
#[derive(Debug, Clone)]
pub struct DeltaRef {
    pub ranges: Vec<RangeDel>,
    pub runs: Vec<RunRef>,
    pub filter: Vec<u64>,
}

/// One run of a delta's or a buffer's point messages: its first key, where it lies, how many keys
/// (groups) and its crc32c.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRef {
    pub lo: Vec<u8>,
    pub offset: u32,
    pub len: u32,
    pub groups: u32,
    pub crc: u32,
}

impl DeltaRef {
    /// Bytes of the point messages.
    pub fn bytes(&self) -> usize {
        self.runs.iter().map(|r| r.len as usize).sum()
    }

    /// `false` only if no point message of the delta is for `key`.
    pub fn may_hold(&self, key: &[u8]) -> bool {
        Probes::admits(&self.filter, key)
    }

    /// The run that holds `key` if any does.
    pub fn run_for(&self, key: &[u8]) -> Option<&RunRef> {
        let i = self.runs.partition_point(|r| key_cmp(&r.lo, key).is_le());
        i.checked_sub(1).map(|i| &self.runs[i])
    }

    /// The byte range of the extent that holds every run (they follow one another).
    pub fn span(&self) -> (u32, u32) {
        match (self.runs.first(), self.runs.last()) {
            (Some(a), Some(b)) => (a.offset, b.offset + b.len - a.offset),
            _ => (0, 0),
        }
    }
}

/// A delta's messages from the bytes `span` names (every run's checksum verified).
pub fn decode_delta_runs(body: &[u8], at: &DeltaRef, id: NodeId) -> Result<Buffer> {
    let start = at.span().0;
    let mut points = Points::default();
    for run in &at.runs {
        let from = (run.offset - start) as usize;
        let bytes = body
            .get(from..from + run.len as usize)
            .ok_or_else(|| Error::Corrupt(format!("node {id}: delta run past its extent")))?;
        verify(crc32c(&[bytes]), run.crc, || format!("node {id}: delta"))?;
        let mut r = Reader::new(bytes, "delta run");
        let p = Points::decode(&mut r, run.groups as usize)?;
        if r.remaining() != 0 || p.groups_len() == 0 {
            return Err(Error::Corrupt(format!("node {id}: delta run length")));
        }
        points
            .append(p)
            .map_err(|e| e.within(&format!("node {id}")))?;
    }
    Ok(Buffer {
        points,
        ranges: at.ranges.clone(),
    })
}

/// The messages for `key` in one run of a delta or a buffer (`groups` keys), read from
/// disk (checksum verified).
pub fn run_lookup(
    bytes: &[u8],
    groups: u32,
    crc: u32,
    id: NodeId,
    key: &[u8],
) -> Result<Vec<(Msn, Msg)>> {
    verify(crc32c(&[bytes]), crc, || format!("node {id}: message run"))?;
    Points::lookup_encoded(bytes, groups as usize, key).map_err(|e| e.within(&format!("node {id}")))
}

/// Whether one of the range deletes in a buffer's head (read from disk, checksum
/// verified) covers `key`.
pub fn head_covers(head: &[u8], crc: u32, id: NodeId, key: &[u8]) -> Result<bool> {
    verify(crc32c(&[head]), crc, || format!("node {id}: buffer"))?;
    let mut r = Reader::new(head, "message buffer");
    let covered = read_ranges(&mut r)?.iter().any(|x| x.covers(key));
    r.u32()?; // the message count
    if r.remaining() != 0 {
        return Err(r.corrupt("trailing bytes in a buffer's head"));
    }
    Ok(covered)
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty() && self.unread.is_none()
    }

    fn mem(&self) -> usize {
        self.buf.bytes()
            + self.buf.points.len() * 8
            + self.unread.as_ref().map_or(0, |r| {
                r.filter.len() * 8 + r.runs.iter().map(|x| x.lo.len() + 48).sum::<usize>()
            })
            + self.base.as_ref().map_or(0, |b| b.section.len())
    }
}

impl Leaf {
    pub fn empty() -> Leaf {
        Leaf::full(Entries::default())
    }

    pub fn full(entries: Entries) -> Leaf {
        Leaf {
            bytes: entries.bytes(),
            data: LeafData::Full(entries),
            delta: Delta::default(),
        }
    }

    pub fn entries(&self) -> Option<&Entries> {
        match &self.data {
            LeafData::Full(e) => Some(e),
            LeafData::Partial { .. } => None,
        }
    }

    /// Applies a flushed buffer to a full leaf: range deletes first, then point messages
    /// (see `Buffer`), in one merge pass over the sorted entries.
    pub fn apply(&mut self, buf: Buffer, up: &Upserts) -> Result<()> {
        if !self.delta.is_empty() {
            return Err(Error::Invalid(
                "internal: applying messages past a leaf's delta".into(),
            ));
        }
        if self.apply_in_place(&buf, up)? {
            return Ok(());
        }
        let out = self.merged(&buf, up)?;
        *self = Leaf::full(out);
        Ok(())
    }

    /// A buffer of a few point messages (a root that is still a leaf gets one write's
    /// each) changes the entries where they are instead of in a rebuild of the leaf:
    /// every new value is worked out first, so an upsert that fails changes nothing.
    /// False when the buffer is not of that kind.
    fn apply_in_place(&mut self, buf: &Buffer, up: &Upserts) -> Result<bool> {
        const FEW: usize = 8;
        let LeafData::Full(old) = &mut self.data else {
            return Ok(false);
        };
        if !buf.ranges.is_empty() {
            return Ok(false);
        }
        let points = buf.points.settled();
        if points.groups_len() > FEW {
            return Ok(false);
        }
        let mut changes: Vec<(&[u8], Option<Vec<u8>>)> = Vec::with_capacity(FEW);
        for g in points.groups() {
            let v = old.value_of(g.key).map(Cow::Borrowed);
            let v = up.apply_all(v, g.msgs().map(|(_, m)| m))?;
            changes.push((g.key, v.map(Cow::into_owned)));
        }
        for (k, v) in changes {
            match (old.search(k), v) {
                (Ok(i), v) => old.splice(i, true, v.as_deref().map(|v| (k, v))),
                (Err(i), Some(v)) => old.splice(i, false, Some((k, &v))),
                (Err(_), None) => {}
            }
        }
        self.bytes = old.bytes();
        self.delta = Delta::default();
        Ok(true)
    }

    /// Applies the leaf's loaded delta to its full entries: the leaf changes only if
    /// that succeeds, and has no base and no delta after.
    pub fn apply_delta(&mut self, up: &Upserts) -> Result<()> {
        if self.delta.unread.is_some() {
            return Err(Error::Invalid("internal: applying an unread delta".into()));
        }
        if !self.delta.buf.is_empty() {
            let out = self.merged(&self.delta.buf, up)?;
            *self = Leaf::full(out);
        }
        self.delta = Delta::default();
        Ok(())
    }

    /// The full entries with `buf` applied.
    fn merged(&self, buf: &Buffer, up: &Upserts) -> Result<Entries> {
        let LeafData::Full(old) = &self.data else {
            return Err(Error::Invalid(
                "internal: applying messages to a partial leaf".into(),
            ));
        };
        let points = buf.points.settled();
        let mut out =
            Entries::with_capacity(old.bytes() + points.bytes, old.len() + points.groups_len());
        let kept = |k: &[u8]| !buf.ranges.iter().any(|r| r.covers(k));
        let mut i = 0;
        for g in points.groups() {
            let k = g.key;
            // Entries before this key: copied in runs.
            let start = i;
            while i < old.len() && old.key(i) < k {
                i += 1;
            }
            copy_kept(&mut out, old, start, i, &buf.ranges, &kept);
            // The value, borrowed until an upsert must compute a new one.
            let v: Option<Cow<[u8]>> = if i < old.len() && old.key(i) == k {
                i += 1;
                let (ek, ev) = old.get(i - 1);
                kept(ek).then_some(Cow::Borrowed(ev))
            } else {
                None
            };
            if let Some(v) = up.apply_all(v, g.msgs().map(|(_, m)| m))? {
                out.push(k, &v);
            }
        }
        copy_kept(&mut out, old, i, old.len(), &buf.ranges, &kept);
        Ok(out)
    }

    /// Cuts a full leaf at `key`: keeps the entries below it, returns the others.
    pub fn split_at(&mut self, key: &[u8]) -> Result<Leaf> {
        let LeafData::Full(all) = &self.data else {
            return Err(Error::Invalid("internal: cutting a partial leaf".into()));
        };
        let at = all.search(key).unwrap_or_else(|i| i);
        let mut left = Entries::with_capacity(all.body(0, at).len(), at);
        left.extend_from(all, 0, at);
        let mut right = Entries::with_capacity(all.body(at, all.len()).len(), all.len() - at);
        right.extend_from(all, at, all.len());
        *self = Leaf::full(left);
        Ok(Leaf::full(right))
    }

    /// Splits a full leaf into pieces of at most `max` bytes. Returns the pieces after
    /// the first, each with its first key as pivot.
    pub fn split(&mut self, max: usize) -> Vec<(Vec<u8>, Leaf)> {
        let LeafData::Full(all) = &self.data else {
            return Vec::new();
        };
        if self.bytes <= max || all.len() < 2 {
            return Vec::new();
        }
        // Pieces packed three quarters full from the left, the rest in the last (which
        // is at least a sixteenth of a node, or it joins the one before). An even split
        // leaves leaves half full for good when keys arrive in order (a file system's
        // paths under one directory do): a third of the device lost. Full pieces would
        // split again at the next message.
        let target = max * 3 / 4;
        let mut cuts = vec![0];
        let mut acc = 0;
        for i in 0..all.len() {
            let b = all.size(i);
            if acc + b > target && i > *cuts.last().expect("one cut") {
                cuts.push(i);
                acc = 0;
            }
            acc += b;
        }
        if cuts.len() > 2 && acc < max / 16 {
            cuts.pop();
        }
        cuts.push(all.len());
        let mut leaves: Vec<Leaf> = cuts
            .windows(2)
            .map(|w| {
                let mut e = Entries::with_capacity(all.body(w[0], w[1]).len(), w[1] - w[0]);
                e.extend_from(all, w[0], w[1]);
                Leaf::full(e)
            })
            .collect();
        let rest = leaves.split_off(1);
        *self = leaves.pop().expect("one piece");
        rest.into_iter()
            .map(|l| {
                (
                    l.entries().map(|e| e.key(0).to_vec()).unwrap_or_default(),
                    l,
                )
            })
            .collect()
    }
}

/// Copies entries `from..to` of `old` that no range delete covers, in runs.
fn copy_kept(
    out: &mut Entries,
    old: &Entries,
    from: usize,
    to: usize,
    ranges: &[RangeDel],
    kept: &impl Fn(&[u8]) -> bool,
) {
    if ranges.is_empty() {
        out.extend_from(old, from, to);
        return;
    }
    let mut run = from;
    for i in from..to {
        if !kept(old.key(i)) {
            out.extend_from(old, run, i);
            run = i + 1;
        }
    }
    out.extend_from(old, run, to);
}

#[derive(Debug, Clone)]
pub enum Node {
    Internal(Internal),
    Leaf(Leaf),
}

/// What the cache charges for a basement's or leaf's entries (part of `Node::mem`).
pub fn entries_mem(e: &Entries) -> usize {
    e.bytes() + e.len() * 4 + 64
}

impl Node {
    /// Memory the cache charges for the node (an estimate).
    pub fn mem(&self) -> usize {
        let entries = entries_mem;
        match self {
            Node::Internal(n) => {
                n.bytes()
                    + n.delta.mem()
                    + n.unread
                        .iter()
                        .flatten()
                        .map(|r| r.mem() + 48)
                        .sum::<usize>()
                    + n.buffers.iter().map(|b| b.points.len() * 8).sum::<usize>()
            }
            Node::Leaf(l) => {
                l.delta.mem()
                    + match &l.data {
                        LeafData::Full(e) => entries(e),
                        LeafData::Partial { index, loaded } => {
                            index.iter().map(|b| b.lo.len() + 64).sum::<usize>()
                                + loaded.iter().flatten().map(entries).sum::<usize>()
                        }
                    }
            }
        }
    }

    pub fn height(&self) -> u16 {
        match self {
            Node::Internal(n) => n.height,
            Node::Leaf(_) => 0,
        }
    }
}

// ---- encoding ----

fn prefix(w: &mut Writer, magic: u32, id: NodeId, height: u16) {
    w.u32(magic);
    w.u16(VERSION);
    w.u8(match magic {
        MAGIC_LEAF => 0,
        MAGIC_INTERNAL => 1,
        _ => 2,
    });
    w.u8(0);
    w.u64(id);
    w.u16(height);
    w.u16(0);
    w.u32(0); // section length
    w.u32(0); // crc
    w.u32(0);
    debug_assert_eq!(w.len(), PREFIX);
}

fn seal_section(w: &mut Writer, len: usize) {
    w.put_u32_at(20, len as u32);
    let crc = crc32c(&[&w.buf[..len]]);
    w.put_u32_at(CRC_AT, crc);
}

fn skip_msg(r: &mut Reader) -> Result<()> {
    r.u64()?;
    match r.u8()? {
        1 => r.bytes().map(|_| ()),
        2 => Ok(()),
        3 => {
            r.u16()?;
            r.bytes().map(|_| ())
        }
        k => Err(r.corrupt(format!("unknown message kind {k}"))),
    }
}

fn get_msg(r: &mut Reader) -> Result<(Msn, Msg)> {
    let msn = r.u64()?;
    let m = match r.u8()? {
        1 => Msg::Put(r.bytes()?.to_vec()),
        2 => Msg::Delete,
        3 => {
            let func = r.u16()?;
            Msg::Upsert {
                func,
                arg: r.bytes()?.to_vec(),
            }
        }
        k => return Err(r.corrupt(format!("unknown message kind {k}"))),
    };
    Ok((msn, m))
}

/// Checks the checksums of a whole buffer read from disk: of all of it before version
/// 4, of its head and each run after (`decode_internal` checked that the runs follow
/// the head and one another to the buffer's end).
fn check_buffer(body: &[u8], at: &BufferRef, id: NodeId) -> Result<()> {
    let what = || format!("node {id}: buffer");
    let Some(first) = at.runs.first() else {
        return verify(crc32c(&[body]), at.crc, what);
    };
    let part = |offset: u32, len: u32| {
        let from = offset.wrapping_sub(at.offset) as usize;
        body.get(from..from.saturating_add(len as usize))
    };
    let outside = || {
        Err(Error::Corrupt(format!(
            "node {id}: a buffer run past its extent"
        )))
    };
    let Some(head) = part(at.offset, first.offset.saturating_sub(at.offset)) else {
        return outside();
    };
    verify(crc32c(&[head]), at.crc, what)?;
    for (_, run) in at.runs.iter() {
        let Some(b) = part(run.offset, run.len) else {
            return outside();
        };
        verify(crc32c(&[b]), run.crc, || format!("node {id}: buffer run"))?;
    }
    Ok(())
}

/// Decodes one buffer of an internal node (checksums verified).
pub fn decode_buffer(body: &[u8], at: &BufferRef, id: NodeId) -> Result<Buffer> {
    check_buffer(body, at, id)?;
    let mut r = Reader::new(body, "message buffer");
    let ranges = read_ranges(&mut r)?;
    let np = r.u32()? as usize;
    if np > r.remaining() {
        return Err(r.corrupt("message count past the end"));
    }
    let points = Points::decode(&mut r, np)?;
    if r.remaining() != 0 {
        return Err(r.corrupt("trailing bytes"));
    }
    Ok(Buffer { points, ranges })
}

/// One key's messages in an encoded buffer, found without decoding the rest (checksum
/// verified): whether a range delete of the buffer covers the key, and its point
/// messages in order. (The window `key..key\0` holds exactly the key.)
pub fn buffer_lookup(
    body: &[u8],
    at: &BufferRef,
    id: NodeId,
    key: &[u8],
) -> Result<(bool, Vec<(Msn, Msg)>)> {
    let next = [key, &[0]].concat();
    let (ranges, points) = buffer_window(body, at, id, key, Some(&next))?;
    Ok((
        !ranges.is_empty(),
        points
            .into_iter()
            .next()
            .map(|(_, m)| m)
            .unwrap_or_default(),
    ))
}

/// The messages of an encoded buffer for keys in `lo..hi`, found without decoding the
/// rest (checksum verified): its range deletes, and the point messages in the window.
#[allow(clippy::type_complexity)]
pub fn buffer_window(
    body: &[u8],
    at: &BufferRef,
    id: NodeId,
    lo: &[u8],
    hi: Option<&[u8]>,
) -> Result<(Vec<RangeDel>, Vec<(Vec<u8>, Vec<(Msn, Msg)>)>)> {
    check_buffer(body, at, id)?;
    let mut r = Reader::new(body, "message buffer");
    let mut ranges = read_ranges(&mut r)?;
    ranges.retain(|x| x.end.as_slice() > lo && hi.is_none_or(|h| x.start.as_slice() < h));
    let np = r.u32()? as usize;
    if np > r.remaining() {
        return Err(r.corrupt("message count past the end"));
    }
    let mut points = Vec::new();
    let mut prev: Option<&[u8]> = None;
    for _ in 0..np {
        let k = r.bytes()?;
        let nm = r.u32()? as usize;
        if nm == 0 || nm > r.remaining() {
            return Err(r.corrupt("message list length"));
        }
        if prev.is_some_and(|p| p >= k) {
            return Err(r.corrupt("keys out of order"));
        }
        prev = Some(k);
        if hi.is_some_and(|h| k >= h) {
            break; // sorted: nothing more in the window
        }
        if k < lo {
            for _ in 0..nm {
                skip_msg(&mut r)?;
            }
            continue;
        }
        let list = (0..nm)
            .map(|_| get_msg(&mut r))
            .collect::<Result<Vec<_>>>()?;
        points.push((k.to_vec(), list));
    }
    if hi.is_none() && r.remaining() != 0 {
        return Err(r.corrupt("trailing bytes"));
    }
    Ok((ranges, points))
}

/// Serializes a node into whole blocks of `bs` bytes.
pub fn encode(id: NodeId, node: &Node, bs: usize, basement_bytes: usize) -> Vec<u8> {
    match node {
        Node::Internal(n) if n.delta.base.is_some() => {
            encode_delta(id, n.height, &n.delta, bs, basement_bytes)
        }
        Node::Internal(n) => {
            debug_assert!(n.is_whole(), "only whole internal nodes are written");
            debug_assert!(n.delta.is_empty(), "a changed node has no delta");
            // The section: children, pivots, and where each buffer and each run of its
            // point messages lies; the buffers follow it, packed. They are encoded in
            // place after the section, whose places are filled in afterwards.
            let filters: Vec<Vec<u64>> = n.buffers.iter().map(filter_for).collect();
            let settled: Vec<Cow<Points>> = n.buffers.iter().map(|b| b.points.settled()).collect();
            let runs: Vec<Vec<_>> = settled.iter().map(|p| p.runs(basement_bytes)).collect();
            let filter_bytes: usize = filters
                .iter()
                .zip(&runs)
                .map(|(f, r)| {
                    24 + f.len() * 8 + r.iter().map(|x| 4 + x.0.len() + 16).sum::<usize>()
                })
                .sum();
            let mut w = Writer::with_capacity(n.bytes() + filter_bytes + bs);
            prefix(&mut w, MAGIC_INTERNAL, id, n.height);
            w.u32(n.children.len() as u32);
            for c in &n.children {
                w.u64(*c);
            }
            for p in &n.pivots {
                w.bytes(p);
            }
            for l in &n.lifts {
                match l {
                    None => w.u8(0),
                    Some(l) => {
                        w.u8(1);
                        w.bytes(&l.inner);
                        w.bytes(&l.outer);
                    }
                }
            }
            let section = w.len() + filter_bytes;
            // (Where each buffer's place and each of its runs' is, to fill in.)
            let mut places: Vec<(usize, Vec<usize>)> = Vec::with_capacity(n.buffers.len());
            for ((buf, f), rs) in n.buffers.iter().zip(&filters).zip(&runs) {
                let at = w.len();
                w.u32(0); // offset, length, crc: below
                w.u32(0);
                w.u32(0);
                w.u32(buf.ranges.len() as u32);
                w.u32(f.len() as u32);
                for word in f {
                    w.u64(*word);
                }
                w.u32(rs.len() as u32);
                let mut run_at = Vec::with_capacity(rs.len());
                for (lo, bytes, groups) in rs {
                    w.bytes(lo);
                    run_at.push(w.len());
                    w.u32(0); // offset: below
                    w.u32(bytes.len() as u32);
                    w.u32(*groups);
                    w.u32(crc32c(&[bytes]));
                }
                places.push((at, run_at));
            }
            debug_assert_eq!(w.len(), section);
            for (((buf, p), rs), (at, run_at)) in
                n.buffers.iter().zip(&settled).zip(&runs).zip(places)
            {
                // The head: range deletes and the message count (`decode_buffer`).
                let off = w.len();
                write_ranges(&mut w, &buf.ranges);
                w.u32(p.groups_len() as u32);
                let crc = crc32c(&[&w.buf[off..]]);
                // Then the groups, run by run (together, exactly the settled arena).
                for ((_, bytes, _), ra) in rs.iter().zip(run_at) {
                    w.put_u32_at(ra, w.len() as u32);
                    w.raw(bytes);
                }
                w.put_u32_at(at, off as u32);
                w.put_u32_at(at + 4, (w.len() - off) as u32);
                w.put_u32_at(at + 8, crc);
            }
            seal_section(&mut w, section);
            w.pad_to(bs);
            w.buf
        }
        Node::Leaf(l) if l.delta.base.is_some() => {
            encode_delta(id, 0, &l.delta, bs, basement_bytes)
        }
        Node::Leaf(l) => {
            let empty = Entries::default();
            debug_assert!(l.entries().is_some(), "only full leaves are written");
            debug_assert!(l.delta.is_empty(), "a changed leaf has no delta");
            let entries = l.entries().unwrap_or(&empty);
            // Cut the entries into basements of about `basement_bytes`.
            let mut cuts = vec![0usize];
            let mut acc = 0;
            for i in 0..entries.len() {
                let b = entries.size(i);
                if acc > 0 && acc + b > basement_bytes {
                    cuts.push(i);
                    acc = 0;
                }
                acc += b;
            }
            cuts.push(entries.len());
            let groups: Vec<(usize, usize)> = cuts.windows(2).map(|c| (c[0], c[1])).collect();
            let mut w = Writer::with_capacity(l.bytes + bs * (groups.len() + 2));
            prefix(&mut w, MAGIC_LEAF, id, 0);
            w.u32(groups.len() as u32);
            let first_key = |a: usize, b: usize| if a < b { entries.key(a) } else { &[][..] };
            let index_len: usize = PREFIX
                + 4
                + groups
                    .iter()
                    .map(|&(a, b)| first_key(a, b).len() + 4 + 16)
                    .sum::<usize>();
            // The basements follow the index at once (not on the next block: with 64 KiB
            // leaves of 4 KiB file blocks, the padding was one block in thirteen).
            let mut off = index_len;
            for &(a, b) in &groups {
                let body = entries.body(a, b);
                w.bytes(first_key(a, b));
                w.u32(off as u32);
                w.u32(body.len() as u32);
                w.u32((b - a) as u32);
                w.u32(crc32c(&[body]));
                off += body.len();
            }
            debug_assert_eq!(w.len(), index_len);
            seal_section(&mut w, index_len);
            // Basements one after another, not each on a block boundary: a 4 KiB file
            // block with its key is a little over a block, and padding each basement
            // doubled the space a file system's data took. A basement read covers the
            // blocks it spans (at most one more than its length needs).
            for &(a, b) in &groups {
                w.raw(entries.body(a, b));
            }
            w.pad_to(bs);
            w.buf
        }
    }
}

/// A delta: the base it applies to (with a copy of the base's section), its range
/// deletes, where its runs of point messages lie and its filter; the runs follow.
fn encode_delta(id: NodeId, height: u16, d: &Delta, bs: usize, run_bytes: usize) -> Vec<u8> {
    let base = d.base.as_ref().expect("a delta has a base");
    debug_assert!(d.unread.is_none(), "a changed delta is loaded");
    let points = d.buf.points.settled();
    let runs = points.runs(run_bytes);
    let filter = filter_for(&d.buf);
    let body: usize = runs.iter().map(|r| r.1.len()).sum();
    let mut w = Writer::with_capacity(body + base.section.len() + bs * 2);
    prefix(&mut w, MAGIC_DELTA, id, height);
    w.u64(base.extent.start);
    w.u64(base.extent.blocks);
    w.bytes(&base.section);
    write_ranges(&mut w, &d.buf.ranges);
    let section =
        w.len() + 4 + runs.iter().map(|r| r.0.len() + 4 + 16).sum::<usize>() + 4 + filter.len() * 8;
    w.u32(runs.len() as u32);
    let mut off = section;
    for (lo, bytes, groups) in &runs {
        w.bytes(lo);
        w.u32(off as u32);
        w.u32(bytes.len() as u32);
        w.u32(*groups);
        w.u32(crc32c(&[bytes]));
        off += bytes.len();
    }
    w.u32(filter.len() as u32);
    for word in &filter {
        w.u64(*word);
    }
    debug_assert_eq!(w.len(), section);
    seal_section(&mut w, section);
    for (_, bytes, _) in &runs {
        w.raw(bytes);
    }
    w.pad_to(bs);
    w.buf
}

/// A delta's section (checksum verified): the height of its node, its base (the
/// extent checked by nothing but the caller, the copied section by whoever decodes
/// it) and where its messages lie in the delta's own extent of `extent_bytes`.
pub fn decode_delta(sec: &[u8], id: NodeId, extent_bytes: usize) -> Result<(u16, Base, DeltaRef)> {
    check_section(sec, id)?;
    let mut r = Reader::new(sec, "delta");
    r.skip(6)?; // magic, version: checked by `section_len`
    r.skip(10)?; // kind, id: checked by `section_len`
    let height = r.u16()?;
    let bad = |why: &str| Error::Corrupt(format!("node {id}: {why}"));
    let mut r = Reader::new(&sec[PREFIX..], "delta");
    let extent = Extent {
        start: r.u64()?,
        blocks: r.u64()?,
    };
    let section = r.bytes()?.to_vec();
    if section.len() < PREFIX {
        return Err(bad("base section too short"));
    }
    let ranges = read_ranges(&mut r)?;
    // Runs follow the section and one another, within the delta's extent.
    let (index, end) = read_runs(&mut r, id, sec.len() as u64, true)?;
    if end > extent_bytes as u64 {
        return Err(bad("delta runs out of bounds or order"));
    }
    let runs: Vec<RunRef> = index
        .iter()
        .map(|(lo, p)| RunRef {
            lo: lo.to_vec(),
            offset: p.offset,
            len: p.len,
            groups: p.groups,
            crc: p.crc,
        })
        .collect();
    let words = r.u32()? as usize;
    if words == 0 || words > r.remaining() / 8 {
        return Err(bad("delta filter size"));
    }
    let filter = (0..words).map(|_| r.u64()).collect::<Result<Vec<u64>>>()?;
    if r.remaining() != 0 {
        return Err(bad("trailing bytes in the section"));
    }
    Ok((
        height,
        Base { extent, section },
        DeltaRef {
            ranges,
            runs,
            filter,
        },
    ))
}

fn read_basement_ref(r: &mut Reader) -> Result<BasementRef> {
    let lo = r.bytes()?.to_vec();
    Ok(BasementRef {
        lo_prefix: key_prefix(&lo),
        lo,
        offset: r.u32()?,
        len: r.u32()?,
        count: r.u32()?,
        crc: r.u32()?,
    })
}

/// Range deletes as buffers and deltas hold them: a count, then each one's MSN, start
/// and end.
fn write_ranges(w: &mut Writer, ranges: &[RangeDel]) {
    w.u32(ranges.len() as u32);
    for r in ranges {
        w.u64(r.msn);
        w.bytes(&r.start);
        w.bytes(&r.end);
    }
}

/// What `write_ranges` wrote.
fn read_ranges(r: &mut Reader) -> Result<Vec<RangeDel>> {
    let n = r.u32()? as usize;
    if n > r.remaining() {
        return Err(r.corrupt("range count past the end"));
    }
    let mut ranges = Vec::with_capacity(n);
    for _ in 0..n {
        let msn = r.u64()?;
        let (start, end) = (r.bytes()?.to_vec(), r.bytes()?.to_vec());
        ranges.push(RangeDel { msn, start, end });
    }
    Ok(ranges)
}

/// A run index as a delta's or a buffer's section holds it (a count, then per run its
/// first key, offset, length, key count and crc32c), checked: every run holds keys,
/// first keys ascend, and the runs follow one another from `first` (exactly there if
/// `exact`, else anywhere after it). Returns it with where the last run ends (`first`
/// if there is none).
fn read_runs(r: &mut Reader, id: NodeId, first: u64, exact: bool) -> Result<(RunIndex, u64)> {
    let bad = |why: String| Err(Error::Corrupt(format!("node {id}: {why}")));
    let n = r.u32()? as usize;
    if n > r.remaining() / 20 {
        return bad(format!("{n} message runs"));
    }
    let index = r.rest();
    let mut next = first;
    let mut prev: Option<&[u8]> = None;
    for i in 0..n {
        let lo = r.bytes()?;
        let (at, len, groups) = (r.u32()? as u64, r.u32()?, r.u32()?);
        r.u32()?; // crc
        let placed = if i == 0 && !exact {
            at >= next
        } else {
            at == next
        };
        if !placed || groups == 0 || prev.is_some_and(|p| p >= lo) {
            return bad("message runs out of bounds or order".into());
        }
        prev = Some(lo);
        next = at + len as u64;
    }
    let raw = index[..index.len() - r.remaining()].to_vec();
    Ok((RunIndex { raw }, next))
}

/// One buffer's place in an internal node's section (a node of `version`).
fn read_buffer_ref(r: &mut Reader, id: NodeId, version: u16) -> Result<BufferRef> {
    let (offset, len, crc, ranges) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let words = r.u32()? as usize;
    if words == 0 || words > r.remaining() / 8 {
        return Err(Error::Corrupt(format!(
            "node {id}: filter of {words} words"
        )));
    }
    let filter = (0..words).map(|_| r.u64()).collect::<Result<Vec<u64>>>()?;
    let mut runs = RunIndex::default();
    if version >= 4 {
        // The head is at least its two counts; the runs follow it and one another to
        // the buffer's end.
        let (index, end) = read_runs(r, id, offset as u64 + 8, false)?;
        if !index.is_empty() && end != offset as u64 + len as u64 {
            return Err(Error::Corrupt(format!(
                "node {id}: buffer runs do not end with their buffer"
            )));
        }
        runs = index;
    }
    Ok(BufferRef {
        offset,
        len,
        crc,
        ranges,
        filter,
        runs,
    })
}

/// What the first block of a node says about its section: (kind, section length).
pub fn section_len(first: &[u8], id: NodeId) -> Result<(Kind, usize)> {
    let mut r = Reader::new(first, "node prefix");
    let magic = r.u32()?;
    let version = r.u16()?;
    let kind = match magic {
        MAGIC_LEAF => Kind::Leaf,
        MAGIC_INTERNAL => Kind::Internal,
        MAGIC_DELTA => Kind::Delta,
        _ => {
            return Err(Error::Corrupt(format!(
                "node {id}: bad magic {magic:#010x}"
            )))
        }
    };
    if version == 0 || version > VERSION {
        return Err(Error::Corrupt(format!(
            "node {id}: unknown version {version}"
        )));
    }
    r.u8()?;
    r.u8()?;
    let got = r.u64()?;
    if got != id {
        return Err(Error::Corrupt(format!(
            "node {id}: extent holds node {got}"
        )));
    }
    r.u16()?;
    r.u16()?;
    let len = r.u32()? as usize;
    if len < PREFIX {
        return Err(Error::Corrupt(format!("node {id}: section length {len}")));
    }
    Ok((kind, len))
}

fn check_section(sec: &[u8], id: NodeId) -> Result<()> {
    let mut copy = sec.to_vec();
    let want = u32::from_le_bytes(copy[CRC_AT..CRC_AT + 4].try_into().expect("4 bytes"));
    copy[CRC_AT..CRC_AT + 4].fill(0);
    verify(crc32c(&[&copy]), want, || format!("node {id}"))
}

/// Decodes an internal node's section (checksum verified): children, pivots, and where
/// its buffers lie; the buffers are left unread (`Internal::unread`).
pub fn decode_internal(
    sec: &[u8],
    id: NodeId,
    max_children: usize,
    extent_bytes: usize,
) -> Result<Internal> {
    check_section(sec, id)?;
    let mut r = Reader::new(sec, "internal node");
    r.skip(4)?; // magic: checked by `section_len`
    let version = r.u16()?;
    r.skip(10)?; // kind, id: checked by `section_len`
    let height = r.u16()?;
    let mut r = Reader::new(&sec[PREFIX..], "internal node");
    let n = r.u32()? as usize;
    if n == 0 || n > max_children || height == 0 {
        return Err(Error::Corrupt(format!(
            "node {id}: {n} children at height {height}"
        )));
    }
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        children.push(r.u64()?);
    }
    let mut pivots: Vec<Vec<u8>> = Vec::with_capacity(n - 1);
    for _ in 1..n {
        let p = r.bytes()?.to_vec();
        if pivots.last().is_some_and(|q| *q >= p) {
            return Err(Error::Corrupt(format!("node {id}: pivots out of order")));
        }
        pivots.push(p);
    }
    // Version 1 nodes have no lifts.
    let mut lifts = vec![None; n];
    if version >= 2 {
        for l in &mut lifts {
            *l = match r.u8()? {
                0 => None,
                1 => {
                    let inner = r.bytes()?.to_vec();
                    let outer = r.bytes()?.to_vec();
                    if crate::lift::prefix_end(&outer).is_none() || inner == outer {
                        return Err(Error::Corrupt(format!("node {id}: invalid lift")));
                    }
                    Some(Lift { inner, outer })
                }
                k => return Err(Error::Corrupt(format!("node {id}: lift kind {k}"))),
            };
        }
    }
    let mut unread = Vec::with_capacity(n);
    for _ in 0..n {
        let at = read_buffer_ref(&mut r, id, version)?;
        if (at.offset as usize) < sec.len()
            || (at.offset as usize).saturating_add(at.len as usize) > extent_bytes
        {
            return Err(Error::Corrupt(format!("node {id}: buffer out of bounds")));
        }
        unread.push(Some(at));
    }
    if r.remaining() != 0 {
        return Err(Error::Corrupt(format!(
            "node {id}: trailing bytes in the section"
        )));
    }
    Ok(Internal {
        height,
        pivots,
        children,
        buffers: vec![Buffer::default(); n],
        lifts,
        unread,
        delta: Delta::default(),
    })
}

/// Decodes a leaf's basement index from its section (checksum verified).
pub fn decode_leaf_index(sec: &[u8], id: NodeId, extent_bytes: usize) -> Result<Vec<BasementRef>> {
    check_section(sec, id)?;
    let mut r = Reader::new(&sec[PREFIX..], "leaf index");
    let nb = r.u32()? as usize;
    if nb == 0 || nb > r.remaining() {
        return Err(Error::Corrupt(format!("node {id}: {nb} basements")));
    }
    let mut index: Vec<BasementRef> = Vec::with_capacity(nb);
    for _ in 0..nb {
        let b = read_basement_ref(&mut r)?;
        if (b.offset as usize) < sec.len()
            || (b.offset as usize).saturating_add(b.len as usize) > extent_bytes
            || index.last().is_some_and(|p| p.lo > b.lo)
        {
            return Err(Error::Corrupt(format!(
                "node {id}: basement index out of bounds or order"
            )));
        }
        index.push(b);
    }
    Ok(index)
}

/// Decodes one basement's entries (checksum verified).
pub fn decode_basement(body: &[u8], b: &BasementRef, id: NodeId) -> Result<Entries> {
    verify(crc32c(&[body]), b.crc, || format!("node {id}: basement"))?;
    Entries::from_body(body.to_vec(), b.count as usize).map_err(|e| e.within(&format!("node {id}")))
}

/// Appends a basement read from disk to `into` (checked as `decode_basement` checks it),
/// for a scan that streams basements instead of caching them.
pub fn append_basement(body: &[u8], b: &BasementRef, id: NodeId, into: &mut Entries) -> Result<()> {
    verify(crc32c(&[body]), b.crc, || format!("node {id}: basement"))?;
    into.append_body(body, b.count as usize)
        .map_err(|e| e.within(&format!("node {id}")))
}

/// The basement of `index` that holds `key`.
pub fn basement_for(index: &[BasementRef], key: &[u8]) -> usize {
    // A scan moving from leaf to leaf asks for the first basement (its cursor is the
    // leaf's lower bound): one comparison, not a search through keys that all share
    // their prefix (each a cache miss).
    if index.get(1).is_none_or(|b| key_cmp(key, &b.lo).is_lt()) {
        return 0;
    }
    let kp = key_prefix(key);
    index
        .partition_point(|b| match b.lo_prefix.cmp(&kp) {
            std::cmp::Ordering::Equal => key_cmp(&b.lo, key).is_le(),
            o => o.is_lt(),
        })
        .saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An internal node's buffers are written with runs (version 4): the runs tile each
    /// buffer after its head, a point query's parts (head and one run) find what the
    /// whole buffer holds for every key, a whole read decodes the buffer as it was, and
    /// a flipped byte in a run or a head is a checksum error.
    #[test]
    fn buffers_are_read_by_run() {
        let bs = 512;
        let key = |i: u32| format!("key{:06}", i * 7).into_bytes();
        let mut buffers = vec![Buffer::default(), Buffer::default(), Buffer::default()];
        for i in 0..600u32 {
            let msg = match i % 3 {
                0 => Msg::Put(vec![i as u8; (i % 50) as usize]),
                1 => Msg::Delete,
                _ => Msg::Upsert {
                    func: 1,
                    arg: vec![1; 3],
                },
            };
            buffers[(i % 2) as usize].push(key(i), i as u64 + 10, msg);
        }
        buffers[1].push_range(RangeDel {
            msn: 5000,
            start: key(100),
            end: key(110),
        });
        // (Buffer 2 stays empty: no runs.)
        let node = Node::Internal(Internal::new(
            1,
            vec![b"m".to_vec(), b"n".to_vec()],
            vec![7, 8, 9],
            buffers.clone(),
        ));
        let bytes = encode(3, &node, bs, 1024);
        let (kind, len) = section_len(&bytes, 3).unwrap();
        assert_eq!(kind, Kind::Internal);
        let n = decode_internal(&bytes[..len], 3, 16, bytes.len()).unwrap();
        for (b, at) in buffers.iter().zip(&n.unread) {
            let at = at.as_ref().unwrap();
            let body = &bytes[at.offset as usize..(at.offset + at.len) as usize];
            assert_eq!(at.runs.is_empty(), b.points.is_empty());
            if !b.points.is_empty() {
                let n = at.runs.iter().count();
                assert!(n > 5, "{n} runs of about 1 KiB");
            }
            // Whole, as before.
            let whole = decode_buffer(body, at, 3).unwrap();
            assert_eq!(whole.ranges, b.ranges);
            for i in 0..600u32 {
                let k = key(i);
                let want = (b.ranges.iter().any(|r| r.covers(&k)), b.points.get(&k));
                assert_eq!(whole.points.get(&k), want.1);
                // In parts, as a point query reads them.
                let got = match at.probe(&k) {
                    BufferProbe::Skip => (false, Vec::new()),
                    BufferProbe::Whole(_) => panic!("a version 4 buffer read whole"),
                    BufferProbe::Parts { head, run } => {
                        let covered = head.is_some_and(|(o, l, crc)| {
                            head_covers(&bytes[o as usize..(o + l) as usize], crc, 3, &k).unwrap()
                        });
                        let msgs = run.map_or(Vec::new(), |r| {
                            let b = &bytes[r.offset as usize..(r.offset + r.len) as usize];
                            run_lookup(b, r.groups, r.crc, 3, &k).unwrap()
                        });
                        (covered, msgs)
                    }
                };
                assert_eq!(got, want, "key {i}");
            }
        }
        // Damage: a byte of a run, then of a head.
        let at = n.unread[1].as_ref().unwrap();
        let (lo, run) = at.runs.iter().nth(2).unwrap();
        let mut bad = bytes.clone();
        bad[run.offset as usize + 3] ^= 1;
        let b = &bad[run.offset as usize..(run.offset + run.len) as usize];
        assert!(matches!(
            run_lookup(b, run.groups, run.crc, 3, lo),
            Err(Error::Checksum { .. })
        ));
        let body = &bad[at.offset as usize..(at.offset + at.len) as usize];
        assert!(matches!(
            decode_buffer(body, at, 3),
            Err(Error::Checksum { .. })
        ));
        let mut bad = bytes.clone();
        bad[at.offset as usize + 6] ^= 1;
        let head = &bad[at.offset as usize..at.runs.first().unwrap().offset as usize];
        assert!(matches!(
            head_covers(head, at.crc, 3, b"x"),
            Err(Error::Checksum { .. })
        ));
        let body = &bad[at.offset as usize..(at.offset + at.len) as usize];
        assert!(matches!(
            decode_buffer(body, at, 3),
            Err(Error::Checksum { .. })
        ));
    }

    /// `basement_for` (prefixes first) picks the basement a linear walk picks, with
    /// keys that tie in their first eight bytes, are shorter than eight, or end in
    /// zeros (where zero-padding could mislead).
    #[test]
    fn basement_for_matches_a_linear_walk() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..300 {
            let mut keys: Vec<Vec<u8>> = (0..1 + round % 40)
                .map(|_| {
                    let len = (next() % 12) as usize;
                    (0..len)
                        .map(|_| [0u8, 1, 0xff][(next() % 3) as usize])
                        .collect()
                })
                .collect();
            keys.sort();
            keys.dedup();
            let index: Vec<BasementRef> = keys
                .iter()
                .map(|k| BasementRef {
                    lo: k.clone(),
                    lo_prefix: key_prefix(k),
                    offset: 0,
                    len: 0,
                    count: 0,
                    crc: 0,
                })
                .collect();
            for _ in 0..50 {
                let len = (next() % 12) as usize;
                let key: Vec<u8> = (0..len)
                    .map(|_| [0u8, 1, 0xff][(next() % 3) as usize])
                    .collect();
                let want = keys
                    .iter()
                    .rposition(|k| k.as_slice() <= key.as_slice())
                    .unwrap_or(0);
                assert_eq!(basement_for(&index, &key), want, "{key:?} in {keys:?}");
            }
        }
    }

    /// Filters on disk were built with the second hash computed over the key; the
    /// shortcut must give the same bits for every length, tabled or not.
    #[test]
    fn filter_probes_are_the_seeded_crc_remainders() {
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in 0..200 {
            for _ in 0..8 {
                let key: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect();
                let h1 = crc32c::crc32c(&key);
                assert_eq!(
                    second_hash(h1, &key),
                    crc32c::crc32c_append(FILTER_SEED, &key),
                    "key length {len}"
                );
                // And the probes are the remainders the filters were built with.
                let h2 = crc32c::crc32c_append(FILTER_SEED, &key) as u64 | 1;
                for words in [1usize, 2, 3, 7, 40, 1000, 67_108_863, 67_108_864, 1 << 30] {
                    let bits = words as u64 * 64;
                    let want: Vec<usize> = (0..FILTER_PROBES as u64)
                        .map(|j| ((h1 as u64 + j * h2) % bits) as usize)
                        .collect();
                    let got = Probes::new(words).unwrap().of(&key);
                    assert_eq!(&got[..], &want[..], "{words} words, key length {len}");
                }
            }
        }
    }
}
