//! The client load: requests of one size, sequential or random over the volume, kept
//! `depth` at a time, for a while or until told to stop; completed bytes counted per
//! tick, so a run gives both its steady throughput and a timeline.

use quilt_gnothi::client::Client;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    SeqWrite,
    RandWrite,
    SeqRead,
    RandRead,
}

impl Workload {
    pub const ALL: [Workload; 4] = [
        Workload::SeqWrite,
        Workload::RandWrite,
        Workload::SeqRead,
        Workload::RandRead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::SeqWrite => "seqwrite",
            Workload::RandWrite => "randwrite",
            Workload::SeqRead => "seqread",
            Workload::RandRead => "randread",
        }
    }

    pub fn parse(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name() == s)
    }

    fn writes(self) -> bool {
        matches!(self, Workload::SeqWrite | Workload::RandWrite)
    }

    fn random(self) -> bool {
        matches!(self, Workload::RandWrite | Workload::RandRead)
    }
}

/// A load to drive.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub workload: Workload,
    /// Bytes per request.
    pub request: usize,
    /// Requests outstanding.
    pub depth: usize,
    /// How long; a stop flag may end it sooner.
    pub duration: Duration,
    pub seed: u64,
}

/// What a load did.
#[derive(Debug, Clone, Default)]
pub struct Done {
    /// Bytes completed in each tick of [`TICK`] from the start.
    pub ticks: Vec<u64>,
    pub errors: u64,
    /// Requests completed within the run.
    pub requests: u64,
    /// The first error, for the report.
    pub first_error: Option<String>,
}

pub const TICK: Duration = Duration::from_millis(250);

impl Done {
    /// MB/s (10^6 bytes) over the ticks from `skip` (a fraction of the run) to the end:
    /// the steady throughput, as the paper takes the last 80% of requests.
    pub fn steady_mb_per_s(&self, skip: f64) -> f64 {
        let n = self.ticks.len();
        let from = ((n as f64) * skip).floor() as usize;
        let span = (n - from.min(n)) as f64 * TICK.as_secs_f64();
        if span <= 0.0 {
            return 0.0;
        }
        self.ticks[from.min(n)..].iter().sum::<u64>() as f64 / span / 1e6
    }

    /// (seconds from the start, MB/s) per `every` ticks.
    pub fn timeline(&self, every: usize) -> Vec<(f64, f64)> {
        let every = every.max(1);
        self.ticks
            .chunks(every)
            .enumerate()
            .map(|(i, c)| {
                let secs = c.len() as f64 * TICK.as_secs_f64();
                (
                    (i * every) as f64 * TICK.as_secs_f64(),
                    c.iter().sum::<u64>() as f64 / secs / 1e6,
                )
            })
            .collect()
    }
}

/// Drives `load` on `client` until its duration passes or `stop` is set.
pub async fn drive(client: Arc<Client>, load: Load, stop: Arc<AtomicBool>) -> Done {
    let g = *client.geometry();
    let bs = g.block_size as usize;
    let per = (load.request / bs).max(1) as u64;
    let slots = (g.blocks / per).max(1);
    let start = Instant::now();
    let end = start + load.duration;
    let nticks = (load.duration.as_millis() / TICK.as_millis()).max(1) as usize + 1;
    let ticks: Arc<Vec<AtomicU64>> = Arc::new((0..nticks).map(|_| AtomicU64::new(0)).collect());
    let cursor = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let mut tasks = Vec::new();
    for lane in 0..load.depth.max(1) {
        let client = client.clone();
        let (ticks, cursor, errors, first_error, stop, requests) = (
            ticks.clone(),
            cursor.clone(),
            errors.clone(),
            first_error.clone(),
            stop.clone(),
            requests.clone(),
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(load.seed ^ (lane as u64) << 32);
        let mut data = vec![0u8; per as usize * bs];
        rng.fill(&mut data[..]);
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end && !stop.load(Ordering::Relaxed) {
                let slot = if load.workload.random() {
                    rng.random_range(0..slots)
                } else {
                    cursor.fetch_add(1, Ordering::Relaxed) % slots
                };
                let first = slot * per;
                // Each write's content differs (its first bytes), as real data does.
                data[..8].copy_from_slice(&rng.random::<u64>().to_le_bytes());
                let r = if load.workload.writes() {
                    client.write(first, &data).await.map(drop)
                } else {
                    client.read(first, per).await.map(drop)
                };
                let now = Instant::now();
                match r {
                    Ok(()) if now <= end => {
                        let t = ((now - start).as_millis() / TICK.as_millis()) as usize;
                        requests.fetch_add(1, Ordering::Relaxed);
                        if let Some(c) = ticks.get(t) {
                            c.fetch_add(data.len() as u64, Ordering::Relaxed);
                        }
                    }
                    Ok(()) => {}
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        first_error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert_with(|| e.to_string());
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        }));
    }
    // A request that hangs past the end is not waited for long: its lane is stopped.
    let grace = tokio::time::sleep_until(end + Duration::from_secs(2));
    tokio::pin!(grace);
    for t in &mut tasks {
        tokio::select! {
            _ = &mut grace => break,
            _ = t => {}
        }
    }
    for t in &tasks {
        t.abort();
    }
    let elapsed = (Instant::now() - start).min(load.duration);
    let first_error = first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    let used = ((elapsed.as_millis() / TICK.as_millis()) as usize).clamp(1, nticks);
    Done {
        ticks: ticks[..used]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect(),
        errors: errors.load(Ordering::Relaxed),
        requests: requests.load(Ordering::Relaxed),
        first_error,
    }
}

/// Writes the whole volume once, sequentially in 1 MiB requests, 4 at a time (so that
/// reads find data, as on a disk in use).
pub async fn fill(client: Arc<Client>) -> Result<(), String> {
    let g = *client.geometry();
    let per = ((1u64 << 20) / u64::from(g.block_size)).max(1);
    let next = Arc::new(AtomicU64::new(0));
    let mut lanes: Vec<tokio::task::JoinHandle<Result<(), String>>> = Vec::new();
    for lane in 0..4u64 {
        let (client, next) = (client.clone(), next.clone());
        lanes.push(tokio::spawn(async move {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(lane);
            let mut data = vec![0u8; (per * u64::from(g.block_size)) as usize];
            rng.fill(&mut data[..]);
            loop {
                let first = next.fetch_add(per, Ordering::Relaxed);
                if first >= g.blocks {
                    return Ok(());
                }
                let n = per.min(g.blocks - first);
                let bytes = (n * u64::from(g.block_size)) as usize;
                client
                    .write(first, &data[..bytes])
                    .await
                    .map_err(|e| format!("filling blocks {first}+{n}: {e}"))?;
            }
        }));
    }
    for l in lanes {
        l.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}
