//! The Cudele bench's workloads through mounts: the same create loop (one process,
//! `open(O_CREAT)` and `close` of N new files in one directory) on a FUSE mount of the
//! metadata service in RPC mode (strong; with and without Stream) and decoupled (weak),
//! beside the peers a user would pick instead: CephFS through ceph-fuse (the system
//! Cudele was built on), sshfs over loopback, and local ext4. And use case 3: the
//! overhead of namespace sync at intervals on a decoupled mount.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// A FUSE (or loop) mount this bench made: unmounted when dropped.
pub struct Mounted {
    pub dir: PathBuf,
}

impl Mounted {
    /// `quiltfs mount ADDRESS DIR` (the server goes to the background).
    pub fn quiltfs(address: &str, dir: &Path) -> Result<Mounted> {
        std::fs::create_dir_all(dir)?;
        crate::sh(
            Command::new(crate::quiltfs_exe()?)
                .arg("mount")
                .arg(address)
                .arg(dir),
        )
        .with_context(|| format!("mounting {address}"))?;
        Ok(Mounted {
            dir: dir.to_path_buf(),
        })
    }

    /// Takes over a mount made some other way.
    pub fn adopt(dir: &Path) -> Mounted {
        Mounted {
            dir: dir.to_path_buf(),
        }
    }

    /// Unmounts and waits until it is gone (for a decoupled quiltfs mount: its last
    /// merge and release).
    pub fn unmount(self) -> Result<()> {
        let dir = self.dir.clone();
        std::mem::forget(self);
        crate::sh(Command::new("umount").arg(&dir)).map(drop)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // Already gone (fusermount, an earlier unmount): nothing to say.
        if !is_mount(&self.dir) {
            return;
        }
        if Command::new("umount")
            .arg(&self.dir)
            .status()
            .map_or(true, |s| !s.success())
        {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Whether `dir` is a mount point now.
pub fn is_mount(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let want = dir.display().to_string();
    text.lines()
        .any(|l| l.split_whitespace().nth(1) == Some(want.as_str()))
}

/// N creates of empty files in `dir` (a new directory inside it): seconds.
pub fn create_loop(dir: &Path, n: u64) -> Result<f64> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let t = Instant::now();
    for i in 0..n {
        let p = dir.join(format!("file.{i:07}"));
        std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Local ext4 on a loop device of a file in `work`: the kernel's own create path.
pub fn ext4(work: &Path) -> Result<Option<Mounted>> {
    if unsafe { libc::geteuid() } != 0 || !crate::have("mkfs.ext4") {
        return Ok(None);
    }
    let img = work.join("ext4.img");
    let mnt = work.join("ext4");
    std::fs::create_dir_all(&mnt)?;
    let f = std::fs::File::create(&img)?;
    f.set_len(4 << 30)?;
    drop(f);
    crate::sh(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&img))?;
    crate::sh(
        Command::new("mount")
            .arg("-o")
            .arg("loop")
            .arg(&img)
            .arg(&mnt),
    )?;
    // The image goes once unmounted: unlinked now, its loop device keeps it.
    let _ = std::fs::remove_file(&img);
    Ok(Some(Mounted::adopt(&mnt)))
}

/// The packages sshfs over loopback needs.
pub const SSHFS_PACKAGES: &[&str] = &["openssh-server", "openssh-client", "sshfs"];

/// An sshd of our own on a loopback port (its keys, config and pid in `dir`), and an
/// sshfs mount of `dir/export` through it; both stopped when dropped.
pub struct Sshfs {
    pub mount: Option<Mounted>,
    sshd: std::process::Child,
    dir: PathBuf,
}

impl Sshfs {
    pub fn up(dir: &Path, port: u16) -> Result<Sshfs> {
        let sshd = crate::have("sshd") || Path::new("/usr/sbin/sshd").exists();
        if !sshd || !crate::have("sshfs") || !crate::have("ssh-keygen") {
            bail!(
                "sshfs over loopback needs sshd, sshfs and ssh-keygen (apt-get install {})",
                SSHFS_PACKAGES.join(" ")
            );
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("export"))?;
        let dir = dir.canonicalize()?;
        let key = |name: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            crate::sh(
                Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                    .arg(&p),
            )?;
            Ok(p)
        };
        let host = key("host_key")?;
        let client = key("client_key")?;
        std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))?;
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "ListenAddress 127.0.0.1:{port}\nHostKey {}\nAuthorizedKeysFile {}\n\
                 PidFile {}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
                 Subsystem sftp internal-sftp\n",
                host.display(),
                dir.join("authorized_keys").display(),
                dir.join("sshd.pid").display()
            ),
        )?;
        std::fs::create_dir_all("/run/sshd")?;
        let sshd_exe = if Path::new("/usr/sbin/sshd").exists() {
            PathBuf::from("/usr/sbin/sshd")
        } else {
            PathBuf::from("sshd")
        };
        // -D: in the foreground, our child; -e: its log to stderr.
        let sshd = Command::new(sshd_exe)
            .arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(&config)
            .stderr(std::fs::File::create(dir.join("sshd.log"))?)
            .spawn()
            .context("starting sshd")?;
        let mut s = Sshfs {
            mount: None,
            sshd,
            dir: dir.clone(),
        };
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt)?;
        let t = Instant::now();
        loop {
            let r = crate::sh(
                Command::new("sshfs")
                    .arg(format!("root@127.0.0.1:{}", dir.join("export").display()))
                    .arg(&mnt)
                    .args(["-p", &port.to_string()])
                    .args(["-o", &format!("IdentityFile={}", client.display())])
                    .args([
                        "-o",
                        "StrictHostKeyChecking=no",
                        "-o",
                        "UserKnownHostsFile=/dev/null",
                        "-o",
                        "LogLevel=ERROR",
                    ]),
            );
            match r {
                Ok(_) => break,
                Err(e) if t.elapsed().as_secs() > 20 => {
                    let log = std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default();
                    return Err(e.context(format!("sshfs did not mount; sshd said: {log}")));
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(200)),
            }
        }
        s.mount = Some(Mounted::adopt(&mnt));
        Ok(s)
    }
}

impl Drop for Sshfs {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            let _ = Command::new("fusermount3").arg("-u").arg(&m.dir).status();
            drop(m);
        }
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.sshd.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.sshd.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
