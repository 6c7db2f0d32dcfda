//! A volume on three replicas in one process: writes and reads, a replica down and
//! back (reserve stand-ins, Phase 1 and Phase 2), data spread (f+1 copies each), and
//! bad requests answered with errors.

use quilt_gnothi::client::{ClientConfig, ClientError};
use quilt_gnothi::node::NodeConfig;
use quilt_gnothi::rpc::{Request, Response, MAX_MESSAGE};
use quilt_gnothi::sim::{Cluster, Faults};
use quilt_gnothi::{Geometry, System};
use std::time::Duration;

const BS: usize = 512;

fn block(tag: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (tag.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8;
    }
    b
}

fn config() -> NodeConfig {
    NodeConfig {
        recovery_interval: Duration::from_millis(5),
        ..NodeConfig::default()
    }
}

async fn wait_for<F: Fn() -> bool>(what: &str, f: F) {
    for _ in 0..400 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_survive_a_replica_down_and_it_catches_up() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 256, 16).unwrap();
    let mut c = Cluster::start(g, 1, Faults::default(), config())
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();

    // Unwritten blocks read as zeros; a write spanning slices reads back.
    assert_eq!(client.read(0, 4).await.unwrap(), vec![0u8; 4 * BS]);
    let data: Vec<u8> = (0..40).flat_map(block).collect();
    client.write(10, &data).await.unwrap();
    assert_eq!(client.read(10, 40).await.unwrap(), data);

    // Each block is held by exactly f+1 = 2 replicas (its preferred quorum).
    let t = c.node(0).unwrap().machine().lock().table().clone();
    for b in 10..50 {
        let m = t.meta(b).unwrap();
        assert_eq!(m.holders.len(), 2, "block {b}");
        assert!(m.reserve.is_empty());
    }

    // Replica 2 goes down: writes to every slice still complete (reserve copies
    // standing in), and read back.
    c.crash(2).await;
    let data2: Vec<u8> = (100..164).flat_map(block).collect();
    client.write(64, &data2).await.unwrap();
    assert_eq!(client.read(64, 64).await.unwrap(), data2);
    let reserve: u64 = (0..2)
        .map(|r| c.node(r).unwrap().status().reserve_used)
        .sum();
    assert!(reserve > 0, "some writes needed a reserve stand-in");

    // It comes back: Phase 1 (metadata) then Phase 2 (data) bring it level, and the
    // reserve empties.
    c.start_replica(2).await.unwrap();
    let n2 = c.node(2).unwrap().clone();
    wait_for("replica 2 to fetch what it missed", || {
        n2.status().incomplete == 0
    })
    .await;
    let (n0, n1) = (c.node(0).unwrap().clone(), c.node(1).unwrap().clone());
    wait_for("the reserve to be reclaimed", || {
        n0.status().reserve_used + n1.status().reserve_used + n2.status().reserve_used == 0
    })
    .await;
    // With replica 0 down now, everything is still readable from the others.
    c.crash(0).await;
    assert_eq!(client.read(10, 40).await.unwrap(), data);
    assert_eq!(client.read(64, 64).await.unwrap(), data2);
    c.shutdown().await;
}

/// `Inspect`: each replica's table entry and copies of a block, as a violation's
/// diagnosis shows them; a damaged copy shows as a checksum mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_replica_shows_its_view_of_a_block() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    let mut c = Cluster::start(g, 3, Faults::default(), config())
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    let mut data = block(7);
    data[..8].copy_from_slice(&0xabcd_u64.to_le_bytes());
    client.write(3, &data).await.unwrap();
    // Every replica has applied the write once one read saw it everywhere.
    wait_for("every replica to apply the write", || {
        (0..3).all(|r| {
            c.node(r).is_some_and(|n| {
                n.machine()
                    .lock()
                    .table()
                    .meta(3)
                    .is_some_and(|m| m.version > 0)
            })
        })
    })
    .await;
    let preferred = g.preferred(g.slice_of(3));
    let mut views = Vec::new();
    for r in 0..3u16 {
        views.push(client.inspect(r, 3).await.unwrap());
    }
    for (r, v) in views.iter().enumerate() {
        let r = r as u16;
        assert_eq!(v.replica, r);
        assert_eq!(v.version, views[0].version, "one table everywhere");
        assert_eq!(v.checksum, crc32c::crc32c(&data));
        assert_eq!(v.holders.iter().collect::<Vec<_>>(), preferred);
        if preferred.contains(&r) {
            assert_eq!(v.home, Some((0xabcd, true)), "replica {r}");
        } else {
            assert_eq!(v.home, None, "replica {r} keeps no home copy of this slice");
        }
        assert_eq!(v.reserved, None);
        assert_eq!(v.lost, None);
    }
    // Outside the volume: an error, not a view.
    assert!(client.inspect(0, 64).await.is_err());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_f_down_refuses_and_loses_nothing() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    let mut c = Cluster::start(g, 2, Faults::default(), config())
        .await
        .unwrap();
    let cfg = ClientConfig {
        op_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    };
    let client = c.client(1, cfg).await.unwrap();
    client.write(0, &block(1)).await.unwrap();
    c.crash(1).await;
    c.crash(2).await;
    let e = client.write(0, &block(2)).await.unwrap_err();
    assert!(matches!(e, ClientError::Unavailable(_)), "{e}");
    assert!(client.read(0, 1).await.is_err());
    c.start_replica(1).await.unwrap();
    c.start_replica(2).await.unwrap();
    // The failed write either happened or not; the acknowledged one is not lost.
    let got = client.read(0, 1).await.unwrap();
    assert!(got == block(1) || got == block(2));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors_and_the_replica_serves_on() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    let mut c = Cluster::start(g, 3, Faults::default(), config())
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    assert!(matches!(
        client.write(60, &vec![1u8; 8 * BS]).await,
        Err(ClientError::OutOfRange { .. })
    ));
    assert!(matches!(
        client.write(0, &[1u8; 100]).await,
        Err(ClientError::Unaligned { .. })
    ));
    let n = c.node(0).unwrap().clone();
    for req in [
        Request::Read {
            first: 63,
            count: 2,
        },
        Request::Read {
            first: u64::MAX,
            count: 1,
        },
        Request::Fetch { first: 0, count: 0 },
        Request::PutData {
            write: quilt_gnothi::WriteId { client: 9, seq: 0 },
            first: 63,
            data: vec![0u8; 2 * BS],
        },
        Request::PutData {
            write: quilt_gnothi::WriteId { client: 9, seq: 1 },
            first: 0,
            data: vec![0u8; 3],
        },
    ] {
        match n.handle(req).await {
            Response::Error(_) => {}
            other => panic!("a bad request was served: {other:?}"),
        }
    }
    client.write(1, &block(5)).await.unwrap();
    assert_eq!(client.read(1, 1).await.unwrap(), block(5));
    c.shutdown().await;
}

/// A long run of small writes on replicas whose Raft log ring holds a few hundred
/// entries: snapshots (and the purges after them) keep the ring from filling, which
/// would stop agreement on every replica at once. (Found by `tests/gnothi-faults.sh`:
/// with the default ring, a volume died after about 4,000 entries.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_log_ring_never_fills() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    // 256 KiB of 512-byte blocks: 512 blocks, two or more a record.
    let mut c = Cluster::start_with_log(g, 3, Faults::default(), config(), 256 << 10)
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    for i in 0..1500u64 {
        client
            .write(i % 64, &block(i))
            .await
            .unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    for b in 0..64 {
        let last = (0..1500u64).filter(|i| i % 64 == b).max().unwrap();
        assert_eq!(client.read(b, 1).await.unwrap(), block(last), "block {b}");
    }
    for r in 0..3 {
        let st = c.node(r).unwrap().status();
        assert!(st.applied >= 1500, "replica {r} applied {}", st.applied);
    }
    c.shutdown().await;
}

/// A replica rebuilding its data disk while one block has no copy left anywhere (lost
/// beyond f): the rest of the rebuild still completes. (Phase 2 used to retry the first
/// block it lacked for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_lost_everywhere_does_not_stall_the_rebuild() {
    use quilt_gnothi::meta::Proposal;
    use quilt_gnothi::Command;
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    let mut c = Cluster::start(g, 5, Faults::default(), config())
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    let data: Vec<u8> = (0..64).flat_map(block).collect();
    client.write(0, &data).await.unwrap();
    // Slice 0's preferred quorum; the rebuilt replica is its first.
    let quorum = g.preferred(0);
    let (r, other) = (quorum[0], quorum[1]);
    let survivor = (0..3).find(|&x| x != r).unwrap();
    c.crash(r).await;
    assert!(c.replace_data_disk(r).await, "the volume took the news");
    // Block 0's other copy is lost too: no replica holds it any more.
    let version = c
        .node(survivor)
        .unwrap()
        .machine()
        .lock()
        .table()
        .meta(0)
        .unwrap()
        .version;
    let lost = Proposal {
        session: None,
        command: Command::Lost {
            replica: other,
            blocks: Some(vec![(0, version)]),
        },
    };
    assert!(c
        .node(survivor)
        .unwrap()
        .propose_through_leader(lost)
        .await
        .is_some());
    c.start_replica(r).await.unwrap();
    let n = c.node(r).unwrap().clone();
    wait_for(
        "every other block of replica r's slices to be rebuilt",
        || n.status().incomplete == 1,
    )
    .await;
    // Block 0 reads as an error, never as wrong data; the others read back.
    assert!(client.read(0, 1).await.is_err());
    assert_eq!(client.read(1, 63).await.unwrap(), data[BS..].to_vec());
    c.shutdown().await;
}

/// A whole server replaced (both disks gone) through a membership change, while a
/// client writes: the new server joins empty, is let in in the old one's slot, and
/// Phase 2 rebuilds its copies; then any one other server may fail and every
/// acknowledged write still reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_server_replaced_is_rebuilt_and_counts() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 128, 16).unwrap();
    let mut c = Cluster::start(g, 11, Faults::default(), config())
        .await
        .unwrap();
    let client = std::sync::Arc::new(c.client(1, ClientConfig::default()).await.unwrap());
    let before: Vec<u8> = (0..128).flat_map(block).collect();
    client.write(0, &before).await.unwrap();
    // Writes go on during the change (each block written again, one at a time).
    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            for b in 0..64u64 {
                client.write(b, &block(1000 + b)).await.unwrap();
            }
        })
    };
    let new = c
        .replace_server(1, false, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(new, 4, "slot 1's second server is 1 + 3");
    writer.await.unwrap();
    let n1 = c.node(1).unwrap().clone();
    assert_eq!(n1.node_id, 4);
    wait_for("the new server to be a member and rebuilt", || {
        let s = n1.status();
        s.is_member && s.incomplete == 0
    })
    .await;
    // Every member agrees slot 1 is the new server.
    for r in [0, 2] {
        let s = c.node(r).unwrap().status();
        assert_eq!(s.slots[1].as_ref().map(|x| x.0), Some(4), "replica {r}");
        assert!(!s.members.contains(&1), "the old server is no member");
    }
    wait_for("every block back on f+1 copies", || c.fully_redundant()).await;
    let expect: Vec<u8> = (0..128)
        .flat_map(|b| if b < 64 { block(1000 + b) } else { block(b) })
        .collect();
    assert_eq!(client.read(0, 128).await.unwrap(), expect);
    // The copies the new server holds count: with slot 0 down, then slot 2 (the
    // other back), every block reads from what remains.
    for down in [0u16, 2] {
        c.crash(down).await;
        let fresh = c
            .client(10 + u64::from(down), ClientConfig::default())
            .await
            .unwrap();
        assert_eq!(
            fresh.read(0, 128).await.unwrap(),
            expect,
            "slot {down} down"
        );
        c.start_replica(down).await.unwrap();
        wait_for("it to catch up", || c.fully_redundant()).await;
    }
    c.shutdown().await;
}

/// A write routed by the membership before a server was replaced names copies on the
/// old server (which may still run and answer): it is refused, never counted. The
/// client routes again and the write lands on the new server. Phase 2 is off here, so
/// every copy the table counts must have come from a store: the new server must hold
/// each block the table says it holds, and with the slice's other server down every
/// block reads from it alone. (Without the fence, the stale client's writes counted
/// the old server's copies as the new one's: acknowledged on one real copy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_routed_to_a_replaced_server_is_refused_then_rerouted() {
    use quilt_gnothi::meta::{Outcome, Proposal};
    use quilt_gnothi::replica::LocalRead;
    use quilt_gnothi::Command;
    use quilt_gnothi::{CommandError, Stored, WriteId};
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 64, 16).unwrap();
    let slow = NodeConfig {
        recovery_interval: Duration::from_secs(3600),
        ..NodeConfig::default()
    };
    let mut c = Cluster::start(g, 12, Faults::default(), slow)
        .await
        .unwrap();
    // Connected before the change: it routes slot 1 to server 1.
    let stale = c.client(1, ClientConfig::default()).await.unwrap();
    stale.write(0, &block(1)).await.unwrap();
    let epoch_before = c.node(0).unwrap().status().epoch;
    // The old server keeps running (cut off from the change, say).
    c.replace_server(1, true, Duration::from_secs(20))
        .await
        .unwrap();
    let n0 = c.node(0).unwrap().clone();
    assert!(n0.status().epoch > epoch_before);
    // Directly: a write naming slot 1's copy under the old membership is refused.
    let quorum = g.preferred(0);
    assert_eq!(quorum, vec![0, 1]);
    let old = Proposal {
        session: None,
        command: Command::Fenced {
            epoch: epoch_before,
            command: Box::new(Command::Write {
                write: WriteId { client: 77, seq: 0 },
                first: 0,
                checksums: vec![crc32c::crc32c(&block(2))],
                stored: quorum.iter().map(|&r| Stored::Home(r)).collect(),
            }),
        },
    };
    match n0.propose_through_leader(old).await {
        Some(Outcome::Refused(CommandError::StaleMembership { epoch, current })) => {
            assert_eq!(epoch, epoch_before);
            assert!(current > epoch_before);
        }
        other => panic!("a write routed by the old membership: {other:?}"),
    }
    // Through the stale client: refused, rerouted, acknowledged.
    for b in 0..16u64 {
        stale.write(b, &block(500 + b)).await.unwrap();
    }
    let n1 = c.node(1).unwrap().clone();
    // Every write was applied by the leader before it was acknowledged.
    let leader = (0..3)
        .filter_map(|r| c.node(r))
        .find(|n| n.status().is_leader)
        .unwrap()
        .clone();
    let done = leader.status().applied;
    wait_for("servers 0 and 4 to apply the writes", || {
        n0.status().applied >= done && n1.status().applied >= done
    })
    .await;
    for b in 0..16u64 {
        let holders = n0.machine().lock().table().meta(b).unwrap().holders;
        assert!(
            holders.contains(1),
            "block {b}: slot 1 holds it ({holders:?})"
        );
        match n1.machine().lock().read(b) {
            Ok(LocalRead::Data(d)) => assert_eq!(d, block(500 + b), "block {b}"),
            other => panic!("block {b}: counted on the new server, which has {other:?}"),
        }
    }
    c.crash(0).await;
    let fresh = c.client(20, ClientConfig::default()).await.unwrap();
    let expect: Vec<u8> = (0..16).flat_map(|b| block(500 + b)).collect();
    assert_eq!(fresh.read(0, 16).await.unwrap(), expect);
    c.shutdown().await;
}

/// A replica whose data device is full when its first snapshot comes due keeps
/// agreeing (no snapshot then: the placed data cannot be made durable), and catches up
/// once there is room again. Its first snapshot failing used to stop agreement on it
/// for good (openraft treats a snapshot error as fatal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_data_device_before_the_first_snapshot_stops_nothing() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 96, 16).unwrap();
    let cfg = NodeConfig {
        snapshot_every: 16,
        keep_after_snapshot: 4,
        write_back_every: Duration::from_secs(3600),
        ..config()
    };
    let mut c = Cluster::start(g, 13, Faults::default(), cfg).await.unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    c.data_disk(2).set_full(true);
    let n2 = c.node(2).unwrap().clone();
    let data: Vec<Vec<u8>> = (0..96u64).map(|b| block(3000 + b)).collect();
    // From the end: slice 5 is replica 2's, so its very first snapshot is due with
    // placed data it cannot make durable.
    for (b, d) in data.iter().enumerate().rev() {
        client.write(b as u64, d).await.unwrap();
    }
    // Well past the first snapshot's due point: replica 2 still agrees.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), n2.fatal())
            .await
            .is_err(),
        "agreement stopped on the replica with the full data device"
    );
    let leader_applied = (0..3)
        .filter_map(|r| c.node(r))
        .map(|n| n.status().applied)
        .max()
        .unwrap();
    wait_for("replica 2 to apply every write", || {
        n2.status().applied >= leader_applied
    })
    .await;
    // Room again: it catches up, and the volume reads with either other replica down.
    c.data_disk(2).set_full(false);
    wait_for("every block back on f+1 copies", || c.fully_redundant()).await;
    let all: Vec<u8> = data.concat();
    for down in [0u16, 1] {
        c.crash(down).await;
        let fresh = c
            .client(30 + u64::from(down), ClientConfig::default())
            .await
            .unwrap();
        assert_eq!(fresh.read(0, 96).await.unwrap(), all, "replica {down} down");
        c.start_replica(down).await.unwrap();
        wait_for("it to catch up", || c.fully_redundant()).await;
    }
    c.shutdown().await;
}

/// Cheap Paxos: while both mains answer, the auxiliary hears nothing of agreement (its
/// log does not grow, it never leads); when a main fails, it votes on commits and writes
/// go on; once the main is back, it falls idle again. Nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_paxos_auxiliaries_act_only_while_a_main_is_down() {
    let g = Geometry::new(System::CheapPaxos, 1, BS as u32, 64, 16).unwrap();
    let mut c = Cluster::start(g, 11, Faults::default(), config())
        .await
        .unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    let mut want = vec![Vec::new(); 64];
    for i in 0..30u64 {
        client.write(i % 64, &block(i)).await.unwrap();
        want[(i % 64) as usize] = block(i);
    }
    let aux = c.node(2).unwrap().clone();
    let leader = |c: &Cluster| (0..3).find(|&r| c.node(r).is_some_and(|n| n.status().is_leader));
    let main_index = c.node(0).unwrap().status().last_log_index;
    let idle_index = aux.status().last_log_index;
    assert!(
        idle_index + 20 < main_index,
        "the auxiliary's log grew with the mains' ({idle_index} of {main_index}; leader {:?})",
        leader(&c)
    );
    assert!(matches!(leader(&c), Some(0 | 1)), "the leader is a main");

    // Main 1 fails (the leader or not): writes go on with the auxiliary's votes, and its
    // log follows now.
    c.crash(1).await;
    for i in 30..60u64 {
        client.write(i % 64, &block(i)).await.unwrap();
        want[(i % 64) as usize] = block(i);
    }
    let n0 = c.node(0).unwrap().clone();
    wait_for("the auxiliary to follow while a main is down", || {
        aux.status().applied >= n0.status().applied.saturating_sub(2)
            && aux.status().last_log_index > main_index
    })
    .await;
    assert_eq!(
        leader(&c),
        Some(0),
        "main 0 leads, elected with the auxiliary's vote"
    );
    for b in 0..64u64 {
        let got = client.read(b, 1).await.unwrap();
        if !want[b as usize].is_empty() {
            assert_eq!(got, want[b as usize], "block {b} with main 1 down");
        }
    }

    // Main 1 back and caught up: the auxiliary falls idle again.
    c.start_replica(1).await.unwrap();
    let n1 = c.node(1).unwrap().clone();
    wait_for("main 1 to catch up", || {
        n1.status().applied >= n0.status().applied && n1.status().incomplete == 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = aux.status().last_log_index;
    for i in 60..90u64 {
        client.write(i % 64, &block(i)).await.unwrap();
        want[(i % 64) as usize] = block(i);
    }
    let after = aux.status().last_log_index;
    assert!(
        after < before + 5,
        "the auxiliary kept following with both mains up ({before} -> {after})"
    );
    // With the other main down in turn, everything reads back.
    c.crash(0).await;
    for b in 0..64u64 {
        assert_eq!(
            client.read(b, 1).await.unwrap(),
            want[b as usize],
            "block {b}"
        );
    }
    c.shutdown().await;
}

/// A replica down while megabytes of metadata were committed (a checksum per block:
/// 1 MiB writes of 512-byte blocks) catches up. openraft sends a follower that far
/// behind up to 300 entries at once, which came to more than a message may carry
/// (`rpc::MAX_MESSAGE`, as gRPC enforces it and the simulated network now does): it
/// was refused at every retry. With `purge`, the others let go of every entry it
/// missed, and the snapshot of a 160 MiB volume's table (every block's entry) is itself
/// larger than a message: it must go in chunks that fit.
async fn a_replica_down_through_megabytes_of_metadata_catches_up(purge: bool) {
    const SLICE: u64 = 2048; // 1 MiB of 512-byte blocks
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 160 * SLICE, SLICE).unwrap();
    let mut c = Cluster::start_with_log(g, 5, Faults::default(), config(), 32 << 20)
        .await
        .unwrap();
    let client = std::sync::Arc::new(c.client(1, ClientConfig::default()).await.unwrap());
    c.crash(2).await;
    // Only slices replica 2 does not prefer: nothing for it to fetch afterwards, and
    // no reserve needed while it is down; what it missed is metadata alone.
    let slices: Vec<u64> = (0..g.slices()).filter(|&s| !g.prefers(2, s)).collect();
    let data = |i: u64| -> Vec<u8> { (0..SLICE).flat_map(|b| block(i * SLICE + b)).collect() };
    let writes = 160u64;
    for round in 0..writes / 8 {
        let batch = (0..8).map(|k| {
            let i = round * 8 + k;
            let (client, slice) = (client.clone(), slices[(i as usize) % slices.len()]);
            async move { client.write(slice * SLICE, &data(i)).await }
        });
        for r in futures::future::join_all(batch).await {
            r.unwrap();
        }
    }
    let n0 = c.node(0).unwrap().clone();
    let target = n0.status().applied;
    if purge {
        // Every entry replica 2 missed goes into a snapshot and out of the logs: it
        // can catch up from nothing but the snapshot, which is larger than a message.
        let table = n0.machine().lock().table().clone();
        let size = postcard::to_stdvec(&table).unwrap().len();
        assert!(
            size > MAX_MESSAGE,
            "the case under test: a table of {size} bytes"
        );
        for r in 0..2 {
            let raft = c.node(r).unwrap().raft().clone();
            raft.trigger().snapshot().await.unwrap();
            let mut m = raft.metrics();
            while m.borrow().snapshot.map_or(0, |s| s.index) < target {
                m.changed().await.unwrap();
            }
            raft.trigger().purge_log(target).await.unwrap();
            while m.borrow().purged.map_or(0, |p| p.index) < target {
                m.changed().await.unwrap();
            }
        }
    }
    c.start_replica(2).await.unwrap();
    let n2 = c.node(2).unwrap().clone();
    wait_for("replica 2 to apply what it missed", || {
        n2.status().applied >= target
    })
    .await;
    // It agrees on the metadata: the last write to each slice, from its own table.
    let t2 = n2.machine().lock().table().clone();
    let t0 = n0.machine().lock().table().clone();
    for &s in &slices {
        for b in [s * SLICE, s * SLICE + SLICE - 1] {
            assert_eq!(t2.meta(b), t0.meta(b), "block {b}");
        }
    }
    // And it serves reads with the others down in turn.
    let last = |s: u64| {
        (0..writes)
            .filter(|i| slices[(*i as usize) % slices.len()] == s)
            .max()
    };
    for &s in slices.iter().take(4) {
        let i = last(s).unwrap();
        assert_eq!(client.read(s * SLICE, SLICE).await.unwrap(), data(i));
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_far_behind_catches_up_from_a_log_of_large_appends() {
    a_replica_down_through_megabytes_of_metadata_catches_up(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_far_behind_catches_up_from_a_snapshot_larger_than_a_message() {
    a_replica_down_through_megabytes_of_metadata_catches_up(true).await;
}

/// More writes in flight than the replicas' data logs hold (8 MiB each here, 24 MiB
/// of writes at once, all to slices replicas 0 and 1 prefer): every acknowledged
/// write reads back, with any one replica down. A replica out of room used to drop
/// the oldest staged writes not yet applied, some of which then committed naming it:
/// acknowledged writes with no copy anywhere. Now it refuses the new write (its client
/// stands in a reserve or tries again) and lets go of old records only through an
/// `Abandon` entry, after which none of them can commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_beyond_the_data_logs_room_are_refused_never_lost() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GNOTHI_TEST_TRACE"))
        .with_test_writer()
        .try_init();
    const SLICE: u64 = 2048; // 1 MiB of 512-byte blocks
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 72 * SLICE, SLICE).unwrap();
    let mut c = Cluster::start(g, 9, Faults::default(), config())
        .await
        .unwrap();
    let client = std::sync::Arc::new(c.client(1, ClientConfig::default()).await.unwrap());
    let slices: Vec<u64> = (0..g.slices())
        .filter(|&s| g.prefers(0, s) && g.prefers(1, s))
        .collect();
    let data = |i: u64| -> Vec<u8> { (0..SLICE).flat_map(|b| block(i * 7919 + b)).collect() };
    // One write per slice: concurrent writes to one slice may apply in either order.
    let writes: Vec<(u64, u64)> = (0u64..).zip(slices.iter().copied()).collect();
    assert!(
        writes.len() * SLICE as usize * BS > 2 * (8 << 20),
        "more than the logs hold"
    );
    let done = futures::future::join_all(writes.iter().map(|&(i, s)| {
        let client = client.clone();
        async move { client.write(s * SLICE, &data(i)).await }
    }))
    .await;
    for (r, &(i, s)) in done.iter().zip(&writes) {
        if let Err(e) = r {
            panic!("write {i} to slice {s}: {e}");
        }
    }
    // Each write, read with each replica down in turn.
    for down in 0..3u16 {
        c.crash(down).await;
        let fresh = c
            .client(20 + u64::from(down), ClientConfig::default())
            .await
            .unwrap();
        for &(i, s) in &writes {
            match fresh.read(s * SLICE, SLICE).await {
                Ok(d) => assert!(d == data(i), "slice {s} with replica {down} down"),
                Err(e) => panic!("slice {s} with replica {down} down: {e}\n{}", c.describe()),
            }
        }
        c.start_replica(down).await.unwrap();
        wait_for("it to catch up", || c.fully_redundant()).await;
    }
    c.shutdown().await;
}

/// A reserve stand-in accepts only what its reserve has slots for. With replica 2
/// down, writes to a slice it prefers with replica 0 stand in replica 1's reserve
/// (4,096 slots of 512 bytes here). Once that is promised, the next write fails
/// `Unavailable` with nothing committed, and every acknowledged one is on two
/// replicas: it reads back from replica 1's reserve with replica 0 down. (Accepted
/// regardless, the write that found no slot when applied had one copy, though
/// acknowledged on two.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_reserve_refuses_writes_it_cannot_keep() {
    const SLICE: u64 = 2048; // 1 MiB of 512-byte blocks
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 12 * SLICE, SLICE).unwrap();
    let mut c = Cluster::start(g, 13, Faults::default(), config())
        .await
        .unwrap();
    let cfg = ClientConfig {
        op_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    };
    let client = c.client(1, cfg.clone()).await.unwrap();
    let slices: Vec<u64> = (0..g.slices())
        .filter(|&s| g.prefers(0, s) && g.prefers(2, s))
        .collect();
    assert!(slices.len() >= 3);
    c.crash(2).await;
    let data = |i: u64| -> Vec<u8> { (0..SLICE).flat_map(|b| block(i * 104_729 + b)).collect() };
    for (i, &s) in slices.iter().take(2).enumerate() {
        client.write(s * SLICE, &data(i as u64)).await.unwrap();
    }
    // Acknowledged once committed: replica 1 may apply the second a moment later.
    wait_for("both copies in replica 1's reserve", || {
        c.node(1).unwrap().status().reserve_used == 2 * SLICE
    })
    .await;
    let third = client.write(slices[2] * SLICE, &data(2)).await;
    assert!(
        matches!(third, Err(ClientError::Unavailable(_))),
        "{third:?}"
    );
    c.crash(0).await;
    c.start_replica(2).await.unwrap();
    let fresh = c.client(2, cfg).await.unwrap();
    for (i, &s) in slices.iter().take(2).enumerate() {
        assert_eq!(
            fresh.read(s * SLICE, SLICE).await.unwrap(),
            data(i as u64),
            "slice {s}, from replica 1's reserve"
        );
    }
    assert_eq!(
        fresh.read(slices[2] * SLICE, SLICE).await.unwrap(),
        vec![0u8; SLICE as usize * BS],
        "the refused write changed nothing"
    );
    c.shutdown().await;
}

/// Phase 2 fetches up to `fetch_bytes` (the paper's 16 MiB) per recovery interval,
/// though a message carries at most 1 MiB: a round is a run of requests to one
/// holder, made durable and reported at once. Here a rebuilt replica lacks two 8 MiB
/// slices and fetches once every 3 s: its first round takes a whole slice. (With one
/// 1 MiB request per interval, as before, a rebuild at the paper's slower intervals
/// took minutes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase2_round_fetches_a_whole_slice_in_message_sized_pieces() {
    const SLICE: u64 = 16384; // 8 MiB of 512-byte blocks
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 3 * SLICE, SLICE).unwrap();
    let cfg = NodeConfig {
        recovery_interval: Duration::from_secs(3),
        ..config()
    };
    let mut c = Cluster::start(g, 17, Faults::default(), cfg).await.unwrap();
    let client = c.client(1, ClientConfig::default()).await.unwrap();
    let mine: Vec<u64> = (0..g.slices()).filter(|&s| g.prefers(2, s)).collect();
    assert_eq!(mine.len(), 2);
    let data = |s: u64, k: u64| -> Vec<u8> {
        (0..2048)
            .flat_map(|b| block(s * SLICE + k * 2048 + b))
            .collect()
    };
    for &s in &mine {
        for k in 0..SLICE / 2048 {
            client
                .write(s * SLICE + k * 2048, &data(s, k))
                .await
                .unwrap();
        }
    }
    c.crash(2).await;
    assert!(c.replace_data_disk(2).await);
    c.start_replica(2).await.unwrap();
    let n2 = c.node(2).unwrap().clone();
    wait_for("replica 2 to know what it lacks", || {
        n2.status().incomplete == 2 * SLICE
    })
    .await;
    wait_for("its first round", || n2.status().incomplete < 2 * SLICE).await;
    assert_eq!(n2.status().incomplete, SLICE, "one round, one whole slice");
    // And the rebuilt copies are what was written: with replica 0 down, then 1.
    wait_for("the rebuild", || n2.status().incomplete == 0).await;
    for down in [0u16, 1] {
        c.crash(down).await;
        for &s in &mine {
            for k in [0, SLICE / 2048 - 1] {
                assert_eq!(
                    client.read(s * SLICE + k * 2048, 2048).await.unwrap(),
                    data(s, k),
                    "slice {s} piece {k} with replica {down} down"
                );
            }
        }
        c.start_replica(down).await.unwrap();
        wait_for("it to catch up", || c.fully_redundant()).await;
    }
    c.shutdown().await;
}
