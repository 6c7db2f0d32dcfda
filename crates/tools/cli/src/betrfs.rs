//! betrfs images from the shell: telling them apart from ext2 images and bare key-value
//! trees, opening them for a mount, and `quiltfs fsck`.

use anyhow::{Context, Result};
use quilt_betrfs::{Betrfs, MountOptions};
use quilt_block::BlockDevice;
use quilt_stack::{DeviceSpec, ImageSpec};
use std::path::Path;
use std::sync::Arc;

/// What an image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Ext2,
    /// A Bε-tree (block size): betrfs or a bare key-value store.
    Tree(usize),
}

/// Looks at the first 128 KiB: a Bε-tree header, or else (presumably) ext2.
pub fn detect(image: &Path) -> Result<Format> {
    if let Some(addr) = crate::image::volume_address(image) {
        let dev = quilt_gnothi::device::ReplicatedDevice::connect(addr)
            .with_context(|| format!("cannot reach the volume {addr}"))?;
        let bs = dev.block_size();
        let blocks = ((128usize << 10) / bs)
            .max(1)
            .min(dev.block_count() as usize);
        let mut prefix = vec![0u8; blocks * bs];
        dev.read_blocks(0, &mut prefix)
            .context("reading the volume")?;
        return Ok(match quilt_betree::probe_block_size(&prefix) {
            Some(bs) => Format::Tree(bs),
            None => Format::Ext2,
        });
    }
    let mut f =
        std::fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
    let mut prefix = vec![0u8; 128 << 10];
    let mut n = 0;
    while n < prefix.len() {
        match std::io::Read::read(&mut f, &mut prefix[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(match quilt_betree::probe_block_size(&prefix[..n]) {
        Some(bs) => Format::Tree(bs),
        None => Format::Ext2,
    })
}

/// Opens a betrfs image's device (read-only: under a copy-on-write overlay, so a log
/// replay changes nothing on disk); `locks` gets a handle on the lock it took.
pub fn open_device(
    image: &Path,
    bs: usize,
    read_only: bool,
    locks: &mut Vec<quilt_block::ImageLock>,
) -> Result<Arc<dyn BlockDevice>> {
    let mut spec = DeviceSpec::image(ImageSpec::new(image, bs, read_only));
    if read_only {
        spec = spec.with(quilt_stack::Layer::Overlay);
    }
    let d = quilt_stack::device(spec).map_err(|e| crate::image::in_use(image, e))?;
    locks.extend(d.locks);
    Ok(d.dev)
}

/// Mounts the betrfs image (read-only: on a copy-on-write view).
pub fn open(
    image: &Path,
    bs: usize,
    opts: MountOptions,
    locks: &mut Vec<quilt_block::ImageLock>,
) -> Result<Betrfs> {
    let dev = open_device(image, bs, opts.read_only, locks)?;
    let opts = MountOptions {
        // A read-only view still replays the log and finishes moves, in memory.
        read_only: false,
        ..opts
    };
    quilt_stack::betrfs(dev, opts)
        .with_context(|| format!("cannot mount {} (betrfs)", image.display()))
}

pub fn mkfs(image: &Path, dev: Arc<dyn BlockDevice>) -> Result<()> {
    let blocks = dev.block_count();
    let bs = dev.block_size();
    quilt_stack::mkfs_betrfs(dev).context("mkfs failed")?;
    println!(
        "{}: betrfs, {} blocks of {} bytes ({} MiB)",
        image.display(),
        blocks,
        bs,
        (blocks * bs as u64) >> 20
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct FsckArgs {
    /// The image (betrfs; an ext2 image is handed to e2fsck with the same flags).
    pub image: std::path::PathBuf,
    /// Open the image read-only and answer "no" to every repair.
    #[arg(short = 'n', conflicts_with = "yes")]
    pub no: bool,
    /// Repair what can be repaired.
    #[arg(short = 'y')]
    pub yes: bool,
    /// Check even if the image is marked clean (as e2fsck -f; betrfs always checks).
    #[arg(short = 'f')]
    pub force: bool,
}

/// e2fsck's exit status: 0 clean, 1 errors corrected, 4 errors left, 8 operational
/// error.
pub fn fsck(a: FsckArgs) -> Result<i32> {
    let fmt = match detect(&a.image) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("quiltfs fsck: {e:#}");
            return Ok(8);
        }
    };
    let bs = match fmt {
        Format::Ext2 => {
            let mut cmd = std::process::Command::new("e2fsck");
            if a.no {
                cmd.arg("-n");
            } else if a.yes {
                cmd.arg("-y");
            } else {
                cmd.arg("-p");
            }
            if a.force {
                cmd.arg("-f");
            }
            let st = cmd
                .arg(&a.image)
                .status()
                .context("running e2fsck for an ext2 image")?;
            return Ok(st.code().unwrap_or(8));
        }
        Format::Tree(bs) => bs,
    };
    let dev = match open_device(&a.image, bs, !a.yes, &mut Vec::new()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("quiltfs fsck: {e:#}");
            return Ok(8);
        }
    };
    let mut meter = crate::progress::Meter::new("fsck", "keys (estimated)", 0);
    let r = quilt_betrfs::fsck::fsck_with_progress(dev, a.yes, &mut |done, total| {
        meter.set(done, total, "")
    });
    meter.finish();
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            println!("{}: cannot be mounted: {e}", a.image.display());
            return Ok(4);
        }
    };
    for p in &r.fixed {
        println!("fixed: {p}");
    }
    for p in &r.problems {
        println!("{}{p}", if a.yes { "not fixed: " } else { "" });
    }
    println!(
        "{}: {} directories, {} files, {} others, {} extra names, {} data blocks ({} bytes): {}",
        a.image.display(),
        r.directories,
        r.files,
        r.other,
        r.link_stubs,
        r.data_blocks,
        r.data_bytes,
        match r.exit_code() {
            0 => "clean",
            1 => "repaired",
            _ => "ERRORS",
        }
    );
    Ok(r.exit_code())
}
