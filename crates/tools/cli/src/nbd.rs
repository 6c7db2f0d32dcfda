//! `quiltfs nbd`: an image or a replicated volume exported over the NBD protocol, for
//! qemu, nbdcopy, nbd-client (where the kernel has the nbd driver) and fio.

use anyhow::{Context, Result};
use clap::Args;
use quilt_stack::{DeviceSpec, ImageSpec};
use std::path::PathBuf;

#[derive(Args)]
pub struct NbdArgs {
    /// An image file or block device, or a volume address (gnothi://…).
    pub image: PathBuf,
    /// Where to listen (NBD's port is 10809).
    #[arg(long, default_value = "127.0.0.1:10809")]
    pub listen: String,
    /// The export's name (clients may also ask for the default, empty, name). Default:
    /// the volume's name, or the image file's name.
    #[arg(long)]
    pub name: Option<String>,
    /// Refuse writes.
    #[arg(long)]
    pub read_only: bool,
    /// Block size an image file is opened with (a volume has its own).
    #[arg(long, default_value_t = 4096)]
    pub block_size: usize,
}

/// Opens an image or a volume whole, as a device, with the name it is shown by: `name`,
/// else the volume's name, else the image file's (else `volume`).
pub(crate) fn open_whole(
    image: &std::path::Path,
    name: Option<&str>,
    block_size: usize,
    read_only: bool,
) -> Result<(quilt_stack::Device, String)> {
    let text = image.to_string_lossy().to_string();
    let name = match (name, quilt_gnothi::device::VolumeAddress::parse(&text)) {
        (Some(n), _) => n.to_string(),
        (None, Ok(v)) => v.volume,
        (None, Err(_)) => image
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "volume".into()),
    };
    let dev = quilt_stack::device(DeviceSpec::image(ImageSpec::new(
        image, block_size, read_only,
    )))
    .with_context(|| format!("cannot open {}", image.display()))?;
    Ok((dev, name))
}

pub fn run(a: NbdArgs) -> Result<()> {
    let (dev, name) = open_whole(&a.image, a.name.as_deref(), a.block_size, a.read_only)?;
    let export = quilt_nbd::Export::new(name.clone(), dev.dev, a.read_only);
    let size = export.size();
    let server = quilt_nbd::Server::bind(&a.listen, export)
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let at = server.local_addr()?;
    eprintln!(
        "quiltfs: exporting {} ({} MiB{}) over NBD as nbd://{at}/{name}",
        a.image.display(),
        size >> 20,
        if a.read_only { ", read-only" } else { "" }
    );
    // The image's lock (dev.locks) is held for as long as this runs.
    let _locks = dev.locks;
    server.serve().context("the NBD listener failed")
}
