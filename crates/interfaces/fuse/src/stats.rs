//! Per-request counters of the FUSE adapter: how many requests of each kind the kernel
//! sent and how long the server spent on them. They show where a workload's time goes
//! (for example, that an untar costs about eight requests per file) and feed
//! `quiltfs stats`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

macro_rules! ops {
    ($($v:ident => $n:literal),* $(,)?) => {
        /// The request kinds we count.
        #[derive(Debug, Clone, Copy)]
        pub enum Op { $($v),* }
        const NAMES: &[&str] = &[$($n),*];
    };
}

ops! {
    Lookup => "lookup", Getattr => "getattr", Setattr => "setattr", Readlink => "readlink",
    Mknod => "mknod", Mkdir => "mkdir", Unlink => "unlink", Rmdir => "rmdir",
    Symlink => "symlink", Rename => "rename", Link => "link", Open => "open",
    Read => "read", Write => "write", Flush => "flush", Release => "release",
    Fsync => "fsync", Readdir => "readdir", Readdirplus => "readdirplus", Fsyncdir => "fsyncdir", Statfs => "statfs",
    Setxattr => "setxattr", Getxattr => "getxattr", Listxattr => "listxattr",
    Removexattr => "removexattr", Access => "access", Create => "create", Ioctl => "ioctl",
    Syncfs => "syncfs", Lseek => "lseek", Fallocate => "fallocate",
    CopyFileRange => "copy_file_range",
}

/// Counts and server time per request kind; shared with whoever reports them.
#[derive(Debug)]
pub struct RequestStats {
    count: Vec<AtomicU64>,
    nanos: Vec<AtomicU64>,
    /// 1 once the session serves over io_uring, 0 on /dev/fuse.
    ring: AtomicU64,
    /// How ring workers waited, once the session has started.
    ring_waits: std::sync::OnceLock<std::sync::Arc<quilt_fusewire::RingStats>>,
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            count: NAMES.iter().map(|_| AtomicU64::new(0)).collect(),
            nanos: NAMES.iter().map(|_| AtomicU64::new(0)).collect(),
            ring: AtomicU64::new(0),
            ring_waits: Default::default(),
        }
    }
}

impl RequestStats {
    /// Starts timing one request; the time is recorded when the guard drops.
    pub(crate) fn time(&self, op: Op) -> Timer<'_> {
        Timer {
            stats: self,
            op,
            start: Instant::now(),
        }
    }

    pub(crate) fn set_ring(&self, on: bool) {
        self.ring.store(on as u64, Relaxed);
    }

    pub(crate) fn set_ring_stats(&self, s: std::sync::Arc<quilt_fusewire::RingStats>) {
        let _ = self.ring_waits.set(s);
    }

    /// Whether the session serves over io_uring.
    pub fn ring(&self) -> bool {
        self.ring.load(Relaxed) == 1
    }

    /// `fuse.io_uring` (1 when served over io_uring), then `fuse.<op>.count` and
    /// `fuse.<op>.us` for every kind seen at least once.
    pub fn fields(&self) -> Vec<(String, u64)> {
        let mut v = vec![("fuse.io_uring".to_string(), self.ring.load(Relaxed))];
        if let (Some(w), true) = (self.ring_waits.get(), self.ring()) {
            v.push(("fuse.ring.waits".to_string(), w.waits()));
            v.push(("fuse.ring.handoffs".to_string(), w.handed_off()));
            v.push(("fuse.ring.migrated".to_string(), w.migrated()));
        }
        for (i, name) in NAMES.iter().enumerate() {
            let c = self.count[i].load(Relaxed);
            if c > 0 {
                v.push((format!("fuse.{name}.count"), c));
                v.push((
                    format!("fuse.{name}.us"),
                    self.nanos[i].load(Relaxed) / 1000,
                ));
            }
        }
        v
    }
}

pub(crate) struct Timer<'a> {
    stats: &'a RequestStats,
    op: Op,
    start: Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        let i = self.op as usize;
        self.stats.count[i].fetch_add(1, Relaxed);
        let ns = self.start.elapsed().as_nanos() as u64;
        self.stats.nanos[i].fetch_add(ns, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_times_each_kind_separately() {
        let s = RequestStats::default();
        for _ in 0..3 {
            let _t = s.time(Op::Create);
        }
        {
            let _t = s.time(Op::Lookup);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let f: std::collections::HashMap<_, _> = s.fields().into_iter().collect();
        assert_eq!(f["fuse.create.count"], 3);
        assert_eq!(f["fuse.lookup.count"], 1);
        assert!(f["fuse.lookup.us"] >= 2000, "{f:?}");
        assert!(!f.contains_key("fuse.write.count"));
    }
}
