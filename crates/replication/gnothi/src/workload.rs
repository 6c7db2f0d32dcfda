//! The fault tests' workload: clients writing and reading blocks whose contents name
//! the write that made them, every operation recorded with when it was invoked and
//! when it returned, and the record checked for linearizability ([`crate::history`]).
//! The simulation runs it in simulated time; `quiltfs cluster check` against real
//! replica processes, while a script kills, partitions, fills and damages them.
//!
//! Times are a logical clock shared by the clients of one process: an operation that
//! returned before another was invoked has the smaller stamps, which is all the
//! checker needs of real time.

use crate::client::Client;
use crate::history::{check, Kind, Op};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Block `block`'s contents after the write named `value`: the value and the block
/// number, then a pattern of the value, so a read tells which write it saw, that it saw
/// all of it, and that it is this block's.
pub fn encode(value: u64, block: u64, block_size: usize) -> Vec<u8> {
    let mut b = vec![0u8; block_size];
    b[0..8].copy_from_slice(&value.to_le_bytes());
    b[8..16].copy_from_slice(&block.to_le_bytes());
    for (i, x) in b[16..].iter_mut().enumerate() {
        *x = (value.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64) >> 3) as u8;
    }
    b
}

/// The write a block's contents name (0: never written), or what is wrong with them.
pub fn decode(b: &[u8], block: u64) -> Result<u64, String> {
    if b.iter().all(|&x| x == 0) {
        return Ok(0);
    }
    if b.len() < 16 {
        return Err(format!("block {block}: {} bytes is too short", b.len()));
    }
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[0..8]);
    let value = u64::from_le_bytes(v);
    if b != encode(value, block, b.len()).as_slice() {
        return Err(format!("block {block} holds data no write wrote"));
    }
    Ok(value)
}

/// The record of every client's operations.
#[derive(Default)]
pub struct Recorder {
    clock: AtomicU64,
    /// Ticks are microseconds since the Unix epoch (made unique), so that a violation
    /// found from outside can be lined up with the replicas' logs; else a counter.
    wall: bool,
    ops: Mutex<Vec<Op>>,
    /// Reads that returned data no write wrote (always a violation).
    garbage: Mutex<Vec<String>>,
    failed_reads: AtomicU64,
}

/// What a recorded history holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Block writes acknowledged, and those whose outcome is unknown.
    pub writes_acked: u64,
    pub writes_unknown: u64,
    /// Block reads answered, and read requests that failed (observed nothing).
    pub reads: u64,
    pub failed_reads: u64,
}

impl Recorder {
    /// A recorder whose ticks are wall-clock microseconds (see `wall`).
    pub fn wall_clock() -> Recorder {
        Recorder {
            wall: true,
            ..Recorder::default()
        }
    }

    pub fn now(&self) -> u64 {
        if !self.wall {
            return self.clock.fetch_add(1, Ordering::SeqCst);
        }
        let us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        // Unique and increasing even if the wall clock steps back or two calls meet.
        let mut last = self.clock.load(Ordering::SeqCst);
        loop {
            let t = us.max(last + 1);
            match self
                .clock
                .compare_exchange(last, t, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return t,
                Err(seen) => last = seen,
            }
        }
    }

    fn push(&self, op: Op) {
        if let Ok(mut ops) = self.ops.lock() {
            ops.push(op);
        }
    }

    /// Records a write of blocks `first..first + count`, returned at `complete`
    /// (`None`: failed or timed out; it may still take effect).
    pub fn write(&self, first: u64, count: u64, value: u64, invoke: u64, complete: Option<u64>) {
        for block in first..first + count {
            self.push(Op {
                block,
                kind: Kind::Write(value),
                invoke,
                complete,
            });
        }
    }

    /// Records a read that returned `data` (blocks from `first`).
    pub fn read(&self, first: u64, data: &[u8], block_size: usize, invoke: u64, complete: u64) {
        for (i, d) in data.chunks(block_size).enumerate() {
            let block = first + i as u64;
            match decode(d, block) {
                Ok(v) => self.push(Op {
                    block,
                    kind: Kind::Read(v),
                    invoke,
                    complete: Some(complete),
                }),
                Err(e) => {
                    if let Ok(mut g) = self.garbage.lock() {
                        g.push(e);
                    }
                }
            }
        }
    }

    pub fn read_failed(&self) {
        self.failed_reads.fetch_add(1, Ordering::Relaxed);
    }

    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().map(|o| o.clone()).unwrap_or_default()
    }

    pub fn summary(&self) -> Summary {
        let ops = self.ops();
        let mut s = Summary {
            failed_reads: self.failed_reads.load(Ordering::Relaxed),
            ..Summary::default()
        };
        for o in &ops {
            match (o.kind, o.complete) {
                (Kind::Write(_), Some(_)) => s.writes_acked += 1,
                (Kind::Write(_), None) => s.writes_unknown += 1,
                (Kind::Read(_), _) => s.reads += 1,
            }
        }
        s
    }

    /// Checks the history: no read of data no write wrote, and a linearization of
    /// every block's operations. The error names the block and lists its operations.
    pub fn check(&self) -> Result<Summary, String> {
        if let Some(g) = self.garbage.lock().ok().and_then(|g| g.first().cloned()) {
            return Err(g);
        }
        let ops = self.ops();
        check(&ops).map_err(|v| {
            let mut mine: Vec<&Op> = ops.iter().filter(|o| o.block == v.block).collect();
            mine.sort_by_key(|o| o.invoke);
            let shown: Vec<String> = mine
                .iter()
                .map(|o| match o.kind {
                    Kind::Write(v) => format!("write {v:#x} {}..{:?}", o.invoke, o.complete),
                    Kind::Read(v) => format!("read {v:#x} {}..{:?}", o.invoke, o.complete),
                })
                .collect();
            format!("{v}; its operations: {shown:?}")
        })?;
        Ok(self.summary())
    }
}

/// One client's share of the load.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Operations touch blocks `0..blocks` (at least 2).
    pub blocks: u64,
    pub block_size: usize,
    /// Stop after this many operations (the simulation's bound), or at `stop`.
    pub max_ops: u64,
    /// A random pause of up to this long between operations.
    pub max_pause: Duration,
}

/// Writes (1 or 2 blocks, half the time) and reads until `stop` or `max_ops`. Client
/// `id`'s write values are `id << 32 | n`, unique across clients for `id` > 0.
pub async fn client_loop(
    c: &Client,
    id: u64,
    seed: u64,
    w: &Workload,
    h: &Recorder,
    stop: &AtomicBool,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (id << 40));
    let mut n = 0u64;
    let blocks = w.blocks.max(2);
    while !stop.load(Ordering::SeqCst) && n < w.max_ops {
        n += 1;
        let first = rng.random_range(0..blocks - 1);
        let count = rng.random_range(1..=2u64).min(blocks - first);
        if rng.random_bool(0.5) {
            let value = (id << 32) | n;
            let data: Vec<u8> = (first..first + count)
                .flat_map(|b| encode(value, b, w.block_size))
                .collect();
            let invoke = h.now();
            let r = c.write(first, &data).await;
            let complete = r.is_ok().then(|| h.now());
            h.write(first, count, value, invoke, complete);
        } else {
            let invoke = h.now();
            match c.read(first, count).await {
                Ok(data) => {
                    let complete = h.now();
                    h.read(first, &data, w.block_size, invoke, complete);
                }
                Err(_) => h.read_failed(),
            }
        }
        let pause = w.max_pause.as_millis() as u64;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..pause.max(1)))).await;
    }
}
