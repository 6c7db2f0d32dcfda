//! Replicated block storage that separates data from metadata (Gnothi, USENIX ATC 2012):
//! a volume on `2f+1` replicas whose writes send their metadata (which blocks, which
//! version, a checksum) to every replica through agreement, and their data to only the
//! `f+1` replicas of the block's slice's preferred quorum. The design, and what of it is
//! built, is `docs/design/gnothi.md`.
//!
//! This crate holds the protocol's deterministic core, free of any network or runtime:
//! [`Geometry`] (slices, preferred quorums, where a replica keeps a slice), the
//! replicated [`MetaTable`] with the [`Command`]s that change it (every replica applies
//! the same commands in the same order and holds the same table), and a replica's
//! [`datalog`], where written data is durable before its metadata commits.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod client;
mod codec;
pub mod datalog;
pub mod device;
mod geometry;
pub mod history;
pub mod layout;
pub mod meta;
pub mod metrics;
pub mod net;
pub mod node;
pub mod raftlog;
pub mod replica;
pub mod rpc;
pub mod server;
pub mod sim;
pub mod store;
mod table;
pub mod transport;
pub mod workload;

pub use geometry::{Geometry, GeometryError, ReplicaId, System};
pub use table::{
    Applied, BlockMeta, Command, CommandError, Holders, MetaTable, Stored, Version, WriteId,
};
