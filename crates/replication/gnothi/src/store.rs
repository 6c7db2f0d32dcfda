//! A replica's data device: the home blocks of the slices it prefers, packed in slice
//! order (`Geometry::home_of`), then the reserve, a bounded area of slots for blocks it
//! keeps only while a preferred replica cannot (`docs/design/gnothi.md` §3).
//!
//! A reserve slot is two blocks: a header (`QGRS`: the volume block, its version and
//! checksum, the header's checksum) and the data. The headers of all slots come first,
//! then the data blocks, so that a run of consecutive slots is written in two requests
//! (its data, then its headers) and the headers are read at open in a few large ones.
//! (Format 1 interleaved header and data: a 1 MiB write placed in the reserve cost 512
//! requests.) The replicated table says *that* a
//! replica keeps a block in reserve; which slot is this replica's own business, found
//! again at open by reading the headers. A slot is freed by clearing its header.

use crate::codec::{le32, le64};
use crate::geometry::{Geometry, ReplicaId};
use crate::table::Version;
use quilt_block::{BlockDevice, BlockError, WriteClass};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

const SLOT_MAGIC: &[u8; 4] = b"QGRS";
/// Reserve slots read by one request when the store opens.
const SLOTS_PER_READ: u64 = 128;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(transparent)]
    Device(#[from] BlockError),
    #[error("replica {replica} does not keep block {block} at home")]
    NotHome { replica: ReplicaId, block: u64 },
    #[error("the data device has {have} blocks; replica {replica} needs {need} ({home} home, {reserve} reserve slots)")]
    TooSmall {
        replica: ReplicaId,
        have: u64,
        need: u64,
        home: u64,
        reserve: u64,
    },
    #[error("the reserve is full ({slots} slots)")]
    ReserveFull { slots: u64 },
    #[error("the data device's block size {device} is not the volume's {volume}")]
    BlockSize { device: usize, volume: u32 },
    #[error("{len} bytes is not one {block_size}-byte block")]
    NotABlock { len: usize, block_size: usize },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A reserve copy: which block, at which version, with which checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub block: u64,
    pub version: Version,
    pub checksum: u32,
}

pub struct DataStore {
    geometry: Geometry,
    replica: ReplicaId,
    dev: Arc<dyn BlockDevice>,
    home: u64,
    slots: u64,
    /// Slot of each block kept in reserve.
    reserved: HashMap<u64, (u64, Reserved)>,
    free: Vec<u64>,
    /// Slots of copies a newer one replaced: cleared only after the next flush, so
    /// that a crash never finds the old header cleared and the new one not yet
    /// durable (no copy at all). Until then, reopening keeps the newer of the two.
    retired: Vec<u64>,
    /// Home and reserve writes not on the device yet (device block → data), written
    /// back in block order by a flush: the page cache's job, so that applying a write never
    /// waits for the data disk. Past [`DIRTY_LIMIT`] blocks, home writes go to the
    /// device at once.
    dirty: BTreeMap<u64, Vec<u8>>,
    /// What write-backs under way are writing, in begin order (which is the order they
    /// reach the device), with whether each is done: reads look here after `dirty`,
    /// newest first, before the device. Two may be under way at once (the flusher's
    /// and a Phase 2 fetch's): one slot for them let the first's end hide the second's
    /// blocks, and reads then met the device's older copy. A batch that is done stays
    /// until every older one is, so that an older one that fails knows which of its
    /// blocks were written again since.
    writing: Vec<(Blocks, bool)>,
    /// Blocks written through to the device (the buffer was full) while write-backs
    /// were under way: the device has them newer than any of those batches, so reads
    /// skip the batches for them, and a batch that fails or is written again leaves
    /// them alone. Cleared once no batch is under way.
    through: std::collections::BTreeSet<u64>,
    /// Held while home data goes to the device, so that an older batch never lands
    /// over a newer write: taken after the replica's lock, never before it.
    device_order: Arc<Mutex<()>>,
    /// Write-backs begun so far; the first whose success again means that everything
    /// buffered before its begin is durable (a failed one puts its blocks back in the
    /// buffer, so only a batch begun after that carries them).
    batches_begun: u64,
    whole_from: u64,
}

/// Home blocks by device block, as a write-back batch carries them.
type Blocks = Arc<BTreeMap<u64, Vec<u8>>>;

/// Home blocks a store buffers at most before writing through.
pub const DIRTY_LIMIT: usize = 16384;

/// A write-back batch: see [`DataStore::flush_begin`].
pub struct Batch {
    pub dev: Arc<dyn BlockDevice>,
    pub blocks: Arc<BTreeMap<u64, Vec<u8>>>,
    pub device_order: Arc<Mutex<()>>,
    retired: Vec<u64>,
    seq: u64,
}

impl Batch {
    /// Writes the batch to the device in block order, one request per run of
    /// consecutive blocks, and flushes it. The caller holds `device_order`.
    pub fn write_out(&self) -> Result<()> {
        write_runs(self.dev.as_ref(), &self.blocks)?;
        Ok(self.dev.flush()?)
    }
}

fn write_runs(dev: &dyn BlockDevice, blocks: &BTreeMap<u64, Vec<u8>>) -> Result<()> {
    let mut run: Vec<u8> = Vec::new();
    let mut start = 0u64;
    let mut next = 0u64;
    for (&b, d) in blocks {
        if !run.is_empty() && b != next {
            dev.write_blocks(start, &run, WriteClass::Data)?;
            run.clear();
        }
        if run.is_empty() {
            start = b;
        }
        run.extend_from_slice(d);
        next = b + 1;
    }
    if !run.is_empty() {
        dev.write_blocks(start, &run, WriteClass::Data)?;
    }
    Ok(())
}

fn crc(b: &[u8]) -> u32 {
    crc32c::crc32c(b)
}

impl DataStore {
    /// Blocks a data device needs for `replica` with `slots` reserve slots.
    pub fn blocks_needed(geometry: &Geometry, replica: ReplicaId, slots: u64) -> u64 {
        geometry.home_blocks(replica) + 2 * slots
    }

    /// Opens replica `replica`'s data device with `slots` reserve slots, finding the
    /// reserve copies it holds. A new device reads as zeros: every slot free.
    pub fn open(
        geometry: Geometry,
        replica: ReplicaId,
        dev: Arc<dyn BlockDevice>,
        slots: u64,
    ) -> Result<DataStore> {
        if dev.block_size() != geometry.block_size as usize {
            return Err(StoreError::BlockSize {
                device: dev.block_size(),
                volume: geometry.block_size,
            });
        }
        let home = geometry.home_blocks(replica);
        let need = DataStore::blocks_needed(&geometry, replica, slots);
        if dev.block_count() < need {
            return Err(StoreError::TooSmall {
                replica,
                have: dev.block_count(),
                need,
                home,
                reserve: slots,
            });
        }
        let mut s = DataStore {
            geometry,
            replica,
            dev,
            home,
            slots,
            reserved: HashMap::new(),
            free: Vec::new(),
            retired: Vec::new(),
            dirty: BTreeMap::new(),
            writing: Vec::new(),
            through: std::collections::BTreeSet::new(),
            batches_begun: 0,
            whole_from: 0,
            device_order: Arc::new(Mutex::new(())),
        };
        // The reserve is read in runs of slots (one request each), not a block at a time.
        let bs = s.dev.block_size();
        let mut headers = Vec::with_capacity(slots as usize);
        let mut run = vec![0u8; SLOTS_PER_READ as usize * bs];
        for first in (0..slots).step_by(SLOTS_PER_READ as usize) {
            let n = SLOTS_PER_READ.min(slots - first);
            let buf = &mut run[..n as usize * bs];
            s.dev.read_blocks(s.header_block(first), buf)?;
            headers.extend(buf.chunks(bs).map(|h| s.decode_header(h)));
        }
        for slot in (0..slots).rev() {
            match headers[slot as usize] {
                // Of two slots naming one block (a crash between writing the new copy
                // and clearing the old), the newer version is kept.
                Some(r) => match s.reserved.get(&r.block) {
                    Some(&(_, old)) if old.version >= r.version => s.free.push(slot),
                    Some(&(old_slot, _)) => {
                        s.free.push(old_slot);
                        s.reserved.insert(r.block, (slot, r));
                    }
                    None => {
                        s.reserved.insert(r.block, (slot, r));
                    }
                },
                None => s.free.push(slot),
            }
        }
        tracing::trace!(replica = s.replica, reserved = ?s.reserved, "data device opened");
        Ok(s)
    }

    fn header_block(&self, slot: u64) -> u64 {
        self.home + slot
    }

    fn data_block(&self, slot: u64) -> u64 {
        self.home + self.slots + slot
    }

    fn decode_header(&self, b: &[u8]) -> Option<Reserved> {
        if &b[0..4] != SLOT_MAGIC {
            return None;
        }
        if crc(&b[..28]) != le32(b, 28) {
            return None;
        }
        let r = Reserved {
            block: le64(b, 4),
            version: le64(b, 12),
            checksum: le32(b, 20),
        };
        (r.block < self.geometry.blocks).then_some(r)
    }

    fn check_block(&self, data: &[u8]) -> Result<()> {
        let bs = self.geometry.block_size as usize;
        if data.len() != bs {
            return Err(StoreError::NotABlock {
                len: data.len(),
                block_size: bs,
            });
        }
        Ok(())
    }

    fn home_block(&self, block: u64) -> Result<u64> {
        self.geometry
            .home_of(self.replica, block)
            .ok_or(StoreError::NotHome {
                replica: self.replica,
                block,
            })
    }

    /// Whether `block`'s home copy is still on its way to the device: buffered, or in
    /// a write-back batch not yet reported done (a failed batch puts its blocks back).
    pub fn home_pending(&self, block: u64) -> bool {
        let Ok(at) = self.home_block(block) else {
            return false;
        };
        self.dirty.contains_key(&at)
            || self
                .writing
                .iter()
                .any(|(w, done)| !done && w.contains_key(&at))
    }

    /// Whether freed reserve slots wait for a flush before they can be reused.
    pub fn has_retired(&self) -> bool {
        !self.retired.is_empty()
    }

    pub fn io(&self) -> quilt_block::IoStats {
        self.dev.stats()
    }

    /// Writes `block`'s data at home (durable at the next flush).
    pub fn write_home(&mut self, block: u64, data: &[u8]) -> Result<()> {
        self.check_block(data)?;
        let at = self.home_block(block)?;
        self.buffer(at, data)
    }

    /// Buffers device blocks from `at` (home, or a reserve's data and headers), or
    /// writes them through when the buffer is full.
    fn buffer(&mut self, at: u64, data: &[u8]) -> Result<()> {
        let bs = self.geometry.block_size as usize;
        let n = (data.len() / bs) as u64;
        if self.dirty.len() + n as usize <= DIRTY_LIMIT {
            for (i, d) in data.chunks(bs).enumerate() {
                self.dirty.insert(at + i as u64, d.to_vec());
            }
            return Ok(());
        }
        // Through to the device, after any write-back under way (it may hold older
        // data for these blocks), and over what waits in the buffer for them.
        let order = self.device_order.clone();
        let _order = order.lock().unwrap_or_else(|p| p.into_inner());
        for b in at..at + n {
            self.dirty.remove(&b);
        }
        self.dev.write_blocks(at, data, WriteClass::Data)?;
        if !self.writing.is_empty() {
            self.through.extend(at..at + n);
        }
        Ok(())
    }

    /// Writes whole blocks from `first` at home in as few requests as their homes
    /// allow (one per run of consecutive home locations: a slice is one run).
    pub fn write_home_run(&mut self, first: u64, data: &[u8]) -> Result<()> {
        let bs = self.geometry.block_size as usize;
        if data.is_empty() || data.len() % bs != 0 {
            return self.check_block(data);
        }
        for (at, i, j) in self.home_runs(first, (data.len() / bs) as u64)? {
            self.buffer(at, &data[i * bs..j * bs])?;
        }
        Ok(())
    }

    /// The runs of consecutive device blocks that `n` volume blocks from `first` map
    /// to at home: (first device block, index of its first block, index past its last).
    fn home_runs(&self, first: u64, n: u64) -> Result<Vec<(u64, usize, usize)>> {
        let mut runs = Vec::new();
        let mut i = 0u64;
        while i < n {
            let at = self.home_block(first + i)?;
            let mut j = i + 1;
            while j < n && self.home_block(first + j)? == at + (j - i) {
                j += 1;
            }
            runs.push((at, i as usize, j as usize));
            i = j;
        }
        Ok(runs)
    }

    /// Device block `at` as buffered, newest first: the buffer, then write-backs
    /// under way (newest last in `writing`).
    fn buffered(&self, at: u64) -> Option<&Vec<u8>> {
        self.dirty.get(&at).or_else(|| {
            if self.through.contains(&at) {
                return None;
            }
            self.writing.iter().rev().find_map(|(w, _)| w.get(&at))
        })
    }

    pub fn read_home(&self, block: u64, buf: &mut [u8]) -> Result<()> {
        self.check_block(buf)?;
        let at = self.home_block(block)?;
        if let Some(d) = self.buffered(at) {
            buf.copy_from_slice(d);
            return Ok(());
        }
        Ok(self.dev.read(at, buf)?)
    }

    /// Reads the home copies of `out.len() / block size` blocks from `first`, with one
    /// device request per run of consecutive home blocks (a slice's are consecutive),
    /// buffered blocks taken from the buffer.
    pub fn read_home_run(&self, first: u64, out: &mut [u8]) -> Result<()> {
        let bs = self.geometry.block_size as usize;
        if out.is_empty() || out.len() % bs != 0 {
            return self.check_block(out);
        }
        for (at, i, j) in self.home_runs(first, (out.len() / bs) as u64)? {
            self.dev.read_blocks(at, &mut out[i * bs..j * bs])?;
        }
        for (i, buf) in out.chunks_mut(bs).enumerate() {
            let at = self.home_block(first + i as u64)?;
            if let Some(d) = self.buffered(at) {
                buf.copy_from_slice(d);
            }
        }
        Ok(())
    }

    /// Keeps `data` for `block` at `version` in the reserve, replacing an older copy
    /// of the same block; durable at the next flush.
    pub fn reserve_put(&mut self, r: Reserved, data: &[u8]) -> Result<()> {
        self.reserve_put_many(&[(r, data)])
    }

    /// Keeps several blocks (distinct ones) in the reserve, all or none, durable at
    /// the next flush. No flush of its own: a crash before the next flush may leave a
    /// header that names data not on the device, and that is harmless, because placed
    /// data is a copy of a record the data log keeps until a flush after the placing
    /// (the replica's placed mark): the record is replayed and placed again, and a
    /// read checks every copy against the table's checksum. (A flush between data and
    /// headers made every write to a down replica's slices cost a disk flush under the
    /// replica's lock: a seventh of the write rate with one replica down.)
    pub fn reserve_put_many(&mut self, items: &[(Reserved, &[u8])]) -> Result<()> {
        for (_, d) in items {
            self.check_block(d)?;
        }
        if self.free.len() < items.len() {
            return Err(StoreError::ReserveFull { slots: self.slots });
        }
        let at = self.free.len() - items.len();
        let slots: Vec<u64> = self.free.drain(at..).rev().collect();
        if let Err(e) = self.fill_slots(&slots, items) {
            // Nothing names the slots: they are free again (a header written stands for
            // a copy the table does not know, and is cleared at the slot's next use).
            self.free.extend(slots.iter().rev());
            return Err(e);
        }
        for (&slot, &(r, _)) in slots.iter().zip(items) {
            tracing::trace!(
                replica = self.replica,
                slot,
                block = r.block,
                version = r.version,
                "reserve put"
            );
            if let Some((old, _)) = self.reserved.insert(r.block, (slot, r)) {
                self.retired.push(old);
            }
        }
        Ok(())
    }

    /// Puts the slots' data and headers in the buffer, as home writes go (written back
    /// in block order by the next flush): applying a write that stands in a reserve
    /// never waits for the data disk. (Written through, under the replica's lock, each
    /// waited out any write-back the disk was busy with: with one replica down, writes
    /// ran at a quarter of their rate.)
    fn fill_slots(&mut self, slots: &[u64], items: &[(Reserved, &[u8])]) -> Result<()> {
        let bs = self.dev.block_size();
        // Runs of consecutive slots: (first slot, index of its first item, length).
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            match runs.last_mut() {
                Some((first, _, len)) if *first + *len as u64 == slot => *len += 1,
                _ => runs.push((slot, i, 1)),
            }
        }
        let mut buf = Vec::new();
        for &(first, at, len) in &runs {
            buf.clear();
            for (_, d) in &items[at..at + len] {
                buf.extend_from_slice(d);
            }
            self.buffer(self.data_block(first), &buf)?;
        }
        for &(first, at, len) in &runs {
            buf.clear();
            buf.resize(len * bs, 0);
            for (h, (r, _)) in buf.chunks_mut(bs).zip(&items[at..at + len]) {
                h[0..4].copy_from_slice(SLOT_MAGIC);
                h[4..12].copy_from_slice(&r.block.to_le_bytes());
                h[12..20].copy_from_slice(&r.version.to_le_bytes());
                h[20..24].copy_from_slice(&r.checksum.to_le_bytes());
                let c = crc(&h[..28]);
                h[28..32].copy_from_slice(&c.to_le_bytes());
            }
            self.buffer(self.header_block(first), &buf)?;
        }
        Ok(())
    }

    /// The reserve copy of `block`, if this replica keeps one.
    pub fn reserved(&self, block: u64) -> Option<Reserved> {
        self.reserved.get(&block).map(|&(_, r)| r)
    }

    pub fn reserve_read(&self, block: u64, buf: &mut [u8]) -> Result<Option<Reserved>> {
        self.check_block(buf)?;
        let Some(&(slot, r)) = self.reserved.get(&block) else {
            return Ok(None);
        };
        let at = self.data_block(slot);
        match self.buffered(at) {
            Some(d) => buf.copy_from_slice(d),
            None => self.dev.read(at, buf)?,
        }
        Ok(Some(r))
    }

    /// Frees `block`'s reserve slot (a newer write replaced it, or every preferred
    /// replica holds it now).
    pub fn reserve_free(&mut self, block: u64) -> Result<()> {
        self.reserve_free_upto(block, Version::MAX)
    }

    /// Frees `block`'s reserve slot if its copy is of `version` or older: a copy newer
    /// than the one the log let go of is kept (a replica replaying its log finds its
    /// disk ahead of the entries it replays).
    pub fn reserve_free_upto(&mut self, block: u64, version: Version) -> Result<()> {
        if let Some(&(slot, r)) = self.reserved.get(&block) {
            if r.version <= version {
                self.reserved.remove(&block);
                if let Err(e) = self.clear_slot(slot) {
                    // Not lost: cleared after the next flush that succeeds.
                    self.retired.push(slot);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Lets go of `block`'s reserve copy without touching the device: its slot is
    /// cleared after the next flush that succeeds. For paths that must not fail on a
    /// data device that is full or failing (a snapshot's install: agreement has let go
    /// of the entries the snapshot covers by then). A header that survives a crash
    /// names a copy the table no longer does, which nothing reads.
    pub fn reserve_retire(&mut self, block: u64) {
        if let Some((slot, _)) = self.reserved.remove(&block) {
            tracing::trace!(replica = self.replica, slot, block, "reserve slot retired");
            self.retired.push(slot);
        }
    }

    /// Clears `slots`; those not cleared (the device failed) wait for the next flush.
    fn clear_retired(&mut self, slots: Vec<u64>) -> Result<()> {
        let mut left = slots.into_iter();
        while let Some(slot) = left.next() {
            if let Err(e) = self.clear_slot(slot) {
                self.retired.push(slot);
                self.retired.extend(left);
                return Err(e);
            }
        }
        Ok(())
    }

    fn clear_slot(&mut self, slot: u64) -> Result<()> {
        tracing::trace!(replica = self.replica, slot, "reserve slot cleared");
        let zero = vec![0u8; self.dev.block_size()];
        self.buffer(self.header_block(slot), &zero)?;
        self.free.push(slot);
        Ok(())
    }

    /// Every reserve copy this replica keeps.
    pub fn reserved_all(&self) -> Vec<Reserved> {
        self.reserved.values().map(|&(_, r)| r).collect()
    }

    /// Reserve slots in use.
    pub fn reserve_used(&self) -> u64 {
        self.reserved.len() as u64
    }

    /// Reserve slots free now (slots of replaced copies come back after a flush).
    pub fn reserve_slots_free(&self) -> u64 {
        self.free.len() as u64
    }

    /// Makes every write so far durable; then clears the slots of replaced copies
    /// (their clearing is durable at the next flush, and harmless if lost: the newer
    /// copy wins at reopen).
    pub fn flush(&mut self) -> Result<()> {
        {
            let order = self.device_order.clone();
            let _order = order.lock().unwrap_or_else(|p| p.into_inner());
            // A write-back not reported done may have failed, and its blocks are not
            // back in the buffer yet: written again, oldest first, before the buffer.
            for (w, done) in &self.writing {
                if !done {
                    let older: BTreeMap<u64, Vec<u8>> = w
                        .iter()
                        .filter(|(b, _)| !self.through.contains(b))
                        .map(|(&b, d)| (b, d.clone()))
                        .collect();
                    write_runs(self.dev.as_ref(), &older)?;
                }
            }
            write_runs(self.dev.as_ref(), &self.dirty)?;
            self.dirty.clear();
            self.dev.flush()?;
        }
        let retired = std::mem::take(&mut self.retired);
        self.clear_retired(retired)
    }

    /// A flush in two halves, for writing back outside the replica's lock:
    /// `flush_begin` takes what is buffered and the replaced slots a flush started now
    /// makes clearable; the caller takes `device_order` before it lets the replica's
    /// lock go, writes the batch out ([`Batch::write_out`]), and reports with
    /// `flush_done`.
    pub fn flush_begin(&mut self) -> Batch {
        let blocks = Arc::new(std::mem::take(&mut self.dirty));
        self.writing.push((blocks.clone(), false));
        self.batches_begun += 1;
        Batch {
            dev: self.dev.clone(),
            blocks,
            device_order: self.device_order.clone(),
            retired: std::mem::take(&mut self.retired),
            seq: self.batches_begun,
        }
    }

    /// The batch is on the device (`ok`), or not: then its blocks not written again
    /// since wait for the next flush, and so do its slots. Returns whether everything
    /// buffered before the batch began is durable now: not while an older batch is not
    /// reported done, nor after one failed (a newer one's success says nothing of the
    /// blocks it put back) until a batch begun since succeeds.
    pub fn flush_done(&mut self, batch: Batch, ok: bool) -> Result<bool> {
        let at = self
            .writing
            .iter()
            .position(|(w, _)| Arc::ptr_eq(w, &batch.blocks));
        // Done ones leave from the front: this one is the oldest under way.
        let oldest = at == Some(0);
        if ok {
            if let Some(i) = at {
                self.writing[i].1 = true;
            }
        } else {
            let i = at.unwrap_or(self.writing.len());
            if at.is_some() {
                self.writing.remove(i);
            }
            // Only blocks nothing newer replaced: the buffer, or a batch begun after
            // this one (written after it, done or not), holds their newer data.
            for (b, d) in batch.blocks.iter() {
                if !self.through.contains(b)
                    && !self.writing[i..].iter().any(|(w, _)| w.contains_key(b))
                {
                    self.dirty.entry(*b).or_insert_with(|| d.clone());
                }
            }
            self.retired.extend(batch.retired);
            self.prune_written();
            self.whole_from = self.batches_begun + 1;
            return Ok(false);
        }
        self.prune_written();
        self.clear_retired(batch.retired)?;
        Ok(oldest && batch.seq >= self.whole_from)
    }

    /// Lets go of the write-backs that are done and have no older one under way.
    fn prune_written(&mut self) {
        let done = self.writing.iter().take_while(|(_, done)| *done).count();
        self.writing.drain(..done);
        if self.writing.is_empty() {
            self.through.clear();
        }
    }

    /// Home blocks waiting in the buffer.
    pub fn dirty(&self) -> usize {
        self.dirty.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::System;
    use quilt_block::MemDevice;

    fn setup(slots: u64) -> (Geometry, Arc<MemDevice>) {
        let g = Geometry::new(System::Gnothi, 1, 512, 30, 5).unwrap();
        let dev = Arc::new(MemDevice::new(512, DataStore::blocks_needed(&g, 2, slots)).unwrap());
        (g, dev)
    }

    fn block(x: u8) -> Vec<u8> {
        vec![x; 512]
    }

    #[test]
    fn home_blocks_round_trip_and_foreign_ones_are_refused() {
        let (g, dev) = setup(2);
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        // Replica 2 prefers slices 1 and 2 (blocks 5..15), and 4 and 5 (20..30).
        s.write_home(7, &block(7)).unwrap();
        s.write_home(29, &block(29)).unwrap();
        let mut b = block(0);
        s.read_home(7, &mut b).unwrap();
        assert_eq!(b, block(7));
        s.read_home(29, &mut b).unwrap();
        assert_eq!(b, block(29));
        assert!(matches!(
            s.write_home(0, &block(0)),
            Err(StoreError::NotHome {
                replica: 2,
                block: 0
            })
        ));
        assert!(matches!(
            s.write_home(7, &[0u8; 100]),
            Err(StoreError::NotABlock { .. })
        ));
    }

    /// A block written through (the buffer full) while a write-back holding an older
    /// copy of it is under way: reads see the newer data, and neither the batch
    /// failing nor a flush that writes it again puts the older data back.
    #[test]
    fn a_block_written_through_during_a_write_back_is_never_shown_older() {
        let g = Geometry::new(System::Gnothi, 1, 512, 3 * DIRTY_LIMIT as u64, 8).unwrap();
        let dev = Arc::new(MemDevice::new(512, DataStore::blocks_needed(&g, 2, 2)).unwrap());
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        let home: Vec<u64> = (0..g.blocks)
            .filter(|&b| g.prefers(2, g.slice_of(b)))
            .collect();
        let x = home[0];
        s.write_home(x, &block(1)).unwrap();
        let batch = s.flush_begin();
        // Fill the buffer with other blocks, so that x's next write goes through.
        for &b in &home[1..=DIRTY_LIMIT] {
            s.write_home(b, &block(5)).unwrap();
        }
        assert_eq!(s.dirty(), DIRTY_LIMIT);
        s.write_home(x, &block(2)).unwrap();
        let mut b = block(0);
        s.read_home(x, &mut b).unwrap();
        assert_eq!(b, block(2), "not the older copy the write-back holds");
        // The batch fails: its older copy of x does not come back to the buffer.
        assert!(!s.flush_done(batch, false).unwrap());
        s.read_home(x, &mut b).unwrap();
        assert_eq!(b, block(2));
        s.flush().unwrap();
        dev.read(s.home_block(x).unwrap(), &mut b).unwrap();
        assert_eq!(b, block(2), "on the device after the flush");
        // A batch under way when a flush writes it again: likewise.
        s.write_home(x, &block(3)).unwrap();
        let batch = s.flush_begin();
        for &b in &home[1..=DIRTY_LIMIT] {
            s.write_home(b, &block(6)).unwrap();
        }
        s.write_home(x, &block(4)).unwrap();
        s.flush().unwrap();
        dev.read(s.home_block(x).unwrap(), &mut b).unwrap();
        assert_eq!(
            b,
            block(4),
            "the flush wrote the unfinished batch again, not over x"
        );
        let _ = s.flush_done(batch, true);
    }

    #[test]
    fn two_write_backs_under_way_never_show_or_restore_older_data() {
        let (g, dev) = setup(2);
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        let mut b = block(0);
        // Block 7 written, taken by a write-back; written again, taken by a second.
        s.write_home(7, &block(1)).unwrap();
        let first = s.flush_begin();
        s.write_home(7, &block(2)).unwrap();
        s.write_home(8, &block(2)).unwrap();
        let second = s.flush_begin();
        first.write_out().unwrap();
        assert!(
            s.flush_done(first, true).unwrap(),
            "the oldest, done: all durable"
        );
        // The second is not on the device yet: reads still see its data.
        s.read_home(7, &mut b).unwrap();
        assert_eq!(b, block(2));
        assert!(s.home_pending(7));
        second.write_out().unwrap();
        assert!(s.flush_done(second, true).unwrap());
        assert!(!s.home_pending(7) && !s.home_pending(8));
        s.read_home(7, &mut b).unwrap();
        assert_eq!(b, block(2));

        // The older of two fails after the newer is done: its block is not put back
        // over the newer data.
        s.write_home(7, &block(3)).unwrap();
        s.write_home(9, &block(3)).unwrap();
        let older = s.flush_begin();
        s.write_home(7, &block(4)).unwrap();
        let newer = s.flush_begin();
        newer.write_out().unwrap();
        assert!(
            !s.flush_done(newer, true).unwrap(),
            "an older batch is not reported: not everything before it is durable"
        );
        assert!(s.home_pending(9), "the older batch is still under way");
        assert!(!s.flush_done(older, false).unwrap());
        assert!(s.home_pending(9), "block 9 waits for the next flush");
        s.write_home(10, &block(5)).unwrap();
        let after = s.flush_begin();
        after.write_out().unwrap();
        assert!(
            s.flush_done(after, true).unwrap(),
            "a batch begun after the failure carries what it put back"
        );
        let mut on_dev = block(0);
        dev.read(s.home_block(7).unwrap(), &mut on_dev).unwrap();
        assert_eq!(on_dev, block(4));
        dev.read(s.home_block(9).unwrap(), &mut on_dev).unwrap();
        assert_eq!(on_dev, block(3));

        // A flush while a write-back is begun and not written (it may yet fail)
        // writes its blocks too: a flush makes everything so far durable.
        s.write_home(11, &block(6)).unwrap();
        let unwritten = s.flush_begin();
        s.flush().unwrap();
        dev.read(s.home_block(11).unwrap(), &mut on_dev).unwrap();
        assert_eq!(on_dev, block(6));
        assert!(!s.flush_done(unwritten, false).unwrap());
    }

    #[test]
    fn a_home_run_reads_in_one_request_with_buffered_blocks_over_the_device() {
        let (g, _) = setup(2);
        // (A disk that counts a multi-block read once; the memory device counts blocks.)
        let dev = crate::sim::CrashDisk::new(512, DataStore::blocks_needed(&g, 2, 2));
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        // Blocks 5..15 are replica 2's (slices 1 and 2): one run on its device.
        for b in 5..15u64 {
            s.write_home(b, &block(b as u8)).unwrap();
        }
        s.flush().unwrap();
        s.write_home(7, &block(70)).unwrap();
        let taken = s.flush_begin();
        s.write_home(9, &block(90)).unwrap();
        let before = dev.stats();
        let mut out = vec![0u8; 10 * 512];
        s.read_home_run(5, &mut out).unwrap();
        assert_eq!(dev.stats().reads, before.reads + 1, "one request");
        for (i, d) in out.chunks(512).enumerate() {
            let b = 5 + i as u64;
            let want = match b {
                7 => 70,
                9 => 90,
                _ => b as u8,
            };
            assert_eq!(d, &block(want)[..], "block {b}");
        }
        assert!(s.read_home_run(0, &mut out).is_err(), "not this replica's");
        assert!(!s.flush_done(taken, false).unwrap());
    }

    #[test]
    fn reserve_copies_survive_a_reopen_and_free_slots_are_reused() {
        let (g, dev) = setup(2);
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        let r = |block, version| Reserved {
            block,
            version,
            checksum: 0xabc,
        };
        s.reserve_put(r(0, 3), &block(1)).unwrap();
        s.reserve_put(r(1, 4), &block(2)).unwrap();
        assert!(matches!(
            s.reserve_put(r(2, 5), &block(3)),
            Err(StoreError::ReserveFull { slots: 2 })
        ));
        s.flush().unwrap();
        drop(s);
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        let mut b = block(0);
        assert_eq!(s.reserve_read(0, &mut b).unwrap(), Some(r(0, 3)));
        assert_eq!(b, block(1));
        s.reserve_free(0).unwrap();
        s.reserve_put(r(2, 5), &block(3)).unwrap();
        s.flush().unwrap();
        drop(s);
        let s = DataStore::open(g, 2, dev, 2).unwrap();
        assert_eq!(s.reserved(0), None);
        assert_eq!(s.reserved(2), Some(r(2, 5)));
        assert_eq!(s.reserve_used(), 2);
    }

    #[test]
    fn a_reserve_copy_let_go_on_a_full_device_is_cleared_after_the_next_flush() {
        let (g, _) = setup(2);
        let dev = crate::sim::CrashDisk::new(512, DataStore::blocks_needed(&g, 2, 2));
        let mut s = DataStore::open(g, 2, dev.clone(), 2).unwrap();
        let r = |block, version| Reserved {
            block,
            version,
            checksum: 0xabc,
        };
        s.reserve_put(r(0, 3), &block(1)).unwrap();
        s.reserve_put(r(1, 4), &block(2)).unwrap();
        s.flush().unwrap();
        dev.set_full(true);
        // Neither letting go nor freeing touches the device (the cleared header waits
        // in the buffer), and neither loses the slot.
        let writes = dev.stats().writes;
        s.reserve_retire(0);
        s.reserve_free(1).unwrap();
        assert_eq!(dev.stats().writes, writes);
        assert_eq!((s.reserved(0), s.reserved(1)), (None, None));
        assert!(
            s.flush().is_err(),
            "the slots' headers cannot be cleared yet"
        );
        assert!(s.has_retired());
        dev.set_full(false);
        s.flush().unwrap();
        assert!(!s.has_retired());
        s.reserve_put_many(&[(r(2, 5), &block(3)[..]), (r(3, 6), &block(4)[..])])
            .unwrap();
        s.flush().unwrap();
        drop(s);
        let s = DataStore::open(g, 2, dev, 2).unwrap();
        assert_eq!((s.reserved(0), s.reserved(1)), (None, None));
        assert_eq!(
            (s.reserved(2), s.reserved(3)),
            (Some(r(2, 5)), Some(r(3, 6)))
        );
    }

    #[test]
    fn a_run_goes_into_the_reserve_all_or_none_without_a_flush() {
        let (g, dev) = setup(4);
        let mut s = DataStore::open(g, 2, dev.clone(), 4).unwrap();
        let r = |block| Reserved {
            block,
            version: 9,
            checksum: 0xabc,
        };
        let (b1, b2, b3) = (block(1), block(2), block(3));
        s.reserve_put(r(0), &block(7)).unwrap();
        let before = dev.stats();
        s.reserve_put_many(&[(r(0), &b1[..]), (r(1), &b2[..]), (r(2), &b3[..])])
            .unwrap();
        assert_eq!(
            (dev.stats().writes, dev.stats().flushes),
            (before.writes, before.flushes),
            "buffered, durable at the replica's next write-back: no request of its own"
        );
        // Read back from the buffer, before any write-back.
        let mut b = block(0);
        assert_eq!(s.reserve_read(1, &mut b).unwrap(), Some(r(1)));
        assert_eq!(b, b2);
        s.flush().unwrap();
        // The run's data lies in consecutive device blocks: slots 1..4, after the four
        // headers and slot 0's data.
        assert_eq!(dev.stats().bytes_written, before.bytes_written + 8 * 512);
        let data_at = g.home_blocks(2) + 4 + 1;
        let mut run = vec![0u8; 3 * 512];
        dev.read_blocks(data_at, &mut run).unwrap();
        assert_eq!(run, [b1.clone(), b2.clone(), b3.clone()].concat());
        // Too many for the free slots: nothing is taken.
        assert!(matches!(
            s.reserve_put_many(&[(r(3), &b1[..]), (r(4), &b2[..])]),
            Err(StoreError::ReserveFull { slots: 4 })
        ));
        assert_eq!(s.reserve_used(), 3);
        s.flush().unwrap();
        drop(s);
        // Block 0's older copy was replaced; its slot is free again after a reopen.
        let mut s = DataStore::open(g, 2, dev, 4).unwrap();
        let mut b = block(0);
        for (blk, want) in [(0, &b1), (1, &b2), (2, &b3)] {
            assert_eq!(s.reserve_read(blk, &mut b).unwrap(), Some(r(blk)));
            assert_eq!(&b, want);
        }
        assert_eq!(s.reserve_used(), 3);
        s.reserve_put(r(3), &block(4)).unwrap();
    }

    /// A copy replaced by a newer one, and a crash during the write-back (its blocks
    /// written, the device not flushed) that lets any part of the unflushed writes
    /// reach the disk: reopening finds the old copy whole,
    /// or the new one whole, or a header of the new one whose data fails its checksum
    /// (its record is still in the data log, which the replica replays: the placed
    /// mark has not moved). Never the old header over other data, nor a checksum
    /// that matches wrong data. After a flush, always the new copy.
    #[test]
    fn a_replaced_copy_is_whole_or_fails_its_checksum_after_any_crash() {
        use rand::SeedableRng;
        let g = Geometry::new(System::Gnothi, 1, 512, 30, 5).unwrap();
        let need = DataStore::blocks_needed(&g, 2, 4);
        let mut seen = [0usize; 3];
        for seed in 0..200u64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let disk = crate::sim::CrashDisk::new(512, need);
            let dev: Arc<dyn BlockDevice> = disk.clone();
            let mut s = DataStore::open(g, 2, dev, 4).unwrap();
            let r = |version: u64| Reserved {
                block: 0,
                version,
                checksum: crc(&block(version as u8)),
            };
            s.reserve_put(r(1), &block(1)).unwrap();
            s.flush().unwrap();
            s.reserve_put(r(2), &block(2)).unwrap();
            let flushed = seed % 4 == 0;
            if flushed {
                s.flush().unwrap();
            } else {
                let batch = s.flush_begin();
                write_runs(batch.dev.as_ref(), &batch.blocks).unwrap();
            }
            let after: Arc<dyn BlockDevice> = disk.crash(&mut rng);
            let again = DataStore::open(g, 2, after, 4).unwrap();
            let mut b = block(0);
            let got = again.reserve_read(0, &mut b).unwrap();
            match got {
                Some(c) if c.version == 1 && !flushed => {
                    assert_eq!(b, block(1), "seed {seed}");
                    seen[0] += 1;
                }
                Some(c) if c.version == 2 && crc(&b) == c.checksum => {
                    assert_eq!(b, block(2), "seed {seed}");
                    seen[1] += 1;
                }
                Some(c) if c.version == 2 && !flushed => seen[2] += 1,
                other => panic!("seed {seed}: the reserve copy is {other:?} after a crash"),
            }
        }
        assert!(seen.iter().all(|&n| n > 0), "every outcome met: {seen:?}");
    }

    #[test]
    fn a_reserve_larger_than_one_read_is_found_whole() {
        let g = Geometry::new(System::Gnothi, 1, 512, 600, 5).unwrap();
        let slots = 2 * SLOTS_PER_READ + 44;
        let dev = Arc::new(MemDevice::new(512, DataStore::blocks_needed(&g, 0, slots)).unwrap());
        let mut s = DataStore::open(g, 0, dev.clone(), slots).unwrap();
        for b in 0..slots {
            let r = Reserved {
                block: b,
                version: b + 1,
                checksum: 0,
            };
            s.reserve_put(r, &block(b as u8)).unwrap();
        }
        s.flush().unwrap();
        drop(s);
        let s = DataStore::open(g, 0, dev, slots).unwrap();
        assert_eq!(s.reserve_used(), slots);
        let mut buf = block(0);
        let last = slots - 1;
        assert_eq!(
            s.reserve_read(last, &mut buf).unwrap().map(|r| r.version),
            Some(slots)
        );
        assert_eq!(buf, block(last as u8));
    }

    #[test]
    fn a_device_too_small_or_of_another_block_size_is_refused() {
        let g = Geometry::new(System::Gnothi, 1, 512, 30, 5).unwrap();
        let small = Arc::new(MemDevice::new(512, 10).unwrap());
        assert!(matches!(
            DataStore::open(g, 0, small, 1),
            Err(StoreError::TooSmall { .. })
        ));
        let other = Arc::new(MemDevice::new(4096, 100).unwrap());
        assert!(matches!(
            DataStore::open(g, 0, other, 1),
            Err(StoreError::BlockSize { .. })
        ));
    }
}
