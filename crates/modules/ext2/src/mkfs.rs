//! `mkfs`: lays out a fresh ext2 revision 1 image (filetype, sparse_super, large_file,
//! ext_attr) through the patch engine, with a root directory and lost+found, the way
//! Debian's mke2fs does for ext2.

use crate::format::*;
use quilt_patch::{ChangeOpts, Engine};
use quilt_vfs::FsError;

#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Inodes wanted; default one per 16 KiB, as mke2fs.
    pub inodes: Option<u32>,
    pub label: String,
    /// The device reads as zeros (a freshly created image file): inode tables need not be
    /// written.
    pub device_is_zeroed: bool,
    /// Owner of the root directory.
    pub root_uid: u32,
    pub root_gid: u32,
    /// Told (groups done, groups) after each block group is laid out: zeroing the inode
    /// tables of a large device that does not read as zeros takes minutes.
    pub progress: Option<Progress>,
}

/// A progress callback (`MkfsOptions::progress`).
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

pub const INODE_SIZE: u16 = 256;
/// Extra inode bytes in use: nanosecond timestamps and creation time.
pub const EXTRA_ISIZE: u16 = 32;
const LOST_FOUND_INO: u32 = 11;

struct Layout {
    sb: Superblock,
    /// Per group: (block bitmap, inode bitmap, inode table).
    groups: Vec<(u32, u32, u32)>,
}

fn layout(blocks: u64, bs: u32, opts: &MkfsOptions, uuid: [u8; 16]) -> Result<Layout, FsError> {
    if ![1024, 2048, 4096].contains(&bs) {
        return Err(FsError::Invalid("block size must be 1024, 2048 or 4096"));
    }
    let first_data_block = u32::from(bs == 1024);
    let bpg = 8 * bs;
    let mut blocks_count = u32::try_from(blocks.min(u32::MAX as u64)).unwrap_or(u32::MAX);
    let inode_size = INODE_SIZE as u32;
    let inodes_per_block = bs / inode_size;
    loop {
        if blocks_count < first_data_block + 64 {
            return Err(FsError::Invalid("image too small (at least 64 blocks)"));
        }
        let groups = (blocks_count - first_data_block).div_ceil(bpg);
        let want_inodes = opts
            .inodes
            .map(|n| n as u64)
            .unwrap_or(blocks_count as u64 * bs as u64 / 16384)
            .max(32);
        let mut ipg = want_inodes.div_ceil(groups as u64).max(16) as u32;
        ipg = ipg.div_ceil(inodes_per_block) * inodes_per_block;
        ipg = ipg.div_ceil(8) * 8;
        ipg = ipg.min(8 * bs);
        let mut sb = Superblock {
            inodes_count: ipg * groups,
            blocks_count,
            r_blocks_count: 0,
            free_blocks_count: 0,
            free_inodes_count: 0,
            first_data_block,
            log_block_size: bs.trailing_zeros() - 10,
            blocks_per_group: bpg,
            inodes_per_group: ipg,
            mtime: 0,
            wtime: 0,
            mnt_count: 0,
            state: STATE_VALID,
            rev_level: 1,
            first_ino: 11,
            inode_size: INODE_SIZE,
            feature_compat: COMPAT_EXT_ATTR,
            feature_incompat: INCOMPAT_FILETYPE,
            feature_ro_compat: RO_COMPAT_SPARSE_SUPER | RO_COMPAT_LARGE_FILE,
            reserved_gdt_blocks: 0,
            def_resuid: 0,
            def_resgid: 0,
            uuid,
            journal_inum: 0,
            journal_uuid: [0; 16],
            last_orphan: 0,
            jnl_blocks: [0; 17],
            jnl_backup_type: 0,
        };
        // The last group must hold its own metadata and some data; otherwise drop it.
        let last = groups - 1;
        let overhead = if sb.group_has_super(last) {
            1 + sb.gdt_blocks()
        } else {
            0
        } + 2
            + sb.inode_table_blocks();
        if sb.group_block_count(last) < overhead + 16 {
            if groups == 1 {
                return Err(FsError::Invalid("image too small for one block group"));
            }
            blocks_count = sb.group_first_block(last);
            continue;
        }
        sb.r_blocks_count = blocks_count / 20;
        let mut g = Vec::new();
        for i in 0..groups {
            let start = sb.group_first_block(i);
            let bb = start
                + if sb.group_has_super(i) {
                    1 + sb.gdt_blocks()
                } else {
                    0
                };
            g.push((bb, bb + 1, bb + 2));
        }
        return Ok(Layout { sb, groups: g });
    }
}

/// A version 4 UUID from the operating system's random source.
fn random_uuid() -> [u8; 16] {
    uuid::Uuid::new_v4().into_bytes()
}

fn set_bit(b: &mut [u8], i: u32) {
    b[(i / 8) as usize] |= 1 << (i % 8);
}

/// Writes a fresh file system onto the engine's device and makes it durable. Returns the
/// superblock written.
pub fn mkfs(engine: &Engine, opts: &MkfsOptions) -> Result<Superblock, FsError> {
    let io = FsError::from;
    let bs = engine.block_size() as u32;
    let Layout { mut sb, groups } = layout(engine.block_count(), bs, opts, random_uuid())?;
    let now = quilt_vfs::Timespec::now();
    let (now_lo, now_extra) = Inode::split_time(now);
    let itb = sb.inode_table_blocks();
    let ng = groups.len() as u32;
    let ipb = bs / INODE_SIZE as u32;
    let meta = ChangeOpts::default();
    let write_block = |blk: u32, data: &[u8]| -> Result<(), FsError> {
        engine
            .write(blk as u64, 0, data, &[], meta)
            .map(|_| ())
            .map_err(io)
    };

    // Data blocks for the root directory and lost+found, right after group 0's table.
    let root_blk = groups[0].2 + itb;
    let lf_blocks = (16384 / bs).min(NDIR_BLOCKS as u32);
    let lf_first = root_blk + 1;
    let used_data_g0 = 1 + lf_blocks;

    let mut descs = Vec::new();
    let mut free_blocks_total = 0u64;
    for g in 0..ng {
        let (bb, ib, it) = groups[g as usize];
        let start = sb.group_first_block(g);
        let count = sb.group_block_count(g);
        let mut bitmap = vec![0u8; bs as usize];
        let mut used = it + itb - start;
        if g == 0 {
            used += used_data_g0;
        }
        for i in 0..used {
            set_bit(&mut bitmap, i);
        }
        for i in count..8 * bs {
            set_bit(&mut bitmap, i);
        }
        write_block(bb, &bitmap)?;
        let mut ibitmap = vec![0u8; bs as usize];
        if g == 0 {
            for i in 0..LOST_FOUND_INO {
                set_bit(&mut ibitmap, i);
            }
        }
        for i in sb.inodes_per_group..8 * bs {
            set_bit(&mut ibitmap, i);
        }
        write_block(ib, &ibitmap)?;
        if !opts.device_is_zeroed {
            for b in it..it + itb {
                engine.zero_block(b as u64, &[], meta).map_err(io)?;
            }
        }
        let free_blocks = count - used;
        free_blocks_total += free_blocks as u64;
        descs.push(GroupDesc {
            block_bitmap: bb,
            inode_bitmap: ib,
            inode_table: it,
            free_blocks: free_blocks as u16,
            free_inodes: (sb.inodes_per_group - if g == 0 { LOST_FOUND_INO } else { 0 }) as u16,
            used_dirs: if g == 0 { 2 } else { 0 },
        });
        if let Some(p) = &opts.progress {
            (p.0)(u64::from(g) + 1, u64::from(ng));
        }
    }

    // Inodes 2 (root) and 11 (lost+found); the other reserved ones stay zero.
    let mk_inode = |mode: u16, links: u16, nblocks: u32, first: u32, uid: u32, gid: u32| {
        let mut ino = Inode {
            mode,
            uid,
            gid,
            size: (nblocks * bs) as u64,
            atime: now_lo,
            ctime: now_lo,
            mtime: now_lo,
            links,
            blocks: nblocks * (bs / 512),
            extra_isize: EXTRA_ISIZE,
            ctime_extra: now_extra,
            mtime_extra: now_extra,
            atime_extra: now_extra,
            crtime: now_lo,
            crtime_extra: now_extra,
            ..Default::default()
        };
        for i in 0..nblocks as usize {
            ino.block[i] = first + i as u32;
        }
        ino
    };
    let root = mk_inode(
        libc::S_IFDIR as u16 | 0o755,
        3,
        1,
        root_blk,
        opts.root_uid,
        opts.root_gid,
    );
    let lf = mk_inode(libc::S_IFDIR as u16 | 0o700, 2, lf_blocks, lf_first, 0, 0);
    let it0 = groups[0].2;
    let mut itable_block = vec![0u8; bs as usize];
    let isz = INODE_SIZE as usize;
    for (num, inode) in [(ROOT_INO, &root), (LOST_FOUND_INO, &lf)] {
        let idx = num - 1;
        let blk = it0 + idx / ipb;
        engine
            .with_block(blk as u64, |d| itable_block.copy_from_slice(d))
            .map_err(io)?;
        let off = (idx % ipb) as usize * isz;
        inode.encode_into(&mut itable_block[off..off + isz]);
        write_block(blk, &itable_block)?;
    }

    // Directory blocks.
    let dir_block = |me: u32, parent: u32| {
        let mut b = vec![0u8; bs as usize];
        encode_dirent(&mut b[0..], me, 12, b".", 2);
        encode_dirent(&mut b[12..], parent, bs as usize - 12, b"..", 2);
        b
    };
    let mut rootb = dir_block(ROOT_INO, ROOT_INO);
    // Root: ".", "..", "lost+found".
    put16(&mut rootb, 12 + 4, 12);
    encode_dirent(
        &mut rootb[24..],
        LOST_FOUND_INO,
        bs as usize - 24,
        b"lost+found",
        2,
    );
    write_block(root_blk, &rootb)?;
    write_block(lf_first, &dir_block(LOST_FOUND_INO, ROOT_INO))?;
    for i in 1..lf_blocks {
        let mut b = vec![0u8; bs as usize];
        put16(&mut b, 4, bs as u16);
        if bs == 65536 {
            put16(&mut b, 4, 0);
        }
        write_block(lf_first + i, &b)?;
    }

    // Descriptor tables and superblocks (primary and sparse backups).
    sb.free_blocks_count = free_blocks_total as u32;
    sb.free_inodes_count = sb.inodes_count - LOST_FOUND_INO;
    sb.mtime = 0;
    sb.wtime = now_lo;
    let mut gdt = vec![0u8; (sb.gdt_blocks() * bs) as usize];
    for (i, d) in descs.iter().enumerate() {
        gdt[i * GDESC_SIZE..(i + 1) * GDESC_SIZE].copy_from_slice(&d.encode());
    }
    let mut raw = vec![0u8; SUPERBLOCK_SIZE];
    sb.encode_into(&mut raw);
    put16(&mut raw, 0x36, 0xFFFF); // max mount count: -1 (no forced checks)
    put16(&mut raw, 0x3C, 1); // errors: continue
    put32(&mut raw, 0x40, now_lo); // last check
    put32(&mut raw, 0x108, now_lo); // mkfs time
    put16(&mut raw, 0x15C, EXTRA_ISIZE); // min extra isize
    put16(&mut raw, 0x15E, EXTRA_ISIZE); // want extra isize
    let label = opts.label.as_bytes();
    let n = label.len().min(16);
    raw[0x78..0x78 + n].copy_from_slice(&label[..n]);
    let hash_seed = random_uuid();
    raw[0xEC..0xFC].copy_from_slice(&hash_seed);
    raw[0xFC] = 1; // default hash: half_md4 (only used with dir_index)
    for g in 0..ng {
        if !sb.group_has_super(g) {
            continue;
        }
        let start = sb.group_first_block(g);
        put16(&mut raw, 0x5A, g as u16);
        let (sb_block, sb_off) = if g == 0 {
            (
                SUPERBLOCK_OFFSET as u32 / bs,
                (SUPERBLOCK_OFFSET % bs as u64) as usize,
            )
        } else {
            (start, 0)
        };
        let mut blk = vec![0u8; bs as usize];
        if sb_off > 0 {
            engine
                .with_block(sb_block as u64, |d| blk.copy_from_slice(d))
                .map_err(io)?;
        }
        blk[sb_off..sb_off + SUPERBLOCK_SIZE].copy_from_slice(&raw);
        write_block(sb_block, &blk)?;
        for i in 0..sb.gdt_blocks() {
            let chunk = &gdt[(i * bs) as usize..((i + 1) * bs) as usize];
            write_block(sb_block + 1 + i, chunk)?;
        }
    }
    engine.sync().map_err(io)?;
    Ok(sb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_drops_a_tiny_last_group() {
        let o = MkfsOptions::default();
        // 32768 blocks per group at 4 KiB: one full group plus 10 blocks.
        let l = layout(32768 + 10, 4096, &o, [0; 16]).unwrap();
        assert_eq!(l.sb.group_count(), 1);
        assert_eq!(l.sb.blocks_count, 32768);
    }

    #[test]
    fn sparse_super_groups() {
        let l = layout(32768 * 30, 4096, &MkfsOptions::default(), [0; 16]).unwrap();
        let with: Vec<u32> = (0..30).filter(|&g| l.sb.group_has_super(g)).collect();
        assert_eq!(with, vec![0, 1, 3, 5, 7, 9, 25, 27]);
    }

    #[test]
    fn refuses_bad_sizes() {
        assert!(layout(10, 4096, &MkfsOptions::default(), [0; 16]).is_err());
        assert!(layout(100_000, 512, &MkfsOptions::default(), [0; 16]).is_err());
    }
}
