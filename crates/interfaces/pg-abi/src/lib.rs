//! The wire format between the client library and the FUSE server: ioctls on the
//! control file at the mount root (patchgroups), and on files and directories of the
//! mount (clones). Both sides use these definitions; the C header
//! (`include/quiltfs_pg.h`) repeats them and a test checks they agree.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

/// The control file's name in the mount's root directory.
pub const CONTROL_NAME: &str = ".quiltfs-control";

/// Arguments and result of every call: `a` is the group (or the group after, for
/// `DEPEND`; the new group, out, for `CREATE`), `b` the group before (`DEPEND`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PgArgs {
    pub a: u64,
    pub b: u64,
}

/// Size of the buffer `LAST_ERROR` fills (a NUL-terminated message, cut to fit).
pub const ERROR_LEN: usize = 256;

const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    // Linux's generic _IOC layout: direction in bits 30-31, size in 16-29, type in
    // 8-15, number in 0-7.
    (dir << 30) | ((size as u32) << 16) | ((b'Q' as u32) << 8) | nr
}
const WRITE: u32 = 1;
const READ: u32 = 2;
const ARGS: usize = std::mem::size_of::<PgArgs>();

pub const CREATE: u32 = ioc(READ | WRITE, 1, ARGS);
pub const DEPEND: u32 = ioc(READ | WRITE, 2, ARGS);
pub const RELEASE: u32 = ioc(READ | WRITE, 3, ARGS);
pub const ENGAGE: u32 = ioc(READ | WRITE, 4, ARGS);
pub const DISENGAGE: u32 = ioc(READ | WRITE, 5, ARGS);
pub const SYNC: u32 = ioc(READ | WRITE, 6, ARGS);
pub const ABANDON: u32 = ioc(READ | WRITE, 7, ARGS);
/// Why the calling process's last failed call failed (read only).
pub const LAST_ERROR: u32 = ioc(READ, 8, ERROR_LEN);
/// Ends the caller's group `a` and engages a new group ordered after it, in one call:
/// `b` bit 0 also abandons `a`'s handle. Returns the new group in `a`.
pub const NEXT: u32 = ioc(READ | WRITE, 9, ARGS);
/// `NEXT`'s flag: abandon the old group's handle too.
pub const NEXT_ABANDON: u64 = 1;

impl PgArgs {
    pub fn to_bytes(self) -> [u8; ARGS] {
        let mut b = [0u8; ARGS];
        b[..8].copy_from_slice(&self.a.to_ne_bytes());
        b[8..].copy_from_slice(&self.b.to_ne_bytes());
        b
    }
    /// None unless `b` holds exactly one `PgArgs`.
    pub fn from_bytes(b: &[u8]) -> Option<PgArgs> {
        if b.len() != ARGS {
            return None;
        }
        Some(PgArgs {
            a: u64::from_ne_bytes(b[..8].try_into().ok()?),
            b: u64::from_ne_bytes(b[8..].try_into().ok()?),
        })
    }
}

/// What a command is called in messages.
pub fn name(cmd: u32) -> &'static str {
    match cmd {
        CREATE => "create",
        DEPEND => "depend",
        RELEASE => "release",
        ENGAGE => "engage",
        DISENGAGE => "disengage",
        SYNC => "sync",
        ABANDON => "abandon",
        LAST_ERROR => "last_error",
        NEXT => "next",
        CLONE_RANGE => "clone_range",
        CLONE_TREE => "clone_tree",
        _ => "unknown",
    }
}

/// A range clone, asked of the destination file: bytes `src_off..src_off + len` of the
/// file whose inode number (st_ino) is `src_ino` (`len` 0: to its end) into this one
/// at `dst_off`, as FICLONERANGE (which FUSE cannot carry: the kernel has no FUSE
/// request for remap_file_range). Out: `len` holds the bytes cloned.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CloneRangeArgs {
    pub src_ino: u64,
    pub src_off: u64,
    pub len: u64,
    pub dst_off: u64,
}

/// Longest name a tree clone takes.
pub const NAME_MAX: usize = 255;

/// A tree clone, asked of the destination's directory: a new entry `name` (its first
/// `name_len` bytes) for a copy of the tree at inode `src_ino`. Out: `src_ino` holds
/// the new entry's inode number.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloneTreeArgs {
    pub src_ino: u64,
    pub name_len: u32,
    pub pad: u32,
    pub name: [u8; NAME_MAX + 1],
}

const RANGE_ARGS: usize = std::mem::size_of::<CloneRangeArgs>();
const TREE_ARGS: usize = std::mem::size_of::<CloneTreeArgs>();

pub const CLONE_RANGE: u32 = ioc(READ | WRITE, 16, RANGE_ARGS);
pub const CLONE_TREE: u32 = ioc(READ | WRITE, 17, TREE_ARGS);

fn u64_at(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(i..i + 8)?.try_into().ok()?))
}

impl CloneRangeArgs {
    pub fn to_bytes(self) -> [u8; RANGE_ARGS] {
        let mut b = [0u8; RANGE_ARGS];
        for (i, v) in [self.src_ino, self.src_off, self.len, self.dst_off]
            .into_iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }
    /// None unless `b` holds exactly one `CloneRangeArgs`.
    pub fn from_bytes(b: &[u8]) -> Option<CloneRangeArgs> {
        if b.len() != RANGE_ARGS {
            return None;
        }
        Some(CloneRangeArgs {
            src_ino: u64_at(b, 0)?,
            src_off: u64_at(b, 8)?,
            len: u64_at(b, 16)?,
            dst_off: u64_at(b, 24)?,
        })
    }
}

impl CloneTreeArgs {
    /// None if the name is longer than [`NAME_MAX`].
    pub fn new(src_ino: u64, name: &[u8]) -> Option<CloneTreeArgs> {
        if name.len() > NAME_MAX {
            return None;
        }
        let mut a = CloneTreeArgs {
            src_ino,
            name_len: name.len() as u32,
            pad: 0,
            name: [0u8; NAME_MAX + 1],
        };
        a.name[..name.len()].copy_from_slice(name);
        Some(a)
    }
    pub fn name(&self) -> &[u8] {
        &self.name[..(self.name_len as usize).min(NAME_MAX)]
    }
    pub fn to_bytes(self) -> [u8; TREE_ARGS] {
        let mut b = [0u8; TREE_ARGS];
        b[..8].copy_from_slice(&self.src_ino.to_ne_bytes());
        b[8..12].copy_from_slice(&self.name_len.to_ne_bytes());
        b[16..].copy_from_slice(&self.name);
        b
    }
    /// None unless `b` holds exactly one `CloneTreeArgs` with a name that fits.
    pub fn from_bytes(b: &[u8]) -> Option<CloneTreeArgs> {
        if b.len() != TREE_ARGS {
            return None;
        }
        let name_len = u32::from_ne_bytes(b[8..12].try_into().ok()?);
        if name_len as usize > NAME_MAX {
            return None;
        }
        let mut name = [0u8; NAME_MAX + 1];
        name.copy_from_slice(&b[16..]);
        Some(CloneTreeArgs {
            src_ino: u64_at(b, 0)?,
            name_len,
            pad: 0,
            name,
        })
    }
}
