//! One test per operation, with its error cases, on the native API over memory.

use quilt_block::MemDevice;
use quilt_ext2::{mkfs, Ext2, MkfsOptions, Mode, MountOptions};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, RenameFlags, SetAttr, XattrFlags};
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
    let fs = Ext2::open(engine, MountOptions::default()).unwrap();
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

use quilt_block::BlockDevice;

#[test]
fn create_lookup_and_errors() {
    let fs = fresh();
    let r = fs.root();
    let a = fs.mknod(r, b"a", REG, 0, &c()).unwrap();
    assert_eq!(a.kind, FileType::Regular);
    assert_eq!(fs.lookup(r, b"a").unwrap().ino, a.ino);
    assert_eq!(fs.mknod(r, b"a", REG, 0, &c()), Err(FsError::Exists));
    assert_eq!(fs.lookup(r, b"zz"), Err(FsError::NotFound));
    assert_eq!(fs.lookup(a.ino, b"x"), Err(FsError::NotDir));
    assert_eq!(fs.mknod(a.ino, b"x", REG, 0, &c()), Err(FsError::NotDir));
    let long = vec![b'n'; 256];
    assert_eq!(fs.mknod(r, &long, REG, 0, &c()), Err(FsError::NameTooLong));
    assert_eq!(fs.lookup(r, &long), Err(FsError::NameTooLong));
    assert!(fs.mknod(r, &long[..255], REG, 0, &c()).is_ok());
    assert!(matches!(
        fs.mknod(r, b"a/b", REG, 0, &c()),
        Err(FsError::Invalid(_))
    ));
}

#[test]
fn mkdir_rmdir_and_link_counts() {
    let fs = fresh();
    let r = fs.root();
    let before = fs.getattr(r).unwrap().nlink;
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap();
    assert_eq!(d.nlink, 2);
    assert_eq!(fs.getattr(r).unwrap().nlink, before + 1);
    fs.mknod(d.ino, b"f", REG, 0, &c()).unwrap();
    assert_eq!(fs.rmdir(r, b"d", &c()), Err(FsError::NotEmpty));
    assert_eq!(fs.unlink(r, b"d", &c()), Err(FsError::IsDir));
    assert_eq!(fs.rmdir(d.ino, b"f", &c()), Err(FsError::NotDir));
    fs.unlink(d.ino, b"f", &c()).unwrap();
    assert_eq!(fs.unlink(d.ino, b"f", &c()), Err(FsError::NotFound));
    fs.rmdir(r, b"d", &c()).unwrap();
    assert_eq!(fs.getattr(r).unwrap().nlink, before);
    assert_eq!(fs.rmdir(r, b"d", &c()), Err(FsError::NotFound));
}

#[test]
fn read_write_holes_and_truncate() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    assert_eq!(fs.write(f, 10_000, b"hello", &c()).unwrap(), 5);
    let all = fs.read(f, 0, 20_000).unwrap();
    assert_eq!(all.len(), 10_005);
    assert!(all[..10_000].iter().all(|&b| b == 0));
    assert_eq!(&all[10_000..], b"hello");
    assert_eq!(
        fs.getattr(f).unwrap().blocks,
        8,
        "one 4 KiB block, the rest a hole"
    );
    fs.setattr(
        f,
        SetAttr {
            size: Some(10_002),
            ..Default::default()
        },
        &c(),
    )
    .unwrap();
    fs.setattr(
        f,
        SetAttr {
            size: Some(20_000),
            ..Default::default()
        },
        &c(),
    )
    .unwrap();
    let all = fs.read(f, 0, 30_000).unwrap();
    assert_eq!(all.len(), 20_000);
    assert_eq!(&all[10_000..10_002], b"he");
    assert!(
        all[10_002..].iter().all(|&b| b == 0),
        "a shrink then grow reads zeros"
    );
    assert_eq!(fs.read(f, 50_000, 10).unwrap(), b"");
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap().ino;
    assert_eq!(fs.read(d, 0, 10), Err(FsError::IsDir));
    assert_eq!(fs.write(d, 0, b"x", &c()), Err(FsError::IsDir));
}

#[test]
fn large_sparse_file_uses_triple_indirect_blocks() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"big", REG, 0, &c()).unwrap().ino;
    // 4 KiB blocks: direct 48 KiB, single 4 MiB, double 4 GiB; past that is triple.
    let offs = [0u64, 50 << 10, 5 << 20, 3 << 30, (5u64 << 30) + 123];
    for (i, &o) in offs.iter().enumerate() {
        fs.write(f, o, format!("chunk{i}").as_bytes(), &c())
            .unwrap();
    }
    for (i, &o) in offs.iter().enumerate() {
        assert_eq!(fs.read(f, o, 6).unwrap(), format!("chunk{i}").as_bytes());
    }
    assert_eq!(fs.getattr(f).unwrap().size, (5u64 << 30) + 129);
    let free_before = fs.statfs().unwrap().blocks_free;
    fs.setattr(
        f,
        SetAttr {
            size: Some(100),
            ..Default::default()
        },
        &c(),
    )
    .unwrap();
    assert!(
        fs.statfs().unwrap().blocks_free > free_before,
        "truncate frees indirect blocks"
    );
    assert_eq!(fs.read(f, 0, 6).unwrap(), b"chunk0");
    let too_far = 1u64 << 45;
    assert_eq!(fs.write(f, too_far, b"x", &c()), Err(FsError::TooBig));
}

#[test]
fn symlinks_fast_and_slow() {
    let fs = fresh();
    let r = fs.root();
    let s = fs.symlink(r, b"s", b"target", &c()).unwrap();
    assert_eq!(s.kind, FileType::Symlink);
    assert_eq!(fs.readlink(s.ino).unwrap(), b"target");
    let long = vec![b'x'; 300];
    let l = fs.symlink(r, b"l", &long, &c()).unwrap();
    assert_eq!(fs.readlink(l.ino).unwrap(), long);
    assert_eq!(fs.symlink(r, b"s", b"t", &c()), Err(FsError::Exists));
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap();
    assert!(matches!(fs.readlink(f.ino), Err(FsError::Invalid(_))));
}

#[test]
fn special_files() {
    let fs = fresh();
    let r = fs.root();
    let dev = (4 << 8) | 64;
    let cdev = fs.mknod(r, b"c", libc::S_IFCHR | 0o600, dev, &c()).unwrap();
    assert_eq!((cdev.kind, cdev.rdev), (FileType::CharDevice, dev));
    let big = (300 << 8) | 5 | (1000 << 12 & 0xfff00000);
    let b = fs.mknod(r, b"b", libc::S_IFBLK | 0o600, big, &c()).unwrap();
    assert_eq!(b.rdev, big);
    assert_eq!(
        fs.mknod(r, b"p", libc::S_IFIFO | 0o644, 0, &c())
            .unwrap()
            .kind,
        FileType::Fifo
    );
    assert_eq!(
        fs.mknod(r, b"s", libc::S_IFSOCK | 0o644, 0, &c())
            .unwrap()
            .kind,
        FileType::Socket
    );
    assert!(matches!(
        fs.mknod(r, b"d", libc::S_IFDIR | 0o755, 0, &c()),
        Err(FsError::Invalid(_))
    ));
}

#[test]
fn hard_links() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    fs.write(f, 0, b"data", &c()).unwrap();
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap().ino;
    assert_eq!(fs.link(f, d, b"g", &c()).unwrap().nlink, 2);
    assert_eq!(fs.link(f, d, b"g", &c()), Err(FsError::Exists));
    assert_eq!(fs.link(d, r, b"dd", &c()), Err(FsError::Perm));
    fs.unlink(r, b"f", &c()).unwrap();
    assert_eq!(
        fs.read(fs.lookup(d, b"g").unwrap().ino, 0, 10).unwrap(),
        b"data"
    );
    assert_eq!(fs.getattr(f).unwrap().nlink, 1);
}

#[test]
fn rename_cases() {
    let fs = fresh();
    let r = fs.root();
    let a = fs.mknod(r, b"a", REG, 0, &c()).unwrap().ino;
    let b = fs.mknod(r, b"b", REG, 0, &c()).unwrap().ino;
    let no = RenameFlags::default();
    // Overwrite: b's inode goes away.
    fs.rename(r, b"a", r, b"b", no, &c()).unwrap();
    assert_eq!(fs.lookup(r, b"b").unwrap().ino, a);
    assert!(fs.getattr(b).is_err());
    // Directories across parents, and the link counts that follow.
    let d1 = fs.mkdir(r, b"d1", 0o755, &c()).unwrap().ino;
    let d2 = fs.mkdir(r, b"d2", 0o755, &c()).unwrap().ino;
    let sub = fs.mkdir(d1, b"sub", 0o755, &c()).unwrap().ino;
    fs.rename(d1, b"sub", d2, b"sub", no, &c()).unwrap();
    assert_eq!(fs.getattr(d1).unwrap().nlink, 2);
    assert_eq!(fs.getattr(d2).unwrap().nlink, 3);
    assert_eq!(fs.lookup(sub, b"..").unwrap().ino, d2);
    // A directory under itself.
    assert!(matches!(
        fs.rename(r, b"d2", sub, b"x", no, &c()),
        Err(FsError::Invalid(_))
    ));
    // Type mismatches and non-empty targets.
    assert_eq!(fs.rename(r, b"b", r, b"d1", no, &c()), Err(FsError::IsDir));
    assert_eq!(fs.rename(r, b"d1", r, b"b", no, &c()), Err(FsError::NotDir));
    assert_eq!(
        fs.rename(r, b"d1", r, b"d2", no, &c()),
        Err(FsError::NotEmpty)
    );
    // Over an empty directory.
    fs.rename(r, b"d2", r, b"d1", no, &c()).unwrap();
    assert_eq!(fs.lookup(r, b"d1").unwrap().ino, d2);
    // NOREPLACE and EXCHANGE.
    fs.mknod(r, b"c", REG, 0, &c()).unwrap();
    let nr = RenameFlags {
        noreplace: true,
        ..Default::default()
    };
    assert_eq!(fs.rename(r, b"b", r, b"c", nr, &c()), Err(FsError::Exists));
    let x = RenameFlags {
        exchange: true,
        ..Default::default()
    };
    let (bi, ci) = (
        fs.lookup(r, b"b").unwrap().ino,
        fs.lookup(r, b"c").unwrap().ino,
    );
    fs.rename(r, b"b", r, b"c", x, &c()).unwrap();
    assert_eq!(fs.lookup(r, b"b").unwrap().ino, ci);
    assert_eq!(fs.lookup(r, b"c").unwrap().ino, bi);
    assert_eq!(
        fs.rename(r, b"b", r, b"nothere", x, &c()),
        Err(FsError::NotFound)
    );
    // Exchange a file with a directory across parents.
    fs.rename(r, b"b", d2, b"f", no, &c()).unwrap();
    fs.mkdir(r, b"e", 0o755, &c()).unwrap();
    let root_links = fs.getattr(r).unwrap().nlink;
    fs.rename(r, b"e", d2, b"f", x, &c()).unwrap();
    assert_eq!(fs.getattr(r).unwrap().nlink, root_links - 1);
    assert_eq!(
        fs.lookup(fs.lookup(d2, b"f").unwrap().ino, b"..")
            .unwrap()
            .ino,
        d2
    );
    assert_eq!(
        fs.rename(r, b"missing", r, b"z", no, &c()),
        Err(FsError::NotFound)
    );
}

#[test]
fn setattr_and_access() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    let a = fs
        .setattr(
            f,
            SetAttr {
                mode: Some(0o600),
                uid: Some(1000),
                gid: Some(100),
                ..Default::default()
            },
            &c(),
        )
        .unwrap();
    assert_eq!((a.perm, a.uid, a.gid), (0o600, 1000, 100));
    let owner = Ctx {
        uid: 1000,
        gid: 100,
        ..Default::default()
    };
    let other = Ctx {
        uid: 2000,
        gid: 200,
        ..Default::default()
    };
    assert!(fs
        .access(f, quilt_vfs::R_OK | quilt_vfs::W_OK, &owner)
        .is_ok());
    assert_eq!(fs.access(f, quilt_vfs::R_OK, &other), Err(FsError::Access));
    let t = quilt_vfs::Timespec {
        sec: 1_000_000,
        nsec: 123_456_789,
    };
    let a = fs
        .setattr(
            f,
            SetAttr {
                mtime: Some(quilt_vfs::TimeOrNow::At(t)),
                ..Default::default()
            },
            &c(),
        )
        .unwrap();
    assert_eq!(a.mtime, t, "nanoseconds survive in the extra inode fields");
}

#[test]
fn xattrs() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    let none = XattrFlags::default();
    fs.setxattr(f, b"user.a", b"1", none, &Ctx::root()).unwrap();
    fs.setxattr(f, b"user.b", &[7u8; 500], none, &Ctx::root())
        .unwrap();
    assert_eq!(fs.getxattr(f, b"user.a").unwrap(), b"1");
    assert_eq!(fs.listxattr(f).unwrap(), b"user.a\0user.b\0");
    let create = XattrFlags {
        create: true,
        ..Default::default()
    };
    let replace = XattrFlags {
        replace: true,
        ..Default::default()
    };
    assert_eq!(
        fs.setxattr(f, b"user.a", b"2", create, &Ctx::root()),
        Err(FsError::Exists)
    );
    assert_eq!(
        fs.setxattr(f, b"user.z", b"2", replace, &Ctx::root()),
        Err(FsError::NoAttr)
    );
    assert_eq!(fs.getxattr(f, b"user.zz"), Err(FsError::NoAttr));
    assert!(matches!(
        fs.setxattr(f, b"system.posix_acl_access", b"", none, &Ctx::root()),
        Err(FsError::Invalid(_))
    ));
    assert_eq!(
        fs.setxattr(f, b"system.other", b"", none, &Ctx::root()),
        Err(FsError::NotSupported)
    );
    assert_eq!(
        fs.setxattr(f, b"user.huge", &vec![1u8; 5000], none, &Ctx::root()),
        Err(FsError::NoSpace)
    );
    fs.removexattr(f, b"user.a", &Ctx::root()).unwrap();
    fs.removexattr(f, b"user.b", &Ctx::root()).unwrap();
    assert_eq!(
        fs.removexattr(f, b"user.b", &Ctx::root()),
        Err(FsError::NoAttr)
    );
    assert_eq!(fs.listxattr(f).unwrap(), b"");
}

#[test]
fn readdir_cookies_survive_changes() {
    let fs = fresh();
    let r = fs.root();
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap().ino;
    for i in 0..300 {
        fs.mknod(d, format!("file-{i:04}").as_bytes(), REG, 0, &c())
            .unwrap();
    }
    // Read half, then delete some seen and unseen entries and add new ones.
    let mut seen = Vec::new();
    let mut cookie = 0;
    fs.readdir(d, 0, &mut |e| {
        cookie = e.next_offset;
        seen.push(e.name);
        seen.len() < 150
    })
    .unwrap();
    for i in (0..300).step_by(7) {
        fs.unlink(d, format!("file-{i:04}").as_bytes(), &c())
            .unwrap();
    }
    fs.readdir(d, cookie, &mut |e| {
        seen.push(e.name);
        true
    })
    .unwrap();
    let mut uniq = seen.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), seen.len(), "no entry is listed twice");
    for i in 0..300 {
        let n = format!("file-{i:04}").into_bytes();
        if i % 7 != 0 {
            assert!(
                seen.contains(&n),
                "entry {i} that was never removed is listed"
            );
        }
    }
}

#[test]
fn enospc_is_clean() {
    // 2 MiB image: fill it, get NoSpace, then delete and write again.
    let (dev, fs) = fresh_with(512, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let f = fs.mknod(r, b"fill", REG, 0, &c()).unwrap().ino;
    let chunk = vec![0xabu8; 64 << 10];
    let mut off = 0u64;
    let err = loop {
        match fs.write(f, off, &chunk, &c()) {
            Ok(n) if n as usize == chunk.len() => off += n as u64,
            Ok(n) => off += n as u64,
            Err(e) => break e,
        }
    };
    assert_eq!(err, FsError::NoSpace);
    assert_eq!(fs.getattr(f).unwrap().size, off);
    assert_eq!(fs.statfs().unwrap().blocks_free, 0);
    // Creating more inodes still works; their blocks do not.
    assert_eq!(fs.mkdir(r, b"d", 0o755, &c()), Err(FsError::NoSpace));
    let (dev, fs) = remount(&dev, fs);
    let r = fs.root();
    assert_eq!(
        fs.getattr(fs.lookup(r, b"fill").unwrap().ino).unwrap().size,
        off
    );
    fs.unlink(r, b"fill", &c()).unwrap();
    assert!(fs.statfs().unwrap().blocks_free > 400);
    let g = fs.mknod(r, b"g", REG, 0, &c()).unwrap().ino;
    fs.write(g, 0, &chunk, &c()).unwrap();
    let (_, fs) = remount(&dev, fs);
    assert_eq!(
        fs.read(fs.lookup(fs.root(), b"g").unwrap().ino, 0, 4)
            .unwrap(),
        &chunk[..4]
    );
}

#[test]
fn unlinked_open_file_lives_until_release() {
    let fs = fresh();
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    fs.write(f, 0, b"still here", &c()).unwrap();
    fs.open(f).unwrap();
    let free = fs.statfs().unwrap().files_free;
    fs.unlink(r, b"f", &c()).unwrap();
    assert_eq!(fs.read(f, 0, 100).unwrap(), b"still here");
    assert_eq!(fs.statfs().unwrap().files_free, free);
    fs.release(f).unwrap();
    assert_eq!(fs.statfs().unwrap().files_free, free + 1);
    assert!(fs.getattr(f).is_err());
}

#[test]
fn state_survives_remount_in_both_modes_and_block_sizes() {
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
fn rename_within_one_directory_keeps_it_intact() {
    // Regression: the new name went into the block before the old entry, and the
    // removal then merged into the wrong record.
    let fs = fresh();
    let r = fs.root();
    fs.mknod(r, b"a", REG, 0, &c()).unwrap();
    fs.rename(r, b"a", r, b"b", RenameFlags::default(), &c())
        .unwrap();
    fs.rename(r, b"b", r, b"c", RenameFlags::default(), &c())
        .unwrap();
    assert_eq!(names(&fs, r), vec![".", "..", "c", "lost+found"]);
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap().ino;
    assert_eq!(
        fs.link(d, r, b"c", &c()),
        Err(FsError::Exists),
        "EEXIST before EPERM"
    );
    fs.mknod(d, b"x", REG, 0, &c()).unwrap();
    assert_eq!(
        fs.rename(d, b"x", r, b"d", RenameFlags::default(), &c()),
        Err(FsError::NotEmpty)
    );
}

#[test]
fn chown_drops_setuid_and_executable_setgid_of_files_only() {
    let fs = fresh();
    let root = fs.root();
    let f = fs
        .mknod(root, b"f", libc::S_IFREG | 0o6755, 0, &c())
        .unwrap();
    let chown = |ino, mode: Option<u32>| {
        fs.setattr(
            ino,
            SetAttr {
                uid: Some(5),
                gid: Some(5),
                mode,
                ..Default::default()
            },
            &c(),
        )
        .unwrap()
    };
    // As Linux does, even for root: set-user-ID goes, and set-group-ID with group execute.
    assert_eq!(chown(f.ino, None).perm, 0o755);
    // Without group execute, set-group-ID marks mandatory locking and stays.
    let g = fs
        .mknod(root, b"g", libc::S_IFREG | 0o6745, 0, &c())
        .unwrap();
    assert_eq!(chown(g.ino, None).perm, 0o2745);
    // A mode given with the owner is taken as it is.
    assert_eq!(chown(g.ino, Some(0o4755)).perm, 0o4755);
    // Directories keep theirs (set-group-ID there means inheritance).
    let d = fs.mkdir(root, b"d", 0o6755, &c()).unwrap();
    assert_eq!(chown(d.ino, None).perm, 0o6755);
    // Changing only times or mode drops nothing.
    let h = fs
        .mknod(root, b"h", libc::S_IFREG | 0o4755, 0, &c())
        .unwrap();
    let a = fs
        .setattr(
            h.ino,
            SetAttr {
                mtime: Some(quilt_vfs::TimeOrNow::Now),
                ..Default::default()
            },
            &c(),
        )
        .unwrap();
    assert_eq!(a.perm, 0o4755);
}

#[test]
fn maximum_file_size_is_the_kernels() {
    // The kernel's limit for a block-mapped file without huge_file: data plus map blocks
    // of a dense file within 2^32 - 1 sectors (tests/no-silent-loss.sh checks these
    // against the kernel's own driver on loop mounts).
    for (bs, max) in [(4096usize, 2_196_873_666_560u64), (1024, 17_247_252_480)] {
        let (_dev, fs) = fresh_with(4096, bs, Mode::SoftUpdates);
        let f = fs.mknod(fs.root(), b"f", REG, 0, &c()).unwrap().ino;
        // The last byte can be written, the next cannot; a write across the limit is
        // short, as the kernel's is.
        assert_eq!(fs.write(f, max - 1, b"x", &c()), Ok(1));
        assert_eq!(fs.write(f, max, b"x", &c()), Err(FsError::TooBig));
        assert_eq!(fs.write(f, max - 2, b"abc", &c()), Ok(2));
        assert_eq!(fs.getattr(f).unwrap().size, max);
        let size = |n| SetAttr {
            size: Some(n),
            ..Default::default()
        };
        assert_eq!(fs.setattr(f, size(max + 1), &c()), Err(FsError::TooBig));
        assert_eq!(fs.getattr(f).unwrap().size, max);
        fs.setattr(f, size(0), &c()).unwrap();
        fs.setattr(f, size(max), &c()).unwrap();
        assert_eq!(fs.read(f, max - 1, 10).unwrap(), vec![0u8]);
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
fn seek_data_and_hole_follow_the_block_map() {
    let (_dev, fs) = fresh_with(16384, 4096, Mode::SoftUpdates);
    let f = fs.mknod(fs.root(), b"f", REG, 0, &c()).unwrap().ino;
    let m = 1u64 << 20;
    fs.write(f, 0, &[1; 5000], &c()).unwrap(); // blocks 0 and 1
    fs.write(f, 10 * m, b"x", &c()).unwrap(); // under the double-indirect block
    fs.write(f, 3 << 30, b"tail", &c()).unwrap(); // under the triple-indirect block
    let size = (3u64 << 30) + 4;
    let seek = |off, data| fs.seek_data(f, off, data);
    assert_eq!(seek(0, true), Ok(0));
    assert_eq!(seek(100, false), Ok(8192), "blocks 0-1 are data");
    assert_eq!(
        seek(8192, true),
        Ok(10 * m),
        "whole missing subtrees skipped"
    );
    assert_eq!(
        seek(10 * m + 7, true),
        Ok(10 * m + 7),
        "inside a data block"
    );
    assert_eq!(seek(10 * m + 7, false), Ok(10 * m + 4096));
    assert_eq!(seek(10 * m + 4096, true), Ok(3 << 30));
    assert_eq!(seek(size - 1, false), Ok(size), "the end is a hole");
    assert_eq!(seek(size, true), Err(FsError::NoData));
    assert_eq!(seek(size, false), Err(FsError::NoData));
    let g = fs.mknod(fs.root(), b"g", REG, 0, &c()).unwrap().ino;
    fs.setattr(
        g,
        SetAttr {
            size: Some(1 << 40),
            ..Default::default()
        },
        &c(),
    )
    .unwrap();
    assert_eq!(fs.seek_data(g, 0, true), Err(FsError::NoData), "all hole");
    assert_eq!(fs.seek_data(g, 5, false), Ok(5));
}

#[test]
fn tmpfile_lives_unnamed_until_linked_or_released() {
    let (dev, fs) = fresh_with(4096, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let free = fs.statfs().unwrap().files_free;
    let t = fs.tmpfile(r, 0o640, &c()).unwrap();
    fs.open(t.ino).unwrap();
    assert_eq!((t.nlink, t.kind), (0, FileType::Regular));
    fs.write(t.ino, 0, b"unnamed", &c()).unwrap();
    assert!(names(&fs, r).iter().all(|n| n != "kept"));
    fs.link(t.ino, r, b"kept", &c()).unwrap();
    assert_eq!(fs.getattr(t.ino).unwrap().nlink, 1);
    fs.release(t.ino).unwrap();
    // One never named is freed at its last release.
    let u = fs.tmpfile(r, 0o600, &c()).unwrap().ino;
    fs.open(u).unwrap();
    fs.write(u, 0, &[7; 9000], &c()).unwrap();
    fs.release(u).unwrap();
    assert_eq!(fs.statfs().unwrap().files_free, free - 1);
    assert!(fs.getattr(u).is_err(), "freed");
    let (_dev, fs) = remount(&dev, fs);
    let k = fs.lookup(fs.root(), b"kept").unwrap();
    assert_eq!(fs.read(k.ino, 0, 100).unwrap(), b"unnamed");
    assert_eq!(fs.statfs().unwrap().files_free, free - 1);
}

#[test]
fn a_file_takes_65000_links_as_on_the_kernel() {
    let (_dev, fs) = fresh_with(65536, 1024, Mode::Async);
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    // Spread over directories: names in one directory are found by a linear scan.
    let dirs: Vec<u64> = (0..100)
        .map(|d| {
            fs.mkdir(r, format!("d{d}").as_bytes(), 0o755, &c())
                .unwrap()
                .ino
        })
        .collect();
    for i in 1..65000u32 {
        let d = dirs[(i % 100) as usize];
        fs.link(f, d, format!("l{i}").as_bytes(), &c()).unwrap();
    }
    assert_eq!(fs.getattr(f).unwrap().nlink, 65000);
    assert_eq!(
        fs.link(f, r, b"one-too-many", &c()),
        Err(FsError::TooManyLinks)
    );
}

#[test]
fn rename_whiteout_leaves_a_whiteout_behind() {
    let (dev, fs) = fresh_with(4096, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let user = Ctx {
        uid: 1000,
        gid: 100,
        ..Ctx::default()
    };
    let f = fs.mknod(r, b"a", REG, 0, &c()).unwrap().ino;
    fs.write(f, 0, b"upper", &c()).unwrap();
    let wo = RenameFlags {
        whiteout: true,
        ..Default::default()
    };
    fs.rename(r, b"a", r, b"b", wo, &user).unwrap();
    assert_eq!(fs.lookup(r, b"b").unwrap().ino, f);
    let w = fs.lookup(r, b"a").unwrap();
    assert_eq!(
        (w.kind, w.perm, w.rdev, w.nlink, w.uid, w.gid),
        (FileType::CharDevice, 0, 0, 1, 1000, 100)
    );
    let both = RenameFlags {
        whiteout: true,
        exchange: true,
        ..Default::default()
    };
    assert!(matches!(
        fs.rename(r, b"b", r, b"a", both, &c()),
        Err(FsError::Invalid(_))
    ));
    let (_dev, fs) = remount(&dev, fs);
    let w = fs.lookup(fs.root(), b"a").unwrap();
    assert_eq!((w.kind, w.rdev), (FileType::CharDevice, 0));
    assert_eq!(
        fs.read(fs.lookup(fs.root(), b"b").unwrap().ino, 0, 9)
            .unwrap(),
        b"upper"
    );
}

#[test]
fn immutable_and_append_only_flags_refuse_changes_and_persist() {
    use quilt_vfs::flags::{APPEND, IMMUTABLE, NODUMP, SYNC};
    let (dev, fs) = fresh_with(8192, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let user = Ctx {
        uid: 1000,
        gid: 100,
        ..c()
    };
    let i = fs.mknod(r, b"i", REG, 0, &c()).unwrap().ino;
    let a = fs.mknod(r, b"a", REG, 0, &c()).unwrap().ino;
    fs.write(a, 0, b"0123", &c()).unwrap();
    // Only root changes immutable and append-only; the owner may change the others.
    fs.setattr(
        i,
        SetAttr {
            uid: Some(1000),
            ..Default::default()
        },
        &c(),
    )
    .unwrap();
    assert_eq!(fs.set_flags(i, IMMUTABLE, &user), Err(FsError::Perm));
    fs.set_flags(i, NODUMP, &user).unwrap();
    fs.set_flags(i, IMMUTABLE | NODUMP, &c()).unwrap();
    fs.set_flags(a, APPEND, &c()).unwrap();
    assert_eq!(fs.get_flags(i).unwrap(), IMMUTABLE | NODUMP);
    // While immutable, only that flag may change.
    assert_eq!(fs.set_flags(i, IMMUTABLE, &c()), Err(FsError::Perm));
    assert!(matches!(
        fs.set_flags(i, 0x8000_0000, &c()),
        Err(FsError::NotSupported)
    ));
    assert_eq!(fs.write(i, 0, b"x", &c()), Err(FsError::Perm));
    assert_eq!(fs.check_open(i, libc::O_WRONLY, &c()), Err(FsError::Perm));
    assert_eq!(fs.unlink(r, b"i", &c()), Err(FsError::Perm));
    assert!(matches!(fs.link(i, r, b"i2", &c()), Err(FsError::Perm)));
    let chmod = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    assert!(matches!(fs.setattr(i, chmod, &c()), Err(FsError::Perm)));
    assert_eq!(
        fs.setxattr(i, b"user.k", b"v", XattrFlags::default(), &c()),
        Err(FsError::Perm)
    );
    // Append-only: writes at the end only, no truncation, no removal.
    assert_eq!(fs.write(a, 0, b"x", &c()), Err(FsError::Perm));
    assert_eq!(fs.write(a, 4, b"45", &c()), Ok(2));
    assert_eq!(fs.check_open(a, libc::O_WRONLY, &c()), Err(FsError::Perm));
    assert_eq!(
        fs.check_open(a, libc::O_WRONLY | libc::O_APPEND, &c()),
        Ok(())
    );
    let trunc = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    assert!(matches!(fs.setattr(a, trunc, &c()), Err(FsError::Perm)));
    // New files inherit SYNC from their directory, never IMMUTABLE.
    let d = fs.mkdir(r, b"d", 0o755, &c()).unwrap().ino;
    fs.set_flags(d, SYNC | IMMUTABLE, &c()).unwrap();
    assert!(matches!(
        fs.mknod(d, b"f", REG, 0, &c()),
        Err(FsError::Perm)
    ));
    fs.set_flags(d, SYNC, &c()).unwrap();
    let f = fs.mknod(d, b"f", REG, 0, &c()).unwrap().ino;
    assert_eq!(fs.get_flags(f).unwrap(), SYNC);
    let (_dev, fs) = remount(&dev, fs);
    let i = fs.lookup(fs.root(), b"i").unwrap().ino;
    assert_eq!(fs.get_flags(i).unwrap(), IMMUTABLE | NODUMP);
    fs.set_flags(i, 0, &c()).unwrap();
    fs.unlink(fs.root(), b"i", &c()).unwrap();
}

#[test]
fn fallocate_punches_holes_and_preallocates_zeroed_blocks() {
    const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
    const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
    let (dev, fs) = fresh_with(8192, 4096, Mode::SoftUpdates);
    let r = fs.root();
    let f = fs.mknod(r, b"f", REG, 0, &c()).unwrap().ino;
    fs.write(f, 0, &vec![7u8; 1100 * 4096], &c()).unwrap();
    let before = fs.getattr(f).unwrap().blocks;
    // The whole single-indirect range: 1024 data blocks and the indirect block go.
    fs.fallocate(f, 12 * 4096, 1024 * 4096, PUNCH | KEEP, &c())
        .unwrap();
    assert_eq!(before - fs.getattr(f).unwrap().blocks, 1025 * 8);
    assert_eq!(fs.seek_data(f, 12 * 4096, true).unwrap(), 1036 * 4096);
    // Inside one block: zeros there, the rest kept.
    fs.fallocate(f, 100, 200, PUNCH | KEEP, &c()).unwrap();
    let head = fs.read(f, 0, 400).unwrap();
    assert!(head[..100].iter().all(|&b| b == 7) && head[100..300].iter().all(|&b| b == 0));
    assert!(head[300..].iter().all(|&b| b == 7));
    assert_eq!(
        fs.fallocate(f, 0, 4096, PUNCH, &c()),
        Err(FsError::NotSupported)
    );
    // Preallocation: zeroed blocks, the size grows with mode 0 only.
    let p = fs.mknod(r, b"p", REG, 0, &c()).unwrap().ino;
    fs.fallocate(p, 0, 10 * 4096 + 1, 0, &c()).unwrap();
    let a = fs.getattr(p).unwrap();
    assert_eq!((a.size, a.blocks), (10 * 4096 + 1, 11 * 8));
    assert!(fs.read(p, 0, 50_000).unwrap().iter().all(|&b| b == 0));
    assert_eq!(
        fs.fallocate(p, 10 * 4096, 8 * 4096, KEEP, &c()),
        Err(FsError::NotSupported),
        "no blocks past the size on ext2"
    );
    // No room: what was allocated is covered by the size, so the image stays valid.
    let big = fs.mknod(r, b"big", REG, 0, &c()).unwrap().ino;
    assert_eq!(
        fs.fallocate(big, 0, 64 << 20, 0, &c()),
        Err(FsError::NoSpace)
    );
    let a = fs.getattr(big).unwrap();
    assert!(a.size > 0 && a.size.div_ceil(4096) * 8 <= a.blocks, "{a:?}");
    let (_dev, fs) = remount(&dev, fs);
    let p = fs.lookup(fs.root(), b"p").unwrap().ino;
    assert_eq!(fs.getattr(p).unwrap().size, 10 * 4096 + 1);
}
