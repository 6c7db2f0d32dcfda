//! The agreement log's types, and the one place that names openraft's. Everything the
//! crate proposes goes through Raft as a [`Proposal`]: a table [`Command`] and, for a
//! client's write, the client session that makes a retried proposal apply once.
//!
//! openraft 0.9 (the stable line, pinned exactly; `docs/design/gnothi.md` §7): an
//! upgrade to 0.10 changes the trait signatures of this module's users (`raftlog.rs`,
//! `machine.rs`, `net.rs`), not the protocol.

use crate::table::{Command, CommandError, Version, WriteId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::io::Cursor;

pub use openraft::BasicNode;

openraft::declare_raft_types!(
    /// Gnothi's Raft: metadata proposals in, their outcome out; nodes are replica ids,
    /// addressed by a `host:port` string.
    pub Meta:
        D = Batch,
        R = Vec<Outcome>,
        NodeId = u64,
        Node = BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<Meta>;
pub type Entry = openraft::Entry<Meta>;
pub type LogId = openraft::LogId<u64>;
pub type Vote = openraft::Vote<u64>;
pub type StorageError = openraft::StorageError<u64>;
pub type SnapshotMeta = openraft::SnapshotMeta<u64, BasicNode>;
pub type StoredMembership = openraft::StoredMembership<u64, BasicNode>;

/// A client's place in its own sequence of writes: `seq` names this write; every seq
/// below `done_below` was answered, so the client will never retry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub client: u64,
    pub seq: u64,
    pub done_below: u64,
}

/// One entry of the agreement log: proposals the leader batched (the paper's write
/// batch), applied in order, each with its own outcome. A block's version is the index
/// of the entry that wrote it, so the leader puts only writes to disjoint blocks in one
/// batch (a second write to a block in the same entry would be refused as stale, the
/// same way on every replica).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch(pub Vec<Proposal>);

/// One proposal: a table command, with the client session of a write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub session: Option<Session>,
    pub command: Command,
}

/// What applying a proposal came to, the same on every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied at this log index (a write's blocks now have this version).
    Applied(Version),
    /// A retry of a write applied before, at that index: nothing changed now.
    Duplicate(Version),
    /// The table refused it (the same way on every replica); nothing changed.
    Refused(CommandError),
}

/// Which writes each client had applied, so that a retried proposal (its first try
/// committed, but the answer was lost) applies once: applying the same data again
/// later could overwrite a newer write by another client.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sessions {
    clients: HashMap<u64, ClientWrites>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct ClientWrites {
    /// Every seq below this was answered (the client said so).
    done_below: u64,
    /// Applied seqs at or above `done_below`, with their index.
    applied: BTreeSet<(u64, Version)>,
}

/// What [`Sessions::applied`] says of a write abandoned before it was applied
/// (`Command::Abandon`): no index is this large.
pub const ABANDONED: Version = Version::MAX;

impl Sessions {
    /// Records `w` as abandoned unless it was applied: applied later, it is refused.
    /// (One its client already let go of needs nothing: a late copy of it is
    /// `forgotten`, and changes nothing.)
    pub fn abandon(&mut self, w: WriteId) {
        let c = self.clients.entry(w.client).or_default();
        if w.seq >= c.done_below
            && c.applied
                .range((w.seq, 0)..=(w.seq, Version::MAX))
                .next()
                .is_none()
        {
            c.applied.insert((w.seq, ABANDONED));
        }
    }

    /// The index `s.seq` was applied at, if it was ([`ABANDONED`] if it was let go).
    pub fn applied(&self, s: &Session) -> Option<Version> {
        let c = self.clients.get(&s.client)?;
        c.applied
            .range((s.seq, 0)..=(s.seq, u64::MAX))
            .next()
            .map(|&(_, v)| v)
    }

    /// Whether `s` is older than what its client already gave up on (a late duplicate
    /// of a write that cannot be told from one applied and forgotten).
    pub fn forgotten(&self, s: &Session) -> bool {
        self.clients
            .get(&s.client)
            .is_some_and(|c| s.seq < c.done_below)
    }

    pub fn record(&mut self, s: &Session, index: Version) {
        let c = self.clients.entry(s.client).or_default();
        if s.done_below > c.done_below {
            c.done_below = s.done_below;
            let keep = c.applied.split_off(&(s.done_below, 0));
            c.applied = keep;
        }
        if s.seq >= c.done_below {
            c.applied.insert((s.seq, index));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_remembers_applied_writes_until_the_client_lets_them_go() {
        let mut s = Sessions::default();
        let w = |seq, done_below| Session {
            client: 7,
            seq,
            done_below,
        };
        s.record(&w(0, 0), 10);
        s.record(&w(2, 0), 12);
        assert_eq!(s.applied(&w(0, 0)), Some(10));
        assert_eq!(s.applied(&w(1, 0)), None);
        assert_eq!(s.applied(&w(2, 0)), Some(12));
        // The client says 0 and 1 are answered: 0 is forgotten, 2 is kept.
        s.record(&w(3, 2), 13);
        assert!(s.forgotten(&w(0, 0)));
        assert!(!s.forgotten(&w(2, 0)));
        assert_eq!(s.applied(&w(2, 0)), Some(12));
        assert_eq!(s.applied(&w(3, 0)), Some(13));
        assert_eq!(s.clients[&7].applied.len(), 2);
    }

    #[test]
    fn an_abandoned_write_is_refused_unless_it_was_applied_or_let_go() {
        let mut s = Sessions::default();
        let w = |seq, done_below| Session {
            client: 7,
            seq,
            done_below,
        };
        let id = |seq| WriteId { client: 7, seq };
        s.record(&w(1, 0), 10);
        s.abandon(id(1));
        assert_eq!(
            s.applied(&w(1, 0)),
            Some(10),
            "applied first: stays applied"
        );
        s.abandon(id(2));
        assert_eq!(s.applied(&w(2, 0)), Some(ABANDONED));
        // The client lets 0..3 go: nothing to record below that.
        s.record(&w(3, 3), 11);
        s.abandon(id(0));
        assert!(s.forgotten(&w(0, 0)));
        assert_eq!(s.applied(&w(0, 0)), None);
    }
}
