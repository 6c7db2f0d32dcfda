//! Per-subtree consistency and durability in one namespace (Cudele, IPDPS 2018).
//!
//! Clients share one namespace, kept by a metadata service in one of quiltfs's file
//! system modules. Each subtree has a [`Policy`]: strong consistency sends every
//! operation to the service; weak and invisible let a client *decouple* the subtree,
//! work in its own [`journal`] under inode numbers granted in advance, and [`merge`]
//! later. Durability says where that journal must be before an update counts: nowhere
//! (memory), the client's disk, or the service's.
//!
//! Here: policies, the client journal's format, the validated, atomic, repeatable
//! merge of a journal into any [`quilt_vfs::FileSystem`], the metadata service
//! ([`service::Mds`], served over gRPC by [`transport`]), and the client library
//! ([`client`]: the namespace as a `FileSystem` through RPCs, and decoupled subtrees).
//! The design and what of it is built is `docs/design/cudele.md`.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod address;
pub mod client;
pub mod journal;
pub mod merge;
pub mod policy;
pub mod recover;
pub mod rpc;
pub mod service;
pub mod transport;
pub mod view;

pub use address::MdsAddress;
pub use client::{Client, DecoupleOptions, Decoupled, RemoteFs};
pub use journal::{ClientJournal, Event, Header};
pub use merge::{MergeError, Plan, Scope};
pub use policy::{Consistency, Durability, Interfere, Mechanism, Policy, Preset};
pub use service::{Mds, MdsConfig};
pub use view::DecoupledFs;
