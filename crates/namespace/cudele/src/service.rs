//! The metadata service's core, free of any network: the global namespace in one
//! [`FileSystem`] (a module that has atomic batches), the clients and their leases,
//! subtree policies and holds, and what every request does.
//!
//! **What is kept where.** The namespace is the module's. The service's own records
//! live in the same store, in a directory no client can see (`/.quiltfs-mds`): the
//! registry (clients given out, and per subtree its policy, its version, the client
//! holding it decoupled and that client's granted numbers; rewritten whole, through a
//! new file renamed over the old, and synced), journals staged for a durable merge,
//! and journals pushed by Global Persist. Merge watermarks are attributes of the
//! subtree's root, set in the merge's own batches (`merge.rs`). So policies, holds,
//! EBUSY blocks and grants survive a restart, and a durable merge that was cut by
//! one is finished before the service answers anyone.
//!
//! **Which subtree a request touches.** The directories an operation names (a parent,
//! the two of a rename, a directory itself; a file by the directory it was last seen
//! in) are walked up to the root through `..` (cached; every change of a directory's
//! place goes through the service). Each directory with a registry entry on the way
//! governs: the nearest one's policy applies, and any hold on the way blocks (EBUSY)
//! a client other than its holder when its interfere policy is `block` and the
//! holder's lease is alive. A hold outlives its lease (the holder may come back and
//! merge its locally persisted journal); only the blocking lapses.
//!
//! **Durability of requests.** Under a policy with global durability (Stream), a
//! changing request is answered once the store made it durable: one `sync_all` covers
//! every change made before it started (group commit), so concurrent clients share
//! them.

use crate::journal::{self, Tail};
use crate::merge::{self, MergeError, Scope};
use crate::policy::{Durability, Interfere, Policy};
use crate::rpc::{PolicyInfo, Request, Response};
use quilt_vfs::{
    Attr, Ctx, FileSystem, FileType, FsError, FsOp, FsReply, Ino, InoGrant, WireError,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The service's own directory at the namespace's root, hidden from clients.
pub const HIDDEN: &[u8] = b".quiltfs-mds";
const REGISTRY: &[u8] = b"registry";
const REGISTRY_NEW: &[u8] = b"registry.new";
/// The registry's format: version 2 marks each hold decoupled or not; version 1 (every
/// hold decoupled) is still read.
const REGISTRY_MAGIC: &[u8; 8] = b"QMDSREG2";
const REGISTRY_MAGIC_V1: &[u8; 8] = b"QMDSREG1";

#[derive(Debug, Clone)]
pub struct MdsConfig {
    /// How long a client's hold keeps blocking others without a renewal.
    pub lease: Duration,
    /// Events per atomic batch of a merge (halved while a batch is too large for the
    /// store's journal).
    pub merge_chunk: usize,
}

impl Default for MdsConfig {
    fn default() -> MdsConfig {
        MdsConfig {
            lease: Duration::from_secs(30),
            merge_chunk: 16384,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Hold {
    client: u64,
    grants: Vec<InoGrant>,
    /// Decoupled (the holder journals and merges), or held by a client that uses the
    /// subtree through RPCs and only keeps others out (`Request::Hold`): such a hold
    /// has nothing to merge, so once its lease lapsed another client may take it.
    decoupled: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Entry {
    /// From the namespace's root, `/`-separated (betrfs knows a directory by number
    /// only once it was looked up by name, so a restart finds entries by path).
    path: Vec<u8>,
    policy: Policy,
    version: u64,
    holder: Option<Hold>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
struct Registry {
    next_client: u64,
    subtrees: BTreeMap<Ino, Entry>,
    /// Each client's token, given at hello: a request names its client and carries
    /// the token, so that no client acts as another.
    tokens: BTreeMap<u64, u128>,
}

impl Registry {
    fn encode(&self) -> Vec<u8> {
        let body = postcard::to_stdvec(self).unwrap_or_default();
        let mut out = REGISTRY_MAGIC.to_vec();
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn decode(b: &[u8]) -> Result<Registry, String> {
        let v1 = b.len() >= 8 && &b[..8] == REGISTRY_MAGIC_V1;
        if b.len() < 12 || (&b[..8] != REGISTRY_MAGIC && !v1) {
            return Err("not a metadata service registry".into());
        }
        let mut c = [0u8; 4];
        c.copy_from_slice(&b[8..12]);
        if crc32c::crc32c(&b[12..]) != u32::from_le_bytes(c) {
            return Err("the registry is damaged (checksum mismatch)".into());
        }
        let undecoded = |e: postcard::Error| format!("the registry does not decode: {e}");
        if v1 {
            return postcard::from_bytes::<v1::Registry>(&b[12..])
                .map(v1::Registry::upgrade)
                .map_err(undecoded);
        }
        postcard::from_bytes(&b[12..]).map_err(undecoded)
    }
}

/// The registry as version 1 wrote it (before holds for RPCs): every hold decoupled.
mod v1 {
    use quilt_vfs::{Ino, InoGrant};
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Deserialize)]
    struct Hold {
        client: u64,
        grants: Vec<InoGrant>,
    }

    #[derive(Deserialize)]
    struct Entry {
        path: Vec<u8>,
        policy: crate::policy::Policy,
        version: u64,
        holder: Option<Hold>,
    }

    #[derive(Deserialize)]
    pub(super) struct Registry {
        next_client: u64,
        subtrees: BTreeMap<Ino, Entry>,
        tokens: BTreeMap<u64, u128>,
    }

    impl Registry {
        pub(super) fn upgrade(self) -> super::Registry {
            let subtrees = self
                .subtrees
                .into_iter()
                .map(|(ino, e)| {
                    let entry = super::Entry {
                        path: e.path,
                        policy: e.policy,
                        version: e.version,
                        holder: e.holder.map(|h| super::Hold {
                            client: h.client,
                            grants: h.grants,
                            decoupled: true,
                        }),
                    };
                    (ino, entry)
                })
                .collect();
            super::Registry {
                next_client: self.next_client,
                subtrees,
                tokens: self.tokens,
            }
        }
    }
}

struct State {
    reg: Registry,
    /// Directory → (parent, name), as last seen.
    dirs: HashMap<Ino, (Ino, Vec<u8>)>,
    /// File → the directory it was last seen in.
    files: HashMap<Ino, Ino>,
    leases: HashMap<u64, Instant>,
    /// Each client's open handles (file → count), each one `FileSystem::open` of the
    /// store: an unlinked file lives until they are closed, or until the client's lease
    /// lapses (`sweep_handles`).
    handles: HashMap<u64, HashMap<Ino, u32>>,
    /// When `sweep_handles` looks for lapsed clients next.
    next_sweep: Instant,
}

/// Group commit: changes counted as they are made, syncs that cover them.
#[derive(Default)]
struct Commit {
    st: Mutex<CommitState>,
    cv: Condvar,
}

#[derive(Default)]
struct CommitState {
    changes: u64,
    durable: u64,
    syncing: bool,
    error: Option<String>,
}

/// The metadata service.
pub struct Mds {
    fs: Arc<dyn FileSystem>,
    cfg: MdsConfig,
    root: Ino,
    hidden: Ino,
    st: Mutex<State>,
    /// Per held subtree: requests inside it take it shared, a merge alone.
    gates: Mutex<HashMap<Ino, Arc<RwLock<()>>>>,
    /// Registry rewrites one at a time.
    reg_write: Mutex<()>,
    commit: Commit,
    counters: Counters,
}

/// What the service has answered since it started (`Mds::metrics`).
#[derive(Default)]
struct Counters {
    requests: [AtomicU64; crate::rpc::REQUEST_KINDS.len()],
    errors: [AtomicU64; crate::rpc::REQUEST_KINDS.len()],
    /// Errors that were EBUSY: requests refused inside a subtree another client holds.
    busy: AtomicU64,
    merged_events: AtomicU64,
    skipped_events: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
pub enum MdsError {
    #[error("the namespace store: {0}")]
    Store(FsError),
    #[error("{0}")]
    Registry(String),
    #[error("finishing a staged merge: {0}")]
    Staged(MergeError),
}

fn wire(errno: i32, message: impl Into<String>) -> WireError {
    WireError {
        errno,
        message: message.into(),
    }
}

fn fs_err(e: &FsError) -> WireError {
    WireError::from(e)
}

fn err(errno: i32, message: impl Into<String>) -> Response {
    Response::Error(wire(errno, message))
}

fn staged_name(client: u64, subtree: Ino) -> Vec<u8> {
    format!("staged.{client}.{subtree}").into_bytes()
}

fn persisted_name(client: u64, subtree: Ino) -> Vec<u8> {
    format!("persisted.{client}.{subtree}").into_bytes()
}

impl Mds {
    /// Opens the service on `fs`: its hidden directory made if new, the registry read,
    /// every hold's unused numbers set aside again, staged merges finished.
    pub fn open(fs: Arc<dyn FileSystem>, cfg: MdsConfig) -> Result<Mds, MdsError> {
        let root = fs.root();
        let c = Ctx::root();
        let hidden = match fs.lookup(root, HIDDEN) {
            Ok(a) => a.ino,
            Err(FsError::NotFound) => {
                fs.mkdir(root, HIDDEN, 0o700, &c)
                    .map_err(MdsError::Store)?
                    .ino
            }
            Err(e) => return Err(MdsError::Store(e)),
        };
        let reg = match read_file(&*fs, hidden, REGISTRY) {
            Ok(Some(b)) => Registry::decode(&b).map_err(MdsError::Registry)?,
            Ok(None) => Registry {
                next_client: 1,
                ..Default::default()
            },
            Err(e) => return Err(MdsError::Store(e)),
        };
        let mds = Mds {
            fs,
            cfg,
            root,
            hidden,
            st: Mutex::new(State {
                reg,
                dirs: HashMap::new(),
                files: HashMap::new(),
                leases: HashMap::new(),
                handles: HashMap::new(),
                next_sweep: Instant::now(),
            }),
            gates: Mutex::new(HashMap::new()),
            reg_write: Mutex::new(()),
            commit: Commit::default(),
            counters: Counters::default(),
        };
        mds.find_entries();
        mds.hold_grants();
        mds.finish_staged()?;
        Ok(mds)
    }

    pub fn fs(&self) -> &Arc<dyn FileSystem> {
        &self.fs
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks every registry entry up by its path (so that the store knows its number
    /// in this mount), re-keying one whose number changed.
    fn find_entries(&self) {
        let entries: Vec<(Ino, Vec<u8>)> = self
            .state()
            .reg
            .subtrees
            .iter()
            .map(|(i, e)| (*i, e.path.clone()))
            .collect();
        for (ino, path) in entries {
            match self.resolve_path(&path) {
                Ok(a) if a.ino == ino => {}
                Ok(a) => {
                    tracing::warn!(
                        "mds: {} is inode {} now, not {ino}; its policy follows the path",
                        String::from_utf8_lossy(&path),
                        a.ino
                    );
                    let mut st = self.state();
                    if let Some(e) = st.reg.subtrees.remove(&ino) {
                        st.reg.subtrees.insert(a.ino, e);
                    }
                }
                Err(e) => tracing::warn!(
                    "mds: the subtree at {} (inode {ino}) is not found by its path ({e}); \
                     its policy stays with its number",
                    String::from_utf8_lossy(&path)
                ),
            }
        }
    }

    /// Sets aside again the numbers of every hold above its merge watermark.
    fn hold_grants(&self) {
        let holds: Vec<(Ino, Hold)> = self
            .state()
            .reg
            .subtrees
            .iter()
            .filter_map(|(i, e)| e.holder.clone().map(|h| (*i, h)))
            .collect();
        for (root, h) in holds {
            // The holder gets a whole lease to come back: its block holds meanwhile.
            self.renew(h.client);
            let max = match merge::watermark(&*self.fs, root, h.client) {
                Ok(w) => w.max_ino,
                Err(e) => {
                    tracing::error!("mds: subtree {root}'s watermark: {e}");
                    continue;
                }
            };
            for g in unused(&h.grants, max) {
                if let Err(e) = self.fs.hold_inodes(g) {
                    tracing::error!(
                        "mds: setting aside client {}'s numbers {}..{} again: {e}",
                        h.client,
                        g.first,
                        g.first + g.count
                    );
                }
            }
        }
    }

    /// Merges every journal staged for a durable merge, then removes it.
    fn finish_staged(&self) -> Result<(), MdsError> {
        let mut names = Vec::new();
        self.fs
            .readdir(self.hidden, 0, &mut |e| {
                if e.name.starts_with(b"staged.") {
                    names.push(e.name);
                }
                true
            })
            .map_err(MdsError::Store)?;
        for name in names {
            let Some(bytes) = read_file(&*self.fs, self.hidden, &name).map_err(MdsError::Store)?
            else {
                continue;
            };
            let read = match journal::read(&bytes, Tail::Strict) {
                Ok(r) => r,
                Err(e) => {
                    // Staging is synced before the merge starts: a torn one never began.
                    tracing::warn!(
                        "mds: {} is not a whole journal ({e}); its merge never began",
                        String::from_utf8_lossy(&name)
                    );
                    let _ = self.fs.unlink(self.hidden, &name, &Ctx::root());
                    continue;
                }
            };
            let Some(scope) = self.scope(read.header.client, read.header.subtree) else {
                tracing::error!(
                    "mds: a staged journal of client {} for subtree {}, which it no longer \
                     holds; kept as {}",
                    read.header.client,
                    read.header.subtree,
                    String::from_utf8_lossy(&name)
                );
                continue;
            };
            self.apply_merge(&scope, &read.events)
                .map_err(MdsError::Staged)?;
            self.fs.sync_all().map_err(MdsError::Store)?;
            tracing::info!(
                "mds: finished the staged merge of client {} into subtree {}",
                scope.client,
                scope.root
            );
            let _ = self.fs.unlink(self.hidden, &name, &Ctx::root());
        }
        Ok(())
    }

    fn scope(&self, client: u64, subtree: Ino) -> Option<Scope> {
        let st = self.state();
        let h = st.reg.subtrees.get(&subtree)?.holder.as_ref()?;
        (h.client == client && h.decoupled).then(|| Scope {
            root: subtree,
            client,
            grants: h.grants.clone(),
        })
    }

    /// Writes the registry: a new file, synced, renamed over the old, synced.
    fn save_registry(&self) -> Result<(), FsError> {
        let _one = self.reg_write.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = self.state().reg.encode();
        write_file(&*self.fs, self.hidden, REGISTRY_NEW, &bytes)?;
        self.fs.rename(
            self.hidden,
            REGISTRY_NEW,
            self.hidden,
            REGISTRY,
            Default::default(),
            &Ctx::root(),
        )?;
        self.fs.sync_all()
    }

    fn resolve_path(&self, path: &[u8]) -> Result<Attr, FsError> {
        let mut a = self.fs.getattr(self.root)?;
        for part in path.split(|&b| b == b'/').filter(|p| !p.is_empty()) {
            if a.ino == self.root && part == HIDDEN {
                return Err(FsError::NotFound);
            }
            let next = self.fs.lookup(a.ino, part)?;
            self.learn(a.ino, part, &next);
            a = next;
        }
        Ok(a)
    }

    fn learn(&self, parent: Ino, name: &[u8], a: &Attr) {
        let mut st = self.state();
        if a.kind == FileType::Directory {
            st.dirs.insert(a.ino, (parent, name.to_vec()));
        } else {
            st.files.insert(a.ino, parent);
        }
    }

    /// `dir`'s parent, from the cache or the store.
    fn parent_of(&self, dir: Ino) -> Result<Ino, FsError> {
        if let Some((p, _)) = self.state().dirs.get(&dir) {
            return Ok(*p);
        }
        let p = self.fs.lookup(dir, b"..")?.ino;
        Ok(p)
    }

    /// `dir`'s name in its parent: the cache, or a search of the parent.
    fn name_of(&self, dir: Ino, parent: Ino) -> Result<Vec<u8>, FsError> {
        if let Some((p, n)) = self.state().dirs.get(&dir) {
            if *p == parent {
                return Ok(n.clone());
            }
        }
        let mut found = None;
        self.fs.readdir(parent, 0, &mut |e| {
            if e.ino == dir && e.name != b"." && e.name != b".." {
                found = Some(e.name);
                return false;
            }
            true
        })?;
        let n = found.ok_or(FsError::NotFound)?;
        self.state().dirs.insert(dir, (parent, n.clone()));
        Ok(n)
    }

    fn path_of(&self, dir: Ino) -> Result<Vec<u8>, FsError> {
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut d = dir;
        for _ in 0..4096 {
            if d == self.root {
                parts.reverse();
                let mut p = Vec::new();
                for part in parts {
                    p.push(b'/');
                    p.extend_from_slice(&part);
                }
                if p.is_empty() {
                    p.push(b'/');
                }
                return Ok(p);
            }
            let parent = self.parent_of(d)?;
            parts.push(self.name_of(d, parent)?);
            d = parent;
        }
        Err(FsError::Io("a directory deeper than 4096 levels".into()))
    }

    /// The registry entries from `dir` up to the root, nearest first.
    fn governing(&self, dir: Ino) -> Result<Vec<(Ino, Entry)>, FsError> {
        let mut out = Vec::new();
        if self.state().reg.subtrees.is_empty() {
            return Ok(out);
        }
        let mut d = dir;
        for _ in 0..4096 {
            if let Some(e) = self.state().reg.subtrees.get(&d) {
                out.push((d, e.clone()));
            }
            if d == self.root {
                return Ok(out);
            }
            let p = self.parent_of(d)?;
            if p == d {
                return Ok(out);
            }
            d = p;
        }
        Err(FsError::Io("a directory deeper than 4096 levels".into()))
    }

    fn policy_of(&self, dir: Ino) -> Result<(Ino, Policy, u64), FsError> {
        Ok(match self.governing(dir)?.first() {
            Some((i, e)) => (*i, e.policy, e.version),
            None => (self.root, Policy::default(), 0),
        })
    }

    fn lease_alive(&self, client: u64) -> bool {
        self.state()
            .leases
            .get(&client)
            .is_some_and(|t| Instant::now() < *t)
    }

    fn renew(&self, client: u64) {
        let until = Instant::now() + self.cfg.lease;
        self.state().leases.insert(client, until);
    }

    fn known_client(&self, client: u64, token: Option<u128>) -> Result<(), WireError> {
        match (self.state().reg.tokens.get(&client), token) {
            (Some(want), Some(got)) if *want == got => Ok(()),
            (Some(_), _) => Err(wire(
                libc::EACCES,
                format!("the request is not client {client}'s (a wrong or missing token)"),
            )),
            (None, _) => Err(wire(
                libc::EACCES,
                format!("client {client} never said hello to this service"),
            )),
        }
    }

    fn gate(&self, subtree: Ino) -> Arc<RwLock<()>> {
        self.gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(subtree)
            .or_default()
            .clone()
    }

    /// Answers one request, which carries `token` (the client's, given at hello).
    /// Blocking: the caller runs it off the network's threads.
    pub fn handle(&self, token: Option<u128>, req: Request) -> Response {
        let kind = req.kind();
        let c = &self.counters;
        c.requests[kind].fetch_add(1, Relaxed);
        let r = self.answer(token, req);
        match &r {
            Response::Error(e) => {
                c.errors[kind].fetch_add(1, Relaxed);
                if e.errno == libc::EBUSY {
                    c.busy.fetch_add(1, Relaxed);
                }
            }
            Response::Merged {
                events, skipped, ..
            } => {
                c.merged_events.fetch_add(*events, Relaxed);
                c.skipped_events.fetch_add(*skipped, Relaxed);
            }
            _ => {}
        }
        r
    }

    /// The service's counters and state in Prometheus's text format (`quiltfs mds
    /// serve --metrics ADDR`): requests and errors by kind (so RPC and merge rates),
    /// refusals under holds, merged events, and the clients, holds and open handles
    /// now.
    pub fn metrics(&self) -> String {
        use quilt_rpc::metrics::{Exposition, Kind};
        let c = &self.counters;
        let mut e = Exposition::new();
        let by_kind = |a: &[AtomicU64]| -> Vec<(String, f64)> {
            crate::rpc::REQUEST_KINDS
                .iter()
                .zip(a)
                .map(|(k, n)| (k.to_string(), n.load(Relaxed) as f64))
                .collect()
        };
        for (name, help, values) in [
            (
                "cudele_requests_total",
                "Requests answered, by kind.",
                by_kind(&c.requests),
            ),
            (
                "cudele_request_errors_total",
                "Requests answered with an error, by kind.",
                by_kind(&c.errors),
            ),
        ] {
            let labels: Vec<[(&str, &str); 1]> =
                values.iter().map(|(k, _)| [("kind", k.as_str())]).collect();
            let samples: Vec<(&[(&str, &str)], f64)> = labels
                .iter()
                .zip(&values)
                .map(|(l, (_, v))| (&l[..], *v))
                .collect();
            e.family(name, Kind::Counter, help, &samples);
        }
        e.metric(
            "cudele_refused_busy_total",
            Kind::Counter,
            "Requests refused with EBUSY inside a subtree another client holds.",
            c.busy.load(Relaxed) as f64,
        );
        e.metric(
            "cudele_merged_events_total",
            Kind::Counter,
            "Client journal events applied by merges.",
            c.merged_events.load(Relaxed) as f64,
        );
        e.metric(
            "cudele_merge_skipped_events_total",
            Kind::Counter,
            "Client journal events a merge skipped (at or below the watermark: applied before).",
            c.skipped_events.load(Relaxed) as f64,
        );
        let (clients, held, subtrees, handles) = {
            let st = self.state();
            (
                st.leases.len(),
                st.reg
                    .subtrees
                    .values()
                    .filter(|s| s.holder.is_some())
                    .count(),
                st.reg.subtrees.len(),
                st.handles
                    .values()
                    .map(|h| h.values().map(|&n| u64::from(n)).sum::<u64>())
                    .sum::<u64>(),
            )
        };
        e.metric(
            "cudele_clients",
            Kind::Gauge,
            "Clients with a lease now.",
            clients as f64,
        );
        e.metric(
            "cudele_subtrees",
            Kind::Gauge,
            "Subtrees with a policy of their own.",
            subtrees as f64,
        );
        e.metric(
            "cudele_subtrees_held",
            Kind::Gauge,
            "Subtrees a client holds now (decoupled or held).",
            held as f64,
        );
        e.metric(
            "cudele_open_handles",
            Kind::Gauge,
            "Files clients hold open through the service.",
            handles as f64,
        );
        e.finish()
    }

    fn answer(&self, token: Option<u128>, req: Request) -> Response {
        self.sweep_handles();
        match req {
            Request::Hello { name } => self.hello(&name),
            Request::Renew { client } => match self.known_client(client, token) {
                Ok(()) => {
                    self.renew(client);
                    Response::Done
                }
                Err(e) => Response::Error(e),
            },
            Request::Op { client, creds, op } => match self.known_client(client, token) {
                Ok(()) => self.op(client, &Ctx::from(creds), op),
                Err(e) => Response::Error(e),
            },
            Request::Resolve { client, path } => {
                if let Err(e) = self.known_client(client, token) {
                    return Response::Error(e);
                }
                match self.resolve_path(&path) {
                    Ok(a) => Response::Attr(a),
                    Err(e) => Response::Error(fs_err(&e)),
                }
            }
            Request::PolicyGet { client, ino } => self
                .known_client(client, token)
                .and_then(|()| self.policy_get(ino))
                .map_or_else(Response::Error, Response::Policy),
            Request::PolicySet {
                client,
                ino,
                settings,
            } => self
                .known_client(client, token)
                .and_then(|()| self.policy_set(ino, &settings))
                .map_or_else(Response::Error, Response::Policy),
            Request::Decouple { client, ino } => match self.known_client(client, token) {
                Ok(()) => self.decouple(client, ino),
                Err(e) => Response::Error(e),
            },
            Request::MoreInodes { client, subtree } => match self.known_client(client, token) {
                Ok(()) => self.more_inodes(client, subtree),
                Err(e) => Response::Error(e),
            },
            Request::Merge {
                client,
                subtree,
                journal,
                durable,
            } => match self.known_client(client, token) {
                Ok(()) => self.merge(client, subtree, &journal, durable),
                Err(e) => Response::Error(e),
            },
            Request::Persist {
                client,
                subtree,
                journal,
            } => match self.known_client(client, token) {
                Ok(()) => self.persist(client, subtree, &journal),
                Err(e) => Response::Error(e),
            },
            Request::Open { client, ino } => match self.known_client(client, token) {
                Ok(()) => self.open_handle(client, ino),
                Err(e) => Response::Error(e),
            },
            Request::Close { client, inos } => match self.known_client(client, token) {
                Ok(()) => self.close_handles(client, &inos),
                Err(e) => Response::Error(e),
            },
            Request::CreateOpen { client, creds, op } => match self.known_client(client, token) {
                Ok(()) if !matches!(op, FsOp::Mknod { ino: None, .. }) => err(
                    libc::EINVAL,
                    "CreateOpen takes a Mknod (with no inode number named)",
                ),
                Ok(()) => match self.op(client, &Ctx::from(creds), op) {
                    Response::Reply(FsReply::Attr(a)) => match self.open_handle(client, a.ino) {
                        Response::Done => Response::Reply(FsReply::Attr(a)),
                        refused => refused,
                    },
                    other => other,
                },
                Err(e) => Response::Error(e),
            },
            Request::Hold { client, ino } => match self.known_client(client, token) {
                Ok(()) => self.hold(client, ino),
                Err(e) => Response::Error(e),
            },
            Request::Release { client, subtree } => match self.known_client(client, token) {
                Ok(()) => self.release(client, subtree),
                Err(e) => Response::Error(e),
            },
            Request::Rejoin { client } => match (self.known_client(client, token), token) {
                (Ok(()), Some(token)) => {
                    self.renew(client);
                    tracing::info!("mds: client {client} came back");
                    Response::Welcome {
                        client,
                        token,
                        root: self.root,
                        lease_ms: self.cfg.lease.as_millis() as u64,
                    }
                }
                (Err(e), _) => Response::Error(e),
                (Ok(()), None) => err(libc::EACCES, "a rejoin without a token"),
            },
            Request::Sync { client } => match self.known_client(client, token) {
                Ok(()) => match self.fs.sync_all() {
                    Ok(()) => Response::Done,
                    Err(e) => Response::Error(fs_err(&e)),
                },
                Err(e) => Response::Error(e),
            },
        }
    }

    fn hello(&self, name: &str) -> Response {
        let token = match random_token() {
            Ok(t) => t,
            Err(e) => return err(libc::EIO, format!("a client token: {e}")),
        };
        let client = {
            let mut st = self.state();
            let c = st.reg.next_client.max(1);
            st.reg.next_client = c + 1;
            st.reg.tokens.insert(c, token);
            c
        };
        // The number is durable before it is given: a restart never gives it again.
        if let Err(e) = self.save_registry() {
            return Response::Error(fs_err(&e));
        }
        self.renew(client);
        tracing::info!("mds: client {client} ({name}) said hello");
        Response::Welcome {
            client,
            token,
            root: self.root,
            lease_ms: self.cfg.lease.as_millis() as u64,
        }
    }

    /// The directories `op` names (and the file it names by number, by the directory
    /// it was seen in), for the subtree checks; and whether it touches the service's
    /// own directory.
    fn touched(&self, op: &FsOp) -> Result<Vec<Ino>, WireError> {
        let hidden_name = |parent: Ino, name: &[u8]| parent == self.root && name == HIDDEN;
        let (dirs, names): (Vec<Ino>, Vec<(Ino, &[u8])>) = match op {
            FsOp::Lookup { parent, name }
            | FsOp::Mknod { parent, name, .. }
            | FsOp::Mkdir { parent, name, .. }
            | FsOp::Symlink { parent, name, .. }
            | FsOp::Unlink { parent, name }
            | FsOp::Rmdir { parent, name } => (vec![*parent], vec![(*parent, name)]),
            FsOp::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => (
                vec![*parent, *new_parent],
                vec![(*parent, name), (*new_parent, new_name)],
            ),
            FsOp::Link {
                ino,
                new_parent,
                new_name,
            } => {
                let mut d = vec![*new_parent];
                d.extend(self.state().files.get(ino).copied());
                (d, vec![(*new_parent, new_name)])
            }
            FsOp::Readdir { ino, .. } => (vec![*ino], vec![]),
            FsOp::Getattr { ino }
            | FsOp::Setattr { ino, .. }
            | FsOp::Readlink { ino }
            | FsOp::Read { ino, .. }
            | FsOp::Write { ino, .. }
            | FsOp::Fsync { ino, .. }
            | FsOp::Setxattr { ino, .. }
            | FsOp::Getxattr { ino, .. }
            | FsOp::Listxattr { ino }
            | FsOp::Removexattr { ino, .. }
            | FsOp::Fallocate { ino, .. } => {
                let st = self.state();
                let d = if *ino == self.root || st.dirs.contains_key(ino) {
                    Some(*ino)
                } else {
                    st.files.get(ino).copied()
                };
                (d.into_iter().collect(), vec![])
            }
            _ => (vec![], vec![]),
        };
        if dirs.contains(&self.hidden) || names.iter().any(|(p, n)| hidden_name(*p, n)) {
            return Err(wire(
                libc::EPERM,
                "the service's own directory (/.quiltfs-mds) is not for clients",
            ));
        }
        Ok(dirs)
    }

    fn op(&self, client: u64, ctx: &Ctx, op: FsOp) -> Response {
        // Looked up, the service's directory is not there; anything else done to it
        // is refused.
        if let FsOp::Lookup { parent, name } = &op {
            if *parent == self.root && name.as_slice() == HIDDEN {
                return Response::Error(fs_err(&FsError::NotFound));
            }
        }
        let dirs = match self.touched(&op) {
            Ok(d) => d,
            Err(e) => return Response::Error(e),
        };
        // The holds over what the request names: blocked, or gates to pass.
        let mut gates = Vec::new();
        // The strictest durability of the subtrees the request names (the default's,
        // global, where none has a policy).
        let mut global = dirs.is_empty();
        for d in &dirs {
            let gov = match self.governing(*d) {
                Ok(g) => g,
                Err(e) => return Response::Error(fs_err(&e)),
            };
            let nearest = gov
                .first()
                .map_or(Policy::default().durability, |(_, e)| e.policy.durability);
            global |= nearest == Durability::Global;
            for (root, e) in gov {
                let Some(h) = &e.holder else { continue };
                if h.client != client
                    && e.policy.interfere == Interfere::Block
                    && self.lease_alive(h.client)
                {
                    return err(
                        libc::EBUSY,
                        format!(
                            "{} is decoupled by client {} (interfere=block)",
                            String::from_utf8_lossy(&e.path),
                            h.client
                        ),
                    );
                }
                gates.push(root);
            }
        }
        gates.sort_unstable();
        gates.dedup();
        let gates: Vec<Arc<RwLock<()>>> = gates.into_iter().map(|g| self.gate(g)).collect();
        let _passing: Vec<_> = gates
            .iter()
            .map(|g| g.read().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let reply = match op.apply(&*self.fs, ctx) {
            Ok(r) => r,
            Err(e) => return Response::Error(fs_err(&e)),
        };
        self.after(&op, &reply);
        if op.changes() && global {
            // Counted once made: a sync that starts after this covers it.
            if let Err(e) = self.durable() {
                return err(libc::EIO, e);
            }
        }
        Response::Reply(self.hide(&op, reply))
    }

    /// Keeps the caches: where directories and files were seen.
    fn after(&self, op: &FsOp, reply: &FsReply) {
        match (op, reply) {
            (
                FsOp::Lookup { parent, name }
                | FsOp::Mknod { parent, name, .. }
                | FsOp::Mkdir { parent, name, .. }
                | FsOp::Symlink { parent, name, .. },
                FsReply::Attr(a),
            ) => self.learn(*parent, name, a),
            (
                FsOp::Link {
                    new_parent,
                    new_name,
                    ..
                },
                FsReply::Attr(a),
            ) => self.learn(*new_parent, new_name, a),
            (FsOp::Readdir { ino, .. }, FsReply::Entries(es)) => {
                let mut st = self.state();
                for e in es {
                    if e.name == b"." || e.name == b".." {
                        continue;
                    }
                    if e.kind == FileType::Directory {
                        st.dirs.insert(e.ino, (*ino, e.name.clone()));
                    } else {
                        st.files.insert(e.ino, *ino);
                    }
                }
            }
            (
                FsOp::Rename {
                    new_parent,
                    new_name,
                    ..
                },
                _,
            ) => {
                if let Ok(a) = self.fs.lookup(*new_parent, new_name) {
                    self.learn(*new_parent, new_name, &a);
                    if a.kind == FileType::Directory {
                        self.refresh_paths();
                    }
                }
            }
            _ => {}
        }
    }

    /// Recomputes every registry entry's path (a directory moved), saving the registry
    /// if one changed.
    fn refresh_paths(&self) {
        let inos: Vec<(Ino, Vec<u8>)> = self
            .state()
            .reg
            .subtrees
            .iter()
            .map(|(i, e)| (*i, e.path.clone()))
            .collect();
        let mut changed = false;
        for (ino, old) in inos {
            if let Ok(p) = self.path_of(ino) {
                if p != old {
                    if let Some(e) = self.state().reg.subtrees.get_mut(&ino) {
                        e.path = p;
                        changed = true;
                    }
                }
            }
        }
        if changed {
            if let Err(e) = self.save_registry() {
                tracing::error!("mds: saving the registry after a move: {e}");
            }
        }
    }

    /// The service's directory left out of the root's listing and of its link count.
    fn hide(&self, op: &FsOp, reply: FsReply) -> FsReply {
        match (op, reply) {
            (FsOp::Readdir { ino, .. }, FsReply::Entries(mut es)) if *ino == self.root => {
                es.retain(|e| e.name != HIDDEN);
                FsReply::Entries(es)
            }
            (_, FsReply::Attr(mut a)) if a.ino == self.root => {
                a.nlink = a.nlink.saturating_sub(1).max(2);
                FsReply::Attr(a)
            }
            (_, r) => r,
        }
    }

    /// Counts a change the caller has made, then waits until a sync that began after
    /// it has ended (one sync for every waiter that counted before it began).
    fn durable(&self) -> Result<(), String> {
        let c = &self.commit;
        let mut g = c.st.lock().unwrap_or_else(|p| p.into_inner());
        g.changes += 1;
        let target = g.changes;
        loop {
            if g.durable >= target {
                return Ok(());
            }
            if !g.syncing {
                g.syncing = true;
                let covers = g.changes;
                drop(g);
                let r = self.fs.sync_all();
                g = c.st.lock().unwrap_or_else(|p| p.into_inner());
                g.syncing = false;
                match r {
                    Ok(()) => {
                        g.durable = g.durable.max(covers);
                        g.error = None;
                    }
                    Err(e) => g.error = Some(e.to_string()),
                }
                c.cv.notify_all();
                if let Some(e) = &g.error {
                    return Err(format!("making the change durable: {e}"));
                }
                continue;
            }
            g = c.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            if let Some(e) = &g.error {
                return Err(format!("making the change durable: {e}"));
            }
        }
    }

    fn dir(&self, ino: Ino) -> Result<Attr, WireError> {
        if ino == self.hidden {
            return Err(fs_err(&FsError::NotFound));
        }
        let a = self.fs.getattr(ino).map_err(|e| fs_err(&e))?;
        if a.kind != FileType::Directory {
            return Err(fs_err(&FsError::NotDir));
        }
        Ok(a)
    }

    fn policy_get(&self, ino: Ino) -> Result<PolicyInfo, WireError> {
        self.dir(ino)?;
        let (from, policy, version) = self.policy_of(ino).map_err(|e| fs_err(&e))?;
        let holder = self
            .governing(ino)
            .map_err(|e| fs_err(&e))?
            .into_iter()
            .find_map(|(_, e)| e.holder.map(|h| h.client));
        Ok(PolicyInfo {
            from,
            policy,
            version,
            holder,
        })
    }

    fn policy_set(&self, ino: Ino, settings: &str) -> Result<PolicyInfo, WireError> {
        self.dir(ino)?;
        // (The nearest policy is the directory's own when it has one.)
        let (_, mut policy, _) = self.policy_of(ino).map_err(|e| fs_err(&e))?;
        for word in settings.split([' ', ',', '\n']).filter(|w| !w.is_empty()) {
            policy
                .set(word)
                .map_err(|e| wire(libc::EINVAL, e.to_string()))?;
        }
        self.upsert(ino, policy, |e| {
            e.policy = policy;
            e.version += 1;
        })
        .map_err(|e| fs_err(&e))?;
        self.policy_get(ino)
    }

    /// Changes directory `ino`'s registry entry (made with `policy` if it has none, its
    /// path brought up to date), and saves the registry.
    fn upsert(
        &self,
        ino: Ino,
        policy: Policy,
        change: impl FnOnce(&mut Entry),
    ) -> Result<(), FsError> {
        let path = self.path_of(ino)?;
        {
            let mut st = self.state();
            let e = st.reg.subtrees.entry(ino).or_insert(Entry {
                path: path.clone(),
                policy,
                version: 0,
                holder: None,
            });
            e.path = path;
            change(e);
        }
        self.save_registry()
    }

    /// The scope of `client`'s hold on `subtree`, or the refusal.
    fn held(&self, client: u64, subtree: Ino) -> Result<Scope, Response> {
        self.scope(client, subtree).ok_or_else(|| {
            err(
                libc::EPERM,
                format!("client {client} does not hold subtree {subtree} decoupled"),
            )
        })
    }

    fn decouple(&self, client: u64, ino: Ino) -> Response {
        match self.try_decouple(client, ino) {
            Ok(r) => r,
            Err(e) => Response::Error(e),
        }
    }

    fn try_decouple(&self, client: u64, ino: Ino) -> Result<Response, WireError> {
        self.dir(ino)?;
        let gov = self.governing(ino).map_err(|e| fs_err(&e))?;
        let policy = gov.first().map_or_else(Policy::default, |(_, e)| e.policy);
        match self.in_the_way(client, ino, &gov)? {
            // Decoupled already by this client: it comes back.
            Some(h) if h.decoupled => {
                self.renew(client);
                let w = merge::watermark(&*self.fs, ino, client).map_err(|e| fs_err(&e))?;
                return Ok(Response::Decoupled {
                    policy,
                    grants: h.grants,
                    merged_seq: w.seq,
                    max_ino: w.max_ino,
                });
            }
            // Held by this client for its RPCs: the hold becomes a decoupled one.
            Some(_) | None => {}
        }
        if !policy.decoupled() {
            return Err(wire(
                libc::EINVAL,
                "the subtree's consistency is strong: it is used through the service, \
                 not decoupled (set consistency=weak or invisible first)",
            ));
        }
        let grants = self.grant(policy.inodes).map_err(|e| fs_err(&e))?;
        self.upsert(ino, policy, |e| {
            e.holder = Some(Hold {
                client,
                grants: grants.clone(),
                decoupled: true,
            })
        })
        .map_err(|e| fs_err(&e))?;
        self.renew(client);
        let w = merge::watermark(&*self.fs, ino, client).map_err(|e| fs_err(&e))?;
        Ok(Response::Decoupled {
            policy,
            grants,
            merged_seq: w.seq,
            max_ino: w.max_ino,
        })
    }

    /// What stands between `client` and a hold on `ino` (whose governing entries are
    /// `gov`): an error when another client holds it, a directory above it or one
    /// inside it; its own hold on `ino` itself when it has one. A hold for RPCs whose
    /// lease lapsed is not in the way (it has nothing to merge): it is dropped.
    fn in_the_way(
        &self,
        client: u64,
        ino: Ino,
        gov: &[(Ino, Entry)],
    ) -> Result<Option<Hold>, WireError> {
        let mut own = None;
        let mut lapsed = Vec::new();
        for (root, e) in gov {
            let Some(h) = &e.holder else { continue };
            if h.client == client && *root == ino {
                own = Some(h.clone());
            } else if !h.decoupled && h.client != client && !self.lease_alive(h.client) {
                lapsed.push(*root);
            } else {
                return Err(wire(
                    libc::EBUSY,
                    format!(
                        "{} is held {}by client {}",
                        String::from_utf8_lossy(&e.path),
                        if h.decoupled { "decoupled " } else { "" },
                        h.client
                    ),
                ));
            }
        }
        let below: Vec<(Ino, u64, bool)> = self
            .state()
            .reg
            .subtrees
            .iter()
            .filter(|(i, _)| **i != ino)
            .filter_map(|(i, e)| e.holder.as_ref().map(|h| (*i, h.client, h.decoupled)))
            .collect();
        for (i, c, decoupled) in below {
            let mut d = i;
            for _ in 0..4096 {
                if d == ino {
                    if !decoupled && c != client && !self.lease_alive(c) {
                        lapsed.push(i);
                        break;
                    }
                    return Err(wire(
                        libc::EBUSY,
                        format!("a directory inside it is held by client {c}"),
                    ));
                }
                if d == self.root {
                    break;
                }
                d = self.parent_of(d).map_err(|e| fs_err(&e))?;
            }
        }
        if !lapsed.is_empty() {
            {
                let mut st = self.state();
                for i in &lapsed {
                    if let Some(e) = st.reg.subtrees.get_mut(i) {
                        tracing::info!(
                            "mds: client {}'s hold on {} lapsed with its lease; dropped",
                            e.holder.as_ref().map_or(0, |h| h.client),
                            String::from_utf8_lossy(&e.path)
                        );
                        e.holder = None;
                    }
                }
            }
            self.save_registry().map_err(|e| fs_err(&e))?;
        }
        Ok(own)
    }

    /// A handle on `ino` for `client` (a file it may reach: the holds are checked as
    /// for any request naming it).
    fn open_handle(&self, client: u64, ino: Ino) -> Response {
        match self.op(client, &Ctx::root(), FsOp::Getattr { ino }) {
            Response::Reply(_) => {}
            refused => return refused,
        }
        if let Err(e) = self.fs.open(ino) {
            return Response::Error(fs_err(&e));
        }
        *self
            .state()
            .handles
            .entry(client)
            .or_default()
            .entry(ino)
            .or_default() += 1;
        Response::Done
    }

    fn close_handles(&self, client: u64, inos: &[Ino]) -> Response {
        let mut first = Ok(());
        for &ino in inos {
            let had = {
                let mut st = self.state();
                let Some(mine) = st.handles.get_mut(&client) else {
                    break;
                };
                match mine.get_mut(&ino) {
                    Some(n) if *n > 1 => {
                        *n -= 1;
                        true
                    }
                    Some(_) => {
                        mine.remove(&ino);
                        if mine.is_empty() {
                            st.handles.remove(&client);
                        }
                        true
                    }
                    // Dropped with a lapsed lease already.
                    None => false,
                }
            };
            if had {
                first = first.and(self.fs.release(ino));
            }
        }
        match first {
            Ok(()) => Response::Done,
            Err(e) => Response::Error(fs_err(&e)),
        }
    }

    /// Closes the handles of every client whose lease lapsed (at most once a second).
    fn sweep_handles(&self) {
        let lapsed: Vec<(u64, Vec<(Ino, u32)>)> = {
            let mut st = self.state();
            let now = Instant::now();
            if now < st.next_sweep || st.handles.is_empty() {
                return;
            }
            st.next_sweep = now + Duration::from_secs(1);
            let dead: Vec<u64> = st
                .handles
                .keys()
                .copied()
                .filter(|c| st.leases.get(c).is_none_or(|t| now >= *t))
                .collect();
            dead.into_iter()
                .filter_map(|c| st.handles.remove(&c).map(|h| (c, h.into_iter().collect())))
                .collect()
        };
        for (client, handles) in lapsed {
            tracing::info!(
                "mds: client {client}'s lease lapsed: its {} open file(s) closed",
                handles.len()
            );
            for (ino, n) in handles {
                for _ in 0..n {
                    if let Err(e) = self.fs.release(ino) {
                        tracing::warn!("mds: closing inode {ino} of client {client}: {e}");
                    }
                }
            }
        }
    }

    fn hold(&self, client: u64, ino: Ino) -> Response {
        match self.try_hold(client, ino) {
            Ok(()) => Response::Done,
            Err(e) => Response::Error(e),
        }
    }

    /// A hold for a client that uses the subtree through RPCs (a mount of it as its
    /// root): others are kept out as its interfere policy says, nothing is granted.
    fn try_hold(&self, client: u64, ino: Ino) -> Result<(), WireError> {
        self.dir(ino)?;
        if ino == self.root {
            return Err(wire(
                libc::EINVAL,
                "the namespace's root is not held: hold a directory in it",
            ));
        }
        let gov = self.governing(ino).map_err(|e| fs_err(&e))?;
        let policy = gov.first().map_or_else(Policy::default, |(_, e)| e.policy);
        if self.in_the_way(client, ino, &gov)?.is_some() {
            // Held already by this client, decoupled or not: it stays as it is.
            self.renew(client);
            return Ok(());
        }
        self.upsert(ino, policy, |e| {
            e.holder = Some(Hold {
                client,
                grants: Vec::new(),
                decoupled: false,
            })
        })
        .map_err(|e| fs_err(&e))?;
        self.renew(client);
        Ok(())
    }

    /// `count` numbers, in as few grants as the store gives (ext2 grants within one
    /// block group).
    fn grant(&self, count: u64) -> Result<Vec<InoGrant>, FsError> {
        let mut out = Vec::new();
        let mut left = count;
        let mut ask = count;
        while left > 0 {
            match self.fs.grant_inodes(ask.min(left)) {
                Ok(g) => {
                    left -= g.count;
                    out.push(g);
                }
                // Too many for one grant (ext2 grants within a block group), or no
                // free run that long: smaller ones.
                Err(FsError::Invalid(_) | FsError::NoSpace) if ask > 1 => ask = ask.div_ceil(2),
                Err(e) => return Err(e),
            }
            if out.len() > 4096 {
                return Err(FsError::NoSpace);
            }
        }
        Ok(out)
    }

    fn more_inodes(&self, client: u64, subtree: Ino) -> Response {
        if let Err(r) = self.held(client, subtree) {
            return r;
        }
        let policy = self.policy_of(subtree).map(|p| p.1).unwrap_or_default();
        let got = match self.grant(policy.inodes) {
            Ok(g) => g,
            Err(e) => return Response::Error(fs_err(&e)),
        };
        {
            let mut st = self.state();
            if let Some(h) = st
                .reg
                .subtrees
                .get_mut(&subtree)
                .and_then(|e| e.holder.as_mut())
            {
                h.grants.extend(got.iter().copied());
            }
        }
        if let Err(e) = self.save_registry() {
            return Response::Error(fs_err(&e));
        }
        match got.first() {
            Some(_) => Response::Granted(got),
            None => err(libc::ENOSPC, "no inode numbers left"),
        }
    }

    /// Applies a validated journal, halving the batch while the store's journal cannot
    /// hold one.
    fn apply_merge(
        &self,
        scope: &Scope,
        events: &[(u64, journal::Event)],
    ) -> Result<merge::Plan, MergeError> {
        let w =
            merge::watermark(&*self.fs, scope.root, scope.client).map_err(MergeError::Namespace)?;
        let plan = merge::plan(&*self.fs, scope, events, w)?;
        let mut chunk = self.cfg.merge_chunk.max(1);
        loop {
            match merge::apply(&*self.fs, scope, &plan, chunk) {
                Ok(_) => return Ok(plan),
                // A batch larger than the store takes whole (ext2's journal, betrfs's
                // log) is refused before it changes anything: smaller ones, from the
                // watermark the earlier batches reached.
                Err(MergeError::Apply { error, .. }) if too_large(&error) && chunk > 1 => {
                    chunk /= 2;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn merge(&self, client: u64, subtree: Ino, bytes: &[u8], durable: bool) -> Response {
        let scope = match self.held(client, subtree) {
            Ok(s) => s,
            Err(r) => return r,
        };
        let read = match journal::read(bytes, Tail::Strict) {
            Ok(r) => r,
            Err(e) => return err(libc::EINVAL, format!("the journal: {e}")),
        };
        if read.header.client != client || read.header.subtree != subtree {
            return err(
                libc::EINVAL,
                format!(
                    "the journal is client {}'s for subtree {}, not client {client}'s for \
                     subtree {subtree}",
                    read.header.client, read.header.subtree
                ),
            );
        }
        self.renew(client);
        let gate = self.gate(subtree);
        let _alone = gate.write().unwrap_or_else(|p| p.into_inner());
        let staged = staged_name(client, subtree);
        if durable {
            if let Err(e) =
                write_file(&*self.fs, self.hidden, &staged, bytes).and_then(|()| self.fs.sync_all())
            {
                return Response::Error(fs_err(&e));
            }
        }
        let result = self.apply_merge(&scope, &read.events);
        let plan = match result {
            Ok(p) => p,
            Err(e) => {
                if durable {
                    // Refused whole (nothing applied) or cut by the store: either way
                    // not to be finished at the next start.
                    let _ = self.fs.unlink(self.hidden, &staged, &Ctx::root());
                }
                let errno = match &e {
                    MergeError::Invalid { .. } => libc::EINVAL,
                    MergeError::Apply { error, .. } | MergeError::Namespace(error) => error.errno(),
                };
                return err(errno, e.to_string());
            }
        };
        if durable {
            if let Err(e) = self.fs.sync_all() {
                return Response::Error(fs_err(&e));
            }
            let _ = self.fs.unlink(self.hidden, &staged, &Ctx::root());
        }
        if plan
            .steps
            .iter()
            .any(|s| matches!(s.op, FsOp::Rename { .. }))
        {
            self.refresh_paths();
        }
        Response::Merged {
            merged_seq: plan.last.seq,
            events: plan.events,
            skipped: plan.skipped,
            moved_aside: plan.moved_aside.len() as u64,
        }
    }

    fn persist(&self, client: u64, subtree: Ino, bytes: &[u8]) -> Response {
        if let Err(r) = self.held(client, subtree) {
            return r;
        }
        let read = match journal::read(bytes, Tail::Strict) {
            Ok(r) => r,
            Err(e) => return err(libc::EINVAL, format!("the journal: {e}")),
        };
        if read.header.client != client || read.header.subtree != subtree {
            return err(libc::EINVAL, "the journal is another client's or subtree's");
        }
        self.renew(client);
        let name = persisted_name(client, subtree);
        let c = Ctx::root();
        let r = (|| -> Result<u64, FsError> {
            let a = match self.fs.lookup(self.hidden, &name) {
                Ok(a) => a,
                Err(FsError::NotFound) => {
                    let a = self
                        .fs
                        .mknod(self.hidden, &name, libc::S_IFREG | 0o600, 0, &c)?;
                    self.fs.write(a.ino, 0, &bytes[..journal::HEADER_LEN], &c)?;
                    self.fs.getattr(a.ino)?
                }
                Err(e) => return Err(e),
            };
            let frames = &bytes[journal::HEADER_LEN..];
            let mut off = a.size;
            for part in frames.chunks(1 << 20) {
                self.fs.write(a.ino, off, part, &c)?;
                off += part.len() as u64;
            }
            self.fs.fsync(a.ino, true)?;
            Ok(off)
        })();
        match r {
            Ok(bytes) => Response::Persisted { bytes },
            Err(e) => Response::Error(fs_err(&e)),
        }
    }

    fn release(&self, client: u64, subtree: Ino) -> Response {
        let holds = self
            .state()
            .reg
            .subtrees
            .get(&subtree)
            .and_then(|e| e.holder.as_ref())
            .is_some_and(|h| h.client == client);
        if !holds {
            return err(
                libc::EPERM,
                format!("client {client} does not hold subtree {subtree}"),
            );
        }
        {
            let mut st = self.state();
            if let Some(e) = st.reg.subtrees.get_mut(&subtree) {
                e.holder = None;
                if e.version == 0 {
                    st.reg.subtrees.remove(&subtree);
                }
            }
        }
        match self.save_registry() {
            Ok(()) => Response::Done,
            Err(e) => Response::Error(fs_err(&e)),
        }
    }

    /// Subtrees with a policy or a hold: (directory, path, policy, version, holder).
    pub fn subtrees(&self) -> Vec<(Ino, String, Policy, u64, Option<u64>)> {
        self.state()
            .reg
            .subtrees
            .iter()
            .map(|(i, e)| {
                (
                    *i,
                    String::from_utf8_lossy(&e.path).into_owned(),
                    e.policy,
                    e.version,
                    e.holder.as_ref().map(|h| h.client),
                )
            })
            .collect()
    }
}

/// 128 bits from the system's random source.
fn random_token() -> std::io::Result<u128> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u128::from_le_bytes(b))
}

fn too_large(e: &FsError) -> bool {
    let m = e.to_string();
    m.contains("journal holds") || m.contains("too large for the log")
}

/// The numbers of `grants` above `max` (a client takes them in increasing order).
fn unused(grants: &[InoGrant], max: Ino) -> Vec<InoGrant> {
    grants
        .iter()
        .filter_map(|g| {
            let end = g.first + g.count;
            let from = g.first.max(max + 1);
            (from < end).then_some(InoGrant {
                first: from,
                count: end - from,
            })
        })
        .collect()
}

fn read_file(fs: &dyn FileSystem, dir: Ino, name: &[u8]) -> Result<Option<Vec<u8>>, FsError> {
    let a = match fs.lookup(dir, name) {
        Ok(a) => a,
        Err(FsError::NotFound) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut out = Vec::with_capacity(a.size as usize);
    while (out.len() as u64) < a.size {
        let part = fs.read(a.ino, out.len() as u64, 1 << 20)?;
        if part.is_empty() {
            break;
        }
        out.extend_from_slice(&part);
    }
    Ok(Some(out))
}

/// Writes `bytes` as file `name` in `dir` (replacing one), durable before it returns.
fn write_file(fs: &dyn FileSystem, dir: Ino, name: &[u8], bytes: &[u8]) -> Result<(), FsError> {
    let c = Ctx::root();
    match fs.unlink(dir, name, &c) {
        Ok(()) | Err(FsError::NotFound) => {}
        Err(e) => return Err(e),
    }
    let a = fs.mknod(dir, name, libc::S_IFREG | 0o600, 0, &c)?;
    let mut off = 0;
    for part in bytes.chunks(1 << 20) {
        fs.write(a.ino, off, part, &c)?;
        off += part.len() as u64;
    }
    fs.fsync(a.ino, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Version 1's layout, as it wrote registries (every hold decoupled).
    #[derive(Serialize)]
    struct HoldV1 {
        client: u64,
        grants: Vec<InoGrant>,
    }
    #[derive(Serialize)]
    struct EntryV1 {
        path: Vec<u8>,
        policy: Policy,
        version: u64,
        holder: Option<HoldV1>,
    }
    #[derive(Serialize)]
    struct RegistryV1 {
        next_client: u64,
        subtrees: BTreeMap<Ino, EntryV1>,
        tokens: BTreeMap<u64, u128>,
    }

    fn framed(magic: &[u8; 8], body: &[u8]) -> Vec<u8> {
        let mut out = magic.to_vec();
        out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn a_version_1_registry_is_read_with_its_holds_decoupled() {
        let grant = InoGrant {
            first: 1000,
            count: 50,
        };
        let mut subtrees = BTreeMap::new();
        subtrees.insert(
            12,
            EntryV1 {
                path: b"job".to_vec(),
                policy: Policy::default(),
                version: 3,
                holder: Some(HoldV1 {
                    client: 4,
                    grants: vec![grant],
                }),
            },
        );
        subtrees.insert(
            13,
            EntryV1 {
                path: b"free".to_vec(),
                policy: Policy::default(),
                version: 1,
                holder: None,
            },
        );
        let v1 = RegistryV1 {
            next_client: 9,
            subtrees,
            tokens: BTreeMap::from([(4, 77u128)]),
        };
        let bytes = framed(REGISTRY_MAGIC_V1, &postcard::to_stdvec(&v1).unwrap());
        let reg = Registry::decode(&bytes).unwrap();
        assert_eq!(reg.next_client, 9);
        assert_eq!(reg.tokens.get(&4), Some(&77));
        let job = &reg.subtrees[&12];
        assert_eq!((job.path.as_slice(), job.version), (&b"job"[..], 3));
        assert_eq!(
            job.holder,
            Some(Hold {
                client: 4,
                grants: vec![grant],
                decoupled: true,
            })
        );
        assert_eq!(reg.subtrees[&13].holder, None);
        // Written again, it is version 2, and reads back the same.
        let again = reg.encode();
        assert_eq!(&again[..8], REGISTRY_MAGIC);
        assert_eq!(Registry::decode(&again).unwrap(), reg);
        // Damage is refused, whichever the version.
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(Registry::decode(&bad).unwrap_err().contains("checksum"));
        assert!(Registry::decode(b"QMDSREG9xxxxyyyy").is_err());
    }
}
