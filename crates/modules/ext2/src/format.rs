//! The ext2 on-disk format: superblock, group descriptors, inodes and directory entries,
//! decoded with validation (a damaged field is an error, never a panic) and encoded back.
//! Little-endian throughout. Field offsets follow the kernel's
//! Documentation/filesystems/ext4 pages.

use quilt_vfs::FsError;

pub const SUPERBLOCK_OFFSET: u64 = 1024;
pub const SUPERBLOCK_SIZE: usize = 1024;
pub const MAGIC: u16 = 0xEF53;
pub const ROOT_INO: u32 = 2;
pub const GOOD_OLD_INODE_SIZE: usize = 128;
pub const GDESC_SIZE: usize = 32;
pub const NDIR_BLOCKS: usize = 12;
pub const IND_BLOCK: usize = 12;
pub const DIND_BLOCK: usize = 13;
pub const TIND_BLOCK: usize = 14;
pub const N_BLOCKS: usize = 15;
pub const NAME_MAX: usize = 255;
/// Fast symlinks keep their target in `i_block` when it is shorter than this.
pub const FAST_SYMLINK_MAX: usize = 60;
/// Hard links to a file, and subdirectories of a directory (by its link count): the
/// kernel's limit for ext2 images (its ext4 driver, which serves them, allows 65,000).
pub const LINK_MAX: u16 = 65000;

pub const STATE_VALID: u16 = 1;
pub const STATE_ERROR: u16 = 2;

pub const COMPAT_DIR_PREALLOC: u32 = 0x1;
pub const COMPAT_IMAGIC_INODES: u32 = 0x2;
pub const COMPAT_HAS_JOURNAL: u32 = 0x4;
pub const COMPAT_EXT_ATTR: u32 = 0x8;
pub const COMPAT_RESIZE_INODE: u32 = 0x10;
pub const COMPAT_DIR_INDEX: u32 = 0x20;
pub const INCOMPAT_FILETYPE: u32 = 0x2;
pub const INCOMPAT_RECOVER: u32 = 0x4;
pub const RO_COMPAT_SPARSE_SUPER: u32 = 0x1;
pub const RO_COMPAT_LARGE_FILE: u32 = 0x2;

pub const INCOMPAT_SUPPORTED: u32 = INCOMPAT_FILETYPE;
pub const RO_COMPAT_SUPPORTED: u32 = RO_COMPAT_SPARSE_SUPER | RO_COMPAT_LARGE_FILE;

/// Inode flag: the directory has an htree index (we keep directories linear and clear it
/// on the first change, as the kernel's ext2 does).
pub const INDEX_FL: u32 = 0x1000;

/// The names e2fsprogs gives the feature bits (`dumpe2fs -h`), those this module knows
/// and the common ones it refuses, in compat, incompat, ro_compat order; a bit without a
/// name is shown as its mask (`incompat:0x20000`).
pub fn feature_names(compat: u32, incompat: u32, ro_compat: u32) -> Vec<String> {
    const COMPAT: &[(u32, &str)] = &[
        (COMPAT_DIR_PREALLOC, "dir_prealloc"),
        (COMPAT_IMAGIC_INODES, "imagic_inodes"),
        (COMPAT_HAS_JOURNAL, "has_journal"),
        (COMPAT_EXT_ATTR, "ext_attr"),
        (COMPAT_RESIZE_INODE, "resize_inode"),
        (COMPAT_DIR_INDEX, "dir_index"),
        (0x200, "sparse_super2"),
    ];
    const INCOMPAT: &[(u32, &str)] = &[
        (0x1, "compression"),
        (INCOMPAT_FILETYPE, "filetype"),
        (INCOMPAT_RECOVER, "needs_recovery"),
        (0x8, "journal_dev"),
        (0x10, "meta_bg"),
        (0x40, "extent"),
        (0x80, "64bit"),
        (0x100, "mmp"),
        (0x200, "flex_bg"),
        (0x400, "ea_inode"),
        (0x1000, "dirdata"),
        (0x2000, "metadata_csum_seed"),
        (0x4000, "large_dir"),
        (0x8000, "inline_data"),
        (0x10000, "encrypt"),
        (0x20000, "casefold"),
    ];
    const RO_COMPAT: &[(u32, &str)] = &[
        (RO_COMPAT_SPARSE_SUPER, "sparse_super"),
        (RO_COMPAT_LARGE_FILE, "large_file"),
        (0x4, "btree_dir"),
        (0x8, "huge_file"),
        (0x10, "uninit_bg"),
        (0x20, "dir_nlink"),
        (0x40, "extra_isize"),
        (0x100, "quota"),
        (0x200, "bigalloc"),
        (0x400, "metadata_csum"),
        (0x1000, "read-only"),
        (0x2000, "project"),
        (0x8000, "verity"),
        (0x10000, "orphan_present"),
    ];
    let mut out = Vec::new();
    for (kind, mask, table) in [
        ("compat", compat, COMPAT),
        ("incompat", incompat, INCOMPAT),
        ("ro_compat", ro_compat, RO_COMPAT),
    ] {
        let mut left = mask;
        for &(bit, name) in table {
            if mask & bit != 0 {
                out.push(name.to_string());
                left &= !bit;
            }
        }
        for i in 0..32 {
            if left & (1 << i) != 0 {
                out.push(format!("{kind}:{:#x}", 1u32 << i));
            }
        }
    }
    out
}

pub fn corrupt(what: impl Into<String>) -> FsError {
    FsError::Corrupt(what.into())
}

pub fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
pub fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
pub fn put16(b: &mut [u8], o: usize, v: u16) {
    b[o..o + 2].copy_from_slice(&v.to_le_bytes());
}
pub fn put32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_le_bytes());
}

/// The superblock fields quiltfs reads or maintains. Unknown fields are kept by writing
/// only the fields we change (see `encode_into`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub inodes_count: u32,
    pub blocks_count: u32,
    pub r_blocks_count: u32,
    pub free_blocks_count: u32,
    pub free_inodes_count: u32,
    pub first_data_block: u32,
    pub log_block_size: u32,
    pub blocks_per_group: u32,
    pub inodes_per_group: u32,
    pub mtime: u32,
    pub wtime: u32,
    pub mnt_count: u16,
    pub state: u16,
    pub rev_level: u32,
    pub first_ino: u32,
    pub inode_size: u16,
    pub feature_compat: u32,
    pub feature_incompat: u32,
    pub feature_ro_compat: u32,
    /// Group-descriptor blocks reserved for growth after each copy of the table
    /// (`resize_inode`, as Debian's mke2fs makes): overhead, not free space.
    pub reserved_gdt_blocks: u16,
    /// Who may use the reserved blocks (`r_blocks_count`) besides root.
    pub def_resuid: u16,
    pub def_resgid: u16,
    pub uuid: [u8; 16],
    /// The journal's inode (8) when `COMPAT_HAS_JOURNAL`; 0 otherwise, or when the journal
    /// is on a device of its own (an external journal, named by `journal_uuid`).
    pub journal_inum: u32,
    /// The external journal's UUID (its JBD2 superblock's).
    pub journal_uuid: [u8; 16],
    /// The head of the on-disk orphan list (inodes chained through `dtime`), 0 if empty.
    pub last_orphan: u32,
    /// A copy of the journal inode's block map (15 words), its size high and low, for
    /// e2fsck when the inode is damaged.
    pub jnl_blocks: [u32; 17],
    /// 1 (`EXT3_JNL_BACKUP_BLOCKS`) when `jnl_blocks` is valid.
    pub jnl_backup_type: u8,
}

/// The journal's inode number.
pub const JOURNAL_INO: u32 = 8;

impl Superblock {
    /// Decodes and validates the 1024-byte superblock.
    pub fn decode(b: &[u8]) -> Result<Superblock, FsError> {
        if b.len() < SUPERBLOCK_SIZE {
            return Err(corrupt("superblock is truncated"));
        }
        if le16(b, 0x38) != MAGIC {
            return Err(corrupt(format!(
                "bad superblock magic {:#06x} (not an ext2/3/4 image)",
                le16(b, 0x38)
            )));
        }
        let rev_level = le32(b, 0x4C);
        let (first_ino, inode_size) = if rev_level == 0 {
            (11, GOOD_OLD_INODE_SIZE as u16)
        } else {
            (le32(b, 0x54), le16(b, 0x58))
        };
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[0x68..0x78]);
        let mut journal_uuid = [0u8; 16];
        journal_uuid.copy_from_slice(&b[0xD0..0xE0]);
        let sb = Superblock {
            inodes_count: le32(b, 0x00),
            blocks_count: le32(b, 0x04),
            r_blocks_count: le32(b, 0x08),
            free_blocks_count: le32(b, 0x0C),
            free_inodes_count: le32(b, 0x10),
            first_data_block: le32(b, 0x14),
            log_block_size: le32(b, 0x18),
            blocks_per_group: le32(b, 0x20),
            inodes_per_group: le32(b, 0x28),
            mtime: le32(b, 0x2C),
            wtime: le32(b, 0x30),
            mnt_count: le16(b, 0x34),
            state: le16(b, 0x3A),
            rev_level,
            first_ino,
            inode_size,
            feature_compat: if rev_level == 0 { 0 } else { le32(b, 0x5C) },
            feature_incompat: if rev_level == 0 { 0 } else { le32(b, 0x60) },
            feature_ro_compat: if rev_level == 0 { 0 } else { le32(b, 0x64) },
            reserved_gdt_blocks: if rev_level == 0 { 0 } else { le16(b, 0xCE) },
            def_resuid: le16(b, 0x50),
            def_resgid: le16(b, 0x52),
            uuid,
            journal_inum: le32(b, 0xE0),
            journal_uuid,
            last_orphan: le32(b, 0xE8),
            jnl_blocks: std::array::from_fn(|i| le32(b, 0x10C + 4 * i)),
            jnl_backup_type: b[0xFD],
        };
        sb.validate()?;
        Ok(sb)
    }

    fn validate(&self) -> Result<(), FsError> {
        if self.log_block_size > 2 {
            return Err(corrupt(format!(
                "block size 1024<<{} is not supported (1, 2 or 4 KiB)",
                self.log_block_size
            )));
        }
        let bs = self.block_size();
        if self.first_data_block != u32::from(bs == 1024) {
            return Err(corrupt(format!(
                "first data block {} does not match block size {bs}",
                self.first_data_block
            )));
        }
        if self.blocks_per_group == 0 || self.blocks_per_group > 8 * bs {
            return Err(corrupt(format!(
                "blocks per group {} out of range",
                self.blocks_per_group
            )));
        }
        if self.inodes_per_group == 0 || self.inodes_per_group > 8 * bs {
            return Err(corrupt(format!(
                "inodes per group {} out of range",
                self.inodes_per_group
            )));
        }
        let isz = self.inode_size as u32;
        if isz < GOOD_OLD_INODE_SIZE as u32 || isz > bs || !isz.is_power_of_two() {
            return Err(corrupt(format!("inode size {isz} is invalid")));
        }
        if self.blocks_count <= self.first_data_block {
            return Err(corrupt("block count is too small"));
        }
        if (self.inodes_count as u64) != self.group_count() as u64 * self.inodes_per_group as u64 {
            return Err(corrupt(format!(
                "inode count {} is not groups × inodes per group ({} × {})",
                self.inodes_count,
                self.group_count(),
                self.inodes_per_group
            )));
        }
        if self.first_ino < 11 || self.first_ino >= self.inodes_count {
            return Err(corrupt(format!(
                "first inode {} is invalid",
                self.first_ino
            )));
        }
        Ok(())
    }

    /// Writes the fields this struct owns into a 1024-byte superblock image.
    pub fn encode_into(&self, b: &mut [u8]) {
        put32(b, 0x00, self.inodes_count);
        put32(b, 0x04, self.blocks_count);
        put32(b, 0x08, self.r_blocks_count);
        put32(b, 0x0C, self.free_blocks_count);
        put32(b, 0x10, self.free_inodes_count);
        put32(b, 0x14, self.first_data_block);
        put32(b, 0x18, self.log_block_size);
        put32(b, 0x1C, self.log_block_size);
        put32(b, 0x20, self.blocks_per_group);
        put32(b, 0x24, self.blocks_per_group);
        put32(b, 0x28, self.inodes_per_group);
        put32(b, 0x2C, self.mtime);
        put32(b, 0x30, self.wtime);
        put16(b, 0x34, self.mnt_count);
        put16(b, 0x38, MAGIC);
        put16(b, 0x3A, self.state);
        put32(b, 0x4C, self.rev_level);
        if self.rev_level > 0 {
            put32(b, 0x54, self.first_ino);
            put16(b, 0x58, self.inode_size);
            put32(b, 0x5C, self.feature_compat);
            put32(b, 0x60, self.feature_incompat);
            put32(b, 0x64, self.feature_ro_compat);
        }
        b[0x68..0x78].copy_from_slice(&self.uuid);
        b[0xD0..0xE0].copy_from_slice(&self.journal_uuid);
        put32(b, 0xE0, self.journal_inum);
        put32(b, 0xE8, self.last_orphan);
        for (i, w) in self.jnl_blocks.iter().enumerate() {
            put32(b, 0x10C + 4 * i, *w);
        }
        b[0xFD] = self.jnl_backup_type;
    }

    pub fn block_size(&self) -> u32 {
        1024 << self.log_block_size
    }
    pub fn group_count(&self) -> u32 {
        (self.blocks_count - self.first_data_block).div_ceil(self.blocks_per_group)
    }
    pub fn gdt_blocks(&self) -> u32 {
        (self.group_count() * GDESC_SIZE as u32).div_ceil(self.block_size())
    }
    pub fn inode_table_blocks(&self) -> u32 {
        (self.inodes_per_group * self.inode_size as u32).div_ceil(self.block_size())
    }
    pub fn has_filetype(&self) -> bool {
        self.feature_incompat & INCOMPAT_FILETYPE != 0
    }
    /// Does group `g` hold a superblock backup (and a group-descriptor table copy)?
    pub fn group_has_super(&self, g: u32) -> bool {
        if self.feature_ro_compat & RO_COMPAT_SPARSE_SUPER == 0 || g <= 1 {
            return true;
        }
        [3u32, 5, 7].iter().any(|&base| {
            let mut p = base;
            while p < g {
                p = p.saturating_mul(base);
            }
            p == g
        })
    }
    /// First block of group `g`.
    pub fn group_first_block(&self, g: u32) -> u32 {
        self.first_data_block + g * self.blocks_per_group
    }
    /// Number of blocks in group `g` (the last one may be short).
    pub fn group_block_count(&self, g: u32) -> u32 {
        let first = self.group_first_block(g);
        (self.blocks_count - first).min(self.blocks_per_group)
    }
}

/// One block-group descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupDesc {
    pub block_bitmap: u32,
    pub inode_bitmap: u32,
    pub inode_table: u32,
    pub free_blocks: u16,
    pub free_inodes: u16,
    pub used_dirs: u16,
}

impl GroupDesc {
    pub fn decode(b: &[u8]) -> GroupDesc {
        GroupDesc {
            block_bitmap: le32(b, 0),
            inode_bitmap: le32(b, 4),
            inode_table: le32(b, 8),
            free_blocks: le16(b, 12),
            free_inodes: le16(b, 14),
            used_dirs: le16(b, 16),
        }
    }
    pub fn encode(&self) -> [u8; GDESC_SIZE] {
        let mut b = [0u8; GDESC_SIZE];
        put32(&mut b, 0, self.block_bitmap);
        put32(&mut b, 4, self.inode_bitmap);
        put32(&mut b, 8, self.inode_table);
        put16(&mut b, 12, self.free_blocks);
        put16(&mut b, 14, self.free_inodes);
        put16(&mut b, 16, self.used_dirs);
        b
    }
}

/// An inode as stored. `raw_extra` keeps bytes past the fields we know so a rewrite
/// preserves them (in-inode xattrs, checksums of other tools).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inode {
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime: u32,
    pub ctime: u32,
    pub mtime: u32,
    pub dtime: u32,
    pub links: u16,
    /// 512-byte units.
    pub blocks: u32,
    pub flags: u32,
    pub block: [u32; N_BLOCKS],
    pub generation: u32,
    pub file_acl: u32,
    pub extra_isize: u16,
    pub ctime_extra: u32,
    pub mtime_extra: u32,
    pub atime_extra: u32,
    pub crtime: u32,
    pub crtime_extra: u32,
}

impl Inode {
    pub fn decode(b: &[u8]) -> Inode {
        let mut block = [0u32; N_BLOCKS];
        for (i, v) in block.iter_mut().enumerate() {
            *v = le32(b, 0x28 + 4 * i);
        }
        let big = b.len() > GOOD_OLD_INODE_SIZE;
        let extra_isize = if big { le16(b, 0x80) } else { 0 };
        let opt = |o: usize| {
            if big && GOOD_OLD_INODE_SIZE + extra_isize as usize >= o + 4 && b.len() >= o + 4 {
                le32(b, o)
            } else {
                0
            }
        };
        Inode {
            mode: le16(b, 0x00),
            uid: le16(b, 0x02) as u32 | (le16(b, 0x78) as u32) << 16,
            size: le32(b, 0x04) as u64 | (le32(b, 0x6C) as u64) << 32,
            atime: le32(b, 0x08),
            ctime: le32(b, 0x0C),
            mtime: le32(b, 0x10),
            dtime: le32(b, 0x14),
            gid: le16(b, 0x18) as u32 | (le16(b, 0x7A) as u32) << 16,
            links: le16(b, 0x1A),
            blocks: le32(b, 0x1C),
            flags: le32(b, 0x20),
            block,
            generation: le32(b, 0x64),
            file_acl: le32(b, 0x68),
            extra_isize,
            ctime_extra: opt(0x84),
            mtime_extra: opt(0x88),
            atime_extra: opt(0x8C),
            crtime: opt(0x90),
            crtime_extra: opt(0x94),
        }
    }

    /// Encodes into `b` (the inode's slot, `inode_size` bytes, holding the old bytes).
    pub fn encode_into(&self, b: &mut [u8]) {
        put16(b, 0x00, self.mode);
        put16(b, 0x02, self.uid as u16);
        put32(b, 0x04, self.size as u32);
        put32(b, 0x08, self.atime);
        put32(b, 0x0C, self.ctime);
        put32(b, 0x10, self.mtime);
        put32(b, 0x14, self.dtime);
        put16(b, 0x18, self.gid as u16);
        put16(b, 0x1A, self.links);
        put32(b, 0x1C, self.blocks);
        put32(b, 0x20, self.flags);
        for (i, v) in self.block.iter().enumerate() {
            put32(b, 0x28 + 4 * i, *v);
        }
        put32(b, 0x64, self.generation);
        put32(b, 0x68, self.file_acl);
        put32(b, 0x6C, (self.size >> 32) as u32);
        put16(b, 0x78, (self.uid >> 16) as u16);
        put16(b, 0x7A, (self.gid >> 16) as u16);
        if b.len() > GOOD_OLD_INODE_SIZE {
            put16(b, 0x80, self.extra_isize);
            let end = GOOD_OLD_INODE_SIZE + self.extra_isize as usize;
            for (o, v) in [
                (0x84, self.ctime_extra),
                (0x88, self.mtime_extra),
                (0x8C, self.atime_extra),
                (0x90, self.crtime),
                (0x94, self.crtime_extra),
            ] {
                if o + 4 <= end {
                    put32(b, o, v);
                }
            }
        }
    }

    pub fn file_type_bits(&self) -> u32 {
        self.mode as u32 & libc::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type_bits() == libc::S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.file_type_bits() == libc::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type_bits() == libc::S_IFLNK
    }
    /// Device nodes, fifos and sockets keep no blocks (their `i_block` holds the device
    /// number).
    pub fn is_special(&self) -> bool {
        matches!(
            self.file_type_bits(),
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK
        )
    }
    pub fn is_fast_symlink(&self) -> bool {
        self.is_symlink() && (self.size as usize) < FAST_SYMLINK_MAX
    }
    /// Does `i_block` hold block pointers?
    pub fn has_block_map(&self) -> bool {
        !(self.is_special() || self.is_fast_symlink())
    }

    /// Timestamps: seconds plus the extra word (nanoseconds << 2 | epoch bits).
    pub fn time(secs: u32, extra: u32, has_extra: bool) -> quilt_vfs::Timespec {
        let mut sec = secs as i32 as i64;
        let mut nsec = 0;
        if has_extra {
            sec += ((extra & 3) as i64) << 32;
            nsec = (extra >> 2).min(999_999_999);
        }
        quilt_vfs::Timespec { sec, nsec }
    }
    pub fn split_time(t: quilt_vfs::Timespec) -> (u32, u32) {
        let lo = t.sec as i32;
        let epoch = ((t.sec - lo as i64) >> 32) as u32 & 3;
        (lo as u32, (t.nsec << 2) | epoch)
    }
    pub fn has_extra_times(&self) -> bool {
        self.extra_isize >= 16
    }

    /// Device number in the old (16-bit) or new (32-bit) encoding, as the kernel reads it.
    pub fn rdev(&self) -> u32 {
        if self.block[0] != 0 {
            let v = self.block[0];
            libc_makedev((v >> 8) & 0xff, v & 0xff)
        } else {
            let v = self.block[1];
            libc_makedev((v & 0xfff00) >> 8, (v & 0xff) | ((v >> 12) & 0xfff00))
        }
    }
    pub fn set_rdev(&mut self, rdev: u32) {
        let (major, minor) = (major(rdev), minor(rdev));
        self.block = [0; N_BLOCKS];
        if major < 256 && minor < 256 {
            self.block[0] = (major << 8) | minor;
        } else {
            self.block[1] = (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12);
        }
    }
}

/// Linux's 32-bit `dev_t` as FUSE carries it: major in bits 8..20, minor split around it.
pub fn libc_makedev(major: u32, minor: u32) -> u32 {
    ((major & 0xfff) << 8) | (minor & 0xff) | ((minor & 0xfff00) << 12)
}
pub fn major(dev: u32) -> u32 {
    (dev >> 8) & 0xfff
}
pub fn minor(dev: u32) -> u32 {
    (dev & 0xff) | ((dev >> 12) & 0xfff00)
}

/// File-type codes in directory entries.
pub fn dirent_type_of_mode(mode: u32) -> u8 {
    match mode & libc::S_IFMT {
        libc::S_IFREG => 1,
        libc::S_IFDIR => 2,
        libc::S_IFCHR => 3,
        libc::S_IFBLK => 4,
        libc::S_IFIFO => 5,
        libc::S_IFSOCK => 6,
        libc::S_IFLNK => 7,
        _ => 0,
    }
}

/// Bytes a directory entry with a name of `name_len` needs.
pub fn dirent_len(name_len: usize) -> usize {
    (8 + name_len + 3) & !3
}

/// One decoded directory entry, at `offset` in its block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawDirent<'a> {
    pub offset: usize,
    pub inode: u32,
    pub rec_len: usize,
    pub file_type: u8,
    pub name: &'a [u8],
}

/// Iterates a directory block's entries, validating each record: a record that overruns
/// the block, is misaligned or too short for its name is corruption.
pub fn parse_dir_block(b: &[u8], filetype: bool) -> Result<Vec<RawDirent<'_>>, FsError> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < b.len() {
        if off + 8 > b.len() {
            return Err(corrupt(format!(
                "directory entry at {off} overruns its block"
            )));
        }
        let inode = le32(b, off);
        let rec_len = le16(b, off + 4) as usize;
        let rec_len = if rec_len == 0 && b.len() == 65536 {
            65536
        } else {
            rec_len
        };
        let (name_len, file_type) = if filetype {
            (b[off + 6] as usize, b[off + 7])
        } else {
            (le16(b, off + 6) as usize & 0xff, 0)
        };
        if rec_len < 8 || rec_len % 4 != 0 || off + rec_len > b.len() {
            return Err(corrupt(format!(
                "directory entry at {off} has bad record length {rec_len}"
            )));
        }
        if inode != 0 && 8 + name_len > rec_len {
            return Err(corrupt(format!(
                "directory entry at {off}: name of {name_len} bytes does not fit record of {rec_len}"
            )));
        }
        let name_end = (off + 8 + name_len).min(off + rec_len);
        out.push(RawDirent {
            offset: off,
            inode,
            rec_len,
            file_type,
            name: &b[off + 8..name_end],
        });
        off += rec_len;
    }
    Ok(out)
}

/// Encodes one entry's header and name at the start of `b`.
pub fn encode_dirent(b: &mut [u8], inode: u32, rec_len: usize, name: &[u8], file_type: u8) {
    put32(b, 0, inode);
    put16(b, 4, rec_len as u16);
    b[6] = name.len() as u8;
    b[7] = file_type;
    b[8..8 + name.len()].copy_from_slice(name);
}

#[cfg(test)]
mod feature_name_tests {
    #[test]
    fn names_as_e2fsprogs_and_unknown_bits_as_masks() {
        assert_eq!(
            super::feature_names(0x8 | 0x4, 0x2 | 0x0100_0000, 0x1 | 0x2),
            [
                "has_journal",
                "ext_attr",
                "filetype",
                "incompat:0x1000000",
                "sparse_super",
                "large_file"
            ]
        );
        assert!(super::feature_names(0, 0, 0).is_empty());
    }
}
