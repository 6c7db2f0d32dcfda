//! Ceph RBD, the replicated block store users pick today, as the peer of the
//! plain-files configuration: one monitor and three OSDs (BlueStore, each on a file in
//! the work directory) of Debian's Ceph packages on this machine, a pool of size 3
//! (every block on three OSDs, as a volume of G′ keeps it; f = 1), one image, driven
//! by fio's rbd engine with the same request sizes, depths and durations as the other
//! systems. The daemons are this process's children and stop with it.
//!
//! Facts this rests on (measured here, see shared/reference/ceph-one-node.md): no
//! cephadm, containers or LVM are needed; the monitor must speak msgr2 (with
//! `ms bind msgr2 = false` the OSDs never come up); BlueStore's block file must not be
//! `<osd data>/block`; `osd crush chooseleaf type = 0` lets three replicas share a host.

use super::load::Workload;
use crate::{have, sh};
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The packages the peer needs (fio in Debian is built with librbd).
pub const PACKAGES: &[&str] = &["ceph-mon", "ceph-osd", "ceph-common", "fio"];
/// What CephFS through ceph-fuse needs besides.
pub const CEPHFS_PACKAGES: &[&str] = &[
    "ceph-mon",
    "ceph-osd",
    "ceph-mds",
    "ceph-fuse",
    "ceph-common",
];

const OSDS: u32 = 3;
const POOL: &str = "rbd";
const IMAGE: &str = "vol";

/// A running one-machine Ceph cluster with one RBD image; stopped and removed when
/// dropped.
pub struct Ceph {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<(String, Child)>,
    size_mib: u64,
    osds: u32,
    /// A ceph-fuse mount of CephFS, unmounted first when dropped.
    fuse: Option<PathBuf>,
}

/// What one fio run measured.
pub struct Measured {
    pub mb_per_s: f64,
    pub requests: u64,
    pub errors: u64,
}

impl Ceph {
    /// Whether the tools are installed (else say what to install).
    pub fn check_tools() -> Result<()> {
        let missing: Vec<&str> = ["ceph-mon", "ceph-osd", "ceph", "rbd", "monmaptool", "fio"]
            .into_iter()
            .filter(|t| !have(t))
            .collect();
        if !missing.is_empty() {
            bail!(
                "ceph-rbd needs {} (apt-get install {})",
                missing.join(", "),
                PACKAGES.join(" ")
            );
        }
        Ok(())
    }

    /// Brings up a fresh cluster in `dir` (whatever was there is removed), its monitor
    /// on `port` (msgr2) and `port + 1` (msgr1), and an image of `size_mib`.
    pub fn up(dir: &Path, size_mib: u64, port: u16) -> Result<Ceph> {
        Ceph::check_tools()?;
        // Each OSD's block file: the image three times over, BlueStore's own metadata
        // and slack; never less than BlueStore accepts.
        let block_bytes = ((size_mib * 3 + 1024) << 20).max(2 << 30);
        let mut c = Ceph::cluster(dir, port, OSDS, block_bytes)?;
        c.size_mib = size_mib;
        c.ceph(&["osd", "pool", "create", POOL, "32", "32", "replicated"])?;
        c.ceph(&["osd", "pool", "set", POOL, "size", "3"])?;
        c.ceph(&["osd", "pool", "application", "enable", POOL, "rbd"])?;
        // Blocks until the pool's placement groups are active; bounded, as a cluster
        // that cannot place them would wait for ever.
        sh(Command::new("timeout")
            .args(["180", "rbd", "-c"])
            .arg(&c.conf)
            .args([
                "create",
                "--size",
                &format!("{size_mib}M"),
                &format!("{POOL}/{IMAGE}"),
            ]))
        .context("creating the RBD image (did the placement groups become active?)")?;
        Ok(c)
    }

    /// CephFS as the Cudele paper ran it, on one machine: a monitor, one OSD on a file,
    /// one MDS, pools of size 1, and the ceph-fuse client mounted at `dir/mnt`.
    pub fn cephfs(dir: &Path, port: u16) -> Result<(Ceph, PathBuf)> {
        let missing: Vec<&str> = ["ceph-mon", "ceph-osd", "ceph-mds", "ceph-fuse", "ceph"]
            .into_iter()
            .filter(|t| !have(t))
            .collect();
        if !missing.is_empty() {
            bail!(
                "cephfs needs {} (apt-get install {})",
                missing.join(", "),
                CEPHFS_PACKAGES.join(" ")
            );
        }
        let mut c = Ceph::cluster(dir, port, 1, 4 << 30)?;
        for pool in ["cephfs_metadata", "cephfs_data"] {
            c.ceph(&["osd", "pool", "create", pool, "16", "16", "replicated"])?;
            c.ceph(&[
                "osd",
                "pool",
                "set",
                pool,
                "size",
                "1",
                "--yes-i-really-mean-it",
            ])?;
        }
        c.ceph(&["fs", "new", "cephfs", "cephfs_metadata", "cephfs_data"])?;
        std::fs::create_dir_all(c.dir.join("mds").join("a"))?;
        c.spawn("mds.a", c.daemon_cmd("ceph-mds").args(["-i", "a", "-f"]))?;
        let t = Instant::now();
        loop {
            let s = c.ceph(&["mds", "stat"])?;
            if s.contains("up:active") {
                break;
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!(
                    "CephFS's MDS is not active after 120 s (ceph mds stat: {})",
                    s.trim()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let mnt = c.dir.join("mnt");
        std::fs::create_dir_all(&mnt)?;
        c.spawn("client.fuse", c.daemon_cmd("ceph-fuse").arg("-f").arg(&mnt))?;
        c.fuse = Some(mnt.clone());
        let t = Instant::now();
        while !crate::cudele_mounts::is_mount(&mnt) {
            if t.elapsed() > Duration::from_secs(60) {
                bail!("ceph-fuse did not mount {} in 60 s", mnt.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok((c, mnt))
    }

    /// A fresh cluster of a monitor and `osds` OSDs in `dir` (whatever was there is
    /// removed), its monitor on `port` (msgr2) and `port + 1` (msgr1).
    fn cluster(dir: &Path, port: u16, osds: u32, block_bytes: u64) -> Result<Ceph> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        for sub in ["run", "log", "mon"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let dir = dir
            .canonicalize()
            .with_context(|| format!("resolving {}", dir.display()))?;
        let fsid = std::fs::read_to_string("/proc/sys/kernel/random/uuid")
            .context("reading a uuid from the kernel")?
            .trim()
            .to_string();
        let mon = format!("[v2:127.0.0.1:{port},v1:127.0.0.1:{}]", port + 1);
        let (size, min_size) = if osds >= 3 { (3, 2) } else { (1, 1) };
        let conf = dir.join("ceph.conf");
        let d = dir.display();
        std::fs::write(
            &conf,
            format!(
                "[global]\n\
                 fsid = {fsid}\n\
                 mon host = {mon}\n\
                 mon initial members = a\n\
                 auth cluster required = none\n\
                 auth service required = none\n\
                 auth client required = none\n\
                 public network = 127.0.0.0/8\n\
                 ms bind ipv6 = false\n\
                 osd pool default size = {size}\n\
                 osd pool default min size = {min_size}\n\
                 mon allow pool size one = true\n\
                 osd pool default pg autoscale mode = off\n\
                 osd crush chooseleaf type = 0\n\
                 mon allow pool delete = true\n\
                 mon warn on pool no redundancy = false\n\
                 mon data avail warn = 1\n\
                 run dir = {d}/run\n\
                 log file = {d}/log/$name.log\n\
                 admin socket = {d}/run/$name.asok\n\
                 pid file = {d}/run/$name.pid\n\
                 mon data = {d}/mon/$id\n\
                 mds data = {d}/mds/$id\n\
                 osd data = {d}/osd-$id\n\
                 osd objectstore = bluestore\n\
                 bluestore block path = {d}/osd-$id.block\n\
                 bluestore block create = true\n\
                 bluestore block size = {block_bytes}\n\
                 osd memory target = 1073741824\n"
            ),
        )
        .with_context(|| format!("writing {}", conf.display()))?;
        let mut c = Ceph {
            dir: dir.clone(),
            conf,
            daemons: Vec::new(),
            size_mib: 0,
            osds,
            fuse: None,
        };
        let monmap = dir.join("monmap");
        sh(Command::new("monmaptool")
            .args(["--create", "--addv", "a", &mon, "--fsid", &fsid])
            .arg(&monmap))?;
        sh(c.daemon_cmd("ceph-mon")
            .args(["--mkfs", "-i", "a", "--monmap"])
            .arg(&monmap))?;
        c.spawn("mon.a", c.daemon_cmd("ceph-mon").args(["-i", "a", "-f"]))?;
        c.ceph(&["osd", "crush", "add-bucket", "h", "host"])?;
        c.ceph(&["osd", "crush", "move", "h", "root=default"])?;
        for _ in 0..osds {
            let id = c.ceph(&["osd", "create"])?.trim().to_string();
            let osd_dir = dir.join(format!("osd-{id}"));
            std::fs::create_dir_all(&osd_dir)
                .with_context(|| format!("creating {}", osd_dir.display()))?;
            sh(c.daemon_cmd("ceph-osd").args(["-i", &id, "--mkfs"]))
                .with_context(|| format!("making OSD {id}"))?;
            c.ceph(&["osd", "crush", "add", &format!("osd.{id}"), "1.0", "host=h"])?;
            c.spawn(
                &format!("osd.{id}"),
                c.daemon_cmd("ceph-osd").args(["-i", &id, "-f"]),
            )?;
        }
        c.wait_osds_up(Duration::from_secs(120))?;
        Ok(c)
    }

    fn daemon_cmd(&self, exe: &str) -> Command {
        let mut cmd = Command::new(exe);
        cmd.arg("-c").arg(&self.conf);
        cmd
    }

    fn spawn(&mut self, name: &str, cmd: &mut Command) -> Result<()> {
        let out = std::fs::File::create(self.dir.join("log").join(format!("{name}.out")))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.daemons.push((name.to_string(), child));
        Ok(())
    }

    fn ceph(&self, args: &[&str]) -> Result<String> {
        sh(Command::new("ceph")
            .arg("-c")
            .arg(&self.conf)
            .args(["--connect-timeout", "20"])
            .args(args))
    }

    fn wait_osds_up(&mut self, within: Duration) -> Result<()> {
        let t = Instant::now();
        loop {
            for (name, child) in &mut self.daemons {
                if let Ok(Some(st)) = child.try_wait() {
                    bail!(
                        "{name} ended ({st}); see {}",
                        self.dir.join("log").join(format!("{name}.out")).display()
                    );
                }
            }
            let s = self.ceph(&["osd", "stat", "--format", "json"])?;
            let v: serde_json::Value =
                serde_json::from_str(&s).context("`ceph osd stat` printed no JSON")?;
            if v["num_up_osds"].as_u64() == Some(u64::from(self.osds)) {
                return Ok(());
            }
            if t.elapsed() > within {
                bail!(
                    "Ceph's OSDs are not up after {} s (ceph osd stat: {})",
                    within.as_secs(),
                    s.trim()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Writes the whole image once in 1 MiB requests, so that reads find data (as the
    /// other systems' volumes are filled before their runs).
    pub fn fill(&self) -> Result<()> {
        self.fio(&[
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            &format!("--size={}M", self.size_mib),
        ])
        .map(drop)
        .context("filling the RBD image")
    }

    /// One run: `request`-byte requests, `depth` outstanding, for `seconds`; the first
    /// 20% is fio's ramp time, so the figure is the last 80%, as for the other systems.
    pub fn run(
        &self,
        workload: Workload,
        request: usize,
        depth: usize,
        seconds: u64,
    ) -> Result<Measured> {
        let ms = seconds * 1000;
        let ramp = ms / 5;
        let rw = match workload {
            Workload::SeqWrite => "write",
            Workload::RandWrite => "randwrite",
            Workload::SeqRead => "read",
            Workload::RandRead => "randread",
        };
        let v = self.fio(&[
            &format!("--rw={rw}"),
            &format!("--bs={request}"),
            &format!("--iodepth={depth}"),
            "--time_based",
            &format!("--ramp_time={ramp}ms"),
            &format!("--runtime={}ms", ms - ramp),
        ])?;
        let job = &v["jobs"][0];
        let sum =
            |k: &str| job["read"][k].as_u64().unwrap_or(0) + job["write"][k].as_u64().unwrap_or(0);
        Ok(Measured {
            mb_per_s: sum("bw_bytes") as f64 / 1e6,
            requests: sum("total_ios"),
            errors: job["error"].as_u64().unwrap_or(0),
        })
    }

    fn fio(&self, args: &[&str]) -> Result<serde_json::Value> {
        let out = sh(Command::new("fio")
            .env("CEPH_CONF", &self.conf)
            .args([
                "--name=bench",
                "--ioengine=rbd",
                "--clientname=admin",
                &format!("--pool={POOL}"),
                &format!("--rbdname={IMAGE}"),
                "--output-format=json",
            ])
            .args(args))?;
        // fio may print notes before its JSON.
        let at = out
            .find('{')
            .ok_or_else(|| anyhow!("fio printed no JSON: {}", out.trim()))?;
        serde_json::from_str(&out[at..]).context("reading fio's JSON")
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        if let Some(mnt) = self.fuse.take() {
            let _ = Command::new("fusermount3").arg("-u").arg(&mnt).status();
            if crate::cudele_mounts::is_mount(&mnt) {
                let _ = Command::new("umount").arg("-l").arg(&mnt).status();
            }
        }
        // OSDs first, the monitor last; each is ours, stopped by its pid.
        for (_, child) in self.daemons.iter_mut().rev() {
            // SAFETY: signalling a child this process started and has not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let t = Instant::now();
        for (_, child) in &mut self.daemons {
            while matches!(child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(15) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
