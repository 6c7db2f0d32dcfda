//! The workloads of the BetrFS suite, grouped by the image they run on (see the module
//! above), and how each is timed.

use super::{disk, mount, Sample, Scale};
use crate::systems::{Disk, Kind, System};
use crate::{drop_caches, loop_stat, reap, sh, Progress};
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// What every workload of a run needs.
pub struct Ctx<'a> {
    pub sys: &'a System,
    pub run: usize,
    pub scale: &'a Scale,
    pub work: &'a Path,
    pub tarball: &'a Path,
    pub chosen: &'a [&'static str],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Data,
    Dirs,
    Toku,
    Names,
    Native,
}

impl Group {
    pub fn workloads(self) -> &'static [&'static str] {
        match self {
            Group::Data => &["seqwrite", "seqread", "randwrite"],
            Group::Dirs => &["untar", "find", "grep", "rmrf"],
            Group::Toku => &["toku1", "toku4"],
            Group::Names => &["rename", "clone", "seek"],
            Group::Native => &["native"],
        }
    }

    /// The native API exists for quiltfs's modules only.
    pub fn applies(&self, s: &System) -> bool {
        *self != Group::Native || s.is_quilt()
    }

    pub fn steps(&self, chosen: &[&str]) -> usize {
        self.workloads()
            .iter()
            .filter(|w| chosen.contains(w))
            .count()
    }
}

/// The groups that hold a chosen workload.
pub fn groups(chosen: &[&str]) -> Vec<Group> {
    [
        Group::Data,
        Group::Dirs,
        Group::Toku,
        Group::Names,
        Group::Native,
    ]
    .into_iter()
    .filter(|g| g.steps(chosen) > 0)
    .collect()
}

/// What a phase measured.
struct Measured {
    wall_s: f64,
    client_cpu_s: f64,
    fs_cpu_s: f64,
    device_write_mb: f64,
    /// FUSE requests the quiltfs server answered over the phase, by type.
    requests: Option<std::collections::BTreeMap<String, u64>>,
}

fn sectors_written(dev: &str) -> u64 {
    let name = dev.trim_start_matches("/dev/");
    std::fs::read_to_string(format!("/sys/block/{name}/stat"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(6).and_then(|x| x.parse().ok()))
        .unwrap_or(0)
}

/// CPU seconds this process has used (the workloads that run in it: its threads).
fn own_cpu() -> f64 {
    // SAFETY: rusage is plain data that getrusage fills in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// Mounts `disk` cold (the page cache dropped), runs `f` on the mount point and, when
/// `durable`, syncs and unmounts inside the timing (else after it). `f` returns the CPU
/// its child processes used (0 when it ran in this process, which is then counted).
fn phase(
    ctx: &Ctx,
    disk: &Disk,
    durable: bool,
    f: impl FnOnce(&Path) -> Result<f64>,
) -> Result<Measured> {
    let m = mount(ctx.sys, disk, ctx.work)?;
    drop_caches()?;
    let s0 = sectors_written(&disk.dev);
    let stats0 = m.counters()?;
    let (fu0, fs0) = m.fs_cpu();
    let c0 = own_cpu();
    let t = Instant::now();
    let children = f(&m.mnt)?;
    let (fu1, fs1) = m.fs_cpu();
    let mut wall_s = t.elapsed().as_secs_f64();
    let stats1;
    let fs_total = if durable {
        m.sync()?;
        // Counted before the unmount, whose own requests (FORGET, DESTROY) are the
        // same for every workload.
        stats1 = m.counters()?;
        let (fu2, fs2) = m.fs_cpu();
        let un = m.unmount()?;
        wall_s = t.elapsed().as_secs_f64();
        match un.server {
            Some(r) => r.user + r.sys - fu0 - fs0,
            None => fu2 + fs2 - fu0 - fs0,
        }
    } else {
        stats1 = m.counters()?;
        m.unmount()?;
        fu1 + fs1 - fu0 - fs0
    };
    let client_cpu_s = children + (own_cpu() - c0);
    let _ = loop_stat(&disk.dev);
    Ok(Measured {
        wall_s,
        client_cpu_s,
        fs_cpu_s: fs_total.max(0.0),
        device_write_mb: sectors_written(&disk.dev).saturating_sub(s0) as f64 * 512.0 / 1e6,
        requests: crate::request_counts(stats0.as_ref(), stats1.as_ref()),
    })
}

fn sample(
    ctx: &Ctx,
    w: &'static str,
    param: String,
    value: f64,
    unit: &'static str,
    m: &Measured,
) -> Sample {
    Sample {
        system: ctx.sys.name,
        workload: w,
        param,
        run: ctx.run,
        value,
        unit,
        wall_s: m.wall_s,
        client_cpu_s: m.client_cpu_s,
        fs_cpu_s: m.fs_cpu_s,
        device_write_mb: m.device_write_mb,
        requests: m.requests.clone(),
    }
}

/// A child process to completion (its errors into `work/workload.err`); the CPU it used.
fn child(c: &mut Command, what: &str, work: &Path) -> Result<f64> {
    let errlog = work.join("workload.err");
    let p = c
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&errlog)?)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let r = reap(&p)?;
    if !r.success() {
        bail!(
            "{what} failed (status {}): {}",
            r.status,
            crate::systems::log_tail(&errlog)
        );
    }
    Ok(r.user + r.sys)
}

/// Runs one group on a fresh image of `ctx.sys`: its samples, and what the checks after
/// it found.
pub fn run_group(g: Group, ctx: &Ctx, bar: &mut Progress) -> Result<(Vec<Sample>, Vec<String>)> {
    let mut d = disk(ctx.sys, ctx.work, ctx.scale.image_mib)?;
    let want = |w: &str| ctx.chosen.contains(&w);
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let step = |what: &str, bar: &mut Progress| {
        bar.step(format!("{what} on {} (run {})", ctx.sys.name, ctx.run + 1));
    };
    match g {
        Group::Data => {
            let bytes = ctx.scale.seq_bytes;
            // The file the reads and random writes use is written in any case.
            step("seqwrite", bar);
            let m = phase(ctx, &d, true, |mnt| {
                seq_write(&mnt.join("big"), bytes, ctx.scale.seq_io)
            })?;
            if want("seqwrite") {
                out.push(sample(
                    ctx,
                    "seqwrite",
                    String::new(),
                    bytes as f64 / 1e6 / m.wall_s,
                    "MB/s",
                    &m,
                ));
                bar.inc();
            }
            if want("seqread") {
                step("seqread", bar);
                let m = phase(ctx, &d, false, |mnt| {
                    seq_read(&mnt.join("big"), bytes, ctx.scale.seq_io)
                })?;
                out.push(sample(
                    ctx,
                    "seqread",
                    String::new(),
                    bytes as f64 / 1e6 / m.wall_s,
                    "MB/s",
                    &m,
                ));
                bar.inc();
            }
            if want("randwrite") {
                step("randwrite", bar);
                let n = ctx.scale.rand_writes;
                let m = phase(ctx, &d, true, |mnt| {
                    rand_write(&mnt.join("big"), bytes, n, ctx.run as u64)
                })?;
                out.push(sample(
                    ctx,
                    "randwrite",
                    String::new(),
                    n as f64 / m.wall_s,
                    "writes/s",
                    &m,
                ));
                bar.inc();
            }
        }
        Group::Dirs => {
            step("untar", bar);
            let tar = ctx.tarball.to_path_buf();
            let m = phase(ctx, &d, true, |mnt| {
                child(
                    Command::new("tar").arg("xf").arg(&tar).arg("-C").arg(mnt),
                    "tar",
                    ctx.work,
                )
            })?;
            if want("untar") {
                out.push(sample(ctx, "untar", String::new(), m.wall_s, "s", &m));
                bar.inc();
            }
            for (w, durable) in [("find", false), ("grep", false), ("rmrf", true)] {
                if !want(w) {
                    continue;
                }
                step(w, bar);
                let m = phase(ctx, &d, durable, |mnt| {
                    let top = mnt.join(crate::LINUX_TOP);
                    match w {
                        "find" => child(Command::new("find").arg(mnt), "find", ctx.work),
                        "grep" => {
                            // Exit 1: nothing matched, as intended (every byte is read).
                            let p = Command::new("grep")
                                .args(["-r", "-c", "quiltfs-never-matches-this"])
                                .arg(mnt)
                                .stdout(Stdio::null())
                                .stderr(Stdio::null())
                                .spawn()?;
                            let r = reap(&p)?;
                            if !libc::WIFEXITED(r.status) || libc::WEXITSTATUS(r.status) > 1 {
                                bail!("grep -r failed (status {})", r.status);
                            }
                            Ok(r.user + r.sys)
                        }
                        _ => child(Command::new("rm").arg("-rf").arg(&top), "rm -rf", ctx.work),
                    }
                })?;
                out.push(sample(ctx, w, String::new(), m.wall_s, "s", &m));
                bar.inc();
            }
        }
        Group::Toku => {
            let n = ctx.scale.toku_files;
            for (w, threads) in [("toku1", 1usize), ("toku4", 4)] {
                if !want(w) {
                    continue;
                }
                step(w, bar);
                let m = phase(ctx, &d, true, |mnt| {
                    tokubench(&mnt.join(w), n, threads).map(|()| 0.0)
                })?;
                out.push(sample(
                    ctx,
                    w,
                    String::new(),
                    n as f64 / m.wall_s,
                    "files/s",
                    &m,
                ));
                bar.inc();
            }
        }
        Group::Names => {
            let mut m = mount(ctx.sys, &d, ctx.work)?;
            let tar = ctx.tarball.to_path_buf();
            child(
                Command::new("tar")
                    .arg("xf")
                    .arg(&tar)
                    .arg("-C")
                    .arg(&m.mnt),
                "tar",
                ctx.work,
            )?;
            for &n in &ctx.scale.name_sizes {
                make_tree(&m.mnt.join(format!("n{n}")), n)?;
            }
            make_file(&m.mnt.join("file"), ctx.scale.clone_file_bytes)?;
            if want("seek") {
                make_sparse(&m.mnt.join("sparse"), ctx.scale.clone_file_bytes)?;
            }
            std::fs::create_dir_all(m.mnt.join("into"))?;
            m.sync()?;
            m.unmount()?;
            let mut params: Vec<(String, String)> = vec![(crate::LINUX_TOP.into(), "linux".into())];
            params.extend(
                ctx.scale
                    .name_sizes
                    .iter()
                    .map(|n| (format!("n{n}"), n.to_string())),
            );
            if want("rename") {
                step("rename", bar);
                m = mount(ctx.sys, &d, ctx.work)?;
                drop_caches()?;
                for (dir, label) in &params {
                    let (a, b) = (m.mnt.join(dir), m.mnt.join("into").join(dir));
                    for _ in 0..ctx.scale.latency_calls {
                        for (x, y) in [(&a, &b), (&b, &a)] {
                            let t = Instant::now();
                            std::fs::rename(x, y)
                                .with_context(|| format!("rename of {}", x.display()))?;
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            out.push(latency(ctx, "rename", label.clone(), ms));
                        }
                    }
                }
                m.unmount()?;
                bar.inc();
            }
            if want("clone") {
                step("clone", bar);
                m = mount(ctx.sys, &d, ctx.work)?;
                drop_caches()?;
                if clones(ctx.sys) {
                    for (dir, label) in &params {
                        for i in 0..ctx.scale.latency_calls {
                            let (a, b) = (m.mnt.join(dir), m.mnt.join(format!("{dir}.clone{i}")));
                            let ms = clone_tree(ctx.sys, &a, &b)?;
                            out.push(latency(ctx, "clone", label.clone(), ms));
                        }
                    }
                    if ctx.sys.is_betrfs() {
                        out.push(clone_writes(ctx, &m, &params[0].0)?);
                    }
                    for i in 0..ctx.scale.latency_calls {
                        let a = m.mnt.join("file");
                        let ms = clone_file(ctx.sys, &a, &m.mnt.join(format!("file.cp{i}")))?;
                        out.push(latency(ctx, "clone", "file-cp".into(), ms));
                        if ctx.sys.is_betrfs() {
                            let ms = clone_tree(ctx.sys, &a, &m.mnt.join(format!("file.q{i}")))?;
                            out.push(latency(ctx, "clone", "file".into(), ms));
                        }
                    }
                }
                m.unmount()?;
                bar.inc();
            }
            if want("seek") {
                step("seek", bar);
                m = mount(ctx.sys, &d, ctx.work)?;
                drop_caches()?;
                let (lat, note) = seeks(ctx, &m.mnt.join("sparse"), ctx.scale.clone_file_bytes)?;
                out.extend(lat);
                notes.extend(note);
                m.unmount()?;
                bar.inc();
            }
        }
        Group::Native => {
            step("native", bar);
            out.extend(super::native::run(ctx, &d)?);
            bar.inc();
        }
    }
    // Every system must leave a consistent file system after a clean unmount.
    let check = ctx.sys.fsck();
    let r = Command::new(&check[0])
        .args(&check[1..])
        .arg(&d.image)
        .output()?;
    if !r.status.success() {
        d.keep = true;
        bail!(
            "{} found problems after the {g:?} workloads (image kept as {}):\n{}",
            check.join(" "),
            d.image.display(),
            String::from_utf8_lossy(&r.stdout)
        );
    }
    let checker = if ctx.sys.is_betrfs() {
        "quiltfs fsck"
    } else {
        check[0].as_str()
    };
    let note = format!(
        "{}: {:?} workloads, run {}: {checker} clean",
        ctx.sys.name,
        g,
        ctx.run + 1
    );
    notes.push(note);
    Ok((out, notes))
}

/// The sparse file's layout (`make_sparse`): data, a 64 KiB hole in the middle, data,
/// and a hole of the last MiB.
fn sparse_layout(bytes: u64) -> [(u64, u64); 2] {
    let mid = bytes / 2;
    [(0, mid), (mid + (64 << 10), bytes - (1 << 20))]
}

/// A file of `bytes` with the holes of `sparse_layout`, its data in 1 MiB writes.
fn make_sparse(path: &Path, bytes: u64) -> Result<()> {
    let f = std::fs::File::create(path)?;
    let mut buf = vec![0u8; 1 << 20];
    for (from, to) in sparse_layout(bytes) {
        let mut at = from;
        while at < to {
            fill(&mut buf[..4096], at);
            let n = (to - at).min(buf.len() as u64) as usize;
            f.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
    }
    f.set_len(bytes)?;
    f.sync_all()?;
    Ok(())
}

fn lseek(fd: i32, at: u64, whence: i32) -> Result<Option<u64>> {
    // SAFETY: lseek on a descriptor this process holds open; no memory is passed.
    let r = unsafe { libc::lseek(fd, at as libc::off_t, whence) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e).context("lseek");
    }
    Ok(Some(r as u64))
}

/// SEEK_HOLE and SEEK_DATA on the sparse file, cold first: `hole` (from 0, the middle
/// hole half a file away), `data` (from that hole to the data after it) and `map`
/// (every extent, as `cp --sparse` and tar walk a file). Each call's latency; a note
/// when a system answers other than the file's layout (a file system without holes
/// may report all of it as data, which POSIX allows).
fn seeks(ctx: &Ctx, path: &Path, bytes: u64) -> Result<(Vec<Sample>, Vec<String>)> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let fd = f.as_raw_fd();
    let [(_, mid), (data2, _)] = sparse_layout(bytes);
    let mut out = Vec::new();
    let mut wrong = Vec::new();
    let mut time = |what: &'static str,
                    out: &mut Vec<Sample>,
                    f: &mut dyn FnMut() -> Result<Vec<u64>>,
                    want: Vec<u64>|
     -> Result<()> {
        let t = Instant::now();
        let got = f()?;
        out.push(latency(
            ctx,
            "seek",
            what.into(),
            t.elapsed().as_secs_f64() * 1e3,
        ));
        if got != want && !wrong.contains(&what) {
            wrong.push(what);
        }
        Ok(())
    };
    for _ in 0..ctx.scale.latency_calls {
        time(
            "hole",
            &mut out,
            &mut || Ok(lseek(fd, 0, libc::SEEK_HOLE)?.into_iter().collect()),
            vec![mid],
        )?;
        time(
            "data",
            &mut out,
            &mut || Ok(lseek(fd, mid, libc::SEEK_DATA)?.into_iter().collect()),
            vec![data2],
        )?;
        time(
            "map",
            &mut out,
            &mut || {
                let mut edges = Vec::new();
                let mut at = 0;
                while let Some(d) = lseek(fd, at, libc::SEEK_DATA)? {
                    let Some(h) = lseek(fd, d, libc::SEEK_HOLE)? else {
                        break;
                    };
                    edges.extend([d, h]);
                    at = h;
                    if edges.len() > 64 {
                        bail!("more than 32 extents in a file of 2");
                    }
                }
                Ok(edges)
            },
            vec![0, mid, data2, bytes - (1 << 20)],
        )?;
    }
    let notes = wrong
        .iter()
        .map(|w| {
            format!(
                "{}: seek `{w}` did not find the sparse file's holes",
                ctx.sys.name
            )
        })
        .collect();
    Ok((out, notes))
}

fn latency(ctx: &Ctx, w: &'static str, param: String, ms: f64) -> Sample {
    Sample {
        system: ctx.sys.name,
        workload: w,
        param,
        run: ctx.run,
        value: ms,
        unit: "ms",
        wall_s: ms / 1e3,
        client_cpu_s: 0.0,
        fs_cpu_s: 0.0,
        device_write_mb: 0.0,
        requests: None,
    }
}

/// Copy-on-abundant-write, measured: every hundredth file of a clone of the linux tree
/// rewritten whole (1% of its files), then a sync; the bytes the tree copied out of
/// shared nodes, as a share of the clone's bytes (the issue: under 5%).
fn clone_writes(ctx: &Ctx, m: &crate::systems::Mounted, dir: &str) -> Result<Sample> {
    let clone = m.mnt.join(format!("{dir}.clone0"));
    let mut files = Vec::new();
    let mut stack = vec![clone];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                files.push((e.path(), e.metadata()?.len()));
            }
        }
    }
    files.sort();
    let total: u64 = files.iter().map(|f| f.1).sum();
    m.sync()?;
    let copied = |s: &serde_json::Value| {
        s.get("tree.cow_bytes")
            .and_then(|v| v.as_u64())
            .unwrap_or(0)
    };
    let before = copied(&quilt_mountctl::stats(&m.mnt)?);
    let t = Instant::now();
    let mut rewritten = 0u64;
    for (k, (p, len)) in files.iter().step_by(100).enumerate() {
        let mut buf = vec![0u8; *len as usize];
        fill(&mut buf, k as u64 + 7);
        std::fs::write(p, &buf)?;
        rewritten += len;
    }
    m.sync()?;
    let wall = t.elapsed().as_secs_f64();
    let after = copied(&quilt_mountctl::stats(&m.mnt)?);
    let pct = 100.0 * after.saturating_sub(before) as f64 / total.max(1) as f64;
    eprintln!(
        "bench: betrfs: rewrote {} of {} files of a clone ({:.1} MB of {:.1} MB); the tree copied {:.1} MB of shared nodes ({pct:.2}% of the clone)",
        files.len().div_ceil(100),
        files.len(),
        rewritten as f64 / 1e6,
        total as f64 / 1e6,
        after.saturating_sub(before) as f64 / 1e6
    );
    Ok(Sample {
        system: ctx.sys.name,
        workload: "clone-writes",
        param: "copied".into(),
        run: ctx.run,
        value: pct,
        unit: "% of the clone",
        wall_s: wall,
        client_cpu_s: 0.0,
        fs_cpu_s: 0.0,
        device_write_mb: 0.0,
        requests: None,
    })
}

/// Whether the system clones trees and files without copying (btrfs and xfs with
/// `cp --reflink`, betrfs with `quiltfs clone`).
pub fn clones(s: &System) -> bool {
    s.is_betrfs()
        || matches!(
            s.kind,
            Kind::Kernel {
                fstype: "btrfs" | "xfs",
                ..
            }
        )
}

/// A tree's clone as a user makes it, timed whole (the process included): `quiltfs
/// clone` on betrfs, `cp -r --reflink=always` elsewhere.
fn clone_tree(s: &System, a: &Path, b: &Path) -> Result<f64> {
    let mut c = if s.is_betrfs() {
        let mut c = Command::new(crate::quiltfs_exe()?);
        c.arg("clone").arg(a).arg(b);
        c
    } else {
        let mut c = Command::new("cp");
        c.args(["-r", "--reflink=always"]).arg(a).arg(b);
        c
    };
    let t = Instant::now();
    sh(&mut c)?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// A file's clone by `cp --reflink=always` (on betrfs through libquilt_preload.so, which
/// carries FICLONE to the mount).
fn clone_file(s: &System, a: &Path, b: &Path) -> Result<f64> {
    let mut c = Command::new("cp");
    c.arg("--reflink=always").arg(a).arg(b);
    if s.is_betrfs() {
        c.env("LD_PRELOAD", crate::preload_lib()?);
    }
    let t = Instant::now();
    sh(&mut c)?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Bytes that do not compress to nothing (a pattern of the offset).
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Writes `bytes` to a new file in `io`-byte writes, then fsync.
pub fn seq_write(path: &Path, bytes: u64, io: usize) -> Result<f64> {
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; io];
    let mut done = 0u64;
    let mut k = 0;
    while done < bytes {
        fill(&mut buf[..64], k);
        let n = (bytes - done).min(io as u64) as usize;
        f.write_all(&buf[..n])?;
        done += n as u64;
        k += 1;
    }
    f.sync_all()?;
    Ok(0.0)
}

/// Reads the file in `io`-byte reads; checks its length.
fn seq_read(path: &Path, bytes: u64, io: usize) -> Result<f64> {
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; io];
    let mut got = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    if got != bytes {
        bail!("read {got} bytes of a {bytes}-byte file");
    }
    Ok(0.0)
}

/// `n` writes of 4 bytes at random offsets of the file, then fsync.
pub fn rand_write(path: &Path, bytes: u64, n: usize, seed: u64) -> Result<f64> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    let mut x = 0x2545_f491_4f6c_dd1d ^ seed;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = x % (bytes - 4);
        f.write_all_at(&(i as u32).to_le_bytes(), off)?;
    }
    f.sync_all()?;
    Ok(0.0)
}

/// Where TokuBench puts file `i`: a balanced tree of fanout 128.
pub fn toku_path(i: usize) -> (String, String) {
    (
        format!("d{}/d{}", i / (128 * 128), (i / 128) % 128),
        format!("f{i}"),
    )
}

/// TokuBench: `n` files of 200 bytes under `root`, created by `threads` threads, each
/// a contiguous share.
fn tokubench(root: &Path, n: usize, threads: usize) -> Result<()> {
    std::fs::create_dir_all(root)?;
    let data = [b'x'; 200];
    let per = n.div_ceil(threads);
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    let mut made = String::new();
                    for i in t * per..((t + 1) * per).min(n) {
                        let (dir, name) = toku_path(i);
                        if dir != made {
                            std::fs::create_dir_all(root.join(&dir))?;
                            made = dir.clone();
                        }
                        let p = root.join(&dir).join(&name);
                        let mut f = std::fs::OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .open(&p)?;
                        f.write_all(&data)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("a TokuBench thread panicked"))??;
        }
        Ok(())
    })
}

/// A tree of `n` files of 100 bytes, in subdirectories of 100 (flat when `n <= 100`).
fn make_tree(root: &Path, n: usize) -> Result<()> {
    std::fs::create_dir_all(root)?;
    for i in 0..n {
        let dir = if n <= 100 {
            root.to_path_buf()
        } else {
            root.join(format!("s{}", i / 100))
        };
        if i % 100 == 0 {
            std::fs::create_dir_all(&dir)?;
        }
        let mut buf = [0u8; 100];
        fill(&mut buf, i as u64);
        std::fs::write(dir.join(format!("f{i}")), buf)?;
    }
    Ok(())
}

/// A file of `bytes`, written in 1 MiB pieces.
fn make_file(path: &Path, bytes: u64) -> Result<()> {
    let mut f = std::fs::File::create(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < bytes {
        fill(&mut buf[..4096], done);
        let n = (bytes - done).min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        done += n as u64;
    }
    Ok(())
}
