//! What mount finishes after a crash: orphans (inodes with no name that were open, and
//! copies of a file's data left by an interrupted move to its number) and directory
//! renames too large for one batch, which an intent record names. Since range renames
//! (`Batch::rename_prefix`) every rename and move is one batch, so the last two come
//! only from images written before: their moves are finished the way they were begun,
//! by copies (a range rename would replace the keys already moved).

use crate::fs::Betrfs;
use crate::keys;
use crate::record;
use quilt_betree::Batch;
use quilt_vfs::{FsError, Result};

/// The value of a rename intent: the old and new path prefixes and the key spaces that
/// move. (Written by earlier versions; here for the tests.)
#[cfg(test)]
pub fn intent(from: &[u8], to: &[u8], spaces: &[u8]) -> Vec<u8> {
    let mut v = vec![1u8, spaces.len() as u8];
    v.extend_from_slice(spaces);
    v.extend_from_slice(&(from.len() as u32).to_le_bytes());
    v.extend_from_slice(from);
    v.extend_from_slice(&(to.len() as u32).to_le_bytes());
    v.extend_from_slice(to);
    v
}

pub fn decode_intent(v: &[u8]) -> Result<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    let bad = || FsError::Corrupt("a damaged rename intent".into());
    let (&ver, rest) = v.split_first().ok_or_else(bad)?;
    let (&n, rest) = rest.split_first().ok_or_else(bad)?;
    if ver != 1 || rest.len() < n as usize {
        return Err(bad());
    }
    let (spaces, rest) = rest.split_at(n as usize);
    let take = |r: &[u8]| -> Result<(Vec<u8>, usize)> {
        let len =
            u32::from_le_bytes(r.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
        let b = r.get(4..4 + len).ok_or_else(bad)?;
        Ok((b.to_vec(), 4 + len))
    };
    let (from, used) = take(rest)?;
    let (to, used2) = take(&rest[used..])?;
    if used + used2 != rest.len() || spaces.iter().any(|s| *s != keys::META && *s != keys::DATA) {
        return Err(bad());
    }
    Ok((from, to, spaces.to_vec()))
}

fn scan(fs: &Betrfs, space: u8) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let lo = vec![space];
    let hi = vec![space + 1];
    fs.tree
        .range(&lo, Some(&hi))
        .map(|kv| kv.map_err(|e| FsError::Corrupt(e.to_string())))
        .collect()
}

/// Lists every link stub in the index (images made before the index existed: their
/// superblock record is version 1; they hold no markers yet). In batches; a crash
/// before the superblock record is rewritten makes the next mount start again.
pub(crate) fn build_index(fs: &Betrfs) -> Result<()> {
    let mut st = fs.lock();
    let mut b = Batch::new();
    let mut bytes = 0usize;
    for (k, v) in scan(fs, keys::META)? {
        if let record::Entry::Link { .. } = record::Entry::decode(&v)? {
            let key = keys::index_key(&k[1..]);
            bytes += key.len() + 16;
            b.put(&key, b"");
            if bytes > fs.batch_bytes {
                fs.commit(&mut st, std::mem::take(&mut b))?;
                bytes = 0;
            }
        }
    }
    fs.commit(&mut st, b)
}

pub(crate) fn recover(fs: &Betrfs) -> Result<()> {
    let mut st = fs.lock();
    for (k, v) in scan(fs, keys::RENAME)? {
        let (from, to, spaces) = decode_intent(&v)?;
        tracing::info!("betrfs: finishing a rename interrupted by a crash");
        fs.move_chunked(&mut st, &from, &to, &spaces)?;
        let mut b = Batch::new();
        b.delete(&k);
        fs.commit(&mut st, b)?;
    }
    for (k, v) in scan(fs, keys::ORPHAN)? {
        let ino = u64::from_be_bytes(
            k.get(1..9)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| FsError::Corrupt("a damaged orphan key".into()))?,
        );
        if !v.is_empty() && !keys::valid_key(&v) {
            return Err(FsError::Corrupt(format!(
                "orphan {ino} names a malformed path"
            )));
        }
        let mut b = Batch::new();
        let gone = match fs
            .tree
            .get(&keys::inode_key(ino))
            .map_err(|e| FsError::Corrupt(e.to_string()))?
        {
            // Linked again before the crash: a leftover marker.
            Some(val) => record::decode_inode(&val)?.nlink == 0,
            // An interrupted move to the number: only copies are there.
            None => true,
        };
        if gone {
            b.delete(&keys::inode_key(ino));
            let p = keys::Loc::Ino(ino).data_prefix();
            b.delete_range(&p, &keys::prefix_end(&p));
            if !v.is_empty() {
                // An orphan whose data is still under the path it had.
                let p = keys::Loc::Path(v.clone()).data_prefix();
                b.delete_range(&p, &keys::prefix_end(&p));
            }
        }
        b.delete(&k);
        fs.commit(&mut st, b)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn intents_round_trip() {
        let v = super::intent(b"a\0", b"b\0c\0", b"md");
        assert_eq!(
            super::decode_intent(&v).unwrap(),
            (b"a\0".to_vec(), b"b\0c\0".to_vec(), b"md".to_vec())
        );
        for n in 0..v.len() {
            assert!(super::decode_intent(&v[..n]).is_err());
        }
    }
}
