//! One replica's state, on its two devices: the replicated table (and client
//! sessions), the data it stages before a write commits, its home blocks and reserve,
//! and its snapshots. [`Machine`] hands this to openraft as the state machine; the
//! server (`node.rs`) uses it for the data path.
//!
//! Invariants kept here:
//! - a block's data reaches home (or the reserve) only when the write naming it is
//!   applied, and only if it matches the checksums the write committed;
//! - a staged record leaves the data log only after its data is durable at home, so a
//!   crash at any point finds either the record or the home copy;
//! - a snapshot is written only after every applied write's data is durable, so the
//!   table it holds never names a copy this replica does not have.

use crate::datalog::{DataLog, DataLogError};
use crate::geometry::{Geometry, ReplicaId};
use crate::layout::{Label, LayoutError};
use crate::meta::{
    Entry, LogId, Meta, Outcome, Proposal, Sessions, SnapshotMeta, StorageError, StoredMembership,
    ABANDONED,
};
use crate::raftlog::{RaftLog, RaftLogError};
use crate::store::{DataStore, Reserved, StoreError};
use crate::table::{
    BlockMeta, Command, CommandError, Holders, MetaTable, Stored, Version, WriteId,
};
use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine, Snapshot};
use openraft::{EntryPayload, RaftLogId, StorageIOError};
use quilt_block::BlockDevice;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Cursor;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A write-back under way: see [`Local::write_back_begin`].
pub struct WriteBack {
    applied: Version,
    /// The data log may let go of records before this lsn once the batch is durable:
    /// those placed when it began. A record staged then, or appended since, may be
    /// placed while the batch is written out, into the buffer, not the batch.
    trim_below: u64,
    pub batch: crate::store::Batch,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaError {
    #[error("log device: {0}")]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    RaftLog(#[from] RaftLogError),
    #[error("data log: {0}")]
    DataLog(#[from] DataLogError),
    #[error("data device: {0}")]
    Store(#[from] StoreError),
    #[error("the snapshot on the log device does not decode: {0}")]
    Snapshot(String),
    #[error("the devices are labelled for replica {label}, not {asked}")]
    WrongReplica { label: ReplicaId, asked: ReplicaId },
    #[error("block {block} is outside the volume ({blocks} blocks)")]
    OutOfRange { block: u64, blocks: u64 },
    #[error("data of {len} bytes is not a whole number of {block_size}-byte blocks")]
    Unaligned { len: usize, block_size: usize },
    #[error("the data log's sync failed: {0}")]
    Sync(String),
    #[error("the reserve has {free} free slots, {pending} promised to staged copies; {want} more do not fit")]
    ReserveFull { want: u64, pending: u64, free: u64 },
    #[error("the data log is out of room ({need} blocks wanted twice, {used} of {ring} used by writes not yet applied); try again")]
    DataLogFull { need: u64, used: u64, ring: u64 },
}

/// What a replica keeps in a snapshot: the replicated state as of `last_applied`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotBody {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    table: MetaTable,
    sessions: Sessions,
}

/// A block as one replica can answer for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalRead {
    /// The data at the table's version (checksum verified).
    Data(Vec<u8>),
    /// Never written: zeros.
    Zero,
    /// Not here at the current version; these replicas hold it.
    NotHere(Holders),
}

struct StagedData {
    lsn: u64,
    first: u64,
    data: Vec<u8>,
    /// When it was staged (or found in the data log at open).
    since: Instant,
}

/// A staged write not applied after this long may be abandoned when the data log is
/// out of room: a client's proposal normally commits within milliseconds of its store.
const ABANDON_AFTER: Duration = Duration::from_secs(1);
/// Writes abandoned by one log entry, at most.
const ABANDON_AT_ONCE: usize = 256;

pub struct Local {
    /// This replica's slot in the placement.
    pub id: ReplicaId,
    /// Its identity in agreement (`Label::node_id`): a server that replaces another in
    /// the same slot is a new member.
    pub node: u64,
    label: Label,
    log_dev: Arc<dyn BlockDevice>,
    table: MetaTable,
    sessions: Sessions,
    store: DataStore,
    datalog: DataLog,
    staged: HashMap<WriteId, StagedData>,
    /// Staged records by lsn, for trimming in order.
    staged_lsns: BTreeMap<u64, WriteId>,
    /// Staged writes to be abandoned through the log (`make_room`), and when that
    /// was last asked.
    abandoning: BTreeSet<WriteId>,
    abandon_asked: Instant,
    last_applied: Option<LogId>,
    membership: StoredMembership,
    snapshot: Option<(SnapshotMeta, Vec<u8>)>,
    snapshot_seq: u64,
    /// Blocks the table says this replica holds, whose data it found missing or
    /// damaged, at the version found so: reads go elsewhere, and the server reports
    /// them lost (at that version only: a replay that finds an older version missing
    /// must not take away a newer one it holds).
    lost: BTreeMap<u64, Version>,
    /// Home or reserve writes since the last flush.
    unflushed: bool,
    /// Blocks placed from copies stored too late to be named, not yet reported.
    late: Vec<(u64, Version)>,
    /// Held blocks whose data failed its checksum, since start.
    checksum_failures: u64,
    /// Write-backs of placed data that failed (a full or failing data device); the
    /// data stays in the data log and the write-back is tried again.
    write_back_failures: u64,
    /// Every entry up to this index has its data durable where this replica keeps
    /// it (kept as the data log's mark, written whenever the log drops a record: no
    /// record goes before the entries it served are covered).
    placed: Version,
}

fn block_crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

impl Local {
    /// Labels `log_dev` for `label.replica` and makes empty rings on it.
    pub fn format(log_dev: &Arc<dyn BlockDevice>, label: &Label) -> Result<(), ReplicaError> {
        label.write(log_dev.as_ref())?;
        let (f, n) = label.raft_region();
        RaftLog::format(log_dev.clone(), f, n)?;
        let (f, n) = label.data_region();
        DataLog::format(log_dev.clone(), f, n)?;
        Ok(())
    }

    /// Opens replica `id`'s devices as the last run left them.
    pub fn open(
        id: ReplicaId,
        log_dev: Arc<dyn BlockDevice>,
        data_dev: Arc<dyn BlockDevice>,
    ) -> Result<(Local, RaftLog), ReplicaError> {
        let label = Label::read(log_dev.as_ref())?;
        if label.replica != id {
            return Err(ReplicaError::WrongReplica {
                label: label.replica,
                asked: id,
            });
        }
        let (f, n) = label.raft_region();
        let raft_log = RaftLog::open(log_dev.clone(), f, n)?;
        let (f, n) = label.data_region();
        let (datalog, records) = DataLog::open(log_dev.clone(), f, n)?;
        let store = DataStore::open(label.geometry, id, data_dev, label.reserve_slots)?;
        let mut local = Local {
            id,
            node: label.node_id(),
            table: MetaTable::new(label.geometry),
            sessions: Sessions::default(),
            store,
            datalog,
            staged: HashMap::new(),
            staged_lsns: BTreeMap::new(),
            abandoning: BTreeSet::new(),
            abandon_asked: Instant::now()
                .checked_sub(ABANDON_AFTER)
                .unwrap_or_else(Instant::now),
            last_applied: None,
            membership: StoredMembership::default(),
            snapshot: None,
            snapshot_seq: 0,
            lost: BTreeMap::new(),
            unflushed: false,
            late: Vec::new(),
            checksum_failures: 0,
            write_back_failures: 0,
            placed: 0,
            label,
            log_dev,
        };
        local.placed = local.datalog.mark();
        for r in records {
            local.staged_lsns.insert(r.lsn, r.write);
            local.staged.insert(
                r.write,
                StagedData {
                    lsn: r.lsn,
                    first: r.first,
                    data: r.data,
                    since: Instant::now(),
                },
            );
        }
        if let Some((seq, bytes)) = local.label.read_snapshot(local.log_dev.as_ref())? {
            let body = decode_snapshot(&bytes, &local.label.geometry)?;
            local.snapshot_seq = seq;
            let meta = SnapshotMeta {
                last_log_id: body.last_applied,
                last_membership: body.membership.clone(),
                snapshot_id: format!("{id}-{seq}"),
            };
            local.set_state(body);
            local.snapshot = Some((meta, bytes));
            local.place_covered_staged();
        }
        Ok((local, raft_log))
    }

    fn set_state(&mut self, body: SnapshotBody) {
        self.table = body.table;
        self.sessions = body.sessions;
        self.membership = body.membership;
        self.last_applied = body.last_applied;
    }

    pub fn geometry(&self) -> &Geometry {
        self.table.geometry()
    }

    /// The membership applied: its log index is the epoch a fenced command is checked
    /// against (0 before the first).
    pub fn epoch(&self) -> u64 {
        self.membership.log_id().map_or(0, |l| l.index)
    }

    /// The log index of the membership applied, `None` before the first (whose index
    /// may be 0 too: `epoch` does not tell them apart).
    pub fn membership_index(&self) -> Option<u64> {
        self.membership.log_id().map(|l| l.index)
    }

    /// Each slot's server (agreement id) and address in the membership applied; in a
    /// joint membership, the newest configuration's. Empty before the first.
    pub fn slots(&self) -> Vec<Option<(u64, String)>> {
        slots_of(self.geometry(), &self.membership)
    }

    /// The server that holds slot `r` now (before the first membership: the volume's
    /// first server of the slot, whose id is the slot).
    pub fn node_of(&self, r: ReplicaId) -> u64 {
        match self.slots().get(usize::from(r)) {
            Some(Some((node, _))) => *node,
            _ => u64::from(r),
        }
    }

    /// Whether this server is its slot's in the membership applied (a server replaced
    /// by another keeps running until stopped, and must not report copies or repair).
    /// Before any membership is applied, only a volume's first servers are.
    pub fn is_member(&self) -> bool {
        match self.slots().get(usize::from(self.id)) {
            Some(Some((node, _))) => *node == self.node,
            Some(None) => false,
            None => self.node == u64::from(self.id),
        }
    }

    /// A new membership at `index`: every slot whose server changed holds nothing any
    /// more (its new server starts empty; Phase 2 rebuilds it), as if `Lost { slot,
    /// None }` were applied, on every replica alike.
    fn apply_membership(&mut self, index: Version, m: StoredMembership) {
        let before = self.slots();
        let after = slots_of(self.geometry(), &m);
        self.membership = m;
        if before.is_empty() {
            return;
        }
        for (slot, (b, a)) in before.iter().zip(after.iter()).enumerate() {
            let (b, a) = (b.as_ref().map(|x| x.0), a.as_ref().map(|x| x.0));
            if b == a || a.is_none() {
                continue;
            }
            let slot = slot as ReplicaId;
            tracing::info!(replica = self.id, slot, from = ?b, to = ?a, index, "a slot changed servers");
            let lost = Command::Lost {
                replica: slot,
                blocks: None,
            };
            if let Err(e) = self.table.apply(index, &lost) {
                tracing::warn!(replica = self.id, slot, error = %e, "dropping a replaced server's copies");
            }
            if slot == self.id && a == Some(self.node) {
                self.lost.clear();
            }
        }
    }

    pub fn table(&self) -> &MetaTable {
        &self.table
    }

    pub fn volume(&self) -> &str {
        &self.label.volume
    }

    pub fn last_applied(&self) -> Option<LogId> {
        self.last_applied
    }

    pub fn lost(&self) -> &BTreeMap<u64, Version> {
        &self.lost
    }

    /// Blocks of this replica's preferred slices it does not hold at the table's
    /// version: Phase 2's work.
    pub fn incomplete(&self) -> usize {
        self.table.incomplete(self.id).count() + self.lost.len()
    }

    pub fn checksum_failures(&self) -> u64 {
        self.checksum_failures
    }

    pub fn write_back_failures(&self) -> u64 {
        self.write_back_failures
    }

    pub fn reserve_used(&self) -> u64 {
        self.store.reserve_used()
    }

    pub fn log_io(&self) -> quilt_block::IoStats {
        self.log_dev.stats()
    }

    pub fn data_io(&self) -> quilt_block::IoStats {
        self.store.io()
    }

    pub fn data_log_usage(&self) -> (u64, u64) {
        (self.datalog.used(), self.datalog.ring_blocks())
    }

    /// Makes `data` (whole blocks from `first`) durable in the data log under `write`,
    /// before this replica answers `Stored`.
    pub fn stage(&mut self, write: WriteId, first: u64, data: Vec<u8>) -> Result<(), ReplicaError> {
        let (mut out, appended) = self.append_staged(vec![(write, first, data)]);
        if appended {
            self.datalog.sync()?;
        }
        out.pop().unwrap_or(Ok(()))
    }

    /// Appends several writes' data to the data log, not yet synced: the caller syncs
    /// the log device ([`Local::log_device`]) once for them all (group commit), outside
    /// this replica's lock, and answers none `Stored` before that sync. They are
    /// staged at once: no proposal names a replica before it answered `Stored`, so
    /// nothing applies them before the sync, and a settle never trims them. Returns
    /// each write's answer, and whether anything was appended (needs the sync).
    pub fn append_staged(
        &mut self,
        writes: Vec<(WriteId, u64, Vec<u8>)>,
    ) -> (Vec<Result<(), ReplicaError>>, bool) {
        let mut out = Vec::with_capacity(writes.len());
        let mut appended = Vec::new();
        for (write, first, data) in writes {
            let r = self.check_range(first, data.len()).and_then(|()| {
                if self.staged.contains_key(&write) {
                    // A retried send of the same write: durable already, or with this
                    // batch's sync (or an earlier batch's, still under way: the retry
                    // is answered after this batch's sync, which covers it too).
                    return Ok(());
                }
                self.reserve_room(first, &data)?;
                self.make_room(&data)?;
                let lsn = self.datalog.append(write, first, &data)?;
                appended.push(write);
                self.staged_lsns.insert(lsn, write);
                self.staged.insert(
                    write,
                    StagedData {
                        lsn,
                        first,
                        data,
                        since: Instant::now(),
                    },
                );
                Ok(())
            });
            out.push(r);
        }
        (out, !appended.is_empty())
    }

    /// The log device, for syncing staged data outside the lock.
    pub fn log_device(&self) -> Arc<dyn BlockDevice> {
        self.log_dev.clone()
    }

    /// A write to a slice this replica does not prefer is a reserve copy: refused now
    /// unless the reserve has a slot for each of its blocks beyond those the staged
    /// reserve copies will take. Accepted and then found no slot when applied, the
    /// acknowledged write would have had one copy fewer than promised.
    fn reserve_room(&self, first: u64, data: &[u8]) -> Result<(), ReplicaError> {
        let g = *self.geometry();
        let bs = g.block_size as usize;
        let reserve_bound = |first: u64| !g.prefers(self.id, g.slice_of(first));
        if !reserve_bound(first) {
            return Ok(());
        }
        let pending: u64 = self
            .staged
            .values()
            .filter(|st| reserve_bound(st.first))
            .map(|st| (st.data.len() / bs) as u64)
            .sum();
        let want = (data.len() / bs) as u64;
        let free = self.store.reserve_slots_free();
        if pending + want > free {
            return Err(ReplicaError::ReserveFull {
                want,
                pending,
                free,
            });
        }
        Ok(())
    }

    /// Room in the data log for `data`: what a settle frees (records of placed writes),
    /// else a refusal, and the oldest staged records put up for abandonment.
    fn make_room(&mut self, data: &[u8]) -> Result<(), ReplicaError> {
        let bs = self.geometry().block_size as usize;
        let need = (data.len() / bs) as u64 + 1;
        let ring = self.datalog.ring_blocks();
        // Twice the record, for a wrap's waste. Records of placed writes go first
        // (a settle makes their copies durable and trims them).
        if self.datalog.used() + 2 * need > ring {
            self.settle()?;
        }
        if self.datalog.used() + 2 * need <= ring {
            return Ok(());
        }
        // The rest is staged writes not applied yet, each of which may be about to
        // commit naming this replica: dropping one here lost acknowledged writes (on
        // every preferred replica alike, when their logs were full alike). This write
        // is refused instead (its client stands in a reserve, or tries again), and
        // the records staged longest are put to the log to be abandoned: once that
        // entry applies, none of them can commit any more, and they go.
        let now = Instant::now();
        let due: Vec<WriteId> = self
            .staged_lsns
            .values()
            .filter(|w| {
                self.staged
                    .get(w)
                    .is_some_and(|st| now.duration_since(st.since) >= ABANDON_AFTER)
            })
            .take(ABANDON_AT_ONCE)
            .copied()
            .collect();
        self.abandoning.extend(due);
        Err(ReplicaError::DataLogFull {
            need,
            used: self.datalog.used(),
            ring,
        })
    }

    /// Staged writes to put to the log as abandoned (see `make_room`), each asked once
    /// until applied; a proposal lost with a leader is asked again after a while.
    pub fn take_abandoning(&mut self) -> Vec<WriteId> {
        let now = Instant::now();
        if now.duration_since(self.abandon_asked) < ABANDON_AFTER {
            return Vec::new();
        }
        let writes: Vec<WriteId> = self
            .abandoning
            .iter()
            .filter(|w| self.staged.contains_key(w))
            .copied()
            .collect();
        self.abandoning.retain(|w| writes.contains(w));
        if !writes.is_empty() {
            self.abandon_asked = now;
        }
        writes
    }

    fn check_range(&self, first: u64, len: usize) -> Result<(), ReplicaError> {
        let g = self.geometry();
        let bs = g.block_size as usize;
        if len == 0 || len % bs != 0 {
            return Err(ReplicaError::Unaligned {
                len,
                block_size: bs,
            });
        }
        let end = first.saturating_add((len / bs) as u64);
        if end > g.blocks {
            return Err(ReplicaError::OutOfRange {
                block: end - 1,
                blocks: g.blocks,
            });
        }
        Ok(())
    }

    /// Applies one committed proposal at `index`.
    pub fn apply(&mut self, index: Version, p: &Proposal) -> Outcome {
        let (command, fence) = p.command.unfenced();
        if let Some(s) = &p.session {
            if let Some(v) = self.sessions.applied(s) {
                self.drop_staged_of(command);
                if v == ABANDONED {
                    self.table.note_applied(index);
                    return Outcome::Refused(CommandError::Abandoned);
                }
                return Outcome::Duplicate(v);
            }
            if self.sessions.forgotten(s) {
                self.drop_staged_of(command);
                return Outcome::Duplicate(0);
            }
        }
        tracing::debug!(replica = self.id, index, command = ?p.command, "apply");
        let current = self.epoch();
        let applied = match fence {
            // Refused alike everywhere: the membership is part of the log.
            Some(epoch) if epoch < current => {
                // The staged data stays: the client sends the same write again, routed
                // anew, and its second store may already have been answered from this
                // very record (a retry of one write id is staged once). Dropping it
                // here lost acknowledged writes (the simulation found it); a write
                // never named again is trimmed when the data log needs the room.
                self.table.note_applied(index);
                return Outcome::Refused(CommandError::StaleMembership { epoch, current });
            }
            _ => match self.table.apply(index, command) {
                Ok(a) => a,
                Err(e) => return Outcome::Refused(e),
            },
        };
        if let Some(s) = &p.session {
            self.sessions.record(s, index);
        }
        // (Before the replay check below: a replayed abandonment still refuses the
        // writes it names.)
        if let Command::Abandon { writes } = command {
            for &w in writes {
                self.sessions.abandon(w);
                self.staged_remove(&w);
                self.abandoning.remove(&w);
            }
        }
        if index <= self.placed {
            // Replayed after a restart or a snapshot: this entry's data was placed and
            // made durable before (the data log's mark says so), and the disks may be
            // ahead of it. Placing again could put older data over newer.
            self.drop_staged_of(command);
            return Outcome::Applied(index);
        }
        for (block, version, holders) in applied.reserve_freed {
            if holders.contains(self.id) {
                if let Err(e) = self.store.reserve_free_upto(block, version) {
                    tracing::warn!(replica = self.id, block, error = %e, "freeing a reserve slot failed");
                }
                self.unflushed = true;
            }
        }
        match command {
            Command::Write {
                write,
                first,
                checksums,
                stored,
            } => {
                let mine = stored.iter().find(|s| s.replica() == self.id).copied();
                match mine {
                    Some(s) => self.place(index, *write, *first, checksums, s),
                    None => self.place_late(index, *write, *first, checksums),
                }
            }
            Command::Lost { replica, blocks } if *replica == self.id => match blocks {
                Some(bs) => bs.iter().for_each(|(b, v)| {
                    if self.lost.get(b) == Some(v) {
                        self.lost.remove(b);
                    }
                }),
                None => self.lost.clear(),
            },
            Command::Repaired { .. }
            | Command::Reclaim { .. }
            | Command::Lost { .. }
            | Command::Fenced { .. }
            | Command::Abandon { .. } => {}
        }
        Outcome::Applied(index)
    }

    /// A write that does not name this replica: its blocks are INCOMPLETE here if
    /// preferred. But the data may have arrived after the client stopped waiting (G′'s
    /// slowest copy, a slow preferred replica): if it is staged and matches, it goes
    /// home now, as this entry's placement (a replay does the same), and the blocks
    /// wait in `late` to be reported `Repaired` once durable, sparing a Phase 2 fetch.
    fn place_late(&mut self, index: Version, write: WriteId, first: u64, checksums: &[u32]) {
        let g = *self.geometry();
        let bs = g.block_size as usize;
        let staged = self.staged.remove(&write);
        if let Some(st) = &staged {
            self.staged_lsns.remove(&st.lsn);
        }
        for (i, &checksum) in checksums.iter().enumerate() {
            let block = first + i as u64;
            self.lost.remove(&block);
            if !g.prefers(self.id, g.slice_of(block)) {
                continue;
            }
            let data = staged
                .as_ref()
                .filter(|st| st.first == first)
                .and_then(|st| st.data.get(i * bs..(i + 1) * bs))
                .filter(|d| block_crc(d) == checksum);
            if let Some(d) = data {
                match self.store.write_home(block, d) {
                    Ok(()) => {
                        self.unflushed = true;
                        self.late.push((block, index));
                    }
                    Err(e) => {
                        tracing::warn!(replica = self.id, block, error = %e, "placing a late copy failed")
                    }
                }
            }
        }
    }

    /// Blocks placed from late copies, made durable: to report `Repaired`.
    pub fn take_late(&mut self) -> Result<Vec<(u64, Version)>, ReplicaError> {
        if self.late.is_empty() {
            return Ok(Vec::new());
        }
        self.settle()?;
        Ok(std::mem::take(&mut self.late))
    }

    fn drop_staged_of(&mut self, c: &Command) {
        if let (Command::Write { write, .. }, _) = c.unfenced() {
            self.staged_remove(write);
        }
    }

    fn staged_remove(&mut self, write: &WriteId) {
        if let Some(s) = self.staged.remove(write) {
            self.staged_lsns.remove(&s.lsn);
        }
    }

    /// Puts a committed write's data where this replica keeps it.
    fn place(&mut self, index: Version, write: WriteId, first: u64, checksums: &[u32], s: Stored) {
        let bs = self.geometry().block_size as usize;
        let staged = self.staged.remove(&write);
        if let Some(st) = &staged {
            self.staged_lsns.remove(&st.lsn);
        }
        // The usual case, all of it staged and intact, goes home in one request per run,
        // or into the reserve with one flush.
        if let Some(st) = &staged {
            let whole = st.first == first
                && st.data.len() == checksums.len() * bs
                && st
                    .data
                    .chunks(bs)
                    .zip(checksums)
                    .all(|(d, &c)| block_crc(d) == c);
            let placed = whole
                && match s {
                    Stored::Home(_) => self.store.write_home_run(first, &st.data).is_ok(),
                    Stored::Reserve(_) => {
                        let items: Vec<(Reserved, &[u8])> = st
                            .data
                            .chunks(bs)
                            .zip(checksums)
                            .enumerate()
                            .map(|(i, (d, &checksum))| {
                                let block = first + i as u64;
                                (
                                    Reserved {
                                        block,
                                        version: index,
                                        checksum,
                                    },
                                    d,
                                )
                            })
                            .collect();
                        self.store.reserve_put_many(&items).is_ok()
                    }
                };
            if placed {
                for b in first..first + checksums.len() as u64 {
                    self.lost.remove(&b);
                }
                self.unflushed = true;
                return;
            }
        }
        for (i, &checksum) in checksums.iter().enumerate() {
            let block = first + i as u64;
            let data = staged
                .as_ref()
                .filter(|st| st.first == first)
                .and_then(|st| st.data.get(i * bs..(i + 1) * bs))
                .filter(|d| block_crc(d) == checksum);
            let res = match (data, s) {
                (Some(d), Stored::Home(_)) => self.store.write_home(block, d).map(|()| true),
                (Some(d), Stored::Reserve(_)) => self
                    .store
                    .reserve_put(
                        Reserved {
                            block,
                            version: index,
                            checksum,
                        },
                        d,
                    )
                    .map(|()| true),
                // Replayed after the record was trimmed: the copy must be in place.
                (None, _) => Ok(self.has_copy(block, index, checksum, s)),
            };
            match res {
                Ok(true) => {
                    self.lost.remove(&block);
                    self.unflushed = true;
                }
                Ok(false) => {
                    tracing::warn!(
                        replica = self.id,
                        block,
                        index,
                        "a committed write's data is not here: block lost"
                    );
                    self.lost.insert(block, index);
                }
                Err(e) => {
                    tracing::warn!(replica = self.id, block, index, error = %e, "placing a committed write failed: block lost");
                    self.lost.insert(block, index);
                }
            }
        }
    }

    fn has_copy(&self, block: u64, version: Version, checksum: u32, s: Stored) -> bool {
        let mut buf = vec![0u8; self.geometry().block_size as usize];
        match s {
            Stored::Home(_) => {
                self.store.read_home(block, &mut buf).is_ok() && block_crc(&buf) == checksum
            }
            Stored::Reserve(_) => matches!(
                self.store.reserve_read(block, &mut buf),
                Ok(Some(r)) if r.version == version && block_crc(&buf) == checksum
            ),
        }
    }

    /// Write-back of placed data, begun: what a data-device flush started now makes
    /// durable (everything applied so far), or `None` if nothing waits. The flush runs
    /// outside this replica's lock (the node's flusher); [`Local::write_back_done`]
    /// then moves the placed mark and lets the data log go of what it covers. Placed
    /// data is a copy of records the data log keeps until then, so a crash before
    /// only replays them.
    pub fn write_back_begin(&mut self) -> Option<WriteBack> {
        let applied = self.last_applied.map_or(0, |l| l.index);
        if !self.unflushed && applied <= self.placed && !self.store.has_retired() {
            return None;
        }
        self.unflushed = false;
        Some(WriteBack {
            applied,
            trim_below: self.oldest_staged().min(self.datalog.next_lsn()),
            batch: self.store.flush_begin(),
        })
    }

    pub fn write_back_done(
        &mut self,
        wb: WriteBack,
        written: Result<(), String>,
    ) -> Result<(), ReplicaError> {
        let ok = written.is_ok();
        let whole = self.store.flush_done(wb.batch, ok)?;
        if let Err(e) = written {
            self.unflushed = true;
            self.write_back_failures += 1;
            return Err(ReplicaError::Sync(e));
        }
        if !whole {
            // An older write-back failed: what it held is buffered again, not durable,
            // and its records stay in the data log until a later write-back succeeds.
            self.unflushed = true;
            return Ok(());
        }
        self.placed = self.placed.max(wb.applied);
        // Not up to the oldest record staged now: one placed since the batch began is
        // in the buffer only, and its record is what a crash would replay it from.
        // (Every record staged now is at or past `trim_below`: staged then, or
        // appended since.)
        self.datalog.trim_marked(wb.trim_below, self.placed)?;
        Ok(())
    }

    /// The lsn of the oldest record still staged (`u64::MAX` if none).
    fn oldest_staged(&self) -> u64 {
        self.staged_lsns.keys().next().copied().unwrap_or(u64::MAX)
    }

    /// Whether any of `blocks`' home copies is not durable yet.
    pub fn home_pending(&self, mut blocks: impl Iterator<Item = u64>) -> bool {
        blocks.any(|b| self.store.home_pending(b))
    }

    /// Makes placed data durable, then lets the data log go of it.
    pub fn settle(&mut self) -> Result<(), ReplicaError> {
        if self.unflushed {
            self.store.flush()?;
            self.unflushed = false;
        }
        // Everything applied is placed and durable now.
        let applied = self.last_applied.map_or(0, |l| l.index);
        self.placed = self.placed.max(applied);
        self.datalog
            .trim_marked(self.oldest_staged(), self.placed)?;
        Ok(())
    }

    /// Verifies the copies this replica holds of blocks `first..first + count` (each
    /// read as a client's read would be, checksum included; a damaged one is marked
    /// lost). Returns the copies checked and those found damaged.
    pub fn scrub(&mut self, first: u64, count: u64) -> Result<(u64, u64), ReplicaError> {
        // Behind its own disks after a restart: a home copy newer than the table this
        // replica has applied would look damaged. Nothing is verified until it caught up.
        if self.placed > self.last_applied.map_or(0, |l| l.index) {
            return Ok((0, 0));
        }
        let end = first.saturating_add(count).min(self.geometry().blocks);
        let before = self.checksum_failures;
        let mut checked = 0;
        for block in first..end {
            let held = self.table.meta(block).is_some_and(|m| {
                m.version != 0
                    && m.holders.contains(self.id)
                    && self.lost.get(&block) != Some(&m.version)
            });
            if held {
                self.read(block)?;
                checked += 1;
            }
        }
        Ok((checked, self.checksum_failures - before))
    }

    /// Reads `block` as this replica can answer for it at the table's current version.
    pub fn read(&mut self, block: u64) -> Result<LocalRead, ReplicaError> {
        self.read_given(block, None)
    }

    /// Reads `count` blocks from `first` (as [`Local::read`] each), the home copies of
    /// a run inside this replica's preferred slices with one device request: a Phase 2
    /// fetch served a block at a time cost a request per block under this replica's
    /// lock.
    pub fn read_run(&mut self, first: u64, count: u64) -> Result<Vec<LocalRead>, ReplicaError> {
        let g = *self.geometry();
        let end = first.checked_add(count).filter(|&e| e <= g.blocks).ok_or(
            ReplicaError::OutOfRange {
                block: first.saturating_add(count.saturating_sub(1)),
                blocks: g.blocks,
            },
        )?;
        let bs = g.block_size as usize;
        let home = count > 1 && (first..end).all(|b| g.prefers(self.id, g.slice_of(b)));
        let mut run = Vec::new();
        if home {
            run = vec![0u8; count as usize * bs];
            if self.store.read_home_run(first, &mut run).is_err() {
                // One by one instead: the failing block is found and reported lost.
                run.clear();
            }
        }
        (first..end)
            .map(|b| {
                let at = ((b - first) as usize) * bs;
                self.read_given(b, run.get(at..at + bs))
            })
            .collect()
    }

    /// [`Local::read`], with the block's home copy already read (`home`).
    fn read_given(&mut self, block: u64, home: Option<&[u8]>) -> Result<LocalRead, ReplicaError> {
        let g = *self.geometry();
        let m: BlockMeta = *self.table.meta(block).ok_or(ReplicaError::OutOfRange {
            block,
            blocks: g.blocks,
        })?;
        if m.version == 0 {
            return Ok(LocalRead::Zero);
        }
        let mut others = m.holders;
        others.remove(self.id);
        if !m.holders.contains(self.id) || self.lost.get(&block) == Some(&m.version) {
            return Ok(LocalRead::NotHere(others));
        }
        let mut buf = vec![0u8; g.block_size as usize];
        let ok = if m.reserve.contains(self.id) {
            matches!(self.store.reserve_read(block, &mut buf)?, Some(r) if r.version == m.version)
        } else {
            match home {
                Some(d) => buf.copy_from_slice(d),
                None => self.store.read_home(block, &mut buf)?,
            }
            true
        };
        if ok && block_crc(&buf) == m.checksum {
            return Ok(LocalRead::Data(buf));
        }
        tracing::warn!(
            replica = self.id,
            block,
            version = m.version,
            "a held block fails its checksum: reading elsewhere, repairing"
        );
        self.lost.insert(block, m.version);
        self.checksum_failures += 1;
        Ok(LocalRead::NotHere(others))
    }

    /// What this replica knows and keeps of `block`, changing nothing (diagnosis).
    pub fn inspect(&self, block: u64) -> Option<crate::rpc::BlockView> {
        let m = *self.table.meta(block)?;
        let g = *self.geometry();
        let first8 = |b: &[u8]| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[..8]);
            u64::from_le_bytes(v)
        };
        let mut buf = vec![0u8; g.block_size as usize];
        let home = (g.prefers(self.id, g.slice_of(block))
            && self.store.read_home(block, &mut buf).is_ok())
        .then(|| (first8(&buf), block_crc(&buf) == m.checksum));
        let reserved = match self.store.reserve_read(block, &mut buf) {
            Ok(Some(r)) => Some((r.version, first8(&buf), block_crc(&buf) == m.checksum)),
            _ => None,
        };
        Some(crate::rpc::BlockView {
            replica: self.id,
            node: self.node,
            applied: self.last_applied.map_or(0, |l| l.index),
            version: m.version,
            checksum: m.checksum,
            holders: m.holders,
            reserve: m.reserve,
            lost: self.lost.get(&block).copied(),
            home,
            reserved,
        })
    }

    /// Writes a block fetched from another replica (Phase 2, or a repair) at home, if
    /// `version` is still the table's and the data matches its checksum. Returns
    /// whether it did.
    pub fn repair(
        &mut self,
        block: u64,
        version: Version,
        data: &[u8],
    ) -> Result<bool, ReplicaError> {
        let Some(m) = self.table.meta(block).copied() else {
            return Ok(false);
        };
        let g = *self.geometry();
        if m.version != version
            || block_crc(data) != m.checksum
            || !g.prefers(self.id, g.slice_of(block))
        {
            return Ok(false);
        }
        // Restarted behind its own disks (the commit point on the log device lags the
        // placed mark): the home may hold a newer copy than the table this replica has
        // applied so far knows, which a fetched older one must not overwrite. Wait
        // until it has applied up to the mark.
        if self.placed > self.last_applied.map_or(0, |l| l.index) {
            return Ok(false);
        }
        // The block's home is about to hold data newer than any entry the data log may
        // still replay: the placed mark must cover everything applied first, durably,
        // or a restart would replay an older write's record over this repair.
        if self.datalog.mark() < self.last_applied.map_or(0, |l| l.index) {
            self.settle()?;
            self.datalog.set_mark(self.placed)?;
        }
        self.store.write_home(block, data)?;
        self.unflushed = true;
        Ok(true)
    }

    /// The replicated state as a snapshot, after making every applied write's data
    /// durable; written to the log device too.
    fn build_snapshot(&mut self) -> Result<(SnapshotMeta, Vec<u8>), ReplicaError> {
        if let Err(e) = self.settle() {
            // A data device that cannot take the placed data (full, failing): no new
            // snapshot, and the last one again, which purges nothing more. An error
            // here would stop agreement on this replica for good (openraft treats it
            // as fatal); the write-back is retried, and the next snapshot may succeed.
            tracing::warn!(replica = self.id, error = %e, "no snapshot: placed data not durable");
            if let Some(last) = self.snapshot.clone() {
                return Ok(last);
            }
            // None yet: one that names no entry, which openraft takes as nothing newer
            // than what it has (it purges nothing, and keeps it nowhere). An error
            // instead stopped agreement on this replica for good when its first
            // snapshot came due on a full data device (found by gnothi-faults.sh).
            let body = SnapshotBody {
                last_applied: None,
                membership: StoredMembership::default(),
                table: MetaTable::new(*self.geometry()),
                sessions: Sessions::default(),
            };
            let bytes =
                postcard::to_stdvec(&body).map_err(|e| ReplicaError::Snapshot(e.to_string()))?;
            let meta = SnapshotMeta {
                last_log_id: None,
                last_membership: StoredMembership::default(),
                snapshot_id: format!("{}-none", self.id),
            };
            return Ok((meta, bytes));
        }
        let body = SnapshotBody {
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            table: self.table.clone(),
            sessions: self.sessions.clone(),
        };
        let bytes =
            postcard::to_stdvec(&body).map_err(|e| ReplicaError::Snapshot(e.to_string()))?;
        self.snapshot_seq += 1;
        self.label
            .write_snapshot(self.log_dev.as_ref(), self.snapshot_seq, &bytes)?;
        let meta = SnapshotMeta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id: format!("{}-{}", self.id, self.snapshot_seq),
        };
        self.snapshot = Some((meta.clone(), bytes.clone()));
        Ok((meta, bytes))
    }

    /// Takes the leader's snapshot: the table as of its index. Data staged here for
    /// writes it names this replica as holding is placed; reserve copies it no longer
    /// names are freed.
    fn install(&mut self, meta: &SnapshotMeta, bytes: Vec<u8>) -> Result<(), ReplicaError> {
        let body = decode_snapshot(&bytes, self.geometry())?;
        self.set_state(body);
        self.place_covered_staged();
        for r in self.store.reserved_all() {
            // A copy newer than the snapshot's table is kept: this replica placed it
            // before (its disks are ahead of the snapshot), and the entries after the
            // snapshot name it or let it go.
            let keep = self.table.meta(r.block).is_some_and(|m| {
                r.version > m.version || (m.version == r.version && m.reserve.contains(self.id))
            });
            if !keep {
                self.store.reserve_retire(r.block);
                self.unflushed = true;
            }
        }
        // What this replica held before the snapshot and the table still names is
        // checked lazily: a read verifies the checksum, and a miss is repaired.
        self.lost.clear();
        if let Err(e) = self.settle() {
            // A data device that cannot take the placed data (full, failing): the
            // snapshot is kept all the same, since agreement lets go of the entries it
            // covers once this returns (an error here stopped agreement on this replica
            // for good; keeping the old snapshot left a gap to the log after a restart).
            // The data log keeps the records placed above until a write-back succeeds,
            // and a restart places them again (`open`).
            tracing::warn!(replica = self.id, error = %e, "snapshot installed; its placed data not durable yet");
            self.unflushed = true;
        }
        self.snapshot_seq += 1;
        self.label
            .write_snapshot(self.log_dev.as_ref(), self.snapshot_seq, &bytes)?;
        self.snapshot = Some((meta.clone(), bytes));
        Ok(())
    }

    /// Places the staged records of writes the table (a snapshot's) already covers:
    /// their entries will not be applied again, so their data goes where the table
    /// says this replica keeps it, if it matches the version the table names and that
    /// version is past the placed mark. At a snapshot's install, and when a replica
    /// opens on one (an install whose data could not be made durable, a full data
    /// device, left its records in the data log).
    fn place_covered_staged(&mut self) {
        let bs = self.geometry().block_size as usize;
        let writes: Vec<WriteId> = self.staged.keys().copied().collect();
        for w in writes {
            // Only writes the snapshot covers (their client's session says applied)
            // are placed and let go here; the others commit after the snapshot, and
            // their entries will find the data staged.
            let session = crate::meta::Session {
                client: w.client,
                seq: w.seq,
                done_below: 0,
            };
            let covered =
                self.sessions.applied(&session).is_some() || self.sessions.forgotten(&session);
            if !covered {
                continue;
            }
            let Some(st) = self.staged.remove(&w) else {
                continue;
            };
            self.staged_lsns.remove(&st.lsn);
            for (i, d) in st.data.chunks(bs).enumerate() {
                let block = st.first + i as u64;
                let Some(m) = self.table.meta(block).copied() else {
                    continue;
                };
                // At or below the placed mark, the copy was durable where it belongs
                // before (and the home may since hold a newer one the mark covers).
                if !m.holders.contains(self.id)
                    || block_crc(d) != m.checksum
                    || m.version <= self.placed
                {
                    continue;
                }
                let res = if m.reserve.contains(self.id) {
                    self.store.reserve_put(
                        Reserved {
                            block,
                            version: m.version,
                            checksum: m.checksum,
                        },
                        d,
                    )
                } else {
                    self.store.write_home(block, d)
                };
                if let Err(e) = res {
                    tracing::warn!(replica = self.id, block, error = %e, "placing staged data at a snapshot failed");
                }
                self.unflushed = true;
            }
        }
    }
}

/// Each slot's server and address in membership `m` (see `Local::slots`).
fn slots_of(g: &Geometry, m: &StoredMembership) -> Vec<Option<(u64, String)>> {
    let membership = m.membership();
    let Some(newest) = membership.get_joint_config().last() else {
        return Vec::new();
    };
    let mut out = vec![None; usize::from(g.replicas())];
    for &node in newest {
        let slot = usize::from(g.slot_of(node));
        let addr = membership
            .get_node(&node)
            .map(|n| n.addr.clone())
            .unwrap_or_default();
        // Two servers of one slot voting at once is not a membership this volume
        // makes; the lower id (the older) keeps the slot if one appears.
        if out[slot].as_ref().is_none_or(|(n, _)| node < *n) {
            out[slot] = Some((node, addr));
        }
    }
    out
}

fn decode_snapshot(bytes: &[u8], g: &Geometry) -> Result<SnapshotBody, ReplicaError> {
    let body: SnapshotBody =
        postcard::from_bytes(bytes).map_err(|e| ReplicaError::Snapshot(e.to_string()))?;
    if body.table.geometry() != g || !body.table.is_whole() {
        return Err(ReplicaError::Snapshot(
            "its table is for another volume geometry".into(),
        ));
    }
    Ok(body)
}

/// The replica's state, shared by openraft (as the state machine) and the server.
#[derive(Clone)]
pub struct Machine {
    local: Arc<Mutex<Local>>,
}

impl Machine {
    pub fn new(local: Local) -> Machine {
        Machine {
            local: Arc::new(Mutex::new(local)),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl RaftSnapshotBuilder<Meta> for Machine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<Meta>, StorageError> {
        let (meta, bytes) = self
            .lock()
            .build_snapshot()
            .map_err(|e| StorageError::from(StorageIOError::write_snapshot(None, &e)))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<Meta> for Machine {
    type SnapshotBuilder = Machine;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let g = self.lock();
        Ok((g.last_applied, g.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Vec<Outcome>>, StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut g = self.lock();
        let mut out = Vec::new();
        for e in entries {
            let id = *e.get_log_id();
            g.last_applied = Some(id);
            match e.payload {
                EntryPayload::Blank => out.push(vec![Outcome::Applied(id.index)]),
                EntryPayload::Normal(batch) => {
                    let o = batch.0.iter().map(|p| g.apply(id.index, p)).collect();
                    out.push(o);
                }
                EntryPayload::Membership(m) => {
                    g.apply_membership(id.index, StoredMembership::new(Some(id), m));
                    out.push(vec![Outcome::Applied(id.index)]);
                }
            }
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Machine {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        self.lock()
            .install(meta, snapshot.into_inner())
            .map_err(|e| {
                StorageError::from(StorageIOError::read_snapshot(Some(meta.signature()), &e))
            })
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<Meta>>, StorageError> {
        Ok(self.lock().snapshot.clone().map(|(meta, bytes)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        }))
    }
}
