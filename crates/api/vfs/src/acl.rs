//! POSIX access control lists as Linux defines them: the `system.posix_acl_access` and
//! `system.posix_acl_default` extended attributes in the kernel's xattr form, and the
//! rules a file system applies to them (validity, the mode bits an ACL implies, chmod,
//! inheritance on create). Modules store ACLs in their own on-disk form; these rules are
//! shared.

use crate::{FsError, Result};

pub const ACCESS: &[u8] = b"system.posix_acl_access";
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

pub const USER_OBJ: u16 = 0x01;
pub const USER: u16 = 0x02;
pub const GROUP_OBJ: u16 = 0x04;
pub const GROUP: u16 = 0x08;
pub const MASK: u16 = 0x10;
pub const OTHER: u16 = 0x20;

/// The xattr form's version, and the id of entries without a qualifier.
const XATTR_VERSION: u32 = 2;
const UNDEFINED_ID: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub tag: u16,
    /// rwx bits (4, 2, 1).
    pub perm: u16,
    /// The uid or gid of USER and GROUP entries; unused otherwise.
    pub id: u32,
}

/// A valid ACL, its entries in the canonical order (by tag, then id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl(pub Vec<Entry>);

impl Acl {
    /// Parses the xattr form (what setxattr(2) receives and getxattr(2) returns) and
    /// checks it as the kernel does: EINVAL for a malformed or invalid list.
    pub fn from_xattr(b: &[u8]) -> Result<Acl> {
        if b.len() < 4 || (b.len() - 4) % 8 != 0 {
            return Err(FsError::Invalid("ACL: bad size"));
        }
        if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != XATTR_VERSION {
            return Err(FsError::NotSupported);
        }
        let entries = b[4..]
            .chunks_exact(8)
            .map(|e| Entry {
                tag: u16::from_le_bytes([e[0], e[1]]),
                perm: u16::from_le_bytes([e[2], e[3]]),
                id: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            })
            .collect();
        Acl::new(entries)
    }

    /// Checks `entries` (any order) and sorts them canonically.
    pub fn new(mut entries: Vec<Entry>) -> Result<Acl> {
        const BAD: FsError = FsError::Invalid("ACL: invalid entries");
        for e in entries.iter_mut() {
            if e.perm & !7 != 0 {
                return Err(BAD);
            }
            if !matches!(e.tag, USER | GROUP) {
                e.id = UNDEFINED_ID;
            }
        }
        entries.sort_by_key(|e| (e.tag, e.id));
        let count = |t: u16| entries.iter().filter(|e| e.tag == t).count();
        if entries
            .iter()
            .any(|e| !matches!(e.tag, USER_OBJ | USER | GROUP_OBJ | GROUP | MASK | OTHER))
            || count(USER_OBJ) != 1
            || count(GROUP_OBJ) != 1
            || count(OTHER) != 1
            || count(MASK) > 1
            || entries
                .windows(2)
                .any(|w| w[0].tag == w[1].tag && w[0].id == w[1].id)
            || (count(USER) + count(GROUP) > 0 && count(MASK) == 0)
        {
            return Err(BAD);
        }
        Ok(Acl(entries))
    }

    pub fn to_xattr(&self) -> Vec<u8> {
        let mut out = XATTR_VERSION.to_le_bytes().to_vec();
        for e in &self.0 {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    /// The three-entry ACL a mode is.
    pub fn from_mode(mode: u32) -> Acl {
        let e = |tag, perm: u32| Entry {
            tag,
            perm: (perm & 7) as u16,
            id: UNDEFINED_ID,
        };
        Acl(vec![
            e(USER_OBJ, mode >> 6),
            e(GROUP_OBJ, mode >> 3),
            e(OTHER, mode),
        ])
    }

    fn find(&self, tag: u16) -> Option<usize> {
        self.0.iter().position(|e| e.tag == tag)
    }

    /// The permission bits (0o777) the ACL implies: owner from USER_OBJ, group from MASK
    /// (or GROUP_OBJ without one), other from OTHER.
    pub fn mode_bits(&self) -> u32 {
        let perm = |t| self.find(t).map_or(0, |i| self.0[i].perm as u32);
        let group = if self.find(MASK).is_some() {
            perm(MASK)
        } else {
            perm(GROUP_OBJ)
        };
        perm(USER_OBJ) << 6 | group << 3 | perm(OTHER)
    }

    /// Does the mode say all the ACL says (only the three base entries)? Then no ACL
    /// need be stored.
    pub fn is_mode(&self) -> bool {
        self.0.len() == 3
    }

    /// chmod(2) on a file with this access ACL: the base entries (the mask in place of
    /// the owning group when there is one) take the new permission bits.
    pub fn chmod(&mut self, mode: u32) {
        let group = self.find(MASK).or_else(|| self.find(GROUP_OBJ));
        for (i, e) in self.0.iter_mut().enumerate() {
            e.perm = match e.tag {
                USER_OBJ => (mode >> 6) & 7,
                OTHER => mode & 7,
                _ if Some(i) == group => (mode >> 3) & 7,
                _ => continue,
            } as u16;
        }
    }

    /// A new inode of `mode` (type and permission bits, before any umask) made in a
    /// directory with this default ACL: returns its access ACL (None when the mode says
    /// it all) and its mode, each entry's permissions limited by the mode's (the
    /// kernel's posix_acl_create_masq). A new directory also takes the default ACL
    /// itself as its own default.
    pub fn inherit(&self, mode: u32) -> (Option<Acl>, u32) {
        let mut acl = self.clone();
        acl.chmod_masq(mode);
        let bits = acl.mode_bits();
        let mode = (mode & !0o777) | bits;
        (if acl.is_mode() { None } else { Some(acl) }, mode)
    }

    fn chmod_masq(&mut self, mode: u32) {
        let group = self.find(MASK).or_else(|| self.find(GROUP_OBJ));
        for (i, e) in self.0.iter_mut().enumerate() {
            let limit = match e.tag {
                USER_OBJ => mode >> 6,
                OTHER => mode,
                _ if Some(i) == group => mode >> 3,
                _ => continue,
            };
            e.perm &= (limit & 7) as u16;
        }
    }

    /// POSIX.1e's access check for a process with `uid` and `groups` (its gid first)
    /// against a file owned by `owner`/`owning_group`: true when every bit of `want`
    /// (rwx as 4, 2, 1) is granted. Root is the caller's business.
    pub fn permits(
        &self,
        owner: u32,
        owning_group: u32,
        uid: u32,
        groups: &[u32],
        want: u32,
    ) -> bool {
        let want = want as u16;
        let mask = self.find(MASK).map_or(7, |i| self.0[i].perm);
        let mut group_match = false;
        for e in &self.0 {
            match e.tag {
                USER_OBJ if uid == owner => return e.perm & want == want,
                USER if uid == e.id => return e.perm & mask & want == want,
                GROUP_OBJ | GROUP => {
                    let gid = if e.tag == GROUP_OBJ {
                        owning_group
                    } else {
                        e.id
                    };
                    if groups.contains(&gid) {
                        group_match = true;
                        if e.perm & mask & want == want {
                            return true;
                        }
                    }
                }
                _ => {}
            }
        }
        if group_match {
            return false;
        }
        self.find(OTHER)
            .is_some_and(|i| self.0[i].perm & want == want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(text: &str) -> Acl {
        // "u::rw-,u:1234:---,g::r--,m::r--,o::r--" (setfacl's short form)
        let entries = text
            .split(',')
            .map(|f| {
                let p: Vec<&str> = f.split(':').collect();
                let tag = match (p[0], p[1].is_empty()) {
                    ("u", true) => USER_OBJ,
                    ("u", false) => USER,
                    ("g", true) => GROUP_OBJ,
                    ("g", false) => GROUP,
                    ("m", _) => MASK,
                    _ => OTHER,
                };
                let perm = p[2]
                    .chars()
                    .zip([4, 2, 1])
                    .filter(|(c, _)| *c != '-')
                    .map(|(_, b)| b)
                    .sum();
                Entry {
                    tag,
                    perm,
                    id: p[1].parse().unwrap_or(0),
                }
            })
            .collect();
        Acl::new(entries).unwrap()
    }

    #[test]
    fn xattr_form_round_trips_and_bad_lists_are_refused() {
        let a = acl("u::rw-,u:1234:---,g::r--,m::r--,o::r--");
        assert_eq!(Acl::from_xattr(&a.to_xattr()).unwrap(), a);
        assert_eq!(a.mode_bits(), 0o644);
        // Named entries need a mask; base entries exactly once; no duplicates.
        for bad in [
            vec![
                (USER_OBJ, 6, 0),
                (USER, 4, 5),
                (GROUP_OBJ, 4, 0),
                (OTHER, 4, 0),
            ],
            vec![(USER_OBJ, 6, 0), (OTHER, 4, 0)],
            vec![
                (USER_OBJ, 6, 0),
                (USER_OBJ, 6, 0),
                (GROUP_OBJ, 4, 0),
                (OTHER, 4, 0),
            ],
            vec![(USER_OBJ, 8, 0), (GROUP_OBJ, 4, 0), (OTHER, 4, 0)],
            vec![
                (USER_OBJ, 6, 0),
                (GROUP_OBJ, 4, 0),
                (OTHER, 4, 0),
                (0x40, 4, 0),
            ],
        ] {
            let e = bad
                .into_iter()
                .map(|(tag, perm, id)| Entry { tag, perm, id })
                .collect();
            assert!(Acl::new(e).is_err());
        }
        assert!(Acl::from_xattr(&[2, 0, 0, 0, 1]).is_err());
    }

    #[test]
    fn the_mask_limits_named_entries_and_the_owning_group() {
        let a = acl("u::rw-,u:1234:rw-,g::rw-,g:50:r--,m::r--,o::---");
        assert!(a.permits(1, 2, 1, &[2], 6), "the owner is not masked");
        assert!(a.permits(1, 2, 1234, &[9], 4));
        assert!(!a.permits(1, 2, 1234, &[9], 2), "the mask removes w");
        assert!(
            !a.permits(1, 2, 77, &[2], 2),
            "the owning group is masked too"
        );
        assert!(a.permits(1, 2, 77, &[3, 50], 4));
        assert!(
            !a.permits(1, 2, 77, &[50], 1),
            "a matching group that lacks the bit denies"
        );
        assert!(!a.permits(1, 2, 77, &[9], 4));
    }

    #[test]
    fn chmod_moves_the_mask_and_inheritance_limits_by_mode() {
        let mut a = acl("u::rwx,u:1234:rwx,g::r-x,m::rwx,o::r-x");
        a.chmod(0o640);
        assert_eq!(a, acl("u::rw-,u:1234:rwx,g::r-x,m::r--,o::---"));
        let mut b = acl("u::rwx,g::r-x,o::r-x");
        b.chmod(0o700);
        assert_eq!(b, acl("u::rwx,g::---,o::---"));
        // A default ACL over open(O_CREAT, 0666): the mask takes the group bits.
        let d = acl("u::rwx,u:1234:rwx,g::r-x,m::rwx,o::---");
        let (access, mode) = d.inherit(libc::S_IFREG | 0o666);
        assert_eq!(mode, libc::S_IFREG | 0o660);
        assert_eq!(
            access.unwrap(),
            acl("u::rw-,u:1234:rwx,g::r-x,m::rw-,o::---")
        );
        let (access, mode) = acl("u::rwx,g::rwx,o::r-x").inherit(libc::S_IFREG | 0o644);
        assert_eq!((access, mode), (None, libc::S_IFREG | 0o644));
    }
}
