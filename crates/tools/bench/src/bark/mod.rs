//! `quiltfs bench bark`: the evaluation of range writes and log skipping (Bark, OSDI
//! 2008) regenerated: PostgreSQL's TPC-B-like pgbench script with fixed work (`-t`) on a
//! file system whose journal lies on its own disk, a model of a 7200 RPM disk with its
//! write cache off (every journal write pays its seek and rotation), and whose data lies
//! on another model disk with its write cache on, as a desktop disk ships. The journal
//! is written
//! - `ring`: quiltfs's ext3 journal as JBD2 writes it (descriptor and data, a flush, the
//!   commit block, a flush: the commit block waits for the platter to come round);
//! - `skip`: log skipping, each commit one record written wherever the head gets first;
//! - `null`: nowhere (success without I/O: the upper bound, no crash safety);
//! - `ext4`: kernel ext4 with its external journal on the same model (a loop device over
//!   a file a FUSE server of this process serves through the model), the familiar
//!   baseline.
//!
//! quiltfs and ext4 both journal data (full-journal, `data=journal`), so each commit of
//! PostgreSQL's write-ahead log goes through the journal (with ordered data an
//! fdatasync of a preallocated WAL segment may not commit the journal at all).
//!
//! Two cache settings: `cached` (a small database, in 512 MB of shared buffers,
//! prewarmed) and `uncached` (a database ten times the size of PostgreSQL's 16 MB of
//! buffers and the file system's cache, the page cache dropped before each run: reads go
//! to the data disk). 1 client and 4 clients (which can share commits). Runs interleave
//! the systems. Reported: runtime and tps (medians, min–max), the journal disk's write
//! latencies (the model's histogram, as CDFs), and the goals.

mod export;
mod report;

use crate::systems::{Disk, Kind, Mounted, QuiltFs, System};
use crate::{apt_install, drop_caches, interrupted, sh, Progress};
use anyhow::{bail, Context, Result};
use quilt_block::{BlockDevice, BlockDeviceExt, DiskParams};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct BarkArgs {
    /// A small database, few transactions, one run, one client count: a couple of
    /// minutes (what CI runs).
    #[arg(long)]
    pub quick: bool,
    /// Runs of each configuration (interleaved); default 3, or 1 with --quick.
    #[arg(long)]
    pub runs: Option<usize>,
    /// Transactions in all per run (split among the clients); default 1000, 60 with
    /// --quick.
    #[arg(long)]
    pub transactions: Option<u32>,
    /// Comma-separated systems (default: all): ring, skip, null, ext4.
    #[arg(long)]
    pub systems: Option<String>,
    /// Comma-separated cache settings (default: both): cached, uncached.
    #[arg(long)]
    pub caches: Option<String>,
    /// Comma-separated client counts (default: 1,4; 1 with --quick).
    #[arg(long)]
    pub clients: Option<String>,
    /// The model disks' flushes stop at the model, for every system: the image files
    /// under them are not flushed on the host, so the host's fdatasync (longer than a
    /// write-through disk's modelled flush) is not added to the modelled time.
    #[arg(long)]
    pub no_host_flush: bool,
    /// Where results.json, results.csv, report.md and the PNG plots go.
    #[arg(long, default_value = "bark-results")]
    pub out: PathBuf,
    /// Working directory for images (a local disk).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-bark")]
    pub work: PathBuf,
}

/// The systems, by name.
pub const SYSTEMS: &[(&str, &str)] = &[
    ("ring", "quiltfs ext3, JBD2 ring journal"),
    ("skip", "quiltfs ext3, log-skipping journal"),
    ("null", "quiltfs ext3, null journal (no journal I/O)"),
    ("ext4", "Linux ext4 data=journal, external journal"),
];

/// How a run's database is cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Cache {
    Cached,
    Uncached,
}

impl Cache {
    pub fn name(self) -> &'static str {
        match self {
            Cache::Cached => "cached",
            Cache::Uncached => "uncached",
        }
    }
}

struct Scale {
    /// pgbench scale of each cache setting.
    cached: u32,
    uncached: u32,
    transactions: u32,
    clients: &'static [u32],
    runs: usize,
    /// Data image and journal, MiB.
    image_mib: u64,
    journal_mib: u64,
}

const FULL: Scale = Scale {
    cached: 10,
    uncached: 50,
    transactions: 1000,
    clients: &[1, 4],
    runs: 3,
    image_mib: 4096,
    journal_mib: 64,
};

const QUICK: Scale = Scale {
    cached: 1,
    uncached: 2,
    transactions: 60,
    clients: &[1],
    runs: 1,
    image_mib: 512,
    journal_mib: 16,
};

/// PostgreSQL's port and the file system cache of quiltfs in the uncached runs.
const PG_PORT: &str = "5439";
const UNCACHED_CACHE_MIB: u64 = 16;

/// One measured run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub system: String,
    pub cache: Cache,
    pub clients: u32,
    pub run: usize,
    pub transactions: u32,
    pub seconds: f64,
    pub tps: f64,
    /// Journal-disk writes in the run by latency bucket (upper bounds in µs, the last
    /// unbounded), from the model.
    pub journal_write_latency: Vec<u64>,
    /// What the journal disk's counters (`journal.device.*`: requests, bytes, the
    /// model's modelled times) and, for quiltfs, the journal's own (`journal.*`) moved
    /// by during the run: where a transaction's time goes.
    pub journal_counters: std::collections::BTreeMap<String, u64>,
}

pub fn run(a: BarkArgs) -> Result<()> {
    crate::require_root("the Bark benchmark (loop devices, mounts, PostgreSQL as its user)")?;
    crate::catch_interrupts();
    let scale = if a.quick { QUICK } else { FULL };
    let runs = a.runs.unwrap_or(scale.runs);
    let transactions = a.transactions.unwrap_or(scale.transactions);
    let systems: Vec<&str> = match &a.systems {
        None => SYSTEMS.iter().map(|s| s.0).collect(),
        Some(list) => {
            let mut v = Vec::new();
            for n in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let Some(s) = SYSTEMS.iter().find(|s| s.0 == n) else {
                    bail!(
                        "unknown system '{n}' (known: {})",
                        SYSTEMS.iter().map(|s| s.0).collect::<Vec<_>>().join(", ")
                    );
                };
                v.push(s.0);
            }
            v
        }
    };
    let pg = Postgres::find()?;
    std::fs::create_dir_all(&a.work)?;
    std::fs::create_dir_all(&a.out)?;
    crate::enable_fuse_uring();
    let caches: Vec<Cache> = match &a.caches {
        None => vec![Cache::Cached, Cache::Uncached],
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|c| match c {
                "cached" => Ok(Cache::Cached),
                "uncached" => Ok(Cache::Uncached),
                _ => Err(anyhow::anyhow!(
                    "unknown cache setting '{c}' (known: cached, uncached)"
                )),
            })
            .collect::<Result<_>>()?,
    };
    let clients: Vec<u32> = match &a.clients {
        None => scale.clients.to_vec(),
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|c| match c.parse::<u32>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(anyhow::anyhow!(
                    "--clients: '{c}' is not a client count of 1 or more"
                )),
            })
            .collect::<Result<_>>()?,
    };
    if caches.is_empty() || clients.is_empty() {
        bail!("--caches and --clients need at least one value each");
    }
    let steps = caches.len() * systems.len() * (1 + runs * clients.len());
    let mut progress = Progress::new(steps as u64, "steps");
    let mut rows: Vec<Row> = Vec::new();
    let t0 = Instant::now();
    for cache in caches {
        let pgscale = match cache {
            Cache::Cached => scale.cached,
            Cache::Uncached => scale.uncached,
        };
        // Set up every system for this cache setting: images, PostgreSQL, pgbench -i.
        let mut beds = Vec::new();
        for name in &systems {
            progress.step(format!(
                "{name}: pgbench -i -s {pgscale} ({})",
                cache.name()
            ));
            let bed = Bed::create(name, &a.work, &scale, cache, !a.no_host_flush)
                .with_context(|| format!("setting up {name}"))?;
            bed.with_postgres(&pg, cache, |db| db.init(pgscale))
                .with_context(|| format!("initializing the database on {name}"))?;
            beds.push(bed);
            progress.inc();
            if interrupted() {
                bail!("interrupted");
            }
        }
        for r in 0..runs {
            for &clients in &clients {
                // A different order each run: drift spreads over the systems.
                for k in 0..beds.len() {
                    let bed = &beds[(k + r) % beds.len()];
                    progress.step(format!(
                        "{} {} c={clients} (run {})",
                        bed.name,
                        cache.name(),
                        r + 1
                    ));
                    let row = bed
                        .with_postgres(&pg, cache, |db| {
                            db.measure(bed, cache, clients, transactions, r)
                        })
                        .with_context(|| format!("pgbench on {}", bed.name))?;
                    eprintln!(
                        "bench: {} {} c={clients}: {:.1} s, {:.1} tps",
                        row.system,
                        cache.name(),
                        row.seconds,
                        row.tps
                    );
                    rows.push(row);
                    progress.inc();
                    if interrupted() {
                        bail!("interrupted");
                    }
                }
            }
        }
        drop(beds);
    }
    progress.finish();
    let meta = report::Meta {
        quick: a.quick,
        runs,
        transactions,
        scale_cached: scale.cached,
        scale_uncached: scale.uncached,
        seconds: t0.elapsed().as_secs_f64(),
        postgres: pg.version.clone(),
        host_flush: !a.no_host_flush,
    };
    report::write(&a.out, &meta, &rows)?;
    eprintln!("bench: results in {}", a.out.display());
    Ok(())
}

/// PostgreSQL's programs, run as the `postgres` user.
struct Postgres {
    bin: PathBuf,
    version: String,
}

impl Postgres {
    fn find() -> Result<Postgres> {
        let find = || -> Option<PathBuf> {
            let mut v: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|p| p.join("initdb").exists() && p.join("pgbench").exists())
                .collect();
            v.sort();
            v.pop()
        };
        let bin = match find() {
            Some(b) => b,
            None => {
                apt_install(&["postgresql", "postgresql-contrib"])?;
                find().context("PostgreSQL is installed but no initdb and pgbench were found under /usr/lib/postgresql")?
            }
        };
        if Command::new("id")
            .arg("postgres")
            .output()
            .map_or(true, |o| !o.status.success())
        {
            bail!("there is no 'postgres' user (the postgresql package makes it)");
        }
        let version = sh(Command::new(bin.join("postgres")).arg("--version"))?
            .trim()
            .to_string();
        Ok(Postgres { bin, version })
    }

    /// A command of PostgreSQL's, as the postgres user.
    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(self.bin.join(prog));
        c
    }
}

/// A running PostgreSQL on a mounted bed.
struct Db<'a> {
    pg: &'a Postgres,
    data: PathBuf,
    sock: PathBuf,
}

impl Db<'_> {
    fn pgbench(&self) -> Command {
        let mut c = self.pg.cmd("pgbench");
        c.arg("-h").arg(&self.sock).args(["-p", PG_PORT]);
        c
    }

    fn psql(&self, sql: &str) -> Result<String> {
        sh(self.pg.cmd("psql").arg("-h").arg(&self.sock).args([
            "-p",
            PG_PORT,
            "-X",
            "-q",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
            "postgres",
        ]))
    }

    fn init(&self, scale: u32) -> Result<()> {
        sh(self
            .pgbench()
            .args(["-i", "-q", "-s", &scale.to_string(), "postgres"]))?;
        self.psql("CHECKPOINT")?;
        Ok(())
    }

    /// The timed run: a checkpoint first (so none falls inside), the journal disk's
    /// histogram around it.
    fn measure(
        &self,
        bed: &Bed,
        cache: Cache,
        clients: u32,
        total: u32,
        run: usize,
    ) -> Result<Row> {
        if cache == Cache::Cached {
            self.psql(
                "CREATE EXTENSION IF NOT EXISTS pg_prewarm; \
                 SELECT pg_prewarm(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = 'public' AND c.relkind IN ('r', 'i')",
            )?;
        }
        self.psql("CHECKPOINT")?;
        let per = (total / clients).max(1);
        let counters_before = bed.journal_counters()?;
        let t = Instant::now();
        let out = sh(self.pgbench().args([
            "-n",
            "-c",
            &clients.to_string(),
            "-j",
            &clients.to_string(),
            "-t",
            &per.to_string(),
            "postgres",
        ]))?;
        let seconds = t.elapsed().as_secs_f64();
        let counters_after = bed.journal_counters()?;
        let tps = out
            .lines()
            .find_map(|l| {
                let rest = l.trim().strip_prefix("tps = ")?;
                rest.split_whitespace().next()?.parse::<f64>().ok()
            })
            .with_context(|| format!("no 'tps = ' in pgbench's output: {out}"))?;
        // What each counter moved by during the run.
        let moved: std::collections::BTreeMap<String, u64> = counters_after
            .into_iter()
            .map(|(k, a)| {
                let b = counters_before.get(&k).copied().unwrap_or(0);
                (k, a.saturating_sub(b))
            })
            .collect();
        Ok(Row {
            system: bed.name.to_string(),
            cache,
            clients,
            run,
            transactions: per * clients,
            seconds,
            tps,
            journal_write_latency: Bed::journal_latency(&moved),
            journal_counters: moved
                .into_iter()
                .filter(|(k, _)| !k.contains("latency") && !k.contains("range_choice"))
                .collect(),
        })
    }
}

/// One system's images and devices for one cache setting.
struct Bed {
    name: &'static str,
    sys: System,
    disk: Disk,
    mnt: PathBuf,
    log: PathBuf,
    /// ext4: the FUSE export of the model disks and the journal's loop device.
    export: Option<Export>,
    /// Files removed when the bed goes (last: after the loop devices and the export).
    _files: Files,
}

/// Files a bed made besides its disk's image (the external journal, the model disks).
struct Files(Vec<PathBuf>);

impl Drop for Files {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}

struct Export {
    journal: Arc<dyn BlockDevice>,
    journal_loop: String,
    session: Option<quilt_fuse::BackgroundSession>,
    dir: PathBuf,
}

impl Drop for Export {
    fn drop(&mut self) {
        let _ = Command::new("losetup")
            .arg("-d")
            .arg(&self.journal_loop)
            .status();
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                eprintln!(
                    "bench: unmounting the disk export {}: {e}",
                    self.dir.display()
                );
            }
        }
    }
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// A new image file of `mib` MiB under the rotating-disk model at real time (`cache`:
/// its write cache on), through the wiring layer like every other device.
fn model_file(
    path: &Path,
    mib: u64,
    cache: bool,
    host_flush: bool,
) -> Result<Arc<dyn BlockDevice>> {
    let _ = std::fs::remove_file(path);
    let spec = quilt_stack::ImageSpec {
        create_bytes: Some(mib << 20),
        lock: false,
        ..quilt_stack::ImageSpec::new(path, 4096, false)
    };
    let d = quilt_stack::device(quilt_stack::DeviceSpec::image(spec).with(
        quilt_stack::Layer::Disk {
            params: DiskParams {
                write_cache: cache,
                ..DiskParams::desktop_7200()
            },
            virtual_time: false,
            host_flush,
        },
    ))
    .with_context(|| format!("creating {}", path.display()))?;
    Ok(d.dev)
}

fn attach(path: &Path, direct: bool) -> Result<String> {
    let mut c = Command::new("losetup");
    c.args(["-f", "--show", "--sector-size", "4096"]);
    if direct {
        c.arg("--direct-io=on");
    }
    Ok(sh(c.arg(path))?.trim().to_string())
}

impl Bed {
    fn create(
        name: &'static str,
        work: &Path,
        scale: &Scale,
        cache: Cache,
        host_flush: bool,
    ) -> Result<Bed> {
        let mnt = work.join(format!("{name}.mnt"));
        let log = work.join(format!("{name}.log"));
        std::fs::create_dir_all(&mnt)?;
        if name == "ext4" {
            return Bed::create_ext4(work, scale, mnt, log, host_flush);
        }
        let image = work.join(format!("{name}.img"));
        let journal = work.join(format!("{name}-journal.img"));
        let _ = std::fs::remove_file(&image);
        let _ = std::fs::remove_file(&journal);
        std::fs::File::create(&image)?.set_len(scale.image_mib << 20)?;
        sh(Command::new(crate::quiltfs_exe()?)
            .arg("mkfs")
            .arg(&image)
            .args(["--journal", "--journal-dev"])
            .arg(&journal)
            .args([
                "--journal-size",
                &format!("{}M", scale.journal_mib),
                "--force",
            ]))?;
        let dev = attach(&image, false)?;
        let disk = Disk {
            image: image.clone(),
            dev,
            keep: false,
        };
        let mut options = format!(
            "allow_other,model=7200,journal_dev={},journal_model=7200,journal={name}",
            journal.display()
        );
        if cache == Cache::Uncached {
            options += &format!(",cache_mib={UNCACHED_CACHE_MIB}");
        }
        if !host_flush {
            options += ",model_nohostsync";
        }
        let sys = System {
            name,
            what: SYSTEMS.iter().find(|s| s.0 == name).map_or("", |s| s.1),
            kind: Kind::Quilt {
                fs: QuiltFs::Ext2,
                mode: "full-journal",
                unsafe_: false,
                options: leak(options),
            },
            safe: name != "null",
            opt: None,
        };
        Ok(Bed {
            name,
            sys,
            disk,
            mnt,
            log,
            export: None,
            _files: Files(vec![journal]),
        })
    }

    fn create_ext4(
        work: &Path,
        scale: &Scale,
        mnt: PathBuf,
        log: PathBuf,
        host_flush: bool,
    ) -> Result<Bed> {
        let files = Files(vec![
            work.join("ext4-data.raw"),
            work.join("ext4-journal.raw"),
        ]);
        let data = model_file(&files.0[0], scale.image_mib, true, host_flush)?;
        let journal = model_file(&files.0[1], scale.journal_mib, false, host_flush)?;
        let dir = work.join("ext4-disks");
        std::fs::create_dir_all(&dir)?;
        let fs = Arc::new(export::DiskExport::new(vec![
            ("data".into(), data),
            ("journal".into(), journal.clone()),
        ]));
        let opts = quilt_fuse::FuseOptions {
            fs_name: "quiltfs-disk-model".into(),
            ..Default::default()
        };
        let session = quilt_fuse::spawn(fs, &dir, &opts, Box::new(|| {}))
            .with_context(|| format!("serving the model disks at {}", dir.display()))?;
        // Direct I/O: every request of the loop device reaches the model (no page cache
        // of the exported file in between); buffered where the kernel refuses it.
        let attach_either = |p: &Path| attach(p, true).or_else(|_| attach(p, false));
        let mut export = Export {
            journal,
            journal_loop: String::new(),
            session: Some(session),
            dir: dir.clone(),
        };
        export.journal_loop = attach_either(&dir.join("journal"))?;
        let dev = attach_either(&dir.join("data"))?;
        let disk = Disk {
            image: dir.join("data"),
            dev: dev.clone(),
            keep: true,
        };
        sh(Command::new("mke2fs")
            .args(["-q", "-F", "-O", "journal_dev", "-b", "4096"])
            .arg(&export.journal_loop))?;
        sh(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", "-E", "lazy_itable_init=0"])
            .arg("-J")
            .arg(format!("device={}", export.journal_loop))
            .arg(&dev))?;
        let sys = System {
            name: "ext4",
            what: "Linux ext4 data=journal, external journal",
            kind: Kind::Kernel {
                mkfs: &[],
                fstype: "ext4",
                options: leak(format!("data=journal,journal_path={}", export.journal_loop)),
            },
            safe: true,
            opt: None,
        };
        Ok(Bed {
            name: "ext4",
            sys,
            disk,
            mnt,
            log,
            export: Some(export),
            _files: files,
        })
    }

    /// The journal disk's write-latency histogram so far.
    /// The journal's and its disk's counters now, by name.
    fn journal_counters(&self) -> Result<std::collections::BTreeMap<String, u64>> {
        let mut m = std::collections::BTreeMap::new();
        if let Some(e) = &self.export {
            let d = &e.journal;
            for (k, v) in d.stats().fields() {
                m.insert(format!("journal.device.{k}"), v);
            }
            for (k, v) in d.extra_stats() {
                m.insert(format!("journal.device.{k}"), v);
            }
            return Ok(m);
        }
        let v = quilt_mountctl::stats(&self.mnt)?;
        if let Some(o) = v.as_object() {
            for (k, val) in o {
                if let (true, Some(n)) = (k.starts_with("journal."), val.as_u64()) {
                    m.insert(k.clone(), n);
                }
            }
        }
        Ok(m)
    }

    /// The journal disk's write-latency histogram in `counters` (one count per bucket
    /// of `LATENCY_BUCKETS_US`).
    fn journal_latency(counters: &std::collections::BTreeMap<String, u64>) -> Vec<u64> {
        quilt_block::LATENCY_BUCKETS_US
            .iter()
            .map(|b| {
                let name = if *b == u64::MAX {
                    "journal.device.model.write_latency.more".to_string()
                } else {
                    format!("journal.device.model.write_latency.le_{b}us")
                };
                counters.get(&name).copied().unwrap_or(0)
            })
            .collect()
    }

    /// Mounts, starts PostgreSQL on the mount (its data directory made at the first
    /// call), runs `f`, stops PostgreSQL and unmounts.
    fn with_postgres<T>(
        &self,
        pg: &Postgres,
        cache: Cache,
        f: impl FnOnce(&Db) -> Result<T>,
    ) -> Result<T> {
        let m = Mounted::mount(&self.sys, &self.disk, &self.mnt, &self.log)?;
        let data = self.mnt.join("pgdata");
        let sock = self.mnt.with_extension("sock");
        std::fs::create_dir_all(&sock)?;
        sh(Command::new("chown").arg("postgres:postgres").arg(&sock))?;
        let fresh = !data.exists();
        if fresh {
            std::fs::create_dir_all(&data)?;
            sh(Command::new("chown").arg("postgres:postgres").arg(&data))?;
            sh(pg
                .cmd("initdb")
                .args(["-A", "trust", "--no-sync", "-D"])
                .arg(&data))?;
            let shared = match cache {
                Cache::Cached => "512MB",
                Cache::Uncached => "16MB",
            };
            let conf = format!(
                "\n# quiltfs bench bark\nlisten_addresses = ''\nport = {PG_PORT}\nunix_socket_directories = '{}'\n\
                 shared_buffers = {shared}\nfsync = on\nsynchronous_commit = on\ncommit_delay = 0\n\
                 checkpoint_timeout = 1h\nmax_wal_size = 8GB\nautovacuum = off\n",
                sock.display()
            );
            let p = data.join("postgresql.conf");
            let mut s = std::fs::read_to_string(&p)?;
            s += &conf;
            std::fs::write(&p, s)?;
        }
        if cache == Cache::Uncached {
            drop_caches()?;
        }
        let pglog = self.mnt.with_extension("pg.log");
        let _ = std::fs::remove_file(&pglog);
        std::fs::File::create(&pglog)?;
        sh(Command::new("chown").arg("postgres:postgres").arg(&pglog))?;
        sh(pg
            .cmd("pg_ctl")
            .args(["-w", "-t", "300", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(&pglog)
            .arg("start"))
        .with_context(|| crate::systems::log_tail(&pglog))?;
        let db = Db {
            pg,
            data: data.clone(),
            sock,
        };
        let r = f(&db);
        let stopped = sh(pg
            .cmd("pg_ctl")
            .args(["-w", "-t", "600", "-m", "fast", "-D"])
            .arg(&db.data)
            .arg("stop"));
        let r = r?;
        stopped?;
        m.unmount()?;
        Ok(r)
    }
}
