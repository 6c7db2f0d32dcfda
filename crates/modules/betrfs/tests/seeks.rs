//! SEEK_DATA and SEEK_HOLE on sparse files against a model of which blocks are present,
//! through random whole and partial writes, whole-block punches and truncations, with
//! the tree warm and after remounts (cold: the keys-only scan then reads leaves'
//! indexes, not their data). The answers follow the module's contract
//! (`FileSystem::seek_data`): the kernel's block-mapped file systems' answers.

use quilt_betrfs::{mkfs, Betrfs, MountOptions};
use quilt_block::MemDevice;
use quilt_vfs::{Ctx, FileSystem, FsError, SetAttr};
use std::sync::Arc;

const BLOCK: u64 = 4096;
const REG: u32 = libc::S_IFREG | 0o644;
const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
/// The file's blocks at most (16 MiB).
const SPAN: u64 = 4096;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Which blocks hold data, and the size.
#[derive(Default)]
struct Model {
    present: Vec<bool>,
    size: u64,
}

impl Model {
    fn write(&mut self, off: u64, len: u64) {
        let end = off + len;
        let last = end.div_ceil(BLOCK) as usize;
        if self.present.len() < last {
            self.present.resize(last, false);
        }
        for b in off / BLOCK..end.div_ceil(BLOCK) {
            self.present[b as usize] = true;
        }
        self.size = self.size.max(end);
    }
    fn punch(&mut self, first: u64, blocks: u64) {
        for b in first..(first + blocks).min(self.present.len() as u64) {
            self.present[b as usize] = false;
        }
    }
    fn truncate(&mut self, size: u64) {
        self.present.truncate(size.div_ceil(BLOCK) as usize);
        self.size = size;
    }
    fn has(&self, b: u64) -> bool {
        self.present.get(b as usize).copied().unwrap_or(false)
    }
    fn seek(&self, off: u64, data: bool) -> Result<u64, FsError> {
        if off >= self.size {
            return Err(FsError::NoData);
        }
        let mut b = off / BLOCK;
        while b * BLOCK < self.size && self.has(b) != data {
            b += 1;
        }
        if b * BLOCK >= self.size {
            return if data {
                Err(FsError::NoData)
            } else {
                Ok(self.size)
            };
        }
        Ok(off.max(b * BLOCK))
    }
}

fn probe(fs: &Betrfs, f: u64, m: &Model, rng: &mut Rng, when: &str) {
    // Every block edge of the first blocks, and random offsets everywhere.
    let mut offs: Vec<u64> = (0..64).map(|b| b * BLOCK).collect();
    offs.extend((0..200).map(|_| rng.below(SPAN * BLOCK + BLOCK)));
    offs.push(m.size.saturating_sub(1));
    offs.push(m.size);
    for off in offs {
        for data in [true, false] {
            assert_eq!(
                fs.seek_data(f, off, data),
                m.seek(off, data),
                "{when}: {} from {off} (size {})",
                if data { "SEEK_DATA" } else { "SEEK_HOLE" },
                m.size
            );
        }
    }
}

fn history(seed: u64) {
    let dev = Arc::new(MemDevice::new(4096, 32768).unwrap());
    mkfs(dev.clone()).unwrap();
    let mut fs = Betrfs::open(dev.clone(), MountOptions::default()).unwrap();
    let c = Ctx::root();
    let mut f = fs.mknod(fs.root(), b"sparse", REG, 0, &c).unwrap().ino;
    let mut m = Model::default();
    let mut rng = Rng(seed);
    for step in 0..300 {
        match rng.below(10) {
            0..=4 => {
                // Whole blocks, a run of them.
                let b = rng.below(SPAN);
                let n = 1 + rng.below(64);
                let len = n * BLOCK;
                fs.write(f, b * BLOCK, &vec![b as u8 | 1; len as usize], &c)
                    .unwrap();
                m.write(b * BLOCK, len);
            }
            5..=6 => {
                // A few bytes anywhere (an upsert into one block).
                let off = rng.below(SPAN * BLOCK);
                let len = 1 + rng.below(100);
                fs.write(f, off, &vec![7u8; len as usize], &c).unwrap();
                m.write(off, len);
            }
            7..=8 => {
                let b = rng.below(SPAN);
                let n = 1 + rng.below(256);
                fs.fallocate(f, b * BLOCK, n * BLOCK, PUNCH, &c).unwrap();
                m.punch(b, n);
            }
            _ => {
                let size = rng.below(m.size + 1);
                let set = SetAttr {
                    size: Some(size),
                    ..SetAttr::default()
                };
                fs.setattr(f, set, &c).unwrap();
                m.truncate(size);
            }
        }
        if step % 25 == 24 {
            probe(&fs, f, &m, &mut rng, &format!("seed {seed}, step {step}"));
        }
        if step % 100 == 99 {
            fs.unmount().unwrap();
            drop(fs);
            fs = Betrfs::open(dev.clone(), MountOptions::default()).unwrap();
            f = fs.lookup(fs.root(), b"sparse").unwrap().ino;
            probe(
                &fs,
                f,
                &m,
                &mut rng,
                &format!("seed {seed}, step {step}, remounted"),
            );
        }
    }
    let a = fs.getattr(f).unwrap();
    let blocks = m.present.iter().filter(|&&p| p).count() as u64;
    assert_eq!((a.size, a.blocks), (m.size, blocks * BLOCK / 512));
    fs.unmount().unwrap();
    drop(fs);
    let report = quilt_betrfs::fsck::fsck(dev, false).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn seeks_match_a_model_of_present_blocks() {
    for seed in [0x9e37_79b9_7f4a_7c15, 12345, 0xdead_beef] {
        history(seed);
    }
}
