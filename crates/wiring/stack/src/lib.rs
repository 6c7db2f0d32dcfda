//! quilt-stack: the one place where stacks are built.
//!
//! A stack is a device (an image file, memory, or one built elsewhere such as a
//! replicated volume), the layers stacked on it bottom to top (a rotating-disk model, a
//! recording of every request, a copy-on-write overlay), the patch engine with its
//! settings, and a module: ext2 (which may keep its journal on a device of its own),
//! betrfs, or a bare Bε-tree. The CLI, the crash explorer, the betrfs benchmark's native
//! runs, fuzzing and the conformance tests describe what they want and call this crate,
//! so a new kind of device is added in one place: a [`Source`] or a [`Layer`]. ext2 says where its
//! journal is and when it starts; this crate says what runs it ([`JbdJournals`]).
//!
//! This crate decides nothing a module owns: each module says what engine it wants
//! (`quilt_betree::engine_options`, `quilt_betrfs::engine_for`); the wiring builds it.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use quilt_block::{
    BlockDevice, BlockError, Clock, DiskModel, DiskParams, FileDevice, FileDeviceOptions,
    ImageLock, MemDevice, OverlayDevice, RecordingDevice,
};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::FsError;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where a stack's blocks live.
#[non_exhaustive]
pub enum Source {
    /// An image file or a block device.
    Image(ImageSpec),
    /// Zeroed memory (tests, the demo, fuzzing).
    Memory { block_size: usize, blocks: u64 },
    /// Memory holding `bytes` (a saved image).
    Bytes { block_size: usize, bytes: Vec<u8> },
    /// A device built elsewhere, taken as it is.
    Given(Arc<dyn BlockDevice>),
    /// A replicated volume: `gnothi://HOST:PORT,…/VOLUME[?secret-file=PATH]`.
    Volume(String),
}

/// An image file or block device to open.
#[derive(Debug, Clone)]
pub struct ImageSpec {
    pub path: PathBuf,
    pub block_size: usize,
    pub read_only: bool,
    /// Take the image's lock (one writer, or readers only).
    pub lock: bool,
    /// Create the file with this many bytes if it does not exist.
    pub create_bytes: Option<u64>,
}

impl ImageSpec {
    /// Opened read-write (or read-only), locked.
    pub fn new(path: impl Into<PathBuf>, block_size: usize, read_only: bool) -> ImageSpec {
        ImageSpec {
            path: path.into(),
            block_size,
            read_only,
            lock: true,
            create_bytes: None,
        }
    }
}

/// A device stacked over the one below it.
#[non_exhaustive]
#[derive(Clone)]
pub enum Layer {
    /// A rotating disk's timing (`DiskModel`); `host_flush: false` stops flushes at the
    /// model (benchmarks that time the model, not the host).
    Disk {
        params: DiskParams,
        /// Virtual time (requests only advance a counter: the crash explorer, tests)
        /// instead of real time (requests sleep until their modelled completion).
        virtual_time: bool,
        host_flush: bool,
    },
    /// Every request recorded (the crash explorer), up to `limit_bytes` of writes.
    Recording { limit_bytes: u64 },
    /// Writes kept in memory, reads falling through (read-only views that replay logs).
    Overlay,
}

/// A device as described: the source and its layers.
pub struct DeviceSpec {
    pub source: Source,
    /// Bottom to top.
    pub layers: Vec<Layer>,
}

impl DeviceSpec {
    /// An image file or block device, or a replicated volume when the path is a
    /// volume address (`gnothi://…`): every command that takes an image takes one.
    pub fn image(spec: ImageSpec) -> DeviceSpec {
        let source = match spec.path.to_str() {
            Some(a) if quilt_gnothi::device::VolumeAddress::is_address(a) => {
                Source::Volume(a.to_string())
            }
            _ => Source::Image(spec),
        };
        DeviceSpec {
            source,
            layers: Vec::new(),
        }
    }
    pub fn memory(block_size: usize, blocks: u64) -> DeviceSpec {
        DeviceSpec {
            source: Source::Memory { block_size, blocks },
            layers: Vec::new(),
        }
    }
    pub fn given(dev: Arc<dyn BlockDevice>) -> DeviceSpec {
        DeviceSpec {
            source: Source::Given(dev),
            layers: Vec::new(),
        }
    }
    pub fn with(mut self, layer: Layer) -> DeviceSpec {
        self.layers.push(layer);
        self
    }
}

/// A device built, with the handles a server keeps to let go of at unmount, and the
/// layers a caller may want to look into (a recording's log).
pub struct Device {
    pub dev: Arc<dyn BlockDevice>,
    pub locks: Vec<ImageLock>,
    /// The recording layer, if one was asked for (the top-most).
    pub recording: Option<Arc<RecordingDevice>>,
}

/// Builds the device `spec` describes.
pub fn device(spec: DeviceSpec) -> Result<Device, BlockError> {
    let mut locks = Vec::new();
    let mut dev: Arc<dyn BlockDevice> = match spec.source {
        Source::Image(i) => {
            let opts = FileDeviceOptions {
                block_size: i.block_size,
                read_only: i.read_only,
                lock: i.lock,
                ..Default::default()
            };
            let f = match i.create_bytes {
                Some(bytes) if !i.path.exists() => {
                    FileDevice::create(&i.path, bytes / i.block_size as u64, opts)?
                }
                _ => FileDevice::open(&i.path, opts)?,
            };
            locks.extend(f.image_lock());
            Arc::new(f)
        }
        Source::Memory { block_size, blocks } => Arc::new(MemDevice::new(block_size, blocks)?),
        Source::Bytes { block_size, bytes } => Arc::new(MemDevice::from_bytes(block_size, &bytes)?),
        Source::Given(d) => d,
        Source::Volume(address) => {
            Arc::new(quilt_gnothi::device::ReplicatedDevice::connect(&address)?)
        }
    };
    let mut recording = None;
    for layer in spec.layers {
        dev = match layer {
            Layer::Disk {
                params,
                virtual_time,
                host_flush,
            } => {
                let clock = if virtual_time {
                    Clock::virtual_at(0)
                } else {
                    Clock::real()
                };
                let m = DiskModel::new(dev, params, clock)?;
                Arc::new(if host_flush {
                    m
                } else {
                    m.without_host_flush()
                })
            }
            Layer::Recording { limit_bytes } => {
                let r = Arc::new(RecordingDevice::new(dev, limit_bytes));
                recording = Some(r.clone());
                r
            }
            Layer::Overlay => Arc::new(OverlayDevice::new(dev)),
        };
    }
    Ok(Device {
        dev,
        locks,
        recording,
    })
}

/// A bare patch engine on `dev`, with no module above it (the engine demo, which drives
/// it with a synthetic workload).
pub fn engine(dev: Arc<dyn BlockDevice>, opts: EngineOptions) -> Engine {
    Engine::new(dev, opts)
}

/// ext2 as a stack wants it: the engine's settings, the module's, and whether a
/// background flusher runs.
#[derive(Clone, Default)]
pub struct Ext2Spec {
    pub engine: EngineOptions,
    pub mount: quilt_ext2::MountOptions,
    /// Background write-back every so often (a mount's `flush_interval_ms`).
    pub flusher: Option<Duration>,
}

impl Ext2Spec {
    /// The engine's defaults, no flusher, and these mount options.
    pub fn mount(mount: quilt_ext2::MountOptions) -> Ext2Spec {
        Ext2Spec {
            mount,
            ..Ext2Spec::default()
        }
    }
}

/// The journal ext3 images get: `quilt_journal`'s JBD2 recovery and writer, on the
/// device ext2 says holds the journal.
pub struct JbdJournals;

impl quilt_ext2::JournalStarter for JbdJournals {
    fn recover(
        &self,
        home: &dyn BlockDevice,
        place: &quilt_ext2::JournalPlace,
    ) -> Result<quilt_journal::RecoveryReport, quilt_journal::JournalError> {
        quilt_journal::recover_on(home, place.dev.as_ref(), &place.map)
    }

    fn start(
        &self,
        engine: &Engine,
        req: quilt_ext2::JournalRequest,
    ) -> Result<Arc<dyn quilt_patch::Transactions>, quilt_journal::JournalError> {
        let j = quilt_journal::Journal::start_on(
            engine.clone(),
            req.place.dev,
            req.place.map,
            req.options,
        )?;
        Ok(Arc::new(j))
    }
}

/// The journal starter for ext2's mount options.
pub fn journals() -> quilt_ext2::Journals {
    quilt_ext2::Journals(Arc::new(JbdJournals))
}

/// Mounts ext2 on `dev`; its journal (if the image has one) is `quilt_journal`'s
/// unless the spec's mount options name another starter.
pub fn ext2(dev: Arc<dyn BlockDevice>, mut spec: Ext2Spec) -> Result<quilt_ext2::Ext2, FsError> {
    spec.mount.journal.get_or_insert_with(journals);
    let fs = quilt_ext2::Ext2::open(Engine::new(dev, spec.engine), spec.mount)?;
    if let Some(every) = spec.flusher {
        fs.engine().start_flusher(every);
    }
    Ok(fs)
}

/// Makes ext2 (or ext3) on `dev`; returns the engine it wrote through, flushed, for a
/// caller that adds to it (a journal) before mounting.
pub fn mkfs_ext2(
    dev: Arc<dyn BlockDevice>,
    engine: EngineOptions,
    opts: &quilt_ext2::MkfsOptions,
) -> Result<(Engine, quilt_ext2::format::Superblock), FsError> {
    let engine = Engine::new(dev, engine);
    let sb = quilt_ext2::mkfs(&engine, opts)?;
    Ok((engine, sb))
}

/// Adds an ext3 journal of `blocks` blocks (`skip`: its commits prefer log skipping) to
/// the unmounted ext2 file system `engine` writes to, as `tune2fs -j` (a fresh one from
/// [`mkfs_ext2`]), and unmounts it again.
pub fn add_journal(engine: Engine, blocks: u32, skip: bool) -> Result<(), FsError> {
    let fs = quilt_ext2::Ext2::open(engine, quilt_ext2::MountOptions::default())?;
    fs.create_journal_for(blocks, skip)?;
    fs.unmount()
}

/// Mounts betrfs on `dev`, on the engine betrfs asks for.
pub fn betrfs(
    dev: Arc<dyn BlockDevice>,
    opts: quilt_betrfs::MountOptions,
) -> Result<quilt_betrfs::Betrfs, FsError> {
    quilt_betrfs::Betrfs::open_on(quilt_betrfs::engine_for(dev), opts)
}

/// Makes betrfs on `dev`.
pub fn mkfs_betrfs(dev: Arc<dyn BlockDevice>) -> Result<(), FsError> {
    quilt_betrfs::mkfs_on(quilt_betrfs::engine_for(dev))
}

/// Opens the Bε-tree on `dev` (a key-value store), on the engine it asks for.
pub fn tree(
    dev: Arc<dyn BlockDevice>,
    opts: quilt_betree::Options,
) -> Result<quilt_betree::Tree, quilt_betree::Error> {
    let engine = Engine::new(
        dev.clone(),
        quilt_betree::engine_options(dev.block_size(), &opts),
    );
    quilt_betree::Tree::open_on(engine, opts)
}

/// Makes a new, empty Bε-tree on `dev` and opens it.
pub fn create_tree(
    dev: Arc<dyn BlockDevice>,
    opts: quilt_betree::Options,
) -> Result<quilt_betree::Tree, quilt_betree::Error> {
    let engine = Engine::new(
        dev.clone(),
        quilt_betree::engine_options(dev.block_size(), &opts),
    );
    quilt_betree::Tree::create_on(engine, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_vfs::{Ctx, FileSystem};

    #[test]
    fn every_module_on_every_layer_mounts_and_keeps_its_data() {
        for layers in [
            vec![],
            vec![Layer::Recording {
                limit_bytes: 1 << 30,
            }],
            vec![Layer::Disk {
                params: DiskParams::desktop_7200(),
                virtual_time: true,
                host_flush: true,
            }],
        ] {
            // ext2
            let d = device(DeviceSpec {
                source: Source::Memory {
                    block_size: 4096,
                    blocks: 8192,
                },
                layers: layers.clone(),
            })
            .unwrap();
            let (engine, _) =
                mkfs_ext2(d.dev.clone(), EngineOptions::default(), &Default::default()).unwrap();
            drop(engine);
            let fs = ext2(d.dev.clone(), Ext2Spec::default()).unwrap();
            let root = fs.root();
            let f = fs
                .mknod(root, b"a", libc::S_IFREG | 0o644, 0, &Ctx::root())
                .unwrap();
            fs.write(f.ino, 0, b"hello", &Ctx::root()).unwrap();
            fs.unmount().unwrap();
            let fs = ext2(d.dev.clone(), Ext2Spec::default()).unwrap();
            let a = fs.lookup(root, b"a").unwrap();
            assert_eq!(fs.read(a.ino, 0, 16).unwrap(), b"hello");
            fs.unmount().unwrap();
            if layers.iter().any(|l| matches!(l, Layer::Recording { .. })) {
                assert!(d.recording.unwrap().log().writes() > 0);
            }
            // betrfs
            let d = device(DeviceSpec {
                source: Source::Memory {
                    block_size: 4096,
                    blocks: 16384,
                },
                layers,
            })
            .unwrap();
            mkfs_betrfs(d.dev.clone()).unwrap();
            let fs = betrfs(d.dev.clone(), Default::default()).unwrap();
            let root = fs.root();
            let f = fs
                .mknod(root, b"b", libc::S_IFREG | 0o644, 0, &Ctx::root())
                .unwrap();
            fs.write(f.ino, 0, b"world", &Ctx::root()).unwrap();
            fs.unmount().unwrap();
            let fs = betrfs(d.dev.clone(), Default::default()).unwrap();
            let b = fs.lookup(root, b"b").unwrap();
            assert_eq!(fs.read(b.ino, 0, 16).unwrap(), b"world");
            fs.unmount().unwrap();
        }
    }

    #[test]
    fn a_tree_made_here_reopens_with_its_keys() {
        let d = device(DeviceSpec::memory(512, 16384)).unwrap();
        let t = create_tree(d.dev.clone(), quilt_betree::Options::tiny()).unwrap();
        t.put(b"k", b"v").unwrap();
        t.close().unwrap();
        let t = tree(d.dev.clone(), quilt_betree::Options::tiny()).unwrap();
        assert_eq!(t.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    }

    #[test]
    fn an_image_is_created_locked_and_refused_to_a_second_writer() {
        let dir = tempfile::tempdir().unwrap();
        let spec = ImageSpec {
            create_bytes: Some(4 << 20),
            ..ImageSpec::new(dir.path().join("i.img"), 4096, false)
        };
        let a = device(DeviceSpec::image(spec.clone())).unwrap();
        assert_eq!(a.dev.block_count(), 1024);
        assert_eq!(a.locks.len(), 1);
        assert!(matches!(
            device(DeviceSpec::image(spec)),
            Err(BlockError::Busy { .. })
        ));
    }
}
