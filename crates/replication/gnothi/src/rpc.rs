//! The messages between replicas and clients: Raft's own, and the data path's. One
//! enum each way, serialisable, so any transport carries them: in-process for the
//! simulation (`net.rs`), gRPC between processes (`transport.rs`).

use crate::geometry::Geometry;
use crate::meta::{Meta, Outcome, Proposal};
use crate::table::{Holders, Version, WriteId};
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};

/// The largest data a message may carry (a batch of blocks): bigger writes are split.
pub const MAX_DATA: usize = 1 << 20;

/// The largest message a transport must carry: a batch of blocks and its envelope.
/// Agreement's own messages are cut to fit (`net.rs`: entries per append; node.rs:
/// snapshot chunks).
pub const MAX_MESSAGE: usize = MAX_DATA + (64 << 10);

#[derive(Debug, Clone, Serialize, Deserialize)]
#[allow(clippy::large_enum_variant)]
pub enum Request {
    AppendEntries(AppendEntriesRequest<Meta>),
    Vote(VoteRequest<u64>),
    InstallSnapshot(InstallSnapshotRequest<Meta>),
    /// Stage a write's data (whole blocks from `first`) durably, before its metadata
    /// is proposed.
    PutData {
        write: WriteId,
        first: u64,
        // Bytes, not a sequence of u8: the same encoding in postcard, without a call
        // per byte (a tenth of a replica's CPU at 1 MiB writes).
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Propose a write's (or a repair's) metadata; the leader answers once applied.
    Propose(Proposal),
    /// The leader's read index: a log index every read served after it must reflect.
    ReadIndex,
    /// Linearizable read of `count` blocks from `first`.
    Read {
        first: u64,
        count: u32,
    },
    /// What this replica holds of these blocks now, with versions (Phase 2 and
    /// repairs; not a linearizable read: the caller checks versions itself).
    Fetch {
        first: u64,
        count: u32,
    },
    Status,
    /// Verify every copy this replica holds against its checksum; a damaged one is
    /// reported lost and fetched again (Phase 2), before a second failure could make
    /// it the last copy.
    Scrub,
    /// (To the leader.) Replace slot `slot`'s server by the server `node` at `addr`,
    /// which must be running with empty devices labelled for that slot: it joins as a
    /// learner, catches up (a snapshot), then a joint membership change makes it the
    /// slot's voter in place of the old one, whose copies stop counting; Phase 2 on the
    /// new server rebuilds them.
    Replace {
        slot: u16,
        node: u64,
        addr: String,
    },
    /// What this replica knows and keeps of one block, for diagnosis (a check that
    /// found a violation asks every replica): not a read, and nothing is changed.
    Inspect {
        block: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockAnswer {
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    Zero,
    /// Not held here at the current version; these replicas do.
    NotHere(Holders),
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    AppendEntries(Result<AppendEntriesResponse<u64>, RaftError<u64>>),
    Vote(Result<VoteResponse<u64>, RaftError<u64>>),
    InstallSnapshot(Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>),
    Stored,
    Proposed(Outcome),
    ReadIndex(u64),
    Blocks(Vec<BlockAnswer>),
    /// Per block: the version held here, and the data if held.
    Fetched(Vec<(Version, Option<serde_bytes::ByteBuf>)>),
    Status(Status),
    /// Copies verified, and those found damaged.
    Scrubbed {
        checked: u64,
        damaged: u64,
    },
    /// The slot has its new server, as of membership `epoch`.
    Replaced {
        epoch: u64,
    },
    Inspected(BlockView),
    Error(RpcError),
}

/// One replica's view of one block (`Request::Inspect`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockView {
    pub replica: u16,
    pub node: u64,
    /// The last log index it applied.
    pub applied: u64,
    /// Its table's entry for the block.
    pub version: Version,
    pub checksum: u32,
    pub holders: Holders,
    pub reserve: Holders,
    /// The version it found missing or damaged here, if it did (reads go elsewhere).
    pub lost: Option<Version>,
    /// Its home copy, if the block's slice is one it keeps: the copy's first eight
    /// bytes (little-endian: a check's value) and whether it matches the checksum.
    pub home: Option<(u64, bool)>,
    /// Its reserve copy, if it keeps one: version, first eight bytes, checksum match.
    pub reserved: Option<(Version, u64, bool)>,
}

impl std::fmt::Display for BlockView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |h: Holders| h.iter().collect::<Vec<_>>();
        let crc = |ok: bool| if ok { "crc ok" } else { "crc bad" };
        write!(
            f,
            "replica {} (server {}, applied {}): version {} (crc {:#x}), holders {:?}, \
             reserve {:?}",
            self.replica,
            self.node,
            self.applied,
            self.version,
            self.checksum,
            set(self.holders),
            set(self.reserve)
        )?;
        if let Some(v) = self.lost {
            write!(f, ", found lost at version {v}")?;
        }
        match self.home {
            Some((x, ok)) => write!(f, ", home copy {x:#x} ({})", crc(ok))?,
            None => write!(f, ", no home copy")?,
        }
        if let Some((v, x, ok)) = self.reserved {
            write!(f, ", reserve copy {x:#x} at version {v} ({})", crc(ok))?;
        }
        Ok(())
    }
}

/// A replica's view of itself and the volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Its slot in the placement.
    pub replica: u16,
    /// Its identity in agreement (the slot, plus `n` per server replaced in it).
    pub node: u64,
    /// Whether it is its slot's server in the membership it applied (a replaced one
    /// is not; a new one is not until the change commits).
    pub is_member: bool,
    /// The log index of the membership it applied: what a client routes by.
    pub epoch: u64,
    /// Each slot's server and address in that membership.
    pub slots: Vec<Option<(u64, String)>>,
    pub volume: String,
    pub geometry: Geometry,
    pub leader: Option<u64>,
    pub is_leader: bool,
    pub term: u64,
    pub last_log_index: u64,
    pub applied: u64,
    /// Blocks of its preferred slices it lacks at the current version.
    pub incomplete: u64,
    pub reserve_used: u64,
    /// Held blocks found damaged (checksum) since the replica started.
    pub checksum_failures: u64,
    /// Write-backs of placed data that failed since the replica started (its data
    /// device full or failing; the data waits in the data log meanwhile).
    pub write_back_failures: u64,
    /// Blocks of the Raft log's ring in use, and its size.
    pub raft_log_used: u64,
    pub raft_log_blocks: u64,
    pub data_log_used: u64,
    pub data_log_blocks: u64,
    pub members: Vec<u64>,
    /// Requests each device has served since the replica started.
    pub log_io: quilt_block::IoStats,
    pub data_io: quilt_block::IoStats,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    #[error("not the leader (leader: {leader:?})")]
    NotLeader { leader: Option<u64> },
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("the replica cannot serve this now: {0}")]
    Unavailable(String),
    #[error("the replica failed: {0}")]
    Failed(String),
}

impl Response {
    /// An answer of the wrong kind for its request: a protocol error, never trusted.
    pub fn unexpected(&self) -> RpcError {
        RpcError::Failed(format!(
            "unexpected answer {:?}",
            std::mem::discriminant(self)
        ))
    }
}

/// What an answered `Write` proposal came to, or why it has no answer.
pub fn outcome_version(o: &Outcome) -> Option<Version> {
    match o {
        Outcome::Applied(v) | Outcome::Duplicate(v) => Some(*v),
        Outcome::Refused(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data fields are encoded as bytes, which postcard writes exactly as it wrote the
    /// sequences of u8 they were before: servers of either build understand each other.
    #[test]
    fn data_is_encoded_as_it_was_as_a_sequence() {
        let data = vec![7u8, 0, 255];
        let as_seq = postcard::to_stdvec(&(0u8, data.clone())).unwrap();
        assert_eq!(
            postcard::to_stdvec(&BlockAnswer::Data(data.clone())).unwrap(),
            as_seq
        );
        let fetched = Response::Fetched(vec![
            (5, Some(serde_bytes::ByteBuf::from(data.clone()))),
            (6, None),
        ]);
        let old: Vec<(Version, Option<Vec<u8>>)> = vec![(5, Some(data)), (6, None)];
        let enc = postcard::to_stdvec(&fetched).unwrap();
        let variant = enc[0];
        let mut want = vec![variant];
        want.extend(postcard::to_stdvec(&old).unwrap());
        assert_eq!(enc, want);
        let back: Response = postcard::from_bytes(&enc).unwrap();
        assert!(
            matches!(back, Response::Fetched(v) if v.len() == 2 && v[0].1.as_ref().map(|b| b.to_vec()) == Some(vec![7u8, 0, 255]))
        );
    }
}
