//! Byte-addressed I/O on a block device, for front ends whose clients address bytes (an
//! NBD export, a device seen as one file): whole blocks go down as one request, a
//! partial block is read, patched and written back. Patches are serialised through
//! one lock, so two writers of different bytes of one block never undo each other.

use crate::{BlockDevice, BlockDeviceExt, BlockError, Result, WriteClass};
use std::sync::{Arc, Mutex};

pub struct ByteView {
    dev: Arc<dyn BlockDevice>,
    patch: Mutex<()>,
}

impl ByteView {
    pub fn new(dev: Arc<dyn BlockDevice>) -> ByteView {
        ByteView {
            dev,
            patch: Mutex::new(()),
        }
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }

    /// The device's size in bytes.
    pub fn size(&self) -> u64 {
        self.dev.block_count() * self.dev.block_size() as u64
    }

    /// `OutOfRange` (naming the first block past the end) unless `[offset, offset+len)`
    /// lies inside the device.
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(BlockError::OutOfRange {
                block: offset.saturating_add(len) / self.dev.block_size() as u64,
                count: self.dev.block_count(),
            }),
        }
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        let bs = self.dev.block_size() as u64;
        self.dev.read_part(offset / bs, (offset % bs) as usize, buf)
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let bs = self.dev.block_size();
        let mut off = offset;
        let mut rest = data;
        let mut block = Vec::new();
        while !rest.is_empty() {
            let first = off / bs as u64;
            let skip = (off % bs as u64) as usize;
            let n = if skip != 0 || rest.len() < bs {
                let n = (bs - skip).min(rest.len());
                block.resize(bs, 0);
                let _one_at_a_time = self.patch.lock().unwrap_or_else(|p| p.into_inner());
                self.dev.read(first, &mut block)?;
                block[skip..skip + n].copy_from_slice(&rest[..n]);
                self.dev.write(first, &block, WriteClass::default())?;
                n
            } else {
                let n = rest.len() / bs * bs;
                self.dev
                    .write_blocks(first, &rest[..n], WriteClass::default())?;
                n
            };
            off += n as u64;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Zeroes `len` bytes from `offset`, a megabyte at a time.
    pub fn write_zeroes_at(&self, offset: u64, len: u64) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        self.check(offset, len)?;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            self.write_at(offset + done, &zeroes[..n as usize])?;
            done += n;
        }
        Ok(())
    }

    pub fn flush(&self) -> Result<()> {
        self.dev.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    #[test]
    fn unaligned_writes_and_reads_match_a_byte_model() {
        let v = ByteView::new(Arc::new(MemDevice::new(512, 8).unwrap()));
        let mut model = vec![0u8; 4096];
        let mut x = 1u32;
        for _ in 0..500 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let off = (x >> 8) as usize % 4096;
            let len = (x >> 3) as usize % (4096 - off).min(1500);
            let data: Vec<u8> = (0..len).map(|i| (i as u32 ^ x) as u8).collect();
            if x % 3 == 0 {
                v.write_zeroes_at(off as u64, len as u64).unwrap();
                model[off..off + len].fill(0);
            } else {
                v.write_at(off as u64, &data).unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
            let mut back = vec![0u8; len];
            v.read_at(off as u64, &mut back).unwrap();
            assert_eq!(back, model[off..off + len]);
        }
        let mut all = vec![0u8; 4096];
        v.read_at(0, &mut all).unwrap();
        assert_eq!(all, model);
    }

    #[test]
    fn ranges_past_the_end_are_refused_and_change_nothing() {
        let v = ByteView::new(Arc::new(MemDevice::new(512, 8).unwrap()));
        assert!(matches!(
            v.write_at(4000, &[1; 200]),
            Err(BlockError::OutOfRange { .. })
        ));
        assert!(matches!(
            v.write_zeroes_at(u64::MAX, 2),
            Err(BlockError::OutOfRange { .. })
        ));
        let mut b = [9u8; 2];
        assert!(matches!(
            v.read_at(4095, &mut b),
            Err(BlockError::OutOfRange { .. })
        ));
        let mut all = vec![1u8; 4096];
        v.read_at(0, &mut all).unwrap();
        assert!(all.iter().all(|&x| x == 0));
    }
}
