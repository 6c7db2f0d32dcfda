//! A session: the INIT handshake, then worker threads that read requests, hand them to
//! the [`Handler`] and send its replies, until the connection closes.

use crate::abi::{self, init, opcode, Writer};
use crate::channel::{Channel, Received};
use crate::notify::Notifier;
use crate::reply::Reply;
use crate::request::{Op, Proto, Request};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the kernel offered at INIT.
#[derive(Debug, Clone, Copy)]
pub struct KernelInit {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// Capabilities the kernel supports ([`abi::init`]).
    pub flags: u64,
}

/// What we ask for at INIT.
#[derive(Debug, Clone, Copy)]
pub struct InitReply {
    /// Capabilities wanted; those the kernel lacks are dropped.
    pub flags: u64,
    pub max_write: u32,
    pub max_readahead: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    /// Timestamp granularity in nanoseconds.
    pub time_gran: u32,
}

impl Default for InitReply {
    fn default() -> Self {
        InitReply {
            flags: 0,
            max_write: 1 << 20,
            max_readahead: 1 << 20,
            max_background: 64,
            congestion_threshold: 48,
            time_gran: 1,
        }
    }
}

/// A file system served over FUSE.
pub trait Handler: Send + Sync + 'static {
    /// Chooses the capabilities and sizes to ask for.
    fn init(&self, kernel: &KernelInit) -> InitReply;
    /// Serves one request; `reply` answers it (dropped unanswered, it says EIO).
    /// FORGET and BATCH_FORGET come with a reply that sends nothing.
    fn request(&self, req: &Request<'_>, reply: Reply<'_>);
    /// The session ends: DESTROY (block-device mounts, before umount(2) returns) or the
    /// connection closed. Called once.
    fn destroy(&self);
}

/// A mounted connection waiting to be served.
pub struct Session {
    master: Arc<Channel>,
    threads: usize,
    ring: Option<RingOptions>,
    ring_stats: Arc<crate::handoff::RingStats>,
}

/// FUSE over io_uring (see `ring`): asked for at INIT when set; used when the kernel
/// offers it and every queue's entries register, /dev/fuse otherwise.
#[derive(Debug, Clone, Copy)]
pub struct RingOptions {
    /// Workers per CPU queue, each pinned to the queue's CPU with one entry (a worker
    /// busy with a slow request, an fsync, leaves the others of its CPU to serve).
    pub threads_per_queue: usize,
    /// When workers submit their answers under `SCHED_IDLE`, so that an answer wakes
    /// its caller on the worker's CPU instead of an idle one (see `handoff.rs`). Auto
    /// by default: while callers ping-pong between CPUs.
    pub handoff: crate::HandoffMode,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            threads_per_queue: 2,
            handoff: crate::HandoffMode::Auto,
        }
    }
}

/// Which transport a session ended up serving on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Device,
    Ring,
}

impl Session {
    pub fn new(chan: Channel, threads: usize) -> Session {
        Session {
            master: Arc::new(chan),
            threads: threads.max(1),
            ring: None,
            ring_stats: Arc::default(),
        }
    }

    /// How the ring workers waited (shared; read it while the session runs).
    pub fn ring_stats(&self) -> Arc<crate::handoff::RingStats> {
        self.ring_stats.clone()
    }

    /// Serve over io_uring where the kernel offers it.
    pub fn with_ring(mut self, ring: Option<RingOptions>) -> Session {
        self.ring = ring;
        self
    }

    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.master.clone())
    }

    /// Serves until the file system is unmounted.
    pub fn run<H: Handler>(self, handler: Arc<H>) -> io::Result<()> {
        self.run_reporting(handler, &|_| {})
    }

    /// [`Session::run`], telling `on_transport` which transport serves once known.
    pub fn run_reporting<H: Handler>(
        self,
        handler: Arc<H>,
        on_transport: &dyn Fn(Transport),
    ) -> io::Result<()> {
        let settled = self.handshake(&*handler)?;
        let Some((max_write, proto, flags)) = settled else {
            finish(&*handler, &AtomicBool::new(false));
            return Ok(());
        };
        let bufsize = (max_write as usize + 4096).max(abi::MIN_READ_BUFFER);
        let destroyed = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        let mut legacy = self.threads;
        let mut drainer = None;
        if let (Some(opts), true) = (self.ring, flags & init::OVER_IO_URING != 0) {
            let payload = (max_write.div_ceil(4096) as usize * 4096).max(abi::MIN_READ_BUFFER);
            let started = crate::ring::Drainer::new(&self.master, bufsize)
                .map(Arc::new)
                .map_err(|e| (e, Vec::new()))
                .and_then(|d| {
                    self.start_ring(opts, payload, proto, &handler, &destroyed, &d)
                        .map(|ws| (d, ws))
                });
            match started {
                Ok((d, ws)) => {
                    workers.extend(ws);
                    drainer = Some(d);
                    legacy = 0;
                    on_transport(Transport::Ring);
                }
                Err((e, ws)) => {
                    tracing::warn!("FUSE over io_uring: {e}; serving on /dev/fuse");
                    workers.extend(ws);
                    on_transport(Transport::Device);
                }
            }
        } else {
            on_transport(Transport::Device);
        }
        for i in 1..legacy {
            let chan = match self.master.clone_channel() {
                Ok(c) => Arc::new(c),
                Err(e) => {
                    tracing::warn!(
                        "cloning the FUSE channel for worker {i}: {e}; serving with {i}"
                    );
                    break;
                }
            };
            let (h, d) = (handler.clone(), destroyed.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("fuse-{i}"))
                    .spawn(move || serve_loop(&chan, &*h, &d, bufsize, proto))?,
            );
        }
        let r = match &drainer {
            // INIT done, the ring serves; /dev/fuse carries FORGET, INTERRUPT and what
            // came before the ring was ready, read only through the drainer.
            Some(d) => d.serve(proto, &|req, reply| {
                dispatch(&*handler, &destroyed, req, reply)
            }),
            None => serve_loop(&self.master, &*handler, &destroyed, bufsize, proto),
        };
        for w in workers {
            if let Ok(Err(e)) = w.join() {
                tracing::error!("FUSE worker: {e}");
            }
        }
        finish(&*handler, &destroyed);
        r
    }

    /// Starts the ring workers, one set per CPU queue, each registered before this
    /// returns. On failure, the workers already started are returned too: their
    /// entries stay registered (the kernel, seeing the failure, stays on /dev/fuse) and
    /// they end with the connection.
    #[allow(clippy::type_complexity)]
    fn start_ring<H: Handler>(
        &self,
        opts: RingOptions,
        payload: usize,
        proto: Proto,
        handler: &Arc<H>,
        destroyed: &Arc<AtomicBool>,
        drainer: &Arc<crate::ring::Drainer>,
    ) -> Result<
        Vec<std::thread::JoinHandle<io::Result<()>>>,
        (io::Error, Vec<std::thread::JoinHandle<io::Result<()>>>),
    > {
        let queues = crate::ring::possible_cpus();
        let handoff = Arc::new(crate::handoff::Handoff::new(
            opts.handoff,
            self.ring_stats.clone(),
        ));
        let mut started = Vec::new();
        let (tx, rx) = std::sync::mpsc::channel::<io::Result<()>>();
        for q in 0..queues {
            for t in 0..opts.threads_per_queue.max(1) {
                let (h, d, tx) = (handler.clone(), destroyed.clone(), tx.clone());
                let master = self.master.clone();
                let dev = drainer.clone();
                let handoff = handoff.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("fuse-ring-{q}.{t}"))
                    .spawn(move || {
                        let w = match crate::ring::Worker::register(
                            &master, dev, handoff, q as u16, 1, payload,
                        ) {
                            Ok(w) => {
                                let _ = tx.send(Ok(()));
                                w
                            }
                            Err(e) => {
                                let _ = tx.send(Err(io::Error::new(
                                    e.kind(),
                                    format!("registering queue {q}: {e}"),
                                )));
                                return Ok(());
                            }
                        };
                        w.run(proto, &|req, reply| dispatch(&*h, &d, req, reply))
                    });
                match spawned {
                    Ok(j) => started.push(j),
                    Err(e) => return Err((e, started)),
                }
            }
        }
        drop(tx);
        for _ in 0..started.len() {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err((e, started)),
                Err(_) => break,
            }
        }
        Ok(started)
    }

    /// Reads INIT and answers it: the largest write, the request layout and the
    /// capabilities settled. None when the connection closed first.
    fn handshake(&self, handler: &dyn Handler) -> io::Result<Option<(u32, Proto, u64)>> {
        let mut buf = vec![0u8; abi::MIN_READ_BUFFER * 2];
        loop {
            let n = match self.master.receive(&mut buf)? {
                Received::Request(n) => n,
                Received::Closed => return Ok(None),
            };
            let req = match Request::parse(&buf[..n]) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("{e}");
                    continue;
                }
            };
            let reply = Reply::new(&self.master, req.header.unique);
            let Op::Init {
                major,
                minor,
                max_readahead,
                flags,
            } = req.op
            else {
                reply.error(libc::EIO);
                continue;
            };
            if major != abi::KERNEL_VERSION {
                tracing::error!("the kernel speaks FUSE {major}.{minor}; we need 7.x");
                reply.error(libc::EPROTO);
                return Ok(None);
            }
            let kernel = KernelInit {
                major,
                minor,
                max_readahead,
                flags,
            };
            let want = handler.init(&kernel);
            let mut asked = want.flags;
            if self.ring.is_some() {
                asked |= init::OVER_IO_URING;
            }
            let mut flags = asked & flags;
            let max_write = want.max_write.max(4096);
            if max_write > 4096 {
                flags |= init::BIG_WRITES | (init::MAX_PAGES & kernel.flags);
            }
            if flags >> 32 != 0 {
                flags |= init::INIT_EXT;
            }
            let mut w = Writer::with_capacity(64);
            w.u32(abi::KERNEL_VERSION)
                .u32(minor.min(abi::KERNEL_MINOR))
                .u32(want.max_readahead.min(max_readahead))
                .u32(flags as u32)
                .u16(want.max_background)
                .u16(want.congestion_threshold)
                .u32(max_write)
                .u32(want.time_gran)
                .u16(max_write.div_ceil(4096).min(u16::MAX as u32) as u16)
                .u16(0)
                .u32((flags >> 32) as u32)
                .zeros(28);
            reply.raw(&w.buf);
            let proto = Proto {
                setxattr_ext: flags & init::SETXATTR_EXT != 0,
            };
            return Ok(Some((max_write, proto, flags)));
        }
    }
}

fn finish(handler: &dyn Handler, destroyed: &AtomicBool) {
    if !destroyed.swap(true, Ordering::SeqCst) {
        handler.destroy();
    }
}

fn serve_loop(
    chan: &Channel,
    handler: &dyn Handler,
    destroyed: &AtomicBool,
    bufsize: usize,
    proto: Proto,
) -> io::Result<()> {
    let mut buf = vec![0u8; bufsize];
    loop {
        let n = match chan.receive(&mut buf)? {
            Received::Request(n) => n,
            Received::Closed => return Ok(()),
        };
        let req = match Request::parse_with(&buf[..n], proto) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("{e}");
                if n >= 16 {
                    let mut u = [0u8; 8];
                    u.copy_from_slice(&buf[8..16]);
                    Reply::new(chan, u64::from_le_bytes(u)).error(libc::EIO);
                }
                continue;
            }
        };
        dispatch(
            handler,
            destroyed,
            &req,
            Reply::new(chan, req.header.unique),
        );
    }
}

/// Hands one request to the handler, or answers it here (INIT again, DESTROY,
/// INTERRUPT, opcodes we do not serve).
fn dispatch(handler: &dyn Handler, destroyed: &AtomicBool, req: &Request<'_>, reply: Reply<'_>) {
    match &req.op {
        Op::Forget { .. } | Op::BatchForget(_) => handler.request(req, reply.noreply()),
        // We answer every request promptly; the interrupted one gets its reply.
        Op::Interrupt { .. } => reply.none(),
        Op::Init { .. } => reply.error(libc::EIO),
        Op::Destroy => {
            finish(handler, destroyed);
            reply.ok();
        }
        Op::Unsupported(opc) => {
            tracing::debug!("FUSE opcode {opc} not served");
            reply.error(libc::ENOSYS);
        }
        _ if req.header.opcode == opcode::INIT => reply.error(libc::EIO),
        _ => handler.request(req, reply),
    }
}
