//! A volume's client: writes send data to the slice's preferred quorum (or reserve
//! stand-ins) and metadata to the leader; reads go to one replica that holds the block
//! current. Every replica's answer is checked for shape before it is used.

use crate::geometry::{Geometry, ReplicaId};
use crate::meta::{Outcome, Proposal, Session};
use crate::net::{call_within, Net, NetError};
use crate::rpc::{BlockAnswer, Request, Response, RpcError, Status, MAX_DATA};
use crate::table::{Command, CommandError, Holders, Stored, WriteId};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// How long one replica may take to answer.
    pub rpc_timeout: Duration,
    /// How long an operation keeps retrying (leader changes, replicas down) before it
    /// fails `Unavailable`.
    pub op_timeout: Duration,
    /// How long to wait for a preferred replica to store data before a reserve stands in.
    pub store_timeout: Duration,
    /// The control for the fault tests, never for use: send the data to one replica
    /// and claim the whole preferred quorum stored it, acknowledging writes before f+1
    /// copies are durable. The tests must catch a client built this way.
    pub unsafe_claim_copies: bool,
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            rpc_timeout: Duration::from_secs(2),
            op_timeout: Duration::from_secs(10),
            store_timeout: Duration::from_secs(2),
            unsafe_claim_copies: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("the volume cannot serve this now (fewer than f+1 replicas, or no leader): {0}")]
    Unavailable(String),
    #[error("blocks {first}+{count} are outside the volume ({blocks} blocks)")]
    OutOfRange { first: u64, count: u64, blocks: u64 },
    #[error("data of {len} bytes is not a whole number of {block_size}-byte blocks")]
    Unaligned { len: usize, block_size: usize },
    #[error("the volume refused the write: {0}")]
    Refused(CommandError),
    #[error("a replica answered badly: {0}")]
    Protocol(String),
    #[error("no replica of the volume answered: {0}")]
    NoReplica(String),
}

pub struct Client {
    net: Arc<dyn Net>,
    geometry: Geometry,
    id: u64,
    next_seq: AtomicU64,
    in_flight: Mutex<BTreeSet<u64>>,
    leader: AtomicU64,
    rotate: AtomicU64,
    config: ClientConfig,
    /// Replicas that failed a store: passed over by writes until a probe finds them
    /// answering again.
    suspects: Arc<Mutex<HashMap<ReplicaId, Suspect>>>,
    /// Which server holds each slot, as of which membership.
    route: Mutex<Route>,
}

/// Slot → server (agreement id), as membership `epoch` has it. Before a server is
/// replaced, slot `r`'s server is `r`.
#[derive(Debug, Clone)]
struct Route {
    epoch: u64,
    nodes: Vec<u64>,
}

struct Suspect {
    /// When to probe it next.
    probe_at: Instant,
    probing: bool,
}

/// How often a suspected replica is probed.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// Times a write is sent again after the volume abandoned it (see `Command::Abandon`).
const ABANDONED_TRIES: u32 = 8;

impl Client {
    /// Connects to the volume on replicas `0..replicas`, learning its geometry from
    /// the first that answers. `id` must be unique among the volume's clients.
    pub async fn connect(
        net: Arc<dyn Net>,
        replicas: u16,
        id: u64,
        config: ClientConfig,
    ) -> Result<Client, ClientError> {
        let servers: Vec<u64> = (0..u64::from(replicas)).collect();
        Client::connect_to(net, &servers, id, config).await
    }

    /// As [`Client::connect`], asking `servers` (ids the net knows) first; the rest of
    /// the volume's servers are learned from the first that answers.
    pub async fn connect_to(
        net: Arc<dyn Net>,
        servers: &[u64],
        id: u64,
        config: ClientConfig,
    ) -> Result<Client, ClientError> {
        let deadline = Instant::now() + config.op_timeout;
        let mut last = String::from("no replicas");
        loop {
            for &r in servers {
                match call_within(net.as_ref(), r, Request::Status, config.rpc_timeout).await {
                    Ok(Response::Status(s)) => {
                        let c = Client {
                            net,
                            geometry: s.geometry,
                            id,
                            next_seq: AtomicU64::new(0),
                            in_flight: Mutex::new(BTreeSet::new()),
                            leader: AtomicU64::new(s.leader.unwrap_or(r)),
                            rotate: AtomicU64::new(id),
                            config,
                            suspects: Arc::new(Mutex::new(HashMap::new())),
                            route: Mutex::new(Route {
                                epoch: 0,
                                nodes: (0..u64::from(s.geometry.replicas())).collect(),
                            }),
                        };
                        c.learn(&s);
                        return Ok(c);
                    }
                    Ok(other) => last = format!("replica {r}: {:?}", other.unexpected()),
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(ClientError::NoReplica(last));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether writes pass `r` over. A suspect is probed (a status request, in the
    /// background) every [`PROBE_EVERY`]; it is trusted again once it answers.
    fn suspected(&self, r: ReplicaId) -> bool {
        let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sus) = s.get_mut(&r) else {
            return false;
        };
        if !sus.probing && Instant::now() >= sus.probe_at {
            sus.probing = true;
            let node = self.node_of(r);
            let (net, suspects, timeout) = (
                self.net.clone(),
                self.suspects.clone(),
                self.config.rpc_timeout,
            );
            tokio::spawn(async move {
                let up = matches!(
                    call_within(net.as_ref(), node, Request::Status, timeout).await,
                    Ok(Response::Status(_))
                );
                let mut s = suspects.lock().unwrap_or_else(|p| p.into_inner());
                if up {
                    s.remove(&r);
                } else if let Some(sus) = s.get_mut(&r) {
                    sus.probing = false;
                    sus.probe_at = Instant::now() + PROBE_EVERY;
                }
            });
        }
        true
    }

    /// The server that holds slot `r`.
    fn node_of(&self, r: ReplicaId) -> u64 {
        let route = self.route.lock().unwrap_or_else(|p| p.into_inner());
        route
            .nodes
            .get(usize::from(r))
            .copied()
            .unwrap_or(u64::from(r))
    }

    /// The membership `s` has applied, if it is newer than the one routed by: where
    /// each slot's server is.
    fn learn(&self, s: &Status) {
        let mut route = self.route.lock().unwrap_or_else(|p| p.into_inner());
        if s.epoch < route.epoch || s.slots.len() != route.nodes.len() {
            return;
        }
        route.epoch = s.epoch;
        for (slot, x) in s.slots.iter().enumerate() {
            if let Some((node, addr)) = x {
                route.nodes[slot] = *node;
                if !addr.is_empty() {
                    self.net.learn(*node, addr);
                }
            }
        }
    }

    /// Asks the servers where the slots are now (after a write was refused as routed
    /// by an old membership, or a round found no server with a block): the leader and
    /// each slot's server at once, so one that is down costs one timeout, not one each.
    async fn refresh_route(&self) {
        let mut ask = vec![self.leader.load(Ordering::Relaxed)];
        ask.extend(
            self.route
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .nodes
                .iter(),
        );
        ask.sort_unstable();
        ask.dedup();
        let answers =
            futures::future::join_all(ask.iter().map(|&to| self.call(to, Request::Status))).await;
        for a in answers {
            if let Ok(Response::Status(s)) = a {
                self.learn(&s);
            }
        }
    }

    fn epoch(&self) -> u64 {
        self.route.lock().unwrap_or_else(|p| p.into_inner()).epoch
    }

    fn suspect(&self, r: ReplicaId) {
        let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        s.entry(r).or_insert(Suspect {
            probe_at: Instant::now() + PROBE_EVERY,
            probing: false,
        });
    }

    fn trust(&self, r: ReplicaId) {
        let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        s.remove(&r);
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub async fn status(&self, replica: ReplicaId) -> Result<Status, ClientError> {
        match self.call(self.node_of(replica), Request::Status).await {
            Ok(Response::Status(s)) => {
                self.learn(&s);
                Ok(s)
            }
            Ok(other) => Err(ClientError::Protocol(other.unexpected().to_string())),
            Err(e) => Err(ClientError::NoReplica(e.to_string())),
        }
    }

    /// Replica `replica`'s view of `block` (diagnosis; not a read).
    pub async fn inspect(
        &self,
        replica: ReplicaId,
        block: u64,
    ) -> Result<crate::rpc::BlockView, ClientError> {
        match self
            .call(self.node_of(replica), Request::Inspect { block })
            .await
        {
            Ok(Response::Inspected(v)) => Ok(v),
            Ok(Response::Error(e)) => Err(ClientError::Protocol(e.to_string())),
            Ok(other) => Err(ClientError::Protocol(other.unexpected().to_string())),
            Err(e) => Err(ClientError::NoReplica(e.to_string())),
        }
    }

    async fn call(&self, to: u64, req: Request) -> Result<Response, NetError> {
        call_within(self.net.as_ref(), to, req, self.config.rpc_timeout).await
    }

    fn check(&self, first: u64, len: usize) -> Result<u64, ClientError> {
        let bs = self.geometry.block_size as usize;
        if len % bs != 0 {
            return Err(ClientError::Unaligned {
                len,
                block_size: bs,
            });
        }
        let count = (len / bs) as u64;
        if first
            .checked_add(count)
            .is_none_or(|e| e > self.geometry.blocks)
        {
            return Err(ClientError::OutOfRange {
                first,
                count,
                blocks: self.geometry.blocks,
            });
        }
        Ok(count)
    }

    /// Pieces of `first..first+count` that lie in one slice and fit one message.
    fn pieces(&self, first: u64, count: u64) -> Vec<(u64, u64)> {
        let g = &self.geometry;
        let max = (MAX_DATA / g.block_size as usize) as u64;
        let mut out = Vec::new();
        let mut b = first;
        let end = first + count;
        while b < end {
            let slice_end = (g.slice_of(b) + 1) * g.slice_blocks;
            let n = (end.min(slice_end) - b).min(max);
            out.push((b, n));
            b += n;
        }
        out
    }

    /// Writes whole blocks from `first`; returns once the write is durable on f+1
    /// replicas and its metadata committed.
    pub async fn write(&self, first: u64, data: &[u8]) -> Result<(), ClientError> {
        let count = self.check(first, data.len())?;
        let bs = self.geometry.block_size as usize;
        let pieces = self.pieces(first, count);
        let writes = pieces.iter().map(|&(b, n)| {
            let at = ((b - first) as usize) * bs;
            self.write_piece(b, &data[at..at + n as usize * bs])
        });
        for r in futures::future::join_all(writes).await {
            r?;
        }
        Ok(())
    }

    async fn write_piece(&self, first: u64, data: &[u8]) -> Result<(), ClientError> {
        let mut tries = 0;
        loop {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            self.in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(seq);
            let r = self.write_seq(seq, first, data).await;
            self.in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&seq);
            tries += 1;
            match r {
                // Its staged data was let go before it committed (a replica's data
                // log out of room): nothing of it applies, ever; as a new write.
                Err(ClientError::Refused(CommandError::Abandoned)) if tries < ABANDONED_TRIES => {
                    tracing::debug!(
                        seq,
                        first,
                        "write abandoned by the volume; writing it again"
                    );
                }
                r => return r,
            }
        }
    }

    /// Tells the volume that replica `r`'s data device was replaced by an empty one
    /// (what the operator's `--new-data-disk` does before `r` serves from it): `r` then
    /// holds no block, and re-replication rebuilds its preferred slices. One session
    /// sequence number, so a retry whose first try committed unseen applies once.
    pub async fn declare_data_lost(&self, r: ReplicaId) -> Result<(), ClientError> {
        if r >= self.geometry.replicas() {
            return Err(ClientError::Protocol(format!(
                "replica {r} is not in a volume of {} replicas",
                self.geometry.replicas()
            )));
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq);
        let proposal = Proposal {
            session: Some(Session {
                client: self.id,
                seq,
                done_below: self.done_below(),
            }),
            command: Command::Lost {
                replica: r,
                blocks: None,
            },
        };
        let deadline = Instant::now() + self.config.op_timeout;
        let r = self.propose(proposal, deadline).await;
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&seq);
        match r? {
            Outcome::Applied(_) | Outcome::Duplicate(_) => Ok(()),
            Outcome::Refused(e) => Err(ClientError::Refused(e)),
        }
    }

    fn done_below(&self) -> u64 {
        let f = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        f.iter()
            .next()
            .copied()
            .unwrap_or_else(|| self.next_seq.load(Ordering::Relaxed))
    }

    async fn write_seq(&self, seq: u64, first: u64, data: &[u8]) -> Result<(), ClientError> {
        let g = self.geometry;
        let write = WriteId {
            client: self.id,
            seq,
        };
        let deadline = Instant::now() + self.config.op_timeout;
        let bs = g.block_size as usize;
        let checksums: Vec<u32> = data.chunks(bs).map(crc32c::crc32c).collect();
        loop {
            // The copies are where this membership puts the slots; the write is
            // applied only if no slot changed servers since (else it goes again).
            let epoch = self.epoch();
            let stored = self.store(write, first, data, deadline).await?;
            let proposal = Proposal {
                session: Some(Session {
                    client: self.id,
                    seq,
                    done_below: self.done_below(),
                }),
                command: Command::Fenced {
                    epoch,
                    command: Box::new(Command::Write {
                        write,
                        first,
                        checksums: checksums.clone(),
                        stored,
                    }),
                },
            };
            match self.propose(proposal, deadline).await? {
                Outcome::Applied(_) | Outcome::Duplicate(_) => return Ok(()),
                // (Refused, it recorded nothing: the same session number goes again.)
                Outcome::Refused(CommandError::StaleMembership { .. })
                    if Instant::now() < deadline =>
                {
                    self.refresh_route().await;
                }
                Outcome::Refused(e) => return Err(ClientError::Refused(e)),
            }
        }
    }

    /// Makes the data durable on f+1 replicas: the slice's preferred quorum, with
    /// non-preferred replicas' reserves standing in for those that do not answer.
    async fn store(
        &self,
        write: WriteId,
        first: u64,
        data: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Stored>, ClientError> {
        let g = self.geometry;
        let need = usize::from(g.copies());
        let preferred = g.preferred(g.slice_of(first));
        let put = |r: ReplicaId| {
            let req = Request::PutData {
                write,
                first,
                data: data.to_vec(),
            };
            async move {
                let ok = matches!(
                    call_within(
                        self.net.as_ref(),
                        self.node_of(r),
                        req,
                        self.config.store_timeout
                    )
                    .await,
                    Ok(Response::Stored)
                );
                (r, ok)
            }
        };
        if self.config.unsafe_claim_copies {
            for &r in &preferred {
                if put(r).await.1 {
                    return Ok(preferred.iter().map(|&p| Stored::Home(p)).collect());
                }
            }
        }
        // Every preferred replica not suspected gets the data, and is waited for (each
        // bounded by the store timeout): G′ writes every copy, as Gaios does. One that
        // fails or times out is suspected for a while, so the writes after it go
        // straight to reserve stand-ins instead of each waiting the timeout out.
        let live: Vec<ReplicaId> = preferred
            .iter()
            .copied()
            .filter(|&r| !self.suspected(r))
            .collect();
        let mut stored: Vec<Stored> = Vec::new();
        for (r, ok) in futures::future::join_all(live.iter().map(|&r| put(r))).await {
            if ok {
                stored.push(Stored::Home(r));
            } else {
                self.suspect(r);
            }
        }
        if stored.len() >= need {
            return Ok(stored);
        }
        loop {
            let others: Vec<ReplicaId> = (0..g.replicas())
                .filter(|r| !preferred.contains(r) && !stored.iter().any(|s| s.replica() == *r))
                .collect();
            let missing = need - stored.len();
            let others: Vec<ReplicaId> =
                others.into_iter().filter(|&r| !self.suspected(r)).collect();
            for (r, ok) in futures::future::join_all(others.into_iter().map(put)).await {
                if !ok {
                    self.suspect(r);
                } else if stored.len() < need {
                    stored.push(Stored::Reserve(r));
                }
            }
            if stored.len() >= need {
                return Ok(stored);
            }
            // Preferred ones may be back.
            for (r, ok) in futures::future::join_all(
                preferred
                    .iter()
                    .copied()
                    .filter(|r| !stored.iter().any(|s| s.replica() == *r))
                    .map(put),
            )
            .await
            {
                if ok {
                    self.trust(r);
                    stored.push(Stored::Home(r));
                }
            }
            if stored.len() >= need {
                return Ok(stored);
            }
            if Instant::now() >= deadline {
                return Err(ClientError::Unavailable(format!(
                    "the data is durable on {} replicas, {need} are needed ({missing} were missing)",
                    stored.len()
                )));
            }
            // (A slot's server may have been replaced since the route was learned.)
            self.refresh_route().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Proposes through the leader, following redirects and retrying until `deadline`.
    async fn propose(&self, p: Proposal, deadline: Instant) -> Result<Outcome, ClientError> {
        let mut to = self.leader.load(Ordering::Relaxed);
        let mut turn = 0usize;
        let mut last;
        loop {
            match self.call(to, Request::Propose(p.clone())).await {
                Ok(Response::Proposed(o)) => {
                    self.leader.store(to, Ordering::Relaxed);
                    return Ok(o);
                }
                Ok(Response::Error(RpcError::NotLeader { leader: Some(l) }))
                    if l != to && Instant::now() < deadline =>
                {
                    to = l;
                    continue;
                }
                Ok(Response::Error(e)) => last = e.to_string(),
                Ok(other) => last = other.unexpected().to_string(),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(ClientError::Unavailable(format!(
                    "no leader took the write: {last}"
                )));
            }
            // Round the slots' servers.
            turn += 1;
            to = self.node_of((turn % usize::from(self.geometry.replicas())) as ReplicaId);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads `count` blocks from `first`: the latest acknowledged data of each.
    pub async fn read(&self, first: u64, count: u64) -> Result<Vec<u8>, ClientError> {
        self.check(first, (count as usize) * self.geometry.block_size as usize)?;
        let bs = self.geometry.block_size as usize;
        let mut out = vec![0u8; count as usize * bs];
        let deadline = Instant::now() + self.config.op_timeout;
        for (b, n) in self.pieces(first, count) {
            let at = ((b - first) as usize) * bs;
            self.read_piece(b, n, &mut out[at..at + n as usize * bs], deadline)
                .await?;
        }
        Ok(out)
    }

    async fn read_piece(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<(), ClientError> {
        let g = self.geometry;
        let bs = g.block_size as usize;
        let preferred = g.preferred(g.slice_of(first));
        let spin = self.rotate.fetch_add(1, Ordering::Relaxed) as usize;
        // Replicas to try, the preferred ones first (rotating), then the rest.
        let mut order: Vec<ReplicaId> = (0..preferred.len())
            .map(|i| preferred[(spin + i) % preferred.len()])
            .collect();
        order.extend((0..g.replicas()).filter(|r| !preferred.contains(r)));
        let mut pending: Vec<u64> = (first..first + count).collect();
        let mut hints: Vec<Holders> = vec![Holders::default(); count as usize];
        let mut last = String::from("no replica answered");
        let mut attempt = 0usize;
        while !pending.is_empty() {
            // Ask for the first pending block's run where a hint or the order points.
            let b0 = pending[0];
            let hint = hints[(b0 - first) as usize];
            let to = hint
                .iter()
                .nth(attempt % hint.len().max(1) as usize)
                .filter(|_| !hint.is_empty())
                .unwrap_or(order[attempt % order.len()]);
            let run = pending
                .iter()
                .enumerate()
                .take_while(|&(i, &b)| b == b0 + i as u64)
                .count();
            let req = Request::Read {
                first: b0,
                count: run as u32,
            };
            match self.call(self.node_of(to), req).await {
                Ok(Response::Blocks(answers)) if answers.len() == run => {
                    let mut still = Vec::new();
                    for (i, a) in answers.into_iter().enumerate() {
                        let b = b0 + i as u64;
                        let at = ((b - first) as usize) * bs;
                        match a {
                            BlockAnswer::Data(d) if d.len() == bs => {
                                out[at..at + bs].copy_from_slice(&d)
                            }
                            BlockAnswer::Data(d) => {
                                return Err(ClientError::Protocol(format!(
                                    "replica {to} sent {} bytes for a block of {bs}",
                                    d.len()
                                )))
                            }
                            BlockAnswer::Zero => out[at..at + bs].fill(0),
                            BlockAnswer::NotHere(h) => {
                                hints[(b - first) as usize] = h;
                                still.push(b);
                            }
                        }
                    }
                    still.extend(pending.drain(run..));
                    pending = still;
                }
                Ok(Response::Blocks(a)) => {
                    return Err(ClientError::Protocol(format!(
                        "replica {to} answered {} blocks for {run}",
                        a.len()
                    )))
                }
                Ok(Response::Error(e)) => last = e.to_string(),
                Ok(other) => last = other.unexpected().to_string(),
                Err(e) => last = e.to_string(),
            }
            attempt += 1;
            if !pending.is_empty() && Instant::now() >= deadline {
                return Err(ClientError::Unavailable(format!(
                    "block {} could not be read: {last}",
                    pending[0]
                )));
            }
            if attempt % order.len() == 0 {
                // A round of servers without the block: one may have been replaced
                // since the route was learned (from a server that had not applied the
                // change yet, say).
                self.refresh_route().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}
