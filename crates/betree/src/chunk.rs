//! A scan's chunk: the entries of one leaf's window, in key order, with their keys and
//! values in one buffer (two allocations for the chunk, not two per entry). The
//! iterator lends them (`Iter::next_entry`) or copies them out (`Iterator::next`).

#[derive(Debug, Default)]
pub struct Chunk {
    bytes: Vec<u8>,
    /// Where each entry's key starts, the key's length and the value's (which follows).
    ents: Vec<(u32, u32, u32)>,
}

impl Chunk {
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.ents.clear();
    }

    pub fn reserve(&mut self, bytes: usize, entries: usize) {
        self.bytes.reserve(bytes);
        self.ents.reserve(entries);
    }

    pub fn push(&mut self, k: &[u8], v: &[u8]) {
        self.ents
            .push((self.bytes.len() as u32, k.len() as u32, v.len() as u32));
        self.bytes.extend_from_slice(k);
        self.bytes.extend_from_slice(v);
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
