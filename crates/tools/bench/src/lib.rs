//! quilt-bench: the benchmark suites of `quiltfs bench`, which run quiltfs side by side
//! with the systems a user would pick instead, on this machine, in one command.
//!
//! What the suites share lives here: running commands, reading device and CPU counters,
//! medians, CSV, progress, and stopping cleanly on Ctrl-C; `systems` sets up every
//! system on its own loop device (kernel file systems, FUSE peers, quiltfs's modules)
//! and tears it down again. The suites (`featherstitch`, `mail`, `betrfs`) run inside
//! the `quiltfs` binary and start it again for mkfs and mount; the key-value suite
//! (`bench/kv`, a workspace of its own so the project never builds RocksDB) uses the
//! same helpers.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod bark;
pub mod betrfs;
pub mod cudele;
pub mod cudele_mounts;
pub mod featherstitch;
pub mod floor;
pub mod gnothi;
pub mod mail;
pub mod plot;
pub mod systems;

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Runs a command to completion; its standard output, or an error with its stderr.
pub fn sh(cmd: &mut Command) -> Result<String> {
    let what = format!("{cmd:?}");
    let o = cmd.output().with_context(|| format!("running {what}"))?;
    if !o.status.success() {
        bail!(
            "{what} failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Whether `tool` is on the PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs Debian packages that are missing (the suites run as root).
pub fn apt_install(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg")
                .args(["-s", p])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("bench: installing {}", missing.join(" "));
    sh(Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .with_context(|| format!("installing {}", missing.join(" ")))?;
    Ok(())
}

/// The FUSE requests between two counter snapshots, by type (`fuse.<type>.count`).
pub fn request_counts(
    a: Option<&serde_json::Value>,
    b: Option<&serde_json::Value>,
) -> Option<std::collections::BTreeMap<String, u64>> {
    let (a, b) = (a?.as_object()?, b?.as_object()?);
    let counts = b
        .iter()
        .filter_map(|(k, v)| {
            let t = k.strip_prefix("fuse.")?.strip_suffix(".count")?;
            let before = a.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            let n = v.as_u64()?.saturating_sub(before);
            (n > 0).then(|| (t.to_string(), n))
        })
        .collect();
    Some(counts)
}

pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} needs root (loop devices, mounts, dropping caches)");
    }
    Ok(())
}

/// Write and flush requests completed by a block device so far.
pub fn loop_stat(dev: &str) -> Result<(u64, u64)> {
    let name = dev.trim_start_matches("/dev/");
    let s = std::fs::read_to_string(format!("/sys/block/{name}/stat"))?;
    let f: Vec<u64> = s
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if f.len() < 17 {
        bail!("/sys/block/{name}/stat has no flush counts");
    }
    Ok((f[4], f[15]))
}

/// CPU seconds (user, system) a process or kernel thread has used so far.
pub fn cpu_of(pid: u32) -> (f64, f64) {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0.0, 0.0);
    };
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) as f64 / hz, ticks(12) as f64 / hz)
}

/// The kernel's journal thread for `dev` (jbd2/loopN-8).
pub fn jbd2_thread(dev: &str) -> Option<u32> {
    let want = format!("jbd2/{}-", dev.trim_start_matches("/dev/"));
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        comm.starts_with(&want).then_some(pid)
    })
}

/// How a child process ended and the CPU it and its waited-for descendants used.
pub struct Reaped {
    pub status: i32,
    pub user: f64,
    pub sys: f64,
    /// Peak resident set size over the process's life, MiB.
    pub peak_rss_mib: f64,
}

impl Reaped {
    pub fn success(&self) -> bool {
        libc::WIFEXITED(self.status) && libc::WEXITSTATUS(self.status) == 0
    }
}

/// Waits for a child we spawned and returns its resource usage (wait4).
pub fn reap(child: &std::process::Child) -> Result<Reaped> {
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain data that wait4 fills in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting for our own child, which nothing else waits for.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            bail!("waiting for process {pid}: {e}");
        }
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Reaped {
        status,
        user: secs(ru.ru_utime),
        sys: secs(ru.ru_stime),
        // Linux reports ru_maxrss in KiB.
        peak_rss_mib: ru.ru_maxrss as f64 / 1024.0,
    })
}

/// Median, minimum and maximum.
pub fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

/// Serializable rows as CSV (RFC 4180, by the csv crate), one column per field; a
/// field that is itself a structure (a map of request counts) is a cell of JSON,
/// quoted like any cell holding commas or quotes.
pub fn csv<T: serde::Serialize>(rows: &[T]) -> Result<String> {
    let rows = serde_json::to_value(rows)?;
    let rows = rows.as_array().cloned().unwrap_or_default();
    let Some(first) = rows.first().and_then(|r| r.as_object()) else {
        return Ok(String::new());
    };
    let keys: Vec<String> = first.keys().cloned().collect();
    let mut w = ::csv::Writer::from_writer(Vec::new());
    w.write_record(&keys)?;
    for r in &rows {
        w.write_record(keys.iter().map(|k| match &r[k] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => String::new(),
            v => v.to_string(),
        }))?;
    }
    Ok(String::from_utf8(
        w.into_inner().map_err(|e| e.into_error())?,
    )?)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on Ctrl-C sets a flag that the suites check between steps, so that what a
/// step set up is torn down by its guards rather than left behind.
pub fn catch_interrupts() {
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Progress of a suite: a bar with an estimate on a terminal, otherwise one line per
/// step on stderr (so logs of long runs show where they are).
pub struct Progress {
    bar: indicatif::ProgressBar,
    tty: bool,
    start: std::time::Instant,
    len: u64,
    done: u64,
}

impl Progress {
    pub fn new(len: u64, unit: &str) -> Progress {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = if tty {
            indicatif::ProgressBar::new(len)
        } else {
            indicatif::ProgressBar::hidden()
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(&format!(
                "{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {unit}, {{eta}} left  {{msg}}"
            ))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress {
            bar,
            tty,
            start: std::time::Instant::now(),
            len,
            done: 0,
        }
    }

    /// A step begins.
    pub fn step(&self, what: String) {
        if self.tty {
            self.bar.set_message(what);
            return;
        }
        let elapsed = self.start.elapsed().as_secs();
        let eta = (elapsed * self.len.saturating_sub(self.done))
            .checked_div(self.done)
            .map(|left| format!(", about {left} s left"))
            .unwrap_or_default();
        eprintln!(
            "bench: [{}/{}] {what} ({elapsed} s so far{eta})",
            self.done + 1,
            self.len
        );
    }

    /// A step ended.
    pub fn inc(&mut self) {
        self.done += 1;
        self.bar.inc(1);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `quiltfs`, for the subcommands a suite runs (mkfs, mount, stats): `QUILTFS_BIN` (set
/// by `quiltfs bench`, which runs this binary), else the `quiltfs` next to this binary,
/// else the one on the PATH.
pub fn quiltfs_exe() -> Result<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("QUILTFS_BIN") {
        return Ok(p.into());
    }
    let me = std::env::current_exe().context("finding the quiltfs-bench binary")?;
    let sibling = me.with_file_name("quiltfs");
    if sibling.is_file() {
        return Ok(sibling);
    }
    Ok("quiltfs".into())
}

/// `quiltfs mkfs IMAGE --size N M [--fs betrfs] [--journal]`: a fresh quiltfs image for
/// a suite.
pub fn quilt_mkfs(image: &Path, size_mib: u64, fs: systems::QuiltFs, journal: bool) -> Result<()> {
    let mut c = Command::new(quiltfs_exe()?);
    c.arg("mkfs");
    if fs == systems::QuiltFs::Betrfs {
        c.args(["--fs", "betrfs"]);
    }
    c.arg(image)
        .arg("--size")
        .arg(format!("{size_mib}M"))
        // The suite's own scratch image, made anew for every step.
        .arg("--force");
    if journal {
        c.arg("--journal");
    }
    sh(&mut c).map(|_| ())
}

/// Drops the kernel's clean caches, so each timed step starts cold.
pub fn drop_caches() -> Result<()> {
    sh(&mut Command::new("sync"))?;
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache")?;
    Ok(())
}

/// Whether something is mounted at `path` (by the kernel's mount table).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize() else {
        return false;
    };
    let want = canon.to_string_lossy().replace(' ', "\\040");
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split_whitespace().nth(4) == Some(want.as_str()))
    })
}

/// quiltfs mounts serve over io_uring when the fuse module allows it (as scripts/setup.sh
/// leaves it); the suites' `-dev` systems measure /dev/fuse. The reports say which
/// transport each run used (the server's `fuse.io_uring`).
pub fn enable_fuse_uring() {
    let p = std::path::Path::new("/sys/module/fuse/parameters/enable_uring");
    match std::fs::read_to_string(p) {
        Ok(v) if v.trim() != "Y" => match std::fs::write(p, "Y") {
            Ok(()) => eprintln!("bench: enabled FUSE over io_uring ({})", p.display()),
            Err(e) => eprintln!(
                "bench: cannot enable FUSE over io_uring: {e}; quiltfs serves on /dev/fuse"
            ),
        },
        Ok(_) => {}
        Err(_) => {
            eprintln!("bench: this kernel has no FUSE over io_uring; quiltfs serves on /dev/fuse")
        }
    }
}

/// The top directory inside the linux-source tarball.
pub const LINUX_TOP: &str = "linux-source-6.1";
const LINUX_XZ: &str = "/usr/src/linux-source-6.1.tar.xz";
/// The quick runs' slice of the kernel tree: about 1,500 files, 26 MB.
const QUICK_DIRS: &[&str] = &["kernel", "lib", "mm", "ipc", "init", "block", "certs"];

/// Debian's linux-source tarball, decompressed once under `work` (outside any timing);
/// with `quick`, a slice of it.
pub fn linux_tarball(work: &Path, quick: bool) -> Result<std::path::PathBuf> {
    let full = work.join("linux.tar");
    if !full.exists() {
        if !Path::new(LINUX_XZ).exists() {
            apt_install(&["linux-source-6.1", "xz-utils"])?;
        }
        eprintln!("bench: decompressing {LINUX_XZ} (once, outside the timing)");
        let tmp = work.join("linux.tar.tmp");
        let out = std::fs::File::create(&tmp)?;
        let st = Command::new("xz")
            .args(["-dc", "-T2", LINUX_XZ])
            .stdout(out)
            .status()
            .context("running xz")?;
        if !st.success() {
            let _ = std::fs::remove_file(&tmp);
            bail!("xz could not decompress {LINUX_XZ} ({st})");
        }
        std::fs::rename(&tmp, &full)?;
    }
    if !quick {
        return Ok(full);
    }
    let small = work.join("linux-quick.tar");
    if !small.exists() {
        let x = work.join("linux-quick.x");
        let _ = std::fs::remove_dir_all(&x);
        std::fs::create_dir_all(&x)?;
        let members: Vec<String> = QUICK_DIRS
            .iter()
            .map(|d| format!("{LINUX_TOP}/{d}"))
            .collect();
        sh(Command::new("tar")
            .arg("xf")
            .arg(&full)
            .arg("-C")
            .arg(&x)
            .args(&members))?;
        let tmp = work.join("linux-quick.tar.tmp");
        sh(Command::new("tar")
            .arg("cf")
            .arg(&tmp)
            .arg("-C")
            .arg(&x)
            .arg(LINUX_TOP))?;
        std::fs::rename(&tmp, &small)?;
        std::fs::remove_dir_all(&x)?;
    }
    Ok(small)
}

/// `libquilt_preload.so` (beside the quiltfs binary, or where scripts/setup.sh installs
/// it): what lets `cp --reflink=always` clone on a betrfs mount.
pub fn preload_lib() -> Result<std::path::PathBuf> {
    let exe = quiltfs_exe()?;
    let beside = exe.with_file_name("libquilt_preload.so");
    for p in [beside, "/usr/local/lib/libquilt_preload.so".into()] {
        if p.exists() {
            return Ok(p);
        }
    }
    bail!("libquilt_preload.so is neither beside {} nor in /usr/local/lib (cargo build --release -p quilt-preload)", exe.display())
}

#[cfg(test)]
mod csv_tests {
    /// Read back by a CSV reader, every row has every column, and a cell of JSON with
    /// commas and quotes comes back whole (Python's csv module and pandas shifted every
    /// column after `requests` when it was written unquoted).
    #[test]
    fn cells_with_commas_and_quotes_read_back_whole() {
        #[derive(serde::Serialize)]
        struct Row {
            system: String,
            seconds: f64,
            requests: std::collections::BTreeMap<String, u64>,
            note: Option<String>,
        }
        let rows = vec![
            Row {
                system: "quilt-su".into(),
                seconds: 1.5,
                requests: [("LOOKUP".to_string(), 3), ("GETATTR".to_string(), 7)].into(),
                note: Some("a \"quoted\", note".into()),
            },
            Row {
                system: "ext2".into(),
                seconds: 0.75,
                requests: Default::default(),
                note: None,
            },
        ];
        let text = super::csv(&rows).unwrap();
        let mut r = csv::Reader::from_reader(text.as_bytes());
        let head: Vec<String> = r.headers().unwrap().iter().map(String::from).collect();
        let col = |name: &str| head.iter().position(|h| h == name).unwrap();
        assert_eq!(head.len(), 4);
        let got: Vec<csv::StringRecord> = r.records().map(Result::unwrap).collect();
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|row| row.len() == 4));
        let req: serde_json::Value = serde_json::from_str(&got[0][col("requests")]).unwrap();
        assert_eq!(req["GETATTR"], 7);
        assert_eq!(&got[0][col("note")], "a \"quoted\", note");
        assert_eq!(&got[1][col("system")], "ext2");
        assert_eq!(&got[1][col("seconds")], "0.75");
        assert_eq!(&got[1][col("note")], "");
    }
}
