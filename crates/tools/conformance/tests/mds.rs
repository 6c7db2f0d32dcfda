//! The metadata service (Cudele) over loopback gRPC, on each module with atomic
//! batches: clients that share the namespace through RPCs, a subtree decoupled by one
//! client (EBUSY for others under `block`, the conflict rule under `allow`), merges
//! over the wire, what survives a restart of the service (policies, holds and their
//! blocks, grants, a staged merge finished), and bad requests refused with nothing
//! changed.

use quilt_cudele::client::{Client, DecoupleOptions, RemoteFs};
use quilt_cudele::journal::{self, ClientJournal, Event, Header};
use quilt_cudele::rpc::Request;
use quilt_vfs::{Ctx, FileSystem, FsError, FsOp};
use std::sync::Arc;
use std::time::Duration;

#[path = "support/mds_service.rs"]
mod mds_service;
#[path = "support/modules.rs"]
mod modules;

use mds_service::{Service, SECRET};
use modules::{check, mkfs, Kind};

const KINDS: [Kind; 2] = [Kind::Betrfs, Kind::Ext2(quilt_ext2::Mode::MetaJournal)];

/// A module mounted for the service: shared, and unmounted by its own type.
enum Store {
    Ext2(Arc<quilt_ext2::Ext2>),
    Betrfs(Arc<quilt_betrfs::Betrfs>),
}

impl Store {
    fn open(kind: Kind, dev: Arc<quilt_block::MemDevice>) -> Store {
        match modules::mount(kind, dev) {
            modules::Mounted::Ext2(f) => Store::Ext2(Arc::from(f)),
            modules::Mounted::Betrfs(f) => Store::Betrfs(Arc::from(f)),
        }
    }
    fn fs(&self) -> Arc<dyn FileSystem> {
        match self {
            Store::Ext2(f) => f.clone(),
            Store::Betrfs(f) => f.clone(),
        }
    }
    fn unmount(self) {
        match self {
            Store::Ext2(f) => f.unmount().unwrap(),
            Store::Betrfs(f) => f.unmount().unwrap(),
        }
    }
}

fn user() -> Ctx {
    Ctx {
        uid: 1000,
        gid: 1000,
        pid: 7,
        umask: 0o022,
    }
}

fn connect(addr: &str, name: &str) -> Arc<Client> {
    Client::connect(addr, SECRET, None, name).unwrap()
}

/// Waits out a client's memory of refusals (up to 200 ms after a hold let go, a client
/// refused in a directory is refused by its own library without asking the service).
fn refusals_forgotten() {
    std::thread::sleep(Duration::from_millis(250));
}

/// Whether `ino` is gone at the service within two seconds (closes are sent without
/// waiting for their answer).
fn gone(fs: &RemoteFs, ino: u64) -> bool {
    for _ in 0..100 {
        if fs.getattr(ino).is_err() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn errno(r: Result<impl std::fmt::Debug, FsError>) -> i32 {
    match r {
        Err(e) => e.errno(),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

fn names(fs: &dyn FileSystem, dir: u64) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    fs.readdir(dir, 0, &mut |e| {
        if e.name != b"." && e.name != b".." {
            v.push(e.name);
        }
        true
    })
    .unwrap();
    v.sort();
    v
}

#[test]
fn clients_share_the_namespace_through_rpcs() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
        let (a, b) = (
            RemoteFs::new(connect(&svc.addr, "a")),
            RemoteFs::new(connect(&svc.addr, "b")),
        );
        assert_ne!(a.client().id(), b.client().id());
        let c = Ctx::root();
        let d = a.mkdir(a.root(), b"shared", 0o777, &c).unwrap();
        let f = a
            .mknod(d.ino, b"notes", libc::S_IFREG | 0o666, 0, &user())
            .unwrap();
        assert_eq!(f.uid, 1000);
        a.write(f.ino, 0, b"written by a", &user()).unwrap();
        // b sees it at once (strong consistency: every request reaches the service).
        let seen = b.lookup(d.ino, b"notes").unwrap();
        assert_eq!(seen.ino, f.ino);
        assert_eq!(b.read(seen.ino, 0, 100).unwrap(), b"written by a");
        b.rename(
            d.ino,
            b"notes",
            d.ino,
            b"renamed",
            Default::default(),
            &user(),
        )
        .unwrap();
        assert_eq!(errno(a.lookup(d.ino, b"notes")), libc::ENOENT);
        assert_eq!(a.lookup(d.ino, b"renamed").unwrap().ino, f.ino);
        // The service's own directory is nobody's business: not listed, not counted.
        assert!(!names(&a, a.root()).contains(&b".quiltfs-mds".to_vec()));
        let subdirs = names(&a, a.root())
            .iter()
            .filter(|n| a.lookup(a.root(), n).unwrap().kind == quilt_vfs::FileType::Directory)
            .count() as u32;
        assert_eq!(a.getattr(a.root()).unwrap().nlink, 2 + subdirs);
        assert_eq!(errno(a.lookup(a.root(), b".quiltfs-mds")), libc::ENOENT);
        assert_eq!(
            errno(a.mkdir(a.root(), b".quiltfs-mds", 0o755, &c)),
            libc::EPERM
        );
        // Errors keep their errno across the wire.
        assert_eq!(errno(a.mkdir(d.ino, b"renamed", 0o755, &c)), libc::EEXIST);
        assert_eq!(errno(a.rmdir(a.root(), b"shared", &c)), libc::ENOTEMPTY);
        a.sync_all().unwrap();
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

#[test]
fn a_decoupled_subtree_blocks_others_or_lets_them_in_and_wins_at_merge() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
        let ca = connect(&svc.addr, "holder");
        let (a, b) = (
            RemoteFs::new(ca.clone()),
            RemoteFs::new(connect(&svc.addr, "other")),
        );
        let c = Ctx::root();
        let job = a.mkdir(a.root(), b"job", 0o777, &c).unwrap().ino;
        let free = a.mkdir(a.root(), b"free", 0o777, &c).unwrap().ino;
        // Strong (the default) cannot be decoupled.
        assert_eq!(
            ca.decouple(job, DecoupleOptions::default())
                .err()
                .unwrap()
                .errno(),
            libc::EINVAL
        );
        ca.set_policy(job, "consistency=weak interfere=block inodes=300 sync=0")
            .unwrap();
        let d = ca.decouple(job, DecoupleOptions::default()).unwrap();
        // Every request of another client inside gets EBUSY; outside, nothing changes.
        assert_eq!(
            errno(b.mknod(job, b"x", libc::S_IFREG | 0o644, 0, &c)),
            libc::EBUSY
        );
        assert_eq!(errno(b.lookup(job, b"anything")), libc::EBUSY);
        assert_eq!(errno(b.getattr(job)), libc::EBUSY);
        b.mknod(free, b"fine", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        // The holder works alone: 1,000 creates, in directories of its own.
        let out = d.mkdir(&user(), job, b"out", 0o755).unwrap();
        for i in 0..1000 {
            d.create(&user(), out, format!("f{i:04}").as_bytes(), 0o644)
                .unwrap();
        }
        assert_eq!(
            d.create(&user(), out, b"f0001", 0o644).err(),
            Some(FsError::Exists)
        );
        assert_eq!(d.appended(), 1001);
        let s = d.sync().unwrap();
        assert_eq!(s.merged_seq, 1001);
        // Merged, and still blocked until the holder lets go.
        assert_eq!(errno(b.lookup(job, b"out")), libc::EBUSY);
        assert_eq!(names(&a, out).len(), 1000);
        d.release().unwrap();
        refusals_forgotten();
        let o = b.lookup(job, b"out").unwrap();
        assert_eq!(o.uid, 1000);
        assert_eq!(names(&b, o.ino).len(), 1000);

        // interfere=allow: the other client's changes go in; the holder's win at merge.
        ca.set_policy(job, "interfere=allow").unwrap();
        let d = ca.decouple(job, DecoupleOptions::default()).unwrap();
        let theirs = b
            .mknod(job, b"result", libc::S_IFREG | 0o644, 0, &c)
            .unwrap();
        b.write(theirs.ino, 0, b"theirs", &c).unwrap();
        let mine = d.create(&user(), job, b"result", 0o644).unwrap();
        let s = d.sync().unwrap();
        assert!(s.merged_seq > 1001);
        assert_eq!(a.lookup(job, b"result").unwrap().ino, mine);
        let aside = format!("result.cudele-conflict-{}", theirs.ino);
        let kept = a.lookup(job, aside.as_bytes()).unwrap();
        assert_eq!(a.read(kept.ino, 0, 10).unwrap(), b"theirs");
        d.release().unwrap();
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

/// A decoupled client under Local Persist dies (no release, no merge: its hold stays
/// and blocks everyone); it comes back as itself from what it kept in its local
/// directory, and its journal is merged whole, once, with a torn last frame dropped.
#[test]
fn a_dead_decoupled_client_comes_back_and_merges_its_local_journal() {
    use quilt_cudele::recover;
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
        let admin = connect(&svc.addr, "admin");
        let a = RemoteFs::new(admin.clone());
        let c = Ctx::root();
        let job = a.mkdir(a.root(), b"job", 0o777, &c).unwrap().ino;
        admin
            .set_policy(job, "preset=deltafs interfere=allow inodes=500")
            .unwrap();
        let local = tempfile::tempdir().unwrap();
        let opts = DecoupleOptions {
            local_dir: Some(local.path().to_path_buf()),
            sync_interval: Some(Duration::ZERO),
        };
        let (dead, journal_file) = {
            let worker = connect(&svc.addr, "worker");
            let d = worker.decouple(job, opts.clone()).unwrap();
            let dir = d.mkdir(&user(), job, b"out", 0o755).unwrap();
            for i in 0..300 {
                d.create(&user(), dir, format!("f{i}").as_bytes(), 0o644)
                    .unwrap();
            }
            // Local Persist (invisible: nothing merges).
            let s = d.sync().unwrap();
            assert_eq!(s.merged_seq, 0);
            // Appended after the last sync: never persisted, lost with the client.
            d.create(&user(), dir, b"unsynced", 0o644).unwrap();
            let id = worker.id();
            // The client dies: no release, no last sync (its runtime stops renewing).
            drop(d);
            drop(worker);
            (id, recover::journal_path(local.path(), id, job))
        };
        assert!(journal_file.exists());
        assert_eq!(errno(a.lookup(job, b"out")), libc::ENOENT);
        // Nobody else may decouple the subtree while the dead client's hold stands.
        let other = connect(&svc.addr, "other");
        assert_eq!(
            other
                .decouple(job, DecoupleOptions::default())
                .err()
                .map(|e| e.errno()),
            Some(libc::EBUSY)
        );
        // A torn last frame: an append the crash cut.
        {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&journal_file)
                .unwrap();
            f.write_all(&[0x40, 0, 0, 0, 1, 2, 3]).unwrap();
        }
        let left = recover::leftovers(local.path()).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].client, left[0].subtree), (dead, job));
        // Without its identity it cannot come back (nobody can pose as it).
        let id_file = local.path().join(format!("cudele-{dead}.id"));
        let kept = std::fs::read(&id_file).unwrap();
        std::fs::write(
            &id_file,
            format!("quiltfs-cudele-client {dead} {:032x}\n", 7u128),
        )
        .unwrap();
        assert!(
            recover::recover(&svc.addr, mds_service::SECRET, None, local.path(), &left[0]).is_err()
        );
        std::fs::write(&id_file, &kept).unwrap();
        let r =
            recover::recover(&svc.addr, mds_service::SECRET, None, local.path(), &left[0]).unwrap();
        assert_eq!(r.events, 301, "{kind:?}: {r:?}");
        assert_eq!(r.torn_bytes, 7);
        let out = a.lookup(job, b"out").unwrap();
        assert_eq!(names(&a, out.ino).len(), 300);
        assert_eq!(errno(a.lookup(out.ino, b"unsynced")), libc::ENOENT);
        assert_eq!(a.lookup(out.ino, b"f7").unwrap().uid, 1000);
        // The journal and the identity are gone; the hold too.
        assert!(recover::leftovers(local.path()).unwrap().is_empty());
        assert!(!id_file.exists());
        let d = other
            .decouple(
                job,
                DecoupleOptions {
                    local_dir: Some(local.path().to_path_buf()),
                    ..Default::default()
                },
            )
            .unwrap();
        d.release().unwrap();
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

#[test]
fn policies_holds_grants_and_staged_merges_survive_a_restart() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
        let addr = svc.addr.clone();
        let ca = connect(&addr, "holder");
        let a = RemoteFs::new(ca.clone());
        let c = Ctx::root();
        let job = a.mkdir(a.root(), b"job", 0o777, &c).unwrap().ino;
        let p = ca
            .set_policy(
                job,
                "consistency=weak durability=global interfere=block sync=0",
            )
            .unwrap();
        assert_eq!(p.version, 1);
        let d = ca.decouple(job, DecoupleOptions::default()).unwrap();
        for i in 0..50 {
            d.create(&user(), job, format!("before.{i}").as_bytes(), 0o644)
                .unwrap();
        }
        d.sync().unwrap();
        drop(d);
        svc.stop().unwrap();
        store.unmount();

        // A journal staged for a durable merge when the service stopped (as a crash
        // in the middle of the merge leaves it): events 51..=60, client `ca`.
        let store = Store::open(kind, dev.clone());
        let fs = store.fs();
        let hidden = fs.lookup(fs.root(), b".quiltfs-mds").unwrap().ino;
        let job_now = fs.lookup(fs.root(), b"job").unwrap().ino;
        assert_eq!(job_now, job);
        let w = quilt_cudele::merge::watermark(&*fs, job, ca.id()).unwrap();
        assert_eq!(w.seq, 50);
        let h = Header {
            client: ca.id(),
            subtree: job,
        };
        let mut j = ClientJournal::new(h, 51);
        for i in 0..10 {
            j.append(&Event {
                uid: 1000,
                gid: 1000,
                op: FsOp::Mknod {
                    parent: job,
                    name: format!("staged.{i}").into_bytes(),
                    mode: libc::S_IFREG | 0o644,
                    rdev: 0,
                    ino: Some(w.max_ino + 1 + i),
                },
            });
        }
        let bytes = journal::encode(&h, &[j.seal().unwrap()]);
        let f = fs
            .mknod(
                hidden,
                format!("staged.{}.{job}", ca.id()).as_bytes(),
                libc::S_IFREG | 0o600,
                0,
                &c,
            )
            .unwrap();
        fs.write(f.ino, 0, &bytes, &c).unwrap();

        // The service again, on the same port: the staged merge is finished first.
        let svc = Service::start(fs.clone(), Some(&addr), Duration::from_secs(30)).unwrap();
        let b = RemoteFs::new(connect(&addr, "other"));
        assert!(b.client().id() > ca.id(), "a client number given twice");
        // The hold and its block survived (the holder gets a fresh lease).
        assert_eq!(errno(b.lookup(job, b"before.1")), libc::EBUSY);
        let info = ca.policy(job).unwrap();
        assert_eq!(info.version, 1);
        assert_eq!(info.holder, Some(ca.id()));
        assert_eq!(info.policy.interfere, quilt_cudele::Interfere::Block);
        // The holder comes back to its hold and goes on past the staged events.
        let d = ca.decouple(job, DecoupleOptions::default()).unwrap();
        for i in 0..5 {
            d.create(&user(), job, format!("after.{i}").as_bytes(), 0o644)
                .unwrap();
        }
        d.release().unwrap();
        refusals_forgotten();
        let all = names(&b, job);
        assert_eq!(all.len(), 65, "{kind:?}: {:?}", all.len());
        assert!(all.contains(&b"staged.9".to_vec()));
        assert!(all.contains(&b"after.4".to_vec()));
        assert_eq!(
            errno(fs.lookup(hidden, format!("staged.{}.{job}", ca.id()).as_bytes())),
            libc::ENOENT,
            "the staged journal stays after its merge"
        );
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

#[test]
fn a_strong_subtree_held_for_rpcs_keeps_others_out_until_let_go_or_lapsed() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let lease = Duration::from_millis(1500);
        let svc = Service::start(store.fs(), None, lease).unwrap();
        let addr = svc.addr.clone();
        let ca = connect(&addr, "holder");
        let cb = connect(&addr, "other");
        let b = RemoteFs::new(cb.clone());
        let c = Ctx::root();
        let jobs = b.mkdir(b.root(), b"jobs", 0o777, &c).unwrap().ino;
        let job = b.mkdir(jobs, b"job", 0o777, &c).unwrap().ino;
        ca.set_policy(job, "consistency=strong durability=global interfere=block")
            .unwrap();
        let a = RemoteFs::holding(ca.clone(), job).unwrap();
        assert_eq!(ca.policy(job).unwrap().holder, Some(ca.id()));
        // A hold again by its holder changes nothing.
        ca.hold(job).unwrap();
        let f = a
            .mknod(job, b"mine", libc::S_IFREG | 0o644, 0, &user())
            .unwrap();
        a.write(f.ino, 0, b"held", &user()).unwrap();
        // Everyone else is kept out of it: requests, holds, decoupling, and holds of a
        // directory above it; the namespace's root is never held.
        assert_eq!(errno(b.lookup(job, b"mine")), libc::EBUSY);
        assert_eq!(
            errno(b.mknod(job, b"theirs", libc::S_IFREG | 0o644, 0, &user())),
            libc::EBUSY
        );
        assert_eq!(errno(cb.hold(job)), libc::EBUSY);
        assert_eq!(errno(cb.hold(jobs)), libc::EBUSY);
        assert!(cb.decouple(job, DecoupleOptions::default()).is_err());
        assert_eq!(errno(cb.hold(cb.root())), libc::EINVAL);
        // Nor may anyone let go of it but its holder.
        assert_eq!(errno(cb.let_go(job)), libc::EPERM);
        // A hold for RPCs merges nothing.
        let h = Header {
            client: ca.id(),
            subtree: job,
        };
        let mut j = ClientJournal::new(h, 1);
        j.append(&Event {
            uid: 1000,
            gid: 1000,
            op: FsOp::Unlink {
                parent: job,
                name: b"mine".to_vec(),
            },
        });
        let merge = ca.call(Request::Merge {
            client: ca.id(),
            subtree: job,
            journal: journal::encode(&h, &[j.seal().unwrap()]),
            durable: false,
        });
        assert_eq!(merge.unwrap_err().errno, libc::EPERM);
        assert_eq!(a.lookup(job, b"mine").unwrap().ino, f.ino);

        // The hold and its block survive a restart of the service.
        svc.stop().unwrap();
        let svc = Service::start(store.fs(), Some(&addr), lease).unwrap();
        assert_eq!(errno(b.lookup(job, b"mine")), libc::EBUSY);
        assert_eq!(ca.policy(job).unwrap().holder, Some(ca.id()));

        // Let go: the others are in.
        a.let_go().unwrap();
        a.let_go().unwrap();
        assert_eq!(ca.policy(job).unwrap().holder, None);
        refusals_forgotten();
        assert_eq!(b.read(f.ino, 0, 10).unwrap(), b"held");
        b.mknod(job, b"theirs", libc::S_IFREG | 0o644, 0, &user())
            .unwrap();

        // A holder that dies: once its lease lapsed, its block lapses and another
        // client may take the hold (nothing of the dead one's is waiting to merge).
        let cd = connect(&addr, "dies");
        cd.hold(job).unwrap();
        assert_eq!(errno(b.lookup(job, b"mine")), libc::EBUSY);
        drop(cd);
        std::thread::sleep(lease + Duration::from_millis(500));
        assert_eq!(b.lookup(job, b"mine").unwrap().ino, f.ino);
        cb.hold(job).unwrap();
        assert_eq!(ca.policy(job).unwrap().holder, Some(cb.id()));
        assert_eq!(errno(a.lookup(job, b"mine")), libc::EBUSY);
        // Under interfere=allow a hold keeps nobody out.
        cb.set_policy(job, "interfere=allow").unwrap();
        refusals_forgotten();
        assert_eq!(a.lookup(job, b"mine").unwrap().ino, f.ino);
        cb.let_go(job).unwrap();
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

#[test]
fn an_open_file_outlives_its_unlink_until_closed_or_its_client_is_gone() {
    for kind in KINDS {
        let dev = mkfs(kind);
        let store = Store::open(kind, dev.clone());
        let lease = Duration::from_millis(1500);
        let svc = Service::start(store.fs(), None, lease).unwrap();
        let a = RemoteFs::new(connect(&svc.addr, "opener"));
        let b = RemoteFs::new(connect(&svc.addr, "remover"));
        let c = Ctx::root();
        let d = a.mkdir(a.root(), b"d", 0o777, &c).unwrap().ino;
        // Created open (the kernel's CREATE, one request), unlinked by another client.
        let f = a
            .create_open(d, b"f", libc::S_IFREG | 0o644, &user())
            .unwrap();
        a.write(f.ino, 0, b"still here", &user()).unwrap();
        b.unlink(d, b"f", &user()).unwrap();
        assert_eq!(errno(b.lookup(d, b"f")), libc::ENOENT);
        assert_eq!(a.read(f.ino, 0, 100).unwrap(), b"still here");
        a.write(f.ino, 10, b", written after", &user()).unwrap();
        assert_eq!(a.getattr(f.ino).unwrap().nlink, 0);
        // Opened twice, closed twice: gone after the last close.
        a.open(f.ino).unwrap();
        a.release(f.ino).unwrap();
        assert_eq!(a.read(f.ino, 0, 100).unwrap(), b"still here, written after");
        a.release(f.ino).unwrap();
        assert!(
            gone(&a, f.ino),
            "{kind:?}: the file outlived its last close"
        );
        // A plain open, and a client that dies holding it: its lease ends the handle.
        let g = b.mknod(d, b"g", libc::S_IFREG | 0o644, 0, &user()).unwrap();
        {
            let dies = RemoteFs::new(connect(&svc.addr, "dies"));
            dies.open(g.ino).unwrap();
            b.unlink(d, b"g", &user()).unwrap();
            assert_eq!(dies.read(g.ino, 0, 10).unwrap(), b"");
        }
        assert!(b.getattr(g.ino).is_ok(), "{kind:?}: freed while open");
        std::thread::sleep(lease + Duration::from_millis(1200));
        // The sweep runs on the next request after the lease lapsed.
        assert!(
            gone(&b, g.ino),
            "{kind:?}: a dead client's handle kept the file"
        );
        // Closing what is not open changes nothing; an open of nothing is refused.
        a.release(12345).unwrap();
        assert_eq!(errno(a.open(f.ino)), errno(a.getattr(f.ino)));
        svc.stop().unwrap();
        store.unmount();
        check(kind, &dev);
    }
}

/// A client kept out of a held subtree that keeps asking is refused by its own
/// library for a moment after each refusal (2 ms, doubling up to 200 ms), so that the
/// service does not answer it again and again; the holder's going away is seen within
/// that bound.
#[test]
fn a_refused_client_backs_off_and_sees_the_release_within_the_bound() {
    let kind = KINDS[0];
    let dev = mkfs(kind);
    let store = Store::open(kind, dev.clone());
    let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
    let ca = connect(&svc.addr, "holder");
    let b = RemoteFs::new(connect(&svc.addr, "rogue"));
    let c = Ctx::root();
    let job = b.mkdir(b.root(), b"job", 0o777, &c).unwrap().ino;
    ca.set_policy(job, "consistency=strong interfere=block")
        .unwrap();
    ca.hold(job).unwrap();
    // A second of asking as fast as it can: every answer EBUSY, and most of them given
    // without a request (one takes ~100 µs on loopback: at most ~10,000 a second).
    let t = std::time::Instant::now();
    let mut calls = 0u64;
    while t.elapsed() < Duration::from_secs(1) {
        let r = b.mknod(job, b"x", libc::S_IFREG | 0o644, 0, &user());
        assert_eq!(errno(r), libc::EBUSY);
        calls += 1;
    }
    assert!(
        calls > 50_000,
        "only {calls} calls in a second: no backing off"
    );
    // Another directory is not refused by the memory of this one.
    let other = b.mkdir(b.root(), b"other", 0o777, &c).unwrap().ino;
    b.mknod(other, b"y", libc::S_IFREG | 0o644, 0, &user())
        .unwrap();
    ca.let_go(job).unwrap();
    let t = std::time::Instant::now();
    loop {
        match b.mknod(job, b"x", libc::S_IFREG | 0o644, 0, &user()) {
            Ok(_) => break,
            Err(e) => assert_eq!(e.errno(), libc::EBUSY),
        }
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "still refused {:?} after the release",
            t.elapsed()
        );
    }
    svc.stop().unwrap();
    store.unmount();
    check(kind, &dev);
}

/// A decoupled view's handle on an older file (made before the decoupling) is the
/// service's: the view's journal unlinks the file, the merge applies it, and the open
/// file still reads until the view closes it.
#[test]
fn an_older_file_open_in_a_decoupled_view_outlives_the_merged_unlink() {
    let kind = KINDS[0];
    let dev = mkfs(kind);
    let store = Store::open(kind, dev.clone());
    let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
    let ca = connect(&svc.addr, "decoupled");
    let a = RemoteFs::new(ca.clone());
    let c = Ctx::root();
    let job = a.mkdir(a.root(), b"job", 0o777, &c).unwrap().ino;
    let old = a
        .mknod(job, b"old", libc::S_IFREG | 0o644, 0, &user())
        .unwrap();
    a.write(old.ino, 0, b"from before", &user()).unwrap();
    ca.set_policy(job, "consistency=weak durability=none sync=0")
        .unwrap();
    let view =
        quilt_cudele::DecoupledFs::open(ca.clone(), job, DecoupleOptions::default()).unwrap();
    let seen = view.lookup(job, b"old").unwrap();
    FileSystem::open(&view, seen.ino).unwrap();
    view.unlink(job, b"old", &user()).unwrap();
    view.sync().unwrap();
    // Merged: the name is gone at the service, the open file is not.
    let b = RemoteFs::new(connect(&svc.addr, "other"));
    assert_eq!(errno(a.lookup(job, b"old")), libc::ENOENT);
    assert_eq!(view.read(seen.ino, 0, 100).unwrap(), b"from before");
    FileSystem::release(&view, seen.ino).unwrap();
    assert!(gone(&b, seen.ino), "the file outlived its last close");
    view.release().unwrap();
    svc.stop().unwrap();
    store.unmount();
    check(kind, &dev);
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let kind = Kind::Betrfs;
    let dev = mkfs(kind);
    let store = Store::open(kind, dev.clone());
    let svc = Service::start(store.fs(), None, Duration::from_secs(30)).unwrap();
    let ca = connect(&svc.addr, "holder");
    let cb = connect(&svc.addr, "other");
    let a = RemoteFs::new(ca.clone());
    let c = Ctx::root();
    let job = a.mkdir(a.root(), b"job", 0o777, &c).unwrap().ino;
    ca.set_policy(job, "consistency=weak sync=0").unwrap();
    let _d = ca.decouple(job, DecoupleOptions::default()).unwrap();
    let before = names(&a, job);
    let call = |cl: &Client, r: Request| cl.call(r).err().map(|e| e.errno);
    // A journal that is garbage, truncated, or another client's.
    let garbage = vec![0xAB; 300];
    assert_eq!(
        call(
            &ca,
            Request::Merge {
                client: ca.id(),
                subtree: job,
                journal: garbage,
                durable: true
            }
        ),
        Some(libc::EINVAL)
    );
    let h = Header {
        client: ca.id(),
        subtree: job,
    };
    let mut j = ClientJournal::new(h, 1);
    j.append(&Event {
        uid: 0,
        gid: 0,
        op: FsOp::Mknod {
            parent: 987_654_321,
            name: b"dangling".to_vec(),
            mode: libc::S_IFREG | 0o644,
            rdev: 0,
            ino: Some(1 << 30),
        },
    });
    let bytes = journal::encode(&h, &[j.seal().unwrap()]);
    assert_eq!(
        call(
            &ca,
            Request::Merge {
                client: ca.id(),
                subtree: job,
                journal: bytes[..bytes.len() - 3].to_vec(),
                durable: false
            }
        ),
        Some(libc::EINVAL)
    );
    assert_eq!(
        call(
            &ca,
            Request::Merge {
                client: ca.id(),
                subtree: job,
                journal: bytes.clone(),
                durable: false
            }
        ),
        Some(libc::EINVAL),
        "a dangling parent and a number never granted"
    );
    // A client that does not hold the subtree cannot merge into it.
    assert_eq!(
        call(
            &cb,
            Request::Merge {
                client: cb.id(),
                subtree: job,
                journal: bytes,
                durable: false
            }
        ),
        Some(libc::EPERM)
    );
    // A client number nobody was given; a hello with the wrong secret.
    assert_eq!(
        call(
            &ca,
            Request::Op {
                client: 9999,
                creds: Default::default(),
                op: FsOp::Getattr { ino: job }
            }
        ),
        Some(libc::EACCES)
    );
    let e = Client::connect(&svc.addr, "wrong", None, "intruder")
        .err()
        .unwrap();
    assert!(e.contains("secret"), "{e}");
    // A policy setting that is not one.
    assert_eq!(
        ca.set_policy(job, "consistency=eventual")
            .err()
            .unwrap()
            .errno,
        libc::EINVAL
    );
    // Letting go of another client's hold, as itself and posing as the holder (its
    // number without its token).
    assert_eq!(
        call(
            &cb,
            Request::Release {
                client: cb.id(),
                subtree: job
            }
        ),
        Some(libc::EPERM)
    );
    assert_eq!(
        call(
            &cb,
            Request::Release {
                client: ca.id(),
                subtree: job
            }
        ),
        Some(libc::EACCES)
    );
    assert_eq!(
        call(
            &cb,
            Request::Merge {
                client: ca.id(),
                subtree: job,
                journal: Vec::new(),
                durable: false
            }
        ),
        Some(libc::EACCES)
    );
    assert_eq!(names(&a, job), before);
    svc.stop().unwrap();
    store.unmount();
    check(kind, &dev);
}

/// A store that numbers its creations as they are made and remembers how far each
/// sync reached (what had been made when it began): a creation is durable once a sync
/// that began after it has ended.
struct Counted {
    inner: Arc<dyn FileSystem>,
    made: std::sync::atomic::AtomicU64,
    synced: std::sync::atomic::AtomicU64,
    order: std::sync::Mutex<std::collections::HashMap<Vec<u8>, u64>>,
}

impl FileSystem for Counted {
    fn root(&self) -> u64 {
        self.inner.root()
    }
    fn lookup(&self, p: u64, n: &[u8]) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.lookup(p, n)
    }
    fn getattr(&self, i: u64) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.getattr(i)
    }
    fn setattr(
        &self,
        i: u64,
        s: quilt_vfs::SetAttr,
        c: &Ctx,
    ) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.setattr(i, s, c)
    }
    fn mknod(
        &self,
        p: u64,
        n: &[u8],
        m: u32,
        r: u32,
        c: &Ctx,
    ) -> quilt_vfs::Result<quilt_vfs::Attr> {
        let a = self.inner.mknod(p, n, m, r, c)?;
        // Numbered under the lock, so that the numbers follow the order made.
        let mut o = self.order.lock().unwrap();
        let k = self.made.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        o.insert(n.to_vec(), k);
        Ok(a)
    }
    fn mkdir(&self, p: u64, n: &[u8], m: u32, c: &Ctx) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.mkdir(p, n, m, c)
    }
    fn unlink(&self, p: u64, n: &[u8], c: &Ctx) -> quilt_vfs::Result<()> {
        self.inner.unlink(p, n, c)
    }
    fn rmdir(&self, p: u64, n: &[u8], c: &Ctx) -> quilt_vfs::Result<()> {
        self.inner.rmdir(p, n, c)
    }
    fn symlink(&self, p: u64, n: &[u8], t: &[u8], c: &Ctx) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.symlink(p, n, t, c)
    }
    fn readlink(&self, i: u64) -> quilt_vfs::Result<Vec<u8>> {
        self.inner.readlink(i)
    }
    fn rename(
        &self,
        p: u64,
        n: &[u8],
        np: u64,
        nn: &[u8],
        f: quilt_vfs::RenameFlags,
        c: &Ctx,
    ) -> quilt_vfs::Result<()> {
        self.inner.rename(p, n, np, nn, f, c)
    }
    fn link(&self, i: u64, np: u64, nn: &[u8], c: &Ctx) -> quilt_vfs::Result<quilt_vfs::Attr> {
        self.inner.link(i, np, nn, c)
    }
    fn read(&self, i: u64, o: u64, s: u32) -> quilt_vfs::Result<Vec<u8>> {
        self.inner.read(i, o, s)
    }
    fn write(&self, i: u64, o: u64, d: &[u8], c: &Ctx) -> quilt_vfs::Result<u32> {
        self.inner.write(i, o, d, c)
    }
    fn readdir(
        &self,
        i: u64,
        o: u64,
        e: &mut dyn FnMut(quilt_vfs::DirEntry) -> bool,
    ) -> quilt_vfs::Result<()> {
        self.inner.readdir(i, o, e)
    }
    fn statfs(&self) -> quilt_vfs::Result<quilt_vfs::StatFs> {
        self.inner.statfs()
    }
    fn fsync(&self, i: u64, d: bool) -> quilt_vfs::Result<()> {
        self.inner.fsync(i, d)
    }
    fn sync_all(&self) -> quilt_vfs::Result<()> {
        let upto = self.made.load(std::sync::atomic::Ordering::SeqCst);
        // A slow disk: other requests make their changes meanwhile.
        std::thread::sleep(Duration::from_millis(2));
        self.inner.sync_all()?;
        self.synced
            .fetch_max(upto, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn setxattr(
        &self,
        i: u64,
        n: &[u8],
        v: &[u8],
        f: quilt_vfs::XattrFlags,
        c: &Ctx,
    ) -> quilt_vfs::Result<()> {
        self.inner.setxattr(i, n, v, f, c)
    }
    fn getxattr(&self, i: u64, n: &[u8]) -> quilt_vfs::Result<Vec<u8>> {
        self.inner.getxattr(i, n)
    }
    fn listxattr(&self, i: u64) -> quilt_vfs::Result<Vec<u8>> {
        self.inner.listxattr(i)
    }
    fn removexattr(&self, i: u64, n: &[u8], c: &Ctx) -> quilt_vfs::Result<()> {
        self.inner.removexattr(i, n, c)
    }
}

/// Stream (global durability) under concurrent clients: every creation is answered
/// only after a sync that began once it was made, whoever's sync that was.
#[test]
fn under_global_durability_every_answered_change_was_synced_after_it_was_made() {
    let kind = Kind::Betrfs;
    let dev = mkfs(kind);
    let store = Store::open(kind, dev.clone());
    let counted = Arc::new(Counted {
        inner: store.fs(),
        made: Default::default(),
        synced: Default::default(),
        order: Default::default(),
    });
    let svc = Service::start(counted.clone(), None, Duration::from_secs(30)).unwrap();
    let setup = RemoteFs::new(connect(&svc.addr, "setup"));
    let dir = setup
        .mkdir(setup.root(), b"d", 0o777, &Ctx::root())
        .unwrap()
        .ino;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (addr, counted) = (svc.addr.clone(), counted.clone());
            std::thread::spawn(move || {
                let fs = RemoteFs::new(connect(&addr, "writer"));
                for i in 0..60 {
                    let name = format!("t{t}.{i}").into_bytes();
                    fs.mknod(dir, &name, libc::S_IFREG | 0o644, 0, &user())
                        .unwrap();
                    let made = counted.order.lock().unwrap()[&name];
                    let synced = counted.synced.load(std::sync::atomic::Ordering::SeqCst);
                    assert!(
                        synced >= made,
                        "creation {made} answered with syncs only up to {synced}"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    svc.stop().unwrap();
    drop(counted);
    store.unmount();
    check(kind, &dev);
}
