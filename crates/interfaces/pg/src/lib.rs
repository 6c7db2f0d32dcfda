//! Patchgroups on a quiltfs mount (Featherstitch's application interface).
//!
//! A patchgroup names a set of file-system changes. Instead of waiting for the disk with
//! `fsync`, a program says "the changes of group Q must reach the disk after those of P"
//! and goes on; the file system keeps that order while it writes back in its own time.
//! The changes a process makes while it has a group *engaged* join that group.
//!
//! The rules (each broken one is a clear error): dependencies are added to a group only
//! before it is released; a group is released before it is engaged; a group that other
//! groups depend on cannot be engaged again; a group cannot depend on a group that is
//! engaged. Together they keep groups from forming cycles.
//!
//! ```no_run
//! use quilt_pg::Control;
//! # fn main() -> Result<(), quilt_pg::Error> {
//! let ctl = Control::open("/mnt/quilt")?;
//! // Write the new file, then rename it over the old one: the rename must never reach
//! // the disk before the data it names.
//! let data = ctl.create()?;
//! ctl.release(data)?;
//! ctl.engage(data)?;
//! std::fs::write("/mnt/quilt/msg.tmp", b"hello").map_err(quilt_pg::Error::io)?;
//! ctl.disengage(data)?;
//! let rename = ctl.create_after(data)?; // created, depends on `data`, released
//! ctl.engage(rename)?;
//! std::fs::rename("/mnt/quilt/msg.tmp", "/mnt/quilt/msg").map_err(quilt_pg::Error::io)?;
//! ctl.disengage(rename)?;
//! ctl.sync(rename)?; // optional: wait until both are durable
//! ctl.abandon(data)?;
//! ctl.abandon(rename)?;
//! # Ok(())
//! # }
//! ```
//!
//! The same calls exist for C (`include/quiltfs_pg.h`, `libquilt_pg.so`): see [`ffi`].
//! Transport: ioctls on the control file `.quiltfs-control` at the mount root ([`abi`]);
//! the server identifies the calling process by the FUSE request's process id.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

/// The wire format (its own crate, which the FUSE server uses too).
pub use quilt_pg_abi as abi;
pub mod clone;
pub mod ffi;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

/// A patchgroup handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Group(pub u64);

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "patchgroup {}", self.0)
    }
}

/// A failed call: which one, the errno, and the server's explanation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub op: &'static str,
    pub errno: i32,
    pub message: String,
}

impl Error {
    /// An I/O error of the program's own, for use with `?` next to patchgroup calls.
    pub fn io(e: std::io::Error) -> Error {
        Error {
            op: "io",
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "patchgroup {}: {}", self.op, self.message)
    }
}

impl std::error::Error for Error {}

/// The control file of one mount.
#[derive(Debug)]
pub struct Control {
    file: File,
}

impl Control {
    /// Opens the control file of the quiltfs mounted at `mount`.
    pub fn open(mount: impl AsRef<Path>) -> Result<Control, Error> {
        let path = mount.as_ref().join(abi::CONTROL_NAME);
        let file = File::open(&path).map_err(|e| Error {
            op: "open",
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            message: if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "{} does not exist: is a quiltfs mounted at {}?",
                    path.display(),
                    mount.as_ref().display()
                )
            } else {
                format!("{}: {e}", path.display())
            },
        })?;
        Ok(Control { file })
    }

    /// Wraps an already open control file (as the C library does).
    pub fn from_file(file: File) -> Control {
        Control { file }
    }

    pub fn as_raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    fn call(&self, cmd: u32, a: u64, b: u64) -> Result<abi::PgArgs, Error> {
        call(self.file.as_raw_fd(), cmd, a, b)
    }

    /// A new group: not released, not engaged, depending on nothing.
    pub fn create(&self) -> Result<Group, Error> {
        self.call(abi::CREATE, 0, 0).map(|r| Group(r.a))
    }

    /// `after`'s changes will reach the disk only after `before`'s.
    pub fn depend(&self, after: Group, before: Group) -> Result<(), Error> {
        self.call(abi::DEPEND, after.0, before.0).map(drop)
    }

    /// No more dependencies for `g`; it may be engaged from now on.
    pub fn release(&self, g: Group) -> Result<(), Error> {
        self.call(abi::RELEASE, g.0, 0).map(drop)
    }

    /// This process's following changes join `g`.
    pub fn engage(&self, g: Group) -> Result<(), Error> {
        self.call(abi::ENGAGE, g.0, 0).map(drop)
    }

    pub fn disengage(&self, g: Group) -> Result<(), Error> {
        self.call(abi::DISENGAGE, g.0, 0).map(drop)
    }

    /// Waits until `g`'s changes (and so those of every group before it) are durable.
    pub fn sync(&self, g: Group) -> Result<(), Error> {
        self.call(abi::SYNC, g.0, 0).map(drop)
    }

    /// Drops the handle. The group's changes keep their order.
    pub fn abandon(&self, g: Group) -> Result<(), Error> {
        self.call(abi::ABANDON, g.0, 0).map(drop)
    }

    /// Ends `current` (engaged by this process) and engages a new group that depends on
    /// it, in one round trip: what create, disengage, depend, release and engage do one
    /// by one. With `abandon_current`, `current`'s handle is dropped as well. On failure
    /// `current` is still engaged and no new group is left behind.
    pub fn next(&self, current: Group, abandon_current: bool) -> Result<Group, Error> {
        let flags = if abandon_current {
            abi::NEXT_ABANDON
        } else {
            0
        };
        self.call(abi::NEXT, current.0, flags).map(|r| Group(r.a))
    }

    /// Creates a group that depends on `before`, and releases it: ready to engage.
    pub fn create_after(&self, before: Group) -> Result<Group, Error> {
        let g = self.create()?;
        let r = self
            .depend(g, before)
            .and_then(|()| self.release(g))
            .map(|()| g);
        if r.is_err() {
            let _ = self.abandon(g);
        }
        r
    }
}

/// One call on the control file `fd`.
pub(crate) fn call(fd: i32, cmd: u32, a: u64, b: u64) -> Result<abi::PgArgs, Error> {
    let mut args = abi::PgArgs { a, b };
    // SAFETY: every command but LAST_ERROR reads and writes exactly one PgArgs, which
    // `args` is, and lives through the call.
    let r = unsafe { libc::ioctl(fd, cmd as _, &mut args as *mut abi::PgArgs) };
    if r == 0 {
        return Ok(args);
    }
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    let message = match errno {
        libc::ENOTTY | libc::EBADF => {
            "not a quiltfs control file (open <mount>/.quiltfs-control)".to_string()
        }
        _ => last_error(fd)
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| std::io::Error::from_raw_os_error(errno).to_string()),
    };
    Err(Error {
        op: abi::name(cmd),
        errno,
        message,
    })
}

/// The server's explanation of this process's last failed call.
pub(crate) fn last_error(fd: i32) -> Option<String> {
    let mut buf = [0u8; abi::ERROR_LEN];
    // SAFETY: LAST_ERROR writes at most ERROR_LEN bytes into `buf`.
    let r = unsafe { libc::ioctl(fd, abi::LAST_ERROR as _, buf.as_mut_ptr()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}
