//! A replica process: its two devices (files or block devices), its peers, the
//! cluster secret, and the gRPC server, until it is told to stop.

use crate::geometry::{Geometry, ReplicaId};
use crate::layout::Label;
use crate::node::{Node, NodeConfig};
use crate::replica::Local;
use crate::store::DataStore;
use crate::transport::{serve, GrpcNet};
use openraft::BasicNode;
use quilt_block::{BlockDevice, Clock, DiskModel, DiskParams, FileDevice, FileDeviceOptions};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Sizes of a replica's log device regions, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct LogSizes {
    pub raft: u64,
    pub data: u64,
}

impl Default for LogSizes {
    fn default() -> LogSizes {
        LogSizes {
            raft: 64 << 20,
            data: 256 << 20,
        }
    }
}

/// The label a replica's log device gets.
pub fn label_for(
    replica: ReplicaId,
    volume: &str,
    geometry: Geometry,
    reserve_slots: u64,
    sizes: LogSizes,
) -> Label {
    let bs = u64::from(geometry.block_size);
    // A snapshot is the table (at most ~24 bytes a block, postcard) and the sessions.
    let snap = (geometry.blocks * 24 + (1 << 20)).div_ceil(bs) + 1;
    Label {
        replica,
        volume: volume.to_string(),
        geometry,
        reserve_slots,
        raft_blocks: sizes.raft / bs,
        data_blocks: sizes.data / bs,
        snap_blocks: snap,
    }
}

fn open_file(path: &Path, bs: usize, blocks: u64) -> Result<Arc<dyn BlockDevice>, String> {
    let opts = FileDeviceOptions {
        block_size: bs,
        ..Default::default()
    };
    let dev = if path.exists() {
        FileDevice::open(path, opts)
    } else {
        FileDevice::create(path, blocks, opts)
    }
    .map_err(|e| format!("{}: {e}", path.display()))?;
    if dev.block_count() < blocks {
        return Err(format!(
            "{} has {} blocks of {bs} bytes; replica needs {blocks}",
            path.display(),
            dev.block_count()
        ));
    }
    Ok(Arc::new(dev))
}

/// Makes replica `label.replica`'s devices (creating files of the sizes needed).
pub fn format(label: &Label, log: &Path, data: &Path) -> Result<(), String> {
    let bs = label.geometry.block_size as usize;
    let log_dev = open_file(log, bs, label.blocks_needed())?;
    let data_blocks = DataStore::blocks_needed(&label.geometry, label.replica, label.reserve_slots);
    let data_dev = open_file(data, bs, data_blocks)?;
    // A data device that held an earlier volume must not be read as this one's reserve.
    let zero = vec![0u8; bs];
    let home = label.geometry.home_blocks(label.replica);
    for b in home..data_blocks {
        data_dev
            .write(b, &zero, quilt_block::WriteClass::Metadata)
            .map_err(|e| format!("{}: {e}", data.display()))?;
    }
    data_dev
        .flush()
        .map_err(|e| format!("{}: {e}", data.display()))?;
    Local::format(&log_dev, label).map_err(|e| format!("{}: {e}", log.display()))
}

/// What a replica process runs with.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub id: ReplicaId,
    pub listen: SocketAddr,
    /// Every replica's address by id, this one's included.
    pub peers: BTreeMap<u64, String>,
    pub log: PathBuf,
    pub data: PathBuf,
    pub secret: String,
    pub config: NodeConfig,
    /// For benchmarks: each device behaves as a 7200 RPM disk with its write cache off
    /// (the rotating-disk model, real time), and flushes stop at the model (the files
    /// under it are not flushed on the host, so a crash of the host may lose them).
    pub model_disks: bool,
}

/// `dev` behind the rotating-disk model, when `model` says so.
fn modelled(dev: Arc<dyn BlockDevice>, model: bool) -> Result<Arc<dyn BlockDevice>, String> {
    if !model {
        return Ok(dev);
    }
    // The write cache on, as desktop disks ship: a sync is a flush that writes what
    // waits in block order.
    let params = DiskParams {
        write_cache: true,
        ..DiskParams::desktop_7200()
    };
    let m =
        DiskModel::new(dev, params, Clock::real()).map_err(|e| format!("the disk model: {e}"))?;
    Ok(Arc::new(m.without_host_flush()))
}

/// Runs a replica until `stop` resolves (the caller wires it to SIGTERM / ctrl-c).
pub async fn run(
    opts: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let probe = open_file(&opts.log, 512, 1)?;
    let mut b = vec![0u8; 512];
    probe.read(0, &mut b).map_err(|e| e.to_string())?;
    drop(probe);
    // The label is read at the device's own block size, which the label names.
    let bs = u32::from_le_bytes([b[16], b[17], b[18], b[19]]) as usize;
    if !(512..=1 << 20).contains(&bs) || !bs.is_power_of_two() {
        return Err(format!(
            "{} is not a formatted replica log device (run `quiltfs replica format` first)",
            opts.log.display()
        ));
    }
    let log_dev = open_file(&opts.log, bs, 1)?;
    let label =
        Label::read(log_dev.as_ref()).map_err(|e| format!("{}: {e}", opts.log.display()))?;
    let data_blocks = DataStore::blocks_needed(&label.geometry, label.replica, label.reserve_slots);
    let data_dev = open_file(&opts.data, bs, data_blocks)?;
    let log_dev = modelled(log_dev, opts.model_disks)?;
    let data_dev = modelled(data_dev, opts.model_disks)?;
    if !opts.peers.contains_key(&u64::from(opts.id)) {
        return Err(format!(
            "the peers list does not name this replica ({})",
            opts.id
        ));
    }
    let net = GrpcNet::new(opts.peers.clone(), &opts.secret)?;
    let members: BTreeMap<u64, BasicNode> = opts
        .peers
        .iter()
        .map(|(&id, a)| (id, BasicNode::new(a.clone())))
        .collect();
    let node = Node::start(opts.id, log_dev, data_dev, net, members, opts.config)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = opts.id, listen = %opts.listen, volume = %label.volume, "replica serving");
    let res = serve(node.clone(), opts.listen, opts.secret, stop).await;
    node.shutdown().await;
    res
}
