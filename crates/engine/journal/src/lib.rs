//! The journal module: JBD2 transactions over the patch layer, and recovery.
//!
//! - `format` — the JBD2 on-disk format (superblock, descriptor, commit, revoke blocks).
//! - `recovery` — replay of committed transactions (the three passes of the kernel's and
//!   e2fsck's recovery: scan, revoke, replay).
//! - `writer` — the running journal: the engine's captured transactions become JBD2
//!   transactions; commit, checkpoint, group commit.
//! - `skip` — log skipping (Bark): each transaction one self-identifying record, written
//!   by a range write wherever the disk's head gets first, found again by a scan.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod format;
pub mod recovery;
pub mod skip;
pub mod writer;

pub use format::JournalSuper;
pub use recovery::{recover, recover_on, RecoveryReport};
pub use writer::{Journal, JournalOptions, JournalStats, Observer, Placement};

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("damaged journal: {0}")]
    Corrupt(String),
    #[error("unsupported journal: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Block(#[from] quilt_block::BlockError),
    #[error(transparent)]
    Patch(#[from] quilt_patch::PatchError),
}

pub type Result<T, E = JournalError> = std::result::Result<T, E>;

/// Where the journal lives: device block of each journal block (block 0 is the journal
/// superblock), as the journal inode maps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalMap {
    pub blocks: Vec<u64>,
}

impl JournalMap {
    pub fn len(&self) -> u32 {
        self.blocks.len() as u32
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    /// Whether journal blocks `j..j + n` lie on consecutive device blocks.
    pub fn contiguous(&self, j: u32, n: u32) -> bool {
        let (j, n) = (j as usize, n as usize);
        self.blocks
            .get(j..j + n)
            .is_some_and(|s| s.windows(2).all(|w| w[1] == w[0] + 1))
    }

    /// The identity map of a device of `blocks` blocks (a journal on a device of its
    /// own).
    pub fn whole_device(blocks: u64) -> JournalMap {
        JournalMap {
            blocks: (0..blocks).collect(),
        }
    }

    /// Device block of journal block `j`.
    pub fn device_block(&self, j: u32) -> Result<u64> {
        self.blocks
            .get(j as usize)
            .copied()
            .ok_or_else(|| JournalError::Corrupt(format!("journal block {j} is past its end")))
    }
}
