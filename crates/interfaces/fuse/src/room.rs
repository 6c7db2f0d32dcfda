//! Room for the kernel's writeback cache: the kernel never holds more written data for
//! the mount than the file system can still store.
//!
//! Under the writeback cache, write(2) returns once the data is in the page cache and
//! the kernel sends it later. If the file system has no room by then, the error reaches
//! only fsync(2) and close(2), and a program that writes on (`dd`) is never told: it
//! would "write" without end. So the mount bounds what the kernel may hold dirty (the
//! mount's own limit under `/sys/class/bdi`, strictly enforced by the kernel), and keeps
//! at least that much free:
//!
//! - **Ample** (free ≥ `2·limit + SLACK`): files opened for writing go through the cache.
//! - **Low**: files opened for writing from then on write through (direct I/O, so errors
//!   fail write(2) itself). The kernel's bound drops to [`LOW_LIMIT`] and the mount is
//!   synced once, so that what the kernel held under the old bound reaches the file
//!   system. The last [`GATE`] bytes are kept for the kernel's write-back: statfs does
//!   not count them, and a direct write that would take them fails with ENOSPC (until
//!   that sync is done, one that would leave less free than the old bound waits for
//!   it first). Files still open through the cache have their attributes dropped from
//!   the kernel's cache, so that each write(2) to them asks for them first (GETATTR
//!   with the handle): that is refused with ENOSPC while less than [`GATE`] is free,
//!   and write(2) fails with it. So every writer, cached or direct, finds the file
//!   system full at the same point, and df says so.
//! - Back to ample once free ≥ `3·limit + SLACK`: the kernel's bound is restored.
//!
//! What remains open, and is reported at fsync(2) and close(2) rather than lost in
//! silence: one write(2) larger than the gate's margin, begun when the gate still let it
//! through; stores through a shared writable mapping (no request precedes them); and a
//! write past the file system's maximum file size (the kernel checks only its own, and
//! a write-back the file system takes only part of is answered with the reason, never
//! as all written). And a side effect of the gate: near full, other calls that ask for
//! attributes with such a handle (`lseek(SEEK_END)`) fail with ENOSPC too.
//!
//! Free space is what the file system's statfs says, which under a sparse image counts
//! only what the host can still store (`HostRoom`): the kernel's cache cannot outrun a
//! host disk that fills first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The kernel's dirty bound while space is low: it then throttles each writer to
/// nearly the pace at which its data reaches us (measured here: about 11 MB/s).
pub const LOW_LIMIT: u64 = 1 << 20;

/// Beyond the bound: the kernel enforces it per writer after a few pages, not exactly
/// (measured: up to 0.8 MiB dirty under a 1 MiB bound, 3 MiB under 4 MiB).
pub const SLACK: u64 = 4 << 20;

/// Writes through the cache are refused while less than this is free: the kernel's
/// low bound and slack, and one write(2) of up to 1 MiB on top.
pub const GATE: u64 = LOW_LIMIT + SLACK + (1 << 20);

/// How long a direct write that needs the kernel's old dirty data flushed waits for it.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// Marks a handle opened for writing through the cache (the rest of the handle is the
/// opener's process id).
pub const CACHED: u64 = 1 << 62;

/// The mount's writeback settings under `/sys/class/bdi/NAME/`.
#[derive(Debug, Clone)]
pub struct Bdi {
    dir: PathBuf,
}

impl Bdi {
    /// The backing device of the mount at `mountpoint`, found in /proc/self/mountinfo
    /// (asking the mount itself would send a request nobody serves yet). A fuseblk
    /// mount has a device of its own named after its block device's numbers.
    pub fn of_mount(mountpoint: &Path, fuseblk: bool) -> std::io::Result<Bdi> {
        let want = std::fs::canonicalize(mountpoint)?;
        let info = std::fs::read_to_string("/proc/self/mountinfo")?;
        // The last mount listed at a path is the one on top.
        let dev = info
            .lines()
            .rev()
            .find_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 4 && unescape(f[4]) == want.as_os_str().as_encoded_bytes())
                    .then(|| f[2].to_string())
            })
            .ok_or_else(|| std::io::Error::other("the mount is not in /proc/self/mountinfo"))?;
        let name = if fuseblk {
            format!("{dev}-fuseblk")
        } else {
            dev
        };
        let dir = Path::new("/sys/class/bdi").join(name);
        if !dir.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} does not exist",
                dir.display()
            )));
        }
        Ok(Bdi { dir })
    }

    fn set(&self, file: &str, value: u64) -> std::io::Result<()> {
        let p = self.dir.join(file);
        std::fs::write(&p, value.to_string())
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
    }

    /// Strict limiting (the kernel holds the mount to its own bound, whatever the
    /// system's dirty total) and the bound itself.
    pub fn bound(&self, bytes: u64) -> std::io::Result<()> {
        self.set("strict_limit", 1)?;
        self.set("max_bytes", bytes)
    }

    /// Read-ahead, in bytes.
    pub fn read_ahead(&self, bytes: u64) -> std::io::Result<()> {
        self.set("read_ahead_kb", bytes / 1024)
    }
}

/// Mount points in mountinfo escape space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

struct State {
    low: bool,
    /// Whether the kernel was made to write back what it held under the ample bound
    /// since space became low.
    drained: bool,
    /// Inodes with handles open for writing through the cache, and how many.
    cached_writers: HashMap<u64, u32>,
}

/// The writeback cache's reservation for one mount.
pub struct Room {
    bdi: Bdi,
    /// The kernel's dirty bound while space is ample.
    limit: u64,
    mountpoint: PathBuf,
    state: Mutex<State>,
    drained: Condvar,
    /// Bytes written since free space was last looked at.
    since_check: AtomicU64,
    /// Mirrors `State::low` for the paths that only read it.
    low: AtomicBool,
}

/// What the adapter must do after [`Room::check`] found the regime changed.
pub enum Change {
    /// Space became low: drop the kernel's cached attributes of these inodes, so their
    /// writers ask before each write(2).
    BecameLow(Vec<u64>),
    BecameAmple,
}

impl Room {
    /// `limit`: the kernel's dirty bound while space is ample. The room starts low (the
    /// low bound is set now); the first [`Room::check`] finds out.
    pub fn new(bdi: Bdi, limit: u64, mountpoint: &Path) -> std::io::Result<Arc<Room>> {
        let limit = limit.max(LOW_LIMIT);
        bdi.bound(LOW_LIMIT)?;
        Ok(Arc::new(Room {
            bdi,
            limit,
            mountpoint: mountpoint.to_path_buf(),
            state: Mutex::new(State {
                low: true,
                drained: true,
                cached_writers: HashMap::new(),
            }),
            drained: Condvar::new(),
            since_check: AtomicU64::new(0),
            low: AtomicBool::new(true),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Space is ample again at or above this.
    fn ample_at(&self) -> u64 {
        3 * self.limit + SLACK
    }

    /// Space becomes low below this.
    fn low_below(&self) -> u64 {
        2 * self.limit + SLACK
    }

    pub fn is_low(&self) -> bool {
        self.low.load(Relaxed)
    }

    /// Looks at free space (`free`: what a write may still take, in bytes) and changes
    /// the regime if it crossed a threshold. The caller acts on the change.
    pub fn check(self: &Arc<Self>, free: u64) -> Option<Change> {
        self.since_check.store(0, Relaxed);
        let mut st = self.lock();
        if !st.low && free < self.low_below() {
            st.low = true;
            st.drained = false;
            self.low.store(true, Relaxed);
            if let Err(e) = self.bdi.bound(LOW_LIMIT) {
                tracing::warn!("lowering the kernel's dirty bound: {e}");
            }
            let inos = st.cached_writers.keys().copied().collect();
            drop(st);
            self.drain();
            return Some(Change::BecameLow(inos));
        }
        if st.low && free >= self.ample_at() {
            if let Err(e) = self.bdi.bound(self.limit) {
                // Stay low: the cache is used only while its bound is ours.
                tracing::warn!("restoring the kernel's dirty bound: {e}");
                return None;
            }
            st.low = false;
            self.low.store(false, Relaxed);
            return Some(Change::BecameAmple);
        }
        None
    }

    /// Counts `bytes` written; true when free space should be looked at again (each
    /// MiB while ample, every write while low).
    pub fn wrote(&self, bytes: u64) -> bool {
        let n = self.since_check.fetch_add(bytes, Relaxed) + bytes;
        self.is_low() || n >= 1 << 20
    }

    /// Makes the kernel write back what it holds for the mount (a sync of it, from a
    /// thread of its own: the writes come back to this server), then marks it drained.
    fn drain(self: &Arc<Self>) {
        let room = self.clone();
        let spawned = std::thread::Builder::new()
            .name("wbcache-drain".into())
            .spawn(move || {
                let r = std::fs::File::open(&room.mountpoint).and_then(|f| {
                    use std::os::fd::AsRawFd;
                    // SAFETY: syncfs on a descriptor we own.
                    match unsafe { libc::syncfs(f.as_raw_fd()) } {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                });
                match r {
                    Ok(()) => {
                        let mut st = room.lock();
                        st.drained = true;
                        room.drained.notify_all();
                    }
                    Err(e) => tracing::warn!("syncing the mount when space became low: {e}"),
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("starting the write-back when space became low: {e}");
        }
    }

    /// Whether a write that takes `need` bytes, not from the kernel's write-back, may
    /// go ahead with `free` bytes free. While space is low it must leave what the
    /// kernel may still hold dirty; if that is the old, ample bound, it waits for the
    /// drain and asks `free_now` again.
    pub fn admit(&self, need: u64, free: u64, free_now: impl Fn() -> u64) -> bool {
        if !self.is_low() {
            return true;
        }
        let held = |st: &State| {
            if st.drained {
                GATE
            } else {
                (self.limit + SLACK).max(GATE)
            }
        };
        let mut st = self.lock();
        if free >= need + held(&st) {
            return true;
        }
        if st.drained {
            return false;
        }
        let deadline = std::time::Instant::now() + DRAIN_WAIT;
        while !st.drained {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .drained
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(st);
        free_now() >= need + GATE
    }

    /// What statfs may report free of `free` bytes: while space is low, the last
    /// [`GATE`] bytes are the kernel's write-back's.
    pub fn reportable(&self, free: u64) -> u64 {
        if self.is_low() {
            free.saturating_sub(GATE)
        } else {
            free
        }
    }

    /// Whether a file opened for writing now may go through the cache; if so it is
    /// counted until [`Room::closed`].
    pub fn open_cached(&self, ino: u64) -> bool {
        let mut st = self.lock();
        if st.low {
            return false;
        }
        *st.cached_writers.entry(ino).or_insert(0) += 1;
        true
    }

    /// A handle opened through [`Room::open_cached`] was released.
    pub fn closed(&self, ino: u64) {
        let mut st = self.lock();
        if let Some(n) = st.cached_writers.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                st.cached_writers.remove(&ino);
            }
        }
    }

    /// Whether `ino` has handles open for writing through the cache.
    pub fn has_cached_writers(&self, ino: u64) -> bool {
        self.lock().cached_writers.contains_key(&ino)
    }

    /// Whether `ino` has writers through the cache while space is low: their write(2)s
    /// are gated.
    pub fn gated(&self, ino: u64) -> bool {
        self.is_low() && self.lock().cached_writers.contains_key(&ino)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A room whose "sysfs" directory is a temporary one, to read back what it set.
    fn room(limit: u64) -> (Arc<Room>, PathBuf) {
        let dir = std::env::temp_dir().join(format!("quilt-room-{}-{}", std::process::id(), limit));
        std::fs::create_dir_all(&dir).unwrap();
        let r = Room::new(Bdi { dir: dir.clone() }, limit, &dir).unwrap();
        (r, dir)
    }

    fn bound(dir: &Path) -> u64 {
        std::fs::read_to_string(dir.join("max_bytes"))
            .unwrap()
            .parse()
            .unwrap()
    }

    #[test]
    fn the_regime_follows_free_space_with_hysteresis() {
        const MIB: u64 = 1 << 20;
        let (r, dir) = room(8 * MIB);
        // Starts low, at the low bound, until space is looked at.
        assert!(r.is_low() && !r.open_cached(1));
        assert_eq!(bound(&dir), LOW_LIMIT);
        assert!(r
            .check(100 * MIB)
            .is_some_and(|c| matches!(c, Change::BecameAmple)));
        assert_eq!(bound(&dir), 8 * MIB);
        assert_eq!(
            r.reportable(5 * MIB),
            5 * MIB,
            "ample space is all reported"
        );
        assert!(r.open_cached(7) && r.open_cached(7));
        // Between the thresholds nothing changes.
        assert!(r.check(2 * 8 * MIB + SLACK).is_none());
        let Some(Change::BecameLow(inos)) = r.check(2 * 8 * MIB + SLACK - 1) else {
            panic!("not low below twice the bound and the slack");
        };
        assert_eq!(inos, vec![7]);
        assert_eq!(bound(&dir), LOW_LIMIT);
        assert!(r.gated(7) && !r.gated(8));
        assert!(
            !r.open_cached(9),
            "a new open went through the cache while low"
        );
        // Back only at three times the bound and the slack.
        assert!(r.check(3 * 8 * MIB + SLACK - 1).is_none());
        assert!(r.check(3 * 8 * MIB + SLACK).is_some());
        assert!(!r.gated(7));
        r.closed(7);
        r.closed(7);
        assert!(!r.lock().cached_writers.contains_key(&7));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn direct_writes_leave_room_for_what_the_kernel_holds() {
        const MIB: u64 = 1 << 20;
        let (r, dir) = room(16 * MIB);
        r.check(100 * MIB);
        // Ample: anything goes (the file system itself says ENOSPC).
        assert!(r.admit(MIB, 0, || 0));
        r.check(10 * MIB);
        assert!(r.is_low());
        // Drained (set by hand: the test has no mount to sync), the kernel holds at
        // most the low bound and the slack.
        r.lock().drained = true;
        assert!(r.admit(MIB, GATE + MIB, || 0));
        assert!(!r.admit(MIB, GATE + MIB - 1, || u64::MAX));
        // statfs counts the same: what is left after the gate's bytes.
        assert_eq!(r.reportable(GATE + MIB), MIB);
        assert_eq!(r.reportable(GATE - 1), 0);
        // Not drained, a write that would eat into the old bound waits for the drain,
        // then asks again.
        r.lock().drained = false;
        let waiter = {
            let r = r.clone();
            std::thread::spawn(move || r.admit(MIB, 4 * MIB, || 64 * MIB))
        };
        std::thread::sleep(Duration::from_millis(50));
        {
            let mut st = r.lock();
            st.drained = true;
            r.drained.notify_all();
        }
        assert!(waiter.join().unwrap());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn mount_points_in_mountinfo_are_unescaped() {
        assert_eq!(unescape(r"/tmp/a\040b\134c"), b"/tmp/a b\\c".to_vec());
        assert_eq!(unescape(r"/plain"), b"/plain".to_vec());
        assert_eq!(unescape(r"/end\04"), br"/end\04".to_vec());
    }
}
