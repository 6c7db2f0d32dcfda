//! `quiltfs mkfs`: a fresh ext2 image, or ext3 with `--journal`.

use crate::image::parse_size;
use anyhow::{bail, Context, Result};
use quilt_block::{BlockDevice, FileDevice, FileDeviceOptions};
use quilt_patch::{Engine, EngineOptions};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// Image file (created if missing) or block device to format.
    pub image: PathBuf,
    /// Size, e.g. 512M, 4G (default: the size of an existing file or device).
    #[arg(long)]
    pub size: Option<String>,
    /// Block size in bytes: 1024, 2048 or 4096.
    #[arg(long, default_value_t = 4096)]
    pub block_size: u32,
    /// Number of inodes (default: one per 16 KiB).
    #[arg(long)]
    pub inodes: Option<u32>,
    /// Volume label.
    #[arg(long, default_value = "")]
    pub label: String,
    /// Create an ext3 journal (JBD2, inode 8), as `mke2fs -j`.
    #[arg(long)]
    pub journal: bool,
    /// Journal size, e.g. 32M (default: as mke2fs picks for the image's size; at least
    /// 1024 blocks).
    #[arg(long, requires = "journal")]
    pub journal_size: Option<String>,
    /// Where the journal's commits go by default: ring (JBD2's log, as the kernel
    /// writes it) or skip (log skipping: each commit one self-identifying record, written
    /// wherever the disk's head gets first; a mount may choose again with journal=).
    #[arg(long, requires = "journal", default_value = "ring", value_parser = ["ring", "skip"])]
    pub journal_placement: String,
    /// Put the journal on a device or file of its own (created if missing, of
    /// --journal-size or the default journal size), as `mke2fs -J device=`: mounts then
    /// need journal_dev=PATH.
    #[arg(long, requires = "journal")]
    pub journal_dev: Option<PathBuf>,
    /// The file system: ext2 (with --journal, ext3) or betrfs (the Bε-tree file system).
    #[arg(long = "fs", default_value = "ext2", value_parser = ["ext2", "betrfs"])]
    pub fs: String,
    /// Overwrite a file system (or anything else blkid recognizes) already on the target.
    #[arg(long, short = 'F')]
    pub force: bool,
}

pub fn run(a: MkfsArgs) -> Result<()> {
    if ![1024, 2048, 4096].contains(&a.block_size) {
        bail!(
            "--block-size must be 1024, 2048 or 4096, not {}",
            a.block_size
        );
    }
    // A size that cannot be made is refused before anything is created.
    let asked = a.size.as_deref().map(parse_size).transpose()?;
    if let Some(bytes) = asked {
        check_size(&a, bytes)?;
    }
    if let Some(addr) = crate::image::volume_address(&a.image) {
        return format_volume(&a, addr, asked);
    }
    let created = !a.image.exists();
    let target = crate::image::open_target(&a.image)?;
    let r = format(&a, target, asked);
    if r.is_err() && created {
        // Nothing of ours may stay behind a refusal: the file did not exist before.
        let _ = std::fs::remove_file(&a.image);
    }
    r
}

/// mkfs on a replicated volume: the volume's size is the file system's.
fn format_volume(a: &MkfsArgs, addr: &str, asked: Option<u64>) -> Result<()> {
    let dev = quilt_gnothi::device::ReplicatedDevice::connect(addr)
        .with_context(|| format!("cannot reach the volume {addr}"))?;
    let bytes = dev.block_count() * dev.block_size() as u64;
    if asked.is_some_and(|b| b != bytes) {
        bail!("a file system on a volume fills it ({bytes} bytes): leave out --size");
    }
    if dev.block_size() != a.block_size as usize {
        bail!(
            "the volume has {}-byte blocks: give --block-size {}",
            dev.block_size(),
            dev.block_size()
        );
    }
    check_size(a, bytes)?;
    // What a volume already holds is not overwritten without --force.
    let mut head = vec![0u8; dev.block_size()];
    dev.read(0, &mut head).context("reading the volume")?;
    let ext2 = head.len() > 1081 && head[1080] == 0x53 && head[1081] == 0xef;
    if head.iter().any(|&b| b != 0) && !a.force {
        bail!(
            "{addr} already holds {}.\nquiltfs mkfs would destroy it; run it again with --force to overwrite it",
            if ext2 { "an ext2 file system" } else { "data" }
        );
    }
    let dev: Arc<dyn quilt_block::BlockDevice> = Arc::new(dev);
    if a.fs == "betrfs" {
        return crate::betrfs::mkfs(&a.image, dev);
    }
    let meter = group_meter();
    let opts = quilt_ext2::MkfsOptions {
        inodes: a.inodes,
        label: a.label.clone(),
        device_is_zeroed: false,
        root_uid: 0,
        root_gid: 0,
        progress: Some(meter.1),
    };
    let made = quilt_stack::mkfs_ext2(dev, EngineOptions::default(), &opts);
    lock(&meter.0).finish();
    let (engine, sb) = made.context("mkfs failed")?;
    let mut kind = "ext2".to_string();
    if a.journal {
        let blocks = bytes / a.block_size as u64;
        let jblocks = match &a.journal_size {
            Some(s) => parse_size(s)? / a.block_size as u64,
            None => quilt_ext2::journal::default_journal_blocks(blocks) as u64,
        };
        quilt_stack::add_journal(engine, jblocks as u32, false).context("creating the journal")?;
        kind = format!("ext3 (journal of {jblocks} blocks)");
    } else {
        drop(engine);
    }
    println!(
        "{addr}: {kind}, {} blocks of {} bytes ({} MiB), {} inodes, {} groups",
        sb.blocks_count,
        sb.block_size(),
        (sb.blocks_count as u64 * sb.block_size() as u64) >> 20,
        sb.inodes_count,
        sb.group_count()
    );
    Ok(())
}

/// Whether `bytes` makes a file system of the kind asked for.
fn check_size(a: &MkfsArgs, bytes: u64) -> Result<()> {
    let blocks = bytes / a.block_size as u64;
    if a.fs == "ext2" && blocks > u32::MAX as u64 {
        bail!(
            "a size of {bytes} bytes is too large for ext2 with {}-byte blocks (at most {} bytes)",
            a.block_size,
            u32::MAX as u64 * a.block_size as u64
        );
    }
    if blocks < 64 {
        bail!("a size of {bytes} bytes is too small for a file system (at least 64 blocks)");
    }
    Ok(())
}

fn format(a: &MkfsArgs, target: crate::image::Target, asked: Option<u64>) -> Result<()> {
    let bytes = match asked {
        Some(b) => b,
        None if target.existed => target.len,
        None => bail!(
            "{} does not exist: give its size with --size (e.g. --size 1G)",
            a.image.display()
        ),
    };
    if target.is_device && bytes != target.len {
        bail!(
            "a file system on a block device fills it ({} bytes): leave out --size",
            target.len
        );
    }
    check_size(a, bytes)?;
    let blocks = bytes / a.block_size as u64;
    if let Some(found) = crate::image::probe_contents(&target.file, &a.image) {
        if !a.force {
            bail!(
                "{} already holds {found}.\nquiltfs mkfs would destroy it; run it again with --force to overwrite it",
                a.image.display()
            );
        }
        eprintln!("quiltfs mkfs: overwriting {found} (--force)");
    }
    let file = target.file;
    if !target.is_device {
        // Emptied, then extended: the new image reads as zeros without writing them.
        let io = |e: std::io::Error| {
            if e.raw_os_error() == Some(libc::EFBIG) {
                anyhow::anyhow!(
                    "the file system under {} does not take a file of {bytes} bytes ({e})",
                    a.image.display()
                )
            } else {
                anyhow::anyhow!("cannot resize {}: {e}", a.image.display())
            }
        };
        file.set_len(0).map_err(io)?;
        file.set_len(bytes).map_err(io)?;
    }
    let dev = FileDevice::from_locked(
        file,
        a.image.clone(),
        FileDeviceOptions {
            block_size: a.block_size as usize,
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open {}", a.image.display()))?;
    if a.fs == "betrfs" {
        if a.journal || a.inodes.is_some() {
            bail!("--journal and --inodes are ext2 options; betrfs has its own log and no inode table");
        }
        return crate::betrfs::mkfs(&a.image, Arc::new(dev));
    }
    let device_is_zeroed = !target.is_device;
    if !target.is_device {
        host_room_note(&a.image, bytes);
    }
    let meter = group_meter();
    let opts = quilt_ext2::MkfsOptions {
        inodes: a.inodes,
        label: a.label.clone(),
        device_is_zeroed,
        root_uid: 0,
        root_gid: 0,
        progress: Some(meter.1),
    };
    let made = quilt_stack::mkfs_ext2(Arc::new(dev), EngineOptions::default(), &opts);
    lock(&meter.0).finish();
    let (engine, sb) = made.context("mkfs failed")?;
    let mut kind = "ext2".to_string();
    let skip = a.journal_placement == "skip";
    if let Some(jpath) = &a.journal_dev {
        let jblocks = external_journal(a, jpath, &engine, skip, blocks)?;
        kind = format!(
            "ext3 (external journal {} of {jblocks} blocks, {} MiB{})",
            jpath.display(),
            (jblocks * a.block_size as u64) >> 20,
            if skip { ", log skipping" } else { "" }
        );
    } else if a.journal {
        let jblocks = match &a.journal_size {
            Some(s) => parse_size(s)? / a.block_size as u64,
            None => quilt_ext2::journal::default_journal_blocks(blocks) as u64,
        };
        if jblocks < 1024 || jblocks > sb.free_blocks_count as u64 / 2 {
            bail!(
                "a journal of {jblocks} blocks does not fit: it needs at least 1024 blocks and at most half the free space ({} blocks)",
                sb.free_blocks_count / 2
            );
        }
        quilt_stack::add_journal(engine, jblocks as u32, skip).context("creating the journal")?;
        kind = format!(
            "ext3 (journal of {jblocks} blocks, {} MiB{})",
            (jblocks * a.block_size as u64) >> 20,
            if skip { ", log skipping" } else { "" }
        );
    }
    println!(
        "{}: {kind}, {} blocks of {} bytes ({} MiB), {} inodes, {} groups",
        a.image.display(),
        sb.blocks_count,
        sb.block_size(),
        (sb.blocks_count as u64 * sb.block_size() as u64) >> 20,
        sb.inodes_count,
        sb.group_count()
    );
    Ok(())
}

/// Formats `jpath` as the external journal of the new file system on `engine`'s device
/// and points the file system at it; returns the journal's size in blocks.
fn external_journal(
    a: &MkfsArgs,
    jpath: &std::path::Path,
    engine: &Engine,
    skip: bool,
    fs_blocks: u64,
) -> Result<u64> {
    let target = crate::image::open_target(jpath)?;
    let bytes = match &a.journal_size {
        Some(s) if target.is_device => bail!(
            "a journal on a block device fills it ({} bytes): leave out --journal-size, not {s}",
            target.len
        ),
        Some(s) => parse_size(s)?,
        None if target.existed && target.len > 0 => target.len,
        None => quilt_ext2::journal::default_journal_blocks(fs_blocks) as u64 * a.block_size as u64,
    };
    if let Some(found) = crate::image::probe_contents(&target.file, jpath) {
        if !a.force {
            bail!(
                "{} already holds {found}.\nquiltfs mkfs would destroy it; run it again with --force to overwrite it",
                jpath.display()
            );
        }
    }
    if !target.is_device {
        let io = |e| anyhow::anyhow!("cannot resize {}: {e}", jpath.display());
        target.file.set_len(0).map_err(io)?;
        target.file.set_len(bytes).map_err(io)?;
    }
    let jblocks = bytes / a.block_size as u64;
    if jblocks < 1024 {
        bail!("a journal of {jblocks} blocks is too small: it needs at least 1024 blocks");
    }
    let jdev = FileDevice::from_locked(
        target.file,
        jpath.to_path_buf(),
        FileDeviceOptions {
            block_size: a.block_size as usize,
            ..Default::default()
        },
    )
    .with_context(|| format!("cannot open {}", jpath.display()))?;
    engine.sync().context("writing the file system")?;
    quilt_ext2::journal::attach_external_journal(engine.device().as_ref(), &jdev, skip)
        .with_context(|| format!("making {} the journal", jpath.display()))?;
    Ok(jblocks.min(u32::MAX as u64))
}

/// Image files are sparse: says so when the host file system has less room than the
/// image could fill (writes past it then fail with ENOSPC, in write(2)).
fn host_room_note(image: &std::path::Path, bytes: u64) {
    let dir = image
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: statvfs fills the struct we pass for a NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return;
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    if free < bytes {
        eprintln!(
            "quiltfs mkfs: note: {} is sparse; its host file system has {} MiB free for its {} MiB, so writes past that will fail with ENOSPC",
            image.display(),
            free >> 20,
            bytes >> 20
        );
    }
}

type SharedMeter = Arc<std::sync::Mutex<crate::progress::Meter>>;

/// Progress of the block groups laid out (a bar on a terminal, lines otherwise): the
/// meter, and the callback mkfs calls.
fn group_meter() -> (SharedMeter, quilt_ext2::mkfs::Progress) {
    let meter: SharedMeter = Arc::new(std::sync::Mutex::new(crate::progress::Meter::new(
        "mkfs", "groups", 0,
    )));
    let m = meter.clone();
    let cb = quilt_ext2::mkfs::Progress(Arc::new(move |done, total| lock(&m).set(done, total, "")));
    (meter, cb)
}

fn lock(m: &SharedMeter) -> std::sync::MutexGuard<'_, crate::progress::Meter> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
