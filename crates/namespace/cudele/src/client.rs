//! The client library: a connection to the metadata service ([`Client`]), the
//! namespace as a [`FileSystem`] through it ([`RemoteFs`]: RPCs, one request per
//! operation), and a decoupled subtree ([`Decoupled`]: Append Client Journal, with
//! Local Persist, Global Persist and merges as its policy says).
//!
//! Both are blocking: a client's own runtime carries the requests, so callers (a FUSE
//! server's threads, a benchmark's loop, a program linking the library) need none.

use crate::journal::{self, ClientJournal, Event, Frame, Header, LocalFile};
use crate::policy::{Consistency, Durability, Policy};
use crate::rpc::{Creds, PolicyInfo, Request, Response};
use crate::transport::Channelled;
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, FsError, FsOp, FsReply, Ino, InoGrant, RenameFlags, Result,
    SetAttr, StatFs, WireError, XattrFlags,
};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A connection to the metadata service, with its client number and lease.
pub struct Client {
    rt: tokio::runtime::Runtime,
    ch: Channelled,
    id: u64,
    token: u128,
    root: Ino,
    lease: Duration,
    stop: Arc<AtomicBool>,
    refusals: Refusals,
}

/// Directories another client's hold keeps this client out of (EBUSY), remembered a
/// moment so that a client that keeps asking (a loop that ignores the error) does not
/// load the service with requests it must refuse: after a refusal, requests in that
/// directory are refused here for 2 ms, doubling with each further refusal up to
/// 200 ms; an answer that is not a refusal forgets it. So after the holder lets go, a
/// client that was refused may be refused here for at most 200 ms more.
#[derive(Default)]
struct Refusals(Mutex<std::collections::HashMap<Ino, (Instant, Duration)>>);

const REFUSED_FIRST: Duration = Duration::from_millis(2);
const REFUSED_MOST: Duration = Duration::from_millis(200);

impl Refusals {
    fn refused(&self, dir: Ino) -> bool {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&dir)
            .is_some_and(|(until, _)| Instant::now() < *until)
    }

    fn answered<T>(&self, dir: Ino, r: &Result<T>) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Err(e) if e.errno() == libc::EBUSY => {
                let wait = map
                    .get(&dir)
                    .map_or(REFUSED_FIRST, |(_, w)| (*w * 2).min(REFUSED_MOST));
                map.insert(dir, (Instant::now() + wait, wait));
            }
            _ => {
                if !map.is_empty() {
                    map.remove(&dir);
                }
            }
        }
    }
}

/// The one directory (or file) an operation is about, for [`Refusals`]; none for those
/// that name two.
fn refusal_key(op: &FsOp) -> Option<Ino> {
    match op {
        FsOp::Lookup { parent, .. }
        | FsOp::Mknod { parent, .. }
        | FsOp::Mkdir { parent, .. }
        | FsOp::Symlink { parent, .. }
        | FsOp::Unlink { parent, .. }
        | FsOp::Rmdir { parent, .. } => Some(*parent),
        FsOp::Getattr { ino }
        | FsOp::Setattr { ino, .. }
        | FsOp::Readlink { ino }
        | FsOp::Read { ino, .. }
        | FsOp::Write { ino, .. }
        | FsOp::Readdir { ino, .. }
        | FsOp::Listxattr { ino }
        | FsOp::Getxattr { ino, .. }
        | FsOp::Setxattr { ino, .. }
        | FsOp::Removexattr { ino, .. } => Some(*ino),
        _ => None,
    }
}

fn unreachable(addr: &str, s: &tonic::Status) -> WireError {
    let errno = match s.code() {
        tonic::Code::Unauthenticated => libc::EACCES,
        _ => libc::EIO,
    };
    WireError {
        errno,
        message: format!("the metadata service at {addr}: {}", s.message()),
    }
}

fn unexpected(r: &Response) -> FsError {
    FsError::Io(format!("an answer the request does not take: {r:?}").into())
}

impl Client {
    /// Connects to the service at `addr` (`host:port`) with the shared `secret` (and
    /// over TLS with `ca_pem`), says hello as `name`, and keeps the lease renewed.
    pub fn connect(
        addr: &str,
        secret: &str,
        ca_pem: Option<Vec<u8>>,
        name: &str,
    ) -> std::result::Result<Arc<Client>, String> {
        let hello = Request::Hello {
            name: name.to_string(),
        };
        Client::start(addr, secret, ca_pem, None, hello)
    }

    /// Comes back as client `client` (which died): `token` is the one it was given,
    /// kept beside its local journal ([`crate::recover`]).
    pub fn rejoin(
        addr: &str,
        secret: &str,
        ca_pem: Option<Vec<u8>>,
        client: u64,
        token: u128,
    ) -> std::result::Result<Arc<Client>, String> {
        Client::start(
            addr,
            secret,
            ca_pem,
            Some(token),
            Request::Rejoin { client },
        )
    }

    fn start(
        addr: &str,
        secret: &str,
        ca_pem: Option<Vec<u8>>,
        token: Option<u128>,
        first: Request,
    ) -> std::result::Result<Arc<Client>, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("quiltfs-mds-client")
            .enable_all()
            .build()
            .map_err(|e| format!("a runtime for the client: {e}"))?;
        let ch = {
            let _in = rt.enter();
            Channelled::new(addr, secret, ca_pem)?
        };
        let welcome = rt
            .block_on(ch.call(token, first))
            .map_err(|s| unreachable(addr, &s).message)?;
        if let Response::Error(e) = &welcome {
            return Err(format!("the service at {addr}: {}", e.message));
        }
        let Response::Welcome {
            client,
            token,
            root,
            lease_ms,
        } = welcome
        else {
            return Err(format!(
                "the service at {addr} did not welcome us: {welcome:?}"
            ));
        };
        let c = Arc::new(Client {
            rt,
            ch,
            id: client,
            token,
            root,
            lease: Duration::from_millis(lease_ms.max(300)),
            stop: Arc::new(AtomicBool::new(false)),
            refusals: Refusals::default(),
        });
        // Renewed at a third of the lease: two renewals may be lost before it lapses.
        let (ch, stop, every) = (c.ch.clone(), c.stop.clone(), c.lease / 3);
        c.rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(every).await;
                let _ = ch.call(Some(token), Request::Renew { client }).await;
            }
        });
        Ok(c)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn root(&self) -> Ino {
        self.root
    }

    pub fn addr(&self) -> &str {
        self.ch.addr()
    }

    /// One request, answered; the service's refusals come back as errors.
    pub fn call(&self, req: Request) -> std::result::Result<Response, WireError> {
        match self.rt.block_on(self.ch.call(Some(self.token), req)) {
            Ok(Response::Error(e)) => Err(e),
            Ok(r) => Ok(r),
            Err(s) => Err(unreachable(self.ch.addr(), &s)),
        }
    }

    /// Sends `req` and goes on: the answer is not waited for (errors are logged).
    fn send_later(&self, req: Request) {
        let (ch, token) = (self.ch.clone(), self.token);
        self.rt.spawn(async move {
            match ch.call(Some(token), req).await {
                Ok(Response::Error(e)) => tracing::debug!("mds client: {}", e.message),
                Err(s) => tracing::debug!("mds client: {}", s.message()),
                Ok(_) => {}
            }
        });
    }

    fn fs_call(&self, req: Request) -> Result<Response> {
        self.call(req).map_err(FsError::from)
    }

    /// The directory at `path` in the namespace.
    pub fn resolve(&self, path: &[u8]) -> Result<Attr> {
        match self.fs_call(Request::Resolve {
            client: self.id,
            path: path.to_vec(),
        })? {
            Response::Attr(a) => Ok(a),
            r => Err(unexpected(&r)),
        }
    }

    pub fn policy(&self, ino: Ino) -> std::result::Result<PolicyInfo, WireError> {
        match self.call(Request::PolicyGet {
            client: self.id,
            ino,
        })? {
            Response::Policy(p) => Ok(p),
            r => Err(WireError::from(&unexpected(&r))),
        }
    }

    pub fn set_policy(
        &self,
        ino: Ino,
        settings: &str,
    ) -> std::result::Result<PolicyInfo, WireError> {
        match self.call(Request::PolicySet {
            client: self.id,
            ino,
            settings: settings.to_string(),
        })? {
            Response::Policy(p) => Ok(p),
            r => Err(WireError::from(&unexpected(&r))),
        }
    }

    /// Everything the service holds made durable.
    pub fn sync(&self) -> Result<()> {
        self.fs_call(Request::Sync { client: self.id }).map(|_| ())
    }

    /// Holds the subtree at `ino` for this client's RPCs: with interfere=block, other
    /// clients get EBUSY inside it until [`Client::let_go`] (or until this client's
    /// lease lapses).
    pub fn hold(&self, ino: Ino) -> Result<()> {
        self.fs_call(Request::Hold {
            client: self.id,
            ino,
        })
        .map(|_| ())
    }

    /// Lets go of a hold taken with [`Client::hold`].
    pub fn let_go(&self, ino: Ino) -> Result<()> {
        self.fs_call(Request::Release {
            client: self.id,
            subtree: ino,
        })
        .map(|_| ())
    }

    /// Decouples the subtree at `ino`: this client holds it until [`Decoupled::release`]
    /// and works in its own journal.
    pub fn decouple(self: &Arc<Self>, ino: Ino, opts: DecoupleOptions) -> Result<Decoupled> {
        Decoupled::new(self.clone(), ino, opts)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The namespace through the service: every operation one request (RPCs).
pub struct RemoteFs {
    c: Arc<Client>,
    /// Where operations start (`mds://HOST:PORT/SUBTREE` mounts a subtree as root).
    root: Ino,
    /// Held for this client ([`RemoteFs::holding`]) until [`RemoteFs::let_go`].
    held: AtomicBool,
}

impl RemoteFs {
    pub fn new(c: Arc<Client>) -> RemoteFs {
        let root = c.root();
        RemoteFs::at(c, root)
    }

    /// The namespace from directory `root`.
    pub fn at(c: Arc<Client>, root: Ino) -> RemoteFs {
        RemoteFs {
            c,
            root,
            held: AtomicBool::new(false),
        }
    }

    /// The namespace from directory `root`, which this client holds ([`Client::hold`])
    /// until [`RemoteFs::let_go`].
    pub fn holding(c: Arc<Client>, root: Ino) -> Result<RemoteFs> {
        c.hold(root)?;
        let fs = RemoteFs::at(c, root);
        fs.held.store(true, Ordering::Relaxed);
        Ok(fs)
    }

    /// Lets go of the hold [`RemoteFs::holding`] took (once; later calls do nothing).
    pub fn let_go(&self) -> Result<()> {
        if self.held.swap(false, Ordering::Relaxed) {
            self.c.let_go(self.root)?;
        }
        Ok(())
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.c
    }

    fn op(&self, ctx: &Ctx, op: FsOp) -> Result<FsReply> {
        self.refusable(refusal_key(&op), || {
            self.c.fs_call(Request::Op {
                client: self.c.id,
                creds: Creds::from(ctx),
                op,
            })
        })
        .and_then(|r| match r {
            Response::Reply(r) => Ok(r),
            r => Err(unexpected(&r)),
        })
    }

    /// `call`, unless a hold refused this client the directory `key` a moment ago.
    fn refusable(
        &self,
        key: Option<Ino>,
        call: impl FnOnce() -> Result<Response>,
    ) -> Result<Response> {
        let Some(dir) = key else {
            return call();
        };
        if self.c.refusals.refused(dir) {
            return Err(FsError::from_errno(libc::EBUSY));
        }
        let r = call();
        self.c.refusals.answered(dir, &r);
        r
    }

    fn attr(&self, ctx: &Ctx, op: FsOp) -> Result<Attr> {
        match self.op(ctx, op)? {
            FsReply::Attr(a) => Ok(a),
            r => Err(FsError::Io(
                format!("expected attributes, got {r:?}").into(),
            )),
        }
    }

    fn bytes(&self, op: FsOp) -> Result<Vec<u8>> {
        match self.op(&Ctx::root(), op)? {
            FsReply::Bytes(b) => Ok(b),
            r => Err(FsError::Io(format!("expected bytes, got {r:?}").into())),
        }
    }

    fn done(&self, ctx: &Ctx, op: FsOp) -> Result<()> {
        self.op(ctx, op).map(|_| ())
    }
}

impl FileSystem for RemoteFs {
    fn root(&self) -> Ino {
        self.root
    }
    /// A handle at the service: the file outlives an unlink (by any client) until
    /// this client closes it.
    fn open(&self, ino: Ino) -> Result<()> {
        self.c
            .fs_call(Request::Open {
                client: self.c.id,
                ino,
            })
            .map(|_| ())
    }
    /// Sent without waiting for the answer: nothing the caller does next depends on
    /// it (a close that is lost ends with this client's lease).
    fn release(&self, ino: Ino) -> Result<()> {
        self.c.send_later(Request::Close {
            client: self.c.id,
            inos: vec![ino],
        });
        Ok(())
    }
    fn create_open(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        let op = FsOp::Mknod {
            parent,
            name: name.to_vec(),
            mode,
            rdev: 0,
            ino: None,
        };
        match self.refusable(Some(parent), || {
            self.c.fs_call(Request::CreateOpen {
                client: self.c.id,
                creds: Creds::from(ctx),
                op,
            })
        })? {
            Response::Reply(FsReply::Attr(a)) => Ok(a),
            r => Err(unexpected(&r)),
        }
    }
    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        self.attr(
            &Ctx::root(),
            FsOp::Lookup {
                parent,
                name: name.to_vec(),
            },
        )
    }
    fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.attr(&Ctx::root(), FsOp::Getattr { ino })
    }
    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr> {
        self.attr(ctx, FsOp::Setattr { ino, set })
    }
    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr> {
        self.attr(
            ctx,
            FsOp::Mknod {
                parent,
                name: name.to_vec(),
                mode,
                rdev,
                ino: None,
            },
        )
    }
    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.attr(
            ctx,
            FsOp::Mkdir {
                parent,
                name: name.to_vec(),
                mode,
                ino: None,
            },
        )
    }
    fn unlink(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.done(
            ctx,
            FsOp::Unlink {
                parent,
                name: name.to_vec(),
            },
        )
    }
    fn rmdir(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.done(
            ctx,
            FsOp::Rmdir {
                parent,
                name: name.to_vec(),
            },
        )
    }
    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.attr(
            ctx,
            FsOp::Symlink {
                parent,
                name: name.to_vec(),
                target: target.to_vec(),
                ino: None,
            },
        )
    }
    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        self.bytes(FsOp::Readlink { ino })
    }
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        self.done(
            ctx,
            FsOp::Rename {
                parent,
                name: name.to_vec(),
                new_parent,
                new_name: new_name.to_vec(),
                flags,
            },
        )
    }
    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.attr(
            ctx,
            FsOp::Link {
                ino,
                new_parent,
                new_name: new_name.to_vec(),
            },
        )
    }
    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        self.bytes(FsOp::Read { ino, offset, size })
    }
    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32> {
        match self.op(
            ctx,
            FsOp::Write {
                ino,
                offset,
                data: data.to_vec(),
            },
        )? {
            FsReply::Written(n) => Ok(n),
            r => Err(FsError::Io(format!("expected a count, got {r:?}").into())),
        }
    }
    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        let mut from = offset;
        loop {
            let es = match self.op(
                &Ctx::root(),
                FsOp::Readdir {
                    ino,
                    offset: from,
                    max: 512,
                },
            )? {
                FsReply::Entries(es) => es,
                r => return Err(FsError::Io(format!("expected entries, got {r:?}").into())),
            };
            let Some(last) = es.last().map(|e| e.next_offset) else {
                return Ok(());
            };
            for e in es {
                if !emit(e) {
                    return Ok(());
                }
            }
            from = last;
        }
    }
    fn statfs(&self) -> Result<StatFs> {
        match self.op(&Ctx::root(), FsOp::Statfs)? {
            FsReply::StatFs(s) => Ok(s),
            r => Err(FsError::Io(format!("expected statfs, got {r:?}").into())),
        }
    }
    fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> {
        self.done(&Ctx::root(), FsOp::Fsync { ino, datasync })
    }
    fn sync_all(&self) -> Result<()> {
        self.c.sync()
    }
    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        self.done(
            ctx,
            FsOp::Setxattr {
                ino,
                name: name.to_vec(),
                value: value.to_vec(),
                flags,
            },
        )
    }
    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        self.bytes(FsOp::Getxattr {
            ino,
            name: name.to_vec(),
        })
    }
    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        self.bytes(FsOp::Listxattr { ino })
    }
    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.done(
            ctx,
            FsOp::Removexattr {
                ino,
                name: name.to_vec(),
            },
        )
    }
    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32, ctx: &Ctx) -> Result<()> {
        self.done(
            ctx,
            FsOp::Fallocate {
                ino,
                offset,
                length,
                mode,
            },
        )
    }
}

/// The kernel's references need nothing of the service: a mount's FUSE adapter drives
/// the namespace as it drives a module.
/// The kernel's references without a handle take nothing at the service: once a file
/// is unlinked they no longer reach its data (handles do: `open`).
impl quilt_vfs::KernelFs for RemoteFs {
    fn reference(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
    fn unreference(&self, _ino: Ino) -> Result<()> {
        Ok(())
    }
}

/// How a client works in a decoupled subtree.
#[derive(Debug, Clone, Default)]
pub struct DecoupleOptions {
    /// Where Local Persist keeps the journal (a file per client and subtree); needed
    /// when the subtree's durability is local.
    pub local_dir: Option<PathBuf>,
    /// Overrides the policy's namespace-sync interval (`Some(ZERO)`: never by time).
    pub sync_interval: Option<Duration>,
}

/// What a sync did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Synced {
    /// Events sent (merged, persisted, or both).
    pub events: u64,
    /// Bytes of journal sent or written.
    pub bytes: u64,
    /// The last event merged into the global namespace.
    pub merged_seq: u64,
}

struct Shared {
    journal: ClientJournal,
    /// Sealed frames not yet merged (weak) or persisted, in order.
    unsent: Vec<Frame>,
    grants: Vec<InoGrant>,
    /// The next granted number to use (they go up).
    next_ino: Ino,
    local: Option<LocalFile>,
    /// Names this client made, to refuse its own duplicates at once.
    names: HashSet<(Ino, Vec<u8>)>,
    synced: Synced,
}

/// A subtree this client holds decoupled: operations append to its journal (Append
/// Client Journal) and nothing is asked of anyone; syncs persist and merge it as the
/// subtree's policy says. A background thread syncs at the policy's interval without
/// stopping appends (the frame is sealed, swapped, and shipped outside the lock).
pub struct Decoupled {
    c: Arc<Client>,
    subtree: Ino,
    policy: Policy,
    shared: Arc<Mutex<Shared>>,
    /// One sync at a time (frames go out in order).
    syncing: Arc<Mutex<()>>,
    stop: Arc<AtomicBool>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

impl Decoupled {
    fn new(c: Arc<Client>, subtree: Ino, opts: DecoupleOptions) -> Result<Decoupled> {
        let (policy, grants, merged_seq, max_ino) = match c.fs_call(Request::Decouple {
            client: c.id,
            ino: subtree,
        })? {
            Response::Decoupled {
                policy,
                grants,
                merged_seq,
                max_ino,
            } => (policy, grants, merged_seq, max_ino),
            r => return Err(unexpected(&r)),
        };
        let header = Header {
            client: c.id,
            subtree,
        };
        let local = match (policy.durability, &opts.local_dir) {
            (Durability::Local, Some(dir)) => {
                // Who this client is, kept before anything it journals: a client that
                // dies comes back as itself to merge the journal (`recover.rs`).
                crate::recover::keep_identity(dir, c.id, c.token)
                    .map_err(|e| FsError::Io(e.into()))?;
                let path = crate::recover::journal_path(dir, c.id, subtree);
                Some(
                    LocalFile::open(&path, header)
                        .map_err(|e| FsError::Io(e.to_string().into()))?,
                )
            }
            (Durability::Local, None) => {
                return Err(FsError::Invalid(
                    "the subtree's durability is local: give a directory for its journal",
                ))
            }
            _ => None,
        };
        let next_ino = first_unused(&grants, max_ino);
        let shared = Arc::new(Mutex::new(Shared {
            journal: ClientJournal::new(header, merged_seq + 1),
            unsent: Vec::new(),
            grants,
            next_ino,
            local,
            names: HashSet::new(),
            synced: Synced {
                merged_seq,
                ..Synced::default()
            },
        }));
        let mut d = Decoupled {
            c,
            subtree,
            policy,
            shared,
            syncing: Arc::new(Mutex::new(())),
            stop: Arc::new(AtomicBool::new(false)),
            ticker: None,
        };
        let every = opts
            .sync_interval
            .unwrap_or(Duration::from_millis(policy.sync_interval_ms));
        if policy.consistency == Consistency::Weak && !every.is_zero() {
            d.start_ticker(every);
        }
        Ok(d)
    }

    fn start_ticker(&mut self, every: Duration) {
        let (c, shared, syncing, stop) = (
            self.c.clone(),
            self.shared.clone(),
            self.syncing.clone(),
            self.stop.clone(),
        );
        let (subtree, policy) = (self.subtree, self.policy);
        self.ticker = Some(std::thread::spawn(move || {
            let mut next = Instant::now() + every;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20).min(every));
                if Instant::now() < next {
                    continue;
                }
                next = Instant::now() + every;
                if let Err(e) = sync_now(&c, subtree, policy, &shared, &syncing) {
                    tracing::warn!("cudele: namespace sync of subtree {subtree}: {e}");
                }
            }
        }));
    }

    pub fn subtree(&self) -> Ino {
        self.subtree
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next granted number, asking for more when the grants are used up.
    fn take_ino(&self, sh: &mut Shared) -> Result<Ino> {
        loop {
            if sh.grants.iter().any(|g| g.contains(sh.next_ino)) {
                let i = sh.next_ino;
                sh.next_ino += 1;
                return Ok(i);
            }
            if let Some(g) = sh
                .grants
                .iter()
                .filter(|g| g.first > sh.next_ino)
                .min_by_key(|g| g.first)
            {
                sh.next_ino = g.first;
                continue;
            }
            let more = match self.c.fs_call(Request::MoreInodes {
                client: self.c.id,
                subtree: self.subtree,
            })? {
                Response::Granted(g) => g,
                r => return Err(unexpected(&r)),
            };
            if more.is_empty() {
                return Err(FsError::NoSpace);
            }
            sh.grants.extend(more);
        }
    }

    fn append(&self, ctx: &Ctx, op: FsOp) -> u64 {
        let mut sh = self.lock();
        sh.journal.append(&Event {
            uid: ctx.uid,
            gid: ctx.gid,
            op,
        })
    }

    fn create_op(
        &self,
        ctx: &Ctx,
        parent: Ino,
        name: &[u8],
        make: impl FnOnce(Ino) -> FsOp,
    ) -> Result<Ino> {
        if name.is_empty() || name.len() > 255 || name.contains(&b'/') || name.contains(&0) {
            return Err(if name.len() > 255 {
                FsError::NameTooLong
            } else {
                FsError::Invalid("a name that is empty or holds '/' or NUL")
            });
        }
        let mut sh = self.lock();
        if !sh.names.insert((parent, name.to_vec())) {
            return Err(FsError::Exists);
        }
        let ino = match self.take_ino(&mut sh) {
            Ok(i) => i,
            Err(e) => {
                sh.names.remove(&(parent, name.to_vec()));
                return Err(e);
            }
        };
        sh.journal.append(&Event {
            uid: ctx.uid,
            gid: ctx.gid,
            op: make(ino),
        });
        Ok(ino)
    }

    /// A regular file (or fifo, socket, device) named `name` in `parent`.
    pub fn create(&self, ctx: &Ctx, parent: Ino, name: &[u8], mode: u32) -> Result<Ino> {
        self.mknod(ctx, parent, name, mode, 0)
    }

    /// [`Decoupled::create`] with a device number.
    pub fn mknod(&self, ctx: &Ctx, parent: Ino, name: &[u8], mode: u32, rdev: u32) -> Result<Ino> {
        let mode = if mode & libc::S_IFMT == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        self.create_op(ctx, parent, name, |ino| FsOp::Mknod {
            parent,
            name: name.to_vec(),
            mode: mode & !ctx.umask,
            rdev,
            ino: Some(ino),
        })
    }

    /// File data of a file this client created in the subtree: it rides in the journal
    /// (the file has no place at the service before the merge that makes it).
    pub fn write(&self, ctx: &Ctx, ino: Ino, offset: u64, data: &[u8]) -> Result<u64> {
        if data.len() > crate::merge::MAX_WRITE {
            return Err(FsError::Invalid("a journaled write larger than 1 MiB"));
        }
        Ok(self.append(
            ctx,
            FsOp::Write {
                ino,
                offset,
                data: data.to_vec(),
            },
        ))
    }

    /// A size change (with any other attributes in `set`) of a file this client created.
    pub fn truncate(&self, ctx: &Ctx, ino: Ino, set: SetAttr) -> Result<u64> {
        Ok(self.append(ctx, FsOp::Setattr { ino, set }))
    }

    pub fn mkdir(&self, ctx: &Ctx, parent: Ino, name: &[u8], mode: u32) -> Result<Ino> {
        self.create_op(ctx, parent, name, |ino| FsOp::Mkdir {
            parent,
            name: name.to_vec(),
            mode: mode & 0o7777 & !ctx.umask,
            ino: Some(ino),
        })
    }

    pub fn symlink(&self, ctx: &Ctx, parent: Ino, name: &[u8], target: &[u8]) -> Result<Ino> {
        self.create_op(ctx, parent, name, |ino| FsOp::Symlink {
            parent,
            name: name.to_vec(),
            target: target.to_vec(),
            ino: Some(ino),
        })
    }

    /// Any other change (unlink, rmdir, rename, link, setattr without a size, xattrs),
    /// appended as it is: the merge validates it.
    pub fn change(&self, ctx: &Ctx, op: FsOp) -> Result<u64> {
        if !op.changes() || !op.batchable() {
            return Err(FsError::Invalid(
                "a decoupled journal takes name and attribute changes only",
            ));
        }
        match &op {
            FsOp::Unlink { parent, name } | FsOp::Rmdir { parent, name } => {
                self.lock().names.remove(&(*parent, name.clone()));
            }
            FsOp::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } if !flags.exchange => {
                let mut sh = self.lock();
                sh.names.remove(&(*parent, name.clone()));
                sh.names.insert((*new_parent, new_name.clone()));
            }
            _ => {}
        }
        Ok(self.append(ctx, op))
    }

    /// A witness that `name` in `parent` names an inode the client is about to change
    /// by number (an attribute, a link): the merge reaches older files by name only.
    pub fn witness(&self, ctx: &Ctx, parent: Ino, name: &[u8]) -> u64 {
        self.append(
            ctx,
            FsOp::Lookup {
                parent,
                name: name.to_vec(),
            },
        )
    }

    /// Events appended so far (the next event's number minus one).
    pub fn appended(&self) -> u64 {
        self.lock().journal.next_seq() - 1
    }

    /// Bytes of events appended.
    pub fn journal_bytes(&self) -> u64 {
        self.lock().journal.event_bytes()
    }

    /// Persists and merges what was appended, as the policy says: Local Persist (the
    /// journal file, synced), Global Persist (to the service's storage), and for a
    /// weak subtree a merge (Volatile Apply; Nonvolatile under global durability).
    pub fn sync(&self) -> Result<Synced> {
        sync_now(
            &self.c,
            self.subtree,
            self.policy,
            &self.shared,
            &self.syncing,
        )
    }

    /// Merges what was appended (whatever the consistency: the application decided
    /// to), durably or not.
    pub fn merge(&self, durable: bool) -> Result<Synced> {
        let _one = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
        seal(&self.shared);
        ship(&self.c, self.subtree, &self.shared, true, durable, false)
    }

    /// Lets go of the subtree: a last sync as the policy says, then the hold goes.
    pub fn release(mut self) -> Result<Synced> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
        let s = self.sync()?;
        self.c.fs_call(Request::Release {
            client: self.c.id,
            subtree: self.subtree,
        })?;
        Ok(s)
    }
}

impl Drop for Decoupled {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

/// The first number of `grants` above `max`.
fn first_unused(grants: &[InoGrant], max: Ino) -> Ino {
    grants
        .iter()
        .filter(|g| g.first + g.count > max + 1)
        .map(|g| g.first.max(max + 1))
        .min()
        .unwrap_or(max + 1)
}

/// Seals the open frame into the unsent list (and the local file, when there is one).
fn seal(shared: &Mutex<Shared>) -> Option<FsError> {
    let mut sh = shared.lock().unwrap_or_else(|p| p.into_inner());
    let f = sh.journal.seal()?;
    let r = match &mut sh.local {
        Some(l) => l.append(&f).err(),
        None => None,
    };
    sh.unsent.push(f);
    r.map(|e| FsError::Io(format!("Local Persist: {e}").into()))
}

fn sync_now(
    c: &Client,
    subtree: Ino,
    policy: Policy,
    shared: &Mutex<Shared>,
    syncing: &Mutex<()>,
) -> Result<Synced> {
    let _one = syncing.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = seal(shared) {
        return Err(e);
    }
    let merge = policy.consistency == Consistency::Weak;
    let persist = policy.durability == Durability::Global;
    ship(c, subtree, shared, merge, persist, persist)
}

/// Sends the unsent frames: persisted globally (`persist`), merged (`merge`, durably
/// with `durable`). The lock is held only to take the frames and to drop them once
/// sent: appends go on meanwhile.
fn ship(
    c: &Client,
    subtree: Ino,
    shared: &Mutex<Shared>,
    merge: bool,
    durable: bool,
    persist: bool,
) -> Result<Synced> {
    let (header, frames) = {
        let sh = shared.lock().unwrap_or_else(|p| p.into_inner());
        (sh.journal.header(), sh.unsent.clone())
    };
    let mut done = shared.lock().unwrap_or_else(|p| p.into_inner()).synced;
    if frames.is_empty() {
        return Ok(done);
    }
    let events: u64 = frames.iter().map(|f| u64::from(f.count)).sum();
    let bytes = journal::encode(&header, &frames);
    // A refusal is an I/O error to whoever synced (fsync's EIO: the changes did not
    // get where the policy sends them), with the service's reason kept; the frames stay
    // unsent.
    let refused = |what: &str, e: WireError| {
        let m = format!("{what} of subtree {subtree}: {}", e.message);
        tracing::error!("cudele: {m}");
        FsError::Io(m.into())
    };
    if persist {
        c.call(Request::Persist {
            client: c.id,
            subtree,
            journal: bytes.clone(),
        })
        .map_err(|e| refused("Global Persist", e))?;
    }
    if merge {
        match c
            .call(Request::Merge {
                client: c.id,
                subtree,
                journal: bytes.clone(),
                durable,
            })
            .map_err(|e| refused("the merge", e))?
        {
            Response::Merged { merged_seq, .. } => done.merged_seq = merged_seq,
            r => return Err(unexpected(&r)),
        }
    }
    done.events += events;
    done.bytes += bytes.len() as u64;
    let mut sh = shared.lock().unwrap_or_else(|p| p.into_inner());
    let n = frames.len().min(sh.unsent.len());
    sh.unsent.drain(..n);
    sh.synced = done;
    Ok(done)
}
