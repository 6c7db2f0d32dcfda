//! The block cache and patch creation: how a change becomes a patch (new, merged into an
//! overlapping patch, or folded into the block's hard patch) and how its dependencies are
//! wired. Write-back lives in `epoch.rs`, patchgroups in `patchgroup.rs`.

use crate::graph::{Graph, Kind, Patch, PatchId};
use crate::patchgroup::{CallerId, Patchgroups};
use crate::stats::EngineStats;
use crate::{PatchError, Result};
use quilt_block::BlockDeviceExt;
use quilt_block::{BlockDevice, BlockNo};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Whether write-back waits for the device to make writes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// A device flush ends every epoch; patches are durable only after it (the default).
    #[default]
    Safe,
    /// No flushes: order is kept against process crashes only. For comparisons, as the
    /// papers report both.
    Unsafe,
}

/// Engine settings. The two optimizations have switches because the benchmarks compare
/// all four combinations.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Hard patches: a block no other block depends on gets one whole-block patch with no
    /// undo bytes, and later changes fold into it.
    pub hard_patches: bool,
    /// Overlap merging: a change overlapping exactly one pending patch folds into it when
    /// that cannot create a cycle.
    pub overlap_merge: bool,
    pub durability: Durability,
    /// Memory budget for cached blocks. Clean blocks are evicted past it; if dirty blocks
    /// alone exceed it, changes trigger write-back. Blocks pinned by unreleased
    /// patchgroups may exceed it.
    pub cache_bytes_max: usize,
    /// Background write-back interval; None for no flusher thread.
    pub flush_interval_ms: Option<u64>,
    /// Past this many pending patches, a change first writes back what is ready (like the
    /// kernel's dirty throttling). Bounds the graph, and with it the cost of each epoch:
    /// without it, patches outside every fsync's closure pile up between flusher runs
    /// and are rolled back again by every epoch that writes their blocks.
    pub patches_live_max: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            hard_patches: true,
            overlap_merge: true,
            durability: Durability::Safe,
            cache_bytes_max: 64 << 20,
            flush_interval_ms: None,
            patches_live_max: 8192,
        }
    }
}

/// Per-change options.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChangeOpts {
    /// Who makes the change: its engaged patchgroups order it.
    pub caller: Option<CallerId>,
    /// The change is file data, not metadata.
    pub data: bool,
}

/// Bounds the reachability search that guards merges: past it a merge is refused, which
/// costs a patch but never correctness.
const MERGE_CYCLE_SEARCH_LIMIT: usize = 64;
/// Hinted blocks remembered (`State::hinted`): 256 MiB of 4 KiB blocks, more than the
/// host keeps of a hint's reads for long on a busy machine.
const HINTED_MAX: usize = 1 << 16;

/// The most blocks one run patch covers (`Engine::write_run`): 4 MiB of 4 KiB blocks. A
/// run is written in one epoch, so this bounds the images one epoch holds for it.
pub const RUN_BLOCKS_MAX: u32 = 1024;

/// An edge onto an unheld empty patch with at most this many pending befores becomes edges
/// onto them (`State::add_edge`). Joins of a few heads are the common case; an empty with
/// many befores (a transaction's "done", a patchgroup's head) keeps one edge, so that
/// depending on it costs O(1).
const LOOKTHROUGH_MAX: usize = 8;

#[derive(Debug)]
pub(crate) struct CachedBlock {
    /// Shared with an epoch's image while the block is being written, so that writing a
    /// block whose image needs no rollback copies nothing; a change made meanwhile copies
    /// it first (see `data_mut`).
    pub data: crate::BlockBuf,
    /// Pending patches on this block in creation order (in-flight ones included).
    pub pending: Vec<PatchId>,
    /// The pending patches an overlap search must look at: a patch fully covered by a
    /// newer one is dropped, since anything overlapping it overlaps the newer one.
    pub overlap_index: crate::overlap::OverlapIndex,
    /// Dependency edges from patches off this block onto patches on it. Zero means no
    /// other block waits for this one, so its changes need no undo bytes.
    pub extern_afters: u64,
    /// The block's hard patch while it is pending and not being written.
    pub hard: Option<PatchId>,
    pub last_use: u64,
}

/// How `State::load` fills a block that is not cached.
#[derive(Clone, Copy)]
pub(crate) enum Init<'a> {
    /// From the device.
    Read,
    /// Zeros, unread: the caller overwrites the whole block.
    Zero,
    /// These bytes, unread: the caller writes exactly them over the whole block.
    Bytes(&'a [u8]),
}

/// The change a caller asks for, before it becomes a patch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change<'a> {
    Bytes { offset: usize, bytes: &'a [u8] },
    Zero,
    Xor { offset: usize, xor: u32 },
}

impl CachedBlock {
    /// The block's bytes for changing, copied first if an epoch still holds them.
    /// A block as read or written, with no pending patch.
    fn new(data: crate::BlockBuf) -> CachedBlock {
        CachedBlock {
            data,
            pending: Vec::new(),
            overlap_index: Default::default(),
            extern_afters: 0,
            hard: None,
            last_use: 0,
        }
    }

    pub fn data_mut(&mut self) -> &mut [u8] {
        if Arc::get_mut(&mut self.data).is_none() {
            self.data = crate::block_buf(self.data.to_vec());
        }
        Arc::get_mut(&mut self.data).expect("just made unique")
    }
}

impl Change<'_> {
    fn range(&self, block_size: usize) -> (usize, usize) {
        match *self {
            Change::Bytes { offset, bytes } => (offset, offset + bytes.len()),
            Change::Zero => (0, block_size),
            Change::Xor { offset, .. } => (offset, offset + 4),
        }
    }
    /// Whether making this change on a block that is not cached reads it first (a
    /// whole-block change with hard patches on needs no old contents; see `State::change`).
    fn needs_old(&self, bs: usize, hard_patches: bool) -> bool {
        let whole = matches!(self, Change::Zero)
            || matches!(self, Change::Bytes { offset: 0, bytes } if bytes.len() == bs);
        !(whole && hard_patches)
    }
    fn apply(&self, data: &mut [u8]) {
        match *self {
            Change::Bytes { offset, bytes } => {
                data[offset..offset + bytes.len()].copy_from_slice(bytes)
            }
            Change::Zero => data.fill(0),
            Change::Xor { offset, xor } => xor_word(data, offset, xor),
        }
    }
}

pub(crate) fn xor_word(data: &mut [u8], offset: usize, xor: u32) {
    let w = &mut data[offset..offset + 4];
    let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ xor;
    w.copy_from_slice(&v.to_le_bytes());
}

pub(crate) struct State {
    pub g: Graph,
    pub blocks: HashMap<BlockNo, CachedBlock>,
    pub dirty: BTreeSet<BlockNo>,
    /// Blocks by last use, for eviction.
    pub lru: BTreeMap<u64, BlockNo>,
    pub tick: u64,
    pub seq: u64,
    pub cached_bytes: usize,
    pub stats: EngineStats,
    pub pgs: Patchgroups,
    /// Blocks that may carry a ready patch: every block holding a pending patch whose
    /// waits are 0 is here (checked by `check_invariants`). An epoch looks only at these,
    /// and takes out each block it looks at; a patch whose waits drop to 0 puts its block
    /// back. So an epoch's cost follows the blocks it can write, not the dirty set.
    pub candidates: BTreeSet<BlockNo>,
    /// Blocks put among the candidates by `satisfy` since the last epoch began (see
    /// `write_back_ready`).
    pub woken: Vec<BlockNo>,
    /// For an unheld empty patch: the patches that were given its befores instead of an
    /// edge onto it (see `add_edge`). A before added to the empty later must reach them.
    pub lookthrough: HashMap<PatchId, Vec<PatchId>>,
    /// Set by a failed write-back; every later change or epoch is refused.
    pub failed: Option<String>,
    /// Live patches and dirty blocks left after the last full write-back: what could
    /// not be written then. The write-back limits count above it (`keep_budget`).
    pub held_floor: (usize, usize),
    /// The open transaction capture, if a journal is above (`capture.rs`).
    pub(crate) capture: Option<crate::capture::Capture>,
    /// Blocks some thread is reading from the device outside the lock (`lock_cached`):
    /// others wanting them wait for that read instead of issuing their own.
    pub reading: HashSet<BlockNo>,
    /// Blocks recently hinted to the device (`will_need`), so that a hint is given once
    /// and not again on every access that finds the block still uncached. Cleared
    /// whole at [`HINTED_MAX`].
    pub hinted: HashSet<BlockNo>,
    /// Buffers of evicted blocks, reused for blocks coming in. An eviction frees an
    /// eighth of the cache at once and the next writes fill it again: through the
    /// allocator, each refill paged fresh memory in (it had given the freed pages back),
    /// a third of a file write's time in the untar. Bounded by that eighth (`evict`).
    pub spare: Vec<Box<[u8]>>,
}

pub(crate) struct Shared {
    pub st: Mutex<State>,
    /// Serialises epochs: at most one set of block images is in flight.
    pub epoch: Mutex<()>,
    pub dev: Arc<dyn BlockDevice>,
    pub opts: EngineOptions,
    pub block_size: usize,
    pub stop: (Mutex<bool>, Condvar),
    pub flusher_running: AtomicBool,
    /// The flusher thread, joined by `stop_flusher`: the thread holds the engine (and
    /// with it the device and the image's lock) until it has ended.
    pub flusher: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set by a change that found the cache or the graph past half its limit: the
    /// flusher starts an early round instead of waiting for its interval.
    pub kicked: AtomicBool,
    /// Operations in flight, and whether a transaction is closing (`services.rs`).
    pub gate: Mutex<Gate>,
    pub gate_cv: Condvar,
    /// Signalled when a block read outside the state lock (`lock_cached`) is in.
    pub read_cv: Condvar,
}

/// The operation boundary: a transaction closes only while no operation is in flight.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    pub in_flight: usize,
    pub closing: bool,
}

thread_local! {
    /// Ops this thread has open (on any engine): a nested op must not wait for a close
    /// that its outer op holds up.
    static OPS_HELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Inside `without_io`: a block that is not cached is not read; the access fails
    /// and the block is remembered in `MISSED`.
    static NO_IO: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static MISSED: std::cell::Cell<Option<BlockNo>> = const { std::cell::Cell::new(None) };
    /// A change inside an op found the cache or the graph over its limit: the
    /// write-back is run when the thread's outermost op ends, with the module's locks
    /// released (`Engine::throttle_due`).
    static THROTTLE_DUE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Device reads made by this thread (a module counts those made under its locks).
    static THREAD_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The buffer `Engine::prefetch` reads runs into, kept so that a read costs no
    /// allocation (and no page faults) after the first.
    static PREFETCH_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The longest run of blocks `Engine::prefetch` reads in one device request (1 MiB of
/// 4 KiB blocks: the largest FUSE read).
const PREFETCH_RUN: u64 = 256;

/// A block-sized buffer, a spare one (`State::spare`) if there is one. Its contents are
/// arbitrary: the caller fills all of it. (A function of the spares alone, so that it
/// can be called while another field of the state is borrowed, and on a guard.)
fn take_spare(spare: &mut Vec<Box<[u8]>>, block_size: usize) -> Box<[u8]> {
    match spare.pop() {
        Some(b) if b.len() == block_size => b,
        _ => vec![0u8; block_size].into_boxed_slice(),
    }
}

/// A block buffer holding a copy of `bytes` (a whole block), in a spare buffer if there
/// is one.
fn spare_copy(spare: &mut Vec<Box<[u8]>>, bytes: &[u8]) -> crate::BlockBuf {
    let mut b = take_spare(spare, bytes.len());
    b.copy_from_slice(bytes);
    Arc::new(b)
}

/// How many times a read outside the lock is retried when blocks were evicted while it
/// ran (its copy might predate a write-back) before reading under the lock.
const READ_RETRIES: usize = 3;

/// The patch engine: block cache, patch graph, write-back and patchgroups.
#[derive(Clone)]
pub struct Engine {
    pub(crate) sh: Arc<Shared>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("opts", &self.sh.opts)
            .finish()
    }
}

impl Engine {
    pub fn new(dev: Arc<dyn BlockDevice>, opts: EngineOptions) -> Engine {
        let block_size = dev.block_size();
        let engine = Engine {
            sh: Arc::new(Shared {
                st: Mutex::new(State {
                    g: Graph::default(),
                    blocks: HashMap::default(),
                    dirty: BTreeSet::new(),
                    lru: BTreeMap::new(),
                    tick: 0,
                    seq: 0,
                    cached_bytes: 0,
                    stats: EngineStats::default(),
                    pgs: Patchgroups::default(),
                    candidates: BTreeSet::new(),
                    woken: Vec::new(),
                    lookthrough: HashMap::default(),
                    failed: None,
                    held_floor: (0, 0),
                    capture: None,
                    reading: HashSet::default(),
                    hinted: HashSet::default(),
                    spare: Vec::new(),
                }),
                epoch: Mutex::new(()),
                dev,
                opts,
                block_size,
                stop: (Mutex::new(false), Condvar::new()),
                flusher_running: AtomicBool::new(false),
                flusher: Mutex::new(None),
                kicked: AtomicBool::new(false),
                gate: Mutex::new(Gate::default()),
                gate_cv: Condvar::new(),
                read_cv: Condvar::new(),
            }),
        };
        if let Some(ms) = engine.sh.opts.flush_interval_ms {
            engine.start_flusher(Duration::from_millis(ms.max(1)));
        }
        engine
    }

    pub fn options(&self) -> &EngineOptions {
        &self.sh.opts
    }
    pub fn block_size(&self) -> usize {
        self.sh.block_size
    }
    pub fn block_count(&self) -> u64 {
        self.sh.dev.block_count()
    }
    /// Makes sure the device has storage behind blocks `first..first + count` (see
    /// `BlockDevice::reserve`): a file system calls it as it allocates, so that a full
    /// host disk fails the operation that needed the blocks, not a later write-back.
    pub fn reserve(&self, first: u64, count: u64) -> Result<(), PatchError> {
        self.device()
            .reserve(first, count)
            .map_err(PatchError::Block)
    }

    /// Of `free` blocks a file system has free, how many can surely be written (see
    /// `HostRoom::writable`): all of them unless the device's host may run out first.
    pub fn writable_blocks(&self, free: u64) -> u64 {
        let bs = self.block_size() as u64;
        match self.device().host_room() {
            Some(r) => r.writable(free.saturating_mul(bs)) / bs,
            None => free,
        }
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.sh.dev
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.sh.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.sh.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An operation starts: waits while a transaction is closing, unless this thread
    /// already has an op open (it would wait for itself).
    pub(crate) fn op_enter(&self) {
        let nested = OPS_HELD.with(|n| {
            let held = n.get();
            n.set(held + 1);
            held > 0
        });
        let mut g = self.gate();
        while g.closing && !nested {
            g = self.sh.gate_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.in_flight += 1;
    }

    /// An operation ends. Returns whether it was the thread's outermost one.
    pub(crate) fn op_leave(&self) -> bool {
        let outermost = OPS_HELD.with(|n| {
            let held = n.get().saturating_sub(1);
            n.set(held);
            held == 0
        });
        let mut g = self.gate();
        debug_assert!(g.in_flight > 0, "op_leave without op_enter");
        g.in_flight = g.in_flight.saturating_sub(1);
        if g.in_flight == 0 && g.closing {
            self.sh.gate_cv.notify_all();
        }
        outermost
    }

    /// Runs `f` with no operation in flight and new ones held back: a transaction closed
    /// in `f` holds whole operations. Must not be called from inside an op.
    pub(crate) fn quiesced<R>(&self, f: impl FnOnce() -> R) -> R {
        debug_assert_eq!(
            OPS_HELD.with(|n| n.get()),
            0,
            "a transaction closed from inside an operation would wait for itself"
        );
        let mut g = self.gate();
        while g.closing {
            g = self.sh.gate_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.closing = true;
        while g.in_flight > 0 {
            g = self.sh.gate_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        drop(g);
        let r = f();
        self.gate().closing = false;
        self.sh.gate_cv.notify_all();
        r
    }

    /// The newest contents of `block` (pending patches included).
    pub fn read(&self, block: BlockNo) -> Result<Vec<u8>> {
        self.with_block(block, |d| d.to_vec())
    }

    /// Runs `f` on the newest contents of `block` without copying it.
    pub fn with_block<R>(&self, block: BlockNo, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let mut st = self.lock_cached(block)?;
        let r = f(&st.load(&self.sh, block, Init::Read)?.data);
        // A read adds nothing dirty: it may evict clean blocks, never write back.
        st.evict(self.sh.opts.cache_bytes_max);
        Ok(r)
    }

    /// The state lock, with `block` in the cache. A block that is not cached is read from
    /// the device *without* the lock held (a cache miss must not stall every other user
    /// of the engine), by one thread at a time: others wanting it wait for that read.
    /// Inside `without_io` a miss is not read: it fails with `PatchError::Miss`.
    fn lock_cached(&self, block: BlockNo) -> Result<MutexGuard<'_, State>> {
        let count = self.sh.dev.block_count();
        let mut st = self.lock();
        let mut retries = 0;
        loop {
            if st.blocks.contains_key(&block) || block >= count {
                // (Out of range: `load` reports it.)
                return Ok(st);
            }
            if NO_IO.with(|n| n.get()) {
                MISSED.with(|m| m.set(Some(block)));
                return Err(PatchError::Miss(block));
            }
            if retries >= READ_RETRIES {
                // Evictions kept racing the read: `load` reads under the lock.
                return Ok(st);
            }
            if st.reading.contains(&block) {
                st = self.sh.read_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            st.reading.insert(block);
            let evictions = st.stats.evictions;
            let mut data = take_spare(&mut st.spare, self.sh.block_size);
            drop(st);
            let read = self.sh.dev.read(block, &mut data);
            THREAD_READS.with(|n| n.set(n.get() + 1));
            st = self.lock();
            st.reading.remove(&block);
            self.sh.read_cv.notify_all();
            read?;
            // Someone may have cached it meanwhile (a whole-block write of a fresh block:
            // theirs is newer). If blocks were evicted while the read ran, this one may
            // have been cached, changed, written back and evicted meanwhile, and the copy
            // read may predate that: read again.
            if !st.blocks.contains_key(&block) {
                if st.stats.evictions != evictions {
                    retries += 1;
                    continue;
                }
                st.insert_block(block, Arc::new(data));
            }
            return Ok(st);
        }
    }

    /// Fills `out` with the newest contents of blocks `first..first + out.len() / block
    /// size` without caching the ones that are not cached: those have no pending patch,
    /// so the device holds their newest contents, and they are read from it without the
    /// lock. For a module that caches what it decodes from the blocks (the Bε-tree's
    /// nodes): caching the raw blocks too would only spend the cache twice. A block
    /// changed by another thread meanwhile may be returned in either version; the caller
    /// orders its reads and writes of a block itself.
    pub fn read_uncached(&self, first: BlockNo, out: &mut [u8]) -> Result<()> {
        if out.len() % self.sh.block_size != 0 {
            return Err(PatchError::Invalid("a read is a whole number of blocks"));
        }
        self.read_part_uncached(first, 0, out)
    }

    /// Reads `out.len()` bytes from `skip` bytes into block `first` on, as
    /// [`read_uncached`](Self::read_uncached) does (the engine's copy of a block it holds,
    /// the device for the others), but only those bytes: a Bε-tree basement of 4 KiB
    /// usually spans two blocks, and reading them whole doubled what a point query
    /// copied.
    pub fn read_part_uncached(&self, first: BlockNo, skip: usize, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let bs = self.sh.block_size;
        let end = skip + out.len();
        let n = end.div_ceil(bs) as u64;
        let count = self.sh.dev.block_count();
        if first.checked_add(n).is_none_or(|e| e > count) {
            return Err(quilt_block::BlockError::OutOfRange {
                block: first.saturating_add(n.saturating_sub(1)),
                count,
            }
            .into());
        }
        // The part of block `i` of the span, in span bytes.
        let part = |i: usize| (skip.max(i * bs), end.min((i + 1) * bs));
        let mut missing: Vec<u64> = Vec::new();
        {
            let st = self.lock();
            for i in skip / bs..n as usize {
                let (a, b) = part(i);
                match st.blocks.get(&(first + i as u64)) {
                    Some(c) => {
                        out[a - skip..b - skip].copy_from_slice(&c.data[a - i * bs..b - i * bs])
                    }
                    None => missing.push(i as u64),
                }
            }
        }
        // Each run of consecutive missing blocks is one device request (a node is read
        // whole or a basement at a time: one pread instead of one per block).
        for r in consecutive_runs(&missing, usize::MAX) {
            let (i, j) = (
                missing[r.start] as usize,
                missing[r.start] as usize + r.len() - 1,
            );
            let (a, b) = (part(i).0, part(j).1);
            self.sh
                .dev
                .read_part(first + i as u64, a - i * bs, &mut out[a - skip..b - skip])?;
            THREAD_READS.with(|t| t.set(t.get() + r.len() as u64));
        }
        Ok(())
    }

    /// Runs `f` with device reads forbidden on this thread: an access to a block that is
    /// not cached fails (`PatchError::Miss`) instead of reading it. Returns `f`'s result
    /// and the first block missed, if any; the caller, holding no lock, reads it with
    /// [`Engine::prefetch`] and runs `f` again. A module holding a lock while it reads
    /// its metadata uses this so the lock is never held across device I/O.
    pub fn without_io<R>(&self, f: impl FnOnce() -> R) -> (R, Option<BlockNo>) {
        let outer = NO_IO.with(|n| n.replace(true));
        MISSED.with(|m| m.set(None));
        let r = f();
        NO_IO.with(|n| n.set(outer));
        (r, MISSED.with(|m| m.take()))
    }

    /// Brings `block` and up to `count - 1` blocks after it into the cache (those not
    /// cached yet), reading without the state lock.
    ///
    /// Consecutive blocks that nobody has cached or is reading are read in one device
    /// request (a 1 MiB file read was 256 reads of 4 KiB, each a system call), into a
    /// buffer this thread keeps for the next prefetch.
    pub fn prefetch(&self, block: BlockNo, count: u64) -> Result<()> {
        let end = block
            .saturating_add(count.max(1))
            .min(self.sh.dev.block_count());
        // (A block past the end is not read here; the access itself reports it.)
        let bs = self.sh.block_size;
        let mut b = block;
        while b < end {
            let (run, evictions) = {
                let mut st = self.lock();
                let free = |st: &State, x: BlockNo| {
                    !st.blocks.contains_key(&x) && !st.reading.contains(&x)
                };
                let mut n = 0;
                while b + n < end && n < PREFETCH_RUN && free(&st, b + n) {
                    n += 1;
                }
                if n < 2 {
                    // Cached, being read by another thread, or a single block: the
                    // ordinary path (which waits for a read under way).
                    drop(st);
                    drop(self.lock_cached(b)?);
                    b += 1;
                    continue;
                }
                for x in b..b + n {
                    st.reading.insert(x);
                }
                (n, st.stats.evictions)
            };
            // Taken out of the thread's slot (and put back below), so that a read that
            // came back into an engine on this thread would find it empty, not borrowed.
            let mut buf = PREFETCH_BUF.with(|b| b.take());
            let read = (|| {
                let len = run as usize * bs;
                if buf.len() < len {
                    buf.resize(len, 0);
                }
                let r = self.sh.dev.read_blocks(b, &mut buf[..len]);
                THREAD_READS.with(|t| t.set(t.get() + run));
                let mut st = self.lock();
                for x in b..b + run {
                    st.reading.remove(&x);
                }
                self.sh.read_cv.notify_all();
                r?;
                // As in `lock_cached`: a block cached meanwhile is newer than the copy
                // read; if blocks were evicted while the read ran, one of these may
                // have been cached, changed, written back and evicted meanwhile, so
                // none is kept (each is read again when it is needed).
                if st.stats.evictions == evictions {
                    for (i, x) in (b..b + run).enumerate() {
                        if !st.blocks.contains_key(&x) {
                            let data = spare_copy(&mut st.spare, &buf[i * bs..(i + 1) * bs]);
                            st.insert_block(x, data);
                        }
                    }
                }
                Ok::<(), PatchError>(())
            })();
            PREFETCH_BUF.with(|b| b.replace(buf));
            read?;
            b += run;
        }
        Ok(())
    }

    /// A hint that `blocks` will be read soon (a listing's inodes): those neither
    /// cached nor hinted lately are asked of the device in runs of consecutive blocks,
    /// which may start reading them in the background (see `BlockDevice::will_need`).
    /// Reorders `blocks`.
    pub fn will_need(&self, blocks: &mut Vec<BlockNo>) {
        blocks.sort_unstable();
        blocks.dedup();
        {
            let mut st = self.lock();
            let st = &mut *st;
            if st.hinted.len() + blocks.len() > HINTED_MAX {
                st.hinted.clear();
            }
            let count = self.sh.dev.block_count();
            blocks.retain(|&b| b < count && !st.blocks.contains_key(&b) && st.hinted.insert(b));
        }
        let mut rest = &blocks[..];
        while let Some(&first) = rest.first() {
            let n = rest
                .iter()
                .zip(first..)
                .take_while(|(&b, want)| b == *want)
                .count();
            self.sh.dev.will_need(first, n as u64);
            rest = &rest[n..];
        }
    }

    /// Whether `block` was hinted lately ([`Engine::will_need`]): its read is under way
    /// or done, and a read-ahead from it was already asked for.
    pub fn was_hinted(&self, block: BlockNo) -> bool {
        self.lock().hinted.contains(&block)
    }

    /// Device reads made so far by the calling thread (through any engine).
    pub fn thread_reads() -> u64 {
        THREAD_READS.with(|n| n.get())
    }

    /// Writes `bytes` at `offset` of `block`, after `befores`. Returns the patch that
    /// carries the change (possibly an existing patch it was merged into).
    pub fn write(
        &self,
        block: BlockNo,
        offset: usize,
        bytes: &[u8],
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<PatchId> {
        self.change(block, Change::Bytes { offset, bytes }, befores, opts)
    }

    /// Writes whole blocks `first..first + data.len() / block_size` (fresh contents: file
    /// data, a new directory or map block) as **one** hard patch, a *run*, when none of
    /// them has a pending patch; a run still pending and not being written grows over the
    /// blocks that follow it, so consecutive writes of a file (and of files allocated one
    /// after another) share one patch until write-back takes it. Otherwise each block is
    /// one change. Returns the patch that carries each block (the same one for a run).
    ///
    /// Later changes to a run's blocks merge into it when that closes no cycle, or become
    /// rollbackable patches after it; the run is always written whole, in one epoch.
    pub fn write_run(
        &self,
        first: BlockNo,
        data: &[u8],
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<Vec<PatchId>> {
        let bs = self.sh.block_size;
        if data.is_empty() || data.len() % bs != 0 {
            return Err(PatchError::Invalid(
                "a run is a whole number of blocks, at least one",
            ));
        }
        let n = (data.len() / bs) as u64;
        let count = self.sh.dev.block_count();
        if first.checked_add(n).is_none_or(|end| end > count) {
            return Err(quilt_block::BlockError::OutOfRange {
                block: first.saturating_add(n - 1),
                count,
            }
            .into());
        }
        let id = {
            let mut st = self.lock();
            st.check_failed()?;
            let id = st.write_run(&self.sh, first, data, befores, opts)?;
            st.debug_check();
            id
        };
        self.keep_budget()?;
        Ok(id)
    }

    /// Zeroes the whole block without reading it first (a freshly allocated block).
    pub fn zero_block(
        &self,
        block: BlockNo,
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<PatchId> {
        self.change(block, Change::Zero, befores, opts)
    }

    /// XORs `xor` into the little-endian 32-bit word at `offset` (a multiple of 4).
    pub fn xor_bits(
        &self,
        block: BlockNo,
        offset: usize,
        xor: u32,
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<PatchId> {
        if offset % 4 != 0 {
            return Err(PatchError::UnalignedWord(offset));
        }
        self.change(block, Change::Xor { offset, xor }, befores, opts)
    }

    /// An empty patch: durable once all of `befores` are. Use it to join dependencies.
    pub fn empty(&self, befores: &[PatchId]) -> PatchId {
        let mut st = self.lock();
        st.new_empty(befores, 0)
    }

    /// Makes `after` wait for `before`. Refused if it would close a cycle, or if `after`
    /// is already durable or being written.
    pub fn add_depend(&self, after: PatchId, before: PatchId) -> Result<()> {
        let mut st = self.lock();
        st.check_failed()?;
        let Some(a) = st.g.resolve(after) else {
            return Err(PatchError::NotPending);
        };
        if st.g.get(a).in_flight {
            return Err(PatchError::NotPending);
        }
        let Some(b) = st.g.resolve(before) else {
            return Ok(());
        };
        // An unheld empty patch hands its befores to the patches that depend on it
        // (`add_edge`), so they must take the new before too.
        let takers = st.lookthrough_closure(a);
        for &t in &takers {
            if t == b || st.g.reaches(b, t, usize::MAX) == Some(true) {
                return Err(PatchError::Cycle);
            }
            if st.g.get(t).in_flight {
                return Err(PatchError::NotPending);
            }
        }
        for t in takers {
            st.add_edge(t, b);
        }
        st.debug_check();
        Ok(())
    }

    /// Is this patch on disk (after a flush)?
    pub fn is_durable(&self, p: PatchId) -> bool {
        self.lock().g.resolve(p).is_none()
    }

    /// Inserts a named mark into the device history (see `RecordingDevice`).
    pub fn mark(&self, name: &str) {
        self.sh.dev.mark(name);
    }

    pub fn stats(&self) -> EngineStats {
        let st = self.lock();
        let mut s = st.stats;
        s.patches_live = st.g.live() as u64;
        s.blocks_cached = st.blocks.len() as u64;
        s.blocks_dirty = st.dirty.len() as u64;
        s
    }

    fn change(
        &self,
        block: BlockNo,
        change: Change<'_>,
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<PatchId> {
        let bs = self.sh.block_size;
        let (start, end) = change.range(bs);
        if end > bs {
            return Err(PatchError::OutOfBlock {
                offset: start,
                len: end - start,
                block_size: bs,
            });
        }
        let id = {
            let mut st = if change.needs_old(bs, self.sh.opts.hard_patches) {
                self.lock_cached(block)?
            } else {
                self.lock()
            };
            st.check_failed()?;
            let id = st.change(&self.sh, block, change, befores, opts)?;
            st.debug_check();
            id
        };
        self.keep_budget()?;
        Ok(id)
    }

    /// Keeps the cache within its budget: evict clean blocks; write back when dirty
    /// blocks or pending patches pile up. Past half of either limit the flusher thread is
    /// woken and the caller goes on; only past the limit itself does the caller write
    /// back (or wait for the flusher's epoch) before returning, like the kernel's dirty
    /// throttling. Without a flusher the caller writes back at the limit.
    ///
    /// The limits count from what the last write-back could not write (`held_floor`):
    /// patches and dirty blocks a journal's running transaction or an unreleased
    /// patchgroup holds cannot be written, so counting them would make every change past
    /// the limit pay an epoch (and a device flush) that writes only that change. (The
    /// metadata journal's PostMark ran 32,793 epochs of 14 blocks that way.)
    fn keep_budget(&self) -> Result<()> {
        let max = self.sh.opts.cache_bytes_max;
        let live_max = self.sh.opts.patches_live_max;
        let bs = self.sh.block_size;
        let (over_cache, over_patches, past_half, far_over) = {
            let mut st = self.lock();
            st.evict(max);
            let (held_live, held_dirty) = st.held_floor;
            let live = st.g.live().saturating_sub(held_live);
            let dirty_bytes = st.dirty.len().saturating_sub(held_dirty) * bs;
            let ready = !st.candidates.is_empty();
            (
                st.cached_bytes > max && dirty_bytes > max / 8 && ready,
                live > live_max && ready,
                live > live_max / 2 || dirty_bytes > max / 2,
                // So far over that one long op (a huge truncate) must not wait for its end.
                live > live_max.saturating_mul(4) || st.cached_bytes > max.saturating_mul(2),
            )
        };
        if past_half && self.sh.flusher_running.load(Ordering::Relaxed) {
            self.kick_flusher();
        }
        if over_patches || over_cache {
            if OPS_HELD.with(|n| n.get()) > 0 && !far_over {
                // Inside an op the module may hold its locks: write back when the op
                // ends (`throttle_due`), not across them.
                THROTTLE_DUE.with(|t| t.set(true));
                return Ok(());
            }
            self.throttle()?;
        }
        Ok(())
    }

    /// The throttling write-back: everything ready, then eviction.
    fn throttle(&self) -> Result<()> {
        self.lock().stats.throttled_writebacks += 1;
        self.write_back_ready()?;
        self.lock().evict(self.sh.opts.cache_bytes_max);
        Ok(())
    }

    /// Runs the write-back a change inside the ending op found due (see `keep_budget`).
    /// Called at the end of the thread's outermost op, with no module lock held.
    pub(crate) fn throttle_due(&self) -> Result<()> {
        if THROTTLE_DUE.with(|t| t.replace(false)) {
            self.throttle()?;
        }
        Ok(())
    }

    fn kick_flusher(&self) {
        if !self.sh.kicked.swap(true, Ordering::SeqCst) {
            let _g = self.sh.stop.0.lock().unwrap_or_else(|e| e.into_inner());
            self.sh.stop.1.notify_all();
        }
    }

    /// Starts the background flusher: every `interval` it writes back everything ready.
    pub fn start_flusher(&self, interval: Duration) {
        if self.sh.flusher_running.swap(true, Ordering::SeqCst) {
            return;
        }
        *self.sh.stop.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
        let weak = Arc::downgrade(&self.sh);
        let handle = std::thread::Builder::new()
            .name("quilt-flusher".into())
            .spawn(move || loop {
                let Some(sh) = weak.upgrade() else { return };
                {
                    let (lock, cv) = &sh.stop;
                    let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let (stopped, _) = cv
                        .wait_timeout_while(stopped, interval, |stop| {
                            !*stop && !sh.kicked.load(Ordering::SeqCst)
                        })
                        .unwrap_or_else(|e| e.into_inner());
                    if *stopped {
                        sh.flusher_running.store(false, Ordering::SeqCst);
                        return;
                    }
                    sh.kicked.store(false, Ordering::SeqCst);
                }
                let engine = Engine { sh };
                engine.lock().stats.flusher_rounds += 1;
                if let Err(e) = engine.write_back_ready() {
                    tracing::warn!("background write-back failed: {e}");
                }
            })
            .expect("spawning the flusher thread");
        *self.sh.flusher.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
    }

    /// Stops the background flusher and waits for its thread to end (it finishes the
    /// epoch it is in), so that once this returns nothing but the caller's handles keep
    /// the device open: an unmount followed by a new open of the image must not find
    /// it still locked. Must not be called with the engine's state locked.
    pub fn stop_flusher(&self) {
        let (lock, cv) = &self.sh.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        let handle = self
            .sh
            .flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl State {
    pub fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(PatchError::Failed(e.clone())),
            None => Ok(()),
        }
    }

    pub fn touch(&mut self, block: BlockNo) {
        self.tick += 1;
        let tick = self.tick;
        let recent = (self.blocks.len() / 16) as u64;
        if let Some(b) = self.blocks.get_mut(&block) {
            // Recently used blocks keep their place: the order is approximate, and a hot
            // block does not pay two tree operations per access.
            if b.last_use != 0 && tick - b.last_use < recent {
                return;
            }
            self.lru.remove(&b.last_use);
            b.last_use = tick;
            self.lru.insert(tick, block);
        }
    }

    /// The cached block; on a miss, filled as `init` says.
    pub fn load(
        &mut self,
        sh: &Shared,
        block: BlockNo,
        init: Init<'_>,
    ) -> Result<&mut CachedBlock> {
        if self.blocks.contains_key(&block) {
            self.stats.cache_hits += 1;
        } else {
            let count = sh.dev.block_count();
            if block >= count {
                return Err(quilt_block::BlockError::OutOfRange { block, count }.into());
            }
            let data: crate::BlockBuf = match init {
                Init::Read => {
                    // Engine calls bring the block in first, without the lock
                    // (`lock_cached`); this is the fallback under it.
                    let mut data = take_spare(&mut self.spare, sh.block_size);
                    sh.dev.read(block, &mut data)?;
                    THREAD_READS.with(|n| n.set(n.get() + 1));
                    Arc::new(data)
                }
                Init::Zero => {
                    let mut data = take_spare(&mut self.spare, sh.block_size);
                    data.fill(0);
                    Arc::new(data)
                }
                Init::Bytes(b) => spare_copy(&mut self.spare, b),
            };
            self.insert_block(block, data);
        }
        self.touch(block);
        Ok(self.blocks.get_mut(&block).expect("just inserted"))
    }

    /// Caches `block` (not cached yet) with `data` and no pending patches.
    pub fn insert_block(&mut self, block: BlockNo, data: crate::BlockBuf) {
        self.stats.cache_misses += 1;
        self.cached_bytes += data.len();
        self.blocks.insert(block, CachedBlock::new(data));
        // Into the LRU now: a block read ahead (`prefetch`) may never be accessed.
        self.touch(block);
    }

    /// Evicts least recently used clean blocks until the cache fits `max` bytes, and then
    /// some (down to 7/8 of it), so that a full cache does not pay a scan per change.
    pub fn evict(&mut self, max: usize) {
        if self.cached_bytes <= max {
            return;
        }
        let target = max - max / 8;
        // Only clean blocks can go. Once the walk has found them all it stops: a cache
        // full of dirty blocks (a Bε-tree checkpoint's nodes, between two flushes) was
        // walked whole by the eviction after every run written to it.
        let mut clean = self.blocks.len().saturating_sub(self.dirty.len());
        let mut victims: Vec<(u64, BlockNo)> = Vec::new();
        let mut passed: Vec<(u64, BlockNo)> = Vec::new();
        let mut freeing = 0;
        for (&tick, &block) in self.lru.iter() {
            if self.cached_bytes - freeing <= target || clean == 0 {
                break;
            }
            if self.dirty.contains(&block) {
                passed.push((tick, block));
                continue;
            }
            freeing += self.blocks.get(&block).map_or(0, |b| b.data.len());
            clean -= 1;
            victims.push((tick, block));
        }
        for (tick, block) in victims {
            if let Some(b) = self.blocks.remove(&block) {
                self.cached_bytes -= b.data.len();
                self.lru.remove(&tick);
                self.stats.evictions += 1;
                // (Shared with an epoch's image still being written: not spare.)
                if let Ok(buf) = Arc::try_unwrap(b.data) {
                    if (self.spare.len() + 1) * buf.len() <= max - target {
                        self.spare.push(buf);
                    }
                }
            }
        }
        // Dirty blocks cannot go; moved to the recent end, they are not walked again by
        // every later eviction (a journal's running transaction keeps thousands dirty
        // while the cache is full, and each change evicts).
        for (tick, block) in passed {
            self.lru.remove(&tick);
            self.tick += 1;
            let t = self.tick;
            if let Some(b) = self.blocks.get_mut(&block) {
                b.last_use = t;
                self.lru.insert(t, block);
            }
        }
    }

    /// Adds the edge "after waits for before" (both live). Keeps the block's count of
    /// off-block afters, which decides whether its changes need undo bytes, and `after`'s
    /// wait count.
    ///
    /// An edge onto an unheld empty patch with few befores (a join of a few heads) becomes
    /// edges onto those befores instead: `after` may then travel with those of them that
    /// are on its own block, where a wait on the empty would hold it back an epoch. The
    /// empty remembers `after` (`lookthrough`) for a before added to it later.
    pub fn add_edge(&mut self, after: PatchId, before: PatchId) {
        if after == before {
            return;
        }
        if self.g.get(before).is_empty() && !self.g.get(before).is_held() {
            let live: Vec<PatchId> = self
                .g
                .get(before)
                .befores
                .iter()
                .filter_map(|&b| self.g.resolve(b))
                .filter(|&b| b != before)
                .take(LOOKTHROUGH_MAX + 1)
                .collect();
            if live.len() <= LOOKTHROUGH_MAX && !live.contains(&after) {
                let list = self.lookthrough.entry(before).or_default();
                if list.last() != Some(&after) {
                    list.push(after);
                }
                for b in live {
                    self.add_edge(after, b);
                }
                return;
            }
        }
        let after_block = self.g.get(after).block;
        let (before_block, wait) = {
            let b = self.g.get(before);
            (b.block, is_wait(after_block, b))
        };
        {
            let a = self.g.get_mut(after);
            // Cheap duplicate check: consecutive changes often name the same before.
            if a.befores.last() == Some(&before) {
                return;
            }
            a.befores.push(before);
            if wait {
                a.waits += 1;
            }
        }
        self.g.get_mut(before).afters.push(after);
        if let Some(bb) = before_block {
            if after_block != Some(bb) {
                if let Some(blk) = self.blocks.get_mut(&bb) {
                    blk.extern_afters += 1;
                }
            }
        }
    }

    /// `p` and, if it is an unheld empty patch, every pending patch that took its befores
    /// in place of an edge onto it (transitively).
    pub fn lookthrough_closure(&self, p: PatchId) -> Vec<PatchId> {
        let mut out = vec![p];
        let mut i = 0;
        while i < out.len() {
            if let Some(list) = self.lookthrough.get(&out[i]) {
                for &a in list {
                    if let Some(a) = self.g.resolve(a) {
                        if !out.contains(&a) {
                            out.push(a);
                        }
                    }
                }
            }
            i += 1;
        }
        out
    }

    /// Puts `p`'s block among the epoch candidates if `p` waits for nothing off it.
    pub fn note_if_unblocked(&mut self, p: PatchId) {
        let patch = self.g.get(p);
        if patch.waits == 0 {
            if let Some(b) = patch.block {
                self.candidates.insert(b);
            }
        }
    }

    /// Resolves caller-supplied befores and adds the tails of the caller's engaged
    /// patchgroups, so that the change waits for what those groups wait for.
    fn gather_befores(&self, befores: &[PatchId], caller: Option<CallerId>) -> Vec<PatchId> {
        let mut out: Vec<PatchId> = Vec::with_capacity(befores.len() + 2);
        let engaged = caller
            .map(|c| self.pgs.engaged_tails(c))
            .unwrap_or_default();
        let all = befores.iter().chain(engaged.iter());
        if befores.len() + engaged.len() <= 16 {
            for &b in all {
                if let Some(r) = self.g.resolve(b) {
                    if !out.contains(&r) {
                        out.push(r);
                    }
                }
            }
        } else {
            // A transaction's done patch joins every patch it captured.
            let mut seen = rustc_hash::FxHashSet::default();
            for &b in all {
                if let Some(r) = self.g.resolve(b) {
                    if seen.insert(r) {
                        out.push(r);
                    }
                }
            }
        }
        out
    }

    pub fn new_empty(&mut self, befores: &[PatchId], holds: u32) -> PatchId {
        let befores = self.gather_befores(befores, None);
        self.stats.patches_created += 1;
        self.stats.empties_created += 1;
        let id = self
            .g
            .insert(Patch::new(None, Kind::Empty { holds }, 0, false));
        for b in befores {
            self.add_edge(id, b);
        }
        if holds == 0 && self.g.get(id).waits == 0 {
            self.satisfy(id);
        }
        id
    }

    /// Drops one hold on an empty patch; it becomes durable once its befores are.
    pub fn unhold(&mut self, id: PatchId) {
        let Some(id) = self.g.resolve(id) else { return };
        if let Kind::Empty { holds } = &mut self.g.get_mut(id).kind {
            *holds = holds.saturating_sub(1);
            if *holds == 0 && self.g.get(id).waits == 0 {
                self.satisfy(id);
            }
        }
    }

    /// Pending patches on `block` (per the overlap index) that `change` overlaps.
    fn overlapping(&self, block: BlockNo, probe: &Patch) -> Vec<PatchId> {
        self.blocks[&block]
            .overlap_index
            .near(probe.range())
            .filter(|&p| self.g.get(p).overlaps(probe))
            .collect()
    }

    /// Can `befores` be added to `target` without a cycle? (Is `target` unreachable from
    /// each of them?) A search that gives up answers no. A change that depends on a run
    /// never joins it: the run's blocks are written together, in no order, so the change
    /// could reach the disk before the block it depends on.
    fn merge_is_acyclic(&self, target: PatchId, befores: &[PatchId]) -> bool {
        let run = self.g.get(target).run;
        befores.iter().all(|&b| {
            (b == target && !run)
                || (b != target
                    && self.g.reaches(b, target, MERGE_CYCLE_SEARCH_LIMIT) == Some(false))
        })
    }

    pub fn change(
        &mut self,
        sh: &Shared,
        block: BlockNo,
        change: Change<'_>,
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<PatchId> {
        let bs = sh.block_size;
        // A block that is not cached has no pending patches, so a whole-block change can
        // become a hard patch without knowing the old contents.
        let init = match change {
            _ if change.needs_old(bs, sh.opts.hard_patches) => Init::Read,
            Change::Bytes { bytes, .. } => Init::Bytes(bytes),
            _ => Init::Zero,
        };
        self.load(sh, block, init)?;
        // Under a capture (the journal modes) transactions commit in order and a group's
        // changes are made after those of the groups before it, so the log already
        // keeps patchgroup order: the groups' tails would only make write-back put
        // blocks home one group per epoch (and flush) for nothing, and their heads
        // (which a group sync does not use there: it commits) only grow the graph.
        let ordering_caller = if self.capture.is_some() {
            None
        } else {
            opts.caller
        };
        let befores = self.gather_befores(befores, ordering_caller);

        let (start, end) = change.range(bs);
        let probe = Patch::new(
            Some(block),
            match change {
                Change::Xor { offset, xor } => Kind::Bit {
                    offset: offset as u32,
                    xor,
                },
                _ => Kind::Byte {
                    offset: start as u32,
                    len: (end - start) as u32,
                    undo: None,
                },
            },
            0,
            opts.data,
        );

        // A run's blocks never fold: only its first block counts the edges from other
        // blocks onto it, so "no afters elsewhere" cannot be read off the others. Changes
        // there merge into the run (`merge_target`, with a cycle check) or follow it.
        let on_run = self.blocks[&block].hard.is_some_and(|h| self.g.get(h).run);
        let may_fold = || {
            self.blocks[&block]
                .pending
                .iter()
                .filter(|&&p| !self.g.get(p).in_flight)
                .all(|&p| self.capture_may_join(p, block, opts.data))
        };
        let id = if sh.opts.hard_patches
            && !on_run
            && self.blocks[&block].extern_afters == 0
            && may_fold()
        {
            self.fold_block_into_hard(block, change, &befores, opts.data)
        } else if let Some(target) = self.merge_target(sh, block, &probe, &befores) {
            self.merge_into(target, block, change, &befores, opts.data);
            target
        } else {
            self.new_patch(block, change, probe, &befores)
        };

        if let Some(c) = ordering_caller {
            for head in self.pgs.engaged_heads(c) {
                if let Some(h) = self.g.resolve(head) {
                    self.add_edge(h, id);
                }
            }
        }
        // File data of a process in a patchgroup is journaled even when only metadata
        // is (as in Featherstitch): written in place it could wait, through the group's
        // befores, for metadata held in the running transaction, miss the commit, and
        // leave the group's committed metadata naming data that never arrived.
        let engaged = opts.caller.is_some_and(|c| self.pgs.is_engaged(c));
        self.capture_change(id, block, opts.data && !engaged);
        self.note_if_unblocked(id);
        Ok(id)
    }

    /// See [`Engine::write_run`]. The blocks' range is checked by the caller.
    pub fn write_run(
        &mut self,
        sh: &Shared,
        first: BlockNo,
        data: &[u8],
        befores: &[PatchId],
        opts: ChangeOpts,
    ) -> Result<Vec<PatchId>> {
        let bs = sh.block_size;
        let n = (data.len() / bs) as u64;
        let fresh = sh.opts.hard_patches && (first..first + n).all(|b| !self.dirty.contains(&b));
        if !fresh || n > RUN_BLOCKS_MAX as u64 {
            // Some block has pending patches (or runs are off): one change per block.
            let mut ids = Vec::with_capacity(n as usize);
            for (i, chunk) in data.chunks(bs).enumerate() {
                let b = first + i as u64;
                let change = Change::Bytes {
                    offset: 0,
                    bytes: chunk,
                };
                ids.push(self.change(sh, b, change, befores, opts)?);
            }
            return Ok(ids);
        }
        // (The caller checked the run is on the device.) One hash lookup a block: a
        // Bε-tree checkpoint writes every node through here.
        for (i, chunk) in data.chunks(bs).enumerate() {
            let b = first + i as u64;
            match self.blocks.entry(b) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    self.stats.cache_hits += 1;
                    e.get_mut().data_mut().copy_from_slice(chunk);
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    self.stats.cache_misses += 1;
                    self.cached_bytes += chunk.len();
                    e.insert(CachedBlock::new(spare_copy(&mut self.spare, chunk)));
                }
            }
            self.touch(b);
        }
        let ordering_caller = if self.capture.is_some() {
            None
        } else {
            opts.caller
        };
        let befores = self.gather_befores(befores, ordering_caller);
        let engaged = opts.caller.is_some_and(|c| self.pgs.is_engaged(c));
        let captured = opts.data && !engaged;
        // Grow the run that ends where this one begins, if it is pending, not being
        // written, of the same kind, and would not close a cycle.
        let grow = first
            .checked_sub(1)
            .and_then(|prev| self.blocks.get(&prev))
            .and_then(|b| b.hard)
            .filter(|&h| {
                let p = self.g.get(h);
                p.run
                    && !p.in_flight
                    && p.data == opts.data
                    && p.block.is_some_and(|b| b + p.span as u64 == first)
                    && p.span as u64 + n <= RUN_BLOCKS_MAX as u64
            })
            .filter(|&h| self.capture_may_grow(h, first, n, captured))
            .filter(|&h| self.merge_is_acyclic(h, &befores));
        let id = match grow {
            Some(h) => {
                self.stats.patches_merged += 1;
                self.g.get_mut(h).span += n as u32;
                h
            }
            None => {
                self.seq += 1;
                self.stats.patches_created += 1;
                self.stats.patches_made_hard += 1;
                if opts.data {
                    self.stats.data_patches_created += 1;
                }
                let mut p = Patch::new(
                    Some(first),
                    Kind::Byte {
                        offset: 0,
                        len: bs as u32,
                        undo: None,
                    },
                    self.seq,
                    opts.data,
                );
                p.span = n as u32;
                p.run = true;
                self.g.insert(p)
            }
        };
        for &b in &befores {
            if let Some(b) = self.g.resolve(b) {
                self.add_edge(id, b);
            }
        }
        for b in first..first + n {
            let blk = self.blocks.get_mut(&b).expect("loaded above");
            blk.pending = vec![id];
            blk.overlap_index.clear();
            blk.overlap_index.insert(id, (0, bs as u32));
            blk.hard = Some(id);
            self.dirty.insert(b);
        }
        if let Some(c) = ordering_caller {
            for head in self.pgs.engaged_heads(c) {
                if let Some(h) = self.g.resolve(head) {
                    self.add_edge(h, id);
                }
            }
        }
        for b in first..first + n {
            self.capture_change(id, b, captured);
        }
        self.note_if_unblocked(id);
        Ok(vec![id; n as usize])
    }

    /// Hard-patch path: no other block depends on `block`, so every pending patch on it
    /// (except those being written) folds into one whole-block patch without undo bytes,
    /// and the change is applied to it. Acyclic by construction: the folded patches' afters
    /// are all on this block, hence folded too, so the result has no afters when the new
    /// befores are added.
    fn fold_block_into_hard(
        &mut self,
        block: BlockNo,
        change: Change<'_>,
        befores: &[PatchId],
        data: bool,
    ) -> PatchId {
        let members: Vec<PatchId> = self.blocks[&block]
            .pending
            .iter()
            .copied()
            .filter(|&p| !self.g.get(p).in_flight)
            .collect();
        let in_flight: Vec<PatchId> = self.blocks[&block]
            .pending
            .iter()
            .copied()
            .filter(|&p| self.g.get(p).in_flight)
            .collect();
        let bs = self.blocks[&block].data.len() as u32;
        let existing = self.blocks[&block].hard;
        let all_data = data && members.iter().all(|&m| self.g.get(m).data);
        self.seq += 1;
        let survivor = match existing {
            Some(h) => {
                self.stats.patches_merged += 1;
                h
            }
            None => {
                self.stats.patches_created += 1;
                self.stats.patches_made_hard += 1;
                if all_data {
                    self.stats.data_patches_created += 1;
                }
                self.g.insert(Patch::new(
                    Some(block),
                    Kind::Byte {
                        offset: 0,
                        len: bs,
                        undo: None,
                    },
                    self.seq,
                    all_data,
                ))
            }
        };
        for m in members {
            if m != survivor {
                self.absorb(survivor, m);
            }
        }
        {
            let p = self.g.get_mut(survivor);
            p.seq = self.seq;
            p.data = all_data;
        }
        for &f in &in_flight {
            self.add_edge(survivor, f);
        }
        for &b in befores {
            if let Some(b) = self.g.resolve(b) {
                self.add_edge(survivor, b);
            }
        }
        let ranges: Vec<(u32, u32)> = in_flight.iter().map(|&f| self.g.get(f).range()).collect();
        let blk = self.blocks.get_mut(&block).expect("loaded");
        blk.pending = in_flight.clone();
        blk.pending.push(survivor);
        blk.overlap_index.clear();
        for (&f, r) in in_flight.iter().zip(ranges) {
            blk.overlap_index.insert(f, r);
        }
        blk.overlap_index.insert(survivor, (0, bs));
        blk.hard = Some(survivor);
        change.apply(blk.data_mut());
        self.dirty.insert(block);
        survivor
    }

    /// Folds patch `m` into `survivor` (same block): `m`'s id forwards to `survivor`, its
    /// edges move over (self-edges are dropped lazily) and its undo bytes are freed.
    fn absorb(&mut self, survivor: PatchId, m: PatchId) {
        let old = self.g.forward(m, survivor);
        self.stats.undo_bytes_now -= old.undo_len() as u64;
        let s = self.g.get_mut(survivor);
        // Same block, so each moved edge keeps its kind; edges between the two become
        // self-edges, which were never waits.
        s.waits += old.waits;
        s.befores.extend(old.befores);
        s.afters.extend(old.afters);
    }

    /// The patch a change may be merged into, if any: the block's hard patch when the change
    /// overlaps nothing else, or (with overlap merging) the single rollbackable patch it
    /// overlaps. Either way the merge must not close a cycle.
    fn merge_target(
        &self,
        sh: &Shared,
        block: BlockNo,
        probe: &Patch,
        befores: &[PatchId],
    ) -> Option<PatchId> {
        let blk = &self.blocks[&block];
        let over = self.overlapping(block, probe);
        if let Some(h) = blk.hard {
            // Everything pending on the block depends on the hard patch; folding the change
            // into it is safe if no newer patch overlaps the change (its undo bytes would
            // otherwise restore bytes older than the change).
            if sh.opts.hard_patches
                && over.iter().all(|&p| p == h)
                && self.capture_may_join(h, block, probe.data)
                && self.merge_is_acyclic(h, befores)
            {
                return Some(h);
            }
        }
        if !sh.opts.overlap_merge {
            return None;
        }
        let target = match probe.kind {
            Kind::Bit { offset, xor, .. } => {
                // Merge with the one patch on this word, if it is a bit patch. (Any other
                // patch touching the word would fix an order between them.) Disjoint bits
                // merge only when both wait for the same patches: neither depends on the
                // other (XORs of disjoint bits commute), and whatever comes to depend on
                // one would otherwise wait for the other's befores too. An inode
                // allocated in the word of an inode just freed joined the free's patch,
                // which waits for the freed inode's cleared record, and that for the
                // entry's removal: a mail server creating and deleting a file per
                // message chained every message behind the one before, an epoch and a
                // flush per link.
                let word = Patch::new(
                    Some(block),
                    Kind::Byte {
                        offset,
                        len: 4,
                        undo: None,
                    },
                    0,
                    false,
                );
                // (From the overlap index: a patch on the word that a newer one covers
                // is left out. The newer one depends on it, so whatever merges into
                // the newer one follows it too.)
                let on_word = self.overlapping(block, &word);
                match on_word[..] {
                    [t] => match self.g.get(t).kind {
                        Kind::Bit { xor: tx, .. }
                            if tx & xor != 0 || self.same_befores(t, befores) =>
                        {
                            t
                        }
                        _ => return None,
                    },
                    _ => return None,
                }
            }
            _ => {
                // The hard patch (older than everything else on the block, which all
                // depends on it) does not stand in the way of merging into a newer patch.
                let over: Vec<PatchId> =
                    over.into_iter().filter(|&p| Some(p) != blk.hard).collect();
                match over[..] {
                    [t] if matches!(self.g.get(t).kind, Kind::Byte { undo: Some(_), .. }) => t,
                    // Touching nothing else pending: grow a patch that ends where the change
                    // begins, or begins where it ends (consecutive pointers in a map block,
                    // entries appended to a directory block). It only adds dependencies.
                    [] => self.adjacent_patch(block, probe)?,
                    _ => return None,
                }
            }
        };
        let t = self.g.get(target);
        if t.in_flight
            || !self.capture_may_join(target, block, probe.data)
            || !self.merge_is_acyclic(target, befores)
        {
            return None;
        }
        Some(target)
    }

    /// Whether the live befores of `t` are exactly `befores` (as sets).
    fn same_befores(&self, t: PatchId, befores: &[PatchId]) -> bool {
        let live = |ids: &[PatchId]| -> Vec<PatchId> {
            let mut v: Vec<PatchId> = ids.iter().filter_map(|&b| self.g.resolve(b)).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        live(&self.g.get(t).befores) == live(befores)
    }

    /// The newest rollbackable byte patch on `block`, not being written, whose bytes end
    /// where `probe`'s begin or begin where they end.
    fn adjacent_patch(&self, block: BlockNo, probe: &Patch) -> Option<PatchId> {
        let (p0, p1) = probe.range();
        // A patch that ends at p0 holds byte p0 - 1; one that begins at p1 holds p1.
        self.blocks[&block]
            .overlap_index
            .near((p0.saturating_sub(1), p1 + 1))
            .filter(|&id| {
                let p = self.g.get(id);
                let (a0, a1) = p.range();
                matches!(p.kind, Kind::Byte { undo: Some(_), .. })
                    && !p.in_flight
                    && (a1 == p0 || a0 == p1)
            })
            .max_by_key(|&id| self.g.get(id).seq)
    }

    fn merge_into(
        &mut self,
        target: PatchId,
        block: BlockNo,
        change: Change<'_>,
        befores: &[PatchId],
        data: bool,
    ) {
        self.stats.patches_merged += 1;
        self.g.get_mut(target).data &= data;
        let bs = self.blocks[&block].data.len();
        let (n0, n1) = change.range(bs);
        let mut undo_added = 0u64;
        let mut grew = None;
        {
            let data = &self.blocks[&block].data;
            let p = self.g.get_mut(target);
            match &mut p.kind {
                Kind::Byte {
                    offset,
                    len,
                    undo: Some(undo),
                } => {
                    let (t0, t1) = (*offset as usize, (*offset + *len) as usize);
                    let (u0, u1) = (t0.min(n0), t1.max(n1));
                    if (u0, u1) != (t0, t1) {
                        // The undo bytes grow to the union: the newly covered bytes are
                        // saved as they are now, before the change.
                        let mut grown = data[u0..u1].to_vec();
                        grown[t0 - u0..t1 - u0].copy_from_slice(undo);
                        undo_added = (grown.len() - undo.len()) as u64;
                        *undo = grown.into_boxed_slice();
                        *offset = u0 as u32;
                        *len = (u1 - u0) as u32;
                        grew = Some(((t0 as u32, t1 as u32), (u0 as u32, u1 as u32)));
                    }
                }
                Kind::Bit { xor: t, .. } => {
                    if let Change::Xor { xor, .. } = change {
                        *t ^= xor;
                    }
                }
                // The hard patch covers the whole block: nothing to record.
                Kind::Byte { undo: None, .. } => {}
                Kind::Empty { .. } => unreachable!("empty patches are never merge targets"),
            }
        }
        self.stats.undo_bytes_now += undo_added;
        self.stats.undo_bytes_total += undo_added;
        for &b in befores {
            if let Some(b) = self.g.resolve(b) {
                self.add_edge(target, b);
            }
        }
        let blk = self.blocks.get_mut(&block).expect("loaded");
        // A patch that grew is filed again where it now lies (if it was filed at all).
        if let Some((was, now)) = grew {
            if blk.overlap_index.remove(target, was) {
                blk.overlap_index.insert(target, now);
            }
        }
        change.apply(blk.data_mut());
    }

    fn new_patch(
        &mut self,
        block: BlockNo,
        change: Change<'_>,
        mut probe: Patch,
        befores: &[PatchId],
    ) -> PatchId {
        let over = self.overlapping(block, &probe);
        self.seq += 1;
        probe.seq = self.seq;
        if let Kind::Byte { offset, len, undo } = &mut probe.kind {
            let data = &self.blocks[&block].data;
            let saved = data[*offset as usize..(*offset + *len) as usize].to_vec();
            self.stats.undo_bytes_now += saved.len() as u64;
            self.stats.undo_bytes_total += saved.len() as u64;
            *undo = Some(saved.into_boxed_slice());
        }
        self.stats.patches_created += 1;
        if matches!(probe.kind, Kind::Bit { .. }) {
            self.stats.bit_patches_created += 1;
        }
        if probe.data {
            self.stats.data_patches_created += 1;
        }
        let id = self.g.insert(probe);
        for o in over {
            self.add_edge(id, o);
        }
        for &b in befores {
            if let Some(b) = self.g.resolve(b) {
                self.add_edge(id, b);
            }
        }
        let new = self.g.get(id);
        let range = new.range();
        // What the new patch covers overlaps it, so it is near it.
        let covered: Vec<(PatchId, (u32, u32))> = self.blocks[&block]
            .overlap_index
            .near(range)
            .filter(|&p| new.covers(self.g.get(p)))
            .map(|p| (p, self.g.get(p).range()))
            .collect();
        let blk = self.blocks.get_mut(&block).expect("loaded");
        for (p, r) in covered {
            blk.overlap_index.remove(p, r);
        }
        blk.overlap_index.insert(id, range);
        blk.pending.push(id);
        change.apply(blk.data_mut());
        self.dirty.insert(block);
        id
    }

    /// Marks a patch durable: it leaves the graph, its block lists and its afters' counts;
    /// empty afters whose befores are now all durable follow it.
    pub fn satisfy(&mut self, first: PatchId) {
        let mut work = vec![first];
        while let Some(id) = work.pop() {
            if self.g.resolve(id) != Some(id) {
                continue;
            }
            debug_assert!(
                befores_durable(&self.g, id),
                "patch {id} satisfied before its befores"
            );
            let p = self.g.remove(id);
            self.stats.undo_bytes_now -= p.undo_len() as u64;
            for b in p.blocks() {
                if let Some(blk) = self.blocks.get_mut(&b) {
                    if blk.hard == Some(id) {
                        blk.hard = None;
                    }
                }
            }
            if p.is_empty() {
                self.lookthrough.remove(&id);
            }
            for &a in &p.afters {
                let Some(a) = self.g.resolve(a) else { continue };
                if a == id {
                    continue;
                }
                let ap = self.g.get(a);
                if let Some(b) = p.block {
                    if ap.block != Some(b) {
                        if let Some(blk) = self.blocks.get_mut(&b) {
                            blk.extern_afters -= 1;
                        }
                    }
                }
                let ap = self.g.get_mut(a);
                if is_wait(ap.block, &p) {
                    ap.waits -= 1;
                    if ap.waits == 0 {
                        match ap.block {
                            Some(ab) => {
                                self.candidates.insert(ab);
                                self.woken.push(ab);
                            }
                            None if !ap.is_held() => work.push(a),
                            None => {}
                        }
                    }
                }
            }
        }
    }

    /// Graph invariants, checked after every mutation in debug builds while the graph is
    /// small enough for that to be cheap.
    pub fn debug_check(&self) {
        if graph_checks() && self.failed.is_none() && self.g.live() <= 512 {
            if let Err(e) = self.check_invariants() {
                panic!("patch graph invariant broken: {e}");
            }
        }
    }
}

/// Whether `debug_check` runs: in builds with debug assertions, unless
/// `QUILTFS_CHECK_GRAPH=0` turns it off. The check is linear in the live graph and runs
/// after every mutation, so it makes a debug build's long runs (benchmarks, a merge of
/// 60 000 creates) many times slower; the test suite keeps it for the unit and
/// integration tests and turns it off for the scripts that time things from outside.
fn graph_checks() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        cfg!(debug_assertions) && std::env::var_os("QUILTFS_CHECK_GRAPH").is_none_or(|v| v != "0")
    })
}

/// The runs of consecutive values in `values` (ascending), each at most `max` long, as
/// index ranges in order: what one device request each can read or write.
pub(crate) fn consecutive_runs(
    values: &[u64],
    max: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= values.len() {
            return None;
        }
        let start = at;
        at += 1;
        while at < values.len() && at - start < max && values[at] == values[at - 1] + 1 {
            at += 1;
        }
        Some(start..at)
    })
}

/// Is an edge from a patch on `after_block` onto `before` a wait (see `Patch::waits`)?
/// Fixed for the edge's life: neither end changes block or kind, and a run is a run from
/// its birth (its span may grow). An edge onto a run is always a wait: the dependency may
/// be on any of the run's blocks, and those are written together with no order among
/// them, so only the run's durability satisfies it.
pub(crate) fn is_wait(after_block: Option<BlockNo>, before: &Patch) -> bool {
    before.block.is_none() || before.run || before.block != after_block
}

/// Are all of `id`'s befores durable?
pub(crate) fn befores_durable(g: &Graph, id: PatchId) -> bool {
    g.get(id).befores.iter().all(|&b| match g.resolve(b) {
        None => true,
        Some(r) => r == id,
    })
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn runs_split_at_gaps_and_at_the_longest() {
        let v = [3, 4, 5, 7, 8, 10];
        let r: Vec<_> = consecutive_runs(&v, usize::MAX).collect();
        assert_eq!(r, vec![0..3, 3..5, 5..6]);
        let r: Vec<_> = consecutive_runs(&v, 2).collect();
        assert_eq!(r, vec![0..2, 2..3, 3..5, 5..6]);
        assert_eq!(consecutive_runs(&[], 4).count(), 0);
    }
}
