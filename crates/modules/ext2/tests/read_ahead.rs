//! Hints to the device ahead of reads (`BlockDevice::will_need`): what a cold tree
//! walk (`rm -rf`, `find`) reads next is asked for before the reads that wait for it.
//! The oracle is the device's own log of hints and reads: every directory block a
//! listing reads was hinted before it was read, nothing cached is hinted again, and a
//! miss in an inode table asks for the table's next blocks, once.

use quilt_block::{BlockDevice, BlockNo, IoStats, MemDevice, Result};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, KernelFs};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Hint(BlockNo, u64),
    Read(BlockNo),
}

/// A memory device that logs hints and reads.
struct Logged {
    inner: MemDevice,
    log: Mutex<Vec<Event>>,
}

impl Logged {
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut self.log.lock().unwrap())
    }
}

impl BlockDevice for Logged {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.log.lock().unwrap().push(Event::Read(block));
        self.inner.read(block, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: quilt_block::WriteClass) -> Result<()> {
        self.inner.write(block, buf, class)
    }
    fn flush(&self) -> Result<()> {
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
            hints: Some(self),
            ..Default::default()
        }
    }
}

impl quilt_block::ReadHints for Logged {
    fn will_need(&self, first: BlockNo, count: u64) {
        self.log.lock().unwrap().push(Event::Hint(first, count));
    }
}

const DIR: u32 = libc::S_IFDIR | 0o755;
const REG: u32 = libc::S_IFREG | 0o644;

/// A tree made and written back: `top/` with `subdirs` directories (each holding
/// one file) and `files` files. Returns the image's bytes.
fn tree(subdirs: usize, files: usize) -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(4096, 8192).unwrap());
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    mkfs(
        &engine,
        &MkfsOptions {
            device_is_zeroed: true,
            ..Default::default()
        },
    )
    .unwrap();
    let fs = Ext2::open(engine, MountOptions::default()).unwrap();
    let c = Ctx::root();
    let top = fs.mkdir(fs.root(), b"top", DIR, &c).unwrap().ino;
    for i in 0..subdirs {
        let d = fs
            .mkdir(top, format!("d{i}").as_bytes(), DIR, &c)
            .unwrap()
            .ino;
        fs.mknod(d, b"f", REG, 0, &c).unwrap();
    }
    for i in 0..files {
        fs.mknod(top, format!("f{i}").as_bytes(), REG, 0, &c)
            .unwrap();
    }
    fs.unmount().unwrap();
    dev.to_vec()
}

/// The image opened cold (nothing cached) over a logging device.
fn cold(image: &[u8]) -> (Arc<Logged>, Ext2) {
    let dev = Arc::new(Logged {
        inner: MemDevice::from_bytes(4096, image).unwrap(),
        log: Mutex::new(Vec::new()),
    });
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    let fs = Ext2::open(engine, MountOptions::default()).unwrap();
    dev.take();
    (dev, fs)
}

fn listing(fs: &Ext2, dir: u64) -> Vec<(Vec<u8>, u64)> {
    let mut v = Vec::new();
    fs.readdir(dir, 0, &mut |e| {
        if e.name != b"." && e.name != b".." {
            v.push((e.name, e.ino));
        }
        true
    })
    .unwrap();
    v
}

fn hinted(log: &[Event], block: BlockNo) -> bool {
    log.iter()
        .any(|e| matches!(*e, Event::Hint(f, n) if (f..f + n).contains(&block)))
}

#[test]
fn subdirectories_listed_next_are_hinted_before_they_are_read() {
    let (dev, fs) = cold(&tree(12, 0));
    let top = fs.lookup(fs.root(), b"top").unwrap().ino;
    let subdirs: Vec<u64> = listing(&fs, top).into_iter().map(|(_, ino)| ino).collect();
    assert_eq!(subdirs.len(), 12);
    // What READDIRPLUS does: the attributes, then the hint for the directories.
    fs.will_getattr(&subdirs);
    for &d in &subdirs {
        fs.getattr(d).unwrap();
    }
    dev.take();
    fs.will_readdir(&subdirs);
    let hints = dev.take();
    assert!(
        hints.iter().all(|e| matches!(e, Event::Hint(..))),
        "a hint reads nothing itself: {hints:?}"
    );
    // Each directory's listing reads its one block, and that block was hinted.
    let mut listed = 0;
    for &d in &subdirs {
        assert_eq!(listing(&fs, d).len(), 1);
        for e in dev.take() {
            if let Event::Read(b) = e {
                assert!(
                    hinted(&hints, b),
                    "block {b} read unhinted; hints {hints:?}"
                );
                listed += 1;
            }
        }
    }
    assert_eq!(listed, 12, "one cold block per directory");
    // Cached now: no hint again.
    fs.will_readdir(&subdirs);
    assert_eq!(dev.take(), vec![]);
}

#[test]
fn an_inode_table_miss_reads_the_table_ahead() {
    // 200 files: 13 inode table blocks of 256-byte inodes (16 a block).
    let (dev, fs) = cold(&tree(0, 200));
    let top = fs.lookup(fs.root(), b"top").unwrap().ino;
    let files = listing(&fs, top);
    assert_eq!(files.len(), 200);
    dev.take();
    // In the order the inodes were made: the first one outside the (cached) block of
    // the directory's own inode misses, and asks for the table's blocks after it.
    let mut files: Vec<u64> = files.into_iter().map(|(_, ino)| ino).collect();
    files.sort_unstable();
    let mut rest = files.iter();
    let (log, read) = loop {
        let ino = rest.next().expect("some inode is in a cold block");
        fs.getattr(*ino).unwrap();
        let log = dev.take();
        if let Some(b) = log.iter().find_map(|e| match *e {
            Event::Read(b) => Some(b),
            _ => None,
        }) {
            break (log, b);
        }
    };
    let ahead = log.iter().find_map(|e| match *e {
        Event::Hint(f, n) if f <= read && read < f + n => Some(f + n - read),
        _ => None,
    });
    assert!(
        ahead.is_some_and(|n| n >= 8),
        "the miss on block {read} asked for the table ahead: {log:?}"
    );
    // The rest of the files' inodes are in hinted blocks: reading them asks for no
    // more hints until half the read-ahead is used.
    let mut reads = Vec::new();
    for &ino in rest {
        fs.getattr(ino).unwrap();
        reads.extend(dev.take());
    }
    let hints = reads
        .iter()
        .filter(|e| matches!(e, Event::Hint(..)))
        .count();
    let blocks = reads.iter().filter(|e| matches!(e, Event::Read(_))).count();
    assert!(
        blocks >= 3,
        "the other inodes span several table blocks: {reads:?}"
    );
    assert_eq!(hints, 0, "inside the read-ahead: {reads:?}");
}
