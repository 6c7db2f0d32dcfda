//! openraft's own storage conformance suite, run against a replica's Raft log and
//! state machine on in-memory devices: the library's authors' oracle for what its log
//! and state machine must do (ordering, truncation, purge, votes, snapshots).

use openraft::testing::{StoreBuilder, Suite};
use quilt_block::{BlockDevice, MemDevice};
use quilt_gnothi::layout::Label;
use quilt_gnothi::meta::{Meta, StorageError};
use quilt_gnothi::raftlog::RaftLog;
use quilt_gnothi::replica::{Local, Machine};
use quilt_gnothi::{Geometry, System};
use std::sync::Arc;

struct Devices;

impl StoreBuilder<Meta, RaftLog, Machine> for Devices {
    async fn build(&self) -> Result<((), RaftLog, Machine), StorageError> {
        let geometry = Geometry::new(System::Gnothi, 1, 512, 256, 16).unwrap();
        let label = Label {
            replica: 0,
            incarnation: 0,
            volume: "suite".into(),
            geometry,
            reserve_slots: 16,
            raft_blocks: 512,
            data_blocks: 64,
            snap_blocks: 64,
        };
        let log_dev: Arc<dyn BlockDevice> =
            Arc::new(MemDevice::new(512, label.blocks_needed()).unwrap());
        let data_dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(512, 1024).unwrap());
        Local::format(&log_dev, &label).unwrap();
        let (local, log) = Local::open(0, log_dev, data_dev).unwrap();
        Ok(((), log, Machine::new(local)))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(Devices).unwrap();
}
