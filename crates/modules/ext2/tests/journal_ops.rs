//! The journal modes through the native API: group commit, refusals, clean shutdown.

mod support;

use quilt_block::{BlockDevice, MemDevice};
use quilt_ext2::format::{Superblock, INCOMPAT_RECOVER};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FsError, KernelFs};
use std::sync::Arc;

fn image(journal: bool) -> Arc<MemDevice> {
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
    let fs = Ext2::open(engine, support::options()).unwrap();
    if journal {
        fs.create_journal(1024).unwrap();
    }
    fs.unmount().unwrap();
    dev
}

fn mount(dev: &Arc<MemDevice>, mode: Mode) -> Result<Ext2, FsError> {
    Ext2::open(
        Engine::new(dev.clone(), EngineOptions::default()),
        MountOptions {
            journal: support::journals(),
            mode,
            read_only: false,
            ..Default::default()
        },
    )
}

/// A mount whose journal retires transactions only by forced checkpoints: write-back
/// would otherwise put them home before the log fills, and no force would be tested.
fn mount_forcing(dev: &Arc<MemDevice>, mode: Mode) -> Ext2 {
    Ext2::open(
        Engine::new(dev.clone(), EngineOptions::default()),
        MountOptions {
            journal: support::journals(),
            mode,
            journal_forced_checkpoints_only: true,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A new regular file `name` in `dir` holding `data`.
fn file(fs: &Ext2, dir: u64, name: &[u8], data: &[u8]) -> u64 {
    let c = Ctx::root();
    let f = fs
        .mknod(dir, name, libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    fs.write(f, 0, data, &c).unwrap();
    f
}

fn counter(fs: &Ext2, name: &str) -> u64 {
    fs.counters()
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

fn superblock(dev: &MemDevice) -> Superblock {
    let mut b = vec![0u8; 4096];
    dev.read(0, &mut b).unwrap();
    Superblock::decode(&b[1024..2048]).unwrap()
}

/// A device whose flush takes a while, as a disk's does: while one commit waits for it,
/// the other threads' fsyncs queue up behind it and can share the next one. (On a
/// memory device a commit is over before another fsync arrives, and whether any is
/// shared is up to the scheduler.)
struct SlowFlush(Arc<MemDevice>);

impl BlockDevice for SlowFlush {
    fn block_size(&self) -> usize {
        self.0.block_size()
    }
    fn block_count(&self) -> u64 {
        self.0.block_count()
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.0.read(block, buf)
    }
    fn write(
        &self,
        block: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.0.write(block, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(3));
        self.0.flush()
    }
    fn stats(&self) -> quilt_block::IoStats {
        self.0.stats()
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
            ..Default::default()
        }
    }
}

#[test]
fn concurrent_fsyncs_share_commits() {
    let dev = image(true);
    let fs = Arc::new(
        Ext2::open(
            Engine::new(Arc::new(SlowFlush(dev.clone())), EngineOptions::default()),
            MountOptions {
                journal: support::journals(),
                mode: Mode::MetaJournal,
                read_only: false,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let c = Ctx::root();
                let f = fs
                    .mknod(
                        fs.root(),
                        format!("t{t}").as_bytes(),
                        libc::S_IFREG | 0o644,
                        0,
                        &c,
                    )
                    .unwrap()
                    .ino;
                for i in 0..25u64 {
                    fs.write(f, i * 100, &[t as u8; 100], &c).unwrap();
                    fs.fsync(f, false).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let fsyncs = counter(&fs, "fs.fsyncs");
    let commits = counter(&fs, "journal.commits");
    assert_eq!(fsyncs, 200);
    assert!(commits >= 1, "fsync must commit");
    assert!(
        commits < fsyncs,
        "{commits} commits for {fsyncs} concurrent fsyncs: none was shared"
    );
    eprintln!("group commit: {commits} commits for {fsyncs} fsyncs");
}

#[test]
fn journal_modes_need_a_journal() {
    let dev = image(false);
    for mode in [Mode::MetaJournal, Mode::FullJournal] {
        match mount(&dev, mode) {
            Err(FsError::Invalid(m)) => assert!(m.contains("journal"), "{m}"),
            other => panic!("{mode} on ext2: {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn needs_recovery_is_set_while_mounted_and_cleared_by_unmount() {
    let dev = image(true);
    let fs = mount(&dev, Mode::FullJournal).unwrap();
    assert_ne!(superblock(&dev).feature_incompat & INCOMPAT_RECOVER, 0);
    file(&fs, fs.root(), b"a", &vec![7u8; 300_000]);
    fs.sync_all().unwrap();
    assert!(
        counter(&fs, "journal.journal_blocks_written") > 70,
        "data is journaled"
    );
    fs.unmount().unwrap();
    drop(fs);
    assert_eq!(superblock(&dev).feature_incompat & INCOMPAT_RECOVER, 0);
    // A second mount in another mode sees the data, and nothing to recover.
    let fs = mount(&dev, Mode::SoftUpdates).unwrap();
    let a = fs.lookup(fs.root(), b"a").unwrap();
    assert_eq!(fs.read(a.ino, 0, 300_001).unwrap(), vec![7u8; 300_000]);
    fs.unmount().unwrap();
}

/// A forced checkpoint wrote the oldest transaction's own images home, though write-back
/// had already put newer committed versions of some of those blocks there: the blocks
/// went back in time, and after a clean unmount the image lost directory entries and
/// link counts (found by `quiltfs bench mail` with Dovecot in full-journal mode). Here:
/// a small log, hot directory and inode-table blocks changed in every transaction, and
/// write-back running between commits, as the flusher thread does.
#[test]
fn forced_checkpoints_never_take_a_block_back_in_time() {
    for mode in [Mode::FullJournal, Mode::MetaJournal] {
        // The smallest log there is (1,024 blocks), so it fills.
        let dev = image(true);
        let fs = mount_forcing(&dev, mode);
        let c = Ctx::root();
        let root = fs.root();
        // Two mailboxes used in turn, so one's blocks go home while the other's are
        // being changed again by the running transaction.
        let boxes: Vec<u64> = (0..4)
            .map(|b| {
                fs.mkdir(root, format!("box{b}").as_bytes(), 0o755, &c)
                    .unwrap()
                    .ino
            })
            .collect();
        for i in 0..600u32 {
            let d = boxes[(i % 4) as usize];
            let keep = boxes[((i + 2) % 4) as usize];
            let name = format!("msg{i}");
            let f = file(&fs, d, name.as_bytes(), &[i as u8; 1500]);
            fs.link(f, keep, format!("copy{i}").as_bytes(), &c).unwrap();
            if i >= 8 {
                fs.unlink(d, format!("msg{}", i - 8).as_bytes(), &c)
                    .unwrap();
            }
            fs.fsync(f, false).unwrap();
        }
        assert!(
            counter(&fs, "journal.forced_checkpoints") > 0,
            "{mode}: the log never filled, so this test checks nothing"
        );
        fs.unmount().unwrap();
        drop(fs);
        assert_e2fsck_clean(&dev, &format!("{mode}"));
    }
}

/// Blocks changed in every transaction (the bitmaps, an inode table block, a
/// directory) must not keep the committed transactions from being retired by
/// write-back: a change of the running transaction that joined a committed one's patch
/// made every transaction wait for a forced checkpoint, which reads its blocks back from
/// the log (a full-journal untar: 91 of 91). A small log that the workload fills many
/// times over, write-back while the running transaction holds changes to the hot
/// blocks: every transaction goes home through write-back.
#[test]
fn write_back_retires_transactions_that_share_hot_blocks() {
    for mode in [Mode::FullJournal, Mode::MetaJournal] {
        let dev = image(true);
        let fs = mount(&dev, mode).unwrap();
        let root = fs.root();
        for i in 0..400u32 {
            let f = file(&fs, root, format!("f{i}").as_bytes(), &[i as u8; 6000]);
            // Write-back while the running transaction has changed the hot blocks
            // again, as the flusher meets it in the middle of an untar.
            fs.engine().write_back_ready().unwrap();
            fs.fsync(f, false).unwrap();
        }
        let (retired, forced) = (
            counter(&fs, "journal.checkpoints"),
            counter(&fs, "journal.forced_checkpoints"),
        );
        assert!(
            retired > 100,
            "{mode}: {retired} transactions retired: the log did not cycle"
        );
        assert_eq!(
            forced, 0,
            "{mode}: {forced} of {retired} checkpoints forced"
        );
        fs.unmount().unwrap();
        drop(fs);
        assert_e2fsck_clean(&dev, &format!("{mode} hot blocks"));
    }
}

/// A forced checkpoint reads each block's committed copy back from the log; a copy whose
/// first four bytes were the JBD2 magic is escaped there (zeroed) and must get its magic
/// back on the way home. Full journaling, so file data goes through the log.
#[test]
fn forced_checkpoints_restore_escaped_blocks() {
    let dev = image(true);
    let fs = mount_forcing(&dev, Mode::FullJournal);
    let c = Ctx::root();
    let root = fs.root();
    let contents = |i: u32| -> Vec<u8> {
        let mut v = vec![(i % 251) as u8; 4096];
        v[0..4].copy_from_slice(&0xC03B_3998u32.to_be_bytes());
        v[4..8].copy_from_slice(&i.to_le_bytes());
        v
    };
    let f = fs
        .mknod(root, b"hot", libc::S_IFREG | 0o644, 0, &c)
        .unwrap()
        .ino;
    // One block rewritten in every transaction (its copies pile up in the log), among
    // many new files whose first block starts with the magic too.
    for i in 0..700u32 {
        fs.write(f, 0, &contents(i), &c).unwrap();
        let g = file(&fs, root, format!("f{i}").as_bytes(), &contents(i + 10_000));
        fs.fsync(g, false).unwrap();
    }
    assert!(
        counter(&fs, "journal.forced_checkpoints") > 0,
        "the log never filled, so this test checks nothing"
    );
    fs.unmount().unwrap();
    drop(fs);
    let fs = mount(&dev, Mode::Async).unwrap();
    let root = fs.root();
    let f = fs.lookup(root, b"hot").unwrap().ino;
    assert!(
        fs.read(f, 0, 4096).unwrap() == contents(699),
        "the hot block"
    );
    for i in 0..700u32 {
        let g = fs.lookup(root, format!("f{i}").as_bytes()).unwrap().ino;
        let got = fs.read(g, 0, 4096).unwrap();
        assert!(
            got == contents(i + 10_000),
            "file f{i} after a forced checkpoint begins {:02x?}",
            &got[..8]
        );
    }
    fs.unmount().unwrap();
}

/// A file unlinked while open, then a crash: the on-disk orphan list (the superblock's
/// last_orphan, chained through dtime) lets recovery free it, so the journal modes leave
/// no allocated inode that no directory names (e2fsck -fn finds the image clean); a
/// second open-unlinked file closed before the crash has left the list.
#[test]
fn files_unlinked_while_open_are_freed_after_a_crash() {
    for mode in [Mode::MetaJournal, Mode::FullJournal] {
        let dev = image(true);
        let fs = mount(&dev, mode).unwrap();
        let c = Ctx::root();
        let root = fs.root();
        let free_before = fs.statfs().unwrap().files_free;
        let mut inos = Vec::new();
        for name in [&b"a"[..], b"b", b"c"] {
            let f = file(&fs, root, name, &[7u8; 50_000]);
            fs.open(f).unwrap();
            inos.push(f);
        }
        for name in [&b"a"[..], b"b", b"c"] {
            fs.unlink(root, name, &c).unwrap();
        }
        // The middle one closes: it leaves the list from its middle.
        fs.release(inos[1]).unwrap();
        fs.sync_all().unwrap();
        // The crash: no release, no unmount.
        drop(fs);
        let fs = mount(&dev, mode).unwrap();
        assert_eq!(
            fs.statfs().unwrap().files_free,
            free_before,
            "{mode}: inodes freed"
        );
        fs.unmount().unwrap();
        drop(fs);
        assert_eq!(superblock(&dev).last_orphan, 0);
        assert_e2fsck_clean(&dev, &format!("{mode}"));
    }
}

/// `e2fsck -fn` finds the image clean (where e2fsck is installed).
fn assert_e2fsck_clean(dev: &MemDevice, what: &str) {
    let img = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(img.path(), dev.to_vec()).unwrap();
    let Ok(out) = std::process::Command::new("e2fsck")
        .arg("-fn")
        .arg(img.path())
        .output()
    else {
        eprintln!("SKIPPED the e2fsck check: e2fsck is not installed");
        return;
    };
    assert!(
        out.status.success(),
        "{what}: e2fsck -fn: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Many files on the orphan list, leaving it in the order `rm -rf` makes (oldest
/// first: each file's FORGET after the unlinks that followed it), newest first, and
/// from the middle out; then a crash. The list on disk must still chain exactly the
/// files not yet released: recovery frees those and only those, and the image is
/// clean. (Files leave the list through in-memory back links, not a walk.)
#[test]
fn the_orphan_list_stays_whole_whatever_order_files_leave_it() {
    const N: usize = 10;
    let orders: [(&str, Vec<usize>); 3] = [
        ("oldest first", (0..N).collect()),
        ("newest first", (0..N).rev().collect()),
        ("middle out", vec![5, 4, 6, 3, 7, 2, 8, 1, 9, 0]),
    ];
    for mode in [Mode::MetaJournal, Mode::FullJournal] {
        for (name, order) in &orders {
            let dev = image(true);
            let fs = mount(&dev, mode).unwrap();
            let c = Ctx::root();
            let root = fs.root();
            let free_before = fs.statfs().unwrap().files_free;
            let mut inos = Vec::new();
            for i in 0..N {
                let n = format!("f{i}");
                let f = file(&fs, root, n.as_bytes(), &[1u8; 5000]);
                fs.open(f).unwrap();
                fs.unlink(root, n.as_bytes(), &c).unwrap();
                inos.push(f);
            }
            // Seven leave; three are still open at the crash.
            for &i in &order[..7] {
                fs.release(inos[i]).unwrap();
            }
            fs.sync_all().unwrap();
            drop(fs);
            let fs = mount(&dev, mode).unwrap();
            assert_eq!(
                fs.statfs().unwrap().files_free,
                free_before,
                "{mode}, {name}: the three left are freed by recovery"
            );
            fs.unmount().unwrap();
            drop(fs);
            assert_eq!(superblock(&dev).last_orphan, 0, "{mode}, {name}");
            assert_e2fsck_clean(&dev, &format!("{mode} {name}"));
        }
    }
}

/// A FORGET batch (`unreference_all`, as `rm -rf` makes them: many files, some named
/// twice, more than one op's worth) frees exactly the unlinked files whose last
/// reference it drops, in every mode, and nothing else; the image is clean, before and
/// after a crash right after it.
#[test]
fn a_forget_batch_frees_exactly_the_unlinked_files_it_lets_go() {
    for (journal, mode) in [
        (false, Mode::SoftUpdates),
        (true, Mode::MetaJournal),
        (true, Mode::FullJournal),
    ] {
        let dev = image(journal);
        let fs = mount(&dev, mode).unwrap();
        let c = Ctx::root();
        let r = fs.root();
        // 100 files of 5 blocks; every fourth has 64 KiB more (an indirect block).
        let mut files = Vec::new();
        for i in 0..100u32 {
            let len = if i % 4 == 0 { 20480 + 65536 } else { 20480 };
            let f = file(&fs, r, format!("f{i}").as_bytes(), &vec![i as u8; len]);
            fs.reference(f).unwrap();
            if (40..80).contains(&i) {
                fs.reference(f).unwrap();
            }
            files.push(f);
        }
        for i in 0..80 {
            fs.unlink(r, format!("f{i}").as_bytes(), &c).unwrap();
        }
        let before = fs.statfs().unwrap();
        // f0-f39 (one reference: freed), f40-f59 (two, one dropped: kept), f60-f79 (two,
        // both dropped in the batch: freed), f80-f99 (still named: kept).
        let mut batch: Vec<u64> = files[0..60].to_vec();
        batch.extend(&files[60..80]);
        batch.extend(&files[60..80]);
        batch.extend(&files[80..100]);
        fs.unreference_all(&batch).unwrap();
        let after = fs.statfs().unwrap();
        let freed: u64 = (0..40)
            .chain(60..80)
            .map(|i| if i % 4 == 0 { 5 + 16 + 1 } else { 5 })
            .sum();
        assert_eq!(
            after.files_free - before.files_free,
            60,
            "{mode:?}: inodes freed"
        );
        assert_eq!(
            after.blocks_free - before.blocks_free,
            freed,
            "{mode:?}: blocks freed"
        );
        for (i, &f) in files.iter().enumerate() {
            let kept = (40..60).contains(&i) || i >= 80;
            match fs.getattr(f) {
                Ok(a) if kept => {
                    assert!(a.size >= 20480, "{mode:?}: f{i}");
                    assert_eq!(fs.read(f, 0, 1).unwrap(), [i as u8], "{mode:?}: f{i} kept");
                }
                Err(_) if !kept => {}
                r => panic!("{mode:?}: f{i} (kept: {kept}): {r:?}"),
            }
        }
        // A crash now: what the batch freed stays freed, what it kept stays. f40-f59
        // are orphans still: a journal's recovery frees them, as the kernel's would;
        // without a journal they are let go first (ext2 leaves such inodes to e2fsck).
        if !journal {
            fs.unreference_all(&files[40..60]).unwrap();
        }
        fs.sync_all().unwrap();
        let crashed = Arc::new(MemDevice::from_bytes(4096, &dev.to_vec()).unwrap());
        drop(fs);
        let fs = mount(&crashed, mode).unwrap();
        for i in 80..100 {
            fs.lookup(fs.root(), format!("f{i}").as_bytes())
                .unwrap_or_else(|e| panic!("{mode:?}: f{i} lost: {e}"));
        }
        fs.unmount().unwrap();
        assert_e2fsck_clean(&crashed, &format!("{mode:?} after the batch and a crash"));
    }
}
