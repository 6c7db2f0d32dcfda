//! The control run of the betrfs explorer: a file system that answers fsync, sync and
//! patchgroup syncs without making anything durable. Its crash states must break
//! promises; if the oracle found none, it could not see a lost fsync either.

use quilt_vfs::{
    Attr, Ctx, DirEntry, FileSystem, Ino, KernelFs, PgId, RenameFlags, Result, SetAttr, StatFs,
    XattrFlags,
};

pub struct Lying<'a>(pub &'a dyn KernelFs);

/// The kernel's references go through the defaults (this file system's open and release,
/// which pass them on), as they did before the kernel hooks had a trait of their own.
impl KernelFs for Lying<'_> {}

impl FileSystem for Lying<'_> {
    fn root(&self) -> Ino {
        self.0.root()
    }
    fn lookup(&self, p: Ino, n: &[u8]) -> Result<Attr> {
        self.0.lookup(p, n)
    }
    fn getattr(&self, i: Ino) -> Result<Attr> {
        self.0.getattr(i)
    }
    fn setattr(&self, i: Ino, s: SetAttr, c: &Ctx) -> Result<Attr> {
        self.0.setattr(i, s, c)
    }
    fn mknod(&self, p: Ino, n: &[u8], m: u32, r: u32, c: &Ctx) -> Result<Attr> {
        self.0.mknod(p, n, m, r, c)
    }
    fn mkdir(&self, p: Ino, n: &[u8], m: u32, c: &Ctx) -> Result<Attr> {
        self.0.mkdir(p, n, m, c)
    }
    fn unlink(&self, p: Ino, n: &[u8], c: &Ctx) -> Result<()> {
        self.0.unlink(p, n, c)
    }
    fn rmdir(&self, p: Ino, n: &[u8], c: &Ctx) -> Result<()> {
        self.0.rmdir(p, n, c)
    }
    fn symlink(&self, p: Ino, n: &[u8], t: &[u8], c: &Ctx) -> Result<Attr> {
        self.0.symlink(p, n, t, c)
    }
    fn readlink(&self, i: Ino) -> Result<Vec<u8>> {
        self.0.readlink(i)
    }
    fn rename(&self, p: Ino, n: &[u8], np: Ino, nn: &[u8], f: RenameFlags, c: &Ctx) -> Result<()> {
        self.0.rename(p, n, np, nn, f, c)
    }
    fn link(&self, i: Ino, np: Ino, nn: &[u8], c: &Ctx) -> Result<Attr> {
        self.0.link(i, np, nn, c)
    }
    fn read(&self, i: Ino, o: u64, s: u32) -> Result<Vec<u8>> {
        self.0.read(i, o, s)
    }
    fn write(&self, i: Ino, o: u64, d: &[u8], c: &Ctx) -> Result<u32> {
        self.0.write(i, o, d, c)
    }
    fn readdir(&self, i: Ino, o: u64, e: &mut dyn FnMut(DirEntry) -> bool) -> Result<()> {
        self.0.readdir(i, o, e)
    }
    fn statfs(&self) -> Result<StatFs> {
        self.0.statfs()
    }
    /// The lie.
    fn fsync(&self, i: Ino, _datasync: bool) -> Result<()> {
        self.0.getattr(i).map(|_| ())
    }
    /// The lie.
    fn sync_all(&self) -> Result<()> {
        Ok(())
    }
    fn setxattr(&self, i: Ino, n: &[u8], v: &[u8], f: XattrFlags, c: &Ctx) -> Result<()> {
        self.0.setxattr(i, n, v, f, c)
    }
    fn getxattr(&self, i: Ino, n: &[u8]) -> Result<Vec<u8>> {
        self.0.getxattr(i, n)
    }
    fn listxattr(&self, i: Ino) -> Result<Vec<u8>> {
        self.0.listxattr(i)
    }
    fn removexattr(&self, i: Ino, n: &[u8], c: &Ctx) -> Result<()> {
        self.0.removexattr(i, n, c)
    }
    fn open(&self, i: Ino) -> Result<()> {
        self.0.open(i)
    }
    fn release(&self, i: Ino) -> Result<()> {
        self.0.release(i)
    }
    fn pg_create(&self) -> Result<PgId> {
        self.0.pg_create()
    }
    fn pg_depend(&self, a: PgId, b: PgId) -> Result<()> {
        self.0.pg_depend(a, b)
    }
    fn pg_release(&self, g: PgId) -> Result<()> {
        self.0.pg_release(g)
    }
    fn pg_engage(&self, g: PgId, c: u64) -> Result<()> {
        self.0.pg_engage(g, c)
    }
    fn pg_disengage(&self, g: PgId, c: u64) -> Result<()> {
        self.0.pg_disengage(g, c)
    }
    /// The lie.
    fn pg_sync(&self, _g: PgId) -> Result<()> {
        Ok(())
    }
    fn pg_abandon(&self, g: PgId) -> Result<()> {
        self.0.pg_abandon(g)
    }
}
