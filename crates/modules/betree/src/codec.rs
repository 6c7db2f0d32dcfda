//! Bounds-checked little-endian encoding, and the checksum every on-disk structure
//! carries. Decoding never panics: a short or damaged buffer is a `Corrupt` error.

use crate::Error;

/// crc32c of `parts`, concatenated (the SSE 4.2 instruction where there is one: a
/// point query checks a whole basement, a checkpoint every node it writes).
pub fn crc32c(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

/// Whether a stored checksum matches the one computed. Always, in a build for coverage-
/// guided fuzzing (`cargo fuzz` sets `cfg(fuzzing)`): random bytes almost never carry a
/// right checksum, and the decoders behind each check are what the fuzzer must reach.
/// Never in any other build.
#[inline]
pub fn crc_ok(computed: u32, stored: u32) -> bool {
    cfg!(fuzzing) || computed == stored
}

/// `Ok` when the checksum `stored` with `what` matches the one its bytes give
/// (`computed`), a [`Error::Checksum`] with both values when not (see `crc_ok`).
#[inline]
pub fn verify(computed: u32, stored: u32, what: impl FnOnce() -> String) -> crate::Result<()> {
    if crc_ok(computed, stored) {
        Ok(())
    } else {
        Err(Error::Checksum {
            what: what(),
            stored,
            computed,
        })
    }
}

/// Orders keys exactly as `<[u8]>::cmp` does, but compares their first eight bytes as
/// one big-endian word first. Random keys nearly always differ there, which spares the
/// call to `memcmp` that a slice comparison makes (scans and basement reads compare a
/// key per entry: a sixth of a scan's time went to `memcmp`).
#[inline]
pub fn key_cmp(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    if let (Some(x), Some(y)) = (a.first_chunk::<8>(), b.first_chunk::<8>()) {
        let (x, y) = (u64::from_be_bytes(*x), u64::from_be_bytes(*y));
        if x != y {
            return x.cmp(&y);
        }
    }
    a.cmp(b)
}

/// A key's first eight bytes as a big-endian number, zero-padded: where two keys'
/// prefixes differ, they order as the keys do (equal prefixes decide nothing).
#[inline]
pub fn key_prefix(k: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = k.len().min(8);
    b[..n].copy_from_slice(&k[..n]);
    u64::from_be_bytes(b)
}

/// `a == b`, deciding most unequal keys by their first eight bytes (no call to
/// `memcmp`; a scan's merge tests every message against each level's next one).
#[inline]
pub fn key_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if let (Some(x), Some(y)) = (a.first_chunk::<8>(), b.first_chunk::<8>()) {
        if x != y {
            return false;
        }
    }
    a == b
}

/// Appends little-endian values to a byte vector.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(n: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// A byte string with a 32-bit length.
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
    }
    pub fn raw(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// Pads with zeros to a multiple of `align`.
    pub fn pad_to(&mut self, align: usize) {
        let n = self.buf.len().div_ceil(align) * align;
        self.buf.resize(n, 0);
    }
    pub fn put_u32_at(&mut self, at: usize, v: u32) {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Reads little-endian values; every read checks the bounds.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                Error::Corrupt(format!("{}: truncated at byte {}", self.what, self.pos))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], Error> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn skip(&mut self, n: usize) -> Result<(), Error> {
        self.take(n).map(|_| ())
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// What is left to read.
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn corrupt(&self, why: impl std::fmt::Display) -> Error {
        Error::Corrupt(format!("{}: {why}", self.what))
    }
}
