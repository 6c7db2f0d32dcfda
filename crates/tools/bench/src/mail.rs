//! `quiltfs bench mail`: the Featherstitch paper's IMAP benchmark with a real IMAP server.
//!
//! Dovecot's `imap` runs pre-authenticated on a pipe (as an unprivileged user: Dovecot
//! refuses root) over a maildir on the file system under test, and our client moves a
//! mailbox: SELECT the source, CREATE the destination, COPY each message and STORE
//! \Deleted on it, EXPUNGE, CHECK, CLOSE, LOGOUT. Each file system sits on its own loop
//! device, so write and flush requests are counted the same way for the kernel's ext3
//! and for quiltfs (`/sys/block/loopN/stat`). Runs are interleaved across
//! configurations; the report gives medians with min–max.

use super::{cpu_of, csv, jbd2_thread, loop_stat, median, sh};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const USER: &str = "quiltmail";
const IMAP: &str = "/usr/lib/dovecot/imap";

#[derive(clap::Args)]
pub struct MailArgs {
    /// Messages in the source mailbox.
    #[arg(long, default_value_t = 1000)]
    pub messages: usize,
    /// Size of each message in bytes.
    #[arg(long, default_value_t = 2048)]
    pub message_size: usize,
    /// Runs of each configuration (interleaved).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Comma-separated configurations (default: all; see the report for names).
    #[arg(long)]
    pub configs: Option<String>,
    /// 200 messages, one run: a few seconds per configuration.
    #[arg(long)]
    pub quick: bool,
    /// Write results.json, results.csv and report.md here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Where the images live while a run lasts (a local disk).
    #[arg(long, default_value = "/var/tmp/quiltfs-bench-mail")]
    pub work: PathBuf,
    /// More mount options for every quiltfs configuration (for comparisons, such as
    /// handoff=never); the report names them.
    #[arg(long)]
    pub mount_options: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fs {
    /// The kernel's ext3 with data=journal.
    Ext3Journal,
    /// A FUSE passthrough (Debian's bindfs) over the kernel's ext3 with data=journal:
    /// what any FUSE file system pays on this kernel for the same calls (the floor).
    Bindfs,
    Quilt(&'static str),
}

#[derive(Debug, Clone, Copy)]
struct Conf {
    name: &'static str,
    what: &'static str,
    fs: Fs,
    /// Dovecot's mail_fsync setting.
    fsync: &'static str,
    /// Run Dovecot under the patchgroup LD_PRELOAD library.
    preload: bool,
}

const CONFS: &[Conf] = &[
    Conf {
        name: "ext3-journal-fsync",
        what: "kernel ext3 data=journal, Dovecot's fsync",
        fs: Fs::Ext3Journal,
        fsync: "optimized",
        preload: false,
    },
    Conf {
        name: "quilt-full-fsync",
        what: "quiltfs full-journal, Dovecot's fsync",
        fs: Fs::Quilt("full-journal"),
        fsync: "optimized",
        preload: false,
    },
    Conf {
        name: "quilt-su-fsync",
        what: "quiltfs soft updates, Dovecot's fsync",
        fs: Fs::Quilt("soft-updates"),
        fsync: "optimized",
        preload: false,
    },
    Conf {
        name: "quilt-full-pg",
        what: "quiltfs full-journal, fsync as patchgroups (LD_PRELOAD)",
        fs: Fs::Quilt("full-journal"),
        fsync: "optimized",
        preload: true,
    },
    Conf {
        name: "quilt-su-pg",
        what: "quiltfs soft updates, fsync as patchgroups (LD_PRELOAD)",
        fs: Fs::Quilt("soft-updates"),
        fsync: "optimized",
        preload: true,
    },
    Conf {
        name: "betrfs-fsync",
        what: "quiltfs betrfs, Dovecot's fsync",
        fs: Fs::Quilt("betrfs"),
        fsync: "optimized",
        preload: false,
    },
    Conf {
        name: "betrfs-pg",
        what: "quiltfs betrfs, fsync as patchgroups (LD_PRELOAD)",
        fs: Fs::Quilt("betrfs"),
        fsync: "optimized",
        preload: true,
    },
    Conf {
        name: "ext3-journal-nofsync",
        what: "UNSAFE: kernel ext3 data=journal, fsync disabled",
        fs: Fs::Ext3Journal,
        fsync: "never",
        preload: false,
    },
    Conf {
        name: "bindfs-nofsync",
        what: "UNSAFE: bindfs (FUSE passthrough) over kernel ext3 data=journal, fsync disabled",
        fs: Fs::Bindfs,
        fsync: "never",
        preload: false,
    },
    Conf {
        name: "quilt-su-nofsync",
        what: "UNSAFE: quiltfs soft updates, fsync disabled",
        fs: Fs::Quilt("soft-updates"),
        fsync: "never",
        preload: false,
    },
];

/// One measured move.
#[derive(Debug, Clone, serde::Serialize)]
struct Sample {
    config: &'static str,
    run: usize,
    seconds: f64,
    /// CPU of Dovecot's imap process (user + system).
    imap_cpu: f64,
    /// CPU of the file system's own threads: the quiltfs server, or the kernel's jbd2
    /// thread (ext3's work done inside system calls is in imap_cpu).
    fs_cpu: f64,
    device_writes: u64,
    device_flushes: u64,
    /// A sync of the whole file system after logout: what it took to make the move
    /// durable where the session did not.
    sync_seconds: f64,
    /// Write and flush requests of the session and the final sync together.
    total_writes: u64,
    total_flushes: u64,
    /// fsync and fsyncdir requests that reached the quiltfs server.
    fsync_requests: u64,
    /// Patchgroup calls the quiltfs server served.
    pg_calls: u64,
}

/// The FUSE request counters of a quiltfs mount that the report shows.
fn quilt_requests(mnt: &Path) -> (u64, u64) {
    let Ok(exe) = crate::quiltfs_exe() else {
        return (0, 0);
    };
    let Ok(out) = sh(Command::new(exe).arg("stats").arg(mnt)) else {
        return (0, 0);
    };
    let get = |k: &str| -> u64 {
        out.lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(k)).then(|| w.next().and_then(|v| v.parse().ok()))?
            })
            .unwrap_or(0)
    };
    (
        get("fuse.fsync.count") + get("fuse.fsyncdir.count"),
        get("fuse.ioctl.count"),
    )
}

fn ensure_prerequisites() -> Result<()> {
    super::require_root("bench mail")?;
    if !Path::new(IMAP).exists() {
        eprintln!("bench mail: installing Dovecot (dovecot-imapd)");
        sh(Command::new("apt-get")
            .args(["install", "-y", "-qq", "dovecot-imapd"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("installing dovecot-imapd")?;
    }
    if sh(Command::new("id").arg("-u").arg(USER)).is_err() {
        sh(Command::new("useradd").args([
            "-r",
            "-M",
            "-d",
            "/nonexistent",
            "-s",
            "/usr/sbin/nologin",
            USER,
        ]))?;
    }
    for tool in ["mkfs.ext3", "losetup", "e2fsck"] {
        if !super::have(tool) {
            bail!("bench mail needs {tool} (Debian packages e2fsprogs and mount)");
        }
    }
    Ok(())
}

fn ids() -> Result<(u32, u32)> {
    let uid = sh(Command::new("id").arg("-u").arg(USER))?.trim().parse()?;
    let gid = sh(Command::new("id").arg("-g").arg(USER))?.trim().parse()?;
    Ok((uid, gid))
}

/// Everything one run set up, torn down in reverse on drop (also after errors).
struct Mounted {
    image: PathBuf,
    dev: Option<String>,
    mnt: PathBuf,
    mounted: bool,
    quilt: bool,
    server: Option<u32>,
    /// The kernel file system a passthrough serves, mounted beside `mnt`.
    lower: Option<PathBuf>,
}

impl Mounted {
    /// Unmounts the mount and the one under a passthrough.
    fn unmount(&mut self) -> Result<()> {
        if self.mounted {
            if self.quilt {
                sh(Command::new(crate::quiltfs_exe()?)
                    .arg("umount")
                    .arg(&self.mnt))?;
            } else {
                sh(Command::new("umount").arg(&self.mnt))?;
            }
            self.mounted = false;
        }
        if let Some(l) = self.lower.take() {
            sh(Command::new("umount").arg(&l))?;
            let _ = std::fs::remove_dir(&l);
        }
        Ok(())
    }

    /// Makes everything written so far durable: through the mount for quiltfs and
    /// kernel file systems, and for a passthrough on the file system under it (a FUSE
    /// mount without a block device gets no syncfs).
    fn sync(&self) -> Result<()> {
        if self.quilt {
            quilt_mountctl::sync(&self.mnt)?;
        } else {
            sh(Command::new("sync")
                .arg("-f")
                .arg(self.lower.as_ref().unwrap_or(&self.mnt)))?;
        }
        Ok(())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.unmount().is_err() {
            // Nothing may stay mounted: what the orderly unmount left, lazily.
            if self.mounted {
                let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
            }
            if let Some(l) = self.lower.take() {
                let _ = Command::new("umount").arg("-l").arg(&l).status();
                let _ = std::fs::remove_dir(&l);
            }
        }
        if let Some(d) = &self.dev {
            let _ = Command::new("losetup").arg("-d").arg(d).status();
        }
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_dir(&self.mnt);
    }
}

fn message(i: usize, size: usize) -> Vec<u8> {
    let mut m = format!(
        "From: sender{i}@example.org\r\nTo: {USER}@example.org\r\nSubject: message {i}\r\nMessage-ID: <{i}@quiltfs.bench>\r\n\r\n"
    )
    .into_bytes();
    // Filler text, the same for the same message in every run.
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(i as u64);
    while m.len() + 2 < size {
        m.push(rng.random_range(b'a'..=b'z'));
        if m.len() % 76 == 0 {
            m.extend_from_slice(b"\r\n");
        }
    }
    m.extend_from_slice(b"\r\n");
    m
}

fn setup(
    conf: &Conf,
    work: &Path,
    n: usize,
    size: usize,
    options: Option<&str>,
) -> Result<Mounted> {
    let image = work.join(format!("{}.img", conf.name));
    let mnt = work.join(format!("{}.mnt", conf.name));
    std::fs::create_dir_all(&mnt)?;
    let quiltfs = crate::quiltfs_exe()?;
    let mut m = Mounted {
        image: image.clone(),
        dev: None,
        mnt: mnt.clone(),
        mounted: false,
        quilt: matches!(conf.fs, Fs::Quilt(_)),
        server: None,
        lower: None,
    };
    let size_mib = 256 + n * size / (1 << 20) * 3;
    match conf.fs {
        Fs::Ext3Journal | Fs::Bindfs => {
            let f = std::fs::File::create(&image)?;
            f.set_len((size_mib as u64) << 20)?;
            sh(Command::new("mkfs.ext3")
                .args(["-q", "-F", "-b", "4096"])
                .arg(&image))?;
        }
        Fs::Quilt("betrfs") => {
            let f = std::fs::File::create(&image)?;
            f.set_len((size_mib as u64) << 20)?;
            sh(Command::new(&quiltfs)
                .args(["mkfs", "--fs", "betrfs", "--force"])
                .arg(&image))?;
        }
        Fs::Quilt(mode) => {
            super::quilt_mkfs(
                &image,
                size_mib as u64,
                crate::systems::QuiltFs::Ext2,
                mode.contains("journal"),
            )?;
        }
    }
    let dev = sh(Command::new("losetup").args(["-f", "--show"]).arg(&image))?
        .trim()
        .to_string();
    m.dev = Some(dev.clone());
    match conf.fs {
        Fs::Ext3Journal => {
            sh(Command::new("mount")
                .args(["-t", "ext3", "-o", "data=journal"])
                .arg(&dev)
                .arg(&mnt))?;
        }
        Fs::Bindfs => {
            let lower = work.join(format!("{}.lower", conf.name));
            std::fs::create_dir_all(&lower)?;
            sh(Command::new("mount")
                .args(["-t", "ext3", "-o", "data=journal"])
                .arg(&dev)
                .arg(&lower))?;
            m.lower = Some(lower.clone());
            // Run as root, it adds allow_other and creates files as their creator; it
            // returns once mounted, its server in the background.
            sh(Command::new("bindfs").arg(&lower).arg(&mnt))?;
            m.server = sh(Command::new("pgrep").args(["-n", "-x", "bindfs"]))
                .ok()
                .and_then(|p| p.trim().parse().ok());
        }
        Fs::Quilt(mode) => {
            let mut c = Command::new(&quiltfs);
            c.arg("mount")
                .arg(&dev)
                .arg(&mnt)
                .args(["-o", "allow_other"]);
            if let Some(o) = options {
                c.args(["-o", o]);
            }
            if mode != "betrfs" {
                c.args(["--mode", mode]);
            }
            let out = sh(&mut c)?;
            m.server = out
                .split("server pid ")
                .nth(1)
                .and_then(|s| s.trim().trim_end_matches(')').parse().ok());
        }
    }
    m.mounted = true;
    // The source mailbox, owned by the mail user.
    let (uid, gid) = ids()?;
    let home = mnt.join("home");
    let cur = home.join("Maildir/cur");
    std::fs::create_dir_all(&cur)?;
    std::fs::create_dir_all(home.join("Maildir/new"))?;
    std::fs::create_dir_all(home.join("Maildir/tmp"))?;
    for i in 0..n {
        std::fs::write(
            cur.join(format!("{}.M{i}.bench:2,", 1_700_000_000 + i)),
            message(i, size),
        )?;
    }
    sh(Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(&home))?;
    Ok(m)
}

fn dovecot_conf(work: &Path, fsync: &str, preload: bool) -> Result<PathBuf> {
    let p = work.join(format!("dovecot-{fsync}-{preload}.conf"));
    // imap re-executes itself through doveconf with a cleaned environment: the preload
    // library and its settings must be let through by name.
    let import = if preload {
        "import_environment = TZ CORE_OUTOFMEM CORE_ERROR LD_PRELOAD QUILTFS_MOUNT QUILTFS_FSYNC\n"
    } else {
        ""
    };
    let run = work.join("dovecot-run");
    std::fs::create_dir_all(&run)?;
    std::fs::write(
        &p,
        format!(
            "mail_location = maildir:~/Maildir\nmail_fsync = {fsync}\nssl = no\nlisten =\nlog_path = /dev/null\nbase_dir = {}\nstate_dir = {}\n{import}",
            run.display(),
            run.display()
        ),
    )?;
    Ok(p)
}

/// A pre-authenticated imap process for the mail user over pipes.
struct Imap {
    child: std::process::Child,
    to: std::process::ChildStdin,
    from: BufReader<std::process::ChildStdout>,
    tag: u64,
}

impl Imap {
    fn start(home: &Path, conf: &Path, preload: Option<(&Path, &Path)>) -> Result<Imap> {
        let (uid, gid) = ids()?;
        let mut c = Command::new(IMAP);
        c.arg("-c")
            .arg(conf)
            .env_clear()
            .env("USER", USER)
            .env("HOME", home)
            .env("PATH", "/usr/bin:/bin");
        if let Some((lib, mnt)) = preload {
            c.env("LD_PRELOAD", lib).env("QUILTFS_MOUNT", mnt);
        }
        std::os::unix::process::CommandExt::uid(&mut c, uid);
        std::os::unix::process::CommandExt::gid(&mut c, gid);
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {IMAP}"))?;
        let to = child.stdin.take().context("imap stdin")?;
        let from = BufReader::new(child.stdout.take().context("imap stdout")?);
        let mut me = Imap {
            child,
            to,
            from,
            tag: 0,
        };
        let greeting = me.line()?;
        if !greeting.starts_with("* PREAUTH") {
            bail!("imap did not log in: {greeting}");
        }
        Ok(me)
    }

    fn line(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.from.read_line(&mut l)? == 0 {
            let mut err = String::new();
            if let Some(e) = self.child.stderr.as_mut() {
                let _ = std::io::Read::read_to_string(e, &mut err);
            }
            bail!("imap exited: {}", err.trim());
        }
        Ok(l)
    }

    /// Sends one command and waits for its tagged reply, which must be OK.
    fn cmd(&mut self, c: &str) -> Result<()> {
        self.tag += 1;
        let tag = format!("a{}", self.tag);
        write!(self.to, "{tag} {c}\r\n")?;
        self.to.flush()?;
        loop {
            let l = self.line()?;
            if let Some(rest) = l.strip_prefix(&format!("{tag} ")) {
                if rest.starts_with("OK") {
                    return Ok(());
                }
                bail!("imap {c}: {}", rest.trim());
            }
        }
    }

    /// Waits for the process; returns its CPU seconds.
    fn finish(self) -> Result<f64> {
        drop(self.to);
        let r = super::reap(&self.child).context("waiting for imap")?;
        Ok(r.user + r.sys)
    }
}

fn one_run(conf: &Conf, run: usize, a: &MailArgs, n: usize, preload_lib: &Path) -> Result<Sample> {
    let m = setup(conf, &a.work, n, a.message_size, a.mount_options.as_deref())?;
    let dev = m.dev.clone().unwrap_or_default();
    let home = m.mnt.join("home");
    let dconf = dovecot_conf(&a.work, conf.fsync, conf.preload)?;
    let preload = conf.preload.then_some((preload_lib, m.mnt.as_path()));
    // Warm-up, outside the timing: Dovecot indexes the source mailbox.
    let mut w = Imap::start(&home, &dconf, None)?;
    w.cmd("SELECT INBOX")?;
    w.cmd("LOGOUT")?;
    w.finish()?;
    m.sync()?;
    let (w0, f0) = loop_stat(&dev)?;
    let fs_pid = m.server.or_else(|| jbd2_thread(&dev));
    let fs0 = fs_pid.map(cpu_of).map(|(u, s)| u + s).unwrap_or(0.0);
    let (q0, p0) = if m.quilt {
        quilt_requests(&m.mnt)
    } else {
        (0, 0)
    };
    let t0 = Instant::now();
    let mut s = Imap::start(&home, &dconf, preload)?;
    s.cmd("SELECT INBOX")?;
    s.cmd("CREATE Dest")?;
    for i in 1..=n {
        s.cmd(&format!("COPY {i} Dest"))?;
        s.cmd(&format!("STORE {i} +FLAGS.SILENT (\\Deleted)"))?;
    }
    s.cmd("EXPUNGE")?;
    s.cmd("CHECK")?;
    s.cmd("CLOSE")?;
    s.cmd("LOGOUT")?;
    let imap_cpu = s.finish()?;
    let seconds = t0.elapsed().as_secs_f64();
    let (w1, f1) = loop_stat(&dev)?;
    let t1 = Instant::now();
    m.sync()?;
    let sync_seconds = t1.elapsed().as_secs_f64();
    let (w2, f2) = loop_stat(&dev)?;
    let fs_cpu = fs_pid.map(cpu_of).map(|(u, s)| u + s).unwrap_or(0.0) - fs0;
    let (q1, p1) = if m.quilt {
        quilt_requests(&m.mnt)
    } else {
        (0, 0)
    };
    if m.quilt && std::env::var_os("QUILTFS_BENCH_STATS").is_some() {
        // For digging into a configuration: the server's counters after the move.
        if let Ok(st) = sh(Command::new(crate::quiltfs_exe()?).arg("stats").arg(&m.mnt)) {
            eprintln!("{} run {}:\n{st}", conf.name, run + 1);
        }
    }
    // The move happened: every message in the destination, none left in the source.
    let count = |d: &str| {
        std::fs::read_dir(home.join(d))
            .map(|r| r.count())
            .unwrap_or(0)
    };
    let moved = count("Maildir/.Dest/cur") + count("Maildir/.Dest/new");
    let left = count("Maildir/cur") + count("Maildir/new");
    if moved != n || left != 0 {
        bail!(
            "{}: the move left {moved} messages in Dest and {left} in INBOX",
            conf.name
        );
    }
    let image = m.image.clone();
    // Unmount, then the image must be clean.
    let mut m = m;
    m.unmount()?;
    if let Some(d) = m.dev.take() {
        sh(Command::new("losetup").arg("-d").arg(&d))?;
    }
    let fsck = if matches!(conf.fs, Fs::Quilt("betrfs")) {
        Command::new(crate::quiltfs_exe()?)
            .args(["fsck", "-n"])
            .arg(&image)
            .output()?
    } else {
        Command::new("e2fsck").arg("-fn").arg(&image).output()?
    };
    if !fsck.status.success() {
        let kept = image.with_extension("failed.img");
        let _ = std::fs::rename(&image, &kept);
        bail!(
            "{}: the file system check found problems after the run (image kept as {}):\n{}",
            conf.name,
            kept.display(),
            String::from_utf8_lossy(&fsck.stdout)
        );
    }
    drop(m);
    Ok(Sample {
        config: conf.name,
        run,
        seconds,
        imap_cpu,
        fs_cpu,
        device_writes: w1 - w0,
        device_flushes: f1 - f0,
        sync_seconds,
        total_writes: w2 - w0,
        total_flushes: f2 - f0,
        fsync_requests: q1 - q0,
        pg_calls: p1 - p0,
    })
}

pub fn run(a: MailArgs) -> Result<()> {
    ensure_prerequisites()?;
    let (n, runs) = if a.quick {
        (200, 1)
    } else {
        (a.messages, a.runs.max(1))
    };
    let confs: Vec<Conf> = match &a.configs {
        None => CONFS.to_vec(),
        Some(list) => list
            .split(',')
            .map(|name| {
                CONFS
                    .iter()
                    .copied()
                    .find(|c| c.name == name.trim())
                    .with_context(|| {
                        format!(
                            "unknown configuration '{name}' (one of: {})",
                            CONFS.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
                        )
                    })
            })
            .collect::<Result<_>>()?,
    };
    if confs.iter().any(|c| c.fs == Fs::Bindfs) && !super::have("bindfs") {
        eprintln!("bench mail: installing bindfs");
        sh(Command::new("apt-get")
            .args(["install", "-y", "-qq", "bindfs"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("installing bindfs")?;
    }
    let exe = crate::quiltfs_exe()?;
    let lib = exe
        .parent()
        .map(|d| d.join("libquilt_preload.so"))
        .filter(|p| p.exists())
        .or_else(|| Some(PathBuf::from("/usr/local/lib/libquilt_preload.so")).filter(|p| p.exists()))
        .context("libquilt_preload.so is neither next to quiltfs nor in /usr/local/lib: run scripts/setup.sh")?;
    std::fs::create_dir_all(&a.work)?;
    // The mail user must reach the mounts under the work directory.
    sh(Command::new("chmod").arg("755").arg(&a.work))?;
    super::catch_interrupts();
    let mut bar = super::Progress::new((confs.len() * runs) as u64, "runs");
    let mut samples = Vec::new();
    for run in 0..runs {
        for c in &confs {
            if super::interrupted() {
                bar.finish();
                bail!(
                    "interrupted: everything this run set up was unmounted, detached and removed"
                );
            }
            bar.step(format!("{} (run {})", c.name, run + 1));
            let s = one_run(c, run, &a, n, &lib)
                .with_context(|| format!("{} run {}", c.name, run + 1))?;
            bar.inc();
            samples.push(s);
        }
    }
    bar.finish();
    let mut report = report(&confs, &samples, n, a.message_size, runs);
    if let Some(o) = &a.mount_options {
        report.push_str(&format!(
            "\nEvery quiltfs configuration was mounted with `-o {o}` as well.\n"
        ));
    }
    print!("{report}");
    if let Some(out) = &a.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("report.md"), &report)?;
        std::fs::write(
            out.join("results.json"),
            serde_json::to_string_pretty(&samples)?,
        )?;
        std::fs::write(out.join("results.csv"), csv(&samples)?)?;
        println!("results in {}", out.display());
    }
    Ok(())
}

fn report(confs: &[Conf], samples: &[Sample], n: usize, size: usize, runs: usize) -> String {
    let mut t = format!(
        "## Mail move: {n} messages of {size} B, Dovecot {} (imap, maildir), {runs} run(s) each, medians (min–max)\n\n\
         | configuration | time s | vs unsafe ext3 | imap CPU s | fs CPU s | device writes | device flushes | then sync s | writes incl. sync | flushes incl. sync | fsyncs at server | patchgroup calls |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        dovecot_version()
    );
    let med = |name: &str, f: &dyn Fn(&Sample) -> f64| {
        median(samples.iter().filter(|s| s.config == name).map(f).collect())
    };
    let unsafe_time = med("ext3-journal-nofsync", &|s| s.seconds).0;
    for c in confs {
        let (ts, tmin, tmax) = med(c.name, &|s| s.seconds);
        let ratio = if unsafe_time > 0.0 {
            format!("{:.2}×", ts / unsafe_time)
        } else {
            "–".into()
        };
        let (ic, _, _) = med(c.name, &|s| s.imap_cpu);
        let (fc, _, _) = med(c.name, &|s| s.fs_cpu);
        let (wr, _, _) = med(c.name, &|s| s.device_writes as f64);
        let (fl, _, _) = med(c.name, &|s| s.device_flushes as f64);
        let (ss, _, _) = med(c.name, &|s| s.sync_seconds);
        let (tw, _, _) = med(c.name, &|s| s.total_writes as f64);
        let (tf, _, _) = med(c.name, &|s| s.total_flushes as f64);
        let (fq, _, _) = med(c.name, &|s| s.fsync_requests as f64);
        let (pg, _, _) = med(c.name, &|s| s.pg_calls as f64);
        let quilt_only = |v: f64| {
            if matches!(c.fs, Fs::Quilt(_)) {
                format!("{v:.0}")
            } else {
                "–".into()
            }
        };
        t.push_str(&format!(
            "| {} (`{}`) | {ts:.2} ({tmin:.2}–{tmax:.2}) | {ratio} | {ic:.2} | {fc:.2} | {wr:.0} | {fl:.0} | {ss:.2} | {tw:.0} | {tf:.0} | {} | {} |\n",
            c.what, c.name, quilt_only(fq), quilt_only(pg)
        ));
    }
    t.push_str(
        "\nTime is the IMAP session from start to logout. imap CPU is Dovecot's process \
         (for the kernel's ext3 this includes the file system's work in system calls); \
         fs CPU is the FUSE server (quiltfs, bindfs), or ext3's jbd2 thread. Device requests are write \
         and flush requests completed by the loop device under each file system, during \
         the session and then including a `sync -f` of the mount after logout (the \
         patchgroup and fsync-disabled configurations promise order, or nothing, when the \
         session ends; the sync is what makes their move durable).\n",
    );
    t
}

fn dovecot_version() -> String {
    Command::new("dovecot")
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default()
}
