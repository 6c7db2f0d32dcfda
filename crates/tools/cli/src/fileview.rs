//! `quiltfs file-view`: an image or a replicated volume mounted through FUSE as a
//! directory holding one file, whose bytes are the volume's; `losetup` on that file
//! gives the kernel a block device, for its own ext4 or any other file system.

use anyhow::{Context, Result};
use clap::Args;
use quilt_vfs::FileSystem;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct FileViewArgs {
    /// An image file or block device, or a volume address (gnothi://…).
    pub image: PathBuf,
    /// Where the directory holding the file appears (it must exist).
    pub mountpoint: PathBuf,
    /// The file's name. Default: the volume's name, or the image file's name.
    #[arg(long)]
    pub name: Option<String>,
    #[arg(long)]
    pub read_only: bool,
    /// Block size an image file is opened with (a volume has its own).
    #[arg(long, default_value_t = 4096)]
    pub block_size: usize,
}

pub fn run(a: FileViewArgs) -> Result<()> {
    let (dev, name) =
        crate::nbd::open_whole(&a.image, a.name.as_deref(), a.block_size, a.read_only)?;
    let text = a.image.to_string_lossy().to_string();
    // SAFETY: getuid and getgid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let fs = Arc::new(
        quilt_volfile::VolumeFile::new(dev.dev, &name, a.read_only, uid, gid)
            .map_err(|e| anyhow::anyhow!("--name {name:?}: {e}"))?,
    );
    let opts = quilt_fuse::FuseOptions {
        fs_name: format!("quiltfs-file:{}", a.image.display()),
        read_only: a.read_only,
        // The loop driver's worker reaches the file as the kernel, not as this user.
        allow_other: uid == 0,
        ..quilt_fuse::FuseOptions::default()
    };
    crate::mount::watch_signals(a.mountpoint.clone());
    let file = a.mountpoint.join(&name);
    let shown = a.mountpoint.display().to_string();
    let at_end = fs.clone();
    let r = quilt_fuse::serve(
        fs.clone(),
        &a.mountpoint,
        &opts,
        move |_| {
            eprintln!(
                "quiltfs: {} is {}; unmount with umount {}",
                file.display(),
                text,
                shown
            )
        },
        Box::new(move || {
            if let Err(e) = at_end.sync_all() {
                eprintln!("quiltfs: the final flush failed: {e}");
            }
        }),
    );
    let _locks = dev.locks;
    r.context("serving the file view")
}
