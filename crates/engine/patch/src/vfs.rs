//! The engine as the file-system interface sees it: `Services` is every module's
//! [`quilt_vfs::Patchgroups`], and the engine's errors become file-system errors here
//! (the interface knows nothing of the engine).

use crate::{BlockError, PatchError, PatchgroupId, Services};
use quilt_vfs::{FsError, PgId};

/// A patchgroup call's failure as the caller sees it.
pub fn pg_error(e: PatchError) -> FsError {
    match e {
        PatchError::Patchgroup(g) => FsError::Patchgroup {
            errno: g.errno(),
            what: g.to_string(),
        },
        PatchError::Pinned => FsError::Patchgroup {
            errno: libc_edeadlk(),
            what: "the group waits for a group that is not released yet: it cannot become durable until that group is released".into(),
        },
        e => FsError::from(e),
    }
}

/// EDEADLK (35 on Linux), without a libc dependency for one constant.
const fn libc_edeadlk() -> i32 {
    35
}

/// A patch-layer failure as a file-system error: a request outside the device or a
/// damaged log is damage (`Corrupt`); anything else is an I/O error.
impl From<PatchError> for FsError {
    fn from(e: PatchError) -> FsError {
        match e {
            PatchError::Block(BlockError::OutOfRange { block, count }) => FsError::Corrupt(
                format!("block {block} is beyond the device ({count} blocks)"),
            ),
            PatchError::Damaged(m) => FsError::Corrupt(m),
            // The device's own error as the cause (`Block` is transparent: through the
            // patch error, a search of the causes would not find it).
            PatchError::Block(e) => FsError::Io(quilt_vfs::IoError::caused_by(e)),
            e => FsError::Io(quilt_vfs::IoError::caused_by(e)),
        }
    }
}

impl quilt_vfs::Patchgroups for Services {
    fn pg_create(&self) -> quilt_vfs::Result<PgId> {
        Ok(Services::pg_create(self).0)
    }
    fn pg_depend(&self, after: PgId, before: PgId) -> quilt_vfs::Result<()> {
        Services::pg_depend(self, PatchgroupId(after), PatchgroupId(before)).map_err(pg_error)
    }
    fn pg_release(&self, pg: PgId) -> quilt_vfs::Result<()> {
        Services::pg_release(self, PatchgroupId(pg)).map_err(pg_error)
    }
    fn pg_engage(&self, pg: PgId, caller: u64) -> quilt_vfs::Result<()> {
        Services::pg_engage(self, PatchgroupId(pg), caller).map_err(pg_error)
    }
    fn pg_disengage(&self, pg: PgId, caller: u64) -> quilt_vfs::Result<()> {
        Services::pg_disengage(self, PatchgroupId(pg), caller).map_err(pg_error)
    }
    fn pg_sync(&self, pg: PgId) -> quilt_vfs::Result<()> {
        Services::pg_sync(self, PatchgroupId(pg)).map_err(pg_error)
    }
    fn pg_abandon(&self, pg: PgId) -> quilt_vfs::Result<()> {
        Services::pg_abandon(self, PatchgroupId(pg)).map_err(pg_error)
    }
    fn pg_inherit(&self, parent: u64, child: u64) {
        Services::pg_inherit(self, parent, child)
    }
    fn pg_forget_caller(&self, caller: u64) {
        Services::pg_forget_caller(self, caller)
    }
}
