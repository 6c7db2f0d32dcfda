//! Patchgroups through a real FUSE mount, checked against the device underneath: what
//! is on the device is what a crash would leave. Skipped without root and /dev/fuse
//! unless QUILT_REQUIRE_FUSE=1.

use quilt_block::{BlockDevice, MemDevice, RecordingDevice};
use quilt_ext2::{Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::EngineOptions;
use quilt_pg::{Control, Group};
use quilt_vfs::FileSystem;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fuse_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let ok = unsafe { libc::geteuid() } == 0 && Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_FUSE").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_FUSE=1 but this process cannot mount FUSE (needs root and /dev/fuse)"
        );
        eprintln!("SKIPPED: needs root and /dev/fuse");
    }
    ok
}

struct Mounted {
    dev: Arc<MemDevice>,
    rec: Arc<RecordingDevice>,
    base: Vec<u8>,
    dir: tempfile::TempDir,
    _session: quilt_fuse::BackgroundSession,
}

impl Mounted {
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
    /// The file system as a crash now would leave it: a copy of the device, mounted
    /// on its own (read-write, so a journal is replayed as after a crash).
    fn on_disk(&self) -> Ext2 {
        after_crash(MemDevice::from_bytes(4096, &self.dev.to_vec()).unwrap())
    }
}

/// Mounts `img` as after a crash: read-write, so a journal is replayed.
fn after_crash(img: MemDevice) -> Ext2 {
    quilt_stack::ext2(
        Arc::new(img),
        quilt_stack::Ext2Spec::mount(MountOptions {
            mode: Mode::Async,
            read_only: false,
            ..Default::default()
        }),
    )
    .unwrap()
}

/// A fresh file system mounted with the kernel's writeback cache off, so every write
/// reaches the server from the writing process (and no background write-back runs:
/// only fsync, sync and patchgroup sync write to the device).
fn mount(mode: Mode) -> Mounted {
    let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
    let (engine, _) = quilt_stack::mkfs_ext2(
        dev.clone(),
        EngineOptions::default(),
        &MkfsOptions {
            device_is_zeroed: true,
            ..Default::default()
        },
    )
    .unwrap();
    if mode.is_journal() {
        quilt_stack::add_journal(engine, 1024, false).unwrap();
    } else {
        drop(engine);
    }
    let base = dev.to_vec();
    let rec = Arc::new(RecordingDevice::new(dev.clone(), 1 << 30));
    let fs = Arc::new(
        quilt_stack::ext2(
            rec.clone(),
            quilt_stack::Ext2Spec::mount(MountOptions {
                mode,
                read_only: false,
                ..Default::default()
            }),
        )
        .unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let opts = quilt_fuse::FuseOptions {
        writeback_cache: false,
        ..Default::default()
    };
    let s = quilt_fuse::spawn(fs, dir.path(), &opts, Box::new(|| {})).unwrap();
    Mounted {
        dev,
        rec,
        base,
        dir,
        _session: s,
    }
}

fn exists(fs: &Ext2, name: &str) -> bool {
    fs.lookup(fs.root(), name.as_bytes()).is_ok()
}

fn content(fs: &Ext2, name: &str) -> Option<Vec<u8>> {
    let a = fs.lookup(fs.root(), name.as_bytes()).ok()?;
    fs.read(a.ino, 0, a.size as u32).ok()
}

#[test]
fn every_rule_violation_is_a_clear_error() {
    if !fuse_available() {
        return;
    }
    let m = mount(Mode::SoftUpdates);
    let c = Control::open(m.dir.path()).unwrap();
    let p = c.create().unwrap();
    let q = c.create().unwrap();
    let e = c.engage(p).unwrap_err();
    assert_eq!(e.errno, libc::EINVAL);
    assert!(
        e.message.contains("must be released before it is engaged"),
        "{e}"
    );
    assert!(c
        .depend(p, p)
        .unwrap_err()
        .message
        .contains("cannot depend on itself"));
    c.release(p).unwrap();
    assert!(c
        .release(p)
        .unwrap_err()
        .message
        .contains("already released"));
    assert!(c.depend(p, q).unwrap_err().message.contains("is released"));
    c.engage(p).unwrap();
    assert_eq!(c.engage(p).unwrap_err().errno, libc::EEXIST);
    let e = c.depend(q, p).unwrap_err();
    assert_eq!(e.errno, libc::EBUSY);
    assert!(e.message.contains("is engaged"), "{e}");
    c.disengage(p).unwrap();
    assert!(c
        .disengage(p)
        .unwrap_err()
        .message
        .contains("is not engaged"));
    c.depend(q, p).unwrap();
    assert!(c
        .engage(p)
        .unwrap_err()
        .message
        .contains("cannot be engaged again"));
    let e = c.sync(Group(999)).unwrap_err();
    assert_eq!(e.errno, libc::ENOENT);
    assert!(e.message.contains("does not exist"), "{e}");
    c.abandon(p).unwrap();
    c.abandon(q).unwrap();
    // The control file is not a place for data, and its name is taken.
    assert!(std::fs::write(m.path(".quiltfs-control"), b"x").is_err());
    assert_eq!(
        std::fs::create_dir(m.path(".quiltfs-control"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EEXIST)
    );
    let listed: Vec<_> = std::fs::read_dir(m.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        !listed.iter().any(|n| n == ".quiltfs-control"),
        "{listed:?}"
    );
    // Ioctls on other files are not patchgroup calls.
    std::fs::write(m.path("plain"), b"x").unwrap();
    let other = Control::from_file(std::fs::File::open(m.path("plain")).unwrap());
    assert_eq!(other.create().unwrap_err().errno, libc::ENOTTY);
    let e = Control::open(std::env::temp_dir()).unwrap_err();
    assert!(e.message.contains("is a quiltfs mounted"), "{e}");
}

/// Group Q after group P: Q's rename never reaches the device before P's data, even
/// though P's data is much larger and was written first; the sync of Q brings both.
#[test]
fn a_group_reaches_the_disk_only_after_the_groups_before_it() {
    if !fuse_available() {
        return;
    }
    for mode in [Mode::SoftUpdates, Mode::MetaJournal, Mode::FullJournal] {
        let m = mount(mode);
        let c = Control::open(m.dir.path()).unwrap();
        let p = c.create().unwrap();
        c.release(p).unwrap();
        c.engage(p).unwrap();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
        std::fs::write(m.path("data.tmp"), &big).unwrap();
        c.disengage(p).unwrap();
        let q = c.create_after(p).unwrap();
        c.engage(q).unwrap();
        std::fs::rename(m.path("data.tmp"), m.path("data")).unwrap();
        c.disengage(q).unwrap();
        // Nothing was synced: the device holds neither change yet.
        let before = m.on_disk();
        assert!(
            !exists(&before, "data") && !exists(&before, "data.tmp"),
            "{mode}"
        );
        c.sync(q).unwrap();
        let after = m.on_disk();
        assert_eq!(content(&after, "data").as_deref(), Some(&big[..]), "{mode}");
        renamed_only_after_data(&m, mode, &big);
        c.abandon(p).unwrap();
        c.abandon(q).unwrap();
    }
}

/// Every crash state of the recorded writes (each prefix at a flush, and subsets of the
/// writes in flight before each flush): `/data` never names anything but `big` whole.
fn renamed_only_after_data(m: &Mounted, mode: Mode, big: &[u8]) {
    let log = m.rec.take_log();
    let states =
        quilt_crashtest::states::generate(&log, &mut quilt_crashtest::workload::Rng::new(1));
    assert!(states.len() > 3, "{mode}: {} states", states.len());
    for s in &states {
        let img = MemDevice::from_bytes(4096, &m.base).unwrap();
        log.replay_subset(s.len, &img, |i| s.keeps(i)).unwrap();
        let fs = after_crash(img);
        if let Some(got) = content(&fs, "data") {
            assert!(
                got == big,
                "{mode}: at {s:?} /data has {} bytes of the {}",
                got.len(),
                big.len()
            );
        }
    }
}

/// `next` (one call at each fsync of the LD_PRELOAD library) orders as the five calls
/// it replaces: the group it engages reaches the disk only after the one it ended.
#[test]
fn next_ends_a_group_and_engages_one_after_it() {
    if !fuse_available() {
        return;
    }
    for mode in [Mode::SoftUpdates, Mode::FullJournal] {
        let m = mount(mode);
        let c = Control::open(m.dir.path()).unwrap();
        let p = c.create().unwrap();
        c.release(p).unwrap();
        c.engage(p).unwrap();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 5 + 1) as u8).collect();
        std::fs::write(m.path("data.tmp"), &big).unwrap();
        let q = c.next(p, true).unwrap();
        assert_ne!(q, p);
        std::fs::rename(m.path("data.tmp"), m.path("data")).unwrap();
        let before = m.on_disk();
        assert!(
            !exists(&before, "data") && !exists(&before, "data.tmp"),
            "{mode}"
        );
        // p's handle went with the call; q is engaged (it cannot be engaged twice).
        assert!(c.abandon(p).is_err(), "{mode}: p was abandoned by next");
        assert!(c.engage(q).is_err(), "{mode}: q is engaged already");
        // Ending a group this process has not engaged fails and changes nothing.
        let e = c.next(p, false).unwrap_err();
        assert!(e.errno != 0, "{mode}");
        c.disengage(q).unwrap();
        c.sync(q).unwrap();
        assert_eq!(
            content(&m.on_disk(), "data").as_deref(),
            Some(&big[..]),
            "{mode}"
        );
        renamed_only_after_data(&m, mode, &big);
        c.abandon(q).unwrap();
    }
}

/// The helper process the next tests start: it creates and engages a group, writes a
/// file inside it, and exits without cleaning up (or sleeps, when asked to).
#[test]
fn helper_process() {
    let Ok(mount) = std::env::var("QUILT_PG_HELPER_MOUNT") else {
        return;
    };
    let c = Control::open(&mount).unwrap();
    let g = c.create().unwrap();
    c.release(g).unwrap();
    c.engage(g).unwrap();
    println!("GROUP {}", g.0);
    std::fs::write(Path::new(&mount).join("from-helper"), b"helper").unwrap();
}

fn run_helper(mount: &Path) -> u64 {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("QUILT_PG_HELPER_MOUNT", mount)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.split("GROUP ").nth(1))
        .and_then(|g| g.trim().parse().ok())
        .unwrap_or_else(|| panic!("no group in: {text}"))
}

#[test]
fn the_groups_of_an_exited_process_are_abandoned() {
    if !fuse_available() {
        return;
    }
    let m = mount(Mode::SoftUpdates);
    let c = Control::open(m.dir.path()).unwrap();
    let g = Group(run_helper(m.dir.path()));
    // The helper's group outlives it only until the server notices the exit.
    let t0 = Instant::now();
    loop {
        match c.sync(g) {
            Err(e) if e.errno == libc::ENOENT => break,
            _ if t0.elapsed() > Duration::from_secs(10) => {
                panic!("the exited helper's {g} was never abandoned")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    // Its change keeps its place: a sync makes it durable.
    std::process::Command::new("sync")
        .arg("-f")
        .arg(m.path("from-helper"))
        .status()
        .unwrap();
    assert_eq!(
        content(&m.on_disk(), "from-helper").as_deref(),
        Some(&b"helper"[..])
    );
}

#[test]
fn a_child_process_starts_inside_its_parents_group() {
    if !fuse_available() {
        return;
    }
    let m = mount(Mode::SoftUpdates);
    let c = Control::open(m.dir.path()).unwrap();
    let mine = c.create().unwrap();
    c.release(mine).unwrap();
    c.engage(mine).unwrap();
    run_helper(m.dir.path());
    c.disengage(mine).unwrap();
    // The helper's write joined our group as well as its own: syncing ours writes it.
    assert!(!exists(&m.on_disk(), "from-helper"));
    c.sync(mine).unwrap();
    assert_eq!(
        content(&m.on_disk(), "from-helper").as_deref(),
        Some(&b"helper"[..])
    );
    let _ = m.dev.stats();
}
