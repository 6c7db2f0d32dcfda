//! `quiltfs mkfs`: a fresh ext2 image.

use crate::image::parse_size;
use anyhow::{bail, Context, Result};
use quilt_block::{FileDevice, FileDeviceOptions};
use quilt_patch::{Engine, EngineOptions};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// Image file to create (replaced if it exists).
    pub image: PathBuf,
    /// Size, e.g. 512M, 4G.
    #[arg(long)]
    pub size: String,
    /// Block size in bytes: 1024, 2048 or 4096.
    #[arg(long, default_value_t = 4096)]
    pub block_size: u32,
    /// Number of inodes (default: one per 16 KiB).
    #[arg(long)]
    pub inodes: Option<u32>,
    /// Volume label.
    #[arg(long, default_value = "")]
    pub label: String,
    /// Create an ext3 journal (arrives with issue #4).
    #[arg(long)]
    pub journal: bool,
}

pub fn run(a: MkfsArgs) -> Result<()> {
    if a.journal {
        bail!("--journal is not implemented yet (issue #4)");
    }
    if ![1024, 2048, 4096].contains(&a.block_size) {
        bail!(
            "--block-size must be 1024, 2048 or 4096, not {}",
            a.block_size
        );
    }
    let bytes = parse_size(&a.size)?;
    let blocks = bytes / a.block_size as u64;
    if blocks > u32::MAX as u64 {
        bail!(
            "--size {} is too large for ext2 with {}-byte blocks",
            a.size,
            a.block_size
        );
    }
    if a.image.exists() && !a.image.is_file() {
        bail!("{} exists and is not a regular file", a.image.display());
    }
    let dev = FileDevice::create(
        &a.image,
        blocks,
        FileDeviceOptions {
            block_size: a.block_size as usize,
            direct: false,
            read_only: false,
        },
    )
    .with_context(|| format!("cannot create {}", a.image.display()))?;
    let engine = Engine::new(Arc::new(dev), EngineOptions::default());
    let opts = quilt_ext2::MkfsOptions {
        inodes: a.inodes,
        label: a.label.clone(),
        device_is_zeroed: true,
        root_uid: 0,
        root_gid: 0,
    };
    let sb = quilt_ext2::mkfs(&engine, &opts).context("mkfs failed")?;
    println!(
        "{}: ext2, {} blocks of {} bytes ({} MiB), {} inodes, {} groups",
        a.image.display(),
        sb.blocks_count,
        sb.block_size(),
        (sb.blocks_count as u64 * sb.block_size() as u64) >> 20,
        sb.inodes_count,
        sb.group_count()
    );
    Ok(())
}
