//! Set-user-ID and set-group-ID through a real FUSE mount, as the kernel's own file
//! systems treat them: the adapter tells the kernel it drops them itself
//! (HANDLE_KILLPRIV_V2), so the kernel stops asking for security.capability on every
//! write; these tests check that it then really drops them, and that `stat` shows it at
//! once; and that writes through write-only handles (which go to the server directly,
//! one request per write(2)) drop `security.capability` as the kernel's cached path
//! does, and leave no stale pages in other handles' cache. Skipped without root and
//! /dev/fuse unless QUILT_REQUIRE_FUSE=1.

// Only `as_ctx` is used here.
#[path = "support/fuse_env.rs"]
mod fuse_env;
#[allow(dead_code)]
#[path = "support/mount_fs.rs"]
mod mount_fs;

use fuse_env::{fresh_ext2, fuse_available};
use quilt_vfs::Ctx;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

fn mounted() -> (tempfile::TempDir, quilt_fuse::BackgroundSession) {
    let fs = fresh_ext2();
    let dir = tempfile::tempdir().unwrap();
    // The production settings (kernel permission checks on), open to other users.
    let opts = quilt_fuse::FuseOptions {
        allow_other: true,
        ..Default::default()
    };
    let s = quilt_fuse::spawn(fs, dir.path(), &opts, Box::new(|| {})).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    (dir, s)
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

fn user() -> Ctx {
    Ctx {
        uid: 1000,
        gid: 100,
        pid: 0,
        umask: 0o022,
    }
}

/// Appends a line as an unprivileged user (setfsuid drops CAP_FSETID).
fn append_as_user(p: &Path) {
    mount_fs::as_ctx(&user(), || {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
        f.write_all(b"hi\n").unwrap();
        f.sync_all().unwrap();
    });
}

#[test]
fn writes_and_truncates_by_users_drop_privileges_at_once() {
    if !fuse_available() {
        return;
    }
    let (dir, session) = mounted();
    let f = dir.path().join("f");
    std::fs::write(&f, b"x").unwrap();

    chmod(&f, 0o4777);
    append_as_user(&f);
    assert_eq!(mode(&f), 0o777, "a user's write drops set-user-ID");

    chmod(&f, 0o6777);
    append_as_user(&f);
    assert_eq!(mode(&f), 0o777, "and set-group-ID with group execute");

    chmod(&f, 0o2767);
    append_as_user(&f);
    assert_eq!(mode(&f), 0o2767, "set-group-ID without group execute stays");

    chmod(&f, 0o4777);
    mount_fs::as_ctx(&user(), || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(1)
            .unwrap()
    });
    assert_eq!(mode(&f), 0o777, "a user's truncate drops set-user-ID");

    chmod(&f, 0o4777);
    std::fs::write(&f, b"root writes").unwrap();
    assert_eq!(mode(&f), 0o4777, "root (CAP_FSETID) keeps it");

    chmod(&f, 0o6755);
    std::os::unix::fs::chown(&f, Some(5), Some(5)).unwrap();
    assert_eq!(mode(&f), 0o755, "chown drops both, even by root");

    let d = dir.path().join("d");
    std::fs::create_dir(&d).unwrap();
    chmod(&d, 0o6755);
    std::os::unix::fs::chown(&d, Some(5), Some(5)).unwrap();
    assert_eq!(mode(&d), 0o6755, "directories keep theirs");
    assert_eq!(std::fs::read(&f).unwrap(), b"root writes");
    session.umount_and_join().unwrap();
}

fn set_capability(p: &Path) {
    // A version-2 capability set: magic with the effective flag, CAP_NET_BIND_SERVICE
    // permitted. The kernel checks the format before it reaches us.
    let mut v = Vec::new();
    for w in [0x0200_0001u32, 1 << 10, 0, 0, 0] {
        v.extend_from_slice(&w.to_le_bytes());
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            c"security.capability".as_ptr(),
            v.as_ptr().cast(),
            v.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

fn has_capability(p: &Path) -> bool {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let r = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"security.capability".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    if r < 0 {
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENODATA)
        );
    }
    r > 0
}

#[test]
fn any_write_drops_capabilities_as_on_kernel_ext2() {
    if !fuse_available() {
        return;
    }
    let (dir, session) = mounted();
    let f = dir.path().join("tool");
    std::fs::write(&f, b"#!/bin/sh\n").unwrap();
    for (how, opts) in [
        (
            "write-only",
            std::fs::OpenOptions::new().write(true).clone(),
        ),
        (
            "read-write",
            std::fs::OpenOptions::new().read(true).write(true).clone(),
        ),
        ("append", std::fs::OpenOptions::new().append(true).clone()),
    ] {
        set_capability(&f);
        assert!(has_capability(&f));
        use std::io::Write;
        opts.open(&f).unwrap().write_all(b"#").unwrap();
        assert!(
            !has_capability(&f),
            "a {how} write by root drops the capability"
        );
    }
    session.umount_and_join().unwrap();
}

#[test]
fn direct_writes_leave_no_stale_pages_in_readers_caches() {
    if !fuse_available() {
        return;
    }
    use std::os::unix::fs::FileExt;
    let (dir, session) = mounted();
    let f = dir.path().join("shared");
    std::fs::write(&f, vec![b'a'; 20_000]).unwrap();
    let reader = std::fs::File::open(&f).unwrap();
    let mut buf = vec![0; 20_000];
    reader.read_exact_at(&mut buf, 0).unwrap();
    assert!(
        buf.iter().all(|&b| b == b'a'),
        "the reader has the pages cached"
    );
    let writer = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    writer.write_all_at(&[b'b'; 5000], 3000).unwrap();
    writer.write_all_at(&[b'c'; 100], 20_000).unwrap();
    drop(writer);
    let mut after = vec![0; 20_100];
    reader.read_exact_at(&mut after, 0).unwrap();
    let mut want = vec![b'a'; 20_100];
    want[3000..8000].fill(b'b');
    want[20_000..].fill(b'c');
    assert!(
        after == want,
        "the reader sees what the write-only handle wrote"
    );
    assert_eq!(reader.metadata().unwrap().len(), 20_100);
    drop(reader); // an open file keeps the mount busy
    session.umount_and_join().unwrap();
}
