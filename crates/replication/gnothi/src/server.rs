//! A replica process: its two devices (files or block devices), its peers, the
//! cluster secret, and the gRPC server, until it is told to stop.

use crate::geometry::{Geometry, ReplicaId};
use crate::layout::{Label, LayoutError};
use crate::node::{Node, NodeConfig};
use crate::replica::Local;
use crate::transport::{serve, GrpcNet, TlsIdentity};
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
        incarnation: 0,
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
    let data_dev = open_file(data, bs, label.data_blocks_needed())?;
    prepare_data(label, data_dev.as_ref()).map_err(|e| format!("{}: {e}", data.display()))?;
    Local::format(&log_dev, label).map_err(|e| format!("{}: {e}", log.display()))
}

/// Clears a data device's reserve (a device that held an earlier volume must not be
/// read as this one's reserve) and labels it. The home area is left as it is: no
/// block there counts until the volume's table says this replica holds it.
fn prepare_data(label: &Label, dev: &dyn BlockDevice) -> Result<(), LayoutError> {
    let bs = dev.block_size();
    let home = label.geometry.home_blocks(label.replica);
    let end = label.data_label_block();
    let per = ((1usize << 20) / bs).max(1) as u64;
    let zero = vec![0u8; per as usize * bs];
    let mut b = home;
    while b < end {
        let n = per.min(end - b);
        dev.write_blocks(
            b,
            &zero[..n as usize * bs],
            quilt_block::WriteClass::Metadata,
        )?;
        b += n;
    }
    dev.flush()?;
    label.write_data_label(dev)
}

/// A new, empty data device in place of a failed one: the volume is told first that
/// this replica holds nothing (through the other replicas, which must have a leader),
/// then the device is prepared; re-replication rebuilds it once the replica runs.
async fn adopt_new_data_disk(
    opts: &ServeOptions,
    label: &Label,
    dev: &dyn BlockDevice,
) -> Result<(), String> {
    let net = opts.peers_net()?;
    let id = (u64::MAX - u64::from(opts.id))
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64 & 0xffff_ffff);
    let config = crate::client::ClientConfig {
        op_timeout: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let client = crate::client::Client::connect(net, opts.peers.len() as u16, id, config)
        .await
        .map_err(|e| format!("telling the volume the data disk is new: {e}"))?;
    client
        .declare_data_lost(opts.id)
        .await
        .map_err(|e| format!("telling the volume the data disk is new: {e}"))?;
    tracing::info!(
        replica = opts.id,
        "the volume knows this replica's data disk is new; rebuilding it"
    );
    prepare_data(label, dev).map_err(|e| format!("{}: {e}", opts.data.display()))
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
    /// The data device is a new, empty disk in place of a failed one: tell the volume
    /// this replica holds nothing, then serve and rebuild (re-replication).
    pub new_data_disk: bool,
    /// TLS: this replica's identity, and the CA its peers' certificates chain to.
    pub tls: Option<ReplicaTls>,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics: Option<SocketAddr>,
}

#[derive(Clone)]
pub struct ReplicaTls {
    pub identity: TlsIdentity,
    pub ca_pem: Vec<u8>,
}

impl std::fmt::Debug for ReplicaTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.write_str("ReplicaTls { .. }")
    }
}

impl ServeOptions {
    /// The other replicas, over TLS when this one serves it.
    fn peers_net(&self) -> Result<Arc<GrpcNet>, String> {
        GrpcNet::with_tls(
            self.peers.clone(),
            &self.secret,
            self.tls.as_ref().map(|t| t.ca_pem.clone()),
        )
    }
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

/// A replica's log device, opened at the block size its label names, and the label.
fn open_log(path: &Path) -> Result<(Arc<dyn BlockDevice>, Label), String> {
    let probe = open_existing(path, 512)?;
    let mut b = vec![0u8; 512];
    probe.read(0, &mut b).map_err(|e| e.to_string())?;
    drop(probe);
    // The label is read at the device's own block size, which the label names.
    let bs = u32::from_le_bytes([b[16], b[17], b[18], b[19]]) as usize;
    if &b[0..4] != b"QGLB" || !(512..=1 << 20).contains(&bs) || !bs.is_power_of_two() {
        return Err(format!(
            "{} is not a formatted replica log device (run `quiltfs replica format` first)",
            path.display()
        ));
    }
    let log_dev = open_file(path, bs, 1)?;
    let label = Label::read(log_dev.as_ref()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((log_dev, label))
}

fn open_existing(path: &Path, bs: usize) -> Result<Arc<dyn BlockDevice>, String> {
    if !path.exists() {
        return Err(format!("{} does not exist", path.display()));
    }
    open_file(path, bs, 1)
}

/// What a replica's log device is labelled.
pub fn read_label(log: &Path) -> Result<Label, String> {
    open_log(log).map(|(_, l)| l)
}

/// Runs a replica until `stop` resolves (the caller wires it to SIGTERM / ctrl-c).
pub async fn run(
    opts: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let (log_dev, label) = open_log(&opts.log)?;
    let bs = label.geometry.block_size as usize;
    // Before anything is told to the volume (a wrong --id with --new-data-disk would
    // declare another replica's copies lost).
    if label.replica != opts.id {
        return Err(format!(
            "{} belongs to replica {} of volume {:?}, not replica {}",
            opts.log.display(),
            label.replica,
            label.volume,
            opts.id
        ));
    }
    if !opts.new_data_disk && !opts.data.exists() {
        return Err(format!(
            "{} does not exist: if it is a new disk replacing a failed one, start with --new-data-disk",
            opts.data.display()
        ));
    }
    let data_dev = open_file(&opts.data, bs, label.data_blocks_needed())?;
    let ours = label
        .data_label_matches(data_dev.as_ref())
        .map_err(|e| format!("{}: {e}", opts.data.display()))?;
    match (ours, opts.new_data_disk) {
        (true, false) => {}
        (true, true) => {
            return Err(format!(
                "{} is already this replica's data device; --new-data-disk is for an empty disk replacing a failed one",
                opts.data.display()
            ))
        }
        (false, false) => {
            return Err(format!(
                "{} carries no data label: if it is a new disk replacing a failed one, start once with --new-data-disk (its copies are then rebuilt from the other replicas)",
                opts.data.display()
            ))
        }
        (false, true) => adopt_new_data_disk(&opts, &label, data_dev.as_ref()).await?,
    }
    let log_dev = modelled(log_dev, opts.model_disks)?;
    let data_dev = modelled(data_dev, opts.model_disks)?;
    if !opts.peers.contains_key(&u64::from(opts.id)) {
        return Err(format!(
            "the peers list does not name this replica ({})",
            opts.id
        ));
    }
    let net = opts.peers_net()?;
    // Bound before the replica starts, so that a port in use fails the start cleanly.
    let metrics_listener = match opts.metrics {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .map_err(|e| format!("listening for metrics on {at}: {e}"))?,
        ),
        None => None,
    };
    // A volume's first servers initialize its agreement with each other (the same
    // first entry on each). A server that replaces another joins through the
    // leader's `Replace` instead: it initializes nothing, and learns who the members
    // are from what it is sent.
    let members: BTreeMap<u64, BasicNode> = if label.incarnation == 0 {
        opts.peers
            .iter()
            .map(|(&id, a)| (id, BasicNode::new(a.clone())))
            .collect()
    } else {
        tracing::info!(
            replica = opts.id,
            node = label.node_id(),
            "a replacement server: waiting to be let in (`quiltfs cluster replace`)"
        );
        BTreeMap::new()
    };
    let node = Node::start(opts.id, log_dev, data_dev, net, members, opts.config)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = opts.id, listen = %opts.listen, volume = %label.volume, "replica serving");
    let metrics = match metrics_listener {
        Some(listener) => {
            let node = node.clone();
            Some(tokio::spawn(quilt_rpc::metrics::serve(
                listener,
                move || crate::metrics::render(&node.status()),
                std::future::pending(),
            )))
        }
        None => None,
    };
    // A replica whose agreement failed for good (its log device failing, say) ends
    // with the reason, rather than answering every request with it: a supervisor
    // restarts it, and its log is replayed.
    let fatal = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let until = {
        let (node, fatal) = (node.clone(), fatal.clone());
        async move {
            tokio::select! {
                _ = stop => {}
                why = node.fatal() => {
                    *fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                }
            }
        }
    };
    let identity = opts.tls.map(|t| t.identity);
    let res = serve(node.clone(), opts.listen, opts.secret, identity, until).await;
    if let Some(m) = metrics {
        m.abort();
    }
    node.shutdown().await;
    if let Some(why) = fatal.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(format!("agreement on this replica stopped: {why}"));
    }
    res
}
