//! Fuzzing what the Bε-tree and betrfs read from disk.
//!
//! The tree's targets damage one region of a small tree image (its header blocks, its
//! block translation table, its log ring, its node extents), then open it (which
//! replays the log), read every key, change a few, checkpoint, close and open it again.
//! A build for fuzzing (`cfg(fuzzing)`) lets every checksum match, so the bytes reach
//! the decoders behind the checks. betrfs's records (superblock, inode, zone, directory
//! entry, rename intent) go to their decoders directly: they live inside tree values,
//! which carry no checksum of their own. Errors are expected; a panic or a hang is a bug.

use quilt_betree::{write_at_arg, Batch, Options, Tree, WRITE_AT};
use quilt_block::MemDevice;
use std::sync::{Arc, OnceLock};

const BS: usize = 512;
const BLOCKS: u64 = 8192;

/// The part of the tree image a target's input overwrites.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeRegion {
    /// The header slots at the start and the mirror in the last block.
    Header,
    /// The block translation table.
    Table,
    /// The log ring's blocks (records not yet checkpointed among them).
    Log,
    /// Every node extent: internal nodes, leaves, deltas.
    Nodes,
}

pub const TREE_REGIONS: [TreeRegion; 4] = [
    TreeRegion::Header,
    TreeRegion::Table,
    TreeRegion::Log,
    TreeRegion::Nodes,
];

struct TreeSeed {
    image: Vec<u8>,
    /// Per region: byte ranges of the image, in the order the input fills them.
    ranges: [Vec<(usize, usize)>; 4],
}

fn key(i: u32) -> Vec<u8> {
    format!("k{i:05}").into_bytes()
}

fn build() -> TreeSeed {
    let dev = Arc::new(MemDevice::new(BS, BLOCKS).expect("memory device"));
    let t = quilt_stack::create_tree(dev.clone(), Options::tiny()).expect("tree");
    let mut b = Batch::new();
    for i in 0..2500u32 {
        b.put(&key(i), &vec![i as u8; (i % 40) as usize + 1]);
        if i % 100 == 99 {
            t.write(std::mem::take(&mut b)).expect("write");
        }
    }
    t.write(b).expect("write");
    t.upsert(&key(7), WRITE_AT, &write_at_arg(3, b"upserted"))
        .expect("upsert");
    t.delete_range(&key(100), &key(300)).expect("range delete");
    t.rename_prefix(b"k004", b"m004").expect("rename");
    t.clone_prefix(b"k005", b"c005").expect("clone");
    t.checkpoint().expect("checkpoint");
    // Messages after the checkpoint: in the log, and buffered or in deltas.
    for i in 0..300u32 {
        t.put(&key(i * 7), b"after").expect("put");
    }
    t.delete(&key(21)).expect("delete");
    t.sync().expect("sync");
    let g = t.geometry();
    // A crash: the log tail stays to be replayed.
    drop(t);
    let image = dev.to_vec();
    let node_blocks = g.node_bytes / BS;
    let mut ranges: [Vec<(usize, usize)>; 4] = Default::default();
    let mut b = 0usize;
    let blocks = image.len() / BS;
    while b < blocks {
        let at = b * BS;
        let head = &image[at..at + 8];
        let magic = &head[..4];
        let (region, len) = if head == b"QBETREE1" {
            (Some(0), 1)
        } else if magic == b"QBTT" {
            (Some(1), 1)
        } else if magic == b"QBLG" {
            (Some(2), 1)
        } else if magic == b"QBNI" || magic == b"QBNL" || magic == b"QBND" {
            (Some(3), node_blocks.min(blocks - b))
        } else {
            (None, 1)
        };
        if let Some(r) = region {
            ranges[r].push((at, len * BS));
        }
        b += len;
    }
    TreeSeed { image, ranges }
}

fn tree_seed() -> &'static TreeSeed {
    static S: OnceLock<TreeSeed> = OnceLock::new();
    S.get_or_init(build)
}

/// Builds the seed image (once per process), before the first input is timed.
pub fn prepare_tree() {
    tree_seed();
}

/// The region's bytes in the undamaged image.
pub fn tree_seed_bytes(region: TreeRegion) -> Vec<u8> {
    let s = tree_seed();
    s.ranges[region as usize]
        .iter()
        .flat_map(|&(a, n)| s.image[a..a + n].iter().copied())
        .collect()
}

/// How many byte ranges the region has in the seed image.
pub fn tree_region_parts(region: TreeRegion) -> usize {
    tree_seed().ranges[region as usize].len()
}

fn damaged(region: TreeRegion, data: &[u8]) -> Vec<u8> {
    let s = tree_seed();
    let mut img = s.image.clone();
    let mut rest = data;
    for &(at, n) in &s.ranges[region as usize] {
        if rest.is_empty() {
            break;
        }
        let k = n.min(rest.len());
        img[at..at + k].copy_from_slice(&rest[..k]);
        rest = &rest[k..];
    }
    img
}

/// Reads every key (a bounded number), as a scan and by point queries.
fn walk(t: &Tree) {
    let mut seen = 0;
    for r in t.range(b"", None) {
        match r {
            Ok((k, _)) => {
                if seen % 97 == 0 {
                    let _ = t.get(&k);
                }
            }
            Err(_) => break,
        }
        seen += 1;
        if seen > 20_000 {
            break;
        }
    }
    for r in t.range_rev(b"k002", Some(b"k003")).take(50) {
        if r.is_err() {
            break;
        }
    }
    let _ = t.get(&key(7));
}

/// One fuzz case: damage the region, then open, use, checkpoint and reopen the tree.
pub fn run_tree(region: TreeRegion, data: &[u8]) {
    let img = damaged(region, data);
    let dev = Arc::new(MemDevice::from_bytes(BS, &img).expect("seed image size"));
    if let Ok(t) = quilt_stack::tree(dev.clone(), Options::tiny()) {
        walk(&t);
        let _ = t.put(b"new", b"value");
        let _ = t.upsert(&key(8), WRITE_AT, &write_at_arg(1, b"x"));
        let _ = t.delete_range(&key(1000), &key(1100));
        let _ = t.rename_prefix(b"k02", b"n02");
        let _ = t.checkpoint();
        let _ = t.close();
    }
    // Whatever the first open left is read again.
    if let Ok(t) = quilt_stack::tree(dev, Options::tiny()) {
        walk(&t);
    }
}

/// betrfs's records: each decoder on the input, and the input re-encoded where it
/// decoded (a decoded record must encode to something that decodes the same).
pub fn run_records(data: &[u8]) {
    use quilt_betrfs::record;
    if let Ok(s) = record::Super::decode(data) {
        let again = record::Super::decode(&s.encode()).expect("a decoded superblock re-encodes");
        assert_eq!(again.next_ino, s.next_ino);
    }
    if let Ok(i) = record::decode_inode(data) {
        let again = record::decode_inode(&i.encode()).expect("a decoded inode re-encodes");
        assert_eq!(again.ino, i.ino);
        assert_eq!(again.size, i.size);
    }
    let _ = record::Zone::decode(data);
    let _ = record::Entry::decode(data);
    let _ = quilt_betrfs::decode_intent(data);
}

/// Encoded records of every kind, for the records target's first corpus.
pub fn record_seeds() -> Vec<Vec<u8>> {
    use quilt_betrfs::record;
    let mut v = vec![record::Super {
        next_ino: 77,
        next_ns: 2,
        next_zone: 3,
        version: 2,
        dirty: true,
        error: false,
    }
    .encode()];
    let mut i = record::Inode::new(
        12,
        libc::S_IFREG | 0o644,
        1,
        2,
        1,
        quilt_vfs::Timespec::now(),
    );
    i.size = 12345;
    i.xattrs = vec![(b"user.a".to_vec(), b"b".to_vec())];
    v.push(i.encode());
    let mut d = record::Inode::new(
        13,
        libc::S_IFDIR | 0o755,
        0,
        0,
        2,
        quilt_vfs::Timespec::now(),
    );
    d.zone = Some(5);
    v.push(d.encode());
    let mut l = record::Inode::new(
        14,
        libc::S_IFLNK | 0o777,
        0,
        0,
        1,
        quilt_vfs::Timespec::now(),
    );
    l.target = b"/some/where".to_vec();
    v.push(l.encode());
    v
}

/// Every tree region, by target name.
pub const TREE_TARGETS: [(TreeRegion, &str); 4] = [
    (TreeRegion::Header, "betree_header"),
    (TreeRegion::Table, "betree_table"),
    (TreeRegion::Log, "betree_log"),
    (TreeRegion::Nodes, "betree_nodes"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::path::Path;

    #[test]
    fn tree_seed_regions_are_found_and_the_undamaged_image_opens() {
        for (r, _) in TREE_TARGETS {
            assert!(
                tree_region_parts(r) > 0,
                "{r:?}: not found in the seed image"
            );
            let s = tree_seed_bytes(r);
            assert_eq!(damaged(r, &s), tree_seed().image, "{r:?}");
        }
        assert!(
            tree_region_parts(TreeRegion::Header) >= 2,
            "both header slots"
        );
        assert!(
            tree_region_parts(TreeRegion::Nodes) >= 5,
            "a tree of several nodes"
        );
        let dev = Arc::new(MemDevice::from_bytes(BS, &tree_seed().image).unwrap());
        let t = quilt_stack::tree(dev, Options::tiny()).unwrap();
        // What the script left, after the log's replay.
        assert_eq!(t.get(&key(7)).unwrap().as_deref(), Some(&b"after"[..]));
        assert_eq!(t.get(&key(21)).unwrap(), None);
        assert_eq!(t.get(&key(150)).unwrap(), None);
        assert!(t.get(b"m00410").unwrap().is_some());
        assert!(t.get(b"c00510").unwrap().is_some());
        for (r, _) in TREE_TARGETS {
            run_tree(r, &tree_seed_bytes(r));
        }
    }

    #[test]
    fn records_seed_and_roundtrip() {
        for s in record_seeds() {
            run_records(&s);
        }
        assert!(quilt_betrfs::record::decode_inode(&record_seeds()[1]).is_ok());
    }

    #[test]
    fn write_seeds() {
        let Some(dir) = std::env::var_os("QUILT_FUZZ_SEEDS") else {
            return;
        };
        for (r, name) in TREE_TARGETS {
            let d = Path::new(&dir).join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("seed"), tree_seed_bytes(r)).unwrap();
        }
        let d = Path::new(&dir).join("betrfs_records");
        std::fs::create_dir_all(&d).unwrap();
        for (i, s) in record_seeds().iter().enumerate() {
            std::fs::write(d.join(format!("seed{i}")), s).unwrap();
        }
    }

    #[test]
    fn regressions() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        for (r, name) in TREE_TARGETS {
            let Ok(entries) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for e in entries {
                run_tree(r, &std::fs::read(e.unwrap().path()).unwrap());
            }
        }
        if let Ok(entries) = std::fs::read_dir(root.join("betrfs_records")) {
            for e in entries {
                run_records(&std::fs::read(e.unwrap().path()).unwrap());
            }
        }
    }

    /// The CI smoke: seeded random damage over each region and random records, without
    /// coverage guidance (and with checksums checked: this is not a fuzzing build).
    #[test]
    fn smoke() {
        let cases: usize = std::env::var("QUILT_FUZZ_SMOKE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if std::env::var_os("CI").is_some() {
                60
            } else {
                300
            });
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x51ee_d0f7_7ee5);
        for (r, _) in TREE_TARGETS {
            let base = tree_seed_bytes(r);
            for case in 0..cases {
                let mut d = base.clone();
                for _ in 0..1 + case % 5 {
                    let at = rng.random_range(0..d.len());
                    if rng.random_bool(0.5) {
                        d[at] ^= 1 << rng.random_range(0..8);
                    } else {
                        let n = rng.random_range(1..64).min(d.len() - at);
                        rng.fill(&mut d[at..at + n]);
                    }
                }
                run_tree(r, &d);
            }
        }
        let seeds = record_seeds();
        for case in 0..cases * 20 {
            let mut d = seeds[case % seeds.len()].clone();
            let at = rng.random_range(0..d.len());
            d[at] = rng.random();
            if case % 3 == 0 {
                d.truncate(rng.random_range(0..d.len()));
            }
            run_records(&d);
            let junk: Vec<u8> = (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect();
            run_records(&junk);
        }
    }
}
