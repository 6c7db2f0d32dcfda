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
}

impl Session {
    pub fn new(chan: Channel, threads: usize) -> Session {
        Session {
            master: Arc::new(chan),
            threads: threads.max(1),
        }
    }

    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.master.clone())
    }

    /// Serves until the file system is unmounted.
    pub fn run<H: Handler>(self, handler: Arc<H>) -> io::Result<()> {
        let settled = self.handshake(&*handler)?;
        let Some((max_write, proto)) = settled else {
            finish(&*handler, &AtomicBool::new(false));
            return Ok(());
        };
        let bufsize = (max_write as usize + 4096).max(abi::MIN_READ_BUFFER);
        let destroyed = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for i in 1..self.threads {
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
        let r = serve_loop(&self.master, &*handler, &destroyed, bufsize, proto);
        for w in workers {
            if let Ok(Err(e)) = w.join() {
                tracing::error!("FUSE worker: {e}");
            }
        }
        finish(&*handler, &destroyed);
        r
    }

    /// Reads INIT and answers it: the largest write and the request layout settled.
    /// None when the connection closed first.
    fn handshake(&self, handler: &dyn Handler) -> io::Result<Option<(u32, Proto)>> {
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
            let mut flags = want.flags & flags;
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
            return Ok(Some((max_write, proto)));
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
        let reply = Reply::new(chan, req.header.unique);
        match &req.op {
            Op::Forget { .. } | Op::BatchForget(_) => handler.request(&req, reply.noreply()),
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
            _ => handler.request(&req, reply),
        }
    }
}
