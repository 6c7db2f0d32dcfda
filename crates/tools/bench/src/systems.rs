//! The systems a suite compares, and the guards that set each one up on its own loop
//! device and tear it down again, also after an error or Ctrl-C: kernel file systems
//! (any mkfs, type and options), fuse2fs, FUSE passthroughs over ext4 (libfuse's
//! `passthrough_hp`: the floor any FUSE file system pays; bindfs, the old floor), and
//! quiltfs's modules.

use crate::{cpu_of, is_mounted, jbd2_thread, reap, sh, Reaped};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The block cache every quiltfs server of the suites runs with, MiB (`quiltfs mount`'s
/// default, given explicitly so that the reports' memory goals hold the same figure).
pub const CACHE_MIB: u64 = 128;

/// `mkfs` command lines (the image's path follows).
pub const MKFS_EXT2: &[&str] = &[
    "mkfs.ext2",
    "-F",
    "-q",
    "-b",
    "4096",
    "-E",
    "lazy_itable_init=0",
];
pub const MKFS_EXT3: &[&str] = &[
    "mkfs.ext3",
    "-F",
    "-q",
    "-b",
    "4096",
    "-E",
    "lazy_itable_init=0,lazy_journal_init=0",
];
pub const MKFS_EXT4: &[&str] = &[
    "mkfs.ext4",
    "-F",
    "-q",
    "-b",
    "4096",
    "-E",
    "lazy_itable_init=0,lazy_journal_init=0",
];
pub const MKFS_XFS: &[&str] = &["mkfs.xfs", "-f", "-q", "-m", "reflink=1"];
pub const MKFS_BTRFS: &[&str] = &["mkfs.btrfs", "-f", "-q"];

/// Which FUSE passthrough serves a `Kind::Passthrough` system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// Debian's bindfs: a high-level (path-based) passthrough, single requests.
    Bindfs,
    /// libfuse's `passthrough_hp` with the kernel's writeback cache and splice, every
    /// read and write through the server (`--nopassthrough`): the floor for a file
    /// system that must see its data, as quiltfs must.
    Hp,
    /// `passthrough_hp` with FUSE passthrough: the kernel reads and writes the backing
    /// files itself, the server sees only metadata. Shown for reference: a file system
    /// whose files are not files below it cannot do this.
    HpKernel,
}

/// The system every "vs FUSE floor" ratio is taken against.
pub const FLOOR: &str = "passthrough";

/// The FUSE passthroughs both suites compare with, over ext4 (see [`Floor`]).
pub const PASSTHROUGH: System = passthrough(
    FLOOR,
    "libfuse passthrough_hp over ext4, writeback cache, no kernel passthrough: the FUSE floor",
    Floor::Hp,
);
pub const PASSTHROUGH_KERNEL: System = passthrough(
    "passthrough-kernel",
    "libfuse passthrough_hp over ext4 with FUSE passthrough (the kernel does reads and writes)",
    Floor::HpKernel,
);
pub const BINDFS: System = passthrough(
    "bindfs",
    "bindfs (high-level FUSE passthrough) over ext4",
    Floor::Bindfs,
);

const fn passthrough(name: &'static str, what: &'static str, server: Floor) -> System {
    System {
        name,
        what,
        kind: Kind::Passthrough {
            mkfs: MKFS_EXT4,
            server,
        },
        safe: true,
        opt: None,
    }
}

/// Which of quiltfs's file-system modules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuiltFs {
    Ext2,
    Betrfs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A kernel file system: mkfs command line, type, mount options.
    Kernel {
        mkfs: &'static [&'static str],
        fstype: &'static str,
        options: &'static str,
    },
    /// fuse2fs (e2fsprogs' FUSE ext2/3/4) on an image `mkfs` makes.
    Fuse2fs { mkfs: &'static [&'static str] },
    /// A FUSE passthrough over a kernel ext4 on the same kind of image: what any FUSE
    /// file system pays for the transport alone, the floor.
    Passthrough {
        mkfs: &'static [&'static str],
        server: Floor,
    },
    /// quiltfs: a module, a consistency mode (ext2), extra mount options.
    Quilt {
        fs: QuiltFs,
        mode: &'static str,
        unsafe_: bool,
        options: &'static str,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct System {
    pub name: &'static str,
    pub what: &'static str,
    pub kind: Kind,
    /// Flushes the device's write cache where durability needs it (the paper's "safe").
    pub safe: bool,
    /// For the Featherstitch optimization table: which patch optimizations are on. None
    /// for systems outside it; "both" is the ordinary soft-updates system.
    pub opt: Option<&'static str>,
}

impl System {
    pub fn is_quilt(&self) -> bool {
        matches!(self.kind, Kind::Quilt { .. })
    }

    pub fn is_betrfs(&self) -> bool {
        matches!(
            self.kind,
            Kind::Quilt {
                fs: QuiltFs::Betrfs,
                ..
            }
        )
    }

    /// The kernel ext3 mode with the same guarantee, for the "vs ext3" ratio: data=journal
    /// for full journaling, data=writeback (ext3's weakest) for everything else.
    pub fn ext3_peer(&self) -> &'static str {
        match self.kind {
            Kind::Quilt {
                mode: "full-journal",
                ..
            } => "ext3-journal",
            Kind::Kernel {
                options: "data=journal",
                ..
            } => "ext3-journal",
            _ => "ext3-writeback",
        }
    }

    /// Whether a failure of this system is reported and the suite goes on without it:
    /// libfuse's passthrough_hp, a peer outside this project whose limits are the
    /// host's (it keeps a descriptor per inode, and where the host caps open files
    /// below a workload's file count it fails with EMFILE).
    pub fn may_fail(&self) -> bool {
        matches!(
            self.kind,
            Kind::Passthrough {
                server: Floor::Hp | Floor::HpKernel,
                ..
            }
        )
    }

    /// Whether the optimization table alone uses this system (not the main tables).
    pub fn opt_only(&self) -> bool {
        self.opt.is_some_and(|o| o != "both")
    }

    /// The checker a clean image of this system must pass after a run: its command
    /// line (the image follows).
    pub fn fsck(&self) -> Vec<String> {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect();
        match self.kind {
            Kind::Kernel { fstype: "xfs", .. } => v(&["xfs_repair", "-n"]),
            Kind::Kernel {
                fstype: "btrfs", ..
            } => v(&["btrfs", "check", "--readonly"]),
            Kind::Quilt {
                fs: QuiltFs::Betrfs,
                ..
            } => vec![
                crate::quiltfs_exe()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| "quiltfs".into()),
                "fsck".into(),
                "-n".into(),
            ],
            _ => v(&["e2fsck", "-fn"]),
        }
    }
}

/// Builds what the chosen passthrough systems run (once per machine; see `floor`), so
/// that no timed phase waits for a build.
pub fn prepare_floor(systems: &[System]) -> Result<()> {
    let hp = systems.iter().any(|s| {
        matches!(
            s.kind,
            Kind::Passthrough {
                server: Floor::Hp | Floor::HpKernel,
                ..
            }
        )
    });
    if hp {
        crate::floor::passthrough_hp()?;
        // passthrough_hp keeps a descriptor open for every inode the kernel knows
        // (TokuBench makes 200,000) and raises its soft limit to the hard one, which it
        // inherits from us: raise that as far as the kernel allows.
        raise_open_files();
    }
    Ok(())
}

/// Raises this process's limit of open files (soft and hard) to the kernel's maximum,
/// as root may; children inherit it. Left as it is where that is refused.
fn raise_open_files() {
    let max: u64 = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1 << 20);
    let lim = libc::rlimit {
        rlim_cur: max as libc::rlim_t,
        rlim_max: max as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        eprintln!(
            "bench: could not raise the open-file limit to {max} ({}): passthrough_hp may run out on large workloads",
            std::io::Error::last_os_error()
        );
    }
}

/// An image file with a fresh file system of the system's kind, attached to a loop
/// device. Dropping it detaches the device and removes the image, unless `keep` is set.
pub struct Disk {
    pub image: PathBuf,
    pub dev: String,
    pub keep: bool,
}

impl Disk {
    pub fn create(sys: &System, work: &Path, size_mib: u64) -> Result<Disk> {
        let image = work.join(format!("{}.img", sys.name));
        let _ = std::fs::remove_file(&image);
        let f = std::fs::File::create(&image)
            .with_context(|| format!("creating {}", image.display()))?;
        f.set_len(size_mib << 20)?;
        drop(f);
        let remove = |e: anyhow::Error| {
            let _ = std::fs::remove_file(&image);
            e
        };
        match sys.kind {
            Kind::Kernel { mkfs, .. } | Kind::Fuse2fs { mkfs } | Kind::Passthrough { mkfs, .. } => {
                sh(Command::new(mkfs[0]).args(&mkfs[1..]).arg(&image)).map_err(remove)?;
            }
            Kind::Quilt { fs, mode, .. } => {
                crate::quilt_mkfs(&image, size_mib, fs, mode.contains("journal"))
                    .map_err(remove)?;
            }
        }
        let dev = sh(Command::new("losetup").args(["-f", "--show"]).arg(&image))
            .map_err(remove)?
            .trim()
            .to_string();
        Ok(Disk {
            image,
            dev,
            keep: false,
        })
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
        if !self.keep {
            let _ = std::fs::remove_file(&self.image);
        }
    }
}

/// A mounted file system. Dropping it unmounts (lazily if it must) and waits for the
/// server it started.
pub struct Mounted {
    pub sys: System,
    pub mnt: PathBuf,
    /// The kernel file system a passthrough serves (mounted beside `mnt`).
    lower: Option<PathBuf>,
    dev: String,
    server: Option<Child>,
    mounted: bool,
    log: PathBuf,
}

/// What the unmount measured.
pub struct Unmounted {
    /// The server's CPU over its whole life (None for kernel file systems).
    pub server: Option<Reaped>,
}

impl Mounted {
    pub fn mount(sys: &System, disk: &Disk, mnt: &Path, log: &Path) -> Result<Mounted> {
        std::fs::create_dir_all(mnt)?;
        if is_mounted(mnt) {
            bail!(
                "{} is already a mount point: unmount it first",
                mnt.display()
            );
        }
        let mut m = Mounted {
            sys: *sys,
            mnt: mnt.to_path_buf(),
            lower: None,
            dev: disk.dev.clone(),
            server: None,
            mounted: false,
            log: log.to_path_buf(),
        };
        let mut server = match sys.kind {
            Kind::Kernel {
                fstype, options, ..
            } => {
                let mut c = Command::new("mount");
                c.args(["-t", fstype]);
                if !options.is_empty() {
                    c.args(["-o", options]);
                }
                sh(c.arg(&disk.dev).arg(mnt))?;
                m.mounted = true;
                return Ok(m);
            }
            Kind::Fuse2fs { .. } => {
                let mut c = Command::new("fuse2fs");
                c.arg(&disk.dev).arg(mnt).arg("-f");
                c
            }
            Kind::Passthrough { server, .. } => {
                let lower = mnt.with_extension("lower");
                std::fs::create_dir_all(&lower)?;
                sh(Command::new("mount")
                    .args(["-t", "ext4"])
                    .arg(&disk.dev)
                    .arg(&lower))?;
                m.lower = Some(lower.clone());
                let mut c = match server {
                    Floor::Bindfs => {
                        let mut c = Command::new("bindfs");
                        c.arg("-f");
                        c
                    }
                    Floor::Hp | Floor::HpKernel => {
                        let mut c = Command::new(crate::floor::passthrough_hp()?);
                        c.arg("--foreground");
                        if server == Floor::Hp {
                            c.arg("--nopassthrough");
                        }
                        c
                    }
                };
                c.arg(&lower).arg(mnt);
                c
            }
            Kind::Quilt {
                mode,
                unsafe_,
                options,
                ..
            } => {
                let mut c = Command::new(crate::quiltfs_exe()?);
                c.arg("mount")
                    .arg(&disk.dev)
                    .arg(mnt)
                    .args(["--foreground", "--mode", mode])
                    .args(["--cache-mib", &CACHE_MIB.to_string()]);
                if unsafe_ {
                    c.arg("--unsafe");
                }
                if !options.is_empty() {
                    c.args(["-o", options]);
                }
                c
            }
        };
        let logf = std::fs::File::create(log)?;
        // Its own process group: Ctrl-C stops the workload, and the server stays up
        // until we unmount it and it has written everything back.
        std::os::unix::process::CommandExt::process_group(&mut server, 0);
        let child = server
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .with_context(|| format!("starting the {} server", sys.name))?;
        m.server = Some(child);
        let start = Instant::now();
        while !is_mounted(mnt) {
            if let Some(c) = m.server.as_mut() {
                if let Some(st) = c.try_wait()? {
                    m.server = None;
                    bail!(
                        "the {} server exited ({st}) before mounting: {}",
                        sys.name,
                        log_tail(log)
                    );
                }
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("{} did not mount within 60 s: {}", sys.name, log_tail(log));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        m.mounted = true;
        Ok(m)
    }

    /// CPU (user, system) of the file system's own process or thread so far: the FUSE
    /// server, or the kernel's jbd2 thread (the rest of a kernel file system's work is
    /// in the system time of the processes that call it).
    pub fn fs_cpu(&self) -> (f64, f64) {
        match &self.server {
            Some(c) => cpu_of(c.id()),
            None => jbd2_thread(&self.dev).map(cpu_of).unwrap_or((0.0, 0.0)),
        }
    }

    /// The quiltfs server's counters (None for other systems).
    pub fn counters(&self) -> Result<Option<serde_json::Value>> {
        if !self.sys.is_quilt() {
            return Ok(None);
        }
        quilt_mountctl::stats(&self.mnt)
            .map(Some)
            .with_context(|| format!("reading the counters of {}", self.sys.name))
    }

    /// Makes everything written durable: syncfs for the kernel (and for fuse2fs, which
    /// then writes back at unmount), quiltfs's own sync request (FUSE_SYNCFS does not
    /// reach FUSE servers here).
    pub fn sync(&self) -> Result<()> {
        if self.sys.is_quilt() {
            Ok(quilt_mountctl::sync(&self.mnt)?)
        } else if let Some(lower) = &self.lower {
            // A passthrough's writeback cache (passthrough_hp keeps one) is written back
            // to it by syncing the mount; what it passed on is durable once its kernel
            // file system is synced.
            sh(Command::new("sync").arg("-f").arg(&self.mnt))?;
            sh(Command::new("sync").arg("-f").arg(lower)).map(|_| ())
        } else {
            sh(Command::new("sync").arg("-f").arg(&self.mnt)).map(|_| ())
        }
    }

    /// Unmounts and, for FUSE servers, waits until the server has exited (its final
    /// write-back done).
    pub fn unmount(mut self) -> Result<Unmounted> {
        sh(Command::new("umount").arg(&self.mnt))
            .with_context(|| format!("unmounting {}", self.sys.name))?;
        self.mounted = false;
        let server = match self.server.take() {
            Some(c) => {
                let r = reap(&c)?;
                if !r.success() {
                    bail!(
                        "the {} server failed at unmount (status {}): {}",
                        self.sys.name,
                        r.status,
                        log_tail(&self.log)
                    );
                }
                Some(r)
            }
            None => None,
        };
        if let Some(lower) = self.lower.take() {
            sh(Command::new("umount").arg(&lower))
                .with_context(|| format!("unmounting the ext4 under {}", self.sys.name))?;
            let _ = std::fs::remove_dir(&lower);
        }
        Ok(Unmounted { server })
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.mounted
            && !Command::new("umount")
                .arg(&self.mnt)
                .status()
                .is_ok_and(|s| s.success())
        {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        if let Some(mut c) = self.server.take() {
            // The server exits once the kernel lets go of the mount; give it time to
            // write back, then stop it (it is our child).
            let start = Instant::now();
            let mut exited = false;
            while start.elapsed() < Duration::from_secs(120) {
                if let Ok(Some(_)) = c.try_wait() {
                    exited = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !exited {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(lower) = self.lower.take() {
            if !Command::new("umount")
                .arg(&lower)
                .status()
                .is_ok_and(|s| s.success())
            {
                let _ = Command::new("umount").arg("-l").arg(&lower).status();
            }
            let _ = std::fs::remove_dir(&lower);
        }
    }
}

/// The last lines of a server's log, for error messages.
pub fn log_tail(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    let tail = lines[lines.len().saturating_sub(8)..].join("\n");
    if tail.trim().is_empty() {
        format!("(nothing in {})", log.display())
    } else {
        tail
    }
}
