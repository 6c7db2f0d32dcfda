//! betrfs: a file system whose names, inodes and data are keys of one Bε-tree
//! (`quilt-betree`), keyed by full path as BetrFS keys them, so that a directory's
//! entries and a whole subtree are contiguous key ranges: `readdir` is a range scan, a
//! small write is an upsert message (no read of the old block), removing a file's data
//! is one range-delete message. The key schema is in [`keys`]; the operations in `fs`.
//!
//! ```
//! use quilt_betrfs::{mkfs, Betrfs, MountOptions};
//! use quilt_block::MemDevice;
//! use quilt_vfs::{Ctx, FileSystem};
//! use std::sync::Arc;
//!
//! let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
//! mkfs(dev.clone()).unwrap();
//! let fs = Betrfs::open(dev, MountOptions::default()).unwrap();
//! let f = fs.mknod(fs.root(), b"hello", libc::S_IFREG | 0o644, 0, &Ctx::root()).unwrap();
//! fs.write(f.ino, 0, b"hi there", &Ctx::root()).unwrap();
//! assert_eq!(fs.read(f.ino, 3, 100).unwrap(), b"there");
//! fs.unmount().unwrap();
//! ```

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod clone;
mod data;
mod fs;
pub mod fsck;
pub mod keys;
mod names;
pub mod record;
mod recover;
/// The rename-intent record's decoder, for the fuzz targets.
#[doc(hidden)]
pub use recover::decode_intent;
mod rename;
mod undo;
mod zones;

pub use fs::{Betrfs, MountOptions, LINK_MAX, MAX_FILE_SIZE, NAME_MAX, NOT_BETRFS, ROOT_INO};
use quilt_betree::{Options, Tree};
use quilt_block::BlockDevice;
use quilt_patch::Engine;
use quilt_vfs::{FsError, Result};
use std::sync::Arc;

/// Tree settings for a device: the tree's defaults, scaled down for small devices (a
/// log of at most an eighth of it, dirty nodes bounded by an eighth).
pub fn tree_options(block_size: usize, blocks: u64) -> Options {
    let bytes = block_size as u64 * blocks;
    let mut o = Options::default();
    if bytes < (256 << 20) {
        o.node_bytes = (64 << 10).max(block_size * 8);
    }
    // The tree keeps sixteen nodes free for its checkpoints (`Space::margin`): a
    // device of a few MiB takes smaller nodes (fewer children each, so that a key
    // may still hold a path of half a KiB).
    if bytes < (8 << 20) {
        o.node_bytes = (16 << 10).max(block_size * 4);
        o.fanout = 8;
    }
    // The log takes every batch's data: a ring much smaller than what a file system
    // writes between checkpoints makes checkpoints follow the log's size instead of the
    // dirty nodes (a 16 MiB ring checkpointed every 12 MB of a sequential write). Large
    // devices get a ring of 1/64 of the device, up to 256 MiB (replay reads at most that).
    o.log_blocks = o
        .log_blocks
        .max((blocks / 64).min((256 << 20) / block_size as u64))
        .min(blocks / 8)
        .max(64);
    // Dirty nodes at most the log's size: while every value went through the log, its
    // ring bounded what a checkpoint wrote; with large values logged by reference it
    // no longer does, and a small image on a host that runs out of room (a sparse file)
    // needs that bound to keep the room for a checkpoint and the one in flight small.
    o.dirty_bytes = o
        .dirty_bytes
        .min((bytes / 8) as usize)
        .min((o.log_blocks * block_size as u64) as usize)
        .max(o.node_bytes * 4);
    // A checkpoint hands every dirty node to the engine at once: with room for them all,
    // it goes out in one write-back and one flush at its end, instead of throttled
    // write-backs (each with its own flush) while it is being written.
    o.engine_cache_bytes = o.engine_cache_bytes.max(o.dirty_bytes + (8 << 20));
    o
}

fn tree_error(e: quilt_betree::Error) -> FsError {
    match e {
        quilt_betree::Error::Corrupt(m) => FsError::Corrupt(m),
        e @ quilt_betree::Error::Checksum { .. } => FsError::Corrupt(e.to_string()),
        quilt_betree::Error::NotFormatted => {
            FsError::Corrupt("not a betrfs image (no Bε-tree header)".into())
        }
        quilt_betree::Error::Patch(e) => e.into(),
        e => FsError::Io(quilt_vfs::IoError::caused_by(e)),
    }
}

/// Makes a new betrfs on `dev` (what it held is lost).
pub fn mkfs(dev: Arc<dyn BlockDevice>) -> Result<()> {
    mkfs_on(engine_for(dev))
}

/// [`mkfs`] on an engine built by the caller (the wiring crate); [`engine_for`] is the
/// engine betrfs wants.
pub fn mkfs_on(engine: Engine) -> Result<()> {
    let opts = tree_options(engine.block_size(), engine.block_count());
    let tree = Tree::create_on(engine, opts).map_err(tree_error)?;
    Betrfs::format(&tree)?;
    tree.close().map_err(tree_error)
}

/// The engine betrfs's tree wants on `dev` (its cache sized for a checkpoint's nodes).
pub fn engine_for(dev: Arc<dyn BlockDevice>) -> Engine {
    let opts = tree_options(dev.block_size(), dev.block_count());
    quilt_betree::engine_for(dev, &opts)
}

impl Betrfs {
    /// Opens the tree on `dev` (its checkpoint and log) and mounts the file system.
    pub fn open(dev: Arc<dyn BlockDevice>, opts: MountOptions) -> Result<Betrfs> {
        Betrfs::open_on(engine_for(dev), opts)
    }

    /// [`Betrfs::open`] on an engine built by the caller (the wiring crate), as
    /// `Ext2::open` takes one.
    pub fn open_on(engine: Engine, opts: MountOptions) -> Result<Betrfs> {
        let topts = tree_options(engine.block_size(), engine.block_count());
        let tree = Tree::open_on(engine, topts).map_err(tree_error)?;
        Betrfs::mount(tree, opts)
    }
}
