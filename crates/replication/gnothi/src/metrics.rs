//! A replica's status as Prometheus metrics (`quiltfs replica serve --metrics ADDR`):
//! its role, agreement progress and lag, recovery work left, reserve and log use, and
//! its devices' requests. The same figures as `quiltfs cluster status`, read from the
//! replica itself at each scrape.

use crate::rpc::Status;
use quilt_rpc::metrics::{Exposition, Kind};

pub fn render(s: &Status) -> String {
    let mut e = Exposition::new();
    let replica = s.replica.to_string();
    let node = s.node.to_string();
    let l: &[(&str, &str)] = &[("replica", &replica)];
    let g = |e: &mut Exposition, name: &str, help: &str, v: u64| {
        e.family(name, Kind::Gauge, help, &[(l, v as f64)])
    };
    let c = |e: &mut Exposition, name: &str, help: &str, v: u64| {
        e.family(name, Kind::Counter, help, &[(l, v as f64)])
    };
    e.family(
        "gnothi_replica_info",
        Kind::Gauge,
        "The replica's slot, agreement id and volume (always 1).",
        &[(
            &[
                ("replica", &replica),
                ("node", &node),
                ("volume", &s.volume),
            ],
            1.0,
        )],
    );
    g(
        &mut e,
        "gnothi_is_leader",
        "1 while this replica leads agreement.",
        u64::from(s.is_leader),
    );
    g(
        &mut e,
        "gnothi_is_member",
        "1 while this replica is its slot's server in the applied membership.",
        u64::from(s.is_member),
    );
    g(&mut e, "gnothi_term", "The agreement term.", s.term);
    g(
        &mut e,
        "gnothi_last_log_index",
        "The last index in this replica's agreement log.",
        s.last_log_index,
    );
    g(
        &mut e,
        "gnothi_applied_index",
        "The last index this replica applied.",
        s.applied,
    );
    g(
        &mut e,
        "gnothi_apply_lag_entries",
        "Entries logged here and not applied yet.",
        s.last_log_index.saturating_sub(s.applied),
    );
    g(
        &mut e,
        "gnothi_members",
        "Voters in the applied membership.",
        s.members.len() as u64,
    );
    g(
        &mut e,
        "gnothi_incomplete_blocks",
        "Blocks of this replica's preferred slices it lacks at their current version (Phase 2's work left).",
        s.incomplete,
    );
    g(
        &mut e,
        "gnothi_reserve_used_slots",
        "Reserve slots holding copies for other replicas.",
        s.reserve_used,
    );
    c(
        &mut e,
        "gnothi_checksum_failures_total",
        "Held blocks found damaged since the replica started.",
        s.checksum_failures,
    );
    c(
        &mut e,
        "gnothi_write_back_failures_total",
        "Write-backs of placed data that failed since the replica started.",
        s.write_back_failures,
    );
    g(
        &mut e,
        "gnothi_raft_log_used_blocks",
        "Blocks of the agreement log's ring in use.",
        s.raft_log_used,
    );
    g(
        &mut e,
        "gnothi_raft_log_blocks",
        "Blocks of the agreement log's ring.",
        s.raft_log_blocks,
    );
    g(
        &mut e,
        "gnothi_data_log_used_blocks",
        "Blocks of the data log in use.",
        s.data_log_used,
    );
    g(
        &mut e,
        "gnothi_data_log_blocks",
        "Blocks of the data log.",
        s.data_log_blocks,
    );
    for (dev, io) in [("log", &s.log_io), ("data", &s.data_io)] {
        let l: &[(&str, &str)] = &[("replica", &replica), ("device", dev)];
        for (name, help, v) in [
            (
                "gnothi_device_reads_total",
                "Read requests the device served.",
                io.reads,
            ),
            (
                "gnothi_device_writes_total",
                "Write requests the device served.",
                io.writes,
            ),
            (
                "gnothi_device_flushes_total",
                "Flushes the device served.",
                io.flushes,
            ),
            (
                "gnothi_device_read_bytes_total",
                "Bytes read from the device.",
                io.bytes_read,
            ),
            (
                "gnothi_device_written_bytes_total",
                "Bytes written to the device.",
                io.bytes_written,
            ),
        ] {
            e.family(name, Kind::Counter, help, &[(l, v as f64)]);
        }
    }
    e.finish()
}
