//! `quiltfs replica …` (one replica server of a Gnothi volume) and `quiltfs cluster …`
//! (a whole volume's replicas as local processes, for trying it on one machine).

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use quilt_gnothi::node::NodeConfig;
use quilt_gnothi::server::{self, LogSizes, ServeOptions};
use quilt_gnothi::transport::GrpcNet;
use quilt_gnothi::{Geometry, System};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
pub enum SystemArg {
    /// Data on the f+1 replicas of each slice's rotated preferred quorum.
    Gnothi,
    /// Data on every replica (Gaios-like full replication).
    Gprime,
    /// f+1 main replicas hold data; f auxiliaries only on failure.
    CheapPaxos,
    /// One unreplicated replica (f = 0): the local-disk baseline on the same code path.
    Local,
}

impl From<SystemArg> for System {
    fn from(s: SystemArg) -> System {
        match s {
            SystemArg::Gnothi => System::Gnothi,
            SystemArg::Gprime => System::GPrime,
            SystemArg::CheapPaxos => System::CheapPaxos,
            SystemArg::Local => System::Local,
        }
    }
}

#[derive(Subcommand)]
pub enum ReplicaCommand {
    /// Label a replica's log device and prepare its data device (files are created).
    Format(FormatArgs),
    /// Run one replica server until SIGTERM or ctrl-c.
    Serve(ServeArgs),
}

#[derive(Args)]
pub struct VolumeShape {
    /// Volume name (what addresses end with).
    #[arg(long, default_value = "vol0")]
    pub volume: String,
    /// How data is placed.
    #[arg(long, value_enum, default_value = "gnothi")]
    pub system: SystemArg,
    /// Failures tolerated: the volume has 2f+1 replicas.
    #[arg(long, default_value_t = 1)]
    pub f: u16,
    /// Volume size, bytes (K, M, G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    #[arg(long, default_value_t = 4096)]
    pub block_size: u32,
    /// Slice size, bytes (each slice has one preferred quorum).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub slice: u64,
    /// Reserve slots on each data device (blocks a replica can hold for others).
    #[arg(long, default_value_t = 16384)]
    pub reserve_slots: u64,
}

impl VolumeShape {
    fn geometry(&self) -> Result<Geometry> {
        let bs = u64::from(self.block_size);
        Geometry::new(
            self.system.into(),
            self.f,
            self.block_size,
            self.size / bs,
            (self.slice / bs).max(1),
        )
        .map_err(|e| anyhow!("{e}"))
    }
}

#[derive(Args)]
pub struct FormatArgs {
    #[arg(long)]
    pub id: u16,
    /// For a server replacing another in slot ID: how many servers held the slot
    /// before (1 for the first replacement). Its agreement id is then ID + n·this;
    /// start it, then let it in with `quiltfs cluster replace`.
    #[arg(long, default_value_t = 0)]
    pub incarnation: u32,
    #[arg(long)]
    pub log_dev: PathBuf,
    #[arg(long)]
    pub data_dev: PathBuf,
    #[command(flatten)]
    pub shape: VolumeShape,
}

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long)]
    pub id: u16,
    /// Address to listen on (HOST:PORT).
    #[arg(long)]
    pub listen: std::net::SocketAddr,
    /// Every replica's address, in id order: HOST:PORT,HOST:PORT,…
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    #[arg(long)]
    pub log_dev: PathBuf,
    #[arg(long)]
    pub data_dev: PathBuf,
    /// File holding the cluster's shared secret.
    #[arg(long)]
    pub secret_file: PathBuf,
    /// Phase 2: milliseconds between fetches of missing data.
    #[arg(long, default_value_t = 10)]
    pub recovery_interval_ms: u64,
    /// Client writes put in one agreement entry, at most (the paper's batch: 10).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub write_batch: u64,
    /// Reads that share one confirmation of the leader's read index, at most (the
    /// paper's batch: 100).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=10000))]
    pub read_batch: u64,
    /// For benchmarks: both devices behave as 7200 RPM disks (the rotating-disk model,
    /// real time) and flushes stop at the model (not crash-safe on the host).
    #[arg(long)]
    pub model_disks: bool,
    /// The data device is a new, empty disk in place of a failed one (created if it
    /// does not exist): the volume is told this replica holds nothing before it
    /// serves, and re-replication rebuilds its copies. Needs the other replicas to
    /// have a leader.
    #[arg(long)]
    pub new_data_disk: bool,
    /// TLS: this replica's certificate (PEM; it must name the host of its address),
    /// its key, and the CA that signed every replica's certificate. All three or none.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Serve Prometheus metrics (role, log index and lag, INCOMPLETE blocks, reserve
    /// and log use, device requests) at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        Some('T' | 't') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 512M, 4G)"))
}

pub fn run_replica(c: ReplicaCommand) -> Result<()> {
    match c {
        ReplicaCommand::Format(a) => {
            let g = a.shape.geometry()?;
            if a.id >= g.replicas() {
                bail!(
                    "replica {} is not in a volume of {} replicas",
                    a.id,
                    g.replicas()
                );
            }
            let mut label = server::label_for(
                a.id,
                &a.shape.volume,
                g,
                a.shape.reserve_slots,
                LogSizes::default(),
            );
            label.incarnation = a.incarnation;
            server::format(&label, &a.log_dev, &a.data_dev).map_err(|e| anyhow!(e))?;
            if a.incarnation > 0 {
                eprintln!(
                    "quiltfs: server {} for slot {} formatted; start it with `quiltfs replica serve --id {}`, then `quiltfs cluster replace ADDRESS --replica {} --address HOST:PORT --incarnation {}`",
                    label.node_id(),
                    a.id,
                    a.id,
                    a.id,
                    a.incarnation
                );
            }
            eprintln!(
                "quiltfs: replica {} of volume {} formatted ({} replicas, {} blocks of {} bytes)",
                a.id,
                a.shape.volume,
                g.replicas(),
                g.blocks,
                g.block_size
            );
            Ok(())
        }
        ReplicaCommand::Serve(a) => serve(a),
    }
}

fn read_secret(path: &Path) -> Result<String> {
    let s = std::fs::read_to_string(path)
        .with_context(|| format!("reading the cluster secret {}", path.display()))?;
    let s = s.trim().to_string();
    if s.len() < 16 {
        bail!(
            "the cluster secret in {} is shorter than 16 characters",
            path.display()
        );
    }
    Ok(s)
}

fn serve(a: ServeArgs) -> Result<()> {
    // Every write and read passes through megabyte buffers taken and freed per
    // request; handing their pages back to the system at once made page faults and
    // unmapping a fifth of a replica's CPU (perf, 1 MiB writes on plain files), and
    // keeping them a second doubled 1 MiB reads. The memory held is at most what a
    // second's requests used.
    crate::set_allocator_purge_delay(1000);
    let secret = read_secret(&a.secret_file)?;
    let read = |p: &Path, what: &str| {
        std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
    };
    let tls = match (&a.tls_cert, &a.tls_key, &a.tls_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(server::ReplicaTls {
            identity: quilt_gnothi::transport::TlsIdentity {
                cert_pem: read(cert, "certificate")?,
                key_pem: read(key, "key")?,
            },
            ca_pem: read(ca, "CA")?,
        }),
        _ => None,
    };
    let peers: BTreeMap<u64, String> = a
        .peers
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, p)| (i as u64, p))
        .collect();
    let opts = ServeOptions {
        id: a.id,
        listen: a.listen,
        peers,
        log: a.log_dev,
        data: a.data_dev,
        secret,
        config: NodeConfig {
            recovery_interval: Duration::from_millis(a.recovery_interval_ms),
            write_batch: a.write_batch as usize,
            read_batch: a.read_batch as usize,
            ..NodeConfig::default()
        },
        model_disks: a.model_disks,
        new_data_disk: a.new_data_disk,
        tls,
        metrics: a.metrics,
    };
    // The Raft log's appends and the state machine's placements wait for their disks
    // on the workers that run them: enough workers that heartbeats and answers still
    // run meanwhile.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let stop = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return std::future::pending().await,
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        server::run(opts, stop).await.map_err(|e| anyhow!(e))
    })
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Format and start a volume's replicas as local processes in DIR; prints the
    /// volume's address.
    Up(UpArgs),
    /// Stop one replica (SIGTERM), or with --kill, kill -9 it.
    Stop {
        dir: PathBuf,
        #[arg(long)]
        replica: u16,
        #[arg(long)]
        kill: bool,
    },
    /// Replace a replica's data disk by an empty one (its data file is deleted) and
    /// start it on it: the volume is told the replica holds nothing, and re-replication
    /// rebuilds its copies from the others.
    ReplaceDisk {
        dir: PathBuf,
        #[arg(long)]
        replica: u16,
    },
    /// Replace a replica's whole server (both disks) by a new, empty one through a
    /// membership change: it joins as a learner, catches up, takes the old one's place
    /// as a voter, and its copies are rebuilt from the others. For a cluster directory
    /// this does it all (the old server is killed; the new one gets new files and a
    /// new port). For a volume's address, format and start the new server first
    /// (`replica format --incarnation`, `replica serve`) and name it here.
    Replace {
        /// A cluster directory (of `cluster up`) or a volume's address (gnothi://…).
        #[arg(value_name = "DIR|ADDRESS")]
        target: String,
        #[arg(long)]
        replica: u16,
        /// (With an address.) Where the new server listens.
        #[arg(long)]
        address: Option<String>,
        /// (With an address.) The new server's incarnation, as it was formatted.
        #[arg(long)]
        incarnation: Option<u32>,
    },
    /// Start a stopped replica again, on its devices as they are.
    Start {
        dir: PathBuf,
        #[arg(long)]
        replica: u16,
    },
    /// Each replica's role, log index, INCOMPLETE blocks, reserve use.
    Status {
        /// A cluster directory (of `cluster up`) or a volume's address (gnothi://…).
        #[arg(value_name = "DIR|ADDRESS")]
        target: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop every replica.
    Down { dir: PathBuf },
    /// Verify every copy each replica holds against its checksum (latent damage found
    /// before a second failure could make it the last copy); damaged copies are
    /// fetched again from the others.
    Scrub {
        /// A cluster directory (of `cluster up`) or a volume's address (gnothi://…).
        #[arg(value_name = "DIR|ADDRESS")]
        target: String,
    },
    /// What each replica knows and keeps of one block: its table's version, checksum
    /// and holders, and its home and reserve copies (for diagnosis; not a read).
    Inspect {
        /// A cluster directory (of `cluster up`) or a volume's address (gnothi://…).
        #[arg(value_name = "DIR|ADDRESS")]
        target: String,
        block: u64,
    },
    /// Check a volume from outside: clients write and read its first blocks
    /// (overwriting them) while you break replicas, then every block is read once more
    /// and the history must be linearizable.
    Check(crate::cluster_check::CheckArgs),
    /// Copy a volume's contents into an image file (for e2fsck, or a backup).
    Export {
        /// The volume's address (gnothi://…).
        address: String,
        file: PathBuf,
    },
}

#[derive(Args)]
pub struct UpArgs {
    #[arg(long)]
    pub dir: PathBuf,
    /// Number of replicas (2f+1).
    #[arg(long, default_value_t = 3)]
    pub replicas: u16,
    /// Volume size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    #[arg(long, value_enum, default_value = "gnothi")]
    pub system: SystemArg,
    #[arg(long, default_value = "vol0")]
    pub volume: String,
    /// First port; replica N listens on PORT+N.
    #[arg(long, default_value_t = 7400)]
    pub port: u16,
    /// Phase 2: milliseconds between a recovering replica's fetches of missing data
    /// (16 MiB each).
    #[arg(long, default_value_t = 10)]
    pub recovery_interval_ms: u64,
    /// Reserve slots on each data device (blocks a replica can hold for others).
    #[arg(long, default_value_t = 16384)]
    pub reserve_slots: u64,
    /// For benchmarks: every replica's devices behave as 7200 RPM disks (modelled
    /// timing) and flushes stop at the model (not crash-safe on the host).
    #[arg(long)]
    pub model_disks: bool,
    /// Replicas talk TLS: a CA and a certificate per replica are made in DIR, and the
    /// address names the CA (`tls-ca=DIR/ca.pem`).
    #[arg(long)]
    pub tls: bool,
    /// Each replica serves Prometheus metrics at http://127.0.0.1:(PORT+ID)/metrics.
    #[arg(long, value_name = "PORT")]
    pub metrics_port: Option<u16>,
}

#[derive(Serialize, Deserialize)]
struct ClusterFile {
    volume: String,
    replicas: Vec<ReplicaEntry>,
    /// How replicas are started (kept, so `cluster start` starts them the same way).
    #[serde(default = "default_recovery_interval")]
    recovery_interval_ms: u64,
    #[serde(default)]
    model_disks: bool,
    #[serde(default)]
    tls: bool,
    #[serde(default)]
    metrics_port: Option<u16>,
}

fn default_recovery_interval() -> u64 {
    10
}

#[derive(Serialize, Deserialize)]
struct ReplicaEntry {
    id: u16,
    addr: String,
    pid: Option<u32>,
    /// Servers replaced in this slot before the current one (its files are
    /// `r{id}.{incarnation}.log` and `.data` past the first).
    #[serde(default)]
    incarnation: u32,
}

/// A slot's current server's files in a cluster directory.
fn files(dir: &Path, id: u16, incarnation: u32) -> (PathBuf, PathBuf) {
    if incarnation == 0 {
        (
            dir.join(format!("r{id}.log")),
            dir.join(format!("r{id}.data")),
        )
    } else {
        (
            dir.join(format!("r{id}.{incarnation}.log")),
            dir.join(format!("r{id}.{incarnation}.data")),
        )
    }
}

fn cluster_file(dir: &Path) -> PathBuf {
    dir.join("cluster.json")
}

fn load(dir: &Path) -> Result<ClusterFile> {
    let f = cluster_file(dir);
    let s = std::fs::read_to_string(&f)
        .with_context(|| format!("no cluster in {} ({})", dir.display(), f.display()))?;
    serde_json::from_str(&s).with_context(|| format!("{} is damaged", f.display()))
}

fn save(dir: &Path, c: &ClusterFile) -> Result<()> {
    let tmp = dir.join("cluster.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(c)?)?;
    std::fs::rename(&tmp, cluster_file(dir))?;
    Ok(())
}

fn address(dir: &Path, c: &ClusterFile) -> String {
    let hosts: Vec<&str> = c.replicas.iter().map(|r| r.addr.as_str()).collect();
    let tls = if c.tls {
        format!("&tls-ca={}", dir.join("ca.pem").display())
    } else {
        String::new()
    };
    format!(
        "gnothi://{}/{}?secret-file={}{tls}",
        hosts.join(","),
        c.volume,
        dir.join("secret").display()
    )
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

/// Stops replica `replica` (SIGTERM, or SIGKILL with `kill`) and waits for it.
fn stop_replica(c: &mut ClusterFile, replica: u16, kill: bool) -> Result<()> {
    let r = c
        .replicas
        .get_mut(replica as usize)
        .ok_or_else(|| anyhow!("no replica {replica}"))?;
    match r.pid.take() {
        Some(pid) if alive(pid) => {
            let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
            // SAFETY: a pid this tool started and recorded.
            unsafe { libc::kill(pid as libc::pid_t, sig) };
            let t = Instant::now();
            while alive(pid) && t.elapsed() < Duration::from_secs(10) {
                reap();
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("quiltfs: replica {replica} stopped");
        }
        _ => eprintln!("quiltfs: replica {replica} was not running"),
    }
    Ok(())
}

/// A failed data disk replaced by an empty one: the replica is stopped, its data file
/// replaced by a new one, and it is started with `--new-data-disk`, which tells the
/// volume first; then it serves and rebuilds its copies from the others.
fn replace_disk(dir: &Path, replica: u16) -> Result<()> {
    let mut c = load(dir)?;
    stop_replica(&mut c, replica, true)?;
    save(dir, &c)?;
    let (_, data) = files(dir, replica, c.replicas[replica as usize].incarnation);
    match std::fs::remove_file(&data) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", data.display())),
    }
    let pid = spawn_with(dir, &c, replica, &["--new-data-disk"])?;
    c.replicas[replica as usize].pid = Some(pid);
    save(dir, &c)?;
    // It serves once the volume has taken the news; without a majority it gives up.
    let t = Instant::now();
    loop {
        reap();
        if !alive(pid) {
            c.replicas[replica as usize].pid = None;
            save(dir, &c)?;
            bail!(
                "replica {replica} did not start on its new disk (see {})",
                dir.join(format!("r{replica}.out")).display()
            );
        }
        if let Ok(st) = statuses(dir, &c) {
            if st.iter().any(|(id, s)| *id == replica && s.is_some()) {
                break;
            }
        }
        if t.elapsed() > Duration::from_secs(90) {
            bail!("replica {replica} (pid {pid}) is not serving after 90 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("quiltfs: replica {replica} serves on a new data disk (pid {pid}); its copies are being rebuilt (see `cluster status`)");
    Ok(())
}

/// Replaces slot `replica`'s whole server (see `ClusterCommand::Replace`).
fn replace_server(
    target: &str,
    replica: u16,
    address: Option<String>,
    incarnation: Option<u32>,
) -> Result<()> {
    if quilt_gnothi::device::VolumeAddress::is_address(target) {
        let (Some(addr), Some(inc)) = (address, incarnation) else {
            bail!("with a volume's address, name the new server: --address HOST:PORT --incarnation N (as it was formatted)");
        };
        let t = Target::resolve(target)?;
        let epoch = let_in(&t, replica, inc, &addr)?;
        eprintln!("quiltfs: slot {replica} is now served from {addr} (membership {epoch}); its copies are being rebuilt (see `cluster status`)");
        return Ok(());
    }
    if address.is_some() || incarnation.is_some() {
        bail!("--address and --incarnation are for a volume's address; a cluster directory picks them");
    }
    let dir = PathBuf::from(target);
    let mut c = load(&dir)?;
    let entry = c
        .replicas
        .get(replica as usize)
        .ok_or_else(|| anyhow!("no replica {replica} in {}", dir.display()))?;
    let (old_log, _) = files(&dir, replica, entry.incarnation);
    let incarnation = entry.incarnation + 1;
    let host = entry
        .addr
        .rsplit_once(':')
        .map_or("127.0.0.1", |(h, _)| h)
        .to_string();
    // The server it replaces is gone (a dead machine, say): killed here. (Its label,
    // read once it no longer holds the file, gives the new one's shape.)
    stop_replica(&mut c, replica, true)?;
    save(&dir, &c)?;
    let old = server::read_label(&old_log).map_err(|e| anyhow!(e))?;
    let mut label = server::label_for(
        replica,
        &old.volume,
        old.geometry,
        old.reserve_slots,
        LogSizes::default(),
    );
    label.incarnation = incarnation;
    let (log, data) = files(&dir, replica, incarnation);
    for p in [&log, &data] {
        if p.exists() {
            std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    server::format(&label, &log, &data).map_err(|e| anyhow!(e))?;
    // A port free now on the same host.
    let port = std::net::TcpListener::bind((host.as_str(), 0))
        .and_then(|l| l.local_addr())
        .with_context(|| format!("finding a free port on {host}"))?
        .port();
    let addr = format!("{host}:{port}");
    let old_addr = std::mem::replace(&mut c.replicas[replica as usize].addr, addr.clone());
    c.replicas[replica as usize].incarnation = incarnation;
    let pid = spawn(&dir, &c, replica)?;
    c.replicas[replica as usize].pid = Some(pid);
    save(&dir, &c)?;
    // The others still list the old address: the change itself tells them the new one.
    let mut t = Target::of_cluster(&dir, &c)?;
    t.peers.insert(u64::from(replica), old_addr);
    let epoch = let_in(&t, replica, incarnation, &addr).with_context(|| {
        format!(
            "the new server runs (pid {pid}, {}) but is not in yet; once the others have a \
             leader, let it in with: quiltfs cluster replace '{}' --replica {replica} \
             --address {addr} --incarnation {incarnation}",
            log.display(),
            t.address
        )
    })?;
    eprintln!(
        "quiltfs: slot {replica} is now served by server {} at {addr} (pid {pid}, membership {epoch}); its copies are being rebuilt (see `cluster status`)",
        label.node_id()
    );
    Ok(())
}

/// Asks the leader to let slot `replica`'s new server in (it must be running), until
/// it answers done or ten minutes pass (joining includes catching up).
fn let_in(t: &Target, replica: u16, incarnation: u32, addr: &str) -> Result<u64> {
    let st = statuses_of(t.peers.clone(), &t.secret, t.ca.clone())?;
    let Some(g) = st.iter().find_map(|(_, s)| s.as_ref().map(|s| s.geometry)) else {
        bail!("no replica of {} answers", t.volume);
    };
    if replica >= g.replicas() {
        bail!(
            "replica {replica} is not in a volume of {} replicas",
            g.replicas()
        );
    }
    let node = g.node_id(replica, incarnation);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let net =
            GrpcNet::with_tls(t.peers.clone(), &t.secret, t.ca.clone()).map_err(|e| anyhow!(e))?;
        use quilt_gnothi::net::Net;
        // Where every member is (a leader's id may be a server that replaced another).
        for s in st.iter().filter_map(|(_, s)| s.as_ref()) {
            for (id, a) in s.slots.iter().flatten() {
                if !a.is_empty() && *id >= u64::from(g.replicas()) {
                    net.learn(*id, a);
                }
            }
        }
        net.learn(node, addr);
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut to = st
            .iter()
            .find_map(|(_, s)| s.as_ref().and_then(|s| s.leader))
            .unwrap_or(0);
        let mut last;
        let mut turn = 0u64;
        let mut failing_since: Option<Instant> = None;
        loop {
            let r = quilt_gnothi::net::call_within(
                net.as_ref(),
                to,
                quilt_gnothi::rpc::Request::Replace {
                    slot: replica,
                    node,
                    addr: addr.to_string(),
                },
                Duration::from_secs(600),
            )
            .await;
            match r {
                Ok(quilt_gnothi::rpc::Response::Replaced { epoch }) => return Ok(epoch),
                Ok(quilt_gnothi::rpc::Response::Error(
                    quilt_gnothi::rpc::RpcError::NotLeader { leader: Some(l) },
                )) if l != to => {
                    to = l;
                    failing_since = None;
                    continue;
                }
                Ok(quilt_gnothi::rpc::Response::Error(e)) => last = e.to_string(),
                Ok(other) => last = other.unexpected().to_string(),
                Err(e) => last = e.to_string(),
            }
            // A leader may take minutes to bring the new server up to date (the
            // call waits for it); with no leader answering at all, half a minute.
            let since = *failing_since.get_or_insert_with(Instant::now);
            if Instant::now() >= deadline || since.elapsed() > Duration::from_secs(30) {
                bail!("the volume did not let server {node} in: {last}");
            }
            turn += 1;
            to = turn % u64::from(g.replicas());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

fn spawn(dir: &Path, c: &ClusterFile, id: u16) -> Result<u32> {
    spawn_with(dir, c, id, &[])
}

fn spawn_with(dir: &Path, c: &ClusterFile, id: u16, extra: &[&str]) -> Result<u32> {
    let me = std::env::current_exe().context("finding the quiltfs binary")?;
    let peers: Vec<&str> = c.replicas.iter().map(|r| r.addr.as_str()).collect();
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("r{id}.out")))?;
    let (log, data) = files(dir, id, c.replicas[id as usize].incarnation);
    let child = std::process::Command::new(me)
        .args(["replica", "serve", "--id", &id.to_string()])
        .args(["--listen", &c.replicas[id as usize].addr])
        .args(["--peers", &peers.join(",")])
        .arg("--log-dev")
        .arg(log)
        .arg("--data-dev")
        .arg(data)
        .arg("--secret-file")
        .arg(dir.join("secret"))
        .args([
            "--recovery-interval-ms",
            &c.recovery_interval_ms.to_string(),
        ])
        .args(c.model_disks.then_some("--model-disks"))
        .args(if c.tls {
            vec![
                "--tls-cert".into(),
                dir.join(format!("r{id}.crt")).into_os_string(),
                "--tls-key".into(),
                dir.join(format!("r{id}.key")).into_os_string(),
                "--tls-ca".into(),
                dir.join("ca.pem").into_os_string(),
            ]
        } else {
            Vec::new()
        })
        .args(
            c.metrics_port
                .map(|p| {
                    vec![
                        "--metrics".to_string(),
                        format!("127.0.0.1:{}", p.saturating_add(id)),
                    ]
                })
                .unwrap_or_default(),
        )
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .context("starting a replica")?;
    Ok(child.id())
}

/// A volume named on the command line: a cluster directory of `cluster up`, or any
/// volume's address.
struct Target {
    volume: String,
    address: String,
    peers: BTreeMap<u64, String>,
    secret: String,
    ca: Option<Vec<u8>>,
}

impl Target {
    fn resolve(target: &str) -> Result<Target> {
        if quilt_gnothi::device::VolumeAddress::is_address(target) {
            let a = quilt_gnothi::device::VolumeAddress::parse(target).map_err(|e| anyhow!(e))?;
            let secret = a.secret().map_err(|e| anyhow!(e))?;
            let ca = a.ca().map_err(|e| anyhow!(e))?;
            let peers = a.peers();
            Ok(Target {
                volume: a.volume,
                address: target.to_string(),
                peers,
                secret,
                ca,
            })
        } else {
            let dir = PathBuf::from(target);
            let c = load(&dir)?;
            Target::of_cluster(&dir, &c)
        }
    }

    /// A local cluster's volume, from its directory and cluster file.
    fn of_cluster(dir: &Path, c: &ClusterFile) -> Result<Target> {
        Ok(Target {
            volume: c.volume.clone(),
            address: address(dir, c),
            peers: c
                .replicas
                .iter()
                .map(|r| (u64::from(r.id), r.addr.clone()))
                .collect(),
            secret: read_secret(&dir.join("secret"))?,
            ca: c
                .tls
                .then(|| std::fs::read(dir.join("ca.pem")))
                .transpose()
                .context("reading the cluster's CA")?,
        })
    }
}

/// Sends `req` to every replica of `t` in turn (each bounded by `timeout`): their
/// answers by replica id, or why none came.
fn ask_each(
    t: &Target,
    req: quilt_gnothi::rpc::Request,
    timeout: Duration,
) -> Result<Vec<(u64, Result<quilt_gnothi::rpc::Response, String>)>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let net =
            GrpcNet::with_tls(t.peers.clone(), &t.secret, t.ca.clone()).map_err(|e| anyhow!(e))?;
        let mut out = Vec::new();
        for &id in t.peers.keys() {
            let r = quilt_gnothi::net::call_within(net.as_ref(), id, req.clone(), timeout).await;
            out.push((id, r.map_err(|e| e.to_string())));
        }
        Ok(out)
    })
}

/// Asks every replica to verify the copies it holds; damaged ones are fetched again.
fn scrub(target: &str) -> Result<()> {
    use quilt_gnothi::rpc::{Request, Response};
    let t = Target::resolve(target)?;
    let mut failed = 0;
    for (id, r) in ask_each(&t, Request::Scrub, Duration::from_secs(3600))? {
        match r {
            Ok(Response::Scrubbed { checked, damaged }) => {
                if damaged > 0 {
                    println!("replica {id}: {checked} copies verified, {damaged} damaged (being fetched again)");
                } else {
                    println!("replica {id}: {checked} copies verified, 0 damaged");
                }
            }
            Ok(Response::Error(e)) => {
                failed += 1;
                println!("replica {id}: {e}");
            }
            Ok(other) => {
                failed += 1;
                println!("replica {id}: {}", other.unexpected());
            }
            Err(e) => {
                failed += 1;
                println!("replica {id}: not scrubbed: {e}");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} replica(s) of {} not scrubbed", t.volume);
    }
    Ok(())
}

/// Prints each replica's view of `block`.
fn inspect(target: &str, block: u64) -> Result<()> {
    use quilt_gnothi::rpc::{Request, Response};
    let t = Target::resolve(target)?;
    let mut answered = 0;
    for (id, r) in ask_each(&t, Request::Inspect { block }, Duration::from_secs(5))? {
        match r {
            Ok(Response::Inspected(v)) => {
                answered += 1;
                println!("{v}");
            }
            Ok(Response::Error(e)) => println!("replica {id}: {e}"),
            Ok(other) => println!("replica {id}: {}", other.unexpected()),
            Err(e) => println!("replica {id}: no answer: {e}"),
        }
    }
    if answered == 0 {
        bail!("no replica of {} answered", t.volume);
    }
    Ok(())
}

fn statuses(dir: &Path, c: &ClusterFile) -> Result<Vec<(u16, Option<quilt_gnothi::rpc::Status>)>> {
    let t = Target::of_cluster(dir, c)?;
    statuses_of(t.peers, &t.secret, t.ca)
}

/// Each replica's status (`None`: it did not answer within a second).
fn statuses_of(
    peers: BTreeMap<u64, String>,
    secret: &str,
    ca: Option<Vec<u8>>,
) -> Result<Vec<(u16, Option<quilt_gnothi::rpc::Status>)>> {
    let ids: Vec<u64> = peers.keys().copied().collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let net = GrpcNet::with_tls(peers, secret, ca).map_err(|e| anyhow!(e))?;
        let mut out = Vec::new();
        for id in ids {
            let s = quilt_gnothi::net::call_within(
                net.as_ref(),
                id,
                quilt_gnothi::rpc::Request::Status,
                Duration::from_secs(1),
            )
            .await;
            out.push((
                id as u16,
                match s {
                    Ok(quilt_gnothi::rpc::Response::Status(s)) => Some(s),
                    _ => None,
                },
            ));
        }
        Ok(out)
    })
}

pub fn run_cluster(c: ClusterCommand) -> Result<()> {
    match c {
        ClusterCommand::Up(a) => up(a),
        ClusterCommand::Export { address, file } => export(&address, &file),
        ClusterCommand::Check(a) => crate::cluster_check::run(a),
        ClusterCommand::Scrub { target } => scrub(&target),
        ClusterCommand::Inspect { target, block } => inspect(&target, block),
        ClusterCommand::Stop { dir, replica, kill } => {
            let mut c = load(&dir)?;
            stop_replica(&mut c, replica, kill)?;
            save(&dir, &c)
        }
        ClusterCommand::ReplaceDisk { dir, replica } => replace_disk(&dir, replica),
        ClusterCommand::Replace {
            target,
            replica,
            address,
            incarnation,
        } => replace_server(&target, replica, address, incarnation),
        ClusterCommand::Start { dir, replica } => {
            let mut c = load(&dir)?;
            if c.replicas.get(replica as usize).is_none() {
                bail!("no replica {replica}");
            }
            if let Some(pid) = c.replicas[replica as usize].pid {
                if alive(pid) {
                    bail!("replica {replica} is running (pid {pid})");
                }
            }
            let pid = spawn(&dir, &c, replica)?;
            c.replicas[replica as usize].pid = Some(pid);
            save(&dir, &c)?;
            eprintln!("quiltfs: replica {replica} started (pid {pid})");
            Ok(())
        }
        ClusterCommand::Status { target, json } => {
            let t = Target::resolve(&target)?;
            let st = statuses_of(t.peers.clone(), &t.secret, t.ca.clone())?;
            let (volume, addr) = (t.volume, t.address);
            if json {
                let v: Vec<serde_json::Value> = st
                    .iter()
                    .map(|(id, s)| match s {
                        Some(s) => serde_json::json!({
                            "replica": id, "up": true, "server": s.node, "member": s.is_member, "membership": s.epoch,
                            "role": if s.is_leader { "leader" } else if !s.is_member { "joining" } else { "follower" },
                            "term": s.term, "log_index": s.last_log_index, "applied": s.applied,
                            "incomplete": s.incomplete, "reserve_used": s.reserve_used, "checksum_failures": s.checksum_failures,
                            "write_back_failures": s.write_back_failures,
                            "raft_log_used": s.raft_log_used, "raft_log_blocks": s.raft_log_blocks,
                            "data_log_used": s.data_log_used, "data_log_blocks": s.data_log_blocks,
                            "log_io": s.log_io, "data_io": s.data_io,
                        }),
                        None => serde_json::json!({"replica": id, "up": false}),
                    })
                    .collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({"volume": volume, "address": addr, "replicas": v})
                    )?
                );
            } else {
                println!("volume {volume}  {addr}");
                println!(
                    "{:>7} {:>6} {:>9} {:>6} {:>10} {:>10} {:>11} {:>9}",
                    "replica",
                    "server",
                    "role",
                    "term",
                    "log index",
                    "applied",
                    "incomplete",
                    "reserve"
                );
                for (id, s) in st {
                    match s {
                        Some(s) => println!(
                            "{id:>7} {:>6} {:>9} {:>6} {:>10} {:>10} {:>11} {:>9}",
                            s.node,
                            if s.is_leader {
                                "leader"
                            } else if !s.is_member {
                                "joining"
                            } else {
                                "follower"
                            },
                            s.term,
                            s.last_log_index,
                            s.applied,
                            s.incomplete,
                            s.reserve_used
                        ),
                        None => println!("{id:>7} {:>9}", "down"),
                    }
                }
            }
            Ok(())
        }
        ClusterCommand::Down { dir } => {
            let mut c = load(&dir)?;
            for (id, r) in c.replicas.iter_mut().enumerate() {
                if let Some(pid) = r.pid.take() {
                    if alive(pid) {
                        // SAFETY: a pid this tool started and recorded.
                        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
                        let t = Instant::now();
                        while alive(pid) && t.elapsed() < Duration::from_secs(10) {
                            reap();
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        // "Down" means down: one that did not stop in 10 s is killed
                        // (its log and data are crash-safe), not left running.
                        if alive(pid) {
                            eprintln!(
                                "quiltfs: replica {id} did not stop within 10 s of SIGTERM; \
                                 killing it"
                            );
                            // SAFETY: as above.
                            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                            let t = Instant::now();
                            while alive(pid) && t.elapsed() < Duration::from_secs(5) {
                                reap();
                                std::thread::sleep(Duration::from_millis(20));
                            }
                        }
                    }
                }
            }
            save(&dir, &c)?;
            eprintln!("quiltfs: cluster in {} is down", dir.display());
            Ok(())
        }
    }
}

fn export(address: &str, file: &Path) -> Result<()> {
    use quilt_block::BlockDevice;
    use std::io::Write;
    let dev = quilt_gnothi::device::ReplicatedDevice::connect(address)
        .with_context(|| format!("cannot reach the volume {address}"))?;
    let bs = dev.block_size();
    let total = dev.block_count();
    let per = ((1usize << 20) / bs).max(1) as u64;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(file).with_context(|| format!("creating {}", file.display()))?,
    );
    let mut buf = vec![0u8; per as usize * bs];
    let mut b = 0;
    while b < total {
        let n = per.min(total - b);
        let chunk = &mut buf[..n as usize * bs];
        dev.read_blocks(b, chunk)
            .with_context(|| format!("reading blocks {b}..{}", b + n))?;
        out.write_all(chunk)?;
        b += n;
    }
    out.flush()?;
    eprintln!(
        "quiltfs: {} MiB of {address} exported to {}",
        (total * bs as u64) >> 20,
        file.display()
    );
    Ok(())
}

/// Collects exited children of this process (a stop or down right after an up, in one
/// process, would otherwise see zombies as alive).
fn reap() {
    // SAFETY: waitpid with WNOHANG on any child; no memory is shared.
    unsafe { while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {} }
}

fn up(a: UpArgs) -> Result<()> {
    if a.replicas == 0 || a.replicas % 2 == 0 {
        bail!(
            "a volume has an odd number of replicas (2f+1), not {}",
            a.replicas
        );
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    if cluster_file(&a.dir).exists() {
        let c = load(&a.dir)?;
        if c.replicas.iter().any(|r| r.pid.is_some_and(alive)) {
            bail!(
                "a cluster is already running in {} (quiltfs cluster down {} first)",
                a.dir.display(),
                a.dir.display()
            );
        }
        bail!("{} holds a cluster already: start its replicas with `quiltfs cluster start`, or remove the directory", a.dir.display());
    }
    let f = (a.replicas - 1) / 2;
    match a.system {
        SystemArg::Local if a.replicas != 1 => {
            bail!("a local volume has one replica (--replicas 1)")
        }
        SystemArg::Local => {}
        _ if a.replicas == 1 => {
            bail!("one replica tolerates no failure: use --system local, or --replicas 3")
        }
        _ => {}
    }
    let shape = VolumeShape {
        volume: a.volume.clone(),
        system: a.system,
        f,
        size: a.size,
        block_size: 4096,
        slice: 16 << 20,
        reserve_slots: a.reserve_slots,
    };
    let g = shape.geometry()?;
    // A fresh secret from the OS.
    let mut raw = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut raw))
        .context("reading /dev/urandom")?;
    let secret: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let secret_path = a.dir.join("secret");
    std::fs::write(&secret_path, &secret)?;
    std::fs::set_permissions(
        &secret_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    let mut c = ClusterFile {
        volume: a.volume.clone(),
        replicas: (0..a.replicas)
            .map(|id| ReplicaEntry {
                id,
                addr: format!("127.0.0.1:{}", a.port + id),
                pid: None,
                incarnation: 0,
            })
            .collect(),
        recovery_interval_ms: a.recovery_interval_ms,
        model_disks: a.model_disks,
        tls: a.tls,
        metrics_port: a.metrics_port,
    };
    // Format each, start each, and the election.
    let steps = 2 * u64::from(a.replicas) + 1;
    let mut meter = crate::progress::Meter::new("cluster up", "steps", steps);
    if a.tls {
        // Each certificate names the host of its replica's address.
        let hosts: Vec<Vec<String>> = c
            .replicas
            .iter()
            .map(|r| {
                let host = r.addr.rsplit_once(':').map_or(r.addr.as_str(), |(h, _)| h);
                vec![host.to_string(), "localhost".to_string()]
            })
            .collect();
        let (ca, ids) =
            quilt_gnothi::transport::make_certificates(&hosts).map_err(|e| anyhow!(e))?;
        std::fs::write(a.dir.join("ca.pem"), ca)?;
        for (id, t) in ids.into_iter().enumerate() {
            std::fs::write(a.dir.join(format!("r{id}.crt")), t.cert_pem)?;
            // The key is never readable by others, not even for a moment.
            let mut key = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(a.dir.join(format!("r{id}.key")))?;
            std::io::Write::write_all(&mut key, &t.key_pem)?;
        }
    }
    for id in 0..a.replicas {
        meter.set(u64::from(id), steps, &format!("formatting replica {id}"));
        let label = server::label_for(id, &a.volume, g, shape.reserve_slots, LogSizes::default());
        server::format(
            &label,
            &a.dir.join(format!("r{id}.log")),
            &a.dir.join(format!("r{id}.data")),
        )
        .map_err(|e| anyhow!(e))?;
    }
    save(&a.dir, &c)?;
    for id in 0..a.replicas {
        meter.set(
            u64::from(a.replicas + id),
            steps,
            &format!("starting replica {id}"),
        );
        let pid = spawn(&a.dir, &c, id)?;
        c.replicas[id as usize].pid = Some(pid);
        save(&a.dir, &c)?;
    }
    // Wait for a leader.
    let t = Instant::now();
    loop {
        meter.set(steps - 1, steps, "electing a leader");
        let st = statuses(&a.dir, &c)?;
        if st
            .iter()
            .any(|(_, s)| s.as_ref().is_some_and(|s| s.is_leader))
        {
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!(
                "the replicas started but elected no leader in 20 s; see {}/r*.out",
                a.dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    meter.set(steps, steps, "up");
    meter.finish();
    eprintln!(
        "quiltfs: volume {} up on {} replicas ({:?}, f={f}), {} MiB",
        a.volume,
        a.replicas,
        g.system,
        a.size >> 20
    );
    println!("{}", address(&a.dir, &c));
    Ok(())
}
