//! quilt-ext2: an ext2-compatible file system over the patch layer.
//!
//! Every block change is a patch (`quilt_patch::Engine`), so the consistency mode is a
//! property of the dependencies the module declares, not of its code paths:
//!
//! - [`Mode::Async`] declares no dependencies across blocks;
//! - [`Mode::SoftUpdates`] declares the soft-updates rules (allocation before pointer,
//!   initialized block before pointer, initialized inode before the entry naming it,
//!   entry removal before the inode is freed, the rename sequences).
//!
//! Modules: `format` (on-disk structures), `mkfs`, `fs` (mount, superblock, the
//! [`quilt_vfs::FileSystem`] implementation), `alloc` (bitmaps), `inode` (inodes, block
//! maps, truncation), `dir` (directory entries), `xattr` (user.* attributes in an EA
//! block), `batch` (atomic batches: a trial mount, then one journal transaction).

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod format;
pub mod journal;
pub mod mkfs;

mod acl;
mod alloc;
mod batch;
mod dir;
pub mod extjournal;
mod files;
mod flags;
mod fs;
mod inode;
mod orphan;
mod pending;
mod xattr;

pub use fs::{Errors, Ext2, JournalDevice, Journals, Mode, MountOptions};
pub use journal::{JournalPlace, JournalRequest, JournalStarter};
pub use mkfs::{mkfs, MkfsOptions};
/// Where journal commits go (ring, skip, null): the journal module's, as mounts name it.
pub use quilt_journal::{Observer as JournalObserver, Placement as JournalPlacement};
