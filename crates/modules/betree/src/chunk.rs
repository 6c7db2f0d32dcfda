//! A scan's chunk: the entries of one leaf's window, in key order, with their keys and
//! values in one buffer (two allocations for the chunk, not two per entry). The
//! iterator lends them (`Iter::next_entry`) or copies them out (`Iterator::next`).

#[derive(Debug, Default)]
pub struct Chunk {
    bytes: Vec<u8>,
    /// Where each entry's key starts, the key's length and the value's (which follows).
    ents: Vec<(u32, u32, u32)>,
    /// A keys-only chunk's value lengths, one per entry (its values are not held).
    lens: Vec<u32>,
}

impl Chunk {
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.ents.clear();
        self.lens.clear();
    }

    /// Room for what the next chunk is expected to hold. Called on an empty chunk: a
    /// buffer too small is replaced rather than grown, since growing one would copy
    /// its old (cleared) bytes for nothing.
    pub fn reserve(&mut self, bytes: usize, entries: usize) {
        debug_assert!(self.ents.is_empty());
        if self.bytes.capacity() < bytes {
            self.bytes = Vec::with_capacity(bytes);
        }
        if self.ents.capacity() < entries {
            self.ents = Vec::with_capacity(entries);
        }
    }

    pub fn push(&mut self, k: &[u8], v: &[u8]) {
        self.ents
            .push((self.bytes.len() as u32, k.len() as u32, v.len() as u32));
        self.bytes.extend_from_slice(k);
        self.bytes.extend_from_slice(v);
    }

    /// An entry of a keys-only chunk: its key, and its value's length only.
    pub fn push_key(&mut self, k: &[u8], value_len: usize) {
        self.ents.push((self.bytes.len() as u32, k.len() as u32, 0));
        self.bytes.extend_from_slice(k);
        self.lens.push(value_len as u32);
    }

    /// The length of entry `i`'s value (held, or only counted in a keys-only chunk).
    pub fn value_len(&self, i: usize) -> usize {
        match self.lens.get(i) {
            Some(&l) => l as usize,
            None => self.ents[i].2 as usize,
        }
    }

    /// Bytes its buffers hold room for.
    pub fn capacity(&self) -> usize {
        self.bytes.capacity() + self.ents.capacity() * 12 + self.lens.capacity() * 4
    }

    pub fn len(&self) -> usize {
        self.ents.len()
    }

    pub fn get(&self, i: usize) -> (&[u8], &[u8]) {
        let (at, k, v) = self.ents[i];
        let (at, k, v) = (at as usize, k as usize, v as usize);
        (&self.bytes[at..at + k], &self.bytes[at + k..at + k + v])
    }
}
