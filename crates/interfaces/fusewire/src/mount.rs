//! Mounting a FUSE file system: as `fuseblk.SUBTYPE` over a block device when we can
//! (root), `fuse.SUBTYPE` otherwise, or through fusermount3 for other users.
//!
//! Why fuseblk: on this kernel only block-device FUSE mounts get FUSE_SYNCFS (sync(1),
//! syncfs(2)) and a synchronous DESTROY at umount (so umount returns after the final
//! write-back). An image file is given a loop device for the purpose (autoclear: it goes
//! away with the mount); the server keeps reading and writing the file itself, and
//! nothing is ever read or written through the loop device.

use crate::channel::Channel;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The block device a fuseblk mount names.
pub enum BlockSource {
    /// A block device the image lives on.
    Device(PathBuf),
    /// An image file: a loop device is attached over it for the mount's lifetime.
    File(std::fs::File),
}

/// How to mount.
pub struct MountOptions {
    /// The source shown in the mount table for plain fuse mounts (the image's path).
    pub fs_name: String,
    /// The type's subtype: `fuse.SUBTYPE` / `fuseblk.SUBTYPE`.
    pub subtype: String,
    pub read_only: bool,
    pub allow_other: bool,
    pub default_permissions: bool,
    /// `nodev`, `nosuid`, `noexec` become mount flags; others go to the kernel as they are.
    pub extra: Vec<String>,
    /// Mount as fuseblk over this, if permitted.
    pub block: Option<BlockSource>,
    /// fuseblk's block size (the file system's).
    pub block_size: u32,
}

/// Which kind of mount was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountKind {
    /// Block-device FUSE: sync(1) and syncfs(2) reach the server, umount waits for it.
    Fuseblk,
    /// Plain FUSE by mount(2) (root).
    Fuse,
    /// Plain FUSE through fusermount3 (other users).
    Fusermount,
}

pub struct Mounted {
    pub channel: Channel,
    pub kind: MountKind,
    /// The mount's source (the loop device for an image file under fuseblk).
    pub source: String,
    /// The loop device attached over an image file, held open until the server has
    /// finished with the image (`LoopDevice::detach`).
    pub loop_dev: Option<LoopDevice>,
}

/// A loop device this server attached (with autoclear, so that a server killed
/// outright still leaves none behind once its mount goes) and holds open: a clean end
/// detaches it and waits until it is gone, so that nothing holds the image when the
/// server exits (the host file system under it can then be unmounted at once).
pub struct LoopDevice {
    pub path: PathBuf,
    fd: OwnedFd,
}

/// How long a detached loop device may take to let go of its file (a udev rule or
/// blkid that opened it meanwhile delays it until they close it).
const LOOP_DETACH_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl LoopDevice {
    /// Detaches the device (`LOOP_CLR_FD`: at once if nobody else has it open, else at
    /// its last close) and waits until it has let go of its backing file.
    pub fn detach(self) -> io::Result<()> {
        const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
        // SAFETY: LOOP_CLR_FD takes no argument.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), LOOP_CLR_FD, 0) };
        let e = io::Error::last_os_error();
        drop(self.fd);
        // ENXIO: already detached.
        if r != 0 && e.raw_os_error() != Some(libc::ENXIO) {
            return Err(io::Error::new(
                e.kind(),
                format!("detaching {}: {e}", self.path.display()),
            ));
        }
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let backing = format!("/sys/block/{}/loop/backing_file", name.unwrap_or_default());
        let start = std::time::Instant::now();
        while Path::new(&backing).exists() {
            if start.elapsed() > LOOP_DETACH_WAIT {
                return Err(io::Error::other(format!(
                    "{} still holds its file {}s after it was detached (something has it open)",
                    self.path.display(),
                    LOOP_DETACH_WAIT.as_secs()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(())
    }
}

/// Mounts at `mountpoint` and returns the connection to serve.
pub fn mount(mountpoint: &Path, o: MountOptions) -> io::Result<Mounted> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return fusermount(mountpoint, &o);
    }
    let mut o = o;
    if let Some(block) = o.block.take() {
        let dev = match block {
            BlockSource::Device(p) => Some((p, None)),
            BlockSource::File(f) => match attach_loop(&f, o.read_only) {
                Ok((p, fd)) => Some((p, Some(fd))),
                Err(e) => {
                    tracing::warn!(
                        "no loop device for a block mount ({e}): mounting plain FUSE, which sync(1) does not reach"
                    );
                    None
                }
            },
        };
        if let Some((dev, hold)) = dev {
            let source = dev.display().to_string();
            let loop_dev = hold.map(|fd| LoopDevice {
                path: dev.clone(),
                fd,
            });
            let chan = Channel::open()?;
            let data = kernel_data(&o, chan.raw(), Some(o.block_size));
            if let Err(e) = mount2(
                &source,
                mountpoint,
                &format!("fuseblk.{}", o.subtype),
                &o,
                &data,
            ) {
                if let Some(l) = loop_dev {
                    let _ = l.detach();
                }
                return Err(e);
            }
            return Ok(Mounted {
                channel: chan,
                kind: MountKind::Fuseblk,
                source,
                loop_dev,
            });
        }
    }
    let chan = Channel::open()?;
    let data = kernel_data(&o, chan.raw(), None);
    mount2(
        &o.fs_name,
        mountpoint,
        &format!("fuse.{}", o.subtype),
        &o,
        &data,
    )?;
    Ok(Mounted {
        channel: chan,
        kind: MountKind::Fuse,
        source: o.fs_name.clone(),
        loop_dev: None,
    })
}

fn flags_of(o: &MountOptions) -> (libc::c_ulong, Vec<&str>) {
    let mut flags: libc::c_ulong = 0;
    if o.read_only {
        flags |= libc::MS_RDONLY;
    }
    let mut rest = Vec::new();
    for e in &o.extra {
        match e.as_str() {
            "nodev" => flags |= libc::MS_NODEV,
            "nosuid" => flags |= libc::MS_NOSUID,
            "noexec" => flags |= libc::MS_NOEXEC,
            other => rest.push(other),
        }
    }
    (flags, rest)
}

fn kernel_data(o: &MountOptions, fd: i32, blksize: Option<u32>) -> String {
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let mut data = format!("fd={fd},rootmode=40000,user_id={uid},group_id={gid}");
    if o.default_permissions {
        data.push_str(",default_permissions");
    }
    if o.allow_other {
        data.push_str(",allow_other");
    }
    if let Some(b) = blksize {
        data.push_str(&format!(",blksize={b}"));
    }
    for r in flags_of(o).1 {
        data.push(',');
        data.push_str(r);
    }
    data
}

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn mount2(
    source: &str,
    target: &Path,
    fstype: &str,
    o: &MountOptions,
    data: &str,
) -> io::Result<()> {
    let (flags, _) = flags_of(o);
    let source = cstring(source.as_bytes())?;
    let target = cstring(target.as_os_str().as_bytes())?;
    let fstype = cstring(fstype.as_bytes())?;
    let data = cstring(data.as_bytes())?;
    // SAFETY: mount(2) on NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches a loop device over `file` that detaches itself when its last user (the
/// mount) lets go. Returns its path and our descriptor of it.
fn attach_loop(file: &std::fs::File, read_only: bool) -> io::Result<(PathBuf, OwnedFd)> {
    const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
    const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
    const LO_FLAGS_READ_ONLY: u32 = 1;
    const LO_FLAGS_AUTOCLEAR: u32 = 4;
    let open = |p: &CString, flags| {
        // SAFETY: open on a NUL-terminated path; checked.
        let fd = unsafe { libc::open(p.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            // SAFETY: a fresh descriptor we own.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    };
    let ctl = open(&cstring(b"/dev/loop-control")?, libc::O_RDWR)?;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let mode = if read_only {
            libc::O_RDONLY
        } else {
            libc::O_RDWR
        };
        let dev = open(&cstring(path.as_os_str().as_bytes())?, mode)?;
        // struct loop_config: fd, block_size, loop_info64 (232 bytes, lo_flags at 52),
        // 8 reserved u64s.
        let mut cfg = [0u8; 304];
        cfg[0..4].copy_from_slice(&(file.as_raw_fd() as u32).to_le_bytes());
        let mut flags = LO_FLAGS_AUTOCLEAR;
        if read_only {
            flags |= LO_FLAGS_READ_ONLY;
        }
        cfg[8 + 52..8 + 56].copy_from_slice(&flags.to_le_bytes());
        // SAFETY: LOOP_CONFIGURE reads one struct loop_config from the pointer.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, cfg.as_ptr()) };
        if r == 0 {
            return Ok((path, dev));
        }
        let e = io::Error::last_os_error();
        // Another program took the free device first: try the next.
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
    }
    Err(io::Error::other("no free loop device"))
}

/// Mounts through the setuid fusermount3, which passes the connection back over a
/// socket (for users other than root).
fn fusermount(mountpoint: &Path, o: &MountOptions) -> io::Result<Mounted> {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair fills two descriptors on success.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors we own.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut opts = vec![
        if o.read_only { "ro" } else { "rw" }.to_string(),
        format!("fsname={}", o.fs_name.replace(',', "\\,")),
        format!("subtype={}", o.subtype),
    ];
    if o.default_permissions {
        opts.push("default_permissions".into());
    }
    if o.allow_other {
        opts.push("allow_other".into());
    }
    opts.extend(o.extra.iter().cloned());
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-o")
        .arg(opts.join(","))
        .arg("--")
        .arg(mountpoint)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string());
    let keep = theirs.as_raw_fd();
    // SAFETY: clearing close-on-exec on one descriptor in the child before exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            let fl = libc::fcntl(keep, libc::F_GETFD);
            libc::fcntl(keep, libc::F_SETFD, fl & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let status = cmd.status()?;
    drop(theirs);
    if !status.success() {
        return Err(io::Error::other(format!("fusermount3 failed ({status})")));
    }
    let fd = receive_fd(&ours)?;
    Ok(Mounted {
        channel: Channel::from_fd(fd),
        kind: MountKind::Fusermount,
        source: o.fs_name.clone(),
        loop_dev: None,
    })
}

fn receive_fd(sock: &OwnedFd) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one descriptor's control message.
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; we fill the fields recvmsg reads.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points at buffers that live across the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: walking the control messages recvmsg filled in.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if !c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
        {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32);
            return Ok(OwnedFd::from_raw_fd(fd));
        }
    }
    Err(io::Error::other("fusermount3 passed no descriptor"))
}

/// Unmounts (root: umount2; others: fusermount3 -u).
pub fn unmount(mountpoint: &Path, lazy: bool) -> io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let mut c = std::process::Command::new("fusermount3");
        c.arg("-u");
        if lazy {
            c.arg("-z");
        }
        let st = c.arg("--").arg(mountpoint).status()?;
        return if st.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("fusermount3 -u failed ({st})")))
        };
    }
    let target = cstring(mountpoint.as_os_str().as_bytes())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: umount2 on a NUL-terminated path.
    if unsafe { libc::umount2(target.as_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
