//! I/O counters kept by every device.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Live counters, updated with relaxed atomics (they are statistics, not synchronisation).
#[derive(Debug, Default)]
pub struct IoCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// A snapshot of [`IoCounters`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IoStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl IoCounters {
    pub fn read(&self, bytes: usize) {
        self.reads.fetch_add(1, Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Relaxed);
    }
    pub fn write(&self, bytes: usize) {
        self.writes.fetch_add(1, Relaxed);
        self.bytes_written.fetch_add(bytes as u64, Relaxed);
    }
    pub fn flush(&self) {
        self.flushes.fetch_add(1, Relaxed);
    }
    pub fn snapshot(&self) -> IoStats {
        IoStats {
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
        }
    }
}

impl IoStats {
    /// Every counter with its name, for text and JSON output.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("reads", self.reads),
            ("writes", self.writes),
            ("flushes", self.flushes),
            ("bytes_read", self.bytes_read),
            ("bytes_written", self.bytes_written),
        ]
    }
}
