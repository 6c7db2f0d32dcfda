//! The namespace service (Cudele) as the tests run it: an in-process service on a
//! loopback port over a mounted module, and clients of it; [`Alternating`] drives the
//! namespace through two clients, each call going to the other one in turn.

#![allow(dead_code)] // each test file uses its share

use quilt_cudele::client::{Client, RemoteFs};
use quilt_cudele::service::{Mds, MdsConfig};
use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, Ino, RenameFlags, Result, SetAttr, StatFs, XattrFlags,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const SECRET: &str = "test-secret";

/// The service on a loopback port, in its own runtime.
pub struct Service {
    rt: tokio::runtime::Runtime,
    pub addr: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<std::result::Result<(), String>>>,
}

impl Service {
    /// Serves `fs` on `at` (a free port when None).
    pub fn start(
        fs: Arc<dyn FileSystem>,
        at: Option<&str>,
        lease: Duration,
    ) -> std::result::Result<Service, String> {
        let mds = Arc::new(
            Mds::open(
                fs,
                MdsConfig {
                    lease,
                    merge_chunk: 64,
                },
            )
            .map_err(|e| e.to_string())?,
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(at.unwrap_or("127.0.0.1:0")))
            .map_err(|e| e.to_string())?;
        let addr = listener
            .local_addr()
            .map_err(|e| e.to_string())?
            .to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let done = rt.spawn(quilt_cudele::transport::serve(
            mds,
            listener,
            SECRET,
            None,
            async {
                let _ = rx.await;
            },
        ));
        Ok(Service {
            rt,
            addr,
            stop: Some(tx),
            done: Some(done),
        })
    }

    pub fn connect(&self, name: &str) -> Arc<Client> {
        Client::connect(&self.addr, SECRET, None, name).expect("a client connects")
    }

    /// Stops serving and waits until the service let go of the store.
    pub fn stop(mut self) -> std::result::Result<(), String> {
        self.halt()
    }

    fn halt(&mut self) -> std::result::Result<(), String> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.done.take() {
            Some(d) => self
                .rt
                .block_on(d)
                .map_err(|e| e.to_string())
                .and_then(|r| r),
            None => Ok(()),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// The namespace through two clients: each call goes to the other one in turn.
pub struct Alternating {
    c: [RemoteFs; 2],
    next: AtomicUsize,
}

impl Alternating {
    pub fn new(a: Arc<Client>, b: Arc<Client>) -> Alternating {
        Alternating {
            c: [RemoteFs::new(a), RemoteFs::new(b)],
            next: AtomicUsize::new(0),
        }
    }

    fn one(&self) -> &RemoteFs {
        &self.c[self.next.fetch_add(1, Ordering::Relaxed) % 2]
    }
}

impl FileSystem for Alternating {
    fn root(&self) -> Ino {
        self.c[0].root()
    }
    fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        self.one().lookup(parent, name)
    }
    fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.one().getattr(ino)
    }
    fn setattr(&self, ino: Ino, set: SetAttr, ctx: &Ctx) -> Result<Attr> {
        self.one().setattr(ino, set, ctx)
    }
    fn mknod(&self, parent: Ino, name: &[u8], mode: u32, rdev: u32, ctx: &Ctx) -> Result<Attr> {
        self.one().mknod(parent, name, mode, rdev, ctx)
    }
    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, ctx: &Ctx) -> Result<Attr> {
        self.one().mkdir(parent, name, mode, ctx)
    }
    fn unlink(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.one().unlink(parent, name, ctx)
    }
    fn rmdir(&self, parent: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.one().rmdir(parent, name, ctx)
    }
    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.one().symlink(parent, name, target, ctx)
    }
    fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        self.one().readlink(ino)
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
        self.one()
            .rename(parent, name, new_parent, new_name, flags, ctx)
    }
    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8], ctx: &Ctx) -> Result<Attr> {
        self.one().link(ino, new_parent, new_name, ctx)
    }
    fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<Vec<u8>> {
        self.one().read(ino, offset, size)
    }
    fn write(&self, ino: Ino, offset: u64, data: &[u8], ctx: &Ctx) -> Result<u32> {
        self.one().write(ino, offset, data, ctx)
    }
    fn readdir(&self, ino: Ino, offset: u64, emit: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        self.one().readdir(ino, offset, emit)
    }
    fn statfs(&self) -> Result<StatFs> {
        self.one().statfs()
    }
    fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> {
        self.one().fsync(ino, datasync)
    }
    fn sync_all(&self) -> Result<()> {
        self.one().sync_all()
    }
    fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        ctx: &Ctx,
    ) -> Result<()> {
        self.one().setxattr(ino, name, value, flags, ctx)
    }
    fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        self.one().getxattr(ino, name)
    }
    fn listxattr(&self, ino: Ino) -> Result<Vec<u8>> {
        self.one().listxattr(ino)
    }
    fn removexattr(&self, ino: Ino, name: &[u8], ctx: &Ctx) -> Result<()> {
        self.one().removexattr(ino, name, ctx)
    }
    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32, ctx: &Ctx) -> Result<()> {
        self.one().fallocate(ino, offset, length, mode, ctx)
    }
}
