//! The key schema: where every name, inode and data block lives in the one tree.
//!
//! A path is keyed so that a directory's direct children are one contiguous range and its
//! whole subtree another, for every byte a Linux name may hold (anything but `/` and
//! NUL). NUL is the separator, so nothing needs escaping:
//!
//! - the *prefix* of a directory `c1/…/ck` is `c1 0 c2 0 … ck 0` (the root's is empty);
//! - the *key* of an entry named `n` in directory `D` is `prefix(D) 0 n`.
//!
//! Names are non-empty and hold no NUL, so a key parses one way only (its last component
//! follows its last NUL), `prefix(D)` starts every key of D's subtree and no other key,
//! and `prefix(D) 0` starts exactly D's direct children (a deeper key has a name's
//! first byte, never NUL, where a child has the second NUL). BetrFS's `\x01` separator
//! does not have this property for names that contain `\x01`.
//!
//! Key spaces (first byte):
//!
//! | space | key | value |
//! |---|---|---|
//! | `S` | `S` | the superblock record |
//! | `m` | `m` path-key | an inode record, or a link stub naming an inode in `h` |
//! | `d` | `d` path-key 0 be64(block) | a data block of a file named by that path |
//! | `h` | `h` be64(ino) | an inode with several names, or with none while open |
//! | `e` | `e` be64(ino) be64(block) | a data block of such an inode |
//! | `o` | `o` be64(ino) | an intent: inode `ino` is an orphan (value: the path its data is still under, or empty) or moving to `h`/`e` |
//! | `r` | `r` be64(id) | an intent: a directory rename too large for one batch |
//! | `i` | `i` path-key | (empty) the name at that path is a link stub or a record with a namespace marker |
//!
//! | `z` | `z` be64(zone) | a zone's record: the number of the directory at its root |
//!
//! A file with one name keeps its inode and data under its path, so a directory's files
//! and their data are contiguous and move and disappear with range operations. A second
//! name (link) moves the inode and its data once to `h`/`e` and leaves link stubs at
//! every name.
//!
//! **Zones** (BetrFS 0.4's answer to full-path keys that outgrow the tree's key limit):
//! a directory may be the root of a *zone*, its inode record naming the zone. Its
//! entries are keyed below the zone's prefix, `/` + the zone's number in sixteen hex
//! digits + `/`, instead of below the directory's own path: the paths of a zone start
//! again from its root. No name holds `/`, and a path of the root zone starts with a NUL
//! or a name's first byte, so zone paths are disjoint from all others; a zone prefix
//! holds no NUL, so the rules above hold below it unchanged (the zone prefix plays the
//! empty root prefix). A zone's root keeps its own record in its parent's zone, so
//! renaming it moves one record whatever lies below. A path-key of a zone names where
//! the entry lies; its directory is found by `up` (across a zone's root, through the
//! zone's record).

pub const SUPER: &[u8] = b"S";
pub const META: u8 = b'm';
pub const DATA: u8 = b'd';
pub const INODE: u8 = b'h';
pub const INODE_DATA: u8 = b'e';
pub const ORPHAN: u8 = b'o';
pub const RENAME: u8 = b'r';
pub const INDEX: u8 = b'i';
pub const ZONE: u8 = b'z';
/// Bytes of a zone prefix: `/`, sixteen hex digits, `/`.
pub const ZONE_PREFIX_LEN: usize = 18;
/// Scratch prefixes of one batch (a large RENAME_EXCHANGE passes one side through
/// here): never left in the tree after the batch.
pub const SCRATCH: u8 = b'x';

/// The bytes after which every key of `[space, prefix…]` lies below `end`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut e = prefix.to_vec();
    while let Some(last) = e.pop() {
        if last < 0xFF {
            e.push(last + 1);
            return e;
        }
    }
    // Only a prefix of all 0xFF bytes gets here; no key space starts with 0xFF.
    vec![0xFF; 8]
}

/// The prefix of zone `z`'s paths (what the empty prefix is for the root zone).
pub fn zone_prefix(z: u64) -> Vec<u8> {
    format!("/{z:016x}/").into_bytes()
}

/// The key of zone `z`'s record.
pub fn zone_key(z: u64) -> Vec<u8> {
    let mut k = vec![ZONE];
    k.extend_from_slice(&z.to_be_bytes());
    k
}

/// The zone a path-key or prefix lies in (None: the root zone).
pub fn zone_of(key: &[u8]) -> Option<u64> {
    let zp = key.get(..ZONE_PREFIX_LEN)?;
    if zp[0] != b'/' || zp[ZONE_PREFIX_LEN - 1] != b'/' {
        return None;
    }
    let hex = std::str::from_utf8(&zp[1..ZONE_PREFIX_LEN - 1]).ok()?;
    if !hex
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// A path-key cut into its zone prefix (empty in the root zone) and its path in the
/// zone.
fn split_zone(key: &[u8]) -> (&[u8], &[u8]) {
    match zone_of(key) {
        Some(_) => key.split_at(ZONE_PREFIX_LEN),
        None => (&[][..], key),
    }
}

/// Where the entry at `key` (not the root) hangs: in the directory at a path-key, or at
/// the root of a zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Up {
    Dir(Vec<u8>),
    Zone(u64),
}

/// The directory of the entry at `key` (see `Up`).
pub fn up(key: &[u8]) -> Up {
    let (zp, rest) = split_zone(key);
    let parent = parent_key_in_zone(rest);
    match zone_of(zp) {
        Some(z) if parent.is_empty() => Up::Zone(z),
        _ => Up::Dir([zp, &parent[..]].concat()),
    }
}

/// The key of entry `name` in the directory with `prefix`.
pub fn child_key(dir_prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(dir_prefix.len() + 1 + name.len());
    k.extend_from_slice(dir_prefix);
    k.push(0);
    k.extend_from_slice(name);
    k
}

/// The prefix of the directory whose key is `key` (the root's key is empty), unless
/// the directory is a zone's root (whose prefix is the zone's: `Betrfs::prefix_of`).
pub fn dir_prefix(key: &[u8]) -> Vec<u8> {
    if key.is_empty() {
        return Vec::new();
    }
    let sep = last_sep(key);
    let mut p = Vec::with_capacity(key.len() + 1);
    p.extend_from_slice(&key[..sep]);
    p.extend_from_slice(&key[sep + 1..]);
    p.push(0);
    p
}

fn last_sep(key: &[u8]) -> usize {
    key.iter().rposition(|&b| b == 0).unwrap_or(0)
}

/// The last component of a (non-root) key.
pub fn name_of(key: &[u8]) -> &[u8] {
    let sep = last_sep(key);
    &key[sep + 1..]
}

/// The key of the directory holding the entry `key` (the root for a top-level name),
/// in the root zone. For any zone, see `up`.
pub fn parent_key(key: &[u8]) -> Vec<u8> {
    match up(key) {
        Up::Dir(k) => k,
        // (Its directory is a zone's root, whose key lies elsewhere.)
        Up::Zone(z) => zone_prefix(z),
    }
}

/// `parent_key` of a path inside one zone, as if its prefix were the root's.
fn parent_key_in_zone(key: &[u8]) -> Vec<u8> {
    let sep = last_sep(key);
    let prefix = &key[..sep];
    if prefix.is_empty() {
        return Vec::new();
    }
    // prefix = c1 0 … cj 0: the parent is cj in directory c1/…/c(j-1).
    let body = &prefix[..prefix.len() - 1];
    match body.iter().rposition(|&b| b == 0) {
        None => child_key(b"", body),
        Some(i) => child_key(&body[..=i], &body[i + 1..]),
    }
}

/// Whether `key` is well formed: empty (the root), or components separated as above,
/// after a zone prefix or not.
pub fn valid_key(key: &[u8]) -> bool {
    let (zp, rest) = split_zone(key);
    if !zp.is_empty() {
        return !rest.is_empty() && valid_key_in_zone(rest);
    }
    if key.first() == Some(&b'/') {
        return false; // a malformed zone prefix
    }
    valid_key_in_zone(key)
}

fn valid_key_in_zone(key: &[u8]) -> bool {
    if key.is_empty() {
        return true;
    }
    let sep = last_sep(key);
    if key[0] != 0 && sep == 0 {
        return false;
    }
    let name = &key[sep + 1..];
    let prefix = &key[..sep];
    valid_name(name)
        && (prefix.is_empty()
            || (prefix.ends_with(&[0])
                && prefix[..prefix.len() - 1]
                    .split(|&b| b == 0)
                    .all(valid_name)))
}

pub fn valid_name(n: &[u8]) -> bool {
    !n.is_empty() && n.len() <= 255 && !n.contains(&0) && !n.contains(&b'/')
}

/// Depth of a key (1 for a top-level name, 0 for the root).
pub fn depth(key: &[u8]) -> usize {
    if key.is_empty() {
        0
    } else {
        key.iter().filter(|&&b| b == 0).count()
    }
}

pub fn meta_key(path: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + path.len());
    k.push(META);
    k.extend_from_slice(path);
    k
}

/// The index key of the name at `path` (a link stub, or a record with a marker).
pub fn index_key(path: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + path.len());
    k.push(INDEX);
    k.extend_from_slice(path);
    k
}

pub fn inode_key(ino: u64) -> Vec<u8> {
    let mut k = vec![INODE];
    k.extend_from_slice(&ino.to_be_bytes());
    k
}

pub fn orphan_key(ino: u64) -> Vec<u8> {
    let mut k = vec![ORPHAN];
    k.extend_from_slice(&ino.to_be_bytes());
    k
}

/// Where a file's inode and data are: under a path, or under its number.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Loc {
    Path(Vec<u8>),
    Ino(u64),
    /// A file with no name any more, still open: its inode under its number, its data
    /// still under the path it had (moving it costs a copy; most orphans are freed at
    /// the kernel's FORGET right after the unlink). Its `o` marker names the path.
    Orphan {
        path: Vec<u8>,
        ino: u64,
    },
}

impl Loc {
    pub fn meta(&self) -> Vec<u8> {
        match self {
            Loc::Path(p) => meta_key(p),
            Loc::Ino(i) | Loc::Orphan { ino: i, .. } => inode_key(*i),
        }
    }
    /// Data keys are this followed by the block number (8 bytes, big-endian).
    pub fn data_prefix(&self) -> Vec<u8> {
        match self {
            Loc::Path(p) | Loc::Orphan { path: p, .. } => {
                let mut k = Vec::with_capacity(p.len() + 2);
                k.push(DATA);
                k.extend_from_slice(p);
                k.push(0);
                k
            }
            Loc::Ino(i) => {
                let mut k = vec![INODE_DATA];
                k.extend_from_slice(&i.to_be_bytes());
                k
            }
        }
    }
    pub fn data_key(&self, block: u64) -> Vec<u8> {
        let mut k = self.data_prefix();
        k.extend_from_slice(&block.to_be_bytes());
        k
    }
}

/// The block number of a data key under `prefix`.
pub fn block_of(prefix: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(prefix)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// The path-key (or inode) a data key belongs to, for the checker.
pub fn data_owner(key: &[u8]) -> Option<(Loc, u64)> {
    if key.len() < 9 {
        return None;
    }
    let block = u64::from_be_bytes(key[key.len() - 8..].try_into().ok()?);
    match key[0] {
        DATA => {
            let body = &key[1..key.len() - 8];
            let path = body.strip_suffix(&[0])?;
            Some((Loc::Path(path.to_vec()), block))
        }
        INODE_DATA if key.len() == 17 => Some((
            Loc::Ino(u64::from_be_bytes(key[1..9].try_into().ok()?)),
            block,
        )),
        _ => None,
    }
}

/// `key` with the path prefix `from` replaced by `to` (key spaces `m` and `d`, whose
/// second byte on is a path).
pub fn rebase(key: &[u8], from: &[u8], to: &[u8]) -> Option<Vec<u8>> {
    let rest = key.get(1..)?.strip_prefix(from)?;
    let mut k = Vec::with_capacity(1 + to.len() + rest.len());
    k.push(key[0]);
    k.extend_from_slice(to);
    k.extend_from_slice(rest);
    Some(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(path: &[&[u8]]) -> Vec<u8> {
        let mut prefix = Vec::new();
        let mut k = Vec::new();
        for c in path {
            k = child_key(&prefix, c);
            prefix = dir_prefix(&k);
        }
        k
    }

    #[test]
    fn children_and_subtrees_are_contiguous_for_any_name_byte() {
        let names: Vec<&[u8]> = vec![b"a", b"\x01", b"a\x01b", b"\xff", b"b", b"a.b", b"\x01\x01"];
        let mut all = Vec::new();
        for x in &names {
            all.push(vec![*x]);
            for y in &names {
                all.push(vec![*x, *y]);
                for z in &names {
                    all.push(vec![*x, *y, *z]);
                }
            }
        }
        let mut keys: Vec<(Vec<u8>, Vec<&[u8]>)> =
            all.iter().map(|p| (key(p), p.clone())).collect();
        keys.sort();
        for (k, p) in &keys {
            assert!(valid_key(k), "{p:?}");
            assert_eq!(name_of(k), *p.last().unwrap());
            assert_eq!(depth(k), p.len());
            let parent = key(&p[..p.len() - 1]);
            assert_eq!(parent_key(k), parent, "{p:?}");
        }
        for (dk, d) in &keys {
            let prefix = dir_prefix(dk);
            let kids = child_key(&prefix, b"");
            // Subtree: exactly the keys starting with the prefix, one contiguous run.
            let inside: Vec<bool> = keys
                .iter()
                .map(|(_, p)| p.len() > d.len() && p[..d.len()] == d[..])
                .collect();
            let by_prefix: Vec<bool> = keys.iter().map(|(k, _)| k.starts_with(&prefix)).collect();
            assert_eq!(inside, by_prefix, "subtree of {d:?}");
            let first = inside.iter().position(|&b| b);
            let last = inside.iter().rposition(|&b| b);
            if let (Some(f), Some(l)) = (first, last) {
                assert!(
                    inside[f..=l].iter().all(|&b| b),
                    "subtree of {d:?} not contiguous"
                );
            }
            // Children: exactly the keys starting with prefix 0, contiguous.
            let child: Vec<bool> = keys
                .iter()
                .map(|(_, p)| p.len() == d.len() + 1 && p[..d.len()] == d[..])
                .collect();
            let by_kids: Vec<bool> = keys.iter().map(|(k, _)| k.starts_with(&kids)).collect();
            assert_eq!(child, by_kids, "children of {d:?}");
            if let (Some(f), Some(l)) = (
                child.iter().position(|&b| b),
                child.iter().rposition(|&b| b),
            ) {
                assert!(
                    child[f..=l].iter().all(|&b| b),
                    "children of {d:?} not contiguous"
                );
            }
        }
    }

    #[test]
    fn data_keys_parse_back() {
        let p = key(&[b"dir", b"f\x01"]);
        let loc = Loc::Path(p.clone());
        let k = loc.data_key(0x0102_0000_0000_0003);
        assert_eq!(data_owner(&k), Some((Loc::Path(p), 0x0102_0000_0000_0003)));
        let loc = Loc::Ino(77);
        assert_eq!(data_owner(&loc.data_key(5)), Some((loc.clone(), 5)));
        assert_eq!(block_of(&loc.data_prefix(), &loc.data_key(9)), Some(9));
    }

    #[test]
    fn rebase_moves_a_subtree_prefix() {
        let from = dir_prefix(&key(&[b"a"]));
        let to = dir_prefix(&key(&[b"z", b"y"]));
        let k = meta_key(&key(&[b"a", b"b", b"c"]));
        let moved = rebase(&k, &from, &to).unwrap();
        assert_eq!(moved, meta_key(&key(&[b"z", b"y", b"b", b"c"])));
        assert_eq!(prefix_end(b"m\x01"), b"m\x02".to_vec());
    }
}
