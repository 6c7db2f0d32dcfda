//! A leaf's (or a basement's) sorted entries in one buffer: each entry is its on-disk
//! encoding (key length, key, value length, value; lengths as u32 LE) and an offset
//! table finds the i-th. A basement read from disk becomes one of these with one copy
//! and no allocation per entry, and writing a basement is a copy of a slice.

use crate::codec::key_cmp;
use crate::{Error, Result};

/// The first index in `from..to` that is not `below` (`to` if all are), where `below`
/// holds for a prefix of the range: probed at distances 1, 2, 4, ... from `from`, then
/// bisected, so finding an index `d` places on costs about 2 log d probes (a scan's next
/// message is usually near, sometimes a whole basement away).
pub fn gallop(from: usize, to: usize, below: impl Fn(usize) -> bool) -> usize {
    // `lo`: the first index not known to be below; `hi`: one known not to be (or `to`).
    let (mut lo, mut hi, mut step) = (from, to, 1);
    while lo < hi {
        let probe = lo + step - 1;
        if probe >= hi {
            break;
        }
        if below(probe) {
            lo = probe + 1;
            step *= 2;
        } else {
            hi = probe;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Pushes onto `offs` where each of `count` entries of `buf` starts (plus `base`),
/// checking bounds and that keys ascend strictly (from above `after`, if given).
fn offsets(
    buf: &[u8],
    count: usize,
    after: Option<&[u8]>,
    base: u32,
    offs: &mut Vec<u32>,
) -> Result<()> {
    let bad = |why: &str| Err(Error::Corrupt(format!("basement: {why}")));
    if count > buf.len() / 8 {
        return bad("entry count past the end");
    }
    offs.reserve(count);
    let mut at = 0usize;
    let mut prev: Option<&[u8]> = after;
    for _ in 0..count {
        if at + 4 > buf.len() {
            return bad("truncated");
        }
        let kl = u32_at(buf, at);
        let kend = at + 4 + kl;
        if kend + 4 > buf.len() {
            return bad("truncated key");
        }
        let vl = u32_at(buf, kend);
        let end = kend + 4 + vl;
        if end > buf.len() {
            return bad("truncated value");
        }
        let key = &buf[at + 4..kend];
        if prev.is_some_and(|p| key_cmp(p, key).is_ge()) {
            return bad("keys out of order");
        }
        prev = Some(key);
        offs.push(base + at as u32);
        at = end;
    }
    if at != buf.len() {
        return bad("trailing bytes");
    }
    Ok(())
}

#[derive(Debug, Clone, Default)]
pub struct Entries {
    buf: Vec<u8>,
    offs: Vec<u32>,
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize
}

impl Entries {
    pub fn with_capacity(bytes: usize, n: usize) -> Entries {
        Entries {
            buf: Vec::with_capacity(bytes),
            offs: Vec::with_capacity(n),
        }
    }

    /// Validates an encoded run of `count` entries (bounds, strictly ascending keys).
    pub fn from_body(buf: Vec<u8>, count: usize) -> Result<Entries> {
        let mut offs = Vec::with_capacity(count);
        offsets(&buf, count, None, 0, &mut offs)?;
        Ok(Entries { buf, offs })
    }

    /// Appends an encoded run of `count` entries (a basement's body, validated as
    /// `from_body` does, its first key above every key so far): a scan that streams
    /// basements through one reused `Entries` copies each once and allocates nothing.
    pub fn append_body(&mut self, body: &[u8], count: usize) -> Result<()> {
        let Entries { buf, offs } = self;
        let last = offs.last().map(|&at| {
            let at = at as usize;
            &buf[at + 4..at + 4 + u32_at(buf, at)]
        });
        // (Offsets are u32: a damaged leaf whose basements overlap could join past it.)
        let base = u32::try_from(buf.len() + body.len())
            .map(|_| buf.len() as u32)
            .map_err(|_| Error::Corrupt("basements: more than 4 GiB joined".into()))?;
        let had = offs.len();
        if let Err(e) = offsets(body, count, last, base, offs) {
            offs.truncate(had);
            return Err(e);
        }
        buf.extend_from_slice(body);
        Ok(())
    }

    /// Empties it, keeping its buffers.
    pub fn clear(&mut self) {
        self.buf.clear();
        self.offs.clear();
    }

    pub fn len(&self) -> usize {
        self.offs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.offs.is_empty()
    }

    /// Encoded bytes of all entries.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn key(&self, i: usize) -> &[u8] {
        let at = self.offs[i] as usize;
        &self.buf[at + 4..at + 4 + u32_at(&self.buf, at)]
    }

    pub fn get(&self, i: usize) -> (&[u8], &[u8]) {
        let at = self.offs[i] as usize;
        let kend = at + 4 + u32_at(&self.buf, at);
        let vl = u32_at(&self.buf, kend);
        (&self.buf[at + 4..kend], &self.buf[kend + 4..kend + 4 + vl])
    }

    pub fn search(&self, key: &[u8]) -> std::result::Result<usize, usize> {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            match key_cmp(self.key(mid), key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(lo)
    }

    pub fn value_of(&self, key: &[u8]) -> Option<&[u8]> {
        self.search(key).ok().map(|i| self.get(i).1)
    }

    /// Appends an entry (its key above every key so far).
    pub fn push(&mut self, k: &[u8], v: &[u8]) {
        debug_assert!(self.is_empty() || self.key(self.len() - 1) < k);
        self.offs.push(self.buf.len() as u32);
        self.buf.extend_from_slice(&(k.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(k);
        self.buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(v);
    }

    /// Changes the entries at index `i` in place: with `replace`, entry `i` becomes
    /// `kv` (or goes, for `None`); without, `kv` is inserted before entry `i`. The
    /// caller keeps keys ascending (`i` from `search`). It moves the entries after `i`
    /// once, where a rebuild would copy all of them and compare keys from the start.
    pub fn splice(&mut self, i: usize, replace: bool, kv: Option<(&[u8], &[u8])>) {
        let start = self.offs.get(i).map_or(self.buf.len(), |&o| o as usize);
        let end = if replace {
            self.offs.get(i + 1).map_or(self.buf.len(), |&o| o as usize)
        } else {
            start
        };
        let mut enc = Vec::new();
        if let Some((k, v)) = kv {
            enc.reserve(8 + k.len() + v.len());
            enc.extend_from_slice(&(k.len() as u32).to_le_bytes());
            enc.extend_from_slice(k);
            enc.extend_from_slice(&(v.len() as u32).to_le_bytes());
            enc.extend_from_slice(v);
        }
        let grow = enc.len() as i64 - (end - start) as i64;
        self.buf.splice(start..end, enc);
        // The entries after the changed one, shifted by the change in bytes.
        let after = match (replace, kv.is_some()) {
            (true, false) => {
                self.offs.remove(i);
                i
            }
            (true, true) => i + 1,
            (false, _) => {
                self.offs.insert(i, start as u32);
                i + 1
            }
        };
        if grow != 0 {
            for o in &mut self.offs[after..] {
                *o = (*o as i64 + grow) as u32;
            }
        }
    }

    /// Appends entries `from..to` of `other`.
    pub fn extend_from(&mut self, other: &Entries, from: usize, to: usize) {
        if from >= to {
            return;
        }
        let start = other.offs[from] as usize;
        let end = other.offs.get(to).map_or(other.buf.len(), |&o| o as usize);
        let base = self.buf.len() as u32;
        self.buf.extend_from_slice(&other.buf[start..end]);
        self.offs.extend(
            other.offs[from..to]
                .iter()
                .map(|&o| o - start as u32 + base),
        );
    }

    /// The encoding of entries `from..to` (a basement's body).
    pub fn body(&self, from: usize, to: usize) -> &[u8] {
        if from >= to {
            return &[];
        }
        let start = self.offs[from] as usize;
        let end = self.offs.get(to).map_or(self.buf.len(), |&o| o as usize);
        &self.buf[start..end]
    }

    /// Encoded size of entry `i`.
    pub fn size(&self, i: usize) -> usize {
        let end = self.offs.get(i + 1).map_or(self.buf.len(), |&o| o as usize);
        end - self.offs[i] as usize
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&[u8], &[u8])> + '_ {
        (0..self.len()).map(move |i| self.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::key_cmp;

    proptest::proptest! {
        /// In-place changes (`splice`) leave what a model map holds: the same entries
        /// in order, offsets that a fresh parse of the buffer agrees with, every key
        /// found by `search`.
        #[test]
        fn splice_matches_a_model(
            ops in proptest::collection::vec(
                (0u8..40, proptest::option::of(proptest::collection::vec(0u8..255, 0..24))),
                1..120,
            )
        ) {
            let mut e = Entries::default();
            let mut model = std::collections::BTreeMap::new();
            for (k, v) in ops {
                let key = vec![b'k', k];
                match (e.search(&key), &v) {
                    (Ok(i), v) => e.splice(i, true, v.as_deref().map(|v| (&key[..], v))),
                    (Err(i), Some(v)) => e.splice(i, false, Some((&key[..], &v[..]))),
                    (Err(_), None) => {}
                }
                match v {
                    Some(v) => {
                        model.insert(key, v);
                    }
                    None => {
                        model.remove(&key);
                    }
                }
                let got: Vec<(Vec<u8>, Vec<u8>)> =
                    e.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
                let want: Vec<(Vec<u8>, Vec<u8>)> =
                    model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                proptest::prop_assert_eq!(&got, &want);
                let parsed = Entries::from_body(e.buf.clone(), e.len())
                    .expect("the buffer parses as entries");
                proptest::prop_assert_eq!(&parsed.offs, &e.offs);
                for (i, k) in model.keys().enumerate() {
                    proptest::prop_assert_eq!(e.search(k), Ok(i));
                }
            }
        }
    }

    /// `gallop` finds the end of the prefix wherever it lies, over ranges of every
    /// length and start (against a linear walk).
    #[test]
    fn gallop_finds_the_end_of_the_prefix() {
        for from in 0..6 {
            for to in from..70 {
                for cut in from..=to {
                    let probes = std::cell::Cell::new(0);
                    let got = gallop(from, to, |i| {
                        assert!((from..to).contains(&i), "probe {i} outside {from}..{to}");
                        probes.set(probes.get() + 1);
                        i < cut
                    });
                    assert_eq!(got, cut, "range {from}..{to}, prefix ends at {cut}");
                    let d = (cut - from + 1) as f64;
                    assert!(
                        probes.get() as f64 <= 2.0 * d.log2() + 3.0,
                        "{} probes",
                        probes.get()
                    );
                }
            }
        }
    }

    /// `key_cmp` orders as the slice order does, also for keys shorter than a word and
    /// keys equal in their first eight bytes.
    #[test]
    fn key_cmp_is_the_slice_order() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let len = |r: u64| (r % 12) as usize;
            let a: Vec<u8> = (0..len(next())).map(|_| (next() % 3) as u8).collect();
            let mut b = a.clone();
            match next() % 3 {
                0 => b.truncate(len(next()).min(b.len())),
                1 => b.push((next() % 3) as u8),
                _ => {
                    if let Some(x) = b.get_mut(len(next()) % a.len().max(1)) {
                        *x = (next() % 3) as u8;
                    }
                }
            }
            assert_eq!(key_cmp(&a, &b), a.cmp(&b), "{a:?} {b:?}");
            assert_eq!(key_cmp(&b, &a), b.cmp(&a), "{b:?} {a:?}");
        }
    }
}
