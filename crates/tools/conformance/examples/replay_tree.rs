//! Copies a directory tree into a fresh in-memory ext2 through the native API, the way
//! `tar x` drives a mount (create, write in 10 KiB pieces, chown, chmod, set times), and
//! prints the time and the engine's counters. For profiling the file system without FUSE.
//!   cargo run --release -p quilt-conformance --example replay_tree -- SRC_DIR [soft-updates|async]
//!       [both|hard|merge|none]   (the patch optimizations on)

use quilt_block::MemDevice;
use quilt_ext2::{Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::EngineOptions;
use quilt_vfs::{Ctx, FileSystem, SetAttr, TimeOrNow, Timespec};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

fn copy(fs: &Ext2, dir: u64, src: &Path, ctx: &Ctx, files: &mut u64) {
    for e in std::fs::read_dir(src).expect("read_dir") {
        let e = e.expect("entry");
        let md = e.metadata().expect("metadata");
        let name = e.file_name();
        let name = name.as_encoded_bytes();
        let perm = md.permissions().mode() & 0o7777;
        let ino = if md.is_dir() {
            let a = fs.mkdir(dir, name, 0o700, ctx).expect("mkdir");
            copy(fs, a.ino, &e.path(), ctx, files);
            a.ino
        } else if md.file_type().is_symlink() {
            let t = std::fs::read_link(e.path()).expect("readlink");
            fs.symlink(dir, name, t.as_os_str().as_encoded_bytes(), ctx)
                .expect("symlink")
                .ino
        } else {
            let a = fs
                .mknod(dir, name, libc::S_IFREG | 0o600, 0, ctx)
                .expect("create");
            let data = std::fs::read(e.path()).expect("read");
            for (i, c) in data.chunks(10240).enumerate() {
                fs.write(a.ino, i as u64 * 10240, c, ctx).expect("write");
            }
            *files += 1;
            a.ino
        };
        let own = SetAttr {
            uid: Some(md.uid()),
            gid: Some(md.gid()),
            ..SetAttr::default()
        };
        fs.setattr(ino, own, ctx).expect("chown");
        let mode = SetAttr {
            mode: Some(perm),
            ..SetAttr::default()
        };
        fs.setattr(ino, mode, ctx).expect("chmod");
        let t = TimeOrNow::At(Timespec {
            sec: md.mtime(),
            nsec: 0,
        });
        let times = SetAttr {
            atime: Some(t),
            mtime: Some(t),
            ..SetAttr::default()
        };
        fs.setattr(ino, times, ctx).expect("utimes");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let src = Path::new(args.get(1).expect("usage: replay_tree SRC_DIR [mode]"));
    let mode = match args.get(2).map(String::as_str) {
        Some("async") => Mode::Async,
        _ => Mode::SoftUpdates,
    };
    let dev = Arc::new(MemDevice::new(4096, 1 << 20).expect("device"));
    let optimizations = args.get(3).map(String::as_str).unwrap_or("both");
    let opts = || EngineOptions {
        hard_patches: matches!(optimizations, "both" | "hard"),
        overlap_merge: matches!(optimizations, "both" | "merge"),
        cache_bytes_max: 128 << 20,
        flush_interval_ms: Some(1000),
        ..Default::default()
    };
    quilt_stack::mkfs_ext2(dev.clone(), opts(), &MkfsOptions::default()).expect("mkfs");
    let fs = quilt_stack::ext2(
        dev.clone(),
        quilt_stack::Ext2Spec {
            engine: opts(),
            mount: MountOptions {
                mode,
                read_only: false,
                ..Default::default()
            },
            flusher: None,
        },
    )
    .expect("mount");
    let ctx = Ctx::root();
    let t0 = Instant::now();
    let mut files = 0;
    let root = fs.root();
    copy(&fs, root, src, &ctx, &mut files);
    fs.sync_all().expect("sync");
    let dt = t0.elapsed();
    println!("{files} files in {dt:.2?}");
    for (k, v) in fs.counters() {
        println!("{k} {v}");
    }
}
