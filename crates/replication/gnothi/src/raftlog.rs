//! The Raft log and vote, durable on the replica's log device. They live in a ring of
//! the same format as the data log (`datalog.rs`), in a region of their own; a record's
//! write id carries a tag and a log index instead of a client's write:
//!
//! - `ENTRIES` (seq: first index): the entries of one append, postcard-encoded;
//! - `VOTE`: the vote; `COMMITTED`: the last committed log id;
//! - `TRUNCATE` (seq: index): entries from that index on are gone;
//! - `PURGED`: the last purged log id; entries up to it are gone.
//!
//! Reopening replays the records in order. A purge moves the ring's head past records
//! that hold only purged entries, after writing the vote, the purge mark and the commit
//! point again at the tail, so that nothing still needed is in the trimmed part.

use crate::datalog::{DataLog, DataLogError};
use crate::meta::{Entry, LogId, Meta, StorageError, Vote};
use crate::table::WriteId;
use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{RaftLogId, StorageIOError};
use quilt_block::BlockDevice;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard};

const ENTRIES: u64 = 1;
const VOTE: u64 = 2;
const TRUNCATE: u64 = 3;
const PURGED: u64 = 4;
const COMMITTED: u64 = 5;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RaftLogError {
    #[error("raft log: {0}")]
    Ring(#[from] DataLogError),
    #[error("raft log record {lsn} (tag {tag}) does not decode: {why}")]
    Decode { lsn: u64, tag: u64, why: String },
    #[error("raft log record {lsn} has unknown tag {tag}")]
    Tag { lsn: u64, tag: u64 },
    #[error("entry of {0} bytes does not encode: {1}")]
    Encode(usize, String),
}

struct Inner {
    ring: DataLog,
    bs: usize,
    /// Index → (entry, lsn of the record holding it).
    entries: BTreeMap<u64, (Entry, u64)>,
    vote: Option<Vote>,
    committed: Option<LogId>,
    /// The commit point last written to the ring (it is written every
    /// [`COMMIT_EVERY`] entries, not at every commit).
    committed_written: u64,
    purged: Option<LogId>,
}

/// How far the commit point may run ahead of the one on the device. A record per
/// commit took a block each: the ring filled with them between snapshots. A commit
/// point behind the truth is safe: a restarted replica applies less from its own log
/// and learns the rest from the leader.
const COMMIT_EVERY: u64 = 256;

/// The Raft log storage of one replica; clones share it (a clone is the log reader).
#[derive(Clone)]
pub struct RaftLog {
    inner: Arc<Mutex<Inner>>,
}

fn io(e: impl std::error::Error + Send + Sync + 'static) -> StorageError {
    StorageIOError::write_logs(&e).into()
}

impl RaftLog {
    /// An empty log in `len` blocks from `first` of `dev`.
    pub fn format(
        dev: Arc<dyn BlockDevice>,
        first: u64,
        len: u64,
    ) -> Result<RaftLog, RaftLogError> {
        let bs = dev.block_size();
        let ring = DataLog::format(dev, first, len)?;
        Ok(RaftLog::from_inner(Inner::empty(ring, bs)))
    }

    /// The log in `len` blocks from `first`, as its records left it.
    pub fn open(dev: Arc<dyn BlockDevice>, first: u64, len: u64) -> Result<RaftLog, RaftLogError> {
        let bs = dev.block_size();
        let (ring, records) = DataLog::open(dev, first, len)?;
        let mut inner = Inner::empty(ring, bs);
        for r in records {
            let (tag, index, len) = (r.write.client, r.write.seq, r.first as usize);
            let body = r.data.get(..len).ok_or_else(|| RaftLogError::Decode {
                lsn: r.lsn,
                tag,
                why: format!("length {len} past its {} bytes", r.data.len()),
            })?;
            let bad = |e: postcard::Error| RaftLogError::Decode {
                lsn: r.lsn,
                tag,
                why: e.to_string(),
            };
            match tag {
                ENTRIES => {
                    let es: Vec<Entry> = postcard::from_bytes(body).map_err(bad)?;
                    let _ = index;
                    for e in es {
                        inner.entries.insert(e.get_log_id().index, (e, r.lsn));
                    }
                }
                VOTE => inner.vote = Some(postcard::from_bytes(body).map_err(bad)?),
                COMMITTED => {
                    inner.committed = postcard::from_bytes(body).map_err(bad)?;
                    inner.committed_written = inner.committed.map_or(0, |c| c.index);
                }
                TRUNCATE => {
                    inner.entries.split_off(&index);
                }
                PURGED => {
                    let p: Option<LogId> = postcard::from_bytes(body).map_err(bad)?;
                    if let Some(p) = p {
                        inner.entries = inner.entries.split_off(&(p.index + 1));
                    }
                    inner.purged = p;
                }
                tag => return Err(RaftLogError::Tag { lsn: r.lsn, tag }),
            }
        }
        Ok(RaftLog::from_inner(inner))
    }

    fn from_inner(inner: Inner) -> RaftLog {
        RaftLog {
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves a log whose records are still
        // the truth; go on with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks of the ring in use, and the ring's size.
    pub fn usage(&self) -> (u64, u64) {
        let g = self.lock();
        (g.ring.used(), g.ring.ring_blocks())
    }

    /// The last log index held (or purged).
    pub fn last_index(&self) -> u64 {
        let g = self.lock();
        g.entries
            .keys()
            .next_back()
            .copied()
            .or(g.purged.map(|p| p.index))
            .unwrap_or(0)
    }
}

impl Inner {
    fn empty(ring: DataLog, bs: usize) -> Inner {
        Inner {
            ring,
            bs,
            entries: BTreeMap::new(),
            vote: None,
            committed: None,
            committed_written: 0,
            purged: None,
        }
    }

    fn put(&mut self, tag: u64, index: u64, body: &[u8]) -> Result<u64, RaftLogError> {
        let blocks = body.len().div_ceil(self.bs).max(1);
        let mut data = vec![0u8; blocks * self.bs];
        data[..body.len()].copy_from_slice(body);
        let lsn = self.ring.append(
            WriteId {
                client: tag,
                seq: index,
            },
            body.len() as u64,
            &data,
        )?;
        Ok(lsn)
    }

    fn put_value<T: serde::Serialize>(
        &mut self,
        tag: u64,
        index: u64,
        v: &T,
    ) -> Result<u64, RaftLogError> {
        let body = postcard::to_stdvec(v).map_err(|e| RaftLogError::Encode(0, e.to_string()))?;
        self.put(tag, index, &body)
    }

    fn sync(&self) -> Result<(), RaftLogError> {
        Ok(self.ring.sync()?)
    }
}

impl RaftLogReader<Meta> for RaftLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        // From the first entry held in the range, the run without a hole. openraft's
        // own helpers ask from indexes already purged ("an entry not found is
        // allowed"); a hole inside is never passed off as consecutive entries. (A
        // stale replication task that asks from a purged index gets later entries:
        // the follower refuses such a request, see `node.rs`.)
        let g = self.lock();
        let mut out: Vec<Entry> = Vec::new();
        let mut next: Option<u64> = None;
        for (&i, (e, _)) in g.entries.range(range) {
            if next.is_some_and(|n| n != i) {
                break;
            }
            next = Some(i + 1);
            out.push(e.clone());
        }
        Ok(out)
    }
}

impl RaftLogStorage<Meta> for RaftLog {
    type LogReader = RaftLog;

    async fn get_log_state(&mut self) -> Result<LogState<Meta>, StorageError> {
        let g = self.lock();
        let last = g
            .entries
            .values()
            .next_back()
            .map(|(e, _)| *e.get_log_id())
            .or(g.purged);
        Ok(LogState {
            last_purged_log_id: g.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> RaftLog {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        let mut g = self.lock();
        g.put_value(VOTE, 0, vote)
            .and_then(|_| g.sync())
            .map_err(|e| StorageError::from(StorageIOError::write_vote(&e)))?;
        g.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        Ok(self.lock().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not synced: a commit point lost in a crash only means re-applying from the
        // snapshot up to what the leader says again.
        let mut g = self.lock();
        let index = committed.map_or(0, |c| c.index);
        if index >= g.committed_written.saturating_add(COMMIT_EVERY) {
            g.put_value(COMMITTED, 0, &committed).map_err(io)?;
            g.committed_written = index;
        }
        g.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<Meta>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let es: Vec<Entry> = entries.into_iter().collect();
        let Some(first) = es.first().map(|e| e.get_log_id().index) else {
            callback.log_io_completed(Ok(()));
            return Ok(());
        };
        let mut g = self.lock();
        let res = g
            .put_value(ENTRIES, first, &es)
            .and_then(|lsn| g.sync().map(|()| lsn));
        match res {
            Ok(lsn) => {
                for e in es {
                    g.entries.insert(e.get_log_id().index, (e, lsn));
                }
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(io(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut g = self.lock();
        g.put_value(TRUNCATE, log_id.index, &())
            .and_then(|_| g.sync())
            .map_err(io)?;
        g.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut g = self.lock();
        g.purged = Some(log_id);
        g.entries = g.entries.split_off(&(log_id.index + 1));
        // Rewrite what the trimmed records may hold and is still needed, then trim.
        let vote = g.vote;
        let committed = g.committed;
        let mut keep = Vec::new();
        let res = (|| -> Result<(), RaftLogError> {
            if let Some(v) = vote {
                keep.push(g.put_value(VOTE, 0, &v)?);
            }
            keep.push(g.put_value(COMMITTED, 0, &committed)?);
            g.committed_written = committed.map_or(0, |c| c.index);
            keep.push(g.put_value(PURGED, 0, &Some(log_id))?);
            g.sync()
        })();
        res.map_err(io)?;
        let oldest_entry = g.entries.values().map(|&(_, lsn)| lsn).min();
        let head = keep.into_iter().chain(oldest_entry).min();
        if let Some(lsn) = head {
            g.ring.trim(lsn).map_err(io)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};
    use quilt_block::MemDevice;

    fn entry(term: u64, index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 0), index),
            payload: EntryPayload::Blank,
        }
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    async fn append(log: &mut RaftLog, es: Vec<Entry>) {
        // LogFlushed has no public constructor; go through the storage ext helper.
        use openraft::storage::RaftLogStorageExt;
        log.blocking_append(es).await.unwrap();
    }

    #[test]
    fn the_log_reopens_as_its_records_left_it() {
        run(async {
            let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(512, 256).unwrap());
            let mut log = RaftLog::format(dev.clone(), 8, 200).unwrap();
            let vote = Vote::new(3, 1);
            log.save_vote(&vote).await.unwrap();
            append(&mut log, (1..=5).map(|i| entry(1, i)).collect()).await;
            append(&mut log, (6..=9).map(|i| entry(2, i)).collect()).await;
            log.truncate(LogId::new(CommittedLeaderId::new(2, 0), 8))
                .await
                .unwrap();
            append(&mut log, vec![entry(3, 8)]).await;
            log.purge(LogId::new(CommittedLeaderId::new(1, 0), 3))
                .await
                .unwrap();

            let mut again = RaftLog::open(dev, 8, 200).unwrap();
            assert_eq!(again.read_vote().await.unwrap(), Some(vote));
            let st = again.get_log_state().await.unwrap();
            assert_eq!(st.last_purged_log_id.map(|l| l.index), Some(3));
            assert_eq!(
                st.last_log_id,
                Some(LogId::new(CommittedLeaderId::new(3, 0), 8))
            );
            let es = again.try_get_log_entries(0..100).await.unwrap();
            let ids: Vec<(u64, u64)> = es
                .iter()
                .map(|e| (e.log_id.leader_id.term, e.log_id.index))
                .collect();
            assert_eq!(ids, vec![(1, 4), (1, 5), (2, 6), (2, 7), (3, 8)]);
        });
    }

    #[test]
    fn purging_frees_the_ring_and_keeps_the_vote() {
        run(async {
            let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(512, 64).unwrap());
            let mut log = RaftLog::format(dev.clone(), 0, 64).unwrap();
            log.save_vote(&Vote::new(1, 2)).await.unwrap();
            // Far more appends than the ring holds at once, purged as they go.
            for i in 1..=500u64 {
                append(&mut log, vec![entry(1, i)]).await;
                if i % 10 == 0 {
                    log.purge(LogId::new(CommittedLeaderId::new(1, 0), i - 2))
                        .await
                        .unwrap();
                }
            }
            let mut again = RaftLog::open(dev, 0, 64).unwrap();
            assert_eq!(again.read_vote().await.unwrap(), Some(Vote::new(1, 2)));
            let es = again.try_get_log_entries(0..1000).await.unwrap();
            assert_eq!(
                es.iter().map(|e| e.log_id.index).collect::<Vec<_>>(),
                vec![499, 500]
            );
        });
    }
}
