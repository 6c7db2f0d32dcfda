//! The systems under comparison, and the guards that set each one up on its own loop
//! device and tear it down again, also after an error or Ctrl-C.

use crate::bench::{cpu_of, is_mounted, jbd2_thread, reap, sh, Reaped};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A kernel file system: mkfs program, type, mount options.
    Kernel {
        mkfs: &'static str,
        fstype: &'static str,
        options: &'static str,
    },
    /// fuse2fs (e2fsprogs' FUSE ext2/3/4) on an ext2 image.
    Fuse2fs,
    /// A FUSE passthrough (Debian's bindfs) over a kernel ext4 on the same kind of
    /// image: what any FUSE file system pays for the transport alone, the floor.
    Passthrough,
    /// quiltfs in a consistency mode; `options` are extra mount options.
    Quilt {
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
    /// For the optimization table: which patch optimizations are on. None for systems
    /// outside it; "both" is the ordinary soft-updates system.
    pub opt: Option<&'static str>,
}

impl System {
    pub fn is_quilt(&self) -> bool {
        matches!(self.kind, Kind::Quilt { .. })
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

    /// Whether the optimization table alone uses this system (not the main tables).
    pub fn opt_only(&self) -> bool {
        self.opt.is_some_and(|o| o != "both")
    }
}

const fn quilt(
    name: &'static str,
    what: &'static str,
    mode: &'static str,
    unsafe_: bool,
) -> System {
    System {
        name,
        what,
        kind: Kind::Quilt {
            mode,
            unsafe_,
            options: "",
        },
        safe: !unsafe_,
        opt: None,
    }
}

const fn opt(name: &'static str, options: &'static str, opt: &'static str) -> System {
    System {
        name,
        what: "quiltfs soft updates, for the optimization table",
        kind: Kind::Quilt {
            mode: "soft-updates",
            unsafe_: false,
            options,
        },
        safe: true,
        opt: Some(opt),
    }
}

pub const SYSTEMS: &[System] = &[
    System {
        opt: Some("both"),
        ..quilt("quilt-su", "quiltfs soft updates", "soft-updates", false)
    },
    quilt(
        "quilt-meta",
        "quiltfs metadata journal",
        "meta-journal",
        false,
    ),
    quilt("quilt-full", "quiltfs full journal", "full-journal", false),
    quilt("quilt-async", "quiltfs asynchronous", "async", false),
    // The kernel's writeback cache instead of write-through writes: what exact write(2)
    // errors cost (with it, a full disk shows at fsync or close while space is ample).
    System {
        name: "quilt-su-wbcache",
        what: "quiltfs soft updates, kernel writeback cache",
        kind: Kind::Quilt {
            mode: "soft-updates",
            unsafe_: false,
            options: "wbcache",
        },
        safe: true,
        opt: None,
    },
    // The same over /dev/fuse instead of io_uring: what the ring transport buys.
    System {
        name: "quilt-su-dev",
        what: "quiltfs soft updates over /dev/fuse (no io_uring)",
        kind: Kind::Quilt {
            mode: "soft-updates",
            unsafe_: false,
            options: "nouring",
        },
        safe: true,
        opt: None,
    },
    // The ring handing the CPU to the caller at each answer (fusewire's handoff.rs,
    // off by default): what keeping caller and worker on one CPU buys.
    System {
        name: "quilt-su-handoff",
        what: "quiltfs soft updates over io_uring, CPU handoff",
        kind: Kind::Quilt {
            mode: "soft-updates",
            unsafe_: false,
            options: "handoff",
        },
        safe: true,
        opt: None,
    },
    quilt(
        "quilt-su-unsafe",
        "quiltfs soft updates, no flushes",
        "soft-updates",
        true,
    ),
    quilt(
        "quilt-meta-unsafe",
        "quiltfs metadata journal, no flushes",
        "meta-journal",
        true,
    ),
    quilt(
        "quilt-full-unsafe",
        "quiltfs full journal, no flushes",
        "full-journal",
        true,
    ),
    quilt(
        "quilt-async-unsafe",
        "quiltfs asynchronous, no flushes",
        "async",
        true,
    ),
    System {
        name: "ext2",
        what: "Linux ext2",
        kind: Kind::Kernel {
            mkfs: "mkfs.ext2",
            fstype: "ext2",
            options: "",
        },
        safe: false,
        opt: None,
    },
    System {
        name: "ext3-writeback",
        what: "Linux ext3 data=writeback",
        kind: Kind::Kernel {
            mkfs: "mkfs.ext3",
            fstype: "ext3",
            options: "data=writeback",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "ext3-journal",
        what: "Linux ext3 data=journal",
        kind: Kind::Kernel {
            mkfs: "mkfs.ext3",
            fstype: "ext3",
            options: "data=journal",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "ext4",
        what: "Linux ext4 (data=ordered)",
        kind: Kind::Kernel {
            mkfs: "mkfs.ext4",
            fstype: "ext4",
            options: "",
        },
        safe: true,
        opt: None,
    },
    System {
        name: "fuse2fs",
        what: "fuse2fs (e2fsprogs, FUSE) on ext2",
        kind: Kind::Fuse2fs,
        safe: false,
        opt: None,
    },
    System {
        name: "bindfs",
        what: "bindfs (FUSE passthrough) over ext4: the FUSE floor",
        kind: Kind::Passthrough,
        safe: true,
        opt: None,
    },
    opt("quilt-su-opt-none", "nohard,nomerge", "none"),
    opt("quilt-su-opt-hard", "nomerge", "hard"),
    opt("quilt-su-opt-merge", "nohard", "merge"),
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
            Kind::Kernel { mkfs, .. } => {
                let lazy = if mkfs == "mkfs.ext2" {
                    "lazy_itable_init=0"
                } else {
                    "lazy_itable_init=0,lazy_journal_init=0"
                };
                sh(Command::new(mkfs)
                    .args(["-F", "-q", "-b", "4096", "-E", lazy])
                    .arg(&image))
                .map_err(remove)?;
            }
            Kind::Fuse2fs => {
                sh(Command::new("mkfs.ext2")
                    .args(["-F", "-q", "-b", "4096", "-E", "lazy_itable_init=0"])
                    .arg(&image))
                .map_err(remove)?;
            }
            Kind::Passthrough => {
                sh(Command::new("mkfs.ext4")
                    .args([
                        "-F",
                        "-q",
                        "-b",
                        "4096",
                        "-E",
                        "lazy_itable_init=0,lazy_journal_init=0",
                    ])
                    .arg(&image))
                .map_err(remove)?;
            }
            Kind::Quilt { mode, .. } => {
                crate::bench::quilt_mkfs(&image, size_mib, mode.contains("journal"))
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
            Kind::Fuse2fs => {
                let mut c = Command::new("fuse2fs");
                c.arg(&disk.dev).arg(mnt).arg("-f");
                c
            }
            Kind::Passthrough => {
                let lower = mnt.with_extension("lower");
                std::fs::create_dir_all(&lower)?;
                sh(Command::new("mount")
                    .args(["-t", "ext4"])
                    .arg(&disk.dev)
                    .arg(&lower))?;
                m.lower = Some(lower.clone());
                let mut c = Command::new("bindfs");
                c.arg("-f").arg(&lower).arg(mnt);
                c
            }
            Kind::Quilt {
                mode,
                unsafe_,
                options,
            } => {
                let mut c = Command::new(crate::bench::quiltfs_exe()?);
                c.arg("mount")
                    .arg(&disk.dev)
                    .arg(mnt)
                    .args(["--foreground", "--mode", mode]);
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

    /// Makes everything written durable: syncfs for the kernel (and for fuse2fs, which
    /// then writes back at unmount), quiltfs's own sync request (FUSE_SYNCFS does not
    /// reach FUSE servers here).
    pub fn sync(&self) -> Result<()> {
        if self.sys.is_quilt() {
            crate::mount::sync_mount(&self.mnt)
        } else if let Some(lower) = &self.lower {
            // A passthrough passes every change on at once: durable once its kernel
            // file system is synced.
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
