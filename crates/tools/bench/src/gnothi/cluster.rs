//! A volume's replicas as local processes, run through `quiltfs cluster` (as a user
//! would), and a client of it in this process.

use crate::{quiltfs_exe, sh};
use anyhow::{anyhow, Context, Result};
use quilt_gnothi::client::{Client, ClientConfig};
use quilt_gnothi::device::VolumeAddress;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// How a cluster is set up.
#[derive(Debug, Clone)]
pub struct Shape {
    /// `gnothi`, `gprime`, `cheap-paxos` or `local` (as `quiltfs cluster up --system`).
    pub system: &'static str,
    pub replicas: u16,
    pub size_mib: u64,
    pub port: u16,
    pub recovery_interval_ms: u64,
    /// Devices on the rotating-disk model (else plain files).
    pub model_disks: bool,
}

/// A running cluster; brought down when dropped.
pub struct LocalCluster {
    pub dir: PathBuf,
    pub address: String,
    pub replicas: u16,
    reserve_slots: u64,
    exe: PathBuf,
}

impl LocalCluster {
    /// Starts a fresh cluster in `dir` (whatever was there is removed).
    pub fn up(dir: &Path, shape: &Shape) -> Result<LocalCluster> {
        let exe = quiltfs_exe()?;
        if dir.exists() {
            // A cluster a killed run left: stop its replicas before the files go.
            if dir.join("cluster.json").exists() {
                let _ = Command::new(&exe)
                    .args(["cluster", "down"])
                    .arg(dir)
                    .output();
            }
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        let mut cmd = Command::new(&exe);
        cmd.args(["cluster", "up", "--dir"])
            .arg(dir)
            .args(["--replicas", &shape.replicas.to_string()])
            .args(["--system", shape.system])
            .args(["--size", &format!("{}M", shape.size_mib)])
            .args(["--port", &shape.port.to_string()])
            .args(["--reserve-slots", &shape.reserve_slots().to_string()])
            .args([
                "--recovery-interval-ms",
                &shape.recovery_interval_ms.to_string(),
            ]);
        if shape.model_disks {
            cmd.arg("--model-disks");
        }
        let out = sh(&mut cmd).with_context(|| format!("starting a {} cluster", shape.system))?;
        let address = out
            .lines()
            .rev()
            .find(|l| VolumeAddress::is_address(l.trim()))
            .map(|l| l.trim().to_string())
            .ok_or_else(|| anyhow!("`quiltfs cluster up` printed no volume address: {out}"))?;
        Ok(LocalCluster {
            dir: dir.to_path_buf(),
            address,
            replicas: shape.replicas,
            reserve_slots: shape.reserve_slots(),
            exe,
        })
    }

    fn cluster(&self, args: &[&str]) -> Result<String> {
        let mut c = Command::new(&self.exe);
        c.arg("cluster")
            .arg(args[0])
            .arg(&self.dir)
            .args(&args[1..]);
        sh(&mut c)
    }

    /// Kills replica `r` (SIGKILL: a crash, not a shutdown).
    pub fn kill(&self, r: u16) -> Result<()> {
        self.cluster(&["stop", "--replica", &r.to_string(), "--kill"])
            .map(drop)
    }

    /// Replaces replica `r`'s data disk by an empty one and starts it on it.
    pub fn replace_disk(&self, r: u16) -> Result<()> {
        self.cluster(&["replace-disk", "--replica", &r.to_string()])
            .map(drop)
    }

    pub fn start(&self, r: u16) -> Result<()> {
        self.cluster(&["start", "--replica", &r.to_string()])
            .map(drop)
    }

    /// Each replica's status (`quiltfs cluster status --json`), by id; `None` if down.
    pub fn status(&self) -> Result<Vec<Option<ReplicaStatus>>> {
        let s = self.cluster(&["status", "--json"])?;
        let v: serde_json::Value =
            serde_json::from_str(&s).context("`quiltfs cluster status --json` printed no JSON")?;
        let list = v["replicas"]
            .as_array()
            .ok_or_else(|| anyhow!("no replicas in the cluster status"))?;
        Ok(list
            .iter()
            .map(|r| {
                r["up"].as_bool().unwrap_or(false).then(|| ReplicaStatus {
                    leader: r["role"] == "leader",
                    log_index: r["log_index"].as_u64().unwrap_or(0),
                    applied: r["applied"].as_u64().unwrap_or(0),
                    incomplete: r["incomplete"].as_u64().unwrap_or(0),
                    reserve_used: r["reserve_used"].as_u64().unwrap_or(0),
                    log_flushes: r["log_io"]["flushes"].as_u64().unwrap_or(0),
                    log_writes: r["log_io"]["writes"].as_u64().unwrap_or(0),
                    data_flushes: r["data_io"]["flushes"].as_u64().unwrap_or(0),
                    data_writes: r["data_io"]["writes"].as_u64().unwrap_or(0),
                    data_reads: r["data_io"]["reads"].as_u64().unwrap_or(0),
                })
            })
            .collect())
    }

    /// Bytes of volume data the replica keeps at home: the allocated parts of its data
    /// device's home area (a sparse file: what was written there). The reserve, which
    /// `replica format` zeroes whole and which sits after the home area, is left out:
    /// its use is reported in blocks by the replica itself.
    pub fn home_bytes(&self, r: u16) -> Result<u64> {
        let p = self.dir.join(format!("r{r}.data"));
        let f = std::fs::File::open(&p).with_context(|| format!("{}", p.display()))?;
        let len = f.metadata()?.len();
        let home_end = len.saturating_sub(2 * self.reserve_slots * BLOCK_SIZE);
        allocated(&f, home_end).with_context(|| format!("mapping {}", p.display()))
    }

    /// A client of the volume, on `rt`.
    pub fn client(&self, rt: &tokio::runtime::Runtime, id: u64) -> Result<Arc<Client>> {
        let a = VolumeAddress::parse(&self.address).map_err(|e| anyhow!(e))?;
        let config = ClientConfig {
            op_timeout: std::time::Duration::from_secs(30),
            ..ClientConfig::default()
        };
        rt.block_on(a.connect(id, config))
            .map(Arc::new)
            .map_err(|e| anyhow!("connecting to {}: {e}", self.address))
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        match self.cluster(&["down"]) {
            // Its devices are the bench's own, and a full run's take gigabytes.
            Ok(_) => {
                if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                    eprintln!("bench: removing {}: {e}", self.dir.display());
                }
            }
            // Kept, so that the replicas' logs say what went wrong.
            Err(e) => eprintln!(
                "bench: bringing the cluster in {} down: {e:#}",
                self.dir.display()
            ),
        }
    }
}

/// What the bench reads of a replica's status.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaStatus {
    pub leader: bool,
    pub log_index: u64,
    pub applied: u64,
    pub incomplete: u64,
    pub reserve_used: u64,
    pub log_flushes: u64,
    pub log_writes: u64,
    pub data_flushes: u64,
    pub data_writes: u64,
    pub data_reads: u64,
}

/// Device requests the replicas served between two statuses, summed over replicas up
/// at both: (log flushes, log writes, data flushes, data writes, data reads).
pub fn io_between(a: &[Option<ReplicaStatus>], b: &[Option<ReplicaStatus>]) -> [u64; 5] {
    let mut out = [0u64; 5];
    for (x, y) in a.iter().zip(b) {
        if let (Some(x), Some(y)) = (x, y) {
            let d = [
                y.log_flushes.saturating_sub(x.log_flushes),
                y.log_writes.saturating_sub(x.log_writes),
                y.data_flushes.saturating_sub(x.data_flushes),
                y.data_writes.saturating_sub(x.data_writes),
                y.data_reads.saturating_sub(x.data_reads),
            ];
            for (o, v) in out.iter_mut().zip(d) {
                *o += v;
            }
        }
    }
    out
}

/// The leader's log index, if a leader answers.
pub fn leader_index(st: &[Option<ReplicaStatus>]) -> Option<u64> {
    st.iter().flatten().find(|s| s.leader).map(|s| s.log_index)
}

impl Shape {
    /// Reserve slots each replica's data device gets (passed to `cluster up`; a slot is
    /// a header block and a data block, after the home area): enough to stand in for
    /// a replica down through a whole run. With one down, a replica stands in for it on
    /// the slices the two of them do not share, f/(2f+1) of the volume at most; writes
    /// past a full reserve wait (its copies are refused rather than dropped), and with
    /// the CLI's default of 16,384 slots the catch-up runs' clients stalled for the
    /// whole time the replica was down. The area is sparse until used.
    pub fn reserve_slots(&self) -> u64 {
        let blocks = (self.size_mib << 20) / BLOCK_SIZE;
        let f = u64::from(self.replicas.saturating_sub(1) / 2);
        (blocks * f).div_ceil(2 * f + 1).max(16384)
    }
}
/// The volumes' block size (`cluster up`'s default).
pub const BLOCK_SIZE: u64 = 4096;

/// Allocated bytes of `f` in `[0, end)`, found with SEEK_DATA and SEEK_HOLE.
fn allocated(f: &std::fs::File, end: u64) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut pos = 0u64;
    let mut total = 0u64;
    while pos < end {
        // SAFETY: lseek on a descriptor this function borrows; no memory is passed.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(e);
        }
        let data = data as u64;
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hole = (hole as u64).min(end);
        total += hole - data;
        pos = hole;
    }
    Ok(total)
}
