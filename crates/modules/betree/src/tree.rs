//! The tree itself: the node cache, message flow (route, flush, split, merge), queries,
//! checkpoints and recovery. Everything here runs under the `Tree`'s lock.

use crate::alloc::Alloc;
use crate::format::{self, Extent, Geometry, Header, HEADER_SLOTS};
use crate::lift::{prefix_end, PathLifts};

mod cache;
mod checkpoint;
mod refs;
mod surgery;
use crate::log::{self, LogWriter};
use crate::msg::{Buffer, Msg, Msn, RangeDel, Upserts};
use crate::node::{self, Base, Delta, Entries, Internal, Kind, Leaf, LeafData, Node, NodeId};
use cache::{Cached, NodeCache};
use refs::Refs;

use crate::chunk::Chunk;
use crate::codec::{key_cmp, key_eq};
use crate::entries::gallop;
use crate::{Error, Op, Options, Result, Stats};
use quilt_patch::{ChangeOpts, Engine, PatchId, RUN_BLOCKS_MAX};
use std::collections::HashMap;
use std::sync::Arc;

/// Bytes of a node read from disk: the blocks that hold them, and where they lie in
/// those blocks (handing out a slice instead of cutting the blocks spares moving the
/// whole read down by the offset of its first byte).
#[derive(Debug, Default)]
struct Span {
    blocks: Vec<u8>,
    range: std::ops::Range<usize>,
}

impl std::ops::Deref for Span {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.blocks[self.range.clone()]
    }
}

/// Batches applied but not yet logged (`Inner::hold`).
struct Held {
    /// The first one's message number: the record's.
    msn: Msn,
    ops: Vec<Op>,
    /// Their records' bytes (what the one record will take, near enough).
    bytes: usize,
}

pub(crate) struct Inner {
    engine: Engine,
    pub geo: Geometry,
    pub(crate) opts: Options,
    upserts: Upserts,
    cache: NodeCache,
    /// Set while `flush_all` pushes messages down for space: flushes then go into the
    /// leaves themselves, never into their deltas (a delete in a delta frees nothing).
    compacting: bool,
    /// Free blocks when a checkpoint last failed for want of room: space-driven
    /// checkpoints wait until something was freed (each retry would fail the same way).
    full_at: Option<u64>,
    /// Free blocks, and blocks reserved ahead, when `reserve_ahead` last reserved.
    reserved_for: Option<(u64, u64)>,
    /// Where each node written by a checkpoint lives.
    btt: HashMap<NodeId, Extent>,
    /// Reference counts of shared nodes (a range clone shares subtrees).
    refs: Refs,
    /// The base extent of each node the newest checkpoint wrote as a delta leaf (its
    /// `btt` extent is the delta). Saved in the table, so that opening knows the
    /// extent is in use.
    bases: HashMap<NodeId, Extent>,
    table: Extent,
    root: NodeId,
    next_node: NodeId,
    next_msn: Msn,
    generation: u64,
    /// Shared with the checkpoint thread, which places the nodes it encodes.
    pub(crate) alloc: Arc<std::sync::Mutex<Alloc>>,
    /// Extents the newest checkpoint still references, freed once the next one is
    /// durable.
    to_free: Vec<Extent>,
    /// The checkpoint being written behind the caller (`checkpoint.rs`).
    inflight: Option<checkpoint::InFlight>,
    /// The thread that writes checkpoints (after `inflight`: dropped last).
    writer: Option<checkpoint::Writer>,
    log: LogWriter,
    /// Batches written since `hold`: applied here, logged together by `release`, and
    /// forgotten by a rollback (`Tree::rollback`). No checkpoint runs meanwhile.
    held: Option<Held>,
    failed: Option<String>,
    /// Damage to the header blocks found at open that lost nothing (a mirror stood in,
    /// or a stale slot): for fsck to report and `repair_headers` to rewrite.
    pub(crate) damage: Vec<String>,
    /// The format version of the newest header: as read at open, and as written by
    /// each checkpoint since (`Tree::header_version`).
    pub(crate) header_version: u32,
    /// The version of the newest durable header: puts are logged by reference only
    /// under a header of version 4, which binaries that cannot replay them refuse.
    durable_version: u32,
    /// Puts logged by reference whose values no durable header's nodes and no bind
    /// record hold yet: what a sync must bind (`bind_late`), by MSN, with their bytes.
    unbound: Vec<(Msn, Arc<Vec<u8>>)>,
    unbound_bytes: usize,
    pub stats: Stats,
    /// What basement reads land in, kept from read to read: a fresh zeroed buffer for
    /// each of a scan's chunks (64-256 KiB) cost its allocation and a `memset` every
    /// time.
    read_buf: Vec<u8>,
    /// Basements a scan streams rather than caches (`stream_basements`), reused.
    stream_buf: Entries,
}

fn instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// No tree is deeper: with fanout 3 at the least, 64 levels would hold 3^64 nodes.
const MAX_DEPTH: usize = 64;

fn check_geometry(geo: &Geometry, block_count: u64) -> std::result::Result<(), String> {
    let bs = geo.block_size;
    if geo.node_bytes % bs != 0 || geo.node_bytes < 2 * bs {
        return Err(format!(
            "node size {} must be a multiple of the block size {bs}, at least two blocks",
            geo.node_bytes
        ));
    }
    if geo.node_bytes > RUN_BLOCKS_MAX as usize * bs || geo.node_bytes > 64 << 20 {
        return Err(format!("node size {} is too large", geo.node_bytes));
    }
    if geo.basement_bytes < 256 || geo.basement_bytes > geo.node_bytes {
        return Err(format!(
            "basement size {} must be between 256 bytes and the node size",
            geo.basement_bytes
        ));
    }
    if !(3..=1024).contains(&geo.fanout) {
        return Err(format!("fanout {} must be between 3 and 1024", geo.fanout));
    }
    if geo.log_first != HEADER_SLOTS || geo.log_blocks < 8 {
        return Err(format!(
            "log region {}+{} is invalid",
            geo.log_first, geo.log_blocks
        ));
    }
    if geo.mirror != 0 && geo.mirror.checked_add(1) != Some(block_count) {
        return Err(format!(
            "the header mirror is at block {}, not the device's last ({})",
            geo.mirror,
            block_count.saturating_sub(1)
        ));
    }
    let node_blocks = (geo.node_bytes / bs) as u64;
    if geo.data_first().saturating_add(8 * node_blocks) > geo.data_end(block_count) {
        return Err(format!(
            "a device of {block_count} blocks is too small for a log of {} blocks and nodes of {} bytes",
            geo.log_blocks, geo.node_bytes
        ));
    }
    Ok(())
}

/// The prefixes of a range rename or clone: each with an end, neither inside the other
/// (the source and destination ranges must not overlap).
fn check_prefixes(from: &[u8], to: &[u8]) -> Result<()> {
    if prefix_end(from).is_none() || prefix_end(to).is_none() {
        return Err(Error::Invalid(
            "a renamed or cloned prefix must hold a byte other than 0xff".into(),
        ));
    }
    if from.starts_with(to) || to.starts_with(from) {
        return Err(Error::Invalid(
            "a prefix cannot be renamed or cloned into or over one of its own".into(),
        ));
    }
    Ok(())
}

/// Decodes the unread buffers of an internal node from its whole extent.
fn load_buffers(n: &mut Internal, extent: &[u8], id: NodeId) -> Result<()> {
    for (i, at) in n.unread.iter_mut().enumerate() {
        if let Some(r) = at.take() {
            let start = r.offset as usize;
            n.buffers[i] = node::decode_buffer(&extent[start..start + r.len as usize], &r, id)?;
        }
    }
    n.unread.clear();
    Ok(())
}

/// A node's lower or upper key bound (`None`: its parent's).
type Bound = Option<Vec<u8>>;

/// How far a compaction pass got (`Inner::flush_all`).
pub struct FlushAll {
    /// It walked every node that held messages.
    pub complete: bool,
    /// It moved a message or rewrote a node.
    pub changed: bool,
    budget_blocks: u64,
}

/// What `Inner::check` has seen: (node, range) pairs checked, nodes visited, and the
/// edges counted into each node.
#[derive(Default)]
struct CheckWalk {
    seen: std::collections::HashSet<(NodeId, Bound, Bound)>,
    visited: std::collections::HashSet<NodeId>,
    edges: HashMap<NodeId, u32>,
}

/// One level's messages for a key: whether a range delete covers it, and its messages,
/// oldest first.
type KeyMsgs = (bool, Vec<(Msn, Msg)>);

/// A whole leaf from the bytes of its extent (section `..len`): its entries and its
/// basement index.
fn decode_whole_leaf(
    bytes: &[u8],
    len: usize,
    id: NodeId,
) -> Result<(Entries, Vec<node::BasementRef>)> {
    let index = node::decode_leaf_index(&bytes[..len], id, bytes.len())?;
    let total: usize = index.iter().map(|b| b.len as usize).sum();
    let mut all = Entries::with_capacity(total, index.iter().map(|b| b.count as usize).sum());
    for b in &index {
        let at = b.offset as usize;
        let es = node::decode_basement(&bytes[at..at + b.len as usize], b, id)?;
        append_basement(&mut all, &es, id)?;
    }
    Ok((all, index))
}

/// Storage behind the headers and the log ring, where the device is a sparse image
/// file: log writes (every batch, every sync) must never fail for a full host.
/// (Node extents are reserved as checkpoints allocate them.)
/// Gives a replayed batch's puts by reference their values from bind records, whose
/// lengths and checksums must match; `false` if one has none (or a wrong one).
fn bind_replayed(rec: &mut log::Replayed, bound: &mut HashMap<Msn, Vec<u8>>) -> bool {
    for l in &rec.late {
        let msn = rec.msn + l.index as u64;
        let ok = bound
            .get(&msn)
            .is_some_and(|v| v.len() == l.len as usize && crate::codec::crc32c(&[v]) == l.crc);
        if !ok {
            return false;
        }
    }
    for l in std::mem::take(&mut rec.late) {
        let msn = rec.msn + l.index as u64;
        if let (Some(v), Some(Op::Put { value, .. })) =
            (bound.remove(&msn), rec.ops.get_mut(l.index))
        {
            *value = v;
        }
    }
    true
}

/// What a scan's chunk holds of each value, and what the leaf's entries hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The values.
    Values,
    /// Their lengths only, taken from the values.
    Lengths,
    /// Their lengths only; the leaf's entries hold each length (`encode_len`) in place
    /// of its value (from the leaf's index, its basements unread).
    Encoded,
}

fn encode_len(n: usize) -> [u8; 4] {
    (n as u32).to_le_bytes()
}

fn decode_len(v: &[u8]) -> usize {
    v.get(..4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, |b| u32::from_le_bytes(b) as usize)
}

/// What [`Inner::absent_chunk`] found.
pub enum AbsentStep {
    /// The first absent number.
    Found(u64),
    /// Every number below this one is present: go on from it (the next leaf).
    Next(u64),
    /// Messages pending in the window `prefix ‖ from .. until` (outer space): a
    /// keys-only scan must merge them.
    Merge { from: u64, until: Vec<u8> },
}

impl AbsentStep {
    /// Where a window ending at `until` (outer space) leaves a search that found every
    /// number from its start up to `next` present: `prefix ‖ next` below `until` is
    /// absent (the window held every key there), else the search goes on from `next`.
    pub(crate) fn settled(prefix: &[u8], next: u64, to: u64, until: &[u8]) -> AbsentStep {
        if next >= to || crate::numbered_key(prefix, next).as_slice() < until {
            AbsentStep::Found(next)
        } else {
            AbsentStep::Next(next)
        }
    }
}

/// Where [`Inner::descend`] ends.
struct Descent {
    leaf: NodeId,
    /// Each internal node on the way and the child taken.
    path: Vec<(NodeId, usize)>,
    lifts: PathLifts,
    /// The leaf's bounds in the outer space (`None`: unbounded).
    node_lo: Option<Vec<u8>>,
    node_hi: Option<Vec<u8>>,
    /// `lo` and the cursor in the leaf's space.
    lo_here: Vec<u8>,
    cursor_here: Option<Vec<u8>>,
}

/// The keys of basements `a..b` of the partial leaf `leaf`, each with its value's
/// length encoded as its value: a loaded basement's own, and a basement of one entry
/// from the index (its first key, and its length less the entry's framing; the index
/// is checksummed, the basement's own checksum is not read). Basements of more entries
/// must be loaded.
fn index_keys(leaf: &Node, a: usize, b: usize, id: NodeId) -> Result<Entries> {
    let Node::Leaf(Leaf {
        data: LeafData::Partial { index, loaded },
        ..
    }) = leaf
    else {
        return Err(Error::Invalid(
            "internal: keys of a leaf not partial".into(),
        ));
    };
    let b = b.min(index.len());
    let room: usize = index[a.min(b)..b].iter().map(|r| r.lo.len() + 12).sum();
    let mut es = Entries::with_capacity(room, b.saturating_sub(a));
    for i in a..b {
        match (&loaded[i], index[i].count) {
            (Some(got), _) => {
                for (k, v) in got.iter() {
                    es.push(k, &encode_len(v.len()));
                }
            }
            (None, 0) => {}
            (None, 1) => {
                let r = &index[i];
                let framing = 8 + r.lo.len();
                if (r.len as usize) < framing {
                    return Err(Error::Corrupt(format!(
                        "node {id}: a basement of one entry shorter than its key"
                    )));
                }
                if !es.is_empty() && key_cmp(es.key(es.len() - 1), &r.lo).is_ge() {
                    return Err(Error::Corrupt(format!(
                        "node {id}: basement keys out of order"
                    )));
                }
                es.push(&r.lo, &encode_len(r.len as usize - framing));
            }
            (None, _) => {
                return Err(Error::Invalid(
                    "internal: a keys-only scan's basement unread".into(),
                ))
            }
        }
    }
    Ok(es)
}

fn reserve_log(engine: &Engine, geo: &Geometry) -> Result<()> {
    engine.reserve(0, geo.data_first()).map_err(|e| match e {
        quilt_patch::PatchError::Block(quilt_block::BlockError::NoSpace { path, .. }) => {
            Error::Invalid(format!(
                "{path}: the host file system has no room for the tree's log ({} blocks)",
                geo.data_first()
            ))
        }
        e => e.into(),
    })
}

/// Basement `r`'s bytes within `bytes`, a span of its leaf read from offset `start`.
fn basement_in<'a>(
    bytes: &'a [u8],
    start: u32,
    r: &node::BasementRef,
    id: NodeId,
) -> Result<&'a [u8]> {
    // (Offsets out of order wrap to a place past the end.)
    let at = r.offset.wrapping_sub(start) as usize;
    bytes
        .get(at..at.saturating_add(r.len as usize))
        .ok_or_else(|| Error::Corrupt(format!("node {id}: basements out of order")))
}

/// Appends a basement's entries to the ones of the basements before it.
fn append_basement(all: &mut Entries, es: &Entries, id: NodeId) -> Result<()> {
    if !all.is_empty() && !es.is_empty() && all.key(all.len() - 1) >= es.key(0) {
        return Err(Error::Corrupt(format!("node {id}: basements out of order")));
    }
    all.extend_from(es, 0, es.len());
    Ok(())
}

impl Inner {
    fn new(engine: Engine, geo: Geometry, opts: Options, h: Option<&Header>) -> Inner {
        let mut upserts = opts.upserts.clone();
        upserts.max_value = geo.max_value();
        Inner {
            log: LogWriter {
                instance: h.map_or_else(instance_id, |h| h.instance),
                first: geo.log_first,
                blocks: geo.log_blocks,
                start_lsn: h.map_or(0, |h| h.log_lsn),
                tail_lsn: h.map_or(0, |h| h.log_lsn),
                tail_offset: h.map_or(0, |h| h.log_offset),
                tail: Vec::new(),
                tail_written: 0,
                pending: Vec::new(),
                blocks_written: 0,
                bytes: 0,
            },
            engine,
            geo,
            opts,
            upserts,
            cache: NodeCache::default(),
            compacting: false,
            full_at: None,
            reserved_for: None,
            btt: HashMap::new(),
            refs: Refs::default(),
            bases: HashMap::new(),
            table: Extent {
                start: 0,
                blocks: 0,
            },
            root: h.map_or(1, |h| h.root),
            next_node: h.map_or(2, |h| h.next_node),
            next_msn: h.map_or(1, |h| h.next_msn),
            generation: h.map_or(0, |h| h.generation),
            alloc: Arc::default(),
            to_free: Vec::new(),
            inflight: None,
            writer: None,
            held: None,
            failed: None,
            damage: Vec::new(),
            header_version: h.map_or_else(|| Header::version_for(&geo), |h| h.version),
            durable_version: h.map_or(0, |h| h.version),
            unbound: Vec::new(),
            unbound_bytes: 0,
            stats: Stats::default(),
            read_buf: Vec::new(),
            stream_buf: Entries::default(),
        }
    }

    pub fn create(engine: Engine, opts: Options) -> Result<Inner> {
        let bs = engine.block_size();
        let geo = Geometry {
            block_size: bs,
            node_bytes: opts.node_bytes,
            basement_bytes: opts.basement_bytes,
            fanout: opts.fanout,
            log_first: HEADER_SLOTS,
            log_blocks: opts.log_blocks,
            mirror: engine.block_count().saturating_sub(1),
        };
        check_geometry(&geo, engine.block_count()).map_err(Error::Invalid)?;
        // Old headers go first, durably, the mirror's too: a crash must never find an
        // older tree's header (whatever its generation) beside this one's.
        let zeros = vec![0u8; bs];
        let mut wiped = Vec::new();
        for slot in (0..HEADER_SLOTS).chain([geo.mirror]) {
            wiped.push(engine.write(slot, 0, &zeros, &[], ChangeOpts::default())?);
        }
        let join = engine.empty(&wiped);
        engine.flush_until(join)?;
        reserve_log(&engine, &geo)?;
        engine.reserve(geo.mirror, 1)?;
        let mut t = Inner::new(engine, geo, opts, None);
        let end = geo.data_end(t.engine.block_count());
        t.alloc = Arc::new(Alloc::new(geo.data_first(), end, &[]).into());
        t.put_node(t.root, Node::Leaf(Leaf::empty()), true);
        t.checkpoint()?;
        Ok(t)
    }

    /// Opens the newest checkpoint: the newest header of the two slots and the mirror.
    ///
    /// Which single damaged header block loses nothing, and why (see ARCHITECTURE.md):
    /// - the newest slot: the mirror holds the same header (written with it, durable
    ///   at the same flush); noted in `damage`;
    /// - the older slot: nothing reads it; noted, unless it is what a crash that tore
    ///   the next header's write leaves (the mirror then names the newest slot's
    ///   generation, as it does before that header's flush);
    /// - the mirror: the slots hold the newest; noted.
    ///
    /// A tree made before mirrors falls back to the older slot when the newer does not
    /// decode; the log then shows whether that loses anything: a newer header was
    /// durable and the log written past it exactly when replay meets a block from a
    /// later lap of the ring, which is refused (`open_at`) rather than rolled back.
    /// Damage below the chosen header (its table, its nodes) is an error too.
    pub fn open(engine: Engine, opts: Options) -> Result<Inner> {
        let mut found: Vec<Header> = Vec::new();
        let mut damaged: Vec<(quilt_block::BlockNo, String)> = Vec::new();
        let mut empty: Vec<quilt_block::BlockNo> = Vec::new();
        for slot in 0..HEADER_SLOTS {
            let raw = engine.read(slot)?;
            match Header::decode(&raw) {
                Ok(Some(h)) if h.slot() == slot => found.push(h),
                Ok(Some(h)) => damaged.push((
                    slot,
                    format!("header slot {slot} holds generation {}", h.generation),
                )),
                Ok(None) => empty.push(slot),
                Err(e) => damaged.push((slot, format!("header slot {slot}: {e}"))),
            }
        }
        // The mirror: where a slot's geometry says it is (or, with no slot readable, the
        // device's last block if it holds a mirror).
        let last = engine.block_count().saturating_sub(1);
        let mirror_at = found.first().map_or(last, |h| h.geo.mirror).min(last);
        let mut mirror = None;
        if mirror_at >= HEADER_SLOTS {
            match Header::decode(&engine.read(mirror_at)?) {
                Ok(Some(h)) if h.geo.mirror == mirror_at => mirror = Some(h),
                Ok(Some(_)) if found.is_empty() => {}
                Ok(_) if found.iter().all(|h| h.geo.mirror == 0) => {} // no mirror
                Ok(_) => damaged.push((
                    mirror_at,
                    format!("the header mirror (block {mirror_at}) is empty"),
                )),
                Err(e) => {
                    if found.iter().any(|h| h.geo.mirror == mirror_at) {
                        damaged.push((
                            mirror_at,
                            format!("the header mirror (block {mirror_at}): {e}"),
                        ));
                    }
                }
            }
        }
        // Headers of another tree (a stale mirror) do not count.
        if let (Some(m), Some(h)) = (&mirror, found.first()) {
            if m.instance != h.instance {
                mirror = None;
            }
        }
        let newest_slot = found.iter().map(|h| h.generation).max();
        let mut damage: Vec<String> = Vec::new();
        let chosen = match (&mirror, newest_slot) {
            (Some(m), Some(g)) if m.generation > g => {
                let slot = m.slot();
                tracing::warn!(
                    "betree: header slot {slot} (generation {}) is damaged or missing; using its mirror",
                    m.generation
                );
                damage.push(format!(
                    "header slot {slot} lost generation {} (recovered from the mirror)",
                    m.generation
                ));
                m.clone()
            }
            (_, Some(g)) => found
                .iter()
                .find(|h| h.generation == g)
                .cloned()
                .expect("the newest slot"),
            (Some(m), None) => {
                damage.push(format!(
                    "both header slots are damaged or empty (recovered from the mirror, generation {})",
                    m.generation
                ));
                m.clone()
            }
            (None, None) => {
                return Err(if damaged.is_empty() {
                    Error::NotFormatted
                } else {
                    Error::Corrupt(format!(
                        "no valid header: {}",
                        damaged
                            .iter()
                            .map(|d| d.1.as_str())
                            .collect::<Vec<_>>()
                            .join("; ")
                    ))
                });
            }
        };
        // The slot the next checkpoint writes may be torn by a crash during that write
        // (the mirror still names the chosen generation then): not damage.
        let next_slot = (chosen.generation + 1) % HEADER_SLOTS;
        let torn_next = |slot: quilt_block::BlockNo| {
            slot == next_slot
                && mirror
                    .as_ref()
                    .is_none_or(|m| m.generation == chosen.generation)
        };
        for (blk, what) in &damaged {
            if *blk == chosen.slot() || torn_next(*blk) {
                continue;
            }
            damage.push(what.clone());
        }
        // After two checkpoints both slots hold a header.
        for &slot in &empty {
            if chosen.generation >= 2 && slot != chosen.slot() && !torn_next(slot) {
                damage.push(format!("header slot {slot} is empty"));
            }
        }
        let damaged_text: Vec<String> = damaged.into_iter().map(|d| d.1).collect();
        let mut t = Inner::open_at(engine, opts, &chosen, &damaged_text)?;
        for d in &damage {
            tracing::warn!("betree: {d}");
        }
        t.damage = damage;
        Ok(t)
    }

    fn open_at(engine: Engine, opts: Options, h: &Header, damaged: &[String]) -> Result<Inner> {
        let geo = h.geo;
        if geo.block_size != engine.block_size() {
            return Err(Error::Corrupt(format!(
                "the tree has {}-byte blocks, the device {}",
                geo.block_size,
                engine.block_size()
            )));
        }
        check_geometry(&geo, engine.block_count()).map_err(Error::Corrupt)?;
        let count = geo.data_end(engine.block_count());
        let in_data = |e: &Extent| {
            e.blocks > 0
                && e.start >= geo.data_first()
                && e.start
                    .checked_add(e.blocks)
                    .is_some_and(|end| end <= count)
        };
        if !in_data(&h.table) {
            return Err(Error::Corrupt(format!(
                "table extent {:?} out of bounds",
                h.table
            )));
        }
        let mut bytes = Vec::new();
        for b in h.table.start..h.table.start + h.table.blocks {
            bytes.extend_from_slice(&engine.read(b)?);
        }
        let (entries, refs, bases) = format::decode_table(&bytes, h.table_crc)?;
        let mut used: Vec<Extent> = entries.iter().chain(&bases).map(|(_, e)| *e).collect();
        used.push(h.table);
        // Bounds first: then no extent's end overflows in the overlap check (the fuzzer
        // found a table whose extent ran past the last block number).
        if let Some(bad) = used.iter().find(|e| !in_data(e)) {
            return Err(Error::Corrupt(format!("extent {bad:?} out of bounds")));
        }
        used.sort();
        for w in used.windows(2) {
            if w[0].start + w[0].blocks > w[1].start {
                return Err(Error::Corrupt(format!(
                    "extents {:?} and {:?} overlap",
                    w[0], w[1]
                )));
            }
        }
        if !entries.iter().any(|(id, _)| *id == h.root) {
            return Err(Error::Corrupt(format!(
                "root node {} has no extent",
                h.root
            )));
        }
        reserve_log(&engine, &geo)?;
        let mut t = Inner::new(engine, geo, opts, Some(h));
        t.btt = entries.into_iter().collect();
        for (id, e) in bases {
            if !t.btt.contains_key(&id) || t.bases.insert(id, e).is_some() {
                return Err(Error::Corrupt(format!(
                    "base extent of node {id}, which has no extent or two bases"
                )));
            }
        }
        for (id, n) in refs {
            if n < 2 || !t.btt.contains_key(&id) {
                return Err(Error::Corrupt(format!(
                    "reference count {n} of node {id}, which has no extent or is not shared"
                )));
            }
            t.refs.load(id, n);
        }
        t.table = h.table;
        t.alloc = Arc::new(Alloc::new(geo.data_first(), count, &used).into());
        // Redo what the log holds past the checkpoint.
        let log::Replay {
            records,
            next_lsn,
            next_offset,
            future,
        } = log::replay(
            &t.engine,
            h.instance,
            geo.log_first,
            geo.log_blocks,
            h.log_lsn,
            h.log_offset,
        )?;
        if let Some(lsn) = future {
            return Err(Error::Corrupt(format!(
                "the newest readable header (generation {}) is not the newest: the log \
                 was written past it (block {lsn} where replay expected {next_lsn}), so a \
                 newer header was lost{}; opening this one would roll the tree back",
                h.generation,
                if damaged.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", damaged.join("; "))
                }
            )));
        }
        // The values bind records give puts logged by reference, by MSN (a bind record
        // follows the records it binds, so this looks ahead).
        let mut bound: HashMap<Msn, Vec<u8>> = HashMap::new();
        for rec in &records {
            if rec.msn == log::BIND_MSN {
                bound.extend(rec.binds.iter().cloned());
            }
        }
        for mut rec in records {
            if rec.msn == log::BIND_MSN {
                continue;
            }
            if rec.msn != t.next_msn {
                break; // a gap: nothing after it may be applied
            }
            // A put by reference whose value neither a durable header nor a bind record
            // holds was never promised: replay ends before its batch.
            if !bind_replayed(&mut rec, &mut bound) {
                break;
            }
            for op in &rec.ops {
                t.validate(op)?;
            }
            let n = rec.ops.len() as u64;
            t.apply_ops(rec.msn, rec.ops)?;
            t.next_msn += n;
        }
        if next_lsn != h.log_lsn {
            // Start a clean log after what was replayed: a new record must never follow a
            // torn one in the stream.
            t.log.tail_lsn = next_lsn;
            t.log.tail_offset = next_offset;
            t.checkpoint()?;
        }
        Ok(t)
    }

    // ---- cache ----

    fn put_node(&mut self, id: NodeId, node: Node, dirty: bool) {
        if !self.cache.insert(id, node, dirty) {
            debug_assert!(false, "node {id} cached twice");
        }
    }

    /// Changes a cached node in place without making it dirty (parts read or dropped, a
    /// base learned) and charges the cache the difference, to the dirty bytes too if it
    /// is dirty (a node read for queries is dirty once its delta took a flush). `None`
    /// if it is not cached.
    fn change_cached<R>(&mut self, id: NodeId, f: impl FnOnce(&mut Node) -> R) -> Option<R> {
        self.cache.change(id, f)
    }

    fn take_cached(&mut self, id: NodeId) -> Option<(Node, bool)> {
        let c = self.cache.remove(&id)?;
        let dirty = c.is_dirty();
        let node = Arc::try_unwrap(c.node).unwrap_or_else(|shared| {
            self.stats.checkpoint_copies += 1;
            (*shared).clone()
        });
        Some((node, dirty))
    }

    fn new_id(&mut self) -> NodeId {
        let id = self.next_node;
        self.next_node += 1;
        id
    }

    fn extent_of(&self, id: NodeId) -> Result<Extent> {
        if let Some(e) = self.placed_inflight(id) {
            return Ok(e);
        }
        self.btt
            .get(&id)
            .copied()
            .ok_or_else(|| Error::Corrupt(format!("node {id} is referenced but has no extent")))
    }

    /// Node blocks, read through the engine without caching them there (the node cache
    /// holds what they decode to).
    fn read_blocks(&self, start: u64, n: u64) -> Result<Vec<u8>> {
        let mut out = vec![0u8; n as usize * self.geo.block_size];
        self.engine.read_uncached(start, &mut out)?;
        Ok(out)
    }

    fn max_children(&self) -> usize {
        self.geo.fanout * 2 + 2
    }

    /// Reads a whole node from its extent (a delta with its base and its messages,
    /// not applied).
    fn read_node(&mut self, id: NodeId) -> Result<Node> {
        let e = self.extent_of(id)?;
        let bytes = self.read_blocks(e.start, e.blocks)?;
        self.stats.node_reads += 1;
        let (kind, len) = node::section_len(&bytes, id)?;
        if len > bytes.len() {
            return Err(Error::Corrupt(format!(
                "node {id}: section longer than its extent"
            )));
        }
        if kind != Kind::Delta {
            let base = Base {
                extent: e,
                section: bytes[..len].to_vec(),
            };
            return self.decode_whole(id, kind, &bytes, len, base);
        }
        let (_, base, at) = node::decode_delta(&bytes[..len], id, bytes.len())?;
        self.check_base(id, &base.extent)?;
        let (from, n) = at.span();
        let buf = node::decode_delta_runs(&bytes[from as usize..(from + n) as usize], &at, id)?;
        let bb = self.read_blocks(base.extent.start, base.extent.blocks)?;
        self.stats.node_reads += 1;
        let (kind, blen) = node::section_len(&bb, id)?;
        if kind == Kind::Delta || blen > bb.len() || bb[..blen] != base.section[..] {
            return Err(Error::Corrupt(format!(
                "node {id}: the base of its delta does not hold what the delta copied"
            )));
        }
        let mut n = self.decode_whole(id, kind, &bb, blen, base)?;
        match &mut n {
            Node::Leaf(l) => l.delta.buf = buf,
            Node::Internal(x) => x.delta.buf = buf,
        }
        Ok(n)
    }

    /// A node from the bytes of an extent written whole (section `..len`), with `base`.
    fn decode_whole(
        &self,
        id: NodeId,
        kind: Kind,
        bytes: &[u8],
        len: usize,
        base: Base,
    ) -> Result<Node> {
        if kind == Kind::Leaf {
            let (all, _) = decode_whole_leaf(bytes, len, id)?;
            let mut l = Leaf::full(all);
            l.delta.base = Some(base);
            return Ok(Node::Leaf(l));
        }
        let mut n = node::decode_internal(&bytes[..len], id, self.max_children(), bytes.len())?;
        load_buffers(&mut n, bytes, id)?;
        n.delta.base = Some(base);
        Ok(Node::Internal(n))
    }

    /// A delta's base must lie where nodes do.
    fn check_base(&self, id: NodeId, e: &Extent) -> Result<()> {
        let ok = e.blocks > 0
            && e.start >= self.geo.data_first()
            && e.start
                .checked_add(e.blocks)
                .is_some_and(|end| end <= self.engine.block_count());
        if ok {
            Ok(())
        } else {
            Err(Error::Corrupt(format!(
                "node {id}: base extent {e:?} out of bounds"
            )))
        }
    }

    /// Reads a node's section only: an internal node's children, pivots and where its
    /// buffers lie, a leaf's basement index; for a delta, its base's (copied into it)
    /// and where the delta's messages lie.
    fn read_section(&mut self, id: NodeId) -> Result<Node> {
        let e = self.extent_of(id)?;
        let bs = self.geo.block_size;
        let first = self.read_blocks(e.start, 1)?;
        let (kind, len) = node::section_len(&first, id)?;
        let n = len.div_ceil(bs) as u64;
        if n > e.blocks {
            return Err(Error::Corrupt(format!(
                "node {id}: section longer than its extent"
            )));
        }
        let mut sec = first;
        if n > 1 {
            sec.extend(self.read_blocks(e.start + 1, n - 1)?);
        }
        sec.truncate(len);
        let (kind, base, unread) = if kind == Kind::Delta {
            let (_, base, at) = node::decode_delta(&sec, id, e.blocks as usize * bs)?;
            self.check_base(id, &base.extent)?;
            let (kind, blen) = node::section_len(&base.section, id)?;
            if kind == Kind::Delta || blen != base.section.len() {
                return Err(Error::Corrupt(format!("node {id}: a delta over a delta")));
            }
            (kind, base, Some(at))
        } else {
            (
                kind,
                Base {
                    extent: e,
                    section: sec,
                },
                None,
            )
        };
        // Places in the section are in the base's extent.
        let bytes = base.extent.blocks as usize * bs;
        let delta = node::Delta {
            buf: Buffer::default(),
            unread,
            base: None,
        };
        if kind == Kind::Internal {
            let mut n = node::decode_internal(&base.section, id, self.max_children(), bytes)?;
            n.delta = Delta {
                base: Some(base),
                ..delta
            };
            return Ok(Node::Internal(n));
        }
        let index = node::decode_leaf_index(&base.section, id, bytes)?;
        let loaded = vec![None; index.len()];
        Ok(Node::Leaf(Leaf {
            data: LeafData::Partial { index, loaded },
            bytes,
            delta: Delta {
                base: Some(base),
                ..delta
            },
        }))
    }

    fn read_basement(&mut self, id: NodeId, b: &node::BasementRef) -> Result<Entries> {
        let base = self.base_of(id)?;
        self.stats.basement_reads += 1;
        self.read_with(base, id, b.offset, b.len, |part| {
            node::decode_basement(part, b, id)
        })
    }

    /// Takes a node out of the cache, whole (a partial leaf gets its other basements);
    /// the caller puts it back.
    fn take_full(&mut self, id: NodeId) -> Result<(Node, bool)> {
        let (mut n, dirty) = match self.take_cached(id) {
            Some(x) => {
                self.stats.cache_hits += 1;
                x
            }
            None => {
                self.stats.cache_misses += 1;
                (self.read_node(id)?, false)
            }
        };
        // (A node with a dirty delta may be partial: on an error it goes back.)
        if let Err(e) = self.make_whole(id, &mut n) {
            self.put_node(id, n, dirty);
            return Err(e);
        }
        Ok((n, dirty))
    }

    /// Reads what a node lacks and applies its delta: the node is then whole and has no
    /// base (its caller may change it). Its contents do not change, so a clean node
    /// stays clean (its extent on disk holds the same).
    fn make_whole(&mut self, id: NodeId, n: &mut Node) -> Result<()> {
        match n {
            Node::Leaf(l) => {
                self.read_whole(id, l)?;
                self.apply_delta(id, l)
            }
            Node::Internal(x) => {
                if !x.is_whole() {
                    let base = x.delta.base.as_ref().map(|b| b.extent).ok_or_else(|| {
                        Error::Invalid(format!("internal: partial node {id} without a base"))
                    })?;
                    let bytes = self.read_blocks(base.start, base.blocks)?;
                    self.stats.node_reads += 1;
                    load_buffers(x, &bytes, id)?;
                }
                if let Some(at) = x.delta.unread.clone() {
                    x.delta.buf = self.read_delta(id, &at)?;
                    x.delta.unread = None;
                }
                let buf = std::mem::take(&mut x.delta.buf);
                if !buf.is_empty() {
                    self.stats.delta_applies += 1;
                    x.absorb(buf);
                }
                x.delta = Delta::default();
                Ok(())
            }
        }
    }

    /// A node's delta messages, from its own extent.
    fn read_delta(&mut self, id: NodeId, at: &node::DeltaRef) -> Result<Buffer> {
        let (offset, len) = at.span();
        let e = self.extent_of(id)?;
        self.stats.buffer_reads += 1;
        self.read_with(e, id, offset, len, |body| {
            node::decode_delta_runs(body, at, id)
        })
    }

    /// Makes a partial leaf full: reads the basements it lacks from its base. On an
    /// error the leaf is still partial (with more basements loaded).
    fn read_whole(&mut self, id: NodeId, l: &mut Leaf) -> Result<()> {
        let LeafData::Partial { index, loaded } = &mut l.data else {
            return Ok(());
        };
        let base =
            l.delta.base.as_ref().map(|b| b.extent).ok_or_else(|| {
                Error::Invalid(format!("internal: partial leaf {id} without a base"))
            })?;
        // The missing basements in one read of the blocks from the first to the last.
        let missing = || {
            index
                .iter()
                .zip(loaded.iter())
                .filter(|(_, l)| l.is_none())
                .map(|(b, _)| b)
        };
        let start = missing().map(|b| b.offset).min();
        let end = missing().map(|b| b.offset.saturating_add(b.len)).max();
        if let (Some(start), Some(end)) = (start, end) {
            let bytes = self.read_range_in(base, id, start, end - start)?;
            self.stats.node_reads += 1;
            for (b, slot) in index.iter().zip(loaded.iter_mut()) {
                if slot.is_none() {
                    let at = (b.offset - start) as usize;
                    let body = bytes.get(at..at + b.len as usize).ok_or_else(|| {
                        Error::Corrupt(format!("node {id}: basement past its leaf"))
                    })?;
                    *slot = Some(node::decode_basement(body, b, id)?);
                }
            }
        }
        let mut all = Entries::default();
        for es in loaded.iter().flatten() {
            append_basement(&mut all, es, id)?;
        }
        let delta = std::mem::take(&mut l.delta);
        *l = Leaf::full(all);
        l.delta = delta;
        Ok(())
    }

    /// Applies a leaf's delta to its entries (reading the delta if it is not loaded):
    /// the leaf is then changed in memory, with no base. Its contents do not change, so
    /// a clean leaf stays clean (its extent on disk holds the same).
    fn apply_delta(&mut self, id: NodeId, l: &mut Leaf) -> Result<()> {
        if let Some(at) = l.delta.unread.clone() {
            l.delta.buf = self.read_delta(id, &at)?;
            l.delta.unread = None;
        }
        if !l.delta.buf.is_empty() {
            self.stats.delta_applies += 1;
        }
        l.apply_delta(&self.upserts)
    }

    /// The extent a cached leaf's entries are read from: its base (a leaf read from
    /// disk always has one; a leaf changed in memory is whole).
    fn base_of(&self, id: NodeId) -> Result<Extent> {
        let base = match self.cache.get(&id).map(|c| &*c.node) {
            Some(Node::Leaf(l)) => l.delta.base.as_ref(),
            Some(Node::Internal(n)) => n.delta.base.as_ref(),
            None => None,
        };
        base.map(|b| b.extent).ok_or_else(|| {
            Error::Invalid(format!("internal: parts of node {id}, which has no base"))
        })
    }

    /// Makes sure the node is cached (a leaf possibly partial) and marks it used.
    fn ensure(&mut self, id: NodeId) -> Result<&mut Cached> {
        if !self.cache.contains_key(&id) {
            self.stats.cache_misses += 1;
            let n = self.read_section(id)?;
            self.put_node(id, n, false);
        } else {
            self.stats.cache_hits += 1;
        }
        Ok(self.cache.touch(id).expect("just cached"))
    }

    /// Bytes `offset..offset + len` of extent `e` of node `id`.
    fn read_range_in(&self, e: Extent, id: NodeId, offset: u32, len: u32) -> Result<Span> {
        let mut part = Vec::new();
        self.read_range_into(e, id, offset, len, &mut part)?;
        Ok(Span {
            blocks: part,
            range: 0..len as usize,
        })
    }

    /// Bytes `offset..offset + len` of extent `e` of node `id`, read into the tree's
    /// kept read buffer and handed to `f`, which copies what it keeps: a part read for
    /// a query or a scan costs no allocation (a fresh buffer each time was an
    /// allocation, a memset and, often, page faults).
    fn read_with<T>(
        &mut self,
        e: Extent,
        id: NodeId,
        offset: u32,
        len: u32,
        f: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<T> {
        let mut buf = std::mem::take(&mut self.read_buf);
        let r = self
            .read_range_into(e, id, offset, len, &mut buf)
            .and_then(f);
        self.read_buf = buf;
        r
    }

    /// Bytes `offset..offset + len` of extent `e` of node `id`, read into the front of
    /// `buf` (which keeps its length when it is longer: only bytes it never held are
    /// zeroed before a read).
    fn read_range_into<'b>(
        &self,
        e: Extent,
        id: NodeId,
        offset: u32,
        len: u32,
        buf: &'b mut Vec<u8>,
    ) -> Result<&'b [u8]> {
        if len == 0 {
            // An empty basement (a leaf with no entries) takes no bytes at all.
            return Ok(&[]);
        }
        let bs = self.geo.block_size;
        let (start, end) = (offset as usize, offset as usize + len as usize);
        let first = start / bs;
        let blocks = end.div_ceil(bs).max(first + 1) - first;
        if (first + blocks) as u64 > e.blocks {
            return Err(Error::Corrupt(format!("node {id}: part past its extent")));
        }
        // Only the part's bytes, not its blocks whole (see `read_part_uncached`).
        if buf.len() < len as usize {
            buf.resize(len as usize, 0);
        }
        let part = &mut buf[..len as usize];
        self.engine
            .read_part_uncached(e.start + first as u64, start - first * bs, part)?;
        Ok(part)
    }

    /// Makes sure the node is cached whole (a leaf with its delta applied).
    fn ensure_full(&mut self, id: NodeId) -> Result<()> {
        // (A node with a base is taken too: whoever wants it whole may change it, and a
        // changed node must not keep a base; see `node::Delta`.)
        let partial = match self.cache.get(&id).map(|c| &*c.node) {
            None => true,
            Some(Node::Leaf(l)) => {
                l.entries().is_none() || l.delta.base.is_some() || !l.delta.is_empty()
            }
            Some(Node::Internal(n)) => {
                !n.is_whole() || n.delta.base.is_some() || !n.delta.is_empty()
            }
        };
        if partial {
            let (n, dirty) = self.take_full(id)?;
            self.put_node(id, n, dirty);
        }
        Ok(())
    }

    fn is_shared(&self, id: NodeId) -> bool {
        self.refs.is_shared(id)
    }

    /// One more edge references `id`.
    fn add_ref(&mut self, id: NodeId) {
        self.refs.add(id);
    }

    /// An edge to `id` (of `height`) goes away: the subtree is freed when it was the last
    /// (shared nodes below it lose one reference each).
    fn drop_ref(&mut self, id: NodeId, height: u16) -> Result<()> {
        if self.refs.release(id) {
            return Ok(());
        }
        if height > 0 {
            let children = match &*self.ensure(id)?.node {
                Node::Internal(n) => n.children.clone(),
                Node::Leaf(_) => {
                    return Err(Error::Corrupt(format!(
                        "node {id}: a leaf where a subtree was"
                    )))
                }
            };
            for c in children {
                self.drop_ref(c, height - 1)?;
            }
        }
        self.free_node(id);
        Ok(())
    }

    /// Makes child `idx` of `parent` the parent's own before it changes: a shared child
    /// is copied (whole) to a new node that only this edge references, and the copy's
    /// children gain a reference. This is the only place a clone costs bytes, and it
    /// happens only when a flush, a split or a surgery reaches the shared node, that is
    /// when enough changes gathered in the buffer above it (copy-on-abundant-write).
    fn own(&mut self, parent: &mut Internal, idx: usize) -> Result<NodeId> {
        let id = parent.children[idx];
        if !self.is_shared(id) {
            return Ok(id);
        }
        self.ensure_full(id)?;
        let node = (*self.cache[&id].node).clone();
        if let Node::Internal(n) = &node {
            for &c in &n.children {
                self.add_ref(c);
            }
        }
        self.stats.cow_copies += 1;
        self.stats.cow_bytes += match &node {
            Node::Leaf(l) => l.bytes as u64,
            Node::Internal(n) => n.bytes() as u64,
        };
        self.refs.release(id);
        let copy = self.new_id();
        self.put_node(copy, node, true);
        parent.children[idx] = copy;
        Ok(copy)
    }

    /// Drops a node that left the tree; its extent is freed by the next checkpoint.
    fn free_node(&mut self, id: NodeId) {
        debug_assert!(!self.is_shared(id), "node {id} freed while shared");
        self.unpin_freed(id);
        self.cache.remove(&id);
        if let Some(e) = self.btt.remove(&id) {
            self.to_free.push(e);
        }
        if let Some(e) = self.bases.remove(&id) {
            self.to_free.push(e);
        }
    }

    // ---- writes ----

    fn validate(&self, op: &Op) -> Result<()> {
        let key_ok = |k: &[u8]| {
            if k.len() > self.geo.max_key() {
                Err(Error::Invalid(format!(
                    "key of {} bytes is longer than the limit {}",
                    k.len(),
                    self.geo.max_key()
                )))
            } else {
                Ok(())
            }
        };
        match op {
            Op::Put { key, value } => {
                key_ok(key)?;
                if value.len() > self.geo.max_value() {
                    return Err(Error::Invalid(format!(
                        "value of {} bytes is longer than the limit {}",
                        value.len(),
                        self.geo.max_value()
                    )));
                }
            }
            Op::Delete { key } => key_ok(key)?,
            Op::Upsert { key, func, arg } => {
                key_ok(key)?;
                if arg.len() > self.geo.max_value() + 8 {
                    return Err(Error::Invalid(format!(
                        "upsert argument of {} bytes is too long",
                        arg.len()
                    )));
                }
                self.upserts.check(*func, arg)?;
            }
            Op::DeleteRange { start, end } => {
                key_ok(start)?;
                if end.len() > self.geo.max_key() + 1 {
                    return Err(Error::Invalid("range end is too long".into()));
                }
                if start >= end {
                    return Err(Error::Invalid("a range delete needs start < end".into()));
                }
            }
            Op::RenamePrefix { from, to } => {
                key_ok(from)?;
                key_ok(to)?;
                check_prefixes(from, to)?;
            }
            Op::CloneRange {
                from,
                to,
                start,
                end,
            } => {
                key_ok(from)?;
                key_ok(to)?;
                check_prefixes(from, to)?;
                let longest = from.len().max(to.len());
                key_ok(&[from.as_slice(), start].concat())?;
                key_ok(&[to.as_slice(), start].concat())?;
                if let Some(e) = end {
                    if longest + e.len() > self.geo.max_key() + 1 {
                        return Err(Error::Invalid("clone range end is too long".into()));
                    }
                    if e <= start {
                        return Err(Error::Invalid("a clone range needs start < end".into()));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(f) => Err(Error::Failed(f.clone())),
            None => Ok(()),
        }
    }

    /// The most log blocks one record may take (and so one held group of batches).
    fn record_blocks_max(&self) -> u64 {
        self.geo.log_blocks / 4
    }

    /// From here until `release`, batches are applied but not logged, and no checkpoint
    /// runs: `release` logs them as one record (all of them survive a crash, or none),
    /// a rollback forgets them. Room for that record is made first.
    pub fn hold(&mut self) -> Result<()> {
        self.check_failed()?;
        if self.held.is_some() {
            return Err(Error::Invalid("the tree holds batches already".into()));
        }
        if self.log.room() <= self.record_blocks_max() + 1 {
            self.finish_checkpoint()?;
            if self.log.room() <= self.record_blocks_max() + 1 {
                self.checkpoint()?;
            }
        }
        // What was logged before is in the engine's cache, where a rollback's replay
        // reads it; with the values of its puts by reference, which the rollback's
        // replay needs as a crash's would.
        self.bind_late()?;
        self.log.write_tail(&self.engine)?;
        self.held = Some(Held {
            msn: self.next_msn,
            ops: Vec::new(),
            bytes: 0,
        });
        Ok(())
    }

    /// Logs the batches held since `hold` as one record.
    pub fn release(&mut self) -> Result<()> {
        self.check_failed()?;
        let Some(held) = self.held.take() else {
            return Err(Error::Invalid("the tree holds no batches".into()));
        };
        if held.ops.is_empty() {
            return Ok(());
        }
        let rec = log::record(held.msn, &held.ops, usize::MAX);
        if let Err(e) = self.log.append(&self.engine, &rec) {
            // Applied but not logged: the in-memory tree is ahead of what a replay
            // finds.
            self.failed = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Whether batches are held (`hold`).
    pub fn holding(&self) -> bool {
        self.held.is_some()
    }

    pub fn write(&mut self, ops: Vec<Op>) -> Result<()> {
        self.check_failed()?;
        if ops.is_empty() {
            return Ok(());
        }
        for op in &ops {
            self.validate(op)?;
        }
        self.admit(&ops)?;
        let late_min = self.late_min();
        let rec = log::record(self.next_msn, &ops, late_min);
        let bs = self.geo.block_size;
        if let Some(held) = &self.held {
            // Refused before anything is applied: the held record would outgrow the log.
            let bytes = held.bytes + rec.len();
            if self.log.blocks_for(bytes, bs) + 1 > self.record_blocks_max() {
                return Err(Error::Invalid(format!(
                    "a batch of {bytes} bytes is too large for the log ({} blocks)",
                    self.geo.log_blocks
                )));
            }
        } else if self.log.blocks_for(rec.len(), bs) + 1 > self.record_blocks_max() {
            return Err(Error::Invalid(format!(
                "a batch of {} bytes is too large for the log ({} blocks)",
                rec.len(),
                self.geo.log_blocks
            )));
        }
        if let Some(held) = &mut self.held {
            held.bytes += rec.len();
            held.ops.extend(ops.iter().cloned());
        } else if self.log.blocks_for(rec.len(), bs) >= self.log.room() {
            // The ring is full: the checkpoint in flight, or a new one, moves replay's
            // start past everything logged before it.
            self.finish_checkpoint()?;
            if self.log.blocks_for(rec.len(), bs) >= self.log.room() {
                self.checkpoint()?;
            }
        }
        if self.held.is_none() {
            self.log.append(&self.engine, &rec)?;
            if late_min != usize::MAX {
                self.owe_late(&ops, late_min);
            }
        }
        for op in &ops {
            match op {
                Op::Put { key, value } => {
                    self.stats.puts += 1;
                    self.stats.user_bytes += (key.len() + value.len()) as u64;
                }
                Op::Delete { .. } => self.stats.deletes += 1,
                Op::Upsert { key, arg, .. } => {
                    self.stats.upserts += 1;
                    self.stats.user_bytes += (key.len() + arg.len()) as u64;
                }
                Op::DeleteRange { .. } => self.stats.range_deletes += 1,
                Op::RenamePrefix { .. } => self.stats.range_renames += 1,
                Op::CloneRange { .. } => self.stats.range_clones += 1,
            }
        }
        self.stats.batches += 1;
        let msn = self.next_msn;
        self.next_msn += ops.len() as u64;
        if let Err(e) = self.apply_ops(msn, ops) {
            // Logged but only partly applied: the in-memory tree cannot be trusted.
            self.failed = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Applies a batch to the tree: into the root buffer (or the root leaf), then flushes
    /// and splits as needed.
    fn apply_ops(&mut self, msn0: Msn, ops: Vec<Op>) -> Result<()> {
        // Runs of messages go into the root together; a range rename is tree surgery of
        // its own, in its place in the batch.
        let mut msn = msn0;
        let mut run = Vec::new();
        for op in ops {
            match op {
                Op::RenamePrefix { from, to } => {
                    let n = run.len() as u64;
                    self.apply_run(msn, std::mem::take(&mut run))?;
                    msn += n;
                    self.rename_prefix(&from, &to)?;
                    msn += 1;
                }
                Op::CloneRange {
                    from,
                    to,
                    start,
                    end,
                } => {
                    let n = run.len() as u64;
                    self.apply_run(msn, std::mem::take(&mut run))?;
                    msn += n;
                    self.clone_range(&from, &to, &start, end.as_deref())?;
                    msn += 1;
                }
                op => run.push(op),
            }
        }
        self.apply_run(msn, run)
    }

    fn apply_run(&mut self, msn0: Msn, ops: Vec<Op>) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let (mut root, _) = self.take_full(self.root)?;
        let r = self.apply_to_root(&mut root, msn0, ops);
        let root_id = self.root;
        self.put_node(root_id, root, true);
        r?;
        self.fix_root()
    }

    fn apply_to_root(&mut self, root: &mut Node, msn0: Msn, ops: Vec<Op>) -> Result<()> {
        for (i, op) in ops.into_iter().enumerate() {
            let msn = msn0 + i as u64;
            match root {
                Node::Internal(n) => match op {
                    Op::Put { key, value } => n.route(key, msn, Msg::Put(value)),
                    Op::Delete { key } => n.route(key, msn, Msg::Delete),
                    Op::Upsert { key, func, arg } => n.route(key, msn, Msg::Upsert { func, arg }),
                    Op::DeleteRange { start, end } => n.route_range(&RangeDel { msn, start, end }),
                    Op::RenamePrefix { .. } | Op::CloneRange { .. } => {
                        return Err(Error::Invalid("internal: a rename among messages".into()))
                    }
                },
                Node::Leaf(l) => {
                    let mut b = Buffer::default();
                    match op {
                        Op::Put { key, value } => b.push(key, msn, Msg::Put(value)),
                        Op::Delete { key } => b.push(key, msn, Msg::Delete),
                        Op::Upsert { key, func, arg } => {
                            b.push(key, msn, Msg::Upsert { func, arg })
                        }
                        Op::DeleteRange { start, end } => {
                            b.push_range(RangeDel { msn, start, end })
                        }
                        Op::RenamePrefix { .. } | Op::CloneRange { .. } => {
                            return Err(Error::Invalid("internal: a rename among messages".into()))
                        }
                    }
                    l.apply(b, &self.upserts)?;
                }
            }
        }
        Ok(())
    }

    /// Restores the root's bounds: flushes its buffers below the node size, splits it
    /// (the tree grows a level), or drops a root with one child (it shrinks one).
    fn fix_root(&mut self) -> Result<()> {
        loop {
            let (mut root, _) = self.take_full(self.root)?;
            let r = self.shrink_buffers(&mut root);
            let sibs = match r {
                Ok(()) => self.split(&mut root),
                Err(e) => {
                    self.put_node(self.root, root, true);
                    return Err(e);
                }
            };
            if !sibs.is_empty() {
                let height = root.height() + 1;
                let old = self.root;
                self.put_node(old, root, true);
                let mut n = Internal::new(height, Vec::new(), vec![old], vec![Buffer::default()]);
                for (pivot, sib) in sibs {
                    let id = self.new_id();
                    self.put_node(id, sib, true);
                    n.pivots.push(pivot);
                    n.children.push(id);
                    n.buffers.push(Buffer::default());
                    n.lifts.push(None);
                }
                self.root = self.new_id();
                self.put_node(self.root, Node::Internal(n), true);
                continue; // a root of more than `fanout` children splits again
            }
            match root {
                Node::Internal(mut n) if n.children.len() == 1 && n.buffers[0].is_empty() => {
                    // A lifted child stores other keys than the root it replaces.
                    if n.lifts[0].is_some() {
                        let r = self.push_lift_down(&mut n, 0);
                        if r.as_ref().map_or(true, |&grew| grew) {
                            // (It split: the root keeps its new children.)
                            self.put_node(self.root, Node::Internal(n), true);
                            r?;
                            continue;
                        }
                    }
                    let old = self.root;
                    self.root = n.children[0];
                    self.free_node(old);
                }
                root => {
                    self.put_node(self.root, root, true);
                    return Ok(());
                }
            }
        }
    }

    fn shrink_buffers(&mut self, node: &mut Node) -> Result<()> {
        if let Node::Internal(n) = node {
            while n.bytes() > self.geo.node_bytes {
                let Some(i) = n.heaviest() else { break };
                self.flush_child(n, i)?;
            }
        }
        Ok(())
    }

    /// The pieces a node over its bounds splits into (after the first, with pivots).
    fn split(&mut self, node: &mut Node) -> Vec<(Vec<u8>, Node)> {
        match node {
            Node::Leaf(l) => {
                let s: Vec<(Vec<u8>, Node)> = l
                    .split(self.geo.node_bytes)
                    .into_iter()
                    .map(|(k, l)| (k, Node::Leaf(l)))
                    .collect();
                self.stats.leaf_splits += s.len() as u64;
                s
            }
            Node::Internal(n) => {
                let len = n.children.len();
                if len <= self.geo.fanout {
                    return Vec::new();
                }
                let pieces = len.div_ceil(self.geo.fanout).max(2);
                let mut out = Vec::new();
                for k in (1..pieces).rev() {
                    let at = len * k / pieces;
                    let pivot = n.pivots[at - 1].clone();
                    let piece = n.split_after(at - 1);
                    out.push((pivot, Node::Internal(piece)));
                }
                out.reverse();
                self.stats.internal_splits += out.len() as u64;
                out
            }
        }
    }

    /// Moves the buffer for child `idx` of `parent` into the child, then restores the
    /// child's bounds (its own flushes, a split into new siblings, or a merge).
    fn flush_child(&mut self, parent: &mut Internal, idx: usize) -> Result<()> {
        if parent.buffers[idx].is_empty() {
            return Ok(());
        }
        if self.drop_if_covered(parent, idx)? {
            return Ok(());
        }
        let cid = self.own(parent, idx)?;
        if self.flush_into_delta(parent, idx, cid)? {
            return Ok(());
        }
        let buf = std::mem::take(&mut parent.buffers[idx]);
        let (mut child, dirty) = match self.take_full(cid) {
            Ok(c) => c,
            Err(e) => {
                parent.buffers[idx] = buf;
                return Err(e);
            }
        };
        self.stats.flushes += 1;
        self.stats.flushed_bytes += buf.bytes() as u64;
        let buf = match &parent.lifts[idx] {
            Some(l) => l.buffer_to_inner(buf),
            None => buf,
        };
        let r = match &mut child {
            Node::Leaf(l) => l.apply(buf, &self.upserts),
            Node::Internal(c) => {
                c.absorb(buf);
                Ok(())
            }
        };
        if let Err(e) = r {
            self.put_node(cid, child, dirty);
            return Err(e);
        }
        let r = self.shrink_buffers(&mut child);
        let sibs = self.split(&mut child);
        self.put_node(cid, child, true);
        r?;
        let grew = !sibs.is_empty();
        self.adopt(parent, idx, sibs);
        if !grew {
            self.maybe_merge(parent, idx)?;
        }
        Ok(())
    }

    /// A child whose whole key range a range delete in its buffer covers holds nothing
    /// the buffer leaves alive (what it holds is older than the buffer): its subtree is
    /// let go of without reading its leaves, so an `rm` of a large file frees its
    /// leaves without reading them. Then every range delete of the buffer has done its
    /// work (the router clipped them to the child's range, and the point messages they
    /// cover are newer than them), and the child's place goes to a neighbour: the
    /// buffer's point messages join the neighbour's buffer (their keys are disjoint
    /// from the neighbour's, so their order against what lies below it does not
    /// matter) and the pivot between them goes. Returns whether the child is gone (the
    /// caller's flush is done). A neighbour with a lift cannot take keys outside its
    /// prefix; with no plain neighbour an empty subtree of the child's height takes
    /// its place instead, and the flush goes on into it. (Only children with a pivot
    /// on both sides: a node does not know its own bounds.)
    fn drop_if_covered(&mut self, parent: &mut Internal, idx: usize) -> Result<bool> {
        let (Some(lo), Some(hi)) = parent.child_range(idx) else {
            return Ok(false);
        };
        let covered = parent.buffers[idx]
            .ranges
            .iter()
            .any(|r| r.start.as_slice() <= lo && hi <= r.end.as_slice());
        if !covered {
            return Ok(false);
        }
        self.stats.subtrees_dropped += 1;
        parent.buffers[idx].ranges.clear();
        if self.remove_child(parent, idx)? {
            return Ok(true);
        }
        let height = parent.height - 1;
        let old = parent.children[idx];
        self.drop_ref(old, height)?;
        parent.children[idx] = self.build_empty(height);
        Ok(false)
    }

    /// Whether a cached subtree holds nothing: an empty leaf, or a chain of single
    /// children with empty buffers down to one (what deletes leave behind).
    fn holds_nothing(&self, id: NodeId) -> bool {
        match self.cache.get(&id).map(|c| &*c.node) {
            Some(Node::Leaf(l)) => l.delta.is_empty() && l.entries().is_some_and(Entries::is_empty),
            Some(Node::Internal(n)) => {
                n.children.len() == 1
                    && n.is_whole()
                    && !n.holds_any_message()
                    && self.holds_nothing(n.children[0])
            }
            None => false,
        }
    }

    /// Lets go of child `idx`'s subtree and gives its key range to a neighbour that has
    /// no lift (one with a lift cannot take keys outside its prefix): the left one's
    /// range grows up, or the right one's down. Its buffer's messages (which may hold
    /// no range delete: the caller cleared those it may) join the neighbour's buffer;
    /// their keys are disjoint from the neighbour's, so their order against what lies
    /// below it does not matter. `false` (nothing changed) when the parent has one
    /// child or no plain neighbour.
    fn remove_child(&mut self, parent: &mut Internal, idx: usize) -> Result<bool> {
        let n = parent.children.len();
        let h = parent.height - 1;
        let take = if idx > 0
            && parent.lifts[idx - 1].is_none()
            && !self.edge_lifted(parent.children[idx - 1], h, true)?
        {
            Some((idx - 1, idx - 1))
        } else if idx + 1 < n
            && parent.lifts[idx + 1].is_none()
            && !self.edge_lifted(parent.children[idx + 1], h, false)?
        {
            Some((idx + 1, idx))
        } else {
            None
        };
        let Some((to, pivot)) = take else {
            return Ok(false);
        };
        debug_assert!(parent.buffers[idx].ranges.is_empty());
        let old = parent.children[idx];
        self.drop_ref(old, parent.height - 1)?;
        let buf = std::mem::take(&mut parent.buffers[idx]);
        parent.buffers[to].absorb(buf);
        parent.pivots.remove(pivot);
        parent.children.remove(idx);
        parent.buffers.remove(idx);
        parent.lifts.remove(idx);
        // (Only whole nodes change: every buffer is loaded.)
        debug_assert!(parent.is_whole());
        parent.unread.clear();
        self.stats.merges += 1;
        Ok(true)
    }

    /// Whether a lifted edge lies on the subtree's right (or left) edge: a subtree whose
    /// range grows on that side would give that lifted child keys outside its prefix.
    fn edge_lifted(&mut self, mut id: NodeId, mut height: u16, right: bool) -> Result<bool> {
        while height > 0 {
            let (lifted, next) = match &*self.ensure(id)?.node {
                Node::Internal(n) => {
                    let i = if right { n.children.len() - 1 } else { 0 };
                    (n.lifts[i].is_some(), n.children[i])
                }
                Node::Leaf(_) => {
                    return Err(Error::Corrupt(format!(
                        "node {id}: a leaf where a subtree of height {height} was"
                    )))
                }
            };
            if lifted {
                return Ok(true);
            }
            id = next;
            height -= 1;
        }
        Ok(false)
    }

    /// Largest delta of a leaf; a leaf with its delta applied holds at most a node and
    /// this many bytes.
    fn delta_max(&self) -> usize {
        self.opts.delta_bytes.min(self.geo.node_bytes / 2)
    }

    /// Moves the buffer for child `cid` (`idx` of `parent`) into the child's delta if
    /// the child is as on disk (it has a base) and its delta has room: the child is
    /// neither read whole nor rewritten (see `node::Delta`). `false`: the caller
    /// flushes into the whole child instead.
    fn flush_into_delta(&mut self, parent: &mut Internal, idx: usize, cid: NodeId) -> Result<bool> {
        let max = self.delta_max();
        let incoming = parent.buffers[idx].bytes();
        let leaf = parent.height == 1;
        // (Upserts checked before the child is read: the check walks the messages, but
        // reading the child's section first cost a read more per flush of upserts.)
        if self.compacting || incoming > max || (leaf && parent.buffers[idx].has_upserts()) {
            return Ok(false);
        }
        // A leaf with its delta applied must stay within a node and a delta (the next
        // flush into the whole leaf splits it), so upserts stay out of leaf deltas (one
        // may grow a value far past its own size: a write at an offset); puts and
        // deletes grow it by at most their bytes. An internal node with its delta
        // applied flushes itself back within a node.
        let node_bytes = self.geo.node_bytes;
        let room = |size: usize, delta: usize| {
            delta + incoming <= max && (!leaf || size + delta + incoming <= node_bytes + max)
        };
        let fits = |d: &Delta, size: usize| match (&d.base, &d.unread) {
            (None, _) => (false, false),
            (Some(_), Some(at)) => (room(size, at.bytes()), true),
            (Some(_), None) => (room(size, d.buf.bytes()), false),
        };
        let (ok, unread) = match &*self.ensure(cid)?.node {
            Node::Leaf(l) if leaf => fits(&l.delta, l.bytes),
            Node::Internal(n) if !leaf => fits(&n.delta, 0),
            _ => {
                return Err(Error::Corrupt(format!(
                    "node {cid}: its height does not match its parent's"
                )))
            }
        };
        if !ok {
            return Ok(false);
        }
        if unread {
            self.load_delta(cid)?;
            let ok = match &*self.cache[&cid].node {
                Node::Leaf(l) => fits(&l.delta, l.bytes).0,
                Node::Internal(n) => fits(&n.delta, 0).0,
            };
            if !ok {
                return Ok(false);
            }
        }
        let buf = std::mem::take(&mut parent.buffers[idx]);
        let buf = match &parent.lifts[idx] {
            Some(l) => l.buffer_to_inner(buf),
            None => buf,
        };
        let Some((mut child, _)) = self.take_cached(cid) else {
            return Err(Error::Invalid(format!(
                "internal: node {cid} left the cache"
            )));
        };
        self.stats.flushes += 1;
        self.stats.delta_flushes += 1;
        self.stats.flushed_bytes += buf.bytes() as u64;
        match &mut child {
            Node::Leaf(l) => l.delta.buf.absorb(buf),
            Node::Internal(n) => n.delta.buf.absorb(buf),
        }
        self.put_node(cid, child, true);
        Ok(true)
    }

    /// Pushes pending messages down to the leaves, so that deletes free the space their
    /// keys held (a buffered range delete frees nothing until it reaches the leaves, and
    /// a delete in a leaf's delta nothing until the leaf is written whole). Only nodes
    /// that hold messages are read, and only those a message reaches become dirty: a
    /// compaction costs what it frees, not a copy of the tree (which a full device has
    /// no room for).
    ///
    /// Stops early, leaving the rest in the buffers, once a checkpoint of what it made
    /// dirty would need more than `budget_blocks`. Returns whether it got to the end
    /// (a merge with a child already visited may still leave messages deeper down:
    /// the caller runs it again until it changes nothing).
    pub fn flush_all(&mut self, budget_blocks: u64) -> Result<FlushAll> {
        self.check_failed()?;
        self.compacting = true;
        let (mut root, dirty) = match self.take_full(self.root) {
            Ok(x) => x,
            Err(e) => {
                self.compacting = false;
                return Err(e);
            }
        };
        let mut walk = FlushAll {
            complete: true,
            changed: false,
            budget_blocks,
        };
        let r = match &mut root {
            Node::Internal(n) => self.flush_subtree(n, &mut walk),
            Node::Leaf(_) => Ok(false),
        };
        self.compacting = false;
        let changed = *r.as_ref().unwrap_or(&true);
        self.put_node(self.root, root, dirty || changed);
        r?;
        if changed {
            self.fix_root()?;
        }
        Ok(walk)
    }

    /// Whether a compaction must rewrite this leaf: one stored as a delta over a base
    /// (the delta may hold deletes; written whole, the leaf frees both extents), or
    /// one with messages in its delta in memory. Other leaves are not read.
    fn leaf_holds_messages(&self, id: NodeId) -> bool {
        if self.is_shared(id) {
            return false;
        }
        self.bases.contains_key(&id)
            || self.cache.get(&id).is_some_and(|c| match &*c.node {
                Node::Leaf(l) => !l.delta.is_empty(),
                Node::Internal(_) => false,
            })
    }

    /// Pushes the messages of `n`'s buffers down its subtree (internal nodes are all
    /// visited: messages may wait deep below a node whose own buffers are empty, left
    /// there by a pass that stopped early). Shared subtrees are left alone: pushing
    /// messages into them would copy them, which takes space rather than freeing it.
    /// Returns whether `n` changed.
    fn flush_subtree(&mut self, n: &mut Internal, walk: &mut FlushAll) -> Result<bool> {
        let mut changed = false;
        let mut i = 0;
        while i < n.children.len() {
            if self.pending_blocks() > walk.budget_blocks && walk.changed {
                walk.complete = false;
                return Ok(changed);
            }
            let cid = n.children[i];
            if self.is_shared(cid) {
                i += 1;
                continue;
            }
            if !n.buffers[i].is_empty() {
                self.flush_child(n, i)?;
                walk.changed = true;
                changed = true;
                // The flush may have let the child go (a range delete covered it: its
                // range went to a neighbour, which slid into `i`), merged it, or put an
                // empty subtree in its place. Whatever is at `i` now is looked at from
                // the top: a neighbour may be shared, and a shared node must not change
                // in place (a split of it here took half its children from the other
                // copy, which the range delete then dropped).
                if n.children.get(i) != Some(&cid) {
                    continue;
                }
            }
            if n.height == 1 && !self.leaf_holds_messages(cid) {
                i += 1;
                continue;
            }
            let (mut child, dirty) = self.take_full(cid)?;
            let r = match &mut child {
                Node::Internal(c) => self.flush_subtree(c, walk),
                Node::Leaf(_) => Ok(true),
            };
            let child_changed = *r.as_ref().unwrap_or(&true);
            let sibs = if r.is_ok() && child_changed {
                self.split(&mut child)
            } else {
                Vec::new()
            };
            self.put_node(cid, child, dirty || child_changed);
            r?;
            if !child_changed {
                i += 1;
                continue;
            }
            walk.changed = true;
            changed = true;
            let pieces = sibs.len();
            self.adopt(n, i, sibs);
            if pieces == 0 {
                // An emptied child goes, or joins a neighbour.
                self.maybe_merge(n, i)?;
                if i >= n.children.len() {
                    break;
                }
            }
            i += 1 + pieces;
        }
        Ok(changed)
    }

    /// The pieces child `idx` split into become its right siblings in `parent`. Each
    /// takes the part of the child's buffer at or above its pivot (empty after a flush;
    /// not after a range rename's surgery) and the child's lift; a lifted child's pivots
    /// are in its own space, the parent's are in the parent's.
    fn adopt(&mut self, parent: &mut Internal, idx: usize, sibs: Vec<(Vec<u8>, Node)>) {
        let lift = parent.lifts[idx].clone();
        for (k, (pivot, node)) in sibs.into_iter().enumerate() {
            let id = self.new_id();
            self.put_node(id, node, true);
            let pivot = match &lift {
                Some(l) => l.to_outer(&pivot).into_owned(),
                None => pivot,
            };
            let buf = parent.buffers[idx + k].split_off(&pivot);
            parent.pivots.insert(idx + k, pivot);
            parent.children.insert(idx + 1 + k, id);
            parent.buffers.insert(idx + 1 + k, buf);
            parent.lifts.insert(idx + 1 + k, lift.clone());
        }
    }

    fn is_small(&self, id: NodeId) -> bool {
        match self.cache.get(&id).map(|c| &*c.node) {
            Some(Node::Leaf(l)) => l.entries().is_some() && l.bytes < self.geo.node_bytes / 4,
            Some(Node::Internal(n)) => n.children.len() < (self.geo.fanout / 4).max(2),
            None => false,
        }
    }

    /// Merges a small child with a neighbour when the two fit in one node.
    fn maybe_merge(&mut self, parent: &mut Internal, idx: usize) -> Result<()> {
        if parent.children.len() < 2 || !self.is_small(parent.children[idx]) {
            return Ok(());
        }
        // An emptied subtree goes without reading a neighbour to merge with.
        if parent.buffers[idx].is_empty()
            && self.holds_nothing(parent.children[idx])
            && self.remove_child(parent, idx)?
        {
            return Ok(());
        }
        let j = if idx + 1 < parent.children.len() {
            idx + 1
        } else {
            idx - 1
        };
        if !parent.buffers[j].is_empty() {
            let before = parent.children.len();
            self.flush_child(parent, j)?;
            if parent.children.len() != before {
                return Ok(());
            }
        }
        let (a, b) = (idx.min(j), idx.max(j));
        let (ida, idb) = (parent.children[a], parent.children[b]);
        if !parent.buffers[a].is_empty() || !parent.buffers[b].is_empty() {
            return Ok(());
        }
        if parent.lifts[a] != parent.lifts[b] {
            // One node stores keys one way: both in the parent's space first.
            for k in [b, a] {
                if self.push_lift_down(parent, k)? {
                    return Ok(()); // it split: nothing small to merge any more
                }
            }
        }
        self.ensure_full(ida)?;
        self.ensure_full(idb)?;
        let fits = match (&*self.cache[&ida].node, &*self.cache[&idb].node) {
            (Node::Leaf(x), Node::Leaf(y)) => x.bytes + y.bytes <= self.geo.node_bytes * 3 / 4,
            (Node::Internal(x), Node::Internal(y)) => {
                x.children.len() + y.children.len() <= self.geo.fanout
                    && x.bytes() + y.bytes() <= self.geo.node_bytes
            }
            _ => {
                return Err(Error::Corrupt(format!(
                    "siblings {ida} and {idb} differ in height"
                )))
            }
        };
        if !fits {
            return Ok(());
        }
        let ida = self.own(parent, a)?;
        let idb = self.own(parent, b)?;
        let (na, _) = self.take_cached(ida).expect("cached");
        let (nb, _) = self.take_cached(idb).expect("cached");
        let merged = match (na, nb) {
            (Node::Leaf(x), Node::Leaf(y)) => {
                let mut e = x.entries().cloned().unwrap_or_default();
                if let Some(y) = y.entries() {
                    e.extend_from(y, 0, y.len());
                }
                Node::Leaf(Leaf::full(e))
            }
            (Node::Internal(mut x), Node::Internal(y)) => {
                let pivot = match &parent.lifts[a] {
                    Some(l) => l.to_inner(&parent.pivots[a]).into_owned(),
                    None => parent.pivots[a].clone(),
                };
                x.pivots.push(pivot);
                x.pivots.extend(y.pivots);
                x.children.extend(y.children);
                x.buffers.extend(y.buffers);
                x.lifts.extend(y.lifts);
                Node::Internal(x)
            }
            _ => unreachable!("heights checked above"),
        };
        self.put_node(ida, merged, true);
        self.free_node(idb);
        parent.pivots.remove(a);
        parent.children.remove(b);
        parent.buffers.remove(b);
        parent.lifts.remove(b);
        self.stats.merges += 1;
        Ok(())
    }

    // ---- reads ----

    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.check_failed()?;
        self.stats.gets += 1;
        // Each level's messages for the key, root first: a node's delta (newer) before
        // its buffer for the child (older); applied in reverse.
        let mut levels: Vec<KeyMsgs> = Vec::new();
        let mut id = self.root;
        // The key in the space of the node at hand (lifted edges map it).
        let mut key_here: std::borrow::Cow<[u8]> = std::borrow::Cow::Borrowed(key);
        // Counted apart from `levels`: a level whose buffer is skipped adds nothing
        // there, and a damaged tree's cycle of such nodes would never end.
        let mut depth = 0usize;
        let leaf = loop {
            depth += 1;
            if depth > MAX_DEPTH {
                return Err(Error::Corrupt(format!(
                    "node {id}: more than {MAX_DEPTH} levels below the root (a cycle of nodes)"
                )));
            }
            let key: &[u8] = &key_here;
            // A buffer not read yet is skipped if its filter rules the key out, else
            // searched where it lies, without decoding or caching it (a query needs one
            // key's messages; whole buffers would crowd the leaves out). `unread`:
            // `None`: the buffer is loaded.
            let (i, unread, lift) = match &*self.ensure(id)?.node {
                Node::Internal(n) => {
                    let i = n.child_for(key);
                    let unread = match n.unread.get(i) {
                        Some(Some(at)) => Some(at.probe(key)),
                        _ => None,
                    };
                    (i, unread, n.lifts[i].clone())
                }
                Node::Leaf(_) => break id,
            };
            levels.extend(self.delta_lookup(id, key)?);
            let next_key = lift.map(|l| l.to_inner(key).into_owned());
            if let Some(probe) = unread {
                match probe {
                    node::BufferProbe::Skip => self.stats.buffers_skipped += 1,
                    node::BufferProbe::Whole(at) => {
                        let base = self.base_of(id)?;
                        self.stats.buffer_reads += 1;
                        levels.push(self.read_with(base, id, at.offset, at.len, |body| {
                            node::buffer_lookup(body, &at, id, key)
                        })?);
                    }
                    node::BufferProbe::Parts { head, run } => {
                        let base = self.base_of(id)?;
                        self.stats.buffer_reads += 1;
                        let mut covered = false;
                        if let Some((offset, len, crc)) = head {
                            covered = self.read_with(base, id, offset, len, |h| {
                                node::head_covers(h, crc, id, key)
                            })?;
                        }
                        let mut msgs = Vec::new();
                        if let Some(run) = run {
                            msgs = self.read_with(base, id, run.offset, run.len, |b| {
                                node::run_lookup(b, run.groups, run.crc, id, key)
                            })?;
                        }
                        levels.push((covered, msgs));
                    }
                }
            } else if let Node::Internal(n) = &*self.cache[&id].node {
                let b = &n.buffers[i];
                levels.push((b.covered(key), b.points.get(key)));
            }
            let Node::Internal(n) = &*self.cache[&id].node else {
                unreachable!("internal")
            };
            id = n.children[i];
            if let Some(k) = next_key {
                key_here = std::borrow::Cow::Owned(k);
            }
        };
        // The leaf's delta: the deepest messages (pushed last, applied first).
        levels.extend(self.delta_lookup(leaf, &key_here)?);
        let mut v = self.leaf_get(leaf, &key_here)?;
        for (covered, msgs) in levels.into_iter().rev() {
            if covered {
                v = None;
            }
            for (_, m) in &msgs {
                v = self.upserts.apply(v, m)?;
            }
        }
        Ok(v)
    }

    /// The messages a cached node's delta holds for `key` (read where they lie if the
    /// delta is not loaded and its filter does not rule the key out).
    fn delta_lookup(&mut self, id: NodeId, key: &[u8]) -> Result<Option<KeyMsgs>> {
        let d = match &*self.cache[&id].node {
            Node::Leaf(l) => &l.delta,
            Node::Internal(n) => &n.delta,
        };
        if !d.buf.is_empty() {
            return Ok(Some((d.buf.covered(key), d.buf.points.get(key))));
        }
        let Some(at) = d.unread.as_ref() else {
            return Ok(None);
        };
        // The range deletes are in the section; of the point messages, only the run
        // that would hold the key is read, if the filter admits it.
        let covered = at.ranges.iter().any(|r| r.covers(key));
        let run = at.may_hold(key).then(|| at.run_for(key).cloned()).flatten();
        let Some(run) = run else {
            self.stats.buffers_skipped += 1;
            return Ok(covered.then(|| (true, Vec::new())));
        };
        let e = self.extent_of(id)?;
        self.stats.buffer_reads += 1;
        let found = self.read_with(e, id, run.offset, run.len, |bytes| {
            node::run_lookup(bytes, run.groups, run.crc, id, key)
        })?;
        Ok(Some((covered, found)))
    }

    fn leaf_get(&mut self, id: NodeId, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let part = match &*self.cache[&id].node {
            Node::Leaf(Leaf {
                data: LeafData::Partial { index, .. },
                ..
            }) => Some(node::basement_for(index, key)),
            Node::Leaf(_) => None,
            Node::Internal(_) => return Err(Error::Corrupt(format!("node {id}: expected a leaf"))),
        };
        Ok(self
            .leaf_entries(id, part)?
            .and_then(|es| es.value_of(key))
            .map(<[u8]>::to_vec))
    }

    /// Reads the basements `a..b` of a cached partial leaf that are not loaded, in one
    /// read of the blocks that hold them.
    fn load_basements(&mut self, id: NodeId, a: usize, b: usize, many_only: bool) -> Result<()> {
        let want: Vec<(usize, node::BasementRef)> = match &*self.cache[&id].node {
            Node::Leaf(Leaf {
                data: LeafData::Partial { index, loaded },
                ..
            }) => (a..b.min(index.len()))
                .filter(|&i| loaded[i].is_none() && !(many_only && index[i].count <= 1))
                .map(|i| (i, index[i].clone()))
                .collect(),
            _ => return Ok(()),
        };
        let (Some(first), Some(last)) = (want.first(), want.last()) else {
            return Ok(());
        };
        let start = first.1.offset;
        let end = last.1.offset.saturating_add(last.1.len);
        let base = self.base_of(id)?;
        let got = self.read_with(base, id, start, end.saturating_sub(start), |bytes| {
            let mut got = Vec::with_capacity(want.len());
            for (i, r) in want {
                let body = basement_in(bytes, start, &r, id)?;
                got.push((i, node::decode_basement(body, &r, id)?));
            }
            Ok(got)
        })?;
        self.stats.basement_reads += got.len() as u64;
        self.change_cached(id, |n| {
            if let Node::Leaf(Leaf {
                data: LeafData::Partial { loaded, .. },
                ..
            }) = n
            {
                for (i, es) in got {
                    loaded[i] = Some(es);
                }
            }
        });
        Ok(())
    }

    /// Basements `a..b` of a partial leaf as one run of entries, for a scan of values:
    /// those cached are copied, the others (of one entry each: `load_basements` took the
    /// rest) read with one device read and appended, into the tree's reused
    /// `stream_buf`; `None` if every one is cached. A file's data (a block a basement)
    /// read by a scan passes through the tree this way without being kept (a point
    /// query, as betrfs's read of a single block, still caches it): the kernel's page cache
    /// above and the host's below keep it, and caching it here cost an allocation per
    /// block, page faults on that fresh memory, and the eviction of what is worth
    /// keeping.
    fn stream_basements(&mut self, id: NodeId, a: usize, b: usize) -> Result<Option<Entries>> {
        let node = self.cache[&id].node.clone();
        let Node::Leaf(Leaf {
            data: LeafData::Partial { index, loaded },
            ..
        }) = &*node
        else {
            return Ok(None);
        };
        let b = b.min(index.len());
        // (Empty basements too: the window's runs must cover every basement.)
        let unread = || (a..b).filter(|&i| loaded[i].is_none());
        let (Some(first), Some(last)) = (unread().next(), unread().next_back()) else {
            return Ok(None);
        };
        let start = index[first].offset;
        let len = (index[last].offset.saturating_add(index[last].len)).saturating_sub(start);
        let base = self.base_of(id)?;
        let mut into = std::mem::take(&mut self.stream_buf);
        into.clear();
        let mut streamed = 0;
        let r = self.read_with(base, id, start, len, |bytes| {
            for i in a..b {
                match &loaded[i] {
                    Some(es) => append_basement(&mut into, es, id)?,
                    // (An empty one too: its checksum and length are still checked.)
                    None => {
                        let r = &index[i];
                        let body = basement_in(bytes, start, r, id)?;
                        node::append_basement(body, r, id, &mut into)?;
                        streamed += 1;
                    }
                }
            }
            Ok(())
        });
        self.stats.basement_reads += streamed;
        match r {
            Ok(()) => Ok(Some(into)),
            Err(e) => {
                into.clear();
                self.stream_buf = into;
                Err(e)
            }
        }
    }

    /// The entries of a cached leaf: all of them, or (`part`) those of one basement of a
    /// partial leaf, which is read if it is not loaded yet.
    fn leaf_entries(&mut self, id: NodeId, part: Option<usize>) -> Result<Option<&Entries>> {
        let missing = match (&*self.cache[&id].node, part) {
            (
                Node::Leaf(Leaf {
                    data: LeafData::Partial { index, loaded },
                    ..
                }),
                Some(i),
            ) if loaded.get(i).is_some_and(Option::is_none) => Some(index[i].clone()),
            _ => None,
        };
        if let Some(b) = missing {
            let es = self.read_basement(id, &b)?;
            self.change_cached(id, |n| {
                if let Node::Leaf(Leaf {
                    data: LeafData::Partial { loaded, .. },
                    ..
                }) = n
                {
                    loaded[part.expect("a part")] = Some(es);
                }
            });
        }
        Ok(match (&*self.cache[&id].node, part) {
            (
                Node::Leaf(Leaf {
                    data: LeafData::Full(es),
                    ..
                }),
                _,
            ) => Some(es),
            (
                Node::Leaf(Leaf {
                    data: LeafData::Partial { loaded, .. },
                    ..
                }),
                Some(i),
            ) => loaded.get(i).and_then(Option::as_ref),
            _ => None,
        })
    }

    /// The walk from the root to the leaf a scan's chunk reads: forward, the leaf
    /// holding `cursor` (or `lo`); backward, the one below `cursor` (or the last).
    fn descend(&mut self, lo: &[u8], forward: bool, cursor: Option<&[u8]>) -> Result<Descent> {
        let mut id = self.root;
        // Bounds of the chunk's leaf, in the outer (the caller's) space.
        let mut node_lo: Option<Vec<u8>> = None;
        let mut node_hi: Option<Vec<u8>> = None;
        let mut path: Vec<(NodeId, usize)> = Vec::new();
        // Lifted edges on the path map keys between the outer space and each level's.
        let mut lifts = PathLifts::default();
        let mut lo_here = lo.to_vec();
        let mut cursor_here = cursor.map(<[u8]>::to_vec);
        loop {
            // A damaged tree may name an ancestor as a child: the descent then never
            // reaches a leaf (found by fuzzing). No real tree is this deep (fanout 3 or
            // more).
            if path.len() > MAX_DEPTH {
                return Err(Error::Corrupt(format!(
                    "node {id}: more than {MAX_DEPTH} levels below the root (a cycle of nodes)"
                )));
            }
            let c = self.ensure(id)?;
            let Node::Internal(n) = &*c.node else { break };
            let i = match (forward, &cursor_here) {
                (true, c) => n.child_for(c.as_deref().unwrap_or(&lo_here)),
                (false, None) => n.children.len() - 1,
                (false, Some(u)) => n.pivots.partition_point(|p| key_cmp(p, u).is_lt()),
            };
            let (clo, chi) = n.child_range(i);
            let level = path.len();
            if let Some(l) = clo {
                node_lo = Some(lifts.up(level, l).into_owned());
            }
            if let Some(h) = chi {
                node_hi = Some(lifts.up(level, h).into_owned());
            }
            let lift = n.lifts[i].clone();
            path.push((id, i));
            id = n.children[i];
            if let Some(l) = &lift {
                lo_here = l.to_inner(&lo_here).into_owned();
                cursor_here = cursor_here.map(|c| l.to_inner(&c).into_owned());
            }
            lifts.edges.push(lift);
        }
        Ok(Descent {
            leaf: id,
            path,
            lifts,
            node_lo,
            node_hi,
            lo_here,
            cursor_here,
        })
    }

    /// One chunk of a range scan: up to `reach` bytes of one leaf (basements read
    /// from disk if the leaf is not cached whole), or, when the caller says how many
    /// entries it still `want`s, about as many as hold them. Forward, `cursor` is the
    /// first key to return; backward, the bound below which to return keys (`None`:
    /// from `hi`, or the top).
    /// Fills `out` with the entries (ascending; its buffers are reused from chunk to
    /// chunk) and returns where the next chunk starts, if anywhere.
    #[allow(clippy::too_many_arguments)]
    pub fn scan_chunk(
        &mut self,
        lo: &[u8],
        hi: Option<&[u8]>,
        forward: bool,
        cursor: Option<&[u8]>,
        reach: usize,
        want: Option<usize>,
        keys_only: bool,
        out: &mut Chunk,
    ) -> Result<Option<Vec<u8>>> {
        self.check_failed()?;
        let Descent {
            leaf: id,
            path,
            lifts,
            mut node_lo,
            mut node_hi,
            lo_here,
            cursor_here,
        } = self.descend(lo, forward, cursor)?;
        let leaf_level = path.len();
        // A leaf not cached whole is read some basements at a time (one read), and a
        // whole one is taken as much at a time: the chunk narrows to them (a short
        // scan copies a few basements' worth, not the rest of the leaf).
        let basements = reach.div_ceil(self.geo.basement_bytes).max(1);
        let parts = match &*self.ensure(id)?.node {
            Node::Leaf(Leaf {
                data: LeafData::Partial { index, .. },
                ..
            }) => {
                let i = match (forward, &cursor_here) {
                    (true, c) => node::basement_for(index, c.as_deref().unwrap_or(&lo_here)),
                    (false, None) => index.len() - 1,
                    (false, Some(u)) => index
                        .partition_point(|b| key_cmp(&b.lo, u).is_lt())
                        .saturating_sub(1),
                };
                // With a count wanted: basement `i` (the cursor's; how many of its
                // entries lie past the cursor is unknown until it is read) and the next
                // ones until their counts hold the count. A scan of 1,000 keys then reads
                // about 32 basements instead of 16 + 32 in two chunks.
                let basements = match want {
                    // (A keys-only scan reads the index only, which is already here.)
                    None if keys_only => index.len(),
                    None => basements,
                    Some(w) => {
                        let beyond = |k: usize| -> Option<&node::BasementRef> {
                            if forward {
                                index.get(i + k)
                            } else {
                                i.checked_sub(k).map(|j| &index[j])
                            }
                        };
                        let (mut k, mut got) = (1, 0usize);
                        while got < w {
                            let Some(b) = beyond(k) else { break };
                            got += b.count as usize;
                            k += 1;
                        }
                        k
                    }
                };
                let (a, b) = if forward {
                    (i, (i + basements).min(index.len()))
                } else {
                    ((i + 1).saturating_sub(basements), i + 1)
                };
                if a > 0 {
                    node_lo = Some(lifts.up(leaf_level, &index[a].lo).into_owned());
                }
                if let Some(next) = index.get(b) {
                    node_hi = Some(lifts.up(leaf_level, &next.lo).into_owned());
                }
                Some((a, b))
            }
            Node::Leaf(Leaf {
                data: LeafData::Full(es),
                ..
            }) if want.is_some_and(|w| w < es.len()) || es.bytes() > reach => {
                let take = match want {
                    Some(w) => w.max(1),
                    None => (reach * es.len() / es.bytes()).max(1),
                };
                if forward {
                    let from = es
                        .search(cursor_here.as_deref().unwrap_or(&lo_here))
                        .unwrap_or_else(|i| i);
                    if let Some(cut) = from.checked_add(take).filter(|&c| c < es.len()) {
                        node_hi = Some(lifts.up(leaf_level, es.key(cut)).into_owned());
                    }
                } else {
                    let to = match cursor.or(hi) {
                        Some(u) => es.search(&lifts.down(leaf_level, u)).unwrap_or_else(|i| i),
                        None => es.len(),
                    };
                    if let Some(cut) = to.checked_sub(take).filter(|&c| c > 0) {
                        node_lo = Some(lifts.up(leaf_level, es.key(cut)).into_owned());
                    }
                }
                None
            }
            _ => None,
        };
        // A keys-only scan needs no basement of one entry: the leaf's index gives its
        // key, and its length gives the value's. A scan for values streams them: each
        // is read (one read for the chunk's, a second where basements of many entries
        // were read first), checked and copied into a reused buffer, not cached (see
        // `stream_basements`).
        let mut streamed = None;
        if let Some((a, b)) = parts {
            self.load_basements(id, a, b, true)?;
            if !keys_only {
                streamed = self.stream_basements(id, a, b)?;
            }
        }
        // The window of keys this chunk settles (outer space).
        let (wlo, whi): (Vec<u8>, Option<Vec<u8>>) = if forward {
            let start = cursor.unwrap_or(lo).to_vec();
            let end = match (node_hi.as_deref(), hi) {
                (Some(a), Some(b)) => Some(a.min(b).to_vec()),
                (a, b) => a.or(b).map(<[u8]>::to_vec),
            };
            (start, end)
        } else {
            let start = match node_lo.as_deref() {
                Some(l) if l > lo => l.to_vec(),
                _ => lo.to_vec(),
            };
            (start, cursor.or(hi).map(<[u8]>::to_vec))
        };
        out.clear();
        if whi.as_deref().is_none_or(|h| wlo.as_slice() < h) {
            // A scan's chunks walk the same path again and again: the path's buffers
            // are read and kept (a point query searches one where it lies instead).
            for &(pid, i) in &path {
                self.load_buffer(pid, i)?;
            }
            // Deltas not read yet: the runs that meet the window only (by level, the
            // path's nodes then the leaf; `None` where the delta is loaded).
            let mut windows = Vec::with_capacity(path.len() + 1);
            for (level, &nid) in path.iter().map(|(p, _)| p).chain([&id]).enumerate() {
                let lo_l = lifts.down(level, &wlo).into_owned();
                let hi_l = whi.as_deref().map(|h| lifts.down(level, h).into_owned());
                windows.push(self.delta_window(nid, &lo_l, hi_l.as_deref())?);
            }
            let mut nodes = Vec::with_capacity(path.len() + 1);
            for &(pid, _) in &path {
                let c = self
                    .cache
                    .get(&pid)
                    .ok_or_else(|| Error::Invalid("internal: scan path evicted".into()))?;
                nodes.push(c.node.clone());
            }
            let leaf = self.cache[&id].node.clone();
            let synth = match (keys_only, parts) {
                (true, Some((a, b))) => Some(index_keys(&leaf, a, b, id)?),
                _ => streamed.take(),
            };
            let mode = match (keys_only, &synth) {
                (false, _) => Mode::Values,
                (true, None) => Mode::Lengths,
                (true, Some(_)) => Mode::Encoded,
            };
            let done = self.merge_window(
                &nodes,
                &path,
                &leaf,
                parts,
                synth.as_ref(),
                mode,
                &lifts,
                &windows,
                &wlo,
                whi.as_deref(),
                out,
            )?;
            if !done {
                // A registered upsert on the path needs the values it changes: the
                // basements are read after all, and the lengths taken from them.
                out.clear();
                if let Some((a, b)) = parts {
                    self.load_basements(id, a, b, false)?;
                }
                let leaf = self.cache[&id].node.clone();
                self.merge_window(
                    &nodes,
                    &path,
                    &leaf,
                    parts,
                    None,
                    Mode::Lengths,
                    &lifts,
                    &windows,
                    &wlo,
                    whi.as_deref(),
                    out,
                )?;
            } else if !keys_only {
                streamed = synth;
            }
        }
        if let Some(mut s) = streamed {
            s.clear();
            self.stream_buf = s;
        }
        let next = if forward {
            match node_hi {
                Some(h) if hi.is_none_or(|hi| h.as_slice() < hi) => Some(h),
                _ => None,
            }
        } else {
            match node_lo {
                Some(l) if l.as_slice() > lo => Some(l),
                _ => None,
            }
        };
        // (Ascending either way: a backward scan walks the chunk from its end.)
        Ok(next)
    }

    /// One leaf's part of [`crate::Tree::first_absent`]: the keys `prefix ‖ m` from
    /// `m = n` on, below `prefix ‖ to`, in the leaf that holds `prefix ‖ n`. When no
    /// buffer or delta on the path (the leaf's own included) holds a message in the
    /// leaf's window, the leaf's keys are the answer and are walked where they lie
    /// (for a partial leaf, its index: a one-entry basement's key is its first);
    /// otherwise, or at a basement of several entries not read, the rest of the
    /// window is left to a keys-only scan, which merges the messages.
    pub fn absent_chunk(&mut self, prefix: &[u8], n: u64, to: u64) -> Result<AbsentStep> {
        use crate::{key_number, numbered_key};
        self.check_failed()?;
        let start = numbered_key(prefix, n);
        let end = numbered_key(prefix, to);
        let d = self.descend(&start, true, Some(&start))?;
        // The window this leaf settles, outer space.
        let until = match d.node_hi {
            Some(h) if h < end => h,
            _ => end,
        };
        for &(pid, i) in &d.path {
            self.load_buffer(pid, i)?;
        }
        let levels: Vec<NodeId> = d.path.iter().map(|p| p.0).chain([d.leaf]).collect();
        for (level, &nid) in levels.iter().enumerate() {
            let lo_l = d.lifts.down(level, &start).into_owned();
            let hi_l = d.lifts.down(level, &until).into_owned();
            let window = self.delta_window(nid, &lo_l, Some(&hi_l))?;
            let node = self
                .cache
                .get(&nid)
                .ok_or_else(|| Error::Invalid("internal: a search's path evicted".into()))?
                .node
                .clone();
            let (delta, buffer) = match &*node {
                Node::Leaf(l) => (&l.delta, None),
                Node::Internal(x) => (&x.delta, x.buffers.get(d.path[level].1)),
            };
            let delta = match (&window, &delta.unread) {
                (Some(w), _) => w,
                (None, None) => &delta.buf,
                (None, Some(_)) => {
                    return Err(Error::Invalid(
                        "internal: a search's delta is unread".into(),
                    ))
                }
            };
            let busy = |b: &Buffer| {
                b.points.any_in(&lo_l, &hi_l)
                    || b.ranges.iter().any(|r| {
                        r.end.as_slice() > lo_l.as_slice() && r.start.as_slice() < hi_l.as_slice()
                    })
            };
            if busy(delta) || buffer.is_some_and(busy) {
                return Ok(AbsentStep::Merge { from: n, until });
            }
        }
        self.stats.absent_walks += 1;
        let leaf_level = d.path.len();
        let leaf = self.cache[&d.leaf].node.clone();
        let Node::Leaf(l) = &*leaf else {
            return Err(Error::Invalid(
                "internal: a search's leaf is internal".into(),
            ));
        };
        let lo_in = d.cursor_here.unwrap_or(d.lo_here);
        let hi_in = d.lifts.down(leaf_level, &until).into_owned();
        let plain = d.lifts.none();
        let plen = prefix.len();
        let mut next = n;
        // Each key of the leaf in the window, in order: `Some(answer)` to stop. The
        // loops below bound the window by index, so most keys cost a length check and
        // an eight-byte load: without lifts a key between `prefix ‖ 0` and
        // `prefix ‖ u64::MAX` starts with `prefix`, so only its length tells whether
        // it is a numbered key.
        let mut visit = |k: &[u8]| -> Result<Option<AbsentStep>> {
            let number = if plain {
                k.get(plen..)
                    .and_then(|r| <[u8; 8]>::try_from(r).ok())
                    .map(u64::from_be_bytes)
            } else {
                key_number(prefix, &d.lifts.up(leaf_level, k))
            };
            match number {
                Some(m) if m == next => next += 1,
                Some(m) if m > next => return Ok(Some(AbsentStep::Found(next))),
                Some(_) => {
                    return Err(Error::Corrupt(format!(
                        "node {}: keys out of order",
                        d.leaf
                    )))
                }
                None => {}
            }
            Ok(None)
        };
        let inside = |k: &[u8]| k >= lo_in.as_slice() && k < hi_in.as_slice();
        let mut stop = None;
        match &l.data {
            LeafData::Full(es) => {
                let from = es.search(&lo_in).unwrap_or_else(|i| i);
                let until_j = es.search(&hi_in).unwrap_or_else(|i| i);
                for j in from..until_j.max(from) {
                    stop = visit(es.key(j))?;
                    if stop.is_some() {
                        break;
                    }
                }
            }
            LeafData::Partial { index, loaded } => {
                let first = node::basement_for(index, &lo_in);
                // Basements starting below the window's end: the rest lie past it.
                let last = index.partition_point(|b| b.lo.as_slice() < hi_in.as_slice());
                'walk: for (i, b) in index.iter().enumerate().take(last).skip(first) {
                    match (loaded.get(i).and_then(Option::as_ref), b.count) {
                        (Some(es), _) => {
                            for (k, _) in es.iter() {
                                if k >= hi_in.as_slice() {
                                    break 'walk;
                                }
                                if k >= lo_in.as_slice() {
                                    stop = visit(k)?;
                                    if stop.is_some() {
                                        break 'walk;
                                    }
                                }
                            }
                        }
                        (None, 0) => {}
                        (None, 1) => {
                            // (Only the first basement can start below the window.)
                            if i > first || inside(&b.lo) {
                                stop = visit(&b.lo)?;
                                if stop.is_some() {
                                    break;
                                }
                            }
                        }
                        // (Its keys are in its body: the scan reads it.)
                        (None, _) => return Ok(AbsentStep::Merge { from: next, until }),
                    }
                }
            }
        }
        if let Some(AbsentStep::Found(m)) = stop {
            return Ok(AbsentStep::Found(m));
        }
        Ok(AbsentStep::settled(prefix, next, to, &until))
    }

    /// The messages of the cached node `id`'s unread delta that a scan's window
    /// `lo..hi` (in the node's space) may need: its range deletes and the runs that meet
    /// the window, read in one piece (`None` if the delta is loaded or empty).
    fn delta_window(&mut self, id: NodeId, lo: &[u8], hi: Option<&[u8]>) -> Result<Option<Buffer>> {
        let at = match &*self.cache[&id].node {
            Node::Leaf(l) => l.delta.unread.clone(),
            Node::Internal(n) => n.delta.unread.clone(),
        };
        let Some(mut at) = at else {
            return Ok(None);
        };
        // Run `i` holds keys `runs[i].lo..runs[i + 1].lo`.
        let first = at
            .runs
            .partition_point(|r| key_cmp(&r.lo, lo).is_le())
            .saturating_sub(1);
        let end = hi.map_or(at.runs.len(), |h| {
            at.runs.partition_point(|r| key_cmp(&r.lo, h).is_lt())
        });
        at.runs = at.runs.drain(first..end.max(first)).collect();
        if at.runs.is_empty() && at.ranges.is_empty() {
            return Ok(Some(Buffer::default()));
        }
        Ok(Some(self.read_delta(id, &at)?))
    }

    /// Decodes and keeps the delta of the cached node `id` if it is unread.
    fn load_delta(&mut self, id: NodeId) -> Result<()> {
        let Some(at) = (match &*self.cache[&id].node {
            Node::Leaf(l) => l.delta.unread.clone(),
            Node::Internal(n) => n.delta.unread.clone(),
        }) else {
            return Ok(());
        };
        let b = self.read_delta(id, &at)?;
        self.change_cached(id, |n| {
            let d = match n {
                Node::Leaf(l) => &mut l.delta,
                Node::Internal(n) => &mut n.delta,
            };
            d.buf = b;
            d.unread = None;
        });
        Ok(())
    }

    /// Decodes and keeps buffer `i` of the cached internal node `id` if it is unread.
    fn load_buffer(&mut self, id: NodeId, i: usize) -> Result<()> {
        let Some(at) = (match &*self.cache[&id].node {
            Node::Internal(n) => n.unread.get(i).cloned().flatten(),
            Node::Leaf(_) => None,
        }) else {
            return Ok(());
        };
        let base = self.base_of(id)?;
        self.stats.buffer_reads += 1;
        let b = self.read_with(base, id, at.offset, at.len, |body| {
            node::decode_buffer(body, &at, id)
        })?;
        self.change_cached(id, |n| {
            if let Node::Internal(n) = n {
                n.buffers[i] = b;
                n.unread[i] = None;
            }
        });
        Ok(())
    }

    /// Fills `out` with the entries of `wlo..whi` (outer space): the leaf's entries
    /// (of basements `parts`, or all) with the messages of the path's buffers applied,
    /// in one pass over every source. At each key the leaf's value comes first, then
    /// each level from the deepest up applies its range deletes, then its messages
    /// (the buffer rule), which is the order they were issued in.
    #[allow(clippy::too_many_arguments)]
    fn merge_window(
        &self,
        nodes: &[Arc<Node>],
        path: &[(NodeId, usize)],
        leaf: &Node,
        parts: Option<(usize, usize)>,
        synth: Option<&Entries>,
        mode: Mode,
        lifts: &PathLifts,
        windows: &[Option<Buffer>],
        wlo: &[u8],
        whi: Option<&[u8]>,
        out: &mut Chunk,
    ) -> Result<bool> {
        use crate::points::MsgRef;
        use std::borrow::Cow;
        let leaf_level = path.len();
        // The leaf's entries in the window: runs of one basement (or of the whole leaf).
        let leaf_lo = lifts.down(leaf_level, wlo);
        let leaf_hi = whi.map(|h| lifts.down(leaf_level, h));
        let mut runs: Vec<(&Entries, usize, usize)> = Vec::new();
        let leaf_run = |es: &'_ Entries| -> (usize, usize) {
            let from = es.search(&leaf_lo).unwrap_or_else(|i| i);
            let to = match &leaf_hi {
                Some(h) => es.search(h).unwrap_or_else(|i| i),
                None => es.len(),
            };
            (from, to.max(from))
        };
        match (leaf, parts) {
            _ if synth.is_some() => {
                if let Some(es) = synth {
                    let (a, b) = leaf_run(es);
                    runs.push((es, a, b));
                }
            }
            (
                Node::Leaf(Leaf {
                    data: LeafData::Full(es),
                    ..
                }),
                _,
            ) => {
                let (a, b) = leaf_run(es);
                runs.push((es, a, b));
            }
            (
                Node::Leaf(Leaf {
                    data: LeafData::Partial { loaded, .. },
                    ..
                }),
                Some((a, b)),
            ) => {
                for es in &loaded[a..b.min(loaded.len())] {
                    // (Read by `load_basements` just before; nothing evicts meanwhile.)
                    let es = es
                        .as_ref()
                        .ok_or_else(|| Error::Invalid("internal: scan basement evicted".into()))?;
                    let (x, y) = leaf_run(es);
                    runs.push((es, x, y));
                }
            }
            _ => {}
        }
        // Each level's range deletes and messages in the window, keys in outer space.
        struct Level<'a> {
            ranges: Vec<RangeDel>,
            items: Vec<(Cow<'a, [u8]>, crate::points::Item<'a>)>,
            at: usize,
        }
        let mut levels: Vec<Level> = Vec::new();
        // The leaf's delta, then each buffer on the path from the deepest up.
        let Node::Leaf(leaf_node) = leaf else {
            return Err(Error::Invalid("internal: a scan's leaf is internal".into()));
        };
        // A level's delta: loaded, or the runs of it the window needs.
        fn delta_at<'a>(window: &'a Option<Buffer>, d: &'a node::Delta) -> Result<&'a Buffer> {
            match (window, &d.unread) {
                (Some(w), _) => Ok(w),
                (None, None) => Ok(&d.buf),
                (None, Some(_)) => Err(Error::Invalid("internal: a scan's delta is unread".into())),
            }
        }
        // (Each node's buffer, then its delta: newer.)
        let mut sources: Vec<(usize, &Buffer)> = vec![(
            leaf_level,
            delta_at(&windows[leaf_level], &leaf_node.delta)?,
        )];
        for (level, (n, &(_, i))) in nodes.iter().zip(path).enumerate().rev() {
            let Node::Internal(n) = &**n else {
                return Err(Error::Invalid("internal: a leaf on a scan's path".into()));
            };
            sources.push((level, &n.buffers[i]));
            sources.push((level, delta_at(&windows[level], &n.delta)?));
        }
        for (level, b) in sources {
            let lo_l = lifts.down(level, wlo);
            let hi_l = whi.map(|h| lifts.down(level, h));
            let mut ranges: Vec<RangeDel> = b
                .ranges
                .iter()
                .filter(|r| {
                    r.end.as_slice() > &*lo_l
                        && hi_l.as_deref().is_none_or(|h| r.start.as_slice() < h)
                })
                .cloned()
                .collect();
            let window = b.points.window_in_place(&lo_l, hi_l.as_deref());
            if ranges.is_empty() && window.is_empty() {
                continue;
            }
            let plain = lifts.edges[..level].iter().all(Option::is_none);
            if !plain {
                for r in &mut ranges {
                    r.start = lifts.up(level, &r.start).into_owned();
                    r.end = lifts.up(level, &r.end).into_owned();
                }
            }
            let items = window
                .into_iter()
                .map(|(k, it)| {
                    let k = if plain {
                        Cow::Borrowed(k)
                    } else {
                        Cow::Owned(lifts.up(level, k).into_owned())
                    };
                    (k, it)
                })
                .collect();
            levels.push(Level {
                ranges,
                items,
                at: 0,
            });
        }
        // The leaf's keys in outer space: borrowed unless an edge on the path is lifted.
        let leaf_plain = lifts.none();
        let lifted: Vec<Vec<u8>> = if leaf_plain {
            Vec::new()
        } else {
            runs.iter()
                .flat_map(|&(es, a, b)| (a..b).map(move |j| es.key(j)))
                .map(|k| lifts.up(leaf_level, k).into_owned())
                .collect()
        };
        // Room for the leaf's entries and what the messages may add (a chunk that
        // outgrows its buffers copies them, and a fresh large buffer is page faults).
        let items = || levels.iter().flat_map(|l| &l.items);
        let total = runs.iter().map(|&(_, a, b)| b - a).sum::<usize>() + items().count();
        let bytes = match mode {
            Mode::Values => {
                runs.iter()
                    .map(|&(es, a, b)| es.body(a, b).len())
                    .sum::<usize>()
                    + items()
                        .map(|(k, it)| k.len() + it.size_hint())
                        .sum::<usize>()
            }
            Mode::Lengths | Mode::Encoded => {
                runs.iter()
                    .map(|&(es, a, b)| (a..b).map(|x| es.key(x).len()).sum::<usize>())
                    .sum::<usize>()
                    + items().map(|(k, _)| k.len()).sum::<usize>()
            }
        };
        out.reserve(bytes, total);
        let emit = |out: &mut Chunk, k: &[u8], v: &[u8]| match mode {
            Mode::Values => out.push(k, v),
            Mode::Lengths => out.push_key(k, v.len()),
            Mode::Encoded => out.push_key(k, decode_len(v)),
        };
        let any_ranges = levels.iter().any(|l| !l.ranges.is_empty());
        // (run, index in run, index over all runs)
        let (mut r, mut j, mut n) = (0, runs.first().map_or(0, |x| x.1), 0);
        let mut key: Vec<u8> = Vec::new();
        loop {
            // The level whose next message has the smallest key (messages are sparse
            // among the leaf's entries: the entries below it are copied with one
            // comparison each).
            let mut first: Option<usize> = None;
            for (x, l) in levels.iter().enumerate() {
                if let Some((k, _)) = l.items.get(l.at) {
                    if first.is_none_or(|f| key_cmp(k, &levels[f].items[levels[f].at].0).is_lt()) {
                        first = Some(x);
                    }
                }
            }
            let bound: Option<&[u8]> = first.map(|f| levels[f].items[levels[f].at].0.as_ref());
            loop {
                while r < runs.len() && j >= runs[r].2 {
                    r += 1;
                    j = runs.get(r).map_or(0, |x| x.1);
                }
                if r == runs.len() {
                    break;
                }
                if !any_ranges {
                    // Every entry below the next message is copied as it is: find
                    // where they end, then copy them with no comparison each.
                    let (es, _, end) = runs[r];
                    let stop = match bound {
                        None => end,
                        Some(b) if leaf_plain => gallop(j, end, |x| key_cmp(es.key(x), b).is_lt()),
                        Some(b) => gallop(j, end, |x| key_cmp(&lifted[n + x - j], b).is_lt()),
                    };
                    for x in j..stop {
                        let (k, v) = es.get(x);
                        let k = if leaf_plain {
                            k
                        } else {
                            lifted[n + x - j].as_slice()
                        };
                        emit(out, k, v);
                    }
                    n += stop - j;
                    j = stop;
                    if j < end {
                        break;
                    }
                    continue;
                }
                let (k, v) = runs[r].0.get(j);
                let k = if leaf_plain { k } else { lifted[n].as_slice() };
                if bound.is_some_and(|b| key_cmp(k, b).is_ge()) {
                    break;
                }
                // No message for this key: only a range delete may drop it.
                if !(any_ranges
                    && levels
                        .iter()
                        .any(|l| l.ranges.iter().any(|rd| rd.covers(k))))
                {
                    emit(out, k, v);
                }
                j += 1;
                n += 1;
            }
            let Some(b) = bound else { break };
            key.clear();
            key.extend_from_slice(b);
            let mut v: Option<Cow<[u8]>> = None;
            if r < runs.len() {
                let (k, lv) = runs[r].0.get(j);
                let k = if leaf_plain { k } else { lifted[n].as_slice() };
                if key_eq(k, &key) {
                    v = Some(Cow::Borrowed(lv));
                    j += 1;
                    n += 1;
                }
            }
            if mode == Mode::Encoded {
                // Lengths only: the built-in upserts' results follow from the old
                // length; a registered one's needs the value (the caller reads the
                // basements and asks again).
                let mut len = v.map(|v| decode_len(&v));
                for l in &mut levels {
                    if l.ranges.iter().any(|rd| rd.covers(&key)) {
                        len = None;
                    }
                    while let Some((k, it)) = l.items.get(l.at) {
                        if !key_eq(k, &key) {
                            break;
                        }
                        for (_, msg) in it.msgs() {
                            len = match msg {
                                MsgRef::Put(x) => Some(x.len()),
                                MsgRef::Delete => None,
                                MsgRef::Upsert { func, arg } => {
                                    match self.upserts.length_after(len, func, arg) {
                                        Some(l) => l,
                                        None => return Ok(false),
                                    }
                                }
                            };
                        }
                        l.at += 1;
                    }
                }
                if let Some(len) = len {
                    out.push_key(&key, len);
                }
                continue;
            }
            for l in &mut levels {
                if l.ranges.iter().any(|rd| rd.covers(&key)) {
                    v = None;
                }
                while let Some((k, it)) = l.items.get(l.at) {
                    if !key_eq(k, &key) {
                        break;
                    }
                    v = self.upserts.apply_all(v, it.msgs().map(|(_, m)| m))?;
                    l.at += 1;
                }
            }
            if let Some(v) = v {
                emit(out, &key, &v);
            }
        }
        Ok(true)
    }

    // ---- space ----

    /// Blocks the next checkpoint may take at most: every dirty node (its bytes, and a
    /// block more for its extent's last block), the one in flight until it is done,
    /// and the table. A change may be accepted only while this fits in what is free:
    /// copy-on-write needs the new copies before the old ones can go.
    pub fn pending_blocks(&self) -> u64 {
        let bs = self.geo.block_size as u64;
        let inflight = self
            .inflight
            .as_ref()
            .filter(|f| !f.done().is_done())
            .map_or(0, |f| (f.bytes as u64).div_ceil(bs) + f.pinned.len() as u64);
        let table = ((self.btt.len() + self.cache.dirty_nodes()) as u64 * 48).div_ceil(bs) + 1;
        (self.cache.dirty_mem() as u64).div_ceil(bs)
            + self.cache.dirty_nodes() as u64
            + inflight
            + table
    }

    /// Blocks always kept free beyond `pending_blocks`, so that the checkpoint a batch
    /// leads to fits: what one batch may dirty besides what was counted (a root flush
    /// down every level, each child split) and the slack of fitting whole nodes into
    /// the free runs left between others.
    pub fn margin_blocks(&self) -> u64 {
        let node = (self.geo.node_bytes / self.geo.block_size) as u64 + 1;
        16 * node
    }

    pub fn free_blocks(&self) -> u64 {
        self.alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free_blocks
    }

    /// Refuses, before anything is logged, a batch that adds keys or bytes while what
    /// it adds would not fit beside the next checkpoint and the margin: once accepted, a
    /// batch must be checkpointed, and a checkpoint that cannot be written leaves the
    /// tree unable to move its log on. Batches that only delete, rename or clone are
    /// let through on the margin (they are how a full tree gets room back). When short,
    /// it first checkpoints, which frees the extents the dirty nodes replace.
    fn admit(&mut self, ops: &[Op]) -> Result<()> {
        let grows: usize = ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value } => key.len() + value.len() + 16,
                Op::Upsert { key, arg, .. } => key.len() + arg.len() + 18,
                _ => 0,
            })
            .sum();
        if grows == 0 {
            return Ok(());
        }
        let need = (grows as u64).div_ceil(self.geo.block_size as u64);
        // (`full_at`: the last checkpoint found no room where the allocator saw some,
        // the host under a sparse image being full: only a checkpoint that succeeds
        // shows there is room again.)
        let fits = |t: &Self| {
            t.full_at.is_none() && t.pending_blocks() + t.margin_blocks() + need <= t.free_blocks()
        };
        if fits(self) && self.reserve_ahead(need)? {
            return Ok(());
        }
        self.finish_checkpoint()?;
        if !fits(self) && (self.cache.dirty_nodes() > 0 || self.full_at.is_some()) {
            self.checkpoint()?;
        }
        if fits(self) && self.reserve_ahead(need)? {
            return Ok(());
        }
        Err(Error::Full(need))
    }

    /// Makes sure the device has storage behind the free runs the next checkpoints
    /// will take (first fit: the lowest), twice what they may need (runs too short for
    /// a node are passed over), so that a sparse image on a host file system that fills
    /// up refuses the batch that would not fit instead of a checkpoint that cannot be
    /// written (`false`). The device remembers what it reserved: cheap when done.
    fn reserve_ahead(&mut self, need: u64) -> Result<bool> {
        let want = 2 * (self.pending_blocks() + self.margin_blocks() + need);
        let free = self.free_blocks();
        // The free runs change only when a checkpoint allocates or frees: once reserved
        // for as much as is wanted now, nothing to do until then (a walk of the runs
        // on every batch cost small writes).
        if self
            .reserved_for
            .is_some_and(|(f, w)| f == free && w >= want)
        {
            return Ok(true);
        }
        // Ahead of that again, so that the next batches (whose wants grow with the
        // dirty nodes) find it done.
        let ahead = 2 * want;
        let runs = self
            .alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .lowest(ahead);
        for r in runs {
            match self.engine.reserve(r.start, r.blocks) {
                Ok(()) => {}
                Err(quilt_patch::PatchError::Block(quilt_block::BlockError::NoSpace {
                    ..
                })) => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        self.reserved_for = Some((free, ahead));
        Ok(true)
    }

    /// Whether the next checkpoint must start now for the space it needs: what it must
    /// write passes what is free less the margin.
    fn short_of_space(&self) -> bool {
        self.cache.dirty_nodes() > 0
            && self.pending_blocks() + self.margin_blocks() / 2 >= self.free_blocks()
            && self.full_at != Some(self.free_blocks())
    }

    // ---- durability ----

    /// The value length from which a put is logged by reference: never while batches
    /// are held (their one record is logged whole), nor before a header of version 4
    /// is durable (a binary that cannot replay such records might open the tree).
    fn late_min(&self) -> usize {
        if self.held.is_none() && self.durable_version >= 4 {
            self.opts.late_put_bytes.max(1)
        } else {
            usize::MAX
        }
    }

    /// Notes the values of a logged batch's puts by reference: a sync owes them until
    /// a durable checkpoint holds them.
    fn owe_late(&mut self, ops: &[Op], late_min: usize) {
        for (i, op) in ops.iter().enumerate() {
            if let Op::Put { value, .. } = op {
                if value.len() >= late_min {
                    self.unbound
                        .push((self.next_msn + i as u64, Arc::new(value.clone())));
                    self.unbound_bytes += value.len();
                    self.stats.late_puts += 1;
                }
            }
        }
    }

    /// Makes the values of every put logged by reference so far reach the log or a
    /// header: a bind record after the records it binds, or, when they are many (a
    /// checkpoint writes them once, where a bind record would be a second copy) or do
    /// not fit the ring, a checkpoint.
    fn bind_late(&mut self) -> Result<()> {
        if self.unbound.is_empty() {
            return Ok(());
        }
        let bs = self.geo.block_size;
        let fits = |t: &Inner, len: usize| {
            let blocks = t.log.blocks_for(len, bs);
            blocks < t.record_blocks_max() && blocks < t.log.room()
        };
        let len: usize = 12
            + self
                .unbound
                .iter()
                .map(|(_, v)| v.len() + 12)
                .sum::<usize>();
        if self.opts.control_unbound_syncs {
            // (The explorer's control: the values are forgotten, not made durable.)
        } else if self.unbound_bytes < self.opts.dirty_bytes / 8 && fits(self, len) {
            let rec = log::bind_record(&self.unbound);
            self.log.append(&self.engine, &rec)?;
            self.stats.late_bytes_bound += self.unbound_bytes as u64;
        } else {
            self.finish_checkpoint()?;
            if !self.unbound.is_empty() {
                self.checkpoint()?;
            }
        }
        self.unbound.clear();
        self.unbound_bytes = 0;
        Ok(())
    }

    /// A patch that is durable once every batch written so far is.
    pub fn sync_point(&mut self) -> Result<PatchId> {
        self.check_failed()?;
        self.bind_late()?;
        self.log.write_tail(&self.engine)?;
        let engine = self.engine.clone();
        self.log.pending.retain(|p| !engine.is_durable(*p));
        self.stats.syncs += 1;
        Ok(self.engine.empty(&self.log.pending))
    }

    /// After a write: starts a checkpoint when dirty nodes pass three quarters of their
    /// limit (or the log three quarters of its ring) and none is in flight, and evicts.
    /// Returns the checkpoint in flight when the caller must wait for it before going on
    /// (dirty nodes and the one in flight past
    /// the whole limit, the log ring nearly full, or the cache far over its budget with
    /// nothing it may evict); the caller waits without the lock and calls again.
    pub fn maintain(&mut self) -> Result<Option<Arc<checkpoint::Done>>> {
        self.poll_checkpoint()?;
        // Clean nodes make room first: a checkpoint for memory's sake is for when
        // evicting every clean node we may is not enough.
        self.evict();
        let limit = self.opts.dirty_bytes;
        let cache = self.opts.cache_bytes;
        let room = self.log.room();
        let ring = self.geo.log_blocks;
        // Three quarters, not half: every checkpoint rewrites the internal nodes, which
        // a stream of writes keeps dirty, so the fewer the better; the last quarter
        // still lets writers go on while one is in flight. (2 M random inserts: 62
        // checkpoints instead of 105, write amplification 9.8 instead of 11.1.)
        let short = self.short_of_space();
        let want = self.cache.dirty_mem() > limit / 4 * 3
            || room < ring / 4
            || (self.cache.mem() > cache && self.cache.dirty_mem() > cache / 4)
            || short;
        if want {
            match &self.inflight {
                None => self.start_checkpoint()?,
                Some(f) => {
                    if self.cache.dirty_mem() + f.bytes > limit
                        || room < ring / 8
                        || self.cache.mem() > cache + cache / 4
                        || short
                    {
                        return Ok(Some(f.done()));
                    }
                }
            }
        }
        self.evict();
        Ok(None)
    }

    pub fn after_read(&mut self) {
        // (A failed checkpoint marks the tree failed: the next call reports it.)
        let _ = self.poll_checkpoint();
        self.evict();
    }

    /// Evicts down to 80% of the budget, least recently used first within each kind:
    /// basements of partial leaves (their index stays), then clean whole leaves, leaf
    /// indexes, and clean internal nodes.
    fn evict(&mut self) {
        if self.cache.mem() <= self.opts.cache_bytes {
            return;
        }
        // Down to 80%, so that the sorts run once per many misses. First the basements
        // of leaves read for queries, then whole clean nodes: not the root, nor a node
        // the checkpoint in flight holds (it stays cached until the checkpoint ends,
        // since the durable table names its old extent, and if the checkpoint finds no
        // room the node is dirty again: `undo_checkpoint`).
        let target = self.opts.cache_bytes / 10 * 8;
        self.cache.drop_basements(target);
        let root = self.root;
        let pinned = self.inflight.as_ref().map(|f| &f.pinned);
        let evicted = self.cache.evict_clean(target, |id| {
            id != root && !pinned.is_some_and(|p| p.contains(&id))
        });
        self.stats.evictions += evicted;
    }

    pub fn stats(&mut self) -> Stats {
        // The height is the root's (read if it is not cached yet).
        let root = self.root;
        let _ = self.ensure(root);
        let mut s = self.stats.clone();
        s.log_blocks_written = self.log.blocks_written;
        s.log_bytes = self.log.bytes;
        s.upsert_failures = self
            .upserts
            .failures
            .load(std::sync::atomic::Ordering::Relaxed);
        let io = self.engine.device().stats();
        s.device_bytes_written = io.bytes_written;
        s.device_bytes_read = io.bytes_read;
        s.device_flushes = io.flushes;
        s.write_amplification = if s.user_bytes > 0 {
            io.bytes_written as f64 / s.user_bytes as f64
        } else {
            0.0
        };
        s.height = self
            .cache
            .get(&self.root)
            .map_or(0, |c| c.node.height() as u64);
        s.nodes_cached = self.cache.len() as u64;
        s.cache_bytes = self.cache.mem() as u64;
        s.cache_internal_bytes = self.cache.internal_mem() as u64;
        s.dirty_bytes = self.cache.dirty_mem() as u64;
        s.shared_nodes = self.refs.len() as u64;
        s
    }

    // ---- checking ----

    /// Walks the whole tree and checks its invariants, the reference counts of shared
    /// nodes (each equals the edges that reach the node), and that every extent in the
    /// table belongs to a node the tree reaches.
    pub fn check(&mut self) -> Result<()> {
        let root = self.root;
        let mut walk = CheckWalk::default();
        walk.edges.insert(root, 1);
        self.check_node(root, None, None, None, &mut walk)?;
        for (&id, &n) in &walk.edges {
            let want = self.refs.count(id);
            if n != want {
                return Err(Error::Corrupt(format!(
                    "check: node {id} is reached by {n} edges, its reference count is {want}"
                )));
            }
        }
        if let Some(id) = self.refs.unreached(|id| walk.edges.contains_key(&id)) {
            return Err(Error::Corrupt(format!(
                "check: node {id} has a reference count but no edge reaches it"
            )));
        }
        if let Some(id) = self.btt.keys().find(|id| !walk.edges.contains_key(id)) {
            return Err(Error::Corrupt(format!(
                "check: node {id} holds an extent but no edge reaches it"
            )));
        }
        // The cache's charges add up.
        self.cache
            .check()
            .map_err(|m| Error::Invalid(format!("check: {m}")))?;
        Ok(())
    }

    fn check_node(
        &mut self,
        id: NodeId,
        lo: Option<Vec<u8>>,
        hi: Option<Vec<u8>>,
        height: Option<u16>,
        walk: &mut CheckWalk,
    ) -> Result<()> {
        // A shared node is checked once per range it is reached with (its places usually
        // give it the same one), and its edges are counted once.
        if !walk.seen.insert((id, lo.clone(), hi.clone())) {
            return Ok(());
        }
        let first_visit = walk.visited.insert(id);
        self.ensure_full(id)?;
        let bad = |why: String| Err(Error::Corrupt(format!("check: node {id}: {why}")));
        let node = self.cache[&id].node.clone();
        let node: &Node = &node;
        if let Some(h) = height {
            if node.height() != h {
                return bad(format!("height {} where {h} was expected", node.height()));
            }
        }
        let within =
            |k: &[u8]| lo.as_deref().is_none_or(|l| k >= l) && hi.as_deref().is_none_or(|h| k < h);
        match node {
            Node::Leaf(l) => {
                let es = l.entries().cloned().unwrap_or_default();
                if (1..es.len()).any(|i| es.key(i - 1) >= es.key(i)) {
                    return bad("entries out of order".into());
                }
                if let Some((k, _)) = es.iter().find(|(k, _)| !within(k)) {
                    return bad(format!("key {k:?} outside its range"));
                }
                if l.bytes > self.geo.node_bytes + self.delta_max() {
                    return bad(format!("{} bytes in a leaf", l.bytes));
                }
            }
            Node::Internal(n) => {
                if n.children.len() > self.geo.fanout
                    || n.children.len() != n.buffers.len()
                    || n.children.len() != n.lifts.len()
                {
                    return bad(format!("{} children", n.children.len()));
                }
                if n.pivots.len() + 1 != n.children.len()
                    || n.pivots.windows(2).any(|w| w[0] >= w[1])
                {
                    return bad("pivots".into());
                }
                if n.pivots.iter().any(|p| !within(p)) {
                    return bad("pivot outside the node's range".into());
                }
                for (i, b) in n.buffers.iter().enumerate() {
                    let (clo, chi) = n.child_range(i);
                    let cw = |k: &[u8]| clo.is_none_or(|l| k >= l) && chi.is_none_or(|h| k < h);
                    for (k, msgs) in b.points.window(b"", None) {
                        let k = k.as_slice();
                        if !cw(k) {
                            return bad(format!("message for {k:?} in the wrong buffer"));
                        }
                        for r in &b.ranges {
                            if r.covers(k) && msgs.iter().any(|(m, _)| *m < r.msn) {
                                return bad(
                                    "a point message older than a range delete covering it".into(),
                                );
                            }
                        }
                    }
                }
                for i in 0..n.children.len() {
                    let (clo, chi) = n.child_range(i);
                    let mut clo = clo.map(<[u8]>::to_vec).or(lo.clone());
                    let mut chi = chi.map(<[u8]>::to_vec).or(hi.clone());
                    if let Some(l) = &n.lifts[i] {
                        // Every key routed to a lifted child starts with its outer prefix.
                        let end = prefix_end(&l.outer);
                        if clo.as_deref().is_none_or(|c| c < l.outer.as_slice())
                            || chi.is_none()
                            || chi.as_deref() > end.as_deref()
                        {
                            return bad(format!("child {i}'s range leaves its lift {l:?}"));
                        }
                        clo = clo.map(|k| l.to_inner(&k).into_owned());
                        chi = chi.map(|k| l.to_inner(&k).into_owned());
                    }
                    if first_visit {
                        *walk.edges.entry(n.children[i]).or_insert(0) += 1;
                    }
                    self.check_node(n.children[i], clo, chi, Some(n.height - 1), walk)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header naming its mirror at the last possible block number is refused, not an
    /// overflow (found by fuzzing).
    #[test]
    fn a_mirror_past_any_device_is_refused() {
        let geo = Geometry {
            block_size: 4096,
            node_bytes: 65536,
            basement_bytes: 4096,
            fanout: 16,
            log_first: HEADER_SLOTS,
            log_blocks: 64,
            mirror: u64::MAX,
        };
        assert!(check_geometry(&geo, 1 << 20).is_err());
        let ok = Geometry {
            mirror: (1 << 20) - 1,
            ..geo
        };
        assert_eq!(check_geometry(&ok, 1 << 20), Ok(()));
    }
}
