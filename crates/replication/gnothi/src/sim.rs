//! An in-process network for tests and the simulation: replicas registered by id,
//! every message encoded and decoded as it would be on a wire, and faults drawn from a
//! seeded stream: loss (of a request, or of its answer after it took effect), delay
//! (so messages overtake each other), and partitions between chosen endpoints.

use crate::net::{BoxFuture, Net, NetError};
use crate::node::Node;
use crate::rpc::{Request, Response, MAX_MESSAGE};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Chance that a request, or separately its answer, is lost.
    pub loss: f64,
    /// Each message waits up to this long (uniformly drawn).
    pub max_delay: Duration,
}

struct State {
    nodes: HashMap<u64, Arc<Node>>,
    rng: ChaCha8Rng,
    faults: Faults,
    /// Endpoint pairs (lower id first) that cannot talk.
    cut: HashSet<(u64, u64)>,
}

pub struct SimNet {
    state: Mutex<State>,
}

/// One endpoint's view of the network: what it sends comes from `from`.
pub struct Endpoint {
    net: Arc<SimNet>,
    from: u64,
}

fn pair(a: u64, b: u64) -> (u64, u64) {
    (a.min(b), a.max(b))
}

impl SimNet {
    pub fn new(seed: u64, faults: Faults) -> Arc<SimNet> {
        Arc::new(SimNet {
            state: Mutex::new(State {
                nodes: HashMap::new(),
                rng: ChaCha8Rng::seed_from_u64(seed),
                faults,
                cut: HashSet::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn endpoint(self: &Arc<SimNet>, from: u64) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            net: self.clone(),
            from,
        })
    }

    pub fn register(&self, node: Arc<Node>) {
        self.lock().nodes.insert(node.node_id, node);
    }

    /// Takes replica `id` off the network (it crashed, or is being stopped).
    pub fn unregister(&self, id: u64) -> Option<Arc<Node>> {
        self.lock().nodes.remove(&id)
    }

    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    /// Cuts (or mends) the link between `a` and `b`.
    pub fn cut(&self, a: u64, b: u64, cut: bool) {
        let mut s = self.lock();
        if cut {
            s.cut.insert(pair(a, b));
        } else {
            s.cut.remove(&pair(a, b));
        }
    }

    pub fn heal(&self) {
        self.lock().cut.clear();
    }

    /// Whether a message from `a` to `b` gets through now, and after what delay.
    fn fate(&self, a: u64, b: u64) -> (bool, Duration) {
        let mut s = self.lock();
        let f = s.faults;
        let lost =
            s.cut.contains(&pair(a, b)) || (f.loss > 0.0 && s.rng.random_bool(f.loss.min(1.0)));
        let delay = if f.max_delay.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_micros(s.rng.random_range(0..=f.max_delay.as_micros() as u64))
        };
        (!lost, delay)
    }

    async fn deliver(&self, from: u64, to: u64, req: Request) -> Result<Response, NetError> {
        let unreachable = || NetError::Unreachable(to, "simulated loss or partition".into());
        // On the wire: what cannot be encoded cannot be sent.
        let wire =
            postcard::to_stdvec(&req).map_err(|e| NetError::Unreachable(to, e.to_string()))?;
        // Nor what is larger than gRPC carries (`transport.rs`): a sender that does
        // not cut its messages to size fails here as it would between processes.
        if wire.len() > MAX_MESSAGE {
            return Err(NetError::Unreachable(
                to,
                format!("a message of {} bytes; at most {MAX_MESSAGE}", wire.len()),
            ));
        }
        let (through, delay) = self.fate(from, to);
        tokio::time::sleep(delay).await;
        if !through {
            return Err(unreachable());
        }
        let node = self
            .lock()
            .nodes
            .get(&to)
            .cloned()
            .ok_or_else(unreachable)?;
        let req: Request =
            postcard::from_bytes(&wire).map_err(|e| NetError::Unreachable(to, e.to_string()))?;
        let resp = node.handle(req).await;
        let wire =
            postcard::to_stdvec(&resp).map_err(|e| NetError::Unreachable(to, e.to_string()))?;
        if wire.len() > MAX_MESSAGE {
            return Err(NetError::Unreachable(
                to,
                format!("an answer of {} bytes; at most {MAX_MESSAGE}", wire.len()),
            ));
        }
        let (through, delay) = self.fate(to, from);
        tokio::time::sleep(delay).await;
        // The answer of a replica that went away meanwhile is lost with it.
        if !through || !self.lock().nodes.contains_key(&to) {
            return Err(unreachable());
        }
        postcard::from_bytes(&wire).map_err(|e| NetError::Unreachable(to, e.to_string()))
    }
}

impl Net for Endpoint {
    fn call(&self, to: u64, req: Request) -> BoxFuture<'_, Result<Response, NetError>> {
        Box::pin(self.net.deliver(self.from, to, req))
    }
}

/// A disk that loses what was not flushed when it crashes: writes wait in a cache
/// until a flush; a crash lets a random part of them reach the media (in any order, as
/// a real disk's cache might) and drops the rest.
pub struct CrashDisk {
    bs: usize,
    count: u64,
    media: Mutex<HashMap<u64, Vec<u8>>>,
    cache: Mutex<HashMap<u64, Vec<u8>>>,
    dead: std::sync::atomic::AtomicBool,
    /// Writes fail as on a full file system (reads and flushes go on).
    full: std::sync::atomic::AtomicBool,
    counters: quilt_block::IoCounters,
}

impl CrashDisk {
    pub fn new(bs: usize, count: u64) -> Arc<CrashDisk> {
        Arc::new(CrashDisk {
            bs,
            count,
            media: Mutex::new(HashMap::new()),
            cache: Mutex::new(HashMap::new()),
            dead: false.into(),
            full: false.into(),
            counters: Default::default(),
        })
    }

    /// From now on (until `false`), every write fails for want of room.
    pub fn set_full(&self, full: bool) {
        self.full.store(full, std::sync::atomic::Ordering::SeqCst);
    }

    /// The disk as it is after a power cut: a new handle (this one fails every request
    /// from now on, so a straggling task of the crashed replica changes nothing).
    pub fn crash(&self, rng: &mut ChaCha8Rng) -> Arc<CrashDisk> {
        self.dead.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut media = self.media.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut cached: Vec<(u64, Vec<u8>)> = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        cached.sort_by_key(|&(b, _)| b);
        for (b, d) in cached {
            if rng.random_bool(0.5) {
                media.insert(b, d);
            }
        }
        Arc::new(CrashDisk {
            bs: self.bs,
            count: self.count,
            media: Mutex::new(media),
            cache: Mutex::new(HashMap::new()),
            dead: false.into(),
            full: false.into(),
            counters: Default::default(),
        })
    }

    /// Flips a bit of `block` on the media (a damaged sector).
    pub fn damage(&self, block: u64) {
        let mut m = self.media.lock().unwrap_or_else(|p| p.into_inner());
        let d = m.entry(block).or_insert_with(|| vec![0u8; self.bs]);
        d[self.bs / 2] ^= 0x40;
        if let Some(c) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&block)
        {
            c[self.bs / 2] ^= 0x40;
        }
    }

    fn check(&self, block: u64, len: usize) -> quilt_block::Result<()> {
        if self.dead.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(quilt_block::BlockError::Unavailable {
                what: "simulated disk".into(),
                why: "it crashed".into(),
            });
        }
        if len % self.bs != 0 || len == 0 {
            return Err(quilt_block::BlockError::BadBufferSize {
                got: len,
                block_size: self.bs,
            });
        }
        let end = block.saturating_add((len / self.bs) as u64);
        if end > self.count {
            return Err(quilt_block::BlockError::OutOfRange {
                block: end - 1,
                count: self.count,
            });
        }
        Ok(())
    }
}

impl quilt_block::BlockDevice for CrashDisk {
    fn block_size(&self) -> usize {
        self.bs
    }
    fn block_count(&self) -> u64 {
        self.count
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.read_blocks(block, buf)
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.check(first, buf.len())?;
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let media = self.media.lock().unwrap_or_else(|p| p.into_inner());
        for (i, out) in buf.chunks_mut(self.bs).enumerate() {
            let b = first + i as u64;
            match cache.get(&b).or_else(|| media.get(&b)) {
                Some(d) => out.copy_from_slice(d),
                None => out.fill(0),
            }
        }
        self.counters.read(buf.len());
        Ok(())
    }
    fn write(
        &self,
        block: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.write_blocks(block, buf, class)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        _class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.check(first, buf.len())?;
        if self.full.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(quilt_block::BlockError::NoSpace {
                path: "crash disk".into(),
                first,
                end: first + (buf.len() / self.bs) as u64,
            });
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        for (i, d) in buf.chunks(self.bs).enumerate() {
            cache.insert(first + i as u64, d.to_vec());
        }
        self.counters.write(buf.len());
        Ok(())
    }
    fn flush(&self) -> quilt_block::Result<()> {
        self.check(0, self.bs)?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let mut media = self.media.lock().unwrap_or_else(|p| p.into_inner());
        media.extend(cache.drain());
        self.counters.flush();
        Ok(())
    }
    fn stats(&self) -> quilt_block::IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        quilt_block::Capabilities::default()
    }
}

/// A volume's replicas in one process, on crash disks, over a [`SimNet`]: for tests
/// and the simulation.
pub struct Cluster {
    pub net: Arc<SimNet>,
    pub geometry: crate::Geometry,
    pub config: crate::node::NodeConfig,
    disks: Vec<(Arc<CrashDisk>, Arc<CrashDisk>)>,
    nodes: Vec<Option<Arc<Node>>>,
    members: std::collections::BTreeMap<u64, openraft::BasicNode>,
    rng: ChaCha8Rng,
    replacements: u64,
    /// Each slot's server: how many were replaced before it.
    incarnations: Vec<u32>,
    raft_bytes: u64,
    /// Servers replaced while still running.
    retired: Vec<Arc<Node>>,
}

/// Log and data device sizes for a simulated replica.
fn sim_label(
    replica: u16,
    incarnation: u32,
    geometry: crate::Geometry,
    raft_bytes: u64,
) -> crate::layout::Label {
    let bs = u64::from(geometry.block_size);
    crate::layout::Label {
        replica,
        incarnation,
        volume: "sim".into(),
        geometry,
        reserve_slots: geometry.blocks.min(4096),
        raft_blocks: raft_bytes / bs,
        data_blocks: (8 << 20) / bs,
        snap_blocks: (geometry.blocks * 24 + 4096).div_ceil(bs) + 2,
    }
}

impl Cluster {
    /// Formats and starts `2f+1` replicas (`f+1`+`f` for Cheap Paxos, 1 for local).
    pub async fn start(
        geometry: crate::Geometry,
        seed: u64,
        faults: Faults,
        config: crate::node::NodeConfig,
    ) -> Result<Cluster, crate::node::NodeError> {
        Cluster::start_with_log(geometry, seed, faults, config, 16 << 20).await
    }

    /// As [`Cluster::start`], each replica's Raft log in a ring of `raft_bytes`.
    pub async fn start_with_log(
        geometry: crate::Geometry,
        seed: u64,
        faults: Faults,
        config: crate::node::NodeConfig,
        raft_bytes: u64,
    ) -> Result<Cluster, crate::node::NodeError> {
        let net = SimNet::new(seed, faults);
        let n = geometry.replicas();
        let members = (0..u64::from(n))
            .map(|r| (r, openraft::BasicNode::new(format!("sim:{r}"))))
            .collect();
        let mut disks = Vec::new();
        for r in 0..n {
            disks.push(Cluster::new_disks(geometry, r, 0, raft_bytes)?);
        }
        let mut c = Cluster {
            net,
            geometry,
            config,
            disks,
            nodes: vec![None; n as usize],
            members,
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5eed),
            replacements: 0,
            incarnations: vec![0; n as usize],
            raft_bytes,
            retired: Vec::new(),
        };
        for r in 0..n {
            c.start_replica(r).await?;
        }
        Ok(c)
    }

    /// A server's two disks, formatted for slot `r`.
    fn new_disks(
        geometry: crate::Geometry,
        r: u16,
        incarnation: u32,
        raft_bytes: u64,
    ) -> Result<(Arc<CrashDisk>, Arc<CrashDisk>), crate::node::NodeError> {
        let label = sim_label(r, incarnation, geometry, raft_bytes);
        let log = CrashDisk::new(geometry.block_size as usize, label.blocks_needed());
        let data = CrashDisk::new(geometry.block_size as usize, label.data_blocks_needed());
        let log_dyn: Arc<dyn quilt_block::BlockDevice> = log.clone();
        crate::replica::Local::format(&log_dyn, &label)?;
        let data_dyn: Arc<dyn quilt_block::BlockDevice> = data.clone();
        label
            .write_data_label(data_dyn.as_ref())
            .map_err(|e| crate::node::NodeError::Raft(format!("labelling a data disk: {e}")))?;
        Ok((log, data))
    }

    pub fn replicas(&self) -> u16 {
        self.geometry.replicas()
    }

    /// Slot `r`'s server's agreement id.
    pub fn node_id(&self, r: u16) -> u64 {
        self.geometry.node_id(r, self.incarnations[r as usize])
    }

    /// Replaces slot `r`'s whole server (both disks) by a new, empty one, through a
    /// membership change: the old one is crashed first unless `keep_old` (then it
    /// runs on, replaced, as a server cut off during the change would), the new one
    /// starts with nothing, and whoever leads lets it in (`Request::Replace`). Returns
    /// the new server's id, or why the change did not happen within `within`.
    pub async fn replace_server(
        &mut self,
        r: u16,
        keep_old: bool,
        within: std::time::Duration,
    ) -> Result<u64, String> {
        if !keep_old {
            self.crash(r).await;
        } else if let Some(old) = self.nodes[r as usize].take() {
            // Off the cluster's books, still on the network.
            self.retired.push(old);
        }
        let incarnation = self.incarnations[r as usize] + 1;
        self.incarnations[r as usize] = incarnation;
        self.disks[r as usize] = Cluster::new_disks(self.geometry, r, incarnation, self.raft_bytes)
            .map_err(|e| e.to_string())?;
        self.start_replica(r).await.map_err(|e| e.to_string())?;
        self.let_in(r, within).await
    }

    /// Asks whoever leads to let slot `r`'s new server in (`Request::Replace`), until
    /// it is done or `within` has passed (without a connected majority it cannot be:
    /// then the new server waits, not a member, and this may be asked again). The
    /// leader may be a server already replaced but still running.
    pub async fn let_in(&mut self, r: u16, within: std::time::Duration) -> Result<u64, String> {
        let node = self.node_id(r);
        let deadline = tokio::time::Instant::now() + within;
        let mut last = String::from("no replica up");
        loop {
            let up: Vec<Arc<Node>> = self
                .nodes
                .iter()
                .flatten()
                .chain(self.retired.iter())
                .filter(|n| n.node_id != node)
                .cloned()
                .collect();
            for n in &up {
                let req = crate::rpc::Request::Replace {
                    slot: r,
                    node,
                    addr: format!("sim:{node}"),
                };
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                match tokio::time::timeout(left, n.handle(req)).await {
                    Ok(crate::rpc::Response::Replaced { .. }) => return Ok(node),
                    Ok(crate::rpc::Response::Error(e)) => last = e.to_string(),
                    Ok(other) => last = other.unexpected().to_string(),
                    Err(_) => last = "timed out".into(),
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(last);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(last);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    pub fn node(&self, r: u16) -> Option<&Arc<Node>> {
        self.nodes.get(r as usize).and_then(|n| n.as_ref())
    }

    pub fn is_up(&self, r: u16) -> bool {
        self.node(r).is_some()
    }

    /// Starts replica `r` on its disks as they are.
    pub async fn start_replica(&mut self, r: u16) -> Result<(), crate::node::NodeError> {
        if self.is_up(r) {
            return Ok(());
        }
        let (log, data) = self.disks[r as usize].clone();
        // A replacement initializes nothing: it is let in by the leader.
        let members = if self.incarnations[r as usize] == 0 {
            self.members.clone()
        } else {
            Default::default()
        };
        let node = Node::start(
            r,
            log,
            data,
            self.net.endpoint(self.node_id(r)),
            members,
            self.config.clone(),
        )
        .await?;
        self.net.register(node.clone());
        self.nodes[r as usize] = Some(node);
        Ok(())
    }

    /// Crashes replica `r`: off the network at once, its disks keep only what was
    /// flushed (and a random part of what was not).
    pub async fn crash(&mut self, r: u16) {
        let Some(node) = self.nodes[r as usize].take() else {
            return;
        };
        self.net.unregister(node.node_id);
        let (log, data) = &self.disks[r as usize];
        let (log, data) = (log.crash(&mut self.rng), data.crash(&mut self.rng));
        self.disks[r as usize] = (log, data);
        node.shutdown().await;
    }

    /// Replaces down replica `r`'s data disk by an empty one (a failed disk swapped),
    /// first telling the volume that `r` holds nothing (what an operator does before
    /// the replica rejoins: re-replication then rebuilds it). Fails if no majority took
    /// the news.
    pub async fn replace_data_disk(&mut self, r: u16) -> bool {
        if self.is_up(r) {
            return false;
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        // One operator session per replacement, so that a retry whose first try was
        // committed unseen applies once (a late second `Lost` would drop copies the
        // replica has rebuilt since).
        self.replacements += 1;
        let session = crate::meta::Session {
            client: u64::MAX - u64::from(r),
            seq: self.replacements,
            done_below: self.replacements,
        };
        loop {
            for up in self.nodes.iter().flatten() {
                let p = crate::meta::Proposal {
                    session: Some(session),
                    command: crate::table::Command::Lost {
                        replica: r,
                        blocks: None,
                    },
                };
                if let Some(crate::meta::Outcome::Applied(_) | crate::meta::Outcome::Duplicate(_)) =
                    up.propose_through_leader(p).await
                {
                    let (_, data) = &self.disks[r as usize];
                    let fresh = CrashDisk::new(data.bs, data.count);
                    self.disks[r as usize].1 = fresh;
                    return true;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Whether the leader's table has every written block on f+1 replicas (so one
    /// more failure loses nothing). `false` when no leader is up.
    /// Judged on every replica up, which must all have applied the same index (a
    /// leader that lags or was deposed unawares would judge from a stale table).
    pub fn fully_redundant(&self) -> bool {
        let up: Vec<&Arc<Node>> = self.nodes.iter().flatten().collect();
        if up.len() < usize::from(self.geometry.copies()) {
            return false;
        }
        // Every up replica has applied all its log, and the same: an entry committed
        // while others were down is in the log of one of these (a majority), and
        // would otherwise be missed by a new leader that has not yet committed an
        // entry of its own term.
        let st: Vec<crate::rpc::Status> = up.iter().map(|n| n.status()).collect();
        if st
            .iter()
            .any(|s| s.applied != st[0].applied || s.applied != s.last_log_index)
        {
            return false;
        }
        let copies = u32::from(self.geometry.copies());
        up.iter().all(|n| {
            let g = n.machine().lock();
            // A copy the table names but the replica found gone (damaged, or its data
            // lost) is one fewer until it is repaired.
            if !g.lost().is_empty() {
                return false;
            }
            let t = g.table();
            (0..self.geometry.blocks).all(|b| {
                t.meta(b)
                    .is_some_and(|m| m.version == 0 || m.holders.len() >= copies)
            })
        })
    }

    /// Each replica's view of the blocks it should hold and does not, for failure
    /// messages.
    pub fn describe(&self) -> String {
        let mut out = Vec::new();
        for n in self.nodes.iter().flatten() {
            let st = n.status();
            let g = n.machine().lock();
            let t = g.table();
            let odd: Vec<String> = (0..self.geometry.blocks)
                .filter_map(|b| {
                    let m = t.meta(b)?;
                    (m.version > 0 && m.holders.len() < u32::from(self.geometry.copies())).then(
                        || {
                            format!(
                                "b{b}@v{} holders {:#b} reserve {:#b}",
                                m.version, m.holders.0, m.reserve.0
                            )
                        },
                    )
                })
                .collect();
            out.push(format!(
                "replica {} (server {}, membership {} {:?}, leader {}, applied {}, lost {:?}): under-replicated {:?}",
                n.id,
                n.node_id,
                st.epoch,
                st.slots.iter().map(|s| s.as_ref().map(|x| x.0)).collect::<Vec<_>>(),
                st.is_leader,
                st.applied,
                g.lost(),
                odd
            ));
        }
        out.join("; ")
    }

    pub fn data_disk(&self, r: u16) -> &Arc<CrashDisk> {
        &self.disks[r as usize].1
    }

    /// A client of the volume, as endpoint `1000 + id`.
    pub async fn client(
        &self,
        id: u64,
        config: crate::client::ClientConfig,
    ) -> Result<crate::client::Client, crate::client::ClientError> {
        let servers: Vec<u64> = (0..self.replicas()).map(|r| self.node_id(r)).collect();
        crate::client::Client::connect_to(self.net.endpoint(1000 + id), &servers, id, config).await
    }

    /// Stops every replica (their disks keep everything: a clean stop).
    pub async fn shutdown(&mut self) {
        for r in 0..self.replicas() {
            if let Some(n) = self.nodes[r as usize].take() {
                self.net.unregister(n.node_id);
                n.shutdown().await;
            }
        }
        for n in std::mem::take(&mut self.retired) {
            self.net.unregister(n.node_id);
            n.shutdown().await;
        }
    }
}
