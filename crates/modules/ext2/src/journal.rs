//! The ext3 journal as the ext2 module sees it: inode 8 holds a JBD2 journal
//! (`quilt_journal`); the superblock says so (`COMPAT_HAS_JOURNAL`, `journal_inum`, a
//! backup of the inode's block map) and asks for recovery after a crash
//! (`INCOMPAT_RECOVER`). Or the journal is on a device of its own (an *external*
//! journal, as `mke2fs -J device=`: `journal_inum` 0, `journal_uuid` its JBD2
//! superblock's UUID), the whole device one journal. Here: finding the journal on a raw
//! device, recovery before the file system is opened, and creating a journal (`mkfs
//! --journal`, `--journal-dev`), with the placement its commits prefer (ring or skip,
//! a compatible JBD2 feature the kernel ignores).

use crate::format::corrupt;
use crate::format::{
    le32, GroupDesc, Inode, Superblock, COMPAT_HAS_JOURNAL, DIND_BLOCK, GDESC_SIZE,
    INCOMPAT_RECOVER, IND_BLOCK, JOURNAL_INO, NDIR_BLOCKS, N_BLOCKS, SUPERBLOCK_OFFSET,
    SUPERBLOCK_SIZE, TIND_BLOCK,
};
use crate::fs::Ext2;
use quilt_block::BlockDevice;
use quilt_block::WriteClass;
use quilt_journal::{JournalMap, JournalSuper, RecoveryReport};
use quilt_vfs::FsError;
use quilt_vfs::Result;
use std::sync::Arc;

/// The journal size mke2fs picks for a file system of `blocks` blocks (0: too small for
/// one).
pub fn default_journal_blocks(blocks: u64) -> u32 {
    match blocks {
        b if b < 2048 => 0,
        b if b < 32768 => 1024,
        b if b < 256 * 1024 => 4096,
        b if b < 512 * 1024 => 8192,
        b if b < 4096 * 1024 => 16384,
        _ => 32768,
    }
}

pub(crate) fn jerr(e: quilt_journal::JournalError) -> FsError {
    match e {
        quilt_journal::JournalError::Corrupt(m) => FsError::Corrupt(m),
        quilt_journal::JournalError::Unsupported(m) => FsError::Corrupt(m),
        quilt_journal::JournalError::Block(e) => FsError::Io(quilt_vfs::IoError::caused_by(e)),
        quilt_journal::JournalError::Patch(e) => e.into(),
        e => FsError::Io(quilt_vfs::IoError::caused_by(e)),
    }
}

fn dev_err(e: quilt_block::BlockError) -> FsError {
    FsError::Io(quilt_vfs::IoError::caused_by(e))
}

/// Reads the superblock straight from the device.
fn read_super(dev: &dyn BlockDevice) -> Result<(Superblock, Vec<u8>, u64, usize)> {
    let bs = dev.block_size() as u64;
    let blk = SUPERBLOCK_OFFSET / bs;
    let off = (SUPERBLOCK_OFFSET % bs) as usize;
    let mut b = vec![0u8; bs as usize];
    dev.read(blk, &mut b).map_err(dev_err)?;
    let sb = Superblock::decode(&b[off..off + SUPERBLOCK_SIZE])?;
    Ok((sb, b, blk, off))
}

/// The journal inode's block map, read straight from the device (before a cache exists:
/// recovery must not leave stale copies behind).
pub fn journal_map(dev: &dyn BlockDevice, sb: &Superblock) -> Result<JournalMap> {
    let bs = sb.block_size();
    if bs as usize != dev.block_size() {
        return Err(FsError::Invalid(
            "device block size differs from the file system's",
        ));
    }
    let ino = sb.journal_inum;
    if ino == 0 || ino > sb.inodes_count {
        return Err(corrupt(format!("journal inode number {ino} is invalid")));
    }
    let read = |blk: u32| -> Result<Vec<u8>> {
        if blk < sb.first_data_block || blk >= sb.blocks_count {
            return Err(corrupt(format!(
                "journal block pointer {blk} is outside the file system"
            )));
        }
        let mut b = vec![0u8; bs as usize];
        dev.read(blk as u64, &mut b).map_err(dev_err)?;
        Ok(b)
    };
    let idx = ino - 1;
    let g = idx / sb.inodes_per_group;
    let gdt_first = sb.first_data_block + 1;
    let per_block = bs / GDESC_SIZE as u32;
    // Saturating: a damaged value lands outside the file system, which `read` refuses.
    let gdb = read(gdt_first.saturating_add(g / per_block))?;
    let o = (g % per_block) as usize * GDESC_SIZE;
    let gd = GroupDesc::decode(&gdb[o..o + GDESC_SIZE]);
    let isz = sb.inode_size as u64;
    let pos = (idx % sb.inodes_per_group) as u64 * isz;
    let it = read(gd.inode_table.saturating_add((pos / bs as u64) as u32))?;
    let io = (pos % bs as u64) as usize;
    let inode = Inode::decode(&it[io..io + sb.inode_size as usize]);
    if inode.mode & 0xF000 != 0x8000 {
        return Err(corrupt(format!(
            "journal inode {ino} is not a regular file (mode {:o})",
            inode.mode
        )));
    }
    let n = inode.size / bs as u64;
    if n < quilt_journal::format::MIN_BLOCKS as u64 || n > sb.blocks_count as u64 {
        return Err(corrupt(format!(
            "journal inode {ino} has size {} (need at least {} blocks)",
            inode.size,
            quilt_journal::format::MIN_BLOCKS
        )));
    }
    let ptrs = bs / 4;
    let mut out: Vec<u64> = Vec::with_capacity(n as usize);
    // Walks a subtree of `level` indirection under `blk`, appending data blocks.
    fn walk(
        blk: u32,
        level: u32,
        ptrs: u32,
        want: u64,
        out: &mut Vec<u64>,
        read: &dyn Fn(u32) -> Result<Vec<u8>>,
    ) -> Result<()> {
        if out.len() as u64 >= want {
            return Ok(());
        }
        if blk == 0 {
            return Err(corrupt("the journal inode has a hole".to_string()));
        }
        if level == 0 {
            out.push(blk as u64);
            return Ok(());
        }
        let b = read(blk)?;
        for i in 0..ptrs as usize {
            if out.len() as u64 >= want {
                break;
            }
            walk(le32(&b, 4 * i), level - 1, ptrs, want, out, read)?;
        }
        Ok(())
    }
    for i in 0..N_BLOCKS {
        let level = match i {
            i if i < NDIR_BLOCKS => 0,
            IND_BLOCK => 1,
            DIND_BLOCK => 2,
            TIND_BLOCK => 3,
            _ => unreachable!(),
        };
        walk(inode.block[i], level, ptrs, n, &mut out, &read)?;
    }
    Ok(JournalMap { blocks: out })
}

/// Where a file system's journal lives: the device that holds it (the file system's
/// own, or an external journal's) and its blocks there.
pub struct JournalPlace {
    pub dev: Arc<dyn BlockDevice>,
    pub map: JournalMap,
}

/// What ext2 asks for when it mounts in a journal mode: the journal at `place`, run
/// with `options` (from the mount options).
pub struct JournalRequest {
    pub place: JournalPlace,
    pub options: quilt_journal::JournalOptions,
}

/// Recovers and starts journals for ext2. The module knows where its journal is (its
/// format says) and when it may be replayed or started (before anything is cached;
/// after the superblock asks for recovery); the layer that wires stacks decides what
/// runs it and hands one of these in [`crate::MountOptions::journal`] (`quilt_stack`'s
/// is the JBD2 writer of `quilt_journal`).
pub trait JournalStarter: Send + Sync {
    /// Replays what a crash left in the journal at `place` onto `home`, the file
    /// system's device.
    fn recover(
        &self,
        home: &dyn BlockDevice,
        place: &JournalPlace,
    ) -> std::result::Result<RecoveryReport, quilt_journal::JournalError>;
    /// Takes over the (empty, recovered) journal and returns it as the engine's
    /// transaction service.
    fn start(
        &self,
        engine: &quilt_patch::Engine,
        req: JournalRequest,
    ) -> std::result::Result<Arc<dyn quilt_patch::Transactions>, quilt_journal::JournalError>;
}

/// The journal of the file system on `dev` (`jdev`: the external journal's device, if
/// it has one); None without a journal. `needs_recovery` tells whether the superblock
/// asks for a replay.
pub fn locate(
    dev: &Arc<dyn BlockDevice>,
    jdev: Option<&Arc<dyn BlockDevice>>,
) -> Result<Option<(JournalPlace, bool)>> {
    let (sb, _, _, _) = read_super(dev.as_ref())?;
    let needs = sb.feature_incompat & INCOMPAT_RECOVER != 0;
    if crate::extjournal::external(&sb) {
        let Some(jdev) = jdev else {
            return Err(FsError::Invalid(
                "the file system's journal is on a device of its own: give it (journal_dev=PATH)",
            ));
        };
        let map = crate::extjournal::open_map(&sb, jdev.as_ref())?;
        return Ok(Some((
            JournalPlace {
                dev: jdev.clone(),
                map,
            },
            needs,
        )));
    }
    if sb.feature_compat & COMPAT_HAS_JOURNAL == 0 || sb.journal_inum == 0 {
        if needs {
            return Err(corrupt(
                "the superblock asks for journal recovery but names no journal".to_string(),
            ));
        }
        return Ok(None);
    }
    let map = journal_map(dev.as_ref(), &sb)?;
    Ok(Some((
        JournalPlace {
            dev: dev.clone(),
            map,
        },
        needs,
    )))
}

/// Replays the journal of the file system on `dev` through `starter` if the superblock
/// asks for it, and clears the request. Must run before anything caches the device's
/// blocks. None when there is no journal or nothing to do.
pub fn recover_with(
    dev: &Arc<dyn BlockDevice>,
    jdev: Option<&Arc<dyn BlockDevice>>,
    starter: &dyn JournalStarter,
) -> Result<Option<RecoveryReport>> {
    let (sb, _, _, _) = read_super(dev.as_ref())?;
    if sb.feature_incompat & INCOMPAT_RECOVER == 0 {
        return Ok(None);
    }
    if crate::extjournal::external(&sb) && jdev.is_none() {
        return Err(FsError::Invalid(
            "the file system's journal is on a device of its own and needs recovery: give it (journal_dev=PATH)",
        ));
    }
    let Some((place, _)) = locate(dev, jdev)? else {
        return Ok(None);
    };
    let report = starter.recover(dev.as_ref(), &place).map_err(jerr)?;
    clear_recover(dev.as_ref())?;
    tracing::info!(
        "journal recovery: {} transactions, {} blocks replayed, {} revoked",
        report.transactions,
        report.blocks_replayed,
        report.blocks_revoked
    );
    Ok(Some(report))
}

/// Clears the superblock's recovery request after a replay (which may have rewritten the
/// superblock's block: it is read again).
fn clear_recover(dev: &dyn BlockDevice) -> Result<()> {
    let (mut sb, mut raw, blk, off) = read_super(dev)?;
    sb.feature_incompat &= !INCOMPAT_RECOVER;
    sb.encode_into(&mut raw[off..off + SUPERBLOCK_SIZE]);
    dev.write(blk, &raw, WriteClass::Metadata)
        .map_err(dev_err)?;
    dev.flush().map_err(dev_err)?;
    Ok(())
}

/// Makes all of `jdev` an empty external journal for the file system on `dev`, and
/// points the file system's superblock at it (as `mke2fs -J device=` over a device made
/// by `mke2fs -O journal_dev`: see `extjournal`). `skip`: its commits prefer log
/// skipping. The file system must have no journal yet, and must not be mounted.
pub fn attach_external_journal(
    dev: &dyn BlockDevice,
    jdev: &dyn BlockDevice,
    skip: bool,
) -> Result<()> {
    let (mut sb, mut raw, blk, off) = read_super(dev)?;
    if sb.feature_compat & COMPAT_HAS_JOURNAL != 0 {
        return Err(FsError::Exists);
    }
    let uuid = crate::extjournal::format(&sb, jdev, skip)?;
    sb.feature_compat |= COMPAT_HAS_JOURNAL;
    sb.journal_inum = 0;
    sb.journal_uuid = uuid;
    sb.encode_into(&mut raw[off..off + SUPERBLOCK_SIZE]);
    dev.write(blk, &raw, WriteClass::Metadata)
        .map_err(dev_err)?;
    dev.flush().map_err(dev_err)?;
    Ok(())
}

impl Ext2 {
    /// Gives the file system an empty JBD2 journal of `blocks` blocks in inode 8 (as
    /// `mke2fs -j`), making it ext3. The journal's blocks are placed from the middle
    /// block group on.
    pub fn create_journal(&self, blocks: u32) -> Result<()> {
        self.create_journal_for(blocks, false)
    }

    /// As `create_journal`; `skip`: its commits prefer log skipping.
    pub fn create_journal_for(&self, blocks: u32, skip: bool) -> Result<()> {
        self.check_writable()?;
        if blocks < quilt_journal::format::MIN_BLOCKS {
            return Err(FsError::Invalid("a journal needs at least 1024 blocks"));
        }
        let op = &self.begin_internal();
        let mut st = self.lock();
        if st.sb.feature_compat & COMPAT_HAS_JOURNAL != 0 {
            return Err(FsError::Exists);
        }
        let bs = self.geo.bs;
        // Room for the journal and its map blocks, checked first: a journal that does
        // not fit fails before a block is taken.
        let n = blocks as u64;
        if (st.sb.free_blocks_count as u64) < n + map_blocks(n, (bs / 4) as u64) {
            return Err(FsError::NoSpace);
        }
        let mut inode = self.new_inode(libc::S_IFREG | 0o600, 0, 0);
        inode.links = 1;
        let ino = JOURNAL_INO;
        let groups = st.gd.len() as u32;
        let mid = groups / 2;
        let mut goal = st.gd[mid as usize].inode_table + self.geo.itb;
        let mut deferred = Vec::new();
        let zero = vec![0u8; bs as usize];
        for lblk in 0..blocks as u64 {
            let content = if lblk == 0 {
                let mut b = zero.clone();
                let mut jsb = JournalSuper::new(bs, blocks, st.sb.uuid);
                if skip {
                    jsb.feature_compat |= quilt_journal::skip::COMPAT_PREFER_SKIP;
                }
                jsb.encode_into(&mut b);
                b
            } else {
                zero.clone()
            };
            let (b, _) = self.bmap_alloc(
                op,
                &mut st,
                ino,
                &mut inode,
                lblk,
                &content,
                &[],
                false,
                goal,
                Some(&mut deferred),
            )?;
            goal = b + 1;
        }
        inode.size = blocks as u64 * bs as u64;
        let h = self.write_inode(op, &st, ino, &inode, &deferred)?;
        self.track(&mut st, ino, h);
        st.sb.feature_compat |= COMPAT_HAS_JOURNAL;
        st.sb.journal_inum = ino;
        for i in 0..N_BLOCKS {
            st.sb.jnl_blocks[i] = inode.block[i];
        }
        st.sb.jnl_blocks[15] = (inode.size >> 32) as u32;
        st.sb.jnl_blocks[16] = inode.size as u32;
        st.sb.jnl_backup_type = 1;
        self.write_groups(op, &mut st)?;
        self.write_super(op, &mut st)?;
        drop(st);
        self.engine().sync().map_err(Self::io)
    }

    /// Takes over the image's journal for the journal modes (after recovery at open),
    /// through the mount's journal starter: on its own device if it is external, with
    /// the placement the mount asks for or the one the journal was made for.
    pub(crate) fn start_journal(
        &self,
        mode: crate::Mode,
        mo: &crate::MountOptions,
        starter: &dyn JournalStarter,
    ) -> Result<Arc<dyn quilt_patch::Transactions>> {
        let sb = self.read_lock().sb.clone();
        let home = self.engine().device().clone();
        let jdev = mo.journal_device.as_ref().map(|j| &j.0);
        let Some((place, _)) = locate(&home, jdev)? else {
            return Err(FsError::Invalid(
                "the journal modes need an ext3 image with a journal (quiltfs mkfs --journal)",
            ));
        };
        let placement = match mo.journal_placement {
            Some(p) => p,
            None => {
                let mut raw = vec![0u8; place.dev.block_size()];
                place
                    .dev
                    .read(place.map.device_block(0).map_err(jerr)?, &mut raw)
                    .map_err(dev_err)?;
                let jsb =
                    JournalSuper::decode(&raw, sb.block_size(), place.map.len()).map_err(jerr)?;
                if jsb.feature_compat & quilt_journal::skip::COMPAT_PREFER_SKIP != 0 {
                    quilt_journal::Placement::Skip
                } else {
                    quilt_journal::Placement::Ring
                }
            }
        };
        let options = quilt_journal::JournalOptions {
            data: mode == crate::Mode::FullJournal,
            placement,
            observer: mo.journal_observer.clone(),
            forced_checkpoints_only: mo.journal_forced_checkpoints_only,
            ..Default::default()
        };
        self.journal_blocks
            .store(place.map.len(), std::sync::atomic::Ordering::Relaxed);
        starter
            .start(self.engine(), JournalRequest { place, options })
            .map_err(jerr)
    }
}

/// Map blocks (indirect, double and triple indirect) a file of `n` blocks needs, with
/// `ppb` pointers per block.
fn map_blocks(n: u64, ppb: u64) -> u64 {
    let mut left = n.saturating_sub(12);
    let mut maps = 0;
    // Single indirect.
    if left > 0 {
        maps += 1;
        left = left.saturating_sub(ppb);
    }
    // Double indirect: itself and one indirect block per `ppb`.
    if left > 0 {
        let here = left.min(ppb * ppb);
        maps += 1 + here.div_ceil(ppb);
        left -= here;
    }
    // Triple indirect: itself, a double indirect per `ppb²`, an indirect per `ppb`.
    if left > 0 {
        maps += 1 + left.div_ceil(ppb * ppb) + left.div_ceil(ppb);
    }
    maps
}

#[cfg(test)]
mod map_tests {
    use super::map_blocks;

    #[test]
    fn map_blocks_counts_each_level() {
        assert_eq!(map_blocks(12, 1024), 0);
        assert_eq!(map_blocks(13, 1024), 1);
        assert_eq!(map_blocks(12 + 1024, 1024), 1);
        assert_eq!(map_blocks(12 + 1024 + 1, 1024), 3);
        assert_eq!(map_blocks(16384, 1024), 1 + 1 + 15);
        assert_eq!(
            map_blocks(12 + 256 + 65536 + 1, 256),
            1 + 1 + 256 + 1 + 1 + 1
        );
    }
}
