//! `quiltfs bench featherstitch`: the Featherstitch paper's evaluation (untar, delete,
//! PostMark, an Andrew-like build; the patch optimization table) regenerated on this
//! machine, with quiltfs's modes and the systems a user would pick instead (kernel ext2,
//! ext3, ext4 on loop devices, fuse2fs) measured in the same run.
//!
//! Each system gets a fresh image on its own loop device per run. The workloads run in
//! order on it (untar; unmount, mount, delete; PostMark; Andrew), each on a fresh mount
//! with the page cache dropped, and each timed until its data is durable and the file
//! system unmounted: the workload, a sync, and the unmount (which for a FUSE server
//! lasts until the server has written everything back and exited). Runs are interleaved
//! across systems so that drift on a shared machine spreads over all of them.

mod plot;
mod report;
mod systems;
mod workloads;

use crate::{drop_caches, loop_stat, sh};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use systems::{Disk, Mounted, System, SYSTEMS};
use workloads::{Inputs, Workload};

#[derive(clap::Args)]
pub struct FeatherstitchArgs {
    /// Scaled-down inputs and one run: a few minutes in all.
    #[arg(long)]
    pub quick: bool,
    /// Runs of each system (interleaved); default 3, or 1 with --quick.
    #[arg(long)]
    pub runs: Option<usize>,
    /// Where results.json, results.csv, report.md and the PNG plots go.
    #[arg(long, default_value = "featherstitch-results")]
    pub out: PathBuf,
    /// Comma-separated systems (default: all). quiltfs: quilt-su, quilt-meta, quilt-full,
    /// quilt-async and their -unsafe twins, quilt-su-wbcache (kernel writeback cache),
    /// quilt-su-dev (over /dev/fuse, not io_uring), quilt-su-handoff and
    /// quilt-su-nohandoff (io_uring handing the CPU to the caller at every answer, and
    /// never; the default does while callers ping-pong between CPUs); the optimization
    /// table's
    /// quilt-su-opt-none, -opt-hard, -opt-merge; kernel: ext2, ext3-writeback,
    /// ext3-journal, ext4; FUSE peers: fuse2fs, passthrough (libfuse's passthrough_hp
    /// over ext4: the floor), passthrough-kernel (the same with FUSE passthrough), bindfs.
    #[arg(long)]
    pub systems: Option<String>,
    /// Comma-separated workloads: untar, delete, postmark, andrew (default: all).
    #[arg(long)]
    pub workloads: Option<String>,
    /// Working directory for images and inputs (a local disk; keeps the decompressed
    /// tarball between invocations).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-featherstitch")]
    pub work: PathBuf,
    /// Image size in MiB (default: 4096, or 1024 with --quick).
    #[arg(long)]
    pub image_mib: Option<u64>,
}

/// One timed workload on one system.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub system: &'static str,
    pub workload: Workload,
    pub run: usize,
    /// Workload, sync and unmount: until the data is durable and the server gone.
    pub wall_s: f64,
    pub work_s: f64,
    pub sync_s: f64,
    pub umount_s: f64,
    /// The workload's processes (tar, rm, postmark, the build), with their children.
    pub client_user_s: f64,
    pub client_sys_s: f64,
    /// The file system's own process: the FUSE server, or the kernel's jbd2 thread.
    pub fs_user_s: f64,
    pub fs_sys_s: f64,
    pub device_writes: u64,
    pub device_flushes: u64,
    /// quiltfs's patch engine counters over the workload and sync.
    pub patches_created: Option<u64>,
    pub undo_bytes: Option<u64>,
    pub patches_merged: Option<u64>,
    pub patches_made_hard: Option<u64>,
    pub patches_rolled_back: Option<u64>,
    /// Peak RSS of the FUSE server over the phase (it is started per phase), MiB.
    pub server_peak_rss_mib: Option<f64>,
    /// FUSE requests the quiltfs server answered over the workload and sync, by type.
    pub requests: Option<std::collections::BTreeMap<String, u64>>,
    /// Whether the quiltfs server answered over io_uring (None for other systems).
    #[serde(default)]
    pub io_uring: Option<bool>,
}

impl Sample {
    pub fn user_s(&self) -> f64 {
        self.client_user_s + self.fs_user_s
    }
    pub fn sys_s(&self) -> f64 {
        self.client_sys_s + self.fs_sys_s
    }
    pub fn cpu_s(&self) -> f64 {
        self.user_s() + self.sys_s()
    }
}

fn ensure_prerequisites(systems: &[System], workloads: &[Workload]) -> Result<()> {
    crate::require_root("bench featherstitch")?;
    let mut pkgs = vec!["e2fsprogs", "fonts-dejavu-core", "xz-utils", "make", "gcc"];
    if systems.iter().any(|s| s.name == "fuse2fs") {
        pkgs.push("fuse2fs");
    }
    if systems.iter().any(|s| s.name == "bindfs") {
        pkgs.push("bindfs");
    }
    if workloads.contains(&Workload::Postmark) {
        pkgs.push("postmark");
    }
    crate::apt_install(&pkgs)?;
    crate::systems::prepare_floor(systems)?;
    for tool in ["losetup", "mount", "umount", "e2fsck", "tar"] {
        if !crate::have(tool) {
            bail!("bench featherstitch needs {tool}");
        }
    }
    crate::enable_fuse_uring();
    Ok(())
}

fn select<T: Copy>(
    list: &Option<String>,
    all: &[T],
    parse: impl Fn(&str) -> Result<T>,
) -> Result<Vec<T>> {
    match list {
        None => Ok(all.to_vec()),
        Some(l) => l
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| parse(s.trim()))
            .collect(),
    }
}

pub fn run(a: FeatherstitchArgs) -> Result<()> {
    let systems = select(&a.systems, SYSTEMS, systems::by_name)?;
    let chosen = select(&a.workloads, &workloads::ALL, Workload::parse)?;
    if systems.is_empty() || chosen.is_empty() {
        bail!("nothing to run: no systems or no workloads selected");
    }
    let runs = a.runs.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    let image_mib = a.image_mib.unwrap_or(if a.quick { 1024 } else { 4096 });
    ensure_prerequisites(&systems, &chosen)?;
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    let inputs = workloads::prepare(&a.work, a.quick)?;
    // Delete removes what untar made: with delete chosen alone, untar still runs, untimed.
    let mut phases: Vec<(Workload, bool)> = Vec::new();
    for w in workloads::ALL {
        if chosen.contains(&w) {
            phases.push((w, true));
        } else if w == Workload::Untar && chosen.contains(&Workload::Delete) {
            phases.push((w, false));
        }
    }
    crate::catch_interrupts();
    eprintln!(
        "bench: {} systems × {} workloads × {runs} run(s); inputs: {} ({} entries), {} ({} files); \
         results go to {}",
        systems.len(),
        chosen.len(),
        inputs.tarball.display(),
        inputs.tarball_entries,
        inputs.source.display(),
        inputs.source_files,
        a.out.display()
    );
    let mut bar = crate::Progress::new((systems.len() * runs * phases.len()) as u64, "steps");
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    for run in 0..runs {
        for sys in &systems {
            let got = one_system(sys, run, &phases, &inputs, &a.work, image_mib, &mut bar)
                .with_context(|| format!("{} run {}", sys.name, run + 1));
            match got {
                Ok(s) => samples.extend(s),
                Err(e) if sys.may_fail() && !crate::interrupted() => {
                    eprintln!("bench: {e:#}; going on without it");
                    failed.push(format!("{e:#}"));
                }
                Err(e) => {
                    bar.finish();
                    if crate::interrupted() {
                        bail!(
                            "interrupted: everything this run set up was unmounted, detached and removed"
                        );
                    }
                    return Err(e);
                }
            }
        }
    }
    bar.finish();
    // A Ctrl-C that came during the last phase's teardown (its programs had ended) is
    // still an interruption: no report, and a failed exit.
    if crate::interrupted() {
        bail!("interrupted: everything this run set up was unmounted, detached and removed");
    }
    let meta = report::Meta::gather(&inputs, a.quick, runs, image_mib, started.elapsed());
    let mut md = report::markdown(&meta, &systems, &chosen, &samples);
    if !failed.is_empty() {
        md.push_str("\n## Not measured\n\nPeers that failed (their phases of that run are missing above):\n\n");
        for f in &failed {
            md.push_str(&format!("- {}\n", f.replace('\n', " ")));
        }
    }
    print!("{md}");
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    std::fs::write(a.out.join("report.md"), &md)?;
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "meta": meta,
            "systems": systems.iter().map(|s| serde_json::json!({
                "name": s.name, "what": s.what, "safe": s.safe, "opt": s.opt,
            })).collect::<Vec<_>>(),
            "samples": samples,
            "failed": failed,
        }))?,
    )?;
    std::fs::write(a.out.join("results.csv"), crate::csv(&samples)?)?;
    let plots = plot::all(&a.out, &systems, &chosen, &samples)?;
    println!(
        "results in {}: report.md, results.json, results.csv{}",
        a.out.display(),
        plots.iter().map(|p| format!(", {p}")).collect::<String>()
    );
    Ok(())
}

/// One run of every phase on one system, on a fresh image.
fn one_system(
    sys: &System,
    run: usize,
    phases: &[(Workload, bool)],
    inputs: &Inputs,
    work: &Path,
    image_mib: u64,
    bar: &mut crate::Progress,
) -> Result<Vec<Sample>> {
    let mut disk = Disk::create(sys, work, image_mib)?;
    let mnt = work.join(format!("{}.mnt", sys.name));
    let mut out = Vec::new();
    for &(w, timed) in phases {
        if crate::interrupted() {
            bail!("interrupted");
        }
        bar.step(format!("{} on {} (run {})", w.name(), sys.name, run + 1));
        let s = one_phase(sys, run, w, inputs, &disk, &mnt, work)
            .with_context(|| format!("{} on {}", w.name(), sys.name))?;
        if timed {
            out.push(s);
        }
        bar.inc();
    }
    let _ = std::fs::remove_dir(&mnt);
    // Every system must leave a consistent file system after a clean unmount.
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&disk.image)
        .output()?;
    if !fsck.status.success() {
        disk.keep = true;
        bail!(
            "e2fsck -fn found problems after the run (image kept as {}):\n{}",
            disk.image.display(),
            String::from_utf8_lossy(&fsck.stdout)
        );
    }
    Ok(out)
}

fn one_phase(
    sys: &System,
    run: usize,
    w: Workload,
    inputs: &Inputs,
    disk: &Disk,
    mnt: &Path,
    work: &Path,
) -> Result<Sample> {
    let log = work.join(format!("{}.server.log", sys.name));
    let m = Mounted::mount(sys, disk, mnt, &log)?;
    drop_caches()?;
    inputs.before(w, mnt, work)?;
    let stats0 = m.counters()?;
    let (w0, f0) = loop_stat(&disk.dev)?;
    let (fu0, fs0) = m.fs_cpu();
    let errlog = work.join("workload.err");
    let (work_s, client) = workloads::run_timed(inputs.command(w, mnt, work), &errlog)?;
    let t = Instant::now();
    m.sync()?;
    let sync_s = t.elapsed().as_secs_f64();
    let stats1 = m.counters()?;
    // Kernel threads exist only while mounted: read them before the unmount.
    let (fu1, fs1) = m.fs_cpu();
    let t = Instant::now();
    let un = m.unmount()?;
    let umount_s = t.elapsed().as_secs_f64();
    let (w1, f1) = loop_stat(&disk.dev)?;
    let (fs_user_s, fs_sys_s) = match &un.server {
        Some(r) => (r.user - fu0, r.sys - fs0),
        None => (fu1 - fu0, fs1 - fs0),
    };
    let delta = |k: &str| -> Option<u64> {
        let (a, b) = (stats0.as_ref()?, stats1.as_ref()?);
        Some(b.get(k)?.as_u64()?.saturating_sub(a.get(k)?.as_u64()?))
    };
    Ok(Sample {
        system: sys.name,
        workload: w,
        run,
        wall_s: work_s + sync_s + umount_s,
        work_s,
        sync_s,
        umount_s,
        client_user_s: client.user,
        client_sys_s: client.sys,
        fs_user_s: fs_user_s.max(0.0),
        fs_sys_s: fs_sys_s.max(0.0),
        device_writes: w1.saturating_sub(w0),
        device_flushes: f1.saturating_sub(f0),
        patches_created: delta("patch.patches_created"),
        undo_bytes: delta("patch.undo_bytes_total"),
        patches_merged: delta("patch.patches_merged"),
        patches_made_hard: delta("patch.patches_made_hard"),
        patches_rolled_back: delta("patch.patches_rolled_back"),
        server_peak_rss_mib: un.server.as_ref().map(|r| r.peak_rss_mib),
        requests: crate::request_counts(stats0.as_ref(), stats1.as_ref()),
        io_uring: stats1
            .as_ref()
            .and_then(|j| j.get("fuse.io_uring"))
            .and_then(|v| v.as_u64())
            .map(|v| v == 1),
    })
}

/// For the report's header: what ran where.
pub fn machine() -> (String, String) {
    let kernel = sh(Command::new("uname").arg("-r"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    (kernel, cpu)
}
