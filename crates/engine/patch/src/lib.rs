//! The patch layer: every change to a block is a *patch* with explicit dependencies, and
//! the write-back engine writes blocks in an order that respects them (Featherstitch).
//!
//! # Model
//!
//! * A [`PatchId`] names one change: bytes of a block (with undo bytes, or *hard*: without
//!   them), an XOR of bits in one 32-bit word, or an *empty* patch that only joins
//!   dependencies. Each patch has *befores* (patches that must be durable first).
//! * A new patch automatically comes after every earlier pending patch it overlaps on the
//!   same block, so the newest bytes always win.
//! * A patch is *ready* when each of its befores is durable, or is a ready patch on the
//!   same block (it travels in the same block write), or is an empty patch whose befores
//!   are all ready in that sense.
//! * **Commit point of write-back** ([`Engine::epoch`]): the engine writes every block
//!   carrying ready patches, with the non-ready patches rolled back from their undo bytes,
//!   then flushes the device. Only when that flush returns are the written patches durable;
//!   they leave the graph and their afters may become ready.
//! * Hard patches are never rolled back: a block gets one only when no patch on another
//!   block depends on the block, and it then absorbs every pending patch of the block, so
//!   every later patch on the block depends on it.
//!
//! Unknown ids are durable: a patch leaves the arena only when it is on disk, so a
//! `PatchId` the engine no longer knows needs no waiting.
//!
//! # Example
//!
//! ```
//! use quilt_block::MemDevice;
//! use quilt_patch::{ChangeOpts, Engine, EngineOptions};
//! use std::sync::Arc;
//!
//! let engine = Engine::new(Arc::new(MemDevice::new(4096, 64)?), EngineOptions::default());
//! let inode = engine.write(3, 0, b"inode", &[], ChangeOpts::default())?;
//! let entry = engine.write(7, 0, b"entry", &[inode], ChangeOpts::default())?; // after the inode
//! engine.flush_until(entry)?; // both durable, in order; nothing else is written
//! assert!(engine.is_durable(inode) && engine.is_durable(entry));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Everything sits behind one lock ([`Engine`] is cheap to clone and `Send + Sync`); the
//! device I/O of an epoch runs outside that lock so that writers are not stalled by disk
//! latency.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod capture;
mod engine;
mod epoch;
mod graph;
mod overlap;
mod patchgroup;
mod services;
mod stats;
pub mod synth;
mod vfs;

pub use capture::CapturedTxn;
pub use engine::{ChangeOpts, Durability, Engine, EngineOptions, RUN_BLOCKS_MAX};
pub use epoch::EpochReport;
pub use graph::PatchId;
pub use patchgroup::{CallerId, PatchgroupError, PatchgroupId};
pub use services::{Op, Services, Transactions};
pub use stats::EngineStats;
pub use vfs::pg_error;

/// A block's bytes, shared between the cache, an epoch's image and a journal's capture
/// without copying. The buffer is a separate allocation of exactly the block size: an
/// `Arc<[u8]>` puts its counts in front of the bytes, which made each 4 KiB block a
/// 4,112-byte allocation that the allocator rounds up by a third (128 MiB of cached
/// blocks took 170 MiB; this way, 130).
pub type BlockBuf = std::sync::Arc<Box<[u8]>>;

/// A [`BlockBuf`] holding `bytes` (no copy when the vector's capacity is its length).
pub fn block_buf(bytes: Vec<u8>) -> BlockBuf {
    std::sync::Arc::new(bytes.into_boxed_slice())
}

pub use quilt_block::{BlockDevice, BlockError, BlockNo};

/// Errors of the patch layer.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error("change of {len} bytes at offset {offset} does not fit in a {block_size}-byte block")]
    OutOfBlock {
        offset: usize,
        len: usize,
        block_size: usize,
    },
    #[error("bit patches work on aligned 32-bit words; offset {0} is not a multiple of 4")]
    UnalignedWord(usize),
    #[error("adding this dependency would create a cycle")]
    Cycle,
    #[error("patch is already durable or being written; it can take no new befores")]
    NotPending,
    #[error("the patches to flush depend on a patchgroup that is not released yet")]
    Pinned,
    #[error("the engine stopped after a failed write-back ({0}); the image holds a crash state")]
    Failed(String),
    #[error(transparent)]
    Patchgroup(#[from] patchgroup::PatchgroupError),
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// A transaction service found its log damaged, or stopped after a failure.
    #[error("{0}")]
    Damaged(String),
    /// Inside `Engine::without_io`: the block is not cached and was not read.
    #[error("block {0} is not cached (no device reads here)")]
    Miss(BlockNo),
}

impl PatchError {
    /// The errno a POSIX front end should report.
    pub fn errno(&self) -> i32 {
        match self {
            PatchError::Block(BlockError::OutOfRange { .. }) => libc_errno::EINVAL,
            PatchError::Block(_) => libc_errno::EIO,
            PatchError::OutOfBlock { .. } | PatchError::UnalignedWord(_) => libc_errno::EINVAL,
            PatchError::Cycle | PatchError::NotPending => libc_errno::EINVAL,
            PatchError::Pinned => libc_errno::EAGAIN,
            PatchError::Failed(_) => libc_errno::EIO,
            PatchError::Patchgroup(e) => e.errno(),
            PatchError::Invalid(_) => libc_errno::EINVAL,
            PatchError::Damaged(_) => libc_errno::EIO,
            PatchError::Miss(_) => libc_errno::EAGAIN,
        }
    }
}

/// The few errno values we need, without a libc dependency in this crate.
pub(crate) mod libc_errno {
    pub const ENOENT: i32 = 2;
    pub const EIO: i32 = 5;
    pub const EAGAIN: i32 = 11;
    pub const EBUSY: i32 = 16;
    pub const EEXIST: i32 = 17;
    pub const EINVAL: i32 = 22;
}

pub type Result<T, E = PatchError> = std::result::Result<T, E>;
