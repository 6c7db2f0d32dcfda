//! The conformance suite lives in `tests/`: one POSIX model that every file-system
//! module behind `quilt_vfs::FileSystem` must agree with (`tests/model.rs`), natively
//! and through the FUSE adapter and the kernel. This crate has no code of its own.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]
