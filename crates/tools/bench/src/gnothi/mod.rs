//! `quiltfs bench gnothi`: the evaluation of Gnothi (USENIX ATC 2012) regenerated on
//! one machine. Each system is a volume whose replicas run as processes (`quiltfs
//! cluster up`), talking gRPC over loopback; the client is this process.
//! - `gnothi`: data on the f+1 replicas of each slice's rotated preferred quorum;
//! - `gprime` (G′): the same code with data on all 2f+1 replicas (Gaios-like);
//! - `cheap-paxos`: data on the f+1 main replicas, the f auxiliaries only on failure;
//! - `local`: one replica, no replication (f = 0);
//! - `ceph-rbd`: Ceph RBD, a pool of size 3 on three OSDs of a one-machine cluster,
//!   driven by fio (plain files only: its OSDs are not on the modelled disks).
//!
//! With `--disks model` (the default) every replica's two devices behave as 7200 RPM
//! disks (the rotating-disk model, real time, write cache on), so runs are disk-bound
//! as the paper's were; `--disks plain` runs on plain files, where CPU and loopback are
//! the limit.
//!
//! Measured: sequential and random writes and reads at each request size, for f = 1
//! and f = 2 (MB/s over the last 80% of each run, as the paper takes the last 80% of
//! requests); bytes each replica's data device holds; and the catch-up timeline (a
//! replica killed under a random 1 MiB write load and restarted later: client
//! throughput per second with the kill, the restart, the end of Phase 1 and the end of
//! Phase 2 marked), at several recovery intervals for Gnothi and G′.

pub mod ceph;
mod cluster;
mod load;
mod report;

use crate::{interrupted, Progress};
use anyhow::{bail, Context, Result};
use cluster::{leader_index, LocalCluster, Shape};
use load::{Done, Load, Workload};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct GnothiArgs {
    /// Small volumes, short runs, f = 1 only, one run: a few minutes (what CI runs).
    #[arg(long)]
    pub quick: bool,
    /// Runs of each configuration (systems interleaved); default 3, 1 with --quick.
    #[arg(long)]
    pub runs: Option<usize>,
    /// Comma-separated systems (default all): gnothi, gprime, cheap-paxos, local, and
    /// with `--disks plain` ceph-rbd (its packages are installed when missing).
    #[arg(long)]
    pub systems: Option<String>,
    /// Comma-separated f values (default 1,2; 1 with --quick).
    #[arg(long)]
    pub f: Option<String>,
    /// Comma-separated workloads (default all): seqwrite, randwrite, seqread, randread.
    #[arg(long)]
    pub workloads: Option<String>,
    /// Comma-separated request sizes in KiB (default 4,64,1024; 4,1024 with --quick).
    #[arg(long)]
    pub sizes: Option<String>,
    /// Seconds per measurement (default 20; 3 with --quick).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Volume size in MiB (default 1024; 128 with --quick).
    #[arg(long)]
    pub size_mib: Option<u64>,
    /// What the replicas' devices are: `model` (7200 RPM disks, modelled) or `plain`.
    #[arg(long, default_value = "model")]
    pub disks: String,
    /// Skip the catch-up timelines.
    #[arg(long)]
    pub no_recovery: bool,
    /// Comma-separated recovery intervals (ms) for the catch-up sweep (default
    /// 10,100,400; 10 with --quick).
    #[arg(long)]
    pub intervals: Option<String>,
    /// First TCP port of the clusters (each uses as many as it has replicas).
    #[arg(long, default_value_t = 7600)]
    pub port: u16,
    /// Where results.json, results.csv, report.md and the PNG plots go.
    #[arg(long, default_value = "gnothi-results")]
    pub out: PathBuf,
    /// Working directory for the replicas' devices (a local disk).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-gnothi")]
    pub work: PathBuf,
}

pub const SYSTEMS: &[(&str, &str)] = &[
    ("gnothi", "Gnothi: data on f+1 of 2f+1, rotated"),
    ("gprime", "G′: data on all 2f+1 (Gaios-like)"),
    (
        "cheap-paxos",
        "Cheap Paxos: data on f+1 mains, f auxiliaries",
    ),
    ("local", "one disk, no replication"),
    (
        "ceph-rbd",
        "Ceph RBD: a pool of size 3 on three OSDs, fio's rbd engine (plain files, f = 1)",
    ),
];

struct Scale {
    runs: usize,
    f: &'static [u16],
    sizes_kib: &'static [usize],
    seconds: u64,
    size_mib: u64,
    /// Catch-up: seconds before the kill, seconds down, the most a recovery may take,
    /// seconds measured after it.
    before: u64,
    down: u64,
    cap: u64,
    tail: u64,
    intervals: &'static [u64],
}

const FULL: Scale = Scale {
    runs: 3,
    f: &[1, 2],
    sizes_kib: &[4, 64, 1024],
    seconds: 20,
    size_mib: 1024,
    before: 20,
    down: 30,
    cap: 400,
    tail: 10,
    intervals: &[10, 100, 400],
};

const QUICK: Scale = Scale {
    runs: 1,
    f: &[1],
    sizes_kib: &[4, 1024],
    seconds: 3,
    size_mib: 128,
    before: 3,
    down: 4,
    cap: 60,
    tail: 2,
    intervals: &[10],
};

/// One measurement: a CSV row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub system: String,
    /// randwrite, randread, seqwrite, seqread, or catchup (a recovery run).
    pub workload: String,
    pub block_size: usize,
    pub f: u16,
    pub run: usize,
    /// Client throughput: steady (last 80%) for the I/O runs; during recovery (from the
    /// restart to the end of Phase 2, or to the cap) for catch-up runs.
    pub mb_per_s: f64,
    pub disks: String,
    pub depth: usize,
    pub errors: u64,
    /// Catch-up runs only.
    pub recovery_interval_ms: Option<u64>,
    pub before_mb_per_s: Option<f64>,
    pub phase1_s: Option<f64>,
    pub recovery_s: Option<f64>,
    pub caught_up: Option<bool>,
    pub missed_entries: Option<u64>,
    /// Phase 1 runs only: the client writes acknowledged while the replica was down,
    /// and the time the same restart took with nothing missed.
    pub missed_writes: Option<u64>,
    pub phase1_baseline_s: Option<f64>,
    /// Requests completed, and the device requests the replicas served meanwhile
    /// (summed over replicas; I/O runs only): where the time goes.
    pub requests: u64,
    pub log_flushes: u64,
    pub log_writes: u64,
    pub data_flushes: u64,
    pub data_writes: u64,
    pub data_reads: u64,
}

impl Row {
    /// An I/O run's row, its measurements zero until set.
    fn io(
        system: &str,
        w: Workload,
        request: usize,
        f: u16,
        run: usize,
        disks: &str,
        depth: usize,
    ) -> Row {
        Row {
            system: system.into(),
            workload: w.name().into(),
            block_size: request,
            f,
            run,
            mb_per_s: 0.0,
            disks: disks.into(),
            depth,
            errors: 0,
            recovery_interval_ms: None,
            before_mb_per_s: None,
            phase1_s: None,
            recovery_s: None,
            caught_up: None,
            missed_entries: None,
            missed_writes: None,
            phase1_baseline_s: None,
            requests: 0,
            log_flushes: 0,
            log_writes: 0,
            data_flushes: 0,
            data_writes: 0,
            data_reads: 0,
        }
    }
}

/// Bytes on each replica's data device after a system's I/O runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stored {
    pub system: String,
    pub f: u16,
    pub run: usize,
    pub replica: u16,
    pub home_bytes: u64,
    pub volume_bytes: u64,
    pub reserve_used_blocks: u64,
}

/// A catch-up run's client throughput over time, and its events.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Timeline {
    pub system: String,
    /// `catchup` or `rereplication`.
    pub workload: String,
    pub recovery_interval_ms: u64,
    pub run: usize,
    /// (seconds, MB/s), one point a second.
    pub points: Vec<(f64, f64)>,
    /// (what, seconds): killed, restarted, phase 1 done, phase 2 done.
    pub events: Vec<(String, f64)>,
}

fn list<T>(
    arg: &Option<String>,
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<Vec<T>>> {
    let Some(s) = arg else { return Ok(None) };
    let mut v = Vec::new();
    for x in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        match parse(x) {
            Some(t) => v.push(t),
            None => bail!("--{what}: '{x}' is not understood"),
        }
    }
    if v.is_empty() {
        bail!("--{what} names nothing");
    }
    Ok(Some(v))
}

/// Requests outstanding: enough to keep every replica's disks busy (the paper used
/// hundreds to thousands; small requests need the most).
fn depth_for(request: usize) -> usize {
    match request {
        r if r <= 16 << 10 => 256,
        r if r <= 256 << 10 => 64,
        _ => 24,
    }
}

pub fn run(a: GnothiArgs) -> Result<()> {
    crate::catch_interrupts();
    let scale = if a.quick { QUICK } else { FULL };
    let runs = a.runs.unwrap_or(scale.runs).max(1);
    let model_disks = match a.disks.as_str() {
        "model" => true,
        "plain" => false,
        d => bail!("--disks: '{d}' is neither model nor plain"),
    };
    let systems: Vec<&'static str> = list(&a.systems, "systems", |s| {
        SYSTEMS.iter().find(|x| x.0 == s).map(|x| x.0)
    })?
    .unwrap_or_else(|| {
        SYSTEMS
            .iter()
            .map(|x| x.0)
            .filter(|s| *s != "ceph-rbd" || !model_disks)
            .collect()
    });
    if systems.contains(&"ceph-rbd") {
        if model_disks {
            bail!("ceph-rbd runs only with --disks plain (its OSDs cannot use the modelled disks)");
        }
        crate::apt_install(ceph::PACKAGES)?;
        ceph::Ceph::check_tools()?;
    }
    let fs: Vec<u16> = list(&a.f, "f", |s| {
        s.parse().ok().filter(|f| (1..=3).contains(f))
    })?
    .unwrap_or_else(|| scale.f.to_vec());
    let workloads: Vec<Workload> =
        list(&a.workloads, "workloads", Workload::parse)?.unwrap_or_else(|| Workload::ALL.to_vec());
    let sizes: Vec<usize> = list(&a.sizes, "sizes", |s| {
        s.parse::<usize>()
            .ok()
            .filter(|k| k.is_power_of_two() && (4..=1024).contains(k))
    })?
    .unwrap_or_else(|| scale.sizes_kib.to_vec())
    .into_iter()
    .map(|k| k << 10)
    .collect();
    let intervals: Vec<u64> = list(&a.intervals, "intervals", |s| s.parse().ok())?
        .unwrap_or_else(|| scale.intervals.to_vec());
    let seconds = a.seconds.unwrap_or(scale.seconds).max(1);
    let size_mib = a.size_mib.unwrap_or(scale.size_mib).max(16);
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    // (system, f) pairs: local once, at f = 0; Ceph's pool of size 3 is f = 1.
    let mut configs: Vec<(&'static str, u16)> = Vec::new();
    for &f in &fs {
        for &s in &systems {
            if s != "local" && (s != "ceph-rbd" || f == 1) {
                configs.push((s, f));
            }
        }
    }
    if systems.contains(&"local") {
        configs.push(("local", 0));
    }
    let recovery_systems: Vec<&'static str> = if a.no_recovery {
        Vec::new()
    } else {
        systems
            .iter()
            .copied()
            .filter(|s| matches!(*s, "gnothi" | "gprime"))
            .collect()
    };
    let recovery_runs = if intervals.is_empty() {
        0
    } else {
        intervals.len() + 1
    };
    // Phase 1's speed is measured on Gnothi alone (G′ catches up its metadata the same way).
    let phase1_runs = usize::from(recovery_runs > 0 && recovery_systems.contains(&"gnothi"));
    let steps = runs * (configs.len() + recovery_systems.len() * recovery_runs + phase1_runs);
    let mut progress = Progress::new(steps as u64, "clusters");
    let mut rows = Vec::new();
    let mut stored = Vec::new();
    let mut timelines = Vec::new();
    let disks = a.disks.clone();
    let t0 = Instant::now();
    let mut client_id = u64::from(std::process::id()) << 24;
    for run in 0..runs {
        // A different order each run: drift spreads over the systems.
        for k in 0..configs.len() {
            let (system, f) = configs[(k + run) % configs.len()];
            progress.step(format!(
                "{system} f={f}: fill, then I/O runs (run {})",
                run + 1
            ));
            if system == "ceph-rbd" {
                let dir = a.work.join("ceph-rbd");
                let peer = ceph::Ceph::up(&dir, size_mib, a.port)
                    .context("bringing up a one-machine Ceph cluster")?;
                peer.fill()?;
                for &request in &sizes {
                    for &w in &workloads {
                        let depth = depth_for(request);
                        let m = peer.run(w, request, depth, seconds)?;
                        eprintln!(
                            "bench: ceph-rbd {} {} KiB: {:.2} MB/s",
                            w.name(),
                            request >> 10,
                            m.mb_per_s
                        );
                        rows.push(Row {
                            mb_per_s: m.mb_per_s,
                            errors: m.errors,
                            requests: m.requests,
                            ..Row::io(system, w, request, f, run, &disks, depth)
                        });
                        if interrupted() {
                            bail!("interrupted");
                        }
                    }
                }
                drop(peer);
                progress.inc();
                continue;
            }
            let shape = Shape {
                system,
                replicas: 2 * f + 1,
                size_mib,
                port: a.port,
                recovery_interval_ms: 10,
                model_disks,
            };
            let dir = a.work.join(format!("{system}-f{f}"));
            let cl = LocalCluster::up(&dir, &shape)?;
            client_id += 1;
            let client = cl.client(&rt, client_id)?;
            rt.block_on(load::fill(client.clone()))
                .map_err(|e| anyhow::anyhow!("{system} f={f}: {e}"))?;
            for &request in &sizes {
                for &w in &workloads {
                    let load = Load {
                        workload: w,
                        request,
                        depth: depth_for(request),
                        duration: Duration::from_secs(seconds),
                        seed: (run as u64) << 16 ^ request as u64,
                    };
                    let before = cl.status()?;
                    let done = rt.block_on(load::drive(
                        client.clone(),
                        load,
                        Arc::new(AtomicBool::new(false)),
                    ));
                    let io = cluster::io_between(&before, &cl.status()?);
                    let mb = done.steady_mb_per_s(0.2);
                    let ops = done.requests.max(1) as f64;
                    eprintln!(
                        "bench: {system} f={f} {} {} KiB: {mb:.2} MB/s{}; per request, summed over replicas: {:.2} log flushes, {:.2} log writes, {:.2} data flushes, {:.2} data writes, {:.2} data reads",
                        w.name(),
                        request >> 10,
                        errors_note(&done),
                        io[0] as f64 / ops,
                        io[1] as f64 / ops,
                        io[2] as f64 / ops,
                        io[3] as f64 / ops,
                        io[4] as f64 / ops,
                    );
                    rows.push(Row {
                        mb_per_s: mb,
                        errors: done.errors,
                        requests: done.requests,
                        log_flushes: io[0],
                        log_writes: io[1],
                        data_flushes: io[2],
                        data_writes: io[3],
                        data_reads: io[4],
                        ..Row::io(system, w, request, f, run, &disks, load.depth)
                    });
                    if interrupted() {
                        bail!("interrupted");
                    }
                }
            }
            let st = cl.status()?;
            for r in 0..cl.replicas {
                stored.push(Stored {
                    system: system.into(),
                    f,
                    run,
                    replica: r,
                    home_bytes: cl.home_bytes(r)?,
                    volume_bytes: size_mib << 20,
                    reserve_used_blocks: st
                        .get(r as usize)
                        .copied()
                        .flatten()
                        .map_or(0, |s| s.reserve_used),
                });
            }
            drop(client);
            drop(cl);
            progress.inc();
        }
        // Catch-up at every recovery interval, then re-replication (a replica's data
        // disk replaced by an empty one under load) at the first.
        let recoveries = intervals
            .iter()
            .map(|&i| (Recovery::CatchUp, i))
            .chain(intervals.first().map(|&i| (Recovery::Rereplicate, i)));
        for (kind, interval) in recoveries {
            for &system in &recovery_systems {
                let what = match kind {
                    Recovery::CatchUp => format!("catch-up, recovery interval {interval} ms"),
                    Recovery::Rereplicate => "re-replication".to_string(),
                };
                progress.step(format!("{system}: {what} (run {})", run + 1));
                let shape = Shape {
                    system,
                    replicas: 3,
                    size_mib,
                    port: a.port,
                    recovery_interval_ms: interval,
                    model_disks,
                };
                client_id += 1;
                let (row, tl) =
                    recovery(kind, &rt, &a.work, &shape, &scale, run, client_id, &disks)
                        .with_context(|| format!("{system}: {what}"))?;
                eprintln!(
                    "bench: {system} {what}: {:.2} MB/s while the replica recovers, {}",
                    row.mb_per_s,
                    match (row.caught_up, row.recovery_s) {
                        (Some(true), Some(s)) => format!("recovered in {s:.1} s"),
                        _ => "not recovered within the cap".into(),
                    }
                );
                rows.push(row);
                timelines.push(tl);
                progress.inc();
                if interrupted() {
                    bail!("interrupted");
                }
            }
        }
        if phase1_runs > 0 {
            progress.step(format!(
                "gnothi: Phase 1 after many small writes (run {})",
                run + 1
            ));
            let shape = Shape {
                system: "gnothi",
                replicas: 3,
                size_mib,
                port: a.port,
                recovery_interval_ms: intervals[0],
                model_disks,
            };
            client_id += 1;
            let row = phase1(&rt, &a.work, &shape, &scale, run, client_id, &disks)
                .context("gnothi: Phase 1")?;
            let per = |n: u64| n as f64 / row.requests.max(1) as f64;
            eprintln!(
                "bench: gnothi Phase 1: {} missed writes ({} entries, {:.2} MB/s; per write, summed over the replicas up: {:.2} log flushes, {:.2} log writes, {:.2} data flushes, {:.2} data writes) caught up in {}",
                row.missed_writes.unwrap_or(0),
                row.missed_entries.unwrap_or(0),
                row.mb_per_s,
                per(row.log_flushes),
                per(row.log_writes),
                per(row.data_flushes),
                per(row.data_writes),
                row.phase1_s
                    .map_or("– (not within the cap)".into(), |s| format!("{s:.2} s")),
            );
            eprintln!(
                "bench: gnothi Phase 1: the same restart with nothing missed took {}",
                row.phase1_baseline_s
                    .map_or("– (not within the cap)".into(), |s| format!("{s:.2} s")),
            );
            rows.push(row);
            progress.inc();
            if interrupted() {
                bail!("interrupted");
            }
        }
    }
    progress.finish();
    let meta = report::Meta {
        quick: a.quick,
        runs,
        seconds,
        size_mib,
        disks,
        elapsed_s: t0.elapsed().as_secs_f64(),
    };
    report::write(&a.out, &meta, &rows, &stored, &timelines)?;
    eprintln!("bench: results in {}", a.out.display());
    Ok(())
}

fn errors_note(d: &Done) -> String {
    match (&d.first_error, d.errors) {
        (Some(e), n) => format!(" ({n} errors; first: {e})"),
        _ => String::new(),
    }
}

/// Phase 1's load: the smallest writes, as many as the agreement takes, so that the
/// replica misses as many writes (and log entries) as the run allows.
const PHASE1_REQUEST: usize = 4 << 10;
const PHASE1_DEPTH: usize = 256;

/// Phase 1 alone, timed against the number of writes missed: a follower is killed
/// and restarted with nothing missed (the restart's own cost: the process's start,
/// reading its log and devices, rejoining), then killed again while the clients write
/// 4 KiB blocks for twice the catch-up's down time, and restarted after they stop (so
/// the target holds still). Phase 1 ends when it has applied the leader's log index.
fn phase1(
    rt: &tokio::runtime::Runtime,
    work: &std::path::Path,
    shape: &Shape,
    scale: &Scale,
    run: usize,
    client_id: u64,
    disks: &str,
) -> Result<Row> {
    let dir = work.join(format!("phase1-{}", shape.system));
    let cl = LocalCluster::up(&dir, shape)?;
    let client = cl.client(rt, client_id)?;
    let st = cl.status()?;
    let victim = a_follower(&st, cl.replicas)?;
    let deadline = Duration::from_secs(scale.cap);
    cl.kill(victim)?;
    let baseline = restart_until_applied(&cl, victim, deadline)?;
    let victim_index = cl.status()?[victim as usize].map_or(0, |s| s.log_index);
    cl.kill(victim)?;
    let before = cl.status()?;
    let load = Load {
        workload: Workload::RandWrite,
        request: PHASE1_REQUEST,
        depth: PHASE1_DEPTH,
        duration: Duration::from_secs(2 * scale.down),
        seed: run as u64,
    };
    let done = rt.block_on(load::drive(client, load, Arc::new(AtomicBool::new(false))));
    if interrupted() {
        bail!("interrupted");
    }
    let after = cl.status()?;
    // Where a write's time goes with a replica down (summed over the two left).
    let io = cluster::io_between(&before, &after);
    let target = leader_index(&after).context("no leader after the load")?;
    let phase1 = restart_until_applied(&cl, victim, deadline)?;
    let mb_per_s = done.steady_mb_per_s(0.0);
    Ok(Row {
        mb_per_s,
        errors: done.errors,
        requests: done.requests,
        phase1_s: phase1,
        phase1_baseline_s: baseline,
        caught_up: Some(phase1.is_some()),
        recovery_interval_ms: Some(shape.recovery_interval_ms),
        missed_entries: Some(target.saturating_sub(victim_index)),
        // Acknowledged within the run (a few more finish after it, uncounted).
        missed_writes: Some(done.requests),
        workload: "phase1".into(),
        log_flushes: io[0],
        log_writes: io[1],
        data_flushes: io[2],
        data_writes: io[3],
        data_reads: io[4],
        ..Row::io(
            shape.system,
            Workload::RandWrite,
            PHASE1_REQUEST,
            1,
            run,
            disks,
            PHASE1_DEPTH,
        )
    })
}

/// The highest-numbered replica up that does not lead: the one the recovery runs kill.
fn a_follower(st: &[Option<cluster::ReplicaStatus>], replicas: u16) -> Result<u16> {
    (0..replicas)
        .rev()
        .find(|&r| {
            st.get(r as usize)
                .copied()
                .flatten()
                .is_some_and(|s| !s.leader)
        })
        .context("no follower to kill")
}

/// Starts replica `r` and times it until it has applied the leader's log index as it
/// was at the start (`None`: not within `cap`).
fn restart_until_applied(cl: &LocalCluster, r: u16, cap: Duration) -> Result<Option<f64>> {
    let target = leader_index(&cl.status()?).context("no leader")?;
    let started = Instant::now();
    cl.start(r)?;
    while started.elapsed() < cap && !interrupted() {
        let st = cl.status()?;
        if st
            .get(r as usize)
            .copied()
            .flatten()
            .is_some_and(|v| v.applied >= target)
        {
            return Ok(Some(started.elapsed().as_secs_f64()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(None)
}

/// The catch-up load: random 1 MiB writes, so that the clients are disk-bound (as the
/// paper's were; 4 KiB writes are bound by agreement, the same for every system) and
/// the missed writes spread over every slice.
const CATCHUP_REQUEST: usize = 1 << 20;
const CATCHUP_DEPTH: usize = 8;

/// Which recovery a run measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recovery {
    /// A follower killed and restarted `down` seconds later, its disks as they were.
    CatchUp,
    /// A follower's data disk replaced by an empty one (`cluster replace-disk`): the
    /// volume is told, and the replica rebuilds every block of its preferred slices.
    Rereplicate,
}

/// The paper's recovery experiments, scaled down: a random 1 MiB write load; after
/// `before` seconds a follower is killed and restarted `down` seconds later (catch-up),
/// or gets an empty data disk at once (re-replication); its Phase 1 (metadata caught
/// up) and Phase 2 (no INCOMPLETE block left) timed.
#[allow(clippy::too_many_arguments)]
fn recovery(
    kind: Recovery,
    rt: &tokio::runtime::Runtime,
    work: &std::path::Path,
    shape: &Shape,
    scale: &Scale,
    run: usize,
    client_id: u64,
    disks: &str,
) -> Result<(Row, Timeline)> {
    let workload = match kind {
        Recovery::CatchUp => "catchup",
        Recovery::Rereplicate => "rereplication",
    };
    let dir = work.join(format!("{workload}-{}", shape.system));
    let cl = LocalCluster::up(&dir, shape)?;
    let client = cl.client(rt, client_id)?;
    let cap = Duration::from_secs(scale.before + scale.down + scale.cap + scale.tail);
    let load = Load {
        workload: Workload::RandWrite,
        request: CATCHUP_REQUEST,
        depth: CATCHUP_DEPTH,
        duration: cap,
        seed: run as u64,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let driving = rt.spawn(load::drive(client, load, stop.clone()));
    let at = |t: Instant| t.duration_since(started).as_secs_f64();
    let mut events = Vec::new();
    std::thread::sleep(Duration::from_secs(scale.before));
    let st = cl.status()?;
    let victim = a_follower(&st, cl.replicas)?;
    let victim_index = st[victim as usize].map_or(0, |s| s.log_index);
    let target = match kind {
        Recovery::CatchUp => {
            cl.kill(victim)?;
            events.push(("killed".to_string(), at(Instant::now())));
            std::thread::sleep(Duration::from_secs(scale.down));
            // What the victim missed: the leader's log index when it comes back.
            let target = leader_index(&cl.status()?).unwrap_or(0);
            cl.start(victim)?;
            target
        }
        Recovery::Rereplicate => {
            let target = leader_index(&cl.status()?).unwrap_or(0);
            events.push(("disk replaced".to_string(), at(Instant::now())));
            cl.replace_disk(victim)?;
            target
        }
    };
    let restarted = Instant::now();
    events.push(("restarted".to_string(), at(restarted)));
    let deadline = restarted + Duration::from_secs(scale.cap);
    let (mut phase1, mut phase2) = (None, None);
    while Instant::now() < deadline && !interrupted() {
        std::thread::sleep(Duration::from_millis(250));
        let st = cl.status()?;
        let Some(v) = st.get(victim as usize).copied().flatten() else {
            continue;
        };
        if phase1.is_none() && v.applied >= target {
            phase1 = Some(Instant::now());
            events.push(("phase 1 done".to_string(), at(Instant::now())));
        }
        if phase1.is_some() && v.incomplete == 0 {
            phase2 = Some(Instant::now());
            events.push(("phase 2 done".to_string(), at(Instant::now())));
            break;
        }
    }
    std::thread::sleep(Duration::from_secs(scale.tail));
    stop.store(true, Ordering::Relaxed);
    let done = rt.block_on(driving).context("the load task failed")?;
    drop(cl);
    let tick = load::TICK.as_secs_f64();
    let mb_between = |from: f64, to: f64| {
        let (a, b) = (
            (from / tick) as usize,
            ((to / tick) as usize).min(done.ticks.len()),
        );
        if b <= a {
            return 0.0;
        }
        done.ticks[a..b].iter().sum::<u64>() as f64 / ((b - a) as f64 * tick) / 1e6
    };
    let restart_s = at(restarted);
    let end_s = phase2.map_or(at(deadline), at);
    let kill_s = events[0].1;
    let per_second = (1.0 / tick).round() as usize;
    let row = Row {
        system: shape.system.into(),
        workload: workload.into(),
        block_size: CATCHUP_REQUEST,
        f: 1,
        run,
        mb_per_s: mb_between(restart_s, end_s),
        disks: disks.into(),
        depth: CATCHUP_DEPTH,
        errors: done.errors,
        recovery_interval_ms: Some(shape.recovery_interval_ms),
        before_mb_per_s: Some(mb_between(kill_s * 0.2, kill_s)),
        phase1_s: phase1.map(|t| t.duration_since(restarted).as_secs_f64()),
        recovery_s: phase2.map(|t| t.duration_since(restarted).as_secs_f64()),
        caught_up: Some(phase2.is_some()),
        missed_entries: Some(target.saturating_sub(victim_index)),
        missed_writes: None,
        phase1_baseline_s: None,
        requests: done.requests,
        log_flushes: 0,
        log_writes: 0,
        data_flushes: 0,
        data_writes: 0,
        data_reads: 0,
    };
    let tl = Timeline {
        system: shape.system.into(),
        workload: workload.into(),
        recovery_interval_ms: shape.recovery_interval_ms,
        run,
        points: done.timeline(per_second),
        events,
    };
    Ok((row, tl))
}
