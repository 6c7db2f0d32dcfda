//! Atomic batches (`FileSystem::apply_batch`) in every module that has them (betrfs,
//! ext2 in the journal modes): a batch that succeeds is all there, with the replies
//! of each operation; a batch with a failing operation names it and leaves nothing
//! behind (names, numbers granted, the next batch works); and a crash at any point of
//! a batch's write-back leaves all of it or none, as the recorded device history shows
//! when each crash state is mounted again.

use quilt_block::{BlockDevice, BlockDeviceExt, LogEntry, MemDevice, RecordingLog};
use quilt_vfs::{Ctx, FileSystem, FsError, FsOp, FsReply, Ino};
use std::sync::Arc;

#[path = "support/modules.rs"]
mod modules;

use modules::{mkfs, mount, unmount, Kind};

const KINDS: [Kind; 3] = [
    Kind::Betrfs,
    Kind::Ext2(quilt_ext2::Mode::MetaJournal),
    Kind::Ext2(quilt_ext2::Mode::FullJournal),
];

/// A subtree made under granted numbers, as a client's journal would carry it: a
/// directory, files and a symlink in it, a rename and an unlink among them.
fn subtree(root: Ino, grant: &[Ino], top: &[u8]) -> Vec<FsOp> {
    let d = grant[0];
    let mut ops = vec![FsOp::Mkdir {
        parent: root,
        name: top.to_vec(),
        mode: 0o755,
        ino: Some(d),
    }];
    for (i, &ino) in grant[1..6].iter().enumerate() {
        ops.push(FsOp::Mknod {
            parent: d,
            name: format!("f{i}").into_bytes(),
            mode: libc::S_IFREG | 0o644,
            rdev: 0,
            ino: Some(ino),
        });
    }
    ops.push(FsOp::Symlink {
        parent: d,
        name: b"link".to_vec(),
        target: b"f0".to_vec(),
        ino: Some(grant[6]),
    });
    ops.push(FsOp::Rename {
        parent: d,
        name: b"f1".to_vec(),
        new_parent: d,
        new_name: b"renamed".to_vec(),
        flags: Default::default(),
    });
    ops.push(FsOp::Unlink {
        parent: d,
        name: b"f2".to_vec(),
    });
    ops.push(FsOp::Lookup {
        parent: d,
        name: b"renamed".to_vec(),
    });
    ops
}

/// The names a successful `subtree(.., top)` leaves in its directory.
const NAMES: [&[u8]; 5] = [b"f0", b"renamed", b"f3", b"f4", b"link"];

fn names_in(fs: &dyn FileSystem, dir: Ino) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    fs.readdir(dir, 0, &mut |e| {
        if e.name != b"." && e.name != b".." {
            v.push(e.name);
        }
        true
    })
    .unwrap();
    v.sort();
    v
}

fn expected_names() -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = NAMES.iter().map(|n| n.to_vec()).collect();
    v.sort();
    v
}

#[test]
fn a_batch_applies_whole_and_a_failing_one_leaves_nothing() {
    let c = Ctx::root();
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let root = fs.root();
        let g = fs.grant_inodes(16).unwrap();
        let grant: Vec<Ino> = g.iter().collect();
        fs.mknod(root, b"taken", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();

        // A batch whose last operation fails: nothing of it stays.
        let mut bad = subtree(root, &grant, b"top");
        bad.push(FsOp::Mknod {
            parent: root,
            name: b"taken".to_vec(),
            mode: libc::S_IFREG | 0o644,
            rdev: 0,
            ino: None,
        });
        let e = fs.apply_batch(&bad, &c).unwrap_err();
        assert_eq!(
            (e.index, &e.error),
            (bad.len() - 1, &FsError::Exists),
            "{kind:?}"
        );
        assert_eq!(
            fs.lookup(root, b"top").unwrap_err(),
            FsError::NotFound,
            "{kind:?}"
        );
        assert!(
            fs.getattr(grant[0]).is_err(),
            "{kind:?}: the number is free again"
        );

        // One that fails in its middle (a parent that is not there).
        let mut mid = subtree(root, &grant, b"top");
        mid.insert(
            3,
            FsOp::Mkdir {
                parent: 999_999,
                name: b"x".to_vec(),
                mode: 0o755,
                ino: None,
            },
        );
        let e = fs.apply_batch(&mid, &c).unwrap_err();
        assert_eq!(e.index, 3, "{kind:?}: {e}");
        assert_eq!(fs.lookup(root, b"top").unwrap_err(), FsError::NotFound);

        // Operations that cannot be in a batch are refused before anything runs.
        let mut data = subtree(root, &grant, b"top");
        data.push(FsOp::Write {
            ino: grant[1],
            offset: 0,
            data: b"x".to_vec(),
        });
        let e = fs.apply_batch(&data, &c).unwrap_err();
        assert_eq!(e.index, data.len() - 1);
        assert!(matches!(e.error, FsError::Invalid(_)), "{e}");
        assert_eq!(fs.lookup(root, b"top").unwrap_err(), FsError::NotFound);

        // The same numbers, in a good batch: every reply, and everything there.
        let good = subtree(root, &grant, b"top");
        let replies = fs.apply_batch(&good, &c).unwrap();
        assert_eq!(replies.len(), good.len());
        match (&replies[0], replies.last().unwrap()) {
            (FsReply::Attr(d), FsReply::Attr(r)) => {
                assert_eq!(d.ino, grant[0]);
                assert_eq!(r.ino, grant[2], "{kind:?}: f1 renamed keeps its number");
            }
            other => panic!("{kind:?}: replies {other:?}"),
        }
        assert_eq!(names_in(&*fs, grant[0]), expected_names(), "{kind:?}");
        assert_eq!(fs.readlink(grant[6]).unwrap(), b"f0");
        // And the file system goes on as usual.
        let f = fs
            .mknod(grant[0], b"later", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        fs.write(f.ino, 0, b"data", &c).unwrap();
        unmount(fs);
        let fs = mount(kind, dev.clone());
        let d = fs.lookup(fs.root(), b"top").unwrap();
        assert_eq!(d.ino, grant[0], "{kind:?}: the number survives a remount");
        let mut want = expected_names();
        want.push(b"later".to_vec());
        want.sort();
        assert_eq!(names_in(&*fs, grant[0]), want, "{kind:?} after a remount");
        unmount(fs);
    }
}

/// The attributes of every directory on the way to `path` (from the root), looked up
/// by name, as a fresh mount must.
fn dir_attrs(fs: &dyn FileSystem, path: &[&[u8]]) -> Vec<quilt_vfs::Attr> {
    let mut at = fs.getattr(fs.root()).unwrap();
    let mut out = vec![at];
    for name in path {
        at = fs.lookup(at.ino, name).unwrap();
        out.push(at);
    }
    out
}

/// A module may put a directory's record once after a run of creations in it (betrfs
/// does, in a batch) rather than once per creation: what it then holds on disk must be
/// what it answered from memory. Every directory a batch changed (links, times, size)
/// reads the same before and after a remount, among creations, a subdirectory, a rename
/// of the directory in the middle of the run and creations after it; a batch that fails
/// after its creations leaves the directory's attributes as they were, on disk too.
#[test]
fn directories_a_batch_changed_read_the_same_after_a_remount() {
    let c = Ctx::root();
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let root = fs.root();
        let top = fs.mkdir(root, b"top", 0o755, &c).unwrap().ino;
        let g: Vec<Ino> = fs.grant_inodes(64).unwrap().iter().collect();
        let mut nums = g.iter().copied();
        let mut ops = Vec::new();
        let mknod = |parent: Ino, name: String, ino: Ino| FsOp::Mknod {
            parent,
            name: name.into_bytes(),
            mode: libc::S_IFREG | 0o644,
            rdev: 0,
            ino: Some(ino),
        };
        for i in 0..10 {
            ops.push(mknod(top, format!("f{i}"), nums.next().unwrap()));
        }
        let sub = nums.next().unwrap();
        ops.push(FsOp::Mkdir {
            parent: top,
            name: b"sub".to_vec(),
            mode: 0o755,
            ino: Some(sub),
        });
        for i in 0..5 {
            ops.push(mknod(sub, format!("s{i}"), nums.next().unwrap()));
        }
        ops.push(FsOp::Rename {
            parent: root,
            name: b"top".to_vec(),
            new_parent: root,
            new_name: b"moved".to_vec(),
            flags: Default::default(),
        });
        for i in 10..20 {
            ops.push(mknod(top, format!("f{i}"), nums.next().unwrap()));
        }
        ops.push(FsOp::Mkdir {
            parent: sub,
            name: b"deeper".to_vec(),
            mode: 0o700,
            ino: Some(nums.next().unwrap()),
        });
        fs.apply_batch(&ops, &c).unwrap();
        let path: [&[u8]; 3] = [b"moved", b"sub", b"deeper"];
        let before = dir_attrs(&*fs, &path);
        assert_eq!(before[1].nlink, 3, "{kind:?}: moved holds one directory");
        assert_eq!(before[2].nlink, 3, "{kind:?}: sub holds one directory");

        // A batch that fails after creations in `sub`: its attributes stay.
        let mut bad = vec![mknod(sub, "late".into(), nums.next().unwrap())];
        bad.push(FsOp::Mkdir {
            parent: sub,
            name: b"d2".to_vec(),
            mode: 0o755,
            ino: Some(nums.next().unwrap()),
        });
        bad.push(mknod(sub, "s0".into(), nums.next().unwrap()));
        let e = fs.apply_batch(&bad, &c).unwrap_err();
        assert_eq!((e.index, &e.error), (2, &FsError::Exists), "{kind:?}");
        assert_eq!(
            dir_attrs(&*fs, &path),
            before,
            "{kind:?}: after the failed batch"
        );

        unmount(fs);
        let fs = mount(kind, dev.clone());
        assert_eq!(dir_attrs(&*fs, &path), before, "{kind:?}: after a remount");
        unmount(fs);
        modules::check(kind, &dev);
    }
}

#[test]
fn ext2_outside_the_journal_modes_refuses_batches() {
    let kind = Kind::Ext2(quilt_ext2::Mode::SoftUpdates);
    let fs = mount(kind, mkfs(kind));
    let ops = [FsOp::Mkdir {
        parent: fs.root(),
        name: b"d".to_vec(),
        mode: 0o755,
        ino: None,
    }];
    let e = fs.apply_batch(&ops, &Ctx::root()).unwrap_err();
    assert!(matches!(e.error, FsError::Invalid(_)), "{e}");
    assert_eq!(fs.lookup(fs.root(), b"d").unwrap_err(), FsError::NotFound);
}

/// Every crash state of the device history from the batch's start to the end: before
/// and after each flush, and at each mark, the blocks written since the last flush all
/// lost, all kept, every other block kept (either way), or the first half kept (a
/// request of many blocks is not atomic on a disk either).
fn crash_states(base: &[u8], log: &RecordingLog, from: usize) -> Vec<Arc<MemDevice>> {
    let mut out = Vec::new();
    // Right after each flush and mark, and right before each flush (its writes in
    // flight).
    let mut points = log.crash_points();
    points.extend(
        log.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, LogEntry::Flush))
            .map(|(i, _)| i),
    );
    points.sort_unstable();
    points.dedup();
    for p in points.into_iter().filter(|&p| p >= from) {
        let durable = log.durable_prefix(p);
        let in_flight = log.in_flight(p).len();
        let blocks_in_flight: usize = log.entries[durable..p]
            .iter()
            .map(|e| match e {
                LogEntry::Write { data, .. } => data.len() / 4096,
                _ => 0,
            })
            .sum();
        for pattern in 0..5 {
            if pattern > 0 && in_flight == 0 {
                break;
            }
            let img = Arc::new(MemDevice::from_bytes(4096, base).unwrap());
            let mut nth = 0usize;
            for (i, e) in log.entries[..p].iter().enumerate() {
                let LogEntry::Write { block, data, class } = e else {
                    continue;
                };
                for (k, b) in data.chunks(4096).enumerate() {
                    let keep = i < durable
                        || match pattern {
                            0 => false,
                            1 => true,
                            _ => {
                                nth += 1;
                                match pattern {
                                    2 => nth % 2 == 0,
                                    3 => nth % 2 == 1,
                                    // The first half (a sequential write cut short).
                                    _ => nth <= blocks_in_flight / 2,
                                }
                            }
                        };
                    if keep {
                        img.write(block + k as u64, b, *class).unwrap();
                    }
                }
            }
            eprintln!(
                "state p={p} durable={durable} in_flight={in_flight} pattern={pattern} nth={nth}"
            );
            out.push(img);
        }
    }
    out
}

const MANY: usize = 600;

fn many_name(i: usize) -> Vec<u8> {
    format!("directory-{i:04}-with-a-name-long-enough-to-fill-log-blocks").into_bytes()
}

#[test]
fn a_crash_keeps_a_batch_whole_or_not_at_all() {
    let c = Ctx::root();
    for kind in KINDS {
        let mem = mkfs(kind);
        let base = mem.to_vec();
        let rec = Arc::new(quilt_block::RecordingDevice::new(mem.clone(), 1 << 30));
        let fs = mount(kind, rec.clone());
        let root = fs.root();
        // Something before the batch, made durable, and something not.
        fs.mkdir(root, b"before", 0o755, &c).unwrap();
        fs.sync_all().unwrap();
        fs.mkdir(root, b"unsynced", 0o755, &c).unwrap();
        let grant: Vec<Ino> = fs.grant_inodes(16).unwrap().iter().collect();
        rec.mark("batch");
        // Large enough to span many log blocks (betrfs) and to pass the size at which
        // the journal would commit on its own (ext2), so that a batch kept apart
        // would show as half of one in some crash state.
        let mut ops = subtree(root, &grant, b"top");
        for i in 0..MANY {
            ops.push(FsOp::Mkdir {
                parent: grant[0],
                name: many_name(i),
                mode: 0o755,
                ino: None,
            });
        }
        fs.apply_batch(&ops, &c).unwrap();
        rec.mark("applied");
        // Durable first by the log alone (betrfs's sync also checkpoints, which would
        // hide a batch logged in pieces), then by everything.
        fs.fsync(grant[0], false).unwrap();
        rec.mark("fsynced");
        fs.sync_all().unwrap();
        drop(fs);
        let log = rec.log();
        let from = log.mark_position("batch").unwrap();
        let states = crash_states(&base, &log, from);
        assert!(states.len() >= 3, "{kind:?}: {} crash states", states.len());
        let (mut none, mut all) = (0, 0);
        for img in states {
            let fs = mount(kind, img);
            assert!(
                fs.lookup(root, b"before").is_ok(),
                "{kind:?}: synced before"
            );
            eprintln!(
                "{kind:?} top={:?}",
                fs.lookup(root, b"top").map(|d| names_in(&*fs, d.ino).len())
            );
            match fs.lookup(root, b"top") {
                Err(FsError::NotFound) => none += 1,
                Ok(d) => {
                    assert_eq!(d.ino, grant[0]);
                    let mut want = expected_names();
                    want.extend((0..MANY).map(many_name));
                    want.sort();
                    let got = names_in(&*fs, d.ino);
                    assert!(
                        got == want,
                        "{kind:?}: half a batch ({} of {} names)",
                        got.len(),
                        want.len()
                    );
                    all += 1;
                }
                Err(e) => panic!("{kind:?}: {e}"),
            }
        }
        // The history ends with the batch durable, and starts without it.
        assert!(
            all >= 1 && none >= 1,
            "{kind:?}: {none} without, {all} with"
        );
        let writes = log
            .entries
            .iter()
            .filter(|e| matches!(e, LogEntry::Write { .. }))
            .count();
        assert!(writes > 0);
    }
}

#[test]
fn ext2_refuses_a_batch_larger_than_one_transaction_and_goes_on() {
    let c = Ctx::root();
    let kind = Kind::Ext2(quilt_ext2::Mode::MetaJournal);
    let fs = mount(kind, mkfs(kind));
    let root = fs.root();
    let ops: Vec<FsOp> = (0..1500)
        .map(|i| FsOp::Mkdir {
            parent: root,
            name: format!("d{i}").into_bytes(),
            mode: 0o755,
            ino: None,
        })
        .collect();
    let e = fs.apply_batch(&ops, &c).unwrap_err();
    assert!(
        matches!(e.error, FsError::Invalid(m) if m.contains("journal")),
        "{e}"
    );
    assert_eq!(fs.lookup(root, b"d0").unwrap_err(), FsError::NotFound);
    // A smaller one goes through, and the file system goes on.
    fs.apply_batch(&ops[..100], &c).unwrap();
    assert!(fs.lookup(root, b"d99").is_ok());
    fs.mkdir(root, b"after", 0o755, &c).unwrap();
}

/// A device that, once armed, fails the second read of a chosen block: an ext2 batch's
/// trial mount reads the block once, so the live mount's read of it fails, as a disk
/// that went away between the trial and the real run would. Unarmed, it logs what is
/// read (to choose the block).
struct FailsRereads {
    inner: Arc<MemDevice>,
    armed: std::sync::atomic::AtomicBool,
    log: std::sync::Mutex<Vec<u64>>,
    target: std::sync::Mutex<std::collections::HashSet<u64>>,
    seen: std::sync::Mutex<std::collections::HashSet<u64>>,
}

impl BlockDevice for FailsRereads {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.log.lock().unwrap().push(block);
        if self.armed.load(std::sync::atomic::Ordering::SeqCst)
            && self.target.lock().unwrap().contains(&block)
            && !self.seen.lock().unwrap().insert(block)
        {
            return Err(quilt_block::BlockError::Unavailable {
                what: format!("block {block}"),
                why: "the test disk went away".into(),
            });
        }
        self.inner.read(block, buf)
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        quilt_block::read_each(self, first, buf)
    }
    fn write(
        &self,
        block: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        self.inner.write(block, buf, class)
    }
    fn write_blocks(
        &self,
        first: u64,
        buf: &[u8],
        class: quilt_block::WriteClass,
    ) -> quilt_block::Result<()> {
        quilt_block::write_each(self, first, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        self.inner.flush()
    }
    fn stats(&self) -> quilt_block::IoStats {
        self.inner.stats()
    }
    fn capabilities(&self) -> quilt_block::Capabilities<'_> {
        Default::default()
    }
}

/// ext2's last resort: an operation that fails for real after the batch passed its trial
/// (here a read error) aborts the journal. The error names the operation and keeps the
/// device's error as its cause; the mount takes no more changes; and the image, mounted
/// again, holds nothing of the batch (not even the operations before the failing one,
/// which had been applied in memory) and passes e2fsck.
#[test]
fn ext2_aborts_the_journal_when_a_batch_fails_after_its_trial() {
    let c = Ctx::root();
    for mode in [quilt_ext2::Mode::MetaJournal, quilt_ext2::Mode::FullJournal] {
        let kind = Kind::Ext2(mode);
        let inner = mkfs(kind);
        let fs = mount(kind, inner.clone());
        let d = fs.mkdir(fs.root(), b"d", 0o755, &c).unwrap();
        fs.mknod(d.ino, b"old", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        unmount(fs);

        let dev = Arc::new(FailsRereads {
            inner: inner.clone(),
            armed: false.into(),
            log: Default::default(),
            target: Default::default(),
            seen: Default::default(),
        });
        // The blocks a listing of `d` reads after its lookup: its directory block.
        let fs = mount(kind, dev.clone());
        let d = fs.lookup(fs.root(), b"d").unwrap().ino;
        dev.log.lock().unwrap().clear();
        assert_eq!(names_in(&*fs, d), vec![b"old".to_vec()]);
        let listed: Vec<u64> = std::mem::take(&mut *dev.log.lock().unwrap());
        assert!(!listed.is_empty(), "{mode:?}: listing d read nothing");
        dev.target.lock().unwrap().extend(listed);
        unmount(fs);

        // The batch's first operation needs only what is cached or fresh; its second
        // reads `d`'s block, which the trial read first.
        let fs = mount(kind, dev.clone());
        let root = fs.root();
        let d = fs.lookup(root, b"d").unwrap().ino;
        dev.armed.store(true, std::sync::atomic::Ordering::SeqCst);

        let ops = vec![
            FsOp::Mkdir {
                parent: root,
                name: b"newtop".to_vec(),
                mode: 0o755,
                ino: None,
            },
            FsOp::Mknod {
                parent: d,
                name: b"new".to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: None,
            },
        ];
        let e = fs.apply_batch(&ops, &c).unwrap_err();
        assert_eq!(e.index, 1, "{mode:?}: {e}");
        let FsError::Io(io) = &e.error else {
            panic!("{mode:?}: not an I/O error: {e}");
        };
        assert!(
            matches!(
                io.find::<quilt_block::BlockError>(),
                Some(quilt_block::BlockError::Unavailable { .. })
            ),
            "{mode:?}: the device's error is not kept as the cause: {io:?}"
        );
        assert!(
            fs.mkdir(root, b"after", 0o755, &c).is_err(),
            "{mode:?}: the mount went on taking changes after aborting its journal"
        );
        // Whatever commits now (a sync, the commit timer) must carry nothing of it.
        let _ = fs.sync_all();
        drop(fs);

        let fs = mount(kind, inner.clone());
        let root = fs.root();
        assert_eq!(
            fs.lookup(root, b"newtop").unwrap_err(),
            FsError::NotFound,
            "{mode:?}: the batch's first operation reached the disk"
        );
        assert_eq!(fs.lookup(root, b"after").unwrap_err(), FsError::NotFound);
        let d = fs.lookup(root, b"d").unwrap().ino;
        assert_eq!(names_in(&*fs, d), vec![b"old".to_vec()], "{mode:?}");
        unmount(fs);
        modules::check(kind, &inner);
    }
}
