//! Checkpoints that write behind the caller.
//!
//! A checkpoint has two halves. The *snapshot* runs under the tree's lock and copies
//! nothing: it takes a shared reference to every dirty node (`Arc`), the block
//! translation table and the header's fields, and marks the nodes clean. The *write*
//! runs on a thread of its own, with no tree lock: it encodes each node, gives it a
//! fresh extent (copy-on-write) and hands it to the patch engine as a run (one patch),
//! then the table, then the header as a patch whose befores are all of them, and waits
//! until the header is durable. Meanwhile the tree takes more batches; a node the
//! snapshot holds that a batch changes is copied first (`Inner::take_cached`), so the
//! thread encodes the snapshot's version.
//!
//! Order on disk, each step enforced where it says:
//! 1. **Nodes and table before the header**: the header patch's befores (the engine).
//! 2. **The header before the log reuses space its predecessor's replay needs**: the
//!    header's replay starts at the exact stream position the snapshot reached, in the
//!    middle of a log block if need be, and the log never restarts at a checkpoint: the
//!    stream is one. Until the header is durable the ring's start stays where the older
//!    header's replay starts (`LogWriter::room` counts from it), so a log block never
//!    overwrites one that the durable header's replay still reads. Records logged
//!    while the checkpoint is in flight are replayed by either header.
//! 3. **Extents freed only once nothing durable references them**: the extents the
//!    snapshot replaced (and the nodes dropped before it) return to the allocator when
//!    the header is durable (`complete`).
//! 4. **The mirror after the header**: the device's last block gets a copy of the
//!    header once the header is durable, and is flushed before the checkpoint counts
//!    as done. A crash between the two leaves the mirror one generation behind, which
//!    open tells from a damaged newest slot (the mirror then is ahead of both slots).
//!
//! At most one checkpoint is in flight. Its nodes stay cached until it completes (the
//! table the tree reads them by still names their old extents), and the tree learns
//! their new extents then. The commit point of a checkpoint is the header's patch
//! becoming durable.
//!
//! One writer thread serves every checkpoint of an open tree (`Writer`). A thread per
//! checkpoint (106 of them for 2 M random inserts) left each one's allocator heap
//! behind when it ended: with mimalloc, peak RSS 175-188 MiB against 163-171 MiB with
//! one writer.

use super::Inner;
use crate::alloc::Alloc;
use crate::format::{self, Extent, Header};
use crate::msg::Msn;
use crate::node::{self, Node, NodeId};
use crate::{Error, Result};
use quilt_patch::{ChangeOpts, Engine, PatchError, PatchId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};

/// Where the writer thread put the snapshot's nodes (with the section of each node
/// written whole: the node's base once the header is durable) and the table.
#[derive(Clone)]
pub(crate) struct Placed {
    nodes: Vec<(NodeId, Extent, Option<Vec<u8>>)>,
    table: Extent,
}

/// Why the writer thread failed: the device was full (of `blocks` for an extent), or
/// something else.
#[derive(Clone)]
pub(crate) enum Failure {
    Full(u64),
    Other(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        match e {
            Error::Full(n) => Failure::Full(n),
            e => Failure::Other(e.to_string()),
        }
    }
}

/// What the writer thread reports: where each node went as soon as the engine has it
/// (so the tree may evict it and read it back from there), and the end.
#[derive(Default)]
pub(crate) struct Done {
    placed: Mutex<HashMap<NodeId, Extent>>,
    result: Mutex<Option<std::result::Result<Placed, Failure>>>,
    cv: Condvar,
}

impl Done {
    fn place(&self, id: NodeId, e: Extent) {
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, e);
    }

    fn placed(&self, id: NodeId) -> Option<Extent> {
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }

    fn finish(&self, r: std::result::Result<Placed, Failure>) {
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.cv.notify_all();
    }

    pub(crate) fn is_done(&self) -> bool {
        self.result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Waits for the writer thread (holding no lock it needs: it takes none of the
    /// tree's).
    pub(crate) fn wait(&self) -> std::result::Result<Placed, Failure> {
        let mut r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = r.as_ref() {
                return r.clone();
            }
            r = self.cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The thread that writes checkpoints, started with an open tree's first one. Dropping
/// it lets the job it holds finish.
pub(crate) struct Writer {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start() -> std::io::Result<Writer> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("quilt-betree-ckpt".into())
            .spawn(move || {
                for job in rx {
                    let done = job.done.clone();
                    // A panic is a bug; reported as a failure, it stops the tree rather
                    // than leaving a caller waiting for a result that never comes.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run()));
                    done.finish(match r {
                        Ok(r) => r.map_err(Failure::from),
                        Err(_) => Err(Failure::Other("the checkpoint writer panicked".into())),
                    });
                }
            })?;
        Ok(Writer {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A checkpoint the writer thread may still be writing.
pub(crate) struct InFlight {
    done: Arc<Done>,
    /// The snapshot's nodes: cached until it completes (`evict` passes over them).
    pub(crate) pinned: HashSet<NodeId>,
    /// Their memory when the snapshot was taken.
    pub(crate) bytes: usize,
    /// Of those, the ones that left the tree meanwhile (their new extents are freed by
    /// the next checkpoint).
    freed: HashSet<NodeId>,
    /// The extents the snapshot's table gave its nodes before, to be freed.
    before: HashMap<NodeId, Extent>,
    /// The base each of its leaves is written over (`None`: written whole).
    bases: HashMap<NodeId, Option<Extent>>,
    /// Where its header's replay starts: the ring's space before it is free once the
    /// header is durable.
    log_lsn: u64,
    /// Its header's next MSN: the values of puts by reference below it are in its
    /// nodes once it is durable.
    next_msn: Msn,
    /// Its header's version.
    version: u32,
    /// Extents that become free once the header is durable.
    freeing: Vec<Extent>,
}

impl InFlight {
    pub(crate) fn done(&self) -> Arc<Done> {
        self.done.clone()
    }
}

impl Drop for InFlight {
    /// A tree dropped with a checkpoint in flight lets it finish: the thread writes to
    /// the device the tree was opened on, which the caller may open again at once.
    fn drop(&mut self) {
        let _ = self.done.wait();
    }
}

/// The snapshot the writer thread works from.
struct Job {
    done: Arc<Done>,
    engine: Engine,
    alloc: Arc<Mutex<Alloc>>,
    nodes: Vec<(NodeId, Arc<Node>)>,
    /// The table as the snapshot saw it; the nodes' new extents replace their entries.
    btt: HashMap<NodeId, Extent>,
    refs: Vec<(NodeId, u32)>,
    /// The base extents of delta leaves, as the snapshot leaves them.
    bases: Vec<(NodeId, Extent)>,
    header: Header,
    bs: usize,
    basement_bytes: usize,
    /// The engine's cache is written back every this many bytes, from this thread (not
    /// by a caller's next log write finding it over its budget).
    chunk_bytes: usize,
}

impl Job {
    /// A fresh extent, with storage behind it where the device is a sparse image file
    /// (a host file system that fills up fails this allocation, not a write-back).
    fn alloc(&self, blocks: u64) -> Result<Extent> {
        let mut alloc = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        let e = alloc.alloc(blocks).ok_or(Error::Full(blocks))?;
        match self.engine.reserve(e.start, e.blocks) {
            Ok(()) => Ok(e),
            Err(err) => {
                alloc.free(e);
                Err(match err {
                    PatchError::Block(quilt_block::BlockError::NoSpace { .. }) => {
                        Error::Full(blocks)
                    }
                    err => err.into(),
                })
            }
        }
    }

    fn run(mut self) -> Result<Placed> {
        let opts = ChangeOpts::default();
        let mut all: Vec<PatchId> = Vec::new();
        let mut chunk: Vec<PatchId> = Vec::new();
        let mut chunk_len = 0;
        let mut placed = Vec::with_capacity(self.nodes.len());
        let engine = self.engine.clone();
        let chunk_bytes = self.chunk_bytes;
        let mut write = |start: u64, bytes: &[u8]| -> Result<()> {
            let ps = engine.write_run(start, bytes, &[], opts)?;
            chunk.extend_from_slice(&ps);
            all.extend(ps);
            chunk_len += bytes.len();
            if chunk_len >= chunk_bytes {
                let join = engine.empty(&chunk);
                engine.flush_until(join)?;
                chunk.clear();
                chunk_len = 0;
            }
            Ok(())
        };
        for (id, n) in std::mem::take(&mut self.nodes) {
            let bytes = node::encode(id, &n, self.bs, self.basement_bytes);
            let whole = match &*n {
                Node::Leaf(l) => l.delta.base.is_none(),
                Node::Internal(x) => x.delta.base.is_none(),
            };
            drop(n);
            // A whole node's section, for the node to take deltas over this extent.
            let section = if whole {
                let (_, len) = node::section_len(&bytes, id)?;
                Some(bytes[..len].to_vec())
            } else {
                None
            };
            let e = self.alloc((bytes.len() / self.bs) as u64)?;
            write(e.start, &bytes)?;
            self.done.place(id, e);
            self.btt.insert(id, e);
            placed.push((id, e, section));
        }
        let mut entries: Vec<(NodeId, Extent)> = self.btt.iter().map(|(k, v)| (*k, *v)).collect();
        entries.sort_unstable();
        let (bytes, table_crc) = format::encode_table(&entries, &self.refs, &self.bases, self.bs);
        let table = self.alloc((bytes.len() / self.bs) as u64)?;
        write(table.start, &bytes)?;
        all.sort_unstable();
        all.dedup();
        let h = Header {
            table,
            table_crc,
            ..self.header
        };
        // 1. Nodes and table before the header.
        let header = h.encode(self.bs);
        let hp = self.engine.write(h.slot(), 0, &header, &all, opts)?;
        // The commit point: the header durable.
        self.engine.flush_until(hp)?;
        // 4. The mirror after it (a flush more): so a mirror newer than both slots means
        // the newest slot was damaged after it was durable, never a torn write (see
        // `Inner::open`).
        if h.geo.mirror != 0 {
            let mp = self.engine.write(h.geo.mirror, 0, &header, &[hp], opts)?;
            self.engine.flush_until(mp)?;
        }
        Ok(Placed {
            nodes: placed,
            table,
        })
    }
}

impl Inner {
    /// The snapshot half of a checkpoint (see the module's doc): takes the dirty nodes,
    /// the table and the header's fields, and starts the thread that writes them. Waits
    /// first for a checkpoint still in flight.
    pub(crate) fn start_checkpoint(&mut self) -> Result<()> {
        if self.holding() {
            // Batches held are in memory only: a checkpoint would make them durable
            // before their record is logged, and a rollback could not forget them.
            return Ok(());
        }
        self.finish_checkpoint()?;
        self.check_failed()?;
        let bs = self.geo.block_size;
        let dirty = self.cache.dirty_ids();
        let mut nodes = Vec::with_capacity(dirty.len());
        let mut before = HashMap::new();
        let mut new_bases = HashMap::new();
        let mut table_bases = self.bases.clone();
        let mut bytes = 0;
        for &id in &dirty {
            let (node, mem) = self.cache.mark_clean(id).expect("dirty node cached");
            bytes += mem;
            let base = match &*node {
                Node::Leaf(l) => l.delta.base.as_ref().map(|b| b.extent),
                Node::Internal(n) => n.delta.base.as_ref().map(|b| b.extent),
            };
            nodes.push((id, node));
            if let Some(&e) = self.btt.get(&id) {
                before.insert(id, e);
            }
            match base {
                Some(b) => table_bases.insert(id, b),
                None => table_bases.remove(&id),
            };
            new_bases.insert(id, base);
        }
        let refs = self.refs.sorted();
        let mut table_bases: Vec<(NodeId, Extent)> = table_bases.into_iter().collect();
        table_bases.sort_unstable();
        let mut freeing = std::mem::take(&mut self.to_free);
        if self.table.blocks > 0 {
            freeing.push(self.table);
        }
        self.generation += 1;
        // Replay starts at the very next record, wherever it falls in its block.
        let (log_lsn, log_offset) = self.log.position();
        self.header_version = Header::version_for(&self.geo);
        let header = Header {
            version: self.header_version,
            instance: self.log.instance,
            generation: self.generation,
            geo: self.geo,
            root: self.root,
            table: Extent {
                start: 0,
                blocks: 0,
            },
            table_crc: 0,
            next_node: self.next_node,
            next_msn: self.next_msn,
            log_lsn,
            log_offset,
        };
        let done = Arc::new(Done::default());
        let job = Job {
            done: done.clone(),
            engine: self.engine.clone(),
            alloc: self.alloc.clone(),
            nodes,
            btt: self.btt.clone(),
            refs,
            bases: table_bases,
            header,
            bs,
            basement_bytes: self.geo.basement_bytes,
            chunk_bytes: (self.engine.options().cache_bytes_max / 2).max(bs),
        };
        self.stats.node_writes += dirty.len() as u64;
        if self.writer.is_none() {
            match Writer::start() {
                Ok(w) => self.writer = Some(w),
                Err(e) => {
                    // The nodes are clean now and nothing will write them.
                    self.failed = Some(format!("cannot start a checkpoint thread: {e}"));
                    return Err(Error::Failed(e.to_string()));
                }
            }
        }
        let sent = self
            .writer
            .as_ref()
            .and_then(|w| w.jobs.as_ref())
            .is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            self.failed = Some("the checkpoint thread is gone".into());
            return Err(Error::Failed("the checkpoint thread is gone".into()));
        }
        self.inflight = Some(InFlight {
            done,
            pinned: dirty.into_iter().collect(),
            bytes,
            freed: HashSet::new(),
            before,
            bases: new_bases,
            log_lsn,
            next_msn: self.next_msn,
            version: self.header_version,
            freeing,
        });
        self.stats.checkpoints += 1;
        Ok(())
    }

    /// Completes the checkpoint in flight if its thread is done (without waiting).
    pub(crate) fn poll_checkpoint(&mut self) -> Result<()> {
        if self.inflight.as_ref().is_some_and(|f| f.done.is_done()) {
            self.finish_checkpoint()?;
        }
        Ok(())
    }

    /// Waits for the checkpoint in flight, if any, and completes it: its header is
    /// durable, so the tree reads its nodes at their new extents, and the ring's space
    /// before its replay start and the extents it replaced are free.
    pub(crate) fn finish_checkpoint(&mut self) -> Result<()> {
        let Some(mut f) = self.inflight.take() else {
            return Ok(());
        };
        if !f.done.is_done() {
            self.stats.checkpoint_waits += 1;
        }
        let r = f.done.wait();
        let placed = match r {
            Ok(p) => p,
            Err(Failure::Full(n)) => {
                self.undo_checkpoint(f);
                return Err(Error::Full(n));
            }
            Err(Failure::Other(m)) => {
                // The nodes were marked clean for extents that may never be written, and
                // the header may be half written: the tree stops (a reopen recovers from
                // the older header and the log).
                self.failed = Some(format!("checkpoint: {m}"));
                return Err(Error::Failed(m));
            }
        };
        self.full_at = None;
        // 2. and 3.: the header is durable.
        self.log.start_lsn = f.log_lsn;
        // Its nodes hold the values of the puts by reference below its cut.
        self.unbound.retain(|(msn, _)| *msn >= f.next_msn);
        self.unbound_bytes = self.unbound.iter().map(|(_, v)| v.len()).sum();
        self.durable_version = f.version;
        let alloc = self.alloc.clone();
        let mut alloc = alloc.lock().unwrap_or_else(|e| e.into_inner());
        for (id, e, section) in placed.nodes {
            self.stats.node_bytes_written += e.blocks * self.geo.block_size as u64;
            if f.freed.contains(&id) {
                // The durable header names it; the next one will not. (Its base, if it
                // is a delta, was its extent or its base before, which `free_node`
                // already gave back.)
                self.to_free.push(e);
                continue;
            }
            let old = self.btt.insert(id, e);
            debug_assert_eq!(old, f.before.get(&id).copied(), "node {id} moved meanwhile");
            // A delta keeps its base: the node's extent before, or its base before.
            let base = f.bases.get(&id).copied().flatten();
            let old_base = match base {
                Some(b) => self.bases.insert(id, b),
                None => self.bases.remove(&id),
            };
            debug_assert!(
                base.is_none() || base == old || base == old_base,
                "node {id}: a delta over an extent it did not have"
            );
            for x in [old, old_base].into_iter().flatten() {
                if Some(x) != base {
                    alloc.free(x);
                }
            }
            // A whole node still cached as written takes deltas over its new extent.
            let clean = self.cache.get(&id).is_some_and(|c| !c.is_dirty());
            if let (Some(section), true) = (section, clean) {
                self.change_cached(id, |n| {
                    let delta = match n {
                        Node::Leaf(l) if l.entries().is_some() => Some(&mut l.delta),
                        Node::Internal(n) if n.is_whole() => Some(&mut n.delta),
                        _ => None,
                    };
                    if let Some(d) = delta.filter(|d| d.base.is_none() && d.is_empty()) {
                        d.base = Some(node::Base { extent: e, section });
                    }
                });
            }
        }
        self.table = placed.table;
        for e in std::mem::take(&mut f.freeing) {
            alloc.free(e);
        }
        Ok(())
    }

    /// Puts back what a checkpoint that found no room took, so that the tree goes on
    /// as if it had not started: its nodes dirty again (each is still cached: they stay
    /// pinned until the checkpoint ends), the extents it placed them in free, the
    /// extents it was to free owed to the next one, and its generation unused (the
    /// next header must go to the slot the durable one is not in). Nothing durable
    /// names what it wrote: the header is the last thing written, after every
    /// allocation succeeded.
    fn undo_checkpoint(&mut self, mut f: InFlight) {
        let placed: Vec<Extent> = f
            .done
            .placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .copied()
            .collect();
        {
            let alloc = self.alloc.clone();
            let mut alloc = alloc.lock().unwrap_or_else(|e| e.into_inner());
            for e in placed {
                alloc.free(e);
            }
            self.full_at = Some(alloc.free_blocks);
        }
        for &id in &f.pinned {
            if f.freed.contains(&id) {
                continue;
            }
            // (A node changed since is a dirty copy already.)
            if !self.cache.mark_dirty(id) {
                debug_assert!(false, "node {id} of a failed checkpoint left the cache");
            }
        }
        let table = self.table;
        self.to_free.extend(
            std::mem::take(&mut f.freeing)
                .into_iter()
                .filter(|e| *e != table),
        );
        self.generation -= 1;
        self.stats.checkpoints_failed += 1;
        tracing::warn!(
            "betree: a checkpoint found no room ({} blocks free, {} needed); the tree goes on",
            self.free_blocks(),
            self.pending_blocks()
        );
    }

    /// Drops a node from the checkpoint in flight's bookkeeping when it leaves the tree.
    pub(super) fn unpin_freed(&mut self, id: NodeId) {
        if let Some(f) = &mut self.inflight {
            if f.pinned.contains(&id) {
                f.freed.insert(id);
            }
        }
    }

    /// Where the checkpoint in flight put a node it holds, if it did yet.
    pub(super) fn placed_inflight(&self, id: NodeId) -> Option<Extent> {
        self.inflight
            .as_ref()
            .filter(|f| f.pinned.contains(&id))
            .and_then(|f| f.done.placed(id))
    }

    /// A whole checkpoint, durable when this returns.
    pub fn checkpoint(&mut self) -> Result<()> {
        self.start_checkpoint()?;
        self.finish_checkpoint()
    }

    /// The final checkpoint of a clean shutdown (see `LogWriter::skip_to_fresh_block`).
    pub fn close(&mut self) -> Result<()> {
        if self.holding() {
            return Err(Error::Invalid("closing a tree that holds batches".into()));
        }
        self.finish_checkpoint()?;
        self.log.skip_to_fresh_block();
        self.checkpoint()
    }

    /// What to wait on (without the lock) for the checkpoint in flight.
    pub(crate) fn checkpoint_done(&self) -> Option<Arc<Done>> {
        self.inflight.as_ref().map(InFlight::done)
    }
}
