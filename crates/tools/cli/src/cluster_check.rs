//! `quiltfs cluster check ADDRESS`: a volume checked from outside. Clients write and
//! read the first blocks of the volume, every operation recorded; at the end every
//! block is read once more (waiting for the volume to serve again, so a heal after the
//! faults shows whether any acknowledged write was lost), and the history must be
//! linearizable. Run it while replicas are killed, partitioned, filled or damaged.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use quilt_gnothi::client::{Client, ClientConfig};
use quilt_gnothi::device::VolumeAddress;
use quilt_gnothi::workload::{self, Recorder, Workload};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct CheckArgs {
    /// The volume's address (gnothi://…).
    pub address: String,
    /// Blocks the clients use, from block 0. Their contents are overwritten.
    #[arg(long, default_value_t = 64)]
    pub blocks: u64,
    /// How long the clients run.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    /// Concurrent clients (1 to 64).
    #[arg(long, default_value_t = 4)]
    pub clients: u64,
    /// Seconds one operation keeps retrying before it counts as failed (a write's
    /// outcome then unknown).
    #[arg(long, default_value_t = 10)]
    pub op_timeout: u64,
    /// Seconds the final read waits for the volume to serve.
    #[arg(long, default_value_t = 120)]
    pub final_wait: u64,
    /// Up to this many milliseconds between one client's operations.
    #[arg(long, default_value_t = 20)]
    pub pause_ms: u64,
    /// Seconds to wait after the load before the final read (for faults meant to
    /// strike when nothing is being written).
    #[arg(long, default_value_t = 0)]
    pub hold: u64,
    /// The control of the fault tests, never for use: the clients acknowledge writes
    /// after one copy is stored. A check must catch it.
    #[arg(long, hide = true)]
    pub unsafe_claim_copies: bool,
    /// Consent to overwriting blocks 0..BLOCKS of the volume.
    #[arg(long)]
    pub overwrite: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: CheckArgs) -> Result<()> {
    if !a.overwrite {
        bail!(
            "cluster check overwrites blocks 0..{} of the volume; pass --overwrite to consent",
            a.blocks
        );
    }
    if !(1..=64).contains(&a.clients) {
        bail!("--clients must be 1 to 64, not {}", a.clients);
    }
    if a.blocks < 2 {
        bail!("--blocks must be at least 2");
    }
    let address = VolumeAddress::parse(&a.address).map_err(|e| anyhow!(e))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(check(a, address))
}

async fn check(a: CheckArgs, address: VolumeAddress) -> Result<()> {
    let config = ClientConfig {
        op_timeout: Duration::from_secs(a.op_timeout),
        unsafe_claim_copies: a.unsafe_claim_copies,
        ..ClientConfig::default()
    };
    // Write values are `id << 32 | n`: ids of this run, unique among the volume's
    // clients (the process and the time), never 0 (the value of an unwritten block).
    let base = (u64::from(std::process::id()) << 16
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64))
        & 0xffff_ff00;
    let base = if base == 0 { 0x100 } else { base };
    let setup = address
        .connect(base, config.clone())
        .await
        .map_err(|e| anyhow!("cannot reach the volume {}: {e}", a.address))?;
    let g = *setup.geometry();
    if a.blocks > g.blocks {
        bail!(
            "--blocks {} is more than the volume's {}",
            a.blocks,
            g.blocks
        );
    }
    let bs = g.block_size as usize;
    let h = Arc::new(Recorder::wall_clock());
    // Every block first gets a value of this run: what a previous user left there is
    // no write of this history.
    for b in 0..a.blocks {
        let invoke = h.now();
        setup
            .write(b, &workload::encode(base << 32 | 1, b, bs))
            .await
            .map_err(|e| anyhow!("writing the first value of block {b}: {e}"))?;
        let complete = h.now();
        h.write(b, 1, base << 32 | 1, invoke, Some(complete));
    }
    let w = Workload {
        blocks: a.blocks,
        block_size: bs,
        max_ops: u64::MAX,
        max_pause: Duration::from_millis(a.pause_ms),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 1..=a.clients {
        let c: Client = address
            .connect(base + i, config.clone())
            .await
            .map_err(|e| anyhow!("client {i}: {e}"))?;
        let (w, h, stop) = (w.clone(), h.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            workload::client_loop(&c, base + i, base, &w, &h, &stop).await;
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.context("a client task failed")?;
    }
    let load = started.elapsed();
    if a.hold > 0 {
        eprintln!("quiltfs: load done; the final read in {} s", a.hold);
        tokio::time::sleep(Duration::from_secs(a.hold)).await;
    }
    // The final read: whatever the faults were, once the volume serves again every
    // block must hold its last acknowledged write (or a later unknown one).
    let deadline = Instant::now() + Duration::from_secs(a.final_wait);
    let mut first = 0;
    while first < a.blocks {
        let n = 64.min(a.blocks - first);
        let invoke = h.now();
        match setup.read(first, n).await {
            Ok(data) => {
                let complete = h.now();
                h.read(first, &data, bs, invoke, complete);
                first += n;
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("final read of {first}+{n}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => bail!(
                "the final read of blocks {first}..{} failed for {} s: {e}",
                first + n,
                a.final_wait
            ),
        }
    }
    let verdict = h.check();
    let s = h.summary();
    let ok = verdict.is_ok();
    // What every replica holds of the block that failed, to tell a table that lost
    // an acknowledged write from a copy served against a stale one.
    let views = if ok {
        Vec::new()
    } else {
        views_of_violation(&setup, &h).await
    };
    for v in &views {
        eprintln!("quiltfs: {v}");
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "linearizable": ok,
                "violation": verdict.as_ref().err(),
                "seconds": load.as_secs_f64(),
                "clients": a.clients,
                "blocks": a.blocks,
                "writes_acked": s.writes_acked,
                "writes_unknown": s.writes_unknown,
                "reads": s.reads,
                "failed_reads": s.failed_reads,
                "replica_views": views,
            })
        );
    } else {
        println!(
            "{} clients, {:.1} s: {} block writes acknowledged, {} unknown, {} block reads, {} failed reads; {}",
            a.clients,
            load.as_secs_f64(),
            s.writes_acked,
            s.writes_unknown,
            s.reads,
            s.failed_reads,
            if ok { "linearizable" } else { "NOT linearizable" }
        );
    }
    match verdict {
        Ok(_) => Ok(()),
        Err(e) => bail!("the history is not linearizable: {e}"),
    }
}

/// Each replica's view of the first block without a linearization: its table's entry
/// and what its copies hold.
async fn views_of_violation(c: &Client, h: &Recorder) -> Vec<String> {
    let Err(v) = quilt_gnothi::history::check(&h.ops()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for r in 0..c.geometry().replicas() {
        out.push(match c.inspect(r, v.block).await {
            Ok(b) => format!("block {}: {b}", v.block),
            Err(e) => format!("block {}: replica {r}: no view: {e}", v.block),
        });
    }
    out
}
