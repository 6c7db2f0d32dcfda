//! Values of the tree: the superblock record, inode records and link stubs. Each starts
//! with a tag and a version; every decode is bounds-checked and damage is
//! `FsError::Corrupt`, never a panic. (The tree checksums the nodes that hold them.)

use quilt_vfs::{FileType, FsError, Result, Timespec};

const TAG_INODE: u8 = 1;
const TAG_LINK: u8 = 2;
const TAG_SUPER: u8 = 3;
const TAG_ZONE: u8 = 4;
const VERSION: u8 = 1;
/// Version 2 of inode records added the namespace marker; of the superblock record, the
/// next namespace. Version 1 records still decode (no marker; namespace 1 next).
const VERSION_2: u8 = 2;
/// Version 3 of inode records adds the zone a directory is the root of (`keys`,
/// "Zones"); of the superblock record, the next zone. Written only by records that
/// need them (a zone root; a file system that made a zone), so images without zones
/// stay readable by binaries that predate them; those refuse version 3 with a message.
const VERSION_3: u8 = 3;

/// Inode numbers: `namespace << RAW_BITS | raw`. A file system's first inodes are in
/// namespace 0, so their numbers are their raw numbers; a clone of a tree gives the copy
/// a new namespace, so the copies of its inodes differ from the originals by namespace
/// alone and no record below the clone is rewritten (see `fs.rs`, "Inode numbers").
pub const RAW_BITS: u32 = 40;
/// Raw numbers are below this (a trillion inodes).
pub const RAW_LIMIT: u64 = 1 << RAW_BITS;
/// Namespaces are below this (numbers stay below 2^63).
pub const NS_LIMIT: u64 = 1 << (63 - RAW_BITS);

/// The inode number of raw number `raw` (or the raw part of a number) in namespace `ns`.
pub fn compose(ns: u64, raw: u64) -> u64 {
    ns << RAW_BITS | (raw & (RAW_LIMIT - 1))
}

/// The namespace part of an inode number.
pub fn ns_of(ino: u64) -> u64 {
    ino >> RAW_BITS
}
pub const MAGIC: &[u8; 8] = b"QBETRFS1";

/// Bytes of a data block (one tree value).
pub const BLOCK: u64 = 4096;

/// The superblock record (key `S`): what the image is, and the next inode number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Super {
    /// The next raw inode number (unique in every namespace).
    pub next_ino: u64,
    /// The next namespace a clone takes.
    pub next_ns: u64,
    /// The record's version as read: 1 predates the index of link stubs and markers
    /// (`keys::INDEX`), which a read-write mount then builds.
    pub version: u8,
    /// 1 while mounted read-write: a mount that finds it set knows the last one did
    /// not end cleanly (the log replays what it synced; nothing to repair).
    pub dirty: bool,
    /// Damage was found while mounted: fsck should look.
    pub error: bool,
    /// The next zone number (zones start at 1; 1 while none was made).
    pub next_zone: u64,
}

impl Super {
    /// Encodes the current version, whatever was read.
    pub fn encode(&self) -> Vec<u8> {
        let zones = self.next_zone > 1;
        let mut v = vec![TAG_SUPER, if zones { VERSION_3 } else { VERSION_2 }];
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&self.next_ino.to_le_bytes());
        v.push(self.dirty as u8 | (self.error as u8) << 1);
        v.extend_from_slice(&self.next_ns.to_le_bytes());
        if zones {
            v.extend_from_slice(&self.next_zone.to_le_bytes());
        }
        v
    }
    pub fn decode(b: &[u8]) -> Result<Super> {
        let mut r = Reader::new(b, "superblock record");
        let tag = r.u8()?;
        let version = r.u8()?;
        if tag != TAG_SUPER || !(VERSION..=VERSION_3).contains(&version) || r.bytes(8)? != MAGIC {
            return Err(FsError::Corrupt(
                "the superblock record has a wrong tag, version or magic".into(),
            ));
        }
        let next_ino = r.u64()?;
        let f = r.u8()?;
        let next_ns = if version >= VERSION_2 { r.u64()? } else { 1 };
        let next_zone = if version >= VERSION_3 { r.u64()? } else { 1 };
        if !r.done() || next_ino > RAW_LIMIT || next_ns == 0 || next_ns > NS_LIMIT || next_zone == 0
        {
            return Err(r.damage("bad counters or trailing bytes"));
        }
        Ok(Super {
            next_ino,
            next_ns,
            version,
            dirty: f & 1 != 0,
            error: f & 2 != 0,
            next_zone,
        })
    }
}

/// An inode: attributes, the symlink target or device number, and extended attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    /// The inode's number. Under a path only its raw part counts: the namespace comes
    /// from the marker or the directory (`fs.rs`, "Inode numbers").
    pub ino: u64,
    /// A record under a path may name its namespace (a clone's top, an entry moved
    /// between namespaces); its directory's applies otherwise. Listed in the index.
    pub marker: Option<u64>,
    /// The zone this directory is the root of (`keys`, "Zones"): its entries are keyed
    /// below the zone's prefix. Listed in the index.
    pub zone: Option<u64>,
    /// Type and permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub rdev: u32,
    pub flags: u32,
    /// Data blocks present (a regular file's keys in the data space): `st_blocks` is
    /// eight times this, so holes do not count, and fsck checks it key by key.
    pub blocks: u64,
    /// Symlink target.
    pub target: Vec<u8>,
    /// Extended attributes by full name (ACLs under their system.* names), sorted.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Inode {
    /// A new inode: all three times `t`, no data, flags, target or attributes; a
    /// directory's size is one block (as ext2 reports an empty directory).
    pub fn new(ino: u64, mode: u32, uid: u32, gid: u32, nlink: u32, t: Timespec) -> Inode {
        Inode {
            ino,
            mode,
            uid,
            gid,
            nlink,
            size: if mode & libc::S_IFMT == libc::S_IFDIR {
                BLOCK
            } else {
                0
            },
            atime: t,
            mtime: t,
            ctime: t,
            rdev: 0,
            flags: 0,
            blocks: 0,
            target: Vec::new(),
            xattrs: Vec::new(),
            marker: None,
            zone: None,
        }
    }

    pub fn kind(&self) -> FileType {
        FileType::from_mode(self.mode).unwrap_or(FileType::Regular)
    }
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
    pub fn xattr(&self, name: &[u8]) -> Option<&[u8]> {
        self.xattrs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
    pub fn set_xattr(&mut self, name: &[u8], value: Option<Vec<u8>>) {
        self.xattrs.retain(|(n, _)| n != name);
        if let Some(v) = value {
            self.xattrs.push((name.to_vec(), v));
            self.xattrs.sort();
        }
    }
    pub fn xattr_bytes(&self) -> usize {
        self.xattrs.iter().map(|(n, v)| n.len() + v.len() + 8).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(113 + self.target.len() + self.xattr_bytes());
        v.push(TAG_INODE);
        v.push(if self.zone.is_some() {
            VERSION_3
        } else {
            VERSION_2
        });
        v.extend_from_slice(&self.ino.to_le_bytes());
        for x in [self.mode, self.uid, self.gid, self.nlink] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(&self.size.to_le_bytes());
        for t in [self.atime, self.mtime, self.ctime] {
            v.extend_from_slice(&t.sec.to_le_bytes());
            v.extend_from_slice(&t.nsec.to_le_bytes());
        }
        v.extend_from_slice(&self.rdev.to_le_bytes());
        v.extend_from_slice(&self.flags.to_le_bytes());
        v.extend_from_slice(&self.blocks.to_le_bytes());
        v.extend_from_slice(&(self.target.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.target);
        v.extend_from_slice(&(self.xattrs.len() as u32).to_le_bytes());
        for (n, x) in &self.xattrs {
            v.extend_from_slice(&(n.len() as u32).to_le_bytes());
            v.extend_from_slice(n);
            v.extend_from_slice(&(x.len() as u32).to_le_bytes());
            v.extend_from_slice(x);
        }
        match self.marker {
            Some(ns) => {
                v.push(1);
                v.extend_from_slice(&ns.to_le_bytes());
            }
            None => v.push(0),
        }
        if let Some(z) = self.zone {
            v.extend_from_slice(&z.to_le_bytes());
        }
        v
    }

    fn decode_body(r: &mut Reader<'_>, version: u8) -> Result<Inode> {
        let ino = r.u64()?;
        let (mode, uid, gid, nlink) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let size = r.u64()?;
        let mut times = [Timespec::default(); 3];
        for t in &mut times {
            let sec = r.u64()? as i64;
            let nsec = r.u32()?;
            if nsec >= 1_000_000_000 {
                return Err(r.damage("nanoseconds out of range"));
            }
            *t = Timespec { sec, nsec };
        }
        let rdev = r.u32()?;
        let flags = r.u32()?;
        let blocks = r.u64()?;
        let tl = r.u32()? as usize;
        let target = r.bytes(tl)?.to_vec();
        let n = r.u32()? as usize;
        let mut xattrs = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let nl = r.u32()? as usize;
            let name = r.bytes(nl)?.to_vec();
            let vl = r.u32()? as usize;
            xattrs.push((name, r.bytes(vl)?.to_vec()));
        }
        let marker = if version >= VERSION_2 {
            match r.u8()? {
                0 => None,
                1 => Some(r.u64()?)
                    .filter(|&ns| ns < NS_LIMIT)
                    .map(Some)
                    .ok_or_else(|| r.damage("namespace out of range"))?,
                _ => return Err(r.damage("bad marker flag")),
            }
        } else {
            None
        };
        let zone = if version >= VERSION_3 {
            Some(r.u64()?)
        } else {
            None
        };
        if FileType::from_mode(mode).is_none() {
            return Err(r.damage("unknown file type"));
        }
        if zone.is_some() && mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(r.damage("a zone root that is not a directory"));
        }
        if zone == Some(0) {
            return Err(r.damage("zone 0"));
        }
        if !r.done() {
            return Err(r.damage("trailing bytes"));
        }
        Ok(Inode {
            ino,
            mode,
            uid,
            gid,
            nlink,
            size,
            atime: times[0],
            mtime: times[1],
            ctime: times[2],
            rdev,
            flags,
            blocks,
            target,
            xattrs,
            marker,
            zone,
        })
    }
}

/// A zone's record (key `z` + its number): the inode number of the directory at its
/// root, whose namespace its top-level entries take and which is their `..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone {
    pub root: u64,
}

impl Zone {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![TAG_ZONE, VERSION];
        v.extend_from_slice(&self.root.to_le_bytes());
        v
    }
    pub fn decode(b: &[u8]) -> Result<Zone> {
        let mut r = Reader::new(b, "zone record");
        if r.u8()? != TAG_ZONE || r.u8()? != VERSION {
            return Err(r.damage("wrong tag or version"));
        }
        let root = r.u64()?;
        if !r.done() {
            return Err(r.damage("trailing bytes"));
        }
        Ok(Zone { root })
    }
}

/// What a name's key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// The inode itself (a file with one name, or a directory).
    Inode(Inode),
    /// A name of an inode stored under its number (`h` space).
    Link { ino: u64, mode: u32 },
}

/// Why an image of betrfs's first development layout is refused: its inode records
/// (version 1 as first written, before commit 21eadea of 2026-11-25) lack the block
/// count that every later version 1 record carries, and nothing in the record tells the
/// two apart but its length.
pub const FIRST_LAYOUT: &str = "this betrfs image was made by a development build of \
     2026-11-25 (before commit 21eadea: its inode records carry no block count), a layout \
     no release reads; copy its files out with the build that made it";

/// Whether `b` parses whole as an inode record of that first layout.
fn first_layout(b: &[u8]) -> bool {
    let mut r = Reader::new(b, "entry");
    // Tag, version, ino, mode/uid/gid/nlink, size, three times, rdev, flags.
    let fixed = 2 + 8 + 16 + 8 + 3 * 12 + 4 + 4;
    let parse = |r: &mut Reader<'_>| -> Result<bool> {
        r.bytes(fixed)?;
        let tl = r.u32()? as usize;
        r.bytes(tl)?;
        for _ in 0..r.u32()? {
            let nl = r.u32()? as usize;
            r.bytes(nl)?;
            let vl = r.u32()? as usize;
            r.bytes(vl)?;
        }
        Ok(r.done())
    };
    parse(&mut r).unwrap_or(false)
}

impl Entry {
    pub fn ino(&self) -> u64 {
        match self {
            Entry::Inode(i) => i.ino,
            Entry::Link { ino, .. } => *ino,
        }
    }
    pub fn kind(&self) -> FileType {
        match self {
            Entry::Inode(i) => i.kind(),
            Entry::Link { mode, .. } => FileType::from_mode(*mode).unwrap_or(FileType::Regular),
        }
    }
    pub fn decode(b: &[u8]) -> Result<Entry> {
        let mut r = Reader::new(b, "entry");
        let tag = r.u8()?;
        let version = r.u8()?;
        match tag {
            TAG_INODE if (VERSION..=VERSION_3).contains(&version) => {
                match Inode::decode_body(&mut r, version) {
                    Ok(i) => Ok(Entry::Inode(i)),
                    Err(_) if version == VERSION && first_layout(b) => {
                        Err(FsError::Invalid(FIRST_LAYOUT))
                    }
                    Err(e) => Err(e),
                }
            }
            TAG_LINK if version == VERSION => {
                let ino = r.u64()?;
                let mode = r.u32()?;
                if !r.done() || FileType::from_mode(mode).is_none() {
                    return Err(r.damage("bad link stub"));
                }
                Ok(Entry::Link { ino, mode })
            }
            TAG_INODE | TAG_LINK => Err(r.damage("unknown version")),
            _ => Err(r.damage("unknown tag")),
        }
    }
    pub fn link_stub(ino: u64, mode: u32) -> Vec<u8> {
        let mut v = vec![TAG_LINK, VERSION];
        v.extend_from_slice(&ino.to_le_bytes());
        v.extend_from_slice(&(mode & libc::S_IFMT).to_le_bytes());
        v
    }
}

/// An inode stored under its number must be a whole inode record.
pub fn decode_inode(b: &[u8]) -> Result<Inode> {
    match Entry::decode(b)? {
        Entry::Inode(i) => Ok(i),
        Entry::Link { .. } => Err(FsError::Corrupt(
            "a link stub where an inode belongs".into(),
        )),
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { b, at: 0, what }
    }
    fn damage(&self, why: &str) -> FsError {
        FsError::Corrupt(format!("{}: {why} (byte {})", self.what, self.at))
    }
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(e) => {
                let s = &self.b[self.at..e];
                self.at = e;
                Ok(s)
            }
            None => Err(self.damage("truncated")),
        }
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn done(&self) -> bool {
        self.at == self.b.len()
    }
}

#[cfg(test)]
mod tests {

    /// A record of the first development layout (no block count) is refused as that,
    /// not as damage; the same record cut short is still damage.
    #[test]
    fn the_first_layout_is_named_when_refused() {
        let mut i = Inode::new(5, libc::S_IFREG | 0o644, 0, 0, 1, Timespec::default());
        i.target = b"t".to_vec();
        i.xattrs.push((b"user.a".to_vec(), b"b".to_vec()));
        let now = i.encode();
        // Version 1, without the block count (8 bytes after flags) and the marker.
        let fixed = 2 + 8 + 16 + 8 + 36 + 4 + 4;
        let mut first = now[..fixed].to_vec();
        first[1] = VERSION;
        first.extend_from_slice(&now[fixed + 8..now.len() - 1]);
        match Entry::decode(&first) {
            Err(FsError::Invalid(why)) => assert_eq!(why, FIRST_LAYOUT),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Entry::decode(&first[..first.len() - 3]),
            Err(FsError::Corrupt(_))
        ));
        assert!(matches!(Entry::decode(&now), Ok(Entry::Inode(_))));
    }
    use super::*;

    #[test]
    fn records_round_trip_and_damage_is_an_error() {
        let i = Inode {
            ino: 42,
            mode: libc::S_IFLNK | 0o777,
            uid: 1,
            gid: 2,
            nlink: 1,
            size: 3,
            atime: Timespec { sec: -5, nsec: 7 },
            mtime: Timespec { sec: 9, nsec: 0 },
            ctime: Timespec {
                sec: 1,
                nsec: 999_999_999,
            },
            rdev: 0,
            flags: 0x80,
            blocks: 0,
            target: b"abc".to_vec(),
            xattrs: vec![(b"user.x".to_vec(), b"1".to_vec())],
            marker: Some(7),
            zone: None,
        };
        let dir = Inode {
            mode: libc::S_IFDIR | 0o755,
            zone: Some(12),
            ..i.clone()
        };
        assert_eq!(
            Entry::decode(&dir.encode()).unwrap(),
            Entry::Inode(dir.clone())
        );
        let z = Zone { root: 99 };
        assert_eq!(Zone::decode(&z.encode()).unwrap(), z);
        let e = i.encode();
        assert_eq!(Entry::decode(&e).unwrap(), Entry::Inode(i.clone()));
        for n in 0..e.len() {
            assert!(Entry::decode(&e[..n]).is_err());
        }
        let s = Super {
            next_ino: 9,
            next_ns: 3,
            version: 2,
            dirty: true,
            error: false,
            next_zone: 1,
        };
        assert_eq!(Super::decode(&s.encode()).unwrap(), s);
        let s3 = Super {
            version: 3,
            next_zone: 5,
            ..s.clone()
        };
        assert_eq!(Super::decode(&s3.encode()).unwrap(), s3);
        let l = Entry::link_stub(5, libc::S_IFREG | 0o644);
        assert_eq!(
            Entry::decode(&l).unwrap(),
            Entry::Link {
                ino: 5,
                mode: libc::S_IFREG
            }
        );
        let mut bad = e.clone();
        bad[0] = 9;
        assert!(matches!(Entry::decode(&bad), Err(FsError::Corrupt(_))));
    }
}
