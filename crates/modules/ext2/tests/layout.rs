//! Where ext2 puts what it allocates, read back from the image by e2fsprogs (`debugfs`,
//! `dumpe2fs`: readers that share no code with us): a tree's directories near each
//! other, separate trees apart, and directory and map (indirect) blocks in front of
//! their group's file data. A walk of a tree (`rm -rf`, `find`) reads those in runs.
//! Needs e2fsprogs (skipped without it unless QUILT_REQUIRE_E2FSCK=1).

mod support;

use quilt_block::MemDevice;
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const REG: u32 = libc::S_IFREG | 0o644;
const DIR: u32 = 0o755;
/// 1 KiB blocks: 8,192 blocks (8 MiB) per group, 8 groups.
const BS: usize = 1024;
const BLOCKS: u64 = 8 * 8192;

fn have_e2fsprogs() -> bool {
    let ok = Command::new("debugfs").arg("-V").output().is_ok()
        && Command::new("dumpe2fs").arg("-V").output().is_ok();
    if !ok {
        assert!(
            std::env::var("QUILT_REQUIRE_E2FSCK").map_or(true, |v| v != "1"),
            "QUILT_REQUIRE_E2FSCK=1 but debugfs or dumpe2fs is missing"
        );
        eprintln!("skipped: e2fsprogs (debugfs, dumpe2fs) not installed");
    }
    ok
}

fn fresh() -> (Arc<MemDevice>, Ext2) {
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
    let fs = Ext2::open(
        engine,
        MountOptions {
            journal: support::journals(),
            mode: Mode::SoftUpdates,
            read_only: false,
            ..Default::default()
        },
    )
    .unwrap();
    (dev, fs)
}

/// A fresh file system with one directory, `/top`, at the root (None without
/// e2fsprogs, which the checks need).
fn fresh_with_top() -> Option<(Arc<MemDevice>, Ext2, u64)> {
    if !have_e2fsprogs() {
        return None;
    }
    let (dev, fs) = fresh();
    let top = fs.mkdir(fs.root(), b"top", DIR, &Ctx::root()).unwrap().ino;
    Some((dev, fs, top))
}

/// Unmounts and writes the image to `dir`; e2fsck must find it clean.
fn image(dev: &MemDevice, fs: Ext2, dir: &Path) -> std::path::PathBuf {
    fs.unmount().unwrap();
    let img = dir.join("layout.img");
    std::fs::write(&img, dev.to_vec()).unwrap();
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2fsck: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    img
}

fn debugfs(img: &Path, req: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(req)
        .arg(img)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Per group (from dumpe2fs): the first block after its inode table.
fn data_starts(img: &Path) -> Vec<u64> {
    let out = Command::new("dumpe2fs").arg(img).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Inode table at "))
        .map(|r| {
            let last = r.split(['-', ' ']).nth(1).unwrap();
            last.parse::<u64>().unwrap() + 1
        })
        .collect()
}

fn inodes_per_group(img: &Path) -> u64 {
    let s = debugfs(img, "stats");
    s.lines()
        .find_map(|l| l.strip_prefix("Inodes per group:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn ino_of(img: &Path, path: &str) -> u64 {
    let s = debugfs(img, &format!("stat {path}"));
    let l = s.lines().find(|l| l.starts_with("Inode:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A file's blocks as debugfs's `stat` lists them: (data blocks, map blocks).
fn blocks_of(img: &Path, path: &str) -> (Vec<u64>, Vec<u64>) {
    let s = debugfs(img, &format!("stat {path}"));
    let list = s.split("BLOCKS:").nth(1).unwrap_or("");
    let (mut data, mut maps) = (Vec::new(), Vec::new());
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((what, blocks)) = item.split_once("):") else {
            continue;
        };
        let blocks = blocks.split_whitespace().next().unwrap_or("");
        let (a, b) = match blocks.split_once('-') {
            Some((a, b)) => (a.parse::<u64>().unwrap(), b.parse::<u64>().unwrap()),
            None => {
                let Ok(a) = blocks.parse::<u64>() else {
                    continue; // "TOTAL: n"
                };
                (a, a)
            }
        };
        let into = if what.contains("IND") {
            &mut maps
        } else {
            &mut data
        };
        into.extend(a..=b);
    }
    (data, maps)
}

#[test]
fn a_trees_directories_stay_together_and_trees_start_apart() {
    if !have_e2fsprogs() {
        return;
    }
    let (dev, fs) = fresh();
    let c = Ctx::root();
    let r = fs.root();
    // Four trees at the root.
    let tops: Vec<u64> = (0..4)
        .map(|i| {
            fs.mkdir(r, format!("top{i}").as_bytes(), DIR, &c)
                .unwrap()
                .ino
        })
        .collect();
    // A small tree in top0: eight directories, each with a subdirectory and files.
    for d in 0..8 {
        let sub = fs
            .mkdir(tops[0], format!("d{d}").as_bytes(), DIR, &c)
            .unwrap()
            .ino;
        let deeper = fs.mkdir(sub, b"deeper", DIR, &c).unwrap().ino;
        for f in 0..3 {
            fs.mknod(deeper, format!("f{f}").as_bytes(), REG, 0, &c)
                .unwrap();
        }
    }
    // A wide tree in top1: more directories than one group's share.
    for d in 0..120 {
        fs.mkdir(tops[1], format!("w{d}").as_bytes(), DIR, &c)
            .unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let img = image(&dev, fs, tmp.path());
    let ipg = inodes_per_group(&img);
    let group = |p: &str| (ino_of(&img, p) - 1) / ipg;

    let top_groups: BTreeSet<u64> = (0..4).map(|i| group(&format!("/top{i}"))).collect();
    assert_eq!(
        top_groups.len(),
        4,
        "the four trees share groups: {top_groups:?}"
    );

    let g0 = group("/top0");
    for d in 0..8 {
        assert_eq!(group(&format!("/top0/d{d}")), g0, "/top0/d{d}");
        assert_eq!(
            group(&format!("/top0/d{d}/deeper")),
            g0,
            "/top0/d{d}/deeper"
        );
        assert_eq!(group(&format!("/top0/d{d}/deeper/f1")), g0);
    }

    // The wide tree fills its parent's group up to its share of directories, then goes
    // on in the groups after it, in order.
    let g1 = group("/top1");
    let mut per_group: BTreeMap<u64, usize> = BTreeMap::new();
    for d in 0..120 {
        *per_group.entry(group(&format!("/top1/w{d}"))).or_default() += 1;
    }
    assert!(
        per_group.len() >= 2,
        "one group took 120 directories: {per_group:?}"
    );
    let ngroups = BLOCKS / 8192;
    let order: Vec<u64> = (0..ngroups).map(|k| (g1 + k) % ngroups).collect();
    let used: Vec<u64> = order
        .iter()
        .copied()
        .filter(|g| per_group.contains_key(g))
        .collect();
    assert_eq!(
        used,
        order[..used.len()],
        "spilled past a group: {per_group:?}"
    );
    assert!(
        per_group[&g1] >= 20,
        "the parent's group took few: {per_group:?}"
    );
}

#[test]
fn directory_and_map_blocks_sit_in_front_of_their_groups_file_data() {
    let Some((dev, fs, top)) = fresh_with_top() else {
        return;
    };
    let c = Ctx::root();
    // As an untar makes them: directories and files in turn, some files past the 12
    // direct blocks (a map block each).
    let mut dirs = vec!["/top".to_string()];
    let mut files = Vec::new();
    for d in 0..6 {
        let name = format!("d{d}");
        let sub = fs.mkdir(top, name.as_bytes(), DIR, &c).unwrap().ino;
        dirs.push(format!("/top/{name}"));
        for f in 0..4 {
            let ino = fs
                .mknod(sub, format!("f{f}").as_bytes(), REG, 0, &c)
                .unwrap()
                .ino;
            let len = if f % 2 == 0 { 20 * BS } else { 3 * BS };
            fs.write(ino, 0, &vec![0x5a; len], &c).unwrap();
            files.push(format!("/top/{name}/f{f}"));
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let img = image(&dev, fs, tmp.path());
    let ipg = inodes_per_group(&img);
    let g = (ino_of(&img, "/top") - 1) / ipg;
    let front = data_starts(&img)[g as usize];

    let mut meta: Vec<u64> = Vec::new();
    for d in &dirs {
        meta.extend(blocks_of(&img, d).0);
    }
    let mut maps = 0;
    let mut data: Vec<u64> = Vec::new();
    for f in &files {
        let (d, m) = blocks_of(&img, f);
        // Each file's data is one run.
        assert!(
            d.windows(2).all(|w| w[1] == w[0] + 1),
            "{f} is split: {d:?}"
        );
        maps += m.len();
        meta.extend(m);
        data.extend(d);
    }
    assert_eq!(maps, 12, "one map block per large file");
    meta.sort_unstable();
    // The group's directory and map blocks, and nothing else, from the front on.
    let expect: Vec<u64> = (front..front + meta.len() as u64).collect();
    assert_eq!(
        meta, expect,
        "directory and map blocks are not packed at the front"
    );
    let first_data = *data.iter().min().unwrap();
    assert!(
        first_data >= front + 8192 / 16,
        "file data at {first_data}, inside the front ({front}..)"
    );
}

#[test]
fn a_file_that_outgrows_its_group_leaves_the_next_groups_front_to_directories() {
    let Some((dev, fs, top)) = fresh_with_top() else {
        return;
    };
    let c = Ctx::root();
    // 12 MiB: more than a group (8 MiB) holds, written as a program writes, 64 KiB at
    // a time.
    let big = fs.mknod(top, b"big", REG, 0, &c).unwrap().ino;
    let chunk = vec![0xa5u8; 64 << 10];
    for i in 0..192u64 {
        fs.write(big, i * chunk.len() as u64, &chunk, &c).unwrap();
    }
    // Directories made afterwards in the tree still find their groups' fronts free.
    for d in 0..4 {
        fs.mkdir(top, format!("d{d}").as_bytes(), DIR, &c).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let img = image(&dev, fs, tmp.path());
    let fronts = data_starts(&img);
    let (data, maps) = blocks_of(&img, "/top/big");
    assert_eq!(data.len(), 12 * 1024);
    let in_a_front = |b: u64| fronts.iter().any(|&f| (f..f + 8192 / 16).contains(&b));
    let stray: Vec<u64> = data.iter().copied().filter(|&b| in_a_front(b)).collect();
    assert!(stray.is_empty(), "file data in a group's front: {stray:?}");
    assert!(maps.iter().all(|&b| in_a_front(b)), "map blocks: {maps:?}");
    for d in 0..4 {
        let (blocks, _) = blocks_of(&img, &format!("/top/d{d}"));
        assert!(in_a_front(blocks[0]), "/top/d{d} at {}", blocks[0]);
    }
    // The file spans groups: the test reached the case it is about.
    let groups: BTreeSet<u64> = data.iter().map(|b| (b - 1) / 8192).collect();
    assert!(groups.len() >= 2, "{groups:?}");
}
