//! The FUSE kernel protocol, written for quiltfs: a session over /dev/fuse served by
//! worker threads with cloned descriptors, requests parsed (bounds-checked) from the
//! read buffer, replies and notifications, and mounting as `fuseblk` (so sync(1) and
//! syncfs(2) reach the server as FUSE_SYNCFS, and umount waits for DESTROY) or plain
//! `fuse`.
//!
//! It replaces the fuser crate, which dispatches neither FUSE_SYNCFS nor FUSE_TMPFILE
//! and hides the protocol choices (request counts, notifications, io_uring later) that
//! the adapter needs to make.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod abi;
mod channel;
mod handoff;
pub mod mount;
mod notify;
mod reply;
mod request;
mod ring;
mod session;

pub use abi::{Attr, Entry};
pub use channel::Channel;
pub use handoff::{HandoffMode, RingStats};
pub use mount::{mount, unmount, BlockSource, LoopDevice, MountKind, MountOptions, Mounted};
pub use notify::Notifier;
pub use reply::{DirBuf, Reply, Statfs};
pub use request::{Header, Op, Proto, Request, SetattrIn};
pub use session::{Handler, InitReply, KernelInit, RingOptions, Session, Transport};
