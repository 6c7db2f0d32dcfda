//! A device that records its history so that crash states can be generated later.
//!
//! Modelled on dm-log-writes: every completed write (with its data), every completed flush
//! and every mark inserted by the layers above is appended to a log, in the order the
//! inner device served them. A crash state is then any prefix of the log in which the
//! writes before the prefix's last flush are all applied and the writes after it (the ones
//! a volatile disk cache could still have held) are applied as any subset, in order.

use crate::{
    check_request, check_run, BlockDevice, BlockDeviceExt, BlockError, BlockNo, Capabilities,
    GatherWrites, History, IoStats, RangeWrites, Result, WriteClass,
};
use std::sync::{Arc, Mutex};

/// One event at the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEntry {
    Write {
        block: BlockNo,
        data: Arc<[u8]>,
        class: WriteClass,
    },
    Flush,
    Mark(String),
}

/// The recorded history, with the operations that cut crash states from it.
#[derive(Debug, Clone, Default)]
pub struct RecordingLog {
    pub entries: Vec<LogEntry>,
}

impl RecordingLog {
    /// Prefix lengths worth crashing at: right after every flush and every mark, and the
    /// whole log. Sorted, without duplicates.
    pub fn crash_points(&self) -> Vec<usize> {
        let mut points: Vec<usize> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, LogEntry::Flush | LogEntry::Mark(_)))
            .map(|(i, _)| i + 1)
            .collect();
        points.push(self.entries.len());
        points.dedup();
        points
    }

    /// Index of the first entry after the last flush in `entries[..len]`.
    pub fn durable_prefix(&self, len: usize) -> usize {
        let len = len.min(self.entries.len());
        self.entries[..len]
            .iter()
            .rposition(|e| matches!(e, LogEntry::Flush))
            .map_or(0, |i| i + 1)
    }

    /// Indices of the writes in `entries[..len]` that a crash at `len` may or may not have
    /// persisted (those after the last flush).
    pub fn in_flight(&self, len: usize) -> Vec<usize> {
        let len = len.min(self.entries.len());
        (self.durable_prefix(len)..len)
            .filter(|&i| matches!(self.entries[i], LogEntry::Write { .. }))
            .collect()
    }

    /// Position of the first mark named `name`, as a prefix length (the mark included).
    pub fn mark_position(&self, name: &str) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| matches!(e, LogEntry::Mark(m) if m == name))
            .map(|i| i + 1)
    }

    /// Applies every write in `entries[..len]` to `target`, in order.
    pub fn replay_prefix(&self, len: usize, target: &dyn BlockDevice) -> Result<()> {
        self.replay_subset(len, target, |_| true)
    }

    /// Applies the crash state at `len` in which, of the writes after the last flush, only
    /// those for which `keep(index)` is true reached the disk.
    pub fn replay_subset(
        &self,
        len: usize,
        target: &dyn BlockDevice,
        keep: impl Fn(usize) -> bool,
    ) -> Result<()> {
        let len = len.min(self.entries.len());
        let durable = self.durable_prefix(len);
        for (i, e) in self.entries[..len].iter().enumerate() {
            if let LogEntry::Write { block, data, class } = e {
                if i < durable || keep(i) {
                    target.write(*block, data, *class)?;
                }
            }
        }
        Ok(())
    }

    pub fn writes(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e, LogEntry::Write { .. }))
            .count()
    }
}

/// Wraps a device and records everything that reaches it.
pub struct RecordingDevice {
    inner: Arc<dyn BlockDevice>,
    log: Mutex<(RecordingLog, u64)>,
    limit_bytes: u64,
}

impl RecordingDevice {
    /// Records at most `limit_bytes` of write data; past that, writes fail with
    /// [`BlockError::LogFull`] rather than silently losing history.
    pub fn new(inner: Arc<dyn BlockDevice>, limit_bytes: u64) -> Self {
        RecordingDevice {
            inner,
            log: Mutex::new((RecordingLog::default(), 0)),
            limit_bytes,
        }
    }

    /// A copy of the log so far (block data is shared, not copied).
    pub fn log(&self) -> RecordingLog {
        self.lock().0.clone()
    }

    /// Takes the log, leaving an empty one.
    pub fn take_log(&self) -> RecordingLog {
        let mut g = self.lock();
        g.1 = 0;
        std::mem::take(&mut g.0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (RecordingLog, u64)> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RecordingDevice {
    /// Logs the blocks of a run written at `first` by `write`, which writes them below,
    /// under the log's lock so that the log order is the order in which the device below
    /// saw the writes. One entry per block: each block is atomic, the run is not.
    fn logged<T>(
        &self,
        first: BlockNo,
        blocks: &[&[u8]],
        class: WriteClass,
        write: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let len: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        let mut g = self.lock();
        if g.1 + len > self.limit_bytes {
            return Err(BlockError::LogFull {
                limit_bytes: self.limit_bytes,
            });
        }
        let r = write()?;
        g.1 += len;
        let bs = self.inner.block_size();
        let mut block = first;
        for part in blocks {
            for b in part.chunks(bs) {
                g.0.entries.push(LogEntry::Write {
                    block,
                    data: Arc::from(b),
                    class,
                });
                block += 1;
            }
        }
        Ok(r)
    }
}

impl BlockDevice for RecordingDevice {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.inner.read(block, buf)
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.inner.read_blocks(first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        check_request(self, block, buf.len())?;
        self.logged(block, &[buf], class, || self.inner.write(block, buf, class))
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        check_run(self, first, buf.len())?;
        self.logged(first, &[buf], class, || {
            self.inner.write_blocks(first, buf, class)
        })
    }
    fn flush(&self) -> Result<()> {
        let mut g = self.lock();
        self.inner.flush()?;
        g.0.entries.push(LogEntry::Flush);
        Ok(())
    }
    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        let below = self.inner.capabilities();
        Capabilities {
            // Writes are logged here, then passed on in the same shape.
            gather: Some(self),
            ranges: Some(self),
            history: Some(self),
            // Reads, hints, reservations and counters are not part of the history.
            part_reads: below.part_reads,
            hints: below.hints,
            reservation: below.reservation,
            counters: below.counters,
        }
    }
}

impl GatherWrites for RecordingDevice {
    fn write_blocks_gather(
        &self,
        first: BlockNo,
        parts: &[&[u8]],
        class: WriteClass,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        check_run(self, first, len)?;
        self.logged(first, parts, class, || {
            self.inner.write_blocks_gather(first, parts, class)
        })
    }
}

impl RangeWrites for RecordingDevice {
    /// The device below chooses; the log records the run where it went.
    fn write_range(
        &self,
        candidates: &[BlockNo],
        buf: &[u8],
        class: WriteClass,
    ) -> Result<BlockNo> {
        for &c in candidates {
            check_run(self, c, buf.len())?;
        }
        let len = buf.len() as u64;
        let mut g = self.lock();
        if g.1 + len > self.limit_bytes {
            return Err(BlockError::LogFull {
                limit_bytes: self.limit_bytes,
            });
        }
        let at = self.inner.write_range(candidates, buf, class)?;
        g.1 += len;
        for (i, b) in buf.chunks(self.inner.block_size()).enumerate() {
            g.0.entries.push(LogEntry::Write {
                block: at + i as u64,
                data: Arc::from(b),
                class,
            });
        }
        Ok(at)
    }
}

impl History for RecordingDevice {
    fn mark(&self, name: &str) {
        self.lock().0.entries.push(LogEntry::Mark(name.to_string()));
        self.inner.mark(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn block(byte: u8) -> Vec<u8> {
        vec![byte; 512]
    }

    fn first_byte(dev: &MemDevice, b: BlockNo) -> u8 {
        let mut buf = vec![0; 512];
        dev.read(b, &mut buf).unwrap();
        buf[0]
    }

    /// A history: w(0,1) w(1,2) flush mark(a) w(0,3) w(2,4) flush w(1,5)
    fn history() -> (RecordingDevice, Arc<MemDevice>) {
        let mem = Arc::new(MemDevice::new(512, 4).unwrap());
        let rec = RecordingDevice::new(mem.clone(), 1 << 20);
        rec.write(0, &block(1), WriteClass::Metadata).unwrap();
        rec.write(1, &block(2), WriteClass::Metadata).unwrap();
        rec.flush().unwrap();
        History::mark(&rec, "a");
        rec.write(0, &block(3), WriteClass::Metadata).unwrap();
        rec.write(2, &block(4), WriteClass::Metadata).unwrap();
        rec.flush().unwrap();
        rec.write(1, &block(5), WriteClass::Metadata).unwrap();
        (rec, mem)
    }

    #[test]
    fn log_records_writes_flushes_and_marks_in_order() {
        let (rec, mem) = history();
        let log = rec.log();
        assert_eq!(log.entries.len(), 8);
        assert_eq!(log.entries[3], LogEntry::Mark("a".into()));
        assert_eq!(log.writes(), 5);
        assert_eq!(log.crash_points(), vec![3, 4, 7, 8]);
        assert_eq!(log.mark_position("a"), Some(4));
        // The recording device is transparent: the inner device holds the newest data.
        assert_eq!(
            (
                first_byte(&mem, 0),
                first_byte(&mem, 1),
                first_byte(&mem, 2)
            ),
            (3, 5, 4)
        );
    }

    #[test]
    fn replaying_each_prefix_gives_the_state_at_that_point() {
        let (rec, _) = history();
        let log = rec.log();
        let expect = [
            (3, [1, 2, 0]),
            (4, [1, 2, 0]),
            (7, [3, 2, 4]),
            (8, [3, 5, 4]),
            (5, [3, 2, 0]),
        ];
        for (len, want) in expect {
            let img = MemDevice::new(512, 4).unwrap();
            log.replay_prefix(len, &img).unwrap();
            let got = [
                first_byte(&img, 0),
                first_byte(&img, 1),
                first_byte(&img, 2),
            ];
            assert_eq!(got, want, "prefix {len}");
        }
    }

    #[test]
    fn subsets_only_drop_writes_after_the_last_flush() {
        let (rec, _) = history();
        let log = rec.log();
        assert_eq!(log.durable_prefix(6), 3);
        assert_eq!(log.in_flight(6), vec![4, 5]);
        // Crash after w(2,4) but before the second flush; keep only the write to block 2.
        let img = MemDevice::new(512, 4).unwrap();
        log.replay_subset(6, &img, |i| i == 5).unwrap();
        assert_eq!(
            [
                first_byte(&img, 0),
                first_byte(&img, 1),
                first_byte(&img, 2)
            ],
            [1, 2, 4]
        );
        // Keep nothing in flight: only the durable state.
        let img = MemDevice::new(512, 4).unwrap();
        log.replay_subset(6, &img, |_| false).unwrap();
        assert_eq!(
            [
                first_byte(&img, 0),
                first_byte(&img, 1),
                first_byte(&img, 2)
            ],
            [1, 2, 0]
        );
    }

    #[test]
    fn log_limit_refuses_writes_and_failed_writes_are_not_logged() {
        let mem = Arc::new(MemDevice::new(512, 4).unwrap());
        let rec = RecordingDevice::new(mem.clone(), 1024);
        rec.write(0, &block(1), WriteClass::Metadata).unwrap();
        rec.write(1, &block(1), WriteClass::Metadata).unwrap();
        assert!(matches!(
            rec.write(2, &block(1), WriteClass::Metadata),
            Err(BlockError::LogFull { limit_bytes: 1024 })
        ));
        assert!(rec.write(9, &block(1), WriteClass::Metadata).is_err());
        mem.set_failing(true);
        assert!(rec.flush().is_err());
        assert_eq!(rec.log().entries.len(), 2);
        assert_eq!(rec.take_log().writes(), 2);
        assert!(rec.log().entries.is_empty());
    }
}
