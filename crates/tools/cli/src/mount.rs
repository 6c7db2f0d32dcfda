//! `quiltfs mount`: serve an image through FUSE, in the background (default) or attached
//! (`--foreground`). Also the `mount -t fuse.quiltfs` helper and the control socket that
//! `quiltfs stats` reads.

use crate::image::{open_fs, OpenSettings};
use anyhow::{bail, Context, Result};
use quilt_ext2::{Ext2, Mode};
use quilt_fuse::FuseOptions;
use quilt_vfs::{FileSystem, KernelFs};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(clap::Args, Clone)]
pub struct MountArgs {
    /// The ext2 image.
    pub image: PathBuf,
    /// Where to mount it.
    pub mountpoint: PathBuf,
    /// Consistency mode: async, soft-updates, meta-journal or full-journal (the journal
    /// modes need an image made with `mkfs --journal`).
    #[arg(long, default_value = "soft-updates")]
    pub mode: Mode,
    /// Stay attached to the terminal instead of serving in the background.
    #[arg(long, short = 'f')]
    pub foreground: bool,
    /// Skip device flushes: order is kept against crashes of the server, not of the
    /// machine.
    #[arg(long)]
    pub r#unsafe: bool,
    /// Block-cache budget in MiB.
    #[arg(long, default_value_t = crate::image::DEFAULT_CACHE_MIB)]
    pub cache_mib: usize,
    /// Comma-separated options: ro, rw, allow_other (the default for root: every user
    /// may use the mount, under its permissions and ACLs) or noallow_other (only the
    /// user who mounted), mode=M, unsafe, cache_mib=N,
    /// acl (POSIX ACLs, the default) or noacl, errors=remount-ro (the default: after
    /// damage is found, marked in the superblock, no more changes) or errors=continue,
    /// flusher_ms=N (background write-back every N ms, 1000 by default; 0: only when
    /// memory, fsync, sync or unmount ask),
    /// wbcache (the kernel's writeback cache: fewer, larger writes; the kernel may hold
    /// at most dirty_mib=N MiB unwritten, 64 by default and at most a sixteenth of the
    /// file system, and the mount keeps that much room for it: when space runs low,
    /// files opened for writing write through and writes through the cache are refused
    /// with ENOSPC in write(2); nowbcache, the default, sends every write(2) to the
    /// server before it returns), threads=N, uring (the default: requests
    /// over io_uring, each served on its caller's CPU, where the kernel offers it, that
    /// is when /sys/module/fuse/parameters/enable_uring is Y; /dev/fuse otherwise) or
    /// nouring (always /dev/fuse), ring_threads=N (workers per CPU, 2 by default),
    /// handoff=auto|always|never (ring workers submit answers under SCHED_IDLE, so an
    /// answer wakes its caller on the worker's CPU, not on an idle one; auto, the
    /// default, does it while callers ping-pong between CPUs and some CPU is idle;
    /// handoff and nohandoff are always and never),
    /// journal=ring|skip|null (where journal commits go: JBD2's ring, log skipping, or
    /// nowhere, for measuring; default: what mkfs made the journal for),
    /// journal_dev=PATH (the external journal of an image made with mkfs --journal-dev),
    /// journal_model=7200 (the external journal behind a model of a 7200 RPM disk, its
    /// write cache off), model=7200 (the image behind one, its write cache on),
    /// model_nohostsync (the models' flushes stop at the model: the files under them are
    /// not flushed on the host, whose fdatasync would add its own time to the modelled
    /// disk's; for benchmarks, as the files then survive a crash of quiltfs but not one
    /// of the host),
    /// nohard and nomerge (the patch engine's optimizations off, for comparing them);
    /// fstab-only options are ignored.
    #[arg(short = 'o', value_delimiter = ',')]
    pub options: Vec<String>,
    /// Internal: the background parent waits for this process to say it is ready.
    #[arg(long, hide = true)]
    pub notify_ready: bool,
}

pub(crate) struct Parsed {
    settings: OpenSettings,
    fuse: FuseOptions,
    /// Where the server serves its counters for Prometheus (`metrics=HOST:PORT`).
    metrics: Option<std::net::SocketAddr>,
}

pub(crate) fn parse(a: &MountArgs) -> Result<Parsed> {
    let mut settings = OpenSettings {
        mode: a.mode,
        unsafe_durability: a.r#unsafe,
        cache_mib: a.cache_mib,
        ..Default::default()
    };
    let mut metrics = None;
    let mut fuse = FuseOptions {
        fs_name: a.image.display().to_string(),
        // Root's mounts serve every user, as a kernel file system does, under the
        // kernel's permission checks (default_permissions) and the module's own ACLs;
        // noallow_other keeps a mount to its owner, as FUSE does by default.
        // SAFETY: geteuid has no preconditions.
        allow_other: unsafe { libc::geteuid() } == 0,
        ..Default::default()
    };
    for o in a.options.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let (k, v) = o
            .split_once('=')
            .map(|(k, v)| (k, Some(v)))
            .unwrap_or((o, None));
        match (k, v) {
            ("ro", None) => settings.read_only = true,
            ("rw", None) => settings.read_only = false,
            ("allow_other", None) => fuse.allow_other = true,
            ("noallow_other", None) => fuse.allow_other = false,
            ("unsafe", None) => settings.unsafe_durability = true,
            ("nowbcache", None) => fuse.writeback_cache = false,
            ("wbcache", None) => fuse.writeback_cache = true,
            ("dirty_mib", Some(n)) => {
                let mib: u64 = n.parse().context("dirty_mib=N (MiB)")?;
                if mib == 0 {
                    bail!("dirty_mib=0: the writeback cache needs at least 1 MiB (nowbcache turns it off)");
                }
                fuse.dirty_limit = mib << 20;
            }
            ("nohard", None) => settings.hard_patches = false,
            ("nomerge", None) => settings.overlap_merge = false,
            ("acl", None) => settings.acl = true,
            ("noacl", None) => settings.acl = false,
            ("journal", Some(p)) => {
                settings.journal_placement = Some(p.parse().map_err(anyhow::Error::msg)?)
            }
            ("journal_dev", Some(p)) => settings.journal_dev = Some(PathBuf::from(p)),
            ("model", Some("7200")) => settings.model = true,
            ("model", Some("none")) => settings.model = false,
            ("model", Some(m)) => {
                bail!("model={m}: the disk models are 7200 (a desktop disk) and none")
            }
            ("journal_model", Some("7200")) => settings.journal_model = true,
            ("journal_model", Some("none")) => settings.journal_model = false,
            ("journal_model", Some(m)) => {
                bail!("journal_model={m}: the disk models are 7200 (a desktop disk) and none")
            }
            ("model_nohostsync", None) => settings.model_nohostsync = true,
            ("metrics", Some(addr)) => {
                metrics = Some(addr.parse().with_context(|| {
                    format!(
                    "metrics={addr}: expected HOST:PORT with a numeric host, e.g. 127.0.0.1:9430"
                )
                })?)
            }
            ("errors", Some(e)) => settings.errors = e.parse().map_err(anyhow::Error::msg)?,
            ("mode", Some(m)) => settings.mode = m.parse().map_err(anyhow::Error::msg)?,
            ("cache_mib", Some(n)) => settings.cache_mib = n.parse().context("cache_mib=N")?,
            ("flusher_ms", Some(n)) => {
                let ms: u64 = n
                    .parse()
                    .context("flusher_ms=N (milliseconds, 0 for none)")?;
                settings.flush_interval_ms = (ms > 0).then_some(ms);
            }
            ("threads", Some(n)) => fuse.threads = n.parse().context("threads=N")?,
            ("uring", None) => fuse.ring = Some(fuse.ring.unwrap_or_default()),
            ("nouring", None) => fuse.ring = None,
            ("ring_threads", Some(n)) => {
                let n: usize = n.parse().context("ring_threads=N")?;
                if n == 0 {
                    bail!("ring_threads=N needs N of at least 1 (nouring turns the ring off)");
                }
                fuse.ring = Some(quilt_fuse::RingOptions {
                    threads_per_queue: n,
                    ..fuse.ring.unwrap_or_default()
                });
            }
            ("handoff" | "nohandoff", _) => {
                let mode = match (k, v) {
                    ("nohandoff", None) | ("handoff", Some("never")) => {
                        quilt_fuse::HandoffMode::Never
                    }
                    ("handoff", None | Some("always")) => quilt_fuse::HandoffMode::Always,
                    ("handoff", Some("auto")) => quilt_fuse::HandoffMode::Auto,
                    _ => bail!("{o}: expected handoff=auto|always|never, handoff or nohandoff"),
                };
                fuse.ring = fuse
                    .ring
                    .map(|r| quilt_fuse::RingOptions { handoff: mode, ..r });
            }
            // fstab and mount(8) bookkeeping.
            (
                "defaults" | "auto" | "noauto" | "user" | "nouser" | "users" | "_netdev" | "nofail"
                | "dev" | "suid" | "exec" | "relatime" | "noatime" | "atime",
                None,
            ) => {}
            ("nodev" | "nosuid" | "noexec", None) => fuse.extra.push(k.to_string()),
            _ => bail!("unknown mount option '{o}'"),
        }
    }
    if settings.cache_mib < 4 {
        bail!("cache_mib must be at least 4");
    }
    fuse.read_only = settings.read_only;
    fuse.posix_acl = settings.acl;
    Ok(Parsed {
        settings,
        fuse,
        metrics,
    })
}

pub use quilt_mountctl::runtime_paths;

pub fn run(mut a: MountArgs) -> Result<()> {
    // Absolute paths: the server's command line and the mount table name the image and
    // the mount point, and messages about a busy image quote them.
    let volume =
        crate::image::volume_address(&a.image).is_some() || mds_address(&a.image).is_some();
    for p in [&mut a.image, &mut a.mountpoint] {
        if let Ok(c) = p.canonicalize() {
            *p = c;
        }
    }
    let p = parse(&a)?;
    if !a.mountpoint.is_dir() {
        bail!("mount point {} is not a directory", a.mountpoint.display());
    }
    if volume {
        // A replicated volume (quilt-stack connects to it).
        if a.foreground {
            return serve(&a, p);
        }
        return background(&a);
    }
    if !a.image.exists() {
        bail!(
            "image {} does not exist (create one with quiltfs mkfs)",
            a.image.display()
        );
    }
    {
        use std::os::unix::fs::FileTypeExt;
        let t = std::fs::metadata(&a.image)
            .with_context(|| format!("cannot read {}", a.image.display()))?
            .file_type();
        if !t.is_file() && !t.is_block_device() {
            bail!(
                "{} is {}: quiltfs mount takes an image file or a block device (quiltfs mount IMAGE MOUNTPOINT)",
                a.image.display(),
                if t.is_dir() { "a directory" } else { "neither a file nor a block device" }
            );
        }
    }
    if a.foreground {
        return serve(&a, p);
    }
    background(&a)
}

/// Starts the server as a detached child and returns once it has mounted (or failed).
fn background(a: &MountArgs) -> Result<()> {
    let (_, log) = runtime_paths(&a.mountpoint);
    std::fs::create_dir_all(log.parent().expect("has a parent"))?;
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)?;
    let start_len = logf.metadata().map(|m| m.len()).unwrap_or(0);
    let exe = std::env::current_exe().context("finding the quiltfs binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(&a.image)
        .arg(&a.mountpoint)
        .arg("--foreground")
        .arg("--notify-ready")
        .arg("--mode")
        .arg(a.mode.to_string())
        .arg("--cache-mib")
        .arg(a.cache_mib.to_string());
    if a.r#unsafe {
        cmd.arg("--unsafe");
    }
    if !a.options.is_empty() {
        cmd.arg("-o").arg(a.options.join(","));
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(logf);
    // SAFETY: setsid is async-signal-safe; the child detaches from our session so it
    // survives the terminal.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the server")?;
    let mut out = child.stdout.take().expect("piped");
    let mut buf = String::new();
    let _ = out.read_to_string(&mut buf);
    // What the server says before it is ready (a decoupled subtree, journals it
    // recovered) is for the user: passed on.
    if buf.lines().any(|l| l == "ready") {
        for l in buf.lines().filter(|l| *l != "ready") {
            println!("{l}");
        }
        println!(
            "quiltfs: {} mounted on {} (server pid {})",
            a.image.display(),
            a.mountpoint.display(),
            child.id()
        );
        return Ok(());
    }
    let status = child.wait()?;
    let text = std::fs::read(&log).unwrap_or_default();
    let tail = String::from_utf8_lossy(&text[(start_len as usize).min(text.len())..]).to_string();
    bail!(
        "the server failed to mount ({status}):\n{}",
        tail.trim_end()
    )
}

/// A module the server can serve: how it ends at unmount.
pub trait Served: KernelFs + 'static {
    fn finish(&self) -> quilt_vfs::Result<()>;
}

impl Served for Ext2 {
    fn finish(&self) -> quilt_vfs::Result<()> {
        self.engine().stop_flusher();
        self.unmount()
    }
}

impl Served for quilt_betrfs::Betrfs {
    fn finish(&self) -> quilt_vfs::Result<()> {
        self.unmount()
    }
}

/// The namespace service's address, when that is what is mounted.
pub fn mds_address(image: &Path) -> Option<&str> {
    image
        .to_str()
        .filter(|s| quilt_cudele::MdsAddress::is_address(s))
}

impl Served for quilt_cudele::DecoupledFs {
    fn finish(&self) -> quilt_vfs::Result<()> {
        // The last sync as the policy says (a merge for a weak subtree), then the
        // hold goes.
        self.release().map(|_| ())
    }
}

impl Served for quilt_cudele::RemoteFs {
    fn finish(&self) -> quilt_vfs::Result<()> {
        // Every change was answered by the service once it had it (and made it
        // durable where the subtree's policy says so); only the hold is let go.
        self.let_go()
    }
}

/// A mount of the namespace service: every operation a request (RPCs), and no kernel
/// cache of names or attributes, so that what other clients change is seen at once.
fn serve_mds(
    a: &MountArgs,
    p: Parsed,
    addr: &str,
    metrics: Option<std::net::TcpListener>,
) -> Result<()> {
    let address = quilt_cudele::MdsAddress::parse(addr).map_err(|e| anyhow::anyhow!(e))?;
    let client = crate::mds::connect(&address, &format!("mount {}", a.mountpoint.display()))?;
    let root = client
        .resolve(address.subtree.as_bytes())
        .map_err(|e| anyhow::anyhow!("{} in the namespace: {e}", address.subtree))?;
    let policy = client
        .policy(root.ino)
        .map_err(|e| anyhow::anyhow!("{}: {}", address.subtree, e.message))?;
    if policy.policy.decoupled() {
        // A journal an earlier client of this local directory left when it died holds
        // the subtree: merged first (that client comes back as itself).
        if let Some(dir) = &address.local_dir {
            crate::mds::recover(&address, dir, Some(root.ino))?;
        }
        // Weak or invisible: this client takes the subtree and works in its own journal;
        // the kernel may cache what it sees, since every change goes through this view.
        let opts = quilt_cudele::DecoupleOptions {
            local_dir: address.local_dir.clone(),
            sync_interval: None,
        };
        let fs = quilt_cudele::DecoupledFs::open(client, root.ino, opts)
            .map_err(|e| anyhow::anyhow!("decoupling {}: {e}", address.subtree))?;
        println!(
            "quiltfs: {} decoupled ({}): changes go to this client's journal; they merge {}",
            address.subtree,
            policy.policy,
            match policy.policy.consistency {
                quilt_cudele::Consistency::Weak =>
                    "at each sync interval, `quiltfs sync` and unmount",
                _ => "only when the application merges them (invisible)",
            }
        );
        let mut fuse = p.fuse.clone();
        fuse.fs_name = format!("quiltfs-mds:{}", address.host);
        return serve_fs(a, fuse, Arc::new(fs), Vec::new(), metrics);
    }
    // A subtree mounted as the root whose policy keeps others out is held by this
    // mount: others get EBUSY inside it until the unmount.
    let block = policy.policy.interfere == quilt_cudele::Interfere::Block;
    let fs = if block && root.ino != client.root() {
        let fs = quilt_cudele::RemoteFs::holding(client, root.ino)
            .map_err(|e| anyhow::anyhow!("holding {}: {e}", address.subtree))?;
        println!(
            "quiltfs: {} held by this mount (interfere=block): other clients get EBUSY \
             inside it until the unmount",
            address.subtree
        );
        Arc::new(fs)
    } else {
        Arc::new(quilt_cudele::RemoteFs::at(client, root.ino))
    };
    let mut fuse = p.fuse.clone();
    fuse.cache_ttl = std::time::Duration::ZERO;
    fuse.fs_name = format!("quiltfs-mds:{}", address.host);
    serve_fs(a, fuse, fs, Vec::new(), metrics)
}

/// Opens the image in whatever format it holds.
fn serve(a: &MountArgs, p: Parsed) -> Result<()> {
    // The metrics port before anything is opened: an address in use fails the mount
    // with the reason, and nothing was marked in use.
    let metrics = match p.metrics {
        Some(at) => Some(
            std::net::TcpListener::bind(at)
                .with_context(|| format!("listening for metrics on {at}"))?,
        ),
        None => None,
    };
    if let Some(addr) = mds_address(&a.image) {
        return serve_mds(a, p, addr, metrics);
    }
    match crate::betrfs::detect(&a.image)? {
        crate::betrfs::Format::Ext2 => {
            let mut locks = Vec::new();
            let fs = open_fs(&a.image, &p.settings, &mut locks)?;
            serve_fs(a, p.fuse.clone(), Arc::new(fs), locks, metrics)
        }
        // (A bare key-value tree fails here: it has no betrfs superblock record.)
        crate::betrfs::Format::Tree(bs) => {
            crate::set_allocator_purge_delay(10);
            let s = &p.settings;
            let mut locks = Vec::new();
            let fs = crate::betrfs::open(
                &a.image,
                bs,
                quilt_betrfs::MountOptions {
                    read_only: s.read_only,
                    acl: s.acl,
                    commit_interval: s.flush_interval_ms.map(std::time::Duration::from_millis),
                },
                &mut locks,
            )?;
            serve_fs(a, p.fuse.clone(), Arc::new(fs), locks, metrics)
        }
    }
}

/// Serves until unmounted: runs FUSE on this thread, the control socket on another.
/// `locks` are the image's: let go of once the file system is written back and marked
/// clean, before the kernel's DESTROY is answered, so that the image is free when
/// umount(8) returns (a mount or mkfs right after it must not find it in use).
fn serve_fs<F: Served>(
    a: &MountArgs,
    fuse_opts: FuseOptions,
    fs: Arc<F>,
    locks: Vec<quilt_block::ImageLock>,
    metrics: Option<std::net::TcpListener>,
) -> Result<()> {
    let (sock, _) = runtime_paths(&a.mountpoint);
    if let Some(listener) = metrics {
        serve_metrics(listener, fs.clone(), fuse_opts.stats.clone())?;
    }
    let unmounted = Arc::new(Mutex::new(false));
    let listener = start_control(
        &sock,
        a.image.clone(),
        fs.clone(),
        fuse_opts.stats.clone(),
        unmounted.clone(),
    )?;
    let locks = Arc::new(Mutex::new(locks));
    // How the module's final write-back ended, once it has.
    let outcome: Arc<Mutex<Option<Result<(), String>>>> = Arc::default();
    let finish = {
        let fs = fs.clone();
        let unmounted = unmounted.clone();
        let outcome = outcome.clone();
        move || {
            let mut done = unmounted.lock().unwrap_or_else(|e| e.into_inner());
            if !*done {
                *done = true;
                let r = fs.finish();
                match &r {
                    Ok(()) => {
                        tracing::info!("flushed and marked clean");
                        for l in locks.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
                            l.release();
                        }
                    }
                    // The locks stay until the process exits: what failed to reach the
                    // image may still be in flight.
                    Err(e) => eprintln!("quiltfs: error while unmounting: {e}"),
                }
                *outcome.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(r.map_err(|e| e.to_string()));
            }
        }
    };
    watch_signals(a.mountpoint.clone());
    let notify = a.notify_ready;
    let utab_line = utab_entry(&a.image, &a.mountpoint);
    let utab_add = utab_line.clone();
    let ready = move || {
        edit_utab(|lines| lines.push(utab_add.clone()));
        if notify {
            let mut o = std::io::stdout();
            let _ = o.write_all(b"ready\n");
            let _ = o.flush();
            // Nothing else goes to the parent's pipe.
            // SAFETY: plain fd juggling on our own descriptors.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
                if null >= 0 {
                    libc::dup2(null, 1);
                    libc::close(null);
                }
            }
        }
    };
    let f2 = finish.clone();
    let mut fuse = fuse_opts;
    // A block-device mount (the image's loop device, or the device itself), so that
    // sync(1) and syncfs(2) reach us and umount waits for the final write-back.
    // A replicated volume has no file to put a loop device on: a plain FUSE mount
    // (`quiltfs sync` or fsync make it durable; every write it passes down is already
    // durable on f+1 replicas once written back).
    let volume =
        crate::image::volume_address(&a.image).is_some() || mds_address(&a.image).is_some();
    fuse.block = if volume {
        None
    } else if crate::image::is_block_device(&a.image) {
        Some(quilt_fuse::BlockTarget::Device(a.image.clone()))
    } else {
        Some(quilt_fuse::BlockTarget::File(a.image.clone()))
    };
    fuse.block_size = fs.statfs().map(|s| s.block_size).unwrap_or(4096);
    let ready = move |kind: quilt_fuse::MountKind| {
        if kind != quilt_fuse::MountKind::Fuseblk {
            tracing::warn!("mounted as plain FUSE: sync(1) does not reach us, use quiltfs sync");
        }
        ready()
    };
    let r = quilt_fuse::serve(fs.clone(), &a.mountpoint, &fuse, ready, Box::new(f2));
    finish();
    edit_utab(|lines| lines.retain(|l| *l != utab_line));
    drop(listener);
    let _ = std::fs::remove_file(&sock);
    // The outcome for `quiltfs umount` (and the exit status): the module's final
    // write-back, then the session's end (the loop device let go of included).
    let finished = outcome
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or(Ok(()));
    let r = match (finished, r) {
        (Err(e), _) => Err(anyhow::anyhow!("the final write-back failed: {e}")),
        (Ok(()), r) => r.with_context(|| format!("serving {}", a.mountpoint.display())),
    };
    let status = quilt_mountctl::status_path(&a.mountpoint, std::process::id());
    let text = match &r {
        Ok(()) => "ok\n".to_string(),
        Err(e) => format!("error: {e:#}\n"),
    };
    let tmp = status.with_extension("tmp");
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, &status);
    }
    r
}

/// SIGTERM, SIGINT or SIGHUP unmount the file system, which ends the session cleanly.
pub(crate) fn watch_signals(mountpoint: PathBuf) {
    // SAFETY: standard signal-mask setup before the worker threads exist; sigwait in a
    // dedicated thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        std::thread::spawn(move || loop {
            let mut sig = 0;
            if libc::sigwait(&set, &mut sig) == 0 {
                tracing::info!("signal {sig}: unmounting");
                let c = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes())
                    .unwrap_or_default();
                if libc::umount(c.as_ptr()) != 0 {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
        });
    }
}

fn start_control<F: Served>(
    sock: &Path,
    image: PathBuf,
    fs: Arc<F>,
    requests: Arc<quilt_fuse::RequestStats>,
    unmounted: Arc<Mutex<bool>>,
) -> Result<Arc<UnixListener>> {
    std::fs::create_dir_all(sock.parent().expect("has a parent"))?;
    if sock.exists() {
        // A live server answers; a stale socket (kill -9) is replaced.
        if UnixStream::connect(sock).is_ok() {
            bail!(
                "another quiltfs server already serves this mount point ({})",
                sock.display()
            );
        }
        let _ = std::fs::remove_file(sock);
    }
    let listener =
        Arc::new(UnixListener::bind(sock).with_context(|| format!("binding {}", sock.display()))?);
    let l = listener.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut line = String::new();
            let _ = BufReader::new(&conn).read_line(&mut line);
            let reply = match line.trim() {
                "stats" => serde_json::to_string(&all_stats(&*fs, &requests)).unwrap_or_default(),
                "pid" => std::process::id().to_string(),
                "image" => image.display().to_string(),
                // What sync(1) does through the mount, for scripts and for plain FUSE
                // mounts (not root), which the kernel sends no FUSE_SYNCFS.
                // Held while syncing: the unmount waits, and after it (the image's
                // lock let go) nothing writes.
                "sync" => {
                    let done = unmounted.lock().unwrap_or_else(|e| e.into_inner());
                    if *done {
                        "error: the file system is unmounted".to_string()
                    } else {
                        match fs.sync_all() {
                            Ok(()) => "ok".to_string(),
                            Err(e) => format!("error: {e}"),
                        }
                    }
                }
                other => format!("{{\"error\":\"unknown command {other:?}\"}}"),
            };
            let _ = conn.write_all(reply.as_bytes());
        }
    });
    Ok(listener)
}

/// What `quiltfs stats MOUNTPOINT` shows: the module's counters and the FUSE requests.
fn all_stats(fs: &dyn FileSystem, requests: &quilt_fuse::RequestStats) -> serde_json::Value {
    let mut j = stats_json(fs);
    if let Some(m) = j.as_object_mut() {
        for (k, v) in requests.fields() {
            m.insert(k, v.into());
        }
    }
    j
}

/// The same counters for Prometheus on `listener` (bound by `serve` before the image
/// was opened), from a thread of the server's own (its runtime serves nothing else).
fn serve_metrics<F: Served>(
    listener: std::net::TcpListener,
    fs: Arc<F>,
    requests: Arc<quilt_fuse::RequestStats>,
) -> Result<()> {
    let at = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the metrics runtime")?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let render = move || {
                    let mut e = quilt_rpc::metrics::Exposition::new();
                    if let serde_json::Value::Object(m) = all_stats(&*fs, &requests) {
                        for (k, v) in m {
                            if let Some(v) = v.as_f64() {
                                let help = format!("quiltfs stats: {k}");
                                let name = format!("quiltfs_{k}");
                                e.metric(&name, quilt_rpc::metrics::Kind::Untyped, &help, v);
                            }
                        }
                    }
                    e.finish()
                };
                quilt_rpc::metrics::serve(listener, render, std::future::pending()).await
            })
        })
        .context("starting the metrics thread")?;
    tracing::info!(metrics = %at, "metrics served at /metrics");
    Ok(())
}

pub fn stats_json(fs: &dyn FileSystem) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (k, v) in fs.counters() {
        m.insert(k, v.into());
    }
    if let Ok(s) = fs.statfs() {
        m.insert("statfs.blocks".into(), s.blocks.into());
        m.insert("statfs.blocks_free".into(), s.blocks_free.into());
        m.insert("statfs.files".into(), s.files.into());
        m.insert("statfs.files_free".into(), s.files_free.into());
    }
    serde_json::Value::Object(m)
}

/// Makes everything written to the mount durable (what syncfs would do).
pub fn sync_mount(mountpoint: &Path) -> Result<()> {
    Ok(quilt_mountctl::sync(mountpoint)?)
}

/// The counters of the server of `mountpoint`.
pub fn query_stats(mountpoint: &Path) -> Result<serde_json::Value> {
    Ok(quilt_mountctl::stats(mountpoint)?)
}

/// One request to the server's control socket.
fn ask(mountpoint: &Path, what: &str) -> Result<String> {
    Ok(quilt_mountctl::ask(mountpoint, what)?)
}

/// `mount -t fuse.quiltfs IMAGE DIR -o OPTS` runs us as `mount.fuse.quiltfs`.
pub fn helper_main(args: Vec<String>) -> Result<()> {
    let mut pos = Vec::new();
    let mut opts = Vec::new();
    let mut it = args.into_iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => opts.extend(it.next().unwrap_or_default().split(',').map(String::from)),
            "-n" | "-s" | "-v" | "-f" => {}
            _ if a.starts_with("-o") => opts.extend(a[2..].split(',').map(String::from)),
            _ => pos.push(a),
        }
    }
    if pos.len() != 2 {
        bail!("usage: mount.fuse.quiltfs IMAGE MOUNTPOINT [-o OPTIONS]");
    }
    let a = MountArgs {
        image: PathBuf::from(&pos[0]),
        mountpoint: PathBuf::from(&pos[1]),
        mode: Mode::SoftUpdates,
        foreground: false,
        r#unsafe: false,
        cache_mib: crate::image::DEFAULT_CACHE_MIB,
        options: opts,
        notify_ready: false,
    };
    run(a)
}

/// Unmounts `mountpoint` and waits until its server has written everything back and
/// exited, and reports how that ended: an error if the final write-back failed (the
/// server leaves its outcome in a status file: the kernel ignores a FUSE server's
/// answer to DESTROY), if the server vanished without saying, or if something still
/// holds the image afterwards. When this returns Ok, no process and no loop device of
/// ours holds the image. util-linux's `umount` runs this as the `umount.fuse.quiltfs`
/// and `umount.fuseblk.quiltfs` helpers, so `umount MOUNTPOINT` waits and reports too.
/// `quiltfs umount --if-dead`: detaches the mount at `mountpoint` if its server died
/// (the kernel answers ENOTCONN for it), and does nothing otherwise.
pub fn detach_if_dead(mountpoint: &Path) -> Result<()> {
    match std::fs::metadata(mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            quilt_fuse::unmount(mountpoint, true)
                .with_context(|| format!("cannot detach {}", mountpoint.display()))?;
            eprintln!(
                "quiltfs: detached {}, whose server had gone",
                mountpoint.display()
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

pub fn unmount_and_wait(mountpoint: &Path, lazy: bool) -> Result<()> {
    let pid: Option<u32> = ask(mountpoint, "pid")
        .ok()
        .and_then(|b| b.trim().parse().ok());
    let image = ask(mountpoint, "image").ok().map(PathBuf::from);
    // A pidfd taken before the unmount: it becomes readable once every thread of the
    // server has exited (its descriptors closed), and it cannot name another process.
    let pidfd = pid.and_then(pidfd_open);
    if let Some(pid) = pid {
        let _ = std::fs::remove_file(quilt_mountctl::status_path(mountpoint, pid));
    }
    quilt_fuse::unmount(mountpoint, lazy)
        .with_context(|| format!("cannot unmount {}", mountpoint.display()))?;
    if lazy {
        // The kernel lets go of a lazily unmounted file system only once nothing uses
        // it: there is nothing to wait for here.
        return Ok(());
    }
    let log = quilt_mountctl::runtime_paths(mountpoint).1;
    if let (Some(pid), Some(fd)) = (pid, pidfd) {
        wait_exit(&fd, pid);
        let status = quilt_mountctl::status_path(mountpoint, pid);
        let text = std::fs::read_to_string(&status);
        let _ = std::fs::remove_file(&status);
        match text {
            Ok(t) if t.trim() == "ok" => {}
            Ok(t) => bail!(
                "the server of {} ended badly: {} (its log: {})",
                mountpoint.display(),
                t.trim().trim_start_matches("error: "),
                log.display()
            ),
            Err(_) => bail!(
                "the server of {} (pid {pid}) exited without saying how its unmount ended \
                 (killed?); its log: {}",
                mountpoint.display(),
                log.display()
            ),
        }
    }
    if let Some(img) = image.filter(|i| i.is_absolute()) {
        // A server killed outright leaves its loop device to autoclear, which the kernel
        // does once the mount has gone; and the image's lock goes with the server.
        let start = std::time::Instant::now();
        let wait = std::time::Duration::from_secs(30);
        let ours = |name: &String| {
            std::fs::read_to_string(format!("/sys/block/{name}/loop/autoclear"))
                .is_ok_and(|a| a.trim() == "1")
        };
        loop {
            let loops: Vec<String> = crate::image::loop_devices_over(&img)
                .into_iter()
                .filter(ours)
                .collect();
            let locked = std::fs::File::open(&img)
                .is_ok_and(|f| quilt_block::lock_file(&f, &img, false).is_err());
            if loops.is_empty() && !locked {
                break;
            }
            if start.elapsed() > wait {
                bail!(
                    "{} is still held after the unmount ({}{})",
                    img.display(),
                    if loops.is_empty() {
                        String::new()
                    } else {
                        format!("by {}", loops.join(", "))
                    },
                    if locked {
                        "; a process has it locked"
                    } else {
                        ""
                    }
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a fresh descriptor we own.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits until the process behind `pidfd` has exited, saying so after five seconds.
fn wait_exit(pidfd: &std::os::fd::OwnedFd, pid: u32) {
    use std::os::fd::AsRawFd;
    let start = std::time::Instant::now();
    let mut told = false;
    loop {
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, a bounded timeout.
        let n = unsafe { libc::poll(&mut p, 1, 1000) };
        if n > 0
            || (n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
        {
            return;
        }
        if !told && start.elapsed() > std::time::Duration::from_secs(5) {
            eprintln!("quiltfs: waiting for server {pid} to finish writing back");
            told = true;
        }
    }
}

/// `umount MOUNTPOINT` runs us as `umount.fuse.quiltfs MOUNTPOINT [-flnrv] [-t TYPE]`.
pub fn umount_helper_main(args: Vec<String>) -> Result<()> {
    let mut target = None;
    let mut lazy = false;
    let mut it = args.into_iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "-t" | "-N" => {
                it.next();
            }
            _ if a.starts_with('-') => lazy |= a.contains('l'),
            _ => target = target.or(Some(a)),
        }
    }
    let target = target.context("usage: umount.fuse.quiltfs MOUNTPOINT")?;
    unmount_and_wait(Path::new(&target), lazy)
}

/// The line we add to libmount's /run/mount/utab. With an entry there, util-linux's
/// `umount` reads the mount table instead of trusting statfs (which says plain "fuse"),
/// sees type fuse.quiltfs and runs our `umount.fuse.quiltfs` helper, which waits for the
/// final write-back.
fn utab_entry(image: &Path, mountpoint: &Path) -> String {
    let esc = |p: &Path| {
        let c = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
        c.display()
            .to_string()
            .replace('\\', "\\x5c")
            .replace(' ', "\\x20")
    };
    format!(
        "SRC={} TARGET={} ROOT=/ OPTS=uhelper=quiltfs",
        esc(image),
        esc(mountpoint)
    )
}

fn edit_utab(f: impl FnOnce(&mut Vec<String>)) {
    let dir = Path::new("/run/mount");
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // libmount's lock protocol: flock on utab.lock around every change.
    let Ok(lock) = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("utab.lock"))
    else {
        return;
    };
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; released when `lock` closes.
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    let path = dir.join("utab");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    f(&mut lines);
    let mut out = lines.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    let tmp = dir.join("utab.quiltfs.tmp");
    if std::fs::write(&tmp, out).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}
