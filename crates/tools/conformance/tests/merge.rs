//! Merging a decoupled client's journal (Cudele) into a namespace kept by each module
//! that has atomic batches (betrfs, ext2 in the journal modes).
//!
//! The oracle of a merge is the module itself: the same operations run one by one, as
//! the client's own calls, on a second image must leave the same tree (names, types,
//! owners, modes, symlink targets, attributes, inode numbers). A journal with any bad
//! event changes nothing; a repeated merge applies nothing twice; a merge cut after
//! any batch and merged again ends where one whole merge ends; the conflict rule moves
//! other clients' entries aside and loses none of them; and the module's checker
//! (e2fsck, betrfs fsck) is clean after every merge.

use quilt_cudele::journal::{self, ClientJournal, Event, Header, Tail};
use quilt_cudele::merge::{self, MergeError, Scope};
use quilt_vfs::{Ctx, FileSystem, FileType, FsError, FsOp, Ino, InoGrant, SetAttr, XattrFlags};
use std::collections::BTreeMap;

#[path = "support/modules.rs"]
mod modules;

use modules::{check, mkfs, mount, unmount, Kind};

const KINDS: [Kind; 3] = [
    Kind::Betrfs,
    Kind::Ext2(quilt_ext2::Mode::MetaJournal),
    Kind::Ext2(quilt_ext2::Mode::FullJournal),
];

const USER: u32 = 1000;

fn ev(op: FsOp) -> Event {
    Event {
        uid: USER,
        gid: USER,
        op,
    }
}

/// A subtree `/job` owned by the user, and a grant of `n` numbers for its client.
fn setup(fs: &dyn FileSystem, n: u64) -> (Ino, InoGrant) {
    let c = Ctx::root();
    let job = fs.mkdir(fs.root(), b"job", 0o755, &c).unwrap().ino;
    fs.setattr(
        job,
        SetAttr {
            uid: Some(USER),
            gid: Some(USER),
            ..Default::default()
        },
        &c,
    )
    .unwrap();
    (job, fs.grant_inodes(n).unwrap())
}

/// What a checkpointing job does in its private directory: a directory of files,
/// a nested directory, a symlink, a hard link, renames, an unlink, an rmdir, a chmod
/// and an attribute.
fn workload(job: Ino, g: InoGrant, files: u64) -> Vec<Event> {
    let mut nums = g.iter();
    let mut next = || nums.next().unwrap();
    let out = next();
    let mut evs = vec![ev(FsOp::Mkdir {
        parent: job,
        name: b"out".to_vec(),
        mode: 0o755,
        ino: Some(out),
    })];
    let mut inos = Vec::new();
    for i in 0..files {
        let ino = next();
        inos.push(ino);
        evs.push(ev(FsOp::Mknod {
            parent: out,
            name: format!("rank.{i:05}").into_bytes(),
            mode: libc::S_IFREG | 0o640,
            rdev: 0,
            ino: Some(ino),
        }));
    }
    let sub = next();
    evs.push(ev(FsOp::Mkdir {
        parent: out,
        name: b"sub".to_vec(),
        mode: 0o700,
        ino: Some(sub),
    }));
    let tmp = next();
    evs.push(ev(FsOp::Mkdir {
        parent: sub,
        name: b"tmp".to_vec(),
        mode: 0o700,
        ino: Some(tmp),
    }));
    evs.push(ev(FsOp::Symlink {
        parent: job,
        name: b"latest".to_vec(),
        target: b"out/rank.00000".to_vec(),
        ino: Some(next()),
    }));
    evs.push(ev(FsOp::Link {
        ino: inos[1],
        new_parent: sub,
        new_name: b"hard".to_vec(),
    }));
    evs.push(ev(FsOp::Rename {
        parent: out,
        name: b"rank.00002".to_vec(),
        new_parent: sub,
        new_name: b"moved".to_vec(),
        flags: Default::default(),
    }));
    evs.push(ev(FsOp::Unlink {
        parent: out,
        name: b"rank.00003".to_vec(),
    }));
    evs.push(ev(FsOp::Rmdir {
        parent: sub,
        name: b"tmp".to_vec(),
    }));
    evs.push(ev(FsOp::Setattr {
        ino: inos[4],
        set: SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    }));
    evs.push(ev(FsOp::Setxattr {
        ino: inos[5],
        name: b"user.checksum".to_vec(),
        value: b"c0ffee".to_vec(),
        flags: XattrFlags::default(),
    }));
    evs
}

/// The journal's bytes, sealed every `frame` events, read back as a merge reads it.
fn through_the_format(job: Ino, evs: &[Event], frame: usize) -> Vec<(u64, Event)> {
    let h = Header {
        client: 42,
        subtree: job,
    };
    let mut j = ClientJournal::new(h, 1);
    let mut frames = Vec::new();
    for (i, e) in evs.iter().enumerate() {
        j.append(e);
        if (i + 1) % frame == 0 {
            frames.extend(j.seal());
        }
    }
    frames.extend(j.seal());
    journal::read(&journal::encode(&h, &frames), Tail::Strict)
        .unwrap()
        .events
}

#[derive(Debug, PartialEq, Eq)]
struct Node {
    ino: Ino,
    kind: FileType,
    perm: u16,
    uid: u32,
    gid: u32,
    nlink: u32,
    target: Option<Vec<u8>>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The tree under `dir` by path, without the service's own attributes.
fn tree(fs: &dyn FileSystem, dir: Ino) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(dir, String::new())];
    while let Some((d, path)) = todo.pop() {
        let mut names = Vec::new();
        fs.readdir(d, 0, &mut |e| {
            names.push(e.name);
            true
        })
        .unwrap_or_else(|e| panic!("readdir of {d} ({path}): {e}"));
        for name in names {
            if name == b"." || name == b".." {
                continue;
            }
            let a = fs.lookup(d, &name).unwrap();
            let p = format!("{path}/{}", String::from_utf8_lossy(&name));
            let mut xattrs = Vec::new();
            let list = fs.listxattr(a.ino).unwrap();
            for x in list.split(|&b| b == 0).filter(|x| !x.is_empty()) {
                if !x.starts_with(merge::RESERVED_XATTR) {
                    xattrs.push((x.to_vec(), fs.getxattr(a.ino, x).unwrap()));
                }
            }
            xattrs.sort();
            out.insert(
                p.clone(),
                Node {
                    ino: a.ino,
                    kind: a.kind,
                    perm: a.perm,
                    uid: a.uid,
                    gid: a.gid,
                    nlink: a.nlink,
                    target: (a.kind == FileType::Symlink).then(|| fs.readlink(a.ino).unwrap()),
                    xattrs,
                },
            );
            if a.kind == FileType::Directory {
                todo.push((a.ino, p));
            }
        }
    }
    out
}

/// The oracle: the events as the client's own calls, one by one.
fn direct(fs: &dyn FileSystem, evs: &[Event]) {
    for e in evs {
        let ctx = Ctx {
            uid: e.uid,
            gid: e.gid,
            pid: 1,
            umask: 0,
        };
        e.op.apply(fs, &ctx)
            .unwrap_or_else(|err| panic!("{:?}: {err}", e.op));
    }
}

fn scope(job: Ino, g: InoGrant) -> Scope {
    Scope {
        root: job,
        client: 42,
        grants: vec![g],
    }
}

#[test]
fn a_merge_leaves_what_the_same_calls_leave_and_the_checker_is_clean() {
    for kind in KINDS {
        let (dev_a, dev_b) = (mkfs(kind), mkfs(kind));
        let (a, b) = (mount(kind, dev_a.clone()), mount(kind, dev_b.clone()));
        let (job_a, g_a) = setup(&*a, 200);
        let (job_b, g_b) = setup(&*b, 200);
        assert_eq!((job_a, g_a), (job_b, g_b), "{kind:?}: twin images differ");
        let evs = workload(job_a, g_a, 150);
        let read = through_the_format(job_a, &evs, 64);
        let plan = merge::merge(&*a, &scope(job_a, g_a), &read, 40)
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(plan.events, evs.len() as u64);
        assert_eq!(plan.skipped, 0);
        assert!(plan.moved_aside.is_empty());
        assert_eq!(
            merge::watermark(&*a, job_a, 42).unwrap().seq,
            evs.len() as u64
        );
        direct(&*b, &evs);
        let (ta, tb) = (tree(&*a, job_a), tree(&*b, job_b));
        assert_eq!(
            ta.len(),
            150 + 3 /* out, sub, latest */ + 1 /* hard */ - 1 /* unlinked */
        );
        assert_eq!(ta, tb, "{kind:?}: the merge and the direct calls differ");
        unmount(a);
        unmount(b);
        check(kind, &dev_a);
        // And after a remount the merge is all there.
        // (betrfs knows an inode by number once it was looked up in this mount.)
        let a = mount(kind, dev_a.clone());
        assert_eq!(a.lookup(a.root(), b"job").unwrap().ino, job_a);
        assert_eq!(tree(&*a, job_a), tb, "{kind:?}: after a remount");
        assert_eq!(
            merge::watermark(&*a, job_a, 42).unwrap().seq,
            evs.len() as u64
        );
        unmount(a);
    }
}

#[test]
fn a_repeated_or_resumed_merge_applies_nothing_twice() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let (job, g) = setup(&*fs, 120);
        let evs = through_the_format(job, &workload(job, g, 100), 16);
        let s = scope(job, g);
        // A merge cut after its first batches: the prefix that a crash would keep.
        let half = &evs[..53];
        merge::merge(&*fs, &s, half, 10).unwrap();
        assert_eq!(merge::watermark(&*fs, job, 42).unwrap().seq, 53);
        // The whole journal again: only the rest is applied.
        let p = merge::merge(&*fs, &s, &evs, 10).unwrap();
        assert_eq!(p.events, evs.len() as u64 - 53, "{kind:?}");
        let once = tree(&*fs, job);
        // And once more: nothing.
        let p = merge::merge(&*fs, &s, &evs, 10).unwrap();
        assert_eq!(p.events, 0);
        assert!(p.steps.is_empty());
        assert_eq!(tree(&*fs, job), once);
        // The same as one merge on a fresh image.
        let dev2 = mkfs(kind);
        let fs2 = mount(kind, dev2.clone());
        let (job2, g2) = setup(&*fs2, 120);
        merge::merge(&*fs2, &scope(job2, g2), &evs, 1000).unwrap();
        assert_eq!(tree(&*fs2, job2), once, "{kind:?}");
        unmount(fs);
        unmount(fs2);
        check(kind, &dev);
    }
}

/// Each bad event, after a valid prefix: the whole journal is refused, naming the
/// event, and the namespace is as it was.
#[test]
fn a_journal_with_any_bad_event_changes_nothing() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let c = Ctx::root();
        let (job, g) = setup(&*fs, 50);
        let elsewhere = fs.mkdir(fs.root(), b"elsewhere", 0o777, &c).unwrap().ino;
        let theirs = fs
            .mknod(job, b"theirs", libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        let outside = fs.grant_inodes(4).unwrap().first;
        let good = workload(job, g, 20);
        let used = g.first + 40;
        let before = tree(&*fs, fs.root());
        let file = |parent: Ino, name: &[u8], ino: Ino| {
            ev(FsOp::Mknod {
                parent,
                name: name.to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: Some(ino),
            })
        };
        let long = vec![b'n'; 256];
        let bad: Vec<(&str, Event)> = vec![
            ("a dangling parent", file(987_654, b"x", used)),
            ("a parent outside the subtree", file(elsewhere, b"x", used)),
            ("a number outside the grant", file(job, b"x", outside)),
            ("a number used twice", file(job, b"x", g.first)),
            ("the number of another's file", file(job, b"x", theirs)),
            (
                "a creation with no number",
                ev(FsOp::Mknod {
                    parent: job,
                    name: b"x".to_vec(),
                    mode: libc::S_IFREG | 0o644,
                    rdev: 0,
                    ino: None,
                }),
            ),
            ("a name with a slash", file(job, b"a/b", used)),
            ("a name of 256 bytes", file(job, &long, used)),
            ("an empty name", file(job, b"", used)),
            ("a dot-dot name", file(job, b"..", used)),
            (
                "a device node by a user",
                ev(FsOp::Mknod {
                    parent: job,
                    name: b"sda".to_vec(),
                    mode: libc::S_IFBLK | 0o600,
                    rdev: 0x800,
                    ino: Some(used),
                }),
            ),
            (
                "file data of another's file",
                ev(FsOp::Write {
                    ino: theirs,
                    offset: 0,
                    data: b"x".to_vec(),
                }),
            ),
            (
                "a write of more than 1 MiB",
                ev(FsOp::Write {
                    ino: g.first + 1,
                    offset: 0,
                    data: vec![7; merge::MAX_WRITE + 1],
                }),
            ),
            (
                "file data of a directory",
                ev(FsOp::Write {
                    ino: g.first + 21,
                    offset: 0,
                    data: b"x".to_vec(),
                }),
            ),
            (
                "a size of 32 TiB",
                ev(FsOp::Setattr {
                    ino: g.first + 1,
                    set: SetAttr {
                        size: Some(1 << 45),
                        ..Default::default()
                    },
                }),
            ),
            (
                "the service's own attribute",
                ev(FsOp::Setxattr {
                    ino: job,
                    name: merge::watermark_name(42),
                    value: 0u64.to_le_bytes().to_vec(),
                    flags: XattrFlags::default(),
                }),
            ),
            (
                "a change to a file outside the journal's reach",
                ev(FsOp::Setattr {
                    ino: theirs,
                    set: SetAttr {
                        mode: Some(0o777),
                        ..Default::default()
                    },
                }),
            ),
            (
                "a chown to another user",
                ev(FsOp::Setattr {
                    ino: g.first + 1,
                    set: SetAttr {
                        uid: Some(0),
                        ..Default::default()
                    },
                }),
            ),
            (
                "rmdir of a directory that is not empty",
                ev(FsOp::Rmdir {
                    parent: job,
                    name: b"out".to_vec(),
                }),
            ),
            (
                "rmdir of a file",
                ev(FsOp::Rmdir {
                    parent: job,
                    name: b"latest".to_vec(),
                }),
            ),
            (
                "a directory moved into itself",
                ev(FsOp::Rename {
                    parent: job,
                    name: b"out".to_vec(),
                    new_parent: g.first + 21, // out/sub (made after the 20 files)
                    new_name: b"loop".to_vec(),
                    flags: Default::default(),
                }),
            ),
            (
                "a read",
                ev(FsOp::Readdir {
                    ino: job,
                    offset: 0,
                    max: 10,
                }),
            ),
            (
                "a creation over the journal's own name",
                file(job, b"latest", used),
            ),
        ];
        for (what, e) in bad {
            let mut evs = good.clone();
            evs.push(e);
            let read = through_the_format(job, &evs, 8);
            match merge::merge(&*fs, &scope(job, g), &read, 10) {
                Err(MergeError::Invalid { seq, .. }) => {
                    assert_eq!(
                        seq,
                        evs.len() as u64,
                        "{kind:?}: {what}: blamed the wrong event"
                    )
                }
                other => panic!("{kind:?}: {what}: {other:?}"),
            }
            assert_eq!(
                tree(&*fs, fs.root()),
                before,
                "{kind:?}: {what} changed the namespace"
            );
            assert_eq!(merge::watermark(&*fs, job, 42).unwrap().seq, 0);
        }
        // The good journal alone still merges.
        merge::merge(&*fs, &scope(job, g), &through_the_format(job, &good, 8), 10).unwrap();
        unmount(fs);
        check(kind, &dev);
    }
}

#[test]
fn another_clients_entries_move_aside_and_nothing_is_lost() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let c = Ctx::root();
        let (job, g) = setup(&*fs, 10);
        // The decoupled client's journal: a file `report` and a directory `data`, the
        // removal of `old`, a rename of `draft` with noreplace onto `final`.
        let old = fs
            .mknod(job, b"old", libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        let draft = fs
            .mknod(job, b"draft", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        fs.setattr(
            draft.ino,
            SetAttr {
                uid: Some(USER),
                ..Default::default()
            },
            &c,
        )
        .unwrap();
        let evs = vec![
            ev(FsOp::Mknod {
                parent: job,
                name: b"report".to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: Some(g.first),
            }),
            ev(FsOp::Mkdir {
                parent: job,
                name: b"data".to_vec(),
                mode: 0o755,
                ino: Some(g.first + 1),
            }),
            ev(FsOp::Unlink {
                parent: job,
                name: b"old".to_vec(),
            }),
            ev(FsOp::Rename {
                parent: job,
                name: b"draft".to_vec(),
                new_parent: job,
                new_name: b"final".to_vec(),
                flags: quilt_vfs::RenameFlags {
                    noreplace: true,
                    ..Default::default()
                },
            }),
        ];
        // Meanwhile another client (interfere=allow): `report` with data in it, a
        // directory `data` with a file, `old` already removed, and its own `final`.
        let report = fs
            .mknod(job, b"report", libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        fs.write(report, 0, b"their words", &c).unwrap();
        let data = fs.mkdir(job, b"data", 0o755, &c).unwrap().ino;
        fs.mknod(data, b"inside", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        fs.unlink(job, b"old", &c).unwrap();
        let fin = fs
            .mknod(job, b"final", libc::S_IFREG | 0o644, 0, &c)
            .unwrap()
            .ino;
        let p = merge::merge(&*fs, &scope(job, g), &through_the_format(job, &evs, 2), 10)
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(p.skipped, 1, "the unlink of a name already gone");
        assert_eq!(p.moved_aside.len(), 3);
        // The journal's entries hold the names.
        assert_eq!(fs.lookup(job, b"report").unwrap().ino, g.first);
        assert_eq!(fs.lookup(job, b"data").unwrap().ino, g.first + 1);
        assert_eq!(fs.lookup(job, b"final").unwrap().ino, draft.ino);
        // The others' entries are aside, whole.
        let aside = |name: &str, ino: Ino| {
            let n = format!("{name}.cudele-conflict-{ino}");
            fs.lookup(job, n.as_bytes())
                .unwrap_or_else(|e| panic!("{kind:?}: {n}: {e}"))
        };
        let r = aside("report", report);
        assert_eq!(fs.read(r.ino, 0, 100).unwrap(), b"their words");
        let d = aside("data", data);
        assert!(fs.lookup(d.ino, b"inside").is_ok());
        aside("final", fin);
        assert!(matches!(fs.lookup(job, b"old"), Err(FsError::NotFound)));
        let _ = old;
        unmount(fs);
        check(kind, &dev);
    }
}

/// A client's grant outlives the mount: after a remount the service sets aside again
/// the numbers above the watermark's highest, the module's own creations avoid them,
/// and the client's next journal merges under them.
#[test]
fn a_grant_held_again_after_a_remount_keeps_its_numbers_for_the_client() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let fs = mount(kind, dev.clone());
        let (job, g) = setup(&*fs, 60);
        let first = through_the_format(job, &workload(job, g, 20), 8);
        merge::merge(&*fs, &scope(job, g), &first, 10).unwrap();
        let w = merge::watermark(&*fs, job, 42).unwrap();
        assert!(g.contains(w.max_ino));
        unmount(fs);
        let fs = mount(kind, dev.clone());
        assert_eq!(fs.lookup(fs.root(), b"job").unwrap().ino, job);
        let rest = InoGrant {
            first: w.max_ino + 1,
            count: g.first + g.count - w.max_ino - 1,
        };
        fs.hold_inodes(rest).unwrap();
        assert!(
            matches!(fs.hold_inodes(rest), Err(FsError::Invalid(_))),
            "{kind:?}: held twice"
        );
        // Numbers never granted (past everything the module has).
        assert!(
            matches!(
                fs.hold_inodes(InoGrant {
                    first: 1 << 38,
                    count: 10
                }),
                Err(FsError::Invalid(_))
            ),
            "{kind:?}"
        );
        let c = Ctx::root();
        let own = fs.mkdir(fs.root(), b"own", 0o755, &c).unwrap().ino;
        for i in 0..100 {
            let a = fs
                .mknod(
                    own,
                    format!("f{i}").as_bytes(),
                    libc::S_IFREG | 0o644,
                    0,
                    &c,
                )
                .unwrap();
            assert!(!rest.contains(a.ino), "{kind:?}: {} was held", a.ino);
        }
        // The client goes on: journal events 22.. (past its watermark), new numbers.
        let mut evs: Vec<(u64, Event)> = first.clone();
        let out = fs.lookup(job, b"out").unwrap().ino;
        for (k, ino) in rest.iter().take(5).enumerate() {
            evs.push((
                w.seq + 1 + k as u64,
                ev(FsOp::Mknod {
                    parent: out,
                    name: format!("after.{k}").into_bytes(),
                    mode: libc::S_IFREG | 0o644,
                    rdev: 0,
                    ino: Some(ino),
                }),
            ));
        }
        let p = merge::merge(&*fs, &scope(job, g), &evs, 10)
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(p.events, 5);
        assert_eq!(fs.lookup(out, b"after.4").unwrap().ino, rest.first + 4);
        unmount(fs);
        check(kind, &dev);
    }
}
