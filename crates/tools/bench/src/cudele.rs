//! `quiltfs bench cudele`: the evaluation of Cudele (IPDPS 2018) regenerated on one
//! machine, against a metadata service (`quiltfs mds serve`) on a quiltfs image.
//!
//! - **Mechanisms** (the paper's figure 4): one client makes N creates in one directory
//!   with each mechanism and each composition (the paper's presets), every time taken
//!   end to end and normalized to Append Client Journal. Stream is measured as the
//!   paper does: RPCs with global durability minus RPCs without.
//! - **Use case 1** (figure 5a): 1, 2, 4 … client processes each making N creates in
//!   a private directory, all at once: through RPCs, decoupled (append only), and
//!   decoupled with its merge; total creates per second over the wall time from the
//!   first start to the last end (the prototype's sleeps are not here).
//! - **Journal bytes per create event.**
//! - Beside them, the same create loop on local ext4 (a kernel loop mount; root only).
//! - **Through mounts** (`cudele_mounts.rs`): one process creating N files in one
//!   directory of a FUSE mount of the service, in RPC mode (with and without Stream)
//!   and decoupled, beside CephFS through ceph-fuse (a one-machine Ceph with an MDS),
//!   sshfs over loopback and ext4.
//! - **Use case 2** (`cudele/rogue.rs`): clients creating through RPCs in private
//!   directories while a rogue client creates in all of them (allow, block, none).
//! - **Use case 3**: the same creates through a decoupled mount with namespace sync
//!   every 1, 5, 10, 25 s, against none: the overhead.
//!
//! Clients are this process (mechanisms) or processes of this binary
//! (`quiltfs-bench cudele-client`, use case 1) linking the client library.

mod rogue;

use crate::{cudele_mounts, median, plot, quiltfs_exe, Progress};
use anyhow::{anyhow, bail, Context, Result};
use quilt_cudele::client::{Client, DecoupleOptions, RemoteFs};
use quilt_vfs::{Ctx, FileSystem, Ino};
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args)]
pub struct CudeleArgs {
    /// Small: 5,000 creates, 1 and 2 clients, one run (what CI runs).
    #[arg(long)]
    pub quick: bool,
    /// Runs of each measurement (default 3; 1 with --quick).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Creates per client (default 100,000; 5,000 with --quick).
    #[arg(long)]
    pub creates: Option<u64>,
    /// Comma-separated client counts for use case 1 (default 1,2,4; 1,2 with --quick).
    #[arg(long)]
    pub clients: Option<String>,
    /// The service's store: betrfs or ext3.
    #[arg(long, default_value = "betrfs")]
    pub fs: String,
    #[arg(long, default_value_t = 7700)]
    pub port: u16,
    /// Events per atomic batch of the service's merges (`mds serve --merge-batch`).
    #[arg(long, default_value_t = 16384)]
    pub merge_batch: usize,
    /// Where results.json, results.csv, report.md and the PNG plots go.
    #[arg(long, default_value = "cudele-results")]
    pub out: PathBuf,
    /// Working directory for the image and the clients' journals (a local disk).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-cudele")]
    pub work: PathBuf,
    /// Creates per run through each mount (default 5,000; 500 with --quick): RPC mode
    /// through FUSE makes a few hundred a second.
    #[arg(long)]
    pub mount_creates: Option<u64>,
    /// Peers beside the mounts, comma-separated: cephfs (a one-machine Ceph with an MDS
    /// and ceph-fuse), sshfs (over loopback), or none. Installed with apt when missing.
    /// Default cephfs,sshfs; none with --quick.
    #[arg(long)]
    pub peers: Option<String>,
    /// Use case 3: creates through a decoupled mount per interval (default 1,000,000;
    /// 20,000 with --quick).
    #[arg(long)]
    pub uc3_creates: Option<u64>,
    /// Use case 3: namespace-sync intervals, seconds, comma-separated (default 1,5,10,25;
    /// 1 with --quick); each against the same creates with no sync.
    #[arg(long)]
    pub uc3_intervals: Option<String>,
    /// Use case 2: creates per client (default 10,000; 300 with --quick). Each is
    /// durable at the service before it returns (the paper's settings).
    #[arg(long)]
    pub uc2_creates: Option<u64>,
    /// Use case 2: clients in private directories beside the rogue (default 2).
    #[arg(long, default_value_t = 2)]
    pub uc2_clients: u32,
}

/// One measurement: `system` is the mechanism, composition or peer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub system: String,
    pub workload: String,
    pub clients: u32,
    pub run: usize,
    pub creates: u64,
    pub seconds: f64,
    pub creates_per_s: f64,
}

/// The service as a child process on a fresh image.
struct Service {
    child: Child,
    addr: String,
    secret: String,
    secret_file: PathBuf,
}

impl Service {
    fn start(work: &Path, fs: &str, port: u16, merge_batch: usize) -> Result<Service> {
        let img = work.join("ns.img");
        let _ = std::fs::remove_file(&img);
        let q = quiltfs_exe()?;
        let mut mk = Command::new(&q);
        mk.arg("mkfs").arg(&img).arg("--size").arg("2G");
        match fs {
            "betrfs" => {
                mk.arg("--fs").arg("betrfs");
            }
            "ext3" => {
                mk.arg("--journal").arg("--inodes").arg("1000000");
            }
            other => bail!("--fs {other}: betrfs or ext3"),
        }
        crate::sh(&mut mk)?;
        let secret_file = work.join("secret");
        std::fs::write(&secret_file, "bench-secret-0123456789abcdef\n")?;
        let mut child = Command::new(&q)
            .arg("mds")
            .arg("serve")
            .arg(&img)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--secret-file")
            .arg(&secret_file)
            .arg("--merge-batch")
            .arg(merge_batch.to_string())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(work.join("serve.log"))?)
            .spawn()
            .context("starting quiltfs mds serve")?;
        let out = child.stdout.take().context("the service's output")?;
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line)?;
        if !line.contains("mds://") {
            let _ = child.kill();
            bail!("the service did not start: {line:?}");
        }
        Ok(Service {
            child,
            addr: format!("127.0.0.1:{port}"),
            secret: "bench-secret-0123456789abcdef".into(),
            secret_file,
        })
    }

    /// The address a mount of `subtree` takes.
    fn address(&self, subtree: &str) -> String {
        format!(
            "mds://{}/{subtree}?secret-file={}",
            self.addr,
            self.secret_file.display()
        )
    }

    fn connect(&self, name: &str) -> Result<Arc<Client>> {
        Client::connect(&self.addr, &self.secret, None, name).map_err(|e| anyhow!(e))
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // SIGTERM: the service writes its store back and stops.
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn user() -> Ctx {
    Ctx {
        uid: 0,
        gid: 0,
        pid: std::process::id(),
        umask: 0o022,
    }
}

/// A fresh directory `name` under the root with `settings` as its policy.
fn subtree(c: &Arc<Client>, name: &str, settings: &str) -> Result<Ino> {
    let remote = RemoteFs::new(c.clone());
    let d = remote
        .mkdir(remote.root(), name.as_bytes(), 0o755, &Ctx::root())
        .map_err(|e| anyhow!("mkdir {name}: {e}"))?;
    c.set_policy(d.ino, settings)
        .map_err(|e| anyhow!("policy of {name}: {}", e.message))?;
    Ok(d.ino)
}

fn name(i: u64) -> Vec<u8> {
    format!("file.{i:07}").into_bytes()
}

/// N creates through RPCs in a new directory with `settings`: seconds.
fn rpcs(c: &Arc<Client>, dir: &str, settings: &str, n: u64) -> Result<f64> {
    let d = subtree(c, dir, settings)?;
    let remote = RemoteFs::new(c.clone());
    let t = Instant::now();
    for i in 0..n {
        remote
            .mknod(d, &name(i), libc::S_IFREG | 0o644, 0, &user())
            .map_err(|e| anyhow!("create {i}: {e}"))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// What a decoupled run measured: seconds appending, seconds in the final sync (or
/// merge), and journal bytes.
struct Decoupled {
    append: f64,
    finish: f64,
    bytes: u64,
}

/// N decoupled creates in a new directory with `settings`, then `finish`: the policy's
/// sync, or a merge (durable or not).
fn decoupled(
    c: &Arc<Client>,
    dir: &str,
    settings: &str,
    n: u64,
    local: &Path,
    finish: Finish,
) -> Result<Decoupled> {
    let root = subtree(c, dir, &format!("{settings} inodes={n} sync=0"))?;
    let d = c
        .decouple(
            root,
            DecoupleOptions {
                local_dir: Some(local.to_path_buf()),
                sync_interval: Some(Duration::ZERO),
            },
        )
        .map_err(|e| anyhow!("decoupling {dir}: {e}"))?;
    let t = Instant::now();
    for i in 0..n {
        d.create(&user(), root, &name(i), 0o644)
            .map_err(|e| anyhow!("decoupled create {i}: {e}"))?;
    }
    let append = t.elapsed().as_secs_f64();
    let bytes = d.journal_bytes();
    let t = Instant::now();
    match finish {
        Finish::Sync => d.sync().map(|_| ()),
        Finish::Merge { durable } => d.merge(durable).map(|_| ()),
        Finish::Nothing => Ok(()),
    }
    .map_err(|e| anyhow!("finishing {dir}: {e}"))?;
    let finish_s = t.elapsed().as_secs_f64();
    d.release().map_err(|e| anyhow!("releasing {dir}: {e}"))?;
    Ok(Decoupled {
        append,
        finish: finish_s,
        bytes,
    })
}

#[derive(Clone, Copy)]
enum Finish {
    Sync,
    Merge { durable: bool },
    Nothing,
}

/// The mechanisms and compositions, one client, each on a fresh service and image (a
/// store grown by the runs before would slow the later ones): rows of (system,
/// seconds), and the journal's bytes per create.
fn mechanisms(a: &CudeleArgs, n: u64, run: usize, local: &Path) -> Result<(Vec<Row>, f64)> {
    let fresh = || -> Result<(Service, Arc<Client>)> {
        let svc = Service::start(&a.work, &a.fs, a.port, a.merge_batch)?;
        let c = svc.connect("bench mechanisms")?;
        Ok((svc, c))
    };
    let mut out: Vec<(&str, f64)> = Vec::new();
    let dec = |settings: &str, finish: Finish| -> Result<Decoupled> {
        let (_svc, c) = fresh()?;
        decoupled(&c, "job", settings, n, local, finish)
    };
    // Alone: append; then each mechanism's own time on such a journal.
    let ap = dec("consistency=invisible durability=none", Finish::Nothing)?;
    out.push(("append client journal", ap.append));
    let bytes_per_event = ap.bytes as f64 / n as f64;
    let v = dec(
        "consistency=weak durability=none",
        Finish::Merge { durable: false },
    )?;
    out.push(("volatile apply", v.finish));
    let nv = dec(
        "consistency=weak durability=none",
        Finish::Merge { durable: true },
    )?;
    out.push(("nonvolatile apply", nv.finish));
    let lp = dec("consistency=invisible durability=local", Finish::Sync)?;
    out.push(("local persist", lp.finish));
    let gp = dec("consistency=invisible durability=global", Finish::Sync)?;
    out.push(("global persist", gp.finish));
    let r = {
        let (_svc, c) = fresh()?;
        rpcs(&c, "job", "consistency=strong durability=none", n)?
    };
    out.push(("rpcs", r));
    let rs = {
        let (_svc, c) = fresh()?;
        rpcs(&c, "job", "preset=posix", n)?
    };
    out.push(("stream", (rs - r).max(0.0)));
    // The compositions, measured whole.
    out.push(("posix", rs));
    for (label, preset) in [
        ("deltafs", "preset=deltafs"),
        ("ramdisk", "preset=ramdisk"),
        ("hdfs", "preset=hdfs"),
        ("batchfs", "preset=batchfs"),
    ] {
        let d = dec(preset, Finish::Sync)?;
        out.push((label, d.append + d.finish));
    }
    let rows = out
        .into_iter()
        .map(|(system, s)| one_client_row(system, "mechanisms", n, run, s))
        .collect();
    Ok((rows, bytes_per_event))
}

/// `quiltfs-bench cudele-client`: one client process of use case 1 or 2. Waits until
/// `start_ms` (Unix time), makes `n` creates in a new directory `dir` as `mode`
/// says, and prints `start_ms end_ms`.
#[derive(clap::Args)]
pub struct ClientArgs {
    #[arg(long)]
    pub addr: String,
    #[arg(long)]
    pub secret: String,
    #[arg(long)]
    pub dir: String,
    #[arg(long)]
    pub n: u64,
    /// rpcs, create (decoupled, append only) or create+merge (use case 1);
    /// uc2-none, uc2-allow, uc2-block or rogue (use case 2: `dir` lists the rogue's
    /// directories, comma-separated, and `n` bounds its attempts).
    #[arg(long)]
    pub mode: String,
    #[arg(long)]
    pub start_ms: u64,
    #[arg(long)]
    pub local: PathBuf,
    /// The rogue's pace: creates a second at most (0: unpaced).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// The rogue stops once this file exists.
    #[arg(long)]
    pub until: Option<PathBuf>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn client_main(a: ClientArgs) -> Result<()> {
    let c = Client::connect(&a.addr, &a.secret, None, "bench client").map_err(|e| anyhow!(e))?;
    if a.mode == "rogue" {
        return rogue::rogue(&c, &a);
    }
    if let Some(case) = a.mode.strip_prefix("uc2-") {
        return rogue::client(&c, &a, case);
    }
    let settings = match a.mode.as_str() {
        "rpcs" => "consistency=strong durability=none".to_string(),
        "create" | "create+merge" => {
            format!("consistency=weak durability=none inodes={} sync=0", a.n)
        }
        m => bail!("mode {m}: rpcs, create, create+merge, uc2-none|allow|block or rogue"),
    };
    let root = subtree(&c, &a.dir, &settings)?;
    let d = if a.mode == "rpcs" {
        None
    } else {
        Some(
            c.decouple(
                root,
                DecoupleOptions {
                    local_dir: Some(a.local.clone()),
                    sync_interval: Some(Duration::ZERO),
                },
            )
            .map_err(|e| anyhow!("decoupling: {e}"))?,
        )
    };
    let remote = RemoteFs::new(c.clone());
    let wait = a.start_ms.saturating_sub(now_ms());
    std::thread::sleep(Duration::from_millis(wait));
    let start = now_ms();
    for i in 0..a.n {
        match &d {
            None => remote
                .mknod(root, &name(i), libc::S_IFREG | 0o644, 0, &user())
                .map(|_| ()),
            Some(d) => d.create(&user(), root, &name(i), 0o644).map(|_| ()),
        }
        .map_err(|e| anyhow!("create {i}: {e}"))?;
    }
    if let Some(d) = &d {
        if a.mode == "create+merge" {
            d.merge(false).map_err(|e| anyhow!("merge: {e}"))?;
        }
    }
    let end = now_ms();
    println!("{start} {end}");
    if let Some(d) = d {
        // Letting go is not part of the measured work.
        if a.mode == "create" {
            d.merge(false).map_err(|e| anyhow!("merge: {e}"))?;
        }
        d.release().map_err(|e| anyhow!("release: {e}"))?;
    }
    Ok(())
}

/// Use case 1: `k` client processes at once, each `n` creates.
fn use_case_1(svc: &Service, k: u32, n: u64, mode: &str, run: usize, local: &Path) -> Result<Row> {
    let start = now_ms() + 1500 + 100 * u64::from(k);
    let kids: Vec<Child> = (0..k)
        .map(|i| {
            let dir = format!("uc1-{mode}-{k}-{run}-{i}").replace('+', "-");
            spawn_client(svc, &dir, n, mode, start, local).spawn()
        })
        .collect::<Result<_>>()?;
    let (mut first, mut last) = (u64::MAX, 0u64);
    for kid in kids {
        let (s, e) = client_times(kid, mode)?;
        first = first.min(s);
        last = last.max(e);
    }
    let seconds = (last.saturating_sub(first)) as f64 / 1000.0;
    let total = n * u64::from(k);
    Ok(Row {
        system: mode.to_string(),
        workload: "use-case-1".into(),
        clients: k,
        run,
        creates: total,
        seconds,
        creates_per_s: total as f64 / seconds.max(1e-3),
    })
}

/// A client process of this binary (`cudele-client`), ready to spawn: `n` creates in
/// `dir` as `mode` says, from `start_ms` (Unix time).
struct ClientCommand(Command);

impl ClientCommand {
    fn arg(mut self, name: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.0.arg(name).arg(value);
        self
    }

    /// At the lowest CPU priority: its own work yields to every other process here.
    fn niced(mut self) -> Self {
        use std::os::unix::process::CommandExt;
        // SAFETY: setpriority is async-signal-safe and touches no memory of ours; it
        // runs in the child between fork and exec.
        unsafe {
            self.0.pre_exec(|| {
                if libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self
    }

    /// Its standard input a pipe: it waits for the end of it before letting go.
    fn with_stdin(mut self) -> Self {
        self.0.stdin(Stdio::piped());
        self
    }

    fn spawn(mut self) -> Result<Child> {
        self.0
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a client process")
    }
}

fn spawn_client(
    svc: &Service,
    dir: &str,
    n: u64,
    mode: &str,
    start_ms: u64,
    local: &Path,
) -> ClientCommand {
    let mut c = Command::new(std::env::current_exe().unwrap_or_else(|_| "quiltfs-bench".into()));
    c.arg("cudele-client");
    ClientCommand(c)
        .arg("--addr", &svc.addr)
        .arg("--secret", &svc.secret)
        .arg("--dir", dir)
        .arg("--n", n.to_string())
        .arg("--mode", mode)
        .arg("--start-ms", start_ms.to_string())
        .arg("--local", local)
}

/// Waits for a client process: the `start end` (ms) it printed.
fn client_times(kid: Child, mode: &str) -> Result<(u64, u64)> {
    let words = client_output(kid, mode)?;
    match words.as_slice() {
        [s, e, ..] => Ok((*s, *e)),
        _ => bail!("a {mode} client printed {words:?}"),
    }
}

/// Waits for a client process: the numbers it printed.
fn client_output(kid: Child, mode: &str) -> Result<Vec<u64>> {
    let out = kid.wait_with_output()?;
    if !out.status.success() {
        bail!("a {mode} client failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .map(|w| w.parse::<u64>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow!("a {mode} client printed {text:?}"))
}

/// The same create loop on local ext4 (a loop mount of a file), as root.
fn ext4(work: &Path, n: u64, run: usize) -> Result<Option<Row>> {
    let Some(m) = cudele_mounts::ext4(work)? else {
        return Ok(None);
    };
    let s = cudele_mounts::create_loop(&m.dir.join(format!("dir{run}")), n)?;
    m.unmount()?;
    Ok(Some(one_client_row("ext4", "mechanisms", n, run, s)))
}

/// A row of one client's `n` creates in `seconds`.
fn one_client_row(system: &str, workload: &str, n: u64, run: usize, seconds: f64) -> Row {
    Row {
        system: system.to_string(),
        workload: workload.into(),
        clients: 1,
        run,
        creates: n,
        seconds,
        creates_per_s: n as f64 / seconds.max(1e-9),
    }
}

/// The service's FUSE mounts: RPC mode with and without Stream, and decoupled (the
/// creates alone; the merge at unmount is not timed).
fn mounts(svc: &Service, work: &Path, n: u64, run: usize) -> Result<Vec<Row>> {
    let c = svc.connect("bench mounts")?;
    let mut rows = Vec::new();
    for (system, settings) in [
        ("rpcs+stream", "preset=posix".to_string()),
        ("rpcs", "consistency=strong durability=none".to_string()),
        (
            "decoupled",
            format!("consistency=weak durability=none inodes={} sync=0", n + 100),
        ),
    ] {
        let dir = format!("mount-{}-{run}", system.replace('+', "-"));
        subtree(&c, &dir, &settings)?;
        let m = cudele_mounts::Mounted::quiltfs(&svc.address(&dir), &work.join("mnt"))?;
        let s = cudele_mounts::create_loop(&m.dir.join("d"), n)?;
        m.unmount()?;
        rows.push(one_client_row(system, "mount", n, run, s));
    }
    Ok(rows)
}

/// Use case 3: the same creates through a decoupled mount with no namespace sync and
/// with a sync every `interval` seconds (weak, durability none: each sync a Volatile
/// Apply of what came since the last).
fn use_case_3(
    svc: &Service,
    work: &Path,
    n: u64,
    intervals: &[u64],
    run: usize,
) -> Result<Vec<Row>> {
    let c = svc.connect("bench use case 3")?;
    let mut rows = Vec::new();
    for &every in std::iter::once(&0).chain(intervals) {
        let dir = format!("uc3-{every}-{run}");
        subtree(
            &c,
            &dir,
            &format!(
                "consistency=weak durability=none inodes={} sync={every}",
                n + 100
            ),
        )?;
        let m = cudele_mounts::Mounted::quiltfs(&svc.address(&dir), &work.join("mnt"))?;
        let s = cudele_mounts::create_loop(&m.dir.join("d"), n)?;
        m.unmount()?;
        let system = if every == 0 {
            "no sync".to_string()
        } else {
            format!("sync {every} s")
        };
        rows.push(one_client_row(&system, "use-case-3", n, run, s));
    }
    Ok(rows)
}

/// The peers a user would pick instead, each brought up once for every run.
struct Peers {
    ceph: Option<(crate::gnothi::ceph::Ceph, PathBuf)>,
    sshfs: Option<cudele_mounts::Sshfs>,
}

impl Peers {
    fn up(a: &CudeleArgs, wanted: &[String]) -> Result<Peers> {
        let mut p = Peers {
            ceph: None,
            sshfs: None,
        };
        for w in wanted {
            match w.as_str() {
                "cephfs" => {
                    crate::apt_install(crate::gnothi::ceph::CEPHFS_PACKAGES)?;
                    p.ceph = Some(crate::gnothi::ceph::Ceph::cephfs(
                        &a.work.join("ceph"),
                        a.port + 10,
                    )?);
                }
                "sshfs" => {
                    crate::apt_install(cudele_mounts::SSHFS_PACKAGES)?;
                    p.sshfs = Some(cudele_mounts::Sshfs::up(
                        &a.work.join("sshfs"),
                        a.port + 20,
                    )?);
                }
                "none" | "" => {}
                other => bail!("--peers {other}: cephfs, sshfs or none"),
            }
        }
        Ok(p)
    }

    /// One run of the create loop on each peer, and on local ext4.
    fn measure(&self, work: &Path, n: u64, run: usize) -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        if let Some((_, mnt)) = &self.ceph {
            let s = cudele_mounts::create_loop(&mnt.join(format!("run{run}")), n)?;
            rows.push(one_client_row("cephfs", "mount", n, run, s));
        }
        if let Some(m) = self.sshfs.as_ref().and_then(|s| s.mount.as_ref()) {
            let s = cudele_mounts::create_loop(&m.dir.join(format!("run{run}")), n)?;
            rows.push(one_client_row("sshfs", "mount", n, run, s));
        }
        if let Some(m) = cudele_mounts::ext4(work)? {
            let s = cudele_mounts::create_loop(&m.dir.join("d"), n)?;
            m.unmount()?;
            rows.push(one_client_row("ext4", "mount", n, run, s));
        }
        Ok(rows)
    }
}

pub fn run(a: CudeleArgs) -> Result<()> {
    crate::catch_interrupts();
    let runs = a.runs.unwrap_or(if a.quick { 1 } else { 3 });
    let n = a.creates.unwrap_or(if a.quick { 5_000 } else { 100_000 });
    let clients: Vec<u32> = a
        .clients
        .clone()
        .unwrap_or_else(|| {
            if a.quick {
                "1,2".into()
            } else {
                "1,2,4".into()
            }
        })
        .split(',')
        .map(|s| s.trim().parse().context("--clients"))
        .collect::<Result<_>>()?;
    std::fs::create_dir_all(&a.work)?;
    std::fs::create_dir_all(&a.out)?;
    let local = a.work.join("journals");
    std::fs::create_dir_all(&local)?;
    let modes = ["rpcs", "create", "create+merge"];
    let mount_n = a.mount_creates.unwrap_or(if a.quick { 500 } else { 5_000 });
    let uc3_n = a
        .uc3_creates
        .unwrap_or(if a.quick { 20_000 } else { 1_000_000 });
    let uc3_every: Vec<u64> = a
        .uc3_intervals
        .clone()
        .unwrap_or_else(|| {
            if a.quick {
                "1".into()
            } else {
                "1,5,10,25".into()
            }
        })
        .split(',')
        .map(|s| s.trim().parse().context("--uc3-intervals"))
        .collect::<Result<_>>()?;
    let peers: Vec<String> = a
        .peers
        .clone()
        .unwrap_or_else(|| {
            if a.quick {
                "none".into()
            } else {
                "cephfs,sshfs".into()
            }
        })
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let uc2_n = a.uc2_creates.unwrap_or(if a.quick { 300 } else { 10_000 });
    let steps = runs * (6 + clients.len() * modes.len());
    let mut p = Progress::new(steps as u64, "steps");
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut bytes = Vec::new();
    let mut rogues = Vec::new();
    p.step(format!("bringing up the peers: {}", peers.join(", ")));
    let peer = Peers::up(&a, &peers)?;
    for run in 0..runs {
        if crate::interrupted() {
            bail!("interrupted");
        }
        p.step(format!("run {run}: mechanisms, {n} creates"));
        let (r, b) = mechanisms(&a, n, run, &local)?;
        rows.extend(r);
        bytes.push(b);
        p.inc();
        let svc = Service::start(&a.work, &a.fs, a.port, a.merge_batch)?;
        for &k in &clients {
            for mode in modes {
                if crate::interrupted() {
                    bail!("interrupted");
                }
                p.step(format!("run {run}: use case 1, {k} clients, {mode}"));
                rows.push(use_case_1(&svc, k, n, mode, run, &local)?);
                p.inc();
            }
        }
        p.step(format!(
            "run {run}: use case 2, {} clients × {uc2_n} creates, alone, {}",
            a.uc2_clients,
            rogue::CASES.join(", ")
        ));
        let alone = rogue::alone(&svc, uc2_n, run, &local)?;
        let pace = alone.creates_per_s.round() as u64;
        rows.push(alone);
        for case in rogue::CASES {
            let (row, r) = rogue::case(&svc, case, a.uc2_clients, uc2_n, pace, run, &local)?;
            rows.push(row);
            rogues.extend(r);
        }
        p.inc();
        p.step(format!(
            "run {run}: {mount_n} creates through the service's mounts"
        ));
        rows.extend(mounts(&svc, &a.work, mount_n, run)?);
        p.inc();
        p.step(format!("run {run}: use case 3, {uc3_n} creates a interval"));
        rows.extend(use_case_3(&svc, &a.work, uc3_n, &uc3_every, run)?);
        p.inc();
        drop(svc);
        p.step(format!("run {run}: ext4 and the peers"));
        rows.extend(ext4(&a.work, n, run)?);
        rows.extend(peer.measure(&a.work, mount_n, run)?);
        p.inc();
    }
    drop(peer);
    p.finish();
    let _ = std::fs::remove_dir_all(&local);
    let _ = std::fs::remove_file(a.work.join("ns.img"));
    write_report(
        &a,
        runs,
        n,
        &rows,
        &rogues,
        &bytes,
        started.elapsed().as_secs_f64(),
    )?;
    eprintln!("bench: results in {}", a.out.display());
    Ok(())
}

fn cell(rows: &[Row], workload: &str, system: &str, clients: u32) -> Option<(f64, f64, f64)> {
    let v: Vec<f64> = rows
        .iter()
        .filter(|r| r.workload == workload && r.system == system && r.clients == clients)
        .map(|r| r.seconds)
        .collect();
    (!v.is_empty()).then(|| median(v))
}

fn rate(rows: &[Row], workload: &str, system: &str, clients: u32) -> Option<(f64, f64, f64)> {
    let v: Vec<f64> = rows
        .iter()
        .filter(|r| r.workload == workload && r.system == system && r.clients == clients)
        .map(|r| r.creates_per_s)
        .collect();
    (!v.is_empty()).then(|| median(v))
}

const MECHANISMS: [&str; 7] = [
    "append client journal",
    "volatile apply",
    "nonvolatile apply",
    "local persist",
    "global persist",
    "rpcs",
    "stream",
];
const COMPOSITIONS: [&str; 5] = ["posix", "hdfs", "batchfs", "deltafs", "ramdisk"];

fn write_report(
    a: &CudeleArgs,
    runs: usize,
    n: u64,
    rows: &[Row],
    rogues: &[rogue::Rogue],
    bytes: &[f64],
    elapsed: f64,
) -> Result<()> {
    let out = &a.out;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "meta": {"quick": a.quick, "runs": runs, "creates": n, "fs": a.fs, "elapsed_s": elapsed},
            "rows": rows,
            "rogue": rogues,
            "journal_bytes_per_create": bytes,
        }))?,
    )?;
    std::fs::write(out.join("results.csv"), crate::csv(rows)?)?;
    let mut md = String::new();
    writeln!(
        md,
        "# Cudele on quiltfs: mechanisms, use cases 1, 2 and 3, mounts and peers\n"
    )?;
    writeln!(
        md,
        "{} creates per client, {runs} run(s), store: {}, medians (min–max). One machine: \
         the service and every client share its cores.\n",
        n, a.fs
    )?;
    let base = cell(rows, "mechanisms", "append client journal", 1).map(|c| c.0);
    writeln!(md, "## Mechanisms and compositions (figure 4)\n")?;
    writeln!(md, "| | seconds | creates/s | ÷ Append Client Journal |")?;
    writeln!(md, "|---|---|---|---|")?;
    let mut bars = Vec::new();
    for s in MECHANISMS
        .iter()
        .chain(COMPOSITIONS.iter())
        .chain(["ext4"].iter())
    {
        let Some(c) = cell(rows, "mechanisms", s, 1) else {
            continue;
        };
        let r = rate(rows, "mechanisms", s, 1).map_or(0.0, |r| r.0);
        let norm = base.map(|b| c.0 / b.max(1e-9));
        writeln!(
            md,
            "| {s} | {:.3} ({:.3}–{:.3}) | {:.0} | {} |",
            c.0,
            c.1,
            c.2,
            r,
            norm.map_or("–".into(), |x| format!("{x:.2}×"))
        )?;
        bars.push((s.to_string(), vec![norm.map(|x| (x, x, x))]));
    }
    let (bpe, _, _) = median(bytes.to_vec());
    writeln!(
        md,
        "\nJournal: {bpe:.1} bytes per create event (the paper: ~2,500).\n"
    )?;
    writeln!(
        md,
        "## Use case 1: creates in private directories (figure 5a)\n"
    )?;
    writeln!(md, "| clients | rpcs c/s | create c/s | create+merge c/s | create ÷ rpcs | create+merge ÷ rpcs |")?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    let mut ks: Vec<u32> = rows
        .iter()
        .filter(|r| r.workload == "use-case-1")
        .map(|r| r.clients)
        .collect();
    ks.sort_unstable();
    ks.dedup();
    let mut uc_bars = Vec::new();
    for k in &ks {
        let r = rate(rows, "use-case-1", "rpcs", *k).map(|c| c.0);
        let c = rate(rows, "use-case-1", "create", *k).map(|c| c.0);
        let m = rate(rows, "use-case-1", "create+merge", *k).map(|c| c.0);
        let f = |x: Option<f64>| x.map_or("–".into(), |v| format!("{v:.0}"));
        let q = |x: Option<f64>, y: Option<f64>| match (x, y) {
            (Some(x), Some(y)) if y > 0.0 => format!("{:.1}×", x / y),
            _ => "–".into(),
        };
        writeln!(
            md,
            "| {k} | {} | {} | {} | {} | {} |",
            f(r),
            f(c),
            f(m),
            q(c, r),
            q(m, r)
        )?;
        uc_bars.push((
            format!("{k} client(s)"),
            vec![r, c, m]
                .into_iter()
                .map(|v| v.map(|x| (x, x, x)))
                .collect(),
        ));
    }
    writeln!(md, "\n## Goals (issue 50)\n")?;
    let append_rate = rate(rows, "mechanisms", "append client journal", 1).map(|c| c.0);
    let rpc_rate = rate(rows, "mechanisms", "rpcs", 1).map(|c| c.0);
    let vapply_rate = rate(rows, "mechanisms", "volatile apply", 1).map(|c| c.0);
    let judge = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not judged",
    };
    writeln!(
        md,
        "- Append Client Journal ≥ 200,000 creates/s through the library: {:.0} — {}",
        append_rate.unwrap_or(0.0),
        judge(append_rate.map(|r| r >= 200_000.0))
    )?;
    let ratio = append_rate.zip(rpc_rate).map(|(a, r)| a / r.max(1e-9));
    writeln!(
        md,
        "- Decoupled ÷ RPCs ≥ 20× through the library: {} — {}",
        ratio.map_or("–".into(), |r| format!("{r:.1}×")),
        judge(ratio.map(|r| r >= 20.0))
    )?;
    writeln!(
        md,
        "- Volatile Apply ≥ 300,000 validated events/s: {:.0} — {}",
        vapply_rate.unwrap_or(0.0),
        judge(vapply_rate.map(|r| r >= 300_000.0))
    )?;
    let k4 = ks.iter().copied().filter(|&k| k <= 4).max();
    if let Some(k) = k4 {
        let m = rate(rows, "use-case-1", "create+merge", k).map(|c| c.0);
        let r = rate(rows, "use-case-1", "rpcs", k).map(|c| c.0);
        let x = m.zip(r).map(|(m, r)| m / r.max(1e-9));
        writeln!(
            md,
            "- Create plus merge ≥ 5× RPCs at 4 clients (here {k}): {} — {}",
            x.map_or("–".into(), |r| format!("{r:.1}×")),
            judge(if k == 4 { x.map(|r| r >= 5.0) } else { None })
        )?;
    }
    writeln!(
        md,
        "- Journal ≤ 256 bytes per create: {bpe:.1} — {}",
        judge(Some(bpe <= 256.0))
    )?;
    let m_dec = rate(rows, "mount", "decoupled", 1).map(|c| c.0);
    let m_rpc = rate(rows, "mount", "rpcs", 1).map(|c| c.0);
    let m_posix = rate(rows, "mount", "rpcs+stream", 1).map(|c| c.0);
    let m_ceph = rate(rows, "mount", "cephfs", 1).map(|c| c.0);
    let x = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b.max(1e-9));
    let shown = |r: Option<f64>| r.map_or("–".into(), |r| format!("{r:.1}×"));
    let d_r = x(m_dec, m_rpc);
    writeln!(
        md,
        "- Decoupled creates through the FUSE mount ≥ 10× RPC-mode creates through the \
         mount: {} (÷ RPCs with Stream: {}) — {}",
        shown(d_r),
        shown(x(m_dec, m_posix)),
        judge(d_r.map(|r| r >= 10.0))
    )?;
    let r_c = x(m_rpc, m_ceph);
    writeln!(
        md,
        "- RPC mode ≥ CephFS through ceph-fuse: {} (with Stream: {}) — {}",
        shown(r_c),
        shown(x(m_posix, m_ceph)),
        judge(r_c.map(|r| r >= 1.0))
    )?;
    let d_c = x(m_dec, m_ceph);
    writeln!(
        md,
        "- Decoupled through the FUSE mount ≥ 10× CephFS: {} — {}",
        shown(d_c),
        judge(d_c.map(|r| r >= 10.0))
    )?;
    writeln!(
        md,
        "\n## Creates through mounts (one process, one directory)\n"
    )?;
    writeln!(md, "| system | creates/s | ÷ ext4 | ÷ cephfs |")?;
    writeln!(md, "|---|---|---|---|")?;
    let m_ext4 = rate(rows, "mount", "ext4", 1).map(|c| c.0);
    let mut mount_bars = Vec::new();
    for sys in [
        "decoupled",
        "rpcs",
        "rpcs+stream",
        "cephfs",
        "sshfs",
        "ext4",
    ] {
        let Some((r, lo, hi)) = rate(rows, "mount", sys, 1) else {
            continue;
        };
        writeln!(
            md,
            "| {sys} | {r:.0} ({lo:.0}–{hi:.0}) | {} | {} |",
            shown(x(Some(r), m_ext4)),
            shown(x(Some(r), m_ceph))
        )?;
        mount_bars.push((sys.to_string(), vec![Some((r, lo, hi))]));
    }
    writeln!(
        md,
        "\n`decoupled`: a FUSE mount of a weak subtree (the client's own view and \
         journal; the merge at unmount not timed); `rpcs`: a mount of a strong subtree \
         without durability, `rpcs+stream` with global durability (each create durable \
         at the service before it returns); `cephfs`: a one-machine Ceph (one monitor, \
         one OSD on a file, one MDS) through ceph-fuse; `sshfs`: over loopback to this \
         machine's disk; `ext4`: the kernel on a loop device.\n"
    )?;
    writeln!(
        md,
        "## Use case 3: namespace sync while creating (decoupled mount)\n"
    )?;
    writeln!(md, "| interval | seconds | creates/s | overhead |")?;
    writeln!(md, "|---|---|---|---|")?;
    let base3 = cell(rows, "use-case-3", "no sync", 1).map(|c| c.0);
    let mut systems3: Vec<(u64, String)> = rows
        .iter()
        .filter(|r| r.workload == "use-case-3")
        .map(|r| {
            let secs = r
                .system
                .strip_prefix("sync ")
                .and_then(|t| t.trim_end_matches(" s").parse().ok())
                .unwrap_or(0);
            (secs, r.system.clone())
        })
        .collect();
    systems3.sort();
    systems3.dedup();
    let mut overheads = Vec::new();
    for (secs, sys) in &systems3 {
        let Some((t, lo, hi)) = cell(rows, "use-case-3", sys, 1) else {
            continue;
        };
        let r = rate(rows, "use-case-3", sys, 1).map_or(0.0, |r| r.0);
        let over = base3.map(|b| (t / b.max(1e-9) - 1.0) * 100.0);
        if *secs > 0 {
            overheads.push((*secs, over));
        }
        writeln!(
            md,
            "| {sys} | {t:.2} ({lo:.2}–{hi:.2}) | {r:.0} | {} |",
            over.map_or("–".into(), |o| format!("{o:+.1}%"))
        )?;
    }
    for (limit, at) in [(3.0, 1u64), (1.0, 10)] {
        if let Some((_, o)) = overheads.iter().find(|(s, _)| *s == at) {
            writeln!(
                md,
                "\n- Namespace sync overhead ≤ {limit}% at {at} s: {} — {}",
                o.map_or("–".into(), |o| format!("{o:+.1}%")),
                judge(o.map(|o| o <= limit))
            )?;
        }
    }
    rogue::report(&mut md, rows, rogues, judge)?;
    std::fs::write(out.join("report.md"), md)?;
    if plot::font() {
        plot::bars(
            &out.join("mechanisms.png"),
            "Cudele mechanisms: time for the same creates, ÷ Append Client Journal",
            "×",
            &["normalized time"],
            &bars,
        )?;
        if !mount_bars.is_empty() {
            plot::bars(
                &out.join("mounts.png"),
                "Creates through mounts: creates per second",
                "creates/s",
                &["creates/s"],
                &mount_bars,
            )?;
        }
        plot::bars(
            &out.join("use-case-1.png"),
            "Use case 1: creates per second, all clients",
            "creates/s",
            &["rpcs", "create", "create+merge"],
            &uc_bars,
        )?;
    }
    Ok(())
}
