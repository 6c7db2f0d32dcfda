//! `quiltfs kv`: the Bε-tree key-value store on an image file, one operation per command
//! (each opens the tree, recovers it if needed, and closes it with a checkpoint).

use anyhow::{bail, Context, Result};
use quilt_betree::{Options, Tree};
use quilt_block::BlockDevice;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(clap::Subcommand)]
pub enum KvCommand {
    /// Create a tree on a new image file (or overwrite an existing one with --force).
    Create {
        image: PathBuf,
        /// Image size (K, M, G, T suffixes).
        #[arg(long, default_value = "1G")]
        size: String,
        /// Largest node (the papers use 4M; see ARCHITECTURE.md for this default).
        #[arg(long, default_value = "256K")]
        node_size: String,
        /// Basement size: what a point query reads of a leaf.
        #[arg(long, default_value = "4K")]
        basement_size: String,
        #[arg(long, default_value_t = 16)]
        fanout: usize,
        /// Replace whatever the image holds.
        #[arg(long)]
        force: bool,
    },
    /// Store a value.
    Put {
        image: PathBuf,
        key: String,
        value: String,
    },
    /// Print a key's value (exit status 1 if absent).
    Get { image: PathBuf, key: String },
    /// Delete a key.
    Delete { image: PathBuf, key: String },
    /// Delete every key in START..END (END excluded) with one message.
    DeleteRange {
        image: PathBuf,
        start: String,
        end: String,
    },
    /// Print keys and values in order.
    Scan {
        image: PathBuf,
        #[arg(long, default_value = "")]
        from: String,
        /// Stop before this key.
        #[arg(long)]
        to: Option<String>,
        #[arg(long)]
        reverse: bool,
        #[arg(long)]
        limit: Option<usize>,
    },
}

fn open_dev(image: &Path) -> Result<Arc<dyn BlockDevice>> {
    let mut f =
        std::fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
    let mut prefix = vec![0u8; 128 << 10];
    let n = std::io::Read::read(&mut f, &mut prefix)?;
    let Some(bs) = quilt_betree::probe_block_size(&prefix[..n]) else {
        bail!(
            "{} holds no Bε-tree (make one with `quiltfs kv create`)",
            image.display()
        );
    };
    let spec = quilt_stack::ImageSpec {
        lock: true,
        ..quilt_stack::ImageSpec::new(image, bs, false)
    };
    let d = quilt_stack::device(quilt_stack::DeviceSpec::image(spec))
        .map_err(|e| crate::image::in_use(image, e))?;
    Ok(d.dev)
}

pub fn open(image: &Path) -> Result<Tree> {
    let dev = open_dev(image)?;
    quilt_stack::tree(dev, Options::default())
        .with_context(|| format!("opening the tree on {}", image.display()))
}

pub fn run(c: KvCommand) -> Result<()> {
    match c {
        KvCommand::Create {
            image,
            size,
            node_size,
            basement_size,
            fanout,
            force,
        } => {
            if image.exists() && !force {
                bail!(
                    "{} exists; add --force to replace what it holds",
                    image.display()
                );
            }
            let bytes = crate::image::parse_size(&size)?;
            let bs = 4096usize;
            let opts = Options {
                node_bytes: crate::image::parse_size(&node_size)? as usize,
                basement_bytes: crate::image::parse_size(&basement_size)? as usize,
                fanout,
                ..Options::default()
            };
            // --force over an image file: refused while it is in use (its lock); the
            // new tree is made beside it and takes its place only once it is whole, so
            // a size or geometry that does not fit leaves the old one as it was. (A
            // block device is written over.)
            let replacing = std::fs::metadata(&image).is_ok_and(|m| m.is_file());
            let _in_use = if replacing {
                let spec = quilt_stack::ImageSpec::new(&image, bs, false);
                Some(
                    quilt_stack::device(quilt_stack::DeviceSpec::image(spec))
                        .map_err(|e| crate::image::in_use(&image, e))?,
                )
            } else {
                None
            };
            let target = if replacing {
                let mut name = image.file_name().unwrap_or_default().to_os_string();
                name.push(".quiltfs-new");
                image.with_file_name(name)
            } else {
                image.clone()
            };
            let made = (|| -> Result<quilt_betree::Geometry> {
                if replacing {
                    // A leftover of an earlier attempt.
                    let _ = std::fs::remove_file(&target);
                }
                let spec = quilt_stack::ImageSpec {
                    create_bytes: Some(bytes / bs as u64 * bs as u64),
                    ..quilt_stack::ImageSpec::new(&target, bs, false)
                };
                let dev = quilt_stack::device(quilt_stack::DeviceSpec::image(spec))
                    .with_context(|| format!("creating {}", image.display()))?
                    .dev;
                let t = quilt_stack::create_tree(dev, opts)?;
                let g = t.geometry();
                t.close()?;
                Ok(g)
            })();
            let g = match made {
                Ok(g) => g,
                Err(e) => {
                    if replacing {
                        let _ = std::fs::remove_file(&target);
                    }
                    return Err(e);
                }
            };
            if replacing {
                std::fs::rename(&target, &image).with_context(|| {
                    format!("putting the new tree in place of {}", image.display())
                })?;
            }
            println!(
                "{}: Bε-tree of {} blocks of {} bytes, nodes {} KiB, basements {} KiB, fanout {}, log {} blocks",
                image.display(),
                bytes / bs as u64,
                bs,
                g.node_bytes >> 10,
                g.basement_bytes >> 10,
                g.fanout,
                g.log_blocks
            );
        }
        KvCommand::Put { image, key, value } => {
            let t = open(&image)?;
            t.put(key.as_bytes(), value.as_bytes())?;
            t.close()?;
        }
        KvCommand::Get { image, key } => {
            let t = open(&image)?;
            let v = t.get(key.as_bytes())?;
            t.close()?;
            match v {
                Some(v) => println!("{}", String::from_utf8_lossy(&v)),
                None => std::process::exit(1),
            }
        }
        KvCommand::Delete { image, key } => {
            let t = open(&image)?;
            t.delete(key.as_bytes())?;
            t.close()?;
        }
        KvCommand::DeleteRange { image, start, end } => {
            let t = open(&image)?;
            t.delete_range(start.as_bytes(), end.as_bytes())?;
            t.close()?;
        }
        KvCommand::Scan {
            image,
            from,
            to,
            reverse,
            limit,
        } => {
            let t = open(&image)?;
            let it = if reverse {
                t.range_rev(from.as_bytes(), to.as_deref().map(str::as_bytes))
            } else {
                t.range(from.as_bytes(), to.as_deref().map(str::as_bytes))
            };
            let it = match limit {
                Some(n) => it.limit(n),
                None => it,
            };
            for e in it {
                let (k, v) = e?;
                println!(
                    "{}\t{}",
                    String::from_utf8_lossy(&k),
                    String::from_utf8_lossy(&v)
                );
            }
            t.close()?;
        }
    }
    Ok(())
}

/// The tree's counters, for `quiltfs stats` on a tree image (`None`: not a tree image).
pub fn stats_json(image: &Path) -> Result<Option<serde_json::Value>> {
    let Ok(dev) = open_dev(image) else {
        return Ok(None);
    };
    // Through a copy-on-write view: opening replays the log and closing checkpoints,
    // and a summary must leave the image as it found it (in its format versions too).
    let view: Arc<dyn BlockDevice> = Arc::new(quilt_block::OverlayDevice::new(dev));
    let t = quilt_stack::tree(view, Options::default())
        .with_context(|| format!("opening the tree on {}", image.display()))?;
    let g = t.geometry();
    let versions = t.format_versions();
    let mut v = serde_json::to_value(t.stats())?;
    if let Some(m) = v.as_object_mut() {
        m.insert("node_size".into(), g.node_bytes.into());
        m.insert("basement_size".into(), g.basement_bytes.into());
        m.insert("fanout".into(), g.fanout.into());
        m.insert("format.tree_header_version".into(), versions.header.into());
        m.insert(
            "format.node_version_written".into(),
            versions.node_written.into(),
        );
    }
    t.close()?;
    Ok(Some(v))
}
