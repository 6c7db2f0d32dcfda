//! A rotating-disk model: a device that wraps another and delays each request by the
//! time a 7200 RPM desktop disk would take to serve it, so that what depends on where
//! the head is (a journal commit that just missed its sector and waits a rotation; a
//! range write that lands wherever the head gets first) can be run and measured on any
//! storage. The data goes to the wrapped device; the model only decides *when* each
//! request completes.
//!
//! The mechanics are DiskSim's, reduced to what a journal's timing needs:
//! - **Layout**: 512-byte sectors in zones (outer zones hold more sectors per track),
//!   tracks on `heads` surfaces per cylinder, sector 0 of each track shifted by
//!   `track_skew` sectors from the previous one (so a transfer crossing a track boundary
//!   does not lose a revolution). The wrapped device's blocks start at cylinder 0
//!   (outermost), as a journal on its own disk would.
//! - **Seek** (Ruemmler and Wilkes's curve): a separate time for one cylinder, then
//!   `c1 + c2·√d` up to `boundary` cylinders (the arm accelerating), `c3 + c4·d` beyond
//!   (coasting); a head switch within a cylinder costs `head_switch`. Writes add a settle
//!   time.
//! - **Rotation**: the platter's angle is the clock's time modulo a revolution; a request
//!   waits, after its seek, until its first sector comes under the head, then transfers
//!   its sectors at the zone's rate.
//! - **Write cache**: off (write-through, every write durable when it completes: what a
//!   journal study runs) or on (writes complete at interface speed and wait in the cache;
//!   a flush writes them in block order).
//!
//! Requests are served one at a time (one actuator, queue depth 1), in arrival order.
//! The clock is real (each request sleeps until its modelled completion, for running
//! real programs) or virtual (time advances by the modelled cost and nothing sleeps:
//! deterministic and fast, for tests). Every request's cost is counted in a histogram.
//!
//! **Range writes**: `write_range` computes, for each candidate, when the head would
//! reach it, and writes where it is soonest (the paper's hierarchical-range scheduler,
//! over a list of single positions).

use crate::{
    check_request, check_run, BlockDevice, BlockDeviceExt, BlockError, BlockNo, Capabilities,
    DeviceCounters, GatherWrites, IoStats, PartReads, RangeWrites, Result, WriteClass,
};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECTOR: u64 = 512;

/// Cylinders of one recording zone, and its sectors per track.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zone {
    pub cylinders: u32,
    pub sectors_per_track: u32,
}

/// Seek time by cylinder distance (Ruemmler and Wilkes), in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeekCurve {
    pub single_ns: f64,
    pub boundary: u32,
    pub c1_ns: f64,
    pub c2_ns: f64,
    pub c3_ns: f64,
    pub c4_ns: f64,
}

impl SeekCurve {
    pub fn time_ns(&self, d: u32) -> f64 {
        match d {
            0 => 0.0,
            1 => self.single_ns,
            d if d < self.boundary => self.c1_ns + self.c2_ns * (d as f64).sqrt(),
            d => self.c3_ns + self.c4_ns * d as f64,
        }
    }
}

/// A disk's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskParams {
    pub rpm: f64,
    pub heads: u32,
    /// Outermost first.
    pub zones: Vec<Zone>,
    pub track_skew: u32,
    pub seek: SeekCurve,
    pub head_switch_ns: f64,
    pub write_settle_ns: f64,
    /// Per command (the controller's overhead).
    pub overhead_ns: f64,
    /// Interface transfer rate into the write cache, bytes per second.
    pub interface_bps: f64,
    pub write_cache: bool,
    /// After a read from the media the drive reads on into its buffer, up to this many
    /// bytes past the last sector the host asked for (0: no read-ahead).
    pub read_ahead_bytes: u64,
}

impl DiskParams {
    /// A 7200 RPM desktop disk of about 500 GB, in the range of the Hitachi Deskstar
    /// 7K80 that Bark used and of current 7200 RPM drives: 8.33 ms per revolution (4.17
    /// ms average rotational latency); 4 surfaces; about 150 MB/s at the outer zone and
    /// half that inside; seek 0.6 ms track to track, about 8 ms on average (a third of
    /// the stroke), 14 ms full stroke; write cache off (write-through).
    pub fn desktop_7200() -> DiskParams {
        DiskParams {
            rpm: 7200.0,
            heads: 4,
            zones: vec![
                Zone {
                    cylinders: 40_000,
                    sectors_per_track: 2400,
                },
                Zone {
                    cylinders: 60_000,
                    sectors_per_track: 2000,
                },
                Zone {
                    cylinders: 60_000,
                    sectors_per_track: 1600,
                },
                Zone {
                    cylinders: 40_000,
                    sectors_per_track: 1200,
                },
            ],
            // A head switch (0.5 ms) is 144 sectors of the outer zone.
            track_skew: 160,
            seek: SeekCurve {
                single_ns: 600_000.0,
                boundary: 5_000,
                c1_ns: 500_000.0,
                c2_ns: 70_000.0,
                c3_ns: 5_231_000.0,
                c4_ns: 43.8,
            },
            head_switch_ns: 500_000.0,
            write_settle_ns: 100_000.0,
            overhead_ns: 50_000.0,
            interface_bps: 300e6,
            write_cache: false,
            // A segment of the drive's buffer (every drive reads ahead: without it, 4 KiB
            // reads in sequence would each wait a revolution).
            read_ahead_bytes: 2 << 20,
        }
    }

    pub fn rotation_ns(&self) -> f64 {
        60e9 / self.rpm
    }

    pub fn cylinders(&self) -> u32 {
        self.zones.iter().map(|z| z.cylinders).sum()
    }

    pub fn sectors(&self) -> u64 {
        self.zones
            .iter()
            .map(|z| z.cylinders as u64 * self.heads as u64 * z.sectors_per_track as u64)
            .sum()
    }

    /// Where sector `lba` lies: cylinder, global track number, sector within its track,
    /// sectors per track.
    pub fn locate(&self, lba: u64) -> Option<Place> {
        let mut first_cyl = 0u32;
        let mut rest = lba;
        for z in &self.zones {
            let per_cyl = self.heads as u64 * z.sectors_per_track as u64;
            let in_zone = z.cylinders as u64 * per_cyl;
            if rest < in_zone {
                let cyl = first_cyl + (rest / per_cyl) as u32;
                let head = ((rest % per_cyl) / z.sectors_per_track as u64) as u32;
                let sector = (rest % z.sectors_per_track as u64) as u32;
                return Some(Place {
                    cylinder: cyl,
                    track: cyl as u64 * self.heads as u64 + head as u64,
                    sector,
                    per_track: z.sectors_per_track,
                });
            }
            rest -= in_zone;
            first_cyl += z.cylinders;
        }
        None
    }
}

/// A sector's place on the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub cylinder: u32,
    pub track: u64,
    pub sector: u32,
    pub per_track: u32,
}

impl Place {
    /// The sector's angle on the platter, in revolutions (0..1), skew included.
    fn angle(&self, skew: u32) -> f64 {
        let s = (self.sector as u64 + self.track * skew as u64) % self.per_track as u64;
        s as f64 / self.per_track as f64
    }
}

/// The model's clock.
pub enum Clock {
    /// Real time: requests sleep until their modelled completion.
    Real(Instant),
    /// Virtual time, in nanoseconds: requests only advance it.
    Virtual(AtomicU64),
}

impl Clock {
    pub fn real() -> Clock {
        Clock::Real(Instant::now())
    }
    pub fn virtual_at(ns: u64) -> Clock {
        Clock::Virtual(AtomicU64::new(ns))
    }
    fn now_ns(&self) -> f64 {
        match self {
            Clock::Real(t0) => t0.elapsed().as_nanos() as f64,
            Clock::Virtual(t) => t.load(Relaxed) as f64,
        }
    }
    /// Lets time pass until `ns` (from the clock's start).
    fn wait_until(&self, ns: f64) {
        match self {
            Clock::Real(t0) => {
                let target = *t0 + Duration::from_nanos(ns.max(0.0) as u64);
                loop {
                    let now = Instant::now();
                    if now >= target {
                        break;
                    }
                    let left = target - now;
                    if left > Duration::from_micros(200) {
                        std::thread::sleep(left - Duration::from_micros(100));
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
            Clock::Virtual(t) => {
                t.fetch_max(ns.max(0.0) as u64, Relaxed);
            }
        }
    }
    /// Lets `ns` of idle time pass (a program thinking between requests), in virtual
    /// time; real time passes by itself.
    pub fn advance(&self, ns: u64) {
        if let Clock::Virtual(t) = self {
            t.fetch_add(ns, Relaxed);
        }
    }
}

/// Where the head is, and what the write cache holds.
struct Head {
    cylinder: u32,
    track: u64,
    /// When the disk finishes what it was given.
    busy_until: f64,
    /// Sectors waiting in the write cache: (first, count).
    cached: Vec<(u64, u64)>,
    /// The read-ahead since the last read from the media, if any.
    ahead: Option<ReadAhead>,
}

/// The drive reading on after a read from the media: sector `origin` + k is in its
/// buffer from `origin_ns` + k * `ns_per_sector`, while the media is not needed for
/// anything else and no more than the read-ahead size lies ahead of what the host has
/// read.
#[derive(Debug, Clone, Copy)]
struct ReadAhead {
    origin: u64,
    origin_ns: f64,
    ns_per_sector: f64,
    /// The end of the host's last read from the buffer.
    served_end: u64,
    /// Where the reading stopped (another command needed the media), if it has.
    stopped_at: Option<u64>,
}

impl ReadAhead {
    /// The end of what the buffer holds, or will hold without a new media command.
    fn limit(&self, ahead_sectors: u64, device_end: u64) -> u64 {
        let mut end = (self.served_end + ahead_sectors).min(device_end);
        if let Some(s) = self.stopped_at {
            end = end.min(s);
        }
        end
    }

    /// The sector the reading has reached at `t`.
    fn reached(&self, t: f64, ahead_sectors: u64, device_end: u64) -> u64 {
        let k = ((t - self.origin_ns) / self.ns_per_sector).max(0.0) as u64;
        (self.origin + k).min(self.limit(ahead_sectors, device_end))
    }
}

/// Latency buckets, microseconds (the last is open).
pub const LATENCY_BUCKETS_US: [u64; LATENCY_BUCKETS] = [
    50,
    100,
    200,
    300,
    400,
    500,
    750,
    1000,
    1250,
    1500,
    1750,
    2000,
    2500,
    3000,
    3500,
    4000,
    5000,
    6000,
    7000,
    8000,
    9000,
    10_000,
    12_500,
    15_000,
    20_000,
    30_000,
    50_000,
    u64::MAX,
];
/// How many latency buckets (fine below a rotation, 8.3 ms, for latency CDFs).
pub const LATENCY_BUCKETS: usize = 28;

/// What the model measured.
#[derive(Debug, Default)]
pub struct ModelCounters {
    /// Writes (plain and range) by modelled latency, in `LATENCY_BUCKETS_US`.
    pub write_latency: [AtomicU64; LATENCY_BUCKETS],
    pub read_latency: [AtomicU64; LATENCY_BUCKETS],
    pub write_ns: AtomicU64,
    pub read_ns: AtomicU64,
    pub flush_ns: AtomicU64,
    /// Flushes the model served (the device below sees none without a host flush).
    pub flushes: AtomicU64,
    pub rotation_ns: AtomicU64,
    pub seek_ns: AtomicU64,
    /// Range writes by the index of the candidate chosen (the last bucket: 15 or more).
    pub range_choice: [AtomicU64; 16],
    /// Range writes that did not take the first candidate, and the blocks they skipped
    /// ahead of it in all.
    pub range_skips: AtomicU64,
    pub range_skipped_blocks: AtomicU64,
}

/// The disk model over a device (see the module's doc).
pub struct DiskModel {
    inner: Arc<dyn BlockDevice>,
    params: DiskParams,
    clock: Clock,
    head: Mutex<Head>,
    sectors_per_block: u64,
    counters: ModelCounters,
    /// Every request's modelled latency in ns, when tracing (for a latency CDF).
    trace: Mutex<Option<Vec<(u8, u64)>>>,
    /// Whether a flush also flushes the wrapped device (see `without_host_flush`).
    host_flush: bool,
}

fn bucket(us: u64) -> usize {
    LATENCY_BUCKETS_US
        .iter()
        .position(|&b| us <= b)
        .unwrap_or(LATENCY_BUCKETS - 1)
}

impl DiskModel {
    pub fn new(inner: Arc<dyn BlockDevice>, params: DiskParams, clock: Clock) -> Result<DiskModel> {
        let bs = inner.block_size() as u64;
        if bs % SECTOR != 0 {
            return Err(BlockError::BadBlockSize(bs as usize));
        }
        let spb = bs / SECTOR;
        if inner.block_count().saturating_mul(spb) > params.sectors() {
            return Err(BlockError::Unsupported(
                "a device larger than the modelled disk",
            ));
        }
        Ok(DiskModel {
            inner,
            params,
            clock,
            head: Mutex::new(Head {
                cylinder: 0,
                track: 0,
                busy_until: 0.0,
                cached: Vec::new(),
                ahead: None,
            }),
            sectors_per_block: spb,
            counters: ModelCounters::default(),
            trace: Mutex::new(None),
            host_flush: true,
        })
    }

    /// Flushes reach the model only, not the device under it. The modelled disk's flush
    /// then costs what the model says, without the host's own flush of the image (an
    /// fdatasync, about 0.15 ms here, longer than the model's flush of a write-through
    /// disk): for measuring, when the image need not survive a crash of the host.
    pub fn without_host_flush(mut self) -> DiskModel {
        self.host_flush = false;
        self
    }

    pub fn params(&self) -> &DiskParams {
        &self.params
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub fn counters(&self) -> &ModelCounters {
        &self.counters
    }

    /// From now on, keep every request's latency (kind: 0 read, 1 write, 2 flush).
    pub fn start_trace(&self) {
        *self.trace.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// The latencies kept since `start_trace`, in ns, with their kinds.
    pub fn take_trace(&self) -> Vec<(u8, u64)> {
        self.trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    fn place(&self, block: BlockNo) -> Result<Place> {
        self.params
            .locate(block * self.sectors_per_block)
            .ok_or(BlockError::OutOfRange {
                block,
                count: self.inner.block_count(),
            })
    }

    /// When the head, free at `t` at `h`, can start transferring at `p` (seek, settle,
    /// rotation): the start time, and the seek and rotation it waited.
    fn position(&self, h: &Head, t: f64, p: &Place, write: bool) -> (f64, f64, f64) {
        let d = h.cylinder.abs_diff(p.cylinder);
        let mut seek = self.params.seek.time_ns(d);
        if d == 0 && h.track != p.track {
            seek = seek.max(self.params.head_switch_ns);
        }
        if write && (d > 0 || h.track != p.track) {
            // The head settles on a track it moved to before it writes; on the track it
            // is on, it writes at once.
            seek += self.params.write_settle_ns;
        }
        let rot = self.params.rotation_ns();
        let at = t + seek;
        let angle = (at / rot).fract();
        let wait = (p.angle(self.params.track_skew) - angle).rem_euclid(1.0) * rot;
        (at + wait, seek, wait)
    }

    /// Time to transfer `sectors` from `p` on (crossing tracks: the skew hides the head
    /// switch).
    fn transfer_ns(&self, p: &Place, sectors: u64) -> f64 {
        sectors as f64 * self.params.rotation_ns() / p.per_track as f64
    }

    /// Serves one media access of `blocks` blocks at `block` that begins no earlier than
    /// `t`; returns its completion and moves the head.
    fn access(
        &self,
        h: &mut Head,
        t: f64,
        block: BlockNo,
        blocks: u64,
        write: bool,
    ) -> Result<f64> {
        self.stop_read_ahead(h, t)?;
        let p = self.place(block)?;
        let (start, seek, wait) = self.position(h, t, &p, write);
        let sectors = blocks * self.sectors_per_block;
        let end = start + self.transfer_ns(&p, sectors);
        let last = self.place(block + blocks - 1)?;
        h.cylinder = last.cylinder;
        h.track = last.track;
        self.counters.seek_ns.fetch_add(seek as u64, Relaxed);
        self.counters.rotation_ns.fetch_add(wait as u64, Relaxed);
        Ok(end)
    }

    fn ahead_sectors(&self) -> u64 {
        self.params.read_ahead_bytes / SECTOR
    }

    fn device_end(&self) -> u64 {
        self.inner.block_count() * self.sectors_per_block
    }

    /// Another command needs the media at `t`: the read-ahead ends where it got to, with
    /// the head there.
    fn stop_read_ahead(&self, h: &mut Head, t: f64) -> Result<()> {
        let (ahead, end) = (self.ahead_sectors(), self.device_end());
        if let Some(a) = h.ahead.as_mut().filter(|a| a.stopped_at.is_none()) {
            let reached = a.reached(t, ahead, end);
            a.stopped_at = Some(reached);
            if reached > a.origin {
                let p = self.place((reached - 1) / self.sectors_per_block)?;
                h.cylinder = p.cylinder;
                h.track = p.track;
            }
        }
        Ok(())
    }

    /// A write of these sectors makes what the read-ahead holds of them stale.
    fn forget_read_ahead(&self, h: &mut Head, sector: u64, count: u64) {
        if let Some(a) = h.ahead {
            let end = a.limit(self.ahead_sectors(), self.device_end());
            if sector < end && sector + count > a.origin {
                h.ahead = None;
            }
        }
    }

    /// A read of `blocks` blocks at `block` arriving at `arrive`: from the read-ahead
    /// when it holds them (or is about to), else from the media (and the drive reads on
    /// from there). Returns the completion.
    fn timed_read(&self, h: &mut Head, arrive: f64, block: BlockNo, blocks: u64) -> Result<f64> {
        let t = arrive.max(h.busy_until) + self.params.overhead_ns;
        let (first, count) = (
            block * self.sectors_per_block,
            blocks * self.sectors_per_block,
        );
        let (ahead, end) = (self.ahead_sectors(), self.device_end());
        let done = match h.ahead.as_mut() {
            Some(a) if first >= a.origin && first + count <= a.limit(ahead, end) => {
                let ready = a.origin_ns + (first + count - a.origin) as f64 * a.ns_per_sector;
                a.served_end = a.served_end.max(first + count);
                ready.max(t + (count * SECTOR) as f64 / self.params.interface_bps * 1e9)
            }
            _ => {
                let done = self.access(h, t, block, blocks, false)?;
                if ahead > 0 {
                    let p = self.place(block + blocks - 1)?;
                    h.ahead = Some(ReadAhead {
                        origin: first + count,
                        origin_ns: done,
                        ns_per_sector: self.params.rotation_ns() / p.per_track as f64,
                        served_end: first + count,
                        stopped_at: None,
                    });
                }
                done
            }
        };
        h.busy_until = done;
        self.clock.wait_until(done);
        self.record(0, done - arrive);
        Ok(done)
    }

    fn record(&self, kind: u8, ns: f64) {
        let ns = ns.max(0.0) as u64;
        let b = bucket(ns / 1000);
        match kind {
            0 => {
                self.counters.read_latency[b].fetch_add(1, Relaxed);
                self.counters.read_ns.fetch_add(ns, Relaxed);
            }
            1 => {
                self.counters.write_latency[b].fetch_add(1, Relaxed);
                self.counters.write_ns.fetch_add(ns, Relaxed);
            }
            _ => {
                self.counters.flush_ns.fetch_add(ns, Relaxed);
            }
        }
        if let Some(t) = self
            .trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            t.push((kind, ns));
        }
    }

    /// A write of `blocks` blocks at `block` (already given to the device below): its
    /// modelled time passes.
    fn timed_write(&self, h: &mut Head, arrive: f64, block: BlockNo, blocks: u64) -> Result<()> {
        self.forget_read_ahead(
            h,
            block * self.sectors_per_block,
            blocks * self.sectors_per_block,
        );
        let t = arrive.max(h.busy_until) + self.params.overhead_ns;
        let done = if self.params.write_cache {
            let sectors = blocks * self.sectors_per_block;
            h.cached.push((block * self.sectors_per_block, sectors));
            t + (sectors * SECTOR) as f64 / self.params.interface_bps * 1e9
        } else {
            self.access(h, t, block, blocks, true)?
        };
        h.busy_until = done;
        self.clock.wait_until(done);
        self.record(1, done - arrive);
        Ok(())
    }

    /// Candidates in order of when the head can reach them (first the soonest).
    fn soonest(&self, h: &Head, t: f64, candidates: &[BlockNo]) -> Result<usize> {
        let mut best = (f64::MAX, 0);
        for (i, &c) in candidates.iter().enumerate() {
            let p = self.place(c)?;
            let (start, _, _) = self.position(h, t, &p, true);
            if start < best.0 {
                best = (start, i);
            }
        }
        Ok(best.1)
    }
}

impl BlockDevice for DiskModel {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }

    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        check_request(self, block, buf.len())?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.read(block, buf)?;
        self.timed_read(&mut h, arrive, block, 1).map(|_| ())
    }

    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        let n = check_run(self, first, buf.len())?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.read_blocks(first, buf)?;
        self.timed_read(&mut h, arrive, first, n).map(|_| ())
    }

    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        check_request(self, block, buf.len())?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.write(block, buf, class)?;
        self.timed_write(&mut h, arrive, block, 1)
    }

    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        let n = check_run(self, first, buf.len())?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.write_blocks(first, buf, class)?;
        self.timed_write(&mut h, arrive, first, n)
    }

    fn flush(&self) -> Result<()> {
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        if self.host_flush {
            self.inner.flush()?;
        }
        let mut t = arrive.max(h.busy_until) + self.params.overhead_ns;
        let mut cached = std::mem::take(&mut h.cached);
        cached.sort_unstable();
        // Adjacent and overlapping writes go to the media as one transfer.
        let mut runs: Vec<(u64, u64)> = Vec::with_capacity(cached.len());
        for (sector, count) in cached {
            match runs.last_mut() {
                Some((s, c)) if sector <= *s + *c => *c = (*c).max(sector + count - *s),
                _ => runs.push((sector, count)),
            }
        }
        for (sector, count) in runs {
            let spb = self.sectors_per_block;
            t = self.access(&mut h, t, sector / spb, count.div_ceil(spb), true)?;
        }
        h.busy_until = t;
        self.clock.wait_until(t);
        self.record(2, t - arrive);
        self.counters.flushes.fetch_add(1, Relaxed);
        Ok(())
    }

    fn stats(&self) -> IoStats {
        IoStats {
            flushes: self.counters.flushes.load(Relaxed),
            ..self.inner.stats()
        }
    }
    fn capabilities(&self) -> Capabilities<'_> {
        let below = self.inner.capabilities();
        Capabilities {
            // Its own: each is one request, timed as the run it covers.
            gather: Some(self),
            part_reads: Some(self),
            ranges: Some(self),
            counters: Some(self),
            // The image's: the model times requests, not where their bytes live.
            hints: below.hints,
            reservation: below.reservation,
            history: below.history,
        }
    }
}

/// A gathered write is one request, as `write_blocks` of the run.
impl GatherWrites for DiskModel {
    fn write_blocks_gather(
        &self,
        first: BlockNo,
        parts: &[&[u8]],
        class: WriteClass,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let n = check_run(self, first, len)?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.write_blocks_gather(first, parts, class)?;
        self.timed_write(&mut h, arrive, first, n)
    }
}

/// A part read is one request for the blocks it touches.
impl PartReads for DiskModel {
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.block_size();
        let n = check_run(self, first, (skip + buf.len()).div_ceil(bs) * bs)?;
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        self.inner.read_part(first, skip, buf)?;
        self.timed_read(&mut h, arrive, first, n).map(|_| ())
    }
}

impl RangeWrites for DiskModel {
    fn write_range(
        &self,
        candidates: &[BlockNo],
        buf: &[u8],
        class: WriteClass,
    ) -> Result<BlockNo> {
        if candidates.is_empty() {
            return Err(BlockError::BadBufferSize {
                got: buf.len(),
                block_size: self.block_size(),
            });
        }
        let mut n = 0;
        for &c in candidates {
            n = check_run(self, c, buf.len())?;
        }
        let mut h = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let arrive = self.clock.now_ns();
        let t = arrive.max(h.busy_until) + self.params.overhead_ns;
        let i = if self.params.write_cache {
            0
        } else {
            self.soonest(&h, t, candidates)?
        };
        let at = candidates[i];
        self.inner.write_blocks(at, buf, class)?;
        self.counters.range_choice[i.min(15)].fetch_add(1, Relaxed);
        if at != candidates[0] {
            self.counters.range_skips.fetch_add(1, Relaxed);
            self.counters
                .range_skipped_blocks
                .fetch_add(at.abs_diff(candidates[0]), Relaxed);
        }
        // Timed from the arrival the choice was made for: the time the image's own
        // write takes is the emulator's, not the disk's (counted, it made one range
        // write in twenty miss the candidate chosen for it by a revolution).
        self.timed_write(&mut h, arrive, at, n)?;
        Ok(at)
    }
}

impl DeviceCounters for DiskModel {
    fn extra_stats(&self) -> Vec<(String, u64)> {
        let c = &self.counters;
        let mut v = self.inner.extra_stats();
        for (i, b) in LATENCY_BUCKETS_US.iter().enumerate() {
            let name = if *b == u64::MAX {
                "more".to_string()
            } else {
                format!("le_{b}us")
            };
            v.push((
                format!("model.write_latency.{name}"),
                c.write_latency[i].load(Relaxed),
            ));
        }
        for (i, n) in c.range_choice.iter().enumerate() {
            v.push((format!("model.range_choice.{i}"), n.load(Relaxed)));
        }
        v.extend([
            ("model.write_ns".into(), c.write_ns.load(Relaxed)),
            ("model.read_ns".into(), c.read_ns.load(Relaxed)),
            ("model.flush_ns".into(), c.flush_ns.load(Relaxed)),
            ("model.seek_ns".into(), c.seek_ns.load(Relaxed)),
            ("model.rotation_ns".into(), c.rotation_ns.load(Relaxed)),
            ("model.range_skips".into(), c.range_skips.load(Relaxed)),
            (
                "model.range_skipped_blocks".into(),
                c.range_skipped_blocks.load(Relaxed),
            ),
        ]);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn model(blocks: u64) -> DiskModel {
        let dev = Arc::new(MemDevice::new(4096, blocks).unwrap());
        DiskModel::new(dev, DiskParams::desktop_7200(), Clock::virtual_at(0)).unwrap()
    }

    fn now(m: &DiskModel) -> f64 {
        m.clock.now_ns()
    }

    #[test]
    fn the_seek_curve_has_its_two_regimes() {
        let s = DiskParams::desktop_7200().seek;
        assert_eq!(s.time_ns(0), 0.0);
        assert_eq!(s.time_ns(1), 600_000.0);
        assert!((s.time_ns(100) - (500_000.0 + 70_000.0 * 10.0)).abs() < 1e-6);
        assert!((s.time_ns(100_000) - (5_231_000.0 + 43.8 * 100_000.0)).abs() < 1e-6);
        // Continuous enough at the boundary, and about 8 ms at a third of the stroke.
        let below = s.time_ns(4_999);
        let above = s.time_ns(5_000);
        assert!((below - above).abs() < 50_000.0, "{below} {above}");
        let third = s.time_ns(DiskParams::desktop_7200().cylinders() / 3);
        assert!((7.0e6..9.5e6).contains(&third), "{third}");
    }

    /// A device as large as a disk that keeps nothing (the timing is all a test reads).
    struct Void(u64, crate::IoCounters);
    impl BlockDevice for Void {
        fn block_size(&self) -> usize {
            4096
        }
        fn block_count(&self) -> u64 {
            self.0
        }
        fn read(&self, _: BlockNo, buf: &mut [u8]) -> Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn read_blocks(&self, _: BlockNo, buf: &mut [u8]) -> Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn write(&self, _: BlockNo, _: &[u8], _: WriteClass) -> Result<()> {
            Ok(())
        }
        fn write_blocks(&self, _: BlockNo, _: &[u8], _: WriteClass) -> Result<()> {
            Ok(())
        }
        fn flush(&self) -> Result<()> {
            Ok(())
        }
        fn stats(&self) -> IoStats {
            self.1.snapshot()
        }
        fn capabilities(&self) -> Capabilities<'_> {
            Capabilities::default()
        }
    }

    #[test]
    fn a_seek_of_known_distance_costs_what_the_curve_says() {
        let p = DiskParams::desktop_7200();
        let dev = Arc::new(Void(40_000_000, Default::default()));
        let m = DiskModel::new(dev, p.clone(), Clock::virtual_at(0)).unwrap();
        let buf = vec![0u8; 4096];
        m.write(0, &buf, WriteClass::Metadata).unwrap();
        // A block 1,000 cylinders in: at least the curve's seek and settle, at most a
        // rotation more.
        let per_cyl = p.heads as u64 * 2400 * 512 / 4096;
        let target = 1000 * per_cyl;
        let t0 = now(&m);
        m.write(target, &buf, WriteClass::Metadata).unwrap();
        let took = now(&m) - t0;
        let seek = p.seek.time_ns(1000) + p.write_settle_ns + p.overhead_ns;
        let xfer = 8.0 * p.rotation_ns() / 2400.0;
        assert!(took >= seek + xfer - 1.0, "{took} < {seek}");
        assert!(took <= seek + xfer + p.rotation_ns(), "{took}");
        assert_eq!(m.place(target).unwrap().cylinder, 1000);
    }

    #[test]
    fn consecutive_sectors_cost_no_rotation() {
        let m = model(4096);
        // One write of 16 blocks: one positioning, then a streaming transfer.
        let buf = vec![1u8; 16 * 4096];
        m.write_blocks(0, &buf, WriteClass::Metadata).unwrap();
        let t0 = now(&m);
        let rot0 = m.counters.rotation_ns.load(Relaxed);
        m.write_blocks(16, &buf, WriteClass::Metadata).unwrap();
        let took = now(&m) - t0;
        let p = m.params();
        // The next write arrives after the controller's overhead: its sector has passed
        // by then, so it waits nearly a revolution (no settle: the head stays on its
        // track) ...
        assert!(took > 0.8 * p.rotation_ns(), "{took}");
        // ... while the transfer inside one request paid none.
        let xfer = 128.0 * p.rotation_ns() / 2400.0;
        let rotated = m.counters.rotation_ns.load(Relaxed) - rot0;
        assert!((took - (rotated as f64 + xfer + p.overhead_ns)).abs() < 2.0);
    }

    #[test]
    fn a_flush_writes_adjacent_cached_writes_as_one_transfer() {
        let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
        let p = DiskParams {
            write_cache: true,
            ..DiskParams::desktop_7200()
        };
        let m = DiskModel::new(dev, p.clone(), Clock::virtual_at(0)).unwrap();
        for b in (0..64).rev() {
            m.write(b, &[3u8; 4096], WriteClass::Metadata).unwrap();
        }
        let rot0 = m.counters.rotation_ns.load(Relaxed);
        let t0 = now(&m);
        m.flush().unwrap();
        // One positioning (at most a revolution) and 64 blocks streamed: not 64
        // revolutions.
        let xfer = 64.0 * 8.0 * p.rotation_ns() / 2400.0;
        let took = now(&m) - t0;
        assert!(
            took <= p.overhead_ns + p.rotation_ns() + xfer + 1.0,
            "{took}"
        );
        assert!(m.counters.rotation_ns.load(Relaxed) - rot0 <= p.rotation_ns() as u64);
    }

    #[test]
    fn a_write_to_a_sector_just_passed_costs_a_full_rotation() {
        let m = model(4096);
        let buf = vec![2u8; 4096];
        m.write(100, &buf, WriteClass::Metadata).unwrap();
        // The same block again, at once: the head is just past it.
        let t0 = now(&m);
        m.write(100, &buf, WriteClass::Metadata).unwrap();
        let took = now(&m) - t0;
        let rot = m.params().rotation_ns();
        assert!(
            took > 0.95 * rot && took < 1.1 * rot,
            "{took} against {rot}"
        );
    }

    #[test]
    fn a_range_write_takes_the_candidate_the_head_reaches_first() {
        let m = model(4096);
        let buf = vec![3u8; 4096];
        m.write(0, &buf, WriteClass::Metadata).unwrap();
        // Candidates: block 0 again (a rotation away), and blocks a little ahead on the
        // same track (reached within the settle time and a short wait).
        let cands = [0u64, 2, 20, 40, 100];
        let at = RangeWrites::write_range(&m, &cands, &buf, WriteClass::Metadata).unwrap();
        assert_ne!(at, 0);
        let mut back = vec![0u8; 4096];
        m.inner.read(at, &mut back).unwrap();
        assert_eq!(back, buf);
        // Its cost is well under a rotation.
        let c = m.counters();
        assert_eq!(c.range_skips.load(Relaxed), 1);
        let total: u64 = c.range_choice.iter().map(|x| x.load(Relaxed)).sum();
        assert_eq!(total, 1);
    }

    #[test]
    fn idle_time_moves_the_platter() {
        let m = model(4096);
        let buf = vec![4u8; 4096];
        m.write(0, &buf, WriteClass::Metadata).unwrap();
        // Thinking for half a revolution, then writing the block that has come round:
        // about half a revolution of waiting instead of a whole one.
        let rot = m.params().rotation_ns();
        m.clock.advance((rot / 2.0) as u64);
        let t0 = now(&m);
        m.write(0, &buf, WriteClass::Metadata).unwrap();
        let took = now(&m) - t0;
        assert!(took < 0.6 * rot, "{took}");
    }

    #[test]
    fn sequential_reads_stream_from_the_read_ahead() {
        let m = model(4096);
        let p = m.params().clone();
        let mut buf = vec![0u8; 4096];
        m.read(0, &mut buf).unwrap();
        // 255 more blocks one by one: the media rate (a revolution per 2400 sectors, 300
        // blocks), not a revolution each.
        let t0 = now(&m);
        for b in 1..256 {
            m.read(b, &mut buf).unwrap();
        }
        let took = now(&m) - t0;
        let media = 255.0 * 8.0 * p.rotation_ns() / 2400.0;
        assert!(took >= media - 1.0, "{took} < {media}");
        assert!(took < media + 255.0 * (p.overhead_ns + 20_000.0), "{took}");
        // Without read-ahead, each would wait nearly a revolution.
        let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
        let q = DiskParams {
            read_ahead_bytes: 0,
            ..DiskParams::desktop_7200()
        };
        let n = DiskModel::new(dev, q, Clock::virtual_at(0)).unwrap();
        n.read(0, &mut buf).unwrap();
        let t1 = now(&n);
        for b in 1..17 {
            n.read(b, &mut buf).unwrap();
        }
        assert!(now(&n) - t1 > 16.0 * 0.8 * p.rotation_ns());
    }

    #[test]
    fn a_write_or_a_distant_read_ends_the_read_ahead() {
        let m = model(40_000);
        let mut buf = vec![0u8; 4096];
        m.read(0, &mut buf).unwrap();
        let rot = m.params().rotation_ns();
        // A write inside what the drive reads ahead: the next read there goes to the media.
        m.write(1, &[7u8; 4096], WriteClass::Metadata).unwrap();
        let t0 = now(&m);
        m.read(1, &mut buf).unwrap();
        assert!(
            now(&m) - t0 > 0.5 * rot,
            "a stale read-ahead served a written block"
        );
        assert_eq!(buf, vec![7u8; 4096]);
        // A read far away stops the reading (50 µs after it began: some 14 sectors):
        // coming back past where it stopped, within the read-ahead size, pays.
        m.read(2, &mut buf).unwrap();
        m.read(30_000, &mut buf).unwrap();
        let t1 = now(&m);
        m.read(100, &mut buf).unwrap();
        assert!(
            now(&m) - t1 > 1e6,
            "the read-ahead went on during another read"
        );
    }

    #[test]
    fn the_write_cache_defers_positioning_to_the_flush() {
        let mut p = DiskParams::desktop_7200();
        p.write_cache = true;
        let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
        let m = DiskModel::new(dev, p, Clock::virtual_at(0)).unwrap();
        let buf = vec![5u8; 4096];
        let t0 = now(&m);
        for b in [10u64, 500, 20, 900] {
            m.write(b, &buf, WriteClass::Metadata).unwrap();
        }
        let writes = now(&m) - t0;
        assert!(writes < 1e6, "writes into the cache took {writes} ns");
        let t1 = now(&m);
        m.flush().unwrap();
        assert!(now(&m) - t1 > 1e6, "the flush must pay the positioning");
    }

    #[test]
    fn without_host_flush_the_model_still_times_the_flush() {
        let mut p = DiskParams::desktop_7200();
        p.write_cache = true;
        let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
        let m = DiskModel::new(dev.clone(), p.clone(), Clock::virtual_at(0))
            .unwrap()
            .without_host_flush();
        let buf = vec![5u8; 4096];
        for b in [10u64, 900] {
            m.write(b, &buf, WriteClass::Metadata).unwrap();
        }
        let t1 = now(&m);
        m.flush().unwrap();
        assert!(
            now(&m) - t1 > 1e6,
            "the modelled flush must still pay the positioning"
        );
        assert_eq!(
            dev.stats().flushes,
            0,
            "the device under the model was flushed"
        );
        assert_eq!(
            m.stats().flushes,
            1,
            "the model counts the flushes it served"
        );
        // The data reached the device all the same.
        let mut back = vec![0u8; 4096];
        dev.read(900, &mut back).unwrap();
        assert_eq!(back, buf);
        // The default flushes the device below too.
        let dev = Arc::new(MemDevice::new(4096, 4096).unwrap());
        let m = DiskModel::new(dev.clone(), p, Clock::virtual_at(0)).unwrap();
        m.flush().unwrap();
        assert_eq!(dev.stats().flushes, 1);
    }
}
