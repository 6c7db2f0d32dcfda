//! `quiltfs fsck` for betrfs images: every invariant of the key schema, after the tree's
//! own check. The image is mounted first (on a copy-on-write view with `-n`), so the
//! log is replayed and interrupted moves and orphans are finished as a mount would.
//!
//! Invariants: the superblock record decodes and its next inode number is above every
//! inode's raw number, its next namespace above every marker's; every name key is well
//! formed and its parent is a directory; inode numbers (a record's namespace, from its
//! marker or its directory, with its raw number) are unique; the index lists exactly the
//! link stubs and marked records; the root is directory 1; a directory's link count is 2 plus its
//! subdirectories; a link stub names an inode under its number, of the same type, whose
//! link count is its number of stubs; data keys belong to a regular file, lie below its
//! size (rounded up to a block) and hold at most a block; nothing lies in an unknown
//! key space.

use crate::fs::{Betrfs, MountOptions};
use crate::keys::{self, Loc};
use crate::record::{self, Entry, Inode, Super, BLOCK};
use quilt_betree::Batch;
use quilt_block::{BlockDevice, OverlayDevice};
use quilt_vfs::{FileSystem, FsError, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// What the check found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub problems: Vec<String>,
    /// Problems repaired (with `repair`).
    pub fixed: Vec<String>,
    pub directories: u64,
    pub files: u64,
    pub other: u64,
    pub link_stubs: u64,
    pub data_blocks: u64,
    pub data_bytes: u64,
}

impl Report {
    /// e2fsck's exit status: 0 clean, 1 errors corrected, 4 errors left.
    pub fn exit_code(&self) -> i32 {
        if !self.problems.is_empty() {
            4
        } else if !self.fixed.is_empty() {
            1
        } else {
            0
        }
    }
}

/// Checks the betrfs image on `dev`; with `repair`, fixes what can be fixed without
/// guessing (link counts, data past the end or without a file, inodes without names
/// go to lost+found) and writes the result.
pub fn fsck(dev: Arc<dyn BlockDevice>, repair: bool) -> Result<Report> {
    fsck_with_progress(dev, repair, &mut |_, _| {})
}

/// `fsck`, telling `progress` how far the scan is: (keys checked, keys expected, a
/// rough estimate from the space and inodes in use), every few thousand keys.
pub fn fsck_with_progress(
    dev: Arc<dyn BlockDevice>,
    repair: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Report> {
    let dev: Arc<dyn BlockDevice> = if repair {
        dev
    } else {
        Arc::new(OverlayDevice::new(dev))
    };
    let fs = Betrfs::open(
        dev,
        MountOptions {
            read_only: false,
            acl: true,
            commit_interval: None,
        },
    )?;
    let mut report = Report::default();
    // Header blocks found damaged at open, whose loss the mirror or the other slot
    // covered: rewritten by a repair.
    let damage = fs.tree().damage();
    if !damage.is_empty() {
        if repair {
            fs.tree()
                .repair_headers()
                .map_err(|e| FsError::Io(quilt_vfs::IoError::caused_by(e)))?;
            report.fixed.extend(damage);
        } else {
            report.problems.extend(damage);
        }
    }
    if let Err(e) = fs.tree().check() {
        report.problems.push(format!("the tree: {e}"));
        return Ok(report);
    }
    let expected = fs.statfs().map_or(0, |s| {
        s.blocks.saturating_sub(s.blocks_free) + s.files.saturating_sub(s.files_free)
    });
    let fixes = check_schema(&fs, &mut report, &mut |n| progress(n, expected.max(n)))?;
    if repair && !fixes.ops.is_empty() {
        fs.tree()
            .write(fixes)
            .map_err(|e| FsError::Io(quilt_vfs::IoError::caused_by(e)))?;
        report.fixed.append(&mut report.problems);
        // What could not be fixed stays a problem: check again.
        let mut again = Report::default();
        check_schema(&fs, &mut again, &mut |_| {})?;
        report.problems = again.problems;
    }
    fs.unmount()?;
    Ok(report)
}

/// One file's data keys, as the scan meets them (a file's blocks are contiguous in key
/// order): how many, the last block, and those that hold more than a block.
struct DataRun {
    loc: Loc,
    blocks: u64,
    bytes: u64,
    last: u64,
    oversized: Vec<(u64, usize)>,
}

fn show(key: &[u8]) -> String {
    let mut parts = Vec::new();
    let mut k = key.to_vec();
    let mut zone = None;
    while !k.is_empty() {
        parts.push(String::from_utf8_lossy(keys::name_of(&k)).into_owned());
        match keys::up(&k) {
            keys::Up::Dir(p) => k = p,
            keys::Up::Zone(z) => {
                zone = Some(z);
                break;
            }
        }
    }
    parts.reverse();
    match zone {
        Some(z) => format!("(zone {z})/{}", parts.join("/")),
        None => format!("/{}", parts.join("/")),
    }
}

/// The directory of the entry at `path`: its parent's path-key, or the path of the
/// record that roots its zone (None: no record does).
fn parent_of(path: &[u8], zone_roots: &HashMap<u64, Vec<u8>>) -> Option<Vec<u8>> {
    match keys::up(path) {
        keys::Up::Dir(p) => Some(p),
        keys::Up::Zone(z) => zone_roots.get(&z).cloned(),
    }
}

/// Checks the schema; returns the batch that repairs what can be repaired.
fn check_schema(fs: &Betrfs, r: &mut Report, progress: &mut dyn FnMut(u64)) -> Result<Batch> {
    let mut scanned = 0u64;
    let mut fix = Batch::new();
    let mut sup = None;
    let mut names: BTreeMap<Vec<u8>, Entry> = BTreeMap::new();
    let mut inodes: BTreeMap<u64, Inode> = BTreeMap::new();
    // One entry per file with data, not per block: the scan streams the values.
    let mut data: Vec<DataRun> = Vec::new();
    let mut markers = Vec::new();
    let mut index: Vec<Vec<u8>> = Vec::new();
    // Zone → the number its record names as its root's.
    let mut zones: BTreeMap<u64, u64> = BTreeMap::new();
    // Every key, with its value; the data key spaces (`d`, `e`) keys-only, since a
    // data block is checked by its length alone (the tree's own check, before, read
    // every node and verified its checksums).
    let mut visit = |k: &[u8], v: &[u8], len: usize| {
        scanned += 1;
        if scanned % 4096 == 0 {
            progress(scanned);
        }
        match k.first() {
            Some(b'S') if k == keys::SUPER => match Super::decode(v) {
                Ok(s) => sup = Some(s),
                Err(e) => r.problems.push(format!("superblock record: {e}")),
            },
            Some(&keys::META) => {
                let path = &k[1..];
                if !keys::valid_key(path) {
                    r.problems.push(format!("a malformed name key {:?}", path));
                    return;
                }
                match Entry::decode(v) {
                    Ok(e) => {
                        names.insert(path.to_vec(), e);
                    }
                    Err(e) => r.problems.push(format!("{}: {e}", show(path))),
                }
            }
            Some(&keys::INODE) if k.len() == 9 => {
                let ino = u64::from_be_bytes(k[1..9].try_into().expect("8 bytes"));
                match record::decode_inode(v) {
                    Ok(i) if i.ino == ino => {
                        inodes.insert(ino, i);
                    }
                    Ok(i) => r
                        .problems
                        .push(format!("inode {ino} records number {}", i.ino)),
                    Err(e) => r.problems.push(format!("inode {ino}: {e}")),
                }
            }
            Some(&keys::DATA) | Some(&keys::INODE_DATA) => match keys::data_owner(k) {
                Some((loc, blk)) => {
                    let same = data.last().is_some_and(|d| d.loc == loc);
                    if !same {
                        data.push(DataRun {
                            loc,
                            blocks: 0,
                            bytes: 0,
                            last: 0,
                            oversized: Vec::new(),
                        });
                    }
                    let d = data.last_mut().expect("pushed");
                    if len as u64 > BLOCK {
                        d.oversized.push((blk, len));
                    } else {
                        d.blocks += 1;
                        d.bytes += len as u64;
                    }
                    d.last = blk;
                }
                None => r.problems.push(format!("a malformed data key {k:?}")),
            },
            Some(&keys::ORPHAN) | Some(&keys::RENAME) => markers.push(k.to_vec()),
            Some(&keys::INDEX) => index.push(k[1..].to_vec()),
            Some(&keys::ZONE) if k.len() == 9 => {
                let z = u64::from_be_bytes(k[1..9].try_into().expect("8 bytes"));
                match record::Zone::decode(v) {
                    Ok(rec) => {
                        zones.insert(z, rec.root);
                    }
                    Err(e) => r.problems.push(format!("zone {z}: {e}")),
                }
            }
            _ => r.problems.push(format!("a key in no key space: {k:?}")),
        }
    };
    let bad = |e: quilt_betree::Error| FsError::Corrupt(e.to_string());
    let data_lo = [keys::DATA];
    let data_hi = [keys::INODE_DATA + 1];
    for kv in fs.tree().range(b"", Some(&data_lo)) {
        let (k, v) = kv.map_err(bad)?;
        visit(&k, &v, v.len());
    }
    let mut data_keys = fs.tree().keys(&data_lo, Some(&data_hi));
    while let Some(kl) = data_keys.next_key() {
        let (k, len) = kl.map_err(bad)?;
        visit(k, &[], len);
    }
    drop(data_keys);
    for kv in fs.tree().range(&data_hi, None) {
        let (k, v) = kv.map_err(bad)?;
        visit(&k, &v, v.len());
    }
    if !markers.is_empty() {
        r.problems.push(format!(
            "{} intent records left after recovery",
            markers.len()
        ));
    }
    let Some(sup) = sup else {
        r.problems.push("no superblock record".into());
        return Ok(fix);
    };
    if sup.error {
        r.problems
            .push("the file system recorded damage found while mounted".into());
    }
    // Names: parents, types, unique numbers, directory link counts.
    let mut seen: HashMap<u64, String> = HashMap::new();
    let mut subdirs: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut stubs: HashMap<u64, u32> = HashMap::new();
    match names.get(&Vec::new()) {
        Some(Entry::Inode(i)) if i.is_dir() && i.ino == crate::ROOT_INO => {}
        _ => r
            .problems
            .push("the root is missing or not directory 1".into()),
    }
    // Zones: each record's zone rooted by exactly one directory, whose number the
    // zone's record names; every zone's keys belong to a zone there is.
    let mut zone_roots: HashMap<u64, Vec<u8>> = HashMap::new();
    for (path, e) in &names {
        if let Entry::Inode(i) = e {
            if let Some(z) = i.zone {
                if z >= sup.next_zone {
                    r.problems.push(format!(
                        "{}: zone {z} is not below the next one {}",
                        show(path),
                        sup.next_zone
                    ));
                }
                if let Some(other) = zone_roots.insert(z, path.clone()) {
                    r.problems.push(format!(
                        "zone {z} has two roots: {} and {}",
                        show(&other),
                        show(path)
                    ));
                }
            }
        }
        if let Some(z) = keys::zone_of(path) {
            if !zones.contains_key(&z) {
                r.problems
                    .push(format!("{}: in zone {z}, which has no record", show(path)));
            }
        }
    }
    for (z, root) in &zones {
        if !zone_roots.contains_key(z) {
            r.problems
                .push(format!("zone {z} (root {root}) is rooted by no directory"));
        }
    }
    // Each directory's namespace (what its unmarked entries take): its marker, else its
    // directory's (a zone's top entries: its root's). Zones break key order, so each
    // is found by walking up, remembered.
    let mut ns_of: HashMap<Vec<u8>, u64> = HashMap::new();
    let raw = |ino: u64| ino & (record::RAW_LIMIT - 1);
    let dir_ns = |path: &[u8], ns_of: &mut HashMap<Vec<u8>, u64>| -> u64 {
        let mut chain = Vec::new();
        let mut p = path.to_vec();
        let base = loop {
            if let Some(&ns) = ns_of.get(&p) {
                break ns;
            }
            if p.is_empty() || chain.len() > names.len() {
                break 0;
            }
            if let Some(Entry::Inode(i)) = names.get(&p) {
                if let Some(m) = i.marker {
                    break m;
                }
            }
            chain.push(p.clone());
            match parent_of(&p, &zone_roots) {
                Some(up) => p = up,
                None => break 0,
            }
        };
        for c in chain {
            ns_of.insert(c, base);
        }
        base
    };
    for (path, e) in &names {
        if let Entry::Inode(i) = e {
            if let Some(m) = i.marker {
                if m >= sup.next_ns {
                    r.problems.push(format!(
                        "{}: namespace {m} is not below the next one {}",
                        show(path),
                        sup.next_ns
                    ));
                }
            }
        }
        let want = matches!(e, Entry::Link { .. })
            || matches!(e, Entry::Inode(i) if i.marker.is_some() || i.zone.is_some());
        if want && index.binary_search(path).is_err() {
            r.problems
                .push(format!("{}: missing from the index", show(path)));
            fix.put(&keys::index_key(path), b"");
        }
    }
    for path in &index {
        let want = match names.get(path) {
            Some(Entry::Link { .. }) => true,
            Some(Entry::Inode(i)) => i.marker.is_some() || i.zone.is_some(),
            None => false,
        };
        if !want {
            r.problems.push(format!(
                "{}: in the index, but not a link stub, a marked record or a zone's root",
                show(path)
            ));
            fix.delete(&keys::index_key(path));
        }
    }
    for (path, e) in &names {
        if !path.is_empty() {
            let parent = parent_of(path, &zone_roots);
            match parent.as_ref().and_then(|p| names.get(p)) {
                Some(Entry::Inode(p)) if p.is_dir() => {
                    if e.kind() == quilt_vfs::FileType::Directory {
                        *subdirs.entry(parent.unwrap_or_default()).or_default() += 1;
                    }
                }
                _ => r
                    .problems
                    .push(format!("{}: its directory does not exist", show(path))),
            }
        }
        match e {
            Entry::Inode(i) => {
                if raw(i.ino) >= sup.next_ino {
                    r.problems.push(format!(
                        "{}: inode {} is not below the next number {}",
                        show(path),
                        raw(i.ino),
                        sup.next_ino
                    ));
                }
                let ns = match i.marker {
                    Some(m) => m,
                    None if path.is_empty() => 0,
                    None => match parent_of(path, &zone_roots) {
                        Some(p) => dir_ns(&p, &mut ns_of),
                        None => 0,
                    },
                };
                let ino = record::compose(ns, i.ino);
                if let Some(z) = i.zone {
                    if zones.get(&z).is_some_and(|&root| root != ino) {
                        r.problems.push(format!(
                            "{}: the root of zone {z} is inode {ino}, its record says {}",
                            show(path),
                            zones[&z]
                        ));
                    }
                }
                if let Some(other) = seen.insert(ino, show(path)) {
                    r.problems.push(format!(
                        "inode {ino} named twice: {other} and {}",
                        show(path)
                    ));
                }
                if i.nlink != 1 && !i.is_dir() {
                    r.problems.push(format!(
                        "{}: a file with one name has link count {}",
                        show(path),
                        i.nlink
                    ));
                    let mut j = i.clone();
                    j.nlink = 1;
                    fix.put(&keys::meta_key(path), &j.encode());
                }
                count(r, i);
            }
            Entry::Link { ino, mode } => {
                r.link_stubs += 1;
                *stubs.entry(*ino).or_default() += 1;
                match inodes.get(ino) {
                    None => {
                        r.problems
                            .push(format!("{}: link to missing inode {ino}", show(path)));
                        fix.delete(&keys::meta_key(path));
                    }
                    Some(i) if i.mode & libc::S_IFMT != *mode => r.problems.push(format!(
                        "{}: link of another type than inode {ino}",
                        show(path)
                    )),
                    _ => {}
                }
            }
        }
    }
    for (path, e) in &names {
        if let Entry::Inode(i) = e {
            if i.is_dir() {
                let want = 2 + subdirs.get(path).copied().unwrap_or(0);
                if i.nlink != want {
                    r.problems.push(format!(
                        "{}: link count {}, should be {want}",
                        show(path),
                        i.nlink
                    ));
                    let mut j = i.clone();
                    j.nlink = want;
                    fix.put(&keys::meta_key(path), &j.encode());
                }
            }
        }
    }
    // Inodes under their numbers: one per stub.
    for (ino, i) in &inodes {
        if raw(*ino) >= sup.next_ino {
            r.problems.push(format!(
                "inode {ino} is not below the next number {}",
                sup.next_ino
            ));
        }
        if let Some(other) = seen.insert(*ino, format!("inode {ino}")) {
            r.problems.push(format!(
                "inode {ino} is both under its number and at {other}"
            ));
        }
        if i.is_dir() {
            r.problems
                .push(format!("inode {ino}: a directory under its number"));
        }
        let n = stubs.get(ino).copied().unwrap_or(0);
        if n == 0 {
            r.problems.push(format!("inode {ino} has no name"));
            // Into lost+found as #ino.
            let lf = keys::child_key(b"", b"lost+found");
            let name = format!("#{ino}");
            let lf_prefix = match names.get(&lf) {
                Some(Entry::Inode(i)) if i.zone.is_some() => {
                    keys::zone_prefix(i.zone.unwrap_or_default())
                }
                _ => keys::dir_prefix(&lf),
            };
            let key = keys::child_key(&lf_prefix, name.as_bytes());
            fix.put(&keys::meta_key(&key), &Entry::link_stub(*ino, i.mode));
            fix.put(&keys::index_key(&key), b"");
            let mut j = i.clone();
            j.nlink = 1;
            fix.put(&keys::inode_key(*ino), &j.encode());
        } else if i.nlink != n {
            r.problems
                .push(format!("inode {ino}: link count {}, {n} names", i.nlink));
            let mut j = i.clone();
            j.nlink = n;
            fix.put(&keys::inode_key(*ino), &j.encode());
        }
        count(r, i);
    }
    // Data: an owner that is a regular file, below its size; each file's count of
    // blocks is its number of keys.
    let mut counted: HashMap<Loc, u64> = HashMap::new();
    for d in data {
        let owner = match &d.loc {
            Loc::Path(p) => match names.get(p) {
                Some(Entry::Inode(i)) => Some(i),
                _ => None,
            },
            Loc::Ino(i) => inodes.get(i),
            // Data keys parse to a path or a number, never to an orphan.
            Loc::Orphan { .. } => None,
        };
        let what = match &d.loc {
            Loc::Path(p) | Loc::Orphan { path: p, .. } => show(p),
            Loc::Ino(i) => format!("inode {i}"),
        };
        let prefix = d.loc.data_prefix();
        match owner {
            Some(i) if i.is_reg() => {
                let end = i.size.div_ceil(BLOCK);
                let mut have = d.blocks;
                if d.last >= end {
                    // The keys past the end, counted again to know how many.
                    let past = fs
                        .tree()
                        .range(&d.loc.data_key(end), Some(&keys::prefix_end(&prefix)))
                        .count() as u64;
                    r.problems.push(format!(
                        "{what}: {past} data blocks past the end ({} bytes), the last {}",
                        i.size, d.last
                    ));
                    fix.delete_range(&d.loc.data_key(end), &keys::prefix_end(&prefix));
                    have = have.saturating_sub(past);
                }
                for (blk, len) in &d.oversized {
                    r.problems
                        .push(format!("{what}: data block {blk} holds {len} bytes"));
                }
                r.data_blocks += have;
                r.data_bytes += d.bytes;
                *counted.entry(d.loc.clone()).or_default() += have;
            }
            _ => {
                r.problems.push(format!(
                    "{what}: {} data blocks of no regular file",
                    d.blocks + d.oversized.len() as u64
                ));
                fix.delete_range(&prefix, &keys::prefix_end(&prefix));
            }
        }
    }
    let files = names
        .iter()
        .filter_map(|(p, e)| match e {
            Entry::Inode(i) if i.is_reg() => Some((Loc::Path(p.clone()), i, keys::meta_key(p))),
            _ => None,
        })
        .chain(
            inodes
                .iter()
                .filter(|(_, i)| i.is_reg())
                .map(|(n, i)| (Loc::Ino(*n), i, keys::inode_key(*n))),
        );
    for (loc, i, key) in files {
        let have = counted.get(&loc).copied().unwrap_or(0);
        if i.blocks != have {
            r.problems.push(format!(
                "inode {}: {} blocks recorded, {have} present",
                i.ino, i.blocks
            ));
            let mut j = i.clone();
            j.blocks = have;
            fix.put(&key, &j.encode());
        }
    }
    Ok(fix)
}

fn count(r: &mut Report, i: &Inode) {
    match i.kind() {
        quilt_vfs::FileType::Directory => r.directories += 1,
        quilt_vfs::FileType::Regular => r.files += 1,
        _ => r.other += 1,
    }
}
