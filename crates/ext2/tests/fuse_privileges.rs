//! Set-user-ID and set-group-ID through a real FUSE mount, as the kernel's own file
//! systems treat them: the adapter tells the kernel it drops them itself
//! (HANDLE_KILLPRIV_V2), so the kernel stops asking for security.capability on every
//! write; these tests check that it then really drops them, and that `stat` shows it at
//! once. Skipped without root and /dev/fuse unless QUILT_REQUIRE_FUSE=1.

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
