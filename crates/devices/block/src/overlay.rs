//! A copy-on-write view of a device: reads see the device below unless the block was
//! written through the view, writes stay in memory. For tools that must open an image
//! read-only whose recovery writes (a check with `-n` replays a log in memory).

use crate::{
    check_request, read_each, write_each, BlockDevice, BlockNo, Capabilities, IoCounters, IoStats,
    Result, WriteClass,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub struct OverlayDevice {
    inner: Arc<dyn BlockDevice>,
    written: Mutex<HashMap<BlockNo, Box<[u8]>>>,
    counters: IoCounters,
}

impl OverlayDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> OverlayDevice {
        OverlayDevice {
            inner,
            written: Mutex::new(HashMap::new()),
            counters: IoCounters::default(),
        }
    }

    /// Blocks written through the view.
    pub fn written_blocks(&self) -> usize {
        self.written.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl BlockDevice for OverlayDevice {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        check_request(self, block, buf.len())?;
        let bs = self.block_size();
        let w = self.written.lock().unwrap_or_else(|e| e.into_inner());
        for (i, chunk) in buf.chunks_mut(bs).enumerate() {
            match w.get(&(block + i as u64)) {
                Some(b) => chunk.copy_from_slice(b),
                None => self.inner.read(block + i as u64, chunk)?,
            }
        }
        self.counters.read(buf.len());
        Ok(())
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        read_each(self, first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], _class: WriteClass) -> Result<()> {
        check_request(self, block, buf.len())?;
        let bs = self.block_size();
        let mut w = self.written.lock().unwrap_or_else(|e| e.into_inner());
        for (i, chunk) in buf.chunks(bs).enumerate() {
            w.insert(block + i as u64, chunk.into());
        }
        self.counters.write(buf.len());
        Ok(())
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        write_each(self, first, buf, class)
    }
    fn flush(&self) -> Result<()> {
        self.counters.flush();
        Ok(())
    }
    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        let below = self.inner.capabilities();
        Capabilities {
            // Reads of blocks not written through the view go below; hints help them.
            hints: below.hints,
            history: below.history,
            counters: below.counters,
            // Writes stay in memory: nothing below to reserve, gather or place, and the
            // plain versions (whole blocks, the first candidate) are what the view does.
            gather: None,
            part_reads: None,
            ranges: None,
            reservation: None,
        }
    }
}
