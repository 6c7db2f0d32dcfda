//! How replicas and clients reach each other: the [`Net`] trait (send a request to a
//! replica, get its response), and openraft's network built on it. A transport
//! implements `Net`: the in-process simulation (`sim.rs`) or gRPC (`transport.rs`).

use crate::geometry::{Geometry, System};
use crate::meta::Meta;
use crate::rpc::{Request, Response, MAX_MESSAGE};
use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The most an append's entries may take: a message, less room for its envelope.
const APPEND_LIMIT: usize = MAX_MESSAGE - 1024;

/// The longest the leader waits before calling an unreachable peer again.
const RETRY_AT_MOST: Duration = Duration::from_millis(50);

/// A request that got no response: the peer is down, unreachable, or too slow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    #[error("replica {0} is unreachable: {1}")]
    Unreachable(u64, String),
    #[error("replica {0} did not answer in time")]
    Timeout(u64),
    #[error("replica {0} is not in the volume")]
    NoSuchReplica(u64),
}

/// Sends requests to replicas by id.
pub trait Net: Send + Sync + 'static {
    fn call(&self, to: u64, req: Request) -> BoxFuture<'_, Result<Response, NetError>>;

    /// Replica `id` is at `addr` (a server that joined, or replaced another, after the
    /// net was made). A transport that finds replicas by id alone ignores it.
    fn learn(&self, _id: u64, _addr: &str) {}
}

/// [`Net::call`] with a deadline.
pub async fn call_within(
    net: &dyn Net,
    to: u64,
    req: Request,
    within: Duration,
) -> Result<Response, NetError> {
    match tokio::time::timeout(within, net.call(to, req)).await {
        Ok(r) => r,
        Err(_) => Err(NetError::Timeout(to)),
    }
}

/// openraft's view of the network: one [`Peer`] per target replica.
#[derive(Clone)]
pub struct RaftNet {
    pub net: Arc<dyn Net>,
    /// Cheap Paxos's auxiliaries, kept idle while the mains answer (else `None`).
    pub standby: Option<Arc<Standby>>,
}

pub struct Peer {
    target: u64,
    net: Arc<dyn Net>,
    standby: Option<Arc<Standby>>,
}

/// Cheap Paxos: the `f` auxiliaries are voters of the `2f+1`, but while every main
/// replica answers, the `f+1` mains are a majority on their own, so the leader sends the
/// auxiliaries nothing: no entries, no heartbeats, no snapshots. Once a main has not
/// answered for `grace`, the leader replicates to the auxiliaries as to anyone (a
/// snapshot first if they are far behind), and they vote on commits until the main
/// answers again. Withholding messages is what a lossy network does, so agreement's
/// safety does not rest on this; votes always go through, so a main can be elected
/// with an auxiliary's vote. The auxiliaries never stand for election themselves
/// (`enable_elect` off), so the leader is always a main.
pub struct Standby {
    geometry: Geometry,
    /// This replica's slot.
    me: u16,
    grace: Duration,
    /// When each main last answered an append (or when this began).
    answered: Mutex<HashMap<u16, Instant>>,
    since: Instant,
}

impl Standby {
    /// For a Cheap Paxos volume; `None` for the other systems.
    pub fn for_volume(geometry: Geometry, me: u16, grace: Duration) -> Option<Arc<Standby>> {
        (geometry.system == System::CheapPaxos && geometry.f > 0).then(|| {
            Arc::new(Standby {
                geometry,
                me,
                grace,
                answered: Mutex::new(HashMap::new()),
                since: Instant::now(),
            })
        })
    }

    /// Whether the server with agreement id `node` is an auxiliary.
    pub fn is_auxiliary(&self, node: u64) -> bool {
        self.geometry.slot_of(node) > self.geometry.f
    }

    fn heard_from(&self, node: u64) {
        let slot = self.geometry.slot_of(node);
        if slot <= self.geometry.f {
            self.answered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(slot, Instant::now());
        }
    }

    /// Whether every main but this replica answered within the grace: then the
    /// auxiliaries are not needed.
    pub fn mains_answer(&self) -> bool {
        let answered = self.answered.lock().unwrap_or_else(|p| p.into_inner());
        (0..=self.geometry.f).filter(|&m| m != self.me).all(|m| {
            let last = answered
                .get(&m)
                .copied()
                .unwrap_or(self.since)
                .max(self.since);
            last.elapsed() < self.grace
        })
    }

    /// Whether a message to `node` is withheld now.
    fn idle(&self, node: u64) -> bool {
        self.is_auxiliary(node) && self.mains_answer()
    }
}

impl RaftNetworkFactory<Meta> for RaftNet {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Peer {
        if !node.addr.is_empty() {
            self.net.learn(target, &node.addr);
        }
        Peer {
            target,
            net: self.net.clone(),
            standby: self.standby.clone(),
        }
    }
}

type RpcResult<T, E = openraft::error::Infallible> =
    Result<T, RPCError<u64, BasicNode, RaftError<u64, E>>>;

impl Peer {
    /// Refuses at once what Cheap Paxos does not send to an idle auxiliary.
    fn withheld(&self) -> Result<(), Unreachable> {
        match &self.standby {
            Some(s) if s.idle(self.target) => Err(Unreachable::new(&NetError::Unreachable(
                self.target,
                "an auxiliary, idle while the main replicas answer".into(),
            ))),
            _ => Ok(()),
        }
    }

    async fn send(&self, req: Request, option: &RPCOption) -> Result<Response, Unreachable> {
        call_within(self.net.as_ref(), self.target, req, option.hard_ttl())
            .await
            .map_err(|e| Unreachable::new(&e))
    }

    fn protocol<E: std::error::Error>(
        &self,
        r: &Response,
    ) -> RPCError<u64, BasicNode, RaftError<u64, E>> {
        RPCError::Network(NetworkError::new(&r.unexpected()))
    }
}

impl RaftNetwork<Meta> for Peer {
    /// After a peer was unreachable, openraft sends it nothing for the backoff's next
    /// interval (its default: 500 ms, every time). A replica that restarts waited out
    /// that pause before its Phase 1 could begin, and a Cheap Paxos auxiliary before it
    /// was woken. Here: 10 ms, doubling up to 50 ms; a retry to a dead peer is one
    /// failed connection.
    fn backoff(&self) -> Backoff {
        Backoff::new((0u32..).map(|i| Duration::from_millis(10 << i.min(4)).min(RETRY_AT_MOST)))
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<Meta>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<u64>> {
        self.withheld()?;
        if let Some(fit) = entries_that_fit(&rpc, APPEND_LIMIT) {
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(fit),
            ));
        }
        match self.send(Request::AppendEntries(rpc), &option).await? {
            Response::AppendEntries(Ok(r)) => {
                if let Some(s) = &self.standby {
                    s.heard_from(self.target);
                }
                Ok(r)
            }
            Response::AppendEntries(Err(e)) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            other => Err(self.protocol(&other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<Meta>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<u64>, InstallSnapshotError> {
        self.withheld()?;
        match self.send(Request::InstallSnapshot(rpc), &option).await? {
            Response::InstallSnapshot(Ok(r)) => Ok(r),
            Response::InstallSnapshot(Err(e)) => {
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            other => Err(self.protocol(&other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<u64>> {
        match self.send(Request::Vote(rpc), &option).await? {
            Response::Vote(Ok(r)) => Ok(r),
            Response::Vote(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
            other => Err(self.protocol(&other)),
        }
    }
}

/// `None` if `rpc` fits a message of `limit` bytes; else how many of its entries do
/// (at least 1). A follower far behind is sent up to openraft's `max_payload_entries`
/// (300) at once, which after large writes (a checksum per block) came to megabytes:
/// the transport refused the message at every retry, and the follower never caught
/// up from the log. openraft sends the number hinted instead.
fn entries_that_fit(rpc: &AppendEntriesRequest<Meta>, limit: usize) -> Option<u64> {
    // One pass over the entries, on every append: postcard lays a struct out field by
    // field, so the whole is the other fields, the entries' count and each entry.
    let mut used = encoded_size(&(&rpc.vote, &rpc.prev_log_id, &rpc.leader_commit))
        .saturating_add(encoded_size(&(rpc.entries.len() as u64)));
    for (fit, e) in rpc.entries.iter().enumerate() {
        used = used.saturating_add(encoded_size(e));
        if used > limit {
            return Some((fit as u64).max(1));
        }
    }
    None
}

/// Bytes `v` takes in postcard, counted without a buffer.
fn encoded_size<T: serde::Serialize>(v: &T) -> usize {
    postcard::serialize_with_flavor(v, postcard::ser_flavors::Size::default()).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auxiliaries_idle_only_while_every_other_main_answers() {
        let g = Geometry::new(System::CheapPaxos, 2, 512, 1024, 16).unwrap();
        let s = Standby::for_volume(g, 0, Duration::from_millis(50)).unwrap();
        // Slots 0..=2 are mains, 3 and 4 auxiliaries, whatever the server's incarnation.
        assert!(!s.is_auxiliary(1) && !s.is_auxiliary(2 + 5));
        assert!(s.is_auxiliary(3) && s.is_auxiliary(4 + 5 * 2));
        // At first every main counts as answering (the start is their last word).
        assert!(s.idle(3));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!s.idle(3), "no main answered within the grace");
        s.heard_from(1);
        assert!(!s.idle(3), "main 2 still silent");
        s.heard_from(2 + 5); // slot 2's second server
        assert!(
            s.idle(4) && !s.idle(1),
            "only auxiliaries are ever withheld"
        );
        // The other systems have no auxiliaries.
        for sys in [System::Gnothi, System::GPrime] {
            let g = Geometry::new(sys, 1, 512, 1024, 16).unwrap();
            assert!(Standby::for_volume(g, 0, Duration::from_secs(1)).is_none());
        }
    }

    #[test]
    fn an_unreachable_peer_is_called_again_within_fifty_milliseconds() {
        let peer = Peer {
            target: 1,
            net: Arc::new(Nowhere),
            standby: None,
        };
        let waits: Vec<Duration> = peer.backoff().take(50).collect();
        assert_eq!(
            waits[0],
            Duration::from_millis(10),
            "the first retry comes soon"
        );
        assert!(
            waits.windows(2).all(|w| w[0] <= w[1]),
            "never shorter than before"
        );
        assert!(waits.iter().all(|&w| w <= RETRY_AT_MOST), "{waits:?}");
        assert_eq!(waits[49], RETRY_AT_MOST, "and never given up");
    }

    struct Nowhere;
    impl Net for Nowhere {
        fn call(&self, to: u64, _req: Request) -> BoxFuture<'_, Result<Response, NetError>> {
            Box::pin(async move { Err(NetError::NoSuchReplica(to)) })
        }
    }

    /// Entries of ten writes of 256 blocks each: a checksum per block makes each
    /// entry ~13 KB, and openraft's 300 come to ~3.9 MB.
    fn big_append(entries: u64) -> AppendEntriesRequest<Meta> {
        use crate::meta::{Batch, Proposal, Session};
        use crate::table::{Command, Stored, WriteId};
        use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
        let mut x: u32 = 12345;
        let mut next = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            x
        };
        let entries = (0..entries)
            .map(|i| {
                let props = (0..10u64)
                    .map(|j| {
                        let write = WriteId {
                            client: 1 << 40,
                            seq: i * 10 + j,
                        };
                        Proposal {
                            session: Some(Session {
                                client: 1 << 40,
                                seq: write.seq,
                                done_below: i * 10,
                            }),
                            command: Command::Write {
                                write,
                                first: j * 256,
                                checksums: (0..256).map(|_| next()).collect(),
                                stored: vec![Stored::Home(0), Stored::Home(1)],
                            },
                        }
                    })
                    .collect();
                Entry::<Meta> {
                    log_id: LogId::new(CommittedLeaderId::new(2, 0), 1000 + i),
                    payload: EntryPayload::Normal(Batch(props)),
                }
            })
            .collect();
        AppendEntriesRequest {
            vote: Vote::new_committed(2, 0),
            prev_log_id: None,
            entries,
            leader_commit: None,
        }
    }

    #[test]
    fn an_append_too_large_for_a_message_is_cut_to_the_entries_that_fit() {
        let full = big_append(300);
        let whole = postcard::to_stdvec(&Request::AppendEntries(full.clone()))
            .unwrap()
            .len();
        assert!(whole > MAX_MESSAGE, "the case under test: {whole} bytes");
        let fit = entries_that_fit(&full, APPEND_LIMIT).expect("too large as a whole");
        assert!((1..300).contains(&fit), "{fit}");
        // The hint is exact: that many entries go in one message, one more does not.
        let cut = |n: u64| {
            let mut r = full.clone();
            r.entries.truncate(n as usize);
            postcard::to_stdvec(&Request::AppendEntries(r))
                .unwrap()
                .len()
        };
        assert!(cut(fit) <= APPEND_LIMIT + 1, "{} bytes", cut(fit));
        assert!(cut(fit + 1) > APPEND_LIMIT, "{} bytes", cut(fit + 1));
        // What fits is left alone, heartbeats (no entries) included.
        assert_eq!(entries_that_fit(&big_append(10), APPEND_LIMIT), None);
        assert_eq!(entries_that_fit(&big_append(0), APPEND_LIMIT), None);
    }
}
