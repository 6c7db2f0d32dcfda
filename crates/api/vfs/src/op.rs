//! File-system operations as values.
//!
//! One vocabulary for everything that records, replays or ships operations: the
//! conformance suite's random sequences, the crash explorer's recorded workloads, and the
//! messages and client journals of the namespace service. An [`FsOp`] serialises with
//! serde (any format: JSON for people, a binary one on the wire); [`FsOp::apply`] runs it
//! on any [`FileSystem`] and gives an [`FsReply`].
//!
//! Creations may name the inode number they get ([`FsOp::Mknod`]'s `ino` and the
//! others): a number from a range the module granted in advance ([`InoGrant`],
//! [`FileSystem::grant_inodes`]), so that a client can create files on its own and have
//! them merged later under the numbers it already handed out.

use crate::{
    Attr, Ctx, DirEntry, FileSystem, FsError, Ino, RenameFlags, Result, SetAttr, StatFs, XattrFlags,
};
use serde::{Deserialize, Serialize};

/// A range of inode numbers a module set aside for one holder (a client of the namespace
/// service): `first..first + count`. The module hands none of them out on its own; a
/// creation that names one of them takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InoGrant {
    pub first: Ino,
    pub count: u64,
}

impl InoGrant {
    pub fn contains(&self, ino: Ino) -> bool {
        ino >= self.first && ino - self.first < self.count
    }
    pub fn iter(&self) -> impl Iterator<Item = Ino> {
        self.first..self.first + self.count
    }
}

/// One operation of [`FileSystem`], with its arguments. Reads are here too (a replayed
/// sequence compares what they return); `Ctx` is not: the caller's credentials go with
/// the message that carries the operation, not inside it.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsOp {
    Lookup {
        parent: Ino,
        name: Vec<u8>,
    },
    Getattr {
        ino: Ino,
    },
    Setattr {
        ino: Ino,
        set: SetAttr,
    },
    /// A regular file, device node, fifo or socket (`mode` carries the type); with `ino`,
    /// under that granted number.
    Mknod {
        parent: Ino,
        name: Vec<u8>,
        mode: u32,
        rdev: u32,
        ino: Option<Ino>,
    },
    Mkdir {
        parent: Ino,
        name: Vec<u8>,
        mode: u32,
        ino: Option<Ino>,
    },
    Symlink {
        parent: Ino,
        name: Vec<u8>,
        target: Vec<u8>,
        ino: Option<Ino>,
    },
    Link {
        ino: Ino,
        new_parent: Ino,
        new_name: Vec<u8>,
    },
    Unlink {
        parent: Ino,
        name: Vec<u8>,
    },
    Rmdir {
        parent: Ino,
        name: Vec<u8>,
    },
    Rename {
        parent: Ino,
        name: Vec<u8>,
        new_parent: Ino,
        new_name: Vec<u8>,
        flags: RenameFlags,
    },
    Readlink {
        ino: Ino,
    },
    Read {
        ino: Ino,
        offset: u64,
        size: u32,
    },
    Write {
        ino: Ino,
        offset: u64,
        data: Vec<u8>,
    },
    /// Entries from cookie `offset`, at most `max` of them.
    Readdir {
        ino: Ino,
        offset: u64,
        max: u32,
    },
    Fsync {
        ino: Ino,
        datasync: bool,
    },
    SyncAll,
    Statfs,
    Setxattr {
        ino: Ino,
        name: Vec<u8>,
        value: Vec<u8>,
        flags: XattrFlags,
    },
    Getxattr {
        ino: Ino,
        name: Vec<u8>,
    },
    Listxattr {
        ino: Ino,
    },
    Removexattr {
        ino: Ino,
        name: Vec<u8>,
    },
    Fallocate {
        ino: Ino,
        offset: u64,
        length: u64,
        mode: i32,
    },
}

/// What an operation returned.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsReply {
    /// Nothing to return (unlink, rename, fsync, ...).
    Done,
    Attr(Attr),
    /// File data, a symlink's target, an attribute's value or the list of names.
    Bytes(Vec<u8>),
    /// Bytes written.
    Written(u32),
    Entries(Vec<DirEntry>),
    StatFs(StatFs),
}

impl FsOp {
    /// Whether the operation changes the file system (else it only reads it; `Fsync`
    /// and `SyncAll` change nothing but durability and count as reads here).
    pub fn changes(&self) -> bool {
        !matches!(
            self,
            FsOp::Lookup { .. }
                | FsOp::Getattr { .. }
                | FsOp::Readlink { .. }
                | FsOp::Read { .. }
                | FsOp::Readdir { .. }
                | FsOp::Fsync { .. }
                | FsOp::SyncAll
                | FsOp::Statfs
                | FsOp::Getxattr { .. }
                | FsOp::Listxattr { .. }
        )
    }

    /// Runs the operation on `fs` as `ctx`.
    pub fn apply(&self, fs: &(impl FileSystem + ?Sized), ctx: &Ctx) -> Result<FsReply> {
        use FsReply::*;
        Ok(match self {
            FsOp::Lookup { parent, name } => Attr(fs.lookup(*parent, name)?),
            FsOp::Getattr { ino } => Attr(fs.getattr(*ino)?),
            FsOp::Setattr { ino, set } => Attr(fs.setattr(*ino, *set, ctx)?),
            FsOp::Mknod {
                parent,
                name,
                mode,
                rdev,
                ino,
            } => Attr(match ino {
                None => fs.mknod(*parent, name, *mode, *rdev, ctx)?,
                Some(i) => fs.mknod_as(*i, *parent, name, *mode, *rdev, ctx)?,
            }),
            FsOp::Mkdir {
                parent,
                name,
                mode,
                ino,
            } => Attr(match ino {
                None => fs.mkdir(*parent, name, *mode, ctx)?,
                Some(i) => fs.mkdir_as(*i, *parent, name, *mode, ctx)?,
            }),
            FsOp::Symlink {
                parent,
                name,
                target,
                ino,
            } => Attr(match ino {
                None => fs.symlink(*parent, name, target, ctx)?,
                Some(i) => fs.symlink_as(*i, *parent, name, target, ctx)?,
            }),
            FsOp::Link {
                ino,
                new_parent,
                new_name,
            } => Attr(fs.link(*ino, *new_parent, new_name, ctx)?),
            FsOp::Unlink { parent, name } => {
                fs.unlink(*parent, name, ctx)?;
                Done
            }
            FsOp::Rmdir { parent, name } => {
                fs.rmdir(*parent, name, ctx)?;
                Done
            }
            FsOp::Rename {
                parent,
                name,
                new_parent,
                new_name,
                flags,
            } => {
                fs.rename(*parent, name, *new_parent, new_name, *flags, ctx)?;
                Done
            }
            FsOp::Readlink { ino } => Bytes(fs.readlink(*ino)?),
            FsOp::Read { ino, offset, size } => Bytes(fs.read(*ino, *offset, *size)?),
            FsOp::Write { ino, offset, data } => Written(fs.write(*ino, *offset, data, ctx)?),
            FsOp::Readdir { ino, offset, max } => {
                let mut v = Vec::new();
                fs.readdir(*ino, *offset, &mut |e| {
                    if v.len() >= *max as usize {
                        return false;
                    }
                    v.push(e);
                    true
                })?;
                Entries(v)
            }
            FsOp::Fsync { ino, datasync } => {
                fs.fsync(*ino, *datasync)?;
                Done
            }
            FsOp::SyncAll => {
                fs.sync_all()?;
                Done
            }
            FsOp::Statfs => StatFs(fs.statfs()?),
            FsOp::Setxattr {
                ino,
                name,
                value,
                flags,
            } => {
                fs.setxattr(*ino, name, value, *flags, ctx)?;
                Done
            }
            FsOp::Getxattr { ino, name } => Bytes(fs.getxattr(*ino, name)?),
            FsOp::Listxattr { ino } => Bytes(fs.listxattr(*ino)?),
            FsOp::Removexattr { ino, name } => {
                fs.removexattr(*ino, name, ctx)?;
                Done
            }
            FsOp::Fallocate {
                ino,
                offset,
                length,
                mode,
            } => {
                fs.fallocate(*ino, *offset, *length, *mode, ctx)?;
                Done
            }
        })
    }
}

/// An error as it crosses a process boundary: its errno and its message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub errno: i32,
    pub message: String,
}

impl From<&FsError> for WireError {
    fn from(e: &FsError) -> WireError {
        WireError {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

impl From<WireError> for FsError {
    /// The variant the errno stands for; a message-carrying kind keeps the message.
    fn from(w: WireError) -> FsError {
        match FsError::from_errno(w.errno) {
            FsError::Io(_) => FsError::Io(w.message.into()),
            e => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_and_replies_survive_a_round_trip_through_json() {
        let ops = vec![
            FsOp::Mknod {
                parent: 1,
                name: b"a\xff".to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: Some(4096),
            },
            FsOp::Rename {
                parent: 1,
                name: b"a".to_vec(),
                new_parent: 2,
                new_name: b"b".to_vec(),
                flags: RenameFlags {
                    exchange: true,
                    ..Default::default()
                },
            },
            FsOp::Setattr {
                ino: 9,
                set: SetAttr {
                    size: Some(7),
                    mtime: Some(crate::TimeOrNow::Now),
                    ..Default::default()
                },
            },
            FsOp::Write {
                ino: 9,
                offset: 1 << 40,
                data: vec![0, 1, 2],
            },
            FsOp::SyncAll,
        ];
        let text = serde_json::to_string(&ops).unwrap();
        let back: Vec<FsOp> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, ops);
        let r = FsReply::Entries(vec![DirEntry {
            ino: 3,
            kind: crate::FileType::Symlink,
            name: b"x".to_vec(),
            next_offset: 5,
        }]);
        let back: FsReply = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn changes_tells_reads_from_writes() {
        assert!(!FsOp::Getattr { ino: 1 }.changes());
        assert!(FsOp::Unlink {
            parent: 1,
            name: b"a".to_vec()
        }
        .changes());
    }

    #[test]
    fn errors_keep_their_errno_across_the_wire() {
        for e in [
            FsError::NotFound,
            FsError::NoSpace,
            FsError::Io("disk".into()),
        ] {
            let w = WireError::from(&e);
            let back = FsError::from(w);
            assert_eq!(back.errno(), e.errno());
        }
        assert_eq!(
            FsError::from(WireError::from(&FsError::Io("disk gone".into()))),
            FsError::Io("I/O error: disk gone".into())
        );
    }
}
