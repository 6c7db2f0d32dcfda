//! Requests from the kernel: the header and each operation's arguments, borrowed from
//! the read buffer.

use crate::abi::{self, opcode, Malformed, Reader};

/// Who sent a request and about which node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// `fuse_setattr_in`: which fields to change (`valid`, see [`abi::fattr`]) and their values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetattrIn {
    pub valid: u32,
    pub fh: u64,
    pub size: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// One operation with its arguments.
#[derive(Debug, PartialEq, Eq)]
pub enum Op<'a> {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    Destroy,
    Lookup {
        name: &'a [u8],
    },
    Forget {
        nlookup: u64,
    },
    /// (node, nlookup) pairs.
    BatchForget(Vec<(u64, u64)>),
    Getattr {
        fh: Option<u64>,
    },
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        name: &'a [u8],
        mode: u32,
        rdev: u32,
        umask: u32,
    },
    Mkdir {
        name: &'a [u8],
        mode: u32,
        umask: u32,
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    /// RENAME and RENAME2 (`flags` 0 for the former).
    Rename {
        name: &'a [u8],
        newdir: u64,
        newname: &'a [u8],
        flags: u32,
    },
    Link {
        oldnode: u64,
        newname: &'a [u8],
    },
    Open {
        flags: i32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Write {
        fh: u64,
        offset: u64,
        data: &'a [u8],
        write_flags: u32,
    },
    Statfs,
    Release {
        fh: u64,
        flags: i32,
    },
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Setxattr {
        name: &'a [u8],
        value: &'a [u8],
        flags: i32,
        /// `abi::SETXATTR_ACL_KILL_SGID` (with SETXATTR_EXT negotiated).
        setxattr_flags: u32,
    },
    Getxattr {
        name: &'a [u8],
        size: u32,
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a [u8],
    },
    Flush {
        fh: u64,
    },
    Opendir {
        flags: i32,
    },
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Readdirplus {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        fh: u64,
    },
    Fsyncdir {
        fh: u64,
        datasync: bool,
    },
    Access {
        mask: u32,
    },
    Create {
        name: &'a [u8],
        flags: i32,
        mode: u32,
        umask: u32,
    },
    Interrupt {
        unique: u64,
    },
    Ioctl {
        fh: u64,
        flags: u32,
        cmd: u32,
        arg: u64,
        input: &'a [u8],
        out_size: u32,
    },
    Fallocate {
        fh: u64,
        offset: u64,
        length: u64,
        mode: u32,
    },
    /// copy_file_range(2) between two files of the mount (the request's node is the
    /// source).
    CopyFileRange {
        fh_in: u64,
        off_in: u64,
        nodeid_out: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
        flags: u64,
    },
    Lseek {
        fh: u64,
        offset: u64,
        whence: u32,
    },
    Syncfs,
    Tmpfile {
        flags: i32,
        mode: u32,
        umask: u32,
    },
    /// An opcode we do not serve (answered ENOSYS, so the kernel stops sending it where
    /// it can).
    Unsupported(u32),
}

/// A parsed request.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub header: Header,
    pub op: Op<'a>,
}

/// What the INIT handshake settled that changes how requests are laid out.
#[derive(Debug, Clone, Copy, Default)]
pub struct Proto {
    /// SETXATTR_EXT: setxattr carries a second flags word.
    pub setxattr_ext: bool,
}

impl<'a> Request<'a> {
    /// Parses one request as read from /dev/fuse (exactly the bytes the read returned),
    /// before any capability is negotiated.
    pub fn parse(buf: &'a [u8]) -> Result<Request<'a>, Malformed> {
        Request::parse_with(buf, Proto::default())
    }

    /// Parses one request of a session that negotiated `proto`.
    pub fn parse_with(buf: &'a [u8], proto: Proto) -> Result<Request<'a>, Malformed> {
        let mut r = Reader::new(buf);
        let header = Header {
            len: r.u32("header")?,
            opcode: r.u32("header")?,
            unique: r.u64("header")?,
            nodeid: r.u64("header")?,
            uid: r.u32("header")?,
            gid: r.u32("header")?,
            pid: r.u32("header")?,
        };
        let extlen = r.u16("header")? as usize * 8;
        r.skip(2, "header")?;
        if (header.len as usize) != buf.len() {
            return Err(Malformed(
                "length in the header differs from the bytes read",
            ));
        }
        // Extensions (security contexts, supplementary groups) trail the arguments; we
        // negotiate none, and ignore any.
        let body_len = buf
            .len()
            .checked_sub(abi::IN_HEADER_LEN + extlen)
            .ok_or(Malformed("extensions longer than the request"))?;
        let body = &buf[abi::IN_HEADER_LEN..abi::IN_HEADER_LEN + body_len];
        let op = parse_op(header.opcode, Reader::new(body), proto)?;
        Ok(Request { header, op })
    }
}

fn parse_op(opc: u32, mut r: Reader<'_>, proto: Proto) -> Result<Op<'_>, Malformed> {
    Ok(match opc {
        opcode::INIT => {
            let major = r.u32("init")?;
            let minor = r.u32("init")?;
            let max_readahead = r.u32("init")?;
            let mut flags = r.u32("init")? as u64;
            if flags & abi::init::INIT_EXT != 0 && r.remaining() >= 4 {
                flags |= (r.u32("init")? as u64) << 32;
            }
            Op::Init {
                major,
                minor,
                max_readahead,
                flags,
            }
        }
        opcode::DESTROY => Op::Destroy,
        opcode::LOOKUP => Op::Lookup {
            name: r.cstr("lookup name")?,
        },
        opcode::FORGET => Op::Forget {
            nlookup: r.u64("forget")?,
        },
        opcode::BATCH_FORGET => {
            let count = r.u32("batch forget")? as usize;
            r.skip(4, "batch forget")?;
            if count > r.remaining() / 16 {
                return Err(Malformed("batch forget count beyond the request"));
            }
            let mut v = Vec::with_capacity(count);
            for _ in 0..count {
                v.push((r.u64("forget one")?, r.u64("forget one")?));
            }
            Op::BatchForget(v)
        }
        opcode::GETATTR => {
            let flags = r.u32("getattr")?;
            r.skip(4, "getattr")?;
            let fh = r.u64("getattr")?;
            Op::Getattr {
                fh: (flags & abi::GETATTR_FH != 0).then_some(fh),
            }
        }
        opcode::SETATTR => {
            let valid = r.u32("setattr")?;
            r.skip(4, "setattr")?;
            let fh = r.u64("setattr")?;
            let size = r.u64("setattr")?;
            r.skip(8, "setattr")?; // lock_owner
            let (a, m, c) = (r.u64("setattr")?, r.u64("setattr")?, r.u64("setattr")?);
            let (an, mn, cn) = (r.u32("setattr")?, r.u32("setattr")?, r.u32("setattr")?);
            let mode = r.u32("setattr")?;
            r.skip(4, "setattr")?;
            let uid = r.u32("setattr")?;
            let gid = r.u32("setattr")?;
            Op::Setattr(SetattrIn {
                valid,
                fh,
                size,
                atime: (a as i64, an),
                mtime: (m as i64, mn),
                ctime: (c as i64, cn),
                mode,
                uid,
                gid,
            })
        }
        opcode::READLINK => Op::Readlink,
        opcode::SYMLINK => {
            let name = r.cstr("symlink name")?;
            let target = r.cstr("symlink target")?;
            Op::Symlink { name, target }
        }
        opcode::MKNOD => {
            let mode = r.u32("mknod")?;
            let rdev = r.u32("mknod")?;
            let umask = r.u32("mknod")?;
            r.skip(4, "mknod")?;
            Op::Mknod {
                name: r.cstr("mknod name")?,
                mode,
                rdev,
                umask,
            }
        }
        opcode::MKDIR => {
            let mode = r.u32("mkdir")?;
            let umask = r.u32("mkdir")?;
            Op::Mkdir {
                name: r.cstr("mkdir name")?,
                mode,
                umask,
            }
        }
        opcode::UNLINK => Op::Unlink {
            name: r.cstr("unlink name")?,
        },
        opcode::RMDIR => Op::Rmdir {
            name: r.cstr("rmdir name")?,
        },
        opcode::RENAME | opcode::RENAME2 => {
            let newdir = r.u64("rename")?;
            let flags = if opc == opcode::RENAME2 {
                let f = r.u32("rename2")?;
                r.skip(4, "rename2")?;
                f
            } else {
                0
            };
            let name = r.cstr("rename name")?;
            let newname = r.cstr("rename new name")?;
            Op::Rename {
                name,
                newdir,
                newname,
                flags,
            }
        }
        opcode::LINK => {
            let oldnode = r.u64("link")?;
            Op::Link {
                oldnode,
                newname: r.cstr("link name")?,
            }
        }
        opcode::OPEN | opcode::OPENDIR => {
            let flags = r.u32("open")? as i32;
            if opc == opcode::OPEN {
                Op::Open { flags }
            } else {
                Op::Opendir { flags }
            }
        }
        opcode::READ | opcode::READDIR | opcode::READDIRPLUS => {
            let fh = r.u64("read")?;
            let offset = r.u64("read")?;
            let size = r.u32("read")?;
            match opc {
                opcode::READ => Op::Read { fh, offset, size },
                opcode::READDIR => Op::Readdir { fh, offset, size },
                _ => Op::Readdirplus { fh, offset, size },
            }
        }
        opcode::WRITE => {
            let fh = r.u64("write")?;
            let offset = r.u64("write")?;
            let size = r.u32("write")? as usize;
            let write_flags = r.u32("write")?;
            r.skip(16, "write")?; // lock_owner, flags, padding
            let data = r.bytes(size, "write data")?;
            Op::Write {
                fh,
                offset,
                data,
                write_flags,
            }
        }
        opcode::STATFS => Op::Statfs,
        opcode::RELEASE | opcode::RELEASEDIR => {
            let fh = r.u64("release")?;
            let flags = r.u32("release")? as i32;
            if opc == opcode::RELEASE {
                Op::Release { fh, flags }
            } else {
                Op::Releasedir { fh }
            }
        }
        opcode::FSYNC | opcode::FSYNCDIR => {
            let fh = r.u64("fsync")?;
            let datasync = r.u32("fsync")? & abi::FSYNC_FDATASYNC != 0;
            if opc == opcode::FSYNC {
                Op::Fsync { fh, datasync }
            } else {
                Op::Fsyncdir { fh, datasync }
            }
        }
        opcode::SETXATTR => {
            let size = r.u32("setxattr")? as usize;
            let flags = r.u32("setxattr")? as i32;
            let mut setxattr_flags = 0;
            if proto.setxattr_ext {
                setxattr_flags = r.u32("setxattr")?;
                r.skip(4, "setxattr")?;
            }
            let name = r.cstr("setxattr name")?;
            let value = r.bytes(size, "setxattr value")?;
            Op::Setxattr {
                name,
                value,
                flags,
                setxattr_flags,
            }
        }
        opcode::GETXATTR => {
            let size = r.u32("getxattr")?;
            r.skip(4, "getxattr")?;
            Op::Getxattr {
                name: r.cstr("getxattr name")?,
                size,
            }
        }
        opcode::LISTXATTR => Op::Listxattr {
            size: r.u32("listxattr")?,
        },
        opcode::REMOVEXATTR => Op::Removexattr {
            name: r.cstr("removexattr name")?,
        },
        opcode::FLUSH => Op::Flush {
            fh: r.u64("flush")?,
        },
        opcode::ACCESS => Op::Access {
            mask: r.u32("access")?,
        },
        opcode::CREATE | opcode::TMPFILE => {
            let flags = r.u32("create")? as i32;
            let mode = r.u32("create")?;
            let umask = r.u32("create")?;
            r.skip(4, "create")?;
            if opc == opcode::CREATE {
                Op::Create {
                    name: r.cstr("create name")?,
                    flags,
                    mode,
                    umask,
                }
            } else {
                Op::Tmpfile { flags, mode, umask }
            }
        }
        opcode::INTERRUPT => Op::Interrupt {
            unique: r.u64("interrupt")?,
        },
        opcode::IOCTL => {
            let fh = r.u64("ioctl")?;
            let flags = r.u32("ioctl")?;
            let cmd = r.u32("ioctl")?;
            let arg = r.u64("ioctl")?;
            let in_size = r.u32("ioctl")? as usize;
            let out_size = r.u32("ioctl")?;
            let input = r.bytes(in_size, "ioctl input")?;
            Op::Ioctl {
                fh,
                flags,
                cmd,
                arg,
                input,
                out_size,
            }
        }
        opcode::FALLOCATE => Op::Fallocate {
            fh: r.u64("fallocate")?,
            offset: r.u64("fallocate")?,
            length: r.u64("fallocate")?,
            mode: r.u32("fallocate")?,
        },
        opcode::COPY_FILE_RANGE => Op::CopyFileRange {
            fh_in: r.u64("copy_file_range")?,
            off_in: r.u64("copy_file_range")?,
            nodeid_out: r.u64("copy_file_range")?,
            fh_out: r.u64("copy_file_range")?,
            off_out: r.u64("copy_file_range")?,
            len: r.u64("copy_file_range")?,
            flags: r.u64("copy_file_range")?,
        },
        opcode::LSEEK => Op::Lseek {
            fh: r.u64("lseek")?,
            offset: r.u64("lseek")?,
            whence: r.u32("lseek")?,
        },
        opcode::SYNCFS => Op::Syncfs,
        other => Op::Unsupported(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::Writer;

    fn request(opc: u32, body: &[u8]) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32((abi::IN_HEADER_LEN + body.len()) as u32)
            .u32(opc)
            .u64(77)
            .u64(5)
            .u32(1000)
            .u32(100)
            .u32(4242)
            .u16(0)
            .u16(0)
            .bytes(body);
        w.buf
    }

    #[test]
    fn parses_names_and_arguments() {
        let buf = request(opcode::LOOKUP, b"hello\0");
        let req = Request::parse(&buf).unwrap();
        assert_eq!(req.header.unique, 77);
        assert_eq!(req.header.nodeid, 5);
        assert_eq!(req.header.pid, 4242);
        assert_eq!(req.op, Op::Lookup { name: b"hello" });

        let mut w = Writer::default();
        w.u64(9)
            .u64(4096)
            .u32(3)
            .u32(abi::WRITE_KILL_SUIDGID)
            .u64(0)
            .u32(0)
            .u32(0)
            .bytes(b"abc");
        let buf = request(opcode::WRITE, &w.buf);
        assert_eq!(
            Request::parse(&buf).unwrap().op,
            Op::Write {
                fh: 9,
                offset: 4096,
                data: b"abc",
                write_flags: abi::WRITE_KILL_SUIDGID
            }
        );

        let mut w = Writer::default();
        w.u64(12).u32(1).u32(0).bytes(b"a\0b\0");
        let buf = request(opcode::RENAME2, &w.buf);
        assert_eq!(
            Request::parse(&buf).unwrap().op,
            Op::Rename {
                name: b"a",
                newdir: 12,
                newname: b"b",
                flags: 1
            }
        );
        assert_eq!(
            Request::parse(&request(opcode::SYNCFS, &[0; 8]))
                .unwrap()
                .op,
            Op::Syncfs
        );
        assert_eq!(
            Request::parse(&request(999, &[])).unwrap().op,
            Op::Unsupported(999)
        );
    }

    #[test]
    fn malformed_requests_are_errors_not_panics() {
        // Every prefix of every well-formed request, and garbage, parse to an error or
        // an operation, never a panic.
        let mut w = Writer::default();
        w.u64(9)
            .u64(0)
            .u32(100)
            .u32(0)
            .u64(0)
            .u32(0)
            .u32(0)
            .bytes(&[1; 10]);
        let bodies: Vec<(u32, Vec<u8>)> = vec![
            (opcode::WRITE, w.buf.clone()),
            (opcode::LOOKUP, b"no nul".to_vec()),
            (
                opcode::BATCH_FORGET,
                vec![0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0],
            ),
            (opcode::SETXATTR, vec![200, 0, 0, 0, 0, 0, 0, 0, b'n', 0]),
            (opcode::IOCTL, vec![0xff; 32]),
        ];
        for (opc, body) in bodies {
            let buf = request(opc, &body);
            assert!(Request::parse(&buf).is_err(), "opcode {opc}");
            for cut in 0..buf.len() {
                let _ = Request::parse(&buf[..cut]);
            }
        }
        // The header's length must match what was read.
        let mut buf = request(opcode::STATFS, &[]);
        buf.push(0);
        assert!(Request::parse(&buf).is_err());
        for op in 0..60 {
            for len in 0..64 {
                let mut b = request(op, &vec![0xa5; len]);
                let _ = Request::parse(&b);
                b[36] = 0xff; // extension length beyond the request
                let _ = Request::parse(&b);
            }
        }
    }
}
