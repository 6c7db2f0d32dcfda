//! ext2's own behaviour on the native API over memory: its block map, block sizes,
//! reserved blocks, size limits, statfs block counts, consistency modes and mount options.
//! The POSIX behaviour every module shares (one test per operation, with its error
//! cases) is tested against ext2 and betrfs alike in `crates/tools/conformance/tests/ops.rs`.

mod support;

use quilt_block::MemDevice;
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, SetAttr};
use std::sync::Arc;

const REG: u32 = libc::S_IFREG | 0o644;

fn fresh_with(blocks: u64, bs: usize, mode: Mode) -> (Arc<MemDevice>, Ext2) {
    let dev = Arc::new(MemDevice::new(bs, blocks).unwrap());
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    mkfs(
        &engine,
        &MkfsOptions {
            device_is_zeroed: true,
            ..Default::default()
        },
    )
    .unwrap();
    let fs = Ext2::open(
        engine,
        MountOptions {
            journal: support::journals(),
            mode,
            read_only: false,
            ..Default::default()
        },
    )
    .unwrap();
    (dev, fs)
}

fn fresh() -> Ext2 {
    fresh_with(8192, 4096, Mode::SoftUpdates).1
}

fn remount(dev: &MemDevice, fs: Ext2) -> (Arc<MemDevice>, Ext2) {
    fs.unmount().unwrap();
    let dev = Arc::new(MemDevice::from_bytes(dev.block_size(), &dev.to_vec()).unwrap());
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    let fs = Ext2::open(engine, support::options()).unwrap();
    (dev, fs)
}

fn c() -> Ctx {
    Ctx::root()
}

fn names(fs: &Ext2, dir: u64) -> Vec<String> {
    let mut v = Vec::new();
    fs.readdir(dir, 0, &mut |e| {
        v.push(String::from_utf8(e.name).unwrap());
        true
    })
    .unwrap();
    v.sort();
    v
}

fn size(n: u64) -> SetAttr {
    SetAttr {
        size: Some(n),
        ..Default::default()
    }
}

use quilt_block::BlockDevice;

#[test]
fn truncating_a_large_sparse_file_frees_its_indirect_blocks() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"big", REG, 0, &c()).unwrap().ino;
    // 4 KiB blocks: direct 48 KiB, single 4 MiB, double 4 GiB; past that is triple.
    let offs = [0u64, 50 << 10, 5 << 20, 3 << 30, (5u64 << 30) + 123];
    for (i, &o) in offs.iter().enumerate() {
        fs.write(f, o, format!("chunk{i}").as_bytes(), &c())
            .unwrap();
    }
    let free_before = fs.statfs().unwrap().blocks_free;
    fs.setattr(f, size(100), &c()).unwrap();
    assert!(
        fs.statfs().unwrap().blocks_free > free_before,
        "truncate frees indirect blocks"
    );
}

#[test]
fn enospc_uses_every_block_and_a_delete_returns_them() {
    // 2 MiB image: fill it, then delete. (That the failure is clean, ENOSPC with the
    // file intact across a remount, is the conformance suite's `enospc_is_clean`.)
    let (dev, fs) = fresh_with(512, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let f = fs.mknod(r, b"fill", REG, 0, &c()).unwrap().ino;
    let chunk = vec![0xabu8; 64 << 10];
    let mut off = 0u64;
    let err = loop {
        match fs.write(f, off, &chunk, &c()) {
            Ok(n) => off += n as u64,
            Err(e) => break e,
        }
    };
    assert_eq!(err, FsError::NoSpace);
    assert_eq!(fs.statfs().unwrap().blocks_free, 0);
    // Creating more inodes still works; their blocks do not.
    assert_eq!(fs.mkdir(r, b"d", 0o755, &c()), Err(FsError::NoSpace));
    let (_, fs) = remount(&dev, fs);
    fs.unlink(fs.root(), b"fill", &c()).unwrap();
    assert!(fs.statfs().unwrap().blocks_free > 400);
}

#[test]
fn state_survives_remount_in_both_modes_and_block_sizes() {
    // ext2's modes and block sizes; the conformance suite's `state_survives_remount` is
    // the same check for every module (ext2 in soft-updates mode with 4 KiB blocks).
    for (bs, mode) in [
        (1024, Mode::Async),
        (2048, Mode::SoftUpdates),
        (4096, Mode::Async),
    ] {
        let (dev, fs) = fresh_with(16384 * 4096 / bs as u64, bs, mode);
        let r = fs.root();
        let d = fs.mkdir(r, b"dir", 0o750, &c()).unwrap().ino;
        let f = fs.mknod(d, b"file", REG, 0, &c()).unwrap().ino;
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        fs.write(f, 0, &data, &c()).unwrap();
        let (_, fs) = remount(&dev, fs);
        let d = fs.lookup(fs.root(), b"dir").unwrap();
        assert_eq!((d.kind, d.perm), (FileType::Directory, 0o750));
        let f = fs.lookup(d.ino, b"file").unwrap();
        assert_eq!(fs.read(f.ino, 0, 400_000).unwrap(), data, "bs {bs}");
        assert_eq!(names(&fs, fs.root()), vec![".", "..", "dir", "lost+found"]);
    }
}

#[test]
fn read_only_mount_refuses_changes() {
    let (dev, fs) = fresh_with(4096, 4096, Mode::SoftUpdates);
    fs.unmount().unwrap();
    let engine = Engine::new(dev.clone(), EngineOptions::default());
    let fs = Ext2::open(
        engine,
        MountOptions {
            journal: support::journals(),
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        fs.mkdir(fs.root(), b"x", 0o755, &c()),
        Err(FsError::ReadOnly)
    );
    assert!(fs.lookup(fs.root(), b"lost+found").is_ok());
}

#[test]
fn maximum_file_size_is_the_kernels() {
    // The kernel's limit for a block-mapped file without huge_file: data plus map blocks
    // of a dense file within 2^32 - 1 sectors (tests/no-silent-loss.sh checks these
    // against the kernel's own driver on loop mounts). How writes and truncation behave
    // at the limit is the conformance suite's
    // `writes_and_truncation_stop_at_the_maximum_file_size` (with 4 KiB blocks).
    for (bs, max) in [(4096usize, 2_196_873_666_560u64), (1024, 17_247_252_480)] {
        let (_dev, fs) = fresh_with(4096, bs, Mode::SoftUpdates);
        let f = fs.mknod(fs.root(), b"f", REG, 0, &c()).unwrap().ino;
        // The last byte can be written, the next cannot; the same for truncation.
        assert_eq!(fs.write(f, max - 1, b"x", &c()), Ok(1), "bs {bs}");
        assert_eq!(
            fs.write(f, max, b"x", &c()),
            Err(FsError::TooBig),
            "bs {bs}"
        );
        assert_eq!(fs.setattr(f, size(max + 1), &c()), Err(FsError::TooBig));
        fs.setattr(f, size(0), &c()).unwrap();
        fs.setattr(f, size(max), &c()).unwrap();
        assert_eq!(fs.getattr(f).unwrap().size, max);
    }
}

#[test]
fn reserved_blocks_are_roots() {
    // mkfs reserves 5% (r_blocks_count) for root, as mke2fs does.
    let (_dev, fs) = fresh_with(2048, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let user = Ctx {
        uid: 1000,
        gid: 1000,
        ..Ctx::default()
    };
    let d = fs.mkdir(r, b"home", 0o777, &c()).unwrap().ino;
    let f = fs.mknod(d, b"u", REG, 0, &user).unwrap().ino;
    let chunk = vec![7u8; 64 << 10];
    let mut off = 0u64;
    let err = loop {
        match fs.write(f, off, &chunk, &user) {
            Ok(n) => off += n as u64,
            Err(e) => break e,
        }
    };
    assert_eq!(err, FsError::NoSpace);
    let st = fs.statfs().unwrap();
    assert!(st.blocks_free > 0, "the reserve is left");
    assert_eq!(st.blocks_avail, 0, "and not available to users");
    assert_eq!(fs.getattr(f).unwrap().size, off);
    // Root still writes into the reserve.
    let g = fs.mknod(r, b"root", REG, 0, &c()).unwrap().ino;
    assert_eq!(fs.write(g, 0, &chunk, &c()), Ok(chunk.len() as u32));
}

#[test]
fn fallocate_frees_and_allocates_whole_blocks_of_the_map() {
    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    let (_dev, fs) = fresh_with(8192, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    fs.write(f, 0, &vec![7u8; 1100 * 4096], &c()).unwrap();
    let before = fs.getattr(f).unwrap().blocks;
    // The whole single-indirect range: 1024 data blocks and the indirect block go.
    fs.fallocate(f, 12 * 4096, 1024 * 4096, PUNCH | KEEP, &c())
        .unwrap();
    assert_eq!(before - fs.getattr(f).unwrap().blocks, 1025 * 8);
    let p = fs.mknod(r, b"p", REG, 0, &c()).unwrap().ino;
    fs.fallocate(p, 0, 10 * 4096 + 1, 0, &c()).unwrap();
    assert_eq!(
        fs.fallocate(p, 10 * 4096, 8 * 4096, KEEP, &c()),
        Err(FsError::NotSupported),
        "no blocks past the size on ext2"
    );
    // No room: all or nothing, the call gives back what it took before it answers.
    let big = fs.mknod(r, b"big", REG, 0, &c()).unwrap().ino;
    let free = fs.statfs().unwrap().blocks_free;
    assert_eq!(
        fs.fallocate(big, 0, 64 << 20, 0, &c()),
        Err(FsError::NoSpace)
    );
    let a = fs.getattr(big).unwrap();
    assert_eq!((a.size, a.blocks), (0, 0), "{a:?}");
    assert_eq!(fs.statfs().unwrap().blocks_free, free);
}
