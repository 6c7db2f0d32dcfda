//! quilt-betree: a write-optimized Bε-tree key-value store on the patch layer.
//!
//! Internal nodes buffer *messages* for their children; a full buffer is flushed, in one
//! batch, to the child that would receive the most bytes, so a small random write costs a
//! fraction of a node write instead of a read-modify-write of a leaf (BetrFS's tree).
//! Queries apply the messages pending on their root-to-leaf path. Leaves are cut into
//! *basements* that are read and decoded independently.
//!
//! Durability: every batch is a record in a redo log (`sync` makes the records so far
//! durable, one device flush for all callers waiting together); nodes are written
//! copy-on-write by *checkpoints*, which write every dirty node and the block translation
//! table, then one of two alternating headers, on a thread of their own while the tree
//! takes more batches. The order "nodes and table before header,
//! header before the log reuses its space" is a set of patch dependencies: the patch
//! engine enforces it, and the crash explorer cuts states from what it wrote. Recovery is
//! the newest valid header plus a replay of the log after it.
//!
//! # Example
//!
//! ```
//! use quilt_betree::{Options, Tree, WRITE_AT, write_at_arg};
//! use quilt_block::MemDevice;
//! use std::sync::Arc;
//!
//! let dev = Arc::new(MemDevice::new(4096, 16384)?);
//! let tree = Tree::create(dev.clone(), Options::default())?;
//! tree.put(b"apple", b"red")?;
//! tree.upsert(b"apple", WRITE_AT, &write_at_arg(0, b"R"))?;
//! tree.delete_range(b"b", b"c")?;
//! tree.sync()?;
//! assert_eq!(tree.get(b"apple")?, Some(b"Red".to_vec()));
//! drop(tree); // a crash: nothing more is logged (a checkpoint in flight finishes)
//! let tree = Tree::open(dev, Options::default())?; // recovery replays the log
//! let all: Vec<_> = tree.range(b"", None).collect::<Result<_, _>>()?;
//! assert_eq!(all, vec![(b"apple".to_vec(), b"Red".to_vec())]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod alloc;
mod chunk;
mod codec;
mod entries;
mod format;
mod lift;
mod log;
mod msg;
mod node;
mod points;
pub mod reference;
mod tree;

pub use format::Geometry;
pub use msg::{
    truncate_arg, write_at_arg, UpsertFn, Upserts, FIRST_USER_UPSERT, TRUNCATE, WRITE_AT,
};

use quilt_block::BlockDevice;
use quilt_patch::{Engine, EngineOptions, PatchError};
use std::sync::{Arc, Mutex, MutexGuard};

/// Errors of the tree.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Patch(#[from] PatchError),
    /// An on-disk structure failed its checks (magic, version, checksum, bounds).
    #[error("damaged tree image: {0}")]
    Corrupt(String),
    /// A structure's stored checksum is not the one its bytes give (a torn or damaged
    /// write, a flipped bit): both values, for a report that can tell a zeroed block
    /// (stored 0) from a stale one.
    #[error("damaged tree image: {what}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        what: String,
        stored: u32,
        computed: u32,
    },
    #[error("the device holds no Bε-tree (no header in block 0 or 1)")]
    NotFormatted,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("upsert function {0} is not registered")]
    UnknownUpsert(u16),
    #[error("the device is full ({0} more blocks needed)")]
    Full(u64),
    /// An earlier failure left the in-memory tree unusable; reopen the device.
    #[error("the tree stopped after an earlier failure ({0}); reopen it to recover")]
    Failed(String),
}

impl Error {
    /// Whether the error says the image is damaged (a failed check or checksum), as
    /// against the device failing or the tree refusing a request.
    pub fn is_damage(&self) -> bool {
        matches!(self, Error::Corrupt(_) | Error::Checksum { .. })
    }

    /// The same damage, said of `whose` (a node named in front of a part's message).
    pub(crate) fn within(self, whose: &str) -> Error {
        match self {
            Error::Corrupt(m) => Error::Corrupt(format!("{whose}: {m}")),
            Error::Checksum {
                what,
                stored,
                computed,
            } => Error::Checksum {
                what: format!("{whose}: {what}"),
                stored,
                computed,
            },
            e => e,
        }
    }
}

impl From<quilt_block::BlockError> for Error {
    fn from(e: quilt_block::BlockError) -> Error {
        Error::Patch(e.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One operation of a batch (and of the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Delete {
        key: Vec<u8>,
    },
    Upsert {
        key: Vec<u8>,
        func: u16,
        arg: Vec<u8>,
    },
    /// Deletes every key in `start..end` (end exclusive), as one message.
    DeleteRange {
        start: Vec<u8>,
        end: Vec<u8>,
    },
    /// Range rename: every key that starts with `from` now starts with `to` instead, and
    /// the keys that started with `to` are gone. Neither prefix may be a prefix of the
    /// other. Costs the same at any size: the range's subtrees move whole (`lift.rs`).
    RenamePrefix {
        from: Vec<u8>,
        to: Vec<u8>,
    },
    /// Range clone: for every key `from + s` with `start <= s` (and `s < end` when an end
    /// is given), the key `to + s` now holds the same value; what `to`'s range held
    /// before is gone. The source is unchanged. Neither prefix may be a prefix of the
    /// other. Costs the same at any size: the range's subtrees are shared by both places
    /// (reference counts) and copied only when enough writes reach one of them
    /// (copy-on-abundant-write; see `tree/surgery.rs`).
    CloneRange {
        from: Vec<u8>,
        to: Vec<u8>,
        start: Vec<u8>,
        end: Option<Vec<u8>>,
    },
}

/// Operations applied atomically: after a crash, all of them or none.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub ops: Vec<Op>,
}

impl Batch {
    pub fn new() -> Batch {
        Batch::default()
    }
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> &mut Batch {
        self.ops.push(Op::Put {
            key: key.to_vec(),
            value: value.to_vec(),
        });
        self
    }
    pub fn delete(&mut self, key: &[u8]) -> &mut Batch {
        self.ops.push(Op::Delete { key: key.to_vec() });
        self
    }
    pub fn upsert(&mut self, key: &[u8], func: u16, arg: &[u8]) -> &mut Batch {
        self.ops.push(Op::Upsert {
            key: key.to_vec(),
            func,
            arg: arg.to_vec(),
        });
        self
    }
    pub fn delete_range(&mut self, start: &[u8], end: &[u8]) -> &mut Batch {
        self.ops.push(Op::DeleteRange {
            start: start.to_vec(),
            end: end.to_vec(),
        });
        self
    }
    pub fn rename_prefix(&mut self, from: &[u8], to: &[u8]) -> &mut Batch {
        self.ops.push(Op::RenamePrefix {
            from: from.to_vec(),
            to: to.to_vec(),
        });
        self
    }
    /// Clones every key under `from` to `to` (see [`Op::CloneRange`]).
    pub fn clone_prefix(&mut self, from: &[u8], to: &[u8]) -> &mut Batch {
        self.clone_range(from, to, b"", None)
    }
    /// Clones the keys `from + s`, `start <= s < end`, to `to + s` (see [`Op::CloneRange`]).
    pub fn clone_range(
        &mut self,
        from: &[u8],
        to: &[u8],
        start: &[u8],
        end: Option<&[u8]>,
    ) -> &mut Batch {
        self.ops.push(Op::CloneRange {
            from: from.to_vec(),
            to: to.to_vec(),
            start: start.to_vec(),
            end: end.map(<[u8]>::to_vec),
        });
        self
    }
}

/// Settings. The geometry fields (`node_bytes` to `log_blocks`) are fixed when the tree
/// is created and read from its header afterwards; the rest apply to each open.
#[derive(Clone, Debug)]
pub struct Options {
    /// Largest node on disk (a multiple of the block size, at most 4 MiB).
    pub node_bytes: usize,
    /// Target size of a leaf's basement (the unit a point query reads).
    pub basement_bytes: usize,
    /// Most children of an internal node.
    pub fanout: usize,
    /// Blocks of the redo log's ring.
    pub log_blocks: u64,
    /// Memory for cached nodes; clean nodes are evicted past it.
    pub cache_bytes: usize,
    /// Past this many bytes of dirty nodes, a checkpoint writes them.
    pub dirty_bytes: usize,
    /// The patch engine's block cache: node blocks being written, log blocks (node reads
    /// bypass it, the node cache holds what they decode to).
    pub engine_cache_bytes: usize,
    /// Largest delta of a leaf (see `node::Delta`): a flush into a leaf goes into its
    /// delta while the delta stays below this, and a checkpoint writes the delta
    /// alone; past it the leaf is read whole and rewritten. 0: never.
    pub delta_bytes: usize,
    /// Update functions for upserts (the built-ins are always there).
    pub upserts: Upserts,
    /// Bytes of a leaf a scan's first chunk takes; each next chunk takes twice as
    /// much, up to a whole leaf. A short scan (a thousand keys from a random place)
    /// then reads and copies little more than it returns, and a long one (a file
    /// read whole) soon reads whole leaves.
    pub scan_first_bytes: usize,
    /// Puts of values at least this long are logged by reference (late binding): the
    /// record holds the key, the value's length and checksum, and the value reaches
    /// the device once, in its node, at the next checkpoint; a sync that comes first
    /// logs the values it still owes (a bind record), so nothing synced is lost.
    /// `usize::MAX`: every value in its record.
    pub late_put_bytes: usize,
    /// A control for the crash explorer only: syncs leave the values of puts by
    /// reference unlogged (a log record that names data nothing made durable), which
    /// the explorer must catch as lost syncs.
    #[doc(hidden)]
    pub control_unbound_syncs: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            // Measured on this machine (docs/results/betree-2026-11-25): see
            // ARCHITECTURE.md for why these and not the papers' 4 MiB / 128 KiB.
            node_bytes: 256 << 10,
            basement_bytes: 4 << 10,
            fanout: 16,
            log_blocks: 4096,
            cache_bytes: 64 << 20,
            dirty_bytes: 48 << 20,
            engine_cache_bytes: 8 << 20,
            delta_bytes: 64 << 10,
            upserts: Upserts::default(),
            scan_first_bytes: 64 << 10,
            // Half a file system block: a whole 4 KiB block is a put by reference, a
            // small record (an inode, a name) stays in the log.
            late_put_bytes: 2048,
            control_unbound_syncs: false,
        }
    }
}

impl Options {
    /// Small nodes (8 blocks of 512 bytes), for tests that want many splits, merges and
    /// flushes.
    pub fn tiny() -> Options {
        Options {
            node_bytes: 4096,
            basement_bytes: 1024,
            fanout: 4,
            log_blocks: 64,
            cache_bytes: 64 << 10,
            dirty_bytes: 32 << 10,
            engine_cache_bytes: 1 << 20,
            delta_bytes: 2048,
            upserts: Upserts::default(),
            scan_first_bytes: 1024,
            late_put_bytes: 128,
            control_unbound_syncs: false,
        }
    }
}

/// See `Tree::format_versions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatVersions {
    pub header: u32,
    pub node_written: u16,
    pub table_written: u32,
}

/// Counters (see `Tree::stats`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    pub puts: u64,
    /// Puts logged by reference (`Options::late_put_bytes`), and the bytes of their
    /// values a sync logged after all (a bind record) because no checkpoint held them.
    pub late_puts: u64,
    pub late_bytes_bound: u64,
    pub deletes: u64,
    pub upserts: u64,
    pub range_deletes: u64,
    pub range_renames: u64,
    /// Subtrees a range rename moved whole (their edges got lifts).
    pub subtrees_moved: u64,
    /// Lifts pushed one level down (a merge of differently lifted children).
    pub lifts_pushed: u64,
    pub range_clones: u64,
    /// Subtrees a range delete covered whole, let go of without reading their leaves.
    pub subtrees_dropped: u64,
    /// Subtrees a range clone shared between its source and its destination.
    pub subtrees_shared: u64,
    /// Shared nodes copied because a change reached one of their places
    /// (copy-on-abundant-write), and the bytes of the copies.
    pub cow_copies: u64,
    pub cow_bytes: u64,
    /// Nodes referenced from more than one place now.
    pub shared_nodes: u64,
    pub batches: u64,
    pub gets: u64,
    pub scans: u64,
    /// Pieces the scans read (a leaf's window each).
    pub scan_chunks: u64,
    /// Leaves [`Tree::first_absent`] walked in place (nothing pending above them), and
    /// windows where it merged pending messages with a keys-only scan instead.
    pub absent_walks: u64,
    pub absent_merges: u64,
    /// Buffer flushes (parent → child), and the message bytes they moved.
    pub flushes: u64,
    pub flushed_bytes: u64,
    /// Of the flushes, those into a leaf's delta (the leaf was not rewritten); and
    /// deltas applied to their leaves (the leaf read whole and rewritten, or merged).
    pub delta_flushes: u64,
    pub delta_applies: u64,
    pub leaf_splits: u64,
    pub internal_splits: u64,
    pub merges: u64,
    /// Whole nodes read, and single basements read for queries.
    pub node_reads: u64,
    pub basement_reads: u64,
    /// Single message buffers read from internal nodes for queries, and those a point
    /// query did not need to read (their key filter ruled the key out).
    pub buffer_reads: u64,
    pub buffers_skipped: u64,
    pub node_writes: u64,
    pub node_bytes_written: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub evictions: u64,
    pub checkpoints: u64,
    /// Checkpoints that found no room for the nodes they write (the tree went on with
    /// them dirty; see `Tree::space`).
    pub checkpoints_failed: u64,
    /// Times a caller waited for the checkpoint in flight (it wrote faster than the
    /// checkpoint thread, or asked for a checkpoint).
    pub checkpoint_waits: u64,
    /// Nodes a change copied because the checkpoint in flight had not encoded them yet.
    pub checkpoint_copies: u64,
    pub syncs: u64,
    pub log_blocks_written: u64,
    pub log_bytes: u64,
    /// Upserts whose function failed at apply time (the value was left unchanged).
    pub upsert_failures: u64,
    /// Key and value bytes the caller inserted (puts and upsert arguments).
    pub user_bytes: u64,
    /// What the device below wrote, and its flushes.
    pub device_bytes_written: u64,
    pub device_flushes: u64,
    pub device_bytes_read: u64,
    /// `device_bytes_written / user_bytes`.
    pub write_amplification: f64,
    pub height: u64,
    pub nodes_cached: u64,
    pub cache_bytes: u64,
    /// Of which internal nodes (the rest is leaves).
    pub cache_internal_bytes: u64,
    pub dirty_bytes: u64,
}

/// Passes of [`Tree::compact`] at most: each pushes down what one checkpoint has room
/// for, so a nearly full device takes several.
pub const COMPACT_PASSES_MAX: usize = 256;

/// See [`Tree::space`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    /// Blocks for nodes and tables (the device less its headers and log).
    pub blocks: u64,
    /// Of which free now (extents a checkpoint still waits to free count as used).
    pub free: u64,
    /// What the next checkpoint may take at most: the dirty nodes' copies (their old
    /// extents are freed only once it is durable).
    pub pending: u64,
    /// Kept free beyond `pending` so that the checkpoint a change leads to always fits.
    pub margin: u64,
}

impl Space {
    /// Blocks that changes may still take: free, less what the next checkpoint needs.
    pub fn avail(&self) -> u64 {
        self.free.saturating_sub(self.pending + self.margin)
    }
}

/// A Bε-tree on a block device. Cheap operations take one internal lock; a checkpoint's
/// and a sync's device flushes run without it.
pub struct Tree {
    inner: Mutex<tree::Inner>,
    engine: Engine,
    /// The buffers of the last iterators dropped, for the next: a short scan's chunk is
    /// 100-300 KiB (a file read's, a megabyte), and a fresh one each scan is an
    /// allocation the allocator may meet with fresh (faulted, zeroed) pages. A few,
    /// for scans that run at once (a mount's request threads).
    spare_chunks: Mutex<Vec<chunk::Chunk>>,
}

/// The engine settings a tree with `opts` wants on a device of `block_size` bytes a
/// block. The wiring crate (`quilt-stack`) builds the engine from them; [`Tree::create`]
/// and [`Tree::open`] do the same for callers that hand the tree a bare device.
pub fn engine_options(block_size: usize, opts: &Options) -> EngineOptions {
    let cache = opts.engine_cache_bytes.max(1 << 20);
    let bs = block_size.max(512);
    EngineOptions {
        cache_bytes_max: cache,
        flush_interval_ms: None,
        // Every log block and every node is a patch: as many may be pending as the
        // cache holds blocks (the engine's default, tuned for a file system's small
        // changes, made a checkpoint or a long log tail write back in pieces, each
        // with its own flush).
        patches_live_max: EngineOptions::default()
            .patches_live_max
            .max(2 * cache / bs),
        ..EngineOptions::default()
    }
}

/// The engine [`engine_options`] describes, on `dev`.
pub fn engine_for(dev: Arc<dyn BlockDevice>, opts: &Options) -> Engine {
    let eo = engine_options(dev.block_size(), opts);
    Engine::new(dev, eo)
}

impl Tree {
    /// Makes a new, empty tree on `dev` (whatever it held is lost) and opens it.
    pub fn create(dev: Arc<dyn BlockDevice>, opts: Options) -> Result<Tree> {
        Tree::create_on(engine_for(dev, &opts), opts)
    }

    /// [`Tree::create`] on an engine built by the caller (the wiring crate), which the
    /// tree then owns: its cache and write-back serve the tree alone.
    pub fn create_on(engine: Engine, opts: Options) -> Result<Tree> {
        let inner = tree::Inner::create(engine.clone(), opts)?;
        Ok(Tree {
            inner: Mutex::new(inner),
            engine,
            spare_chunks: Mutex::default(),
        })
    }

    /// Opens the tree on `dev`: the newest valid header, then a replay of the log.
    pub fn open(dev: Arc<dyn BlockDevice>, opts: Options) -> Result<Tree> {
        Tree::open_on(engine_for(dev, &opts), opts)
    }

    /// [`Tree::open`] on an engine built by the caller (the wiring crate).
    pub fn open_on(engine: Engine, opts: Options) -> Result<Tree> {
        let inner = tree::Inner::open(engine.clone(), opts)?;
        Ok(Tree {
            inner: Mutex::new(inner),
            engine,
            spare_chunks: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, tree::Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tree's geometry.
    pub fn geometry(&self) -> Geometry {
        self.lock().geo
    }

    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut t = self.lock();
        let r = t.get(key);
        t.after_read();
        r
    }

    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(Batch {
            ops: vec![Op::Put {
                key: key.to_vec(),
                value: value.to_vec(),
            }],
        })
    }

    pub fn delete(&self, key: &[u8]) -> Result<()> {
        self.write(Batch {
            ops: vec![Op::Delete { key: key.to_vec() }],
        })
    }

    /// Applies the registered function `func` to the key's value, lazily: the message
    /// travels down the tree and meets the value at its leaf (or at a query).
    pub fn upsert(&self, key: &[u8], func: u16, arg: &[u8]) -> Result<()> {
        self.write(Batch {
            ops: vec![Op::Upsert {
                key: key.to_vec(),
                func,
                arg: arg.to_vec(),
            }],
        })
    }

    /// Deletes every key in `start..end` with one message.
    pub fn delete_range(&self, start: &[u8], end: &[u8]) -> Result<()> {
        self.write(Batch {
            ops: vec![Op::DeleteRange {
                start: start.to_vec(),
                end: end.to_vec(),
            }],
        })
    }

    /// Moves every key starting with `from` under `to` (see [`Op::RenamePrefix`]).
    pub fn rename_prefix(&self, from: &[u8], to: &[u8]) -> Result<()> {
        self.write(Batch {
            ops: vec![Op::RenamePrefix {
                from: from.to_vec(),
                to: to.to_vec(),
            }],
        })
    }

    /// Copies every key starting with `from` under `to`, sharing the tree's nodes (see
    /// [`Op::CloneRange`]).
    pub fn clone_prefix(&self, from: &[u8], to: &[u8]) -> Result<()> {
        let mut b = Batch::new();
        b.clone_prefix(from, to);
        self.write(b)
    }

    /// Applies a batch atomically (one log record). Not durable until `sync`.
    pub fn write(&self, batch: Batch) -> Result<()> {
        if self.write_behind(batch)? {
            self.catch_up()?;
        }
        Ok(())
    }

    /// [`Tree::write`] without its wait: applies and logs the batch, starts a checkpoint
    /// if one is due, and answers whether the writer is too far ahead of the one in
    /// flight. Then the writer owes the tree a [`Tree::catch_up`], which a caller with
    /// locks of its own makes after letting them go, so that the wait (a checkpoint's
    /// whole write-back) holds up no one else. Waits only when the log or the device has
    /// no room for the batch without the checkpoint in flight (`stats().checkpoint_waits`
    /// counts those).
    pub fn write_behind(&self, batch: Batch) -> Result<bool> {
        let mut t = self.lock();
        t.write(batch.ops)?;
        match t.maintain() {
            Ok(owes) => Ok(owes.is_some()),
            // The batch is in; see `catch_up`.
            Err(Error::Full(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits, without the tree's lock, until writers are no longer too far ahead of the
    /// checkpoint in flight (after [`Tree::write_behind`] answered `true`).
    pub fn catch_up(&self) -> Result<()> {
        loop {
            let mut t = self.lock();
            match t.maintain() {
                Ok(Some(done)) => {
                    drop(t);
                    let _ = done.wait();
                }
                Ok(None) => return Ok(()),
                // A checkpoint that found no room left the tree as it was (its nodes
                // dirty again); what needs room next is refused (`space`), and a
                // compaction or a later checkpoint catches up.
                Err(Error::Full(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// From here until [`Tree::release`], batches written are applied but not logged
    /// and no checkpoint runs; `release` logs them as one record, so a crash keeps all
    /// of them or none, and [`Tree::rollback`] forgets them. The held batches together
    /// are bounded as one batch is (a quarter of the log).
    pub fn hold(&self) -> Result<()> {
        self.lock().hold()
    }

    /// Logs the batches held since [`Tree::hold`] as one record.
    pub fn release(&self) -> Result<()> {
        self.lock().release()
    }

    /// Forgets the batches held since [`Tree::hold`]: the tree is opened again from what
    /// it logged before them (through the engine's cache, so batches logged and not
    /// yet durable are kept), as a crash would find it without them.
    pub fn rollback(&self) -> Result<()> {
        let mut t = self.lock();
        if !t.holding() {
            return Err(Error::Invalid("the tree holds no batches".into()));
        }
        // A checkpoint started before the hold writes extents the reopened tree would
        // think free: it ends first (its failure leaves the older header, which the
        // reopening reads).
        let _ = t.finish_checkpoint();
        let opts = t.opts.clone();
        let fresh = tree::Inner::open(self.engine.clone(), opts)?;
        *t = fresh;
        Ok(())
    }

    /// Makes every batch written so far durable. Callers syncing together share the
    /// device flush (group commit).
    pub fn sync(&self) -> Result<()> {
        let join = self.lock().sync_point()?;
        self.engine.flush_until(join)?;
        Ok(())
    }

    /// Writes every dirty node, the table and a header, and waits until they are durable.
    pub fn checkpoint(&self) -> Result<()> {
        let done = {
            let mut t = self.lock();
            t.start_checkpoint()?;
            t.checkpoint_done()
        };
        if let Some(done) = done {
            let _ = done.wait();
        }
        self.lock().finish_checkpoint()
    }

    /// Pushes every pending message down to the leaves (so that deleted keys free their
    /// space), then checkpoints: what a caller short of space does after deleting.
    ///
    /// On a full device it goes a piece at a time: it pushes messages down while a
    /// checkpoint of what it made dirty still fits in what is free, checkpoints (which
    /// frees the extents of what was deleted or rewritten), and goes on, until a pass
    /// finds nothing left to push (or after `COMPACT_PASSES_MAX` passes).
    pub fn compact(&self) -> Result<()> {
        for _ in 0..COMPACT_PASSES_MAX {
            let walk = {
                let mut t = self.lock();
                t.finish_checkpoint()?;
                let budget = t.free_blocks().saturating_sub(t.margin_blocks());
                t.flush_all(budget)?
            };
            if !walk.changed {
                return Ok(());
            }
            self.checkpoint()?;
        }
        Ok(())
    }

    /// A checkpoint, then the tree is closed (the next open replays nothing).
    pub fn close(self) -> Result<()> {
        self.lock().close()
    }

    /// Keys in `lo..hi` (`hi: None`: to the end) in ascending order. The iterator reads
    /// the tree a leaf at a time; changes made meanwhile may or may not be seen.
    pub fn range(&self, lo: &[u8], hi: Option<&[u8]>) -> Iter<'_> {
        Iter::new(self, lo, hi, true)
    }

    /// Keys in `lo..hi` in descending order.
    pub fn range_rev(&self, lo: &[u8], hi: Option<&[u8]>) -> Iter<'_> {
        Iter::new(self, lo, hi, false)
    }

    /// The keys in `lo..hi` in ascending order, each with its value's length, without
    /// the values: a leaf on disk is read for its index only where its basements hold
    /// one entry each (a file system's data blocks), so a scan over a gigabyte of
    /// values reads a few megabytes. Messages pending above the leaves are applied as
    /// in [`Tree::range`]; a registered upsert among them makes the scan read the
    /// values it changes.
    pub fn keys(&self, lo: &[u8], hi: Option<&[u8]>) -> Keys<'_> {
        let mut it = Iter::new(self, lo, hi, true);
        it.keys_only = true;
        Keys(it)
    }

    /// The first `n` in `from..to` whose key `prefix ‖ n` (`n` in eight big-endian
    /// bytes, as a file's block keys) is absent, or `to` when every one is present:
    /// SEEK_HOLE over a file's blocks. A leaf with nothing pending for its keys above
    /// it (or in its delta) is walked in place, a comparison per key and its basements
    /// of one entry unread; where messages are pending a keys-only scan merges them.
    pub fn first_absent(&self, prefix: &[u8], from: u64, to: u64) -> Result<u64> {
        let mut n = from;
        while n < to {
            let step = {
                let mut t = self.lock();
                let r = t.absent_chunk(prefix, n, to);
                t.after_read();
                r?
            };
            n = match step {
                tree::AbsentStep::Found(m) => return Ok(m.min(to)),
                tree::AbsentStep::Next(m) if m > n => m,
                tree::AbsentStep::Next(_) => {
                    return Err(Error::Corrupt(format!(
                        "a search for absent keys made no progress at {n}: the tree's pivots contradict each other"
                    )))
                }
                tree::AbsentStep::Merge { from: s, until } => {
                    self.lock().stats.absent_merges += 1;
                    let mut next = s;
                    let mut keys = self.keys(&numbered_key(prefix, s), Some(&until));
                    while let Some(k) = keys.next_key() {
                        let (k, _) = k?;
                        match key_number(prefix, k) {
                            Some(m) if m == next => next += 1,
                            Some(_) => return Ok(next.min(to)),
                            None => {}
                        }
                    }
                    // (`until` is past `prefix ‖ n`: progress, or an answer.)
                    match tree::AbsentStep::settled(prefix, next, to, &until) {
                        tree::AbsentStep::Found(m) => return Ok(m.min(to)),
                        _ => next,
                    }
                }
            };
        }
        Ok(to)
    }

    pub fn stats(&self) -> Stats {
        self.lock().stats()
    }

    /// The on-disk format versions: of the newest header (as read at open, or as the
    /// last checkpoint wrote it), and of what this build writes for nodes and tables.
    pub fn format_versions(&self) -> FormatVersions {
        FormatVersions {
            header: self.lock().header_version,
            node_written: node::VERSION,
            table_written: format::TABLE_VERSION,
        }
    }

    /// Checks the whole tree's invariants (pivot order, keys within their node's range,
    /// buffer rule, heights), reading every node. For tests.
    pub fn check(&self) -> Result<()> {
        self.lock().check()
    }

    /// Bytes of dirty nodes past which a checkpoint writes them (`Options::dirty_bytes`):
    /// what a checkpoint may need in free space at most.
    pub fn dirty_limit(&self) -> usize {
        self.lock().opts.dirty_bytes
    }

    /// Blocks for nodes and tables, how many are free, and what the next checkpoint
    /// needs of them (see [`Space`]).
    pub fn space(&self) -> Space {
        let t = self.lock();
        Space {
            blocks: t
                .geo
                .data_end(self.engine.block_count())
                .saturating_sub(t.geo.data_first()),
            free: self.engine.writable_blocks(t.free_blocks()),
            pending: t.pending_blocks(),
            margin: t.margin_blocks(),
        }
    }

    /// Damage to the header blocks found when the tree was opened that lost nothing
    /// (see `Inner::open`): what `fsck` reports, and `repair_headers` rewrites.
    pub fn damage(&self) -> Vec<String> {
        self.lock().damage.clone()
    }

    /// Rewrites both header slots and the mirror (two checkpoints).
    pub fn repair_headers(&self) -> Result<()> {
        self.checkpoint()?;
        self.checkpoint()?;
        self.lock().damage.clear();
        Ok(())
    }

    /// The patch engine below (for the crash explorer's marks, and tests).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

/// Ordered iteration over a key range (see [`Tree::range`]).
pub struct Iter<'a> {
    tree: &'a Tree,
    lo: Vec<u8>,
    hi: Option<Vec<u8>>,
    forward: bool,
    /// Forward: the next key to read from. Backward: the bound (exclusive) to read
    /// below; `None` with `started` means "from the top".
    cursor: Option<Vec<u8>>,
    started: bool,
    done: bool,
    chunk: chunk::Chunk,
    /// Entries of `chunk` not returned yet: forward `taken..len`, backward `..len - taken`.
    taken: usize,
    /// Bytes of a leaf the next chunk takes at most (`Options::scan_first_bytes`, then
    /// doubling; 0 before the first).
    reach: usize,
    /// Entries still to return, under [`Iter::limit`].
    left: Option<usize>,
    /// Keys and value lengths only ([`Tree::keys`]).
    keys_only: bool,
}

impl<'a> Iter<'a> {
    fn new(tree: &'a Tree, lo: &[u8], hi: Option<&[u8]>, forward: bool) -> Iter<'a> {
        let empty = hi.is_some_and(|h| h <= lo);
        Iter {
            tree,
            lo: lo.to_vec(),
            hi: hi.map(<[u8]>::to_vec),
            forward,
            cursor: if forward {
                Some(lo.to_vec())
            } else {
                hi.map(<[u8]>::to_vec)
            },
            started: false,
            done: empty,
            chunk: chunk::Chunk::default(),
            taken: 0,
            reach: 0,
            left: None,
            keys_only: false,
        }
    }

    /// Returns at most `n` entries, and reads the tree for about that many: a chunk is
    /// as many basements as hold the entries still wanted, where an iterator that
    /// cannot know how far it will go reads a few basements, then twice as many.
    pub fn limit(mut self, n: usize) -> Iter<'a> {
        self.left = Some(n);
        self.done |= n == 0;
        self
    }
}

impl Iter<'_> {
    /// Makes sure the chunk has an entry left, reading the next one if need be. `false`
    /// at the end (or after an error, which is returned once).
    fn fill(&mut self) -> Result<bool> {
        while self.taken == self.chunk.len() {
            if self.done {
                return Ok(false);
            }
            if !self.started {
                // The largest spare (they are kept smallest first).
                if let Some(c) = self
                    .tree
                    .spare_chunks
                    .try_lock()
                    .ok()
                    .and_then(|mut s| s.pop())
                {
                    self.chunk = c;
                }
            }
            let mut t = self.tree.lock();
            if !self.started {
                t.stats.scans += 1;
                self.started = true;
                self.reach = t.opts.scan_first_bytes;
            }
            t.stats.scan_chunks += 1;
            let r = t.scan_chunk(
                &self.lo,
                self.hi.as_deref(),
                self.forward,
                self.cursor.as_deref(),
                self.reach,
                self.left,
                self.keys_only,
                &mut self.chunk,
            );
            self.reach = (self.reach * 2).clamp(1, t.geo.node_bytes);
            t.after_read();
            drop(t);
            match r {
                Err(e) => {
                    self.done = true;
                    self.chunk.clear();
                    self.taken = 0;
                    return Err(e);
                }
                Ok(next) => {
                    self.taken = 0;
                    match next {
                        Some(c) => {
                            // A chunk that found nothing must still move the cursor on:
                            // on a damaged tree (pivots or lifts that contradict each
                            // other) it may not, and the scan would spin for ever
                            // (found by fuzzing).
                            let stuck = self.chunk.len() == 0
                                && self.cursor.as_deref().is_some_and(|old| {
                                    if self.forward {
                                        c.as_slice() <= old
                                    } else {
                                        c.as_slice() >= old
                                    }
                                });
                            if stuck {
                                self.done = true;
                                return Err(Error::Corrupt(format!(
                                    "a scan made no progress at key {:?}: the tree's pivots contradict each other",
                                    String::from_utf8_lossy(&c)
                                )));
                            }
                            self.cursor = Some(c)
                        }
                        None => self.done = true,
                    }
                }
            }
        }
        Ok(true)
    }

    /// The next entry, lent rather than copied (valid until the next call): a scan
    /// that only looks at its entries allocates nothing per entry.
    pub fn next_entry(&mut self) -> Option<Result<(&[u8], &[u8])>> {
        match self.advance()? {
            Err(e) => Some(Err(e)),
            Ok(i) => Some(Ok(self.chunk.get(i))),
        }
    }

    /// Moves to the next entry and returns its place in the chunk (reading the next
    /// chunk if need be); `None` at the end or past the limit.
    fn advance(&mut self) -> Option<Result<usize>> {
        if self.left == Some(0) {
            return None;
        }
        match self.fill() {
            Err(e) => return Some(Err(e)),
            Ok(false) => return None,
            Ok(true) => {}
        }
        if let Some(left) = &mut self.left {
            *left -= 1;
        }
        let i = if self.forward {
            self.taken
        } else {
            self.chunk.len() - 1 - self.taken
        };
        self.taken += 1;
        Some(Ok(i))
    }
}

/// `prefix ‖ n`, `n` in eight big-endian bytes ([`Tree::first_absent`]'s keys).
pub(crate) fn numbered_key(prefix: &[u8], n: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 8);
    k.extend_from_slice(prefix);
    k.extend_from_slice(&n.to_be_bytes());
    k
}

/// `n` of a key `prefix ‖ n`; `None` for a key of another shape.
pub(crate) fn key_number(prefix: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(prefix)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// Ordered keys of a range with their values' lengths (see [`Tree::keys`]).
pub struct Keys<'a>(Iter<'a>);

impl Keys<'_> {
    /// Returns at most `n` keys (as [`Iter::limit`]).
    pub fn limit(self, n: usize) -> Self {
        Keys(self.0.limit(n))
    }

    /// The next key, lent rather than copied (valid until the next call), and its
    /// value's length.
    pub fn next_key(&mut self) -> Option<Result<(&[u8], usize)>> {
        let it = &mut self.0;
        match it.advance()? {
            Err(e) => Some(Err(e)),
            Ok(i) => Some(Ok((it.chunk.get(i).0, it.chunk.value_len(i)))),
        }
    }
}

impl Iterator for Keys<'_> {
    type Item = Result<(Vec<u8>, usize)>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_key().map(|r| r.map(|(k, l)| (k.to_vec(), l)))
    }
}

/// Spare chunks a tree keeps (see `Tree::spare_chunks`).
const SPARE_CHUNKS: usize = 4;

impl Drop for Iter<'_> {
    fn drop(&mut self) {
        // (A chunk that held a huge value is not worth keeping; nor is one never used.)
        let cap = self.chunk.capacity();
        if cap > 0 && cap <= 4 << 20 {
            if let Ok(mut s) = self.tree.spare_chunks.try_lock() {
                let mut c = std::mem::take(&mut self.chunk);
                c.clear();
                let at = s.partition_point(|x| x.capacity() <= cap);
                s.insert(at, c);
                if s.len() > SPARE_CHUNKS {
                    s.remove(0);
                }
            }
        }
    }
}

impl Iterator for Iter<'_> {
    type Item = Result<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_entry()
            .map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())))
    }
}

/// The block size of the Bε-tree whose first 128 KiB are `prefix`, if it holds one (a
/// valid header in slot 0 or slot 1, whatever the block size). For tools that must tell
/// a tree image from other images.
pub fn probe_block_size(prefix: &[u8]) -> Option<usize> {
    let at = |off: usize| {
        prefix
            .get(off..)
            .and_then(|b| format::Header::decode(b).ok().flatten())
    };
    if let Some(h) = at(0) {
        return Some(h.geo.block_size);
    }
    (9..=16)
        .map(|s| 1usize << s)
        .find(|&bs| at(bs).is_some_and(|h| h.geo.block_size == bs))
}
