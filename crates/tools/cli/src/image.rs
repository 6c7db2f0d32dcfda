//! Opening images: the device, the patch engine and the ext2 module, with the settings
//! shared by `mount`, `stats` and the tests.

use anyhow::{bail, Context, Result};
use quilt_block::{BlockDevice, FileDevice, FileDeviceOptions, ImageLock};
use quilt_ext2::{format::Superblock, Ext2, Mode, MountOptions};
use quilt_patch::{Durability, EngineOptions};
use quilt_stack::{DeviceSpec, ImageSpec};
use std::path::Path;

/// Parses sizes like `512M`, `4G`, `1T`, `65536` (bytes).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => bail!("unknown size suffix '{c}' in '{s}' (use K, M, G or T)"),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("'{s}' is not a size"))?;
    n.checked_mul(mult)
        .with_context(|| format!("size '{s}' is too large"))
}

/// The target of `mkfs`, opened and locked (exclusive), not yet changed.
pub struct Target {
    pub file: std::fs::File,
    /// It existed before (else it was just created, empty).
    pub existed: bool,
    pub is_device: bool,
    /// Its size in bytes.
    pub len: u64,
}

/// Opens (creating if missing) a file or block device for `mkfs` and takes the image
/// lock, so a mounted image is refused before anything is read or written; a loop
/// device the kernel has mounted over the file is refused too.
pub fn open_target(path: &Path) -> Result<Target> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let meta = std::fs::metadata(path).ok();
    let is_device = meta
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device());
    if meta
        .as_ref()
        .is_some_and(|m| !m.is_file() && !m.file_type().is_block_device())
    {
        bail!(
            "{} exists and is neither a regular file nor a block device",
            path.display()
        );
    }
    let mut oo = std::fs::OpenOptions::new();
    oo.read(true).write(true);
    if is_device {
        // The kernel refuses O_EXCL while the device is mounted or claimed.
        oo.custom_flags(libc::O_EXCL);
    } else {
        oo.create(true).truncate(false);
    }
    let file = oo.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::EBUSY) {
            anyhow::anyhow!(
                "{} is in use (mounted, or held by another program): refusing to format it",
                path.display()
            )
        } else {
            anyhow::anyhow!("cannot open {}: {e}", path.display())
        }
    })?;
    if !is_device {
        quilt_block::lock_file(&file, path, true).map_err(|e| in_use(path, e))?;
        if let Some(l) = kernel_loop_mount(path) {
            bail!("{} is in use: {l}; unmount it first", path.display());
        }
    }
    let len = if is_device {
        use std::io::Seek;
        (&file).seek(std::io::SeekFrom::End(0))?
    } else {
        file.metadata()?.len()
    };
    Ok(Target {
        file,
        existed: meta.is_some(),
        is_device,
        len,
    })
}

/// Turns the block layer's "image in use" into a message naming the mount that holds it.
pub fn in_use(path: &Path, e: quilt_block::BlockError) -> anyhow::Error {
    let quilt_block::BlockError::Busy { holders, .. } = &e else {
        return anyhow::anyhow!("{e}");
    };
    let mut who = Vec::new();
    for pid in holders {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // A server is `quiltfs mount IMAGE MOUNTPOINT --foreground ...`.
        match args.iter().position(|a| a == "mount") {
            Some(i) if args.len() > i + 2 => who.push(format!(
                "it is mounted on {} (quiltfs server, pid {pid})",
                args[i + 2]
            )),
            _ => who.push(format!(
                "process {pid} ({}) holds it",
                args.first().map(String::as_str).unwrap_or("?")
            )),
        }
    }
    if who.is_empty() {
        who.push("another process holds its lock".into());
    }
    anyhow::anyhow!("{} is in use: {}", path.display(), who.join("; "))
}

fn open_error(image: &Path, e: quilt_block::BlockError) -> anyhow::Error {
    match e {
        quilt_block::BlockError::Busy { .. } => in_use(image, e),
        e => anyhow::Error::new(e).context(format!("cannot open {}", image.display())),
    }
}

/// The loop devices (`loopN`) attached over `path`.
pub fn loop_devices_over(path: &Path) -> Vec<String> {
    let Ok(canon) = path.canonicalize() else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    dir.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("loop"))
        .filter(|name| {
            std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
                .is_ok_and(|b| Path::new(b.trim()) == canon)
        })
        .collect()
}

/// A loop device over `path` that the kernel has mounted, described.
fn kernel_loop_mount(path: &Path) -> Option<String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for name in loop_devices_over(path) {
        let dev = format!("/dev/{name}");
        // mountinfo: ... mount point is field 5; the source follows " - TYPE ".
        for l in mountinfo.lines() {
            let (left, right) = l.split_once(" - ").unwrap_or((l, ""));
            if right.split_whitespace().nth(1) == Some(dev.as_str()) {
                let at = left.split_whitespace().nth(4).unwrap_or("?");
                return Some(format!("the kernel has it mounted on {at} through {dev}"));
            }
        }
    }
    None
}

/// What `file` already holds, if it looks like a file system: ext2/3/4 from the
/// superblock (size, label, last mount), anything else as blkid names it.
pub fn probe_contents(file: &std::fs::File, path: &Path) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; 2048];
    let n = file.read_at(&mut b, 0).unwrap_or(0);
    if n >= 2048 && u16::from_le_bytes([b[1024 + 0x38], b[1024 + 0x39]]) == 0xEF53 {
        return Some(describe_ext(&b[1024..2048]));
    }
    let mut t = vec![0u8; 128 << 10];
    let n = file.read_at(&mut t, 0).unwrap_or(0);
    if quilt_betree::probe_block_size(&t[..n]).is_some() {
        return Some("a quiltfs Bε-tree (betrfs or a key-value store)".to_string());
    }
    // Any other signature blkid knows (file systems, swap, partition tables).
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(path)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).map(|v| v.to_string()))
    };
    if let Some(t) = field("TYPE=") {
        return Some(if t == "swap" {
            "swap space (found by blkid)".to_string()
        } else {
            format!("a {t} file system (found by blkid)")
        });
    }
    field("PTTYPE=").map(|t| format!("a {t} partition table (found by blkid)"))
}

fn describe_ext(sb: &[u8]) -> String {
    let le32 = |o: usize| u32::from_le_bytes([sb[o], sb[o + 1], sb[o + 2], sb[o + 3]]);
    let compat = le32(0x5C);
    let incompat = le32(0x60);
    let kind = if incompat & 0x2C0 != 0 {
        // extents, 64bit or flex_bg
        "ext4"
    } else if compat & 0x4 != 0 {
        "ext3"
    } else {
        "ext2"
    };
    let bs = 1024u64 << le32(0x18).min(6);
    let blocks = le32(0x04) as u64;
    let inodes = le32(0x00);
    let used = inodes.saturating_sub(le32(0x10));
    let mut s = format!(
        "an {kind} file system of {} MiB ({} inodes in use)",
        (blocks * bs) >> 20,
        used
    );
    let label = String::from_utf8_lossy(&sb[0x78..0x88])
        .trim_end_matches('\0')
        .to_string();
    if !label.is_empty() {
        s.push_str(&format!(", label '{label}'"));
    }
    match le32(0x2C) {
        0 => s.push_str(", never mounted"),
        t => {
            s.push_str(&format!(", last mounted {}", utc(t as i64)));
            let dir = String::from_utf8_lossy(&sb[0x88..0xC8])
                .trim_end_matches('\0')
                .to_string();
            if !dir.is_empty() {
                s.push_str(&format!(" on {dir}"));
            }
        }
    }
    let wtime = le32(0x30);
    if wtime != 0 {
        s.push_str(&format!(", last written {}", utc(wtime as i64)));
    }
    s
}

/// `2026-11-23 18:45:00 UTC` from seconds since the epoch.
pub fn utc(t: i64) -> String {
    let days = t.div_euclid(86400);
    let secs = t.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Whether `path` is a block device (else an image file).
pub fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// Reads the block size an ext2 image declares.
/// The replicated-volume address `image` is, if it is one (`gnothi://…`).
pub fn volume_address(image: &Path) -> Option<&str> {
    image
        .to_str()
        .filter(|s| quilt_gnothi::device::VolumeAddress::is_address(s))
}

pub fn probe_block_size(image: &Path) -> Result<usize> {
    if let Some(addr) = volume_address(image) {
        // A volume's blocks are the size it was made with; the superblock must agree.
        let dev = quilt_gnothi::device::ReplicatedDevice::connect(addr)
            .with_context(|| format!("cannot reach the volume {addr}"))?;
        let mut b = vec![0u8; dev.block_size()];
        dev.read(0, &mut b)?;
        let sb = Superblock::decode(&b[1024..2048])
            .with_context(|| format!("{addr} holds no usable ext2 file system"))?;
        return Ok(sb.block_size() as usize);
    }
    let dev = FileDevice::open(
        image,
        FileDeviceOptions {
            block_size: 1024,
            read_only: true,
            ..Default::default()
        },
    )
    .map_err(|e| open_error(image, e))?;
    if dev.block_count() < 2 {
        bail!(
            "{} is too small to hold an ext2 file system",
            image.display()
        );
    }
    let mut b = vec![0u8; 1024];
    dev.read(1, &mut b)?;
    let sb = Superblock::decode(&b)
        .with_context(|| format!("{} is not a usable ext2 image", image.display()))?;
    Ok(sb.block_size() as usize)
}

/// The block cache a mount gets unless told otherwise, MiB.
pub const DEFAULT_CACHE_MIB: usize = 128;

#[derive(Debug, Clone)]
pub struct OpenSettings {
    pub mode: Mode,
    pub read_only: bool,
    pub unsafe_durability: bool,
    pub cache_mib: usize,
    /// Background write-back interval; None for none.
    pub flush_interval_ms: Option<u64>,
    /// The patch engine's two optimizations (on unless a benchmark compares them).
    pub hard_patches: bool,
    pub overlap_merge: bool,
    /// POSIX ACLs (`acl`, the default; `noacl`).
    pub acl: bool,
    /// After damage is found: `errors=remount-ro` (the default) or `continue`.
    pub errors: quilt_ext2::Errors,
    /// The journal's placement (`journal=ring|skip|null`); None: the one it was made for.
    pub journal_placement: Option<quilt_ext2::JournalPlacement>,
    /// The external journal's device or file (`journal_dev=PATH`).
    pub journal_dev: Option<std::path::PathBuf>,
    /// Serve the external journal through a model of a rotating disk (`journal_model=7200`).
    pub journal_model: bool,
    /// Serve the image through a model of a rotating disk with its write cache on
    /// (`model=7200`).
    pub model: bool,
    /// The models' flushes stop at the model: the host does not flush the files under
    /// them (`model_nohostsync`, for benchmarks).
    pub model_nohostsync: bool,
}

impl Default for OpenSettings {
    fn default() -> Self {
        OpenSettings {
            mode: Mode::SoftUpdates,
            read_only: false,
            unsafe_durability: false,
            cache_mib: DEFAULT_CACHE_MIB,
            flush_interval_ms: Some(1000),
            hard_patches: true,
            overlap_merge: true,
            acl: true,
            errors: quilt_ext2::Errors::default(),
            journal_placement: None,
            journal_dev: None,
            journal_model: false,
            model: false,
            model_nohostsync: false,
        }
    }
}

/// The disk-model layer the settings ask for (`model=7200`, `journal_model=7200`).
fn disk_layer(s: &OpenSettings, params: quilt_block::DiskParams) -> quilt_stack::Layer {
    quilt_stack::Layer::Disk {
        params,
        virtual_time: false,
        host_flush: !s.model_nohostsync,
    }
}

/// The external journal's device named by `journal_dev=`, opened with the image's block
/// size, behind the disk model if asked.
fn open_journal_dev(
    s: &OpenSettings,
    block_size: usize,
    locks: &mut Vec<ImageLock>,
) -> Result<Option<quilt_ext2::JournalDevice>> {
    let Some(path) = &s.journal_dev else {
        if s.journal_model {
            bail!("journal_model= needs an external journal (journal_dev=PATH)");
        }
        return Ok(None);
    };
    let mut spec = DeviceSpec::image(ImageSpec::new(path, block_size, s.read_only));
    if s.journal_model {
        spec = spec.with(disk_layer(s, quilt_block::DiskParams::desktop_7200()));
    }
    let d = quilt_stack::device(spec).map_err(|e| open_error(path, e))?;
    locks.extend(d.locks);
    Ok(Some(quilt_ext2::JournalDevice(d.dev)))
}

/// Opens an ext2 image as `s` says; `locks` gets handles on the locks it took (the
/// image's, an external journal's), for the server to let go of at unmount.
pub fn open_fs(image: &Path, s: &OpenSettings, locks: &mut Vec<ImageLock>) -> Result<Ext2> {
    let bs = probe_block_size(image)?;
    let mut spec = DeviceSpec::image(ImageSpec::new(image, bs, s.read_only));
    if s.model {
        // A desktop disk as it ships: its write cache on (the journal's disk, modelled
        // for log skipping, keeps it off).
        spec = spec.with(disk_layer(
            s,
            quilt_block::DiskParams {
                write_cache: true,
                ..quilt_block::DiskParams::desktop_7200()
            },
        ));
    }
    // The image's lock first (a second quiltfs mount is named by its server), then a
    // kernel mount of a loop device over it.
    let d = quilt_stack::device(spec).map_err(|e| open_error(image, e))?;
    if !s.read_only {
        if let Some(l) = kernel_loop_mount(image) {
            bail!("{} is in use: {l}", image.display());
        }
    }
    locks.extend(d.locks);
    let journal_device = open_journal_dev(s, bs, locks)?;
    quilt_stack::ext2(
        d.dev,
        quilt_stack::Ext2Spec {
            engine: EngineOptions {
                durability: if s.unsafe_durability {
                    Durability::Unsafe
                } else {
                    Durability::Safe
                },
                cache_bytes_max: s.cache_mib << 20,
                flush_interval_ms: s.flush_interval_ms,
                hard_patches: s.hard_patches,
                overlap_merge: s.overlap_merge,
                ..Default::default()
            },
            mount: MountOptions {
                mode: s.mode,
                read_only: s.read_only,
                acl: s.acl,
                errors: s.errors,
                journal_placement: s.journal_placement,
                journal_device,
                ..Default::default()
            },
            flusher: s.flush_interval_ms.map(std::time::Duration::from_millis),
        },
    )
    .with_context(|| format!("cannot mount {}", image.display()))
}
