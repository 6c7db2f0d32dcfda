//! `quiltfs mds`: the namespace service (Cudele) and subtree policies.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use quilt_cudele::{Client, Mds, MdsAddress, MdsConfig};
use quilt_vfs::FileSystem;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Subcommand)]
pub enum MdsCommand {
    /// Serve an image's namespace (ext2 with a journal, or betrfs) to clients until
    /// interrupted; prints the address clients use.
    Serve(ServeArgs),
    /// A subtree's policy: consistency, durability, inodes, interfere, sync.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Merge the journals that decoupled clients which died left in DIR (their local
    /// directory, `local-dir=` of the mount): each comes back as itself, merges durably,
    /// lets its subtree go, and its journal is removed. A mount with the same local
    /// directory does this for its subtree by itself.
    Recover {
        /// The local directory holding `cudele-*.journal` files.
        dir: PathBuf,
        /// The service: mds://HOST:PORT?secret-file=F.
        address: String,
    },
}

#[derive(Args)]
pub struct ServeArgs {
    /// The image holding the namespace.
    pub image: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7420")]
    pub listen: String,
    /// The shared secret clients must present (made, 0600, next to the image as
    /// IMAGE.secret when not given and not there yet).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Seconds a decoupled client's hold keeps blocking others without renewal.
    #[arg(long, default_value_t = 30)]
    pub lease: u64,
    /// Page cache of the store, MiB.
    #[arg(long, default_value_t = 256)]
    pub cache_mib: usize,
    /// Events per atomic batch of a merge (halved while the store cannot take one
    /// whole); each batch also moves the client's watermark.
    #[arg(long, default_value_t = 16384)]
    pub merge_batch: usize,
    /// Serve Prometheus metrics (requests and errors by kind, merged events, refusals
    /// under holds, clients, holds and open files) at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
}

#[derive(Subcommand)]
pub enum PolicyCommand {
    /// Change the policy of the directory PATH (a path inside a mount of the service,
    /// or mds://HOST:PORT/PATH?secret-file=F): KEY=VALUE words, among
    /// consistency=strong|weak|invisible, durability=none|local|global, inodes=N,
    /// interfere=allow|block, sync=SECONDS, preset=posix|hdfs|batchfs|deltafs|ramdisk.
    Set {
        path: String,
        #[arg(required = true)]
        settings: Vec<String>,
    },
    /// Show the policy that governs PATH, where it comes from, and who holds it.
    Show {
        path: String,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: MdsCommand) -> Result<()> {
    match c {
        MdsCommand::Serve(a) => serve(a),
        MdsCommand::Policy(p) => policy(p),
        MdsCommand::Recover { dir, address } => {
            let a = MdsAddress::parse(&address).map_err(|e| anyhow!(e))?;
            let n = recover(&a, &dir, None)?;
            if n == 0 {
                println!("{}: no journal left to merge", dir.display());
            }
            Ok(())
        }
    }
}

/// Merges the journals left in `dir` (of `subtree` only, when given); says what each
/// did. Returns how many were merged.
pub fn recover(addr: &MdsAddress, dir: &Path, subtree: Option<quilt_vfs::Ino>) -> Result<usize> {
    let secret = addr.secret().map_err(|e| anyhow!(e))?;
    let ca = addr.ca().map_err(|e| anyhow!(e))?;
    let left = quilt_cudele::recover::leftovers(dir).map_err(|e| anyhow!(e))?;
    let mut n = 0;
    for l in left
        .iter()
        .filter(|l| subtree.is_none_or(|s| s == l.subtree))
    {
        let r = quilt_cudele::recover::recover(&addr.host, &secret, ca.clone(), dir, l)
            .map_err(|e| anyhow!("{}: {e}", l.path.display()))?;
        println!(
            "quiltfs: client {}'s journal of subtree {}: {} events merged now ({} in all){}",
            l.client,
            l.subtree,
            r.events,
            r.last_seq,
            if r.torn_bytes > 0 {
                format!(", a torn last frame of {} bytes dropped", r.torn_bytes)
            } else {
                String::new()
            }
        );
        n += 1;
    }
    Ok(n)
}

/// The image's secret file: given, or IMAGE.secret (made with 32 random hex digits).
fn secret_for(image: &Path, given: Option<PathBuf>) -> Result<(PathBuf, String)> {
    let path = given.unwrap_or_else(|| {
        let mut p = image.as_os_str().to_owned();
        p.push(".secret");
        PathBuf::from(p)
    });
    if !path.exists() {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut bytes = [0u8; 16];
        getrandom(&mut bytes)?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("creating the secret {}", path.display()))?;
        writeln!(f, "{hex}")?;
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the secret {}", path.display()))?;
    let secret = text.lines().next().unwrap_or("").trim().to_string();
    if secret.len() < 16 {
        bail!(
            "the secret in {} is shorter than 16 characters",
            path.display()
        );
    }
    Ok((path.canonicalize().unwrap_or(path), secret))
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .context("reading /dev/urandom")
}

fn serve(a: ServeArgs) -> Result<()> {
    let image = a
        .image
        .canonicalize()
        .with_context(|| format!("image {} (make one with quiltfs mkfs)", a.image.display()))?;
    let (secret_path, secret) = secret_for(&image, a.secret_file)?;
    // Both ports before the store is opened: an address in use must fail the start
    // before anything marks the image in use.
    let bind = |addr: &str, what: &str| -> Result<std::net::TcpListener> {
        let l = std::net::TcpListener::bind(addr)
            .with_context(|| format!("listening {what}on {addr}"))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let service_listener = bind(&a.listen, "")?;
    let metrics_listener = match a.metrics {
        Some(m) => Some((m, bind(&m.to_string(), "for metrics ")?)),
        None => None,
    };
    let mut locks = Vec::new();
    let store: Store = match crate::betrfs::detect(&image)? {
        crate::betrfs::Format::Ext2 => {
            let s = crate::image::OpenSettings {
                mode: quilt_ext2::Mode::MetaJournal,
                cache_mib: a.cache_mib,
                ..Default::default()
            };
            let fs = crate::image::open_fs(&image, &s, &mut locks).with_context(|| {
                format!(
                    "{}: the service keeps its namespace in ext2 with a journal \
                     (quiltfs mkfs --journal) or betrfs",
                    image.display()
                )
            })?;
            Store::Ext2(Arc::new(fs))
        }
        crate::betrfs::Format::Tree(bs) => {
            crate::set_allocator_purge_delay(10);
            let fs = crate::betrfs::open(
                &image,
                bs,
                quilt_betrfs::MountOptions {
                    read_only: false,
                    acl: true,
                    commit_interval: Some(Duration::from_secs(1)),
                },
                &mut locks,
            )?;
            Store::Betrfs(Arc::new(fs))
        }
    };
    let mds = Mds::open(
        store.fs(),
        MdsConfig {
            lease: Duration::from_secs(a.lease.max(1)),
            merge_chunk: a.merge_batch.max(1),
        },
    )
    .map_err(|e| anyhow!("opening the namespace of {}: {e}", image.display()))?;
    let mds = Arc::new(mds);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _in_runtime = rt.enter();
    let listener = tokio::net::TcpListener::from_std(service_listener)?;
    let at = listener.local_addr()?;
    let metrics = match metrics_listener {
        Some((m, l)) => {
            let l = tokio::net::TcpListener::from_std(l)?;
            // A weak reference: the store is finished once the service is gone.
            let weak = Arc::downgrade(&mds);
            let render = move || weak.upgrade().map(|m| m.metrics()).unwrap_or_default();
            eprintln!("quiltfs: metrics at http://{m}/metrics");
            Some(rt.spawn(quilt_rpc::metrics::serve(l, render, std::future::pending())))
        }
        None => None,
    };
    println!(
        "quiltfs: serving the namespace of {} at mds://{at}/?secret-file={}",
        image.display(),
        secret_path.display()
    );
    let stop = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async {
                match term.as_mut() {
                    Some(t) => { t.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    };
    let r = rt.block_on(quilt_cudele::transport::serve(
        mds.clone(),
        listener,
        &secret,
        None,
        stop,
    ));
    if let Some(m) = metrics {
        m.abort();
        let _ = rt.block_on(m);
    }
    drop(mds);
    let finished = store.finish();
    for l in locks {
        l.release();
    }
    r.map_err(|e| anyhow!(e))?;
    finished.map_err(|e| anyhow!("the final write-back of {}: {e}", image.display()))?;
    eprintln!(
        "quiltfs: the namespace service stopped; {} is clean",
        image.display()
    );
    Ok(())
}

enum Store {
    Ext2(Arc<quilt_ext2::Ext2>),
    Betrfs(Arc<quilt_betrfs::Betrfs>),
}

impl Store {
    fn fs(&self) -> Arc<dyn FileSystem> {
        match self {
            Store::Ext2(f) => f.clone(),
            Store::Betrfs(f) => f.clone(),
        }
    }
    fn finish(&self) -> quilt_vfs::Result<()> {
        match self {
            Store::Ext2(f) => {
                f.engine().stop_flusher();
                f.unmount()
            }
            Store::Betrfs(f) => f.unmount(),
        }
    }
}

/// Connects to the service of `addr`.
pub fn connect(addr: &MdsAddress, name: &str) -> Result<Arc<Client>> {
    let secret = addr.secret().map_err(|e| anyhow!(e))?;
    Client::connect(
        &addr.host,
        &secret,
        addr.ca().map_err(|e| anyhow!(e))?,
        name,
    )
    .map_err(|e| anyhow!(e))
}

/// The service and the path in its namespace that `path` names: an mds:// address, or
/// a path inside a mount of the service (its server tells the address).
fn locate(path: &str) -> Result<(MdsAddress, String)> {
    if MdsAddress::is_address(path) {
        let a = MdsAddress::parse(path).map_err(|e| anyhow!(e))?;
        let p = a.subtree.clone();
        return Ok((a, p));
    }
    let abs = std::fs::canonicalize(path).with_context(|| path.to_string())?;
    let mut mp = abs.as_path();
    let dev = |p: &Path| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::dev(&m));
    let d = dev(&abs)?;
    while let Some(parent) = mp.parent() {
        if dev(parent)? != d {
            break;
        }
        mp = parent;
    }
    let image = quilt_mountctl::ask(mp, "image").with_context(|| {
        format!("{path} is not inside a mount of the namespace service (quiltfs mount mds://…)")
    })?;
    let image = image.trim();
    if !MdsAddress::is_address(image) {
        bail!(
            "{} is a mount of {image}, not of the namespace service",
            mp.display()
        );
    }
    let a = MdsAddress::parse(image).map_err(|e| anyhow!(e))?;
    let rel = abs.strip_prefix(mp).unwrap_or(Path::new(""));
    let base = a.subtree.trim_end_matches('/');
    let p = format!("{base}/{}", rel.display());
    Ok((a, p))
}

fn policy(c: PolicyCommand) -> Result<()> {
    let (path, settings, json) = match c {
        PolicyCommand::Set { path, settings } => (path, Some(settings.join(" ")), false),
        PolicyCommand::Show { path, json } => (path, None, json),
    };
    let (addr, p) = locate(&path)?;
    let client = connect(&addr, "quiltfs mds policy")?;
    let dir = client
        .resolve(p.as_bytes())
        .map_err(|e| anyhow!("{p} in the namespace: {e}"))?;
    let info = match settings {
        Some(s) => client.set_policy(dir.ino, &s),
        None => client.policy(dir.ino),
    }
    .map_err(|e| anyhow!("{p}: {}", e.message))?;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "path": p,
                "governed_by": info.from,
                "consistency": info.policy.consistency.to_string(),
                "durability": info.policy.durability.to_string(),
                "inodes": info.policy.inodes,
                "interfere": info.policy.interfere.to_string(),
                "sync_ms": info.policy.sync_interval_ms,
                "mechanisms": info.policy.mechanisms().iter().map(|m| m.name()).collect::<Vec<_>>(),
                "version": info.version,
                "holder": info.holder,
            })
        );
    } else {
        let from = if info.version == 0 {
            "the default".to_string()
        } else if info.from == dir.ino {
            "its own".to_string()
        } else {
            format!("inherited from directory {}", info.from)
        };
        println!("{p}: {} ({from}, version {})", info.policy, info.version);
        println!("  mechanisms: {}", info.policy.formula());
        match info.holder {
            Some(h) if info.policy.decoupled() => println!("  held decoupled by client {h}"),
            Some(h) => println!("  held by client {h}, which uses it through the service"),
            None => println!("  not held"),
        }
    }
    Ok(())
}
