//! The FUSE wire format (protocol 7.38, what this kernel and Debian's headers speak):
//! opcodes, flags, and the byte layouts of the structures we read and write. Everything
//! is little-endian on the machines we run on (the protocol uses host order); every read
//! is bounds-checked, so a short or malformed request is an error, never a panic.

/// Protocol version we speak. The kernel adapts to the minor we answer with.
pub const KERNEL_VERSION: u32 = 7;
pub const KERNEL_MINOR: u32 = 38;
/// The root directory's node id.
pub const ROOT_ID: u64 = 1;

pub const IN_HEADER_LEN: usize = 40;
pub const OUT_HEADER_LEN: usize = 16;
/// Room for one request: a write of `max_write` bytes plus its header and arguments.
pub const MIN_READ_BUFFER: usize = 8192;

pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const BMAP: u32 = 37;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const POLL: u32 = 40;
    pub const NOTIFY_REPLY: u32 = 41;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
    pub const SYNCFS: u32 = 50;
    pub const TMPFILE: u32 = 51;
}

/// INIT flags (the low 32 bits in `flags`, the high ones in `flags2` with `INIT_EXT`).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const EXPORT_SUPPORT: u64 = 1 << 4;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DONT_MASK: u64 = 1 << 6;
    pub const FLOCK_LOCKS: u64 = 1 << 10;
    pub const HAS_IOCTL_DIR: u64 = 1 << 11;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const NO_OPEN_SUPPORT: u64 = 1 << 17;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const HANDLE_KILLPRIV: u64 = 1 << 19;
    pub const POSIX_ACL: u64 = 1 << 20;
    pub const ABORT_ERROR: u64 = 1 << 21;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const NO_OPENDIR_SUPPORT: u64 = 1 << 24;
    pub const EXPLICIT_INVAL_DATA: u64 = 1 << 25;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const SETXATTR_EXT: u64 = 1 << 29;
    pub const INIT_EXT: u64 = 1 << 30;
    /// FUSE over io_uring (kernel 6.14+, with the fuse module's `enable_uring` set).
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `fuse_open_out.open_flags`.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const NONSEEKABLE: u32 = 1 << 2;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
}

/// `fuse_setattr_in.valid`.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const LOCKOWNER: u32 = 1 << 9;
    pub const CTIME: u32 = 1 << 10;
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

pub const GETATTR_FH: u32 = 1 << 0;
pub const FSYNC_FDATASYNC: u32 = 1 << 0;
pub const WRITE_CACHE: u32 = 1 << 0;
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// `fuse_setxattr_in.setxattr_flags`: the caller may not keep set-group-ID.
pub const SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;
pub const IOCTL_UNRESTRICTED: u32 = 1 << 1;

/// Notification codes (sent with `unique` 0 and the code as `error`).
pub mod notify {
    pub const INVAL_INODE: i32 = 2;
    pub const INVAL_ENTRY: i32 = 3;
    pub const DELETE: i32 = 6;
}

/// A request too short for what its opcode needs, or a name without its NUL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed FUSE request: {0}")]
pub struct Malformed(pub &'static str);

/// A cursor over a request's bytes.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    pub fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Malformed> {
        if self.b.len() < n {
            return Err(Malformed(what));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, Malformed> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, Malformed> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, Malformed> {
        let b = self.bytes(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn skip(&mut self, n: usize, what: &'static str) -> Result<(), Malformed> {
        self.bytes(n, what).map(|_| ())
    }
    /// A NUL-terminated name, without its NUL.
    pub fn cstr(&mut self, what: &'static str) -> Result<&'a [u8], Malformed> {
        let n = self.b.iter().position(|&c| c == 0).ok_or(Malformed(what))?;
        let s = &self.b[..n];
        self.b = &self.b[n + 1..];
        Ok(s)
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
    pub fn remaining(&self) -> usize {
        self.b.len()
    }
}

/// A little-endian byte builder for replies.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(n: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf.resize(self.buf.len() + n, 0);
        self
    }
    /// Pads to a multiple of 8 bytes (directory records).
    pub fn align8(&mut self) -> &mut Self {
        let pad = (8 - self.buf.len() % 8) % 8;
        self.zeros(pad)
    }
}

/// Attributes as FUSE carries them (`fuse_attr`, 88 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// Type and permission bits.
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

pub const ATTR_LEN: usize = 88;
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;

impl Attr {
    pub fn encode(&self, w: &mut Writer) {
        w.u64(self.ino)
            .u64(self.size)
            .u64(self.blocks)
            .i64(self.atime.0)
            .i64(self.mtime.0)
            .i64(self.ctime.0)
            .u32(self.atime.1)
            .u32(self.mtime.1)
            .u32(self.ctime.1)
            .u32(self.mode)
            .u32(self.nlink)
            .u32(self.uid)
            .u32(self.gid)
            .u32(self.rdev)
            .u32(self.blksize)
            .u32(0);
    }
}

/// A name and its attributes for the kernel's caches (`fuse_entry_out`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    pub attr: Attr,
    pub generation: u64,
    pub entry_valid: std::time::Duration,
    pub attr_valid: std::time::Duration,
}

impl Entry {
    pub fn encode(&self, w: &mut Writer) {
        w.u64(self.attr.ino)
            .u64(self.generation)
            .u64(self.entry_valid.as_secs())
            .u64(self.attr_valid.as_secs())
            .u32(self.entry_valid.subsec_nanos())
            .u32(self.attr_valid.subsec_nanos());
        self.attr.encode(w);
    }
}

/// `fuse_dirent` type field: the `S_IFMT` bits shifted down, as `d_type`.
pub fn dirent_type(mode: u32) -> u32 {
    (mode & libc::S_IFMT) >> 12
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_the_kernels_sizes() {
        let mut w = Writer::default();
        Attr::default().encode(&mut w);
        assert_eq!(w.buf.len(), ATTR_LEN);
        let mut w = Writer::default();
        Entry::default().encode(&mut w);
        assert_eq!(w.buf.len(), ENTRY_OUT_LEN);
        assert_eq!(ENTRY_OUT_LEN, 128);
    }

    #[test]
    fn reader_refuses_short_input_and_names_without_nul() {
        let mut r = Reader::new(&[1, 0, 0]);
        assert!(r.u32("x").is_err());
        let mut r = Reader::new(b"abc\0def");
        assert_eq!(r.cstr("name").unwrap(), b"abc");
        assert!(r.cstr("name").is_err());
        assert_eq!(r.rest(), b"def");
        assert_eq!(r.remaining(), 0);
    }
}
