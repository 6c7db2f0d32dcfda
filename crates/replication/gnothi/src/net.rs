//! How replicas and clients reach each other: the [`Net`] trait (send a request to a
//! replica, get its response), and openraft's network built on it. A transport
//! implements `Net`: the in-process simulation (`sim.rs`) or gRPC (`transport.rs`).

use crate::meta::Meta;
use crate::rpc::{Request, Response};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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
}

pub struct Peer {
    target: u64,
    net: Arc<dyn Net>,
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
        }
    }
}

type RpcResult<T, E = openraft::error::Infallible> =
    Result<T, RPCError<u64, BasicNode, RaftError<u64, E>>>;

impl Peer {
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
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<Meta>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<u64>> {
        match self.send(Request::AppendEntries(rpc), &option).await? {
            Response::AppendEntries(Ok(r)) => Ok(r),
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
