//! Requests run in parallel (issue 18): no lock of the module or the engine is held
//! across device I/O. A device that stalls every I/O made by one thread (named
//! "stalled") until the test lets it go shows it: while that thread waits for the
//! device inside a request, other threads' requests must complete.

use quilt_block::{
    BlockDevice, BlockDeviceExt, BlockNo, IoStats, MemDevice, Result as BlockResult,
};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, Ino};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Stalls the reads (and, when `writes`, the writes) of the thread named "stalled".
struct StallDevice {
    inner: MemDevice,
    stall_writes: AtomicBool,
    released: Mutex<bool>,
    cv: Condvar,
    /// I/Os currently stalled.
    waiting: AtomicUsize,
}

impl StallDevice {
    fn stall(&self, write: bool) {
        if std::thread::current().name() != Some("stalled")
            || (write && !self.stall_writes.load(SeqCst))
        {
            return;
        }
        self.waiting.fetch_add(1, SeqCst);
        let mut r = self.released.lock().unwrap();
        while !*r {
            r = self.cv.wait(r).unwrap();
        }
        self.waiting.fetch_sub(1, SeqCst);
    }
    fn release(&self) {
        *self.released.lock().unwrap() = true;
        self.cv.notify_all();
    }
    /// Waits until the stalled thread is inside the device.
    fn wait_stalled(&self) {
        for _ in 0..2000 {
            if self.waiting.load(SeqCst) > 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the stalled thread never reached the device");
    }
}

impl BlockDevice for StallDevice {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> BlockResult<()> {
        self.stall(false);
        self.inner.read(block, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: quilt_block::WriteClass) -> BlockResult<()> {
        self.stall(true);
        self.inner.write(block, buf, class)
    }
    fn flush(&self) -> BlockResult<()> {
        self.inner.flush()
    }
    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        quilt_block::read_each(self, first, buf)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        quilt_block::write_each(self, first, buf, class)
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        quilt_block::Capabilities {
            reservation: Some(self),
            ..Default::default()
        }
    }
}

impl quilt_block::Reservation for StallDevice {
    fn reserve(&self, first: BlockNo, count: u64) -> BlockResult<()> {
        self.inner.reserve(first, count)
    }
    fn host_room(&self) -> Option<quilt_block::HostRoom> {
        self.inner.host_room()
    }
}

fn root() -> Ctx {
    Ctx {
        uid: 0,
        gid: 0,
        ..Default::default()
    }
}

/// An image with directories `a` (a file `f` of 64 KiB, a file `g`) and `b`, and the
/// stalling device under a freshly opened file system: nothing of it cached.
fn image(engine_opts: EngineOptions) -> (Arc<StallDevice>, Arc<Ext2>) {
    let mem = MemDevice::new(4096, 8192).unwrap();
    let dev = Arc::new(StallDevice {
        inner: mem,
        stall_writes: AtomicBool::new(false),
        released: Mutex::new(false),
        cv: Condvar::new(),
        waiting: AtomicUsize::new(0),
    });
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    let zeroed = MkfsOptions {
        device_is_zeroed: true,
        ..Default::default()
    };
    mkfs(&engine, &zeroed).unwrap();
    let fs = Ext2::open(engine, MountOptions::default()).unwrap();
    let r = fs.root();
    let a = fs.mkdir(r, b"a", 0o755, &root()).unwrap();
    fs.mkdir(r, b"b", 0o755, &root()).unwrap();
    let f = fs
        .mknod(a.ino, b"f", libc::S_IFREG | 0o644, 0, &root())
        .unwrap();
    fs.write(f.ino, 0, &pattern(65536), &root()).unwrap();
    fs.mknod(a.ino, b"g", libc::S_IFREG | 0o644, 0, &root())
        .unwrap();
    fs.unmount().unwrap();
    drop(fs);
    let fs = Ext2::open(
        Engine::new(dev.clone(), engine_opts),
        MountOptions::default(),
    )
    .unwrap();
    (dev, Arc::new(fs))
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

/// Warms what the other thread's requests read (the root, `b`, the inode table and the
/// group's bitmaps), so that they need no block the stalled thread is reading: waiting
/// for the same block's one read is not waiting for a lock.
fn warm_b(fs: &Ext2) -> Ino {
    let b = fs.lookup(fs.root(), b"b").unwrap().ino;
    fs.readdir(b, 0, &mut |_| true).unwrap();
    let t = fs
        .mknod(b, b"warm", libc::S_IFREG | 0o644, 0, &root())
        .unwrap();
    fs.write(t.ino, 0, b"x", &root()).unwrap();
    fs.statfs().unwrap();
    b
}

/// Runs `stalled` on a thread whose device I/O stalls, waits until it is inside the
/// device, runs `meanwhile` (which must complete), then lets the device go.
fn while_stalled<T: Send + 'static>(
    dev: &Arc<StallDevice>,
    stalled: impl FnOnce() -> T + Send + 'static,
    meanwhile: impl FnOnce(),
) -> T {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let t = std::thread::Builder::new()
        .name("stalled".into())
        .spawn(move || {
            let r = stalled();
            d.store(true, SeqCst);
            r
        })
        .unwrap();
    dev.wait_stalled();
    // A watchdog: if `meanwhile` waits for the stalled thread, it would hang the test;
    // fail it instead by releasing the device after a while and checking the order.
    let finished = Arc::new(AtomicBool::new(false));
    let (f2, dev2) = (finished.clone(), dev.clone());
    let watchdog = std::thread::spawn(move || {
        for _ in 0..200 {
            if f2.load(SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        dev2.release();
    });
    meanwhile();
    finished.store(true, SeqCst);
    let (d, w) = (done.load(SeqCst), dev.waiting.load(SeqCst));
    assert!(
        !d && w > 0,
        "the other requests completed only after the stalled device was let go: they \
         waited for a lock held across its I/O (stalled thread done: {d}, I/Os stalled: {w})"
    );
    dev.release();
    watchdog.join().unwrap();
    t.join().unwrap()
}

#[test]
fn a_read_waiting_for_the_device_holds_up_no_other_request() {
    let (dev, fs) = image(EngineOptions::default());
    let b = warm_b(&fs);
    let a = fs.lookup(fs.root(), b"a").unwrap().ino;
    let f = fs.lookup(a, b"f").unwrap().ino;
    let fs2 = fs.clone();
    let got = while_stalled(
        &dev,
        move || fs2.read(f, 0, 65536).unwrap(),
        || {
            // Reads and changes elsewhere, while the file's data is being read.
            fs.getattr(b).unwrap();
            let n = fs
                .mknod(b, b"new", libc::S_IFREG | 0o644, 0, &root())
                .unwrap();
            fs.write(n.ino, 0, b"written meanwhile", &root()).unwrap();
            assert_eq!(fs.read(n.ino, 0, 100).unwrap(), b"written meanwhile");
            fs.rename(b, b"new", b, b"renamed", Default::default(), &root())
                .unwrap();
            fs.statfs().unwrap();
        },
    );
    assert_eq!(
        got,
        pattern(65536),
        "the stalled read returns the file's data"
    );
    let n = fs.lookup(b, b"renamed").unwrap();
    assert_eq!(n.size, 17);
    fs.unmount().unwrap();
}

#[test]
fn a_change_waiting_for_the_device_holds_up_no_other_request() {
    let (dev, fs) = image(EngineOptions::default());
    let b = warm_b(&fs);
    let a = fs.lookup(fs.root(), b"a").unwrap().ino;
    let fs2 = fs.clone();
    // The unlink reads `a`'s entries and `g`'s inode first: they are not cached.
    while_stalled(
        &dev,
        move || fs2.unlink(a, b"g", &root()).unwrap(),
        || {
            let n = fs.mkdir(b, b"d", 0o755, &root()).unwrap();
            fs.mknod(n.ino, b"x", libc::S_IFREG | 0o600, 0, &root())
                .unwrap();
            fs.lookup(n.ino, b"x").unwrap();
        },
    );
    assert!(fs.lookup(a, b"g").is_err(), "the stalled unlink completed");
    assert!(fs.lookup(a, b"f").is_ok());
    fs.unmount().unwrap();
}

#[test]
fn throttled_write_back_holds_up_no_reader() {
    // A graph limit so small that every write's op ends in a write-back.
    let opts = EngineOptions {
        patches_live_max: 4,
        ..Default::default()
    };
    let (dev, fs) = image(opts);
    let b = warm_b(&fs);
    let a = fs.lookup(fs.root(), b"a").unwrap().ino;
    let f = fs.lookup(a, b"f").unwrap().ino;
    fs.read(f, 0, 65536).unwrap();
    let n = fs
        .mknod(b, b"w", libc::S_IFREG | 0o644, 0, &root())
        .unwrap();
    dev.stall_writes.store(true, SeqCst);
    let fs2 = fs.clone();
    while_stalled(
        &dev,
        move || {
            for i in 0..8u64 {
                fs2.write(n.ino, i * 4096, &[i as u8; 4096], &root())
                    .unwrap();
                let name = format!("more{i}");
                let m = fs2
                    .mknod(b, name.as_bytes(), libc::S_IFREG | 0o644, 0, &root())
                    .unwrap();
                fs2.setattr(
                    m.ino,
                    quilt_vfs::SetAttr {
                        mode: Some(0o600),
                        ..Default::default()
                    },
                    &root(),
                )
                .unwrap();
            }
        },
        || {
            // The writer is inside write-back, at its op's end: readers go on.
            assert_eq!(fs.read(f, 0, 65536).unwrap(), pattern(65536));
            fs.getattr(n.ino).unwrap();
            fs.lookup(b, b"w").unwrap();
            fs.readdir(b, 0, &mut |_| true).unwrap();
        },
    );
    assert_eq!(fs.getattr(n.ino).unwrap().size, 8 * 4096);
    assert_eq!(fs.read(n.ino, 7 * 4096, 4).unwrap(), [7u8; 4]);
    fs.unmount().unwrap();
}

#[test]
fn freeing_an_unlinked_file_at_its_last_release_holds_up_no_other_request() {
    let (dev, fs) = image(EngineOptions::default());
    let b = warm_b(&fs);
    let a = fs.lookup(fs.root(), b"a").unwrap().ino;
    // `f` (64 KiB: twelve direct blocks and an indirect one) stays open while its name
    // goes, as the kernel holds a file `rm -rf` unlinks until it FORGETs it. Its
    // indirect block is not cached: freeing the file reads it.
    let f = fs.lookup(a, b"f").unwrap().ino;
    fs.open(f).unwrap();
    fs.unlink(a, b"f", &root()).unwrap();
    let free_before = fs.statfs().unwrap().blocks_free;
    let fs2 = fs.clone();
    while_stalled(
        &dev,
        move || fs2.release(f).unwrap(),
        || {
            // (Nothing that keeps a block: the count below is the release's.)
            fs.mknod(b, b"x", libc::S_IFREG | 0o600, 0, &root())
                .unwrap();
            fs.rename(b, b"x", b, b"y", Default::default(), &root())
                .unwrap();
            fs.unlink(b, b"y", &root()).unwrap();
            fs.getattr(a).unwrap();
        },
    );
    assert_eq!(
        fs.statfs().unwrap().blocks_free,
        free_before + 17,
        "the release freed the file's 16 data blocks and its indirect block"
    );
    fs.unmount().unwrap();
}
