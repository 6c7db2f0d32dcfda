//! Inode numbers granted in advance, in every module: the module never hands a granted
//! number out by itself, creations that name one get exactly it (files, directories,
//! symlinks, through [`FsOp`] as a client's journal would carry them), a number is taken
//! once, numbers outside a grant are refused, a failed creation gives its number back,
//! and what was made under granted numbers is there, under them, after a remount, with
//! the module's checker (e2fsck, betrfs fsck) clean.

use quilt_vfs::{Ctx, FsError, FsOp, FsReply, Ino, InoGrant};

#[path = "support/modules.rs"]
mod modules;

use modules::{check, mkfs, mount, unmount, Kind};

fn attr_ino(r: Result<FsReply, FsError>) -> Ino {
    match r {
        Ok(FsReply::Attr(a)) => a.ino,
        other => panic!("expected attributes, got {other:?}"),
    }
}

fn granted_numbers_are_the_holders_alone(kind: Kind) {
    let dev = mkfs(kind);
    let fs = mount(kind, dev.clone());
    let c = Ctx::root();
    let root = fs.root();
    let g: InoGrant = fs.grant_inodes(64).unwrap();
    assert_eq!(g.count, 64);
    let other = fs.grant_inodes(8).unwrap();
    assert!(
        g.iter().all(|i| !other.contains(i)),
        "two grants overlap: {g:?} {other:?}"
    );
    // The module's own creations never land in a grant: next to the grant (in the root,
    // whose group holds it) and in a directory of their own.
    let d = fs.mkdir(root, b"own", 0o755, &c).unwrap().ino;
    for i in 0..200 {
        let parent = if i % 2 == 0 { root } else { d };
        let a = fs
            .mknod(
                parent,
                format!("f{i}").as_bytes(),
                libc::S_IFREG | 0o644,
                0,
                &c,
            )
            .unwrap();
        assert!(
            !g.contains(a.ino) && !other.contains(a.ino),
            "{} was granted",
            a.ino
        );
    }
    // A client's creations under its numbers, as operations off the wire.
    let mut nums = g.iter();
    let mut take = || nums.next().unwrap();
    let dir_ino = take();
    let ops = vec![
        FsOp::Mkdir {
            parent: root,
            name: b"client".to_vec(),
            mode: 0o755,
            ino: Some(dir_ino),
        },
        FsOp::Mknod {
            parent: dir_ino,
            name: b"a".to_vec(),
            mode: libc::S_IFREG | 0o600,
            rdev: 0,
            ino: Some(take()),
        },
        FsOp::Symlink {
            parent: dir_ino,
            name: b"s".to_vec(),
            target: b"a".to_vec(),
            ino: Some(take()),
        },
    ];
    let wire = serde_json::to_vec(&ops).unwrap();
    let ops: Vec<FsOp> = serde_json::from_slice(&wire).unwrap();
    let mut made = Vec::new();
    for op in &ops {
        let want = match op {
            FsOp::Mkdir { ino, .. } | FsOp::Mknod { ino, .. } | FsOp::Symlink { ino, .. } => {
                ino.unwrap()
            }
            _ => unreachable!(),
        };
        let got = attr_ino(op.apply(&*fs, &c));
        assert_eq!(got, want);
        made.push(got);
    }
    let a = made[1];
    assert_eq!(
        fs.write(a, 0, b"granted", &c).unwrap(),
        7,
        "a file under a granted number takes data"
    );
    // Taken once; a number outside every grant is refused; so is a used one.
    assert!(matches!(
        fs.mknod_as(a, dir_ino, b"again", libc::S_IFREG | 0o600, 0, &c),
        Err(FsError::Invalid(_))
    ));
    let outside = g.first + g.count + 1000;
    assert!(matches!(
        fs.mknod_as(outside, dir_ino, b"x", libc::S_IFREG | 0o600, 0, &c),
        Err(FsError::Invalid(_))
    ));
    // A creation that fails (the name exists) keeps its number for the next try.
    let n = take();
    assert_eq!(
        fs.mknod_as(n, dir_ino, b"a", libc::S_IFREG | 0o600, 0, &c)
            .unwrap_err(),
        FsError::Exists
    );
    assert_eq!(
        fs.mknod_as(n, dir_ino, b"b", libc::S_IFREG | 0o600, 0, &c)
            .unwrap()
            .ino,
        n
    );
    made.push(n);
    unmount(fs);
    check(kind, &dev);

    let fs = mount(kind, dev.clone());
    let d = fs.lookup(root, b"client").unwrap();
    assert_eq!(d.ino, made[0]);
    assert_eq!(fs.lookup(d.ino, b"a").unwrap().ino, made[1]);
    assert_eq!(fs.lookup(d.ino, b"s").unwrap().ino, made[2]);
    assert_eq!(fs.lookup(d.ino, b"b").unwrap().ino, made[3]);
    assert_eq!(fs.read(made[1], 0, 100).unwrap(), b"granted");
    assert_eq!(fs.readlink(made[2]).unwrap(), b"a");
    // A grant does not outlive its mount: the numbers left are refused now.
    let left = take();
    assert!(matches!(
        fs.mknod_as(left, d.ino, b"late", libc::S_IFREG | 0o600, 0, &c),
        Err(FsError::Invalid(_))
    ));
    // And new creations after the remount do not reuse the client's numbers.
    for i in 0..50 {
        let a = fs
            .mknod(
                d.ino,
                format!("n{i}").as_bytes(),
                libc::S_IFREG | 0o644,
                0,
                &c,
            )
            .unwrap();
        assert!(!made.contains(&a.ino), "{} reused", a.ino);
    }
    unmount(fs);
    check(kind, &dev);
}

#[test]
fn ext2_soft_updates_grants() {
    granted_numbers_are_the_holders_alone(Kind::Ext2(quilt_ext2::Mode::SoftUpdates));
}

#[test]
fn ext2_journal_grants() {
    granted_numbers_are_the_holders_alone(Kind::Ext2(quilt_ext2::Mode::MetaJournal));
}

#[test]
fn betrfs_grants() {
    granted_numbers_are_the_holders_alone(Kind::Betrfs);
}
