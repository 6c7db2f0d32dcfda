//! An in-memory device: tests, crash-state images and the benchmarks' bottom device.

use crate::{
    check_block_size, check_request, read_each, write_each, BlockDevice, BlockError, BlockNo,
    Capabilities, IoCounters, IoStats, Result, WriteClass,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// Blocks held in memory. Writes are "durable" at once; `flush` only counts.
///
/// For fault-injection tests it can be switched into a failing state in which every write
/// and flush returns an I/O error.
#[derive(Debug)]
pub struct MemDevice {
    block_size: usize,
    data: RwLock<Vec<u8>>,
    failing: AtomicBool,
    counters: IoCounters,
}

impl MemDevice {
    /// A zero-filled device of `block_count` blocks.
    pub fn new(block_size: usize, block_count: u64) -> Result<Self> {
        check_block_size(block_size)?;
        let len = usize::try_from(block_count)
            .ok()
            .and_then(|n| n.checked_mul(block_size))
            .ok_or(BlockError::Unsupported("a memory device this large"))?;
        Ok(Self::from_vec(block_size, vec![0; len]))
    }

    /// A device holding `bytes` (whose length must be a multiple of the block size).
    pub fn from_bytes(block_size: usize, bytes: &[u8]) -> Result<Self> {
        check_block_size(block_size)?;
        if bytes.len() % block_size != 0 {
            return Err(BlockError::BadBufferSize {
                got: bytes.len(),
                block_size,
            });
        }
        Ok(Self::from_vec(block_size, bytes.to_vec()))
    }

    fn from_vec(block_size: usize, data: Vec<u8>) -> Self {
        MemDevice {
            block_size,
            data: RwLock::new(data),
            failing: AtomicBool::new(false),
            counters: IoCounters::default(),
        }
    }

    /// A copy of the whole device.
    pub fn to_vec(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes every following write and flush fail with an I/O error (or stop failing).
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    fn injected_error(&self, what: String) -> Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(BlockError::Io {
                what,
                source: std::io::Error::other("injected fault"),
            });
        }
        Ok(())
    }
}

impl BlockDevice for MemDevice {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn block_count(&self) -> u64 {
        let len = self.data.read().unwrap_or_else(|e| e.into_inner()).len();
        (len / self.block_size) as u64
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        check_request(self, block, buf.len())?;
        let start = block as usize * self.block_size;
        let data = self.data.read().unwrap_or_else(|e| e.into_inner());
        buf.copy_from_slice(&data[start..start + self.block_size]);
        self.counters.read(buf.len());
        Ok(())
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        read_each(self, first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], _class: WriteClass) -> Result<()> {
        check_request(self, block, buf.len())?;
        self.injected_error(format!("memory block {block}"))?;
        let start = block as usize * self.block_size;
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        data[start..start + self.block_size].copy_from_slice(buf);
        self.counters.write(buf.len());
        Ok(())
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        write_each(self, first, buf, class)
    }
    fn flush(&self) -> Result<()> {
        self.injected_error("memory device flush".into())?;
        self.counters.flush();
        Ok(())
    }
    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockDeviceExt;

    #[test]
    fn write_then_read_returns_the_same_bytes() {
        let dev = MemDevice::new(512, 8).unwrap();
        let block = vec![0xab; 512];
        dev.write(3, &block, WriteClass::Metadata).unwrap();
        let mut back = vec![0; 512];
        dev.read(3, &mut back).unwrap();
        assert_eq!(back, block);
        dev.read(2, &mut back).unwrap();
        assert!(
            back.iter().all(|&b| b == 0),
            "untouched block must stay zero"
        );
        let s = dev.stats();
        assert_eq!((s.reads, s.writes, s.bytes_written), (2, 1, 512));
    }

    #[test]
    fn out_of_range_and_bad_sizes_are_typed_errors() {
        let dev = MemDevice::new(512, 8).unwrap();
        let mut buf = vec![0; 512];
        assert!(matches!(
            dev.read(8, &mut buf),
            Err(BlockError::OutOfRange { block: 8, count: 8 })
        ));
        assert!(matches!(
            dev.write(u64::MAX, &buf, WriteClass::Metadata),
            Err(BlockError::OutOfRange { .. })
        ));
        assert!(matches!(
            dev.write(0, &buf[..100], WriteClass::Metadata),
            Err(BlockError::BadBufferSize { got: 100, .. })
        ));
        assert!(matches!(
            MemDevice::new(1000, 8),
            Err(BlockError::BadBlockSize(1000))
        ));
        assert!(matches!(
            MemDevice::from_bytes(512, &[0; 700]),
            Err(BlockError::BadBufferSize { .. })
        ));
        // Without a placement model a range write takes the first candidate.
        assert_eq!(
            dev.write_range(&[1, 2], &buf, WriteClass::Metadata)
                .unwrap(),
            1
        );
        assert!(matches!(
            dev.write_range(&[], &buf, WriteClass::Metadata),
            Err(BlockError::Unsupported(_))
        ));
    }

    #[test]
    fn injected_faults_fail_writes_and_flushes_without_changing_data() {
        let dev = MemDevice::new(512, 2).unwrap();
        dev.set_failing(true);
        assert!(matches!(
            dev.write(0, &[1; 512], WriteClass::Metadata),
            Err(BlockError::Io { .. })
        ));
        assert!(matches!(dev.flush(), Err(BlockError::Io { .. })));
        dev.set_failing(false);
        assert!(dev.to_vec().iter().all(|&b| b == 0));
        dev.flush().unwrap();
        assert_eq!(dev.stats().flushes, 1);
    }
}
