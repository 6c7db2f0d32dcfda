//! Crash states of the journal modes, cut from a recording of the device: every prefix
//! ending at a flush or an fsync mark, plus subsets of the writes in flight after the
//! last flush (what a volatile disk cache may persist). For each state, our own replay
//! (mount, unmount) and e2fsck -fy's replay must both leave an image e2fsck -fn finds
//! clean, holding the same tree; and every file fsynced before the cut must be there
//! with its contents. Needs e2fsck (e2fsprogs); skipped without it unless
//! QUILT_REQUIRE_E2FSCK=1. `CI=true` samples the crash points.

mod support;

use quilt_block::{BlockDevice, BlockDeviceExt, MemDevice, RecordingDevice};
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FileType};
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

const BS: usize = 4096;
const BLOCKS: u64 = 8192;

fn e2fsck_available() -> bool {
    let ok = Command::new("e2fsck").arg("-V").output().is_ok();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_E2FSCK").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_E2FSCK=1 but e2fsck is missing"
        );
        eprintln!("SKIPPED: e2fsck is not installed");
    }
    ok
}

fn base_image() -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(BS, BLOCKS).unwrap());
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
    fs.create_journal(1024).unwrap();
    fs.unmount().unwrap();
    dev.to_vec()
}

fn open(dev: Arc<dyn BlockDevice>, mode: Mode, read_only: bool) -> Result<Ext2, String> {
    Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        MountOptions {
            journal: support::journals(),
            mode,
            read_only,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed) as u8)
        .collect()
}

/// The workload: directories, files of several sizes, renames, links, unlinks, and an
/// fsync after every few operations, each announced by a mark `fsync-K` placed after
/// it returns. Returns the fsynced files: mark name → (path, contents).
fn workload(fs: &Ext2, dev: &RecordingDevice) -> BTreeMap<String, (Vec<Vec<u8>>, Vec<u8>)> {
    let c = Ctx::root();
    let root = fs.root();
    let mut synced = BTreeMap::new();
    for r in 0..6u32 {
        let d = fs
            .mkdir(root, format!("d{r}").as_bytes(), 0o755, &c)
            .unwrap()
            .ino;
        for i in 0..12u32 {
            let name = format!("f{i}");
            let f = fs
                .mknod(d, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c)
                .unwrap()
                .ino;
            let data = pattern(r * 100 + i, (i as usize * 3001) % 40000 + 1);
            fs.write(f, 0, &data, &c).unwrap();
            if i % 5 == 4 {
                fs.fsync(f, false).unwrap();
                let k = format!("fsync-{r}-{i}");
                dev.mark(&k);
                synced.insert(
                    k,
                    (vec![format!("d{r}").into_bytes(), name.into_bytes()], data),
                );
            }
        }
        fs.link(
            fs.lookup(d, b"f1").unwrap().ino,
            root,
            format!("link{r}").as_bytes(),
            &c,
        )
        .unwrap();
        fs.rename(
            d,
            b"f2",
            root,
            format!("moved{r}").as_bytes(),
            Default::default(),
            &c,
        )
        .unwrap();
        fs.unlink(d, b"f3", &c).unwrap();
        if r >= 2 {
            let old = format!("d{}", r - 2);
            let od = fs.lookup(root, old.as_bytes()).unwrap().ino;
            let mut names = Vec::new();
            fs.readdir(od, 0, &mut |e| {
                if e.name != b"." && e.name != b".." {
                    names.push(e.name);
                }
                true
            })
            .unwrap();
            for n in names {
                fs.unlink(od, &n, &c).unwrap();
            }
            fs.rmdir(root, old.as_bytes(), &c).unwrap();
            // Files fsynced in a removed directory are no longer promised.
            synced.retain(|_, (p, _)| p[0] != old.as_bytes());
        }
    }
    synced
}

/// Every name in the tree with its kind, size, link count and contents.
fn tree(fs: &Ext2) -> BTreeMap<String, (FileType, u64, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(fs.root(), String::new())];
    while let Some((d, path)) = stack.pop() {
        let mut entries = Vec::new();
        fs.readdir(d, 0, &mut |e| {
            if e.name != b"." && e.name != b".." && e.name != b"lost+found" {
                entries.push(e);
            }
            true
        })
        .unwrap();
        for e in entries {
            let p = format!("{path}/{}", String::from_utf8_lossy(&e.name));
            let a = fs.getattr(e.ino).unwrap();
            let data = if a.kind == FileType::Regular {
                fs.read(e.ino, 0, a.size as u32).unwrap()
            } else {
                Vec::new()
            };
            if a.kind == FileType::Directory {
                stack.push((e.ino, p.clone()));
            }
            out.insert(p, (a.kind, a.size, a.nlink, data));
        }
    }
    out
}

fn e2fsck(img: &[u8], args: &[&str]) -> (i32, String, Vec<u8>) {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), img).unwrap();
    let o = Command::new("e2fsck")
        .args(args)
        .arg(f.path())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    (
        o.status.code().unwrap_or(-1),
        text,
        std::fs::read(f.path()).unwrap(),
    )
}

fn check_state(
    label: &str,
    img: Vec<u8>,
    synced: &[(Vec<Vec<u8>>, Vec<u8>)],
) -> Result<(), String> {
    // Ours: mount (replays), unmount.
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).unwrap());
    let fs =
        open(dev.clone(), Mode::Async, false).map_err(|e| format!("{label}: our mount: {e}"))?;
    fs.unmount()
        .map_err(|e| format!("{label}: our unmount: {e}"))?;
    drop(fs);
    let ours = dev.to_vec();
    let (rc, text, _) = e2fsck(&ours, &["-fn"]);
    if rc != 0 {
        return Err(format!(
            "{label}: after our replay e2fsck -fn says:\n{text}"
        ));
    }
    // e2fsck's replay.
    let (rc, text, theirs) = e2fsck(&img, &["-fy"]);
    if rc > 1 {
        return Err(format!("{label}: e2fsck -fy exit {rc}:\n{text}"));
    }
    let (rc, text, _) = e2fsck(&theirs, &["-fn"]);
    if rc != 0 {
        return Err(format!(
            "{label}: after e2fsck's replay e2fsck -fn says:\n{text}"
        ));
    }
    let a = open(
        Arc::new(MemDevice::from_bytes(BS, &ours).unwrap()),
        Mode::Async,
        true,
    )
    .map_err(|e| format!("{label}: {e}"))?;
    let b = open(
        Arc::new(MemDevice::from_bytes(BS, &theirs).unwrap()),
        Mode::Async,
        true,
    )
    .map_err(|e| format!("{label}: {e}"))?;
    let (ta, tb) = (tree(&a), tree(&b));
    if ta != tb {
        let only_a: Vec<_> = ta.keys().filter(|k| tb.get(*k) != ta.get(*k)).collect();
        let only_b: Vec<_> = tb.keys().filter(|k| ta.get(*k) != tb.get(*k)).collect();
        return Err(format!(
            "{label}: our replay and e2fsck's differ: ours {only_a:?}, theirs {only_b:?}"
        ));
    }
    for (path, data) in synced {
        let mut ino = a.root();
        for c in path {
            ino = a
                .lookup(ino, c)
                .map_err(|e| format!("{label}: fsynced {path:?} is missing: {e}"))?
                .ino;
        }
        let got = a.read(ino, 0, data.len() as u32 + 1).unwrap();
        if &got != data {
            return Err(format!("{label}: fsynced {path:?} has other contents"));
        }
    }
    Ok(())
}

fn crash_states(mode: Mode) {
    // The recording starts before the mount, so the mount's own writes (needs_recovery,
    // the journal superblock) are part of every crash state.
    let base0 = base_image_cached();
    let mem = Arc::new(MemDevice::from_bytes(BS, &base0).unwrap());
    let rec = Arc::new(RecordingDevice::new(mem, 1 << 30));
    let fs = open(rec.clone(), mode, false).unwrap();
    let synced = workload(&fs, &rec);
    let log = rec.take_log();
    // A crash: no unmount. (Its threads keep writing to the now unrecorded device.)
    std::mem::forget(fs);
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    // After every flush and mark, and also just before every flush: there all the
    // writes since the previous flush are in flight, and subsets of them are explored.
    let mut points = log.crash_points();
    points.extend(
        log.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, quilt_block::LogEntry::Flush))
            .map(|(i, _)| i),
    );
    points.sort_unstable();
    points.dedup();
    let step = if ci { (points.len() / 25).max(1) } else { 1 };
    let mut checked = 0;
    for (n, &len) in points.iter().enumerate() {
        if n % step != 0 && n + 1 != points.len() {
            continue;
        }
        let promised: Vec<_> = synced
            .iter()
            .filter(|(k, _)| log.mark_position(k).is_some_and(|p| p <= len))
            .map(|(_, v)| v.clone())
            .collect();
        let in_flight = log.in_flight(len);
        // All in-flight writes, none, and every other one.
        let subsets: Vec<Box<dyn Fn(usize) -> bool>> = if in_flight.is_empty() {
            vec![Box::new(|_| true)]
        } else {
            let first = in_flight[0];
            let last = *in_flight.last().expect("not empty");
            vec![
                Box::new(|_| true),
                Box::new(|_| false),
                Box::new(|i| i % 2 == 0),
                // The last write lost (a commit block, often), or only the first kept.
                Box::new(move |i| i != last),
                Box::new(move |i| i == first),
            ]
        };
        for (s, keep) in subsets.iter().enumerate() {
            let dev = MemDevice::from_bytes(BS, &base0).unwrap();
            log.replay_subset(len, &dev, keep).unwrap();
            let label = format!("{mode}: crash at {len}/{} (subset {s})", log.entries.len());
            if let Err(e) = check_state(&label, dev.to_vec(), &promised) {
                panic!("{e}");
            }
            checked += 1;
        }
    }
    eprintln!(
        "{mode}: {checked} crash states checked ({} crash points)",
        points.len()
    );
    assert!(checked > 10);
}

fn base_image_cached() -> Vec<u8> {
    static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BASE.get_or_init(base_image).clone()
}

#[test]
fn meta_journal_crash_states_recover_like_e2fsck() {
    if e2fsck_available() {
        crash_states(Mode::MetaJournal);
    }
}

#[test]
fn full_journal_crash_states_recover_like_e2fsck() {
    if e2fsck_available() {
        crash_states(Mode::FullJournal);
    }
}

/// A transaction never ends in the middle of an operation: one thread commits over and
/// over (as the journal's timer does every 5 s) while another renames, links and
/// creates across directories. Every crash state at a flush must then recover to an
/// image e2fsck finds clean: a commit that split a rename between adding the new entry
/// and removing the old one would leave a state with both names and a link count one
/// too low.
#[test]
fn commits_from_another_thread_never_split_an_operation() {
    if !e2fsck_available() {
        return;
    }
    let base0 = base_image_cached();
    let mem = Arc::new(MemDevice::from_bytes(BS, &base0).unwrap());
    let rec = Arc::new(RecordingDevice::new(mem, 1 << 30));
    let fs = open(rec.clone(), Mode::MetaJournal, false).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let commits = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                fs.services().sync().unwrap();
                commits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let c = Ctx::root();
        let root = fs.root();
        let a = fs.mkdir(root, b"a", 0o755, &c).unwrap().ino;
        let b = fs.mkdir(root, b"b", 0o755, &c).unwrap().ino;
        for i in 0..150u32 {
            if i % 5 == 0 {
                // Let the committer get a commit in before going on: on a loaded
                // machine it could otherwise miss most of the workload.
                let seen = commits.load(std::sync::atomic::Ordering::SeqCst);
                while commits.load(std::sync::atomic::Ordering::SeqCst) == seen {
                    std::thread::yield_now();
                }
            }
            let name = format!("f{i}");
            let f = fs
                .mknod(a, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c)
                .unwrap()
                .ino;
            fs.write(f, 0, &pattern(i, 5000), &c).unwrap();
            fs.link(f, b, format!("l{i}").as_bytes(), &c).unwrap();
            fs.rename(
                a,
                name.as_bytes(),
                b,
                name.as_bytes(),
                Default::default(),
                &c,
            )
            .unwrap();
            let d = fs
                .mkdir(b, format!("d{i}").as_bytes(), 0o755, &c)
                .unwrap()
                .ino;
            fs.rename(
                b,
                format!("d{i}").as_bytes(),
                a,
                b"sub",
                Default::default(),
                &c,
            )
            .unwrap();
            if i % 3 == 0 {
                fs.rmdir(a, b"sub", &c).unwrap();
            }
            let _ = d;
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    fs.services().sync().unwrap();
    let log = rec.take_log();
    std::mem::forget(fs);
    let points: Vec<usize> = log
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, quilt_block::LogEntry::Flush))
        .map(|(i, _)| i + 1)
        .collect();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let want = if ci { 30 } else { 120 };
    let step = (points.len() / want).max(1);
    let mut checked = 0;
    for (n, &len) in points.iter().enumerate() {
        if n % step != 0 {
            continue;
        }
        let dev = MemDevice::from_bytes(BS, &base0).unwrap();
        log.replay_subset(len, &dev, |_| true).unwrap();
        let label = format!("crash after flush at {len}/{}", log.entries.len());
        if let Err(e) = check_state(&label, dev.to_vec(), &[]) {
            panic!("{e}");
        }
        checked += 1;
    }
    let commits = commits.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("{commits} commits raced the operations; {checked} crash states checked");
    assert!(
        commits > 20,
        "the committer must have run during the workload"
    );
    assert!(checked > 10);
}
