//! A replica server, independent of its transport: openraft over the replica's log
//! device, the data path (stage, propose, read), and the background work that keeps
//! the volume whole (reporting lost blocks, Phase 2 fetches, reserve reclaim).

use crate::geometry::ReplicaId;
use crate::meta::{Batch, Outcome, Proposal, Raft};
use crate::net::{call_within, Net, RaftNet, Standby};
use crate::replica::{LocalRead, Machine, ReplicaError};
use crate::rpc::{BlockAnswer, Request, Response, RpcError, Status, MAX_DATA};
use crate::table::{Command, Version};
use openraft::{BasicNode, SnapshotPolicy};
use quilt_block::BlockDevice;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Knobs of a replica server (the paper's recovery interval among them).
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub heartbeat: Duration,
    pub election_min: Duration,
    pub election_max: Duration,
    /// A snapshot after this many log entries; the log keeps `keep_after_snapshot`.
    pub snapshot_every: u64,
    pub keep_after_snapshot: u64,
    /// How long a request to a peer may take.
    pub rpc_timeout: Duration,
    /// How long a read waits for this replica to apply up to the read index.
    pub read_wait: Duration,
    /// Phase 2: one fetch of at most `fetch_bytes` every `recovery_interval`.
    pub recovery_interval: Duration,
    pub fetch_bytes: u64,
    /// Client proposals put in one log entry, at most (the paper's write batch: 10).
    pub write_batch: usize,
    /// Reads that share one confirmation of the leader's read index, at most (the
    /// paper's read batch: 100). 1: each read confirms on its own.
    pub read_batch: usize,
    /// Writes' data staged with one sync of the log device, at most (group commit).
    pub stage_batch: usize,
    /// Batches of proposals the leader has in agreement at once.
    pub batches_in_flight: usize,
    /// How often placed data is written back (a flush of the data device).
    pub write_back_every: Duration,
}

impl Default for NodeConfig {
    fn default() -> NodeConfig {
        NodeConfig {
            heartbeat: Duration::from_millis(50),
            election_min: Duration::from_millis(300),
            election_max: Duration::from_millis(600),
            snapshot_every: 5_000,
            keep_after_snapshot: 1_000,
            rpc_timeout: Duration::from_secs(2),
            read_wait: Duration::from_secs(2),
            recovery_interval: Duration::from_millis(10),
            fetch_bytes: 16 << 20,
            write_batch: 10,
            read_batch: 100,
            stage_batch: 64,
            batches_in_flight: 8,
            write_back_every: Duration::from_millis(20),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("raft: {0}")]
    Raft(String),
}

pub struct Node {
    /// Its slot in the placement.
    pub id: ReplicaId,
    /// Its identity in agreement (`Label::node_id`).
    pub node_id: u64,
    raft: Raft,
    machine: Machine,
    net: Arc<dyn Net>,
    config: NodeConfig,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    stager: tokio::sync::mpsc::UnboundedSender<StageJob>,
    proposer: tokio::sync::mpsc::UnboundedSender<ProposeJob>,
    /// Phase 2's pace: fetches are `fetch_bytes >> fetch_shift` (halved after a fetch
    /// that failed or brought nothing, doubled back after one that repaired), and
    /// `fetch_turn` picks among the holders, so a slow or unhelpful holder (one reading
    /// scattered reserve slots past the RPC timeout) cannot stall recovery forever.
    fetch_shift: std::sync::atomic::AtomicU32,
    fetch_turn: std::sync::atomic::AtomicUsize,
    raft_log: crate::raftlog::RaftLog,
    /// Where the next Phase 2 fetch looks first (it goes round the volume).
    phase2_cursor: std::sync::atomic::AtomicU64,
    /// When `step` last asked for a snapshot because the log's ring filled.
    snapshot_asked: Mutex<Option<tokio::time::Instant>>,
    /// Reads waiting for a read index (from the leader, through it if this replica
    /// follows), and `ReadIndex` requests waiting for this leader's confirmation: each
    /// batch shares one.
    reads: Coalescer,
    leads: Coalescer,
    /// The membership `step` last looked at (its log index; `u64::MAX - 1` before
    /// any, `u64::MAX` before the first step), and whether this server is its slot's
    /// in it.
    seen_membership: std::sync::atomic::AtomicU64,
    member: std::sync::atomic::AtomicBool,
}

type IndexAnswer = tokio::sync::oneshot::Sender<Result<u64, RpcError>>;

/// Callers that wait for one log index each, answered in batches: the first caller
/// starts a round, everyone who came meanwhile (up to the batch) waits for the next
/// one, which starts only after they came, so a read index is never older than the
/// read it is for.
#[derive(Clone)]
struct Coalescer {
    tx: tokio::sync::mpsc::UnboundedSender<IndexAnswer>,
}

impl Coalescer {
    fn start<F, Fut>(batch: usize, round: F) -> (Coalescer, JoinHandle<()>)
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<u64, RpcError>> + Send,
    {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<IndexAnswer>();
        let task = tokio::spawn(async move {
            while let Some(waiting) = next_batch(&mut rx, batch).await {
                let r = round().await;
                for w in waiting {
                    let _ = w.send(r.clone());
                }
            }
        });
        (Coalescer { tx }, task)
    }

    async fn index(&self) -> Result<u64, RpcError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(tx).is_err() {
            return Err(RpcError::Unavailable("the replica is stopping".into()));
        }
        rx.await
            .unwrap_or_else(|_| Err(RpcError::Unavailable("the replica is stopping".into())))
    }
}

/// The read index this leader confirms (openraft's, or its last log index if higher:
/// see `safe_read_index`); `NotLeader` when it does not lead.
async fn confirm_read_index(raft: &Raft) -> Result<u64, RpcError> {
    match raft.get_read_log_id().await {
        Ok((read, _)) => Ok(safe_read_index(raft, read)),
        Err(e) => Err(match e.forward_to_leader::<BasicNode>() {
            Some(f) => RpcError::NotLeader {
                leader: f.leader_id,
            },
            None => RpcError::Unavailable(e.to_string()),
        }),
    }
}

/// The read index to wait for, on a confirmed leader: openraft's (its commit index,
/// or the first entry of its term), or its last log index if that is higher.
/// openraft 0.9 lets a leader that restarts with its vote come back as leader in
/// the same term, proposing no new first entry; its commit index is what its log
/// store kept, which may predate writes it acknowledged before the crash. Every
/// acknowledged write is in a leader's log (leader completeness), so waiting for
/// the last log index never misses one. (Found by the simulation: a stale read.)
fn safe_read_index(raft: &Raft, read: Option<crate::meta::LogId>) -> u64 {
    let last = raft.metrics().borrow().last_log_index.unwrap_or(0);
    read.map_or(0, |l| l.index).max(last)
}

/// The index a linearizable read must see applied: this leader's, or the leader's
/// through a `ReadIndex` request.
async fn read_index(raft: &Raft, net: &dyn Net, timeout: Duration) -> Result<u64, RpcError> {
    match confirm_read_index(raft).await {
        Err(RpcError::NotLeader {
            leader: Some(leader),
        }) => match call_within(net, leader, Request::ReadIndex, timeout).await {
            Ok(Response::ReadIndex(i)) => Ok(i),
            Ok(Response::Error(e)) => Err(e),
            Ok(other) => Err(other.unexpected()),
            Err(e) => Err(RpcError::Unavailable(e.to_string())),
        },
        Err(RpcError::NotLeader { leader: None }) => {
            Err(RpcError::Unavailable("no leader known".into()))
        }
        r => r,
    }
}

/// A proposal waiting for a batch, and where its answer goes.
struct ProposeJob {
    proposal: Proposal,
    done: tokio::sync::oneshot::Sender<Response>,
}

impl ProposeJob {
    /// The blocks a write names (none for other commands, which go alone).
    fn write_range(&self) -> Option<std::ops::Range<u64>> {
        match self.proposal.command.unfenced().0 {
            Command::Write {
                first, checksums, ..
            } => Some(*first..first.saturating_add(checksums.len() as u64)),
            _ => None,
        }
    }
}

/// `command` fenced by membership `epoch` (see `Command::Fenced`).
fn fenced(epoch: u64, command: Command) -> Command {
    Command::Fenced {
        epoch,
        command: Box::new(command),
    }
}

fn raft_error(
    e: openraft::error::RaftError<u64, openraft::error::ClientWriteError<u64, BasicNode>>,
) -> RpcError {
    match e.forward_to_leader::<BasicNode>() {
        Some(f) => RpcError::NotLeader {
            leader: f.leader_id,
        },
        None => RpcError::Unavailable(e.to_string()),
    }
}

/// Puts waiting proposals into log entries: up to `batch` writes to disjoint blocks
/// each (a write that overlaps one already in the batch waits for the next), with at
/// most `in_flight` entries in agreement at once, so that under load batches fill
/// while earlier ones commit.
async fn proposer(
    raft: Raft,
    mut jobs: tokio::sync::mpsc::UnboundedReceiver<ProposeJob>,
    batch: usize,
    in_flight: usize,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(in_flight.max(1)));
    let mut held: Option<ProposeJob> = None;
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let first = match held.take() {
            Some(j) => j,
            None => match jobs.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
        let alone = match first.write_range() {
            Some(r) => {
                ranges.push(r);
                false
            }
            None => true,
        };
        let mut group = vec![first];
        while !alone && group.len() < batch.max(1) {
            let Ok(j) = jobs.try_recv() else { break };
            match j.write_range() {
                Some(r) if ranges.iter().all(|o| r.end <= o.start || o.end <= r.start) => {
                    ranges.push(r);
                    group.push(j);
                }
                _ => {
                    held = Some(j);
                    break;
                }
            }
        }
        let raft = raft.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let (proposals, answers): (Vec<Proposal>, Vec<_>) =
                group.into_iter().map(|j| (j.proposal, j.done)).unzip();
            let n = proposals.len();
            match raft.client_write(Batch(proposals)).await {
                Ok(r) if r.data.len() == n => {
                    for (done, o) in answers.into_iter().zip(r.data) {
                        let _ = done.send(Response::Proposed(o));
                    }
                }
                Ok(r) => {
                    let why = format!("{} outcomes for a batch of {n}", r.data.len());
                    for done in answers {
                        let _ = done.send(Response::Error(RpcError::Failed(why.clone())));
                    }
                }
                Err(e) => {
                    let e = raft_error(e);
                    for done in answers {
                        let _ = done.send(Response::Error(e.clone()));
                    }
                }
            }
        });
    }
}

/// Blocks a Phase 2 fetch reads under one hold of the replica's lock.
const FETCH_CHUNK: u64 = 256;

/// Writes placed data back: every `every`, a flush of the data device (outside the
/// replica's lock, so applies and reads go on meanwhile), then the placed mark moves.
async fn flusher(machine: Machine, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = write_back(&machine).await {
            tracing::warn!(error = %e, "writing placed data back failed");
        }
    }
}

/// One write-back of everything placed so far: durable when it returns `Ok`. The
/// replica's lock is held only to take the batch and to record it written.
async fn write_back(machine: &Machine) -> Result<(), String> {
    let m = machine.clone();
    tokio::task::spawn_blocking(move || {
        let mut g = m.lock();
        let Some(wb) = g.write_back_begin() else {
            return Ok(());
        };
        // The device's order is taken before the replica's lock goes: a settle
        // that comes meanwhile waits for this batch before writing newer data.
        let order = wb.batch.device_order.clone();
        let written = {
            let _order = order.lock().unwrap_or_else(|p| p.into_inner());
            drop(g);
            wb.batch.write_out().map_err(|e| e.to_string())
        };
        m.lock()
            .write_back_done(wb, written)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// One write's data waiting for the stager, and where its answer goes.
struct StageJob {
    write: crate::table::WriteId,
    first: u64,
    data: Vec<u8>,
    done: tokio::sync::oneshot::Sender<Result<(), ReplicaError>>,
}

/// What waits in `rx` once something does, up to `max` (at least one); `None` when
/// every sender is gone.
async fn next_batch<T>(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<T>,
    max: usize,
) -> Option<Vec<T>> {
    let mut batch = vec![rx.recv().await?];
    while batch.len() < max.max(1) {
        match rx.try_recv() {
            Ok(x) => batch.push(x),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Stages the writes that wait, up to `batch` at a time, each batch with one sync of
/// the log device (group commit), off the runtime's workers.
async fn stager(
    machine: Machine,
    mut jobs: tokio::sync::mpsc::UnboundedReceiver<StageJob>,
    batch: usize,
) {
    while let Some(group) = next_batch(&mut jobs, batch).await {
        let (writes, answers): (Vec<_>, Vec<_>) = group
            .into_iter()
            .map(|j| ((j.write, j.first, j.data), j.done))
            .unzip();
        let m = machine.clone();
        let staged = tokio::task::spawn_blocking(move || {
            // Appended under the lock, synced outside it: applies and reads go on
            // while the log device syncs.
            let (results, dev) = {
                let mut g = m.lock();
                (g.append_staged(writes).0, g.log_device())
            };
            let synced = if results.iter().any(Result::is_ok) {
                dev.flush().map_err(|e| e.to_string())
            } else {
                Ok(())
            };
            (results, synced)
        })
        .await;
        match staged {
            Ok((results, Ok(()))) => {
                for (done, r) in answers.into_iter().zip(results) {
                    let _ = done.send(r);
                }
            }
            Ok((_, Err(why))) => {
                for done in answers {
                    let _ = done.send(Err(ReplicaError::Sync(why.clone())));
                }
            }
            // The blocking task panicked or was cancelled: the senders drop, and each
            // waiting request answers that staging failed.
            Err(_) => {}
        }
    }
}

impl Node {
    /// Starts replica `id` on its devices. `members` (id → address) initializes a new
    /// volume's agreement group the first time; a replica that has a log ignores it.
    pub async fn start(
        id: ReplicaId,
        log_dev: Arc<dyn BlockDevice>,
        data_dev: Arc<dyn BlockDevice>,
        net: Arc<dyn Net>,
        members: BTreeMap<u64, BasicNode>,
        config: NodeConfig,
    ) -> Result<Arc<Node>, NodeError> {
        let (local, log) = crate::replica::Local::open(id, log_dev, data_dev)?;
        let node_id = local.node;
        // Where the members are, as the last membership applied says (servers that
        // replaced others since the peers were configured).
        for (node, addr) in local.slots().into_iter().flatten() {
            if !addr.is_empty() {
                net.learn(node, &addr);
            }
        }
        let raft_log = log.clone();
        // The log between snapshots must fit its ring with room to spare: an entry's
        // record takes 2 blocks or more (header and body), so a snapshot at least
        // every ring/8 entries. `step` also asks for one whenever the ring is half full.
        let (_, ring) = raft_log.usage();
        let snapshot_every = config.snapshot_every.min((ring / 8).max(16));
        let keep_after_snapshot = config.keep_after_snapshot.min(snapshot_every / 4);
        // Cheap Paxos: a main that has not answered for an election timeout is taken
        // for down, and the auxiliaries are woken.
        let standby = Standby::for_volume(*local.geometry(), local.id, config.election_min);
        let auxiliary = standby.as_ref().is_some_and(|s| s.is_auxiliary(node_id));
        let machine = Machine::new(local);
        let ms = |d: Duration| d.as_millis() as u64;
        let raft_config = openraft::Config {
            cluster_name: "gnothi".into(),
            heartbeat_interval: ms(config.heartbeat),
            election_timeout_min: ms(config.election_min),
            election_timeout_max: ms(config.election_max),
            snapshot_policy: SnapshotPolicy::LogsSinceLast(snapshot_every),
            max_in_snapshot_log_to_keep: keep_after_snapshot,
            install_snapshot_timeout: ms(config.rpc_timeout),
            // A chunk must fit one message (openraft's default, 3 MiB, did not: a
            // snapshot of a volume's table past a megabyte never arrived).
            snapshot_max_chunk_size: (crate::rpc::MAX_DATA / 2) as u64,
            // An auxiliary hears nothing while the mains are well: it must not take
            // that silence for a leader's failure.
            enable_elect: !auxiliary,
            ..Default::default()
        }
        .validate()
        .map_err(|e| NodeError::Raft(e.to_string()))?;
        let raft = Raft::new(
            node_id,
            Arc::new(raft_config),
            RaftNet {
                net: net.clone(),
                standby,
            },
            log,
            machine.clone(),
        )
        .await
        .map_err(|e| NodeError::Raft(e.to_string()))?;
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))?;
        if !initialized && !members.is_empty() && !auxiliary {
            // Every replica of a new volume initializes with the same members: the
            // same entry at index 0 everywhere, so any of them may win the election.
            // Not a Cheap Paxos auxiliary: initializing stands for election at once,
            // and an auxiliary must never lead (it gets the entry when it is needed).
            if let Err(e) = raft.initialize(members).await {
                tracing::debug!(replica = id, error = %e, "initialize");
            }
        }
        let (jobs, queue) = tokio::sync::mpsc::unbounded_channel();
        let staging = tokio::spawn(stager(machine.clone(), queue, config.stage_batch));
        let writing_back = tokio::spawn(flusher(machine.clone(), config.write_back_every));
        let (proposals, waiting) = tokio::sync::mpsc::unbounded_channel();
        let proposing = tokio::spawn(proposer(
            raft.clone(),
            waiting,
            config.write_batch,
            config.batches_in_flight,
        ));
        let (reads, reading) = {
            let (raft, net, timeout) = (raft.clone(), net.clone(), config.rpc_timeout);
            Coalescer::start(config.read_batch, move || {
                let (raft, net) = (raft.clone(), net.clone());
                async move { read_index(&raft, net.as_ref(), timeout).await }
            })
        };
        let (leads, leading) = {
            let raft = raft.clone();
            Coalescer::start(config.read_batch, move || {
                let raft = raft.clone();
                async move { confirm_read_index(&raft).await }
            })
        };
        let node = Arc::new(Node {
            id,
            node_id,
            reads,
            leads,
            seen_membership: std::sync::atomic::AtomicU64::new(u64::MAX),
            member: std::sync::atomic::AtomicBool::new(false),
            raft,
            machine,
            net,
            config,
            tasks: Mutex::new(Vec::new()),
            stager: jobs,
            proposer: proposals,
            fetch_shift: std::sync::atomic::AtomicU32::new(0),
            fetch_turn: std::sync::atomic::AtomicUsize::new(0),
            raft_log,
            phase2_cursor: std::sync::atomic::AtomicU64::new(0),
            snapshot_asked: Mutex::new(None),
        });
        let bg = tokio::spawn(Node::background(Arc::downgrade(&node)));
        node.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([bg, staging, proposing, writing_back, reading, leading]);
        Ok(node)
    }

    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// Stops the replica (its devices keep what it made durable).
    pub async fn shutdown(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::debug!(replica = self.id, error = %e, "raft shutdown");
        }
    }

    /// Answers one request.
    pub async fn handle(&self, req: Request) -> Response {
        match req {
            Request::AppendEntries(r) => {
                // openraft trusts its peers to send entries that follow prev_log_id, one
                // index after another; a peer (or a forged frame) that does not must not
                // take this replica down.
                let start = r.prev_log_id.map_or(0, |l| l.index + 1);
                let follows = (start..).zip(&r.entries).all(|(i, e)| e.log_id.index == i);
                if !follows {
                    tracing::warn!(
                        replica = self.id,
                        leader = ?r.vote,
                        prev = ?r.prev_log_id,
                        first = ?r.entries.first().map(|e| e.log_id),
                        "refusing append-entries whose entries do not follow prev_log_id"
                    );
                    return Response::Error(RpcError::BadRequest(
                        "append-entries whose entries do not follow prev_log_id".into(),
                    ));
                }
                Response::AppendEntries(self.raft.append_entries(r).await)
            }
            Request::Vote(r) => Response::Vote(self.raft.vote(r).await),
            Request::InstallSnapshot(r) => {
                Response::InstallSnapshot(self.raft.install_snapshot(r).await)
            }
            Request::PutData { write, first, data } => {
                if data.len() > MAX_DATA {
                    return Response::Error(RpcError::BadRequest(format!(
                        "{} bytes of data in one message; at most {MAX_DATA}",
                        data.len()
                    )));
                }
                let (done, answer) = tokio::sync::oneshot::channel();
                let job = StageJob {
                    write,
                    first,
                    data,
                    done,
                };
                if self.stager.send(job).is_err() {
                    return Response::Error(RpcError::Unavailable(
                        "the replica is stopping".into(),
                    ));
                }
                let Ok(staged) = answer.await else {
                    return Response::Error(RpcError::Failed("staging the data failed".into()));
                };
                match staged {
                    Ok(()) => Response::Stored,
                    Err(e @ (ReplicaError::OutOfRange { .. } | ReplicaError::Unaligned { .. })) => {
                        Response::Error(RpcError::BadRequest(e.to_string()))
                    }
                    Err(e) => Response::Error(RpcError::Unavailable(e.to_string())),
                }
            }
            Request::Propose(p) => self.propose(p).await,
            Request::ReadIndex => match self.leads.index().await {
                Ok(i) => Response::ReadIndex(i),
                Err(e) => Response::Error(e),
            },
            Request::Read { first, count } => self.read(first, count).await,
            Request::Fetch { first, count } => self.fetch(first, count).await,
            Request::Status => Response::Status(self.status()),
            Request::Scrub => self.scrub().await,
            Request::Replace { slot, node, addr } => self.replace(slot, node, addr).await,
            Request::Inspect { block } => {
                let m = self.machine.clone();
                let seen = tokio::task::spawn_blocking(move || m.lock().inspect(block)).await;
                match seen {
                    Ok(Some(v)) => Response::Inspected(v),
                    Ok(None) => Response::Error(RpcError::BadRequest(format!(
                        "block {block} is outside the volume"
                    ))),
                    Err(e) => Response::Error(RpcError::Failed(e.to_string())),
                }
            }
        }
    }

    /// Replaces slot `slot`'s server by `node` at `addr` (on the leader): a learner
    /// first, caught up, then the voter in the old one's place (one joint change, so
    /// the volume keeps its majority throughout).
    async fn replace(&self, slot: u16, node: u64, addr: String) -> Response {
        let geo = *self.machine.lock().geometry();
        if slot >= geo.replicas() || geo.slot_of(node) != slot {
            return Response::Error(RpcError::BadRequest(format!(
                "server {node} cannot hold slot {slot} of a volume of {} replicas (its slot \
                 would be {})",
                geo.replicas(),
                geo.slot_of(node)
            )));
        }
        let m = self.raft.metrics().borrow().clone();
        if m.current_leader != Some(self.node_id) {
            return Response::Error(RpcError::NotLeader {
                leader: m.current_leader,
            });
        }
        // Done only once this replica applied it: the membership in the leader's
        // metrics may hold an entry not yet committed, which a new leader may drop.
        let applied = || {
            let g = self.machine.lock();
            let done = g
                .slots()
                .get(usize::from(slot))
                .cloned()
                .flatten()
                .map(|x| x.0);
            (done == Some(node)).then(|| g.epoch())
        };
        if let Some(epoch) = applied() {
            return Response::Replaced { epoch };
        }
        let voters: BTreeSet<u64> = m.membership_config.membership().voter_ids().collect();
        if !voters.contains(&node) {
            self.net.learn(node, &addr);
            if let Err(e) = self
                .raft
                .add_learner(node, BasicNode::new(addr), true)
                .await
            {
                return Response::Error(raft_error(e));
            }
        }
        let new: BTreeSet<u64> = voters
            .iter()
            .copied()
            .filter(|&v| geo.slot_of(v) != slot)
            .chain([node])
            .collect();
        if let Err(e) = self.raft.change_membership(new, false).await {
            return Response::Error(raft_error(e));
        }
        let until = tokio::time::Instant::now() + self.config.rpc_timeout;
        loop {
            if let Some(epoch) = applied() {
                return Response::Replaced { epoch };
            }
            if tokio::time::Instant::now() >= until {
                return Response::Error(RpcError::Unavailable(
                    "the membership change is not applied yet; ask again".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Verifies every held copy, a chunk at a time under the replica's lock, off the
    /// runtime's workers.
    async fn scrub(&self) -> Response {
        let m = self.machine.clone();
        let blocks = self.machine.lock().geometry().blocks;
        let done = tokio::task::spawn_blocking(move || {
            let (mut checked, mut damaged) = (0, 0);
            let mut b = 0;
            while b < blocks {
                let (c, d) = m.lock().scrub(b, 1024)?;
                checked += c;
                damaged += d;
                b += 1024;
            }
            Ok::<_, ReplicaError>((checked, damaged))
        })
        .await;
        match done {
            Ok(Ok((checked, damaged))) => Response::Scrubbed { checked, damaged },
            Ok(Err(e)) => Response::Error(RpcError::Failed(e.to_string())),
            Err(e) => Response::Error(RpcError::Failed(e.to_string())),
        }
    }

    async fn propose(&self, p: Proposal) -> Response {
        let (done, answer) = tokio::sync::oneshot::channel();
        let job = ProposeJob { proposal: p, done };
        if self.proposer.send(job).is_err() {
            return Response::Error(RpcError::Unavailable("the replica is stopping".into()));
        }
        answer.await.unwrap_or_else(|_| {
            Response::Error(RpcError::Unavailable("the replica is stopping".into()))
        })
    }

    fn check_range(&self, first: u64, count: u32) -> Result<(), RpcError> {
        let g = *self.machine.lock().geometry();
        let blocks = g.blocks;
        let max = (MAX_DATA / g.block_size as usize) as u32;
        if count == 0
            || count > max
            || first
                .checked_add(u64::from(count))
                .is_none_or(|e| e > blocks)
        {
            return Err(RpcError::BadRequest(format!(
                "blocks {first}+{count}: outside the volume of {blocks} blocks, or more than {max} at once"
            )));
        }
        Ok(())
    }

    async fn read(&self, first: u64, count: u32) -> Response {
        if let Err(e) = self.check_range(first, count) {
            return Response::Error(e);
        }
        let index = match self.reads.index().await {
            Ok(i) => i,
            Err(e) => return Response::Error(e),
        };
        if let Err(e) = self
            .raft
            .wait(Some(self.config.read_wait))
            .applied_index_at_least(Some(index), "read")
            .await
        {
            return Response::Error(RpcError::Unavailable(format!(
                "not caught up to the read index {index}: {e}"
            )));
        }
        let machine = self.machine.clone();
        let read = tokio::task::spawn_blocking(move || {
            let mut g = machine.lock();
            // A run of home copies in one device request (a request per block before).
            match g.read_run(first, u64::from(count)) {
                Ok(read) => Response::Blocks(
                    read.into_iter()
                        .map(|r| match r {
                            LocalRead::Data(d) => BlockAnswer::Data(d),
                            LocalRead::Zero => BlockAnswer::Zero,
                            LocalRead::NotHere(h) => BlockAnswer::NotHere(h),
                        })
                        .collect(),
                ),
                Err(e) => Response::Error(RpcError::Failed(e.to_string())),
            }
        });
        read.await
            .unwrap_or_else(|e| Response::Error(RpcError::Failed(e.to_string())))
    }

    async fn fetch(&self, first: u64, count: u32) -> Response {
        if let Err(e) = self.check_range(first, count) {
            return Response::Error(e);
        }
        let machine = self.machine.clone();
        let fetched = tokio::task::spawn_blocking(move || {
            let mut out = Vec::with_capacity(count as usize);
            let end = first + u64::from(count);
            // A megabyte's worth of blocks at a time, the lock let go between them: a
            // recovering replica's 16 MiB fetch must not hold this one's stores and
            // applies. Each block's version and data are read together, which is all a
            // fetch needs.
            for chunk in (first..end).step_by(FETCH_CHUNK as usize) {
                let mut g = machine.lock();
                let n = FETCH_CHUNK.min(end - chunk);
                let read = match g.read_run(chunk, n) {
                    Ok(r) => r,
                    Err(e) => return Response::Error(RpcError::Failed(e.to_string())),
                };
                for (b, r) in (chunk..chunk + n).zip(read) {
                    let version = g.table().meta(b).map_or(0, |m| m.version);
                    out.push(match r {
                        LocalRead::Data(d) => (version, Some(serde_bytes::ByteBuf::from(d))),
                        _ => (version, None),
                    });
                }
            }
            Response::Fetched(out)
        });
        fetched
            .await
            .unwrap_or_else(|e| Response::Error(RpcError::Failed(e.to_string())))
    }

    pub fn status(&self) -> Status {
        let m = self.raft.metrics().borrow().clone();
        let (raft_log_used, raft_log_blocks) = self.raft_log.usage();
        let g = self.machine.lock();
        let (used, ring) = g.data_log_usage();
        Status {
            replica: self.id,
            node: self.node_id,
            is_member: g.is_member(),
            epoch: g.epoch(),
            slots: g.slots(),
            volume: g.volume().to_string(),
            geometry: *g.geometry(),
            leader: m.current_leader,
            is_leader: m.current_leader == Some(self.node_id),
            term: m.current_term,
            last_log_index: m.last_log_index.unwrap_or(0),
            applied: m.last_applied.map_or(0, |l| l.index),
            incomplete: g.incomplete() as u64,
            reserve_used: g.reserve_used(),
            checksum_failures: g.checksum_failures(),
            write_back_failures: g.write_back_failures(),
            raft_log_used,
            raft_log_blocks,
            data_log_used: used,
            data_log_blocks: ring,
            members: m.membership_config.membership().voter_ids().collect(),
            log_io: g.log_io(),
            data_io: g.data_io(),
        }
    }

    /// Proposes `cmd` through whoever leads now; `None` if it could not.
    pub async fn propose_anywhere(&self, cmd: Command) -> Option<Outcome> {
        self.propose_through_leader(Proposal {
            session: None,
            command: cmd,
        })
        .await
    }

    /// Proposes `p` through whoever leads now (bounded by the RPC timeout); `None` if
    /// no answer came (it may still have been committed: a retry that must not apply
    /// twice carries a session).
    pub async fn propose_through_leader(&self, p: Proposal) -> Option<Outcome> {
        let leader = self.raft.metrics().borrow().current_leader?;
        let resp = if leader == self.node_id {
            // Bounded like a remote proposal: a leader cut off from its majority
            // never commits, and the caller should try again elsewhere.
            tokio::time::timeout(self.config.rpc_timeout, self.propose(p))
                .await
                .ok()?
        } else {
            call_within(
                self.net.as_ref(),
                leader,
                Request::Propose(p),
                self.config.rpc_timeout,
            )
            .await
            .ok()?
        };
        match resp {
            Response::Proposed(o) => Some(o),
            _ => None,
        }
    }

    /// Asks for a snapshot (and so a purge of the log before it) when the log's ring
    /// is half full, at most once a second: entries larger than the snapshot policy
    /// assumes must not fill it, since a full log stops agreement on this replica.
    async fn snapshot_if_log_fills(&self) {
        let (used, ring) = self.raft_log.usage();
        if used * 2 < ring {
            return;
        }
        let now = tokio::time::Instant::now();
        {
            let mut asked = self
                .snapshot_asked
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if asked.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
                return;
            }
            *asked = Some(now);
        }
        tracing::info!(
            replica = self.id,
            used,
            ring,
            "the log is half full: snapshot"
        );
        if let Err(e) = self.raft.trigger().snapshot().await {
            tracing::warn!(replica = self.id, error = %e, "asking for a snapshot");
        }
    }

    /// Waits until agreement on this replica has stopped for good (its log or state
    /// machine failed): the process should end, so that a supervisor restarts it.
    pub async fn fatal(&self) -> String {
        let mut m = self.raft.metrics();
        loop {
            if let Err(e) = &m.borrow().running_state {
                return e.to_string();
            }
            if m.changed().await.is_err() {
                return "agreement stopped".to_string();
            }
        }
    }

    /// Background work, one step per recovery interval: report blocks found lost,
    /// fetch what this replica lacks (Phase 2), and, on the leader, reclaim reserve
    /// copies every preferred replica now holds.
    async fn background(node: std::sync::Weak<Node>) {
        loop {
            let interval = match node.upgrade() {
                Some(n) => {
                    n.step().await;
                    n.config.recovery_interval
                }
                None => return,
            };
            tokio::time::sleep(interval).await;
        }
    }

    async fn step(&self) {
        self.snapshot_if_log_fills().await;
        let (member, epoch) = {
            let g = self.machine.lock();
            let epoch = g.epoch();
            // Addresses and this server's place change only with the membership.
            let seen = g.membership_index().unwrap_or(u64::MAX - 1);
            if self.seen_membership.swap(seen, Relaxed) != seen {
                for (node, addr) in g.slots().into_iter().flatten() {
                    if node != self.node_id && !addr.is_empty() {
                        self.net.learn(node, &addr);
                    }
                }
                self.member.store(g.is_member(), Relaxed);
            }
            (self.member.load(Relaxed), epoch)
        };
        if !member {
            // Replaced (or not yet in): its copies do not count, and what it would
            // report about them is not the slot's.
            return;
        }
        let lost: Vec<(u64, Version)> = self
            .machine
            .lock()
            .lost()
            .iter()
            .map(|(&b, &v)| (b, v))
            .take(4096)
            .collect();
        if !lost.is_empty() {
            self.propose_anywhere(fenced(
                epoch,
                Command::Lost {
                    replica: self.id,
                    blocks: Some(lost),
                },
            ))
            .await;
        }
        // Staged writes to let go of, for room in the data log: through the log, so
        // that none of them commits after its data is gone (unfenced: which server
        // holds a slot does not matter to it).
        let abandon = self.machine.lock().take_abandoning();
        if !abandon.is_empty() {
            tracing::info!(
                replica = self.id,
                writes = abandon.len(),
                "data log out of room: abandoning staged writes"
            );
            self.propose_anywhere(Command::Abandon { writes: abandon })
                .await;
        }
        let late = self.machine.lock().take_late();
        match late {
            Ok(blocks) if !blocks.is_empty() => {
                self.propose_anywhere(fenced(
                    epoch,
                    Command::Repaired {
                        replica: self.id,
                        blocks,
                    },
                ))
                .await;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(replica = self.id, error = %e, "settling late copies failed"),
        }
        self.phase2().await;
        let is_leader = self.raft.metrics().borrow().current_leader == Some(self.node_id);
        if is_leader {
            let blocks: Vec<(u64, Version)> = self
                .machine
                .lock()
                .table()
                .reclaimable()
                .take(4096)
                .collect();
            if !blocks.is_empty() {
                self.propose_anywhere(Command::Reclaim { blocks }).await;
            }
        }
    }

    /// One Phase 2 fetch: the first run of blocks this replica lacks, from a replica
    /// that holds the first of them, written home if still current, then reported.
    async fn phase2(&self) {
        let (first, count, piece, from, epoch) = {
            let g = self.machine.lock();
            let geo = *g.geometry();
            // From where the last fetch ended, and only blocks someone else holds: a
            // block no replica can give (its copies lost beyond f) must not stall the
            // rebuild of every block after it.
            let cursor = self.phase2_cursor.load(Relaxed);
            let Some((first, m)) = g
                .table()
                .incomplete_from(self.id, cursor)
                .find(|(_, m)| m.holders.iter().any(|r| r != self.id))
            else {
                return;
            };
            // Home copies first: a slice's run lies in order on a preferred replica's
            // home, while reserve copies are scattered slots, read a block at a time
            // under the holder's lock (a 16 MiB fetch from a reserve held the holder's
            // stores and applies for seconds: client writes stalled through Phase 2).
            let others = || m.holders.iter().filter(|&r| r != self.id);
            let home: Vec<ReplicaId> = others().filter(|&r| !m.reserve.contains(r)).collect();
            let holders: Vec<ReplicaId> = if home.is_empty() {
                others().collect()
            } else {
                home
            };
            let from = holders[self.fetch_turn.load(Relaxed) % holders.len()];
            let shift = self.fetch_shift.load(Relaxed);
            let per_fetch = ((self.config.fetch_bytes / u64::from(geo.block_size)) >> shift).max(1);
            let slice_end = (geo.slice_of(first) + 1) * geo.slice_blocks;
            let count = per_fetch.min(slice_end.min(geo.blocks) - first);
            self.phase2_cursor.store(first + count, Relaxed);
            let piece = (MAX_DATA / geo.block_size as usize) as u64;
            (first, count, piece, g.node_of(from), g.epoch())
        };
        let slower = || {
            self.fetch_turn.fetch_add(1, Relaxed);
            let _ = self
                .fetch_shift
                .fetch_update(Relaxed, Relaxed, |s| Some((s + 1).min(12)));
        };
        // One round fetches up to `fetch_bytes` (the paper's 16 MiB), in requests of
        // at most a message's data, one after another from the same holder: its run
        // is read in order, and the round is made durable and reported once.
        let mut repaired = Vec::new();
        let mut short = false;
        let end = first + count;
        let mut at = first;
        while at < end {
            let n = (end - at).min(piece);
            let resp = call_within(
                self.net.as_ref(),
                from,
                Request::Fetch {
                    first: at,
                    count: n as u32,
                },
                self.config.rpc_timeout,
            )
            .await;
            let Ok(Response::Fetched(blocks)) = resp else {
                short = true;
                break;
            };
            let mut g = self.machine.lock();
            for (i, (version, data)) in blocks.into_iter().enumerate() {
                let b = at + i as u64;
                let Some(d) = data else { continue };
                let lacks = g
                    .table()
                    .meta(b)
                    .is_some_and(|m| m.version == version && !m.holders.contains(self.id));
                if lacks && matches!(g.repair(b, version, &d), Ok(true)) {
                    repaired.push((b, version));
                }
            }
            at += n;
        }
        if repaired.is_empty() && short {
            slower();
            return;
        }
        // Durable before they are reported; written outside the lock (16 MiB written and
        // flushed under it held the replica's stores and applies for the whole time).
        // The flusher may have taken them into its own batch: then wait until no batch
        // holds them (a failed one puts them back, and the next write-back retries).
        loop {
            if let Err(e) = write_back(&self.machine).await {
                tracing::warn!(replica = self.id, error = %e, "flushing repaired blocks failed");
                return;
            }
            let pending = self
                .machine
                .lock()
                .home_pending(repaired.iter().map(|&(b, _)| b));
            if !pending {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if repaired.is_empty() || short {
            slower();
        } else {
            let _ = self
                .fetch_shift
                .fetch_update(Relaxed, Relaxed, |s| Some(s.saturating_sub(1)));
        }
        if !repaired.is_empty() {
            self.propose_anywhere(fenced(
                epoch,
                Command::Repaired {
                    replica: self.id,
                    blocks: repaired,
                },
            ))
            .await;
        }
    }
}
