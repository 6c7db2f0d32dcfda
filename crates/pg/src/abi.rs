//! The wire format between the client library and the FUSE server: ioctls on the
//! control file at the mount root. Both sides use these definitions; the C header
//! (`include/quiltfs_pg.h`) repeats them and a test checks they agree.

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
        _ => "unknown",
    }
}
