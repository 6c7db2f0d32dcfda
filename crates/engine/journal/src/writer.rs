//! The running journal: turns the engine's captured transactions into JBD2 transactions.
//!
//! A commit closes the engine's capture (a new one opens at once), writes a descriptor
//! block for every `descriptor_capacity` captured blocks followed by their contents as of
//! the close (escaped when they begin with the JBD2 magic), revoke blocks for blocks
//! freed in the transaction that the live log may still hold, flushes, writes the commit
//! block and flushes again. Only then is the capture's hold dropped, so no captured change
//! reaches its home block before its transaction is durable in the log.
//!
//! Log space comes back when a transaction is *checkpointed*: normally when the engine's
//! write-back has put every one of its changes in place (its `done` patch is durable);
//! when a commit needs space that is not free, the oldest transactions are checkpointed
//! by writing their committed images in place (`Engine::write_through`), read back from
//! the log: a committed transaction remembers where each block's copy lies, not its
//! contents, so the journal holds no block data beyond the cache's budget (it held a
//! log's worth of images before, which the server's peak memory showed). The journal
//! superblock's tail (`start`, `sequence`) moves, durably, before any freed log block is
//! reused; recovery from an older tail replays a few transactions twice, harmlessly.
//!
//! Commits happen on a timer (default 5 s), when the capture grows past
//! `max_txn_blocks`, and on fsync; concurrent fsyncs share a commit (group commit).
//!
//! **Placement** (`JournalOptions::placement`): `Ring` is JBD2's log (each transaction's
//! descriptor and data blocks written as one request, a flush, the commit block, a
//! flush); `Skip` writes each transaction as one self-identifying record by a range
//! write wherever the device's head gets first in the free part of the area, then one
//! flush (`skip.rs`); `Null` writes nothing and reports success at once (no crash
//! safety: the upper bound a journal could reach, for benchmarks). The journal may live
//! on a device of its own (`Journal::start_on`), as an ext3 external journal.

use crate::format::{
    descriptor_capacity, encode_commit, encode_descriptor, encode_revoke, needs_escape,
    revoke_capacity, JournalSuper, Tag, TxnChecksum, COMPAT_CHECKSUM, INCOMPAT_REVOKE,
    INCOMPAT_WRITABLE,
};
use crate::{JournalError, JournalMap, Result};
use quilt_block::{BlockDevice, BlockNo};
use quilt_block::{BlockDeviceExt, WriteClass};
use quilt_patch::{block_buf, BlockBuf, Engine, PatchId};
use rustc_hash::FxHashMap as HashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct JournalOptions {
    /// Journal file data too (full journaling); otherwise metadata only.
    pub data: bool,
    /// Commit at least this often while changes are pending.
    pub commit_interval: Duration,
    /// Commit once the running transaction holds this many blocks (None: a quarter of
    /// the log or an eighth of the engine's cache, whichever is less).
    pub max_txn_blocks: Option<usize>,
    pub placement: Placement,
    /// Told every transaction as it is committed (for the crash explorer's model of
    /// what recovery must yield).
    pub observer: Option<Observer>,
    /// Retire transactions only by forced checkpoints (their blocks read back from the
    /// log and written home), never because write-back put them home: for tests of
    /// the forced checkpoint, which write-back makes rare.
    pub forced_checkpoints_only: bool,
}

/// Hears each transaction as it commits: its sequence, its blocks' new contents, and
/// the blocks it revokes. Besides, commits leave the marks `journal-write SEQ` (before
/// the first log write) and `journal-durable SEQ` (after the last flush) on the journal
/// device, which a recording device keeps in its history.
#[derive(Clone)]
pub struct Observer(pub Arc<ObserverFn>);

/// What an [`Observer`] calls: sequence, blocks and their contents, revoked blocks.
pub type ObserverFn = dyn Fn(u32, &[(BlockNo, &[u8])], &[BlockNo]) + Send + Sync;

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observer")
    }
}

/// Where commits put their records (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    #[default]
    Ring,
    Skip,
    Null,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Placement, String> {
        match s {
            "ring" => Ok(Placement::Ring),
            "skip" => Ok(Placement::Skip),
            "null" => Ok(Placement::Null),
            _ => Err(format!(
                "journal placement '{s}' is none of ring, skip, null"
            )),
        }
    }
}

/// Candidate starts a skip commit offers the device: one every this many blocks of free
/// space from where the last record ended (at the outer zone of a desktop disk, a 4 KiB
/// block is about 1/300 of a revolution), at most `SKIP_CANDIDATES` (2,048 blocks: the
/// tracks around the head, whatever its angle).
const SKIP_STEP: u32 = 4;
const SKIP_CANDIDATES: usize = 512;

impl Default for JournalOptions {
    fn default() -> Self {
        JournalOptions {
            data: false,
            commit_interval: Duration::from_secs(5),
            max_txn_blocks: None,
            placement: Placement::Ring,
            observer: None,
            forced_checkpoints_only: false,
        }
    }
}

/// Counters for `quiltfs stats`.
#[derive(Debug, Default)]
pub struct JournalStats {
    pub transactions: AtomicU64,
    pub journal_blocks_written: AtomicU64,
    pub commits: AtomicU64,
    pub checkpoints: AtomicU64,
    pub forced_checkpoints: AtomicU64,
    pub revokes: AtomicU64,
    pub log_full_waits: AtomicU64,
    /// Skip commits whose record the device placed elsewhere than the first free start.
    pub skipped_commits: AtomicU64,
}

impl JournalStats {
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("transactions", self.transactions.load(SeqCst)),
            (
                "journal_blocks_written",
                self.journal_blocks_written.load(SeqCst),
            ),
            ("commits", self.commits.load(SeqCst)),
            ("checkpoints", self.checkpoints.load(SeqCst)),
            ("forced_checkpoints", self.forced_checkpoints.load(SeqCst)),
            ("revokes", self.revokes.load(SeqCst)),
            ("log_full_waits", self.log_full_waits.load(SeqCst)),
            ("skipped_commits", self.skipped_commits.load(SeqCst)),
        ]
    }
}

/// A committed transaction whose log space is not yet reclaimed.
struct Live {
    seq: u32,
    start: u32,
    len: u32,
    done: PatchId,
    /// Each block this transaction logged: where its copy lies in the log, and whether
    /// the copy is escaped (its first four bytes were the JBD2 magic, zeroed in the log).
    images: Vec<(BlockNo, u32, bool)>,
    /// Blocks this transaction revoked (freed while the log held a copy).
    revoked: Vec<BlockNo>,
}

struct State {
    sb: JournalSuper,
    sb_raw: Vec<u8>,
    /// Next log block to write.
    head: u32,
    /// Sequence number of the next commit.
    next_seq: u32,
    live: VecDeque<Live>,
    /// Transactions checkpointed since the tail was last written: recovery from the
    /// superblock on the device would still replay them, so their log space and their
    /// blocks' need of revokes last until the next tail write (`write_tail`), which is
    /// put off until space runs short or they fill a quarter of the log (as jbd2 moves
    /// its tail lazily): one superblock write per many commits instead of one each.
    home: VecDeque<Live>,
    /// Log blocks the live and home transactions occupy.
    used: u32,
    /// Skip placement: the end of the last record written, where the journal disk's head
    /// was left; candidates are offered from there on.
    skip_from: u32,
    /// Blocks with a copy in the log recovery may replay (live and home transactions),
    /// and how many transactions hold one.
    logged: HashMap<BlockNo, u32>,
    /// Set by a failed write: the journal refuses further commits.
    failed: Option<String>,
}

struct Inner {
    engine: Engine,
    dev: Arc<dyn BlockDevice>,
    map: JournalMap,
    bs: usize,
    opts: JournalOptions,
    max_txn: usize,
    st: Mutex<State>,
    /// Sequence the running transaction will commit as (for group commit).
    running: AtomicU32,
    /// Last committed sequence.
    committed: AtomicU32,
    stop: (Mutex<bool>, Condvar),
    kicked: AtomicBool,
    stats: JournalStats,
}

/// A journal in use. Cloning shares it.
///
/// In metadata mode the commit first writes back every ready change, file data
/// included, so data reaches its blocks before the metadata naming them commits (ext3's
/// data=ordered); in full mode file data is journaled with the metadata.
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Inner>,
}

impl Journal {
    /// Takes over the journal at `map` (it must be empty: recover first), opens the
    /// engine's capture, and starts the commit timer. The journal superblock is marked
    /// in use before this returns.
    pub fn start(engine: Engine, map: JournalMap, opts: JournalOptions) -> Result<Journal> {
        let dev = engine.device().clone();
        Journal::start_on(engine, dev, map, opts)
    }

    /// As `start`, with the journal on a device of its own (`dev`, which `map` maps into:
    /// an external journal).
    pub fn start_on(
        engine: Engine,
        dev: Arc<dyn BlockDevice>,
        map: JournalMap,
        opts: JournalOptions,
    ) -> Result<Journal> {
        let bs = dev.block_size();
        if bs != engine.block_size() {
            return Err(JournalError::Corrupt(format!(
                "the journal device's block size {bs} differs from the file system's {}",
                engine.block_size()
            )));
        }
        let mut raw = vec![0u8; bs];
        dev.read(map.device_block(0)?, &mut raw)?;
        let mut sb = JournalSuper::decode(&raw, bs as u32, map.len())?;
        sb.check_readable()?;
        if sb.feature_incompat & !INCOMPAT_WRITABLE != 0 {
            return Err(JournalError::Unsupported(format!(
                "journal features {:#x} (quiltfs writes journals without checksums or 64-bit block numbers)",
                sb.feature_incompat
            )));
        }
        if sb.start != 0 {
            return Err(JournalError::Corrupt(
                "the journal holds transactions to replay".into(),
            ));
        }
        let ring = sb.maxlen - sb.first;
        // A quarter of the log, as JBD2; and an eighth of the cache, because the running
        // transaction's blocks stay dirty in the cache, unwritable, until it commits
        // (with a 128 MiB cache and a 128 MiB log, a quarter of the log pinned 32 MiB
        // and the server's peak memory went past the cache by 80 MiB).
        let cache_blocks = engine.options().cache_bytes_max / bs;
        let max_txn = opts
            .max_txn_blocks
            .unwrap_or((ring as usize / 4).min(cache_blocks / 8))
            .clamp(1, ring as usize / 2);
        // The log starts at its first block with the next sequence number; recovery from
        // here finds nothing until the first commit.
        sb.feature_incompat |= INCOMPAT_REVOKE;
        if opts.placement == Placement::Skip {
            // Until a clean shutdown, the area may hold skip records.
            sb.feature_incompat |= crate::skip::INCOMPAT_SKIP;
            sb.skip_nonce = crate::skip::fresh_nonce();
        }
        sb.start = sb.first;
        sb.errno = 0;
        sb.encode_into(&mut raw);
        dev.write(map.device_block(0)?, &raw, WriteClass::Metadata)?;
        dev.flush()?;
        let next_seq = sb.sequence;
        let head = sb.first;
        engine.capture_start(opts.data)?;
        let j = Journal {
            inner: Arc::new(Inner {
                engine,
                dev,
                map,
                bs,
                max_txn,
                st: Mutex::new(State {
                    skip_from: sb.first,
                    sb,
                    sb_raw: raw,
                    head,
                    next_seq,
                    live: VecDeque::new(),
                    home: VecDeque::new(),
                    used: 0,
                    logged: HashMap::default(),
                    failed: None,
                }),
                running: AtomicU32::new(next_seq),
                committed: AtomicU32::new(next_seq.wrapping_sub(1)),
                stop: (Mutex::new(false), Condvar::new()),
                kicked: AtomicBool::new(false),
                stats: JournalStats::default(),
                opts,
            }),
        };
        j.spawn_timer();
        Ok(j)
    }

    pub fn stats(&self) -> &JournalStats {
        &self.inner.stats
    }

    /// Whether file data is journaled.
    pub fn journals_data(&self) -> bool {
        self.inner.opts.data
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Commits the running transaction if it has grown past the size limit (call after
    /// each operation); otherwise does nothing.
    pub fn maybe_commit(&self) -> Result<()> {
        if self.inner.engine.capture_len() >= self.inner.max_txn {
            self.commit()?;
        }
        Ok(())
    }

    /// Makes every change made so far durable: commits the running transaction, unless
    /// a commit that began after this call's changes already did (group commit).
    pub fn commit(&self) -> Result<()> {
        let want = self.inner.running.load(SeqCst);
        let mut st = self.lock();
        let committed = self.inner.committed.load(SeqCst);
        if !crate::format::seq_after(want, committed) {
            return Ok(());
        }
        self.commit_locked(&mut st)
    }

    fn commit_locked(&self, st: &mut State) -> Result<()> {
        if let Some(f) = &st.failed {
            return Err(JournalError::Corrupt(format!("the journal stopped: {f}")));
        }
        let r = self.commit_inner(st);
        if let Err(e) = &r {
            st.failed = Some(e.to_string());
        }
        r
    }

    fn commit_inner(&self, st: &mut State) -> Result<()> {
        let inner = &self.inner;
        // Announce the next transaction before closing this one: a caller whose change
        // lands after the close then waits for that next commit (group commit).
        inner.running.store(st.next_seq.wrapping_add(1), SeqCst);
        let Some(txn) = inner.engine.capture_rotate(true)? else {
            inner.running.store(st.next_seq, SeqCst);
            return Ok(());
        };
        if !inner.opts.data {
            // File data goes home before the commit that makes metadata point to it
            // (ordered mode): after a crash no file shows another file's old blocks.
            inner.engine.write_back_ready()?;
        }
        let own: std::collections::BTreeSet<BlockNo> = txn.blocks.iter().map(|(b, _)| *b).collect();
        let mut revokes: Vec<u32> = txn
            .revoked
            .iter()
            .copied()
            .filter(|b| st.logged.contains_key(b) || own.contains(b))
            .filter_map(|b| u32::try_from(b).ok())
            .collect();
        revokes.sort_unstable();
        if txn.blocks.is_empty() && revokes.is_empty() {
            inner.engine.release_hold(txn.hold);
            // Nothing to log: the sequence number is not used.
            inner.running.store(st.next_seq, SeqCst);
            inner.committed.store(st.next_seq.wrapping_sub(1), SeqCst);
            return Ok(());
        }
        let seq = st.next_seq;
        if let Some(o) = &inner.opts.observer {
            let blocks: Vec<(BlockNo, &[u8])> =
                txn.blocks.iter().map(|(b, d)| (*b, &d[..])).collect();
            let revoked: Vec<BlockNo> = revokes.iter().map(|&b| b as BlockNo).collect();
            (o.0)(seq, &blocks, &revoked);
        }
        match inner.opts.placement {
            Placement::Null => {
                // Success without I/O: the changes go home by write-back alone.
                inner.engine.release_hold(txn.hold);
                st.next_seq = seq.wrapping_add(1);
                inner.committed.store(seq, SeqCst);
                inner.stats.transactions.fetch_add(1, SeqCst);
                inner.stats.commits.fetch_add(1, SeqCst);
                return Ok(());
            }
            Placement::Skip => return self.commit_skip(st, txn, seq, &own, &revokes),
            Placement::Ring => {}
        }
        let dcap = descriptor_capacity(inner.bs, 0);
        let rcap = revoke_capacity(inner.bs);
        let n = txn.blocks.len();
        let need = (n.div_ceil(dcap) + n + revokes.len().div_ceil(rcap) + 1) as u32;
        let ring = st.sb.maxlen - st.sb.first;
        if need + 1 > ring {
            return Err(JournalError::Corrupt(format!(
                "a transaction of {need} blocks does not fit in a log of {ring}"
            )));
        }
        self.make_room(st, need)?;

        // The log records, in order.
        let start = st.head;
        let mut pos = start;
        // Block images are shared with the capture (no copy), except escaped ones.
        let mut writes: Vec<(u32, BlockBuf)> = Vec::with_capacity(need as usize);
        let mut images: Vec<(BlockNo, u32, bool)> = Vec::with_capacity(txn.blocks.len());
        let mut push = |st: &State, data: BlockBuf, pos: &mut u32| {
            writes.push((*pos, data));
            *pos = if *pos + 1 >= st.sb.maxlen {
                st.sb.first
            } else {
                *pos + 1
            };
        };
        for chunk in txn.blocks.chunks(dcap) {
            let tags: Vec<Tag> = chunk
                .iter()
                .map(|(b, d)| Tag {
                    block: *b,
                    escaped: needs_escape(d),
                })
                .collect();
            push(
                st,
                block_buf(encode_descriptor(inner.bs, seq, &st.sb.uuid, &tags)),
                &mut pos,
            );
            for (b, d) in chunk {
                let escaped = needs_escape(d);
                let copy: BlockBuf = if escaped {
                    let mut c = d.to_vec();
                    c[0..4].fill(0);
                    block_buf(c)
                } else {
                    d.clone()
                };
                images.push((*b, pos, escaped));
                push(st, copy, &mut pos);
            }
        }
        let data_records = n.div_ceil(dcap) + n;
        for chunk in revokes.chunks(rcap) {
            push(st, block_buf(encode_revoke(inner.bs, seq, chunk)), &mut pos);
        }
        let commit_pos = pos;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // As one request per run of consecutive device blocks (a disk streams it), as the
        // kernel's jbd2 submits a transaction's log blocks together.
        inner.dev.mark(&format!("journal-write {seq}"));
        let mut i = 0;
        while i < writes.len() {
            let first = inner.map.device_block(writes[i].0)?;
            let mut k = i + 1;
            while k < writes.len() && inner.map.device_block(writes[k].0)? == first + (k - i) as u64
            {
                k += 1;
            }
            if k - i == 1 {
                inner.dev.write(first, &writes[i].1, WriteClass::Metadata)?;
            } else {
                let mut run = Vec::with_capacity((k - i) * inner.bs);
                for (_, d) in &writes[i..k] {
                    run.extend_from_slice(d);
                }
                inner.dev.write_blocks(first, &run, WriteClass::Metadata)?;
            }
            i = k;
        }
        let safe = inner.engine.flushes();
        if safe {
            inner.dev.flush()?;
        }
        // journal_checksum: a CRC of the descriptor and data blocks (revoke blocks are
        // not included, as in the kernel).
        let checksum = (st.sb.feature_compat & COMPAT_CHECKSUM != 0).then(|| {
            let mut c = TxnChecksum::default();
            for (_, data) in writes.iter().take(data_records) {
                c.update(data);
            }
            c.value()
        });
        let commit = encode_commit(inner.bs, seq, now.as_secs(), now.subsec_nanos(), checksum);
        inner.dev.write(
            inner.map.device_block(commit_pos)?,
            &commit,
            WriteClass::Metadata,
        )?;
        if safe {
            inner.dev.flush()?;
        }
        inner.dev.mark(&format!("journal-durable {seq}"));
        // Durable in the log: the changes may go home now.
        inner.engine.release_hold(txn.hold);
        st.head = if commit_pos + 1 >= st.sb.maxlen {
            st.sb.first
        } else {
            commit_pos + 1
        };
        st.next_seq = seq.wrapping_add(1);
        st.used += need;
        for b in &own {
            *st.logged.entry(*b).or_insert(0) += 1;
        }
        st.live.push_back(Live {
            seq,
            start,
            len: need,
            done: txn.done,
            images,
            revoked: revokes.iter().map(|&b| b as BlockNo).collect(),
        });
        inner.committed.store(seq, SeqCst);
        let s = &inner.stats;
        s.transactions.fetch_add(1, SeqCst);
        s.commits.fetch_add(1, SeqCst);
        s.journal_blocks_written.fetch_add(need as u64, SeqCst);
        s.revokes.fetch_add(revokes.len() as u64, SeqCst);
        self.reclaim(st, false)?;
        Ok(())
    }

    /// A skip commit: the transaction as one record, written where the device finds it
    /// cheapest among the free starts of the area, then one flush.
    fn commit_skip(
        &self,
        st: &mut State,
        txn: quilt_patch::CapturedTxn,
        seq: u32,
        own: &std::collections::BTreeSet<BlockNo>,
        revokes: &[u32],
    ) -> Result<()> {
        let inner = &self.inner;
        let revoked: Vec<u64> = revokes.iter().map(|&b| b as u64).collect();
        let len = crate::skip::record_len(inner.bs, txn.blocks.len(), revoked.len()) as u32;
        let ring = st.sb.maxlen - st.sb.first;
        if len + 1 > ring {
            return Err(JournalError::Corrupt(format!(
                "a transaction of {len} blocks does not fit in a journal of {ring}"
            )));
        }
        let cands = self.skip_room(st, len)?;
        let data: Vec<(u64, &[u8])> = txn.blocks.iter().map(|(b, d)| (*b, &d[..])).collect();
        let record = crate::skip::encode(inner.bs, &st.sb, seq, &data, &revoked);
        let dev_cands: Vec<BlockNo> = cands
            .iter()
            .map(|&j| inner.map.device_block(j))
            .collect::<Result<_>>()?;
        inner.dev.mark(&format!("journal-write {seq}"));
        let at = inner
            .dev
            .write_range(&dev_cands, &record, WriteClass::Metadata)?;
        let Some(k) = dev_cands.iter().position(|&c| c == at) else {
            return Err(JournalError::Corrupt(format!(
                "the device placed a record at block {at}, which was no candidate"
            )));
        };
        let start = cands[k];
        st.skip_from = start + len;
        if inner.engine.flushes() {
            inner.dev.flush()?;
        }
        inner.dev.mark(&format!("journal-durable {seq}"));
        inner.engine.release_hold(txn.hold);
        let headers = len as usize - txn.blocks.len() - 1;
        let images: Vec<(BlockNo, u32, bool)> = txn
            .blocks
            .iter()
            .enumerate()
            .map(|(i, (b, d))| {
                (
                    *b,
                    start + (headers + i) as u32,
                    crate::skip::needs_escape(d),
                )
            })
            .collect();
        st.next_seq = seq.wrapping_add(1);
        st.used += len;
        for b in own {
            *st.logged.entry(*b).or_insert(0) += 1;
        }
        st.live.push_back(Live {
            seq,
            start,
            len,
            done: txn.done,
            images,
            revoked,
        });
        inner.committed.store(seq, SeqCst);
        let s = &inner.stats;
        s.transactions.fetch_add(1, SeqCst);
        s.commits.fetch_add(1, SeqCst);
        s.journal_blocks_written.fetch_add(len as u64, SeqCst);
        s.revokes.fetch_add(revokes.len() as u64, SeqCst);
        if start != cands[0] {
            s.skipped_commits.fetch_add(1, SeqCst);
        }
        self.reclaim(st, false)?;
        Ok(())
    }

    /// Candidate starts for a record of `len` blocks (contiguous on the device too),
    /// checkpointing the oldest transactions until there is one.
    fn skip_room(&self, st: &mut State, len: u32) -> Result<Vec<u32>> {
        let mut forced = false;
        loop {
            let mut used: Vec<(u32, u32)> = st
                .live
                .iter()
                .chain(&st.home)
                .map(|t| (t.start, t.len))
                .collect();
            used.sort_unstable();
            let map = &self.inner.map;
            let cands: Vec<u32> = crate::skip::candidates(
                st.sb.first,
                st.sb.maxlen,
                &used,
                st.skip_from,
                len,
                SKIP_STEP,
                SKIP_CANDIDATES,
            )
            .into_iter()
            .filter(|&j| {
                // The record's blocks must follow one another on the device.
                match (map.device_block(j), map.device_block(j + len - 1)) {
                    (Ok(a), Ok(b)) => b == a + (len - 1) as u64 && map.contiguous(j, len),
                    _ => false,
                }
            })
            .collect();
            if !cands.is_empty() {
                return Ok(cands);
            }
            if !st.home.is_empty() {
                self.write_tail(st)?; // frees what checkpoints left
                continue;
            }
            if !forced {
                self.inner.stats.log_full_waits.fetch_add(1, SeqCst);
                self.inner.engine.write_back_ready()?;
                self.reclaim(st, true)?;
                forced = true;
                continue;
            }
            if st.live.is_empty() {
                return Err(JournalError::Corrupt(format!(
                    "the journal area has no {len} consecutive blocks"
                )));
            }
            self.force_oldest(st)?;
        }
    }

    /// Frees log space until `need` blocks (and one spare) are free, checkpointing the
    /// oldest transactions by force if their changes are not home yet.
    fn make_room(&self, st: &mut State, need: u32) -> Result<()> {
        let ring = st.sb.maxlen - st.sb.first;
        if st.used + need < ring {
            return Ok(());
        }
        // First what checkpoints have freed, then what write-back can put in place.
        self.reclaim(st, true)?;
        if st.used + need < ring {
            return Ok(());
        }
        self.inner.stats.log_full_waits.fetch_add(1, SeqCst);
        self.inner.engine.write_back_ready()?;
        self.reclaim(st, true)?;
        while st.used + need >= ring {
            if st.live.is_empty() {
                return Err(JournalError::Corrupt("the log has no room".into()));
            }
            self.force_oldest(st)?;
        }
        Ok(())
    }

    /// Checkpoints the oldest live transaction by putting its blocks home: for each, what
    /// replaying the whole live log would leave there. Not the transaction's own image:
    /// write-back may already have put a newer committed version home, and writing the
    /// older one would take the block back in time for good. A block a live transaction
    /// revoked is not written at all (it was freed, and may hold unjournaled data now).
    fn force_oldest(&self, st: &mut State) -> Result<()> {
        let Some(t) = st.live.front() else {
            return Ok(());
        };
        let mut latest: HashMap<BlockNo, Option<(u32, bool)>> =
            t.images.iter().map(|(b, _, _)| (*b, None)).collect();
        for l in &st.live {
            for (b, at, escaped) in &l.images {
                if let Some(slot) = latest.get_mut(b) {
                    *slot = Some((*at, *escaped));
                }
            }
            for b in &l.revoked {
                if let Some(slot) = latest.get_mut(b) {
                    *slot = None;
                }
            }
        }
        let mut copies: Vec<(BlockNo, u32, bool)> = latest
            .into_iter()
            .filter_map(|(b, c)| c.map(|(at, esc)| (b, at, esc)))
            .collect();
        copies.sort_unstable_by_key(|(b, _, _)| *b);
        // The copies are in the log, from which no live transaction's space is reused.
        // They are read first, each run of consecutive log blocks as one request (a
        // disk's head then streams a whole record instead of coming round for each
        // block), at most a transaction's worth of blocks in memory.
        let homes: Vec<BlockNo> = copies.iter().map(|&(b, _, _)| b).collect();
        let inner = &self.inner;
        let mut positions: Vec<u32> = copies.iter().map(|&(_, at, _)| at).collect();
        positions.sort_unstable();
        positions.dedup();
        let mut images: HashMap<u32, Vec<u8>> = HashMap::default();
        let mut i = 0;
        while i < positions.len() {
            let first = inner.map.device_block(positions[i])?;
            let mut k = i + 1;
            while k < positions.len()
                && positions[k] == positions[k - 1] + 1
                && inner.map.device_block(positions[k])? == first + (k - i) as u64
            {
                k += 1;
            }
            let mut run = vec![0u8; (k - i) * inner.bs];
            inner.dev.read_blocks(first, &mut run)?;
            for (j, b) in run.chunks(inner.bs).enumerate() {
                images.insert(positions[i + j], b.to_vec());
            }
            i = k;
        }
        let mut next = copies.iter();
        inner.engine.write_through(&homes, |_, buf| {
            let &(_, at, escaped) = next.next().expect("one copy per block");
            let image = images.get(&at).ok_or(quilt_patch::PatchError::Block(
                quilt_block::BlockError::Unsupported("a log copy that was not read"),
            ))?;
            buf.copy_from_slice(image);
            if escaped {
                let magic = match inner.opts.placement {
                    Placement::Skip => crate::skip::MAGIC.to_le_bytes(),
                    _ => crate::format::MAGIC.to_be_bytes(),
                };
                buf[0..4].copy_from_slice(&magic);
            }
            Ok(())
        })?;
        self.inner.stats.forced_checkpoints.fetch_add(1, SeqCst);
        self.pop_oldest(st);
        self.write_tail(st)
    }

    /// The oldest live transaction is home: it waits for the next tail write.
    fn pop_oldest(&self, st: &mut State) {
        if let Some(t) = st.live.pop_front() {
            st.home.push_back(t);
            self.inner.stats.checkpoints.fetch_add(1, SeqCst);
        }
    }

    /// After a tail write: the space and copies of the transactions it put behind the
    /// tail are free.
    fn release_home(st: &mut State) {
        for t in std::mem::take(&mut st.home) {
            st.used -= t.len;
            for (b, _, _) in &t.images {
                if let Some(c) = st.logged.get_mut(b) {
                    *c -= 1;
                    if *c == 0 {
                        st.logged.remove(b);
                    }
                }
            }
        }
    }

    /// Moves the oldest transactions whose changes are all home behind the tail, and
    /// writes the tail durably when `always` or when they fill a quarter of the log.
    fn reclaim(&self, st: &mut State, always: bool) -> Result<()> {
        while let Some(t) = st.live.front() {
            if self.inner.opts.forced_checkpoints_only || !self.inner.engine.is_durable(t.done) {
                break;
            }
            self.pop_oldest(st);
        }
        let waiting: u32 = st.home.iter().map(|t| t.len).sum();
        if always || waiting >= (st.sb.maxlen - st.sb.first) / 4 {
            self.write_tail(st)?;
        }
        Ok(())
    }

    /// Writes the journal superblock with the current tail, and flushes: recovery starts
    /// at the oldest live transaction (or at the head, which holds nothing yet).
    fn write_tail(&self, st: &mut State) -> Result<()> {
        let (start, seq) = match (self.inner.opts.placement, st.live.front()) {
            // Skip records are found by a scan: `start` only says there may be some.
            (Placement::Skip, Some(t)) => (st.sb.first, t.seq),
            (Placement::Skip, None) => (st.sb.first, st.next_seq),
            (_, Some(t)) => (t.start, t.seq),
            (_, None) => (st.head, st.next_seq),
        };
        st.sb.start = start;
        st.sb.sequence = seq;
        let mut raw = std::mem::take(&mut st.sb_raw);
        st.sb.encode_into(&mut raw);
        let r = self
            .inner
            .dev
            .write(self.inner.map.device_block(0)?, &raw, WriteClass::Metadata)
            .and_then(|()| self.inner.dev.flush());
        st.sb_raw = raw;
        r?;
        Self::release_home(st);
        Ok(())
    }

    /// Ends journaling: commits what is pending, closes the capture, puts everything
    /// home and marks the journal empty (`start = 0`), as a clean unmount leaves it.
    pub fn shutdown(&self) -> Result<()> {
        self.stop_timer();
        let mut st = self.lock();
        self.commit_locked(&mut st)?;
        // The caller has stopped making changes, so the capture closed here is empty.
        if let Some(txn) = self.inner.engine.capture_rotate(false)? {
            if !txn.blocks.is_empty() {
                tracing::warn!(
                    "{} blocks changed during journal shutdown go home unjournaled",
                    txn.blocks.len()
                );
            }
            self.inner.engine.release_hold(txn.hold);
        }
        self.inner.engine.sync()?;
        while !st.live.is_empty() {
            let before = st.live.len();
            self.reclaim(&mut st, false)?;
            if st.live.len() == before {
                self.force_oldest(&mut st)?;
            }
        }
        st.sb.start = 0;
        st.sb.sequence = st.next_seq;
        // Empty: a plain JBD2 journal again (the kernel may use a cleanly unmounted image).
        st.sb.feature_incompat &= !crate::skip::INCOMPAT_SKIP;
        let mut raw = std::mem::take(&mut st.sb_raw);
        st.sb.encode_into(&mut raw);
        self.inner
            .dev
            .write(self.inner.map.device_block(0)?, &raw, WriteClass::Metadata)?;
        self.inner.dev.flush()?;
        st.sb_raw = raw;
        Self::release_home(&mut st);
        Ok(())
    }

    fn spawn_timer(&self) {
        let weak = Arc::downgrade(&self.inner);
        let interval = self.inner.opts.commit_interval;
        std::thread::Builder::new()
            .name("quilt-journal".into())
            .spawn(move || loop {
                let Some(inner) = weak.upgrade() else { return };
                {
                    let (lock, cv) = &inner.stop;
                    let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let (stopped, _) = cv
                        .wait_timeout_while(stopped, interval, |s| {
                            !*s && !inner.kicked.load(SeqCst)
                        })
                        .unwrap_or_else(|e| e.into_inner());
                    if *stopped {
                        return;
                    }
                    inner.kicked.store(false, SeqCst);
                }
                let j = Journal { inner };
                if j.inner.engine.capture_len() > 0 {
                    if let Err(e) = j.commit() {
                        tracing::error!("journal commit failed: {e}");
                    }
                } else {
                    let mut st = j.lock();
                    if let Err(e) = j.reclaim(&mut st, false) {
                        tracing::error!("journal checkpoint failed: {e}");
                    }
                }
            })
            .expect("spawning the journal thread");
    }

    fn stop_timer(&self) {
        let (lock, cv) = &self.inner.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.stop.1.notify_all();
    }
}

impl From<JournalError> for quilt_patch::PatchError {
    fn from(e: JournalError) -> Self {
        match e {
            JournalError::Patch(p) => p,
            JournalError::Block(b) => quilt_patch::PatchError::Block(b),
            e @ (JournalError::Corrupt(_) | JournalError::Unsupported(_)) => {
                quilt_patch::PatchError::Damaged(e.to_string())
            }
        }
    }
}

/// The journal as the patch layer's transaction service: file-system modules reach it
/// only through `quilt_patch::Services`.
impl quilt_patch::Transactions for Journal {
    fn op_end(&self) -> quilt_patch::Result<()> {
        Ok(self.maybe_commit()?)
    }
    fn commit(&self) -> quilt_patch::Result<()> {
        Ok(Journal::commit(self)?)
    }
    fn shutdown(&self) -> quilt_patch::Result<()> {
        Ok(Journal::shutdown(self)?)
    }
    fn abort(&self, why: String) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(format!("aborted: {why}"));
        }
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.stats().fields()
    }
    fn kind(&self) -> &'static str {
        "journal"
    }
    fn device_counters(&self) -> Vec<(String, u64)> {
        if Arc::ptr_eq(&self.inner.dev, self.inner.engine.device()) {
            return Vec::new(); // the engine's device: reported as such
        }
        let mut v: Vec<(String, u64)> = self
            .inner
            .dev
            .stats()
            .fields()
            .into_iter()
            .map(|(k, val)| (k.to_string(), val))
            .collect();
        v.extend(self.inner.dev.extra_stats());
        v
    }
}
