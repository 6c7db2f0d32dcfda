//! A synthetic workload with the dependency shapes of a soft-updates file system, for the
//! demo and the benchmarks (until the ext2 module drives the engine for real).
//!
//! Per file: inode-bitmap bit → inode initialised → block-bitmap bit → data block zeroed
//! → data written → block pointer in the inode (after the bitmap bit and the zeroing) →
//! directory entry (after the inode). Every so often a file is removed (entry cleared →
//! inode cleared → bits freed), a directory inode's times change, a file is fsynced
//! (`flush_until`), and one in eight files is made inside a patchgroup chained to the
//! previous one, as a mail server would.

use crate::{ChangeOpts, Engine, PatchId, Result};

/// Block layout of the synthetic volume.
#[derive(Debug, Clone, Copy)]
pub struct SynthLayout {
    pub inode_bitmap: u64,
    pub block_bitmap: u64,
    pub inode_table: u64,
    pub inode_table_blocks: u64,
    pub dir_blocks: u64,
    pub first_dir_block: u64,
    pub first_data_block: u64,
}

impl SynthLayout {
    pub fn for_device(block_count: u64) -> Option<SynthLayout> {
        let l = SynthLayout {
            inode_bitmap: 1,
            block_bitmap: 2,
            inode_table: 3,
            inode_table_blocks: 32,
            first_dir_block: 40,
            dir_blocks: 32,
            first_data_block: 80,
        };
        (block_count > l.first_data_block + 64).then_some(l)
    }
}

/// What one run did.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct SynthReport {
    pub files_created: u64,
    pub files_removed: u64,
    pub changes: u64,
    pub fsyncs: u64,
}

/// The workload's random stream: ChaCha8 from a seed, the same run everywhere.
struct Rng(rand_chacha::ChaCha8Rng);
impl Rng {
    fn new(seed: u64) -> Rng {
        use rand::SeedableRng;
        Rng(rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64 {
        use rand::Rng as _;
        self.0.random_range(0..n.max(1))
    }
}

/// Runs the workload for `files` files, fsyncing a file every `fsync_every` files (0:
/// never). Does not sync at the end.
pub fn run(engine: &Engine, files: u64, seed: u64, fsync_every: u64) -> Result<SynthReport> {
    let bs = engine.block_size() as u64;
    let l = SynthLayout::for_device(engine.block_count()).ok_or(crate::PatchError::OutOfBlock {
        offset: 0,
        len: 0,
        block_size: bs as usize,
    })?;
    let mut rng = Rng::new(seed);
    let mut rep = SynthReport::default();
    let inodes_per_block = bs / 128;
    let inode_count = (l.inode_table_blocks * inodes_per_block).min(bs * 8);
    let data_blocks = (engine.block_count() - l.first_data_block).min(bs * 8);
    let dirents_per_block = bs / 32;
    let mut live: Vec<(u64, u64, u64, PatchId)> = Vec::new(); // (inode, data block, dirent slot, dirent patch)
    let mut group = None;
    let caller = 1;
    for f in 0..files {
        let in_group = f % 8 == 0;
        if in_group {
            let g = engine.pg_create();
            if let Some(prev) = group {
                engine.pg_add_depend(g, prev)?;
                engine.pg_abandon(prev)?;
            }
            engine.pg_release(g)?;
            engine.pg_engage(g, caller)?;
            group = Some(g);
        }
        let opts = ChangeOpts {
            caller: in_group.then_some(caller),
            data: false,
        };
        let data_opts = ChangeOpts { data: true, ..opts };
        // Numbers are handed out round robin, so a long run reuses inodes, blocks and
        // entries freed earlier (the shapes that need rollback).
        let ino = f % inode_count;
        let blk = l.first_data_block + f % data_blocks;
        let dslot = f % (l.dir_blocks * dirents_per_block);

        let ibit = engine.xor_bits(
            l.inode_bitmap,
            (ino / 32 * 4) as usize,
            1 << (ino % 32),
            &[],
            opts,
        )?;
        let iblock = l.inode_table + ino / inodes_per_block;
        let ioff = (ino % inodes_per_block * 128) as usize;
        let mut inode = [0u8; 128];
        inode[..8].copy_from_slice(&f.to_le_bytes());
        let init = engine.write(iblock, ioff, &inode, &[ibit], opts)?;
        let bbit = engine.xor_bits(
            l.block_bitmap,
            (blk % (bs * 8) / 32 * 4) as usize,
            1 << (blk % 32),
            &[],
            opts,
        )?;
        let zero = engine.zero_block(blk, &[bbit], data_opts)?;
        let len = 64 + rng.below(bs - 64) as usize;
        let content: Vec<u8> = (0..len).map(|i| (i as u64 ^ f) as u8).collect();
        engine.write(blk, 0, &content, &[], data_opts)?;
        let ptr = engine.write(
            iblock,
            ioff + 40,
            &(blk as u32).to_le_bytes(),
            &[bbit, zero],
            opts,
        )?;
        let dblock = l.first_dir_block + dslot / dirents_per_block;
        let doff = (dslot % dirents_per_block * 32) as usize;
        let mut dirent = [0u8; 32];
        dirent[..4].copy_from_slice(&(ino as u32 + 1).to_le_bytes());
        let de = engine.write(dblock, doff, &dirent, &[init, ptr], opts)?;
        // The directory's own inode: times change with every entry.
        engine.write(l.inode_table, 8, &f.to_le_bytes(), &[], opts)?;
        rep.changes += 8;
        rep.files_created += 1;
        live.push((ino, blk, dslot, de));

        if in_group {
            if let Some(g) = group {
                engine.pg_disengage(g, caller)?;
            }
        }
        if rng.below(4) == 0 && live.len() > 4 {
            let (ino, blk, dslot, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
            let dblock = l.first_dir_block + dslot / dirents_per_block;
            let doff = (dslot % dirents_per_block * 32) as usize;
            let gone = engine.write(dblock, doff, &[0u8; 32], &[], ChangeOpts::default())?;
            let iblock = l.inode_table + ino / inodes_per_block;
            let ioff = (ino % inodes_per_block * 128) as usize;
            let clear = engine.write(iblock, ioff, &[0u8; 128], &[gone], ChangeOpts::default())?;
            engine.xor_bits(
                l.inode_bitmap,
                (ino / 32 * 4) as usize,
                1 << (ino % 32),
                &[clear],
                ChangeOpts::default(),
            )?;
            engine.xor_bits(
                l.block_bitmap,
                (blk % (bs * 8) / 32 * 4) as usize,
                1 << (blk % 32),
                &[clear],
                ChangeOpts::default(),
            )?;
            rep.changes += 4;
            rep.files_removed += 1;
        }
        if fsync_every > 0 && f % fsync_every == fsync_every - 1 {
            if let Some(&(_, _, _, de)) = live.last() {
                engine.flush_until(de)?;
                rep.fsyncs += 1;
            }
        }
    }
    if let Some(g) = group {
        engine.pg_abandon(g)?;
    }
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineOptions;
    use quilt_block::MemDevice;
    use std::sync::Arc;

    #[test]
    fn synthetic_workload_runs_clean_under_every_configuration() {
        for (hard, merge) in [(false, false), (true, false), (false, true), (true, true)] {
            let dev = Arc::new(MemDevice::new(4096, 1024).unwrap());
            let e = Engine::new(
                dev,
                EngineOptions {
                    hard_patches: hard,
                    overlap_merge: merge,
                    ..EngineOptions::default()
                },
            );
            let r = run(&e, 300, 42, 64).unwrap();
            assert_eq!(r.fsyncs, 4);
            assert_eq!(r.files_created, 300);
            e.sync().unwrap();
            e.check_invariants().unwrap();
            assert_eq!(e.stats().patches_live, 0);
        }
    }
}
