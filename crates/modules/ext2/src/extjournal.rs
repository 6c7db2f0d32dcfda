//! An ext3 journal on a device of its own (an *external* journal), in the layout of
//! `mke2fs -O journal_dev` that the kernel (`mount -o journal_path=`) and `e2fsck -j`
//! read:
//! - at byte 1024 of the journal device, an ext2 superblock with only the
//!   `journal_dev` incompatible feature, the device's size and block size, and the
//!   journal's UUID (which the file system's superblock names in `journal_uuid`, with
//!   `journal_inum` 0);
//! - in the block after it (1 with 4 KiB blocks, 2 with 1 KiB), the JBD2 superblock,
//!   whose users list holds the file system's UUID;
//! - the log from the block after that to the device's end. Journal block numbers are
//!   device block numbers (the kernel adds no offset), except that journal block 0, the
//!   superblock, is where the JBD2 superblock lies.

use crate::format::{le32, Superblock, COMPAT_HAS_JOURNAL, SUPERBLOCK_OFFSET, SUPERBLOCK_SIZE};
use quilt_block::BlockDevice;
use quilt_block::WriteClass;
use quilt_journal::{JournalMap, JournalSuper};
use quilt_vfs::{FsError, Result};

/// The ext2 incompatible feature of a journal device.
pub const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
const EXT2_MAGIC: u16 = 0xEF53;
/// Offset of `s_users` in the JBD2 superblock (16 bytes per user).
const JSB_USERS: usize = 0x100;

/// The device block of the JBD2 superblock on a journal device of block size `bs`.
pub fn jsb_block(bs: u32) -> u64 {
    SUPERBLOCK_OFFSET / bs as u64 + 1
}

fn dev_err(e: quilt_block::BlockError) -> FsError {
    FsError::Io(quilt_vfs::IoError::caused_by(e))
}

/// Whether the superblock names an external journal.
pub fn external(sb: &Superblock) -> bool {
    sb.feature_compat & COMPAT_HAS_JOURNAL != 0
        && sb.journal_inum == 0
        && sb.journal_uuid != [0; 16]
}

/// The journal map of an external journal of `blocks` blocks with block size `bs`.
fn map(bs: u32, blocks: u64) -> JournalMap {
    let mut m = JournalMap::whole_device(blocks);
    m.blocks[0] = jsb_block(bs);
    m
}

/// The journal device's own superblock: its size in blocks and its UUID, checked.
fn read_dev_super(jdev: &dyn BlockDevice, bs: u32) -> Result<(u64, [u8; 16])> {
    let blk = SUPERBLOCK_OFFSET / bs as u64;
    let off = (SUPERBLOCK_OFFSET % bs as u64) as usize;
    let mut b = vec![0u8; bs as usize];
    jdev.read(blk, &mut b).map_err(dev_err)?;
    let s = &b[off..off + SUPERBLOCK_SIZE];
    if u16::from_le_bytes([s[0x38], s[0x39]]) != EXT2_MAGIC
        || le32(s, 0x60) & INCOMPAT_JOURNAL_DEV == 0
    {
        return Err(FsError::Invalid(
            "the journal device holds no journal (no journal_dev superblock at byte 1024)",
        ));
    }
    if 1024u64 << le32(s, 0x18).min(16) != bs as u64 {
        return Err(FsError::Invalid(
            "the journal device's block size differs from the file system's",
        ));
    }
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&s[0x68..0x78]);
    Ok((le32(s, 0x04) as u64, uuid))
}

/// The external journal on `jdev`, checked against the file system's superblock: its
/// map.
pub fn open_map(sb: &Superblock, jdev: &dyn BlockDevice) -> Result<JournalMap> {
    let bs = sb.block_size();
    if jdev.block_size() != bs as usize {
        return Err(FsError::Invalid(
            "the journal device's block size differs from the file system's",
        ));
    }
    let (blocks, uuid) = read_dev_super(jdev, bs)?;
    if uuid != sb.journal_uuid {
        return Err(FsError::Invalid(
            "the journal device is not this file system's journal (its UUID differs)",
        ));
    }
    if blocks > jdev.block_count() || blocks > u32::MAX as u64 {
        return Err(FsError::Corrupt(format!(
            "the journal device's superblock says {blocks} blocks; the device holds {}",
            jdev.block_count()
        )));
    }
    let m = map(bs, blocks);
    let mut raw = vec![0u8; bs as usize];
    jdev.read(jsb_block(bs), &mut raw).map_err(dev_err)?;
    let jsb = JournalSuper::decode(&raw, bs, blocks as u32).map_err(crate::journal::jerr)?;
    if jsb.first as u64 <= jsb_block(bs) {
        return Err(FsError::Corrupt(format!(
            "the external journal's log starts at block {}, inside its superblocks",
            jsb.first
        )));
    }
    Ok(m)
}

/// Makes all of `jdev` an empty external journal for the file system whose superblock
/// is `sb` (as `mke2fs -O journal_dev` then `mke2fs -J device=`): writes its two
/// superblocks and zeroes its log. Returns the journal's UUID, for the file system's
/// `journal_uuid`. `skip`: its commits prefer log skipping.
pub fn format(sb: &Superblock, jdev: &dyn BlockDevice, skip: bool) -> Result<[u8; 16]> {
    let bs = sb.block_size();
    if jdev.block_size() != bs as usize {
        return Err(FsError::Invalid(
            "the journal device's block size differs from the file system's",
        ));
    }
    let blocks = jdev.block_count().min(u32::MAX as u64) as u32;
    if blocks < quilt_journal::format::MIN_BLOCKS {
        return Err(FsError::Invalid("a journal needs at least 1024 blocks"));
    }
    // A UUID of its own: the file system's, with its last byte changed.
    let mut uuid = sb.uuid;
    uuid[15] ^= 0x5a;
    // The log first: nothing in it may pass for a record of this journal.
    let zero = vec![0u8; bs as usize * 256];
    let mut at = 0u64;
    while at < blocks as u64 {
        let n = (blocks as u64 - at).min(256);
        jdev.write_blocks(at, &zero[..n as usize * bs as usize], WriteClass::Metadata)
            .map_err(dev_err)?;
        at += n;
    }
    // The device's ext2 superblock.
    let blk = SUPERBLOCK_OFFSET / bs as u64;
    let off = (SUPERBLOCK_OFFSET % bs as u64) as usize;
    let mut b = vec![0u8; bs as usize];
    {
        let s = &mut b[off..off + SUPERBLOCK_SIZE];
        let put32 = |s: &mut [u8], o: usize, v: u32| s[o..o + 4].copy_from_slice(&v.to_le_bytes());
        let put16 = |s: &mut [u8], o: usize, v: u16| s[o..o + 2].copy_from_slice(&v.to_le_bytes());
        let log = bs.trailing_zeros() - 10;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as u32);
        put32(s, 0x04, blocks);
        put32(s, 0x14, u32::from(bs == 1024)); // first data block
        put32(s, 0x18, log);
        put32(s, 0x1C, log);
        put32(s, 0x20, bs * 8); // blocks per group
        put32(s, 0x24, bs * 8);
        put32(s, 0x30, now); // written
        put16(s, 0x36, 0xFFFF); // max mount count: none
        put16(s, 0x38, EXT2_MAGIC);
        put16(s, 0x3A, 1); // clean
        put16(s, 0x3C, 1); // errors: continue
        put32(s, 0x40, now); // checked
        put32(s, 0x4C, 1); // dynamic revision
        put32(s, 0x54, 11); // first inode
        put16(s, 0x58, 256); // inode size
        put32(s, 0x60, INCOMPAT_JOURNAL_DEV);
        s[0x68..0x78].copy_from_slice(&uuid);
    }
    jdev.write(blk, &b, WriteClass::Metadata).map_err(dev_err)?;
    // The JBD2 superblock, with the file system as its one user.
    let mut jsb = JournalSuper::new(bs, blocks, uuid);
    jsb.first = jsb_block(bs) as u32 + 1;
    if skip {
        jsb.feature_compat |= quilt_journal::skip::COMPAT_PREFER_SKIP;
    }
    let mut j = vec![0u8; bs as usize];
    jsb.encode_into(&mut j);
    j[JSB_USERS..JSB_USERS + 16].copy_from_slice(&sb.uuid);
    jdev.write(jsb_block(bs), &j, WriteClass::Metadata)
        .map_err(dev_err)?;
    jdev.flush().map_err(dev_err)?;
    Ok(uuid)
}
