//! The block layer: the bottom of the quiltfs stack.
//!
//! A [`BlockDevice`] stores fixed-size blocks. Its contract is the one every layer above
//! relies on for crash consistency:
//!
//! * `write` may sit in a volatile cache: after a crash, each block written since the last
//!   completed `flush` holds either its old content or one of the contents written to it
//!   since (block writes are atomic, but they may be reordered and dropped).
//! * `flush` is the durability barrier: when it returns `Ok`, every write that returned
//!   before it was called is durable.
//! * `mark` inserts a named point into the device's history. Devices that keep no history
//!   ignore it and pass it down; the [`RecordingDevice`] logs it so that crash states can be
//!   cut at operation boundaries, fsync returns and patchgroup syncs.
//!
//! Devices stack: a device may wrap another one (`Arc<dyn BlockDevice>`). Every device
//! counts its I/O in [`IoCounters`]. Bad requests (a block past the end, a buffer of the
//! wrong size) and I/O failures are typed [`BlockError`]s, never panics.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod bytes;
mod counters;
mod file;
mod mem;
mod model;
mod overlay;
mod recording;

pub use bytes::ByteView;
pub use counters::{IoCounters, IoStats};
pub use file::{lock_file, lock_holders, FileDevice, FileDeviceOptions, ImageLock};
pub use mem::MemDevice;
pub use model::{
    Clock, DiskModel, DiskParams, ModelCounters, Place, SeekCurve, Zone, LATENCY_BUCKETS,
    LATENCY_BUCKETS_US,
};
pub use overlay::OverlayDevice;
pub use recording::{LogEntry, RecordingDevice, RecordingLog};

/// A block number on a device.
pub type BlockNo = u64;

/// Everything that can go wrong below the patch layer.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("block {block} is out of range (device has {count} blocks)")]
    OutOfRange { block: BlockNo, count: u64 },
    #[error("buffer of {got} bytes does not match the block size {block_size}")]
    BadBufferSize { got: usize, block_size: usize },
    #[error("short read of block {block}: {got} of {want} bytes (the image ends early)")]
    ShortRead {
        block: BlockNo,
        got: usize,
        want: usize,
    },
    #[error("block size {0} is invalid: it must be a power of two between 512 and 65536")]
    BadBlockSize(usize),
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
    #[error("the recording log is full ({limit_bytes} bytes); raise the limit or record less")]
    LogFull { limit_bytes: u64 },
    /// What holds the image (a sparse file on a full host file system) has no room for
    /// blocks about to be used.
    #[error(
        "no room for blocks {first}..{end} of {path}: the file system holding the image is full"
    )]
    NoSpace {
        path: String,
        first: BlockNo,
        end: BlockNo,
    },
    /// Another open of the image holds its lock: one writer per image (or readers only).
    #[error("{path} is in use{}", holders_text(.holders))]
    Busy { path: String, holders: Vec<u32> },
    /// The device cannot serve the request now, though it may later (a replicated
    /// volume without a quorum of its replicas, a remote device whose peer is gone).
    /// Nothing was changed by the request that failed.
    #[error("{what} is unavailable: {why}")]
    Unavailable { what: String, why: String },
    #[error("I/O error on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = BlockError> = std::result::Result<T, E>;

fn holders_text(pids: &[u32]) -> String {
    match pids {
        [] => String::new(),
        [p] => format!(" by process {p}"),
        _ => format!(
            " by processes {}",
            pids.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// What a write carries, as the layer that made it knows: a replicated or tiered device
/// may place file data and metadata differently, a recording may count them apart. The
/// patch engine passes it down from each patch; tools that write raw blocks say what they
/// write.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WriteClass {
    /// File-system structure, logs, tree nodes: everything but a file's bytes.
    #[default]
    Metadata,
    /// A file's contents.
    Data,
}

/// A device of fixed-size blocks with an explicit durability barrier: the small core
/// every device implements in full, plus [`Capabilities`] it may have.
///
/// Methods take `&self` so that one device can be shared by the write-back engine and
/// its flusher thread; implementations synchronise internally. Nothing has a default
/// body: a device that wraps another says, method by method and in
/// [`capabilities`](Self::capabilities), what it passes on, so nothing is dropped by
/// forgetting it (`tests/wrappers.rs` stacks every wrapper and checks).
pub trait BlockDevice: Send + Sync {
    /// Size of one block in bytes (a power of two).
    fn block_size(&self) -> usize;
    /// Number of blocks on the device.
    fn block_count(&self) -> u64;
    /// Reads block `block` into `buf`, which must be exactly one block long, filling all
    /// of it or failing (callers pass reused buffers: bytes left unwritten would leak).
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()>;
    /// Reads consecutive blocks from `first` into `buf` (whole blocks): one request to a
    /// device that models its timing. [`read_each`] does it block by block.
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()>;
    /// Writes `buf` (exactly one block) to block `block`. Not durable until `flush`.
    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> Result<()>;
    /// Writes `buf` (whole blocks) to consecutive blocks from `first`: one request to a
    /// device that models its timing (a disk streams it). Each block is written
    /// atomically; the blocks may reach the media in any order. [`write_each`] does it
    /// block by block.
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()>;
    /// Durability barrier: every write that returned before this call is durable when it
    /// returns `Ok`.
    fn flush(&self) -> Result<()>;
    /// The I/O this device has served so far.
    fn stats(&self) -> IoStats;
    /// What else this device can do. A wrapper lists its own, and those of the device
    /// below that it passes on (often through an implementation of its own that does its
    /// part and calls down); [`BlockDeviceExt`] falls back to the core for the rest.
    fn capabilities(&self) -> Capabilities<'_>;
}

/// The optional parts of a device, each present or not. Callers reach them through
/// [`BlockDeviceExt`], which does the plain thing when one is missing.
#[derive(Clone, Copy, Default)]
pub struct Capabilities<'a> {
    pub gather: Option<&'a dyn GatherWrites>,
    pub part_reads: Option<&'a dyn PartReads>,
    pub ranges: Option<&'a dyn RangeWrites>,
    pub hints: Option<&'a dyn ReadHints>,
    pub reservation: Option<&'a dyn Reservation>,
    pub history: Option<&'a dyn History>,
    pub counters: Option<&'a dyn DeviceCounters>,
}

impl Capabilities<'_> {
    /// The names of the capabilities present, for messages and tests.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (present, name) in [
            (self.gather.is_some(), "gather"),
            (self.part_reads.is_some(), "part_reads"),
            (self.ranges.is_some(), "ranges"),
            (self.hints.is_some(), "hints"),
            (self.reservation.is_some(), "reservation"),
            (self.history.is_some(), "history"),
            (self.counters.is_some(), "counters"),
        ] {
            if present {
                v.push(name);
            }
        }
        v
    }
}

/// Writes of runs given in pieces, gathered by the device itself (an image file:
/// `pwritev`) instead of concatenated by the caller.
pub trait GatherWrites: Send + Sync {
    /// Writes `parts` (each whole blocks), one after another, to consecutive blocks from
    /// `first`: [`BlockDevice::write_blocks`] of their concatenation.
    fn write_blocks_gather(&self, first: BlockNo, parts: &[&[u8]], class: WriteClass)
        -> Result<()>;
}

/// Reads of byte ranges that need not start or end on a block boundary.
pub trait PartReads: Send + Sync {
    /// Reads `buf.len()` bytes starting `skip` bytes into block `first` (they may run on
    /// into the blocks after it), without the rest of its first and last blocks.
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()>;
}

/// Range writes, as in Bark: the device picks where a run goes among candidates.
pub trait RangeWrites: Send + Sync {
    /// Writes `buf` (whole blocks, kept together and in order) at whichever of
    /// `candidates` the device finds cheapest, and returns the block it chose (a disk
    /// model: the one its head reaches first).
    fn write_range(&self, candidates: &[BlockNo], buf: &[u8], class: WriteClass)
        -> Result<BlockNo>;
}

/// Hints about reads to come.
pub trait ReadHints: Send + Sync {
    /// Blocks `first..first + count` will be read soon: a device that can start reading
    /// them in the background (an image file, through the host's page cache) does, so
    /// that the reads that follow, one at a time on the path of some caller, find them
    /// there. Never fails.
    fn will_need(&self, first: BlockNo, count: u64);
}

/// Storage reserved before it is written.
pub trait Reservation: Send + Sync {
    /// Makes sure blocks `first..first + count` have storage behind them, so that
    /// writing them later cannot fail for lack of room where the image lives (a sparse
    /// image file on a host file system that fills up). A file system calls it when it
    /// allocates a block, so that the error reaches the write(2) that needed the block
    /// instead of a write-back after it returned.
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()>;
    /// What the host can still give, where it may run out before the device does; None
    /// when the device's own size is the only limit.
    fn host_room(&self) -> Option<HostRoom>;
}

/// Room where a device's storage lives (a sparse image's host file system).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRoom {
    /// Bytes the host can still allocate.
    pub free: u64,
    /// Bytes of the device with no host storage behind them yet (at most).
    pub unbacked: u64,
}

impl HostRoom {
    /// Of `fs_free` bytes a file system on the device has free, how many can surely be
    /// written: free blocks might all lie where no storage is yet, and those count
    /// only as far as the host has room.
    pub fn writable(&self, fs_free: u64) -> u64 {
        let short = self.unbacked.min(fs_free).saturating_sub(self.free);
        fs_free - short
    }
}

/// A history of the device's requests that named points can be put into.
pub trait History: Send + Sync {
    /// Inserts a named mark (see [`RecordingDevice`]): crash states are cut at
    /// operation boundaries, fsync returns and patchgroup syncs.
    fn mark(&self, name: &str);
}

/// Counters of the device's own, beyond [`IoStats`].
pub trait DeviceCounters: Send + Sync {
    /// By name (a disk model's latencies and range-write choices).
    fn extra_stats(&self) -> Vec<(String, u64)>;
}

/// The capabilities as methods on every device, each doing the plain thing (whole
/// blocks, the first candidate, nothing) where the device lacks it.
pub trait BlockDeviceExt: BlockDevice {
    fn write_blocks_gather(
        &self,
        first: BlockNo,
        parts: &[&[u8]],
        class: WriteClass,
    ) -> Result<()> {
        match self.capabilities().gather {
            Some(g) => g.write_blocks_gather(first, parts, class),
            None => self.write_blocks(first, &parts.concat(), class),
        }
    }
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        if let Some(p) = self.capabilities().part_reads {
            return p.read_part(first, skip, buf);
        }
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.block_size();
        if skip == 0 && buf.len() % bs == 0 {
            return self.read_blocks(first, buf);
        }
        let blocks = (skip + buf.len()).div_ceil(bs);
        let mut whole = vec![0u8; blocks * bs];
        self.read_blocks(first, &mut whole)?;
        buf.copy_from_slice(&whole[skip..skip + buf.len()]);
        Ok(())
    }
    /// Without the capability: the first candidate, which is what a caller that lists
    /// them in its preferred order would choose anyway.
    fn write_range(
        &self,
        candidates: &[BlockNo],
        buf: &[u8],
        class: WriteClass,
    ) -> Result<BlockNo> {
        if let Some(r) = self.capabilities().ranges {
            return r.write_range(candidates, buf, class);
        }
        let Some(&first) = candidates.first() else {
            return Err(BlockError::Unsupported("a range write with no candidate"));
        };
        self.write_blocks(first, buf, class)?;
        Ok(first)
    }
    fn will_need(&self, first: BlockNo, count: u64) {
        if let Some(h) = self.capabilities().hints {
            h.will_need(first, count)
        }
    }
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()> {
        match self.capabilities().reservation {
            Some(r) => r.reserve(first, count),
            None => Ok(()),
        }
    }
    fn host_room(&self) -> Option<HostRoom> {
        self.capabilities().reservation.and_then(|r| r.host_room())
    }
    fn mark(&self, name: &str) {
        if let Some(h) = self.capabilities().history {
            h.mark(name)
        }
    }
    fn extra_stats(&self) -> Vec<(String, u64)> {
        match self.capabilities().counters {
            Some(c) => c.extra_stats(),
            None => Vec::new(),
        }
    }
}

impl<T: BlockDevice + ?Sized> BlockDeviceExt for T {}

/// [`BlockDevice::read_blocks`] as reads of one block each, for devices with no cheaper
/// way.
pub fn read_each(dev: &(impl BlockDevice + ?Sized), first: BlockNo, buf: &mut [u8]) -> Result<()> {
    let bs = dev.block_size();
    whole_blocks(bs, buf.len())?;
    for (i, b) in buf.chunks_mut(bs).enumerate() {
        dev.read(first + i as u64, b)?;
    }
    Ok(())
}

/// [`BlockDevice::write_blocks`] as writes of one block each, for devices with no
/// cheaper way.
pub fn write_each(
    dev: &(impl BlockDevice + ?Sized),
    first: BlockNo,
    buf: &[u8],
    class: WriteClass,
) -> Result<()> {
    let bs = dev.block_size();
    whole_blocks(bs, buf.len())?;
    for (i, b) in buf.chunks(bs).enumerate() {
        dev.write(first + i as u64, b, class)?;
    }
    Ok(())
}

/// Checks a request against a device's geometry. Shared by every device so that the
/// error messages are the same everywhere.
/// Checks a request for a run of whole blocks from `first` (the buffer a non-empty
/// multiple of the block size, the run inside the device); returns its length in blocks.
pub fn check_run(dev: &dyn BlockDevice, first: BlockNo, buf_len: usize) -> Result<u64> {
    let bs = dev.block_size();
    let n = whole_blocks(bs, buf_len)?;
    check_request(dev, first.saturating_add(n - 1), bs)?;
    Ok(n)
}

/// How many blocks of `bs` bytes a buffer of `len` holds (a non-empty whole number).
fn whole_blocks(bs: usize, len: usize) -> Result<u64> {
    if len == 0 || len % bs != 0 {
        return Err(BlockError::BadBufferSize {
            got: len,
            block_size: bs,
        });
    }
    Ok((len / bs) as u64)
}

pub fn check_request(dev: &dyn BlockDevice, block: BlockNo, buf_len: usize) -> Result<()> {
    let count = dev.block_count();
    if block >= count {
        return Err(BlockError::OutOfRange { block, count });
    }
    if buf_len != dev.block_size() {
        return Err(BlockError::BadBufferSize {
            got: buf_len,
            block_size: dev.block_size(),
        });
    }
    Ok(())
}

/// Validates a block size: a power of two in [512, 65536].
pub fn check_block_size(block_size: usize) -> Result<()> {
    if !(512..=65536).contains(&block_size) || !block_size.is_power_of_two() {
        return Err(BlockError::BadBlockSize(block_size));
    }
    Ok(())
}

impl<T: BlockDevice + ?Sized> BlockDevice for std::sync::Arc<T> {
    fn block_size(&self) -> usize {
        (**self).block_size()
    }
    fn block_count(&self) -> u64 {
        (**self).block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        (**self).read(block, buf)
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        (**self).read_blocks(first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        (**self).write(block, buf, class)
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        (**self).write_blocks(first, buf, class)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn stats(&self) -> IoStats {
        (**self).stats()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        (**self).capabilities()
    }
}

#[cfg(test)]
mod host_room_tests {
    use super::HostRoom;
    use proptest::prelude::*;

    proptest! {
        /// Against the worst case spelled out: as much of the free space as can be
        /// unbacked is, and each of those bytes needs the host.
        #[test]
        fn writable_is_what_survives_the_worst_placement(
            free in 0u64..1 << 40, unbacked in 0u64..1 << 40, fs_free in 0u64..1 << 40,
        ) {
            let w = HostRoom { free, unbacked }.writable(fs_free);
            let needing_host = unbacked.min(fs_free);
            let backed_free = fs_free - needing_host;
            prop_assert_eq!(w, backed_free + needing_host.min(free));
            prop_assert!(w <= fs_free);
        }
    }

    #[test]
    fn a_host_with_room_limits_nothing_and_a_full_one_leaves_the_backed_part() {
        let r = HostRoom {
            free: 100,
            unbacked: 50,
        };
        assert_eq!(r.writable(1000), 1000);
        let full = HostRoom {
            free: 0,
            unbacked: 600,
        };
        assert_eq!(full.writable(1000), 400);
        assert_eq!(full.writable(500), 0);
    }
}
