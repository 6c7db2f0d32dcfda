//! One replica's own devices, without the network: what its data log must keep across
//! a write-back for a crash to lose nothing.

use quilt_block::{BlockDevice, MemDevice};
use quilt_gnothi::layout::Label;
use quilt_gnothi::meta::{Outcome, Proposal};
use quilt_gnothi::replica::{Local, LocalRead};
use quilt_gnothi::{Command, Geometry, Stored, System, WriteId};
use std::sync::Arc;

const BS: usize = 512;

fn devices(g: Geometry) -> (Arc<dyn BlockDevice>, Arc<dyn BlockDevice>) {
    let label = Label {
        replica: 0,
        incarnation: 0,
        volume: "local".into(),
        geometry: g,
        reserve_slots: 16,
        raft_blocks: 512,
        data_blocks: 64,
        snap_blocks: 64,
    };
    let log_dev: Arc<dyn BlockDevice> =
        Arc::new(MemDevice::new(BS, label.blocks_needed()).unwrap());
    let data_dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(BS, 1024).unwrap());
    Local::format(&log_dev, &label).unwrap();
    (log_dev, data_dev)
}

/// The committed write of `byte`s to `block`, stored at home on its slice's replicas.
fn proposal(g: &Geometry, seq: u64, block: u64, byte: u8) -> Proposal {
    Proposal {
        session: None,
        command: Command::Write {
            write: WriteId { client: 1, seq },
            first: block,
            checksums: vec![crc32c::crc32c(&vec![byte; BS])],
            stored: g
                .preferred(g.slice_of(block))
                .into_iter()
                .map(Stored::Home)
                .collect(),
        },
    }
}

fn stage_and_apply(local: &mut Local, g: &Geometry, index: u64, block: u64, byte: u8) {
    local
        .stage(
            WriteId {
                client: 1,
                seq: index,
            },
            block,
            vec![byte; BS],
        )
        .unwrap();
    let out = local.apply(index, &proposal(g, index, block, byte));
    assert!(matches!(out, Outcome::Applied(_)), "{out:?}");
}

/// A write placed while a write-back is being written out is in the buffer, not in
/// the batch: when the batch is reported durable, the data log must keep that write's
/// record, or a crash before the next write-back loses the only durable copy of data
/// acknowledged on this replica. Checked by "crashing" there (the replica dropped, its
/// buffer never written) and replaying both writes on the reopened devices. (Trimmed
/// up to the oldest record still staged, as before, the second write was lost: "a
/// committed write's data is not here".)
#[test]
fn a_write_placed_during_a_write_back_survives_a_crash_after_it() {
    let g = Geometry::new(System::Gnothi, 1, BS as u32, 256, 16).unwrap();
    let home: Vec<u64> = (0..g.blocks)
        .filter(|&b| g.prefers(0, g.slice_of(b)))
        .take(2)
        .collect();
    let (log_dev, data_dev) = devices(g);
    let (mut local, _log) = Local::open(0, log_dev.clone(), data_dev.clone()).unwrap();
    stage_and_apply(&mut local, &g, 1, home[0], 0xa1);
    let wb = local.write_back_begin().expect("a write to write back");
    // Applied while the batch is written out, outside the replica's lock.
    stage_and_apply(&mut local, &g, 2, home[1], 0xb2);
    wb.batch.write_out().unwrap();
    local.write_back_done(wb, Ok(())).unwrap();
    assert!(
        local.data_log_usage().0 > 0,
        "the second write's record was let go before its data was durable"
    );
    drop(local);

    let (mut local, _log) = Local::open(0, log_dev, data_dev).unwrap();
    // The metadata is replayed from the Raft log (here by hand): the first write's
    // record is gone, its copy durable at home; the second's is replayed.
    for (index, block, byte) in [(1, home[0], 0xa1), (2, home[1], 0xb2)] {
        let out = local.apply(index, &proposal(&g, index, block, byte));
        assert!(matches!(out, Outcome::Applied(_)), "{out:?}");
    }
    for (block, byte) in [(home[0], 0xa1), (home[1], 0xb2)] {
        match local.read(block).unwrap() {
            LocalRead::Data(d) => assert!(d == vec![byte; BS], "block {block}"),
            other => panic!("block {block} after the crash: {other:?}"),
        }
    }
}
