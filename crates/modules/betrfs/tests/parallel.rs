//! Requests go on while a writer waits for the disk: betrfs holds its state lock across
//! no checkpoint wait. A device stalls every write of the tree's checkpoint thread
//! until the test lets it go; a thread writing a file then soon owes the tree a wait
//! for that checkpoint (`Tree::write_behind`), and while it waits, other threads'
//! reads (a lookup, a getattr, a read) must complete, also while a second change waits.

use quilt_betrfs::{mkfs, Betrfs, MountOptions};
use quilt_block::{BlockDevice, BlockNo, IoStats, MemDevice, Result as BlockResult, WriteClass};
use quilt_vfs::{Ctx, FileSystem};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

const REG: u32 = libc::S_IFREG | 0o644;

/// Stalls the writes of the checkpoint thread once armed, until released.
struct StallCheckpoints {
    inner: MemDevice,
    armed: AtomicBool,
    released: Mutex<bool>,
    cv: Condvar,
    waiting: AtomicUsize,
}

impl StallCheckpoints {
    fn stall(&self) {
        if !self.armed.load(SeqCst) || std::thread::current().name() != Some("quilt-betree-ckpt") {
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
}

impl BlockDevice for StallCheckpoints {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> BlockResult<()> {
        self.inner.read(block, buf)
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> BlockResult<()> {
        self.inner.read_blocks(first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> BlockResult<()> {
        self.stall();
        self.inner.write(block, buf, class)
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> BlockResult<()> {
        self.stall();
        self.inner.write_blocks(first, buf, class)
    }
    fn flush(&self) -> BlockResult<()> {
        self.stall();
        self.inner.flush()
    }
    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        Default::default()
    }
}

/// Runs `f` on its own thread and waits at most ten seconds for its answer.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} waited for the stalled checkpoint"))
}

#[test]
fn requests_go_on_while_a_writer_waits_for_a_checkpoint() {
    let dev = Arc::new(StallCheckpoints {
        inner: MemDevice::new(4096, 65536).unwrap(),
        armed: AtomicBool::new(false),
        released: Mutex::new(false),
        cv: Condvar::new(),
        waiting: AtomicUsize::new(0),
    });
    mkfs(dev.clone()).unwrap();
    let fs = Arc::new(
        Betrfs::open(
            dev.clone(),
            MountOptions {
                commit_interval: None,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let c = Ctx::root();
    let root = fs.root();
    let other = fs.mknod(root, b"other", REG, 0, &c).unwrap().ino;
    fs.write(other, 0, b"still readable", &c).unwrap();
    fs.sync_all().unwrap();
    dev.armed.store(true, SeqCst);

    // The writer: 1 MiB writes until a checkpoint starts and stalls, and then on into
    // the wait it owes.
    let writes = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (fs, writes) = (fs.clone(), writes.clone());
        std::thread::spawn(move || {
            let f = fs
                .mknod(fs.root(), b"big", REG, 0, &Ctx::root())
                .unwrap()
                .ino;
            let chunk = vec![7u8; 1 << 20];
            for i in 0..96u64 {
                fs.write(f, i << 20, &chunk, &Ctx::root()).unwrap();
                writes.fetch_add(1, SeqCst);
            }
        })
    };
    for _ in 0..2000 {
        if dev.waiting.load(SeqCst) > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        dev.waiting.load(SeqCst) > 0,
        "no checkpoint started within 96 MiB of writes"
    );
    // The writer goes on until it owes the tree its wait, and stops there.
    let mut last = usize::MAX;
    for _ in 0..200 {
        let now = writes.load(SeqCst);
        if now == last {
            break;
        }
        last = now;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        writes.load(SeqCst) < 96,
        "the writer never waited for the stalled checkpoint"
    );

    // Reads go on. A change may wait too (a writer that finds the checkpoint too far
    // behind owes the same wait), but not holding the state: reads still go on.
    let reads = |when: &str| {
        let f = fs.clone();
        let a = within(&format!("a lookup {when}"), move || {
            f.lookup(f.root(), b"other").unwrap().ino
        });
        assert_eq!(a, other);
        let f = fs.clone();
        within(&format!("a getattr {when}"), move || {
            f.getattr(other).unwrap()
        });
        let f = fs.clone();
        let read = within(&format!("a read {when}"), move || {
            f.read(other, 0, 100).unwrap()
        });
        assert_eq!(read, b"still readable");
    };
    reads("while a writer waits");
    let creator = {
        let f = fs.clone();
        std::thread::spawn(move || f.mknod(f.root(), b"new", REG, 0, &Ctx::root()).unwrap())
    };
    std::thread::sleep(Duration::from_millis(200));
    reads("while a writer and a creator wait");

    dev.release();
    writer.join().unwrap();
    creator.join().unwrap();
    assert!(fs.lookup(root, b"new").is_ok());
    assert_eq!(writes.load(SeqCst), 96);
    let big = fs.lookup(root, b"big").unwrap();
    assert_eq!(big.size, 96 << 20);
    assert_eq!(fs.read(big.ino, 95 << 20, 4).unwrap(), vec![7u8; 4]);
}
