//! Running out of space in the middle of every allocating operation leaves nothing
//! behind: a workload that allocates in every way the module does (data blocks behind
//! single and double indirect blocks by write and fallocate, directory growth, an
//! extended-attribute block, a slow symlink's block, a default ACL's block, an
//! O_TMPFILE file linked in) runs on images left with exactly N free blocks, for every
//! N from none to what it needs. Every call that fails must fail with ENOSPC and leave
//! the file's size as it was, and e2fsck -fn (which shares no code with us) must find
//! the image clean: no block marked used that nothing references, no count off.
//! A stress run then mixes writes, fallocate, punched holes and truncates on a nearly
//! full image, for many seeds, checking every file's contents against a model.
//! Needs e2fsck (skipped without it unless QUILT_REQUIRE_E2FSCK=1).

mod support;

use quilt_block::MemDevice;
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FsError, SetAttr, XattrFlags};
use std::process::Command;
use std::sync::Arc;

const REG: u32 = libc::S_IFREG | 0o644;
/// 1 KiB blocks (256 pointers per map block: the double indirect level starts at
/// logical block 268), one group.
const BS: usize = 1024;
const BLOCKS: u64 = 2048;
const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;

fn have_e2fsck() -> bool {
    let ok = Command::new("e2fsck").arg("-V").output().is_ok();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_E2FSCK").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_E2FSCK=1 but e2fsck is missing"
        );
        eprintln!("skipped: e2fsck not installed");
    }
    ok
}

fn open(dev: Arc<MemDevice>, mode: Mode) -> Ext2 {
    Ext2::open(
        Engine::new(dev, EngineOptions::default()),
        MountOptions {
            journal: support::journals(),
            mode,
            ..Default::default()
        },
    )
    .unwrap()
}

fn fresh(mode: Mode) -> Arc<MemDevice> {
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
    if matches!(mode, Mode::MetaJournal | Mode::FullJournal) {
        let fs = open(dev.clone(), Mode::SoftUpdates);
        fs.create_journal(1024).unwrap();
        fs.unmount().unwrap();
    }
    dev
}

/// e2fsck -fn on the device's image: clean, or the test fails with its report.
fn e2fsck_clean(dev: &MemDevice, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enospc.img");
    std::fs::write(&img, dev.to_vec()).unwrap();
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: e2fsck -fn:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_blocks(fs: &Ext2) -> u64 {
    fs.statfs().unwrap().blocks_free
}

/// An image whose file `filler` leaves exactly `n` blocks free (for root), unmounted.
fn with_free(base: &[u8], mode: Mode, n: u64) -> Option<Arc<MemDevice>> {
    let dev = Arc::new(MemDevice::from_bytes(BS, base).unwrap());
    let fs = open(dev.clone(), mode);
    let root = Ctx::root();
    let f = fs.lookup(fs.root(), b"filler").unwrap().ino;
    let mut size = fs.getattr(f).unwrap().size;
    while free_blocks(&fs) < n && size > 0 {
        size = size.saturating_sub(BS as u64);
        fs.setattr(
            f,
            SetAttr {
                size: Some(size),
                ..Default::default()
            },
            &root,
        )
        .unwrap();
    }
    let ok = free_blocks(&fs) == n;
    fs.unmount().unwrap();
    ok.then_some(dev)
}

/// The image full: `filler` takes every block root may use.
fn full_base(mode: Mode) -> Vec<u8> {
    let dev = fresh(mode);
    let fs = open(dev.clone(), mode);
    let root = Ctx::root();
    let f = fs.mknod(fs.root(), b"filler", REG, 0, &root).unwrap().ino;
    let chunk = vec![0x5a; 16 * BS];
    let mut off = 0;
    loop {
        match fs.write(f, off, &chunk, &root) {
            Ok(n) => off += n as u64,
            Err(FsError::NoSpace) => break,
            Err(e) => panic!("filling: {e:?}"),
        }
    }
    assert_eq!(free_blocks(&fs), 0);
    fs.unmount().unwrap();
    dev.to_vec()
}

/// One step of the workload: Ok, or ENOSPC with the sizes it names unchanged. Counts
/// the calls that failed.
fn step(
    fs: &Ext2,
    what: &str,
    sized: &[u64],
    failed: &mut u32,
    f: impl FnOnce() -> Result<(), FsError>,
) {
    let before: Vec<u64> = sized.iter().map(|&i| fs.getattr(i).unwrap().size).collect();
    match f() {
        Ok(()) => {}
        Err(FsError::NoSpace) => {
            *failed += 1;
            let after: Vec<u64> = sized.iter().map(|&i| fs.getattr(i).unwrap().size).collect();
            assert_eq!(
                before, after,
                "{what}: a call that failed with ENOSPC changed a size"
            );
        }
        Err(e) => panic!("{what}: {e:?}, not ENOSPC"),
    }
}

/// Every allocating operation once. Returns how many calls ran out of space.
fn workload(fs: &Ext2) -> u32 {
    let c = Ctx::root();
    let r = fs.root();
    let bs = BS as u64;
    let mut failed = 0;
    let Ok(a) = fs.mknod(r, b"a", REG, 0, &c).map(|a| a.ino) else {
        return 1; // (no inode needs a block: this cannot run out; counted if it did)
    };
    step(
        fs,
        "write behind the first indirect block",
        &[a],
        &mut failed,
        || fs.write(a, 12 * bs, &[1; 10], &c).map(|_| ()),
    );
    step(
        fs,
        "write across indirect blocks",
        &[a],
        &mut failed,
        || fs.write(a, 266 * bs, &vec![2; 4 * BS], &c).map(|_| ()),
    );
    let b = fs.mknod(r, b"b", REG, 0, &c).unwrap().ino;
    step(
        fs,
        "fallocate into the double indirect level",
        &[b],
        &mut failed,
        || fs.fallocate(b, 265 * bs, 6 * bs, 0, &c),
    );
    step(
        fs,
        "fallocate behind the first indirect block",
        &[b],
        &mut failed,
        || fs.fallocate(b, 12 * bs, 2 * bs, 0, &c),
    );
    // (Only inside the file: past it ext2 has no way to keep blocks, as the module
    // answers; the calls above may have failed to make the file that long.)
    if fs.getattr(b).unwrap().size >= 103 * bs {
        step(
            fs,
            "fallocate KEEP_SIZE inside the file",
            &[b],
            &mut failed,
            || fs.fallocate(b, 100 * bs, 3 * bs, KEEP_SIZE, &c),
        );
    }
    step(fs, "punch", &[b], &mut failed, || {
        fs.fallocate(b, 266 * bs, 2 * bs, PUNCH | KEEP_SIZE, &c)
    });
    step(fs, "extended attribute block", &[a], &mut failed, || {
        fs.setxattr(a, b"user.big", &[7; 600], XattrFlags::default(), &c)
    });
    step(fs, "slow symlink", &[], &mut failed, || {
        fs.symlink(r, b"link", &[b'x'; 200], &c).map(|_| ())
    });
    match fs.mkdir(r, b"d", 0o755, &c) {
        Ok(d) => {
            for i in 0..60 {
                let name = format!("entry-with-a-long-name-{i:04}-{}", "n".repeat(20));
                step(fs, "directory growth", &[d.ino], &mut failed, || {
                    fs.mknod(d.ino, name.as_bytes(), REG, 0, &c).map(|_| ())
                });
            }
        }
        Err(FsError::NoSpace) => failed += 1,
        Err(e) => panic!("mkdir: {e:?}"),
    }
    match fs.mkdir(r, b"acl", 0o755, &c) {
        Ok(d) => {
            use quilt_vfs::acl::{Acl, Entry, GROUP_OBJ, MASK, OTHER, USER, USER_OBJ};
            let e = |tag, perm, id| Entry { tag, perm, id };
            let acl = Acl::new(vec![
                e(USER_OBJ, 7, 0),
                e(USER, 7, 1000),
                e(GROUP_OBJ, 5, 0),
                e(MASK, 7, 0),
                e(OTHER, 5, 0),
            ])
            .unwrap()
            .to_xattr();
            step(fs, "default ACL", &[], &mut failed, || {
                fs.setxattr(
                    d.ino,
                    quilt_vfs::acl::DEFAULT,
                    &acl,
                    XattrFlags::default(),
                    &c,
                )
            });
            step(fs, "create under a default ACL", &[], &mut failed, || {
                fs.mknod(d.ino, b"inherits", REG, 0, &c).map(|_| ())
            });
        }
        Err(FsError::NoSpace) => failed += 1,
        Err(e) => panic!("mkdir: {e:?}"),
    }
    step(fs, "O_TMPFILE written and linked", &[], &mut failed, || {
        let t = fs.tmpfile(r, REG, &c)?;
        fs.write(t.ino, 20 * bs, &[3; 100], &c)?;
        fs.link(t.ino, r, b"was-tmp", &c).map(|_| ())
    });
    step(fs, "truncate up (sparse)", &[a], &mut failed, || {
        fs.setattr(
            a,
            SetAttr {
                size: Some(400 * bs),
                ..Default::default()
            },
            &c,
        )
        .map(|_| ())
    });
    failed
}

#[test]
fn enospc_at_every_block_of_a_workload_leaves_a_clean_image() {
    if !have_e2fsck() {
        return;
    }
    for mode in [Mode::SoftUpdates, Mode::Async, Mode::MetaJournal] {
        let base = full_base(mode);
        // What the workload takes with room to spare: N runs up to a little past it.
        let roomy = with_free(&base, mode, 300).expect("300 blocks free");
        let fs = open(roomy.clone(), mode);
        let before = free_blocks(&fs);
        assert_eq!(
            workload(&fs),
            0,
            "{mode:?}: the workload failed with room to spare"
        );
        let needs = before - free_blocks(&fs);
        fs.unmount().unwrap();
        e2fsck_clean(&roomy, &format!("{mode:?}, room to spare"));
        let mut tried = 0;
        for n in 0..=needs + 2 {
            let Some(dev) = with_free(&base, mode, n) else {
                continue; // (freeing one more block freed a map block too)
            };
            tried += 1;
            let fs = open(dev.clone(), mode);
            let failed = workload(&fs);
            assert!(
                n >= needs || failed > 0,
                "{mode:?}, {n} free: nothing ran out"
            );
            fs.unmount().unwrap();
            e2fsck_clean(&dev, &format!("{mode:?}, {n} blocks free"));
        }
        assert!(
            tried as u64 > needs / 2,
            "{mode:?}: only {tried} of {needs} cuts reached"
        );
    }
}

/// A seeded stream (ChaCha8): the stress run's seeds reproduce.
struct Rng(rand_chacha::ChaCha8Rng);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(rand::SeedableRng::seed_from_u64(seed))
    }
    fn next(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seeds() -> u64 {
    if let Ok(n) = std::env::var("QUILT_ENOSPC_SEEDS") {
        return n.parse().expect("QUILT_ENOSPC_SEEDS must be a number");
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        40
    } else {
        300
    }
}

#[test]
fn writes_fallocate_punch_and_truncate_on_a_nearly_full_image_keep_it_clean() {
    if !have_e2fsck() {
        return;
    }
    let base = full_base(Mode::SoftUpdates);
    let bs = BS as u64;
    for seed in 0..seeds() {
        let mut rng = Rng::new(seed);
        let free = 20 + rng.below(60);
        let Some(dev) = with_free(&base, Mode::SoftUpdates, free) else {
            continue;
        };
        let fs = open(dev.clone(), Mode::SoftUpdates);
        let c = Ctx::root();
        let files: Vec<u64> = (0..3)
            .map(|i| {
                fs.mknod(fs.root(), format!("s{i}").as_bytes(), REG, 0, &c)
                    .unwrap()
                    .ino
            })
            .collect();
        let mut model: Vec<Vec<u8>> = vec![Vec::new(); files.len()];
        for step in 0..150 {
            let k = rng.below(files.len() as u64) as usize;
            let ino = files[k];
            // Offsets up to past the double indirect level's start.
            let off = rng.below(300) * bs + rng.below(bs);
            let len = 1 + rng.below(6 * bs);
            let what = rng.below(4);
            let m = &mut model[k];
            match what {
                0 => {
                    let byte = (step % 250) as u8 + 1;
                    match fs.write(ino, off, &vec![byte; len as usize], &c) {
                        Ok(n) => {
                            let end = (off + n as u64) as usize;
                            if m.len() < end {
                                m.resize(end, 0);
                            }
                            m[off as usize..end].fill(byte);
                        }
                        Err(FsError::NoSpace) => {}
                        Err(e) => panic!("seed {seed} step {step}: write: {e:?}"),
                    }
                }
                1 => match fs.fallocate(ino, off, len, 0, &c) {
                    // Allocated blocks read as zeros; a call that fails leaves nothing.
                    Ok(()) => m.resize(m.len().max((off + len) as usize), 0),
                    Err(FsError::NoSpace) => {}
                    Err(e) => panic!("seed {seed} step {step}: fallocate: {e:?}"),
                },
                2 => {
                    fs.fallocate(ino, off, len, PUNCH | KEEP_SIZE, &c)
                        .unwrap_or_else(|e| panic!("seed {seed} step {step}: punch: {e:?}"));
                    let (a, b) = (
                        (off as usize).min(m.len()),
                        ((off + len) as usize).min(m.len()),
                    );
                    m[a..b].fill(0);
                }
                _ => {
                    let size = rng.below(310) * bs / 2;
                    fs.setattr(
                        ino,
                        SetAttr {
                            size: Some(size),
                            ..Default::default()
                        },
                        &c,
                    )
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: truncate: {e:?}"));
                    m.resize(size as usize, 0);
                }
            }
            assert_eq!(
                fs.getattr(ino).unwrap().size,
                m.len() as u64,
                "seed {seed} step {step} (op {what}): size"
            );
        }
        for (k, &ino) in files.iter().enumerate() {
            let got = fs.read(ino, 0, model[k].len() as u32 + 1).unwrap();
            assert!(
                got == model[k],
                "seed {seed}: file s{k} differs from the model"
            );
        }
        fs.unmount().unwrap();
        e2fsck_clean(&dev, &format!("seed {seed}"));
    }
}
