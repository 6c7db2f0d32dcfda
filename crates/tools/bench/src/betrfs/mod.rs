//! `quiltfs bench betrfs`: the BetrFS papers' evaluation (sequential I/O, random 4-byte
//! writes, directory operations on the linux source, TokuBench, rename and clone
//! latencies) regenerated on this machine, with the systems a user would pick instead
//! measured in the same run: kernel ext4, xfs and btrfs on loop devices, fuse2fs, the
//! ext2 module in soft-updates mode, betrfs, and the FUSE floor (libfuse's
//! passthrough_hp over ext4, with and without FUSE passthrough; bindfs beside it).
//!
//! Each run gives every system fresh images, one per group of workloads:
//! - **data**: `seqwrite` (a large file in 40 KiB writes, then fsync), `seqread` (it read
//!   back in 40 KiB reads, cold), `randwrite` (256 Ki random 4-byte writes into it, then
//!   fsync, cold);
//! - **dirs**: `untar` of Debian's linux source, then `find`, `grep` (`grep -r`) and
//!   `rmrf` (`rm -rf`), each cold;
//! - **toku**: TokuBench, 200-byte files in a balanced tree of fanout 128, by 1 and by 4
//!   threads (`toku1`, `toku4`);
//! - **names**: `rename` of directories of 10 to 100,000 files and of the linux tree, and
//!   `clone` of the same (`quiltfs clone` on betrfs, `cp -r --reflink=always` where the
//!   kernel's file systems can) and of a 1 GiB file: latency of each call, back and
//!   forth; `seek`: SEEK_HOLE and SEEK_DATA on a 1 GiB file with a hole in its middle
//!   and one at its end (cold first), and the walk of its whole extent map;
//! - **native** (quiltfs's modules only, no FUSE): `randwrite` and TokuBench through the
//!   library, to separate the file system from the transport.
//!
//! A timed phase that writes lasts until its data is durable and the file system is
//! unmounted (the workload, a sync, the unmount, which for a FUSE server lasts until it
//! has written everything back and exited); reads and latencies are timed alone. "Cold"
//! means unmounted, mounted again and the page cache dropped. Runs interleave the
//! systems, so that drift on a shared machine spreads over all of them.

mod native;
mod report;
mod workloads;

use crate::systems::{self, Disk, Floor, Kind, Mounted, QuiltFs, System};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct BetrfsArgs {
    /// Scaled-down inputs and one run: a few minutes in all (what CI runs).
    #[arg(long)]
    pub quick: bool,
    /// Runs of each system (interleaved); default 3, or 1 with --quick.
    #[arg(long)]
    pub runs: Option<usize>,
    /// Where results.json, results.csv, report.md and the PNG plots go.
    #[arg(long, default_value = "betrfs-results")]
    pub out: PathBuf,
    /// Comma-separated systems (default: all): ext4, xfs, btrfs, fuse2fs, quilt-su (the
    /// ext2 module, soft updates), quilt-su-wbcache (the same under the kernel's
    /// writeback cache), betrfs, passthrough (libfuse's passthrough_hp over ext4: the
    /// FUSE floor), passthrough-kernel (the same with FUSE passthrough), bindfs.
    #[arg(long)]
    pub systems: Option<String>,
    /// Comma-separated workloads (default: all): seqwrite, seqread, randwrite, untar,
    /// find, grep, rmrf, toku1, toku4, rename, clone, seek, native.
    #[arg(long)]
    pub workloads: Option<String>,
    /// Working directory for images and inputs (a local disk; keeps the decompressed
    /// tarball between invocations).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-betrfs")]
    pub work: PathBuf,
}

const fn kernel(
    name: &'static str,
    what: &'static str,
    mkfs: &'static [&'static str],
    fstype: &'static str,
) -> System {
    System {
        name,
        what,
        kind: Kind::Kernel {
            mkfs,
            fstype,
            options: "",
        },
        safe: true,
        opt: None,
    }
}

pub const SYSTEMS: &[System] = &[
    kernel(
        "ext4",
        "Linux ext4 (data=ordered)",
        systems::MKFS_EXT4,
        "ext4",
    ),
    kernel("xfs", "Linux xfs (reflink)", systems::MKFS_XFS, "xfs"),
    kernel("btrfs", "Linux btrfs", systems::MKFS_BTRFS, "btrfs"),
    System {
        name: "fuse2fs",
        what: "fuse2fs (e2fsprogs, FUSE) on ext4",
        kind: Kind::Fuse2fs {
            mkfs: systems::MKFS_EXT4,
        },
        safe: false,
        opt: None,
    },
    System {
        name: "quilt-su",
        what: "quiltfs ext2 module, soft updates",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "quilt-su-wbcache",
        what: "quiltfs ext2 module, soft updates, kernel writeback cache (-o wbcache)",
        kind: Kind::Quilt {
            fs: QuiltFs::Ext2,
            mode: "soft-updates",
            unsafe_: false,
            options: "wbcache",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "betrfs",
        what: "quiltfs betrfs (Bε-tree)",
        kind: Kind::Quilt {
            fs: QuiltFs::Betrfs,
            mode: "soft-updates",
            unsafe_: false,
            options: "",
        },
        safe: true,
        opt: None,
    },
    systems::PASSTHROUGH,
    systems::PASSTHROUGH_KERNEL,
    systems::BINDFS,
];

pub fn by_name(name: &str) -> Result<System> {
    SYSTEMS
        .iter()
        .copied()
        .find(|s| s.name == name)
        .with_context(|| {
            format!(
                "unknown system '{name}' (one of: {})",
                SYSTEMS
                    .iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// The sizes a run uses (scaled from the papers to this machine; the report says so).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Scale {
    /// The sequential file (the papers: 10 GiB).
    pub seq_bytes: u64,
    pub seq_io: usize,
    /// Random writes into it (the papers: 256 Ki of 4 bytes).
    pub rand_writes: usize,
    /// TokuBench's files (the papers: 3 M, FAST'15 500 k).
    pub toku_files: usize,
    /// Directory sizes renamed and cloned.
    pub name_sizes: Vec<usize>,
    /// The file whose clone is timed (the issue: 1 GiB).
    pub clone_file_bytes: u64,
    /// Latencies: calls per size (back and forth for renames).
    pub latency_calls: usize,
    pub image_mib: u64,
}

impl Scale {
    pub fn new(quick: bool) -> Scale {
        if quick {
            Scale {
                seq_bytes: 128 << 20,
                seq_io: 40 << 10,
                rand_writes: 16 << 10,
                toku_files: 4000,
                name_sizes: vec![10, 100, 1000],
                clone_file_bytes: 64 << 20,
                latency_calls: 3,
                image_mib: 3072,
            }
        } else {
            Scale {
                seq_bytes: 4 << 30,
                seq_io: 40 << 10,
                rand_writes: 256 << 10,
                toku_files: 200_000,
                name_sizes: vec![10, 100, 1000, 10_000, 100_000],
                clone_file_bytes: 1 << 30,
                latency_calls: 5,
                image_mib: 16 << 10,
            }
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub system: &'static str,
    pub workload: &'static str,
    /// What the workload was given: a directory size, "linux", "1GiB-cp" (latencies);
    /// empty otherwise.
    pub param: String,
    pub run: usize,
    /// The headline figure in `unit` (seconds, MB/s, writes/s, files/s, ms).
    pub value: f64,
    pub unit: &'static str,
    /// The timed phase: the workload, and for phases that write, the sync and unmount.
    pub wall_s: f64,
    /// CPU of the workload's processes (or threads) and of the file system's own
    /// process (the FUSE server) or kernel thread over the phase.
    pub client_cpu_s: f64,
    pub fs_cpu_s: f64,
    /// Bytes the device was asked to write over the phase, MB.
    pub device_write_mb: f64,
    /// FUSE requests the quiltfs server answered over the phase (the workload and, for
    /// phases that write, the sync), by type; None for other systems and latencies.
    #[serde(default)]
    pub requests: Option<std::collections::BTreeMap<String, u64>>,
}

pub const WORKLOADS: &[&str] = &[
    "seqwrite",
    "seqread",
    "randwrite",
    "untar",
    "find",
    "grep",
    "rmrf",
    "toku1",
    "toku4",
    "rename",
    "clone",
    "seek",
    "native",
];

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

fn ensure_prerequisites(systems: &[System]) -> Result<()> {
    crate::require_root("bench betrfs")?;
    let mut pkgs = vec![
        "e2fsprogs",
        "fonts-dejavu-core",
        "xz-utils",
        "tar",
        "grep",
        "findutils",
    ];
    for s in systems {
        match s.kind {
            Kind::Kernel { fstype: "xfs", .. } => pkgs.push("xfsprogs"),
            Kind::Kernel {
                fstype: "btrfs", ..
            } => pkgs.push("btrfs-progs"),
            Kind::Fuse2fs { .. } => pkgs.push("fuse2fs"),
            Kind::Passthrough {
                server: Floor::Bindfs,
                ..
            } => pkgs.push("bindfs"),
            _ => {}
        }
    }
    crate::apt_install(&pkgs)?;
    systems::prepare_floor(systems)?;
    for tool in ["losetup", "mount", "umount", "tar", "find", "grep"] {
        if !crate::have(tool) {
            bail!("bench betrfs needs {tool}");
        }
    }
    crate::enable_fuse_uring();
    Ok(())
}

pub fn run(a: BetrfsArgs) -> Result<()> {
    let systems = select(&a.systems, SYSTEMS, by_name)?;
    let chosen: Vec<&'static str> = select(&a.workloads, WORKLOADS, |w| {
        WORKLOADS
            .iter()
            .copied()
            .find(|x| *x == w)
            .with_context(|| format!("unknown workload '{w}' (one of: {})", WORKLOADS.join(", ")))
    })?;
    if systems.is_empty() || chosen.is_empty() {
        bail!("nothing to run: no systems or no workloads selected");
    }
    let runs = a.runs.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    let scale = Scale::new(a.quick);
    ensure_prerequisites(&systems)?;
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    let tarball = crate::linux_tarball(&a.work, a.quick)?;
    crate::catch_interrupts();
    let groups = workloads::groups(&chosen);
    let steps: usize = systems
        .iter()
        .map(|s| {
            groups
                .iter()
                .filter(|g| g.applies(s))
                .map(|g| g.steps(&chosen))
                .sum::<usize>()
        })
        .sum::<usize>()
        * runs;
    eprintln!(
        "bench: {} systems × {} workloads × {runs} run(s); linux source {} ; results go to {}",
        systems.len(),
        chosen.len(),
        tarball.display(),
        a.out.display()
    );
    let mut bar = crate::Progress::new(steps as u64, "steps");
    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut checks: Vec<String> = Vec::new();
    for run in 0..runs {
        for sys in &systems {
            for g in groups.iter().filter(|g| g.applies(sys)) {
                let ctx = workloads::Ctx {
                    sys,
                    run,
                    scale: &scale,
                    work: &a.work,
                    tarball: &tarball,
                    chosen: &chosen,
                };
                let r = workloads::run_group(*g, &ctx, &mut bar)
                    .with_context(|| format!("{} ({:?} workloads), run {}", sys.name, g, run + 1));
                match r {
                    Ok((s, check)) => {
                        samples.extend(s);
                        checks.extend(check);
                        // What is measured so far survives a run that is stopped (a
                        // full run takes hours).
                        std::fs::create_dir_all(&a.out)?;
                        std::fs::write(
                            a.out.join("partial.json"),
                            serde_json::to_string(&serde_json::json!({
                                "samples": samples,
                                "checks": checks,
                            }))?,
                        )?;
                    }
                    Err(e) if sys.may_fail() && !crate::interrupted() => {
                        eprintln!("bench: {e:#}; going on without it");
                        checks.push(format!(
                            "not measured: {}",
                            format!("{e:#}").replace('\n', " ")
                        ));
                    }
                    Err(e) => {
                        bar.finish();
                        if crate::interrupted() {
                            bail!("interrupted: everything this run set up was unmounted, detached and removed");
                        }
                        return Err(e);
                    }
                }
            }
        }
    }
    bar.finish();
    let meta = report::Meta::gather(&scale, a.quick, runs, &tarball, started.elapsed());
    let md = report::markdown(&meta, &systems, &chosen, &samples, &checks);
    print!("{md}");
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    std::fs::write(a.out.join("report.md"), &md)?;
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "meta": meta,
            "systems": systems.iter().map(|s| serde_json::json!({"name": s.name, "what": s.what})).collect::<Vec<_>>(),
            "samples": samples,
            "checks": checks,
        }))?,
    )?;
    std::fs::write(a.out.join("results.csv"), crate::csv(&samples)?)?;
    let _ = std::fs::remove_file(a.out.join("partial.json"));
    let plots = report::plots(&a.out, &systems, &samples)?;
    println!(
        "results in {}: report.md, results.json, results.csv{}",
        a.out.display(),
        plots.iter().map(|p| format!(", {p}")).collect::<String>()
    );
    Ok(())
}

/// A fresh image of `sys`, attached to a loop device.
pub(crate) fn disk(sys: &System, work: &Path, image_mib: u64) -> Result<Disk> {
    Disk::create(sys, work, image_mib)
}

/// Mounts `disk` for `sys` at `work/<name>.mnt`.
pub(crate) fn mount(sys: &System, disk: &Disk, work: &Path) -> Result<Mounted> {
    let mnt = work.join(format!("{}.mnt", sys.name));
    let log = work.join(format!("{}.server.log", sys.name));
    Mounted::mount(sys, disk, &mnt, &log)
}
