//! Inode flags over FUSE: the kernel turns FS_IOC_GETFLAGS/SETFLAGS and
//! FS_IOC_FSGETXATTR/FSSETXATTR on any file of the mount (chattr, lsattr, xfs_io,
//! file_getattr(2)) into FUSE_IOCTL requests after its own checks of who may change what.
//! This translates them into `FileSystem::get_flags`/`set_flags`.

use quilt_vfs::flags::*;
use quilt_vfs::{Ctx, FileSystem, FsError, Ino};

pub(crate) const GETFLAGS: u32 = 0x8008_6601;
pub(crate) const SETFLAGS: u32 = 0x4008_6602;
const GETFLAGS32: u32 = 0x8004_6601;
const SETFLAGS32: u32 = 0x4004_6602;
pub(crate) const FSGETXATTR: u32 = 0x801c_581f;
pub(crate) const FSSETXATTR: u32 = 0x401c_5820;

/// struct fsxattr: xflags, extsize, nextents, projid, cowextsize, 8 bytes of padding.
const FSXATTR_LEN: usize = 28;

/// FS_XFLAG_* bit for each inode flag that has one.
const XFLAGS: [(u32, u32); 5] = [
    (IMMUTABLE, 0x08),
    (APPEND, 0x10),
    (SYNC, 0x20),
    (NOATIME, 0x40),
    (NODUMP, 0x80),
];

/// Is `cmd` one of the inode-flag ioctls?
pub(crate) fn is_fileattr(cmd: u32) -> bool {
    matches!(
        cmd,
        GETFLAGS | SETFLAGS | GETFLAGS32 | SETFLAGS32 | FSGETXATTR | FSSETXATTR
    )
}

/// Serves one of them: the reply's bytes.
pub(crate) fn ioctl(
    fs: &dyn FileSystem,
    ino: Ino,
    cmd: u32,
    input: &[u8],
    ctx: &Ctx,
) -> Result<Vec<u8>, FsError> {
    let word = |b: &[u8], i: usize| -> Result<u32, FsError> {
        b.get(i * 4..i * 4 + 4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .ok_or(FsError::Invalid("short ioctl argument"))
    };
    match cmd {
        GETFLAGS | GETFLAGS32 => Ok(fs.get_flags(ino)?.to_le_bytes().to_vec()),
        SETFLAGS | SETFLAGS32 => {
            let f = word(input, 0)?;
            fs.set_flags(ino, f, ctx)?;
            Ok(f.to_le_bytes().to_vec())
        }
        FSGETXATTR => {
            let f = fs.get_flags(ino)?;
            let x = XFLAGS
                .iter()
                .filter(|(fl, _)| f & fl != 0)
                .fold(0, |x, (_, xf)| x | xf);
            let mut out = vec![0u8; FSXATTR_LEN];
            out[..4].copy_from_slice(&u32::to_le_bytes(x));
            Ok(out)
        }
        FSSETXATTR => {
            let (x, extsize, projid, cow) = (
                word(input, 0)?,
                word(input, 1)?,
                word(input, 3)?,
                word(input, 4)?,
            );
            let known = XFLAGS.iter().fold(0, |a, (_, xf)| a | xf);
            if x & !known != 0 || extsize != 0 || projid != 0 || cow != 0 {
                // Extent size hints, project ids and the rest need features ext2 lacks.
                return Err(FsError::NotSupported);
            }
            let mut f = fs.get_flags(ino)?;
            for (fl, xf) in XFLAGS {
                if x & xf != 0 {
                    f |= fl;
                } else {
                    f &= !fl;
                }
            }
            fs.set_flags(ino, f, ctx)?;
            Ok(input[..FSXATTR_LEN.min(input.len())].to_vec())
        }
        _ => Err(FsError::NotSupported),
    }
}
