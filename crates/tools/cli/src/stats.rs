//! `quiltfs stats`: the counters of a mounted file system (from its server), or a
//! summary of an unmounted image.

use crate::image::{open_fs, OpenSettings};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct StatsArgs {
    /// A quiltfs mount point, or an image file.
    pub target: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: StatsArgs) -> Result<()> {
    let v = if a.target.is_dir() {
        crate::mount::query_stats(&a.target)?
    } else if let crate::betrfs::Format::Tree(bs) = crate::betrfs::detect(&a.target)? {
        let opts = quilt_betrfs::MountOptions {
            read_only: true,
            commit_interval: None,
            ..Default::default()
        };
        match crate::betrfs::open(&a.target, bs, opts, &mut Vec::new()) {
            Ok(fs) => {
                let mut v = crate::mount::stats_json(&fs);
                if let Some(m) = v.as_object_mut() {
                    m.insert("format".into(), "betrfs".into());
                }
                v
            }
            // A tree without betrfs's superblock record: a key-value store.
            // Only that refusal: any other (a layout no release reads, say) is the
            // answer, and the image is not opened again as something else.
            Err(e)
                if matches!(
                    e.downcast_ref(),
                    Some(quilt_vfs::FsError::Invalid(m)) if *m == quilt_betrfs::NOT_BETRFS
                ) =>
            {
                crate::kv::stats_json(&a.target)?.unwrap_or_default()
            }
            Err(e) => return Err(e),
        }
    } else {
        let fs = open_fs(
            &a.target,
            &OpenSettings {
                read_only: true,
                flush_interval_ms: None,
                ..Default::default()
            },
            &mut Vec::new(),
        )?;
        crate::mount::stats_json(&fs)
    };
    let v = with_feature_names(v);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if let serde_json::Value::Object(m) = v {
        let w = m.keys().map(|k| k.len()).max().unwrap_or(0);
        for (k, v) in m {
            println!("{k:<w$}  {v}");
        }
    }
    Ok(())
}

/// An ext2 image's feature masks also as e2fsprogs's names (`format.features`).
fn with_feature_names(mut v: serde_json::Value) -> serde_json::Value {
    let Some(m) = v.as_object_mut() else {
        return v;
    };
    let mask = |k: &str| m.get(k).and_then(|x| x.as_u64()).map(|x| x as u32);
    if let (Some(c), Some(i), Some(r)) = (
        mask("format.feature_compat"),
        mask("format.feature_incompat"),
        mask("format.feature_ro_compat"),
    ) {
        let names = quilt_ext2::format::feature_names(c, i, r).join(",");
        m.insert("format.features".into(), names.into());
    }
    v
}
