//! The native API: the suite's random writes and TokuBench through the module's library
//! calls (`quilt_vfs::FileSystem`), with no FUSE and no kernel between, on the same kind
//! of image: what the file system costs without the transport. quiltfs's modules only.
//! Each phase ends durable: the module's unmount (a checkpoint, the last write-back).

use super::workloads::{toku_path, Ctx};
use super::Sample;
use crate::systems::{Disk, Kind, QuiltFs, CACHE_MIB};
use anyhow::{bail, Context, Result};
use quilt_vfs::{FileSystem, FsError, Ino};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A module opened on the image, with what unmounting it takes.
struct Native {
    fs: Arc<dyn FileSystem>,
    close: Box<dyn Fn() -> Result<()>>,
}

fn open(ctx: &Ctx, d: &Disk) -> Result<Native> {
    let Kind::Quilt { fs, .. } = ctx.sys.kind else {
        bail!("{} has no native API", ctx.sys.name);
    };
    let bs = block_size(&d.image, fs)?;
    let dev = quilt_stack::device(quilt_stack::DeviceSpec::image(quilt_stack::ImageSpec::new(
        &d.image, bs, false,
    )))
    .with_context(|| format!("opening {}", d.image.display()))?
    .dev;
    match fs {
        QuiltFs::Betrfs => {
            let f = Arc::new(
                quilt_stack::betrfs(dev, quilt_betrfs::MountOptions::default())
                    .context("opening betrfs natively")?,
            );
            let g = f.clone();
            Ok(Native {
                fs: f,
                close: Box::new(move || g.unmount().map_err(|e| anyhow::anyhow!("{e}"))),
            })
        }
        QuiltFs::Ext2 => {
            let f = Arc::new(
                quilt_stack::ext2(
                    dev,
                    quilt_stack::Ext2Spec {
                        engine: quilt_patch::EngineOptions {
                            cache_bytes_max: (CACHE_MIB as usize) << 20,
                            flush_interval_ms: Some(1000),
                            ..Default::default()
                        },
                        mount: quilt_ext2::MountOptions::default(),
                        flusher: Some(std::time::Duration::from_millis(1000)),
                    },
                )
                .context("opening the ext2 module natively")?,
            );
            let g = f.clone();
            Ok(Native {
                fs: f,
                close: Box::new(move || {
                    // (The flusher thread holds the engine, and with it the image.)
                    g.engine().stop_flusher();
                    g.unmount().map_err(|e| anyhow::anyhow!("{e}"))
                }),
            })
        }
    }
}

/// The image's block size: from the tree's header, or ext2's superblock.
fn block_size(image: &std::path::Path, fs: QuiltFs) -> Result<usize> {
    let mut head = vec![0u8; 128 << 10];
    let n = std::io::Read::read(&mut std::fs::File::open(image)?, &mut head)?;
    head.truncate(n);
    match fs {
        QuiltFs::Betrfs => quilt_betree::probe_block_size(&head)
            .with_context(|| format!("{} holds no Bε-tree", image.display())),
        QuiltFs::Ext2 => {
            let log = head
                .get(1024 + 24..1024 + 28)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .filter(|&l| l <= 6)
                .with_context(|| format!("{} holds no ext2 superblock", image.display()))?;
            Ok(1024 << log)
        }
    }
}

fn err(e: FsError) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// CPU seconds this process has used.
fn cpu() -> f64 {
    // SAFETY: rusage is plain data that getrusage fills in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

fn sample(
    ctx: &Ctx,
    w: &'static str,
    value: f64,
    unit: &'static str,
    wall: f64,
    cpu_s: f64,
) -> Sample {
    Sample {
        system: ctx.sys.name,
        workload: w,
        param: String::new(),
        run: ctx.run,
        value,
        unit,
        wall_s: wall,
        client_cpu_s: 0.0,
        fs_cpu_s: cpu_s,
        device_write_mb: 0.0,
        requests: None,
    }
}

/// The native phases on the group's image: its samples.
pub fn run(ctx: &Ctx, d: &Disk) -> Result<Vec<Sample>> {
    let c = quilt_vfs::Ctx::root();
    let bytes = ctx.scale.seq_bytes;
    let mut out = Vec::new();
    // The file the random writes go to, written outside the timing.
    {
        let n = open(ctx, d)?;
        let f =
            n.fs.mknod(n.fs.root(), b"big", libc::S_IFREG | 0o644, 0, &c)
                .map_err(err)?
                .ino;
        let mut buf = vec![0u8; 1 << 20];
        let mut done = 0u64;
        while done < bytes {
            buf[..8].copy_from_slice(&done.to_le_bytes());
            let k = (bytes - done).min(buf.len() as u64) as usize;
            n.fs.write(f, done, &buf[..k], &c).map_err(err)?;
            done += k as u64;
        }
        (n.close)()?;
    }
    crate::drop_caches()?;
    // Random 4-byte writes, then fsync and the unmount.
    {
        let n = open(ctx, d)?;
        let writes = ctx.scale.rand_writes;
        let c0 = cpu();
        let t = Instant::now();
        // (As open(2) would: a program knows its file by name.)
        let ino = n.fs.lookup(n.fs.root(), b"big").map_err(err)?.ino;
        let mut x = 0x2545_f491_4f6c_dd1d ^ ctx.run as u64;
        for i in 0..writes {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            n.fs.write(ino, x % (bytes - 4), &(i as u32).to_le_bytes(), &c)
                .map_err(err)?;
        }
        n.fs.fsync(ino, false).map_err(err)?;
        (n.close)()?;
        let wall = t.elapsed().as_secs_f64();
        out.push(sample(
            ctx,
            "randwrite-native",
            writes as f64 / wall,
            "writes/s",
            wall,
            cpu() - c0,
        ));
    }
    // TokuBench by 1 and 4 threads, each into its own tree, then the unmount.
    for (w, threads) in [("toku1-native", 1usize), ("toku4-native", 4)] {
        let n = open(ctx, d)?;
        let files = ctx.scale.toku_files;
        let c0 = cpu();
        let t = Instant::now();
        let root =
            n.fs.mkdir(n.fs.root(), w.as_bytes(), 0o755, &c)
                .map_err(err)?
                .ino;
        toku(n.fs.as_ref(), root, files, threads)?;
        n.fs.sync_all().map_err(err)?;
        (n.close)()?;
        let wall = t.elapsed().as_secs_f64();
        out.push(sample(
            ctx,
            w,
            files as f64 / wall,
            "files/s",
            wall,
            cpu() - c0,
        ));
    }
    Ok(out)
}

/// A directory under `parent`, made if missing (threads share the upper levels).
fn dir(fs: &dyn FileSystem, parent: Ino, name: &str) -> Result<Ino> {
    let c = quilt_vfs::Ctx::root();
    match fs.mkdir(parent, name.as_bytes(), 0o755, &c) {
        Ok(a) => Ok(a.ino),
        Err(FsError::Exists) => Ok(fs.lookup(parent, name.as_bytes()).map_err(err)?.ino),
        Err(e) => Err(err(e)),
    }
}

fn toku(fs: &dyn FileSystem, root: Ino, n: usize, threads: usize) -> Result<()> {
    let per = n.div_ceil(threads);
    let data = [b'x'; 200];
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    let c = quilt_vfs::Ctx::root();
                    let mut dirs: HashMap<String, Ino> = HashMap::new();
                    for i in t * per..((t + 1) * per).min(n) {
                        let (path, name) = toku_path(i);
                        let d = match dirs.get(&path) {
                            Some(&d) => d,
                            None => {
                                let (a, b) = path.split_once('/').expect("two levels");
                                let top = dir(fs, root, a)?;
                                let d = dir(fs, top, b)?;
                                dirs.insert(path.clone(), d);
                                d
                            }
                        };
                        let f = fs
                            .mknod(d, name.as_bytes(), libc::S_IFREG | 0o644, 0, &c)
                            .map_err(err)?
                            .ino;
                        fs.write(f, 0, &data, &c).map_err(err)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("a TokuBench thread panicked"))??;
        }
        Ok(())
    })
}
