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

mod counters;
mod file;
mod mem;
mod model;
mod overlay;
mod recording;

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

/// A device of fixed-size blocks with an explicit durability barrier.
///
/// Methods take `&self` so that one device can be shared by the write-back engine and
/// its flusher thread; implementations synchronise internally.
pub trait BlockDevice: Send + Sync {
    /// Size of one block in bytes (a power of two).
    fn block_size(&self) -> usize;
    /// Number of blocks on the device.
    fn block_count(&self) -> u64;
    /// Reads block `block` into `buf`, which must be exactly one block long, filling all
    /// of it or failing (callers pass reused buffers: bytes left unwritten would leak).
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()>;
    /// Reads consecutive blocks from `first` into `buf` (whole blocks): one request to a
    /// device that models its timing, block reads otherwise.
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        let bs = self.block_size();
        whole_blocks(bs, buf.len())?;
        for (i, b) in buf.chunks_mut(bs).enumerate() {
            self.read(first + i as u64, b)?;
        }
        Ok(())
    }
    /// Reads `buf.len()` bytes starting `skip` bytes into block `first` (they may run on
    /// into the blocks after it): what a reader of a part of a run needs, without the
    /// rest of its first and last blocks where the device can read bytes (an image
    /// file). By default the blocks are read whole and the part copied out.
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
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
    /// Makes sure blocks `first..first + count` have storage behind them, so that
    /// writing them later cannot fail for lack of room where the image lives (a sparse
    /// image file on a host file system that fills up). A file system calls it when it
    /// allocates a block, so that the error reaches the write(2) that needed the block
    /// instead of a write-back after it returned. Nothing to do by default.
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()> {
        let _ = (first, count);
        Ok(())
    }
    /// A hint that blocks `first..first + count` will be read soon: a device that can
    /// start reading them in the background (an image file, through the host's page
    /// cache) does, so that the reads that follow, one at a time on the path of some
    /// caller, find them there. Never fails; nothing by default.
    fn will_need(&self, first: BlockNo, count: u64) {
        let _ = (first, count);
    }
    /// Writes `buf` (exactly one block) to block `block`. Not durable until `flush`.
    fn write(&self, block: BlockNo, buf: &[u8]) -> Result<()>;
    /// Durability barrier: every write that returned before this call is durable when it
    /// returns `Ok`.
    fn flush(&self) -> Result<()>;
    /// Writes `buf` (whole blocks) to consecutive blocks from `first`: one request to a
    /// device that models its timing (a disk streams it), block writes otherwise. Each
    /// block is written atomically; the blocks may reach the media in any order.
    fn write_blocks(&self, first: BlockNo, buf: &[u8]) -> Result<()> {
        let bs = self.block_size();
        whole_blocks(bs, buf.len())?;
        for (i, b) in buf.chunks(bs).enumerate() {
            self.write(first + i as u64, b)?;
        }
        Ok(())
    }
    /// Writes `parts` (each whole blocks), one after another, to consecutive blocks from
    /// `first`: [`write_blocks`](Self::write_blocks) of their concatenation, without
    /// making it where the device can gather them itself (an image file: `pwritev`).
    fn write_blocks_gather(&self, first: BlockNo, parts: &[&[u8]]) -> Result<()> {
        self.write_blocks(first, &parts.concat())
    }
    /// Writes `buf` (whole blocks, kept together and in order) at whichever of
    /// `candidates` the device finds cheapest, and returns the block it chose (range
    /// writes, as in Bark). A device that models a disk's timing ([`DiskModel`]) takes the
    /// one its head reaches first; others take the first candidate, which is what a
    /// caller that lists them in its preferred order would choose anyway.
    fn write_range(&self, candidates: &[BlockNo], buf: &[u8]) -> Result<BlockNo> {
        let Some(&first) = candidates.first() else {
            return Err(BlockError::Unsupported("a range write with no candidate"));
        };
        self.write_blocks(first, buf)?;
        Ok(first)
    }
    /// Inserts a named mark into the device's history (see [`RecordingDevice`]).
    fn mark(&self, name: &str) {
        let _ = name;
    }
    /// The I/O this device has served so far.
    fn stats(&self) -> IoStats;
    /// Counters of the device's own (a disk model's latencies and range-write choices),
    /// by name; none by default. Devices that wrap another pass its counters on.
    fn extra_stats(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
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
    fn write(&self, block: BlockNo, buf: &[u8]) -> Result<()> {
        (**self).write(block, buf)
    }
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()> {
        (**self).reserve(first, count)
    }
    fn will_need(&self, first: BlockNo, count: u64) {
        (**self).will_need(first, count)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8]) -> Result<()> {
        (**self).write_blocks(first, buf)
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        (**self).read_blocks(first, buf)
    }
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        (**self).read_part(first, skip, buf)
    }
    fn write_blocks_gather(&self, first: BlockNo, parts: &[&[u8]]) -> Result<()> {
        (**self).write_blocks_gather(first, parts)
    }
    fn write_range(&self, candidates: &[BlockNo], buf: &[u8]) -> Result<BlockNo> {
        (**self).write_range(candidates, buf)
    }
    fn extra_stats(&self) -> Vec<(String, u64)> {
        (**self).extra_stats()
    }
    fn mark(&self, name: &str) {
        (**self).mark(name)
    }
    fn stats(&self) -> IoStats {
        (**self).stats()
    }
}
