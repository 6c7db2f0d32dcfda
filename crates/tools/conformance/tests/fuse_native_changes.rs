//! The kernel caches names and attributes of a quiltfs mount; a program that links the
//! file system and changes it natively while it is mounted reports the change through
//! the session's `Invalidator`, and the mount then shows it at once, not after the
//! cache times out. Also what the mount itself does to cached state: renames over an
//! existing name and unlinks of open files as the kernel's ext2 shows them. Skipped
//! without root and /dev/fuse unless QUILT_REQUIRE_FUSE=1.

#[path = "support/fuse_env.rs"]
mod fuse_env;

use fuse_env::{fresh_ext2, fuse_available};
use quilt_ext2::Ext2;
use quilt_vfs::{Ctx, FileSystem, SetAttr};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

fn mounted(ring: bool) -> (tempfile::TempDir, Arc<Ext2>, quilt_fuse::BackgroundSession) {
    let fs = fresh_ext2();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = quilt_fuse::FuseOptions::default();
    if !ring {
        opts.ring = None;
    }
    let s = quilt_fuse::spawn(fs.clone(), dir.path(), &opts, Box::new(|| {})).unwrap();
    (dir, fs, s)
}

fn root() -> Ctx {
    Ctx {
        uid: 0,
        gid: 0,
        ..Default::default()
    }
}

fn native_changes_are_seen_through_the_mount(ring: bool) {
    let (dir, fs, s) = mounted(ring);
    let inv = s.invalidator();
    let p = dir.path().join("f");
    std::fs::write(&p, b"hello").unwrap();
    // The kernel now holds the name and the attributes.
    let before = std::fs::metadata(&p).unwrap();
    assert_eq!(before.len(), 5);
    assert_eq!(before.mode() & 0o7777, 0o644);

    let root_ino = fs.root();
    let a = fs.lookup(root_ino, b"f").unwrap();
    let set = SetAttr {
        mode: Some(0o600),
        size: Some(2),
        ..Default::default()
    };
    fs.setattr(a.ino, set, &root()).unwrap();
    inv.inode(a.ino).unwrap();
    let after = std::fs::metadata(&p).unwrap();
    assert_eq!(after.len(), 2, "size changed natively");
    assert_eq!(after.mode() & 0o7777, 0o600, "mode changed natively");
    let mut got = Vec::new();
    std::fs::File::open(&p)
        .unwrap()
        .read_to_end(&mut got)
        .unwrap();
    assert_eq!(got, b"he", "cached data dropped");

    // A name removed natively disappears; one created natively appears.
    fs.unlink(root_ino, b"f", &root()).unwrap();
    inv.entry(root_ino, b"f").unwrap();
    assert!(
        !p.exists(),
        "a natively removed name is gone through the mount"
    );
    fs.mknod(root_ino, b"g", libc::S_IFREG | 0o640, 0, &root())
        .unwrap();
    inv.entry(root_ino, b"g").unwrap();
    let g = std::fs::metadata(dir.path().join("g")).unwrap();
    assert_eq!(g.mode() & 0o7777, 0o640);
    // An invalidation of something the kernel never saw is no error.
    inv.entry(root_ino, b"never-looked-up").unwrap();
    drop(s);
}

#[test]
fn native_changes_are_seen_at_once_over_the_ring() {
    if fuse_available() {
        native_changes_are_seen_through_the_mount(true);
    }
}

#[test]
fn native_changes_are_seen_at_once_over_dev_fuse() {
    if fuse_available() {
        native_changes_are_seen_through_the_mount(false);
    }
}

#[test]
fn renames_over_names_and_unlinks_of_open_files_show_at_once() {
    if !fuse_available() {
        return;
    }
    let (dir, _fs, s) = mounted(true);
    let d = dir.path();
    std::fs::write(d.join("a"), b"new").unwrap();
    std::fs::write(d.join("b"), b"old!").unwrap();
    let b_ino = std::fs::metadata(d.join("b")).unwrap().ino();
    let mut held = std::fs::File::open(d.join("b")).unwrap();
    std::fs::hard_link(d.join("b"), d.join("b2")).unwrap();
    assert_eq!(std::fs::metadata(d.join("b2")).unwrap().nlink(), 2);
    // rename over an existing name: the name now shows the new file, the old one lost a
    // link, and an open descriptor of it still reads its data.
    std::fs::rename(d.join("a"), d.join("b")).unwrap();
    assert_eq!(std::fs::read(d.join("b")).unwrap(), b"new");
    assert_ne!(std::fs::metadata(d.join("b")).unwrap().ino(), b_ino);
    assert_eq!(std::fs::metadata(d.join("b2")).unwrap().nlink(), 1);
    assert!(!d.join("a").exists());
    // Unlink of the last name while open: fstat shows no links, data still reads.
    std::fs::remove_file(d.join("b2")).unwrap();
    assert_eq!(held.metadata().unwrap().nlink(), 0);
    let mut got = Vec::new();
    held.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"old!");
    let free_before = nix_free_inodes(d);
    drop(held);
    // Closed: the inode is freed. On this plain FUSE mount the kernel sends RELEASE in
    // the background after close(2) returns (a fuseblk mount, as `quiltfs mount` makes,
    // sends it before), so statfs may briefly lag.
    eventually(5, || nix_free_inodes(d) == free_before + 1);
    assert_eq!(nix_free_inodes(d), free_before + 1);
    let mut f = std::fs::File::create(d.join("c")).unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    drop(s);
}

/// An unlinked file is freed at its FORGET, which the kernel queues on /dev/fuse while
/// the ring carries everything else. A request that reports or allocates space (and an
/// unlink) drains the FORGETs queued before it; the last file's FORGET has no request
/// after it, and the /dev/fuse thread's sweep must still free it soon, even while that
/// thread pauses after sweeping the ones before. Checked through the native API, which
/// sends no FUSE request.
#[test]
fn unlinked_files_are_freed_with_no_request_after_them() {
    if !fuse_available() {
        return;
    }
    let (dir, fs, s) = mounted(true);
    let files = 20u64;
    for i in 0..files {
        std::fs::write(dir.path().join(format!("doomed{i}")), vec![7u8; 64 * 1024]).unwrap();
    }
    let before = fs.statfs().unwrap();
    for i in 0..files {
        std::fs::remove_file(dir.path().join(format!("doomed{i}"))).unwrap();
    }
    eventually(2, || {
        fs.statfs().unwrap().files_free == before.files_free + files
    });
    let now = fs.statfs().unwrap();
    assert_eq!(
        now.files_free,
        before.files_free + files,
        "every unlinked file's inode is freed, the last one without a request after it"
    );
    assert!(
        now.blocks_free >= before.blocks_free + files * 16,
        "their blocks are freed too ({} -> {})",
        before.blocks_free,
        now.blocks_free
    );
    drop(s);
}

/// Polls `done` until it holds or `secs` seconds have passed (the caller then asserts).
fn eventually(secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !done() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn nix_free_inodes(p: &Path) -> u64 {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs fills the struct it is given; the path is NUL-terminated.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        st.f_ffree as u64
    }
}
