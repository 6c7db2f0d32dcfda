//! Opening images: the device, the patch engine and the ext2 module, with the settings
//! shared by `mount`, `stats` and the tests.

use anyhow::{bail, Context, Result};
use quilt_block::{BlockDevice, FileDevice, FileDeviceOptions};
use quilt_ext2::{format::Superblock, Ext2, Mode, MountOptions};
use quilt_patch::{Durability, Engine, EngineOptions};
use std::path::Path;
use std::sync::Arc;

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

/// Reads the block size an ext2 image declares.
pub fn probe_block_size(image: &Path) -> Result<usize> {
    let dev = FileDevice::open(
        image,
        FileDeviceOptions {
            block_size: 1024,
            direct: false,
            read_only: true,
        },
    )
    .with_context(|| format!("cannot open {}", image.display()))?;
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
}

impl Default for OpenSettings {
    fn default() -> Self {
        OpenSettings {
            mode: Mode::SoftUpdates,
            read_only: false,
            unsafe_durability: false,
            cache_mib: 128,
            flush_interval_ms: Some(1000),
            hard_patches: true,
            overlap_merge: true,
        }
    }
}

pub fn open_fs(image: &Path, s: &OpenSettings) -> Result<Ext2> {
    let bs = probe_block_size(image)?;
    let dev = FileDevice::open(
        image,
        FileDeviceOptions {
            block_size: bs,
            direct: false,
            read_only: s.read_only,
        },
    )
    .with_context(|| format!("cannot open {}", image.display()))?;
    let engine = Engine::new(
        Arc::new(dev),
        EngineOptions {
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
    );
    let fs = Ext2::open(
        engine,
        MountOptions {
            mode: s.mode,
            read_only: s.read_only,
        },
    )
    .with_context(|| format!("cannot mount {}", image.display()))?;
    if let Some(ms) = s.flush_interval_ms {
        fs.engine()
            .start_flusher(std::time::Duration::from_millis(ms));
    }
    Ok(fs)
}
