//! The control file at the mount root (`.quiltfs-control`): patchgroup calls arrive as
//! ioctls on it (`quilt_pg_abi`). It exists only in the adapter: it is not in the
//! image, not listed by readdir, and its name in the root is reserved (a real entry of
//! that name, made by another driver, is shadowed).

use crate::callers::Callers;
use quilt_fusewire::Attr;
use quilt_pg_abi as abi;
use quilt_vfs::{FsError, KernelFs};

/// Its inode number on the FUSE side: above every ext2 inode number.
pub(crate) const CONTROL_INO: u64 = 1 << 40;

/// Is `name` in directory `parent` (FUSE numbering) the control file?
pub(crate) fn is_control(parent: crate::NodeId, name: &[u8]) -> bool {
    parent == crate::NodeId(1) && name == abi::CONTROL_NAME.as_bytes()
}

pub(crate) fn attr() -> Attr {
    Attr {
        ino: CONTROL_INO,
        // Everyone may open it for reading, which is all an ioctl needs.
        mode: libc::S_IFREG | 0o444,
        nlink: 1,
        blksize: 4096,
        ..Attr::default()
    }
}

/// Serves one ioctl from thread `tid`: the reply's bytes, or an errno.
pub(crate) fn ioctl(
    fs: &dyn KernelFs,
    callers: &Callers,
    tid: u32,
    cmd: u32,
    input: &[u8],
    out_size: u32,
) -> Result<Vec<u8>, i32> {
    let caller = callers.join(tid, fs);
    if cmd == abi::LAST_ERROR {
        let mut out = vec![0u8; abi::ERROR_LEN.min(out_size as usize)];
        let msg = callers.last_error(caller);
        let n = msg.len().min(out.len().saturating_sub(1));
        out[..n].copy_from_slice(&msg.as_bytes()[..n]);
        return Ok(out);
    }
    let Some(args) = abi::PgArgs::from_bytes(input) else {
        return Err(libc::ENOTTY);
    };
    let r = match cmd {
        abi::CREATE => fs.pg_create().map(|g| {
            callers.owns(caller, g);
            abi::PgArgs { a: g, b: 0 }
        }),
        abi::DEPEND => fs.pg_depend(args.a, args.b).map(|()| args),
        abi::RELEASE => fs.pg_release(args.a).map(|()| args),
        abi::ENGAGE => fs.pg_engage(args.a, caller).map(|()| args),
        abi::DISENGAGE => fs.pg_disengage(args.a, caller).map(|()| args),
        abi::SYNC => fs.pg_sync(args.a).map(|()| args),
        abi::ABANDON => fs.pg_abandon(args.a).map(|()| {
            callers.disown(args.a);
            args
        }),
        abi::NEXT => next(fs, callers, caller, args.a, args.b & abi::NEXT_ABANDON != 0)
            .map(|g| abi::PgArgs { a: g, b: 0 }),
        _ => return Err(libc::ENOTTY),
    };
    match r {
        Ok(out) => Ok(out.to_bytes()[..(out_size as usize).min(16)].to_vec()),
        Err(e) => {
            let what = match &e {
                FsError::NotSupported => {
                    "this file system has no patchgroups (read-only mount?)".to_string()
                }
                e => e.to_string(),
            };
            tracing::debug!("patchgroup {} for process {caller}: {what}", abi::name(cmd));
            callers.set_error(caller, what);
            Err(e.errno())
        }
    }
}

/// `NEXT`: ends `current` and engages a new group ordered after it (create, disengage,
/// depend, release, engage: what a program doing fsync-as-ordering does at every
/// fsync, in one round trip instead of five). On failure `current` is engaged again
/// and the new group dropped, so ordering still holds.
fn next(
    fs: &dyn KernelFs,
    callers: &Callers,
    caller: u64,
    current: u64,
    abandon_current: bool,
) -> Result<u64, FsError> {
    let g = fs.pg_create()?;
    callers.owns(caller, g);
    // A group cannot take groups after it while engaged: disengage first.
    let switched = fs.pg_disengage(current, caller).and_then(|()| {
        fs.pg_depend(g, current)
            .and_then(|()| fs.pg_release(g))
            .and_then(|()| fs.pg_engage(g, caller))
            .inspect_err(|_| {
                let _ = fs.pg_engage(current, caller);
            })
    });
    if let Err(e) = switched {
        if fs.pg_abandon(g).is_ok() {
            callers.disown(g);
        }
        return Err(e);
    }
    if abandon_current && fs.pg_abandon(current).is_ok() {
        callers.disown(current);
    }
    Ok(g)
}
